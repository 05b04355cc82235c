"""Tests of harness/metrics.py (ALGORITHM.md §6): the metrics of a training batch, read off the loss's own
slots, against loops over the counted slots, on test_dflash2.py's tiny random target, drafter, batch
and loop references (conftest.py's), and the end-of-run decoding; nothing is downloaded.
Run: python -m pytest tests/test_metrics.py -q
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import dflash2
from conftest import (ANCHORS, B, H, MASK_ID, S, SERVED, V, VALID, WIDE_K, argmax_loop, counted_slots, echo_forward,
                      float64_scores, loss_batch, make_batch, make_drafter, make_target, ref_edge_score,
                      ref_filtered_law, ref_greedy_walk, ref_topk, with_last_hidden)
from dflash2 import LossConfig, block_layout, dflash2_loss, target_view
from harness.metrics import decoding_eval, dflash2_metrics, expected_acceptance_length

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def batch(target):
    return make_batch(target)


def loss_and_metrics(drafter, target, batch, anchors=ANCHORS, anchor_valid=VALID, cfg=LossConfig(),
                     accept_at=(1.0, 1.0, 0)):
    """dflash2_loss and dflash2_metrics (of the loss's own slots, the acceptance metrics at accept_at) of a batch:
    (L, its stats as floats with the §6 metrics)."""
    view = target_view(drafter.config, target)
    loss, stats, slots = dflash2_loss(drafter, view, loss_batch(batch, anchors, anchor_valid), cfg)
    return loss, {k: v.item() for k, v in stats.items()} | dflash2_metrics(drafter, view, slots, cfg, accept_at)


def leading_run(hits):
    run = 0
    for hit in hits:
        if not hit:
            break
        run += 1
    return run


def assert_same_metrics(got, want, what, tol):
    for key, value in want.items():
        diff = (torch.tensor(got[key], dtype=torch.float64) - torch.tensor(value, dtype=torch.float64)).abs().max()
        assert diff < tol, f"{what}: stats[{key!r}] {got[key]} != {value}"


def test_expected_acceptance_length_is_one_plus_the_leading_correct_slots():
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    want = [1 + leading_run(row) for row in correct.tolist()]
    got = expected_acceptance_length(correct).tolist()
    assert got == want, f"AL {got} != 1 + leading correct slots {want}"


def test_every_metric_comes_from_the_loss_own_drafter_pass(target, batch):
    """The loss's stats and every §6 metric, per-slot ones B-1 long, after one drafter pass: the metrics
    read the loss's own slots."""
    drafter, seen = make_drafter(randomize=True), []
    hook = drafter.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        _, stats = loss_and_metrics(drafter, target, batch)
    finally:
        hook.remove()
    assert len(seen) == 1, f"the loss and its metrics ran the drafter {len(seen)} times, want once"
    keys = {"loss", "unary_loss", "selector_loss", "slot_acc", "al_unary", "oracle", "selector_tf_acc",
            "walk_slot_acc", "al_walk", "al_oracle", "accept_unary", "accept_selector", "mass_at_k"}
    assert set(stats) == keys, f"stats keys differ: {set(stats) ^ keys}"
    assert len(stats["slot_acc"]) == len(stats["walk_slot_acc"]) == B - 1, \
        f"per-slot metrics {stats['slot_acc']}, {stats['walk_slot_acc']} should have B-1 = {B - 1} entries"


def test_a_drafter_that_outputs_the_target_state_at_a_plus_k_minus_1_is_always_right(target, batch, monkeypatch):
    drafter = make_drafter()
    G = 10 * torch.randn(2, S, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    monkeypatch.setattr(drafter, "forward", echo_forward(G, 0))
    _, stats = loss_and_metrics(drafter, target, with_last_hidden(batch, G))
    assert stats["slot_acc"] == [1.0] * (B - 1), f"aligned drafter has slot accuracy {stats['slot_acc']}"


@pytest.mark.parametrize("accept_at", [(1.0, 1.0, 0), SERVED], ids=["T=1", "served"])
def test_metrics_equal_loops(target, batch, monkeypatch, accept_at):
    """§6 metrics against loops over the counted slots, on a stand-in drafter that is right
    about half the time, so that no metric is trivially 0 or 1. The anchors include blocks
    whose slot 1 is not counted (8, 18 and the padding) and blocks cut short by the end.
    The acceptance metrics at T = 1 unfiltered (the default) and at a setting whose filters cut."""
    drafter = make_drafter()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 0.5, generator=g)
        drafter.candidate_selector.predecessor_codebook.normal_(0, 0.1, generator=g)
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 0.1, generator=g)
    anchors = torch.tensor([[2, 3, 5, 6, 8, 10, 12, 14, 15, 17, 18], [3, 4, 5, 7, 8, 9, 10, 12, 0, 0, 0]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[1, 8:] = False
    N = anchors.shape[1]
    G = 10 * torch.randn(2, S, H, generator=g, dtype=torch.float64)
    noise = 6 * torch.randn(2, N * B, H, generator=g, dtype=torch.float64)  # a drafter that is sometimes right
    forward = echo_forward(G, noise=noise)
    monkeypatch.setattr(drafter, "forward", forward)
    ids, pos = block_layout(batch["input_ids"], anchors, B, MASK_ID)
    h = forward(None, pos, None, None).view(2, N, B, H)
    unary = target.lm_head(h[:, :, 1:])
    batch, logits = with_last_hidden(batch, G), target.lm_head(G)
    stats = loss_and_metrics(drafter, target, batch, anchors=anchors, anchor_valid=valid,
                             accept_at=accept_at)[1]
    temperature, top_p, top_k = accept_at

    sel, slots = drafter.candidate_selector, counted_slots(batch, anchors, valid)
    hits = {name: {} for name in ("unary", "oracle", "tf", "walk")}
    walks, accept = {}, {"accept_unary": 0.0, "accept_selector": 0.0, "mass_at_k": 0.0}
    for n, j, k, t in slots:
        label = logits[n, t - 1].argmax().item()
        u = unary[n, j, k - 1]
        cand = ref_topk(u, 5)
        scores = [ref_edge_score(sel, h[n, j, k], u, batch["input_ids"][n, t - 1].item(), c) for c in cand]
        if (n, j) not in walks:
            walks[n, j] = ref_greedy_walk(sel, h[n, j, 1:], unary[n, j], ids[n, j * B].item())
        hits["unary"][n, j, k] = u.argmax().item() == label
        hits["oracle"][n, j, k] = label in cand
        hits["tf"][n, j, k] = cand[scores.index(max(scores))] == label
        hits["walk"][n, j, k] = walks[n, j][k - 1] == label
        p, q_unary = (ref_filtered_law(x, temperature, top_p, top_k) for x in (logits[n, t - 1], u))
        q_sel = F.softmax(torch.tensor(scores) / temperature, 0)
        accept["accept_unary"] += sum(min(x, q_unary.get(v, 0.0)) for v, x in p.items())
        accept["accept_selector"] += sum(min(p.get(c, 0.0), q_sel[i].item()) for i, c in enumerate(cand))
        accept["mass_at_k"] += sum(p.get(c, 0.0) for c in cand)

    def mean_al(hit):  # over blocks whose slot 1 counts; an uncounted slot ends the run
        blocks = [(n, j) for n, j, k, t in slots if k == 1]
        return sum(1 + leading_run(hit.get((n, j, k), False) for k in range(1, B)) for n, j in blocks) / len(blocks)

    def per_slot(hit, among):
        return [sum(hit[s] for s in among if s[2] == k) / max(1, sum(s[2] == k for s in among)) for k in range(1, B)]

    keys = [s[:3] for s in slots]
    reached = [s for s in keys if all(hits["walk"].get((s[0], s[1], k), False) for k in range(1, s[2]))]
    want = {"slot_acc": per_slot(hits["unary"], keys), "al_unary": mean_al(hits["unary"]),
            "oracle": sum(hits["oracle"].values()) / len(keys), "al_oracle": mean_al(hits["oracle"]),
            "selector_tf_acc": sum(hits["tf"].values()) / len(keys), "al_walk": mean_al(hits["walk"]),
            "walk_slot_acc": per_slot(hits["walk"], reached), **{k: v / len(keys) for k, v in accept.items()}}
    for name, value in want.items():
        got = stats[name]
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
                              atol=1e-6), f"{name}: {got} != loop {value}"
    assert all(0 < x < 1 for x in stats["slot_acc"] + stats["walk_slot_acc"][:2]) \
        and stats["al_unary"] not in (stats["al_walk"], stats["al_oracle"]) \
        and 0 < stats["accept_selector"] < stats["mass_at_k"] < 1, \
        f"metrics too degenerate to tell a wrong one from a right one: {stats}"


@pytest.mark.parametrize("accept_at, message", [
    ((1.0, 0.0, 20), r"accept_at \(1.0, 0.0, 20\): top_p \(0.0\) must be in \(0, 1\]"),
    ((1.0, 1.0, 2.5), r"accept_at \(1.0, 1.0, 2.5\): top_k \(2.5\) must be an integer"),
    ((0.0, 1.0, 0), r"accept_at \(0.0, 1.0, 0\): temperature must be > 0")])
def test_metrics_refuse_an_acceptance_setting_without_a_law(target, batch, accept_at, message):
    with pytest.raises(ValueError, match=message):
        loss_and_metrics(make_drafter(), target, batch, accept_at=accept_at)


def test_metrics_do_not_depend_on_chunk_size_or_grad_checkpoint(target, batch, monkeypatch):
    """The metrics walk chunk_size // (B - 1) blocks at a time: the same metrics at any chunk size, also ones
    that do not divide the counted slots, in float64 to 1e-10, then with the real fp32 edge scores to fp32
    rounding; and the same with grad_checkpoint."""
    drafter = make_drafter(randomize=True, selector_top_k=WIDE_K)
    n = len(counted_slots(batch, ANCHORS, VALID))
    float64_scores(monkeypatch, drafter.candidate_selector)
    for kw in (dict(loss_type="kl"),
               dict(loss_type="ce", selector_labels="soft", soft_labels_at=SERVED)):
        want = loss_and_metrics(drafter, target, batch, cfg=LossConfig(**kw))[1]
        for chunk in (1, 5, n - 1, n, 10 * n):
            assert_same_metrics(loss_and_metrics(drafter, target, batch, cfg=LossConfig(chunk_size=chunk, **kw))[1],
                                want, f"{kw}, chunk_size {chunk} of {n} slots", 1e-10)
    monkeypatch.undo()
    assert_same_metrics(loss_and_metrics(drafter, target, batch, cfg=LossConfig(chunk_size=5))[1],
                        loss_and_metrics(drafter, target, batch)[1], "fp32 edge scores, chunk_size 5", 1e-6)
    drafter = make_drafter(randomize=True, selector_top_k=V)
    want = loss_and_metrics(drafter, target, batch)[1]
    drafter.grad_checkpoint = True
    assert_same_metrics(loss_and_metrics(drafter, target, batch)[1], want, "grad_checkpoint", 1e-12)


# -----------------------------------------------------------------------------
# the end-of-run decoding: spec_generate on held-out prompts


@pytest.fixture(scope="module")
def decoding():
    """A float32 target and drafter (the dtype decoding_eval decodes a CPU target in) and a prompt (1, P)."""
    return make_target(dtype=torch.float32), make_drafter(randomize=True).float(), torch.tensor([[5, 9, 3, 7]])


def decoded(decoding, seed, eos, max_new_tokens=12):
    """decoding_eval's first output at T = 0 and T = 1, as token ids (its tokenizer decodes ids to themselves)."""
    target, drafter, prompt = decoding
    tokenizer = SimpleNamespace(eos_token_id=eos, decode=lambda ids: ids.tolist())
    table = decoding_eval(drafter, target, tokenizer, [prompt], max_new_tokens, seed, log=lambda *a: None)
    return table[0.0][2], table[1.0][2]


def test_the_end_of_run_decoding_stops_at_eos(decoding):
    """At T = 0: the target's greedy tokens up to and with the first eos, then no more."""
    greedy, _ = argmax_loop(decoding[0], decoding[2][0].tolist(), 12)
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])  # its first use: eos there
    got = decoded(decoding, 0, eos=greedy[k])[0]
    assert got == greedy[:k + 1], f"with eos {greedy[k]} (greedy token {k}) the decoding gave {got}, the greedy " \
        f"tokens up to it are {greedy[:k + 1]}"


