"""Tests of harness/regenerate.py: on-policy answers are the target's own greedy (or seeded)
continuations, resumable files, prompt-only rows, and the job `python -m harness.regenerate` on a
saved target (tests/conftest.py's world). A tiny random target and a byte-level tokenizer built on
the spot; no downloads, CPU only."""
import itertools
import json
import math
import re

import datasets
import pytest
import torch
import transformers

from harness import regenerate, tiny_world
from conftest import plain_greedy, tiny_qwen3
from harness.target import load_tokenizer
from tests.conftest import CONVERSATION, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 in float64 (so cached, padded and plain forwards agree to the last
    bit) whose eos row is scaled up so that some answers stop early and others run to the limit."""
    tokenizer = tiny_world.build_tiny_tokenizer()
    model = tiny_qwen3(len(tokenizer), head_dim=16, initializer_range=0.5, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 3
    return model, tokenizer


CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a longer first question " * 3},
     {"role": "assistant", "content": "old 1"}, {"role": "user", "content": "and then?"},
     {"role": "assistant", "content": "old 2"}, {"role": "user", "content": "trailing"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "old"}, {"role": "user", "content": "yy"},
     {"role": "assistant", "content": "old"}, {"role": "user", "content": "zzz"},
     {"role": "assistant", "content": "o"}],
    [{"role": "user", "content": "no answer here"}],
    [{"role": "user", "content": "medium length prompt"}, {"role": "assistant", "content": "old"}],
]


def test_regenerated_turns_are_the_targets_greedy_continuations(target):
    model, tokenizer = target
    n = 12
    want, stopped = [], []
    for chat in CHATS:  # each assistant turn answers the conversation so far, earlier turns already replaced
        chat = [dict(m) for m in chat] + [{"role": "assistant"}] * (chat[-1]["role"] == "user")  # and a last user turn
        for i, m in enumerate(chat):
            if m["role"] == "assistant":
                text, stop = plain_greedy(model, tokenizer, chat[:i], n)
                chat[i] = {"role": "assistant", "content": text}
                stopped.append(stop)
        want.append(chat)
    assert any(stopped) and not all(stopped), f"the test target should stop early on some turns only: {stopped}"
    before = [[dict(m) for m in c] for c in CHATS]
    for batch_size in (1, 3, 8):  # batches mix rows of different lengths: left padding must not matter
        calls = []
        got = regenerate.regenerate_conversations(model, tokenizer, CHATS, max_new_tokens=n, batch_size=batch_size,
                                                  progress=lambda done, total: calls.append((done, total)))
        for c, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"batch_size {batch_size}, conversation {c}: regenerated\n{g}\nplain greedy\n{w}"
        assert calls[-1] == (9, 9), f"progress calls {calls}, expected to end at (9, 9): 7 assistant turns, 2 last " \
            "user turns answered"
    assert CHATS == before, "regenerate_conversations modified its input"


def test_batched_positions_count_real_tokens_only_on_a_target_without_rope():
    """GPT-2 adds a learned embedding of each absolute position: a left-padded row whose positions
    counted its padding would see other embeddings (RoPE targets cannot tell, only differences
    of positions reach their attention). Reference: each prompt alone, argmax over full forwards."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     initializer_range=0.5, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    want = []
    for prompt in prompts:
        new = []
        with torch.no_grad():
            while len(new) < 6 and (tok := int(model(torch.tensor([prompt + new])).logits[0, -1].argmax())) != 0:
                new.append(tok)
        want.append(new)
    got = regenerate.generate(model, prompts, {0}, 6, pad_id=0)
    assert got == want, f"batched, left-padded decoding {got}; each prompt alone {want}"


