"""Tests of harness/checkpoint.py's export I/O (ALGORITHM.md §7): save_export and load_export
against the contract written out from §7 (tensor names and shapes, config.json
keys), round trips that draft the same tokens, the export dtype, exports of drafters with a part
off, DFlash (v1) checkpoints and the warm start from them, vllm-project speculators' format (read
from a config written here from its field list, written, refused), and what the loader refuses:
fields dflash2.py does not implement, malformed folders, pickled weights; a crash mid-save leaves
nothing half-written; the export job (python -m harness.checkpoint) and the serving commands it prints.
Tiny random targets from transformers.Qwen3Config, nothing downloaded.
"""
import dataclasses
import json
import os
import pickle
import shutil

import pytest
import safetensors
import safetensors.torch
import torch
import transformers

from harness import checkpoint
from conftest import tiny_qwen3
from harness.target import load_config, load_tokenizer
from tests.conftest import tiny_drafter
from dflash2 import DFlash2Drafter, context_features, spec_generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab_size=32, num_layers=3)  # target_layer_ids [0, 1]: below the last layer


# ALGORITHM.md §7 written out for the checkpoint drafter below: H = 32, I = 64, 2 target features,
# 2 draft layers, 4 heads / 2 KV heads of 8, V = 32, Kc = 2, G = 8, R = 4.
def spec_tensor_shapes(dflash2):
    H, I, n, L, nh, nkv, hd, V, Kc, G, R = 32, 64, 2, 2, 4, 2, 8, 32, 2, 8, 4
    shapes = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        shapes.update({
            f"layers.{i}.input_layernorm.weight": (H,), f"layers.{i}.post_attention_layernorm.weight": (H,),
            f"layers.{i}.self_attn.q_proj.weight": (nh * hd, H), f"layers.{i}.self_attn.k_proj.weight": (nkv * hd, H),
            f"layers.{i}.self_attn.v_proj.weight": (nkv * hd, H), f"layers.{i}.self_attn.o_proj.weight": (H, nh * hd),
            f"layers.{i}.self_attn.q_norm.weight": (hd,), f"layers.{i}.self_attn.k_norm.weight": (hd,),
            f"layers.{i}.mlp.gate_proj.weight": (I, H), f"layers.{i}.mlp.up_proj.weight": (I, H),
            f"layers.{i}.mlp.down_proj.weight": (H, I)})
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, Kc, H)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * Kc * H // G, H)
    if dflash2:
        shapes.update({"candidate_selector.hidden_projection.weight": (R, H),
                       "candidate_selector.predecessor_codebook": (V, R),
                       "candidate_selector.successor_codebook": (V, R)})
    return shapes


SPEC_CONFIG_KEYS = {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                    "tie_word_embeddings", "architectures", "num_target_layers", "block_size", "dflash_config"}
SPEC_DFLASH_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
                    "selector_rank", "selector_top_k"}


def checkpoint_drafter(target, **overrides):
    """float32, 2 layers, and every parameter random, so no tensor can hide behind its init."""
    shape = dict(num_layers=2, block_size=5, target_layer_ids=[0, 1], selector_top_k=4)
    drafter = tiny_drafter(target, seed=4, dtype=torch.float32, **{**shape, **overrides})
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpoint.save_export(checkpoint_drafter(target), path, dtype=torch.float32)
    return path


def draft_inputs(drafter, target, seed=5):
    g = torch.Generator().manual_seed(seed)
    B, S = drafter.config.block_size, 7
    block = torch.randint(0, target.config.vocab_size, (1, B), generator=g)
    with torch.no_grad():
        hs = target(torch.randint(0, target.config.vocab_size, (1, S), generator=g), output_hidden_states=True).hidden_states
    ctx = context_features(hs, drafter.config.target_layer_ids).float()
    return target.get_input_embeddings()(block).float(), torch.arange(S, S + B)[None], ctx, torch.arange(S)[None], block[:, 0]


@torch.no_grad()
def drafts(drafter, target, inputs, temperature):
    """Hidden states and the proposal (path, cand, q) of one draft pass."""
    *forward_args, anchor = inputs
    h = drafter(*forward_args)[:, 1:]
    unary = target.get_output_embeddings()(h.double()).float()
    return (h, *drafter.propose(h, unary, anchor, temperature, torch.Generator().manual_seed(0)))


def assert_same_drafts(a, b, what):
    for name, x, y in zip(("hidden states", "path", "candidates", "q"), a, b):
        if x is None or y is None:  # a unary drafter's candidates: every token
            assert x is y, f"{what}: {name} {x} and {y}"
            continue
        assert torch.equal(x, y), f"{what}: {name} differ (max |diff| {(x.double() - y.double()).abs().max().item():.3g})"


def tensor_shapes(path):
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, {f.get_slice(k).get_dtype() for k in f.keys()}


def assert_tensor_contract(path, dflash2):
    shapes, _ = tensor_shapes(path)
    spec = spec_tensor_shapes(dflash2)
    assert shapes == spec, (f"tensors: missing {sorted(set(spec) - set(shapes))}, unexpected {sorted(set(shapes) - set(spec))}, "
                            f"mis-shaped {sorted(f'{k} {shapes[k]} != {spec[k]}' for k in spec if k in shapes and shapes[k] != spec[k])}")


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    edit(tensors)
    safetensors.torch.save_file(tensors, path / "model.safetensors")


# -----------------------------------------------------------------------------
# export: the §7 contract, round trips, dtype, parts off, file modes, crashes


