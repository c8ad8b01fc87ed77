"""Concurrent generations stepped together (core/group.py, ``Llama(parallel=N).view()``).

Exact mode makes the claim checkable bit for bit: every request served concurrently -- its
drafts verified in decodes shared with the others' -- gives the tokens it gives alone, greedy
and seeded, and even drafts and accepts the same (the features each sequence's drafter sees are
its own rows of the joint batch).  The default mode (a unified KV cache) is checked for what it
guarantees: every request served, completions whole, slots freed and reused.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_exact import PROMPTS  # the exact-mode prompt kinds: code, prose, JSON, French, repetition, SQL, chat

import llama_dflash
from llama_dflash import DFlashError
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core.engine import EngineRequest
from llama_dflash.formats.config import DrafterConfig

from models import cached_random_drafter, real_target


def _concurrently(llm, calls):
    """Run each call(view) in a thread of its own, all at once; their results in order."""
    out: list = [None] * len(calls)
    errors: list = []
    go = threading.Barrier(len(calls))

    def work(i):
        try:
            v = llm.view()
            go.wait()
            out[i] = (calls[i](v), v.last_speculative_stats)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    return out


def _text(llm, p, **kw):
    return llm.create_completion(p, max_tokens=kw.pop("max_tokens", 32), **kw)["choices"][0]["text"]


@pytest.mark.parametrize("speculation,parallel,n_max", [("on", 2, 3), ("on", 3, 1), ("auto", 4, None)])
def test_concurrent_requests_equal_alone_exact(speculation, parallel, n_max):
    """6 greedy and 2 seeded requests at once: each equals the same request alone (the model's
    own loop); with fixed drafts that fit their share of the joint batch (exact mode: the 8 rows
    the self-check proved), acceptance is what it is alone (each drafter sees its own sequence's
    features; joint decodes verify equally many rows per sequence, so a draft is sometimes cut)."""
    llm = llama_dflash.Llama(str(default_target()), draft_model_path=str(shipped_drafter()), n_ctx=512,
                             verbose=False, exact=True, speculation=speculation, parallel=parallel,
                             draft_n_max=n_max)
    try:
        cases = [(p, dict(temperature=0.0, max_tokens=24)) for p in PROMPTS[:6]]
        cases += [(p, dict(temperature=0.8, seed=s, max_tokens=24)) for p, s in zip(PROMPTS[6:], (1, 2), strict=True)]
        alone = []
        for p, kw in cases:
            alone.append((_text(llm, p, **kw), llm.last_speculative_stats))
        got = _concurrently(llm, [lambda v, p=p, kw=kw: _text(v, p, **kw) for p, kw in cases])
        for (p, kw), (a, _), (g, sg) in zip(cases, alone, got, strict=True):
            assert g == a, (p, kw)
            assert sg.exact.startswith("self-check passed")
        if speculation == "on":
            rate = [sum(s.accepted for s in st) / sum(s.drafted for s in st)
                    for st in ([s for _, s in alone], [s for _, s in got])]
            assert rate[1] > 0.85 * rate[0] > 0, rate
        js = llm.joint_stats
        assert js["joint_sequences"] > 1.5 * js["joint_steps"] > 0  # the decodes were shared
        if speculation == "on":
            assert sum(s.drafted for _, s in got) > 0
    finally:
        llm.close()


def test_gemma3_concurrent_through_cb_eval_exact():
    """Gemma-3 (cb_eval capture: the group's context has a capture of its own)."""
    target = str(real_target("gemma-3-270m"))
    cfg = DrafterConfig(n_layer=1, n_embd=640, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, block_size=8,
                        target_layers=[1, 9, 15], mask_token_id=262143, rope_theta=10000.0, rms_eps=1e-6)
    d = cached_random_drafter("gemma-3-270m-exact", cfg, target, seed=2)
    llm = llama_dflash.Llama(target, n_ctx=512, verbose=False, draft_model_path=str(d), exact=True,
                             speculation="on", parallel=2, draft_n_max=2)  # (its self-check: 7 rows)
    try:
        alone = [(_text(llm, p, max_tokens=16, temperature=0.0), llm.last_speculative_stats) for p in PROMPTS[:3]]
        got = _concurrently(llm, [lambda v, p=p: _text(v, p, max_tokens=16, temperature=0.0) for p in PROMPTS[:3]])
        for (a, _), (g, sg) in zip(alone, got, strict=True):
            assert g == a
            assert sg.drafted > 0
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_default_mode_serves_every_request(artifacts, arch):
    """Unified KV cache (the default): streams, stop strings, logprobs and stopping criteria in
    slots; more requests than slots wait for one; early stops free their slot."""
    a = artifacts[arch]
    llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=256, verbose=False,
                             speculation="on", parallel=2)
    try:
        def stream(v):
            chunks = list(v.create_completion("the quick", max_tokens=12, temperature=0.0, stream=True))
            return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

        def logprobs(v):
            r = v.create_completion("a b c", max_tokens=6, temperature=0.0, logprobs=3)
            return r["choices"][0]["logprobs"]["token_logprobs"], r["usage"]["completion_tokens"]

        def stops_early(v):
            for i, _ in enumerate(v.generate(v.tokenize(b"hello"), temp=0.0)):
                if i == 2:
                    return i

        def sampled(v):
            r = v.create_completion("x y z", max_tokens=32, temperature=0.7, seed=3)
            return r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"], r["choices"][0]["text"]

        calls = [stream, logprobs, stops_early] * 2 + [sampled]  # (7 requests, 2 slots: most wait for one)
        got = [r for r, _ in _concurrently(llm, calls)]
        for r in got[0::3][:2]:
            assert r[1] in ("length", "stop") and r[0]
        for lp, n in got[1::3][:2]:
            assert len(lp) == n and all(np.isfinite(x) and x <= 0 for x in lp)
        assert got[2] == got[5] == 2
        finish, n, _ = got[6]  # whole: its 32 tokens, or ended by the model
        assert (finish == "length" and n == 32) or (finish == "stop" and n < 32), got[6]
        assert llm._group.load == (0, 0)  # every slot free again
    finally:
        llm.close()


