"""Statistics of one speculative generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .._native import lib
from . import kernels as _kernels


class Acceptance:
    """tau and acceptance rate from steps / drafted / accepted counters."""

    steps: int
    drafted: int
    accepted: int

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


# enum dflash_stop_reason (csrc/dflash.h), by name
STOP_NAMES = {lib.DFLASH_STOP_EOS: "eos", lib.DFLASH_STOP_MAX_TOKENS: "max_tokens"}

@dataclass
class SpecStats(Acceptance):
    """What one generation did and where its time went.

    tau is the mean acceptance length per verify step, bonus token included
    (1 <= tau <= n + 1).  per_position[k] is the fraction of steps that drafted
    a token at position k+1 and had it accepted; with adaptive drafting,
    per_position_expected[k] is what the calibration predicted for the same steps.  Times are seconds; t_total_s
    covers the decode phase (after prefill), t_other_s is the loop's own cost.
    """

    n_prompt: int = 0
    n_reused: int = 0  # prompt tokens whose KV was kept from the previous generation
    n_generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[float] = field(default_factory=list)
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    t_prefill_s: float = 0.0
    t_draft_s: float = 0.0
    t_verify_s: float = 0.0
    t_total_s: float = 0.0
    stop_reason: str = ""
    draft_len: int = 0
    drafter: str = "none"
    mode: str = "greedy"  # greedy | match | rejection (| plain: a drop-in Llama's fallback)
    fallback_reason: str = ""
    exact: str = ""           # exact mode: what its self-check verified ("" = default mode)
    grammar_cut: int = 0      # drafts the grammar ended early (grammar-aware drafting)
    grammar_skipped: int = 0  # draft slots whose best candidate the grammar forbade (replaced)
    grammar_argmax: int = 0   # greedy rows settled by checking the raw argmax against the grammar alone
    # adaptive drafting (speculation "auto", docs/architecture.md §5.9)
    adaptive: bool = False
    plain_steps: int = 0      # steps that did not call the drafter: the cost model said it would not pay
    probes: int = 0           # drafted steps that probed while drafting was not paying
    lengths: list[int] = field(default_factory=list)  # steps by verified draft length (index 0: none)
    t_predicted_s: float = 0.0  # the cost model's prediction of t_draft_s + t_verify_s
    per_position_expected: list[float] = field(default_factory=list)  # calibrated acceptance per position
    kernels: str = field(default_factory=lambda: _kernels.describe())  # who ran the small products

    @property
    def t_other_s(self) -> float:
        return max(0.0, self.t_total_s - self.t_draft_s - self.t_verify_s)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens produced by verify steps per second of decode phase."""
        n = self.n_generated - 1
        return n / self.t_total_s if n > 0 and self.t_total_s > 0 else 0.0

    @classmethod
    def from_c(cls, st, draft_len: int, drafter: str, adaptive: bool = False) -> SpecStats:
        n = max((i + 1 for i in range(len(st.per_position_drafted)) if st.per_position_drafted[i]), default=0)
        drafted = [int(st.per_position_drafted[i]) for i in range(n)]
        accepted = [int(st.per_position_accepted[i]) for i in range(n)]
        lengths = [int(x) for x in st.length_hist]
        while lengths and lengths[-1] == 0:
            lengths.pop()
        return cls(
            adaptive=adaptive,
            plain_steps=st.plain_steps,
            probes=st.probes,
            lengths=lengths,
            t_predicted_s=st.t_predicted_s,
            per_position_expected=[float(st.per_position_expected[i]) / d if d else 0.0
                                   for i, d in zip(range(n), drafted, strict=True)],
            n_prompt=st.n_prompt,
            n_reused=st.n_reused,
            grammar_cut=st.grammar_cut,
            grammar_skipped=st.grammar_skipped,
            grammar_argmax=st.grammar_argmax,
            n_generated=st.n_generated,
            steps=st.steps,
            drafted=st.drafted,
            accepted=st.accepted,
            per_position=[a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)],
            per_position_drafted=drafted,
            per_position_accepted=accepted,
            t_prefill_s=st.t_prefill_s,
            t_draft_s=st.t_draft_s,
            t_verify_s=st.t_verify_s,
            t_total_s=st.t_total_s,
            stop_reason=STOP_NAMES.get(st.stop_reason, "stopped"),
            draft_len=draft_len,
            drafter=drafter,
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, t_other_s=self.t_other_s,
                 tokens_per_s=self.tokens_per_s)
        return d
