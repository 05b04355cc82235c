"""Tests on a CUDA GPU (skipped without one), where the algorithm runs at scale: greedy
spec_generate equals the target's own greedy decoding token for token in fp32, speculative
sampling follows the target's exact law (chi-square, and the same test rejects a wrong q),
the loss under bf16 autocast stays close to fp32 with finite gradients, and train.py takes
a step on the GPU. The autocast test runs on the CPU as well (bf16 autocast exists there
too), so that a machine without CUDA still checks it. Tiny random models, nothing downloaded.
"""
import itertools
import json
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash2
from harness import checkpoint, memory
from conftest import chi_square_pvalue, replace_q, tiny_qwen3
from tests.conftest import tiny_drafter
from harness.target import drafter_config

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fp32_matmuls():
    """fp32 matmuls really in fp32 (no TF32), as the greedy comparison needs."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


# -----------------------------------------------------------------------------
# greedy: token for token


def force_drafts(monkeypatch, drafter, reference, n_right):
    """Make the drafter propose reference's tokens (prompt and greedy continuation) for the
    first n_right[c % len(n_right)] slots of cycle c and wrong tokens after them; the
    anchor's position is read off the block positions of the drafter's forward call."""
    positions, forward, propose = [], drafter.forward, drafter.propose
    B, V = drafter.config.block_size, drafter.config.vocab_size

    def recorded(block_embeds, block_pos, *args, **kwargs):
        positions.append(int(block_pos[0, 0]))
        return forward(block_embeds, block_pos, *args, **kwargs)

    def forced(h, unary, anchor, temperature=0.0, generator=None, **filters):
        path, cand, q = propose(h, unary, anchor, temperature, generator, **filters)
        a, j = positions[-1], n_right[(len(positions) - 1) % len(n_right)]
        right = torch.cat([reference[a + 1:a + B], torch.zeros(B, dtype=torch.long)])[:B - 1]  # past the end: unused
        return torch.cat([right[:j], (right[j:] + 1) % V])[None].to(path.device), cand, q
    monkeypatch.setattr(drafter, "forward", recorded)
    monkeypatch.setattr(drafter, "propose", forced)


@CUDA
@pytest.mark.parametrize("parts", [{}, dict(conv_kernel_size=0, selector_top_k=0)], ids=["DFlash2", "DFlash"])
def test_greedy_spec_generate_equals_target_on_cuda(fp32_matmuls, monkeypatch, parts):
    """The drafter's own proposals (a random drafter: mostly rejected), then drafts forced
    right for 2, 0, 4, 1, 3 slots of successive cycles, so that every acceptance length and
    every cache crop runs on the GPU."""
    target = tiny_qwen3(vocab_size=64, hidden_size=32, num_layers=2, dtype=torch.float32, lm_head_scale=4.0).cuda()
    drafter = tiny_drafter(target, dtype=torch.float32, **{**dict(block_size=5, target_layer_ids=[0, 1],
                                                                  selector_top_k=6), **parts}).cuda()
    g = torch.Generator().manual_seed(0)
    for n in (3, 8, 13):
        prompt = torch.randint(0, 63, (1, n), generator=g).cuda()
        plain, _ = dflash2.target_generate(target, prompt, 40)
        for forced in (False, True):
            with monkeypatch.context() as m:
                if forced:
                    force_drafts(m, drafter, torch.cat([prompt[0].cpu(), plain.cpu()]), [2, 0, 4, 1, 3])
                spec, stats = dflash2.spec_generate(drafter, target, prompt, 40)
            differ = (spec.cpu() != plain.cpu()).nonzero() if spec.shape == plain.shape else torch.zeros(1, 1)
            assert spec.shape == plain.shape and not len(differ), \
                f"prompt of {n}, forced {forced}: spec_generate {spec.tolist()} vs target {plain.tolist()}, first " \
                f"difference at {differ[0].item()}"
            if forced:
                assert stats.mean_acceptance_length > 2.5, \
                    f"forced drafts were accepted too little: acceptance lengths {stats.acceptance_lengths}"


# -----------------------------------------------------------------------------
# sampling: the target's law (chi-square over the first 3 tokens)

LOOP_V, LOOP_PROMPT, LOOP_RUNS = 8, (1, 2, 3), 200


@pytest.fixture(scope="module")
def loop_models():
    """V = 8 peaked fp32 target on the GPU; drafter with B = 4 and K = 4 < V candidates, q
    strongly predecessor-conditioned, flat enough unary logits that drafts are often accepted."""
    target = tiny_qwen3(vocab_size=LOOP_V, hidden_size=16, num_layers=1, seed=2, lm_head_scale=20.0,
                        dtype=torch.float32)
    drafter = tiny_drafter(target, seed=3, block_size=4, selector_top_k=4, conv_kernel_size=0, dtype=torch.float32)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    return target.cuda(), drafter.cuda()


@torch.no_grad()
def exact_joint3(target, temperature, top_p, top_k):
    """p(x1) p(x2|x1) p(x3|x1,x2) after the prompt, (V, V, V), from one batched forward."""
    V = LOOP_V
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
    ids = torch.cat([torch.tensor([LOOP_PROMPT]).expand(len(pairs), -1), pairs], 1).cuda()
    p = dflash2.sampling_probs(target(ids).logits[:, -3:].double().cpu(), temperature, top_p, top_k)  # (V^2, 3, V)
    x1, x2 = pairs[:, 0], pairs[:, 1]
    rows = torch.arange(len(pairs))
    return ((p[rows, 0, x1] * p[rows, 1, x2])[:, None] * p[:, 2]).view(V, V, V)


@CUDA
@pytest.mark.parametrize("temperature, top_p, top_k, q_kind", [
    (0.7, 1.0, 0, "walk"), (1.0, 1.0, 0, "walk"), (1.0, 0.9, 5, "walk"), (1.0, 1.0, 0, "unary top-K")])
def test_spec_generate_samples_the_target_law_on_cuda(monkeypatch, loop_models, temperature, top_p, top_k, q_kind):
    """max_new_tokens = 4 with B = 4: the 2nd and 3rd tokens come from slot-1 and slot-2
    drafts, residuals, bonuses or a following cycle. "unary top-K" verifies with the unary
    softmax over the candidates instead of the walk's q: the same test must reject it."""
    target, drafter = loop_models
    if q_kind == "unary top-K":
        replace_q(monkeypatch, drafter, lambda unary, cand, T: torch.softmax(unary.gather(-1, cand) / T, -1))
    g, counts, first_cycle = torch.Generator("cuda").manual_seed(0), np.zeros((LOOP_V,) * 3), []
    prompt = torch.tensor([LOOP_PROMPT]).cuda()
    for _ in range(LOOP_RUNS):
        out, stats = dflash2.spec_generate(drafter, target, prompt, 4, temperature, top_p, top_k, generator=g)
        counts[tuple(out[:3].tolist())] += 1
        first_cycle.append(stats.acceptance_lengths[0])
    al = np.bincount(first_cycle, minlength=4)[1:]
    assert al[0] and al[1] and al[2], f"first-cycle acceptance lengths 1/2/3 seen {al.tolist()} times: some branch is never exercised"
    pvalue = chi_square_pvalue(counts, exact_joint3(target, temperature, top_p, top_k).numpy(), q_kind)
    if q_kind == "walk":
        assert pvalue > 1e-6, f"joint of the first 3 tokens departs from the target's exact joint: p = {pvalue:.3g}"
    else:
        assert pvalue < 1e-6, f"verifying with the unary top-K q went undetected: p = {pvalue:.3g}"


