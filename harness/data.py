"""
Chat data -> training rows for train.py (ALGORITHM.md §6 Data): reading conversations, the loss mask
of the chat template's render, the batches, the data order and each row's anchor seed.

    conversations = read_conversations("chats.jsonl")       # [[{"role", "content", ...}, ...], ...]
    rows = load_rows("chats.jsonl", "train", tokenizer, seq_len=3072)            # input_ids / loss_mask
    ids, attention_mask, loss_mask = collate(rows[0:8], tokenizer.pad_token_id, device)

Not here: the target's own answers, on-policy data (harness/regenerate.py), the tokenizer
(harness/target.py), the anchors a seed draws (dflash2.sample_anchors).

A conversation is a list of {"role": system | user | assistant | tool, "content": str, ...}:
every other field of a message (tool_calls, reasoning_content / reasoning / thinking,
tool_call_id, name, ...) is kept for the chat template, and a row's `tools` go to it too.
Every bad input is a ValueError of one line that names the file, the line (jsonl, 1-based)
or the row (json array, parquet, hub dataset; 0-based, as in ds[i]) and the field:

    chats.jsonl: line 3: messages[1].role: unknown role 'bot' (expected system, user, ...)

Decisions:
- loss tokens (`assistant_tokens`) are what the target generates for each assistant turn, as
  the chat template renders the whole conversation: its reasoning, content, tool calls and
  end-of-turn token; never what the prompt supplies (headers, the generation prompt, the
  newline after the end-of-turn token). Found by renders with sentinels in the turn's fields
  and by laying the turn's prompt over the render, so headerless (Mistral) and multi-ending
  (harmony) templates work; {% generation %} marks can narrow this, never widen it;
- the reasoning goes under every name the template reads; tool-call arguments go as the row
  has them, unless only the other type renders as JSON (`arguments | tojson` wants an object,
  a string is parsed as vLLM does; `'...' + arguments` wants a string, an object is dumped);
- a tool call the template does not render refuses the row (its tokens would be missing);
  reasoning it does not render is counted and printed;
- OpenAI list content keeps its text parts joined by newlines (as vLLM joins them); any
  other part is an error;
- rows with fewer than 2 loss tokens after truncation are dropped, counted and printed.
"""
import argparse
import json
import re
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import datasets
import jinja2
import torch

from dflash2 import sample_anchors

# -----------------------------------------------------------------------------
# a flag type of the entry points (train.py, python -m harness.memory, .checkpoint, .regenerate)


def at_least(low, kind=int):
    """argparse type: a number >= low, refused with the flag and value otherwise (NaN too)."""
    def parse(text):
        value = kind(text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{text} must be >= {low}")
        return value
    parse.__name__ = kind.__name__
    return parse


# -----------------------------------------------------------------------------
# chat template options: --chat-template FILE, --chat-template-kwargs JSON


def load_chat_template(path):
    """The Jinja text of a --chat-template file, to assign to tokenizer.chat_template."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text


def parse_template_kwargs(text):
    """--chat-template-kwargs JSON (e.g. '{"enable_thinking": false}') -> dict passed to the template.
    Raises ValueError, so call it on the parsed string (argparse's type= would hide the message)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {text!r}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs {text!r}: expected a JSON object such as "
                         f"'{{\"enable_thinking\": false}}', got {type(value).__name__}")
    return value


# -----------------------------------------------------------------------------
# reading conversations: local .jsonl/.json/.parquet or a hub dataset -> checked conversations

FORMATS = (".jsonl", ".json", ".parquet")
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "human": "user", "gpt": "assistant", "model": "assistant"}  # OpenAI roles, then ShareGPT's `from`
REASONING = ("reasoning_content", "reasoning", "thinking")  # what datasets and chat templates call a turn's reasoning


class BadRow(ValueError):
    """An unusable row; `kind` is what a drop_bad summary counts."""

    def __init__(self, message, kind):
        super().__init__(message)
        self.kind = kind


