"""End-to-end tests of train.py on a tiny random Qwen3 target; no downloads, CPU only."""
import argparse
import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import dflash2
import train
from harness import checkpoint, data, fast_loss, memory, metrics, tiny_world
from harness import regenerate as regenerate_module
from harness import target as target_module
from bench import ablation, cost, gpu_check, peer_cycle, peer_step, real, train_steps
from port import golden
from conftest import tiny_qwen3
from dflash2 import DFlash2Config, DFlash2Drafter
from harness.target import drafter_config
from tests.conftest import CONVERSATION, save_tiny_target, write_jsonl

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

pytestmark = pytest.mark.usefixtures("one_thread")


def records(out, kind):
    """A run's record lines of one kind ("train" or "eval")."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


SELECTOR_RANK_8 = '{"selector_rank": 8}'
FACTORED = '{"selector_rank": 8, "selector_codebooks": "factored"}'


def flags(world, out, *extra, data=None):
    """A run's flags: float32 (the same numbers on every CPU), a log line (and a record line) every step, no
    decoding at the end unless extra asks for it."""
    return ["--target", world["target"], "--data", data or world["data"], "--out-dir", str(out), "--seq-len", "192",
            "--batch-size", "2", "--max-anchors", "6", "--val-size", "4", "--drafter-config", SELECTOR_RANK_8,
            "--dtype", "float32", "--log-every", "1", "--decode-prompts", "0", *extra]


@pytest.fixture(scope="module", autouse=True)
def eager_loss():
    """Every run here takes the eager loss (each process would compile it again; the compiled loss is held to the
    formula in test_dflash2.py and in train.py's step below); scripts run by torchrun inherit it."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TORCH_COMPILE_DISABLE", "1")
        yield


def args_for(world, out, *extra, data=None):
    return train.parse_args(flags(world, out, *extra, data=data))


@pytest.fixture(scope="module")
def reference_run(world, tmp_path_factory):
    """One run of 4 steps, checkpointing every 2, that several tests read instead of each
    training its own: the smoke test, the resume tests and the data-parallel comparison.
    -> its out dir, the summary train() returns, and what it printed."""
    out, printed = tmp_path_factory.mktemp("reference") / "out", io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train.train(args_for(world, out, "--steps", "4", "--eval-every", "2", "--decode-prompts", "1"))
    return {"out": out, "summary": summary, "printed": printed.getvalue()}


def test_smoke_run_logs_records_and_exports_a_loadable_checkpoint(reference_run):
    summary, out = reference_run["summary"], reference_run["out"]
    assert len(summary["losses"]) == 4 and all(math.isfinite(l) for l in summary["losses"].values()), summary["losses"]
    drafter = checkpoint.load_export(out / "checkpoint")
    assert drafter.config.hidden_size == 64 and drafter.config.selector_top_k == 16, drafter.config
    assert summary["al_t0"] >= 1 and summary["al_t1"] >= 1, f"acceptance lengths {summary['al_t0']}, {summary['al_t1']}"
    printed = reference_run["printed"]
    assert "step     4/4 | loss " in printed and "temperature   mean AL" in printed, printed
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in record] == [("train", 1), ("train", 2), ("eval", 2), ("train", 3),
                                                        ("train", 4), ("eval", 4)], record
    assert record[-1]["al_t0"] == summary["al_t0"] and len(record[0]["slot_acc"]) == 7, record[-1]
    assert (out / "curves.png").stat().st_size > 1000, "curves.png was not written"


def test_held_out_prompts_are_decoded_at_the_end_of_the_run_only(reference_run):
    """--decode-prompts 1 with evaluations at steps 2 and 4 (of 4): only the last evaluation decodes, so only step
    4's eval record holds acceptance lengths, and the log prints one table of them, after the step-4 checkpoint."""
    decoded = {r["step"]: [k for k in ("al_t0", "al_t1") if k in r] for r in records(reference_run["out"], "eval")}
    assert decoded == {2: [], 4: ["al_t0", "al_t1"]}, f"acceptance lengths in the eval records by step: {decoded}, " \
        "want step 4's only"
    printed, table = reference_run["printed"], "temperature   mean AL"
    assert printed.count(table) == 1 and printed.index(table) > printed.index("resume.pt at step 4"), \
        f"{printed.count(table)} decoding tables in the log, want one after the step-4 checkpoint:\n{printed}"


def test_a_run_logs_every_log_every_steps_and_at_its_last(world, tmp_path):
    """--log-every 2 over 5 steps: a log line and a train record after steps 2 and 4, and after step 5, the run's
    last; none after steps 1 and 3."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.train(args_for(world, tmp_path / "out", "--steps", "5", "--log-every", "2"))
    want = [2, 4, 5]
    lines = [int(m[1]) for m in re.finditer(r"^step +(\d+)/5 \| loss ", printed.getvalue(), re.M)]
    recorded = [r["step"] for r in records(tmp_path / "out", "train")]
    assert lines == want and recorded == want, f"log lines at steps {lines}, train records at {recorded}, want {want}"


@pytest.mark.parametrize("generation_tag", [True, False])
@pytest.mark.parametrize("shape", ["messages", "conversations"])
def test_loss_mask_is_the_assistant_text(tmp_path, generation_tag, shape):
    template = tiny_world.CHATML if generation_tag else re.sub(r"{% (end)?generation %}", "", tiny_world.CHATML)
    tokenizer = tiny_world.build_tiny_tokenizer(template)
    msgs = CONVERSATION if shape == "messages" else [
        {"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CONVERSATION]
    rows = data.load_rows(write_jsonl(tmp_path / "c.jsonl", [{shape: msgs}] * 2), "train", tokenizer, 512,
                           log=lambda *a: None)
    ids, mask = rows[0]["input_ids"], rows[0]["loss_mask"]
    got = tokenizer.decode(ids[mask.bool()])
    want = CONVERSATION[1]["content"] + "<|im_end|>"  # with or without {% generation %} marks
    assert got == want, f"masked tokens decode to {got!r}, expected the assistant turn {want!r}"


def test_resume_repeats_the_uninterrupted_run(world, reference_run, tmp_path, monkeypatch):
    straight = reference_run["summary"]["losses"]  # 4 steps, a checkpoint every 2
    save = checkpoint.save_checkpoint

    def save_then_die(*a, **k):  # a kill right after the step-2 checkpoint
        save(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.train(args_for(world, tmp_path / "b", "--steps", "4", "--eval-every", "2"))
    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    resumed = train.train(args_for(world, tmp_path / "b", "--steps", "4", "--eval-every", "2", "--resume"))["losses"]
    assert list(resumed) == [3, 4], f"resumed run did steps {list(resumed)}, expected [3, 4]"
    assert all(resumed[s] == straight[s] for s in resumed), f"resumed {resumed} != uninterrupted {straight}"
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4], f"the resumed run's record holds steps {steps}, want 1..4 once (+ the eval at 4)"


def test_each_epoch_draws_fresh_anchors_for_every_row(world, tmp_path, monkeypatch, one_thread):
    """A row's place in the data stream, not its index in the data nor its place in the epoch,
    seeds its anchors: a second epoch trains other blocks of the same rows, also of a row that
    the second permutation puts where the first one did (seeded by the place in the epoch, that
    row would repeat its blocks)."""
    convs = tiny_world.stdlib_conversations(chunk_chars=120)[:6]
    data = write_jsonl(tmp_path / "six.jsonl", [{"messages": c} for c in convs])
    drawn, loss_step = [], train.loss_step

    def recording(drafter, view, target, batch, *rest, **kw):  # the anchors drawn, by row
        ids, attn, anchors, valid = batch.input_ids, batch.attention_mask, batch.anchors, batch.anchor_valid
        drawn.extend((tuple(ids[r][attn[r].bool()].tolist()), anchors[r][valid[r]].tolist()) for r in range(len(ids)))
        return loss_step(drafter, view, target, batch, *rest, **kw)

    monkeypatch.setattr(train, "loss_step", recording)
    train.train(args_for(world, tmp_path / "out", "--steps", "2", "--val-size", "1", "--batch-size", "5", data=data))
    epochs = [[row for row, _ in drawn[:5]], [row for row, _ in drawn[5:10]]]  # the evaluation's row comes after
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 5, "each epoch should see the 5 rows once"
    kept = [k for k in range(5) if epochs[0][k] == epochs[1][k]]
    assert kept, "no row keeps its place in the second epoch: the test would not see places in the epoch seed anchors"
    by_row = {}
    for row, anchors in drawn[:10]:
        by_row.setdefault(row, []).append(anchors)
    same = [k for k, (a, b) in enumerate(by_row.values()) if a == b]
    assert not same, f"rows {same} of 5 draw the same anchors in both epochs (rows at places {kept} keep their place)"


def test_init_from_a_dflash_v1_checkpoint_adds_conv_and_selector(world, tmp_path):
    v1 = drafter_config(AutoConfig.from_pretrained(world["target"]), mask_token_id=258, num_layers=1,
                        conv_kernel_size=0, selector_top_k=0)
    checkpoint.save_export(DFlash2Drafter(v1), tmp_path / "v1")
    train.train(args_for(world, tmp_path / "out", "--steps", "1", "--init-from", str(tmp_path / "v1")))
    c = checkpoint.load_export(tmp_path / "out" / "checkpoint").config
    assert (c.num_layers, c.conv_kernel_size, c.selector_top_k) == (1, 2, 16), f"warm-started drafter config {c}"


@pytest.mark.parametrize("wrapper", ["Gemma3Config", "Gemma4Config"])
def test_a_multimodal_wrapper_builds_the_drafter_of_its_language_model(tmp_path, wrapper):
    """A ...ForConditionalGeneration target's config holds no vocab_size or num_hidden_layers of its own: the
    drafter (fresh, and warm-started from an export) takes its language model's width, vocabulary and layers."""
    tokenizer = tiny_world.build_tiny_tokenizer()
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = getattr(transformers, wrapper)(text_config=text)
    want = (64, len(tokenizer) + 4, 6)
    fields = train.drafter_fields(train.parse_args(["--drafter-config", SELECTOR_RANK_8]))
    fresh = checkpoint.build_drafter(config, tokenizer, fields, log=lambda *a: None)
    checkpoint.save_export(fresh, tmp_path / "export")
    warm = checkpoint.build_drafter(config, tokenizer, fields, init_from=str(tmp_path / "export"), log=lambda *a: None)
    for how, c in (("fresh", fresh.config), ("--init-from", warm.config)):
        got = (c.hidden_size, c.vocab_size, c.num_target_layers)
        assert got == want, f"{wrapper}: the {how} drafter's (hidden, vocab, target layers) {got}, the language " \
            f"model's {want}"


