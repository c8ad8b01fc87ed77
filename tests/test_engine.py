"""The speculative loop: greedy output identical to plain decoding, cache invariants."""

from __future__ import annotations

import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.verify.oracle import ReplayDraftSource

PROMPTS = [
    "def fibonacci(n):\n    return", "The capital of France is", "Once upon a time, there was",
    "import numpy as np\nx =", "Q: What is 2 + 2?\nA:", "<|im_start|>user\nHello!<|im_end|>\n",
    "In the beginning", "SELECT * FROM users WHERE", "for i in range(10):", "The quick brown fox",
    "Dear Sir or Madam,", "class Stack:\n    def push(self, x):", "# TODO: fix the", "It was a dark and",
    "print('hello", "My favourite colour is", "1, 2, 3, 4,", "The results show that", "if __name__ ==",
    "Translate to French: cheese",
]
N_TOKENS = 64
DRAFT_LENS = [1, 3, 7, 15]
# A divergence is acceptable only where plain decoding's top-1/top-2 logit margin
# is below EPS: batched verification and single-token decoding round differently.
EPS = 0.05


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_same(plain, spec, label, report):
    i = first_divergence(plain.tokens, spec.tokens)
    if i is None:
        return
    m = plain.margins[i]
    report.append(f"{label}: divergence at token {i}, plain margin {m:.4f}")
    assert m < EPS, f"{label}: outputs differ at token {i} with plain margin {m:.4f} (not a near-tie)"


def invariant_checker(n, records):
    def on_step(s):
        records.append(s)
        assert 0 <= s["accepted"] <= s["drafted"] <= n
        assert 1 <= s["accepted"] + 1 <= n + 1
        # everything before the anchor is in both caches, nothing else
        assert s["target_len"] == s["committed"] - 1
        assert s["drafter_len"] == s["committed"] - 1
        assert s["drafted"] <= s["made"] <= n
        assert all(0.0 <= c <= 1.0 for c in s["conf"])
    return on_step


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_identity_dflash_and_oracle(artifacts, name, capsys):
    a = artifacts[name]
    g = SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_threads=2)
    assert g.capture_mode == ("layer_inp" if name == "llama" else "cb_eval")
    prompts = PROMPTS
    report: list[str] = []
    steps_total = 0
    seen: dict[int, set[int]] = {n: set() for n in DRAFT_LENS}
    for pi, p in enumerate(prompts):
        toks = g.tokenize(p)
        plain = g.generate(toks, N_TOKENS, draft_len=0, stop_on_eos=False, return_margins=True)
        assert len(plain.tokens) == N_TOKENS and plain.stats.steps == N_TOKENS - 1
        for n in DRAFT_LENS:
            recs: list[dict] = []
            spec = g.generate(toks, N_TOKENS, draft_len=n, stop_on_eos=False, return_margins=True,
                              on_step=invariant_checker(n, recs))
            check_same(plain, spec, f"{name} dflash n={n} {p!r}", report)
            st = spec.stats
            assert st.steps == len(recs) and 1.0 <= st.tau <= n + 1
            assert st.accepted <= st.drafted
            steps_total += st.steps

            oracle = ReplayDraftSource.cycling(toks + plain.tokens, g.n_vocab, offset=5 * pi)
            recs = []
            spec = g.generate(toks, N_TOKENS, draft_len=n, stop_on_eos=False, return_margins=True,
                              draft_source=oracle, on_step=invariant_checker(n, recs))
            check_same(plain, spec, f"{name} oracle n={n} {p!r}", report)
            if spec.tokens == plain.tokens:
                # every step accepted exactly up to the corrupted position
                called = [r for r in recs if r["drafted"] > 0]  # the budget cuts the last steps' drafts
                assert [r["accepted"] for r in called] == oracle.expected
                assert spec.stats.accepted == sum(oracle.expected)
                seen[n] |= {e for e, r in zip(oracle.expected, called, strict=True) if e < r["drafted"]}
    for n in DRAFT_LENS:
        assert seen[n] == set(range(n)), f"n={n}: rejection positions exercised: {sorted(seen[n])}"
    with capsys.disabled():
        print(f"\n[{name}] {len(prompts)} prompts x {N_TOKENS} tokens x n={DRAFT_LENS}: "
              f"{len(report)} near-tie divergences" + "".join(f"\n  {r}" for r in report))
    assert steps_total > 0
    g.close()