def raw_rows(source, split):
    """-> [(where, row)]: `where` names the file and line/row; `row` is the parsed value, or a
    BadRow for a jsonl line that is not JSON (so that drop_bad can drop just that line)."""
    path = Path(source)
    if not path.exists() and path.suffix.lower() not in FORMATS:  # a hub dataset id
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # the hub's errors are many and long; the first line says what failed
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"{source}: no such local file, and loading it as a hub dataset failed: "
                             f"{type(e).__name__}: {first}") from None
        return [(f"{source} [{split}]: row {i}", row) for i, row in enumerate(ds)]
    if not path.is_file():
        raise ValueError(f"{source}: no such file" if not path.exists() else
                         f"{source}: a directory; expected a {', '.join(FORMATS)} file or a hub dataset id")
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{source}: unsupported file type '{path.suffix}' (expected {', '.join(FORMATS)})")
    if path.stat().st_size == 0:
        raise ValueError(f"{source}: empty file")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet  # a dependency of datasets
        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
            raise ValueError(f"{source}: not a readable parquet file ({e})") from None
        return [(f"{source}: row {i}", row) for i, row in enumerate(rows)]
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{source}: line {line}: not UTF-8 text ({e.reason})") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):  # one array; else JSON lines
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        return [(f"{source}: row {i}", row) for i, row in enumerate(rows)]
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if line.strip():
            try:
                out.append((f"{source}: line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                out.append((f"{source}: line {n}",
                            BadRow(f"{source}: line {n}: invalid JSON ({e.msg} at column {e.colno})", "invalid JSON")))
    if not out:
        raise ValueError(f"{source}: empty file (only blank lines)")
    return out


def message_text(content, where, field):
    """A message's content -> str; OpenAI list content keeps its text parts, joined by newlines."""
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow(f"{where}: {field}[{k}]: a {kind!r} part; only text parts "
                             "({'type': 'text', 'text': ...}) are supported", "non-text content")
        return "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise BadRow(f"{where}: {field}: expected a string or a list of text parts, got {type(content).__name__}",
                     "bad content")
    return content