def test_views_and_the_group_refuse_bad_input(artifacts):
    a = artifacts["llama"]
    with pytest.raises(ValueError, match="parallel"):
        llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=256, verbose=False, parallel=0)
    llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], n_ctx=256, verbose=False, parallel=2)
    try:
        v = llm.view()
        with pytest.raises(ValueError, match="context window"):
            v.create_completion("hi " * 400, max_tokens=4)
        g = llm._group
        with pytest.raises(ValueError, match="outside the vocabulary"):
            g.submit([10**8], EngineRequest(max_tokens=4))
        with pytest.raises(ValueError, match="positions of a concurrent slot"):
            g.submit([1, 2, 3], EngineRequest(max_tokens=10**4))
        # the base class's own paths (echo + logprobs) run on the model itself: the same outcome
        for who in (llm, v):
            with pytest.raises(ValueError, match="logits_all=False"):
                who.create_completion("a b", max_tokens=4, temperature=0.0, echo=True, logprobs=2)
        v.close()  # a view closes nothing
        assert _text(v, "a b", max_tokens=4, temperature=0.0)
    finally:
        llm.close()
    with pytest.raises(DFlashError, match="closed"):
        llm.view()


def test_a_model_without_a_drafter_serves_concurrently(artifacts):
    """parallel > 1 without a drafter: plain steps, still shared decodes."""
    a = artifacts["llama"]
    llm = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, parallel=3)
    try:
        got = _concurrently(llm, [lambda v, i=i: v.create_completion(f"w{i} w{i}", max_tokens=10, temperature=0.0)
                                  for i in range(6)])
        for r, st in got:  # each whole, in plain steps
            c = r["choices"][0]
            assert (c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10) or \
                (c["finish_reason"] == "stop" and r["usage"]["completion_tokens"] < 10), r
            assert st.drafted == 0 and sum(st.lengths[1:]) == 0, st
        assert llm.joint_stats["joint_sequences"] > llm.joint_stats["joint_steps"] > 0
        assert llm.draft_n_max == 0
    finally:
        llm.close()


def test_exact_mode_serves_at_most_its_invariant_rows_at_once():
    llm = llama_dflash.Llama(str(default_target()), draft_model_path=str(shipped_drafter()), n_ctx=256,
                             verbose=False, exact=True, parallel=64)
    try:
        assert llm.parallel == llm._core.exact.max_rows == llm._group.n_seq >= 2
    finally:
        llm.close()
