"""Memory-aware dispatch: a sample whose working set is large does not start beside others.

Uneven samples (CT volumes differ in size 4x or more within KiTS19) make a loader's peak
memory the sum of the largest working sets that happen to run at once. The workers measure
each sample's peak memory (``worker.PeakMeter``: the resident set's high-water mark above its
level when the sample began), and the scheduler keeps the last figure of each dataset index.
A sample is then sent to a worker only if the estimated working sets of the samples in
flight, its own included, fit in the budget

    budget = margin * max(the largest sample's peak, workers * the upper quartile's peak)

or if nothing else is in flight (so every sample starts, however large); the memory the
loader's pools hold (batch buffers and slots with their pages) takes up to
:data:`POOL_SHARE` of the budget's base from that room. The rule is for
outliers: when samples are alike, or large samples are more than a quarter of the dataset, the
budget holds ``workers`` of the large ones and nothing waits (holding them apart would idle
workers on a large part of every epoch: trial 47 measured 1.4x the DataLoader's time with 8
of 20 samples at 300 MB and the median as the typical figure); a sample above the upper
quartile, several times it, runs beside small samples only, so the peak is about what the
largest sample alone, or all workers on the upper quartile, needs. Dispatch stays first in,
first out, except that later samples may overtake the one held back when each fits now *and*
leaves room for it: the held sample's estimate, plus what may still run of the samples it
waited for at the moment it could first have started without the overtakers (all of them if
it fits beside them, else all but the smallest: any part it fits beside is a proper part),
plus the samples that overtook it and still run, plus the newcomer, fit in the budget. So it
starts no later than it would have without them (a large sample that small ones overtook
without that bound would wait for the epoch's end and become its straggler), as long as the
figures, the worker count and the pool's share stay as they were when the overtakers started
and no worker dies with a sample it waited for (a room that shrinks meanwhile, the pool
holding more batches, can make it wait for them
too, as can a replacement worker that is still starting; no new one overtakes it then). Only the
first sample is guaranteed its room: a later one refused (it does not fit now, or would take
the first one's room) keeps its place and the scan goes on behind it, so a small sample
overtakes it too, and it is guaranteed its room once it is first in line (up to
:data:`SCAN_REFUSALS` refused samples are passed in one scan). A scan that stopped
at the second refusal left a worker idle whenever a typical sample stood between the held
outlier and a small one (``autominato.bench.replay`` weighs the two rules).

An index not measured yet is estimated from the size of its file where the dataset names one
(``sample_path(index)``, or MONAI's file names: ``worker.sample_files``) and
:data:`SIZE_FIT_MIN` measured indices have a file too: a line fitted to the measured figures
against their files' sizes (Theil-Sen, robust to the samples whose augmentation doubles
their working set now and then), raised by the height above it of the measured point nearest
in file size, or, where the measured files are alike, in proportion to its size beyond twice
theirs (:meth:`SampleMemory.size_estimate`); else at the median. The sizes are read on a
thread of their own (:class:`SizeReader`). A sample in flight or asking to start
at such an estimate counts in the budget's base as the largest sample does, so that an
outlier known only by its file runs beside small samples, not beside another outlier, in the
epoch that measures them (trial 125: two KiTS19 cases of 735 and 1059 slices among 14 of
32-106 ran together in the first epoch, 3.8-4.3 GiB against the DataLoader's 2.7; a mask's
compressed size and its voxels correlate at r = 0.99 over the 168 KiTS19 masks). Until a
sample has been measured nothing is held back. Samples sent in chunks (under 10 ms each) are
not measured. The figure of an index is its last: a sample whose size changes from one call
to the next (a random zoom) is not predicted.
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

#: Headroom of the budget over ``max(largest, workers * upper quartile)``: samples alike in size vary
#: by their augmentation (a crop's foreground search runs on 40% of KiTS19's samples), and the
#: headroom keeps two typical samples from waiting on each other. 1.35 (1.25 until December
#: 2026): replayed on the KiTS19 bench's measured samples (``scripts/replay_memory.py
#: --cases 8|21 --orders 20 --margins 1.25 1.35 1.45``, 2 workers, the balanced step), the
#: rule's wall time against no rule was 1.112x / 1.076x / 1.006x at 8 cases with the median
#: peak of the working sets running together 530 / 533 / 605 MiB (no rule: 649), and
#: 1.036x / 1.005x / 1.004x at 21 cases with 700 / 712 / 741 MiB (no rule: 870): 1.35 keeps
#: nearly all that 1.25 saved in memory and gives back a third (8 cases) to nearly all (21
#: cases) of the wall time it cost.
MARGIN = 1.35

#: The most of the budget's base, ``max(largest, workers x upper quartile)``, that the
#: memory the loader's pools hold (``SlotPool.resident_bytes``: slots and batch buffers that
#: have their pages: the batches waiting for the training loop, the one it holds, those being
#: filled, idle ones not given back yet; and the private batch buffers of
#: ``collate.BatchPool`` with theirs, not pinned ones, which stay for the loader's life,
#: nor those under ``collate.DECAY_MIN_BYTES``, which never give them back) takes from the
#: samples' room: a sample starts only if the working sets in flight, its own included, plus
#: that memory fit in the budget (or nothing else is in flight). The rest of the headroom,
#: ``MARGIN - POOL_SHARE`` (0.15), stays the samples' alone, so that samples alike (one up to
#: 1.3x the upper quartile beside another at it, with 2 workers) never wait for the pool
#: however much it holds (batch buffers may outweigh the working sets many times). Where
#: samples are large, the batches a loader keeps ahead of a slower training loop were a
#: peak's other part: on the KiTS19 bench at MLPerf's per-rank epoch size (21 samples, 2
#: workers), peaks held 5-7 batch buffers of 20 MiB beside a large sample's working set.
#: Measured there (docs/memory.md, "The pools in the budget"): the median peak 12-80 MiB
#: lower than with the pool not counted in each of 7 paired runs, the wall time from 1.4 %
#: lower to 3.6 % higher; at 42 samples an epoch 58 MiB lower and 2.2 % slower.
POOL_SHARE = 0.2

#: Queued samples refused at which a scan for overtakers stops: each ask costs
#: ``O(workers)`` (the sums over the samples in flight; their estimates are computed once a
#: pump: 16 refusals cost 80-200 us a pump with 8-64 workers, 150-570 us when each ask
#: recomputed them), so a pump with free workers asks at most this many more than it
#: starts. While samples wait, the queue fills to about ``pool_size - running``
#: (``2 * batch + workers + 2`` by default), so the whole queue is scanned for small batches
#: (up to 6 with 2 workers), and its first 16 refused samples beyond.
SCAN_REFUSALS = 16

#: Figures (indices measured) from which workers keep a warm heap, or half the dataset's
#: indices if fewer (:meth:`SampleMemory.heap_keep`): the largest of 256 draws lies above
#: 99.6% of the distribution in expectation.
KEEP_AFTER_FIGURES = 256

#: A sample whose figure is above this many times the upper quartile's runs without a warm
#: heap (``Pipeline._task_heap``, ``worker.HeapTrim.trim_for``): from the heap alone the
#: arrays it frees stay resident below those it still uses, and such an outlier sets the
#: loader's peak. Twice: trial 128's MONAI workload (3 KiTS19 cases of ~5.7 GB, 8 times
#: the upper quartile) peaked at 7.35 GB from the heap against 5.76-6.03 GB run cold, while
#: on the KiTS19 bench at 42 samples an epoch (the largest 2x the upper quartile, an index's
#: heap overhang 28-50 MiB) running the quarter above the upper quartile cold cost 3% of the
#: wall time and 5% of the CPU (page faults) for no lower peak (docs/memory.md, "An outlier
#: runs cold").
COLD_ABOVE = 2.0

#: An index that ran cold runs cold again while its figure is above this many times the
#: upper quartile's: run cold it reads less than it needs warm, and at :data:`COLD_ABOVE`
#: alone it would go warm after each cold run, then need more than its figure (review 130).
COLD_STAYS = 1.5

#: Indices of a map-style dataset whose figures are kept (4 bytes each); a larger dataset
#: keeps none and is never held back.
MAX_INDICES = 1 << 24

#: Indices of a dataset whose figures ``Loader.state_dict()`` carries (a list of ints, JSON-
#: friendly; a larger dataset's state carries none and a resumed run measures them again).
MAX_SAVED = 1 << 16

#: The figure of a sample measured with no rise of its worker's resident set
#: (``worker.PeakMeter.peak``): 1 byte, not 0 (not measured).
NO_RISE = 1

#: Measured indices with a file size from which an index not measured yet is estimated from
#: its file's size (:meth:`SampleMemory.estimate`): a robust line needs a few points, and the
#: first few samples of a run are where an outlier is met unmeasured.
SIZE_FIT_MIN = 4

#: The span of the measured files' sizes (largest / smallest) from which their line is
#: fitted, and beyond which a file without a line is estimated in proportion to its size
#: (:meth:`SampleMemory.size_estimate`).
SIZE_SPAN = 2.0

#: The most measured indices the size line is fitted to (Theil-Sen takes the median of the
#: ``n (n - 1) / 2`` pairwise slopes: 32,640 for 256 points, ~1 ms here); beyond it, evenly
#: spaced ones.
SIZE_FIT_POINTS = 256

#: A file more than this many times the median size of the files read (since the dataset
#: was last replaced, the first :data:`FILE_MEDIAN_SIZES`) is an outlier by file: where an
#: index has no figure and its file no estimate (fewer than :data:`SIZE_FIT_MIN` measured
#: files, or no line through them; before the first figure too), an outlier by file does
#: not start beside another one in flight (:meth:`SampleMemory.file_outlier`,
#: ``Pipeline._admit``). Trial 128: KiTS19's 3 largest masks at full resolution (~5.7 GB
#: working sets) are 12-20 times the median file of its 17; over the 168 KiTS19 masks, 21
#: are above 4 times the median, the 3 largest 5.5-7.8 times.
FILE_OUTLIER = 4.0

#: Sizes read that the median of :data:`FILE_OUTLIER` is taken over at most (the first ones:
#: an epoch's order is a sample of the dataset), so that taking it costs ~50 us.
FILE_MEDIAN_SIZES = 4096

#: Seconds an epoch's first dispatch waits at most for the reader to read the sizes of the
#: first indices of its order (``Pipeline._begin``): workers that are up before the epoch
#: begins ask at once (review 132: a loader built, then a model, then its first epoch), and
#: an unread size is no outlier. A few stat calls on a local disk take microseconds; a
#: stalled mount costs this, once an epoch while those sizes stay unread.
FILE_WAIT_S = 0.05

#: Files whose sizes are read before their median is taken (or the epoch's distinct indices,
#: or the dataset's, where fewer): :data:`FILE_OUTLIER`'s reference.
FILE_MEDIAN_MIN = 8

#: Indices of each epoch's order whose files' sizes are read as the epoch begins (the rest
#: from the first ask for memory of a sample sent alone): the median file size
#: (:data:`FILE_OUTLIER`) is there before the workers ask for the first samples.
FILE_PREREAD = 256

#: Indices of a dataset whose files' sizes are read (4 bytes each; a larger dataset's
#: indices not measured yet count at the median).
SIZE_MAX_INDICES = 1 << 20

#: What a sample that rose nothing counts as when its index has no figure yet: the most heap
#: a worker keeps between two give-backs (``worker.HEAP_SLACK_BYTES``, docs/workers.md), the
#: largest working set that can need no new page.
KEPT_HEAP_BYTES = 16 << 20


def file_bytes(path: str | None) -> int | None:
    """Bytes of the file at ``path``, or of the files directly in it where it is a directory
    (a DICOM series), for :attr:`SampleMemory.size_of`; ``None`` where there is none (no path,
    not found, a URL, a directory without files)."""
    if not path:
        return None
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return st.st_size
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(path) as entries:
                total = sum(e.stat().st_size for e in entries if e.is_file())
            return total or None
    except OSError:
        pass
    return None


class SampleMemory:
    """The last measured peak memory of each index, and the admission rule (module docstring).

    The figures are kept per index (a float32 array) and, for the budget, in a sorted list,
    so that the largest and the median are those of the current figures (an index measured
    again replaces its figure: a first run that paid for a worker's lazy set-up does not set
    the budget for good) at ``O(log k)`` plus a ``k``-pointer move per figure.

    Args:
        n: the dataset's length (``None``: an iterable dataset; nothing is kept).
        margin: the budget's headroom (:data:`MARGIN`).
        pool_share: the most of the budget's base the pool's memory takes (``None``:
            :data:`POOL_SHARE` as it is when the object is made).
    """

    def __init__(self, n: int | None, margin: float = MARGIN,
                 pool_share: float | None = None,
                 size_of: Callable[[int], float | None] | None = None,
                 least_figure: float = 0.0) -> None:
        self.margin = float(margin)
        #: bytes that ``workers`` of, together, always fit in the budget (:meth:`_base`)
        self.least_figure = float(least_figure)
        #: ``index -> bytes of its file`` (``None``: none known), or ``None``: estimates of
        #: indices not measured are the median (see :meth:`estimate`)
        self.size_of = size_of
        self._fit: tuple | None = None  # (stamp, _size_model's)
        self._sizes_gen = 0  # forget_sizes calls: a fit of sizes forgotten is stale
        self._late_sizes = 0  # sizes read for indices measured already (look_up)
        # the first FILE_MEDIAN_SIZES sizes (above 0) read since the last forget_sizes (a
        # new list then: a reader that captured the old one appends there)
        self._read_sizes: list[float] = []
        self._file_median: tuple | None = None  # (sizes read, their list, median), last taken
        self.pool_share_of_base = float(POOL_SHARE if pool_share is None else pool_share)
        self._n = n if n is not None and 0 < n <= MAX_INDICES else 0
        # float32 bytes of each index's files: NaN not read yet, 0 none
        self._sizes: np.ndarray | None = (
            np.full(self._n, np.nan, np.float32)
            if size_of is not None and 0 < self._n <= SIZE_MAX_INDICES else None)
        self._peaks: np.ndarray | None = None  # float32 bytes per index, 0 unknown
        self._sorted: list[float] = []  # the current figures, ascending
        self.held_back = 0  # samples that waited for memory (counted once each)
        self._waited: set = set()  # keys refused that have not started since
        # learn (the scheduler thread) against restore / saved (the training thread)
        self._lock = threading.Lock()
        #: changes whenever a figure does (learn, restore): estimates kept across asks are
        #: stale once it moved
        self.version = 0
        #: distinct indices of the epoch started last (``Epoch.distinct``; 0 before one):
        #: what :meth:`heap_keep` waits for figures of where that is fewer than half the
        #: dataset's
        self.epoch_indices = 0

    @property
    def known(self) -> bool:
        return bool(self._sorted)

    @property
    def largest(self) -> float:
        return self._sorted[-1] if self._sorted else 0.0

    @property
    def median(self) -> float:
        k = len(self._sorted)
        if not k:
            return 0.0
        return self._sorted[k // 2] if k % 2 else 0.5 * (self._sorted[k // 2 - 1] + self._sorted[k // 2])

    def learn(self, index: int, peak_bytes: int) -> None:
        """Record ``index``'s peak (bytes; 0: not measured, ignored), replacing its last.

        :data:`NO_RISE` (a sample that needed no new page: its memory came from the heap the
        worker kept) says the working set was at most that heap: it keeps the index's last
        figure if it has one (a large sample run again where a larger one left its pages is
        still large), else it counts as :data:`KEPT_HEAP_BYTES`. (Left out as unmeasured,
        most small samples of a dataset with a few large ones were, trial 97, and the large
        ones alone then set the upper quartile; as 1 byte, samples alike would set it at
        nothing and hold apart the few measured otherwise, review 98.)

        A negative ``peak_bytes`` is a bound, at most about ``-peak_bytes``: a sample that
        fitted in its worker's warm heap (``worker.PeakMeter.peak``: the heap's free top and
        the rise outside it; the free blocks it also used inside the heap are not in it, so
        it may read a little low). The index keeps its figure if it has one (lowered to such a
        figure, 8 MiB samples alike read 7.1 and were held apart), else takes it, at most the
        median figure: taken whole, a small sample first run in a warm worker read the whole
        warm heap for good, and such figures raised the quantiles, the budget and the keep
        itself (review 118: 8 MiB samples read 64; at the KiTS19 bench's 21 samples an epoch
        half the indices first ran warm); left unmeasured, the large samples alone set the
        upper quartile (trial 97)."""
        if not peak_bytes or not 0 <= index < self._n:
            return
        with self._lock:
            if self._peaks is None:
                self._peaks = np.zeros(self._n, np.float32)
            old = float(self._peaks[index])
            if peak_bytes < 0 or peak_bytes == NO_RISE:
                if old > 0:
                    return
                if peak_bytes == NO_RISE:
                    peak_bytes = KEPT_HEAP_BYTES
                else:
                    peak_bytes = min(-peak_bytes, self.median) if self._sorted else -peak_bytes
            self._peaks[index] = peak_bytes
            new = float(self._peaks[index])  # (as stored: float32)
            if old > 0:
                del self._sorted[bisect.bisect_left(self._sorted, old)]
            bisect.insort(self._sorted, new)
            self.version += 1

    def saved(self) -> list[int] | None:
        """The figures as ``Loader.state_dict()`` keeps them: bytes per index (0 unknown),
        ``None`` when there are none or more than :data:`MAX_SAVED` indices."""
        with self._lock:
            peaks = self._peaks
            if peaks is None or not 0 < self._n <= MAX_SAVED:
                return None
            return peaks.astype(np.int64).tolist()

    def restore(self, figures: list[int] | None) -> None:
        """Take the figures of :meth:`saved` for the indices not measured here yet (a list
        of another length, another dataset's, is ignored). Safe while samples run."""
        if figures is None or len(figures) != self._n or not self._n:
            return
        given = np.asarray(figures, np.float32)
        with self._lock:
            peaks = (np.zeros(self._n, np.float32) if self._peaks is None
                     else self._peaks.copy())
            fill = (peaks == 0) & (given > 0)
            peaks[fill] = given[fill]
            self._sorted = np.sort(peaks[peaks > 0]).astype(float).tolist()
            self._peaks = peaks
            self.version += 1

    @staticmethod
    def merge(own: list[int] | None, given: list[int] | None) -> list[int] | None:
        """Figures of :meth:`saved`: ``own`` where it has one, else ``given``'s."""
        if own is None or given is None or len(own) != len(given):
            return given if given is not None else own
        return [o if o > 0 else g for o, g in zip(own, given, strict=True)]

    def estimate(self, index: int) -> float:
        """``index``'s last peak, else its size estimate (:meth:`size_estimate`), else the
        median (bytes; 0 before any figure)."""
        if self._peaks is not None and 0 <= index < self._n:
            v = float(self._peaks[index])
            if v > 0:
                return v
            if self._sizes is not None:
                v = self.size_estimate(index)
                if v > 0:
                    return v
        return self.median

    def keep_estimate(self, index: int) -> float:
        """What the other workers' warm heaps make room for while ``index`` runs (bytes,
        ``Pipeline._make_room``): its last figure, else at least the largest figure. An
        index not measured may be the outlier: its size estimate or the median can be far
        under it (6 of 38 KiTS19 size estimates under 0.7x, :meth:`size_estimate`), and
        the warm heaps beside it are kept at the upper quartile's figure, not fitted beside
        the largest sample (:meth:`heap_keep`)."""
        if self._peaks is not None and 0 <= index < self._n:
            v = float(self._peaks[index])
            if v > 0:
                return v
        return max(self.estimate(index), self.largest)

    def size(self, index: int) -> float:
        """Bytes of ``index``'s files as :meth:`look_up` read them; 0 when there are none or
        they were not read yet (the scheduler never waits for a file system: a
        :class:`SizeReader` reads them on a thread of its own)."""
        sizes = self._sizes
        if sizes is None or not 0 <= index < self._n:
            return 0.0
        v = float(sizes[index])
        return v if v > 0 else 0.0

    def look_up(self, index: int) -> None:
        """Read ``index``'s size with ``size_of`` unless read already (a :class:`SizeReader`'s
        thread); a read that raises counts as no file."""
        sizes, gen, read = self._sizes, self._sizes_gen, self._read_sizes
        if sizes is None or not 0 <= index < self._n or not np.isnan(sizes[index]):
            return
        try:
            got = self.size_of(index)
        except Exception:  # (the dataset's own code: an estimate is not worth an error)
            got = None
        if gen == self._sizes_gen:  # (not a size of a dataset replaced meanwhile)
            sizes[index] = got if got is not None and got > 0 else 0.0
            if sizes[index] > 0 and len(read) < FILE_MEDIAN_SIZES:
                read.append(float(sizes[index]))
            peaks = self._peaks
            if sizes[index] > 0 and peaks is not None and peaks[index] > 0:
                self._late_sizes += 1  # (a point for the line: as a new figure)

    def forget_sizes(self) -> None:
        """Read the files' sizes again (the dataset was replaced)."""
        if self._sizes is not None:
            self._sizes_gen += 1
            self._sizes = np.full(self._n, np.nan, np.float32)
            self._read_sizes = []

    def file_outlier(self, index: int) -> bool:
        """Whether ``index`` is an outlier by file: no figure of its own, no estimate from
        its files' size (:meth:`size_estimate`: fewer than :data:`SIZE_FIT_MIN` measured
        files, or no line and no figure per byte through them: review 132, small working
        sets alike over files spanning 2x or more), and its files more than
        :data:`FILE_OUTLIER` times the median size of the files read (at least
        :data:`FILE_MEDIAN_MIN` of them, or the epoch's distinct indices where fewer).
        ``Pipeline._admit`` does not start one beside another in flight. False where its
        size is not read yet or there is none."""
        size = self.size(index)
        if not size:
            return False
        peaks = self._peaks
        if peaks is not None and peaks[index] > 0:
            return False  # (its figure counts)
        if self.size_estimate(index) > 0:
            return False
        median = self._median_file_size()
        return bool(median) and size > FILE_OUTLIER * median

    def _median_file_size(self) -> float:
        """The median size of the first :data:`FILE_MEDIAN_SIZES` files read since the
        dataset was last replaced (bytes), taken again once an eighth more were read; 0
        while fewer than :data:`FILE_MEDIAN_MIN` (or the epoch's indices) were read."""
        read, got = self._read_sizes, self._file_median
        count = len(read)
        if got is not None and got[1] is read and count < got[0] + max(1, got[0] // 8):
            return got[2]
        if count < min(FILE_MEDIAN_MIN, self.epoch_indices or self._n):
            return 0.0
        median = float(np.median(read[:count]))  # (~50 us for 4096; the reader appends)
        self._file_median = (count, read, median)
        return median

    def size_fit(self) -> tuple[float, float] | None:
        """``(intercept bytes, bytes per byte of file)`` of the Theil-Sen line (Sen 1968:
        the median of the pairwise slopes; the intercept the median of ``figure - slope x
        size``) through the measured figures against their files' sizes, at most
        :data:`SIZE_FIT_POINTS` of them; ``None`` with fewer than :data:`SIZE_FIT_MIN`
        points, sizes that span less than :data:`SIZE_SPAN` (the slope between files alike
        is noise: trial 128, MONAI's padding of short volumes made the small samples' working
        sets alike, and the slope came out below 0), or a slope not above 0 (sizes that say
        nothing of the working set over the span measured: a fixed crop read from files of
        many sizes). Refitted once an eighth of the measured indices' figures changed (one at
        a time while fewer than 16 are)."""
        model = self._size_model()
        return None if model is None or np.isnan(model[1]) else (model[0], model[1])

    def _size_model(self) -> tuple | None:
        """``(intercept, slope, bytes per byte of file, the largest measured file's size,
        (log sizes ascending, heights above the line) or None)``: the line of
        :meth:`size_fit` (NaN where there is none), the median of the measured figures per
        byte of file, the largest file measured, and each measured point's height above the
        line (0 below it); ``None`` without a point."""
        sizes, peaks = self._sizes, self._peaks
        if peaks is None or sizes is None:
            return None
        # (read first: a fit is never newer than its figures; sizes of measured indices
        # read after them, once a dataset was replaced, count as new figures)
        version = self.version + self._late_sizes
        fit = self._fit
        if fit is not None:
            (at, gen, measured_then), model = fit
            # (~1 ms for 256 points, against the scheduler's few us a sample)
            if gen == self._sizes_gen and version - at < max(1, measured_then // 8):
                return model
        measured = np.flatnonzero(peaks > 0)
        x = sizes[measured].astype(np.float64)
        sized = x > 0  # (NaN, not read yet, and 0, no file, are left out)
        x, y = x[sized], peaks[measured[sized]].astype(np.float64)
        if len(x) > SIZE_FIT_POINTS:
            pick = np.linspace(0, len(x) - 1, SIZE_FIT_POINTS).astype(int)
            x, y = x[pick], y[pick]
        model = None
        if len(x):
            line = (np.nan, np.nan)
            above = None
            if len(x) >= SIZE_FIT_MIN and x.max() >= SIZE_SPAN * x.min():
                i, j = np.triu_indices(len(x), 1)
                dx = x[j] - x[i]
                apart = dx != 0
                slope = float(np.median((y[j] - y[i])[apart] / dx[apart]))
                if slope > 0:
                    line = (float(np.median(y - slope * x)), slope)
                    order = np.argsort(x, kind="stable")
                    # (each measured point's height above the line, by its file's log size)
                    above = (np.log(x[order]),
                             np.maximum(0.0, y[order] - (line[0] + slope * x[order])))
            # (without a line because the files are alike, not because their sizes said
            # nothing over a span: the largest file's figure per byte, the lowest where part
            # of the working set does not grow with the file, for files beyond them)
            top = int(np.lexsort((y, x))[-1])
            per_byte = (float(y[top] / x[top])
                        if len(x) >= SIZE_FIT_MIN and x.max() < SIZE_SPAN * x.min() else np.nan)
            model = (*line, per_byte, float(x.max()), above)
        self._fit = ((version, self._sizes_gen, len(measured)), model)
        return model

    def size_estimate(self, index: int) -> float:
        """``index``'s working set from its files' size, bytes: on :meth:`size_fit`'s line
        raised by the height above it of the measured point whose file is nearest in size
        (log scale; the higher of two as near), at least the smallest figure. A line through
        many small samples and a few large ones follows the small ones (trial 128: KiTS19
        masks of 2.0-2.5 MB read 2.4-2.9 GB on it beside a measured one of 2.9 MB and ~6 GB,
        and two ran together); the nearest point carries what the line misses there (on the
        KiTS19 bench's first-seen indices, 26 of 38 estimates within 25% of the figure then
        read, against 24 on the line alone, and 6 below 0.7x against 10); without a line
        because :data:`SIZE_FIT_MIN` or more measured files span less than
        :data:`SIZE_SPAN`, for files more than :data:`SIZE_SPAN` times the largest measured,
        the largest measured file's figure per byte times their size (the lowest per byte
        where part of the working set does not grow with the file: review 129 saw the
        median's of one point read typical files 3x; an outlier beyond what was measured is
        taken to need what its size says: KiTS19's two largest masks are 14x the compressed
        size of the 14 smallest); else 0 (no size read, no figure: the median counts)."""
        model = self._size_model()
        if model is None:
            return 0.0
        size = self.size(index)
        if not size:
            return 0.0
        a, b, per_byte, top_size, above = model
        if not np.isnan(b):
            logs, heights = above
            log_size = np.log(size)
            at = int(np.searchsorted(logs, log_size))
            gaps = {k: abs(logs[k] - log_size) for k in (at - 1, at) if 0 <= k < len(logs)}
            gap = min(gaps.values())
            lift = max(heights[k] for k, g in gaps.items() if g == gap)
            return max(a + b * size + lift, self._sorted[0] if self._sorted else 0.0)
        if size > SIZE_SPAN * top_size and not np.isnan(per_byte):
            return per_byte * size
        return 0.0

    @property
    def upper_quartile(self) -> float:
        """The 75th percentile of the figures (nearest rank: the ``ceil(0.75 k)``-th)."""
        k = len(self._sorted)
        return self._sorted[max(0, -(-3 * k // 4) - 1)] if k else 0.0

    def _base(self, workers: int, largest: float = 0.0) -> float:
        """``max(largest, workers x upper quartile)``, bytes: what the budget's headroom and
        the pool's share are fractions of; ``largest`` a larger estimate than the largest
        figure, of a sample in flight or asking (a size estimate, :meth:`admit`). At least
        ``workers x`` :attr:`least_figure` (the pipeline's: :data:`KEPT_HEAP_BYTES`) once
        there is a figure: ``workers`` samples
        that needed no new page (each counted at that bound until measured) fit together,
        else samples of a few MiB alike were held apart by their bounds (two at 16 MiB
        beside two measured at 8 in a budget of 43 MiB, under load: a flaky test)."""
        base = max(self.largest, largest, max(1, workers) * self.upper_quartile)
        return max(base, max(1, workers) * self.least_figure) if base > 0 else base

    def budget(self, workers: int, largest: float = 0.0) -> float:
        """Bytes of working sets that may be in flight together (0: no figure yet)."""
        return self.margin * self._base(workers, largest)

    def pool_share(self, workers: int, pool_bytes: float, largest: float = 0.0) -> float:
        """The part of the budget that the loader's pools take, bytes: ``pool_bytes``
        (their slots and batch buffers that have their pages), at most ``pool_share x
        max(largest, workers x upper quartile)`` (:data:`POOL_SHARE`)."""
        if pool_bytes <= 0:
            return 0.0
        return min(float(pool_bytes), self.pool_share_of_base * self._base(workers, largest))

    def heap_keep(self, workers: int) -> float:
        """Bytes of free heap each of ``workers`` process workers may keep warm between
        samples (``worker.HeapTrim.set_keep``): what the room leaves beside a sample at the
        upper quartile's figure when the pool takes its whole share, ``(MARGIN - POOL_SHARE) x
        max(largest, workers x upper quartile) - upper quartile``, split over the other
        ``workers - 1``, at most the upper quartile's figure (all of the room, at most the
        largest figure, with one worker: no sample needs more). With the default headroom
        that is the upper quartile's figure (the room, at least ``1.15 x workers x`` it,
        holds ``workers`` such); a smaller ``margin`` can make it less. A warm heap above the upper
        quartile serves only the quarter of the samples above it and sits beside them while
        they run (trial 128: 1.08 GB a worker beside a 5.7 GB KiTS19 case with 14 small
        ones of ~265 MiB, the process tree 7.3-8.0 GB against the DataLoader's 5.8; with one
        worker nothing runs beside it).

        Three samples in four then run beside the other workers' warm heaps; a larger one
        that does not fit beside them takes their room while it runs
        (:meth:`keep_beside`, ``Pipeline._update_heap_keep``: idle workers give theirs back
        at once, busy ones after their sample, which admission counts at the warm heap). Until
        December 2026 the keep fitted beside the largest sample instead: with an outlier
        twice the upper quartile (the KiTS19 bench's 42 cases: largest 480-500 MiB, upper
        quartile 220-240) that kept 70-75 MiB for every sample, and most of each sample's
        arrays were faulted in anew (docs/memory.md, "The warm heap": 20% fewer bytes
        faulted in with the upper quartile's keep, the peak the same). When samples are
        alike the warm heap holds a whole sample (``workers`` of them fit in the budget).
        0 until half the indices, or :data:`KEEP_AFTER_FIGURES`, have figures: sized
        against a largest sample not measured yet, whole-sample warm heaps sat beside it
        (review 117: 838 MiB of working sets in a budget of 678 in the first epoch; 126-250
        MiB per worker in the KiTS19 bench's first epochs at 21 samples an epoch); or an
        epoch's indices (:attr:`epoch_indices`) where that is fewer: a rank's fixed shard, or
        a sampler of a subset, never measures half the dataset (review 118: 4 ranks, no keep
        ever)."""
        if len(self._sorted) < max(1, min(self._n // 2, KEEP_AFTER_FIGURES,
                                          self.epoch_indices or self._n)):
            return 0.0
        if workers <= 1:
            return max(0.0, min(self.largest,
                                (self.margin - self.pool_share_of_base) * self._base(workers)))
        quartile = self.upper_quartile
        return max(0.0, min(quartile, self.keep_beside(workers, quartile)))

    def keep_beside(self, workers: int, estimate: float) -> float:
        """The warm heap each of the other ``workers - 1`` workers may keep beside a sample
        of ``estimate`` bytes in flight (infinite with one worker: none runs beside it), so
        that the sample and their warm heaps fit in the room the budget leaves when the pool
        takes its whole share: ``((MARGIN - POOL_SHARE) x max(largest, estimate, workers x
        upper quartile) - estimate) / (workers - 1)``, at least 0."""
        if workers <= 1:
            return float("inf")
        room = (self.margin - self.pool_share_of_base) * self._base(workers, estimate)
        return max(0.0, (room - estimate) / (workers - 1))

    def room(self, workers: int, pool_bytes: float = 0.0, largest: float = 0.0) -> float:
        """Bytes of working sets that may be in flight beside ``pool_bytes`` of the pool:
        :meth:`budget` less :meth:`pool_share` (``largest``: see :meth:`_base`)."""
        return (self.budget(workers, largest)
                - self.pool_share(workers, pool_bytes, largest))

    def admit(self, index: int, in_flight: list[float], workers: int, key: object = None,
              ahead: tuple[float, ...] | None = None, pool_bytes: float = 0.0,
              largest: float = 0.0) -> bool:
        """Whether sample ``index`` may start beside samples whose estimates are ``in_flight``
        (bytes, see :meth:`estimate`) beside ``pool_bytes`` of the loader's pools (bytes
        with their pages, ``Pipeline._budgeted_pool_bytes``; they take up to
        :data:`POOL_SHARE` of the budget's base, see :meth:`room`).

        Args:
            key: the sample's task key: a wait is counted once per key (``held_back``),
                first in line or refused as an overtaker.
            ahead: ``None`` for the first sample in line; for a later one, which would
                overtake the first (held back), ``(bytes the held sample needs free: its
                estimate plus what may still run of the samples it waited for when it could
                first start; the sum of the estimates of the samples in flight that overtook
                it; the largest estimate of the held sample and those it will start beside,
                those it waits for still counted and those that overtook it, or left out:
                the largest in flight)``: the newcomer may start only if it fits now and
                leaves that room (module docstring), in the budget the held sample will see
                when it asks (its estimate counts in the base as the largest sample's may,
                review 127; a sample it no longer waits for does not, review 129).
            largest: the largest estimate among the samples in flight (their own, not the
                warm heaps ``in_flight`` may count them at): with the newcomer's, a size
                estimate above the largest figure counts in the budget's base (:meth:`_base`).
        """
        if not in_flight or not self.known:
            ok = True
        else:
            est = self.estimate(index)
            top = max(est, largest)
            room = self.room(workers, pool_bytes, top)
            ok = est + sum(in_flight) <= room
            if ahead is not None and ok:
                beside = max(est, ahead[2]) if len(ahead) > 2 else top
                room = self.room(workers, pool_bytes, beside)
                ok = ahead[0] + ahead[1] + est <= room
        if ok:
            self.started(key)
            return True
        self.refused(key)
        return False

    def started(self, key: object) -> None:
        """The sample of task ``key`` starts (:meth:`admit`'s or the caller's own rule)."""
        if self._waited:
            self._waited.discard(key)

    def refused(self, key: object) -> None:
        """The sample of task ``key`` waits for memory: counted in :attr:`held_back` once a
        key until it starts."""
        waited = self._waited
        if key is not None and key not in waited:
            if len(waited) >= 4096:  # (keys of discarded epochs never start: a bound)
                waited.clear()
            waited.add(key)
            self.held_back += 1


class SizeReader:
    """Reads the files' sizes of the indices an epoch is about to run
    (:meth:`SampleMemory.look_up`) on a daemon thread of its own, in the epoch's order, so
    that the scheduler never calls the dataset's ``sample_path`` or waits on a file system (a
    stalled network mount would otherwise stall the loader; review 127): an index whose size
    is not read yet counts at the median. One ``os.stat`` (a few us on a local disk) per file,
    once per index, until the dataset is replaced."""

    def __init__(self, memory: SampleMemory) -> None:
        self.memory = memory
        # (an epoch's first indices and its order, the next one's, prefetched)
        self._todo: deque = deque(maxlen=4)
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def want(self, indices) -> None:
        """Read the sizes of ``indices`` (an epoch's order) after those asked for before."""
        if self.memory._sizes is None:
            return
        with self._cv:
            if self._closed:
                return
            self._todo.append(indices)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="autominato-file-sizes",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def wait(self, indices, timeout: float) -> None:
        """Wait until the sizes of ``indices`` were read (or read as none), ``timeout``
        seconds at most (a stalled mount: they then count as unread)."""
        sizes = self.memory._sizes
        if sizes is None or self._closed:
            return
        want = np.asarray(indices, dtype=np.int64)
        want = want[(want >= 0) & (want < len(sizes))]
        deadline = time.monotonic() + timeout
        while np.isnan(sizes[want]).any() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._todo and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                indices = self._todo.popleft()
            for i in indices:
                if self._closed:
                    return
                self.memory.look_up(int(i))

    def close(self) -> None:
        """Stop after the index being read (the thread is a daemon: a read that hangs does
        not hold the interpreter's exit)."""
        with self._cv:
            self._closed = True
            self._todo.clear()
            self._cv.notify()
