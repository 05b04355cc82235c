"""Tests of harness/memory.py (the plan `python -m harness.memory` prints) and of the memory the loss
allocates: the plan against peak memory measured in a subprocess by bench/cost.py's memory
table (CPU, scaled-down shapes, ±20%), the chunked loss never building a (slots, V) tensor,
the flags the plan reads (memory.py's and train.py's GPU check alike), and bad input. Nothing
here needs a GPU or downloads anything.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dflash2
from harness import memory
import train
from harness.target import drafter_config, load_config, model_class
from bench import cost
from bench.common import QWEN3_4B, QWEN3_8B, qwen3_config, random_target


pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_matches_measured_peak(tmp_path):
    """Peak RSS of two training steps in a fresh process, against the plan (fp32 on CPU):
    chunked and unchunked loss at two anchor counts, and grad checkpointing."""
    png = tmp_path / "memory.png"
    table = cost.memory_table(anchors=(64, 256), vocab=16384, hidden=64, seq_len=512, loss_chunk=64)
    rows = table["rows"]
    cost.plot_memory_table(table, png)
    assert png.stat().st_size > 0, "plot_memory_table wrote no plot"
    report = cost.markdown({"memory": table})
    assert f"| 256 | {rows[1]['chunked_mib']:.0f} ({rows[1]['chunked_plan_mib']:.0f}) |" in report, report
    target = dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=16384)
    drafter = dict(num_layers=2, block_size=4, selector_rank=32, conv_group_size=16)
    spec = cost.peak_spec(target, drafter, 512, 256, loss_chunk=64, grad_checkpoint=True)
    measured = cost.measure_peaks([spec])[0]["peak"]
    plan = memory.memory_plan(qwen3_config(**target), 512, 256, loss_chunk=64, grad_checkpoint=True, amp=False,
                              target_bytes=4, **drafter)["peak"]
    pairs = [(f"{n} anchors {name}", r[f"{name}_plan_mib"], r[f"{name}_mib"])
             for r in rows for n in [r["anchors"]] for name in ("chunked", "unchunked")]
    pairs.append(("256 anchors, grad checkpoint", plan / 2 ** 20, measured / 2 ** 20))
    for what, planned, got in pairs:
        assert 0.8 < planned / got < 1.2, f"{what}: plan {planned:.1f} MiB vs measured {got:.1f} MiB"
    growth = {name: rows[1][f"{name}_mib"] - rows[0][f"{name}_mib"] for name in ("chunked", "unchunked")}
    assert growth["unchunked"] > 2 * growth["chunked"], f"64 -> 256 anchors grew the peak by {growth} MiB"


class LargestVocabTensor(TorchDispatchMode):
    """Every op's outputs, forward and backward: the most elements of any new tensor (views
    of lm_head's weight are not) whose last dimension is the vocabulary."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storages = lambda x: {t.untyped_storage().data_ptr() for t in tree_leaves(x) if isinstance(t, torch.Tensor)}
        seen = storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_loss_holds_at_most_a_chunk_of_logits():
    """With chunk_size c, no tensor of the loss's forward or backward spans more than c
    slots of the vocabulary (the target's logits included); without chunks, all do."""
    V = 512
    target = random_target(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=V)
    c = memory.sizing_config(target.config, num_layers=1, block_size=4, selector_rank=8, conv_group_size=8,
                              mask_token_id=V - 1)
    drafter = dflash2.DFlash2Drafter(c)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (2, 64), generator=g)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    context, last = dflash2.context_features(hidden, c.target_layer_ids), hidden[-1]
    batch = dflash2.Batch(ids, ones, ones, context, last, *dflash2.sample_anchors(ones, 20, g))
    view, slots = dflash2.target_view(c, target), 2 * 20 * (c.block_size - 1)
    for chunk, most in ((5, 5), (None, slots)):
        with LargestVocabTensor(V) as seen:
            loss, _, _ = dflash2.dflash2_loss(drafter, view, batch, dflash2.LossConfig(chunk_size=chunk))
            loss.backward()
        assert seen.largest == most * V, \
            f"chunk_size {chunk}: largest vocabulary-wide tensor has {seen.largest // V} slots, want {most}"


