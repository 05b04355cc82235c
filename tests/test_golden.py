"""
Tests of the porter's kit (ALGORITHM.md §8): dflash2.py still reproduces the committed
golden set in golden/, the NumPy port (port_numpy.py) reproduces it from ALGORITHM.md
alone, and bad golden input is refused. Nothing is downloaded.
Run: python -m pytest test_golden.py -q
"""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from port import golden
from port import port_numpy as port

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "port", "golden")
TOL = 1e-5  # relative to the tensor's largest magnitude: fp32 rounding, not behaviour


def assert_close(name, got, want):
    """Integers and booleans exactly; floats to TOL·max|want|."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != golden {want.shape}"
    if want.dtype.kind in "biu":
        bad = np.argwhere(got != want)
        assert not len(bad), f"{name}: {len(bad)} entries differ, first at {tuple(bad[0])}: {got[tuple(bad[0])]} != {want[tuple(bad[0])]}"
        return
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got.astype(np.float64) - want).max())
    assert err <= TOL * scale, f"{name}: max |diff| {err:.3g} > {TOL}·{scale:.3g}"


@pytest.fixture(scope="module")
def committed():
    return golden.read_golden(GOLDEN)


# -----------------------------------------------------------------------------
# (a) the reference still computes the committed set


def test_dflash2_reproduces_committed_golden(tmp_path, committed):
    out = tmp_path / "golden"
    out.mkdir()
    (out / "stale.txt").write_text("left over")  # force=True writes over a non-empty folder
    golden.write_golden(str(out), force=True)
    fresh = golden.read_golden(str(out))
    assert sorted(fresh) == sorted(committed), (
        f"tensor names changed: new {sorted(set(fresh) - set(committed))}, gone {sorted(set(committed) - set(fresh))}")
    for name in sorted(committed):
        assert_close(name, fresh[name], committed[name])
    for model in ("drafter", "target"):
        with open(out / model / "config.json") as f, open(os.path.join(GOLDEN, model, "config.json")) as g:
            new, old = json.load(f), json.load(g)
        new.pop("transformers_version", None), old.pop("transformers_version", None)
        assert new == old, f"{model}/config.json differs in {sorted(k for k in {*new, *old} if new.get(k) != old.get(k))}"
        new_w, old_w = load_file(out / model / "model.safetensors"), load_file(os.path.join(GOLDEN, model, "model.safetensors"))
        assert sorted(new_w) == sorted(old_w), f"{model} tensor names differ"
        for name in sorted(old_w):
            assert_close(f"{model}/{name}", new_w[name], old_w[name])


# -----------------------------------------------------------------------------
# (b) the NumPy port, written from ALGORITHM.md, computes the same tensors


@pytest.fixture(scope="module")
def ported():
    cfg, weights = port.load_drafter(os.path.join(GOLDEN, "drafter"))
    embed, lm_head = port.load_target_tables(os.path.join(GOLDEN, "target"))
    return cfg, weights, embed, lm_head


def test_port_forward_matches_golden(committed, ported):
    g, (cfg, W, embed, _) = committed, ported
    ids, pos = port.block_layout(g["batch.input_ids"], g["batch.anchors"], cfg["B"], cfg["mask_id"])
    mask = port.block_mask(g["batch.anchors"], g["batch.attention_mask"], cfg["B"])
    assert_close("fwd.block_ids", ids, g["fwd.block_ids"])
    assert_close("fwd.block_pos", pos, g["fwd.block_pos"])
    assert_close("fwd.mask", mask, g["fwd.mask"])
    rec = {}
    hidden = port.drafter_forward(W, cfg, embed[ids], pos, g["fwd.ctx_features"].astype(port.DTYPE),
                                  g["fwd.ctx_pos"], mask, rec)
    rec["fwd.hidden"] = hidden
    expected = sorted(k for k in g if k.startswith("fwd.") and k not in
                      ("fwd.ctx_features", "fwd.ctx_pos", "fwd.block_ids", "fwd.block_pos", "fwd.mask"))
    assert sorted(rec) == expected, f"port records {sorted(set(rec) ^ set(expected))} unlike the golden set"
    for name in expected:
        assert_close(name, rec[name], g[name])


def test_port_walks_match_golden(committed, ported):
    """Walks on the golden hidden states, so a forward error cannot hide a walk error."""
    g, (cfg, W, _, lm_head) = committed, ported
    M, n, K = g["walk.candidates"].shape
    h = g["fwd.hidden"].astype(port.DTYPE).reshape(M, n + 1, -1)[:, 1:]
    unary = h @ lm_head.T
    assert_close("walk.unary", unary, g["walk.unary"])
    cand = port.candidates(unary, cfg["K"])
    assert_close("walk.candidates", cand, g["walk.candidates"])
    anchor = g["fwd.block_ids"].reshape(M, n + 1)[:, 0]
    assert_close("walk.anchor", anchor, g["walk.anchor"])
    path, scores, _ = port.walk(W, h, unary, anchor, cand)
    assert_close("walk.greedy_path", path, g["walk.greedy_path"])
    assert_close("walk.greedy_scores", scores, g["walk.greedy_scores"])
    path, scores, q = port.walk(W, h, unary, anchor, cand, g["walk.uniforms"], float(g["walk.temperature"]))
    assert_close("walk.sampled_path", path, g["walk.sampled_path"])
    assert_close("walk.sampled_scores", scores, g["walk.sampled_scores"])
    assert_close("walk.sampled_q", q, g["walk.sampled_q"])


def test_port_replays_greedy_trace(committed, ported):
    """§5 against the recorded target: every call's ids, the tokens and the ALs agree."""
    g, (cfg, W, embed, lm_head) = committed, ported
    ends = np.cumsum(g["trace.call_lengths"])
    starts = ends - g["trace.call_lengths"]
    calls = [(g["trace.logits"][s:e].astype(port.DTYPE), g["trace.ctx_features"][s:e].astype(port.DTYPE))
             for s, e in zip(starts, ends)]
    sent, tokens, als = port.replay_greedy(W, cfg, embed, lm_head, g["trace.prompt"], calls,
                                           int(g["trace.max_new_tokens"]))
    assert len(sent) == len(calls), f"the port made {len(sent)} target calls, the trace {len(calls)}"
    for c, (s, e) in enumerate(zip(starts, ends)):
        assert_close(f"trace call {c} input ids", sent[c], g["trace.input_ids"][s:e])
    assert_close("trace.tokens", tokens, g["trace.tokens"])
    assert_close("trace.acceptance_lengths", als, g["trace.acceptance_lengths"])
    assert als.max() > 1 and (als[:-1] < cfg["B"]).any(), (
        f"the trace's acceptance lengths {als.tolist()} should show both accepted and rejected drafts")


