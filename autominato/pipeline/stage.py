"""One stage of the pipeline, written once: a bounded input queue, an executor, a stats hook.

Read, transform, batch and transfer are all :class:`Stage` instances; they differ only in
the function their executor runs. The modes of the loader are compositions of stages (see
:func:`autominato.pipeline.scheduler.compose`), never branches on a mode string.

An executor runs one item per worker at a time (so the scheduler knows which items each
worker holds, and a straggler never has work queued behind it) and reports every outcome as
a :class:`Result` through the ``post`` callback it was built with. The protocol says nothing
about threads or processes, so a remote executor (Ray actors) fits behind it too.

Model: SPDL's ``_pipe`` (one function per stage, hooks for statistics) and torchdata.nodes'
small base; see ``../shared/STYLE.md``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

#: ``hook(service_seconds, wait_seconds, nbytes)``, called once per finished item.
StatsHook = Callable[[float, float, int], None]


@dataclass(slots=True)
class Result:
    """The outcome of one item in one stage.

    Attributes:
        stage: the stage's name.
        key: the key the item was submitted with.
        value: the stage's output (``ok``), else ``None``.
        ok: the function returned.
        error: the exception it raised (``ok`` false, ``lost`` false), with sample context.
        lost: the worker holding the item is gone (died, or timed out and was abandoned):
            ``error`` says which; the item has no output.
        timed_out: lost because it took longer than the sample timeout.
        requeue: lost although it never started (queued behind the item that was lost in a
            worker's chunk): dispatch it again without counting it against the sample.
        service_s: seconds inside the stage's function.
        read_s: seconds of those spent reading (a stage that reads and transforms), or 0.
        nbytes: bytes of the output (array payload).
        peak_bytes: the item's peak memory in its worker process (bytes above the worker's
            resident set when it began; ``worker.PeakMeter``), 0 when not measured; negative:
            an upper bound (``SampleMemory.learn``).
    """

    stage: str
    key: Any
    value: Any = None
    ok: bool = True
    error: BaseException | None = None
    lost: bool = False
    timed_out: bool = False
    requeue: bool = False
    service_s: float = 0.0
    read_s: float = 0.0
    nbytes: int = 0
    peak_bytes: int = 0


class Executor(Protocol):
    """What a stage needs from whatever runs its function."""

    def submit(self, key: Any, item: Any) -> None:
        """Run the stage's function on ``item``; its :class:`Result` is posted later."""

    def resize(self, n: int) -> None:
        """Change the number of workers while running; busy workers finish their item."""

    @property
    def size(self) -> int:
        """Workers (not counting those retiring)."""

    @property
    def busy(self) -> int:
        """Items held by workers now."""

    def free(self) -> int:
        """Items that can be submitted now without queueing behind a busy worker."""

    def flush(self) -> None:
        """Start what was submitted (an executor may hold submissions to send them together)."""

    def new_pass(self) -> None:
        """A pass (epoch run) begins, before the scheduler sizes the workers: workers held
        back after a failed start may start again."""

    def expire(self, seconds: float) -> None:
        """Give up on items held longer than ``seconds``: each is posted as lost
        (``timed_out``) once its worker is replaced."""

    def stop(self) -> None:
        """Stop every worker; nothing is posted afterwards."""


