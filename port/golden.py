"""
Golden tensors for porters (ALGORITHM.md §8): a seeded tiny target, drafters trained on it
for a few seconds, and every intermediate a port needs to diff itself against, written as

    DIR/target/                  config.json + model.safetensors   (transformers Qwen3ForCausalLM)
    DIR/drafter/                 the DFlash2 drafter (§7 checkpoint, fp32)
    DIR/drafter_v1/              a DFlash (v1) drafter, convolution and selector off
    DIR/drafter_conv_only/       servable exports (§7 partial variants, bf16) of the DFlash2
    DIR/drafter_selector_only/   drafter with its selector, or its convolution, switched off
    DIR/golden.safetensors       all tensors below
    DIR/manifest.json            name, shape, dtype, meaning of each, in computation order

Run from the repository root: python -m port.golden DIR [--force] [--weights-from GOLDEN_DIR].

The target is a noisy bigram model built by hand (each token has a likely and a less likely
successor), so its greedy text runs through many distinct tokens and its sampled text has
real choices. The drafters are trained on walks of that bigram chain with dflash2_loss (one
thread, seeded), long enough that most drafts are accepted and short enough that some are
not. A port cannot reproduce torch's RNG, so every random choice of the sampled traces is
driven by recorded uniforms (inverse CDF, §8), replayed by this file's own §5 loop out of
dflash2's pieces. Every discrete decision in the set (top-K order, argmaxes, inverse-CDF
picks, accept tests) is at least TIE_MARGIN away from a tie, so an fp32 port lands on the
same tokens. Notation: ALGORITHM.md's legend.
"""
import argparse
import dataclasses
import json
import os
import shutil

import torch
from safetensors.numpy import load_file, save_file

import dflash2
from harness import checkpoint
from harness.metrics import dflash2_metrics
from harness.target import drafter_config

TIE_MARGIN = 1e-4
# the tiny world: V 64, H 32, Lt 4 target layers, nf 2 features, Ld 2 draft layers,
# B 4, Kc 3 (so a block start cuts two taps), G 8, R 8, K 4, nh 4, nkv 2 (GQA), hd 8
V, H, MASK_ID = 64, 32, 63
DRAFT = dict(mask_token_id=MASK_ID, num_layers=2, block_size=4, target_layer_ids=[0, 2],
             conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4)
SEED = 0
# the bigram target: logit of the likely successor ≈ 32·LIKELY, of the other ≈ 32·OTHER
LIKELY, OTHER, P_LIKELY = 0.25, 0.18, 0.8
# training: walks of the chain, fresh anchors every step (dflash2.sample_anchors)
CORPUS_ROWS, CORPUS_LEN, TRAIN_ROWS, TRAIN_ANCHORS, LR = 32, 24, 4, 6, 1e-2
STEPS, STEPS_V1 = 60, 100
# the training batch: b 2 rows of S 12, anchors placed by hand (all obey the §6 rule)
S = 12
ANCHORS = [[0, 2, 10], [5, 8, 0]]
ANCHOR_VALID = [[True, True, True], [True, True, False]]
MAX_ANCHORS = 4                # of the anchor-sampling case
WALK_TEMPERATURE = 0.7         # of the sampled walk on the batch
PROMPT = [15, 52, 52, 23, 22]
GREEDY_NEW_TOKENS = 30
SAMPLING = dict(temperature=1.3, top_p=0.9, top_k=3)
SERVED = (SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["top_k"])  # soft_labels_at and accept_at's setting
SAMPLED_NEW_TOKENS = 24
STOP_TOKEN_IDS = [29]          # the stop trace: 29 is an accepted draft in the middle of a greedy cycle
SHORT_NEW_TOKENS, SHORT_SEED = 9, SEED + 15   # the short sampled trace: its last cycle has one token left (n = 0)
GRADS = ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
         "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
         "layers.0.self_attn.q_norm.weight", "layers.0.attention_conv.kernel_projection.weight",
         "layers.1.post_attention_layernorm.weight", "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.k_norm.weight",
         "layers.1.mlp_conv.base_kernel", "candidate_selector.hidden_projection.weight",
         "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
LAYER_RULE_CASES = (1, 2, 3, 4, 5, 6, 9, 11, 13, 28, 36, 64)
GAMMA_CASES = (2, 3, 4, 8, 10, 12, 16)
DRAFTERS = ("drafter", "drafter_v1", "drafter_conv_only", "drafter_selector_only")
OUTPUTS = ("target", *DRAFTERS, "golden.safetensors", "manifest.json")


def target_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       rope_theta=10000.0, tie_word_embeddings=False)


def successors():
    """The chain: token v is followed by likely[v] (a single cycle through every token but
    MASK) with probability P_LIKELY, else by other[v]."""
    g = torch.Generator().manual_seed(SEED + 1)
    order = torch.randperm(MASK_ID, generator=g)
    likely = torch.empty(MASK_ID, dtype=torch.long)
    likely[order] = order.roll(-1)
    return likely, torch.randint(0, MASK_ID, (MASK_ID,), generator=g)


def build_models():
    """Every weight drawn here, in sorted-name order from one generator, so the set depends
    on the forward math only, not on how dflash2 or transformers initialise. The target's
    layers are small next to its embeddings, so it is a bigram model with some context mixed
    in: lm_head row w gets LIKELY·e[v] for w = likely[v] and OTHER·e[v] for w = other[v]
    (e = the embedding rows at unit RMS). The drafter's convolution and selector start far
    from their identity init, so a port with a transposed kernel or a swapped codebook
    cannot hide behind zeros."""
    from transformers import Qwen3ForCausalLM
    target = Qwen3ForCausalLM(target_config()).float().eval().requires_grad_(False)
    drafter = dflash2.DFlash2Drafter(drafter_config(target.config, **DRAFT)).float()
    g = torch.Generator().manual_seed(SEED)
    randn = lambda p, std: std * torch.randn(p.shape, generator=g)
    likely, other = successors()
    with torch.no_grad():
        for name, p in sorted(target.named_parameters()):
            p.copy_(1 + randn(p, 0.1) if name.endswith("norm.weight") else randn(p, 0.02))
        embed = randn(target.model.embed_tokens.weight, 1.0)
        target.model.embed_tokens.weight.copy_(embed)
        e = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        lm_head = randn(target.lm_head.weight, 0.05)
        lm_head[likely] += LIKELY * e[:MASK_ID]
        lm_head[other] += OTHER * e[:MASK_ID]
        target.lm_head.weight.copy_(lm_head)
        for name, p in sorted(drafter.named_parameters()):
            if name.endswith("base_kernel"):
                p.copy_(randn(p, 0.3))
                p[:, 0] += 1.0
            elif name.endswith("kernel_projection.weight"):
                p.copy_(randn(p, 0.1))
            elif name.endswith("norm.weight"):
                p.copy_(1 + randn(p, 0.1))
            elif name.startswith("candidate_selector."):
                p.copy_(randn(p, 0.3))
            else:
                p.copy_(randn(p, 0.02))
    v1 = dflash2.DFlash2Drafter(dataclasses.replace(drafter.config, conv_kernel_size=0, selector_top_k=0)).float()
    v1.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in v1.state_dict()})
    return target, drafter, v1


def chain_walks(n, length, g):
    likely, other = successors()
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, MASK_ID, (n,), generator=g)
    for t in range(1, length):
        keep = torch.rand(n, generator=g) < P_LIKELY
        x[:, t] = torch.where(keep, likely[x[:, t - 1]], other[x[:, t - 1]])
    return x


