"""
The frozen target of train.py: where it lives, its tokenizer, config and weights, the check
that the drafter reads its tables as its own forward does, and the mask token the drafter's
blocks are filled with (ALGORITHM.md §1).

    tokenizer = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")    # a hub id or a model folder
    model = load_target("path/to/model.Q4_1.gguf", "auto", torch.device("cpu"))   # or a GGUF file
    features = TargetFeatures(key, layer_ids)   # each row's features once (--cache-target-features)

A GGUF file is read by transformers itself (the `gguf` package), dequantized to the dtype
asked for: the file's folder and name go to `from_pretrained(folder, gguf_file=name)`.
"""
import hashlib
import json
import os
from pathlib import Path

import safetensors.torch
import torch
import transformers

import dflash2
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


def native_bf16_cpu():
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16). There a bf16
    product runs several times faster than a float32 one; elsewhere torch emulates bf16, slower."""
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_amx_tile_supported",
                                                                        "_is_avx512_bf16_supported"))


def training_dtype(flag, device):
    """--dtype -> (the target's dtype for training and batched generation, why). Below float32
    the drafter's step also runs under bf16 autocast (its weights and optimizer stay float32)."""
    if flag != "auto":
        return getattr(torch, flag), f"--dtype {flag}"
    if device.type == "cuda":
        return torch.bfloat16, "a GPU"
    if native_bf16_cpu():
        return torch.bfloat16, "this CPU multiplies bf16 in hardware (AMX or AVX512-BF16)"
    return torch.float32, "this CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated and slower"


def decoding_dtype(device, dtype):
    """The target's dtype for decoding one sequence: one token at a time is bound by reading the
    weights, and on a CPU a float32 step beats a bf16 one even with AMX (bench/RESULTS.md)."""
    return torch.float32 if device.type == "cpu" else dtype


def model_class(config):
    """The auto class that builds a target of this config: its causal LM, or for a multimodal wrapper that has
    none (Muse-Glimmer) its image-text-to-text model. The drafter reads either through its language model:
    get_text_config(), get_input_embeddings(), get_output_embeddings() and the forward's hidden states."""
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise ValueError(f"the {config.model_type!r} target has neither a causal-LM nor an image-text-to-text class in "
                     "transformers: the drafter needs a model that predicts the next token")


def load_target(target, dtype_flag, device):
    """Frozen, in training_dtype(dtype_flag, device)."""
    path, kw = source(target)
    model = model_class(load_config(target)).from_pretrained(path, dtype=training_dtype(dtype_flag, device)[0], **kw)
    return model.to(device).eval().requires_grad_(False)


# Families whose embedding module RMS-normalises the rows, without a weight, before the first layer. Their
# published drafter configs declare no transform, and the engines embed the raw rows: the drafter follows the
# engines (ALGORITHM.md §1), and the check holds the target's embeddings to its rows normalised.
NORMALISED_EMBEDDINGS = {"muse_glimmer_text"}


@torch.no_grad()
def check_target_view(c, target, ids):
    """The drafter's view of the target against the target's own forward on ids (1, n): embed_tokens
    must give its hidden_states[0] (RMS-normalised first for NORMALISED_EMBEDDINGS) and target_logits of
    its last hidden state its logits. A family whose forward does anything else to its tables is refused
    by name, before any training."""
    embed, lm_head = dflash2.check_target(c, target)
    out = target(ids, output_hidden_states=True)
    tolerance = 1e-4 if embed.weight.dtype in (torch.float32, torch.float64) else 3e-2
    tc = target.config.get_text_config()
    rows = dflash2.embed_tokens(c, embed, ids)
    if tc.model_type in NORMALISED_EMBEDDINGS:
        rows = torch.nn.functional.rms_norm(rows.float(), rows.shape[-1:], eps=tc.rms_norm_eps)
    for what, ours, theirs in (
            ("embeddings (hidden_states[0])", rows, out.hidden_states[0]),
            ("logits", dflash2.target_logits(c, lm_head, out.hidden_states[-1]), out.logits)):
        ours, theirs = ours.double(), theirs.double()
        error = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-30))
        if not error <= tolerance:
            raise ValueError(f"the {target.config.model_type!r} target's {what} differ from what the drafter computes "
                             f"from its tables (relative difference {error:.2g}): its forward transforms them in a way "
                             "this implementation does not follow (it knows embedding scales, logit multipliers and "
                             "final-logit soft-capping)")


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


