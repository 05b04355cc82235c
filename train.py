"""
Train a DFlash2 drafter against a frozen target (ALGORITHM.md §6). A script, not a framework:
arguments -> setup -> data -> model -> loop (step, log line, eval, checkpoint) -> export.

    python train.py                                  # offline demo: tiny_world.py builds its world once
    python train.py --target Qwen/Qwen3-4B --dry-run # the untrained export and its serving commands
    torchrun --nproc_per_node=8 train.py ...         # data parallel: one frozen target per rank

The jobs around training have their own scripts: regenerate.py (on-policy data) and
memory.py (the memory plan; on a GPU train.py stops a batch it says does not fit). Outputs
under --out-dir: checkpoint/ (servable export, §7), resume.pt, metrics.jsonl and curves.png
(checkpoint.py), and target_features/ when the target's features are cached on disk. A row's
place in the data stream fixes its order and its anchor draws, so a resumed
run repeats the uninterrupted one exactly.
"""
import argparse
import contextlib
import math
import os
import shutil
import time
from functools import lru_cache

import datasets
import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

from dflash2 import (Batch, DFlash2Drafter, LossConfig, check_sampling, check_target_shape,
                     loss_from_sums, loss_sums, sample_anchors, slot_sums, spec_generate, target_view)
from memory import GiB, check_fits, run_plan
from metrics import dflash2_metrics
from checkpoint import (check_out_dir, check_resume, load_export, plot_curves, record, resume, run_identity,
                        save_checkpoint, save_export, serving_commands, weights_fingerprint, with_parts)
from data import collate, load_rows, parse_template_kwargs
from target import (TargetFeatures, check_target_view, choose_mask_token, decoding_dtype, decoding_view,
                    drafter_config, is_gguf, load_config, load_target, load_tokenizer, rope_tables, target_features,
                    training_dtype)
from tiny_world import tiny_world

# -----------------------------------------------------------------------------
# arguments

# settings nobody needs to turn (the optimizer's and the loss's are the write-up's, ALGORITHM.md §6)
TINY_PRETRAIN_STEPS = 600  # pretraining steps of the offline tiny target (its cache is per value)
WARMUP = 0.04              # warmup fraction of the steps, then cosine to 0
WEIGHT_DECAY = 0.0         # AdamW
GRAD_CLIP = 1.0            # max gradient norm
GAMMA = None               # slot weight decay w_k = exp(-(k-1)/γ); None: 4/5/7 for B = 8/10/16
ALPHA = 1.0                # weight of the selector loss


def at_least(low, kind=int, strict=False):
    """argparse type: a number >= low (> low if strict), refused with the flag and value otherwise."""
    def parse(text):
        value = kind(text)
        if not (value > low if strict else value >= low):  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
        return value
    parse.__name__ = kind.__name__
    return parse


def fraction(text):
    """argparse type: a number in [0, 1]."""
    value = float(text)
    if not 0 <= value <= 1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 1]")
    return value


