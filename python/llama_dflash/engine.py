"""Target + drafter loading and speculative generation (the C loop behind a small API)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np
from llama_cpp import _logger

from . import _native
from ._native import ffi, lib
from .drafter import DFlashError, Drafter, DrafterInfo, check_file
from .sampling import MODE_NAMES, SamplingParams, grammar_params, verification
from .stats import SpecStats

DraftSource = Callable[[Sequence[int], int], Sequence[int]]
"""An external drafter: (committed tokens, last = anchor; n) -> up to n proposed tokens."""

StepCallback = Callable[[dict], None]

_CAPTURE_MODES = {"auto": 0, "layer_inp": 1, "cb_eval": 2}


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: SpecStats
    margins: list[float] | None = None
    """Per generated token: target top-1 minus top-2 logit at the row that produced it."""


@dataclass
class _Request:
    tokens: list[int]
    draft_len: int
    drafter_kind: str
    params: object = None
    prompt_c: object = None
    errors: list = field(default_factory=list)

    def check(self, rc: int, err) -> None:
        """Raise what went wrong: a Python callback's exception first, else the core's message."""
        if self.errors:
            raise self.errors[0]
        if rc < 0:
            raise DFlashError(_native.err_str(err))

    def stats(self, st) -> SpecStats:
        s = SpecStats.from_c(st, self.draft_len, self.drafter_kind)
        s.mode = MODE_NAMES[st.mode]
        return s


def engine_steps(engine, tokens: list[int], params, check: Callable[[int, object], None]) -> Iterator[list[int]]:
    """Drive a C engine step by step: the prefill's token, then each verify step's tokens."""
    err = _native.err_buf()
    first = lib.dflash_engine_start(engine, ffi.new("int32_t[]", tokens), len(tokens), params, ffi.NULL, err,
                                    _native.ERR_LEN)
    check(first, err)
    yield [first]
    buf = ffi.new("int32_t[]", int(lib.DFLASH_MAX_DRAFT) + 1)
    while (n := lib.dflash_engine_step(engine, buf, ffi.NULL, err, _native.ERR_LEN)) != 0:
        check(n, err)
        yield list(buf[0:n])


class SpeculativeGenerator(_native.Resource):
    """A target model (GGUF) with an optional DFlash drafter (GGUF).

    Without a drafter it decodes plainly through the same loop, which makes
    side-by-side comparisons exact.  ``capture`` forces a feature-capture path
    ("layer_inp" or "cb_eval"); "auto" picks the one the target supports.
    ``capture_layers`` turns capture on without a drafter (HF layer ids), for
    measuring its cost or producing training features.  ``flash_attn``
    defaults to off, like ``llama_cpp.Llama``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        drafter_path: str | os.PathLike | None = None,
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        capture: str = "auto",
        capture_layers: Sequence[int] | None = None,
        flash_attn: bool = False,
        verbose: bool | None = False,
    ) -> None:
        self._model = self._ctx = self._drafter = self._capture = self._engine = None
        self.last_stats: SpecStats | None = None
        if capture not in _CAPTURE_MODES:
            raise ValueError(f"capture must be one of {sorted(_CAPTURE_MODES)}, got {capture!r}")
        if n_ctx < 1 or n_batch < 1:
            raise ValueError("n_ctx and n_batch must be positive")
        self.n_threads = n_threads or _native.default_threads()
        self.n_ctx = n_ctx
        model_b = check_file(model_path, "target model")
        if drafter_path is not None:
            check_file(drafter_path, "drafter")
        if verbose is not None:  # None: leave llama.cpp's log level as the caller set it
            _logger.set_verbose(verbose)
        llama_cpp.llama_backend_init()

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(model_b, mparams)
        if not self._model:
            raise DFlashError(f"cannot load target model {os.fspath(model_path)!r} (not a valid GGUF model?)")
        model_c = _native.ptr("struct llama_model *", self._model)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        err = _native.err_buf()

        self.drafter_info: DrafterInfo | None = None
        taps: list[int] = list(capture_layers or [])
        if drafter_path is not None:
            try:
                self._drafter = Drafter(drafter_path, self._model, n_ctx, self.n_threads)
            except BaseException:
                self.close()
                raise
            self.drafter_info = self._drafter.info
            taps = list(self.drafter_info.target_layers)

        if taps:
            arr = ffi.new("int32_t[]", taps)
            c = lib.dflash_capture_new(model_c, arr, len(taps), n_batch, _CAPTURE_MODES[capture], err,
                                       _native.ERR_LEN)
            if c == ffi.NULL:
                self.close()
                raise DFlashError(_native.err_str(err))
            self._capture = c
            self.capture_mode = {1: "layer_inp", 2: "cb_eval"}[lib.dflash_capture_mode(c)]
        else:
            self.capture_mode = "none"

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        # Same default as llama_cpp.Llama, so plain outputs are comparable.
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if self._capture is not None:
            lib.dflash_capture_install(self._capture, _native.ptr("void *", cparams))
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise DFlashError(f"cannot create a context with n_ctx={n_ctx}, n_batch={n_batch}")
        ctx_c = _native.ptr("struct llama_context *", self._ctx)
        if self._capture is not None and lib.dflash_capture_attach(self._capture, ctx_c, err, _native.ERR_LEN) != 0:
            self.close()
            raise DFlashError(_native.err_str(err))
        d_c = self._drafter.handle if self._drafter else ffi.NULL
        e = lib.dflash_engine_new(ctx_c, d_c, self._capture or ffi.NULL, err, _native.ERR_LEN)
        if e == ffi.NULL:
            self.close()
            raise DFlashError(_native.err_str(err))
        self._engine = e

    # -- info ---------------------------------------------------------------

    @property
    def max_draft_len(self) -> int:
        return self.drafter_info.block_size - 1 if self.drafter_info else int(lib.DFLASH_MAX_DRAFT)

    # -- text ---------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text; special tokens written in the text (chat markers) are parsed,
        as llama_cpp.Llama.create_completion does."""
        return _native.tokenize(self._vocab, text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            n = llama_cpp.llama_token_to_piece(self._vocab, int(t), buf, len(buf), 0, False)
            if n > 0:
                out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    # -- generation -----------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        *,
        draft_len: int | None = None,
        draft_source: DraftSource | None = None,
        stop_on_eos: bool = True,
        return_margins: bool = False,
        on_step: StepCallback | None = None,
        sampling: SamplingParams | None = None,
        p_min: float = 0.0,
        reuse_prefix: bool = False,
    ) -> GenerationResult:
        """Speculative generation whose output is distributed exactly as plain decoding's.

        Greedy by default (token-identical to plain greedy decoding).  With
        ``sampling`` at temperature > 0, mode "match" samples every verify row with
        the request's llama.cpp sampler chain (same seed => same text as plain
        decoding); mode "rejection" uses speculative rejection sampling with the
        drafter's proposal q (higher acceptance, same distribution, different
        random stream).  draft_len: tokens drafted per step (default: the
        drafter's block - 1; 0 decodes plainly).  p_min cuts a greedy / match
        draft at its first slot less confident than p_min.  draft_source
        replaces the DFlash drafter with a Python callable.  on_step receives
        each step's cache state.  reuse_prefix keeps the previous generation's
        KV / drafter cache for the common prefix (a chat's earlier turns) and
        prefills only the rest.
        """
        with self._request(prompt, max_tokens, draft_len, draft_source, stop_on_eos, on_step, sampling,
                           p_min, reuse_prefix) as rq:
            out = ffi.new("int32_t[]", max_tokens)
            margins = ffi.new("float[]", max_tokens) if return_margins else ffi.NULL
            st = ffi.new("struct dflash_stats *")
            err = _native.err_buf()
            n = lib.dflash_engine_generate(self._engine, rq.prompt_c, len(rq.tokens), rq.params, out, margins, st,
                                           err, _native.ERR_LEN)
            rq.check(n, err)
            toks = list(out[0:n])
            stats = rq.stats(st)
        return GenerationResult(tokens=toks, text=self.detokenize(toks), stats=stats,
                                margins=list(margins[0:n]) if return_margins else None)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        *,
        draft_len: int | None = None,
        draft_source: DraftSource | None = None,
        stop_on_eos: bool = True,
        sampling: SamplingParams | None = None,
        p_min: float = 0.0,
        reuse_prefix: bool = False,
    ) -> Iterator[list[int]]:
        """Like generate, but yields the tokens of every step as it commits them (the first
        list holds the prefill's token).  Closing the iterator early stops the generation;
        ``last_stats`` then describes what ran."""
        with self._request(prompt, max_tokens, draft_len, draft_source, stop_on_eos, None, sampling, p_min,
                           reuse_prefix) as rq:
            try:
                yield from engine_steps(self._engine, rq.tokens, rq.params, rq.check)
            finally:
                st = ffi.new("struct dflash_stats *")
                lib.dflash_engine_get_stats(self._engine, st)
                self.last_stats = rq.stats(st)

    @contextlib.contextmanager
    def _request(self, prompt, max_tokens, draft_len, draft_source, stop_on_eos, on_step, sampling, p_min,
                 reuse_prefix=False):
        """Validate a request and set up its C-side pieces (callbacks, sampler chain); tear them down after."""
        if self._engine is None:
            raise DFlashError("generator is closed")
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if draft_len is None:
            draft_len = self.max_draft_len if (self._drafter or draft_source) else 0
            if draft_source and not self._drafter:
                draft_len = min(draft_len, 15)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        rq = _Request(tokens, draft_len, "external" if draft_source else (
            "dflash" if self._drafter and draft_len > 0 else "none"))
        draft_cb = step_cb = ffi.NULL
        if draft_source is not None:
            def _draft(_ud, hist, n_hist, n, out):
                try:
                    prop = list(draft_source(ffi.unpack(hist, n_hist), n))
                    if len(prop) > n:
                        raise DFlashError(f"draft source returned {len(prop)} tokens (asked for at most {n})")
                    for i, t in enumerate(prop):
                        out[i] = int(t)
                    return len(prop)
                except BaseException as ex:  # re-raised after the C loop returns
                    rq.errors.append(ex)
                    return -1
            draft_cb = ffi.callback("dflash_draft_fn", _draft)
        if on_step is not None:
            def _step(_ud, s):
                try:
                    on_step({"step": s.step, "drafted": s.drafted, "accepted": s.accepted,
                             "committed": s.committed, "target_len": s.target_len,
                             "drafter_len": s.drafter_len})
                except BaseException as ex:
                    rq.errors.append(ex)
            step_cb = ffi.callback("dflash_step_fn", _step)

        sp = sampling or SamplingParams()
        mode, chain = verification(sp, self._model, self._vocab, self.n_vocab)
        seed = sp.seed if sp.seed != 0xFFFFFFFF else int.from_bytes(os.urandom(8), "little")
        rq.params = ffi.new("struct dflash_engine_params *",
                            {"n_draft": draft_len, "max_tokens": max_tokens, "stop_on_eos": stop_on_eos,
                             "mode": mode, "temperature": sp.temperature, "seed": seed, "p_min": p_min,
                             "reuse_prefix": reuse_prefix, **grammar_params(sp, chain),
                             "sampler": _native.ptr("struct llama_sampler *", chain.sampler) if chain else ffi.NULL})
        rq.prompt_c = ffi.new("int32_t[]", tokens) if tokens else ffi.new("int32_t[]", 1)
        lib.dflash_engine_set_draft_fn(self._engine, draft_cb, ffi.NULL)
        lib.dflash_engine_set_step_fn(self._engine, step_cb, ffi.NULL)
        try:
            yield rq
        finally:
            lib.dflash_engine_set_draft_fn(self._engine, ffi.NULL, ffi.NULL)
            lib.dflash_engine_set_step_fn(self._engine, ffi.NULL, ffi.NULL)
            if chain is not None:
                chain.close()

    @property
    def feature_width(self) -> int:
        """Values per position that `features` returns (n_taps * n_embd)."""
        if self._capture is None:
            raise DFlashError("no capture: load a drafter or pass capture_layers")
        return lib.dflash_capture_row_width(self._capture)

    def features(self, tokens: Sequence[int]) -> np.ndarray:
        """Target features of `tokens` (decoded from position 0): [n, n_taps * n_embd] float32."""
        toks = [int(t) for t in tokens]
        out = np.empty((len(toks), self.feature_width), dtype=np.float32)
        err = _native.err_buf()
        arr = ffi.new("int32_t[]", toks) if toks else ffi.new("int32_t[]", 1)
        if lib.dflash_engine_features(self._engine, arr, len(toks), ffi.from_buffer("float[]", out), err,
                                      _native.ERR_LEN):
            raise DFlashError(_native.err_str(err))
        return out

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Free the engine, context, drafter, capture and model (in that order)."""
        if getattr(self, "_engine", None):
            lib.dflash_engine_free(self._engine)
        self._engine = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
        self._ctx = None
        if getattr(self, "_drafter", None):
            self._drafter.close()
        self._drafter = None
        if getattr(self, "_capture", None):
            lib.dflash_capture_free(self._capture)
        self._capture = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
        self._model = None

