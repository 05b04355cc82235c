"""
The whole train.py step at two commits: seconds per optimizer step of this checkout's train.py against another
commit's, each run as a user runs it (a fresh process, the default run's world or any train.py flags), so all that
changed between them counts: the loss, the features, the optimizer, the log line's metrics, the allocator setting.

Each side is a checkout: this one's working tree as it is (or --commit's tree), and --against's tree, exported with
`git archive` into a temporary folder removed at the end. Each timed run is a fresh python process whose sys.path
starts at its side's folder instead of the working directory (the flags' relative paths stay the user's), so
nothing of the other side is imported. It imports that side's train.py, hooks the optimizer train.make_optimizer
returns to read time.perf_counter() after each update (the tiny world's pretraining, run by the first process that
needs the world, is not timed), runs train.train(train.parse_args(FLAGS --out-dir TMP --steps LAST)) (the bench's
--out-dir and --steps win over the flags') and stops after step LAST's update, before the evaluation and export.

  seconds per step = (t[LAST] - t[FIRST - 1]) / (LAST - FIRST + 1),  t[i] the clock after step i's update

Steps before FIRST are the warm-up (the loss compiles on step 1). Step LAST is the run's last, which train.py
logs: its metrics, computed before its update, are in the mean. R rounds each run both sides one after the other,
the first alternating by round so drift hits both alike. Reports each side's seconds per step by round, against /
this by round and its median (with 3 rounds or more, a paired 95% bootstrap interval over rounds). Threads and the
allocator setting are each side's train.py's: the bench sets neither.

python -m bench.train_steps --against d9e72ae     # the default run's world; bench_out/train_steps.json and .md
python -m bench.train_steps --against d9e72ae --rounds 4 -- --target F.gguf --data rows.jsonl --batch-size 8
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

from bench.common import ci_text, median, round_ratio_ci, write_results
from bench.cost import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a timed run: python -c CHILD CHECKOUT TIMES_FILE LAST TRAIN_FLAGS...
CHILD = """
import json, sys, time
checkout, times_file, last, flags = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
sys.path[0] = checkout  # in place of the working directory: the flags' relative paths are the user's
import torch
import train

class Stop(BaseException):  # not an Exception: no handler in train.py catches it
    pass

times, make_optimizer = [], train.make_optimizer

def timed_optimizer(*args, **kwargs):
    optimizer = make_optimizer(*args, **kwargs)
    def after_step(optimizer, args, kwargs):
        if torch.cuda.is_available():  # a GPU's update has ended, not just been queued
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        if len(times) == last:
            raise Stop
    optimizer.register_step_post_hook(after_step)
    return optimizer

train.make_optimizer = timed_optimizer
try:
    train.train(train.parse_args(flags))
except Stop:
    pass
with open(times_file, "w") as f:
    json.dump(times, f)
"""


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def export(commit, folder):
    """commit's tree into folder, as `git archive COMMIT | tar -x` writes it (no worktree registered)."""
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", commit], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        tar.extractall(folder, filter="data")
    if archive.wait():
        raise RuntimeError(f"git archive {commit} exited with {archive.returncode}")


def step_times(checkout, flags, last):
    """checkout's train.py in a fresh process, stopped after step `last` -> [t[1], ..., t[last]]."""
    with tempfile.TemporaryDirectory() as tmp:
        times_file = os.path.join(tmp, "times.json")
        run = subprocess.run([sys.executable, "-c", CHILD, checkout, times_file, str(last), *flags,
                              "--out-dir", os.path.join(tmp, "out"), "--steps", str(last)])
        if run.returncode:
            raise RuntimeError(f"train.py in {checkout} exited with {run.returncode} (its output is above)")
        with open(times_file) as f:
            times = json.load(f)
    if len(times) != last:
        raise RuntimeError(f"train.py in {checkout} ran {len(times)} optimizer steps, not --last {last}")
    return times


def seconds_per_step(times, first, last):
    """times[i - 1] = t[i] -> (t[last] - t[first - 1]) / (last - first + 1)."""
    return (times[last - 1] - times[first - 2]) / (last - first + 1)


def round_order(sides, r):
    """Round r's order: the sides as given in even rounds, reversed in odd ones."""
    return sides if r % 2 == 0 else sides[::-1]


