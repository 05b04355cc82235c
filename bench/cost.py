"""
What DFlash2's two parts cost, at real widths with random weights (nothing downloaded).

  draft   one draft step as serving runs it, for DFlash, +conv, +selector and DFlash2 at a
          Qwen3-4B-like drafter shape (5 layers, B = 16, K = 16, R = 256), the walk alone,
          and each variant's floor: the weight bytes its step must read over DFlash's
          (draft_step_reads), the time ratio of a step bound by reading its weights; a
          measured ratio above it is what the parts' compute and kernel launches add.
  train   one training step as train.py takes it at bench.real's shape (SmolLM2-135M's widths):
          the target part, the drafter's loss forward + backward and the whole step, for a
          float32 and a bf16 target, features computed every step or cached, the loss compiled
          (as train.py runs it) and eager, against the floor of its matrix products.
  memory  peak memory of a training step against max_anchors (N) at V = 151936, chunked vs
          unchunked loss, measured in a fresh process and planned by memory.memory_plan.

python -m bench.cost                 # all three parts: bench_out/cost.json, cost.md, memory.png
python -m bench.cost --parts draft --device cuda --draft-dtype bfloat16
python -m bench.cost --quick         # a smoke run at small shapes
"""
import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch

import dflash2
from bench.common import (QWEN3_4B, median, median_seconds, qwen3_config, random_target, round_ratio_ci,
                          round_seconds, write_results)
from harness.memory import memory_plan, sizing_config, train_loss_chunk, use_huge_pages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

# name -> the DFlash2Config fields that switch its parts off (0 = off)
VARIANTS = {
    "DFlash": dict(conv_kernel_size=0, selector_top_k=0),
    "+conv": dict(selector_top_k=0),
    "+selector": dict(conv_kernel_size=0),
    "DFlash2": {},
}
# the draft step's shape: Qwen3-4B's widths and vocabulary; the target needs only its
# embedding and lm_head here, so 2 layers of it (and 1 context feature) are enough
DRAFT_TARGET = dict(QWEN3_4B, layers=2)
QUICK_DRAFT_TARGET = dict(DRAFT_TARGET, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1536, vocab=32000)
DRAFT_DRAFTER = dict(num_layers=5, block_size=16, target_layer_ids=[0], selector_rank=256, selector_top_k=16,
                     conv_kernel_size=2, conv_group_size=16)
# SmolLM2-135M-Instruct's widths and vocabulary (bench.real's target), from its config.json
SMOLLM2_135M = dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, tie=True)


def variant_drafters(target_config, names=tuple(VARIANTS), dtype=torch.float32, device="cpu", **overrides):
    """The named variants of the DFlash2 drafter that `overrides` describe, over one shared
    backbone (the same tensors, not copies), with every weight moved off its init (the
    DFlash2 parts start at the identity) so that both parts do real work."""
    torch.manual_seed(0)
    with torch.device(device):
        full = dflash2.DFlash2Drafter(sizing_config(target_config, **overrides)).to(dtype)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    shared, drafters = full.state_dict(), {}
    for name in names:
        if name == "DFlash2":
            drafters[name] = full
            continue
        with torch.device("meta"):  # no memory: the tensors come from `full`
            d = dflash2.DFlash2Drafter(sizing_config(target_config, **{**overrides, **VARIANTS[name]}))
        d.load_state_dict({k: shared[k] for k in d.state_dict()}, assign=True)
        drafters[name] = d
    return drafters


# -----------------------------------------------------------------------------
# draft step


