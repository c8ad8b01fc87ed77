"""The completion loop (llama_dflash.api.completion) against llama_cpp.Llama's own, chunk for chunk.

A scripted logits processor makes both models write the same known text (multi-byte
characters split over byte tokens, stop-string candidates), and a replay draft source feeds
the speculative model long accepted runs and rejections at every position, so the stop,
UTF-8 and streaming rules are exercised inside accepted runs as well as between steps.
"""

from __future__ import annotations

import copy
import math

import llama_cpp
import numpy as np
import pytest

import llama_dflash

TEXT = "Hé said: wörld ünïcödé → done. Then «more» text ends ✓ here"
PROMPT = "The story:"


def strip(x: dict) -> dict:
    return {k: v for k, v in x.items() if k not in ("id", "created")}


class Script:
    """A logits processor that forces `tokens` after the prompt, then EOS; it records every
    input_ids it is shown."""

    def __init__(self, tokens: list[int], n_prompt: int, eos: int) -> None:
        self.tokens, self.n_prompt, self.eos = tokens + [eos], n_prompt, eos
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, ids, scores):
        self.seen.append(tuple(int(t) for t in ids))
        i = len(ids) - self.n_prompt
        out = np.full_like(scores, -np.inf)
        out[self.tokens[min(i, len(self.tokens) - 1)]] = 0.0
        return out


@pytest.fixture(scope="module")
def models(artifacts):
    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False, logits_all=True)
    # the default mode's loop, chunk for chunk against llama_cpp.Llama at its defaults (exact mode would
    # load with flash attention: tests/test_exact.py compares it under the same settings)
    spec = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, draft_model_path=a["drafter"], draft_n_max=7,
                              speculation="on", exact=False)
    script = base.tokenize(TEXT.encode(), add_bos=False, special=False)
    assert base.detokenize(script).decode() == TEXT
    n_prompt = len(base.tokenize(PROMPT.encode(), add_bos=False, special=True))
    yield base, spec, script, n_prompt
    spec.close()
    base.close()


def replay(spec, script: list[int], n_prompt: int, corrupt_every: int):
    """Drafts = the script's continuation; every `corrupt_every`-th step has one wrong draft at a
    cycling position (0: never), so runs of every length are accepted and rejected."""
    state = {"step": 0}

    def draft(hist, n):
        done = len(hist) - n_prompt
        prop = script[done:done + n]
        state["step"] += 1
        if corrupt_every and state["step"] % corrupt_every == 0 and prop:
            bad = state["step"] % len(prop)
            prop[bad] = (prop[bad] + 1) % 1000
        return prop

    spec.draft_source = draft
    return draft


def close(a, b) -> bool:
    """Equal up to llama.cpp's batch numerics: a verify batch and plain's one-token batches give
    logits that differ by up to ~2e-2 on this random model's +-50 logits (plain llama-cpp-python
    differs from itself as much when it evaluates the same tokens in one batch; the tight
    comparison is test_logprobs_without_logits_all)."""
    return a is None and b is None or math.isclose(a, b, abs_tol=0.05)


def same_logprobs(got, want) -> None:
    if want is None:
        assert got is None
        return
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert all(close(g, w) for g, w in zip(got["token_logprobs"], want["token_logprobs"], strict=True))
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert g.keys() == w.keys()
        assert all(close(g[k], w[k]) for k in w)


def same_result(got: dict, want: dict) -> None:
    got, want = copy.deepcopy(strip(got)), copy.deepcopy(strip(want))
    gl = got["choices"][0].pop("logprobs")
    wl = want["choices"][0].pop("logprobs")
    assert got == want
    same_logprobs(gl, wl)