def measure(args):
    sides, checkouts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, commit in (("this", args.commit), ("against", args.against)):
            sha = git("rev-parse", "HEAD" if commit is None else f"{commit}^{{commit}}")
            # commit None: this checkout's working tree as it is, uncommitted changes and all
            sides[name] = {"commit": sha, "dirty": commit is None and bool(git("status", "--porcelain")), "seconds": []}
            checkouts[name] = ROOT if commit is None else os.path.join(tmp, name)
            if commit is not None:
                export(sha, checkouts[name])
        for r in range(args.rounds):
            for name in round_order(list(sides), r):
                print(f"round {r + 1}/{args.rounds}: {name} ({sides[name]['commit'][:7]})", flush=True)
                times = step_times(checkouts[name], args.train_flags, args.last)
                sides[name]["seconds"].append(seconds_per_step(times, args.first, args.last))
    this, against = sides["this"]["seconds"], sides["against"]["seconds"]
    ratios = [a / t for a, t in zip(against, this)]
    return {"first": args.first, "last": args.last, "rounds": args.rounds, "train_flags": args.train_flags,
            "cpu": cpu_model(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "sides": sides, "ratios": ratios, "median_ratio": median(ratios),
            "interval": list(round_ratio_ci(against, this)[1:]) if args.rounds >= 3 else None}


def markdown(r):
    ratio = f"{r['median_ratio']:.2f}" if r["interval"] is None else ci_text(r["median_ratio"], *r["interval"])
    lines = [f"The whole train.py step: seconds per step over steps {r['first']}-{r['last']} (step {r['last']} "
             f"logged), a fresh process a run, {r['rounds']} round(s) alternating which side runs first, on "
             f"{r['gpu'] or r['cpu']['model']}; train.py flags: {' '.join(r['train_flags']) or 'the default run'}", "",
             "| side | commit | " + " | ".join(f"round {i + 1}" for i in range(r["rounds"])) + " | median |",
             "|---|---|" + "---|" * (r["rounds"] + 1)]
    for name, side in r["sides"].items():
        commit = side["commit"][:7] + (" + uncommitted changes" if side["dirty"] else "")
        lines.append(f"| {name} | {commit} | " + " | ".join(f"{s:.3f}" for s in side["seconds"]) +
                     f" | {median(side['seconds']):.3f} |")
    lines.append("| against / this | | " + " | ".join(f"{x:.2f}" for x in r["ratios"]) + f" | {ratio} |")
    return "\n".join(lines + [""])


def parse_args(argv=None):
    """The bench's flags, then train.py's after `--` (args.train_flags)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m bench.train_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the commit this checkout's train.py is timed against")
    p.add_argument("--commit", default=None, help="time this commit's tree instead of this checkout's working tree")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each running both sides once")
    p.add_argument("--first", type=int, default=5, help="the first timed step (the ones before are the warm-up)")
    p.add_argument("--last", type=int, default=8, help="the last timed step, the run's last (a logged step)")
    p.add_argument("--out", dest="out_dir", default="bench_out", help="where train_steps.json and .md go")
    args = p.parse_args(argv[:split])
    args.train_flags = argv[split + 1:]
    return args


def check_args(args):
    """Bad flags fail here, before any work."""
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: expected an integer >= 1")
    if not 2 <= args.first <= args.last:
        raise ValueError(f"--first {args.first} --last {args.last}: expected 2 <= first <= last (the clock starts "
                         "after step first - 1)")
    if shutil.which("git") is None:
        raise ValueError("git is not on PATH: each side is a commit of this checkout's repository")
    for flag, commit in (("--against", args.against), ("--commit", args.commit)):
        if commit is not None and subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "--quiet",
                                                  f"{commit}^{{commit}}"], capture_output=True).returncode:
            raise ValueError(f"{flag} {commit}: not a commit of the repository at {ROOT}")


def main(args):
    check_args(args)
    t0 = time.time()
    results = measure(args)
    results["wall_seconds"] = time.time() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    write_results(args.out_dir, "train_steps", results, markdown(results))
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags: one line, before any work
        raise SystemExit(f"bench.train_steps: {e}") from None
