"""
The memory of DFlash2 training: its plan on one GPU, read off the target's config before any
weight is loaded, and on a CPU the allocator's page size (use_huge_pages, which train.py's
start_ranks and the benches call before their first large tensor):

    python -m harness.memory --target Qwen/Qwen3-4B --seq-len 3072 --max-anchors 512 --block-size 16 --batch-size 2

prints it for train.py's step and drafter flags (the same names, types and defaults as train.py's)
and --gpu-memory-gib (80). On a GPU, train.py plans for the device's total memory
(torch.cuda.get_device_properties(device).total_memory) before the target loads: it recomputes
each draft layer in backward when the batch fits only so, and refuses one that does not fit
(fitting_plan). Not here: the drafter's shape (harness/target.py's drafter_config), the loss's
chunking (dflash2.loss_sums; train_loss_chunk is its size here).

Peak per GPU at batch b = fixed + b · per sequence + max(loss chunk, b · one layer), where
  fixed        = target weights + the drafter's weights, grads and AdamW state (fp32
                 master weights: 4 + 4 + 8 bytes a parameter);
  per sequence = the target's hidden states (all L + 1 are returned and live through the
                 loss) + the activations the drafter saves for backward over N·B block
                 tokens and S context tokens, every layer's (or, with grad checkpointing,
                 only each layer's input);
  loss chunk   = the (chunk, V) fp32 tensors of one chunk of slots (LOSS_CHUNK_LOGITS / V slots);
  one layer    = with grad checkpointing, the layer being recomputed in backward (after the
                 loss chunks are done, so the two do not add up); 0 otherwise.
The activation counts follow the tensors autograd saves in dflash2.py's drafter (fp32
residual stream and norms, linear inputs in bf16 under autocast, both sides of the
convolution, keys and values repeated for GQA before attention). The plan is checked
against measured peaks on the CPU only: tests/test_memory.py holds it to the peak RSS of
training steps in a fresh process (scaled-down shapes, within 20%), and `python -m bench.cost
--parts memory` prints the same comparison at a real vocabulary. On a GPU nothing has checked
it yet: `python -m bench.gpu_check` compares it with CUDA's measured peak, but has not been
run on a GPU.
"""
import argparse
import os

import torch

import dflash2
from harness.data import at_least
from harness.target import add_drafter_flags, drafter_config, drafter_fields, load_config, model_class, rope_tables

GiB = 2 ** 30
# AdamW with fp32 master weights: weight 4 + grad 4 + exp_avg 4 + exp_avg_sq 4 bytes
DRAFTER_BYTES_PER_PARAM = 16
# live (n, V) fp32 tensors at the peak of one chunk's recomputed backward of the eager formula
# (dflash2.slot_sums): the logits of the drafter and of the target, log q, p, and log_softmax's
# gradient with its input's; 6 fits the measured peaks. The compiled loss train.py runs where a
# compiler exists fuses some of them away, so there the plan is an upper bound
LOSS_TENSORS_PER_SLOT = 6
# train.py's loss holds at most this many slot × vocabulary logits at once: 1,024 slots of Qwen3's 151,936-token
# vocabulary, 3.7 GB at 6 fp32 tensors a slot. A step with more slots takes them a chunk at a time, each recomputed
# in backward (the same loss and gradients); a step whose slots all fit recomputes nothing, which on a CPU at
# SmolLM2's 49,152 tokens takes a quarter to a third off the cached step (bench/RESULTS.md, the training step)
LOSS_CHUNK_LOGITS = 1024 * 151_936


