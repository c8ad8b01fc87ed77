"""The engine core: the one owner of speculative decoding's native handles (capture, drafter,
engines, the joint batches' context).

``EngineCore`` sits on a loaded target model (``llama_model *``) and the context created for
it.  It loads the drafter, sets up feature capture -- layer inputs where the architecture's
graph records them, else a cb_eval callback that must be in the context's params when the
context is created (``prepare_context``) -- creates the C engine (``attach``) and runs
generations described by one typed ``EngineRequest``.  ``SpeculativeGenerator`` and
``llama_dflash.Llama`` (and through them the server and the CLI) are adapters over it: a
parameter travels entry point -> ``EngineRequest`` -> ``struct dflash_engine_params``.
``JointEngines`` holds the native side of several sequences stepped together (the group's
context, capture and per-sequence engines); ``core/group.py`` schedules them without a handle.
Models and contexts themselves are made by ``_native.load_model`` / ``_native.new_context`` alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from .. import _native, options
from .._native import ffi, lib
from ..errors import DFlashError
from ..formats.config import DrafterConfig
from . import exact as exact_mode
from . import policy
from .capture import MODES as CAPTURE_MODES
from .capture import Capture
from .drafter import Drafter
from .sampling import MODE_NAMES, SamplingParams, grammar_params, verification
from .stats import SpecStats

DraftSource = Callable[[Sequence[int], int], Sequence[int]]
"""An external drafter: (committed tokens, last = anchor; n) -> up to n proposed tokens."""

StepCallback = Callable[[dict], None]

log = logging.getLogger("llama_dflash")

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw one


@dataclass
class EngineRequest:
    """One generation's parameters, as the C loop takes them (``struct dflash_engine_params``)."""

    max_tokens: int
    draft_len: int = 0          # tokens drafted per step (0: plain decoding)
    n_min: int = 0              # drafts shorter than this (after cuts) are dropped
    p_min: float = 0.0          # cut a greedy / match draft at its first slot less confident than this
    draft_budget: int = 0       # no drafts past this many generated tokens (0: max_tokens)
    stop_on_eos: bool = True
    reuse_prefix: bool = False  # keep the previous generation's KV / drafter cache for the common prefix
    adaptive: bool = False      # each step's length in 0..draft_len from the cost model (§5.9)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def check(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        # the options' own checks, named as the generator's arguments are
        for opt, arg in (("draft_n_max", "draft_len"), ("draft_n_min", "n_min"), ("draft_p_min", "p_min")):
            try:
                options.check(opt, getattr(self, arg))
            except ValueError as e:
                raise ValueError(str(e).replace(opt, arg, 1)) from None


