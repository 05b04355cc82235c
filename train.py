"""
Train a DFlash2 drafter against a frozen target (SPEC.md §6). A script, not a framework:
arguments -> setup -> data -> model -> loop (step, log line, eval, checkpoint) -> export.

    python train.py                                  # offline demo: ~9 min on 2 CPU cores, first run
    python train.py --target Qwen/Qwen3-4B --data chats.jsonl --seq-len 3072 --max-anchors 512 \
        --epochs 6 --num-layers 5 --batch-size 2 --grad-accum 4 --out-dir out/qwen3-4b
    torchrun --nproc_per_node=8 train.py ...         # data parallel: one frozen target per rank

With no --target the script first builds, once, an offline world under --cache-dir: a
byte-level tokenizer with a ChatML template, conversations cut from the running Python's
own standard library ("Continue this code:" + a prefix -> the rest), and a 1.8M-parameter
Qwen3 pretrained on them from scratch and saved like any Hugging Face model, so the
drafter then trains through the same code path as a real --target folder.

Outputs under --out-dir: checkpoint/ (servable export, §7) and resume.pt (fp32 weights,
optimizer, step). The data order and the anchor draws are functions of (seed, step), so
the step is the whole data position and a resumed run repeats the uninterrupted one exactly.
"""
import argparse
import math
import os
import re
import time
from functools import lru_cache
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
import transformers

from dflash2 import DFlash2Config, DFlash2Drafter, dflash2_loss, sample_anchors, spec_generate
from tiny_world import tiny_world

# -----------------------------------------------------------------------------
# arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a DFlash2 drafter (SPEC.md §6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target", help="HF model folder or hub id of the frozen target; unset: the offline tiny "
                   "Qwen3 trained on the stdlib, built and cached on first use")
    g.add_argument("--data", help="hub dataset id or local .jsonl/.json/.parquet/.txt; rows hold 'messages' or "
                   "'conversations' (role/content or from/value) or plain 'text'; unset: the stdlib conversations")
    g.add_argument("--data-split", default="train", help="split of a hub dataset")
    g.add_argument("--val-size", type=int, default=32, help="last rows held out for validation and spec_generate")
    g.add_argument("--seq-len", type=int, default=512, help="rows are truncated to this many tokens (paper: 3072)")
    g.add_argument("--mask-token-id", type=int, help="id of the MASK slots; unset: the tokenizer's mask token, "
                   "else the first target embedding row that no token uses")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target weights (auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash2"),
                   help="offline world (tokenizer, conversations, tiny target) and local datasets' Arrow cache")
    g.add_argument("--tiny-pretrain-steps", type=int, default=400,
                   help="pretraining steps of the offline tiny target (cached per value)")
    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=int, default=2, help="draft layers (DFlash: 5 for 4B-8B targets)")
    g.add_argument("--block-size", type=int, default=8, help="B: anchor + B-1 drafted tokens")
    g.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")],
                   help="comma-separated target layers feeding the context; unset: the SPEC §1 rule")
    g.add_argument("--conv-kernel-size", type=int, default=2, help="local convolution taps Kc (0 disables)")
    g.add_argument("--conv-group-size", type=int, default=16, help="channels per dynamic coefficient G")
    g.add_argument("--selector-rank", type=int, default=256, help="candidate selector rank R")
    g.add_argument("--selector-top-k", type=int, default=16, help="selector candidates K (0 disables)")
    g.add_argument("--init-from", help="warm start from a DFlash or DFlash2 export folder; its architecture wins "
                   "over the flags above, except that a DFlash (v1) one gains this run's convolution and selector")
    g = p.add_argument_group("loss")
    g.add_argument("--loss", default="kl", choices=["kl", "ce"], help="unary loss: forward KL or CE on target argmax")
    g.add_argument("--gamma", type=float, help="slot weight decay w_k = exp(-(k-1)/γ); unset: 4/5/7 for B=8/10/16")
    g.add_argument("--alpha", type=float, default=1.0, help="weight of the selector loss")
    g.add_argument("--detach-selector", action="store_true", help="selector loss does not train the backbone")
    g.add_argument("--max-anchors", type=int, default=32,
                   help="blocks per sequence per step (paper: 512 per 3072-token row)")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    g.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps, then cosine to 0")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0 disables)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps")
    g.add_argument("--epochs", type=float, help="passes over the data; overrides --steps when set")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="out", help="checkpoint/ and resume.pt go here")
    g.add_argument("--seed", type=int, default=0, help="drafter init, data order and anchor draws")
    g.add_argument("--log-every", type=int, default=20, help="steps between log lines")
    g.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: only at the end)")
    g.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for real spec_generate AL")
    g.add_argument("--eval-new-tokens", type=int, default=96, help="tokens generated per eval prompt")
    g.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="checkpoint/ dtype")
    g.add_argument("--resume", action="store_true", help="continue from --out-dir/resume.pt")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# small helpers


