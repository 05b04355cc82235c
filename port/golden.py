"""
Golden tensors for porters (ALGORITHM.md §8): a seeded tiny target and drafter, and every
intermediate a port needs to diff itself against, written as

    DIR/target/      config.json + model.safetensors   (transformers Qwen3ForCausalLM)
    DIR/drafter/     config.json + model.safetensors   (DFlash2 checkpoint, §7, fp32)
    DIR/golden.safetensors                             (all tensors below)
    DIR/manifest.json                                  (name, shape, dtype, meaning of each)

Run from the repository root: python -m port.golden DIR [--force].
A port cannot reproduce torch's RNG, so the sampled walk is driven by recorded uniforms
(inverse CDF, below) and the speculative trace is greedy. Every discrete decision in the
set (top-K order, walk argmaxes, inverse-CDF picks) is at least TIE_MARGIN away from a tie,
so an fp32 port lands on the same tokens. Notation: ALGORITHM.md's legend.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.numpy import load_file, save_file

import dflash2

TIE_MARGIN = 1e-4
# the tiny world: V 64, H 32, Lt 4 target layers, nf 2 features, Ld 2 draft layers,
# B 4, Kc 3 (so a block start cuts two taps), G 8, R 8, K 4, nh 4, nkv 2 (GQA), hd 8
V, H, MASK_ID = 64, 32, 63
DRAFT = dict(mask_token_id=MASK_ID, num_layers=2, block_size=4, target_layer_ids=[0, 2],
             conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4)
# training batch: b 2 rows of S 12; row 1 is right-padded from 9 on. Anchors: a block at 0
# (empty context), one running past the end (10) and a padding anchor (row 1, last)
S = 12
ANCHORS = [[0, 4, 10], [3, 5, 0]]
ANCHOR_VALID = [[True, True, True], [True, True, False]]
TEMPERATURE = 0.7            # of the sampled walk
PROMPT_LEN, MAX_NEW_TOKENS = 5, 14
SEED = 0
EMBED_SHIFT, CODEBOOK_SCALE = 0.2, 0.3
OUTPUTS = ("target", "drafter", "golden.safetensors", "manifest.json")


def target_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       rope_theta=10000.0, tie_word_embeddings=False)


def build_models():
    """Every weight drawn here, in sorted-name order from one generator, so the set depends
    on the forward math only, not on how dflash2 or transformers initialise. The target's
    logits are spread wide (lm_head std 0.8) so ties are rare; the drafter's convolution and
    selector are far from their identity init, so a port with a transposed kernel or a
    swapped codebook cannot hide behind zeros."""
    from transformers import Qwen3ForCausalLM
    target = Qwen3ForCausalLM(target_config()).float().eval().requires_grad_(False)
    drafter = dflash2.DFlash2Drafter(dflash2.DFlash2Config.from_target(target.config, **DRAFT)).float()
    g = torch.Generator().manual_seed(SEED)
    randn = lambda p, std: std * torch.randn(p.shape, generator=g)
    with torch.no_grad():
        for name, p in sorted(target.named_parameters()):
            p.copy_(1 + randn(p, 0.1) if name.endswith("norm.weight") else randn(p, 0.8 if name == "lm_head.weight" else 0.02))
        # a shared offset on one embedding channel gives target and drafter a common prior over
        # tokens, so the greedy trace accepts some drafts instead of rejecting every one
        target.model.embed_tokens.weight[:, 0] += EMBED_SHIFT
        for name, p in sorted(drafter.named_parameters()):
            if name.endswith("base_kernel"):
                p.copy_(randn(p, 0.3))
                p[:, 0] += 1.0
            elif name.endswith("kernel_projection.weight"):
                p.copy_(randn(p, 0.1))
            elif name.endswith("norm.weight"):
                p.copy_(1 + randn(p, 0.1))
            elif name.startswith("candidate_selector."):
                p.copy_(randn(p, 0.3 if "projection" in name else CODEBOOK_SCALE))
            else:
                p.copy_(randn(p, 0.02))
    return target, drafter


def training_batch():
    g = torch.Generator().manual_seed(SEED + 2)
    input_ids = torch.randint(0, MASK_ID, (2, S), generator=g)
    attention_mask = torch.ones(2, S, dtype=torch.long)
    attention_mask[1, 9:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0  # a 3-token prompt
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                anchors=torch.tensor(ANCHORS), anchor_valid=torch.tensor(ANCHOR_VALID))


# -----------------------------------------------------------------------------
# dflash2's free functions are called only here, so an API change is one edit; the rest of
# this file uses the drafter's methods (forward, propose, edge_scores, save_pretrained)


def block_inputs(drafter, target, batch):
    """What the drafter's training forward reads: packed blocks, the block mask, features."""
    c = drafter.config
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    ctx = dflash2.context_features(out.hidden_states, c.target_layer_ids)
    ids, pos = dflash2.block_layout(batch["input_ids"], batch["anchors"], c.block_size, c.mask_token_id)
    mask = dflash2.block_attention_mask(batch["anchors"], batch["attention_mask"], c.block_size)
    return dict(hidden_states=out.hidden_states, target_logits=out.logits, ctx_features=ctx,
                block_ids=ids, block_pos=pos, mask=mask, ctx_pos=torch.arange(S).expand(2, S))


