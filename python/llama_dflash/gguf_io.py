"""Reading and writing DFlash drafter GGUF files in upstream llama.cpp's layout.

Architecture ``dflash``; keys and tensor names as in llama.cpp's
``src/models/dflash.cpp`` (see docs: llama-cpp-python-notes §2).  The
drafter carries the target's vocabulary (tokenizer.* keys) and the mask token
id; ``dflash.target_layers`` stores HF layer ids + 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

ARCH = "dflash"

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
# 1-D tensors (norms) always stay f32.
_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "enc.output_norm", "output_norm")

_OUTTYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}


@dataclass
class DrafterConfig:
    """Hyper-parameters of a DFlash (v1) drafter, HF conventions for layer ids."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    causal: bool = False
    sliding_window: int = 0
    swa_layers: list[bool] = field(default_factory=list)
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float = 0.0
    context_length: int = 32768


def _field_value(f):
    return f.contents()


def copy_tokenizer(src: GGUFReader, writer: GGUFWriter) -> None:
    """Copy every tokenizer.* key of a target GGUF (the drafter shares its vocabulary)."""
    for name, f in src.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.ggml.mask_token_id":
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, _field_value(f), vtype, sub_type=sub)


def _tensor_type(name: str, outtype: str) -> GGMLQuantizationType:
    base = name.removesuffix(".weight")
    if any(base == n or base.endswith("." + n) for n in _NORMS):
        return GGMLQuantizationType.F32
    return _OUTTYPES[outtype]


def write_drafter(
    path: str | os.PathLike,
    cfg: DrafterConfig,
    tensors: dict[str, np.ndarray],
    target_gguf: str | os.PathLike,
    outtype: str = "f32",
) -> None:
    """Write a drafter GGUF.  tensors: GGUF names -> arrays in PyTorch [out, in] order."""
    if outtype not in _OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(_OUTTYPES)}, got {outtype!r}")
    src = GGUFReader(os.fspath(target_gguf))
    w = GGUFWriter(os.fspath(path), ARCH)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    if cfg.causal:
        w.add_bool(f"{ARCH}.attention.causal", True)
    if cfg.sliding_window > 0:
        w.add_uint32(f"{ARCH}.attention.sliding_window", cfg.sliding_window)
        pattern = cfg.swa_layers or [True] * cfg.n_layer
        w.add_array(f"{ARCH}.attention.sliding_window_pattern", [bool(x) for x in pattern])
    if cfg.embedding_scale != 1.0:
        w.add_float32(f"{ARCH}.embedding_scale", cfg.embedding_scale)
    if cfg.logit_scale != 1.0:
        w.add_float32(f"{ARCH}.logit_scale", cfg.logit_scale)
    if cfg.softcap > 0:
        w.add_float32(f"{ARCH}.final_logit_softcapping", cfg.softcap)
    copy_tokenizer(src, w)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype=np.float32)
        qt = _tensor_type(name, outtype) if a.ndim > 1 else GGMLQuantizationType.F32
        if qt == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qt == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_tensors(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of a GGUF as float32 arrays in PyTorch [out, in] order (dequantized)."""
    r = GGUFReader(os.fspath(path))
    out = {}
    for t in r.tensors:
        if names is not None and t.name not in names:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return out


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    r = GGUFReader(os.fspath(path))

    def get(key, default=None):
        f = r.fields.get(key)
        return f.contents() if f is not None else default

    n_embd = int(get(f"{ARCH}.embedding_length"))
    n_head = int(get(f"{ARCH}.attention.head_count"))
    n_layer = int(get(f"{ARCH}.block_count"))
    return DrafterConfig(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=int(get(f"{ARCH}.attention.head_count_kv", n_head)),
        head_dim=int(get(f"{ARCH}.attention.key_length", n_embd // n_head)),
        n_ff=int(get(f"{ARCH}.feed_forward_length")),
        target_layer_ids=[int(i) - 1 for i in get(f"{ARCH}.target_layers")],
        block_size=int(get(f"{ARCH}.block_size", 16)),
        mask_token_id=int(get("tokenizer.ggml.mask_token_id")),
        rope_theta=float(get(f"{ARCH}.rope.freq_base", 10000.0)),
        rms_eps=float(get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)),
        causal=bool(get(f"{ARCH}.attention.causal", False)),
        sliding_window=int(get(f"{ARCH}.attention.sliding_window", 0)),
        swa_layers=[bool(x) for x in get(f"{ARCH}.attention.sliding_window_pattern", [])],
        embedding_scale=float(get(f"{ARCH}.embedding_scale", 1.0)),
        logit_scale=float(get(f"{ARCH}.logit_scale", 1.0)),
        softcap=float(get(f"{ARCH}.final_logit_softcapping", 0.0)),
        context_length=int(get(f"{ARCH}.context_length", 32768)),
    )


def random_drafter_tensors(cfg: DrafterConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random-weight drafter tensors (GGUF names, [out, in] order), norms near 1."""
    rng = np.random.default_rng(seed)
    E, qd, kvd = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim

    def mat(o, i):
        return (rng.standard_normal((o, i)) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "fc.weight": mat(E, E * len(cfg.target_layer_ids)),
        "enc.output_norm.weight": norm(E),
        "output_norm.weight": norm(E),
    }
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        t.update({
            p + "attn_norm.weight": norm(E), p + "attn_q.weight": mat(qd, E), p + "attn_k.weight": mat(kvd, E),
            p + "attn_v.weight": mat(kvd, E), p + "attn_output.weight": mat(E, qd),
            p + "attn_q_norm.weight": norm(cfg.head_dim), p + "attn_k_norm.weight": norm(cfg.head_dim),
            p + "ffn_norm.weight": norm(E), p + "ffn_gate.weight": mat(cfg.n_ff, E),
            p + "ffn_up.weight": mat(cfg.n_ff, E), p + "ffn_down.weight": mat(E, cfg.n_ff),
        })
    return t
