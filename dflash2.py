"""
DFlash2 in one file: the block-parallel speculative-decoding drafter (DFlash) with the two DFlash2
additions, a grouped dynamic local convolution and a low-rank candidate selector, plus its training
objective and lossless speculative decoding. It imports nothing from the repository; checkpoint.py
imports it and owns the export engines load (§7). References: DFlash (arXiv 2602.06036); "DFlash 2:
Keep Drafting Parallel" (Inco AI, Aug 2026); the z-lab `dflash` package (inference reference).
ALGORITHM.md pins every formula down; the section numbers below (§n) point into it.

From the last verified token (the anchor) at a, the drafter reads the block [anchor, MASK, ..., MASK] at
a..a+B-1 and predicts a+1..a+B-1 in one pass (slot k predicts position a+k, no shift), with the frozen
target's embedding and LM head, and the target's context features (a few of its layers' hidden states,
concatenated and projected) injected as extra keys/values in every draft layer.

Notable departures from a textbook decoder:
  - attention inside a block is bidirectional; the context is never run through the MLP;
  - a training sequence packs many blocks after its context; a block sees context strictly before its
    anchor (the anchor's own target state does not exist yet when drafting), its own block, nothing else;
  - the local convolution's taps never cross a block start;
  - proposals come from a walk over the top-K candidates of each slot, scored with the predecessor the
    walk actually chose, and verification uses that walk's q.
The target's RoPE type, its embedding and logit transforms (Gemma, Granite) and sliding-window draft
layers follow §1. Not implemented (refused by name): dynamic RoPE past the target's context, causal
draft layers, pruned draft vocabularies (DFlash2 needs the full vocabulary).

Notation (shape comments; ALGORITHM.md has the full legend): b batch rows, S context length, N blocks
per row (1 at inference), B block size, H hidden, V vocab, K candidates, R selector rank, Kc conv taps,
G channels per conv group, nh/nkv query/key-value heads, hd head dim, nf target feature layers, M blocks
walked at once, T temperature (only).
"""
import functools
import math
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# -----------------------------------------------------------------------------
# config
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
    selector_codebooks: str = "free"  # or "factored": A = E·W_A, Bc = E·W_B from the target's embedding E (§3)
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

    @classmethod
    def from_target(cls, target_config, **overrides):
        """The drafter of a transformers target config: its width, RoPE (target_rope) and tables (target_view)."""
        require("mask_token_id" in overrides,
                "from_target needs mask_token_id: an existing but unused token id of the target")
        tc = text_config(target_config)
        L, n_heads = tc.num_hidden_layers, tc.num_attention_heads
        shape = dict(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                     intermediate_size=overrides.get("intermediate_size") or mlp_width(tc),
                     num_heads=n_heads, num_kv_heads=getattr(tc, "num_key_value_heads", None) or n_heads,
                     head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // n_heads,
                     num_target_layers=L, target_layer_ids=default_target_layer_ids(L),
                     rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
                     **target_rope(tc), **target_view(tc))
        return cls(**{**shape, **known_fields(overrides)})

    @property
    def is_dflash2(self):
        return bool(self.conv_kernel_size or self.selector_top_k)

def require(ok, sentence):  # refuse early, with a sentence a user can act on (the field, its value, the rule)
    if not ok:
        raise ValueError(sentence)

ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),  # rope_type -> what it reads
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "proportional": ()}

