"""
DFlash2 measurements, in parts (the default runs ablation and cost).

  ablation  train DFlash, +conv, +selector and DFlash2 (and DFlash2 with soft selector
            labels, an option of §6) with train.py against the offline tiny-world
            target, same data and steps, for several seeds; measure real
            acceptance length with spec_generate on held-out prompts at each temperature
            (the selector drafters also with their selector switched off: the unary path),
            the expected AL of the unary / selector / oracle top-K paths on validation
            blocks, and the per-slot conditional acceptance. Every AL comes with a 95%
            bootstrap interval that redraws both the training seeds and the prompts, so it
            covers the run-to-run spread of training as well as the choice of prompts.
  cost      draft-step time at a Qwen3-4B-like drafter shape with random weights, with
            and without the convolution and the selector, the walk alone, and the
            training-step time of DFlash vs DFlash2 at a small shape.
  memory    peak memory of one training step against --max-anchors at V = 151936,
            chunked vs unchunked loss, with the plan's estimate (memory.memory_table).
  gpu       the GPU check of memory.gpu_check: one CUDA device, under 8 minutes.

python bench.py --parts ablation   # 3 seeds × 5 drafters, 64 prompts (2-core CPU: see the README)
python bench.py --quick            # a smoke run of both parts in about a minute
"""
import argparse
import copy
import dataclasses
import json
import os
import shlex
import statistics
import time

import torch

import dflash2 as D
import memory

VARIANTS = {  # name -> (conv_kernel_size, selector_top_k); 0 switches a part off
    "DFlash": (0, 0),
    "+conv": (2, 0),
    "+selector": (0, 16),
    "DFlash2": (2, 16),
}
SOFT = "DFlash2 (soft labels)"  # DFlash2 trained with --selector-labels soft, an option of §6
DRAFTERS = {  # the ablation: name -> train.py flags on top of the shared ones (the parts' sizes come from those)
    "DFlash": ["--conv-kernel-size", "0", "--selector-top-k", "0"],
    "+conv": ["--selector-top-k", "0"],
    "+selector": ["--conv-kernel-size", "0"],
    "DFlash2": [],
    SOFT: ["--selector-labels", "soft"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny budgets everywhere: a smoke run in a few minutes")
    p.add_argument("--parts", default="ablation,cost", help="comma-separated subset of: ablation, cost, memory, gpu")
    p.add_argument("--out-dir", default="bench_out", help="where results.json, results.md and the plot go")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device for the cost part")
    g = p.add_argument_group("ablation")
    g.add_argument("--seeds", type=int, default=3, help="training seeds per variant")
    g.add_argument("--drafters", type=lambda s: s.split(","), default=list(DRAFTERS),
                   help=f"comma-separated subset of: {', '.join(DRAFTERS)}")
    g.add_argument("--steps", type=int, default=None, help="drafter training steps per variant (default: train.py's)")
    g.add_argument("--train-flags", default="", help="more train.py flags for every run, e.g. '--block-size 16' or "
                   "'--selector-top-k 64' (the parts' sizes)")
    g.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for spec_generate")
    g.add_argument("--eval-tokens", type=int, default=64, help="max_new_tokens per prompt")
    g.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 1.0],
                   help="comma-separated sampling temperatures for spec_generate")
    g.add_argument("--val-blocks", type=int, default=1024, help="validation blocks for the expected-AL metrics")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash2"),
                   help="train.py's offline-world cache")
    g = p.add_argument_group("cost")
    g.add_argument("--repeats", type=int, default=20, help="timed repeats per variant (medians reported)")
    g.add_argument("--context", type=int, default=384, help="context tokens already in the drafter cache")
    g.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", help="cost-part dtype")
    return p.parse_args(argv)


