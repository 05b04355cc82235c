"""
A run's drafter and what a run writes: the drafter a run trains (build_drafter: new on the
target's family, or warm-started from an export); the export that vLLM, SGLang and the z-lab
`dflash` package load (§7: config.json + model.safetensors, written by save_export and read by
load_export, config.json in the z-lab layout or in vllm-project speculators'), and for train.py
its run's folder (TrainingRun): the resume state, the identity a resumed run must share with the
run it continues, and the run's record (metrics.jsonl, curves.png). Everything is written under a
temporary name and renamed into place. Not here: what the drafter computes (dflash2.py), its shape on a target
and its mask token (harness/target.py), the metrics the record holds (harness/metrics.py).

As a script it writes an export for serving and prints the engines' commands for it:

    python -m harness.checkpoint --target Qwen/Qwen3-4B --out untrained --block-size 16   # does an engine load it?
    python -m harness.checkpoint --target Qwen/Qwen3-4B --from out/checkpoint --out spec --format speculators
"""
import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import dflash2
from harness.target import (add_drafter_flags, drafter_config, drafter_fields, is_gguf, known_fields, load_config,
                            load_tokenizer, mask_token, rope_tables, weights_fingerprint)

# -----------------------------------------------------------------------------
# the export (§7)

QWEN3_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads"}  # DFlash2Config field -> config.json key, where they differ
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")        # in config.json's dflash_config
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # there, for DFlash2 only
VIEW_FIELDS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}  # there too,
# under z-lab's names, where they differ from these plain values (the target's transforms, §1)
EXPORT_FORMATS = ("z-lab", "speculators")  # config.json's layout; the tensors are the same
SPECULATORS_VERSION = "0.9.0"  # the vllm-project speculators release whose config format speculators_config writes
SPECULATORS_TYPES = {"dflash2": ("DFlash2DraftModel", "DFlash2SpeculatorConfig"),  # speculators_model_type ->
                     "dflash": ("DFlashDraftModel", "DFlashSpeculatorConfig")}     # (architecture, config class)
SPECULATORS_INERT = (  # speculators fields that change nothing this drafter computes
    "architectures", "auto_map", "speculators_version", "speculators_config", "torch_dtype", "dtype",
    "transformers_version",
    "tie_word_embeddings")        # the drafter has no embedding or head of its own: it borrows the target's
SUPPORTED = {  # layer fields that change what a drafter computes: any other value is refused, not ignored
    "hidden_act": lambda v: v in (None, "silu"), "attention_bias": lambda v: not v,
}


def layer_config(c):
    """The drafter's layers as a Qwen3 config: config.json's top level in the z-lab format,
    its transformer_layer_config in speculators'."""
    return {
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta},
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False,
        **({} if c.layer_types is None else {  # Qwen3Config drops sliding_window unless use_sliding_window
            "layer_types": c.layer_types, "use_sliding_window": True, "sliding_window": c.sliding_window}),
    }


def checkpoint_config(c):
    """config.json of a drafter config in the z-lab format: a Qwen3 config plus the DFlash/DFlash2
    fields in dflash_config."""
    return {
        "architectures": ["DFlash2DraftModel" if c.is_dflash2 else "DFlashDraftModel"],
        **layer_config(c),
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        "dflash_config": {**{k: getattr(c, k) for k in DFLASH_FIELDS + (DFLASH2_FIELDS if c.is_dflash2 else ())},
                          **{k: getattr(c, k) for k, plain in VIEW_FIELDS.items() if getattr(c, k) != plain}},
        **({} if c.layer_types is None else {"is_causal": False}),  # z-lab's default makes sliding layers causal
    }


def speculators_config(c, verifier):
    """config.json of a drafter config in vllm-project speculators' format (release
    SPECULATORS_VERSION): the layers nested as transformer_layer_config, the context layers as
    HF hidden_states indices (aux id = target layer id + 1), no record of the target's layer
    count, and the verifier vLLM serves the drafter with: {"name_or_path", "architectures"}."""
    kind = "dflash2" if c.is_dflash2 else "dflash"
    transformed = [k for k, plain in VIEW_FIELDS.items() if getattr(c, k) != plain]
    if transformed:
        raise ValueError(f"the speculators format has no field for {', '.join(transformed)} (this target's transforms of "
                         "its tables): export in the z-lab format, which vLLM and SGLang read too")
    architecture, config_class = SPECULATORS_TYPES[kind]
    dflash2_fields = {k: getattr(c, k) for k in DFLASH2_FIELDS} if c.is_dflash2 else {}
    return {
        "architectures": [architecture],
        "auto_map": {"": f"config.{config_class}"},
        "aux_hidden_state_layer_ids": [l + 1 for l in c.target_layer_ids],
        "block_size": c.block_size,
        **dflash2_fields,
        "draft_vocab_size": c.vocab_size,
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": c.is_dflash2 or c.layer_types is not None,  # speculators' default per type
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": c.block_size - 1, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(verifier["architectures"]), "name_or_path": verifier["name_or_path"]},
        },
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer_config(c),
    }


