"""Tests of dflash2's speculative decoding (ALGORITHM.md §3-§5).

Every check runs against an independent reference: a naive greedy loop without a cache,
exact enumeration of one draft-verify cycle's law, the target's exact joint over all
short continuations (chi-square), and fresh prefills for the cache rollback. Tiny random
float64 targets from transformers.Qwen3Config, nothing downloaded. The checkpoint tests
(§7) are in test_checkpoint.py.
"""
import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
import torch

import dflash2
from conftest import (ForcedLookup, argmax_loop, chi_square_pvalue, exact_joint3, force_drafts, record_forward,
                      replace_q, tiny_qwen3)
from dflash2 import (DFlash2Drafter, DraftCache, acceptance_probability, context_features, residual_distribution, sampling_probs,
                     spec_generate, target_generate, verify_sampled)
from harness.lookup import SuffixLookup
from tests.conftest import tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab_size=32, num_layers=3)  # target_layer_ids [0, 1]: below the last layer


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, seed=1, block_size=5, target_layer_ids=[0, 1], selector_top_k=6)


def naive_greedy(target, prompt, n):
    """prompt + n tokens, each the argmax of target(whole sequence so far): no cache."""
    return list(prompt) + argmax_loop(target, prompt, n)[0]


PROMPTS = [(3,), (5, 9, 1, 7), (11, 30, 2, 2, 8, 19)]
REPEATING = [(5, 9, 1, 7, 5, 9, 1, 7, 5, 9), (3, 4, 3, 4, 3, 4, 3), (11, 30, 2, 2, 8, 19, 11, 30, 2)]  # for lookups
MAX_NEW = 20


@pytest.fixture(scope="module")
def greedy_reference(target):
    """prompt -> prompt + greedy continuation, long enough for a full block past MAX_NEW."""
    return {p: naive_greedy(target, p, MAX_NEW + 8) for p in PROMPTS + REPEATING}


def expected_cycles(n_right, block_size, max_new_tokens, looked_right=(None,), max_lookup=0):
    """(tokens committed, source) per cycle when the drafter's c-th cycle has its first n_right[c] drafts right and
    the lookup's c-th call (ForcedLookup, asked while a token is left to draft) proposes max_lookup tokens, the first
    looked_right[c] of them right (None: no proposal), each draft cut so the bonus never passes max_new_tokens."""
    cycles, emitted, calls = [], 1, 0            # the first token comes from the prefill
    while emitted < max_new_tokens:
        left = max_new_tokens - emitted - 1
        j, calls = (looked_right[calls % len(looked_right)], calls + 1) if left else (None, calls)
        drafted = sum(source == "drafter" for _, source in cycles)
        cycles.append((min(n_right[drafted % len(n_right)], block_size - 1, left) + 1, "drafter") if j is None
                      else (min(j, max_lookup, left) + 1, "lookup"))
        emitted += cycles[-1][0]
    return cycles


def expected_acceptance_lengths(n_right, block_size, max_new_tokens):
    """Tokens committed per cycle of expected_cycles with no lookup."""
    return [length for length, _ in expected_cycles(n_right, block_size, max_new_tokens)]


# -----------------------------------------------------------------------------
# greedy: output equals the target's own greedy decoding, token for token


def assert_greedy_run(out, stats, expected, what):
    assert out.tolist() == expected, f"{what}: {out.tolist()} != greedy {expected}"
    assert 1 + sum(stats.acceptance_lengths) == len(out) == stats.new_tokens, (
        f"{what}: 1 + Σ acceptance lengths {stats.acceptance_lengths} = {1 + sum(stats.acceptance_lengths)}, "
        f"{len(out)} tokens returned, stats.new_tokens = {stats.new_tokens}")


@pytest.mark.parametrize("max_new_tokens", [1, 2, 9, MAX_NEW])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_spec_generate_with_a_random_drafter_equals_naive_greedy(target, drafter, greedy_reference, prompt,
                                                                        max_new_tokens):
    expected = greedy_reference[prompt][len(prompt):len(prompt) + max_new_tokens]
    ids = torch.tensor([prompt])
    out, _ = target_generate(target, ids, max_new_tokens)
    assert out.tolist() == expected, f"target_generate {out.tolist()} != naive greedy {expected}"
    out, stats = spec_generate(drafter, target, ids, max_new_tokens)
    assert_greedy_run(out, stats, expected, f"spec_generate, prompt {prompt}")


def test_greedy_spec_generate_with_a_bf16_target_equals_its_own_greedy_decoding():
    """The bf16 path train.py takes on a GPU or an AMX CPU: a bf16 target with a float32
    drafter decodes at T = 0 exactly as the bf16 target's own greedy loop. The target's
    lm_head is sharpened (x 8) so that no argmax is a near-tie that bf16 rounding of a
    batched verification against one-token steps could flip."""
    target = tiny_qwen3(vocab_size=32, num_layers=3, dtype=torch.bfloat16, lm_head_scale=8.0)
    drafter = tiny_drafter(target, seed=1, block_size=5, target_layer_ids=[0, 1], selector_top_k=6).float()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want, _ = target_generate(target, ids, MAX_NEW)
        assert want.tolist() == argmax_loop(target, prompt, MAX_NEW)[0], f"prompt {prompt}: cached greedy loop drifted"
        out, stats = spec_generate(drafter, target, ids, MAX_NEW)
        assert_greedy_run(out, stats, want.tolist(), f"bf16 target, prompt {prompt}")
        assert len(stats.acceptance_lengths) < MAX_NEW, f"prompt {prompt}: no draft was ever accepted"