def sampling_setting(text):
    """argparse type: 'T[,top_p[,top_k]]' -> (T, top_p, top_k), T > 0, top_p in (0, 1], top_k >= 0;
    a filter left out filters nothing (top_p 1, top_k 0)."""
    fields = text.split(",")
    try:
        if len(fields) > 3:
            raise ValueError
        fields += ["1", "0"][len(fields) - 1:]  # the filters left out
        t, top_p, top_k = float(fields[0]), float(fields[1]), int(fields[2])
        check_sampling(t, top_p, top_k)
        if t == 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not T[,top_p[,top_k]] with T > 0, top_p in (0, 1] and "
                                         "top_k >= 0 (e.g. 1,0.95,20)") from None
    return t, top_p, top_k


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a DFlash2 drafter (ALGORITHM.md §6).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target", help="HF model folder, hub id or .gguf file of the frozen target; unset: the "
                   "offline tiny Qwen3 trained on the stdlib, built and cached on first use")
    g.add_argument("--data", help="hub dataset id or local .jsonl/.json/.parquet; rows hold 'messages' or "
                   "'conversations' (role/content or from/value); unset: the offline world's conversations")
    g.add_argument("--data-split", default="train", help="split of a hub dataset")
    g.add_argument("--drop-bad-rows", action="store_true", help="drop (and count) unusable rows instead of stopping")
    g.add_argument("--chat-template", help="a Jinja file replacing the tokenizer's chat template")
    g.add_argument("--chat-template-kwargs", default="{}", help="JSON options for the template, e.g. "
                   "'{\"enable_thinking\": false}'")
    g.add_argument("--val-size", type=at_least(1), default=32,
                   help="last rows held out for validation and spec_generate")
    g.add_argument("--seq-len", type=at_least(2), default=512,
                   help="rows are truncated to this many tokens (paper: 3072)")
    g.add_argument("--mask-token-id", type=int, help="id of the MASK slots; unset: the tokenizer's mask token, "
                   "else the first target embedding row that no token uses, else the lowest-id added token that is "
                   "not bos/eos/pad/unk and never occurs in the training rows (ALGORITHM.md §1)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's weights; below float32 the drafter's step also runs under bf16 autocast. auto: "
                   "bfloat16 on a GPU or on a CPU with AMX or AVX512-BF16, else float32 (decoding one sequence on "
                   "a CPU always uses float32, which is faster there)")
    g.add_argument("--cache-target-features", default="auto", choices=["auto", "off", "memory", "disk"],
                   help="keep each training row's target features (context layers, last hidden state) from its "
                   "first use for later epochs: in memory, or on disk in --features-dir; auto: memory if they fit "
                   "in half the free memory, else disk, and off when no row is used twice")
    g.add_argument("--features-dir", help="the on-disk feature cache (default: --out-dir/target_features); runs "
                   "with the same target, target layers and data can share one")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash2"),
                   help="the offline world (tokenizer, tiny target, on-policy conversations)")
    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=at_least(1), default=2, help="draft layers (DFlash: 5 for 4B-8B targets)")
    g.add_argument("--block-size", type=at_least(2), default=8, help="B: anchor + B-1 drafted tokens")
    g.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")],
                   help="comma-separated target layers feeding the context; unset: the ALGORITHM.md §1 rule")
    g.add_argument("--conv-kernel-size", type=at_least(0), default=2, help="local convolution taps Kc (0 disables)")
    g.add_argument("--selector-rank", type=at_least(1), default=256, help="candidate selector rank R")
    g.add_argument("--selector-top-k", type=at_least(0), default=16, help="selector candidates K (0 disables)")
    g.add_argument("--selector-codebooks", default="free", choices=["free", "factored"],
                   help="free: [V, R] codebook tables; factored: A = E·W_A, Bc = E·W_B from the target's frozen "
                   "embedding E, 3·H·R parameters (exported as the tables; ALGORITHM.md §3)")
    g.add_argument("--sliding-window", type=at_least(1), help="W: make the draft layers sliding-window "
                   "(ALGORITHM.md §1: a key at distance >= W from its query is hidden); unset: full attention")
    g.add_argument("--full-attention-layers", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="comma-separated draft layers that keep full attention under --sliding-window")
    g.add_argument("--init-from", help="warm start from a DFlash or DFlash2 export folder; its architecture wins "
                   "over the flags above, except that a DFlash (v1) one gains this run's convolution and selector")
    g = p.add_argument_group("loss")
    g.add_argument("--loss", default="kl", choices=["kl", "ce"], help="unary loss: forward KL or CE on target argmax")
    g.add_argument("--selector-labels", default="argmax", choices=["argmax", "soft"], help="selector loss against "
                   "the target's argmax (the write-up's) or its whole distribution over the candidates (§6)")
    g.add_argument("--soft-labels-at", type=sampling_setting, metavar="T[,TOP_P[,TOP_K]]",
                   help="with --selector-labels soft: the target's law at this sampling setting (softmax(z/T), its "
                   "top-k and top-p, renormalised) instead of softmax(z), e.g. 1,0.95,20 (§6)")
    g.add_argument("--max-anchors", type=at_least(1), default=16,
                   help="blocks per sequence per step (paper: 512 per 3072-token row)")
    g.add_argument("--loss-chunk", type=at_least(0), default=1024, help="slots whose vocabulary-wide tensors live "
                   "at once, recomputed in backward (0: all at once); same loss and gradients")
    g.add_argument("--compile", default="auto", choices=["auto", "off"], help="auto: the loss under torch.compile "
                   "where the device has a compiler for it (once a run, on the first step); off: the eager formula; "
                   "the same values either way")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=at_least(0, float), default=6e-4, help="peak AdamW learning rate")
    g.add_argument("--lr-floor", type=fraction, default=0.0,
                   help="where the cosine decay ends, as a fraction of --lr (0: decays to 0)")
    g.add_argument("--grad-checkpoint", action="store_true", help="recompute each draft layer in backward: "
                   "activation memory of one layer instead of all")
    g.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per rank per micro-step")
    g.add_argument("--grad-accum", type=at_least(1), default=1, help="micro-steps per optimizer step")
    g.add_argument("--steps", type=at_least(1), default=300, help="optimizer steps")
    g.add_argument("--epochs", type=at_least(0, float, strict=True),
                   help="passes over the data; overrides --steps when set")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="out", help="checkpoint/, resume.pt, metrics.jsonl, curves.png (and "
                   "target_features/ with --cache-target-features disk) go here")
    g.add_argument("--seed", type=int, default=0, help="drafter init, data order and anchor draws")
    g.add_argument("--log-every", type=at_least(1), default=20, help="steps between log lines")
    g.add_argument("--eval-every", type=at_least(0), default=0, help="steps between evaluations (0: only at the end)")
    g.add_argument("--save-every", type=at_least(0), default=200, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--eval-prompts", type=at_least(1), default=4, help="held-out prompts for real spec_generate AL")
    g.add_argument("--eval-new-tokens", type=at_least(1), default=96, help="tokens generated per eval prompt")
    g.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="checkpoint/ dtype")
    g.add_argument("--export-format", default="z-lab", choices=["z-lab", "speculators"], help="checkpoint/'s "
                   "config.json: z-lab's (vLLM, SGLang, the dflash package) or vllm-project speculators' (vLLM; "
                   "names --target as the verifier, so `vllm serve checkpoint/` is enough); same tensors (§7)")
    g.add_argument("--resume", action="store_true", help="continue from --out-dir/resume.pt")
    g.add_argument("--dry-run", action="store_true", help="write the untrained export of this target and drafter "
                   "shape to --out-dir/checkpoint, print the engines' serving commands for it, then exit")
    args = p.parse_args(argv)
    if args.soft_labels_at and args.selector_labels != "soft":
        p.error(f"--soft-labels-at {','.join(map(str, args.soft_labels_at))} needs --selector-labels soft")
    return args


