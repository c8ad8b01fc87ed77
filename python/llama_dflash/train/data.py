"""Training data on disk: the target's responses and, from the same pass, its features.

Layout of a data directory (every stage resumable: finished work is skipped):

- ``responses.jsonl`` -- one line per finished generation (prompt key, source,
  temperature, sample, prompt ids, response ids), appended as sequences finish.
- ``rows/`` -- a ``RowStore`` (train/store.py): every generated sequence's tokens, the
  target's tapped features and its top-k next-token log-probabilities, captured in the
  decodes that generated it (one target pass per sequence).  Responses without rows (a
  directory from before one-pass capture, an interrupted run) are captured in a second pass.
- ``index.npy`` -- the training set: per sequence [store row, length, response start,
  temperature * 1000, held out].

Features are stored rather than recomputed: the 2 cores that train would otherwise also
run a target forward per step.  8-bit rows (format ``q8``) cost 2.9 KB per token for 5 taps
of 576, fp16 rows 5.8 KB.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core import Tokenizer
from ..core.batchgen import BatchGenerator, Job
from ..formats.hf import read_target
from .prompts import RAW_KEY, Prompt
from .store import RowStore, StoreMismatch


@dataclass
class DataSpec:
    target: str
    taps: list[int]                 # HF layer ids (ZL convention)
    max_new: int = 192
    max_prompt: int = 320
    sampled_every: int = 4          # every k-th prompt also gets sampled responses (0 = none)
    samples: int = 1                # sampled responses per such prompt and temperature (each its own seed)
    temperatures: tuple[float, ...] = (0.7,)  # the sampled responses' temperatures (each gets `samples`)
    n_seq: int = 32                 # sequences per decode
    held_out: float = 0.03          # fraction of prompts kept for validation
    max_sequences: int = 0          # train on at most this many sequences (0 = all)
    seed: int = 0
    feature_format: str = "q8"      # rows on disk: "q8" (8-bit, per-channel standardised) or "f16"
    top_k: int = 32                 # target log-probabilities kept per position (0 = none)


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


def generate_responses(out: Path, spec: DataSpec, prompts: Sequence[Prompt], log=print,
                       reuse: Sequence[Path] = ()) -> Path:
    """Stage 1: the target's greedy (and some sampled) responses, batched, with every position's
    features and top-k log-probabilities from the same decodes; appends to responses.jsonl and
    the row store (a new one encodes as the first of `reuse`'s stores, whose rows then copy as
    they are)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "responses.jsonl"
    done = {_rid(r) for r in _read_responses(path)} if path.is_file() else set()
    jobs, meta = [], {}
    with Tokenizer(spec.target) as tok:  # released before the generator loads the model
        for i, p in enumerate(prompts):
            ids = prompt_ids(tok, p)
            if not fits(spec, ids):
                continue
            for t, k in _runs(spec, i):
                if (p.key, t, k) in done:
                    continue
                j = len(meta)
                meta[j] = (p, k)
                # sample k > 0 of a prompt, or a later temperature: its own stream; sample 0 at the first
                # temperature keeps the seed runs had before samples and temperatures were added
                ti = spec.temperatures.index(t) if t > 0 else 0
                jobs.append(Job(j, ids, t, spec.seed * 1_000_003 + i + k * 100_003 + ti * 7_000_003))
    if not jobs:
        return path
    store = open_store(out, spec, reuse)
    store.check_space(sum(len(j.prompt) + spec.max_new for j in jobs))
    log(f"generating {len(jobs)} responses ({len(done)} already done), {spec.n_seq} sequences per decode, "
        f"features ({spec.feature_format}) and top-{spec.top_k} log-probabilities in the same pass")
    bar = Progress(len(jobs), "generate")
    n_tok = 0
    try:
        _end_line(path)
        with BatchGenerator(spec.target, n_seq=spec.n_seq, max_len=spec.max_prompt + spec.max_new,
                            capture_layers=spec.taps, top_k=spec.top_k) as g, \
                open(path, "a", encoding="utf-8") as f:
            for c in g.run(jobs, spec.max_new):
                p, k = meta[c.key]
                r = {"key": p.key, "source": p.source, "temperature": c.temperature, "sample": k,
                     "prompt": c.prompt, "response": c.response}
                f.write(json.dumps(r) + "\n")
                f.flush()  # the response first: one whose rows are lost is captured by build_features
                store.add(_rid(r), c.prompt + c.response, c.features, c.top_ids, c.top_logp)
                n_tok += len(c.response)
                bar.update(1, f"{n_tok / max(1e-9, time.time() - bar.t0):.0f} tok/s")
    finally:
        store.flush()
    return path


