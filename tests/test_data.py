"""Tests of harness/data.py: reading chat files, assistant masks, training rows, their order in a run, the flags it
declares.
Tiny random targets and byte-level tokenizers built on the spot; no downloads, CPU only."""
import json
import random
import re

import datasets
import pytest
import torch

import train
from harness import data, target, tiny_world

# -----------------------------------------------------------------------------
# assistant masks: templates that reproduce the common families

CHATML_PLAIN = re.sub(r"{% (end)?generation %}", "", tiny_world.CHATML)  # ChatML as most models ship it: no marks
QWEN3_STYLE = (  # Qwen3's rules: reasoning dropped before the last user turn, a think block after it
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
LLAMA3_STYLE = ("{{- '<|begin_of_text|>' }}{%- for m in messages %}"
                "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
                "{%- endfor %}"
                "{%- if add_generation_prompt %}"
                "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MISTRAL_STYLE = (  # the system prompt goes into the last user turn: earlier renders differ from the full one
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<s>' }}{%- for m in loop_messages %}{%- if m.role == 'user' %}"
    "{%- if (loop.last or loop_messages|length - loop.index0 == 2) and system is defined %}"
    "{{- '[INST] ' + system + '\\n\\n' + m.content + '[/INST]' }}{%- else %}{{- '[INST] ' + m.content + '[/INST]' }}"
    "{%- endif %}{%- elif m.role == 'assistant' %}{{- ' ' + m.content + eos_token }}{%- endif %}{%- endfor %}")
TEMPLATES = {"chatml-generation-marks": tiny_world.CHATML, "chatml": CHATML_PLAIN, "qwen3": QWEN3_STYLE, "llama3": LLAMA3_STYLE,
             "mistral": MISTRAL_STYLE}
EOT = {"llama3": "<|eot_id|>"}


def tokenizer_for(name):
    tokenizer = tiny_world.build_tiny_tokenizer(TEMPLATES[name])
    if name == "qwen3":  # added, not special, as in Qwen3's tokenizer
        tokenizer.add_tokens(["<think>", "</think>"])
    if name == "llama3":
        tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                             special_tokens=True)
    return tokenizer


def loss_spans(tokenizer, messages, **kw):
    """The loss tokens as text, one string per contiguous run."""
    ids, mask = data.assistant_tokens(tokenizer, messages, kw or None)
    assert len(ids) == len(mask), f"{len(ids)} ids but {len(mask)} mask entries"
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    return runs + ([tokenizer.decode(run)] if run else [])


MULTI = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
         {"role": "assistant", "content": "a2"}, {"role": "tool", "content": "t"},
         {"role": "assistant", "content": "a3"}, {"role": "user", "content": "trailing user turn"}]


@pytest.mark.parametrize("name", ["chatml-generation-marks", "chatml", "llama3", "mistral"])
def test_every_assistant_turn_and_nothing_else_is_trained(name):
    eot = EOT.get(name, "<|im_end|>")
    got = loss_spans(tokenizer_for(name), MULTI)
    want = [f"a1{eot}", f"a2{eot}", f"a3{eot}"]
    if name == "mistral":  # no generation prompt: the space before an answer is the target's; the tool turn
        want = [f" a1{eot}", f" a2{eot} a3{eot}"]  # is not rendered, so turns a2 and a3 touch
    assert got == want, f"{name}: loss text {got}, expected each assistant turn + its end-of-turn token {want}"