@pytest.mark.parametrize("max_new_tokens", [13, 11, 3])  # 1 + 3 full blocks; ends 2 tokens into a block; n < B-1 at once
@pytest.mark.parametrize("n_right", [0, 1, 2, 3, 4])     # B = 5: 4 = every draft right
@pytest.mark.parametrize("prompt", PROMPTS[1:])
def test_greedy_forced_drafts_accept_exactly_the_right_prefix(monkeypatch, target, drafter, greedy_reference,
                                                              prompt, n_right, max_new_tokens):
    reference = greedy_reference[prompt]
    force_drafts(monkeypatch, drafter, reference, [n_right])
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens)
    assert_greedy_run(out, stats, reference[len(prompt):len(prompt) + max_new_tokens], f"{n_right} right drafts")
    want = expected_acceptance_lengths([n_right], drafter.config.block_size, max_new_tokens)
    assert stats.acceptance_lengths == want, f"{n_right} right drafts: acceptance lengths {stats.acceptance_lengths} != {want}"
    per_slot = [sum(al - 1 > k for al in want) for k in range(drafter.config.block_size - 1)]
    assert stats.accepted_per_slot == per_slot, f"accepted_per_slot {stats.accepted_per_slot} != {per_slot}"


@pytest.mark.parametrize("max_tokens", [2, 10])  # B = 5: fewer than B − 1, and twice B
@pytest.mark.parametrize("prompt", REPEATING)
def test_greedy_with_a_suffix_lookup_equals_naive_greedy(target, drafter, greedy_reference, prompt, max_tokens):
    """Prompts that repeat themselves, lookup drafts wherever a token occurred before (min_match 1, gate 0), the
    drafter's elsewhere: the output is the target's greedy decoding, and the lookup's drafts were both cut by a
    rejection and accepted whole."""
    expected = greedy_reference[prompt][len(prompt):len(prompt) + MAX_NEW]
    lookup = SuffixLookup(max_tokens=max_tokens, min_match=1, gate=0)
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), MAX_NEW, lookup=lookup)
    assert_greedy_run(out, stats, expected, f"lookup of {max_tokens}, prompt {prompt}")
    assert {"lookup", "drafter"} <= set(stats.sources), f"prompt {prompt}: sources {stats.sources}"
    emitted = 1 + np.cumsum([0] + stats.acceptance_lengths)
    drafts = [min(max_tokens, MAX_NEW - e - 1) for e in emitted]  # each lookup cycle's draft, cut at MAX_NEW
    looked = [(al - 1, n) for al, n, s in zip(stats.acceptance_lengths, drafts, stats.sources) if s == "lookup"]
    assert any(accepted < n for accepted, n in looked) and any(accepted == n > 0 for accepted, n in looked), (
        f"prompt {prompt}: lookup drafts (accepted, drafted) {looked}: a rejection and a whole accept both wanted")


@pytest.mark.parametrize("max_new_tokens", [MAX_NEW, 13])
@pytest.mark.parametrize("max_lookup", [2, 10])  # B = 5: fewer than B − 1, and twice B
def test_greedy_forced_lookup_drafts_accept_exactly_the_right_prefix(monkeypatch, target, drafter, greedy_reference,
                                                                     max_lookup, max_new_tokens):
    """A lookup right for 10 (all), none (the drafter drafts), 0, 6, none, 3 of its tokens, the drafter right for 4
    and 1: the acceptance lengths and sources are those counted by hand (expected_cycles), accepted_per_slot
    counts the drafter's cycles only, and no verify call reads more than the anchor and max_lookup tokens."""
    prompt, B = PROMPTS[1], drafter.config.block_size
    reference = greedy_reference[prompt]
    force_drafts(monkeypatch, drafter, reference, [4, 1])
    lookup = ForcedLookup(reference, [10, None, 0, 6, None, 3], max_lookup, 32)
    calls = record_forward(monkeypatch, target)
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens, lookup=lookup)
    assert_greedy_run(out, stats, reference[len(prompt):len(prompt) + max_new_tokens], f"lookup of {max_lookup}")
    want = expected_cycles([4, 1], B, max_new_tokens, [10, None, 0, 6, None, 3], max_lookup)
    assert list(zip(stats.acceptance_lengths, stats.sources)) == want, (
        f"(acceptance length, source) per cycle {list(zip(stats.acceptance_lengths, stats.sources))} != {want}")
    per_slot = [sum(al - 1 > k for al, source in want if source == "drafter") for k in range(B - 1)]
    assert stats.accepted_per_slot == per_slot, f"accepted_per_slot {stats.accepted_per_slot} != {per_slot}"
    read = [args[0].shape[1] for args, _, _ in calls[1:]]
    assert max(read) == max(B, min(max_lookup, max_new_tokens - 2) + 1), f"verify calls read {read} tokens"


@pytest.mark.parametrize("stop_index", [0, 2, 6])
@pytest.mark.parametrize("forced", [False, True], ids=["random-drafts", "right-drafts"])
def test_greedy_stop_token_is_the_last_token(monkeypatch, target, drafter, greedy_reference, forced, stop_index):
    prompt = PROMPTS[1]
    continuation = greedy_reference[prompt][len(prompt):]
    # the first token at or after stop_index that did not occur before it
    k = next(i for i in range(stop_index, MAX_NEW) if continuation[i] not in continuation[:i])
    if forced:  # B = 5 and every draft right: token k sits inside an accepted block unless k % 4 == 0
        force_drafts(monkeypatch, drafter, greedy_reference[prompt], [4])
    expected = continuation[:k + 1]
    for name, run in (("target_generate", lambda **kw: target_generate(target, **kw)),
                      ("spec_generate", lambda **kw: spec_generate(drafter, target, **kw))):
        out, _ = run(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, stop_token_ids=[continuation[k]])
        assert out.tolist() == expected, f"{name} with stop token {continuation[k]}: {out.tolist()} != {expected}"


