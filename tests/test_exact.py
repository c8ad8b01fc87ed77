"""Exact mode: speculative output bit-identical to plain decoding (strict equality, nothing certified).

A representative subset of the full matrix (bench/bench_exact.py runs it whole): prompts of
every kind × greedy and T = 0.8 with seeds × DFlash v1 / DFlash2 random-weight drafters and the
shipped drafter × n = 1, 3, 7, 15, on Q4_0 and Q8_0 llama targets and the Gemma-3 target through
cb_eval capture; equality with llama_cpp.Llama under the same settings; prompt reuse; the
self-check refusing configurations that are not batch-invariant (the tests' tiny f32 targets,
Q4_0 without flash attention).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import llama_cpp
import pytest

import llama_dflash
from llama_dflash import DFlashError, SamplingParams, SpeculativeGenerator
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core import exact

from models import TargetSpec, cached_random_drafter, exact_reference_llama, real_target, write_target

PROMPTS = [
    "def binary_search(xs, x):\n",
    "Write a haiku about autumn rain.",
    '{"name": "Ada", "languages": [',
    "Traduis en français : le chat dort sur le canapé.",
    "one two three one two three one two three",
    "SELECT name, COUNT(*) FROM users",
    "The mitochondria is",
    "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
]


def _same(g, prompt, n, sampling=None, max_tokens=40):
    toks = g.tokenize(prompt)
    a = g.generate(toks, max_tokens, draft_len=n, sampling=sampling)
    b = g.generate(toks, max_tokens, draft_len=0, sampling=sampling)
    assert a.stats.exact.startswith("self-check passed"), a.stats.exact
    return a.tokens == b.tokens, a.stats


@pytest.fixture(scope="module")
def smollm2_random_drafters(tmp_path_factory):
    """Random-weight DFlash v1 (block 16) and DFlash2 (block 8) drafters shaped for SmolLM2."""
    from llama_dflash.formats.config import DrafterConfig
    from llama_dflash.formats.gguf import random_drafter_tensors, write_drafter

    d = tmp_path_factory.mktemp("exact")
    base = dict(n_layer=1, n_embd=576, n_ff=512, n_head=9, n_head_kv=3, head_dim=64, target_layers=[1, 14, 27],
                mask_token_id=16, rope_theta=100000.0, rms_eps=1e-5)
    out = {}
    for name, extra in (("v1", dict(block_size=16)),
                        ("v2", dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                                    selector_top_k=4, n_vocab=49152))):
        cfg = DrafterConfig(**base, **extra)
        out[name] = d / f"{name}.gguf"
        write_drafter(out[name], cfg, random_drafter_tensors(cfg, seed=4, std=0.05), default_target(), outtype="f16")
    return out


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_random_drafters_every_draft_length(smollm2_random_drafters, which):
    with SpeculativeGenerator(default_target(), smollm2_random_drafters[which], n_ctx=512, exact=True) as g:
        cap = g.max_draft_len
        for i, p in enumerate(PROMPTS):
            n = min((1, 3, 7, 15)[i % 4], cap)  # every draft length, two prompts each
            same, st = _same(g, p, n, max_tokens=20)
            assert same, (which, p, n)
            if i % 2 == 0:
                same, st = _same(g, p, n, sampling=SamplingParams(temperature=0.8, seed=i + 1), max_tokens=20)
                assert same and st.mode == "match", (which, p)


def test_f32_target_is_refused(artifacts):
    """The tests' tiny f32 targets: f32 matrix products take another path for 2 rows than for 1.
    exact=True refuses them; exact="auto" runs in the default mode and says why in the stats."""
    a = artifacts["llama"]
    with pytest.raises(DFlashError, match="self-check failed: a 2-row batch differs"):
        SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, exact=True)
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, exact="auto") as g:
        st = g.generate(g.tokenize("Hello"), 8, draft_len=3).stats
        assert st.exact.startswith("not exact: self-check failed") and st.drafted > 0
    with pytest.raises(ValueError, match="exact must be"):
        SpeculativeGenerator(a["target"], exact="yes")


@pytest.mark.parametrize("ftype", ["q4_0", "q8_0"])
def test_shipped_drafter_on_smollm2(ftype):
    with SpeculativeGenerator(default_target(ftype), shipped_drafter(), n_ctx=1024, exact=True) as g:
        drafted = 0
        for i, p in enumerate(PROMPTS if ftype == "q4_0" else PROMPTS[::3]):
            same, st = _same(g, p, (3, 7)[i % 2], max_tokens=32)
            assert same, (ftype, p)
            drafted += st.drafted
            for seed in (1, 2, 3) if i == 0 else ():
                same, _ = _same(g, p, 7, sampling=SamplingParams(temperature=0.8, seed=seed), max_tokens=24)
                assert same, (ftype, p, seed)
        assert drafted > 0


def test_drop_in_equals_llama_cpp_under_the_same_settings(monkeypatch):
    target = str(default_target())
    llm = llama_dflash.Llama(target, n_ctx=1024, verbose=False, draft_model_path=str(shipped_drafter()), exact=True)
    ref = exact_reference_llama(target, monkeypatch, n_ctx=1024)
    try:
        repacked = exact.weight_layout(target)  # on this CPU: True (Q4_0's repacked kernels are invariant)
        assert llm.exact and llm.model_params.use_extra_bufts == repacked == llm._core.exact.repacked
        for p in PROMPTS[:4]:
            got = llm(p, max_tokens=32, temperature=0.0)["choices"][0]["text"]
            assert got == ref(p, max_tokens=32, temperature=0.0)["choices"][0]["text"], p
            assert llm.last_speculative_stats.exact.startswith("self-check passed")
            got = llm(p, max_tokens=24, temperature=0.8, seed=5)["choices"][0]["text"]
            assert got == ref(p, max_tokens=24, temperature=0.8, seed=5)["choices"][0]["text"], p
        # a second chat turn (after the first: whatever the cache holds) gives what the whole
        # conversation gives fresh -- the reference is reset: llama_cpp.Llama's own prefix reuse
        # evaluates the rest in another split, whose last bits differ (canonical prefill, §5.10)
        msgs = [{"role": "user", "content": "Name a colour."}]
        for turn in range(2):
            ref.reset()
            want = ref.create_chat_completion(msgs, max_tokens=24, temperature=0.0)["choices"][0]["message"]
            got = llm.create_chat_completion(msgs, max_tokens=24, temperature=0.0)["choices"][0]["message"]
            assert got["content"] == want["content"], turn
            msgs += [want, {"role": "user", "content": "And another one?"}]
        # a LlamaRAMCache hit restores a saved state: the next generation is still the fresh output
        ref.reset()
        want = ref(PROMPTS[0], max_tokens=24, temperature=0.0)["choices"][0]["text"]
        llm.set_cache(llama_cpp.LlamaRAMCache())
        for _ in range(2):
            assert llm(PROMPTS[0], max_tokens=24, temperature=0.0)["choices"][0]["text"] == want
    finally:
        llm.close()
        ref.close()


def test_output_does_not_depend_on_what_ran_before():
    """A prompt's output is the same fresh, after prompts that share a prefix with it (reused:
    whole prefill chunks only) and after unrelated ones -- what concurrent serving relies on."""
    target = str(default_target())
    llm = llama_dflash.Llama(target, n_ctx=1024, n_batch=64, verbose=False, draft_model_path=str(shipped_drafter()),
                             exact=True)
    try:
        lead = "<|im_start|>system\n" + "You answer briefly and precisely, in plain English. " * 8 + "<|im_end|>\n"
        asks = [lead + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                for q in ("Name a colour.", "Name a planet.", "What is 2 + 2?")]
        fresh = []
        for p in asks:
            llm.reset()
            fresh.append(llm(p, max_tokens=24, temperature=0.0)["choices"][0]["text"])
        assert llm.last_speculative_stats.n_reused == 0
        reused = 0
        for order in (asks, asks[::-1], [PROMPTS[0], *asks]):
            for p in order:
                got = llm(p, max_tokens=24, temperature=0.0)["choices"][0]["text"]
                reused = max(reused, llm.last_speculative_stats.n_reused)
                if p in asks:
                    assert got == fresh[asks.index(p)], p
        assert reused >= 64 and reused % 64 == 0  # the shared system prompt, in whole chunks
    finally:
        llm.close()


def test_gemma3_through_cb_eval(tmp_path):
    from llama_dflash.formats.config import DrafterConfig

    target = str(real_target("gemma-3-270m"))
    cfg = DrafterConfig(n_layer=1, n_embd=640, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, block_size=8,
                        target_layers=[1, 9, 15], mask_token_id=262143, rope_theta=10000.0, rms_eps=1e-6)
    d = cached_random_drafter("gemma-3-270m-exact", cfg, target, seed=2)
    llm = llama_dflash.Llama(target, n_ctx=512, verbose=False, draft_model_path=str(d), exact=True, speculation="on")
    try:
        assert llm._core.capture_mode == "cb_eval"
        verdict = llm._core.exact
        assert 2 <= verdict.max_rows and llm.draft_n_max == min(7, verdict.max_rows - 1)
        plain = llama_dflash.Llama(target, n_ctx=512, verbose=False, exact=True)  # same settings, no drafter
        for p in PROMPTS[:2]:
            got = llm(p, max_tokens=16, temperature=0.0)["choices"][0]["text"]
            assert llm.last_speculative_stats.drafted > 0
            assert got == plain(p, max_tokens=16, temperature=0.0)["choices"][0]["text"], p
        plain.close()
    finally:
        llm.close()


def test_weight_layout_keeps_the_layout_that_stays_invariant_longer(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(exact, "_layouts", {})
    path = str(default_target())
    # the small-batch kernels take every product of this Q4_0 file (Q4_0 and Q8_0 weights): repacked,
    # nothing probed; with them off, both layouts are probed as below
    assert exact._kernels_take_every_product(path)
    monkeypatch.setattr(exact, "_probe_layout", lambda *a: pytest.fail("probed although the kernels take all"))
    assert exact.weight_layout(path, 2) is True and not (tmp_path / "exact-verdicts.json").exists()
    monkeypatch.undo()
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(exact, "_layouts", {})
    monkeypatch.setattr(exact, "_kernels_take_every_product", lambda p: False)
    # the real probe: each layout's verdict on a throw-away load, the pick cached on disk (on a tiny
    # Q4_0 target: the same two layouts, probed in a second rather than a minute)
    path = write_target(str(tmp_path / "q4_0.gguf"), TargetSpec(tied=False, output_type="q4_0", matrix_type="q4_0"))
    # (its f32 embedding is a matrix the kernels do not read; so is a file that is not GGUF)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    assert not any(map(exact._kernels_take_every_product, (path, str(tmp_path / "bad.gguf"), str(tmp_path / "no"))))
    rows = {r: exact._probe_layout(path, 2, r) for r in (True, False)}
    assert all(2 <= n <= exact.PROBE_ROWS for n in rows.values())
    assert exact.weight_layout(path, 2) == (rows[True] >= rows[False])
    assert list(json.loads((tmp_path / "exact-verdicts.json").read_text()).values()) == [rows[True] >= rows[False]]
    # the rule, on made-up verdicts: more invariant rows win, a tie keeps llama.cpp's repacked default
    for probed, want in (({True: 16, False: 16}, True), ({True: 3, False: 7}, False), ({True: 7, False: 1}, True)):
        monkeypatch.setattr(exact, "_layouts", {})
        (tmp_path / "exact-verdicts.json").unlink()
        monkeypatch.setattr(exact, "_probe_layout", lambda p, t, r, probed=probed: probed[r])
        assert exact.weight_layout(path, 2) is want
        assert exact.weight_layout(path, 2) is want  # this process's memo
        assert list(json.loads((tmp_path / "exact-verdicts.json").read_text()).values()) == [want]
    # offloaded layers never repack; a file that does not load is left to the caller's own error
    assert exact.weight_layout(path, 2, n_gpu_layers=10) is False
    monkeypatch.setattr(exact, "_probe_layout", lambda p, t, r: None)
    assert exact.weight_layout(str(tmp_path / "missing.gguf"), 2) is False
    with pytest.raises(ValueError, match="does not exist"):
        llama_dflash.Llama(str(tmp_path / "missing.gguf"), exact=True, verbose=False)


def test_exact_past_256_positions():
    """Past 256 positions llama.cpp's one-token flash attention splits the KV across threads and
    rounds apart from a verify batch; exact mode runs the reference kernels.  Before that fix this
    HumanEval prompt (~170 tokens) diverged at T = 0.7 around its 95th generated token."""
    from llama_dflash.train.prompts import chatml, humaneval_prompts

    with SpeculativeGenerator(default_target(), shipped_drafter(), n_ctx=1024, exact=True) as g:
        toks = g.tokenize(chatml(humaneval_prompts()[0].text))
        assert len(toks) + 128 > 256
        for sp in (SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=1000), None):
            plain = g.generate(toks, 128, draft_len=0, sampling=sp).tokens
            assert len(toks) + len(plain) > 280
            for kw in (dict(draft_len=1, speculation="on"), dict(draft_len=3, speculation="on"), {}):
                assert g.generate(toks, 128, sampling=sp, **kw).tokens == plain, (sp, kw)


def test_self_check_probes_past_256_positions(tmp_path, monkeypatch):
    """Without the reference kernels the long probe finds the split-KV rounding; with them it passes."""
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    path = str(default_target())
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    try:
        for ref in (False, True):
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 1024, 128, 2, 2
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            ctx = llama_cpp.llama_init_from_model(model, cp)
            try:
                if ref:
                    assert exact.reference_kernels(ctx) == 1
                v = exact.self_check(ctx, model, None, 4, 2, repacked=True)
                if ref:
                    assert v.max_rows == 4 and v.first_diff == 0.0
                else:
                    assert v.max_rows == 1 and v.at_position == exact.PROBE_LONG and v.first_diff > 0
                    assert f"at position {exact.PROBE_LONG}" in v.describe()
            finally:
                llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)


def test_self_check_refuses_a_configuration_that_is_not_invariant(tmp_path, monkeypatch):
    """Q4_0 without flash attention: a 2-row batch already rounds differently."""
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    path = str(default_target())
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.flash_attn_type = 128, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(model, cp)
    try:
        v = exact.self_check(ctx, model, path, 8, 2)
        assert v.max_rows == 1 and v.first_diff > 0
        with pytest.raises(DFlashError, match="self-check failed: a 2-row batch differs"):
            exact.require(v)
        cached = json.loads((tmp_path / "exact-verdicts.json").read_text())
        assert cached[v.key]["max_rows"] == 1
        assert exact.self_check(ctx, model, path, 8, 2) == v  # the second time from the cache
        # a verdict measured while the placement did not hold (an rpc server lost: garbage compared) is
        # returned but never kept
        (tmp_path / "exact-verdicts.json").unlink()
        assert exact.self_check(ctx, model, path, 8, 2, healthy=lambda: False) == v
        assert not (tmp_path / "exact-verdicts.json").exists()
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    with pytest.raises(ValueError, match="needs flash attention"):
        SpeculativeGenerator(path, exact=True, flash_attn=False)


def test_cli_exact_diff_and_demo():
    target, drafter = str(default_target()), str(shipped_drafter())
    r = subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", "diff", "--model", target, "--drafter",
                        drafter, "--prompt", "def quicksort(xs):", "--max-tokens", "48", "--exact", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["identical"] and rep["exact"].startswith("self-check passed")
    r = subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", "demo", "--max-tokens", "48"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "greedy outputs bit-identical: yes (exact mode, self-check passed" in r.stdout


def _our_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llama_dflash"]


def test_exact_is_the_default_and_falls_back_in_one_logged_line(artifacts, caplog):
    """exact="auto" by default: a target the self-check refuses (the tests' f32 ones) runs in the
    default mode, said once in the log and in every generation's stats; a model without drafter
    or concurrent requests is llama-cpp-python's own (its settings untouched)."""
    a = artifacts["llama"]
    with caplog.at_level(logging.WARNING, logger="llama_dflash"):
        llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=256, verbose=False)
    try:
        assert llm.exact == "auto" and llm.options.exact == "auto"
        lines = _our_lines(caplog)
        assert len(lines) == 1 and "exact mode off" in lines[0] and "self-check failed" in lines[0], lines
        llm("the quick", max_tokens=6, temperature=0.0)
        assert llm.last_speculative_stats.exact.startswith("not exact: self-check failed")
    finally:
        llm.close()
    plain = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False)
    try:
        assert plain.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    finally:
        plain.close()


