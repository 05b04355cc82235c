"""
Chat data -> training rows for train.py (ALGORITHM.md §6 Data).

    conversations = read_conversations("chats.jsonl")       # [[{"role", "content"}, ...], ...]
    conversations = regenerate_conversations(target, tokenizer, conversations)   # the target's own answers
    rows = load_rows("chats.jsonl", "train", tokenizer, seq_len=3072)            # input_ids / loss_mask

A conversation is a list of {"role": system | user | assistant | tool, "content": str}.
Every bad input is a ValueError of one line that names the file, the line (jsonl, 1-based)
or the row (json array, parquet, hub dataset; 0-based, as in ds[i]) and the field:

    chats.jsonl: line 3: messages[1].role: unknown role 'bot' (expected system, user, ...)

Decisions:
- loss tokens (`assistant_tokens`) are each assistant turn's content and its end-of-turn
  token, as the chat template really renders the whole conversation: from the template's
  own {% generation %} marks when it has them, else from turn-by-turn renders; the newline
  a template writes after the end-of-turn token is not trained;
- OpenAI list content keeps its text parts joined by newlines (as vLLM joins them); any
  other part is an error;
- rows with fewer than 2 loss tokens after truncation are dropped, counted and printed;
- regeneration decodes with its own loop rather than `generate`: a torch.Generator seeds
  the sampling, and the stop tokens are the template's end-of-turn token and the eos.
"""
import json
import os
import re
import time
from collections import Counter
from pathlib import Path

import datasets
import jinja2
import torch
import transformers

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


def check_target_path(target):
    """A local folder must be a model folder; anything else that exists locally is a mistake,
    not a hub id (transformers would otherwise blame a missing tokenizer package)."""
    p = Path(target)
    if p.is_dir() and not (p / "config.json").is_file():
        raise ValueError(f"--target {target}: the folder has no config.json, it is not a Hugging Face model folder")
    if p.exists() and not p.is_dir():
        raise ValueError(f"--target {target}: a file, expected a model folder or a hub id")


def load_tokenizer(target, chat_template=None):
    """The target's tokenizer, with --chat-template's text if given and a pad token."""
    check_target_path(target)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    if chat_template:
        tokenizer.chat_template = load_chat_template(chat_template)
    if tokenizer.pad_token is None:  # padding is masked everywhere, any real token will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# -----------------------------------------------------------------------------
# reading conversations: local .jsonl/.json/.parquet or a hub dataset -> checked conversations

FORMATS = (".jsonl", ".json", ".parquet")
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "human": "user", "gpt": "assistant", "model": "assistant"}  # OpenAI roles, then ShareGPT's `from`


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


