"""What a worker runs for one sample, and the loop of a worker process.

The same :func:`run_sample` serves thread workers and process workers, so a sample's result
does not depend on where it ran: its random generator is seeded from ``(seed, epoch, index)``
alone (``numpy.random.SeedSequence`` entropy).

Global generators. When the loader has a ``transform``, a worker process also seeds Python's
``random``, NumPy's legacy global generator and torch's default generator from
``(seed, epoch, index)`` before each sample (:func:`seed_globals`), for transforms that draw
from them: a sample's augmentation is then reproducible whichever worker ran it. Without a
transform it seeds them once, from ``(seed, worker id)``, as the DataLoader seeds each of its
workers (per-sample seeding costs about 15 us, as much as a tiny sample's whole transport). Thread workers (``worker_kind="thread"``, ``workers=0``)
run in the training process: they leave those generators alone, since reseeding them from a
worker thread would repeat the training loop's own draws and race with them.

Intra-op threads (BLAS, OpenMP, torch) of a worker process:

* A worker that descends from the training process by fork (a zygote forked from it, see
  :mod:`autominato.pipeline.spawn`) keeps **one** thread, as the DataLoader's workers do
  (``torch.set_num_threads(1)`` in its worker loop). GNU libgomp, the OpenMP runtime of
  torch's Linux wheels, does not survive fork: after the parent ran a parallel region, a
  child that enters one with more than one thread waits forever for pool threads that fork
  did not copy (GCC bug 60035). One thread never uses the pool.
* A worker forked by a zygote that is a new interpreter (or spawned) never inherited an
  OpenMP pool: it takes ``cores // workers`` threads (:func:`threads_per_worker`), updated
  when the worker count changes, so that workers x threads stays within the cores.
"""

from __future__ import annotations

import inspect
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autominato.pipeline.errors import ErrorReport
from autominato.pipeline.shm import SlotCache, pack, unpack


def takes_rng(fn: Callable | None) -> bool:
    """Whether ``fn`` is called as ``fn(sample, rng)`` rather than ``fn(sample)``.

    True when ``fn`` has exactly two required positional parameters, or its second positional
    parameter is named ``rng`` (``def aug(sample, rng=None)``). A MONAI ``Compose`` (one
    required parameter, the rest defaulted) is therefore called as ``fn(sample)``.
    """
    if fn is None:
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    # ``def aug(sample, rng=None)`` asks for the generator by name.
    return len(required) == 2 or (len(positional) >= 2 and positional[1].name == "rng")


@dataclass
class WorkSpec:
    """Everything a worker needs. Forked workers inherit it; a zygote in a new interpreter
    receives it cloudpickled, once (see :mod:`autominato.pipeline.spawn`)."""

    dataset: Any
    transform: Callable | None
    transform_takes_rng: bool
    seed: int
    threads_per_worker: int = 1


