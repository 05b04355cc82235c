"""
The DFlash2 ablation in the tiny world: train DFlash, +conv, +selector and DFlash2 (and
DFlash2 with soft selector labels, options of §6, and with factored codebooks, the option
of §3) with train.py's code against the
offline tiny-world target, same data and steps, for several seeds; decode the same
held-out prompts with spec_generate at each sampling setting (the selector drafters also
with their selector switched off: the unary path of the same weights); measure the
expected AL of the unary / walk / oracle top-K paths on validation blocks and the
per-slot conditional acceptance. Every AL and every paired ratio (DFlash2 / DFlash,
selector path / unary path, ...) comes with a 95% bootstrap interval that redraws both the
training seeds and the prompts, so it covers the run-to-run spread of training as well as
the choice of prompts.

Sampling settings: --settings takes settings separated by ';', each
temperature[,top_p[,top_k]] (top_p 1 and top_k 0 filter nothing): the default
"0;1;1,0.95,20" is greedy, plain sampling and sampling with top-p 0.95 and top-k 20.
--chat-curve adds Qwen3's recommended chat settings, T = 0.6 / top-p 0.95 / top-k 20 and
T = 0.7 / top-p 0.8 / top-k 20 (two more decoding passes of every drafter).

python -m bench.ablation           # 3 seeds × 7 drafters, 64 prompts (over an hour on a 2-core CPU)
python -m bench.ablation --quick   # a smoke run in about a minute
Outputs in --out (bench_out): results.json, results.md, per_slot_acceptance.png and,
after each seed, ablation_so_far.md.
"""
import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import time

import torch

import dflash2
from harness import checkpoint, metrics, tiny_world
from harness.target import decoding_view
from bench.common import ci_text, mean_ci, prompts_of, quick_world, ratio_ci, slot_ci, validation_rows, write_results

DRAFTERS = {  # the ablation: name -> train.py flags on top of the shared ones (the parts' sizes come from those)
    "DFlash": ["--conv-kernel-size", "0", "--selector-top-k", "0"],
    "+conv": ["--selector-top-k", "0"],
    "+selector": ["--conv-kernel-size", "0"],
    "DFlash2": [],
    # the options of §6 for the selector's labels: the target's softmax, or its law at the write-up's setting
    "DFlash2 (soft labels)": ["--selector-labels", "soft"],
    "DFlash2 (soft labels at T=1 top-p 0.95 top-k 20)": ["--selector-labels", "1,0.95,20"],
    # the option of §3: codebooks as projections of the target's embedding (no comma: --drafters splits on them)
    "DFlash2 (factored codebooks)": ["--drafter-config", '{"selector_codebooks": "factored"}'],
}
LABEL_OPTIONS = [name for name, flags in DRAFTERS.items() if "--selector-labels" in flags]
CODEBOOK_OPTIONS = [name for name, flags in DRAFTERS.items() if any("selector_codebooks" in f for f in flags)]
WRITE_UP = (1.0, 0.95, 20)  # the write-up's sampling setting, where the acceptance metrics are also measured
ACCEPT_KEYS = ("accept_unary", "accept_selector", "mass_at_k")
CHAT_CURVE = [(0.6, 0.95, 20), (0.7, 0.8, 20)]  # Qwen3's recommended chat settings (thinking / non-thinking)


