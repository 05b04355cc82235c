"""
The frozen target: where it lives, its tokenizer, config and weights, and the dtype it runs in; what its
family applies, read from its config with transformers' own functions (the drafter's shape and RoPE, the
transforms of its tables), and the check that the drafter reads its tables as its own forward does; the
mask token the drafter's blocks are filled with (ALGORITHM.md §1); the features the loss reads, cached.
Not here: the drafter itself (dflash2.py computes it; harness/checkpoint.py builds a run's and writes
exports), chat data (harness/data.py), the flags (each entry point declares its own).

    c = drafter_config(target.config, mask_token_id=m)      # the drafter of this target
    drafter = dflash2.DFlash2Drafter(c, rope=rope_tables(c))
    view = decoding_view(c, target)                          # the target as the drafter reads it

    tokenizer = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")    # a hub id or a model folder
    target = load_target("path/to/model.Q4_1.gguf", "auto", torch.device("cpu"))  # or a GGUF file
    features = TargetFeatures(key, layer_ids)   # each row's features once (--cache-target-features)

A GGUF file is read by transformers itself (the `gguf` package), dequantized to the dtype
asked for: the file's folder and name go to `from_pretrained(folder, gguf_file=name)`.
"""
import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import safetensors.torch
import torch
import transformers

import dflash2
from harness.data import at_least, load_chat_template


def source(target_path):
    """--target (a model folder, hub id or .gguf file) -> (what from_pretrained reads, its keyword arguments). A
    local folder must be a model folder and a local file a .gguf: anything else that exists locally is a mistake,
    not a hub id (transformers would otherwise blame a missing tokenizer package)."""
    p = Path(target_path)
    if p.is_dir() and not (p / "config.json").is_file():
        raise ValueError(f"--target {target_path}: the folder has no config.json, it is not a Hugging Face model "
                         "folder")
    if p.exists() and not p.is_dir():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"--target {target_path}: a file that is not .gguf; expected a model folder, a hub id or "
                             "a GGUF file")
        return str(p.resolve().parent), {"gguf_file": p.name}
    return target_path, {}


def is_gguf(target_path):
    return bool(source(target_path)[1])


def load_tokenizer(target_path, chat_template=None):
    """The target's tokenizer, with --chat-template's text if given and a pad token."""
    path, kw = source(target_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kw)
    if chat_template:
        tokenizer.chat_template = load_chat_template(chat_template)
    if tokenizer.pad_token is None:  # padding is masked everywhere, any real token will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_and_config(target_path, chat_template=None):
    """What a run reads of the target before its weights: its tokenizer (and --chat-template) and its config."""
    return load_tokenizer(target_path, chat_template), load_config(target_path)


def load_config(target_path):
    """The target's transformers config; a GGUF file's is read from its header, no weights."""
    path, kw = source(target_path)
    try:
        return transformers.AutoConfig.from_pretrained(path, **kw)
    except Exception as e:  # missing folder, malformed JSON, unknown model type, not cached
        raise ValueError(f"cannot read the target's config at {target_path!r}: {e}") from e