def test_qwen3_style_trains_the_text_the_template_renders():
    tokenizer = tokenizer_for("qwen3")
    chat = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "<think>r2</think>a2"},
            {"role": "tool", "content": "t"}, {"role": "assistant", "content": "a3"}]
    got = loss_spans(tokenizer, chat)
    # turn 1 is before the last user turn: its reasoning is not rendered, so not trained; turns 2 and 3
    # follow it: turn 2 keeps its reasoning, turn 3 (last) gets an empty think block, both trained
    want = ["a1<|im_end|>", "<think>\nr2\n</think>\n\na2<|im_end|>", "<think>\n\n</think>\n\na3<|im_end|>"]
    assert got == want, f"loss text {got}, expected {want}"
    no_think = loss_spans(tokenizer, chat[:2] + [{"role": "user", "content": "u2"},
                                                 {"role": "assistant", "content": "a2"}], enable_thinking=False)
    # enable_thinking=false: the generation prompt holds the empty think block, so it is prompt, not loss
    assert no_think == ["a1<|im_end|>", "a2<|im_end|>"], f"loss text with enable_thinking=false: {no_think}"


def test_a_template_without_an_end_of_turn_token_is_refused():
    tokenizer = tiny_world.build_tiny_tokenizer("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}")
    with pytest.raises(ValueError, match=r"the chat template writes '\\n' after an assistant turn, no special token"):
        data.assistant_tokens(tokenizer, MULTI)


def random_conversation(rng, name):
    """system?, then user/assistant exchanges with tool turns, maybe a trailing user turn;
    contents mix words, whitespace at both ends, newlines and non-ASCII."""
    words = ["def", "x", " ", "\n", "  ", "é", "日本", "<", ">", "|", "{", "}", "'", "\\", "think", "\t"]
    text = lambda: "".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))
    chat = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randrange(1, 5)):
        chat.append({"role": "user", "content": text()})
        if rng.random() < 0.3:
            chat += [{"role": "assistant", "content": text()}, {"role": "tool", "content": text()}]
        reasoning = name == "qwen3" and rng.random() < 0.5
        chat.append({"role": "assistant", "content": (f"<think>{text()}</think>" if reasoning else "") + text()})
    return chat + ([{"role": "user", "content": text()}] if rng.random() < 0.3 else [])


def rendered_answers(chat, name):
    """What each family's template writes for each assistant turn, between header and end-of-turn."""
    if name == "llama3":
        return [m["content"].strip() for m in chat if m["role"] == "assistant"]
    if name == "mistral":  # the target writes the space before its answer: no generation prompt holds it
        return [" " + m["content"] for m in chat if m["role"] == "assistant"]
    if name != "qwen3":
        return [m["content"] for m in chat if m["role"] == "assistant"]
    last_user = max(i for i, m in enumerate(chat) if m["role"] == "user")
    out = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            reasoning, answer = "", m["content"]
            if "</think>" in answer:
                reasoning = answer.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                answer = answer.split("</think>")[-1].lstrip("\n")
            if i > last_user and (i == len(chat) - 1 or reasoning):
                answer = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n")
            out.append(answer)
    return out


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_property_loss_tokens_decode_to_the_rendered_answers(name):
    tokenizer, rng = tokenizer_for(name), random.Random(0)
    eot = EOT.get(name, "<|im_end|>")
    for trial in range(40):
        chat = random_conversation(rng, name)
        ids, mask = data.assistant_tokens(tokenizer, chat)
        got = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        want = "".join(a + eot for a in rendered_answers(chat, name))
        assert got == want, f"{name}, conversation {trial} {chat}:\nloss text {got!r}\nexpected  {want!r}"


# -----------------------------------------------------------------------------
# reading conversations: formats and bad input

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def call(arguments, name="f"):
    return {"type": "function", "id": "abcdefghi", "function": {"name": name, "arguments": arguments}}


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_reads_every_format_and_shape(tmp_path):
    import pyarrow
    import pyarrow.parquet
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}, {"from": "model", "value": "again"}]}
    openai_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": "c"}, {"role": "tool", "content": "d"}]}
    want = [CHAT, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": "again"}],
            [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"},
             {"role": "tool", "content": "d"}]]
    rows = [{"messages": CHAT}, sharegpt, openai_parts]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=1))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"messages": CHAT}] * 2), tmp_path / "p.parquet")
    for path, expected in ((write(tmp_path / "l.jsonl", rows + [""]), want), (str(tmp_path / "a.json"), want),
                           (write(tmp_path / "l.json", rows), want), (str(tmp_path / "p.parquet"), [CHAT] * 2)):
        got = data.read_conversations(path)
        assert got == expected, f"{path}: read\n{got}\nexpected\n{expected}"


