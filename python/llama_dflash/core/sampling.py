"""Sampling settings and the llama.cpp sampler chains that verify drafts at T > 0.

The chain is built with llama-cpp-python's own sampler objects, in the order
``llama_cpp.Llama._init_sampler`` uses (penalties, grammar, top-k, typical,
top-p, min-p, temperature, dist), so that a match-mode generation with a seed
samples exactly what ``Llama`` samples with that seed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import llama_cpp
import numpy as np
from llama_cpp import _internals

from .._native import ffi, lib, ptr

MODES = ("match", "rejection")


@dataclass
class SamplingParams:
    """The request's sampling; defaults are llama_cpp.Llama.generate's (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: object | None = None  # llama_cpp.LlamaGrammar
    logits_processor: Sequence | None = None  # llama_cpp.LogitsProcessorList: (input_ids, scores) -> scores
    seed: int = 0xFFFFFFFF          # LLAMA_DEFAULT_SEED: random
    mode: str = "match"
    grammar_aware_drafting: bool = True  # drafts walk a copy of the grammar (skip what it forbids)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def is_greedy_but_grammar(self) -> bool:
        """Temperature 0 and no logit transform other than (possibly) a grammar."""
        return (self.temperature == 0 and self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and not self.logit_bias and not self.logits_processor)

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax without any logit transform: the exact greedy path (with margins)."""
        return self.is_greedy_but_grammar and self.grammar is None


_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


class ProcessorSampler(_internals.CustomSampler):
    """llama-cpp-python logits processors as the chain's first sampler, as
    ``llama_cpp.Llama._init_sampler`` places them.  Their ``input_ids`` are the prompt and the
    tokens accepted into the chain so far: the verify loop accepts a row's token before it
    samples the next row, so processors see the verified prefix and never a draft."""

    def __init__(self, processors: Sequence, history: Sequence[int]) -> None:
        self.processors = list(processors)
        self.ids = np.empty(max(64, 2 * len(history)), dtype=np.intc)
        self.n = len(history)
        self.ids[:self.n] = history
        super().__init__(self._apply)

        def accept(_smpl, token) -> None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
            self.ids[self.n] = token
            self.n += 1

        self._accept_ref = llama_cpp.llama_sampler_i_accept(accept)
        self.sampler.iface.contents.accept = self._accept_ref

    def _apply(self, cur_p) -> None:
        arr = cur_p.contents
        raw = (ctypes.c_char * (arr.size * _TOKEN_DATA.itemsize)).from_address(ctypes.addressof(arr.data.contents))
        logits = np.frombuffer(raw, dtype=_TOKEN_DATA)["logit"]
        for proc in self.processors:
            logits[:] = proc(self.ids[:self.n], logits)


def build_chain(p: SamplingParams, model, vocab, n_vocab: int, with_dist: bool = True,
                history: Sequence[int] = ()) -> _internals.LlamaSampler:
    """The request's chain; without the final dist sampler it is the transform chain whose
    surviving logits define p for rejection sampling.  history: the prompt (what logits
    processors see before the first generated token).  ``chain.grammar_index`` is the grammar
    sampler's position in the chain (-1: none), for grammar-aware drafting."""
    s = _internals.LlamaSampler()
    if p.logits_processor:
        proc = ProcessorSampler(p.logits_processor, history)
        llama_cpp.llama_sampler_chain_add(s.sampler, proc.get_sampler())
        # removed again before the chain is freed (llama.cpp must not free a Python object)
        s.custom_samplers.append((llama_cpp.llama_sampler_chain_n(s.sampler) - 1, proc))
    if p.logit_bias:
        s.add_logit_bias(n_vocab, {int(k): float(v) for k, v in p.logit_bias.items()})
    s.add_penalties(n_vocab=n_vocab, penalty_last_n=p.penalty_last_n, penalty_repeat=p.repeat_penalty,
                    penalty_freq=p.frequency_penalty, penalty_present=p.presence_penalty)
    s.grammar_index = -1
    if p.grammar is not None:
        s.grammar_index = llama_cpp.llama_sampler_chain_n(s.sampler)
        s.add_grammar(SimpleNamespace(vocab=vocab, model=model), p.grammar)
    if p.temperature == 0:
        if with_dist:
            s.add_greedy()
        return s
    s.add_top_k(p.top_k)
    s.add_typical(p.typical_p, 1)
    s.add_top_p(p.top_p, 1)
    s.add_min_p(p.min_p, 1)
    s.add_temp(p.temperature)
    if with_dist:
        s.add_dist(p.seed)
    return s


# enum dflash_verify_mode (csrc/dflash.h), by name
MODE_NAMES = {lib.DFLASH_VERIFY_GREEDY: "greedy", lib.DFLASH_VERIFY_MATCH: "match",
              lib.DFLASH_VERIFY_REJECTION: "rejection"}


def verification(p: SamplingParams, model, vocab, n_vocab: int, history: Sequence[int] = ()):
    """The C loop's verify mode for a request, and the sampler chain it needs (or None):
    exact argmax when nothing transforms the logits, else the chain (match) or its transforms
    without the final draw (rejection)."""
    if p.is_plain_greedy:
        return lib.DFLASH_VERIFY_GREEDY, None
    if p.temperature == 0 or p.mode == "match":
        return lib.DFLASH_VERIFY_MATCH, build_chain(p, model, vocab, n_vocab, with_dist=True, history=history)
    return lib.DFLASH_VERIFY_REJECTION, build_chain(p, model, vocab, n_vocab, with_dist=False, history=history)


def grammar_params(p: SamplingParams, chain) -> dict:
    """The engine's grammar fields: the chain's grammar sampler (a cffi pointer, or NULL), whether
    drafts walk it, and whether a row's raw argmax may be checked against it alone (greedy with
    no other transform: then the chain would pick that argmax whenever the grammar allows it)."""
    if chain is None or chain.grammar_index < 0:
        return {"grammar": ffi.NULL, "grammar_drafts": False, "grammar_argmax": False}
    return {"grammar": ptr("struct llama_sampler *", llama_cpp.llama_sampler_chain_get(chain.sampler,
                                                                                      chain.grammar_index)),
            "grammar_drafts": p.grammar_aware_drafting, "grammar_argmax": p.is_greedy_but_grammar}