def parse_settings(text):
    """'T[,top_p[,top_k]];...' -> [(temperature, top_p, top_k)]; the ranges are check_args'."""
    settings = []
    for part in text.split(";"):
        fields = part.split(",")
        try:
            if not 1 <= len(fields) <= 3:
                raise ValueError
            settings.append((float(fields[0]), float(fields[1]) if len(fields) > 1 else 1.0,
                             int(fields[2]) if len(fields) > 2 else 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not temperature[,top_p[,top_k]] (e.g. '1,0.95,20'); "
                                             "settings are separated by ';'") from None
    return settings


def label(setting):
    """(1.0, 0.95, 20) -> 'T=1, top-p 0.95, top-k 20'; filters that filter nothing are left out."""
    t, top_p, top_k = setting
    return f"T={t:g}" + (f", top-p {top_p:g}" if top_p < 1 else "") + (f", top-k {top_k}" if top_k else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny budgets everywhere: a smoke run in about a minute")
    p.add_argument("--out", dest="out_dir", default="bench_out", help="where results.json, results.md, the plot "
                   "and the runs go")
    p.add_argument("--seeds", type=int, default=3, help="training seeds per variant")
    p.add_argument("--drafters", type=lambda s: s.split(","), default=list(DRAFTERS),
                   help=f"comma-separated subset of: {', '.join(DRAFTERS)}")
    p.add_argument("--train-flags", default="", help="more train.py flags for every run, e.g. '--steps 600', "
                   "'--block-size 16' or '--selector-top-k 64' (the parts' sizes)")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for spec_generate")
    p.add_argument("--eval-tokens", type=int, default=64, help="max_new_tokens per prompt")
    p.add_argument("--settings", type=parse_settings, default=[(0.0, 1.0, 0), (1.0, 1.0, 0), WRITE_UP],
                   help="sampling settings for spec_generate, separated by ';', each temperature[,top_p[,top_k]] "
                   "(default: '0;1;1,0.95,20')")
    p.add_argument("--chat-curve", action="store_true", help="also decode at Qwen3's recommended chat settings: "
                   "T=0.6, top-p 0.95, top-k 20 and T=0.7, top-p 0.8, top-k 20")
    p.add_argument("--val-blocks", type=int, default=1024, help="validation blocks for the expected-AL metrics")
    p.add_argument("--cache-dir", default=tiny_world.CACHE_DIR,
                   help="train.py's offline-world cache")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# ablation in the tiny world


def without_selector(drafter):
    """The drafter's unary path: the same weights with the selector switched off, the one
    way the code asks whether a selector is on (config.selector_top_k = 0): a drafter built
    without one, loaded with every tensor but the selector's. It proposes from the unary
    logits, and its metrics are a selector-less drafter's."""
    weight = drafter.fc.weight
    unary = dflash2.DFlash2Drafter(dataclasses.replace(drafter.config, selector_top_k=0), rope=drafter.rope)
    unary = unary.to(weight.device, weight.dtype)
    unary.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("candidate_selector.")})
    return unary.eval()


def decoding_paths(name, out, selector_on, unary_paths=None):
    """The exported drafter of run dir `out` -> {path label: drafter}: its own path (the walk with a
    selector on, else the unary path: a partial variant exports as a full DFlash2 with its missing
    part at the identity, §7, so +conv proposes as a drafter without a selector does) and, with a
    selector on and the name in unary_paths (None: every name), also "<name>, unary path"."""
    drafter = checkpoint.load_export(os.path.join(out, "checkpoint")).eval()
    unary = without_selector(drafter)
    paths = {name: drafter if selector_on else unary}
    if selector_on and (unary_paths is None or name in unary_paths):
        paths[f"{name}, unary path"] = unary
    return paths


def spec_eval(drafter, target, prompts, args, setting, stop_id, progress=None):
    """Real acceptance length and the slot-wise counts per prompt, decoding speed overall;
    progress(prompts done, eta seconds) is called about once a minute."""
    gen = torch.Generator().manual_seed(0)
    out = {"al": [], "accepted": [], "reached": [], "target_forwards": 0, "new_tokens": 0, "seconds": 0.0}
    t0 = t_log = time.time()
    for i, p in enumerate(prompts, 1):
        if progress and time.time() - t_log > 60:
            t_log = time.time()
            progress(i - 1, (t_log - t0) / (i - 1) * (len(prompts) - i + 1))
        _, s = dflash2.spec_generate(drafter, target, p, args.eval_tokens, *setting, stop_token_ids=[stop_id],
                                     generator=gen, view=decoding_view(drafter.config, target))
        out["al"].append(s.mean_acceptance_length)
        out["accepted"].append(s.accepted_per_slot)
        out["reached"].append([len(s.acceptance_lengths)] + s.accepted_per_slot[:-1])  # slots < k all accepted
        out["target_forwards"] += s.target_forwards
        out["new_tokens"] += s.new_tokens
        out["seconds"] += s.decode_seconds
    return out


