"""DFlash2 in one file: the block-parallel speculative-decoding drafter (DFlash) with the two DFlash2 additions, a
grouped dynamic local convolution and a low-rank candidate selector, its training loss, and lossless speculative
decoding. It imports nothing from the repository. References: DFlash (arXiv 2602.06036); "DFlash 2: Keep Drafting
Parallel" (Inco AI, Aug 2026); the z-lab `dflash` package (the inference reference). ALGORITHM.md pins every
formula down; §n points into it.

From the last verified token (the anchor) at a, the drafter reads the block [anchor, MASK, ..., MASK] at a..a+B-1
and predicts a+1..a+B-1 in one pass (slot k predicts position a+k, no shift). It borrows the frozen target's
embedding rows and LM head, and reads the target's context features f (a few of its layers' hidden states,
concatenated and projected) as extra keys/values in every draft layer. What a target family applies beyond the
plain forms here (its RoPE type, its other transforms) comes in from outside, built by harness/target.py from
transformers' own functions (§1).

Departures from a textbook decoder:
  - attention inside a block is bidirectional; the context is never run through the MLP;
  - a training row packs many blocks after its context; a block sees the context strictly before its anchor (the
    anchor's own target state does not exist yet when drafting), its own block, nothing else;
  - the local convolution's taps never cross a block start;
  - proposals come from a walk over the top-K candidates of each slot, scored with the predecessor the walk
    actually chose, and verification uses that walk's q.

The training mask, for a row of S = 6 context tokens and two blocks of B = 3 anchored at a = 1 and a = 3
(■ may attend; a block sees context s < a and its whole own block):

                 context s         block a=1   block a=3
                 0 1 2 3 4 5       1  2  3     3  4  5
    block a=1 1  ■ · · · · ·       ■  ■  ■     ·  ·  ·
              2  ■ · · · · ·       ■  ■  ■     ·  ·  ·
              3  ■ · · · · ·       ■  ■  ■     ·  ·  ·
    block a=3 3  ■ ■ ■ · · ·       ·  ·  ·     ■  ■  ■
              4  ■ ■ ■ · · ·       ·  ·  ·     ■  ■  ■
              5  ■ ■ ■ · · ·       ·  ·  ·     ■  ■  ■

Notation (shape comments; ALGORITHM.md has the full legend): b batch rows, S context length, N blocks per row (1 at
inference), B block size, H hidden, V vocab, K candidates, R selector rank, Kc conv taps, G channels per conv group,
nh/nkv query/key-value heads, hd head dim, nf target feature layers, M blocks walked at once, T temperature (only).
U the drafter's logits, z the target's, f its context features, g its last hidden state, W_in its input embedding
rows, E the selector's edge scores.
"""
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

if sys.version_info < (3, 10):  # `X | None` fields below
    raise ImportError(f"dflash2 needs Python 3.10 or newer; this is {sys.version.split()[0]}")

# --- config ------------------------------------------------------------------
@dataclass
class DFlash2Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list
    mask_token_id: int
    num_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    block_size: int = 8
    conv_kernel_size: int = 2      # 0 turns the local convolution off
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16       # 0 turns the candidate selector off (both off: plain DFlash, v1)
    selector_codebooks: str = "free"  # or "factored": A = W_in·W_A, Bc = W_in·W_B from the target's rows (§3)
    rope_scaling: dict | None = None      # the target's RoPE type and its parameters but rope_theta; None: plain (§1)
    input_embedding_scale: float = 1.0    # the target's view of its tables (§1): block embeddings = rows × this,
    output_multiplier: float = 1.0        # logits = lm_head(h) × this,
    final_logit_softcapping: float | None = None  # then c·tanh(logits / c)
    layer_types: list | None = None       # per draft layer "full_attention" or "sliding_attention"; None: all full
    sliding_window: int | None = None     # W of the sliding layers: a key at distance >= W from the query is hidden

    def __post_init__(self):
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = None if self.layer_types is None else list(self.layer_types)
        check_config(self)

    @property
    def is_dflash2(self):
        return bool(self.conv_kernel_size or self.selector_top_k)

def default_target_layer_ids(num_target_layers, num_features=5):
    """§1: nf = max(1, min(5, Lt-3)) distinct layers, round(1 + i*(Lt-4)/(nf-1)) (36 -> [1, 9, 17, 25, 33])."""
    L, n = num_target_layers, max(1, min(num_features, num_target_layers - 3))
    if n == 1:
        return [max(0, min(L // 2, L - 2))]  # never the last layer (check_config says why)
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]

# --- the target as the drafter reads it (§1) ---------------------------------
@dataclass
class TargetView:
    """What the drafter borrows from the target; target_view gives the plain forms (a family's: harness/target.py)
        embed(ids) = W_in[ids] · input_embedding_scale
        logits(g)  = cap(lm_head(g) · output_multiplier), at least fp32,   cap(·) = c·tanh(· / c)"""
    W_in: torch.Tensor   # (V, H) the input embedding rows, raw (factored codebooks read them)
    embed: Callable      # ids (...) -> (..., H)
    logits: Callable     # final hidden states (..., H) -> (..., V)

def target_view(c, target):
    """The plain view of a transformers target, after check_target_shape (§1)."""
    W_in, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings()
    check_target_shape(c, target.config.get_text_config().num_hidden_layers, W_in.shape[1], lm_head.weight.shape[0])
    require(c.mask_token_id < W_in.shape[0],
            f"mask_token_id {c.mask_token_id} is outside the target's embedding table [0, {W_in.shape[0]})")
    return TargetView(W_in, lambda ids: embed_rows(c, W_in, ids),
                      lambda g: transformed_logits(c, lm_head(g.to(lm_head.weight.dtype))))

def embed_rows(c, W_in, ids):
    """The raw rows × input_embedding_scale, as engines embed the block (not the module's forward)."""
    x = F.embedding(ids, W_in)
    return x * c.input_embedding_scale if c.input_embedding_scale != 1 else x

def transformed_logits(c, y):
    """lm_head's output (..., V) at least fp32, × output_multiplier, then soft-capped."""
    y, cap = y.to(torch.promote_types(y.dtype, torch.float32)), c.final_logit_softcapping
    y = y * c.output_multiplier if c.output_multiplier != 1 else y
    return torch.tanh(y / cap) * cap if cap else y

def context_features(hidden_states, layer_ids):
    """f = cat(h_l for l in layer_ids); layer id l is HF hidden_states[l + 1] (index 0 = embeddings)."""
    return torch.cat([hidden_states[l + 1] for l in layer_ids], dim=-1)  # (b, S, nf·H)

# --- RoPE and RMSNorm --------------------------------------------------------
def plain_rope(c, positions=None):
    """A plain RoPE: inv_freq[m] = θ^(−2m/hd) (hd/2,) fp32, cos / sin scale 1; other types' come from outside."""
    return 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim), 1.0

def rope_cos_sin(positions, inv_freq, scale, dtype):
    """Rotary tables for integer positions (b, n) -> (b, n, hd), half-table repeated as in Qwen3."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

def apply_rope(x, cos, sin):
    """x (b, heads, N·B, hd); cos/sin (b, N·B, hd). Rotate-half convention of HF Llama/Qwen."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

# --- drafter pieces: attention with context injection, local convolution, decoder layer ---
class DraftCache:
    """The drafter's K/V cache, one (k, v) per layer, of committed context only: a block's live one pass (§5)."""
    def __init__(self, num_layers):
        self.kv, self.length = [None] * num_layers, 0  # length: context positions seen (a sliding layer holds fewer)

    def extend(self, layer_idx, k, v, keep=None):
        """Append the new context's k, v (b, nkv, n, hd); keep: hold only the last `keep` positions (a sliding
        layer's W − 1: the oldest that this pass's first query, the anchor, still sees)."""
        old = self.kv[layer_idx]
        k, v = (k, v) if old is None else (torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2))
        if keep is not None:
            k, v = k[:, :, max(0, k.shape[2] - keep):], v[:, :, max(0, v.shape[2] - keep):]
        self.kv[layer_idx] = (k, v)
        return k, v

