"""A DFlash drafter bound to a loaded target model (thin wrapper of dflash_drafter_*)."""

from __future__ import annotations

import os

import numpy as np

from .. import _native
from .._native import ffi, lib
from ..errors import DFlashError, check_file
from ..formats.config import DrafterConfig, from_info


class Drafter(_native.Resource):
    """DFlash drafter weights + its context cache, running as our ggml graph.

    model: the target's ``llama_model *`` (ctypes pointer from llama_cpp); its
    token embedding and output head are borrowed, not copied.
    """

    def __init__(self, path: str | os.PathLike, model, n_ctx: int, n_threads: int | None = None, *,
                 generic_conv: bool = False, gathered_as_stored: bool = False, device: int | None = None) -> None:
        """generic_conv, gathered_as_stored: the same numbers by another route (``enum
        dflash_load_flags``), for tests that compare the two.  device: a ``ggml_backend_dev_t`` (an
        RPC server's: ``rpc.Cluster.device``) to hold the drafter, its cache and its graph; None:
        the CPU, or the GPU holding the target's head."""
        self._d = None
        path_b = check_file(path, "drafter")
        err = _native.err_buf()
        flags = (lib.DFLASH_LOAD_GENERIC_CONV if generic_conv else 0) | (
            lib.DFLASH_LOAD_GATHERED_AS_STORED if gathered_as_stored else 0)
        d = lib.dflash_drafter_load_on(path_b, _native.ptr("struct llama_model *", model), n_ctx,
                                       n_threads or _native.default_threads(), flags,
                                       ffi.cast("void *", device or 0), err, _native.ERR_LEN)
        if d == ffi.NULL:
            raise DFlashError(_native.err_str(err))
        self._d = d
        i = ffi.new("struct dflash_drafter_info *")
        lib.dflash_drafter_get_info(d, i)
        self.info: DrafterConfig = from_info(i)

    def memory(self) -> dict:
        """Bytes allocated by the drafter (weights, of which repacked for the CPU's multi-row kernels,
        cache, compute) and borrowed from the target."""
        m = ffi.new("struct dflash_drafter_memory *")
        lib.dflash_drafter_get_memory(self._d, m)
        return {"weights": m.weights, "repacked": m.repacked, "cache": m.cache, "compute": m.compute,
                "borrowed": m.borrowed, "borrows_embedding": bool(m.borrows_embedding),
                "borrows_head": bool(m.borrows_head)}

    @property
    def handle(self):
        return self._d

    def reset(self) -> None:
        lib.dflash_drafter_reset(self._d)

    def truncate(self, n: int) -> None:
        if lib.dflash_drafter_truncate(self._d, n) < 0:
            raise DFlashError(f"cannot truncate the drafter context to {n}")

    @property
    def n_ctx_used(self) -> int:
        return lib.dflash_drafter_n_ctx_used(self._d)

    def push(self, features: np.ndarray) -> None:
        """Queue features [rows, n_taps*n_embd] of the next committed positions."""
        f = np.ascontiguousarray(features, dtype=np.float32)
        width = len(self.info.target_layers) * self.info.n_embd
        if f.ndim != 2 or f.shape[1] != width:
            raise ValueError(f"features must have shape [rows, {width}], got {f.shape}")
        err = _native.err_buf()
        if lib.dflash_drafter_push(self._d, ffi.from_buffer("float[]", f), f.shape[0], err, _native.ERR_LEN):
            raise DFlashError(_native.err_str(err))

    def draft(self, anchor: int, n: int, return_logits: bool = False, p_min: float = 0.0,
              return_conf: bool = False):
        """Greedy draft of n tokens after `anchor` (fewer when p_min cuts it); optionally also the
        [n, vocab] logits and each drafted slot's confidence (what adaptive steps calibrate), in
        that order after the ids."""
        toks = ffi.new("int32_t[]", max(n, 1))
        logits = np.empty((max(n, 0), self.info.n_vocab), dtype=np.float32) if return_logits else None
        lp = ffi.from_buffer("float[]", logits) if return_logits and n > 0 else ffi.NULL
        conf = ffi.new("float[]", max(n, 1)) if return_conf else ffi.NULL
        err = _native.err_buf()
        got = lib.dflash_drafter_draft(self._d, anchor, n, p_min, ffi.NULL, toks, conf, lp, err, _native.ERR_LEN)
        if got < 0:
            raise DFlashError(_native.err_str(err))
        out = [list(toks[0:got])]
        if return_logits:
            out.append(logits)
        if return_conf:
            out.append([float(c) for c in conf[0:got]])
        return tuple(out) if len(out) > 1 else out[0]

    def draft_sample(self, anchor: int, n: int, temperature: float, seed: int):
        """Sampled draft at temperature > 0: (tokens, cand [n, k], q [n, k]), q being the
        proposal distribution over each slot's candidates (DFlash2: conditioned on the drafted
        predecessor)."""
        k_max = max(self.info.selector_top_k, int(lib.DFLASH_V1_SAMPLE_K))
        toks = ffi.new("int32_t[]", max(n, 1))
        cand = np.zeros((max(n, 1), k_max), np.int32)
        q = np.zeros((max(n, 1), k_max), np.float32)
        rng = ffi.new("struct dflash_rng *")
        state = np.random.SeedSequence(seed).generate_state(4, np.uint64)
        for i in range(4):
            rng.s[i] = int(state[i])
        k = ffi.new("int32_t *")
        err = _native.err_buf()
        cand_c, q_c = ffi.from_buffer("int32_t[]", cand), ffi.from_buffer("float[]", q)
        if lib.dflash_drafter_draft_sample(self._d, anchor, n, temperature, rng, ffi.NULL, toks, cand_c, q_c, k, err,
                                           _native.ERR_LEN) < 0:
            raise DFlashError(_native.err_str(err))
        kk = k[0]
        cand = cand.reshape(-1)[: n * kk].reshape(n, kk)
        q = q.reshape(-1)[: n * kk].reshape(n, kk)
        return list(toks[0:n]), cand.copy(), q.copy()

    def last_lattice(self) -> tuple[np.ndarray, np.ndarray]:
        """DFlash2: (cand [n, K], scores [n, K, K]) of the last draft; scores[k, a, b] is candidate b
        of slot k after candidate a of slot k-1 (slot 0: after the anchor)."""
        return _read_lattice(self.info, lambda c, s: lib.dflash_drafter_last_lattice(self._d, c, s))

    def new_state(self) -> DrafterState:
        """A further sequence's context (the methods above use the drafter's own)."""
        return DrafterState(self)

    def draft_batch(self, states: list[DrafterState], anchors: list[int], n: int, return_logits: bool = False):
        """Greedy drafts of n tokens for several sequences in one graph: [n_seq][n] ids
        (and [n_seq, n, vocab] logits)."""
        if len(states) != len(anchors):
            raise ValueError("one anchor per state")
        arr = ffi.new("dflash_state *[]", [st._st for st in states])
        toks = ffi.new("int32_t[]", max(1, n * len(states)))
        logits = np.empty((len(states), n, self.info.n_vocab), np.float32) if return_logits else None
        lp = ffi.from_buffer("float[]", logits) if return_logits else ffi.NULL
        err = _native.err_buf()
        if lib.dflash_drafter_draft_batch(self._d, arr, len(states), ffi.new("int32_t[]", list(anchors)), n, toks, lp,
                                          err, _native.ERR_LEN) < 0:
            raise DFlashError(_native.err_str(err))
        ids = [list(toks[s * n:(s + 1) * n]) for s in range(len(states))]
        return (ids, logits) if return_logits else ids

    def close(self) -> None:
        if self._d is not None:
            lib.dflash_drafter_free(self._d)
            self._d = None