def prompt_ids(tok: Tokenizer, p: Prompt) -> list[int]:
    """A prompt's token ids as the serving path makes them: the chat template (its special tokens
    parsed, no BOS of its own), or a raw completion prefix tokenized as ``create_completion`` does
    (the vocabulary's BOS, text as text)."""
    if p.raw:
        return tok.tokenize(p.render().encode(), add_bos=True, special=False)
    return tok.tokenize(p.render().encode(), add_bos=False, special=True)


def _end_line(path: Path) -> None:
    """A file cut inside its last line gets a newline: what is appended starts a line of its own."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _read_responses(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupted run
                continue


def open_store(out: Path, spec: DataSpec, reuse: Sequence[Path] = ()) -> RowStore:
    """The directory's row store for the spec's target, taps, format and top-k (rows made with
    other settings are deleted: their sequences are captured again).  A new q8 store takes the
    statistics of the first of `reuse`'s stores with the same capture."""
    info = read_target(spec.target)
    store = RowStore.replace(out / "rows", _capture_id(spec), len(spec.taps) * info.n_embd, len(spec.taps),
                             spec.feature_format, spec.top_k)
    for src in _stores(reuse, store):
        if store.adopt_statistics(src):
            break
    return store


def _runs(spec: DataSpec, i: int) -> list[tuple[float, int]]:
    """The (temperature, sample number) responses the spec asks for prompt number `i`."""
    sampled = spec.sampled_every and i % spec.sampled_every == 0
    return [(0.0, 0)] + ([(t, k) for t in spec.temperatures for k in range(spec.samples)] if sampled else [])


def wanted(spec: DataSpec, prompts: Sequence[Prompt]) -> set[tuple[str, float, int]]:
    """The identities (prompt key, temperature, sample) of the responses the spec asks for."""
    return {(p.key, t, k) for i, p in enumerate(prompts) for t, k in _runs(spec, i)}


def fits(spec: DataSpec, ids: Sequence[int]) -> bool:
    """Whether a prompt of these tokens gets responses (longer ones are skipped)."""
    return len(ids) <= spec.max_prompt


def _rid(r: dict) -> tuple[str, float, int]:
    """A response's identity: prompt key, temperature, sample number (absent in older files: 0)."""
    return r["key"], r["temperature"], int(r.get("sample", 0))


def _order(r: dict) -> tuple:
    """Sequences' fixed pseudo-random order (a hash of the identity; sample 0 hashes as before samples existed)."""
    key, t, k = _rid(r)
    return zlib.crc32(f"{key}|{t}".encode() + (f"|{k}".encode() if k else b"")), key, t, k


def _held_out(key: str, frac: float) -> bool:
    """Whether a prompt key is held out (a raw completion prompt goes with its chat twin)."""
    key = key.removeprefix(RAW_KEY)
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


def _read_legacy(out: Path) -> dict | None:
    """Features of the layout before row stores (``tokens.npy`` / ``index.npy`` / ``features.f16``
    / ``features.done``): their tokens, index, capture id, width and which sequences are complete;
    None when there are none or they cannot be trusted.  A bare count in ``features.done`` means
    that many leading sequences, captured by the directory's own settings."""
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


_LEGACY = ("features.done", "features.f16", "tokens.npy")  # (the state first: see build_features)


def _sources(dirs: Sequence[Path], store: RowStore) -> Iterator[tuple[np.ndarray, Callable[[tuple], None]]]:
    """(tokens, rid -> add that sequence's rows to the store) for every sequence captured in `dirs` as
    the store would capture it (same target and taps): their row stores and layouts before those."""
    for src in _stores(dirs, store):
        for row, n in src.refs.values():
            yield src.tokens(row, n), (lambda rid, row=row, n=n, src=src: store.add_rows(src, rid, row, n))
    for d in dirs:
        old = _read_legacy(d)
        if old is not None and old["capture"] in (None, store.meta["capture"]) and old["width"] == store.width:
            f = np.memmap(old["path"], np.float16, "r", shape=(max(1, len(old["tokens"])), old["width"]))
            for j in np.flatnonzero(old["done"]):
                o, n = (int(x) for x in old["index"][j, :2])
                toks = old["tokens"][o:o + n]
                yield toks, (lambda rid, o=o, n=n, f=f, toks=toks:
                             store.add(rid, toks, np.asarray(f[o:o + n], np.float32)))


