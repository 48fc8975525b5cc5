"""Benchmark workloads: the same dataset, transform and consumer step for every arm.

A :class:`Workload` is what every arm is given: a map-style dataset (the read stage), a
``transform(sample, rng)`` (the transform stage), a batch size and the simulated accelerator
step time. Arms differ only in how they schedule that work, so the comparison is fair: the
per-sample work is byte-for-byte the same function in every arm, seeded the same way, with the
same collate (torch's ``default_collate``).

Samples are wrapped as ``(index, sample)`` (:class:`IndexedDataset`, :class:`IndexedTransform`)
so that the consumer can count every delivered sample and prove that none was lost or
duplicated, whatever order an arm delivers them in.

The synthetic workload's cost is CPU-seconds, not loop iterations: :func:`burn_cpu` runs small
NumPy kernels (which release the GIL) until the calling thread's CPU clock has advanced by the
sample's cost, so a sample costs the same CPU time on every arm, whether it runs in a process
or a thread, and the serial sum of the costs is the work the cores must do.
"""

from __future__ import annotations

import heapq
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

#: The distributions of per-sample transform cost that the synthetic workload offers.
COST_DISTRIBUTIONS = ("constant", "lognormal", "bimodal")

Transform = Callable[[Any, np.random.Generator], Any]


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The augmentation generator of sample ``index`` in ``epoch`` (NumPy ``SeedSequence``).

    Seeded by ``(seed, epoch, index)`` as DESIGN.md asks, so a sample's augmentation does not
    depend on which worker of which arm ran it.
    """
    return np.random.default_rng((seed, epoch, index))


def burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (``time.thread_time``) in NumPy kernels.

    Each kernel is a square root over a 256 Ki float64 scratch array (about 0.4 ms); NumPy
    releases the GIL inside it, so threads of one process burn in parallel as real array code
    does. Sleeping or being descheduled does not count: the cost is CPU-seconds, not wall time.
    """
    if seconds <= 0:
        return
    # Smaller kernels let the GIL hand-off dominate: with 32 Ki elements two threads took
    # 1.5x as long as two processes on a 2-core machine; with 256 Ki they matched.
    scratch = np.full(256 * 1024, 2.0)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        np.sqrt(scratch, out=scratch)
        scratch += 1.0  # keeps the values away from 1.0 so the kernel never degenerates