def layer_fields(layer, where):
    """The inverse of layer_config -> DFlash2Config's layer fields, refusing what SUPPORTED refuses.
    layer: a Qwen3 config as transformers' config class reads it (its sliding layers effective)."""
    for name, ok in SUPPORTED.items():
        if not ok(layer.get(name)):
            raise ValueError(f"{where}: {name} = {layer[name]!r} is not supported by this implementation (only the "
                             "Qwen3 drafter layer: silu MLP, no attention bias)")
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or layer["rope_theta"]  # transformers: rope_parameters' wins
    kind = rope.pop("type", None) or rope.get("rope_type", "default")
    types = layer.get("layer_types") if layer.get("sliding_window") is not None else None
    return dict(
        {k: layer[QWEN3_NAMES.get(k, k)] for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                   "num_kv_heads", "vocab_size", "rms_norm_eps",
                                                   "max_position_embeddings")},
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        rope_theta=theta,
        rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
        **({} if not types or "sliding_attention" not in types else
           dict(layer_types=list(types), sliding_window=layer["sliding_window"])))


def as_read(layer, where):
    """A drafter layer config as transformers' config class for its model_type reads it, the way the
    engines read it: fields left out take the class's defaults, sliding layers exist only with
    use_sliding_window."""
    import transformers
    layer = dict(layer)
    model_type = layer.pop("model_type", "qwen3")
    try:
        return transformers.AutoConfig.for_model(model_type, **layer).to_dict()
    except ValueError:
        raise ValueError(f"{where}: model_type {model_type!r} is not a config transformers knows") from None


def zlab_fields(raw, where):
    """The inverse of checkpoint_config, for DFlash2 and DFlash (v1) exports. The target's transforms
    are read where z-lab reads them: dflash_config, else the top level."""
    if (raw.get("architectures") or [None])[0] not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"{where}: architectures {raw.get('architectures')} is not a DFlash drafter "
                         "(expected ['DFlash2DraftModel'] or ['DFlashDraftModel'])")
    d = raw.get("dflash_config", {})
    read = as_read({k: v for k, v in raw.items() if k not in ("architectures", "dflash_config", "auto_map")}, where)
    layer = {**raw, **{k: read.get(k) for k in ("layer_types", "sliding_window", "rope_parameters")}}
    fields = layer_fields(layer, where)
    causal = [i for i, t in enumerate(layer.get("layer_types") or []) if t == "sliding_attention"] if (
        raw.get("is_causal") is None) else list(range(fields["num_layers"])) if raw["is_causal"] else []
    if causal:
        raise ValueError(f"{where}: is_causal = {raw.get('is_causal')!r} makes draft layers {causal} causal (z-lab "
                         "makes sliding_attention layers causal unless is_causal is false); a block is bidirectional")
    view = {k: d.get(k, raw.get(k, plain)) for k, plain in VIEW_FIELDS.items()}
    return dict(fields, num_target_layers=raw["num_target_layers"],
                block_size=d.get("block_size") or raw["block_size"], mask_token_id=d["mask_token_id"],
                target_layer_ids=d["target_layer_ids"], conv_kernel_size=d.get("conv_kernel_size", 0),
                selector_top_k=d.get("selector_top_k", 0), **{k: v for k, v in view.items() if v is not None},
                **{k: d[k] for k in ("conv_group_size", "selector_rank") if k in d})


