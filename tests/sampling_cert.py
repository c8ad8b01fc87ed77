"""Certify that a seeded-sampling divergence comes from last-digit logit differences.

llama.cpp's dist sampler draws u from std::mt19937(seed) through
std::uniform_real_distribution<double> (libstdc++: two 32-bit outputs,
(x1 + x2 * 2^32) / 2^64), once per sampled token, and picks the first candidate
(in the order the transforms leave them) whose running sum of exp(logit - max)
reaches u * total.  Replaying that draw on the plain run's logits must give the
plain token; the divergence is certified when the same draw on a batched
evaluation of the same prefix (the way verification computes it), whose logits
differ from the plain ones by less than a small epsilon, gives the other token.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from llama_dflash.core.sampling import SamplingParams, build_chain


def dist_uniforms(seed: int, n: int) -> list[float]:
    raw = np.random.RandomState(seed)._bit_generator.random_raw(2 * n)  # legacy seeding == init_genrand
    return [min((float(raw[2 * i]) + float(raw[2 * i + 1]) * 2.0**32) / 2.0**64, np.nextafter(1.0, 0.0))
            for i in range(n)]


def replay(llm: llama_cpp.Llama, logits: np.ndarray, history: list[int], sp: SamplingParams, u: float) -> int:
    tr = build_chain(sp, llm._model.model, llm._model.vocab, llm.n_vocab(), with_dist=False)
    for t in history:
        tr.accept(t)
    n = llm.n_vocab()
    arr = (llama_cpp.llama_token_data * n)()
    for v in range(n):
        arr[v].id, arr[v].logit, arr[v].p = v, logits[v], 0.0
    a = llama_cpp.llama_token_data_array(arr, n, -1, False)
    llama_cpp.llama_sampler_apply(tr.sampler, ctypes.byref(a))
    tr.close()
    ls = np.array([a.data[k].logit for k in range(a.size)], dtype=np.float32)
    p = np.exp(ls - ls.max()).astype(np.float64)
    k = int(np.searchsorted(np.cumsum(p), p.sum() * u))
    return a.data[min(k, a.size - 1)].id


def spec_row_logits(llm: llama_cpp.Llama, prompt: list[int], spec: list[int], steps: list[dict],
                    i: int) -> np.ndarray:
    """Logits the speculative run sampled token i from, recomputed with the same batches:
    each step verified [anchor, drafts...] (drafted + 1 rows) and kept the accepted rows."""
    llm.reset()
    llm.eval(prompt)
    pos = 0  # spec[pos] is the anchor of the next step
    for s in steps:
        d, acc = s["drafted"], s["accepted"]
        batch = spec[pos:pos + 1 + acc]
        batch = batch + [batch[-1]] * (d + 1 - len(batch))  # rejected drafts: only the batch size matters
        base = llm.n_tokens
        llm.eval(batch)
        if pos + 1 <= i <= pos + 1 + acc:
            return np.array(llm.scores[base + i - pos - 1], dtype=np.float32)
        llm.n_tokens = base + acc + 1  # roll back the rejected rows
        pos += acc + 1
    raise ValueError(f"token {i} is not produced by the recorded steps")


def near_tie(llm: llama_cpp.Llama, prompt: list[int], plain: list[int], spec: list[int], steps: list[dict],
             i: int, sp: SamplingParams, rel_eps: float) -> tuple[bool, str]:
    """plain[i] (plain run) vs spec[i] (speculative run, with its recorded steps); the rows
    may differ by rel_eps times the largest |logit|."""
    u = dist_uniforms(sp.seed, i + 1)[i]
    llm.reset()
    llm.eval(prompt)
    for t in plain[:i]:
        llm.eval([t])
    single = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    if replay(llm, single, plain[:i], sp, u) != plain[i]:
        return False, "could not replay the plain draw"
    batched = spec_row_logits(llm, prompt, spec, steps, i)
    diff = float(np.abs(batched - single).max())
    if replay(llm, batched, spec[:i], sp, u) != spec[i]:
        return False, f"could not replay the speculative draw (logits differ by {diff:.1e})"
    if diff >= rel_eps * float(np.abs(single).max()):
        return False, f"the rows' logits differ by {diff:.1e} (max |logit| {np.abs(single).max():.1f})"
    return True, f"the same draw picks {plain[i]} / {spec[i]} on logits that differ by {diff:.1e}"
