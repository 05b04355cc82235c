"""Shared builders and fixtures of the tests, test_dflash2.py's and those in tests/: tiny random
Qwen3 targets built from a transformers config (nothing downloaded), random DFlash2 drafters for
them, the single-thread fixture that tiny models need on a busy CPU, the chi-square test of a
sampler's law, and the plain greedy loop that generation and regeneration are checked against."""
import itertools

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash2 import DFlash2Drafter, sampling_probs
from harness.target import drafter_config, rope_tables


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are all per-op overhead: on a busy 2-core machine a second intra-op thread
    makes each op wait for a core (measured: 18 ms instead of 30 us per matmul). A module
    opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_qwen3(vocab_size, hidden_size=32, num_layers=2, head_dim=8, seed=0, dtype=torch.float64,
               lm_head_scale=1.0, **config):
    """A random Qwen3ForCausalLM, frozen and in eval mode: hidden_size // head_dim query heads,
    half as many KV heads, MLP width 2 * hidden_size, an lm_head of its own. `config` sets any
    other Qwen3Config field or overrides these (tie_word_embeddings, pad_token_id,
    initializer_range, ...). lm_head_scale > 1 sharpens the next-token distributions.
    float64 by default, so that cached, batched and plain forwards agree far below any
    tolerance a test sets."""
    torch.manual_seed(seed)
    heads = hidden_size // head_dim
    shape = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                 num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                 head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(Qwen3Config(**{**shape, **config})).to(dtype).eval().requires_grad_(False)
    model.lm_head.weight.mul_(lm_head_scale)
    return model


def tiny_drafter(target, seed=1, dtype=torch.float64, **overrides):
    """A random drafter for `target` (1 layer, mask token V - 1 unless overridden) whose DFlash2
    parts are off their identity init: the selector's codebooks and projection are random (so
    q depends on the predecessor) and the convolution has nonzero off-centre taps and dynamic
    kernels. A rope_scaling override takes its tables from harness.target.rope_tables."""
    torch.manual_seed(seed)
    shape = dict(mask_token_id=target.config.vocab_size - 1, num_layers=1, conv_group_size=8, selector_rank=4)
    c = drafter_config(target.config, **{**shape, **overrides})
    drafter = DFlash2Drafter(c, rope=rope_tables(c))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("candidate_selector."):
                p.normal_(0, 1.5)
            elif "_conv." in name:
                p.add_(0.3 * torch.randn_like(p))
    return drafter.to(dtype).eval()


def chi_square_pvalue(counts, probs, what):
    """Pearson chi-square of counts against probs, both indexed by outcome tuples
    (..., last coordinate). Cells expecting fewer than 5 samples are pooled per prefix
    (the last coordinate summed out), repeatedly; what is left at the top is one bin."""
    n = counts.sum()
    impossible = counts[probs <= 0].sum()
    assert impossible == 0, f"{what}: {impossible} samples fell on outcomes of probability 0"
    obs, exp, c, e = [], [], counts.astype(float), probs * n
    while c.ndim:
        big = e >= 5
        obs, exp = obs + c[big].tolist(), exp + e[big].tolist()
        c, e = np.where(big, 0, c).sum(-1), np.where(big, 0, e).sum(-1)
    if e > 0:
        obs, exp = obs + [c], exp + [e]
    assert len(obs) >= 2, f"{what}: {n} samples fill fewer than 2 bins"
    obs, exp = np.array(obs, dtype=float), np.array(exp) * n / sum(exp)
    stat = ((obs - exp) ** 2 / exp).sum()
    # the chi-square tail with len(obs) - 1 degrees of freedom: Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def replace_q(monkeypatch, drafter, q_of):
    """A wrong-q mutant: drafter.propose keeps its drafts but returns q_of(unary, cand, T) as
    the law they were drawn from, so verification uses that q instead."""
    propose = drafter.propose

    def mutant(h, unary, anchor, temperature=0.0, generator=None, **filters):
        path, cand, _ = propose(h, unary, anchor, temperature, generator, **filters)
        return path, cand, q_of(unary, cand, temperature)
    monkeypatch.setattr(drafter, "propose", mutant)


def argmax_loop(model, ids, max_new_tokens, stop_ids=()):
    """The target's plain greedy continuation of token ids: the argmax of a full forward of the
    whole sequence so far (no cache, no batch, no padding), max_new_tokens times or until one of
    stop_ids, which is left out. -> (new ids, stopped at a stop id)."""
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            tok = int(model(torch.tensor([list(ids) + new])).logits[0, -1].argmax())
        if tok in stop_ids:
            return new, True
        new.append(tok)
    return new, False


def plain_greedy(model, tokenizer, messages, max_new_tokens, stop_ids=(), tools=None):
    """The target's greedy answer to a chat (rendered with `tools`): argmax_loop on the unpadded
    prompt until the tokenizer's eos or one of `stop_ids`. -> (text, stopped at a stop token)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, tools=tools,
                                        return_dict=True)["input_ids"]
    new, stopped = argmax_loop(model, ids, max_new_tokens, {tokenizer.eos_token_id, *stop_ids})
    return tokenizer.decode(new), stopped


def record_forward(monkeypatch, module):
    """Wrap module.forward; returns the list of (args, kwargs, output) of its calls."""
    calls, forward = [], module.forward

    def recorded(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(module, "forward", recorded)
    return calls


def force_drafts(monkeypatch, drafter, reference, n_right):
    """Make spec_generate's drafter propose reference's tokens (the whole greedy sequence,
    prompt included) for the first n_right[c % len(n_right)] slots of cycle c and wrong
    tokens after that. The anchor's absolute position is read off the block positions the
    drafter was called with. Returns the drafter's recorded forward calls."""
    calls, propose = record_forward(monkeypatch, drafter), drafter.propose
    B, V = drafter.config.block_size, drafter.config.vocab_size

    def forced(h, unary, anchor, temperature=0.0, generator=None, **filters):
        path, cand, q = propose(h, unary, anchor, temperature, generator, **filters)
        a, j = int(calls[-1][0][1][0, 0]), n_right[(len(calls) - 1) % len(n_right)]
        assert int(anchor) == reference[a], f"anchor {int(anchor)} at position {a}, the greedy sequence has {reference[a]}"
        right = torch.tensor(reference[a + 1:a + B])
        return torch.cat([right[:j], (right[j:] + 1) % V])[None], cand, q

    monkeypatch.setattr(drafter, "propose", forced)
    return calls


@torch.no_grad()
def exact_joint3(target, prompt, temperature, top_p, top_k):
    """p(x1) p(x2|x1) p(x3|x1,x2) after the prompt, (V, V, V), from one batched forward."""
    V = target.config.get_text_config().vocab_size
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
    logits = target(torch.cat([torch.tensor([prompt]).expand(len(pairs), -1), pairs], 1)).logits[:, -3:]
    p = sampling_probs(logits, temperature, top_p, top_k)                           # (V^2, 3, V)
    x1, x2 = pairs[:, 0], pairs[:, 1]
    rows = torch.arange(len(pairs))
    return ((p[rows, 0, x1] * p[rows, 1, x2])[:, None] * p[:, 2]).view(V, V, V)