def check_config(c):
    """Refuse a shape the drafter cannot be built with, in one sentence naming the field."""
    for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                 "num_target_layers", "num_layers"):
        require(getattr(c, name) >= 1, f"{name} ({getattr(c, name)}) must be >= 1")
    require(c.rope_theta > 0 and c.rms_norm_eps >= 0,
            f"rope_theta ({c.rope_theta}) must be > 0 and rms_norm_eps ({c.rms_norm_eps}) >= 0")
    require(c.num_heads % c.num_kv_heads == 0,
            f"num_heads ({c.num_heads}) must be divisible by num_kv_heads ({c.num_kv_heads})")
    require(c.head_dim % 2 == 0, f"head_dim ({c.head_dim}) must be even for rotary embeddings")
    require(c.block_size >= 2, f"block_size ({c.block_size}) must be >= 2 (an anchor plus at least one draft slot)")
    require(0 <= c.mask_token_id < c.vocab_size,
            f"mask_token_id ({c.mask_token_id}) must be a token of the target vocabulary [0, {c.vocab_size})")
    require(c.selector_codebooks in ("free", "factored"),
            f"selector_codebooks ({c.selector_codebooks!r}) must be 'free' or 'factored'")
    require(c.input_embedding_scale > 0 and c.output_multiplier > 0 and (c.final_logit_softcapping or 1) > 0,
            f"input_embedding_scale ({c.input_embedding_scale}), output_multiplier ({c.output_multiplier}) and "
            f"final_logit_softcapping ({c.final_logit_softcapping}) must be > 0 (softcapping: or None)")
    L, ids, rope = c.num_target_layers, c.target_layer_ids, c.rope_scaling or {}
    require(ids, "target_layer_ids is empty: the drafter needs at least one target layer")
    require(all(0 <= l < L for l in ids),
            f"target_layer_ids {[l for l in ids if not 0 <= l < L]} outside the target's layers [0, {L})")
    require(len(set(ids)) == len(ids), f"target_layer_ids {ids} has duplicates: each layer is one feature")
    require(L - 1 not in ids, f"target_layer_ids {ids} holds the target's last layer {L - 1}: Hugging Face returns "
            "it after the final norm, and serving engines, which capture each layer's input, never see it; use "
            f"layers below {L - 1}")
    kind = rope.get("rope_type", "default")
    require(kind in ROPE_KEYS, f"rope_type {kind!r} is not supported (only {', '.join(ROPE_KEYS)})")
    missing = [k for k in ROPE_KEYS[kind] if rope.get(k) is None]
    require(not missing, f"rope_type {kind!r} needs {missing} in rope_scaling")
    for k in ("short_factor", "long_factor") if kind == "longrope" else ():
        require(len(rope[k]) == c.head_dim // 2,
                f"longrope {k} has {len(rope[k])} entries, expected head_dim / 2 = {c.head_dim // 2}")
    if c.layer_types is not None:
        require(len(c.layer_types) == c.num_layers,
                f"layer_types has {len(c.layer_types)} entries for num_layers = {c.num_layers}")
        require(set(c.layer_types) <= {"full_attention", "sliding_attention"},
                f"layer_types {sorted(set(c.layer_types))} may only hold 'full_attention' and 'sliding_attention'")
    if "sliding_attention" in (c.layer_types or ()):
        require(isinstance(c.sliding_window, int) and c.sliding_window >= 1,
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

def known_fields(overrides):
    unknown = sorted(set(overrides) - {f.name for f in fields(DFlash2Config)})
    require(not unknown, f"unknown DFlash2Config fields {unknown}")
    return overrides

def default_target_layer_ids(num_target_layers, num_features=5):
    """§1: nf = max(1, min(5, Lt-3)) distinct layers, round(1 + i*(Lt-4)/(nf-1)) (36 -> [1, 9, 17, 25, 33])."""
    L, n = num_target_layers, max(1, min(num_features, num_target_layers - 3))
    if n == 1:
        return [max(0, min(L // 2, L - 2))]  # never the last layer (check_config says why)
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]

def text_config(target_config):
    """The language model's config of a target (a multimodal wrapper's text_config), read through its
    full-attention layers where layers differ in width (Gemma-4's head_dim), as its RoPE is (target_rope).
    Hyper-connection targets (DeepSeek-V4) are refused: each layer returns several residual streams
    (b, S, streams, H), and a DFlash context feature is one (b, S, H) state per layer."""
    tc = target_config.get_text_config()
    require(not getattr(tc, "hc_mult", None),
            f"the {tc.model_type!r} target has hyper-connections (hc_mult {getattr(tc, 'hc_mult', None)}): its layers "
            "return several residual streams, and the drafter reads one hidden state per layer")
    if getattr(tc, "is_heterogeneous", False):
        kinds = getattr(tc, "layer_types", None) or ()
        tc = tc.per_layer_config["full_attention" if "full_attention" in kinds else 0]
    return tc

def mlp_width(tc):
    """The target's intermediate_size; an MoE config without one (Qwen3.5-MoE) gives the width a token's routed
    experts add up to, moe_intermediate_size × num_experts_per_tok."""
    if getattr(tc, "intermediate_size", None):
        return tc.intermediate_size
    moe, k = getattr(tc, "moe_intermediate_size", None), getattr(tc, "num_experts_per_tok", None)
    require(moe and k, f"the target's {tc.model_type!r} config has no intermediate_size (nor moe_intermediate_size "
            "and num_experts_per_tok to take it from): pass intermediate_size for the drafter's MLP")
    return moe * k

def target_rope(tc):
    """The target's rope_parameters as DFlash2Config's rope_theta and rope_scaling (None: plain RoPE), §1:
    Gemma-3/4's full-attention set; partial_rotary_factor ignored (whole heads rotate) but under longrope, and
    kept under proportional, whose table it defines (the rest of each head is not rotated)."""
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    rope = dict(rope.get("full_attention", rope))
    partial = rope.pop("partial_rotary_factor", None) or getattr(tc, "partial_rotary_factor", None) or 1.0
    theta = rope.pop("rope_theta", None) or getattr(tc, "rope_theta", None) or 1e6
    kind = rope.pop("type", None) or rope.get("rope_type", "default")
    if kind == "longrope" and partial != 1:
        raise ValueError(f"target rope_type 'longrope' with partial_rotary_factor {partial}: its factors cover part "
                         "of a head, and the drafter rotates whole heads")
    if kind == "proportional" and partial != 1:
        rope["partial_rotary_factor"] = partial
    if "original_max_position_embeddings" in ROPE_KEYS.get(kind, ()) and hasattr(tc, "original_max_position_embeddings"):
        rope.setdefault("original_max_position_embeddings", tc.original_max_position_embeddings)
    return dict(rope_theta=theta, rope_scaling=None if kind == "default" else {**rope, "rope_type": kind})

def target_view(tc):
    """What the target's forward does to its tables (§1; Gemma's √H and soft-cap, Granite's and Falcon-H1's
    multipliers, Muse-Glimmer's multiplier before its cap), as DFlash2Config fields. A family that does
    anything else is caught by target.check_target_view."""
    gemma = tc.model_type.startswith(("gemma", "recurrent_gemma"))
    multiplier = getattr(tc, "output_multiplier", None) or getattr(tc, "lm_head_multiplier", None) or 1.0
    return dict(input_embedding_scale=tc.hidden_size ** 0.5 if gemma else getattr(tc, "embedding_multiplier", 1.0),
                output_multiplier=multiplier / getattr(tc, "logits_scaling", 1.0),
                final_logit_softcapping=getattr(tc, "final_logit_softcapping", None) or None)

# -----------------------------------------------------------------------------
# small pure helpers
def context_features(hidden_states, layer_ids):
    """cat(h_l for l in layer_ids); layer id l is HF hidden_states[l + 1] (index 0 = embeddings)."""
    return torch.cat([hidden_states[l + 1] for l in layer_ids], dim=-1)  # (b, S, nf·H)

def check_target_shape(c, num_target_layers, hidden_size, vocab_size):
    """A drafter only fits the target it was built for: same layer count, width and vocabulary."""
    for name, value in (("num_target_layers", num_target_layers), ("hidden_size", hidden_size),
                        ("vocab_size", vocab_size)):
        require(getattr(c, name) == value, f"the drafter has {name} {getattr(c, name)} but the target has {value}: "
                "a drafter only fits the target it was trained for")

def check_target(c, target):
    """check_target_shape on the loaded target, and a mask token inside its embedding table. -> (embedding, lm_head)."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    check_target_shape(c, target.config.get_text_config().num_hidden_layers, embed.weight.shape[1],
                       lm_head.weight.shape[0])
    require(c.mask_token_id < embed.weight.shape[0],
            f"mask_token_id {c.mask_token_id} is outside the target's embedding table [0, {embed.weight.shape[0]})")
    return embed, lm_head

def embed_tokens(c, embedding, ids):
    """§1: the raw embedding rows × input_embedding_scale, as engines embed the block (not the module's forward)."""
    x = F.embedding(ids, embedding.weight)
    return x * c.input_embedding_scale if c.input_embedding_scale != 1 else x

def lm_head_rows(lm_head, x):
    """lm_head(x) for a draft block's few rows: on a CPU 512 vocabulary rows of the weight at a time, which MKL
    multiplies 1.5–2× faster than the whole weight (7 × 576 × 49,152 in fp32: 13 ms against 8.5; 15 × 2560 ×
    151,936: 397 against 185), the same values to rounding; one product elsewhere, or for a head that is not a
    plain nn.Linear."""
    if x.device.type != "cpu" or type(lm_head) is not nn.Linear:
        return lm_head(x)
    w = lm_head.weight.split(512)
    b = lm_head.bias.split(512) if lm_head.bias is not None else [None] * len(w)
    return torch.cat([F.linear(x, w_i, b_i) for w_i, b_i in zip(w, b)], dim=-1)

def target_logits(c, lm_head, x, upcast=True, few_rows=False):
    """§1: lm_head(x) of final hidden states, at least fp32, × output_multiplier, soft-capped at the cap;
    upcast=False: as lm_head gives them where neither transform applies (a reader upcasts as it reads);
    few_rows: through lm_head_rows (a decode cycle's draft block)."""
    x = x.to(lm_head.weight.dtype)
    y = lm_head_rows(lm_head, x) if few_rows else lm_head(x)
    if not upcast and c.output_multiplier == 1 and not c.final_logit_softcapping:
        return y
    y = y.to(torch.promote_types(y.dtype, torch.float32))
    y = y * c.output_multiplier if c.output_multiplier != 1 else y
    cap = c.final_logit_softcapping
    return torch.tanh(y / cap) * cap if cap else y

def sampling_probs(logits, temperature, top_p=1.0, top_k=0):
    """softmax(logits / T), then the request's top-k / top-p, renormalised (fp32 or fp64): the
    target's p, and the q of a unary draft (the selector walk's q stays softmax(E / T) over K)."""
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

def check_sampling(temperature, top_p, top_k):
    """A request's setting: T finite, >= 0 (0: greedy); top_p in (0, 1], integer top_k >= 0 (1 and 0: no filter)."""
    require(temperature >= 0 and not math.isinf(temperature),  # NaN fails `>= 0`
            f"temperature ({temperature}) must be a finite number >= 0")
    require(0 < top_p <= 1, f"top_p ({top_p}) must be in (0, 1]")
    require(isinstance(top_k, int) and top_k >= 0, f"top_k ({top_k!r}) must be an integer >= 0")

def rope_frequencies(c, seq_len=None):
    """§1: the drafter's RoPE, of the target's type, from transformers' own table functions -> (inverse
    frequencies (hd/2,) fp32, cos / sin scale). seq_len bounds the positions: longrope's long factors past L₀,
    dynamic refused past max_position_embeddings (its table there depends on the model's history)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if (c.rope_scaling or {}).get("rope_type", "default") == "default":  # plain RoPE, θ^(−2m/hd)
        return 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim), 1.0
    rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    if rope["rope_type"] == "dynamic" and seq_len is not None and seq_len > c.max_position_embeddings:
        raise ValueError(f"dynamic RoPE at position {seq_len - 1}, past max_position_embeddings "
                         f"({c.max_position_embeddings}): its frequencies there depend on the model's history")
    if rope["rope_type"] == "yarn":
        rope.setdefault("factor", None)  # transformers then takes max_position_embeddings / L₀
    shape = LlamaConfig(hidden_size=c.num_heads * c.head_dim, num_attention_heads=c.num_heads, head_dim=c.head_dim,
                        max_position_embeddings=c.max_position_embeddings, rope_parameters=rope)
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](shape, None, seq_len)

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
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

# -----------------------------------------------------------------------------
# drafter pieces: attention with context injection, local convolution, decoder layer
class DraftCache:
    """The drafter's K/V cache, one (k, v) per layer, of committed context only (§5): block keys/values live
    for one draft pass, so the next pass only appends the context of the newly committed tokens."""
    def __init__(self, num_layers):
        self.kv, self.length = [None] * num_layers, 0  # length: context positions held

    def extend(self, layer_idx, k, v, keep=None):
        """Append the new context's k, v (b, nkv, n, hd); keep: hold only the last `keep` positions
        (a sliding layer's W − 1: the oldest that this pass's first query, the anchor, still sees)."""
        old = self.kv[layer_idx]
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        if keep is not None:
            k, v = k[:, :, max(0, k.shape[2] - keep):], v[:, :, max(0, v.shape[2] - keep):]
        self.kv[layer_idx] = (k, v)
        return k, v

def window_mask(query_pos, key_pos, window, mask=None):
    """A sliding layer's view (§1): position p sees key position k iff |p − k| < W (from each query, as the
    inference reference; never causal). query_pos (b, n), key_pos (b, m) -> (b, 1, n, m) bool, and mask."""
    near = (query_pos[:, :, None] - key_pos[:, None, :]).abs() < window
    return near[:, None] if mask is None else mask & near[:, None]

def cached_positions(cache, num_new, window, block_pos):
    """A sliding layer's key positions in a cached pass: the last W − 1 positions of the context once
    num_new more are appended (all DraftCache.extend keeps), then the block's block_pos (b, n)."""
    total = cache.length + num_new
    ctx = torch.arange(max(0, total - (window - 1)), total, device=block_pos.device)
    return torch.cat([ctx.expand(block_pos.shape[0], -1), block_pos], 1)

class Attention(nn.Module):
    """Queries from the block only; keys/values = [proj(ctx) ; proj(block)] (KV injection)."""
    def __init__(self, c, layer_idx):
        super().__init__()
        self.c = c
        sliding = (c.layer_types or ["full_attention"] * c.num_layers)[layer_idx] == "sliding_attention"
        self.window = c.sliding_window if sliding else None  # None: full attention
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _split_heads(self, y, n):
        return y.view(*y.shape[:2], n, self.c.head_dim).transpose(1, 2)  # (b, heads, N·B, hd)

    def forward(self, x, ctx, block_rope, ctx_rope, mask=None, cache=None, layer_idx=0):
        """x (b, N·B, H) blocks; ctx (b, S, H) projected context features (only the new ones
        when a cache is given); mask (b, 1, N·B, S + N·B) bool or None."""
        nh, nkv = self.c.num_heads, self.c.num_kv_heads
        q = apply_rope(self.q_norm(self._split_heads(self.q_proj(x), nh)), *block_rope)
        # the same k/v projections (and k_norm) serve context and block; only RoPE positions differ
        k_ctx = apply_rope(self.k_norm(self._split_heads(self.k_proj(ctx), nkv)), *ctx_rope)
        v_ctx = self._split_heads(self.v_proj(ctx), nkv)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer_idx, k_ctx, v_ctx, None if self.window is None else self.window - 1)
        k_blk = apply_rope(self.k_norm(self._split_heads(self.k_proj(x), nkv)), *block_rope)
        v_blk = self._split_heads(self.v_proj(x), nkv)
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
        out[i, c] = Σ_{τ<Kc} (base[τ, c] + δ[i, τ, g(c)]) · x[i − τ, c],  g(c) = c // G,  x[i − τ] := 0 if (i mod B) < τ
    x (b, N·B, H) block by block (or one block of at most B tokens); delta (b, N·B, Kc, H/G), computed
    at the output position; base (Kc, H). Packed blocks sit back to back, so a tap reaching across a
    block start would read the previous block: those taps are zeroed, not only the row's first."""
    length, H = x.shape[1], x.shape[2]
    Kc, G = base.shape[0], H // delta.shape[-1]
    pos_in_block = torch.arange(length, device=x.device) % block_size
    out = torch.zeros_like(x)
    for tap in range(Kc):
        shifted = F.pad(x, (0, 0, tap, 0))[:, :length]  # shifted[:, i] = x[:, i - tap]
        shifted = shifted * (pos_in_block >= tap).to(x.dtype)[:, None]
        coef = base[tap] + delta[:, :, tap].repeat_interleave(G, dim=-1)
        out = out + coef * shifted
    return out

class LocalConv(nn.Module):
    """Both sides of the convolution around one sublayer (§2): `prepare` convolves its normalised input u
    and returns the output side's δ, `finish` convolves its output with it (both δ come from u)."""
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

# -----------------------------------------------------------------------------
# candidate selector (§3)
class CandidateSelector(nn.Module):
    """E[k](p, c) = U[k, c] + Σ_r A[p, r] · P[k, r] · Bc[c, r],  P[k] = hidden_projection(h[k]).
    A, Bc: [V, R] tables ("free"), or ("factored") A[p] = W_A·E[p], Bc[c] = W_B·E[c] with E the
    target's frozen input embedding, passed in as `embedding`: 3·H·R parameters, not H·R + 2·V·R."""

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

    def edge_scores(self, h, unary, prev, cand, embedding=None):
        """h (..., H), unary (..., V), prev (...) predecessor ids, cand (..., K) -> (..., K) fp32 (even under
        autocast: in bf16 about 1% of the argmaxes flip); embedding: the target's, for factored codebooks."""
        return unary.gather(-1, cand).float() + self.pairwise_scores(h, prev, cand, embedding)

    def pairwise_scores(self, h, prev, cand, embedding=None):
        """E's low-rank part Σ_r A[p, r]·P[k, r]·Bc[c, r], fp32 (edge_scores without U): h (..., H), prev (...),
        cand (..., K) -> (..., K)."""
        require(not self.factored or embedding is not None,
                "a selector with factored codebooks needs the target's input embedding (embedding=)")
        with torch.autocast(h.device.type, enabled=False):
            P = F.linear(h.float(), self.hidden_projection.weight.float())  # (..., R)
            if self.factored:
                E = embedding.weight  # the raw rows, as the exported tables A = E·W_Aᵀ, Bc = E·W_Bᵀ read them
                A = F.linear(E[prev].float(), self.predecessor_projection.weight.float())  # (..., R)
                Bc = F.linear(E[cand].float(), self.successor_projection.weight.float())   # (..., K, R)
            else:
                A, Bc = self.predecessor_codebook[prev].float(), self.successor_codebook[cand].float()
            return torch.einsum("...r,...kr->...k", A * P, Bc)

    def walk(self, h, unary, anchor, temperature=0.0, generator=None, embedding=None):
        """The walk from the verified anchor (§3): h (M, B-1, H), unary (M, B-1, V), anchor (M,) -> path
        (M, B-1), cand (M, B-1, K), q (M, B-1, K) fp32: each pick's law given the predecessor the walk picked
        (any other q makes verification lossy); at T = 0 one-hot on the argmax (lowest index on ties)."""
        cand = unary.topk(self.top_k, dim=-1).indices            # (M, B-1, K)
        prev, path, qs = anchor, [], []
        for j in range(cand.shape[1]):
            s = self.edge_scores(h[:, j], unary[:, j], prev, cand[:, j], embedding)  # (M, K)
            if temperature == 0:
                pick = s.argmax(-1)
                q = F.one_hot(pick, s.shape[-1]).float()
            else:
                q = torch.softmax(s / temperature, dim=-1)
                pick = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            prev = cand[:, j].gather(-1, pick[:, None]).squeeze(-1)
            path.append(prev)
            qs.append(q)
        return torch.stack(path, 1), cand, torch.stack(qs, 1)

# -----------------------------------------------------------------------------
# the drafter
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
            m.base_kernel.zero_()
            m.base_kernel[:, 0] = 1.0
            m.kernel_projection.weight.zero_()
        elif isinstance(m, CandidateSelector) and m.factored:  # W_A keeps the linears' N(0, 0.02)
            m.successor_projection.weight.zero_()
        elif isinstance(m, CandidateSelector):
            nn.init.normal_(m.predecessor_codebook, std=0.02)
            m.successor_codebook.zero_()

class DFlash2Drafter(nn.Module):
    """Parameter names follow §7 (export: the state_dict, factored tables materialized); the target's are passed in."""
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c) if c.selector_top_k else None
        self.grad_checkpoint = False  # True: keep only each layer's input, recompute the layer in backward
        init_weights(self)

    def forward(self, block_embeds, block_pos, ctx_features, ctx_pos, mask=None, cache=None):
        """block_embeds (b, N·B, H) the block tokens' target embeddings at block_pos (b, N·B); ctx_features
        (b, S, nf·H) raw target features at ctx_pos (b, S), only the new context with a cache; mask
        (b, 1, N·B, S + N·B) bool (True = may attend) or None (= see everything). -> (b, N·B, H), normalized."""
        c = self.config
        ctx = self.hidden_norm(self.fc(ctx_features))  # computed once, shared by every layer
        positions = torch.cat([ctx_pos, block_pos], 1)
        longest = int(positions.max()) + 1 if (c.rope_scaling or {}).get("rope_type") in ("longrope", "dynamic") else None
        inv_freq, scale = rope_frequencies(c, longest)
        block_rope, ctx_rope = (rope_cos_sin(pos, inv_freq, scale, block_embeds.dtype) for pos in (block_pos, ctx_pos))
        masks = {None: mask}
        if c.sliding_window and "sliding_attention" in (c.layer_types or ()):
            masks[c.sliding_window] = window_mask(block_pos, positions if cache is None else
                                                  cached_positions(cache, ctx_features.shape[1], c.sliding_window,
                                                                   block_pos), c.sliding_window, mask)
        h, recompute = block_embeds, self.grad_checkpoint and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (h, ctx, block_rope, ctx_rope, masks[layer.self_attn.window], cache, i)
            h = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        if cache is not None:
            cache.length += ctx_features.shape[1]
        return self.norm(h)

    def propose(self, h, unary, anchor, temperature=0.0, generator=None, *, top_p=1.0, top_k=0, embedding=None):
        """Drafts for slots 1..B-1 (§3): the walk, or with the selector off the unary argmax (T = 0) or a draw
        from sampling_probs (the request's law). -> path (M, B-1), cand (M, B-1, K or V), q (M, B-1, K or V)
        the law each token was drawn from. embedding: the target's input embedding (factored codebooks)."""
        if self.config.selector_top_k:
            return self.candidate_selector.walk(h, unary, anchor, temperature, generator, embedding)
        M, n, V = unary.shape
        cand = torch.arange(V, device=unary.device).expand(M, n, V)
        if temperature == 0:
            path = unary.argmax(-1)
            return path, cand, F.one_hot(path, V).float()
        q = sampling_probs(unary, temperature, top_p, top_k)
        path = torch.multinomial(q.view(-1, V), 1, generator=generator).view(M, n)
        return path, cand, q

# -----------------------------------------------------------------------------
# block masking and anchors (§6)
def sample_anchors(loss_mask, max_anchors, generator=None):
    """Per row, up to max_anchors distinct positions a with loss_mask[a] = loss_mask[a + 1] = 1, sorted (§6).
    -> anchors (b, N) long, valid (b, N) bool; padding anchors sit at 0."""
    require(max_anchors >= 1, f"max_anchors ({max_anchors}) must be >= 1")
    b, lm = loss_mask.shape[0], loss_mask.bool()
    eligible = lm[:, :-1] & lm[:, 1:]                # (b, S-1): position a, with a + 1 < S
    chosen = []
    for row in eligible:
        idx = row.nonzero().squeeze(-1)
        perm = torch.randperm(len(idx), generator=generator)[:max_anchors]
        chosen.append(idx[perm.to(idx.device)].sort().values)
    N = max(1, max(len(a) for a in chosen))
    anchors = torch.zeros(b, N, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(b, N, dtype=torch.bool, device=loss_mask.device)
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
    """Dense (b, 1, N·B, S + N·B) bool mask over keys [context ; blocks] (§6): block j sees all of its own block
    and the real context tokens s < a_j (strictly: at inference the anchor's target state does not exist yet)."""
    (b, N), S = anchors.shape, attention_mask.shape[1]
    s = torch.arange(S, device=anchors.device)
    ctx = (s[None, None, :] < anchors[:, :, None]) & attention_mask.bool()[:, None, :]   # (b, N, S)
    ctx = ctx.repeat_interleave(block_size, dim=1)                                          # (b, N·B, S)
    blk = torch.arange(N * block_size, device=anchors.device) // block_size
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)                                  # (b, N·B, N·B)
    return torch.cat([ctx, own], dim=-1)[:, None]

# -----------------------------------------------------------------------------
# loss and metrics (§6)
def default_gamma(block_size):
    """γ of the position weights w_k = exp(-(k-1)/γ): the published 4/5/7 for B = 8/10/16, else B/2."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, block_size / 2)

def expected_acceptance_length(correct):
    """correct (..., B-1) bool per slot -> 1 + number of leading correct slots (bonus counted)."""
    return 1 + correct.long().cumprod(-1).sum(-1).float()

@dataclass(frozen=True)
class LossConfig:
    """The §6 loss's settings (train.py's loss flags), checked once, when made."""
    loss_type: str = "kl"                # unary term: "kl" to the target's softmax, or "ce" on its argmax
    gamma: float | None = None           # slot weights w_k = exp(-(k-1)/γ); None: default_gamma(B)
    alpha: float = 1.0                   # L = L_unary + α·L_sel
    selector_labels: str = "argmax"      # π: "argmax" (one-hot on the target's token) or "soft" (its law on C)
    soft_labels_at: tuple | None = None  # soft π at a sampling setting (T, top_p, top_k); None: softmax
    accept_at: tuple | None = None       # the acceptance metrics' sampling setting; None: (1, 1, 0)
    chunk_size: int | None = None        # slots whose (slots, V) logits live at once, recomputed in backward
    fused: bool = True                   # the unary term from FusedUnaryLoss; False: autograd through its formula

    def __post_init__(self):
        require(self.loss_type in ("kl", "ce"), f"loss_type ({self.loss_type!r}) must be 'kl' or 'ce'")
        require(self.selector_labels in ("argmax", "soft"),
                f"selector_labels ({self.selector_labels!r}) must be 'argmax' or 'soft'")
        require(self.soft_labels_at is None or self.selector_labels == "soft",
                f"soft_labels_at ({self.soft_labels_at}) needs selector_labels='soft'")
        require(self.gamma is None or self.gamma > 0, f"gamma ({self.gamma}) must be > 0 (or None for B's default)")
        require(self.alpha >= 0, f"alpha ({self.alpha}) must be >= 0")
        require(self.chunk_size is None or self.chunk_size >= 1, f"chunk_size ({self.chunk_size}) must be >= 1 or None")
        for name, setting in (("soft_labels_at", self.soft_labels_at), ("accept_at", self.accept_at)):
            if setting is not None:  # a sampling setting, and T = 0 has no law to read
                try:
                    check_sampling(*setting)
                    require(setting[0] != 0, "temperature must be > 0")
                except ValueError as e:
                    raise ValueError(f"{name} {setting}: {e}") from None

class FusedUnaryLoss(torch.autograd.Function):
    """slot_losses' unary term (§6) in few passes over V, with its gradient written out:
        kl = Σ_v p_v·(r_v − z_v) − lse(r) + lse(z),   ce = lse(z) − z_y,   ∂/∂z = softmax(z) − π
    z / r (n, V) drafter / target logits in lm_head's dtype (finite: lm_head outputs), read in at least fp32;
    p = softmax(r), π = p (kl) or one-hot(y) (ce), y = argmax r; lse(x) = x_j − log softmax(x)_j at j = argmax x,
    exact as that entry is >= 1/V. top_k > 0: also the selector's candidates C = topk(z, K), whose first is then
    argmax z, and z_C (n, K) at least fp32, whose gradient is added into ∂/∂z in place. Five passes forward (r's
    maximum, two softmaxes, the dot, z's top-K or maximum), two in place backward (autograd: about ten each way,
    and an (n, V) gradient for z_C). -> (term (n,), p (n, V) or None for ce, y (n,), C, z_C)."""
    @staticmethod
    def forward(ctx, z, r, hard, top_k):
        f = torch.promote_types(z.dtype, torch.float32)

        def softmax(x):  # 64 rows at a time into one fp32 tensor: no fp32 copy of a bf16 x is made
            out = torch.empty(x.shape, dtype=f, device=x.device)
            for x_i, out_i in zip(x.split(64), out.split(64)):
                torch.softmax(x_i, dim=-1, dtype=f, out=out_i)
            return out
        with torch.autocast(z.device.type, enabled=False):  # none of it in bf16
            r_max, label = r.max(-1, keepdim=True)
            cand = z.topk(top_k, dim=-1).indices if top_k else None
            top = cand[:, :1] if top_k else z.max(-1, keepdim=True).indices  # argmax z, from C's pass when there is C
            q = softmax(z)
            lse_z = (z.gather(-1, top).to(f) - q.gather(-1, top).log()).squeeze(-1)
            if hard:
                term, p = lse_z - z.gather(-1, label).squeeze(-1).to(f), None
            else:
                p = softmax(r)
                lse_r = (r_max.to(f) - p.gather(-1, label).log()).squeeze(-1)
                # Σ_v p_v·(r_v − z_v), 16 rows at a time through one fp32 buffer that stays in cache: no (n, V)
                # temporary, and on a CPU 1.6× the speed of 64 rows through fresh ones
                d = torch.empty(min(16, len(r)), r.shape[-1], dtype=f, device=r.device)
                rows = zip(p.split(16), r.split(16), z.split(16))
                dots = [torch.linalg.vecdot(p_i, d[:len(p_i)].copy_(r_i).sub_(z_i)) for p_i, r_i, z_i in rows]
                term = torch.cat(dots) - lse_r + lse_z
            z_cand = z.gather(-1, cand).to(f) if top_k else None
            ctx.save_for_backward(q, p if p is not None else label, cand)
            ctx.hard = hard
            ctx.mark_non_differentiable(*(x for x in (p, label, cand) if x is not None))
            return term, p, label.squeeze(-1), cand, z_cand

    @staticmethod
    def backward(ctx, grad_term, _p, _label, _cand, grad_z_cand):
        q, target, cand = ctx.saved_tensors  # q is not needed again: the gradient is built in its memory
        grad = q.scatter_add_(-1, target, -torch.ones_like(target, dtype=q.dtype)) if ctx.hard else q.sub_(target)
        grad.mul_(grad_term[:, None])
        return grad.scatter_add_(-1, cand, grad_z_cand) if cand is not None else grad, None, None, None

def slot_losses(h, unary, ref, prev, selector=None, loss_type="kl", selector_labels="argmax", soft_labels_at=None,
                embedding=None, fused=True):
    """The §6 terms of each slot, for slots laid out any way (...):
        unary   kl: Σ_v p_v·(log p_v − log q_v),  p = softmax(ref), q = softmax(unary);  ce: −log q_y,  y = argmax ref
        sel     −Σ_{c∈C} π_c·log softmax_K(E(prev, C))_c,  C = topk(unary, K),  π = one-hot(y) ("argmax") or the
                target's law on C ("soft": p, or sampling_probs(ref, *soft_labels_at) when given)
    h (..., H) drafter output, unary / ref (..., V) drafter / target logits, prev (...) predecessor ids,
    embedding the target's input embedding (factored codebooks) -> (unary term, selector term, Σ_{c∈C} π_c:
    the slot's selector weight), each (...); the last two None without a selector. fused: the unary term
    from FusedUnaryLoss (the same values in fewer passes over V, for finite logits); False: the formula."""
    soft, top_k = selector is not None and selector_labels == "soft", selector.top_k if selector is not None else 0
    if fused:
        term, p, label, cand, unary_cand = FusedUnaryLoss.apply(unary.flatten(0, -2), ref.flatten(0, -2),
                                                                loss_type == "ce", top_k)
        term, label = term.view(unary.shape[:-1]), label.view(unary.shape[:-1])
        p = p.view(ref.shape) if p is not None else F.softmax(ref, dim=-1, dtype=term.dtype) if soft else None
    else:
        logq = F.log_softmax(unary, dim=-1)
        label = ref.argmax(-1)
        p = F.softmax(ref, dim=-1) if loss_type == "kl" or soft else None  # (..., V): only where a term needs it
        if loss_type == "kl":  # xlogy: a target logit of -inf gives p = 0, a term of 0 (not 0·-inf = NaN)
            term = (torch.special.xlogy(p, p) - p * logq).sum(-1)
        else:
            term = -logq.gather(-1, label[..., None]).squeeze(-1)
        if top_k:
            cand = unary.topk(top_k, dim=-1).indices                     # (..., K)
            unary_cand = unary.gather(-1, cand)
    if selector is None:
        return term, None, None
    cand, unary_cand = cand.view(*label.shape, top_k), unary_cand.view(*label.shape, top_k)
    p_label = sampling_probs(ref, *soft_labels_at) if soft and soft_labels_at else p
    pi = p_label.gather(-1, cand) if soft else (cand == label[..., None]).to(term.dtype)
    scores = unary_cand + selector.pairwise_scores(h, prev, cand, embedding)  # edge_scores, U(C) in U's precision
    log_sel = F.log_softmax(scores, dim=-1)
    return term, -(pi * log_sel.to(term.dtype)).sum(-1), pi.sum(-1)

def weighted_sums(c, selector, embed, lm_head, cfg, h, ref_h, prev, w):
    """slot_losses' Σ w·terms over n slots (n bounds the memory): h, ref_h (n, H) final hidden states, prev, w (n,)."""
    logits = functools.partial(target_logits, c, lm_head, upcast=not cfg.fused)  # FusedUnaryLoss upcasts as it reads
    term, sel, mass = slot_losses(h, logits(h), logits(ref_h), prev, selector, cfg.loss_type, cfg.selector_labels,
                                  cfg.soft_labels_at, embed, cfg.fused)
    if sel is None:
        return ((w * term).sum(),)
    return (w * term).sum(), (w * sel).sum(), (w * mass).sum()

