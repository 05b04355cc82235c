"""
Chat data -> training rows for train.py (SPEC.md §6 Data, §9 Assistant masks, On-policy data).

    conversations = read_conversations("chats.jsonl")        # list of [{"role", "content"}, ...]
    conversations = regenerate_conversations(target, tokenizer, conversations)   # on-policy answers
    rows = load_rows("chats.jsonl", "train", tokenizer, seq_len=3072)             # input_ids / loss_mask

A conversation is a list of {"role": system | user | assistant | tool, "content": str}. Every
bad input is a ValueError of one line naming the file, the line (jsonl, 1-based) or row
(json array, parquet, hub; 0-based, as ds[i]) and the field, e.g.
`chats.jsonl: line 3: messages[1].role: unknown role 'bot' (...)`.
"""
import json
import time

import torch

# -----------------------------------------------------------------------------
# rendering with the chat template

PROBE = "\x01assistant content probe\x01"  # a content no template transforms, found again in the render


def render(tokenizer, messages, template_kwargs, add_generation_prompt=False):
    """The chat template's text for `messages` (no tokenization)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def end_of_turn(tokenizer, template_kwargs):
    """-> (text, id) of the end-of-turn token: the first added/special token the template puts
    after an assistant content (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>), else its first token."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]
    tail = render(tokenizer, probe, template_kwargs).split(PROBE)[-1]
    if not tail:  # some templates end the last turn with nothing: look at a turn that has a successor
        tail = render(tokenizer, probe + [{"role": "user", "content": "?"}], template_kwargs).split(PROBE)[-1]
    enc = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
    if not enc["input_ids"]:
        raise ValueError("the chat template puts nothing after an assistant turn's content: there is no "
                         "end-of-turn token to stop generation at or to train")
    added = set(tokenizer.added_tokens_decoder)
    i = next((i for i, t in enumerate(enc["input_ids"]) if t in added), 0)
    start, end = enc["offset_mapping"][i]
    return tail[start:end], enc["input_ids"][i]


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