def test_plan_at_qwen3_4b_shape_and_bad_input(tmp_path):
    config = qwen3_config(**QWEN3_4B)
    plan = lambda **kw: memory.memory_plan(config, 3072, **{"max_anchors": 512, "block_size": 16, **kw})
    base = plan()
    n_target, n_drafter = base["target_params"], base["drafter_params"]
    assert 4.0e9 < n_target < 4.1e9, f"Qwen3-4B has 4.02B parameters (tied embeddings), the plan counts {n_target}"
    assert base["target_weights"] == 2 * n_target and base["drafter_states"] == 16 * n_drafter, \
        f"bf16 target weights and 16 bytes a drafter parameter: {base}"
    fits = base["max_batch_size"]
    assert fits >= 1 and plan(batch_size=fits)["peak"] <= 80 * 2 ** 30 < plan(batch_size=fits + 1)["peak"], \
        f"max_batch_size {fits} does not match the peaks around it"
    checkpointed = plan(grad_checkpoint=True)
    assert checkpointed["activations_per_seq"] < base["activations_per_seq"] / 3 \
        and checkpointed["max_batch_size"] > fits, f"grad checkpointing saves too little: {checkpointed}"
    loss = {(n, c): plan(max_anchors=n, loss_chunk=c)["loss_chunk"] for n in (128, 512) for c in (1024, None)}
    assert loss[128, 1024] == loss[512, 1024] < loss[128, None] < loss[512, None], \
        f"loss bytes by (anchors, chunk): {loss}; the chunked loss must not grow with the anchors"
    memory.check_fits(plan(batch_size=fits))
    with pytest.raises(ValueError, match=rf"batch size {fits + 1} needs about [0-9.]+ GiB per GPU, more than "
                                         rf"the GPU's 80 GiB; --batch-size {fits} fits"):
        memory.check_fits(plan(batch_size=fits + 1))
    with pytest.raises(ValueError, match="not even one sequence fits: try a smaller --max-anchors or --seq-len"):
        memory.check_fits(plan(gpu_memory_gib=10))
    text = memory.format_plan(base)
    assert "target weights" in text and f"largest batch in 80 GiB:  {fits}" in text, text

    small = qwen3_config(hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=128)
    from transformers import Qwen3ForCausalLM
    c = memory.sizing_config(small)
    want = (sum(p.numel() for p in Qwen3ForCausalLM(small).parameters()),
            sum(p.numel() for p in dflash2.DFlash2Drafter(c).parameters()))
    assert memory.parameter_counts(small, c) == want, f"meta-device counts {memory.parameter_counts(small, c)} != {want}"

    with pytest.raises(ValueError, match=r"loss_chunk \(0\) must be >= 1"):
        memory.memory_plan(config, 3072, 512, loss_chunk=0)
    with pytest.raises(ValueError, match="max_anchors \\(0\\) must be >= 1"):
        memory.memory_plan(config, 3072, 0)
    missing = tmp_path / "no-such-target"
    with pytest.raises(ValueError, match=f"cannot read the target's config at '{missing}'"):
        load_config(str(missing))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read the target's config at '{broken}'"):
        load_config(str(broken))
    small.save_pretrained(tmp_path / "ok")
    assert load_config(str(tmp_path / "ok")).hidden_size == 32, "a saved config did not read back"
    text = memory.format_plan(memory.memory_plan(load_config(str(tmp_path / "ok")), 64, 8,
                                                 gpu_memory_gib=1))
    assert "largest batch in 1 GiB:" in text, f"the saved config gave no plan: {text}"


