"""Shared builders and fixtures of the tests, test_dflash2.py's and those in tests/, from dflash2.py,
torch and transformers alone (the second tier's builders: tests/conftest.py): tiny random Qwen3 targets
built from a transformers config (nothing downloaded), the single-thread fixture that tiny models need
on a busy CPU, the chi-square test of a sampler's law, the plain greedy loop that generation and
regeneration are checked against, and test_dflash2.py's target, drafter, batch and loop references,
which tests/test_metrics.py reads too."""
import itertools
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash2 import Batch, CandidateSelector, DFlash2Config, DFlash2Drafter, LocalConv, context_features, sampling_probs


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


class ForcedLookup:
    """A lookup draft source for spec_generate's lookup=: its c-th call proposes the max_tokens tokens of reference
    (the whole greedy sequence, prompt included) after the anchor's position len(tokens) − 1, right for the first
    n_right[c % len(n_right)] of them and wrong after; None: it proposes nothing and the drafter drafts."""
    def __init__(self, reference, n_right, max_tokens, vocab_size):
        self.reference, self.n_right, self.max_tokens, self.vocab_size = reference, n_right, max_tokens, vocab_size
        self.calls = 0

    def __call__(self, tokens, stats):
        j, self.calls = self.n_right[self.calls % len(self.n_right)], self.calls + 1
        right = self.reference[len(tokens):len(tokens) + self.max_tokens]
        return [] if j is None else right[:j] + [(t + 1) % self.vocab_size for t in right[j:]]


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


# -----------------------------------------------------------------------------
# test_dflash2.py's world (tests/test_metrics.py's too): a target, a drafter of it, a batch, loop references

V, H, B = 96, 32, 4      # target vocab, target width, drafter block size
MASK_ID = V - 1           # never drawn as a data token
S = 20                    # sequence length of the test batch
LAYER_IDS = [0, 2]        # two context features out of the target's four layers
WIDE_K = 32               # a top-K that holds about a third of the labels of a random drafter,
                          # so the selector loss sees slots in and out of its candidates
SERVED = (0.7, 0.6, 14)   # soft_labels_at: top-k keeps 14 of the V tokens, then top-p 8 or 9 of them
# anchors of the test batch: row 0 has a block at 0 (empty context), a block whose slot 1
# is outside loss_mask (9) and one running past the end (18); row 1 is right-padded from
# 14 on, its block at 12 runs into the padding and its last two anchors are padding
ANCHORS = torch.tensor([[0, 5, 8, 14, 18], [3, 7, 12, 0, 0]])
VALID = torch.tensor([[True] * 5, [True, True, True, False, False]])


def make_target(lm_head_scale=1.0, dtype=torch.float64):
    """A random Qwen3 target (V tokens, width H, four layers of 4 query and 2 key-value heads of 8), frozen, in
    float64 unless asked otherwise."""
    return tiny_qwen3(V, H, num_layers=4, max_position_embeddings=256, lm_head_scale=lm_head_scale, dtype=dtype)


def make_config(**overrides):
    """A small drafter of make_target()'s target: its shape as target.drafter_config reads it (tests/test_target.py),
    two layers, blocks of B, a convolution and a selector."""
    shape = dict(hidden_size=H, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=V,
                 num_target_layers=4, rope_theta=1e4, max_position_embeddings=256)
    small = dict(mask_token_id=MASK_ID, num_layers=2, block_size=B, target_layer_ids=LAYER_IDS,
                 conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)
    return DFlash2Config(**{**shape, **small, **overrides})


def make_drafter(seed=0, randomize=False, **overrides):
    """randomize: move the convolution and the selector off their identity init, so that
    leaks across blocks or predecessors cannot hide behind zero weights."""
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(make_config(**overrides)).double()
    if randomize:
        with torch.no_grad():
            for m in drafter.modules():
                if isinstance(m, LocalConv):
                    m.base_kernel.normal_(0, 0.5)
                    m.kernel_projection.weight.normal_(0, 0.3)
                elif isinstance(m, CandidateSelector) and m.factored:  # E rows are ~0.02: W_A·E[p] ~ 1
                    m.hidden_projection.weight.normal_(0, 0.3)
                    m.predecessor_projection.weight.normal_(0, 8.0)
                    m.successor_projection.weight.normal_(0, 8.0)
                elif isinstance(m, CandidateSelector):
                    m.hidden_projection.weight.normal_(0, 0.3)
                    m.predecessor_codebook.normal_(0, 1.0)
                    m.successor_codebook.normal_(0, 1.0)
    return drafter