def speculators_fields(raw, where):
    """The inverse of speculators_config, for speculators' "dflash2" and "dflash" types. Every
    field is mapped, checked or known to change nothing here (SPECULATORS_INERT); any other is
    refused by name. transformer_layer_config is read as speculators reads it (transformers'
    config class for its model_type, so fields left at their default are filled in)."""
    kind = raw["speculators_model_type"]
    if kind not in SPECULATORS_TYPES:
        raise ValueError(f"{where}: speculators_model_type {kind!r} is not a DFlash drafter "
                         f"(expected one of {sorted(SPECULATORS_TYPES)})")
    known = {"speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids", "block_size",
             "mask_token_id", "sample_from_anchor", "draft_vocab_size", "target_hidden_size", *SPECULATORS_INERT,
             "sliding_window_non_causal",
             *(DFLASH2_FIELDS if kind == "dflash2" else ())}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not a field of a speculators {kind!r} config that this "
                         "implementation maps (refused, not ignored)")
    fields = layer_fields(as_read(raw["transformer_layer_config"], f"{where}: transformer_layer_config"),
                          f"{where}: transformer_layer_config")
    if fields.get("layer_types") and not raw.get("sliding_window_non_causal"):
        raise ValueError(f"{where}: sliding_window_non_causal = {raw.get('sliding_window_non_causal')!r} makes the "
                         "sliding layers causal; a block is bidirectional")
    H, V, ids = fields["hidden_size"], fields["vocab_size"], raw["aux_hidden_state_layer_ids"]
    for name, ok, why in (
            ("sample_from_anchor", not raw.get("sample_from_anchor"), "the anchor is the verified token, never drafted"),
            ("draft_vocab_size", raw.get("draft_vocab_size") in (None, V), f"DFlash2 drafts over all {V} tokens of "
             "the target, not a pruned vocabulary"),
            ("target_hidden_size", raw.get("target_hidden_size") in (None, H), f"the drafter is as wide as its "
             f"target ({H})"),
            ("mask_token_id", raw["mask_token_id"] is not None, "the drafter needs its MASK token"),
            ("aux_hidden_state_layer_ids", ids and all(isinstance(i, int) and i >= 1 for i in ids),
             "they index HF hidden_states from 1 (index 0, the embeddings, is no target layer)")):
        if not ok:
            raise ValueError(f"{where}: {name} = {raw.get(name)!r} is not supported: {why}")
    # a "dflash2" config without a part's sizes means speculators' defaults, which are DFlash2Config's
    parts = {k: raw[k] for k in DFLASH2_FIELDS if k in raw} if kind == "dflash2" else dict(conv_kernel_size=0,
                                                                                            selector_top_k=0)
    return dict(fields, block_size=raw["block_size"], mask_token_id=raw["mask_token_id"],
                target_layer_ids=[i - 1 for i in ids], **parts)


def config_fields(raw, where):
    """config.json in either format -> DFlash2Config fields; num_target_layers only where the
    file records it (z-lab's; speculators' config holds the drafter's layers only)."""
    try:
        return speculators_fields(raw, where) if "speculators_model_type" in raw else zlab_fields(raw, where)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where} lacks the key {e.args[0]!r} of a DFlash drafter config") from None


def with_parts(drafter, **parts):
    """`drafter` with its convolution / selector set to `parts` (DFlash2Config fields): the
    weights it keeps are drafter's, a part it gains starts at its identity init (init_weights:
    tap 0 = 1 and nothing else; a zero successor codebook, so E = U), so the result computes
    exactly what `drafter` computes. How a DFlash (v1) drafter warm-starts DFlash2."""
    whole = dflash2.DFlash2Drafter(dataclasses.replace(drafter.config, **parts), rope=drafter.rope)
    whole.load_state_dict(drafter.state_dict(), strict=False)  # strict=False: the gained part is not in it
    return whole


def with_tables(drafter, embedding):
    """A factored selector's codebooks (§3) as the [V, R] tables engines read, from `embedding`,
    the target's input embedding: A = W_in·W_Aᵀ, Bc = W_in·W_Bᵀ. -> a drafter with free codebooks that
    computes what `drafter` computes."""
    if embedding is None:
        raise ValueError("the drafter's selector has factored codebooks: exporting it needs the target's input "
                         "embedding (save_export(..., embedding=target.get_input_embeddings()))")
    state = drafter.state_dict()
    with torch.no_grad():  # the same F.linear on fp32 rows as CandidateSelector.edge_scores
        W_in = embedding.weight.float()
        for side in ("predecessor", "successor"):
            W = state.pop(f"candidate_selector.{side}_projection.weight").float()
            state[f"candidate_selector.{side}_codebook"] = F.linear(W_in, W)
    whole = dflash2.DFlash2Drafter(dataclasses.replace(drafter.config, selector_codebooks="free"), rope=drafter.rope)
    whole.load_state_dict(state)
    return whole