def test_plan_at_qwen3_8b_shape():
    """Qwen3-8B (untied embeddings) at the paper's recipe: 8.19B target parameters, and with
    grad checkpointing a larger batch fits than without."""
    config = qwen3_config(**QWEN3_8B)
    plan = lambda **kw: memory.memory_plan(config, 3072, 512, block_size=16, **kw)
    base, checkpointed = plan(), plan(grad_checkpoint=True)
    assert 8.1e9 < base["target_params"] < 8.3e9, f"Qwen3-8B has 8.19B parameters, the plan counts {base['target_params']}"
    assert base["target_weights"] == 2 * base["target_params"], base
    assert 1 <= base["max_batch_size"] < checkpointed["max_batch_size"], \
        f"largest batch {base['max_batch_size']} without, {checkpointed['max_batch_size']} with grad checkpointing"


def test_factored_selector_trains_the_write_ups_two_million_parameters_at_qwen3_4b():
    """The write-up's +2.0M: at Qwen3-4B's shape (H = 2560, V = 151,936, R = 256) factored
    codebooks give the selector 3·H·R = 1,966,080 trainable parameters (hidden projection, W_A,
    W_B), free ones H·R + 2·V·R; the plan's drafter count (and its AdamW bytes) differs by that."""
    config = qwen3_config(**QWEN3_4B)
    selector, plan = {}, {}
    for codebooks in ("free", "factored"):
        with torch.device("meta"):
            drafter = dflash2.DFlash2Drafter(memory.sizing_config(config, block_size=16, selector_codebooks=codebooks))
        selector[codebooks] = sum(p.numel() for p in drafter.candidate_selector.parameters() if p.requires_grad)
        plan[codebooks] = memory.memory_plan(config, 3072, 512, block_size=16, selector_codebooks=codebooks)
    want = {"free": 2560 * 256 + 2 * 151_936 * 256, "factored": 1_966_080}
    assert selector == want, f"trainable selector parameters {selector}, want {want}"
    saved = plan["free"]["drafter_params"] - plan["factored"]["drafter_params"]
    assert saved == want["free"] - want["factored"] and \
        plan["free"]["drafter_states"] - plan["factored"]["drafter_states"] == 16 * saved, \
        f"the plan counts {plan['free']['drafter_params']} / {plan['factored']['drafter_params']} drafter parameters"


# -----------------------------------------------------------------------------
# python -m harness.memory


def test_memory_script_prints_the_plan_of_train_py_shape_flags_from_the_config_alone(tmp_path):
    from transformers import Qwen3ForCausalLM
    small = qwen3_config(hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=128)
    small.save_pretrained(tmp_path)  # a config, no weights
    lines = []
    plan = memory.main(memory.parse_args(["--target", str(tmp_path), "--seq-len", "64", "--max-anchors", "8",
                                          "--batch-size", "2", "--block-size", "4", "--gpu-memory-gib", "0.001"]),
                       lines.append)
    want = memory.memory_plan(small, 64, 8, 2, memory.train_loss_chunk(128), False, 0.001, num_layers=2, block_size=4,
                              conv_kernel_size=2, selector_rank=256, selector_top_k=16, selector_codebooks="free")
    assert plan == want, f"memory.py's plan {plan} is not memory_plan's for the same shape {want}"
    assert lines == [memory.format_plan(want)] and "largest batch in 0.001 GiB:  0" in lines[0], lines
    assert plan["target_weights"] == 2 * sum(p.numel() for p in Qwen3ForCausalLM(small).parameters()), plan


SMALL = dict(hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=128)
SHAPE = ["--seq-len", "64", "--max-anchors", "8", "--batch-size", "2", "--block-size", "4", "--num-layers", "2",
         "--conv-kernel-size", "2", "--selector-top-k", "16"]  # flags both scripts take


def planned(folder, **config):
    """memory.py's plan of SHAPE and the DFlash2Config fields `config` (selector_rank 8 unless set) on the config
    in `folder`, after checking that train.py's GPU check plans the same peak: it trains plainly on a GPU of exactly
    that many bytes, and not on one a byte smaller (the check reads the target's config only)."""
    argv = ["--target", str(folder), *SHAPE, "--drafter-config", json.dumps({"selector_rank": 8, **config})]
    plan = memory.main(memory.parse_args(argv), lambda *a: None)

    def plainly(total_memory):
        try:
            args = train.parse_args(argv)
            return memory.fitting_plan(load_config(args.target), args.seq_len, args.max_anchors, args.batch_size,
                                       train.drafter_fields(args), total_memory / memory.GiB, lambda *a: None) is False
        except ValueError:
            return False
    at, below = plainly(plan["peak"]), plainly(plan["peak"] - 1)
    assert at and not below, f"{config}: train.py's GPU check {'trains' if at else 'does not train'} plainly on a " \
        f"GPU of memory.py's peak ({plan['peak']} bytes) and {'does' if below else 'does not'} on one a byte smaller"
    return plan