# -----------------------------------------------------------------------------
# (c) bad input


def test_write_golden_refuses_non_empty_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=str(tmp_path)):
        golden.write_golden(str(tmp_path))
    with pytest.raises(SystemExit):
        golden.main([str(tmp_path)])
    assert os.listdir(tmp_path) == ["notes.txt"], "a refused write must leave the folder alone"


def copy_golden(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    for f in ("golden.safetensors", "manifest.json"):
        shutil.copy(os.path.join(GOLDEN, f), d / f)
    with open(d / "manifest.json") as f:
        return d, json.load(f)


def write_manifest(d, manifest):
    with open(d / "manifest.json", "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("change", ["shape", "dtype", "missing", "extra"])
def test_manifest_mismatch_names_the_tensor(tmp_path, change):
    d, manifest = copy_golden(tmp_path)
    entry = next(e for e in manifest["tensors"] if e["name"] == "walk.sampled_q")
    if change == "shape":
        entry["shape"] = [1] + entry["shape"]
    elif change == "dtype":
        entry["dtype"] = "float16"
    elif change == "missing":
        manifest["tensors"].remove(entry)
    else:
        entry = {**entry, "name": "walk.not_there"}
        manifest["tensors"].append(entry)
    write_manifest(d, manifest)
    with pytest.raises(ValueError, match=entry["name"].replace(".", r"\.")):
        golden.read_golden(str(d))
