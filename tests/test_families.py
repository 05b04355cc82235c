"""The target families of the field: each family's RoPE against transformers' own rotary embedding,
each family's embedding and logit transforms against its own forward, and on a tiny random target
of each family's config class (nothing downloaded) lossless greedy decoding and a few training
steps. Then sliding-window draft layers: the training mask against a brute-force one, the packed
training forward against the cached decoding forward past the window, and the published drafter
configs' fields loaded and decoded."""
import dataclasses
import json

import numpy as np

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import dflash2
from harness import checkpoint, regenerate
from harness import target as target_module
from conftest import ForcedLookup, argmax_loop, chi_square_pvalue, exact_joint3, force_drafts, record_forward
from harness.target import (check_target_view, config_transforms, decoding_view, drafter_config, model_class,
                            rope_tables, target_features, text_config)
from dflash2 import DFlash2Drafter, DraftCache

pytestmark = pytest.mark.usefixtures("one_thread")

V, H, LAYERS, PROMPT, NEW, WINDOW = 96, 32, 4, 12, 20, 6  # prompt + new tokens run well past every window
SHAPE = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
             pad_token_id=0, eos_token_id=1, bos_token_id=2)
LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8)
YARN = dict(rope_type="yarn", rope_theta=1.5e5, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, truncate=False)
GATED_DELTANET = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
LONGROPE = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0 + i / 8 for i in range(4)],
                long_factor=[1.5 + i / 2 for i in range(4)])
FAMILIES = {  # the family's own config class and the fields that make it what it is
    "Llama-3.x": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3)),
    "SmolLM2": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "SmolLM3": (transformers.SmolLM3Config, dict(no_rope_layer_interval=2)),
    "Qwen2.5": (transformers.Qwen2Config, {}),
    "Qwen3": (transformers.Qwen3Config, {}),
    "Qwen3-MoE": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "Mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    "Gemma-2": (transformers.Gemma2Config, dict(sliding_window=WINDOW, final_logit_softcapping=30.0,
                                                 query_pre_attn_scalar=8, tie_word_embeddings=True)),
    "Gemma-3": (transformers.Gemma3TextConfig, dict(sliding_window=WINDOW, query_pre_attn_scalar=8,
                                                     layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                                     tie_word_embeddings=True)),
    "Phi-3": (transformers.Phi3Config, dict(rope_parameters=LONGROPE, original_max_position_embeddings=8)),
    "gpt-oss": (transformers.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                                rope_parameters=YARN)),
    "Granite": (transformers.GraniteConfig, dict(embedding_multiplier=12.0, logits_scaling=8.0,
                                                 residual_multiplier=0.22, attention_multiplier=0.125)),
    "OLMo-2": (transformers.Olmo2Config, {}),
    "Falcon-H1": (transformers.FalconH1Config, dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                                                    mamba_chunk_size=4, embedding_multiplier=2.0,
                                                    lm_head_multiplier=0.039)),
    "Qwen3.5": (transformers.Qwen3_5TextConfig, GATED_DELTANET),
    "Qwen3.5-MoE": (transformers.Qwen3_5MoeTextConfig, dict(GATED_DELTANET, **QWEN_MOE)),
    "Qwen3-Next": (transformers.Qwen3NextConfig, dict(GATED_DELTANET, **QWEN_MOE)),
    "Granite-4": (transformers.GraniteMoeHybridConfig, dict(layer_types=["mamba", "attention"] * 2, mamba_n_heads=4,
                                                            mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4,
                                                            num_local_experts=4, shared_intermediate_size=16,
                                                            embedding_multiplier=12.0, logits_scaling=8.0)),
    "Nemotron-H": (transformers.NemotronHConfig, dict(layers_block_type=["mamba", "attention", "mamba", "mlp"],
                                                      mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                                                      n_groups=1, chunk_size=4)),
    "Kimi-Linear": (transformers.KimiLinearConfig, dict(layer_types=["linear_attention", "full_attention"] * 2,
                                                        num_key_value_heads=4, linear_head_dim=8, linear_num_heads=4,
                                                        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                                        v_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=16)),
    "LFM2": (transformers.Lfm2Config, dict(layer_types=["conv", "full_attention"] * 2, conv_L_cache=3)),
    # multimodal wrappers: the fields go to the language model's text_config
    "Gemma-4": (transformers.Gemma4Config, dict(hidden_size_per_layer_input=4, vocab_size_per_layer_input=V,
                                                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                                sliding_window=WINDOW, global_head_dim=16, final_logit_softcapping=30.0)),
    "Muse-Glimmer": (transformers.MuseGlimmerConfig, dict(sliding_window=WINDOW)),
}
WRAPPERS = {"Gemma-4": {}, "Muse-Glimmer": dict(vision_config=dict(hidden_size=16, num_hidden_layers=1,
                                                                    num_attention_heads=2, intermediate_size=16))}
# targets whose layers return several residual streams (hyper-connections), each config naming their count its own
# way: refused, not among FAMILIES -> (config class, fields, streams)
HYPER_CONNECTED = {
    "DeepSeek-V4": (transformers.DeepseekV4Config, dict(hc_mult=4, n_routed_experts=4, num_experts_per_tok=2,
                                                        q_lora_rank=16, o_lora_rank=16, o_groups=2, index_n_heads=2,
                                                        index_head_dim=8, index_topk=4, qk_rope_head_dim=4), 4),
    "Qwen4-Exp": (transformers.Qwen4ExpTextConfig, dict(GATED_DELTANET, **QWEN_MOE, hc_count=2, hc_lowrank=4,
                                                        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                                                        indexer_budget=8, indexer_compress_ratio=2,
                                                        ngram_vocab_size_base=256, split_ngram_parts=2), 2)}
HYBRIDS = ["Qwen3.5", "Qwen3.5-MoE", "Qwen3-Next", "Granite-4", "Nemotron-H", "Kimi-Linear", "Falcon-H1", "LFM2"]


MOE = ("Qwen3-MoE", "gpt-oss", "Qwen3.5-MoE", "Qwen3-Next", "Granite-4", "Kimi-Linear",  # float32 expert products
       *HYPER_CONNECTED)