def assert_bf16_table(table, want, side):
    """An exported (bf16) codebook against its float64 value: within bf16's rounding, 2^-8 of its largest entry."""
    off = (table - want).abs().max() / want.abs().max()
    assert off <= 2 ** -8, f"{side}_codebook differs from W_in·W by {off:.3g} of its largest entry"


def test_factored_codebooks_train_resume_and_export_as_tables(world, tmp_path, monkeypatch):
    """Factored codebooks: a run killed after its step-1 checkpoint resumes W_A and
    W_B from resume.pt and trains them on (they move); its export is an ordinary DFlash2
    checkpoint whose tables are W_in·W_Aᵀ and W_in·W_Bᵀ of the final weights, W_in the target's embedding."""
    save = checkpoint.save_checkpoint

    def save_then_die(*a, **k):
        save(*a, **k)
        raise KeyboardInterrupt

    run = lambda *extra: train.train(args_for(world, tmp_path, "--steps", "2", "--eval-every", "1", "--drafter-config",
                                              FACTORED, *extra))
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run()
    first = torch.load(tmp_path / "resume.pt", weights_only=True)
    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    assert list(run("--resume")["losses"]) == [2], "the resumed run did not do step 2 alone"
    last = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert last["run"]["drafter"]["selector_codebooks"] == "factored", last["run"]["drafter"]
    W_in = AutoModelForCausalLM.from_pretrained(world["target"]).get_input_embeddings().weight.double()
    exported = checkpoint.load_export(tmp_path / "checkpoint").state_dict()
    for side in ("predecessor", "successor"):
        W = last["model"][f"candidate_selector.{side}_projection.weight"]
        assert not torch.equal(W, first["model"][f"candidate_selector.{side}_projection.weight"]), f"W {side} froze"
        table, want = exported[f"candidate_selector.{side}_codebook"].double(), W_in @ W.double().T
        assert_bf16_table(table, want, side)


def test_nonfinite_loss_stops_without_a_poisoned_checkpoint(world, tmp_path, monkeypatch):
    real, calls = dflash2.loss_from_sums, []

    def nan_on_second_step(*a, **k):  # the second training step's loss (the evaluations run without grad)
        loss, stats = real(*a, **k)
        calls.append(torch.is_grad_enabled())
        return (loss * float("nan") if sum(calls) == 2 and calls[-1] else loss), stats

    monkeypatch.setattr(dflash2, "loss_from_sums", nan_on_second_step)
    with pytest.raises(RuntimeError, match="not finite"):
        train.train(args_for(world, tmp_path / "out", "--steps", "4", "--eval-every", "1"))
    state = torch.load(tmp_path / "out" / "resume.pt", weights_only=True)
    assert state["step"] == 1, f"last checkpoint is from step {state['step']}, expected 1 (before the NaN)"
    assert all(torch.isfinite(v).all() for v in state["model"].values()), "a non-finite weight reached the checkpoint"


DATA_PARALLEL = """
import os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {root!r})
import train
flags, out = sys.argv[1:], os.environ["RUNS_OUT"]
run = lambda name, *extra: train.train(train.parse_args([*flags, "--out-dir", os.path.join(out, name), *extra]))
# the runs share one process group: a new one would rendezvous on the keys the last one left in torchrun's store
init = dist.init_process_group
dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
dist.destroy_process_group = lambda: None
# one step of two micro-steps: the gradients the update uses (after the ranks' reduction), the weights after it
clip, make_optimizer, grads, made = torch.nn.utils.clip_grad_norm_, train.make_optimizer, [], []
def recording(params, *a, **k):
    grads.append([p.grad.clone() for p in params])
    return clip(params, *a, **k)
torch.nn.utils.clip_grad_norm_ = recording
train.make_optimizer = lambda params, lr: made.append(make_optimizer(params, lr)) or made[-1]
run("gradient", "--steps", "1", "--grad-accum", "2")
weights = [p.detach() for p in made[0].param_groups[0]["params"]]  # the drafter's, after the update
torch.save(dict(grads=grads, weights=weights), os.path.join(out, "gradient" + os.environ["RANK"] + ".pt"))
torch.nn.utils.clip_grad_norm_, train.make_optimizer = clip, make_optimizer
# 4 steps, a checkpoint every 2: every rank stops in step 3, before its update (a kill after step 2's checkpoint),
# then the run resumes
lr_at = train.lr_at
def dying(step, *a):
    if step == 2:
        raise SystemExit("killed in step 3")
    return lr_at(step, *a)
train.lr_at = dying
try:
    run("ddp", "--steps", "4", "--eval-every", "2")
except SystemExit as killed:
    print(killed, flush=True)
train.lr_at = lr_at
run("ddp", "--steps", "4", "--eval-every", "2", "--resume")
"""


