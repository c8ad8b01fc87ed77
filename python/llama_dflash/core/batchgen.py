"""Batched generation of the target's own responses (training data, docs/architecture.md §6.1).

Several sequences share each llama_decode (continuous batching: a finished
sequence's slot is refilled with the next prompt), which is what makes data
generation run at a useful rate on a 2-core CPU.  Greedy rows take the argmax;
sampled rows draw from softmax(logits / T) over the top 40.

With ``capture_layers`` the same pass captures the tapped layers' features of every
position (prompt and response: the last token is fed once more for its row) and,
with ``top_k``, the target's k most likely next tokens and their log-probabilities
at every position that predicts a response token: training data in one pass.
llama.cpp computes a batch of several sequences (a KV stream each) as ubatches
ordered by sequence, and the captured rows come in that order while the logits come
in batch order; so a prompt's prefill is a decode of its own and every generation
step holds exactly one row per sequence, in ascending sequence order, and the two
orders agree.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from .._native import Resource, load_model, new_context
from ..errors import DFlashError
from .capture import Capture


@dataclass
class Job:
    key: int                 # caller's id for the request
    prompt: list[int]        # token ids (chat template already applied)
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Completion:
    key: int
    prompt: list[int]
    response: list[int]      # generated ids, the end-of-generation token included when reached
    temperature: float
    features: np.ndarray | None = None  # [L, width] float32 for prompt + response (with capture)
    top_ids: np.ndarray | None = None   # [L, top_k] int32: row r's most likely next tokens (-1: no row)
    top_logp: np.ndarray | None = None  # [L, top_k] float32: their log-probabilities (rows P-1 .. L-2)


class BatchGenerator(Resource):
    """One target model, one context with `n_seq` parallel sequences of up to `max_len` tokens.

    capture_layers: HF layer ids whose outputs each completion carries (None: no features);
    top_k: how many of the target's next-token log-probabilities it carries per row (0: none).
    """

    def __init__(self, model_path: str | os.PathLike, n_seq: int = 16, max_len: int = 512,
                 n_threads: int | None = None, capture_layers: Sequence[int] | None = None,
                 top_k: int = 0) -> None:
        self._model = self._ctx = self._batch = self._capture = None
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"no such model file: {model_path}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.n_seq, self.max_len, self.top_k = n_seq, max_len, top_k
        self._model = load_model(model_path, what="target model")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_seq * max_len
        cp.n_batch = cp.n_ubatch = max(512, n_seq * 8)
        cp.n_seq_max = n_seq
        cp.kv_unified = False  # one KV stream per sequence: attention spans its own cells only
        nt = n_threads or max(1, len(os.sched_getaffinity(0)))
        cp.n_threads = cp.n_threads_batch = nt
        if capture_layers:
            self._capture = Capture(self._model, capture_layers, cp.n_batch)
            self._capture.install(cp)
        try:
            self._ctx = new_context(self._model, cp, f"a context of {n_seq} x {max_len} positions")
        except DFlashError:
            self.close()
            raise
        if self._capture is not None:
            self._capture.attach(self._ctx)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        if top_k > self.n_vocab:
            self.close()
            raise ValueError(f"top_k {top_k} exceeds the vocabulary ({self.n_vocab})")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(cp.n_batch, 0, 1)
        self._cap = cp.n_batch

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, tok))

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray | None:
        """One llama_decode of rows (sequence, position, token, wants logits); the captured
        features [len(rows), width] (None without capture)."""
        b = self._batch
        for n, (s, pos, tok, want) in enumerate(rows):
            b.token[n], b.pos[n], b.n_seq_id[n] = tok, pos, 1
            b.seq_id[n][0] = s
            b.logits[n] = want
        b.n_tokens = len(rows)
        if self._capture is not None:
            self._capture.begin()
        rc = llama_cpp.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        return self._capture.rows(len(rows)) if self._capture is not None else None

    def _logits(self, i: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))

    def _next(self, st: dict, logits: np.ndarray) -> None:
        """Pick the slot's next token from its row's logits (and keep their top k)."""
        if self.top_k:
            idx = np.argpartition(logits, -self.top_k)[-self.top_k:]
            idx = idx[np.argsort(-logits[idx], kind="stable")]
            m = float(logits.max())
            lse = m + float(np.log(np.exp(logits.astype(np.float64) - m).sum()))
            st["top"].append((idx.astype(np.int32), (logits[idx] - lse).astype(np.float32)))
        tok = _pick(logits, st["job"].temperature, st["rng"])
        st["out"].append(tok)
        st["done"] = self.is_eog(tok) or len(st["out"]) >= st["max_new"]

    def _completion(self, st: dict) -> Completion:
        job = st["job"]
        c = Completion(job.key, job.prompt, st["out"], job.temperature)
        if self._capture is not None:
            c.features = np.concatenate(st["feats"])
        if self.top_k:
            L, P = len(job.prompt) + len(st["out"]), len(job.prompt)
            c.top_ids = np.full((L, self.top_k), -1, np.int32)
            c.top_logp = np.zeros((L, self.top_k), np.float32)
            for r, (ids, lp) in enumerate(st["top"], start=P - 1):
                c.top_ids[r], c.top_logp[r] = ids, lp
        return c

    def run(self, jobs: Iterable[Job], max_new: int, on_done: Callable[[Completion], None] | None = None
            ) -> Iterator[Completion]:
        """Generate up to max_new tokens for every job; yields completions as they finish."""
        pending = iter(jobs)
        slots: list[dict | None] = [None] * self.n_seq
        capture = self._capture is not None
        while True:
            for s in range(self.n_seq):  # fill free slots: each prompt's prefill a decode of its own
                if slots[s] is not None:
                    continue
                job = next(pending, None)
                if job is None:
                    break
                if not job.prompt or len(job.prompt) + max_new > self.max_len or len(job.prompt) > self._cap:
                    raise ValueError(f"prompt {job.key}: {len(job.prompt)} tokens + {max_new} exceed the "
                                     f"slot length {self.max_len} (or the batch), or the prompt is empty")
                llama_cpp.llama_memory_seq_rm(self._mem, s, -1, -1)
                st = slots[s] = {"job": job, "pos": len(job.prompt), "out": [], "feats": [], "top": [],
                                 "max_new": max_new, "rng": np.random.default_rng(job.seed), "done": False}
                P = len(job.prompt)
                f = self._decode([(s, j, t, j == P - 1) for j, t in enumerate(job.prompt)])
                if capture:
                    st["feats"].append(f)
                self._next(st, self._logits(P - 1))
            active = [s for s in range(self.n_seq) if slots[s] is not None]
            if not active:
                return
            # one row per sequence, in sequence order; a finished sequence's last token is fed (for its
            # features) only when capturing, and its logits are not read
            rows = [(s, slots[s]["pos"], slots[s]["out"][-1], not slots[s]["done"]) for s in active
                    if capture or not slots[s]["done"]]
            f = self._decode(rows) if rows else None
            for i, (s, _, _, want) in enumerate(rows):
                st = slots[s]
                st["pos"] += 1
                if capture:
                    st["feats"].append(f[i:i + 1])
                if want:
                    self._next(st, self._logits(i))
            for s in active:
                st = slots[s]
                if st["done"] and (not capture or st["pos"] == len(st["job"].prompt) + len(st["out"])):
                    slots[s] = None
                    c = self._completion(st)
                    if on_done:
                        on_done(c)
                    yield c

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_capture", None) is not None:
            self._capture.close()
            self._capture = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator, top_k: int = 40) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    idx = np.argpartition(logits, -top_k)[-top_k:]
    z = logits[idx] / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(idx[rng.choice(top_k, p=p)])