def family_config(family, **config):
    cls, fields = FAMILIES[family] if family in FAMILIES else HYPER_CONNECTED[family][:2]
    if family in WRAPPERS:
        text = {k: v for k, v in SHAPE.items() if k != "tie_word_embeddings"}
        return cls(text_config={**text, **fields, **config}, **WRAPPERS[family])
    return cls(**{**SHAPE, **fields, **config})


def family_target(family, seed=0, **config):
    """A random frozen float64 target of the family (float32 for MoE), its lm_head sharpened so that
    its logits span tens of units (soft-capping at 30 then matters, and greedy continuations are not
    all ties); a multiplier below 1 is undone, so that the logits still span tens of units after it."""
    config = family_config(family, **config)
    torch.manual_seed(seed)
    model = model_class(config).from_config(config)
    model = model.to(torch.float32 if family in MOE else torch.float64).eval().requires_grad_(False)
    tc = config.get_text_config() if family in HYPER_CONNECTED else text_config(config)  # text_config refuses them
    model.get_output_embeddings().weight.mul_(40.0 / (tc.hidden_size ** 0.5 if family.startswith("Gemma") else 1.0)
                                              / min(config_transforms(tc)["output_multiplier"], 1.0))
    for name, p in model.named_parameters():  # Mamba states that decay slowly: a wrong state after a rollback shows
        if name.endswith("A_log"):
            p.fill_(-4.0)
    return model


def family_drafter(target, seed=1, **overrides):
    torch.manual_seed(seed)
    shape = dict(mask_token_id=V - 1, num_layers=2, conv_group_size=8, selector_rank=4, block_size=4)
    c = drafter_config(target.config, **{**shape, **overrides})
    drafter = DFlash2Drafter(c, rope=rope_tables(c))
    with torch.no_grad():  # off the identity init, so that every part changes what is drafted
        for name, p in drafter.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if ("_conv." in name or name.startswith("candidate_selector.")) else None
    return drafter.to(target.dtype).eval()


# -----------------------------------------------------------------------------
# every RoPE a target brings


ROPES = {"default": (transformers.LlamaConfig, dict(rope_type="default", rope_theta=1e4), {}),
         "linear": (transformers.LlamaConfig, dict(rope_type="linear", rope_theta=1e4, factor=2.0), {}),
         "dynamic": (transformers.LlamaConfig, dict(rope_type="dynamic", rope_theta=1e4, factor=2.0), {}),
         "llama3": (transformers.LlamaConfig, LLAMA3, {}),
         "yarn": (transformers.LlamaConfig, dict(YARN, truncate=True), {}),
         "yarn, mscale": (transformers.LlamaConfig, dict(YARN, mscale=0.707, mscale_all_dim=1.0), {}),
         "yarn, attention_factor": (transformers.Qwen3Config, dict(YARN, attention_factor=1.3), {}),
         "longrope": (transformers.Phi3Config, LONGROPE, dict(original_max_position_embeddings=8))}


@pytest.mark.parametrize("kind", ROPES)
def test_rope_tables_equal_transformers_rotary_embedding_inside_and_beyond_the_original_context(kind):
    cls, rope, extra = ROPES[kind]
    config = cls(**{**SHAPE, "rope_parameters": dict(rope), **extra})
    c = drafter_config(config, mask_token_id=V - 1)
    theirs = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    for length in (6, 100):  # inside the original 8 positions, and far beyond (max_position_embeddings 128)
        positions = torch.arange(length)[None]
        cos, sin = theirs(torch.zeros(1, length, 8), positions)
        ours = dflash2.rope_cos_sin(positions, *rope_tables(c)(c, positions), torch.float32)
        assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin), (
            f"{kind} at {length} positions: cos / sin differ from transformers' by "
            f"{float((ours[0] - cos).abs().max()):.3g} / {float((ours[1] - sin).abs().max()):.3g}")


def test_dynamic_rope_past_its_context_is_refused_and_an_unknown_one_by_name():
    c = drafter_config(transformers.LlamaConfig(**{**SHAPE, "rope_parameters": dict(ROPES["dynamic"][1])}),
                       mask_token_id=V - 1)
    with pytest.raises(ValueError, match="dynamic RoPE at position 128, past max_position_embeddings"):
        rope_tables(c)(c, torch.arange(129)[None])
    with pytest.raises(ValueError, match="rope_type 'longrope' with partial_rotary_factor 0.5"):
        drafter_config(transformers.Phi3Config(**{**SHAPE, "partial_rotary_factor": 0.5,
                                                  "original_max_position_embeddings": 8, "rope_parameters": {
            **LONGROPE, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}}), mask_token_id=V - 1)


@pytest.mark.parametrize("family", HYPER_CONNECTED)
def test_a_hyper_connection_target_is_refused_by_name_at_the_startup_check_in_decoding_and_in_training(family,
                                                                                                    monkeypatch):
    """DeepSeek-V4's hc_mult and Qwen4-Exp's hc_count both mean several residual streams a layer; what their
    forwards return is wider than hidden_size either way. Their configs are refused before the weights load; a
    family whose config names the streams otherwise (here: no field known) is refused by each
    place that reads the forward, in one sentence naming it, before the drafter's first matmul would fail."""
    target = family_target(family)
    with pytest.raises(ValueError, match=f"the {target.config.model_type!r} target has hyper-connections"):
        drafter_config(target.config, mask_token_id=V - 1)
    monkeypatch.setattr(target_module, "HYPER_CONNECTION_FIELDS", ())
    c = drafter_config(target.config, mask_token_id=V - 1, num_layers=1, block_size=4)
    drafter = DFlash2Drafter(c, rope=rope_tables(c)).to(target.dtype)
    ids = torch.arange(3, 3 + PROMPT)[None]
    streams, model_type = HYPER_CONNECTED[family][2], target.config.model_type
    want = (f"the {model_type!r} target's layers return {streams * H} values a position, more than its hidden_size "
            f"{H}: hyper-connections, and the drafter reads one hidden state a layer")
    for where, run in (
            ("the startup check", lambda: check_target_view(c, target, ids)),
            ("decoding", lambda: dflash2.spec_generate(drafter, target, ids, NEW, view=decoding_view(c, target))),
            ("the training step", lambda: target_features(target, ids, torch.ones_like(ids), c.target_layer_ids))):
        try:
            run()
            got = "nothing raised"
        except ValueError as e:
            got = str(e)
        assert got == want, f"{family}, {where}: {got!r}, expected the refusal {want!r}"


