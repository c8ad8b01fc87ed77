"""OpenAI-compatible HTTP server over ``llama_dflash.Llama``.

    llama-dflash serve --model T.gguf --draft_model_path D.gguf [--draft_n_max 5 ...]
    llama-dflash serve --config_file models.json     # {"models": [{...}, ...], "port": ...}

(``python -m llama_dflash.api.server`` takes the same arguments.)  Settings, request and response
types and model switching are llama-cpp-python's (``llama_cpp.server``); the routes are ours so
that no request is lost or cut and none reaches the model unchecked:

* requests wait in a FIFO queue (``max_queue``, then HTTP 503) and are never interrupted by
  later ones (llama-cpp-python's ``interrupt_requests`` default cuts a running stream when
  another request arrives); up to ``parallel`` of them run at once, their steps sharing one
  decode (``Llama.view()``, docs/architecture.md §5.10);
* every body is parsed and checked before it is queued (JSON, types, ranges, ``n``, schemas,
  grammars, logit-bias ids, context length): a 4xx with an OpenAI-style error body, never a
  500 with internals;
* a client that disconnects ends its generation after the current step; a generation ends
  after ``request_timeout`` seconds as if it had hit its length limit;
* ``/v1/models``, ``/metrics`` and ``/health`` answer while the model works.

Extra routes: Prometheus ``/metrics`` (queue, requests by outcome, tokens proposed / accepted /
rejected, acceptance rate, tau, tokens/s) and ``/extras/speculative_stats`` (JSON).
Needs the server extras: ``pip install 'llama-dflash[server]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import math
import os
import queue
import sys
import threading
import traceback
import types
from collections.abc import Callable
from typing import Optional

import llama_cpp

try:
    import llama_cpp.server.model as _server_model
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings
    from llama_cpp.server.types import (
        CreateChatCompletionRequest,
        CreateCompletionRequest,
        CreateEmbeddingRequest,
        DetokenizeInputRequest,
        TokenizeInputRequest,
    )
    from pydantic import Field, ValidationError, create_model, field_validator
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
except ImportError as e:  # exercised by test_serve_without_server_extras
    raise ImportError(f"the server needs the server extras ({e.name} is missing): "
                      "pip install 'llama-dflash[server]'", name=e.name) from None

from .. import options
from ..core import kernels as _kernels
from .llama import Llama, openai_response_format


def _check_option(cls, value, info):
    return options.check(info.field_name, value)


def _exact_value(cls, value):
    """exact: "auto" or a flag as the command line and config files spell it (the check names the option)."""
    if isinstance(value, str) and value.strip().lower() != "auto":
        flag = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False,
                "no": False}.get(value.strip().lower(), value)
        return options.check("exact", flag)
    return value


# llama-cpp-python's model settings plus the speculative options (their one definition:
# llama_dflash.options), each checked by that definition's check.
DFlashModelSettings = create_model(
    "DFlashModelSettings", __base__=ModelSettings, __doc__="llama-cpp-python's model settings plus the drafter's.",
    __validators__={"check_option": field_validator(*options.NAMES)(_check_option),
                    "exact_value": field_validator("exact", mode="before")(_exact_value)},
    logits_all=(bool, Field(default=False, description="Keep logits of every position (off: no n_ctx x n_vocab)")),
    # typing.Optional: llama-cpp-python's argparse bridge understands Union, not the | syntax
    flash_attn=(Optional[bool], Field(default=None, description="flash attention (default: on in exact mode, "  # noqa: UP045
                                                                "which needs it; else off)")),
    **{n: (ann, Field(default=default, description=options.doc(n)))
       for n, (ann, default) in options.server_fields().items()})


class DFlashServerSettings(ServerSettings):
    """llama-cpp-python's server settings; requests are queued, never interrupted."""

    interrupt_requests: bool = Field(default=False, description="not supported (must stay off): requests are "
                                                                "queued and served in order, never cut")
    max_queue: int = Field(default=256, ge=1, description="requests waiting for the model at most (more: HTTP 503)")
    request_timeout: float = Field(default=600.0, gt=0, description="seconds one request may generate; it then "
                                                                    "ends as at its length limit")
    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="largest request body accepted (HTTP 413)")


class DFlashSettings(DFlashServerSettings, DFlashModelSettings):
    pass


class DFlashConfigFileSettings(DFlashServerSettings, ConfigFileSettings):
    models: list[DFlashModelSettings] = Field(default=[], description="Model configs")


