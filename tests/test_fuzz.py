"""A seeded, bounded fuzz test: mutated drafter GGUFs, HF checkpoints and CLI values must each
get a clean outcome -- never a crash, an abort, a hang or a traceback, never a bad value taken
silently (tests/fuzz_child.py says what counts as clean).  HTTP bodies are fuzzed against the
server in tests/test_server.py.  Run with -s to see the counts per category."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
SEED = 20261201
N = 160  # drafter mutations; the HF checkpoint gets N / 4, the CLI N / 2


def test_fuzz_drafter_files_checkpoints_and_cli(artifacts, tmp_path):
    a = artifacts["llama"]
    env = {**os.environ, "LLAMA_DFLASH_CACHE": str(tmp_path / "cache")}
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_child.py"), a["target"], a["drafter"],
                            str(tmp_path), str(SEED), str(N)], capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        last = [ln for ln in out.splitlines() if ln.startswith("CASE")][-1:]
        pytest.fail(f"hang: no answer within 600 s, at {last}")
    lines = r.stdout.splitlines()
    summary = [ln for ln in lines if ln.startswith("SUMMARY ")]
    if r.returncode != 0 or not summary:
        last = [ln for ln in lines if ln.startswith("CASE")][-1:]
        pytest.fail(f"the fuzz worker died (exit {r.returncode}) at {last}: {r.stderr[-2000:]}")
    res = json.loads(summary[0][len("SUMMARY "):])
    print("\nfuzz counts (tried / clean / wrong; crash and hang would have failed above):")
    for cat, c in res["counts"].items():
        print(f"  {cat:14s} {c['tried']:4d} / {c['clean']:4d} / {c['wrong']:3d}")
    assert not res["wrong"], "\n".join(res["wrong"][:20])
    assert res["counts"]["drafter-gguf"]["tried"] == N