def variant_drafters(target_config, dtype, device, **shape):
    """The four variants over one shared backbone (the same tensors, not copies), with the
    DFlash2 parts randomised away from their identity init so they do real work."""
    drafters = {}
    for name, (taps, top_k) in reversed(VARIANTS.items()):  # DFlash2 first: it owns every tensor
        cfg = D.DFlash2Config.from_target(target_config, conv_kernel_size=taps, selector_top_k=top_k, **shape)
        d = drafters[name] = D.DFlash2Drafter(cfg).to(device, dtype).eval()
        if name == "DFlash2":
            with torch.no_grad():
                for p in d.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            shared = d.state_dict()
        else:
            d.load_state_dict({k: shared[k] for k in d.state_dict()}, assign=True)
    return drafters


# -----------------------------------------------------------------------------
# cost


@torch.no_grad()
def draft_step_cost(args):
    """One draft step as serving runs it: drafter forward over one block with a cached
    context, lm_head, top-K and the walk (or unary argmax with the selector off)."""
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    quick = args.quick
    shape = dict(hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, intermediate=1536, vocab=32000) if quick else \
        dict(hidden=2560, layers=2, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936)  # Qwen3-4B widths
    target = memory.random_target(**shape, dtype=dtype, device=dev)
    drafters = variant_drafters(target.config, dtype, dev, num_layers=5, block_size=8, mask_token_id=shape["vocab"] - 1,
                                target_layer_ids=[0, 1], selector_rank=256, conv_group_size=16)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    B, H = 8, shape["hidden"]
    ctx = torch.randn(1, args.context, 2 * H, device=dev, dtype=dtype)
    block = torch.full((1, B), shape["vocab"] - 1, device=dev)
    block[0, 0] = 11
    pos = torch.arange(args.context, args.context + B, device=dev)[None]
    no_ctx, no_pos = ctx[:, :0], pos[:, :0]

    fns, caches = {}, {}
    for name, d in drafters.items():
        caches[name] = D.DraftCache(d.config.num_layers)
        d(embed(block), pos, ctx, torch.arange(args.context, device=dev)[None], cache=caches[name])

        def step(d=d, cache=caches[name]):  # the cache already holds the context; no new context this step
            h = d(embed(block), pos, no_ctx, no_pos, cache=cache)[:, 1:]
            d.propose(h, lm_head(h).float(), block[:, 0])
        fns[name] = step
    full = drafters["DFlash2"]
    h = full(embed(block), pos, no_ctx, no_pos, cache=caches["DFlash2"])[:, 1:]
    unary = lm_head(h).float()
    fns["walk alone"] = lambda: full.candidate_selector.walk(h, unary, block[:, 0])
    med = memory.median_seconds(fns, 1 if quick else args.repeats, warmup=1 if quick else 2, device=dev)
    base = med["DFlash"]
    return {"shape": {**shape, "draft_layers": 5, "block": B, "K": 16, "R": 256, "context": args.context,
                      "dtype": args.dtype, "device": str(dev)},
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_vs_dflash": {k: v / base for k, v in med.items()}}


def train_step_cost(args):
    """Forward + backward of dflash2_loss (target forward included) at a small shape."""
    dev, dtype = torch.device(args.device), torch.float32
    shape = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=4096)
    target = memory.random_target(**shape, dtype=dtype, device=dev)
    drafters = variant_drafters(target.config, dtype, dev, num_layers=2, block_size=8, mask_token_id=shape["vocab"] - 1,
                                target_layer_ids=[0, 2], selector_rank=64, conv_group_size=16)
    g = torch.Generator().manual_seed(0)
    S, batch = 256, 2
    ids = torch.randint(0, shape["vocab"] - 1, (batch, S), generator=g).to(dev)
    ones = torch.ones_like(ids)
    anchors, valid = D.sample_anchors(ones, 64, g)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, logits_to_keep=1)

    def step(d):  # as train.py's steps run it: no metrics
        loss, _ = D.dflash2_loss(d, target, ids, ones, ones, out.hidden_states, anchors.to(dev), valid.to(dev),
                                 with_metrics=False)
        loss.backward()
    fns = {k: (lambda d=drafters[k]: step(d)) for k in ("DFlash", "DFlash2")}
    med = memory.median_seconds(fns, 1 if args.quick else 10, warmup=1 if args.quick else 2, device=dev)
    return {"shape": {**shape, "draft_layers": 2, "seq": S, "batch": batch, "anchors": 64},
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_dflash2_vs_dflash": med["DFlash2"] / med["DFlash"]}



# -----------------------------------------------------------------------------
# statistics: a bootstrap over training seeds and prompts


def bootstrap(arrays, fn, n=2000, seed=0):
    """Two-level bootstrap: each replicate redraws the seeds (rows) and, independently, the
    prompts (columns) with replacement, and applies fn to the resampled arrays. arrays:
    tensors (S, P, ...) sharing their seeds and prompts, so a ratio of two of them is paired.
    fn maps tensors (n, S, P, ...) to (n, ...). -> replicates (n, ...)."""
    S, P = arrays[0].shape[:2]
    g = torch.Generator().manual_seed(seed)
    si, pi = torch.randint(S, (n, S, 1), generator=g), torch.randint(P, (n, 1, P), generator=g)
    return fn(*(a[si, pi] for a in arrays))


def interval(replicates, level=0.95):
    """Percentile interval of bootstrap replicates (n, ...) -> (lo, hi)."""
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=replicates.dtype)
    lo, hi = torch.quantile(replicates, q, dim=0)
    return lo, hi


