"""Exact mode: a target whose verify batches give bit-identical logits to one-token decoding.

Speculative decoding evaluates committed tokens as rows of verify batches; plain decoding one
per ``llama_decode``.  Where the backend's kernels round the same for both, every committed
position sees bit-identical logits, so greedy output is token-identical and a seeded sampled
run draws the same text with and without the drafter.  Exact mode loads the target with the
settings that make this possible on llama.cpp's CPU backend (flash attention, the weight layout
:func:`weight_layout` picks, ggml's reference kernels: :func:`settings`, :func:`reference_kernels`)
and then checks, not assumes, that it holds: :func:`self_check` decodes a probe both ways and
compares the logits bitwise, for every batch size the loop may verify (after a short prefix; the
smallest and largest also after a long one), and the K/V those batches leave behind (two tokens
decoded after each batch must match too).  Kernels switch paths at some batch sizes (e.g.
repacked K-quant matrix products from 4 rows on this CPU), so the verdict is the largest batch
that is invariant together with every smaller one; the draft length is capped below it.  The
verdict is cached per (model file, settings, llama.cpp build, threads).

On a recurrent / hybrid target (a context with ``n_rs_seq`` recurrent-state snapshots) a step's
rejected rows are rolled back by restoring the snapshot after its last kept row; the self-check
then also checks that several such rollbacks in a row leave the next logits bit-identical to a
fresh one-token decode of the kept tokens (:func:`_rollback_probe`).

The drafter plays no part in exactness: it only proposes tokens, the target decides each one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import llama_cpp
import numpy as np

from .. import _native, options
from ..cache import JsonStore, build_id, file_id, key_of
from ..errors import DFlashError

# The settings exact mode loads a target with, on top of the caller's:
#   context: flash_attn_type = ENABLED (one attention path for every batch size);
#            type_k / type_v left at llama.cpp's default (f16)
#   model:   use_extra_bufts = the layout `weight_layout` picks: llama.cpp's repacked CPU weights
#            (its default; they run 2-3 rows as one-row products and 4+ through another kernel)
#            or the plain layout, whichever stays bit-invariant up to more rows (repacked on a
#            tie).  With the reference kernels below, on this CPU both stay invariant up to 16 rows
#            for every quantized type but these: IQ4_NL only repacked, Q3_K_M / Q4_K_M repacked only
#            up to 3 (plain: 16); F16 / BF16 in neither; bench/bench_exact.py, "invariance".
#   backend: ggml's reference CPU kernels (`reference_kernels`): past 256 positions the optimized
#            one-token flash attention splits the KV across threads and rounds apart from a batch.
EXACT_SETTINGS = {"use_extra_bufts": False, "flash_attn": True, "reference_kernels": True}  # the plain layout's
PROBE_ROWS = 16  # batches probed: drafts of up to 15

PROBE_PREFIX = 8   # prompt rows before the probed batch
PROBE_AFTER = 2    # one-token decodes after it (they read the batch's K/V)
PROBE_LONG = 300   # a second prefix, past 256 positions: the KV view then spans 512 cells, where
#                    llama.cpp's optimized one-token flash attention splits the KV across threads
PROBE_VERSION = 3  # 3: the long-context probe, both layouts probed (older verdicts are probed again)


@dataclass
class Verdict:
    """The self-check's result: batches of 2..max_rows rows are bit-identical to one-token
    decoding (max_rows 1: not even two rows are), and the largest logit gap of the first
    size that was not (0.0 when every probed size was)."""

    max_rows: int
    probed_rows: int
    first_diff: float
    key: str
    repacked: bool = False  # the target's weights in llama.cpp's repacked CPU layout
    at_position: int = PROBE_PREFIX  # where the first batch that differed started
    rollback: bool = False  # the batches were invariant but a rollback of recurrent state was not

    def describe(self) -> str:
        if self.rollback:
            return (f"self-check failed: after rolling back rejected rows the next logits differ from a fresh "
                    f"decode by {self.first_diff:.3g} (the recurrent state's snapshots do not restore exactly)")
        if self.max_rows >= self.probed_rows:
            return f"self-check passed: verify batches of up to {self.probed_rows} rows are bit-identical"
        if self.max_rows >= 2:
            where = f" at position {self.at_position}" if self.at_position != PROBE_PREFIX else ""
            return (f"self-check passed for verify batches of up to {self.max_rows} rows (a batch of "
                    f"{self.max_rows + 1}{where} differs by {self.first_diff:.3g}): drafts capped at "
                    f"{self.max_rows - 1}")
        where = f" at position {self.at_position}" if self.at_position != PROBE_PREFIX else ""
        return (f"self-check failed: a 2-row batch{where} differs from one-token decoding by {self.first_diff:.3g} "
                "(this model's kernels are not batch-invariant here)")


def _decode_rows(ctx, items: list[tuple[int, int, int]], n_vocab: int) -> np.ndarray:
    """One llama_decode of (sequence, token, position) rows; every row's logits."""
    b = llama_cpp.llama_batch_init(len(items), 0, 1)
    try:
        b.n_tokens = len(items)
        for i, (seq, t, pos) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, 1
            b.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise DFlashError("exact-mode self-check: llama_decode failed on a probe batch")
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,)).copy()
                         for i in range(len(items))])
    finally:
        llama_cpp.llama_batch_free(b)


