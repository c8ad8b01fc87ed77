# ruff: noqa: UP007, UP045 (typing.Optional / Union: the server's argparse bridge reads only those)
"""The speculative options: one definition of each (name, type, default, check, help).

``Llama(...)`` takes them as keyword arguments, the server as model settings (its fields are
built from :data:`FIELDS`), the CLI as flags (their help and choices come from here) and the
generator through the same checks.  The C engine validates only what it needs for its own
safety (draft lengths within its arrays).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ._native import lib

MAX_PARALLEL = lib.DFLASH_MAX_SEQ_GROUP  # sequences one group decodes together (a joint batch holds a row of each)


def _opt(default: Any, doc: str, annotation: Any, check: Callable[[str, Any], Any],
         server_default: Any = dataclasses.MISSING) -> Any:
    meta = {"doc": doc, "annotation": annotation, "check": check}
    if server_default is not dataclasses.MISSING:
        meta["server_default"] = server_default
    return field(default=default, metadata=meta)


# -- checks: (name, value) -> the value as stored, or ValueError naming the option ---------------

def _int_in(lo: int, hi: int | None = None, none_ok: bool = False) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        if v is None and none_ok:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{name} must be an integer {span}{' (or None)' if none_ok else ''}, got {v!r}")
        return int(v)
    return check


def _unit(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


def _one_of(*choices: Any) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        # (compared by type too: True == 1 must not pass for "on")
        if not any(type(v) is type(c) and v == c for c in choices):
            names = [repr(c) for c in choices]
            raise ValueError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {v!r}")
        return v
    check.choices = choices  # type: ignore[attr-defined]
    return check


def _path(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path (str) or None, got {v!r}")
    return os.fspath(v)


def parse_endpoints(spec: Any, name: str = "rpc_servers") -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (or a list of such strings) -> [(host, port)]; ValueError, one line."""
    if isinstance(spec, str):
        items = spec.split(",")
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, str) for s in spec):
        items = [x for s in spec for x in s.split(",")]
    else:
        raise ValueError(f"{name} must be \"host:port[,host:port...]\" (or None: all local), got {spec!r}")
    out = []
    for raw in items:
        s = raw.strip()
        if not s:
            continue
        host, sep, port = s.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{name} must be host:port[,host:port...]: bad endpoint {s!r} "
                             "(e.g. 192.168.1.5:50052)")
        out.append((host, int(port)))
    if not out:
        raise ValueError(f"{name} must be host:port[,host:port...]: it is empty (None: all local)")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must list each endpoint once: {spec!r}")
    return out


def _endpoints(name: str, v: Any) -> str | None:
    if v is None:
        return None
    return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in parse_endpoints(v, name))


def _endpoint(name: str, v: Any) -> str | None:
    one = _endpoints(name, v)
    if one is not None and len(parse_endpoints(v, name)) != 1:
        raise ValueError(f"{name} must be one endpoint \"host:port\", got {v!r}")
    return one


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be True or False, got {v!r}")
    return v