@pytest.mark.parametrize("held", ["absent", None, 0])  # absent as its class has it; null or 0 in a config.json
def test_an_moe_config_without_intermediate_size_takes_its_routed_experts_width_or_is_refused_by_name(held):
    cls, fields = FAMILIES["Qwen3.5-MoE"]
    config = cls(**{k: v for k, v in SHAPE.items() if k != "intermediate_size"}, **fields,
                 **({} if held == "absent" else {"intermediate_size": held}))
    c = drafter_config(config, mask_token_id=V - 1)
    assert c.intermediate_size == 16 * 2, (f"intermediate_size {held}: moe_intermediate_size 16 × 2 experts a token "
                                           f"is 32, not {c.intermediate_size}")
    assert drafter_config(config, mask_token_id=V - 1, intermediate_size=40).intermediate_size == 40
    config.__dict__["num_experts_per_tok"] = None  # past the strict field check: a config with neither width
    with pytest.raises(ValueError, match="the target's 'qwen3_5_moe_text' config has no intermediate_size"):
        drafter_config(config, mask_token_id=V - 1)


def test_gemma4_drafter_takes_its_full_attention_layers_width_and_proportional_rope():
    """Gemma-4's layers differ in head_dim (global_head_dim on full attention); the drafter reads the
    full-attention layers' width as it reads their RoPE, whose table is transformers' own."""
    config = family_config("Gemma-4")
    c = drafter_config(config, mask_token_id=V - 1)
    assert (c.head_dim, c.rope_theta, c.rope_scaling) == (16, 1e6, dict(rope_type="proportional",
                                                                      partial_rotary_factor=0.25)), f"read as {c}"
    full = config.get_text_config().per_layer_config[3]
    theirs = transformers.ROPE_INIT_FUNCTIONS["proportional"](config.get_text_config(), layer_type="full_attention")[0]
    ours = rope_tables(c)(c, torch.arange(100)[None])[0]
    assert full.head_dim == 16 and torch.equal(ours, theirs), f"inverse frequencies {ours} != transformers' {theirs}"
    assert int((ours == 0).sum()) == 16 // 2 - int(0.25 * 16 // 2), "proportional RoPE leaves the rest of a head unrotated"


def rotary_tables(config, length, *layer_type):
    """transformers' own cos / sin at positions 0..length−1, from a fresh rotary embedding of the
    config's model (the dynamic and longrope ones keep state between calls)."""
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    return rotary(torch.zeros(1, length, config.head_dim), torch.arange(length)[None], *layer_type)


def our_tables(c, length):
    positions = torch.arange(length)[None]
    return dflash2.rope_cos_sin(positions, *rope_tables(c)(c, positions), torch.float32)


def max_diff(ours, theirs):
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))


def test_a_gemma3_drafter_rotates_with_its_full_attention_layers_theta_and_exports_it(tmp_path):
    """Gemma-3's sliding layers rotate with θ = 1e4, its full-attention layers with 1e6: the drafter
    takes the full layers' RoPE (§1), declares it in its export and loads it back."""
    target = family_target("Gemma-3")
    thetas = {kind: p["rope_theta"] for kind, p in target.config.rope_parameters.items()}
    assert thetas == {"sliding_attention": 1e4, "full_attention": 1e6}, f"Gemma-3's θ are {thetas}: no test here"
    drafter = family_drafter(target)
    full, sliding = (rotary_tables(target.config, 100, kind) for kind in ("full_attention", "sliding_attention"))
    assert max_diff(full, sliding) > 0.1, "the two layer types rotate alike: this test could not fail"
    diff = max_diff(our_tables(drafter.config, 100), full)
    assert diff == 0, (f"the drafter's tables differ from the full-attention layers' by {diff:.3g} "
                       f"(rope_theta {drafter.config.rope_theta})")
    checkpoint.save_export(drafter, tmp_path / "ckpt", dtype=torch.float32)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    exported = (config["rope_theta"], config["rope_parameters"])
    assert exported == (1e6, {"rope_type": "default", "rope_theta": 1e6}), f"the export declares θ as {exported}"
    loaded = checkpoint.load_export(tmp_path / "ckpt", dtype=torch.float64).config
    diff = max_diff(our_tables(loaded, 100), full)
    assert diff == 0, f"the loaded drafter (θ {loaded.rope_theta}) differs from the full layers' tables by {diff:.3g}"


YARN_LEFT_OUT = {  # keys left to transformers' defaults (None: left out) -> the same keys set against them
    "Qwen3: all left out": (dict(beta_fast=None, beta_slow=None, truncate=None), dict(truncate=False)),
    "DeepSeek: no truncate": (dict(truncate=None, mscale=1.0, mscale_all_dim=1.0), dict(truncate=False)),
    "no beta_fast": (dict(beta_fast=None), dict(beta_fast=16.0))}


@pytest.mark.parametrize("case", YARN_LEFT_OUT)
def test_yarn_without_truncate_or_beta_fast_takes_transformers_defaults(case):
    """transformers' yarn truncates and takes β_fast = 32 where the config leaves them out. L₀ = 256 and
    θ = 1e4 put both β's dimensions inside the head, so that either default changes the tables."""
    left_out, against = YARN_LEFT_OUT[case]
    yarn = {**YARN, "rope_theta": 1e4, "original_max_position_embeddings": 256, **left_out}
    rope = {k: v for k, v in yarn.items() if v is not None}
    config = transformers.Qwen3Config(**{**SHAPE, "max_position_embeddings": 1024, "rope_parameters": rope})
    theirs = rotary_tables(config, 100)
    diff = max_diff(our_tables(drafter_config(config, mask_token_id=V - 1), 100), theirs)
    assert diff == 0, f"{case}: cos / sin differ from transformers' by {diff:.3g}"
    config.rope_parameters = {**rope, **against}
    assert max_diff(rotary_tables(config, 100), theirs) > 0.1, f"{case}: {against} changes nothing: no test here"