def train(drafter, target, steps, seed):
    """AdamW on dflash2_loss (KL, argmax selector labels) over chain walks: every token is a
    loss token, TRAIN_ANCHORS anchors per row, drawn afresh each step."""
    g = torch.Generator().manual_seed(seed)
    corpus = chain_walks(CORPUS_ROWS, CORPUS_LEN, g)
    ones = torch.ones_like(corpus)
    with torch.no_grad():
        hidden_states = target(corpus, output_hidden_states=True).hidden_states
    context, last = dflash2.context_features(hidden_states, drafter.config.target_layer_ids), hidden_states[-1]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=LR, weight_decay=0.0)
    for _ in range(steps):
        rows = torch.randint(0, CORPUS_ROWS, (TRAIN_ROWS,), generator=g)
        anchors, valid = dflash2.sample_anchors(ones[rows], TRAIN_ANCHORS, g)
        batch = dflash2.Batch(corpus[rows], ones[rows], ones[rows], context[rows], last[rows], anchors, valid)
        loss = dflash2.dflash2_loss(drafter, dflash2.target_view(drafter.config, target), batch)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.zero_grad(set_to_none=True)
    return drafter.eval()


def training_batch():
    """Row 0: no padding, a loss-mask gap at 4 (block 2's middle slot is not counted), a block
    at 0 (empty context) and one running past S. Row 1: two padding tokens on the left (the
    attention_mask clause of the block mask hides them from its blocks), a 3-token prompt,
    and a padding anchor."""
    g = torch.Generator().manual_seed(SEED + 2)
    input_ids = torch.cat([chain_walks(1, S, g), torch.cat([torch.zeros(1, 2, dtype=torch.long),
                                                            chain_walks(1, S - 2, g)], 1)])
    attention_mask = torch.ones(2, S, dtype=torch.long)
    attention_mask[1, :2] = 0
    loss_mask = torch.ones(2, S, dtype=torch.long)
    loss_mask[0, 4] = 0
    loss_mask[1, :5] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                anchors=torch.tensor(ANCHORS), anchor_valid=torch.tensor(ANCHOR_VALID))


def anchor_case():
    """sample_anchors on three loss masks: more eligible positions than MAX_ANCHORS, exactly
    one, none. -> (loss_mask, eligible, draw order (b, S) padded with -1, anchors, valid).
    The draw order replays sample_anchors' randperm per row; anchors = its first MAX_ANCHORS, sorted."""
    loss_mask = torch.zeros(3, S, dtype=torch.long)
    loss_mask[0, 1:] = 1
    loss_mask[0, 6] = 0
    loss_mask[1, 7:9] = 1
    loss_mask[2, ::2] = 1
    lm = loss_mask.bool()
    eligible = torch.zeros_like(lm)
    eligible[:, :-1] = lm[:, :-1] & lm[:, 1:]
    g = torch.Generator().manual_seed(SEED + 5)
    order = torch.full((3, S), -1, dtype=torch.long)
    for i, row in enumerate(eligible):
        idx = row.nonzero().squeeze(-1)
        order[i, :len(idx)] = idx[torch.randperm(len(idx), generator=g)]
    anchors, valid = dflash2.sample_anchors(loss_mask, MAX_ANCHORS, torch.Generator().manual_seed(SEED + 5))
    for i in range(3):
        drawn = order[i][order[i] >= 0][:MAX_ANCHORS].sort().values
        if not torch.equal(anchors[i][valid[i]], drawn):
            raise RuntimeError(f"sample_anchors row {i} gave {anchors[i][valid[i]].tolist()}, the replayed "
                               f"randperm {drawn.tolist()}: update anchor_case to how it draws")
    return loss_mask, eligible, order, anchors, valid


# -----------------------------------------------------------------------------
# the training forward and its intermediates


def block_inputs(drafter, target, batch):
    """What the drafter's training forward reads: packed blocks, the block mask, features."""
    c = drafter.config
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    ctx = dflash2.context_features(out.hidden_states, c.target_layer_ids)
    ids, pos = dflash2.block_layout(batch["input_ids"], batch["anchors"], c.block_size, c.mask_token_id)
    mask = dflash2.block_attention_mask(batch["anchors"], batch["attention_mask"], c.block_size)
    return dict(hidden_states=out.hidden_states, target_logits=out.logits, ctx_features=ctx,
                block_ids=ids, block_pos=pos, mask=mask, ctx_pos=torch.arange(S).expand(2, S))


class Capture:
    """Records each draft layer's intermediates during one forward: module outputs through
    forward hooks, the convolutions' prepare/finish through wrappers on the instances."""

    def __init__(self, drafter):
        self.drafter, self.got, self.undo = drafter, {}, []

    def __enter__(self):
        d = self.drafter
        self._out(d.hidden_norm, "fwd.ctx")
        for i, layer in enumerate(d.layers):
            p = f"fwd.layers.{i}."
            self._out(layer.input_layernorm, p + "attn_norm")
            for side in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, side)
                self._out(conv.kernel_projection, p + side + ".delta")
                self._wrap(conv, "prepare", p + side + ".prepare", first=True)
                self._wrap(conv, "finish", p + side + ".finish", first=False)
            self._out(layer.self_attn, p + "attention")
            self._out(layer.post_attention_layernorm, p + "mlp_norm")
            self._out(layer.mlp, p + "mlp")
            self._out(layer, p + "output")
        return self.got

    def __exit__(self, *exc):
        for undo in reversed(self.undo):
            undo()

    def _out(self, module, name):
        def hook(m, args, out):
            self.got[name] = out.detach().clone()
        self.undo.append(module.register_forward_hook(hook).remove)

    def _wrap(self, obj, method, name, first):
        inner = getattr(obj, method)

        def wrapper(*args):
            out = inner(*args)
            self.got[name] = (out[0] if first else out).detach().clone()
            return out
        setattr(obj, method, wrapper)
        self.undo.append(lambda: delattr(obj, method))