def mean_ci(x):
    """x (S, P) -> (mean, lo, hi) of the mean over seeds and prompts."""
    lo, hi = interval(bootstrap([x], lambda a: a.mean((1, 2))))
    return x.mean().item(), lo.item(), hi.item()


def ratio_ci(x, y):
    """(S, P) each, paired by seed and prompt -> (mean(x) / mean(y), lo, hi)."""
    lo, hi = interval(bootstrap([x, y], lambda a, b: a.mean((1, 2)) / b.mean((1, 2))))
    return (x.mean() / y.mean()).item(), lo.item(), hi.item()


def slot_ci(accepted, reached):
    """(S, P, B-1) counts -> per-slot P(accepted | reached) and its (lo, hi) bands."""
    rate = lambda a, r: a.sum((1, 2)) / r.sum((1, 2)).clamp(min=1)
    lo, hi = interval(bootstrap([accepted, reached], rate))
    return rate(accepted[None], reached[None])[0].tolist(), lo.tolist(), hi.tolist()


# -----------------------------------------------------------------------------
# ablation in the tiny world


def without_selector(drafter):
    """The same drafter (shared weights) with its selector switched off: it proposes from
    the unary logits, and its metrics are a selector-less drafter's."""
    unary_only = copy.copy(drafter)
    unary_only._modules = {**drafter._modules, "candidate_selector": None}  # the original keeps its selector
    unary_only.config = dataclasses.replace(drafter.config, selector_top_k=0)
    return unary_only


def spec_eval(drafter, target, prompts, args, temperature, stop_id):
    """Real acceptance length and the slot-wise counts per prompt, decoding speed overall."""
    gen = torch.Generator().manual_seed(0)
    out = {"al": [], "accepted": [], "reached": [], "target_forwards": 0, "new_tokens": 0, "seconds": 0.0}
    for p in prompts:
        _, s = D.spec_generate(drafter, target, p, args.eval_tokens, temperature, stop_token_ids=[stop_id], generator=gen)
        out["al"].append(s.mean_acceptance_length)
        out["accepted"].append(s.accepted_per_slot)
        out["reached"].append([len(s.acceptance_lengths)] + s.accepted_per_slot[:-1])  # slots < k all accepted
        out["target_forwards"] += s.target_forwards
        out["new_tokens"] += s.new_tokens
        out["seconds"] += s.decode_seconds
    return out


@torch.no_grad()
def val_metrics(drafter, target, val, targs, pad_id, min_blocks):
    """train.py's validation metrics averaged over blocks (not batches), on at least
    min_blocks blocks: every further pass over the rows draws new anchors."""
    import train as T
    total, n_blocks, rounds = {}, 0, 0
    while n_blocks < min_blocks:
        for i in range(0, len(val), targs.batch_size):
            batch = T.collate(val[i:i + targs.batch_size], pad_id, torch.device("cpu"))
            seeds = [rounds * len(val) + j for j in range(i, i + len(batch[0]))]
            n = int(T.row_anchors(batch[2], targs.max_anchors, seeds)[1].sum())  # the blocks loss_step draws
            stats = T.loss_step(drafter, target, batch, targs, seeds)[1]
            for k, v in stats.items():
                total[k] = [t + n * x for t, x in zip(total.get(k, [0] * len(v)), v)] if isinstance(v, list) \
                    else total.get(k, 0) + n * v
            n_blocks += n
        rounds += 1
    return {"blocks": n_blocks, **{k: [x / n_blocks for x in v] if isinstance(v, list) else v / n_blocks
                                   for k, v in total.items()}}


