"""Exact mode: a target whose verify batches give bit-identical logits to one-token decoding.

Speculative decoding evaluates committed tokens as rows of verify batches; plain decoding one
per ``llama_decode``.  Where the backend's kernels round the same for both, every committed
position sees bit-identical logits, so greedy output is token-identical and a seeded sampled
run draws the same text with and without the drafter.  Exact mode loads the target with the
settings that make this possible on llama.cpp's CPU backend (``EXACT_SETTINGS``) and then
checks, not assumes, that it holds: :func:`self_check` decodes a probe both ways and compares
the logits bitwise, for every batch size the loop may verify, and the K/V those batches leave
behind (two tokens decoded after each batch must match too).  Kernels switch paths at some batch
sizes (e.g. K-quant matrix products from 4-5 rows on this CPU), so the verdict is the largest
batch that is invariant together with every smaller one; the draft length is capped below it.
The verdict is cached per (model file, settings, llama.cpp build, threads).

The drafter plays no part in exactness: it only proposes tokens, the target decides each one.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass

import llama_cpp
import numpy as np

from ..cache import JsonStore, build_id, file_id, key_of
from ..errors import DFlashError

# The settings exact mode loads a target with, on top of the caller's:
#   model:   use_extra_bufts = False  (no repacked CPU weights: one kernel family for 1 and n rows)
#   context: flash_attn_type = ENABLED (one attention path for every batch size);
#            type_k / type_v left at llama.cpp's default (f16)
EXACT_SETTINGS = {"use_extra_bufts": False, "flash_attn": True}

PROBE_PREFIX = 8   # prompt rows before the probed batch
PROBE_AFTER = 2    # one-token decodes after it (they read the batch's K/V)


@dataclass
class Verdict:
    """The self-check's result: batches of 2..max_rows rows are bit-identical to one-token
    decoding (max_rows 1: not even two rows are), and the largest logit gap of the first
    size that was not (0.0 when every probed size was)."""

    max_rows: int
    probed_rows: int
    first_diff: float
    key: str

    def describe(self) -> str:
        if self.max_rows >= self.probed_rows:
            return f"self-check passed: verify batches of up to {self.probed_rows} rows are bit-identical"
        if self.max_rows >= 2:
            return (f"self-check passed for verify batches of up to {self.max_rows} rows (a batch of "
                    f"{self.max_rows + 1} differs by {self.first_diff:.3g}): drafts capped at {self.max_rows - 1}")
        return (f"self-check failed: a 2-row batch differs from one-token decoding by {self.first_diff:.3g} "
                "(this model's kernels are not batch-invariant here)")


def _decode(ctx, toks: list[int], pos0: int, n_vocab: int, one_by_one: bool) -> np.ndarray:
    rows = []
    groups = [[t] for t in toks] if one_by_one else [toks]
    pos = pos0
    for g in groups:
        b = llama_cpp.llama_batch_init(len(g), 0, 1)
        try:
            b.n_tokens = len(g)
            for i, t in enumerate(g):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos + i, 1, 1
                b.seq_id[i][0] = 0
            if llama_cpp.llama_decode(ctx, b) != 0:
                raise DFlashError("exact-mode self-check: llama_decode failed on the probe")
            for i in range(len(g)):
                rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,)).copy())
        finally:
            llama_cpp.llama_batch_free(b)
        pos += len(g)
    return np.stack(rows)


def _probe(ctx, n_vocab: int, k: int, rng: np.random.Generator) -> float:
    """Largest |logit difference| between a k-row batch (+ PROBE_AFTER tokens after it) and
    the same tokens decoded one by one, after the same prefix."""
    mem = llama_cpp.llama_get_memory(ctx)
    toks = [int(t) for t in rng.integers(0, n_vocab, PROBE_PREFIX + k + PROBE_AFTER)]
    prefix, block, after = toks[:PROBE_PREFIX], toks[PROBE_PREFIX:PROBE_PREFIX + k], toks[PROBE_PREFIX + k:]
    out = []
    for one_by_one in (False, True):
        llama_cpp.llama_memory_clear(mem, True)
        _decode(ctx, prefix, 0, n_vocab, False)
        rows = _decode(ctx, block, PROBE_PREFIX, n_vocab, one_by_one)
        rows = np.concatenate([rows, _decode(ctx, after, PROBE_PREFIX + k, n_vocab, True)])
        out.append(rows)
    llama_cpp.llama_memory_clear(mem, True)
    a, b = out
    return 0.0 if np.array_equal(a, b) else float(np.nanmax(np.abs(a - b)))


def _cache_key(model_path: str, n_threads: int, n_rows: int) -> str:
    return key_of(*file_id(model_path), *build_id(), n_threads, n_rows, json.dumps(EXACT_SETTINGS, sort_keys=True))


def self_check(ctx, model, model_path: str | os.PathLike | None, n_rows: int, n_threads: int) -> Verdict:
    """Probe batches of 2..n_rows rows on the target context ``ctx`` (``llama_context *``, before
    its first use: its memory is cleared afterwards); cached when ``model_path`` is given."""
    n_batch = int(llama_cpp.llama_n_batch(ctx))
    if n_batch < PROBE_PREFIX:  # (llama_decode aborts the process on a batch above n_batch)
        raise DFlashError(f"exact mode needs n_batch >= {PROBE_PREFIX} for its self-check (got {n_batch})")
    n_rows = max(2, min(int(n_rows), int(llama_cpp.llama_n_ctx(ctx)) - PROBE_PREFIX - PROBE_AFTER, n_batch))
    key = _cache_key(os.fspath(model_path), n_threads, n_rows) if model_path else ""
    store = JsonStore("exact-verdicts.json")
    if key and isinstance(hit := store.get(key), dict):
        with contextlib.suppress(TypeError):  # an entry of another version: probe again
            return Verdict(**hit)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rng = np.random.default_rng(1234)
    max_rows, diff = 1, 0.0
    for k in range(2, n_rows + 1):
        diff = _probe(ctx, n_vocab, k, rng)
        if diff != 0.0:
            break
        max_rows, diff = k, 0.0
    v = Verdict(max_rows, n_rows, diff, key)
    if key:
        store.put(key, asdict(v))
    return v


def flash_attn_for(exact: bool | str, flash_attn: bool | None) -> bool | None:
    """Check an ``exact`` argument (False, True or "auto") and return the flash-attention setting
    the target must be loaded with: on for exact mode, else the caller's."""
    if exact not in (False, True, "auto"):
        raise ValueError(f"exact must be False, True or 'auto', got {exact!r}")
    if exact and flash_attn is False:
        raise ValueError("exact=True needs flash attention (flash_attn=False was passed)")
    return True if exact else flash_attn


def require(v: Verdict) -> None:
    """Exact mode cannot run on a context whose 2-row batches already differ."""
    if v.max_rows < 2:
        raise DFlashError("exact=True: " + v.describe() + "; use the default mode (divergences are then "
                          "certified as batch numerics) or another quantization type")
