"""
DFlash2 measurements, in two parts.

  ablation  train DFlash, +conv, +selector and DFlash2 against the offline tiny-world
            target with the same data, steps and seed; measure real acceptance length
            with spec_generate at T = 0 and T = 1, the unary / selector / oracle paths of
            the DFlash2 drafter, end-to-end decoding speed, and plot per-slot acceptance.
  cost      draft-step time at a Qwen3-4B-like drafter shape with random weights, with
            and without the convolution and the selector, the walk alone, and the
            training-step time of DFlash vs DFlash2 at a small shape.

python bench.py            # everything (CPU: tens of minutes)
python bench.py --quick    # a few minutes, for a smoke run
"""
import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash2 as D

VARIANTS = {  # name -> (conv_kernel_size, selector_top_k); 0 switches a part off
    "DFlash": (0, 0),
    "+conv": (2, 0),
    "+selector": (0, 16),
    "DFlash2": (2, 16),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny budgets everywhere: a smoke run in a few minutes")
    p.add_argument("--parts", default="ablation,cost", help="comma-separated subset of: ablation, cost")
    p.add_argument("--out-dir", default="bench_out", help="where results.json, results.md and the plot go")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device for the cost part")
    g = p.add_argument_group("ablation")
    g.add_argument("--seeds", type=int, default=1, help="training seeds per variant")
    g.add_argument("--steps", type=int, default=None, help="drafter training steps per variant (default: train.py's)")
    g.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for spec_generate")
    g.add_argument("--eval-tokens", type=int, default=64, help="max_new_tokens per prompt")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash2"),
                   help="train.py's offline-world cache")
    g = p.add_argument_group("cost")
    g.add_argument("--repeats", type=int, default=20, help="timed repeats per variant (medians reported)")
    g.add_argument("--context", type=int, default=384, help="context tokens already in the drafter cache")
    g.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", help="cost-part dtype")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# timing


