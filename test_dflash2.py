"""Core tests of dflash2.py (ALGORITHM.md §1-§3, §6): drafter, local convolution, candidate
selector, block masking, anchors and loss (the §6 metrics: tests/test_metrics.py, on the same
target, drafter, batch and references, conftest.py's). Every hand-written piece is checked against an
independent reference (a naive loop, brute force or exact enumeration) on tiny random Qwen3
targets built from a config; nothing is downloaded. Comparisons run in float64 (in float32
where float32 is the point: underflow, the compiled loss). Beside conftest's builders it
imports dflash2.py only.
Run: python -m pytest test_dflash2.py -q
"""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import (ANCHORS, B, H, LAYER_IDS, MASK_ID, S, SERVED, V, VALID, WIDE_K, counted_slots, echo_forward,
                      float64_scores, loss_batch, make_batch, make_config, make_drafter, make_target, ref_edge_score,
                      ref_filtered_law, ref_greedy_walk, ref_topk, with_last_hidden)
from dflash2 import (Batch, DFlash2Drafter, DraftCache, LocalConv, LossConfig, TargetView, block_attention_mask,
                     block_layout, block_slots, context_features, default_gamma, default_target_layer_ids,
                     dflash2_loss, local_conv, loss_sums, sample_anchors, slot_sums, target_view)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return make_target()


def model_logits(target, batch):
    """(b, S, V) logits as the target's own forward returns them: the reference for the
    loss's lm_head(hidden_states[-1])."""
    with torch.no_grad():
        return target(batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def loss_and_stats(drafter, target, batch, anchors, anchor_valid, cfg=LossConfig()):
    """dflash2_loss of a batch: (L, its stats as floats)."""
    view = target_view(drafter.config, target)
    loss, stats, _ = dflash2_loss(drafter, view, loss_batch(batch, anchors, anchor_valid), cfg)
    return loss, {k: v.item() for k, v in stats.items()}


@pytest.fixture(scope="module")
def batch(target):
    return make_batch(target)


def packed_inputs(target, batch, anchors=ANCHORS, ids=None, ctx=None):
    """Drafter inputs in the training layout dflash2_loss builds: every block packed after
    the context, dense mask. ids / ctx replace the block token ids / context features."""
    layout_ids, pos = block_layout(batch["input_ids"], anchors, B, MASK_ID)
    embeds = target.model.embed_tokens(layout_ids if ids is None else ids)
    ctx = context_features(batch["hidden_states"], LAYER_IDS) if ctx is None else ctx
    mask = block_attention_mask(anchors, batch["attention_mask"], B)
    return embeds, pos, ctx, torch.arange(S).expand(len(pos), S), mask


def draft_packed(drafter, target, batch, **kw):
    with torch.no_grad():
        return drafter(*packed_inputs(target, batch, **kw))


def loss_and_logits(drafter, target, batch, **kw):
    """dflash2_loss on the test anchors, plus the drafter output it computed (b, N, B, H)
    and the unary logits of slots 1..B-1 (b, N, B-1, V), read off a forward hook: the loss's
    only drafter pass."""
    seen = []
    hook = drafter.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        loss, stats = loss_and_stats(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID, cfg=LossConfig(**kw))
    finally:
        hook.remove()
    assert len(seen) == 1, f"the loss ran the drafter {len(seen)} times, want once"
    h = seen[0].detach().view(*ANCHORS.shape, B, H)
    return loss, stats, h, target.lm_head(h[:, :, 1:])


def max_diff(a, b):
    return (a - b).abs().max().item()


# -----------------------------------------------------------------------------
# independent references: plain python loops over the formulas of ALGORITHM.md


def ref_rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean() + eps)