def servable(drafter, embedding=None):
    """Engines build both DFlash2 parts for "DFlash2DraftModel", so a drafter with one part
    switched off is exported with the other filled in at the identity (with_parts), at the
    default size: Kc = 2 taps (G = conv_group_size, or H if that does not divide H), or K =
    min(16, V) candidates whose codebooks and projection are all zero (no init noise in the
    export). Both off: DFlash (v1), exported as it is. Factored codebooks are exported as
    tables (with_tables, from `embedding`).
    -> a drafter that computes exactly what `drafter` computes, with both parts or none."""
    c, default = drafter.config, {f.name: f.default for f in dataclasses.fields(dflash2.DFlash2Config)}
    if c.selector_top_k and c.selector_codebooks == "factored":
        drafter = with_tables(drafter, embedding)
    if not c.is_dflash2 or (c.conv_kernel_size and c.selector_top_k):
        return drafter
    fill = {}
    if not c.conv_kernel_size:
        fill.update(conv_kernel_size=default["conv_kernel_size"],
                    conv_group_size=c.conv_group_size if c.hidden_size % c.conv_group_size == 0 else c.hidden_size)
    if not c.selector_top_k:
        fill.update(selector_top_k=min(default["selector_top_k"], c.vocab_size))
    whole = with_parts(drafter, **fill)
    if not c.selector_top_k:
        with torch.no_grad():
            whole.candidate_selector.hidden_projection.weight.zero_()
            whole.candidate_selector.predecessor_codebook.zero_()
    return whole


def save_export(drafter, path, dtype=torch.bfloat16, export_format="z-lab", verifier=None, embedding=None):
    """servable(drafter, embedding) as the folder `path` with config.json + model.safetensors, written
    under a temporary name and renamed into place, world-readable (servers run as other users).
    export_format: config.json in the z-lab layout (vLLM, SGLang, the dflash package) or in
    vllm-project speculators' (vLLM alone, `vllm serve PATH`), which names the verifier:
    {"name_or_path": hub id or folder, "architectures": [...]} (the z-lab layout ignores it).
    embedding: the target's input embedding, needed by factored codebooks only."""
    from safetensors.torch import save_file
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"checkpoint dtype {dtype} must be torch.bfloat16, torch.float16 or torch.float32")
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export format {export_format!r} must be one of {', '.join(EXPORT_FORMATS)}")
    if export_format == "speculators" and not (verifier or {}).get("name_or_path"):
        raise ValueError("the speculators format names the verifier vLLM serves the drafter with: pass "
                         "verifier={'name_or_path': ..., 'architectures': [...]}")
    path, drafter = os.path.abspath(path), servable(drafter, embedding)
    config = checkpoint_config(drafter.config) if export_format == "z-lab" else speculators_config(drafter.config,
                                                                                                    verifier)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path))
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2,
                      sort_keys=export_format == "speculators")  # as speculators (transformers) writes it
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.exists(path):  # replace an older export: move it aside first, then swap
            old = tmp + "-old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_export(path, dtype=torch.float32, num_target_layers=None, **overrides):
    """The DFlash2Drafter of a DFlash2 or DFlash (v1) export folder, in the z-lab or the
    speculators format; no pickle on this path. num_target_layers: the target's layer count,
    which a speculators config does not record (it is then required); a z-lab export records
    it, and a different value is refused. overrides: DFlash2Config fields. A v1 export loads
    into a v1 drafter or, with overrides that switch the convolution / selector on, into a
    DFlash2 drafter whose new parts keep their identity init (warm start)."""
    from safetensors.torch import load_file
    known_fields(overrides)  # a misspelt override fails before any file is read
    cfg_file, weights_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"{f} not found: a drafter checkpoint is a folder with config.json and model.safetensors")
    with open(cfg_file) as f:
        raw = json.load(f)
    fields = config_fields(raw, cfg_file)
    recorded = fields.setdefault("num_target_layers", num_target_layers)
    if recorded is None:
        raise ValueError(f"{cfg_file} is a speculators config, which does not record the target's layer count: "
                         "pass num_target_layers (the target's num_hidden_layers) to load_export")
    if num_target_layers not in (None, recorded):
        raise ValueError(f"the drafter in {path} has num_target_layers {recorded} but the target has "
                         f"{num_target_layers}: a drafter only fits the target it was trained for")
    file_is_v1 = (fields.get("conv_kernel_size"), fields.get("selector_top_k")) == (0, 0)
    c = dflash2.DFlash2Config(**{**fields, **overrides})
    drafter = dflash2.DFlash2Drafter(c, rope=rope_tables(c))
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # a truncated file, a pickle, anything that is not safetensors
        raise ValueError(f"{weights_file} is not a readable safetensors file: {e}") from e
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if file_is_v1:  # warm start: the DFlash2 parts keep their identity init
        missing = [k for k in missing if "_conv." not in k and not k.startswith("candidate_selector.")]
    unexpected = sorted(set(tensors) - set(expected))
    mis_shaped = sorted(f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                        if k in tensors and tensors[k].shape != v.shape)
    if missing or unexpected or mis_shaped:
        raise ValueError(f"{weights_file} does not match the drafter config: missing {missing}, "
                         f"unexpected {unexpected}, mis-shaped {mis_shaped}")
    drafter.load_state_dict(tensors, strict=False)
    return drafter.to(dtype)