# -----------------------------------------------------------------------------
# the target's features, computed once per row


@torch.no_grad()
def target_features(target, ids, attention_mask, layer_ids):
    """What the loss reads of the target for a batch (ALGORITHM.md §1, §6), from its decoder alone:
    -> context (b, S, nf·H), its hidden states at layer_ids concatenated (Hugging Face index l + 1),
    and last_hidden (b, S, H), after the final norm. The loss applies lm_head where it needs it,
    never to (b, S, V) at once. (Through the whole model even one position's logits cost a copy of
    lm_head per row on a CPU: the last position is a strided slice, which matmul cannot fold.)"""
    states = target.base_model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return torch.cat([states[l + 1] for l in layer_ids], -1), states[-1]


def token_digest(ids):
    return hashlib.sha256(ids.cpu().long().numpy().tobytes()).hexdigest()


class TargetFeatures:
    """What the loss reads of the frozen target (the context layers' and the last hidden states)
    for each training row, computed at the row's first use and reused in later epochs: in memory,
    or with `folder` one safetensors file per row there (a killed run's files are reused).

    A cache belongs to one target and one set of rows: `key` (the target's weights fingerprint,
    the layer ids, the dtype) is checked against the folder's, and each row's tokens against
    those its features were computed for; a mismatch is refused, never reused."""

    def __init__(self, key, layer_ids, folder=None):
        self.layer_ids, self.folder, self.rows = list(layer_ids), folder, {}
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        key_file = Path(folder) / "key.json"
        if key_file.is_file():
            held = json.loads(key_file.read_text())
            if held != key:
                raise ValueError(f"--cache-target-features: {folder} holds the features of {held}, not of this run's "
                                 f"{key}; delete the folder or choose another --out-dir")
        else:
            tmp = key_file.with_name(f"key.json.tmp{os.getpid()}")
            tmp.write_text(json.dumps(key))
            os.replace(tmp, key_file)

    @staticmethod
    def row_bytes(num_tokens, num_layer_ids, hidden_size, dtype):
        return num_tokens * (num_layer_ids + 1) * hidden_size * dtype.itemsize

    def _path(self, row):
        return Path(self.folder) / f"row{row:08d}.safetensors"

    def _get(self, row, ids):
        """-> the row's (n, (nf + 1)·H) features, or None when not computed yet."""
        if self.folder is None:
            held = self.rows.get(row)
        elif self._path(row).is_file():
            with safetensors.safe_open(self._path(row), "pt") as f:
                held = f.metadata()["tokens"], f.get_tensor("features")
        else:
            held = None
        if held is None:
            return None
        if held[0] != token_digest(ids):
            raise ValueError(f"--cache-target-features: training row {row} holds other tokens than the ones its cached "
                             "features were computed for; the cache belongs to other data")
        return held[1]

    def _put(self, row, ids, features):
        if self.folder is None:
            self.rows[row] = token_digest(ids), features.clone()
            return
        tmp = self._path(row).with_name(f"{self._path(row).name}.tmp{os.getpid()}")
        safetensors.torch.save_file({"features": features.contiguous()}, tmp, metadata={"tokens": token_digest(ids)})
        os.replace(tmp, self._path(row))

    def features(self, target, ids, attention_mask, rows):
        """target_features of a right-padded batch (ids, attention_mask (b, S)) whose rows are the
        training rows `rows`: -> context (b, S, nf·H), last_hidden (b, S, H), zero past each row's
        length (masked there). One target pass over the batch if any of its rows is not cached yet."""
        lengths = attention_mask.sum(1).tolist()
        held = [self._get(r, ids[i, :n]) for i, (r, n) in enumerate(zip(rows, lengths))]
        if any(h is None for h in held):
            context, last = target_features(target, ids, attention_mask, self.layer_ids)
            for i, (r, n) in enumerate(zip(rows, lengths)):
                if held[i] is None:
                    self._put(r, ids[i, :n], torch.cat([context[i, :n], last[i, :n]], -1).cpu())
            return context, last
        b, S = ids.shape
        features = torch.zeros(b, S, held[0].shape[-1], dtype=held[0].dtype, device=ids.device)
        for i, (h, n) in enumerate(zip(held, lengths)):
            features[i, :n] = h
        H = features.shape[-1] // (len(self.layer_ids) + 1)
        return features[..., :-H], features[..., -H:]