BAD = {  # name: (file name, rows, the message must contain)
    "empty file": ("e.jsonl", None, "e.jsonl: empty file"),
    "blank lines only": ("b.jsonl", ["", "  "], "b.jsonl: empty file"),
    "malformed line": ("m.jsonl", [{"messages": CHAT}, {"messages": CHAT}, '{"messages": [', {"messages": CHAT}],
                       "m.jsonl: line 3: invalid JSON"),
    "malformed array": ("a.json", '[{"messages": []},\n {"messages": ]}]', "a.json: line 2: invalid JSON"),
    "csv": ("d.csv", ["messages", "hi"], "d.csv: unsupported file type '.csv'"),
    "missing messages": ("n.jsonl", [{"messages": CHAT}, {"text": "hi", "id": 1}],
                         "n.jsonl: line 2: no 'messages' or 'conversations' field (fields: text, id)"),
    "messages not a list": ("s.jsonl", [{"messages": "hi"}], "s.jsonl: line 1: messages: expected a list"),
    "not an object": ("o.jsonl", ["[1, 2]"], "o.jsonl: line 1: expected an object with 'messages', got list"),
    "missing content": ("c.jsonl", [{"messages": [CHAT[0], {"role": "assistant"}]}],
                        "c.jsonl: line 1: messages[1].content: missing"),
    "missing role": ("r.jsonl", [{"messages": [{"content": "hi"}, CHAT[1]]}],
                     "r.jsonl: line 1: messages[0]: no 'role'"),
    "unknown role": ("u.jsonl", [{"messages": CHAT}, {"conversations": [{"from": "bot", "value": "x"}, CHAT[1]]}],
                     "u.jsonl: line 2: conversations[0].role: unknown role 'bot'"),
    "image part": ("i.jsonl", [{"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}, CHAT[1]]}],
                   "i.jsonl: line 1: messages[0].content[1]: a 'image_url' part"),
    "content not text": ("t.jsonl", [{"messages": [{"role": "user", "content": 3}, CHAT[1]]}],
                         "t.jsonl: line 1: messages[0].content: expected a string or a list of text parts, got int"),
    "not utf-8": ("8.jsonl", b'{"messages": []}\n{"messages": "caf\xe9"}\n', "8.jsonl: line 2: not UTF-8 text"),
    "no assistant turn": ("q.jsonl", [{"messages": CHAT}, {"messages": CHAT[:1]}],
                          "q.jsonl: line 2: messages: no assistant turn (roles: user)"),
    "tool_calls not a list": ("tc.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": {"name": "f"}}]}],
                              "tc.jsonl: line 1: messages[1].tool_calls: expected a list of tool calls, got dict"),
    "arguments not an object": ("ta.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": [call(3)]}]}],
                                "ta.jsonl: line 1: messages[1].tool_calls[0].function.arguments: expected an object "
                                "or a string holding a JSON object, got int"),
    "arguments a JSON list": ("tl.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": [call("[1]")]}]}],
                              "tl.jsonl: line 1: messages[1].tool_calls[0].function.arguments: a JSON list; expected"),
    "arguments not JSON": ("tj.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": [call("{x: 1}")]}]}],
                           "tj.jsonl: line 1: messages[1].tool_calls[0].function.arguments: a string that is not JSON"),
    "tool call without a name": ("tn.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": [{"arguments": {}}]}]}],
                                 "tn.jsonl: line 1: messages[1].tool_calls[0].name: expected a string, got NoneType"),
    "reasoning not a string": ("rc.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "reasoning_content": ["r"]}]}],
                               "rc.jsonl: line 1: messages[1].reasoning_content: expected a string, got list"),
    "two reasoning fields": ("r2.jsonl", [{"messages": [CHAT[0], {**CHAT[1], "reasoning_content": "a", "thinking": "b"}]}],
                             "r2.jsonl: line 1: messages[1]: reasoning_content and thinking differ"),
    "tool_call_id not a string": ("ti.jsonl", [{"messages": [CHAT[0], CHAT[1], {"role": "tool", "content": "r",
                                                                              "tool_call_id": 7}]}],
                                  "ti.jsonl: line 1: messages[2].tool_call_id: expected a string, got int"),
    "tools not a list": ("tt.jsonl", [{"messages": CHAT, "tools": {"name": "f"}}],
                         "tt.jsonl: line 1: tools: expected a list of tool definitions (objects), got dict"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_file_line_and_field(tmp_path, case):
    name, rows, match = BAD[case]
    path = tmp_path / name
    if rows is None:
        path.write_text("")
    elif isinstance(rows, bytes):
        path.write_bytes(rows)
    elif isinstance(rows, str):
        path.write_text(rows)
    else:
        write(path, rows)
    with pytest.raises(ValueError) as e:
        data.read_conversations(str(path))
    msg = str(e.value)
    assert match in msg and "\n" not in msg, f"{case}: message {msg!r} should be one line containing {match!r}"


def test_every_message_field_reaches_the_conversation(tmp_path):
    import pyarrow
    import pyarrow.parquet
    tool_turns = [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "reasoning_content": "look it up",
                   "tool_calls": [call('{"city": "Paris"}', "get"), call({"city": "Rome"}, "get")]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi", "name": "get"},
                  {"role": "assistant", "content": [{"type": "text", "text": "sunny"}], "thinking": "easy",
                   "weight": 1}]
    want = [{**tool_turns[0]}, {**tool_turns[1], "content": ""}, tool_turns[2],
            {"role": "assistant", "content": "sunny", "thinking": "easy", "weight": 1}]
    sharegpt = [{"from": "human", "value": "weather?"}, {"from": "gpt", "value": "sunny", "reasoning": "easy"}]
    path = write(tmp_path / "f.jsonl", [{"messages": tool_turns, "tools": [{"type": "function"}]},
                                        {"conversations": sharegpt}])
    got = data.located_conversations(path, "train", False, print)
    assert [(c, t) for _, c, t in got] == [(want, [{"type": "function"}]), (
        [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny", "reasoning": "easy"}],
        None)], got
    # parquet holds every struct key in every message, absent ones as None: they are not fields
    rows = [{"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "reasoning_content": "r",
                           "tool_calls": [call('{"a": 1}')]}]}, {"messages": CHAT}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "t.parquet")
    got = data.read_conversations(str(tmp_path / "t.parquet"))
    assert got == [r["messages"] for r in rows], f"parquet read back as\n{got}"