def test_exact_by_default_on_a_quantized_target(monkeypatch, caplog):
    """SmolLM2 Q4_0 with the shipped drafter and no exact argument: exact mode (self-checked, flash
    attention on) and output equal to llama_cpp.Llama under the same settings; flash_attn=False
    asked for: the default mode, said once; exact=True with it: refused."""
    target, drafter = str(default_target()), str(shipped_drafter())
    llm = llama_dflash.Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    ref = exact_reference_llama(target, monkeypatch, n_ctx=512)
    try:
        assert llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        for p in PROMPTS[:2]:
            assert llm(p, max_tokens=24, temperature=0.0)["choices"][0]["text"] == \
                ref(p, max_tokens=24, temperature=0.0)["choices"][0]["text"], p
            assert llm.last_speculative_stats.exact.startswith("self-check passed")
    finally:
        llm.close()
        ref.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llama_dflash"):
        llm = llama_dflash.Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False, flash_attn=False)
    try:
        lines = _our_lines(caplog)
        assert len(lines) == 1 and "flash_attn=False" in lines[0], lines
        llm("Hi", max_tokens=4, temperature=0.0)
        assert llm.last_speculative_stats.exact.startswith("not exact: flash_attn=False")
    finally:
        llm.close()
    with pytest.raises(ValueError, match="needs flash attention"):
        llama_dflash.Llama(target, draft_model_path=drafter, verbose=False, exact=True, flash_attn=False)


