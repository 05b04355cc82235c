"""
Train a DFlash2 drafter against a frozen target (ALGORITHM.md §6). A script, not a framework: every knob of a run
(the settings, then the flags), setup (the target, the rows, the drafter, the features, resume), then the loop
(step, log line, evaluation, checkpoint).

    python train.py                                   # offline demo: harness/tiny_world.py builds its world once
    torchrun --nproc_per_node=8 train.py --target ... # data parallel: one frozen target per rank

Setup calls into the harness package (harness/__init__.py lists its modules) with plain values and gets plain values
back; the reference, dflash2.py, computes the drafter, the loss and decoding. The jobs around training have their own
entry points: python -m harness.checkpoint (exports and serving commands), python -m harness.memory (the memory
plan), python -m harness.regenerate (on-policy data). Outputs under --out-dir: checkpoint/ (the servable export, §7),
resume.pt, metrics.jsonl, curves.png (and target_features/ for a feature cache on disk).
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

import dflash2
from harness import checkpoint, data, fast_loss, memory, metrics, tiny_world
# by name, not the module: in this file `target` is the model
from harness.target import DrafterFields, below_float32, feature_cache, load_checked_target, tokenizer_and_config

# -----------------------------------------------------------------------------
# settings nobody needs to turn (the optimizer's and the loss's are the write-up's, ALGORITHM.md §6)
DATA_SPLIT = "train"       # a hub dataset's split (harness.regenerate --data-split writes any other to a file)
WARMUP = 0.04              # warmup fraction of the steps, then cosine down to LR_FLOOR · lr
LR_FLOOR = 0.1             # where the cosine ends, as a fraction of --lr (nanoGPT's min_lr = lr / 10)
WEIGHT_DECAY = 0.0         # AdamW
GRAD_CLIP = 1.0            # max gradient norm
GAMMA = None               # slot weight decay w_k = exp(-(k-1)/γ); None: 4/5/7 for B = 8/10/16
ALPHA = 1.0                # weight of the selector loss
EVAL_NEW_TOKENS = 96       # the tokens spec_generate generates for each prompt --decode-prompts decodes
EXPORT_DTYPE = torch.bfloat16  # checkpoint/, as engines serve it (resume.pt keeps the float32 weights)

# -----------------------------------------------------------------------------
# the flags: every knob of a run (every other entry point, bench/ and port/ included, declares the ones it shares
# with the same name, type and default: tests/test_train.py holds them to it)

def selector_labels(text):
    """argparse type: 'argmax', 'soft' (the target's softmax) or a sampling setting 'T[,top_p[,top_k]]' (soft
    labels: the target's law there; a filter left out filters nothing) -> (labels, setting or None)."""
    if text in ("argmax", "soft"):
        return text, None
    fields = text.split(",")
    fields += ["1", "0"][len(fields) - 1:]
    try:
        setting = float(fields[0]), float(fields[1]), int(fields[2])
        dflash2.check_sampling(*setting)
        ok = len(fields) == 3 and setting[0] > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not argmax, soft or T[,top_p[,top_k]] with T > 0, top_p in "
                                         "(0, 1] and top_k >= 0 (e.g. 1,0.95,20)")
    return "soft", setting

def feature_choice(text):
    """argparse type of --cache-target-features."""
    if text in ("auto", "off", "memory", "disk") or text.startswith("disk:") and len(text) > 5:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not auto, off, memory, disk or disk:FOLDER")

