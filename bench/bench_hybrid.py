"""What speculation costs a hybrid target: llama.cpp's per-token snapshots of the recurrent state.

A hybrid target (qwen35, lfm2, nemotron_h, ...) rolls a verify step's rejected rows back by
restoring the snapshot of its recurrent state after the last kept row, so its context keeps
``n_rs_seq`` extra copies of that state (the engine asks for the longest draft: 15 with a
block-16 drafter).  Measured on the tests' tiny random qwen35 target (tests/models.py, Q8_0):

- ``memory``: the recurrent-state buffer per n_rs_seq, as llama.cpp reports it when it allocates
  the context ("RS buffer size", MiB) and from the GGUF's SSM sizes (bytes: per recurrent layer
  (n_embd_r + n_embd_s) f32 values per copy, 1 + n_rs_seq copies), and the same formula for one
  recurrent layer of Qwen3-Next's published linear-attention sizes (32 value heads, 16 key heads,
  head 128, conv kernel 4): multiply by a real target's recurrent layers for its cost per snapshot;
- ``verify``: t(k), one ``llama_decode`` of k rows (all logits) after a 64-token prefix, k = 1, 2,
  4, 8, with n_rs_seq = 0 (no snapshots: the graph writes the final state only), 8 and 15; the
  sequence's state after the prefix is restored between batches (not timed); best of the rounds,
  the settings interleaved round by round.

Usage: python3 bench/bench_hybrid.py [--rounds 15] [--threads 2] [--out bench/results/hybrid.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import io
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
from llama_cpp import _logger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import TargetSpec, write_target  # noqa: E402

SPEC = TargetSpec(arch="qwen35", seed=3, matrix_type="q8_0", tied=False, output_type="q8_0")
KS = (1, 2, 4, 8)
RS = (0, 8, 15)
PREFIX = 64
# one recurrent layer of Qwen3-Next's config.json linear_* sizes: value heads, key heads, head size, conv kernel
REAL_LAYER = (32, 16, 128, 4)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def state_bytes(n_recurrent: int, v_heads: int, k_heads: int, head: int, conv: int) -> int:
    """One copy of a qwen35 target's recurrent state (llama.cpp's n_embd_s + n_embd_r, f32)."""
    s = head * head * v_heads                        # the delta net's state: head x head per value head
    r = (conv - 1) * (head * v_heads + 2 * head * k_heads)  # the conv's last kernel - 1 inputs
    return 4 * n_recurrent * (s + r)


def context(model, n_rs_seq: int, threads: int, log: io.StringIO | None = None):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_rs_seq = 512, 64, 64, n_rs_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    if log is None:
        return llama_cpp.llama_init_from_model(model, cp)
    _logger.set_verbose(True)
    try:
        with contextlib.redirect_stderr(log):
            return llama_cpp.llama_init_from_model(model, cp)
    finally:
        _logger.set_verbose(False)


def decode(ctx, toks: list[int], pos0: int) -> None:
    b = llama_cpp.llama_batch_init(len(toks), 0, 1)
    try:
        b.n_tokens = len(toks)
        for i, t in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 1
            b.seq_id[i][0] = 0
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        llama_cpp.llama_batch_free(b)


def memory(model, threads: int) -> dict:
    out = {}
    for n in (0, 1, 2, 4, 8, 15):
        log = io.StringIO()
        ctx = context(model, n, threads, log)
        got = int(llama_cpp.llama_n_rs_seq(ctx))
        llama_cpp.llama_free(ctx)
        m = re.search(r"llama_memory_recurrent: size = +([\d.]+) MiB", log.getvalue())
        n_rec = sum((i + 1) % SPEC.full_attn_interval != 0 for i in range(SPEC.n_layer))
        per = state_bytes(n_rec, SPEC.ssm_dt_rank, SPEC.ssm_n_group, SPEC.ssm_d_state, SPEC.ssm_d_conv)
        out[n] = {"n_rs_seq": got, "rs_buffer_mib_logged": float(m.group(1)) if m else None,
                  "rs_bytes_formula": per * (1 + got)}
        print(f"n_rs_seq {n:2d}: recurrent state {out[n]['rs_bytes_formula'] / 1024:8.1f} KiB (formula), "
              f"llama.cpp: {out[n]['rs_buffer_mib_logged']} MiB")
    layer = state_bytes(1, *REAL_LAYER)
    real = {"sizes": dict(zip(("v_heads", "k_heads", "head", "conv"), REAL_LAYER, strict=True)),
            "per_layer_per_snapshot_mib": round(layer / 2**20, 3)}
    print(f"a Qwen3-Next-size recurrent layer: {layer / 2**20:.3f} MiB per snapshot (x recurrent layers x n_rs_seq)")
    return {"tiny": out, "qwen3next_layer": real}


def verify(model, threads: int, rounds: int) -> dict:
    ctxs = {n: context(model, n, threads) for n in RS}
    toks = [(100 + 37 * i) % 1024 for i in range(PREFIX + max(KS))]
    saved = {}
    for n, ctx in ctxs.items():
        decode(ctx, toks[:PREFIX], 0)
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        assert llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0) == size
        saved[n] = (buf, size)
    best = {n: {k: float("inf") for k in KS} for n in RS}
    for _ in range(rounds):
        for k in KS:
            for n, ctx in ctxs.items():
                t0 = time.perf_counter()
                decode(ctx, toks[PREFIX:PREFIX + k], PREFIX)
                best[n][k] = min(best[n][k], time.perf_counter() - t0)
                buf, size = saved[n]
                assert llama_cpp.llama_state_seq_set_data(ctx, buf, size, 0) == size
    for ctx in ctxs.values():
        llama_cpp.llama_free(ctx)
    out = {}
    for n in RS:
        out[n] = {"t_ms": {k: round(best[n][k] * 1e3, 4) for k in KS},
                  "vs_no_snapshots": {k: round(best[n][k] / best[0][k], 3) for k in KS}}
        print(f"n_rs_seq {n:2d}: " + "  ".join(f"t({k}) {best[n][k] * 1e3:.3f} ms ({best[n][k] / best[0][k]:.2f}x)"
                                              for k in KS))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/hybrid.json")
    a = ap.parse_args()
    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    with tempfile.TemporaryDirectory() as d:
        path = write_target(os.path.join(d, "qwen35.gguf"), SPEC)
        model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        try:
            mem = memory(model, a.threads)
            ver = verify(model, a.threads, a.rounds)
        finally:
            llama_cpp.llama_model_free(model)
    res = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "cpu": cpu_model(), "threads": a.threads, "load": os.getloadavg(),
           "target": {k: v for k, v in vars(SPEC).items() if not k.startswith("_")},
           "memory": mem, "verify": ver}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print("saved", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
