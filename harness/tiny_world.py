"""
The offline world of `python train.py` with no --target, built once from the running
Python's own standard library and cached, so the drafter then trains through exactly the
code path a real Hugging Face target folder takes:

1. conversations: "Continue this code:" + the first third of a chunk of stdlib source -> the rest;
2. a BPE tokenizer trained on them (V = 2048, so K = 16 candidates are a small part of the
   vocabulary, as in a real LLM) with the ChatML specials and a mask token;
3. a small Qwen3 target pretrained on them from scratch, then checked on held-out prompts:
   held-out loss, the share of greedy tokens inside runs of >= 4 identical tokens (a target
   whose greedy output collapses into repeats makes every drafter look perfect at T = 0),
   and one greedy continuation to read;
4. on-policy data: every prompt answered again by the target itself, because the drafter's
   job is to predict what the target says, not what the corpus says (§6).

Not here: the regeneration loop (harness/regenerate.py), the rows train.py makes of the
conversations (harness/data.py); a real target's world is its own folder and data file.
"""
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from harness.regenerate import regenerate_conversations

# ChatML; {% generation %} marks assistant tokens, so return_assistant_tokens_mask works
CHATML = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
          "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = dict(pad_token="<|endoftext|>", eos_token="<|im_end|>", mask_token="<|mask|>",
                additional_special_tokens=["<|im_start|>"])
TINY_HELD_OUT = 256  # the last conversations: neither the tokenizer nor the target ever train on them
CACHE_DIR = os.environ.get("DFLASH2_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dflash2"))
PRETRAIN_STEPS = 600  # train.py's tiny target (the cache is per value)