def parse_args(argv=None):
    at_least = data.at_least
    p = argparse.ArgumentParser(description="Train a DFlash2 drafter (ALGORITHM.md §6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target", default=None, help="HF model folder, hub id or .gguf file of the target; unset: the "
                   "offline tiny Qwen3 trained on the stdlib, built and cached on first use")
    g.add_argument("--data", default=None, help="hub dataset id or local .jsonl/.json/.parquet; rows hold 'messages' "
                   "or 'conversations' (role/content or from/value); unset: the offline world's conversations")
    g.add_argument("--chat-template", default=None, help="a Jinja file replacing the tokenizer's chat template")
    g.add_argument("--chat-template-kwargs", default="{}", help="JSON options for the template, e.g. "
                   "'{\"enable_thinking\": false}'")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's weights; below float32 the drafter's step also runs under bf16 autocast. auto: "
                   "bfloat16 on a GPU or on a CPU with AMX or AVX512-BF16, else float32 (decoding one sequence on "
                   "a CPU always uses float32, which is faster there)")
    g.add_argument("--val-size", type=at_least(1), default=32, help="last rows held out for validation and decoding")
    g.add_argument("--cache-target-features", type=feature_choice, default="auto", help="keep each training row's "
                   "target features from its first use for later epochs: memory, disk (in --out-dir/target_features) "
                   "or disk:FOLDER (runs on one target, its layers and data can share it); auto: memory if they fit in "
                   "half the free memory, else disk, and off when no row is used twice")
    g = p.add_argument_group("the training step (python -m harness.memory plans its memory)")
    g.add_argument("--seq-len", type=at_least(2), default=512, help="rows are truncated to this many tokens "
                   "(paper: 3072)")
    g.add_argument("--max-anchors", type=at_least(1), default=16, help="blocks per sequence per step (paper: 512 "
                   "per 3072-token row)")
    g.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per rank per micro-step")
    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=at_least(1), default=2, help="draft layers (DFlash: 5 for 4B-8B targets)")
    g.add_argument("--block-size", type=at_least(2), default=8, help="B: anchor + B-1 drafted tokens")
    g.add_argument("--conv-kernel-size", type=at_least(0), default=2, help="local convolution taps Kc (0 disables)")
    g.add_argument("--selector-top-k", type=at_least(0), default=16, help="selector candidates K (0 disables; both "
                   "0: plain DFlash)")
    g.add_argument("--drafter-config", action=DrafterFields, default={}, metavar="JSON",
                   help="other DFlash2Config fields, e.g. '{\"selector_rank\": 128, \"selector_codebooks\": "
                   "\"factored\", \"target_layer_ids\": [1, 9, 17], \"mask_token_id\": 151669, \"sliding_window\": "
                   "2048, \"layer_types\": [\"sliding_attention\", \"full_attention\"]}' (dflash2.py and ALGORITHM.md "
                   "say what each does); given twice, the fields of both, the later's where they meet")
    g.add_argument("--init-from", default=None, help="warm start from a DFlash or DFlash2 export folder; its "
                   "architecture wins over the drafter flags, except that a DFlash (v1) one gains this run's "
                   "convolution and selector")
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
    g.add_argument("--decode-prompts", type=at_least(0), default=4, help="held-out prompts spec_generate decodes at "
                   "the end of the run, at T = 0 and T = 1 (0: none)")
    g.add_argument("--log-every", type=at_least(1), default=20, help="steps between log lines (a logged step also "
                   "computes the metrics of its batches)")
    g.add_argument("--resume", action="store_true", help="continue from --out-dir/resume.pt")
    return p.parse_args(argv)

def drafter_fields(args):
    """The DFlash2Config fields the drafter flags set (the rest come from the target's family, and the mask token
    from its tokenizer when --drafter-config names none)."""
    return dict(num_layers=args.num_layers, block_size=args.block_size, conv_kernel_size=args.conv_kernel_size,
                selector_top_k=args.selector_top_k, **args.drafter_config)

# -----------------------------------------------------------------------------
# the step: its inputs, its loss, its log line

def step_inputs(target, tokens, max_anchors, seeds, features, rows=None):
    """The loss's dflash2.Batch of a micro-batch's tokens (input_ids, attention_mask, loss_mask): the target's
    features (feature_cache's: one target pass, no grad, no lm_head, or the cache of its training rows `rows`; None
    where it keeps nothing), and each row's anchors from its seed."""
    ids, attn, loss_mask = tokens
    f, g = features.features(target, ids, attn, rows)
    return dflash2.Batch(ids, attn, loss_mask, f, g, *data.row_anchors(loss_mask, max_anchors, seeds))

def loss_config(args, vocab_size):
    """The loss flags as dflash2.LossConfig (checked once), its chunk memory.train_loss_chunk's at the target's
    vocabulary."""
    labels, soft_labels_at = args.selector_labels
    return dflash2.LossConfig(loss_type=args.loss, gamma=GAMMA, alpha=ALPHA, selector_labels=labels,
                              soft_labels_at=soft_labels_at, chunk_size=memory.train_loss_chunk(vocab_size))

def compiled_loss(device, log):
    """The §6 loss's sums as harness.fast_loss writes them (dflash2.slot_sums with a cheaper exact top-K), under
    torch.compile (dynamic shapes: one compile serves every slot count) where the device has a compiler (C++ for a
    CPU, Triton for a GPU) and TORCH_COMPILE_DISABLE is unset, else eager, with one line saying why: the same values
    either way. Compiled, p = exp(log p) is recomputed where it is read instead of stored (a slots × V tensor)."""
    from torch.utils._triton import has_triton
    compilers = {"cpu": None if any(map(shutil.which, ("g++", "c++", "clang++"))) else "no C++ compiler on PATH",
                 "cuda": None if has_triton() else "Triton is not installed"}
    missing = ("TORCH_COMPILE_DISABLE is set" if os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0") else
               compilers.get(device.type, f"a {device.type} device"))
    if missing:
        log(f"loss: the eager formula ({missing})")
        return fast_loss.slot_sums
    log("loss: the formula under torch.compile (compiled on the first step)")
    return torch.compile(fast_loss.slot_sums, dynamic=True)