def json_object(value, where, field, what):
    """Checks that `value` is an object, or a string holding a JSON object (OpenAI's tool-call arguments)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(f"{where}: {field}: a string that is not JSON ({e.msg} at column {e.colno}); expected "
                         f"{what}", "bad tool_calls") from None
        if not isinstance(parsed, dict):
            raise BadRow(f"{where}: {field}: a JSON {type(parsed).__name__}; expected {what}", "bad tool_calls")
    elif not isinstance(value, dict):
        raise BadRow(f"{where}: {field}: expected {what}, got {type(value).__name__}", "bad tool_calls")


def check_tool_calls(calls, where, field):
    """OpenAI tool calls: [{"type": "function", "id": ..., "function": {"name", "arguments"}}], or
    the flat {"name", "arguments"} some datasets use; arguments an object or a JSON string of one."""
    if not isinstance(calls, list):
        raise BadRow(f"{where}: {field}: expected a list of tool calls, got {type(calls).__name__}", "bad tool_calls")
    for k, call in enumerate(calls):
        f = f"{field}[{k}]"
        if not isinstance(call, dict):
            raise BadRow(f"{where}: {f}: expected an object, got {type(call).__name__}", "bad tool_calls")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise BadRow(f"{where}: {f}.function: expected an object, got {type(fn).__name__}", "bad tool_calls")
        f += ".function" if "function" in call else ""
        if not isinstance(fn.get("name"), str):
            raise BadRow(f"{where}: {f}.name: expected a string, got {type(fn.get('name')).__name__}",
                         "bad tool_calls")
        if "arguments" not in fn:
            raise BadRow(f"{where}: {f}.arguments: missing", "bad tool_calls")
        json_object(fn["arguments"], where, f"{f}.arguments", "an object or a string holding a JSON object")


def conversation(row, where, need_answer=True):
    """One row -> [{"role", "content", ...}]: 'messages' or 'conversations', role/content or
    from/value, every other field of a message kept for the chat template (tool_calls,
    reasoning_content / reasoning / thinking, tool_call_id, name, ...). Fields a template reads
    are type-checked; a None field is absent (parquet and hub rows hold every struct key). An
    assistant turn with tool_calls may have no content. Raises BadRow naming `where` and the field."""
    if not isinstance(row, dict):
        raise BadRow(f"{where}: expected an object with 'messages', got {type(row).__name__}", "not an object")
    key = next((k for k in ("messages", "conversations") if k in row), None)
    if key is None:
        raise BadRow(f"{where}: no 'messages' or 'conversations' field (fields: {', '.join(map(str, row)) or 'none'})",
                     "missing messages")
    if not isinstance(row[key], list):
        raise BadRow(f"{where}: {key}: expected a list of messages, got {type(row[key]).__name__}", "missing messages")
    out = []
    for j, m in enumerate(row[key]):
        field = f"{key}[{j}]"
        if not isinstance(m, dict):
            raise BadRow(f"{where}: {field}: expected an object with role/content (or from/value), got "
                         f"{type(m).__name__}", "bad message")
        m = {k: v for k, v in m.items() if v is not None}
        role, content = m.pop("role", m.pop("from", None)), m.pop("content", m.pop("value", None))
        if role is None:
            raise BadRow(f"{where}: {field}: no 'role' (or 'from')", "missing role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow(f"{where}: {field}.role: unknown role {role!r} (expected system, user, assistant or tool; "
                         "ShareGPT's human, gpt or model)", "unknown role")
        if m.get("tool_calls") == []:  # no calls: as if absent (a template may index tool_calls[0])
            del m["tool_calls"]
        if "tool_calls" in m:
            if ROLES[role] != "assistant":
                raise BadRow(f"{where}: {field}.tool_calls: only assistant turns make tool calls (role {role!r})",
                             "bad tool_calls")
            check_tool_calls(m["tool_calls"], where, f"{field}.tool_calls")
            content = "" if content is None else content
        if content is None:
            raise BadRow(f"{where}: {field}.content: missing (every message needs a 'content' or 'value')",
                         "missing content")
        for name in (*REASONING, "tool_call_id", "name"):
            if name in m and not isinstance(m[name], str):
                raise BadRow(f"{where}: {field}.{name}: expected a string, got {type(m[name]).__name__}",
                             f"bad {name}")
        if len({m[k] for k in REASONING if k in m}) > 1:
            raise BadRow(f"{where}: {field}: {' and '.join(k for k in REASONING if k in m)} differ; keep one "
                         "reasoning field", "bad reasoning")
        out.append({"role": ROLES[role], "content": message_text(content, where, f"{field}.content"), **m})
    if not any(m["role"] == "assistant" for m in out) and (need_answer or not out or out[-1]["role"] != "user"):
        raise BadRow(f"{where}: {key}: no assistant turn (roles: {', '.join(m['role'] for m in out) or 'none'})"
                     + ("" if need_answer else "; a row to regenerate needs one, or must end with a user turn"),
                     "no assistant turn")
    return out


def row_tools(row, where):
    """A row's tool definitions ('tools': a list of objects, or a JSON string of one) -> list or None;
    the chat template renders them into the prompt, as a server does for a request with tools."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow(f"{where}: tools: a string that is not JSON ({e.msg} at column {e.colno})", "bad tools") \
                from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRow(f"{where}: tools: expected a list of tool definitions (objects), got {type(tools).__name__}",
                     "bad tools")
    return tools or None


def located_conversations(source, split, drop_bad, log, need_answer=True):
    """read_conversations, each conversation with its `where` and tools -> [(where, conversation, tools)]."""
    rows = raw_rows(source, split)
    if not rows:
        raise ValueError(f"{source}: no rows")
    out, dropped, first = [], Counter(), None
    for where, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            out.append((where, conversation(row, where, need_answer), row_tools(row, where)))
        except BadRow as e:
            if not drop_bad:
                raise
            dropped[e.kind] += 1
            first = first or e
    if dropped:
        log(f"{source}: dropped {sum(dropped.values())} of {len(rows)} rows: "
            f"{', '.join(f'{n} {kind}' for kind, n in dropped.most_common())} (first: {first})")
    if not out:
        raise ValueError(f"{source}: none of its {len(rows)} rows is usable (first problem: {first})")
    return out


