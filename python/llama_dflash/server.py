"""OpenAI-compatible server: llama-cpp-python's server with DFlash drafters.

    python -m llama_dflash.server --model T.gguf --draft_model_path D.gguf [--draft_n_max 5 ...]
    python -m llama_dflash.server --config_file models.json     # {"models": [{...}, ...], "port": ...}

The routes, request/response types, model switching and locking are llama-cpp-python's own
(``llama_cpp.server``); models are built as ``llama_dflash.Llama`` from the extra settings
below, ``logits_all`` defaults to off, and two routes are added: Prometheus ``/metrics``
(tokens proposed / accepted / rejected, acceptance rate, tau, tokens/s) and
``/extras/speculative_stats`` (the last request's and the cumulative stats, JSON).
Needs the server extras: ``pip install fastapi uvicorn sse-starlette pydantic-settings starlette-context``.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import sys
import types
from typing import Literal, Optional

import llama_cpp
from pydantic import Field

try:
    import llama_cpp.server.app as _app
    import llama_cpp.server.model as _server_model
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings
except ImportError as e:  # pragma: no cover - exercised only without the extras
    raise ImportError(f"llama_dflash.server needs llama-cpp-python's server extras ({e.name} is missing): "
                      "pip install fastapi uvicorn sse-starlette pydantic-settings starlette-context") from None

from .llama import Llama, openai_response_format


class DFlashModelSettings(ModelSettings):
    """llama-cpp-python's model settings plus the drafter's."""

    logits_all: bool = Field(default=False, description="Keep logits of every position (off: no n_ctx x n_vocab)")
    # typing.Optional: llama-cpp-python's argparse bridge understands Union, not the | syntax
    draft_model_path: Optional[str] = Field(default=None, description="DFlash / DFlash2 drafter GGUF")  # noqa: UP045
    draft_n_max: Optional[int] = Field(default=None, description="tokens drafted per step (default: block - 1)")  # noqa: UP045
    draft_n_min: int = Field(default=0, description="drop drafts shorter than this")
    draft_p_min: float = Field(default=0.0, description="cut drafts at the first slot less confident than this")
    verify: Literal["match", "rejection"] = Field(default="match", description="T > 0 verification")
    speculation: Literal["on", "off", "auto"] = Field(default="on", description="speculate, never, or when faster")
    grammar_aware_drafting: bool = Field(default=True, description="drafts walk the request's grammar / JSON schema")


class DFlashSettings(ServerSettings, DFlashModelSettings):
    pass


class DFlashConfigFileSettings(ConfigFileSettings):
    models: list[DFlashModelSettings] = Field(default=[], description="Model configs")


_current: contextvars.ContextVar[DFlashModelSettings | None] = contextvars.ContextVar("dflash_settings", default=None)


def _make_llama(*args, **kwargs) -> Llama:
    s = _current.get()
    if s is not None:
        kwargs.update(draft_model_path=s.draft_model_path, draft_n_max=s.draft_n_max, draft_n_min=s.draft_n_min,
                      draft_p_min=s.draft_p_min,
                      verify=s.verify, speculation=s.speculation, grammar_aware_drafting=s.grammar_aware_drafting)
    return Llama(*args, **kwargs)


# server.model builds models with `llama_cpp.Llama(...)`; in that module only, `llama_cpp`
# resolves to a view of the package whose Llama is ours (the package itself is untouched).
_server_model.llama_cpp = types.SimpleNamespace(**{**vars(llama_cpp), "Llama": _make_llama})
_original_load = _server_model.LlamaProxy.load_llama_from_model_settings


def _load(settings: ModelSettings):
    token = _current.set(settings if isinstance(settings, DFlashModelSettings) else None)
    try:
        return _original_load(settings)
    finally:
        _current.reset(token)


_server_model.LlamaProxy.load_llama_from_model_settings = staticmethod(_load)


def _current_model():
    proxy = _app._llama_proxy
    return getattr(proxy, "_current_model", None) if proxy is not None else None


def metrics_text() -> str:
    """Prometheus exposition of the loaded model's cumulative speculative stats."""
    m = _current_model()
    tot = getattr(m, "speculative_stats_total", None)
    vals = {"requests": 0, "tokens_generated": 0, "tokens_proposed": 0, "tokens_accepted": 0, "tokens_rejected": 0,
            "acceptance_rate": 0.0, "tau": 0.0, "tokens_per_second": 0.0, "fallbacks": 0}
    if tot is not None:
        d = tot.as_dict()
        vals.update(requests=d["generations"] + d["fallbacks"], tokens_generated=d["tokens"],
                    tokens_proposed=d["drafted"], tokens_accepted=d["accepted"],
                    tokens_rejected=d["drafted"] - d["accepted"], acceptance_rate=round(d["acceptance_rate"], 6),
                    tau=round(d["tau"], 6), tokens_per_second=round(d["tokens_per_s"], 3), fallbacks=d["fallbacks"])
    kinds = {"acceptance_rate": "gauge", "tau": "gauge", "tokens_per_second": "gauge"}
    lines = []
    for k, v in vals.items():
        name = f"llama_dflash_{k}" + ("_total" if kinds.get(k) is None else "")
        lines += [f"# TYPE {name} {kinds.get(k, 'counter')}", f"{name} {v}"]
    return "\n".join(lines) + "\n"


class _OpenAIResponseFormat:
    """ASGI middleware: a chat request's OpenAI ``response_format: {"type": "json_schema", ...}``
    is rewritten to llama-cpp-python's json_object-with-schema form before the route validates
    it (the route's request type knows only "text" and "json_object")."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            data = json.loads(body)
            rf = data.get("response_format")
            if isinstance(rf, dict) and rf.get("type") == "json_schema":
                data["response_format"] = openai_response_format(rf)
                body = json.dumps(data).encode()
        except (ValueError, AttributeError):
            pass  # the route reports what is wrong with the request
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # e.g. the client's disconnect, for streaming responses
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replay, send)


def create_app(server_settings: ServerSettings | None = None, model_settings: list[ModelSettings] | None = None,
               settings: DFlashSettings | None = None):
    """llama-cpp-python's app with DFlash models and the two extra routes."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    if server_settings is None and model_settings is None:
        settings = settings or DFlashSettings()
        server_settings = ServerSettings.model_validate(settings.model_dump())
        model_settings = [DFlashModelSettings.model_validate(settings.model_dump())]
    app = _app.create_app(server_settings=server_settings, model_settings=model_settings)
    app.add_middleware(_OpenAIResponseFormat)

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    def metrics() -> str:
        return metrics_text()

    @app.get("/extras/speculative_stats")
    def speculative_stats() -> JSONResponse:
        m = _current_model()
        last = getattr(m, "last_speculative_stats", None)
        tot = getattr(m, "speculative_stats_total", None)
        return JSONResponse({"model": getattr(_app._llama_proxy, "_current_model_alias", None),
                             "last": last.as_dict() if last is not None else None,
                             "total": tot.as_dict() if tot is not None else None})

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m llama_dflash.server", description=__doc__.split("\n\n")[0])
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
            server, models = ServerSettings.model_validate(c.model_dump()), c.models
        else:
            server = parse_model_from_args(ServerSettings, a)
            models = [parse_model_from_args(DFlashModelSettings, a)]
        if not models:
            raise ValueError("no models configured")
        app = create_app(server_settings=server, model_settings=models)
    except Exception as e:  # noqa: BLE001 - any configuration or load error ends in one line
        print(f"llama_dflash.server: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    uvicorn.run(app, host=os.getenv("HOST", server.host), port=int(os.getenv("PORT", server.port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
