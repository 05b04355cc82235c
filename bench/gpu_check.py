"""
The GPU check: one CUDA GPU of 80 GB or more (the Qwen3-8B step without grad checkpointing
plans 62 GiB), sized to finish in under 8 minutes on an H200. Three parts:

  pipeline    the default run end to end: the tiny world and train.py with its defaults,
              then the trained export decodes held-out prompts in fp32: spec_generate's
              greedy output against the target's own, token for token, and the real
              acceptance length and tokens/s at T = 0 and T = 1 (train.py's own end-of-run
              eval, bf16 target, is reported too);
  real scale  training steps at the Qwen3-4B and Qwen3-8B shapes with random weights (bf16
              target, fp32 drafter under autocast; seq 3072, 512 anchors, B = 16, 5 draft
              layers, loss chunk 1024, batch 1): peak memory measured against
              memory.memory_plan's estimate and tokens/s, with and without gradient
              checkpointing, and the step time of DFlash2 against DFlash at the 4B shape;
  draft step  bf16 draft-step latency of DFlash and DFlash2 at the Qwen3-4B shape
              (bench.cost's draft step), the walk's share of it, and the weight-bytes floor.

It prints one table and writes gpu_check.json to --out after each part; a part that
fails is recorded with its error and the others still run. It exits with status 1 if a
part failed or spec_generate's greedy output differs from the target's.
--cpu-smoke (automatic without CUDA) runs the same code on the CPU at small shapes: seconds
on one CPU thread once the quick tiny world (bench.ablation --quick's) is cached.

python -m bench.gpu_check               # one CUDA GPU
python -m bench.gpu_check --cpu-smoke   # the same code at small shapes on the CPU
"""
import argparse
import json
import os
import tempfile
import time
import traceback

import torch

import dflash2
from harness import checkpoint, tiny_world
from bench.common import QWEN3_4B, QWEN3_8B, prompts_of, quick_world, random_target, validation_rows
from bench.cost import draft_part, train_step_cost, variant_drafters
from harness.memory import GiB, memory_plan, sizing_config

# small shapes of the CPU smoke run
SMOKE_TARGET = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024)
SMOKE_STEP = dict(seq_len=96, max_anchors=12, block_size=8, num_layers=2, loss_chunk=20)
REAL_STEP = dict(seq_len=3072, max_anchors=512, block_size=16, num_layers=5, loss_chunk=1024)


def pipeline(device, cache_dir, smoke, prompts=8, max_new_tokens=96):
    """train.py's default run (the quick world and 4 steps with smoke), then the export
    against the fp32 target on held-out prompts."""
    import train
    import transformers
    if smoke:
        world = quick_world(cache_dir)
        flags = ["--steps", "4", "--batch-size", "4", "--seq-len", "256", "--drafter-config", '{"selector_rank": 16}',
                 "--val-size", "8", "--decode-prompts", "1"]
        prompts, max_new_tokens = 2, 16
    else:
        world, flags = tiny_world.tiny_world(cache_dir, tiny_world.PRETRAIN_STEPS), []
    with tempfile.TemporaryDirectory() as out:  # the run's files are not the check's output
        args = train.parse_args(["--target", world[0], "--data", world[1], "--out-dir", out, *flags])
        t0 = time.time()
        summary = train.train(args)
        train_seconds = time.time() - t0
        drafter = checkpoint.load_export(os.path.join(out, "checkpoint")).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    stop = [tokenizer.eos_token_id]
    equal, al, spec_tps, plain_tps = [], {0.0: [], 1.0: []}, [], []
    for p in prompts_of(validation_rows(args, tokenizer), prompts):
        p = p.to(device)
        spec, s = dflash2.spec_generate(drafter, target, p, max_new_tokens, stop_token_ids=stop)
        plain, b = dflash2.target_generate(target, p, max_new_tokens, stop_token_ids=stop)
        equal.append(torch.equal(spec, plain))
        al[0.0].append(s.mean_acceptance_length)
        spec_tps.append(s.tokens_per_second)
        plain_tps.append(b.tokens_per_second)
        g = torch.Generator(device).manual_seed(len(equal))
        al[1.0].append(dflash2.spec_generate(drafter, target, p, max_new_tokens, 1.0, stop_token_ids=stop,
                                             generator=g)[1].mean_acceptance_length)
    mean = lambda xs: sum(xs) / len(xs)
    return {"train_steps": args.steps, "train_seconds": train_seconds, "train_eval_al": [summary["al_t0"],
            summary["al_t1"]], "prompts": len(equal), "max_new_tokens": max_new_tokens, "greedy_equal": equal,
            "al_t0": mean(al[0.0]), "al_t1": mean(al[1.0]), "spec_tokens_per_s_t0": mean(spec_tps),
            "target_tokens_per_s": mean(plain_tps), "ok": all(equal)}