def read_conversations(source, split="train", drop_bad=False, log=print, need_answer=True):
    """Local .jsonl / .json (an array or JSON lines) / .parquet, or a hub dataset id (`split`) ->
    list of conversations. Each row holds 'messages' or 'conversations': role/content (OpenAI) or
    from/value (ShareGPT; human -> user, gpt/model -> assistant); list content keeps its text
    parts; every other message field is kept (see `conversation`). Every row needs an assistant
    turn; with need_answer=False (rows to regenerate) a row may end with a user turn instead. A
    bad row raises ValueError naming the file, the line/row and the field; with drop_bad=True
    bad rows are dropped, counted and printed instead."""
    return [c for _, c, _ in located_conversations(source, split, drop_bad, log, need_answer)]


# -----------------------------------------------------------------------------
# rendering with the chat template; assistant masks

SENTINEL = "\ue000{}\ue000"  # private-use characters: no template trims or escapes them, no text holds them
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def template_messages(messages, facts):
    """Messages as this chat template wants them: the reasoning under every name the template
    reads, and tool-call arguments of the type it renders as JSON (a JSON string is parsed, an
    object dumped, as servers do before they render a request)."""
    out = []
    for m in messages:
        m = dict(m)
        reasoning = next((m[k] for k in REASONING if k in m), None)
        if reasoning is not None:
            m.update({k: reasoning for k in facts["reasoning"]})
        if "tool_calls" in m and facts["arguments"]:
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function", call))
                args = fn["arguments"]
                if facts["arguments"] == "object" and isinstance(args, str):
                    fn["arguments"] = json.loads(args)
                elif facts["arguments"] == "string" and not isinstance(args, str):
                    fn["arguments"] = json.dumps(args, ensure_ascii=False)
                calls.append({**call, "function": fn} if "function" in call else fn)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(tokenizer, messages, kw, facts, add_generation_prompt=False):
    """The chat template's text for `messages` (no tokenization); kw holds the template options
    and the row's tools."""
    return tokenizer.apply_chat_template(template_messages(messages, facts), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kw)


def common_prefix(a, b):
    """Length of the longest common prefix of two strings (binary search over slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo


def changed_region(text, other):
    """-> (start, end) of the part of `text` that `other` replaces (the rest of both is equal), or
    None when they are equal."""
    if text == other:
        return None
    p = common_prefix(text, other)
    s = common_prefix(text[p:][::-1], other[p:][::-1])
    return p, len(text) - s


def tool_call(arguments, name="f"):
    """A tool call of the probes; the 9-character id satisfies Mistral's templates."""
    return {"type": "function", "id": "abcdefghi", "function": {"name": name, "arguments": arguments}}


def first_added_token(tokenizer, text):
    """-> (text, id) of the first added/special token in `text`, or None."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    added = set(tokenizer.added_tokens_decoder)
    i = next((i for i, t in enumerate(enc["input_ids"]) if t in added), None)
    return None if i is None else (text[slice(*enc["offset_mapping"][i])], enc["input_ids"][i])


def end_of_turn(tokenizer, template_kwargs):
    """-> (text, id) of the token that ends a last assistant turn: the first added/special token the
    template writes after its content (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, harmony's
    <|return|>). Plain text such as a newline cannot end a turn: contents hold newlines too."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL.format("c")}]
    tail = tokenizer.apply_chat_template(probe, tokenize=False, **template_kwargs).split(SENTINEL.format("c"))[-1]
    found = first_added_token(tokenizer, tail)
    if found is None:
        raise ValueError(f"the chat template writes {tail!r} after an assistant turn, no special token that ends "
                         f"the turn; pass --chat-template FILE with a template that does (e.g. with the eos token "
                         f"{tokenizer.eos_token!r})")
    return found


