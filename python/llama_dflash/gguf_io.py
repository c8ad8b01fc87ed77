"""Reading and writing DFlash drafter GGUF files in upstream llama.cpp's layout.

Architecture ``dflash``; keys and tensor names as in llama.cpp's
``src/models/dflash.cpp`` (see docs: llama-cpp-python-notes §2).  The
drafter carries the target's vocabulary (tokenizer.* keys) and the mask token
id; ``dflash.target_layers`` stores HF layer ids + 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

ARCH = "dflash"

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
# Kept in f32 whatever the output type: norms, DFlash2 conv bases and selector codebooks.
_KEEP_F32 = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "enc.output_norm", "output_norm",
             "attn_conv_base", "ffn_conv_base", "selector_predecessor", "selector_successor")

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
    # DFlash2 (0 = absent)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # drafts for M-RoPE targets carry degenerate sections [head_dim/2, 0, 0, 0]
    rope_sections: list[int] = field(default_factory=list)
    # RoPE scaling ("" = none): linear or YaRN, keys as llama.cpp's converter writes them
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_orig_ctx: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 1.0
    n_vocab: int = 0  # only needed by the PyTorch reference of the DFlash2 selector

    def is_swa(self, il: int) -> bool:
        """Does layer il use the sliding window (every layer when no pattern is given)?"""
        return self.sliding_window > 0 and (not self.swa_layers or bool(self.swa_layers[il]))

    @property
    def is_v2(self) -> bool:
        return self.selector_top_k > 0


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


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> GGMLQuantizationType:
    """GGML type of a tensor for an output type: float for the kept tensors and 1-D ones,
    f16 where a quantized type's block does not divide the row."""
    base = name.removesuffix(".weight")
    if len(shape) < 2 or any(base == n or base.endswith("." + n) for n in _KEEP_F32):
        return GGMLQuantizationType.F32
    qt = _OUTTYPES[outtype]
    block = GGML_QUANT_SIZES[qt][0]
    if shape[-1] % block != 0:
        return GGMLQuantizationType.F16
    return qt


def _encode(arr: np.ndarray, qt: GGMLQuantizationType) -> np.ndarray:
    a = np.ascontiguousarray(arr, dtype=np.float32)
    if qt == GGMLQuantizationType.F32:
        return a
    if qt == GGMLQuantizationType.F16:
        return a.astype(np.float16)
    return quantize(a, qt)


@dataclass
class TensorSource:
    """A tensor to write: GGUF name, PyTorch-order shape, and a loader returning float32 data.

    load_rows(r0, r1), when given, returns rows [r0, r1) of the first dimension: the tensor is
    then converted chunk by chunk and only its encoded form is held whole.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    load_rows: Callable[[int, int], np.ndarray] | None = None
    raw_type: GGMLQuantizationType | None = None  # load() returns data already in this type (e.g. I64 ids)


_CHUNK_BYTES = 32 << 20


def _encode_source(t: TensorSource, qt: GGMLQuantizationType) -> np.ndarray:
    if t.raw_type is not None:
        return np.ascontiguousarray(t.load())
    if t.load_rows is None or len(t.shape) < 2:
        return _encode(t.load(), qt)
    row = int(np.prod(t.shape[1:]))
    step = max(1, _CHUNK_BYTES // (4 * row))
    out = None
    for r0 in range(0, t.shape[0], step):
        r1 = min(r0 + step, t.shape[0])
        chunk = _encode(t.load_rows(r0, r1), qt)  # rows encode independently (quant blocks lie in a row)
        if out is None:
            out = np.empty((t.shape[0], *chunk.shape[1:]), dtype=chunk.dtype)
        out[r0:r1] = chunk
    return out


def write_drafter(
    path: str | os.PathLike,
    cfg: DrafterConfig,
    tensors: Mapping[str, np.ndarray] | Iterable[TensorSource],
    target_gguf: str | os.PathLike | GGUFReader | Callable[[GGUFWriter], None],
    outtype: str = "f32",
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write a drafter GGUF; returns the number of tensors.

    target_gguf: the target's GGUF (its tokenizer keys are copied), or a function that
    writes the target's tokenizer keys.

    tensors: GGUF names -> arrays in PyTorch [out, in] order, or TensorSources,
    which are loaded one at a time (peak memory ~ the largest tensor).
    progress(bytes_done, bytes_total) is called after each tensor.
    """
    if outtype not in _OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(_OUTTYPES)}, got {outtype!r}")
    if isinstance(tensors, Mapping):
        tensors = [TensorSource(k, tuple(v.shape), (lambda v=v: v)) for k, v in tensors.items()]
    srcs = list(tensors)
    if callable(target_gguf):  # writes the target's tokenizer keys itself (e.g. from a HF directory)
        write_vocab = target_gguf
    else:
        src = target_gguf if isinstance(target_gguf, GGUFReader) else GGUFReader(os.fspath(target_gguf))

        def write_vocab(w: GGUFWriter) -> None:
            copy_tokenizer(src, w)
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
    if cfg.rope_sections:
        w.add_array(f"{ARCH}.rope.dimension_sections", [int(x) for x in cfg.rope_sections])
    if cfg.rope_scaling:
        w.add_string(f"{ARCH}.rope.scaling.type", cfg.rope_scaling)
        w.add_float32(f"{ARCH}.rope.scaling.factor", cfg.rope_factor)
        if cfg.rope_scaling == "yarn":
            w.add_uint32(f"{ARCH}.rope.scaling.original_context_length", cfg.rope_orig_ctx)
            w.add_float32(f"{ARCH}.rope.scaling.yarn_beta_fast", cfg.yarn_beta_fast)
            w.add_float32(f"{ARCH}.rope.scaling.yarn_beta_slow", cfg.yarn_beta_slow)
            if cfg.yarn_attn_factor != 1.0:
                w.add_float32(f"{ARCH}.rope.scaling.attn_factor", cfg.yarn_attn_factor)
    w.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    if cfg.is_v2:
        w.add_uint32(f"{ARCH}.conv_kernel_size", cfg.conv_kernel_size)
        w.add_uint32(f"{ARCH}.conv_group_size", cfg.conv_group_size)
        w.add_uint32(f"{ARCH}.selector_rank", cfg.selector_rank)
        w.add_uint32(f"{ARCH}.selector_top_k", cfg.selector_top_k)
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
    write_vocab(w)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)

    types = [t.raw_type or tensor_type(t.name, t.shape, outtype) for t in srcs]
    total = 0
    for t, qt in zip(srcs, types, strict=True):
        block, size = GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(t.shape)) // block * size
        byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
        dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.I64: np.int64, GGMLQuantizationType.I32: np.int32}.get(qt, np.uint8)
        w.add_tensor_info(t.name, byte_shape if dtype is np.uint8 else t.shape, np.dtype(dtype), nbytes,
                          raw_dtype=qt)
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    done = 0
    for t, qt in zip(srcs, types, strict=True):
        data = _encode_source(t, qt)
        w.write_tensor_data(data)
        done += data.nbytes
        del data
        if progress:
            progress(done, total)
    w.close()
    return len(srcs)