def serving_commands(target_name, export_path, block_size, export_format="z-lab"):
    """How each engine serves an export: vLLM counts the B - 1 drafted tokens, SGLang the whole
    block B; the z-lab `dflash` package's CLI needs its runtime extra and a CUDA device. The
    speculators format is vLLM's alone, and its config.json already names the target and B - 1."""
    if export_format == "speculators":
        return [f"vllm serve {export_path}"]
    return [
        f"vllm serve {target_name} --speculative-config "
        f"'{{\"method\": \"dflash\", \"model\": \"{export_path}\", \"num_speculative_tokens\": {block_size - 1}}}'",
        f"python -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {export_path} --speculative-num-draft-tokens {block_size}",
        f"pip install \"dflash[local]\" && dflash generate transformers --model {target_name} --draft {export_path} "
        "\"Hello\"",
    ]


# -----------------------------------------------------------------------------
# a run's drafter


def build_drafter(target_config, tokenizer, fields, rows=None, init_from=None, log=print):
    """The drafter of DFlash2Config `fields` on this target (its width, RoPE and tables' transforms from the
    target's config), or with init_from the export there, whose architecture wins (a DFlash (v1) one gains the
    fields' convolution and selector at identity), checked against the target's shape before its weights load. The
    mask token, unless the fields name one, is the target's tokenizer's that the `rows` (a Dataset of input_ids, or
    a tuple of them) never hold. Seed torch first: the new drafter's init draws from its generator."""
    text = target_config.get_text_config()  # a multimodal wrapper's language model
    if init_from:
        drafter = load_export(init_from, num_target_layers=text.num_hidden_layers)
        if not drafter.config.is_dflash2:  # DFlash (v1): this run's convolution and selector join at identity
            drafter = with_parts(drafter, **{k: v for k, v in fields.items() if k.startswith(("conv_", "selector_"))})
        dflash2.check_target_shape(drafter.config, text.num_hidden_layers, text.hidden_size, text.vocab_size)
        return drafter
    if "mask_token_id" not in fields:
        fields = {**fields, "mask_token_id": mask_token(tokenizer, text.vocab_size, rows, log)}
    c = drafter_config(target_config, **fields)
    return dflash2.DFlash2Drafter(c, rope=rope_tables(c))


# -----------------------------------------------------------------------------
# a training run's files


def check_out_dir(out_dir, resuming=False):
    """Fail before any work if --out-dir cannot be created or written, or (resuming) holds no resume.pt.
    -> the path of its resume.pt."""
    p = Path(out_dir).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {out_dir} is not writable ({p} is not a writable directory)")
    resume_file = os.path.join(out_dir, "resume.pt")
    if resuming and not os.path.isfile(resume_file):
        raise ValueError(f"--resume: {resume_file} not found")
    return resume_file