@torch.no_grad()
def target_entropy(target, rows, setting):
    """The target's mean entropy (nats) at a sampling setting over the loss tokens of the
    rows, its own answers: the law it samples each answer token from, given the text before."""
    total, n = 0.0, 0
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"].bool()
        p = dflash2.sampling_probs(target(input_ids=ids[None]).logits[0, :-1][mask[1:]], *setting)
        total, n = total - torch.special.xlogy(p, p).sum().item(), n + len(p)
    return total / n


@torch.no_grad()
def val_metrics(drafter, target, val, targs, pad_id, min_blocks, accept_at=(1.0, 1.0, 0)):
    """train.py's validation metrics averaged over blocks (not batches), on at least
    min_blocks blocks: every further pass over the rows draws new anchors. The acceptance
    metrics at the sampling setting accept_at (T = 1, no filter, unless given)."""
    import train
    from harness.data import collate
    from harness.target import uncached_features
    total, n_blocks, rounds, features = {}, 0, 0, uncached_features(drafter.config.target_layer_ids)
    while n_blocks < min_blocks:
        for i in range(0, len(val), targs.batch_size):
            batch = collate(val[i:i + targs.batch_size], pad_id, torch.device("cpu"))
            seeds = [rounds * len(val) + j for j in range(i, i + len(batch[0]))]
            inputs = train.step_inputs(target, batch, targs.max_anchors, seeds, features)
            n = int(inputs.anchor_valid.sum())  # the blocks the loss draws
            cfg = train.loss_config(targs, drafter.config.vocab_size)
            view = dflash2.target_view(drafter.config, target)
            _, terms, slots = train.loss_step(drafter, view, target, inputs, cfg)
            stats = metrics.step_stats(drafter, view, target, slots, cfg, terms, accept_at)
            for k, v in stats.items():
                total[k] = [t + n * x for t, x in zip(total.get(k, [0] * len(v)), v)] if isinstance(v, list) \
                    else total.get(k, 0) + n * v
            n_blocks += n
        rounds += 1
    return {"blocks": n_blocks, **{k: [x / n_blocks for x in v] if isinstance(v, list) else v / n_blocks
                                   for k, v in total.items()}}


def ablation(args, settings):
    import train  # the same training code path as `python train.py`
    import transformers
    defaults = train.parse_args(shlex.split(args.train_flags))  # train.py's defaults, and the world it would build
    if args.quick:  # a barely trained target and few prompts: checks the plumbing, not the numbers
        target_path, data_path = quick_world(args.cache_dir)
        base = ["--steps", "4", "--batch-size", "4", "--seq-len", "256",
                "--drafter-config", '{"selector_rank": 16}']
    else:
        target_path, data_path, base = *tiny_world.tiny_world(args.cache_dir, tiny_world.PRETRAIN_STEPS), []
    val_size = 8 if args.quick else max(defaults.val_size, args.eval_prompts)
    base = ["--target", target_path, "--data", data_path, "--val-size", str(val_size), *base,
            *shlex.split(args.train_flags)]
    # the same held-out prompts for every drafter: the prompts of train.py's validation rows
    targs = train.parse_args(base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_path)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    val = validation_rows(targs, tokenizer)
    prompts = prompts_of(val, args.eval_prompts)
    results = empty_results(args, base, settings, target, tokenizer, val, prompts)
    return train_and_decode(results, args, base, settings, target, tokenizer, val, prompts,
                            os.path.join(args.out_dir, "ablation_so_far.md"))


def empty_results(args, base, settings, target, tokenizer, val, prompts):
    """What a run records before any drafter: its sizes, the target's autoregressive speed on
    (up to 8 of) the prompts, and its entropy on the validation answers at T = 1 and at the
    write-up's setting."""
    baseline = [dflash2.target_generate(target, p, args.eval_tokens, stop_token_ids=[tokenizer.eos_token_id])[1]
                for p in prompts[:8]]
    return {"prompts": len(prompts), "max_new_tokens": args.eval_tokens, "seeds": 0,
            "settings": [label(s) for s in settings], "train_flags": base[2:], "variants": {},
            "autoregressive_tokens_per_s": sum(s.new_tokens for s in baseline) / sum(s.decode_seconds for s in baseline),
            "target_entropy": {label(s): target_entropy(target, val, s) for s in ((1.0, 1.0, 0), WRITE_UP)}}