# -----------------------------------------------------------------------------
# small helpers


def lr_at(step, total, warmup, peak, floor=0.0):
    """Linear warmup over `warmup` steps, then cosine decay from peak to floor · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return peak * (floor + (1 - floor) * cosine)


# -----------------------------------------------------------------------------
# evaluation: validation metrics + real speculative decoding


def mean_stats(all_stats):
    """Average a list of dflash2_loss stats dicts (floats and per-slot lists)."""
    out = {}
    for k, v in all_stats[0].items():
        col = [s[k] for s in all_stats]
        out[k] = [sum(x) / len(x) for x in zip(*col)] if isinstance(v, list) else sum(col) / len(col)
    return out


def row_anchors(loss_mask, max_anchors, seeds):
    """sample_anchors row by row, each row from its own seed: a row draws the same anchors
    whatever batch, rank or micro-step it lands in (resume and data parallel repeat them)."""
    drawn = [sample_anchors(m[None], max_anchors, torch.Generator().manual_seed(s)) for m, s in zip(loss_mask, seeds)]
    # each row's draw is sample_anchors' (1, N_i) with its padding; pad the rows to the longest the same way
    return tuple(torch.nn.utils.rnn.pad_sequence([x[0] for x in part], batch_first=True) for part in zip(*drawn))


def anchor_seed(seed, place):
    """The seed of the anchors of the row at `place` in the data stream (train.py's data order);
    validation row i draws from -1 - anchor_seed(seed, i), never a training row's seed."""
    return seed * 1_000_003 + place


def loss_config(args, accept_at=None):
    """The loss flags as dflash2.LossConfig (checked once); accept_at: the acceptance metrics' setting."""
    return LossConfig(loss_type=args.loss, gamma=GAMMA, alpha=ALPHA, selector_labels=args.selector_labels,
                      soft_labels_at=args.soft_labels_at, accept_at=accept_at, chunk_size=args.loss_chunk or None)


def mean_over_ranks(*values):
    """The ranks' mean of each scalar, in one all_reduce. Of the loss weights (Σw): dividing each rank's
    sums by them makes DistributedDataParallel's mean of the ranks' gradients the global batch's (ALGORITHM.md §6)."""
    total = torch.stack(values)
    dist.all_reduce(total)
    return total / dist.get_world_size()


def step_inputs(target, batch, layer_ids, max_anchors, seeds, features=None, rows=None):
    """The loss's dflash2.Batch of a batch: one target pass (no grad; its logits only where the loss
    needs them, never (b, S, V) at once), or the cached features of the batch's training rows `rows`,
    and each row's anchors from its seed."""
    ids, attn, loss_mask = batch
    f, g = (target_features(target, ids, attn, layer_ids) if features is None else
            features.features(target, ids, attn, rows))
    return Batch(ids, attn, loss_mask, f, g, *row_anchors(loss_mask, max_anchors, seeds))


def compiled_loss(device, log, choice="auto"):
    """--compile -> dflash2.slot_sums under torch.compile (dynamic shapes: one compile serves every slot count)
    where this device has a compiler for it (a C++ compiler for a CPU, Triton for a GPU), else the eager
    formula, with one line saying why: the same values either way."""
    from torch.utils._triton import has_triton
    missing = {"cpu": None if any(map(shutil.which, ("g++", "c++", "clang++"))) else "no C++ compiler on PATH",
               "cuda": None if has_triton() else "Triton is not installed"}.get(device.type, f"a {device.type} device")
    if choice == "off" or missing:
        log(f"loss: the eager formula ({'--compile off' if choice == 'off' else missing})")
        return slot_sums
    log("loss: the formula under torch.compile (compiled on the first step)")
    return torch.compile(slot_sums, dynamic=True)


def below_float32(target):
    """Under bf16 autocast: the drafter's step when the target is below float32."""
    return torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=target.dtype in (torch.bfloat16,
                                                                                             torch.float16))