def block_slots(anchors, anchor_valid, loss_mask, block_size):
    """Slot k = 1..B-1 of block j predicts t = a_j + k and counts iff its anchor is real, t < S and loss_mask[t] = 1;
    its label, reference logits and predecessor are read at src = t - 1 (t clamped). -> counted, src (b, N, B-1)."""
    S = loss_mask.shape[1]
    t = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)   # (b, N, B-1)
    t_in = t.clamp(max=S - 1)
    counted = anchor_valid[:, :, None] & (t < S) & loss_mask.bool().gather(1, t_in.flatten(1)).view_as(t)
    return counted, t_in - 1

def packed_slots(drafter, embed, input_ids, attention_mask, loss_mask, context, last_hidden, anchors, anchor_valid):
    """The drafter over a batch's packed blocks, per slot (block_slots) -> h (b, N, B-1, H), ref_h (b, N, B-1, H) the
    target's last hidden states at t - 1, prev (b, N, B-1) the predecessor ids there, counted (b, N, B-1) bool."""
    c, dtype = drafter.config, drafter.fc.weight.dtype
    B, (b, S), N = c.block_size, input_ids.shape, anchors.shape[1]
    ids, pos = block_layout(input_ids, anchors, B, c.mask_token_id)
    mask = block_attention_mask(anchors, attention_mask, B)
    ctx_pos = torch.arange(S, device=input_ids.device).expand(b, S)
    h = drafter(embed_tokens(c, embed, ids).to(dtype), pos, context.to(dtype), ctx_pos, mask).view(b, N, B, -1)
    counted, src = block_slots(anchors, anchor_valid, loss_mask, B)
    rows = torch.arange(b, device=input_ids.device)[:, None, None]
    return h[:, :, 1:], last_hidden[rows, src], input_ids[rows, src], counted