def run_dir(out_dir, name, seed):
    """Where train_and_decode trains a drafter of this name and seed."""
    return os.path.join(out_dir, f"{name.replace(' (', '-').strip(')').replace(' ', '-')}-seed{seed}")


def train_and_decode(results, args, base, settings, target, tokenizer, val, prompts, so_far, unary_paths=None,
                     log=print):
    """Seed by seed, each of args.drafters: trained by train.py's code (the base flags plus
    its own), its validation metrics measured, and the prompts decoded at every setting;
    a drafter with a selector also through its unary path (only those named in unary_paths,
    if given). Each run's measurements are saved in its run dir (decoded.json), and a bench
    started again with the same flags reads them instead of decoding again. The report so far
    goes to the file so_far after each drafter of the first seed, then after each seed."""
    for seed in range(args.seeds):
        for name in args.drafters:
            out = run_dir(args.out_dir, name, seed)
            key = {"flags": [*base, *DRAFTERS[name], "--seed", str(seed)], "settings": [label(t) for t in settings],
                   "prompts": len(prompts), "eval_tokens": args.eval_tokens, "val_blocks": args.val_blocks,
                   "unary_paths": sorted(unary_paths) if unary_paths is not None else None}
            run = saved_run(out, key)
            if run is None:
                run = train_and_measure(name, out, seed, args, base, settings, target, tokenizer, val, prompts,
                                        unary_paths, log)
                save_run(out, key, run)
            else:
                log(f"{name}, seed {seed}: measured before with these flags, read from {out}/decoded.json")
            for path_label, by_setting in run["spec"].items():
                r = results["variants"].setdefault(path_label, {"train_seconds": [], "val": [], "spec": {}})
                if path_label == name:
                    r["train_seconds"].append(run["train_seconds"])
                    r["val"].append(run["val"])
                for t, measured in by_setting.items():
                    r["spec"].setdefault(t, []).append(measured)
            if seed == 0 or name == args.drafters[-1]:  # every variant has as many seeds: a report so far
                results["seeds"] = seed + 1
                summarize(results)
                with open(so_far, "w") as f:
                    f.write(markdown(results) + "\n")
    return results


def saved_run(out, key, name="decoded.json"):
    """The run's saved measurements (in its file `name`) if they were taken with these flags, else None."""
    run = saved_file(out, name)
    return run if run is not None and run.pop("key") == key else None


def saved_key(out, name="decoded.json"):
    """The flags the run's measurements in its file `name` were taken with (for decoded.json: those that trained
    its drafter), or None where there are none."""
    run = saved_file(out, name)
    return None if run is None else run["key"]


def saved_file(out, name):
    """The run dir's file `name` as save_run wrote it, or None."""
    path = os.path.join(out, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_run(out, key, run, name="decoded.json"):
    """The run's measurements with their key, written whole: a bench killed while writing leaves no file."""
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"key": key, **run}, f)
    os.replace(tmp, os.path.join(out, name))


def train_and_measure(name, out, seed, args, base, settings, target, tokenizer, val, prompts, unary_paths, log):
    """One run: trained (or resumed, from a killed bench), its validation metrics, its paths' decodes at every
    setting. -> {train_seconds, val, spec: {path label: {setting label: spec_eval's}}}."""
    import train
    targs = train.parse_args(base)
    resume = ["--resume"] if os.path.isfile(os.path.join(out, "resume.pt")) else []  # a killed bench goes on
    run_args = train.parse_args(base + ["--out-dir", out, "--seed", str(seed), *DRAFTERS[name], *resume,
                                        "--decode-prompts", "0"])  # the bench decodes its own prompts
    t0 = time.time()
    train.train(run_args)
    train_seconds = time.time() - t0
    paths = decoding_paths(name, out, run_args.selector_top_k, unary_paths)
    val_stats = val_metrics(paths[name], target, val, targs, tokenizer.pad_token_id, args.val_blocks)
    at_write_up = val_metrics(paths[name], target, val, targs, tokenizer.pad_token_id, args.val_blocks,
                              accept_at=WRITE_UP)
    val_stats["at_write_up"] = {k: at_write_up[k] for k in ACCEPT_KEYS if k in at_write_up}
    spec = {path_label: {label(t): spec_eval(d, target, prompts, args, t, tokenizer.eos_token_id,
                                             lambda i, eta: log(f"decode | {path_label} at {label(t)}: {i}/"
                                                                f"{len(prompts)} prompts | eta {int(eta // 60)}m"
                                                                f"{int(eta % 60):02d}s"))
                         for t in settings}
            for path_label, d in paths.items()}
    return {"train_seconds": train_seconds, "val": val_stats, "spec": spec}


