"""
A second implementation of the DFlash2 inference path in NumPy, written from ALGORITHM.md
(section numbers below point there), to show that the write-up and the golden tensors are
enough to port DFlash2: load a §7 checkpoint, run the drafter (§1 KV injection, RoPE,
q/k norm, GQA, SwiGLU; §2 local convolution), score and walk the candidates (§3), and
replay a greedy §5 loop against recorded target logits (§4). No torch on this path.

Computes in float64 (DTYPE), so the golden fp32 tensors are matched to their own rounding.
Notation: ALGORITHM.md's legend. Check against golden/: python -m pytest test_golden.py -q
"""
import json
import os

import numpy as np
from safetensors.numpy import load_file

DTYPE = np.float64


def load_drafter(path):
    """-> (cfg, weights) from a checkpoint folder (§7). cfg holds what the forward needs."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    d = raw["dflash_config"]
    cfg = dict(H=raw["hidden_size"], nh=raw["num_attention_heads"], nkv=raw["num_key_value_heads"],
               hd=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
               eps=raw["rms_norm_eps"], theta=raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"],
               Ld=raw["num_hidden_layers"], B=d["block_size"], mask_id=d["mask_token_id"],
               layer_ids=d["target_layer_ids"], Kc=d.get("conv_kernel_size", 0), G=d.get("conv_group_size", 1),
               K=d.get("selector_top_k", 0))
    weights = {k: v.astype(DTYPE) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    return cfg, weights


def load_target_tables(path):
    """The two target tensors the drafter borrows (§1): input embedding and lm_head."""
    w = load_file(os.path.join(path, "model.safetensors"))
    return w["model.embed_tokens.weight"].astype(DTYPE), w["lm_head.weight"].astype(DTYPE)


# -----------------------------------------------------------------------------
# §1 pieces


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, pos, theta):
    """x (b, L, n, hd), pos (b, L). Rotate-half with the half-table repeated (§1)."""
    hd = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=DTYPE) / hd)
    phi = pos[..., None].astype(DTYPE) * inv_freq                    # (b, L, hd/2)
    cos = np.concatenate([np.cos(phi), np.cos(phi)], -1)[:, :, None]  # (b, L, 1, hd)
    sin = np.concatenate([np.sin(phi), np.sin(phi)], -1)[:, :, None]
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rotated * sin


def heads(y, n):
    return y.reshape(*y.shape[:-1], n, -1)  # head-major: head n' owns channels n'·hd..(n'+1)·hd-1


def attention(W, p, u, ctx, pos, ctx_pos, mask, cfg):
    """KV injection (§1): queries from the block u (b, T, H); keys/values [context ; block]
    from the same projections; mask (b, 1, T, S+T) bool or None (all visible)."""
    nh, nkv, eps, theta = cfg["nh"], cfg["nkv"], cfg["eps"], cfg["theta"]
    proj = lambda x, name: x @ W[p + name + ".weight"].T
    q = rope(rms_norm(heads(proj(u, "q_proj"), nh), W[p + "q_norm.weight"], eps), pos, theta)
    k_ctx = rope(rms_norm(heads(proj(ctx, "k_proj"), nkv), W[p + "k_norm.weight"], eps), ctx_pos, theta)
    k_blk = rope(rms_norm(heads(proj(u, "k_proj"), nkv), W[p + "k_norm.weight"], eps), pos, theta)
    k = np.concatenate([k_ctx, k_blk], 1).transpose(0, 2, 1, 3)        # (b, nkv, S+T, hd)
    v = np.concatenate([heads(proj(ctx, "v_proj"), nkv), heads(proj(u, "v_proj"), nkv)], 1).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # GQA: kv head n'·nkv/nh
    q = q.transpose(0, 2, 1, 3)                                        # (b, nh, T, hd)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    y = (scores / scores.sum(-1, keepdims=True)) @ v                   # (b, nh, T, hd)
    return proj(y.transpose(0, 2, 1, 3).reshape(*u.shape[:2], -1), "o_proj")


def mlp(W, p, u):
    gate, up = u @ W[p + "gate_proj.weight"].T, u @ W[p + "up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ W[p + "down_proj.weight"].T


# -----------------------------------------------------------------------------
# §2 local convolution


def local_conv(x, delta, base, B):
    """out[i, c] = Σ_τ (base[τ, c] + δ[i, τ, c // G]) · x[i − τ, c], taps zeroed where i mod B < τ.
    x (b, T, H), delta (b, T, Kc, H/G), base (Kc, H)."""
    T, H = x.shape[1:]
    G = H // delta.shape[-1]
    i = np.arange(T)
    out = np.zeros_like(x)
    for tau in range(base.shape[0]):
        shifted = np.zeros_like(x)
        shifted[:, tau:] = x[:, :T - tau]
        shifted *= (i % B >= tau)[:, None]
        out += (base[tau] + np.repeat(delta[:, :, tau], G, axis=-1)) * shifted
    return out


def conv_sublayer(W, p, u, sublayer, cfg, rec, name):
    """u = RMSNorm(h); u' = conv(u, side 0); y = sublayer(u'); y' = conv(y, side 1) -> y'."""
    if not cfg["Kc"]:
        y = sublayer(u)
        rec[name] = y
        return y
    Kc, groups = cfg["Kc"], cfg["H"] // cfg["G"]
    delta = u @ W[p + "kernel_projection.weight"].T                    # [side, tap, group] flattened
    rec["fwd." + p + "delta"] = delta
    delta = delta.reshape(*u.shape[:2], 2, Kc, groups)
    u2 = local_conv(u, delta[:, :, 0], W[p + "base_kernel"][0], cfg["B"])
    y = sublayer(u2)
    y2 = local_conv(y, delta[:, :, 1], W[p + "base_kernel"][1], cfg["B"])
    rec.update({"fwd." + p + "prepare": u2, name: y, "fwd." + p + "finish": y2})
    return y2


def drafter_forward(W, cfg, block_embeds, pos, ctx_features, ctx_pos, mask=None, rec=None):
    """block_embeds (b, T, H) at pos (b, T); ctx_features (b, S, nf·H) at ctx_pos (b, S)
    -> (b, T, H) after the final norm. rec, if given, collects the golden intermediates."""
    rec = {} if rec is None else rec
    eps = cfg["eps"]
    ctx = rms_norm(ctx_features @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    rec["fwd.ctx"] = ctx
    h = block_embeds
    for l in range(cfg["Ld"]):
        p, r = f"layers.{l}.", f"fwd.layers.{l}."
        u = rms_norm(h, W[p + "input_layernorm.weight"], eps)
        rec[r + "attn_norm"] = u
        attn = lambda x: attention(W, p + "self_attn.", x, ctx, pos, ctx_pos, mask, cfg)
        h = h + conv_sublayer(W, p + "attention_conv.", u, attn, cfg, rec, r + "attention")
        u = rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)
        rec[r + "mlp_norm"] = u
        h = h + conv_sublayer(W, p + "mlp_conv.", u, lambda x: mlp(W, p + "mlp.", x), cfg, rec, r + "mlp")
        rec[r + "output"] = h
    return rms_norm(h, W["norm.weight"], eps)


# -----------------------------------------------------------------------------
# §6 block layout and mask (what the training forward reads)


def block_layout(input_ids, anchors, B, mask_id):
    """Blocks [x[a_j], MASK×(B−1)] at positions a_j..a_j+B−1, concatenated -> ids, pos (b, N·B)."""
    b, N = anchors.shape
    ids = np.full((b, N, B), mask_id, dtype=np.int64)
    ids[:, :, 0] = np.take_along_axis(input_ids, anchors, 1)
    pos = anchors[:, :, None] + np.arange(B)
    return ids.reshape(b, N * B), pos.reshape(b, N * B)


def block_mask(anchors, attention_mask, B):
    """(b, 1, N·B, S + N·B): context key s visible iff s < a_j and real; own block fully."""
    b, N = anchors.shape
    S = attention_mask.shape[1]
    ctx = (np.arange(S)[None, None] < anchors[:, :, None]) & attention_mask.astype(bool)[:, None]
    ctx = np.repeat(ctx, B, axis=1)
    blk = np.arange(N * B) // B
    own = np.broadcast_to(blk[:, None] == blk[None, :], (b, N * B, N * B))
    return np.concatenate([ctx, own], -1)[:, None]


# -----------------------------------------------------------------------------
# §3 candidate selector


def candidates(unary, K):
    """Top-K by descending logit (stable: the lower id first on an exact tie)."""
    return np.argsort(-unary, axis=-1, kind="stable")[..., :K]


def edge_scores(W, h, unary, prev, cand):
    """S(p, c) = U[c] + Σ_r A[p, r]·P[r]·Bc[c, r], P = h·W_hpᵀ. h (..., H), prev (...), cand (..., K)."""
    P = h @ W["candidate_selector.hidden_projection.weight"].T
    A = W["candidate_selector.predecessor_codebook"][prev]
    Bc = W["candidate_selector.successor_codebook"][cand]
    return np.take_along_axis(unary, cand, -1) + np.einsum("...r,...kr->...k", A * P, Bc)


def walk(W, h, unary, anchor, cand, uniforms=None, temperature=0.0):
    """The §3 walk from the anchor. h (M, B−1, H), unary (M, B−1, V), anchor (M,), cand
    (M, B−1, K). Greedy without uniforms; with uniforms (M, B−1), pick = #{i: cdf_i <= u}.
    -> path (M, B−1), scores (M, B−1, K), q (M, B−1, K)."""
    prev, path, scores, qs = anchor, [], [], []
    for k in range(cand.shape[1]):
        s = edge_scores(W, h[:, k], unary[:, k], prev, cand[:, k])
        if uniforms is None:
            pick = s.argmax(-1)
            q = np.eye(s.shape[-1])[pick]
        else:
            q = np.exp((s - s.max(-1, keepdims=True)) / temperature)
            q /= q.sum(-1, keepdims=True)
            pick = np.minimum((np.cumsum(q, -1) <= uniforms[:, k, None]).sum(-1), s.shape[-1] - 1)
        prev = np.take_along_axis(cand[:, k], pick[:, None], -1)[:, 0]
        path.append(prev), scores.append(s), qs.append(q)
    return np.stack(path, 1), np.stack(scores, 1), np.stack(qs, 1)


def propose_greedy(W, cfg, h, unary, anchor):
    """T = 0 proposal: the selector walk, or the unary argmax when the selector is off."""
    if not cfg["K"]:
        return unary.argmax(-1)
    return walk(W, h, unary, anchor, candidates(unary, cfg["K"]))[0]


# -----------------------------------------------------------------------------
# §4 greedy verification and the §5 loop, replayed against recorded target calls


def verify_greedy(draft, logits):
    """draft (n,), logits (n+1, V) -> (n_acc, bonus)."""
    g = logits.argmax(-1)
    n_acc = 0
    while n_acc < len(draft) and draft[n_acc] == g[n_acc]:
        n_acc += 1
    return n_acc, int(g[n_acc])


def replay_greedy(W, cfg, embed, lm_head, prompt, calls, max_new_tokens, stop_ids=()):
    """§5 at T = 0 with the target replaced by its recorded answers: calls[c] = (logits
    (n_c, V), features (n_c, nf·H)) of target call c. -> (ids fed per call, tokens, ALs)."""
    B, P = cfg["B"], len(prompt)
    logits, feats = calls[0]
    sent, tokens, als = [np.asarray(prompt)], [int(logits[-1].argmax())], []
    ctx = feats
    done = tokens[-1] in stop_ids or len(tokens) >= max_new_tokens
    while not done:
        a = P + len(tokens) - 1                         # the anchor's position; ctx covers 0..a−1
        block = np.array([tokens[-1]] + [cfg["mask_id"]] * (B - 1))
        h = drafter_forward(W, cfg, embed[block][None], np.arange(a, a + B)[None], ctx[None], np.arange(a)[None])
        h = h[:, 1:]
        path = propose_greedy(W, cfg, h, h @ lm_head.T, block[:1])[0]
        n = min(B - 1, max_new_tokens - len(tokens) - 1)
        draft = path[:n]
        sent.append(np.concatenate([block[:1], draft]))
        logits, feats = calls[len(sent) - 1]
        n_acc, bonus = verify_greedy(draft, logits)
        ctx = np.concatenate([ctx, feats[:n_acc + 1]])   # the anchor and the accepted drafts
        before = len(tokens)
        for tok in [int(t) for t in draft[:n_acc]] + [bonus]:
            tokens.append(tok)
            if tok in stop_ids or len(tokens) >= max_new_tokens:
                done = True
                break
        als.append(len(tokens) - before)
    return sent, np.array(tokens), np.array(als)