def ablation(args):
    import train as T  # the same training code path as `python train.py`
    import tiny_world as W
    defaults = T.parse_args(shlex.split(args.train_flags))  # train.py's defaults, and the world it would build
    if args.quick:  # a barely trained target and few prompts: checks the plumbing, not the numbers
        target_path, data_path = W.tiny_world(args.cache_dir, 5, train_prompts=32, max_new_tokens=24)
        base = ["--steps", "4", "--batch-size", "4", "--seq-len", "256", "--selector-rank", "16"]
    else:
        target_path, data_path = W.tiny_world(args.cache_dir, defaults.tiny_pretrain_steps)
        base = ["--steps", str(args.steps)] if args.steps else []
    val_size = 8 if args.quick else max(defaults.val_size, args.eval_prompts)
    base = ["--target", target_path, "--data", data_path, "--cache-dir", args.cache_dir, "--val-size", str(val_size),
            "--export-dtype", "float32", "--eval-prompts", "1", "--eval-new-tokens", "8", *base,
            *shlex.split(args.train_flags)]
    # the same held-out prompts for every drafter: the prompts of train.py's validation rows
    targs = T.parse_args(base)
    tokenizer = T.transformers.AutoTokenizer.from_pretrained(target_path)
    target = T.transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    rows = T.load_rows(data_path, "train", tokenizer, targs.seq_len, log=lambda *a: None)
    val = rows.select(range(len(rows) - targs.val_size, len(rows)))
    prompts = [r["input_ids"][None, :int(r["loss_mask"].nonzero()[0])] for r in val][:args.eval_prompts]
    baseline = [D.target_generate(target, p, args.eval_tokens, stop_token_ids=[tokenizer.eos_token_id])[1]
                for p in prompts]

    results = {"prompts": len(prompts), "max_new_tokens": args.eval_tokens, "seeds": 0,
               "temperatures": args.temperatures, "train_flags": base[2:], "variants": {},
               "autoregressive_tokens_per_s": sum(s.new_tokens for s in baseline) / sum(s.decode_seconds for s in baseline)}
    for seed in range(args.seeds):  # seed by seed, so that a long run reports what it has so far
        for name in args.drafters:
            out = os.path.join(args.out_dir, f"{name.replace(' (', '-').strip(')').replace(' ', '-')}-seed{seed}")
            run_args = T.parse_args(base + ["--out-dir", out, "--seed", str(seed), *DRAFTERS[name]])
            t0 = time.time()
            T.train(run_args)
            train_seconds = time.time() - t0
            # a partial variant exports as a full DFlash2 with its missing part at the identity (§7);
            # +conv then proposes through its own unary path, as a drafter with no selector does
            drafter = D.DFlash2Drafter.from_pretrained(os.path.join(out, "checkpoint")).eval()
            unary = without_selector(drafter)
            paths = {name: drafter, f"{name}, unary path": unary} if run_args.selector_top_k else {name: unary}
            val_stats = val_metrics(paths[name], target, val, targs, tokenizer.pad_token_id, args.val_blocks)
            for label, d in paths.items():
                r = results["variants"].setdefault(label, {"train_seconds": [], "val": [], "spec": {}})
                if label == name:
                    r["train_seconds"].append(train_seconds)
                    r["val"].append(val_stats)
                for t in args.temperatures:
                    r["spec"].setdefault(f"T={t:g}", []).append(spec_eval(d, target, prompts, args, t,
                                                                          tokenizer.eos_token_id))
        results["seeds"] = seed + 1
        summarize(results)
        with open(os.path.join(args.out_dir, "ablation_so_far.md"), "w") as f:
            f.write(markdown({"ablation": results}) + "\n")
    return results


