"""Tests of harness.lookup: the suffix lookup's proposals against a brute-force search over every earlier occurrence,
its fallback guess against an enumeration of what followed the last token, its gate's choice read from its log and
from GenerationStats.sources, and its refusals. That decoding with its drafts stays lossless is tested in
test_generate.py (greedy, chi-square, the caches) and test_families.py (hybrid and sliding-window targets)."""
import random
from fractions import Fraction

import pytest
import torch

from conftest import argmax_loop, force_drafts, tiny_qwen3
from dflash2 import GenerationStats, spec_generate
from harness.lookup import SuffixLookup, by_source
from tests.conftest import tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_force_proposal(x, min_match, max_match, max_tokens):
    """Every suffix length from the longest down, its earlier occurrences found by comparing every slice that ends
    before len(x); then max_tokens steps, each enumerating the next token of every occurrence that agrees with the
    draft so far, read from y = x + the draft. -> (draft, score as an exact fraction)."""
    L = len(x)
    for m in range(min(max_match, L - 1), min_match - 1, -1):
        ends = [e for e in range(m, L) if x[e - m:e] == x[L - m:]]
        if ends:
            break
    else:
        return [], Fraction(0)
    y, agree, reach, score = list(x), ends, Fraction(1), Fraction(1)
    for t in range(max_tokens):
        nexts = [y[e + t] for e in agree]
        best = max(nexts.count(token) for token in nexts)
        token = [token for token in nexts if nexts.count(token) == best][-1]  # ties: the latest occurrence's
        reach *= Fraction(best + 1, len(nexts) + 2)  # the rule of succession
        score += reach
        agree = [e for e in agree if y[e + t] == token]
        y.append(token)
    return y[L:], score


def repeating_sequence(seed, length, vocab_size):
    """Random tokens, and copies of earlier stretches of 1 to 8 tokens 40% of the time."""
    rng, x = random.Random(seed), []
    while len(x) < length:
        if x and rng.random() < 0.4:
            start = rng.randrange(len(x))
            x += x[start:start + rng.randint(1, 8)]
        else:
            x.append(rng.randrange(vocab_size))
    return x[:length]


@pytest.mark.parametrize("min_match, max_match, max_tokens", [(1, 1, 3), (1, 16, 6), (2, 4, 5), (3, 3, 2)])
def test_proposals_equal_a_brute_force_search(min_match, max_match, max_tokens):
    """One lookup reads each of two sequences token by token (its index grows), then the first again (it starts
    over); every call's draft and score equal the brute force's."""
    lookup, seen = SuffixLookup(max_tokens=max_tokens, min_match=min_match, max_match=max_match), []
    for seed in range(3):
        a, b = repeating_sequence(2 * seed, 60, 3 + seed), repeating_sequence(2 * seed + 1, 60, 3 + seed)
        for x in a, b, a:
            for L in range(1, len(x) + 1):
                draft, score = lookup.propose(x[:L])
                want, want_score = brute_force_proposal(x[:L], min_match, max_match, max_tokens)
                assert draft == want and abs(score - float(want_score)) < 1e-12, (
                    f"tokens {x[:L]}: proposed {draft} (score {score}), brute force {want} (score {want_score})")
                seen.append(want_score)
    found = [s for s in seen if s > 0]
    assert len(found) > len(seen) / 2 and any(s.denominator > 1 for s in found), (
        f"{len(found)} of {len(seen)} calls found a match, scores {sorted(set(found))[:5]}...: the occurrences' "
        "counts are never exercised")


def brute_force_guess(x):
    """fallback's guess by enumeration: for every token of the vocabulary, the earlier positions i < len(x) − 1
    holding the last token and followed by it; the token with the most (ties: the one whose latest such i is
    latest), score 1 + (its count + 1) / (all of them + 2); none anywhere: the last token, score 1."""
    after = {t: [i for i in range(len(x) - 1) if x[i] == x[-1] and x[i + 1] == t] for t in set(x)}
    total = sum(map(len, after.values()))
    if not total:
        return [x[-1]], Fraction(1)
    token = max((t for t in after if after[t]), key=lambda t: (len(after[t]), max(after[t])))
    return [token], 1 + Fraction(len(after[token]) + 1, total + 2)