def loss_terms(drafter, target, batch, inputs, loss_type):
    return dflash2.dflash2_loss(drafter, target, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                inputs["hidden_states"], batch["anchors"], batch["anchor_valid"], loss_type=loss_type)


def greedy_trace(drafter, target, prompt):
    """spec_generate at T = 0, with every target call recorded by a forward hook, and the
    smallest tie margin of its decisions: lm_head outputs (the drafter's unary logits and
    the target's logits) over their top K + 1, and the walk's edge scores over their top 2."""
    calls, gaps = [], []
    K, selector = drafter.config.selector_top_k, drafter.candidate_selector

    def on_target(module, args, kwargs, out):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        calls.append((ids[0].clone(), out.logits[0].clone(),
                      dflash2.context_features(out.hidden_states, drafter.config.target_layer_ids)[0].clone()))

    def scores(*args):
        s = edge_scores(*args)
        gaps.append(min_gap(s, 1))
        return s

    edge_scores = selector.edge_scores
    handles = [target.register_forward_hook(on_target, with_kwargs=True),
               target.get_output_embeddings().register_forward_hook(lambda m, a, out: gaps.append(min_gap(out, K)))]
    selector.edge_scores = scores
    try:
        tokens, stats = dflash2.spec_generate(drafter, target, prompt, MAX_NEW_TOKENS, temperature=0.0)
    finally:
        for handle in handles:
            handle.remove()
        del selector.edge_scores
    return calls, tokens, stats, min(gaps)


class Capture:
    """Records each draft layer's intermediates during one forward: module outputs through
    forward hooks, the convolutions' prepare/finish through wrappers on the instances."""

    def __init__(self, drafter):
        self.drafter, self.got, self.undo = drafter, {}, []

    def __enter__(self):
        d = self.drafter
        self._out(d.hidden_norm, "fwd.ctx")
        for i, layer in enumerate(d.layers):
            p = f"fwd.layers.{i}."
            self._out(layer.input_layernorm, p + "attn_norm")
            self._out(layer.self_attn, p + "attention")
            self._out(layer.post_attention_layernorm, p + "mlp_norm")
            self._out(layer.mlp, p + "mlp")
            self._out(layer, p + "output")
            for side in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, side)
                self._out(conv.kernel_projection, p + side + ".delta")
                self._wrap(conv, "prepare", p + side + ".prepare", first=True)
                self._wrap(conv, "finish", p + side + ".finish", first=False)
        return self.got

    def __exit__(self, *exc):
        for undo in reversed(self.undo):
            undo()

    def _out(self, module, name):
        def hook(m, args, out):
            self.got[name] = out.detach().clone()
        self.undo.append(module.register_forward_hook(hook).remove)

    def _wrap(self, obj, method, name, first):
        inner = getattr(obj, method)

        def wrapper(*args):
            out = inner(*args)
            self.got[name] = (out[0] if first else out).detach().clone()
            return out
        setattr(obj, method, wrapper)
        self.undo.append(lambda: delattr(obj, method))


