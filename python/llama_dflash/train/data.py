"""Training data on disk: the target's responses and their captured features.

Layout of a data directory (every stage resumable: finished work is skipped):

- ``responses.jsonl`` — one line per finished generation (prompt key, source,
  temperature, prompt ids, response ids), appended as sequences finish.
- ``tokens.npy`` / ``index.npy`` — all sequences' ids concatenated (int32) and, per
  sequence, [token offset, length, response start, temperature * 1000, held out].
- ``features.f16`` — fp16 rows [n_tokens, n_taps * n_embd] from the package's C capture;
  ``features.done`` says which sequences they cover and for which target and taps (when
  responses are added, the sequences already captured are copied, not captured again).

Features are stored rather than recomputed: the 2 cores that train would otherwise
also run a target forward per step, and fp16 rows cost 5.8 KB per token for 5 taps of
576 (≈ 2 GB for the shipped run), which this machine's disk holds easily.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core import Tokenizer
from ..core.batchgen import BatchGenerator, Job
from .prompts import Prompt, chatml


@dataclass
class DataSpec:
    target: str
    taps: list[int]                 # HF layer ids (ZL convention)
    max_new: int = 192
    max_prompt: int = 320
    sampled_every: int = 4          # every k-th prompt also gets sampled responses (0 = none)
    samples: int = 1                # sampled responses per such prompt (each its own seed)
    temperature: float = 0.7
    n_seq: int = 8                  # sequences per decode
    held_out: float = 0.03          # fraction of prompts kept for validation
    max_sequences: int = 0          # features (and training) for at most this many sequences (0 = all)
    seed: int = 0


class Progress:
    """A one-line progress bar on stderr (plain text when not a terminal)."""

    def __init__(self, total: int, label: str, every_s: float = 2.0, done: int = 0) -> None:
        self.total, self.label, self.every = total, label, every_s
        self.t0 = self.last = time.time()
        self.done = self.start = done  # a resumed run: the rate counts this run's work only

    def update(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        now = time.time()
        if now - self.last < self.every and self.done < self.total:
            return
        self.last = now
        frac = self.done / max(1, self.total)
        el = now - self.t0
        rate = (self.done - self.start) / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0
        bar = "#" * int(24 * frac)
        end = "\r" if sys.stderr.isatty() and self.done < self.total else "\n"
        sys.stderr.write(f"{self.label} [{bar:<24}] {self.done}/{self.total} {el:.0f}s eta {eta:.0f}s {extra}{end}")
        sys.stderr.flush()


def generate_responses(out: Path, spec: DataSpec, prompts: Sequence[Prompt], log=print) -> Path:
    """Stage 1: the target's greedy (and some sampled) responses, batched; appends to responses.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "responses.jsonl"
    done = set()
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interrupted run
                    continue
                done.add(_rid(r))
    jobs, meta = [], {}
    with Tokenizer(spec.target) as tok:  # released before the generator loads the model
        for i, p in enumerate(prompts):
            ids = tok.tokenize(chatml(p.text).encode(), add_bos=False, special=True)
            if len(ids) > spec.max_prompt:
                continue
            for t, k in _runs(spec, i):
                if (p.key, t, k) in done:
                    continue
                j = len(meta)
                meta[j] = (p, k)
                # sample k > 0 of a prompt: its own stream; sample 0 keeps the seed runs before samples had
                jobs.append(Job(j, ids, t, spec.seed * 1_000_003 + i + k * 100_003))
    if not jobs:
        return path
    log(f"generating {len(jobs)} responses ({len(done)} already done), {spec.n_seq} sequences per decode")
    bar = Progress(len(jobs), "generate")
    n_tok = 0
    with BatchGenerator(spec.target, n_seq=spec.n_seq, max_len=spec.max_prompt + spec.max_new) as g, \
            open(path, "a", encoding="utf-8") as f:
        for c in g.run(jobs, spec.max_new):
            p, k = meta[c.key]
            f.write(json.dumps({"key": p.key, "source": p.source, "temperature": c.temperature, "sample": k,
                                "prompt": c.prompt, "response": c.response}) + "\n")
            f.flush()
            n_tok += len(c.response)
            bar.update(1, f"{n_tok / max(1e-9, time.time() - bar.t0):.0f} tok/s")
    return path


def _runs(spec: DataSpec, i: int) -> list[tuple[float, int]]:
    """The (temperature, sample number) responses the spec asks for prompt number `i`."""
    sampled = spec.sampled_every and i % spec.sampled_every == 0
    return [(0.0, 0)] + ([(spec.temperature, k) for k in range(spec.samples)] if sampled else [])