def native_bf16_cpu():
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16). There a bf16
    product runs several times faster than a float32 one; elsewhere torch emulates bf16, slower."""
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_amx_tile_supported",
                                                                        "_is_avx512_bf16_supported"))


def training_dtype(flag, device):
    """--dtype -> (the target's dtype for training and batched generation, why). Below float32
    the drafter's step also runs under bf16 autocast (its weights and optimizer stay float32)."""
    if flag != "auto":
        return getattr(torch, flag), f"--dtype {flag}"
    if device.type == "cuda":
        return torch.bfloat16, "a GPU"
    if native_bf16_cpu():
        return torch.bfloat16, "this CPU multiplies bf16 in hardware (AMX or AVX512-BF16)"
    return torch.float32, "this CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated and slower"


def below_float32(target):
    """Under bf16 autocast: the drafter's step (its loss and metrics) when the target is below float32."""
    return torch.autocast(target.device.type, dtype=torch.bfloat16,
                          enabled=target.dtype in (torch.bfloat16, torch.float16))


def decoding_dtype(device, dtype):
    """The target's dtype for decoding one sequence: float32 on a CPU, even one that multiplies bf16 in hardware.
    There a bf16 forward of 8 tokens, a verification, costs 0.76x a float32 one (AMX), but it is not the target's
    greedy decoding: a forward of k tokens rounds its bf16 products otherwise than k forwards of one, and on
    SmolLM2-135M about 1% of the greedy tokens change when read 8 at a time (10 of 1,088; `python -m bench.real
    --decoding-dtypes`, bench/RESULTS.md#decoding-dtype), where spec_generate would leave target_generate. In
    float32 none did (0 of 1,058), though a k-row float32 product need not round as k one-row ones do either: its
    differences are float32's, far below bf16's, and flipped no argmax measured."""
    return torch.float32 if device.type == "cpu" else dtype


def model_class(config):
    """The auto class that builds a target of this config: its causal LM, or for a multimodal wrapper that has
    none (Muse-Glimmer) its image-text-to-text model. The drafter reads either through its language model:
    get_text_config(), get_input_embeddings(), get_output_embeddings() and the forward's hidden states."""
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise ValueError(f"the {config.model_type!r} target has neither a causal-LM nor an image-text-to-text class in "
                     "transformers: the drafter needs a model that predicts the next token")


def load_target(target_path, dtype_flag, device):
    """Frozen, in training_dtype(dtype_flag, device)."""
    path, kw = source(target_path)
    model = model_class(load_config(target_path)).from_pretrained(path, dtype=training_dtype(dtype_flag, device)[0],
                                                                  **kw)
    return model.to(device).eval().requires_grad_(False)


# -----------------------------------------------------------------------------
# the target's family: the drafter's shape, RoPE and view of the tables (ALGORITHM.md §1)


def drafter_config(target_config, **overrides):
    """The DFlash2Config of a drafter for this transformers target config: its width, RoPE (config_rope) and
    table transforms (config_transforms); overrides set any other field (mask_token_id is required)."""
    dflash2.require("mask_token_id" in overrides,
                    "drafter_config needs mask_token_id: an existing but unused token id of the target")
    tc = text_config(target_config)
    L, n_heads = tc.num_hidden_layers, tc.num_attention_heads
    shape = dict(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                 intermediate_size=overrides.get("intermediate_size") or mlp_width(tc),
                 num_heads=n_heads, num_kv_heads=getattr(tc, "num_key_value_heads", None) or n_heads,
                 head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // n_heads,
                 num_target_layers=L, target_layer_ids=dflash2.default_target_layer_ids(L),
                 rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
                 **config_rope(tc), **config_transforms(tc))
    c = dflash2.DFlash2Config(**{**shape, **known_fields(overrides)})
    check_rope(c)
    return c


# the drafter fields every entry point that builds a drafter sets with a flag of its own (--num-layers, ...); the
# rest of DFlash2Config comes from the target (its width and RoPE) or from --drafter-config
OWN_FLAGS = {"num_layers": "--num-layers", "block_size": "--block-size", "conv_kernel_size": "--conv-kernel-size",
             "selector_top_k": "--selector-top-k"}


class DrafterFields(argparse.Action):
    """argparse action of --drafter-config: a JSON object of other DFlash2Config fields; given twice, the fields of
    both, the later's where they meet."""
    def __call__(self, parser, namespace, values, option_string=None):
        try:
            fields = json.loads(values)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentError(self, f"{values!r} is not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(fields, dict):
            raise argparse.ArgumentError(self, f"{values!r} is not a JSON object of DFlash2Config fields")
        unknown = unknown_fields(fields)
        own = [OWN_FLAGS[k] for k in fields if k in OWN_FLAGS]
        if unknown or own:
            why = (f"unknown DFlash2Config fields {unknown}" if unknown else
                   f"set {', '.join(own)} with {'its' if len(own) == 1 else 'their'} own flag")
            raise argparse.ArgumentError(self, f"{values}: {why}")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), **fields})