def make_batch(target, seed=0):
    """Two rows of S tokens; row 1 right-padded from 14; loss_mask 0 on a 3-token prompt,
    on padding and at position 9."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V - 1, (2, S), generator=g)
    attention_mask = torch.ones(2, S, dtype=torch.long)
    attention_mask[1, 14:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    loss_mask[0, 9] = 0
    with torch.no_grad():
        out = target(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                hidden_states=out.hidden_states)


def loss_batch(batch, anchors=ANCHORS, anchor_valid=VALID):
    """The loss's Batch of a test batch: ids and masks, the context features f and the last hidden state g."""
    hs = batch["hidden_states"]
    return Batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], context_features(hs, LAYER_IDS),
                 hs[-1], anchors, anchor_valid)


def with_last_hidden(batch, G):
    """The batch with G (b, S, H) as the target's final hidden state: target logits lm_head(G)."""
    return {**batch, "hidden_states": (*batch["hidden_states"][:-1], G)}


def ref_codebook_row(sel, side, v, W_in=None):
    """Row v of A (side "predecessor") or Bc ("successor"): the table's row, or with factored
    codebooks Σ_h W[r, h] · W_in[v, h], summed in a loop."""
    if not sel.factored:
        return getattr(sel, f"{side}_codebook")[v].tolist()
    W, E = getattr(sel, f"{side}_projection").weight.tolist(), W_in[v].tolist()
    return [sum(W[r][i] * E[i] for i in range(len(E))) for r in range(len(W))]


def ref_edge_score(sel, h, unary, p, c, W_in=None):
    """S(p, c) = U[c] + Σ_r A[p, r] · P[r] · Bc[c, r] with P = W h, for one slot."""
    P = (sel.hidden_projection.weight @ h).tolist()
    A, Bc = ref_codebook_row(sel, "predecessor", p, W_in), ref_codebook_row(sel, "successor", c, W_in)
    return unary[c].item() + sum(A[r] * P[r] * Bc[r] for r in range(len(P)))


def ref_topk(unary, k):
    return sorted(range(unary.shape[-1]), key=lambda v: -unary[v].item())[:k]


def ref_filtered_law(logits, temperature, top_p, top_k):
    """The law at a sampling setting, token by token: the top_k largest logits, softmax(·/T)
    over them, then the most likely tokens in order until their mass reaches top_p,
    renormalised. -> {token: probability} over its support."""
    order = sorted(range(len(logits)), key=lambda v: -logits[v].item())[:top_k or None]
    z = sum(math.exp(logits[v].item() / temperature) for v in order)
    kept, mass = [], 0.0
    for v in order:
        if top_p < 1 and mass >= top_p:
            break
        kept.append(v)
        mass += math.exp(logits[v].item() / temperature) / z
    return {v: math.exp(logits[v].item() / temperature) / z / mass for v in kept}


def ref_greedy_walk(sel, h, unary, anchor, feed_forward=True, W_in=None):
    """One block: h (n, H), unary (n, V). Returns the path, recomputing every slot's scores
    with the token chosen at the slot before (the anchor for slot 1); feed_forward=False
    keeps the anchor as every slot's predecessor (the wrong walk, a control)."""
    prev, path = anchor, []
    for j in range(unary.shape[0]):
        cand = ref_topk(unary[j], sel.top_k)
        scores = [ref_edge_score(sel, h[j], unary[j], prev, c, W_in) for c in cand]
        path.append(cand[scores.index(max(scores))])
        prev = path[-1] if feed_forward else anchor
    return path


def counted_slots(batch, anchors, valid):
    """(row, block, slot k, position t) of every slot the loss counts: real anchor, t < S
    and loss_mask[t] = 1."""
    out = []
    for n in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            for k in range(1, B):
                t = anchors[n, j].item() + k
                if valid[n, j] and t < S and batch["loss_mask"][n, t]:
                    out.append((n, j, k, t))
    return out


def echo_forward(G, shift=0, noise=None):
    """A stand-in drafter forward whose output at block position t is G[t - 1 + shift]
    (+ noise): with target logits lm_head(G), shift 0 reproduces exactly the distribution
    slot k of anchor a must learn, the target's at a + k - 1."""
    def forward(embeds, pos, ctx, ctx_pos, mask=None, cache=None):
        h = G.gather(1, (pos - 1 + shift).clamp(0, S - 1)[..., None].expand(-1, -1, H))
        return h if noise is None else h + noise
    return forward


def float64_scores(monkeypatch, sel):
    """sel's edge scores without their cast to fp32 (kept on purpose, §8), in the loss and the
    metrics: fp32 scores would hide a chunking error of 1e-10 behind rounding of 1e-7.
    monkeypatch.undo() restores the real ones."""
    def edge_scores(h, unary, prev, cand, W_in=None):  # free codebooks: W_in is not read
        return unary.gather(-1, cand) + torch.einsum("...r,...kr->...k", sel.predecessor_codebook[prev]
                                                     * sel.hidden_projection(h), sel.successor_codebook[cand])
    monkeypatch.setattr(sel, "edge_scores", edge_scores)
