"""
The §6 metrics of a training batch (ALGORITHM.md §6), from the drafter outputs the loss's own forward
produced (dflash2.dflash2_loss's Slots): no second drafter pass. train.py logs them every logging step
and at evaluation.
"""
import torch
import torch.nn.functional as F

import dflash2


def expected_acceptance_length(correct):
    """correct (..., B-1) bool per slot -> 1 + number of leading correct slots (bonus counted)."""
    return 1 + correct.long().cumprod(-1).sum(-1).float()


def metric_hits(drafter, view, h, g, prev, accept_at):
    """h / g (M, B-1, H), prev (M, B-1) for M blocks -> (M, B-1) per metric (§6): bool, unary argmax, label in
    the top-K (oracle), teacher-forced pick (tf) and walk right; float at accept_at = (T, top_p, top_k): Σ min(p, q),
    the chance rejection sampling keeps the unary / selector draft (§4), and the target's mass on the top-K."""
    U, z = view.logits(h), view.logits(g)
    y, p = z.argmax(-1), dflash2.sampling_probs(z, *accept_at)
    hits = {"unary": U.argmax(-1) == y, "accept_unary": torch.minimum(p, dflash2.sampling_probs(U, *accept_at)).sum(-1)}
    sel = drafter.candidate_selector
    if sel is not None:
        cand = U.topk(sel.top_k, dim=-1).indices
        E, p_cand = sel.edge_scores(h, U, prev, cand, view.W_in), p.gather(-1, cand)
        tf_pick = cand.gather(-1, E.argmax(-1, keepdim=True)).squeeze(-1)
        hits.update(oracle=(cand == y[..., None]).any(-1), tf=tf_pick == y,
                    walk=sel.walk(h, U, prev[:, 0], W_in=view.W_in)[0] == y, mass_at_k=p_cand.sum(-1),
                    accept_selector=torch.minimum(p_cand, F.softmax(E / accept_at[0], -1).to(p.dtype)).sum(-1))
    return hits


@torch.no_grad()
def dflash2_metrics(drafter, view, slots, cfg=None):
    """The §6 metrics of the slots dflash2_loss returned, as floats, at cfg.accept_at (None: T = 1, no filter), a
    chunk of whole blocks at a time (the walk runs along a block); an uncounted slot ends an acceptance run."""
    cfg, counted = cfg or dflash2.LossConfig(), slots.counted
    flat = [x.detach().flatten(0, 1) for x in (slots.h, slots.g, slots.prev)]
    M = len(flat[0])
    size = M if cfg.chunk_size is None else max(1, cfg.chunk_size // counted.shape[-1])
    parts = [metric_hits(drafter, view, *(x[i:i + size] for x in flat), cfg.accept_at or (1.0, 1.0, 0))
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