def blocks_forward(drafter, target, inp, dtype=torch.float32):
    """The drafter on the batch's packed blocks -> hidden (b, N·B, H), and for the M = b·N
    blocks the drafted slots' h (M, B−1, H), unary logits (M, B−1, V) and anchors (M,)."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    h_all = drafter(embed(inp["block_ids"]).to(dtype), inp["block_pos"], inp["ctx_features"].to(dtype),
                    inp["ctx_pos"], inp["mask"])
    B = drafter.config.block_size
    M = h_all.shape[0] * h_all.shape[1] // B
    h = h_all.view(M, B, -1)[:, 1:]
    return h_all, h, lm_head(h.float()).float(), inp["block_ids"].view(M, B)[:, 0]


def greedy_walk(drafter, h, unary, anchor):
    """-> path, candidates, the edge scores along the path, and its smallest tie gap."""
    path, cand, _ = drafter.propose(h, unary, anchor, 0.0)
    prev = torch.cat([anchor[:, None], path[:, :-1]], 1)
    scores = drafter.candidate_selector.edge_scores(h, unary, prev, cand)
    return path, cand, scores, min(min_gap(unary, cand.shape[-1]), min_gap(scores, 1))


# -----------------------------------------------------------------------------
# draws from recorded uniforms, and how far each decision is from a tie


def inverse_cdf(probs, u):
    """The draw of §8: the number of entries of cumsum(probs) that are <= u (clamped to the
    last index), i.e. the first index whose cumulative probability exceeds u.
    probs (..., n), u (...) -> (index (...), margin: min |cumsum − u| over the entries that decide)."""
    cdf = probs.double().cumsum(-1)
    u = u.double()[..., None]
    pick = (cdf <= u).sum(-1).clamp(max=probs.shape[-1] - 1)
    return pick, float((cdf[..., :-1] - u).abs().min()) if probs.shape[-1] > 1 else float("inf")


def min_gap(x, k):
    """Smallest gap between consecutive values among the k + 1 largest (last axis)."""
    top = x.topk(min(k + 1, x.shape[-1]), dim=-1).values
    return float((top[..., :-1] - top[..., 1:]).min())


def separating_uniform(law, other):
    """A u whose inverse-CDF draws from the two laws (V,) differ: the middle of the widest
    stretch of [0, 1) where they do, rounded to fp32 (the recorded value is then exact).
    -> (u, its distance to the nearest cumulative sum of either law)."""
    cuts = torch.cat([torch.zeros(1, dtype=torch.float64), law.double().cumsum(-1), other.double().cumsum(-1)])
    cuts = cuts[cuts < 1].sort().values
    ends = torch.cat([cuts[1:], torch.ones(1, dtype=torch.float64)])
    mids = (cuts + ends) / 2
    differ = inverse_cdf(law.expand(len(mids), -1), mids)[0] != inverse_cdf(other.expand(len(mids), -1), mids)[0]
    width = torch.where(differ, ends - cuts, torch.zeros_like(ends))
    u = mids[width.argmax()].float().double()
    return u, float(torch.cat([law.double().cumsum(-1), other.double().cumsum(-1)]).sub(u).abs().min())


def law_cases():
    """Unit cases of §4's filtered law, each one where a port can read the rule another way:
    -> logits (3, V), temperature (3,), top_p (3,), top_k (3,), and how far each top-p test
    is from its threshold. Row 0: top-k 3 then top-p 0.5 on a law (0.4, 0.2, 0.1 on ids 7,
    30, 2; 0.3 spread over the rest): top-p measured on the law renormalised over the top-k
    survivors keeps id 7 alone; measured on the softmax it would keep 7 and 30. Row 1: top-p
    0.5 with an exact tie across the threshold (0.3 on id 40, 0.25 on ids 12 and 51): id 12
    is kept, 51 dropped (lower id first). Row 2: top-k 2 at T = 2 with three ids tied for
    second place (8, 20, 33): all three stay."""
    rest = lambda mass, n: torch.full((V,), float(torch.tensor(mass / n).log()))
    logits = torch.stack([rest(0.3, V - 3), rest(0.2, V - 3), torch.linspace(-1, 1, V).roll(17)])
    logits[0, [7, 30, 2]] = torch.tensor([0.4, 0.2, 0.1]).log()
    logits[1, [40, 12, 51]] = torch.tensor([0.3, 0.25, 0.25]).log()
    logits[2, 3], logits[2, [8, 20, 33]] = 3.0, 2.0
    temperature, top_p, top_k = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.5, 0.5, 1.0]), torch.tensor([3, 0, 2])
    margin = float("inf")
    for z, t, tp, tk in zip(logits, temperature.tolist(), top_p.tolist(), top_k.tolist()):
        if tp < 1:
            survivors = dflash2.sampling_probs(z.double(), t, 1.0, tk).sort(descending=True).values
            margin = min(margin, float((survivors.cumsum(-1) - survivors - tp).abs().min()))
    return logits, temperature, top_p, top_k, margin


def sampled_walk(selector, h, unary, anchor, cand, uniforms, temperature):
    """The §3 walk at T > 0 with its sampling made explicit: pick = inverse_cdf(q, u), u one
    recorded uniform per slot. h (M, n, H), unary (M, n, V), anchor (M,), cand (M, n, K),
    uniforms (M, n) -> path (M, n), q (M, n, K), scores (M, n, K), smallest margin."""
    prev, path, qs, scores, margin = anchor, [], [], [], float("inf")
    for j in range(cand.shape[1]):
        s = selector.edge_scores(h[:, j], unary[:, j], prev, cand[:, j])
        q = torch.softmax(s / temperature, dim=-1)
        pick, m = inverse_cdf(q, uniforms[:, j])
        margin = min(margin, m)
        prev = cand[:, j].gather(-1, pick[:, None]).squeeze(-1)
        path.append(prev), qs.append(q), scores.append(s)
    return torch.stack(path, 1), torch.stack(qs, 1), torch.stack(scores, 1), margin


# -----------------------------------------------------------------------------
# §5 traces: greedy through spec_generate itself, sampled through a replay of its loop


class TargetCalls:
    """Every target call of a §5 loop: ids, logits, context features, and the KV cache's
    length before the call (the last cache seen is kept to read its final length)."""

    def __init__(self, target, layer_ids):
        self.ids, self.logits, self.features, self.cache_before, self.cache = [], [], [], [], None
        self.layer_ids = layer_ids
        self.handles = [target.register_forward_pre_hook(self._before, with_kwargs=True),
                        target.register_forward_hook(self._after, with_kwargs=True)]

    def _before(self, module, args, kwargs):
        self.cache = kwargs["cache"]
        self.cache_before.append(self.cache.get_seq_length())

    def _after(self, module, args, kwargs, out):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.ids.append(ids[0].clone())
        self.logits.append(out.logits[0].float().clone())
        self.features.append(dflash2.context_features(out.hidden_states, self.layer_ids)[0].float().clone())

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def put(self, put, prefix):
        put(prefix + "call_lengths", torch.tensor([len(i) for i in self.ids]),
            "(calls,) tokens fed to the target per call: the prompt, then [anchor ; draft] per cycle")
        put(prefix + "input_ids", torch.cat(self.ids), "(Σ calls,) token ids fed to the target, call after call")
        put(prefix + "logits", torch.cat(self.logits), "(Σ calls, V) target logits of those calls")
        put(prefix + "ctx_features", torch.cat(self.features), "(Σ calls, nf·H) raw context features of those calls")


def put_drafting(put, prefix, cycles):
    """Per-cycle records of a §5 trace up to the drafts; cycles[c] is a dict of cycle c's values."""
    stack = lambda key: torch.stack([c[key] for c in cycles])
    put(prefix + "anchor_pos", torch.tensor([c["a"] for c in cycles]),
        "(cycles,) anchor position a = S₀ + len(tokens) − 1 of each cycle")
    put(prefix + "block_pos", stack("block_pos"), "(cycles, B) positions the drafter's block is read at, a..a+B−1")
    put(prefix + "ctx_new_lengths", torch.tensor([len(c["ctx_pos"]) for c in cycles]),
        "(cycles,) context rows the drafter cache appends in each cycle's draft pass")
    put(prefix + "ctx_new_pos", torch.cat([c["ctx_pos"] for c in cycles]),
        "(Σ cycles,) their positions, cycle after cycle (together: 0..a−1 of the last cycle, each once)")
    put(prefix + "draft_cache_lengths", torch.tensor([c["draft_cache"] for c in cycles]),
        "(cycles,) context positions the drafter cache holds after the draft pass (= a: the committed context)")
    put(prefix + "unary", stack("unary"), "(cycles, B−1, V) the drafter's unary logits U of slots 1..B−1")
    if "cand" in cycles[0]:
        put(prefix + "candidates", stack("cand"), "(cycles, B−1, K) top-K of U, by descending logit")
        put(prefix + "walk_scores", stack("scores"), "(cycles, B−1, K) edge scores E[k](prev, C[k]) along the walk")