def test_sampling_is_seeded_by_the_generator(target):
    model, tokenizer = target
    runs = [regenerate.regenerate_conversations(model, tokenizer, CHATS, temperature=1.0, max_new_tokens=8, batch_size=2,
                                          generator=torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    assert runs[0] == runs[1], f"same seed, different samples:\n{runs[0]}\n{runs[1]}"
    assert runs[0] != runs[2], "seeds 1 and 2 gave identical samples"


def test_regenerate_file_resumes_after_a_kill(target, tmp_path, monkeypatch):
    model, tokenizer = target
    chats = [c for c in CHATS if any(m["role"] == "assistant" for m in c)] * 2  # 8 conversations
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    opts = dict(temperature=0.0, max_new_tokens=6, batch_size=3, template_kwargs=None, log=lambda *a: None)
    regenerate.regenerate_file(model, tokenizer, str(src), str(tmp_path / "straight.jsonl"), **opts)
    straight = (tmp_path / "straight.jsonl").read_text()
    rows = straight.count("\n")  # not splitlines(): a random target's text may hold U+2028
    assert rows == len(chats), f"{rows} rows written, want {len(chats)}"

    real, calls = regenerate.regenerate_conversations, []

    def die_on_second_batch(*a, **k):
        calls.append(len(a[2]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "killed.jsonl"
    monkeypatch.setattr(regenerate, "regenerate_conversations", die_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        regenerate.regenerate_file(model, tokenizer, str(src), str(out), **opts)
    with open(out, "a") as f:  # a kill in the middle of writing a line
        f.write('{"messages": [{"role": "user", "con')
    calls.clear()
    logs = []
    monkeypatch.setattr(regenerate, "regenerate_conversations", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    regenerate.regenerate_file(model, tokenizer, str(src), str(out), **{**opts, "log": logs.append})
    assert calls == [3, 2], f"the resumed run regenerated batches of {calls}, expected the 5 unwritten rows as [3, 2]"
    assert out.read_text() == straight, "resumed output differs from the uninterrupted run's"
    assert any("torn last line" in l for l in logs) and any("eta" in l for l in logs), logs


def test_a_sampled_regenerate_file_repeats_itself_and_resumes_to_the_same_rows(target, tmp_path, monkeypatch):
    """At T = 1 the file's answers are fixed by `seed`: a second run writes the same rows, and a run
    killed after its first batch resumes to exactly the uninterrupted run's file."""
    model, tokenizer = target
    chats = [c for c in CHATS if any(m["role"] == "assistant" for m in c)] * 2  # 8 conversations
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    opts = dict(temperature=1.0, max_new_tokens=6, batch_size=3, template_kwargs=None, log=lambda *a: None)

    def run(name, seed):
        regenerate.regenerate_file(model, tokenizer, str(src), str(tmp_path / name), seed=seed, **opts)
        return (tmp_path / name).read_text()

    torch.manual_seed(0)
    straight = run("straight.jsonl", 7)
    torch.manual_seed(1)  # the global generator is not the one that draws
    assert run("again.jsonl", 7) == straight, "seed 7 twice, different rows"
    assert run("other.jsonl", 8) != straight, "seeds 7 and 8 wrote the same rows"
    real, calls = regenerate.regenerate_conversations, []

    def die_on_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(regenerate, "regenerate_conversations", die_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        run("killed.jsonl", 7)
    monkeypatch.setattr(regenerate, "regenerate_conversations", real)
    assert (tmp_path / "killed.jsonl").read_text().count("\n") == 3, "the killed run should have written one batch"
    assert run("killed.jsonl", 7) == straight, "the resumed sampled run differs from the uninterrupted one"


def test_each_sampled_batch_draws_from_its_own_seed(target, tmp_path, monkeypatch):
    """At T = 1 regenerate_file seeds every batch's generator apart: three batches of one same
    prompt never repeat each other's answers, and each batch's rows are what
    regenerate_conversations draws from the seed recorded for it, replayed on a fresh generator."""
    model, tokenizer = target
    chat = [{"role": "user", "content": "hi"}]
    src = tmp_path / "in.jsonl"
    src.write_text((json.dumps({"messages": chat}) + "\n") * 6)
    opts = dict(temperature=1.0, max_new_tokens=8, batch_size=2)
    real, seeds = regenerate.regenerate_conversations, []
    monkeypatch.setattr(regenerate, "regenerate_conversations",
                        lambda *a, **k: seeds.append(k["generator"].initial_seed()) or real(*a, **k))
    regenerate.regenerate_file(model, tokenizer, str(src), str(tmp_path / "out.jsonl"), template_kwargs=None,
                               log=lambda *a: None, seed=3, **opts)
    rows = [json.loads(line)["messages"] for line in (tmp_path / "out.jsonl").read_text().split("\n")[:-1]]
    batches = [rows[b:b + 2] for b in range(0, 6, 2)]
    assert len(set(seeds)) == 3, f"the 3 batches drew from the seeds {seeds}"
    assert all(a != b for a, b in itertools.combinations(batches, 2)), \
        f"batches of the same prompt repeat each other's answers: {[[r[1]['content'] for r in b] for b in batches]}"
    for b, (seed, written) in enumerate(zip(seeds, batches)):
        replayed = real(model, tokenizer, [chat] * 2, generator=torch.Generator().manual_seed(seed), **opts)
        assert replayed == written, f"batch {b}: wrote {written}, its recorded seed {seed} draws {replayed}"


def test_regeneration_keeps_tool_calls_and_the_fields_it_does_not_replace(target, tmp_path):
    model, tokenizer = target
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "look it up",
             "tool_calls": [{"type": "function", "id": "abcdefghi",
                             "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi", "name": "get"},
            {"role": "assistant", "content": "old", "reasoning_content": "old reasoning", "weight": 0.5},
            {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "old 2"}]
    want = [dict(m) for m in chat]
    for i in (3, 5):  # the turns after the tool result are the target's; the tool-call turn stays as it was
        text, _ = plain_greedy(model, tokenizer, want[:i], 6)
        want[i] = {**{k: v for k, v in want[i].items() if k != "reasoning_content"}, "content": text}
    calls = []
    got = regenerate.regenerate_conversations(model, tokenizer, [chat], max_new_tokens=6,
                                        progress=lambda done, total: calls.append((done, total)))
    assert got == [want], f"regenerated\n{got[0]}\nexpected\n{want}"
    assert calls[-1] == (2, 2), f"progress {calls}: 2 turns are regenerated, the tool-call turn is not one"
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    src, out, logs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", []
    src.write_text(json.dumps({"messages": chat, "tools": tools}) + "\n")
    regenerate.regenerate_file(model, tokenizer, str(src), str(out), temperature=0.0, max_new_tokens=6, batch_size=2,
                         template_kwargs=None, log=logs.append)
    assert json.loads(out.read_text()) == {"messages": want, "tools": tools}, out.read_text()
    assert any("1 assistant turns with tool calls are kept as they are" in l for l in logs), logs


def test_regeneration_stops_at_every_eos_id_of_the_generation_config(target, monkeypatch):
    """A target's generation_config may list several eos ids (Llama 3 lists <|eot_id|> and
    <|end_of_text|>): decoding stops at each of them, not only at the tokenizer's eos."""
    model, tokenizer = target
    text, _ = plain_greedy(model, tokenizer, CHATS[0][:1], 12)
    stop = tokenizer(text, add_special_tokens=False)["input_ids"][3]  # a token of its answer (checked below)
    eos = [tokenizer.eos_token_id, stop]
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    want, cut = [], 0
    for chat in CHATS:
        chat = [dict(m) for m in chat] + [{"role": "assistant"}] * (chat[-1]["role"] == "user")
        for i, m in enumerate(chat):
            if m["role"] == "assistant":
                chat[i] = {"role": "assistant", "content": plain_greedy(model, tokenizer, chat[:i], 12, {stop})[0]}
                cut += chat[i]["content"] != plain_greedy(model, tokenizer, chat[:i], 12)[0]
        want.append(chat)
    assert cut, f"no answer holds token {stop}: the test would not see it stop decoding"
    got = regenerate.regenerate_conversations(model, tokenizer, CHATS, max_new_tokens=12, batch_size=4)
    for c, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"generation_config eos {eos}, conversation {c}: regenerated\n{g}\nplain greedy\n{w}"


def test_a_regenerated_turn_drops_every_reasoning_field(target):
    """The new content holds the target's own reasoning as it writes it: the old reasoning goes,
    under each of its names; the turn's other fields stay."""
    model, tokenizer = target
    chat = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "old", "reasoning": "r1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "old", "thinking": "r2", "weight": 2},
            {"role": "user", "content": "u3"}, {"role": "assistant", "content": "old", "reasoning_content": "r3"}]
    got = regenerate.regenerate_conversations(model, tokenizer, [chat], max_new_tokens=4)[0]
    kept = [sorted(m) for m in got]
    want = [["content", "role"]] * 3 + [["content", "role", "weight"]] + [["content", "role"]] * 2
    assert kept == want, f"fields of the regenerated conversation {kept}, expected {want}: {got}"


def test_a_row_that_ends_with_a_tool_result_gets_no_answer_turn(target):
    """Only a last user turn asks for an answer: after a tool result, the next assistant turn
    would answer results regeneration cannot check, so the row stays as it is."""
    model, tokenizer = target
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "abcdefghi",
                                                                  "function": {"name": "get", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi", "name": "get"}]
    calls = []
    got = regenerate.regenerate_conversations(model, tokenizer, [chat], max_new_tokens=4,
                                              progress=lambda done, total: calls.append((done, total)))
    assert got == [chat] and calls == [], f"regenerated {got} (progress {calls}), expected the row as it is"


def test_resuming_a_regeneration_whose_rows_hold_line_separators(target, tmp_path):
    """U+2028 and U+2029 end a line for str.splitlines, not for JSON lines: a resumed run counts
    the rows written by newlines only."""
    model, tokenizer = target
    chats = [[{"role": "user", "content": f"row {n}\u2028with a line separator\u2029"}] for n in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in chats), encoding="utf-8")
    opts = dict(temperature=0.0, max_new_tokens=3, batch_size=1, template_kwargs=None, log=lambda *a: None)
    regenerate.regenerate_file(model, tokenizer, str(src), str(tmp_path / "straight.jsonl"), **opts)
    straight = (tmp_path / "straight.jsonl").read_text(encoding="utf-8")
    assert "\u2028" in straight, "the output lost the line separators the test is about"
    killed = tmp_path / "killed.jsonl"
    killed.write_text(straight[:straight.index("\n") + 1], encoding="utf-8")  # a run killed after its first row
    regenerate.regenerate_file(model, tokenizer, str(src), str(killed), **opts)
    assert killed.read_text(encoding="utf-8") == straight, "the resumed output differs from the uninterrupted run's"


TOOLS_CHATML = ("{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for t in tools %}"
                "{{- ' ' + t['function']['name'] }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + tiny_world.CHATML)


def test_each_regeneration_batch_renders_with_its_own_rows_tools(target, tmp_path, monkeypatch):
    model, tokenizer = target
    monkeypatch.setattr(tokenizer, "chat_template", TOOLS_CHATML)
    chat = [{"role": "user", "content": "what now?"}]
    tools = [[{"type": "function", "function": {"name": name, "parameters": {}}}] for name in ("get_weather", "now")]
    want = [plain_greedy(model, tokenizer, chat, 6, tools=t)[0] for t in tools]
    assert want[0] != want[1], f"both tool lists give the answer {want[0]!r}: the test would not see them mixed"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"messages": chat, "tools": t}) + "\n" for t in tools))
    regenerate.regenerate_file(model, tokenizer, str(src), str(out), temperature=0.0, max_new_tokens=6, batch_size=1,
                               template_kwargs=None, log=lambda *a: None)
    got = [json.loads(line) for line in out.read_text().split("\n")[:-1]]
    assert got == [{"messages": [*chat, {"role": "assistant", "content": w}], "tools": t} for w, t in zip(want, tools)], \
        f"regenerated {got}, the target's greedy answers with each row's tools {want}"


@pytest.mark.parametrize("case", ["other prompt", "not ours", "too many"])
def test_regenerate_file_refuses_output_of_other_data(target, tmp_path, case):
    model, tokenizer = target
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    row = json.dumps({"messages": CHATS[0]}) + "\n"
    lines, match = {"other prompt": ([{"messages": [{"role": "user", "content": "other"}, CHATS[0][1]]}],
                                     r"out\.jsonl: line 1: its non-assistant turns differ from the input's"),
                    "not ours": (["[1]"], r"out\.jsonl: line 1: not a row this command wrote \('\[1\]'\)"),
                    "too many": ([row, row], r"out\.jsonl: 2 rows already, more than the 1 of the input")}[case]
    out.write_text("".join((l if isinstance(l, str) else json.dumps(l)).rstrip("\n") + "\n" for l in lines))
    with pytest.raises(ValueError, match=match):
        regenerate.regenerate_file(model, tokenizer, str(src), str(out), temperature=0.0, max_new_tokens=4, batch_size=2,
                             template_kwargs=None, log=lambda *a: None)


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"max_new_tokens": 2.5}, {"batch_size": 0}])
def test_regenerate_refuses_bad_arguments(target, bad):
    model, tokenizer = target
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=rf"^{name} must be .*, got {value!r}$"):
        regenerate.regenerate_conversations(model, tokenizer, CHATS, **bad)