def build_tiny_tokenizer(chat_template=CHATML):
    """Every byte is a token (BPE with no merges), plus the ChatML specials and a mask token:
    free to build, for tests that need a tokenizer and no corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **SPECIALS)


def train_bpe_tokenizer(texts, vocab_size=2048, chat_template=CHATML):
    """Byte-level BPE learned from `texts` (seconds on the stdlib); the specials come first (ids 0-3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # a newline is a token of its own: the template's "assistant\n" then never merges with the
    # answer's first indentation, so the assistant mask falls on token boundaries
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [SPECIALS["pad_token"], *SPECIALS["additional_special_tokens"], SPECIALS["eos_token"],
                SPECIALS["mask_token"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **SPECIALS)


def stdlib_conversations(chunk_chars=300, seed=0):
    """Cut the top-level .py files of this Python's standard library into chunks of whole
    lines; the first third of a chunk is the prompt, the rest the answer. Shuffled, so the
    held-out tail samples the whole library."""
    convs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunk = ""
        for line in f.read_text(encoding="utf-8", errors="ignore").splitlines(keepends=True):
            chunk += line
            if len(chunk) >= chunk_chars:
                lines, chunk = chunk.splitlines(keepends=True), ""
                cut = max(1, len(lines) // 3)
                if "".join(lines[cut:]).strip():
                    convs.append([{"role": "user", "content": "Continue this code:\n" + "".join(lines[:cut])},
                                  {"role": "assistant", "content": "".join(lines[cut:])}])
    perm = torch.randperm(len(convs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [convs[i] for i in perm]


# -----------------------------------------------------------------------------
# the target


def token_stream(tokenizer, conversations):
    """All conversations rendered with the chat template, end to end: (n,) ids."""
    return torch.tensor([t for c in conversations
                         for t in tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]])


def pretrain_tiny_target(tokenizer, stream, steps, log=print, seq_len=256, batch_size=8, lr=3e-3, seed=0):
    """Next-token pretraining of a 3.5M-parameter Qwen3, in float32, on random windows of the token
    stream (packed: no padding, so every position of every step is a training token)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = transformers.get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps)
    gen, t0 = torch.Generator().manual_seed(seed), time.time()
    for step in range(steps):
        starts = torch.randint(len(stream) - seq_len, (batch_size,), generator=gen)
        ids = stream[starts[:, None] + torch.arange(seq_len)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"pretrain tiny target {step + 1}/{steps} | loss {loss.item():.3f} | {time.time() - t0:.0f}s")
    return model.eval()


@torch.no_grad()
def held_out_loss(model, stream, seq_len=256):
    """Mean next-token cross-entropy (nats) over consecutive windows of a held-out stream."""
    n = len(stream) // seq_len
    windows = stream[:n * seq_len].view(n, seq_len)
    return sum(model(input_ids=w, labels=w).loss.item() * len(w) for w in windows.split(16)) / n


def repeat_share(ids, run=4):
    """Share of the tokens that sit inside a run of >= `run` identical consecutive tokens."""
    inside, i = 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        inside += (j - i) * (j - i >= run)
        i = j
    return inside / max(1, len(ids))


def repeated_line_share(texts):
    """Share of the non-blank lines that repeat an earlier line of the same text: the loops
    a weak model falls into a line at a time, which repeat_share does not see."""
    lines = [[l for l in t.splitlines() if l.strip()] for t in texts]
    return sum(len(ls) - len(set(ls)) for ls in lines) / max(1, sum(map(len, lines)))


# -----------------------------------------------------------------------------
# the world


def tiny_world(cache_dir, pretrain_steps, log=print, *, train_prompts=1024, max_new_tokens=160):
    """Build once and cache: the tiny target folder (model + tokenizer via save_pretrained)
    and the on-policy conversations (.jsonl: the first `train_prompts` training prompts,
    then the TINY_HELD_OUT held-out ones, each answered greedily by the target). The whole
    world is written under a temporary name and renamed into place, so a racing process
    either finds it complete or builds its own and drops it. The world is built in float32 on every
    machine, so that every CPU trains on a target of the same quality (a bf16 build loops more);
    train.py may still train in bf16 on it. -> (target path, data path)."""
    world = Path(cache_dir) / f"stdlib-v2-{pretrain_steps}steps-{train_prompts}prompts"
    target_path, data_path = world / "target", world / "conversations.jsonl"
    if world.exists():
        return str(target_path), str(data_path)
    log(f"building the offline tiny world in {world} (first run only)")
    t0, tmp = time.time(), Path(cache_dir) / f"{world.name}.tmp{os.getpid()}"
    convs = stdlib_conversations(chunk_chars=600)
    train, held = convs[:-TINY_HELD_OUT], convs[-TINY_HELD_OUT:]
    tokenizer = train_bpe_tokenizer([m["content"] for c in train for m in c])
    model = pretrain_tiny_target(tokenizer, token_stream(tokenizer, train), pretrain_steps, log)
    convs = regenerate_conversations(model, tokenizer, train[:train_prompts] + held, max_new_tokens=max_new_tokens,
                                     batch_size=128)
    greedy = [tokenizer(c[1]["content"])["input_ids"] for c in convs[-TINY_HELD_OUT:]]
    quality = {"held_out_loss": held_out_loss(model, token_stream(tokenizer, held)),
               "greedy_repeat_share": sum(repeat_share(g) * len(g) for g in greedy) / max(1, sum(map(len, greedy))),
               "greedy_repeated_lines": repeated_line_share(c[1]["content"] for c in convs[-TINY_HELD_OUT:]),
               "corpus_repeated_lines": repeated_line_share(c[1]["content"] for c in held),
               "greedy_sample": convs[-TINY_HELD_OUT], "build_seconds": time.time() - t0}
    log(f"tiny target: held-out loss {quality['held_out_loss']:.3f} | greedy tokens inside runs of >= 4 identical "
        f"tokens {100 * quality['greedy_repeat_share']:.1f}% | lines repeating an earlier line "
        f"{100 * quality['greedy_repeated_lines']:.0f}% (corpus {100 * quality['corpus_repeated_lines']:.0f}%) | "
        f"held-out prompts, greedy | built in {quality['build_seconds']:.0f}s")
    log(f"tiny target greedy sample:\n{convs[-TINY_HELD_OUT][0]['content']}\n>>>>>>>> the target continues:\n"
        f"{convs[-TINY_HELD_OUT][1]['content']}")

    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")
    (tmp / "conversations.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    (tmp / "quality.json").write_text(json.dumps(quality, indent=1))
    try:
        os.replace(tmp, world)
    except OSError:  # another process built it first: keep theirs
        shutil.rmtree(tmp)
    return str(target_path), str(data_path)


def offline_world(target_path, data_path, world=1, rank=0, log=print):
    """train.py's --target and --data -> (target path, data path), an unset one the tiny world's, built in
    CACHE_DIR (which the DFLASH2_CACHE environment variable moves). Rank 0 builds it, the other ranks then read its
    cache."""
    if target_path is not None and data_path is not None:
        return target_path, data_path
    if rank:
        dist.barrier()
    built_target, built_data = tiny_world(CACHE_DIR, PRETRAIN_STEPS, log)
    if rank == 0 and world > 1:
        dist.barrier()
    log(f"offline world cached in {os.path.abspath(CACHE_DIR)}")
    return target_path or built_target, data_path or built_data