def small_drafter_config(target_config):
    return drafter_config(target_config, mask_token_id=V - 1, num_layers=1, block_size=4, conv_group_size=8,
                          selector_rank=4)


def test_longrope_takes_its_short_factors_through_the_original_context_and_the_long_ones_past_it():
    """transformers takes the long factors once the sequence is longer than L₀ (its last position >= L₀).
    The drafter's forward takes them from its own positions: on either side of the boundary it computes
    what the same drafter computes with both factor lists set to the short, or to the long, ones."""
    L0 = 8
    config = transformers.Phi3Config(**{**SHAPE, "rope_parameters": dict(LONGROPE),
                                        "original_max_position_embeddings": L0})
    c = small_drafter_config(config)
    for length, factors in ((L0, "short_factor"), (L0 + 1, "long_factor")):
        diff = max_diff(our_tables(c, length), rotary_tables(config, length))
        assert diff == 0, f"{length} positions: cos / sin differ from transformers' by {diff:.3g}"
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=length)
        assert torch.equal(rope_tables(c)(c, torch.arange(length)[None])[0], inv_freq), (
            f"{length} positions: the inverse frequencies are not transformers' of the {factors}")
    torch.manual_seed(0)
    drafter = DFlash2Drafter(c, rope=rope_tables(c)).double().eval()
    pinned = {}
    for kind in ("short", "long"):
        factors = LONGROPE[f"{kind}_factor"]
        p = dataclasses.replace(c, rope_scaling={**c.rope_scaling, "short_factor": factors, "long_factor": factors})
        pinned[kind] = DFlash2Drafter(p, rope=rope_tables(p)).double().eval()  # its own tables, of its own factors
        pinned[kind].load_state_dict(drafter.state_dict())
    g = torch.Generator().manual_seed(1)
    embeds, ctx = torch.randn(1, 4, H, generator=g), torch.randn(1, L0, len(c.target_layer_ids) * H, generator=g)
    with torch.no_grad():
        for anchor, kind in ((L0 - 4, "short"), (L0 - 3, "long")):  # the block's last position: L₀ − 1, then L₀
            args = (embeds.double(), torch.arange(anchor, anchor + 4)[None], ctx[:, :anchor].double(),
                    torch.arange(anchor)[None])
            apart = float((pinned["short"](*args) - pinned["long"](*args)).abs().max())
            assert apart > 1e-3, f"the two factor lists draft alike ({apart:.3g} apart): no test here"
            diff = float((drafter(*args) - pinned[kind](*args)).abs().max())
            assert diff == 0, f"last position {anchor + 3}: the forward differs from the {kind} factors' by {diff:.3g}"


def test_dynamic_rope_serves_the_last_position_of_its_context():
    """Dynamic RoPE is plain RoPE while the sequence fits max_position_embeddings = 128: positions
    0..127 are served as transformers computes them, and a block reaching position 128 is refused."""
    config = transformers.LlamaConfig(**{**SHAPE, "rope_parameters": dict(ROPES["dynamic"][1])})
    c = small_drafter_config(config)
    diff = max_diff(our_tables(c, 128), rotary_tables(config, 128))
    assert diff == 0, f"positions 0..127: cos / sin differ from transformers' by {diff:.3g}"
    torch.manual_seed(0)
    drafter = DFlash2Drafter(c, rope=rope_tables(c)).eval()
    embeds, ctx = torch.randn(1, 4, H), torch.randn(1, 125, len(c.target_layer_ids) * H)
    with torch.no_grad():
        drafter(embeds, torch.arange(124, 128)[None], ctx[:, :124], torch.arange(124)[None])  # the block ends at 127
        with pytest.raises(ValueError, match="dynamic RoPE at position 128, past max_position_embeddings"):
            drafter(embeds, torch.arange(125, 129)[None], ctx, torch.arange(125)[None])


# -----------------------------------------------------------------------------
# the target's embedding and logit transforms


