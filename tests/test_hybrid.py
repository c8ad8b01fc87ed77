"""Hybrid and recurrent targets: tiny random qwen35 (gated delta net + gated full attention), lfm2
(short convolutions + attention) and mamba targets written through gguf-py and loaded by the real
libllama.

qwen35 speculates: its context keeps n_rs_seq per-token snapshots of the recurrent state, and a
verify step's rejected rows are rolled back by restoring the snapshot after its last kept row.
With Q8_0 matrices (the small-batch kernels take every product) the verify batches and the
rollbacks are bit-exact, so exact mode holds; the f32 version is refused by the self-check.
mamba has no snapshots in llama.cpp: it is refused for speculation at load, with a warning.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import llama_cpp
import numpy as np
import pytest

import llama_dflash
from llama_dflash import DFlashError, SpeculativeGenerator
from llama_dflash.core import exact

from models import TargetSpec, drafter_config, exact_reference_llama, write_random_drafter, write_target

PROMPT = "The quick brown fox"
N_TOKENS = 120


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    out = {}
    for name, spec in (("q8", TargetSpec(arch="qwen35", seed=3, matrix_type="q8_0", tied=False, output_type="q8_0")),
                       ("f32", TargetSpec(arch="qwen35", seed=4)),
                       ("lfm2", TargetSpec(arch="lfm2", seed=6, matrix_type="q8_0", tied=False, output_type="q8_0")),
                       ("mamba", TargetSpec(arch="mamba", seed=5))):
        t = write_target(str(d / f"{name}.gguf"), spec)
        out[name] = {"target": t, "drafter": write_random_drafter(str(d / f"{name}-drafter.gguf"), t,
                                                                  drafter_config(spec), seed=spec.seed + 10)}
    return out


def _our_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llama_dflash"]


def test_qwen35_drafts_and_equals_plain_llama_cpp(hybrid, monkeypatch):
    """The drop-in class on the hybrid target drafts (drafted > 0) in exact mode, with the context's
    n_rs_seq as long as its drafts, and its greedy output over 120 tokens is llama_cpp.Llama's."""
    a = hybrid["q8"]
    llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=512, n_threads=2, verbose=False,
                             exact=True, speculation="on", draft_n_max=7)
    ref = exact_reference_llama(a["target"], monkeypatch, n_ctx=512, n_threads=2)
    try:
        assert llama_cpp.llama_n_rs_seq(llm._ctx.ctx) == 7 == llm.draft_n_max
        got = llm(PROMPT, max_tokens=N_TOKENS, temperature=0.0)
        st = llm.last_speculative_stats
        want = ref(PROMPT, max_tokens=N_TOKENS, temperature=0.0)
        assert st.drafted > 0 and st.steps > 0, st
        assert st.exact.startswith("self-check passed"), st.exact
        assert got["usage"]["completion_tokens"] >= 100
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    finally:
        llm.close()
        ref.close()


def test_default_mode_equals_plain_decoding(hybrid):
    """exact=False (llama.cpp's own kernels): every draft length and the adaptive policy give the
    plain greedy tokens (the Q8_0 target's batches round alike here too)."""
    a = hybrid["q8"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_threads=2, exact=False) as g:
        toks = g.tokenize(PROMPT)
        plain = g.generate(toks, N_TOKENS, draft_len=0).tokens
        assert len(plain) == N_TOKENS
        for n in (1, 4, 15):
            r = g.generate(toks, N_TOKENS, draft_len=n, speculation="on")
            assert r.tokens == plain, n
            assert r.stats.drafted > 0
        assert g.generate(toks, N_TOKENS).tokens == plain  # adaptive (measures the costs: whole-batch restores)