def test_step_records_confidence_and_anchor_margin(artifacts):
    """Each step's record carries the drafter's per-slot confidences (none from a draft source) and
    the anchor row's margin, which is plain decoding's margin at that token."""
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_threads=2) as g:
        toks = g.tokenize(PROMPTS[0])
        plain = g.generate(toks, 32, draft_len=0, stop_on_eos=False, return_margins=True)
        steps: list[dict] = []
        spec = g.generate(toks, 32, draft_len=3, speculation="on", stop_on_eos=False, on_step=steps.append)
        prev = len(toks) + 1  # after the prefill: the prompt and the first token, the first anchor
        for s in steps:
            assert len(s["conf"]) == s["drafted"] == s["made"]  # (fixed length: every draft verified whole)
            i = prev - len(toks) - 1  # the anchor's index in the output
            if spec.tokens[: i + 1] == plain.tokens[: i + 1]:
                assert abs(s["anchor_margin"] - plain.margins[i]) < 0.05, (i, s["anchor_margin"], plain.margins[i])
            prev = s["committed"]
        assert sum(s["made"] for s in steps) > 0
        # a p_min cut: the confidences of the slots the drafter returned, no more
        steps = []
        g.generate(toks, 32, draft_len=3, speculation="on", stop_on_eos=False, p_min=0.5, on_step=steps.append)
        assert all(len(s["conf"]) == s["drafted"] <= s["made"] for s in steps)
        assert any(s["drafted"] < s["made"] for s in steps) and all(min(s["conf"], default=1) >= 0.5 for s in steps)
        steps = []
        oracle = ReplayDraftSource.cycling(toks + plain.tokens, g.n_vocab)
        g.generate(toks, 32, draft_len=3, stop_on_eos=False, draft_source=oracle, on_step=steps.append)
        assert all(s["conf"] == [] for s in steps) and sum(s["made"] for s in steps) > 0


def test_step_records_carry_their_times(artifacts, tmp_path, monkeypatch):
    """Each step's record carries its measured draft and verify seconds, which add up to the run's
    stats, and the cost model's prediction for it (adaptive steps; what the stats sum)."""
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_threads=2) as g:
        toks = g.tokenize(PROMPTS[0])
        for kw in (dict(draft_len=3, speculation="on"), dict(speculation="auto"), dict(draft_len=0)):
            steps: list[dict] = []
            st = g.generate(toks, 32, stop_on_eos=False, on_step=steps.append, **kw).stats
            assert steps and all(s["t_verify"] > 0 and s["t_draft"] >= 0 for s in steps), kw
            assert all(s["t_draft"] > 0 for s in steps if s["made"]), kw
            assert abs(sum(s["t_draft"] for s in steps) - st.t_draft_s) < 1e-6, kw
            assert abs(sum(s["t_verify"] for s in steps) - st.t_verify_s) < 1e-6, kw
            assert abs(sum(s["t_predicted"] for s in steps) - st.t_predicted_s) < 1e-6, kw
            if kw.get("speculation") == "auto":
                assert all(s["t_predicted"] > 0 for s in steps)


def test_plain_same_path_matches_llama_cpp(artifacts):
    """draft_len=0 is ordinary greedy decoding: the same tokens as llama_cpp.Llama."""
    import llama_cpp

    a = artifacts["qwen3"]
    g = SpeculativeGenerator(a["target"], n_ctx=512, n_threads=2)
    ref = llama_cpp.Llama(a["target"], n_ctx=512, n_threads=2, verbose=False)
    for p in PROMPTS[:5]:
        toks = g.tokenize(p)
        ours = g.generate(toks, 32, stop_on_eos=False)
        theirs = []
        for t in ref.generate(toks, temp=0.0, reset=True):
            theirs.append(t)
            if len(theirs) == 32:
                break
        assert ours.tokens == theirs
        assert ours.stats.drafter == "none" and ours.stats.drafted == 0
    g.close()


def test_max_tokens_is_exact(artifacts):
    a = artifacts["llama"]
    g = SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256, n_threads=2)
    toks = g.tokenize(PROMPTS[0])
    plain = g.generate(toks, 40, draft_len=0, stop_on_eos=False)
    perfect = lambda h, n: (toks + plain.tokens)[len(h):len(h) + n]  # noqa: E731
    for max_tokens in (1, 2, 3, 17):
        r = g.generate(toks, max_tokens, draft_len=7, stop_on_eos=False, draft_source=perfect)
        assert r.tokens == plain.tokens[:max_tokens]
        assert r.stats.stop_reason == "max_tokens"
        assert r.stats.drafted <= max_tokens - 1  # drafts never run past the budget
    g.close()


