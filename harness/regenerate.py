"""
On-policy data: every assistant turn answered again by the target itself, because the
drafter's job is to predict what the target says, not what the corpus says (ALGORITHM.md §6).

    python -m harness.regenerate --target Qwen/Qwen3-4B --data prompts.jsonl --out chats.jsonl [--temperature 1 ...]
    conversations = regenerate_conversations(target, tokenizer, conversations)   # in memory
    regenerate_file(target, tokenizer, "prompts.jsonl", "chats.jsonl", temperature=1.0, seed=0, ...)   # resumable

Decisions:
- a row that ends with a user turn (a list of prompts is the common case) gets the target's
  answer appended as a new assistant turn; the assistant turns a row already has are answered
  again, in order;
- assistant turns with tool calls are kept as they are: regeneration cannot run the tools
  that would answer other calls;
- decoding is its own loop rather than `generate`: a torch.Generator seeds the sampling, the
  tokens are drawn by dflash2.sample at the setting given (T, top-p, top-k: the law serving
  uses), and the stop tokens are the template's end-of-turn token and the eos;
- regenerate_file seeds each batch of rows from (seed, its first row), so a run repeats itself
  at T > 0 and a resumed run writes what the uninterrupted one would have.
Not here: reading and checking the conversations and rendering them (harness/data.py), loading
the target (harness/target.py), the training rows train.py makes of the file written.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch

import dflash2
from harness.data import (REASONING, at_least, located_conversations, parse_template_kwargs, read_conversations,
                          render, template_facts)
from harness.target import load_target, load_tokenizer


@torch.no_grad()
def generate(target, prompts, stop_ids, max_new_tokens, pad_id, temperature=0.0, top_p=1.0, top_k=0, generator=None):
    """Batched decoding of token-id prompts of any lengths, left-padded so that every row's
    next token sits in the last column, each token drawn by dflash2.sample at (T, top_p, top_k).
    -> list of new ids per prompt, the stop token excluded. Positions count real tokens only,
    so a row's result does not depend on its padding."""
    device = target.device
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (S - len(p)) + p for p in prompts], device=device)  # (b, S)
    attn = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(sorted(stop_ids), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache, new = None, []
    for _ in range(max_new_tokens):
        # the last column's logits only, picked by an index (a copy, one row per prompt): through the
        # strided slice that logits_to_keep=1 takes, matmul copies lm_head once per row on a CPU
        out = target(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                     logits_to_keep=torch.tensor([ids.shape[1] - 1], device=device))
        logits, cache = out.logits[:, -1].float(), out.cache  # (b, V)
        tok = dflash2.sample(logits, temperature, top_p, top_k, generator)  # (b,)
        new.append(tok.masked_fill(done, pad_id))
        done |= torch.isin(tok, stops)
        if done.all():
            break
        ids, pos = tok[:, None], pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(ids)], 1)
    rows = torch.stack(new, 1).tolist() if new else [[] for _ in prompts]
    stop_set = set(stop_ids)
    return [r[:next((i for i, t in enumerate(r) if t in stop_set), len(r))] for r in rows]


def with_answer_turns(conversations):
    """Copies of the conversations, an empty assistant turn appended to each that ends with a
    user turn: the turn regeneration will fill with the target's answer."""
    return [[dict(m) for m in c] + ([{"role": "assistant", "content": ""}] if c[-1]["role"] == "user" else [])
            for c in conversations]


