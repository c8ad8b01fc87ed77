"""Several generations on one target, stepped together (docs/architecture.md §5.10).

On a compute-bound CPU one ``llama_decode`` of R rows costs far less than R decodes of one row
(measured here: 4 sequences' rows in one batch take 0.5-0.7x the time of their separate decodes),
so a server with several requests in flight serves them faster together than in turn.  An
``EngineGroup`` runs a scheduler thread over ``JointEngines`` (core/engine.py, which owns the
native side): a second context on the core's model with one sequence per slot (a KV stream
each) and a sequence engine per slot (its own drafter state: the drafter's weights are shared).
Each scheduler round admits waiting generations into free slots (their prefill), then runs
``dflash_engine_step_group``: every active sequence drafts, and one decode verifies all their rows.
Adaptive sequences price their rows at what they add to the joint batch, so under load drafting
only goes on where it still pays.

Output: each sequence is verified exactly as alone (its own sampler chain and draws), so the
output is what plain decoding gives up to llama.cpp's batch numerics -- in the default mode a
joint batch rounds differently and may move a near-tie, in exact mode it is bit-identical to the
same request alone (tests/test_group.py).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence

from .. import _native, options
from .._native import ffi, lib
from ..errors import DFlashError
from .engine import EngineCore, EngineRequest, JointEngines, Run
from .stats import SpecStats

Hold = Callable[[], contextlib.AbstractContextManager]
"""Exclusive use of the model's native state (its drafter is shared with the core's own engine)."""


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class GroupSequence:
    """One generation in an ``EngineGroup``: iterate it for its tokens (a list per step, the
    prefill's token first) as the scheduler commits them -- with ``rows``, (tokens, the logits
    row behind each) -- and ``close()`` it to end it early."""

    def __init__(self, tokens: list[int], req: EngineRequest, history: Sequence[int], rows: bool) -> None:
        self.tokens, self.req, self.history, self.rows = tokens, req, list(history), rows
        self.stats: SpecStats | None = None   # once it has ended
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self.done = threading.Event()  # the scheduler has let it go (stats set, slot free)
        self._withdraw: Callable[[GroupSequence], bool] | None = None
        # the scheduler's side
        self.slot = -1
        self.run: Run | None = None
        self.exit = contextlib.ExitStack()

    def __iter__(self) -> Iterator:
        while True:
            item = self._out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self, wait: bool = True) -> None:
        """Stop after the current step (the slot is freed; what was not read is dropped); wait:
        until the scheduler has let it go (one round at most), so that ``stats`` are final."""
        self._cancelled.set()
        if self._withdraw is not None and self._withdraw(self):  # it had not started: gone now
            return
        if wait:
            self.done.wait()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class EngineGroup(_native.Resource):
    """n_seq generations at a time on ``core``'s model, each of up to ``n_ctx`` positions.

    cparams: the ``llama_context_params`` (ctypes) the core's own context was created with --
    copied, with n_seq sequences (a KV stream each).  hold: exclusive use of the model's
    native state around each scheduler round (the core's own generations take it too).
    on_done: called with each finished generation's stats (in the scheduler thread, under hold).
    """

    def __init__(self, core: EngineCore, cparams, n_seq: int, n_ctx: int, *,
                 hold: Hold = contextlib.nullcontext, on_done: Callable[[SpecStats], None] | None = None) -> None:
        if not 2 <= n_seq <= min(options.MAX_PARALLEL, int(cparams.n_batch)):
            raise ValueError(f"a group takes 2..min({options.MAX_PARALLEL}, n_batch {cparams.n_batch}) sequences, "
                             f"got {n_seq}")
        self._native: JointEngines | None = None
        self._thread: threading.Thread | None = None
        self.core, self.n_seq, self._hold, self._on_done = core, n_seq, hold, on_done
        # exact mode: joint batches no larger than the self-check proved bit-identical to one-row decoding
        self._max_rows = core.exact.max_rows if core.exact is not None else 0
        if core.exact is not None and n_seq > self._max_rows:
            raise ValueError(f"exact mode: {n_seq} concurrent sequences exceed the {self._max_rows} rows its "
                             "self-check proved invariant (use parallel <= that)")
        self._native = JointEngines(core, cparams, n_seq, n_ctx, self._max_rows)  # (JointBatchesDiffer)
        self.n_ctx = self._native.n_ctx
        self._free = list(range(n_seq))
        self._active: dict[int, GroupSequence] = {}
        self._waiting: collections.deque[GroupSequence] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self.joint_steps = 0      # scheduler rounds that verified at least one sequence
        self.joint_sequences = 0  # sequences those rounds verified (/ joint_steps: sequences per decode)
        self._prompts: list[list[int]] = [[] for _ in range(n_seq)]  # each slot's last prompt (its KV prefix)
        self._thread = threading.Thread(target=self._loop, name="llama-dflash-group", daemon=True)
        self.thread = self._thread
        self._thread.start()

    # -- the callers' side ---------------------------------------------------------------------

    def submit(self, tokens: Sequence[int], req: EngineRequest, history: Sequence[int] = (),
               rows: bool = False) -> GroupSequence:
        """Queue one generation; it starts when a slot is free (first come, first served).
        history: what logits processors see before the first generated token; rows: hand out
        each token's logits row too (copied: the scheduler moves on)."""
        req.check()
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("the prompt is empty")
        if len(toks) + req.max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(toks)} tokens) + max_tokens ({req.max_tokens}) exceed the "
                             f"{self.n_ctx} positions of a concurrent slot")
        if any(t < 0 or t >= self.core.n_vocab for t in toks):
            raise ValueError(f"a prompt token is outside the vocabulary (0..{self.core.n_vocab - 1})")
        seq = GroupSequence(toks, req, history, rows)
        seq._withdraw = self._withdraw
        with self._cv:
            if self._closing:
                raise DFlashError("the group is closed")
            self._waiting.append(seq)
            self._cv.notify()
        return seq

    def _withdraw(self, seq: GroupSequence) -> bool:
        with self._cv:
            if seq not in self._waiting:
                return False
            self._waiting.remove(seq)
        seq._out.put(None)
        seq.done.set()
        return True

    @property
    def load(self) -> tuple[int, int]:
        """(generations running, generations waiting for a slot)."""
        with self._cv:
            return len(self._active), len(self._waiting)

    # -- the scheduler -------------------------------------------------------------------------

    def _loop(self) -> None:
        n_rows = int(lib.DFLASH_MAX_ROWS)
        out = ffi.new("int32_t[]", self.n_seq * n_rows)
        counts = ffi.new("int32_t[]", self.n_seq)
        err = _native.err_buf()
        while True:
            with self._cv:
                while not self._closing and not self._waiting and not self._active:
                    self._cv.wait()
                if self._closing:
                    break
                admit = []
                while self._waiting and self._free:
                    seq = self._waiting.popleft()
                    # the free slot whose cached prompt shares the longest prefix (a system prompt, an
                    # earlier turn of the conversation) prefills least
                    best = max(self._free, key=lambda s: _common(self._prompts[s], seq.tokens))
                    self._free.remove(best)
                    seq.slot = best
                    self._prompts[best] = seq.tokens
                    admit.append(seq)
                    self._active[seq.slot] = seq
                active = list(self._active.values())
            try:
                with self._hold():
                    self._round(admit, active, out, counts, err)
            except Exception as ex:  # noqa: BLE001 - a bug: end what runs with it, never leave readers waiting
                traceback.print_exc(file=sys.stderr)
                with self._hold():
                    for s in list(self._active.values()):
                        self._finish(s, DFlashError(f"internal error in the concurrent scheduler "
                                                    f"({type(ex).__name__})"))
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for s in waiting:
            s._out.put(DFlashError("the group was closed"))
            s.done.set()
        # (no lock needed: this touches the group's own engines and the requests' sampler chains only)
        for s in list(self._active.values()):
            self._finish(s, DFlashError("the group was closed"))

    def _round(self, admit: list[GroupSequence], active: list[GroupSequence], out, counts, err) -> None:
        """One scheduler round: prefill the admitted, drop the closed, step the rest together."""
        n_rows = int(lib.DFLASH_MAX_ROWS)
        for seq in admit:
            self._start(seq, err)
        for seq in active:
            if seq.cancelled and seq.slot in self._active:
                self._finish(seq)
        live = [s for s in active if s.slot in self._active and s.run is not None]
        if not live:
            return
        if not self._native.step([s.slot for s in live], out, counts, err):
            msg = DFlashError(_native.err_str(err))
            for s in live:
                self._finish(s, msg)
            return
        self.joint_steps += 1
        self.joint_sequences += len(live)
        for i, s in enumerate(live):
            n = counts[i]
            if n > 0:
                self._put(s, list(out[i * n_rows:i * n_rows + n]))
            else:
                self._finish(s, None if n == 0 else self._error(s, err))

    def _start(self, seq: GroupSequence, err) -> None:
        try:
            seq.run = seq.exit.enter_context(self._native.start(self.core, seq.slot, seq.tokens, seq.req, seq.history))
            first = self._native.prefill(seq.slot, seq.run, len(seq.tokens), err)
        except BaseException as ex:  # noqa: BLE001 - handed to the caller
            seq.run = None
            self._finish(seq, ex)
            return
        self._put(seq, [first])

    def _put(self, seq: GroupSequence, tokens: list[int]) -> None:
        if seq.rows:  # before the next decode overwrites them
            seq._out.put((tokens, [seq.run.logits(k).copy() for k in range(len(tokens))]))
        else:
            seq._out.put(tokens)

    def _error(self, seq: GroupSequence, err) -> BaseException:
        if seq.run is not None and seq.run.errors:
            return seq.run.errors[0]
        return DFlashError(_native.err_str(err))

    def _finish(self, seq: GroupSequence, error: BaseException | None = None) -> None:
        """End a generation: its stats, its sampler chain, its slot (the KV it leaves there is
        reused by the next generation in the slot that shares its prefix)."""
        if seq.run is not None:
            with contextlib.suppress(Exception):
                seq.stats = seq.run.stats()
                if self._on_done is not None:
                    self._on_done(seq.stats)
        with contextlib.suppress(Exception):
            seq.exit.close()
        seq.run = None
        with self._cv:
            if self._active.get(seq.slot) is seq:
                del self._active[seq.slot]
                self._free.append(seq.slot)
        seq._out.put(error if error is not None else None)
        seq.done.set()

    def close(self) -> None:
        t = getattr(self, "_thread", None)
        if t is not None:
            with self._cv:
                self._closing = True
                self._cv.notify()
            if t is not threading.current_thread():
                t.join()
            self._thread = None
        if getattr(self, "_native", None) is not None:
            self._native.close()
        self._native = None