def put_drafts(put, prefix, cycles, B):
    put(prefix + "drafts", torch.stack([torch.cat([c["draft"], torch.full((B - 1 - len(c["draft"]),), -1)])
                                        for c in cycles]),
        "(cycles, B−1) drafted tokens sent for verification, n = min(B−1, max_new_tokens − len(tokens) − 1) "
        "of them, then −1")


def put_verified(put, prefix, cycles, tokens, als, al_meaning=""):
    put(prefix + "n_accepted", torch.tensor([c["n_acc"] for c in cycles]), "(cycles,) drafts accepted")
    put(prefix + "bonus", torch.tensor([c["bonus"] for c in cycles]), "(cycles,) the token the target adds after them")
    put(prefix + "target_cache_lengths", torch.tensor([c["target_cache"] for c in cycles]),
        "(cycles,) the target KV cache's length after the cycle's rollback (= a + n_accepted + 1)")
    put(prefix + "tokens", tokens, "(n,) committed tokens")
    put(prefix + "acceptance_lengths", als, "(cycles,) tokens committed per cycle, bonus included" + al_meaning)


def greedy_trace(drafter, target, prompt, max_new_tokens, stop_token_ids=None):
    """spec_generate at T = 0, every target call and drafter pass recorded by hooks.
    -> (TargetCalls, per-cycle dicts, tokens, stats, smallest tie gap)."""
    c, cycles, gaps = drafter.config, [], [float("inf")]
    calls = TargetCalls(target, c.target_layer_ids)
    forward, propose = drafter.forward, drafter.propose

    def recorded_forward(block_embeds, block_pos, ctx_features, ctx_pos, mask=None, cache=None):
        out = forward(block_embeds, block_pos, ctx_features, ctx_pos, mask, cache)
        cycles.append(dict(a=int(block_pos[0, 0]), block_pos=block_pos[0].clone(), ctx_pos=ctx_pos[0].clone(),
                           draft_cache=cache.length))
        return out

    def recorded_propose(h, unary, anchor, *args, **kwargs):
        path, cand, q = propose(h, unary, anchor, *args, **kwargs)
        prev = torch.cat([anchor[:, None], path[:, :-1]], 1)
        scores = drafter.candidate_selector.edge_scores(h, unary, prev, cand)
        gaps.extend([min_gap(unary, c.selector_top_k), min_gap(scores, 1)])
        cycles[-1].update(unary=unary[0].clone(), cand=cand[0].clone(), scores=scores[0].clone(), path=path[0].clone())
        return path, cand, q

    drafter.forward, drafter.propose = recorded_forward, recorded_propose
    try:
        tokens, stats = dflash2.spec_generate(drafter, target, prompt, max_new_tokens, temperature=0.0,
                                              stop_token_ids=stop_token_ids)
    finally:
        calls.remove()
        del drafter.forward, drafter.propose
    for i, cyc in enumerate(cycles):
        n = len(calls.ids[i + 1]) - 1
        gaps.append(min_gap(calls.logits[i + 1], 1))
        after = calls.cache_before[i + 2] if i + 2 < len(calls.ids) else calls.cache.get_seq_length()
        n_acc = after - cyc["a"] - 1
        cyc.update(draft=cyc["path"][:n], n_acc=n_acc, bonus=int(calls.logits[i + 1][n_acc].argmax()),
                   target_cache=after)
    gaps.append(min_gap(calls.logits[0][-1:], 1))
    return calls, cycles, tokens, stats, min(gaps)


@torch.no_grad()
def sampled_trace(drafter, target, prompt, max_new_tokens, temperature, top_p, top_k, seed, u_first=None):
    """spec_generate's loop at T > 0 with every draw taken from recorded uniforms: the first
    token ~ p by inverse CDF of u_first (drawn first, unless given); per cycle, slot k's draft from u_walk[k−1] (the walk's
    q = softmax(E/T) over K, or, selector off, q = sampling_probs(U, T, top_p, top_k) over V);
    draft m is kept iff u_accept[m] < acceptance_probability(p[m], q[m], d); the bonus is drawn
    from residual_distribution(p[m], q[m]) at the first rejection, or from p[n], by u_bonus.
    -> (TargetCalls, per-cycle dicts, tokens, ALs, uniforms, smallest decision margin)."""
    from transformers import DynamicCache
    c, dev = drafter.config, prompt.device
    B, P, K = c.block_size, prompt.shape[1], c.selector_top_k
    view = dflash2.target_view(c, target)
    g = torch.Generator().manual_seed(seed)
    calls, cycles, tokens, als = TargetCalls(target, c.target_layer_ids), [], [], []
    cache, draft_cache = DynamicCache(config=target.config), dflash2.DraftCache(c.num_layers)
    try:
        out = target(prompt, cache=cache, use_cache=True, output_hidden_states=True)
        if u_first is None:
            u_first = torch.rand((), generator=g, dtype=torch.float64)
        first, margin = inverse_cdf(dflash2.sampling_probs(out.logits[0, -1].double(), temperature, top_p, top_k), u_first)
        new_ctx = dflash2.context_features(out.hidden_states, c.target_layer_ids)
        tokens.append(int(first))
        while len(tokens) < max_new_tokens:
            # speculative_decode_step with its draws replaced by the recorded uniforms' inverse CDFs
            u_walk, u_accept, u_bonus = torch.rand(2 * B - 1, generator=g, dtype=torch.float64).split([B - 1, B - 1, 1])
            a = P + len(tokens) - 1
            anchor = torch.tensor([tokens[-1]], device=dev)
            ctx_pos = torch.arange(draft_cache.length, a, device=dev)
            h, unary = dflash2.draft_forward(drafter, view, anchor, new_ctx, draft_cache)
            cyc = dict(a=a, block_pos=torch.arange(a, a + B), ctx_pos=ctx_pos, draft_cache=draft_cache.length,
                       unary=unary[0], u_walk=u_walk, u_accept=u_accept, u_bonus=u_bonus[0])
            if K:
                cand = unary.topk(K, dim=-1).indices
                path, q, scores, m = sampled_walk(drafter.candidate_selector, h, unary, anchor, cand,
                                                  u_walk[None], temperature)
                cyc.update(cand=cand[0], scores=scores[0], q=q[0])
            else:
                q = dflash2.sampling_probs(unary, temperature, top_p, top_k)
                path, m = inverse_cdf(q, u_walk[None])
                cand = torch.arange(V).expand(1, B - 1, V)
                cyc.update(q=q[0])
            margin = min(margin, m)
            n = min(B - 1, max_new_tokens - len(tokens) - 1)
            draft = path[0, :n]
            out = target(torch.cat([anchor, draft])[None], cache=cache, use_cache=True, output_hidden_states=True)
            logits, features = out.logits[0], dflash2.context_features(out.hidden_states, c.target_layer_ids)
            p = dflash2.sampling_probs(logits.double(), temperature, top_p, top_k)     # (n+1, V)
            q_vocab = dflash2.q_over_vocab(cand[0, :n], q[0, :n], V)
            ratios, n_acc = torch.full((B - 1,), -1.0, dtype=torch.float64), n
            for i, d in enumerate(draft.tolist()):
                ratios[i] = dflash2.acceptance_probability(p[i], q_vocab[i], d)
                margin = min(margin, abs(float(u_accept[i] - ratios[i])))
                if not u_accept[i] < ratios[i]:
                    n_acc = i
                    break
            law = dflash2.residual_distribution(p[n_acc], q_vocab[n_acc]) if n_acc < n else p[n]
            bonus, m = inverse_cdf(law, u_bonus[0])
            margin = min(margin, m)
            cache.crop(-(n - n_acc))  # speculative_decode_step's rollback
            new_ctx = features[:, :n_acc + 1]
            tokens += draft[:n_acc].tolist() + [int(bonus)]  # n <= max_new_tokens − len(tokens) − 1: all fit
            als.append(n_acc + 1)
            cyc.update(draft=draft, n_acc=n_acc, bonus=int(bonus), target_cache=cache.get_seq_length(), p=p,
                       ratios=ratios, law=law)
            cycles.append(cyc)
    finally:
        calls.remove()
    return calls, cycles, torch.tensor(tokens), torch.tensor(als), u_first, margin