def _stores(dirs: Sequence[Path], store: RowStore) -> Iterator[RowStore]:
    """The row stores of `dirs` (other than `store`) with the same target and taps."""
    for d in dirs:
        rp = Path(d) / "rows"
        if not (rp / "meta.json").is_file() or rp.resolve() == store.path.resolve():
            continue
        try:
            src = RowStore.open(rp)
        except (StoreMismatch, ValueError, KeyError, OSError):
            continue
        if (src.meta["capture"], src.width) == (store.meta["capture"], store.width):
            yield src


def build_features(out: Path, spec: DataSpec, prompts: Sequence[Prompt] | None = None, log=print,
                   reuse: Sequence[Path] = ()) -> None:
    """Stage 2: the training set (``index.npy``): the responses the spec asks for `prompts` (default:
    every response on file; a directory may hold more, e.g. samples of an earlier, larger run), in a
    fixed pseudo-random order, each with its rows in the store.  Rows the generation did not capture
    (older directories, an interrupted run) are copied from an earlier capture of the same sequence
    (this directory's older layout, or `reuse`: other data directories of the same target and taps),
    else captured now in a second target pass (without top-k log-probabilities)."""
    from ..core.generator import SpeculativeGenerator

    recs = _training_set(out, spec, prompts)
    store = open_store(out, spec, reuse)

    def has_rows(r: dict) -> bool:
        ref = store.refs.get(_rid(r))
        return ref is not None and np.array_equal(store.tokens(*ref), r["prompt"] + r["response"])

    missing = [r for r in recs if not has_rows(r)]
    todo: list[dict] = []
    try:
        if missing:
            by_tokens: dict[bytes, list[dict]] = {}
            for r in missing:
                by_tokens.setdefault(np.asarray(r["prompt"] + r["response"], np.int32).tobytes(), []).append(r)
            copied = 0
            for toks, copy in _sources([out, *map(Path, reuse)], store):
                for r in by_tokens.pop(np.asarray(toks, np.int32).tobytes(), []):
                    copy(_rid(r))
                    copied += 1
            store.flush()
            if copied:
                log(f"features: {copied} of {len(recs)} sequences carried over from an earlier capture")
            todo = [r for r in missing if not has_rows(r)]
        if todo:
            lengths = [len(r["prompt"]) + len(r["response"]) for r in todo]
            store.check_space(sum(lengths))
            with SpeculativeGenerator(spec.target, capture_layers=spec.taps, n_ctx=max(lengths) + 8,
                                      n_batch=512) as g:
                bar = Progress(len(todo), "features")
                for r in todo:
                    toks = r["prompt"] + r["response"]
                    store.add(_rid(r), toks, g.features(toks))
                    bar.update(1)
    finally:
        store.flush()
    index = _index(store, recs, spec)
    # every sequence the training set needs is in the store now; the older layout's state goes first
    # (without it the older files are not read), then the new index replaces the older one
    legacy = [n for n in _LEGACY if (out / n).exists()]
    for n in legacy:
        (out / n).unlink()
    tmp = out / "index.tmp.npy"
    np.save(tmp, index)
    tmp.replace(out / "index.npy")
    if legacy:
        log(f"features: the layout before row stores ({', '.join(legacy)}) removed from {out}")
    cover = top_k_coverage(store, index) if spec.top_k else 0.0
    log(f"features: {len(recs)} sequences ({len(todo)} captured in a second pass), {int(index[:, 1].sum())} "
        f"tokens, {store.width} values per token ({spec.feature_format}, {store.bytes_per_row} bytes per row)"
        + (f"; top-{spec.top_k} log-probabilities at {100 * cover:.1f} % of the response positions" if spec.top_k
           else ""))


def _training_set(out: Path, spec: DataSpec, prompts: Sequence[Prompt] | None) -> list[dict]:
    """The responses on file that the spec asks for `prompts` (None: all), in the fixed order."""
    want = None if prompts is None else wanted(spec, prompts)
    recs, seen = [], set()
    for r in _read_responses(out / "responses.jsonl"):
        rid = _rid(r)
        if (want is None or rid in want) and rid not in seen:
            seen.add(rid)
            recs.append(r)
    # a fixed pseudo-random order (by a hash of the key), so that max_sequences takes a fair sample
    recs.sort(key=_order)
    return recs[: spec.max_sequences] if spec.max_sequences else recs


