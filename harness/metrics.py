"""
The §6 metrics of a training batch (ALGORITHM.md §6), from the drafter outputs the loss's own forward
produced (dflash2.dflash2_loss's Slots): no second drafter pass. train.py logs them every logging step
(step_stats), evaluate logs them on the validation rows, and at the end of a run decoding_eval measures
real speculative decoding. Not here: the loss (dflash2.py), where the record of a run is written
(harness/checkpoint.py).
"""
import time

import torch
import torch.nn.functional as F

import dflash2
from harness.data import anchor_seed, collate, row_anchors
from harness.target import below_float32, decoding_dtype, decoding_view, target_features


def expected_acceptance_length(correct):
    """correct (..., B-1) bool per slot -> 1 + number of leading correct slots (bonus counted)."""
    return 1 + correct.long().cumprod(-1).sum(-1).float()


def metric_hits(drafter, view, h, g, prev, accept_at):
    """h / g (M, B-1, H), prev (M, B-1) for M blocks -> (M, B-1) per metric (§6): bool, unary argmax, label in
    the top-K (oracle), teacher-forced pick (tf) and walk right; float at accept_at = (T, top_p, top_k): Σ min(p, q),
    the chance rejection sampling keeps the unary / selector draft (§4), and the target's mass on the top-K."""
    U, z = view.logits(h), view.logits(g)
    argmax = lambda x: x.max(-1).indices  # argmax's index (the first on ties), cheaper than argmax on a CPU
    y, p = argmax(z), dflash2.sampling_probs(z, *accept_at)
    hits = {"unary": argmax(U) == y, "accept_unary": torch.minimum(p, dflash2.sampling_probs(U, *accept_at)).sum(-1)}
    sel = drafter.candidate_selector
    if sel is not None:
        path, cand, _ = sel.walk(h, U, prev[:, 0], W_in=view.W_in)  # cand: U's top-K, the candidates of every metric
        E, p_cand = sel.edge_scores(h, U, prev, cand, view.W_in), p.gather(-1, cand)
        tf_pick = cand.gather(-1, E.argmax(-1, keepdim=True)).squeeze(-1)
        hits.update(oracle=(cand == y[..., None]).any(-1), tf=tf_pick == y, walk=path == y, mass_at_k=p_cand.sum(-1),
                    accept_selector=torch.minimum(p_cand, F.softmax(E / accept_at[0], -1).to(p.dtype)).sum(-1))
    return hits


@torch.no_grad()
def dflash2_metrics(drafter, view, slots, cfg=None, accept_at=(1.0, 1.0, 0)):
    """The §6 metrics of the slots dflash2_loss returned (cfg: its LossConfig, for the chunk size), as floats, the
    acceptance metrics at the sampling setting accept_at = (T, top_p, top_k), a chunk of whole blocks at a time (the
    walk runs along a block); an uncounted slot ends an acceptance run."""
    dflash2.check_law_setting("accept_at", accept_at)
    cfg, counted = cfg or dflash2.LossConfig(), slots.counted
    flat = [x.detach().flatten(0, 1) for x in (slots.h, slots.g, slots.prev)]
    M = len(flat[0])
    size = M if cfg.chunk_size is None else max(1, cfg.chunk_size // counted.shape[-1])
    parts = [metric_hits(drafter, view, *(x[i:i + size] for x in flat), accept_at)
             for i in range(0, M, size)]
    hit = {k: torch.cat([p[k] for p in parts]).view_as(counted) for k in parts[0]}
    blocks, n_blocks = counted[..., 0], counted[..., 0].sum().clamp(min=1)
    per_slot = lambda hit, among: ((hit & among).sum((0, 1)) / among.sum((0, 1)).clamp(min=1)).tolist()
    overall = lambda hit: ((hit * counted).sum() / counted.sum().clamp(min=1)).item()
    mean_al = lambda hit: (expected_acceptance_length(hit & counted)[blocks].sum() / n_blocks).item()
    m = {"slot_acc": per_slot(hit["unary"], counted), "al_unary": mean_al(hit["unary"]),
         "accept_unary": overall(hit["accept_unary"])}
    if "walk" in hit:
        run = (hit["walk"] & counted).long().cumprod(-1).bool()
        reached = counted & torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], -1)  # prefix all right
        m.update(oracle=overall(hit["oracle"]), selector_tf_acc=overall(hit["tf"]),
                 walk_slot_acc=per_slot(hit["walk"], reached),
                 al_walk=mean_al(hit["walk"]), al_oracle=mean_al(hit["oracle"]),
                 accept_selector=overall(hit["accept_selector"]), mass_at_k=overall(hit["mass_at_k"]))
    return m