def regenerate_conversations(target, tokenizer, conversations, *, temperature=0.0, top_p=1.0, top_k=0,
                             max_new_tokens=256, batch_size=8, template_kwargs=None, tools=None, generator=None,
                             progress=None):
    """Replace every assistant turn, in order, with the target's own response to the conversation
    so far (earlier turns already replaced): rendered with the chat template and its generation
    prompt (and the conversation's tools: `tools` holds one list or None per conversation),
    decoded until the end-of-turn token, the tokenizer's eos or the target's generation_config
    eos, or max_new_tokens; the end-of-turn text is not part of the content. The decoded text is
    the new content, reasoning included as the target writes it (Qwen3's <think>...</think>), so
    the turn's reasoning fields go; its other fields stay. temperature 0 is greedy; at T > 0
    tokens are drawn from dflash2.sampling_probs(logits, T, top_p, top_k), and `generator` (on
    the target's device) seeds the draws. `progress(done, total)` is called after each batch,
    counting regenerated turns. -> new conversations (the input is not modified); one that ends
    with a user turn gains an assistant turn, the target's answer to it.

    An assistant turn with tool_calls is kept as it is: the tool results after it answer those
    calls, and regeneration cannot run tools to answer different ones. The turns after the
    results are regenerated (they answer results that stay valid); other turns are kept.

    Turn k of a conversation needs its turn k-1, so the work goes round by round: each round
    answers the next pending turn of every conversation, in batches of prompts sorted by length."""
    dflash2.check_sampling(temperature, top_p, top_k)
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    facts = template_facts(tokenizer, template_kwargs)
    eot_text, eot_id = facts["eot"]
    eos = target.generation_config.eos_token_id
    stop_ids = {eot_id, tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eot_id
    tools = tools or [None] * len(conversations)
    out = with_answer_turns(conversations)
    pending = [[i for i, m in enumerate(c) if m["role"] == "assistant" and "tool_calls" not in m] for c in out]
    total, done = sum(len(p) for p in pending), 0
    while any(pending):
        turns = []  # (conversation, turn, prompt ids)
        for c, p in enumerate(pending):
            if p:
                kw = {**facts["kw"], **({"tools": tools[c]} if tools[c] else {})}
                prompt = render(tokenizer, out[c][:p[0]], kw, facts, add_generation_prompt=True)
                turns.append((c, p.pop(0), tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        turns.sort(key=lambda t: len(t[2]))
        for b in range(0, len(turns), batch_size):
            batch = turns[b:b + batch_size]
            answers = generate(target, [t[2] for t in batch], stop_ids, max_new_tokens, pad_id, temperature, top_p,
                               top_k, generator)
            for (c, i, _), answer in zip(batch, answers):
                kept = {k: v for k, v in out[c][i].items() if k not in REASONING}
                out[c][i] = {**kept, "content": tokenizer.decode(answer).split(eot_text)[0]}
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


def regenerate_file(target, tokenizer, in_path, out_path, *, temperature, top_p=1.0, top_k=0, max_new_tokens,
                    batch_size, template_kwargs, log, split="train", seed=0):
    """regenerate_conversations over a whole file or hub dataset split (see read_conversations)
    -> out_path, a jsonl of {"messages": [...]} rows (plus the row's "tools") in the input's
    order. Rows are appended batch by batch, so a killed run started again with the same
    arguments resumes after the last complete row; at T > 0 the batch starting at row b draws
    from a generator seeded by (seed, b), so the resumed rows are the ones the uninterrupted
    run writes. Assistant turns with tool calls are kept as they are, counted and printed. The
    input is read here again: to report its errors before the target's weights load, call
    read_conversations(in_path, split) first."""
    rows = located_conversations(in_path, split, False, log, need_answer=False)
    conversations, tools = with_answer_turns([c for _, c, _ in rows]), [t for _, _, t in rows]
    start = written_rows(out_path, conversations, log)
    if start:
        log(f"{out_path}: {start} of {len(conversations)} conversations already regenerated, resuming")
    calls = sum("tool_calls" in m for c in conversations for m in c)
    if calls:
        log(f"{in_path}: {calls} assistant turns with tool calls are kept as they are (regeneration cannot run the "
            f"tools that would answer other calls); the other assistant turns are regenerated")
    t0 = time.time()
    with open(out_path, "a", encoding="utf-8") as f:
        for b in range(start, len(conversations), batch_size):
            generator = torch.Generator(target.device).manual_seed(seed * 1_000_003 + b)  # sampling is on the device
            chunk = regenerate_conversations(target, tokenizer, conversations[b:b + batch_size],
                                             temperature=temperature, top_p=top_p, top_k=top_k,
                                             max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, template_kwargs=template_kwargs,
                                             tools=tools[b:b + batch_size], generator=generator)
            f.write("".join(json.dumps({"messages": c, **({"tools": t} if t else {})}, ensure_ascii=False) + "\n"
                            for c, t in zip(chunk, tools[b:b + batch_size])))
            f.flush()
            done = b + len(chunk)
            eta = (time.time() - t0) / (done - start) * (len(conversations) - done)
            log(f"regenerate {done}/{len(conversations)} conversations | {time.time() - t0:.0f}s | "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s")


def parse_args(argv=None):
    """The flags; those train.py takes too have its names, types and defaults."""
    p = argparse.ArgumentParser(description="Write --data with every assistant turn answered again by the target "
                                "(on-policy data, ALGORITHM.md §6); a killed run started again resumes.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="HF model folder, hub id or .gguf file of the target that answers")
    p.add_argument("--data", default=None, help="hub dataset id or local .jsonl/.json/.parquet of conversations, as "
                   "train.py reads them; a row may end with a user turn (a list of prompts)")
    p.add_argument("--chat-template", default=None, help="a Jinja file replacing the tokenizer's chat template")
    p.add_argument("--chat-template-kwargs", default="{}", help="JSON options for the template, e.g. "
                   "'{\"enable_thinking\": false}'")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's weights; auto: bfloat16 on a GPU or on a CPU with AMX or AVX512-BF16, else "
                   "float32")
    p.add_argument("--out", metavar="OUT.jsonl", help="the regenerated conversations, one {\"messages\": [...]} a line")
    p.add_argument("--data-split", default="train", help="split of a hub dataset")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    p.add_argument("--top-p", type=float, default=1.0, help="at a temperature > 0, draw from the most likely tokens "
                   "whose probabilities first reach this sum, as serving's top-p does (1: all tokens)")
    p.add_argument("--top-k", type=int, default=0, help="at a temperature > 0, draw from the k most likely tokens, "
                   "as serving's top-k does (0: all tokens)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="longest answer, in tokens")
    p.add_argument("--batch-size", type=at_least(1), default=8, help="conversations per generate batch")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampled answers (temperature > 0)")
    return p.parse_args(argv)


def main(args, log=print):
    """The target answers every assistant turn of --data itself, and the last user turn of a row
    that ends with one; every input error is raised before the weights load."""
    if not (args.target and args.data and args.out):
        raise ValueError("needs --target (who answers), --data (the conversations) and --out (where the answers go)")
    dflash2.check_sampling(args.temperature, args.top_p, args.top_k)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    template_kwargs = parse_template_kwargs(args.chat_template_kwargs)
    read_conversations(args.data, args.data_split, log=log, need_answer=False)
    tokenizer = load_tokenizer(args.target, args.chat_template)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    regenerate_file(load_target(args.target, args.dtype, device), tokenizer, args.data, args.out,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, template_kwargs=template_kwargs,
                    log=log, split=args.data_split, seed=args.seed)
    log(f"regenerated conversations in {os.path.abspath(args.out)}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"harness.regenerate: {e}") from None
