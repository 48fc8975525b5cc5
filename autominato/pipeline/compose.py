"""The sample stages of a configuration: which stages, which executor, which function.

A mode of the loader is a composition of :class:`~autominato.pipeline.stage.Stage` s, never a
branch on a mode string: :func:`compose` builds the list for a
:class:`~autominato.pipeline.scheduler.Pipeline`, and each stage function below is what one
item costs there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autominato.pipeline.errors import ErrorReport, WorkerInitError, with_original_type
from autominato.pipeline.executor import ProcessWorkers
from autominato.pipeline.executors import ProcessExecutor, ThreadExecutor
from autominato.pipeline.shm import pack, packed_nbytes, use_slot
from autominato.pipeline.stage import Result, Stage
from autominato.pipeline.stats import thread_cpu
from autominato.pipeline.worker import (
    Streams,
    WorkSpec,
    install_thread_getter,
    run_sample,
    sample_path,
    start_worker,
)

if TYPE_CHECKING:
    from autominato.pipeline.scheduler import Pipeline

log = logging.getLogger("autominato.pipeline")


class Packed:
    """A sample read by the split read stage: its descriptor and the slot holding its arrays."""

    __slots__ = ("desc", "slot")

    def __init__(self, desc: bytes, slot: Any) -> None:
        self.desc, self.slot = desc, slot


def compose(p: Pipeline) -> list[Stage]:
    """The sample stages of ``p``'s configuration, in data order.

    * ``workers == 0``: one stage of threads that read and transform (no worker process).
    * ``worker_kind="thread"``: read threads, then transform threads.
    * process workers, ``fuse_read`` (default): one stage of processes that read and transform.
    * process workers, ``fuse_read=False``: read threads, then transform processes; samples
      cross through shared memory.
    * an iterable dataset (``cfg.iterable``): one stage of processes or threads, each pull
      iterating a shard and transforming (:class:`~autominato.pipeline.worker.Streams`);
      ``fuse_read`` does not apply (a shard is read where it is iterated).

    Transform threads are workers as processes are: each has an id in ``[0, workers)``, its
    ``get_worker_info()`` (torch's getter is wrapped for threads, see
    :func:`~autominato.pipeline.worker.install_thread_getter`) and runs ``worker_init_fn``; an
    error there is posted as ``("fatal", exception)``.
    * ``worker_kind="ray"``: Ray actors that read and transform (``fuse_read``, default), or
      read threads then Ray actors; samples come back through Ray's object store.
    """
    cfg, k, post, spec = p.cfg, p.knobs, p.post, p.spec
    plain = WorkSpec(spec.dataset, None, False, spec.seed)

    def thread_init(wid: int) -> bool:
        try:
            start_worker(spec, wid, k.workers, f"thread {threading.current_thread().name}",
                         process=False)
        except WorkerInitError as e:
            post(("fatal", with_original_type(e)))
            return False
        return True

    def pull(key: tuple, item: tuple) -> Result:
        gen, shard, shards, epoch, seq, n = item
        where = f"worker {shard} (thread {threading.current_thread().name})"
        return Result("transform", key, list(p.streams.pull(gen, shard, shards, epoch, seq, n, where)))

    def stage(name: str, executor: Any, capacity: Callable[[], int]) -> Stage:
        return Stage(name, executor, p._hook(name), capacity)

    def read_and_transform(key: tuple, item: tuple) -> Result:
        index, epoch, draw = item
        try:
            sample, read_s, transform_s = run_sample(spec, index, epoch, read=True, draw=draw)
        except BaseException as e:  # noqa: BLE001
            return _failed("transform", key, e, index, spec)
        return Result("transform", key, sample, service_s=transform_s, read_s=read_s,
                      nbytes=packed_nbytes(sample))

    add_cpu = p.stats["read"].add_cpu

    def read_cpu(c: float, w: float | None) -> None:
        # (what a read thread asked of the CPU for an item, from thread_cpu() at its start:
        # StageSnapshot.cpu_seconds_total and runqueue_seconds_total; no wait where either
        # end could not read it)
        c1, w1 = thread_cpu()
        add_cpu(c1 - c, w1 - w if w is not None and w1 is not None else 0.0)

    def read(key: tuple, item: tuple) -> Result:
        index, epoch, draw = item  # they seed a dataset's own random transforms
        c, w = thread_cpu()
        try:
            sample, read_s, _ = run_sample(plain, index, epoch, read=True, draw=draw)
        except BaseException as e:  # noqa: BLE001
            return _failed("read", key, e, index, spec)
        finally:
            read_cpu(c, w)
        return Result("read", key, sample, service_s=read_s, nbytes=packed_nbytes(sample))

    def read_packed(key: tuple, item: tuple) -> Result:
        c, w = thread_cpu()
        try:
            return packed(key, item)
        finally:
            read_cpu(c, w)

    def packed(key: tuple, item: tuple) -> Result:
        index, epoch, draw = item
        try:
            sample, read_s, _ = run_sample(plain, index, epoch, read=True, draw=draw)
            t = time.perf_counter()
            nbytes = packed_nbytes(sample)
            slot = p.slots.acquire(nbytes) if use_slot(nbytes) else None  # (never waits)
        except BaseException as e:  # noqa: BLE001
            return _failed("read", key, e, index, spec)
        try:
            desc, _ = pack(sample, slot.mmap if slot is not None else None)
        except BaseException as e:  # noqa: BLE001 - an unpicklable leaf, say
            p.slots.release(slot)
            return _failed("read", key, e, index, spec)
        return Result("read", key, Packed(desc, slot),
                      service_s=read_s + time.perf_counter() - t, nbytes=nbytes)

    def transform(key: tuple, item: tuple) -> Result:
        index, epoch, draw, sample = item
        try:
            sample, _, transform_s = run_sample(spec, index, epoch, read=False, sample=sample,
                                                draw=draw)
        except BaseException as e:  # noqa: BLE001
            return _failed("transform", key, e, index, spec)
        return Result("transform", key, sample, service_s=transform_s, nbytes=packed_nbytes(sample))

    reads = lambda: k.read_threads  # noqa: E731
    ahead = lambda: k.workers + k.read_threads  # noqa: E731 - read-ahead of the transform stage
    if k.workers == 0:
        return [stage("transform", ThreadExecutor("transform", read_and_transform, post, k.read_threads), reads)]
    if cfg.worker_kind == "thread":
        install_thread_getter()
        if cfg.iterable:
            p.streams = Streams(spec, process=False)
            return [stage("transform", ThreadExecutor("transform", pull, post, k.workers, thread_init),
                          lambda: 0)]
        return [stage("read", ThreadExecutor("read", read, post, k.read_threads), lambda: 0),
                stage("transform", ThreadExecutor("transform", transform, post, k.workers, thread_init),
                      ahead)]
    if cfg.worker_kind == "ray":
        ex = _ray_executor(p, spec)
        if cfg.fuse_read:
            return [stage("transform", ex, lambda: 0)]
        return [stage("read", ThreadExecutor("read", read, post, k.read_threads), lambda: 0),
                stage("transform", ex, ahead)]
    workers = ProcessWorkers(spec, post, cfg.start_method, initial=k.workers)
    p.procs = ProcessExecutor("transform", workers, cfg.batch_size, cfg.max_tries, p._fail_runs,
                              cfg.start_method)
    p.procs.resize(k.workers)  # those not forked already start from the fork server
    if cfg.fuse_read or cfg.iterable:
        return [stage("transform", p.procs, lambda: 0)]
    return [stage("read", ThreadExecutor("read", read_packed, post, k.read_threads), lambda: 0),
            stage("transform", p.procs, ahead)]


def _ray_executor(p: Pipeline, spec: WorkSpec) -> Any:
    """Ray actors for the transform stage; the cluster's room bounds the ``workers`` knob."""
    from autominato.pipeline.ray_executor import RayExecutor, actor_options

    k = p.knobs
    asked: list[int] = []  # the value the cluster's bound last cut the knob down from

    def bound(actors: int) -> None:
        lo, hi = k.bounds("workers")
        if actors == hi:
            return
        now = k.workers
        if now > actors:
            log.warning("the Ray cluster has room for %d transform actors of %s CPU now (its "
                        "placed ones and those its free CPUs hold; one is asked for even "
                        "where none fits); workers goes from %d to %d until it has more",
                        actors, actor_options(p.cfg.ray_actor_options)["num_cpus"], now, actors)
            asked[:] = [now]
        k.set_bounds("workers", min(lo, actors), actors)
        if asked and actors > hi and now == hi:  # room again, and nobody moved the knob since
            k.workers = min(asked[0], actors)
            if asked[0] <= actors:
                asked.clear()

    ex = RayExecutor("transform", spec, p.post, 0, actor_options(p.cfg.ray_actor_options),
                     copy=p.cfg.collate_fn is not None, max_startup_deaths=p.cfg.max_tries,
                     on_fatal=p._fail_runs, on_capacity=bound,
                     share="num_cpus" not in (p.cfg.ray_actor_options or {}))
    ex.resize(k.workers)  # within the bound just read
    return ex


def _failed(stage: str, key: tuple, e: BaseException, index: int, spec: WorkSpec) -> Result:
    report = ErrorReport.capture(e, index, sample_path(spec.dataset, index, e),
                                 f"thread {threading.current_thread().name}")
    report.original = e
    return Result(stage, key, ok=False, error=report.to_exception())
