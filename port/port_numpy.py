"""
DFlash2 in NumPy, written from ALGORITHM.md (section numbers below point there) to show
that the write-up and the golden tensors are enough to port DFlash2. No torch.

Covered: loading a §7 checkpoint (fp32 or bf16 safetensors, DFlash2 or v1); the drafter on
one block against the context it may see (§1 KV injection, RoPE, q/k norm, GQA, SwiGLU;
§2 local convolution); the candidate walk (§3), greedy and sampled; verification (§4) and
the §5 loop, replayed against recorded target answers with recorded uniforms; the §6
training forward (anchors, block mask, per-slot losses, the loss variants, the metrics, the
data-parallel normalisation). Not covered: gradients.

A serving engine drafts one block at a time, so this port does too, in training as well:
block j of a row is drafted alone against the context rows its §6 mask shows it, which is
what the packed forward with the block mask computes. Everything is float64 (DTYPE), so the
golden fp32 tensors are matched to their own rounding. Check: python -m pytest tests/test_golden.py -q
"""
import json
import os

import numpy as np

DTYPE = np.float64


# -----------------------------------------------------------------------------
# §7 checkpoints


def read_safetensors(path):
    """{name: array} of a .safetensors file: 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian data."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        raw = data[e["data_offsets"][0]:e["data_offsets"][1]]
        if e["dtype"] == "BF16":  # the top half of an fp32
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, {"F32": "<f4", "F16": "<f2", "I64": "<i8", "BOOL": "?"}[e["dtype"]])
        out[name] = a.reshape(e["shape"])
    return out


def load_drafter(path):
    """-> (cfg, weights) from a checkpoint folder. A v1 checkpoint has no convolution (Kc 0)
    and no selector (K 0)."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    d = raw["dflash_config"]
    cfg = dict(H=raw["hidden_size"], nh=raw["num_attention_heads"], nkv=raw["num_key_value_heads"],
               hd=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
               eps=raw["rms_norm_eps"], theta=raw["rope_parameters"]["rope_theta"], Ld=raw["num_hidden_layers"],
               B=d["block_size"], mask_id=d["mask_token_id"], layer_ids=d["target_layer_ids"],
               Kc=d.get("conv_kernel_size", 0), G=d.get("conv_group_size", 1), K=d.get("selector_top_k", 0))
    weights = {k: v.astype(DTYPE) for k, v in read_safetensors(os.path.join(path, "model.safetensors")).items()}
    return cfg, weights


def load_target_tables(path):
    """The two target tensors the drafter borrows (§1): input embedding and lm_head."""
    w = read_safetensors(os.path.join(path, "model.safetensors"))
    return w["model.embed_tokens.weight"].astype(DTYPE), w["lm_head.weight"].astype(DTYPE)


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(DTYPE)


# -----------------------------------------------------------------------------
# §1, §2: the drafter on one block


def rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta):
    """x (L, n, hd) at integer positions (L,): rotate-half with the half-table repeated."""
    hd = x.shape[-1]
    phi = positions[:, None] * theta ** (-np.arange(hd // 2) * 2.0 / hd)       # (L, hd/2)
    cos = np.concatenate([np.cos(phi), np.cos(phi)], -1)[:, None]
    sin = np.concatenate([np.sin(phi), np.sin(phi)], -1)[:, None]
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def project_context(W, cfg, features):
    """ctx[s] = RMSNorm_hidden_norm(f[s]·W_fcᵀ), features (S, nf·H) -> (S, H)."""
    return rms_norm(features @ W["fc.weight"].T, W["hidden_norm.weight"], cfg["eps"])


def attention(W, p, cfg, u, positions, ctx, ctx_positions):
    """Queries from the block u (B, H); keys/values [context ; block] from the same projections."""
    nh, nkv, hd, eps, theta = cfg["nh"], cfg["nkv"], cfg["hd"], cfg["eps"], cfg["theta"]
    split = lambda y, n: y.reshape(len(y), n, hd)
    q = rope(rms_norm(split(u @ W[p + "q_proj.weight"].T, nh), W[p + "q_norm.weight"], eps), positions, theta)
    key = lambda x, pos: rope(rms_norm(split(x @ W[p + "k_proj.weight"].T, nkv), W[p + "k_norm.weight"], eps), pos, theta)
    keys = np.concatenate([key(ctx, ctx_positions), key(u, positions)])        # (S' + B, nkv, hd)
    values = np.concatenate([split(ctx @ W[p + "v_proj.weight"].T, nkv), split(u @ W[p + "v_proj.weight"].T, nkv)])
    out = np.empty((len(u), nh, hd))
    for head in range(nh):
        kv = head // (nh // nkv)
        scores = q[:, head] @ keys[:, kv].T / np.sqrt(hd)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = weights / weights.sum(-1, keepdims=True) @ values[:, kv]
    return out.reshape(len(u), nh * hd) @ W[p + "o_proj.weight"].T


def mlp(W, p, u):
    gate = u @ W[p + "gate_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * (u @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def conv(x, base, delta, G):
    """out[i, c] = Σ_{τ=0}^{min(Kc−1, i)} (base[τ, c] + δ[i, τ, ⌊c/G⌋])·x[i−τ, c] over one block.
    x (B, H), base (Kc, H), delta (B, Kc, H/G)."""
    out = np.zeros_like(x)
    for i in range(len(x)):
        for tau in range(min(len(base) - 1, i) + 1):
            out[i] += (base[tau] + np.repeat(delta[i, tau], G)) * x[i - tau]
    return out


def around(W, p, cfg, u, sublayer, rec, name):
    """§2 placement: u' = conv(u, side 0); y = sublayer(u'); y' = conv(y, side 1) -> y'."""
    if not cfg["Kc"]:
        rec[name] = sublayer(u)
        return rec[name]
    delta_all = u @ W[p + "kernel_projection.weight"].T                       # [side, tap, group]
    delta = delta_all.reshape(len(u), 2, cfg["Kc"], cfg["H"] // cfg["G"])
    base = W[p + "base_kernel"]
    rec[p + "delta"] = delta_all
    rec[p + "prepare"] = conv(u, base[0], delta[:, 0], cfg["G"])
    rec[name] = sublayer(rec[p + "prepare"])
    rec[p + "finish"] = conv(rec[name], base[1], delta[:, 1], cfg["G"])
    return rec[p + "finish"]


def draft_block(W, cfg, embeds, positions, ctx, ctx_positions):
    """One block (B, H) of embeddings at positions (B,) against the projected context rows
    (S', H) it may see -> (hidden (B, H) after the final norm, {intermediate: (B, ·)})."""
    rec, eps, h = {}, cfg["eps"], embeds
    for l in range(cfg["Ld"]):
        p = f"layers.{l}."
        rec[p + "attn_norm"] = u = rms_norm(h, W[p + "input_layernorm.weight"], eps)
        attend = lambda x: attention(W, p + "self_attn.", cfg, x, positions, ctx, ctx_positions)
        h = h + around(W, p + "attention_conv.", cfg, u, attend, rec, p + "attention")
        rec[p + "mlp_norm"] = u = rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)
        h = h + around(W, p + "mlp_conv.", cfg, u, lambda x: mlp(W, p + "mlp.", x), rec, p + "mlp")
        rec[p + "output"] = h
    return rms_norm(h, W["norm.weight"], eps), rec


# -----------------------------------------------------------------------------
# §3 candidate walk; §4 verification laws


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def top_k(logits, K):
    """The K largest, by descending logit (lower id first on an exact tie)."""
    return np.argsort(-logits, kind="stable")[:K]


def edge_scores(W, h, U, prev, C):
    """E(prev, c) = U[c] + Σ_r A[prev, r]·P[r]·Bc[c, r], P = W_hp·h, for the candidates C (K,)."""
    P = W["candidate_selector.hidden_projection.weight"] @ h
    A = W["candidate_selector.predecessor_codebook"][prev]
    return U[C] + W["candidate_selector.successor_codebook"][C] @ (A * P)


def inverse_cdf(probs, u):
    """§8: the first index whose cumulative probability exceeds u."""
    return min(int(np.sum(np.cumsum(probs) <= u)), len(probs) - 1)


def sampling_law(z, T, top_p=1.0, top_k_=0):
    """§4: softmax(z/T); top-k keeps every logit >= the k-th largest; top-p then keeps a token
    iff the mass before it is < top_p, measured on the top-k survivors' renormalised law sorted
    descending, equal probabilities in id order; renormalised."""
    x = z / T
    if top_k_:
        x = np.where(x >= np.sort(x)[-top_k_], x, -np.inf)
    p = softmax(x)
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0
        p /= p.sum()
    return p


def residual_law(p, q):
    """§4: normalise(max(0, p − q)), or p where that is all 0 (p = q: nothing is ever rejected)."""
    r = np.maximum(p - q, 0)
    return r / r.sum() if r.sum() > 0 else p


def walk(W, h, U, anchor, K, T=0.0, uniforms=None):
    """§3 from the anchor over one block's drafted slots: h (n, H), U (n, V).
    -> path (n,), candidates (n, K), scores (n, K), q (n, K)."""
    prev, path, cands, scores, qs = anchor, [], [], [], []
    for k in range(len(U)):
        C = top_k(U[k], K)
        s = edge_scores(W, h[k], U[k], prev, C)
        if T == 0:
            pick, q = int(np.argmax(s)), np.eye(K)[np.argmax(s)]
        else:
            q = softmax(s / T)
            pick = inverse_cdf(q, uniforms[k])
        prev = int(C[pick])
        path.append(prev), cands.append(C), scores.append(s), qs.append(q)
    return np.array(path), np.array(cands), np.array(scores), np.array(qs)


def propose(W, cfg, h, U, anchor, sampling=None, uniforms=None):
    """The block's drafts: the walk, or with the selector off the unary argmax (T = 0) or a
    draw from the unary sampling law (T > 0). -> (path, {candidates, walk_scores, q})."""
    if cfg["K"]:
        T = sampling["temperature"] if sampling else 0.0
        path, cands, scores, q = walk(W, h, U, anchor, cfg["K"], T, uniforms)
        return path, dict(candidates=cands, walk_scores=scores, q=q)
    if not sampling:
        return U.argmax(-1), {}
    q = np.array([sampling_law(u, sampling["temperature"], sampling["top_p"], sampling["top_k"]) for u in U])
    return np.array([inverse_cdf(qk, uk) for qk, uk in zip(q, uniforms)]), dict(q=q)


def verify(draft, logits, sampling=None, q=None, candidates=None, u_accept=None, u_bonus=None):
    """§4 on the target's logits (n+1, V) -> (n_accepted, bonus, records of the sampled case)."""
    if not sampling:
        g = logits.argmax(-1)
        n_acc = 0
        while n_acc < len(draft) and draft[n_acc] == g[n_acc]:
            n_acc += 1
        return n_acc, int(g[n_acc]), {}
    V = logits.shape[-1]
    p = np.array([sampling_law(z, sampling["temperature"], sampling["top_p"], sampling["top_k"]) for z in logits])
    qv = np.zeros((len(draft), V))
    for m in range(len(draft)):
        qv[m, candidates[m] if candidates is not None else np.arange(V)] = q[m]
    ratios, n_acc = -np.ones(len(u_accept)), len(draft)
    for m, d in enumerate(draft):
        ratios[m] = min(1.0, p[m, d] / qv[m, d]) if p[m, d] > 0 else 0.0
        if not u_accept[m] < ratios[m]:
            n_acc = m
            break
    law = residual_law(p[n_acc], qv[n_acc]) if n_acc < len(draft) else p[n_acc]
    return n_acc, inverse_cdf(law, u_bonus), dict(p=p, accept_probability=ratios, bonus_law=law)


# -----------------------------------------------------------------------------
# §5: the loop, with the target's answers replayed from a recording


def replay(W, cfg, embed, lm_head, prompt, calls, max_new_tokens, sampling=None, uniforms=None, stop_ids=()):
    """calls[c] = (ids (n_c,), logits (n_c, V), features (n_c, nf·H)) of target call c;
    sampling = None (greedy) or {temperature, top_p, top_k} with uniforms {u_first, u_walk[c, k−1],
    u_accept[c, m], u_bonus[c]} (c the cycle). The drafter's context is recomputed every cycle
    (§5: same numbers as the cache). The replay stops where it would send the target ids the
    recording has no answer for. -> (ids sent per call, tokens, {record: per-cycle list})."""
    B, P = cfg["B"], len(prompt)
    sent, (_, logits, features) = [np.asarray(prompt)], calls[0]
    if sampling:
        law = sampling_law(logits[-1], sampling["temperature"], sampling["top_p"], sampling["top_k"])
        tokens = [inverse_cdf(law, uniforms["u_first"])]          # the filtered p, as every draw from the target
    else:
        tokens = [int(logits[-1].argmax())]
    context, held, target_len, rec = features, 0, P, {}
    keep = lambda **values: [rec.setdefault(k, []).append(v) for k, v in values.items()]
    done = tokens[0] in stop_ids or max_new_tokens == 1
    while not done:
        c = len(sent) - 1
        a = P + len(tokens) - 1                          # the anchor's position; the context is 0..a−1
        block = np.array([tokens[-1]] + [cfg["mask_id"]] * (B - 1))
        positions = np.arange(a, a + B)
        h = draft_block(W, cfg, embed[block], positions, project_context(W, cfg, context[:a]), np.arange(a))[0][1:]
        U = h @ lm_head.T
        path, walked = propose(W, cfg, h, U, block[0], sampling, uniforms["u_walk"][c] if sampling else None)
        n = min(B - 1, max_new_tokens - len(tokens) - 1)   # n = 0: the pass above still ran, its drafts are all cut
        draft = path[:n]
        keep(anchor_pos=a, block_pos=positions, ctx_new_pos=np.arange(held, a), draft_cache_lengths=a, unary=U,
             drafts=np.concatenate([draft, -np.ones(B - 1 - n, int)]), **walked)
        held = a
        sent.append(np.concatenate([block[:1], draft]))
        if len(sent) > len(calls) or not np.array_equal(sent[-1], calls[len(sent) - 1][0]):
            break
        _, logits, features = calls[len(sent) - 1]
        target_len += n + 1
        extra = dict(q=walked.get("q"), candidates=walked.get("candidates"), u_accept=uniforms["u_accept"][c],
                     u_bonus=uniforms["u_bonus"][c]) if sampling else {}
        n_acc, bonus, checked = verify(draft, logits, sampling, **extra)
        target_len -= n - n_acc                          # roll back the rejected drafts
        context = np.concatenate([context, features[:n_acc + 1]])   # the anchor and the accepted drafts
        before = len(tokens)
        for t in [int(t) for t in draft[:n_acc]] + [bonus]:     # commit one at a time: stop right after a stop token
            tokens.append(t)
            if t in stop_ids or len(tokens) == max_new_tokens:
                done = True
                break
        keep(n_accepted=n_acc, bonus=bonus, target_cache_lengths=target_len, acceptance_lengths=len(tokens) - before,
             **checked)
    return sent, np.array(tokens), rec


# -----------------------------------------------------------------------------
# §6 training forward: rules, anchors, block mask, losses, metrics


def default_target_layer_ids(L):
    nf = max(1, min(5, L - 3))
    return [max(0, min(L // 2, L - 2))] if nf == 1 else [round(1 + e * (L - 4) / (nf - 1)) for e in range(nf)]


def default_gamma(B):
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(B, B / 2)


def eligible_anchors(loss_mask):
    """(b, S) bool: a may be an anchor iff loss_mask[a] = loss_mask[a+1] = 1 (a+1 < S)."""
    out = np.zeros(loss_mask.shape, bool)
    out[:, :-1] = (loss_mask[:, :-1] == 1) & (loss_mask[:, 1:] == 1)
    return out


def anchors_from_draws(draw_order, max_anchors):
    """Each row's first max_anchors draws, sorted; rows padded with invalid anchors at 0 to
    N = the largest count (at least 1). -> anchors, valid (b, N)."""
    rows = [np.sort(o[o >= 0][:max_anchors]) for o in draw_order]
    N = max(1, max(len(r) for r in rows))
    anchors, valid = np.zeros((len(rows), N), np.int64), np.zeros((len(rows), N), bool)
    for i, r in enumerate(rows):
        anchors[i, :len(r)], valid[i, :len(r)] = r, True
    return anchors, valid


def block_mask(anchors, attention_mask, B):
    """(b, 1, N·B, S + N·B): a query of block j sees context key s iff s < a_j and
    attention_mask[s] = 1, and every key of block j."""
    b, N = anchors.shape
    S = attention_mask.shape[1]
    mask = np.zeros((b, 1, N * B, S + N * B), bool)
    for r in range(b):
        for j in range(N):
            rows = slice(j * B, (j + 1) * B)
            mask[r, 0, rows, :S] = (np.arange(S) < anchors[r, j]) & (attention_mask[r] == 1)
            mask[r, 0, rows, S + j * B:S + (j + 1) * B] = True
    return mask


def training_forward(W, cfg, embed, input_ids, attention_mask, anchors, features):
    """Every block of every row, each against the context its mask row shows it.
    -> block ids, positions (b, N·B), hidden (b, N·B, H), {intermediate: (b, N·B, ·)}, ctx (b, S, H)."""
    B = cfg["B"]
    (b, N), S = anchors.shape, input_ids.shape[1]
    ids, pos = np.full((b, N * B), cfg["mask_id"]), np.zeros((b, N * B), np.int64)
    hidden, rec = np.zeros((b, N * B, cfg["H"])), {}
    ctx = np.stack([project_context(W, cfg, f) for f in features])
    for r in range(b):
        for j in range(N):
            a, rows = anchors[r, j], slice(j * B, (j + 1) * B)
            ids[r, j * B], pos[r, rows] = input_ids[r, a], np.arange(a, a + B)
            seen = np.flatnonzero((np.arange(S) < a) & (attention_mask[r] == 1))
            hidden[r, rows], parts = draft_block(W, cfg, embed[ids[r, rows]], pos[r, rows], ctx[r, seen], seen)
            for name, x in parts.items():
                rec.setdefault(name, np.zeros((b, N * B, x.shape[-1])))[r, rows] = x
    return ids, pos, hidden, rec, ctx


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def slot_terms(W, cfg, h, U, z, prev, soft_labels_at=None):
    """§6 terms of one counted slot: h (H,), U (V,) drafter; z (V,) target logits at t−1.
    The soft labels are p, or §4's law at the setting soft_labels_at = (T, top_p, top_k)."""
    p, logq, y = softmax(z), log_softmax(U), int(np.argmax(z))
    C = top_k(U, cfg["K"]) if cfg["K"] else np.zeros(0, int)
    out = dict(kl=float(np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - logq), 0))), ce=-logq[y],
               p=p, q=softmax(U), y=y, C=C, z=z, U=U)
    if cfg["K"]:
        s = edge_scores(W, h, U, prev, C)
        log_sel = log_softmax(s)
        label = sampling_law(z, *soft_labels_at) if soft_labels_at else p
        out.update(s=s, label_in_candidates=float(y in C),
                   selector_ce=-log_sel[list(C).index(y)] if y in C else 0.0,
                   candidate_mass=label[C].sum(), selector_soft=-np.sum(label[C] * log_sel))
    return out


def losses(W, cfg, lm_head, hidden, input_ids, loss_mask, anchors, valid, target_logits, soft_labels_at=None):
    """Per-slot records (b, N, B−1) and the slots' terms, for the loss variants and metrics;
    soft_labels_at: slot_terms'."""
    B, (b, N), S = cfg["B"], anchors.shape, input_ids.shape[1]
    slots = {}
    for r in range(b):
        for j in range(N):
            for k in range(1, B):
                t = anchors[r, j] + k
                counted = bool(valid[r, j] and t < S and loss_mask[r, t] == 1)
                rec = dict(counted=counted, prev=-1, k=k)
                if counted:
                    h = hidden[r, j * B + k]
                    rec.update(prev=int(input_ids[r, t - 1]),
                               **slot_terms(W, cfg, h, h @ lm_head.T, target_logits[r, t - 1], input_ids[r, t - 1],
                                            soft_labels_at))
                slots[r, j, k] = rec
    return slots


def slot_table(slots, key, shape, fill=0.0):
    out = np.full(shape, fill, dtype=float if isinstance(fill, float) else int)
    for (r, j, k), s in slots.items():
        if s["counted"] or key == "counted":
            out[r, j, k - 1] = s[key]
    return out


def loss_value(slots, loss_type="kl", labels="argmax", alpha=1.0, gamma=4.0, weight_sums=None):
    """(L, L_unary, L_sel, Σw unary, Σw selector); empty denominators floored at 1e-9.
    weight_sums: the (Σw unary, Σw selector) to divide by instead of this batch's own."""
    num_u = num_s = den_u = den_s = 0.0
    sel_key, mass_key = ("selector_ce", "label_in_candidates") if labels == "argmax" else \
        ("selector_soft", "candidate_mass")
    for s in slots.values():
        if not s["counted"]:
            continue
        w = np.exp(-(s["k"] - 1) / gamma)
        num_u, den_u = num_u + w * s[loss_type], den_u + w
        if "s" in s:
            num_s, den_s = num_s + w * s[sel_key], den_s + w * s[mass_key]
    du, ds = weight_sums if weight_sums is not None else (den_u, den_s)
    unary, selector = num_u / max(du, 1e-9), num_s / max(ds, 1e-9)
    return unary + alpha * selector, unary, selector, den_u, den_s


def metrics(W, cfg, slots, hidden, lm_head, anchors, B, accept_at=(1.0, 1.0, 0)):
    """The §6 metrics table over the counted slots; empty counts are floored at 1. The
    acceptance metrics read §4's p and q at the sampling setting accept_at = (T, top_p, top_k)."""
    (b, N), out = anchors.shape, {}
    counted = lambda r, j, k: slots[r, j, k]["counted"]
    blocks = [(r, j) for r in range(b) for j in range(N) if counted(r, j, 1)]
    every = [s for s in slots.values() if s["counted"]]
    mean = lambda xs: sum(xs) / max(1, len(xs))
    hit = {"unary": lambda s: s["q"].argmax() == s["y"], "oracle": lambda s: s["y"] in s["C"],
           "tf": lambda s: s["C"][np.argmax(s["s"])] == s["y"]}
    walks = {}  # the greedy walk from the anchor (slot 1's predecessor), on its own picks
    for r, j in blocks if cfg["K"] else ():
        h = hidden[r, j * B + 1:(j + 1) * B]
        walks[r, j] = walk(W, h, h @ lm_head.T, slots[r, j, 1]["prev"], cfg["K"])[0]

    def right(kind, r, j, k):
        s = slots[r, j, k]
        if not s["counted"]:
            return False
        return walks[r, j][k - 1] == s["y"] if kind == "walk" else bool(hit[kind](s))

    def al(kind):
        lengths = []
        for r, j in blocks:
            run = 0
            while run < B - 1 and right(kind, r, j, run + 1):
                run += 1
            lengths.append(1 + run)
        return mean(lengths)

    out["slot_acc"] = [mean([right("unary", r, j, k) for (r, j, kk), s in slots.items() if kk == k and s["counted"]])
                       for k in range(1, B)]
    out["al_unary"] = al("unary")
    t, p_at = accept_at[0], [sampling_law(s["z"], *accept_at) for s in every]  # the target's law, slot by slot
    out["accept_unary"] = mean([np.minimum(p, sampling_law(s["U"], *accept_at)).sum() for p, s in zip(p_at, every)])
    if cfg["K"]:
        out["oracle"] = mean([s["y"] in s["C"] for s in every])
        out["selector_tf_acc"] = mean([bool(hit["tf"](s)) for s in every])
        path_acc = []
        for k in range(1, B):
            reached = [(r, j) for (r, j, kk), s in slots.items() if kk == k and s["counted"]
                       and all(right("walk", r, j, i) for i in range(1, k))]
            path_acc.append(mean([right("walk", r, j, k) for r, j in reached]))
        out["walk_slot_acc"] = path_acc
        out["al_walk"], out["al_oracle"] = al("walk"), al("oracle")
        out["accept_selector"] = mean([np.minimum(p[s["C"]], softmax(s["s"] / t)).sum() for p, s in zip(p_at, every)])
        out["mass_at_k"] = mean([p[s["C"]].sum() for p, s in zip(p_at, every)])
    return out