def ref_rope(x, pos, theta):
    """Rotate the pairs (x[i], x[i + d/2]) by the angle pos * theta^(-2i/d)."""
    d = x.shape[0]
    out = x.clone()
    for i in range(d // 2):
        angle = pos * theta ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def ref_attention(attn, x, ctx, blk_pos, ctx_pos, allowed):
    """One row: x (T, H) block, ctx (S, H) projected context, allowed (T, S+T) bool.
    Keys/values [ctx ; block] through the same projections; query head h reads kv head
    h // (nh / nkv)."""
    c = attn.c
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    src = torch.cat([ctx, x])
    src_pos = list(ctx_pos) + list(blk_pos)
    keys = [(attn.k_proj.weight @ s).view(nkv, hd) for s in src]
    vals = [(attn.v_proj.weight @ s).view(nkv, hd) for s in src]
    out = []
    for i in range(x.shape[0]):
        q = (attn.q_proj.weight @ x[i]).view(nh, hd)
        heads = []
        for h in range(nh):
            g = h // (nh // nkv)
            qh = ref_rope(ref_rms(q[h], attn.q_norm.weight, c.rms_norm_eps), blk_pos[i], c.rope_theta)
            scores = torch.stack([
                qh @ ref_rope(ref_rms(keys[n][g], attn.k_norm.weight, c.rms_norm_eps), src_pos[n], c.rope_theta)
                / math.sqrt(hd) if allowed[i, n] else torch.tensor(-math.inf, dtype=x.dtype)
                for n in range(len(src))])
            p = torch.softmax(scores, 0)
            heads.append(sum(p[n] * vals[n][g] for n in range(len(src)) if allowed[i, n]))
        out.append(attn.o_proj.weight @ torch.cat(heads))
    return torch.stack(out)


def ref_conv(x, delta, base, block_size):
    """out[i, c] = Σ_t (base[t, c] + δ[i, t, c // G]) · x[i − t, c], taps not crossing a
    block start. x (b, T, H), delta (b, T, Kc, H/G), base (Kc, H)."""
    b, T, Hx = x.shape
    Kc, G = base.shape[0], Hx // delta.shape[-1]
    out = torch.zeros_like(x)
    for n in range(b):
        for i in range(T):
            for t in range(Kc):
                if i % block_size < t:
                    continue
                for c in range(Hx):
                    out[n, i, c] += (base[t, c] + delta[n, i, t, c // G]) * x[n, i - t, c]
    return out


def ref_layer(layer, h, ctx, blk_pos, ctx_pos, allowed, block_size):
    """Pre-norm layer with the convolution around both sublayers (ALGORITHM.md §2 placement)."""
    eps = layer.input_layernorm.eps

    def convolved(conv, u, sublayer):
        delta = (u @ conv.kernel_projection.weight.T).view(u.shape[0], 2, conv.taps, conv.groups)
        u1 = ref_conv(u[None], delta[None, :, 0], conv.base_kernel[0], block_size)[0]
        return ref_conv(sublayer(u1)[None], delta[None, :, 1], conv.base_kernel[1], block_size)[0]

    u = torch.stack([ref_rms(r, layer.input_layernorm.weight, eps) for r in h])
    h = h + convolved(layer.attention_conv, u,
                      lambda u1: ref_attention(layer.self_attn, u1, ctx, blk_pos, ctx_pos, allowed))
    u = torch.stack([ref_rms(r, layer.post_attention_layernorm.weight, eps) for r in h])
    mlp = layer.mlp
    return h + convolved(layer.mlp_conv, u, lambda u1: (F.silu(u1 @ mlp.gate_proj.weight.T)
                                                        * (u1 @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T)


# -----------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 0, r"hidden_size \(0\) must be >= 1"),
    ("num_layers", 0, r"num_layers \(0\) must be >= 1"),
    ("vocab_size", 0, r"vocab_size \(0\) must be >= 1"),
    ("num_kv_heads", 3, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    ("head_dim", 7, r"head_dim \(7\) must be even"),
    ("block_size", 1, r"block_size \(1\) must be >= 2"),
    ("mask_token_id", V, rf"mask_token_id \({V}\) must be a token"),
    ("mask_token_id", -1, r"mask_token_id \(-1\) must be a token"),
    ("target_layer_ids", [], r"target_layer_ids is empty"),
    ("target_layer_ids", [0, 4], r"target_layer_ids \[4\] outside the target's layers \[0, 4\)"),
    ("target_layer_ids", [-1, 2], r"target_layer_ids \[-1\] outside"),
    ("conv_kernel_size", B + 1, rf"conv_kernel_size \({B + 1}\) must be in \[1, block_size={B}\]"),
    ("conv_kernel_size", -1, r"conv_kernel_size \(-1\) must be in"),
    ("conv_group_size", 5, r"hidden_size \(32\) must be divisible by conv_group_size \(5\)"),
    ("conv_group_size", 0, r"hidden_size \(32\) must be divisible by conv_group_size \(0\)"),
    ("selector_top_k", V + 1, rf"selector_top_k \({V + 1}\) must be in \[1, vocab_size={V}\]"),
    ("selector_top_k", -1, r"selector_top_k \(-1\) must be in"),
    ("selector_rank", 0, r"selector_rank \(0\) must be >= 1"),
    ("selector_codebooks", "x", r"selector_codebooks \('x'\) must be 'free' or 'factored'"),
    ("rope_theta", 0.0, r"rope_theta \(0.0\) must be > 0"),
    ("rms_norm_eps", -1e-6, r"rms_norm_eps \(-1e-06\) >= 0"),
    ("target_layer_ids", [1, 1], r"target_layer_ids \[1, 1\] has duplicates"),
    ("target_layer_ids", [0, 3], r"target_layer_ids \[0, 3\] holds the target's last layer 3: .*after the final norm"),
])
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        make_config(**{field: value})


@pytest.mark.parametrize("window", [0, -2, None])
def test_sliding_layers_refuse_a_window_that_hides_every_key(window):
    """A sliding layer's query sees the keys less than W away (its own position included): W <= 0 would hide them all
    (every score masked, NaN attention). Full-attention layers alone read no window."""
    with pytest.raises(ValueError) as refused:
        make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=window)
    assert str(refused.value) == f"sliding_window ({window!r}) must be an integer >= 1 for sliding_attention layers", \
        f"sliding_window {window!r}: {refused.value}"
    make_config(layer_types=["full_attention", "full_attention"], sliding_window=window)


def test_config_accepts_disabled_parts_with_unused_bad_values():
    # conv / selector off: their group size and rank are not used and must not be validated
    c = make_config(conv_kernel_size=0, conv_group_size=5, selector_top_k=0, selector_rank=0)
    assert not c.is_dflash2, "conv and selector off should be plain DFlash (is_dflash2 False)"


def test_default_target_layer_ids_are_the_published_choice_and_distinct_layers():
    # ALGORITHM.md §1: the published choice for 36 layers and 5 features, and n == 1 -> [L // 2]
    got = default_target_layer_ids(36), default_target_layer_ids(36, num_features=1)
    assert got == ([1, 9, 17, 25, 33], [18]), f"36 layers: {got}, want [1, 9, 17, 25, 33] and [18]"
    for L in range(2, 40):  # never the last layer, which serving engines cannot capture (a 1-layer target has none)
        ids = default_target_layer_ids(L)
        assert len(set(ids)) == len(ids) and all(0 <= l < L - 1 for l in ids), f"L={L}: layer ids {ids}"


def test_training_functions_refuse_bad_arguments(target, batch):
    with pytest.raises(ValueError, match=r"max_anchors \(0\) must be >= 1"):
        sample_anchors(batch["loss_mask"], 0)
    loss = lambda drafter=None, **kw: loss_and_stats(drafter or make_drafter(), target, batch, anchors=ANCHORS,
                                                   anchor_valid=VALID, cfg=LossConfig(**kw))
    for kw, message in ((dict(loss_type="mse"), r"loss_type \('mse'\) must be 'kl' or 'ce'"),
                        (dict(gamma=0), r"gamma \(0\) must be > 0"), (dict(gamma=-2.0), r"gamma \(-2.0\) must be > 0"),
                        (dict(alpha=-1.0), r"alpha \(-1.0\) must be >= 0"),
                        (dict(chunk_size=0), r"chunk_size \(0\) must be >= 1"),
                        (dict(selector_labels="top1"), r"selector_labels \('top1'\) must be 'argmax' or 'soft'"),
                        (dict(soft_labels_at=(1.0, 0.9, 20)), r"soft_labels_at \(\(1.0, 0.9, 20\)\) needs "
                                                              r"selector_labels='soft'"),
                        (dict(selector_labels="soft", soft_labels_at=(0.0, 0.9, 20)),
                         r"soft_labels_at \(0.0, 0.9, 20\): temperature must be > 0"),
                        (dict(selector_labels="soft", soft_labels_at=(1.0, 1.0, 2.5)),
                         r"soft_labels_at \(1.0, 1.0, 2.5\): top_k \(2.5\) must be an integer")):
        with pytest.raises(ValueError, match=message):
            loss(**kw)
    with pytest.raises(ValueError, match=r"the drafter has num_target_layers 6 but the target has 4"):
        loss(DFlash2Drafter(make_config(num_target_layers=6)).double())


def test_block_slots_counts_the_slots_of_a_loop(batch):
    """block_slots against counted_slots' loop: the same counted slots (past the row's end,
    outside loss_mask and of padding anchors left out), each read at t - 1."""
    counted, src = block_slots(ANCHORS, VALID, batch["loss_mask"], B)
    got = [(n, j, k + 1, src[n, j, k].item() + 1) for n, j, k in counted.nonzero().tolist()]
    want = counted_slots(batch, ANCHORS, VALID)
    assert got == want, f"block_slots counts {got}, the loop {want}"


def test_dflash2_imports_nothing_from_the_repository():
    """dflash2.py is the leaf every other file imports: no import of a repository module,
    at the top or inside a function (harness/checkpoint.py imports it, not the other way round)."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parent
    ours = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if (p / "__init__.py").exists()
                                                  or p.name in ("bench", "port", "tests")}
    tree = ast.parse((root / "dflash2.py").read_text())
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    inside = sorted({n for n in names if n.split(".")[0] in ours - {"dflash2"} or n == "dflash2"})
    assert not inside, f"dflash2.py imports {inside} from the repository"


# -----------------------------------------------------------------------------
# shapes, dtypes, and the drafter against a loop reference


def test_context_features_read_the_hidden_state_after_each_layer(batch):
    ctx = context_features(batch["hidden_states"], LAYER_IDS)
    assert torch.equal(ctx, torch.cat([batch["hidden_states"][1], batch["hidden_states"][3]], -1)), \
        "context_features: layer id l must read hidden_states[l + 1]"


def proposal_inputs(target, h):
    """Slots 1..B-1 of drafter output h (b, N·B, H) as propose takes them: hidden states
    (b·N, B-1, H) and unary logits (b·N, B-1, V), in h's dtype."""
    return h.view(-1, B, H)[:, 1:], F.linear(h.view(-1, B, H)[:, 1:], target.lm_head.weight.to(h.dtype))


def test_shapes_and_dtypes_of_layout_mask_drafter_and_proposals(target, batch):
    drafter = make_drafter(randomize=True)
    b, N = ANCHORS.shape
    ids, pos = block_layout(batch["input_ids"], ANCHORS, B, MASK_ID)
    mask = block_attention_mask(ANCHORS, batch["attention_mask"], B)
    assert ids.shape == pos.shape == (b, N * B) and ids.dtype == pos.dtype == torch.long, \
        f"block_layout: ids {tuple(ids.shape)} {ids.dtype}, pos {tuple(pos.shape)} {pos.dtype}, want {(b, N * B)} long"
    assert mask.shape == (b, 1, N * B, S + N * B) and mask.dtype == torch.bool, \
        f"block_attention_mask: {tuple(mask.shape)} {mask.dtype}, want {(b, 1, N * B, S + N * B)} bool"
    h = drafter(*packed_inputs(target, batch))
    assert h.shape == (b, N * B, H) and h.dtype == torch.float64, f"drafter output {tuple(h.shape)} {h.dtype}"

    slots_h, unary = proposal_inputs(target, h)
    anchor_ids = batch["input_ids"].gather(1, ANCHORS).view(-1)
    for temperature in (0.0, 0.8):
        path, cand, q = drafter.propose(slots_h, unary, anchor_ids, temperature)
        got = (path.shape, path.dtype, cand.shape, q.shape, q.dtype)
        want = ((b * N, B - 1), torch.long, (b * N, B - 1, 5), (b * N, B - 1, 5), torch.float32)
        assert got == want, f"T={temperature}: propose gave (path, cand, q) shapes/dtypes {got}, want {want}"
    scores = drafter.candidate_selector.edge_scores(slots_h, unary, anchor_ids[:, None].expand(-1, B - 1), cand)
    assert scores.shape == cand.shape and scores.dtype == torch.float32, \
        f"edge_scores {tuple(scores.shape)} {scores.dtype}, want {tuple(cand.shape)} float32"

    v1 = make_drafter(conv_kernel_size=0, selector_top_k=0)
    path, cand, q = v1.propose(slots_h, unary, anchor_ids, 0.8)
    assert path.shape == (b * N, B - 1) and cand is None and q.shape == (b * N, B - 1, V), \
        f"v1 propose: path {tuple(path.shape)}, cand {cand}, q {tuple(q.shape)}; q must span all of V (cand None)"


def test_loss_is_a_float64_scalar_with_grad_and_every_stat(target, batch):
    loss, stats = loss_and_stats(make_drafter(randomize=True), target, batch, anchors=ANCHORS, anchor_valid=VALID)
    assert loss.dim() == 0 and loss.dtype == torch.float64 and loss.requires_grad, \
        f"loss {tuple(loss.shape)} {loss.dtype} requires_grad={loss.requires_grad}, want a float64 scalar with grad " \
        "(at least fp32: float64 under a float64 drafter)"
    keys = {"loss", "unary_loss", "selector_loss"}
    assert set(stats) == keys, f"stats keys differ: {set(stats) ^ keys}"


def test_bf16_drafter_drafts_in_bf16_and_keeps_the_selector_q_in_fp32(target, batch):
    bf16 = make_drafter(randomize=True).to(torch.bfloat16)
    embeds, pos, ctx, ctx_pos, mask = packed_inputs(target, batch)
    hb = bf16(embeds.bfloat16(), pos, ctx.bfloat16(), ctx_pos, mask)
    assert hb.dtype == torch.bfloat16, f"bf16 drafter returned {hb.dtype}"
    anchor_ids = batch["input_ids"].gather(1, ANCHORS).view(-1)
    _, _, qb = bf16.propose(*proposal_inputs(target, hb), anchor_ids, 0.8)
    assert qb.dtype == torch.float32, f"selector q must stay fp32 under a bf16 drafter, got {qb.dtype}"


def test_default_gamma_is_the_published_value():
    got = [default_gamma(b) for b in (8, 10, 16)]
    assert got == [4.0, 5.0, 7.0], f"γ for B = 8/10/16 is {got}, published: [4.0, 5.0, 7.0]"


def test_drafter_matches_loop_reference(target, batch):
    """Attention with context injection (GQA, q/k norms, RoPE at context and block
    positions, dense mask), the convolution placement around both sublayers and the
    drafter's own norms, all against python loops."""
    drafter = make_drafter(randomize=True)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # let a swapped or skipped norm show
    inputs = [x[:1] for x in packed_inputs(target, batch, ANCHORS[:, :2])]  # row 0, blocks at 0 and 5
    embeds, pos, feats, _, mask = inputs
    with torch.no_grad():
        got = drafter(*inputs)[0]
        eps = drafter.config.rms_norm_eps
        ctx = torch.stack([ref_rms(f, drafter.hidden_norm.weight, eps) for f in feats[0] @ drafter.fc.weight.T])
        h = embeds[0]
        for layer in drafter.layers:
            h = ref_layer(layer, h, ctx, pos[0].tolist(), list(range(S)), mask[0, 0], B)
        want = torch.stack([ref_rms(r, drafter.norm.weight, eps) for r in h])
    assert max_diff(got, want) < 1e-5, f"drafter forward differs from the loop reference by {max_diff(got, want):.3g}"


def test_drafter_rows_in_a_batch_equal_rows_drafted_alone(target, batch):
    drafter = make_drafter(randomize=True)
    inputs = packed_inputs(target, batch)
    with torch.no_grad():
        together = drafter(*inputs)
        for n in range(2):
            alone = drafter(*[x[n:n + 1] for x in inputs])
            assert max_diff(together[n], alone[0]) < 1e-6, \
                f"row {n} computed in a batch differs from alone by {max_diff(together[n], alone[0]):.3g}"


# -----------------------------------------------------------------------------
# local convolution (§2)


@pytest.mark.parametrize("block, taps, group, T", [(4, 1, 1, 12), (4, 2, 4, 12), (5, 3, 2, 15), (3, 3, 8, 9),
                                                   (6, 4, 16, 5)])
def test_local_conv_equals_loop(block, taps, group, T):
    g = torch.Generator().manual_seed(block * 100 + taps * 10 + group)
    Hc = 16
    x = torch.randn(2, T, Hc, generator=g, dtype=torch.float64)
    delta = torch.randn(2, T, taps, Hc // group, generator=g, dtype=torch.float64)
    base = torch.randn(taps, Hc, generator=g, dtype=torch.float64)
    got, want = local_conv(x, delta, base, block), ref_conv(x, delta, base, block)
    assert max_diff(got, want) < 1e-12, f"local_conv differs from the loop by {max_diff(got, want):.3g}"


def test_kernel_projection_layout_is_side_tap_group():
    """Switch on one output row of kernel_projection at a time: exactly the side, tap and
    contiguous channel group that row names must move, by δ(i) · x[i − tap, c]."""
    c = make_config(conv_kernel_size=2, conv_group_size=8)
    conv = LocalConv(c).double()
    g = torch.Generator().manual_seed(0)
    u = torch.randn(1, 2 * B, H, generator=g, dtype=torch.float64)
    y = torch.randn(1, 2 * B, H, generator=g, dtype=torch.float64)
    groups, taps = H // 8, 2
    for row in range(2 * taps * groups):
        side, tap, group = row // (taps * groups), (row // groups) % taps, row % groups
        with torch.no_grad():
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
            conv.kernel_projection.weight[row] = torch.randn(H, generator=g, dtype=torch.float64)
            u1, delta_out = conv.prepare(u)
            y1 = conv.finish(y, delta_out)
        x = u if side == 0 else y
        moved = (u1 - u) if side == 0 else (y1 - y)
        still = (y1 - y) if side == 0 else (u1 - u)
        want = torch.zeros_like(x)
        d = u[0] @ conv.kernel_projection.weight[row]
        for i in range(2 * B):
            if i % B >= tap:
                want[0, i, group * 8:(group + 1) * 8] = d[i] * x[0, i - tap, group * 8:(group + 1) * 8]
        assert max_diff(moved, want) < 1e-12, \
            f"row {row} (side {side}, tap {tap}, group {group}) moved the output by {max_diff(moved, want):.3g} off"
        assert not still.any(), f"row {row} (side {side}) also moved the other side"


def test_local_conv_at_init_is_the_identity():
    conv = make_drafter(conv_kernel_size=3).layers[0].attention_conv
    g = torch.Generator().manual_seed(0)
    u = torch.randn(2, 3 * B, H, generator=g, dtype=torch.float64)
    y = torch.randn(2, 3 * B, H, generator=g, dtype=torch.float64)
    u1, delta_out = conv.prepare(u)
    assert torch.equal(u1, u), f"identity-init prepare moved its input by {max_diff(u1, u):.3g}"
    assert torch.equal(conv.finish(y, delta_out), y), "identity-init finish is not the identity"


def test_conv_never_reads_the_previous_block():
    drafter = make_drafter(randomize=True, conv_kernel_size=B)
    conv = drafter.layers[0].mlp_conv
    g = torch.Generator().manual_seed(1)
    u = torch.randn(1, 3 * B, H, generator=g, dtype=torch.float64)
    y = torch.randn(1, 3 * B, H, generator=g, dtype=torch.float64)

    def both_sides(u, y):
        u1, delta_out = conv.prepare(u)
        return u1, conv.finish(y, delta_out)

    with torch.no_grad():
        base = both_sides(u, y)
        u2, y2 = u.clone(), y.clone()
        u2[:, B:2 * B] += torch.randn(B, H, generator=g, dtype=torch.float64)  # all of block 1
        y2[:, B:2 * B] += torch.randn(B, H, generator=g, dtype=torch.float64)
        moved = both_sides(u2, y2)
        for side, (a, b) in enumerate(zip(base, moved)):
            assert torch.equal(a[:, 2 * B:], b[:, 2 * B:]), \
                f"side {side}: block 2 moved by {max_diff(a[:, 2 * B:], b[:, 2 * B:]):.3g} when block 1 changed"
        u3 = u.clone()
        u3[:, 2 * B] += 1.0                                       # block 2's first token (positive control)
        later = both_sides(u3, y)[0][:, 2 * B + 1:]
        assert max_diff(later, base[0][:, 2 * B + 1:]) > 1e-3, "taps inside a block do not read earlier tokens"


# -----------------------------------------------------------------------------
# block mask and anchors (§6)


def test_block_layout_equals_loop(batch):
    ids, pos = block_layout(batch["input_ids"], ANCHORS, B, MASK_ID)
    for n in range(2):
        for j in range(ANCHORS.shape[1]):
            a = ANCHORS[n, j].item()
            want_ids = [batch["input_ids"][n, a].item()] + [MASK_ID] * (B - 1)
            got_ids, got_pos = ids[n, j * B:(j + 1) * B].tolist(), pos[n, j * B:(j + 1) * B].tolist()
            assert (got_ids, got_pos) == (want_ids, list(range(a, a + B))), \
                f"row {n} block {j}: ids {got_ids} at {got_pos}, want {want_ids} at {a}..{a + B - 1}"


def test_block_attention_mask_equals_brute_force():
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[1, 9:] = 0          # right padding
    attention_mask[2, :2] = 0          # left padding
    anchors = torch.tensor([[0, 4, 10], [2, 6, 0], [3, 5, 11]])
    got = block_attention_mask(anchors, attention_mask, 3)
    b, N, Sx, Bx = 3, 3, 12, 3
    want = torch.zeros(b, 1, N * Bx, Sx + N * Bx, dtype=torch.bool)
    for n in range(b):
        for q in range(N * Bx):
            for k in range(Sx + N * Bx):
                if k < Sx:
                    want[n, 0, q, k] = k < anchors[n, q // Bx] and attention_mask[n, k] == 1
                else:
                    want[n, 0, q, k] = (k - Sx) // Bx == q // Bx
    assert torch.equal(got, want), f"{(got != want).sum().item()} mask entries differ from the double loop"


def test_sample_anchors_draws_distinct_sorted_eligible_anchors_per_seed():
    """Eligible: loss_mask[a] = 1 and a + 1 < S (§6), and loss_mask[a + 1] = 1 (the rule in
    sample_anchors' docstring: a block whose first slot is not trained on is wasted)."""
    loss_mask = torch.zeros(4, 16, dtype=torch.long)
    loss_mask[0, 2:] = 1                 # 13 eligible (15 is the last position)
    loss_mask[1, 4:9] = 1                # 4 eligible, fewer than max_anchors (8 ends the span)
    loss_mask[2, 15] = 1                 # only the last position: nothing to predict after it
    loss_mask[3, [1, 5, 6, 11, 15]] = 1  # only 5 is followed by a trained position
    eligible = [[a for a in range(15) if loss_mask[n, a] and loss_mask[n, a + 1]] for n in range(4)]
    for seed in range(5):
        anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(seed))
        for n in range(4):
            want_count = min(6, len(eligible[n]))
            got = anchors[n][valid[n]].tolist()
            assert valid[n].tolist() == [True] * want_count + [False] * (anchors.shape[1] - want_count), \
                f"row {n}: valid {valid[n].tolist()} should be the first {want_count} entries"
            assert set(got) <= set(eligible[n]), f"row {n}: anchors {got} outside eligible {eligible[n]}"
            assert got == sorted(set(got)), f"row {n}: anchors {got} not distinct and sorted"
            assert not anchors[n][~valid[n]].any(), f"row {n}: padding anchors {anchors[n].tolist()} not 0"
            if len(eligible[n]) <= 6:
                assert got == eligible[n], f"row {n}: {got} should be all eligible positions {eligible[n]}"
    first = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(7))
    again = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(7))
    other = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(8))
    assert torch.equal(first[0], again[0]), "same generator seed gave different anchors"
    assert not torch.equal(first[0][0], other[0][0]), "a different seed gave the same 6 of 13 anchors"


def test_block_sees_only_its_context_and_itself(target, batch):
    """Block j of row 0 (anchor a) must not move when the context at or after a, a padding
    key, or any other block's tokens change, and must move when context before a changes."""
    drafter = make_drafter(randomize=True)
    batch = {**batch, "attention_mask": batch["attention_mask"].clone()}
    batch["attention_mask"][0, 2] = 0  # a hole: key 2 of row 0 is not a real token
    ctx = context_features(batch["hidden_states"], LAYER_IDS)
    ids, _ = block_layout(batch["input_ids"], ANCHORS, B, MASK_ID)
    base = draft_packed(drafter, target, batch)
    j, a = 2, ANCHORS[0, 2].item()        # block 2 of row 0, anchor 8
    own = slice(j * B, (j + 1) * B)

    def moved(ctx=None, ids=None):
        return max_diff(draft_packed(drafter, target, batch, ctx=ctx, ids=ids)[0, own], base[0, own])

    late, hole, early = ctx.clone(), ctx.clone(), ctx.clone()
    late[0, a:] += torch.randn_like(late[0, a:])
    hole[0, 2] += 10.0
    early[0, a - 1] += 1.0
    others = ids.clone()
    others[0, :j * B] = (others[0, :j * B] + 1) % V
    others[0, (j + 1) * B:] = (others[0, (j + 1) * B:] + 1) % V
    assert moved(ctx=late) == 0, f"context at/after the anchor {a} leaked into its block: {moved(ctx=late):.3g}"
    assert moved(ctx=hole) == 0, f"a padding key leaked into the block: {moved(ctx=hole):.3g}"
    assert moved(ids=others) == 0, f"other blocks' tokens leaked into block {j}: {moved(ids=others):.3g}"
    assert moved(ctx=early) > 1e-4, f"context just before the anchor changed the block by only {moved(ctx=early):.3g}"
    inside = ids.clone()
    inside[0, j * B + B - 1] = 7                                    # positive control: own last slot
    assert max_diff(draft_packed(drafter, target, batch, ids=inside)[0, j * B], base[0, j * B]) > 1e-4, \
        "the block's first slot did not see its own last slot (attention should be bidirectional)"


def test_training_layout_equals_inference_path(target, batch):
    """Logits of each block inside the packed, masked layout of dflash2_loss equal the
    same block drafted alone from context 0..a-1 through the cache path spec_generate uses."""
    drafter = make_drafter(randomize=True)
    _, _, h, _ = loss_and_logits(drafter, target, batch)
    ctx = context_features(batch["hidden_states"], LAYER_IDS)
    ids, _ = block_layout(batch["input_ids"], ANCHORS, B, MASK_ID)
    b, N = ANCHORS.shape
    packed = target.lm_head(h)
    for n in range(b):
        for j in range(N):
            if not VALID[n, j]:
                continue
            a = ANCHORS[n, j].item()
            block = ids[n:n + 1, j * B:(j + 1) * B]
            with torch.no_grad():
                alone = drafter(target.model.embed_tokens(block), torch.arange(a, a + B)[None], ctx[n:n + 1, :a],
                                torch.arange(a)[None], mask=None, cache=DraftCache(drafter.config.num_layers))
            diff = max_diff(packed[n, j], target.lm_head(alone[0]))
            assert diff < 1e-6, f"row {n} anchor {a}: packed-layout logits differ from inference by {diff:.3g}"


# -----------------------------------------------------------------------------
# DFlash2 at init is DFlash


@pytest.mark.parametrize("codebooks", ["free", "factored"])
def test_dflash2_with_fresh_conv_and_selector_drafts_as_dflash(target, batch, codebooks):
    v1 = make_drafter(seed=1, conv_kernel_size=0, selector_top_k=0)
    v2 = make_drafter(seed=2, conv_kernel_size=3, selector_codebooks=codebooks)
    W_in = target.model.embed_tokens.weight
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing), \
        f"v1 -> v2 load: missing {missing}, unexpected {unexpected}"
    h1, h2 = draft_packed(v1, target, batch), draft_packed(v2, target, batch)
    assert torch.equal(h1, h2), f"hidden states differ by {max_diff(h1, h2):.3g}"
    M = ANCHORS.numel()
    u1, u2 = target.lm_head(h1).view(M, B, V)[:, 1:], target.lm_head(h2).view(M, B, V)[:, 1:]
    assert torch.equal(u1, u2), f"unary logits differ by {max_diff(u1, u2):.3g}"
    anchor_ids = batch["input_ids"].gather(1, ANCHORS).view(-1)
    p1 = v1.propose(h1.view(M, B, H)[:, 1:], u1, anchor_ids)[0]
    p2, cand, _ = v2.propose(h2.view(M, B, H)[:, 1:], u2, anchor_ids, W_in=W_in)
    assert torch.equal(p1, p2), f"greedy proposals differ in {(p1 != p2).sum().item()} of {p1.numel()} slots"
    prev = torch.cat([anchor_ids[:, None], p2[:, :-1]], 1)
    scores = v2.candidate_selector.edge_scores(h2.view(M, B, H)[:, 1:], u2, prev, cand, W_in)
    unary = u2.float().gather(-1, cand)
    assert torch.equal(scores, unary), \
        f"fresh selector scores differ from the unary logits by {max_diff(scores, unary):.3g}"


