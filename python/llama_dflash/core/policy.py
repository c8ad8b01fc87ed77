"""Cost-aware drafting between runs: the cost model and the confidence calibration that the C
loop's adaptive steps use (csrc/dflash_policy.c, docs/architecture.md §5.9).

The engine measures the cost model before its first adaptive generation (`Llama` with
speculation "auto": as it loads; verify batches of 1 .. n_max + 1 rows and drafts of 1 .. n_max
tokens: a fraction of a second on the default model), refines it and the calibration from every
step it times, and this module keeps both in the cache folder per (target file, drafter file,
threads, placement, mode, llama.cpp build), so the next start reuses them.  `replay` runs the
engine's policy on dense traces, with no model and no timing (bench/bench_policy.py,
tests/test_policy.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

from .. import _native
from .._native import ffi, lib
from ..cache import JsonStore, build_id, file_id, key_of
from ..errors import DFlashError

_STORE = "costs.json"
# how saved curves were refined: 2 = the one-row time anchors the speed factor (version 1's curves
# could drift, t(2) / t(1) to twice its measured value, and are measured again instead)
_COSTS_VERSION = 2


def cost_key(model_path: str | os.PathLike, drafter_path: str | os.PathLike | None, n_threads: int,
             placement: str, mode: str) -> str:
    """What the cost model and calibration depend on (``mode``: the default mode or exact mode
    with its weight layout)."""
    return key_of(*file_id(model_path), *(file_id(drafter_path) if drafter_path else ["none"]), *build_id(),
                  n_threads, placement, mode, int(lib.DFLASH_CONF_VERSION), _COSTS_VERSION)


def load(engine, key: str) -> bool:
    """Set the engine's cost model and calibration from the cache; False when there is none or its
    cost curves have a shape no machine has (timed under load: `dflash_costs_plausible`) -- the
    calibration is set then all the same, and only the curves need measuring again."""
    hit = JsonStore(_STORE).get(key)
    try:
        tv, td = [float(x) for x in hit["t_verify"]], [float(x) for x in hit["t_draft"]]
        reached, accepted = hit["reached"], hit["accepted"]
        c = ffi.new("struct dflash_costs *", {"n_rows": len(tv), "t_verify": tv, "n_draft": len(td), "t_draft": td})
        cal = ffi.new("struct dflash_calibration *", {"reached": reached, "accepted": accepted})
    except (TypeError, KeyError, ValueError, IndexError, OverflowError):
        return False  # none, or written by another version
    lib.dflash_engine_set_calibration(engine, cal)
    if not lib.dflash_costs_plausible(c):
        return False
    lib.dflash_engine_set_costs(engine, c)
    return bool(lib.dflash_engine_get_costs(engine, ffi.new("struct dflash_costs *")))


def measure(engine, n_rows: int, n_draft: int) -> None:
    """Time the target's verify batches and the drafter's drafts on this engine (clears its KV)."""
    err = _native.err_buf()
    if lib.dflash_engine_measure_costs(engine, n_rows, n_draft, ffi.NULL, err, _native.ERR_LEN) != 0:
        raise DFlashError(_native.err_str(err))


def snapshot(engine) -> dict | None:
    """The engine's refined cost model and calibration (None before it has a cost model)."""
    c = ffi.new("struct dflash_costs *")
    if not lib.dflash_engine_get_costs(engine, c):
        return None
    cal = ffi.new("struct dflash_calibration *")
    lib.dflash_engine_get_calibration(engine, cal)
    return {"t_verify": list(c.t_verify[0:c.n_rows]), "t_draft": list(c.t_draft[0:c.n_draft]),
            "reached": [list(r) for r in cal.reached], "accepted": [list(r) for r in cal.accepted]}


def save(engine, key: str) -> None:
    snap = snapshot(engine)
    if snap is not None:
        JsonStore(_STORE).put(key, snap)


def replay(traces: Sequence[Sequence[tuple[int, Sequence[float] | None]]], t_verify: Sequence[float],
           t_draft: Sequence[float], n_max: int, passes: int = 2, calibration: dict | None = None,
           t_inject_row: float = 0.0) -> dict:
    """The engine's adaptive steps replayed on dense traces (dflash_policy_replay): no model runs.

    traces: one list per generation, one (accepted, conf) pair per anchor position of its fixed
    output -- how many tokens of the drafter's n_max-token draft from there the output continues
    with, and that draft's per-slot confidences (n_max of them; None for a draft source without
    them, in every pair).  t_verify: seconds per verify batch of 1 .. n_max + 1 (or more) rows;
    t_draft: per draft of 1 .. n tokens; t_inject_row: what a draft pays per row committed since
    the last one (it injects them first).  One policy state runs through the traces in order; the
    last of `passes` is reported: seconds (cost-model time of its steps), plain_seconds (plain
    steps over the same tokens), steps, plain_steps, made, drafted, accepted."""
    lens = [len(tr) for tr in traces]
    flat = [x for tr in traces for x in tr]
    confs = [c for _, c in flat]
    has_conf = any(c is not None for c in confs)
    if has_conf and any(c is None or len(c) != n_max for c in confs):
        raise ValueError(f"each position needs n_max = {n_max} confidences (or none anywhere)")
    costs = ffi.new("struct dflash_costs *")
    if len(t_verify) > int(lib.DFLASH_MAX_ROWS) or len(t_draft) > int(lib.DFLASH_MAX_DRAFT):
        raise ValueError("too many cost-model sizes")
    costs.n_rows, costs.n_draft = len(t_verify), len(t_draft)
    for i, x in enumerate(t_verify):
        costs.t_verify[i] = float(x)
    for i, x in enumerate(t_draft):
        costs.t_draft[i] = float(x)
    cal = ffi.NULL
    if calibration is not None:
        cal = ffi.new("struct dflash_calibration *", {"reached": calibration["reached"],
                                                      "accepted": calibration["accepted"]})
    acc = ffi.new("int32_t[]", [int(a) for a, _ in flat] or [0])
    cf = ffi.new("float[]", [float(x) for c in confs for x in c]) if has_conf else ffi.NULL
    out = ffi.new("struct dflash_replay *")
    err = _native.err_buf()
    if lib.dflash_policy_replay(costs, cal, n_max, len(lens), ffi.new("int32_t[]", lens or [0]), acc, cf, passes,
                                float(t_inject_row), out, err, _native.ERR_LEN) != 0:
        raise DFlashError(_native.err_str(err))
    return {k: getattr(out, k) for k in ("seconds", "plain_seconds", "steps", "plain_steps", "made", "drafted",
                                          "accepted")}


def iid_traces(p: float, n_traces: int = 8, length: int = 128, seed: int = 0,
               n_max: int = 7) -> list[list[tuple[int, None]]]:
    """Dense traces (for `replay`) of a draft source without confidences whose slots are each right
    with probability p while the ones before them were: `n_traces` generations of `length` positions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_traces):
        tr = []
        for j in range(length):
            a = 0
            while a < n_max and rng.random() < p:
                a += 1
            tr.append((min(a, length - j - 1), None))
        out.append(tr)
    return out


def fixed_seconds(traces: Sequence[Sequence[tuple[int, object]]], t_verify: Sequence[float], n: int) -> float:
    """Seconds on the cost curve `t_verify` of drafting n tokens at every step of `traces` and
    verifying them all (no draft time): what a fixed draft length would take."""
    t = 0.0
    for tr in traces:
        j = 0
        while j < len(tr):
            k = min(n, len(tr) - j - 1)
            t += t_verify[k]
            j += min(k, tr[j][0]) + 1
    return t
