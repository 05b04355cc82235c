"""
The decode cycle against the z-lab `dflash` package's own loop, side by side: one export loaded
by both (checkpoint.load_export here, DFlash2DraftModel.from_pretrained there), the float32
target bench.real trains against (from its cached world, built first if missing), its first
HumanEval prompts at T = 0, and target_generate (the target alone) beside them; the three loops
alternate prompt by prompt after a warm-up pass of each, outputs checked identical token for
token. Reports each loop's decode seconds per cycle (prefill excluded), the two cycles' ratio
and spec_generate's speed over the target alone's, each with a paired 95% bootstrap interval
over prompts, and the mean acceptance lengths.

python -m bench.peer_cycle --export bench_out/real/DFlash2-seed0/checkpoint
(in a virtual environment that also has `pip install --no-deps dflash==0.1.0`)
"""
import argparse
import os
import time

import torch

import dflash2
from harness import checkpoint
from harness.target import decoding_view
from bench.common import ci_text, ratio_ci, write_results


def zlab_generate(model, target, prompt, max_new_tokens, stop_id):
    """The z-lab loop on a CPU: its clock synchronizes CUDA, so it reads perf_counter here.
    -> (new token ids (n,), decode seconds, cycles)."""
    from dflash import model as zlab  # optional: the peer package
    zlab._cuda_time = time.perf_counter
    out = zlab.dflash_generate(model, target, prompt, max_new_tokens, [stop_id], return_stats=True)
    new = out.output_ids[0, out.num_input_tokens:]
    return new, out.time_per_output_token * out.num_output_tokens, len(out.acceptance_lengths)


def dflash2_generate(drafter, target, prompt, max_new_tokens, stop_id):
    """spec_generate, or target_generate with drafter None (a cycle is then a plain step)."""
    if drafter is None:
        new, stats = dflash2.target_generate(target, prompt, max_new_tokens, stop_token_ids=[stop_id])
        return new, stats.decode_seconds, stats.target_forwards - 1  # the prefill is not a step
    new, stats = dflash2.spec_generate(drafter, target, prompt, max_new_tokens, stop_token_ids=[stop_id],
                                       view=decoding_view(drafter.config, target))
    return new, stats.decode_seconds, len(stats.acceptance_lengths)


@torch.inference_mode()
def measure(args, log=print):
    if not os.path.isfile(os.path.join(args.export, "config.json")):
        raise ValueError(f"--export {args.export}: no config.json there (expected a z-lab format export)")
    try:
        from dflash.model import DFlash2DraftModel  # optional: the peer package
    except ImportError:
        raise ValueError("the z-lab package is missing: pip install --no-deps dflash==0.1.0") from None
    from bench import real
    from harness.target import load_target, load_tokenizer
    defaults = real.parse_args([])
    target_path, _, _ = real.real_world(defaults.cache_dir, defaults.train_prompts, defaults.held_out_rows,
                                        defaults.answer_tokens, defaults.regen_batch_size, defaults.packages, log)
    tokenizer, target = load_tokenizer(target_path), load_target(target_path, "float32", torch.device("cpu"))
    drafter = checkpoint.load_export(args.export).eval()
    peer = DFlash2DraftModel.from_pretrained(args.export, dtype=torch.float32).eval()
    prompts = [real.chat_prompt(tokenizer, text) for _, text in real.humaneval_prompts()[:args.prompts]]
    stop = tokenizer.eos_token_id
    loops = {"dflash2": lambda p: dflash2_generate(drafter, target, p, args.max_new_tokens, stop),
             "z-lab": lambda p: zlab_generate(peer, target, p, args.max_new_tokens, stop),
             "target alone": lambda p: dflash2_generate(None, target, p, args.max_new_tokens, stop)}
    for run in loops.values():
        run(prompts[0])  # first calls allocate and pick kernels
    per_cycle, seconds = ({name: [] for name in loops} for _ in range(2))
    cycles, tokens = {name: 0 for name in loops}, 0
    for i, p in enumerate(prompts):
        order = list(loops) if i % 2 == 0 else list(loops)[::-1]
        got = {name: loops[name](p) for name in order}
        for name, (new, s, n) in got.items():
            if not torch.equal(new, got["target alone"][0]):
                raise RuntimeError(f"prompt {i}: {name}'s output {new.tolist()} differs from the target's "
                                   f"{got['target alone'][0].tolist()}")
            per_cycle[name].append(s / n)
            seconds[name].append(s)
            cycles[name] += n
        tokens += len(got["target alone"][0])
    grid = lambda x, name: torch.tensor([x[name]], dtype=torch.float64)  # (1 seed, prompts)
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "export": args.export,
           "ms_per_cycle": {name: 1e3 * sum(v) / len(v) for name, v in per_cycle.items()},
           "mean_al": {name: tokens / n for name, n in cycles.items()},
           "tokens_per_s": {name: tokens / sum(v) for name, v in seconds.items()},
           "zlab_over_dflash2": ratio_ci(grid(per_cycle, "z-lab"), grid(per_cycle, "dflash2")),
           "speedup": ratio_ci(grid(seconds, "target alone"), grid(seconds, "dflash2"))}
    log(f"cycle | dflash2 {out['ms_per_cycle']['dflash2']:.1f} ms, z-lab {out['ms_per_cycle']['z-lab']:.1f} ms: "
        f"z-lab / dflash2 {ci_text(*out['zlab_over_dflash2'])}; spec_generate / target_generate tokens/s "
        f"{ci_text(*out['speedup'])}")
    return out


def markdown(r):
    ms, al, tps = r["ms_per_cycle"], r["mean_al"], r["tokens_per_s"]
    return "\n".join([
        f"Decode cycle at T = 0, {r['prompts']} HumanEval prompts, max_new_tokens {r['max_new_tokens']}, "
        f"export {r['export']}, loops alternating after a warm-up pass, outputs identical token for token:", "",
        "| loop | ms per cycle | mean AL | tokens/s |", "|---|---|---|---|",
        f"| dflash2.spec_generate | {ms['dflash2']:.1f} | {al['dflash2']:.2f} | {tps['dflash2']:.1f} |",
        f"| z-lab dflash_generate | {ms['z-lab']:.1f} | {al['z-lab']:.2f} | {tps['z-lab']:.1f} |",
        f"| dflash2.target_generate (a cycle: one step) | {ms['target alone']:.1f} | 1 | {tps['target alone']:.1f} |",
        "", "Paired 95% bootstrap over prompts: z-lab's cycle / this project's "
        f"{ci_text(*r['zlab_over_dflash2'])}; spec_generate / target_generate tokens/s {ci_text(*r['speedup'])}.", ""])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="a drafter export in the z-lab format (train.py's checkpoint/)")
    p.add_argument("--prompts", type=int, default=32, help="HumanEval prompts, the first ones")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", dest="out_dir", default="bench_out", help="where peer_cycle.json and .md go")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    return args


def main(args):
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    results = measure(args)
    results["wall_seconds"] = time.time() - t0
    write_results(args.out_dir, "peer_cycle", results, markdown(results))
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags or a missing package: one line, before any work
        raise SystemExit(f"bench.peer_cycle: {e}") from None
