"""
Train a DFlash2 drafter against a frozen target (ALGORITHM.md §6). A script, not a framework:
arguments -> setup -> data -> model -> loop (step, log line, eval, checkpoint) -> export.

    python train.py                                   # offline demo: tiny_world.py builds its world once
    torchrun --nproc_per_node=8 train.py --target ... # data parallel: one frozen target per rank

The jobs around it have their own entry points: checkpoint.py (exports and serving commands), memory.py
(the memory plan), regenerate.py (on-policy data). Outputs under --out-dir: checkpoint/ (the servable
export, §7), resume.pt, metrics.jsonl, curves.png (and target_features/ for a feature cache on disk).
"""
import argparse
import contextlib
import math
import os
import shutil
import time

import datasets
import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

from dflash2 import (Batch, DFlash2Drafter, LossConfig, check_sampling, check_target_shape, loss_from_sums, loss_sums,
                     slot_sums, target_view)
from checkpoint import (check_out_dir, check_resume, load_export, plot_curves, record, resume, run_identity,
                        save_checkpoint, with_parts)
from data import (add_data_flags, anchor_seed, at_least, collate, data_stream, load_rows, parse_template_kwargs,
                  row_anchors, split_rows)
from memory import add_step_flags, fitting_plan, train_loss_chunk
from metrics import decoding_eval, dflash2_metrics
from target import (add_drafter_flags, drafter_config, drafter_fields, feature_cache, feature_choice,
                    load_checked_target, load_config, load_tokenizer, mask_token, rope_tables, target_features,
                    weights_fingerprint)
from tiny_world import offline_world

# -----------------------------------------------------------------------------
# settings nobody needs to turn (the optimizer's and the loss's are the write-up's, ALGORITHM.md §6)
DATA_SPLIT = "train"       # a hub dataset's split (regenerate.py --data-split writes any other to a file)
WARMUP = 0.04              # warmup fraction of the steps, then cosine down to LR_FLOOR · lr
LR_FLOOR = 0.1             # where the cosine ends, as a fraction of --lr (nanoGPT's min_lr = lr / 10)
WEIGHT_DECAY = 0.0         # AdamW
GRAD_CLIP = 1.0            # max gradient norm
GAMMA = None               # slot weight decay w_k = exp(-(k-1)/γ); None: 4/5/7 for B = 8/10/16
ALPHA = 1.0                # weight of the selector loss
LOG_EVERY = 20             # steps between log lines (each syncs with the host for its metrics)
EVAL_PROMPTS = 4           # held-out prompts spec_generate decodes at the end of a run, at T = 0 and T = 1,
EVAL_NEW_TOKENS = 96       # and the tokens it generates for each
EXPORT_DTYPE = torch.bfloat16  # checkpoint/, as engines serve it (resume.pt keeps the float32 weights)

# -----------------------------------------------------------------------------
# arguments

def selector_labels(text):
    """argparse type: 'argmax', 'soft' (the target's softmax) or a sampling setting 'T[,top_p[,top_k]]' (soft
    labels: the target's law there; a filter left out filters nothing) -> (labels, setting or None)."""
    if text in ("argmax", "soft"):
        return text, None
    fields = text.split(",")
    fields += ["1", "0"][len(fields) - 1:]
    try:
        setting = float(fields[0]), float(fields[1]), int(fields[2])
        check_sampling(*setting)
        ok = len(fields) == 3 and setting[0] > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not argmax, soft or T[,top_p[,top_k]] with T > 0, top_p in "
                                         "(0, 1] and top_k >= 0 (e.g. 1,0.95,20)")
    return "soft", setting