def add_drafter_flags(group):
    """The drafter flags of the entry points that build a drafter without training it (the export job, the memory
    plan), declared as train.py declares them (a test holds them to its name, type and default)."""
    group.add_argument("--num-layers", type=at_least(1), default=2, help="draft layers")
    group.add_argument("--block-size", type=at_least(2), default=8, help="B: anchor + B-1 drafted tokens")
    group.add_argument("--conv-kernel-size", type=at_least(0), default=2, help="local convolution taps Kc (0 disables)")
    group.add_argument("--selector-top-k", type=at_least(0), default=16, help="selector candidates K (0 disables)")
    group.add_argument("--drafter-config", action=DrafterFields, default={}, metavar="JSON", help="other DFlash2Config "
                       "fields, as train.py takes them")


def drafter_fields(args):
    """The DFlash2Config fields an entry point's drafter flags set (OWN_FLAGS and --drafter-config)."""
    return {**{k: getattr(args, k) for k in OWN_FLAGS}, **args.drafter_config}


def unknown_fields(fields):
    """The keys of fields that are no DFlash2Config field, sorted."""
    return sorted(set(fields) - {f.name for f in dataclasses.fields(dflash2.DFlash2Config)})


def known_fields(overrides):
    """overrides, once every key is a DFlash2Config field."""
    unknown = unknown_fields(overrides)
    dflash2.require(not unknown, f"unknown DFlash2Config fields {unknown}")
    return overrides


HYPER_CONNECTION_FIELDS = ("hc_mult", "hc_count")  # DeepSeek-V4's and Qwen4-Exp's residual streams per layer


def text_config(target_config):
    """The language model's config of a target (a multimodal wrapper's text_config), read through its
    full-attention layers where layers differ in width (Gemma-4's head_dim), as its RoPE is (config_rope).
    A config that counts residual streams (hyper-connections) is refused here, before the weights load; the
    forward's widths (dflash2.check_hidden_states) refuse the families whose configs name them otherwise."""
    tc = target_config.get_text_config()
    streams = {k: getattr(tc, k) for k in HYPER_CONNECTION_FIELDS if (getattr(tc, k, None) or 1) > 1}
    dflash2.require(not streams, f"the {tc.model_type!r} target has hyper-connections ({streams}): its layers return "
                    "several residual streams, and the drafter reads one hidden state a layer")
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
    dflash2.require(moe and k, f"the target's {tc.model_type!r} config has no intermediate_size (nor "
                    "moe_intermediate_size and num_experts_per_tok to take it from): pass intermediate_size for "
                    "the drafter's MLP")
    return moe * k


def config_rope(tc):
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
    if "original_max_position_embeddings" in ROPE_KEYS.get(kind, ()) and hasattr(
            tc, "original_max_position_embeddings"):
        rope.setdefault("original_max_position_embeddings", tc.original_max_position_embeddings)
    return dict(rope_theta=theta, rope_scaling=None if kind == "default" else {**rope, "rope_type": kind})


def config_transforms(tc):
    """What the target's forward does to its tables (§1; Gemma's √H and soft-cap, Granite's and Falcon-H1's
    multipliers, Muse-Glimmer's multiplier before its cap), as DFlash2Config fields. A family that does
    anything else is caught by check_target_view."""
    gemma = tc.model_type.startswith(("gemma", "recurrent_gemma"))
    multiplier = getattr(tc, "output_multiplier", None) or getattr(tc, "lm_head_multiplier", None) or 1.0
    return dict(input_embedding_scale=tc.hidden_size ** 0.5 if gemma else getattr(tc, "embedding_multiplier", 1.0),
                output_multiplier=multiplier / getattr(tc, "logits_scaling", 1.0),
                final_logit_softcapping=getattr(tc, "final_logit_softcapping", None) or None)


ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),  # rope_type -> what it reads
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "proportional": ()}


