"""
What a run writes: the export that vLLM, SGLang and the z-lab `dflash` package load (§7:
config.json + model.safetensors, written by save_export and read by load_export), and for
train.py the resume state, the identity a resumed run must share with the run it continues,
and the run's record (metrics.jsonl, curves.png). Everything is written under a temporary
name and renamed into place. This file imports dflash2.py, never the other way round.
"""
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

# -----------------------------------------------------------------------------
# the export (§7)

QWEN3_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads"}  # DFlash2Config field -> config.json key, where they differ
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")        # in config.json's dflash_config
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # there, for DFlash2 only
SUPPORTED = {  # config.json fields that change what a drafter computes: any other value is refused, not ignored
    "output_multiplier": lambda v: v in (None, 1), "final_logit_softcapping": lambda v: v is None,
    "input_embedding_scale": lambda v: v in (None, 1), "use_sliding_window": lambda v: not v,
    "layer_types": lambda v: all(t == "full_attention" for t in v or []),
    "is_causal": lambda v: not v,  # attention inside a block is bidirectional
    "hidden_act": lambda v: v in (None, "silu"), "attention_bias": lambda v: not v,
    "rope_parameters": lambda v: (v or {}).get("rope_type", (v or {}).get("type", "default")) == "default",
}


def checkpoint_config(c):
    """config.json of a drafter config: a Qwen3 config plus the DFlash/DFlash2 fields in dflash_config."""
    return {
        "architectures": ["DFlash2DraftModel" if c.is_dflash2 else "DFlashDraftModel"],
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
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False,
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        "dflash_config": {k: getattr(c, k) for k in DFLASH_FIELDS + (DFLASH2_FIELDS if c.is_dflash2 else ())},
    }


def config_fields(raw, where):
    """The inverse of checkpoint_config, for DFlash2 and DFlash (v1) exports -> DFlash2Config fields."""
    if (raw.get("architectures") or [None])[0] not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"{where}: architectures {raw.get('architectures')} is not a DFlash drafter "
                         "(expected ['DFlash2DraftModel'] or ['DFlashDraftModel'])")
    raw = {**raw, "rope_parameters": raw.get("rope_parameters") or raw.get("rope_scaling")}
    for name, ok in SUPPORTED.items():
        if not ok(raw.get(name)):
            raise ValueError(f"{where}: {name} = {raw[name]!r} is not supported by this implementation (only the "
                             "plain Qwen3 drafter: no soft-capping, multipliers, sliding windows or RoPE scaling)")
    d = raw.get("dflash_config", {})
    try:
        return dict(
            {k: raw[QWEN3_NAMES.get(k, k)] for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                     "num_kv_heads", "vocab_size", "num_target_layers", "rms_norm_eps",
                                                     "max_position_embeddings")},
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rope_theta=raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"],
            block_size=d.get("block_size") or raw["block_size"], mask_token_id=d["mask_token_id"],
            target_layer_ids=d["target_layer_ids"], conv_kernel_size=d.get("conv_kernel_size", 0),
            selector_top_k=d.get("selector_top_k", 0), **{k: d[k] for k in ("conv_group_size", "selector_rank") if k in d})
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where} lacks the key {e.args[0]!r} of a DFlash drafter config") from None


def servable(drafter, embedding=None):
    """Engines build both DFlash2 parts for "DFlash2DraftModel", so a drafter with one part
    switched off is exported with the other as the exact identity: a convolution with
    tap 0 = 1 and nothing else, or a selector whose zero codebooks add nothing to the
    unary logits (the walk then picks the unary argmax at T = 0). Both off: DFlash (v1).
    Factored codebooks (§3) are materialized as the [V, R] tables engines read, from
    `embedding`, the target's input embedding: A = E·W_Aᵀ, Bc = E·W_Bᵀ.
    -> a drafter that computes what `drafter` computes, with both parts or none."""
    c, state = drafter.config, drafter.state_dict()
    factored = bool(c.selector_top_k) and c.selector_codebooks == "factored"
    if not c.is_dflash2 or (c.conv_kernel_size and c.selector_top_k and not factored):
        return drafter
    full = {"selector_codebooks": "free"}
    if factored:
        if embedding is None:
            raise ValueError("the drafter's selector has factored codebooks: exporting it needs the target's input "
                             "embedding (save_export(..., embedding=target.get_input_embeddings()))")
        with torch.no_grad():  # the same F.linear on fp32 rows as CandidateSelector.edge_scores
            E = embedding.weight.float()
            for side in ("predecessor", "successor"):
                W = state.pop(f"candidate_selector.{side}_projection.weight").float()
                state[f"candidate_selector.{side}_codebook"] = F.linear(E, W)
    if not c.conv_kernel_size:
        taps, group = 2, c.conv_group_size if c.hidden_size % c.conv_group_size == 0 else c.hidden_size
        identity = torch.zeros(2, taps, c.hidden_size)
        identity[:, 0] = 1.0
        for i in range(c.num_layers):
            for part in ("attention_conv", "mlp_conv"):
                state[f"layers.{i}.{part}.base_kernel"] = identity.clone()  # safetensors refuses shared storage
                state[f"layers.{i}.{part}.kernel_projection.weight"] = torch.zeros(2 * taps * c.hidden_size // group,
                                                                                   c.hidden_size)
        full.update(conv_kernel_size=taps, conv_group_size=group)
    if not c.selector_top_k:
        R = c.selector_rank
        state["candidate_selector.hidden_projection.weight"] = torch.zeros(R, c.hidden_size)
        state["candidate_selector.predecessor_codebook"] = torch.zeros(c.vocab_size, R)
        state["candidate_selector.successor_codebook"] = torch.zeros(c.vocab_size, R)
        full.update(selector_top_k=min(16, c.vocab_size))
    whole = dflash2.DFlash2Drafter(dataclasses.replace(c, **full))
    whole.load_state_dict(state)
    return whole