@pytest.fixture(scope="module")
def data_parallel_runs(world, tmp_path_factory):
    """The runs of DATA_PARALLEL, 2 ranks x batch 1, in one torchrun (its start-up costs more than the runs):
    -> the folder of their outputs (each run's folder, each rank's recorded gradients) and what they printed."""
    out = tmp_path_factory.mktemp("data_parallel")
    (out / "runs.py").write_text(DATA_PARALLEL.format(root=HERE))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "RUNS_OUT": str(out)}
    run = subprocess.run([*torchrun, str(out / "runs.py"), *flags(world, out / "unused", "--batch-size", "1")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"out": out, "printed": run.stdout}


def test_torchrun_two_ranks_equal_one_rank_with_the_whole_batch(reference_run, data_parallel_runs):
    """DistributedDataParallel: 2 ranks x batch 1, killed after step 2's checkpoint and resumed,
    make the same updates and log the same losses as 1 rank x batch 2 (the reference run: the
    loss is normalised by the weights of the whole global batch). The replicas' agreement:
    test_the_data_parallel_gradient_is_the_whole_batchs."""
    printed, ddp_out = data_parallel_runs["printed"], data_parallel_runs["out"] / "ddp"
    assert printed.count("killed in step 3") == 2, f"both ranks should stop in step 3: {printed[-3000:]}"
    # Tolerances. Both runs do the same float32 arithmetic in another order (two rows in one
    # batch, or one per rank and an all-reduce), so their gradients agree to rounding only:
    # 2^-24 per operation, more where many terms nearly cancel. AdamW steps every entry by
    # about lr whatever its gradient's size, so a step inherits its entry's *relative* rounding
    # error; the successor codebook starts at 0 and holds nothing but such steps (the runs end
    # ~1e-5 of its largest entry apart): 1e-3 leaves 100x room. A wrong normalisation is no
    # rounding: each rank dividing by its own Σw instead of the ranks' mean reweights the rows
    # and moves entries by whole steps (~1 of the largest entry). The gradient's overall scale,
    # which AdamW cancels, shows in the logged loss: a float32 sum of a few hundred terms, far
    # inside 1e-4 when right.
    ddp, one = (torch.load(d / "resume.pt", weights_only=True)["model"] for d in (ddp_out, reference_run["out"]))
    for k, v in one.items():
        err = (ddp[k] - v).abs().max().item() / (v.abs().max().item() + 1e-12)
        assert err < 1e-3, f"{k}: 2 ranks x batch 1 and 1 rank x batch 2 differ by {err:.3g} of its largest entry"
    ddp_loss, one_loss = ({r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                           if r["kind"] == "train"} for d in (ddp_out, reference_run["out"]))
    assert ddp_loss.keys() == one_loss.keys() and all(abs(ddp_loss[s] - one_loss[s]) < 1e-4 * one_loss[s] for s in one_loss), \
        f"logged losses per step: 2 ranks x batch 1 {ddp_loss}, 1 rank x batch 2 {one_loss}"


def other_width_checkpoint(path):
    c = DFlash2Config(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=260,
                      num_target_layers=4, target_layer_ids=[1], mask_token_id=258, num_layers=1)
    checkpoint.save_export(DFlash2Drafter(c), path)
    return str(path)


@pytest.mark.parametrize("case", ["missing data", "no assistant", "mask id", "layer ids", "init width", "out dir"])
def test_bad_input_is_refused_before_the_out_dir_is_created(world, tmp_path, case):
    out, extra, data = tmp_path / "out", [], None
    if case == "missing data":
        data, match = str(tmp_path / "nope.jsonl"), "no such file"
    elif case == "no assistant":
        data = write_jsonl(tmp_path / "u.jsonl", [{"messages": CONVERSATION[:1]}] * 8)
        match = "line 1: messages: no assistant turn"
    elif case == "mask id":
        extra, match = ["--drafter-config", '{"mask_token_id": 100000}'], r"mask_token_id \(100000\)"
    elif case == "layer ids":
        extra, match = ["--drafter-config", '{"target_layer_ids": [1, 9]}'], r"target_layer_ids \[9\] outside"
    elif case == "init width":
        extra = ["--init-from", other_width_checkpoint(tmp_path / "ckpt")]
        match = "hidden_size 32 but the target has 64"
    else:
        (tmp_path / "file").write_text("")
        out, match = tmp_path / "file" / "out", "not writable"
    with pytest.raises(ValueError, match=match):
        train.train(args_for(world, out, "--steps", "1", *extra, data=data))
    assert not out.exists(), f"{out} was created by a run that failed on bad input"


BAD_DATA = {  # name -> (file name, file text, what the message must say)
    "empty file": ("e.jsonl", "", "e.jsonl: empty file"),
    "malformed JSON line": ("m.jsonl", json.dumps({"messages": CONVERSATION}) + '\n{"messages": [\n',
                            "m.jsonl: line 2: invalid JSON"),
    "a .csv file": ("c.csv", "a,b\n1,2\n", "unsupported file type '.csv'"),
    "row without messages": ("r.jsonl", json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"text": "x"}) + "\n",
                             "r.jsonl: line 2: no 'messages' or 'conversations' field"),
    "message without content": ("n.jsonl", json.dumps({"messages": [CONVERSATION[0], {"role": "assistant"}]}) + "\n",
                                r"n.jsonl: line 1: messages\[1\].content: missing"),
    "unknown role": ("u.jsonl", json.dumps({"messages": [CONVERSATION[0], {"role": "bot", "content": "x"}]}) + "\n",
                     r"u.jsonl: line 1: messages\[1\].role: unknown role 'bot'"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_line_naming_the_row_before_the_target_loads(world, tmp_path, no_target_load, case):
    name, text, match = BAD_DATA[case]
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        train.train(args_for(world, tmp_path / "out", "--steps", "1", data=str(tmp_path / name)))


def test_a_target_folder_that_is_not_a_model_is_named(world, tmp_path, no_target_load):
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(ValueError, match="notamodel: the folder has no config.json"):
        train.train(train.parse_args(["--target", str(tmp_path / "notamodel"), "--data", world["data"],
                                      "--out-dir", str(tmp_path / "out")]))


@pytest.mark.parametrize("flag", ["--grad-accum", "--val-size", "--steps", "--batch-size", "--max-anchors",
                                  "--num-layers"])
def test_zero_counts_are_refused_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit):
        train.parse_args([flag, "0"])
    assert f"argument {flag}: 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0,0.95", "1,1.5", "1,0.9,20,3", "1,0.9,x", "1,0.9,2.5", "hard"])
def test_bad_selector_labels_are_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--selector-labels", value])
    assert f"{value!r} is not argmax, soft or T[,top_p[,top_k]] with T > 0" in capsys.readouterr().err


def test_selector_label_settings_parse_with_the_filters_left_out():
    for text, want in (("argmax", ("argmax", None)), ("soft", ("soft", None)), ("0.7", ("soft", (0.7, 1.0, 0))),
                       ("1,0.95", ("soft", (1.0, 0.95, 0))), ("1,0.95,20", ("soft", (1.0, 0.95, 20)))):
        assert train.parse_args(["--selector-labels", text]).selector_labels == want, text
    cfg = train.loss_config(train.parse_args(["--selector-labels", "1,0.95,20"]), 49152)
    assert (cfg.selector_labels, cfg.soft_labels_at) == ("soft", (1.0, 0.95, 20)), cfg


def test_drafter_configs_given_twice_merge_the_later_winning():
    args = train.parse_args(["--drafter-config", '{"selector_rank": 8, "conv_group_size": 8}',
                             "--drafter-config", '{"selector_rank": 4, "selector_codebooks": "factored"}'])
    want = {"selector_rank": 4, "conv_group_size": 8, "selector_codebooks": "factored"}
    assert args.drafter_config == want and train.parse_args([]).drafter_config == {}, args.drafter_config


@pytest.mark.parametrize("value, message", [
    ("{nope", "'{nope' is not JSON"), ("[1]", "'[1]' is not a JSON object of DFlash2Config fields"),
    ('{"selector_rnak": 8}', "unknown DFlash2Config fields ['selector_rnak']"),
    ('{"num_layers": 3}', "set --num-layers with its own flag")])
