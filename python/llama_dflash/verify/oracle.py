"""Replay draft sources: propose a known continuation with errors at chosen positions.

Used by the tests (every rejection position) and by the benchmarks (a fixed
acceptance rate without a trained drafter).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


class ReplayDraftSource:
    """Proposes `sequence[len(history):]`, corrupting the draft at index corrupt(step, n).

    corrupt returns the first wrong draft index, or >= n for none.  After a
    divergence of the committed history (a numerical near-tie) it keeps
    replaying, which only produces rejected drafts.
    """

    def __init__(self, sequence: Sequence[int], n_vocab: int,
                 corrupt: Callable[[int, int], int] | None = None) -> None:
        self.sequence = list(sequence)
        self.n_vocab = n_vocab
        self.corrupt = corrupt or (lambda step, n: n)
        self.step = 0
        self.expected: list[int] = []  # drafts each step should get accepted (if history matches)

    def __call__(self, history: Sequence[int], n: int) -> list[int]:
        h = len(history)
        prop = self.sequence[h:h + n]
        bad = self.corrupt(self.step, n)
        self.step += 1
        if 0 <= bad < len(prop):
            prop[bad] = (prop[bad] + 1) % self.n_vocab
        self.expected.append(min(max(bad, 0), len(prop)))
        return prop

    @classmethod
    def cycling(cls, sequence: Sequence[int], n_vocab: int, offset: int = 0) -> ReplayDraftSource:
        """The corrupted index cycles through 0..n (n = none): every rejection position occurs."""
        return cls(sequence, n_vocab, lambda step, n: (step + offset) % (n + 1))

    @classmethod
    def with_acceptance(cls, sequence: Sequence[int], n_vocab: int, alpha: float,
                        seed: int = 0) -> ReplayDraftSource:
        """Each draft token is right with probability alpha, independently (i.i.d. acceptance)."""
        rng = random.Random(seed)

        def corrupt(step: int, n: int) -> int:
            k = 0
            while k < n and rng.random() < alpha:
                k += 1
            return k

        return cls(sequence, n_vocab, corrupt)