def _index(store: RowStore, recs: list[dict], spec: DataSpec) -> np.ndarray:
    return np.array([[*store.refs[_rid(r)], len(r["prompt"]), round(r["temperature"] * 1000),
                      _held_out(r["key"], spec.held_out)] for r in recs], np.int64).reshape(-1, 5)


def index_shared(data: Path, spec: DataSpec, prompts: Sequence[Prompt], index_path: Path, log=print) -> None:
    """A training set (written to index_path) drawn from another run's finished data directory,
    which is only read: every response the spec asks for must be there with its rows."""
    if not (data / "rows" / "meta.json").is_file() or not (data / "responses.jsonl").is_file():
        raise ValueError(f"data {data}: no responses with rows there (a run of this version, data stage done)")
    store = RowStore.open(data / "rows")
    if store.meta["capture"] != _capture_id(spec) or store.meta["format"] != spec.feature_format \
            or store.top_k != spec.top_k:
        raise ValueError(f"data {data}: its rows were captured with other settings (target, taps, format or top-k)")
    recs = _training_set(data, spec, prompts)
    with Tokenizer(spec.target) as tok:  # (generation skipped the prompts that do not fit)
        fit = {p.key for p in prompts if fits(spec, prompt_ids(tok, p))}
    want = sum(1 for w in wanted(spec, prompts) if w[0] in fit)  # (a prompt's runs follow its place in `prompts`)
    if spec.max_sequences:
        want = min(want, spec.max_sequences)
    lacking = sum(1 for r in recs if _rid(r) not in store.refs) + max(0, want - len(recs))
    if lacking:
        raise ValueError(f"data {data}: {lacking} of the {want} sequences this run trains on are not there yet "
                         "(finish that run's data stage first)")
    tmp = index_path.with_suffix(".tmp.npy")
    np.save(tmp, _index(store, recs, spec))
    tmp.replace(index_path)
    log(f"features: {len(recs)} sequences of {data}'s data (read only)")


def top_k_coverage(store: RowStore, index: np.ndarray) -> float:
    """The fraction of the training set's response positions with the target's top-k rows (rows
    captured in a second pass, or copied from a capture without them, have none)."""
    have = total = 0
    for row, n, start in index[:, :3]:
        ids = store.top(int(row) + int(start) - 1, int(n - start))[0]
        have += int((ids[:, 0] >= 0).sum())
        total += int(n - start)
    return have / max(1, total)


class Dataset:
    """Read-only view of a data directory's training set (rows from its store, memory-mapped); a
    directory of the layout before row stores is read as it is."""

    def __init__(self, out: str | os.PathLike, index: str | os.PathLike | None = None) -> None:
        out = Path(out)
        self.index = np.load(index if index is not None else out / "index.npy")
        self.store = RowStore.open(out / "rows") if (out / "rows" / "meta.json").is_file() else None
        if self.store is not None:
            self.width = self.store.width
            self.bytes_per_token = self.store.bytes_per_row
            self.top_k = self.store.top_k
        else:
            tokens = np.load(out / "tokens.npy")
            self._tokens = tokens
            self.width = (out / "features.f16").stat().st_size // (2 * max(1, len(tokens)))
            self._features = np.memmap(out / "features.f16", np.float16, "r", shape=(max(1, len(tokens)), self.width))
            self.bytes_per_token = 2 * self.width + 4
            self.top_k = 0
        self.train_ids = [i for i in range(len(self.index)) if not self.index[i, 4]]
        self.val_ids = [i for i in range(len(self.index)) if self.index[i, 4]]

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(token ids [L], float32 features [L, width], response start)."""
        o, n, start = (int(x) for x in self.index[i, :3])
        if self.store is None:
            return self._tokens[o:o + n], np.asarray(self._features[o:o + n], np.float32), start
        return self.store.tokens(o, n), self.store.features(o, n), start

    def top(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Sequence i's top-k next-token ids [L, k] (-1 where none) and log-probabilities, or None."""
        if not self.top_k:
            return None
        o, n = (int(x) for x in self.index[i, :2])
        return self.store.top(o, n)

    @property
    def n_tokens(self) -> int:
        return int(self.index[:, 1].sum()) if len(self.index) else 0