def drafter_parameters(config, **flags):
    """The parameters of a real drafter (not the plan's meta-device count) of SHAPE's size."""
    c = drafter_config(config, mask_token_id=0, num_layers=2, block_size=4, conv_kernel_size=2,
                       selector_rank=8, selector_top_k=16, **flags)
    return sum(p.numel() for p in dflash2.DFlash2Drafter(c).parameters())


def test_the_plan_holds_the_context_features_of_the_target_layer_ids_asked_for(tmp_path):
    """target_layer_ids: with 3 ids rather than 1, each sequence holds two more (S, H) feature
    slices in fp32 and the bf16 copy the fc reads under autocast, and the drafter the fc's wider
    input (a real drafter's count); train.py's GPU check plans the same."""
    config = qwen3_config(**SMALL)
    config.save_pretrained(tmp_path)
    one, three = (planned(tmp_path, target_layer_ids=ids) for ids in ([1], [0, 1, 2]))
    S, H = 64, SMALL["hidden"]
    grown = three["activations_per_seq"] - one["activations_per_seq"]
    assert grown == 2 * S * H * (4 + 2), f"two more target layers add {grown} bytes a sequence, want {2 * S * H * 6}"
    for plan, ids in ((one, [1]), (three, [0, 1, 2])):
        want = drafter_parameters(config, target_layer_ids=ids)
        assert plan["drafter_params"] == want, f"layers {ids}: the plan counts {plan['drafter_params']} drafter " \
            f"parameters, a real drafter has {want}"


def test_the_plan_counts_the_factored_selectors_parameters(tmp_path):
    """Factored codebooks: the plan's drafter parameters and their AdamW bytes are those
    of a real factored drafter (W_A, W_B at H·R each instead of two V·R tables); train.py's GPU check
    plans the same."""
    config = qwen3_config(**SMALL)
    config.save_pretrained(tmp_path)
    plans = {books: planned(tmp_path, selector_codebooks=books) for books in ("free", "factored")}
    for books, plan in plans.items():
        want = drafter_parameters(config, selector_codebooks=books)
        assert (plan["drafter_params"], plan["drafter_states"]) == (want, 16 * want), \
            f"{books} codebooks: the plan counts {plan['drafter_params']} drafter parameters " \
            f"({plan['drafter_states']} bytes), a real drafter has {want} (16 bytes each)"
    assert plans["free"]["drafter_params"] != plans["factored"]["drafter_params"], "the two selectors are one size"


def test_train_py_loss_chunk_holds_the_same_logits_at_every_vocabulary():
    """train.py's chunk is the most slots whose logits fit LOSS_CHUNK_LOGITS (1,024 at Qwen3's vocabulary), at least
    one; train.py's loss config and the plan both take it."""
    for vocab, want in ((151936, 1024), (49152, 3165), (128, 1_215_488), (2 * 1024 * 151936, 1)):
        got = memory.train_loss_chunk(vocab)
        assert got == want and (got * vocab <= memory.LOSS_CHUNK_LOGITS or got == 1), \
            f"vocabulary {vocab}: a chunk of {got} slots, want {want}"
    assert train.loss_config(train.parse_args([]), 49152).chunk_size == 3165
    plan = memory.memory_plan(qwen3_config(**dict(SMALL, vocab=49152)), 3072, 512, block_size=16)
    assert plan["shape"]["loss_chunk"] == 3165, plan["shape"]


