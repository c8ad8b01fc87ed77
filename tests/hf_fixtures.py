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


def hf_tensors(cfg: dict, seed: int = 0, encoder_names: bool = False, prefix: str = "",
               draft_vocab: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dc = cfg.get("dflash_config", {})
    taps = dc.get("target_layer_ids", cfg.get("target_layer_ids")) or [1, 3]

    def mat(o, i, s=0.15):
        return (rng.standard_normal((o, i)) * s).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        ("encoder.fc.weight" if encoder_names else "fc.weight"): mat(H, H * len(taps)),
        ("encoder.output_norm_enc.weight" if encoder_names else "hidden_norm.weight"): norm(H),
        "norm.weight": norm(H),
    }
    for i in range(L):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(H), p + "self_attn.q_proj.weight": mat(NQ * D, H),
                  p + "self_attn.k_proj.weight": mat(NKV * D, H), p + "self_attn.v_proj.weight": mat(NKV * D, H),
                  p + "self_attn.o_proj.weight": mat(H, NQ * D), p + "self_attn.q_norm.weight": norm(D),
                  p + "self_attn.k_norm.weight": norm(D), p + "post_attention_layernorm.weight": norm(H),
                  p + "mlp.gate_proj.weight": mat(FF, H), p + "mlp.up_proj.weight": mat(FF, H),
                  p + "mlp.down_proj.weight": mat(H, FF)})
        if cfg["architectures"][0] == "DFlash2DraftModel":
            g = H // GROUP
            for mod in ("attention_conv", "mlp_conv"):
                base = np.zeros((2, K_CONV, H), np.float32)
                base[:, 0, :] = 1.0
                base += 0.1 * rng.standard_normal(base.shape).astype(np.float32)
                t[p + f"{mod}.base_kernel"] = base
                t[p + f"{mod}.kernel_projection.weight"] = mat(2 * K_CONV * g, H, 0.05)
    if cfg["architectures"][0] == "DFlash2DraftModel":
        t["candidate_selector.predecessor_codebook"] = mat(cfg["vocab_size"], RANK, 0.5)
        t["candidate_selector.successor_codebook"] = mat(cfg["vocab_size"], RANK, 0.5)
        t["candidate_selector.hidden_projection.weight"] = mat(RANK, H, 0.1)
    if draft_vocab:
        ids = draft_ids(cfg["vocab_size"], draft_vocab, seed)
        t["lm_head.weight"] = mat(draft_vocab, H, 0.5)
        t["d2t"] = ids - np.arange(draft_vocab)
        t2d = np.zeros(cfg["vocab_size"], np.bool_)
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
