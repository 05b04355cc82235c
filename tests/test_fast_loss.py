"""Tests of harness/fast_loss.py: its top-K against a sort of the whole row, and the loss train.py runs
(train.compiled_loss: dflash2.slot_sums with that top-K, compiled) against dflash2.slot_sums itself, values and
gradients. Nothing here needs a GPU or downloads anything."""
import pytest
import torch

import dflash2
import train
from harness import fast_loss

GROUP = fast_loss.GROUP


def sorted_top(x, k):
    """The k largest values of each row, largest first: a stable sort of the whole row, not a top-K."""
    values, indices = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def rows(kind, shape, generator):
    """Logit rows whose top-k is spread over groups, packed in one group, tied, or partly -inf."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "one group":  # the whole top-k inside group 3 of every row
        x[..., 3 * GROUP:4 * GROUP] += 20
    elif kind == "ties":  # few distinct values: many groups share the maximum, the k-th value is tied
        x = torch.randint(0, 4, shape, generator=generator).double()
    elif kind == "-inf":
        x[..., ::3] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["spread", "one group", "ties", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_top_k_finds_the_largest_values_of_a_sorted_row(kind, dtype):
    """top_k's values are the first k of the row sorted, largest first, and its indices hold those values, each
    index once; with distinct values (float64 rows without ties) the indices are the sort's too. Rows of a
    (2, 3, V) tensor, V = 32 groups."""
    g = torch.Generator().manual_seed(0)
    x = rows(kind, (2, 3, 32 * GROUP), g).to(dtype)
    for k in (1, 5, 16):
        got, (want, want_idx) = fast_loss.top_k(x, k), sorted_top(x, k)
        where = f"{kind} {dtype} k={k}"
        assert torch.equal(got.values, want), f"{where}: values {got.values[0, 0].tolist()} != {want[0, 0].tolist()}"
        assert torch.equal(x.gather(-1, got.indices), want), f"{where}: the indices do not hold the values"
        assert (got.indices.sort(-1).values.diff(dim=-1) > 0).all(), f"{where}: an index picked twice"
        distinct = dtype == torch.float64 and kind in ("spread", "one group")
        assert not distinct or torch.equal(got.indices, want_idx), f"{where}: indices differ from the sort's"


@pytest.mark.parametrize("V, k", [(1000, 4), (2 * GROUP, 2), (16 * GROUP, 32)],
                         ids=["V not a multiple of GROUP", "k groups >= V", "more candidates than groups"])
def test_top_k_is_torch_topk_where_groups_do_not_pay(V, k):
    """A vocabulary GROUP does not divide, or k groups covering it, take torch.topk itself; so does a K larger than
    the V / GROUP groups (K = 32 at V = 2048), where a top-K of the group maxima has too few to pick from."""
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, want = fast_loss.top_k(x, k), torch.topk(x, k)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices), f"V={V} k={k}"


@pytest.mark.parametrize("shape, dim", [((4 * GROUP, 3, 4 * GROUP), 0), ((4 * GROUP, 3, 4 * GROUP), -3),
                                         ((4 * GROUP, 3, 4 * GROUP), 1), ((3, 4 * GROUP), 0)],
                         ids=["dim 0", "dim -3", "dim 1 of length 3", "dim 0 of length 3"])
def test_top_k_along_another_dimension_is_torch_topks(shape, dim):
    """A dim other than the last selects along that dim, as torch.topk does: values and indices both, the same
    shape, whatever the last dimension's length (V = 4 groups there, or that of the dim asked)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got, want = fast_loss.top_k(x, 2, dim), torch.topk(x, 2, dim)
    assert got.values.shape == want.values.shape, f"dim={dim}: shape {tuple(got.values.shape)}, torch.topk's " \
        f"{tuple(want.values.shape)}"
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices), \
        f"dim={dim}: values off torch.topk's by {(got.values - want.values).abs().max():.3g}"


def selector_inputs(generator, n=12, H=32, V=32 * GROUP, dtype=torch.float64):
    """A selector (K = 16) over V = 32 groups, the logits view of a random lm_head, and n slots' h, g, prev, w."""
    c = dflash2.DFlash2Config(hidden_size=H, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                              vocab_size=V, num_target_layers=4, target_layer_ids=[1], mask_token_id=V - 1,
                              selector_rank=8)
    torch.manual_seed(0)
    selector = dflash2.CandidateSelector(c).to(dtype)
    for p in selector.parameters():
        torch.nn.init.normal_(p, std=0.3)
    lm_head = torch.randn(V, H, generator=generator, dtype=dtype)
    view = dflash2.TargetView(torch.randn(V, H, generator=generator, dtype=dtype), None, lambda x: x @ lm_head.T)
    h = torch.randn(n, H, generator=generator, dtype=dtype)
    g = h + torch.randn(n, H, generator=generator, dtype=dtype)  # near h: labels among the candidates in some slots
    return selector, view, h, g, torch.randint(0, V, (n,), generator=generator), torch.rand(n, generator=generator,
                                                                                             dtype=dtype)