def test_stops_at_eos_inside_an_accepted_run(artifacts, tmp_path):
    from dataclasses import replace

    from models import write_target

    a = artifacts["llama"]
    g = SpeculativeGenerator(a["target"], n_ctx=256, n_threads=2)
    toks = g.tokenize(PROMPTS[3])
    plain = g.generate(toks, 40, stop_on_eos=False).tokens
    g.close()
    k = next(i for i in range(4, 40) if plain[i] not in plain[:i])
    # Same weights, but the token plain decoding emits at index k is the EOS.
    path = write_target(str(tmp_path / "eos.gguf"), replace(a["spec"], eos_id=plain[k]))
    g = SpeculativeGenerator(path, a["drafter"], n_ctx=256, n_threads=2)
    perfect = lambda h, n: (toks + plain)[len(h):len(h) + n]  # noqa: E731
    for src in (None, perfect):
        r = g.generate(toks, 40, draft_len=15, draft_source=src)
        assert r.tokens == plain[:k + 1]
        assert r.stats.stop_reason == "eos"
    g.close()


def test_p_min_keeps_output_and_shortens_drafts(artifacts):
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256) as g:
        toks = g.tokenize(PROMPTS[1])
        plain = g.generate(toks, 40, draft_len=0, stop_on_eos=False)
        full = g.generate(toks, 40, draft_len=7, stop_on_eos=False)
        cut = g.generate(toks, 40, draft_len=7, stop_on_eos=False, p_min=0.5)
        assert cut.tokens == plain.tokens == full.tokens
        assert cut.stats.drafted < full.stats.drafted


def test_stream_yields_each_step_and_stops_early(artifacts):
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256) as g:
        toks = g.tokenize(PROMPTS[2])
        full = g.generate(toks, 30, draft_len=5, stop_on_eos=False)
        oracle = ReplayDraftSource.cycling(toks + full.tokens, g.n_vocab)
        chunks = list(g.stream(toks, 30, draft_len=5, stop_on_eos=False, draft_source=oracle))
        assert [t for c in chunks for t in c] == full.tokens
        assert len(chunks[0]) == 1 and all(1 <= len(c) <= 6 for c in chunks[1:])
        assert any(len(c) > 1 for c in chunks)  # accepted drafts arrive together
        assert g.last_stats.n_generated == 30 and g.last_stats.stop_reason == "max_tokens"
        it = g.stream(toks, 30, draft_len=5, stop_on_eos=False)
        got = next(it) + next(it)
        it.close()  # a consumer that stops early (a stop string, a disconnect)
        assert g.last_stats.stop_reason == "stopped" and got == full.tokens[:len(got)]
        assert g.generate(toks, 30, draft_len=5, stop_on_eos=False).tokens == full.tokens


