"""
What a training run keeps under --out-dir, for train.py: the servable export (§7: a drafter
with one DFlash2 part switched off is exported with the other as the identity) and the resume
state (each written under a temporary name and renamed into place), the identity a resumed
run must share with the run it continues, and the run's record (metrics.jsonl, curves.png).
"""
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from dflash2 import DFlash2Drafter


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


def export(drafter, path, dtype=torch.bfloat16):
    """The folder engines serve (§7): save_pretrained of servable(drafter)."""
    servable(drafter).save_pretrained(path, dtype)


def servable(drafter):
    """Engines build both DFlash2 parts for "DFlash2DraftModel", so a drafter with one part
    switched off is exported with the other as the exact identity: a convolution with
    tap 0 = 1 and nothing else, or a selector whose zero codebooks add nothing to the
    unary logits (the walk then picks the unary argmax at T = 0). Both off: DFlash (v1).
    -> a drafter that computes exactly what `drafter` computes, with both parts or none."""
    c, state = drafter.config, drafter.state_dict()
    if not c.is_dflash2 or (c.conv_kernel_size and c.selector_top_k):
        return drafter
    full = {}
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
    full_drafter = DFlash2Drafter(dataclasses.replace(c, **full))
    full_drafter.load_state_dict(state)
    return full_drafter.to(drafter.fc.weight.dtype)


def save_checkpoint(drafter, optimizer, step, out_dir, export_dtype, meta):
    """The servable export, then the resume state; each written under a temp name and renamed."""
    export(drafter, os.path.join(out_dir, "checkpoint"), getattr(torch, export_dtype))
    tmp = os.path.join(out_dir, f"resume.pt.tmp{os.getpid()}")
    torch.save({"model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **meta}, tmp)
    os.replace(tmp, os.path.join(out_dir, "resume.pt"))


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