def _oracle_source(truth: list[int], n_prompt: int, rng: np.random.Generator):
    """Drafts that follow the plain output up to a random slot and are wrong from there: every step
    rolls back a different number of rows (all of them, some, or none)."""
    def source(hist, n):
        at = len(hist) - n_prompt  # generated tokens so far (the anchor is the last)
        nxt = truth[at:at + n]
        cut = int(rng.integers(0, n + 1))
        return [t if i < cut else (t + 1 + int(rng.integers(0, 50))) % 1024 for i, t in enumerate(nxt)]
    return source


@pytest.mark.parametrize("name", ["q8", "lfm2"])
def test_rollbacks_leave_the_target_bit_identical_to_a_fresh_decode(hybrid, name):
    """After a generation of many partly rejected steps, the target's state is what decoding the
    committed tokens one by one gives: the next token's logits are bitwise equal.  (A recurrent
    state merely truncated, not restored, would still hold the rejected rows.)  qwen35's gated
    delta net and lfm2's short convolutions alike."""
    a = hybrid[name]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_threads=2, exact=True) as g:
        ctx, n_vocab = g._ctx, g.n_vocab
        toks = g.tokenize(PROMPT)
        truth = g.generate(toks, N_TOKENS, draft_len=0).tokens
        steps = []
        r = g.generate(toks, N_TOKENS, draft_len=8, speculation="on", on_step=steps.append,
                       draft_source=_oracle_source(truth, len(toks), np.random.default_rng(0)))
        assert r.tokens == truth
        rolled = [s["drafted"] - s["accepted"] for s in steps]
        assert sum(x > 0 for x in rolled) >= 20 and len(set(rolled)) >= 5, rolled  # many sizes of rollback
        pos = len(toks) + len(truth) - 1  # the KV holds every committed token but the last
        assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx), 0) == pos - 1
        after = exact._decode(ctx, [truth[-1]], pos, n_vocab, True)
        mem = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_clear(mem, True)
        exact._decode(ctx, toks, 0, n_vocab, False)
        exact._decode(ctx, truth[:-1], len(toks), n_vocab, True)
        fresh = exact._decode(ctx, [truth[-1]], pos, n_vocab, True)
        assert np.array_equal(after, fresh), float(np.abs(after - fresh).max())
        # the comparison sees the recurrent state: one rejected token left in it changes the logits
        llama_cpp.llama_memory_clear(mem, True)
        exact._decode(ctx, toks, 0, n_vocab, False)
        exact._decode(ctx, truth[:-2] + [(truth[-2] + 1) % n_vocab], len(toks), n_vocab, True)
        assert not np.array_equal(exact._decode(ctx, [truth[-1]], pos, n_vocab, True), fresh)
        g._core.forget()


def test_prefix_reuse_on_a_hybrid_target(hybrid):
    """reuse_prefix continues from the previous generation's state only where nothing must be
    removed (the recurrent state has no older snapshot); either way the output is plain output.
    (The default mode, whose prefill batches of 16 rows round as its one-token decodes here: exact
    mode reuses only whole prefill chunks.)"""
    a = hybrid["q8"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_batch=16, n_threads=2, exact=False) as g:
        assert g._core.n_rs_seq == 14  # (n_ubatch 16: llama.cpp keeps a batch's last n_rs_seq + 1 rows in one)
        toks = g.tokenize(PROMPT)
        first = g.generate(toks, 40, draft_len=4, speculation="on", reuse_prefix=True)
        follow = toks + first.tokens + g.tokenize(" and then", add_special=False)
        r = g.generate(follow, 40, draft_len=4, speculation="on", reuse_prefix=True)
        assert r.stats.n_reused == len(toks) + len(first.tokens) - 1
        shorter = g.generate(toks[:-1], 40, draft_len=4, speculation="on", reuse_prefix=True)  # a rollback past
        assert shorter.stats.n_reused == 0                                                        # the snapshots
        for p, got in ((follow, r), (toks[:-1], shorter)):
            assert got.tokens == g.generate(p, 40, draft_len=0).tokens