def put_sampled(put, prefix, calls, cycles, tokens, als, u_first, B, K, u_first_meaning=""):
    stack = lambda key: torch.stack([c[key] for c in cycles])
    put(prefix + "u_first", u_first.float(), "() uniform of the first token's draw from p (inverse CDF)" + u_first_meaning)
    put(prefix + "u_walk", stack("u_walk").float(),
        "(cycles, B−1) uniform of slot k's draft (inverse CDF of its q), all B−1 slots drawn")
    put_drafting(put, prefix, cycles)
    put(prefix + "q", stack("q").float(), "(cycles, B−1, K) the walk's q = softmax(E/T), unfiltered" if K else
        "(cycles, B−1, V) q = softmax(U/T) after the request's top-k then top-p, renormalised")
    put_drafts(put, prefix, cycles, B)
    calls.put(put, prefix)
    put(prefix + "p", torch.cat([c["p"] for c in cycles]).float(),
        "(Σ (n+1), V) p = softmax(z/T) after top-k then top-p, renormalised, for each verify row "
        "(float64 in the reference)")
    put(prefix + "u_accept", stack("u_accept").float(),
        "(cycles, B−1) uniform of the accept test of draft m: keep iff u < min(1, p[m][d]/q[m][d])")
    put(prefix + "accept_probability", stack("ratios").float(),
        "(cycles, B−1) min(1, p/q) of each tested draft (0 where p = 0), −1 where not tested")
    put(prefix + "u_bonus", stack("u_bonus").float(), "(cycles,) uniform of the bonus draw (inverse CDF)")
    put(prefix + "bonus_law", stack("law").float(),
        "(cycles, V) what the bonus was drawn from: normalise(max(0, p[m] − q[m])) at the first rejection m, "
        "else p[n]")
    put_verified(put, prefix, cycles, tokens, als)


# -----------------------------------------------------------------------------
# everything, in computation order


