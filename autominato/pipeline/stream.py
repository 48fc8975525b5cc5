"""One epoch of an iterable dataset as pure state transitions: events in, decisions out.

The counterpart of :mod:`autominato.pipeline.epoch` for a dataset that is iterated, not
indexed (``torch.utils.data.IterableDataset``, a webdataset pipeline). There are no positions
to hand out: each of ``shards`` workers iterates its own shard (``iter(dataset)`` with
``get_worker_info()`` saying which, so the dataset shards itself as under the DataLoader), and
:class:`Stream` decides how many samples each shard may be asked for (*pulls*, bounded by the
window the scheduler gives it: backpressure), which samples form a batch and when the epoch
ends. It takes no lock, starts no thread and does no I/O; ``tests/test_stream.py`` replays
random interleavings.

Rules:

* A shard has at most one pull open (sent, not yet answered by :class:`PullDone`); a pull asks
  for ``n`` samples and is answered by up to ``n`` :class:`Yielded` / :class:`YieldFailed`,
  then :class:`PullDone` (``unused``: samples not produced because the shard ended).
* Completion order (default): samples join the batch being filled as they arrive, whatever
  their shard; only the epoch's last batch may be short, none with ``drop_last``.
* ``in_order``: as the DataLoader with an iterable dataset, each batch holds ``batch_size``
  consecutive samples of one shard, and batches come round-robin over the shards (shard 0's
  first, shard 1's first, ..., shard 0's second, ...), a shard that ended leaving the round;
  each shard's last batch may be short (``drop_last`` drops it), as each DataLoader worker's.
* A failed sample is skipped (``skip_errors``) or raised at once, and its shard is pulled on
  (as by DataLoader's workers: a generator that raised then ends). In order, the samples of the
  batch it was in that came before it are lost with it (discarded), as the DataLoader's worker
  loses the batch it was fetching; a shard whose worker is gone
  (:class:`ShardLost`) ends the epoch with its error: its iterator died with the worker.
* Exactly once: every sample yielded is emitted in one batch, skipped, raised, dropped by
  ``drop_last`` or discarded (the epoch already failed); none is asked for twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autominato.pipeline.epoch import Decision, Discard, Emit, End, Raise, Skip, _Failure

# -- decisions and events ---------------------------------------------------------------------


@dataclass(slots=True)
class Pull:
    """Ask the worker of ``shard`` for ``n`` more samples; ``seq`` counts the shard's earlier
    pulls (0: its iterator is to be created)."""

    shard: int
    n: int
    seq: int


@dataclass(slots=True)
class Yielded:
    """The shard's iterator yielded a sample and it was transformed: ``result``."""

    shard: int
    result: Any


@dataclass(slots=True)
class YieldFailed:
    """``next()`` on the shard's iterator, or the transform, raised ``error``."""

    shard: int
    error: BaseException


@dataclass(slots=True)
class PullDone:
    """The open pull of ``shard`` is answered; ``unused`` of its samples were not produced;
    ``exhausted``: the shard's iterator ended."""

    shard: int
    unused: int
    exhausted: bool


@dataclass(slots=True)
class ShardLost:
    """The worker iterating ``shard`` is gone (it died or timed out): ``error`` says why."""

    shard: int
    error: BaseException


StreamEvent = Yielded | YieldFailed | PullDone | ShardLost