def test_bad_drafter_configs_are_refused_by_the_parser(value, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--drafter-config", value])
    assert message in capsys.readouterr().err


class Built(Exception):
    """parser_of's way out of an entry point once its parser is built."""


def parser_of(parse_args):
    """The ArgumentParser an entry point's parse_args (or a main that parses first) builds, caught as it is asked
    to parse."""
    built = []

    def caught(self, *a, **k):
        built.append(self)
        raise Built

    with pytest.MonkeyPatch.context() as m, pytest.raises(Built):
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        parse_args([])
    return built[0]


FLAG_PROBES = ["-1", "0", "1", "2", "8", "0.5", "1e-3", "nan", "x", "", "auto", "float32", "disk:x", "{}"]


def parsed(action):
    """What an action's type makes of each probe: its value, or the error it refuses the probe with."""
    def one(text):
        try:
            return "value", action.type(text) if action.type else text
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            return "refused", type(e).__name__
    return [one(text) for text in FLAG_PROBES]


ENTRY_POINTS = {  # every entry point but train.py: its parser, and what it must share with train.py at least
    "harness.memory": (memory.parse_args, {"--target", "--seq-len", "--max-anchors", "--batch-size"}),
    "harness.checkpoint": (checkpoint.parse_args, {"--target", "--num-layers", "--drafter-config"}),
    "harness.regenerate": (regenerate_module.parse_args, {"--target", "--data", "--dtype"}),
    "bench.ablation": (ablation.parse_args, set()), "bench.cost": (cost.parse_args, set()),
    "bench.gpu_check": (gpu_check.parse_args, set()), "bench.peer_cycle": (peer_cycle.parse_args, set()),
    "bench.peer_step": (peer_step.parse_args, set()), "bench.real": (real.parse_args, set()),
    "bench.train_steps": (train_steps.parse_args, set()),
    "port.golden": (golden.main, set())}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_flag_an_entry_point_shares_with_train_py_has_its_name_type_and_default(entry):
    """Every other entry point (python -m harness.memory, .checkpoint, .regenerate, bench/'s and port/'s) declares
    its own flags; one that train.py takes too (--batch-size, --block-size, --dtype, ...) means the same thing there:
    the same destination, action, default and choices, and its type accepts and refuses the same values (numbers,
    bounds, NaN, words). A flag of another meaning takes another name (bench.cost's --draft-dtype, the bench's
    --out)."""
    parse_args, at_least = ENTRY_POINTS[entry]
    options = lambda parser: {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    ours, theirs = options(parser_of(train.parse_args)), options(parser_of(parse_args))
    shared = sorted(ours.keys() & theirs.keys())
    assert theirs and at_least <= set(shared), f"{entry} shares {shared} with train.py, not {sorted(at_least)}"
    for flag in shared:
        a, b = ours[flag], theirs[flag]
        want = (a.dest, type(a).__name__, a.default, a.choices, a.nargs)
        got = (b.dest, type(b).__name__, b.default, b.choices, b.nargs)
        assert got == want, f"{entry} {flag}: (dest, action, default, choices, nargs) {got}, train.py's {want}"
        differ = [(text, x, y) for text, x, y in zip(FLAG_PROBES, parsed(a), parsed(b)) if x != y]
        assert not differ, f"{entry} {flag} parses (probe, train.py's, its own) {differ} differently"


def test_script_bad_input_exits_with_one_line(world, tmp_path):
    bad = tmp_path / "e.jsonl"
    bad.write_text("")
    run = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags(world, tmp_path / "out", data=str(bad))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [f"train.py: {bad}: empty file"], run.stderr


@pytest.mark.parametrize("change", ["steps", "lr", "seq-len", "target", "layers", "data", "batch-size", "grad-accum",
                                    "world"])
def test_resume_refuses_another_run(world, reference_run, tmp_path, monkeypatch, change):
    """The reference run (1 rank, batch 2, grad-accum 1) resumed with another schedule, data, target or drafter is
    refused, naming what differs; so is another global batch, and the same global batch over another number of
    ranks."""
    shutil.copytree(reference_run["out"], tmp_path / "out")
    extra, match, data = ["--steps", "4", "--resume"], None, None
    if change == "batch-size":
        extra, match = extra + ["--batch-size", "1"], r"schedule: saved global_batch 2 != now 1"
    elif change == "grad-accum":
        extra, match = extra + ["--grad-accum", "2"], r"schedule: saved global_batch 2 != now 4"
    elif change == "world":  # rank 0 of 2 as torchrun starts it; the refusal comes before any collective
        start_ranks = train.start_ranks
        monkeypatch.setattr(train, "start_ranks", lambda: (2, *start_ranks()[1:]))
        extra, match = extra + ["--batch-size", "1"], r"schedule: saved world 1 != now 2"
    elif change == "steps":
        extra, match = ["--steps", "5", "--resume"], r"schedule: saved steps 4 != now 5"
    elif change == "lr":
        extra, match = extra + ["--lr", "0.001"], r"another run \(schedule: saved lr 0\.0006 != now 0\.001\)"
    elif change == "seq-len":
        extra, match = extra + ["--seq-len", "160"], r"seq_len: saved 192 != now 160"
    elif change == "layers":
        extra, match = extra + ["--num-layers", "3"], r"drafter: saved num_layers 2 != now 3"
    elif change == "data":  # as many rows, other text
        convs = tiny_world.stdlib_conversations(chunk_chars=120)[24:48]
        data, match = write_jsonl(tmp_path / "other.jsonl", [{"messages": c} for c in convs]), r"data: saved sample_sha256"
    args = args_for(world, tmp_path / "out", *extra, data=data)
    if change == "target":  # same shape, other weights
        other = save_tiny_target(tmp_path / "other", tiny_world.build_tiny_tokenizer())
        with torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(other)
            model.lm_head.weight.add_(1.0)
            model.save_pretrained(other)
        args = args_for({**world, "target": other}, tmp_path / "out", *extra)
        match = "the target's weights differ"
    with pytest.raises(ValueError, match=match):
        train.train(args)


def test_rewind_record_drops_the_killed_runs_later_lines(tmp_path):
    for step in (1, 2, 3, 4, 5):
        checkpoint.record(tmp_path, {"kind": "train", "step": step})
    checkpoint.rewind_record(tmp_path, 3)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], f"after rewinding to step 3 the record holds steps {steps}"


def test_a_gpu_run_recomputes_layers_only_when_the_batch_fits_no_other_way(world):
    """On a GPU, train.py plans its run for the device's memory (the target's config is enough): a batch that fits
    trains plainly, one that fits only with each draft layer recomputed in backward recomputes (and says so), one
    that fits neither way stops, naming the batch that fits."""
    args = train.parse_args(["--target", world["target"], "--batch-size", "3", "--max-anchors", "64"])
    config, fields = target_module.load_config(world["target"]), train.drafter_fields(args)
    shape = (config, args.seq_len, args.max_anchors, args.batch_size)
    plain, recomputed = (memory.memory_plan(*shape, "train", recompute, 80.0, **fields)["peak"] / memory.GiB
                         for recompute in (False, True))
    assert recomputed < plain, f"the plan's peak recomputing layers {recomputed} is not below the plain {plain}"
    lines = []
    assert memory.fitting_plan(*shape, fields, plain * 1.001, lines.append) is False and not lines, lines
    assert memory.fitting_plan(*shape, fields, (plain + recomputed) / 2, lines.append) is True, "it did not recompute"
    assert lines and lines[0].startswith("recomputing each draft layer in backward: without, batch 3"), lines
    with pytest.raises(ValueError, match=r"^batch size 3 needs about [0-9.]+ GiB per GPU, more than the GPU's "
                                         r"[0-9.e-]+ GiB; (--batch-size [12] fits|not even one sequence fits)"):
        memory.fitting_plan(*shape, fields, recomputed * 0.999)


# -----------------------------------------------------------------------------
# the fast training path: bf16 autocast on a CPU, the target's features once per row


def step_inputs(world, rows=3):
    tokenizer = target_module.load_tokenizer(world["target"])
    args = args_for(world, "unused")
    dataset = data.load_rows(world["data"], "train", tokenizer, args.seq_len)
    batch = data.collate(dataset[:rows], tokenizer.pad_token_id, torch.device("cpu"))
    target = AutoModelForCausalLM.from_pretrained(world["target"], dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(args.seed)  # as train.py seeds the drafter's init
    fields = train.drafter_fields(args)
    drafter = checkpoint.build_drafter(target.config, tokenizer, fields, dataset, log=lambda *a: None)
    return args, batch, target, drafter


def step(drafter, target, batch, args, sums_fn=dflash2.slot_sums, **kw):
    """train.py's step on batch: its loss and gradients. sums_fn: the loss formula, or train.compiled_loss's."""
    drafter.zero_grad(set_to_none=True)
    kw = kw or {"features": target_module.uncached_features(drafter.config.target_layer_ids)}
    inputs = train.step_inputs(target, batch, args.max_anchors, [1, 2, 3], **kw)
    view = dflash2.target_view(drafter.config, target)
    cfg = train.loss_config(args, drafter.config.vocab_size)
    loss, _, _ = train.loss_step(drafter, view, target, inputs, cfg, sums_fn)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_a_cpu_bf16_autocast_step_is_the_float32_step_within_bf16_rounding(world):
    """A bf16 target (--dtype bfloat16) runs the drafter's step under CPU bf16 autocast: its loss
    is the float32 step's to 2% and every gradient tensor to 20% in norm (‖g_bf16 - g‖ / ‖g‖; measured: at most 12%). bf16
    keeps 8 bits of mantissa (0.4% a rounding), compounded over the target's and the drafter's layers. Both steps
    run the loss as train.py does, compiled (train.compiled_loss)."""
    args, batch, target, drafter = step_inputs(world)
    sums_fn = train.compiled_loss(torch.device("cpu"), lambda line: None)
    want_loss, want = step(drafter, target, batch, args, sums_fn)
    got_loss, got = step(drafter, target.to(torch.bfloat16), batch, args, sums_fn)
    assert abs(got_loss - want_loss) < 0.02 * want_loss, f"bf16 loss {got_loss} vs float32 {want_loss}"
    for name, g in want.items():
        assert got[name].dtype == torch.float32, f"{name}: gradient in {got[name].dtype}, the weights are float32"
        off = (got[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert off < 0.2, f"{name}: bf16 gradient off by {off:.3f} of the float32 one's norm"


def test_a_float16_target_runs_the_drafter_step_under_bf16_autocast(world):
    """Below float32 means float16 too: on a float16 target every matmul of the drafter's step (its linear layers)
    runs under bf16 autocast, as on a bf16 target, and not in float32; the loss stays the float32 step's to 2%."""
    args, batch, target, drafter = step_inputs(world, rows=1)  # one row: a CPU emulates float16 matmuls
    want_loss, _ = step(drafter, target, batch, args)
    linear = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, out: seen.setdefault(out.dtype, []).append(m)) for m in linear]
    got_loss, _ = step(drafter, target.to(torch.float16), batch, args)
    for h in hooks:
        h.remove()
    dtypes = {str(d).removeprefix("torch."): len(ms) for d, ms in seen.items()}
    assert linear and set(seen) == {torch.bfloat16}, f"the drafter's linear outputs on a float16 target: {dtypes}, " \
        "want bfloat16 only"
    assert abs(got_loss - want_loss) < 0.02 * want_loss, f"float16 target's loss {got_loss} vs float32 {want_loss}"


def test_the_step_stats_read_the_acceptance_metrics_at_the_setting_asked(world):
    """step_stats(accept_at=(T, top_p, top_k)) (bench/ablation.py's metrics at the write-up's setting): the step's
    acceptance metric is then Σ_v min(p_v, q_v) at that setting, p = softmax(z/T) of the target's logits and
    q = softmax(U/T) of the drafter's, averaged over the counted slots; not the T = 1 default's, another number."""
    args, batch, target, drafter = step_inputs(world)
    c = drafter.config
    inputs = train.step_inputs(target, batch, args.max_anchors, [1, 2, 3], target_module.uncached_features(c.target_layer_ids))
    view, cfg = dflash2.target_view(c, target), train.loss_config(args, c.vocab_size)
    with torch.no_grad():
        _, terms, slots = train.loss_step(drafter, view, target, inputs, cfg)
        got = {T: metrics.step_stats(drafter, view, target, slots, cfg, terms, (T, 1.0, 0))["accept_unary"]
               for T in (0.25, 1.0)}
        counted = slots.counted.bool()
        z, U = (target.lm_head(x[counted]).double() for x in (slots.g, slots.h))  # Qwen3: lm_head(h) is its logits
    want = {T: torch.minimum(torch.softmax(z / T, -1), torch.softmax(U / T, -1)).sum(-1).mean().item() for T in got}
    assert all(abs(got[T] - want[T]) < 1e-5 for T in got), f"accept_unary by T: {got}, want Σ min(p, q) {want}"
    assert abs(want[0.25] - want[1.0]) > 1e-3, f"T = 0.25 and T = 1 accept alike ({want}): the test cannot tell them"


def test_cached_target_features_give_the_online_step_exactly(world, tmp_path):
    """TargetFeatures: the step that fills the cache and the steps that read it back (in memory,
    on disk, and from the disk files by a second cache, as a resumed run does) have the online
    step's loss and gradients exactly; padding is zero-filled from the cache, masked either way."""
    args, batch, target, drafter = step_inputs(world)
    online = step(drafter, target, batch, args)
    key = {"target_weights": target_module.weights_fingerprint(target),
           "target_layer_ids": drafter.config.target_layer_ids,
           "dtype": "float32"}
    make = lambda folder=None: target_module.TargetFeatures(key, drafter.config.target_layer_ids, folder)
    calls, forward = [], target.base_model.forward
    target.base_model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    for cache in (make(), make(tmp_path / "features")):
        for use in ("fills", "reads"):
            got = step(drafter, target, batch, args, features=cache, rows=[4, 0, 9])
            assert got[0] == online[0], f"the step that {use} the cache: loss {got[0]} != online {online[0]}"
            assert all(torch.equal(got[1][n], g) for n, g in online[1].items()), f"the step that {use}: gradients"
    assert len(calls) == 2, f"{len(calls)} target passes for 2 caches x 2 steps: each cache computes a row once"
    resumed = step(drafter, target, batch, args, features=make(tmp_path / "features"), rows=[4, 0, 9])
    assert resumed[0] == online[0] and len(calls) == 2, "a second cache on the same folder recomputed the rows"
    assert sorted(p.name for p in (tmp_path / "features").iterdir()) == \
        ["key.json", "row00000000.safetensors", "row00000004.safetensors", "row00000009.safetensors"]


def test_the_target_pass_gives_the_whole_models_hidden_states_and_never_runs_lm_head(world):
    """target.target_features reads the decoder alone: the whole model's hidden states at the layer
    ids (Hugging Face index l + 1) and its last (after the final norm), and no logits at all."""
    _, batch, target, drafter = step_inputs(world)
    ids, attn, layer_ids = *batch[:2], drafter.config.target_layer_ids
    want = target(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    heads, forward = [], target.lm_head.forward
    target.lm_head.forward = lambda *a, **k: heads.append(1) or forward(*a, **k)
    context, last = target_module.target_features(target, ids, attn, layer_ids)
    del target.lm_head.forward
    assert torch.equal(context, torch.cat([want[l + 1] for l in layer_ids], -1)), "the context differs"
    assert torch.equal(last, want[-1]), "the last hidden state differs from the whole model's"
    assert not heads, "the target pass ran lm_head"


def test_a_cache_of_another_target_or_other_rows_is_refused(world, tmp_path):
    args, batch, target, drafter = step_inputs(world)
    ids = drafter.config.target_layer_ids
    key = {"target_weights": [1.0, 2.0], "target_layer_ids": ids, "dtype": "float32"}
    cache = target_module.TargetFeatures(key, ids, tmp_path)
    cache.features(target, *batch[:2], rows=[0, 1, 2])
    with pytest.raises(ValueError, match=r"holds the features of .*'dtype': 'float32'.*, not of this run's .*bfloat16"):
        target_module.TargetFeatures({**key, "dtype": "bfloat16"}, ids, tmp_path)
    for folder in (tmp_path, None):
        cache = target_module.TargetFeatures(key, ids, folder)
        cache.features(target, *batch[:2], rows=[0, 1, 2])
        with pytest.raises(ValueError, match="training row 2 holds other tokens than the ones its cached features"):
            cache.features(target, *batch[:2], rows=[0, 2, 1])


def test_a_run_with_the_cache_on_disk_trains_as_the_run_without(world, tmp_path):
    """--cache-target-features disk over two epochs: one file per training row, and every step's
    loss the uncached run's (epoch 2's to float rounding: a cached row was computed in another
    batch, whose padding changes the products' shapes)."""
    run = lambda out, choice: train.train(args_for(world, tmp_path / out, "--steps", "20", "--cache-target-features",
                                                   choice))["losses"]  # 20 training rows, 2 a step: 2 epochs
    off, disk = run("off", "off"), run("disk", "disk")
    files = list((tmp_path / "disk" / "target_features").glob("row*.safetensors"))
    assert len(files) == 20, f"{len(files)} feature files for 20 training rows"
    assert off.keys() == disk.keys() and all(abs(off[s] - disk[s]) < 1e-5 * off[s] for s in off), \
        f"losses with the cache {disk} != without {off}"


def test_runs_with_one_features_dir_share_it(world, tmp_path, monkeypatch):
    """--cache-target-features disk:FOLDER: a second run (another drafter, another seed) on the same target, layers and
    data reads every row from the first run's folder, without a target pass, and trains as it
    would with no cache (to float rounding)."""
    shared = ["--steps", "10", "--cache-target-features", f"disk:{tmp_path / 'shared'}"]  # an epoch
    train.train(args_for(world, tmp_path / "first", *shared))
    off = train.train(args_for(world, tmp_path / "off", "--steps", "10", "--seed", "3", "--conv-kernel-size", "0",
                               "--cache-target-features", "off"))["losses"]

    def no_target_pass(*a, **k):
        raise AssertionError("the second run computed target features the shared folder holds")
    monkeypatch.setattr(target_module, "target_features", no_target_pass)
    got = train.train(args_for(world, tmp_path / "second", *shared, "--seed", "3", "--conv-kernel-size", "0"))["losses"]
    assert not (tmp_path / "second" / "target_features").exists()
    assert len(list((tmp_path / "shared").glob("row*.safetensors"))) == 20
    assert got.keys() == off.keys() and all(abs(off[s] - got[s]) < 1e-5 * off[s] for s in off), (got, off)


def test_the_learning_rate_warms_up_then_follows_a_cosine_down_to_its_floor():
    """lr_at against the schedule's landmarks: the peak at the end of warmup, the mean of the peak
    and the floor half-way through the decay, the floor at the last step, never below it."""
    peak, total, warmup = 1e-3, 110, 10
    for floor in (0.0, 0.1):
        lrs = [train.lr_at(s, total, warmup, peak, floor) for s in range(total + 1)]
        assert lrs[0] == peak / warmup and lrs[warmup - 1] == lrs[warmup] == peak
        assert abs(lrs[60] - (peak + floor * peak) / 2) < 1e-12 and abs(lrs[total] - floor * peak) < 1e-12
        assert all(a >= b >= floor * peak for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_a_short_run_warms_up_for_one_step_then_decays_over_the_rest(reference_run):
    """4% of a run shorter than 13 steps rounds to no step, yet every run warms up for at least one: the 4-step
    reference run logs the peak at step 1 (its warmup) and at step 2 (the cosine's start), then the cosine over the
    3 steps after the warmup, f + (1 - f)·(1 + cos(πk/3))/2 of the peak at k = 1, 2, f = LR_FLOOR."""
    peak, f = train.parse_args([]).lr, train.LR_FLOOR
    want = {1: peak, 2: peak, 3: peak * (f + (1 - f) * 0.75), 4: peak * (f + (1 - f) * 0.25)}
    got = {r["step"]: r["lr"] for r in records(reference_run["out"], "train")}
    assert got.keys() == want.keys() and all(math.isclose(got[s], want[s], rel_tol=1e-12) for s in want), \
        f"the 4-step run's logged lr by step: {got}, want {want} (off by up to " \
        f"{max(abs(got.get(s, 0) - want[s]) / peak for s in want):.3g} of the peak)"


def test_lr_floor_lifts_the_logged_schedule_onto_floor_times_peak(world, reference_run, tmp_path, monkeypatch):
    """LR_FLOOR f: after the warmup (the same ramp to the peak), the lr a run logs at every step is the
    reference run's (same steps, floor f0) mapped from [f0·peak, peak] onto [f·peak, peak]."""
    floor, base, peak = 0.5, train.LR_FLOOR, train.parse_args([]).lr
    logged = lambda out: {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                          if r["kind"] == "train"}
    monkeypatch.setattr(train, "LR_FLOOR", floor)
    train.train(args_for(world, tmp_path / "out", "--steps", "4"))
    got, ref = logged(tmp_path / "out"), logged(reference_run["out"])
    top = min(s for s, lr in ref.items() if math.isclose(lr, peak))  # the warmup's last step
    cosine = {s: (lr - base * peak) / (1 - base) for s, lr in ref.items()}  # the floor-free run's lr
    want = {s: lr if s <= top else floor * peak + (1 - floor) * cosine[s] for s, lr in ref.items()}
    assert got.keys() == want.keys() and all(math.isclose(got[s], want[s], rel_tol=1e-12) for s in want), \
        f"logged lr by step with LR_FLOOR {floor}: {got}; the reference run's moved onto [{floor * peak:.2e}, " \
        f"{peak:.2e}] after step {top}: {want}"
    assert max(ref) - top >= 2, f"the reference run decays over {max(ref) - top} logged steps only: {ref}"


@pytest.mark.parametrize("compiled", [False, True], ids=["formula", "compiled"])
def test_the_unary_term_is_float32_under_bf16_autocast(compiled):
    """The step runs under bf16 autocast below a float32 target, where a matmul or bmm would run in bf16:
    the loss's KL term (dflash2.slot_sums, eager and as train.compiled_loss runs it) must still be the
    float64 formula's to float32 rounding, slot by slot (w one-hot on the slot). In bf16 (8 bits of
    mantissa) its Σ_v p_v·r_v and Σ_v p_v·z_v, here about 5 each, would be off by ~0.02, far outside 1e-4."""
    torch.manual_seed(0)
    z, r = 3 * torch.randn(8, 600), 3 * torch.randn(8, 600)
    p = torch.softmax(r.double(), -1)
    want = (p * (torch.log_softmax(r.double(), -1) - torch.log_softmax(z.double(), -1))).sum(-1)
    view = dflash2.TargetView(torch.zeros(600, 600), None, lambda x: x)  # the slots' logits are z and r themselves
    lines = []
    sums_fn = train.compiled_loss(torch.device("cpu"), lines.append) if compiled else dflash2.slot_sums
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.stack([sums_fn(view, None, dflash2.LossConfig(), z, r, torch.zeros(8, dtype=torch.long), w)["unary"]
                           for w in torch.eye(8)])
    err = (got.double() - want).abs().max().item()
    assert got.dtype == torch.float32 and err < 1e-4, (
        f"KL under bf16 autocast ({'compiled' if compiled else 'formula'}{'; ' if lines else ''}{' '.join(lines)}): "
        f"{got.dtype}, off by {err:.3g}")


@pytest.mark.parametrize("disable, compilers, why", [
    ("0", ["g++", "c++"], None), ("", ["g++"], None), (None, ["c++"], None), (None, ["clang++"], None),
    ("1", ["g++", "c++"], "TORCH_COMPILE_DISABLE is set"), (None, [], "no C++ compiler on PATH")],
    ids=["DISABLE=0", "DISABLE empty, g++", "c++", "clang++", "DISABLE=1", "no compiler"])
def test_the_cpu_loss_is_compiled_where_any_cpp_compiler_is(monkeypatch, disable, compilers, why):
    """train.compiled_loss on a CPU: harness.fast_loss's sums under torch.compile where any one C++ compiler is on
    PATH and TORCH_COMPILE_DISABLE is unset, empty or 0 (torch disables on 1 only); else eager, with the line
    saying why. Only the compilers named are on PATH here."""
    if disable is None:
        monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", disable)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name in compilers else None)
    lines = []
    sums_fn = train.compiled_loss(torch.device("cpu"), lines.append)
    compiled = getattr(sums_fn, "_torchdynamo_orig_callable", None) is fast_loss.slot_sums
    got = "compiled" if compiled else "eager" if sums_fn is fast_loss.slot_sums else repr(sums_fn)
    want, line = ("eager", f"loss: the eager formula ({why})") if why else \
        ("compiled", "loss: the formula under torch.compile (compiled on the first step)")
    assert (got, lines) == (want, [line]), f"TORCH_COMPILE_DISABLE={disable!r} with {compilers or 'no compiler'} on " \
        f"PATH: the loss is {got}, logged {lines}; want {want}, logged {[line]}"


def test_a_bf16_cpu_target_decodes_the_eval_in_float32(world, monkeypatch):
    """On a CPU with AMX, --dtype auto loads the target in bf16 for training, but the eval's
    spec_generate (one token at a time, bound by reading the weights) runs it in float32; the
    target is bf16 again afterwards."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    target = target_module.load_target(world["target"], "auto", torch.device("cpu"))
    assert target.dtype == torch.bfloat16, f"auto on an AMX CPU loaded the target in {target.dtype}"
    args, _, _, drafter = step_inputs(world)
    tokenizer = target_module.load_tokenizer(world["target"])
    val = data.load_rows(world["data"], "train", tokenizer, args.seq_len).select(range(2))
    real, seen = dflash2.spec_generate, []
    monkeypatch.setattr(dflash2, "spec_generate", lambda d, t, *a, **k: seen.append(t.dtype) or real(d, t, *a, **k))
    metrics.evaluate(drafter.float(), target, tokenizer, val, train.loss_config(args, drafter.config.vocab_size),
                     args.batch_size, args.max_anchors, args.seed, lambda *a: None, prompts=2, max_new_tokens=8)
    assert seen and set(seen) == {torch.float32}, f"the eval decoded with the target in {set(seen)}"
    assert target.dtype == torch.bfloat16, f"after the eval the target is in {target.dtype}, not bf16 again"


def test_the_data_parallel_gradient_is_the_whole_batchs(world, tmp_path, data_parallel_runs):
    """2 ranks x batch 1 reach the update with the gradient of 1 rank x batch 2, the same rows, over
    two micro-steps (DDP reduces in the last one's backward only): the mean over ranks of each rank's
    gradient, itself normalised by the global batch's weights. Both replicas hold that gradient and,
    after the update, the same weights, bit for bit. (AdamW and the gradient clip both hide the
    gradient's scale from the weights and the loss.)"""
    clip, grads = torch.nn.utils.clip_grad_norm_, []

    def recording(params, *a, **k):
        grads.append([p.grad.clone() for p in params])
        return clip(params, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.utils, "clip_grad_norm_", recording)
        train.train(args_for(world, tmp_path / "one", "--steps", "1", "--batch-size", "2", "--grad-accum", "2"))
    one = {"grads": grads}
    two, other = (torch.load(data_parallel_runs["out"] / f"gradient{rank}.pt") for rank in (0, 1))
    flat = lambda tensors: torch.cat([t.flatten() for t in tensors])
    for what, got, want in (("gradients", flat(other["grads"][0]), flat(two["grads"][0])),
                            ("weights after the update", flat(other["weights"]), flat(two["weights"]))):
        assert torch.equal(got, want), f"the replicas' {what} differ: rank 1's are off rank 0's by up to " \
            f"{(got - want).abs().max().item():.3g}"
    (one,), (two,) = one["grads"], two["grads"]
    assert len(one) == len(two) and sum(bool(g.any()) for g in one) > len(one) / 2, "the runs' gradients are not " \
        "the same parameters', or mostly zero"
    for i, (g1, g2) in enumerate(zip(one, two)):  # float32, the rows summed in another order: ~1e-6 apart
        assert (g2 - g1).norm() <= 1e-3 * g1.norm(), f"parameter {i}: the 2-rank gradient is off the 1-rank one by " \
            f"{((g2 - g1).norm() / g1.norm()).item():.3g} of its norm (norm ratio {(g2.norm() / g1.norm()).item():.3f})"


def test_factored_tables_come_from_the_input_embedding_of_an_untied_target(world, tmp_path):
    """On a target whose lm_head is not its input embedding, the exported factored codebooks are
    W_in·W_Aᵀ and W_in·W_Bᵀ with W_in the input embedding (what the selector reads), not lm_head's rows."""
    untied = tmp_path / "untied"
    tokenizer = tiny_world.build_tiny_tokenizer()
    tiny_qwen3(len(tokenizer), hidden_size=64, num_layers=4, head_dim=32, dtype=torch.float32, seed=3,
               tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id).save_pretrained(untied)
    tokenizer.save_pretrained(untied)
    train.train(args_for({**world, "target": str(untied)}, tmp_path / "out", "--steps", "1", "--drafter-config",
                         FACTORED))
    model = AutoModelForCausalLM.from_pretrained(untied)
    W_in, head = (m.weight.detach().double() for m in (model.get_input_embeddings(), model.get_output_embeddings()))
    assert (W_in - head).abs().max() > 0.01, "the test target's lm_head is its embedding: it could not tell them apart"
    state = torch.load(tmp_path / "out" / "resume.pt", weights_only=True)["model"]
    exported = checkpoint.load_export(tmp_path / "out" / "checkpoint").state_dict()
    for side in ("predecessor", "successor"):
        table, want = exported[f"candidate_selector.{side}_codebook"].double(), \
            W_in @ state[f"candidate_selector.{side}_projection.weight"].double().T
        assert_bf16_table(table, want, side)


def test_training_stops_on_a_target_whose_forward_the_drafter_does_not_follow(world, tmp_path, monkeypatch):
    """The first-batch check: a target whose logits are scaled behind the drafter's back stops the
    run with one line naming its family, before any step."""
    load = target_module.load_target

    def scaled(*args, **kwargs):
        model = load(*args, **kwargs)
        forward = model.forward

        def forward_scaled(*a, **k):
            out = forward(*a, **k)
            out.logits = out.logits * 2
            return out
        model.forward = forward_scaled
        return model
    monkeypatch.setattr(target_module, "load_target", scaled)
    with pytest.raises(ValueError, match=r"the 'qwen3' target's logits differ from what the drafter computes"):
        train.train(args_for(world, tmp_path / "out", "--steps", "1"))


def test_the_fused_optimizer_takes_the_loop_over_tensors_steps():
    """train.make_optimizer's fused AdamW against torch's AdamW looping over the tensors (foreach off),
    from the same weights and gradients, over three steps: the same weights to float32 rounding."""
    torch.manual_seed(0)
    weights = [torch.randn(5, 7), torch.randn(11)]
    fused = [w.clone().requires_grad_() for w in weights]
    loop = [w.clone().requires_grad_() for w in weights]
    opt_fused = train.make_optimizer(fused, lr=1e-2)
    opt_loop = torch.optim.AdamW(loop, lr=1e-2, weight_decay=train.WEIGHT_DECAY, foreach=False, fused=False)
    for step in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for params, opt in ((fused, opt_fused), (loop, opt_loop)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, w in zip(fused, loop, weights):
        assert not torch.equal(a, w) and torch.allclose(a, b, atol=1e-6), f"fused off by {(a - b).abs().max():.3g}"


# -----------------------------------------------------------------------------
# what the other runs in this process hold fixed: one micro-step a step, and an embedding table the size of the
# tokenizer. One run varies both.


@pytest.fixture(scope="module")
def padded_target(tmp_path_factory):
    """A tiny target whose embedding table is padded past its tokenizer (vocab_size = len(tokenizer) + 4, as real
    tables are padded to a multiple of 64 or 128), with a tokenizer that has no mask token of its own (it would be
    the mask token whatever the table)."""
    root = tmp_path_factory.mktemp("padded")
    tokenizer = tiny_world.build_tiny_tokenizer()
    tokenizer.mask_token = None
    return save_tiny_target(root, tokenizer, vocab_size=len(tokenizer) + 4)


DECODED_AL = {0.0: 3.5, 1.0: 1.25}  # what the stand-in decoder reports at each temperature


@pytest.fixture(scope="module")
def accumulated_run(world, padded_target, tmp_path_factory):
    """One step of 2 micro-steps of batch 2 on the padded target, recording each micro-step's batch and loss, the
    drafter it started from, and the gradient the update used; the end-of-run decoding is a stand-in that records
    its prompts and reports the acceptance length DECODED_AL[T]."""
    out, printed = tmp_path_factory.mktemp("accumulated") / "out", io.StringIO()
    seen = {"micro": [], "grads": [], "prompts": []}
    loss_step, clip = train.loss_step, torch.nn.utils.clip_grad_norm_

    def recording_step(drafter, view, target, batch, cfg, *a, **k):
        training = torch.is_grad_enabled()  # the evaluation runs without grad
        if training and "start" not in seen:
            seen["start"] = (copy.deepcopy(drafter), view, target, cfg)
        loss, terms, slots = loss_step(drafter, view, target, batch, cfg, *a, **k)
        if training:
            seen["micro"].append((batch, loss.item()))
        return loss, terms, slots

    def recording_clip(params, *a, **k):
        seen["grads"].append([p.grad.clone() for p in params])
        return clip(params, *a, **k)

    def decoding(drafter, target, ids, max_new_tokens, temperature, **k):
        seen["prompts"].append((temperature, ids[0].tolist()))
        stats = SimpleNamespace(mean_acceptance_length=DECODED_AL[temperature], tokens_per_second=1.0)
        return torch.tensor([65]), stats

    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(printed):
        m.setattr(train, "loss_step", recording_step)
        m.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
        m.setattr(dflash2, "spec_generate", decoding)
        summary = train.train(args_for({**world, "target": padded_target}, out, "--steps", "1", "--grad-accum", "2",
                                       "--decode-prompts", "4"))
    return {"out": out, "summary": summary, "printed": printed.getvalue(), **seen}


def test_the_logged_step_loss_is_the_mean_of_its_micro_steps(accumulated_run):
    """--grad-accum 2: the step's loss that train() returns, the record holds and the log line prints is the mean
    of its two micro-steps' losses."""
    micro = [loss for _, loss in accumulated_run["micro"]]
    want = sum(micro) / len(micro)
    got = {"returned": accumulated_run["summary"]["losses"][1], "recorded": records(accumulated_run["out"], "train")[0]
           ["loss"]}
    assert len(micro) == 2 and all(math.isclose(v, want, rel_tol=1e-6) for v in got.values()), \
        f"step 1's loss {got}, the mean of its micro-steps' losses {micro} is {want}"
    assert f"step     1/1 | loss {want:.4f} " in accumulated_run["printed"], accumulated_run["printed"]


def test_the_accumulated_gradient_is_the_mean_of_the_micro_steps(accumulated_run):
    """--grad-accum 2: the gradient the clip and the update see is the mean of the two micro-batches' gradients
    (each of its own loss, from the step's weights), computed here one micro-batch at a time. Twice that (the
    micro-steps' sum) would let GRAD_CLIP bite at half the true norm."""
    drafter, view, target, cfg = accumulated_run["start"]
    each = []
    for batch, _ in accumulated_run["micro"]:
        drafter.zero_grad(set_to_none=True)
        train.loss_step(drafter, view, target, batch, cfg)[0].backward()
        each.append([p.grad.clone() for p in drafter.parameters()])
    got = accumulated_run["grads"][0]
    want = [(a + b) / 2 for a, b in zip(*each)]
    assert len(got) == len(want) and sum(bool(g.any()) for g in want) > len(want) / 2, \
        "the update's gradients are not the drafter's parameters', or mostly zero"
    for i, (g, w) in enumerate(zip(got, want)):  # the same float32 operations, summed in another order
        assert (g - w).norm() <= 1e-5 * w.norm(), f"parameter {i}: the accumulated gradient is off the micro-steps' " \
            f"mean by {((g - w).norm() / w.norm()).item():.3g} of its norm (norm ratio " \
            f"{(g.norm() / w.norm()).item():.3f})"


def test_a_padded_embedding_table_gives_the_mask_token_a_row_no_token_uses(accumulated_run, padded_target):
    """A target whose embedding table is padded past its tokenizer, which has no mask token: the drafter's mask
    token is the first padded row (one no token uses), not a special token of the tokenizer."""
    tokenizer = target_module.load_tokenizer(padded_target)
    vocab_size = AutoConfig.from_pretrained(padded_target).vocab_size
    assert tokenizer.mask_token_id is None and sorted(tokenizer.get_vocab().values()) == list(range(len(tokenizer)))
    got = checkpoint.load_export(accumulated_run["out"] / "checkpoint").config.mask_token_id
    line = next((l for l in accumulated_run["printed"].splitlines() if l.startswith("mask token")), None)
    assert got == len(tokenizer) < vocab_size, f"mask token {got} ({line}), want {len(tokenizer)}: the first of the " \
        f"rows {len(tokenizer)}..{vocab_size - 1} that no token of the {len(tokenizer)} uses"


def test_the_summary_and_record_report_each_temperatures_acceptance_length(accumulated_run):
    """al_t0 and al_t1 (train()'s summary and the record's eval line) are the T = 0 and the T = 1 decoding's mean
    acceptance lengths (the stand-in decoder reports 3.5 and 1.25)."""
    want = {"al_t0": DECODED_AL[0.0], "al_t1": DECODED_AL[1.0]}
    recorded = records(accumulated_run["out"], "eval")[-1]
    for where, got in (("summary", accumulated_run["summary"]), ("record", recorded)):
        assert {k: got.get(k) for k in want} == want, f"the {where}'s {[(k, got.get(k)) for k in want]}, want {want}"


def test_held_out_prompts_end_before_the_first_answer_token(world, accumulated_run, padded_target):
    """The end-of-run decoding's prompts, at both temperatures, are the held-out conversations' (the data's last
    --val-size 4) first user turns as the chat template renders them for generation: everything before the
    answer's first token, none of it."""
    tokenizer = target_module.load_tokenizer(padded_target)
    held_out = [json.loads(line)["messages"] for line in open(world["data"]).read().splitlines()[-4:]]
    want = [tokenizer.apply_chat_template(c[:1], add_generation_prompt=True, tokenize=True, return_dict=True)
            ["input_ids"] for c in held_out]
    for T in DECODED_AL:
        got = [ids for t, ids in accumulated_run["prompts"] if t == T]
        for k, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"T = {T}, prompt {k}: {tokenizer.decode(g[-12:])!r} ends the decoded prompt " \
                f"({len(g)} tokens), the generation prompt ends {tokenizer.decode(w[-12:])!r} ({len(w)} tokens)"
        assert len(got) == len(want), f"T = {T}: {len(got)} prompts decoded, {len(want)} held out"


class TargetNotLoaded(Exception):
    """Raised where a run would load the target's weights: a test of its setup stops there."""


def stop_before_the_target_loads(*args, **kwargs):
    raise TargetNotLoaded


@pytest.mark.parametrize("taps", [0, 3])
def test_the_conv_kernel_size_flag_reaches_the_drafter_a_run_trains(world, tmp_path, monkeypatch, taps):
    """--conv-kernel-size 0 builds the drafter the run trains and exports without the convolution (bench.ablation's
    DFlash and +selector rows), 3 with three taps on both sides of each sublayer; the run stops where the target's
    weights would load."""
    built, build = [], checkpoint.build_drafter

    def recording(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(checkpoint, "build_drafter", recording)
    monkeypatch.setattr(train, "load_checked_target", stop_before_the_target_loads)
    with pytest.raises(TargetNotLoaded):
        train.train(args_for(world, tmp_path / "out", "--conv-kernel-size", str(taps)))
    (drafter,) = built
    convs = [conv for layer in drafter.layers for conv in (layer.attention_conv, layer.mlp_conv)]
    taps_built = [None if conv is None else conv.base_kernel.shape[1] for conv in convs]
    assert drafter.config.conv_kernel_size == taps and taps_built == [taps or None] * len(convs), \
        f"--conv-kernel-size {taps}: the drafter has conv_kernel_size {drafter.config.conv_kernel_size} and " \
        f"convolutions of {taps_built} taps"