def loss_sums(drafter, target, input_ids, attention_mask, loss_mask, context, last_hidden, anchors, anchor_valid,
              cfg=LossConfig()):
    """The sums the §6 loss divides, over the counted slots (slot_losses, w_k = exp(-(k-1)/γ)): unary = Σ w·term,
    unary_weight = Σ w; with a selector also selector = Σ w·sel, selector_weight = Σ w·m (π's mass on the top-K).
    input_ids / attention_mask / loss_mask (b, S), context (b, S, nf·H) the target's context_features, last_hidden
    (b, S, H) its last hidden state (after the final norm), anchors / anchor_valid (b, N). -> {name: sum tensor}."""
    c = drafter.config
    embed, lm_head = check_target(c, target)
    h, ref_h, prev, counted = packed_slots(drafter, embed, input_ids, attention_mask, loss_mask, context, last_hidden,
                                           anchors, anchor_valid)
    gamma = default_gamma(c.block_size) if cfg.gamma is None else cfg.gamma
    logits_dtype = torch.promote_types(lm_head.weight.dtype, torch.float32)  # target_logits': fp64 stays fp64
    w = torch.exp(-torch.arange(c.block_size - 1, device=h.device, dtype=logits_dtype) / gamma) * counted
    idx = counted.flatten().nonzero().squeeze(-1)      # only counted slots reach the vocabulary
    slots = [x.flatten(0, 2)[idx] for x in (h, ref_h, prev, w)]
    chunk_sums = functools.partial(weighted_sums, c, drafter.candidate_selector, embed, lm_head, cfg)
    n, parts = cfg.chunk_size or max(1, len(idx)), []
    for i in range(0, max(1, len(idx)), n):
        chunk = [x[i:i + n] for x in slots]
        parts.append(torch.utils.checkpoint.checkpoint(chunk_sums, *chunk, use_reentrant=False) if cfg.chunk_size
                     else chunk_sums(*chunk))
    totals = [sum(p) for p in zip(*parts)]
    sums = {"unary": totals[0], "unary_weight": w.sum()}
    if c.selector_top_k:
        sums.update(selector=totals[1], selector_weight=totals[2])
    return sums

