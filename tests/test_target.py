"""Tests of harness/target.py and of train.py on a real-model path: the mask-token rule, what --target
may name, the drafter's config of a target, a tiny random Llama folder (tied embeddings, GQA, a
ChatML template, a tokenizer with no mask token and no free embedding row) through regeneration,
training, export and speculative decoding, and a tiny Llama GGUF file written here. Everything is
built on the spot; no downloads, CPU only."""
import copy
import json

import datasets
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from harness import checkpoint, regenerate, target
import train
from conftest import ForcedLookup, plain_greedy, tiny_qwen3
from dflash2 import spec_generate, target_generate
from tests.conftest import tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

# ChatML as SmolLM2 writes it: no {% generation %} marks, the eos <|im_end|> ends every turn
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# after the 256 byte tokens, in this order: ids 256, 257, 258, ...
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<filename>"]
PAD, IM_START, IM_END, REPO_NAME, FILE_SEP, FILENAME = range(256, 262)


def byte_tokenizer(specials=SPECIALS, **roles):
    """Every byte a token (ids 0-255, BPE with no merges), then `specials` as special tokens at
    ids 256, 257, ...; `roles` names the pad/eos/mask/... tokens among them. No mask token
    unless `roles` names one."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    roles = roles or dict(pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHATML, **roles)
    got = [tokenizer.convert_tokens_to_ids(s) for s in specials]
    assert got == list(range(256, 256 + len(specials))), f"specials got ids {got}, the tests expect 256, 257, ..."
    return tokenizer


# -----------------------------------------------------------------------------
# the mask token


def test_mask_token_is_the_lowest_free_added_token_the_data_never_holds():
    tokenizer = byte_tokenizer()
    V = len(tokenizer)
    assert V == 262, f"tokenizer of {V} tokens, expected 256 bytes + 6 specials"
    # no data given: <|im_start|> is the lowest added token that is not pad/eos
    got = target.choose_mask_token(tokenizer, V)
    assert got[0] == IM_START, f"no data: chose {got}, expected {IM_START} <|im_start|>"
    # the template's tokens occur in every row: the next free one is <repo_name>
    mask, why = target.choose_mask_token(tokenizer, V, used_ids=[10, 97, PAD, IM_START, IM_END])
    assert mask == REPO_NAME, f"mask token {mask}, expected {REPO_NAME} <repo_name>"
    assert why == "'<repo_name>', the lowest-id added token that is not bos/eos/pad/unk and never occurs in the " \
        "training rows", why
    mask, _ = target.choose_mask_token(tokenizer, V, used_ids=[IM_START, IM_END, REPO_NAME])
    assert mask == FILE_SEP, f"<repo_name> occurs in the data, mask token {mask}, expected {FILE_SEP} <file_sep>"
    mask, _ = target.choose_mask_token(tokenizer, V, used_ids=[IM_START, REPO_NAME, FILE_SEP])
    assert mask == FILENAME, f"mask token {mask}, expected {FILENAME} <filename>"
    # a bos token is no candidate either
    with_bos = byte_tokenizer(pad_token="<|endoftext|>", eos_token="<|im_end|>", bos_token="<|im_start|>")
    got = target.choose_mask_token(with_bos, V)
    assert got[0] == REPO_NAME, f"bos <|im_start|>: chose {got}, expected {REPO_NAME} <repo_name>"


def test_mask_token_refused_when_every_candidate_occurs_in_the_data():
    tokenizer = byte_tokenizer()
    with pytest.raises(ValueError) as refused:
        target.choose_mask_token(tokenizer, len(tokenizer), used_ids=[IM_START, REPO_NAME, FILE_SEP, FILENAME])
    message = str(refused.value)
    assert message.startswith("no free mask token:"), message
    assert "pass --drafter-config '{\"mask_token_id\": ID}'" in message, message
    for i, name in zip(range(256, 262), SPECIALS):  # every candidate named, with its id
        assert f"{i} {name!r}" in message, f"the refusal does not name candidate {i} {name!r}: {message}"


def test_mask_token_flag_tokenizer_mask_and_free_rows():
    tokenizer = byte_tokenizer()
    V = len(tokenizer)
    # a table padded past the vocabulary: its first row no token uses, even with data given
    got = target.choose_mask_token(tokenizer, V + 10, used_ids=[IM_START])
    assert got == (262, "the first embedding row no token uses"), f"table of {V + 10} rows: chose {got}, expected 262"
    # the tokenizer's own mask token wins over free rows and added tokens
    masked = byte_tokenizer(SPECIALS + ["<|mask|>"], pad_token="<|endoftext|>", eos_token="<|im_end|>",
                            mask_token="<|mask|>")
    got = target.choose_mask_token(masked, 300, used_ids=[])
    assert got == (262, "the tokenizer's mask token"), f"mask token <|mask|> 262: chose {got}"
    # ... unless it lies outside the embedding table: then the added-token rule applies
    got = target.choose_mask_token(masked, 262, used_ids=[IM_START])
    assert got[0] == REPO_NAME, f"<|mask|> 262 outside a table of 262 rows: chose {got}, expected {REPO_NAME}"


def test_mask_token_is_never_the_unk_token():
    """Llama-2's and Mistral's tokenizers have an added unk token (<unk>, id 0): unknown text maps
    to it, so its row is no free row."""
    with_unk = byte_tokenizer(pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<|im_start|>")
    assert with_unk.unk_token_id == IM_START, f"unk token {with_unk.unk_token_id}, the test wants {IM_START}"
    got = target.choose_mask_token(with_unk, len(with_unk))
    assert got[0] == REPO_NAME, f"unk <|im_start|>: chose {got}, expected {REPO_NAME} <repo_name>"


def test_mask_token_refuses_added_tokens_beyond_the_embedding_table():
    """A table of 259 rows holds the bytes, <|endoftext|>, <|im_start|> and <|im_end|>: the added
    tokens after them have no embedding row, so nothing is left and the refusal names the three."""
    tokenizer = byte_tokenizer()
    with pytest.raises(ValueError) as refused:
        target.choose_mask_token(tokenizer, IM_END + 1, used_ids=[IM_START])
    message = str(refused.value)
    named = [f"{i} {name!r}" for i, name in zip(range(256, 262), SPECIALS)]
    assert message.startswith("no free mask token:") and "\n" not in message, message
    assert all(n in message for n in named[:3]) and not any(n in message for n in named[3:]), \
        f"the refusal should name candidates {named[:3]} only: {message}"


# -----------------------------------------------------------------------------
# what --target names


def test_source_of_a_gguf_file_a_folder_and_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "model.Q4_1.GGUF").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)  # a relative path: from_pretrained gets the file's folder in full
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for name, want in (("model.Q4_1.GGUF", (str(tmp_path.resolve()), {"gguf_file": "model.Q4_1.GGUF"})),
                       ("model", ("model", {})), (hub, (hub, {}))):
        got = target.source(name)
        assert got == want, f"source({name!r}) = {got}, expected {want}"
        assert target.is_gguf(name) == (name != "model" and name != hub), f"is_gguf({name!r})"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^--target \S+empty: the folder has no config.json, it is not a Hugging "
                                         r"Face model folder$"):
        target.source(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"^--target \S+weights.bin: a file that is not .gguf; expected a model "
                                         r"folder, a hub id or a GGUF file$"):
        target.source(str(tmp_path / "weights.bin"))


# -----------------------------------------------------------------------------
# the drafter's config of a target


def qwen3_config():
    """test_dflash2.py's target: 96 tokens, width 32, four layers of 4 query and 2 key-value heads of 8."""
    return transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=256)