PLAIN_VIEW = dict(input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None)
VIEWS = {  # the transforms each family's forward applies to its tables, as the family tests' configs set them
    "Gemma-2": dict(input_embedding_scale=H ** 0.5, output_multiplier=1.0, final_logit_softcapping=30.0),
    "Gemma-3": dict(input_embedding_scale=H ** 0.5, output_multiplier=1.0, final_logit_softcapping=None),
    "Gemma-4": dict(input_embedding_scale=H ** 0.5, output_multiplier=1.0, final_logit_softcapping=30.0),
    "Granite": dict(input_embedding_scale=12.0, output_multiplier=1 / 8.0, final_logit_softcapping=None),
    "Granite-4": dict(input_embedding_scale=12.0, output_multiplier=1 / 8.0, final_logit_softcapping=None),
    "Falcon-H1": dict(input_embedding_scale=2.0, output_multiplier=0.039, final_logit_softcapping=None),
    # Muse-Glimmer's class defaults; its embedding module also RMS-normalises the rows, which the engines
    # do not (target.NORMALISED_EMBEDDINGS)
    "Muse-Glimmer": dict(input_embedding_scale=1.0, output_multiplier=0.19611613513818404, final_logit_softcapping=20.0),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafter_reads_the_target_as_its_own_forward_does(family):
    target = family_target(family)
    c = drafter_config(target.config, mask_token_id=V - 1)
    want = VIEWS.get(family, PLAIN_VIEW)
    got = {k: getattr(c, k) for k in want}
    assert got == pytest.approx(want), f"{family}: the transforms read from its config are {got}, not {want}"
    ids = torch.randint(0, V - 1, (1, 10), generator=torch.Generator().manual_seed(0))
    check_target_view(c, target, ids)  # the family's own forward agrees
    for field, plain in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if got[field] != plain:  # the same target with one transform forgotten is refused, by family
            with pytest.raises(ValueError, match=f"the '{target.config.model_type}' target's"):
                check_target_view(dataclasses.replace(c, **{field: plain}), target, ids)


def test_a_transform_nobody_declares_is_refused_at_the_startup_check():
    target = family_target("Qwen3")
    c = drafter_config(target.config, mask_token_id=V - 1)
    ids = torch.randint(0, V - 1, (1, 10), generator=torch.Generator().manual_seed(0))
    forward = target.forward

    def scaled_logits(*args, **kwargs):  # a family that multiplies its logits by 1.5 and tells nobody
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out
    target.forward = scaled_logits
    with pytest.raises(ValueError, match=r"the 'qwen3' target's logits differ .*relative difference 0.33"):
        check_target_view(c, target, ids)


def test_the_block_embeddings_are_the_raw_rows_times_the_scale():
    """Engines multiply the raw table by input_embedding_scale; Gemma's embedding module rounds √H to
    the table's dtype first. The drafter computes what the engines compute."""
    target = family_target("Gemma-3").to(torch.bfloat16)
    c = drafter_config(target.config, mask_token_id=V - 1)
    ids = torch.arange(V)[None]
    ours = dflash2.embed_rows(c, target.get_input_embeddings().weight, ids)
    engines = torch.nn.functional.embedding(ids, target.get_input_embeddings().weight) * float(H ** 0.5)
    assert torch.equal(ours, engines), "the drafter's block embeddings are not the raw rows times input_embedding_scale"
    view = dflash2.target_view(c, target)  # what the loss and decoding embed the blocks with
    assert torch.equal(view.embed(ids), engines), "the target view's embeddings are not the raw rows times the scale"
    assert not torch.equal(ours, target.get_input_embeddings()(ids)), "bf16 √H rounding: this test could not fail"


def test_logits_with_a_multiplier_and_soft_capping_are_the_cap_of_the_multiplied_logits():
    """The published z-lab DFlash2 config has both: logits = c·tanh(m·y / c), the multiplier first; the
    formula, the training view and the decoding view (lm_head_rows: a vocabulary of 1100 is two 512-row
    pieces and a part) all compute it."""
    config = transformers.Qwen3Config(**{**SHAPE, "vocab_size": 1100})
    c = drafter_config(config, mask_token_id=V - 1, **PUBLISHED_VIEW)
    m, cap = PUBLISHED_VIEW["output_multiplier"], PUBLISHED_VIEW["final_logit_softcapping"]
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(config).eval().requires_grad_(False)
    lm_head = target.get_output_embeddings()
    lm_head.weight.normal_()
    x = 10 * torch.randn(3, 5, H)  # raw logits y of a few hundred: m·y / c reaches ±3, where tanh bends
    y = x.double() @ lm_head.weight.double().T
    want = cap * torch.tanh(m * y / cap)
    assert float((want - m * cap * torch.tanh(y / cap)).abs().max()) > 1, "the order changes nothing: no test here"
    for what, logits in (("transformed_logits", dflash2.transformed_logits(c, lm_head(x))),
                         ("target_view", dflash2.target_view(c, target).logits(x)),
                         ("decoding_view", decoding_view(c, target).logits(x))):
        diff = float((logits.double() - want).abs().max())
        assert logits.dtype == torch.float32 and diff < 1e-4, (
            f"{what}: {logits.dtype} logits off c·tanh(m·y / c) by {diff:.3g}")


def family_head(target):
    """The family's logits of final hidden states, in float64, written from its config as its forward
    computes them (Gemma-2: soft-capped, Granite: ÷ logits_scaling)."""
    tc, w = target.config, target.get_output_embeddings().weight.double()
    cap, scaling = getattr(tc, "final_logit_softcapping", None), getattr(tc, "logits_scaling", 1.0)

    def head(h):
        y = h.double() @ w.T / scaling
        return cap * torch.tanh(y / cap) if cap else y
    return head


BITING = {"Gemma-2": dict(final_logit_softcapping=3.0), "Granite": {}}  # Gemma-2: a cap at the logits' size


@pytest.mark.parametrize("family", BITING)
def test_the_training_loss_reads_the_targets_transformed_logits_on_both_sides(family):
    """L_unary = Σ w_k·KL(softmax(r) ‖ softmax(z)) / Σ w_k over the slots, r the target's own forward
    logits at t − 1 and z the family's logits of the drafter's output (family_head, checked against
    that forward)."""
    target = family_target(family, **BITING[family])
    drafter = family_drafter(target, selector_top_k=0)
    c, B, gamma = drafter.config, 4, 2.0
    ids = torch.randint(0, V - 1, (1, 16), generator=torch.Generator().manual_seed(8))
    ones, anchors = torch.ones_like(ids), torch.tensor([[2, 7, 12]])  # every slot t = a + k < 16 counts
    context, last = target_features(target, ids, ones, c.target_layer_ids)
    cfg = dflash2.LossConfig(gamma=gamma)
    batch = dflash2.Batch(ids, ones, ones, context, last, anchors, torch.ones_like(anchors, dtype=torch.bool))
    _, stats, _ = dflash2.dflash2_loss(drafter, dflash2.target_view(c, target), batch, cfg)
    head, lm_head = family_head(target), target.get_output_embeddings().weight.double()
    with torch.no_grad():
        r = target(ids).logits[0].double()
        off = float((head(last[0]) - r).abs().max())
        assert off < 1e-9, f"{family}: family_head differs from the target's forward logits by {off:.3g}"
        block, pos = dflash2.block_layout(ids, anchors, B, c.mask_token_id)
        h = drafter(dflash2.embed_rows(c, target.get_input_embeddings().weight, block), pos, context,
                    torch.arange(16)[None], dflash2.block_attention_mask(anchors, ones, B))
    t = anchors[0, :, None] + torch.arange(1, B)                     # (N, B−1): slot k predicts t = a + k
    slots, w = h.view(len(t), B, H)[:, 1:], torch.exp(-torch.arange(B - 1, dtype=torch.float64) / gamma)

    def unary_loss(drafted, reference):  # logits (N, B−1, V)
        kl = (reference.softmax(-1) * (reference.log_softmax(-1) - drafted.log_softmax(-1))).sum(-1)
        return float((w * kl).sum() / (len(kl) * w.sum()))
    want = unary_loss(head(slots), r[t - 1])
    for side, untransformed in (("drafter", unary_loss(slots.double() @ lm_head.T, r[t - 1])),
                                ("target", unary_loss(head(slots), last[0, t - 1].double() @ lm_head.T))):
        moved = abs(untransformed - want)
        assert moved > 1e-3 * want, f"{family}: the {side}'s logits untransformed move the loss by {moved:.3g}: no test"
    got = float(stats["unary_loss"])
    assert abs(got - want) < 1e-9 * want, f"{family}: L_unary {got:.9g} != {want:.9g} ({abs(got - want):.3g} apart)"


@pytest.mark.parametrize("family", ["Gemma-2", "Granite", "Llama-3.x", "gpt-oss", "Falcon-H1", "Muse-Glimmer", "Gemma-4"])
def test_an_export_declares_the_targets_rope_and_transforms_and_loads_back(tmp_path, family):
    target = family_target(family)
    drafter = family_drafter(target)
    checkpoint.save_export(drafter, tmp_path / "ckpt", dtype=torch.float32)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    c = drafter.config
    declared = {k: config["dflash_config"].get(k, plain) for k, plain in checkpoint.VIEW_FIELDS.items()}
    assert declared == {k: getattr(c, k) for k in checkpoint.VIEW_FIELDS}, f"{family}: the export declares {declared}"
    rope = target.config.get_text_config().rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma-4's per-layer-type sets: the full-attention one
    kept = {k: v for k, v in rope.items() if k != "partial_rotary_factor" or rope["rope_type"] == "proportional"}
    assert config["rope_parameters"] == kept, (
        f"{family}: the export's rope_parameters {config['rope_parameters']} are not the target's {rope}")
    loaded = checkpoint.load_export(tmp_path / "ckpt", dtype=torch.float64)
    assert loaded.config == c, f"{family}: the loaded config differs from the exported one"


def test_the_speculators_format_refuses_transforms_it_cannot_declare(tmp_path):
    drafter = family_drafter(family_target("Gemma-2"))
    with pytest.raises(ValueError, match="the speculators format has no field for input_embedding_scale, "
                                         "final_logit_softcapping"):
        checkpoint.save_export(drafter, tmp_path / "ckpt", export_format="speculators",
                               verifier={"name_or_path": "t", "architectures": []})
    assert not (tmp_path / "ckpt").exists(), "a refused export left a folder"


# -----------------------------------------------------------------------------
# the family table: lossless greedy decoding (sliding-window caches included) and a few training steps


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_decodes_losslessly_and_trains(family):
    target = family_target(family)
    drafter = family_drafter(target)
    prompt = torch.randint(0, V - 1, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    plain, _ = dflash2.target_generate(target, prompt, NEW)
    spec, stats = dflash2.spec_generate(drafter, target, prompt, NEW)
    assert torch.equal(spec, plain), f"{family}: greedy spec_generate {spec.tolist()} != target {plain.tolist()}"
    assert len(stats.acceptance_lengths) > 1, f"{family}: one cycle: rollback was never exercised"

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V - 1, (2, 24), generator=g)
    attention, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    check_target_view(drafter.config, target, ids[:1])
    context, last = target_features(target, ids, attention, drafter.config.target_layer_ids)
    view = dflash2.target_view(drafter.config, target)
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):  # one batch, four steps: the loss must fall
        anchors, valid = dflash2.sample_anchors(loss_mask, 4, generator=torch.Generator().manual_seed(3))
        batch = dflash2.Batch(ids, attention, loss_mask, context, last, anchors, valid)
        loss, _, _ = dflash2.dflash2_loss(drafter, view, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], f"{family}: losses {losses}"


