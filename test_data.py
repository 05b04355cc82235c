"""Tests of data.py: on-policy regeneration, reading chat files, assistant masks, training rows.
Tiny random targets and byte-level tokenizers built on the spot; no downloads, CPU only."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import data as D
import tiny_world as W

# -----------------------------------------------------------------------------
# on-policy regeneration


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 in float64 (so cached, padded and plain forwards agree to the last
    bit) whose eos row is scaled up so that some answers stop early and others run to the limit."""
    tokenizer = W.build_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      initializer_range=0.5, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 3
    return model, tokenizer


def plain_greedy(model, tokenizer, messages, max_new_tokens):
    """Argmax loop over full forwards of the unpadded prompt: no cache, no batch. -> (text, stopped)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            tok = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
        if tok == tokenizer.eos_token_id:
            return tokenizer.decode(new), True
        new.append(tok)
    return tokenizer.decode(new), False


CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a longer first question " * 3},
     {"role": "assistant", "content": "old 1"}, {"role": "user", "content": "and then?"},
     {"role": "assistant", "content": "old 2"}, {"role": "user", "content": "trailing"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "old"}, {"role": "user", "content": "yy"},
     {"role": "assistant", "content": "old"}, {"role": "user", "content": "zzz"}, {"role": "assistant", "content": "o"}],
    [{"role": "user", "content": "no answer here"}],
    [{"role": "user", "content": "medium length prompt"}, {"role": "assistant", "content": "old"}],
]


def test_regenerated_turns_are_the_targets_greedy_continuations(target):
    model, tokenizer = target
    n = 12
    want, stopped = [], []
    for chat in CHATS:  # each assistant turn answers the conversation so far, earlier turns already replaced
        chat = [dict(m) for m in chat]
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
        got = D.regenerate_conversations(model, tokenizer, CHATS, max_new_tokens=n, batch_size=batch_size,
                                         progress=lambda done, total: calls.append((done, total)))
        for c, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"batch_size {batch_size}, conversation {c}: regenerated\n{g}\nplain greedy\n{w}"
        assert calls[-1] == (7, 7), f"progress calls {calls}, expected to end at (7, 7) assistant turns"
    assert CHATS == before, "regenerate_conversations modified its input"


def test_sampling_is_seeded_by_the_generator(target):
    model, tokenizer = target
    runs = [D.regenerate_conversations(model, tokenizer, CHATS, temperature=1.0, max_new_tokens=8, batch_size=2,
                                       generator=torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    assert runs[0] == runs[1], f"same seed, different samples:\n{runs[0]}\n{runs[1]}"
    assert runs[0] != runs[2], "seeds 1 and 2 gave identical samples"
