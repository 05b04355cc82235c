"""
Memory of DFlash2 training on one GPU: a plan read off the target's config before any
weight is loaded, the measurements that check it, and a GPU check at real scale.

    python memory.py --target Qwen/Qwen3-4B --seq-len 3072 --max-anchors 512 --block-size 16
    python memory.py --gpu-check                        # one H200, under 8 minutes

Peak per GPU at batch b = fixed + b · per sequence + max(loss chunk, b · one layer), where
  fixed        = target weights + the drafter's weights, grads and AdamW state (fp32
                 master weights: 4 + 4 + 8 bytes a parameter);
  per sequence = the target's hidden states (all L + 1 are returned and live through the
                 loss) + the activations the drafter saves for backward over N·B block
                 tokens and S context tokens, every layer's (or, with grad checkpointing,
                 only each layer's input);
  loss chunk   = the (chunk, V) fp32 tensors of one chunk of slots, recomputed in backward;
  one layer    = with grad checkpointing, the layer being recomputed in backward (after the
                 loss chunks are done, so the two do not add up); 0 otherwise.
The activation counts follow the tensors autograd saves in dflash2.py's drafter (fp32
residual stream and norms, linear inputs in bf16 under autocast, both sides of the
convolution, keys and values repeated for GQA before attention); memory_table and
test_memory.py check the plan against measured peaks.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

import dflash2

GiB = 2 ** 30
# AdamW with fp32 master weights: weight 4 + grad 4 + exp_avg 4 + exp_avg_sq 4 bytes
DRAFTER_BYTES_PER_PARAM = 16
# live (n, V) fp32 tensors at the peak of one chunk's recomputed backward (logits of the
# drafter and of the target, log q, p, p·log q, gradients); 7 fits the measured peaks
LOSS_TENSORS_PER_SLOT = 7


# -----------------------------------------------------------------------------
# the plan


def read_target_config(path):
    """The target's transformers config (config.json of a folder, or a hub id already in
    the local cache); no weights are read."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # missing folder, malformed JSON, unknown model type, not cached
        raise ValueError(f"cannot read the target's config at {path!r}: {e}") from e


def drafter_config(target_config, **overrides):
    """The drafter a run would build on this target (mask token 0: it changes no size)."""
    return dflash2.DFlash2Config.from_target(target_config, **{"mask_token_id": 0, **overrides})