def loss_from_sums(sums, alpha, weights=None):
    """L = unary / unary_weight + α·selector / selector_weight (§6; a sum over no slot is 0 / 1e-9 = 0).
    weights: the denominators to use instead of the batch's own (data parallel: the ranks' mean, so the
    ranks' mean gradient is the global batch's). -> (L, {loss, unary_loss, selector_loss} detached)."""
    w_unary, w_selector = (sums["unary_weight"], sums.get("selector_weight")) if weights is None else weights
    loss = unary_loss = sums["unary"] / w_unary.clamp(min=1e-9)
    stats = {"unary_loss": unary_loss.detach()}
    if "selector" in sums:
        selector_loss = sums["selector"] / w_selector.clamp(min=1e-9)
        loss = loss + alpha * selector_loss
        stats["selector_loss"] = selector_loss.detach()
    return loss, {**stats, "loss": loss.detach()}

def dflash2_loss(drafter, target, input_ids, attention_mask, loss_mask, context, last_hidden, anchors, anchor_valid,
                 cfg=LossConfig()):
    """L = L_unary + α·L_sel of a batch: loss_from_sums(loss_sums(...)). -> (L, detached stats)."""
    return loss_from_sums(loss_sums(drafter, target, input_ids, attention_mask, loss_mask, context, last_hidden,
                                    anchors, anchor_valid, cfg), cfg.alpha)