def assert_verifications_equal_fresh_forwards(family, target, calls, reference, stats):
    """Each verification's logits (calls: the target's, prefill first) against a fresh forward over the committed
    tokens and that verification's input."""
    committed = PROMPT + np.cumsum([0] + stats.acceptance_lengths)
    tolerance = 5e-5  # transformers' reference recurrent kernels compute in float32; a misaligned state: 3e-4 to 0.1
    with torch.no_grad():
        for i, ((ids,), _, out) in enumerate(calls[1:]):
            fresh = target(torch.cat([torch.tensor([reference[:committed[i]]]), ids], 1)).logits[0, committed[i]:]
            error = float((out.logits[0] - fresh).abs().max())
            assert error < tolerance, f"{family}, cycle {i}: the rolled-back cache's logits differ from a fresh " \
                                      f"forward by {error:.3g}"


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_hybrid_target_rolls_back_exactly_through_partly_wrong_drafts(monkeypatch, family):
    """Drafts right for 2, 0, 3 (all), 1, ... slots of B − 1 = 3: every rollback size of the recurrent
    states (linear attention, Mamba, short convolutions) and the attention layers. The output must equal
    the target's greedy continuation computed without a cache, and each verification's logits a fresh
    forward over the committed tokens and that verification's input."""
    target = family_target(family)
    drafter = family_drafter(target)
    prompt = torch.randint(3, V - 1, (PROMPT,), generator=torch.Generator().manual_seed(8)).tolist()
    reference = prompt + argmax_loop(target, prompt, NEW + drafter.config.block_size)[0]
    force_drafts(monkeypatch, drafter, reference, [2, 0, 3, 1])
    calls = record_forward(monkeypatch, target)
    spec, stats = dflash2.spec_generate(drafter, target, torch.tensor([prompt]), NEW)
    monkeypatch.undo()
    assert spec.tolist() == reference[PROMPT:PROMPT + NEW], (
        f"{family}: spec_generate {spec.tolist()} != the uncached greedy loop {reference[PROMPT:PROMPT + NEW]}")
    assert stats.acceptance_lengths[:4] == [3, 1, 4, 2], f"{family}: acceptance lengths {stats.acceptance_lengths}"
    assert_verifications_equal_fresh_forwards(family, target, calls, reference, stats)