# -----------------------------------------------------------------------------
# the loss under bf16 autocast


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_loss_under_bf16_autocast_is_close_to_fp32(device):
    """Same weights and blocks: the loss under bf16 autocast within 5% of fp32, chunked equal
    to unchunked under autocast too, gradients finite and pointing the same way, and the
    selector's edge scores still fp32 inside autocast."""
    target = tiny_qwen3(vocab_size=1024, hidden_size=64, num_layers=4, head_dim=16, dtype=torch.float32).to(device)
    torch.manual_seed(0)
    c = drafter_config(target.config, num_layers=2, block_size=8, selector_rank=16, mask_token_id=1023)
    drafter = dflash2.DFlash2Drafter(c).to(device)
    with torch.no_grad():
        for p in drafter.parameters():  # off the identity init, so the DFlash2 parts carry gradient
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1023, (2, 128), generator=g).to(device)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    context, last = dflash2.context_features(hidden, drafter.config.target_layer_ids), hidden[-1]
    batch = dflash2.Batch(ids, ones, ones, context, last, *(x.to(device) for x in dflash2.sample_anchors(ones, 16, g)))
    view = dflash2.target_view(c, target)

    def run(amp, chunk):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
            loss = dflash2.dflash2_loss(drafter, view, batch, dflash2.LossConfig(chunk_size=chunk))[0]
            h = torch.randn(3, c.hidden_size, device=device)
            cand = torch.randint(0, c.vocab_size, (3, 4), device=device)
            scores = drafter.candidate_selector.edge_scores(h, torch.randn(3, c.vocab_size, device=device),
                                                            cand[:, 0], cand)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])
        return loss.item(), scores.dtype, grads
    (fp32, _, g32), (amp, score_dtype, g16), (chunked, _, _) = run(False, None), run(True, None), run(True, 37)
    assert abs(amp - fp32) / abs(fp32) < 0.05, f"autocast loss {amp:.5f} vs fp32 {fp32:.5f}"
    assert abs(chunked - amp) / abs(amp) < 1e-2, f"chunked {chunked:.5f} vs unchunked {amp:.5f} under autocast"
    assert score_dtype == torch.float32, f"edge scores came out {score_dtype} under autocast"
    assert torch.isfinite(g32).all() and torch.isfinite(g16).all(), "non-finite gradients"
    cosine = torch.nn.functional.cosine_similarity(g32.double(), g16.double(), dim=0).item()
    assert cosine > 0.95, f"autocast gradients point elsewhere than fp32's: cosine {cosine:.4f}"


