"""Executors with concurrency that can change while they run.

Both executors take one task per worker at a time from the scheduler (which therefore knows
exactly which samples each worker holds) and report through one callback, ``post(event)``,
so the scheduler sees a single stream of events:

* :class:`ThreadWorkers`: threads of this process (read stage; GIL-free transforms).
* :class:`ProcessWorkers`: worker processes, each with its own duplex pipe. Per-worker pipes
  (not one shared queue) mean a worker killed mid-message cannot leave a lock held that
  blocks the others, and its death is seen at once through its process sentinel.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger("autominato.pipeline")

Post = Callable[[tuple], None]


@dataclass
class ThreadWorker:
    wid: int
    thread: threading.Thread
    task: Any = None


class ThreadWorkers:
    """A pool of threads running ``fn(task) -> event`` and posting each event.

    ``fn`` must not raise (it returns an error event instead). A thread stuck in ``fn`` (a read
    from a hung network file system) cannot be killed: :meth:`abandon` stops counting it and
    starts a replacement; when ``fn`` returns at last, its event is still posted (the scheduler
    discards it, freeing what it holds) and the thread ends.
    """

    def __init__(self, name: str, fn: Callable[[Any], tuple], post: Post) -> None:
        self.name = name
        self.fn = fn
        self.post = post
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive = 0
        self._retire = 0
        self._stuck = 0  # abandoned threads still inside fn
        self._ids = itertools.count()
        self._threads: set[threading.Thread] = set()  # started and not yet returned
        self._running: dict[int, tuple[Any, float]] = {}  # thread id -> (task, start time)
        self._abandoned: set[int] = set()
        self.in_flight = 0
        self._closed = False

    @property
    def size(self) -> int:
        return self._alive - self._retire - self._stuck

    def resize(self, n: int) -> None:
        with self._lock:
            want = max(0, n)
            cur = self._alive - self._retire
            if want > cur:
                cancel = min(self._retire, want - cur)
                self._retire -= cancel
                for _ in range(want - cur - cancel):
                    t = threading.Thread(
                        target=self._loop, name=f"autominato-{self.name}-{next(self._ids)}", daemon=True
                    )
                    self._alive += 1
                    self._threads.add(t)
                    t.start()
            elif want < cur:
                self._retire += cur - want

    def capacity(self) -> int:
        return max(0, self.size - self.in_flight)

    def submit(self, task: Any) -> None:
        with self._lock:
            self.in_flight += 1
        self._q.put(task)

    def overdue(self, limit: float) -> list[Any]:
        """Tasks that have been running for more than ``limit`` seconds."""
        now = time.monotonic()
        with self._lock:
            return [task for tid, (task, t0) in self._running.items()
                    if now - t0 > limit and tid not in self._abandoned]

    def abandon(self, task: Any) -> bool:
        """Give up on the thread running ``task`` and start a replacement (see the class doc)."""
        with self._lock:
            tid = next((t for t, (held, _) in self._running.items() if held is task), None)
            if tid is None or tid in self._abandoned:
                return False
            self._abandoned.add(tid)
            self._stuck += 1
            self.in_flight -= 1
            t = threading.Thread(target=self._loop, name=f"autominato-{self.name}-{next(self._ids)}", daemon=True)
            self._alive += 1
            self._threads.add(t)
        t.start()
        return True

    def _loop(self) -> None:
        tid = threading.get_ident()
        while True:
            with self._lock:
                if self._retire > 0 or self._closed:
                    self._retire = max(0, self._retire - 1)
                    self._alive -= 1
                    self._threads.discard(threading.current_thread())
                    return
            try:
                task = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            with self._lock:
                self._running[tid] = (task, time.monotonic())
            event = self.fn(task)
            with self._lock:
                del self._running[tid]
                stuck = tid in self._abandoned
                if stuck:
                    self._abandoned.discard(tid)
                    self._stuck -= 1
                    self._alive -= 1
                    self._threads.discard(threading.current_thread())
                else:
                    self.in_flight -= 1
            self.post(event)
            if stuck:
                return

    def close(self, timeout: float = 0.5) -> None:
        """Stop the threads; wait up to ``timeout`` seconds for those not stuck in ``fn``.

        Waiting lets a loader built next find this process single-threaded again, so that
        its workers may fork (see :func:`autominato.pipeline.spawn.can_fork_now`)."""
        with self._lock:
            self._closed = True
            waiting = [t for t in self._threads if t.ident not in self._abandoned]
        deadline = time.monotonic() + timeout
        for t in waiting:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


@dataclass
class ProcWorker:
    wid: int
    proc: Any
    conn: Any
    pid: int | None = None
    ready: bool = False
    task: Any = None  # the task the worker holds (one at a time)
    task_started: float = 0.0
    retiring: bool = False
    info: dict = field(default_factory=dict)


class ProcessWorkers:
    """Resizable pool of worker processes running :func:`autominato.pipeline.worker.process_main`.

    Events posted: ``("proc", wid, reply)`` for each reply of a worker and
    ``("died", wid, exitcode)`` when a worker process ends without being asked to.
    All methods except the collector thread's are called from the scheduler thread.
    """

    def __init__(self, payload: bytes, post: Post, start_method: str = "auto", initial: int = 0) -> None:
        self.payload = payload
        self.post = post
        fork_first = start_method == "auto" and can_fork_now()
        if start_method == "auto":
            start_method = "forkserver"
        if start_method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
            start_method = "spawn"
        self.ctx = mp.get_context(start_method)
        self._start_ctx = self.ctx
        if start_method == "forkserver":
            # Workers fork from a server that already imported these: fast starts.
            self.ctx.set_forkserver_preload(["__main__", "autominato.pipeline.worker", "numpy", "torch"])
        self.workers: dict[int, ProcWorker] = {}
        self.dead: dict[int, ProcWorker] = {}
        self.threads: int | None = None  # intra-op thread cap of each worker (None: payload's)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._closing = False
        if fork_first and initial > 0:
            # No thread runs yet in this process, so the first workers may fork straight from
            # it: no interpreter start and no torch import (seconds) before the first batch.
            # Workers started later (resizes, replacements) come from the fork server, which
            # starts then (a background start would print its traceback on an early Ctrl-C).
            from autominato.pipeline.knobs import usable_cores
            from autominato.pipeline.worker import threads_per_worker

            self.threads = threads_per_worker(usable_cores(), initial)
            self._start_ctx = mp.get_context("fork")
            try:
                for _ in range(initial):
                    self.start_one()
            finally:
                self._start_ctx = self.ctx
        self._collector = threading.Thread(target=self._collect, name="autominato-collector", daemon=True)
        self._collector.start()

    # -- scheduler side ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return sum(1 for w in self.workers.values() if not w.retiring)

    def resize(self, n: int) -> None:
        from autominato.pipeline.knobs import usable_cores
        from autominato.pipeline.worker import threads_per_worker

        active = [w for w in self.workers.values() if not w.retiring]
        threads = threads_per_worker(usable_cores(), n)
        if self.threads is not None and threads != self.threads:
            # Workers x threads must stay within the cores whatever the worker count becomes.
            for w in active:
                self._send_control(w, ("threads", threads))
        self.threads = threads
        for _ in range(n - len(active)):
            self.start_one()
        if n < len(active):
            # Retire idle workers first, newest first; busy ones finish their sample first.
            victims = sorted(active, key=lambda w: (w.task is not None, -w.wid))[: len(active) - n]
            for w in victims:
                w.retiring = True
                if w.task is None:
                    self._stop(w)

    def start_one(self) -> ProcWorker:
        from autominato.pipeline.worker import process_main

        wid = next(self._ids)
        parent, child = self._start_ctx.Pipe(duplex=True)
        # Not a daemon: a transform may start a process pool of its own (daemons may not have
        # children); close() ends the workers instead.
        proc = self._start_ctx.Process(
            target=process_main, args=(wid, child, self.payload, self.threads),
            name=f"autominato-worker-{wid}", daemon=False,
        )
        proc.start()
        child.close()
        w = ProcWorker(wid, proc, parent, pid=proc.pid)
        with self._lock:
            self.workers[wid] = w
        self._wake()
        return w

    def idle(self) -> list[ProcWorker]:
        return [w for w in self.workers.values() if w.ready and w.task is None and not w.retiring]

    def send(self, w: ProcWorker, task: Any, msg: tuple) -> None:
        w.task = task
        w.task_started = time.monotonic()
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # its death is reported by the collector; the task is re-dispatched then

    def _send_control(self, w: ProcWorker, msg: tuple) -> None:
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # a dead worker: the collector reports it

    def task_done(self, w: ProcWorker) -> None:
        w.task = None
        if w.retiring:
            self._stop(w)

    def _stop(self, w: ProcWorker) -> None:
        try:
            w.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._forget(w)
        threading.Thread(target=_reap, args=(w.proc, 5.0), daemon=True).start()

    def _forget(self, w: ProcWorker) -> None:
        with self._lock:
            self.workers.pop(w.wid, None)
        self._wake()
        try:
            w.conn.close()
        except OSError:
            pass

    def kill(self, w: ProcWorker) -> None:
        """SIGKILL ``w`` (a hung worker); its death is then handled like any other."""
        try:
            os.kill(w.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass

    def remove_dead(self, wid: int) -> ProcWorker | None:
        """Forget a worker whose death was posted; returns it (with the task it held)."""
        with self._lock:
            w = self.dead.pop(wid, None)
        if w is not None:
            try:
                w.conn.close()
            except OSError:
                pass
        return w

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.pid is not None]

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        workers = list(self.workers.values())
        for w in workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for w in workers:
            # A worker busy on a long sample would finish it first: do not wait for that.
            w.proc.join(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=max(0.1, deadline - time.monotonic()))
            try:
                w.conn.close()
            except OSError:
                pass
        with self._lock:
            self.workers.clear()
        self._wake()
        self._collector.join(timeout=2.0)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"w")
        except OSError:
            pass

    # -- collector thread ----------------------------------------------------------------
    def _collect(self) -> None:
        while not self._closing:
            with self._lock:
                ws = list(self.workers.values())
            conns = {w.conn: w for w in ws}
            sentinels = {w.proc.sentinel: w for w in ws}
            try:
                ready = wait([self._wake_r, *conns, *sentinels], timeout=1.0)
            except OSError:
                continue  # a connection closed under us; rebuild the list
            dead: list[ProcWorker] = []
            for r in ready:
                if r is self._wake_r:
                    try:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                    except (EOFError, OSError):
                        return
                elif r in conns:
                    self._drain(conns[r])
                else:
                    dead.append(sentinels[r])
            for w in dead:
                with self._lock:
                    if self.workers.pop(w.wid, None) is None:
                        continue  # stopped on purpose
                    self.dead[w.wid] = w
                self._drain(w)  # a reply sent just before dying still counts
                w.proc.join(timeout=0.5)
                self.post(("died", w.wid, w.proc.exitcode))

    def _drain(self, w: ProcWorker) -> None:
        try:
            while w.conn.poll():
                self.post(("proc", w.wid, w.conn.recv()))
        except (EOFError, OSError):
            pass  # the sentinel reports the death


def can_fork_now() -> bool:
    """Whether this process may fork workers safely: Linux-style ``fork`` exists, only one
    thread runs (a lock held by another thread at fork time stays held in the child forever)
    and CUDA is not initialised (a forked child cannot use it)."""
    if "fork" not in mp.get_all_start_methods() or threading.active_count() != 1:
        return False
    try:
        import torch

        return not torch.cuda.is_initialized()
    except ImportError:  # pragma: no cover
        return True


def _reap(proc: Any, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)