def test_drafter_config_refuses_no_mask_token_unknown_fields_and_unknown_rope():
    with pytest.raises(ValueError, match=r"drafter_config needs mask_token_id"):
        target.drafter_config(qwen3_config())
    with pytest.raises(ValueError, match=r"unknown DFlash2Config fields \['blocksize'\]"):
        target.drafter_config(qwen3_config(), mask_token_id=95, blocksize=8)
    with pytest.raises(ValueError, match=r"rope_type 'mrope' is not supported"):
        target.drafter_config(qwen3_config(), mask_token_id=95, rope_scaling={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs \['low_freq_factor'\]"):
        target.drafter_config(qwen3_config(), mask_token_id=95,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})


def test_drafter_config_copies_the_target_shape():
    c = target.drafter_config(qwen3_config(), mask_token_id=95)
    got = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
           c.num_target_layers, c.rope_theta)
    assert got == (32, 64, 4, 2, 8, 96, 4, 1e4), f"drafter shape {got} differs from the target's"


# -----------------------------------------------------------------------------
# a tiny Llama folder, end to end

PROMPTS = ["hi", "Continue this code:\nimport os\n", "what is 2 + 2?", "write a haiku", "x" * 30, "explain GQA"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama (4 layers, hidden 64, 4 query heads sharing 2 key-value heads, tied
    embeddings) whose vocabulary is the tokenizer's, every embedding row a token, saved as a
    model folder. <repo_name>, <file_sep> and <filename> never occur in chats: their rows are
    shrunk so that the random target never writes them either."""
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                                      pad_token_id=PAD, eos_token_id=IM_END, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[REPO_NAME:] *= 0.01
        model.model.embed_tokens.weight[IM_END] *= 2.5  # some answers stop before the limit, others run to it
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings are not tied"
    path = tmp_path_factory.mktemp("llama") / "target"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"path": str(path), "root": path.parent}



@pytest.fixture(scope="module")
def regenerated(llama):
    prompts, out = llama["root"] / "prompts.jsonl", llama["root"] / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    regenerate.main(regenerate.parse_args(["--target", llama["path"], "--data", str(prompts), "--out", str(out),
                                           "--max-new-tokens", "12", "--batch-size", "4", "--dtype", "float32"]),
                    log=lambda *a: None)
    return out


def test_regenerate_answers_every_prompt_with_the_targets_greedy_continuation(llama, regenerated):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama["path"])
    model = transformers.AutoModelForCausalLM.from_pretrained(llama["path"], dtype=torch.float32).eval()
    rows = [json.loads(line)["messages"] for line in regenerated.read_text().splitlines(keepends=False) if line]
    assert len(rows) == len(PROMPTS), f"{len(rows)} rows written, want {len(PROMPTS)}"
    stopped = []
    for prompt, row in zip(PROMPTS, rows):
        assert row[0] == {"role": "user", "content": prompt} and len(row) == 2 and row[1]["role"] == "assistant", row
        want, stop = plain_greedy(model, tokenizer, row[:1], 12)
        assert row[1]["content"] == want, f"prompt {prompt!r}: regenerated {row[1]['content']!r}, plain greedy {want!r}"
        stopped.append(stop)
    assert any(stopped) and not all(stopped), f"the test target should stop early on some prompts only: {stopped}"


def test_regenerate_renders_with_the_chat_template_flag(llama, tmp_path):
    """regenerate.py answers the prompts as --chat-template renders them, not as the tokenizer's
    own template does."""
    template = "{{ '<|im_start|>system\\nAnswer in French.<|im_end|>\\n' }}" + CHATML
    (tmp_path / "t.jinja").write_text(template)
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    regenerate.main(regenerate.parse_args(["--target", llama["path"], "--data", str(prompts), "--out", str(out),
                                           "--chat-template", str(tmp_path / "t.jinja"), "--max-new-tokens", "6",
                                           "--dtype", "float32"]),
                    log=lambda *a: None)
    got = [json.loads(line)["messages"][1]["content"] for line in out.read_text().split("\n")[:-1]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama["path"])
    model = transformers.AutoModelForCausalLM.from_pretrained(llama["path"], dtype=torch.float32).eval()
    own = [plain_greedy(model, tokenizer, [{"role": "user", "content": p}], 6)[0] for p in PROMPTS]
    tokenizer.chat_template = template
    want = [plain_greedy(model, tokenizer, [{"role": "user", "content": p}], 6)[0] for p in PROMPTS]
    assert want != own, f"both templates give the answers {want}: the test would not see which one rendered"
    assert got == want, f"regenerated {got}; the target's greedy answers under --chat-template are {want}"


def test_training_picks_the_lowest_free_added_token_and_exports_a_drafter_that_decodes_as_the_target(
        llama, regenerated, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    train.train(train.parse_args([
        "--target", llama["path"], "--data", str(regenerated), "--out-dir", str(out), "--steps", "2", "--seq-len", "64",
        "--batch-size", "2", "--block-size", "4", "--max-anchors", "4", "--val-size", "2", "--decode-prompts", "1",
        "--drafter-config", '{"selector_rank": 8}']))
    printed = capsys.readouterr().out
    # the chats hold <|im_start|> and <|im_end|>, <|endoftext|> is the pad: <repo_name> is the lowest one left
    want = (f"mask token {REPO_NAME}: '<repo_name>', the lowest-id added token that is not bos/eos/pad/unk and never "
            "occurs in the training rows")
    assert want in printed.splitlines(), f"no line {want!r} in the output:\n{printed}"
    assert "step     2/2 | loss " in printed, printed

    drafter = checkpoint.load_export(out / "checkpoint")
    assert drafter.config.mask_token_id == REPO_NAME, f"exported mask token {drafter.config.mask_token_id}"
    saved = torch.load(out / "resume.pt", weights_only=False)["model"]
    reloaded = drafter.state_dict()
    assert saved.keys() == reloaded.keys(), f"export tensors {sorted(reloaded)} != trained {sorted(saved)}"
    for name, tensor in saved.items():  # the export holds the trained weights rounded to bf16
        assert torch.equal(reloaded[name], tensor.bfloat16().float()), \
            f"{name}: the export reloads {(reloaded[name] - tensor).abs().max():.3g} away from the trained weights"

    model = target.load_target(llama["path"], "auto", torch.device("cpu"))
    tokenizer = target.load_tokenizer(llama["path"])
    decoded = 0
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        plain, _ = target_generate(model, torch.tensor([ids]), 24, stop_token_ids=[IM_END])
        spec, _ = spec_generate(drafter, model, torch.tensor([ids]), 24, stop_token_ids=[IM_END])
        assert spec.tolist() == plain.tolist(), \
            f"prompt {text!r}: spec_generate at T = 0\n{spec.tolist()}\ntarget_generate\n{plain.tolist()}"
        decoded += len(plain)
    assert decoded >= 48, f"only {decoded} tokens decoded over {len(PROMPTS)} prompts: too short a comparison"


# -----------------------------------------------------------------------------
# a tiny Llama GGUF file

GGUF_SHAPE = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64)


def llama_cpp_permute(w, n_head):
    """The q/k row order llama.cpp's convert_hf_to_gguf.py writes (its `permute`): per head, the
    two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A float32 llama GGUF: gpt2-style byte-level BPE (the 256 byte tokens, one merge 'Ġ t', three
    control tokens), a ChatML template, random weights; -> (path, the Hugging Face-layout
    tensors written, the vocabulary)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package writes the GGUF file (pip install gguf)")
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    s = GGUF_SHAPE
    H, head_dim = s["hidden"], s["hidden"] // s["heads"]
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(259)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    rand = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
    hf = {"model.embed_tokens.weight": rand(len(tokens), H), "model.norm.weight": 1 + rand(H)}
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    for i in range(s["layers"]):
        layer = {"self_attn.q_proj": rand(H, H), "self_attn.k_proj": rand(s["kv_heads"] * head_dim, H),
                 "self_attn.v_proj": rand(s["kv_heads"] * head_dim, H), "self_attn.o_proj": rand(H, H),
                 "mlp.gate_proj": rand(s["ffn"], H), "mlp.up_proj": rand(s["ffn"], H),
                 "mlp.down_proj": rand(H, s["ffn"]),
                 "input_layernorm": 1 + rand(H), "post_attention_layernorm": 1 + rand(H)}
        hf.update({f"model.layers.{i}.{k}.weight": v for k, v in layer.items()})
        for name, key, n_head in (("attn_q", "self_attn.q_proj", s["heads"]),
                                  ("attn_k", "self_attn.k_proj", s["kv_heads"])):
            w.add_tensor(f"blk.{i}.{name}.weight", llama_cpp_permute(layer[key], n_head))
        for name, key in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
                          ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{name}.weight", layer[key])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), hf, tokens


def test_gguf_target_loads_as_the_llama_written(gguf_file):
    path, hf, tokens = gguf_file
    s = GGUF_SHAPE
    config = target.load_config(path)
    got = (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
           config.num_key_value_heads, config.intermediate_size, config.vocab_size)
    assert got == ("llama", s["layers"], s["hidden"], s["heads"], s["kv_heads"], s["ffn"], len(tokens)), \
        f"config from the GGUF header (type, layers, hidden, heads, kv heads, ffn, vocab) {got}"
    tokenizer = target.load_tokenizer(path)
    ids = tokenizer("<|im_start|>user\nat tea", add_special_tokens=False)["input_ids"]
    # bytes, except ' t' (the merge) and the control token kept whole
    assert ids == [258, 117, 115, 101, 114, 10, 97, 116, 256, 101, 97], f"encoded {ids}"
    assert tokenizer.decode(ids) == "<|im_start|>user\nat tea", tokenizer.decode(ids)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>"), (tokenizer.eos_token,
                                                                                         tokenizer.pad_token)
    model = target.load_target(path, "float32", torch.device("cpu"))
    assert type(model) is transformers.LlamaForCausalLM, type(model)
    assert model.dtype == torch.float32 and not any(p.requires_grad for p in model.parameters())
    state = model.state_dict()
    for name, tensor in hf.items():  # q and k too: transformers undoes llama.cpp's permutation
        diff = (state[name] - torch.from_numpy(tensor)).abs().max()
        assert diff == 0, f"{name}: loaded {diff:.3g} away from the tensor written"
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"]), "no output.weight: lm_head is tied"