def parameter_counts(target_config, c):
    """(target, drafter) parameters, built on the meta device: shapes only, no memory."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(target_config)
        drafter = dflash2.DFlash2Drafter(c)
    count = lambda m: sum(p.numel() for p in m.parameters())  # tied embeddings counted once
    return count(target), count(drafter)


def layer_bytes(c, amp):
    """Bytes one draft layer saves for backward, per block token, per key token and per
    context token. amp: linears in bf16 under autocast, each call saving its own bf16
    copy of an fp32 input; otherwise everything fp32 (CPU)."""
    H, I, Q, KV, Kc = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.conv_kernel_size
    a = 2 if amp else 4                   # bytes of a linear's output
    cast = 2 if amp else 0                # an extra bf16 copy of an fp32 linear input
    norm = 8 * H + (0 if amp else 4 * H)  # fp32 residual + normalised x (+ the fp32 output a linear keeps)
    conv_in = cast * H + 8 * H * Kc       # kernel projection input; per tap the shifted input and coefficient
    conv_out = (4 + a) * H * Kc
    heads = lambda n: (14 if amp else 16) * n  # q/k_norm in fp32 and RoPE's two rotated copies
    attn = 3 * cast * H + (4 if amp else 0) * H + heads(Q) + heads(KV) + 3 * a * Q  # + sdpa q, out, o_proj in
    mlp = 2 * cast * H + (0 if amp else 4 * H) + 4 * a * I
    if not Kc:
        conv_in = conv_out = 0
    block = 2 * norm + 2 * conv_in + 2 * conv_out + attn + mlp
    key = 2 * a * Q                       # keys and values after the GQA repeat
    ctx = 2 * cast * H + heads(KV)        # k_proj / v_proj inputs and the context keys
    return block, key, ctx


def memory_plan(target_config, seq_len, max_anchors, batch_size=1, loss_chunk=1024, grad_checkpoint=False,
                gpu_memory_gib=80.0, amp=True, target_bytes=2, **drafter_overrides):
    """Estimated peak bytes of one training step per GPU, split into parts; loss_chunk None
    is the unchunked loss. -> dict of bytes (ints) plus max_batch_size (0 if not even one
    sequence fits gpu_memory_gib) and the shape it assumed."""
    if loss_chunk is not None and loss_chunk < 1:
        raise ValueError(f"loss_chunk ({loss_chunk}) must be >= 1 (or None for the unchunked loss)")
    for name, value in (("seq_len", seq_len), ("max_anchors", max_anchors), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")
    c = drafter_config(target_config, **drafter_overrides)
    n_target, n_drafter = parameter_counts(target_config, c)
    S, B, H, V = seq_len, c.block_size, c.hidden_size, c.vocab_size
    N = min(max_anchors, S - 1)
    T, nf = N * B, len(c.target_layer_ids)
    block, key, ctx = layer_bytes(c, amp)
    layer = T * block + (S + T) * key + S * ctx
    common = (S * nf * H * (4 + (2 if amp else 0))         # features in fp32, the fc input (bf16 copy)
              + S * H * 16 + T * H * 16                    # hidden_norm / final norm internals
              + T * (S + T) * (3 if amp else 5))           # block mask (bool) and the additive mask sdpa makes
    # checkpointed layers keep only their inputs; in backward one layer at a time is
    # recomputed, after the loss chunks are done, so the two peaks do not add up
    stored = c.num_layers * (T * H * 4 if grad_checkpoint else layer) + common
    recompute = layer if grad_checkpoint else 0
    loss_at = lambda b: min(loss_chunk or b * N * (B - 1), b * N * (B - 1)) * V * 4 * LOSS_TENSORS_PER_SLOT
    plan = {
        "target_weights": n_target * target_bytes,
        "drafter_states": n_drafter * DRAFTER_BYTES_PER_PARAM,
        "loss_chunk": loss_at(batch_size),
        "hidden_states_per_seq": (target_config.num_hidden_layers + 1) * S * H * target_bytes,
        "activations_per_seq": stored,
        "recompute_per_seq": recompute,
    }
    peak_at = lambda b: (plan["target_weights"] + plan["drafter_states"] + b * (plan["hidden_states_per_seq"] + stored)
                         + max(loss_at(b), b * recompute))
    fits = 0
    while fits < 4096 and peak_at(fits + 1) <= gpu_memory_gib * GiB:
        fits += 1
    plan.update(peak=peak_at(batch_size), max_batch_size=fits, target_params=n_target, drafter_params=n_drafter,
                shape=dict(seq_len=S, anchors=N, block_size=B, batch_size=batch_size, loss_chunk=loss_chunk,
                           grad_checkpoint=grad_checkpoint, draft_layers=c.num_layers, gpu_memory_gib=gpu_memory_gib))
    return plan


def format_plan(plan):
    """The plan as the lines --plan prints."""
    s = plan["shape"]
    gib = lambda x: f"{x / GiB:7.2f} GiB"
    lines = [f"memory plan: seq {s['seq_len']}, {s['anchors']} anchors, B={s['block_size']}, batch "
             f"{s['batch_size']}, loss chunk {s['loss_chunk']} slots, grad checkpoint "
             f"{'on' if s['grad_checkpoint'] else 'off'}, {s['draft_layers']} draft layers",
             f"  target weights              {gib(plan['target_weights'])}  ({plan['target_params'] / 1e9:.2f}B params)",
             f"  drafter weights+grads+AdamW {gib(plan['drafter_states'])}  ({plan['drafter_params'] / 1e6:.0f}M params, fp32)",
             f"  loss chunk                  {gib(plan['loss_chunk'])}",
             f"  per sequence: hidden states {gib(plan['hidden_states_per_seq'])}",
             f"  per sequence: activations   {gib(plan['activations_per_seq'])}",
             f"  one layer recomputed        {gib(plan['recompute_per_seq'])}  (per sequence, grad checkpoint)",
             f"  estimated peak              {gib(plan['peak'])}",
             f"  largest batch in {s['gpu_memory_gib']:g} GiB:  {plan['max_batch_size']}"]
    return "\n".join(lines if s["grad_checkpoint"] else [l for l in lines if "recomputed" not in l])


def check_fits(plan):
    """Refuse, before any weight is loaded, a batch the plan says does not fit."""
    s = plan["shape"]
    if plan["peak"] > s["gpu_memory_gib"] * GiB:
        hint = (f"--batch-size {plan['max_batch_size']} fits" if plan["max_batch_size"] else
                "not even one sequence fits: try --grad-checkpoint, a smaller --loss-chunk, --max-anchors or --seq-len")
        raise ValueError(f"batch size {s['batch_size']} needs about {plan['peak'] / GiB:.1f} GiB per GPU, more than "
                         f"--gpu-memory-gib {s['gpu_memory_gib']:g}; {hint}")


# -----------------------------------------------------------------------------
# measurements: one training step, its peak memory in a fresh process


def qwen3_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tie=False):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                       max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=tie)


# Qwen3-4B's shape (its embeddings are tied), for the real-scale GPU check
QWEN3_4B = dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tie=True)


def random_target(seed=0, dtype=torch.float32, device="cpu", **shape):
    """A Qwen3 target of qwen3_config's shape with random weights (nothing downloaded),
    initialised directly on the device in the given dtype."""
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(qwen3_config(**shape)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def train_step(drafter, target, optimizer, ids, max_anchors, loss_chunk, generator):
    """One optimizer step as train.py takes it, loss_mask = all ones: the target's decoder
    with hidden states (its lm_head only inside the loss), anchors, the loss without
    metrics, backward, AdamW. -> loss (tensor)."""
    ones = torch.ones_like(ids)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, attention_mask=ones, output_hidden_states=True).hidden_states
    anchors, valid = dflash2.sample_anchors(ones, max_anchors, generator)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss, _ = dflash2.dflash2_loss(drafter, target, ids, ones, ones, hidden, anchors.to(ids.device),
                                       valid.to(ids.device), chunk_size=loss_chunk, with_metrics=False)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _measure_child(spec):
    """In a fresh process: build target and drafter, take two steps (the second has AdamW
    state), print as JSON the peak RSS above the RSS left after a tiny warm-up run. The
    peak is the kernel's high-water mark, reset after the warm-up (not ru_maxrss: that one
    starts at the RSS of the parent the process was forked from)."""
    torch.set_num_threads(1)
    tiny = dict(spec["target"], hidden=32, intermediate=32, vocab=64, heads=2, kv_heads=1, head_dim=16)
    warm = dict(spec, target=tiny, seq_len=16, max_anchors=2, batch_size=1, loss_chunk=spec["loss_chunk"] and 4)
    _run(warm)  # lazy imports, kernel and thread-pool set-up are not the step's memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _status("VmRSS")
    seconds = _run(spec)
    print(json.dumps({"peak": _status("VmHWM") - base, "seconds": seconds}))


def _run(spec):
    target = random_target(**spec["target"])
    drafter = dflash2.DFlash2Drafter(drafter_config(target.config, **spec["drafter"]))
    drafter.grad_checkpoint = spec["grad_checkpoint"]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["target"]["vocab"] - 1, (spec["batch_size"], spec["seq_len"]), generator=g)
    start = time.perf_counter()
    for _ in range(2):
        train_step(drafter, target, optimizer, ids, spec["max_anchors"], spec["loss_chunk"], g)
    return (time.perf_counter() - start) / 2


def measure_peak(target, drafter, seq_len, max_anchors, batch_size=1, loss_chunk=1024, grad_checkpoint=False):
    """Peak CPU memory (bytes above the interpreter's own) of training steps at this shape,
    in a subprocess with malloc returning every large block to the system on free, so peak
    RSS is peak allocation. target: random_target's arguments; drafter: DFlash2Config
    overrides. -> {"peak": bytes, "seconds": per step}."""
    spec = dict(target=target, drafter=drafter, seq_len=seq_len, max_anchors=max_anchors, batch_size=batch_size,
                loss_chunk=loss_chunk, grad_checkpoint=grad_checkpoint)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    code = f"import json, memory; memory._measure_child(json.loads({json.dumps(json.dumps(spec))}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"memory measurement failed ({spec}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_table(anchors=(64, 128, 256, 512), vocab=151936, hidden=64, seq_len=1024, block_size=4, loss_chunk=128,
                 plot=None):
    """Peak memory of one training step against max_anchors at a real vocabulary and a small
    width, chunked loss vs all slots at once, measured and planned. block_size 4 keeps the
    unchunked line inside a 23 GB machine at 512 anchors. plot: a PNG path (matplotlib).
    -> list of rows {anchors, measured/planned MiB for chunked and unchunked}."""
    target = dict(hidden=hidden, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=2 * hidden, vocab=vocab)
    drafter = dict(num_layers=1, block_size=block_size, selector_rank=32, conv_group_size=16)
    rows = []
    for n in anchors:
        row = {"anchors": n}
        for name, chunk in (("chunked", loss_chunk), ("unchunked", None)):
            row[f"{name}_mib"] = measure_peak(target, drafter, seq_len, n, loss_chunk=chunk)["peak"] / 2 ** 20
            plan = memory_plan(qwen3_config(**target), seq_len, n, loss_chunk=chunk, amp=False, target_bytes=4,
                               **drafter)
            row[f"{name}_plan_mib"] = plan["peak"] / 2 ** 20
        rows.append(row)
    if plot:
        plot_memory_table(rows, plot, f"V={vocab}, H={hidden}, S={seq_len}, B={block_size}, chunk {loss_chunk}")
    return rows


def plot_memory_table(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    anchors = [r["anchors"] for r in rows]
    for name, style in (("unchunked", "o-"), ("chunked", "s-")):
        ax.plot(anchors, [r[f"{name}_mib"] for r in rows], style, label=f"{name} loss, measured")
        ax.plot(anchors, [r[f"{name}_plan_mib"] for r in rows], ":", color=ax.lines[-1].get_color(),
                label=f"{name} loss, plan")
    ax.set(xlabel="max anchors N", ylabel="peak memory of a step (MiB)", xticks=anchors, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def median_seconds(fns, repeats, warmup=1, device="cpu"):
    """Median seconds per call of each fn, rounds interleaved so drift hits all alike."""
    times = {k: [] for k in fns}
    for r in range(warmup + repeats):
        for k, fn in fns.items():
            t0 = dflash2._now(torch.device(device))
            fn()
            if r >= warmup:
                times[k].append(dflash2._now(torch.device(device)) - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def dflash_pair(target_config, dtype=torch.float32, device="cpu", **overrides):
    """DFlash (both parts off) and DFlash2 drafters sharing one backbone's weights, the
    DFlash2 parts moved off their identity init so they do real work."""
    torch.manual_seed(0)
    with torch.device(device):
        v2 = dflash2.DFlash2Drafter(drafter_config(target_config, **overrides)).to(dtype)
        v1 = dflash2.DFlash2Drafter(drafter_config(target_config, **{**overrides, "conv_kernel_size": 0,
                                                                      "selector_top_k": 0})).to(dtype)
    with torch.no_grad():
        for p in v2.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    v1.load_state_dict({k: v for k, v in v2.state_dict().items() if k in v1.state_dict()})
    return {"DFlash": v1, "DFlash2": v2}


def step_cost(target, drafters, batch_size, seq_len, max_anchors, loss_chunk=1024, repeats=5):
    """Seconds of one training step (train_step: target forward, loss without metrics,
    backward, AdamW) per drafter, interleaved medians. -> ({name: seconds}, tokens/step)."""
    dev = target.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size - 1, (batch_size, seq_len), generator=g).to(dev)
    fns = {}
    for name, d in drafters.items():
        opt = torch.optim.AdamW(d.parameters(), lr=1e-6)
        fns[name] = lambda d=d, opt=opt: train_step(d, target, opt, ids, max_anchors, loss_chunk, g)
    return median_seconds(fns, repeats, device=dev), batch_size * seq_len


def draft_step_cost(target, drafters, context=1024, repeats=50):
    """Seconds of one inference draft step per drafter (block of B against a cached context
    of `context` tokens: forward, lm_head, propose), interleaved medians."""
    dev = target.device
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    fns = {}
    for name, d in drafters.items():
        c, dtype = d.config, d.fc.weight.dtype
        cache = dflash2.DraftCache(c.num_layers)
        feats = torch.randn(1, context, len(c.target_layer_ids) * c.hidden_size, device=dev, dtype=dtype)
        with torch.no_grad():
            d(embed(torch.zeros(1, 1, dtype=torch.long, device=dev)).to(dtype), torch.zeros(1, 1, device=dev,
              dtype=torch.long), feats, torch.arange(context, device=dev)[None], cache=cache)
        block = torch.full((1, c.block_size), c.mask_token_id, device=dev)
        pos = torch.arange(context, context + c.block_size, device=dev)[None]
        no_ctx, no_pos = feats[:, :0], pos[:, :0]

        @torch.no_grad()
        def draft(d=d, cache=cache, dtype=dtype):
            h = d(embed(block).to(dtype), pos, no_ctx, no_pos, cache=cache)[:, 1:]
            return d.propose(h, lm_head(h.to(lm_head.weight.dtype)).float(), block[:, 0])
        fns[name] = draft
    return median_seconds(fns, repeats, warmup=3, device=dev)


# -----------------------------------------------------------------------------
# the GPU check: python memory.py --gpu-check (one H200, under 8 minutes). Each part takes
# a device, so the tests run them on the CPU at small shapes.

TINY = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024)


def check_loss_autocast(device, dtype=torch.bfloat16):
    """The loss under autocast against fp32 with the same weights: within bf16 rounding,
    chunked = unchunked under autocast too, edge scores still fp32, gradients finite."""
    target = random_target(device=device, **TINY)
    c = drafter_config(target.config, num_layers=2, block_size=8, selector_rank=16, mask_token_id=TINY["vocab"] - 1)
    torch.manual_seed(0)
    drafter = dflash2.DFlash2Drafter(c).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab"] - 1, (2, 128), generator=g).to(device)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    anchors, valid = (x.to(device) for x in dflash2.sample_anchors(ones, 16, g))

    def run(amp, chunk):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=amp):
            loss, _ = dflash2.dflash2_loss(drafter, target, ids, ones, ones, hidden, anchors, valid, chunk_size=chunk,
                                           with_metrics=False)
            h = torch.randn(3, c.hidden_size, device=device)
            cand = torch.randint(0, c.vocab_size, (3, 4), device=device)
            scores = drafter.candidate_selector.edge_scores(h, torch.randn(3, c.vocab_size, device=device),
                                                            cand[:, 0], cand)
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
        return loss.item(), scores.dtype, finite
    (fp32, _, finite32), (amp, score_dtype, finite_amp), (amp_chunked, _, _) = run(False, None), run(True, None), \
        run(True, 37)
    out = {"loss_fp32": fp32, "loss_autocast": amp, "rel_diff": abs(amp - fp32) / abs(fp32),
           "chunk_rel_diff": abs(amp_chunked - amp) / abs(amp), "edge_scores_dtype": str(score_dtype),
           "grads_finite": finite32 and finite_amp}
    out["ok"] = out["rel_diff"] < 0.05 and out["chunk_rel_diff"] < 1e-2 and score_dtype == torch.float32 \
        and out["grads_finite"]
    return out


def check_spec_generate(device, prompts=3, max_new_tokens=48):
    """spec_generate at T = 0 on the device equals the target's own greedy decoding."""
    target = random_target(device=device, **TINY)
    torch.manual_seed(0)
    drafter = dflash2.DFlash2Drafter(drafter_config(target.config, num_layers=2, block_size=8, selector_rank=16,
                                                    mask_token_id=TINY["vocab"] - 1)).to(device)
    g = torch.Generator().manual_seed(1)
    equal, als = [], []
    for _ in range(prompts):
        prompt = torch.randint(0, TINY["vocab"] - 1, (1, 12), generator=g).to(device)
        spec, stats = dflash2.spec_generate(drafter, target, prompt, max_new_tokens)
        plain, _ = dflash2.target_generate(target, prompt, max_new_tokens)
        equal.append(torch.equal(spec, plain))
        als.append(stats.mean_acceptance_length)
    return {"greedy_equal": equal, "mean_al": sum(als) / len(als), "ok": all(equal)}


def real_scale_step(device, shape=QWEN3_4B, seq_len=3072, max_anchors=512, block_size=16, num_layers=5,
                    batch_size=1, loss_chunk=1024, steps=3, log=print):
    """Training steps at a real target's shape with random weights (bf16 target, fp32
    drafter under autocast on CUDA): peak memory with and without grad checkpointing
    against the plan (CUDA only), step time and tokens/s of DFlash vs DFlash2, and the
    draft-step latency of both in bf16."""
    dev, cuda = torch.device(device), torch.device(device).type == "cuda"
    tdtype = torch.bfloat16 if cuda else torch.float32
    overrides = dict(num_layers=num_layers, block_size=block_size, mask_token_id=shape["vocab"] - 1)
    out = {"shape": dict(shape, seq_len=seq_len, max_anchors=max_anchors, block_size=block_size,
                         draft_layers=num_layers, batch_size=batch_size, loss_chunk=loss_chunk)}
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    target = random_target(dtype=tdtype, device=dev, **shape)
    with torch.device(dev):
        drafter = dflash2.DFlash2Drafter(drafter_config(target.config, **overrides))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"] - 1, (batch_size, seq_len), generator=g).to(dev)
    for checkpointed in (False, True):
        drafter.grad_checkpoint = checkpointed
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(2):  # the second step holds the AdamW state
            train_step(drafter, target, optimizer, ids, max_anchors, loss_chunk, g)
        plan = memory_plan(target.config, seq_len, max_anchors, batch_size, loss_chunk, checkpointed, amp=cuda,
                           target_bytes=2 if cuda else 4, **overrides)
        key = "grad_checkpoint" if checkpointed else "plain"
        out[key] = {"plan_gib": plan["peak"] / GiB,
                    "measured_gib": torch.cuda.max_memory_allocated(dev) / GiB if cuda else None}
        log(f"peak memory, {key}: {out[key]}")
    del drafter, optimizer
    drafters = dflash_pair(target.config, device=dev, **overrides)
    seconds, tokens = step_cost(target, drafters, batch_size, seq_len, max_anchors, loss_chunk, repeats=steps)
    out["train_step_s"] = seconds
    out["tokens_per_s"] = {k: tokens / v for k, v in seconds.items()}
    out["train_ratio_dflash2_vs_dflash"] = seconds["DFlash2"] / seconds["DFlash"]
    log(f"training step: {seconds} s, ratio {out['train_ratio_dflash2_vs_dflash']:.3f}")
    del drafters
    drafters = dflash_pair(target.config, dtype=tdtype, device=dev, **overrides)
    draft = draft_step_cost(target, drafters)
    out["draft_step_ms"] = {k: 1e3 * v for k, v in draft.items()}
    out["draft_ratio_dflash2_vs_dflash"] = draft["DFlash2"] / draft["DFlash"]
    log(f"draft step: {out['draft_step_ms']} ms, ratio {out['draft_ratio_dflash2_vs_dflash']:.3f}")
    return out


def gpu_check(device="cuda", log=print):
    """Everything above on one GPU; -> dict (also what --gpu-check prints as JSON)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--gpu-check needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # the greedy comparison wants fp32 matmuls
    start, out = time.time(), {"device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda"
                               else "cpu"}
    out["loss_autocast"] = check_loss_autocast(device)
    log(f"loss under bf16 autocast: {out['loss_autocast']}")
    out["spec_generate"] = check_spec_generate(device)
    log(f"spec_generate greedy: {out['spec_generate']}")
    out["real_scale"] = real_scale_step(device, log=log)
    out["seconds"] = time.time() - start
    return out


# -----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target folder or cached hub id: print its memory plan")
    p.add_argument("--seq-len", type=int, default=3072, help="tokens per sequence")
    p.add_argument("--max-anchors", type=int, default=512, help="blocks per sequence")
    p.add_argument("--block-size", type=int, default=16, help="B")
    p.add_argument("--num-layers", type=int, default=5, help="draft layers")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per GPU")
    p.add_argument("--loss-chunk", type=int, default=1024, help="slots per loss chunk (0: unchunked)")
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute draft layers in backward")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory budget per GPU")
    p.add_argument("--table", metavar="PNG", help="measure memory_table on this CPU and plot it here")
    p.add_argument("--gpu-check", action="store_true", help="run the GPU check (one CUDA device)")
    args = p.parse_args(argv)
    if args.target:
        plan = memory_plan(read_target_config(args.target), args.seq_len, args.max_anchors, args.batch_size,
                           args.loss_chunk or None, args.grad_checkpoint, args.gpu_memory_gib,
                           block_size=args.block_size, num_layers=args.num_layers)
        print(format_plan(plan))
    if args.table:
        for row in memory_table(plot=args.table):
            print(json.dumps({k: round(v, 1) for k, v in row.items()}))
    if args.gpu_check:
        print(json.dumps(gpu_check(), indent=1))


if __name__ == "__main__":
    main()