def summarize(a):
    """Means and 95% bootstrap intervals over (seeds × prompts), written into the results."""
    grid = lambda label, t, key: torch.tensor([run[key] for run in a["variants"][label]["spec"][t]], dtype=torch.float64)
    a["summary"] = {}
    for label, r in a["variants"].items():
        s = a["summary"][label] = {}
        for t in r["spec"]:
            runs = r["spec"][t]
            s[t] = {"al": mean_ci(grid(label, t, "al")),
                    "slot_acceptance": slot_ci(grid(label, t, "accepted"), grid(label, t, "reached")),
                    "tokens_per_s": sum(x["new_tokens"] for x in runs) / sum(x["seconds"] for x in runs),
                    "target_forwards_per_token": sum(x["target_forwards"] for x in runs) /
                                                 sum(x["new_tokens"] for x in runs)}
            if label != "DFlash" and not label.endswith(", unary path") and "DFlash" in a["variants"]:
                s[t]["ratio_vs_dflash"] = ratio_ci(grid(label, t, "al"), grid("DFlash", t, "al"))
            if f"{label}, unary path" in a["variants"]:
                s[t]["ratio_vs_unary_path"] = ratio_ci(grid(label, t, "al"), grid(f"{label}, unary path", t, "al"))
            if label == SOFT and "DFlash2" in a["variants"]:
                s[t]["ratio_vs_argmax_labels"] = ratio_ci(grid(label, t, "al"), grid("DFlash2", t, "al"))
        if r["val"]:
            s["val"] = {k: statistics.mean(v[k] for v in r["val"]) for k in
                        ("blocks", "al_unary", "al_selector", "al_oracle", "recall_at_k", "selector_tf_acc",
                         "accept_unary", "accept_selector", "mass_at_k")
                        if k in r["val"][0]}
            s["val"]["selector_path_acc"] = [statistics.mean(x) for x in zip(*(v["selector_path_acc"] for v in r["val"]))] \
                if "selector_path_acc" in r["val"][0] else None
            s["val"]["slot_acc"] = [statistics.mean(x) for x in zip(*(v["slot_acc"] for v in r["val"]))]


# -----------------------------------------------------------------------------
# report


def markdown(results):
    lines = []
    if "ablation" in results:
        a = results["ablation"]
        ci = lambda m, lo, hi: f"{m:.2f} [{lo:.2f}, {hi:.2f}]"
        temps = [f"T={t:g}" for t in a["temperatures"]]
        lines += [f"Ablation: real acceptance length, mean [95% bootstrap interval over {a['seeds']} training seed(s) "
                  f"× {a['prompts']} held-out prompts], ≤ {a['max_new_tokens']} new tokens; tokens/s and target "
                  f"forwards per token at {temps[0]}; autoregressive baseline "
                  f"{a['autoregressive_tokens_per_s']:.1f} tok/s", "",
                  "| drafter | " + " | ".join(f"AL {t}" for t in temps) + " | expected AL unary / selector / oracle "
                  "(val) | T=1 acceptance unary / selector / top-K mass (val) | recall@K | selector tf-acc | tok/s | "
                  "target fwd / token |", "|---|" + "---|" * (len(temps) + 6)]
        for label, s in a["summary"].items():
            v = s.get("val", {})
            f = lambda k: (f"{v[k]:.2f}" if k in v else "-") if v else ""
            three = lambda *keys: " / ".join(map(f, keys)) if v else ""
            lines.append(f"| {label} | " + " | ".join(ci(*s[t]["al"]) for t in temps) +
                         f" | {three('al_unary', 'al_selector', 'al_oracle')} | "
                         f"{three('accept_unary', 'accept_selector', 'mass_at_k')} | {f('recall_at_k')} | "
                         f"{f('selector_tf_acc')} | {s[temps[0]]['tokens_per_s']:.1f} | "
                         f"{s[temps[0]]['target_forwards_per_token']:.3f} |")
        blocks = [s["val"]["blocks"] for s in a["summary"].values() if "val" in s]
        lines += ["", f"Expected AL and accuracies: mean over seeds of {min(blocks):.0f}+ validation blocks each.", ""]
        for label, s in a["summary"].items():
            for key, what in (("ratio_vs_dflash", "DFlash"), ("ratio_vs_unary_path", "its unary path"),
                              ("ratio_vs_argmax_labels", "DFlash2 (argmax labels)")):
                if key in s[temps[0]]:
                    lines.append(f"- {label} / {what}: " + ", ".join(f"{t} {ci(*s[t][key])}×" for t in temps))
        lines.append("")
    if "draft_step" in results:
        c = results["draft_step"]
        lines += [f"Draft step at {c['shape']} (median ms, ratio to DFlash)", "", "| variant | ms | × DFlash |", "|---|---|---|"]
        lines += [f"| {k} | {c['median_ms'][k]:.2f} | {c['ratio_vs_dflash'][k]:.3f} |" for k in c["median_ms"]]
        t = results["train_step"]
        lines += ["", f"Training step (target forward + drafter forward/backward) at {t['shape']}: DFlash "
                  f"{t['median_ms']['DFlash']:.0f} ms, DFlash2 {t['median_ms']['DFlash2']:.0f} ms "
                  f"(× {t['ratio_dflash2_vs_dflash']:.3f})", ""]
    return "\n".join(lines)


