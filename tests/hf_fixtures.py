"""Synthetic HF drafter checkpoints in every published schema variant (docs/architecture.md §4.2-4.3),
small shapes but the real names, layouts and config fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llama_dflash.formats.safetensors import write_safetensors

H, L, NQ, NKV, D, FF = 64, 2, 4, 2, 16, 96
K_CONV, GROUP, RANK, TOPK = 2, 16, 8, 4


def base_config(**kw) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": D, "intermediate_size": FF,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 1024, "num_target_layers": 6,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "dtype": "bfloat16",
    }
    cfg.update(kw)
    return cfg


# name -> (config, options).  Each is a schema seen in published checkpoints.
VARIANTS = {
    # z-lab/Qwen3-*-DFlash-b16 style: block_size and rope_theta at the top level
    "v1_toplevel": (base_config(block_size=16, rope_theta=10000.0,
                                dflash_config={"mask_token_id": 16, "target_layer_ids": [0, 2, 4]}), {}),
    # June-2026 revisions: block_size nested, rope_parameters, SWA layer types, explicit is_causal
    "v1_nested_swa": (base_config(dflash_config={"block_size": 8, "mask_token_id": 16, "target_layer_ids": [1, 3]},
                                  rope_parameters={"rope_theta": 5000.0, "rope_type": "default"},
                                  layer_types=["sliding_attention", "full_attention"], sliding_window=9,
                                  use_sliding_window=True, is_causal=False), {}),
    # Muse-Glimmer v1 adapter: encoder.* fusion names, mask / taps at the top level, "model." prefix
    "v1_encoder_names": (base_config(block_size=16, mask_token_id=16, target_layer_ids=[0, 1, 2, 3],
                                     rope_theta=10000.0), {"encoder_names": True, "prefix": "model."}),
    # no target_layer_ids: the default formula over num_target_layers (6 -> [1, 3] for 2 layers)
    "v1_default_taps": (base_config(block_size=16, dflash_config={"mask_token_id": 16}), {}),
    # logit transforms, embedding scale, dflash_config.causal, use_swa + swa_window_size
    "v1_transforms": (base_config(dflash_config={"block_size": 16, "mask_token_id": 16, "target_layer_ids": [0, 4],
                                                 "output_multiplier": 0.5, "final_logit_softcapping": 4.0,
                                                 "input_embedding_scale": 1.5, "causal": True, "use_swa": True,
                                                 "swa_window_size": 12}), {}),
    # YaRN rope scaling (Qwen3.6-style drafters), in rope_parameters
    "v1_yarn": (base_config(dflash_config={"block_size": 16, "mask_token_id": 16, "target_layer_ids": [0, 2]},
                            rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64}), {}),
    # sharded bf16 with an index file
    "v1_sharded_bf16": (base_config(block_size=16, dflash_config={"mask_token_id": 16, "target_layer_ids": [0, 2]}),
                        {"shards": 3, "dtype": "BF16"}),
    # DFlash2 (Muse-Glimmer fixture layout): convs + selector, codebooks without ".weight", f16
    "v2": (base_config(architectures=["DFlash2DraftModel"], is_causal=False,
                       dflash_config={"block_size": 8, "mask_token_id": 16, "target_layer_ids": [0, 2, 4],
                                      "conv_kernel_size": K_CONV, "conv_group_size": GROUP, "selector_rank": RANK,
                                      "selector_top_k": TOPK}), {"dtype": "F16"}),
    # reduced draft vocabulary (speculators / EAGLE-3 export style): own lm_head, d2t offsets, t2d mask
    "v1_reduced_vocab": (base_config(block_size=16, draft_vocab_size=300,
                                     dflash_config={"mask_token_id": 16, "target_layer_ids": [0, 2]}),
                         {"draft_vocab": 300}),
    "v2_reduced_vocab": (base_config(architectures=["DFlash2DraftModel"], draft_vocab_size=300,
                                     dflash_config={"block_size": 8, "mask_token_id": 16, "target_layer_ids": [0, 2],
                                                    "conv_kernel_size": K_CONV, "conv_group_size": GROUP,
                                                    "selector_rank": RANK, "selector_top_k": TOPK}),
                         {"draft_vocab": 300, "prefix": "model."}),
}


def draft_ids(n_vocab: int, n_draft: int, seed: int = 0) -> np.ndarray:
    """The target ids a reduced-vocabulary fixture keeps (ascending, as exports store them)."""
    return np.sort(np.random.default_rng(seed + 99).choice(n_vocab, n_draft, replace=False)).astype(np.int64)


def _dims(cfg: dict) -> dict:
    """The sizes a checkpoint's tensors take from its config (any schema; speculators' nested too)."""
    tl = cfg.get("transformer_layer_config") or cfg
    dc = cfg.get("dflash_config") or {}

    def get(k, default):
        return dc.get(k, cfg.get(k, default))
    taps = get("target_layer_ids", None) or cfg.get("aux_hidden_state_layer_ids") or [1, 3]
    return {"H": tl.get("hidden_size", H), "L": tl.get("num_hidden_layers", L),
            "NQ": tl.get("num_attention_heads", NQ), "NKV": tl.get("num_key_value_heads", NKV),
            "D": tl.get("head_dim", D), "FF": tl.get("intermediate_size", FF),
            "n_taps": len(taps), "v2": cfg["architectures"][0] == "DFlash2DraftModel",
            "bias": bool(tl.get("attention_bias")), "vocab": cfg.get("vocab_size") or tl.get("vocab_size") or 1024,
            "K": get("conv_kernel_size", K_CONV), "G": get("conv_group_size", GROUP), "R": get("selector_rank", RANK)}


def hf_tensors(cfg: dict, seed: int = 0, encoder_names: bool = False, prefix: str = "",
               draft_vocab: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    z = _dims(cfg)
    h, nq, nkv, d, ff = z["H"], z["NQ"], z["NKV"], z["D"], z["FF"]

    def mat(o, i, s=0.15):
        return (rng.standard_normal((o, i)) * s).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def vec(n, s=0.3):
        return (rng.standard_normal(n) * s).astype(np.float32)

    t = {
        ("encoder.fc.weight" if encoder_names else "fc.weight"): mat(h, h * z["n_taps"]),
        ("encoder.output_norm_enc.weight" if encoder_names else "hidden_norm.weight"): norm(h),
        "norm.weight": norm(h),
    }
    for i in range(z["L"]):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(h), p + "self_attn.q_proj.weight": mat(nq * d, h),
                  p + "self_attn.k_proj.weight": mat(nkv * d, h), p + "self_attn.v_proj.weight": mat(nkv * d, h),
                  p + "self_attn.o_proj.weight": mat(h, nq * d), p + "self_attn.q_norm.weight": norm(d),
                  p + "self_attn.k_norm.weight": norm(d), p + "post_attention_layernorm.weight": norm(h),
                  p + "mlp.gate_proj.weight": mat(ff, h), p + "mlp.up_proj.weight": mat(ff, h),
                  p + "mlp.down_proj.weight": mat(h, ff)})
        if z["v2"]:
            k, g = z["K"], h // z["G"]
            for mod in ("attention_conv", "mlp_conv"):
                base = np.zeros((2, k, h), np.float32)
                base[:, 0, :] = 1.0
                base += 0.1 * rng.standard_normal(base.shape).astype(np.float32)
                t[p + f"{mod}.base_kernel"] = base
                t[p + f"{mod}.kernel_projection.weight"] = mat(2 * k * g, h, 0.05)
        if z["bias"]:  # gpt-oss drafters: nn.Linear(..., bias=attention_bias), o_proj included
            t.update({p + "self_attn.q_proj.bias": vec(nq * d), p + "self_attn.k_proj.bias": vec(nkv * d),
                      p + "self_attn.v_proj.bias": vec(nkv * d), p + "self_attn.o_proj.bias": vec(h)})
    if z["v2"]:
        t["candidate_selector.predecessor_codebook"] = mat(z["vocab"], z["R"], 0.5)
        t["candidate_selector.successor_codebook"] = mat(z["vocab"], z["R"], 0.5)
        t["candidate_selector.hidden_projection.weight"] = mat(z["R"], h, 0.1)
    if draft_vocab:
        ids = draft_ids(z["vocab"], draft_vocab, seed)
        t["lm_head.weight"] = mat(draft_vocab, h, 0.5)
        t["d2t"] = ids - np.arange(draft_vocab)
        t2d = np.zeros(z["vocab"], np.bool_)
        t2d[ids] = True
        t["t2d"] = t2d
    return {prefix + k: v for k, v in t.items()}


def write_checkpoint(d: Path, cfg: dict, tensors: dict[str, np.ndarray], shards: int = 1,
                     dtype: str = "F32") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    names = list(tensors)
    if shards == 1:
        write_safetensors(d / "model.safetensors", tensors, dtype)
        return d
    weight_map = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(d / fn, part, dtype)
        weight_map.update({n: fn for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def make_variant(root: Path, name: str, seed: int = 0) -> tuple[Path, dict, dict[str, np.ndarray]]:
    cfg, opt = VARIANTS[name]
    t = hf_tensors(cfg, seed, encoder_names=opt.get("encoder_names", False), prefix=opt.get("prefix", ""),
                   draft_vocab=opt.get("draft_vocab", 0))
    d = write_checkpoint(root / name, cfg, t, shards=opt.get("shards", 1), dtype=opt.get("dtype", "F32"))
    return d, cfg, t


# ---------------------------------------------------------------------------------------------
# The published catalogue (../shared/docs/published-drafters.md): each config as published, its
# sizes scaled down (hidden 64, FF 96, heads / 8 or so, head_dim 128 -> 16, vocabulary 1024, windows
# 9, taps onto a 10-layer target, mask id 16, selector rank 32, top-k 4); every other field as
# published.  For PUBLISHED_TARGET_LAYERS-layer targets.
PUBLISHED_TARGET_LAYERS = 10
_TAPS5, _TAPS8 = [1, 3, 5, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]
_S, _F = "sliding_attention", "full_attention"


def _common(**kw) -> dict:
    c = {"hidden_size": H, "intermediate_size": FF, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": D, "vocab_size": 1024, "num_target_layers": PUBLISHED_TARGET_LAYERS}
    c.update(kw)
    return c


PUBLISHED: dict[str, tuple[dict, dict]] = {
    # z-lab/Qwen3-4B-DFlash-b16 (§2.4)
    "qwen3_v1_b16": (_common(
        architectures=["DFlashDraftModel"], attention_bias=False, attention_dropout=0.0,
        auto_map={"AutoModel": "dflash.DFlashDraftModel"}, block_size=16, bos_token_id=151643,
        dflash_config={"mask_token_id": 16, "target_layer_ids": _TAPS5}, dtype="bfloat16", eos_token_id=151645,
        hidden_act="silu", initializer_range=0.02, layer_types=[_F] * 5, max_position_embeddings=40960,
        max_window_layers=5, model_type="qwen3", num_hidden_layers=5, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, transformers_version="4.57.3",
        use_cache=True, use_sliding_window=False), {}),
    # z-lab/Qwen3.5-*-DFlash June-2026 revisions (§3): nested block, rope_parameters, [S x5, F], no is_causal
    "qwen35_june": (_common(
        architectures=["DFlashDraftModel"], attention_bias=False, attention_dropout=0.0, dtype="bfloat16",
        dflash_config={"block_size": 16, "mask_token_id": 16, "target_layer_ids": _TAPS8}, hidden_act="silu",
        layer_types=[_S] * 5 + [_F], max_position_embeddings=262144, model_type="qwen3", num_hidden_layers=6,
        num_key_value_heads=1, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000000.0, "rope_type": "default"},
        sliding_window=9, tie_word_embeddings=False, use_sliding_window=True), {}),
    # z-lab/Qwen3.6-27B-DFlash (§3): flat rope_theta and block_size, [S x4, F], no is_causal
    "qwen36_27b_flat": (_common(
        architectures=["DFlashDraftModel"], attention_bias=False, block_size=16,
        dflash_config={"mask_token_id": 16, "target_layer_ids": _TAPS5}, hidden_act="silu",
        layer_types=[_S] * 4 + [_F], max_position_embeddings=262144, model_type="qwen3", num_hidden_layers=5,
        rms_norm_eps=1e-6, rope_theta=10000000, sliding_window=9, use_sliding_window=True,
        tie_word_embeddings=False), {}),
    # z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (§3, Llama-3.1's llama3 RoPE scaling)
    "llama31_llama3_rope": (_common(
        architectures=["DFlashDraftModel"], attention_bias=False, block_size=10,
        dflash_config={"mask_token_id": 16, "target_layer_ids": _TAPS5}, hidden_act="silu",
        layer_types=[_F] * 5, max_position_embeddings=131072, model_type="qwen3", num_hidden_layers=5,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, use_sliding_window=False), {}),
    # z-lab/gpt-oss-20b-DFlash (§3): q/k/v/o biases, head_dim 64, 64/8 heads, YaRN x32 truncate false
    "gptoss_20b": (_common(
        architectures=["DFlashDraftModel"], attention_bias=True, attention_dropout=0.0,
        auto_map={"AutoModel": "dflash.DFlashDraftModel"}, block_size=8, bos_token_id=199998, eos_token_id=200002,
        dflash_config={"mask_token_id": 16, "target_layer_ids": _TAPS5}, head_dim=64, hidden_act="silu",
        initial_context_length=4096, layer_types=[_F] * 8, max_position_embeddings=131072, model_type="qwen3",
        num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=8, rms_norm_eps=1e-5, rope_theta=150000,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                      "rope_type": "yarn", "truncate": False}, dtype="bfloat16"), {}),
    # XiaomiMiMo/MiMo-V2.5-Pro-FP4-DFlash (§2.6), as published: refused (attention_sink_bias)
    "mimo": (_common(
        architectures=["DFlashDraftModel"], model_type="qwen3", auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=1, v_head_dim=D, partial_rotary_factor=0.5,
        block_size=8, dflash_config={"target_layer_ids": [0, 2, 4, 6, 8], "mask_token_id": 16, "num_anchors": 4096,
                                     "block_size": 8, "loss_decay_gamma": 7.0, "use_swa": True,
                                     "swa_window_size": 9, "backbone_rotary_base": 5000000,
                                     "attention_value_scale": 0.612, "attention_sink_bias": True},
        max_position_embeddings=262144, rope_theta=10000, sliding_window=9, rms_norm_eps=1e-5,
        torch_dtype="bfloat16", hidden_act="silu", attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False, use_cache=True), {}),
    # z-lab/Muse-Glimmer-30B-DFlash2 (§2.1)
    "muse_dflash2": (_common(
        architectures=["DFlash2DraftModel"], attention_bias=False, attention_dropout=0.0, bos_token_id=200000,
        is_causal=False, dflash_config={"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                                        "final_logit_softcapping": 20.0, "mask_token_id": 16,
                                        "output_multiplier": 0.19611613513818404, "selector_rank": 32,
                                        "selector_top_k": 4, "target_layer_ids": _TAPS5},
        dtype="bfloat16", eos_token_id=200001, hidden_act="silu", initializer_range=0.02, layer_types=[_S] * 5,
        max_position_embeddings=131072, max_window_layers=5, model_type="qwen3", num_hidden_layers=5,
        pad_token_id=200018, rms_norm_eps=1e-05, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        sliding_window=9, tie_word_embeddings=False, transformers_version="5.15.0", use_cache=False,
        use_sliding_window=True), {"dtype": "BF16"}),
    # Muse-Glimmer v1 assistant (§2.2): top-level block / mask / taps, encoder.* names, no vocab_size
    "muse_v1_assistant": ({k: v for k, v in _common(
        architectures=["MuseGlimmerAssistantModel"], attention_dropout=0, block_size=16, bos_token_id=200000,
        dtype="bfloat16", eos_token_id=200001, hidden_act="silu", layer_types=[_S] * 5, mask_token_id=16,
        max_position_embeddings=131072, model_type="muse_glimmer_assistant", num_hidden_layers=5,
        pad_token_id=200018, rms_norm_eps=1e-05, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        sliding_window=9, target_layer_ids=_TAPS5, transformers_version="5.15.0.dev0").items()
        if k not in ("vocab_size", "num_target_layers")}, {"encoder_names": True, "dtype": "BF16"}),
    # z-lab/Qwen3.8-27B-DFlash2 (§2.3)
    "qwen38_dflash2": (_common(
        architectures=["DFlash2DraftModel"], attention_bias=False, attention_dropout=0.0, bos_token_id=None,
        is_causal=False, dflash_config={"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2,
                                        "mask_token_id": 16, "selector_rank": 32, "selector_top_k": 4,
                                        "target_layer_ids": _TAPS5},
        dtype="bfloat16", eos_token_id=248044, hidden_act="silu", initializer_range=0.02, layer_types=[_S] * 5,
        max_position_embeddings=262144, max_window_layers=5, model_type="qwen3", num_hidden_layers=5,
        pad_token_id=248044, rms_norm_eps=1e-06, rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
        sliding_window=9, tie_word_embeddings=False, transformers_version="5.15.0", use_cache=True,
        use_sliding_window=True), {"dtype": "BF16"}),
    # vllm-project/speculators DFlash2 save (§2.8, verl-SpeCo's Qwen3-4B shape)
    "speculators_dflash2": ({
        "architectures": ["DFlash2DraftModel"], "aux_hidden_state_layer_ids": [2, 4, 6, 8, 9], "block_size": 8,
        "conv_group_size": 16, "conv_kernel_size": 2, "draft_vocab_size": 1024, "mask_token_id": 16,
        "selector_rank": 32, "selector_top_k": 4, "speculators_config": {"algorithm": "dflash2"},
        "speculators_model_type": "dflash2", "sliding_window_non_causal": True,
        "transformer_layer_config": {
            "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": D, "intermediate_size": FF, "layer_types": [_S] * 2,
            "sliding_window": 9, "use_sliding_window": True, "vocab_size": 1024, "attention_bias": False,
            "mlp_bias": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}}, {}),
}


def with_changes(cfg: dict, **changes) -> dict:
    """A deep copy of a config with top-level fields replaced (None: removed)."""
    cfg = json.loads(json.dumps(cfg))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def make_published(root: Path, name: str, seed: int = 0, **cfg_changes) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """A checkpoint in a published schema (cfg_changes: top-level fields replaced; None removes)."""
    cfg, opt = PUBLISHED[name]
    cfg = with_changes(cfg, **cfg_changes)
    t = hf_tensors(cfg, seed, encoder_names=opt.get("encoder_names", False), prefix=opt.get("prefix", ""))
    d = write_checkpoint(root / name, cfg, t, dtype=opt.get("dtype", "F32"))
    return d, cfg, t