RATIOS = (("ratio_vs_dflash", "{} / DFlash"), ("ratio_vs_unary_path", "{} / its unary path"),
          ("ratio_vs_argmax_labels", "{} / DFlash2 (argmax labels)"),
          ("ratio_vs_free_codebooks", "{} / DFlash2 (free codebooks)"))


def summarize(a):
    """Means and 95% bootstrap intervals over (seeds × prompts), written into the results;
    ratios are paired (same seed, same prompts) at every setting."""
    grid = lambda name, t, key: torch.tensor([run[key] for run in a["variants"][name]["spec"][t]], dtype=torch.float64)
    a["summary"] = {}
    for name, r in a["variants"].items():
        s = a["summary"][name] = {}
        for t in r["spec"]:
            runs = r["spec"][t]
            s[t] = {"al": mean_ci(grid(name, t, "al")),
                    "slot_acceptance": slot_ci(grid(name, t, "accepted"), grid(name, t, "reached")),
                    "tokens_per_s": sum(x["new_tokens"] for x in runs) / sum(x["seconds"] for x in runs),
                    "target_forwards_per_token": sum(x["target_forwards"] for x in runs) /
                                                 sum(x["new_tokens"] for x in runs)}
            if name != "DFlash" and not name.endswith(", unary path") and "DFlash" in a["variants"]:
                s[t]["ratio_vs_dflash"] = ratio_ci(grid(name, t, "al"), grid("DFlash", t, "al"))
            if f"{name}, unary path" in a["variants"]:
                s[t]["ratio_vs_unary_path"] = ratio_ci(grid(name, t, "al"), grid(f"{name}, unary path", t, "al"))
            for key, options in (("ratio_vs_argmax_labels", LABEL_OPTIONS),
                                 ("ratio_vs_free_codebooks", CODEBOOK_OPTIONS)):
                if name in options and "DFlash2" in a["variants"]:
                    s[t][key] = ratio_ci(grid(name, t, "al"), grid("DFlash2", t, "al"))
        if r["val"]:
            s["val"] = {k: statistics.mean(v[k] for v in r["val"]) for k in
                        ("blocks", "al_unary", "al_walk", "al_oracle", "oracle", "selector_tf_acc",
                         *ACCEPT_KEYS) if k in r["val"][0]}
            s["val"]["at_write_up"] = {k: statistics.mean(v["at_write_up"][k] for v in r["val"])
                                       for k in r["val"][0]["at_write_up"]}
            s["val"]["walk_slot_acc"] = [statistics.mean(x) for x in zip(*(v["walk_slot_acc"] for v in r["val"]))] \
                if "walk_slot_acc" in r["val"][0] else None
            s["val"]["slot_acc"] = [statistics.mean(x) for x in zip(*(v["slot_acc"] for v in r["val"]))]


# -----------------------------------------------------------------------------
# report