@pytest.mark.parametrize("family", ["Qwen3.5", "Mistral"])  # linear attention; a sliding window
def test_long_lookup_drafts_roll_back_exactly_on_a_hybrid_or_sliding_target(monkeypatch, family):
    """Lookup drafts of 2B = 8 tokens right for 5, then (after a drafter cycle right for 2 of B − 1 = 3) for 0 and
    8 (all) in a row: the target rolls back 3 and 8 tokens of one verification, past B − 1, and the sliding layers
    read verifications longer than their window W = 6. Greedy output and each verification's logits as in the
    test above."""
    target = family_target(family)
    drafter = family_drafter(target)
    prompt = torch.randint(3, V - 1, (PROMPT,), generator=torch.Generator().manual_seed(8)).tolist()
    reference = prompt + argmax_loop(target, prompt, NEW + 8)[0]
    force_drafts(monkeypatch, drafter, reference, [2])
    lookup = ForcedLookup(reference, [5, None, 0, 8], 8, V)
    calls = record_forward(monkeypatch, target)
    spec, stats = dflash2.spec_generate(drafter, target, torch.tensor([prompt]), NEW, lookup=lookup)
    monkeypatch.undo()
    assert spec.tolist() == reference[PROMPT:PROMPT + NEW], (
        f"{family}: spec_generate {spec.tolist()} != the uncached greedy loop {reference[PROMPT:PROMPT + NEW]}")
    cycles = list(zip(stats.acceptance_lengths, stats.sources))
    assert cycles == [(6, "lookup"), (3, "drafter"), (1, "lookup"), (9, "lookup")], (
        f"{family}: (acceptance length, source) per cycle {cycles}")
    assert_verifications_equal_fresh_forwards(family, target, calls, reference, stats)


def test_a_hybrid_target_is_sampled_by_its_law():
    """Qwen3.5 (Gated DeltaNet and attention) at V = 8: the first 3 tokens of spec_generate, drafted and
    rolled back through its recurrent states, against the target's exact joint (chi-square)."""
    target = family_target("Qwen3.5", vocab_size=8, seed=2)
    drafter = family_drafter(target, mask_token_id=7, selector_top_k=4, conv_kernel_size=0)
    with torch.no_grad():  # flatter unary logits: drafts are often accepted, and every branch is seen
        drafter.norm.weight.mul_(0.3)
    prompt, runs = (1, 2, 3), 200
    g, counts, first_cycle = torch.Generator().manual_seed(0), np.zeros((8, 8, 8)), []
    for _ in range(runs):
        out, stats = dflash2.spec_generate(drafter, target, torch.tensor([prompt]), 4, 1.0, generator=g)
        counts[tuple(out[:3].tolist())] += 1
        first_cycle.append(stats.acceptance_lengths[0])
    seen = np.bincount(first_cycle, minlength=4)[1:]
    assert seen.all(), f"first-cycle acceptance lengths 1/2/3 seen {seen.tolist()} times: a rollback size is never exercised"
    pvalue = chi_square_pvalue(counts, exact_joint3(target, prompt, 1.0, 1.0, 0).numpy(), "Qwen3.5")
    assert pvalue > 1e-6, f"the first 3 tokens depart from the hybrid target's exact joint: p = {pvalue:.3g}"


@pytest.mark.parametrize("family", ["Gemma-3", "Mistral", "Qwen3.5", "LFM2", "Falcon-H1"])
def test_batched_regeneration_on_a_sliding_window_or_hybrid_target_equals_the_plain_greedy_loop(family):
    target = family_target(family)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, V - 1, (n,), generator=g).tolist() for n in (PROMPT, 5)]  # left-padded together
    answers = regenerate.generate(target, prompts, {1}, NEW, pad_id=0)
    for prompt, answer in zip(prompts, answers):
        plain, _ = argmax_loop(target, prompt, NEW, {1})
        assert list(answer) == plain, f"{family}: regenerated {list(answer)} != the greedy loop's {plain}"


# -----------------------------------------------------------------------------
# sliding-window draft layers


def brute_force_mask(anchors, attention_mask, block_size, window):
    """The sliding layer's training mask, one (query, key) pair at a time: a query of block j at
    slot i (position a_j + i) sees context key s iff s < a_j, s is real and a_j + i − s < W, and
    slot i' of its own block iff |i − i'| < W."""
    b, N = anchors.shape
    S = attention_mask.shape[1]
    mask = torch.zeros(b, 1, N * block_size, S + N * block_size, dtype=torch.bool)
    for r in range(b):
        for j in range(N):
            a = int(anchors[r, j])
            for i in range(block_size):
                for s in range(S):
                    mask[r, 0, j * block_size + i, s] = s < a and bool(attention_mask[r, s]) and a + i - s < window
                for i2 in range(block_size):
                    mask[r, 0, j * block_size + i, S + j * block_size + i2] = abs(i - i2) < window
    return mask


@pytest.mark.parametrize("window", [1, 3, 6])
def test_the_sliding_training_mask_equals_brute_force(window):
    B, anchors = 4, torch.tensor([[0, 5, 9], [2, 11, 3]])
    attention = torch.ones(2, 14, dtype=torch.long)
    attention[1, 12:] = 0
    attention[0, 4] = 0  # a hole
    pos = dflash2.block_layout(torch.zeros(2, 14, dtype=torch.long), anchors, B, 0)[1]
    keys = torch.cat([torch.arange(14).expand(2, -1), pos], 1)
    ours = dflash2.window_mask(pos, keys, window, dflash2.block_attention_mask(anchors, attention, B))
    assert torch.equal(ours, brute_force_mask(anchors, attention, B, window)), f"W = {window}: masks differ"