def test_acceptance_length_counts_only_committed_tokens(monkeypatch, target, drafter, greedy_reference):
    """Every draft right (B = 5: 5 tokens a cycle) and a stop token inside the second cycle:
    that cycle commits the tokens up to the stop token, not the 5 it verified."""
    prompt = PROMPTS[2]
    continuation = greedy_reference[prompt][len(prompt):]
    # token 0 comes from the prefill, cycle 1 commits tokens 1..5, cycle 2 verifies 6..10
    k = next(i for i in range(7, 10) if continuation[i] not in continuation[:i])  # the first occurrence stops
    force_drafts(monkeypatch, drafter, greedy_reference[prompt], [4])
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), MAX_NEW, stop_token_ids=[continuation[k]])
    assert out.tolist() == continuation[:k + 1], f"{out.tolist()} != {continuation[:k + 1]}"
    assert stats.acceptance_lengths == [5, k - 5], f"acceptance lengths {stats.acceptance_lengths} != [5, {k - 5}]"
    per_slot = [1 + (slot < k - 5) for slot in range(4)]
    assert stats.accepted_per_slot == per_slot, f"accepted_per_slot {stats.accepted_per_slot} != {per_slot}"


@pytest.mark.parametrize("draft_tokens", [1, 2, 4])  # B = 5: one draft, a middle count, all B − 1
@pytest.mark.parametrize("forced", [False, True], ids=["random-drafts", "right-drafts"])
def test_fewer_draft_tokens_verify_only_that_many_and_stay_greedy(monkeypatch, target, drafter, greedy_reference,
                                                                 draft_tokens, forced):
    """draft_tokens = n: every verify call reads the anchor and at most n drafts, the output
    is target_generate's token for token, and no cycle commits more than n + 1 tokens. With
    every draft right each cycle commits exactly n + 1 until the last ones (a block of n + 1)."""
    prompt, B = PROMPTS[2], drafter.config.block_size
    want, _ = target_generate(target, torch.tensor([prompt]), MAX_NEW)
    if forced:
        force_drafts(monkeypatch, drafter, greedy_reference[prompt], [B - 1])
    calls = record_forward(monkeypatch, target)
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), MAX_NEW, draft_tokens=draft_tokens)
    assert_greedy_run(out, stats, want.tolist(), f"draft_tokens {draft_tokens}")
    read = [args[0].shape[1] for args, _, _ in calls[1:]]
    assert max(read) <= draft_tokens + 1, f"draft_tokens {draft_tokens}: verify calls read {read} tokens"
    assert max(stats.acceptance_lengths) <= draft_tokens + 1, \
        f"draft_tokens {draft_tokens}: acceptance lengths {stats.acceptance_lengths} pass n + 1 = {draft_tokens + 1}"
    if forced:
        lengths = expected_acceptance_lengths([B - 1], draft_tokens + 1, MAX_NEW)
        assert stats.acceptance_lengths == lengths, f"draft_tokens {draft_tokens}, every draft right: acceptance " \
            f"lengths {stats.acceptance_lengths} != {lengths}"


@pytest.mark.parametrize("draft_tokens", [0, -1, 5, 2.0, "2"])  # B = 5: an integer in 1..4
def test_a_draft_count_outside_one_to_b_minus_one_is_refused_before_the_target_runs(monkeypatch, target, drafter,
                                                                                     draft_tokens):
    calls = record_forward(monkeypatch, target)
    with pytest.raises(ValueError, match=rf"draft_tokens \({re.escape(repr(draft_tokens))}\) must be an integer "
                                         r"from 1 to block_size − 1 \(block_size = 5\)"):
        spec_generate(drafter, target, torch.tensor([[1, 2]]), 4, draft_tokens=draft_tokens)
    assert not calls, f"draft_tokens {draft_tokens!r}: the target ran {len(calls)} times before the refusal"


def test_drafter_for_another_target_is_refused(target, drafter):
    for what, other in (("num_target_layers", tiny_qwen3(vocab_size=32, num_layers=4)),
                        ("vocab_size", tiny_qwen3(vocab_size=24, num_layers=3)),
                        ("hidden_size", tiny_qwen3(vocab_size=32, hidden_size=48, num_layers=3))):
        with pytest.raises(ValueError, match=f"the drafter has {what} .* but the target has"):
            spec_generate(drafter, other, torch.tensor([[1, 2]]), 4)
    # a target whose lm_head has the drafter's vocabulary but whose embedding table is smaller than mask_token_id
    small = tiny_qwen3(vocab_size=32, num_layers=3)
    small.model.embed_tokens = torch.nn.Embedding(20, 32).double()
    with pytest.raises(ValueError, match="mask_token_id 31 is outside the target's embedding table"):
        spec_generate(drafter, small, torch.tensor([[1, 2]]), 4)


# -----------------------------------------------------------------------------
# the verifier's law, exactly: one cycle enumerated on a 5-token vocabulary


V5, N_DRAFT, ANCHOR = 5, 3, 2