# -----------------------------------------------------------------------------
# candidate selector (§3)


def selector_inputs(seed=0, M=6):
    drafter = make_drafter(randomize=True)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, B - 1, H, generator=g, dtype=torch.float64)
    unary = torch.randn(M, B - 1, V, generator=g, dtype=torch.float64)
    anchor = torch.randint(0, V, (M,), generator=g)
    return drafter.candidate_selector, h, unary, anchor


def test_edge_scores_equal_loop():
    sel, h, unary, anchor = selector_inputs()
    g = torch.Generator().manual_seed(1)
    prev = torch.randint(0, V, (6, B - 1), generator=g)
    cand = torch.randint(0, V, (6, B - 1, 5), generator=g)
    with torch.no_grad():
        got = sel.edge_scores(h, unary, prev, cand)
    for m in range(6):
        for j in range(B - 1):
            for k in range(5):
                want = ref_edge_score(sel, h[m, j], unary[m, j], prev[m, j].item(), cand[m, j, k].item())
                assert abs(got[m, j, k].item() - want) < 1e-5 * (1 + abs(want)), \
                    f"S at ({m}, {j}, {k}) is {got[m, j, k].item()}, loop gives {want}"


def test_factored_selector_scores_and_walks_equal_loops(target):
    """Factored codebooks: A[prev] = W_A·W_in[prev], Bc[c] = W_B·W_in[c] with W_in the target's
    input embedding rows, against the loop of ref_codebook_row; the greedy walk feeds its choices
    forward through them; without W_in the selector refuses in one sentence."""
    sel = make_drafter(randomize=True, selector_codebooks="factored").candidate_selector
    W_in = target.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    h, unary = (torch.randn(4, B - 1, n, generator=g, dtype=torch.float64) for n in (H, V))
    prev, cand = torch.randint(0, V, (4, B - 1), generator=g), torch.randint(0, V, (4, B - 1, 5), generator=g)
    with torch.no_grad():
        got, (path, _, _) = sel.edge_scores(h, unary, prev, cand, W_in), sel.walk(h, unary, prev[:, 0], W_in=W_in)
    pairwise = []
    for m in range(4):
        for j in range(B - 1):
            for k in range(5):
                want = ref_edge_score(sel, h[m, j], unary[m, j], prev[m, j].item(), cand[m, j, k].item(), W_in)
                assert abs(got[m, j, k].item() - want) < 1e-5 * (1 + abs(want)), \
                    f"S at ({m}, {j}, {k}) is {got[m, j, k].item()}, loop gives {want}"
                pairwise.append(abs(want - unary[m, j, cand[m, j, k]].item()))
        walk = ref_greedy_walk(sel, h[m], unary[m], prev[m, 0].item(), W_in=W_in)
        assert path[m].tolist() == walk, f"row {m}: factored walk {path[m].tolist()} != loop {walk}"
    assert sorted(pairwise)[len(pairwise) // 2] > 0.1, "the pairwise term is too small to test anything"
    with pytest.raises(ValueError, match="factored codebooks needs the target's input embedding"):
        sel.edge_scores(h, unary, prev, cand)


def test_edge_scores_stay_fp32_under_autocast():
    """The `.float()` casts alone do not stop autocast from running the einsum in bf16."""
    sel, h, unary, anchor = selector_inputs()
    sel, h, unary = sel.float(), h.float(), unary.float()
    prev = anchor[:, None].expand(-1, B - 1)
    cand = unary.topk(5, dim=-1).indices
    with torch.no_grad():
        plain = sel.edge_scores(h, unary, prev, cand)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = sel.edge_scores(h, unary, prev, cand)
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain), (
        f"under autocast: {autocast.dtype}, max |diff| {(autocast.float() - plain).abs().max():.3g}")