def metric_hits(drafter, embed, lm_head, h, ref_h, prev, accept_at):
    """h / ref_h (M, B-1, H), prev (M, B-1) for M blocks -> (M, B-1) per metric (§6): bool, unary argmax, label in
    the top-K (oracle), teacher-forced pick (tf) and walk right; float at accept_at = (T, top_p, top_k): Σ min(p, q),
    the chance rejection sampling keeps the unary / selector draft (§4), and the target's mass on the top-K."""
    unary, ref = target_logits(drafter.config, lm_head, h), target_logits(drafter.config, lm_head, ref_h)
    label, p = ref.argmax(-1), sampling_probs(ref, *accept_at)
    hits = {"unary": unary.argmax(-1) == label, "accept_unary": torch.minimum(p, sampling_probs(unary, *accept_at)).sum(-1)}
    sel = drafter.candidate_selector
    if sel is not None:
        cand = unary.topk(sel.top_k, dim=-1).indices
        scores, p_cand = sel.edge_scores(h, unary, prev, cand, embed), p.gather(-1, cand)
        tf_pick = cand.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        hits.update(oracle=(cand == label[..., None]).any(-1), tf=tf_pick == label,
                    walk=sel.walk(h, unary, prev[:, 0], embedding=embed)[0] == label, mass_at_k=p_cand.sum(-1),
                    accept_selector=torch.minimum(p_cand, F.softmax(scores / accept_at[0], -1).to(p.dtype)).sum(-1))
    return hits