# -----------------------------------------------------------------------------
# train.py on the GPU


@CUDA
@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_train_takes_steps_on_cuda(tmp_path, capsys, monkeypatch, grad_checkpoint):
    """Two steps of train.py on the GPU, plain and recomputing each draft layer (which train.py does when the
    memory plan says only that fits; forced here)."""
    from harness import tiny_world
    import train
    tokenizer = tiny_world.build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    convs = tiny_world.stdlib_conversations(chunk_chars=120)[:24]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    flags = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.jsonl"), "--out-dir",
             str(tmp_path / "out"), "--seq-len", "192", "--batch-size", "2", "--max-anchors", "6", "--val-size", "4",
             "--drafter-config", '{"selector_rank": 8}', "--steps", "2", "--decode-prompts", "1"]
    monkeypatch.setattr(memory, "fitting_plan", lambda *a: grad_checkpoint)
    summary = train.train(train.parse_args(flags))
    assert "1 rank(s) on cuda" in capsys.readouterr().out, "train.py did not run on the GPU"
    assert len(summary["losses"]) == 2 and all(math.isfinite(l) for l in summary["losses"].values()), summary["losses"]
    assert summary["al_t0"] >= 1 and summary["al_t1"] >= 1, summary
    drafter = checkpoint.load_export(tmp_path / "out" / "checkpoint")
    assert all(torch.isfinite(p).all() for p in drafter.parameters()), "the export holds non-finite weights"