def test_greedy_walk_feeds_its_choice_forward():
    sel, h, unary, anchor = selector_inputs()
    with torch.no_grad():
        path, cand, q = sel.walk(h, unary, anchor)
    for m in range(6):
        want = ref_greedy_walk(sel, h[m], unary[m], anchor[m].item())
        assert path[m].tolist() == want, f"row {m}: walk {path[m].tolist()} != loop {want}"
        for j in range(B - 1):
            top = ref_topk(unary[m, j], 5)
            assert cand[m, j].tolist() == top, f"row {m} slot {j}: candidates {cand[m, j].tolist()} != top-5 {top}"
            assert path[m, j].item() in top, f"row {m} slot {j}: {path[m, j].item()} outside the top-5"
            assert q[m, j].tolist() == [float(c == path[m, j].item()) for c in top], f"T=0 q not one-hot: {q[m, j]}"
    stale = sum(ref_greedy_walk(sel, h[m], unary[m], anchor[m].item(), feed_forward=False) != path[m].tolist()
                for m in range(6))
    assert stale > 0, "no row's walk depends on the fed-forward predecessor: the check has no teeth"


def test_sampled_walk_q_is_conditional_on_the_sampled_predecessor():
    sel, h, unary, anchor = selector_inputs(M=16)
    T = 1.5
    with torch.no_grad():
        path, cand, q = sel.walk(h, unary, anchor, T, torch.Generator().manual_seed(0))
        again = sel.walk(h, unary, anchor, T, torch.Generator().manual_seed(0))
    assert torch.equal(path, again[0]) and torch.equal(q, again[2]), "same seed gave a different sampled walk"
    sums = q.sum(-1)
    assert max_diff(sums, torch.ones_like(sums)) < 1e-5, f"q rows sum to {sums.min():.6f}..{sums.max():.6f}"
    greedy = sel.walk(h, unary, anchor)[0]
    assert not torch.equal(path, greedy), "sampling at T=1.5 reproduced the greedy walk: no test of q"
    for m in range(16):
        prev = anchor[m].item()
        for j in range(B - 1):
            scores = torch.tensor([ref_edge_score(sel, h[m, j], unary[m, j], prev, c) for c in cand[m, j].tolist()])
            want = torch.softmax(scores / T, 0)
            assert max_diff(q[m, j].double(), want) < 1e-5, \
                f"row {m} slot {j}: q differs from softmax(S(prev, C)/T) by {max_diff(q[m, j].double(), want):.3g}"
            assert path[m, j].item() in cand[m, j].tolist(), f"row {m} slot {j}: sample outside the candidates"
            prev = path[m, j].item()


