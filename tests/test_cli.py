"""`llama-dflash generate`: JSON output, plain path, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json(artifacts, tmp_path):
    a = artifacts["llama"]
    pf = tmp_path / "p.txt"
    pf.write_text("The capital of France is")
    spec = run("generate", "--model", a["target"], "--drafter", a["drafter"], "--prompt-file", str(pf),
               "--max-tokens", "24", "--draft-len", "7", "--n-ctx", "256", "--threads", "2", "--json")
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert set(out) >= {"text", "tokens", "stats"}
    st = out["stats"]
    for k in ("steps", "drafted", "accepted", "tau", "per_position", "t_draft_s", "t_verify_s", "t_total_s",
              "tokens_per_s"):
        assert k in st
    assert len(out["tokens"]) == 24 and 1 <= st["tau"] <= 8
    # adaptive by default: the chosen lengths, the cost model's prediction, calibrated acceptance per position
    # (how much it drafts follows this machine's live costs: tests/test_policy.py runs it on a modelled clock)
    assert st["adaptive"] and sum(st["lengths"]) == st["steps"] and st["lengths"][0] >= st["plain_steps"]
    assert st["t_predicted_s"] > 0 and len(st["per_position_expected"]) == len(st["per_position"])
    assert all(0 < e < 1 for e in st["per_position_expected"])
    fixed = run("generate", "--model", a["target"], "--drafter", a["drafter"], "--prompt-file", str(pf),
                "--max-tokens", "24", "--draft-len", "7", "--n-ctx", "256", "--speculation", "on", "--json")
    assert fixed.returncode == 0, fixed.stderr
    f = json.loads(fixed.stdout)
    assert not f["stats"]["adaptive"] and f["stats"]["plain_steps"] == 0 and f["tokens"] == out["tokens"]
    assert f["stats"]["drafted"] > 0 and 1 <= f["stats"]["tau"] <= 8
    plain = run("generate", "--model", a["target"], "--prompt", "The capital of France is", "--max-tokens", "24",
                "--n-ctx", "256", "--json")
    assert plain.returncode == 0, plain.stderr
    p = json.loads(plain.stdout)
    assert p["stats"]["drafted"] == 0 and p["stats"]["steps"] == 23
    assert p["tokens"] == out["tokens"]
    # sampling flags: the mode is recorded; match mode with a seed repeats itself
    args = ["generate", "--model", a["target"], "--drafter", a["drafter"], "--prompt", "Hello", "--max-tokens", "12",
            "--n-ctx", "256", "--temperature", "3", "--top-k", "20", "--seed", "7", "--json"]
    r1, r2 = run(*args, "--mode", "match"), run(*args, "--mode", "match")
    assert r1.returncode == 0, r1.stderr
    s1, s2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert s1["stats"]["mode"] == "match" and s1["tokens"] == s2["tokens"]
    r3 = run(*args, "--mode", "rejection")
    assert r3.returncode == 0 and json.loads(r3.stdout)["stats"]["mode"] == "rejection"


@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/nonexistent.gguf", "--prompt", "x"], "target model file not found"),
    (["generate", "--model", "{target}", "--drafter", "{target}", "--prompt", "x"], "not a DFlash drafter"),
    (["generate", "--model", "{target}", "--drafter", "{drafter}", "--prompt", "x", "--draft-len", "40"],
     "exceeds the drafter's block"),
    (["generate", "--model", "{target}", "--prompt-file", "/nonexistent.txt"], "cannot read prompt file"),
    (["generate", "--model", "{target}", "--drafter", "{truncated}", "--prompt", "x"], "truncated"),
    (["generate", "--model", "{target}", "--prompt", "x " * 300, "--n-ctx", "256"], "but n_ctx is 256"),
    (["generate", "--model", "{target}"], "one of the arguments --prompt --prompt-file is required"),
    (["generate", "--model", "{target}", "--prompt", "x", "--max-tokens", "zero"], "invalid int value"),
    (["generate", "--model", "{target}", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--model", "{target}", "--prompt", "x", "--mode", "best"], "invalid choice"),
] + [(["generate", "--model", "{target}", "--prompt", "x", flag, value], want) for flag, value, want in [
    ("--threads", "0", "outside 1.."), ("--threads", "-1", "outside 1.."),
    ("--temperature", "nan", "temperature must be >= 0"), ("--temperature", "inf", "temperature must be >= 0"),
    ("--top-p", "-0.5", "top-p must be"), ("--top-p", "nan", "top-p must be"), ("--top-k", "-5", "outside 0.."),
    ("--min-p", "2", "min-p must be"), ("--min-p", "-1", "min-p must be"), ("--min-p", "nan", "min-p must be"),
    ("--repeat-penalty", "0", "repeat-penalty must be > 0"), ("--repeat-penalty", "-1", "repeat-penalty must be"),
    ("--repeat-penalty", "nan", "repeat-penalty must be"), ("--repeat-penalty", "inf", "repeat-penalty must be"),
    ("--max-tokens", str(2**63), "outside 1.."), ("--draft-len", str(2**31), "outside 0.."),
    ("--n-ctx", str(2**31), "outside 1.."), ("--seed", str(2**64), "outside -1.."), ("--seed", "-2", "outside -1..")]]
    + [(["inspect", path], want) for path, want in [
        ("{fifo}", "is not a regular file"), ("{dir}", "is not a regular file"), ("/nonexistent", "file not found"),
        ("{garbage}", "not a valid GGUF file"), ("{target}", "not a DFlash drafter"), ("{truncated}", "truncated")]])
def test_user_errors_are_one_line(artifacts, tmp_path, args, msg):
    """Every bad value is a one-line error with exit 2 (no traceback, no silent acceptance)."""
    a = artifacts["llama"]
    trunc = tmp_path / "t.gguf"
    trunc.write_bytes(open(a["drafter"], "rb").read()[:5000])
    fifo, garbage = tmp_path / "fifo", tmp_path / "garbage.gguf"
    os.mkfifo(fifo)  # opening it for reading would block: it must be refused before any read
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    args = [x.format(target=a["target"], drafter=a["drafter"], truncated=trunc, fifo=fifo, dir=tmp_path,
                     garbage=garbage) for x in args]
    r = run(*args)
    assert r.returncode == 2
    # (the f32 target fails exact mode's self-check: the default mode, said in its own logged line)
    lines = [x for x in r.stderr.strip().splitlines() if "exact mode off" not in x]
    assert len(lines) == 1 and lines[0].startswith("llama-dflash: error:") and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_diff_reports_and_classifies(artifacts):
    """The default mode's divergences (the f32 target's verify batches round apart at near-ties) are
    classified, not reported as bugs: the first prompt of a few that diverges on this CPU (which
    one depends on its rounding) is certified by replaying the speculative batches, and the same
    divergence by margins alone is a near-tie, or a mismatch (exit 1) with a tiny eps."""
    a = artifacts["llama"]
    base = ["diff", "--model", a["target"], "--drafter", a["drafter"], "--n-ctx", "256", "--json",
            "--speculation", "on", "--default-mode", "--max-tokens", "64"]
    prompts = ["# TODO: fix the", "Hello", "one two three four", "def main():", "The weather today is"]
    rep = prompt = None
    for prompt in prompts:
        r = run(*base, "--prompt", prompt)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        if rep["identical"]:
            assert rep.get("position") is None
        else:
            break
    assert rep is not None and not rep["identical"], "no prompt diverged: nothing classified"
    # certified by replaying the speculative batches in plain llama-cpp-python (tests/test_certify.py)
    assert rep["verdict"] == "batch-numerics", rep
    assert rep["replay"]["certified"] and rep["replay"]["gap_in_spec_batches"] < 0
    margin = min(rep["plain_margin"], rep["spec_margin"])
    r = run(*base, "--prompt", prompt, "--no-replay")
    want = "near-tie" if margin < 0.1 else "mismatch"
    assert r.returncode == (0 if want == "near-tie" else 1) and json.loads(r.stdout)["verdict"] == want
    # by margins alone, with an eps below the margin, the same divergence is reported as a mismatch
    r = run(*base, "--prompt", prompt, "--eps", str(margin / 2), "--no-replay")
    assert r.returncode == 1 and json.loads(r.stdout)["verdict"] == "mismatch"
    r = run("diff", "--model", a["target"], "--drafter", a["drafter"], "--prompt", "x", "--temperature", "1",
            "--mode", "rejection")
    assert r.returncode == 2 and "not seed-identical" in r.stderr


def test_demo_runs(tmp_path):
    """The README's main job, briefly: the default SmolLM2 target, a drafter, both runs, the verdict."""
    import os

    env = dict(os.environ, LLAMA_DFLASH_CACHE=os.environ.get("LLAMA_DFLASH_CACHE", str(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", "demo", "--max-tokens", "12", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    # the adaptive default may verify no draft in 12 tokens: what ran is in its stats
    spec = out["speculative"]["stats"]
    assert out["plain"]["stats"]["drafted"] == 0 and spec["adaptive"] and sum(spec["lengths"]) == spec["steps"]
    assert out["ceiling_tokens_per_s"] > 0
    assert len(out["speculative"]["tokens"]) == 12 and isinstance(out["identical"], bool)
    assert out["divergence"]["identical"] == out["identical"]


def test_chat_streams_two_turns_with_stats(artifacts):
    """`llama-dflash chat` over a pipe: each turn streams a reply, then tau and tok/s on stderr;
    the second turn sees the first (the history is kept)."""
    a = artifacts["llama"]
    r = subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", "chat", "--model", a["target"], "--drafter",
                        a["drafter"], "--max-tokens", "8"], input="hello there\nand again\n/exit\nignored\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = [line for line in r.stderr.splitlines() if line.startswith("[") and "tau" in line]
    assert len(stats) == 2 and all("tok/s" in s for s in stats), r.stderr
    assert len(r.stdout.splitlines()) >= 2


def test_seed_minus_one_and_undecodable_paths_are_accepted(artifacts, tmp_path):
    """--seed -1 means random (llama.cpp's convention); a drafter at a path that is not UTF-8 loads."""
    import os
    import shutil

    a = artifacts["llama"]
    odd = os.path.join(os.fsencode(tmp_path), b"drafter-\xff.gguf")
    shutil.copyfile(a["drafter"], odd)
    r = run("generate", "--model", a["target"], "--drafter", os.fsdecode(odd), "--prompt", "Hello", "--max-tokens", "4",
            "--temperature", "0.8", "--seed", "-1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4


@pytest.mark.parametrize("missing", ["pydantic", "fastapi"])
def test_serve_without_server_extras(missing):
    """`llama-dflash serve` without the server extras says what to install, in one line (exit 2)."""
    code = (f"import sys; sys.modules[{missing!r}] = None  # as if not installed\n"
            "from llama_dflash.api.cli import main; sys.exit(main(['serve', '--help']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llama-dflash: error:"), r.stderr
    assert f"{missing} is missing" in lines[0] and "pip install 'llama-dflash[server]'" in lines[0]
