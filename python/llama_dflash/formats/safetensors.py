"""Lazy safetensors reading (f32 / f16 / bf16), one tensor at a time, no framework needed.

Every header is validated before anything is converted, so a corrupt shard is
reported with its file name instead of failing half-way through a conversion.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import printable

_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2), "F64": (np.float64, 8),
           # id maps of reduced-vocabulary drafters (d2t offsets, t2d masks)
           "I64": (np.int64, 8), "I32": (np.int32, 4), "BOOL": (np.bool_, 1)}
_INT_DTYPES = ("I64", "I32", "BOOL")


class SafetensorsError(ValueError):
    """A safetensors file whose header or data cannot be used."""


@dataclass(frozen=True)
class LazyTensor:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def load(self) -> np.ndarray:
        """The tensor as float32 (bf16 widened exactly)."""
        return self.load_rows(0, self.shape[0] if self.shape else 1)

    def load_ints(self) -> np.ndarray:
        """An integer (or bool) tensor as int64."""
        if self.dtype not in _INT_DTYPES:
            raise SafetensorsError(f"{self.file}: tensor '{self.name}' is {self.dtype}, not an integer tensor")
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            a = np.fromfile(f, dtype=_DTYPES[self.dtype][0], count=int(np.prod(self.shape, dtype=np.int64)))
        return a.astype(np.int64).reshape(self.shape)

    def load_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of the first dimension as float32, read (not mapped) from the file,
        so converting a large tensor chunk by chunk keeps only the chunk in memory."""
        if self.dtype in _INT_DTYPES:
            raise SafetensorsError(f"{self.file}: tensor '{self.name}' is {self.dtype}, not a float tensor")
        np_dtype, size = _DTYPES[self.dtype]
        row = int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1
        with open(self.file, "rb") as f:
            f.seek(self.offset + r0 * row * size)
            a = np.fromfile(f, dtype=np_dtype, count=(r1 - r0) * row)
        shape = (r1 - r0, *self.shape[1:]) if self.shape else ()
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return a.astype(np.float32).reshape(shape)


def read_header(path: str | os.PathLike) -> dict[str, LazyTensor]:
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{p}: corrupt safetensors header (file too short)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or 8 + n > size:
            raise SafetensorsError(f"{p}: corrupt safetensors header (header length {n} exceeds the file)")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{p}: corrupt safetensors header ({e.__class__.__name__})") from None
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{p}: corrupt safetensors header (not a JSON object)")
    out = {}
    base = 8 + n
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            if not all(type(x) is int for x in (b, e)):  # (JSON numbers only: no floats, strings, bools)
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{p}: corrupt safetensors header (entry '{printable(name)}')") from None
        if not isinstance(dtype, str) or dtype not in _DTYPES:  # (a list or object: unhashable)
            raise SafetensorsError(f"{p}: tensor '{printable(name)}' has unsupported dtype "
                                   f"{printable(str(dtype))} (f32, f16, bf16, f64, ids)")
        want = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1]
        if e - b != want or b < 0 or base + e > size:
            raise SafetensorsError(f"{p}: tensor '{printable(name)}' data ({b}..{e}) does not match its shape "
                                   f"{list(shape)} or lies outside the file")
        out[name] = LazyTensor(p, name, dtype, shape, base + b, e - b)
    return out


def open_checkpoint(hf_dir: str | os.PathLike) -> dict[str, LazyTensor]:
    """All tensors of a HF directory: one file, or shards listed by model.safetensors.index.json."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise SafetensorsError(f"{index}: not a valid safetensors index (weight_map)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SafetensorsError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        for fn in files:
            # shards are files of this directory: no paths out of it
            if fn in ("", ".", "..") or "/" in fn or "\\" in fn or "\0" in fn:
                raise SafetensorsError(f"{index}: shard name {fn!r} is not a file name in {d}")
            if not (d / fn).is_file():
                raise SafetensorsError(f"{index}: shard '{printable(fn)}' is missing")
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"{d}: no .safetensors files")
    tensors: dict[str, LazyTensor] = {}
    for fn in files:
        for name, t in read_header(d / fn).items():
            if name in tensors:
                raise SafetensorsError(f"{d / fn}: tensor '{printable(name)}' appears in two shards")
            tensors[name] = t
    if index.is_file():
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise SafetensorsError(f"{index}: lists tensors not found in the shards: "
                                   f"{printable(', '.join(missing[:5]))}")
    return tensors


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Write float arrays as F32 / F16 / BF16, integer / bool arrays as I64 / BOOL (used by training
    export and test fixtures)."""
    header: dict = {}
    blobs = []
    off = 0
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):  # id maps keep their integer type
            t = "BOOL" if a.dtype == np.bool_ else "I64"
            b = np.ascontiguousarray(a, dtype=np.bool_ if t == "BOOL" else np.int64).tobytes()
            header[name] = {"dtype": t, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)
            continue
        a32 = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "F32":
            b = a32.tobytes()
        elif dtype == "F16":
            b = a32.astype(np.float16).tobytes()
        elif dtype == "BF16":  # round to nearest even
            u = a32.view(np.uint32).astype(np.uint64)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
        else:
            raise ValueError(dtype)
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