def verifier_case(name):
    """-> (p, q, cands): p(prefix) the target's law of the next token after the cycle's
    emitted prefix; q(j, prev) the walk's law at slot j given the predecessor it picked,
    scattered to the vocabulary; cands[j] the candidate ids of slot j."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn((V5 + 1,) * N_DRAFT + (V5,), generator=g, dtype=torch.float64) * 1.5  # index V5 = no token
    q_logits = torch.randn(N_DRAFT, V5, V5, generator=g, dtype=torch.float64)
    cands = [[0, 1, 3], [1, 2, 4], [0, 2, 3]]
    key = lambda prefix: tuple(prefix) + (V5,) * (N_DRAFT - len(prefix))
    p = lambda prefix: torch.softmax(table[key(prefix)], -1)
    if name == "q=p":  # a Markov target and q equal to it over the whole vocabulary
        cands = [list(range(V5))] * N_DRAFT
        p = lambda prefix: torch.softmax(table[key(prefix[-1:] or [ANCHOR])], -1)
        return p, lambda j, prev: p([prev]), cands
    if name == "disjoint supports":  # p lives on {3, 4}, the candidates on {0, 1, 2}
        cands = [[0, 1, 2]] * N_DRAFT
        p = lambda prefix: torch.softmax(table[key(prefix)].masked_fill(torch.arange(V5) < 3, -math.inf), -1)
    if name == "one-hot p":  # sometimes among the candidates, sometimes not
        p = lambda prefix: torch.nn.functional.one_hot(table[key(prefix)].argmax(), V5).double()

    def q(j, prev):
        out = torch.zeros(V5, dtype=torch.float64)
        out[cands[j]] = torch.softmax(q_logits[j, prev, cands[j]], -1)
        return out
    return p, q, cands


def cycle_law(p, q_walk, q_verify, cands):
    """Exact law of the tokens one cycle emits: every walk path (drawn from q_walk,
    conditional on the drafted predecessor) and every accept/reject branch of verification
    with q_verify, through dflash2's acceptance_probability and residual_distribution; the
    bonus after a full accept comes from p. -> {emitted tuple: probability}."""
    law = {}
    for path in itertools.product(*cands):
        prevs = (ANCHOR,) + path[:-1]
        reach = math.prod(float(q_walk(j, prevs[j])[d]) for j, d in enumerate(path))
        for i, d in enumerate(path):
            if reach == 0:
                break
            p_i, q_i = p(path[:i]), q_verify(i, prevs[i])
            accept = float(acceptance_probability(p_i, q_i, d))
            for b, r in enumerate(residual_distribution(p_i, q_i).tolist()):
                law[path[:i] + (b,)] = law.get(path[:i] + (b,), 0.0) + reach * (1 - accept) * r
            reach *= accept
        for b, r in enumerate(p(path).tolist()):
            law[path + (b,)] = law.get(path + (b,), 0.0) + reach * r
    return law


def first_tokens_law(law, p, m):
    """Law of the first m tokens when the cycle's output is continued by sampling the target."""
    joint = torch.zeros((V5,) * m, dtype=torch.float64)
    for emitted, prob in law.items():
        for tail in itertools.product(range(V5), repeat=m - len(emitted)):
            seq = emitted + tail
            joint[seq] += prob * math.prod(float(p(seq[:t])[seq[t]]) for t in range(len(emitted), m))
    return joint


def target_joint(p, m):
    joint = torch.zeros((V5,) * m, dtype=torch.float64)
    for seq in itertools.product(range(V5), repeat=m):
        joint[seq] = math.prod(float(p(seq[:t])[seq[t]]) for t in range(m))
    return joint


@pytest.mark.parametrize("case", ["conditional q, partial candidates", "q=p", "disjoint supports", "one-hot p"])
def test_verifier_law_is_the_target_joint(case):
    p, q, cands = verifier_case(case)
    law = cycle_law(p, q, q, cands)
    assert abs(sum(law.values()) - 1) < 1e-12, f"{case}: the cycle's outcomes sum to {sum(law.values())}"
    emitted, exact = first_tokens_law(law, p, N_DRAFT + 1), target_joint(p, N_DRAFT + 1)
    err = (emitted - exact).abs().max().item()
    assert err < 1e-12, f"{case}: emitted joint of the first {N_DRAFT + 1} tokens differs from the target's by {err:.3g}"


def test_verifier_law_needs_the_conditional_q():
    """Power of the test above: verifying with q(·|anchor) at every slot, while the walk drew
    each draft conditional on its drafted predecessor, changes the emitted law."""
    p, q, cands = verifier_case("conditional q, partial candidates")
    law = cycle_law(p, q, lambda j, prev: q(j, ANCHOR), cands)
    err = (first_tokens_law(law, p, N_DRAFT + 1) - target_joint(p, N_DRAFT + 1)).abs().max().item()
    assert err > 1e-3, f"a predecessor-blind q moved the emitted joint by only {err:.3g}: the exact-law test has no power"