def test_joint_batches_are_self_checked(monkeypatch, caplog):
    """parallel > 1 in exact mode: the group's context gets the core's kernels and its joint batches
    are probed against plain decoding before any request; a target whose joint batches round apart
    serves one request at a time, said once in the log and in the stats."""
    target, drafter = str(default_target()), str(shipped_drafter())
    gaps: list[float] = []
    real = exact.joint_check
    monkeypatch.setattr(exact, "joint_check", lambda *a, **k: gaps.append(real(*a, **k)) or gaps[-1])
    llm = llama_dflash.Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False, parallel=2)
    try:
        assert gaps == [0.0] and llm.parallel == 2
        assert llm.view() is not llm
    finally:
        llm.close()
    monkeypatch.setattr(exact, "joint_check", lambda *a, **k: 0.125)
    with caplog.at_level(logging.WARNING, logger="llama_dflash"):
        llm = llama_dflash.Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False, parallel=2)
    try:
        lines = _our_lines(caplog)
        assert len(lines) == 1 and "joint batches of 2 sequences round apart" in lines[0], lines
        assert llm.parallel == 1 and llm.view() is llm
        llm("Hi", max_tokens=4, temperature=0.0)
        st = llm.last_speculative_stats.exact
        assert st.startswith("self-check passed") and "served one at a time" in st
    finally:
        llm.close()