def parse_args(argv=None):
    """The flags: the target's and data's (data.py), the step's (memory.py) and the drafter's (target.py) are
    declared where the other entry points share them; the loss's, the optimizer's and the run's here."""
    p = argparse.ArgumentParser(description="Train a DFlash2 drafter (ALGORITHM.md §6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = add_data_flags(p)
    g.add_argument("--val-size", type=at_least(1), default=32, help="last rows held out for validation and decoding")
    g.add_argument("--cache-target-features", type=feature_choice, default="auto", help="keep each training row's "
                   "target features from its first use for later epochs: memory, disk (in --out-dir/target_features) "
                   "or disk:FOLDER (runs on one target, its layers and data can share it); auto: memory if they fit in "
                   "half the free memory, else disk, and off when no row is used twice")
    add_step_flags(p)
    g = add_drafter_flags(p)
    g.add_argument("--init-from", help="warm start from a DFlash or DFlash2 export folder; its architecture wins "
                   "over the drafter flags, except that a DFlash (v1) one gains this run's convolution and selector")
    g = p.add_argument_group("loss and optimization")
    g.add_argument("--loss", default="kl", choices=["kl", "ce"], help="unary loss: forward KL or CE on target argmax")
    g.add_argument("--selector-labels", type=selector_labels, default="argmax", metavar="argmax|soft|T[,TOP_P[,TOP_K]]",
                   help="selector loss against the target's argmax (the write-up's), its softmax over the candidates, "
                   "or its law at a sampling setting (softmax(z/T), its top-k and top-p, renormalised; §6)")
    g.add_argument("--lr", type=at_least(0, float), default=6e-4, help="peak AdamW learning rate")
    g.add_argument("--grad-accum", type=at_least(1), default=1, help="micro-steps per optimizer step")
    g.add_argument("--steps", type=at_least(1), default=300, help="optimizer steps")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="out", help="checkpoint/, resume.pt, metrics.jsonl, curves.png go here")
    g.add_argument("--seed", type=int, default=0, help="drafter init, data order and anchor draws")
    g.add_argument("--eval-every", type=at_least(0), default=0, help="steps between evaluations and checkpoints "
                   "(0: only at the end, where spec_generate also decodes held-out prompts)")
    g.add_argument("--resume", action="store_true", help="continue from --out-dir/resume.pt")
    return p.parse_args(argv)

# -----------------------------------------------------------------------------
# the step: its inputs, its loss, its log line

def step_inputs(target, batch, layer_ids, max_anchors, seeds, features=None, rows=None):
    """The loss's dflash2.Batch of a batch: one target pass (no grad, no lm_head) or the cached features of its
    training rows `rows`, and each row's anchors from its seed."""
    ids, attn, loss_mask = batch
    f, g = (target_features(target, ids, attn, layer_ids) if features is None else
            features.features(target, ids, attn, rows))
    return Batch(ids, attn, loss_mask, f, g, *row_anchors(loss_mask, max_anchors, seeds))

def loss_config(args, vocab_size, accept_at=None):
    """The loss flags as dflash2.LossConfig (checked once), its chunk memory.train_loss_chunk's at the target's
    vocabulary; accept_at: the acceptance metrics' setting."""
    labels, soft_labels_at = args.selector_labels
    return LossConfig(loss_type=args.loss, gamma=GAMMA, alpha=ALPHA, selector_labels=labels,
                      soft_labels_at=soft_labels_at, accept_at=accept_at, chunk_size=train_loss_chunk(vocab_size))

def compiled_loss(device, log):
    """dflash2.slot_sums under torch.compile (dynamic shapes: one compile serves every slot count) where the device
    has a compiler (C++ for a CPU, Triton for a GPU) and TORCH_COMPILE_DISABLE is unset, else the eager formula,
    with one line saying why: the same values either way."""
    from torch.utils._triton import has_triton
    compilers = {"cpu": None if any(map(shutil.which, ("g++", "c++", "clang++"))) else "no C++ compiler on PATH",
                 "cuda": None if has_triton() else "Triton is not installed"}
    missing = ("TORCH_COMPILE_DISABLE is set" if os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0") else
               compilers.get(device.type, f"a {device.type} device"))
    if missing:
        log(f"loss: the eager formula ({missing})")
        return slot_sums
    log("loss: the formula under torch.compile (compiled on the first step)")
    return torch.compile(slot_sums, dynamic=True)

def mean_over_ranks(*values):
    """The ranks' mean of each scalar, in one all_reduce. Of the loss weights (Σw): dividing each rank's
    sums by them makes DistributedDataParallel's mean of the ranks' gradients the global batch's (ALGORITHM.md §6)."""
    total = torch.stack(values)
    dist.all_reduce(total)
    return total / dist.get_world_size()

def below_float32(target):
    """Under bf16 autocast: the drafter's step when the target is below float32."""
    return torch.autocast(target.device.type, dtype=torch.bfloat16,
                          enabled=target.dtype in (torch.bfloat16, torch.float16))