def test_a_token_the_target_never_emits_is_never_accepted():
    """p[token] = q[token] = 0 made the ratio NaN, and `u >= NaN` is False: the token was kept."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    assert acceptance_probability(p[0], q[0], 0) == 0, "a token of target probability 0 may be accepted"
    assert acceptance_probability(p[0], q[0], 2) == 0.5, "min(1, p/q) changed"
    for seed in range(20):
        n_acc, bonus = verify_sampled(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert n_acc == 0 and p[0, bonus] > 0, f"seed {seed}: accepted {n_acc}, bonus {bonus} (p = {p[0].tolist()})"


def test_verify_sampled_matches_enumerated_branches():
    """verify_sampled itself, seeded, against the branch probabilities written out:
    P(n_acc = k, bonus = b) = Π_{i<k} a_i · (1 - a_k) · r_k(b), or Π_i a_i · p_n(b) after a full accept,
    a_i = min(1, p_i/q_i), r_k = normalize(max(0, p_k - q_k))."""
    p_rows = torch.softmax(torch.randn(N_DRAFT + 1, V5, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    draft, cands = (1, 2, 0), [[0, 1, 3], [1, 2, 4], [0, 2, 3]]
    q_rows = torch.zeros(N_DRAFT, V5, dtype=torch.float64)
    for i, d in enumerate(draft):  # q puts p/0.6 on the draft and splits the rest over the other candidates
        q_rows[i, d] = p_rows[i, d] / 0.6
        q_rows[i, [c for c in cands[i] if c != d]] = (1 - q_rows[i, d]) / 2
    a = [min(1.0, float(p_rows[i, d] / q_rows[i, d])) for i, d in enumerate(draft)]
    branch = np.zeros((N_DRAFT + 1, V5))
    for k in range(N_DRAFT):
        r = (p_rows[k] - q_rows[k]).clamp(min=0)
        branch[k] = math.prod(a[:k]) * (1 - a[k]) * (r / r.sum()).numpy()
    branch[N_DRAFT] = math.prod(a) * p_rows[N_DRAFT].numpy()
    assert branch[:N_DRAFT].sum(1).min() > 0.05, f"every rejection branch should be likely enough to test: {branch.sum(1)}"
    g, counts = torch.Generator().manual_seed(0), np.zeros_like(branch)
    for _ in range(6000):
        n_acc, bonus = verify_sampled(torch.tensor(draft), q_rows, p_rows, g)
        counts[n_acc, bonus] += 1
    pvalue = chi_square_pvalue(counts, branch, "verify_sampled")
    assert pvalue > 1e-6, f"verify_sampled's (n_accepted, bonus) counts depart from the enumerated law: p = {pvalue:.3g}"


@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (1.0, 3), (0.6, 0), (0.8, 5)], ids=["no-filter", "top-k", "top-p",
                                                                                         "both"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.6])
@pytest.mark.parametrize("selector", [True, False], ids=["selector", "no-selector"])
def test_propose_q_is_the_law_of_its_own_samples(target, drafter, selector, temperature, top_p, top_k):
    """propose draws slot j from q_j(·|prev) = softmax(S[j](prev, c)/T) over the top-K
    candidates c, prev being the token it drew at slot j-1 (the anchor at slot 1), and
    returns that q, whatever the request's top-k / top-p; without the selector, from the
    request's law over the vocabulary: softmax(U[j]/T) after top-k / top-p (brute_force_probs).
    At T = 0 it walks the argmax. Reference: S[j](p, c) = U[j, c] + Σ_r A[p, r] P[j, r] Bc[c, r]
    with explicit sums; 20000 walks in one batch, chi-square over the drafted paths."""
    if not selector:
        drafter = tiny_drafter(target, seed=1, block_size=5, target_layer_ids=[0, 1], selector_top_k=0)
    M, n, V, anchor = 20000, drafter.config.block_size - 1, target.config.vocab_size, 7
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, n, target.config.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        unary = target.get_output_embeddings()(h).float()
        path, cand, q = drafter.propose(h.expand(M, -1, -1), unary.expand(M, -1, -1), torch.full((M,), anchor), temperature,
                                        g, top_p=top_p, top_k=top_k)
    U = unary[0].double()
    if selector:
        sel = drafter.candidate_selector
        A, Bc, W = (t.detach().double() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
        P = h[0] @ W.T                                                   # (n, R)
        cands = [sorted(range(V), key=lambda c: -U[j, c])[:drafter.config.selector_top_k] for j in range(n)]
        scores = [[[float(U[j, c]) + sum(float(A[p, r] * P[j, r] * Bc[c, r]) for r in range(P.shape[1])) for c in cands[j]]
                   for p in range(V)] for j in range(n)]
        S = torch.tensor(scores, dtype=torch.float64)                    # (n, V predecessors, K)
    elif temperature == 0:
        cands, S = [list(range(V))] * n, U[:, None, :].expand(n, V, V)  # no predecessor dependence
    else:  # the filtered law, as log-probabilities (-inf outside its support) so that softmax(S/T) returns it
        law = torch.stack([brute_force_probs(U[j].tolist(), temperature, top_p, top_k) for j in range(n)])
        cands, S = [list(range(V))] * n, (temperature * law.log())[:, None, :].expand(n, V, V)
    if selector:
        assert (cand == torch.tensor(cands)).all(), f"candidates {cand[0].tolist()} != top-K {cands}"
    else:
        assert cand is None and q.shape[-1] == V, f"unary drafts: cand {cand}, q over {q.shape[-1]} tokens, not {V}"
    prev = torch.cat([torch.full((M, 1), anchor), path[:, :-1]], 1)
    if temperature == 0:
        want, p = [], anchor
        for j in range(n):
            p = cands[j][int(S[j, p].argmax())]
            want.append(p)
        assert (path == torch.tensor(want)).all(), f"greedy walk {path[0].tolist()} != {want}"
        assert (q[0].argmax(-1) == S[torch.arange(n), prev[0]].argmax(-1)).all() and (q.sum(-1) == 1).all(), "q is not one-hot on the pick"
        return
    table = torch.softmax(S / temperature, -1)                           # q_j(·|p): (n, V, K)
    err = (q.double() - table[torch.arange(n), prev]).abs().max().item()
    assert err < 1e-5, f"returned q differs from softmax(S(sampled predecessor, ·)/T) by {err:.3g}"
    position = torch.full((n, V), -1)                                    # token -> index among slot j's candidates
    for j in range(n):
        position[j, cands[j]] = torch.arange(len(cands[j]))
    idx = position[torch.arange(n), path]
    assert (idx >= 0).all(), "a drafted token is not among its slot's candidates"
    law = table[0, anchor]                                               # law over candidate-index paths
    for j in range(1, n):
        law = law[..., None] * table[j][torch.tensor(cands[j - 1])]
    counts = np.zeros(law.shape)
    np.add.at(counts, tuple(idx.T.numpy()), 1)
    pvalue = chi_square_pvalue(counts, law.numpy(), "drafted paths")
    assert pvalue > 1e-6, f"drafted paths depart from Π_j q_j(·|drafted predecessor): p = {pvalue:.3g}"


def brute_force_probs(logits, temperature, top_p, top_k):
    """One row: softmax(logits/T) over the k largest logits, then the smallest set of the most
    likely tokens whose mass reaches top_p, renormalised."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = order[:top_k] if top_k else order
    z = sum(math.exp(logits[i] / temperature) for i in keep)
    probs = {i: math.exp(logits[i] / temperature) / z for i in keep}
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    out = torch.zeros(len(logits), dtype=torch.float64)
    out[kept] = torch.tensor([probs[i] / mass for i in kept], dtype=torch.float64)
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.01])
@pytest.mark.parametrize("top_k", [0, 1, 3, 10, 50])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_probs_matches_brute_force(temperature, top_k, top_p):
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    got = sampling_probs(logits, temperature, top_p, top_k)
    want = torch.stack([brute_force_probs(row.tolist(), temperature, top_p, top_k) for row in logits])
    err = (got - want).abs().max().item()
    assert err < 1e-12, f"sampling_probs(T={temperature}, top_k={top_k}, top_p={top_p}) differs from brute force by {err:.3g}"


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (1.0, 4)])
def test_top_p_at_an_exact_tie_keeps_the_tokens_whose_mass_before_is_below_it(top_p, kept):
    """ALGORITHM.md §4: a token stays iff the mass before it is < top_p, ties in id order. Four
    equal logits put that mass at exactly 0, 1/4, 1/2, 3/4 (binary fractions, no rounding), so
    top-p 1/2 keeps the first two."""
    p = sampling_probs(torch.zeros(4, dtype=torch.float64), 1.0, top_p=top_p).tolist()
    want = [1 / kept] * kept + [0.0] * (4 - kept)
    assert p == want, f"top-p {top_p} over four equal logits gives {p}, want {want}"