@pytest.mark.parametrize("corrupt_every", [0, 2])
@pytest.mark.parametrize("stop", [[], ["wör"], ["ünï", "zzz"], ["→ do"], ["✓"], ["«more»"], ["ends ✓ h"]])
def test_chunks_equal_plain(models, stop, corrupt_every):
    base, spec, script, n_prompt = models
    keep = replay(spec, script, n_prompt, corrupt_every)
    try:
        for logprobs in (None, 2):
            for stream in (False, True):
                for max_tokens in (len(script) + 5, 9):
                    kw = dict(max_tokens=max_tokens, temperature=0.0, stop=stop, logprobs=logprobs, stream=stream)
                    s1, s2 = Script(script, n_prompt, base.token_eos()), Script(script, n_prompt, base.token_eos())
                    want = base.create_completion(PROMPT, logits_processor=[s1], **kw)
                    got = spec.create_completion(PROMPT, logits_processor=[s2], **kw)
                    if stream:
                        want, got = list(want), list(got)
                        assert len(got) == len(want), (stop, logprobs, max_tokens)
                        for g, w in zip(got, want, strict=True):
                            same_result(g, w)
                    else:
                        same_result(got, want)
                    st = spec.last_speculative_stats
                    assert st.fallback_reason == "" and st.drafted > 0
                    if corrupt_every == 0 and max_tokens > len(script):
                        assert st.tau > 4  # long accepted runs went through the loop
                    # the processor saw plain's prefixes, in order, and only verified ones (a
                    # step verified past a stop string shows it a few more, all true prefixes)
                    n = min(len(s1.seen), len(s2.seen))
                    assert s2.seen[:n] == s1.seen[:n] and len(s2.seen) >= len(s1.seen) - 1
                    full = s1.seen[0] + tuple(script)
                    assert all(ids == full[:len(ids)] for ids in s2.seen)
    finally:
        spec.draft_source = None
        del keep


def test_logprobs_without_logits_all(models):
    """No logits_all, no n_ctx x n_vocab buffer: logprobs still equal plain's (logits_all=True),
    and differ from them less than plain's own one-batch evaluation of the same tokens does."""
    base, spec, _, _ = models
    assert not spec._logits_all  # llama-cpp-python would refuse logprobs here
    prompt = base.tokenize(b"1, 2, 3,", add_bos=False, special=True)
    for kw in (dict(temperature=0.0), dict(temperature=0.9, seed=5)):
        want = base.create_completion("1, 2, 3,", max_tokens=20, logprobs=3, **kw)
        got = spec.create_completion("1, 2, 3,", max_tokens=20, logprobs=3, **kw)
        same_result(got, want)
        assert len(got["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3
        assert spec.last_speculative_stats.fallback_reason == ""
        ours = np.array(got["choices"][0]["logprobs"]["token_logprobs"])
        plain = np.array(want["choices"][0]["logprobs"]["token_logprobs"], dtype=np.float64)
        toks = base.tokenize(want["choices"][0]["text"].encode(), add_bos=False, special=False)
        base.reset()
        base.eval(prompt + toks)
        rows = llama_cpp.Llama.logits_to_logprobs(base.scores[len(prompt) - 1:len(prompt) - 1 + len(toks)])
        one_batch = rows[np.arange(len(toks)), toks]
        n = min(len(toks), len(ours))
        assert np.abs(ours - plain).max() <= max(1e-5, 2 * np.abs(one_batch[:n] - plain[:n]).max())
    # echo + logprobs needs the prompt's rows: llama-cpp-python's rule (logits_all) applies
    with pytest.raises(ValueError, match="logits_all"):
        spec.create_completion("1, 2, 3,", max_tokens=4, logprobs=1, echo=True)


def test_logit_bias_and_processors_stay_speculative(models):
    base, spec, _, _ = models
    bias = {15: 4.0, 30: 3.0, 200: -100.0}
    for kw in (dict(temperature=0.0), dict(temperature=0.8, seed=2)):
        want = base.create_completion("Once upon", max_tokens=24, logit_bias=bias, **kw)
        got = spec.create_completion("Once upon", max_tokens=24, logit_bias=bias, **kw)
        same_result(got, want)
        assert spec.last_speculative_stats.fallback_reason == ""


def test_cached_pieces_equal_detokenize(models):
    """The incremental text is llama-cpp-python's detokenize (BOS leading-space rule included)."""
    from llama_dflash.api.completion import _Pieces

    _, spec, script, _ = models
    pieces = _Pieces(spec)
    long = (script * 40)[:2000]
    assert pieces.text(long) == spec.detokenize(long)
    assert pieces.text([spec.token_bos(), *script]) == spec.detokenize([spec.token_bos(), *script])