# -- building models ----------------------------------------------------------------------------

_current: contextvars.ContextVar[DFlashModelSettings | None] = contextvars.ContextVar("dflash_settings", default=None)


def _make_llama(*args, **kwargs) -> Llama:
    s = _current.get()
    if s is not None:
        kwargs.update({n: getattr(s, n) for n in options.NAMES})
    return Llama(*args, **kwargs)


# LlamaProxy builds models with `llama_cpp.Llama(...)`; in its module only, `llama_cpp` resolves
# to a view of the package whose Llama is ours (the package itself is untouched).
_server_model.llama_cpp = types.SimpleNamespace(**{**vars(llama_cpp), "Llama": _make_llama})
_original_load = _server_model.LlamaProxy.load_llama_from_model_settings


def _load(settings: ModelSettings):
    token = _current.set(settings if isinstance(settings, DFlashModelSettings) else None)
    try:
        return _original_load(settings)
    finally:
        _current.reset(token)


_server_model.LlamaProxy.load_llama_from_model_settings = staticmethod(_load)


# -- request checks -----------------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def check_json_schema(schema, where: str = "schema") -> None:
    """Refuse what llama-cpp-python's schema-to-grammar converter would silently drop or crash on
    (a ``type`` that is no JSON type, sub-schemas that are not objects)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON object, got {type(schema).__name__}", param="response_format")
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not ts or any(not isinstance(x, str) or x not in _JSON_TYPES for x in ts):
            raise RequestError(f"{where}.type must be one of {sorted(_JSON_TYPES)} (or a list of them), got {t!r}",
                               param="response_format")
    for k in _SCHEMA_MAPS:
        if k in schema:
            if not isinstance(schema[k], dict):
                raise RequestError(f"{where}.{k} must be an object", param="response_format")
            for name, sub in schema[k].items():
                check_json_schema(sub, f"{where}.{k}.{name}")
    for k in _SCHEMA_LISTS:
        if k in schema:
            if not isinstance(schema[k], list):
                raise RequestError(f"{where}.{k} must be a list", param="response_format")
            for i, sub in enumerate(schema[k]):
                check_json_schema(sub, f"{where}.{k}[{i}]")
    for k in ("items", "additionalProperties", "not"):
        if k in schema and not isinstance(schema[k], bool):
            check_json_schema(schema[k], f"{where}.{k}")
    if "required" in schema and (not isinstance(schema["required"], list)
                                 or not all(isinstance(x, str) for x in schema["required"])):
        raise RequestError(f"{where}.required must be a list of property names", param="response_format")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise RequestError(f"{where}.enum must be a list", param="response_format")
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        raise RequestError(f"{where}.$ref must be a string", param="response_format")


def _finite(body, name: str, lo: float | None = None, hi: float | None = None) -> None:
    v = getattr(body, name, None)
    if v is None:
        return
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise RequestError(f"{name} must be a finite number in {rng}, got {v!r}", param=name)


def _check_sampling(body) -> None:
    """Ranges llama.cpp's samplers are defined on (outside them they crash, hang or are ignored)."""
    _finite(body, "temperature", 0.0)
    _finite(body, "top_p", 0.0, 1.0)
    _finite(body, "min_p", 0.0, 1.0)
    _finite(body, "repeat_penalty", 1e-6)
    _finite(body, "presence_penalty", -2.0, 2.0)
    _finite(body, "frequency_penalty", -2.0, 2.0)
    _finite(body, "mirostat_tau", 0.0)
    _finite(body, "mirostat_eta", 0.0)
    if body.top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {body.top_k}", param="top_k")
    if body.mirostat_mode not in (0, 1, 2):
        raise RequestError(f"mirostat_mode must be 0, 1 or 2, got {body.mirostat_mode}", param="mirostat_mode")
    if body.max_tokens is not None and body.max_tokens < 0:
        raise RequestError(f"max_tokens must be >= 0 (0 or null: up to the context size), got {body.max_tokens}",
                           param="max_tokens")
    if body.min_tokens < 0:
        raise RequestError(f"min_tokens must be >= 0, got {body.min_tokens}", param="min_tokens")
    if body.seed is not None and not -1 <= body.seed < 2**32:
        raise RequestError(f"seed must be in [0, 2**32) (or -1: random), got {body.seed}", param="seed")
    if getattr(body, "n", None) not in (None, 1):
        raise RequestError(f"n must be 1: one choice per request is supported, got {body.n}", param="n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise RequestError(f"best_of must be 1, got {body.best_of}", param="best_of")
    if body.logit_bias is not None:
        for k, v in body.logit_bias.items():
            if not math.isfinite(v) and v != -math.inf:
                raise RequestError(f"logit_bias[{k!r}] must be a finite number (or -inf), got {v!r}",
                                   param="logit_bias")
            if body.logit_bias_type != "tokens":
                try:
                    int(k)
                except ValueError:
                    raise RequestError(f"logit_bias key {k!r} is not a token id", param="logit_bias") from None
    stop = body.stop
    if isinstance(stop, list) and len(stop) > 16:
        raise RequestError("stop takes at most 16 strings", param="stop")


def parse_body(raw: bytes, kind: type):
    """The request body as ``kind`` (a llama-cpp-python request type), or a RequestError."""
    try:
        return _parse_body(raw, kind)
    except RecursionError:  # json and the schema checks recurse once per nesting level
        raise RequestError("the request body is nested too deeply") from None


def _parse_body(raw: bytes, kind: type):
    if not raw.strip():
        raise RequestError("the request body is empty: send a JSON object")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8 text") from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    if kind is CreateChatCompletionRequest and "response_format" in data:
        try:
            data["response_format"] = openai_response_format(data["response_format"])
        except ValueError as e:
            raise RequestError(str(e), param="response_format") from None
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False)
        msg = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in errs[:5])
        raise RequestError(f"invalid request: {msg}", param=".".join(str(x) for x in errs[0]["loc"]) or None) \
            from None
    if kind is CreateCompletionRequest:
        if isinstance(body.prompt, list):
            if len(body.prompt) > 1:
                raise RequestError("prompt: one prompt per request is supported (got a list of "
                                   f"{len(body.prompt)})", param="prompt")
            body.prompt = body.prompt[0] if body.prompt else ""
    if kind is CreateChatCompletionRequest:
        if not body.messages:
            raise RequestError("messages must hold at least one message", param="messages")
        rf = body.response_format
        if rf is not None and rf.get("schema") is not None:
            check_json_schema(rf["schema"])
    if kind in (CreateCompletionRequest, CreateChatCompletionRequest):
        _check_sampling(body)
    return body


