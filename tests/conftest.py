"""Builders and fixtures of the second tier's tests that need the package (harness/) besides
dflash2.py; those that need dflash2.py alone are the top conftest.py's, which the card's tests
read too. tests/ is a package so that this conftest and the top one are two modules. The world
here is a saved model folder and a data file, for the entry points that read paths: train.py,
python -m harness.checkpoint and python -m harness.regenerate."""
import functools
import json

import pytest
import torch
import transformers

from conftest import tiny_qwen3
from dflash2 import DFlash2Drafter
from harness import tiny_world
from harness.target import drafter_config, rope_tables


def tiny_drafter(target, seed=1, dtype=torch.float64, **overrides):
    """A random drafter for `target` (1 layer, mask token V - 1 unless overridden) whose DFlash2
    parts are off their identity init: the selector's codebooks and projection are random (so
    q depends on the predecessor) and the convolution has nonzero off-centre taps and dynamic
    kernels. A rope_scaling override takes its tables from harness.target.rope_tables."""
    torch.manual_seed(seed)
    shape = dict(mask_token_id=target.config.vocab_size - 1, num_layers=1, conv_group_size=8, selector_rank=4)
    c = drafter_config(target.config, **{**shape, **overrides})
    drafter = DFlash2Drafter(c, rope=rope_tables(c))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("candidate_selector."):
                p.normal_(0, 1.5)
            elif "_conv." in name:
                p.add_(0.3 * torch.randn_like(p))
    return drafter.to(dtype).eval()


CONVERSATION = [{"role": "user", "content": "Continue this code:\nimport os\n"},
                {"role": "assistant", "content": "def f(x):\n    return x + 1\n"}]


def save_tiny_target(path, tokenizer, vocab_size=None):
    """A random float32 Qwen3 for `tokenizer` (4 layers, hidden 64; an embedding table of vocab_size rows, default
    len(tokenizer)) and the tokenizer, saved as a model folder."""
    tiny_qwen3(vocab_size or len(tokenizer), hidden_size=64, num_layers=4, head_dim=32, dtype=torch.float32,
               tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    convs = tiny_world.stdlib_conversations(chunk_chars=120)[:24]  # short rows: answers survive --seq-len
    return {"root": root, "target": save_tiny_target(root / "target", tiny_world.build_tiny_tokenizer()),
            "data": write_jsonl(root / "data.jsonl", [{"messages": c} for c in convs])}


@pytest.fixture
def no_target_load(monkeypatch):
    """What must run on the target's config and tokenizer alone (the checks of the data, the untrained export)
    fails here if it loads the target's weights."""
    def refuse(*a, **k):
        raise AssertionError("the target's weights were loaded")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def small_world(monkeypatch):
    """tiny_world builds from 120 stdlib conversations, 8 of them held out, instead of all of them (7000+) and
    256, and pretrains on 2 windows of 64 tokens a step instead of 8 of 256: nothing the tests check depends on
    those sizes, and at full size they are nearly all of a build's time (tokenizing the library, a step,
    answering and measuring the held-out conversations)."""
    convs, pretrain = tiny_world.stdlib_conversations(chunk_chars=600)[:120], tiny_world.pretrain_tiny_target
    monkeypatch.setattr(tiny_world, "stdlib_conversations", lambda **kw: convs)
    monkeypatch.setattr(tiny_world, "TINY_HELD_OUT", 8)
    monkeypatch.setattr(tiny_world, "pretrain_tiny_target", functools.partial(pretrain, seq_len=64, batch_size=2))