def sliding_drafter(target, window=5):
    return family_drafter(target, num_layers=3, block_size=4, sliding_window=window,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def test_sliding_training_forward_equals_the_cached_decoding_forward_past_the_window():
    """Each block of the packed, masked training layout equals the same block drafted from its
    context 0..a−1 fed to the draft cache in pieces, as decoding feeds it, with a context far longer
    than W: the sliding layers' cache trimming and decode-time window agree with the training mask."""
    target = family_target("Qwen3")
    drafter = sliding_drafter(target)
    c, B, S = drafter.config, 4, 30
    ids = torch.randint(0, V - 1, (1, S), generator=torch.Generator().manual_seed(4))
    states = target.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    ctx = dflash2.context_features(states, c.target_layer_ids)
    anchors = torch.tensor([[3, 13, 22, 26]])
    block, pos = dflash2.block_layout(ids, anchors, B, c.mask_token_id)
    W_in = target.get_input_embeddings().weight
    with torch.no_grad():
        packed = drafter(dflash2.embed_rows(c, W_in, block), pos, ctx, torch.arange(S)[None],
                         dflash2.block_attention_mask(anchors, torch.ones_like(ids), B))
        for j, a in enumerate(anchors[0].tolist()):
            cache, fed = DraftCache(c.num_layers), 0
            while fed < a:  # the context in pieces of 3 (the last one carries the block)
                new = min(3, a - fed)
                if fed + new < a:
                    drafter(dflash2.embed_rows(c, W_in, block[:, :B]), torch.arange(fed + new, fed + new + B)[None],
                            ctx[:, fed:fed + new], torch.arange(fed, fed + new)[None], cache=cache)
                else:
                    alone = drafter(dflash2.embed_rows(c, W_in, block[:, j * B:(j + 1) * B]),
                                    torch.arange(a, a + B)[None], ctx[:, fed:a], torch.arange(fed, a)[None],
                                    cache=cache)
                fed += new
            held = [cache.kv[i][0].shape[2] for i in range(c.num_layers)]
            assert held == [min(a, c.sliding_window - 1), a, min(a, c.sliding_window - 1)], (
                f"anchor {a}: the draft cache holds {held} context positions per layer")
            diff = float((packed[0, j * B:(j + 1) * B] - alone[0]).abs().max())
            assert diff < 1e-10, f"anchor {a}: the packed training block differs from the decoding one by {diff:.3g}"
    full = family_drafter(target, num_layers=3, block_size=4)
    full.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        unwindowed = full(dflash2.embed_rows(c, W_in, block), pos, ctx, torch.arange(S)[None],
                          dflash2.block_attention_mask(anchors, torch.ones_like(ids), B))
    assert float((unwindowed - packed)[0, B:].abs().max()) > 1e-3, "the window changed nothing: W is not applied"


@pytest.mark.parametrize("window, seed", [(3, 5), (1, 9)])
def test_a_sliding_drafter_decodes_losslessly_on_a_sliding_target(window, seed):
    """W = 1 too: a sliding layer's query then sees its own position only, and its draft cache holds no
    context at all (W − 1 = 0 positions)."""
    target = family_target("Gemma-3")
    drafter = sliding_drafter(target, window=window)
    prompt = torch.randint(0, V - 1, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    plain, _ = dflash2.target_generate(target, prompt, NEW)
    spec, stats = dflash2.spec_generate(drafter, target, prompt, NEW)
    assert torch.equal(spec, plain), f"W = {window}: greedy spec_generate {spec.tolist()} != target {plain.tolist()}"
    assert len(stats.acceptance_lengths) > 1, f"W = {window}: one cycle, the draft cache was never reused"


def test_a_window_of_one_draft_cache_holds_no_context():
    target = family_target("Gemma-3")
    drafter = sliding_drafter(target, window=1)
    prompt = torch.randint(0, V - 1, (1, PROMPT), generator=torch.Generator().manual_seed(9))
    cache = DraftCache(drafter.config.num_layers)
    with torch.no_grad():  # one draft pass reading the prompt's features, as decoding's first does
        states = target(prompt, output_hidden_states=True).hidden_states
        dflash2.draft_forward(drafter, dflash2.target_view(drafter.config, target), prompt[0, -1:],
                              dflash2.context_features(states, drafter.config.target_layer_ids), cache)
    held = [cache.kv[i][0].shape[2] for i in range(drafter.config.num_layers)]
    assert held == [0, PROMPT, 0], f"the draft cache holds {held} context positions per layer, not [0, {PROMPT}, 0]"


# -----------------------------------------------------------------------------
# the published drafters' configs


PUBLISHED = dict(  # the fields of a published DFlash2 drafter's config.json (a 52-layer target's), z-lab's fixture
    layer_types=["sliding_attention"] * 5, sliding_window=2048, use_sliding_window=True, max_window_layers=5,
    is_causal=False, num_hidden_layers=5, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
PUBLISHED_VIEW = dict(final_logit_softcapping=20.0, output_multiplier=0.19611613513818404)


def test_a_published_zlab_dflash2_config_loads_decodes_and_exports_the_same_fields(tmp_path):
    """The published config's fields at a tiny width: five sliding layers (W = 2048 here, and W = 3 so
    that the window bites), is_causal false, soft-capping and an output multiplier in dflash_config."""
    target = family_target("Qwen3")
    drafter = family_drafter(target, num_layers=5)
    path = tmp_path / "published"
    checkpoint.save_export(drafter, path, dtype=torch.float32)
    prompt = torch.randint(0, V - 1, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    plain, _ = dflash2.target_generate(target, prompt, NEW)
    for window in (2048, 3):
        config = {**checkpoint.checkpoint_config(drafter.config), **PUBLISHED, "sliding_window": window}
        config["dflash_config"].update(PUBLISHED_VIEW)
        (path / "config.json").write_text(json.dumps(config))
        loaded = checkpoint.load_export(path, dtype=torch.float64)
        c = loaded.config
        assert (c.layer_types, c.sliding_window, c.final_logit_softcapping, c.output_multiplier) == (
            PUBLISHED["layer_types"], window, *PUBLISHED_VIEW.values()), f"read as {c}"
        spec, _ = dflash2.spec_generate(loaded, target, prompt, NEW)
        assert torch.equal(spec, plain), f"W = {window}: the published config's drafter does not decode losslessly"
        checkpoint.save_export(loaded, tmp_path / "again", dtype=torch.float32)
        again = json.loads((tmp_path / "again" / "config.json").read_text())
        for key in ("layer_types", "sliding_window", "use_sliding_window", "is_causal", "rope_parameters"):
            assert again[key] == config[key], f"re-exported {key} = {again[key]!r}, not {config[key]!r}"
        assert {k: again["dflash_config"][k] for k in PUBLISHED_VIEW} == PUBLISHED_VIEW, (
            f"re-exported {again['dflash_config']}")


def test_a_speculators_config_with_sliding_layers_round_trips(tmp_path):
    target = family_target("Qwen3")
    drafter = sliding_drafter(target)
    verifier = {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}
    checkpoint.save_export(drafter, tmp_path / "spec", dtype=torch.float32, export_format="speculators",
                           verifier=verifier)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"], config["sliding_window_non_causal"]) == (
        drafter.config.layer_types, 5, True), f"speculators config: {layer}"
    loaded = checkpoint.load_export(tmp_path / "spec", dtype=torch.float64, num_target_layers=LAYERS)
    assert loaded.config == drafter.config, "the speculators export did not load back to the same config"