def train_loss_chunk(vocab_size):
    """train.py's loss chunk at this vocabulary: the slots whose (n, V) tensors live at once."""
    return max(1, LOSS_CHUNK_LOGITS // vocab_size)


def use_huge_pages():
    """Have torch's CPU allocator back each tensor of 2 MiB or more with transparent huge pages (its
    THP_MEM_ALLOC_ENABLE, read at its first such allocation: call this before; a value already set is kept). A
    training step allocates its slots × vocabulary tensors afresh each step, and in 4 KiB pages the first touch of
    each page faults: at bench.real's shape about 360,000 faults a step, under 10,000 in 2 MiB pages (bench/RESULTS.md,
    the training step). Freed tensors still go back to the system, so memory stays what the step holds."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def sizing_config(target_config, **fields):
    """The DFlash2Config a run would build on this target, to size it (mask token 0: it changes no size)."""
    return drafter_config(target_config, **{"mask_token_id": 0, **fields})


def parameter_counts(target_config, c):
    """(target, drafter) parameters, built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        model = model_class(target_config).from_config(target_config)
        drafter = dflash2.DFlash2Drafter(c, rope=rope_tables(c))
    count = lambda m: sum(p.numel() for p in m.parameters())  # tied embeddings counted once
    return count(model), count(drafter)


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


def memory_plan(target_config, seq_len, max_anchors, batch_size=1, loss_chunk="train", grad_checkpoint=False,
                gpu_memory_gib=80.0, amp=True, target_bytes=2, **fields):
    """Estimated peak bytes of one training step per GPU, split into parts; loss_chunk: slots,
    "train" for train.py's (train_loss_chunk(V)) or None for the unchunked loss. -> dict of bytes
    (ints) plus max_batch_size (0 if not even one sequence fits gpu_memory_gib) and the shape
    it assumed; fields: the drafter's DFlash2Config fields (the rest from the target)."""
    if loss_chunk not in ("train", None) and loss_chunk < 1:
        raise ValueError(f"loss_chunk ({loss_chunk}) must be >= 1 (or None for the unchunked loss)")
    for name, value in (("seq_len", seq_len), ("max_anchors", max_anchors), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")
    c = sizing_config(target_config, **fields)
    loss_chunk = train_loss_chunk(c.vocab_size) if loss_chunk == "train" else loss_chunk
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
        "hidden_states_per_seq": (target_config.get_text_config().num_hidden_layers + 1) * S * H * target_bytes,
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
    """The plan as the lines `python -m harness.memory` prints."""
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
                "not even one sequence fits: try a smaller --max-anchors or --seq-len")
        raise ValueError(f"batch size {s['batch_size']} needs about {plan['peak'] / GiB:.3g} GiB per GPU, more than "
                         f"the GPU's {s['gpu_memory_gib']:.3g} GiB; {hint} (python -m harness.memory prints the plan)")


def fitting_plan(target_config, seq_len, max_anchors, batch_size, fields, gpu_memory_gib, log=print):
    """train.py on a GPU: -> whether to recompute each draft layer in backward, which it does only when the
    batch fits no other way; a batch that does not fit even so is refused (check_fits)."""
    plan = memory_plan(target_config, seq_len, max_anchors, batch_size, "train", False, gpu_memory_gib, **fields)
    if plan["peak"] > gpu_memory_gib * GiB:
        plan = memory_plan(target_config, seq_len, max_anchors, batch_size, "train", True, gpu_memory_gib, **fields)
        check_fits(plan)
        log(f"recomputing each draft layer in backward: without, batch {batch_size} does not fit "
            f"{gpu_memory_gib:.3g} GiB (python -m harness.memory prints the plan)")
    return plan["shape"]["grad_checkpoint"]


# -----------------------------------------------------------------------------
# python -m harness.memory


def parse_args(argv=None):
    """The plan's own flags, then train.py's step and drafter flags (the same names, types and defaults)."""
    p = argparse.ArgumentParser(description="The estimated peak GPU memory of a train.py run and the largest "
                                "--batch-size that fits, from the target's config alone (no weights).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="HF model folder, hub id or .gguf file of the frozen target (its "
                   "config only)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory the plan must fit")
    p.add_argument("--grad-checkpoint", action="store_true", help="plan for recomputing each draft layer in backward "
                   "(train.py does so on its own when a batch fits no other way)")
    g = p.add_argument_group("the training step")
    g.add_argument("--seq-len", type=at_least(2), default=512, help="rows are truncated to this many tokens")
    g.add_argument("--max-anchors", type=at_least(1), default=16, help="blocks per sequence per step")
    g.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per rank per micro-step")
    add_drafter_flags(p.add_argument_group("drafter"))
    return p.parse_args(argv)


def main(args, log=print):
    """Print the plan of this run shape on --target; -> the plan."""
    if not args.target:  # the offline demo's target is built (trained) on first use: no config to read yet
        raise ValueError("the memory plan reads the target's config: name one with --target (a model folder, hub id "
                         "or .gguf file); the offline demo's tiny target needs no plan")
    if not args.gpu_memory_gib > 0:  # also refuses NaN
        raise ValueError(f"--gpu-memory-gib {args.gpu_memory_gib} must be > 0")
    plan = memory_plan(load_config(args.target), args.seq_len, args.max_anchors, args.batch_size, "train",
                       args.grad_checkpoint, args.gpu_memory_gib, **drafter_fields(args))
    log(format_plan(plan))
    return plan


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"harness.memory: {e}") from None