# -----------------------------------------------------------------------------
# the sampled walk, replayable without torch's RNG


def sampled_walk(selector, h, unary, anchor, cand, uniforms, temperature):
    """The §3 walk at T > 0 with its sampling made explicit: pick = the first candidate whose
    cumulative q exceeds u (inverse CDF), u one recorded uniform per slot.
    h (M, B-1, H), unary (M, B-1, V), anchor (M,), cand (M, B-1, K), uniforms (M, B-1)
    -> path (M, B-1), q (M, B-1, K), scores (M, B-1, K), cdf margin (min |cdf - u|)."""
    K = cand.shape[-1]
    prev, path, qs, scores, margin = anchor, [], [], [], float("inf")
    for j in range(cand.shape[1]):
        s = selector.edge_scores(h[:, j], unary[:, j], prev, cand[:, j])
        q = torch.softmax(s / temperature, dim=-1)
        cdf = q.cumsum(-1)
        u = uniforms[:, j, None]
        pick = (cdf <= u).sum(-1).clamp(max=K - 1)
        margin = min(margin, float((cdf[:, :-1] - u).abs().min()))
        prev = cand[:, j].gather(-1, pick[:, None]).squeeze(-1)
        path.append(prev), qs.append(q), scores.append(s)
    return torch.stack(path, 1), torch.stack(qs, 1), torch.stack(scores, 1), margin


def min_gap(x, k):
    """Smallest gap between consecutive values among the k + 1 largest (last axis)."""
    top = x.topk(min(k + 1, x.shape[-1]), dim=-1).values
    return float((top[..., :-1] - top[..., 1:]).min())


# -----------------------------------------------------------------------------
# writing and reading


