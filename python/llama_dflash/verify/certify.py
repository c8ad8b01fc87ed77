"""Is a greedy divergence llama.cpp's batch numerics?  Replay the speculative run's batches.

A speculative run evaluates its tokens in verify batches of n + 1; plain decoding evaluates them
one per ``llama_decode``.  llama.cpp's kernels round differently for different batch sizes, so
at a near-tie the two runs may pick different tokens.  This module evaluates the same tokens
with plain llama-cpp-python (``logits_all=True``, no DFlash loop; its context computing as the
package's contexts do: :func:`checker`) both ways: one token per call,
and in exactly the speculative run's batches (same positions and sizes; stand-ins for the drafts
it rejected, dropped again afterwards, as the loop does).  When plain llama-cpp-python prefers
its own token in the first and the speculative token in the second, the divergence is certified
as batch numerics.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp

from .. import _native


def checker(model_path: str, n_ctx: int, n_threads: int | None = None, flash_attn: bool = False) -> llama_cpp.Llama:
    """Plain llama-cpp-python keeping every row's logits, its context set as every context the
    package drives (the small-batch kernels take its attention and the row-wise ops between its
    products too), so that its one-token rows round as the generator's plain decoding does."""
    llm = llama_cpp.Llama(str(model_path), n_ctx=n_ctx, n_threads=n_threads, logits_all=True, verbose=False,
                          flash_attn=flash_attn)
    _native.attention_kernels(llm._ctx.ctx)
    return llm


def _prefill(checker: llama_cpp.Llama, prompt: Sequence[int]) -> None:
    checker.reset()
    checker._ctx.kv_cache_clear()
    checker.eval(list(prompt))


def gap_one_by_one(checker: llama_cpp.Llama, tokens: Sequence[int], n_prompt: int, i: int, a: int, b: int) -> float:
    """logit(a) - logit(b) at sequence position i (the row after tokens[:i]), the prompt evaluated
    in one batch and every later token alone, as plain decoding does."""
    _prefill(checker, tokens[:n_prompt])
    for t in tokens[n_prompt:i]:
        checker.eval([t])
    row = checker.scores[i - 1]
    return float(row[a] - row[b])


def gap_in_batches(checker: llama_cpp.Llama, tokens: Sequence[int], n_prompt: int, steps: Sequence[dict], i: int,
                   a: int, b: int) -> float | None:
    """logit(a) - logit(b) at sequence position i with the speculative run's verify batches.
    steps: the run's step records (``drafted``, ``accepted``, ``committed``, as the engine's
    step callback reports them); tokens: its committed sequence, prompt included.  None when
    the steps do not reach position i."""
    tokens = list(tokens)
    _prefill(checker, tokens[:n_prompt])
    if i - 1 < n_prompt:
        row = checker.scores[i - 1]
        return float(row[a] - row[b])
    for st in steps:
        start, size = st["committed"] - st["accepted"] - 2, st["drafted"] + 1  # anchor position, rows
        if checker.n_tokens != start:
            return None  # not this run's steps
        batch = tokens[start:start + size]
        checker.eval(batch + [tokens[-1]] * (size - len(batch)))
        # only rows 0..accepted chose tokens; a later row of this batch (after a rejection) is
        # evaluated again, in another batch, by a later step
        if start <= i - 1 <= start + st["accepted"]:
            row = checker.scores[i - 1]
            return float(row[a] - row[b])
        keep = start + st["accepted"] + 1
        checker._ctx.kv_cache_seq_rm(-1, keep, -1)
        checker.n_tokens = keep
    return None


def certify(checker: llama_cpp.Llama, plain: Sequence[int], spec: Sequence[int], n_prompt: int,
            steps: Sequence[dict]) -> dict | None:
    """The first divergence of two greedy runs (sequences with their prompt) and plain
    llama-cpp-python's logit gap there, its token minus the speculative one, evaluated one token
    at a time and in the speculative run's batches; ``certified`` when the sign flips."""
    i = next((k for k, (x, y) in enumerate(zip(plain, spec, strict=False)) if x != y), None)
    if i is None or i < n_prompt:
        return None
    a, b = plain[i], spec[i]
    one = gap_one_by_one(checker, plain, n_prompt, i, a, b)
    batched = gap_in_batches(checker, spec, n_prompt, steps, i, a, b)
    return {"position": i - n_prompt, "plain_token": a, "spec_token": b, "gap_one_by_one": one,
            "gap_in_spec_batches": batched, "certified": batched is not None and batched < 0 <= one}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_report(g, plain, spec, eps: float, sampled: bool = False, replay=None) -> dict:
    """Where a speculative run first differs from the plain one, with both rows' top-1/top-2 margins
    and a verdict: batch-numerics (certified by `replay`, a ``certify`` result: plain
    llama-cpp-python picks the speculative token in the run's own batches), near-tie (a margin
    below eps), sampled, mismatch (a bug) or length."""
    i = _first_divergence(plain.tokens, spec.tokens)
    report = {"identical": i is None, "n_tokens": len(plain.tokens), "tau": spec.stats.tau}
    if i is not None and i < min(len(plain.tokens), len(spec.tokens)):
        mp, ms = plain.margins[i], spec.margins[i]
        verdict = "near-tie" if min(mp, ms) < eps else ("sampled" if sampled else "mismatch")
        if not sampled and replay is not None:
            report["replay"] = replay
            if replay["certified"]:
                verdict = "batch-numerics"
        report.update(position=i, plain_token=plain.tokens[i], spec_token=spec.tokens[i],
                      plain_piece=g.detokenize([plain.tokens[i]]), spec_piece=g.detokenize([spec.tokens[i]]),
                      plain_margin=mp, spec_margin=ms, verdict=verdict)
    elif i is not None:
        report.update(position=i, verdict="length")
    return report


def replay_divergence(model_path: str, toks: list[int], plain, spec, steps: list[dict], n_ctx: int,
                      n_threads: int | None = None, flash_attn: bool = False) -> dict | None:
    """certify for two greedy runs of a SpeculativeGenerator (steps: the speculative
    run's on_step records), with a fresh plain llama_cpp.Llama that keeps every row's logits
    (flash attention as the generator ran)."""
    if _first_divergence(plain.tokens, spec.tokens) is None:
        return None
    replayer = checker(model_path, n_ctx, n_threads, flash_attn)
    try:
        return certify(replayer, toks + plain.tokens, toks + spec.tokens, len(toks), steps)
    finally:
        replayer.close()