@dataclass(frozen=True)
class SpecOptions:
    """What a model speculates with.  Every field is checked on construction (ValueError)."""

    draft_model_path: str | None = _opt(
        None, "the DFlash / DFlash2 drafter GGUF (None: plain decoding)", Optional[str], _path)
    draft_n_max: int | None = _opt(
        None, "tokens drafted per step at most (default and maximum: the drafter's block - 1)",
        Optional[int], _int_in(0, none_ok=True))
    draft_n_min: int = _opt(
        0, "drafts shorter than this (after the p_min / grammar cuts) are dropped: the step verifies "
           "its anchor alone", int, _int_in(0))
    draft_p_min: float = _opt(
        0.0, "cut drafts at the first slot less confident than this", float, _unit)
    verify: str = _opt(
        "match", "T > 0 verification: 'match' (a seed gives the same text as plain decoding) or 'rejection' "
                 "(speculative sampling with the drafter's q: same distribution, other random stream)",
        Literal["match", "rejection"], _one_of("match", "rejection"))
    speculation: str = _opt(
        "auto", "'auto': each step drafts only when the measured cost model says it pays and verifies the "
                "draft prefix that maximises expected tokens per second (docs/architecture.md §5.9); 'on': "
                "draft_n_max tokens every step; 'off': plain decoding. The output is the same either way",
        Literal["auto", "on", "off"], _one_of("auto", "on", "off"))
    grammar_aware_drafting: bool = _opt(
        True, "with a grammar (or JSON schema, or forced tool call) drafts walk a copy of the grammar state: "
              "forbidden candidates are skipped and a draft ends where the grammar allows none",
        bool, _flag)
    exact: bool | str = _opt(
        "auto", "exact mode (core/exact.py): the target loaded with batch-invariant settings (flash attention "
                "on), self-checked, so that output is bit-identical to plain decoding with those settings, "
                "whatever the verify batches and the other requests; 'auto': exact where the self-check passes, "
                "else the default mode with the reason logged and in the stats; True: refuse a target that fails "
                "it; False: the default mode (verify batches may round apart from one-token decoding)",
        Union[Literal["auto"], bool], _one_of("auto", True, False))
    parallel: int = _opt(
        1, f"requests served together, their steps sharing one decode (1..{MAX_PARALLEL}; more wait)",
        int, _int_in(1, MAX_PARALLEL), server_default=4)
    kernels: bool | None = _opt(
        None, "the small-batch kernels for the target's verify products (docs/architecture.md §13): True / "
              "False switch them on / off for the process; None leaves them (on where this CPU runs them; "
              "LLAMA_DFLASH_KERNELS=0 keeps them off)", Optional[bool], _one_of(None, True, False))
    rpc_servers: str | None = _opt(
        None, "llama.cpp rpc-server endpoints, \"host:port,host:port\", to split the target over "
              "(scripts/setup.sh --rpc; docs/architecture.md §14): n_gpu_layers of its layers go to them, as "
              "llama.cpp splits layers over GPUs; the drafter and its cache stay local (see rpc_drafter); a server "
              "lost mid-generation is an RPCError and the next request reloads; None: all local",
        Optional[str], _endpoints)

    rpc_drafter: str | None = _opt(
        None, "one of rpc_servers, \"host:port\": the drafter, its cache and its graph go to that server "
              "instead of staying local (a client too slow to draft; each draft then waits on a round trip "
              "more); None: local", Optional[str], _endpoint)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))

    @classmethod
    def take(cls, kwargs: dict, base: SpecOptions | None = None) -> SpecOptions:
        """The options among ``kwargs`` (removed from it) over ``base``'s (or the defaults)."""
        given = {n: kwargs.pop(n) for n in NAMES if n in kwargs}
        return dataclasses.replace(base or cls(), **given)

    def as_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS: Mapping[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(SpecOptions)}
NAMES = tuple(FIELDS)


def check(name: str, value: Any) -> Any:
    """One option's value as stored (ValueError naming ``name`` if it is not one)."""
    return FIELDS[name].metadata["check"](name, value)


def doc(name: str) -> str:
    return FIELDS[name].metadata["doc"]


def choices(name: str) -> tuple:
    return FIELDS[name].metadata["check"].choices


def server_fields() -> dict[str, tuple[Any, Any]]:
    """(annotation, default) per option, for a pydantic model (the server's settings)."""
    return {n: (f.metadata["annotation"], f.metadata.get("server_default", f.default)) for n, f in FIELDS.items()}


def describe(indent: str = "") -> str:
    """Each option with its default and help, as a docstring's list."""
    out = []
    for n, f in FIELDS.items():
        text = f"{n} (default {f.default!r}): {f.metadata['doc']}."
        out.append(textwrap.fill(text, 96, initial_indent=indent, subsequent_indent=indent + "    "))
    return "\n".join(out) + "\n"


def signature(base, extra: tuple[str, ...] = ()) -> inspect.Signature:
    """``base``'s signature (a function taking ``**kwargs``) with the options as keyword-only
    parameters: what ``help()`` and editors show for a class that takes them through ``**kwargs``."""
    sig = inspect.signature(base)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    kw = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=f.default) for n, f in FIELDS.items()]
    kw += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in extra]
    var = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    return sig.replace(parameters=params + kw + var)