def test_the_end_of_run_sampling_is_seeded_by_the_runs_seed(decoding):
    got = {run: decoded(decoding, seed, eos=-1)[1] for run, seed in (("seed 0", 0), ("seed 0 again", 0),
                                                                       ("seed 1", 1))}
    assert got["seed 0"] == got["seed 0 again"], f"one seed sampled twice: {got['seed 0']} then {got['seed 0 again']}"
    assert got["seed 0"] != got["seed 1"], f"seeds 0 and 1 sampled the same tokens at T = 1: {got['seed 0']}"


def test_the_end_of_run_decoding_verifies_the_draft_length_asked(decoding, monkeypatch):
    """draft_tokens reaches every spec_generate call of the end-of-run decoding, and no cycle commits more than
    draft_tokens + 1 tokens (None: the block's B − 1)."""
    target, drafter, prompt = decoding
    real_spec, seen = dflash2.spec_generate, []

    def recording(*a, **k):
        out = real_spec(*a, **k)
        seen.append((k.get("draft_tokens"), max(out[1].acceptance_lengths, default=1)))
        return out
    monkeypatch.setattr(dflash2, "spec_generate", recording)
    tokenizer = SimpleNamespace(eos_token_id=-1, decode=lambda ids: ids.tolist())
    for n in (None, 2):
        seen.clear()
        decoding_eval(drafter, target, tokenizer, [prompt], 12, 0, log=lambda *a: None, draft_tokens=n)
        assert [asked for asked, _ in seen] == [n, n], f"draft_tokens {n}: spec_generate was asked {seen}"
        limit = (n or drafter.config.block_size - 1) + 1
        assert all(longest <= limit for _, longest in seen), f"draft_tokens {n}: cycles committed {seen}"