def test_fp32_export_follows_the_contract_and_drafts_the_same_after_reload(tmp_path, target):
    drafter = checkpoint_drafter(target)
    path = tmp_path / "ckpt"
    checkpoint.save_export(drafter, path, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and sorted(os.listdir(path)) == ["config.json", "model.safetensors"], (
        f"export left {sorted(os.listdir(tmp_path))}, holding {sorted(os.listdir(path))}")

    assert_tensor_contract(path, dflash2=True)
    dtypes = tensor_shapes(path)[1]
    assert dtypes == {"F32"}, f"fp32 export holds {dtypes}"

    config = json.loads((path / "config.json").read_text())
    assert SPEC_CONFIG_KEYS <= set(config) and ({"rope_theta", "rope_parameters"} & set(config)), (
        f"config.json lacks {sorted(SPEC_CONFIG_KEYS - set(config))} or both rope_theta and rope_parameters")
    # anything else must be a field a Qwen3 config has (torch_dtype: the spelling transformers < 5 wrote)
    qwen3_keys = set(transformers.Qwen3Config().to_dict()) | {"rope_theta", "torch_dtype"}
    assert set(config) - SPEC_CONFIG_KEYS <= qwen3_keys, f"config.json keys outside SPEC and Qwen3: {sorted(set(config) - SPEC_CONFIG_KEYS - qwen3_keys)}"
    assert set(config["dflash_config"]) == SPEC_DFLASH_KEYS, f"dflash_config keys {sorted(config['dflash_config'])}"
    want = dict(architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=32,
                tie_word_embeddings=False, num_target_layers=3, block_size=5)
    got = {k: config[k] for k in want}
    assert got == want, f"config.json {got} != {want}"
    want_dflash = dict(block_size=5, mask_token_id=31, target_layer_ids=[0, 1], conv_kernel_size=2, conv_group_size=8,
                       selector_rank=4, selector_top_k=4)
    assert config["dflash_config"] == want_dflash, f"dflash_config {config['dflash_config']} != {want_dflash}"
    qwen3 = transformers.Qwen3Config.from_pretrained(path)
    assert (qwen3.hidden_size, qwen3.num_hidden_layers, qwen3.rope_parameters["rope_theta"]) == (32, 2, drafter.config.rope_theta), (
        f"transformers reads config.json as {qwen3}")

    loaded = checkpoint.load_export(path)
    assert loaded.config == drafter.config, f"config after the round trip {loaded.config} != {drafter.config}"
    inputs = draft_inputs(drafter, target)
    for temperature in (0.0, 1.0):
        assert_same_drafts(drafts(loaded, target, inputs, temperature), drafts(drafter, target, inputs, temperature),
                           f"fp32 round trip, T={temperature}")


@pytest.mark.parametrize("folder", ["drafter", "drafter_v1", "drafter_conv_only", "drafter_selector_only"])
def test_config_json_is_byte_identical_to_the_published_exports(tmp_path, folder):
    """Engines and porters may read config.json as text (key order, indent, number spelling):
    re-exporting a committed golden drafter writes its config.json byte for byte."""
    published = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "port", "golden", folder)
    with open(os.path.join(published, "config.json"), "rb") as f:
        want = f.read()
    dtype = getattr(torch, json.loads(want)["torch_dtype"])  # the partial variants are published in bf16
    checkpoint.save_export(checkpoint.load_export(published), tmp_path / "ckpt", dtype=dtype)
    got = (tmp_path / "ckpt" / "config.json").read_bytes()
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, (f"{folder}/config.json differs from byte {at} on ({len(got)} bytes, published {len(want)}): "
                         f"{got[at:at + 60]!r} != published {want[at:at + 60]!r}")


def test_export_is_bf16_by_default_and_reloads_the_rounded_weights(tmp_path, target):
    drafter = checkpoint_drafter(target)
    checkpoint.save_export(drafter, tmp_path / "ckpt")
    dtypes = tensor_shapes(tmp_path / "ckpt")[1]
    assert dtypes == {"BF16"}, f"default export holds {dtypes}, not bf16"
    assert transformers.Qwen3Config.from_pretrained(tmp_path / "ckpt").dtype == torch.bfloat16, "config.json does not say bfloat16"
    loaded = checkpoint.load_export(tmp_path / "ckpt").state_dict()
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded[k], v.bfloat16().float()), f"{k} is not the bf16 rounding of the saved tensor"


@pytest.mark.parametrize("part_off", ["conv_kernel_size", "selector_top_k"])
def test_a_drafter_with_one_part_off_exports_a_complete_servable_dflash2(tmp_path, target, part_off):
    """Engines build both parts for DFlash2DraftModel: the missing one is exported as the
    exact identity, so the reloaded full DFlash2 drafter drafts the same greedy tokens."""
    drafter = checkpoint_drafter(target, **{part_off: 0})
    checkpoint.save_export(drafter, tmp_path / "ckpt", dtype=torch.float32)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"], f"{part_off}=0 exported as {config['architectures']}"
    assert config["dflash_config"]["conv_kernel_size"] > 0 and config["dflash_config"]["selector_top_k"] > 0, (
        f"{part_off}=0 exported dflash_config {config['dflash_config']}")
    assert_tensor_contract(tmp_path / "ckpt", dflash2=True)
    loaded = checkpoint.load_export(tmp_path / "ckpt")
    inputs = draft_inputs(drafter, target)
    (h0, path0, *_), (h1, path1, *_) = drafts(drafter, target, inputs, 0.0), drafts(loaded, target, inputs, 0.0)
    assert torch.equal(h1, h0), f"{part_off}=0: hidden states after reload differ by {(h1 - h0).abs().max():.3g}"
    assert torch.equal(path1, path0), f"{part_off}=0: greedy drafts {path1.tolist()} != {path0.tolist()} before export"


