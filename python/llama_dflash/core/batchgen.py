"""Batched generation of the target's own responses (training data, docs/architecture.md §6.1).

Several sequences share each llama_decode (continuous batching: a finished
sequence's slot is refilled with the next prompt in the same batch), which is
what makes data generation run at a useful rate on a 2-core CPU.  Greedy rows
take the argmax; sampled rows draw from softmax(logits / T) over the top-k.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import llama_cpp
import numpy as np

from .._native import Resource


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


class BatchGenerator(Resource):
    """One target model, one context with `n_seq` parallel sequences of up to `max_len` tokens."""

    def __init__(self, model_path: str | os.PathLike, n_seq: int = 16, max_len: int = 512,
                 n_threads: int | None = None) -> None:
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"no such model file: {model_path}")
        self.n_seq, self.max_len = n_seq, max_len
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self._model:
            raise RuntimeError(f"could not load {model_path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_seq * max_len
        cp.n_batch = cp.n_ubatch = max(512, n_seq * 8)
        cp.n_seq_max = n_seq
        cp.kv_unified = False  # one KV stream per sequence: attention spans its own cells only
        nt = n_threads or max(1, len(os.sched_getaffinity(0)))
        cp.n_threads = cp.n_threads_batch = nt
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise RuntimeError("could not create a llama context")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(cp.n_batch, 0, 1)
        self._cap = cp.n_batch

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, tok))

    def run(self, jobs: Iterable[Job], max_new: int, on_done: Callable[[Completion], None] | None = None
            ) -> Iterator[Completion]:
        """Generate up to max_new tokens for every job; yields completions as they finish."""
        pending = iter(jobs)
        slots: list[dict | None] = [None] * self.n_seq
        exhausted = False
        held: Job | None = None
        while True:
            # refill free slots, as long as the batch has room for the prompts
            room = self._cap
            for s in range(self.n_seq):
                if slots[s] is not None:
                    room -= 1
            for s in range(self.n_seq):
                if slots[s] is None and not exhausted:
                    job = held or next(pending, None)
                    held = None
                    if job is None:
                        exhausted = True
                        break
                    if len(job.prompt) + max_new > self.max_len or len(job.prompt) > self._cap:
                        raise ValueError(f"prompt {job.key}: {len(job.prompt)} tokens + {max_new} exceed the "
                                         f"slot length {self.max_len} (or the batch)")
                    if len(job.prompt) > room:  # no room in this batch: the next one takes it
                        held = job
                        break
                    llama_cpp.llama_memory_seq_rm(self._mem, s, -1, -1)
                    slots[s] = {"job": job, "feed": list(job.prompt), "pos": 0, "out": [],
                                "rng": np.random.default_rng(job.seed)}
                    room -= len(job.prompt)
            active = [s for s in range(self.n_seq) if slots[s] is not None]
            if not active:
                return
            b = self._batch
            n = 0
            last: dict[int, int] = {}
            for s in active:
                st = slots[s]
                for j, t in enumerate(st["feed"]):
                    b.token[n], b.pos[n], b.n_seq_id[n] = t, st["pos"] + j, 1
                    b.seq_id[n][0] = s
                    b.logits[n] = j == len(st["feed"]) - 1
                    n += 1
                last[s] = n - 1
                st["pos"] += len(st["feed"])
            b.n_tokens = n
            rc = llama_cpp.llama_decode(self._ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            for s in active:
                st = slots[s]
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, last[s])
                logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))
                tok = _pick(logits, st["job"].temperature, st["rng"])
                st["out"].append(tok)
                st["feed"] = [tok]
                if self.is_eog(tok) or len(st["out"]) >= max_new:
                    job = st["job"]
                    c = Completion(job.key, job.prompt, st["out"], job.temperature)
                    slots[s] = None
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