def _decode(ctx, toks: list[int], pos0: int, n_vocab: int, one_by_one: bool) -> np.ndarray:
    """Sequence 0's tokens from pos0, in one batch or one by one: every row's logits."""
    groups = [[t] for t in toks] if one_by_one else [toks]
    rows, pos = [], pos0
    for g in groups:
        rows.append(_decode_rows(ctx, [(0, t, pos + i) for i, t in enumerate(g)], n_vocab))
        pos += len(g)
    return np.concatenate(rows)


def _probe(ctx, n_vocab: int, k: int, rng: np.random.Generator, n_prefix: int = PROBE_PREFIX) -> float:
    """Largest |logit difference| between a k-row batch (+ PROBE_AFTER tokens after it) and
    the same tokens decoded one by one, after the same n_prefix-token prefix (decoded in chunks
    of n_batch from position 0, as exact mode prefills)."""
    mem = llama_cpp.llama_get_memory(ctx)
    n_batch = int(llama_cpp.llama_n_batch(ctx))
    toks = [int(t) for t in rng.integers(0, n_vocab, n_prefix + k + PROBE_AFTER)]
    prefix, block, after = toks[:n_prefix], toks[n_prefix:n_prefix + k], toks[n_prefix + k:]
    out = []
    for one_by_one in (False, True):
        llama_cpp.llama_memory_clear(mem, True)
        for c in range(0, n_prefix, n_batch):
            _decode(ctx, prefix[c:c + n_batch], c, n_vocab, False)
        rows = _decode(ctx, block, n_prefix, n_vocab, one_by_one)
        rows = np.concatenate([rows, _decode(ctx, after, n_prefix + k, n_vocab, True)])
        out.append(rows)
    llama_cpp.llama_memory_clear(mem, True)
    a, b = out
    return 0.0 if np.array_equal(a, b) else float(np.nanmax(np.abs(a - b)))


PROBE_ROLLBACK_STEPS = 3  # verify batches rolled back in a row before the compared decodes


def _rollback_probe(ctx, n_vocab: int, k: int, n_rs_seq: int, rng: np.random.Generator) -> float:
    """Largest |logit difference| between PROBE_AFTER one-token decodes after PROBE_ROLLBACK_STEPS
    k-row batches each rolled back to its first ``keep`` rows (as many rejected rows as the
    snapshots allow, then one), and the same decodes after a fresh prefix + the kept tokens one by
    one: bitwise 0.0 when the snapshots restore the recurrent state exactly."""
    if n_rs_seq < 1 or k < 2:
        return 0.0
    mem = llama_cpp.llama_get_memory(ctx)
    worst = 0.0
    for keep in sorted({max(1, k - n_rs_seq), k - 1}):
        steps = [[int(t) for t in rng.integers(0, n_vocab, k)] for _ in range(PROBE_ROLLBACK_STEPS)]
        prefix = [int(t) for t in rng.integers(0, n_vocab, PROBE_PREFIX)]
        after = [int(t) for t in rng.integers(0, n_vocab, PROBE_AFTER)]
        kept = [t for s in steps for t in s[:keep]]
        llama_cpp.llama_memory_clear(mem, True)
        _decode(ctx, prefix, 0, n_vocab, False)
        pos = PROBE_PREFIX
        for s in steps:
            _decode(ctx, s, pos, n_vocab, False)
            pos += keep
            if not llama_cpp.llama_memory_seq_rm(mem, 0, pos, -1):
                raise DFlashError(f"exact-mode self-check: the target could not roll back {k - keep} rows")
        rolled = _decode(ctx, after, pos, n_vocab, True)
        llama_cpp.llama_memory_clear(mem, True)
        _decode(ctx, prefix, 0, n_vocab, False)
        _decode(ctx, kept, PROBE_PREFIX, n_vocab, True)
        fresh = _decode(ctx, after, pos, n_vocab, True)
        if not np.array_equal(rolled, fresh):
            worst = max(worst, float(np.nanmax(np.abs(rolled - fresh))))
    llama_cpp.llama_memory_clear(mem, True)
    return worst


