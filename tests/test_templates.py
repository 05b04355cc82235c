"""Loss masks under the chat-template families that real targets ship, each reproduced by a
minimal template written here with the family's mechanism:

  smol      {% generation %} marks that also wrap the header and the newline after <|im_end|>;
            enable_thinking=false puts an empty think block in the generation prompt and every turn
  nemo      no assistant header, add_generation_prompt ignored, the system prompt inside the last
            user turn, tool calls as `function | tojson` with 9-character ids, tool results by id
  harmony   per-turn end tokens (<|end|>, <|return|> for the last turn, <|call|>), channel headers,
            reasoning in an analysis channel read from `thinking` and dropped from earlier turns,
            one tool call per turn, tool turns named after the last call
  qwen25    a default system prompt when the row has none; `arguments | tojson` (an object)
  qwen3     reasoning_content, dropped before the last user turn; tool calls with string or object
            arguments; tool results merged into a user turn; enable_thinking
  thinking  Qwen3-4B-Thinking-2507: qwen3's turns, a generation prompt that ends in <think>\n, the
            tools in a system block
  llama31   header tokens; one tool call with `arguments | tojson` (an object), ipython results
  deepseek  a generation prompt that opens a think block the render never holds; reasoning read
            from no field; tool calls built by string concatenation (string arguments)
  gemma     a refused system role, roles that must alternate, `model` turns
  phi       <|assistant|> headers, <|end|> endings

Ground truth never comes from data.py: each generated field holds a sentinel string, the test
writes by hand what the target generates around it, locates that text in the render and maps it
to tokens by the tokenizer's offsets."""
import json

import pytest

from harness import data, tiny_world

# -----------------------------------------------------------------------------
# the templates

SMOL = (
    "{%- set think = enable_thinking is not defined or enable_thinking -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{% generation %}{{- '<|im_start|>assistant\\n' + ('' if think else '<think>\\n\\n</think>\\n') + m.content"
    " + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' + ('' if think else '<think>\\n\\n</think>\\n')"
    " -}}{%- endif -%}")
NEMO = (
    "{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{{- '<s>' -}}{%- for m in loop_messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- if loop.last and system is defined -%}{{- '[INST]' + system + '\\n\\n' + m.content + '[/INST]' -}}"
    "{%- else -%}{{- '[INST]' + m.content + '[/INST]' -}}{%- endif -%}"
    "{%- elif m.tool_calls is defined -%}{{- '[TOOL_CALLS][' -}}{%- for c in m.tool_calls -%}"
    "{%- if c.id is not defined or c.id | length != 9 -%}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}{%- endif -%}"
    "{{- (c.function | tojson)[:-1] + ', \"id\": \"' + c.id + '\"}' + (', ' if not loop.last else ']') -}}"
    "{%- endfor -%}{{- '</s>' -}}"
    "{%- elif m.role == 'assistant' -%}{{- m.content + '</s>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + m.content + ', \"call_id\": \"' + m.tool_call_id + '\"}[/TOOL_RESULTS]' -}}"
    "{%- else -%}{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') -}}{%- endif -%}{%- endfor -%}")
HARMONY = (
    "{{- '<|start|>system<|message|>Reasoning: medium<|end|>' -}}"
    "{%- if messages[0].role == 'system' -%}{%- set loop_messages = messages[1:] -%}"
    "{{- '<|start|>developer<|message|>' + messages[0].content + '<|end|>' -}}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in loop_messages -%}{%- if m.role == 'assistant' -%}"
    "{%- if '<|channel|>' in m.content -%}{{- raise_exception('You have passed a message containing <|channel|> "
    "tags in the content field.') -}}{%- endif -%}"
    "{%- if 'tool_calls' in m -%}"
    "{%- set future = namespace(final=false) -%}{%- for f in loop_messages[loop.index:] -%}"
    "{%- if f.role == 'assistant' and 'tool_calls' not in f -%}{%- set future.final = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set call = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] -%}"
    "{%- if m.thinking and not future.final -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}{%- endif -%}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>'"
    " + call.arguments | tojson + '<|call|>' -}}{%- set last.name = call.name -%}"
    "{%- elif loop.last and not add_generation_prompt -%}"
    "{%- if 'thinking' in m -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}"
    "{%- endif -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}{%- if last.name is none -%}{{- raise_exception('Message has tool role, but "
    "there was no previous assistant message with a tool call!') -}}{%- endif -%}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + m.content | tojson"
    " + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}")
