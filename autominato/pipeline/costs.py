"""Each dataset index's last service time: what slow-first dispatch orders by.

Uneven samples (KiTS19's CT volumes differ 30x in transform time, 15 ms to 0.85 s) leave the
accelerator idle when a slow sample starts late: the batches after it wait for it, or the
epoch's end does. In completion order the loader may start the samples of its window in any
order, so it starts the one known to be slowest first (``epoch.Epoch.take``: longest
processing time first within the ``pool_size`` window, after the epoch's first batch, which
goes in sampler order so that a cold start's first batch is not held up by the slow ones).
A sample's time is its index's last one (read and transform in the worker, seconds): a
volume's size sets most of it, a random crop or flip the rest. An index not measured yet
counts at the mean of those measured (0 before any), so the first epoch goes in sampler order.

Replayed on the KiTS19 bench's serial sample times at MLPerf size (``--cases 42 --ranks 2``,
6 epochs, 2 workers, a window of 8, the balanced step, a loader with no overhead), the wall
time over max(floor, steps) went from 1.124 (sampler order) to 1.058 (slow first after the
first batch), and the accelerator's idle time from 0.87 to 0.41 s; with steps 0.7-1.3x the
balance, from 1.041-1.087 to 1.023-1.053.
"""

from __future__ import annotations

import numpy as np

from autominato.pipeline.memory import MAX_INDICES


class SampleCosts:
    """The last service time (seconds) of each index of a map-style dataset of ``n`` samples
    (none kept for ``n`` None, 0 or above ``memory.MAX_INDICES``: every estimate is 0 then)."""

    def __init__(self, n: int | None) -> None:
        self._s = np.zeros(n, np.float32) if n and n <= MAX_INDICES else None
        self._sum = 0.0
        self._count = 0

    def learn(self, index: int, seconds: float) -> None:
        """Record ``seconds`` as ``index``'s time (an index out of range is ignored)."""
        s = self._s
        if s is None or not 0 <= index < len(s) or not seconds > 0:
            return
        old = float(s[index])
        if old > 0:
            self._sum -= old
        else:
            self._count += 1
        s[index] = seconds
        self._sum += float(s[index])

    def estimate(self, index: int) -> float:
        """``index``'s last time, else the mean of the indices measured (seconds; 0 before
        any)."""
        s = self._s
        if s is not None and 0 <= index < len(s):
            v = float(s[index])
            if v > 0:
                return v
        return self._sum / self._count if self._count else 0.0