@torch.no_grad()
def dflash2_metrics(drafter, target, input_ids, attention_mask, loss_mask, context, last_hidden, anchors, anchor_valid,
                    cfg=LossConfig()):
    """The §6 metrics of a batch (loss_sums' inputs) as floats, at cfg.accept_at (None: T = 1, no filter), a
    chunk of whole blocks at a time (the walk runs along a block); an uncounted slot ends an acceptance run."""
    embed, lm_head = check_target(drafter.config, target)
    h, ref_h, prev, counted = packed_slots(drafter, embed, input_ids, attention_mask, loss_mask, context, last_hidden,
                                           anchors, anchor_valid)
    flat = [x.flatten(0, 1) for x in (h, ref_h, prev)]
    M = len(flat[0])
    size = M if cfg.chunk_size is None else max(1, cfg.chunk_size // counted.shape[-1])
    parts = [metric_hits(drafter, embed, lm_head, *(x[i:i + size] for x in flat), cfg.accept_at or (1.0, 1.0, 0))
             for i in range(0, M, size)]
    hit = {k: torch.cat([p[k] for p in parts]).view_as(counted) for k in parts[0]}
    blocks, n_blocks = counted[..., 0], counted[..., 0].sum().clamp(min=1)
    per_slot = lambda hit, among: ((hit & among).sum((0, 1)) / among.sum((0, 1)).clamp(min=1)).tolist()
    overall = lambda hit: ((hit * counted).sum() / counted.sum().clamp(min=1)).item()
    mean_al = lambda hit: (expected_acceptance_length(hit & counted)[blocks].sum() / n_blocks).item()
    m = {"slot_acc": per_slot(hit["unary"], counted), "al_unary": mean_al(hit["unary"]),
         "accept_unary": overall(hit["accept_unary"])}
    if "walk" in hit:
        run = (hit["walk"] & counted).long().cumprod(-1).bool()
        reached = counted & torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], -1)  # prefix all right
        m.update(oracle=overall(hit["oracle"]), selector_tf_acc=overall(hit["tf"]),
                 walk_slot_acc=per_slot(hit["walk"], reached),
                 al_walk=mean_al(hit["walk"]), al_oracle=mean_al(hit["oracle"]),
                 accept_selector=overall(hit["accept_selector"]), mass_at_k=overall(hit["mass_at_k"]))
    return m

# -----------------------------------------------------------------------------
# speculative decoding (§4, §5)
def verify_greedy(draft, logits):
    """T = 0 (§4): the longest prefix of draft (n,) equal to argmax logits (n+1, V), then the next argmax."""
    pred = logits.argmax(-1)
    n_acc = int((draft == pred[:-1]).long().cumprod(0).sum())
    return n_acc, int(pred[n_acc])

def acceptance_probability(p, q, token):
    """Keep a draft token with probability min(1, p[token] / q[token]). A token the target
    gives p = 0 is never kept, even where q = 0 too (0/0 would be NaN, and u >= NaN is False)."""
    return torch.where(p[token] > 0, torch.clamp(p[token] / q[token], max=1.0), 0.0)

def residual_distribution(p, q):
    """After a rejection, sample from normalize(max(0, p - q)); p itself if that is all zero
    (only when p = q, where rejection cannot happen anyway)."""
    r = (p - q).clamp(min=0)
    return r / r.sum() if r.sum() > 0 else p

def verify_sampled(draft, q, p, generator=None):
    """T > 0 rejection sampling (Leviathan et al. / Chen et al., §4) with a sparse proposal: draft (n,),
    q (n, V) the law each draft was drawn from (0 outside its candidates, conditional on the drafted
    predecessor), p (n+1, V) the target's laws. Emitted tokens follow p exactly. -> (n_accepted, bonus)."""
    for i, d in enumerate(draft.tolist()):
        u = torch.rand((), generator=generator, device=p.device, dtype=p.dtype)
        if u >= acceptance_probability(p[i], q[i], d):
            return i, int(torch.multinomial(residual_distribution(p[i], q[i]), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))

@dataclass
class GenerationStats:
    acceptance_lengths: list = field(default_factory=list)   # tokens committed per cycle, bonus included
    accepted_per_slot: list = field(default_factory=list)    # cycles in which slot k was accepted
    target_forwards: int = 0                                 # prefill included
    new_tokens: int = 0
    decode_seconds: float = 0.0                              # everything after the prefill

    @property
    def mean_acceptance_length(self):
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_second(self):
        return self.new_tokens / max(self.decode_seconds, 1e-9)

def _check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k):
    require(input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] >= 1,
            f"input_ids shape {tuple(input_ids.shape)}: expected (1, P) with P >= 1 (batch 1)")
    require(isinstance(max_new_tokens, int) and max_new_tokens >= 1,
            f"max_new_tokens ({max_new_tokens!r}) must be an integer >= 1")
    check_sampling(temperature, top_p, top_k)

def sample(logits, temperature, top_p=1.0, top_k=0, generator=None):
    """One token per row of logits (..., V): the argmax at T = 0, else a draw from sampling_probs -> (...,). The
    target alone (target_generate, spec_generate's first token, regeneration) draws here: serving's law."""
    if temperature == 0:
        return logits.argmax(-1)
    p = sampling_probs(logits, temperature, top_p, top_k)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).view(p.shape[:-1])