QWEN25 = (
    "{%- if messages[0].role != 'system' -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' + ('\\n' + m.content if m.content else '') -}}"
    "{%- for c in m.tool_calls or [] -%}{%- set c = c.function if c.function is defined else c -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + c.arguments | tojson + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' and not m.content.startswith('<tool_response>') -%}"
    "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{%- set content = m.content -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- else -%}{%- set reasoning = '' -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{%- set c = c.function if c.function is defined else c -%}"
    "{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": '"
    " + (c.arguments if c.arguments is string else c.arguments | tojson) + '}\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- ('<|im_start|>user' if loop.first or messages[loop.index0 - 1].role != 'tool' else '')"
    " + '\\n<tool_response>\\n' + m.content + '\\n</tool_response>'"
    " + ('<|im_end|>\\n' if loop.last or messages[loop.index0 + 1].role != 'tool' else '') -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}")
THINKING = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if messages[0].role == 'system'"
    " else '') + '# Tools\\n<tools>' -}}{%- for t in tools -%}{{- '\\n' + t | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(multi_step_tool=true, last_query=messages | length - 1) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- if ns.multi_step_tool and m.role == 'user' and not m.content.startswith('<tool_response>') -%}"
    "{%- set ns.multi_step_tool = false -%}{%- set ns.last_query = messages | length - 1 - loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{%- set c = c.function if c.function is defined else c -%}"
    "{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": '"
    " + (c.arguments if c.arguments is string else c.arguments | tojson) + '}\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- ('<|im_start|>user' if loop.first or messages[loop.index0 - 1].role != 'tool' else '')"
    " + '\\n<tool_response>\\n' + m.content + '\\n</tool_response>'"
    " + ('<|im_end|>\\n' if loop.last or messages[loop.index0 + 1].role != 'tool' else '') -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}")
LLAMA31 = (
    "{{- '<|begin_of_text|>' -}}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined -%}"
    "{%- if m.tool_calls | length != 1 -%}{{- raise_exception('This model only supports single tool-calls at "
    "once!') -}}{%- endif -%}{%- set c = m.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + c.name + '\", \"parameters\": '"
    " + c.arguments | tojson + '}<|eot_id|>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}")
DEEPSEEK = (
    "{{- '<｜begin▁of▁sentence｜>' -}}{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content.split('</think>')[-1] if '</think>' in m.content else m.content -%}"
    "{{- '<｜Assistant｜>' + content -}}{%- for c in m.tool_calls or [] -%}"
    "{{- '<｜tool▁call▁begin｜>' + c.function.name + '\\n```json\\n' + c.function.arguments"
    " + '\\n```<｜tool▁call▁end｜>' -}}{%- endfor -%}{{- '<｜end▁of▁sentence｜>' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}")
GEMMA = (
    "{{- '<bos>' -}}{%- if messages[0].role == 'system' -%}{{- raise_exception('System role not supported') -}}"
    "{%- endif -%}{%- for m in messages -%}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + m.content | trim"
    " + '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")
PHI = ("{%- for m in messages -%}{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}{%- endfor -%}"
       "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")

FAMILIES = {  # template, special tokens, plain added tokens (as the real tokenizers have them)
    "smol": (SMOL, [], ["<think>", "</think>"]),
    "nemo": (NEMO, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
    "harmony": (HARMONY, ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>"], []),
    "qwen25": (QWEN25, [], ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "qwen3": (QWEN3, [], ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                          "</tool_response>"]),
    "thinking": (THINKING, [], ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                "</tool_response>"]),
    "llama31": (LLAMA31, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], []),
    "deepseek": (DEEPSEEK, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁output▁begin｜>",
                            "<｜tool▁output▁end｜>"], ["<think>", "</think>"]),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"], []),
    "phi": (PHI, ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"], []),
}


def tokenizer_for(family):
    template, special, plain = FAMILIES[family]
    tokenizer = tiny_world.build_tiny_tokenizer(template)
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.add_tokens(plain)
    return tokenizer