class Run:
    """One generation in progress: its steps, the logits behind its tokens, its stats."""

    def __init__(self, core: EngineCore, tokens: list[int], req: EngineRequest, params, kind: str,
                 engine=None) -> None:
        self.core, self.tokens, self.req, self.params, self.kind = core, tokens, req, params, kind
        self.engine = engine if engine is not None else core._engine  # the C engine that runs it
        self.errors: list[BaseException] = []  # raised by Python callbacks inside the C loop
        self.prompt_c = ffi.new("int32_t[]", tokens) if tokens else ffi.new("int32_t[]", 1)

    def check(self, rc: int, err) -> None:
        """Raise what went wrong: a Python callback's exception first, else the core's message."""
        if self.errors:
            raise self.errors[0]
        if rc < 0:
            raise DFlashError(_native.err_str(err))

    def steps(self) -> Iterator[list[int]]:
        """The prefill's token, then each verify step's tokens, as they are committed."""
        e = self.engine
        err = _native.err_buf()
        first = lib.dflash_engine_start(e, self.prompt_c, len(self.tokens), self.params, ffi.NULL, err,
                                        _native.ERR_LEN)
        self.check(first, err)
        yield [first]
        buf = ffi.new("int32_t[]", int(lib.DFLASH_MAX_DRAFT) + 1)
        while (n := lib.dflash_engine_step(e, buf, ffi.NULL, err, _native.ERR_LEN)) != 0:
            self.check(n, err)
            yield list(buf[0:n])

    def generate(self, return_margins: bool = False) -> tuple[list[int], list[float] | None, SpecStats]:
        """The whole generation in one C call: (tokens, margins or None, stats)."""
        n_max = self.req.max_tokens
        out = ffi.new("int32_t[]", n_max)
        margins = ffi.new("float[]", n_max) if return_margins else ffi.NULL
        st = ffi.new("struct dflash_stats *")
        err = _native.err_buf()
        n = lib.dflash_engine_generate(self.engine, self.prompt_c, len(self.tokens), self.params, out, margins,
                                       st, err, _native.ERR_LEN)
        self.check(n, err)
        return list(out[0:n]), (list(margins[0:n]) if return_margins else None), self._stats(st)

    def logits(self, k: int) -> np.ndarray:
        """The target's raw logits row behind the k-th token of the last step (a view, valid
        until the next step)."""
        p = ctypes.cast(int(ffi.cast("uintptr_t", lib.dflash_engine_last_logits(self.engine, k))),
                        ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(p, (self.core.n_vocab,))

    def stats(self) -> SpecStats:
        st = ffi.new("struct dflash_stats *")
        lib.dflash_engine_get_stats(self.engine, st)
        return self._stats(st)

    def _stats(self, st) -> SpecStats:
        s = SpecStats.from_c(st, self.req.draft_len, self.kind, self.req.adaptive)
        s.mode = MODE_NAMES[st.mode]
        c = self.core
        s.exact = c.exact.describe() if c.exact is not None else (f"not exact: {c.exact_unavailable}"
                                                                 if c.exact_unavailable else "")
        if c.exact is not None and c.exact_note:
            s.exact += f"; {c.exact_note}"
        return s


# drafts a caller's draft source (no drafter: no block size) may propose a step; the exact probe covers them
SOURCE_MAX_DRAFT = exact_mode.PROBE_ROWS - 1

# Architectures whose recurrent state llama.cpp snapshots per token (n_rs_seq), so that rejected drafts
# can be rolled back: llm_arch_supports_rs_rollback in the pinned libllama (src/llama-arch.cpp); it
# clamps n_rs_seq to 0 for every other one (tests/test_hybrid.py holds this list to it).
RS_ROLLBACK_ARCHS = frozenset({"bailingmoe3", "deepseek4", "glm5-next", "kimi-k3", "lfm2", "lfm2moe", "nemotron_h",
                               "nemotron_h_moe", "qwen35", "qwen35moe", "qwen4exp"})


def arch(model) -> str:
    """The model's ``general.architecture``."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else "?"


def has_recurrent_state(model) -> bool:
    lc = llama_cpp.llama_cpp  # the bindings module (where llama_cpp.Llama looks these up too)
    return bool(lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model))


def target_refusal(model) -> str | None:
    """Why this target model cannot speculate, in one line, or None when it can (a vocab-only
    load suffices: ``llama-dflash inspect --target`` asks the same question).  A recurrent / hybrid
    target speculates where llama.cpp keeps snapshots of its recurrent state to roll back to."""
    if has_recurrent_state(model) and (name := arch(model)) not in RS_ROLLBACK_ARCHS:
        kind = "hybrid" if llama_cpp.llama_cpp.llama_model_is_hybrid(model) else "recurrent"
        return (f"{kind} target '{name}': llama.cpp keeps no snapshots of its recurrent state (n_rs_seq is "
                "clamped to 0), so it cannot roll back rejected drafts: plain decoding")
    return None


class EngineCore(_native.Resource):
    """Drafter, feature capture and C engine over one target model and its context.

    model: the target's ``llama_model *`` (ctypes, as llama_cpp returns it).  drafter_path:
    a DFlash / DFlash2 GGUF, or None (plain decoding; ``capture_layers`` then turns capture
    on alone, HF layer ids, e.g. for training features).  Use: ``prepare_context(cparams)``
    on the params the context will be created with, then ``attach(ctx)``.

    Recurrent and hybrid targets (qwen35, lfm2, nemotron_h, ...) roll rejected drafts back through
    llama.cpp's per-token snapshots of their recurrent state: ``prepare_context`` asks for
    ``n_rs_seq`` = the longest draft (``draft_n_max``, else the drafter's), and drafts never exceed
    what the context got.  Where llama.cpp has no snapshots for the architecture (it clamps
    ``n_rs_seq`` to 0: mamba, rwkv, jamba, qwen3next, ...) the target is refused for speculation
    here, at load, with a logged warning (``unavailable``); it still decodes plainly.
    """

    def __init__(self, model, drafter_path: str | os.PathLike | None = None, *, n_ctx: int, n_batch: int,
                 n_threads: int | None = None, capture: str = "auto",
                 capture_layers: Sequence[int] | None = None, exact: exact_mode.LoadSettings | None = None,
                 model_path: str | os.PathLike | None = None, placement: str = "cpu",
                 draft_n_max: int | None = None, healthy: Callable[[], bool] | None = None,
                 drafter_device: int | None = None) -> None:
        self._drafter = self._capture = self._engine = None
        # adaptive drafting's cost model: kept per target, drafter, threads, placement and mode
        self._costs_ready = False
        self._cost_key = ""
        self._cost_id = (model_path, drafter_path, placement)
        self._healthy = healthy  # whether the placement still holds (rpc: no server lost): what is measured is kept
        # exact mode: the target was loaded with ``exact`` (exact.load_settings); attach() checks it
        exact = exact or exact_mode.LoadSettings(None, None)
        self._exact_wanted = exact.exact
        self._asked_flash_attn = exact.asked_flash_attn
        self._exact_repacked = bool(exact.repacked)
        self.exact: exact_mode.Verdict | None = None
        self.exact_note = ""  # what exact mode holds only for (one request at a time: joint batches differ)
        self.exact_unavailable = exact.off  # exact="auto" ruled out (a setting, the self-check): why
        if exact.off:
            log.warning("llama-dflash: exact mode off (%s): default mode", exact.off)
        self._model_path = model_path
        self._n_threads = n_threads or _native.default_threads()
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {sorted(CAPTURE_MODES)}, got {capture!r}")
        self.n_ctx = n_ctx  # usable positions: min(this, the context's) once attached
        self._model_c = _native.ptr("struct llama_model *", model)
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.drafter_info: DrafterConfig | None = None
        self.unavailable: str | None = None  # why this target cannot speculate (None: it can)
        self.unavailable = target_refusal(model)
        self._draft_n_max = draft_n_max
        # recurrent state (None: a KV cache only): its rollback depth is the context's n_rs_seq
        self.n_rs_seq: int | None = 0 if has_recurrent_state(model) else None
        taps = list(capture_layers or [])
        if drafter_path is not None:
            self._drafter = Drafter(drafter_path, model, n_ctx, self._n_threads, device=drafter_device)
            self.drafter_info = self._drafter.info
            taps = list(self.drafter_info.target_layers)
            if self.unavailable is not None:
                log.warning("llama-dflash: not speculating: %s", self.unavailable)
        self.capture_mode = "none"
        if taps and self.unavailable is None:  # no capture or engine on a target that cannot speculate
            try:
                self._capture = Capture(model, taps, n_batch, capture)
            except DFlashError:
                self.close()
                raise
            self.capture_mode = self._capture.mode

    # -- setup ------------------------------------------------------------------------------

    def prepare_context(self, cparams) -> None:
        """Settle exact mode and put the cb_eval capture (if this target needs it) into the
        ``llama_context_params`` (a ctypes struct) the target context will be created with.

        Exact mode is decided here, before that context exists: its self-check runs on a probe
        context of the same settings (or comes from the cache), so that where ``exact="auto"``
        falls back, the target context is created with the caller's own settings (flash
        attention as asked) -- the default mode exactly as ``exact=False`` would load it."""
        if self.n_rs_seq is not None and self.unavailable is None:
            # snapshots for the longest rollback a step can need: its drafts (exact mode may lower it below)
            cparams.n_rs_seq = self._rollback_wanted(cparams)
        if self._exact_wanted and self.unavailable is None and self.exact is None:
            rows = min(self.max_draft_len + 1, exact_mode.PROBE_ROWS)
            placement = self._cost_id[2]  # (a verdict holds for the kernels of its placement: rpc servers too)
            v = exact_mode.self_check_for(cparams, self._model, self._model_path, rows, self._n_threads,
                                          self._exact_repacked, "" if placement == "cpu" else placement,
                                          self._healthy)
            if v.max_rows < 2 and self._exact_wanted == "auto":
                self.exact_unavailable = v.describe()  # the default mode, with the reason in every stats
                log.warning("llama-dflash: exact mode off for this target (%s): default mode", v.describe())
                cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self._asked_flash_attn
                                           else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            else:
                exact_mode.require(v)
                self.exact = v
                if self.n_rs_seq is not None:
                    cparams.n_rs_seq = self._rollback_wanted(cparams)  # (no more than the invariant drafts)
        if self.n_rs_seq is not None and self.unavailable is None:
            self.n_rs_seq = int(cparams.n_rs_seq)
        if self._capture is not None:
            self._capture.install(cparams)

    def _rollback_wanted(self, cparams) -> int:
        """Recurrent-state snapshots to ask for: the longest draft this core may verify (each costs
        one more copy of the recurrent state: bench/bench_hybrid.py), in exact mode no more than its
        invariant drafts; llama.cpp keeps a batch's last n_rs_seq + 1 rows in one ubatch and aborts
        unless n_ubatch exceeds them."""
        n = self.drafter_info.max_draft if self.drafter_info else SOURCE_MAX_DRAFT
        if self._draft_n_max is not None:
            n = min(n, self._draft_n_max)
        if self.exact is not None:
            n = min(n, self.exact.max_rows - 1)
        ubatch = min(int(cparams.n_ubatch), int(cparams.n_batch))
        if ubatch < 3:
            raise DFlashError(f"a recurrent / hybrid target rolls drafts back only with n_ubatch >= 3 (got {ubatch})")
        return max(1, min(n, ubatch - 2))

    def attach(self, ctx) -> None:
        """Bind the capture and create the engine on the target context (``llama_context *``); a
        target that cannot speculate gets a plain engine (no drafter, no capture)."""
        if self.unavailable is None and self.n_rs_seq is not None:
            got = int(llama_cpp.llama_n_rs_seq(ctx))
            if got < 1:  # (a context created without prepare_context's n_rs_seq, or clamped)
                raise DFlashError(f"the {arch(self._model)} target's context keeps no recurrent-state snapshots "
                                  "(llama.cpp clamped n_rs_seq to 0): rejected drafts could not be rolled back")
            self.n_rs_seq = got
        if self.unavailable is not None:
            self.ctx = ctx
            err = _native.err_buf()
            e = lib.dflash_engine_new(_native.ptr("struct llama_context *", ctx), ffi.NULL, ffi.NULL, err,
                                      _native.ERR_LEN)
            if e == ffi.NULL:
                raise DFlashError(_native.err_str(err))
            self._engine = e
            self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
            return
        _native.attention_kernels(ctx)  # (the drop-in Llama's context is llama-cpp-python's)
        if self.exact is not None:  # (prepare_context proved it) before the capture is bound and first use
            exact_mode.reference_kernels(ctx)
        self.ctx = ctx
        err = _native.err_buf()
        ctx_c = _native.ptr("struct llama_context *", ctx)
        if self._capture is not None:
            self._capture.attach(ctx)
        e = lib.dflash_engine_new(ctx_c, self._drafter.handle if self._drafter else ffi.NULL,
                                  self._capture.handle if self._capture else ffi.NULL, err, _native.ERR_LEN)
        if e == ffi.NULL:
            raise DFlashError(_native.err_str(err))
        self._engine = e
        # as the C engine counts it: what both the context and the drafter's cache hold
        n = int(llama_cpp.llama_n_ctx(ctx))
        self.n_ctx = min(self.n_ctx, n) if self._drafter is not None else n

    # -- info -------------------------------------------------------------------------------

    @property
    def has_drafter(self) -> bool:
        return self._drafter is not None

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @property
    def max_draft_len(self) -> int:
        """Longest draft: the drafter's block - 1 (without a drafter, the core's limit); in exact
        mode at most the largest batch the self-check found invariant, minus its anchor row; on a
        recurrent / hybrid target at most its context's n_rs_seq (0: it cannot speculate)."""
        if self.unavailable is not None:
            return 0
        n = self._drafter_max_draft()
        if self.n_rs_seq:  # (0 until the context exists)
            n = min(n, self.n_rs_seq)
        return min(n, self.exact.max_rows - 1) if self.exact is not None else n

    def _drafter_max_draft(self) -> int:
        return self.drafter_info.max_draft if self.drafter_info else int(lib.DFLASH_MAX_DRAFT)

    @property
    def feature_width(self) -> int:
        """Values per position that ``features`` returns (n_taps * n_embd)."""
        if self._capture is None:
            raise DFlashError("no capture: load a drafter or pass capture_layers")
        return self._capture.width

    # -- running ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def run(self, tokens: Sequence[int], req: EngineRequest, *, draft_source: DraftSource | None = None,
            on_step: StepCallback | None = None, history: Sequence[int] = (), engine=None) -> Iterator[Run]:
        """Set up one generation (sampler chain, callbacks, the C params); tear it down after.
        ``history``: what logits processors see before the first generated token; ``engine``: a
        sequence engine of an ``EngineGroup`` to run it on (default: this core's own)."""
        if self._engine is None:
            raise DFlashError("the engine is closed")
        engine = self._engine if engine is None else engine
        req.check()
        if (self.exact is not None or self.n_rs_seq is not None) and req.draft_len > self.max_draft_len:
            # verify only invariant batch sizes; roll back no more than the recurrent state's snapshots
            n = self.max_draft_len
            req = dataclasses.replace(req, draft_len=n, adaptive=req.adaptive and n > 0)
        if req.adaptive and req.draft_len > 0:
            self.ensure_costs()
        toks = [int(t) for t in tokens]
        sp = req.sampling
        mode, chain = verification(sp, self._model, self._vocab, self.n_vocab, history=history)
        seed = sp.seed if sp.seed != RANDOM_SEED else int.from_bytes(os.urandom(8), "little")
        params = ffi.new("struct dflash_engine_params *", {
            "n_draft": req.draft_len, "n_min": req.n_min, "max_tokens": req.max_tokens,
            "stop_on_eos": req.stop_on_eos, "mode": mode, "temperature": sp.temperature, "seed": seed,
            "p_min": req.p_min, "draft_budget": req.draft_budget, "reuse_prefix": req.reuse_prefix,
            "adaptive": req.adaptive, "canonical_prefill": self.exact is not None,
            **grammar_params(sp, chain),
            "sampler": _native.ptr("struct llama_sampler *", chain.sampler) if chain else ffi.NULL})
        kind = "external" if draft_source else ("dflash" if self._drafter and req.draft_len > 0 else "none")
        r = Run(self, toks, req, params, kind, engine)
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
                    r.errors.append(ex)
                    return -1
            draft_cb = ffi.callback("dflash_draft_fn", _draft)
        if on_step is not None:
            def _step(_ud, s):
                try:
                    on_step({"step": s.step, "drafted": s.drafted, "accepted": s.accepted,
                             "committed": s.committed, "target_len": s.target_len, "drafter_len": s.drafter_len,
                             "made": s.made, "anchor_margin": s.anchor_margin, "conf": list(s.conf[0:s.n_conf]),
                             "t_draft": s.t_draft, "t_verify": s.t_verify, "t_predicted": s.t_predicted})
                except BaseException as ex:
                    r.errors.append(ex)
            step_cb = ffi.callback("dflash_step_fn", _step)
        lib.dflash_engine_set_draft_fn(engine, draft_cb, ffi.NULL)
        lib.dflash_engine_set_step_fn(engine, step_cb, ffi.NULL)
        try:
            yield r
        finally:
            lib.dflash_engine_set_draft_fn(engine, ffi.NULL, ffi.NULL)
            lib.dflash_engine_set_step_fn(engine, ffi.NULL, ffi.NULL)
            if chain is not None:
                chain.close()

    def ensure_costs(self) -> None:
        """Before the first adaptive generation: the cost model and calibration from the cache,
        else measured now (a fraction of a second; the context's KV is cleared)."""
        if self._costs_ready:
            return
        self._costs_ready = True
        model_path, drafter_path, placement = self._cost_id
        if model_path is not None:
            mode = ("exact, repacked" if self._exact_repacked else "exact") if self.exact is not None else "default"
            self._cost_key = policy.cost_key(model_path, drafter_path, self._n_threads, placement, mode)
            if policy.load(self._engine, self._cost_key):
                return
        n = self.max_draft_len if self._drafter is not None else min(self.max_draft_len, SOURCE_MAX_DRAFT)
        if self.n_ctx >= 4:  # (the C core times what a small context or batch allows)
            policy.measure(self._engine, n + 1, n)
            self.forget()

    def cost_model(self) -> dict | None:
        """The adaptive steps' cost model (seconds per verify batch of k rows, per draft of n
        tokens) and confidence calibration, as refined so far; None before the first adaptive run."""
        return policy.snapshot(self._engine) if self._engine is not None and self._costs_ready else None

    def ceiling(self, accepted: Sequence[int]) -> float:
        """The ceiling of any length policy with this drafter, as a speedup over plain decoding:
        steps that each commit exactly the tokens a run at n_max got accepted (``accepted``, one
        count per step; 0: a plain step) -- drafting and verifying those tokens, or more where a
        larger batch costs less (the CPU's 4-row tiles make 4 rows cheaper than 3), or plain steps
        over them where those cost less -- against plain steps over all the tokens, both priced by
        the cost model (a ratio: the model's one-row time and the hour's measured plain speed may
        differ by several per cent, and the ceiling is applied to the measured plain speed)."""
        if self._engine is None:
            raise DFlashError("the engine is closed")
        acc = [int(a) for a in accepted]
        n_max = self.max_draft_len
        if any(a < 0 or a > n_max for a in acc):
            raise DFlashError(f"accepted counts must lie in 0 .. {n_max} (the longest draft)")
        t1 = lib.dflash_engine_step_cost(self._engine, 0, 0)
        best = [t1] + [min(min(lib.dflash_engine_step_cost(self._engine, k, k) for k in range(a, n_max + 1)),
                           (a + 1) * t1) for a in range(1, n_max + 1)]
        oracle = sum(best[a] for a in acc)
        plain = sum(a + 1 for a in acc) * t1
        return plain / oracle if oracle > 0 else 1.0

    def forget(self) -> None:
        """Someone else changed the context's KV: do not reuse what the engine left there."""
        if self._engine is not None:
            lib.dflash_engine_forget(self._engine)

    def lost(self) -> None:
        """The target's rpc server was lost (core/rpc.py): the steps since timed nothing real, so the
        cost model's refinement is not saved, and the KV is not reused."""
        self._cost_key = ""
        self.forget()

    def features(self, tokens: Sequence[int]) -> np.ndarray:
        """Target features of ``tokens`` (decoded from position 0): [n, n_taps * n_embd] float32."""
        toks = [int(t) for t in tokens]
        out = np.empty((len(toks), self.feature_width), dtype=np.float32)
        err = _native.err_buf()
        arr = ffi.new("int32_t[]", toks) if toks else ffi.new("int32_t[]", 1)
        if lib.dflash_engine_features(self._engine, arr, len(toks), ffi.from_buffer("float[]", out), err,
                                      _native.ERR_LEN):
            raise DFlashError(_native.err_str(err))
        return out

    def close(self) -> None:
        """Free the engine, the drafter and the capture (in that order; before the context); the
        refined cost model goes to the cache first."""
        if getattr(self, "_engine", None):
            if self._cost_key:
                with contextlib.suppress(OSError):  # a read-only cache folder loses the refinement only
                    policy.save(self._engine, self._cost_key)
            lib.dflash_engine_free(self._engine)
        self._engine = None
        if getattr(self, "_drafter", None):
            self._drafter.close()
        self._drafter = None
        if getattr(self, "_capture", None) is not None:
            self._capture.close()
        self._capture = None