@pytest.mark.parametrize("bad", [{"temperature": float("nan")}, {"temperature": -1.0}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.5}])
def test_regenerate_refuses_bad_sampling_settings(target, bad):
    model, tokenizer = target
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=rf"^{name} \({value!r}\) must be"):
        regenerate.regenerate_conversations(model, tokenizer, CHATS, **bad)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1", "--top-k", "1"]])
def test_regenerate_writes_the_targets_own_greedy_answers(world, tmp_path, sampling):
    """Greedy, and sampled at top-k 1 (the flags reach the sampler: unfiltered, T = 1 draws others)."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATION}] * 2)
    regenerate.main(regenerate.parse_args(["--target", world["target"], "--data", data, "--out",
                                           str(tmp_path / "out.jsonl"), "--max-new-tokens", "12", *sampling]),
                    log=lambda *a: None)
    rows = [json.loads(line)["messages"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(world["target"], None)
    model = transformers.AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    want, _ = plain_greedy(model, tokenizer, CONVERSATION[:1], 12)
    assert len(rows) == 2 and all(r[0] == CONVERSATION[0] and r[1] == {"role": "assistant", "content": want}
                                  for r in rows), f"regenerated {rows} ({sampling}), the target's greedy answer is " \
                                                  f"{want!r}"


def test_regenerate_reads_the_data_split_it_is_given(world, tmp_path, monkeypatch):
    """--data-split reaches the regeneration itself, not only the check before the weights load:
    a hub dataset's "validation" rows are the ones regenerated."""
    splits = {name: [{"messages": [{"role": "user", "content": f"{name} prompt {i}"}]} for i in range(2)]
              for name in ("train", "validation")}
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda source, split: asked.append(split) or splits[split])
    out = tmp_path / "out.jsonl"
    regenerate.main(regenerate.parse_args(["--target", world["target"], "--data", "someone/chats",
                                           "--data-split", "validation", "--out", str(out),
                                           "--max-new-tokens", "2"]),
                    log=lambda *a: None)
    prompts = [json.loads(line)["messages"][0]["content"] for line in out.read_text().split("\n")[:-1]]
    assert prompts == ["validation prompt 0", "validation prompt 1"], f"regenerated {prompts} (splits read: {asked})"
    assert set(asked) == {"validation"}, f"splits read: {asked}"