def compute(weights_from=None):
    """-> ({name: tensor} in computation order, {name: meaning}, {decision: tie margin},
    {folder: model}). Everything fp32/int64/bool. One thread: the same reduction order on every run.
    weights_from: a golden folder whose trained DFlash2 and v1 drafters to use instead of
    training them here (training's fp32 rounding differs from CPU to CPU and grows over the
    steps; every tensor computed from given weights agrees to fp32 rounding)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compute(weights_from)
    finally:
        torch.set_num_threads(threads)


def trained_drafters(weights_from=None):
    """-> (target, DFlash2 drafter, v1 drafter), trained here or read from a golden folder."""
    target, drafter, v1 = build_models()
    if weights_from is None:
        return target, train(drafter, target, STEPS, SEED + 6), train(v1, target, STEPS_V1, SEED + 7)
    for model, folder in ((drafter, "drafter"), (v1, "drafter_v1")):
        model.load_state_dict(checkpoint.load_export(os.path.join(weights_from, folder)).state_dict())
    return target, drafter.eval(), v1.eval()


def _compute(weights_from):
    target, drafter, v1 = trained_drafters(weights_from)
    c = drafter.config
    B, K, N = c.block_size, c.selector_top_k, len(ANCHORS[0])
    M = 2 * N
    rec, meaning, margins = {}, {}, {}

    def put(name, t, what):
        if name in rec:
            raise RuntimeError(f"golden tensor {name} recorded twice")
        rec[name], meaning[name] = t.detach().clone().contiguous(), what

    layer_cases = torch.full((len(LAYER_RULE_CASES), 5), -1)
    for i, L in enumerate(LAYER_RULE_CASES):
        ids = dflash2.default_target_layer_ids(L)
        layer_cases[i, :len(ids)] = torch.tensor(ids)
    put("rules.num_target_layers", torch.tensor(LAYER_RULE_CASES), "(n,) target layer counts Lt of the rule cases")
    put("rules.target_layer_ids", layer_cases, "(n, 5) default target_layer_ids for each Lt (§1), padded with −1")
    put("rules.block_sizes", torch.tensor(GAMMA_CASES), "(n,) block sizes B of the γ cases")
    put("rules.gamma", torch.tensor([dflash2.default_gamma(b) for b in GAMMA_CASES], dtype=torch.float32),
        "(n,) default γ of the position weights for each B (§6)")

    loss_mask, eligible, order, anchors, valid = anchor_case()
    put("anchors.loss_mask", loss_mask, "(3, S) loss masks of the anchor-sampling case")
    put("anchors.max_anchors", torch.tensor(MAX_ANCHORS), "() max_anchors")
    put("anchors.eligible", eligible, "(3, S) a may be an anchor: loss_mask[a] = loss_mask[a+1] = 1, a+1 < S")
    put("anchors.draw_order", order, "(3, S) eligible positions in the order drawn (a uniform random "
        "permutation; recorded, since torch's randperm cannot be ported), then −1")
    put("anchors.anchors", anchors, "(3, N) the first max_anchors drawn, sorted; rows with fewer are padded "
        "with 0; N = the largest count over rows, at least 1")
    put("anchors.valid", valid, "(3, N) False = padding anchor")

    batch = training_batch()
    put("batch.input_ids", batch["input_ids"], "(b, S) data tokens of the training batch")
    put("batch.attention_mask", batch["attention_mask"], "(b, S) 1 = real token, 0 = padding (row 1: left padding)")
    put("batch.loss_mask", batch["loss_mask"], "(b, S) 1 = trained token")
    put("batch.anchors", batch["anchors"], "(b, N) anchor positions a_j, placed by hand to reach the edge cases "
        "(empty context, a block past S, a loss-mask gap inside a block, left padding); each obeys §6's rule; "
        "the padding anchor sits at 0")
    put("batch.anchor_valid", batch["anchor_valid"], "(b, N) False = padding anchor")

    with torch.no_grad():
        inp = block_inputs(drafter, target, batch)
    put("batch.target_logits", inp["target_logits"], "(b, S, V) target logits z of the training batch")
    put("fwd.ctx_features", inp["ctx_features"], "(b, S, nf·H) raw context features cat(h_l), l in target_layer_ids")
    put("fwd.ctx_pos", inp["ctx_pos"], "(b, S) positions of the context keys")
    put("fwd.block_ids", inp["block_ids"], "(b, N·B) packed blocks [x[a_j], MASK×(B−1)]")
    put("fwd.block_pos", inp["block_pos"], "(b, N·B) absolute positions a_j + k")
    put("fwd.mask", inp["mask"], "(b, 1, N·B, S + N·B) block attention mask over keys [context ; blocks], True = visible")

    with torch.no_grad(), Capture(drafter) as got:
        h_all, h, unary, anchor = blocks_forward(drafter, target, inp)
    what = {"ctx": "(b, S, H) projected context RMSNorm(fc(ctx_features)), shared by every layer",
            "attn_norm": "(b, N·B, H) u = input_layernorm(h)",
            "attention_conv.delta": "(b, N·B, 2·Kc·H/G) kernel_projection(u), viewed [side, tap, group]",
            "attention_conv.prepare": "(b, N·B, H) u' = input-side conv of u (queries and block K/V read it)",
            "attention": "(b, N·B, H) attention output y (o_proj applied)",
            "attention_conv.finish": "(b, N·B, H) y' = output-side conv of y (added to the residual)",
            "mlp_norm": "(b, N·B, H) u = post_attention_layernorm(h)",
            "mlp_conv.delta": "(b, N·B, 2·Kc·H/G) kernel_projection(u), viewed [side, tap, group]",
            "mlp_conv.prepare": "(b, N·B, H) u' = input-side conv of u",
            "mlp": "(b, N·B, H) SwiGLU output y",
            "mlp_conv.finish": "(b, N·B, H) y' = output-side conv of y",
            "output": "(b, N·B, H) residual stream after the layer"}
    for name, t in got.items():
        put(name, t, what[name.split(".", 3)[-1] if name.startswith("fwd.layers.") else "ctx"])
    put("fwd.hidden", h_all, "(b, N·B, H) drafter output norm(h), all slots including the anchor's")

    with torch.no_grad():
        path, cand, scores, margins["walk"] = greedy_walk(drafter, h, unary, anchor)
    put("walk.unary", unary, "(M, B−1, V) unary logits U = lm_head(h) of drafted slots, M = b·N blocks in row order")
    put("walk.anchor", anchor, "(M,) anchor token of each block")
    put("walk.candidates", cand, "(M, B−1, K) top-K of U, by descending logit")
    put("walk.greedy_path", path, "(M, B−1) greedy walk (T = 0)")
    put("walk.greedy_scores", scores, "(M, B−1, K) edge scores E[k](prev, C[k]) with prev = anchor, then the greedy path")
    uniforms = torch.rand(M, B - 1, generator=torch.Generator().manual_seed(SEED + 3))
    with torch.no_grad():
        s_path, s_q, s_scores, margins["sampled_walk"] = sampled_walk(drafter.candidate_selector, h, unary, anchor,
                                                                      cand, uniforms, WALK_TEMPERATURE)
    put("walk.temperature", torch.tensor(WALK_TEMPERATURE), "() T of the sampled walk")
    put("walk.uniforms", uniforms, "(M, B−1) u per slot; pick = #{i : cdf_i <= u} (inverse CDF of q)")
    put("walk.sampled_path", s_path, "(M, B−1) sampled walk driven by walk.uniforms")
    put("walk.sampled_q", s_q, "(M, B−1, K) q = softmax(E / T) given the sampled predecessor")
    put("walk.sampled_scores", s_scores, "(M, B−1, K) edge scores along the sampled walk")

    logits, temperature, top_p, top_k, margins["laws"] = law_cases()
    laws = torch.stack([dflash2.sampling_probs(z.double(), t, tp, tk) for z, t, tp, tk in
                        zip(logits, temperature.tolist(), top_p.tolist(), top_k.tolist())])
    put("laws.logits", logits, "(3, V) logits of three unit cases of §4's filtered law: row 0 tells apart the two "
        "readings of top-p after top-k, row 1 has an exact tie across the top-p threshold, row 2 a tie at top-k")
    put("laws.temperature", temperature, "(3,) T of each case")
    put("laws.top_p", top_p, "(3,) top_p of each case")
    put("laws.top_k", top_k, "(3,) top_k of each case (0 = off)")
    put("laws.p", laws.float(), "(3, V) softmax(z/T), top-k (ties at the k-th all stay), then top-p measured on the "
        "law renormalised over the top-k survivors (ties in id order), renormalised: row 0 keeps id 7 alone, row 1 "
        "keeps 12 and drops 51, row 2 keeps 3, 8, 20, 33")
    residual_p, residual_q = torch.stack([laws[1], laws[0]]), torch.stack([laws[1], laws[2]])
    put("laws.residual_p", residual_p.float(), "(2, V) p of two residual cases: row 0 the law q itself, row 1 laws.p[0]")
    put("laws.residual_q", residual_q.float(), "(2, V) q of the residual cases: row 0 = p (max(0, p − q) is all 0), "
        "row 1 laws.p[2]")
    put("laws.residual_law", torch.stack([dflash2.residual_distribution(p, q) for p, q in
                                          zip(residual_p.double(), residual_q.double())]).float(),
        "(2, V) normalise(max(0, p − q)), or p where that is all 0 (row 0: the fallback, §4)")

    put_losses(put, drafter, target, batch, inp)

    prompt = torch.tensor([PROMPT])
    calls, cycles, tokens, stats, margins["greedy_trace"] = greedy_trace(drafter, target, prompt, GREEDY_NEW_TOKENS)
    put("trace.prompt", prompt[0], "(P,) prompt of the greedy spec_generate trace (also of the sampled ones)")
    put("trace.max_new_tokens", torch.tensor(GREEDY_NEW_TOKENS), "() max_new_tokens of the trace")
    put_drafting(put, "trace.", cycles)
    put_drafts(put, "trace.", cycles, B)
    calls.put(put, "trace.")
    put_verified(put, "trace.", cycles, tokens, torch.tensor(stats.acceptance_lengths))

    put("sampled.temperature", torch.tensor(SAMPLING["temperature"]), "() T of both sampled traces")
    put("sampled.top_p", torch.tensor(SAMPLING["top_p"]), "() the request's top_p")
    put("sampled.top_k", torch.tensor(SAMPLING["top_k"]), "() the request's top_k")
    put("sampled.max_new_tokens", torch.tensor(SAMPLED_NEW_TOKENS), "() max_new_tokens of both sampled traces")
    for prefix, model, seed in (("sampled.", drafter, SEED + 10), ("sampled_v1.", v1, SEED + 9)):
        out = sampled_trace(model, target, prompt, SAMPLED_NEW_TOKENS, seed=seed, **SAMPLING)
        margins[prefix + "trace"] = out[-1]
        put_sampled(put, prefix, *out[:-1], B, model.config.selector_top_k)

    calls, cycles, tokens, stats, margins["stop_trace"] = greedy_trace(drafter, target, prompt, GREEDY_NEW_TOKENS,
                                                                       STOP_TOKEN_IDS)
    if int(tokens[-1]) not in STOP_TOKEN_IDS or stats.acceptance_lengths[-1] > cycles[-1]["n_acc"]:
        raise RuntimeError(f"the stop trace should end on a stop token {STOP_TOKEN_IDS} among a cycle's accepted "
                           f"drafts, not on {tokens.tolist()} with ALs {stats.acceptance_lengths}: pick another")
    put("stop.stop_token_ids", torch.tensor(STOP_TOKEN_IDS), "(n,) stop tokens of the stop trace (the other traces "
        "have none: the target has no eos)")
    put("stop.max_new_tokens", torch.tensor(GREEDY_NEW_TOKENS), "() max_new_tokens of the stop trace")
    put_drafting(put, "stop.", cycles)
    put_drafts(put, "stop.", cycles, B)
    calls.put(put, "stop.")
    put_verified(put, "stop.", cycles, tokens, torch.tensor(stats.acceptance_lengths),
                 "; the last cycle stops right after the stop token, an accepted draft, so it commits fewer than "
                 "n_accepted + 1")

    with torch.no_grad():
        z = target(prompt).logits[0, -1].double()
    u_first, margins["short_first"] = separating_uniform(
        dflash2.sampling_probs(z, SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["top_k"]),
        torch.softmax(z / SAMPLING["temperature"], -1))
    out = sampled_trace(drafter, target, prompt, SHORT_NEW_TOKENS, seed=SHORT_SEED, u_first=u_first, **SAMPLING)
    margins["short_trace"] = out[-1]
    if len(out[1][-1]["draft"]) or len(out[1]) < 3:
        raise RuntimeError(f"the short trace's last cycle should draft n = 0 tokens after at least two cycles: "
                           f"ALs {out[3].tolist()} for {SHORT_NEW_TOKENS} tokens; pick SHORT_NEW_TOKENS anew")
    put("short.max_new_tokens", torch.tensor(SHORT_NEW_TOKENS), "() max_new_tokens of the short sampled trace (the "
        "DFlash2 drafter at sampled.*'s setting), whose last cycle has one token left: n = 0, the target call is "
        "the anchor alone, no accept test, the bonus ~ p[0]")
    put_sampled(put, "short.", *out[:-1], B, K, ", chosen where the filtered p and the plain softmax(z/T) draw "
                "different tokens: the first token comes from the filtered p")

    variants = {"drafter": drafter, "drafter_v1": v1}
    with torch.no_grad():
        h_all, h, unary, _ = blocks_forward(v1, target, inp)
    put("v1.hidden", h_all, "(b, N·B, H) the v1 drafter's output on the batch's blocks")
    put("v1.greedy_path", unary.argmax(-1), "(M, B−1) its proposal at T = 0: the unary argmax")
    margins["v1"] = min_gap(unary, 1)
    for name, off in (("conv_only", dict(selector_top_k=0)), ("selector_only", dict(conv_kernel_size=0))):
        # exported in bf16, as training exports; the weights are rounded to bf16 first, so the
        # fp32 outputs below are exactly what a port computes from the bf16 folder
        part = dflash2.DFlash2Drafter(dataclasses.replace(c, **off)).float()
        part.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()
                              if k in part.state_dict()})
        with torch.no_grad():
            h_all, h, unary, _ = blocks_forward(part, target, inp)
            path = part.propose(h, unary, anchor, 0.0)[0]
        variants[f"drafter_{name}"] = part
        put(f"variant.{name}.hidden", h_all, f"(b, N·B, H) output of drafter_{name}/ (the DFlash2 drafter with its "
            f"{'selector' if 'selector_top_k' in off else 'convolution'} off, exported in bf16 with that part as the "
            "identity), computed in fp32 from the bf16 weights")
        put(f"variant.{name}.greedy_path", path, "(M, B−1) its greedy proposal on the batch's blocks")
        margins[name] = min_gap(unary, K)

    bf16 = dflash2.DFlash2Drafter(c).to(torch.bfloat16)
    bf16.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        h_all, h, unary, _ = blocks_forward(bf16, target, inp, torch.bfloat16)
        prev = torch.cat([anchor[:, None], rec["walk.greedy_path"][:, :-1]], 1)
        scores = bf16.candidate_selector.edge_scores(h, unary, prev, rec["walk.candidates"])
    put("bf16.hidden", h_all.float(), "(b, N·B, H) the DFlash2 drafter with bf16 weights, block embeddings and "
        "context features, on the batch's blocks (stored in fp32); compare to bf16 rounding (~1e-2 relative)")
    put("bf16.unary", unary, "(M, B−1, V) lm_head(h) in fp32 of those bf16 h")
    put("bf16.edge_scores", scores, "(M, B−1, K) edge scores in fp32 from the bf16 h and the bf16 selector, on "
        "walk.candidates with the predecessors of walk.greedy_path (no decision taken in bf16)")
    return rec, meaning, margins, target, variants


def put_losses(put, drafter, target, batch, inp):
    """§6 per slot, the loss variants, the metrics, the data-parallel split and the gradients."""
    c = drafter.config
    B, b = c.block_size, batch["input_ids"].shape[0]
    anchors = batch["anchors"]
    counted, src = dflash2.block_slots(anchors, batch["anchor_valid"], batch["loss_mask"], B)
    rows = torch.arange(b)[:, None, None]
    prev = batch["input_ids"][rows, src]
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float) / dflash2.default_gamma(B)) * counted
    view, g = dflash2.target_view(c, target), inp["hidden_states"][-1][rows, src]

    def per_slot(key, selector=drafter.candidate_selector, **kw):  # slot_sums of each slot alone, weight 1
        cfg = dflash2.LossConfig(**kw)
        one = lambda i: dflash2.slot_sums(view, selector, cfg, *(x.flatten(0, 2)[i:i + 1] for x in (h, g, prev)),
                                          torch.ones(1))[key]
        return torch.stack([one(i) for i in range(counted.numel())]).view(counted.shape)
    with torch.no_grad():
        h = blocks_forward(drafter, target, inp)[0].view(b, -1, B, H)[:, :, 1:]
        kl, sel, in_c = per_slot("unary"), per_slot("selector"), per_slot("selector_weight")
        ce = per_slot("unary", None, loss_type="ce")
        sel_soft, mass = per_slot("selector", selector_labels="soft"), per_slot("selector_weight", selector_labels="soft")
    z = lambda x: x * counted
    put("loss.slots.counted", counted,
        "(b, N, B−1) slot k of block j counts: valid anchor, t = a_j + k < S, loss_mask[t] = 1")
    put("loss.slots.prev", torch.where(counted, prev, -1), "(b, N, B−1) predecessor of the selector loss: the data "
        "token x[t−1] (slot 1: the anchor); −1 where not counted")
    put("loss.slots.weight", w, "(b, N, B−1) w_k = exp(−(k−1)/γ) on counted slots, 0 elsewhere (γ = the default)")
    put("loss.slots.kl", z(kl),
        "(b, N, B−1) ℓ_kl = Σ_v p(v)(log p(v) − log q(v)), p = softmax(z[t−1]); 0 where not counted")
    put("loss.slots.ce", z(ce), "(b, N, B−1) ℓ_ce = −log q(y), y = argmax z[t−1]; 0 where not counted")
    put("loss.slots.label_in_candidates", z(in_c), "(b, N, B−1) 1[y ∈ C]: the argmax labels' mass on C")
    put("loss.slots.selector_ce", z(sel), "(b, N, B−1) −log softmax(E[k](x[t−1], C))[y] where y ∈ C, else 0")
    put("loss.slots.candidate_mass", z(mass), "(b, N, B−1) m = Σ_{c∈C} p(c)")
    put("loss.slots.selector_soft", z(sel_soft), "(b, N, B−1) ℓ_sel,soft = −Σ_{c∈C} p(c)·log softmax(E)[c]")

    plain = lambda valid=batch["anchor_valid"], rows=slice(None): dflash2.Batch(
        batch["input_ids"][rows], batch["attention_mask"][rows], batch["loss_mask"][rows], inp["ctx_features"][rows],
        inp["hidden_states"][-1][rows], anchors[rows], valid[rows])

    def loss(accept_at=(1.0, 1.0, 0), **kw):
        cfg = dflash2.LossConfig(**kw)
        value, stats, slots = dflash2.dflash2_loss(drafter, view, plain(), cfg)
        return value, {k: v.item() for k, v in stats.items()} | dflash2_metrics(drafter, view, slots, cfg, accept_at)

    cases = {"kl": ({}, "L_unary with ℓ_kl + α·L_sel with argmax labels, α = 1, γ = the default (training's default)"),
             "ce": (dict(loss_type="ce"), "ℓ_ce instead of ℓ_kl"),
             "soft": (dict(selector_labels="soft"), "soft selector labels (L_sel divided by Σ w·m)"),
             "alpha_gamma": (dict(alpha=0.5, gamma=1.5), "α = 0.5 and γ = 1.5 (not B's default)"),
             "soft_at": (dict(selector_labels="soft", soft_labels_at=SERVED),
                         f"soft selector labels from the target's law at the sampling setting (T, top_p, top_k) = "
                         f"{SERVED}: π = §4's filtered p on C")}
    for name, (kw, what) in cases.items():
        drafter.zero_grad()
        value, stats = loss(**kw)
        put(f"loss.{name}.loss", value, f"() L: {what}")
        put(f"loss.{name}.unary_loss", torch.tensor(stats["unary_loss"]), "() L_unary = Σ w·ℓ / Σ w")
        put(f"loss.{name}.selector_loss", torch.tensor(stats["selector_loss"]), "() L_sel")
        if name == "kl":
            value.backward()
            grads = {p: drafter.get_parameter(p).grad.clone() for p in GRADS}
            metrics = {k: v for k, v in stats.items() if k not in ("loss", "unary_loss", "selector_loss")}
    for key, value in metrics.items():
        put(f"metrics.{key}", torch.tensor(value, dtype=torch.float32),
            f"{key} (§6 metrics table) over the batch's counted slots")
    stats = loss(accept_at=SERVED)[1]
    for key in ("accept_unary", "accept_selector", "mass_at_k"):
        put(f"metrics_at.{key}", torch.tensor(stats[key], dtype=torch.float32),
            f"{key} with §4's p and q at the sampling setting (T, top_p, top_k) = {SERVED} (accept_at)")

    none_valid = torch.zeros_like(batch["anchor_valid"])
    value, _, slots = dflash2.dflash2_loss(drafter, view, plain(none_valid))
    stats = dflash2_metrics(drafter, view, slots)
    put("loss.empty.loss", value.detach(), "() L with every anchor invalid (no counted slot): 0 / max(0, 1e-9) = 0")
    for key in ("slot_acc", "al_unary", "accept_unary", "oracle", "al_walk"):
        put(f"loss.empty.{key}", torch.tensor(stats[key], dtype=torch.float32),
            f"{key} with no counted slot: empty counts are floored at 1, so 0 (an AL over no block is 0 too)")

    rank_sums = [dflash2.loss_sums(drafter, view, plain(rows=slice(r, r + 1)))[0] for r in range(2)]
    sums = [torch.stack([s["unary_weight"], s["selector_weight"]]) for s in rank_sums]
    mean = torch.stack(sums).mean(0)
    mean_weights = {"unary_weight": mean[0], "selector_weight": mean[1]}
    rank_losses = torch.stack([dflash2.loss_from_sums({**s, **mean_weights}, 1.0)[0].detach() for s in rank_sums])
    put("loss.data_parallel.weight_sums", torch.stack(sums), "(ranks, 2) each rank's (Σw unary, Σ w·m selector), "
        "rank r holding batch row r")
    put("loss.data_parallel.rank_losses", rank_losses, "(ranks,) each rank's L with its sums divided by the ranks' "
        "mean Σw; their mean is loss.kl.loss")
    for name, g in grads.items():
        put(f"grad.{name}", g, f"dL/d {name} of the full L = L_unary + α·L_sel of loss.kl.loss, same shape")
    drafter.zero_grad(set_to_none=True)


# -----------------------------------------------------------------------------
# writing and reading


def write_golden(out_dir, force=False, weights_from=None):
    """Write the golden set into out_dir; a non-empty out_dir needs force=True; weights_from: compute's."""
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise ValueError(f"{out_dir} is not empty: pass force=True (--force) to overwrite its golden set")
    rec, meaning, margins, target, drafters = compute(weights_from)
    close = {k: v for k, v in margins.items() if v < TIE_MARGIN}
    if close:
        raise RuntimeError(f"golden decisions within {TIE_MARGIN} of a tie {close}: a port could pick another token")
    os.makedirs(out_dir, exist_ok=True)
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    target.save_pretrained(os.path.join(out_dir, "target"))
    for name, model in drafters.items():
        dtype = torch.float32 if name in ("drafter", "drafter_v1") else torch.bfloat16
        checkpoint.save_export(model, os.path.join(out_dir, name), dtype)
    arrays = {k: v.numpy() for k, v in rec.items()}
    save_file(arrays, os.path.join(out_dir, "golden.safetensors"))
    manifest = {"format": "dflash2-golden/2", "tie_margin": TIE_MARGIN,
                "order": "tensors are listed in computation order: compare in this order, the first to differ is the bug",
                "tensors": [{"name": k, "shape": list(a.shape), "dtype": str(a.dtype), "meaning": meaning[k]}
                            for k, a in arrays.items()]}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return arrays


