"""Every target family on a tiny random target written through gguf-py (tests/families.py) and loaded
by the real libllama: llama with llama3 RoPE, qwen3, qwen3moe, gpt-oss (sinks, alternating sliding
window, biases, MXFP4 experts), gemma3 run far past its 32-token window and qwen35 (hybrid: gated
delta net, rolled back through llama.cpp's recurrent snapshots).  For each, a drafter in
the schema of the published checkpoint for that family (random weights, converted) drafts; exact
mode's self-check passes (the MoE targets since the kernels take the f32 router; with the kernels off
they are refused with the self-check's reason); greedy output over 120 tokens is identical to
llama_cpp.Llama's under the same settings; and after a run whose drafts are mostly rejected, the
target's next logits are bit-identical to a fresh context that decoded the same tokens one at a
time (rollback left nothing behind).

One thread: on this 2-core machine shared with other runs, two threads make the self-check's
300 small decodes of a MoE target take a minute instead of a second (OpenMP barriers under load).
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from llama_dflash import DFlashError, SpeculativeGenerator
from llama_dflash.core import exact, kernels
from llama_dflash.formats.inspect import describe, fit
from llama_dflash.verify.oracle import ReplayDraftSource

from families import FAMILIES, SCHEMAS, published_drafter, write_any
from models import exact_reference_llama

PROMPTS = ["Once upon a time, there was", "def fibonacci(n):\n"]
N_TOKENS = 120
THREADS = 1
MOE = ("qwen3moe", "gpt-oss")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        spec = make(20 + i)
        target = write_any(str(d / f"{name}.gguf"), spec)
        drafter = published_drafter(d, SCHEMAS[name], target, spec.n_layer, seed=30 + i)
        out[name] = (target, drafter, spec)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_published_schema_converts_and_inspect_agrees(pairs, name):
    """The converted drafter is what its schema says (biases, RoPE factors, layer causality) and
    `inspect --target` says the pair speculates -- which the tests below then see it do."""
    target, drafter, _ = pairs[name]
    info = describe(drafter)
    names = {t[0] for t in info["tensors"]}
    if name == "gpt-oss":
        assert {"blk.0.attn_q.bias", "blk.0.attn_output.bias", "rope_freqs.weight"} <= names
    if name == "llama3":
        assert "rope_freqs.weight" in names and info["block_size"] == 10
    if name == "gemma3":
        assert info["causal_layers"] == [True] * 4 + [False] and info["swa_layers"] == [True] * 4 + [False]
    assert fit(drafter, target) == {"ok": True, "error": None}


def _expect_exact(name: str) -> bool:
    """The MoE targets' routers are f32, which only our kernels multiply batch-invariantly."""
    return name not in MOE or kernels.stats().enabled


def _greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_drafts_and_equals_plain_decoding_exactly(pairs, name, monkeypatch):
    target, drafter, tspec = pairs[name]
    if not _expect_exact(name):
        _refused_then_default_mode(target, drafter, name)
        return
    ref = exact_reference_llama(target, monkeypatch, n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS)
    with SpeculativeGenerator(target, drafter, n_ctx=512, exact=True, n_threads=THREADS) as g:
        v = g.exact_verdict
        assert v.max_rows >= v.probed_rows >= 2, v.describe()
        assert g.capture_mode == ("cb_eval" if name == "gemma3" else "layer_inp")
        for p in PROMPTS:
            toks = g.tokenize(p)
            want = _greedy(ref, toks, N_TOKENS)
            assert len(set(want)) > 20, f"{name}: degenerate target ({len(set(want))} distinct tokens)"
            plain = g.generate(toks, N_TOKENS, draft_len=0, stop_on_eos=False)
            spec = g.generate(toks, N_TOKENS, draft_len=min(7, g.max_draft_len), stop_on_eos=False)
            st = spec.stats
            assert st.exact.startswith("self-check passed") and st.drafted > 0 and st.fallback_reason == "", st
            assert plain.tokens == want, (name, p, "our plain loop differs from llama_cpp.Llama")
            assert spec.tokens == want, (name, p, "speculative output differs from llama_cpp.Llama")
            if name == "gemma3":
                assert len(toks) + N_TOKENS > 3 * tspec.n_swa  # far past the window
            print(f"\n[{name}] {p!r}: drafted {st.drafted}, accepted {st.accepted}, {N_TOKENS} tokens identical")
    ref.close()