def conversation(row, where):
    """One row -> [{"role", "content"}]: 'messages' or 'conversations', role/content or from/value.
    Raises BadRow naming `where` and the field."""
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
        role = m.get("role") or m.get("from")  # `or`: parquet/hub rows hold every struct key, absent ones as None
        if role is None:
            raise BadRow(f"{where}: {field}: no 'role' (or 'from')", "missing role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow(f"{where}: {field}.role: unknown role {role!r} (expected system, user, assistant or tool; "
                         "ShareGPT's human, gpt or model)", "unknown role")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        if content is None:
            raise BadRow(f"{where}: {field}.content: missing (every message needs a 'content' or 'value')",
                         "missing content")
        out.append({"role": ROLES[role], "content": message_text(content, where, f"{field}.content")})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow(f"{where}: {key}: no assistant turn (roles: {', '.join(m['role'] for m in out) or 'none'})",
                     "no assistant turn")
    return out


def located_conversations(source, split, drop_bad, log):
    """read_conversations, each conversation with its `where` -> [(where, conversation)]."""
    rows = raw_rows(source, split)
    if not rows:
        raise ValueError(f"{source}: no rows")
    out, dropped, first = [], Counter(), None
    for where, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            out.append((where, conversation(row, where)))
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


def read_conversations(source, split="train", drop_bad=False, log=print):
    """Local .jsonl / .json (an array or JSON lines) / .parquet, or a hub dataset id (`split`) ->
    list of conversations. Each row holds 'messages' or 'conversations': role/content (OpenAI) or
    from/value (ShareGPT; human -> user, gpt/model -> assistant); list content keeps its text
    parts. Every row needs an assistant turn. A bad row raises ValueError naming the file, the
    line/row and the field; with drop_bad=True bad rows are dropped, counted and printed instead."""
    return [c for _, c in located_conversations(source, split, drop_bad, log)]


# -----------------------------------------------------------------------------
# rendering with the chat template; assistant masks

PROBE = "\x01assistant content probe\x01"  # a content no template transforms, found again in the render
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def render(tokenizer, messages, template_kwargs, add_generation_prompt=False):
    """The chat template's text for `messages` (no tokenization)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def common_prefix(a, b):
    """Length of the longest common prefix of two strings."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def end_of_turn(tokenizer, template_kwargs):
    """-> (text, id) of the end-of-turn token: the first added/special token the template writes
    after the last assistant turn's content (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>).
    Plain text such as a newline cannot end a turn: contents hold newlines too."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]
    tail = render(tokenizer, probe, template_kwargs).split(PROBE)[-1]
    enc = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
    added = set(tokenizer.added_tokens_decoder)
    i = next((i for i, t in enumerate(enc["input_ids"]) if t in added), None)
    if i is None:
        raise ValueError(f"the chat template writes {tail!r} after an assistant turn, no special token that ends "
                         f"the turn; pass --chat-template FILE with a template that does (e.g. with the eos token "
                         f"{tokenizer.eos_token!r})")
    start, end = enc["offset_mapping"][i]
    return tail[start:end], enc["input_ids"][i]


def assistant_spans(tokenizer, messages, text, template_kwargs):
    """-> [(start, end)]: character spans of `text`, the render of all `messages`, that are loss
    text: each assistant turn from the end of its header to the end of its end-of-turn token.

    A turn's header is found with two probe renders of the conversation before it (`before`):
    plus the generation prompt (the header of a last turn; Qwen3's may hold an empty think
    block) and plus an assistant turn followed by a user turn (the header of an earlier turn).
    A header is the probe's text from where it leaves `before`, so with templates that move the
    system prompt into the last user turn (Mistral's) it starts inside that user turn. It is
    searched in `text` from where the probe, or `text` if earlier, leaves `before`, never before
    the previous turn's end; the first header found wins, the longest at a tie. For templates
    that render a turn the same whatever follows, that is exactly where `before` ends; the search
    follows the others (Qwen3 renders a trailing assistant turn with its reasoning, an earlier
    one without)."""
    kw = template_kwargs
    eot, _ = end_of_turn(tokenizer, kw)
    spans, prev_end = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], kw) if i else ""
        probes = [render(tokenizer, messages[:i] + [{"role": "assistant", "content": PROBE},
                                                     {"role": "user", "content": "?"}], kw)]
        if i:  # a generation prompt for no messages at all breaks templates that read messages[0]
            probes.append(render(tokenizer, messages[:i], kw, add_generation_prompt=True))
        same = common_prefix(before, text)
        found, headers = [], []
        for p in probes:  # the header starts where the probe leaves `before`, at most where `text` does
            k = common_prefix(before, p)
            h = p[k:].split(PROBE)[0]
            at = text.find(h, max(min(k, same), prev_end)) if h else -1
            headers.append(h)
            if at >= 0:
                found.append((at, -len(h)))
        if not found:
            raise ValueError(f"the chat template's header of assistant turn {i} ({', '.join(map(repr, headers))}) "
                             f"is not in its render of the conversation after character {prev_end}")
        at, minus_len = min(found)  # the first header, the longest at a tie
        body = at - minus_len
        # a content that quotes the end-of-turn text is skipped over when the template writes it verbatim
        end = text.find(eot, body + len(m["content"]) if text.startswith(m["content"], body) else body)
        if end < 0:
            raise ValueError(f"assistant turn {i}: no end-of-turn {eot!r} after it in the chat template's render")
        prev_end = end + len(eot)
        spans.append((body, prev_end))
    return spans


def assistant_tokens(tokenizer, messages, template_kwargs=None):
    """-> (input_ids, loss_mask) of a conversation rendered with the chat template; loss_mask is 1
    on every assistant turn's content and its end-of-turn token, as the template renders the
    whole conversation, and 0 on system/user/tool turns, the templates' headers, separators
    and any turn after the last assistant one.

    A template with {% generation %} marks gives the mask itself (what it marks is trained).
    Otherwise the mask comes from turn-by-turn renders (`assistant_spans`), mapped to tokens by
    the tokenizer's offsets: a token is trained when it overlaps a span, as the {% generation %}
    path does (a token that merges the header's last character with the content's first is trained).

    What is trained with Qwen3-style templates, which rewrite assistant turns:
    - an assistant turn before the last user turn: its answer only, because the template drops
      its reasoning (<think>...</think>) from the render;
    - an assistant turn after the last user turn (the answer, or each step of a tool-calling
      loop): the template's think block `<think>\\nREASONING\\n</think>\\n\\n` and the answer.
      The last turn always gets one, empty when its content has no reasoning, and it is trained;
      with {"enable_thinking": false} the generation prompt already holds that empty think
      block, so then it is prompt, not loss."""
    template_kwargs = template_kwargs or {}
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **template_kwargs)
        return out["input_ids"], out["assistant_masks"]
    text = render(tokenizer, messages, template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = assistant_spans(tokenizer, messages, text, template_kwargs)
    return enc["input_ids"], [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]


# -----------------------------------------------------------------------------
# training rows


def load_rows(data, split, tokenizer, seq_len, *, template_kwargs=None, drop_bad=False, log=print):
    """`data` (see read_conversations) -> datasets.Dataset of input_ids / loss_mask (torch
    format), rows cut to seq_len tokens. A conversation the chat template rejects (some raise on
    roles that do not alternate) is a ValueError naming its row, or a counted drop with drop_bad.
    A row with fewer than 2 loss tokens left teaches nothing (a loss token is predicted from the
    one before it): such rows are dropped, counted and printed with the reason."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: pass --chat-template FILE (a Jinja template)")
    rows = located_conversations(data, split, drop_bad, log)
    ids, masks, rejected, beyond, empty, t_log = [], [], [], 0, 0, time.time()
    for n, (where, c) in enumerate(rows, 1):
        try:
            row_ids, mask = assistant_tokens(tokenizer, c, template_kwargs)
        except (ValueError, jinja2.TemplateError) as e:
            if not drop_bad:
                raise ValueError(f"{where}: chat template: {e}") from None
            rejected.append(f"{where}: {e}")
            continue
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
    if beyond or empty:
        log(f"{data}: dropped {beyond + empty} of {len(rows)} rows with fewer than 2 loss tokens: {beyond} with "
            f"their assistant tokens beyond --seq-len {seq_len}, {empty} with empty assistant turns")
    if not ids:
        raise ValueError(f"{data}: no row has 2 or more assistant tokens (loss tokens) in its first {seq_len} tokens")
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).with_format("torch")