@dataclass
class Stream:
    """The shards of one epoch of an iterable dataset and the transitions between their states.

    Args:
        shards: workers iterating the dataset, each its own shard (>= 1).
        batch_size: samples per batch (>= 1).
        drop_last: never emit a short batch (see the module docstring for ``in_order``).
        in_order: DataLoader's batch order (module docstring); else completion order.
        skip_errors: ``on_error="skip"`` (else ``"raise"``).
        max_pull: most samples asked of a shard in one pull.

    Raises:
        ValueError: ``shards < 1`` or ``batch_size < 1``.

    Emitted items are ``(arrival, -1, result)``: ``arrival`` counts samples as they arrived
    (there is no dataset index).
    """

    shards: int
    batch_size: int
    drop_last: bool = False
    in_order: bool = False
    skip_errors: bool = False
    max_pull: int = 64
    _asked: list = field(default_factory=list)  # shard -> samples of its open pull not answered
    _open: list = field(default_factory=list)  # shard -> a pull is open
    _seq: list = field(default_factory=list)  # shard -> pulls sent
    _exhausted: list = field(default_factory=list)  # shard -> its iterator ended
    _queues: list = field(default_factory=list)  # in_order: shard -> samples awaiting a batch
    _ready: list = field(default_factory=list)  # completion order: samples awaiting a batch
    _turn: int = 0  # in_order: the shard whose batch is next
    _arrived: int = 0
    batches: int = 0
    skipped: int = 0
    raised: int = 0  # samples whose error was raised (on_error="raise"; the epoch goes on)
    failed: bool = False
    ended: bool = False

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"an iterable dataset's epoch needs >= 1 shard, got {self.shards}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        n = self.shards
        self._asked, self._open, self._seq = [0] * n, [False] * n, [0] * n
        self._exhausted = [False] * n
        self._queues = [[] for _ in range(n)]

    # -- queries ------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.ended or self.failed

    @property
    def held(self) -> int:
        """Samples asked for and not yet answered, plus samples (and, in order, errors)
        awaiting their batch's turn: what the epoch holds resources for."""
        return sum(self._asked) + len(self._ready) + sum(map(len, self._queues))

    def is_open(self, shard: int) -> bool:
        return self._open[shard]

    # -- transitions --------------------------------------------------------------------
    def start(self) -> list[Decision]:
        return []

    def take(self, room: int) -> list[Pull]:
        """Pulls to send now, asking ``room`` samples at most in all, shared among the shards
        that have none open. In order, the shard whose batch is next may ask for one sample
        even without room, so that samples other shards hold never stall the epoch."""
        if self.finished:
            return []
        want = [s for s in range(self.shards) if not self._open[s] and not self._exhausted[s]]
        if not want:
            return []
        pulls = []
        if room <= 0:
            if self.in_order and self._turn in want:
                pulls.append(self._pull(self._turn, 1))
            return pulls
        per = max(1, min(self.max_pull, room // len(want)))
        for s in want:
            n = min(per, room)
            if n <= 0:
                break
            pulls.append(self._pull(s, n))
            room -= n
        return pulls

    def on(self, event: StreamEvent) -> list[Decision]:
        """Apply one event; returns the decisions it causes, in the order to carry them out."""
        if isinstance(event, Yielded):
            if self.finished:
                return [Discard(event.result)]
            self._answered(event.shard)
            item = (self._arrived, -1, event.result)
            self._arrived += 1
            if self.in_order:
                self._queues[event.shard].append(item)
                return self._advance([])
            self._ready.append(item)
            return self._emit_full([])
        if isinstance(event, YieldFailed):
            if self.finished:
                return []
            self._answered(event.shard)
            pos = self._arrived
            self._arrived += 1
            if not self.skip_errors:
                # As DataLoader's workers: the error goes to the training loop and the shard is
                # pulled on (a generator that raised then ends; other shards are not affected).
                self.raised += 1
                if self.in_order:  # in the shard's turn, in place of the batch it was in
                    self._queues[event.shard].append(_Failure(event.error, pos))
                    return self._advance([])
                return [Raise(event.error, pos=pos, lost=(pos,))]
            self.skipped += 1
            return [Skip(pos, -1, event.error)]
        if isinstance(event, PullDone):
            s = event.shard
            self._asked[s] = 0
            self._open[s] = False
            if event.exhausted:
                self._exhausted[s] = True
            if self.finished:
                return []
            return self._advance([]) if self.in_order else self._maybe_end([])
        if isinstance(event, ShardLost):
            self._asked[event.shard] = 0
            self._open[event.shard] = False
            if self.finished:
                return []
            return self._raise(event.error)
        raise TypeError(f"not a stream event: {event!r}")

    def abort(self) -> list[Discard]:
        """The epoch is abandoned: free every sample held. Answers still on their way are
        discarded by :meth:`on` (the epoch is then finished)."""
        out = [Discard(r) for _, _, r in self._ready]
        for q in self._queues:
            out += [Discard(it[2]) for it in q if type(it) is not _Failure]
            q.clear()
        self._ready.clear()
        self.failed = True
        return out

    # -- internals ------------------------------------------------------------------------
    def _pull(self, s: int, n: int) -> Pull:
        p = Pull(s, n, self._seq[s])
        self._seq[s] += 1
        self._open[s] = True
        self._asked[s] = n
        return p

    def _answered(self, s: int) -> None:
        self._asked[s] = max(0, self._asked[s] - 1)

    def _raise(self, error: BaseException) -> list[Decision]:
        return [Raise(error, final=True), *self.abort()]  # the epoch ends with it

    def _batch(self, items: list) -> Emit:
        self.batches += 1
        return Emit(tuple(items))

    def _emit_full(self, out: list[Decision]) -> list[Decision]:
        B = self.batch_size
        while len(self._ready) >= B:
            items, self._ready = self._ready[:B], self._ready[B:]
            out.append(self._batch(items))
        return self._maybe_end(out)

    def _done(self, s: int) -> bool:
        """No more samples will come from shard ``s``."""
        return self._exhausted[s] and not self._open[s]

    def _advance(self, out: list[Decision]) -> list[Decision]:
        """In order: emit the batches whose turn it is (see the module docstring)."""
        B = self.batch_size
        while not all(self._done(s) and not self._queues[s] for s in range(self.shards)):
            s = self._turn
            q = self._queues[s]
            failed = next((i for i, it in enumerate(q[:B]) if type(it) is _Failure), None)
            if failed is not None:
                # The error takes the place of the batch it was in, and the samples of that
                # batch before it are lost with it, as a DataLoader worker's fetch of the batch
                # raises (its next batch starts after the failing sample).
                f, before = q[failed], q[:failed]
                del q[:failed + 1]
                out += [Discard(r) for _, _, r in before]
                out.append(Raise(f.error, pos=f.pos, lost=(*(it[0] for it in before), f.pos)))
            elif len(q) >= B:
                out.append(self._batch(q[:B]))
                del q[:B]
            elif self._done(s):
                if q and self.drop_last:
                    out += [Discard(r) for _, _, r in q]
                elif q:
                    out.append(self._batch(list(q)))
                q.clear()
            else:
                return out  # wait for this shard's next samples
            self._turn = (s + 1) % self.shards  # a shard that ended leaves the round here
        return self._maybe_end(out)

    def _maybe_end(self, out: list[Decision]) -> list[Decision]:
        if self.finished or not all(self._done(s) for s in range(self.shards)):
            return out
        if any(self._queues):
            return out  # in order: batches still to emit (after _advance, none)
        if self._ready:
            if self.drop_last:
                out += [Discard(r) for _, _, r in self._ready]
            else:
                out.append(self._batch(self._ready))
            self._ready = []
        self.ended = True
        out.append(End())
        return out

