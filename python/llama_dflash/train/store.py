"""Per-position rows of training sequences on disk, appended as they are captured.

A store (a directory) holds, for every position of every sequence added to it, the token,
the target's tapped features and, optionally, the target's top-k next-token log-probabilities
(the distillation signal); ``refs.jsonl`` says where each sequence starts, by its response
identity.  Rows are appended in the pass that generates the sequence (one target pass per
sequence), the sequence's reference after them: an interrupted run leaves whole sequences.

Files: ``meta.json`` (what the rows depend on: capture id, width, format, top-k),
``tokens.i32``, ``feat.f16`` or ``feat.q8`` + ``scale.f16`` + ``norm.f32``, ``top_ids.i32`` +
``top_logp.f16`` (top-k only), ``refs.jsonl``.

Format ``q8``: values are standardised per channel with the mean and deviation of the store's
first rows (``norm.f32``), then each row's values of each tap are scaled to int8 by their
absolute maximum (one fp16 scale per row and tap): 1 byte per value instead of 2.  Measured on
SmolLM2-135M's five taps: an RMS error of 0.0075 standard deviations per value (without the
channel step a few massive-activation channels set every scale: 0.27).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FORMATS = ("q8", "f16")  # (the default first)
NORM_ROWS = 4096  # q8: rows the per-channel statistics are taken from


class StoreMismatch(ValueError):
    """The directory holds a store made with other settings."""


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else 0


def _rid(rid: Sequence) -> tuple[str, float, int]:
    return str(rid[0]), float(rid[1]), int(rid[2])


class RowStore:
    """An append-only row store at `path` (created, or opened when it exists with the same meta).

    capture: what the features depend on besides the tokens (target, taps); width: values per
    row (n_taps * n_embd); fmt: "f16" or "q8"; top_k: log-probabilities kept per row (0: none).
    """

    def __init__(self, path: str | os.PathLike, capture: dict, width: int, n_taps: int, fmt: str = "q8",
                 top_k: int = 0, readonly: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"feature format must be one of {FORMATS}, got {fmt!r}")
        if width <= 0 or n_taps <= 0 or width % n_taps:
            raise ValueError(f"a row of {width} values cannot hold {n_taps} taps")
        self.path = Path(path)
        self.meta = {"capture": capture, "width": int(width), "n_taps": int(n_taps), "format": fmt,
                     "top_k": int(top_k)}
        mp = self.path / "meta.json"
        if mp.is_file():
            try:
                have = json.loads(mp.read_text())
            except ValueError:
                have = None
            if have != self.meta:
                raise StoreMismatch(f"{self.path} holds rows made with other settings ({have})")
        elif readonly:
            raise FileNotFoundError(f"no row store in {self.path}")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = mp.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.meta))
            tmp.replace(mp)
        self.readonly = readonly
        self._open()

    @classmethod
    def open(cls, path: str | os.PathLike, readonly: bool = True) -> RowStore:
        """An existing store, with the settings it was made with (read-only: nothing on disk changes;
        rows past what every file holds, and references to them, are ignored)."""
        m = json.loads((Path(path) / "meta.json").read_text())
        return cls(path, m["capture"], m["width"], m["n_taps"], m["format"], m["top_k"], readonly=readonly)

    @classmethod
    def replace(cls, path: str | os.PathLike, *args, **kw) -> RowStore:
        """The store at `path`; one made with other settings (or unreadable) is deleted first."""
        try:
            return cls(path, *args, **kw)
        except StoreMismatch:
            shutil.rmtree(path)
            return cls(path, *args, **kw)

    # -- layout -----------------------------------------------------------------------------

    @property
    def width(self) -> int:
        return self.meta["width"]

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    def _files(self) -> dict[str, tuple[np.dtype, int]]:
        """Each row file: (dtype, values per row)."""
        W, T, k = self.width, self.meta["n_taps"], self.top_k
        f = {"tokens.i32": (np.dtype(np.int32), 1)}
        if self.meta["format"] == "f16":
            f["feat.f16"] = (np.dtype(np.float16), W)
        else:
            f["feat.q8"] = (np.dtype(np.int8), W)
            f["scale.f16"] = (np.dtype(np.float16), T)
        if k:
            f["top_ids.i32"] = (np.dtype(np.int32), k)
            f["top_logp.f16"] = (np.dtype(np.float16), k)
        return f

    @property
    def bytes_per_row(self) -> int:
        return sum(dt.itemsize * n for dt, n in self._files().values())

    def _open(self) -> None:
        """Cut every file to the rows all of them hold and drop references past them (what an
        interrupted append leaves), then read the references and the q8 statistics."""
        files = self._files()
        if not self.readonly:
            for name in files:
                (self.path / name).touch()
        n = min(_size(self.path / name) // (dt.itemsize * w) for name, (dt, w) in files.items())
        for name, (dt, w) in files.items():
            p = self.path / name
            if not self.readonly and p.stat().st_size != n * dt.itemsize * w:
                os.truncate(p, n * dt.itemsize * w)
        self.refs: dict[tuple[str, float, int], tuple[int, int]] = {}
        rp, kept, cut = self.path / "refs.jsonl", [], False
        if rp.is_file():
            text = rp.read_text(encoding="utf-8")
            cut = bool(text) and not text.endswith("\n")  # a cut last line: the next append must start afresh
            for line in text.splitlines():
                try:
                    r = json.loads(line)
                    rid, row, length = _rid(r["rid"]), int(r["row"]), int(r["n"])
                except (ValueError, KeyError, TypeError, IndexError):
                    cut = True
                    continue
                if row + length > n:
                    cut = True
                    continue
                self.refs[rid] = (row, length)
                kept.append(line)
        if cut and not self.readonly:
            tmp = rp.with_suffix(".tmp")
            tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
            tmp.replace(rp)
        self.n_rows = n
        self._norm = None
        npath = self.path / "norm.f32"
        if self.meta["format"] == "q8" and npath.is_file():
            norm = np.fromfile(npath, np.float32)
            if norm.size != 2 * self.width:
                raise StoreMismatch(f"{self.path}: unreadable statistics (norm.f32)")
            self._norm = norm.reshape(2, self.width)
        if self.meta["format"] == "q8" and n and self._norm is None:
            raise StoreMismatch(f"{self.path}: rows without their statistics (norm.f32)")
        self._pending: list[dict] = []  # sequences queued for the next flush
        self._maps: dict[str, np.memmap] = {}

    # -- writing ----------------------------------------------------------------------------

    def add(self, rid: Sequence, tokens: Sequence[int], features: np.ndarray, top_ids: np.ndarray | None = None,
            top_logp: np.ndarray | None = None) -> None:
        """Queue one sequence's rows (written by ``flush``, or once q8 has its statistics)."""
        tokens = np.asarray(tokens, np.int32)
        features = np.asarray(features, np.float32)
        if features.shape != (len(tokens), self.width):
            raise ValueError(f"features of shape {features.shape} for {len(tokens)} tokens of width {self.width}")
        if self.top_k and top_ids is not None:  # (None: captured without logits, no distillation rows)
            if np.shape(top_ids) != (len(tokens), self.top_k) or np.shape(top_logp) != np.shape(top_ids):
                raise ValueError(f"top-k rows of shape {np.shape(top_ids)} for {len(tokens)} tokens, k {self.top_k}")
        self._queue({"rid": _rid(rid), "tokens": tokens, "feats": features, "ids": top_ids, "logp": top_logp})

    def add_rows(self, src: RowStore, rid: Sequence, row: int, n: int) -> None:
        """Another store's rows [row, row + n) as one sequence: copied as they are when both stores
        encode alike (f16, or q8 with the same statistics), else decoded and encoded again."""
        if src.width != self.width:
            raise ValueError(f"rows of width {src.width} for a store of width {self.width}")
        # the source's top-k rows are sorted: a larger k keeps its first self.top_k columns
        ids, logp = (tuple(x[:, :self.top_k] for x in src.top(row, n)) if self.top_k and src.top_k >= self.top_k
                     else (None, None))
        if self.meta["format"] == src.meta["format"] == "q8" and self._norm is not None and \
                src._norm is not None and np.array_equal(self._norm, src._norm):
            q8 = np.asarray(src._map("feat.q8")[row:row + n]), np.asarray(src._map("scale.f16")[row:row + n])
            self._queue({"rid": _rid(rid), "tokens": np.asarray(src.tokens(row, n), np.int32), "q8": q8,
                         "ids": ids, "logp": logp})
        else:
            self.add(rid, src.tokens(row, n), src.features(row, n), ids, logp)

    def adopt_statistics(self, src: RowStore) -> bool:
        """An empty q8 store takes another store's per-channel statistics (same capture), so that rows
        copied between them stay byte for byte the same.  Whether it did."""
        if (self.meta["format"] != "q8" or self._norm is not None or self.n_rows or self._pending
                or src._norm is None or (src.meta["capture"], src.width) != (self.meta["capture"], self.width)):
            return False
        self._set_statistics(src._norm.copy())
        return True

    def _set_statistics(self, norm: np.ndarray) -> None:
        self._norm = norm
        tmp = self.path / "norm.f32.tmp"
        norm.tofile(tmp)
        tmp.replace(self.path / "norm.f32")

    def _queue(self, item: dict) -> None:
        self._pending.append(item)
        if self.meta["format"] == "f16" or self._norm is not None or \
                sum(len(p["tokens"]) for p in self._pending) >= NORM_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write the queued sequences' rows, then their references.  On an error (a full disk, an
        interrupt) the files go back to what they held before and the queued sequences are dropped
        (their responses then have no rows: a later run captures them)."""
        if not self._pending:
            return
        if self.readonly:
            raise ValueError(f"{self.path} was opened read-only")
        start, refs_size = self.n_rows, _size(self.path / "refs.jsonl")
        try:
            self._write()
        except BaseException:
            for name, (dt, w) in self._files().items():
                os.truncate(self.path / name, start * dt.itemsize * w)
            if (self.path / "refs.jsonl").is_file():
                os.truncate(self.path / "refs.jsonl", refs_size)
            self.n_rows = start
            self._pending = []
            self._maps = {}
            raise

    def _write(self) -> None:
        if self.meta["format"] == "q8" and self._norm is None:
            self._set_statistics(_channel_stats(np.concatenate([p["feats"] for p in self._pending if "feats" in p]),
                                                self.meta["n_taps"]))
        outs = {name: open(self.path / name, "ab") for name in self._files()}
        refs = []
        try:
            for p in self._pending:
                tokens = p["tokens"]
                outs["tokens.i32"].write(tokens.tobytes())
                if self.meta["format"] == "f16":
                    outs["feat.f16"].write(p["feats"].astype(np.float16).tobytes())
                else:
                    q, sc = p["q8"] if "q8" in p else quantize_q8(p["feats"], self._norm, self.meta["n_taps"])
                    outs["feat.q8"].write(np.ascontiguousarray(q, np.int8).tobytes())
                    outs["scale.f16"].write(np.ascontiguousarray(sc, np.float16).tobytes())
                if self.top_k:
                    ids, logp = p["ids"], p["logp"]
                    if ids is None:  # no top-k rows for this sequence: ids -1
                        shape = (len(tokens), self.top_k)
                        ids, logp = np.full(shape, -1, np.int32), np.zeros(shape, np.float32)
                    outs["top_ids.i32"].write(np.asarray(ids, np.int32).tobytes())
                    outs["top_logp.f16"].write(np.asarray(logp, np.float32).astype(np.float16).tobytes())
                refs.append((p["rid"], self.n_rows, len(tokens)))
                self.n_rows += len(tokens)
        finally:
            for f in outs.values():
                f.close()
        with open(self.path / "refs.jsonl", "a", encoding="utf-8") as f:  # (ends with a newline: _open)
            f.write("".join(json.dumps({"rid": list(rid), "row": row, "n": n}) + "\n" for rid, row, n in refs))
        for rid, row, n in refs:
            self.refs[rid] = (row, n)
        self._pending = []
        self._maps = {}

    def check_space(self, rows: int) -> None:
        """A clear error when the disk cannot take `rows` more rows."""
        need, free = rows * self.bytes_per_row, shutil.disk_usage(self.path).free
        if need > free:
            raise ValueError(f"features for this data need {need / 2**30:.1f} GiB in {self.path}, only "
                             f"{free / 2**30:.1f} GiB free (--max-sequences or fewer --prompts make them smaller)")

    # -- reading ----------------------------------------------------------------------------

    def _map(self, name: str) -> np.ndarray:
        m = self._maps.get(name)
        if m is None:
            dt, w = self._files()[name]
            if self.n_rows == 0:
                return np.zeros((0, w), dt)
            m = self._maps[name] = np.memmap(self.path / name, dt, "r", shape=(self.n_rows, w))
        return m

    def tokens(self, row: int, n: int) -> np.ndarray:
        return self._map("tokens.i32")[row:row + n, 0]

    def features(self, row: int, n: int) -> np.ndarray:
        """Rows [row, row + n) as float32 [n, width]."""
        if self.meta["format"] == "f16":
            return np.asarray(self._map("feat.f16")[row:row + n], np.float32)
        return dequantize_q8(self._map("feat.q8")[row:row + n], self._map("scale.f16")[row:row + n], self._norm)

    def top(self, row: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows' top-k next-token ids (-1: none) and log-probabilities, [n, k] each."""
        if not self.top_k:
            raise ValueError(f"{self.path} keeps no top-k log-probabilities")
        return (np.asarray(self._map("top_ids.i32")[row:row + n]),
                np.asarray(self._map("top_logp.f16")[row:row + n], np.float32))