def draft_step_reads(c):
    """Weight elements one draft step reads at least once (the floor of a step bound by
    memory), with the context already cached, so fc reads nothing:
      backbone  every draft layer's weights and the final norm, the target's lm_head (V·H)
                and the B embedding rows of the block;
      conv      per layer, both LocalConvs' base kernels and kernel projections:
                2 · (2·Kc·H + H · 2·Kc·H/G);
      selector  hidden_projection (R·H, once: the walk applies it slot by slot, but its
                repeat reads are cache hits) and the codebook rows the walk gathers, per
                slot one predecessor row and K successor rows: (B−1)·(K+1)·R.
    -> {"backbone", "conv", "selector": elements} (conv / selector 0 when off)."""
    H, I, B, V = c.hidden_size, c.intermediate_size, c.block_size, c.vocab_size
    Q, KV = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = 2 * H + H * Q + 2 * H * KV + Q * H + 2 * c.head_dim + 3 * H * I  # norms, attention (q/k_norm), MLP
    Kc, G = c.conv_kernel_size, c.conv_group_size
    return {"backbone": c.num_layers * layer + H + V * H + B * H,
            "conv": c.num_layers * 2 * (2 * Kc * H + H * 2 * Kc * (H // G)) if Kc else 0,
            "selector": c.selector_rank * H + (B - 1) * (c.selector_top_k + 1) * c.selector_rank
            if c.selector_top_k else 0}


@torch.no_grad()
def draft_step(drafter, target, context):
    """One draft step as serving runs it, the draft half of dflash2.speculative_decode_step:
    draft_forward over one block [anchor, MASK, ...] with `context` tokens of context already
    in its cache (put there now, from random features), then propose: top-K and the walk, or
    the unary argmax with the selector off. -> (forward, step): forward() -> (h, unary
    logits, anchor), propose's inputs; step() = propose(*forward())."""
    from harness.target import decoding_view
    c, dtype, dev = drafter.config, drafter.fc.weight.dtype, target.device
    view = decoding_view(c, target)
    anchor = torch.ones(1, dtype=torch.long, device=dev)  # any token
    cache = dflash2.DraftCache(c.num_layers)
    features = torch.randn(1, context, len(c.target_layer_ids) * c.hidden_size, device=dev, dtype=dtype)
    dflash2.draft_forward(drafter, view, anchor, features, cache)

    @torch.no_grad()
    def forward():  # no new context this step
        return (*dflash2.draft_forward(drafter, view, anchor, features[:, :0], cache), anchor)

    @torch.no_grad()
    def step():
        return drafter.propose(*forward())
    return forward, step


def draft_step_cost(target, drafters, context=1024, repeats=20, warmup=2):
    """Seconds of one draft_step per drafter in each round, rounds interleaved. Adds "walk
    alone": the walk of the last drafter with a selector, on one step's h and logits."""
    fns, walker = {}, None
    for name, d in drafters.items():
        forward, fns[name] = draft_step(d, target, context)
        if d.config.selector_top_k:
            walker, inputs = d.candidate_selector, forward()
    if walker:
        fns["walk alone"] = torch.no_grad()(lambda: walker.walk(*inputs))
    return round_seconds(fns, repeats, warmup, device=target.device)


def draft_report(times, configs, itemsize):
    """Per variant, from per-round seconds: median ms and × DFlash measured (the median of
    the per-round ratios, with round_ratio_ci's interval); the weight bytes its step reads
    and the floor's × DFlash (bytes / DFlash's bytes) next to it."""
    reads = {k: itemsize * sum(draft_step_reads(c).values()) for k, c in configs.items()}
    return {k: {"ms": 1e3 * median(t), "ratio_vs_dflash": round_ratio_ci(t, times["DFlash"]),
                **({"weight_bytes": reads[k], "floor_ratio_vs_dflash": reads[k] / reads["DFlash"]} if k in reads else {})}
            for k, t in times.items()}


def draft_part(device, dtype, context, repeats, quick, names=tuple(VARIANTS)):
    """draft_step_cost of the named variants at DRAFT_TARGET's shape (QUICK_DRAFT_TARGET's
    with quick), with draft_report's floors."""
    target_shape = QUICK_DRAFT_TARGET if quick else DRAFT_TARGET
    target = random_target(dtype=dtype, device=device, **target_shape)
    drafters = variant_drafters(target.config, names, dtype=dtype, device=device,
                                mask_token_id=target_shape["vocab"] - 1, **DRAFT_DRAFTER)
    times = draft_step_cost(target, drafters, context, repeats, warmup=1 if quick else 3)
    return {"shape": {**target_shape, **DRAFT_DRAFTER, "context": context, "dtype": str(dtype).removeprefix("torch."),
                      "device": str(device), "repeats": repeats},
            "variants": draft_report(times, {k: d.config for k, d in drafters.items()}, dtype.itemsize)}


# -----------------------------------------------------------------------------
# training step


def train_step(drafter, target, optimizer, ids, max_anchors, loss_chunk, generator):
    """One optimizer step as train.py takes it, loss_mask = all ones: the target's decoder
    with hidden states (its lm_head only inside the loss), anchors, the loss without
    metrics under bf16 autocast on CUDA, backward, AdamW. -> loss (tensor)."""
    from harness.target import target_features
    ones = torch.ones_like(ids)
    context, last = target_features(target, ids, ones, drafter.config.target_layer_ids)
    anchors, valid = dflash2.sample_anchors(ones, max_anchors, generator)
    batch = dflash2.Batch(ids, ones, ones, context, last, anchors.to(ids.device), valid.to(ids.device))
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss = dflash2.dflash2_loss(drafter, dflash2.target_view(drafter.config, target), batch,
                                    dflash2.LossConfig(chunk_size=loss_chunk))[0]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train_step_cost(target, drafters, batch_size, seq_len, max_anchors, loss_chunk=1024, repeats=5, warmup=1):
    """Median seconds of one train_step per drafter, rounds interleaved; each drafter has
    its own AdamW, whose state the warm-up round creates. -> {name: seconds}."""
    from train import make_optimizer
    dev = target.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size - 1, (batch_size, seq_len), generator=g).to(dev)
    fns = {}
    for name, d in drafters.items():
        opt = make_optimizer(d.parameters(), lr=1e-6)
        fns[name] = lambda d=d, opt=opt: train_step(d, target, opt, ids, max_anchors, loss_chunk, g)
    return median_seconds(fns, repeats, warmup, device=dev)


def product(dtype, device, m=1792, k=576, n=49152):
    """An (m, k) @ (k, n) product in `dtype` and its FLOPs (the default: the lm_head product of
    bench.real's loss, its largest); timed in the steps' own rounds it gives the product rate
    of their floors, under the same drift. It writes into one kept output: a fresh one's page
    faults would take more than half its time on a CPU, and vary from run to run. -> (fn, flops)."""
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return (lambda: torch.mm(a, b, out=out)), 2 * m * k * n


def product_flops(fn):
    """Matrix-product FLOPs (matmuls, attention, their backward) of one call of fn."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def train_part(device, repeats, quick):
    """One training step of train.py at bench.real's shape (SmolLM2-135M-Instruct's widths and
    vocabulary with random weights, batch 8 x 384 tokens, 32 anchors, B = 8, 2 draft layers,
    KL loss), for a float32 and a bf16 target (the drafter's step under bf16 autocast), with the
    target's features computed every step ("online") or read from TargetFeatures ("cached"),
    the bf16 rows only on a GPU or a CPU that multiplies bf16 in hardware; every case with the loss
    compiled as train.py runs it (train.compiled_loss), and float32 online with the eager formula too:
    the target part, the drafter's loss forward + backward, and the whole step with AdamW, rounds
    interleaved; each step's floor is its product FLOPs at this machine's product rate, timed in the same
    rounds."""
    import train
    from harness.target import TargetFeatures, native_bf16_cpu, uncached_features
    shape = dict(SMOLLM2_135M, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab=4096) if quick \
        else SMOLLM2_135M
    batch_size, seq_len, anchors = (2, 64, 8) if quick else (8, 384, 32)
    targets = {"float32": random_target(device=device, **shape)}
    if device.type == "cuda" or native_bf16_cpu():  # elsewhere bf16 is emulated, many times slower: auto never picks it
        targets["bfloat16"] = random_target(device=device, dtype=torch.bfloat16, **shape)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"] - 1, (batch_size, seq_len), generator=g).to(device)
    ones = torch.ones_like(ids)
    batch, rows, seeds = (ids, ones, ones), list(range(batch_size)), list(range(batch_size))
    c = sizing_config(targets["float32"].config, mask_token_id=shape["vocab"] - 1, num_layers=2, block_size=8)
    cases = {"float32 online, eager loss": ("float32", "online", False), "float32 online": ("float32", "online", True),
             "float32 cached": ("float32", "cached", True), "bfloat16 online": ("bfloat16", "online", True),
             "bfloat16 cached": ("bfloat16", "cached", True)}
    cases = {name: case for name, case in cases.items() if case[0] in targets}
    fns, flops = {}, {}
    for name, (dtype, mode, compiled) in cases.items():
        target = targets[dtype]
        torch.manual_seed(0)
        drafter = dflash2.DFlash2Drafter(c).to(device)
        optimizer = train.make_optimizer(drafter.parameters(), lr=1e-6)
        cfg, view = dflash2.LossConfig(chunk_size=train_loss_chunk(c.vocab_size)), dflash2.target_view(c, target)
        sums_fn = train.compiled_loss(device, print) if compiled else dflash2.slot_sums
        features = uncached_features(c.target_layer_ids)
        if mode == "cached":
            key = {"target_weights": [0.0], "target_layer_ids": c.target_layer_ids, "dtype": dtype}
            features = TargetFeatures(key, c.target_layer_ids)
            features.features(target, ids, ones, rows)  # filled once, as a run's first epoch does
        inputs = train.step_inputs(target, batch, anchors, seeds, features, rows)

        def target_part(target=target, features=features):
            return train.step_inputs(target, batch, anchors, seeds, features, rows)

        def loss_part(drafter=drafter, view=view, target=target, cfg=cfg, inputs=inputs, sums_fn=sums_fn):
            drafter.zero_grad(set_to_none=True)
            train.loss_step(drafter, view, target, inputs, cfg, sums_fn)[0].backward()

        def whole_step(drafter=drafter, view=view, target=target, cfg=cfg, features=features, optimizer=optimizer,
                       sums_fn=sums_fn):
            train.loss_step(drafter, view, target, target_part(target, features), cfg, sums_fn)[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        fns.update({(name, "target"): target_part, (name, "loss"): loss_part, (name, "step"): whole_step})
        # counted on the eager formula: under the counter's dispatch mode torch.compile would not compile the
        # loss (and the step would stay eager for good), and a compiled graph's products escape the count
        flops[name] = product_flops(lambda step=whole_step: step(sums_fn=dflash2.slot_sums))
    products = {dtype: product(getattr(torch, dtype), device, *((128, 64, 4096) if quick else ()))
                for dtype in targets}
    fns.update({("product", dtype): fn for dtype, (fn, _) in products.items()})
    seconds = {k: median(v) for k, v in round_seconds(fns, repeats, warmup=1, device=device).items()}
    rates = {dtype: flops / seconds[("product", dtype)] for dtype, (_, flops) in products.items()}
    profiled = {name: step_profile(fns[(name, "step")]) for name in PROFILED if name in cases}
    return {"shape": {**shape, "batch_size": batch_size, "seq_len": seq_len, "max_anchors": anchors, "num_layers": 2,
                      "block_size": 8, "device": str(device), "repeats": repeats},
            "cpu": cpu_model(), "product_tflops": {k: v / 1e12 for k, v in rates.items()},
            "cases": step_rows(cases, seconds, flops, rates), "profile": profiled}


PROFILED = ("bfloat16 cached", "float32 online")  # the steps whose time goes by part in the profile table
# torch.profiler's op names by part of a step; the compiled loss's kernels run inside "CompiledFxGraph" calls
STEP_PARTS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention"),
    "compiled loss kernels (slots x V)": ("CompiledFxGraph",),
    "top-K": ("aten::topk",),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::index", "aten::gather"),
    "optimizer": ("aten::_fused_adamw_", "Optimizer."),
}


def step_part(op_name):
    """The part of a step an op's self time counts in: the first STEP_PARTS entry with a prefix in its name, else
    "other ops (eager pointwise, reductions, fills)"."""
    for part, prefixes in STEP_PARTS.items():
        if any(prefix in op_name for prefix in prefixes):
            return part
    return "other ops (eager pointwise, reductions, fills)"


def step_profile(step):
    """One step under torch.profiler, after a warm-up step: its self CPU milliseconds by step_part, and the page
    faults it took (first touches of freshly mapped memory). -> {part: ms, ..., "page faults": n, "step ms": ms}."""
    import resource
    from torch.profiler import ProfilerActivity, profile
    step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    parts = {"step ms": 1e3 * (time.perf_counter() - t0),
             "page faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}
    for event in prof.key_averages():
        part = step_part(event.key)
        parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3
    return parts


def step_rows(cases, seconds, flops, rates):
    """Each case's row: its parts' seconds, its product FLOPs and its floor, those FLOPs at the product rate of its
    own dtype (cases: name -> (dtype, ...); seconds: (name, part) -> s; rates: dtype -> FLOP/s)."""
    eager = seconds[("float32 online, eager loss", "step")]
    rows = {}
    for name, (dtype, *_) in cases.items():
        s = {part: seconds[(name, part)] for part in ("target", "loss", "step")}
        floor = flops[name] / rates[dtype]
        rows[name] = {**{f"{part}_s": v for part, v in s.items()}, "product_tflop": flops[name] / 1e12,
                      "floor_s": floor, "speedup_vs_eager": eager / s["step"], "times_floor": s["step"] / floor}
    return rows


def cpu_model():
    """This CPU's model name and whether it multiplies bf16 in hardware, for the report."""
    from harness.target import native_bf16_cpu
    name = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return {"model": name, "native_bf16": native_bf16_cpu(), "threads": torch.get_num_threads()}


# -----------------------------------------------------------------------------
# memory table: peak memory of a training step, in a fresh process


def _status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _measure_child(specs):
    """In a fresh process: tiny warm-up runs of every spec's code path, then for each spec in turn build target
    and drafter and take two steps (the second has AdamW state); print as JSON, for each, the peak RSS above the
    RSS before it. The peak is the kernel's high-water mark, reset before each spec once the memory of the ones
    before is back with the system (not ru_maxrss: that one starts at the RSS of the parent the process was forked
    from, and never goes down)."""
    torch.set_num_threads(1)
    for spec in specs:  # lazy imports, kernel and thread-pool set-up are not a step's memory
        tiny = dict(spec["target"], hidden=32, intermediate=32, vocab=64, heads=2, kv_heads=1, head_dim=16)
        _run(dict(spec, target=tiny, seq_len=16, max_anchors=2, batch_size=1, loss_chunk=spec["loss_chunk"] and 4))
    peaks = []
    for spec in specs:
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # glibc: the freed heap goes back to the system, out of the RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _status("VmRSS")
        seconds = _run(spec)
        peaks.append({"peak": _status("VmHWM") - base, "seconds": seconds})
    print(json.dumps(peaks))


def _run(spec):
    from train import make_optimizer
    target = random_target(**spec["target"])
    drafter = dflash2.DFlash2Drafter(sizing_config(target.config, **spec["drafter"]))
    drafter.grad_checkpoint = spec["grad_checkpoint"]
    optimizer = make_optimizer(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["target"]["vocab"] - 1, (spec["batch_size"], spec["seq_len"]), generator=g)
    start = time.perf_counter()
    for _ in range(2):
        train_step(drafter, target, optimizer, ids, spec["max_anchors"], spec["loss_chunk"], g)
    return (time.perf_counter() - start) / 2


def peak_spec(target, drafter, seq_len, max_anchors, batch_size=1, loss_chunk=1024, grad_checkpoint=False):
    """A shape measure_peaks measures. target: random_target's arguments; drafter: DFlash2Config overrides."""
    return dict(target=target, drafter=drafter, seq_len=seq_len, max_anchors=max_anchors, batch_size=batch_size,
                loss_chunk=loss_chunk, grad_checkpoint=grad_checkpoint)


def measure_peaks(specs):
    """Peak CPU memory (bytes above the interpreter's own) of training steps at each peak_spec, one after the
    other in one subprocess with malloc returning every large block to the system on free, so peak RSS is peak
    allocation. -> [{"peak": bytes, "seconds": per step}], one per spec."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    code = f"import json; from bench import cost; cost._measure_child(json.loads({json.dumps(json.dumps(specs))}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"memory measurement failed ({specs}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_table(anchors=(64, 128, 256, 512), vocab=151936, hidden=64, seq_len=1024, block_size=4, loss_chunk=128):
    """Peak memory of one training step against max_anchors at a real vocabulary and a small
    width, chunked loss vs all slots at once, measured and planned (fp32 on the CPU).
    block_size 4 keeps the unchunked line inside a 23 GB machine at 512 anchors.
    -> {"shape", "rows": [{anchors, measured and planned MiB, chunked and unchunked}]}."""
    target = dict(hidden=hidden, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=2 * hidden, vocab=vocab)
    drafter = dict(num_layers=1, block_size=block_size, selector_rank=32, conv_group_size=16)
    cases = [(n, name, chunk) for n in anchors for name, chunk in (("chunked", loss_chunk), ("unchunked", None))]
    peaks = measure_peaks([peak_spec(target, drafter, seq_len, n, loss_chunk=chunk) for n, _, chunk in cases])
    rows = {n: {"anchors": n} for n in anchors}
    for (n, name, chunk), measured in zip(cases, peaks):
        plan = memory_plan(qwen3_config(**target), seq_len, n, loss_chunk=chunk, amp=False, target_bytes=4, **drafter)
        rows[n].update({f"{name}_mib": measured["peak"] / 2 ** 20, f"{name}_plan_mib": plan["peak"] / 2 ** 20})
    rows = list(rows.values())
    return {"shape": dict(vocab=vocab, hidden=hidden, seq_len=seq_len, block_size=block_size, loss_chunk=loss_chunk),
            "rows": rows}


def plot_memory_table(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, s = table["rows"], table["shape"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    anchors = [r["anchors"] for r in rows]
    for name, style in (("unchunked", "o-"), ("chunked", "s-")):
        ax.plot(anchors, [r[f"{name}_mib"] for r in rows], style, label=f"{name} loss, measured")
        ax.plot(anchors, [r[f"{name}_plan_mib"] for r in rows], ":", color=ax.lines[-1].get_color(),
                label=f"{name} loss, plan")
    ax.set(xlabel="max anchors N", ylabel="peak memory of a step (MiB)", xticks=anchors,
           title=f"V={s['vocab']}, H={s['hidden']}, S={s['seq_len']}, B={s['block_size']}, chunk {s['loss_chunk']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------
# report


def markdown(results):
    lines = []
    if "draft" in results:
        d = results["draft"]
        lines += [f"Draft step at {d['shape']}: median ms; × DFlash: median of the per-round ratios [95% bootstrap "
                  "over rounds]; floor = weight bytes read, × DFlash's", "",
                  "| variant | ms | × DFlash | weights read (MB) | floor × DFlash |", "|---|---|---|---|---|"]
        for k, v in d["variants"].items():
            reads = f"{v['weight_bytes'] / 1e6:.0f} | {v['floor_ratio_vs_dflash']:.3f}" if "weight_bytes" in v \
                else "- | -"
            ratio = "{:.3f} [{:.3f}, {:.3f}]".format(*v["ratio_vs_dflash"])
            lines.append(f"| {k} | {v['ms']:.2f} | {ratio} | {reads} |")
        lines.append("")
    if "train" in results:
        t = results["train"]
        cpu = t["cpu"]
        lines += [f"Training step at bench.real's shape {t['shape']} on {cpu['model']} ({cpu['threads']} threads, bf16 "
                  f"products in hardware: {'yes' if cpu['native_bf16'] else 'no'}); medians of {t['shape']['repeats']} "
                  "rounds. Floor: the step's matrix-product FLOPs at this machine's product rate in the same "
                  "rounds (" + ", ".join(f"{k} {v:.3f}" for k, v in t["product_tflops"].items()) + " TFLOP/s)",
                  "", "| step | target features s | drafter loss fwd+bwd s | whole step s | × the float32 online "
                  "step with the eager loss | products TFLOP | floor s | × floor |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {k} | {v['target_s']:.2f} | {v['loss_s']:.2f} | {v['step_s']:.2f} | {v['speedup_vs_eager']:.2f} | "
                  f"{v['product_tflop']:.3f} | {v['floor_s']:.2f} | {v['times_floor']:.1f} |" for k, v in t["cases"].items()]
        if t.get("profile"):
            names = list(t["profile"])
            parts = [*STEP_PARTS, step_part(""), "page faults", "step ms"]
            lines += ["", "One step under torch.profiler, self CPU ms by part (the profiler's own cost included), and the "
                      "page faults it took (a count)", "",
                      "| part | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
            lines += [f"| {part} | " + " | ".join(f"{t['profile'][n].get(part, 0):.0f}" for n in names) + " |"
                      for part in parts]
        lines.append("")
    if "memory" in results:
        m = results["memory"]
        lines += [f"Peak memory of a training step at {m['shape']}, measured (planned), MiB", "",
                  "| anchors | chunked loss | unchunked loss |", "|---|---|---|"]
        lines += [f"| {r['anchors']} | {r['chunked_mib']:.0f} ({r['chunked_plan_mib']:.0f}) | "
                  f"{r['unchunked_mib']:.0f} ({r['unchunked_plan_mib']:.0f}) |" for r in m["rows"]]
        lines.append("")
    return "\n".join(lines)


PARTS = ("draft", "train", "memory")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS),
                   help=f"comma-separated subset of: {', '.join(PARTS)}")
    p.add_argument("--out", dest="out_dir", default="bench_out", help="where cost.json, cost.md and memory.png go")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the draft and training steps (the memory table is the CPU's)")
    p.add_argument("--draft-dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=["float32", "bfloat16", "float16"], help="weights of the draft step")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds of the draft and training steps (medians)")
    p.add_argument("--train-repeats", type=int, default=3, help="timed rounds of the training steps (medians)")
    p.add_argument("--context", type=int, default=1024, help="context tokens already in the drafter's cache")
    p.add_argument("--quick", action="store_true", help="small shapes, 64 tokens of context, one round: a smoke run")
    return p.parse_args(argv)


def check_args(args):
    """Bad flags fail here, before any work."""
    unknown = set(args.parts) - set(PARTS)
    if unknown or not args.parts:
        raise ValueError(f"--parts: unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    for flag in ("repeats", "train_repeats", "context"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} ({getattr(args, flag)}) must be >= 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device here")


def main(args):
    check_args(args)
    use_huge_pages()  # before the first large tensor
    os.makedirs(args.out_dir, exist_ok=True)
    repeats, results, t0 = 1 if args.quick else args.repeats, {}, time.time()
    if "draft" in args.parts:
        results["draft"] = draft_part(torch.device(args.device), getattr(torch, args.draft_dtype),
                                      min(args.context, 64) if args.quick else args.context, repeats, args.quick)
    if "train" in args.parts:
        results["train"] = train_part(torch.device(args.device), 1 if args.quick else args.train_repeats, args.quick)
    if "memory" in args.parts:
        results["memory"] = memory_table(anchors=(8, 16), vocab=4096, seq_len=64, loss_chunk=8) if args.quick \
            else memory_table()
        plot_memory_table(results["memory"], os.path.join(args.out_dir, "memory.png"))
    results["wall_seconds"] = time.time() - t0
    write_results(args.out_dir, "cost", results, markdown(results))
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags: one line, before any work
        raise SystemExit(f"bench.cost: {e}") from None