def template_facts(tokenizer, template_kwargs=None):
    """What rendering and masking need to know of a chat template, found once by probe renders:
    kw        the template options;
    eot       (text, id) of end_of_turn, where regeneration stops;
    ends      ids of every token that can end an assistant turn: the first added token after a
              probe's content, reasoning or tool call (harmony ends turns with <|end|>, <|return|>
              or <|call|>; ChatML always with <|im_end|>);
    arguments "object" or "string" when only that type of tool-call arguments comes out as JSON
              (`arguments | tojson` wants an object, `'...' + arguments` a string), else None;
    reasoning the reasoning field names the template reads."""
    kw = dict(template_kwargs or {})
    template = tokenizer.chat_template or ""
    reads = lambda name: re.search(rf"\.\s*{name}\b|\[\s*['\"]{name}['\"]\s*\]|['\"]{name}['\"]\s+(not\s+)?in\b|"
                                   rf"\.get\(\s*['\"]{name}['\"]", template)
    facts = {"kw": kw, "eot": end_of_turn(tokenizer, kw), "arguments": None,
             "reasoning": tuple(k for k in REASONING if reads(k))}
    user, arg = {"role": "user", "content": "?"}, SENTINEL.format("a")

    def try_render(messages):  # probes only: a template may refuse a probe for any reason of its own
        try:
            return render(tokenizer, messages, kw, facts)
        except Exception:
            return ""

    call = lambda v: [user, {"role": "assistant", "content": "", "tool_calls": [tool_call(v)]}]
    as_json = {kind: f'"{arg}"' in try_render(call(v))
               for kind, v in (("object", {"x": arg}), ("string", json.dumps({"x": arg}, ensure_ascii=False)))}
    if as_json["object"] != as_json["string"]:
        facts["arguments"] = "object" if as_json["object"] else "string"
    content, reasoning = SENTINEL.format("c"), SENTINEL.format("r")
    probes = [([user, {"role": "assistant", "content": content}, user], content),
              ([user, {"role": "assistant", "content": content, **{k: reasoning for k in REASONING}}], reasoning),
              ([user, {"role": "assistant", "content": "", "tool_calls": [tool_call({"x": arg})]},
                {"role": "tool", "content": "?", "tool_call_id": "abcdefghi", "name": "f"}], arg)]
    facts["ends"] = {facts["eot"][1]}
    for messages, field in probes:
        text = try_render(messages)
        found = first_added_token(tokenizer, text.split(field)[-1]) if field in text else None
        facts["ends"] |= {found[1]} if found else set()
    return facts


def with_sentinels(messages, j):
    """-> (messages with message j's own text replaced by sentinels, {field: sentinel}). For an
    assistant turn: the content and the reasoning when not empty (a template may render an empty
    one differently), each tool call's arguments; the content also when nothing else is there."""
    m, marks = dict(messages[j]), {}
    for k in REASONING:
        if m.get(k):
            marks["reasoning"] = m[k] = SENTINEL.format(f"r{j}")
    for k, call in enumerate(m.get("tool_calls", [])):
        marks[k] = SENTINEL.format(f"a{j}.{k}")
        fn = {**call.get("function", call), "arguments": {"x": marks[k]}}
        m["tool_calls"] = [*m["tool_calls"][:k], {**call, "function": fn} if "function" in call else fn,
                           *m["tool_calls"][k + 1:]]
    if m["content"] or not marks:
        marks["content"] = m["content"] = SENTINEL.format(f"c{j}")
    return [*messages[:j], m, *messages[j + 1:]], marks


def own_text(tokenizer, messages, j, text, kw, facts):
    """Message j's own text (its content, reasoning, tool calls) in `text`, the render of all
    `messages`: -> (span, probe, marks), `span` the (start, end) of `text` that changes when they
    are replaced by sentinels (None when the template renders none of them), `probe` that render
    and `marks` the sentinels (with_sentinels)."""
    variant, marks = with_sentinels(messages, j)
    probe = render(tokenizer, variant, kw, facts)
    return changed_region(text, probe), probe, marks