@pytest.mark.parametrize("ties", [17, 40])
def test_top_p_inside_a_tie_of_many_equal_logits_keeps_the_lowest_ids(ties):
    """Sorts of more than 16 elements need not keep equal values in order: top-p that cuts a tie
    of 17 or more equal logits keeps the lowest ids of the tie, as the brute force's stable sort
    does. The tied ids are spread among lower logits; top-p 0.52 cuts the tie about halfway,
    far from any rounding."""
    g = torch.Generator().manual_seed(0)
    logits = torch.rand(2 * ties, generator=g, dtype=torch.float64) - 9  # each about e^-8.5 of a tied one
    logits[torch.randperm(2 * ties, generator=g)[:ties]] = 0.0
    got = sampling_probs(logits, 1.0, top_p=0.52)
    want = brute_force_probs(logits.tolist(), 1.0, 0.52, 0)
    tied = (logits == 0).nonzero()[:, 0].tolist()
    assert 0 < (want > 0).sum() < ties, f"top-p keeps {(want > 0).sum()} tokens: it should cut the tie of {ties}"
    assert (got > 0).nonzero()[:, 0].tolist() == (want > 0).nonzero()[:, 0].tolist(), \
        f"{ties} tied logits at ids {tied}: top-p keeps ids {(got > 0).nonzero()[:, 0].tolist()}, the lowest tied " \
        f"ids are {(want > 0).nonzero()[:, 0].tolist()}"
    assert (got - want).abs().max() < 1e-12, f"differs from brute force by {(got - want).abs().max():.3g}"


# -----------------------------------------------------------------------------
# the whole loop samples the target's law (chi-square over the first 3 tokens)


LOOP_V, LOOP_PROMPT, LOOP_RUNS = 8, (1, 2, 3), 200


@pytest.fixture(scope="module")
def loop_models():
    """V = 8 peaked target; drafter with B = 4 and K = 4 < V candidates, q strongly
    predecessor-conditioned, flat enough unary logits that drafts are often accepted.
    No convolution: it only shapes h, and it would cost a third of the drafter's time."""
    target = tiny_qwen3(vocab_size=LOOP_V, hidden_size=16, num_layers=2, seed=2, lm_head_scale=20.0)
    drafter = tiny_drafter(target, seed=3, block_size=4, selector_top_k=4, conv_kernel_size=0)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    return target, drafter


def without_selector(drafter):
    """The same weights with the selector off: a DFlash (v1) drafter proposing from its unary law."""
    unary = DFlash2Drafter(dataclasses.replace(drafter.config, selector_top_k=0)).to(drafter.fc.weight.dtype)
    unary.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("candidate_selector.")})
    return unary


def sampled_runs(target, drafter, temperature, top_p, top_k, draft_tokens=None):
    """LOOP_RUNS runs of 4 new tokens after LOOP_PROMPT, one generator -> (counts (V, V, V) of
    the first 3 tokens, each run's acceptance lengths)."""
    g, counts, lengths = torch.Generator().manual_seed(0), np.zeros((LOOP_V,) * 3), []
    for _ in range(LOOP_RUNS):
        out, stats = spec_generate(drafter, target, torch.tensor([LOOP_PROMPT]), 4, temperature, top_p, top_k,
                                   generator=g, draft_tokens=draft_tokens)
        counts[tuple(out[:3].tolist())] += 1
        lengths.append(stats.acceptance_lengths)
    return counts, lengths


@pytest.mark.parametrize("temperature, top_p, top_k, q_kind", [
    (0.7, 1.0, 0, "walk"), (1.0, 1.0, 0, "walk"), (1.6, 1.0, 0, "walk"), (1.0, 0.9, 5, "walk"),
    (1.0, 1.0, 3, "unary"), (1.0, 0.8, 0, "unary"), (1.3, 0.9, 4, "unary"),
    (1.0, 1.0, 0, "unary top-K"), (2.0, 1.0, 3, "unfiltered unary q")])
