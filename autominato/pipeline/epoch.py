"""One epoch's bookkeeping as pure state transitions: events in, decisions out.

:class:`Epoch` owns every *position* of one epoch's order (positions, not dataset indices,
are the unit: a sampler may repeat an index). It takes no lock, starts no thread and does no
I/O: the scheduler thread feeds it typed events (:class:`Completed`, :class:`Failed`,
:class:`Lost`) and carries out the decisions it returns (:class:`Emit`, :class:`Skip`,
:class:`Discard`, :class:`Raise`, :class:`End`). Exactly-once lives here and only here, so it
is tested without threads or processes (``tests/test_epoch.py`` replays thousands of random
interleavings of completions, failures, worker deaths, timeouts and window changes).

States of a position::

    waiting ──take()──► in flight ──Completed──► done ──► emitted in a batch   (final)
                          │  ▲                  │
                          │  └─ Lost(retry) ────┘  (worker died: dispatched again,
                          │                          at most ``max_tries`` times)
                          ├─ Failed / Lost(no retry) ──► on_error="skip": skipped (final)
                          │                              on_error="raise": Raise
                          └─ (epoch end with drop_last): a short remainder is dropped (final)

Rules:

* A result for a position that is not in flight (already final, or an attempt overtaken by a
  later one that finished first) is returned as :class:`Discard`, so its resources are freed
  and it is never delivered twice.
* :class:`Lost` and :class:`Failed` act only on the *current* attempt of a position: the late
  death of a worker whose sample was re-dispatched does not count twice.
* Batches hold ``batch_size`` samples, in completion order (default) or in sampler order
  (``in_order``); only the epoch's last batch may be short, and with ``drop_last`` none is
  (skipped samples shorten the epoch, never a batch in the middle of it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# -- events (in) ----------------------------------------------------------------------------


@dataclass(slots=True)
class Task:
    """A position handed to the pipeline: ``index = order[pos]``; ``attempt`` counts from 0."""

    pos: int
    index: int
    attempt: int


@dataclass(slots=True)
class Completed:
    """The sample at ``pos`` finished; ``result`` is whatever the pipeline carries for it."""

    pos: int
    attempt: int
    result: Any


@dataclass(slots=True)
class Failed:
    """Reading or transforming the sample at ``pos`` raised ``error`` (the sample's fault)."""

    pos: int
    attempt: int
    error: BaseException


@dataclass(slots=True)
class Lost:
    """The worker holding ``pos`` is gone: it died (``retry=True``: dispatch again, counted
    against ``max_tries`` unless ``count`` is false: the sample never started) or timed out
    (``retry=False``: the error policy applies at once)."""

    pos: int
    attempt: int
    error: BaseException
    retry: bool = True
    count: bool = True


Event = Completed | Failed | Lost

# -- decisions (out) ------------------------------------------------------------------------


@dataclass(slots=True)
class Emit:
    """Deliver one batch: ``items`` are ``(pos, index, result)`` in batch order.
    ``stragglers`` of them finished after a later-dispatched sample had been delivered."""

    items: tuple[tuple[int, int, Any], ...]
    stragglers: int = 0


@dataclass(slots=True)
class Skip:
    """The sample at ``pos`` is dropped by ``on_error="skip"`` (log it, count it)."""

    pos: int
    index: int
    error: BaseException


@dataclass(slots=True)
class Discard:
    """A result that will never be delivered (duplicate, late, or dropped by ``drop_last``
    after skips): free what it holds."""

    result: Any


@dataclass(slots=True)
class Raise:
    """``on_error="raise"``: the training loop gets ``error``; the epoch is over."""

    error: BaseException


@dataclass(slots=True)
class End:
    """Every position is final and every batch emitted."""


Decision = Emit | Skip | Discard | Raise | End

# -- the state ------------------------------------------------------------------------------


@dataclass
class Epoch:
    """The positions of one epoch and the transitions between their states.

    Args:
        order: dataset indices in sampler order (``order[pos]``).
        batch_size: samples per batch (>= 1).
        drop_last: never emit a short batch (the remainder is discarded).
        in_order: emit batches in sampler order (DataLoader's); else completion order.
        skip_errors: ``on_error="skip"`` (else ``"raise"``).
        max_tries: a position whose worker died this many times goes through the error policy.
    """

    order: Sequence[int]
    batch_size: int
    drop_last: bool = False
    in_order: bool = False
    skip_errors: bool = False
    max_tries: int = 3
    _cursor: int = 0
    _redo: deque = field(default_factory=deque)
    _attempt: dict = field(default_factory=dict)  # pos -> current attempt, while in flight
    _tries: dict = field(default_factory=dict)  # pos -> attempts made (re-dispatched ones)
    _deaths: dict = field(default_factory=dict)  # pos -> workers that died holding it
    _done: dict = field(default_factory=dict)  # in_order: pos -> (pos, index, result) or _SKIPPED
    _ready: list = field(default_factory=list)  # (pos, index, result) waiting for a batch
    _next_pos: int = 0  # in_order: first position not yet moved to _ready
    _final: int = 0  # positions final (emitted, skipped or dropped)
    batches: int = 0
    skipped: int = 0
    stragglers: int = 0
    failed: bool = False
    ended: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    # -- queries ------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def in_flight(self) -> int:
        """Positions dispatched and not yet completed or final."""
        return len(self._attempt)

    @property
    def held(self) -> int:
        """Positions dispatched and not yet emitted or final: what the epoch holds resources for."""
        return len(self._attempt) + len(self._ready) + sum(
            1 for r in self._done.values() if isinstance(r, tuple))

    @property
    def finished(self) -> bool:
        return self.ended or self.failed

    @property
    def exhausted(self) -> bool:
        """Nothing left to :meth:`take` now: every position handed out, no re-dispatch due
        (a worker death later may still make one due)."""
        return self._cursor >= len(self.order) and not self._redo

    def deaths(self, pos: int) -> int:
        """Workers that died holding ``pos`` so far."""
        return self._deaths.get(pos, 0)

    def is_current(self, pos: int, attempt: int) -> bool:
        return self._attempt.get(pos) == attempt

    # -- transitions --------------------------------------------------------------------
    def start(self) -> list[Decision]:
        """Decisions due before any event (an empty epoch ends at once)."""
        return self._maybe_end([])

    def take(self, n: int) -> list[Task]:
        """Up to ``n`` positions to dispatch now: re-dispatches first, then fresh ones."""
        tasks: list[Task] = []
        if self.finished:
            return tasks
        while len(tasks) < n:
            if self._redo:
                pos = self._redo.popleft()
                attempt = self._attempt[pos] = self._tries[pos]
            elif self._cursor < len(self.order):
                pos = self._cursor
                self._cursor += 1
                attempt = self._attempt[pos] = 0
            else:
                break
            tasks.append(Task(pos, int(self.order[pos]), attempt))
        return tasks

    def on(self, event: Event) -> list[Decision]:
        """Apply one event; returns the decisions it causes, in the order to carry them out."""
        if isinstance(event, Completed):
            return self._completed(event)
        if isinstance(event, Failed):
            if self.finished or not self.is_current(event.pos, event.attempt):
                return []
            return self._policy(event.pos, event.error)
        if isinstance(event, Lost):
            if self.finished or not self.is_current(event.pos, event.attempt):
                return []
            if event.retry:
                deaths = self._deaths.get(event.pos, 0) + event.count
                self._deaths[event.pos] = deaths
                if deaths < self.max_tries:
                    del self._attempt[event.pos]
                    self._tries[event.pos] = event.attempt + 1
                    self._redo.append(event.pos)
                    return []
            return self._policy(event.pos, event.error)
        raise TypeError(f"not an epoch event: {event!r}")

    def abort(self) -> list[Discard]:
        """The epoch is abandoned (the training loop stopped early): free every result held.
        Positions still in flight are not returned; their results arrive later and are
        discarded by :meth:`on` (the epoch is then finished)."""
        out = [Discard(r) for _, _, r in self._ready]
        out += [Discard(item[2]) for item in self._done.values() if isinstance(item, tuple)]
        self._ready.clear()
        self._done.clear()
        self.failed = True
        return out

    # -- internals ------------------------------------------------------------------------
    def _completed(self, ev: Completed) -> list[Decision]:
        if self.finished or ev.pos not in self._attempt:
            return [Discard(ev.result)]
        del self._attempt[ev.pos]
        self._deaths.pop(ev.pos, None)
        self._tries.pop(ev.pos, None)
        item = (ev.pos, int(self.order[ev.pos]), ev.result)
        if self.in_order:
            self._done[ev.pos] = item
            return self._advance([])
        self._ready.append(item)
        return self._emit_full([])

    def _policy(self, pos: int, error: BaseException) -> list[Decision]:
        self._attempt.pop(pos, None)
        self._deaths.pop(pos, None)
        self._tries.pop(pos, None)
        if not self.skip_errors:
            if self.in_order:
                # As the DataLoader: every batch before the failing sample's is delivered,
                # then the error is raised in place of that batch.
                self._done[pos] = _Failure(error)
                return self._advance([])
            return self._raise(error)
        self.skipped += 1
        self._final += 1
        out: list[Decision] = [Skip(pos, int(self.order[pos]), error)]
        if self.in_order:
            self._done[pos] = _SKIPPED
            return self._advance(out)
        return self._emit_full(out)

    def _raise(self, error: BaseException) -> list[Decision]:
        self.failed = True
        return [Raise(error), *self.abort()]

    def _advance(self, out: list[Decision]) -> list[Decision]:
        """In order: move the final positions at the cursor to the batch being filled."""
        B = self.batch_size
        while self._next_pos in self._done:
            item = self._done.pop(self._next_pos)
            if isinstance(item, _Failure):
                # Emit the batches before this one; the partial batch it belongs to is not.
                done = len(self._ready) - len(self._ready) % B
                self._ready, rest = self._ready[:done], self._ready[done:]
                self._emit_full(out)
                out += [Discard(r) for _, _, r in rest]
                return out + self._raise(item.error)
            if item is not _SKIPPED:
                self._ready.append(item)
            self._next_pos += 1
        return self._emit_full(out)

    def _emit_full(self, out: list[Decision]) -> list[Decision]:
        B = self.batch_size
        while len(self._ready) >= B:
            group, self._ready = self._ready[:B], self._ready[B:]
            out.append(self._batch(group))
        return self._maybe_end(out)

    def _batch(self, group: list) -> Emit:
        k = self.batches
        s = 0 if self.in_order else sum(1 for pos, _, _ in group if pos // self.batch_size < k)
        self.stragglers += s
        self.batches += 1
        self._final += len(group)
        return Emit(tuple(group), s)

    def _maybe_end(self, out: list[Decision]) -> list[Decision]:
        if self.ended or self.failed:
            return out
        if self._final + len(self._ready) < self.size:
            return out
        # Every position is final or ready: the remainder (< batch_size) is the last batch.
        if self._ready:
            if self.drop_last:
                out += [Discard(r) for _, _, r in self._ready]
                self._final += len(self._ready)
                self._ready = []
            else:
                out.append(self._batch(self._ready))
                self._ready = []
        self.ended = True
        out.append(End())
        return out


class _Failure:
    """In order, a failed position waits for its turn to raise."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Skipped:
    def __repr__(self) -> str:
        return "<skipped>"


_SKIPPED = _Skipped()