def loss_step(drafter, view, target, batch, cfg, sums_fn=slot_sums, ddp=None):
    """The DFlash2 loss of a step_inputs Batch. ddp: the drafter's DistributedDataParallel wrapper (data
    parallel), which runs the forward; the loss weights are then the global batch's (mean_over_ranks).
    -> (loss, {loss, unary_loss, selector_loss} detached tensors, the Slots)."""
    with below_float32(target):
        sums, slots = loss_sums(drafter, view, batch, cfg, sums_fn, ddp)
    weights = None
    if ddp is not None:
        weights = mean_over_ranks(sums["unary_weight"], sums.get("selector_weight", sums["unary_weight"]))
    return (*loss_from_sums(sums, cfg.alpha, weights), slots)


def step_stats(drafter, view, target, slots, cfg, terms):
    """A logged batch's stats, floats: the loss terms and the §6 metrics of the loss's own slots (host syncs)."""
    with below_float32(target):
        return {k: v.item() for k, v in terms.items()} | dflash2_metrics(drafter, view, slots, cfg)


def feature_cache(args, target, c, train_rows, total_rows_drawn, log):
    """--cache-target-features -> a TargetFeatures, or None (off). Its size is logged."""
    size = sum(TargetFeatures.row_bytes(len(ids), len(c.target_layer_ids), c.hidden_size, target.dtype)
               for ids in train_rows["input_ids"])
    choice = args.cache_target_features
    if choice == "auto":
        pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else 0
        free = pages * os.sysconf("SC_PAGE_SIZE") if pages else 0
        choice = "off" if total_rows_drawn <= len(train_rows) else "memory" if size <= free / 2 else "disk"
        why = ("no row is used twice" if choice == "off" else
               f"{'within' if choice == 'memory' else 'over'} half of the {free / 2**30:.1f} GiB free")
    else:
        why = f"--cache-target-features {choice}"
    if choice == "off":
        log(f"target features: computed every step ({why}; a cache would take {size / 2**30:.2f} GiB)")
        return None
    folder = (args.features_dir or os.path.join(args.out_dir, "target_features")) if choice == "disk" else None
    key = {"target_weights": weights_fingerprint(target), "target_layer_ids": c.target_layer_ids,
           "dtype": str(target.dtype).removeprefix("torch.")}
    log(f"target features: cached {'in ' + folder if folder else 'in memory'}, {size / 2**30:.2f} GiB for "
        f"{len(train_rows)} rows ({why})")
    return TargetFeatures(key, c.target_layer_ids, folder)