def generation_start(tokenizer, messages, i, text, own_spans, kw, facts):
    """Where the target takes over assistant turn i in `text`: the turn's prompt (messages[:i] and
    the generation prompt, as a server renders it) is laid over `text` from the end of the last
    earlier message whose own text both hold; where they part, the target starts. So the header,
    the generation prompt (Qwen3's empty think block under enable_thinking=false, a Thinking
    template's `<think>\\n`) and a user turn's closing are prompt, also where `text` renders them
    inside the turn's own text; text the prompt does not hold is generated: harmony's
    <|channel|>...<|message|>, the space Mistral's template writes before an answer."""
    try:
        prompt = render(tokenizer, messages[:i], kw, facts, add_generation_prompt=True)
    except Exception:  # a generation prompt for no messages at all breaks templates that read messages[0]
        if i:
            raise
        return own_spans[i][0]  # then the turn starts at its own text
    in_text = in_prompt = 0  # the end of that earlier message's own text, in `text` and in `prompt`
    for j in range(i - 1, -1, -1):
        if own_spans[j] is not None:
            variant, _ = with_sentinels(messages[:i], j)
            span = changed_region(prompt, render(tokenizer, variant, kw, facts, add_generation_prompt=True))
            if span is not None:
                in_text, in_prompt = own_spans[j][1], span[1]
                break
    return in_text + common_prefix(text[in_text:], prompt[in_prompt:])


def assistant_spans(tokenizer, messages, text, enc, facts, kw):
    """-> ([(start, end)], n): character spans of `text`, the render of all `messages` (`enc` its
    tokenization with offsets), that are loss text, and the number of assistant turns whose
    reasoning the template does not render.

    The loss text of an assistant turn is what the target generates for it (ALGORITHM.md §6):
    from where its prompt ends (generation_start) to the end of the turn's last end-of-turn token.
    - The turn's own text (own_text) must hold every tool call: the tokens of one that does not
      come out, what the target generates, would be missing.
    - End: the last end-of-turn token (facts["ends"]) between the end of the turn's own text and
      the start of the next rendered message's own text, or the next turn's start when that is an
      assistant turn too (its header is prompt); the newline a template writes after it is not
      trained.
    Nothing here assumes that earlier renders are prefixes of later ones: Mistral moves the system
    prompt into the last user turn, Qwen3 and harmony drop the reasoning of earlier turns."""
    own = [own_text(tokenizer, messages, j, text, kw, facts) for j in range(len(messages))]
    own_spans = [span for span, _, _ in own]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    unrendered = 0
    for i in turns:
        span, probe, marks = own[i]
        for k, call in enumerate(messages[i].get("tool_calls", [])):
            if marks[k] not in probe:
                raise ValueError(f"messages[{i}].tool_calls[{k}] ({call.get('function', call)['name']}): the chat "
                                 f"template does not render this tool call, so the tokens the target generates for "
                                 f"it cannot be trained")
        unrendered += "reasoning" in marks and marks["reasoning"] not in probe
        if span is None:
            raise ValueError(f"messages[{i}]: the chat template renders nothing of this assistant turn")
    starts = {i: generation_start(tokenizer, messages, i, text, own_spans, kw, facts) for i in turns}
    end_tokens = [(a, b) for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t in facts["ends"]]
    spans, prev_end = [], 0
    for i in turns:
        own_end = own_spans[i][1]
        following = next((j for j in range(i + 1, len(messages)) if own_spans[j] is not None), None)
        bound = len(text) if following is None else own_spans[following][0]
        if following in starts and starts[following] > own_end:
            # two assistant turns in a row: the second one's header and generation prompt lie between them,
            # and the second one's think block holds </think>, which the reasoning probe counts as an end
            bound = min(bound, starts[following])
        end = max((b for a, b in end_tokens if a >= own_end and b <= bound), default=None)
        if end is None:
            raise ValueError(f"messages[{i}]: no end-of-turn token (one of "
                             f"{', '.join(map(repr, tokenizer.convert_ids_to_tokens(sorted(facts['ends']))))}) "
                             f"after this assistant turn in the chat template's render")
        spans.append((max(starts[i], prev_end), end))
        prev_end = end
    return spans, unrendered