def _grammar_ok(llm: Llama, text: str) -> bool:
    s = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), b"root")
    if not s:
        return False
    llama_cpp.llama_sampler_free(s)
    return True


def _prepare(llm: Llama, body, kwargs: dict) -> None:
    """The checks that need the model (vocabulary, context size, grammars), then the kwargs
    llama-cpp-python's routes would pass (logit bias ids, grammar object, min_tokens)."""
    n_vocab, n_ctx = llm.n_vocab(), llm.n_ctx()
    if body.max_tokens is not None and body.max_tokens > n_ctx:
        raise RequestError(f"max_tokens {body.max_tokens} exceeds the context size {n_ctx}", param="max_tokens",
                           code="context_length_exceeded")
    if body.logit_bias is not None:
        if body.logit_bias_type == "tokens":
            bias: dict[str, float] = {}
            for tok, v in body.logit_bias.items():
                for i in llm.tokenize(tok.encode("utf-8"), add_bos=False, special=True):
                    bias[str(i)] = v
        else:
            bias = dict(body.logit_bias)
            bad = [k for k in bias if not 0 <= int(k) < n_vocab]
            if bad:
                raise RequestError(f"logit_bias token id(s) {bad[:5]} outside the vocabulary (0..{n_vocab - 1})",
                                   param="logit_bias")
        kwargs["logit_bias"] = bias
    if body.grammar is not None:
        if not _grammar_ok(llm, body.grammar):
            raise RequestError("grammar: not a valid GBNF grammar with a 'root' rule", param="grammar")
        kwargs["grammar"] = llama_cpp.LlamaGrammar.from_string(body.grammar, verbose=False)
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.get("schema") is not None:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            gbnf = json_schema_to_gbnf(json.dumps(rf["schema"]))
        except Exception as e:  # noqa: BLE001 - the converter raises what it likes on odd schemas
            raise RequestError(f"response_format schema cannot be turned into a grammar: {e}",
                               param="response_format") from None
        if not _grammar_ok(llm, gbnf):
            raise RequestError("response_format schema gives no valid grammar", param="response_format")
    if body.min_tokens > 0:
        procs = llama_cpp.LogitsProcessorList([llama_cpp.MinTokensLogitsProcessor(body.min_tokens, llm.token_eos())])
        kwargs["logits_processor"] = procs