def draw_costs(
    n: int,
    dist: str,
    mean_s: float,
    *,
    sigma: float = 0.5,
    straggler_fraction: float = 0.05,
    straggler_factor: float = 10.0,
    double_at: float | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Per-sample transform costs in CPU-seconds, shape ``(n,)``, float64.

    Args:
        n: number of samples.
        dist: ``constant`` (every sample ``mean_s``); ``lognormal`` (mean ``mean_s``, log-space
            standard deviation ``sigma``: ``mu = ln(mean_s) - sigma^2 / 2``); ``bimodal``
            (``straggler_fraction`` of the samples, drawn at random, cost
            ``straggler_factor * mean_s``, the rest ``mean_s``).
        mean_s: the base cost, seconds.
        double_at: if given, samples with index ``>= double_at * n`` cost twice as much (the
            "cost doubles half-way" scenario; benchmark samplers are sequential, so index order
            is dispatch order).
        seed: seed of the draw (the costs are a property of the dataset, fixed per seed).

    Raises:
        ValueError: unknown ``dist`` or a negative parameter.
    """
    if dist not in COST_DISTRIBUTIONS:
        raise ValueError(
            f"cost distribution {dist!r}: expected one of {', '.join(COST_DISTRIBUTIONS)}"
        )
    if mean_s < 0 or sigma < 0 or not 0 <= straggler_fraction <= 1 or straggler_factor < 0:
        raise ValueError(
            f"cost parameters must be non-negative (mean_s={mean_s}, sigma={sigma}, "
            f"straggler_fraction={straggler_fraction}, straggler_factor={straggler_factor})"
        )
    rng = np.random.default_rng(seed)
    if dist == "constant":
        costs = np.full(n, float(mean_s))
    elif dist == "lognormal":
        mu = math.log(mean_s) - sigma**2 / 2 if mean_s > 0 else -math.inf
        costs = rng.lognormal(mu, sigma, n) if mean_s > 0 else np.zeros(n)
    else:
        costs = np.full(n, float(mean_s))
        k = int(round(straggler_fraction * n))
        costs[rng.choice(n, size=k, replace=False)] *= straggler_factor
    if double_at is not None:
        costs[int(double_at * n) :] *= 2.0
    return costs


class SyntheticDataset:
    """``n`` float32 samples of ``sample_mb`` MB each, read after ``read_latency_s`` seconds.

    ``dataset[i]`` returns ``{"image": float32 (1, L) array, "cost_s": float}`` where
    ``L = sample_mb * 2**20 / 4`` and ``cost_s`` is sample ``i``'s transform cost. The read
    sleeps ``read_latency_s`` (storage latency, no CPU) and then materialises the array: from an
    ``.npy`` file under ``root`` when the dataset is on disk, else by filling a fresh array.

    Raises:
        IndexError: ``i`` is outside ``[0, n)``.
        FileNotFoundError: the sample's file is missing (the message names index and path).
    """

    def __init__(
        self,
        costs: np.ndarray,
        sample_mb: float,
        read_latency_s: float = 0.0,
        root: str | Path | None = None,
    ) -> None:
        self.costs = np.asarray(costs, dtype=np.float64)
        self.sample_mb = float(sample_mb)
        self.length = max(1, int(sample_mb * 2**20 / 4))
        self.read_latency_s = float(read_latency_s)
        self.root = Path(root) if root is not None else None

    def __len__(self) -> int:
        return len(self.costs)

    def sample_path(self, index: int) -> str | None:
        return str(self.root / f"sample_{index:06d}.npy") if self.root is not None else None

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.costs):
            raise IndexError(f"sample index {index} out of range [0, {len(self.costs)})")
        if self.read_latency_s > 0:
            time.sleep(self.read_latency_s)
        path = self.sample_path(index)
        if path is None:
            image = np.full((1, self.length), index % 251, dtype=np.float32)
        else:
            try:
                image = np.load(path)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"sample {index}: file {path} is missing") from e
        return {"image": image, "cost_s": float(self.costs[index])}

    def write(self, root: str | Path) -> SyntheticDataset:
        """Write every sample to ``root`` as ``.npy`` and return the on-disk dataset."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        on_disk = SyntheticDataset(self.costs, self.sample_mb, self.read_latency_s, root)
        for i in range(len(self)):
            np.save(on_disk.sample_path(i), np.full((1, self.length), i % 251, dtype=np.float32))
        return on_disk


def synthetic_transform(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Burn the sample's ``cost_s`` CPU-seconds, then scale the image by a random factor.

    Input ``{"image": float32 array, "cost_s": float}``; output ``{"image": float32 array}``
    (same shape; the scaling touches every byte once, as an intensity augmentation would).
    """
    burn_cpu(sample["cost_s"])
    image = sample["image"]
    image *= np.float32(rng.uniform(0.9, 1.1))
    return {"image": image}


class IndexedDataset:
    """``dataset[i] -> (i, inner[i])``; forwards ``sample_path`` so errors name the file."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.inner[index]

    def sample_path(self, index: int) -> str | None:
        fn = getattr(self.inner, "sample_path", None)
        return fn(index) if fn is not None else None


class IndexedTransform:
    """``(i, sample), rng -> (i, inner(sample, rng))``: keeps the index beside the sample."""

    def __init__(self, inner: Transform) -> None:
        self.inner = inner

    def __call__(self, item: tuple[int, Any], rng: np.random.Generator) -> tuple[int, Any]:
        index, sample = item
        return index, self.inner(sample, rng)


class SampleFn:
    """Read and transform sample ``i`` in one call, as the peers' workers run it.

    ``SampleFn(workload)(i)`` is ``transform(dataset[i], sample_rng(seed, epoch, i))`` on the
    indexed dataset and transform; ``SampleFn(workload)((e, i))`` does epoch ``e``'s work on
    sample ``i`` (what :class:`EpochIndices` yields), so that a peer's every epoch draws that
    epoch's augmentation, as autominato's own epoch counter does. Also usable as a map-style
    dataset (``len``, ``[i]``, ``[(e, i)]``).
    """

    def __init__(self, workload: Workload, epoch: int = 0) -> None:
        self.dataset = workload.indexed_dataset()
        self.transform = workload.indexed_transform()
        self.seed = workload.seed
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, index: int | tuple[int, int]) -> tuple[int, Any]:
        epoch = self.epoch
        if isinstance(index, tuple):
            epoch, index = index
        return self.transform(self.dataset[index], sample_rng(self.seed, epoch, index))

    __getitem__ = __call__


class EpochIndices:
    """A sampler of ``(epoch, index)`` pairs whose epoch counts its passes.

    Pass ``k`` (the ``k``-th ``iter``, from 0, unless ``set_epoch`` named the next one, as
    ``torchdata.nodes.SamplerWrapper`` does) yields ``(k, i)`` for ``i`` in
    :func:`~autominato.pipeline.sampler.epoch_order` ``(n, epoch=k, seed=seed, shuffle=shuffle)``:
    ``0 .. n - 1``, or with ``shuffle`` the permutation that
    ``autominato.Loader(shuffle=True, seed=seed)`` draws for epoch ``k`` (``DistributedSampler``'s
    rule: ``torch.randperm`` seeded with ``seed + k``). It
    runs in the training process (a DataLoader's sampler does, with persistent workers too),
    so the peers' workers receive the epoch with each index and every epoch's augmentation is
    the one autominato draws for it: the arms do the same work, epoch by epoch.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = False,
                 world_size: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.world_size = world_size
        self.next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.next_epoch = int(epoch)

    def __len__(self) -> int:
        return -(-self.n // self.world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        e = self.next_epoch
        self.next_epoch = e + 1
        from autominato.pipeline.sampler import epoch_order

        order = epoch_order(self.n, epoch=e, seed=self.seed, shuffle=self.shuffle,
                            rank=0, world_size=self.world_size)
        return ((e, int(i)) for i in order)


#: What :meth:`Workload.shard` appends to a workload's name, before the rank count.
RANK_SUFFIX = "-rank0of"


@dataclass
class Workload:
    """Everything an arm needs to run one epoch of the benchmark.

    Attributes:
        name: short name used in tables and file names (``synthetic-balanced_stragglers``).
        dataset: map-style dataset (``len`` and ``[i]``), picklable; the read stage.
        transform: ``transform(sample, rng) -> sample``, picklable; the transform stage.
        batch_size: samples per batch.
        step_s: simulated accelerator step time per batch, seconds (``None`` until calibrated).
        seed: augmentation seed (see :func:`sample_rng`).
        description: one line for reports (sizes, costs, step).
        step_basis: what the simulated step is calibrated to (:func:`calibrate_step`):
            ``floor`` (the first floor measured, per batch: the cores' output in parallel, as
            the loaders meet it), ``cpu`` (serial CPU-seconds per batch / cores) or ``wall``
            (serial wall seconds per batch / cores, read latency included; for I/O-bound
            scenarios).
        step_factor: multiplies the calibrated step.
        cleanup: folders to delete when the benchmark ends (on-disk synthetic samples).
        shuffle: every arm takes each epoch's samples in the same random order
            (the Loader's, :func:`~autominato.pipeline.sampler.epoch_order`) instead of
            ``0 .. n - 1``. With a fixed order, an in-order DataLoader gives each worker the
            same samples every epoch, so its workers' memory peaks (and costs) differ by
            which samples they always get.
        world_size: ranks that split each epoch; the workload is rank 0's share
            (:meth:`shard`): ``DistributedSampler(num_replicas=world_size, rank=0,
            shuffle=shuffle, seed=seed)``'s indices of each epoch.
    """

    name: str
    dataset: Any
    transform: Transform
    batch_size: int
    step_s: float | None = None
    seed: int = 0
    description: str = ""
    step_basis: str = "cpu"
    step_factor: float = 1.0
    cleanup: list[str] = field(default_factory=list)
    shuffle: bool = False
    world_size: int = 1

    def __len__(self) -> int:
        """Samples in one epoch: the dataset's, or rank 0's share of them."""
        return -(-len(self.dataset) // self.world_size)

    @property
    def n_batches(self) -> int:
        """Batches in one epoch (the last one may be partial: ``drop_last=False``)."""
        return -(-len(self) // self.batch_size)

    def epoch_indices(self, epoch: int) -> list[int]:
        """Dataset indices of ``epoch`` in the order every arm takes them: ``0 .. n - 1``,
        the shuffle of ``Loader(shuffle=True, seed=seed)``, and with ``world_size > 1``
        rank 0's share as ``DistributedSampler`` draws it."""
        from autominato.pipeline.sampler import epoch_order

        return [int(i) for i in epoch_order(len(self.dataset), epoch=epoch, seed=self.seed,
                                            shuffle=self.shuffle, rank=0,
                                            world_size=self.world_size)]

    def epoch_sampler(self) -> EpochIndices:
        """The peers' sampler: ``(epoch, index)`` pairs of :meth:`epoch_indices`, epoch by
        epoch (:class:`EpochIndices`)."""
        return EpochIndices(len(self.dataset), self.seed, self.shuffle, self.world_size)

    def indexed_dataset(self) -> IndexedDataset:
        return IndexedDataset(self.dataset)

    def indexed_transform(self) -> IndexedTransform:
        return IndexedTransform(self.transform)

    def subset(self, n: int) -> Workload:
        """The same workload on the first ``n`` samples of its epoch 0 (for short probe runs),
        as one rank."""
        keep = self.epoch_indices(0)[:n] if self.world_size > 1 else range(min(n, len(self)))
        return replace(self, name=self.name, dataset=_Subset(self.dataset, keep), cleanup=[],
                       world_size=1)

    def shard(self, ranks: int) -> Workload:
        """Rank 0's share of each epoch when ``ranks`` processes split it, as
        ``DistributedSampler(num_replicas=ranks, rank=0, seed=seed)`` draws it: with
        ``shuffle`` another ``ceil(len / ranks)`` of the samples each epoch (a permutation
        of all of them seeded with ``seed + epoch``, every ``ranks``-th), else samples
        ``0, ranks, 2 * ranks, ...``; MLPerf 3D-UNet's 168 cases over 8 GPUs give 21 per epoch.

        Raises:
            ValueError: ``ranks`` is not in ``[1, len(workload)]``.
        """
        if not 1 <= ranks <= len(self.dataset):
            raise ValueError(f"ranks must be in [1, {len(self.dataset)}] (the samples of an "
                             f"epoch), got {ranks}")
        if ranks == 1:
            return self
        n = -(-len(self.dataset) // ranks)
        return replace(self, name=f"{self.name}{RANK_SUFFIX}{ranks}", world_size=ranks,
                       description=f"{self.description}; rank 0 of {ranks}: {n} samples "
                       "per epoch")

    def remove_files(self) -> None:
        for folder in self.cleanup:
            shutil.rmtree(folder, ignore_errors=True)


class _Subset:
    """``inner`` seen through ``keep``: sample ``i`` is ``inner[keep[i]]``."""

    def __init__(self, inner: Any, keep: range) -> None:
        self.inner = inner
        self.keep = keep

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self.keep):
            raise IndexError(f"sample index {index} out of range [0, {len(self.keep)})")
        return self.inner[self.keep[index]]

    def sample_path(self, index: int) -> str | None:
        fn = getattr(self.inner, "sample_path", None)
        return fn(self.keep[index]) if fn is not None else None


@dataclass(frozen=True)
class SerialCost:
    """The work of the run's epochs measured serially in one thread (the limit's numerator).

    Attributes:
        cpu_s: per-sample CPU-seconds of read + transform (``time.process_time``), shape (k,).
        wall_s: per-sample wall seconds of read + transform, shape (k,).
        n_samples: samples in the run's epochs; when more than the ``k`` measured (a subset was
            measured to save time), totals are the measured mean times ``n_samples``.
    """

    cpu_s: np.ndarray
    wall_s: np.ndarray
    n_samples: int = 0

    @property
    def _n(self) -> int:
        return self.n_samples or len(self.cpu_s)

    @property
    def cpu_total_s(self) -> float:
        return float(self.cpu_s.mean() * self._n) if len(self.cpu_s) else 0.0

    @property
    def wall_total_s(self) -> float:
        return float(self.wall_s.mean() * self._n) if len(self.wall_s) else 0.0

    @property
    def estimated(self) -> bool:
        """True when only a subset was measured and the totals are extrapolated."""
        return self._n > len(self.cpu_s)


def measure_serial(workload: Workload, warmup: int = 1, samples: int | None = None,
                   epochs: int = 1) -> SerialCost:
    """Run read + transform of every sample of ``epochs`` epochs once, serially, in this
    process (epoch ``e``'s augmentation for its samples: the cost of a sample depends on its
    random draws, a crop or a resize, so every epoch is measured); time each.

    ``warmup`` samples are run first and not counted, so first-call costs (imports, page
    faults of fresh buffers) do not inflate the limit. ``samples`` measures only that many
    ``(epoch, index)`` pairs, spread evenly over the epochs (the totals are then
    extrapolated, see :class:`SerialCost`).
    """
    fn = SampleFn(workload)
    for i in range(min(warmup, len(fn))):
        fn(i)
    tasks = [(e, i) for e in range(max(1, epochs)) for i in workload.epoch_indices(e)]
    n_samples = len(tasks)
    if samples is not None and samples < len(tasks):
        k = max(1, samples)
        tasks = [tasks[j * len(tasks) // k] for j in range(k)]
    cpu, wall = np.zeros(len(tasks)), np.zeros(len(tasks))
    for j, task in enumerate(tasks):
        c0, w0 = time.process_time(), time.perf_counter()
        fn(task)
        cpu[j] = time.process_time() - c0
        wall[j] = time.perf_counter() - w0
    return SerialCost(cpu, wall, n_samples)


_floor_fn: Any = None
_floor_error: BaseException | None = None  # what the warm-up sample raised (_floor_init)

#: Seconds a floor process waits at start-up for the others to be ready (each has imported
#: the work and run one sample), after which it gives up and the floor raises.
_FLOOR_START_S = 600.0


def _floor_init(payload: bytes, threads: int, barrier: Any) -> None:
    """Floor worker start-up (outside the timed span): unpickle the work, cap the threads as
    the loaders cap theirs, keep the C heap warm (below), run one sample (imports,
    first-call costs), then wait for all.

    Warm heap: the process serves every array from its heap and keeps all that is freed
    (:func:`~autominato.pipeline.worker.heap_only`; autominato's workers keep what the
    memory budget leaves, worker.py "Warm heap"), so that no
    sample pays for faulting in and zeroing pages that the one before it gave back. A floor
    without it was no floor: on the KiTS19 bench (42 cases, 6 epochs, 2 cores) it read
    20.5-23.6 s where the same processes with it read 14.9-17.6 s, interleaved, and
    autominato's loader ran under it (0.95x) at a step that left it the bottleneck. Where
    the allocator refuses (not glibc 2.33 or later, or tuned by the user's environment) it
    is left as it is."""
    import cloudpickle

    from autominato.pipeline.worker import heap_only, limit_threads

    global _floor_fn, _floor_error
    limit_threads(threads)
    heap_only(True)
    _floor_fn = cloudpickle.loads(payload)
    try:
        _floor_fn(0)
    except Exception as e:  # noqa: BLE001 -- raised by the first task (the executor would
        _floor_error = e  # log an initializer's error and end the process: "died", review 188)
    # (a process that died before it got here breaks the pool, which ends the others:
    # the timeout only bounds a wait that nothing else would end)
    barrier.wait(timeout=_FLOOR_START_S)


def _floor_task(task: tuple[int, int]) -> tuple[float, float]:
    """Read sample ``index`` and transform it for ``epoch``: ``(the read's CPU-seconds, the
    transform's seconds)``. The result stays here: the floor is the work, not its transport.

    The read counts by its CPU time (``time.process_time``), not its wall time: a loader can
    overlap a read's waits (storage latency) with other samples' transforms, but not the CPU a
    read spends (a copy out of the page cache, a decode) on cores the transforms already fill.
    """
    if _floor_error is not None:
        raise _floor_error
    epoch, index = task
    fn = _floor_fn
    c0 = time.process_time()
    item = fn.dataset[index]
    read_cpu = time.process_time() - c0
    t0 = time.perf_counter()
    fn.transform(item, sample_rng(fn.seed, epoch, index))
    return read_cpu, time.perf_counter() - t0


def makespan(durations: Sequence[float], workers: int) -> float:
    """Seconds ``workers`` take when each takes the next of ``durations`` (in order) as soon
    as it is free (greedy list scheduling, as a loader dispatches), seconds.

    Raises:
        ValueError: ``workers < 1``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    free = [0.0] * workers
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


@dataclass(frozen=True)
class Floor:
    """The work alone, scheduled as the loaders dispatch it (:func:`measure_floor`), seconds.

    Attributes:
        s: the floor: the makespan of every sample's read CPU-seconds + transform seconds.
        transform_s: the same makespan of the transforms alone (the reads left out).
        epochs_s: each sample's read CPU-seconds + transform seconds, one tuple per epoch in
            the arms' order (what :func:`~autominato.bench.replay.any_loader_bound` takes).
    """

    s: float
    transform_s: float
    epochs_s: tuple[tuple[float, ...], ...] = ()


def measure_floor(workload: Workload, cores: int, epochs: int = 1,
                  timeout_s: float | None = None) -> Floor:
    """Seconds that the work of every sample of ``epochs`` epochs takes in ``cores``
    processes with nothing else running, taken in the arms' order.

    ``cores`` warm processes (``spawn``ed, threads capped at one each as the loaders' workers
    are, one sample run before the timing starts) each take the next ``(epoch, index)``, each
    epoch in the order every arm takes it (:meth:`Workload.epoch_indices`), as
    soon as they are free, read it and transform it, so the durations carry the contention
    of ``cores`` samples at once (memory bandwidth, caches). A sample's duration is its
    read's CPU-seconds plus its transform's seconds: a loader can hide a read's waits
    (storage latency) behind other samples' transforms, not the CPU the read spends (a copy
    out of the page cache, a decode: KiTS19's read of a whole case is ~50 ms of it). The
    floor is the :func:`makespan` of those durations in dispatch order on ``cores`` workers:
    no batching, collation, transport to the training loop or consumer. It bounds a loader
    that starts the samples in the epoch's order, as every arm does; one that started the
    long samples first could finish a little sooner (greedy list scheduling is within
    ``2 - 1/cores`` of the best order, Graham 1966; the CPU-sum limit, :func:`physical_limit`,
    bounds any order).

    ``timeout_s``: seconds the floor may take in all, its processes' start-up included,
    ``None``: no limit. Every process is ended when the floor returns or raises.

    Raises:
        ValueError: ``cores < 1``.
        RuntimeError: a floor process died (killed, e.g. by the kernel out of memory: a
            process keeps the largest working set it ran warm, see :func:`_floor_init`),
            or failed to start (or waited more than ``_FLOOR_START_S`` s for the others to);
            the message gives its exit code.
        TimeoutError: the samples took longer than ``timeout_s``.
        Exception: whatever the workload's read or transform raises for a sample (the
            warm-up sample's too).
    """
    import multiprocessing as mp
    import signal
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    import cloudpickle

    from autominato.pipeline.worker import threads_per_worker

    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    ctx = mp.get_context("spawn")
    payload = cloudpickle.dumps(SampleFn(workload))
    # each epoch in the order the arms take it (EpochIndices, Loader(shuffle, seed)): the
    # makespan of greedy dispatch depends on where the long samples fall
    tasks = [(e, i) for e in range(epochs) for i in workload.epoch_indices(e)]
    threads = threads_per_worker(cores, cores)
    # the executor starts a process per task submitted while none is idle: all of them, as
    # every task is submitted before one can end (fewer where there are fewer tasks). It
    # takes the tasks in order as its processes come free (multiprocessing.Pool.imap did
    # the same, but waited forever for the task of a process that was killed, review 187)
    n = max(1, min(cores, len(tasks)))
    barrier = ctx.Barrier(n)
    pool = ProcessPoolExecutor(n, mp_context=ctx, initializer=_floor_init,
                               initargs=(payload, threads, barrier))
    procs: dict = {}  # every process started (submit starts them), to end them all

    def started() -> None:
        procs.update(getattr(pool, "_processes", None) or {})

    try:
        futures = []
        for t in tasks:
            futures.append(pool.submit(_floor_task, t))
            started()
        done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()
        if pending:
            raise TimeoutError(f"the floor took more than {timeout_s:.0f} s ({len(done)} of "
                               f"its {len(tasks)} samples done)")
        parts = [f.result() for f in futures]
    except BrokenProcessPool as e:
        started()
        # Every code, once reaped: the executor's own thread ends and reaps them too, and a
        # process it reaped first reads None here until it has stored the code (a clean-clone
        # CI run read only the -15 of the one it terminated, the -9 not yet there)
        deadline = time.monotonic() + 5
        while (any(p.exitcode is None for p in procs.values())
               and time.monotonic() < deadline):
            for p in procs.values():
                p.join(0.05)
        codes = sorted({p.exitcode for p in procs.values() if p.exitcode not in (None, 0)})
        # (the executor SIGTERMs the others once one died: their -15 is not the cause)
        codes = [c for c in codes if c != -signal.SIGTERM] or codes
        why = (f"exit code {', '.join(map(str, codes))}"
               + (" (a negative code is the signal that ended it: -9, SIGKILL, is the "
                  "kernel's out-of-memory killer's)" if any(c < 0 for c in codes) else "")
               if codes else "no exit code")
        raise RuntimeError(f"a floor process died ({why}); the floor was not measured") from e
    finally:
        started()
        barrier.abort()  # (a process still waiting there gives up: after a cut-short start)
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(5)
    both = [r + t for r, t in parts]
    per: dict[int, list[float]] = {}
    for (e, _), d in zip(tasks, both, strict=True):
        per.setdefault(e, []).append(d)
    return Floor(s=makespan(both, cores), transform_s=makespan([t for _, t in parts], cores),
                 epochs_s=tuple(tuple(per.get(e, ())) for e in range(epochs)))


#: The values of :attr:`Workload.step_basis`.
STEP_BASES = ("floor", "cpu", "wall")


def calibrate_step(workload: Workload, serial: SerialCost, cores: int,
                   floor: Floor | None = None, epochs: int = 1) -> float:
    """The simulated step time that balances the loader's work against the accelerator,
    seconds per batch.

    ``step_basis="floor"``: ``step_factor * floor.s / (epochs * batches per epoch)``, the
    floor of ``epochs`` epochs (:func:`measure_floor`) spread over their batches: the steps
    then take as long as the cores take to read and transform the samples in parallel, which
    is what a loader meets. Without a floor (``--no-floor``) it falls back to ``"cpu"``.
    ``"cpu"``: ``step_factor * mean serial CPU-seconds per batch / cores``: the serial
    measurement does not see what running ``cores`` processes at once costs (memory bandwidth,
    page faults: KiTS19's floor CPU was 1.13x the serial CPU on the 2-core machine) nor
    shares their conditions (a loaded spell during it once put it 1.3-1.45x above what that
    run's floors implied), so it decides by chance whether a run is bound by the steps or by the CPUs.
    ``"wall"``: the same with serial wall seconds (read latency included).

    Raises:
        ValueError: ``step_basis`` is none of :data:`STEP_BASES`.
    """
    if workload.step_basis not in STEP_BASES:
        raise ValueError(f"step_basis {workload.step_basis!r}: expected one of "
                         f"{', '.join(map(repr, STEP_BASES))}")
    if workload.step_basis == "floor" and floor is not None:
        batches = max(1, epochs * workload.n_batches)
        return float(workload.step_factor * floor.s / batches)
    per_sample = serial.wall_s if workload.step_basis == "wall" else serial.cpu_s
    return float(workload.step_factor * per_sample.mean() * workload.batch_size / cores)


def physical_limit(serial: SerialCost, n_batches: int, step_s: float, cores: int) -> float:
    """The best wall time any loader could reach, seconds (the issue's definition).

    ``max(serial CPU-seconds / usable cores, batches * step time)``: the cores cannot do the
    epoch's CPU work faster than in parallel without loss, and the accelerator cannot run its
    steps faster than back to back.
    """
    return max(serial.cpu_total_s / cores, n_batches * step_s)


#: Cost and step parameters of the synthetic workload when no scenario or option sets them.
SYNTHETIC_DEFAULTS: dict[str, Any] = dict(
    read_latency_s=0.0,
    cost_dist="constant",
    cost_s=0.030,
    sigma=0.5,
    straggler_fraction=0.05,
    straggler_factor=10.0,
    double_at=None,
    step_basis="cpu",
    step_factor=1.0,
)

#: Synthetic scenarios: overrides of :data:`SYNTHETIC_DEFAULTS`.
SCENARIOS: dict[str, dict[str, Any]] = {
    # Reads dominate: 60 ms of storage latency per sample and little CPU; the accelerator
    # keeps pace with `cores` concurrent readers, so a loader must overlap more reads than it
    # has cores to feed it.
    "io_bound": dict(read_latency_s=0.060, cost_dist="constant", cost_s=0.004, step_basis="wall"),
    # Transforms dominate and the accelerator is twice as fast as the cores can feed it.
    "cpu_bound": dict(read_latency_s=0.0, cost_dist="constant", cost_s=0.040, step_factor=0.5),
    # Balanced on average, but 5 % of the samples cost 10x: the case completion-order
    # batching is for.
    "balanced_stragglers": dict(
        read_latency_s=0.004,
        cost_dist="bimodal",
        cost_s=0.030,
        straggler_fraction=0.05,
        straggler_factor=10.0,
    ),
    # Over-provisioned for the first half, under-provisioned for the second: a static
    # setting tuned on the first half is wrong for the second.
    "cost_doubles": dict(read_latency_s=0.002, cost_dist="constant", cost_s=0.020, double_at=0.5),
}


def synthetic_workload(
    scenario: str | None = None,
    *,
    samples: int = 128,
    batch_size: int = 2,
    sample_mb: float = 8.0,
    on_disk: bool = False,
    step_s: float | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """Build a synthetic workload.

    Cost and step parameters (the keys of :data:`SYNTHETIC_DEFAULTS`: ``read_latency_s``,
    ``cost_dist``, ``cost_s``, ``sigma``, ``straggler_fraction``, ``straggler_factor``,
    ``double_at``, ``step_basis``, ``step_factor``; see :func:`draw_costs`) come from the
    defaults, then the named ``scenario`` of :data:`SCENARIOS`, then ``overrides``.
    ``on_disk`` writes the samples as ``.npy`` files in a temporary folder that
    ``Workload.remove_files`` deletes. ``step_s=None`` leaves the step to be calibrated.

    Raises:
        ValueError: unknown scenario, parameter or distribution, or a non-positive size.
    """
    params = dict(SYNTHETIC_DEFAULTS)
    if scenario is not None:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario {scenario!r}: expected one of {', '.join(SCENARIOS)}")
        params.update(SCENARIOS[scenario])
    unknown = set(overrides) - set(SYNTHETIC_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown synthetic parameter(s): {', '.join(sorted(unknown))}")
    params.update(overrides)
    if samples < 1 or batch_size < 1 or sample_mb <= 0:
        raise ValueError(
            f"samples ({samples}), batch_size ({batch_size}) and sample_mb ({sample_mb}) "
            "must be positive"
        )
    if params["step_basis"] not in STEP_BASES:
        raise ValueError(f"step_basis {params['step_basis']!r}: expected one of "
                         f"{', '.join(map(repr, STEP_BASES))}")
    costs = draw_costs(
        samples,
        params["cost_dist"],
        params["cost_s"],
        sigma=params["sigma"],
        straggler_fraction=params["straggler_fraction"],
        straggler_factor=params["straggler_factor"],
        double_at=params["double_at"],
        seed=seed,
    )
    dataset = SyntheticDataset(costs, sample_mb, params["read_latency_s"])
    cleanup = []
    if on_disk:
        folder = tempfile.mkdtemp(prefix="autominato-bench-")
        dataset = dataset.write(folder)
        cleanup.append(folder)
    desc = (
        f"{samples} samples x {sample_mb:g} MB{' on disk' if on_disk else ''}, "
        f"read {params['read_latency_s'] * 1e3:g} ms, cost {params['cost_dist']} "
        f"{params['cost_s'] * 1e3:g} ms"
    )
    if params["cost_dist"] == "bimodal":
        desc += f" ({params['straggler_fraction']:.0%} x{params['straggler_factor']:g})"
    if params["double_at"] is not None:
        desc += f", doubling at {params['double_at']:.0%}"
    return Workload(
        name=f"synthetic-{scenario or 'custom'}",
        dataset=dataset,
        transform=synthetic_transform,
        batch_size=batch_size,
        step_s=step_s,
        seed=seed,
        description=desc,
        step_basis=params["step_basis"],
        step_factor=params["step_factor"],
        cleanup=cleanup,
    )


def scenario_dataset(
    scenario: str = "balanced_stragglers", samples: int = 128, sample_mb: float = 8.0, seed: int = 0
) -> SyntheticDataset:
    """The dataset of a synthetic scenario with the benchmark's default sizes.

    For ``autominato tune``, which takes a dataset factory and a transform by import path::

        autominato tune --dataset autominato.bench.workload:balanced_stragglers_dataset \
            --transform autominato.bench.workload:synthetic_transform --batch-size 2 \
            --step-time 0.045 --config-out tuned.yaml
    """
    return synthetic_workload(scenario, samples=samples, sample_mb=sample_mb, seed=seed).dataset


#: Factories of each scenario's dataset (``module:factory`` import paths for ``autominato tune``).
io_bound_dataset = partial(scenario_dataset, "io_bound")
cpu_bound_dataset = partial(scenario_dataset, "cpu_bound")
balanced_stragglers_dataset = partial(scenario_dataset, "balanced_stragglers")
cost_doubles_dataset = partial(scenario_dataset, "cost_doubles")
