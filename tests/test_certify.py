"""llama_dflash.verify.certify: a greedy divergence is certified as llama.cpp batch numerics only when
plain llama-cpp-python, evaluating the speculative run's own batches, picks the speculative token."""

from __future__ import annotations

import numpy as np
import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.verify.certify import certify, gap_in_batches
from llama_dflash.verify.certify import checker as make_checker

PROMPTS = ["# TODO: fix the", "def main():"]  # (the first diverged at a 0.0004 margin on one CPU)


@pytest.fixture(scope="module")
def setup(artifacts):
    a = artifacts["llama"]
    checker = make_checker(a["target"], 256)
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=256) as g:
        yield g, checker
    checker.close()


class _Numerics:
    """A stand-in checker over two tokens whose rounding depends on the batch, as llama.cpp's may: the
    row that chooses position `tie` prefers token 0 by `alone` evaluated alone and by `batched` (negative:
    token 1) in a batch of several rows; every other row prefers token 0 by a wide margin."""

    def __init__(self, tie: int, alone: float, batched: float) -> None:
        self.tie, self.alone, self.batched = tie, alone, batched
        self.n_tokens, self.scores = 0, np.zeros((64, 2), np.float32)
        self._ctx = self

    def reset(self) -> None:
        self.n_tokens = 0

    def kv_cache_clear(self) -> None:
        pass

    def kv_cache_seq_rm(self, _seq: int, p0: int, _p1: int) -> None:
        pass

    def eval(self, batch: list[int]) -> None:
        for p in range(self.n_tokens, self.n_tokens + len(batch)):
            gap = (self.alone if len(batch) == 1 else self.batched) if p == self.tie - 1 else 5.0
            self.scores[p] = (gap, 0.0)
        self.n_tokens += len(batch)


# a run of 4 prompt tokens and 12 generated ones (token 0 everywhere, but for the speculative run's token 1
# at position 9); its steps: the prefill chose position 4, then [drafted, accepted] per step
N_PROMPT, TIE = 4, 9
PLAIN = [0] * 16
SPEC = PLAIN[:TIE] + [1] + PLAIN[TIE + 1:]


def _steps(shape: list[tuple[int, int]]) -> list[dict]:
    out, committed = [], N_PROMPT + 1
    for drafted, accepted in shape:
        committed += accepted + 1
        out.append({"drafted": drafted, "accepted": accepted, "committed": committed})
    return out


def test_a_divergence_the_batches_explain_is_certified():
    """Plain decoding (one row a call) prefers its token by a hair, the speculative run's batch of four
    rows (anchor at 7, position 9 chosen by its row 1) the other: certified as batch numerics."""
    c = certify(_Numerics(TIE, 0.001, -0.002), PLAIN, SPEC, N_PROMPT, _steps([(3, 2), (3, 0), (3, 3), (3, 3)]))
    assert c == {"position": TIE - N_PROMPT, "plain_token": 0, "spec_token": 1,
                 "gap_one_by_one": pytest.approx(0.001), "gap_in_spec_batches": pytest.approx(-0.002),
                 "certified": True}


@pytest.mark.parametrize("why,alone,batched,shape", [
    ("the batches prefer plain's token too", 0.001, 0.002, [(3, 2), (3, 0), (3, 3), (3, 3)]),
    ("the deciding row was a plain step's, alone", 0.001, -0.002, [(3, 2), (0, 0), (0, 0), (3, 3), (3, 3)]),
    ("plain decoding does not prefer its own token", -0.001, -0.002, [(3, 2), (3, 0), (3, 3), (3, 3)]),
    ("the steps are not this run's", 0.001, -0.002, [(3, 1), (3, 3)]),
])
def test_a_divergence_the_batches_do_not_explain_is_not_certified(why, alone, batched, shape):
    steps = _steps(shape)
    if why == "the steps are not this run's":
        steps[1]["committed"] += 1  # (its anchor is not where the step before left the sequence)
    c = certify(_Numerics(TIE, alone, batched), PLAIN, SPEC, N_PROMPT, steps)
    assert c["position"] == TIE - N_PROMPT and not c["certified"], (why, c)
    assert c["gap_one_by_one"] == pytest.approx(alone)
    assert c["gap_in_spec_batches"] == (None if why == "the steps are not this run's" else pytest.approx(
        alone if why == "the deciding row was a plain step's, alone" else batched))


def test_identical_runs_need_no_certificate():
    assert certify(_Numerics(TIE, 0.001, -0.002), PLAIN, PLAIN, N_PROMPT, _steps([(3, 3)] * 3)) is None


def test_real_runs_diverge_only_at_replayed_near_ties(setup):
    """Greedy speculative runs against plain ones on the tiny target: a run either equals plain decoding
    or first differs where plain llama-cpp-python, replaying both runs' batches, sees a near-tie (which
    token wins there is this CPU's rounding; the replay's one-row gap is plain decoding's own margin)."""
    g, checker = setup
    for p in PROMPTS:
        toks = g.tokenize(p)
        plain = g.generate(toks, 40, draft_len=0, stop_on_eos=False, return_margins=True)
        steps: list[dict] = []
        spec = g.generate(toks, 40, draft_len=7, stop_on_eos=False, on_step=steps.append)
        c = certify(checker, toks + plain.tokens, toks + spec.tokens, len(toks), steps)
        if spec.tokens == plain.tokens:
            assert c is None, p
            continue
        assert c is not None and c["gap_in_spec_batches"] is not None, (p, c)
        assert 0 <= c["gap_one_by_one"] < 0.01 and abs(c["gap_in_spec_batches"]) < 0.01, (p, c)
        assert c["gap_one_by_one"] == pytest.approx(plain.margins[c["position"]], abs=1e-4), (p, c)


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
