"""
The frozen target of train.py: where it lives, its tokenizer, config and weights, and the
mask token the drafter's blocks are filled with (ALGORITHM.md §1).

    tokenizer = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")    # a hub id or a model folder
    model = load_target("path/to/model.Q4_1.gguf", "auto", torch.device("cpu"))   # or a GGUF file

A GGUF file is read by transformers itself (the `gguf` package), dequantized to the dtype
asked for: the file's folder and name go to `from_pretrained(folder, gguf_file=name)`.
"""
from pathlib import Path

import torch
import transformers

from data import load_chat_template


def source(target):
    """--target -> (what from_pretrained reads, its keyword arguments). A local folder must be a
    model folder and a local file a .gguf: anything else that exists locally is a mistake, not a
    hub id (transformers would otherwise blame a missing tokenizer package)."""
    p = Path(target)
    if p.is_dir() and not (p / "config.json").is_file():
        raise ValueError(f"--target {target}: the folder has no config.json, it is not a Hugging Face model folder")
    if p.exists() and not p.is_dir():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"--target {target}: a file that is not .gguf; expected a model folder, a hub id or "
                             "a GGUF file")
        return str(p.resolve().parent), {"gguf_file": p.name}
    return target, {}


def is_gguf(target):
    return bool(source(target)[1])


def load_tokenizer(target, chat_template=None):
    """The target's tokenizer, with --chat-template's text if given and a pad token."""
    path, kw = source(target)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kw)
    if chat_template:
        tokenizer.chat_template = load_chat_template(chat_template)
    if tokenizer.pad_token is None:  # padding is masked everywhere, any real token will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(target):
    """The target's transformers config; a GGUF file's is read from its header, no weights."""
    path, kw = source(target)
    try:
        return transformers.AutoConfig.from_pretrained(path, **kw)
    except Exception as e:  # missing folder, malformed JSON, unknown model type, not cached
        raise ValueError(f"cannot read the target's config at {target!r}: {e}") from e


def load_target(target, dtype_flag, device):
    """Frozen, in bfloat16 on GPU and float32 on CPU unless --dtype says otherwise."""
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if dtype_flag == "auto" else \
        getattr(torch, dtype_flag)
    path, kw = source(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device)
    return model.eval().requires_grad_(False)


# -----------------------------------------------------------------------------
# the mask token


def choose_mask_token(flag, tokenizer, num_rows, used_ids=None):
    """The id whose embedding row fills a block's MASK slots: a row of the target's embedding
    table that the data never holds (ALGORITHM.md §1). In order:
    1. --mask-token-id, if given;
    2. the tokenizer's mask token;
    3. the lowest embedding row that no token uses (tables are often padded past the vocabulary);
    4. the lowest-id added or special token that is not the bos, eos, pad or unk token and is
       not in `used_ids` (every id of the training rows: the template's own tokens are there).
    -> (id, how it was chosen). Refuses, naming the candidates, when nothing is left."""
    if flag is not None:
        if not 0 <= flag < num_rows:
            raise ValueError(f"--mask-token-id {flag} is outside the target's embedding table [0, {num_rows})")
        return flag, "--mask-token-id"
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < num_rows:
        return tokenizer.mask_token_id, "the tokenizer's mask token"
    unused = sorted(set(range(num_rows)) - set(tokenizer.get_vocab().values()))
    if unused:
        return unused[0], "the first embedding row no token uses"
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    added = sorted(i for i in tokenizer.added_tokens_decoder if i < num_rows)
    used = set() if used_ids is None else set(used_ids)
    free = [i for i in added if i not in roles and i not in used]
    if not free:
        names = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in added) or "none"
        raise ValueError(f"no free mask token: the tokenizer has no mask token, every embedding row is a token, and "
                         f"every added or special token is the bos/eos/pad/unk token or occurs in the training data "
                         f"(candidates: {names}); pass --mask-token-id with an id the data never holds")
    return free[0], (f"{tokenizer.convert_ids_to_tokens(free[0])!r}, the lowest-id added token that is not "
                     "bos/eos/pad/unk" + (" and never occurs in the training rows" if used_ids is not None else ""))