def _channel_stats(x: np.ndarray, n_taps: int) -> np.ndarray:
    """[mean; deviation] per channel, the deviation floored at 1 % of its tap's median (a channel
    constant in the sample must not blow up later rows' values)."""
    x = x.astype(np.float64)
    mu, sd = x.mean(0), x.std(0)
    for t in np.split(np.arange(x.shape[1]), n_taps):
        sd[t] = np.maximum(sd[t], 0.01 * np.median(sd[t]) + 1e-12)
    return np.stack([mu, sd]).astype(np.float32)


def quantize_q8(x: np.ndarray, norm: np.ndarray, n_taps: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [n, W] and fp16 scales [n, n_taps] of float rows x (``norm``: mean; deviation)."""
    z = ((x - norm[0]) / norm[1]).reshape(len(x), n_taps, -1)
    s = np.minimum(np.abs(z).max(2) / 127, np.finfo(np.float16).max).astype(np.float16)  # (beyond: clipped)
    sf = s.astype(np.float32)
    sf[sf == 0] = 1
    q = np.clip(np.rint(z / sf[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(len(x), -1), s


def dequantize_q8(q: np.ndarray, s: np.ndarray, norm: np.ndarray) -> np.ndarray:
    n, n_taps = s.shape
    z = np.asarray(q, np.float32).reshape(n, n_taps, -1) * np.asarray(s, np.float32)[:, :, None]
    return z.reshape(n, -1) * norm[1] + norm[0]