def test_an_unchunked_loss_plans_what_one_chunk_of_every_slot_plans():
    """loss_chunk None (the whole loss at once) plans what one chunk holding every slot plans
    (batch · anchors · (B - 1) = 48 here); a smaller chunk plans less."""
    figures = lambda plan: {k: v for k, v in plan.items() if k != "shape"}
    whole, every, part = (memory.memory_plan(qwen3_config(**SMALL), 64, 8, 2, n, block_size=4, selector_rank=8)
                          for n in (None, 48, 16))
    assert figures(whole) == figures(every), f"the unchunked loss plans {figures(whole)}, one chunk of all 48 slots " \
        f"{figures(every)}"
    assert part["loss_chunk"] < whole["loss_chunk"], f"a 16-slot chunk plans {part['loss_chunk']} loss bytes, " \
        f"the whole loss {whole['loss_chunk']}"


def test_train_py_loss_chunk_holds_only_the_slots_a_step_has():
    """At Qwen3's vocabulary train.py's chunk is 1,024 slots (3.7 GB); a step of fewer slots (here batch · 8 anchors
    · 3) holds only those: the plan is the unchunked loss's, and its loss bytes grow with the batch."""
    config = qwen3_config(**dict(SMALL, vocab=151_936))
    plan = lambda batch, chunk: memory.memory_plan(config, 64, 8, batch, chunk, block_size=4, selector_rank=8)
    loss = {}
    for batch in (1, 2):
        train_plan, whole = plan(batch, "train"), plan(batch, None)
        assert train_plan["shape"]["loss_chunk"] == 1024 > batch * 8 * 3, train_plan["shape"]
        got, want = (train_plan["loss_chunk"], train_plan["peak"]), (whole["loss_chunk"], whole["peak"])
        assert got == want, f"batch {batch} ({batch * 24} slots): train.py's plan holds (loss, peak) {got} bytes, " \
            f"the unchunked loss {want}"
        loss[batch] = got[0]
    assert loss[2] == 2 * loss[1], f"loss bytes by batch {loss}: twice the slots, not twice the bytes"


# Gemma-3's multimodal wrapper (Gemma3ForConditionalGeneration): the language model's fields are in text_config
GEMMA3_WRAPPER = dict(text_config=dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                       query_pre_attn_scalar=16, sliding_window=8),
                      vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, image_size=28, patch_size=14), mm_tokens_per_image=4)


@pytest.mark.parametrize("family", ["Qwen3", "Gemma-3 wrapper"])
def test_the_plan_holds_every_hidden_state_the_targets_forward_returns(tmp_path, family):
    """A sequence holds all the hidden states the target returns (the embeddings' and every layer's: L + 1), bf16,
    from the language model of a multimodal wrapper too; memory.py and train.py's GPU check plan the same."""
    from transformers import Gemma3Config
    config = qwen3_config(**SMALL) if family == "Qwen3" else Gemma3Config(**GEMMA3_WRAPPER)
    config.save_pretrained(tmp_path)
    plan = planned(tmp_path)
    torch.manual_seed(0)
    model = model_class(config).from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        states = model(input_ids=torch.randint(4, 128, (1, 64)), output_hidden_states=True).hidden_states
    want = sum(s.numel() * s.element_size() for s in states)
    assert plan["hidden_states_per_seq"] == want, f"{family}: the plan holds {plan['hidden_states_per_seq']} bytes " \
        f"of hidden states a sequence, the target's forward returns {len(states)} states of {want} bytes"


@pytest.mark.parametrize("argv, message", [
    ([], "the memory plan reads the target's config: name one with --target"),
    (["--target", "t", "--gpu-memory-gib", "nan"], "--gpu-memory-gib nan must be > 0"),
    (["--target", "t", "--gpu-memory-gib", "0"], "--gpu-memory-gib 0.0 must be > 0"),
])
def test_memory_script_refuses_bad_flags_in_one_line_before_reading_the_config(argv, message, monkeypatch):
    monkeypatch.setattr(memory, "load_config", lambda target: pytest.fail(f"read the config of {target}"))
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        memory.main(memory.parse_args(argv), lambda *a: None)