def check_rope(c):
    """A drafter config's rope_scaling: a type this code has transformers' tables for, with what it reads."""
    rope = c.rope_scaling or {}
    kind = rope.get("rope_type", "default")
    dflash2.require(kind in ROPE_KEYS, f"rope_type {kind!r} is not supported (only {', '.join(ROPE_KEYS)})")
    missing = [k for k in ROPE_KEYS[kind] if rope.get(k) is None]
    dflash2.require(not missing, f"rope_type {kind!r} needs {missing} in rope_scaling")
    for k in ("short_factor", "long_factor") if kind == "longrope" else ():
        dflash2.require(len(rope[k]) == c.head_dim // 2,
                        f"longrope {k} has {len(rope[k])} entries, expected head_dim / 2 = {c.head_dim // 2}")


def rope_tables(c):
    """The drafter's RoPE of the config's type, from transformers' own table functions: a function (c, positions)
    -> (inverse frequencies (hd/2,) fp32, cos / sin scale), dflash2.plain_rope's signature. Longrope takes its long
    factors once a position reaches L₀; dynamic RoPE is refused past max_position_embeddings (its table there
    depends on the longest sequence the model has read, which no export carries)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    check_rope(c)
    if (c.rope_scaling or {}).get("rope_type", "default") == "default":
        return dflash2.plain_rope
    rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    if rope["rope_type"] == "yarn":
        rope.setdefault("factor", None)  # transformers then takes max_position_embeddings / L₀
    shape = transformers.LlamaConfig(hidden_size=c.num_heads * c.head_dim, num_attention_heads=c.num_heads,
                                     head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                                     rope_parameters=rope)
    compute, by_length = ROPE_INIT_FUNCTIONS[rope["rope_type"]], rope["rope_type"] in ("longrope", "dynamic")
    fixed, built_for = None if by_length else compute(shape, None, None), c

    def tables(c, positions):
        if (c.rope_scaling, c.rope_theta, c.head_dim) != (built_for.rope_scaling, built_for.rope_theta,
                                                          built_for.head_dim):
            return rope_tables(c)(c, positions)  # a config with other RoPE fields: its own tables
        if fixed is not None:
            return fixed
        longest = int(positions.max()) + 1
        dflash2.require(rope["rope_type"] != "dynamic" or longest <= c.max_position_embeddings,
                        f"dynamic RoPE at position {longest - 1}, past max_position_embeddings "
                        f"({c.max_position_embeddings}): its frequencies there depend on the model's history")
        return compute(shape, None, longest)
    return tables


GEMV_ROWS = 8  # a B = 8 block's 7 drafts as W·xᵀ; a B = 16 block's 15 in the slices measured at Qwen3-4B's shape


def lm_head_rows(lm_head, x):
    """lm_head(x) for a draft block's few rows, on a CPU in the layout MKL multiplies fastest (bench/RESULTS.md, the
    draft step): up to GEMV_ROWS rows as W·xᵀ, more in slices of 512 vocabulary rows of the weight; the same values
    to rounding. One product elsewhere, or for a head that is not a plain nn.Linear."""
    if x.device.type != "cpu" or type(lm_head) is not torch.nn.Linear:
        return lm_head(x)
    W, b, rows = lm_head.weight, lm_head.bias, x.reshape(-1, x.shape[-1])
    if len(rows) <= GEMV_ROWS:
        y = (W @ rows.T).T if b is None else torch.addmm(b[:, None], W, rows.T).T
        return y.contiguous().reshape(*x.shape[:-1], W.shape[0])
    w = W.split(512)
    b = b.split(512) if b is not None else [None] * len(w)
    return torch.cat([torch.nn.functional.linear(x, w_i, b_i) for w_i, b_i in zip(w, b)], dim=-1)


def decoding_view(c, target):
    """dflash2.target_view with the draft block's logits through lm_head_rows: what decoding reads (a draft
    pass multiplies a handful of rows against the whole vocabulary)."""
    view, lm_head = dflash2.target_view(c, target), target.get_output_embeddings()
    return dflash2.TargetView(view.W_in, view.embed,
                              lambda g: dflash2.transformed_logits(c, lm_head_rows(lm_head, g.to(lm_head.weight.dtype))))


class RowsHead(torch.nn.Module):
    """A target's lm_head computed by lm_head_rows (its weight the head's own): what verifying_in_rows swaps in."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    @property
    def weight(self):
        return self.head.weight

    def forward(self, x):
        return lm_head_rows(self.head, x)