def real_scale(shape, device, step, repeats, compare):
    """Peak memory (CUDA only) against the plan and tokens/s of a DFlash2 drafter's training
    steps with and without gradient checkpointing; with compare also DFlash2 / DFlash."""
    cuda = device.type == "cuda"
    overrides = dict(num_layers=step["num_layers"], block_size=step["block_size"], mask_token_id=shape["vocab"] - 1)
    target = random_target(dtype=torch.bfloat16 if cuda else torch.float32, device=device, **shape)
    with torch.device(device):
        drafter = dflash2.DFlash2Drafter(sizing_config(target.config, **overrides))
    out = {"shape": {**shape, **step}}
    for checkpointed in (False, True):
        drafter.grad_checkpoint = checkpointed
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds = train_step_cost(target, {"DFlash2": drafter}, 1, step["seq_len"], step["max_anchors"],
                                  step["loss_chunk"], repeats=repeats, warmup=1)["DFlash2"]  # warm-up: AdamW state
        plan = memory_plan(target.config, step["seq_len"], step["max_anchors"], 1, step["loss_chunk"], checkpointed,
                           amp=cuda, target_bytes=2 if cuda else 4, **overrides)
        out["grad_checkpoint" if checkpointed else "plain"] = {
            "plan_gib": plan["peak"] / GiB, "measured_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda
            else None, "step_s": seconds, "tokens_per_s": step["seq_len"] / seconds}
    del drafter
    if compare:
        drafters = variant_drafters(target.config, ("DFlash", "DFlash2"), device=device, **overrides)
        seconds = train_step_cost(target, drafters, 1, step["seq_len"], step["max_anchors"], step["loss_chunk"],
                                  repeats=repeats, warmup=1)
        out["train_ratio_dflash2_vs_dflash"] = seconds["DFlash2"] / seconds["DFlash"]
        del drafters
    del target
    if cuda:
        torch.cuda.empty_cache()
    return out


def table(results):
    """The one table the check prints: (part, what, value) rows."""
    rows = [(part, "FAILED", r["error"]) for part, r in results.items() if isinstance(r, dict) and "error" in r]
    if "pipeline" in results and "error" not in results["pipeline"]:
        p = results["pipeline"]
        rows += [("pipeline", f"train.py, {p['train_steps']} steps", f"{p['train_seconds']:.0f} s; its eval AL T=0 "
                  f"{p['train_eval_al'][0]:.2f}, T=1 {p['train_eval_al'][1]:.2f}"),
                 ("pipeline", f"fp32 greedy spec_generate == target, {p['prompts']} prompts",
                  f"{sum(p['greedy_equal'])}/{p['prompts']} equal" + ("" if p["ok"] else "  FAILED")),
                 ("pipeline", f"fp32 mean AL, <= {p['max_new_tokens']} new tokens",
                  f"T=0 {p['al_t0']:.2f}, T=1 {p['al_t1']:.2f}"),
                 ("pipeline", "tokens/s at T=0", f"spec {p['spec_tokens_per_s_t0']:.0f}, target alone "
                  f"{p['target_tokens_per_s']:.0f}")]
    for name in ("Qwen3-4B", "Qwen3-8B"):
        if name in results and "error" not in results[name]:
            r = results[name]
            for key in ("plain", "grad_checkpoint"):
                m = r[key]
                measured = f"{m['measured_gib']:.1f} GiB measured vs " if m["measured_gib"] is not None else ""
                rows.append((name, f"training step, {key.replace('_', ' ')}",
                             f"peak {measured}{m['plan_gib']:.1f} GiB planned; {m['tokens_per_s']:.0f} tok/s"))
            if "train_ratio_dflash2_vs_dflash" in r:
                rows.append((name, "training step DFlash2 / DFlash", f"× {r['train_ratio_dflash2_vs_dflash']:.3f}"))
    if "draft_step" in results and "error" not in results["draft_step"]:
        d = results["draft_step"]
        v, s = d["variants"], d["shape"]
        for k in ("DFlash", "DFlash2"):
            rows.append(("draft step", f"{k}, {s['dtype']}, context {s['context']}",
                         f"{v[k]['ms']:.3f} ms (× DFlash {'{:.3f} [{:.3f}, {:.3f}]'.format(*v[k]['ratio_vs_dflash'])}, floor "
                         f"× {v[k]['floor_ratio_vs_dflash']:.3f})"))
        rows.append(("draft step", "walk alone", f"{v['walk alone']['ms']:.3f} ms "
                     f"({100 * v['walk alone']['ms'] / v['DFlash2']['ms']:.1f}% of DFlash2's step)"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="small shapes on the CPU (automatic without CUDA; "
                   "train.py still picks its own device)")
    p.add_argument("--out", dest="out_dir", default="bench_out", help="where gpu_check.json goes")
    p.add_argument("--cache-dir", default=tiny_world.CACHE_DIR,
                   help="train.py's offline-world cache")
    return p.parse_args(argv)


def main(args):
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if not args.cpu_smoke and smoke:
        print("no CUDA device: running the CPU smoke check (--cpu-smoke)", flush=True)
    device = torch.device("cpu" if smoke else "cuda")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "gpu_check.json")
    results, t0 = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(device)}, time.time()

    def done(part, value):  # written after each part: a run cut short keeps what it measured
        results[part], results["seconds"] = value, time.time() - t0
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"{part}: done at {results['seconds']:.0f}s", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False  # the greedy comparison wants fp32 matmuls
    parts = [("pipeline", lambda: pipeline(device, args.cache_dir, smoke))]
    parts += [(name, lambda shape=shape, name=name: real_scale(SMOKE_TARGET if smoke else shape, device,
                                                              SMOKE_STEP if smoke else REAL_STEP, 1 if smoke else 3,
                                                              compare=name == "Qwen3-4B"))
              for name, shape in (("Qwen3-4B", QWEN3_4B), ("Qwen3-8B", QWEN3_8B))]
    parts.append(("draft_step", lambda: draft_part(device, torch.float32 if smoke else torch.bfloat16,
                                                   64 if smoke else 1024, 1 if smoke else 50, smoke,
                                                   names=("DFlash", "DFlash2"))))
    for part, run in parts:
        try:
            value = run()
        except Exception as e:  # a part that fails does not cost the other parts their numbers
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        done(part, value)
    print(table(results))
    print(f"wall time {results['seconds']:.0f}s; {os.path.abspath(path)}")
    failed = [part for part, _ in parts if "error" in results[part]]
    if failed or not results["pipeline"]["ok"]:
        raise SystemExit(f"bench.gpu_check: failed: {failed or 'greedy spec_generate differs from the target'}")
    return results


if __name__ == "__main__":
    main(parse_args())