def window_mask(query_pos, key_pos, window, mask=None):
    """A sliding layer's view (§1): a query sees a key iff their positions are less than W apart (from each query, as
    the inference reference; never causal). query_pos (b, n), key_pos (b, m) -> (b, 1, n, m) bool, and mask."""
    near = (query_pos[:, :, None] - key_pos[:, None, :]).abs() < window
    return near[:, None] if mask is None else mask & near[:, None]

class Attention(nn.Module):
    """Queries from the block only; keys/values = [proj(ctx) ; proj(block)] (KV injection)."""
    def __init__(self, c, layer_idx):
        super().__init__()
        sliding = c.layer_types is not None and c.layer_types[layer_idx] == "sliding_attention"
        self.c, self.window = c, c.sliding_window if sliding else None  # None: full attention
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, ctx, block_rope, ctx_rope, mask=None, cache=None, layer_idx=0):
        """x (b, N·B, H) blocks; ctx (b, S, H) projected context features (only the new ones when a cache is
        given); mask (b, 1, N·B, S + N·B) bool or None."""
        nh, nkv, hd = self.c.num_heads, self.c.num_kv_heads, self.c.head_dim
        heads = lambda y, n: y.view(*y.shape[:2], n, hd).transpose(1, 2)  # (b, heads, N·B, hd)
        # the same k/v projections (and k_norm) serve context and block; only RoPE positions differ
        kv = lambda y, rope: (apply_rope(self.k_norm(heads(self.k_proj(y), nkv)), *rope), heads(self.v_proj(y), nkv))
        q = apply_rope(self.q_norm(heads(self.q_proj(x), nh)), *block_rope)
        (k_ctx, v_ctx), (k_blk, v_blk) = kv(ctx, ctx_rope), kv(x, block_rope)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer_idx, k_ctx, v_ctx, None if self.window is None else self.window - 1)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)  # GQA
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, nh, N·B, hd)
        return self.o_proj(y.transpose(1, 2).flatten(2))

class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

def local_conv(x, delta, base, block_size):
    """Grouped dynamic causal convolution along each block (§2):
        out[i, c] = Σ_{τ<Kc} (base[τ, c] + δ[i, τ, c // G]) · x[i − τ, c],  x[i − τ] := 0 if (i mod B) < τ
    x (b, N·B, H) block by block (or one block of at most B tokens); delta (b, N·B, Kc, H/G) at the output position;
    base (Kc, H). Packed blocks sit back to back: a tap reaching across a block start would read the previous block,
    so it is zeroed, not only the row's first."""
    length, Kc, G = x.shape[1], base.shape[0], x.shape[2] // delta.shape[-1]
    pos_in_block = torch.arange(length, device=x.device) % block_size
    out = torch.zeros_like(x)
    for tap in range(Kc):  # shifted[:, i] = x[:, i − tap], zero where i − tap is in the previous block
        shifted = F.pad(x, (0, 0, tap, 0))[:, :length] * (pos_in_block >= tap).to(x.dtype)[:, None]
        out = out + (base[tap] + delta[:, :, tap].repeat_interleave(G, dim=-1)) * shifted
    return out

class LocalConv(nn.Module):
    """Both sides of the convolution around one sublayer (§2): `prepare` convolves its normalised input u and returns
    the output side's δ, `finish` convolves its output with it (both δ come from u)."""
    def __init__(self, c):
        super().__init__()
        self.block_size, self.taps, self.groups = c.block_size, c.conv_kernel_size, c.hidden_size // c.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, c.hidden_size))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(c.hidden_size, 2 * self.taps * self.groups, bias=False)

    def prepare(self, u):
        delta = self.kernel_projection(u).view(*u.shape[:2], 2, self.taps, self.groups)  # [side, tap, group]
        return local_conv(u, delta[:, :, 0], self.base_kernel[0], self.block_size), delta[:, :, 1]

    def finish(self, y, delta_out):
        return local_conv(y, delta_out, self.base_kernel[1], self.block_size)