def test_gguf_export_job_writes_an_export_and_serving_commands_for_the_original_model(gguf_file, tmp_path):
    path, _, tokens = gguf_file
    out, logs = tmp_path / "out", []
    checkpoint.main(checkpoint.parse_args(["--target", path, "--out", str(out)]), logs.append)
    printed = "\n".join(logs)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"]) == (GGUF_SHAPE["hidden"], len(tokens)), config
    # bos <|endoftext|> and eos <|im_end|> (also the pad) are out; no data read: <|im_start|> is the first left
    assert config["dflash_config"]["mask_token_id"] == 258, config["dflash_config"]
    commands = [line for line in logs if line.startswith(("vllm serve", "python -m sglang", "pip install"))]
    assert len(commands) == 3, f"serving commands printed:\n{printed}"
    assert all("ORIGINAL_MODEL" in c and path not in c for c in commands), "\n".join(commands)
    assert "put the hub id or folder of the model it was converted from in place of ORIGINAL_MODEL" in printed, printed


def test_a_gguf_targets_speculators_export_names_original_model_as_its_verifier(gguf_file, tmp_path):
    """vLLM serves a speculators export with the verifier its config.json names: for a GGUF target that is the model
    it was converted from, which only the user can name (ORIGINAL_MODEL, and a line saying where), never the file."""
    path, logs = gguf_file[0], []
    checkpoint.main(checkpoint.parse_args(["--target", path, "--out", str(tmp_path / "out"), "--format",
                                           "speculators"]), logs.append)
    verifier = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "ORIGINAL_MODEL", f"the export's verifier is {verifier}"
    printed = "\n".join(logs)
    assert "in the export's config.json (speculators_config.verifier.name_or_path) put the hub id or folder of the " \
        "model it was converted from in place of ORIGINAL_MODEL" in printed, printed