def interleaved_medians(fns, repeats, warmup=2, device=torch.device("cpu")):
    """Run every fn once per round, rounds interleaved so drift hits all alike; the median
    over rounds in seconds per fn, warm-up rounds excluded."""
    times = {k: [] for k in fns}
    for r in range(warmup + repeats):
        for k, fn in fns.items():
            t0 = D._now(device)
            fn()
            if r >= warmup:
                times[k].append(D._now(device) - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def random_target(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, dtype, device):
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096)
    return Qwen3ForCausalLM(cfg).to(device, dtype).eval()


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
    target = random_target(**shape, dtype=dtype, device=dev)
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
    med = interleaved_medians(fns, 3 if quick else args.repeats, device=dev)
    base = med["DFlash"]
    return {"shape": {**shape, "draft_layers": 5, "block": B, "K": 16, "R": 256, "context": args.context,
                      "dtype": args.dtype, "device": str(dev)},
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_vs_dflash": {k: v / base for k, v in med.items()}}


def train_step_cost(args):
    """Forward + backward of dflash2_loss (target forward included) at a small shape."""
    dev, dtype = torch.device(args.device), torch.float32
    shape = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=4096)
    target = random_target(**shape, dtype=dtype, device=dev)
    drafters = variant_drafters(target.config, dtype, dev, num_layers=2, block_size=8, mask_token_id=shape["vocab"] - 1,
                                target_layer_ids=[0, 2], selector_rank=64, conv_group_size=16)
    g = torch.Generator().manual_seed(0)
    S, batch = 256, 2
    ids = torch.randint(0, shape["vocab"] - 1, (batch, S), generator=g).to(dev)
    ones = torch.ones_like(ids)
    anchors, valid = D.sample_anchors(ones, 64, g)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)

    def step(d):
        loss, _ = D.dflash2_loss(d, target, ids, ones, ones, out.hidden_states, out.logits, anchors.to(dev), valid.to(dev))
        loss.backward()
    fns = {k: (lambda d=drafters[k]: step(d)) for k in ("DFlash", "DFlash2")}
    med = interleaved_medians(fns, 3 if args.quick else 10, device=dev)
    return {"shape": {**shape, "draft_layers": 2, "seq": S, "batch": batch, "anchors": 64},
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio_dflash2_vs_dflash": med["DFlash2"] / med["DFlash"]}



# -----------------------------------------------------------------------------
# ablation in the tiny world


def without_selector(drafter):
    """The same drafter (shared weights) proposing by unary argmax: its selector switched off."""
    unary_only = copy.copy(drafter)
    unary_only.config = dataclasses.replace(drafter.config, selector_top_k=0)
    return unary_only


def spec_eval(drafter, target, prompts, args, temperature, stop_id):
    """Real acceptance length per prompt, slot-wise acceptance counts and decoding speed."""
    gen = torch.Generator().manual_seed(0)
    als, accepted, cycles, forwards, tokens, seconds = [], None, 0, 0, 0, 0.0
    for p in prompts:
        _, s = D.spec_generate(drafter, target, p, args.eval_tokens, temperature, stop_token_ids=[stop_id], generator=gen)
        als.append(s.mean_acceptance_length)
        accepted = s.accepted_per_slot if accepted is None else [a + b for a, b in zip(accepted, s.accepted_per_slot)]
        cycles, forwards, tokens, seconds = (cycles + len(s.acceptance_lengths), forwards + s.target_forwards,
                                             tokens + s.new_tokens, seconds + s.decode_seconds)
    reached = [cycles] + accepted[:-1]  # slot k is reached when slots < k were all accepted
    return {"al_mean": statistics.mean(als), "al_se": statistics.stdev(als) / math.sqrt(len(als)) if len(als) > 1 else 0.0,
            "slot_acceptance": [a / max(1, r) for a, r in zip(accepted, reached)],
            "tokens_per_s": tokens / seconds, "target_forwards_per_token": forwards / tokens}


def ablation(args):
    import train as T  # the same training code path as `python train.py`
    import tiny_world as W
    base = ["--cache-dir", args.cache_dir, "--export-dtype", "float32", "--eval-prompts", "2"]
    if args.quick:  # a barely trained target and the first 64 conversations: checks the plumbing, not the numbers
        W.tiny_world(args.cache_dir, 20)
        quick_data = os.path.join(args.out_dir, "quick-conversations.jsonl")
        with open(os.path.join(args.cache_dir, "stdlib-conversations.jsonl")) as src, open(quick_data, "w") as dst:
            dst.writelines(line for _, line in zip(range(64), src))
        base += ["--tiny-pretrain-steps", "20", "--data", quick_data, "--steps", "4", "--val-size", "8",
                 "--eval-new-tokens", "8", "--batch-size", "4", "--seq-len", "256"]
    elif args.steps:
        base += ["--steps", str(args.steps)]
    runs = {}
    for seed in range(args.seeds):
        for name, (taps, top_k) in VARIANTS.items():
            out = os.path.join(args.out_dir, f"{name}-seed{seed}")
            t0 = time.time()
            summary = T.train(T.parse_args(base + ["--out-dir", out, "--seed", str(seed), "--conv-kernel-size",
                                                   str(taps), "--selector-top-k", str(top_k)]))
            runs[name, seed] = {"summary": summary, "train_seconds": time.time() - t0,
                                "checkpoint": os.path.join(out, "checkpoint")}

    # the same held-out prompts for every drafter: the prompts of train.py's validation rows
    targs = T.parse_args(base)
    target_path, data_path = W.tiny_world(args.cache_dir, targs.tiny_pretrain_steps)  # cached by the runs above
    data_path = targs.data or data_path
    tokenizer = T.transformers.AutoTokenizer.from_pretrained(target_path)
    target = T.transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    rows = T.load_rows(data_path, "train", tokenizer, targs.seq_len, args.cache_dir)
    val = rows.select(range(len(rows) - targs.val_size, len(rows)))
    prompts = [r["input_ids"][None, :int(r["loss_mask"].nonzero()[0])] for r in val][:args.eval_prompts]

    results = {"prompts": len(prompts), "max_new_tokens": args.eval_tokens, "seeds": args.seeds, "variants": {}}
    for name in VARIANTS:
        per_seed = []
        for seed in range(args.seeds):
            run = runs[name, seed]
            drafter = D.DFlash2Drafter.from_pretrained(run["checkpoint"]).eval()
            r = {"train_seconds": run["train_seconds"], "val": run["summary"]["val"]}
            for temperature in (0.0, 1.0):
                r[f"T={temperature:g}"] = spec_eval(drafter, target, prompts, args, temperature, tokenizer.eos_token_id)
                if drafter.config.selector_top_k:
                    r[f"T={temperature:g} unary path"] = spec_eval(without_selector(drafter), target, prompts, args,
                                                                   temperature, tokenizer.eos_token_id)
            per_seed.append(r)
        results["variants"][name] = per_seed
    baseline = [D.target_generate(target, p, args.eval_tokens, stop_token_ids=[tokenizer.eos_token_id])[1] for p in prompts]
    results["autoregressive_tokens_per_s"] = sum(s.new_tokens for s in baseline) / sum(s.decode_seconds for s in baseline)
    return results


# -----------------------------------------------------------------------------
# report


def markdown(results):
    lines = []
    if "ablation" in results:
        a = results["ablation"]
        mean = lambda xs: statistics.mean(xs)
        lines += [f"Ablation: real acceptance length (mean ± s.e. over {a['prompts']} held-out prompts, "
                  f"≤ {a['max_new_tokens']} new tokens, {a['seeds']} seed(s); tokens/s and target forwards "
                  f"per token at T = 0; autoregressive baseline {a['autoregressive_tokens_per_s']:.1f} tok/s)", "",
                  "| drafter | AL T=0 | AL T=1 | expected AL unary / selector / oracle (val) | tok/s | target fwd / token |",
                  "|---|---|---|---|---|---|"]
        for name, per_seed in a["variants"].items():
            for label, key in ((name, ""), (f"{name}, unary path", " unary path")):
                if f"T=0{key}" not in per_seed[0]:
                    continue
                al = lambda t: f"{mean([r[f'T={t}{key}']['al_mean'] for r in per_seed]):.2f} ± " \
                               f"{mean([r[f'T={t}{key}']['al_se'] for r in per_seed]):.2f}"
                v = per_seed[0]["val"]
                expected = "" if key else " / ".join(f"{v[k]:.2f}" if k in v else "-"
                                                     for k in ("al_unary", "al_selector", "al_oracle"))
                lines.append(f"| {label} | {al(0)} | {al(1)} | {expected} | "
                             f"{mean([r[f'T=0{key}']['tokens_per_s'] for r in per_seed]):.1f} | "
                             f"{mean([r[f'T=0{key}']['target_forwards_per_token'] for r in per_seed]):.3f} |")
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


def plot(ablation_results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, t in zip(axes, ("0", "1")):
        for name, per_seed in ablation_results["variants"].items():
            rates = [statistics.mean(r[f"T={t}"]["slot_acceptance"][k] for r in per_seed)
                     for k in range(len(per_seed[0][f"T={t}"]["slot_acceptance"]))]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        ax.set(title=f"T = {t}", xlabel="slot k", ylim=(0, 1))
    axes[0].set_ylabel("P(slot k accepted | slots < k accepted)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args):
    os.makedirs(args.out_dir, exist_ok=True)
    if args.quick:
        args.eval_prompts, args.eval_tokens = min(args.eval_prompts, 3), min(args.eval_tokens, 16)
    parts, results, t0 = args.parts.split(","), {}, time.time()
    if "cost" in parts:
        results["draft_step"], results["train_step"] = draft_step_cost(args), train_step_cost(args)
    if "ablation" in parts:
        results["ablation"] = ablation(args)
        plot(results["ablation"], os.path.join(args.out_dir, "per_slot_acceptance.png"))
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
    main(parse_args())