def row_tokens(tokenizer, messages, tools, facts):
    """assistant_tokens, plus the number of assistant turns whose reasoning the template drops."""
    kw = {**facts["kw"], **({"tools": tools} if tools else {})}
    text = render(tokenizer, messages, kw, facts)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, unrendered = assistant_spans(tokenizer, messages, text, enc, facts, kw)
    mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(template_messages(messages, facts), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
        if out["input_ids"] != enc["input_ids"]:
            raise ValueError("the chat template's {% generation %} render tokenizes differently from its plain render")
        mask = [a & b for a, b in zip(mask, out["assistant_masks"])]
    return enc["input_ids"], mask, unrendered


def assistant_tokens(tokenizer, messages, template_kwargs=None, tools=None, facts=None):
    """-> (input_ids, loss_mask) of a conversation rendered with the chat template; loss_mask is 1
    on what the target generates for each assistant turn — its reasoning, content and tool calls
    as the template renders them, and the turn's end-of-turn token — and 0 on system/user/tool
    turns, headers, generation prompts, the newline after an end-of-turn token and any turn after
    the last assistant one (`assistant_spans`). Spans map to tokens by the tokenizer's offsets: a
    token is trained when it overlaps one (a token that merges the header's last character with
    the content's first is trained). A template's own {% generation %} marks can narrow the mask,
    never widen it: SmolLM3's wrap the header and the newline after <|im_end|> too.

    What is trained with Qwen3-style templates, which rewrite assistant turns:
    - an assistant turn before the last user turn: its answer only, because the template drops
      its reasoning (<think>...</think>) from the render;
    - an assistant turn after the last user turn (the answer, or each step of a tool-calling
      loop): the template's think block `<think>\\nREASONING\\n</think>\\n\\n` and the answer.
      The last turn always gets one, empty when it has no reasoning, and it is trained; with
      {"enable_thinking": false} the generation prompt already holds that empty think block, so
      then it is prompt, not loss.
    `facts` (template_facts) saves its probe renders when called for many conversations."""
    facts = facts or template_facts(tokenizer, template_kwargs)
    ids, mask, _ = row_tokens(tokenizer, messages, tools, facts)
    return ids, mask


# -----------------------------------------------------------------------------
# training rows


def load_rows(data, split, tokenizer, seq_len, *, template_kwargs=None, drop_bad=False, log=print):
    """`data` (see read_conversations) -> datasets.Dataset of input_ids / loss_mask (torch
    format), rows cut to seq_len tokens; a row's `tools` go to the template. A conversation the
    chat template cannot render (it raises, e.g. on roles that do not alternate or a system role
    it does not support, or it drops a tool call) is a ValueError naming its row and quoting the
    template's message, or a counted drop with drop_bad. A row with fewer than 2 loss tokens left
    teaches nothing (a loss token is predicted from the one before it): such rows are dropped,
    counted and printed with the reason. Assistant turns whose reasoning the template does not
    render are counted and printed."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: pass --chat-template FILE (a Jinja template)")
    rows = located_conversations(data, split, drop_bad, log)
    facts = template_facts(tokenizer, template_kwargs)
    ids, masks, rejected, beyond, empty, t_log = [], [], [], 0, 0, time.time()
    with_reasoning = sum(any(m.get(k) for k in REASONING) for _, c, _ in rows for m in c if m["role"] == "assistant")
    unrendered = 0
    for n, (where, c, tools) in enumerate(rows, 1):
        try:
            row_ids, mask, dropped = row_tokens(tokenizer, c, tools, facts)
        except (ValueError, TypeError, jinja2.TemplateError) as e:  # TypeError: a template adding str and dict
            if not drop_bad:
                raise ValueError(f"{where}: chat template: {e}") from None
            rejected.append(f"{where}: {e}")
            continue
        unrendered += dropped
        if sum(mask[:seq_len]) >= 2:
            ids.append(row_ids[:seq_len])
            masks.append(mask[:seq_len])
        elif sum(mask) >= 2:
            beyond += 1
        else:
            empty += 1
        if time.time() - t_log > 10:
            log(f"tokenized {n}/{len(rows)} conversations")
            t_log = time.time()
    if rejected:
        log(f"{data}: dropped {len(rejected)} of {len(rows)} rows the chat template rejects (first: {rejected[0]})")
    if unrendered:
        log(f"{data}: {unrendered} of {with_reasoning} assistant turns with reasoning are trained without it: the "
            f"chat template does not render it (templates drop the reasoning of turns before the last user turn; "
            f"one that reads none of the fields {', '.join(REASONING)} drops it everywhere)")
    if beyond or empty:
        log(f"{data}: dropped {beyond + empty} of {len(rows)} rows with fewer than 2 loss tokens: {beyond} with "
            f"their assistant tokens beyond --seq-len {seq_len}, {empty} with empty assistant turns")
    if not ids:
        raise ValueError(f"{data}: no row has 2 or more assistant tokens (loss tokens) in its first {seq_len} tokens")
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).with_format("torch")


# -----------------------------------------------------------------------------
# batches


def pad(rows, value):
    """Right-pad lists of ids -> (ids (b, S), attention_mask (b, S))."""
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), value, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(r)
    return ids, (torch.arange(S) < torch.tensor([len(r) for r in rows])[:, None]).long()


def collate(cols, pad_id, device):
    """Dataset columns of a batch (ds[indices]) -> padded (ids, attention_mask, loss_mask)."""
    ids, attn = pad(cols["input_ids"], pad_id)
    loss_mask, _ = pad(cols["loss_mask"], 0)
    return ids.to(device), attn.to(device), loss_mask.to(device)


# -----------------------------------------------------------------------------
# the training data's order: validation rows, batches, anchor seeds


def training_rows(data, split, tokenizer, seq_len, val_size, template_kwargs_json="{}", log=print):
    """A run's rows: --data's conversations through the chat template (--chat-template-kwargs JSON), cut to
    seq_len tokens (load_rows), then split (split_rows). -> (training rows, validation rows)."""
    rows = load_rows(data, split, tokenizer, seq_len, template_kwargs=parse_template_kwargs(template_kwargs_json),
                     log=log)
    return split_rows(rows, val_size, data)


def split_rows(dataset, val_size, data):
    """-> (training rows, validation rows): the last val_size rows of --data validate."""
    if len(dataset) <= val_size:
        raise ValueError(f"--data {data}: {len(dataset)} usable rows, need more than --val-size {val_size}")
    n_train = len(dataset) - val_size
    return dataset.select(range(n_train)), dataset.select(range(n_train, len(dataset)))


def anchor_seed(seed, place):
    """The seed of the anchors of the row at `place` in the data stream (train.py's data order);
    validation row i draws from -1 - anchor_seed(seed, i), never a training row's seed."""
    return seed * 1_000_003 + place


def row_anchors(loss_mask, max_anchors, seeds):
    """sample_anchors row by row, each row from its own seed: a row draws the same anchors
    whatever batch, rank or micro-step it lands in (resume and data parallel repeat them)."""
    drawn = [sample_anchors(m[None], max_anchors, torch.Generator().manual_seed(s)) for m, s in zip(loss_mask, seeds)]
    # each row's draw is sample_anchors' (1, N_i) with its padding; pad the rows to the longest the same way
    return tuple(torch.nn.utils.rnn.pad_sequence([x[0] for x in part], batch_first=True) for part in zip(*drawn))


def data_stream(train_rows, seed, batch_size, grad_accum, world, rank, pad_token_id, device):
    """The data order: one permutation per epoch, seeded by (seed, epoch); rank r takes its slice
    of every global batch, so the step alone says where the data stands. -> micro_batch(step,
    micro): its tokens (collate's), its training rows' indices and their anchor seeds (from their
    places)."""
    global_batch = batch_size * grad_accum * world

    @lru_cache(maxsize=2)
    def epoch_order(epoch):  # seeded as the anchors are: with seed + epoch, --seed 1's epoch e is --seed 0's e + 1
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(len(train_rows), generator=g).tolist()

    def micro_batch(step, micro):
        start = step * global_batch + (micro * world + rank) * batch_size
        places = range(start, start + batch_size)
        idx = [epoch_order(i // len(train_rows))[i % len(train_rows)] for i in places]
        return collate(train_rows[idx], pad_token_id, device), idx, [anchor_seed(seed, i) for i in places]
    return micro_batch
