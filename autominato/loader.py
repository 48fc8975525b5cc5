"""``autominato.Loader``: a drop-in for ``torch.utils.data.DataLoader`` on heavy samples.

This is the one module that wires the pipeline (:mod:`autominato.pipeline`, which knows
nothing else) to telemetry, the online controller and configuration files written by
``autominato tune``. Telemetry and the controller see the loader through a weak proxy, so a
Loader dropped without ``close()`` is collected and frees its workers and shared memory.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DistributedSampler

# Imported with the Loader, not in its constructor: the controller runs by default, and
# importing it (and the telemetry switch) there delayed the first batch by tens of ms.
from autominato.control import Controller
from autominato.pipeline.knobs import KNOB_NAMES, Knobs, usable_cores
from autominato.pipeline.sampler import epoch_order
from autominato.pipeline.scheduler import Pipeline, PipelineConfig, Run
from autominato.pipeline.shm import shm_free_bytes
from autominato.pipeline.stats import RECENT, LoaderSnapshot, StageStats
from autominato.pipeline.worker import WorkSpec, takes_rng
from autominato.telemetry.handle import monitor_interval_from_env

log = logging.getLogger("autominato.pipeline")

STAGES = ("read", "transform", "batch", "transfer", "consumer")
_live: weakref.WeakSet = weakref.WeakSet()


def default_knobs(batch_size: int, cores: int, workers: int | None = None) -> tuple[dict, dict]:
    """Starting values and bounds of the knobs.

    ``workers`` defaults to the usable cores (what users commonly give the DataLoader);
    ``pool_size`` (samples in flight) to ``2 * batch_size + workers + read_threads``: enough to
    keep every worker busy while one batch fills and one waits. The controller may take
    ``workers`` up to ``4 * cores`` (workers that wait on I/O leave cores idle).
    """
    w = cores if workers is None else workers
    values = {"depth": 2, "read_threads": 2, "workers": w, "pool_size": 2 * batch_size + w + 2}
    bounds = {
        "depth": (1, 32),
        "read_threads": (1, 32),
        "workers": (0, 0) if w == 0 else (1, max(4 * cores, 8)),
        "pool_size": (batch_size, max(64 * batch_size, 256)),
    }
    return values, bounds


#: DataLoader arguments that Loader does not take (yet), and what to use instead.
DATALOADER_ARGS = {
    "num_workers": "use workers=N (worker processes; 0 loads without worker processes)",
    "prefetch_factor": "use depth=N (batches prepared ahead of the training loop)",
    "pin_memory": "use device='cuda': batches arrive on the GPU, copied from pinned memory",
    "pin_memory_device": "use device=...",
    "persistent_workers": "drop it: workers live as long as the Loader",
    "multiprocessing_context": "use start_method='fork' | 'forkserver' | 'spawn'",
    "generator": "use seed=N (shuffling and augmentation)",
    "worker_init_fn": "not supported yet",
    "batch_sampler": "not supported yet: give sampler=, batch_size= and drop_last=",
}


def draw_seed() -> int:
    """A base seed drawn from torch's default generator, as the DataLoader draws its own (so
    ``torch.manual_seed`` makes a run reproducible)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class Loader:
    """A staged asynchronous loader with completion-order batches and live knobs.

    Args:
        dataset: a map-style dataset (``__len__``, ``__getitem__``). May define
            ``sample_path(index) -> str | None`` so that errors name the file.
        batch_size: samples per batch.
        shuffle: reshuffle every epoch (seeded by ``seed + epoch``).
        sampler: an iterable of indices used instead of ``shuffle``. It is iterated as it is
            (as the DataLoader does): its ``set_epoch`` is called only by
            :meth:`set_epoch`, so a sampler that the training loop set itself is respected.
        collate_fn: builds a batch from a list of samples; default stacks arrays into pooled
            buffers like ``default_collate``.
        drop_last: drop the last short batch (the same indices the DataLoader drops); with
            ``on_error="skip"`` no batch is ever short.
        transform: ``transform(sample, rng)`` with a ``numpy.random.Generator`` seeded from
            ``(seed, epoch, index)``, or a plain ``transform(sample)``.
        seed: base seed of shuffling and augmentation. ``None``: drawn from torch's default
            generator (as the DataLoader does), except that with several ranks the shuffle
            uses seed 0, ``DistributedSampler``'s default, so that every rank draws the same
            permutation and the ranks' shards never overlap.
        in_order: deliver batches in sampler order (as the DataLoader); default is completion
            order, where a slow sample joins a later batch of the same epoch.
        device: ``"cuda"`` etc.: batches arrive on this device, copied from pinned memory on a
            side stream. ``None`` leaves them on the host.
        rank, world_size: this process's share of each epoch (``DistributedSampler``
            semantics); read from ``torch.distributed`` when initialised and not given.
        worker_kind: ``"process"`` (default) or ``"thread"`` for GIL-free transforms.
        fuse_read: read inside the transform worker processes (default), so that only the
            transformed sample crosses to the main process. ``False`` adds a separate read
            stage of threads (``read_threads``) for I/O-bound reads (network storage).
        on_error: ``"raise"`` or ``"skip"`` (log, count and continue without the sample).
        on_worker_death: ``"retry"`` (replace the worker, re-dispatch its sample) or ``"raise"``.
        max_tries: a sample whose worker dies this many times goes through ``on_error``.
        timeout: seconds one sample may take in a worker before that worker is replaced and
            the sample goes through ``on_error`` as a ``SampleTimeout``; ``None`` or ``0``
            (the DataLoader's "no timeout") wait for ever. Fast samples travel to a worker
            in chunks: a sample that hangs in a chunk is first sent again alone (the others
            are not blamed), so it is given up after up to twice ``timeout``.
        memory_budget_bytes: most bytes of shared memory for sample slots (default: half of
            the free ``/dev/shm``, at most a quarter of the available RAM).
        start_method: how worker processes start. ``"auto"`` (default): a fork server of this
            loader's own (:mod:`autominato.pipeline.spawn`) is forked when the Loader is built,
            if no other thread runs and CUDA is not initialised (workers then share the
            dataset copy-on-write), else started as a new interpreter that unpickles the
            dataset once; ``"fork"``, ``"forkserver"`` force one of these; ``"spawn"`` starts
            each worker as a new interpreter. Workers never import ``__main__``.
        config: a file written by ``autominato tune`` (or its dict): starting knobs and bounds.
        metrics_port, metrics_host, monitor_interval: telemetry (see ``autominato.telemetry``).
        autotune: run the online controller (``autominato.control``).
        prefetch_next_epoch: start the next epoch's samples in the workers that the tail of
            this epoch frees (its first batches are ready when the training loop asks), as
            long as the next order is computable without side effects: the Loader's own
            shuffle / sequential order, or a ``DistributedSampler`` (other samplers: off).
            The next epoch is the current one + 1 (+ 0 after a pass that repeated the epoch
            set by :meth:`set_epoch`); a pass that asks for another epoch or order discards
            the speculative work (counted in ``speculative_discarded_total``). Memory: no
            more samples in flight than without it (the two epochs share the ``pool_size``
            window), plus up to ``depth`` assembled batches of the next epoch. The last
            epoch's speculation is wasted work (up to ``pool_size`` samples). Off with
            ``persistent_workers=False`` (the dataset may change between epochs).
        depth, read_threads, workers, pool_size: starting knob values (see :class:`Knobs`).

    Raises:
        ValueError: invalid arguments (the message names the argument).

    Iterators are independent, as the DataLoader's: ``zip(loader, loader)`` gives
    ``len(loader)`` pairs, each side a whole epoch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        drop_last: bool = False,
        transform: Callable | None = None,
        seed: int | None = None,
        in_order: bool = False,
        device: str | torch.device | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        worker_kind: str = "process",
        fuse_read: bool | None = None,
        on_error: str = "raise",
        on_worker_death: str = "retry",
        max_tries: int = 3,
        timeout: float | None = None,
        memory_budget_bytes: int | None = None,
        start_method: str = "auto",
        config: str | Path | dict | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        monitor_interval: float | None = None,
        autotune: bool = True,
        prefetch_next_epoch: bool = True,
        **knobs: int,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True are mutually exclusive (as in DataLoader)")
        if worker_kind not in ("process", "thread"):
            raise ValueError(f"worker_kind must be 'process' or 'thread', got {worker_kind!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_worker_death not in ("retry", "raise"):
            raise ValueError(f"on_worker_death must be 'retry' or 'raise', got {on_worker_death!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be seconds >= 0 (0 or None: no timeout), got {timeout!r}")
        unknown = set(knobs) - set(KNOB_NAMES)
        if unknown:
            hints = [f"{name}: {DATALOADER_ARGS.get(name, 'not an argument of Loader')}"
                     for name in sorted(unknown)]
            raise TypeError("Loader() got argument(s) it does not take: " + "; ".join(hints)
                            + f" (the knobs are {', '.join(KNOB_NAMES)})")
        for name, v in knobs.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        try:
            self._n = len(dataset)
        except TypeError as e:
            raise ValueError("dataset must be map-style (define __len__ and __getitem__)") from e

        cfg = None
        if config is not None:
            from autominato.config import load_config

            cfg = load_config(config)
            static = cfg["loader"]
            worker_kind = static.get("worker_kind", worker_kind)
            in_order = static.get("in_order", in_order)

        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.sampler = sampler
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.transform = transform
        self.in_order = in_order
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
            rank = torch.distributed.get_rank() if rank is None else rank
        self.world_size = int(world_size or 1)
        self.rank = int(rank or 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        self.seed = draw_seed() if seed is None else int(seed)
        # All ranks must draw one permutation (DistributedSampler's seed 0 when none is given).
        self.shuffle_seed = 0 if seed is None and self.world_size > 1 else self.seed
        self.worker_kind = worker_kind
        self.on_error = on_error
        self.on_worker_death = on_worker_death
        self.max_tries = max(1, int(max_tries))
        self.timeout = timeout or None
        self.config = cfg
        self._on_skip: Callable | None = None
        self.decision_hooks: list[Callable[[Any], None]] = []
        self.decisions: deque = deque(maxlen=1000)

        cores = usable_cores()
        start = dict(knobs)
        if cfg is not None:
            start = {**cfg["knobs"], **start}
        values, bounds = default_knobs(self.batch_size, cores, start.get("workers"))
        if cfg is not None:
            for name, (lo, hi) in cfg["bounds"].items():
                bounds[name] = (lo, hi)
        values.update(start)
        if values["workers"] == 0:
            bounds["workers"] = (0, 0)
        elif bounds["workers"][0] == 0:
            bounds["workers"] = (1, max(1, bounds["workers"][1]))
        if "workers" not in knobs and values["workers"] > bounds["workers"][1]:
            # A configuration tuned on a bigger machine: say so rather than oversubscribe.
            log.warning("the configuration asks for %d workers, more than this machine's bound "
                        "of %d (%d usable cores); using %d", values["workers"],
                        bounds["workers"][1], cores, bounds["workers"][1])
        elif values["workers"] > bounds["workers"][1]:
            bounds["workers"] = (bounds["workers"][0], values["workers"])  # the user's explicit choice
        bounds["pool_size"] = (max(self.batch_size, bounds["pool_size"][0]),
                               max(self.batch_size, bounds["pool_size"][1]))
        self.knobs = Knobs(values, bounds)

        fused = True if fuse_read is None else bool(fuse_read)
        avail = psutil.virtual_memory().available
        shm_budget = (int(memory_budget_bytes) if memory_budget_bytes is not None
                      else int(min(shm_free_bytes() * 0.5, avail * 0.25)))
        self._cfg = PipelineConfig(
            batch_size=self.batch_size, drop_last=drop_last, in_order=in_order, on_error=on_error,
            on_worker_death=on_worker_death, max_tries=self.max_tries, sample_timeout=self.timeout,
            collate_fn=collate_fn, device=self.device, worker_kind=worker_kind, fuse_read=fused,
            start_method=start_method, shm_budget_bytes=shm_budget,
        )
        self.stage_stats: dict[str, StageStats] = {s: StageStats(s) for s in STAGES}
        self._consumer_busy = 0.0
        self._consumer_wait = 0.0
        self._batches = 0
        self._samples = 0
        self._h2d_bytes = 0
        self._h2d_seconds = 0.0
        self._epoch = 0
        self._epoch_set = False
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self._epoch_step = 1  # how the epoch moved between the last two passes (0 or 1)
        self._last_pass_epoch: int | None = None
        self._started = False
        self._pipeline: Pipeline | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._telemetry = None
        self._controller = None
        _live.add(self)

        if values["workers"] > 0 and worker_kind == "process" and start_method in ("auto", "fork"):
            # Start the workers now, before telemetry and the controller start threads, so
            # that they can fork (see start_method).
            self._ensure_pipeline()

        me = _Observed(self)
        if metrics_port is not None or monitor_interval is not None or monitor_interval_from_env():
            from autominato import telemetry

            self._telemetry = telemetry.attach(
                me, port=metrics_port, host=metrics_host, monitor_interval=monitor_interval
            )
        if autotune:
            self._controller = Controller(me, config=cfg)
            self._controller.start()

    # ------------------------------------------------------------------ DataLoader API
    def __len__(self) -> int:
        """Batches per epoch on this rank (an upper bound when ``on_error="skip"`` drops some).

        Raises:
            TypeError: the sampler has no length (a generator), as with the DataLoader.
        """
        n = self._samples_per_epoch()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _samples_per_epoch(self) -> int:
        if self.sampler is not None:
            try:
                return len(self.sampler)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(
                    f"the sampler ({type(self.sampler).__name__}) has no len(), so neither has "
                    "the Loader (as with DataLoader); give a sampler with __len__") from None
        if self.world_size > 1:
            return -(-self._n // self.world_size)
        return self._n

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the shuffle and augmentation seeds of every iteration until the
        next call (as ``DistributedSampler.set_epoch``); a sampler with ``set_epoch`` gets it
        too. Without any call, each pass over the Loader is a new epoch."""
        self._epoch = int(epoch)
        self._epoch_set = True
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _order(self, epoch: int) -> list[int]:
        return epoch_order(
            self._n, epoch=epoch, seed=self.shuffle_seed, shuffle=self.shuffle, sampler=self.sampler,
            rank=self.rank, world_size=self.world_size, batch_size=self.batch_size, drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        with self._lock:
            if self._started and not self._epoch_set:
                # Like DataLoader's RandomSampler: a new shuffle each pass, until the training
                # loop sets the epoch itself; from then on, as with DistributedSampler, the
                # epoch is the one set (a peek with next(iter(loader)) does not advance it).
                self._epoch += 1
            self._started = True
            pipeline = self._ensure_pipeline()
            if self._last_pass_epoch is not None:
                step = self._epoch - self._last_pass_epoch
                self._epoch_step = step if step in (0, 1) else 1
            self._last_pass_epoch = self._epoch
            run = pipeline.start(self._order(self._epoch), self._epoch, self._next_epoch_order())
            return _EpochIterator(self, pipeline, run)

    def _next_epoch_order(self) -> tuple[list[int], int] | None:
        """``(order, epoch)`` of the pass expected after this one, or ``None`` when it cannot
        be computed without side effects (a user sampler other than ``DistributedSampler``,
        whose iteration may draw from a shared generator) or speculation is off."""
        if not self.prefetch_next_epoch or not getattr(self, "persistent_workers", True):
            return None
        epoch = self._epoch + self._epoch_step
        sampler = self.sampler
        if sampler is not None:
            if type(sampler) is not DistributedSampler:  # a subclass may have side effects
                return None
            sampler = copy.copy(sampler)
            # The training loop sets the sampler's epoch itself (DDP's habit) or through
            # set_epoch: either way the next one is expected to follow.
            sampler.set_epoch(sampler.epoch + 1)
        order = epoch_order(
            self._n, epoch=epoch, seed=self.shuffle_seed, shuffle=self.shuffle, sampler=sampler,
            rank=self.rank, world_size=self.world_size, batch_size=self.batch_size,
            drop_last=self.drop_last,
        )
        return order, epoch

    def _ensure_pipeline(self) -> Pipeline:
        if self._pipeline is None:
            spec = WorkSpec(
                dataset=self.dataset,
                transform=self.transform,
                transform_takes_rng=takes_rng(self.transform),
                seed=self.seed,
                threads_per_worker=max(1, usable_cores() // max(1, self.knobs.workers)),
            )
            me = weakref.ref(self)

            def on_skip(index: int, path: str | None, exc: BaseException) -> None:
                loader = me()
                if loader is not None and loader._on_skip is not None:
                    loader._on_skip(index, path, exc)

            self._pipeline = Pipeline(self._cfg, spec, self.knobs, self.stage_stats, on_skip=on_skip)
            self.knobs.subscribe(self._pipeline.knobs_changed)
        return self._pipeline

    def close(self) -> None:
        """Stop workers and threads and unlink shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._controller is not None:
            self._controller.stop()
        if self._pipeline is not None:
            self._pipeline.close()
        if self._telemetry is not None:
            self._telemetry.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def telemetry(self) -> Any:
        """The telemetry handle (exporter ``.url``, ``.report()``), or ``None`` when off."""
        return self._telemetry

    @property
    def controller(self) -> Any:
        """The online controller (``.decisions``), or ``None`` with ``autotune=False``."""
        return self._controller

    # ------------------------------------------------------------------ control surface
    def worker_pids(self) -> list[int]:
        """PIDs of the transform worker processes (empty with thread workers)."""
        return self._pipeline.worker_pids() if self._pipeline is not None else []

    def report_decision(self, decision: Any) -> None:
        """Record a controller decision and pass it to every hook in ``decision_hooks``."""
        self.decisions.append(decision)
        for hook in list(self.decision_hooks):
            hook(decision)

    def snapshot(self) -> LoaderSnapshot:
        """A frozen copy of every figure the telemetry and the controller read."""
        p = self._pipeline
        stages = {name: st.snapshot() for name, st in self.stage_stats.items()}
        cons = stages["consumer"]
        return LoaderSnapshot(
            time=time.monotonic(),
            stages=stages,
            consumer_wait_seconds_total=self._consumer_wait,
            consumer_wait_recent_s=cons.recent_wait_s[-RECENT:],
            consumer_busy_seconds_total=self._consumer_busy,
            batches_total=self._batches,
            samples_total=self._samples,
            epoch=self._epoch,
            stragglers_total=p.stragglers if p else 0,
            skipped_total=p.skipped if p else 0,
            worker_restarts_total=p.worker_restarts if p else 0,
            h2d_bytes_total=self._h2d_bytes,
            h2d_seconds_total=self._h2d_seconds,
            knobs=self.knobs.as_dict(),
            sample_bytes=p.sample_bytes if p else 0.0,
            pool_bytes=p.pool_bytes if p else 0,
            speculative_discarded_total=p.speculative_discarded if p else 0,
        )


class _Observed:
    """What telemetry and the controller see of a Loader: its figures and knobs, through a
    weak reference, so that their threads never keep a dropped Loader (and its workers and
    shared memory) alive.

    Raises:
        ReferenceError: from :meth:`snapshot` once the Loader is gone.
    """

    def __init__(self, loader: Loader) -> None:
        self._ref = weakref.ref(loader)
        self.stage_stats = loader.stage_stats
        self.knobs = loader.knobs
        self.decision_hooks = loader.decision_hooks
        self.rank = loader.rank
        self.config = loader.config

    def _loader(self) -> Loader:
        loader = self._ref()
        if loader is None:
            raise ReferenceError("the Loader was garbage-collected")
        return loader

    def snapshot(self) -> LoaderSnapshot:
        return self._loader().snapshot()

    def worker_pids(self) -> list[int]:
        return self._loader().worker_pids()

    def report_decision(self, decision: Any) -> None:
        self._loader().report_decision(decision)


class _EpochIterator:
    """One epoch of batches; the training loop's waits in ``__next__`` are its idle time."""

    def __init__(self, loader: Loader, pipeline: Pipeline, run: Run) -> None:
        self.L = loader
        self.pipeline = pipeline
        self.run = run
        self.epoch = run.epoch_no
        self._done = False
        self._last_return: float | None = None
        self._pending_h2d: list = []

    def __iter__(self) -> _EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self.L)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.monotonic()
        busy = t0 - self._last_return if self._last_return is not None else 0.0
        self._poll_h2d()
        run = self.run
        with run.cv:
            while not run.out:
                if self.L._closed or (run.closed and not run.out):
                    self._finish()
                    fatal = self.pipeline.fatal()
                    if fatal is not None:
                        raise RuntimeError("autominato's scheduler failed") from fatal
                    raise StopIteration
                run.cv.wait(0.5)
            item = run.out.popleft()
        kind = item[0]
        if kind != "batch":
            self._finish()
            if kind == "end":
                if self.L._telemetry is not None:
                    self.L._telemetry.on_epoch_end(self.epoch)
                raise StopIteration
            raise item[1]
        self.pipeline.consumed(run)
        _, batch, indices, h2d = item
        if h2d is not None:
            from autominato.pipeline.collate import record_stream

            e0, e1, nbytes, host = h2d
            stream = torch.cuda.current_stream(self.L.device)
            stream.wait_event(e1)
            record_stream(batch, stream)
            self._pending_h2d.append(h2d)
        now = time.monotonic()
        wait = now - t0
        L = self.L
        L._consumer_wait += wait
        L._consumer_busy += busy
        L._batches += 1
        L._samples += len(indices)
        L.stage_stats["consumer"].record(busy, wait, 0, items=len(indices))
        self._last_return = now
        return batch

    def _poll_h2d(self) -> None:
        keep = []
        for e0, e1, nbytes, host in self._pending_h2d:
            if e1.query():
                seconds = e0.elapsed_time(e1) / 1000.0
                self.L._h2d_bytes += nbytes
                self.L._h2d_seconds += seconds
                self.L.stage_stats["transfer"].record(seconds, 0.0, nbytes)
            else:
                keep.append((e0, e1, nbytes, host))
        self._pending_h2d = keep

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.pipeline.stop(self.run)

    def stop(self) -> None:
        """Abandon the epoch: what the pipeline holds for it is freed."""
        self._finish()

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:
            pass


def _close_all() -> None:
    for loader in list(_live):
        try:
            loader.close()
        except Exception:
            pass


import atexit  # noqa: E402

atexit.register(_close_all)