def device_time(device):
    """time.perf_counter() once the device's queued work is done: the clock of GenerationStats and the bench."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

def draft_forward(drafter, embed, lm_head, anchor, new_ctx, draft_cache):
    """The draft half (§5): the block [anchor, MASK, ..., MASK] at a..a+B−1 through the drafter, which first
    appends new_ctx (1, ·, nf·H), the target features it has not read yet, to draft_cache; then the target's
    logits of slots 1..B−1. anchor (1,) long. -> (h (1, B−1, H), unary (1, B−1, V) fp32): propose's inputs."""
    c, dev, dtype = drafter.config, anchor.device, drafter.fc.weight.dtype
    a = draft_cache.length + new_ctx.shape[1]  # the context is 0..a−1, the anchor sits at a
    block = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = anchor
    h = drafter(embed_tokens(c, embed, block).to(dtype), torch.arange(a, a + c.block_size, device=dev)[None],
                new_ctx.to(dtype), torch.arange(draft_cache.length, a, device=dev)[None], cache=draft_cache)[:, 1:]
    return h, target_logits(c, lm_head, h, few_rows=True).float()

def verify_forward(target, cache, anchor, draft, layer_ids):
    """The verify half (§5): the target reads [anchor ; draft] after its cache; logits row i is its law after
    draft[:i] (row n: the bonus's when all are kept). -> (logits (n+1, V), context features (1, n+1, nf·H))."""
    out = target(torch.cat([anchor, draft])[None], cache=cache, use_cache=True, output_hidden_states=True)
    return out.logits[0], context_features(out.hidden_states, layer_ids)

def q_over_vocab(cand, q, vocab_size):
    """q (..., K) of candidates cand (..., K) spread over the vocabulary -> (..., V) fp64, 0 off the candidates."""
    dense = torch.zeros(*cand.shape[:-1], vocab_size, device=cand.device, dtype=torch.float64)
    return dense.scatter_(-1, cand, q.double())

def rollback(cache, features, n, n_acc):
    """Keep what verification accepted (§5): the target cache drops the n − n_acc rejected drafts; the next new_ctx
    (1, n_acc + 1, nf·H) is the features of the anchor and the accepted drafts (the bonus is the next anchor)."""
    # transformers 5: crop(-m) drops the last m tokens. crop(0) drops nothing from a full-attention layer, but
    # trims a sliding-window layer that records its past (spec_generate's cache) back to W − 1: call it anyway
    cache.crop(-(n - n_acc))
    return features[:, :n_acc + 1]

def speculative_decode_step(drafter, target, cache, draft_cache, anchor, new_ctx, n, temperature=0.0, top_p=1.0,
                            top_k=0, generator=None):
    """One draft-and-verify cycle (§5): the anchor (1,) at a is the last emitted token, the target's cache holds
    0..a−1, the drafter's 0..a−1 less new_ctx. Draft n <= B−1 tokens, verify them in one target pass (greedy
    or sampled), keep the accepted prefix and a bonus. -> (the accepted drafts then the bonus, next new_ctx)."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    h, unary = draft_forward(drafter, embed, lm_head, anchor, new_ctx, draft_cache)
    path, cand, q = drafter.propose(h, unary, anchor, temperature, generator, top_p=top_p, top_k=top_k, embedding=embed)
    draft = path[0, :n]
    logits, features = verify_forward(target, cache, anchor, draft, drafter.config.target_layer_ids)
    if temperature == 0:
        n_acc, bonus = verify_greedy(draft, logits)
    else:
        q_vocab = q_over_vocab(cand[0, :n], q[0, :n], logits.shape[-1])
        p = sampling_probs(logits.double(), temperature, top_p, top_k)
        n_acc, bonus = verify_sampled(draft, q_vocab, p, generator)
    return draft[:n_acc].tolist() + [bonus], rollback(cache, features, n, n_acc)

def target_cache(target, forward_tokens=0):
    """The target's transformers cache for decoding one sequence. forward_tokens > 0: after a forward of at most
    that many tokens, crop(−m) can take back any m of them (§5): sliding-window layers keep the keys past their
    window, and recurrent layers (linear attention, Mamba, short convolutions) the state after each of the
    forward's tokens, until the next crop. Without them a hybrid target cannot be rolled back; with fewer the
    states are misaligned: transformers keeps the last k states of a forward, and crop(−m) takes the m-th from
    the end of [state before the forward] + those k but the last."""
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    if forward_tokens:
        cache.activate_past_recording(recurrent_states_to_keep=forward_tokens)
    return cache

def _emit(tokens, new, stop_ids, max_new_tokens):
    """Append new tokens, stopping after a stop token or at max_new_tokens; -> done."""
    for tok in new:
        tokens.append(tok)
        if tok in stop_ids or len(tokens) >= max_new_tokens:
            return True
    return False

@torch.no_grad()
def target_generate(target, input_ids, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                    stop_token_ids=None, generator=None):
    """Plain autoregressive decoding with the same cache and sampling code: the baseline."""
    _check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k)
    stats, stop_ids, tokens = GenerationStats(), set(stop_token_ids or ()), []
    cache = target_cache(target)
    logits = target(input_ids, cache=cache, use_cache=True).logits[0, -1]
    start, stats.target_forwards = device_time(input_ids.device), 1
    while not _emit(tokens, [int(sample(logits, temperature, top_p, top_k, generator))], stop_ids, max_new_tokens):
        logits = target(torch.tensor([[tokens[-1]]], device=input_ids.device), cache=cache, use_cache=True).logits[0, -1]
        stats.target_forwards += 1
    stats.decode_seconds, stats.new_tokens = device_time(input_ids.device) - start, len(tokens)
    return torch.tensor(tokens, dtype=torch.long), stats

@torch.no_grad()
def spec_generate(drafter, target, input_ids, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                  stop_token_ids=None, generator=None):
    """Speculative decoding of one sequence with a DFlash/DFlash2 drafter (§5). -> (new token ids (n,),
    GenerationStats). Equals target_generate's output token for token at T = 0, follows its law at T > 0."""
    _check_generation_args(input_ids, max_new_tokens, temperature, top_p, top_k)
    c, dev, B = drafter.config, input_ids.device, drafter.config.block_size
    check_target(c, target)
    stats, stop_ids, tokens = GenerationStats(accepted_per_slot=[0] * (B - 1)), set(stop_token_ids or ()), []
    cache, draft_cache = target_cache(target, forward_tokens=B), DraftCache(c.num_layers)  # [anchor ; <= B−1 drafts]
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True)
    new_ctx = context_features(out.hidden_states, c.target_layer_ids)  # features not yet in draft_cache
    start, stats.target_forwards = device_time(dev), 1
    first = int(sample(out.logits[0, -1], temperature, top_p, top_k, generator))
    done = _emit(tokens, [first], stop_ids, max_new_tokens)
    while not done:
        n = min(B - 1, max_new_tokens - len(tokens) - 1)  # never draft past max_new_tokens
        anchor = torch.tensor([tokens[-1]], device=dev)  # the last emitted token; the target has not read it yet
        committed, new_ctx = speculative_decode_step(drafter, target, cache, draft_cache, anchor, new_ctx, n,
                                                     temperature, top_p, top_k, generator)
        stats.target_forwards += 1
        before = len(tokens)
        done = _emit(tokens, committed, stop_ids, max_new_tokens)
        kept = len(tokens) - before  # fewer than committed when a stop token ends the cycle early
        stats.acceptance_lengths.append(kept)
        for k in range(min(len(committed) - 1, kept)):  # the accepted drafts among the kept tokens
            stats.accepted_per_slot[k] += 1
    stats.decode_seconds, stats.new_tokens = device_time(dev) - start, len(tokens)
    return torch.tensor(tokens, dtype=torch.long), stats