def test_an_upper_case_gguf_name_is_served_as_original_model(tmp_path):
    """A GGUF file is a GGUF file whatever the case of its suffix: the serving commands name
    ORIGINAL_MODEL, never the file (engines do not serve a drafter's target from it)."""
    path = tmp_path / "Model.Q4_1.GGUF"
    path.write_bytes(b"GGUF")
    path = str(path)
    served = checkpoint.served_target(path)
    commands = checkpoint.serving_commands(served, str(tmp_path / "out"), 8)
    assert served == "ORIGINAL_MODEL" and all("ORIGINAL_MODEL" in c and path not in c for c in commands), commands


# -----------------------------------------------------------------------------
# the dtype of a CPU target


@pytest.mark.parametrize("amx, avx512_bf16, want", [(False, True, torch.bfloat16), (True, False, torch.bfloat16),
                                                    (False, False, torch.float32)])
def test_auto_dtype_on_a_cpu_is_bf16_where_either_bf16_unit_exists(monkeypatch, amx, avx512_bf16, want):
    """--dtype auto on a CPU: bf16 with AMX or with AVX512-BF16 alone (EPYC Zen 4 has no AMX),
    float32 with neither (bf16 would be emulated)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    got, why = target.training_dtype("auto", torch.device("cpu"))
    assert got == want, f"AMX {amx}, AVX512-BF16 {avx512_bf16}: auto chose {got} ({why}), expected {want}"


# -----------------------------------------------------------------------------
# TargetFeatures: the target's features of each training row, once


def right_padded(seqs):
    """Token-id lists -> (ids, attention_mask) (b, S), right-padded with 0."""
    S = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (S - len(s)) for s in seqs])
    return ids, torch.tensor([[1] * len(s) + [0] * (S - len(s)) for s in seqs])


@pytest.fixture(scope="module")
def feature_target():
    return tiny_qwen3(vocab_size=50, num_layers=3), [0, 1]  # float64; features of layers 0 and 1 and the last


def assert_served(served, model, layer_ids, seqs, what):
    """The (context, last hidden state) TargetFeatures served for the batch of `seqs` are each row's
    own: the model's Hugging Face hidden states of the row alone, at layer_ids (index l + 1) and the last."""
    for i, s in enumerate(seqs):
        with torch.no_grad():
            alone = model(torch.tensor([s]), output_hidden_states=True).hidden_states
        want = (torch.cat([alone[l + 1][0] for l in layer_ids], -1), alone[-1][0])
        for name, got, ref in zip(("context", "last hidden state"), served, want):
            err = (got[i, :len(s)] - ref).abs().max().item()
            assert err < 1e-10, f"{what}: row {i}, the {name} differs from the row's own by {err:.3g}"


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_a_batch_mixing_cached_and_new_rows_is_served_and_cached_right(feature_target, tmp_path, on_disk):
    """Rows a and b are cached by one batch; the next batch holds b (cached) and c (new) at other
    positions and padding: its features are each row's own, and c is cached by it, so a third
    batch of c and b needs no target pass."""
    model, layer_ids = feature_target
    cache = target.TargetFeatures({"k": 1}, layer_ids, tmp_path if on_disk else None)
    a, b, c = [3, 8, 1, 4, 4, 9, 2], [5, 6, 7, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]
    passes, forward = [], model.base_model.forward
    model.base_model.forward = lambda *x, **k: passes.append(1) or forward(*x, **k)
    try:
        for seqs, rows, want_passes in (([a, b], [0, 1], 1), ([b, c], [1, 2], 1), ([c, b], [2, 1], 0)):
            passes.clear()
            served = cache.features(model, *right_padded(seqs), rows=rows)
            assert len(passes) == want_passes, f"rows {rows}: {len(passes)} target passes, expected {want_passes} " \
                                               "(one for a batch with a new row, none for a cached batch)"
            assert_served(served, model, layer_ids, seqs, f"rows {rows}")
    finally:
        del model.base_model.forward