def markdown(a):
    settings = a["settings"]
    lines = [f"Ablation: real acceptance length, mean [95% bootstrap interval over {a['seeds']} training seed(s) "
             f"× {a['prompts']} held-out prompts], ≤ {a['max_new_tokens']} new tokens; tokens/s and target "
             f"forwards per token at {settings[0]}; autoregressive baseline "
             f"{a['autoregressive_tokens_per_s']:.1f} tok/s", "",
             "| drafter | " + " | ".join(f"AL {t}" for t in settings) + " | expected AL unary / walk / oracle "
             f"(val) | T=1 acceptance unary / selector / top-K mass (val) | the same at {label(WRITE_UP)} (val) | "
             "oracle | selector tf-acc | tok/s | target fwd / token |", "|---|" + "---|" * (len(settings) + 7)]
    for name, s in a["summary"].items():
        v = s.get("val", {})
        f = lambda *keys, at=v: " / ".join(f"{at[k]:.2f}" if k in at else "-" for k in keys) if at else ""
        lines.append(f"| {name} | " + " | ".join(ci_text(*s[t]["al"]) for t in settings) +
                     f" | {f('al_unary', 'al_walk', 'al_oracle')} | "
                     f"{f('accept_unary', 'accept_selector', 'mass_at_k')} | "
                     f"{f('accept_unary', 'accept_selector', 'mass_at_k', at=v.get('at_write_up'))} | "
                     f"{f('oracle')} | "
                     f"{f('selector_tf_acc')} | {s[settings[0]]['tokens_per_s']:.1f} | "
                     f"{s[settings[0]]['target_forwards_per_token']:.3f} |")
    blocks = [s["val"]["blocks"] for s in a["summary"].values() if "val" in s]
    lines += ["", f"Expected AL, accuracies and acceptance probabilities: mean over seeds of {min(blocks):.0f}+ "
              "validation blocks each. The target's mean entropy on its validation answers: " +
              ", ".join(f"{h:.2f} nats at {t}" for t, h in a["target_entropy"].items()) + ".", "",
              "Ratios of mean AL, paired (same seeds, same prompts), 95% bootstrap intervals:", "",
              "| ratio | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for key, what in RATIOS:
        for name, s in a["summary"].items():
            if key in s[settings[0]]:
                lines.append(f"| {what.format(name)} | " + " | ".join(ci_text(*s[t][key]) for t in settings) + " |")
    lines.append("")
    return "\n".join(lines)


def plot(a, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = a["settings"]
    cols = min(3, len(settings))
    rows = math.ceil(len(settings) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), sharey=True, squeeze=False)
    for ax, t in zip(axes.flat, settings):
        for name in (n for n in a["summary"] if not n.endswith(", unary path")):
            rate, lo, hi = a["summary"][name][t]["slot_acceptance"]
            k = range(1, len(rate) + 1)
            ax.plot(k, rate, marker="o", label=name)
            ax.fill_between(k, lo, hi, alpha=0.2)
        ax.set(title=t, xlabel="slot k", ylim=(0, 1))
    for ax in axes.flat[len(settings):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("P(slot k accepted | slots < k accepted)")
    axes[0][0].legend(title="95% bootstrap bands")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_args(args):
    """Bad flags fail here, before any training. -> the sampling settings to decode at."""
    if args.seeds < 1:
        raise ValueError(f"--seeds ({args.seeds}) must be >= 1")
    if not args.drafters or not set(args.drafters) <= set(DRAFTERS):
        raise ValueError(f"--drafters: unknown drafter(s) {sorted(set(args.drafters) - set(DRAFTERS))}; "
                         f"choose from {', '.join(DRAFTERS)}")
    if args.eval_prompts < 1 or args.eval_tokens < 1:
        raise ValueError(f"--eval-prompts ({args.eval_prompts}) and --eval-tokens ({args.eval_tokens}) must be >= 1")
    for t, top_p, top_k in args.settings:
        if not 0 <= t < math.inf or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"--settings: {label((t, top_p, top_k))!r} needs a temperature >= 0, top_p in (0, 1] "
                             f"and top_k >= 0")
    settings = args.settings + [s for s in CHAT_CURVE if args.chat_curve and s not in args.settings]
    labels = [label(s) for s in settings]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--settings: {labels} names a setting twice")
    return settings


def main(args):
    settings = check_args(args)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.quick:
        args.seeds, args.eval_prompts, args.eval_tokens = min(args.seeds, 2), min(args.eval_prompts, 3), \
            min(args.eval_tokens, 16)
        args.val_blocks = min(args.val_blocks, 64)
    t0 = time.time()
    return report(ablation(args, settings), args.out_dir, t0)


def report(results, out_dir, t0, extra=""):
    """The wall time since t0, then the plot, results.md (markdown(results), then extra) and
    results.json in out_dir."""
    results["wall_seconds"] = time.time() - t0
    plot(results, os.path.join(out_dir, "per_slot_acceptance.png"))
    write_results(out_dir, "results", results, markdown(results) + extra)
    return results


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags: one line, before any work
        raise SystemExit(f"bench.ablation: {e}") from None
