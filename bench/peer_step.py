"""
This project's training step against vllm-project speculators 0.9.0's DFlash training step, side by side on a CPU at
bench.cost's training shape: SmolLM2-135M-Instruct's widths and vocabulary with random weights (H = 576, 30 target
layers, V = 49,152), batch 8 x 384 tokens, 32 anchors a row, B = 8, 2 draft layers. The target's features are cached:
computed once, and every step reads the same hidden states. In float32, and in bf16 (a bf16 target, the step under
bf16 autocast, float32 weights and optimizer) where this CPU multiplies bf16 in hardware, as train.py's --dtype auto
picks.

  ours          train.py's step at its defaults (DFlash2: conv 2, selector 16): step_inputs from the feature cache,
                loss_step with the compiled loss (forward KL to the target's softmax, plus the selector's loss),
                backward, the gradient clipped at 1.0, fused AdamW (make_optimizer)
  ours, DFlash  the same with --conv-kernel-size 0 --selector-top-k 0: the algorithm speculators trains
  speculators   as its Trainer.train_epoch takes a step: DFlashDraftModel's forward under autocast (anchors, the mask,
                the target's logits from its last hidden states, the loss and its metrics), backward, the gradient
                clipped at 1.0, AdamW from its build_optimizers. Its loss is --loss-fn kl_div
                --per-position-loss-weight fixed-exp-decay with γ = 4 (ours at B = 8): forward KL to the target's
                softmax, slot k weighted exp(-(k-1)/γ), as ours. (Its DFlash default is CE to the target's argmax
                weighted by D-PACE.)

Each side runs as its own code runs on a CPU, and so the steps differ beyond their code:
  - layout: ours keeps the rows (8, 384) with 32 anchors each; speculators packs them into one row of 3,072 tokens
    with document ids and draws 256 anchors over the pack (its collator's and select_anchors' layout), so a row gets
    32 on average. Its dense mask sets every block against the whole pack: 2,048 x 5,120 scores a head against ours'
    8 x 256 x 640, 8 times the attention products.
  - attention: flex attention, its default, has no backward on a CPU; its "sdpa" option (its choice for such
    hardware) is the faster of its other two here. Every draft layer full attention (--full-attention-indices 0 1):
    bidirectional in a block, as ours (its default sliding layers are causal there).
  - slots: it takes the logits of all B slots of a block, the anchor's too (weight 0 in the loss), ours B - 1: 8/7
    of the lm_head products, the drafter's and the target's.
  - loss: its eager implementation over all slots at once (its fused losses are Triton kernels, for a GPU); ours
    under torch.compile. Its forward is compiled only on CUDA (conditional_torch_compile): eager here.
  - optimizer: its AdamW is torch's default, a loop over the tensors on a CPU; ours is fused.

Reports each step's median seconds over rounds interleaved (ours, ours DFlash, speculators, ...) after a warm-up
round (ours compiles there), speculators / ours as the median of the per-round ratios with a paired 95% bootstrap
over rounds, each step's matrix-product FLOPs as torch's counter sees them (the linear layers and lm_heads: it sees
no SDPA on a CPU) and its dense attention's by formula, and the trainable parameters.

python -m bench.peer_step              # bench_out/peer_step/peer_step.json and .md
python -m bench.peer_step --quick      # small shapes, one round: a smoke run
(in a virtual environment that also has `pip install --no-deps speculators==0.9.0`, and for its imports
openai httpx httpcore h11 distro jiter sniffio hs-connectors==0.9.0 pydantic-settings python-dotenv loguru)
"""
import argparse
import importlib.metadata
import os
import time

import torch

import dflash2
from bench.common import ci_text, median, random_target, round_ratio_ci, round_seconds, write_results
from bench.cost import SMOLLM2_135M, cpu_model, product_flops
from harness.memory import sizing_config, use_huge_pages

STEPS = ("ours", "ours, DFlash", "speculators")


# -----------------------------------------------------------------------------
# the two steps