def data_fingerprint(rows):
    """Rows count and a hash of 16 evenly spaced rows' token ids (the whole set can be GBs)."""
    picks = sorted({i * (len(rows) - 1) // 15 for i in range(16)})
    digest = hashlib.sha256(json.dumps([rows[i]["input_ids"].tolist() for i in picks]).encode()).hexdigest()[:16]
    return {"rows": len(rows), "sample_sha256": digest}


def run_identity(target_config, c, train_rows, seq_len, schedule):
    """Everything a resumed run must share with the run it continues (c: its drafter's DFlash2Config)."""
    config = {k: v for k, v in target_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")}
    return {"target_config": config, "data": data_fingerprint(train_rows), "seq_len": seq_len, "schedule": schedule,
            "drafter": dataclasses.asdict(c)}


def check_resume(resume_file, run):
    """Load resume.pt, refusing a run that differs in target, data, sequence length,
    schedule or drafter architecture, and naming what differs."""
    state = torch.load(resume_file, map_location="cpu", weights_only=True)
    saved = state.get("run", {})
    differ = [k for k in run if saved.get(k) != run[k]]
    if differ:
        detail = "; ".join(f"{k}: saved {diff(saved.get(k), run[k])}" for k in differ)
        raise ValueError(f"--resume: {resume_file} belongs to another run ({detail}); use another --out-dir")
    return state


def resume(state, meta, drafter, optimizer, out_dir, master):
    """--resume from a checked resume state: the target's weights must be the run's; then the
    weights, the optimizer and the step come back, and the record is rewound to that step."""
    if state["target_weights"] != meta["target_weights"]:
        raise ValueError(f"--resume: the target's weights differ from the run in {os.path.join(out_dir, 'resume.pt')} "
                         f"(fingerprint {meta['target_weights']} != {state['target_weights']})")
    drafter.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if master:
        rewind_record(out_dir, state["step"])
    return state["step"]


def diff(saved, now):
    """The fields of two dicts that differ, as 'key a != b' (or the two values)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        return ", ".join(f"{k} {saved.get(k)!r} != now {now.get(k)!r}" for k in keys)
    return f"{saved!r} != now {now!r}"


def record(out_dir, entry):
    """Append one log or eval line, as JSON, to OUT/metrics.jsonl: the run's record."""
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def rewind_record(out_dir, step):
    """A resumed run continues the record from its checkpoint: later lines of the killed run go."""
    path = Path(out_dir) / "metrics.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
        path.with_suffix(".tmp").write_text("".join(kept))
        os.replace(path.with_suffix(".tmp"), path)


def plot_curves(out_dir):
    """OUT/curves.png from the record: loss, expected AL (unary / walk / oracle) and the
    per-slot accuracy of each evaluation, against steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    train_rows, evals = [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss")
    ax[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="val loss")
    for key in ("al_unary", "al_walk", "al_oracle"):
        ax[1].plot([r["step"] for r in train_rows if key in r], [r[key] for r in train_rows if key in r], label=key)
    for r in evals:
        ax[2].plot(range(1, len(r["slot_acc"]) + 1), r["slot_acc"], "o-", label=f"step {r['step']}")
    for a, title in zip(ax, ("loss", "expected acceptance length (train batches)", "val accuracy per slot")):
        a.set_title(title)
        a.legend()
    ax[0].set_xlabel("step"), ax[1].set_xlabel("step"), ax[2].set_xlabel("slot k")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "curves.png", dpi=80)
    plt.close(fig)


class TrainingRun:
    """A training run's folder (--out-dir) from train.py's side: checked before any work; the run's identity, and
    resuming, the resume state it must match (check, then start); its record and its checkpoints (master: rank 0,
    the one that writes)."""

    def __init__(self, out_dir, resuming, master):
        self.out_dir, self.resuming, self.master = out_dir, resuming, master
        self.resume_file = check_out_dir(out_dir, resuming)
        self.state, self.meta = None, {}

    def check(self, target_config, c, train_rows, seq_len, schedule):
        """The run's identity (run_identity); resuming, resume.pt loaded and refused if it belongs to another run:
        before the target's weights load."""
        self.meta["run"] = run_identity(target_config, c, train_rows, seq_len, schedule)
        if self.resuming:
            self.state = check_resume(self.resume_file, self.meta["run"])

    def start(self, drafter, optimizer, target):
        """-> the first step: 0, or resuming, the checkpoint's (weights, optimizer and record back; the target's
        weights must be the run's)."""
        self.meta["target_weights"] = weights_fingerprint(target)
        if self.state is None:
            return 0
        return resume(self.state, self.meta, drafter, optimizer, self.out_dir, self.master)

    def record(self, entry):
        if self.master:
            record(self.out_dir, entry)

    def save(self, drafter, optimizer, step, export):
        """The checkpoint (save_checkpoint), rank 0 only."""
        if self.master:
            save_checkpoint(drafter, optimizer, step, self.out_dir, export, self.meta)

    def record_eval(self, step, summary):
        """An evaluation's line in the record, and curves.png drawn again."""
        self.record({"kind": "eval", "step": step, **summary["val"],
                     **{k: v for k, v in summary.items() if k != "val"}})
        if self.master:
            plot_curves(self.out_dir)


def save_checkpoint(drafter, optimizer, step, out_dir, export, meta):
    """The servable export (export: save_export's keywords), then the resume state; each written
    under a temp name and renamed. resume.pt holds the drafter's own parameters: factored
    codebooks as W_A and W_B, not tables."""
    save_export(drafter, os.path.join(out_dir, "checkpoint"), **export)
    tmp = os.path.join(out_dir, f"resume.pt.tmp{os.getpid()}")
    torch.save({"model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **meta}, tmp)
    os.replace(tmp, os.path.join(out_dir, "resume.pt"))


# -----------------------------------------------------------------------------
# the export job: python -m harness.checkpoint


def served_target(target_name):
    """The model engines serve a drafter's target from: --target, or for a GGUF file the original
    model it was converted from, which only the user can name (ORIGINAL_MODEL)."""
    return "ORIGINAL_MODEL" if is_gguf(target_name) else target_name


def parse_args(argv=None):
    """The export's own flags, then train.py's drafter flags (the same names, types and defaults)."""
    p = argparse.ArgumentParser(description="Write a drafter export for serving and print the engines' commands "
                                "for it: --from a trained export (rewritten in --format, --export-dtype), or the "
                                "untrained drafter of the drafter flags on --target, to check that an engine loads it "
                                "before training (the target's config and tokenizer are read, never its weights).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="HF model folder, hub id or .gguf file of the target the drafter "
                   "serves")
    p.add_argument("--out", default=None, help="the export folder to write")
    p.add_argument("--from", dest="source", default=None, metavar="EXPORT", help="an export folder (train.py's "
                   "OUT/checkpoint); unset: the untrained drafter of the drafter flags")
    p.add_argument("--format", default="z-lab", choices=EXPORT_FORMATS, help="config.json's layout: z-lab's (vLLM, "
                   "SGLang, the dflash package) or vllm-project speculators' (vLLM; it names --target as the verifier, "
                   "so `vllm serve OUT` is enough); the same tensors (§7)")
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the tensors' dtype")
    add_drafter_flags(p.add_argument_group("drafter (untrained: without --from)"))
    return p.parse_args(argv)


def main(args, log=print):
    """Write the export of args and log its serving commands -> its path."""
    if not (args.target and args.out):
        raise ValueError("needs --target (the model the drafter serves) and --out (the export folder to write)")
    target_config = load_config(args.target)
    text = target_config.get_text_config()
    if args.source:
        drafter = load_export(args.source, num_target_layers=text.num_hidden_layers)
        dflash2.check_target_shape(drafter.config, text.num_hidden_layers, text.hidden_size, text.vocab_size)
    else:  # factored codebooks' tables need the target's embedding, which is not read: they are written as free
        # tables at their init, which score as the untrained factored selector does (successor side 0: U)
        drafter = build_drafter(target_config, load_tokenizer(args.target),
                                {**drafter_fields(args), "selector_codebooks": "free"}, log=log)
    path, served, B = os.path.abspath(args.out), served_target(args.target), drafter.config.block_size
    save_export(drafter, path, getattr(torch, args.export_dtype), args.format, verifier={
        "name_or_path": served, "architectures": list(getattr(target_config, "architectures", None) or [])})
    if served != args.target:
        where = ("the commands below" if args.format == "z-lab" else
                 "the export's config.json (speculators_config.verifier.name_or_path)")
        log(f"--target {args.target} is a GGUF file: in {where} put the hub id or folder of the model it was "
            "converted from in place of ORIGINAL_MODEL (the export fits the same weights in any format)")
    engines = ("one of" if args.format == "z-lab" else
               "vLLM, which reads the target from it (SGLang and the dflash package read --format z-lab)")
    log(f"{'untrained ' if not args.source else ''}export (B = {B}, {args.format} format) in {path}; serve it with "
        f"{engines}:")
    for command in serving_commands(served, path, B, args.format):
        log(command)
    return path


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"harness.checkpoint: {e}") from None