class LossSums(torch.nn.Module):
    """dflash2.loss_sums as a module, for DistributedDataParallel to wrap: its forward runs the drafter."""
    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args):
        return loss_sums(self.drafter, *args)

def loss_step(drafter, view, target, batch, cfg, sums_fn=slot_sums, ddp=None):
    """The DFlash2 loss of a step_inputs Batch -> (loss, its detached terms, the Slots). ddp: DistributedDataParallel
    around LossSums(drafter), which runs the forward; the loss weights are then the global batch's."""
    with below_float32(target):
        sums, slots = loss_sums(drafter, view, batch, cfg, sums_fn) if ddp is None else ddp(view, batch, cfg, sums_fn)
    if ddp is not None:
        weights = mean_over_ranks(sums["unary_weight"], sums.get("selector_weight", sums["unary_weight"]))
        sums = {**sums, "unary_weight": weights[0], "selector_weight": weights[1]}
    return (*loss_from_sums(sums, cfg.alpha), slots)

def step_stats(drafter, view, target, slots, cfg, terms):
    """A logged batch's stats, floats: the loss terms and the §6 metrics of the loss's own slots (host syncs)."""
    with below_float32(target):
        return {k: v.item() for k, v in terms.items()} | dflash2_metrics(drafter, view, slots, cfg)

def mean_stats(all_stats):
    """Average a list of step_stats dicts (floats and per-slot lists)."""
    mean = lambda col: [sum(x) / len(x) for x in zip(*col)] if isinstance(col[0], list) else sum(col) / len(col)
    return {k: mean([s[k] for s in all_stats]) for k in all_stats[0]}

def step_line(step, total, loss, s, lr, tokens_per_second, eta):
    """A logged step's line; s: its stats (rank 0's micro-batches; "-": selector off), loss: all ranks'."""
    f = lambda k, spec: format(s[k], spec) if k in s else "-"
    return (f"step {step:>5}/{total} | loss {loss:.4f} unary {s['unary_loss']:.4f} sel {f('selector_loss', '.4f')} | "
            f"slot acc {' '.join(f'{a:.2f}' for a in s['slot_acc'])} | AL unary {s['al_unary']:.2f} walk "
            f"{f('al_walk', '.2f')} oracle {f('al_oracle', '.2f')} | lr {lr:.2e} | {tokens_per_second:.0f} tok/s | "
            f"eta {int(eta // 60)}m{int(eta % 60):02d}s")

def lr_at(step, total, warmup, peak, floor):
    """Linear warmup over `warmup` steps, then cosine decay from peak to floor · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return peak * (floor + (1 - floor) * cosine)

def make_optimizer(params, lr):
    """AdamW as one fused kernel: the loop over tensors' update to rounding, in a seventh of its time (AMX Xeon)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True)