def sums_and_grads(fn, selector, view, cfg, h, g, prev, w):
    h = h.clone().requires_grad_()
    sums = fn(view, selector, cfg, h, g, prev, w)
    total = sum(v for v in sums.values() if v.requires_grad)
    grads = torch.autograd.grad(total, [h, *selector.parameters()])
    return {k: v.item() for k, v in sums.items()}, grads


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # torch's own, inductor imports it
@pytest.mark.parametrize("labels", ["argmax", "soft"])
def test_the_loss_train_py_runs_equals_the_formula(labels):
    """fast_loss.slot_sums (float64, eager) and train.compiled_loss (float32, compiled as train.py runs it) against
    dflash2.slot_sums with torch.topk: the same sums, and the same gradients in h and the selector's weights
    (float64 to 1e-12, compiled float32 to 1e-5 of their scale)."""
    cfg = dflash2.LossConfig(selector_labels=labels)
    compiled = train.compiled_loss(torch.device("cpu"), lambda line: None)
    for fn, dtype, tol in ((fast_loss.slot_sums, torch.float64, 1e-12), (compiled, torch.float32, 1e-5)):
        selector, *inputs = selector_inputs(torch.Generator().manual_seed(2), dtype=dtype)
        (got, got_grads), (want, want_grads) = (sums_and_grads(f, selector, inputs[0], cfg, *inputs[1:])
                                                for f in (fn, dflash2.slot_sums))
        where = f"{labels} labels, {dtype}"
        assert want["selector_weight"] > 0, f"{where}: no label among the candidates, nothing compared"
        assert set(got) == set(want), f"{where}: sums {sorted(got)} != {sorted(want)}"
        for key, value in want.items():
            assert abs(got[key] - value) <= tol * (1 + abs(value)), f"{where}: {key} {got[key]} != formula's {value}"
        for a, b in zip(got_grads, want_grads):
            assert (a - b).abs().max() <= tol * (1 + b.abs().max()), \
                f"{where}: a gradient differs by {(a - b).abs().max():.3g}"


def test_with_tied_bf16_logits_the_candidates_hold_the_same_values_and_untied_slots_the_same_sums():
    """Logits of bf16 resolution, as train.py's bf16 step reads them (lm_head in bf16, upcast after): ties at the
    K-th place are common. Slot by slot, fast_loss.slot_sums against dflash2.slot_sums with torch.topk: the
    candidates' logits are the K largest of the row (a valid top-K: the same values, each index once) in every slot,
    and in each slot where no tie crosses the K-th place (the K-th and (K+1)-th largest differ) every sum is the
    same, to 1e-6: ties inside the top-K may order the candidates otherwise, and the selector scores them in
    float32."""
    K, n = 16, 64
    selector, view, h, g, prev, w = selector_inputs(torch.Generator().manual_seed(3), n=n)
    logits = view.logits
    view = dflash2.TargetView(view.W_in, None, lambda x: logits(x * 4).to(torch.bfloat16).double())
    U = view.logits(h)
    top = U.sort(-1, descending=True).values[:, :K + 1]
    crossing = top[:, K - 1] == top[:, K]
    assert 0 < int(crossing.sum()) < n, f"{int(crossing.sum())} of {n} slots tie at the K-th place: widen the test"
    got_C, want_C = fast_loss.top_k(U, K).indices, torch.topk(U, K).indices
    assert torch.equal(U.gather(-1, got_C).sort(-1).values, U.gather(-1, want_C).sort(-1).values), \
        "the candidates' logits are not the K largest"
    assert (got_C.sort(-1).values.diff(dim=-1) > 0).all(), "a candidate picked twice"
    cfg = dflash2.LossConfig(selector_labels="soft")
    for i in (~crossing).nonzero()[:, 0].tolist():
        one = (h[i:i + 1], g[i:i + 1], prev[i:i + 1], w[i:i + 1])
        got, want = (fn(view, selector, cfg, *one) for fn in (fast_loss.slot_sums, dflash2.slot_sums))
        for key, value in want.items():
            assert abs(got[key].item() - value.item()) <= 1e-6 * (1 + abs(value.item())), \
                f"slot {i}, no tie at the K-th place: {key} {got[key].item()} != the formula's {value.item()}"