def lr_at(step, total, warmup, peak):
    """Linear warmup over `warmup` steps, then cosine decay to 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def pad(rows, value):
    """Right-pad lists of ids -> (ids (b, S), attention_mask (b, S))."""
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), value, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(r)
    return ids, (torch.arange(S) < torch.tensor([len(r) for r in rows])[:, None]).long()


# -----------------------------------------------------------------------------
# data: conversations -> (input_ids, loss_mask = 1 on assistant tokens)

ROLES = {"human": "user", "gpt": "assistant", "model": "assistant"}  # ShareGPT-style from/value


def message(m):
    """role/content (OpenAI style) or from/value (ShareGPT style) -> role/content."""
    role = m.get("role") or m.get("from")
    return {"role": ROLES.get(role, role), "content": m["content"] if m.get("content") is not None else m.get("value")}


def chat_tokens(tokenizer, messages):
    """The template's own assistant mask when it marks {% generation %}; otherwise every
    token after the prompt of the last assistant turn."""
    if re.search(r"{%-?\s*generation\s*-?%}", tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return out["input_ids"], out["assistant_masks"]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    if last == 0:
        return ids, [0] * len(ids)
    prompt = tokenizer.apply_chat_template(messages[:last], tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"]
    n = 0  # common prefix: some templates render the last turn's header differently in the prompt
    while n < min(len(prompt), len(ids)) and prompt[n] == ids[n]:
        n += 1
    return ids, [0] * n + [1] * (len(ids) - n)


def load_rows(data, split, tokenizer, seq_len, cache_dir):
    """-> datasets.Dataset of input_ids / loss_mask (torch format), rows without loss tokens dropped."""
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}.get(Path(data).suffix)
    if builder:
        if not Path(data).is_file():
            raise ValueError(f"--data {data}: no such file")
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=data, split="train",
                                   cache_dir=os.path.join(cache_dir, "datasets"), **extra)
    else:
        ds = datasets.load_dataset(data, split=split)
    key = next((k for k in ("messages", "conversations", "text") if k in ds.column_names), None)
    if key is None:
        raise ValueError(f"--data {data}: expected a 'messages', 'conversations' or 'text' column, "
                         f"found {ds.column_names}")

    def encode(row):
        if key == "text":  # plain text: every token is a training token
            ids = tokenizer(row["text"])["input_ids"]
            mask = [1] * len(ids)
        else:
            ids, mask = chat_tokens(tokenizer, [message(m) for m in row[key]])
        return {"input_ids": ids[:seq_len], "loss_mask": mask[:seq_len]}

    ds = ds.map(encode, remove_columns=ds.column_names).filter(lambda r: sum(r["loss_mask"]) > 1)
    if len(ds) == 0:
        raise ValueError(f"--data {data}: no row has assistant tokens (loss tokens) in its first {seq_len} tokens; "
                         "check the chat format (role/content or from/value with an 'assistant'/'gpt' turn)")
    return ds.with_format("torch")


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


def collate(cols, pad_id, device):
    """Dataset columns of a batch (ds[indices]) -> padded (ids, attention_mask, loss_mask)."""
    ids, attn = pad(cols["input_ids"], pad_id)
    loss_mask, _ = pad(cols["loss_mask"], 0)
    return ids.to(device), attn.to(device), loss_mask.to(device)


# -----------------------------------------------------------------------------
# evaluation: validation metrics + real speculative decoding


def mean_stats(all_stats):
    """Average a list of dflash2_loss stats dicts (floats and per-slot lists)."""
    out = {}
    for k, v in all_stats[0].items():
        col = [s[k] for s in all_stats]
        out[k] = [sum(x) / len(x) for x in zip(*col)] if isinstance(v, list) else sum(col) / len(col)
    return out


def loss_step(drafter, target, batch, args, generator):
    """One target pass (no grad) + anchors + the DFlash2 loss."""
    ids, attn, loss_mask = batch
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    anchors, valid = sample_anchors(loss_mask, args.max_anchors, generator)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        return dflash2_loss(drafter, target, ids, attn, loss_mask, out.hidden_states, out.logits, anchors, valid,
                            loss_type=args.loss, gamma=args.gamma, alpha=args.alpha,
                            detach_selector=args.detach_selector)


@torch.no_grad()
def evaluate(drafter, target, tokenizer, val, args, device, log):
    gen = torch.Generator().manual_seed(args.seed)  # same anchors at every evaluation
    stats = mean_stats([loss_step(drafter, target, collate(val[i:i + args.batch_size], tokenizer.pad_token_id, device),
                                  args, gen)[1] for i in range(0, len(val), args.batch_size)])
    gen, table = torch.Generator(device).manual_seed(args.seed), {}  # sampling happens on the device
    for temperature in (0.0, 1.0):
        als, tps, texts = [], [], []
        for i in range(min(args.eval_prompts, len(val))):
            ids, mask = val[i]["input_ids"], val[i]["loss_mask"]
            start = int(mask.nonzero()[0]) or len(ids) // 2  # prompt = all before the first answer token
            new, s = spec_generate(drafter, target, ids[None, :start].to(device), args.eval_new_tokens, temperature,
                                   stop_token_ids=[tokenizer.eos_token_id], generator=gen)
            als.append(s.mean_acceptance_length)
            tps.append(s.tokens_per_second)
            texts.append(tokenizer.decode(new))
        table[temperature] = (sum(als) / len(als), sum(tps) / len(tps), texts[0])
    sel = lambda k: f"{stats[k]:.3f}" if k in stats else "-"
    log(f"eval | val loss {stats['loss']:.4f} unary {stats['unary_loss']:.4f} sel {sel('selector_loss')} | "
        f"recall@K {sel('recall_at_k')} selector tf-acc {sel('selector_tf_acc')} | expected AL unary "
        f"{stats['al_unary']:.2f} selector {sel('al_selector')} oracle {sel('al_oracle')}")
    log("eval | slot accuracy " + " ".join(f"{a:.2f}" for a in stats["slot_acc"]))
    log(f"eval | spec_generate, {len(als)} held-out prompts, <= {args.eval_new_tokens} new tokens")
    log("eval |   temperature   mean AL   tokens/s   start of the first output")
    for temperature, (al, tok_s, text) in table.items():
        log(f"eval |   {temperature:>11.1f}   {al:>7.2f}   {tok_s:>8.1f}   {text[:40]!r}")
    return {"val": stats, "al_t0": table[0.0][0], "al_t1": table[1.0][0]}


# -----------------------------------------------------------------------------
# checkpoints


def check_out_dir(out_dir):
    """Fail before any work if --out-dir cannot be created or written."""
    p = Path(out_dir).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {out_dir} is not writable ({p} is not a writable directory)")


def save_checkpoint(drafter, optimizer, step, out_dir, export_dtype, meta):
    """The servable export, then the resume state; each written under a temp name and renamed."""
    drafter.save_pretrained(os.path.join(out_dir, "checkpoint"), dtype=getattr(torch, export_dtype))
    tmp = os.path.join(out_dir, f"resume.pt.tmp{os.getpid()}")
    torch.save({"model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **meta}, tmp)
    os.replace(tmp, os.path.join(out_dir, "resume.pt"))


# -----------------------------------------------------------------------------
# training


def train(args):
    # setup: one process per device; torchrun sets RANK / WORLD_SIZE / LOCAL_RANK
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the cores between the ranks of this machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    master = rank == 0
    datasets.disable_progress_bars()  # one log line per step, no progress bars in between
    transformers.utils.logging.disable_progress_bar()
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)
    check_out_dir(args.out_dir)
    resume_file = os.path.join(args.out_dir, "resume.pt")
    if args.resume and not os.path.isfile(resume_file):
        raise ValueError(f"--resume: {resume_file} not found")

    # target (frozen) and data
    if args.target is None or args.data is None:
        if not master:  # rank 0 builds the offline world, the others then read its cache
            dist.barrier()
        target_path, data_path = tiny_world(args.cache_dir, args.tiny_pretrain_steps, log)
        if master and world > 1:
            dist.barrier()
        args.target, args.data = args.target or target_path, args.data or data_path
        log(f"offline world cached in {os.path.abspath(args.cache_dir)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    if tokenizer.pad_token is None:  # padding is masked everywhere, any real token will do
        tokenizer.pad_token = tokenizer.eos_token
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device)
    target.eval().requires_grad_(False)
    rows = load_rows(args.data, args.data_split, tokenizer, args.seq_len, args.cache_dir)
    if len(rows) <= args.val_size:
        raise ValueError(f"--data {args.data}: {len(rows)} usable rows, need more than --val-size {args.val_size}")
    n_train = len(rows) - args.val_size
    train_rows, val = rows.select(range(n_train)), rows.select(range(n_train, len(rows)))
    num_rows = target.get_input_embeddings().weight.shape[0]
    mask_token_id = choose_mask_token(args.mask_token_id, tokenizer, num_rows)

    # drafter: at the target's width; the target's embedding and lm_head are borrowed, frozen
    torch.manual_seed(args.seed)
    parts = dict(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                 selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    if args.init_from:
        drafter = DFlash2Drafter.from_pretrained(args.init_from)
        if not drafter.config.is_dflash2:  # DFlash (v1): add this run's convolution/selector at identity init
            drafter = DFlash2Drafter.from_pretrained(args.init_from, **parts)
        for name, want in (("hidden_size", target.config.hidden_size), ("vocab_size", target.config.vocab_size),
                           ("num_target_layers", target.config.num_hidden_layers)):
            if getattr(drafter.config, name) != want:
                raise ValueError(f"--init-from {args.init_from} has {name} {getattr(drafter.config, name)} but the "
                                 f"target has {want}: a drafter only fits the target it was trained for")
    else:
        layer_ids = {"target_layer_ids": args.target_layer_ids} if args.target_layer_ids else {}
        drafter = DFlash2Drafter(DFlash2Config.from_target(target.config, num_layers=args.num_layers,
                                                           block_size=args.block_size, mask_token_id=mask_token_id,
                                                           **layer_ids, **parts))
    drafter.to(device)
    params = list(drafter.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    global_batch = args.batch_size * args.grad_accum * world
    total = math.ceil(args.epochs * len(train_rows) / global_batch) if args.epochs else args.steps
    warmup = max(1, round(args.warmup * total))
    meta = {"seed": args.seed, "global_batch": global_batch, "world": world}
    step = 0
    if args.resume:
        state = torch.load(resume_file, map_location=device, weights_only=True)
        if {k: state[k] for k in meta} != meta:
            raise ValueError(f"--resume: {resume_file} was written with {({k: state[k] for k in meta})}, this run has "
                             f"{meta}; the data order would differ")
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    if world > 1:  # every replica starts from rank 0's weights
        for p in params:
            dist.broadcast(p.data, 0)
    os.makedirs(args.out_dir, exist_ok=True)
    n_params = sum(p.numel() for p in params)
    c = drafter.config
    log(f"target {args.target} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, {dtype}) | drafter "
        f"{n_params / 1e6:.2f}M, {c.num_layers} layers, B={c.block_size}, target layers {c.target_layer_ids}, mask "
        f"token {c.mask_token_id} | data {args.data}: {len(train_rows)} train / {len(val)} val rows | {world} "
        f"rank(s) on {device.type} | out {os.path.abspath(args.out_dir)}")

    # the data order: one permutation per epoch, seeded by (seed, epoch); rank r takes its
    # slice of every global batch, so the step alone says where the data stands
    @lru_cache(maxsize=2)
    def epoch_order(epoch):
        return torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()

    def micro_batch(step, micro):
        start = step * global_batch + (micro * world + rank) * args.batch_size
        idx = [epoch_order(i // len(train_rows))[i % len(train_rows)] for i in range(start, start + args.batch_size)]
        return collate(train_rows[idx], tokenizer.pad_token_id, device)

    losses, summary, t_start, t_log, tokens, start_step = {}, {}, time.time(), time.time(), 0, step
    while step < total:
        micro_stats = []
        for micro in range(args.grad_accum):
            batch = micro_batch(step, micro)
            # anchors are drawn from (seed, step, micro, rank) so a resumed run draws the same ones
            gen = torch.Generator().manual_seed(hash((args.seed, step, micro, rank)))
            loss, stats = loss_step(drafter, target, batch, args, gen)
            (loss / args.grad_accum).backward()
            micro_stats.append(stats)
            tokens += int(batch[1].sum()) * world
        # DistributedDataParallel needs the loss to call its wrapper's forward; dflash2_loss
        # calls the drafter and its selector directly, so gradients are averaged by hand,
        # once per optimizer step (accumulation needs no no_sync)
        step_loss = torch.tensor(sum(s["loss"] for s in micro_stats) / args.grad_accum, device=device)
        if world > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world
            dist.all_reduce(step_loss)
            step_loss /= world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip or float("inf"))
        if not (torch.isfinite(step_loss) and torch.isfinite(grad_norm)):
            raise RuntimeError(f"step {step + 1}: loss {step_loss.item()} / gradient norm {grad_norm.item()} is not "
                               f"finite; stopped before the update, no checkpoint written for it. Lower --lr or use "
                               f"--dtype float32, then --resume from the last good checkpoint.")
        lr = lr_at(step, total, warmup, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses[step] = step_loss.item()

        if step % args.log_every == 0 or step == total:
            s, now = mean_stats(micro_stats), time.time()
            # loss: mean over all ranks; the other terms: rank 0's micro-batches ("-": selector off)
            f = lambda k, spec: format(s[k], spec) if k in s else "-"
            eta = (now - t_start) / (step - start_step) * (total - step)
            log(f"step {step:>5}/{total} | loss {losses[step]:.4f} unary {s['unary_loss']:.4f} sel "
                f"{f('selector_loss', '.4f')} | slot acc {' '.join(f'{a:.2f}' for a in s['slot_acc'])} | AL unary "
                f"{s['al_unary']:.2f} sel {f('al_selector', '.2f')} oracle {f('al_oracle', '.2f')} | lr {lr:.2e} | "
                f"{tokens / (now - t_log):.0f} tok/s | eta {int(eta // 60)}m{int(eta % 60):02d}s")
            t_log, tokens = now, 0
        if master and ((args.save_every and step % args.save_every == 0) or step == total):
            save_checkpoint(drafter, optimizer, step, args.out_dir, args.export_dtype, meta)
            log(f"saved {args.out_dir}/checkpoint and resume.pt at step {step}")
        if master and ((args.eval_every and step % args.eval_every == 0) or step == total):
            summary = evaluate(drafter, target, tokenizer, val, args, device, log)

    if world > 1:  # replicas must still be identical: compare per-tensor checksums across ranks
        sums = torch.stack([p.detach().double().sum() for p in params])
        every = [torch.zeros_like(sums) for _ in range(world)]
        dist.all_gather(every, sums)
        if any(not torch.equal(s, every[0]) for s in every):
            raise RuntimeError("drafter replicas diverged across ranks")
        log(f"replicas agree: parameter checksum {float(every[0].sum()):.12e} on {world} ranks")
        dist.destroy_process_group()
    log(f"done in {time.time() - t_start:.0f}s: export {os.path.abspath(os.path.join(args.out_dir, 'checkpoint'))}")
    return {**summary, "step": step, "losses": losses, "out_dir": args.out_dir, "target": args.target}


if __name__ == "__main__":
    train(parse_args())