def wanted(spec: DataSpec, prompts: Sequence[Prompt]) -> set[tuple[str, float, int]]:
    """The identities (prompt key, temperature, sample) of the responses the spec asks for."""
    return {(p.key, t, k) for i, p in enumerate(prompts) for t, k in _runs(spec, i)}


def _rid(r: dict) -> tuple[str, float, int]:
    """A response's identity: prompt key, temperature, sample number (absent in older files: 0)."""
    return r["key"], r["temperature"], int(r.get("sample", 0))


def _order(r: dict) -> tuple:
    """Sequences' fixed pseudo-random order (a hash of the identity; sample 0 hashes as before samples existed)."""
    key, t, k = _rid(r)
    return zlib.crc32(f"{key}|{t}".encode() + (f"|{k}".encode() if k else b"")), key, t, k


def _held_out(key: str, frac: float) -> bool:
    return (zlib.crc32(key.encode()) % 10_000) < frac * 10_000


def _capture_id(spec: DataSpec) -> dict:
    """What the features depend on besides the tokens: the target file (size and a digest of its
    first 16 MiB: header, metadata and the first tensors) and the tapped layers."""
    import hashlib

    with open(spec.target, "rb") as f:
        head = hashlib.sha256(f.read(16 << 20)).hexdigest()[:16]
    return {"target_bytes": os.path.getsize(spec.target), "target_head": head, "taps": list(spec.taps)}


def _layout(tokens: np.ndarray, index: np.ndarray) -> str:
    return f"{zlib.crc32(tokens.tobytes()):08x}{zlib.crc32(index.tobytes()):08x}-{len(index)}-{len(tokens)}"


def _read_state(out: Path) -> dict | None:
    """The features on disk: their layout (tokens, index), capture id, width and which sequences
    are complete; None when there are none or they cannot be trusted.  ``features.done`` is JSON;
    a bare count (older runs) means that many leading sequences of the stored layout, captured by
    this run's own settings (a run directory refuses other settings)."""
    state, feats = out / "features.done", out / "features.f16"
    if not (state.is_file() and feats.is_file() and (out / "tokens.npy").is_file() and (out / "index.npy").is_file()):
        return None
    tokens, index = np.load(out / "tokens.npy"), np.load(out / "index.npy")
    text = state.read_text().strip()
    try:
        if text.startswith("{"):
            st = json.loads(text)
            done = np.zeros(len(index), bool)
            done[np.asarray(st["done"], np.int64)] = True
            if st["layout"] != _layout(tokens, index):
                return None
            capture, width = st["capture"], int(st["width"])
        else:
            done = np.arange(len(index)) < int(text)
            capture, width = None, feats.stat().st_size // (2 * max(1, len(tokens)))
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if feats.stat().st_size != 2 * width * max(1, len(tokens)):
        return None
    return {"tokens": tokens, "index": index, "done": done, "capture": capture, "width": width, "path": feats}


def _usable(st: dict, capture: dict, width: int) -> bool:
    """Whether features recorded in state `st` were captured as this capture would (an older
    state without a capture id is trusted: its run directory refused other settings)."""
    return st["capture"] in (None, capture) and st["width"] == width


def _write_state(out: Path, tokens: np.ndarray, index: np.ndarray, capture: dict, width: int,
                 done: np.ndarray) -> None:
    tmp = out / "features.done.tmp"
    tmp.write_text(json.dumps({"layout": _layout(tokens, index), "capture": capture, "width": width,
                               "done": np.flatnonzero(done).tolist()}))
    tmp.replace(out / "features.done")


def _check_disk(out: Path, need: int) -> None:
    """The feature file is sparse and memory-mapped: running out of disk while its pages are
    written kills the process (SIGBUS), so the space is checked before it is created."""
    import shutil

    free = shutil.disk_usage(out).free
    if free < need:
        raise ValueError(f"features for this data need {need / 2**30:.1f} GiB in {out}, only {free / 2**30:.1f} GiB "
                         "free (--max-sequences or fewer --prompts make them smaller)")


