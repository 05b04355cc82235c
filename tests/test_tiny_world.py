"""Tests of the offline tiny world: tokenizer, quality measure, the cached on-policy build, where train.py finds it."""
import importlib
import json
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import tiny_world
from conftest import tiny_qwen3
from dflash2 import target_generate
from tests.conftest import small_world

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bpe():
    convs = tiny_world.stdlib_conversations(chunk_chars=600)
    return tiny_world.train_bpe_tokenizer([m["content"] for c in convs[:1500] for m in c], vocab_size=1024), convs[-20:]


def test_bpe_tokenizer_round_trips_and_compresses(bpe):
    tok, held = bpe
    text = "".join(m["content"] for c in held for m in c)
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text, "held-out text does not survive encode/decode"
    assert len(text) / len(ids) > 2.5, f"{len(text) / len(ids):.2f} characters per token: BPE learned few merges"
    assert len(tok) == 1024, len(tok)
    specials = [tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.convert_tokens_to_ids("<|im_start|>")]
    assert sorted(specials) == [0, 1, 2, 3], f"specials at {specials}, expected ids 0-3"
    rendered = tok.apply_chat_template(held[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    answer = [t for t, m in zip(rendered["input_ids"], rendered["assistant_masks"]) if m]
    assert tok.decode(answer) == held[0][1]["content"] + "<|im_end|>", "assistant mask does not cover the answer"


def brute_force_repeat_share(ids, run):
    """Position i is inside a run iff some window of `run` identical tokens covers it."""
    inside = [any(i - run < j <= i and j + run <= len(ids) and len(set(ids[j:j + run])) == 1 for j in range(len(ids)))
              for i in range(len(ids))]
    return sum(inside) / max(1, len(ids))


def test_repeat_share_matches_brute_force():
    assert tiny_world.repeat_share([5, 5, 5, 5, 1, 2, 2, 2, 7, 7, 7, 7, 7]) == 9 / 13
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([0, 1]) if rng.random() < 0.7 else rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        assert tiny_world.repeat_share(ids) == pytest.approx(brute_force_repeat_share(ids, 4)), ids


def test_repeated_line_share_counts_repeats_within_a_text():
    texts = ["a = 1\nb = 2\na = 1\n\n\na = 1\n", "b = 2\nc = 3\n"]
    assert tiny_world.repeated_line_share(texts) == 2 / 6, "two of six non-blank lines repeat an earlier line of their text"


@pytest.fixture
def small_build(monkeypatch):
    """The world built small (tests/conftest.py's small_world)."""
    small_world(monkeypatch)


def test_tiny_world_builds_once_loadable_and_on_policy(tmp_path, small_build):
    logs = []
    target, data = tiny_world.tiny_world(tmp_path, 1, logs.append, train_prompts=4, max_new_tokens=3)
    model, tok = AutoModelForCausalLM.from_pretrained(target), AutoTokenizer.from_pretrained(target)
    assert model.config.vocab_size == len(tok) == 2048, (model.config.vocab_size, len(tok))
    assert tok.mask_token_id is not None and tok.chat_template == tiny_world.CHATML
    rows = [json.loads(line)["messages"] for line in open(data)]
    assert len(rows) == 4 + tiny_world.TINY_HELD_OUT, len(rows)
    assert all([m["role"] for m in r] == ["user", "assistant"] for r in rows), rows[0]
    # on-policy: the answer is the target's greedy continuation, not the corpus' text
    prompt = tok.apply_chat_template(rows[0][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    greedy = target_generate(model, prompt["input_ids"], 3, stop_token_ids=[tok.eos_token_id])[0].tolist()
    assert rows[0][1]["content"] == tok.decode([t for t in greedy if t != tok.eos_token_id]), rows[0][1]
    quality = json.loads((tmp_path / "stdlib-v2-1steps-4prompts" / "quality.json").read_text())
    assert quality["held_out_loss"] > 0 and 0 <= quality["greedy_repeat_share"] <= 1, quality
    assert 0 <= quality["greedy_repeated_lines"] <= 1 and 0 <= quality["corpus_repeated_lines"] < 0.1, quality
    assert any("held-out loss" in line for line in logs), logs
    logs.clear()
    assert tiny_world.tiny_world(tmp_path, 1, logs.append, train_prompts=4, max_new_tokens=3) == (target, data)
    assert logs == [], f"the cached world was rebuilt: {logs}"
    assert [p.name for p in tmp_path.iterdir()] == ["stdlib-v2-1steps-4prompts"], "a temporary folder was left behind"


def test_the_world_is_the_same_float32_world_on_every_cpu(tmp_path, monkeypatch, small_build):
    """A CPU that multiplies bf16 in hardware builds the very world a float32-only CPU builds: the
    same name, the same conversations, a float32 target."""
    from harness import target as target_module
    built = {}
    for hardware_bf16 in (True, False):
        monkeypatch.setattr(target_module, "native_bf16_cpu", lambda: hardware_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: hardware_bf16)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware_bf16)
        folder = tmp_path / str(hardware_bf16)
        target, data = tiny_world.tiny_world(folder, 1, lambda *a: None, train_prompts=2, max_new_tokens=3)
        built[hardware_bf16] = ([p.name for p in folder.iterdir()], open(data).read(),
                                AutoModelForCausalLM.from_pretrained(target).dtype)
    assert built[True] == built[False], f"the worlds differ: {built[True][0]} vs {built[False][0]}"
    assert built[True][0] == ["stdlib-v2-1steps-2prompts"] and built[True][2] == torch.float32, built[True][::2]


def test_tiny_world_race_keeps_the_first_build(tmp_path, monkeypatch, small_build):
    """Another process finishes while this one builds: its world stays, ours is dropped."""
    world = tmp_path / "stdlib-v2-1steps-2prompts"
    real = tiny_world.regenerate_conversations

    def finish_elsewhere(*a, **k):
        (world / "target").mkdir(parents=True)
        (world / "marker").write_text("theirs")
        return real(*a, **k)
    monkeypatch.setattr(tiny_world, "regenerate_conversations", finish_elsewhere)
    monkeypatch.setattr(tiny_world, "pretrain_tiny_target", lambda tokenizer, *a, **k: tiny_qwen3(  # any target: the race is the point
        len(tokenizer), dtype=torch.float32, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    target, _ = tiny_world.tiny_world(tmp_path, 1, lambda *a: None, train_prompts=2, max_new_tokens=1)
    assert target == str(world / "target") and (world / "marker").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == [world.name], "a temporary folder was left behind"


def record_builds(monkeypatch):
    """offline_world with the world's build replaced by a record of where it was asked for: -> that record."""
    asked = []

    def build(cache_dir, pretrain_steps, log):
        asked.append(cache_dir)
        return os.path.join(cache_dir, "target"), os.path.join(cache_dir, "conversations.jsonl")
    monkeypatch.setattr(tiny_world, "tiny_world", build)
    return asked


def test_dflash2_cache_moves_the_offline_world(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    try:
        importlib.reload(tiny_world)  # the variable is read once, at import
        asked, logs = record_builds(monkeypatch), []
        got = tiny_world.offline_world(None, None, log=logs.append)
    finally:
        monkeypatch.undo()
        importlib.reload(tiny_world)
    assert asked == [str(tmp_path)], f"with DFLASH2_CACHE={tmp_path} the world was built in {asked}"
    assert got == (str(tmp_path / "target"), str(tmp_path / "conversations.jsonl")), got
    assert logs == [f"offline world cached in {tmp_path}"], logs


def test_a_target_without_data_trains_on_the_worlds_conversations(monkeypatch):
    builds = record_builds(monkeypatch)
    got = tiny_world.offline_world("my/target", None, log=lambda *a: None)
    want = ("my/target", os.path.join(tiny_world.CACHE_DIR, "conversations.jsonl"))
    assert got == want, f"--target my/target without --data trains {got[0]} on {got[1]}, expected {want}"
    assert tiny_world.offline_world("my/target", "chats.jsonl") == ("my/target", "chats.jsonl") and len(builds) == 1, \
        f"--target and --data given: the world was built anyway ({builds})"