def test_missing_file_directory_bad_parquet_and_parquet_row(tmp_path):
    import pyarrow
    import pyarrow.parquet
    with pytest.raises(ValueError, match=r"nope\.jsonl: no such file"):
        data.read_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"dir\.jsonl: a directory; expected a \.jsonl, \.json, \.parquet file"):
        data.read_conversations(str(tmp_path / "dir.jsonl"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
        data.read_conversations(str(tmp_path / "bad.parquet"))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT[:1]}]),
                                tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: row 1: messages: no assistant turn"):
        data.read_conversations(str(tmp_path / "p.parquet"))


def test_a_row_to_regenerate_may_be_a_prompt_with_a_system_turn(tmp_path):
    """Rows to regenerate (need_answer=False) need no assistant turn when they end with a user
    turn, whatever comes before it; one that ends otherwise is refused."""
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    rows = [[system, user], [user], [system, user, *CHAT]]
    got = data.read_conversations(write(tmp_path / "p.jsonl", [{"messages": r} for r in rows]), need_answer=False)
    assert got == rows, f"read\n{got}\nexpected\n{rows}"
    with pytest.raises(ValueError, match=r"^\S+u\.jsonl: line 1: messages: no assistant turn \(roles: user, system\); "
                                         r"a row to regenerate needs one, or must end with a user turn$"):
        data.read_conversations(write(tmp_path / "u.jsonl", [{"messages": [user, system]}]), need_answer=False)