class Stage:
    """A bounded input queue in front of an executor, with a statistics hook.

    Args:
        name: ``"read"``, ``"transform"``, ``"batch"`` or ``"transfer"``.
        executor: runs the items (see :class:`Executor`).
        hook: called with ``(service_s, wait_s, nbytes)`` for every finished item.
        capacity: the queue's capacity (a callable: it follows a live knob).
        prepare: ``prepare(key, item) -> item``, called as an item leaves the queue for a
            worker (process workers take their output slot then, not while queued).
        admit: ``admit(key, item, overtaking) -> bool``: whether a queued item may leave for
            a free worker now (see :mod:`autominato.pipeline.memory`). The first item is asked
            with ``overtaking=False``; while it is refused, each later one is asked in turn,
            while workers are free, with ``overtaking=True`` (it would start before the first,
            and before any refused between them): those ``admit`` lets pass start, the others
            keep their place in the queue.
        max_refusals: stop a scan at this many refusals (``None``: scan the whole queue;
            the scheduler sets :data:`~autominato.pipeline.memory.SCAN_REFUSALS`).

    Only the scheduler thread calls :meth:`put`, :meth:`pump` and :meth:`finished`.
    """

    def __init__(self, name: str, executor: Executor, hook: StatsHook,
                 capacity: Callable[[], int],
                 prepare: Callable[[Any, Any], Any] | None = None,
                 admit: Callable[[Any, Any, bool], bool] | None = None,
                 max_refusals: int | None = None) -> None:
        self.name = name
        self.executor = executor
        self.hook = hook
        self.capacity = capacity
        self.prepare = prepare
        self.admit = admit
        self.max_refusals = max_refusals
        #: odd while :meth:`pump` runs, a new number each pump: ``admit`` may keep what it
        #: computed for one pump (nothing else changes the workers' items meanwhile)
        self.scans = 0
        self.queue: deque = deque()
        self._waits: dict[Any, float] = {}
        # free workers left idle by ``admit`` at the last pump, its time, and the worker-
        # seconds summed up to it (one tuple, replaced whole: read by other threads)
        self._held_idle: tuple[int, float, float] = (0, 0.0, 0.0)

    def held_idle_s(self) -> float:
        """Worker-seconds that free workers waited because ``admit`` held the queued items
        back (summed over workers), seconds, up to the last :meth:`pump`: the free workers
        left after a scan that refused an item (at most as many as items queued) count from then
        until the next pump (the scheduler pumps at least every 50 ms). Never decreases, and
        stays put once the pumps stop (a closed pipeline)."""
        return self._held_idle[2]

    def room(self) -> int:
        """Items that may be put now: free workers plus free queue places."""
        return self.executor.free() + max(0, self.capacity() - len(self.queue))

    def put(self, key: Any, item: Any) -> None:
        self.queue.append((key, item, time.monotonic()))

    def pump(self, most: int | None = None) -> None:
        """Move queued items (``most`` of them at most) to free workers, oldest first."""
        ex = self.executor
        n = min(len(self.queue), ex.free())
        if most is not None:
            n = min(n, most)
        q = self.queue
        i = 0  # items refused so far: they keep their place, later ones may overtake them
        refused = False
        self.scans += 1
        try:
            while n > 0 and i < len(q):
                key, item, t = q[i]
                if self.admit is not None and not self.admit(key, item, i > 0):
                    refused = True
                    i += 1
                    if self.max_refusals is not None and i >= self.max_refusals:
                        break
                    continue
                del q[i]
                n -= 1
                self._waits[key] = time.monotonic() - t
                ex.submit(key, item if self.prepare is None else self.prepare(key, item))
        finally:
            self.scans += 1
        ex.flush()
        if self.admit is not None and (refused or self._held_idle[0]):
            idle_before, since, total = self._held_idle
            now = time.monotonic()
            idle = min(ex.free(), len(q)) if refused else 0
            self._held_idle = (idle, now, total + idle_before * (now - since))

    def finished(self, r: Result, count: bool = True) -> None:
        """Account for one result of this stage (call before acting on it); ``count=False``
        for a marker that is not an item."""
        wait = self._waits.pop(r.key, 0.0)
        if r.ok and count:
            self.hook(r.service_s, wait, r.nbytes)

    def drop(self, keep: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
        """Remove queued items whose key fails ``keep``; returns them ``(key, item)``."""
        kept, gone = deque(), []
        for entry in self.queue:
            (kept.append(entry) if keep(entry[0]) else gone.append(entry[:2]))
        self.queue = kept
        return gone