def read_tensors(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of a GGUF as float32 arrays in PyTorch [out, in] order (dequantized; id maps as int64)."""
    r = GGUFReader(os.fspath(path))
    out = {}
    for t in r.tensors:
        if names is not None and t.name not in names:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type in (GGMLQuantizationType.I32, GGMLQuantizationType.I64):  # id maps (d2t) stay ids
            out[t.name] = np.array(t.data, dtype=np.int64).reshape(shape)
            continue
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
        conv_kernel_size=int(get(f"{ARCH}.conv_kernel_size", 0)),
        conv_group_size=int(get(f"{ARCH}.conv_group_size", 0)),
        selector_rank=int(get(f"{ARCH}.selector_rank", 0)),
        selector_top_k=int(get(f"{ARCH}.selector_top_k", 0)),
        rope_sections=[int(x) for x in get(f"{ARCH}.rope.dimension_sections", [])],
        rope_scaling="" if get(f"{ARCH}.rope.scaling.type", "none") == "none" else get(f"{ARCH}.rope.scaling.type"),
        rope_factor=float(get(f"{ARCH}.rope.scaling.factor", 1.0)),
        rope_orig_ctx=int(get(f"{ARCH}.rope.scaling.original_context_length", 0)),
        yarn_beta_fast=float(get(f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(get(f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
        yarn_attn_factor=float(get(f"{ARCH}.rope.scaling.attn_factor", 1.0)),
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
        if cfg.is_v2:
            g = E // cfg.conv_group_size
            for side in ("attn", "ffn"):
                base = np.zeros((2, cfg.conv_kernel_size, E), np.float32)
                base[:, 0, :] = 1.0  # identity-initialised, as DFlash2 training starts
                t[p + f"{side}_conv_base"] = base + (0.1 * std * rng.standard_normal(base.shape)).astype(np.float32)
                t[p + f"{side}_conv_proj.weight"] = mat(2 * cfg.conv_kernel_size * g, E)
    if cfg.is_v2:
        if cfg.n_vocab <= 0:
            raise ValueError("a DFlash2 config needs n_vocab for the selector codebooks")
        t["selector_predecessor.weight"] = mat(cfg.n_vocab, cfg.selector_rank)
        t["selector_successor.weight"] = mat(cfg.n_vocab, cfg.selector_rank)
        t["selector_hidden.weight"] = mat(cfg.selector_rank, E)
    return t