@torch.no_grad()
def evaluate(drafter, target, tokenizer, val, args, device, log):
    seeds = [-1 - anchor_seed(args.seed, i) for i in range(len(val))]
    batches = [step_inputs(target, collate(val[i:i + args.batch_size], tokenizer.pad_token_id, device),
                           drafter.config.target_layer_ids, args.max_anchors, seeds[i:i + args.batch_size])
               for i in range(0, len(val), args.batch_size)]
    cfg, view = loss_config(args), target_view(drafter.config, target)
    stats = []
    for batch in batches:
        _, terms, slots = loss_step(drafter, view, target, batch, cfg)
        stats.append(step_stats(drafter, view, target, slots, cfg, terms))
    stats = mean_stats(stats)
    trained_in = target.dtype
    target.to(decoding_dtype(device, trained_in))  # and back below: bf16 -> float32 -> bf16 is exact
    gen, table = torch.Generator(device).manual_seed(args.seed), {}  # sampling happens on the device
    decoding = decoding_view(drafter.config, target)
    for temperature in (0.0, 1.0):
        als, tps, texts, t0 = [], [], [], time.time()
        for i in range(min(args.eval_prompts, len(val))):
            ids, mask = val[i]["input_ids"], val[i]["loss_mask"]
            start = int(mask.nonzero()[0]) or len(ids) // 2  # prompt = all before the first answer token
            new, s = spec_generate(drafter, target, ids[None, :start].to(device), args.eval_new_tokens, temperature,
                                   stop_token_ids=[tokenizer.eos_token_id], generator=gen, view=decoding)
            als.append(s.mean_acceptance_length)
            tps.append(s.tokens_per_second)
            texts.append(tokenizer.decode(new))
        table[temperature] = (sum(als) / len(als), sum(tps) / len(tps), texts[0])
        log(f"eval | spec_generate at T = {temperature}: {len(als)} prompts in {time.time() - t0:.0f}s, "
            f"target in {str(target.dtype).removeprefix('torch.')}")
    target.to(trained_in)
    sel = lambda k: f"{stats[k]:.3f}" if k in stats else "-"
    log(f"eval | val loss {stats['loss']:.4f} unary {stats['unary_loss']:.4f} sel {sel('selector_loss')} | "
        f"oracle (label in top-K) {sel('oracle')} selector tf-acc {sel('selector_tf_acc')} | expected AL unary "
        f"{stats['al_unary']:.2f} walk {sel('al_walk')} oracle {sel('al_oracle')} | T=1 acceptance unary "
        f"{stats['accept_unary']:.3f} selector {sel('accept_selector')} (top-K mass {sel('mass_at_k')})")
    log("eval | slot accuracy " + " ".join(f"{a:.2f}" for a in stats["slot_acc"]))
    log(f"eval | spec_generate, {len(als)} held-out prompts, <= {args.eval_new_tokens} new tokens")
    log("eval |   temperature   mean AL   tokens/s   start of the first output")
    for temperature, (al, tok_s, text) in table.items():
        log(f"eval |   {temperature:>11.1f}   {al:>7.2f}   {tok_s:>8.1f}   {text[:40]!r}")
    return {"val": stats, "al_t0": table[0.0][0], "al_t1": table[1.0][0]}


# -----------------------------------------------------------------------------
# setup steps


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


def check_memory(args, device):
    """On a GPU: the memory plan of this run (memory.py, from the target's config alone) against
    the device's memory; a batch it says does not fit stops the run before any weight loads."""
    check_fits(run_plan(args, torch.cuda.get_device_properties(device).total_memory / GiB))