def test_prefix_reuse_prefills_only_the_new_suffix(artifacts):
    """A second turn keeps the KV / drafter cache of the common prefix (truncated in lockstep)."""
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512) as g:
        turn1 = g.tokenize("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
        r1 = g.generate(turn1, 24, draft_len=7, stop_on_eos=False, reuse_prefix=True)
        assert r1.stats.n_reused == 0
        turn2 = turn1 + r1.tokens + g.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
        recs: list[dict] = []
        r2 = g.generate(turn2, 24, draft_len=7, stop_on_eos=False, reuse_prefix=True,
                        on_step=invariant_checker(7, recs))
        # everything of turn 1 that is in the KV cache (all but the last generated token) is kept
        assert r2.stats.n_reused == len(turn1) + len(r1.tokens) - 1
        fresh = g.generate(turn2, 24, draft_len=0, stop_on_eos=False, return_margins=True)
        assert fresh.stats.n_reused == 0
        i = first_divergence(fresh.tokens, r2.tokens)
        assert i is None or fresh.margins[i] < EPS
        # a different conversation shares nothing: full prefill, same output as fresh
        other = g.tokenize("Something else entirely")
        r3 = g.generate(other, 8, stop_on_eos=False, reuse_prefix=True)
        assert r3.stats.n_reused == 0


GRAMMAR = 'root ::= [a-z ]+ "." [ \\n]*'


def test_grammar_cuts_drafts_at_the_first_forbidden_token(artifacts):
    """Grammar-aware drafting: an external draft with a forbidden token is cut before it (nothing
    forbidden is verified), the output is unchanged, and the cuts are counted."""
    import llama_cpp

    from llama_dflash import SamplingParams

    a = artifacts["llama"]
    grammar = llama_cpp.LlamaGrammar.from_string(GRAMMAR, verbose=False)
    with SpeculativeGenerator(a["target"], n_ctx=256) as g:
        toks = g.tokenize("Once upon a time")
        digit = g.tokenize("7", add_special=False)[0]
        for seed in (1, 2, 3):
            plain = g.generate(toks, 24, draft_len=0, stop_on_eos=False,
                               sampling=SamplingParams(temperature=1.0, seed=seed, grammar=grammar))
            for aware in (True, False):
                seen: list[list[int]] = []

                def source(hist, n, seen=seen, plain=plain):
                    # the plain continuation with a digit (never allowed) at a cycling slot
                    prop = list(plain.tokens[len(hist) - len(toks):][:n])
                    if prop:
                        prop[len(seen) % len(prop)] = digit
                    seen.append(prop)
                    return prop

                sp = SamplingParams(temperature=1.0, seed=seed, grammar=grammar, grammar_aware_drafting=aware)
                steps: list[dict] = []
                r = g.generate(toks, 24, draft_len=5, draft_source=source, stop_on_eos=False, sampling=sp,
                               on_step=steps.append)
                assert r.tokens == plain.tokens
                assert digit not in r.tokens
                if aware:
                    assert r.stats.grammar_cut > 0
                    # every step verified exactly the allowed prefix of what the source proposed
                    for s, prop in zip(steps, seen, strict=False):
                        assert s["drafted"] == (prop.index(digit) if digit in prop else len(prop))
                else:
                    assert r.stats.grammar_cut == 0 and r.stats.drafted > sum(map(len, seen)) - len(seen)


def test_dflash2_walk_skips_forbidden_candidates(artifacts, v2_drafter):
    """The DFlash2 walk takes the best candidate the grammar allows: same greedy output as plain,
    forbidden candidates replaced or the draft ended (counted).  (This random drafter is never
    accepted; the acceptance gain is measured with the trained one: test_shipped_drafter.py.)"""
    import llama_cpp

    from llama_dflash import SamplingParams

    a = artifacts["llama"]
    grammar = llama_cpp.LlamaGrammar.from_string(GRAMMAR, verbose=False)
    with SpeculativeGenerator(a["target"], str(v2_drafter), n_ctx=256) as g:
        for aware in (True, False):
            skipped = cut = 0
            for p in PROMPTS[:6]:
                toks = g.tokenize(p)
                plain = g.generate(toks, 32, draft_len=0, stop_on_eos=False,
                                   sampling=SamplingParams(temperature=0.0, grammar=grammar))
                sp = SamplingParams(temperature=0.0, grammar=grammar, grammar_aware_drafting=aware)
                r = g.generate(toks, 32, draft_len=7, stop_on_eos=False, sampling=sp)
                assert r.tokens == plain.tokens, p
                skipped += r.stats.grammar_skipped
                cut += r.stats.grammar_cut
            assert (skipped + cut > 0) == aware


def test_greedy_grammar_checks_the_argmax_first(artifacts):
    """Greedy with a grammar: a row whose raw argmax the grammar allows is settled without the
    chain's full-vocabulary grammar pass; the output is still llama_cpp.Llama's."""
    import llama_cpp

    from llama_dflash import SamplingParams

    a = artifacts["llama"]
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= [a-z ]+ ("." | "!") [ \\n]*', verbose=False)
    llm = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False)
    hits = rows = 0
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256) as g:
        for p in PROMPTS[:8]:
            toks = g.tokenize(p)
            llm.reset()
            ref = []
            for t in llm.generate(toks, temp=0.0, grammar=grammar):
                ref.append(t)
                if len(ref) == 24:
                    break
            for n in (0, 3):
                r = g.generate(toks, 24, draft_len=n, stop_on_eos=False,
                               sampling=SamplingParams(temperature=0.0, grammar=grammar))
                assert r.tokens == ref, (p, n)
                hits += r.stats.grammar_argmax
                rows += r.stats.n_generated
    assert 0 < hits < rows  # both paths were taken: allowed argmax, and the full chain