@torch.no_grad()
def decoding_eval(drafter, target, tokenizer, prompts, max_new_tokens, seed, log=print, draft_tokens=None):
    """spec_generate on each prompt (1, P) at T = 0 and T = 1, verifying draft_tokens drafts a cycle (None: B − 1),
    the target in decoding_dtype (and back after: bf16 -> float32 -> bf16 is exact), logged as a table.
    -> {T: (mean AL, mean tokens/s, the first output's text)}."""
    trained_in, device = target.dtype, prompts[0].device
    target.to(decoding_dtype(device, trained_in))
    generator, view, table = torch.Generator(device).manual_seed(seed), decoding_view(drafter.config, target), {}
    for temperature in (0.0, 1.0):
        als, tps, texts, t0 = [], [], [], time.time()
        for ids in prompts:
            new, s = dflash2.spec_generate(drafter, target, ids, max_new_tokens, temperature, generator=generator,
                                           stop_token_ids=[tokenizer.eos_token_id], view=view,
                                           draft_tokens=draft_tokens)
            als.append(s.mean_acceptance_length)
            tps.append(s.tokens_per_second)
            texts.append(tokenizer.decode(new))
        table[temperature] = (sum(als) / len(als), sum(tps) / len(tps), texts[0])
        log(f"eval | spec_generate at T = {temperature}: {len(als)} prompts in {time.time() - t0:.0f}s, "
            f"target in {str(target.dtype).removeprefix('torch.')}")
    target.to(trained_in)
    log(f"eval | spec_generate, {len(prompts)} held-out prompts, <= {max_new_tokens} new tokens")
    log("eval |   temperature   mean AL   tokens/s   start of the first output")
    for temperature, (al, tok_s, text) in table.items():
        log(f"eval |   {temperature:>11.1f}   {al:>7.2f}   {tok_s:>8.1f}   {text[:40]!r}")
    return table


# -----------------------------------------------------------------------------
# a batch's stats, the evaluation of a run


def step_stats(drafter, view, target, slots, cfg, terms, accept_at=(1.0, 1.0, 0)):
    """A logged batch's stats, floats: the loss terms and the §6 metrics of the loss's own slots (host syncs), the
    acceptance metrics at accept_at."""
    with below_float32(target):
        return {k: v.item() for k, v in terms.items()} | dflash2_metrics(drafter, view, slots, cfg, accept_at)


def mean_stats(all_stats):
    """Average a list of step_stats dicts (floats and per-slot lists)."""
    mean = lambda col: [sum(x) / len(x) for x in zip(*col)] if isinstance(col[0], list) else sum(col) / len(col)
    return {k: mean([s[k] for s in all_stats]) for k in all_stats[0]}


@torch.no_grad()
def evaluate(drafter, target, tokenizer, val, cfg, batch_size, max_anchors, seed, log=print, prompts=0,
             max_new_tokens=96, draft_tokens=None):
    """The validation rows' loss (cfg: the run's dflash2.LossConfig) and §6 metrics, logged, each row's anchors drawn
    from -1 - anchor_seed(seed, i), never a training row's seed; then decoding_eval (draft_tokens: its drafts a
    cycle) on the first `prompts` rows' prompts (all before the first answer token). -> {val: stats, al_t0 and
    al_t1 when it decoded}."""
    seeds = [-1 - anchor_seed(seed, i) for i in range(len(val))]
    c, stats, b = drafter.config, [], batch_size
    view = dflash2.target_view(c, target)
    for i in range(0, len(val), b):
        ids, attn, loss_mask = collate(val[i:i + b], tokenizer.pad_token_id, target.device)
        batch = dflash2.Batch(ids, attn, loss_mask, *target_features(target, ids, attn, c.target_layer_ids),
                              *row_anchors(loss_mask, max_anchors, seeds[i:i + b]))
        with below_float32(target):
            _, terms, slots = dflash2.dflash2_loss(drafter, view, batch, cfg)
        stats.append(step_stats(drafter, view, target, slots, cfg, terms))
    s = mean_stats(stats)
    sel = lambda k: f"{s[k]:.3f}" if k in s else "-"
    log(f"eval | val loss {s['loss']:.4f} unary {s['unary_loss']:.4f} sel {sel('selector_loss')} | "
        f"oracle (label in top-K) {sel('oracle')} selector tf-acc {sel('selector_tf_acc')} | expected AL unary "
        f"{s['al_unary']:.2f} walk {sel('al_walk')} oracle {sel('al_oracle')} | T=1 acceptance unary "
        f"{s['accept_unary']:.3f} selector {sel('accept_selector')} (top-K mass {sel('mass_at_k')})")
    log("eval | slot accuracy " + " ".join(f"{a:.2f}" for a in s["slot_acc"]))
    if not prompts:
        return {"val": s}
    ids = [row["input_ids"][None, :int(row["loss_mask"].nonzero()[0]) or len(row["input_ids"]) // 2]
           for row in val.select(range(min(prompts, len(val))))]
    table = decoding_eval(drafter, target, tokenizer, [i.to(target.device) for i in ids], max_new_tokens, seed, log,
                          draft_tokens)
    return {"val": s, "al_t0": table[0.0][0], "al_t1": table[1.0][0]}