# -----------------------------------------------------------------------------
# conversations: every generated field holds a sentinel «..»; `want` is what the target generates

S = lambda text: {"role": "system", "content": text}
U = lambda text: {"role": "user", "content": text}
A = lambda text, **fields: {"role": "assistant", "content": text, **fields}
T = lambda text, **fields: {"role": "tool", "content": text, **fields}


def call(name, arguments, id="abc123def"):
    return {"type": "function", "id": id, "function": {"name": name, "arguments": arguments}}


ARGS = {"city": "«x1»"}
CASES = {  # (family, case): (messages, template kwargs, tools, the trained text of each assistant turn)
    ("smol", "multi, system, trailing user"): (
        [S("«s»"), U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»"), U("«u3»")], {}, None,
        ["«c1»<|im_end|>", "«c2»<|im_end|>"]),
    ("smol", "thinking off"): (
        [U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»")], {"enable_thinking": False}, None,
        ["«c1»<|im_end|>", "«c2»<|im_end|>"]),
    ("nemo", "single"): ([U("«u1»"), A("«c1»")], {}, None, ["«c1»</s>"]),
    ("nemo", "system, multi"): (  # the system prompt sits in the prompt's last user turn, nowhere in the row
        [S("«s»"), U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»")], {}, None, ["«c1»</s>", "«c2»</s>"]),
    ("nemo", "system, trailing user"): (
        [S("«s»"), U("«u1»"), A("«c1»"), U("«u2»")], {}, None, ["«c1»</s>"]),
    ("nemo", "tools, string arguments"): (
        [U("«u1»"), A("", tool_calls=[call("get", json.dumps(ARGS))]), T("«t1»", tool_call_id="abc123def"),
         A("«c2»")], {}, None,
        ['[TOOL_CALLS][{"name": "get", "arguments": {"city": "«x1»"}, "id": "abc123def"}]</s>', "«c2»</s>"]),
    ("harmony", "single"): ([U("«u1»"), A("«c1»")], {}, None, ["<|channel|>final<|message|>«c1»<|return|>"]),
    ("harmony", "system, multi, reasoning"): (
        [S("«s»"), U("«u1»"), A("«c1»", reasoning_content="«r1»"), U("«u2»"), A("«c2»", reasoning_content="«r2»")],
        {}, None, ["<|channel|>final<|message|>«c1»<|end|>", "<|channel|>analysis<|message|>«r2»<|end|>"
                   "<|start|>assistant<|channel|>final<|message|>«c2»<|return|>"]),
    ("harmony", "tools"): (
        [U("«u1»"), A("", thinking="«r1»", tool_calls=[call("get", json.dumps(ARGS))]), T("«t1»"),
         A("«c2»", thinking="«r2»")], {}, [{"type": "function", "function": {"name": "get"}}],
        [' to=functions.get<|channel|>commentary json<|message|>{"city": "«x1»"}<|call|>',
         "<|channel|>analysis<|message|>«r2»<|end|><|start|>assistant<|channel|>final<|message|>«c2»<|return|>"]),
    ("harmony", "tool call last, trailing user"): (
        [U("«u1»"), A("«c1»"), U("«u2»"), A("", thinking="«r2»", tool_calls=[call("get", ARGS)]), T("«t2»"),
         U("«u3»")], {}, None,
        ["<|channel|>final<|message|>«c1»<|end|>", "<|channel|>analysis<|message|>«r2»<|end|><|start|>assistant"
         ' to=functions.get<|channel|>commentary json<|message|>{"city": "«x1»"}<|call|>']),
    ("qwen25", "default system, tools"): (
        [U("«u1»"), A("", tool_calls=[call("get", json.dumps(ARGS))]), T("«t1»"), A("«c2»"), U("«u3»")], {}, None,
        ['<tool_call>\n{"name": "get", "arguments": {"city": "«x1»"}}\n</tool_call><|im_end|>', "«c2»<|im_end|>"]),
    ("qwen25", "system, multi"): (
        [S("«s»"), U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»")], {}, None, ["«c1»<|im_end|>", "«c2»<|im_end|>"]),
    ("qwen3", "reasoning, tools"): (
        [S("«s»"), U("«u1»"), A("«c1»", reasoning_content="«r1»"), U("«u2»"),
         A("", reasoning_content="«r2»", tool_calls=[call("get", ARGS), call("put", '{"k":"«x2»"}')]),
         T("«t1»"), T("«t2»"), A("«c3»", reasoning_content="«r3»")], {}, None,
        ["«c1»<|im_end|>",
         '<think>\n«r2»\n</think>\n\n<tool_call>\n{"name": "get", "arguments": {"city": "«x1»"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "put", "arguments": {"k":"«x2»"}}\n</tool_call><|im_end|>',
         "<think>\n«r3»\n</think>\n\n«c3»<|im_end|>"]),
    ("qwen3", "thinking off, trailing user"): (
        [U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»"), U("«u3»")], {"enable_thinking": False}, None,
        ["«c1»<|im_end|>", "«c2»<|im_end|>"]),
    ("qwen3", "thinking on, last turn without reasoning"): (
        [U("«u1»"), A("«c1»")], {}, None, ["<think>\n\n</think>\n\n«c1»<|im_end|>"]),
    ("qwen3", "two assistant turns in a row"): (  # the second one's header is prompt
        [U("«u1»"), A("«c1»"), A("«c2»", reasoning_content="«r2»"), A("«c3»")], {}, None,
        ["«c1»<|im_end|>", "<think>\n«r2»\n</think>\n\n«c2»<|im_end|>", "<think>\n\n</think>\n\n«c3»<|im_end|>"]),
    ("thinking", "reasoning, tools"): (  # the generation prompt holds <think>\n, so every turn starts after it
        [S("«s»"), U("«u1»"), A("«c1»", reasoning_content="«r1»"), U("«u2»"),
         A("", reasoning_content="«r2»", tool_calls=[call("get", ARGS)]), T("«t1»"), A("«c3»", reasoning_content="«r3»")],
        {}, [{"type": "function", "function": {"name": "get"}}],
        ["«c1»<|im_end|>",
         '«r2»\n</think>\n\n<tool_call>\n{"name": "get", "arguments": {"city": "«x1»"}}\n</tool_call><|im_end|>',
         "«r3»\n</think>\n\n«c3»<|im_end|>"]),
    ("thinking", "two assistant turns in a row"): (
        [U("«u1»"), A("«c1»"), A("", reasoning_content="«r2»", tool_calls=[call("get", ARGS)]), A("«c3»")], {}, None,
        ["«c1»<|im_end|>",
         '«r2»\n</think>\n\n<tool_call>\n{"name": "get", "arguments": {"city": "«x1»"}}\n</tool_call><|im_end|>',
         "\n</think>\n\n«c3»<|im_end|>"]),
    ("thinking", "reasoning in content, tool call"): (  # the generation prompt's <think>\n is prompt in both turns
        [U("what is the weather?"), A("<think>\nI should call the tool.\n</think>\n\n",
                                      tool_calls=[call("get_weather", ARGS)]),
         T("sunny"), A("<think>\nIt is sunny.\n</think>\n\nIt is sunny.")], {}, None,
        ['I should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "«x1»"}}\n'
         '</tool_call><|im_end|>', "It is sunny.\n</think>\n\nIt is sunny.<|im_end|>"]),
    ("thinking", "reasoning in content, tool call, tools"): (
        [U("what is the weather?"), A("<think>\nI should call the tool.\n</think>\n\n",
                                      tool_calls=[call("get_weather", ARGS)]),
         T("sunny"), A("<think>\nIt is sunny.\n</think>\n\nIt is sunny.")], {},
        [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": {"type": "string"}}}}],
        ['I should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "«x1»"}}\n'
         '</tool_call><|im_end|>', "It is sunny.\n</think>\n\nIt is sunny.<|im_end|>"]),
    ("llama31", "system, tools"): (
        [S("«s»"), U("«u1»"), A("", tool_calls=[call("get", json.dumps(ARGS))]), T("«t1»"), A("«c2»"), U("«u3»")],
        {}, None, ['{"name": "get", "parameters": {"city": "«x1»"}}<|eot_id|>', "«c2»<|eot_id|>"]),
    ("deepseek", "reasoning, tools"): (
        [S("«s»"), U("«u1»"), A("«c1»", reasoning_content="«r1»"), U("«u2»"), A("", tool_calls=[call("get", ARGS)]),
         T("«t1»"), A("<think>\n«r3»\n</think>\n\n«c3»")], {}, None,
        ["«c1»<｜end▁of▁sentence｜>",
         '<｜tool▁call▁begin｜>get\n```json\n{"city": "«x1»"}\n```<｜tool▁call▁end｜><｜end▁of▁sentence｜>',
         "\n\n«c3»<｜end▁of▁sentence｜>"]),
    ("gemma", "multi, trailing user"): (
        [U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»"), U("«u3»")], {}, None,
        ["«c1»<end_of_turn>", "«c2»<end_of_turn>"]),
    ("phi", "system, multi, tool"): (
        [S("«s»"), U("«u1»"), A("«c1»"), T("«t1»"), A("«c2»")], {}, None, ["«c1»<|end|>", "«c2»<|end|>"]),
}


def expected_mask(tokenizer, ids, want):
    """The ground truth: each wanted text located in order in the decoded row; a token is trained
    when its offsets overlap one."""
    text = tokenizer.decode(ids)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == list(ids), "the row does not decode and re-encode to itself"
    spans, at = [], 0
    for w in want:
        k = text.find(w, at)
        assert k >= 0, f"{w!r} is not in the render after character {at}:\n{text!r}"
        spans.append((k, k + len(w)))
        at = k + len(w)
    return [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]


def runs(tokenizer, ids, mask):
    """The trained text, one string per run of trained tokens."""
    out, run = [], []
    for i, m in zip(list(ids) + [None], list(mask) + [0]):
        if m:
            run.append(i)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out


@pytest.mark.parametrize("family, case", list(CASES))
def test_trained_tokens_are_what_the_target_generates(family, case):
    messages, kwargs, tools, want = CASES[family, case]
    tokenizer = tokenizer_for(family)
    ids, mask = data.assistant_tokens(tokenizer, messages, kwargs, tools)
    assert mask == expected_mask(tokenizer, ids, want), \
        f"{family}, {case}: trained\n{runs(tokenizer, ids, mask)}\nexpected\n{want}"


def as_file_row(messages, tools, n):
    """Row n of a file: every other row in ShareGPT's from/value, every third with list-of-parts content."""
    out = []
    for m in messages:
        m = dict(m)
        if n % 3 == 1:
            m["content"] = [{"type": "text", "text": m["content"]}]
        if n % 2:
            m = {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                 "value": m.pop("content"), **{k: v for k, v in m.items() if k != "role"}}
        out.append(m)
    return {("conversations" if n % 2 else "messages"): out, **({"tools": tools} if tools else {})}


@pytest.mark.parametrize("family", sorted({f for f, _ in CASES}))
def test_the_file_path_trains_the_same_tokens(family, tmp_path):
    cases = [c for (f, _), c in CASES.items() if f == family]
    tokenizer, logs = tokenizer_for(family), []
    for kwargs in {json.dumps(c[1]) for c in cases}:
        group = [c for c in cases if json.dumps(c[1]) == kwargs] * 2  # each case as OpenAI and ShareGPT rows
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(as_file_row(m, t, n)) + "\n" for n, (m, _, t, _) in enumerate(group)))
        rows = data.load_rows(str(path), "train", tokenizer, 4096, template_kwargs=json.loads(kwargs), log=logs.append)
        assert len(rows) == len(group), f"{family}: {len(rows)} rows of {len(group)} survived: {logs}"
        for n, (row, (_, _, _, want)) in enumerate(zip(rows, group)):
            ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
            assert mask == expected_mask(tokenizer, ids, want), \
                f"{family}, row {n}: trained\n{runs(tokenizer, ids, mask)}\nexpected\n{want}"


# -----------------------------------------------------------------------------
# rows a template cannot render, and what it drops

REFUSED = {  # family: (messages, the error names)
    "gemma": ([S("«s»"), U("«u1»"), A("«c1»")], "chat template: System role not supported"),
    "nemo": ([U("«u1»"), A("", tool_calls=[call("get", ARGS, id="call_1")]), T("«t»", tool_call_id="call_1")],
             "chat template: Tool call IDs should be alphanumeric strings with length 9!"),
    "llama31": ([U("«u1»"), A("", tool_calls=[call("get", ARGS), call("put", ARGS)])],
                "chat template: This model only supports single tool-calls at once!"),
    "harmony": ([U("«u1»"), A("", tool_calls=[call("get", ARGS), call("put", ARGS)])],
                "chat template: messages[1].tool_calls[1] (put): the chat template does not render this tool call"),
    "phi": ([U("«u1»"), A("", tool_calls=[call("get", ARGS)])],
            "chat template: messages[1].tool_calls[0] (get): the chat template does not render this tool call"),
}


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_row_the_template_cannot_render_is_named_with_its_message(family, tmp_path):
    messages, match = REFUSED[family]
    tokenizer, good = tokenizer_for(family), [U("«u»"), A("«c» a longer answer")]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, messages, good)))
    with pytest.raises(ValueError) as e:
        data.load_rows(str(path), "train", tokenizer, 512)
    assert f"r.jsonl: line 2: {match}" in str(e.value), f"{family}: {e.value}"
    logs = []
    rows = data.load_rows(str(path), "train", tokenizer, 512, drop_bad=True, log=logs.append)
    message = match.removeprefix("chat template: ")
    assert len(rows) == 2 and any("dropped 1 of 3 rows the chat template rejects" in l and message in l
                                  for l in logs), (len(rows), logs)


def test_reasoning_a_template_drops_is_counted(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [{"messages": [U("u1"), A("c1", reasoning_content="r1"), U("u2"), A("c2", reasoning_content="r2")]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for family, dropped in (("qwen3", 1), ("deepseek", 2), ("harmony", 1)):  # earlier turns; everywhere; earlier
        logs = []
        data.load_rows(str(path), "train", tokenizer_for(family), 512, log=logs.append)
        want = f"{dropped} of 2 assistant turns with reasoning are trained without it"
        assert any(want in l for l in logs), f"{family}: expected {want!r} in {logs}"


def test_template_facts_read_each_mechanism():
    got = {f: data.template_facts(tokenizer_for(f)) for f in ("nemo", "harmony", "qwen3", "llama31", "deepseek")}
    ends = {f: sorted(tokenizer_for(f).convert_ids_to_tokens(sorted(facts["ends"]))) for f, facts in got.items()}
    assert ends["harmony"] == ["<|call|>", "<|end|>", "<|return|>"], ends
    assert ends["nemo"] == ["</s>"] and ends["llama31"] == ["<|eot_id|>"], ends
    arguments = {f: facts["arguments"] for f, facts in got.items()}
    assert arguments == {"nemo": "object", "harmony": "object", "qwen3": None, "llama31": "object",
                         "deepseek": "string"}, arguments
    reasoning = {f: facts["reasoning"] for f, facts in got.items()}
    assert reasoning["harmony"] == ("thinking",) and reasoning["qwen3"] == ("reasoning_content",) \
        and reasoning["deepseek"] == (), reasoning


def test_generation_marks_narrow_the_mask_and_never_widen_it():
    content_only = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
                    "{% generation %}{{- m.content -}}{% endgeneration %}{{- '<|im_end|>\\n' -}}"
                    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
                    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    tokenizer = tiny_world.build_tiny_tokenizer(content_only)
    ids, mask = data.assistant_tokens(tokenizer, [U("«u1»"), A("«c1»"), U("«u2»"), A("«c2»")])
    assert mask == expected_mask(tokenizer, ids, ["«c1»", "«c2»"]), runs(tokenizer, ids, mask)


def test_reasoning_reaches_a_template_under_the_name_it_reads():
    """transformers itself copies any of the three names into reasoning_content and thinking, so
    only a template that reads `reasoning` shows whether data.py passes the name the template reads."""
    reads_reasoning = (
        "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if m.reasoning -%}{{- '<think>' + m.reasoning + '</think>' -}}{%- endif -%}"
        "{{- m.content + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    tokenizer = tiny_world.build_tiny_tokenizer(reads_reasoning)
    tokenizer.add_tokens(["<think>", "</think>"])
    for field in data.REASONING:
        ids, mask = data.assistant_tokens(tokenizer, [U("q"), A("answer", **{field: "why"})])
        assert runs(tokenizer, ids, mask) == ["<think>why</think>answer<|im_end|>"], \
            f"a row holding {field!r}: trained {runs(tokenizer, ids, mask)}"