@contextlib.contextmanager
def verifying_in_rows(target):
    """The target's lm_head through lm_head_rows inside the block, its own again after it: a spec_generate
    verification's 2 to B rows (or a lookup draft's) in the faster layout on a CPU, the same values to rounding
    (bench/RESULTS.md, the hybrid on a CPU). target_generate, run outside it, keeps the module's own."""
    head = target.get_output_embeddings()
    target.set_output_embeddings(RowsHead(head))
    try:
        yield target
    finally:
        target.set_output_embeddings(head)


# Families whose embedding module RMS-normalises the rows, without a weight, before the first layer. Their
# published drafter configs declare no transform, and the engines embed the raw rows: the drafter follows the
# engines (ALGORITHM.md §1), and the check holds the target's embeddings to its rows normalised.
NORMALISED_EMBEDDINGS = {"muse_glimmer_text"}


@torch.no_grad()
def check_target_view(c, target, ids):
    """The drafter's view of the target against the target's own forward on ids (1, n): view.embed must give
    its hidden_states[0] (RMS-normalised first for NORMALISED_EMBEDDINGS) and view.logits of its last hidden
    state its logits. A family whose forward does anything else to its tables is refused by name, before any
    training, and so is one whose layers return several residual streams (hyper-connections: DeepSeek-V4,
    Qwen4-Exp), whatever its config calls them: dflash2.check_hidden_states reads the forward's widths."""
    view = dflash2.target_view(c, target)
    out = target(ids, output_hidden_states=True)
    dflash2.check_hidden_states(target, out.hidden_states)
    tolerance = 1e-4 if view.W_in.dtype in (torch.float32, torch.float64) else 3e-2
    tc = target.config.get_text_config()
    rows = view.embed(ids)
    if tc.model_type in NORMALISED_EMBEDDINGS:
        rows = torch.nn.functional.rms_norm(rows.float(), rows.shape[-1:], eps=tc.rms_norm_eps)
    for what, ours, theirs in (
            ("embeddings (hidden_states[0])", rows, out.hidden_states[0]),
            ("logits", view.logits(out.hidden_states[-1]), out.logits)):
        ours, theirs = ours.double(), theirs.double()
        error = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-30))
        if not error <= tolerance:
            raise ValueError(f"the {target.config.model_type!r} target's {what} differ from what the drafter computes "
                             f"from its tables (relative difference {error:.2g}): its forward transforms them in a way "
                             "this implementation does not follow (it knows embedding scales, logit multipliers and "
                             "final-logit soft-capping)")


def load_checked_target(target_path, dtype_flag, c, first_row, device, log):
    """The frozen target in the training dtype (logged, with why), checked against the drafter's
    config c: its tables and the mask token, then its forward on the first training row's start."""
    dtype, why = training_dtype(dtype_flag, device)
    log(f"training in {str(dtype).removeprefix('torch.')}" + (" under bf16 autocast" if dtype != torch.float32 else "")
        + f": {why}")
    model = load_target(target_path, dtype_flag, device)
    check_target_view(c, model, torch.as_tensor(first_row[:128])[None].to(device))
    return model


# -----------------------------------------------------------------------------
# the mask token


def choose_mask_token(tokenizer, num_rows, used_ids=None):
    """The id whose embedding row fills a block's MASK slots, unless the run names one (--drafter-config
    '{"mask_token_id": ID}'): a row of the target's embedding table that the data never holds (ALGORITHM.md §1).
    In order:
    1. the tokenizer's mask token;
    2. the lowest embedding row that no token uses (tables are often padded past the vocabulary);
    3. the lowest-id added or special token that is not the bos, eos, pad or unk token and is
       not in `used_ids` (every id of the training rows: the template's own tokens are there).
    -> (id, how it was chosen). Refuses, naming the candidates, when nothing is left."""
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < num_rows:
        return tokenizer.mask_token_id, "the tokenizer's mask token"
    unused = sorted(set(range(num_rows)) - set(tokenizer.get_vocab().values()))
    if unused:
        return unused[0], "the first embedding row no token uses"
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    added = sorted(i for i in tokenizer.added_tokens_decoder if i < num_rows)
    used = set() if used_ids is None else set(used_ids)
    free = [i for i in added if i not in roles and i not in used]
    if not free:
        names = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in added) or "none"
        raise ValueError(f"no free mask token: the tokenizer has no mask token, every embedding row is a token, and "
                         f"every added or special token is the bos/eos/pad/unk token or occurs in the training data "
                         f"(candidates: {names}); pass --drafter-config '{{\"mask_token_id\": ID}}' with an id the data "
                         "never holds")
    return free[0], (f"{tokenizer.convert_ids_to_tokens(free[0])!r}, the lowest-id added token that is not "
                     "bos/eos/pad/unk" + (" and never occurs in the training rows" if used_ids is not None else ""))