class DecoderLayer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer_idx)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.attention_conv = LocalConv(c) if c.conv_kernel_size else None  # None: plain DFlash layer
        self.mlp_conv = LocalConv(c) if c.conv_kernel_size else None

    def forward(self, h, ctx, block_rope, ctx_rope, mask, cache, layer_idx):
        conv = self.attention_conv is not None
        u = self.input_layernorm(h)
        if conv:
            u, delta = self.attention_conv.prepare(u)  # block Q/K/V come from u'; the context is not convolved
        y = self.self_attn(u, ctx, block_rope, ctx_rope, mask, cache, layer_idx)
        h = h + (self.attention_conv.finish(y, delta) if conv else y)
        u = self.post_attention_layernorm(h)
        if conv:
            u, delta = self.mlp_conv.prepare(u)
        y = self.mlp(u)
        return h + (self.mlp_conv.finish(y, delta) if conv else y)

# --- candidate selector (§3) -------------------------------------------------
class CandidateSelector(nn.Module):
    """E[k](prev, c) = U[k, c] + Σ_r A[prev, r] · P[k, r] · Bc[c, r],  P[k] = hidden_projection(h[k]).
    A, Bc: [V, R] tables ("free"), or ("factored") A[prev] = W_A·W_in[prev], Bc[c] = W_B·W_in[c], W_in the target's
    frozen input embedding rows, passed in: 3·H·R parameters, not H·R + 2·V·R."""
    def __init__(self, c):
        super().__init__()
        self.top_k, self.factored = c.selector_top_k, c.selector_codebooks == "factored"
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        if self.factored:  # the export materializes A and Bc under the free tables' names (§7)
            self.predecessor_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)  # W_A
            self.successor_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)    # W_B
        else:
            self.predecessor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
            self.successor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))

    def edge_scores(self, h, U, prev, cand, W_in=None):
        """h (..., H), U (..., V), prev (...) predecessor ids, cand (..., K) -> E (..., K) fp32 (even under autocast:
        the walk's argmax tells close scores apart); W_in: the target's rows, for factored codebooks."""
        require(not self.factored or W_in is not None,
                "a selector with factored codebooks needs the target's input embedding rows (W_in=)")
        with torch.autocast(h.device.type, enabled=False):
            P = F.linear(h.float(), self.hidden_projection.weight.float())  # (..., R)
            if self.factored:  # the raw rows, as the exported tables A = W_in·W_Aᵀ, Bc = W_in·W_Bᵀ read them
                A = F.linear(W_in[prev].float(), self.predecessor_projection.weight.float())  # (..., R)
                Bc = F.linear(W_in[cand].float(), self.successor_projection.weight.float())   # (..., K, R)
            else:
                A, Bc = self.predecessor_codebook[prev].float(), self.successor_codebook[cand].float()
            return U.gather(-1, cand).float() + torch.einsum("...r,...kr->...k", A * P, Bc)

    def walk(self, h, U, anchor, temperature=0.0, generator=None, W_in=None):
        """The walk from the verified anchor (§3): h (M, B-1, H), U (M, B-1, V), anchor (M,) -> path (M, B-1), cand
        (M, B-1, K), q (M, B-1, K) fp32: each pick's law given the predecessor the walk picked (any other q makes
        verification lossy); at T = 0 one-hot on the argmax (lowest index on ties)."""
        cand = U.topk(self.top_k, dim=-1).indices            # (M, B-1, K)
        prev, path, qs = anchor, [], []
        for j in range(cand.shape[1]):
            E = self.edge_scores(h[:, j], U[:, j], prev, cand[:, j], W_in)  # (M, K)
            if temperature == 0:
                pick = E.argmax(-1)
                q = F.one_hot(pick, E.shape[-1]).float()
            else:
                q = torch.softmax(E / temperature, dim=-1)
                pick = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            prev = cand[:, j].gather(-1, pick[:, None]).squeeze(-1)
            path.append(prev)
            qs.append(q)
        return torch.stack(path, 1), cand, torch.stack(qs, 1)

# --- the drafter -------------------------------------------------------------
@torch.no_grad()
def init_weights(drafter):
    """Linears N(0, 0.02), RMSNorms 1; then (the visiting order is moot) the identity convolution (§2) and a zero
    successor codebook or W_B (§3): a fresh DFlash2 drafter computes what DFlash with its weights does."""
    for m in drafter.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    for m in drafter.modules():
        if isinstance(m, LocalConv):
            m.base_kernel.zero_()[:, 0] = 1.0
            m.kernel_projection.weight.zero_()
        elif isinstance(m, CandidateSelector) and m.factored:  # W_A keeps the linears' N(0, 0.02)
            m.successor_projection.weight.zero_()
        elif isinstance(m, CandidateSelector):
            nn.init.normal_(m.predecessor_codebook, std=0.02)
            m.successor_codebook.zero_()

def unary_drafts(U, temperature, generator=None, top_p=1.0, top_k=0):
    """The selector off (§3): each slot's argmax of U (M, B-1, V) at T = 0, else a draw from sampling_probs(U).
    -> path (M, B-1), None (every token is a candidate), q (M, B-1, V) the law each token was drawn from."""
    if temperature == 0:
        path = U.argmax(-1)
        return path, None, F.one_hot(path, U.shape[-1]).float()
    q = sampling_probs(U, temperature, top_p, top_k)
    return torch.multinomial(q.view(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1]), None, q