# -----------------------------------------------------------------------------
# on-policy data: every assistant turn answered again by the target


@torch.no_grad()
def generate(target, prompts, stop_ids, max_new_tokens, temperature, generator, pad_id):
    """Batched decoding of token-id prompts of any lengths, left-padded so that every row's
    next token sits in the last column. -> list of new ids per prompt, the stop token excluded.
    Positions count real tokens only, so a row's result does not depend on its padding."""
    device = target.device
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (S - len(p)) + p for p in prompts], device=device)  # (b, S)
    attn = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(sorted(stop_ids), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache, new = None, []
    for _ in range(max_new_tokens):
        out = target(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                     logits_to_keep=1)
        logits, cache = out.logits[:, -1].float(), out.cache  # (b, V)
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            tok = logits.argmax(-1)
        new.append(tok.masked_fill(done, pad_id))
        done |= torch.isin(tok, stops)
        if done.all():
            break
        ids, pos = tok[:, None], pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(ids)], 1)
    rows = torch.stack(new, 1).tolist() if new else [[] for _ in prompts]
    stop_set = set(stop_ids)
    return [r[:next((i for i, t in enumerate(r) if t in stop_set), len(r))] for r in rows]


def regenerate_conversations(target, tokenizer, conversations, *, temperature=0.0, max_new_tokens=256, batch_size=8,
                             template_kwargs=None, generator=None, progress=None):
    """Replace every assistant turn, in order, with the target's own response to the conversation
    so far (earlier turns already replaced): rendered with the chat template and its generation
    prompt, decoded until the end-of-turn token, the tokenizer's eos or the target's
    generation_config eos, or max_new_tokens; the end-of-turn text is not part of the content.
    temperature 0 is greedy; `generator` (on the target's device) seeds sampling.
    `progress(done, total)` is called after each batch, counting assistant turns.
    -> new conversations (the input is not modified); other turns are kept as they are.

    Turn k of a conversation needs its turn k-1, so the work goes round by round: each round
    answers the next pending turn of every conversation, in batches of prompts sorted by length."""
    if not temperature >= 0:  # also refuses nan
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    template_kwargs = template_kwargs or {}
    eot_text, eot_id = end_of_turn(tokenizer, template_kwargs)
    eos = target.generation_config.eos_token_id
    stop_ids = {eot_id, tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eot_id
    out = [[dict(m) for m in c] for c in conversations]
    pending = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in out]
    total, done = sum(len(p) for p in pending), 0
    while any(pending):
        turns = []  # (conversation, turn, prompt ids)
        for c, p in enumerate(pending):
            if p:
                ids = tokenizer.apply_chat_template(out[c][:p[0]], tokenize=True, add_generation_prompt=True,
                                                    return_dict=True, **template_kwargs)["input_ids"]
                turns.append((c, p.pop(0), ids))
        turns.sort(key=lambda t: len(t[2]))
        for b in range(0, len(turns), batch_size):
            batch = turns[b:b + batch_size]
            answers = generate(target, [t[2] for t in batch], stop_ids, max_new_tokens, temperature, generator, pad_id)
            for (c, i, _), answer in zip(batch, answers):
                text = tokenizer.decode(answer)
                out[c][i] = {"role": "assistant", "content": text.split(eot_text)[0]}
            done += len(batch)
            if progress:
                progress(done, total)
    return out