def offline_world(args, world, rank, log):
    """Unset --target / --data: the tiny world's. Rank 0 builds it, the others then read its cache."""
    if args.target is not None and (args.data is not None or args.dry_run):
        return
    if rank:
        dist.barrier()
    target_path, data_path = tiny_world(args.cache_dir, TINY_PRETRAIN_STEPS, log)
    if rank == 0 and world > 1:
        dist.barrier()
    args.target, args.data = args.target or target_path, args.data or data_path
    log(f"offline world cached in {os.path.abspath(args.cache_dir)}")


def build_drafter(args, tokenizer, target_config, rows, log):
    """At the target's width, from the flags or --init-from; checked against the target's
    shape before its weights load. The target's embedding and lm_head are borrowed, frozen.
    rows: the training rows, whose ids the mask token must avoid (None: not read, --dry-run)."""
    torch.manual_seed(args.seed)
    parts = dict(conv_kernel_size=args.conv_kernel_size, selector_rank=args.selector_rank,
                 selector_top_k=args.selector_top_k, selector_codebooks=args.selector_codebooks)
    text = target_config.get_text_config()  # a multimodal wrapper's language model
    if args.init_from:
        drafter = load_export(args.init_from, num_target_layers=text.num_hidden_layers)
        if not drafter.config.is_dflash2:  # DFlash (v1): this run's convolution and selector join at identity
            drafter = with_parts(drafter, **parts)
        check_target_shape(drafter.config, text.num_hidden_layers, text.hidden_size, text.vocab_size)
        return drafter
    used = None
    if rows is not None:  # the ids the training rows hold, marked in one pass
        seen = torch.zeros(max(text.vocab_size, len(tokenizer)), dtype=torch.bool)
        for ids in rows["input_ids"]:
            seen[ids] = True
        used = seen.nonzero()[:, 0].tolist()
    mask_token_id, why = choose_mask_token(args.mask_token_id, tokenizer, text.vocab_size, used)
    log(f"mask token {mask_token_id}: {why}")
    layer_ids = {"target_layer_ids": args.target_layer_ids} if args.target_layer_ids else {}
    outside = [i for i in args.full_attention_layers if not 0 <= i < args.num_layers]
    if outside:
        raise ValueError(f"--full-attention-layers {outside} outside the draft layers [0, {args.num_layers})")
    window = {} if args.sliding_window is None else dict(sliding_window=args.sliding_window, layer_types=[
        "full_attention" if i in args.full_attention_layers else "sliding_attention" for i in range(args.num_layers)])
    c = drafter_config(target_config, num_layers=args.num_layers, block_size=args.block_size,
                       mask_token_id=mask_token_id, **layer_ids, **parts, **window)
    return DFlash2Drafter(c, rope=rope_tables(c))


def served_target(target):
    """The model engines serve a drafter's target from: --target, or for a GGUF file the original
    model it was converted from, which only the user can name (ORIGINAL_MODEL)."""
    return "ORIGINAL_MODEL" if is_gguf(target) else target


def export_options(dtype, export_format, target, target_config, embedding=None):
    """save_export's dtype, format and verifier (the speculators format names it) for --target;
    embedding: the target's input embedding (factored codebooks are exported as tables of it)."""
    return dict(dtype=getattr(torch, dtype), export_format=export_format,
                verifier={"name_or_path": served_target(target),
                          "architectures": list(getattr(target_config, "architectures", None) or [])},
                embedding=embedding)


def dry_run(drafter, target, out_dir, export, log):
    """--dry-run: the untrained export (export_options) of this target and drafter shape, to check
    that a serving engine loads it before any training; no data and no target weights are read.
    Factored codebooks' tables need the target's embedding: they are written as free tables at
    their init, which score as the untrained factored selector does (successor side 0: the unary logits)."""
    if drafter.config.selector_codebooks == "factored":
        drafter = with_parts(drafter, selector_codebooks="free")  # all but W_A, W_B
    path = os.path.abspath(os.path.join(out_dir, "checkpoint"))
    save_export(drafter, path, **export)
    export_format, served = export["export_format"], served_target(target)
    if served != target:
        where = ("the commands below" if export_format == "z-lab" else
                 "the export's config.json (speculators_config.verifier.name_or_path)")
        log(f"--target {target} is a GGUF file: in {where} put the hub id or folder of the model it was "
            "converted from in place of ORIGINAL_MODEL (the export fits the same weights in any format)")
    engines = ("one of" if export_format == "z-lab" else
               "vLLM, which reads the target from it (SGLang and the dflash package read --export-format z-lab)")
    log(f"untrained export (B = {drafter.config.block_size}, {export_format} format) in {path}; serve it with "
        f"{engines}:")
    for command in serving_commands(served, path, drafter.config.block_size, export_format):
        log(command)
    return {"export": path}