def _refused_then_default_mode(a: dict, caplog, refusal: str, logged: str, n_tokens: int):
    """exact=True refuses the pair with ``refusal``; exact="auto" loads it in the default mode, logs
    ``logged`` and speculates: that generation's stats."""
    with pytest.raises(DFlashError, match=refusal):
        SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, n_threads=2, exact=True)
    with caplog.at_level(logging.WARNING, logger="llama_dflash"):
        g = SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, n_threads=2, exact="auto")
    with g:
        assert any(logged in m for m in _our_lines(caplog))
        return g.generate(g.tokenize(PROMPT), n_tokens, draft_len=4, speculation="on").stats


def test_exact_mode_refuses_a_hybrid_target_that_is_not_invariant(hybrid, caplog):
    """The f32 target: its matrix products round apart for 1 and 2 rows, so neither the batches nor
    the rollbacks are exact: exact=True refuses it, "auto" speculates in the default mode and says
    why."""
    st = _refused_then_default_mode(hybrid["f32"], caplog, "self-check failed", "exact mode off", 30)
    assert st.exact.startswith("not exact: self-check failed") and st.drafted > 0


def test_rollback_probe_tells_exact_from_inexact_restores(hybrid, monkeypatch, caplog):
    """The self-check's rollback probe: 0.0 on the Q8_0 target, > 0 on the f32 one; a target whose
    batches pass but whose rollbacks do not (simulated) is refused by exact=True with that reason,
    and "auto" falls back to the default mode with it logged."""
    for name, exact_ok in (("q8", True), ("f32", False)):
        m = llama_cpp.llama_model_load_from_file(hybrid[name]["target"].encode(),
                                                 llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_rs_seq, cp.n_threads, cp.n_threads_batch = 256, 64, 64, 4, 2, 2
        ctx = llama_cpp.llama_init_from_model(m, cp)
        try:
            diff = exact._rollback_probe(ctx, 1024, 6, 4, np.random.default_rng(0))
            assert (diff == 0.0) == exact_ok, (name, diff)
        finally:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(m)
    a = hybrid["q8"]
    monkeypatch.setattr(exact, "_rollback_probe", lambda *args: 3e-4)
    monkeypatch.setattr(exact, "_cached", lambda key: None)
    monkeypatch.setattr(exact.JsonStore, "put", lambda *args: None)
    st = _refused_then_default_mode(a, caplog, "after rolling back rejected rows the next logits differ",
                                    "after rolling back", 20)
    assert st.drafted > 0


def test_capture_on_the_hybrid_graph(hybrid):
    """Layer inputs (set for the recurrent and the attention layers alike) and the cb_eval path's
    l_out-N tensors give the same features, for taps on both kinds of layer."""
    a = hybrid["q8"]
    feats = {}
    for mode in ("layer_inp", "cb_eval"):
        with SpeculativeGenerator(a["target"], n_ctx=256, n_threads=2, capture=mode,
                                  capture_layers=[0, 2, 3]) as g:  # (layer 2: full attention)
            feats[mode] = g.features(g.tokenize("Hello there, hybrid world"))
    assert feats["layer_inp"].shape[1] == 3 * 64
    assert np.array_equal(feats["layer_inp"], feats["cb_eval"])


def test_n_rs_seq_bounds_the_drafts(hybrid):
    """draft_n_max=3: the context keeps 3 snapshots; a longer draft length asked later is clamped
    to them (never a verify batch the snapshots cannot roll back), by the engine core and, below
    it, by the C loop itself; the output is unchanged."""
    a = hybrid["q8"]
    llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=512, n_threads=2, verbose=False,
                             draft_n_max=3, speculation="on")
    try:
        assert llama_cpp.llama_n_rs_seq(llm._ctx.ctx) == 3 and llm.draft_n_max == 3
        want = llm(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        llm.draft_n_max = 12
        for bypass in (False, True):
            if bypass:
                llm._core.n_rs_seq = None  # (the core's clamp off: 12 reaches the C loop)
            steps = []
            llm.on_step = steps.append
            assert llm(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"] == want
            assert steps and max(s["drafted"] for s in steps) == 3, (bypass, steps)
    finally:
        llm.close()


def test_rollback_architectures_are_llama_cpps(hybrid):
    """engine.RS_ROLLBACK_ARCHS (what a vocab-only load answers from) agrees with what the loaded
    libllama grants: a context asking for snapshots gets them for qwen35 and lfm2, 0 for mamba."""
    from llama_dflash.core import engine

    for name, rolls in (("q8", True), ("lfm2", True), ("mamba", False)):
        m = llama_cpp.llama_model_load_from_file(hybrid[name]["target"].encode(),
                                                 llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_rs_seq = 256, 8, 8, 2
        ctx = llama_cpp.llama_init_from_model(m, cp)
        try:
            assert (llama_cpp.llama_n_rs_seq(ctx) == 2) == rolls == (engine.arch(m) in engine.RS_ROLLBACK_ARCHS)
            assert (engine.target_refusal(m) is None) == rolls
        finally:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(m)


def test_a_ubatch_too_small_for_snapshots_is_refused(hybrid):
    """llama.cpp aborts a decode unless n_ubatch exceeds n_rs_seq + 1: refused up front instead."""
    a = hybrid["q8"]
    with pytest.raises(DFlashError, match=r"n_ubatch >= 3 \(got 2\)"):
        SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, n_batch=2, n_threads=2, exact=False)


def test_a_target_without_rollback_is_refused_at_load(hybrid, caplog, tmp_path):
    """mamba (recurrent, no snapshots in llama.cpp): one warning at load on Llama (logged and a
    Python warning), the generator and the server, which decode plainly; the CLI, asked for a
    drafter, refuses with a one-line error (exit 2)."""
    a = hybrid["mamba"]
    with caplog.at_level(logging.WARNING, logger="llama_dflash"), pytest.warns(UserWarning, match="not speculating"):
        llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=256, n_threads=2, verbose=False)
    try:
        lines = _our_lines(caplog)
        assert len(lines) == 1 and "recurrent target 'mamba'" in lines[0] and "n_rs_seq" in lines[0], lines
        assert "\n" not in lines[0]
        out = llm("Hello", max_tokens=8, temperature=0.0)
        assert out["usage"]["completion_tokens"] == 8
        assert "cannot roll back rejected drafts" in llm.last_speculative_stats.fallback_reason
    finally:
        llm.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llama_dflash"):
        g = SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, n_threads=2)
    with g:
        assert len(_our_lines(caplog)) == 1
        r = g.generate(g.tokenize("Hello"), 8, draft_len=4, speculation="on")
        assert len(r.tokens) == 8 and r.stats.drafted == 0
    cli = subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", "generate", "--model", a["target"], "--drafter",
                          a["drafter"], "--prompt", "Hello", "--max-tokens", "4", "--n-ctx", "256"],
                         capture_output=True, text=True, timeout=300)
    # the CLI, asked for a drafter it cannot use: a one-line error, exit 2 (inspect --target's verdict)
    lines = cli.stderr.strip().splitlines()
    assert cli.returncode == 2 and len(lines) == 1, cli.stderr
    assert "--drafter: recurrent target 'mamba'" in lines[0] and "cannot roll back" in lines[0], lines
    from llama_dflash.api.server import DFlashModelSettings, DFlashServerSettings, create_app

    caplog.clear()
    ms = DFlashModelSettings(model=a["target"], model_alias="m", draft_model_path=a["drafter"], n_ctx=256,
                             n_threads=2, verbose=False)
    with caplog.at_level(logging.WARNING, logger="llama_dflash"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        create_app(server_settings=DFlashServerSettings(host="127.0.0.1", port=1), model_settings=[ms])
    assert any("not speculating: recurrent target 'mamba'" in m for m in _our_lines(caplog))