def read_manifest(golden_dir):
    with open(os.path.join(golden_dir, "manifest.json")) as f:
        return json.load(f)


def read_golden(golden_dir):
    """-> {name: numpy array} in the manifest's (computation) order, after checking the
    manifest names, shapes and dtypes."""
    manifest = read_manifest(golden_dir)
    arrays = load_file(os.path.join(golden_dir, "golden.safetensors"))
    listed = {e["name"]: e for e in manifest["tensors"]}
    for name in sorted(set(listed) | set(arrays)):
        if name not in arrays:
            raise ValueError(f"golden tensor {name} is in manifest.json but not in golden.safetensors")
        if name not in listed:
            raise ValueError(f"golden tensor {name} is in golden.safetensors but not in manifest.json")
        e, a = listed[name], arrays[name]
        if list(a.shape) != e["shape"] or str(a.dtype) != e["dtype"]:
            raise ValueError(f"golden tensor {name}: file has {list(a.shape)} {a.dtype}, "
                             f"manifest says {e['shape']} {e['dtype']}")
    return {name: arrays[name] for name in listed}


def main(argv=None):
    p = argparse.ArgumentParser(description="Write the DFlash2 golden tensors (ALGORITHM.md §8).")
    p.add_argument("out_dir", help="folder to write target/, the drafter folders, golden.safetensors, manifest.json into")
    p.add_argument("--force", action="store_true", help="overwrite the golden set in a non-empty folder")
    p.add_argument("--weights-from", metavar="GOLDEN_DIR", help="take the trained drafters from this golden set "
                   "instead of training them (training's fp32 rounding differs across CPUs)")
    args = p.parse_args(argv)
    try:
        write_golden(args.out_dir, force=args.force, weights_from=args.weights_from)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
