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
                          │                              on_error="raise": raised (final; the
                          │                              epoch goes on, as DataLoader's)
                          └─ (epoch end with drop_last): a short remainder is dropped (final)

Rules:

* A result for a position that is not in flight (already final, or an attempt overtaken by a
  later one that finished first) is returned as :class:`Discard`, so its resources are freed
  and it is never delivered twice.
* :class:`Lost` and :class:`Failed` act only on the *current* attempt of a position: the late
  death of a worker whose sample was re-dispatched does not count twice.
* Batches hold ``batch_size`` samples, in completion order (default) or in sampler order
  (``in_order``); only the epoch's last batch may be short, and with ``drop_last`` none is
  (skipped samples shorten the epoch, never a batch in the middle of it). In order with
  ``on_error="raise"``, the batches are the DataLoader's: batch ``k`` is positions
  ``[k * batch_size, (k + 1) * batch_size)`` (kept as fixed ``groups``, below), so an error
  loses its whole batch and the batches after it are the ones an epoch without it delivers.
* With ``groups`` (a ``batch_sampler``'s batches), a batch is one group, emitted when all its
  positions are final: the first complete group first (default) or in group order
  (``in_order``); a skipped sample shortens its own group (one whose samples are all skipped
  emits nothing); ``drop_last`` does not apply (the batch sampler decides). An empty group (a
  batch sampler that yields ``[]``) is an empty batch, emitted (``Emit(())``) at the epoch's
  start in completion order (it is complete at once), at its turn in order: the DataLoader
  fetches nothing for it and calls ``collate_fn([])``, whose result (or error:
  ``default_collate``'s ``IndexError``) takes the batch's place, so ``len(loader)`` batches
  come, as its batch sampler's ``len()`` says.
* ``on_error="raise"``: the error goes to the training loop and the epoch goes on, so a loop
  that catches it gets the batches after it, as from the DataLoader's iterator. Lost with it
  (:attr:`Raise.lost`): in completion order the failing sample alone (its batch is made of
  other samples), in order or with ``groups`` its whole batch, as the DataLoader's (the
  batch's samples not dispatched yet are never loaded). In order, the error comes after every
  batch before the failing sample's and before any batch after it; only the first error of a
  batch is raised.
* A resumed epoch starts with ``done`` positions already final (delivered before a
  checkpoint): they are never dispatched, count towards the epoch's end and ``drop_last``, and
  ``in_order`` steps over them, so the remaining batches are the ones the uninterrupted epoch
  would have delivered after the checkpoint.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def occurrences(order: Sequence[int]) -> np.ndarray | None:
    """For each position of ``order`` (dataset indices), which occurrence of its index it is,
    counted from 0 in position order (``[5, 3, 5, 5] -> [0, 0, 1, 2]``), int64 of
    ``len(order)``; ``None`` when no index repeats (a sampler that draws with replacement
    repeats). Linear time (a ``bincount``) when the indices lie in ``[0, 2 * len(order))``, as
    a dataset's do, else a sort; measured on a 2-core machine for a list of a million
    indices: 45 ms without repeats, 250 ms with them (the list's conversion included)."""
    o = np.asarray(order, dtype=np.int64)
    if o.size < 2:
        return None
    lo, hi = int(o.min()), int(o.max())
    if 0 <= lo and hi < 2 * o.size + 1024:
        if int(np.bincount(o).max()) < 2:
            return None
    elif np.unique(o).size == o.size:  # (indices far apart, or negative ones)
        return None
    by_index = np.argsort(o, kind="stable")  # equal indices together, in position order
    s = o[by_index]
    rank = np.arange(o.size)
    start = np.where(np.concatenate(([True], s[1:] != s[:-1])), rank, 0)
    np.maximum.accumulate(start, out=start)  # each run's first rank
    occ = np.empty(o.size, np.int64)
    occ[by_index] = rank - start
    return occ


# -- events (in) ----------------------------------------------------------------------------


@dataclass(slots=True)
class Task:
    """A position handed to the pipeline: ``index = order[pos]``; ``attempt`` counts from 0;
    ``draw``: which occurrence of ``index`` in the order this position is, counted from 0
    (:func:`occurrences`; it seeds a repeat's augmentation anew)."""

    pos: int
    index: int
    attempt: int
    draw: int = 0


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
    """The training loop gets ``error``. ``final``: the epoch is over (a worker death under
    ``on_worker_death="raise"``, decided by the scheduler; an iterable's shard lost with its
    worker); else (a sample's error under ``on_error="raise"``) the epoch goes on after it."""

    error: BaseException
    final: bool = False
    pos: int | None = None  # the failing position (the first of a group's, with groups)
    lost: tuple[int, ...] = ()  # positions lost with it (see Epoch): not loaded after a resume


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
        in_order: emit batches in sampler order (DataLoader's); else completion order. With
            ``skip_errors`` false and no ``groups``, the batches are fixed runs of
            ``batch_size`` positions (``groups`` is set to them), as the DataLoader's.
        skip_errors: ``on_error="skip"`` (else ``"raise"``).
        max_tries: a position whose worker died this many times goes through the error policy.
        groups: sizes of consecutive groups of positions that form the batches (a
            ``batch_sampler``'s lists, flattened into ``order``), or ``None``.
        done: positions already final before this epoch runs (delivered before a
            checkpoint; see ``Loader.state_dict``). Repeats are ignored.
        done_empty: with ``groups``, how many of the empty groups (in group order: the order
            in which they are emitted, in order or not) were delivered before a checkpoint:
            they are not emitted again.
        cost: slow first: a dataset index's predicted seconds (``costs.SampleCosts.
            estimate``); None (the default): fresh positions go in sampler order. See
            :meth:`take`.
        lookahead: positions :meth:`take` chooses among with ``cost`` (the scheduler sets it
            before each take: ``min(pool_size, SLOW_FIRST_LOOKAHEAD)``, 0 for chunked
            samples); 0 or 1: sampler order.

    Raises:
        ValueError: ``batch_size < 1``, ``groups`` that do not sum to ``len(order)``, or a
            ``done`` position outside ``[0, len(order))``.
    """

    order: Sequence[int]
    batch_size: int
    drop_last: bool = False
    in_order: bool = False
    skip_errors: bool = False
    max_tries: int = 3
    groups: Sequence[int] | None = None
    done: Iterable[int] = ()
    done_empty: int = 0
    _cursor: int = 0
    _redo: deque = field(default_factory=deque)
    _attempt: dict = field(default_factory=dict)  # pos -> current attempt, while in flight
    _tries: dict = field(default_factory=dict)  # pos -> attempts made (re-dispatched ones)
    _deaths: dict = field(default_factory=dict)  # pos -> workers that died holding it
    _done: dict = field(default_factory=dict)  # in order, not fixed: pos -> (pos, index, result), _SKIPPED or _Failure
    _ready: list = field(default_factory=list)  # (pos, index, result) waiting for a batch
    _next_pos: int = 0  # in_order: first position not yet moved to _ready
    _final: int = 0  # positions final (emitted, skipped or dropped)
    batches: int = 0
    skipped: int = 0
    raised: int = 0  # errors raised (on_error="raise"): a sample's, or a group's first
    stragglers: int = 0
    failed: bool = False
    ended: bool = False
    unique: bool = False  # the caller knows that no index repeats in ``order``
    _draws: Any = None  # occurrences(order)
    cost: Callable[[int], float] | None = field(default=None, repr=False)  # (see Args)
    lookahead: int = 0
    _ahead: list = field(default_factory=list)  # positions past the cursor not handed out yet
    _fresh: int = 0  # positions handed out for the first time
    # slow first: pos -> its rank in the order taken (counting the ``done`` positions), for
    # the positions it chose, from their take to their batch (so at most the window's)
    _rank: dict = field(default_factory=dict)

    @property
    def distinct(self) -> int:
        """How many dataset indices the epoch's order visits (each once however often it
        repeats; ``_draws`` is None where none repeats)."""
        return len(self.order) if self._draws is None else int((self._draws == 0).sum())

    def __post_init__(self) -> None:
        # Here, in the thread that builds the epoch (the training loop's), not at the first
        # take() on the scheduler thread, where it would hold up the epoch before it.
        self._draws = None if self.unique else occurrences(self.order)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.done = tuple(self.done)  # read again by others (rows.RowAllocator.open)
        n, B = len(self.order), self.batch_size
        self._fixed = 0  # the groups are fixed runs of this many positions (pos // _fixed)
        if (self.in_order and not self.skip_errors and self.groups is None
                and not (self.drop_last and n % B) and _whole_batches(self.done, n, B)):
            # The DataLoader's batches (its BatchSampler's): an error loses its whole batch
            # and the batches after it do not move (a sampler that buckets shapes keeps its
            # buckets). With skips, or resumed from a state whose delivered positions are not
            # whole batches (a completion-order one), a batch is filled from the next samples.
            self.groups = [B] * (n // B) + ([n % B] if n % B else [])
            self._fixed = B
        if self.groups is not None:
            sizes = list(self.groups) if self._fixed else [int(k) for k in self.groups]
            if not self._fixed and (sum(sizes) != n or any(k < 0 for k in sizes)):
                raise ValueError(f"groups sum to {sum(sizes)}, not to the {n} "
                                 "positions of the order")
            self._starts = [0, *itertools.accumulate(sizes)]  # group -> its first position (and the end)
            self._left = sizes  # positions of a group not yet final
            self._members: dict = {}  # group -> items completed
            self._complete: dict = {}  # in_order: group -> items (or _Failure) awaiting its turn
            self._lost_groups: set = set()  # groups lost to an error (raised or waiting to be)
            self._failing: dict = {}  # lost group -> its first failure in position order, until raised
            self._next_group = 0
            # empty groups (a batch sampler's []) still to emit as empty batches, in group
            # order; those delivered before a checkpoint (done_empty) are not
            empties = [g for g, k in enumerate(sizes) if k == 0]
            self._empty_due: set = set(empties[max(0, int(self.done_empty)):])
        self._prior = bytearray(n)  # pos -> 1: final before the epoch ran
        # (read at every dispatch: computed once)
        self._min_window = (max(self._left, default=1) or 1
                            if self.groups is not None and not self._fixed else self.batch_size)
        for pos in self.done:
            if not 0 <= pos < len(self.order):
                raise ValueError(f"done position {pos} is not in [0, {len(self.order)})")
            if not self._prior[pos]:
                self._prior[pos] = 1
                self._final += 1
                if self.groups is not None:
                    self._left[self._gid(pos)] -= 1
        self._done_n = self._final  # positions final before the epoch ran
        if self.groups is not None:
            self._empty_groups()
        else:
            self.batches = self._final // self.batch_size  # the batches delivered before

    # -- queries ------------------------------------------------------------------------
    def _gid(self, pos: int) -> int:
        """The group of position ``pos`` (with ``groups``)."""
        if self._fixed:
            return pos // self._fixed
        return bisect.bisect_right(self._starts, pos) - 1  # (past empty groups at ``pos``)

    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def min_window(self) -> int:
        """Positions this epoch must be let hold at once to complete its largest batch (a
        ``batch_sampler``'s largest group, else ``batch_size``): a smaller window never
        completes it."""
        return self._min_window

    @property
    def redo_due(self) -> int:
        """Positions due for re-dispatch (their worker died): the window must let them go
        whatever it holds, or an epoch whose window filled behind them never ends."""
        return len(self._redo)

    @property
    def in_flight(self) -> int:
        """Positions dispatched and not yet completed or final."""
        return len(self._attempt)

    @property
    def held(self) -> int:
        """Positions dispatched and not yet emitted or final: what the epoch holds resources for."""
        held = len(self._attempt) + len(self._ready) + sum(
            1 for r in self._done.values() if isinstance(r, tuple))
        if self.groups is not None:
            held += sum(map(len, self._members.values()))
            held += sum(len(g) for g in self._complete.values() if isinstance(g, list))
        return held

    @property
    def finished(self) -> bool:
        return self.ended or self.failed

    @property
    def exhausted(self) -> bool:
        """Nothing left to :meth:`take` now: every position handed out, no re-dispatch due
        (a worker death later may still make one due)."""
        return self._cursor >= len(self.order) and not self._ahead and not self._redo

    def deaths(self, pos: int) -> int:
        """Workers that died holding ``pos`` so far."""
        return self._deaths.get(pos, 0)

    def settled(self, pos: int) -> bool:
        """Whether dispatched position ``pos`` is final: neither in flight nor waiting to go
        again (after a :class:`Failed` or :class:`Lost`: it failed for good)."""
        return pos not in self._attempt and pos not in self._tries

    def attempts(self) -> list[tuple[int, int]]:
        """``(pos, attempt)`` of the positions in flight."""
        return list(self._attempt.items())

    def is_current(self, pos: int, attempt: int) -> bool:
        return self._attempt.get(pos) == attempt

    # -- transitions --------------------------------------------------------------------
    def start(self) -> list[Decision]:
        """Decisions due before any event: the empty groups' batches (in order, those before
        the first group with a sample); an empty epoch ends at once."""
        out: list[Decision] = []
        if self.groups is not None and self._empty_due:
            if self.in_order:
                self._drain_groups(out)
            else:  # (complete at once: the first complete first)
                out += [self._batch([]) for _ in range(len(self._empty_due))]
                self._empty_due.clear()
        return self._maybe_end(out)

    def take(self, n: int) -> list[Task]:
        """Up to ``n`` positions to dispatch now: re-dispatches first, then fresh ones.

        Fresh positions go in sampler order, except in completion order without ``groups``
        once the epoch's first batch is handed out and ``cost`` is set: then the position
        whose index has the largest ``cost`` among the next ``lookahead`` ones not handed
        out goes first (the earliest of equals), so a sample known to be slow starts before
        the faster ones around it and finishes while they fill batches, instead of holding
        up the batches or the epoch's end (longest processing time first, Graham 1969). A
        position passed over until the cursor is more than ``2 x lookahead`` past it goes
        next, whatever its cost: no sample comes more than about that many places late, so
        a loop that stops an epoch early still gets the fast samples in their share. The
        order in which samples arrive changes; which samples an epoch delivers does not.
        """
        tasks: list[Task] = []
        if self.finished:
            return tasks
        slow_first = (self.cost is not None and self.lookahead > 1 and not self.in_order
                      and self.groups is None)
        while len(tasks) < n:
            if self._redo:
                pos = self._redo.popleft()
                attempt = self._attempt[pos] = self._tries[pos]
            else:
                chose = slow_first and self._fresh >= self.batch_size
                pos = self._next_fresh(chose)
                if pos is None:
                    break
                if chose:
                    self._rank[pos] = self._fresh + self._done_n
                self._fresh += 1
                attempt = self._attempt[pos] = 0
            tasks.append(Task(pos, int(self.order[pos]), attempt, self.draw(pos)))
        return tasks

    def _next_fresh(self, slow_first: bool) -> int | None:
        """The next fresh position (see :meth:`take`), or None when none is left."""
        ahead, prior, n = self._ahead, self._prior, len(self.order)
        if not slow_first:
            if ahead:  # (looked ahead before: the earliest of those is next in order)
                return ahead.pop(0)
            while self._cursor < n and prior[self._cursor]:
                self._cursor += 1
            if self._cursor >= n:
                return None
            self._cursor += 1
            return self._cursor - 1
        while len(ahead) < self.lookahead and self._cursor < n:
            if not prior[self._cursor]:
                ahead.append(self._cursor)
            self._cursor += 1
        if not ahead:
            return None
        if self._cursor - ahead[0] > 2 * self.lookahead:
            # Passed over long enough: a sample is handed out at most about 2 x lookahead
            # places after its turn, so that a loop that stops early (max_steps) gets the
            # fast samples in their share, not only at the epoch's end.
            return ahead.pop(0)
        cost, order = self.cost, self.order
        best, top = 0, cost(int(order[ahead[0]]))
        for i in range(1, len(ahead)):
            c = cost(int(order[ahead[i]]))
            if c > top:
                best, top = i, c
        return ahead.pop(best)

    def draw(self, pos: int) -> int:
        """Which occurrence of its index position ``pos`` is in the order, counted from 0
        (:func:`occurrences`)."""
        draws = self._draws
        return 0 if draws is None else int(draws[pos])

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
            g = self._gid(event.pos) if self.groups is not None else -1
            if g >= 0 and g in self._lost_groups and (g not in self._failing
                                           or event.pos > self._failing[g].pos):
                # its batch is lost already (and its error is not waiting for this sample):
                # not loaded again
                del self._attempt[event.pos]
                self._deaths.pop(event.pos, None)
                self._tries.pop(event.pos, None)
                return self._lost_member(g, [])
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
        if self.groups is not None:
            for items in (*self._members.values(), *self._complete.values()):
                if isinstance(items, list):
                    out += [Discard(r) for _, _, r in items]
            self._members.clear()
            self._complete.clear()
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
        if self.groups is not None:
            g = self._gid(ev.pos)
            if g in self._lost_groups:  # its group's batch is lost to an error
                return self._lost_member(g, [Discard(ev.result)])
            self._members.setdefault(g, []).append(item)
            return self._group_final(g, [])
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
            if self.groups is not None:
                return self._group_failed(self._gid(pos), error, pos)
            if self.in_order:
                # (a resumed epoch whose batches are not fixed) as the DataLoader: every batch
                # before the failing sample's is delivered, then the error is raised
                self._done[pos] = _Failure(error, pos)
                return self._advance([])
            self.raised += 1
            self._final += 1
            return self._emit_full([Raise(error, pos=pos, lost=(pos,))])
        self.skipped += 1
        self._final += 1
        out: list[Decision] = [Skip(pos, int(self.order[pos]), error)]
        if self.groups is not None:
            return self._group_final(self._gid(pos), out)
        if self.in_order:
            self._done[pos] = _SKIPPED
            return self._advance(out)
        return self._emit_full(out)

    def _lost_member(self, g: int, out: list[Decision]) -> list[Decision]:
        """A position of group ``g``, whose batch an error lost, is final (failed too,
        completed, or its worker died)."""
        self._left[g] -= 1
        self._final += 1
        return self._group_failure(g, out)

    def _group_failed(self, g: int, error: BaseException, pos: int) -> list[Decision]:
        """A position of group ``g`` failed (``on_error="raise"``): the group's batch is lost
        (its completed members discarded now, the others as they complete). Raised: the
        error of its first failing position in sampler order, as the DataLoader's fetch,
        which stops at a batch's first error (so the members after it are not loaded: those
        not dispatched yet, or due again after a death, never are), once every member before
        it is final (one of them may fail too); in group order with ``in_order``."""
        first = self._failing.get(g)
        if g in self._lost_groups and (first is None or pos > first.pos):
            return self._lost_member(g, [])  # raised already, or after the first failure
        self._left[g] -= 1
        self._final += 1
        out: list[Decision] = []
        if g not in self._lost_groups:
            self.raised += 1
            self._lost_groups.add(g)
            members = self._members.pop(g, [])
            self._final += len(members)
            out += [Discard(r) for _, _, r in members]
            for q in range(max(self._cursor, self._starts[g]), self._starts[g + 1]):
                if not self._prior[q]:
                    self._prior[q] = 1  # take() steps over it
                    self._left[g] -= 1
                    self._final += 1
            while self._cursor < len(self._prior) and self._prior[self._cursor]:
                self._cursor += 1  # (so that the epoch is ``exhausted`` when nothing is left)
        self._failing[g] = _Failure(error, pos)
        due = [q for q in self._redo if q > pos and self._gid(q) == g]
        for q in due:
            self._redo.remove(q)
            self._tries.pop(q, None)
            self._deaths.pop(q, None)
        self._left[g] -= len(due)
        self._final += len(due)
        return self._group_failure(g, out)

    def _group_failure(self, g: int, out: list[Decision]) -> list[Decision]:
        """Raise lost group ``g``'s failure if it is due (see :meth:`_group_failed`)."""
        f = self._failing.get(g)
        if f is not None and not any(q in self._attempt or q in self._tries
                                     for q in range(self._starts[g], f.pos)):
            del self._failing[g]
            if self.in_order:
                return self._group_ready(g, f, out)
            out.append(Raise(f.error, pos=f.pos, lost=self._span(g)))
        return self._maybe_end(out)

    def _span(self, g: int) -> tuple[int, ...]:
        return tuple(range(self._starts[g], self._starts[g + 1]))

    def _advance(self, out: list[Decision]) -> list[Decision]:
        """In order without fixed batches (skipping errors, or resumed from a state whose
        delivered positions are not whole batches): move the final positions at the cursor to
        the batch being filled (a skipped or failed one is left out: the next samples fill
        its batch)."""
        prior = self._prior
        while True:
            if self._next_pos < len(prior) and prior[self._next_pos]:
                self._next_pos += 1
                continue
            if self._next_pos not in self._done:
                break
            item = self._done.pop(self._next_pos)
            if isinstance(item, _Failure):
                # The full batches before it first; the samples before it that do not fill
                # a batch wait for the ones after it (only the failing sample is lost).
                self._emit_batches(out)
                out.append(Raise(item.error, pos=item.pos, lost=(item.pos,)))
                self.raised += 1
                self._final += 1
                self._next_pos += 1
                continue
            if item is not _SKIPPED:
                self._ready.append(item)
            self._next_pos += 1
        return self._emit_full(out)

    def _emit_full(self, out: list[Decision]) -> list[Decision]:
        self._emit_batches(out)
        return self._maybe_end(out)

    def _emit_batches(self, out: list[Decision]) -> None:
        """Emit every full batch waiting in ``_ready``."""
        B = self.batch_size
        while len(self._ready) >= B:
            group, self._ready = self._ready[:B], self._ready[B:]
            out.append(self._batch(group))

    def _batch(self, group: list) -> Emit:
        k = self.batches
        if self.in_order or self.groups is not None:
            s = 0
        else:  # (slow first: a position it chose counts by the order it was taken in)
            rank, B = self._rank, self.batch_size
            s = sum(1 for pos, _, _ in group if rank.pop(pos, pos) // B < k)
        self.stragglers += s
        self.batches += 1
        self._final += len(group)
        return Emit(tuple(group), s)

    def _group_final(self, g: int, out: list[Decision]) -> list[Decision]:
        """One more position of group ``g`` is final (completed or skipped)."""
        self._left[g] -= 1
        if self._left[g] or g in self._complete:
            return out
        items = sorted(self._members.pop(g, []), key=lambda it: it[0])
        return self._group_ready(g, items, out)

    def _group_ready(self, g: int, items: Any, out: list[Decision]) -> list[Decision]:
        """Group ``g`` is complete (``items``, in sampler order) or failed (a ``_Failure``)."""
        if not self.in_order:
            if items:
                out.append(self._batch(items))
            return self._maybe_end(out)
        self._complete[g] = items
        self._drain_groups(out)
        return self._maybe_end(out)

    def _drain_groups(self, out: list[Decision]) -> None:
        """In order: emit the groups whose turn has come, complete ones and empty ones."""
        while True:
            g = self._next_group
            if g in self._complete:
                items = self._complete.pop(g)
            elif g in self._empty_due:  # a batch sampler's [] at its turn
                self._empty_due.discard(g)
                items = None
            else:
                return
            self._next_group += 1
            if isinstance(items, _Failure):
                out.append(Raise(items.error, pos=items.pos, lost=self._span(g)))
            elif items is None:
                out.append(self._batch([]))
            elif items:  # (a group whose samples were all skipped emits nothing)
                out.append(self._batch(items))
            self._empty_groups()

    def _empty_groups(self) -> None:
        """In order, step over groups with nothing left to emit: those delivered before a
        checkpoint (every position ``done``; an empty one among the first ``done_empty``).
        An empty group still due stops it: its batch is emitted at its turn."""
        if self.in_order:
            while (self._next_group < len(self._left) and self._left[self._next_group] == 0
                   and self._next_group not in self._complete
                   and self._next_group not in self._empty_due):
                self._next_group += 1

    def _maybe_end(self, out: list[Decision]) -> list[Decision]:
        if self.ended or self.failed:
            return out
        if self._final + len(self._ready) < self.size:
            return out
        if self.groups is not None and self._empty_due:
            return out  # (in order, an empty batch still to come: emitted at its turn)
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
    """In order, an error waiting for its turn to be raised (a position's, or in a stream a
    shard's sample's: ``stream.py`` uses it too)."""

    __slots__ = ("error", "pos")

    def __init__(self, error: BaseException, pos: int) -> None:
        self.error = error
        self.pos = pos


class _Skipped:
    def __repr__(self) -> str:
        return "<skipped>"


_SKIPPED = _Skipped()


def _whole_batches(done: Sequence[int], n: int, size: int) -> bool:
    """Whether positions ``done`` (of ``n``) are whole batches of ``size`` (the last may be
    short): what an in-order epoch with fixed batches has delivered before a checkpoint."""
    count: dict[int, int] = {}
    for pos in set(done):
        count[pos // size] = count.get(pos // size, 0) + 1
    return all(c == min(size, n - k * size) for k, c in count.items())