class DrafterState:
    """One more sequence's drafter context (cache of committed positions + queued features)."""

    def __init__(self, drafter: Drafter) -> None:
        err = _native.err_buf()
        st = lib.dflash_state_new(drafter.handle, err, _native.ERR_LEN)
        if st == ffi.NULL:
            raise DFlashError(_native.err_str(err))
        self._st = ffi.gc(st, lib.dflash_state_free)
        self.drafter = drafter  # the state must not outlive its drafter

    def push(self, features: np.ndarray) -> None:
        f = np.ascontiguousarray(features, dtype=np.float32)
        err = _native.err_buf()
        if lib.dflash_state_push(self._st, ffi.from_buffer("float[]", f), f.shape[0], err, _native.ERR_LEN):
            raise DFlashError(_native.err_str(err))

    @property
    def n_ctx_used(self) -> int:
        return lib.dflash_state_n_ctx_used(self._st)

    def last_lattice(self) -> tuple[np.ndarray, np.ndarray]:
        return _read_lattice(self.drafter.info, lambda c, s: lib.dflash_state_last_lattice(self._st, c, s))


def _read_lattice(info: DrafterConfig, call) -> tuple[np.ndarray, np.ndarray]:
    if info.version != 2:
        raise DFlashError("only DFlash2 drafters have a candidate lattice")
    K = info.selector_top_k
    cand = np.empty((info.block_size, K), np.int32)
    scores = np.empty((info.block_size, K, K), np.float32)
    n = call(ffi.from_buffer("int32_t[]", cand), ffi.from_buffer("float[]", scores))
    if n < 0:
        raise DFlashError("the last draft walked its lattice on the CUDA device: its scores stayed there")
    return cand[:n].copy(), scores[:n].copy()


def cuda_devices() -> int:
    """CUDA devices this build of the core can use (0 in a CPU build or without a device)."""
    return int(lib.dflash_cuda_devices())


def walk_lattice(cand: np.ndarray, scores: np.ndarray, *, temperature: float = 0.0, seed: int = 0,
                 p_min: float = 0.0, on_cuda: bool = False) -> tuple[list[int], np.ndarray]:
    """One DFlash2 walk of a lattice (cand [n, K], scores [n, K, K]) by the core's host code or by
    its CUDA twin (on_cuda): the drafted ids and, sampled (temperature > 0, generator seeded with
    `seed`), each slot's proposal q [n, K], else greedy (cut at p_min) each slot's confidence [n]."""
    cand = np.ascontiguousarray(cand, np.int32)
    scores = np.ascontiguousarray(scores, np.float32)
    n, K = cand.shape
    if scores.shape != (n, K, K):
        raise ValueError(f"scores must be [n, K, K] = [{n}, {K}, {K}], got {list(scores.shape)}")
    toks = np.zeros(n, np.int32)
    q = np.zeros((n, K), np.float32)
    conf = np.zeros(n, np.float32)
    err = _native.err_buf()
    got = lib.dflash_walk_lattice(int(on_cuda), ffi.from_buffer("int32_t[]", cand), ffi.from_buffer("float[]", scores),
                                  n, K, temperature, seed, p_min, ffi.from_buffer("int32_t[]", toks),
                                  ffi.from_buffer("float[]", q), ffi.from_buffer("float[]", conf), err,
                                  _native.ERR_LEN)
    if got < 0:
        raise DFlashError(_native.err_str(err))
    return toks[:got].tolist(), (q[:got] if temperature > 0 else conf[:got])