class DFlash2Drafter(nn.Module):
    """Parameter names follow §7 (the export: the state_dict, factored tables materialized). rope(config, positions)
    -> (inv_freq, scale): plain_rope, or the tables of the target's type (rope_scaling): harness.target.rope_tables."""
    def __init__(self, config, rope=None):
        super().__init__()
        c = self.config = config
        require(rope is not None or c.rope_scaling is None, f"rope_type {(c.rope_scaling or {}).get('rope_type')!r}: "
                "its tables come from outside, DFlash2Drafter(config, rope=harness.target.rope_tables(config))")
        self.rope = rope or plain_rope
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c) if c.selector_top_k else None
        self.grad_checkpoint = False  # True: keep only each layer's input, recompute the layer in backward
        init_weights(self)

    def rope_and_masks(self, block_pos, ctx_pos, mask, cache, dtype):
        """RoPE tables of the block and context positions, and masks by layer window (None: mask; W: ∧ window_mask)."""
        c, W = self.config, self.config.sliding_window
        inv_freq, scale = self.rope(c, torch.cat([ctx_pos, block_pos], 1))
        block_rope, ctx_rope = (rope_cos_sin(pos, inv_freq, scale, dtype) for pos in (block_pos, ctx_pos))
        masks, keys = {None: mask}, ctx_pos
        if W and "sliding_attention" in (c.layer_types or ()):
            if cache is not None:  # the keys a cached pass sees: the last W − 1 context positions (all extend keeps)
                end = cache.length + ctx_pos.shape[1]
                keys = torch.arange(max(0, end - (W - 1)), end, device=block_pos.device).expand(block_pos.shape[0], -1)
            masks[W] = window_mask(block_pos, torch.cat([keys, block_pos], 1), W, mask)
        return block_rope, ctx_rope, masks

    def forward(self, block_embeds, block_pos, f, ctx_pos, mask=None, cache=None):
        """block_embeds (b, N·B, H) the block tokens' target embeddings at block_pos (b, N·B); f (b, S, nf·H) the
        target's context features at ctx_pos (b, S), only the new context with a cache; mask (b, 1, N·B, S + N·B)
        bool (True = may attend) or None (= see everything). -> h (b, N·B, H), normalized."""
        ctx = self.hidden_norm(self.fc(f))  # computed once, shared by every layer
        block_rope, ctx_rope, masks = self.rope_and_masks(block_pos, ctx_pos, mask, cache, block_embeds.dtype)
        h, recompute = block_embeds, self.grad_checkpoint and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (h, ctx, block_rope, ctx_rope, masks[layer.self_attn.window], cache, i)
            h = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        if cache is not None:
            cache.length += f.shape[1]
        return self.norm(h)

    def propose(self, h, U, anchor, temperature=0.0, generator=None, *, top_p=1.0, top_k=0, W_in=None):
        """Drafts for slots 1..B-1 (§3) and the law each was drawn from: the walk's path (M, B-1), cand and q (M, B-1,
        K), or with the selector off unary_drafts'. -> (path, cand, q)."""
        if self.candidate_selector is None:
            return unary_drafts(U, temperature, generator, top_p, top_k)
        return self.candidate_selector.walk(h, U, anchor, temperature, generator, W_in)

# --- anchors, block layout and mask (§6) -------------------------------------
def sample_anchors(loss_mask, max_anchors, generator=None):
    """Per row, up to max_anchors distinct positions a with loss_mask[a] = loss_mask[a + 1] = 1, sorted (§6).
    -> anchors (b, N) long, valid (b, N) bool; padding anchors sit at 0."""
    require(max_anchors >= 1, f"max_anchors ({max_anchors}) must be >= 1")
    b, lm, chosen = loss_mask.shape[0], loss_mask.bool(), []
    for row in lm[:, :-1] & lm[:, 1:]:  # eligible (b, S-1): position a, with a + 1 < S
        idx = row.nonzero().squeeze(-1)
        chosen.append(idx[torch.randperm(len(idx), generator=generator)[:max_anchors].to(idx.device)].sort().values)
    N = max(1, max(len(a) for a in chosen))
    anchors, valid = (torch.zeros(b, N, dtype=dtype, device=loss_mask.device) for dtype in (torch.long, torch.bool))
    for i, a in enumerate(chosen):
        anchors[i, :len(a)], valid[i, :len(a)] = a, True
    return anchors, valid

def block_layout(input_ids, anchors, block_size, mask_token_id):
    """Blocks [x[a_j], MASK x (B-1)] at positions a_j + 0..B-1, concatenated -> ids, positions (b, N·B)."""
    b, N = anchors.shape
    ids = torch.full((b, N, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    return ids.view(b, N * block_size), pos.view(b, N * block_size)

def block_attention_mask(anchors, attention_mask, block_size):
    """Dense (b, 1, N·B, S + N·B) bool mask over keys [context ; blocks] (§6, drawn in the module docstring): block j
    sees its own block and real context s < a_j (strictly: the anchor's target state is not there yet at inference)."""
    (b, N), S = anchors.shape, attention_mask.shape[1]
    s = torch.arange(S, device=anchors.device)
    ctx = (s[None, None, :] < anchors[:, :, None]) & attention_mask.bool()[:, None, :]   # (b, N, S)
    ctx = ctx.repeat_interleave(block_size, dim=1)                                          # (b, N·B, S)
    blk = torch.arange(N * block_size, device=anchors.device) // block_size
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)                                  # (b, N·B, N·B)
    return torch.cat([ctx, own], dim=-1)[:, None]

def block_slots(anchors, anchor_valid, loss_mask, block_size):
    """Slot k = 1..B-1 of block j predicts t = a_j + k and counts iff its anchor is real, t < S and loss_mask[t] = 1;
    its label, the target's logits and predecessor are read at src = t - 1 (t clamped). -> counted, src (b, N, B-1)."""
    S = loss_mask.shape[1]
    t = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)   # (b, N, B-1)
    t_in = t.clamp(max=S - 1)
    counted = anchor_valid[:, :, None] & (t < S) & loss_mask.bool().gather(1, t_in.flatten(1)).view_as(t)
    return counted, t_in - 1

# --- the loss (§6) -----------------------------------------------------------
@dataclass
class Batch:
    """A training step's tensors: input_ids, attention_mask, loss_mask (b, S); the target's context features
    f (b, S, nf·H) and last hidden state g (b, S, H), after its final norm; anchors, anchor_valid (b, N)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor

@dataclass(frozen=True)
class LossConfig:
    """The §6 loss's settings, checked once, when made (train.py: the flags named below, γ and α, the memory plan)."""
    loss_type: str = "kl"                # --loss: the unary term, "kl" to the target's softmax or "ce" on its argmax
    gamma: float | None = None           # slot weights w_k = exp(-(k-1)/γ); None: default_gamma(B)
    alpha: float = 1.0                   # L = L_unary + α·L_sel
    selector_labels: str = "argmax"      # --selector-labels: π, "argmax" (one-hot on y) or "soft" (p on C)
    soft_labels_at: tuple | None = None  # --selector-labels T,TOP_P,TOP_K: soft π at that sampling setting; None: p
    chunk_size: int | None = None        # slots whose logits live at once; several chunks are recomputed in backward

    def __post_init__(self):
        check_loss_config(self)

