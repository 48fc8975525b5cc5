"""Each dataset index's last service time: what slow-first dispatch orders by.

Uneven samples (KiTS19's CT volumes differ 30x in transform time, 15 ms to 0.85 s) leave the
accelerator idle when a slow sample starts late: the batches after it wait for it, or the
epoch's end does. In completion order the loader may start the samples of its window in any
order, so it starts the one known to be slowest first (``epoch.Epoch.take``: longest
processing time first among the next ``pool_size`` positions, at most
``scheduler.SLOW_FIRST_LOOKAHEAD``, after the epoch's first batch, which goes in sampler order
so that a cold start's first batch is not held up by the slow ones; no sample comes more than
about two lookaheads late). A sample's time is its index's last one (its stages' seconds
together: read and transform), which a volume's size sets mostly and a random crop or flip
partly. An index not measured yet counts at the mean of those measured (0 before any), so the
first epoch goes in sampler order, unless the figures came with a ``Loader.state_dict()``
(``sample_seconds``: a resumed run's first epoch goes slow first too; the figures measured
here win). Samples sent to workers in chunks (under 10 ms each) are not reordered.

Replayed with ``scripts/ideal_loader.py`` (the Loader's own dispatch code, with
``epoch.Epoch.take``, on a simulated clock, nothing else) on one serial measurement of the
KiTS19 bench's samples at MLPerf size (``--cases 42 --ranks 2``, 6 epochs, 2 workers, window
8), wall time over max(floor, steps), memory-aware dispatch without and with slow first:
1.335 -> 1.290 at the balanced step, 1.274 -> 1.229 at 0.9x it, 1.276 -> 1.235 at 1.1x; at 8
cases (4 batches an epoch) 1.594 -> 1.586. On the real Loader at MLPerf size (sampler order
forced by an estimate of 0, runs interleaved) the 2-core machine's noise was larger than the
effect: at a 0.15 s step, 7 pairs, the training loop's waits had a median of 1.19 s with slow
first against 2.67 s without (lower in 4 of the 7 pairs; before the bound on how late a sample
may come); at 0.165 s, 4 pairs, 2.41 s against 1.76 s (lower in 1 of the 4).
"""

from __future__ import annotations

import threading

import numpy as np

from autominato.pipeline.memory import MAX_INDICES, MAX_SAVED


class SampleCosts:
    """The last service time (seconds) of each index of a map-style dataset of ``n`` samples
    (none kept for ``n`` None, 0 or above ``memory.MAX_INDICES``: every estimate is 0 then)."""

    def __init__(self, n: int | None) -> None:
        self._s = np.zeros(n, np.float32) if n and n <= MAX_INDICES else None
        self._sum = 0.0
        self._count = 0
        # learn (the scheduler thread) against restore (a load_state_dict in the training
        # process); estimate reads without it (an element, or a mean a figure behind)
        self._lock = threading.Lock()

    @property
    def kept(self) -> bool:
        """Whether figures are kept at all (else every estimate is 0)."""
        return self._s is not None

    def learn(self, index: int, seconds: float) -> None:
        """Record ``seconds`` as ``index``'s time (an index out of range is ignored)."""
        s = self._s
        if s is None or not 0 <= index < len(s) or not seconds > 0:
            return
        with self._lock:
            old = float(s[index])
            if old > 0:
                self._sum -= old
            else:
                self._count += 1
            s[index] = seconds
            self._sum += float(s[index])

    def saved(self) -> list[float] | None:
        """The figures as ``Loader.state_dict()`` keeps them (``sample_seconds``): seconds
        per index, 0 unknown; ``None`` when none was measured or the dataset has more than
        :data:`~autominato.pipeline.memory.MAX_SAVED` indices."""
        s = self._s
        if s is None or not self._count or len(s) > MAX_SAVED:
            return None
        with self._lock:
            return s.astype(np.float64).round(6).tolist()

    def restore(self, seconds: list[float] | None) -> None:
        """Take the figures of :meth:`saved` for the indices not measured here yet (a list of
        another length, another dataset's, is ignored). Safe while samples run."""
        s = self._s
        if s is None or seconds is None or len(seconds) != len(s):
            return
        # (clipped: a float64 beyond float32's range would be inf here, and the mean nan)
        given = np.clip(np.asarray(seconds, np.float64), 0.0, 1e9).astype(np.float32)
        with self._lock:
            fill = (s == 0) & (given > 0)
            s[fill] = given[fill]
            self._count = int(np.count_nonzero(s))
            self._sum = float(s.sum(dtype=np.float64))

    @staticmethod
    def merge(own: list[float] | None, given: list[float] | None) -> list[float] | None:
        """Figures of :meth:`saved`: ``own`` where it has one, else ``given``'s."""
        if own is None or given is None or len(own) != len(given):
            return given if given is not None else own
        return [o if o > 0 else g for o, g in zip(own, given, strict=True)]

    def estimate(self, index: int) -> float:
        """``index``'s last time, else the mean of the indices measured (seconds; 0 before
        any)."""
        s = self._s
        if s is not None and 0 <= index < len(s):
            v = float(s[index])
            if v > 0:
                return v
        return self._sum / self._count if self._count else 0.0