def mean_over_ranks(*values):
    """The ranks' mean of each scalar, in one all_reduce. Of the loss weights (Σw): dividing each rank's
    sums by them makes DistributedDataParallel's mean of the ranks' gradients the global batch's (ALGORITHM.md §6)."""
    total = torch.stack(values)
    dist.all_reduce(total)
    return total / dist.get_world_size()

class LossSums(torch.nn.Module):
    """dflash2.loss_sums as a module, for DistributedDataParallel to wrap: its forward runs the drafter."""
    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args):
        return dflash2.loss_sums(self.drafter, *args)

def loss_step(drafter, view, target, batch, cfg, sums_fn=dflash2.slot_sums, ddp=None):
    """The DFlash2 loss of a step_inputs Batch -> (loss, its detached terms, the Slots). ddp: DistributedDataParallel
    around LossSums(drafter), which runs the forward; the loss weights are then the global batch's."""
    with below_float32(target):
        sums, slots = (dflash2.loss_sums(drafter, view, batch, cfg, sums_fn) if ddp is None else
                       ddp(view, batch, cfg, sums_fn))
    if ddp is not None:
        weights = mean_over_ranks(sums["unary_weight"], sums.get("selector_weight", sums["unary_weight"]))
        sums = {**sums, "unary_weight": weights[0], "selector_weight": weights[1]}
    return (*dflash2.loss_from_sums(sums, cfg.alpha), slots)

def step_line(step, total, loss, s, lr, tokens_per_second, eta):
    """A logged step's line; s: its stats (rank 0's micro-batches; "-": selector off), loss: all ranks'."""
    f = lambda k, spec: format(s[k], spec) if k in s else "-"
    return (f"step {step:>5}/{total} | loss {loss:.4f} unary {s['unary_loss']:.4f} sel {f('selector_loss', '.4f')} | "
            f"slot acc {' '.join(f'{a:.2f}' for a in s['slot_acc'])} | AL unary {s['al_unary']:.2f} walk "
            f"{f('al_walk', '.2f')} oracle {f('al_oracle', '.2f')} | lr {lr:.2e} | {tokens_per_second:.0f} tok/s | "
            f"eta {int(eta // 60)}m{int(eta % 60):02d}s")

def check_finite(step, loss, grad_norm):
    """Stop before the update of a step whose loss or clipped gradient is not finite: the weights and the checkpoint
    stay the last good step's."""
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        raise RuntimeError(f"step {step}: loss {loss.item()} / gradient norm {grad_norm.item()} is not finite; "
                           f"stopped before the update, no checkpoint written for it. Lower --lr or use --dtype "
                           f"float32, then --resume from the last good checkpoint.")

def lr_at(step, total, warmup, peak, floor):
    """Linear warmup over `warmup` steps, then cosine decay from peak to floor · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return peak * (floor + (1 - floor) * cosine)

def make_optimizer(params, lr):
    """AdamW as one fused kernel: the loop over tensors' update to rounding, in one pass."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True)

# -----------------------------------------------------------------------------
# setup