# -----------------------------------------------------------------------------
# the loss (§6)


def test_unary_and_selector_loss_equal_loops(target, batch):
    """Position weights exp(-(k-1)/γ) normalised by Σw over counted slots; the test
    anchors include slots past the end, outside loss_mask and of padding anchors. The
    selector loss uses the data token at t-1; with argmax labels it skips labels outside
    the top-K, with soft labels each slot weighs by the target's mass on the top-K."""
    drafter = make_drafter(randomize=True, selector_top_k=WIDE_K)
    sel, gamma, alpha = drafter.candidate_selector, 2.5, 0.7
    seen = {}
    for loss_type, labels in (("kl", "argmax"), ("ce", "argmax"), ("kl", "soft"), ("ce", "soft"), ("kl", "served")):
        kw = dict(selector_labels="soft", soft_labels_at=SERVED) if labels == "served" else dict(selector_labels=labels)
        loss, stats, h, unary = loss_and_logits(drafter, target, batch, loss_type=loss_type, gamma=gamma, alpha=alpha,
                                                **kw)
        logits = model_logits(target, batch)
        num = den = sel_num = sel_den = 0.0
        for n, j, k, t in counted_slots(batch, ANCHORS, VALID):
            w = math.exp(-(k - 1) / gamma)
            ref = logits[n, t - 1]
            logp, logq = F.log_softmax(ref, -1), F.log_softmax(unary[n, j, k - 1], -1)
            label = ref.argmax().item()
            term = (logp.exp() * (logp - logq)).sum().item() if loss_type == "kl" else -logq[label].item()
            num, den = num + w * term, den + w
            cand = ref_topk(unary[n, j, k - 1], WIDE_K)
            prev = batch["input_ids"][n, t - 1].item()
            scores = torch.tensor([ref_edge_score(sel, h[n, j, k], unary[n, j, k - 1], prev, c) for c in cand])
            log_sel = F.log_softmax(scores, 0)
            if labels == "argmax" and label in cand:
                sel_num += w * -log_sel[cand.index(label)].item()
                sel_den += w
            elif labels in ("soft", "served"):
                law = ref_filtered_law(ref, *SERVED) if labels == "served" else {v: math.exp(x) for v, x in
                                                                                 enumerate(logp.tolist())}
                sel_num += w * sum(-law.get(c, 0.0) * log_sel[i].item() for i, c in enumerate(cand))
                sel_den += w * sum(law.get(c, 0.0) for c in cand)
        unary_ref, sel_ref = num / den, sel_num / sel_den
        where = f"{loss_type}, {labels} labels"
        assert abs(stats["unary_loss"] - unary_ref) < 1e-5 * (1 + unary_ref), \
            f"{where}: unary_loss {stats['unary_loss']} != loop {unary_ref}"
        assert 0 < sel_den < den, f"need slots both in and out of the top-K (weights {sel_den} of {den})"
        assert abs(stats["selector_loss"] - sel_ref) < 1e-5 * (1 + sel_ref), \
            f"{where}: selector_loss {stats['selector_loss']} != loop {sel_ref}"
        total = unary_ref + alpha * sel_ref
        assert abs(loss.item() - total) < 1e-5 * (1 + total), f"{where}: loss {loss.item()} != loop {total}"
        seen[labels] = sel_ref
    assert min(abs(seen["soft"] - seen["argmax"]), abs(seen["served"] - seen["soft"])) > 1e-3, \
        f"two label rules gave the same selector loss {seen}"