def default_gamma(block_size):
    """γ of the position weights w_k = exp(-(k-1)/γ): the published 4/5/7 for B = 8/10/16, else B/2."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, block_size / 2)

def slot_sums(view, selector, cfg, h, g, prev, w, topk_fn=torch.topk):
    """Σ over n slots of w·(their §6 terms): h (n, H) the drafter's output, g (n, H) the target's last hidden state
    at t − 1, prev (n,) the data token there, w (n,) the slot weights.
        unary     kl: ℓ = Σ_v p_v·(log p_v − log q_v),  p = softmax(z), q = softmax(U);   ce: ℓ = −log q_y,  y = argmax z
        selector  −Σ_{c∈C} π_c·log softmax_K(E(prev, C))_c,  C = U's K largest,  π = one-hot(y) ("argmax") or
                  the target's law on C ("soft": p, or sampling_probs(z, *soft_labels_at))
    topk_fn finds C: torch.topk, or a cheaper function with its values (train.py passes harness.fast_loss.top_k).
    -> {unary: Σ w·ℓ, selector: Σ w·CE, selector_weight: Σ w·Σ_{c∈C} π_c} (no selector: unary only)."""
    U, z = view.logits(h), view.logits(g)
    log_q, y = F.log_softmax(U, dim=-1), z.argmax(-1)
    uses_p = cfg.loss_type == "kl" or cfg.selector_labels == "soft"
    log_p = F.log_softmax(z, dim=-1).clamp(min=torch.finfo(z.dtype).min) if uses_p else None  # -inf: p = 0, not NaN
    p = log_p.exp() if uses_p else None
    ell = (p * (log_p - log_q)).sum(-1) if cfg.loss_type == "kl" else -log_q.gather(-1, y[:, None]).squeeze(-1)
    sums = {"unary": (w * ell).sum()}
    if selector is None:
        return sums
    C = topk_fn(U, selector.top_k, dim=-1).indices                                  # (n, K)
    E = selector.edge_scores(h, U, prev, C, view.W_in)                              # (n, K)
    if cfg.selector_labels == "soft":
        pi = (sampling_probs(z, *cfg.soft_labels_at) if cfg.soft_labels_at else p).gather(-1, C)
    else:
        pi = (C == y[:, None]).to(ell.dtype)
    sums["selector"] = (w * -(pi * F.log_softmax(E, dim=-1).to(ell.dtype)).sum(-1)).sum()
    sums["selector_weight"] = (w * pi.sum(-1)).sum()
    return sums

@dataclass
class Slots:
    """Per slot of a batch's blocks, kept for the metrics: h, g (b, N, B-1, H), prev, counted (b, N, B-1)."""
    h: torch.Tensor
    g: torch.Tensor
    prev: torch.Tensor
    counted: torch.Tensor

def loss_sums(drafter, view, batch, cfg=None, sums_fn=slot_sums):
    """The drafter over the batch's packed blocks, then the sums the §6 loss divides over the counted slots, chunk_size
    at a time (with more than one chunk, their (n, V) logits recomputed in backward). sums_fn: slot_sums or it
    compiled. -> ({unary, unary_weight (Σ w), selector, selector_weight}, Slots)."""
    cfg = cfg or LossConfig()
    c, (b, S), N = drafter.config, batch.input_ids.shape, batch.anchors.shape[1]
    ids, pos = block_layout(batch.input_ids, batch.anchors, c.block_size, c.mask_token_id)
    mask = block_attention_mask(batch.anchors, batch.attention_mask, c.block_size)
    dtype, ctx_pos = drafter.fc.weight.dtype, torch.arange(S, device=ids.device).expand(b, S)
    h = drafter(view.embed(ids).to(dtype), pos, batch.f.to(dtype), ctx_pos, mask).unflatten(1, (N, -1))
    counted, src = block_slots(batch.anchors, batch.anchor_valid, batch.loss_mask, c.block_size)
    rows = torch.arange(b, device=ids.device)[:, None, None]
    slots = Slots(h[:, :, 1:], batch.g[rows, src], batch.input_ids[rows, src], counted)
    gamma = default_gamma(c.block_size) if cfg.gamma is None else cfg.gamma
    w_dtype = torch.promote_types(view.W_in.dtype, torch.float32)  # the logits' dtype: fp64 stays fp64
    w = torch.exp(-torch.arange(c.block_size - 1, device=h.device, dtype=w_dtype) / gamma) * counted
    idx = counted.flatten().nonzero().squeeze(-1)  # only counted slots reach the vocabulary
    h_c, g_c, prev_c, w_c = (x.flatten(0, 2)[idx] for x in (slots.h, slots.g, slots.prev, w))
    n = cfg.chunk_size or max(1, len(idx))
    recompute, parts = len(idx) > n, []  # one chunk: recomputing it would bound nothing (its backward comes first)
    for i in range(0, max(1, len(idx)), n):
        chunk = (view, drafter.candidate_selector, cfg, h_c[i:i + n], g_c[i:i + n], prev_c[i:i + n], w_c[i:i + n])
        parts.append(torch.utils.checkpoint.checkpoint(sums_fn, *chunk, use_reentrant=False) if recompute
                     else sums_fn(*chunk))
    sums = {k: sum(p[k] for p in parts) for k in parts[0]}
    return {**sums, "unary_weight": w.sum()}, slots

def loss_from_sums(sums, alpha):
    """L = unary / unary_weight + α·selector / selector_weight (§6; a sum over no slot is 0 / 1e-9 = 0).
    -> (L, {loss, unary_loss, selector_loss} detached)."""
    loss = unary_loss = sums["unary"] / sums["unary_weight"].clamp(min=1e-9)
    stats = {"unary_loss": unary_loss.detach()}
    if "selector" in sums:
        selector_loss = sums["selector"] / sums["selector_weight"].clamp(min=1e-9)
        loss = loss + alpha * selector_loss
        stats["selector_loss"] = selector_loss.detach()
    return loss, {**stats, "loss": loss.detach()}

def dflash2_loss(drafter, view, batch, cfg=None, sums_fn=slot_sums):
    """L = L_unary + α·L_sel of a batch. -> (L, detached stats, Slots for dflash2_metrics)."""
    sums, slots = loss_sums(drafter, view, batch, cfg, sums_fn)
    return (*loss_from_sums(sums, (cfg or LossConfig()).alpha), slots)