def written_rows(out_path, conversations, log):
    """How many conversations a killed regenerate_file already wrote to out_path. A torn last line
    (the kill came mid-write) is cut off; a line whose non-assistant turns differ from the input's
    means out_path belongs to other data, and is an error rather than a silent mix."""
    path = Path(out_path)
    if not path.exists():
        return 0
    raw = path.read_bytes()
    whole = raw[:raw.rfind(b"\n") + 1]
    if len(whole) < len(raw):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
        log(f"{out_path}: cut a torn last line ({len(raw) - len(whole)} bytes) left by a killed run")
    lines = whole.decode("utf-8").split("\n")[:-1]
    if len(lines) > len(conversations):
        raise ValueError(f"{out_path}: {len(lines)} rows already, more than the {len(conversations)} of the input; "
                         "written from other data? delete it to start over")
    prompts = lambda c: [(m["role"], m["content"] if m["role"] != "assistant" else None) for m in c]
    for n, (line, c) in enumerate(zip(lines, conversations), 1):
        try:
            written = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{out_path}: line {n}: not a row this command wrote ({line[:60]!r}); delete the file "
                             "to start over") from None
        if prompts(written) != prompts(c):
            raise ValueError(f"{out_path}: line {n}: its non-assistant turns differ from the input's conversation "
                             f"{n}: written from other data? delete it to start over")
    return len(lines)


def regenerate_file(target, tokenizer, in_path, out_path, *, temperature, max_new_tokens, batch_size, template_kwargs,
                    log):
    """regenerate_conversations over a whole file (see read_conversations) -> out_path, a jsonl of
    {"messages": [...]} rows in the input's order. Rows are appended batch by batch, so a killed
    run started again with the same arguments resumes after the last complete row. The input is
    read here again: to report its errors before the target's weights load, call
    read_conversations(in_path) first."""
    conversations = read_conversations(in_path, log=log)
    start = written_rows(out_path, conversations, log)
    if start:
        log(f"{out_path}: {start} of {len(conversations)} conversations already regenerated, resuming")
    t0 = time.time()
    with open(out_path, "a", encoding="utf-8") as f:
        for b in range(start, len(conversations), batch_size):
            chunk = regenerate_conversations(target, tokenizer, conversations[b:b + batch_size],
                                             temperature=temperature, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, template_kwargs=template_kwargs)
            f.write("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in chunk))
            f.flush()
            done = b + len(chunk)
            eta = (time.time() - t0) / (done - start) * (len(conversations) - done)
            log(f"regenerate {done}/{len(conversations)} conversations | {time.time() - t0:.0f}s | "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s")


# -----------------------------------------------------------------------------
# the drafter's inputs: a mask token id, padded batches


def choose_mask_token(flag, tokenizer, num_rows):
    """An id that exists in the target's embedding table but is never a real word."""
    if flag is not None:
        if not 0 <= flag < num_rows:
            raise ValueError(f"--mask-token-id {flag} is outside the target's embedding table [0, {num_rows})")
        return flag
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < num_rows:
        return tokenizer.mask_token_id
    unused = sorted(set(range(num_rows)) - set(tokenizer.get_vocab().values()))
    if not unused:
        raise ValueError("the tokenizer has no mask token and every target embedding row is a real token: "
                         "pass --mask-token-id with an id you know is unused")
    return unused[0]


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
# the target, and the --regenerate job of train.py


def load_target(target, dtype_flag, device):
    """Frozen, in bfloat16 on GPU and float32 on CPU unless --dtype says otherwise."""
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if dtype_flag == "auto" else \
        getattr(torch, dtype_flag)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device)
    return model.eval().requires_grad_(False)


def regenerate(args, log=print):
    """--regenerate: the target answers every assistant turn of --data itself (on-policy data)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (args.target and args.data):
        raise ValueError("--regenerate needs --target (who answers) and --data (the conversations)")
    template_kwargs = parse_template_kwargs(args.chat_template_kwargs)
    read_conversations(args.data, args.data_split, log=log)  # input errors before the weights load
    tokenizer = load_tokenizer(args.target, args.chat_template)
    regenerate_file(load_target(args.target, args.dtype, device), tokenizer, args.data, args.regenerate,
                    temperature=args.regen_temperature, max_new_tokens=args.regen_max_new_tokens,
                    batch_size=args.regen_batch_size, template_kwargs=template_kwargs, log=log)
    log(f"regenerated conversations in {os.path.abspath(args.regenerate)}")
