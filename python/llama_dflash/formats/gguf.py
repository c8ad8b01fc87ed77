"""Reading and writing DFlash drafter GGUF files in upstream llama.cpp's layout.

Keys and tensors as the format table (``dflash_format.h``) gives them, which follows llama.cpp's
``src/models/dflash.cpp``.  The drafter carries the target's vocabulary (tokenizer.* keys) and
the mask token id.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from .check import check_drafter
from .config import DrafterConfig
from .table import evaluate, table

_T = table()
ARCH = _T.arch

# Kept in f32 whatever the output type: norms, DFlash2 conv bases and selector codebooks.
_KEEP_F32 = tuple(t.name.removesuffix(".weight") for t in (*_T.top, *_T.layer) if t.dtype == "F32")

_OUTTYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
OUTTYPES = tuple(_OUTTYPES)  # the types a drafter's matrices can be written in
_SKIP_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def _field_value(f):
    return f.contents()


def copy_fields(src: GGUFReader, w: GGUFWriter, keep: Callable[[str], bool] | None = None) -> None:
    """Copy the keys of a GGUF (those `keep` accepts; the writer sets the architecture and the counts)."""
    for name, f in src.fields.items():
        if name in _SKIP_KEYS or (keep is not None and not keep(name)):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, _field_value(f), vtype, sub_type=sub)


def copy_tokenizer(src: GGUFReader, writer: GGUFWriter) -> None:
    """Copy every tokenizer.* key of a target GGUF (the drafter shares its vocabulary)."""
    copy_fields(src, writer, lambda name: name.startswith("tokenizer.") and name != "tokenizer.ggml.mask_token_id")


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
    write_vocab(w)
    write_keys(w, cfg)
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


def _shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch [out, in] order."""
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _is_ids(t) -> bool:
    return t.tensor_type in (GGMLQuantizationType.I32, GGMLQuantizationType.I64)  # id maps (d2t)


def _as_f32(t) -> np.ndarray:
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(_shape(t))


def quantize_drafter(src: str | os.PathLike, out: str | os.PathLike, outtype: str) -> dict:
    """Write `out`: the drafter GGUF `src` with its matrices re-encoded in `outtype` by the
    converter's rule (`tensor_type`: norms, conv bases and codebooks stay f32; id maps as they are).

    On the CPU, q4_0 matrices are what llama.cpp repacks for its multi-row kernels (AVX2 and
    ARM): the drafter reads half the bytes of q8_0 and multiplies faster.  Returns the tensors
    re-encoded and the file's size.
    """
    from ..errors import check_file

    check_file(src, "drafter")
    if outtype not in _OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(_OUTTYPES)}, got {outtype!r}")
    r = GGUFReader(os.fspath(src))
    arch = r.fields.get("general.architecture")
    if arch is None or arch.contents() != ARCH:
        raise ValueError(f"{src} is not a DFlash drafter GGUF")
    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    changed = 0
    try:
        w = GGUFWriter(os.fspath(tmp), ARCH)
        copy_fields(r, w)
        for t in r.tensors:
            qt = t.tensor_type if _is_ids(t) else tensor_type(t.name, _shape(t), outtype)
            if qt == t.tensor_type:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=qt)
                continue
            w.add_tensor(t.name, _encode(_as_f32(t), qt), raw_dtype=qt)
            changed += 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(out), "bytes": out.stat().st_size, "outtype": outtype, "tensors_changed": changed}


def read_tensors(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of a GGUF as float32 arrays in PyTorch [out, in] order (dequantized; id maps as int64)."""
    r = GGUFReader(os.fspath(path))
    out = {}
    for t in r.tensors:
        if names is not None and t.name not in names:
            continue
        out[t.name] = np.array(t.data, dtype=np.int64).reshape(_shape(t)) if _is_ids(t) else _as_f32(t)
    return out


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """A drafter file's hyper-parameters, read and validated by the C loader (without a target:
    the vocabulary is the file's own tokenizer); raises DFlashError when the loader would refuse it."""
    return check_drafter(path)


def random_drafter_tensors(cfg: DrafterConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random-weight drafter tensors (GGUF names, [out, in] order) for every tensor the table
    requires of cfg: matrices ~ N(0, std), norms near 1, DFlash2 conv bases near identity."""
    if cfg.is_v2 and cfg.n_vocab <= 0:
        raise ValueError("a DFlash2 config needs n_vocab for the selector codebooks")
    rng = np.random.default_rng(seed)
    wanted = [(n, t) for n, t, _ in _T.tensors(cfg.n_layer) if t.need == "REQ" or (t.need == "V2" and cfg.is_v2)]
    # draw order: shared tensors, the layers, then the DFlash2 selector
    wanted.sort(key=lambda nt: (not nt[1].per_layer and nt[1].need == "V2"))
    out = {}
    for name, t in wanted:
        shape = t.shape(cfg)
        if t.dtype == "F32" and len(shape) == 1:  # a norm
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif t.dtype == "F32" and len(shape) == 3:  # a conv base, identity-initialised as DFlash2 training starts
            base = np.zeros(shape, np.float32)
            base[:, 0, :] = 1.0
            out[name] = base + (0.1 * std * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


def _key_written(k, cfg: DrafterConfig, value) -> bool:
    if k.write == "ALWAYS":
        return True
    if k.write == "NONDEF":
        return value != evaluate(k.default, cfg) and value != []
    return {"SCALED": cfg.rope_scaling != "none", "YARN": cfg.rope_scaling == "yarn", "SWA": cfg.n_swa > 0,
            "V2": cfg.is_v2}[k.write]


def write_keys(w: GGUFWriter, cfg: DrafterConfig) -> None:
    """The hyper-parameter keys of cfg, as the format table says (type, and when each is written)."""
    def put(key: str, typ: str, value) -> None:
        if typ == "U32":
            if not 0 <= int(value) < 2**32:  # (the loader checks ranges; this is what the type can hold)
                raise ValueError(f"{key} = {value} does not fit the file's unsigned 32-bit field")
            w.add_uint32(key, int(value))
        elif typ == "F32":
            w.add_float32(key, float(value))
        elif typ == "BOOL":
            w.add_bool(key, bool(value))
        elif typ == "STR":
            w.add_string(key, str(value))
        elif typ == "ARR_INT":
            w.add_array(key, [int(x) for x in value])
        else:
            w.add_array(key, [bool(x) for x in value])

    for k in _T.keys:
        value = getattr(cfg, k.field)
        if k.field == "target_layers":
            value = [int(i) + 1 for i in value]  # the file stores HF id + 1
        elif k.field == "swa_layers":
            value = value or [True] * cfg.n_layer
        if _key_written(k, cfg, value):
            put(k.key, k.type, value)
    for e in _T.equal:
        put(e.key, e.type, getattr(cfg, e.field))
