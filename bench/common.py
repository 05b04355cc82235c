"""
What the bench's modules share: Qwen3 targets at real shapes with random weights, the smoke
runs' world, the held-out prompts of train.py's validation rows, interleaved median timing,
and the two-level bootstrap (training seeds × prompts) behind every interval the bench reports.
"""
import json
import os

import torch

import dflash2

# -----------------------------------------------------------------------------
# targets with random weights (nothing downloaded)

# the shapes of Qwen3-4B (tied embeddings) and Qwen3-8B, from their config.json
QWEN3_4B = dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tie=True)
QWEN3_8B = dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936)


def qwen3_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tie=False):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                       max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=tie)


def random_target(seed=0, dtype=torch.float32, device="cpu", **shape):
    """A frozen Qwen3 target of qwen3_config's shape with random weights, initialised
    directly on the device in the given dtype (no fp32 copy of a large model first)."""
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(qwen3_config(**shape)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def quick_world(cache_dir):
    """The smoke runs' tiny world (bench.ablation --quick, bench.gpu_check --cpu-smoke): a target barely
    pretrained (5 steps), 32 training prompts answered in up to 24 tokens. -> (target path, data path)."""
    from harness import tiny_world
    return tiny_world.tiny_world(cache_dir, 5, train_prompts=32, max_new_tokens=24)


# -----------------------------------------------------------------------------
# held-out prompts


def validation_rows(targs, tokenizer):
    """train.py's validation rows for these train.py arguments: the last --val-size rows."""
    from harness.data import load_rows
    from train import DATA_SPLIT
    rows = load_rows(targs.data, DATA_SPLIT, tokenizer, targs.seq_len, log=lambda *a: None)
    return rows.select(range(len(rows) - targs.val_size, len(rows)))


def prompts_of(rows, n):
    """The first n rows' prompts: every token before the first loss (answer) token, (1, P) each."""
    return [r["input_ids"][None, :int(r["loss_mask"].nonzero()[0])] for r in rows][:n]


# -----------------------------------------------------------------------------
# timing


def round_seconds(fns, repeats, warmup=1, device="cpu"):
    """Seconds per call of each fn in each timed round, rounds interleaved so drift hits all
    alike. -> {name: [seconds per round]}."""
    device, times = torch.device(device), {k: [] for k in fns}
    for r in range(warmup + repeats):
        for k, fn in fns.items():
            t0 = dflash2.device_time(device)
            fn()
            if r >= warmup:
                times[k].append(dflash2.device_time(device) - t0)
    return times


def median(xs):
    return sorted(xs)[len(xs) // 2]


def median_seconds(fns, repeats, warmup=1, device="cpu"):
    """Median seconds per call of each fn over round_seconds' rounds."""
    return {k: median(v) for k, v in round_seconds(fns, repeats, warmup, device).items()}


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


def ci_text(mean, lo, hi):
    """(mean, lo, hi) -> 'mean [lo, hi]', two decimals: how every report prints an interval."""
    return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"


def round_ratio_ci(x, y, n=2000, seed=0):
    """Per-round seconds x, y (same rounds, interleaved, so paired) -> (median of the per-round
    ratios x/y, lo, hi): a 95% bootstrap interval that redraws the rounds."""
    r = torch.tensor(x, dtype=torch.float64) / torch.tensor(y, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    replicates = r[torch.randint(len(r), (n, len(r)), generator=g)].sort(-1).values[:, len(r) // 2]
    lo, hi = interval(replicates)
    return median(r.tolist()), lo.item(), hi.item()


def slot_ci(accepted, reached):
    """(S, P, B-1) counts -> per-slot P(accepted | reached) and its (lo, hi) bands."""
    rate = lambda a, r: a.sum((1, 2)) / r.sum((1, 2)).clamp(min=1)
    lo, hi = interval(bootstrap([accepted, reached], rate))
    return rate(accepted[None], reached[None])[0].tolist(), lo.tolist(), hi.tolist()


def write_results(out_dir, stem, results, report):
    """Print the markdown report and write it and the raw results as out_dir/stem.{md,json}."""
    print(report)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(report + "\n")
    print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.abspath(out_dir)}")
