"""Target + drafter loading and speculative generation (the C loop behind a small API)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp import _logger

from .. import _native, options
from ..errors import DFlashError, check_file
from ..formats.config import DrafterConfig
from . import exact as exact_mode
from . import rpc
from .engine import SOURCE_MAX_DRAFT, DraftSource, EngineCore, EngineRequest, StepCallback
from .sampling import SamplingParams
from .stats import SpecStats

__all__ = ["DraftSource", "GenerationResult", "SpeculativeGenerator", "StepCallback"]


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: SpecStats
    margins: list[float] | None = None
    """Per generated token: target top-1 minus top-2 logit at the row that produced it."""


class SpeculativeGenerator(_native.Resource):
    """A target model (GGUF) with an optional DFlash drafter (GGUF).

    Without a drafter it decodes plainly through the same loop, which makes
    side-by-side comparisons exact.  ``capture`` forces a feature-capture path
    ("layer_inp" or "cb_eval"); "auto" picks the one the target supports.
    ``capture_layers`` turns capture on without a drafter (HF layer ids), for
    measuring its cost or producing training features.  ``flash_attn``
    defaults to off, like ``llama_cpp.Llama``.

    ``exact=True`` loads the target with flash attention on and the weight layout (llama.cpp's
    repacked CPU weights or not) that ``core.exact.weight_layout`` finds invariant, and
    self-checks that verify batches give bit-identical logits to one-token decoding: greedy
    output is then token-identical to plain decoding and a seeded match-mode run gives the same
    text with and without the drafter.  Drafts are capped at the largest invariant batch; a model
    whose 2-row batches already differ raises DFlashError (``exact="auto"``: runs in the default
    mode instead, the reason in every ``stats.exact``).

    ``rpc_servers="host:port,host:port"`` splits the target over llama.cpp ``rpc-server``s
    (``core.rpc``): ``n_gpu_layers`` of its layers (-1: all) go to them, the drafter stays local
    (``rpc_drafter="host:port"``, one of them: the drafter goes to that server).  A server lost
    mid-generation raises ``rpc.RPCError`` (one line) before any token of the failed step is handed
    out; the next call loads the model again (once the server is back).  rpc_timeout_s: how long a
    server may stay silent before it counts as lost.
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
        flash_attn: bool | None = None,
        exact: bool | str = False,
        rpc_servers: str | Sequence[str] | None = None,
        rpc_timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
        rpc_drafter: str | None = None,
        verbose: bool | None = False,
    ) -> None:
        self._model = self._ctx = self._core = self._cluster = None
        self._lost = False  # an rpc server was lost: the next request loads the model again
        self.last_stats: SpecStats | None = None
        if n_ctx < 1 or n_batch < 1:
            raise ValueError("n_ctx and n_batch must be positive")
        rpc_servers = options.check("rpc_servers", rpc_servers)
        rpc_drafter = options.check("rpc_drafter", rpc_drafter)
        rpc.drafter_server(rpc_servers, rpc_drafter)  # (a one-line error before any server is reached)
        if rpc_servers is not None and not n_gpu_layers:
            raise ValueError("rpc_servers needs n_gpu_layers > 0 (-1: every layer): it sets how many of the "
                             "target's layers go to the servers")
        n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers  # (as llama_cpp.Llama: all)
        load = exact_mode.load_settings(exact, model_path, flash_attn, n_threads, n_gpu_layers)
        self.exact = exact
        self.n_threads = n_threads or _native.default_threads()
        self.n_ctx = n_ctx
        check_file(model_path, "target model")
        if drafter_path is not None:
            check_file(drafter_path, "drafter")
        if verbose is not None:  # None: leave llama.cpp's log level as the caller set it
            _logger.set_verbose(verbose)
        llama_cpp.llama_backend_init()  # (before the rpc servers are registered)
        if rpc_servers is not None:
            self._cluster = rpc.Cluster(rpc_servers, timeout_s=rpc_timeout_s)
        placement = f"n_gpu_layers={n_gpu_layers}" if n_gpu_layers else "cpu"
        drafter_device = None
        if self._cluster is not None:
            placement = self._cluster.placement(placement, rpc_drafter)
            if rpc_drafter is not None:
                drafter_device = self._cluster.device(rpc_drafter)
        self.placement = placement
        self._load_args = dict(model_path=model_path, drafter_path=drafter_path, n_batch=n_batch,
                               n_gpu_layers=n_gpu_layers, capture=capture, capture_layers=capture_layers,
                               load=load, drafter_device=drafter_device)
        self._load(**self._load_args)

    def _load(self, model_path, drafter_path, n_batch, n_gpu_layers, capture, capture_layers, load,
              drafter_device) -> None:
        """Load the target (over the rpc servers, if any), the engine core and the context."""
        cluster = self._cluster
        if cluster is not None:
            cluster.mark()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        load.apply(mparams)
        if cluster is not None:
            cluster.apply(mparams)
        try:
            self._model = _native.load_model(model_path, mparams, "target model")
        except DFlashError:
            if cluster is not None:
                raise cluster.load_error(model_path) from None
            raise
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        n_ctx = self.n_ctx
        try:
            self._core = EngineCore(self._model, drafter_path, n_ctx=n_ctx, n_batch=n_batch,
                                    n_threads=self.n_threads, capture=capture, capture_layers=capture_layers,
                                    exact=load, model_path=model_path, placement=self.placement,
                                    healthy=(lambda: cluster.lost() is None) if cluster is not None else None,
                                    drafter_device=drafter_device)
        except BaseException:
            self.close()
            raise
        self.drafter_info: DrafterConfig | None = self._core.drafter_info
        self.capture_mode = self._core.capture_mode

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        # Same default as llama_cpp.Llama, so plain outputs are comparable.
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if load.flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._core.prepare_context(cparams)  # (exact="auto" falling back puts the caller's flash attention back)
        self.flash_attn = cparams.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        try:
            self._ctx = _native.new_context(self._model, cparams, f"a context with n_ctx={n_ctx}, n_batch={n_batch}")
        except DFlashError:
            self.close()
            if cluster is not None:
                raise cluster.load_error(model_path) from None
            raise
        try:
            self._core.attach(self._ctx)  # (exact mode's self-check decodes: over the servers too)
            self._check_rpc(loading=True)
        except BaseException:
            self.close()
            raise

    # -- rpc ----------------------------------------------------------------------------------

    @property
    def cluster(self) -> rpc.Cluster | None:
        """The rpc servers the target is split over (None: all local)."""
        return self._cluster

    def _check_rpc(self, loading: bool = False) -> None:
        """After a decode: RPCError when a server was lost meanwhile (what it produced is garbage);
        the engine then forgets its cache and the next request loads the model again."""
        if self._cluster is None or self._cluster.lost() is None:
            return
        self._lost = True
        if self._core is not None:
            self._core.lost()
        if loading:
            raise rpc.RPCError(f"cannot load {os.fspath(self._load_args['model_path'])!r} over RPC: "
                               f"{self._cluster.lost()}")
        self._cluster.check()

    def _reconnect(self) -> None:
        """The model loaded again over the servers (after a loss: a new connection each)."""
        self.close()
        self._lost = False
        self._load(**self._load_args)

    # -- info ---------------------------------------------------------------

    @property
    def exact_verdict(self):
        """The self-check's ``exact.Verdict`` when exact mode is on (None: the default mode)."""
        return self._core.exact if self._core is not None else None

    @property
    def max_draft_len(self) -> int:
        return self._core.max_draft_len

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
        speculation: str | None = None,
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
        each step's record (a dict): its cache state (committed, target_len, drafter_len), the
        drafts made, verified and accepted (made, drafted, accepted), the drafter's confidence per
        slot it returned (conf, greedy drafts; empty for a draft source) and the raw top-1 minus
        top-2 logit of the row that gave the anchor (anchor_margin; NaN after a rejection's
        resample), and the step's measured seconds of drafting and verifying beside the cost
        model's prediction of their sum (t_draft, t_verify, t_predicted; 0 before a cost model).
        reuse_prefix keeps the previous generation's KV / drafter cache for the
        common prefix (a chat's earlier turns) and prefills only the rest.  speculation: "auto"
        chooses each step's draft length in 0..draft_len from the measured cost model and the
        drafter's calibrated confidence (the default when draft_len is not given), "on" drafts
        draft_len tokens every step (the default when it is), "off" decodes plainly; the output
        is the same either way.
        """
        with self._run(prompt, max_tokens, draft_len, draft_source, stop_on_eos, on_step, sampling, p_min,
                       reuse_prefix, speculation) as run:
            toks, margins, stats = run.generate(return_margins)
            self._check_rpc()
        return GenerationResult(tokens=toks, text=self.detokenize(toks), stats=stats, margins=margins)

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
        speculation: str | None = None,
    ) -> Iterator[list[int]]:
        """Like generate, but yields the tokens of every step as it commits them (the first
        list holds the prefill's token).  Closing the iterator early stops the generation;
        ``last_stats`` then describes what ran."""
        with self._run(prompt, max_tokens, draft_len, draft_source, stop_on_eos, None, sampling, p_min,
                       reuse_prefix, speculation) as run:
            try:
                for step in run.steps():
                    self._check_rpc()  # before the step's tokens are handed out
                    yield step
            finally:
                self.last_stats = run.stats()

    def _run(self, prompt, max_tokens, draft_len, draft_source, stop_on_eos, on_step, sampling, p_min,
             reuse_prefix, speculation):
        """One request on the core (the default draft length: the drafter's block - 1)."""
        if self._lost:
            self._reconnect()
        if self._core is None:
            raise DFlashError("generator is closed")
        if speculation is not None:
            options.check("speculation", speculation)
        adaptive = (speculation or ("on" if draft_len is not None else "auto")) == "auto"
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if draft_len is None:
            draft_len = self.max_draft_len if (self._core.has_drafter or draft_source) else 0
            if draft_source and not self._core.has_drafter:
                draft_len = min(draft_len, SOURCE_MAX_DRAFT)
        if speculation == "off":
            draft_len = 0
        req = EngineRequest(max_tokens=max_tokens, draft_len=draft_len, p_min=p_min, stop_on_eos=stop_on_eos,
                            reuse_prefix=reuse_prefix, adaptive=adaptive and draft_len > 0,
                            sampling=sampling or SamplingParams())
        return self._core.run(tokens, req, draft_source=draft_source, on_step=on_step)

    def cost_model(self) -> dict | None:
        """The adaptive steps' cost model and calibration as refined so far (see EngineCore)."""
        return self._core.cost_model() if self._core is not None else None

    def ceiling(self, accepted: Sequence[int]) -> float:
        """The best any draft-length policy can do, as a speedup over plain decoding (see
        EngineCore.ceiling)."""
        if self._core is None:
            raise DFlashError("generator is closed")
        return self._core.ceiling(accepted)

    @property
    def feature_width(self) -> int:
        """Values per position that `features` returns (n_taps * n_embd)."""
        return self._core.feature_width

    def features(self, tokens: Sequence[int]) -> np.ndarray:
        """Target features of `tokens` (decoded from position 0): [n, n_taps * n_embd] float32."""
        if self._lost:
            self._reconnect()
        out = self._core.features(tokens)
        self._check_rpc()
        return out

    @property
    def drafter(self):
        """The loaded ``Drafter`` (None without one)."""
        return self._core.drafter if self._core is not None else None

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Free the engine core (engine, drafter, capture), the context and the model."""
        if getattr(self, "_core", None) is not None:
            self._core.close()
        self._core = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
        self._ctx = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
        self._model = None