@pytest.mark.parametrize("flag, value, low", [("--seq-len", "1", 2), ("--max-anchors", "0", 1),
                                              ("--block-size", "1", 2), ("--batch-size", "0", 1)])
def test_the_shared_shape_flags_refuse_small_values_in_the_parser(flag, value, low, capsys):
    """memory.py and train.py declare the shape flags once, with the same bounds."""
    for parse in (memory.parse_args, train.parse_args):
        with pytest.raises(SystemExit):
            parse(["--target", "t", flag, value])
        assert f"argument {flag}: {value} must be >= {low}" in capsys.readouterr().err, parse.__module__


def test_memory_script_exits_with_one_line():
    done = subprocess.run([sys.executable, "-m", "harness.memory", "--seq-len", "8"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(memory.__file__)))
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        "harness.memory: the memory plan reads the target's config: name one with --target (a model folder, hub id or "
        ".gguf file); the offline demo's tiny target needs no plan"], done.stderr


def test_memory_script_prints_the_recomputing_plan_with_grad_checkpoint(tmp_path):
    """--grad-checkpoint prints memory_plan's recomputing plan of the same shape, with its recomputed layer's line;
    its peak is not the plain plan's."""
    qwen3_config(**SMALL).save_pretrained(tmp_path)
    runs = {}
    for flags in ([], ["--grad-checkpoint"]):
        lines = []
        plan = memory.main(memory.parse_args(["--target", str(tmp_path), *SHAPE, *flags]), lines.append)
        runs[" ".join(flags) or "plain"] = plan, "\n".join(lines)
    want = memory.memory_plan(load_config(str(tmp_path)), 64, 8, 2, "train", True, 80.0, num_layers=2, block_size=4,
                              conv_kernel_size=2, selector_top_k=16, selector_rank=256, selector_codebooks="free")
    (got, printed), (plain, _) = runs["--grad-checkpoint"], runs["plain"]
    assert got == want, f"--grad-checkpoint printed the plan {got}, the recomputing plan of its shape is {want}"
    assert got["peak"] != plain["peak"], f"with and without --grad-checkpoint the plan peaks at {got['peak']} bytes"
    assert "grad checkpoint on" in printed and "one layer recomputed" in printed, f"--grad-checkpoint printed {printed}"


def transparent_huge_pages():
    """The kernel's THP mode ('always', 'madvise', 'never'), or None where there is none (not Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except OSError:
        return None


@pytest.mark.skipif(transparent_huge_pages() in (None, "never"), reason="no transparent huge pages on this machine")
def test_use_huge_pages_makes_a_large_tensors_first_touch_fault_in_2_mib_pages():
    """After use_huge_pages, a fresh 64 MiB tensor faults a 16th (or less) as often as with torch's 4 KiB pages
    (THP_MEM_ALLOC_ENABLE=0, a value use_huge_pages keeps): each process counts its own minor faults."""
    script = ("import resource, torch\nfrom harness.memory import use_huge_pages\nuse_huge_pages()\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\nx = torch.ones(2 ** 24)\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def faults(setting):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | setting
        return int(subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                                  check=True).stdout)

    huge, small = faults({}), faults({"THP_MEM_ALLOC_ENABLE": "0"})
    assert small >= 2 ** 24 * 4 // 4096, f"4 KiB pages: {small} faults for 16,384 pages"
    assert huge * 16 <= small, f"after use_huge_pages {huge} faults, with 4 KiB pages {small}"


def test_train_asks_for_huge_pages_before_it_allocates(monkeypatch):
    """train() asks for huge pages first (start_ranks' first line), before the run's folder or anything else: torch
    reads the setting at its first large tensor."""
    calls = []

    class Started(Exception):
        pass

    def training_run(*args, **kwargs):
        calls.append("run folder")
        raise Started

    monkeypatch.setattr(train.memory, "use_huge_pages", lambda: calls.append("huge pages"))
    monkeypatch.setattr(train.checkpoint, "TrainingRun", training_run)
    with pytest.raises(Started):
        train.train(train.parse_args([]))
    assert calls == ["huge pages", "run folder"], f"train() ran {calls}"
