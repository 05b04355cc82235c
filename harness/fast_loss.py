"""
The §6 loss as train.py runs it: dflash2.slot_sums with a cheaper exact top-K. Not here: the formula itself
(dflash2.slot_sums), its compilation (train.compiled_loss), the loss's chunking (dflash2.loss_sums).

torch.topk over a (slots, V) tensor selects along each whole row; top_k finds the same values with a max pass over
groups of 128 columns, a top-K of the V / 128 group maxima and one of the k · 128 columns of the best k groups: at
SmolLM2's V = 49,152 a third of torch.topk's time (bench/RESULTS.md, the training step). A vocabulary of at most
k · 128 (train.py's tiny world: V = 2048, K = 16) takes torch.topk itself.
"""
from collections import namedtuple

import torch

import dflash2

TopK = namedtuple("TopK", "values indices")
GROUP = 128  # columns a group: V / GROUP group maxima for the first top-K, k · GROUP columns for the second


def top_k(x, k, dim=-1):
    """torch.topk(x, k, dim)'s values, largest first, and indices holding them (x finite or -inf; among equal values
    another index may be picked): the k groups of GROUP columns with the largest maxima hold a top-k of x (a group
    holding one of its values has a maximum at least that value, and fewer than k groups have a larger one), so the
    top-k of their k · GROUP columns is x's. torch.topk itself where GROUP does not divide the last dimension V, or
    k · GROUP >= V."""
    V = x.shape[dim]
    if dim not in (-1, x.dim() - 1) or V % GROUP or k * GROUP >= V:
        return TopK(*torch.topk(x, k, dim))
    groups = x.unflatten(-1, (V // GROUP, GROUP))                                 # (..., V / GROUP, GROUP)
    best = groups.amax(-1).topk(k, -1).indices                                    # (..., k) groups
    columns = (best[..., None] * GROUP + torch.arange(GROUP, device=x.device)).flatten(-2)  # (..., k · GROUP)
    values, j = x.gather(-1, columns).topk(k, -1)
    return TopK(values, columns.gather(-1, j))


def slot_sums(view, selector, cfg, h, g, prev, w):
    """dflash2.slot_sums with this module's top_k. The unary sum is the same; the candidates C hold the same logits,
    but where several logits tie at the K-th place (common in bf16) C may hold another of them than torch.topk's
    (whose choice among ties is unspecified too), and the selector's sums follow C. Where no tie crosses the K-th
    place, every sum and gradient is the same."""
    return dflash2.slot_sums(view, selector, cfg, h, g, prev, w, topk_fn=top_k)