def compute():
    """-> ({name: tensor}, {name: meaning}, {decision: tie margin}, target, drafter).
    Everything fp32/int64/bool. One thread: the same reduction order on every run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compute()
    finally:
        torch.set_num_threads(threads)


def _compute():
    target, drafter = build_models()
    c = drafter.config
    B, K, N = c.block_size, c.selector_top_k, len(ANCHORS[0])
    M = 2 * N
    rec, meaning = {}, {}

    def put(name, t, what):
        rec[name], meaning[name] = t.detach().clone().contiguous(), what

    batch = training_batch()
    put("batch.input_ids", batch["input_ids"], "(b, S) data tokens of the training batch")
    put("batch.attention_mask", batch["attention_mask"], "(b, S) 1 = real token, 0 = padding")
    put("batch.loss_mask", batch["loss_mask"], "(b, S) 1 = trained token")
    put("batch.anchors", batch["anchors"], "(b, N) anchor positions a_j (padding anchors sit at 0)")
    put("batch.anchor_valid", batch["anchor_valid"], "(b, N) False = padding anchor")

    with torch.no_grad():
        inp = block_inputs(drafter, target, batch)
    put("batch.target_logits", inp["target_logits"], "(b, S, V) target logits of the training batch")
    put("fwd.ctx_features", inp["ctx_features"], "(b, S, nf·H) raw context features cat(h_l), l in target_layer_ids")
    put("fwd.ctx_pos", inp["ctx_pos"], "(b, S) positions of the context keys")
    put("fwd.block_ids", inp["block_ids"], "(b, N·B) packed blocks [x[a_j], MASK×(B−1)]")
    put("fwd.block_pos", inp["block_pos"], "(b, N·B) absolute positions a_j + k")
    put("fwd.mask", inp["mask"], "(b, 1, N·B, S + N·B) block attention mask over keys [context ; blocks], True = visible")

    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad(), Capture(drafter) as got:
        h_all = drafter(embed(inp["block_ids"]), inp["block_pos"], inp["ctx_features"], inp["ctx_pos"], inp["mask"])
    what = {"ctx": "(b, S, H) projected context RMSNorm(fc(ctx_features)), shared by every layer",
            "attn_norm": "(b, N·B, H) u = input_layernorm(h)",
            "attention_conv.delta": "(b, N·B, 2·Kc·H/G) kernel_projection(u), viewed [side, tap, group]",
            "attention_conv.prepare": "(b, N·B, H) u' = input-side conv of u (queries and block K/V read it)",
            "attention": "(b, N·B, H) attention output y (o_proj applied)",
            "attention_conv.finish": "(b, N·B, H) y' = output-side conv of y (added to the residual)",
            "mlp_norm": "(b, N·B, H) u = post_attention_layernorm(h)",
            "mlp_conv.delta": "(b, N·B, 2·Kc·H/G) kernel_projection(u), viewed [side, tap, group]",
            "mlp_conv.prepare": "(b, N·B, H) u' = input-side conv of u",
            "mlp": "(b, N·B, H) SwiGLU output y",
            "mlp_conv.finish": "(b, N·B, H) y' = output-side conv of y",
            "output": "(b, N·B, H) residual stream after the layer"}
    for name in sorted(got):
        put(name, got[name], what[name.split(".", 3)[-1] if name.startswith("fwd.layers.") else "ctx"])
    put("fwd.hidden", h_all, "(b, N·B, H) drafter output norm(h), all slots including the anchor's")

    h = h_all.view(2, N, B, H)[:, :, 1:].reshape(M, B - 1, H)
    with torch.no_grad():
        unary = lm_head(h).float()
        anchor = inp["block_ids"].view(M, B)[:, 0]
        path, cand, q_greedy = drafter.propose(h, unary, anchor, 0.0)
        prev = torch.cat([anchor[:, None], path[:, :-1]], 1)
        scores = drafter.candidate_selector.edge_scores(h, unary, prev, cand)
    put("walk.unary", unary, "(M, B−1, V) unary logits lm_head(h) of drafted slots, M = b·N blocks in row order")
    put("walk.anchor", anchor, "(M,) anchor token of each block")
    put("walk.candidates", cand, "(M, B−1, K) top-K of unary, by descending logit")
    put("walk.greedy_path", path, "(M, B−1) greedy walk (T = 0)")
    put("walk.greedy_scores", scores, "(M, B−1, K) edge scores S[k](prev, C[k]) with prev = anchor, then the greedy path")

    uniforms = torch.rand(M, B - 1, generator=torch.Generator().manual_seed(SEED + 3))
    with torch.no_grad():
        s_path, s_q, s_scores, cdf_margin = sampled_walk(drafter.candidate_selector, h, unary, anchor, cand,
                                                         uniforms, TEMPERATURE)
    put("walk.temperature", torch.tensor(TEMPERATURE), "() T of the sampled walk")
    put("walk.uniforms", uniforms, "(M, B−1) u per slot; pick = #{i : cdf_i <= u} (inverse CDF of q)")
    put("walk.sampled_path", s_path, "(M, B−1) sampled walk driven by walk.uniforms")
    put("walk.sampled_q", s_q, "(M, B−1, K) q = softmax(S / T) given the sampled predecessor")
    put("walk.sampled_scores", s_scores, "(M, B−1, K) edge scores along the sampled walk")

    margins = dict(candidates=min_gap(unary, K), greedy=min_gap(scores, 1), inverse_cdf=cdf_margin)
    for loss_type in ("kl", "ce"):
        drafter.zero_grad()
        loss, stats = loss_terms(drafter, target, batch, inp, loss_type)
        put(f"loss.{loss_type}.loss", loss, "() L = L_unary + α·L_sel (α = 1)")
        for key in sorted(stats):
            if key != "loss":
                put(f"loss.{loss_type}.{key}", torch.tensor(stats[key], dtype=torch.float32), f"{key} of the stats")
        if loss_type == "kl":
            loss.backward()
            for name in ("fc.weight", "layers.0.attention_conv.kernel_projection.weight",
                         "layers.1.mlp_conv.base_kernel", "layers.1.self_attn.k_proj.weight",
                         "candidate_selector.hidden_projection.weight", "candidate_selector.successor_codebook"):
                put(f"grad.{name}", drafter.get_parameter(name).grad, f"dL/d {name} (KL loss), same shape")
    drafter.zero_grad(set_to_none=True)

    prompt = torch.randint(0, MASK_ID, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(SEED + 4))
    calls, tokens, stats, margins["trace"] = greedy_trace(drafter, target, prompt)
    put("trace.prompt", prompt[0], "(P,) prompt of the greedy spec_generate trace")
    put("trace.max_new_tokens", torch.tensor(MAX_NEW_TOKENS), "() max_new_tokens of the trace")
    put("trace.call_lengths", torch.tensor([len(ids) for ids, _, _ in calls]),
        "(calls,) tokens fed to the target per call: the prefill, then [anchor ; draft] per cycle")
    put("trace.input_ids", torch.cat([ids for ids, _, _ in calls]), "(Σ calls,) token ids fed to the target, call after call")
    put("trace.logits", torch.cat([lg for _, lg, _ in calls]), "(Σ calls, V) target logits of those calls")
    put("trace.ctx_features", torch.cat([f for _, _, f in calls]), "(Σ calls, nf·H) raw context features of those calls")
    put("trace.tokens", tokens, "(n,) committed tokens")
    put("trace.acceptance_lengths", torch.tensor(stats.acceptance_lengths), "(cycles,) tokens committed per cycle, bonus included")
    return rec, meaning, margins, target, drafter


def write_golden(out_dir, force=False):
    """Write the golden set into out_dir; a non-empty out_dir needs force=True."""
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise ValueError(f"{out_dir} is not empty: pass force=True (--force) to overwrite its golden set")
    rec, meaning, margins, target, drafter = compute()
    close = {k: v for k, v in margins.items() if v < TIE_MARGIN}
    if close:
        raise RuntimeError(f"golden decisions within {TIE_MARGIN} of a tie {close}: a port could pick another token")
    os.makedirs(out_dir, exist_ok=True)
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    target.save_pretrained(os.path.join(out_dir, "target"))
    drafter.save_pretrained(os.path.join(out_dir, "drafter"), dtype=torch.float32)
    arrays = {k: v.numpy() for k, v in rec.items()}
    save_file(arrays, os.path.join(out_dir, "golden.safetensors"))
    manifest = {"format": "dflash2-golden/1", "tie_margin": TIE_MARGIN,
                "tensors": [{"name": k, "shape": list(a.shape), "dtype": str(a.dtype), "meaning": meaning[k]}
                            for k, a in sorted(arrays.items())]}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return arrays


def read_golden(golden_dir):
    """-> {name: numpy array}, after checking the manifest names, shapes and dtypes."""
    with open(os.path.join(golden_dir, "manifest.json")) as f:
        manifest = json.load(f)
    arrays = load_file(os.path.join(golden_dir, "golden.safetensors"))
    listed = {e["name"]: e for e in manifest["tensors"]}
    for name in sorted(set(listed) | set(arrays)):
        if name not in arrays:
            raise ValueError(f"golden tensor {name} is in manifest.json but not in golden.safetensors")
        if name not in listed:
            raise ValueError(f"golden tensor {name} is in golden.safetensors but not in manifest.json")
        e, a = listed[name], arrays[name]
        if list(a.shape) != e["shape"] or str(a.dtype) != e["dtype"]:
            raise ValueError(f"golden tensor {name}: file has {list(a.shape)} {a.dtype}, "
                             f"manifest says {e['shape']} {e['dtype']}")
    return arrays


def main(argv=None):
    p = argparse.ArgumentParser(description="Write the DFlash2 golden tensors (ALGORITHM.md §8).")
    p.add_argument("out_dir", help="folder to write target/, drafter/, golden.safetensors, manifest.json into")
    p.add_argument("--force", action="store_true", help="overwrite the golden set in a non-empty folder")
    args = p.parse_args(argv)
    try:
        write_golden(args.out_dir, force=args.force)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