def test_spec_generate_samples_the_target_law(monkeypatch, loop_models, temperature, top_p, top_k, q_kind):
    """max_new_tokens = 4 with B = 4: the first cycle drafts 2 slots, so the 2nd and 3rd
    tokens come from slot-1 and slot-2 drafts (slot 2 conditional on the drafted slot 1),
    residuals, bonuses or a following cycle. "walk": a DFlash2 drafter; "unary": the same
    drafter with its selector off (a DFlash drafter), whose drafts follow the request's
    filtered law. Two wrong q's must be rejected by the same test: "unary top-K" verifies
    with the unary softmax over the candidates instead of the walk's q (the path still comes
    from the walk); "unfiltered unary q" samples the filtered unary law but verifies with
    the unfiltered softmax(U/T)."""
    target, drafter = loop_models
    if q_kind in ("unary", "unfiltered unary q"):
        drafter = without_selector(drafter)
    if q_kind == "unfiltered unary q":
        replace_q(monkeypatch, drafter, lambda unary, cand, T: torch.softmax(unary / T, -1))
    if q_kind == "unary top-K":
        replace_q(monkeypatch, drafter, lambda unary, cand, T: torch.softmax(unary.gather(-1, cand) / T, -1))
    counts, lengths = sampled_runs(target, drafter, temperature, top_p, top_k)
    al = np.bincount([run[0] for run in lengths], minlength=4)[1:]
    assert al[0] and al[1] and al[2], f"first-cycle acceptance lengths 1/2/3 seen {al.tolist()} times: some branch is never exercised"
    pvalue = chi_square_pvalue(counts, exact_joint3(target, LOOP_PROMPT, temperature, top_p, top_k).numpy(), q_kind)
    print(f"T={temperature} top_p={top_p} top_k={top_k} q={q_kind}: chi-square p = {pvalue:.3g}")
    if q_kind in ("walk", "unary"):
        assert pvalue > 1e-6, f"joint of the first 3 tokens departs from the target's exact joint: p = {pvalue:.3g}"
    else:
        assert pvalue < 1e-6, f"verifying with the wrong q ({q_kind}) went undetected: p = {pvalue:.3g}"


def test_one_draft_token_samples_the_target_law(loop_models):
    """draft_tokens = 1 (B = 4), the DFlash2 walk: each cycle verifies only slot 1's draft, so the
    2nd and 3rd tokens come from a slot-1 draft, a residual or a bonus, over two cycles; the
    joint of the first 3 tokens is still the target's (chi-square), and no cycle commits more
    than 2. (The tests above already verify n = 2 < B − 1 drafts in their first cycle.)"""
    target, drafter = loop_models
    counts, lengths = sampled_runs(target, drafter, 1.0, 0.9, 5, draft_tokens=1)
    seen = sorted({al for run in lengths for al in run})
    assert seen == [1, 2], f"acceptance lengths seen {seen}, want 1 (rejected) and 2 (accepted), nothing above 2"
    pvalue = chi_square_pvalue(counts, exact_joint3(target, LOOP_PROMPT, 1.0, 0.9, 5).numpy(), "draft_tokens 1")
    assert pvalue > 1e-6, f"draft_tokens 1: joint of the first 3 tokens departs from the target's exact joint: " \
        f"p = {pvalue:.3g}"