def test_float64_unary_loss_equals_a_loop_to_float64_rounding(target, batch):
    """The position weights w_k = exp(-(k-1)/γ) are built in the logits' dtype: in float64
    the loss is float64-accurate (float32 weights leave it ~1e-7 off)."""
    drafter, gamma = make_drafter(randomize=True, selector_top_k=0), 2.5
    loss, stats, h, unary = loss_and_logits(drafter, target, batch, gamma=gamma)
    logits = model_logits(target, batch)
    num = den = 0.0
    for n, j, k, t in counted_slots(batch, ANCHORS, VALID):
        w = math.exp(-(k - 1) / gamma)
        logp, logq = F.log_softmax(logits[n, t - 1], -1), F.log_softmax(unary[n, j, k - 1], -1)
        num, den = num + w * (logp.exp() * (logp - logq)).sum().item(), den + w
    assert loss.dtype == torch.float64, f"loss dtype {loss.dtype}"
    assert abs(loss.item() - num / den) < 1e-12, f"float64 loss {loss.item()!r} != loop {num / den!r} " \
        f"(off by {abs(loss.item() - num / den):.3g})"


def logits_view():
    """A view whose logits are its input: slot_sums' h and g are then the drafter's and the target's logits
    themselves, U = h and z = g (without a selector nothing else of the view is read)."""
    return TargetView(None, None, lambda x: x)


def one_slot(view, selector, cfg, h, g, prev, w, i):
    """slot_sums of slot i alone, with its weight: its own weighted terms."""
    return slot_sums(view, selector, cfg, h[i:i + 1], g[i:i + 1], None if prev is None else prev[i:i + 1], w[i:i + 1])


def ref_log_softmax(x):
    """log softmax of one row in python floats: x_v − max − log Σ_u exp(x_u − max)."""
    x = x.tolist()
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x))
    return [v - lse for v in x]


def ref_unary_term(u, z, loss_type):
    """ℓ of one slot, a loop over the vocabulary: kl Σ_v p_v·(log p_v − log q_v) over the p_v > 0, ce −log q_y;
    p = softmax(z), q = softmax(u), y = argmax z (the first on ties, as torch's)."""
    logp, logq = ref_log_softmax(z), ref_log_softmax(u)
    if loss_type == "ce":
        return -logq[max(range(len(logp)), key=lambda v: logp[v])]
    return sum(math.exp(a) * (a - b) for a, b in zip(logp, logq) if a > -math.inf)


def test_kl_with_minus_infinite_target_logits_is_finite():
    """Masked target logits (-inf) give p = 0; those terms are 0, not 0·(-inf) = NaN.
    Reference: the loop over the vocabulary that skips p = 0."""
    g = torch.Generator().manual_seed(0)
    unary, ref = (torch.randn(6, V, generator=g, dtype=torch.float64) for _ in range(2))
    ref[..., ::3] = float("-inf")
    for i in range(6):
        term = one_slot(logits_view(), None, LossConfig(), unary, ref, None, torch.ones(6, dtype=torch.float64),
                        i)["unary"].item()
        want = ref_unary_term(unary[i], ref[i], "kl")
        assert math.isfinite(term) and abs(term - want) < 1e-10 * (1 + want), f"slot {i}: KL term {term} != loop {want}"


