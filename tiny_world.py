"""
The offline world of `python train.py` with no --target: a tokenizer, conversations and a
small Qwen3 target pretrained from scratch, all built once from the running Python's own
standard library and cached, so the drafter then trains through exactly the code path a
real Hugging Face target folder takes.
"""
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import transformers

# ChatML; {% generation %} marks assistant tokens, so return_assistant_tokens_mask works
CHATML = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
          "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TINY_HELD_OUT = 256  # the last stdlib conversations: the tiny target never trains on them (keep --val-size below)


def build_tiny_tokenizer(chat_template=CHATML):
    """Every byte is a token (BPE with no merges), plus the ChatML specials and a mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", additional_special_tokens=["<|im_start|>"],
                                   chat_template=chat_template)


def stdlib_conversations(chunk_chars=300, seed=0):
    """Cut the top-level .py files of this Python's standard library into chunks of whole
    lines; the first third of a chunk is the prompt, the rest the answer. Shuffled, so the
    held-out tail samples the whole library."""
    convs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunk = ""
        for line in f.read_text(encoding="utf-8", errors="ignore").splitlines(keepends=True):
            chunk += line
            if len(chunk) >= chunk_chars:
                lines, chunk = chunk.splitlines(keepends=True), ""
                cut = max(1, len(lines) // 3)
                if "".join(lines[cut:]).strip():
                    convs.append([{"role": "user", "content": "Continue this code:\n" + "".join(lines[:cut])},
                                  {"role": "assistant", "content": "".join(lines[cut:])}])
    perm = torch.randperm(len(convs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [convs[i] for i in perm]


def pretrain_tiny_target(tokenizer, conversations, steps, log=print, seq_len=512, batch_size=8, lr=3e-3, seed=0):
    """Next-token pretraining of a 1.8M-parameter Qwen3 on the rendered conversations."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=576,
                                      num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.Qwen3ForCausalLM(config)
    render = lambda c: tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"][:seq_len]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = transformers.get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps)
    gen, t0 = torch.Generator().manual_seed(seed), time.time()
    for step in range(steps):
        picks = torch.randint(len(conversations), (batch_size,), generator=gen).tolist()
        batch = tokenizer.pad({"input_ids": [render(conversations[i]) for i in picks]}, return_tensors="pt")
        ids, attn = batch["input_ids"], batch["attention_mask"]
        loss = model(input_ids=ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"pretrain tiny target {step + 1}/{steps} | loss {loss.item():.3f} | {time.time() - t0:.0f}s")
    return model.eval()


def tiny_world(cache_dir, pretrain_steps, log=print):
    """Build once and cache: stdlib conversations (.jsonl) and the tiny target folder
    (model + tokenizer via save_pretrained). -> (target path, data path)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    data, target = cache / "stdlib-conversations.jsonl", cache / f"tiny-qwen3-stdlib-{pretrain_steps}steps"
    if not data.exists():
        tmp = data.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in stdlib_conversations()))
        os.replace(tmp, data)
    if not target.exists():
        log(f"building the offline tiny target in {target} (first run only)")
        convs = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
        tokenizer = build_tiny_tokenizer()
        model = pretrain_tiny_target(tokenizer, convs[:-TINY_HELD_OUT], pretrain_steps, log)
        tmp = cache / f"{target.name}.tmp{os.getpid()}"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process built it first: keep theirs
            shutil.rmtree(tmp)
    return str(target), str(data)