def test_the_evaluation_decodes_with_the_draft_length_asked():
    """A target and a selector-off drafter whose logits are all 0 (lm_head zeroed): at T = 0 every draft is the
    argmax, at T = 1 the drafts' law is the target's, so every draft is accepted and each cycle commits the drafts
    verified and a bonus. evaluate(draft_tokens=n) then reports AL n + 1 at T = 0 and at T = 1, not B's."""
    import datasets
    from conftest import tiny_qwen3
    from tests.conftest import tiny_drafter
    from harness.metrics import evaluate
    target = tiny_qwen3(vocab_size=40, dtype=torch.float32)
    target.lm_head.weight.zero_()
    drafter = tiny_drafter(target, dtype=torch.float32, block_size=8, selector_top_k=0)
    val = datasets.Dataset.from_dict({"input_ids": [[3, 5, 7, 9, 11, 2], [4, 6, 8, 10]],
                                      "loss_mask": [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1]]}).with_format("torch")
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=-1, decode=lambda ids: ids.tolist())
    n = 2
    summary = evaluate(drafter, target, tokenizer, val, LossConfig(), 2, 4, 0, log=lambda *a: None, prompts=2,
                       max_new_tokens=1 + 3 * (n + 1), draft_tokens=n)
    got = {"T = 0": summary["al_t0"], "T = 1": summary["al_t1"]}
    assert got == {"T = 0": n + 1, "T = 1": n + 1}, \
        f"evaluate(draft_tokens={n}) with every draft accepted reports AL {got}, want {n + 1} (B = 8)"