@pytest.mark.parametrize("loss_type", ["kl", "ce"])
def test_slot_sums_unary_term_and_its_gradient_equal_loops_over_the_vocabulary(loss_type):
    """slot_sums' unary term, each slot alone and all slots at once (Σ w·ℓ), against ref_unary_term's
    loop over V; its gradient in U against w·(softmax(U) − π) (π = softmax(z) for kl, one-hot(argmax z)
    for ce), written out per slot. In float64 to 1e-12; with no selector it returns the unary sum only."""
    g, n, view, cfg = torch.Generator().manual_seed(1), 40, logits_view(), LossConfig(loss_type=loss_type)
    U = (4 * torch.randn(n, V, generator=g, dtype=torch.float64)).requires_grad_()
    z, w = 4 * torch.randn(n, V, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    terms = [ref_unary_term(U[i].detach(), z[i], loss_type) for i in range(n)]
    for i in range(n):
        got, want = one_slot(view, None, cfg, U, z, None, w, i), w[i].item() * terms[i]
        assert set(got) == {"unary"}, f"slot_sums without a selector returned {sorted(got)}, want only 'unary'"
        assert abs(got["unary"].item() - want) < 1e-12 * (1 + want), \
            f"{loss_type} slot {i}: {got['unary'].item()} != loop {want}"
    total, want = slot_sums(view, None, cfg, U, z, None, w)["unary"], sum(w[i].item() * terms[i] for i in range(n))
    assert abs(total.item() - want) < 1e-12 * (1 + want), \
        f"{loss_type}: Σ w·ℓ over {n} slots {total.item()} != loop {want}"
    grad, = torch.autograd.grad(total, U)
    for i in range(n):
        qs, ps = ([math.exp(a) for a in ref_log_softmax(x)] for x in (U[i].detach(), z[i]))
        pi = ps if loss_type == "kl" else [float(v == z[i].argmax().item()) for v in range(V)]
        want_grad = torch.tensor([w[i].item() * (q - p) for p, q in zip(pi, qs)], dtype=torch.float64)
        assert max_diff(grad[i], want_grad) < 1e-12, \
            f"{loss_type} slot {i}: gradient off by {max_diff(grad[i], want_grad):.3g} from w·(softmax(U) - π)"


@pytest.mark.parametrize("loss_type", ["kl", "ce"])
def test_slot_sums_unary_term_holds_where_fp32_softmaxes_underflow(loss_type):
    """One logit per row 300 above the rest, at columns that differ between U and z: in fp32 both softmaxes
    are one-hot (exp(-300) underflows to 0), so a term read through softmax(U) would be log 0 = -inf; slot_sums'
    fp32 term must still be the float64 loop's (about 300 for kl and ce), to fp32 rounding of those 300s."""
    g, n, view = torch.Generator().manual_seed(3), 40, logits_view()
    U, z = torch.randn(n, V, generator=g), torch.randn(n, V, generator=g)
    rows = torch.arange(n)
    U[rows, torch.randint(0, V, (n,), generator=g)] += 300
    z[rows, torch.randint(0, V, (n,), generator=g)] += 300
    w = torch.ones(n)
    assert (F.softmax(U, -1) == 0).any(-1).all() and (F.softmax(z, -1) == 0).any(-1).all(), \
        "fp32 softmaxes do not underflow: the test has no teeth"
    for i in range(n):
        term, want = one_slot(view, None, LossConfig(loss_type=loss_type), U, z, None, w, i)["unary"], \
            ref_unary_term(U[i], z[i], loss_type)
        assert term.dtype == torch.float32 and abs(term.item() - want) < 1e-5 * (1 + abs(want)), \
            f"{loss_type} row {i}: the fp32 term {term.item()} is {abs(term.item() - want):.3g} off the float64 loop " \
            f"{want}"


@pytest.mark.parametrize("labels", ["argmax", "soft", "served"])
def test_slot_sums_selector_term_equals_a_loop(target, labels):
    """slot_sums' selector sums, each slot alone and all at once, against loops: C = the top-K of U,
    E(prev, C) from ref_edge_score, π one-hot on argmax z (0 when outside C), the target's softmax on C
    ("soft"), or its law at SERVED (ref_filtered_law); Σ w·(−Σ_C π·log softmax(E)) and Σ w·Σ_C π."""
    drafter = make_drafter(randomize=True, selector_top_k=WIDE_K)
    sel, view, cfg = drafter.candidate_selector, target_view(drafter.config, target), LossConfig(
        loss_type="ce", **dict(argmax={}, soft=dict(selector_labels="soft"),
                               served=dict(selector_labels="soft", soft_labels_at=SERVED))[labels])
    g, n = torch.Generator().manual_seed(4), 12
    h, g_t = (10 * torch.randn(n, H, generator=g, dtype=torch.float64) for _ in range(2))  # labels in C 4 times in 12
    prev, w = torch.randint(0, V, (n,), generator=g), torch.rand(n, generator=g, dtype=torch.float64)
    U, z = target.lm_head(h), target.lm_head(g_t)
    want, inside = {"selector": 0.0, "selector_weight": 0.0}, 0
    for i in range(n):
        cand = ref_topk(U[i], WIDE_K)
        log_sel = F.log_softmax(torch.tensor([ref_edge_score(sel, h[i], U[i], prev[i].item(), c) for c in cand]), 0)
        law = {z[i].argmax().item(): 1.0} if labels == "argmax" else ref_filtered_law(
            z[i], *(SERVED if labels == "served" else (1.0, 1.0, 0)))
        pi = [law.get(c, 0.0) for c in cand]
        inside += z[i].argmax().item() in cand
        slot = {"selector": w[i].item() * -sum(p * log_sel[k].item() for k, p in enumerate(pi)),
                "selector_weight": w[i].item() * sum(pi)}
        got = one_slot(view, sel, cfg, h, g_t, prev, w, i)
        for key, value in slot.items():
            assert abs(got[key].item() - value) < 1e-5 * (1 + abs(value)), \
                f"{labels} labels, slot {i}: {key} {got[key].item()} != loop {value}"
            want[key] += value
    got = slot_sums(view, sel, cfg, h, g_t, prev, w)
    for key, value in want.items():
        assert abs(got[key].item() - value) < 1e-5 * (1 + abs(value)), \
            f"{labels} labels, {n} slots: {key} {got[key].item()} != loop {value}"
    assert 0 < inside < n, f"{inside} of {n} labels among the candidates: need slots both in and out of C"


def test_slot_k_learns_the_target_logits_at_a_plus_k_minus_1(target, batch, monkeypatch):
    drafter = make_drafter()
    G = 10 * torch.randn(2, S, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = with_last_hidden(batch, G)
    kl = {}
    for shift in (-1, 0, 1):
        monkeypatch.setattr(drafter, "forward", echo_forward(G, shift))
        _, stats = loss_and_stats(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID)
        kl[shift] = stats["unary_loss"]
    assert kl[0] < 1e-6, f"KL is {kl[0]:.3g} for a drafter that outputs the target logits at a+k-1"
    assert min(kl[-1], kl[1]) > 0.05, f"KL for a drafter off by one position is only {kl}"


def drafter_grads(target, batch, randomize=True, codebooks="free", **kw):
    """Gradients of the loss; top-K = V puts every label among the candidates."""
    drafter = make_drafter(randomize=randomize, selector_top_k=V, selector_codebooks=codebooks)
    loss, stats = loss_and_stats(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID, cfg=LossConfig(**kw))
    assert stats["selector_loss"] > 0, "no label in the top-K: the selector loss has no gradient to test"
    loss.backward()
    return {name: p.grad for name, p in drafter.named_parameters()}


def test_gradients_reach_backbone_convolution_and_selector(target, batch):
    grads = drafter_grads(target, batch)
    dead = [name for name, g in grads.items() if g is None or not g.any()]
    assert not dead, f"no gradient reaches {dead}"
    # at init the successor codebook is 0, so only it gets a selector gradient on step 1
    # (A and P enter every score multiplied by it); the convolution learns from step 1
    grads = drafter_grads(target, batch, randomize=False)
    dead = sorted(name for name, g in grads.items() if g is None or not g.any())
    want = ["candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook"]
    assert dead == want, f"parameters without gradient at init: {dead}, expected exactly {want}"
    # factored codebooks: the loss reads the target's embedding through W_A and W_B; at init
    # W_B = 0 plays the successor codebook's part
    for randomize, want in ((True, []), (False, ["candidate_selector.hidden_projection.weight",
                                                 "candidate_selector.predecessor_projection.weight"])):
        grads = drafter_grads(target, batch, randomize=randomize, codebooks="factored")
        dead = sorted(name for name, g in grads.items() if g is None or not g.any())
        assert dead == want, f"factored, randomize={randomize}: no gradient reaches {dead}, expected {want}"


def test_selector_loss_trains_the_backbone_too(target, batch):
    """Coupled training (§6): L_sel's gradient reaches the backbone through h and the unary
    logits, so α > 0 moves every backbone gradient away from the unary-only one."""
    unary_only = drafter_grads(target, batch, alpha=0.0)
    coupled = drafter_grads(target, batch)
    backbone = [name for name in unary_only if not name.startswith("candidate_selector.")]
    coupling = min(max_diff(coupled[name], unary_only[name]) for name in backbone)
    assert coupling > 1e-6, f"the selector loss moves some backbone gradient by only {coupling:.3g}"


def test_target_logits_are_lm_head_of_the_last_hidden_state(target, batch):
    """The loss computes the target's logits itself, as lm_head(hidden_states[-1]) at t - 1:
    HF's last hidden state must be the one after the final norm."""
    got, want = target.lm_head(batch["hidden_states"][-1]), model_logits(target, batch)
    assert max_diff(got, want) < 1e-12, \
        f"lm_head(hidden_states[-1]) differs from the target's own logits by {max_diff(got, want):.3g}"


def loss_and_grads(drafter, target, batch, **kw):
    drafter.zero_grad(set_to_none=True)
    loss, stats = loss_and_stats(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID, cfg=LossConfig(**kw))
    loss.backward()
    return loss.item(), stats, {name: p.grad.clone() for name, p in drafter.named_parameters()}


def assert_same_loss(got, want, what, tol):
    (loss, stats, grads), (want_loss, want_stats, want_grads) = got, want
    assert abs(loss - want_loss) < tol * (1 + abs(want_loss)), f"{what}: loss {loss} != {want_loss}"
    for key, value in want_stats.items():
        diff = max_diff(torch.tensor(stats[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64))
        assert diff < tol, f"{what}: stats[{key!r}] {stats[key]} != {value}"
    for name, g in want_grads.items():
        assert max_diff(grads[name], g) < tol * (1 + g.abs().max().item()), \
            f"{what}: gradient of {name} differs by {max_diff(grads[name], g):.3g}"


def test_chunked_loss_equals_unchunked(target, batch, monkeypatch):
    """Chunks of counted slots, recomputed in backward: loss, stats and every gradient equal
    the all-at-once computation, also for chunk sizes that do not divide the counted slots
    (the test anchors leave slots of both rows uncounted). In float64 to 1e-10, then with
    the real fp32 edge scores to fp32 rounding."""
    drafter = make_drafter(randomize=True, selector_top_k=WIDE_K)
    n = len(counted_slots(batch, ANCHORS, VALID))
    float64_scores(monkeypatch, drafter.candidate_selector)
    for kw in (dict(loss_type="kl"),
               dict(loss_type="ce", selector_labels="soft", soft_labels_at=SERVED)):
        want = loss_and_grads(drafter, target, batch, **kw)
        for chunk in (1, 5, n - 1, n, 10 * n):
            assert_same_loss(loss_and_grads(drafter, target, batch, chunk_size=chunk, **kw), want,
                             f"{kw}, chunk_size {chunk} of {n} slots", 1e-10)
    monkeypatch.undo()
    assert_same_loss(loss_and_grads(drafter, target, batch, chunk_size=5), loss_and_grads(drafter, target, batch),
                     "fp32 edge scores, chunk_size 5", 1e-6)


def test_only_a_loss_of_several_chunks_is_recomputed_in_backward(target, batch):
    """The formula runs once per chunk in forward and, only when the slots take more than one chunk, once more per
    chunk in backward: a single chunk's recompute would bound no memory (its backward comes first) and cost a
    forward of the vocabulary-wide products."""
    drafter = make_drafter(randomize=True)
    view, n = target_view(drafter.config, target), len(counted_slots(batch, ANCHORS, VALID))
    for chunk, want in ((None, 1), (n, 1), (10 * n, 1), (n - 1, 4), (5, 2 * math.ceil(n / 5))):
        calls = []
        counting = lambda *args: calls.append(1) or slot_sums(*args)
        sums, _ = loss_sums(drafter, view, loss_batch(batch), LossConfig(chunk_size=chunk), counting)
        sum(v for k, v in sums.items() if not k.endswith("weight")).backward()
        assert len(calls) == want, f"chunk_size {chunk} of {n} slots: the formula ran {len(calls)} times, want {want}"


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # torch's own, inductor imports it
def test_the_compiled_loss_equals_the_eager_formula(target):
    """train.py runs slot_sums under torch.compile(dynamic=True): inductor's kernels (its fused softmaxes,
    its own reduction order) must give the eager formula's sums and gradient in h to fp32 rounding: the unary
    KL and the selector's terms, at two slot counts, in float32. One configuration: each compile costs seconds
    on a 2-core CPU, and the eager formula's other settings are held to loops above."""
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler (g++ or c++) on PATH: torch.compile's CPU backend cannot build its kernels")
    target32, drafter = make_target(dtype=torch.float32), make_drafter(randomize=True).float()
    view, compiled = target_view(drafter.config, target32), torch.compile(slot_sums, dynamic=True)
    g = torch.Generator().manual_seed(5)

    def sums_and_grad(fn, sel, cfg, h, *rest):
        h = h.clone().requires_grad_()
        sums = fn(view, sel, cfg, h, *rest)
        grad, = torch.autograd.grad(sum(v for v in sums.values() if v.requires_grad), h)
        return {k: v.item() for k, v in sums.items()}, grad

    for cfg, sel in ((LossConfig(loss_type="kl"), drafter.candidate_selector),):
        for n in (7, 12):
            h = 10 * torch.randn(n, H, generator=g)
            g_t = h + 2 * torch.randn(n, H, generator=g)  # near h: the label among the top-5 in some slots
            inputs = (sel, cfg, h, g_t, torch.randint(0, V, (n,), generator=g), torch.rand(n, generator=g))
            (got, got_grad), (want, want_grad) = sums_and_grad(compiled, *inputs), sums_and_grad(slot_sums, *inputs)
            where = f"{cfg.loss_type}, selector {'off' if sel is None else 'on'}, {n} slots"
            assert set(got) == set(want), f"{where}: compiled sums {sorted(got)}, eager {sorted(want)}"
            for key, value in want.items():
                assert abs(got[key] - value) <= 1e-5 * abs(value), \
                    f"{where}: compiled {key} {got[key]} != eager {value} (off by {abs(got[key] - value):.3g})"
            assert max_diff(got_grad, want_grad) <= 1e-5 * want_grad.abs().max(), \
                f"{where}: the compiled gradient in h differs by {max_diff(got_grad, want_grad):.3g}"
            assert sel is None or want["selector"] > 0, f"{where}: no label among the candidates, nothing compared"


def test_the_loss_skips_the_metrics(target, batch, monkeypatch):
    """dflash2_loss: no walk, no host sync; the loss terms come back as detached tensors."""
    drafter = make_drafter(randomize=True)
    want = loss_and_stats(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID)[1]

    def no_walk(*args, **kw):
        raise AssertionError("dflash2_loss walked the selector")
    monkeypatch.setattr(drafter.candidate_selector, "walk", no_walk)
    view = target_view(drafter.config, target)
    _, stats, _ = dflash2_loss(drafter, view, loss_batch(batch), LossConfig(chunk_size=3))
    assert set(stats) == {"loss", "unary_loss", "selector_loss"}, f"stats of a training step: {sorted(stats)}"
    for key, value in stats.items():
        assert torch.is_tensor(value) and not value.requires_grad and abs(value.item() - want[key]) < 1e-10, \
            f"{key}: {value!r} should be a detached tensor equal to {want[key]}"


def test_grad_checkpoint_gives_the_same_gradients(target, batch):
    """drafter.grad_checkpoint recomputes each draft layer in backward (its forward runs
    twice) and changes nothing else."""
    drafter = make_drafter(randomize=True, selector_top_k=V)
    calls = []
    drafter.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))
    want = loss_and_grads(drafter, target, batch)
    drafter.grad_checkpoint = True
    got = loss_and_grads(drafter, target, batch)
    assert_same_loss(got, want, "grad_checkpoint", 1e-12)
    calls.clear()
    dflash2_loss(drafter, target_view(drafter.config, target), loss_batch(batch))[0].backward()
    assert len(calls) == 2, f"layer 0 ran {len(calls)} times with grad_checkpoint, want 2 (forward + recompute)"


def test_drafter_overfits_a_fixed_batch():
    target = make_target(lm_head_scale=10.0)  # peaked target logits: room for the KL to fall
    batch = make_batch(target)
    anchors, valid = sample_anchors(batch["loss_mask"], 8, torch.Generator().manual_seed(0))
    drafter = make_drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-3, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss, _ = loss_and_stats(drafter, target, batch, anchors=anchors, anchor_valid=valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], f"loss went {losses[0]:.3f} -> {losses[-1]:.3f} in 50 steps (want < 30%)"


# -----------------------------------------------------------------------------
# sampled drafts of a DFlash drafter; RoPE tables of a row past the original context


def qwen3_target(seed=0):
    """A random float64 Qwen3 of make_config's target shape, frozen, built from transformers alone."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).double().eval().requires_grad_(False)


def test_a_dflash_drafters_sampled_drafts_follow_the_generator_alone(monkeypatch):
    """Selector off, T = 1: two spec_generate calls with equally seeded generators, the global generator seeded
    differently before each, draw the same drafts, accept the same and return the same tokens."""
    from dflash2 import spec_generate
    target, drafter = qwen3_target(), make_drafter(randomize=True, selector_top_k=0)
    propose, drafts = drafter.propose, []

    def recording(*args, **kwargs):
        path, cand, q = propose(*args, **kwargs)
        drafts.append(path.tolist())
        return path, cand, q
    monkeypatch.setattr(drafter, "propose", recording)
    runs = []
    for global_seed in (1, 2):
        drafts.clear()
        torch.manual_seed(global_seed)
        ids, stats = spec_generate(drafter, target, torch.tensor([[5, 9, 3, 7]]), 16, temperature=1.0,
                                   generator=torch.Generator().manual_seed(7))
        runs.append({"drafts": list(drafts), "acceptance lengths": stats.acceptance_lengths, "tokens": ids.tolist()})
    for what in runs[0]:
        assert runs[0][what] == runs[1][what], \
            f"{what} of one generator seed, global seeds 1 and 2: {runs[0][what]} != {runs[1][what]}"


def test_a_training_row_past_the_original_context_takes_the_tables_decoding_there_takes():
    """A long-RoPE-like type (short factors while every position is below L0, long ones and a larger cos/sin scale
    once one reaches it). A row of L0 + 4 tokens: the block that crosses L0 drafts in training what decoding
    drafts at its positions, and a block that ends before L0 drafts with the long tables too (the row's positions
    reach past L0); a row shorter than L0 drafts with the short tables."""
    from dflash2 import draft_forward, plain_rope
    L0 = 12
    drafter = make_drafter(randomize=True)
    short = plain_rope(drafter.config)[0]
    tables = {"short": lambda c, positions: (short, 1.0), "long": lambda c, positions: (short / 4, 1.2)}
    tables["by position"] = lambda c, positions: tables["long" if int(positions.max()) >= L0 else "short"](c, positions)
    g = torch.Generator().manual_seed(0)
    W_in = torch.randn(V, H, generator=g, dtype=torch.float64)
    view = TargetView(W_in, lambda ids: F.embedding(ids, W_in), lambda x: x @ W_in.T)
    S = L0 + 4
    ids = torch.randint(0, V - 1, (1, S), generator=g)
    f = torch.randn(1, S, len(LAYER_IDS) * H, generator=g, dtype=torch.float64)
    last_hidden = torch.randn(1, S, H, generator=g, dtype=torch.float64)

    def trained(rope, anchors, length=S):
        drafter.rope = tables[rope]
        ones = torch.ones(1, length, dtype=torch.long)
        batch = Batch(ids[:, :length], ones, ones, f[:, :length], last_hidden[:, :length], torch.tensor([anchors]),
                      torch.ones(1, len(anchors), dtype=torch.bool))
        with torch.no_grad():
            return loss_sums(drafter, view, batch)[1].h[0]            # (N, B-1, H)

    crossing = L0 - 2
    drafter.rope = tables["by position"]
    with torch.no_grad():
        decoded = draft_forward(drafter, view, ids[0, crossing:crossing + 1], f[:, :crossing],
                                DraftCache(drafter.config.num_layers))[0][0]
    in_training = trained("by position", [2, crossing])[1]
    assert max_diff(in_training, decoded) < 1e-10, f"the block at {crossing} (L0 = {L0}) drafts in training " \
        f"{max_diff(in_training, decoded):.3g} away from decoding at its positions"
    for anchors, length, want in (([2], S, "long"), ([2], L0 - 2, "short")):
        got, expected = trained("by position", anchors, length), trained(want, anchors, length)
        assert torch.equal(got, expected), f"a row of {length} tokens (L0 = {L0}), block at {anchors}: " \
            f"{max_diff(got, expected):.3g} away from the {want} tables"