def _seed_sequence(seed: int, epoch: int, index: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, index])


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's augmentation: ``default_rng(SeedSequence([seed, epoch, index]))``.

    Touches no global generator (see :func:`seed_globals` for worker processes)."""
    return np.random.default_rng(_seed_sequence(seed, epoch, index))


def _mix(*values: int) -> int:
    """A 32-bit seed from integers: SplitMix64's finaliser over each (Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014); 1 us where
    ``SeedSequence.generate_state`` takes 10."""
    x = 0
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0xFFFFFFFF


def seed_globals(*key: int) -> None:
    """Seed Python's ``random``, NumPy's legacy global generator and torch's default generator
    from ``key``: ``(seed, epoch, index)`` for one sample, or ``(seed, worker_id)`` once per
    worker (see the module docstring).

    Only for worker processes: in the training process it would reseed the user's own
    generators."""
    s32 = _mix(*key)
    random.seed(s32)
    np.random.seed(s32)
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    # Not torch.manual_seed: with CUDA not initialised (a worker's usual state) it queues a
    # lazy CUDA seeding and formats the whole call stack for it, about 1 ms per sample.
    torch.default_generator.manual_seed(s32)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s32)


def sample_path(dataset: Any, index: int) -> str | None:
    fn = getattr(dataset, "sample_path", None)
    if fn is None:
        return None
    try:
        p = fn(index)
    except Exception:
        return None
    return None if p is None else str(p)


def run_sample(
    spec: WorkSpec, index: int, epoch: int, read: bool, sample: Any = None
) -> tuple[Any, float, float]:
    """Read (when ``read``) and transform one sample.

    Returns:
        ``(sample, read_seconds, transform_seconds)``.
    """
    t0 = time.perf_counter()
    if read:
        sample = spec.dataset[index]
    t1 = time.perf_counter()
    if spec.transform is not None:
        rng = sample_rng(spec.seed, epoch, index)
        sample = spec.transform(sample, rng) if spec.transform_takes_rng else spec.transform(sample)
    return sample, t1 - t0, time.perf_counter() - t1


def serve_sample(
    spec: WorkSpec, index: int, epoch: int, read: bool, sample: Any = None
) -> tuple[Any, float, float]:
    """:func:`run_sample` as a worker process (or a Ray actor) runs it: with a transform, the
    global generators are first seeded from ``(seed, epoch, index)`` (:func:`seed_globals`),
    so that a sample's result does not depend on which process ran it.

    Returns:
        ``(sample, read_seconds, transform_seconds)``.
    """
    if spec.transform is not None:
        seed_globals(spec.seed, epoch, index)
    return run_sample(spec, index, epoch, read, sample)


#: Variables that BLAS / OpenMP libraries read when they load (OpenBLAS, MKL, BLIS, Apple
#: Accelerate, numexpr): a library that a transform imports later starts with the cap too.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def threads_per_worker(cores: int, workers: int) -> int:
    """Intra-op threads each of ``workers`` processes may use so that workers x threads does
    not exceed ``cores`` (at least 1)."""
    return max(1, cores // max(1, workers))


def limit_threads(n: int) -> None:
    """Cap BLAS / OpenMP / torch intra-op threads of this process to ``n``.

    Libraries already loaded are capped through threadpoolctl and torch; libraries loaded
    afterwards through the environment variables in :data:`THREAD_ENV`.
    """
    for var in THREAD_ENV:
        os.environ[var] = str(n)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
    except Exception:  # pragma: no cover - threadpoolctl is a dependency
        pass
    try:
        import torch

        torch.set_num_threads(n)
    except Exception:  # pragma: no cover
        pass


def process_main(wid: int, conn, spec: WorkSpec | bytes, threads: int | None = None) -> None:
    """Body of a transform worker process.

    ``spec`` is the :class:`WorkSpec` itself (inherited by fork) or its cloudpickle bytes.
    Messages from the loader: ``None`` (exit), ``("threads", n)`` (cap intra-op threads at
    ``n``: the worker count changed) or ``("many", [task, ...])``, each task
    ``(key, index, epoch, read, in_slot, in_desc, out_slot)`` where a slot is ``(name, size)``
    or ``None``, served in order. Replies: ``("many", [reply, ...])`` (see :data:`FLUSH_S`),
    each ``("ok", key, desc, need, read_s, transform_s, pack_s)`` or
    ``("err", key, ErrorReport)``; before them ``("ready", pid)`` once, or
    ``("fatal", ErrorReport)`` when ``spec`` cannot be unpickled. ``threads`` overrides the
    spec's ``threads_per_worker``. The worker ends at ``None`` or at the end of ``conn`` (the
    loader closed or died: only the loader holds the other end).
    """
    # Ctrl-C goes to the whole process group; the loader in the main process handles it and
    # ends the workers, so a worker must not die half-way through writing a reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the loader's SIGTERM clean-up handler, which must not run here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker = f"worker {wid} (process {os.getpid()})"
    try:
        if isinstance(spec, (bytes, bytearray)):
            import cloudpickle

            try:
                spec = cloudpickle.loads(spec)
            except BaseException as e:
                conn.send(("fatal", ErrorReport.capture(e, -1, None, worker)))
                return
        limit_threads(spec.threads_per_worker if threads is None else threads)
        seed_globals(spec.seed, wid)  # per sample too when there is a transform
        cache = SlotCache()
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return  # retired (or the loader closed) before this worker was ready: nothing to say
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the loader is gone
        if msg is None:
            return
        if msg[0] == "threads":
            limit_threads(msg[1])
            continue
        if not _serve_chunk(conn, spec, cache, worker, msg[1]):  # ("many", [task, ...])
            return


#: A worker given several samples in one message replies for all of them in one message, but
#: sends what it has at once when this many seconds have passed since the last send: the
#: loader then knows which sample a worker holds when it hangs or dies (the first one with no
#: reply), and a slow sample never holds back the results of fast ones for long.
FLUSH_S = 0.02


def _serve(spec: WorkSpec, cache: SlotCache, worker: str, msg: tuple) -> tuple:
    """Read / transform one task and pack the result; returns the reply (never raises)."""
    pos, index, epoch, read, in_slot, in_desc, out_slot = msg
    try:
        sample = None
        if in_slot is not None or in_desc is not None:
            buf = cache.get(*in_slot) if in_slot is not None else None
            sample = unpack(in_desc, buf)
        sample, read_s, transform_s = serve_sample(spec, index, epoch, read, sample)
        t = time.perf_counter()
        out = cache.get(*out_slot) if out_slot is not None else None
        desc, need = pack(sample, out)
        del sample
        return ("ok", pos, desc, need, read_s, transform_s, time.perf_counter() - t)
    except BaseException as e:  # noqa: BLE001 - every failure is the sample's, reported
        return ("err", pos, ErrorReport.capture(e, index, sample_path(spec.dataset, index), worker))


def _serve_chunk(conn, spec: WorkSpec, cache: SlotCache, worker: str, tasks: list) -> bool:
    """Serve several tasks, replying ``("many", [reply, ...])`` (see :data:`FLUSH_S`).
    Returns False when the loader is gone."""
    replies: list = []
    last = time.perf_counter()
    for task in tasks:
        replies.append(_serve(spec, cache, worker, task))
        if time.perf_counter() - last > FLUSH_S:
            try:
                conn.send(("many", replies))
            except (EOFError, OSError, BrokenPipeError):
                return False
            replies, last = [], time.perf_counter()
    if replies:
        try:
            conn.send(("many", replies))
        except (EOFError, OSError, BrokenPipeError):
            return False
    return True
