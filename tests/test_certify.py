"""llama_dflash.verify.certify: a greedy divergence is certified as llama.cpp batch numerics only when
plain llama-cpp-python, evaluating the speculative run's own batches, picks the speculative token."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.verify.certify import certify, gap_in_batches

PROMPT = "# TODO: fix the"  # diverges at a 0.0004 margin on the tiny llama target (tests/test_engine.py)


@pytest.fixture(scope="module")
def setup(artifacts):
    a = artifacts["llama"]
    checker = llama_cpp.Llama(a["target"], n_ctx=256, logits_all=True, verbose=False)
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256) as g:
        yield g, checker
    checker.close()


def test_near_tie_divergence_is_certified(setup):
    g, checker = setup
    toks = g.tokenize(PROMPT)
    plain = g.generate(toks, 40, draft_len=0, stop_on_eos=False, return_margins=True)
    steps: list[dict] = []
    spec = g.generate(toks, 40, draft_len=7, stop_on_eos=False, on_step=steps.append)
    assert spec.tokens != plain.tokens
    c = certify(checker, toks + plain.tokens, toks + spec.tokens, len(toks), steps)
    assert c["certified"] and 0 <= c["gap_one_by_one"] < 0.01 and c["gap_in_spec_batches"] < 0
    assert c["gap_one_by_one"] == pytest.approx(plain.margins[c["position"]], abs=1e-4)


def test_a_real_mismatch_is_not_certified(setup):
    """A 'speculative' run that took a wrong token where plain decoding is not near a tie (what a
    broken acceptance rule would produce) is not explained by the replay."""
    g, checker = setup
    toks = g.tokenize("The capital of France is")
    plain = g.generate(toks, 24, draft_len=0, stop_on_eos=False, return_margins=True)
    k = max(range(24), key=lambda j: plain.margins[j])  # the most confident position
    wrong = plain.tokens[:k] + [(plain.tokens[k] + 1) % g.n_vocab] + plain.tokens[k + 1:]
    steps: list[dict] = []
    g.generate(toks, 24, draft_len=0, stop_on_eos=False, on_step=steps.append)  # this run's batches
    c = certify(checker, toks + plain.tokens, toks + wrong, len(toks), steps)
    assert c["position"] == k and not c["certified"] and c["gap_in_spec_batches"] > 0.5


class _Recorder:
    """A stand-in checker: row p of the logits says which eval call (1, 2, ...) last computed it."""

    def __init__(self) -> None:
        self.n_tokens, self.calls, self.scores = 0, 0, np.zeros((64, 2), np.float32)
        self._ctx = self

    def reset(self) -> None:
        self.n_tokens = 0

    def kv_cache_clear(self) -> None:
        self.calls = 0

    def kv_cache_seq_rm(self, _seq: int, p0: int, _p1: int) -> None:
        pass

    def eval(self, batch: list[int]) -> None:
        self.calls += 1
        self.scores[self.n_tokens:self.n_tokens + len(batch), 0] = self.calls
        self.n_tokens += len(batch)


def test_replay_takes_the_row_that_chose_the_token():
    """A position first evaluated as a rejected row of one step (after its first mismatch) and
    decided by a later step is read from the later step's batch, the row that chose its token."""
    n_prompt = 10  # positions 0-9; the prefill's last row chose token 10
    # step 1: anchor 10, 7 drafts, none accepted -> commits position 11;
    # step 2: anchor 11, 3 drafts, 2 accepted -> commits 12, 13, 14
    steps = [{"drafted": 7, "accepted": 0, "committed": 12}, {"drafted": 3, "accepted": 2, "committed": 15}]
    tokens = list(range(15))
    rec = _Recorder()
    # rows 11 and 12 lie in both batches: step 1's rejected rows and step 2's deciding ones
    for i in (12, 13):
        assert gap_in_batches(rec, tokens, n_prompt, steps, i, 0, 1) == 3.0  # prefill = call 1, step 2 = call 3
    assert gap_in_batches(rec, tokens, n_prompt, steps, 11, 0, 1) == 2.0  # row 10: step 1's row 0 chose it
    assert gap_in_batches(rec, tokens, n_prompt, steps, 10, 0, 1) == 1.0  # the prefill's last row