def our_step(target, c, features, batch, rows, seeds, max_anchors):
    """train.py's step on a cached batch, as bench.cost's train_part builds it, with train.py's gradient clip.
    -> (step(sums_fn), the loss compiled, trainable parameters)."""
    import train
    torch.manual_seed(0)
    drafter = dflash2.DFlash2Drafter(c)
    params = list(drafter.parameters())
    optimizer = train.make_optimizer(params, lr=1e-6)
    cfg, view = train.loss_config(train.parse_args([]), c.vocab_size), dflash2.target_view(c, target)

    def step(sums_fn):
        inputs = train.step_inputs(target, batch, max_anchors, seeds, features, rows)
        train.loss_step(drafter, view, target, inputs, cfg, sums_fn)[0].backward()
        torch.nn.utils.clip_grad_norm_(params, train.GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, train.compiled_loss(target.device, print), sum(p.numel() for p in params)


def peer_drafter(c, target):
    """speculators' DFlashDraftModel at the drafter's shape, its config as its from_training_args builds one (the
    decoder's a LlamaConfig, as its CLI's create_transformer_layer_config), every layer full attention through SDPA;
    the target's embedding, lm_head and final norm copied in where it would load them from the verifier's files."""
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig  # optional: the peer package
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # optional
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # optional
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                        layer_types=["full_attention"] * c.num_layers)
    layer._attn_implementation = "sdpa"
    proposal = GreedyTokenProposalConfig(speculative_tokens=c.block_size - 1)
    verifier = VerifierConfig(name_or_path=None, architectures=[type(target).__name__])
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=c.vocab_size, block_size=c.block_size,
        aux_hidden_state_layer_ids=c.target_layer_ids, mask_token_id=c.mask_token_id,
        speculators_config=SpeculatorsConfig(algorithm="dflash", proposal_methods=[proposal],
                                             default_proposal_method="greedy", verifier=verifier))
    torch.manual_seed(0)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        model.verifier_lm_head.weight.copy_(target.get_output_embeddings().weight)
        # it normalises the last hidden states itself; ours are normed already, by unit weights (a random target's
        # init), so this norm leaves them as they are up to eps: both losses read the same target logits
        model.verifier_norm.weight.copy_(target.base_model.norm.weight)
    return model


def peer_step(model, context, last, ids, max_anchors, gamma, dtype):
    """speculators' step on the packed batch: its inputs as its collator hands them in (one row, document ids,
    positions restarting at each document). -> (step(), trainable parameters)."""
    from speculators.train.optimizers import build_optimizers  # optional: the peer package
    b, S = ids.shape
    optimizer, = build_optimizers(model, argparse.Namespace(optimizer="adamw", lr=1e-6, weight_decay=0.0))
    inputs = dict(hidden_states=context.reshape(1, b * S, -1), input_ids=ids.reshape(1, b * S),
                  loss_mask=torch.ones(1, b * S, dtype=torch.long),
                  verifier_last_hidden_states=last.reshape(1, b * S, -1),
                  document_ids=torch.arange(b).repeat_interleave(S)[None], position_ids=torch.arange(S).repeat(b)[None])
    kwargs = model.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", dflash_decay_gamma=gamma,
                                      max_anchors=max_anchors, per_position_loss_weight="fixed-exp-decay")[0]

    def step():
        # its trainer's autocast at --hidden-states-dtype; a CPU has none for float32, the same as none at all
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**inputs, **kwargs)[1]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step, sum(p.numel() for p in model.parameters() if p.requires_grad)


def attention_flops(rows, queries, keys, c):
    """The draft layers' attention products, forward (QKᵀ and PV: 4·q·k·hd a head) and backward (twice that), dense:
    an SDPA kernel on a CPU computes the masked scores too."""
    return 12 * rows * queries * keys * c.num_heads * c.head_dim * c.num_layers


# -----------------------------------------------------------------------------
# measurement