@torch.no_grad()
def mask_token(tokenizer, num_rows, rows, log=print):
    """choose_mask_token, avoiding every id the rows hold (rows: a Dataset of input_ids or a tuple of them, marked
    in one pass; None: not read), logged with how it was chosen."""
    used = None
    if rows is not None:
        seen = torch.zeros(max(num_rows, len(tokenizer)), dtype=torch.bool)
        for part in rows if isinstance(rows, tuple) else (rows,):
            for ids in part["input_ids"]:
                seen[ids] = True
        used = seen.nonzero()[:, 0].tolist()
    mask_id, why = choose_mask_token(tokenizer, num_rows, used)
    log(f"mask token {mask_id}: {why}")
    return mask_id


# -----------------------------------------------------------------------------
# the target's features, computed or cached


def weights_fingerprint(model):
    """Cheap identity of a model's weights: float64 sums of its first and last tensors."""
    params = list(model.parameters())
    return [round(float(p.detach().double().sum()), 6) for p in (params[0], params[-1])]


def target_features(target, ids, attention_mask, layer_ids):
    """What the loss reads of the target for a batch (ALGORITHM.md §1, §6), from its decoder alone:
    -> context (b, S, nf·H), its hidden states at layer_ids concatenated (Hugging Face index l + 1),
    and last_hidden (b, S, H), after the final norm. The loss applies lm_head where it needs it,
    never to (b, S, V) at once. (Through the whole model even one position's logits cost a copy of
    lm_head per row on a CPU: the last position is a strided slice, which matmul cannot fold.)"""
    states = target.base_model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    dflash2.check_hidden_states(target, states)
    return torch.cat([states[l + 1] for l in layer_ids], -1), states[-1]


def token_digest(ids):
    return hashlib.sha256(ids.cpu().long().numpy().tobytes()).hexdigest()