@pytest.mark.parametrize("flags, message", [
    (["--out", None], "needs --target (who answers), --data (the conversations) and --out"),
    (["--top-p", "1.5"], "top_p (1.5) must be in (0, 1]"),
    (["--temperature", "-1"], "temperature (-1.0) must be a finite number >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--chat-template-kwargs", "{nope"], "--chat-template-kwargs"),
])
def test_regenerate_refuses_bad_flags_before_the_target_loads(world, tmp_path, monkeypatch, flags, message):
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATION}])
    monkeypatch.setattr(regenerate, "load_target", lambda *a: pytest.fail("the target loaded"))
    argv = ["--target", world["target"], "--data", data, "--out", str(tmp_path / "out.jsonl")]
    if flags[1] is None:
        argv = argv[:argv.index(flags[0])]
    else:
        argv += flags
    with pytest.raises(ValueError, match=re.escape(message)):
        regenerate.main(regenerate.parse_args(argv), log=lambda *a: None)
    assert not (tmp_path / "out.jsonl").exists()


def test_sampled_regeneration_is_seeded_by_the_runs_seed(world, tmp_path, monkeypatch):
    """At T > 0 every draw takes a generator (seeded from --seed): two runs with the same seed
    write the same file, another seed writes another."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATION}] * 3)
    sample, generators = regenerate.dflash2.sample, []

    def recording(logits, temperature, top_p=1.0, top_k=0, generator=None):
        generators.append(generator)
        return sample(logits, temperature, top_p, top_k, generator)

    monkeypatch.setattr(regenerate.dflash2, "sample", recording)

    def run(name, seed):
        torch.manual_seed(len(generators))  # the global generator differs between runs: it must not be the one used
        regenerate.main(regenerate.parse_args(
            ["--target", world["target"], "--data", data, "--out", str(tmp_path / name), "--max-new-tokens", "12",
             "--temperature", "1", "--batch-size", "2", "--seed", str(seed)]), log=lambda *a: None)
        return (tmp_path / name).read_text()

    first, again, other = run("a.jsonl", 3), run("b.jsonl", 3), run("c.jsonl", 4)
    assert generators and all(isinstance(g, torch.Generator) for g in generators), \
        f"the sampler got {set(map(type, generators))}, not a torch.Generator on every draw"
    assert first == again, f"--seed 3 twice, different answers:\n{first}\n{again}"
    assert first != other, "--seed 3 and --seed 4 gave the same answers: the seed does not reach the draws"


def allowed_tokens(logits, temperature, top_p, top_k):
    """The tokens a top-k / top-p request may draw from one row of logits, written out: the k
    largest (all if k = 0), then of those, by descending probability, every token until their
    probabilities first sum to top_p (the one that crosses included)."""
    order = sorted(range(len(logits)), key=lambda t: -float(logits[t]))[:top_k or len(logits)]
    weights = [math.exp((float(logits[t]) - float(logits[order[0]])) / temperature) for t in order]
    kept, mass = set(), 0.0
    for t, w in zip(order, weights):
        kept.add(t)
        mass += w / sum(weights)
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p, top_k", [(1.0, 1), (1.0, 3), (0.5, 0), (0.7, 4)])
def test_regeneration_samples_only_inside_the_filtered_set(target, top_p, top_k):
    """At T = 1 with top-k / top-p, every regenerated token lies in the set the setting allows,
    judged by allowed_tokens on the logits of a plain forward (no cache, no padding) of the
    prompt and the tokens before it; top-k = 1 is the target's greedy answer. The sets hold
    several tokens at some steps, so drawing from the unfiltered softmax(z / T) would show."""
    model, tokenizer = target
    chats = [c[:[m["role"] for m in c].index("user") + 1] for c in CHATS]  # up to the first user turn
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
               for c in chats]
    stops = {tokenizer.eos_token_id}
    sizes = []
    for seed in range(3):
        answers = regenerate.generate(model, prompts, stops, 10, tokenizer.pad_token_id, 1.0, top_p, top_k,
                                      torch.Generator().manual_seed(seed))
        for prompt, answer in zip(prompts, answers):
            for j, tok in enumerate(answer):
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + answer[:j]])).logits[0, -1]
                kept = allowed_tokens(logits, 1.0, top_p, top_k)
                sizes.append(len(kept))
                assert tok in kept, f"top_p {top_p}, top_k {top_k}, seed {seed}: token {j} of the answer to " \
                                    f"{prompt} is {tok}, outside the allowed set {sorted(kept)}"
    if top_k == 1:
        want = [plain_greedy(model, tokenizer, c, 10)[0] for c in chats]
        got = regenerate.regenerate_conversations(model, tokenizer, chats, temperature=1.0, top_k=1,
                                                  max_new_tokens=10, generator=torch.Generator())
        got = [c[-1]["content"] for c in got]
        assert got == want, f"regenerated at T = 1, top-k 1:\n{got}\nthe target's greedy answers:\n{want}"
    else:
        assert max(sizes) >= 2 and max(sizes) < len(tokenizer) // 2, \
            f"top_p {top_p}, top_k {top_k}: allowed sets of {min(sizes)}..{max(sizes)} tokens cannot tell a " \
            "filtered draw from an unfiltered one"