@torch.no_grad()
def evaluate(drafter, target, tokenizer, val, args, log, prompts=0):
    """The validation rows' loss and §6 metrics, logged, then spec_generate on the first `prompts` rows' prompts (all
    before the first answer token). -> {val: stats, al_t0 and al_t1 when it decoded}."""
    seeds = [-1 - anchor_seed(args.seed, i) for i in range(len(val))]
    c, stats, b = drafter.config, [], args.batch_size
    cfg, view = loss_config(args, c.vocab_size), target_view(c, target)
    for i in range(0, len(val), b):
        batch = step_inputs(target, collate(val[i:i + b], tokenizer.pad_token_id, target.device),
                            c.target_layer_ids, args.max_anchors, seeds[i:i + b])
        _, terms, slots = loss_step(drafter, view, target, batch, cfg)
        stats.append(step_stats(drafter, view, target, slots, cfg, terms))
    s = mean_stats(stats)
    sel = lambda k: f"{s[k]:.3f}" if k in s else "-"
    log(f"eval | val loss {s['loss']:.4f} unary {s['unary_loss']:.4f} sel {sel('selector_loss')} | "
        f"oracle (label in top-K) {sel('oracle')} selector tf-acc {sel('selector_tf_acc')} | expected AL unary "
        f"{s['al_unary']:.2f} walk {sel('al_walk')} oracle {sel('al_oracle')} | T=1 acceptance unary "
        f"{s['accept_unary']:.3f} selector {sel('accept_selector')} (top-K mass {sel('mass_at_k')})")
    log("eval | slot accuracy " + " ".join(f"{a:.2f}" for a in s["slot_acc"]))
    if not prompts:
        return {"val": s}
    ids = [row["input_ids"][None, :int(row["loss_mask"].nonzero()[0]) or len(row["input_ids"]) // 2]
           for row in val.select(range(min(prompts, len(val))))]
    table = decoding_eval(drafter, target, tokenizer, [i.to(target.device) for i in ids], EVAL_NEW_TOKENS, args.seed,
                          log)
    return {"val": s, "al_t0": table[0.0][0], "al_t1": table[1.0][0]}

# -----------------------------------------------------------------------------
# setup

def start_ranks():
    """One process per device; torchrun sets RANK / WORLD_SIZE / LOCAL_RANK. -> (world, rank, device, log)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif world > 1:  # share the cores between the ranks of this machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if rank:  # downloads and tokenization show one progress bar, rank 0's
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return world, rank, device, (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

def build_drafter(args, tokenizer, target_config, rows, log):
    """At the target's width, from the drafter flags or --init-from; checked against the target's shape before its
    weights load. The target's embedding and lm_head are borrowed, frozen. The mask token avoids the rows' ids."""
    torch.manual_seed(args.seed)
    text, fields = target_config.get_text_config(), drafter_fields(args)  # a multimodal wrapper's language model
    if args.init_from:
        drafter = load_export(args.init_from, num_target_layers=text.num_hidden_layers)
        if not drafter.config.is_dflash2:  # DFlash (v1): this run's convolution and selector join at identity
            drafter = with_parts(drafter, **{k: v for k, v in fields.items() if k.startswith(("conv_", "selector_"))})
        check_target_shape(drafter.config, text.num_hidden_layers, text.hidden_size, text.vocab_size)
        return drafter
    if "mask_token_id" not in fields:
        fields["mask_token_id"] = mask_token(tokenizer, text.vocab_size, rows, log)
    c = drafter_config(target_config, **fields)
    return DFlash2Drafter(c, rope=rope_tables(c))

# -----------------------------------------------------------------------------
# training

def train(args, decode_prompts=EVAL_PROMPTS):
    """The run of args -> {val, al_t0, al_t1, step, losses, out_dir, target}; decode_prompts: the held-out prompts
    the final evaluation decodes (an entry point that decodes its own, the bench, passes 0)."""
    world, rank, device, log = start_ranks()
    master, resume_file = rank == 0, check_out_dir(args.out_dir, args.resume)
    # the memory plan (a GPU: the target's config is enough), then tokenizer, config, data and drafter: every
    # shape or data problem surfaces before the (possibly many-GB) target weights load
    recompute = args.target is not None and device.type == "cuda" and fitting_plan(
        args, torch.cuda.get_device_properties(device).total_memory / 2**30, log)
    target_path, data_path = offline_world(args.target, args.data, world, rank, log)
    tokenizer, target_config = load_tokenizer(target_path, args.chat_template), load_config(target_path)
    dataset = load_rows(data_path, DATA_SPLIT, tokenizer, args.seq_len, log=log,
                        template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    drafter = build_drafter(args, tokenizer, target_config, dataset, log)
    train_rows, val = split_rows(dataset, args.val_size, data_path)
    total, global_batch = args.steps, args.batch_size * args.grad_accum * world
    warmup = max(1, round(WARMUP * total))
    run = run_identity(target_config, drafter.config, train_rows, args.seq_len, {
        "steps": total, "warmup": warmup, "lr": args.lr, "lr_floor": LR_FLOOR, "global_batch": global_batch,
        "world": world, "seed": args.seed})
    state = check_resume(resume_file, run) if args.resume else None
    target = load_checked_target(target_path, args.dtype, drafter.config, train_rows[0]["input_ids"], device, log)
    meta = {"run": run, "target_weights": weights_fingerprint(target)}
    drafter.to(device).grad_checkpoint = recompute
    params = list(drafter.parameters())
    optimizer = make_optimizer(params, args.lr)
    step = resume(state, meta, drafter, optimizer, args.out_dir, master) if state is not None else 0
    # data parallel: DDP starts every replica from rank 0's weights and averages each gradient during the backward;
    # the forward must go through it: one that does not leaves the gradients unreduced and the replicas drift apart
    ddp = DistributedDataParallel(LossSums(drafter)) if world > 1 else None
    os.makedirs(args.out_dir, exist_ok=True)
    c, sums_fn = drafter.config, compiled_loss(device, log)
    loss_cfg = loss_config(args, c.vocab_size)
    view = target_view(c, target)
    features = feature_cache(args.cache_target_features, target, c, train_rows, total * global_batch, args.out_dir, log)
    export = {"dtype": EXPORT_DTYPE, "embedding": target.get_input_embeddings()}
    log(f"target {target_path} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, {target.dtype}) | drafter "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M, {c.num_layers} layers, B={c.block_size}, target layers "
        f"{c.target_layer_ids}, mask token {c.mask_token_id} | data {data_path}: {len(train_rows)} train / {len(val)} "
        f"val rows | {world} rank(s) on {device.type} | out {os.path.abspath(args.out_dir)}")
    micro_batch = data_stream(train_rows, args.seed, args.batch_size, args.grad_accum, world, rank,
                              tokenizer.pad_token_id, device)

    losses, summary, t_start, t_log, tokens, start_step = {}, {}, time.time(), time.time(), 0, step
    while step < total:
        micro_stats, logged = [], (step + 1) % LOG_EVERY == 0 or step + 1 == total  # metrics: host syncs
        for micro in range(args.grad_accum):
            batch, row_ids, seeds = micro_batch(step, micro)
            inputs = step_inputs(target, batch, c.target_layer_ids, args.max_anchors, seeds, features, row_ids)
            last = micro + 1 == args.grad_accum  # DDP reduces once a step: the accumulated gradient, in this backward
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss, terms, slots = loss_step(drafter, view, target, inputs, loss_cfg, sums_fn, ddp)
                (loss / args.grad_accum).backward()
            micro_stats.append(step_stats(drafter, view, target, slots, loss_cfg, terms) if logged else terms)
            tokens += int(batch[1].sum()) * world
        step_loss = sum(torch.as_tensor(s["loss"], device=device) for s in micro_stats) / args.grad_accum
        if world > 1:  # the log line's loss: the global batch's
            step_loss = mean_over_ranks(step_loss)[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        if not (torch.isfinite(step_loss) and torch.isfinite(grad_norm)):
            raise RuntimeError(f"step {step + 1}: loss {step_loss.item()} / gradient norm {grad_norm.item()} is not "
                               f"finite; stopped before the update, no checkpoint written for it. Lower --lr or use "
                               f"--dtype float32, then --resume from the last good checkpoint.")
        lr = lr_at(step, total, warmup, args.lr, LR_FLOOR)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses[step] = step_loss.item()
        if logged:
            s, now = mean_stats(micro_stats), time.time()
            tok_s, eta = tokens / (now - t_log), (now - t_start) / (step - start_step) * (total - step)
            log(step_line(step, total, losses[step], s, lr, tok_s, eta))
            if master:
                record(args.out_dir, {"kind": "train", "step": step, **s, "loss": losses[step], "lr": lr,
                                      "tokens_per_second": tok_s})
            t_log, tokens = now, 0
        if master and ((args.eval_every and step % args.eval_every == 0) or step == total):
            save_checkpoint(drafter, optimizer, step, args.out_dir, export, meta)
            log(f"saved {args.out_dir}/checkpoint and resume.pt at step {step}")
            summary = evaluate(drafter, target, tokenizer, val, args, log, decode_prompts if step == total else 0)
            record(args.out_dir, {"kind": "eval", "step": step, **summary["val"],
                                  **{k: v for k, v in summary.items() if k != "val"}})
            plot_curves(args.out_dir)

    if world > 1:
        dist.destroy_process_group()
    log(f"done in {time.time() - t_start:.0f}s: export {os.path.abspath(os.path.join(args.out_dir, 'checkpoint'))}")
    return {**summary, "step": step, "losses": losses, "out_dir": args.out_dir, "target": target_path}

if __name__ == "__main__":
    args = parse_args()
    try:
        train(args)
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"train.py: {e}") from None
