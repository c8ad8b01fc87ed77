"""`llama_dflash.Llama`: llama_cpp.Llama with DFlash speculative decoding underneath.

Everything above token generation -- completions, chat formats, streaming, stop strings,
grammars, seeds -- is llama-cpp-python's own code; only ``generate`` (the token source those
methods iterate) is replaced by the speculative loop, which yields exactly the tokens plain
decoding would (greedy) or draws them with the same sampler chain and seed (match
verification).  Requests the loop cannot serve exactly fall back to plain decoding, and
the reason is recorded in ``last_speculative_stats``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import random
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import llama_cpp
import numpy as np
from llama_cpp import _logger
from llama_cpp.llama_speculative import LlamaDraftModel

from .. import options
from ..core import exact as exact_mode
from ..core import kernels as _kernels
from ..core import rpc
from ..core.engine import DraftSource, EngineCore, EngineRequest, JointBatchesDiffer, StepCallback
from ..core.group import EngineGroup
from ..core.sampling import SamplingParams
from ..core.stats import Acceptance, SpecStats
from ..errors import DFlashError, check_file
from ..options import SpecOptions
from . import completion


def openai_response_format(response_format):
    """OpenAI's structured-output form ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}`` as llama-cpp-python's ``{"type": "json_object", "schema":
    {...}}`` (which llama-cpp-python 0.3.36 otherwise ignores in Python and rejects over HTTP)."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return response_format
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"schema": {...}}')
    return {"type": "json_object", "schema": spec["schema"]}


class DFlashDraftModel(LlamaDraftModel):
    """A DFlash / DFlash2 drafter for llama-cpp-python's ``draft_model=`` slot, where its users
    pass a ``LlamaPromptLookupDecoding``: ``Llama(model, draft_model=DFlashDraftModel("d.gguf"))``.
    Only ``llama_dflash.Llama`` runs it (the drafter needs the target's hidden states)."""

    def __init__(self, path: str, n_max: int | None = None, n_min: int = 0, p_min: float = 0.0) -> None:
        self.path, self.n_max, self.n_min, self.p_min = str(path), n_max, n_min, p_min

    def __call__(self, input_ids, /, **kwargs):
        raise TypeError("a DFlash drafter runs inside llama_dflash.Llama (from llama_dflash import Llama), "
                        "not llama_cpp.Llama")


_log = logging.getLogger("llama_dflash")
_BASE_PARAMS = frozenset(inspect.signature(llama_cpp.Llama.__init__).parameters)  # e.g. draft_model
_CHAT_SIGNATURE = inspect.signature(llama_cpp.Llama.create_chat_completion)
_COMPLETION_ARGS = list(inspect.signature(llama_cpp.Llama._create_completion).parameters)[4:]  # after max_tokens
_CLOSED = "this Llama is closed (close() was called): create a new one"
_BUDGET_SLACK = 8  # tokens a slot may run past a completion's max_tokens (a UTF-8 character's end)

@dataclass
class SpeculativeTotals(Acceptance):
    """Cumulative counters over every speculative generation of one Llama."""

    generations: int = 0
    fallbacks: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    t_decode_s: float = 0.0
    grammar_cut: int = 0
    grammar_skipped: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    # adaptive drafting (speculation "auto"), over the adaptive generations only
    adaptive_generations: int = 0
    plain_steps: int = 0                 # steps the cost model kept plain (no drafter call)
    lengths: list[int] = field(default_factory=list)  # steps by verified draft length (index 0: none)
    t_step_s: float = 0.0                # measured draft + verify seconds
    t_predicted_s: float = 0.0           # the cost model's prediction of the same
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_expected: list[float] = field(default_factory=list)  # calibrated acceptance, summed per draft

    @property
    def tokens_per_s(self) -> float:
        """Decode speed of the speculative generations (prefill excluded)."""
        return self.tokens / self.t_decode_s if self.t_decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        return d


def _add(into: list, more: list) -> None:
    """Element-wise into += more, `into` grown as needed."""
    into.extend([0] * (len(more) - len(into)))
    for i, v in enumerate(more):
        into[i] += v


