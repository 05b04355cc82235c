"""bench.py: the bootstrap against exact references, bad flags, and a smoke run of --quick."""
import itertools
import json
import os
import statistics

import pytest
import torch

from bench import ablation as bench
import dflash2 as D


def test_bootstrap_over_prompts_matches_exact_enumeration():
    """One seed, 4 prompts: the 4^4 equally likely resamples give the exact law of the
    bootstrap mean; 40000 replicates must reproduce it."""
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=torch.float64)
    exact = {}
    for pick in itertools.product(range(4), repeat=4):
        m = round(float(x[0, list(pick)].mean()), 6)
        exact[m] = exact.get(m, 0) + 1 / 4 ** 4
    reps = bench.bootstrap([x], lambda a: a.mean((1, 2)), n=40000)
    for m, p in exact.items():
        got = float((reps.sub(m).abs() < 1e-6).double().mean())
        assert abs(got - p) < 0.006, f"P(mean = {m}): bootstrap {got:.4f}, exact {p:.4f}"
    lo, hi = bench.interval(reps)
    cdf = lambda v: sum(p for m, p in exact.items() if m <= v + 1e-9)
    assert cdf(lo) >= 0.025 - 0.006 and cdf(hi) >= 0.975 - 0.006, f"interval [{lo}, {hi}] is not at the exact quantiles"


def test_bootstrap_redraws_seeds_and_prompts_independently():
    """x[s, p] = a[s] + b[p]: the resampled mean is mean(a*) + mean(b*), two independent
    bootstrap means, so its variance is var(a)/S + var(b)/P (population variances)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    x = a[:, None] + b[None, :]
    reps = bench.bootstrap([x], lambda v: v.mean((1, 2)), n=40000)
    want = a.var(unbiased=False) / 3 + b.var(unbiased=False) / 64
    assert abs(reps.var() / want - 1) < 0.05, f"bootstrap variance {reps.var():.5f}, analytic {want:.5f}"
    assert abs(reps.mean() - x.mean()) < 0.01, (reps.mean(), x.mean())


def test_ratio_is_paired_and_slot_rate_pools_counts():
    g = torch.Generator().manual_seed(2)
    y = 1 + torch.rand(3, 64, generator=g, dtype=torch.float64)
    assert bench.ratio_ci(2 * y, y) == pytest.approx((2, 2, 2)), "a paired ratio of 2·y to y must be exactly 2"
    accepted = torch.tensor([[[3, 1], [1, 0]]], dtype=torch.float64)   # (S=1, P=2, B-1=2)
    reached = torch.tensor([[[4, 3], [2, 1]]], dtype=torch.float64)
    rate, lo, hi = bench.slot_ci(accepted, reached)
    assert rate == pytest.approx([4 / 6, 1 / 4]), rate
    assert all(l <= r <= h for l, r, h in zip(lo, rate, hi)), (lo, rate, hi)


def test_without_selector_proposes_by_unary_argmax_and_leaves_the_original_alone():
    c = D.DFlash2Config(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=50,
                        num_target_layers=4, target_layer_ids=[1], mask_token_id=0, num_layers=1, selector_rank=8)
    drafter = D.DFlash2Drafter(c)
    unary = bench.without_selector(drafter)
    assert unary.candidate_selector is None and unary.config.selector_top_k == 0, "the copy still has a selector"
    assert drafter.candidate_selector is not None and drafter.config.selector_top_k == 16, "the original lost its selector"
    assert unary.layers is drafter.layers, "the copy must share the drafter's weights"
    g = torch.Generator().manual_seed(0)
    h, logits = torch.randn(3, 7, 32, generator=g), torch.randn(3, 7, 50, generator=g)
    assert torch.equal(unary.propose(h, logits, torch.tensor([1, 2, 3]))[0], logits.argmax(-1))
    assert not any(k.startswith("candidate_selector.") for k in unary.state_dict())
    assert any(k.startswith("candidate_selector.") for k in drafter.state_dict())


@pytest.mark.parametrize("flag", [["--seeds", "0"], ["--eval-prompts", "0"], ["--temperatures", "0,-1"],
                                  ["--parts", "ablation,speed"], ["--drafters", "DFlash,DFlash3"]])
def test_bad_flags_fail_before_any_work(tmp_path, monkeypatch, flag):
    monkeypatch.setattr(bench, "ablation", lambda args: pytest.fail("the ablation started"))
    monkeypatch.setattr(bench, "draft_step_cost", lambda args: pytest.fail("the cost part started"))
    with pytest.raises(ValueError, match=flag[0]):
        bench.main(bench.parse_args(flag + ["--out-dir", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run that failed on bad flags"


def test_bench_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "bench"
    results = bench.main(bench.parse_args(["--quick", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                                           "--device", "cpu", "--dtype", "float32"]))
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) >= {"draft_step", "train_step", "ablation", "wall_seconds"}, f"missing parts: {sorted(saved)}"
    a = results["ablation"]
    want = set(bench.DRAFTERS) | {f"{n}, unary path" for n in ("+selector", "DFlash2", bench.SOFT)}
    assert set(a["summary"]) == want, sorted(a["summary"])
    for label, s in a["summary"].items():
        for t in ("T=0", "T=1"):
            runs = a["variants"][label]["spec"][t]
            assert len(runs) == 2 and all(len(r["al"]) == a["prompts"] for r in runs), f"{label} {t}: seeds × prompts"
            mean, lo, hi = s[t]["al"]
            assert 1 <= lo <= mean <= hi <= 8, f"{label} {t}: AL {mean} [{lo}, {hi}] outside [1, B] or not ordered"
            assert mean == pytest.approx(statistics.mean(x for r in runs for x in r["al"])), label
    assert "ratio_vs_dflash" in a["summary"]["DFlash2"]["T=0"] and "ratio_vs_unary_path" in a["summary"]["DFlash2"]["T=1"]
    assert "ratio_vs_argmax_labels" in a["summary"][bench.SOFT]["T=1"], sorted(a["summary"][bench.SOFT]["T=1"])
    assert a["summary"]["DFlash2"]["val"]["blocks"] >= 64, a["summary"]["DFlash2"]["val"]
    assert "accept_selector" in a["summary"]["DFlash2"]["val"] and "accept_selector" not in a["summary"]["+conv"]["val"], \
        "selector metrics belong to the drafters trained with a selector, and only to them"
    assert set(saved["draft_step"]["median_ms"]) == set(bench.VARIANTS) | {"walk alone"}
    assert os.path.getsize(out / "per_slot_acceptance.png") > 1000, "the plot was not written"
    assert "| DFlash2 |" in (out / "results.md").read_text()