def test_drop_bad_counts_and_prints_what_it_drops(tmp_path):
    rows = [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}, CHAT[1]]}, '{"messages":',
            {"messages": [CHAT[0], {"role": "assistant"}]}, {"messages": [{"role": "chatgpt", "content": "x"}]},
            {"messages": CHAT}]
    logs = []
    got = data.read_conversations(write(tmp_path / "d.jsonl", rows), drop_bad=True, log=logs.append)
    assert got == [CHAT, CHAT], f"kept {got}, expected the two good rows"
    want = "d.jsonl: dropped 4 of 6 rows: 2 unknown role, 1 invalid JSON, 1 missing content (first: "
    assert len(logs) == 1 and want in logs[0] and "line 2: messages[0].role: unknown role 'bot'" in logs[0], logs
    fields = [{"messages": [CHAT[0], {**CHAT[1], "tool_calls": "f()"}]}, {"messages": CHAT},
              {"messages": [CHAT[0], {**CHAT[1], "reasoning_content": 1}]}]
    logs.clear()
    assert data.read_conversations(write(tmp_path / "f.jsonl", fields), drop_bad=True, log=logs.append) == [CHAT]
    assert "dropped 2 of 3 rows: 1 bad tool_calls, 1 bad reasoning_content (first: " in logs[0], logs
    with pytest.raises(ValueError, match=r"none of its 1 rows is usable \(first problem: .*line 1: messages"):
        data.read_conversations(write(tmp_path / "x.jsonl", [{"messages": CHAT[:1]}]), drop_bad=True, log=logs.append)


# -----------------------------------------------------------------------------
# training rows and template options


def test_load_rows_truncates_and_reports_useless_rows(tmp_path):
    tokenizer, logs = tokenizer_for("chatml"), []
    long_prompt = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "late"}]
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    path = write(tmp_path / "r.jsonl", [{"messages": CHAT}, {"messages": long_prompt}, {"messages": empty},
                                        {"messages": MULTI}])
    rows = data.load_rows(path, "train", tokenizer, 40, log=logs.append)
    assert len(rows) == 2 and rows.column_names == ["input_ids", "loss_mask"], rows
    ids, mask = rows[0]["input_ids"], rows[0]["loss_mask"]
    assert isinstance(ids, torch.Tensor) and tokenizer.decode(ids[mask.bool()]) == "hello<|im_end|>", (ids, mask)
    assert len(rows[1]["input_ids"]) == 40, f"a {len(rows[1]['input_ids'])}-token row survived seq_len 40"
    want = "dropped 2 of 4 rows with fewer than 2 loss tokens: 1 with their assistant tokens beyond --seq-len 40, " \
           "1 with empty assistant turns"
    assert any(want in l for l in logs), logs


def test_load_rows_names_the_row_a_template_rejects(tmp_path):
    strict = "{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('no system role') }}{%- endif %}" \
             + CHATML_PLAIN[len("{%- for m in messages %}"):]
    tokenizer = tiny_world.build_tiny_tokenizer(strict)
    path = write(tmp_path / "s.jsonl", [{"messages": CHAT}, {"messages": [{"role": "system", "content": "s"}] + CHAT}])
    with pytest.raises(ValueError, match=r"s\.jsonl: line 2: chat template: no system role"):
        data.load_rows(path, "train", tokenizer, 64)
    logs = []
    assert len(data.load_rows(path, "train", tokenizer, 64, drop_bad=True, log=logs.append)) == 1
    assert any("dropped 1 of 2 rows the chat template rejects (first: " in l and "line 2" in l for l in logs), logs
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template: pass --chat-template"):
        data.load_rows(path, "train", tokenizer, 64)