def reference_kernels(ctx, on: bool = True) -> int:
    """Put the target context's CPU backends into ggml's reference kernels, or back
    (``dflash_context_reference_kernels``): the number of CPU backends set, -1 if unsupported."""
    return int(_native.lib.dflash_context_reference_kernels(_native.ptr("struct llama_context *", ctx), on))


def settings(repacked: bool) -> dict:
    """The model and context settings of exact mode with the given weight layout."""
    return {**EXACT_SETTINGS, "use_extra_bufts": bool(repacked)}


def _cache_key(model_path: str, n_threads: int, n_rows: int, repacked: bool, long: bool, placement: str = "",
               n_rs_seq: int = 0) -> str:
    return key_of(*file_id(model_path), *build_id(), n_threads, n_rows,
                  json.dumps(settings(repacked), sort_keys=True), PROBE_VERSION, long,
                  *([placement] if placement else []), *([f"n_rs_seq={n_rs_seq}"] if n_rs_seq else []))


def _max_rows(ctx, model, n_rows: int) -> tuple[int, float, int]:
    """The largest k <= n_rows such that batches of 2..k rows are bit-identical to one-token
    decoding -- after a short prefix, and (the smallest and the largest of them) after a long one
    where the context holds it -- with the logit gap and the position of the first batch that was
    not (0.0 and PROBE_PREFIX when none)."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rng = np.random.default_rng(1234)
    max_rows = 1
    for k in range(2, n_rows + 1):
        diff = _probe(ctx, n_vocab, k, rng)
        if diff != 0.0:
            return max_rows, diff, PROBE_PREFIX
        max_rows = k
    if _reaches_long(ctx, n_rows):
        for k in sorted({2, max_rows}):
            diff = _probe(ctx, n_vocab, k, rng, PROBE_LONG)
            if diff != 0.0:
                return k - 1, diff, PROBE_LONG
    return max_rows, 0.0, PROBE_PREFIX


def _joint_probe(gctx, ctx, n_vocab: int, n_seq: int, rows: int, rng: np.random.Generator, long: bool) -> float:
    """Largest |logit difference| between n_seq sequences verified together in the group context
    ``gctx`` (after prefixes of different lengths, each prefilled alone as a request's prompt is: a
    joint batch of ``rows`` rows each, in ascending sequence order as the C loop lays them out,
    then PROBE_AFTER joint one-row steps that read its K/V) and each sequence's same tokens
    decoded one by one in the single-sequence context ``ctx``: plain decoding."""
    n_batch = min(int(llama_cpp.llama_n_batch(gctx)), int(llama_cpp.llama_n_batch(ctx)))
    base = PROBE_LONG if long else PROBE_PREFIX
    prefix = [[int(t) for t in rng.integers(0, n_vocab, base + 3 * s)] for s in range(n_seq)]
    tail = [[int(t) for t in rng.integers(0, n_vocab, rows + PROBE_AFTER)] for _ in range(n_seq)]

    def prefill(c, seq: int, toks: list[int]) -> None:
        for c0 in range(0, len(toks), n_batch):
            _decode_rows(c, [(seq, t, c0 + i) for i, t in enumerate(toks[c0:c0 + n_batch])], n_vocab)

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(gctx), True)
    for s in range(n_seq):
        prefill(gctx, s, prefix[s])
    joint = _decode_rows(gctx, [(s, tail[s][j], len(prefix[s]) + j) for s in range(n_seq) for j in range(rows)],
                         n_vocab).reshape(n_seq, rows, n_vocab)
    after = [_decode_rows(gctx, [(s, tail[s][rows + a], len(prefix[s]) + rows + a) for s in range(n_seq)], n_vocab)
             for a in range(PROBE_AFTER)]
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(gctx), True)
    worst = 0.0
    mem = llama_cpp.llama_get_memory(ctx)
    for s in range(n_seq):
        llama_cpp.llama_memory_clear(mem, True)
        prefill(ctx, 0, prefix[s])
        alone = np.concatenate([_decode_rows(ctx, [(0, t, len(prefix[s]) + j)], n_vocab)
                                for j, t in enumerate(tail[s])])
        got = np.concatenate([joint[s], np.stack([a[s] for a in after])])
        if not np.array_equal(got, alone):
            worst = max(worst, float(np.nanmax(np.abs(got - alone))))
    llama_cpp.llama_memory_clear(mem, True)
    return worst


def joint_check(gctx, ctx, model, model_path: str | os.PathLike | None, n_seq: int, max_rows: int,
                n_threads: int, repacked: bool) -> float:
    """Whether joint batches of the group context ``gctx`` (up to ``n_seq`` sequences, at most
    ``max_rows`` rows in all: the rows the single-sequence self-check proved invariant) round as
    plain decoding in ``ctx`` does: the largest logit gap found (0.0: bit-identical).  Probed with
    2 and n_seq sequences, one row each and as many as fit, after short prefixes and, where both
    contexts hold them, long ones; cached like the self-check."""
    per_seq = min(int(llama_cpp.llama_n_ctx(gctx)) // max(n_seq, 1), int(llama_cpp.llama_n_ctx(ctx)))
    seqs = sorted({2, min(n_seq, max_rows)})
    longs = (False, True) if per_seq >= PROBE_LONG + 3 * n_seq + max_rows + PROBE_AFTER else (False,)
    key = key_of("joint", *file_id(os.fspath(model_path)), *build_id(), n_threads, n_seq, max_rows,
                 json.dumps(settings(repacked), sort_keys=True), PROBE_VERSION, len(longs)) if model_path else ""
    store = JsonStore("exact-verdicts.json")
    if key and isinstance(hit := store.get(key), float):
        return hit
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rng = np.random.default_rng(4321)
    worst = 0.0
    for long in longs:
        for s in seqs:
            for r in sorted({1, max_rows // s}):
                if s * r <= max_rows and PROBE_PREFIX + 3 * s + r + PROBE_AFTER <= per_seq:
                    worst = max(worst, _joint_probe(gctx, ctx, n_vocab, s, r, rng, long))
    if key:
        store.put(key, worst)
    return worst


def _reaches_long(ctx, n_rows: int) -> bool:
    """Whether the context holds the long probe (llama.cpp sizes contexts in multiples of 256, and
    one of 256 never spans the 512-cell KV view the long probe is for)."""
    return int(llama_cpp.llama_n_ctx(ctx)) >= PROBE_LONG + n_rows + PROBE_AFTER


_layouts: dict[str, bool] = {}  # this process's picks: the loader and the engine core agree


def weight_layout(model_path: str | os.PathLike, n_threads: int | None = None, n_gpu_layers: int = 0) -> bool:
    """Whether exact mode loads this target with llama.cpp's repacked CPU weights (True) or the
    plain layout (False): the one whose batches stay bit-invariant up to more rows (probed up to
    ``PROBE_ROWS`` on a throw-away load of each), the repacked one on a tie.  Repacked weights are
    llama.cpp's default because they are faster: on this CPU at every batch size measured (Q4_0
    one token 9.2 ms against 11.5; Qwen2.5-Coder-1.5B Q4_K_M 62 against 82 ms;
    bench/bench_exact.py, "cost"), and Q4_0, Q8_0 and the other legacy types stay invariant up to
    16 rows either way.  Q3_K_M / Q4_K_M stay invariant longer in the plain layout (16 rows against
    3: longer drafts, and room for concurrent requests in a joint batch), IQ4_NL only repacked.
    Offloaded layers never repack: False.  Where the small-batch kernels take every weight's
    products (csrc/kernels: the quantized types of Q4_0, Q8_0, Q4_K_M and Q5_K_M files), both
    layouts run the same batch-invariant kernels in exact mode and the repacked one is kept
    without probing (the probes were most of a first load's cost).  Cached per (model file,
    llama.cpp build, threads); the engine's own self-check still decides what the loaded target
    may verify."""
    path = os.fspath(model_path)
    if n_gpu_layers or not os.path.isfile(path):  # (a missing file: the caller's own load reports it)
        return False
    if _kernels_take_every_product(path):
        return True  # (both layouts read by the same batch-invariant kernels: no probe to tell them apart)
    n_threads = n_threads or _native.default_threads()
    key = key_of("layout", *file_id(path), *build_id(), n_threads, json.dumps(EXACT_SETTINGS), PROBE_VERSION)
    if key in _layouts:
        return _layouts[key]
    store = JsonStore("exact-verdicts.json")
    hit = store.get(key)
    if not isinstance(hit, bool):
        rows = {repacked: _probe_layout(path, n_threads, repacked) for repacked in (True, False)}
        if None in rows.values():  # not loadable: the caller's own load reports why
            return False
        hit = rows[True] >= rows[False]
        store.put(key, hit)
    _layouts[key] = hit
    return hit


def _kernels_take_every_product(path: str) -> bool:
    """Whether the small-batch kernels take the products of every weight of this GGUF (each matrix's
    type one they read, in either layout); they then run every row count in exact mode, so both
    layouts round alike and the faster repacked one is kept without probing."""
    # (the header only, read in C: a Python reader spends seconds on a 262k-token vocabulary; an
    # unreadable file is probed as before, and its load reports it)
    return _native.lib.dflash_kernels_take_file(os.fsencode(path)) == 1


def _probe_layout(path: str, n_threads: int, repacked: bool) -> int | None:
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = repacked
    try:
        model = _native.load_model(path, mp)
    except DFlashError:
        return None
    try:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 64, 64  # (room for the long probe)
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.no_perf = True
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        try:
            ctx = _native.new_context(model, cp)
        except DFlashError:
            return None
        try:
            reference_kernels(ctx)
            return _max_rows(ctx, model, PROBE_ROWS)[0]
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)


def _cached(key: str) -> Verdict | None:
    if key and isinstance(hit := JsonStore("exact-verdicts.json").get(key), dict):
        with contextlib.suppress(TypeError):  # an entry of another version: probe again
            return Verdict(**hit)
    return None


def self_check(ctx, model, model_path: str | os.PathLike | None, n_rows: int, n_threads: int,
               repacked: bool = False, placement: str = "", healthy: Callable[[], bool] | None = None) -> Verdict:
    """Probe batches of 2..n_rows rows on the target context ``ctx`` (``llama_context *``, before
    its first use: its memory is cleared afterwards), loaded with the weight layout ``repacked``;
    cached when ``model_path`` is given (per ``placement`` too: offloaded layers, rpc servers) and
    ``healthy`` (if given) still holds after the probes: a verdict measured while an rpc server was
    lost compared garbage, and is returned for this load (which fails) but never kept."""
    n_batch = int(llama_cpp.llama_n_batch(ctx))
    if n_batch < PROBE_PREFIX:  # (llama_decode aborts the process on a batch above n_batch)
        raise DFlashError(f"exact mode needs n_batch >= {PROBE_PREFIX} for its self-check (got {n_batch})")
    n_rows = max(2, min(int(n_rows), int(llama_cpp.llama_n_ctx(ctx)) - PROBE_PREFIX - PROBE_AFTER, n_batch))
    n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx))
    key = _cache_key(os.fspath(model_path), n_threads, n_rows, repacked, _reaches_long(ctx, n_rows),
                     placement, n_rs_seq) if model_path else ""
    if (v := _cached(key)) is not None:
        return v
    max_rows, diff, at = _max_rows(ctx, model, n_rows)
    v = Verdict(max_rows, n_rows, diff, key, bool(repacked), at)
    if max_rows >= 2 and n_rs_seq > 0:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        # (the probe's prefix, steps and decodes after them fit the probe context: PROBE_CTX)
        rb = _rollback_probe(ctx, n_vocab, max_rows, n_rs_seq, np.random.default_rng(99))
        if rb != 0.0:
            v = Verdict(1, n_rows, rb, key, bool(repacked), PROBE_PREFIX, rollback=True)
    if key and (healthy is None or healthy()):
        JsonStore("exact-verdicts.json").put(key, asdict(v))
    return v


PROBE_CTX = 512  # the probe context: holds the long probe and every verify batch in one ubatch


def self_check_for(cparams, model, model_path: str | os.PathLike | None, n_rows: int, n_threads: int,
                   repacked: bool = False, placement: str = "", healthy: Callable[[], bool] | None = None) -> Verdict:
    """The self-check for a target context to be created with ``cparams`` (before it exists): run
    on a probe context of the same settings and PROBE_CTX positions, so that its verdict covers any
    context of these settings (the probe's prefixes are decoded alike both ways); a cached verdict
    needs no probe context at all."""
    n_rows = max(2, min(int(n_rows), PROBE_CTX - PROBE_PREFIX - PROBE_AFTER))  # (as self_check clamps it)
    long = PROBE_CTX >= PROBE_LONG + n_rows + PROBE_AFTER  # (as _reaches_long finds it on that context)
    key = _cache_key(os.fspath(model_path), n_threads, n_rows, repacked, long, placement,
                     int(cparams.n_rs_seq)) if model_path else ""
    if (v := _cached(key)) is not None:
        return v
    cp = type(cparams).from_buffer_copy(cparams)
    cp.n_ctx = cp.n_batch = cp.n_ubatch = PROBE_CTX
    cp.n_seq_max = 1
    cp.cb_eval = llama_cpp.ggml_backend_sched_eval_callback()  # (not the capture's)
    cp.cb_eval_user_data = None
    ctx = _native.new_context(model, cp, "a context for exact mode's self-check")
    try:
        reference_kernels(ctx)  # (-1, unsupported: the self-check's long probe then fails)
        return self_check(ctx, model, model_path, n_rows, n_threads, repacked, placement, healthy)
    finally:
        reference_kernels(ctx, False)
        llama_cpp.llama_free(ctx)


def flash_attn_for(exact: bool | str, flash_attn: bool | None) -> bool | None:
    """Check an ``exact`` argument (False, True or "auto") and return the flash-attention setting
    the target must be loaded with: on for exact mode, else the caller's."""
    exact = options.check("exact", exact)
    if exact is True and flash_attn is False:
        raise ValueError("exact=True needs flash attention (flash_attn=False was passed)")
    return True if exact and flash_attn is not False else flash_attn


@dataclass(frozen=True)
class LoadSettings:
    """What exact mode changes in a target's load: flash attention (None: llama.cpp's default),
    the weight layout (``use_extra_bufts``; None: the caller's), and exact mode as it will run
    (``exact``: False with the reason in ``off`` when "auto" met a setting that rules it out)."""

    flash_attn: bool | None
    repacked: bool | None
    exact: bool | str = False
    off: str = ""
    asked_flash_attn: bool | None = None  # the caller's (the context's when "auto" falls back)

    def apply(self, mparams) -> None:
        """Set the layout on a ``llama_model_params`` before the model loads."""
        if self.repacked is not None:
            mparams.use_extra_bufts = self.repacked


def load_settings(exact: bool | str, model_path: str | os.PathLike, flash_attn: bool | None = None,
                  n_threads: int | None = None, n_gpu_layers: int = 0) -> LoadSettings:
    """The one place exact mode's load settings are decided (every loader asks here)."""
    asked = flash_attn
    flash_attn = flash_attn_for(exact, flash_attn)
    if exact == "auto" and flash_attn is False:
        return LoadSettings(False, None, False, "flash_attn=False was asked for (exact mode needs flash attention)",
                            asked)
    if not exact:
        return LoadSettings(flash_attn, None, asked_flash_attn=asked)
    return LoadSettings(flash_attn, weight_layout(model_path, n_threads, n_gpu_layers), exact, asked_flash_attn=asked)


def require(v: Verdict) -> None:
    """Exact mode cannot run on a context whose 2-row batches already differ."""
    if v.max_rows < 2:
        raise DFlashError("exact=True: " + v.describe() + "; use the default mode (divergences are then "
                          "certified as batch numerics) or another quantization type")