# --- speculative decoding (§4, §5) -------------------------------------------
def sampling_probs(logits, temperature, top_p=1.0, top_k=0):
    """softmax(logits / T), then the request's top-k / top-p, renormalised (fp32 or fp64): the target's p, and the q
    of a unary draft (the selector walk's q stays softmax(E / T) over K)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if top_k:
        kth = x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True, stable=True)  # ties: lower id first, on every device
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest prefix reaching top_p
        p = p.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)  # back to vocab order
        p = p / p.sum(-1, keepdim=True)
    return p

def sample(logits, temperature, top_p=1.0, top_k=0, generator=None):
    """One token per row of logits (..., V): the argmax at T = 0, else a draw from sampling_probs -> (...,). The
    target alone (target_generate, spec_generate's first token, regeneration) draws here: serving's law."""
    if temperature == 0:
        return logits.argmax(-1)
    p = sampling_probs(logits, temperature, top_p, top_k)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).view(p.shape[:-1])

def verify_greedy(draft, logits):
    """T = 0 (§4): the longest prefix of draft (n,) equal to argmax logits (n+1, V), then the next argmax."""
    pred = logits.argmax(-1)
    n_acc = int((draft == pred[:-1]).long().cumprod(0).sum())
    return n_acc, int(pred[n_acc])

def acceptance_probability(p, q, token):
    """Keep a draft token with probability min(1, p[token] / q[token]). A token the target gives p = 0 is never
    kept, even where q = 0 too (0/0 would be NaN, and a draw >= NaN is False)."""
    return torch.where(p[token] > 0, torch.clamp(p[token] / q[token], max=1.0), 0.0)

def residual_distribution(p, q):
    """The law after a rejection, normalize(max(0, p - q)); p if that is all zero (only at p = q: no rejection)."""
    r = (p - q).clamp(min=0)
    return r / r.sum() if r.sum() > 0 else p

def verify_sampled(draft, q, p, generator=None):
    """T > 0 rejection sampling (Leviathan et al. / Chen et al., §4) with a sparse proposal: draft (n,), q (n, V) the
    law each draft was drawn from (0 outside its candidates, conditional on the drafted predecessor), p (n+1, V) the
    target's laws. Emitted tokens follow p exactly. -> (n_accepted, bonus)."""
    for i, d in enumerate(draft.tolist()):
        draw = torch.rand((), generator=generator, device=p.device, dtype=p.dtype)
        if draw >= acceptance_probability(p[i], q[i], d):
            return i, int(torch.multinomial(residual_distribution(p[i], q[i]), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))

def q_over_vocab(cand, q, vocab_size):
    """q (..., K) of candidates cand (..., K) spread over the vocabulary -> (..., V) fp64, 0 off the candidates."""
    dense = torch.zeros(*cand.shape[:-1], vocab_size, device=cand.device, dtype=torch.float64)
    return dense.scatter_(-1, cand, q.double())

def target_cache(target, forward_tokens=0):
    """The target's transformers cache for decoding one sequence. forward_tokens > 0: after a forward of at most that
    many tokens, crop(−m) can take back any m of them (§5): sliding-window layers keep the keys past their window,
    recurrent layers (linear attention, Mamba, short convolutions) the state after each token, until the next crop.
    Without them a hybrid target cannot be rolled back; with fewer the states misalign: transformers keeps a forward's
    last k states, and crop(−m) takes the m-th from the end of [state before the forward] + those k but the last."""
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    if forward_tokens:
        cache.activate_past_recording(recurrent_states_to_keep=forward_tokens)
    return cache

def draft_forward(drafter, view, anchor, new_f, draft_cache):
    """The draft half (§5): the block [anchor, MASK, ..., MASK] at a..a+B−1 through the drafter, which first appends
    new_f (1, ·, nf·H), the target features it has not read yet, to draft_cache; then U, the drafter's logits (its h
    through the target's lm_head) of slots 1..B−1. anchor (1,) long. -> (h (1, B−1, H), U (1, B−1, V) fp32)."""
    c, dev, dtype = drafter.config, anchor.device, drafter.fc.weight.dtype
    a = draft_cache.length + new_f.shape[1]  # the context is 0..a−1, the anchor sits at a
    block = torch.cat([anchor, torch.full((c.block_size - 1,), c.mask_token_id, device=dev)])[None]
    h = drafter(view.embed(block).to(dtype), torch.arange(a, a + c.block_size, device=dev)[None],
                new_f.to(dtype), torch.arange(draft_cache.length, a, device=dev)[None], cache=draft_cache)[:, 1:]
    return h, view.logits(h).float()

def speculative_decode_step(drafter, view, target, cache, draft_cache, anchor, new_f, n, temperature=0.0, top_p=1.0,
                            top_k=0, generator=None, draft=None):
    """One draft-and-verify cycle (§5): the anchor (1,) at a is the last emitted token, the target's cache holds
    0..a−1, the drafter's 0..a−1 less new_f. Draft n <= B−1 tokens (or take draft (n,) long from elsewhere: no
    draft pass, q a point mass on each), verify them in one target pass (greedy or sampled), keep the accepted prefix
    and a bonus. -> (the accepted drafts then the bonus, next new_f)."""
    if draft is None:  # draft: one drafter pass over [anchor, MASK, ...], then the walk (or the unary law) picks n
        h, U = draft_forward(drafter, view, anchor, new_f, draft_cache)
        path, cand, q = drafter.propose(h, U, anchor, temperature, generator, top_p=top_p, top_k=top_k, W_in=view.W_in)
        draft, unread = path[0, :n], new_f[:, :0]
    else:  # a draft from elsewhere (a lookup): q puts all its mass on each token; the drafter has not read new_f
        cand, q, unread = draft[None, :, None], torch.ones(1, n, 1, device=draft.device), new_f
    # verify: the target reads [anchor ; draft] after its cache; logits row i is its law after draft[:i]
    out = target(torch.cat([anchor, draft])[None], cache=cache, use_cache=True, output_hidden_states=True)
    logits = out.logits[0]
    if temperature == 0:
        n_acc, bonus = verify_greedy(draft, logits)
    else:
        p = sampling_probs(logits.double(), temperature, top_p, top_k)
        q_v = q[0, :n].double() if cand is None else q_over_vocab(cand[0, :n], q[0, :n], logits.shape[-1])
        n_acc, bonus = verify_sampled(draft, q_v, p, generator)
    # roll back: the target drops the n − n_acc rejected drafts (transformers 5: crop(−m) drops the last m; crop(0)
    # drops nothing but trims the layers that recorded their past); the drafter's next new context is all it has not
    # read: unread, then the features of the anchor and the accepted drafts (the bonus is the next anchor)
    cache.crop(-(n - n_acc))
    feats = context_features(out.hidden_states, drafter.config.target_layer_ids)[:, :n_acc + 1]
    return draft[:n_acc].tolist() + [bonus], torch.cat([unread, feats], 1)

@dataclass
class GenerationStats:
    acceptance_lengths: list = field(default_factory=list)   # tokens committed per cycle, bonus included
    accepted_per_slot: list = field(default_factory=list)    # the drafter's cycles in which slot k was accepted
    target_forwards: int = 0                                 # prefill included
    new_tokens: int = 0
    decode_seconds: float = 0.0                              # everything after the prefill
    sources: list = field(default_factory=list)              # per cycle: who drafted, 'drafter' or 'lookup'

    @property
    def mean_acceptance_length(self):
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_second(self):
        return self.new_tokens / max(self.decode_seconds, 1e-9)

def device_time(device):
    """time.perf_counter() once the device's queued work is done: the clock of GenerationStats and the bench."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

def emit(tokens, new, stop_ids, max_new_tokens):
    """Append new tokens, stopping after a stop token or at max_new_tokens; -> done."""
    for tok in new:
        tokens.append(tok)
        if tok in stop_ids or len(tokens) >= max_new_tokens:
            return True
    return False

@torch.no_grad()
def target_generate(target, input_ids, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=None,
                    generator=None):
    """Plain autoregressive decoding with the same cache and sampling code: the baseline."""
    check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k)
    stats, stop_ids, tokens, cache = GenerationStats(), set(stop_token_ids or ()), [], target_cache(target)
    logits = target(input_ids, cache=cache, use_cache=True).logits[0, -1]
    start, stats.target_forwards = device_time(input_ids.device), 1
    while not emit(tokens, [int(sample(logits, temperature, top_p, top_k, generator))], stop_ids, max_new_tokens):
        logits = target(torch.tensor([[tokens[-1]]], device=input_ids.device), cache=cache, use_cache=True).logits[0, -1]
        stats.target_forwards += 1
    stats.decode_seconds, stats.new_tokens = device_time(input_ids.device) - start, len(tokens)
    return torch.tensor(tokens, dtype=torch.long), stats

@torch.no_grad()
def spec_generate(drafter, target, input_ids, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                  stop_token_ids=None, generator=None, view=None, draft_tokens=None, lookup=None):
    """Speculative decoding of one sequence with a DFlash/DFlash2 drafter (§5): equals target_generate's output token
    for token at T = 0, follows its law at T > 0. view: the target as the drafter reads it (None: target_view's plain
    forms); draft_tokens: the drafts a cycle verifies, 1..B−1 (None: B−1); lookup: a draft source asked first each
    cycle, lookup(prompt ids + emitted ids, stats) -> at most lookup.max_tokens ids to verify ([]: the drafter
    drafts), e.g. harness.lookup.SuffixLookup. -> (new ids (n,), GenerationStats)."""
    c, dev, B = drafter.config, input_ids.device, drafter.config.block_size
    check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k, draft_tokens, B)
    view = view or target_view(c, target)
    stats, stop_ids, tokens = GenerationStats(accepted_per_slot=[0] * (B - 1)), set(stop_token_ids or ()), []
    longest = max(B, lookup.max_tokens + 1) if lookup else B  # a verify call: [anchor ; <= B−1 drafts or a lookup's]
    cache, draft_cache = target_cache(target, forward_tokens=longest), DraftCache(c.num_layers)
    prompt = input_ids[0].tolist()  # what a lookup reads, with the emitted tokens after it
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True)
    check_hidden_states(target, out.hidden_states)
    new_f = context_features(out.hidden_states, c.target_layer_ids)  # features not yet in draft_cache
    start, stats.target_forwards = device_time(dev), 1
    done = emit(tokens, [int(sample(out.logits[0, -1], temperature, top_p, top_k, generator))], stop_ids, max_new_tokens)
    while not done:
        left = max_new_tokens - len(tokens) - 1  # never draft past max_new_tokens
        looked = lookup(prompt + tokens, stats)[:min(lookup.max_tokens, left)] if lookup and left else []
        n = len(looked) or min(draft_tokens or B - 1, left)
        anchor = torch.tensor([tokens[-1]], device=dev)  # the last emitted token; the target has not read it yet
        committed, new_f = speculative_decode_step(drafter, view, target, cache, draft_cache, anchor, new_f, n,
                                                   temperature, top_p, top_k, generator,
                                                   torch.tensor(looked, device=dev) if looked else None)
        stats.target_forwards += 1
        before = len(tokens)
        done = emit(tokens, committed, stop_ids, max_new_tokens)
        kept = len(tokens) - before  # fewer than committed when a stop token ends the cycle early
        stats.acceptance_lengths.append(kept)
        stats.sources.append("lookup" if looked else "drafter")
        for k in range(0 if looked else min(len(committed) - 1, kept)):  # the drafter's accepted drafts, kept
            stats.accepted_per_slot[k] += 1
    stats.decode_seconds, stats.new_tokens = device_time(dev) - start, len(tokens)
    return torch.tensor(tokens, dtype=torch.long), stats

# --- the checks: bad input refused early, in one sentence naming the field, its value and the rule ---
def require(ok, sentence):
    if not ok:
        raise ValueError(sentence)

def check_config(c):
    """Refuse a shape the drafter cannot be built with."""
    for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                 "num_target_layers", "num_layers"):
        require(getattr(c, name) >= 1, f"{name} ({getattr(c, name)}) must be >= 1")
    require(c.rope_theta > 0 and c.rms_norm_eps >= 0,
            f"rope_theta ({c.rope_theta}) must be > 0 and rms_norm_eps ({c.rms_norm_eps}) >= 0")
    require(c.num_heads % c.num_kv_heads == 0, f"num_kv_heads ({c.num_kv_heads}) must divide num_heads ({c.num_heads})")
    require(c.head_dim % 2 == 0, f"head_dim ({c.head_dim}) must be even for rotary embeddings")
    require(c.block_size >= 2, f"block_size ({c.block_size}) must be >= 2 (an anchor plus at least one draft slot)")
    require(0 <= c.mask_token_id < c.vocab_size,
            f"mask_token_id ({c.mask_token_id}) must be a token of the target vocabulary [0, {c.vocab_size})")
    require(c.selector_codebooks in ("free", "factored"),
            f"selector_codebooks ({c.selector_codebooks!r}) must be 'free' or 'factored'")
    require(c.input_embedding_scale > 0 and c.output_multiplier > 0 and (c.final_logit_softcapping or 1) > 0,
            f"input_embedding_scale ({c.input_embedding_scale}), output_multiplier ({c.output_multiplier}) and "
            f"final_logit_softcapping ({c.final_logit_softcapping}) must be > 0 (softcapping: or None)")
    L, ids, types = c.num_target_layers, c.target_layer_ids, c.layer_types
    require(ids, "target_layer_ids is empty: the drafter needs at least one target layer")
    require(all(0 <= l < L for l in ids),
            f"target_layer_ids {[l for l in ids if not 0 <= l < L]} outside the target's layers [0, {L})")
    require(len(set(ids)) == len(ids), f"target_layer_ids {ids} has duplicates: each layer is one feature")
    require(L - 1 not in ids, f"target_layer_ids {ids} holds the target's last layer {L - 1}: Hugging Face returns "
            "it after the final norm, and serving engines, which capture each layer's input, never see it; use "
            f"layers below {L - 1}")
    if types is not None:
        require(len(types) == c.num_layers, f"layer_types has {len(types)} entries for num_layers = {c.num_layers}")
        require(set(types) <= {"full_attention", "sliding_attention"},
                f"layer_types {sorted(set(types))} may only hold 'full_attention' and 'sliding_attention'")
        require("sliding_attention" not in types or isinstance(c.sliding_window, int) and c.sliding_window >= 1,
                f"sliding_window ({c.sliding_window!r}) must be an integer >= 1 for sliding_attention layers")
    if c.conv_kernel_size:
        require(1 <= c.conv_kernel_size <= c.block_size,
                f"conv_kernel_size ({c.conv_kernel_size}) must be in [1, block_size={c.block_size}], or 0 to disable")
        require(c.conv_group_size >= 1 and c.hidden_size % c.conv_group_size == 0,
                f"hidden_size ({c.hidden_size}) must be divisible by conv_group_size ({c.conv_group_size})")
    if c.selector_top_k:
        require(1 <= c.selector_top_k <= c.vocab_size,
                f"selector_top_k ({c.selector_top_k}) must be in [1, vocab_size={c.vocab_size}], or 0 to disable")
        require(c.selector_rank >= 1, f"selector_rank ({c.selector_rank}) must be >= 1 when the selector is on")

def check_target_shape(c, num_target_layers, hidden_size, vocab_size):
    """A drafter only fits the target it was built for: same layer count, width and vocabulary."""
    for name, value in (("num_target_layers", num_target_layers), ("hidden_size", hidden_size),
                        ("vocab_size", vocab_size)):
        require(getattr(c, name) == value, f"the drafter has {name} {getattr(c, name)} but the target has {value}: "
                "a drafter only fits the target it was trained for")

def check_hidden_states(target, hidden_states):  # a hyper-connection target's layers return several residual streams
    tc, width = target.config.get_text_config(), max(h.shape[2:].numel() for h in hidden_states)
    require(width <= tc.hidden_size, f"the {tc.model_type!r} target's layers return {width} values a position, more "
            f"than its hidden_size {tc.hidden_size}: hyper-connections, and the drafter reads one hidden state a layer")

def check_loss_config(cfg):
    require(cfg.loss_type in ("kl", "ce"), f"loss_type ({cfg.loss_type!r}) must be 'kl' or 'ce'")
    require(cfg.selector_labels in ("argmax", "soft"),
            f"selector_labels ({cfg.selector_labels!r}) must be 'argmax' or 'soft'")
    require(cfg.soft_labels_at is None or cfg.selector_labels == "soft",
            f"soft_labels_at ({cfg.soft_labels_at}) needs selector_labels='soft'")
    require(cfg.gamma is None or cfg.gamma > 0, f"gamma ({cfg.gamma}) must be > 0 (or None for B's default)")
    require(cfg.alpha >= 0, f"alpha ({cfg.alpha}) must be >= 0")
    require(cfg.chunk_size is None or cfg.chunk_size >= 1, f"chunk_size ({cfg.chunk_size}) must be >= 1 or None")
    if cfg.soft_labels_at is not None:
        check_law_setting("soft_labels_at", cfg.soft_labels_at)

def check_law_setting(name, setting):
    """A sampling setting whose law is read (the soft labels', the acceptance metrics'): T = 0 has none to read."""
    try:
        check_sampling(*setting)
        require(setting[0] != 0, "temperature must be > 0")
    except ValueError as e:
        raise ValueError(f"{name} {setting}: {e}") from None

def check_sampling(temperature, top_p, top_k):
    """A request's setting: T finite, >= 0 (0: greedy); top_p in (0, 1], integer top_k >= 0 (1 and 0: no filter)."""
    require(0 <= temperature < float("inf"), f"temperature ({temperature}) must be a finite number >= 0")  # NaN fails
    require(0 < top_p <= 1, f"top_p ({top_p}) must be in (0, 1]")
    require(isinstance(top_k, int) and top_k >= 0, f"top_k ({top_k!r}) must be an integer >= 0")

def check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k, draft_tokens=None, block_size=None):
    require(input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] >= 1,
            f"input_ids shape {tuple(input_ids.shape)}: expected (1, P) with P >= 1 (batch 1)")
    require(isinstance(max_new_tokens, int) and max_new_tokens >= 1,
            f"max_new_tokens ({max_new_tokens!r}) must be an integer >= 1")
    require(draft_tokens is None or isinstance(draft_tokens, int) and 1 <= draft_tokens < block_size,
            f"draft_tokens ({draft_tokens!r}) must be an integer from 1 to block_size − 1 (block_size = {block_size})")
    check_sampling(temperature, top_p, top_k)