def test_chat_template_file_and_kwargs(tmp_path):
    (tmp_path / "t.jinja").write_text(CHATML_PLAIN)
    assert data.load_chat_template(str(tmp_path / "t.jinja")) == CHATML_PLAIN
    with pytest.raises(ValueError, match=r"--chat-template .*nope\.jinja: cannot read it"):
        data.load_chat_template(str(tmp_path / "nope.jinja"))
    (tmp_path / "e.jinja").write_text("\n")
    with pytest.raises(ValueError, match=r"--chat-template .*e\.jinja: the file is empty"):
        data.load_chat_template(str(tmp_path / "e.jinja"))
    assert data.parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"--chat-template-kwargs '\{enable_thinking: false\}': invalid JSON"):
        data.parse_template_kwargs("{enable_thinking: false}")
    with pytest.raises(ValueError, match=r"--chat-template-kwargs '\[1\]': expected a JSON object .* got list"):
        data.parse_template_kwargs("[1]")


def test_hub_rows_are_named_by_split_and_index(monkeypatch):
    import datasets
    rows = datasets.Dataset.from_list([{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}, CHAT[1]]}])
    monkeypatch.setattr(datasets, "load_dataset", lambda source, split: rows)
    with pytest.raises(ValueError, match=r"^org/chats \[test\]: row 1: messages\[0\]\.role: unknown role 'bot'"):
        data.read_conversations("org/chats", "test")

    def offline(source, split):
        raise ConnectionError(f"Couldn't reach '{source}' on the Hub\n(many more lines)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"^org/chats: no such local file, and loading it as a hub dataset failed: "
                                         r"ConnectionError: Couldn't reach 'org/chats' on the Hub$"):
        data.read_conversations("org/chats")


# -----------------------------------------------------------------------------
# the training data's order (train.py's): epochs, micro-steps and ranks, anchor seeds, validation rows

N_ROWS, EPOCHS, GLOBAL_BATCH = 10, 3, 6  # epochs end inside a step, as in most runs


@pytest.fixture(scope="module")
def train_rows():
    """Row i holds token i + 1: a batch says which rows it holds."""
    return datasets.Dataset.from_dict({"input_ids": [[i + 1] * 2 for i in range(N_ROWS)],
                                       "loss_mask": [[1, 1]] * N_ROWS}).with_format("torch")


@pytest.fixture(params=[(6, 1, 1), (2, 3, 1), (3, 1, 2), (1, 2, 3)],
                ids=lambda shape: "batch {}, grad-accum {}, world {}".format(*shape))
def shape(request):
    """(batch_size, grad_accum, world): one global batch of GLOBAL_BATCH rows, split into micro-steps and ranks."""
    return request.param