@pytest.mark.parametrize("q_kind", ["point mass", "uniform q"])
def test_lookup_drafts_sample_the_target_law(monkeypatch, loop_models, q_kind):
    """Each run's first cycle verifies a lookup's 2 tokens, the target's greedy continuation of LOOP_PROMPT (the
    target is peaked: often kept, sometimes not), its next the drafter's, then the lookup's again. With q a point
    mass on each looked-up token the joint of the first 3 tokens is the target's (chi-square, LOOP_RUNS / 2 runs);
    the same test must reject a lookup draft verified as if drawn uniformly over the vocabulary."""
    target, drafter = loop_models
    if q_kind == "uniform q":
        point_mass = dflash2.q_over_vocab  # K = 1 only for a lookup's draft (the walk's K is 4)
        monkeypatch.setattr(dflash2, "q_over_vocab", lambda cand, q, V: torch.full(
            (*cand.shape[:-1], V), 1 / V, dtype=torch.float64) if cand.shape[-1] == 1 else point_mass(cand, q, V))
    reference = list(LOOP_PROMPT) + argmax_loop(target, LOOP_PROMPT, 8)[0]
    g, counts, first, sources = torch.Generator().manual_seed(0), np.zeros((LOOP_V,) * 3), [], set()
    for _ in range(LOOP_RUNS // 2):
        out, stats = spec_generate(drafter, target, torch.tensor([LOOP_PROMPT]), 4, 1.0, generator=g,
                                   lookup=ForcedLookup(reference, [3, None], 3, LOOP_V))
        counts[tuple(out[:3].tolist())] += 1
        first.append(stats.acceptance_lengths[0])
        sources.update(stats.sources[1:])
    assert stats.sources[0] == "lookup" and "drafter" in sources, f"later cycles' sources {sources}: no drafter"
    pvalue = chi_square_pvalue(counts, exact_joint3(target, LOOP_PROMPT, 1.0, 1.0, 0).numpy(), q_kind)
    if q_kind == "point mass":
        seen = np.bincount(first, minlength=4)[1:]
        assert seen.all(), f"first-cycle acceptance lengths 1/2/3 seen {seen.tolist()} times: a branch is never exercised"
        assert pvalue > 1e-6, f"with lookup drafts the first 3 tokens depart from the target's exact joint: p = {pvalue:.3g}"
    else:
        assert pvalue < 1e-6, f"lookup drafts verified with a uniform q went undetected: p = {pvalue:.3g}"


# -----------------------------------------------------------------------------
# cache rollback: the cropped target cache and the context-only draft cache equal fresh ones


@pytest.mark.parametrize("looked", [False, True], ids=["drafter", "lookup"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_fresh_prefill(monkeypatch, target, drafter, greedy_reference, temperature, looked):
    """At T = 0 the drafts are right for 4, 0, 2, 1, 3, ... slots (every crop size, and no
    crop); at T = 1 the random drafter is mostly rejected. With a lookup, some cycles verify
    10 tokens (twice B) instead, right for 7, 0 (in a row), then 10 of them, and the drafter
    reads their features at its next pass. Every target call's logits must equal a fresh, cache-free
    forward over the committed tokens plus that call's input, and every draft pass's hidden
    states a pass with a fresh DraftCache filled with all committed context at once.
    Compared at 1e-12, not bitwise: a fresh prefill multiplies matrices of other shapes, and
    BLAS does not promise the same rounding across shapes."""
    prompt = PROMPTS[1]
    if temperature == 0:
        draft_calls = force_drafts(monkeypatch, drafter, greedy_reference[prompt], [4, 0, 2, 1, 3])
    else:
        draft_calls = record_forward(monkeypatch, drafter)
    lookup = ForcedLookup(greedy_reference[prompt], [7, 0, None, None, 10], 10, 32) if looked else None
    target_calls = record_forward(monkeypatch, target)
    out, stats = spec_generate(drafter, target, torch.tensor([prompt]), MAX_NEW, temperature,
                               generator=torch.Generator().manual_seed(0), lookup=lookup)
    monkeypatch.undo()
    full, P = list(prompt) + out.tolist(), len(prompt)
    committed = P + np.cumsum([0] + stats.acceptance_lengths)  # target cache length before each verify call
    drafted = [i for i, source in enumerate(stats.sources) if source == "drafter"]  # the cycles with a draft pass
    assert len(target_calls) == 1 + len(stats.acceptance_lengths) and len(draft_calls) == len(drafted), (
        f"{len(target_calls)} target calls, {len(draft_calls)} draft passes, {len(stats.acceptance_lengths)} cycles, "
        f"{len(drafted)} of them the drafter's")
    assert looked == ("lookup" in stats.sources), f"sources {stats.sources}"
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for i, ((ids,), _, res) in enumerate(target_calls[1:]):
            L0, ids = int(committed[i]), ids[0].tolist()
            assert ids[0] == full[L0], f"cycle {i}: anchor {ids[0]} != committed token {full[L0]} at position {L0}"
            fresh = target(torch.tensor([full[:L0] + ids])).logits[0, L0:]
            err = (res.logits[0] - fresh).abs().max().item()
            assert err < 1e-12, f"cycle {i}: target logits with the rolled-back cache differ from a fresh prefill by {err:.3g}"
        for j, i in enumerate(drafted):
            L0 = int(committed[i])
            (block_embeds, block_pos, _, ctx_pos), _, h = draft_calls[j]
            block = torch.tensor([[full[L0]] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)])
            assert torch.equal(block_embeds, embed(block)), f"cycle {i}: draft block is not [anchor, MASK, ...]"
            assert torch.equal(block_pos[0], torch.arange(L0, L0 + drafter.config.block_size)), (
                f"cycle {i}: block positions {block_pos[0].tolist()}, anchor at {L0}")
            assert ctx_pos[0].tolist() == list(range(int(committed[drafted[j - 1]]) if j else 0, L0)), (
                f"cycle {i}: new context positions {ctx_pos[0].tolist()}")
            hs = target(torch.tensor([full[:L0]]), output_hidden_states=True).hidden_states
            ctx = context_features(hs, drafter.config.target_layer_ids)
            fresh = drafter(block_embeds, block_pos, ctx, torch.arange(L0)[None], cache=DraftCache(drafter.config.num_layers))
            err = (h - fresh).abs().max().item()
            assert err < 1e-12, f"cycle {i}: draft hidden states with the incremental DraftCache differ from a fresh one by {err:.3g}"


# -----------------------------------------------------------------------------
# argument checks and reproducibility


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.tensor([[1, 2], [3, 4]])), "batch 1"),
    (dict(input_ids=torch.tensor([1, 2])), "batch 1"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "batch 1"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k")])
@pytest.mark.parametrize("generate", ["target_generate", "spec_generate"])
def test_bad_generation_arguments_are_refused(target, drafter, generate, kwargs, match):
    args = {"input_ids": torch.tensor([[1, 2]]), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        if generate == "target_generate":
            target_generate(target, **args)
        else:
            spec_generate(drafter, target, **args)


@pytest.mark.parametrize("generate", ["target_generate", "spec_generate"])
def test_generator_reproduces_sampling_without_the_global_rng(target, drafter, generate):
    run = {"target_generate": lambda g: target_generate(target, torch.tensor([[5, 9]]), 12, 1.0, 0.9, 10, generator=g),
           "spec_generate": lambda g: spec_generate(drafter, target, torch.tensor([[5, 9]]), 12, 1.0, 0.9, 10, generator=g)}[generate]
    outs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        outs.append(run(torch.Generator().manual_seed(123)))
        assert torch.equal(torch.get_rng_state(), state), f"{generate} with a generator advanced the global RNG"
    (a, sa), (b, sb) = outs
    assert a.tolist() == b.tolist() and sa.acceptance_lengths == sb.acceptance_lengths, (
        f"{generate}, same generator seed, different global seeds: {a.tolist()} vs {b.tolist()}")
    others = {tuple(run(torch.Generator().manual_seed(s))[0].tolist()) for s in range(4)}
    assert len(others) > 1, f"{generate}: four generator seeds gave the same sample {others}: is the generator used?"