def load_checked_target(target, dtype_flag, c, first_row, device, log):
    """The frozen target in the training dtype (logged, with why), checked against the drafter's
    config c: its tables and the mask token, then its forward on the first training row's start."""
    dtype, why = training_dtype(dtype_flag, device)
    log(f"training in {str(dtype).removeprefix('torch.')}" + (" under bf16 autocast" if dtype != torch.float32 else "")
        + f": {why}")
    model = load_target(target, dtype_flag, device)
    check_target_view(c, model, torch.as_tensor(first_row[:128])[None].to(device))
    return model


def make_optimizer(params, lr):
    """AdamW as one fused kernel over all the drafter's tensors: the same update as the loop over tensors,
    to rounding, in a seventh of the time on the AMX Xeon (bench.cost's training step builds it here too)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True)


def split_rows(dataset, val_size, data):
    """-> (training rows, validation rows): the last val_size rows of --data validate."""
    if len(dataset) <= val_size:
        raise ValueError(f"--data {data}: {len(dataset)} usable rows, need more than --val-size {val_size}")
    n_train = len(dataset) - val_size
    return dataset.select(range(n_train)), dataset.select(range(n_train, len(dataset)))


def data_stream(train_rows, seed, batch_size, grad_accum, world, rank, pad_token_id, device):
    """The data order: one permutation per epoch, seeded by (seed, epoch); rank r takes its slice
    of every global batch, so the step alone says where the data stands. -> micro_batch(step,
    micro): the batch, its training rows' indices and their anchor seeds (from their places)."""
    global_batch = batch_size * grad_accum * world

    @lru_cache(maxsize=2)
    def epoch_order(epoch):
        return torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()

    def micro_batch(step, micro):
        start = step * global_batch + (micro * world + rank) * batch_size
        places = range(start, start + batch_size)
        idx = [epoch_order(i // len(train_rows))[i % len(train_rows)] for i in places]
        return collate(train_rows[idx], pad_token_id, device), idx, [anchor_seed(seed, i) for i in places]
    return micro_batch


def step_line(step, total, loss, s, lr, tokens_per_second, eta):
    """A logged step's line; s: its stats (rank 0's micro-batches; "-": selector off), loss: all ranks'."""
    f = lambda k, spec: format(s[k], spec) if k in s else "-"
    return (f"step {step:>5}/{total} | loss {loss:.4f} unary {s['unary_loss']:.4f} sel {f('selector_loss', '.4f')} | "
            f"slot acc {' '.join(f'{a:.2f}' for a in s['slot_acc'])} | AL unary {s['al_unary']:.2f} walk "
            f"{f('al_walk', '.2f')} oracle {f('al_oracle', '.2f')} | lr {lr:.2e} | {tokens_per_second:.0f} tok/s | "
            f"eta {int(eta // 60)}m{int(eta % 60):02d}s")


# -----------------------------------------------------------------------------
# training


def train(args):
    world, rank, device, log = start_ranks()
    master = rank == 0
    check_out_dir(args.out_dir)
    resume_file = os.path.join(args.out_dir, "resume.pt")
    if args.resume and not os.path.isfile(resume_file):
        raise ValueError(f"--resume: {resume_file} not found")
    if args.target and device.type == "cuda":  # the memory plan: the target's config is enough
        check_memory(args, device)
    offline_world(args, world, rank, log)

    # tokenizer, target config, drafter, data: every shape or data problem surfaces before the
    # (possibly many-GB) target weights load
    tokenizer = load_tokenizer(args.target, args.chat_template)
    target_config = load_config(args.target)
    if args.dry_run:
        return dry_run(build_drafter(args, tokenizer, target_config, None, log), args.target, args.out_dir,
                       export_options(args.export_dtype, args.export_format, args.target, target_config), log)
    dataset = load_rows(args.data, args.data_split, tokenizer, args.seq_len, drop_bad=args.drop_bad_rows, log=log,
                        template_kwargs=parse_template_kwargs(args.chat_template_kwargs))
    drafter = build_drafter(args, tokenizer, target_config, dataset, log)
    train_rows, val = split_rows(dataset, args.val_size, args.data)
    global_batch = args.batch_size * args.grad_accum * world
    total = math.ceil(args.epochs * len(train_rows) / global_batch) if args.epochs else args.steps
    warmup = max(1, round(WARMUP * total))
    run = run_identity(target_config, drafter.config, train_rows, args.seq_len, {
        "steps": total, "warmup": warmup, "lr": args.lr, "lr_floor": args.lr_floor, "global_batch": global_batch,
        "world": world, "seed": args.seed})
    state = check_resume(resume_file, run) if args.resume else None

    target = load_checked_target(args.target, args.dtype, drafter.config, train_rows[0]["input_ids"], device, log)
    meta = {"run": run, "target_weights": weights_fingerprint(target)}
    drafter.to(device).grad_checkpoint = args.grad_checkpoint
    params = list(drafter.parameters())
    optimizer = make_optimizer(params, args.lr)
    step = resume(state, meta, drafter, optimizer, args.out_dir, master) if state is not None else 0
    # data parallel: DDP starts every replica from rank 0's weights and averages each gradient during the
    # backward, the selector's too (its hooks sit on the parameters). The forward must go through it: one
    # that does not leaves the gradients unreduced, silently, and the replicas drift apart
    ddp = DistributedDataParallel(drafter) if world > 1 else None
    os.makedirs(args.out_dir, exist_ok=True)
    c, loss_cfg, sums_fn = drafter.config, loss_config(args), compiled_loss(device, log, args.compile)
    view = target_view(c, target)
    features = feature_cache(args, target, c, train_rows, total * global_batch, log)
    export = export_options(args.export_dtype, args.export_format, args.target, target_config,
                            target.get_input_embeddings())
    log(f"target {args.target} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, {target.dtype}) | drafter "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M, {c.num_layers} layers, B={c.block_size}, target layers "
        f"{c.target_layer_ids}, mask token {c.mask_token_id} | data {args.data}: {len(train_rows)} train / {len(val)} "
        f"val rows | {world} rank(s) on {device.type} | out {os.path.abspath(args.out_dir)}")
    micro_batch = data_stream(train_rows, args.seed, args.batch_size, args.grad_accum, world, rank,
                              tokenizer.pad_token_id, device)

    losses, summary, t_start, t_log, tokens, start_step = {}, {}, time.time(), time.time(), 0, step
    while step < total:
        micro_stats, logged = [], (step + 1) % args.log_every == 0 or step + 1 == total  # metrics: host syncs
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
        lr = lr_at(step, total, warmup, args.lr, args.lr_floor)
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
        if master and ((args.save_every and step % args.save_every == 0) or step == total):
            save_checkpoint(drafter, optimizer, step, args.out_dir, export, meta)
            log(f"saved {args.out_dir}/checkpoint and resume.pt at step {step}")
        if master and ((args.eval_every and step % args.eval_every == 0) or step == total):
            summary = evaluate(drafter, target, tokenizer, val, args, device, log)
            record(args.out_dir, {"kind": "eval", "step": step, **summary["val"], "al_t0": summary["al_t0"],
                                  "al_t1": summary["al_t1"]})
            plot_curves(args.out_dir)

    if world > 1:
        dist.destroy_process_group()
    log(f"done in {time.time() - t_start:.0f}s: export {os.path.abspath(os.path.join(args.out_dir, 'checkpoint'))}")
    return {**summary, "step": step, "losses": losses, "out_dir": args.out_dir, "target": args.target}


if __name__ == "__main__":
    args = parse_args()
    try:
        train(args)
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"train.py: {e}") from None
