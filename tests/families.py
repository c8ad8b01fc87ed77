"""Tiny random-weight GGUF targets of the families tests/models.py does not write.

* ``llama3``: a Llama-3.1 target: ``rope_freqs.weight`` holding the llama3 RoPE frequency factors
  as llama.cpp's converter computes them (conversion/llama.py, generate_extra_tensors: factor 8,
  low 1, high 4, original context 8192) and no rope scaling keys (the converter writes none for
  llama3: "Handled in generate_extra_tensors"), θ 5e5.
* ``gpt-oss``: attention sinks, alternating sliding-window / full layers (llama.cpp's default
  pattern 2: even layers slide), q/k/v/o biases, head_dim × heads ≠ hidden size, YaRN (factor 32,
  original context 4096), a biased router and experts with biases, the experts in MXFP4 as the
  published GGUFs hold them (llama.cpp accepts any type there; the converter warns and keeps other
  types).
* ``gemma3``: a small sliding window (32 by default; llama.cpp's pattern 6: five sliding layers,
  one full), q/k norms, post-attention and post-FFN norms, the embedding scaled by √hidden.

Every family's matrices are Q8_0 (the output head too, untied) unless asked otherwise: f32
products are not batch-invariant in ggml, so an f32 target can never pass exact mode's self-check,
and the families would only ever be tested in the default mode.  The vocabulary, tokenizer keys
and matrix writer are tests/models.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from llama_dflash.formats import convert_hf_to_gguf
from llama_dflash.formats.config import DrafterConfig

from hf_fixtures import PUBLISHED, make_published
from models import LAYER_SCALE, MASK_ID, VOCAB, TargetSpec, add_matrix, add_tiny_vocab, write_target


@dataclass
class FamilySpec:
    """A tiny target of one of the families below (the sizes scaled down, the rest as published)."""

    family: str                  # llama3 | gpt-oss | gemma3
    n_embd: int = 64
    n_layer: int = 6
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    n_expert: int = 4            # gpt-oss (published: 32 experts, 4 used)
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_swa: int = 32              # gpt-oss (published 128), gemma3 (published 512)
    matrix_type: str = "q8_0"    # attention, dense FFN, output head: f32 | q8_0 | q4_0
    expert_type: str = "mxfp4"   # gpt-oss experts: mxfp4 | q8_0 | f32
    router_type: str = "f32"     # gpt-oss router (converted models keep it f32)
    seed: int = 0
    ctx: int = 4096
    eos_id: int = 2
    layer_scale: float = LAYER_SCALE
    extra: dict = field(default_factory=dict)


def _header(w: GGUFWriter, arch: str, s: FamilySpec, n_ff: int) -> None:
    w.add_name(f"tiny-{s.family}")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5 if arch != "gemma3" else 1e-6)
    add_tiny_vocab(w, arch, s.eos_id)


def llama3_rope_factors(head_dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        orig_ctx: int = 8192) -> np.ndarray:
    """The llama3 RoPE frequency factors, computed as llama.cpp's converter computes them."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_family(path: str, s: FamilySpec) -> str:
    """A random-weight target of family s.family whose greedy continuations vary."""
    arch = {"llama3": "llama", "gpt-oss": "gpt-oss", "gemma3": "gemma3"}[s.family]
    rng = np.random.default_rng(s.seed)
    E, hd = s.n_embd, s.head_dim
    w = GGUFWriter(path, arch)
    _header(w, arch, s, s.n_ff_exp if arch == "gpt-oss" else s.n_ff)
    if arch == "llama":
        w.add_rope_freq_base(500000.0)
    elif arch == "gpt-oss":
        w.add_rope_freq_base(150000.0)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_sliding_window(s.n_swa)
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    else:
        w.add_rope_freq_base(1000000.0)
        w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
        w.add_sliding_window(s.n_swa)

    def mat(o: int, i: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((o, i)) * scale).astype(np.float32)

    def vec(n: int, scale: float = 0.02) -> np.ndarray:
        return (scale * rng.standard_normal(n)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)

    def put(name: str, m: np.ndarray, qtype: str | None = None) -> None:
        add_matrix(w, name, m, qtype or s.matrix_type)

    w.add_tensor("token_embd.weight", mat(VOCAB, E, 1.0 if arch != "gemma3" else 1.0 / math.sqrt(E)))
    w.add_tensor("output_norm.weight", norm(E))
    put("output.weight", mat(VOCAB, E, 0.5))
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, 500000.0))
    sc = s.layer_scale / math.sqrt(E)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(E))
        put(p + "attn_q.weight", mat(s.n_head * hd, E, sc))
        put(p + "attn_k.weight", mat(s.n_head_kv * hd, E, sc))
        put(p + "attn_v.weight", mat(s.n_head_kv * hd, E, sc))
        put(p + "attn_output.weight", mat(E, s.n_head * hd, s.layer_scale / math.sqrt(s.n_head * hd)))
        if arch == "gpt-oss":
            for n, k in (("q", s.n_head), ("k", s.n_head_kv), ("v", s.n_head_kv)):
                w.add_tensor(p + f"attn_{n}.bias", vec(k * hd))
            w.add_tensor(p + "attn_output.bias", vec(E))
            # sinks of either sign: some heads keep attention mass in the sink, some do not
            w.add_tensor(p + "attn_sinks.weight", vec(s.n_head, 1.0))
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
            _experts(w, p, s, rng, sc)
            continue
        if arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
            w.add_tensor(p + "post_ffw_norm.weight", norm(E))
        w.add_tensor(p + "ffn_norm.weight", norm(E))
        put(p + "ffn_gate.weight", mat(s.n_ff, E, sc))
        put(p + "ffn_up.weight", mat(s.n_ff, E, sc))
        put(p + "ffn_down.weight", mat(E, s.n_ff, s.layer_scale / math.sqrt(s.n_ff)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _experts(w: GGUFWriter, p: str, s: FamilySpec, rng: np.random.Generator, sc: float) -> None:
    """gpt-oss's router and experts, each with its bias (numpy shapes [n_expert, rows, values])."""
    E, F, X = s.n_embd, s.n_ff_exp, s.n_expert
    add_matrix(w, p + "ffn_gate_inp.weight", (rng.standard_normal((X, E)) * 4.0 / math.sqrt(E)).astype(np.float32),
               s.router_type)
    w.add_tensor(p + "ffn_gate_inp.bias", (0.1 * rng.standard_normal(X)).astype(np.float32))
    for name, rows, cols, scale in (("gate", F, E, sc), ("up", F, E, sc), ("down", E, F, s.layer_scale / math.sqrt(F))):
        m = (rng.standard_normal((X, rows, cols)) * scale).astype(np.float32)
        if s.expert_type == "mxfp4":
            w.add_tensor(p + f"ffn_{name}_exps.weight", quantize(m, GGMLQuantizationType.MXFP4),
                         raw_dtype=GGMLQuantizationType.MXFP4)
        else:
            add_matrix(w, p + f"ffn_{name}_exps.weight", m, s.expert_type)
        w.add_tensor(p + f"ffn_{name}_exps.bias", (0.02 * rng.standard_normal((X, rows))).astype(np.float32))


# -- the families the tests run: a target writer and its drafter's config ------------------------

def _qwen3(seed: int) -> TargetSpec:
    return TargetSpec(arch="qwen3", tied=False, output_type="q8_0", matrix_type="q8_0", seed=seed)


def _qwen3moe(seed: int) -> TargetSpec:
    return TargetSpec(arch="qwen3moe", tied=False, output_type="q8_0", matrix_type="q8_0", expert_type="q8_0",
                      seed=seed)


FAMILIES: dict[str, Callable[[int], TargetSpec | FamilySpec]] = {
    "llama3": lambda seed: FamilySpec("llama3", seed=seed),
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gpt-oss": lambda seed: FamilySpec("gpt-oss", head_dim=32, seed=seed),
    "gemma3": lambda seed: FamilySpec("gemma3", seed=seed),
    # hybrid (gated delta net + gated attention, tests/models.py): rolls back through recurrent snapshots
    "qwen35": lambda seed: TargetSpec(arch="qwen35", n_layer=10, matrix_type="q8_0", tied=False, output_type="q8_0",
                                      seed=seed),
}


def write_any(path: str, spec: TargetSpec | FamilySpec) -> str:
    return write_target(path, spec) if isinstance(spec, TargetSpec) else write_family(path, spec)


def family_drafter_config(spec: TargetSpec | FamilySpec, **kw) -> DrafterConfig:
    """A DFlash v1 drafter shaped for the target: its hidden size, taps inside its layers, block 8."""
    n_layer = spec.n_layer
    base = dict(n_embd=spec.n_embd, n_layer=1, n_head=4, n_head_kv=2, head_dim=16, n_ff=96,
                target_layers=[0, n_layer // 2, n_layer - 2], block_size=8, mask_token_id=MASK_ID,
                rope_theta=10000.0, rms_eps=1e-6)
    base.update(kw)
    return DrafterConfig(**base)


# each family's drafter in the schema of its published checkpoint (tests/hf_fixtures.PUBLISHED: the
# config as published, sizes scaled down), converted by `llama-dflash convert`; gemma3 has no published
# DFlash drafter -- gemma-4's are Qwen3 bodies with [S x4, F] layers, Qwen3.6-27B's layout; qwen35 takes
# the Qwen3.5 June revisions' [S x5, F] with 8 taps
SCHEMAS = {"llama3": "llama31_llama3_rope", "qwen3": "qwen3_v1_b16", "qwen3moe": "qwen3_v1_b16",
           "gpt-oss": "gptoss_20b", "gemma3": "qwen36_27b_flat", "qwen35": "qwen35_june"}


def published_drafter(root: Path, schema: str, target: str, n_layer: int, seed: int) -> str:
    """A published-schema checkpoint with its taps spread over this target's layers, converted."""
    cfg, _ = PUBLISHED[schema]
    dc = dict(cfg.get("dflash_config") or {})
    n_taps = len(dc.get("target_layer_ids") or cfg["target_layer_ids"])
    usable = n_layer - 1  # (layers 0 .. n_layer - 2: the last layer's output is pruned)
    assert n_taps <= usable, (schema, n_taps, n_layer)
    taps = sorted({round(i * (usable - 1) / (n_taps - 1)) for i in range(n_taps)})
    hf, _, _ = make_published(root, schema, seed, dflash_config={**dc, "target_layer_ids": taps},
                              num_target_layers=n_layer)
    out = root / f"{schema}-{seed}.gguf"
    convert_hf_to_gguf(hf, target, out, outtype="f16")
    return str(out)