def read_rows(train_rows, seed, shape):
    """What a run of --seed reads over EPOCHS epochs, in order: step by step, micro-step by micro-step, rank by
    rank, each rank from its own data_stream. -> [(row, its anchor seed)]."""
    batch_size, grad_accum, world = shape
    streams = [data.data_stream(train_rows, seed, batch_size, grad_accum, world, rank, 0, "cpu")
               for rank in range(world)]
    read = []
    for step in range(EPOCHS * N_ROWS // GLOBAL_BATCH):
        for micro in range(grad_accum):
            for rank, stream in enumerate(streams):
                (ids, _, _), rows, seeds = stream(step, micro)
                held = (ids[:, 0] - 1).tolist()
                assert held == rows, f"step {step}, micro-step {micro}, rank {rank}: the batch holds rows {held}, " \
                    f"the stream says {rows}"
                read += zip(rows, seeds)
    return read


def epoch_orders(train_rows, seed, shape):
    rows = [row for row, _ in read_rows(train_rows, seed, shape)]
    return [rows[e * N_ROWS:(e + 1) * N_ROWS] for e in range(EPOCHS)]


def test_every_epoch_reads_every_row_once_in_a_fresh_order(train_rows, shape):
    """Micro-steps and ranks take their own rows: no micro-batch of a step comes again in the next."""
    orders = epoch_orders(train_rows, 0, shape)
    for e, order in enumerate(orders):
        assert sorted(order) == list(range(N_ROWS)), f"epoch {e} reads rows {order}, not each of {N_ROWS} once"
    same = [(a, b) for b in range(EPOCHS) for a in range(b) if orders[a] == orders[b]]
    assert not same, f"epochs {same} read the rows in one order: {orders}"


def test_a_split_batch_reads_the_rows_and_anchors_of_the_whole_batch(train_rows, shape):
    """Data parallel and gradient accumulation change where a row is read, never which row or its anchors."""
    whole, split = read_rows(train_rows, 0, (GLOBAL_BATCH, 1, 1)), read_rows(train_rows, 0, shape)
    differ = [i for i, (a, b) in enumerate(zip(whole, split)) if a != b]
    assert not differ, f"from place {differ[:1]}: (row, anchor seed) {split[differ[0]]} where one batch of " \
        f"{GLOBAL_BATCH} reads {whole[differ[0]]}"


def test_no_two_seeds_or_epochs_share_a_data_order(train_rows, shape):
    """The seeds bench intervals treat as independent: --seed 1's first epoch is not --seed 0's second."""
    orders = {(seed, e): order for seed in range(3) for e, order in enumerate(epoch_orders(train_rows, seed, shape))}
    same = [(a, b) for a in orders for b in orders if a < b and orders[a] == orders[b]]
    assert not same, f"(seed, epoch) pairs reading the rows in one order: {same}"


def test_no_two_seeds_draw_anchors_from_one_seed(train_rows, shape):
    """--seed 1's row at place p does not draw --seed 0's anchors at place p + 1 (nor any other place's)."""
    drawn = {}
    for seed in range(3):
        for place, (_, anchor_seed) in enumerate(read_rows(train_rows, seed, shape)):
            drawn.setdefault(anchor_seed, []).append((seed, place))
    shared = {k: v for k, v in drawn.items() if len(v) > 1}
    assert not shared, f"anchor seeds drawn at several (seed, place): {dict(list(shared.items())[:3])}"


def test_the_last_val_size_rows_validate_and_no_training_row_left_is_refused(train_rows):
    train_part, val = data.split_rows(train_rows, N_ROWS - 1, "chats.jsonl")
    got = [(ids[0] - 1).item() for ids in train_part["input_ids"]], [(ids[0] - 1).item() for ids in val["input_ids"]]
    assert got == ([0], list(range(1, N_ROWS))), f"(training rows, validation rows) {got} at --val-size {N_ROWS - 1}"
    with pytest.raises(ValueError, match=rf"^--data chats\.jsonl: {N_ROWS} usable rows, need more than --val-size "
                                         rf"{N_ROWS}$"):
        data.split_rows(train_rows, N_ROWS, "chats.jsonl")


# -----------------------------------------------------------------------------
# the flags data.py declares


def test_a_nan_learning_rate_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--lr", "nan"])
    assert "argument --lr: nan must be >= 0" in capsys.readouterr().err, "--lr nan was not refused by name"
    assert train.parse_args(["--lr", "0"]).lr == 0.0, "--lr 0 (the bound itself) was refused"


@pytest.mark.parametrize("device, native_bf16, want", [("cuda", False, torch.bfloat16),
                                                       ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32)])
def test_a_run_without_dtype_trains_in_bf16_where_bf16_is_native(monkeypatch, device, native_bf16, want):
    monkeypatch.setattr(target, "native_bf16_cpu", lambda: native_bf16)
    got, why = target.training_dtype(train.parse_args([]).dtype, torch.device(device))
    assert got == want, f"train.py with no --dtype on a {device} (bf16 in hardware: {native_bf16}) trains in " \
        f"{got} ({why}), expected {want}"
