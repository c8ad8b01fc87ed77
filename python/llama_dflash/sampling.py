"""Sampling settings and the llama.cpp sampler chains that verify drafts at T > 0.

The chain is built with llama-cpp-python's own sampler objects, in the order
``llama_cpp.Llama._init_sampler`` uses (penalties, grammar, top-k, typical,
top-p, min-p, temperature, dist), so that a match-mode generation with a seed
samples exactly what ``Llama`` samples with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from llama_cpp import _internals

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
    seed: int = 0xFFFFFFFF          # LLAMA_DEFAULT_SEED: random
    mode: str = "match"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax without any logit transform: the exact greedy path (with margins)."""
        return (self.temperature == 0 and self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and not self.logit_bias and self.grammar is None)


def build_chain(p: SamplingParams, model, vocab, n_vocab: int, with_dist: bool = True) -> _internals.LlamaSampler:
    """The request's chain; without the final dist sampler it is the transform chain whose
    surviving logits define p for rejection sampling."""
    s = _internals.LlamaSampler()
    if p.logit_bias:
        s.add_logit_bias(n_vocab, {int(k): float(v) for k, v in p.logit_bias.items()})
    s.add_penalties(n_vocab=n_vocab, penalty_last_n=p.penalty_last_n, penalty_repeat=p.repeat_penalty,
                    penalty_freq=p.frequency_penalty, penalty_present=p.presence_penalty)
    if p.grammar is not None:
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


MODE_NAMES = {0: "greedy", 1: "match", 2: "rejection"}  # enum dflash_verify_mode


def verification(p: SamplingParams, model, vocab, n_vocab: int):
    """The C loop's verify mode for a request, and the sampler chain it needs (or None):
    exact argmax when nothing transforms the logits, else the chain (match) or its transforms
    without the final draw (rejection)."""
    if p.is_plain_greedy:
        return 0, None
    if p.temperature == 0 or p.mode == "match":
        return 1, build_chain(p, model, vocab, n_vocab, with_dist=True)
    return 2, build_chain(p, model, vocab, n_vocab, with_dist=False)
