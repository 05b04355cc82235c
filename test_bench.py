"""Smoke test of bench.py --quick: every part runs end to end and reports what it measured."""
import json
import os

import bench


def test_bench_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "bench"
    results = bench.main(bench.parse_args(["--quick", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                                           "--device", "cpu", "--dtype", "float32"]))
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) >= {"draft_step", "train_step", "ablation", "wall_seconds"}, f"missing parts: {sorted(saved)}"
    assert set(saved["ablation"]["variants"]) == set(bench.VARIANTS), sorted(saved["ablation"]["variants"])
    for name, per_seed in results["ablation"]["variants"].items():
        for t in ("T=0", "T=1"):
            al = per_seed[0][t]["al_mean"]
            assert 1 <= al <= 8, f"{name} {t}: acceptance length {al} outside [1, B]"
        has_selector = bench.VARIANTS[name][1] > 0
        assert ("T=0 unary path" in per_seed[0]) == has_selector, f"{name}: unary-path run present iff selector on"
    assert set(saved["draft_step"]["median_ms"]) == set(bench.VARIANTS) | {"walk alone"}
    assert os.path.getsize(out / "per_slot_acceptance.png") > 1000, "the plot was not written"
    assert "| DFlash2 |" in (out / "results.md").read_text()