def start_ranks():
    """The process: torch's CPU allocator asked for huge pages before the first large tensor (harness.memory); one
    process per device, torchrun setting RANK / WORLD_SIZE / LOCAL_RANK. -> (world, rank, device, log)."""
    memory.use_huge_pages()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif world > 1:  # CPU ranks of one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if rank:  # downloads and tokenization show one progress bar, rank 0's
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return world, rank, device, (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

# -----------------------------------------------------------------------------
# training

def train(args):
    """The run of args -> {val, al_t0, al_t1, step, losses, out_dir, target}."""
    world, rank, device, log = start_ranks()
    run = checkpoint.TrainingRun(args.out_dir, args.resume, master=rank == 0)
    # the target's tokenizer and config, the memory plan (a GPU), the rows and the drafter: every shape or data
    # problem surfaces before the (possibly many-GB) target weights load
    target_path, data_path = tiny_world.offline_world(args.target, args.data, world, rank, log)
    tokenizer, target_config = tokenizer_and_config(target_path, args.chat_template)
    fields = drafter_fields(args)
    recompute = device.type == "cuda" and memory.fitting_plan(
        target_config, args.seq_len, args.max_anchors, args.batch_size, fields,
        torch.cuda.get_device_properties(device).total_memory / 2**30, log)
    train_rows, val = data.training_rows(data_path, DATA_SPLIT, tokenizer, args.seq_len, args.val_size,
                                         args.chat_template_kwargs, log)
    torch.manual_seed(args.seed)
    drafter = checkpoint.build_drafter(target_config, tokenizer, fields, (train_rows, val), args.init_from, log)
    c = drafter.config  # decided: every later step reads the drafter's shape, its mask token and layers from here
    total, global_batch = args.steps, args.batch_size * args.grad_accum * world
    warmup = max(1, round(WARMUP * total))
    run.check(target_config, c, train_rows, args.seq_len, {"steps": total, "warmup": warmup, "lr": args.lr,
              "lr_floor": LR_FLOOR, "global_batch": global_batch, "world": world, "seed": args.seed})
    # the target, the optimizer and where the run starts
    target = load_checked_target(target_path, args.dtype, c, train_rows[0]["input_ids"], device, log)
    drafter.to(device).grad_checkpoint = recompute
    params = list(drafter.parameters())
    optimizer = make_optimizer(params, args.lr)
    step = run.start(drafter, optimizer, target)
    # data parallel: DDP starts every replica from rank 0's weights and averages each gradient during the backward;
    # the forward must go through it: one that does not leaves the gradients unreduced and the replicas drift apart
    ddp = DistributedDataParallel(LossSums(drafter)) if world > 1 else None
    os.makedirs(args.out_dir, exist_ok=True)
    sums_fn, loss_cfg = compiled_loss(device, log), loss_config(args, c.vocab_size)
    view = dflash2.target_view(c, target)
    features = feature_cache(args.cache_target_features, target, c, train_rows, total * global_batch, args.out_dir, log)
    export = {"dtype": EXPORT_DTYPE, "embedding": target.get_input_embeddings()}
    log(f"target {target_path} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, {target.dtype}) | drafter "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M, {c.num_layers} layers, B={c.block_size}, target layers "
        f"{c.target_layer_ids}, mask token {c.mask_token_id} | data {data_path}: {len(train_rows)} train / {len(val)} "
        f"val rows | {world} rank(s) on {device.type} | out {os.path.abspath(args.out_dir)}")
    micro_batch = data.data_stream(train_rows, args.seed, args.batch_size, args.grad_accum, world, rank,
                                   tokenizer.pad_token_id, device)

    losses, summary, t_start, t_log, n_tokens, start_step = {}, {}, time.time(), time.time(), 0, step
    while step < total:
        micro_stats, logged = [], (step + 1) % args.log_every == 0 or step + 1 == total  # metrics: host syncs
        for micro in range(args.grad_accum):
            tokens, row_ids, seeds = micro_batch(step, micro)
            batch = step_inputs(target, tokens, args.max_anchors, seeds, features, row_ids)
            last = micro + 1 == args.grad_accum  # DDP reduces once a step: the accumulated gradient, in this backward
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss, terms, slots = loss_step(drafter, view, target, batch, loss_cfg, sums_fn, ddp)
                (loss / args.grad_accum).backward()
            micro_stats.append(metrics.step_stats(drafter, view, target, slots, loss_cfg, terms) if logged else terms)
            n_tokens += int(tokens[1].sum()) * world
        step_loss = sum(torch.as_tensor(s["loss"], device=device) for s in micro_stats) / args.grad_accum
        if world > 1:  # the log line's loss: the global batch's
            step_loss = mean_over_ranks(step_loss)[0]
        check_finite(step + 1, step_loss, torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
        lr = lr_at(step, total, warmup, args.lr, LR_FLOOR)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses[step] = step_loss.item()
        if logged:
            s, now = metrics.mean_stats(micro_stats), time.time()
            tok_s, eta = n_tokens / (now - t_log), (now - t_start) / (step - start_step) * (total - step)
            log(step_line(step, total, losses[step], s, lr, tok_s, eta))
            run.record({"kind": "train", "step": step, **s, "loss": losses[step], "lr": lr, "tokens_per_second": tok_s})
            t_log, n_tokens = now, 0
        if run.master and ((args.eval_every and step % args.eval_every == 0) or step == total):
            run.save(drafter, optimizer, step, export)
            log(f"saved {args.out_dir}/checkpoint and resume.pt at step {step}")
            summary = metrics.evaluate(drafter, target, tokenizer, val, loss_cfg, args.batch_size, args.max_anchors,
                                       args.seed, log, args.decode_prompts if step == total else 0, EVAL_NEW_TOKENS)
            run.record_eval(step, summary)

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