class TargetFeatures:
    """What the loss reads of the frozen target (the context layers' and the last hidden states)
    for each training row, computed at the row's first use and reused in later epochs: in memory,
    or with `folder` one safetensors file per row there (a killed run's files are reused).

    A cache belongs to one target and one set of rows: `key` (the target's weights fingerprint,
    the layer ids, the dtype) is checked against the folder's, and each row's tokens against
    those its features were computed for; a mismatch is refused, never reused."""

    def __init__(self, key, layer_ids, folder=None, keep=True):
        self.layer_ids, self.folder, self.rows, self.keep = list(layer_ids), folder, {}, keep
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        key_file = Path(folder) / "key.json"
        if key_file.is_file():
            held = json.loads(key_file.read_text())
            if held != key:
                raise ValueError(f"--cache-target-features: {folder} holds the features of {held}, not of this run's "
                                 f"{key}; delete the folder or choose another --out-dir")
        else:
            tmp = key_file.with_name(f"key.json.tmp{os.getpid()}")
            tmp.write_text(json.dumps(key))
            os.replace(tmp, key_file)

    @staticmethod
    def row_bytes(num_tokens, num_layer_ids, hidden_size, dtype):
        return num_tokens * (num_layer_ids + 1) * hidden_size * dtype.itemsize

    def _path(self, row):
        return Path(self.folder) / f"row{row:08d}.safetensors"

    def _get(self, row, ids):
        """-> the row's (n, (nf + 1)·H) features, or None when not computed yet."""
        if self.folder is None:
            held = self.rows.get(row)
        elif self._path(row).is_file():
            with safetensors.safe_open(self._path(row), "pt") as f:
                held = f.metadata()["tokens"], f.get_tensor("features")
        else:
            held = None
        if held is None:
            return None
        if held[0] != token_digest(ids):
            raise ValueError(f"--cache-target-features: training row {row} holds other tokens than the ones its cached "
                             "features were computed for; the cache belongs to other data")
        return held[1]

    def _put(self, row, ids, features):
        if self.folder is None:
            self.rows[row] = token_digest(ids), features.clone()
            return
        tmp = self._path(row).with_name(f"{self._path(row).name}.tmp{os.getpid()}")
        safetensors.torch.save_file({"features": features.contiguous()}, tmp, metadata={"tokens": token_digest(ids)})
        os.replace(tmp, self._path(row))

    def features(self, target, ids, attention_mask, rows):
        """target_features of a right-padded batch (ids, attention_mask (b, S)) whose rows are the
        training rows `rows`: -> context (b, S, nf·H), last_hidden (b, S, H), zero past each row's
        length (masked there). One target pass over the batch if any of its rows is not cached yet (every batch,
        keep=False)."""
        if not self.keep:
            return target_features(target, ids, attention_mask, self.layer_ids)
        lengths = attention_mask.sum(1).tolist()
        held = [self._get(r, ids[i, :n]) for i, (r, n) in enumerate(zip(rows, lengths))]
        if any(h is None for h in held):
            context, last = target_features(target, ids, attention_mask, self.layer_ids)
            for i, (r, n) in enumerate(zip(rows, lengths)):
                if held[i] is None:
                    self._put(r, ids[i, :n], torch.cat([context[i, :n], last[i, :n]], -1).cpu())
            return context, last
        b, S = ids.shape
        features = torch.zeros(b, S, held[0].shape[-1], dtype=held[0].dtype, device=ids.device)
        for i, (h, n) in enumerate(zip(held, lengths)):
            features[i, :n] = h
        H = features.shape[-1] // (len(self.layer_ids) + 1)
        return features[..., :-H], features[..., -H:]


def uncached_features(layer_ids):
    """The features of each batch from one target pass, kept nowhere (--cache-target-features off)."""
    return TargetFeatures(None, layer_ids, keep=False)


def feature_cache(choice, target, c, train_rows, rows_drawn, out_dir, log=print):
    """--cache-target-features -> a TargetFeatures (off: one that keeps nothing), its size logged. auto: off when no
    row is drawn twice (rows_drawn: the run's global batches × steps), in memory when the features fit in half the
    free memory, else on disk in OUT/target_features; disk:FOLDER puts them there (runs on one target can share it)."""
    size = sum(TargetFeatures.row_bytes(len(ids), len(c.target_layer_ids), c.hidden_size, target.dtype)
               for ids in train_rows["input_ids"])
    folder = choice.removeprefix("disk:") if choice.startswith("disk:") else os.path.join(out_dir, "target_features")
    why = f"--cache-target-features {choice}"
    if choice == "auto":
        pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else 0
        free = pages * os.sysconf("SC_PAGE_SIZE") if pages else 0
        choice = "off" if rows_drawn <= len(train_rows) else "memory" if size <= free / 2 else "disk"
        why = ("no row is used twice" if choice == "off" else
               f"{'within' if choice == 'memory' else 'over'} half of the {free / 2**30:.1f} GiB free")
    if choice == "off":
        log(f"target features: computed every step ({why}; a cache would take {size / 2**30:.2f} GiB)")
        return uncached_features(c.target_layer_ids)
    folder = None if choice == "memory" else folder
    key = {"target_weights": weights_fingerprint(target), "target_layer_ids": c.target_layer_ids,
           "dtype": str(target.dtype).removeprefix("torch.")}
    log(f"target features: cached {'in ' + folder if folder else 'in memory'}, {size / 2**30:.2f} GiB for "
        f"{len(train_rows)} rows ({why})")
    return TargetFeatures(key, c.target_layer_ids, folder)