class JointBatchesDiffer(DFlashError):
    """Exact mode: joint batches of several sequences do not round as plain decoding does."""


class JointEngines(_native.Resource):
    """The native side of a group of sequences (core/group.py schedules them, holding no handle):
    one target context on ``core``'s model with a KV stream per sequence, its capture, and a C
    engine per sequence over the core's drafter, seeded with the core's cost model.

    cparams: the core's ``llama_context_params`` (copied, then sized for n_seq x n_ctx).
    max_rows: exact mode's proven rows (0: the default mode); in exact mode the context gets the
    reference kernels and its joint batches are checked against plain decoding first
    (JointBatchesDiffer if they round apart)."""

    def __init__(self, core: EngineCore, cparams, n_seq: int, n_ctx: int, max_rows: int) -> None:
        self._ctx = self._capture = None
        self._engines: list = []
        cp = type(cparams).from_buffer_copy(cparams)
        cp.n_ctx = n_seq * n_ctx
        cp.n_seq_max = n_seq
        # A KV stream per sequence: a row's attention spans its own sequence's cells only (in one cache it
        # spans every slot's: 1.6x slower for 8 x 1 rows at 400 positions each), its cells stay in
        # position order (in one cache a rolled-back draft's cells go to whichever sequence comes next,
        # and attention then sums them in another order: exact mode would break), and its rows round
        # as they do alone more often.  Joint decodes keep equal rows per sequence (C side) so that
        # llama.cpp's split by sequence stays one ubatch.  Measured: bench/RESULTS.md, "Concurrent".
        cp.kv_unified = False
        cp.cb_eval = llama_cpp.ggml_backend_sched_eval_callback()  # not the core's capture
        cp.cb_eval_user_data = None
        taps = list(core.drafter_info.target_layers) if core.has_drafter else []
        if taps:
            self._capture = Capture(core._model, taps, int(cp.n_batch), core.capture_mode)
            self._capture.install(cp)
        try:
            self._ctx = _native.new_context(core._model, cp, f"a context of {n_seq} x {n_ctx} positions for concurrent "
                                                             "requests")
        except DFlashError:
            self.close()
            raise
        try:
            if self._capture is not None:
                self._capture.attach(self._ctx)
            if core.exact is not None:  # the rounding of the core's context, and a check that joint batches keep it
                exact_mode.reference_kernels(self._ctx)
                gap = exact_mode.joint_check(self._ctx, core.ctx, core._model, core._model_path, n_seq, max_rows,
                                             core._n_threads, core._exact_repacked)
                if gap != 0.0:
                    raise JointBatchesDiffer(f"joint batches of {n_seq} sequences round apart from plain decoding "
                                             f"(logit gap {gap:.3g}): requests are served one at a time")
            drafter = core.drafter.handle if core.has_drafter else ffi.NULL
            ctx_c, err = _native.ptr("struct llama_context *", self._ctx), _native.err_buf()
            for s in range(n_seq):
                e = lib.dflash_engine_new_seq(ctx_c, drafter, self._capture.handle if self._capture else ffi.NULL, s,
                                              err, _native.ERR_LEN)
                if e == ffi.NULL:
                    raise DFlashError(_native.err_str(err))
                self._engines.append(e)
        except BaseException:
            self.close()
            raise
        self.n_ctx = min(n_ctx, int(llama_cpp.llama_n_ctx(self._ctx)) // n_seq)  # positions per sequence
        self._max_rows = max_rows
        self._copy_costs(core)

    def _copy_costs(self, core: EngineCore) -> None:
        """The core's cost model and calibration (if it has one): each sequence's prior."""
        costs = ffi.new("struct dflash_costs *")
        cal = ffi.new("struct dflash_calibration *")
        if core._engine is None or not lib.dflash_engine_get_costs(core._engine, costs):
            return
        lib.dflash_engine_get_calibration(core._engine, cal)
        for e in self._engines:
            lib.dflash_engine_set_costs(e, costs)
            lib.dflash_engine_set_calibration(e, cal)

    def start(self, core: EngineCore, slot: int, tokens: list[int], req: EngineRequest,
              history: Sequence[int] = ()) -> contextlib.AbstractContextManager[Run]:
        """A Run of one generation on the sequence `slot`'s engine (see ``EngineCore.run``)."""
        return core.run(tokens, req, history=history, engine=self._engines[slot])

    def prefill(self, slot: int, run: Run, n_tokens: int, err) -> int:
        """The prompt of `run` into its sequence: the first generated token (checked by run)."""
        first = lib.dflash_engine_start(self._engines[slot], run.prompt_c, n_tokens, run.params, ffi.NULL, err,
                                        _native.ERR_LEN)
        run.check(first, err)
        return first

    def step(self, slots: Sequence[int], out, counts, err) -> bool:
        """One joint decode of the sequences `slots` (their draft, one verify batch, accept): each
        one's tokens into out (DFLASH_MAX_ROWS apart), their number into counts (< 0: its error).
        False when the whole step failed (err says why)."""
        engines = ffi.new("dflash_engine *[]", [self._engines[s] for s in slots])
        return lib.dflash_engine_step_group(engines, len(slots), self._max_rows, out, counts, err,
                                            _native.ERR_LEN) == 0

    def close(self) -> None:
        for e in getattr(self, "_engines", []):
            lib.dflash_engine_free(e)
        self._engines = []
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
        self._ctx = None
        if getattr(self, "_capture", None) is not None:
            self._capture.close()
        self._capture = None
