"""What a worker runs for one sample, and the loop of a worker process.

The same :func:`run_sample` serves thread workers and process workers, so a sample's result
does not depend on where it ran: its random generator is seeded from ``(seed, epoch, index)``
alone (``numpy.random.SeedSequence`` entropy), and so are Python's ``random``, NumPy's legacy
global generator and torch's default generator, for transforms that use global randomness.
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

    True when ``fn`` has exactly two required positional parameters. A MONAI ``Compose``
    (one required parameter, the rest defaulted) is therefore called as ``fn(sample)``.
    """
    if fn is None:
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(required) == 2


@dataclass
class WorkSpec:
    """Everything a worker needs, pickled (with cloudpickle) once per worker."""

    dataset: Any
    transform: Callable | None
    transform_takes_rng: bool
    seed: int
    threads_per_worker: int = 1


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's augmentation: ``default_rng(SeedSequence([seed, epoch, index]))``."""
    ss = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, index])
    g = np.random.default_rng(ss)
    # Global generators too, for transforms that draw from them.
    s32 = int(ss.generate_state(1, dtype=np.uint32)[0])
    random.seed(s32)
    np.random.seed(s32)
    try:
        import torch

        torch.manual_seed(s32)
    except ImportError:  # pragma: no cover
        pass
    return g


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


def process_main(wid: int, conn, payload: bytes, threads: int | None = None) -> None:
    """Body of a transform worker process.

    Messages from the loader: ``None`` (exit), ``("threads", n)`` (cap intra-op threads at
    ``n``: the worker count changed) or ``("many", [task, ...])``, each task
    ``(key, index, epoch, read, in_slot, in_desc, out_slot)`` where a slot is ``(name, size)``
    or ``None``, served in order. Replies: ``("many", [reply, ...])`` (see :data:`FLUSH_S`),
    each ``("ok", key, desc, need, read_s, transform_s, pack_s)`` or
    ``("err", key, ErrorReport)``. ``threads`` overrides the payload's ``threads_per_worker``.
    """
    # Ctrl-C goes to the whole process group; the loader in the main process handles it and
    # ends the workers, so a worker must not die half-way through writing a reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the loader's SIGTERM clean-up handler, which must not run here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    import cloudpickle

    worker = f"worker {wid} (process {os.getpid()})"
    try:
        try:
            spec: WorkSpec = cloudpickle.loads(payload)
        except BaseException as e:
            conn.send(("fatal", ErrorReport.capture(e, -1, None, worker)))
            return
        limit_threads(spec.threads_per_worker if threads is None else threads)
        cache = SlotCache()
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return  # retired (or the loader closed) before this worker was ready: nothing to say
    while True:
        try:
            # A forked worker's pipe may also be open in its siblings, so the loader's death
            # does not always close it: a new parent (we were re-parented) says so instead.
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    return
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
        sample, read_s, transform_s = run_sample(spec, index, epoch, read, sample)
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