@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_the_fallback_guesses_what_most_often_followed_the_last_token_where_no_suffix_matched(min_match):
    """fallback=True: where the brute-force search finds a suffix, the draft and score are its; where it finds none,
    one token, brute_force_guess's, and its score. Both the guess from earlier followers and the last token itself
    are exercised (the first needs min_match > 1: with 1, no match means the last token is new)."""
    lookup, kinds = SuffixLookup(max_tokens=4, min_match=min_match, max_match=6, fallback=True), set()
    for seed in range(3):
        x = repeating_sequence(seed, 60, 4 + seed)
        for L in range(1, len(x) + 1):
            draft, score = lookup.propose(x[:L])
            want, want_score = brute_force_proposal(x[:L], min_match, 6, 4)
            if not want:
                want, want_score = brute_force_guess(x[:L])
                kinds.add("followed" if want_score > 1 else "last token")
            assert draft == want and abs(score - float(want_score)) < 1e-12, (
                f"tokens {x[:L]}: proposed {draft} (score {score}), want {want} (score {want_score})")
    want_kinds = {"last token"} | ({"followed"} if min_match > 1 else set())
    assert kinds == want_kinds, f"min_match {min_match}: fallback cases seen {kinds}, want {want_kinds}"


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), r"max_tokens \(0\) must be an integer >= 1"),
    (dict(min_match=0), r"min_match \(0\) and max_match \(16\) must be integers with 1 <= min_match <= max_match"),
    (dict(min_match=4, max_match=3), r"min_match \(4\) and max_match \(3\)"),
    (dict(gate=-1), r"gate \(-1\) must be a number >= 0 or 'drafter'"),
    (dict(gate="always"), r"gate \('always'\) must be a number >= 0 or 'drafter'")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuffixLookup(**kwargs)


def test_by_source_counts_cycles_and_tokens():
    stats = GenerationStats(acceptance_lengths=[3, 1, 5, 2], sources=["drafter", "lookup", "lookup", "drafter"])
    assert by_source(stats) == {"drafter": (2, 5), "lookup": (2, 6)}, f"by_source {by_source(stats)}"


# -----------------------------------------------------------------------------
# the gate, in spec_generate on a tiny target whose greedy continuations repeat themselves


PROMPT, MAX_NEW = (11, 30, 2, 2, 8, 19, 11, 30, 2), 20


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen3(vocab_size=32, num_layers=3)
    return target, tiny_drafter(target, seed=1, block_size=5, target_layer_ids=[0, 1], selector_top_k=6)


def asked(stats):
    """Per cycle: whether the lookup was asked (a token was left to draft)."""
    emitted, out = 1, []  # the first token comes from the prefill
    for length in stats.acceptance_lengths:
        out.append(MAX_NEW - emitted - 1 > 0)
        emitted += length
    return out


@pytest.mark.parametrize("gate", [0, 1e9])
def test_a_fixed_gate_takes_every_proposal_or_none(models, gate):
    """Gate 0: every call with a proposal drafts (its score is at least 1), every other cycle is the drafter's; a
    gate above every score: the drafter drafts every cycle, though the lookup had proposals."""
    target, drafter = models
    lookup = SuffixLookup(max_tokens=10, min_match=1, gate=gate)
    out, stats = spec_generate(drafter, target, torch.tensor([PROMPT]), MAX_NEW, lookup=lookup)
    calls = asked(stats)
    assert len(lookup.log) == sum(calls), f"{len(lookup.log)} calls logged, {sum(calls)} cycles asked"
    scores, thresholds, taken = zip(*lookup.log)
    assert set(thresholds) == {gate} and any(s > 0 for s in scores) and not all(s > 0 for s in scores), (
        f"log {lookup.log}: a proposal and a call without one both wanted")
    assert list(taken) == [gate == 0 and s > 0 for s in scores], f"gate {gate}: log {lookup.log}"
    looked = [source == "lookup" for source, a in zip(stats.sources, calls) if a]
    assert looked == list(taken) and stats.sources.count("lookup") == sum(taken), (
        f"gate {gate}: sources {stats.sources}, taken {taken}")


def test_the_drafter_gate_tracks_the_drafters_mean_acceptance_length(monkeypatch, models):
    """gate "drafter", the drafter right for 3, 4, 0 slots: each call's threshold is the mean acceptance length
    of the drafter's cycles before it (1 before its first), and a proposal is taken iff its score passes it."""
    target, drafter = models
    reference = list(PROMPT) + argmax_loop(target, PROMPT, MAX_NEW + 5)[0]
    force_drafts(monkeypatch, drafter, reference, [3, 4, 0])
    lookup = SuffixLookup(max_tokens=3, min_match=1)
    out, stats = spec_generate(drafter, target, torch.tensor([PROMPT]), MAX_NEW, lookup=lookup)
    greedy = reference[len(PROMPT):len(PROMPT) + MAX_NEW]
    assert out.tolist() == greedy, f"{out.tolist()} != greedy {greedy}"
    want = []
    for i, a in enumerate(asked(stats)):
        drafted = [al for al, s in zip(stats.acceptance_lengths[:i], stats.sources) if s == "drafter"]
        want += [sum(drafted) / len(drafted) if drafted else 1.0] if a else []
    scores, thresholds, taken = zip(*lookup.log)
    assert list(thresholds) == want, f"thresholds {thresholds} != the drafter's running mean {want}"
    assert list(taken) == [s > t for s, t in zip(scores, thresholds)], f"log {lookup.log}"
    proposed = [took for score, _, took in lookup.log if score > 0]
    assert any(proposed) and not all(proposed), f"log {lookup.log}: a proposal taken and one left wanted"