def save_export(drafter, path, dtype=torch.bfloat16, embedding=None):
    """servable(drafter, embedding) as the folder `path` with config.json + model.safetensors,
    written under a temporary name and renamed into place, world-readable (servers run as
    other users). embedding: the target's input embedding, needed by factored codebooks only."""
    from safetensors.torch import save_file
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"checkpoint dtype {dtype} must be torch.bfloat16, torch.float16 or torch.float32")
    path, drafter = os.path.abspath(path), servable(drafter, embedding)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path))
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**checkpoint_config(drafter.config), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
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


def load_export(path, dtype=torch.float32, **overrides):
    """The DFlash2Drafter of a DFlash2 or DFlash (v1) export folder; no pickle on this path.
    overrides: DFlash2Config fields. A v1 export loads into a v1 drafter or, with overrides
    that switch the convolution / selector on, into a DFlash2 drafter whose new parts keep
    their identity init (warm start)."""
    from safetensors.torch import load_file
    dflash2.known_fields(overrides)  # a misspelt override fails before any file is read
    cfg_file, weights_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"{f} not found: a drafter checkpoint is a folder with config.json and model.safetensors")
    with open(cfg_file) as f:
        raw = json.load(f)
    drafter = dflash2.DFlash2Drafter(dflash2.DFlash2Config(**{**config_fields(raw, cfg_file), **overrides}))
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # a truncated file, a pickle, anything that is not safetensors
        raise ValueError(f"{weights_file} is not a readable safetensors file: {e}") from e
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if raw["architectures"][0] == "DFlashDraftModel":  # warm start: the DFlash2 parts keep their identity init
        missing = [k for k in missing if "_conv." not in k and not k.startswith("candidate_selector.")]
    unexpected = sorted(set(tensors) - set(expected))
    mis_shaped = sorted(f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                        if k in tensors and tensors[k].shape != v.shape)
    if missing or unexpected or mis_shaped:
        raise ValueError(f"{weights_file} does not match the drafter config: missing {missing}, "
                         f"unexpected {unexpected}, mis-shaped {mis_shaped}")
    drafter.load_state_dict(tensors, strict=False)
    return drafter.to(dtype)


def serving_commands(target, export_path, block_size):
    """How each engine serves an export: vLLM counts the B - 1 drafted tokens, SGLang the whole
    block B; the z-lab `dflash` package's CLI needs its runtime extra and a CUDA device."""
    return [
        f"vllm serve {target} --speculative-config "
        f"'{{\"method\": \"dflash\", \"model\": \"{export_path}\", \"num_speculative_tokens\": {block_size - 1}}}'",
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {export_path} --speculative-num-draft-tokens {block_size}",
        f"pip install \"dflash[local]\" && dflash generate transformers --model {target} --draft {export_path} \"Hello\"",
    ]


# -----------------------------------------------------------------------------
# a training run's files


def check_out_dir(out_dir):
    """Fail before any work if --out-dir cannot be created or written."""
    p = Path(out_dir).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {out_dir} is not writable ({p} is not a writable directory)")


def weights_fingerprint(model):
    """Cheap identity of a model's weights: float64 sums of its first and last tensors."""
    params = list(model.parameters())
    return [round(float(p.detach().double().sum()), 6) for p in (params[0], params[-1])]


def data_fingerprint(rows):
    """Rows count and a hash of 16 evenly spaced rows' token ids (the whole set can be GBs)."""
    picks = sorted({i * (len(rows) - 1) // 15 for i in range(16)})
    digest = hashlib.sha256(json.dumps([rows[i]["input_ids"].tolist() for i in picks]).encode()).hexdigest()[:16]
    return {"rows": len(rows), "sample_sha256": digest}


def run_identity(target_config, drafter_config, train_rows, seq_len, schedule):
    """Everything a resumed run must share with the run it continues."""
    target = {k: v for k, v in target_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")}
    return {"target_config": target, "data": data_fingerprint(train_rows), "seq_len": seq_len, "schedule": schedule,
            "drafter": dataclasses.asdict(drafter_config)}


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
    """OUT/curves.png from the record: loss, expected AL (unary / selector / oracle) and the
    per-slot accuracy of each evaluation, against steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    train_rows, evals = [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss")
    ax[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="val loss")
    for key in ("al_unary", "al_selector", "al_oracle"):
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


def save_checkpoint(drafter, optimizer, step, out_dir, export_dtype, meta, embedding=None):
    """The servable export, then the resume state; each written under a temp name and renamed.
    resume.pt holds the drafter's own parameters: factored codebooks as W_A and W_B, not tables."""
    save_export(drafter, os.path.join(out_dir, "checkpoint"), getattr(torch, export_dtype), embedding)
    tmp = os.path.join(out_dir, f"resume.pt.tmp{os.getpid()}")
    torch.save({"model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **meta}, tmp)
    os.replace(tmp, os.path.join(out_dir, "resume.pt"))