def test_joint_probe_sees_a_context_that_rounds_apart(tmp_path, monkeypatch):
    """The joint probe compares bitwise, against plain decoding in the single-sequence context: a
    group context without flash attention (its 2-row batches round apart) is caught; one with
    exact mode's settings and kernels passes."""
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    path = str(default_target())
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.flash_attn_type = 512, 512, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctxs = [llama_cpp.llama_init_from_model(model, cp)]
    for fa in (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED):
        gp = llama_cpp.llama_context_params.from_buffer_copy(cp)
        gp.n_ctx, gp.n_seq_max, gp.kv_unified, gp.flash_attn_type = 1024, 2, False, fa
        ctxs.append(llama_cpp.llama_init_from_model(model, gp))
    ctx, no_fa, group = ctxs
    try:
        for c in ctxs:
            exact.reference_kernels(c)
        assert exact.joint_check(no_fa, ctx, model, None, 2, 8, 2, True) > 0.0
        assert exact.joint_check(group, ctx, model, None, 2, 8, 2, True) == 0.0
    finally:
        for c in ctxs:
            exact.reference_kernels(c, False)
            llama_cpp.llama_free(c)
        llama_cpp.llama_model_free(model)


def test_greedy_answers_repeat_by_default():
    """The same greedy request sent six times in a row to a Llama with the shipped drafter and no
    mode argument gives one answer: exact mode (the default) keeps the verify shapes the adaptive
    policy picks as it learns from changing the text (in the default mode they could)."""
    llm = llama_dflash.Llama(str(default_target()), draft_model_path=str(shipped_drafter()), n_ctx=512,
                             verbose=False)
    try:
        for p in PROMPTS[:3]:
            answers = {llm(p, max_tokens=48, temperature=0.0)["choices"][0]["text"] for _ in range(6)}
            assert len(answers) == 1, (p, answers)
    finally:
        llm.close()