def test_a_row_file_killed_mid_write_is_never_read_back(feature_target, tmp_path, monkeypatch):
    """A kill while a row's file is written leaves no row file behind: a restarted run computes
    the row again instead of reading a torn file."""
    model, layer_ids = feature_target
    seqs, real = [[3, 8, 1, 4], [5, 6, 7]], safetensors.torch.save_file

    def killed_mid_write(tensors, filename, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[:len(data) // 2])
        raise KeyboardInterrupt

    make = lambda: target.TargetFeatures({"k": 1}, layer_ids, tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        make().features(model, *right_padded(seqs), rows=[0, 1])
    assert not list(tmp_path.glob("row*.safetensors")), f"a torn row file is left: {sorted(tmp_path.iterdir())}"
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert_served(make().features(model, *right_padded(seqs), rows=[0, 1]), model, layer_ids, seqs, "restarted")
    assert_served(make().features(model, *right_padded(seqs), rows=[0, 1]), model, layer_ids, seqs, "read back")
    assert len(list(tmp_path.glob("row*.safetensors"))) == 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (8,), (1, 9), (15,)], ids=["7 rows in a block", "8", "9", "15"])
def test_lm_head_rows_is_the_product_in_either_layout(shape, bias):
    """A draft block's logits through lm_head_rows against the float64 product: up to GEMV_ROWS rows as W·xᵀ (a
    block's leading dims kept), more in slices over a vocabulary that 512 does not divide, every slice in its place
    with its own bias."""
    torch.manual_seed(0)
    lm_head, x = torch.nn.Linear(24, 1300, bias=bias), torch.randn(*shape, 24)
    with torch.no_grad():
        got = target.lm_head_rows(lm_head, x)
        want = x.double() @ lm_head.weight.double().T + (lm_head.bias.double() if bias else 0)
    assert got.shape == (*shape, 1300) and float((got.double() - want).abs().max()) < 1e-5, \
        f"lm_head_rows differs from the float64 product by {float((got.double() - want).abs().max()):.3g}"


# -----------------------------------------------------------------------------
# --cache-target-features: which runs may share a cache, when auto caches, what the flag takes


@pytest.fixture(scope="module")
def bf16_numbers_target():
    """A 4-layer target whose weights are bf16 numbers, loaded in each dtype (as a target published in bf16 is):
    the two share the weights fingerprint, while their features differ by the dtype they are computed in."""
    model = tiny_qwen3(vocab_size=50, num_layers=4, dtype=torch.bfloat16)
    return {torch.bfloat16: model, torch.float32: copy.deepcopy(model).float()}


def feature_run(model, choice, layer_ids, rows, out_dir, rows_drawn=None, log=print):
    """--cache-target-features `choice` of a run on `model` reading `layer_ids` that draws rows_drawn rows (default:
    each row twice) -> its cache, every row's features in it."""
    c = target.drafter_config(model.config, mask_token_id=49, target_layer_ids=layer_ids)
    cache = target.feature_cache(choice, model, c, rows, 2 * len(rows) if rows_drawn is None else rows_drawn,
                                 str(out_dir), log)
    cache.features(model, *right_padded(rows["input_ids"]), rows=list(range(len(rows))))
    return cache


FEATURE_ROWS = datasets.Dataset.from_dict({"input_ids": [[3, 8, 1, 4, 4, 9], [5, 6, 7], [11, 12, 13, 14]]})


@pytest.mark.parametrize("first, second", [((torch.bfloat16, [0, 1]), (torch.float32, [0, 1])),
                                           ((torch.float32, [0, 1]), (torch.bfloat16, [0, 1])),
                                           ((torch.float32, [0, 1]), (torch.float32, [0, 2]))],
                         ids=["bf16 then float32", "float32 then bf16", "other layers"])
def test_a_shared_feature_cache_is_refused_to_a_run_whose_features_differ(bf16_numbers_target, tmp_path, first,
                                                                          second):
    """disk:FOLDER shared by two runs on one target's weights: a run of the same dtype and layers reads it back; one
    in another dtype, or reading other layers (as many), would read features that are not its own, and is refused
    before any row is read."""
    (dtype, layer_ids), folder = first, f"disk:{tmp_path / 'shared'}"
    for out in ("first", "again"):  # the same run twice: the second reads the first's rows
        feature_run(bf16_numbers_target[dtype], folder, layer_ids, FEATURE_ROWS, tmp_path / out)
    dtype, layer_ids = second
    with pytest.raises(ValueError) as refused:
        feature_run(bf16_numbers_target[dtype], folder, layer_ids, FEATURE_ROWS, tmp_path / "second")
    assert str(refused.value).startswith(f"--cache-target-features: {tmp_path / 'shared'} holds the features of"), \
        f"a {first} cache read by a {second} run: {refused.value}"


def test_auto_caches_the_features_only_when_a_row_is_drawn_twice(bf16_numbers_target, tmp_path):
    """auto is off while no row is used twice (fewer draws than rows, or each row exactly once: an epoch) and on
    (here in memory, the rows being tiny) from the first row drawn again."""
    model, n = bf16_numbers_target[torch.float32], len(FEATURE_ROWS)
    for drawn, cached in ((n - 1, False), (n, False), (n + 1, True)):
        logs = []
        cache = feature_run(model, "auto", [0, 1], FEATURE_ROWS, tmp_path, drawn, logs.append)
        assert cache.keep == cached and len(cache.rows) == (n if cached else 0), \
            f"{drawn} rows drawn of {n}: cached {cache.keep}, {len(cache.rows)} rows held, {logs}"
        assert logs[-1].startswith("target features: computed every step (no row is used twice" if not cached else
                                   "target features: cached in memory"), f"{drawn} rows drawn of {n}: {logs}"


def test_disk_without_a_folder_is_refused_by_the_parser_and_disk_caches_in_the_out_dir(bf16_numbers_target, tmp_path,
                                                                                        capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--cache-target-features", "disk:"])
    error = capsys.readouterr().err
    assert "argument --cache-target-features: 'disk:' is not auto, off, memory, disk or disk:FOLDER" in error, error
    args = train.parse_args(["--cache-target-features", "disk", "--out-dir", str(tmp_path / "out")])
    model = bf16_numbers_target[torch.float32]
    c = target.drafter_config(model.config, mask_token_id=49, target_layer_ids=[0, 1])
    cache = target.feature_cache(args.cache_target_features, model, c, FEATURE_ROWS, 2 * len(FEATURE_ROWS),
                                 args.out_dir, print)
    cache.features(model, *right_padded(FEATURE_ROWS["input_ids"]), rows=[0, 1, 2])
    files = sorted(p.name for p in (tmp_path / "out" / "target_features").iterdir())
    assert files == ["key.json", "row00000000.safetensors", "row00000001.safetensors", "row00000002.safetensors"], \
        f"--cache-target-features disk wrote {files} in OUT/target_features"


# -----------------------------------------------------------------------------
# the draft block's logits in decoding


class QuantizedHead(torch.nn.Linear):
    """An nn.Linear subclass as bitsandbytes' heads are: its weight holds codes, its forward dequantizes them."""
    def __init__(self, head, scale):
        super().__init__(head.in_features, head.out_features, bias=False, dtype=head.weight.dtype)
        self.scale = scale
        with torch.no_grad():
            self.weight.copy_(head.weight / scale)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.scale)


@pytest.mark.parametrize("case", ["bf16 target, float32 drafter", "quantized head"])
def test_the_decoding_views_logits_are_the_targets_own(case):
    """decoding_view's logits of a draft block against the target's forward: a bf16 target read by a float32 drafter
    (GPU evaluation, bench.real), and a head whose forward is not its weight's product."""
    model = tiny_qwen3(vocab_size=1300, dtype=torch.bfloat16 if case.startswith("bf16") else torch.float32)
    if case == "quantized head":
        model.lm_head = QuantizedHead(model.lm_head, 4.0)
    c = target.drafter_config(model.config, mask_token_id=1299)
    with torch.no_grad():
        out = model(torch.tensor([[3, 8, 1, 4, 4, 9, 2]]), output_hidden_states=True)
        got = target.decoding_view(c, model).logits(out.hidden_states[-1][0].float())  # the drafter's h: float32
    want = out.logits[0].double()
    error = float((got.double() - want).abs().max() / want.abs().max())
    assert error < 1e-2 if case.startswith("bf16") else error < 1e-5, \
        f"{case}: the decoding view's logits differ from the target's by {error:.3g} (relative)"


def test_verifying_in_rows_keeps_greedy_decoding_the_targets_and_puts_its_head_back():
    """spec_generate inside verifying_in_rows with a lookup right for 12 (all), none (the drafter drafts), 3 and 7 of
    its 12 tokens: 5-row verifications of the drafter's B = 5 block as W·xᵀ, 13-row ones in lm_head_rows' slices of a
    1300-token vocabulary. The output is target_generate's, run outside the block; inside, the target's logits are
    the float64 product of its final hidden states; after the block, and after one that raised, its own head is back."""
    model = tiny_qwen3(vocab_size=1300, num_layers=3)
    drafter = tiny_drafter(model, block_size=5, target_layer_ids=[0, 1])
    prompt, head = torch.tensor([[5, 9, 1, 7, 40]]), model.get_output_embeddings()
    plain, _ = target_generate(model, prompt, 42)  # 12 past the 30 decoded: what the lookup's last draft reads
    lookup = ForcedLookup(prompt[0].tolist() + plain.tolist(), [12, None, 3, 7], 12, 1300)
    with target.verifying_in_rows(model):
        spec, stats = spec_generate(drafter, model, prompt, 30, lookup=lookup)
        with torch.no_grad():
            out = model(prompt, output_hidden_states=True)
        want = out.hidden_states[-1].double() @ head.weight.double().T
        assert isinstance(model.get_output_embeddings(), target.RowsHead)
        assert float((out.logits.double() - want).abs().max()) < 1e-9, "the rows head's logits are not the product"
    assert spec.tolist() == plain[:30].tolist(), f"verifying in rows: {spec.tolist()}\ntarget_generate: {plain[:30]}"
    assert {"lookup", "drafter"} <= set(stats.sources) and max(stats.acceptance_lengths) == 13, \
        f"sources {stats.sources}, acceptance lengths {stats.acceptance_lengths}: a whole 12-token lookup wanted"
    assert model.get_output_embeddings() is head, "the target's own head is not back after the block"
    with pytest.raises(KeyboardInterrupt):
        with target.verifying_in_rows(model):
            raise KeyboardInterrupt
    assert model.get_output_embeddings() is head, "the target's own head is not back after a block that raised"


def test_one_residual_stream_a_layer_is_a_plain_residual_not_a_hyper_connection():
    """hc_mult or hc_count 1 counts one residual stream a layer, a plain residual: the drafter is built as without
    the field; 2 streams are refused by name."""
    plain = target.drafter_config(qwen3_config(), mask_token_id=95)
    for field in target.HYPER_CONNECTION_FIELDS:
        config = qwen3_config()
        setattr(config, field, 1)
        try:
            c = target.drafter_config(config, mask_token_id=95)
        except ValueError as refused:
            pytest.fail(f"a target with {field} = 1 (one residual stream) was refused: {refused}")
        assert c == plain, f"{field} = 1 built {c}, without the field {plain}"
        setattr(config, field, 2)
        with pytest.raises(ValueError, match=f"hyper-connections \\({{'{field}': 2}}\\)"):
            target.drafter_config(config, mask_token_id=95)