def measure(quick, rounds):
    try:
        import speculators  # optional: the peer package
    except ImportError:
        raise ValueError("speculators is missing: pip install --no-deps speculators==0.9.0 (bench/peer_step.py's "
                         "docstring lists what its import needs)") from None
    import train
    from harness.target import TargetFeatures, native_bf16_cpu
    shape = dict(SMOLLM2_135M, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab=4096) if quick \
        else SMOLLM2_135M
    batch_size, seq_len, anchors = (2, 64, 8) if quick else (8, 384, 32)
    # elsewhere bf16 is emulated, many times slower: --dtype auto never picks it
    dtypes = ["float32", "bfloat16"] if native_bf16_cpu() else ["float32"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"] - 1, (batch_size, seq_len), generator=g)
    ones = torch.ones_like(ids)
    batch, rows = (ids, ones, ones), list(range(batch_size))
    fns, counts = {}, {}
    for dtype in dtypes:
        target = random_target(dtype=getattr(torch, dtype), **shape)
        fields = dict(mask_token_id=shape["vocab"] - 1, num_layers=2, block_size=8)
        configs = {"ours": sizing_config(target.config, **fields),
                   "ours, DFlash": sizing_config(target.config, conv_kernel_size=0, selector_top_k=0, **fields)}
        c = configs["ours"]
        key = {"target_weights": [0.0], "target_layer_ids": c.target_layer_ids, "dtype": dtype}
        features = TargetFeatures(key, c.target_layer_ids)
        context, last = features.features(target, ids, ones, rows)  # filled once, as a run's first epoch does
        for name, config in configs.items():
            step, compiled, params = our_step(target, config, features, batch, rows, rows, anchors)
            # counted on the eager formula (bench.cost.train_part says why)
            counts[(dtype, name)] = {"product_flops": product_flops(lambda: step(dflash2.slot_sums)),
                                     "params": params}
            fns[(dtype, name)] = lambda step=step, compiled=compiled: step(compiled)
        gamma = dflash2.default_gamma(c.block_size) if train.GAMMA is None else train.GAMMA  # as our loss weighs slots
        step, params = peer_step(peer_drafter(c, target), context, last, ids, batch_size * anchors, gamma,
                                 getattr(torch, dtype))
        counts[(dtype, "speculators")] = {"product_flops": product_flops(step), "params": params}
        fns[(dtype, "speculators")] = step
        ours_attention = attention_flops(batch_size, anchors * c.block_size, seq_len + anchors * c.block_size, c)
        theirs_attention = attention_flops(1, batch_size * anchors * c.block_size,
                                           batch_size * (seq_len + anchors * c.block_size), c)
        for name in STEPS:
            counts[(dtype, name)]["attention_flops"] = theirs_attention if name == "speculators" else ours_attention
    seconds = round_seconds(fns, rounds, warmup=1)
    return {"shape": {**shape, "batch_size": batch_size, "seq_len": seq_len, "max_anchors": anchors, "num_layers": 2,
                      "block_size": 8, "rounds": rounds},
            "cpu": cpu_model(), "peer": f"speculators {importlib.metadata.version('speculators')}",
            "steps": report(seconds, counts)}


def report(seconds, counts):
    """Per dtype and step, from per-round seconds {(dtype, step): [s]} and counts {(dtype, step): {...}}: the median
    seconds, speculators / this step (the median of the per-round ratios, round_ratio_ci's interval), the counts."""
    steps = {}
    for (dtype, name), s in seconds.items():
        row = steps.setdefault(dtype, {})[name] = {"seconds": s, "median_s": median(s), **counts[(dtype, name)]}
        if name != "speculators":
            row["speculators_over"] = round_ratio_ci(seconds[(dtype, "speculators")], s)
    return steps


def markdown(r):
    s, cpu = r["shape"], r["cpu"]
    lines = [f"Training step, {r['peer']} against this project's, at {s} on {cpu['model']} ({cpu['threads']} threads, "
             f"bf16 products in hardware: {'yes' if cpu['native_bf16'] else 'no'}); target features cached; medians "
             f"of {s['rounds']} rounds, interleaved after a warm-up round. speculators / this step: the median of the "
             "per-round ratios [paired 95% bootstrap over rounds]", "",
             "| dtype | step | s per step | speculators / this step | products TFLOP (counted) | dense attention "
             "TFLOP | trainable params (M) |", "|---|---|---|---|---|---|---|"]
    for dtype, steps in r["steps"].items():
        for name, v in steps.items():
            ratio = "-" if name == "speculators" else ci_text(*v["speculators_over"])
            lines.append(f"| {dtype} | {name} | {v['median_s']:.2f} | {ratio} | {v['product_flops'] / 1e12:.3f} | "
                         f"{v['attention_flops'] / 1e12:.3f} | {v['params'] / 1e6:.2f} |")
    return "\n".join(lines + [""])


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.peer_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each step (medians), after a warm-up round")
    p.add_argument("--quick", action="store_true", help="small shapes, one round: a smoke run")
    p.add_argument("--out", dest="out_dir", default="bench_out/peer_step", help="where peer_step.json and .md go")
    return p.parse_args(argv)


def check_args(args):
    """Bad flags fail here, before any work."""
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: expected an integer >= 1")


def main(args):
    check_args(args)
    use_huge_pages()  # before the first large tensor
    t0 = time.time()
    results = measure(args.quick, 1 if args.quick else args.rounds)
    results["wall_seconds"] = time.time() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    write_results(args.out_dir, "peer_step", results, markdown(results))
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags or a missing package: one line, before any work
        raise SystemExit(f"bench.peer_step: {e}") from None