def _new_layout(out: Path, tokens: np.ndarray, index: np.ndarray, capture: dict, width: int, olds: list[dict],
                log) -> np.ndarray:
    """Start features for a changed set of sequences, copying the rows of every sequence whose
    tokens an earlier capture (same target and taps; this directory's or another's) already
    covered: a sequence's features depend only on its own tokens, so a grown data set captures
    its new sequences only."""
    done = np.zeros(len(index), bool)
    tmp = out / "features.f16.tmp"
    _check_disk(out, 2 * width * max(1, len(tokens)))
    feats = np.memmap(tmp, np.float16, "w+", shape=(max(1, len(tokens)), width))
    have, srcs = {}, []
    for old in olds:
        if _usable(old, capture, width):
            srcs.append(np.memmap(old["path"], np.float16, "r", shape=(max(1, len(old["tokens"])), width)))
            for j in np.flatnonzero(old["done"]):
                o, n = (int(x) for x in old["index"][j, :2])
                have.setdefault(old["tokens"][o:o + n].tobytes(), (srcs[-1], o))
    for i in range(len(index)):
        o, n = (int(x) for x in index[i, :2])
        src = have.get(tokens[o:o + n].tobytes())
        if src is not None:
            feats[o:o + n] = src[0][src[1]:src[1] + n]
            done[i] = True
    del have, srcs
    if done.any():
        log(f"features: {int(done.sum())} of {len(index)} sequences carried over from the earlier capture")
    feats.flush()
    del feats
    # the old state goes first: a crash in between leaves no state (a fresh start), never a stale one
    (out / "features.done").unlink(missing_ok=True)
    tmp.replace(out / "features.f16")
    np.save(out / "tokens.npy", tokens)
    np.save(out / "index.npy", index)
    _write_state(out, tokens, index, capture, width, done)
    return done


def build_features(out: Path, spec: DataSpec, prompts: Sequence[Prompt] | None = None, log=print,
                   reuse: Sequence[Path] = ()) -> None:
    """Stage 2: pack the responses the spec asks for `prompts` (default: every response on file; a
    directory may hold more, e.g. samples of an earlier, larger run) and capture their features with
    the C capture (fp16 on disk).  Resumable, and incremental when responses were added; `reuse`:
    other data directories (same target and taps) whose captured sequences are copied."""
    from ..core.generator import SpeculativeGenerator

    want = None if prompts is None else wanted(spec, prompts)
    recs, seen = [], set()
    with open(out / "responses.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            rid = _rid(r)
            if (want is None or rid in want) and rid not in seen:
                seen.add(rid)
                recs.append(r)
    # a fixed pseudo-random order (by a hash of the key), so that max_sequences takes a fair sample
    recs.sort(key=_order)
    if spec.max_sequences:
        recs = recs[: spec.max_sequences]
    lengths = [len(r["prompt"]) + len(r["response"]) for r in recs]
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = np.array([[offs[i], lengths[i], len(r["prompt"]), round(r["temperature"] * 1000),
                       _held_out(r["key"], spec.held_out)] for i, r in enumerate(recs)], np.int64).reshape(-1, 5)
    tokens = np.concatenate([np.asarray(r["prompt"] + r["response"], np.int32) for r in recs]) if recs else \
        np.zeros(0, np.int32)
    capture = _capture_id(spec)
    with SpeculativeGenerator(spec.target, capture_layers=spec.taps, n_ctx=max(lengths, default=1) + 8,
                              n_batch=512) as g:
        width = g.feature_width
        old = _read_state(out)
        same = (old is not None and _usable(old, capture, width) and np.array_equal(old["index"], index)
                and np.array_equal(old["tokens"], tokens))
        olds = [st for st in [old, *map(_read_state, map(Path, reuse))] if st is not None]
        done = old["done"] if same else _new_layout(out, tokens, index, capture, width, olds, log)
        del old, olds
        feats = np.memmap(out / "features.f16", np.float16, "r+", shape=(max(1, len(tokens)), width))
        todo = np.flatnonzero(~done)
        bar = Progress(len(todo), "features")
        for k, i in enumerate(todo):
            o, n = int(index[i, 0]), int(index[i, 1])
            feats[o:o + n] = g.features(tokens[o:o + n].tolist()).astype(np.float16)
            done[i] = True
            if (k + 1) % 50 == 0:
                feats.flush()
                _write_state(out, tokens, index, capture, width, done)
            bar.update(1)
        feats.flush()
        del feats
    _write_state(out, tokens, index, capture, width, done)
    log(f"features: {len(recs)} sequences ({len(todo)} captured now), {len(tokens)} tokens, "
        f"{width} values per token (fp16)")


class Dataset:
    """Read-only view of a data directory (memory-mapped features)."""

    def __init__(self, out: str | os.PathLike) -> None:
        out = Path(out)
        self.tokens = np.load(out / "tokens.npy")
        self.index = np.load(out / "index.npy")
        n = len(self.tokens)
        size = (out / "features.f16").stat().st_size
        self.width = size // (2 * max(1, n))
        self.features = np.memmap(out / "features.f16", np.float16, "r", shape=(max(1, n), self.width))
        self.train_ids = [i for i in range(len(self.index)) if not self.index[i, 4]]
        self.val_ids = [i for i in range(len(self.index)) if self.index[i, 4]]

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(token ids [L], fp16 features [L, width], response start)."""
        o, n, start = (int(x) for x in self.index[i, :3])
        return self.tokens[o:o + n], self.features[o:o + n], start

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)