class _Serial:
    """One request at a time on one model (libllama's context is not thread-safe): another thread
    waits; the thread already inside (a generator it has not finished, a completion's own eval)
    goes on.  A plain Lock, not an RLock: an abandoned generator may be closed -- and release it --
    in whichever thread the garbage collector runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None  # the thread inside

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        me = threading.get_ident()
        if self.owner == me:
            yield
            return
        with self._lock:
            self.owner = me
            try:
                yield
            finally:
                self.owner = None


class Llama(llama_cpp.Llama):
    """Drop-in llama_cpp.Llama with a DFlash / DFlash2 drafter.

    Takes llama_cpp.Llama's arguments and the speculative options below (one definition:
    ``llama_dflash.options.SpecOptions``).  The drafter may also come in llama-cpp-python's own
    slot, ``draft_model=DFlashDraftModel(path, n_max=..., ...)``, or as ``speculative``: a
    SpecConfig-like object (duck-typed: draft_model_path, draft_n_max, draft_p_min, optional
    spec_type), as the llama-cpp-python fork that has one takes.  With ``parallel`` > 1,
    ``view()`` hands out views of this model whose generations share one decode per step (each
    sequence's drafts verified in a joint batch, docs/architecture.md §5.10): a second context
    with ``parallel`` sequences of n_ctx positions each (exact mode: at most as many as the rows
    its self-check proved invariant).

    Completions run through a loop that adds O(1) work per token (llama-cpp-python's re-reads
    the whole text), and ``logprobs`` work without ``logits_all`` (no n_ctx x n_vocab buffer).

    ``stop_requested`` (a ``threading.Event``): set it from another thread to end the running
    generation after its current step, as a length limit would (finish_reason "length"); it
    stays set until cleared, so clear it before the next request (the server does both).

    Speculative options:
    """

    def __init__(self, model_path: str, *args, speculative=None, **kwargs) -> None:
        init_args = (model_path, args, speculative, dict(kwargs))  # (loaded again after a lost rpc server)
        opts = SpecOptions.take(kwargs)
        if speculative is not None:
            kind = str(getattr(speculative, "spec_type", "dflash")).lower()
            if "dflash" not in kind:
                raise ValueError(f"speculative.spec_type {kind!r}: only DFlash / DFlash2 drafters are supported")
            opts = dataclasses.replace(opts, **{n: v for n in ("draft_model_path", "draft_n_max", "draft_p_min",
                                                               "draft_n_min")
                                                if (v := getattr(speculative, n, None))})
        dm = kwargs.get("draft_model")
        if isinstance(dm, DFlashDraftModel):
            if opts.draft_model_path is not None:
                raise ValueError("pass the DFlash drafter once: draft_model=DFlashDraftModel(...) or draft_model_path")
            kwargs["draft_model"] = None
            opts = dataclasses.replace(opts, draft_model_path=dm.path, draft_n_min=dm.n_min, draft_p_min=dm.p_min,
                                       draft_n_max=dm.n_max if dm.n_max is not None else opts.draft_n_max)
        unknown = [k for k in kwargs if k.startswith(("draft_", "spec", "verif")) and k not in _BASE_PARAMS]
        if opts.draft_model_path is not None and kwargs.get("draft_model") is not None:
            raise ValueError("draft_model (llama-cpp-python's prompt-lookup drafter) and a DFlash drafter "
                             "(draft_model_path) cannot be combined: pass one")
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; speculative options are "
                            f"{sorted([*options.NAMES, 'speculative'])}")
        if opts.kernels is not None:
            _kernels.set_enabled(opts.kernels)
        cluster = None
        rpc.drafter_server(opts.rpc_servers, opts.rpc_drafter)  # (a one-line error before any server is reached)
        if opts.rpc_servers is not None:  # the target split over llama.cpp rpc-servers (core/rpc.py)
            if not kwargs.get("n_gpu_layers"):
                raise ValueError("rpc_servers needs n_gpu_layers > 0 (-1: every layer): it sets how many of the "
                                 "target's layers go to the servers")
            if opts.parallel > 1:  # (a lost server's garbage would reach every sequence of a joint decode)
                _log.warning("llama-dflash: parallel=%d over rpc servers: one request at a time", opts.parallel)
                opts = dataclasses.replace(opts, parallel=1)
            cluster = rpc.Cluster(opts.rpc_servers)
            self.__dict__["_init_args"] = init_args
        self.__dict__["_cluster"] = cluster  # read by the model_params setter, during the base's init
        _logger.set_verbose(kwargs.get("verbose", True))  # (as the base class does first: exact mode's probes load)
        # (without a drafter or concurrent requests every decode is llama-cpp-python's own: "auto" leaves it
        # untouched; exact=True still loads exact mode's settings, as a reference of the same configuration)
        engine = opts.draft_model_path is not None or opts.parallel > 1
        load = exact_mode.load_settings(opts.exact if engine or opts.exact is True else False, model_path,
                                        kwargs.get("flash_attn"),
                                        kwargs.get("n_threads"), kwargs.get("n_gpu_layers", 0))
        if load.exact:
            kwargs["flash_attn"] = load.flash_attn
        self.__dict__["_options"] = opts
        self.__dict__["_load"] = load  # read by the model_params setter, during the base's init
        self.__dict__["_serial"] = _Serial()
        self.stop_requested = threading.Event()
        self.draft_source: DraftSource | None = None  # a Python drafter in place of the DFlash one (tests, benches)
        self.on_step: StepCallback | None = None        # receives each verify step's cache state
        self._base_budget = -1  # max_tokens of a completion the base class's own loop runs
        self._core: EngineCore | None = None
        self._unavailable: str | None = None
        self._outside_eval = False  # eval() was called outside our loop (e.g. a multimodal chat handler)
        self._eval_end = 0          # n_tokens as the last eval() left it
        self.parallel = opts.parallel
        self._group: EngineGroup | None = None
        self._view_lock = threading.Lock()
        if engine:  # (concurrent requests run in the engine, drafter or not)
            if opts.draft_model_path is not None:
                check_file(opts.draft_model_path, "drafter")
            # built as soon as the base class has loaded the model, before it creates the context:
            # cb_eval capture (qwen2, gemma3, ...) must be in the context params (see _model below)
            self._pending_core = {"drafter_path": opts.draft_model_path, "n_batch": kwargs.get("n_batch", 512),
                                  "n_threads": kwargs.get("n_threads")}
        try:
            super().__init__(model_path, *args, **kwargs)
        except ValueError as e:  # (llama-cpp-python's "Failed to load model" / "... create llama_context")
            if cluster is None or not str(e).startswith("Failed to"):
                raise
            raise cluster.load_error(model_path) from None
        self.__dict__.pop("_pending_core", None)
        self.verify = opts.verify
        self.speculation = opts.speculation
        self.draft_p_min = opts.draft_p_min
        self.draft_n_min = opts.draft_n_min
        self.grammar_aware_drafting = opts.grammar_aware_drafting
        self.draft_model_path = opts.draft_model_path
        self.last_speculative_stats: SpecStats | None = None
        self.speculative_stats_total = SpeculativeTotals()
        if self._core is None:
            if load.exact and getattr(self, "_ctx", None) is not None:  # a reference of the same rounding too
                exact_mode.reference_kernels(self._ctx.ctx)
            return
        if len(self.input_ids) < self.n_ctx():
            # llama.cpp raised n_ctx to its floor: llama-cpp-python's completions run to that context
            # (max_tokens None or <= 0 included), so the token buffer it sized by the n_ctx asked for
            # grows to hold it
            self.input_ids = np.resize(self.input_ids, self.n_ctx())
        self._core.attach(self._ctx.ctx)
        self._unavailable = self._core.unavailable
        limit = self._core.max_draft_len if self._core.has_drafter else 0  # the drafter's block - 1 (exact
        n_max = opts.draft_n_max
        self.draft_n_max = limit if n_max is None else min(n_max, limit)  # mode: invariant)
        # a joint decode holds a row per sequence at least: within a batch (exact mode: within the rows
        # its self-check proved invariant); a multimodal chat handler fills the model's own context
        parallel = min(opts.parallel, int(self.context_params.n_batch))
        if self._core.exact is not None:
            parallel = min(parallel, self._core.exact.max_rows)
        if self.chat_handler is not None or self._unavailable is not None:
            parallel = 1
        if parallel > 1 and self._core.n_rs_seq is not None:
            # (joint batches would split by sequence, and each sequence's snapshots must stay in one ubatch)
            _log.warning("llama-dflash: parallel=%d on a recurrent / hybrid target: one request at a time",
                         parallel)
            parallel = 1
        self.parallel = parallel  # what is served at once: 1 when no group could be built
        if self._core.has_drafter and opts.speculation == "auto" and self.draft_n_max > 0 and self._unavailable is None:
            # at start, not in the first request (a cached model or a fraction of a second; it clears
            # the context, empty now); with parallel > 1 it is every slot's prior too
            self._core.ensure_costs()
        if cluster is not None and cluster.lost() is not None:  # (the self-check and the costs decode there)
            raise rpc.RPCError(f"cannot load {model_path!r} over RPC: {cluster.lost()}")
        if parallel > 1:
            me = weakref.ref(self)  # (the scheduler thread must not keep the model alive)
            try:
                self._group = EngineGroup(self._core, self.context_params, parallel, self._usable_ctx(),
                                          hold=self._serial.hold,
                                          on_done=lambda st: (o := me()) is not None and o._record_stats(st))
            except JointBatchesDiffer as e:  # exact mode holds for one request at a time
                _log.warning("llama-dflash: %s", e)
                self._core.exact_note = str(e)
                self.parallel = 1

    @property
    def joint_stats(self) -> dict[str, int]:
        """Concurrent requests (``parallel`` > 1): the decodes that verified several at once
        (joint_steps) and the sequences they verified (joint_sequences)."""
        g = (self.__dict__.get("_origin") or self).__dict__.get("_group")
        return {"joint_steps": g.joint_steps if g else 0, "joint_sequences": g.joint_sequences if g else 0}

    def view(self) -> Llama:
        """This model for one of ``parallel`` concurrent requests (one view per request, any
        thread).  Its completions and chats run in a slot of the model's group, stepped together
        with the other views' (their output is what each gives alone); it has its own seed,
        ``stop_requested`` and ``last_speculative_stats``.  What a slot cannot serve (logprobs,
        stopping criteria, logits processors, suffix / echo completions, eval, embeddings) runs on
        the model itself, one request at a time.  A view needs no closing: close the model."""
        if self.__dict__.get("_origin") is not None:
            return self._origin.view()
        self._model  # noqa: B018 (raises once closed)
        if self._group is None:
            return self  # (one request at a time: the model itself)
        v = object.__new__(type(self))
        v.__dict__.update(self.__dict__)
        with self._view_lock:  # each view its own seed, as each request on the model draws the next one
            self._seed = random.Random(self._seed).randint(0, 2**32)
            seed = self._seed
        v.__dict__.update(_origin=self, cache=None, stop_requested=threading.Event(), last_speculative_stats=None,
                          _seed=seed)
        return v

    def __getstate__(self) -> dict:
        """The base class's init arguments plus the drafter's: unpickling loads both again."""
        state = super().__getstate__()
        state.update(self.options.as_kwargs())
        return state

    @property
    def options(self) -> SpecOptions:
        """The speculative options as this model runs them (draft_n_max, parallel: as capped by the
        drafter's block and the self-check; the rest as given)."""
        return dataclasses.replace(self.__dict__["_options"], draft_n_max=getattr(self, "draft_n_max", None),
                                   parallel=self.parallel, verify=self.verify, speculation=self.speculation,
                                   draft_n_min=self.draft_n_min, draft_p_min=self.draft_p_min,
                                   grammar_aware_drafting=self.grammar_aware_drafting)

    # Exact mode: the base class fills ``self.model_params`` before it loads the model; the
    # struct it assigns gets exact mode's weight layout (``exact.weight_layout``) at once.
    @property
    def model_params(self):
        try:
            return self.__dict__["_dflash_model_params"]
        except KeyError:
            raise AttributeError("model_params") from None

    @model_params.setter
    def model_params(self, params) -> None:
        self.__dict__["_load"].apply(params)
        if (cluster := self.__dict__.get("_cluster")) is not None:
            cluster.apply(params)  # its devices only: n_gpu_layers of the target's layers go there
        self.__dict__["_dflash_model_params"] = params

    @property
    def exact(self) -> bool | str:
        """Exact mode as asked for (True, "auto" or False; see ``core.exact``)."""
        return self.__dict__["_options"].exact

    # The base class assigns ``self._model`` once, right after loading the model and before it
    # creates the context from ``self.context_params``: the engine core is built there, so that
    # a cb_eval capture is in the params of the one context the base class creates.
    @property
    def _model(self):
        if self._closed():
            raise self._closed_error()
        try:
            return self.__dict__["_dflash_target"]
        except KeyError:
            raise AttributeError("_model") from None

    @_model.setter
    def _model(self, model) -> None:
        self.__dict__["_dflash_target"] = model
        pending = self.__dict__.pop("_pending_core", None)
        if pending is None or model is None:
            return
        if self.model_params.vocab_only:
            self._unavailable = "vocab-only model (no weights: nothing to decode)"
            return
        # n_ctx=0: the base sets it after this; llama.cpp pads a context to a multiple of 256
        n_ctx = -(-(self.context_params.n_ctx or model.n_ctx_train()) // 256) * 256
        self._core = EngineCore(model.model, pending["drafter_path"], n_ctx=n_ctx,
                                n_batch=pending["n_batch"], n_threads=pending["n_threads"] or self.n_threads,
                                exact=self.__dict__["_load"], model_path=self.model_path,
                                placement=self._placement(), draft_n_max=self.__dict__["_options"].draft_n_max,
                                healthy=self._placement_holds, drafter_device=self._drafter_device())
        if self._core.unavailable is not None and pending["drafter_path"] is not None:
            warnings.warn(f"llama-dflash: not speculating: {self._core.unavailable}", stacklevel=4)
        self._core.prepare_context(self.context_params)

    def _placement(self) -> str:
        """Where the target (and the drafter) run: what its cost model and exact-mode verdict are kept for."""
        g = self.model_params.n_gpu_layers
        where = f"n_gpu_layers={g}" if g else "cpu"
        cluster = self.__dict__.get("_cluster")
        return where if cluster is None else cluster.placement(where, self.__dict__["_options"].rpc_drafter)

    def _drafter_device(self) -> int | None:
        """The rpc server's device the drafter goes to (rpc_drafter), or None: local."""
        cluster, where = self.__dict__.get("_cluster"), self.__dict__["_options"].rpc_drafter
        return cluster.device(where) if cluster is not None and where is not None else None

    def _placement_holds(self) -> bool:
        """No rpc server lost (what was measured over them meanwhile is worth keeping)."""
        cluster = self.__dict__.get("_cluster")
        return cluster is None or cluster.lost() is None

    # -- rpc servers (core/rpc.py): a lost one ends the request; the next one loads the model again

    def _rpc_check(self) -> None:
        """After a decode: RPCError (one line) when a server was lost since the model loaded; what
        that decode produced is garbage, so the context's state is dropped (n_tokens 0, the engine's
        KV forgotten) and the next request loads the model again."""
        cluster = self.__dict__.get("_cluster")
        if cluster is None or cluster.lost() is None:
            return
        self.__dict__["_rpc_reload"] = True
        if self.__dict__.get("_core") is not None:
            self._core.lost()
        self.n_tokens = 0
        cluster.check()

    def _rpc_reconnect(self) -> None:
        """At the next request after a lost server: the model loaded again with the same arguments,
        each server reached afresh (the old connections closed first: an rpc-server serves one client
        at a time).  While a server is still down that raises RPCError, this Llama stays unloaded and
        the request after tries again.  What the caller set here is kept (callbacks, stop event,
        seed, cache, stats)."""
        if not self.__dict__.get("_rpc_reload"):
            return
        with self._serial.hold():
            if not self.__dict__.get("_rpc_reload"):
                return  # (another thread's request did it)
            keep = {k: self.__dict__[k] for k in ("_serial", "stop_requested", "draft_source", "on_step", "_seed",
                                                  "cache", "speculative_stats_total", "last_speculative_stats",
                                                  "_init_args") if k in self.__dict__}
            model_path, args, speculative, kwargs = keep["_init_args"]
            self.__dict__["_rpc_reload"] = False  # (no reentry while it loads)
            try:
                self._close()
                self.__dict__.pop("_dflash_closed", None)
                Llama.__init__(self, model_path, *args, speculative=speculative, **kwargs)
            except BaseException as e:
                with contextlib.suppress(Exception):
                    self._close()  # what the failed load left (its connections too)
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.__dict__["_dflash_closed"] = (f"{msg} (the model is unloaded after a lost rpc server; the "
                                                   "next request loads it again)")
                self.__dict__["_rpc_reload"] = True
                raise
            finally:
                self.__dict__.update(keep)

    def _create_completion(self, prompt, suffix=None, max_tokens=16, *args, **kwargs):
        kwargs.update(zip(_COMPLETION_ARGS, args, strict=False))
        self._rpc_reconnect()  # (after a lost rpc server)
        if (self._core is None or suffix is not None or self._logits_all
                or (kwargs.get("echo") and kwargs.get("logprobs") is not None)):
            origin = self.__dict__.get("_origin")
            if origin is not None:  # the base class's loop reads the model's own buffers: on the model
                kwargs.setdefault("seed", self._seed)
                return _held(origin._serial, origin._create_completion(prompt, suffix, max_tokens, **kwargs))
            # the base class's own loop (it still draws its tokens from generate below)
            self._base_budget = -1 if max_tokens is None else max_tokens
            return super()._create_completion(prompt, suffix, max_tokens, **kwargs)
        return completion.create_completion(self, prompt, None, max_tokens, **kwargs)

    @functools.wraps(llama_cpp.Llama.create_chat_completion)  # same signature, docs
    def create_chat_completion(self, messages, *args, **kwargs):
        # response_format may also take OpenAI's {"type": "json_schema", ...} form
        bound = _CHAT_SIGNATURE.bind(self, messages, *args, **kwargs)
        self._rpc_reconnect()  # (after a lost rpc server)
        if "response_format" in bound.arguments:
            bound.arguments["response_format"] = openai_response_format(bound.arguments["response_format"])
        return super().create_chat_completion(*bound.args[1:], **bound.kwargs)

    def _forget(self) -> None:
        """Someone else is changing the context's KV: the engine must not reuse what it left there."""
        if getattr(self, "_core", None) is not None:
            self._core.forget()

    @functools.wraps(llama_cpp.Llama.reset)
    def reset(self) -> None:
        if self.__dict__.get("_origin") is not None:
            return  # a view holds no context state: its next generation starts fresh in a slot
        super().reset()
        self._forget()  # the next generation evaluates its prompt again

    @functools.wraps(llama_cpp.Llama.load_state)
    def load_state(self, state) -> None:
        if (origin := self.__dict__.get("_origin")) is not None:
            with origin._serial.hold():
                return origin.load_state(state)
        super().load_state(state)
        self._forget()

    def _fallback_reason(self, temp, mirostat_mode) -> str | None:
        if self._unavailable:
            return self._unavailable
        if self._core is None:
            return None
        if self.speculation == "off":
            return "speculation off"
        if self._outside_eval and self.n_tokens != self._eval_end:
            # eval() ran, then something else moved n_tokens: a chat handler (multimodal: image /
            # audio chunks) filled the context itself, with what no token list describes
            return "context filled outside the speculative loop (multimodal chunks)"
        # (after the caller's own eval() of tokens alone, the loop prefills them again: speculates)
        if self._logits_all:
            return "logits_all (scores of every position)"
        if mirostat_mode:
            return "mirostat"
        if temp < 0:
            return "negative temperature"
        return None

    @functools.wraps(llama_cpp.Llama.generate)
    def generate(self, tokens: Sequence[int], *args, **kwargs) -> Iterator[int]:
        origin = self.__dict__.get("_origin")
        if origin is None:
            # one request at a time: another thread's waits here until this generator finishes or closes
            with self._serial.hold():
                yield from self._generate(tokens, *args, **kwargs)
            return
        a = _GENERATE.bind(origin, tokens, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        reason = origin._fallback_reason(a["temp"], a["mirostat_mode"])
        if (origin._group is not None and reason in (None, "speculation off")  # (off: plain steps, still joint)
                and not origin._outside_eval and origin.draft_source is None and origin.on_step is None):
            yield from self._grouped(origin, origin._group, a, draft=reason is None)
            return
        with origin._serial.hold():  # on the model itself, with this view's seed and stop event
            saved = origin._seed, origin.stop_requested
            origin._seed, origin.stop_requested = self._seed, self.stop_requested
            try:
                yield from origin._generate(tokens, *args, **kwargs)
            finally:
                origin._seed, origin.stop_requested = saved
                self.last_speculative_stats = origin.last_speculative_stats
                self._dflash_stop_state = tuple(np.copy(x) for x in origin._stop_state())

    def _grouped(self, origin: Llama, group: EngineGroup, a: dict, draft: bool) -> Iterator[int]:
        """A view's generation in a slot of the group (draft: speculate, else plain steps)."""
        toks = [int(t) for t in a["tokens"]]
        max_tokens = origin._usable_ctx() - len(toks)
        if max_tokens < 1:
            raise ValueError(f"Requested tokens ({len(toks)}) exceed context window of {origin._usable_ctx()}")
        budget = a["draft_budget"] if a["draft_budget"] and a["draft_budget"] > 0 else 0
        if budget:  # the scheduler runs ahead of the reader: stop near the completion's own limit
            max_tokens = min(max_tokens, budget + _BUDGET_SLACK)
        sp = origin._sampling(a, self._seed)
        req = EngineRequest(max_tokens=max_tokens, draft_len=origin.draft_n_max if draft else 0,
                            n_min=origin.draft_n_min,
                            p_min=origin.draft_p_min, draft_budget=budget, reuse_prefix=True,
                            adaptive=origin.speculation == "auto", sampling=sp)
        criteria, rows = a["stopping_criteria"], a["logprob_rows"]
        seq = group.submit(toks, req, history=toks, rows=criteria is not None or rows is not None)
        ids = np.empty(len(toks) + max_tokens, dtype=np.intc)  # what the stopping criteria see
        ids[:len(toks)] = toks
        n_ids = len(toks)
        row = None
        try:
            for step in seq:
                if self.stop_requested.is_set() and n_ids > len(toks):
                    return
                step, step_rows = step if seq.rows else (step, None)
                for k, t in enumerate(step):
                    if step_rows is not None:  # as in _speculate: the tokens before this one, its row
                        row = step_rows[k]
                        if rows is not None:
                            rows[0].append(completion.TokenLogprobs(row, t, rows[1]))
                        if criteria is not None and criteria(ids[:n_ids], row):
                            return
                    ids[n_ids] = t
                    n_ids += 1
                    yield t
        finally:
            # (no waiting for the final stats where a round may be what is closing it: the scheduler's
            # own thread, e.g. a collected generator, or a holder of the model's lock)
            seq.close(wait=threading.current_thread() is not group.thread
                      and origin._serial.owner != threading.get_ident())
            self.last_speculative_stats = seq.stats
            self._dflash_stop_state = (ids[:n_ids], row if row is not None else np.zeros(origin._n_vocab, np.float32))

    def _stop_state(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, last logits row) as the last generation left them: what a completion's final
        stopping-criteria check reads (a view's own, not the model's buffers)."""
        st = self.__dict__.get("_dflash_stop_state")
        return st if st is not None else (self._input_ids, self._scores[-1, :])

    def _usable_ctx(self) -> int:
        """Positions a generation may use: llama.cpp's context, the drafter's, and the base class's
        token buffer (grown to llama.cpp's context at load)."""
        return min(self.n_ctx(), self._core.n_ctx, len(self.input_ids))

    def _sampling(self, a: dict, seed: int) -> SamplingParams:
        """The sampling of a generate call (its bound arguments ``a``)."""
        return SamplingParams(temperature=a["temp"], top_k=a["top_k"], top_p=a["top_p"], min_p=a["min_p"],
                              typical_p=a["typical_p"], repeat_penalty=a["repeat_penalty"],
                              frequency_penalty=a["frequency_penalty"], presence_penalty=a["presence_penalty"],
                              penalty_last_n=self.last_n_tokens_size, grammar=a["grammar"],
                              logits_processor=a["logits_processor"], seed=seed, mode=self.verify,
                              grammar_aware_drafting=self.grammar_aware_drafting)

    def _generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None, *, draft_budget: int | None = None,
                 logprob_rows: tuple[list, int] | None = None) -> Iterator[int]:
        """llama_cpp.Llama.generate's contract (yield tokens until the caller stops), served by the
        speculative loop when it can be exact, else by the base class.

        draft_budget: no drafts past this many tokens (a completion's max_tokens: the caller
        usually stops there); logprob_rows: (list, n) that receives each token's
        ``completion.TokenLogprobs`` with its n best alternatives."""
        budget = self._base_budget if draft_budget is None else draft_budget
        self._base_budget = -1
        self._rpc_reconnect()
        reason = self._fallback_reason(temp, mirostat_mode)
        if self._core is None or reason is not None:
            self._forget()  # the base class is about to use the context
            if reason is not None:
                self.last_speculative_stats = SpecStats(drafter="none", mode="plain", fallback_reason=reason)
                tot = self.speculative_stats_total
                tot.fallbacks += 1
                tot.fallback_reasons[reason] = tot.fallback_reasons.get(reason, 0) + 1
            try:
                yield from self._plain(logprob_rows, tokens, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                       temp=temp, repeat_penalty=repeat_penalty, reset=reset,
                                       frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                       tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                                       mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                                       logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                       grammar=grammar)
            finally:
                self._outside_eval = False  # what the context holds is the base class's own again
            return

        toks = [int(t) for t in tokens]
        # Like the base generator, run until the caller stops (create_completion may read a few
        # tokens past max_tokens to complete a UTF-8 character); drafts stop at its max_tokens.
        n_ctx = self._usable_ctx()
        max_tokens = n_ctx - len(toks)
        if max_tokens < 1:  # (as create_completion says it)
            raise ValueError(f"Requested tokens ({len(toks)}) exceed context window of {n_ctx}")
        sp = self._sampling(dict(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                 repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                 presence_penalty=presence_penalty, grammar=grammar,
                                 logits_processor=logits_processor), self._seed)
        yield from self._speculate(toks, max_tokens, sp, budget if budget and budget > 0 else 0, stopping_criteria,
                                   logprob_rows)

    def _plain(self, rows, tokens, **kw) -> Iterator[int]:
        """The base class's generator; with logprobs asked for, each token's row is summarised
        while the context still holds it."""
        for t in super().generate(tokens, **kw):
            if self.stop_requested.is_set():
                return
            if rows is not None:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx.ctx, -1), (self._n_vocab,))
                rows[0].append(completion.TokenLogprobs(row, t, rows[1]))
            yield t

    @functools.wraps(llama_cpp.Llama.embed)
    def embed(self, *args, **kwargs):
        if (origin := self.__dict__.get("_origin")) is not None:
            return origin.embed(*args, **kwargs)
        with self._serial.hold():
            self._rpc_reconnect()
            self._forget()  # embedding clears the KV cache
            out = super().embed(*args, **kwargs)
            self._rpc_check()
            return out

    @functools.wraps(llama_cpp.Llama.eval)
    def eval(self, tokens: Sequence[int]) -> None:
        if (origin := self.__dict__.get("_origin")) is not None:
            return origin.eval(tokens)
        with self._serial.hold():
            self._rpc_reconnect()
            if getattr(self, "_core", None) is not None:
                self._outside_eval = True  # the next generation must use what this put in the context
                self._forget()
            super().eval(tokens)
            self._rpc_check()  # (the base class's own decoding comes here too)
            self._eval_end = self.n_tokens

    def _speculate(self, toks: list[int], max_tokens: int, sp: SamplingParams, budget: int,
                   stopping_criteria=None, rows: tuple[list, int] | None = None) -> Iterator[int]:
        req = EngineRequest(max_tokens=max_tokens, draft_len=self.draft_n_max, n_min=self.draft_n_min,
                            p_min=self.draft_p_min, draft_budget=budget, reuse_prefix=True,
                            adaptive=self.speculation == "auto", sampling=sp)
        # prompt + tokens handed out so far (what the stopping criteria see), without per-token copies
        ids = np.empty(len(toks) + max_tokens, dtype=np.intc)
        ids[:len(toks)] = toks
        n_ids = len(toks)
        self._outside_eval = False  # the loop prefills the prompt itself: the context is ours again
        with self._core.run(toks, req, draft_source=self.draft_source, on_step=self.on_step, history=toks) as run:
            try:
                for step in run.steps():
                    self._rpc_check()  # before the step's tokens are handed out (a lost server's are garbage)
                    if self.stop_requested.is_set() and n_ids > len(toks):
                        return
                    for k, t in enumerate(step):
                        # As in llama_cpp.Llama.generate: the criteria see the tokens before this one and
                        # the row that produced it -- only verified tokens, never drafts.
                        if stopping_criteria is not None or rows is not None:
                            row = run.logits(k)
                            if rows is not None:
                                rows[0].append(completion.TokenLogprobs(row, t, rows[1]))
                            if stopping_criteria is not None and stopping_criteria(ids[:n_ids], row):
                                return
                        ids[n_ids] = t
                        n_ids += 1
                        yield t
            finally:
                with contextlib.suppress(Exception):
                    self._record_stats(run.stats())
                # Tell the base class what the KV cache now holds (everything committed but the last
                # token), so that its own prefix matching and bookkeeping stay true.
                # As the base class leaves it: the last token handed out is not evaluated yet.
                kv_len = self._engine_kv_len()
                kept = min(kv_len, max(n_ids - 1, len(toks)))
                if self.__dict__.get("_rpc_reload"):  # a lost server: nothing of the context is kept
                    kept = kv_len = 0
                if kept < kv_len:  # the consumer stopped inside a step: drop what it never saw
                    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._ctx.ctx), 0, kept, -1)
                    self._core.forget()
                self.input_ids[:kept] = ids[:kept]
                self.n_tokens = kept

    def _engine_kv_len(self) -> int:
        return max(0, llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self._ctx.ctx), 0) + 1)

    def _record_stats(self, s: SpecStats) -> None:
        self.last_speculative_stats = s
        tot = self.speculative_stats_total
        tot.generations += 1
        tot.steps += s.steps
        tot.drafted += s.drafted
        tot.accepted += s.accepted
        tot.tokens += s.n_generated
        tot.t_decode_s += s.t_total_s
        tot.grammar_cut += s.grammar_cut
        tot.grammar_skipped += s.grammar_skipped
        if s.adaptive:
            tot.adaptive_generations += 1
            tot.plain_steps += s.plain_steps
            tot.t_step_s += s.t_draft_s + s.t_verify_s
            tot.t_predicted_s += s.t_predicted_s
            _add(tot.lengths, s.lengths)
            _add(tot.per_position_drafted, s.per_position_drafted)
            _add(tot.per_position_accepted, s.per_position_accepted)
            _add(tot.per_position_expected, [e * d for e, d in zip(s.per_position_expected, s.per_position_drafted,
                                                                     strict=True)])

    def close(self) -> None:
        if self.__dict__.get("_origin") is not None:
            return  # a view: the model owns everything
        group = self.__dict__.get("_group")
        if group is not None:  # (its scheduler takes the lock below: closed first)
            group.close()
            self._group = None
        with self.__dict__["_serial"].hold() if "_serial" in self.__dict__ else contextlib.nullcontext():
            self._close()

    def _close(self) -> None:
        if getattr(self, "_core", None) is not None:
            self._core.close()  # before the context it drives
            self._core = None
        if hasattr(self, "_stack"):
            super().close()
            # the model and context are freed: every later use is a clear error, not a crash
            self.__dict__["_dflash_closed"] = True

    def _closed(self) -> bool:
        origin = self.__dict__.get("_origin")
        return bool((origin if origin is not None else self).__dict__.get("_dflash_closed"))

    def _closed_error(self) -> DFlashError:
        """Why the model cannot be used: closed, or unloaded after a lost rpc server (its message)."""
        origin = self.__dict__.get("_origin")
        why = (origin if origin is not None else self).__dict__.get("_dflash_closed")
        return rpc.RPCError(why) if isinstance(why, str) else DFlashError(_CLOSED)

    # The tokenizer keeps its own reference to the model: guard it here too.
    @functools.wraps(llama_cpp.Llama.tokenize)
    def tokenize(self, *args, **kwargs):
        self._rpc_reconnect()  # (a request's first call)
        self._model  # noqa: B018 (raises once closed)
        return super().tokenize(*args, **kwargs)

    @functools.wraps(llama_cpp.Llama.detokenize)
    def detokenize(self, *args, **kwargs):
        self._model  # noqa: B018 (raises once closed)
        return super().detokenize(*args, **kwargs)

    # The context, like the model above, is reached through a property so that a closed Llama
    # raises instead of handing a freed pointer to libllama.
    @property
    def _ctx(self):
        if self._closed():
            raise self._closed_error()
        try:
            return self.__dict__["_dflash_ctx"]
        except KeyError:
            raise AttributeError("_ctx") from None

    @_ctx.setter
    def _ctx(self, ctx) -> None:
        self.__dict__["_dflash_ctx"] = ctx


_GENERATE = inspect.signature(Llama._generate)


def _held(serial: _Serial, it: Iterator) -> Iterator:
    """``it``, iterated under ``serial`` (released when it ends or is closed)."""
    with serial.hold():
        yield from it


Llama.__doc__ += options.describe(indent="    ")
Llama.__init__.__signature__ = options.signature(llama_cpp.Llama.__init__, extra=("speculative",))