# -- the worker ---------------------------------------------------------------------------------

class _Job:
    """One request: what to run on the model, and the channel its results come back on."""

    def __init__(self, model: str | None, run: Callable[[Llama], object], stream: bool,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.model, self.run, self.stream, self.loop = model, run, stream, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.llm: Llama | None = None

    def emit(self, *item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
        llm = self.llm
        if llm is not None:
            llm.stop_requested.set()


class Worker:
    """Runs jobs in arrival order: on the current model up to its ``parallel`` at once, each in a
    thread of its own on a view of the model (one at a time when ``parallel`` is 1).  A job for
    another model waits until the running ones have finished; the model is then switched."""

    def __init__(self, proxy_factory: Callable[[], object], max_queue: int, timeout_s: float) -> None:
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a job ends
        self.waiting = 0
        self.running = 0
        self.counts = {"completed": 0, "client_error": 0, "server_error": 0, "rejected_busy": 0, "cancelled": 0,
                       "timed_out": 0}
        self.proxy = None
        self.load_error: str | None = None
        self._proxy_factory = proxy_factory
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="llama-dflash-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.load_error is not None:
            raise RuntimeError(self.load_error)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def submit(self, job: _Job) -> None:
        with self._lock:
            if self.waiting >= self.max_queue:
                self.counts["rejected_busy"] += 1
                raise RequestError(f"server busy: {self.waiting} requests are waiting (max_queue {self.max_queue}); "
                                   "retry later", status=503, kind="server_error", code="server_busy")
            self.waiting += 1
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)

    def _switches(self, model: str | None) -> bool:
        """Would ``model`` load another model than the current one?  (LlamaProxy's own rule.)"""
        p = self.proxy
        names = getattr(p, "_model_settings_dict", None)
        if names is None:
            return True
        alias = model if model in names else p._default_model_alias
        return alias != p._current_model_alias or p._current_model is None

    def _main(self) -> None:
        try:
            self.proxy = self._proxy_factory()
        except Exception as e:  # noqa: BLE001 - reported by the constructor in one line
            self.load_error = str(e).splitlines()[0] if str(e) else type(e).__name__
        self._ready.set()
        if self.load_error is not None:
            return
        while (job := self._q.get()) is not None:
            with self._lock:
                self.waiting -= 1
            with self._idle:  # another model: only once nothing runs on this one
                while self.running and self._switches(job.model):
                    self._idle.wait()
            try:
                llm = self.proxy(job.model)
            except Exception as e:  # noqa: BLE001 - the job's error
                self._fail(job, e)
                continue
            n = max(1, int(getattr(llm, "parallel", 1)))  # (1 where the model serves one at a time)
            with self._idle:
                while self.running >= n:
                    self._idle.wait()
                if job.cancelled.is_set():  # (while it waited)
                    self.counts["cancelled"] += 1
                    continue
                self.running += 1
            try:
                target = llm.view() if n > 1 else llm
                threading.Thread(target=self._run, args=(job, target), name="llama-dflash-request",
                                 daemon=True).start()
            except Exception as e:  # noqa: BLE001 - the job's error; the worker goes on
                with self._idle:
                    self.running -= 1
                    self._idle.notify_all()
                self._fail(job, e)
        with self._idle:
            while self.running:
                self._idle.wait()
        if self.proxy is not None:
            self.proxy.free()

    def _run(self, job: _Job, llm: Llama) -> None:
        try:
            self._serve(job, llm)
        finally:
            with self._idle:
                self.running -= 1
                self._idle.notify_all()

    def _serve(self, job: _Job, llm: Llama) -> None:
        timer = None
        try:
            llm.stop_requested.clear()
            timer = threading.Timer(self.timeout_s, self._timeout, (job, llm.stop_requested))
            timer.daemon = True
            timer.start()
            job.llm = llm
            out = job.run(llm)
            if job.stream:
                it = iter(out)
                try:
                    for chunk in it:
                        if job.cancelled.is_set():
                            break
                        job.emit("chunk", chunk)
                finally:
                    close = getattr(it, "close", None)
                    if close is not None:
                        close()
                job.emit("end")
            else:
                job.emit("result", out)
            self.count("cancelled" if job.cancelled.is_set() else "completed")
        except Exception as e:  # noqa: BLE001 - reported to the client
            self._fail(job, e)
        finally:
            job.llm = None
            if timer is not None:
                timer.cancel()

    def _fail(self, job: _Job, e: Exception) -> None:
        if isinstance(e, RequestError):
            self.count("client_error")
            job.emit("error", e)
        elif isinstance(e, (ValueError, TypeError)):  # refused by llama-cpp-python / the core (bad request values)
            self.count("client_error")
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            code = "context_length_exceeded" if "context window" in msg else None
            job.emit("error", RequestError(msg, code=code))
        else:  # a bug: logged here, reported without internals
            self.count("server_error")
            traceback.print_exception(e, file=sys.stderr)
            job.emit("error", RequestError(f"internal error ({type(e).__name__})", status=500, kind="server_error"))

    def _timeout(self, job: _Job, stop: threading.Event) -> None:
        if job.llm is not None:
            self.count("timed_out")
            stop.set()


# -- the app ------------------------------------------------------------------------------------

def metrics_text(worker: Worker | None = None) -> str:
    """Prometheus exposition: the queue, requests by outcome, the loaded model's speculative stats."""
    m = getattr(worker.proxy, "_current_model", None) if worker is not None and worker.proxy is not None else None
    tot = getattr(m, "speculative_stats_total", None)
    vals = {"requests": 0, "tokens_generated": 0, "tokens_proposed": 0, "tokens_accepted": 0, "tokens_rejected": 0,
            "acceptance_rate": 0.0, "tau": 0.0, "tokens_per_second": 0.0, "fallbacks": 0}
    if tot is not None:
        d = tot.as_dict()
        vals.update(requests=d["generations"] + d["fallbacks"], tokens_generated=d["tokens"],
                    tokens_proposed=d["drafted"], tokens_accepted=d["accepted"],
                    tokens_rejected=d["drafted"] - d["accepted"], acceptance_rate=round(d["acceptance_rate"], 6),
                    tau=round(d["tau"], 6), tokens_per_second=round(d["tokens_per_s"], 3), fallbacks=d["fallbacks"])
    vals.update(getattr(m, "joint_stats", None) or {"joint_steps": 0, "joint_sequences": 0})
    kinds = {"acceptance_rate": "gauge", "tau": "gauge", "tokens_per_second": "gauge", "queue_waiting": "gauge",
             "requests_running": "gauge"}
    if worker is not None:
        vals["queue_waiting"] = worker.waiting
        vals["requests_running"] = worker.running
    lines = []
    for k, v in vals.items():
        name = f"llama_dflash_{k}" + ("_total" if kinds.get(k) is None else "")
        lines += [f"# TYPE {name} {kinds.get(k, 'counter')}", f"{name} {v}"]
    if tot is not None:  # adaptive drafting: what the cost model chose, predicted and measured
        lines += ["# TYPE llama_dflash_plain_steps_total counter", f"llama_dflash_plain_steps_total {tot.plain_steps}",
                  "# TYPE llama_dflash_draft_length_steps_total counter"]
        lines += [f'llama_dflash_draft_length_steps_total{{length="{k}"}} {v}' for k, v in enumerate(tot.lengths)]
        lines += ["# TYPE llama_dflash_step_seconds_total counter",
                  f'llama_dflash_step_seconds_total{{kind="measured"}} {round(tot.t_step_s, 6)}',
                  f'llama_dflash_step_seconds_total{{kind="predicted"}} {round(tot.t_predicted_s, 6)}']
        for name, vals_k in (("drafted", tot.per_position_drafted), ("accepted", tot.per_position_accepted),
                             ("expected_accepted", tot.per_position_expected)):
            lines.append(f"# TYPE llama_dflash_position_{name}_total counter")
            lines += [f'llama_dflash_position_{name}_total{{position="{k + 1}"}} {round(v, 4)}'
                      for k, v in enumerate(vals_k)]
    ks = _kernels.stats()  # which backend ran the target's small (verify) matrix products
    lines += ["# TYPE llama_dflash_kernels_info gauge",
              f'llama_dflash_kernels_info{{backend="{ks.backend}",isa="{ks.isa}"}} 1',
              "# TYPE llama_dflash_kernel_products_total counter",
              f"llama_dflash_kernel_products_total {ks.products}",
              "# TYPE llama_dflash_kernel_rows_total counter", f"llama_dflash_kernel_rows_total {ks.rows}"]
    if worker is not None:
        lines.append("# TYPE llama_dflash_http_requests_total counter")
        lines += [f'llama_dflash_http_requests_total{{outcome="{k}"}} {v}' for k, v in worker.counts.items()]
    return "\n".join(lines) + "\n"


def create_app(server_settings: ServerSettings | None = None, model_settings: list[ModelSettings] | None = None,
               settings: DFlashSettings | None = None) -> FastAPI:
    """The OpenAI-compatible app; the model loads (in the worker thread) before this returns."""
    if server_settings is None and model_settings is None:
        settings = settings or DFlashSettings()
        server_settings = DFlashServerSettings.model_validate(settings.model_dump())
        model_settings = [DFlashModelSettings.model_validate(settings.model_dump())]
    if server_settings is None or not model_settings:
        raise ValueError("create_app needs server settings and at least one model")
    if not isinstance(server_settings, DFlashServerSettings):
        fields = server_settings.model_dump()
        fields["interrupt_requests"] = False  # the base default (True) is what this server exists to avoid
        server_settings = DFlashServerSettings.model_validate(fields)
    if server_settings.interrupt_requests:
        raise ValueError("interrupt_requests is not supported: requests are queued and served in order")
    for ms in model_settings:
        if not os.path.isfile(ms.model):
            raise ValueError(f"model file not found: {ms.model}")
        dp = getattr(ms, "draft_model_path", None)
        if dp is not None and not os.path.isfile(dp):
            raise ValueError(f"drafter file not found: {dp}")
    ss = server_settings
    worker = Worker(lambda: _server_model.LlamaProxy(models=list(model_settings)), ss.max_queue, ss.request_timeout)
    aliases = [m.model_alias or m.model for m in model_settings]
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        worker.close()

    app = FastAPI(title="llama-dflash", root_path=ss.root_path, lifespan=lifespan)
    app.state.worker = worker
    app.state.settings = ss

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc):
        return RequestError(str(exc.detail), status=exc.status_code).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if ss.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {ss.api_key}":
                return RequestError("invalid API key", status=401, kind="authentication_error").response()
        return await call_next(request)

    async def read(request: Request, kind: type):
        n = int(request.headers.get("content-length") or 0)
        if n > ss.max_body_bytes:
            raise RequestError(f"request body of {n} bytes exceeds max_body_bytes ({ss.max_body_bytes})", status=413)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > ss.max_body_bytes:
                raise RequestError(f"request body exceeds max_body_bytes ({ss.max_body_bytes})", status=413)
        return parse_body(bytes(raw), kind)

    async def watch(request: Request, job: _Job, done: asyncio.Event) -> None:
        """Cancel the job when its client goes away before it has its answer."""
        while not done.is_set():
            if await request.is_disconnected():
                job.cancel()
                return
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    async def submit(request: Request, model: str | None, run: Callable[[Llama], object], stream: bool):
        job = _Job(model, run, stream, asyncio.get_running_loop())
        worker.submit(job)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(request, job, done))
        try:
            first = await job.events.get()
        except BaseException:
            job.cancel()
            raise
        finally:
            done.set()
            watcher.cancel()
        if first[0] == "error":
            return first[1].response()
        if first[0] == "result":
            return JSONResponse(first[1])

        async def events():
            item = first
            try:
                while item[0] == "chunk":
                    yield {"data": json.dumps(item[1])}
                    item = await job.events.get()
                if item[0] == "error":  # after the first chunk: the stream ends with the error as an event
                    yield {"data": json.dumps({"error": {"message": str(item[1]), "type": item[1].kind}})}
                yield {"data": "[DONE]"}
            finally:
                job.cancel()  # a no-op when it has finished; a hung-up client stops its generation

        ping = 10**9 if ss.disable_ping_events else 15
        return EventSourceResponse(events(), sep="\n", ping=ping)

    async def serve(request: Request, kind: type, call: Callable[[Llama, object], object],
                    exclude: set[str] | None = None):
        """Parse and check the body, then queue ``call(llm, body)``; a completion route (``exclude``:
        the fields llama-cpp-python's routes drop) gets ``call(llm, kwargs)`` after the checks that
        need the model, and may stream."""
        try:
            body = await read(request, kind)
        except RequestError as e:
            worker.count("client_error")
            return e.response()
        except ClientDisconnect:  # hung up before the whole body came: nobody reads the answer
            worker.count("cancelled")
            return RequestError("the client disconnected while sending the request body").response()
        if exclude is None:
            def run(llm: Llama):
                return call(llm, body)
            stream = False
        else:
            kwargs = body.model_dump(exclude=exclude)

            def run(llm: Llama):
                _prepare(llm, body, kwargs)
                return call(llm, kwargs)
            stream = bool(kwargs.get("stream"))
        try:
            return await submit(request, body.model, run, stream)
        except RequestError as e:  # the queue is full (counted by the worker)
            return e.response()

    completion_exclude = {"n", "best_of", "logit_bias_type", "user", "min_tokens"}

    @app.post("/v1/completions")
    @app.post("/v1/engines/copilot-codex/completions", include_in_schema=False)
    async def create_completion(request: Request):
        return await serve(request, CreateCompletionRequest, lambda llm, kw: llm(**kw), completion_exclude)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await serve(request, CreateChatCompletionRequest,
                           lambda llm, kw: llm.create_chat_completion(**kw), completion_exclude - {"best_of"})

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request):
        return await serve(request, CreateEmbeddingRequest,
                           lambda llm, b: llm.create_embedding(**b.model_dump(exclude={"user"})))

    @app.post("/extras/tokenize")
    async def tokenize(request: Request):
        return await serve(request, TokenizeInputRequest,
                           lambda llm, b: {"tokens": llm.tokenize(b.input.encode("utf-8"), special=True)})

    @app.post("/extras/tokenize/count")
    async def count_tokens(request: Request):
        return await serve(request, TokenizeInputRequest,
                           lambda llm, b: {"count": len(llm.tokenize(b.input.encode("utf-8"), special=True))})

    def _detokenize(llm: Llama, b) -> dict:
        bad = [t for t in b.tokens if not 0 <= t < llm.n_vocab()]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary (0..{llm.n_vocab() - 1})",
                               param="tokens")
        return {"text": llm.detokenize(b.tokens).decode("utf-8", errors="replace")}

    @app.post("/extras/detokenize")
    async def detokenize(request: Request):
        return await serve(request, DetokenizeInputRequest, _detokenize)

    @app.get("/v1/models")
    async def get_models():
        return {"object": "list", "data": [{"id": a, "object": "model", "owned_by": "me", "permissions": []}
                                           for a in aliases]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue_waiting": worker.waiting, "requests_running": worker.running}

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    async def metrics() -> str:
        return metrics_text(worker)

    @app.get("/extras/speculative_stats")
    async def speculative_stats() -> JSONResponse:
        proxy = worker.proxy
        m = getattr(proxy, "_current_model", None)
        last = getattr(m, "last_speculative_stats", None)
        tot = getattr(m, "speculative_stats_total", None)
        return JSONResponse({"model": getattr(proxy, "_current_model_alias", None),
                             "last": last.as_dict() if last is not None else None,
                             "total": tot.as_dict() if tot is not None else None})

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            self.exit(2, f"llama-dflash: error: {message}\n")

    p = _Parser(prog="llama-dflash serve", description=__doc__.split("\n\n")[0])
    add_args_from_model(p, DFlashSettings)
    p.add_argument("--config_file", type=str, help="JSON (or YAML) file: server settings and models: [...]")
    a = p.parse_args(argv)
    try:
        cfg = os.environ.get("CONFIG_FILE", a.config_file)
        if cfg:
            with open(cfg, "rb") as f:
                raw = f.read()
            if cfg.endswith((".yaml", ".yml")):
                import yaml

                raw = json.dumps(yaml.safe_load(raw))
            c = DFlashConfigFileSettings.model_validate_json(raw)
            server, models = DFlashServerSettings.model_validate(c.model_dump()), c.models
        else:
            if a.model is None:
                raise ValueError("--model (the target GGUF) or --config_file is required")
            server = parse_model_from_args(DFlashServerSettings, a)
            models = [parse_model_from_args(DFlashModelSettings, a)]
        if not models:
            raise ValueError("no models configured")
        app = create_app(server_settings=server, model_settings=models)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        print(f"llama-dflash: error: --{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - any configuration or load error ends in one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"llama-dflash: error: {msg}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=os.getenv("HOST", server.host), port=int(os.getenv("PORT", server.port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