def _refused_then_default_mode(target: str, drafter: str, name: str) -> None:
    """Without the kernels (a CPU they do not serve, LLAMA_DFLASH_KERNELS=0) ggml multiplies the MoE
    router: exact mode refuses with the self-check's reason, and the default mode's output equals
    plain decoding up to near-ties (top-1/top-2 margin < 0.05, printed)."""
    with pytest.raises(DFlashError, match="self-check failed: a 2-row batch differs"):
        SpeculativeGenerator(target, drafter, n_ctx=512, exact=True, n_threads=THREADS)
    with SpeculativeGenerator(target, drafter, n_ctx=512, exact=False, n_threads=THREADS) as g:
        for p in PROMPTS:
            toks = g.tokenize(p)
            plain = g.generate(toks, N_TOKENS, draft_len=0, stop_on_eos=False, return_margins=True)
            spec = g.generate(toks, N_TOKENS, draft_len=7, stop_on_eos=False)
            assert spec.stats.drafted > 0
            i = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens, strict=True)) if a != b), None)
            assert i is None or plain.margins[i] < 0.05, (name, p, i, plain.margins[i])
            print(f"\n[{name}] kernels off, default mode: " + ("identical" if i is None else f"near-tie at {i}"))


def _last_logits(ctx, n_vocab: int, tok: int, pos: int) -> np.ndarray:
    return exact._decode(ctx, [tok], pos, n_vocab, False)[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollback_leaves_next_logits_bit_identical(pairs, name):
    """A replayed continuation right with probability 0.3 a token: most steps reject, the
    target's rejected rows are removed each time; the next logits then equal a fresh context's
    that decoded the same tokens (prompt in canonical chunks, then one at a time), bit for bit."""
    target, drafter, tspec = pairs[name]
    exact_ok = _expect_exact(name)
    with SpeculativeGenerator(target, drafter, n_ctx=512, exact=exact_ok, n_threads=THREADS) as g, \
            SpeculativeGenerator(target, None, n_ctx=512, exact=exact_ok, n_threads=THREADS) as fresh:
        toks = g.tokenize(PROMPTS[0])
        plain = g.generate(toks, N_TOKENS, draft_len=0, stop_on_eos=False).tokens
        src = ReplayDraftSource.with_acceptance(toks + plain, g.n_vocab, 0.3, seed=1)
        steps: list[dict] = []
        r = g.generate(toks, N_TOKENS, draft_len=7, draft_source=src, stop_on_eos=False, on_step=steps.append)
        rejected = sum(1 for s in steps if s["accepted"] < s["drafted"])
        assert rejected >= 20 and r.stats.drafted > 0, (rejected, r.stats)
        assert all(s["target_len"] == s["committed"] - 1 for s in steps)
        seq = toks + r.tokens
        # the engine's context holds every committed token but the last (the next step's anchor)
        got = _last_logits(g._ctx, g.n_vocab, seq[-1], len(seq) - 1)
        ctx = fresh._ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        n_batch = int(llama_cpp.llama_n_batch(ctx))
        for c in range(0, len(toks), n_batch):
            exact._decode(ctx, toks[c:c + n_batch], c, fresh.n_vocab, False)
        exact._decode(ctx, seq[len(toks):-1], len(toks), fresh.n_vocab, True)
        want = _last_logits(ctx, fresh.n_vocab, seq[-1], len(seq) - 1)
        if exact_ok:
            assert r.tokens == plain
            assert np.array_equal(got, want), (name, float(np.abs(got - want).max()))
        else:  # the default mode (kernels off, a MoE target): batches round apart in the last bits only
            assert float(np.abs(got - want).max()) < 1e-3 * float(np.abs(want).max()), name
        print(f"\n[{name}] {len(steps)} steps, {rejected} with rejected rows: next logits identical")