def plot(a, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = [f"T={t:g}" for t in a["temperatures"]]
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temps):
        for name in (n for n in a["summary"] if not n.endswith(", unary path")):
            rate, lo, hi = a["summary"][name][t]["slot_acceptance"]
            k = range(1, len(rate) + 1)
            ax.plot(k, rate, marker="o", label=name)
            ax.fill_between(k, lo, hi, alpha=0.2)
        ax.set(title=t.replace("=", " = "), xlabel="slot k", ylim=(0, 1))
    axes[0][0].set_ylabel("P(slot k accepted | slots < k accepted)")
    axes[0][0].legend(title="95% bootstrap bands")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_args(args):
    """Bad flags fail here, before any training."""
    if args.seeds < 1:
        raise ValueError(f"--seeds ({args.seeds}) must be >= 1")
    if not set(args.drafters) <= set(DRAFTERS):
        raise ValueError(f"--drafters: unknown drafter(s) {sorted(set(args.drafters) - set(DRAFTERS))}; "
                         f"choose from {', '.join(DRAFTERS)}")
    if args.eval_prompts < 1 or args.eval_tokens < 1:
        raise ValueError(f"--eval-prompts ({args.eval_prompts}) and --eval-tokens ({args.eval_tokens}) must be >= 1")
    if not args.temperatures or any(not t >= 0 for t in args.temperatures):
        raise ValueError(f"--temperatures {args.temperatures} must be one or more numbers >= 0")
    unknown = set(args.parts.split(",")) - {"ablation", "cost", "memory", "gpu"}
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {sorted(unknown)}; choose from ablation, cost, memory, gpu")


def main(args):
    check_args(args)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.quick:
        args.seeds, args.eval_prompts, args.eval_tokens = min(args.seeds, 2), min(args.eval_prompts, 3), \
            min(args.eval_tokens, 16)
        args.val_blocks = min(args.val_blocks, 64)
    parts, results, t0 = args.parts.split(","), {}, time.time()
    if "cost" in parts:
        results["draft_step"], results["train_step"] = draft_step_cost(args), train_step_cost(args)
    if "ablation" in parts:
        results["ablation"] = ablation(args)
        plot(results["ablation"], os.path.join(args.out_dir, "per_slot_acceptance.png"))
    if "memory" in parts:
        results["memory"] = memory.memory_table(plot=os.path.join(args.out_dir, "memory.png"))
    if "gpu" in parts:
        results["gpu"] = memory.gpu_check()
    results["wall_seconds"] = time.time() - t0
    report = markdown(results)
    print(report)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(report + "\n")
    print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.abspath(args.out_dir)}")
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags: one line, before any work
        raise SystemExit(f"bench.py: {e}") from None