def test_a_convolution_filled_in_for_export_takes_a_group_size_that_divides_h(tmp_path, target):
    """A drafter without the convolution may hold any conv_group_size (unused); the identity
    convolution its export gains takes it where it divides H, else G = H (one coefficient per tap),
    and the reloaded drafter drafts the same."""
    H = target.config.hidden_size
    for group, want in ((12, H), (H // 4, H // 4)):
        drafter = checkpoint_drafter(target, conv_kernel_size=0, conv_group_size=group)
        checkpoint.save_export(drafter, tmp_path / str(group), dtype=torch.float32)
        loaded = checkpoint.load_export(tmp_path / str(group))
        assert (loaded.config.conv_kernel_size, loaded.config.conv_group_size) == (2, want), \
            f"conv_group_size {group} (H = {H}) exported as Kc = {loaded.config.conv_kernel_size}, " \
            f"G = {loaded.config.conv_group_size}; expected Kc = 2, G = {want}"
        inputs = draft_inputs(drafter, target)
        assert_same_drafts(drafts(loaded, target, inputs, 0.0), drafts(drafter, target, inputs, 0.0),
                           f"conv_group_size {group}")


def test_factored_codebooks_export_as_the_tables_they_stand_for(tmp_path, target):
    """A drafter whose selector has factored codebooks (§3) exports as any DFlash2 drafter: the
    §7 tensors and the config.json of the same drafter with free codebooks, the tables being
    A = W_in·W_Aᵀ and Bc = W_in·W_Bᵀ (against a loop over the vocabulary, W_in the target's input
    embedding), so the loaded drafter's edge scores and greedy walk are the factored one's."""
    drafter, embed = checkpoint_drafter(target, selector_codebooks="factored"), target.get_input_embeddings()
    with pytest.raises(ValueError, match="factored codebooks: exporting it needs the target's input embedding"):
        checkpoint.save_export(drafter, tmp_path / "none", dtype=torch.float32)
    assert not (tmp_path / "none").exists(), "a refused export left a folder"
    checkpoint.save_export(drafter, tmp_path / "ckpt", dtype=torch.float32, embedding=embed)
    checkpoint.save_export(checkpoint_drafter(target), tmp_path / "free", dtype=torch.float32)
    assert_tensor_contract(tmp_path / "ckpt", dflash2=True)
    assert (tmp_path / "ckpt" / "config.json").read_text() == (tmp_path / "free" / "config.json").read_text(), \
        "config.json of the factored export differs from the free one's"
    loaded = checkpoint.load_export(tmp_path / "ckpt")
    assert loaded.config == dataclasses.replace(drafter.config, selector_codebooks="free"), loaded.config

    sel, W_in, state = drafter.candidate_selector, embed.weight.tolist(), loaded.state_dict()
    for side in ("predecessor", "successor"):
        W = getattr(sel, f"{side}_projection").weight.tolist()
        want = torch.tensor([[sum(w[i] * row[i] for i in range(len(row))) for w in W] for row in W_in])
        got = state[f"candidate_selector.{side}_codebook"]
        assert (got - want).abs().max() < 1e-5, f"{side}_codebook differs from W_in·W by {(got - want).abs().max():.3g}"
    kept = {k: v for k, v in drafter.state_dict().items()
            if not k.startswith(("candidate_selector.predecessor", "candidate_selector.successor"))}
    differ = [k for k, v in kept.items() if not torch.equal(state[k], v)]
    assert not differ and len(state) == len(kept) + 2, f"backbone tensors changed on export: {differ}"

    *forward, anchor = draft_inputs(drafter, target)
    with torch.no_grad():
        h = drafter(*forward)[:, 1:].expand(3, -1, -1)
        unary = target.get_output_embeddings()(h.double()).float()
        cand = unary.topk(4, dim=-1).indices
        prev = torch.randint(0, 32, cand.shape[:-1], generator=torch.Generator().manual_seed(0))
        factored, exported = sel.edge_scores(h, unary, prev, cand, W_in=embed.weight), \
            loaded.candidate_selector.edge_scores(h, unary, prev, cand)
        walks = drafter.propose(h, unary, prev[:, 0], W_in=embed.weight)[0], loaded.propose(h, unary, prev[:, 0])[0]
    assert (factored - exported).abs().max() < 1e-5, f"edge scores differ by {(factored - exported).abs().max():.3g}"
    assert (factored - unary.gather(-1, cand)).abs().max() > 1e-2, "the pairwise term is ~0: the check has no teeth"
    assert torch.equal(*walks), f"greedy walks {walks[0].tolist()} (factored) != {walks[1].tolist()} (export)"


def test_resume_state_keeps_the_factored_weights(tmp_path, target):
    """resume.pt holds W_A and W_B, not the exported tables, so --resume trains them on."""
    drafter = checkpoint_drafter(target, selector_codebooks="factored")
    optimizer = torch.optim.AdamW(drafter.parameters())
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    checkpoint.save_checkpoint(drafter, optimizer, 7, tmp_path,
                               dict(dtype=torch.float32, embedding=target.get_input_embeddings()), {"target_weights": [1.0]})
    state = torch.load(tmp_path / "resume.pt", weights_only=True)
    selector = sorted(k for k in state["model"] if k.startswith("candidate_selector."))
    assert selector == [f"candidate_selector.{n}_projection.weight" for n in ("hidden", "predecessor", "successor")], \
        f"resume.pt holds the selector tensors {selector}"
    fresh = DFlash2Drafter(drafter.config, rope=drafter.rope)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert checkpoint.resume(state, {"target_weights": [1.0]}, fresh, fresh_optimizer, tmp_path, False) == 7
    differ = [k for k, v in drafter.state_dict().items() if not torch.equal(fresh.state_dict()[k], v)]
    moments = [torch.equal(fresh_optimizer.state[a]["exp_avg"], optimizer.state[b]["exp_avg"])
               for a, b in zip(fresh.parameters(), drafter.parameters())]
    assert not differ and all(moments), f"resumed weights differ in {differ}, AdamW moments equal: {moments}"


def test_export_is_readable_by_other_users(tmp_path, target):
    old = os.umask(0o077)
    try:
        checkpoint.save_export(checkpoint_drafter(target), tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").iterdir()]}
    assert modes == {"ckpt": "0o755", "config.json": "0o644", "model.safetensors": "0o644"}, f"modes {modes}"


def boom(*args, **kwargs):
    raise OSError("disk full")


def half_written_json(obj, f, **kwargs):
    f.write('{"architectures": ')
    raise OSError("disk full")


@pytest.mark.parametrize("crash", ["safetensors.torch.save_file", "json.dump"])
@pytest.mark.parametrize("existing", [False, True])
def test_crash_mid_save_leaves_no_partial_checkpoint(monkeypatch, tmp_path, saved_checkpoint, target, crash, existing):
    path = tmp_path / "ckpt"
    if existing:
        shutil.copytree(saved_checkpoint, path)
    before = {f: (path / f).read_bytes() for f in os.listdir(path)} if existing else None
    monkeypatch.setattr(crash, boom if crash.startswith("safetensors") else half_written_json)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_export(checkpoint_drafter(target), path)
    assert sorted(os.listdir(tmp_path)) == (["ckpt"] if existing else []), f"a crash in {crash} left {sorted(os.listdir(tmp_path))}"
    if existing:
        after = {f: (path / f).read_bytes() for f in os.listdir(path)}
        assert after == before, f"a crash in {crash} changed the older checkpoint: files {sorted(after)} vs {sorted(before)}"


# -----------------------------------------------------------------------------
# DFlash (v1) checkpoints and the warm start from them


LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}  # a target's RoPE whose tables come from harness.target.rope_tables


@pytest.mark.parametrize("part_off", ["conv_kernel_size", "selector_top_k", "v1 warm start"])
def test_a_rope_scaled_drafter_gaining_a_part_keeps_its_rope(tmp_path, target, part_off):
    """with_parts rebuilds a drafter with the part it lacks: the export of a rope-scaled drafter with one part off
    (the part filled in), and train.py's warm start from a rope-scaled v1 export (its parts joining), each draft
    what the drafter drafted before, with its RoPE."""
    if part_off == "v1 warm start":
        drafter = checkpoint_drafter(target, conv_kernel_size=0, selector_top_k=0, rope_scaling=LINEAR_ROPE)
        checkpoint.save_export(drafter, tmp_path / "v1", dtype=torch.float32)
        gained = checkpoint.with_parts(checkpoint.load_export(tmp_path / "v1"), conv_kernel_size=2,
                                       conv_group_size=8, selector_top_k=4, selector_rank=4)
    else:
        drafter = checkpoint_drafter(target, rope_scaling=LINEAR_ROPE, **{part_off: 0})
        checkpoint.save_export(drafter, tmp_path / "ckpt", dtype=torch.float32)
        gained = checkpoint.load_export(tmp_path / "ckpt")
    assert gained.config.is_dflash2 and gained.config.rope_scaling == LINEAR_ROPE, f"{part_off}: {gained.config}"
    inputs = draft_inputs(drafter, target)
    (h0, path0, *_), (h1, path1, *_) = drafts(drafter, target, inputs, 0.0), drafts(gained, target, inputs, 0.0)
    assert torch.equal(h1, h0), f"{part_off}: hidden states differ by {(h1 - h0).abs().max():.3g} from the drafter's"
    assert torch.equal(path1, path0), f"{part_off}: greedy drafts {path1.tolist()} != {path0.tolist()} before"


def test_v1_checkpoint_loads_and_warm_starts_dflash2(tmp_path, target):
    v1 = checkpoint_drafter(target, conv_kernel_size=0, selector_top_k=0)
    checkpoint.save_export(v1, tmp_path / "v1", dtype=torch.float32)
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"], f"v1 architectures {config['architectures']}"
    off = {k: config["dflash_config"][k] for k in ("conv_kernel_size", "selector_top_k") if k in config["dflash_config"]}
    assert {"block_size", "mask_token_id", "target_layer_ids"} <= set(config["dflash_config"]) <= SPEC_DFLASH_KEYS \
        and not any(off.values()), f"v1 dflash_config {config['dflash_config']}"
    assert_tensor_contract(tmp_path / "v1", dflash2=False)

    loaded = checkpoint.load_export(tmp_path / "v1")
    assert not loaded.config.is_dflash2 and loaded.candidate_selector is None, f"v1 loaded as {loaded.config}"
    warm = checkpoint.load_export(tmp_path / "v1", conv_kernel_size=2, conv_group_size=8, selector_top_k=4, selector_rank=4)
    assert warm.config.is_dflash2 and warm.layers[0].attention_conv is not None, f"warm start built {warm.config}"
    inputs = draft_inputs(v1, target)
    reference = drafts(v1, target, inputs, 0.0)
    assert_same_drafts(drafts(loaded, target, inputs, 0.0), reference, "v1 round trip")
    h, path = drafts(warm, target, inputs, 0.0)[:2]
    assert torch.equal(h, reference[0]), f"warm-started hidden states differ by {(h - reference[0]).abs().max().item():.3g}"
    assert torch.equal(path, reference[1]), f"warm-started greedy proposal {path.tolist()} != v1's {reference[1].tolist()}"
    # lossless decoding makes both outputs the target's greedy text: the acceptance lengths show the proposals agree
    prompt = torch.tensor([[11, 30, 2, 2, 8, 19]])
    (out_v1, stats_v1), (out_warm, stats_warm) = (spec_generate(d, target, prompt, 20) for d in (loaded, warm))
    assert out_warm.tolist() == out_v1.tolist() and stats_warm.acceptance_lengths == stats_v1.acceptance_lengths, (
        f"warm start: {out_warm.tolist()} with acceptance lengths {stats_warm.acceptance_lengths}, "
        f"v1: {out_v1.tolist()} with {stats_v1.acceptance_lengths}")


# -----------------------------------------------------------------------------
# vllm-project speculators' format: read, written, refused

VERIFIER = {"name_or_path": "tiny/qwen3-target", "architectures": ["Qwen3ForCausalLM"]}
LAYER = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
         "attention_bias": False, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "vocab_size": 32,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
ZLAB_CONFIG = {"architectures": ["DFlash2DraftModel"], **LAYER, "num_target_layers": 3, "block_size": 5,
               "dflash_config": {"block_size": 5, "mask_token_id": 31, "target_layer_ids": [0, 1], "conv_kernel_size": 2,
                                 "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4},
               "torch_dtype": "float32"}
SPECULATORS_CONFIG = {  # the checkpoint drafter as speculators 0.9.0 writes it: aux ids = target_layer_ids + 1
    "architectures": ["DFlash2DraftModel"], "auto_map": {"": "config.DFlash2SpeculatorConfig"},
    "aux_hidden_state_layer_ids": [1, 2], "block_size": 5, "conv_group_size": 8, "conv_kernel_size": 2,
    "draft_vocab_size": 32, "mask_token_id": 31, "sample_from_anchor": False, "selector_rank": 4, "selector_top_k": 4,
    "sliding_window_non_causal": True,
    "speculators_config": {"algorithm": "dflash2", "default_proposal_method": "greedy",
                           "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                 "speculative_tokens": 4, "verifier_accept_k": 1}],
                           "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "tiny/qwen3-target"}},
    "speculators_model_type": "dflash2", "speculators_version": "0.9.0", "target_hidden_size": 32,
    "tie_word_embeddings": False, "transformer_layer_config": LAYER, "torch_dtype": "float32"}


def shape_of(config):
    """The config's fields, less conv_group_size and selector_rank for a v1 drafter (§7: they
    matter only for a part that is on, and a v1 config.json holds neither)."""
    return {k: v for k, v in dataclasses.asdict(config).items()
            if config.is_dflash2 or k not in ("conv_group_size", "selector_rank")}


def speculators_checkpoint(path, saved_checkpoint, **edits):
    """A folder as speculators writes it: SPECULATORS_CONFIG (with edits; None drops a key) beside
    the z-lab export's model.safetensors, the tensor names of both formats being the same."""
    path.mkdir()
    shutil.copy(saved_checkpoint / "model.safetensors", path)
    config = {k: v for k, v in {**SPECULATORS_CONFIG, **edits}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_speculators_checkpoint_decodes_as_the_same_drafters_z_lab_export(tmp_path, saved_checkpoint, target):
    """A config.json written from speculators' field list, over the z-lab export's tensors: the
    same drafter, so spec_generate at T = 0 gives the same tokens in the same acceptance lengths."""
    zlab = checkpoint.load_export(saved_checkpoint)
    theirs = checkpoint.load_export(speculators_checkpoint(tmp_path / "spec", saved_checkpoint), num_target_layers=3)
    assert theirs.config == zlab.config, f"speculators config read as {theirs.config}, z-lab as {zlab.config}"
    prompt = torch.tensor([[11, 30, 2, 2, 8, 19]])
    (out, stats), (want, want_stats) = (spec_generate(d, target, prompt, 20) for d in (theirs, zlab))
    assert out.tolist() == want.tolist() and stats.acceptance_lengths == want_stats.acceptance_lengths, (
        f"speculators checkpoint: {out.tolist()} with acceptance lengths {stats.acceptance_lengths}, "
        f"z-lab export: {want.tolist()} with {want_stats.acceptance_lengths}")
    assert max(stats.acceptance_lengths) > 1, f"acceptance lengths {stats.acceptance_lengths}: nothing drafted was kept"


def test_a_speculators_dflash_v1_checkpoint_loads_as_v1(tmp_path, target):
    v1 = checkpoint_drafter(target, conv_kernel_size=0, selector_top_k=0)
    checkpoint.save_export(v1, tmp_path / "v1", dtype=torch.float32)
    v1_config = {k: v for k, v in SPECULATORS_CONFIG.items() if k not in checkpoint.DFLASH2_FIELDS}
    v1_config.update(architectures=["DFlashDraftModel"], auto_map={"": "config.DFlashSpeculatorConfig"},
                     speculators_model_type="dflash", sliding_window_non_causal=False,
                     speculators_config={**SPECULATORS_CONFIG["speculators_config"], "algorithm": "dflash"})
    edit_config(tmp_path / "v1", lambda c: (c.clear(), c.update(v1_config)))
    loaded = checkpoint.load_export(tmp_path / "v1", num_target_layers=3)
    assert shape_of(loaded.config) == shape_of(v1.config), f"speculators dflash read as {loaded.config}, not {v1.config}"
    inputs = draft_inputs(v1, target)
    assert_same_drafts(drafts(loaded, target, inputs, 0.0), drafts(v1, target, inputs, 0.0), "speculators v1")


def test_a_dflash_v1_sliding_drafters_speculators_export_is_non_causal_and_loads_back(tmp_path, target):
    """speculators' "dflash" type defaults to causal sliding layers; a DFlash block is bidirectional,
    so the export must say sliding_window_non_causal, or vLLM reads another drafter (and the loader refuses)."""
    v1 = checkpoint_drafter(target, conv_kernel_size=0, selector_top_k=0, sliding_window=3,
                            layer_types=["sliding_attention", "full_attention"])
    checkpoint.save_export(v1, tmp_path / "v1", torch.float32, export_format="speculators", verifier=VERIFIER)
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    said = {k: config.get(k) for k in ("speculators_model_type", "sliding_window_non_causal")}
    assert said == {"speculators_model_type": "dflash", "sliding_window_non_causal": True}, f"the export says {said}"
    loaded = checkpoint.load_export(tmp_path / "v1", num_target_layers=3)
    assert shape_of(loaded.config) == shape_of(v1.config), f"loaded as {loaded.config}, not {v1.config}"
    inputs = draft_inputs(v1, target)
    assert_same_drafts(drafts(loaded, target, inputs, 0.0), drafts(v1, target, inputs, 0.0), "speculators v1, sliding")


@pytest.mark.parametrize("dflash2", [True, False], ids=["dflash2", "v1"])
@pytest.mark.parametrize("export_format", ["z-lab", "speculators"])
def test_round_trip_in_both_formats_writes_the_expected_config(tmp_path, target, export_format, dflash2):
    drafter = checkpoint_drafter(target, **({} if dflash2 else dict(conv_kernel_size=0, selector_top_k=0)))
    checkpoint.save_export(drafter, tmp_path / "ckpt", torch.float32, export_format=export_format, verifier=VERIFIER)
    want = dict(ZLAB_CONFIG if export_format == "z-lab" else SPECULATORS_CONFIG)
    if not dflash2 and export_format == "z-lab":
        want.update(architectures=["DFlashDraftModel"], dflash_config={"block_size": 5, "mask_token_id": 31,
                                                                      "target_layer_ids": [0, 1]})
    elif not dflash2:
        want = {k: v for k, v in want.items() if k not in checkpoint.DFLASH2_FIELDS}
        want.update(architectures=["DFlashDraftModel"], auto_map={"": "config.DFlashSpeculatorConfig"},
                    speculators_model_type="dflash", sliding_window_non_causal=False,
                    speculators_config={**want["speculators_config"], "algorithm": "dflash"})
    got = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert got == want, f"{export_format} config.json differs in {sorted(k for k in {*got, *want} if got.get(k) != want.get(k))}"
    loaded = checkpoint.load_export(tmp_path / "ckpt", num_target_layers=3)
    assert shape_of(loaded.config) == shape_of(drafter.config), (
        f"{export_format} round trip: {loaded.config} != {drafter.config}")
    inputs = draft_inputs(drafter, target)
    assert_same_drafts(drafts(loaded, target, inputs, 0.0), drafts(drafter, target, inputs, 0.0),
                       f"{export_format} round trip")


SPECULATORS_REFUSED = {  # edit of SPECULATORS_CONFIG -> what the one-line message must name
    "unknown field": (dict(projector_type="domino"), "projector_type is not a field of a speculators 'dflash2' config"),
    "DFlash2 field in a v1 config": (dict(speculators_model_type="dflash"), "conv_group_size, conv_kernel_size, "
                                     "selector_rank, selector_top_k is not a field of a speculators 'dflash'"),
    "another algorithm": (dict(speculators_model_type="eagle3"), "speculators_model_type 'eagle3' is not a DFlash"),
    "sample_from_anchor": (dict(sample_from_anchor=True), "sample_from_anchor = True is not supported"),
    "pruned vocabulary": (dict(draft_vocab_size=16), "draft_vocab_size = 16 is not supported"),
    "other target width": (dict(target_hidden_size=64), "target_hidden_size = 64 is not supported"),
    "embedding layer": (dict(aux_hidden_state_layer_ids=[0, 2]), r"aux_hidden_state_layer_ids = \[0, 2\] is not"),
    "no mask token": (dict(mask_token_id=None), "lacks the key 'mask_token_id'"),
    "causal sliding layers": (dict(transformer_layer_config={**LAYER, "layer_types": ["sliding_attention"] * 2,
                                                             "use_sliding_window": True, "sliding_window": 4},
                                   sliding_window_non_causal=False), "sliding_window_non_causal = False makes"),
}


def test_a_partial_speculators_layer_config_takes_the_transformers_class_defaults():
    """speculators reads transformer_layer_config through transformers' config class for its
    model_type: the fields it leaves out are that class's defaults, the ones it holds are kept."""
    left_out = ("intermediate_size", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_parameters")
    layer = {k: v for k, v in LAYER.items() if k not in left_out}
    fields = checkpoint.speculators_fields({**SPECULATORS_CONFIG, "transformer_layer_config": layer}, "config.json")
    default = transformers.Qwen3Config()
    want = dict(intermediate_size=default.intermediate_size, rms_norm_eps=default.rms_norm_eps,
                max_position_embeddings=default.max_position_embeddings,
                rope_theta=default.rope_parameters["rope_theta"], hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, vocab_size=32)
    got = {k: fields.get(k) for k in want}
    assert got == want, f"read {got}, expected the given fields and Qwen3Config's defaults {want}"


@pytest.mark.parametrize("case", SPECULATORS_REFUSED)
def test_a_speculators_field_that_cannot_be_honoured_is_refused_by_name(tmp_path, saved_checkpoint, case):
    edits, match = SPECULATORS_REFUSED[case]
    path = speculators_checkpoint(tmp_path / "spec", saved_checkpoint, **edits)
    with pytest.raises(ValueError, match=match) as refused:
        checkpoint.load_export(path, num_target_layers=3)
    assert "\n" not in str(refused.value), f"{case}: the refusal is not one line: {refused.value}"


def test_the_target_layer_count_is_required_for_speculators_and_checked_for_z_lab(tmp_path, saved_checkpoint):
    with pytest.raises(ValueError, match="does not record the target's layer count: pass num_target_layers"):
        checkpoint.load_export(speculators_checkpoint(tmp_path / "spec", saved_checkpoint))
    with pytest.raises(ValueError, match="has num_target_layers 3 but the target has 4"):
        checkpoint.load_export(saved_checkpoint, num_target_layers=4)


def test_a_speculators_export_without_a_verifier_is_refused_before_writing(tmp_path, target):
    with pytest.raises(ValueError, match="the speculators format names the verifier"):
        checkpoint.save_export(checkpoint_drafter(target), tmp_path / "ckpt", export_format="speculators")
    with pytest.raises(ValueError, match="export format 'hf' must be one of z-lab, speculators"):
        checkpoint.save_export(checkpoint_drafter(target), tmp_path / "ckpt", export_format="hf")
    assert not (tmp_path / "ckpt").exists(), "a refused export left a folder"


# -----------------------------------------------------------------------------
# what the loader refuses


UNSUPPORTED = {  # config.json edit -> what the refusal names
    "causal": ({"is_causal": True}, r"is_causal = True makes draft layers \[0, 1\] causal"),
    "causal by z-lab's default": ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                                   "sliding_window": 4}, r"is_causal = None makes draft layers \[0\] causal"),
    "unknown rope": ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6, "factor": 4.0}},
                     "rope_type 'mrope' is not supported"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    "bias": ({"attention_bias": True}, "attention_bias = True is not supported")}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_config_fields_dflash2_does_not_implement_are_refused(tmp_path, saved_checkpoint, case):
    path = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, path)
    edit, match = UNSUPPORTED[case]
    edit_config(path, lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match):
        checkpoint.load_export(path)


def test_unimplemented_config_fields_at_their_plain_values_load(tmp_path, saved_checkpoint):
    """The refused fields at the values that ask for nothing dflash2.py lacks load as the export without them:
    the same config, field by field, and the same tensors."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, path)
    plain = {"output_multiplier": 1.0, "final_logit_softcapping": None, "layer_types": ["full_attention"] * 2,
             "use_sliding_window": False, "sliding_window": 4096, "is_causal": False, "hidden_act": "silu"}
    edit_config(path, lambda c: c.update(plain))
    got, want = checkpoint.load_export(path), checkpoint.load_export(saved_checkpoint)
    fields, base = dataclasses.asdict(got.config), dataclasses.asdict(want.config)
    assert fields == base, f"with {plain} the config loads {({k: v for k, v in fields.items() if base[k] != v})}, " \
        f"without them {({k: v for k, v in base.items() if fields[k] != v})}"
    state, saved = got.state_dict(), want.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved), \
        f"with {plain} the tensors {sorted(state)} load otherwise than {sorted(saved)}"


def test_a_z_lab_config_with_the_view_fields_at_its_top_level_loads_them(tmp_path, saved_checkpoint):
    """z-lab reads each of the target's transforms from dflash_config, else from the top level."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, path)
    view = {"final_logit_softcapping": 20.0, "output_multiplier": 0.19611613513818404, "input_embedding_scale": 5.0}
    edit_config(path, lambda c: c.update(view))
    loaded = {k: getattr(checkpoint.load_export(path).config, k) for k in view}
    assert loaded == view, f"the top level's {view} loaded as {loaded}"
    edit_config(path, lambda c: c["dflash_config"].update(output_multiplier=0.5))
    loaded = checkpoint.load_export(path).config.output_multiplier
    assert loaded == 0.5, f"output_multiplier 0.5 in dflash_config, {view['output_multiplier']} on top: read {loaded}"


@pytest.mark.parametrize("export_format", ["z-lab", "speculators"])
def test_sliding_layer_types_without_use_sliding_window_load_as_full_attention(tmp_path, target, export_format):
    """Qwen3Config drops sliding_window unless use_sliding_window, and the engines then run every layer
    with full attention: the loader reads the same drafter, and refuses nothing."""
    drafter = checkpoint_drafter(target)
    checkpoint.save_export(drafter, tmp_path / "ckpt", torch.float32, export_format=export_format, verifier=VERIFIER)
    sliding = {"layer_types": ["sliding_attention"] * 2, "use_sliding_window": False, "sliding_window": 2}
    if export_format == "z-lab":  # z-lab makes sliding_attention layers causal unless is_causal is false
        edit_config(tmp_path / "ckpt", lambda c: c.update(sliding, is_causal=False))
    else:
        edit_config(tmp_path / "ckpt", lambda c: c["transformer_layer_config"].update(sliding))
    loaded = checkpoint.load_export(tmp_path / "ckpt", num_target_layers=3)
    read = (loaded.config.layer_types, loaded.config.sliding_window)
    assert read == (None, None), f"{export_format}: read as layer_types, sliding_window = {read}, not full attention"
    inputs = draft_inputs(drafter, target)
    assert_same_drafts(drafts(loaded, target, inputs, 0.0), drafts(drafter, target, inputs, 0.0),
                       f"{export_format}, use_sliding_window false")


MALFORMED = {
    "missing config.json": (lambda p: os.remove(p / "config.json"), "config.json not found"),
    "missing model.safetensors": (lambda p: os.remove(p / "model.safetensors"), "model.safetensors not found"),
    "wrong architectures": (lambda p: edit_config(p, lambda c: c.update(architectures=["Qwen3ForCausalLM"])), "architectures"),
    "config lacks hidden_size": (lambda p: edit_config(p, lambda c: c.pop("hidden_size")), "hidden_size"),
    "config lacks mask_token_id": (lambda p: edit_config(p, lambda c: c["dflash_config"].pop("mask_token_id")), "mask_token_id"),
    "missing tensor": (lambda p: edit_tensors(p, lambda t: t.pop("norm.weight")), r"missing \['norm.weight'\]"),
    "missing DFlash2 tensor": (lambda p: edit_tensors(p, lambda t: t.pop("candidate_selector.successor_codebook")),
                               r"missing \['candidate_selector.successor_codebook'\]"),  # only a v1 checkpoint may lack it
    "unexpected tensor": (lambda p: edit_tensors(p, lambda t: t.update({"lm_head.weight": torch.zeros(32, 32)})),
                          r"unexpected \['lm_head.weight'\]"),
    "mis-shaped tensor": (lambda p: edit_tensors(p, lambda t: t.update({"fc.weight": t["fc.weight"][:, :32].contiguous()})),
                          r"mis-shaped \['fc.weight \(32, 32\) != \(32, 64\)'\]"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_checkpoint_is_refused_naming_what_is_wrong(tmp_path, saved_checkpoint, case):
    corrupt, match = MALFORMED[case]
    path = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, path)
    corrupt(path)
    with pytest.raises(ValueError, match=match):
        checkpoint.load_export(path)


class Payload:
    """Unpickling this creates a marker file: proof that a loader ran pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickled_weights_are_never_unpickled(tmp_path, saved_checkpoint):
    pickle.loads(pickle.dumps(Payload(str(tmp_path / "armed"))))
    assert (tmp_path / "armed").exists(), "the payload does not fire when unpickled: this test could not fail"
    path, marker = tmp_path / "ckpt", tmp_path / "unpickled"
    shutil.copytree(saved_checkpoint, path)
    with open(path / "model.safetensors", "wb") as f:
        pickle.dump({"fc.weight": Payload(str(marker))}, f)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        checkpoint.load_export(path)
    assert not marker.exists(), "loading a checkpoint ran pickle"


def test_an_unknown_override_is_refused_by_name(target, tmp_path):
    checkpoint.save_export(checkpoint_drafter(target), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"unknown DFlash2Config fields \['blocksize'\]"):
        checkpoint.load_export(tmp_path / "ckpt", blocksize=4)


# -----------------------------------------------------------------------------
# the export job: python -m harness.checkpoint


@pytest.fixture(scope="module")
def target_folders(tmp_path_factory, target):
    """Model folders of config.json alone (the export job reads no weights): the checkpoint target's, and two with
    its layer count but another width or vocabulary."""
    folders = {}
    for name, shape in (("same", {}), ("wider", dict(hidden_size=64)), ("more tokens", dict(vocab_size=48))):
        folders[name] = tmp_path_factory.mktemp("target") / "model"
        transformers.Qwen3Config(**{**target.config.to_dict(), **shape}).save_pretrained(folders[name])
    return folders


def export_job(*flags, log=lambda line: None):
    """python -m harness.checkpoint with these flags, its lines to log -> the export's path."""
    return checkpoint.main(checkpoint.parse_args([str(f) for f in flags]), log=log)


def test_the_export_job_writes_the_dtype_asked_for(tmp_path, target_folders, saved_checkpoint):
    """--export-dtype float32 writes float32: the untrained drafter, and a float32 export rewritten with its
    weights exact; bfloat16, the default, rounds them."""
    saved = safetensors.torch.load_file(saved_checkpoint / "model.safetensors")
    for flags, dtype in ((["--drafter-config", '{"mask_token_id": 31}', "--export-dtype", "float32"], torch.float32),
                         (["--from", saved_checkpoint, "--export-dtype", "float32"], torch.float32),
                         (["--from", saved_checkpoint], torch.bfloat16)):
        out = export_job("--target", target_folders["same"], "--out", tmp_path / "out", *flags)
        tensors = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
        written = ({v.dtype for v in tensors.values()}, json.loads(open(os.path.join(out, "config.json")).read())[
            "torch_dtype"])
        assert written == ({dtype}, str(dtype).removeprefix("torch.")), \
            f"{flags}: wrote tensors {written[0]} and torch_dtype {written[1]!r}, expected {dtype}"
        for k, v in saved.items() if "--from" in flags else ():
            assert torch.equal(tensors[k], v.to(dtype)), \
                f"{flags}: {k} is {(tensors[k].double() - v.double()).abs().max():.3g} off the export's {dtype} value"


def test_speculators_export_names_the_target_and_init_from_reads_it_back(world, tmp_path):
    """checkpoint.py --format speculators: config.json names --target as the verifier (vLLM serves the
    folder alone), the job prints that command, and --init-from (build_drafter) reads the export back, its
    architecture winning over the drafter flags."""
    out, printed = tmp_path / "dry", []
    export_job("--target", world["target"], "--out", out, "--num-layers", "1", "--format", "speculators",
               log=printed.append)
    config = json.loads((out / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert config["speculators_model_type"] == "dflash2" and verifier["name_or_path"] == world["target"], (
        f"speculators export: type {config['speculators_model_type']}, verifier {verifier}")
    assert f"vllm serve {out.absolute()}" in printed, printed
    config = load_config(world["target"])
    drafter = checkpoint.build_drafter(config, load_tokenizer(world["target"]), {"num_layers": 2}, init_from=str(out),
                                       log=printed.append)
    exported = checkpoint.load_export(out, num_target_layers=config.num_hidden_layers).state_dict()
    same = all(torch.equal(v, exported[k]) for k, v in drafter.state_dict().items())
    assert drafter.config.num_layers == 1 and same, f"--init-from a 1-layer speculators export built {drafter.config}" \
        f"{'' if same else ' with other weights'}"


def test_the_untrained_export_and_its_serving_commands(world, tmp_path, no_target_load):
    """checkpoint.py without --from reads the target's config and tokenizer only (no weights) and writes
    the export of the drafter shape the flags ask for, which loads back with that shape; it
    prints each engine's command with this export's path and block size (vLLM: B - 1)."""
    out, printed = tmp_path / "dry", []
    export_job("--target", world["target"], "--out", out, "--block-size", "6", "--num-layers", "1",
               "--drafter-config", '{"selector_rank": 8}', log=printed.append)
    drafter = checkpoint.load_export(out)
    target = transformers.AutoConfig.from_pretrained(world["target"])
    c = drafter.config
    assert (c.block_size, c.num_layers, c.selector_rank, c.hidden_size, c.num_target_layers) == \
        (6, 1, 8, target.hidden_size, target.num_hidden_layers), f"exported shape {c}"
    path = str(out.absolute())
    for engine, count in (("vllm serve", '"num_speculative_tokens": 5'), ("sglang.launch_server",
                                                                         "--speculative-num-draft-tokens 6"),
                          ("dflash generate", "--draft")):
        line = next((l for l in printed if engine in l), "")
        assert path in line and count in line, f"{engine}: {line!r} lacks {path} or {count}\n{printed}"


def test_an_untrained_factored_export_is_loadable(world, tmp_path, no_target_load):
    """The untrained export with factored codebooks: no target weights to build the tables from, so it
    holds free tables at their init (a zero successor codebook: the untrained selector's scores)."""
    out = tmp_path / "dry"
    export_job("--target", world["target"], "--out", out, "--num-layers", "1", "--drafter-config",
               '{"selector_rank": 8, "selector_codebooks": "factored"}')
    drafter = checkpoint.load_export(out)
    c, target = drafter.config, transformers.AutoConfig.from_pretrained(world["target"])
    assert (c.selector_rank, c.selector_top_k, c.num_layers, c.vocab_size) == (8, 16, 1, target.vocab_size), c
    successor = drafter.state_dict()["candidate_selector.successor_codebook"]
    assert successor.shape == (target.vocab_size, 8) and not successor.any(), "the successor codebook is not its init"


def test_a_sliding_window_export_has_the_layer_types_asked_for(world, tmp_path, no_target_load):
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    window = json.dumps({"sliding_window": 64, "layer_types": layer_types})
    export_job("--target", world["target"], "--out", tmp_path / "dry", "--num-layers", "3", "--drafter-config", window)
    c = checkpoint.load_export(tmp_path / "dry").config
    assert (c.layer_types, c.sliding_window) == (layer_types, 64), c
    with pytest.raises(ValueError, match=r"layer_types has 3 entries for num_layers = 2"):
        export_job("--target", world["target"], "--out", tmp_path / "bad", "--num-layers", "2", "--drafter-config",
                   window)


@pytest.mark.parametrize("other, differs", [("wider", "hidden_size 32 but the target has 64"),
                                            ("more tokens", "vocab_size 32 but the target has 48")])
def test_the_export_job_refuses_an_export_of_another_targets_shape(tmp_path, target_folders, saved_checkpoint,
                                                                   other, differs):
    """--from an export for a target of the same layer count but another width or vocabulary: refused by name,
    nothing written."""
    with pytest.raises(ValueError) as refused:
        export_job("--target", target_folders[other], "--out", tmp_path / "out", "--from", saved_checkpoint)
    assert str(refused.value).startswith(f"the drafter has {differs}"), f"--from onto a target {other}: {refused.value}"
    assert not (tmp_path / "out").exists(), f"--from onto a target {other}: wrote {list((tmp_path / 'out').iterdir())}"


@pytest.mark.parametrize("shape, differs", [(dict(hidden_size=64), "hidden_size 32 but the target has 64"),
                                            (dict(vocab_size=48), "vocab_size 32 but the target has 48")])
def test_init_from_an_export_of_another_targets_width_or_vocabulary_is_refused_in_one_line(target, saved_checkpoint,
                                                                                           shape, differs):
    """--init-from an export whose target has this one's layer count but another width or vocabulary: the drafter
    train.py would build from it is refused, in one line naming the field, from the target's config alone."""
    other = transformers.Qwen3Config(**{**target.config.to_dict(), **shape})
    with pytest.raises(ValueError) as refused:
        checkpoint.build_drafter(other, None, {}, init_from=str(saved_checkpoint), log=lambda *a: None)
    message = str(refused.value)
    assert message.startswith(f"the drafter has {differs}") and "\n" not in message, \
        f"--init-from onto a target with {shape}: {message!r}"
