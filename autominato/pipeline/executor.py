"""Executors with concurrency that can change while they run.

Both executors take one task per worker at a time from the scheduler (which therefore knows
exactly which samples each worker holds) and report through one callback, ``post(event)``,
so the scheduler sees a single stream of events:

* :class:`ThreadWorkers`: threads of this process (read stage; GIL-free transforms).
* :class:`ProcessWorkers`: worker processes, forked by a per-loader zygote
  (:mod:`autominato.pipeline.spawn`), each with its own socket to the loader. Per-worker
  sockets (not one shared queue) mean a worker killed mid-message cannot leave a lock held
  that blocks the others; the zygote reaps each worker and reports its exit at once.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from autominato.pipeline.errors import ErrorReport, describe
from autominato.pipeline.shm import SCM_MAX_FD, FdDesc, fd_socket, map_memfd
from autominato.pipeline.spawn import Zygote, can_fork_now, say_fresh_start, zygote_kind

__all__ = ["ProcWorker", "ProcessWorkers", "ThreadWorker", "ThreadWorkers", "can_fork_now"]

log = logging.getLogger("autominato.pipeline")

Post = Callable[[tuple], None]

#: Put in a :class:`ThreadWorkers` queue by ``close``: wakes a waiting thread at once.
_WAKE = object()


@dataclass
class ThreadWorker:
    wid: int
    thread: threading.Thread
    task: Any = None


#: Seconds the interpreter's exit waits in all for loader threads still inside a sample
#: (:func:`join_at_exit`; read when it runs).
EXIT_WAIT_S = 60.0

_thread_pools: weakref.WeakSet = weakref.WeakSet()  # every ThreadWorkers made


def join_at_exit(limit: float | None = None) -> int:
    """Wait, up to ``limit`` seconds in all (:data:`EXIT_WAIT_S` as it is then), for every
    loader thread still inside an item (a thread worker's sample, a batch's collation, a
    read; one of a closed loader included, as ``close`` waits only 0.5 s for it; not one
    given up on for ``sample_timeout``, which may never return, nor an idle one): the
    loader's ``atexit`` hook, before the interpreter's finalization. That finalization ends a
    daemon thread that comes back to Python from C code with ``pthread_exit``; where C++
    frames are on its stack (torch, MONAI's transforms) that aborts the process (exit status
    134, "terminate called without an active exception") before the program's open files are
    flushed: trial 125, a MONAI pipeline on thread workers, aborted in 6 of 12 runs, a sample
    of the next epoch (prefetched) still running at the end. Warns, naming the threads, when
    it waits over 2 s. Returns how many were still inside an item after it."""
    limit = EXIT_WAIT_S if limit is None else limit
    deadline = time.monotonic() + limit

    def busy() -> list[threading.Thread]:
        out = [t for pool in list(_thread_pools) for t in pool.busy_threads()]
        return [t for t in out if t is not threading.current_thread() and t.is_alive()]

    told = False
    while True:
        threads = busy()
        left = deadline - time.monotonic()
        if not threads or left <= 0:
            return len(threads)
        if not told and limit - left >= 2.0:
            told = True
            log.warning("waiting up to %.0f s for %d loader thread(s) still inside a sample "
                        "before the interpreter exits (%s): a thread cannot be stopped "
                        "mid-sample (executor.EXIT_WAIT_S)", left, len(threads),
                        ", ".join(t.name for t in threads))
        threads[0].join(min(left, 0.1))


class ThreadWorkers:
    """A pool of threads running ``fn(task) -> event`` and posting each event.

    ``fn`` must not raise (it returns an error event instead). A thread stuck in ``fn`` (a read
    from a hung network file system) cannot be killed: :meth:`abandon` stops counting it and
    starts a replacement; when ``fn`` returns at last, its event is still posted (the scheduler
    discards it, freeing what it holds) and the thread ends.

    Each thread has an id in ``[0, size)``, as the DataLoader's workers: a new thread takes
    the lowest free id, and shrinking retires the highest ids first. ``init(id)`` runs first
    in every new thread (replacements included); when it returns False the thread ends.
    """

    def __init__(self, name: str, fn: Callable[[Any], tuple], post: Post,
                 init: Callable[[int], bool] | None = None) -> None:
        self.name = name
        self.fn = fn
        self.post = post
        self.init = init
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[int] = set()  # ids of threads that serve (not retiring, not abandoned)
        self._retiring: set[int] = set()  # ids of threads asked to end
        self._ids = itertools.count()
        self._threads: set[threading.Thread] = set()  # started and not yet returned
        self._running: dict[int, tuple[Any, float]] = {}  # thread id -> (task, start time)
        self._abandoned: set[int] = set()
        self._initing: set[int] = set()  # ids of threads running init
        self._slot: dict[int, int] = {}  # thread ident -> its id, while it serves
        self.in_flight = 0
        self._closed = False
        _thread_pools.add(self)

    @property
    def size(self) -> int:
        return len(self._live)

    def resize(self, n: int) -> None:
        with self._lock:
            want = max(0, n)
            while len(self._live) < want and self._retiring:
                slot = min(self._retiring)  # not gone yet: it serves on
                self._retiring.discard(slot)
                self._live.add(slot)
            while len(self._live) < want:
                slot = 0
                while slot in self._live or slot in self._retiring:
                    slot += 1
                self._spawn(slot)
            while len(self._live) > want:
                slot = max(self._live)
                self._live.discard(slot)
                self._retiring.add(slot)

    def _spawn(self, slot: int) -> None:
        """Start the thread of id ``slot`` (the lock is held)."""
        t = threading.Thread(target=self._loop, args=(slot,),
                             name=f"autominato-{self.name}-{next(self._ids)}", daemon=True)
        self._live.add(slot)
        self._threads.add(t)
        t.start()

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
        """Give up on the thread running ``task`` and start a replacement with its id (see the
        class doc)."""
        with self._lock:
            tid = next((t for t, (held, _) in self._running.items() if held is task), None)
            if tid is None or tid in self._abandoned:
                return False
            self._abandoned.add(tid)
            self.in_flight -= 1
            slot = self._slot.pop(tid)
            if slot in self._live:
                self._live.discard(slot)
                self._spawn(slot)
            else:
                self._retiring.discard(slot)  # it was to end anyway
        return True

    def _end(self, slot: int | None) -> None:
        """This thread ends (the lock is held)."""
        if slot is not None:
            self._retiring.discard(slot)
            self._live.discard(slot)
            self._slot.pop(threading.get_ident(), None)
        self._threads.discard(threading.current_thread())

    def _loop(self, slot: int) -> None:
        tid = threading.get_ident()
        with self._lock:
            self._slot[tid] = slot
            if self.init is not None:
                self._initing.add(tid)  # in user code: close waits for it like a busy one
        if self.init is not None:
            ok = self.init(slot)
            with self._lock:
                self._initing.discard(tid)
                if not ok:
                    self._end(slot)
            if not ok:
                return
        while True:
            with self._lock:
                if slot in self._retiring or self._closed:
                    self._end(slot)
                    return
            try:
                task = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            if task is _WAKE:
                continue
            with self._lock:
                if slot in self._retiring or self._closed:  # retired while it waited
                    self._q.put(task)
                    self._end(slot)
                    return
                self._running[tid] = (task, time.monotonic())
            event = self.fn(task)
            with self._lock:
                del self._running[tid]
                stuck = tid in self._abandoned
                if stuck:
                    self._abandoned.discard(tid)
                    self._end(None)  # its id serves in its replacement now
                else:
                    self.in_flight -= 1
            self.post(event)
            # Not held while waiting for the next task: an item may carry an exception whose
            # traceback holds the training loop's frames (and its iterator, whose run then
            # never stops).
            task = event = None
            if stuck:
                return

    def busy_threads(self) -> list[threading.Thread]:
        """The threads inside ``fn`` or ``init`` now (user code), not those given up on
        (:meth:`abandon`)."""
        with self._lock:
            idents = {tid for tid in (*self._running, *self._initing) if tid not in self._abandoned}
            return [t for t in self._threads if t.ident in idents]

    def running(self) -> bool:
        """A thread other than this one has not returned (after :meth:`close`: one still
        inside ``fn``, or an abandoned one)."""
        with self._lock:
            return any(t is not threading.current_thread() and t.is_alive() for t in self._threads)

    def close(self, timeout: float = 0.5) -> None:
        """Stop the threads: those waiting for a task end at once (and are waited for, up to
        5 s on a loaded machine), one inside ``fn`` is waited for up to ``timeout`` seconds
        (its sample may take long), an abandoned one is not.

        Waiting lets a loader built next find this process single-threaded again, so that
        its workers may fork (see :func:`autominato.pipeline.spawn.can_fork_now`)."""
        with self._lock:
            self._closed = True
            threads = [t for t in self._threads if t.ident not in self._abandoned]
        busy = {t.ident for t in self.busy_threads()}
        for _ in threads:
            self._q.put(_WAKE)
        now = time.monotonic()
        short, long = now + timeout, now + max(timeout, 5.0)
        for t in sorted(threads, key=lambda t: t.ident in busy):
            if t is not threading.current_thread():
                t.join(max(0.0, (short if t.ident in busy else long) - time.monotonic()))


@dataclass
class ProcWorker:
    wid: int
    proc: Any  # a _Child: how the loader reaches the process (pid, kill, exit)
    conn: Any
    pid: int | None = None
    ready: bool = False
    ready_at: float = 0.0  # time.monotonic() when the scheduler first saw it ready
    task: Any = None  # the task the worker holds (one at a time)
    task_started: float = 0.0
    retiring: bool = False
    stale: bool = False  # replaced by ProcessWorkers.renew: never serves again
    count: int = 0  # the num_workers its worker_init_fn was given (get_worker_info)
    info: dict = field(default_factory=dict)
    slot: int = 0  # its id in [0, workers), as the DataLoader's worker ids (wid never repeats)
    dataset_due: bool = False  # ProcessWorkers.dataset is to be sent before its next task
    heap_sent: int = 0  # the last ("heap", keep) it was sent (ProcessWorkers.heap_keep)
    fd_sock: Any = None  # conn's socket for the memory files beside replies (shm.fd_socket)
    # The scheduler thread sends tasks and control messages, the collector thread the answers
    # to row claims (rows.RowAllocator.claim): one message at a time.
    send_lock: Any = field(default_factory=threading.Lock)

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def close_conn(self) -> None:
        for c in (self.conn, self.fd_sock):
            try:
                if c is not None:
                    c.close()
            except OSError:
                pass


class _Child:
    """The loader's view of one worker process, which its zygote forked and reaps."""

    def __init__(self, zygote: Zygote | None) -> None:
        self.zygote = zygote
        self.pid: int | None = None
        self.started = False  # the zygote reported it forked it
        self.eof = False  # its connection reached end of file
        self.exitcode: int | None = None
        self.exited = threading.Event()
        self.stop_deadline: float | None = None  # asked to stop: SIGKILL it after this
        # start_one is asking a zygote for it: its connection's end, or its zygote's, is
        # start_one's to report (else the collector could post its death before the reason)
        self.starting = False

    @property
    def forked(self) -> bool:
        """It descends from the training process by fork (see worker.py on threads)."""
        return self.zygote is not None and self.zygote.forked

    def kill(self) -> None:
        # Takes no lock: also called from a SIGTERM handler.
        if self.pid is not None and not self.exited.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def is_alive(self) -> bool:
        return not self.exited.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.exited.wait(timeout)


class ProcessWorkers:
    """Resizable pool of worker processes running :func:`autominato.pipeline.worker.process_main`.

    Workers are forked by a per-loader zygote (:mod:`autominato.pipeline.spawn`), started
    here, so that they share ``spec`` copy-on-write and never run the user's ``__main__``.
    :meth:`start_one` only sends a request: a worker is usable once its ``("ready", pid)``
    reply arrives, and a start that fails is reported as a death.

    Each worker has an internal ``wid`` that never repeats and an id (``slot``) in
    ``[0, workers)`` as the DataLoader's worker ids: a new worker (a replacement, or one added)
    takes the lowest id no active worker has, and shrinking retires the highest ids. Its
    first message carries that id, the worker count and :attr:`dataset` (see
    :func:`~autominato.pipeline.worker.process_main`).

    Events posted: ``("proc", wid, reply)`` for each reply of a worker and
    ``("died", wid, exitcode)`` when a worker process ends without being asked to
    (``exitcode`` as multiprocessing's: ``-9`` for SIGKILL; ``None`` when unknown, e.g. the
    worker never started). All methods except the collector thread's are called from the
    scheduler thread.

    Args:
        spec: the :class:`~autominato.pipeline.worker.WorkSpec` the workers run. Pickled (once)
            only for a zygote that is not forked from this process (nested, or a new
            interpreter).
        post: receives the events.
        start_method: ``"auto"``, ``"fork"``, ``"forkserver"`` or ``"spawn"`` (see
            :func:`autominato.pipeline.spawn.zygote_kind`).
        initial: workers to start now.

    Raises:
        ValueError: ``start_method`` is unknown, or the zygote cannot be forked from this
            process and ``spec`` cannot be pickled.
    """

    def __init__(self, spec: Any, post: Post, start_method: str = "auto", initial: int = 0) -> None:
        from autominato.pipeline.knobs import usable_cores
        from autominato.pipeline.worker import threads_per_worker

        self.spec = spec
        self.post = post
        self.start_method = start_method
        self.kind = zygote_kind(start_method)
        if self.kind == "fresh" and start_method == "auto":  # (trial 120: ~1 s, unsaid)
            say_fresh_start()
        self._replaced = False  # a forked zygote ended and a new interpreter took over
        #: The worker count that new workers are told (``WorkerInfo.num_workers``).
        self.target = initial
        #: The dataset cloudpickled, sent to every new worker in place of the spec's (set by
        #: :meth:`send_dataset`), or ``None``.
        self.dataset: bytes | None = None
        self.workers: dict[int, ProcWorker] = {}
        self.dead: dict[int, ProcWorker] = {}
        # Intra-op thread cap of each worker that does not descend from this process by fork.
        self.threads: int = threads_per_worker(usable_cores(), max(1, initial))
        #: Bytes of free heap each worker keeps warm between samples (:meth:`set_heap_keep`),
        #: sent to every worker and to those started later.
        self.heap_keep: int = 0
        #: The keep is a cap, not a budgeted share: a worker gives nothing back while its
        #: free heap is within it (``memory_aware=False``, ``worker.HeapTrim.set_keep``).
        self.heap_whole: bool = False
        self._payload: bytes | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._children: dict[int, ProcWorker] = {}  # every worker whose end is not known yet
        self._zygotes: list[Zygote] = []
        self._closing = False
        self._stop_collector = False
        #: ``on_claim(key, signature) -> answer``: a worker's claim of a batch row, answered
        #: from the collector thread (``rows.RowAllocator.claim``); None: every claim is refused.
        self.on_claim: Callable[[tuple, tuple], tuple] | None = None
        # First, while this process runs one thread: a forked zygote is started right here.
        self._zygote: Zygote | None = self._new_zygote(self.kind)
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._collector: threading.Thread | None = None
        try:
            for _ in range(initial):
                self.start_one()
        except BaseException:
            # (a Ctrl-C here, trial 165: nothing held this object, and its zygote, not a
            # daemon, waited on its socket while multiprocessing's exit joined it: the
            # process never exited)
            self.close(timeout=1.0)
            raise
        self._collector = threading.Thread(target=self._collect, name="autominato-collector", daemon=True)
        self._collector.start()

    # -- zygotes -------------------------------------------------------------------------
    def _pickled(self) -> bytes:
        if self._payload is None:

            from autominato.pipeline.worker import dumps_for_worker, script_classes_note

            try:
                self._payload = dumps_for_worker(self.spec)
            except Exception as e:
                if self._replaced:
                    why = ("this Loader's fork server ended (killed, or broken), and the "
                           "workers started after it come from a new interpreter, which gets "
                           "them pickled")
                    ways = "a picklable dataset and transform"
                elif self.start_method in ("spawn", "forkserver"):
                    why = (f"start_method={self.start_method!r} starts them from a new "
                           "interpreter, which gets them pickled")
                    ways = "start_method='fork' to fork them from this process as it is"
                else:
                    why = ("this process runs threads (another Loader's, say), so its workers "
                           "start from a clean process that gets them pickled")
                    ways = ("start_method='fork' (multiprocessing_context='fork', as the "
                            "DataLoader's on Linux up to Python 3.13) to fork them from this "
                            "process as it is, which hangs if a thread holds a lock they need "
                            "(see the Loader's start_method); or build this Loader before any "
                            "thread starts")
                raise ValueError(
                    f"the dataset and transform must be picklable to run in worker processes "
                    f"({type(e).__name__}: {e}): {why}. Use {ways}; or worker_kind='thread' "
                    "(threads share this process's objects, which must then allow use from "
                    "other threads: an sqlite3 connection refuses it unless opened with "
                    "check_same_thread=False), or num_workers=0."
                    + script_classes_note(self.spec.dataset, self.spec.transform)
                ) from e
        return self._payload

    def _new_zygote(self, kind: str) -> Zygote:
        z = None
        if kind == "nested":
            try:
                z = Zygote(kind, self.spec, self._pickled)
            except OSError as e:  # the zygote to fork it from ended meanwhile
                log.debug("no zygote to fork this loader's from (%s): a new interpreter", e)
                kind = self.kind = "fresh"
        if z is None:
            z = Zygote(kind, self.spec, self._pickled)
        with self._lock:
            self._zygotes.append(z)
        return z

    def _zygote_for_start(self) -> Zygote:
        z = self._zygote
        if z is None or z.gone or z.broken:
            # Never fork this process again (threads run now): a new interpreter takes over.
            self._replaced = self._replaced or (z is not None and self.kind in ("fork", "nested"))
            z = self._zygote = None
            z = self._zygote = self._new_zygote("spawn" if self.kind == "spawn" else "fresh")
        return z

    # -- scheduler side ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return sum(1 for w in list(self.workers.values()) if not w.retiring)

    def resize(self, n: int) -> None:
        from autominato.pipeline.knobs import usable_cores
        from autominato.pipeline.worker import threads_per_worker

        active = [w for w in list(self.workers.values()) if not w.retiring]
        # Workers retired while busy still run (and hold their ids): they serve on, lowest id
        # first, rather than new workers taking the same ids beside them.
        for w in sorted((w for w in list(self.workers.values()) if w.retiring and not w.stale),
                        key=lambda w: w.slot):
            if len(active) >= n:
                break
            w.retiring = False
            active.append(w)
        threads = threads_per_worker(usable_cores(), n)
        if threads != self.threads:
            # Workers x threads must stay within the cores whatever the worker count becomes.
            # Forked workers keep their one thread (see worker.py).
            for w in active:
                if not w.proc.forked:
                    self._send_control(w, ("threads", threads))
        self.threads = threads
        self.target = n
        for _ in range(n - len(active)):
            self.start_one()
        if n < len(active):
            # Retire the highest ids, so that ids stay in [0, n); busy ones finish first.
            victims = sorted(active, key=lambda w: -w.slot)[: len(active) - n]
            for w in victims:
                w.retiring = True
                if w.task is None:
                    self._stop(w)

    def counts(self) -> set[int]:
        """The ``num_workers`` values the serving workers were started with."""
        return {w.count for w in list(self.workers.values()) if not w.retiring}

    def renew(self, n: int) -> None:
        """Replace every worker by ``n`` new ones (ids ``0 .. n-1``): a busy one finishes the
        task it holds, then stops, and none serves again (:meth:`resize` would keep those that
        fit). For an iterable dataset whose ``worker_init_fn`` shards it by
        ``get_worker_info().num_workers`` (the torch documentation's example): a worker that
        ran it for another count holds another share, and a new one runs it on the dataset as
        the zygote holds it (or as sent: ``persistent_workers=False``)."""
        for w in list(self.workers.values()):
            w.stale = True
            if not w.retiring:
                w.retiring = True
                if w.task is None:
                    self._stop(w)
        self.resize(n)

    def kill_busy_after(self, grace_s: float) -> None:
        """A worker busy now is SIGKILLed by the collector if it is still there ``grace_s``
        seconds from now (``ProcessExecutor.stop_all``); its end is no death (``info``
        ``"stopped"``)."""
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.task is not None:
                w.info["stopped"] = grace_s
                w.proc.stop_deadline = now + grace_s

    def wait_ended(self, timeout_s: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until every worker process this pool started has ended and its fork server
        reaped it (``Pipeline.park``: as the DataLoader's shutdown joins its workers), up to
        ``timeout_s`` seconds or until ``stop()``; whether all had."""
        deadline = time.monotonic() + timeout_s
        while self._children:
            if stop() or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def start_one(self) -> ProcWorker:
        """Ask the zygote for one more worker; returns at once (see the class docstring)."""
        wid = next(self._ids)
        parent, child = mp.Pipe(duplex=True)  # a socket pair: the worker's line to us
        # Before any other thread uses ``parent`` (see shm.fd_socket)
        w = ProcWorker(wid, _Child(None), parent, fd_sock=fd_socket(parent.fileno()))
        w.proc.starting = True
        with self._lock:
            taken = {v.slot for v in self.workers.values() if not v.retiring}
            while w.slot in taken:
                w.slot += 1
            self.workers[wid] = w
            self._children[wid] = w
        try:
            try:
                for attempt in range(2):
                    z = w.proc.zygote = self._zygote_for_start()
                    try:
                        z.request(wid, child.fileno(), 1 if z.forked else self.threads)
                        break
                    except OSError:
                        z.broken = True  # it died; its end of file is handled by the collector
                        if attempt:
                            raise
            finally:
                child.close()  # before the first message: a worker that never starts ends it
            try:
                w.count = max(self.target, w.slot + 1)
                parent.send(("init", w.slot, w.count, self.dataset))
            except OSError:
                pass  # it did not start: the zygote reports that
        except (OSError, ValueError) as e:
            self._start_failed(w, e)
        finally:
            w.proc.starting = False
        self._wake()
        return w

    def _start_failed(self, w: ProcWorker, e: BaseException) -> None:
        log.warning("could not start transform worker %d: %s", w.wid, describe(e))
        with self._lock:
            self._children.pop(w.wid, None)
            self.workers.pop(w.wid, None)
            self.dead[w.wid] = w
        w.proc.exited.set()
        if isinstance(e, ValueError):  # the spec cannot be pickled: say so in the training loop
            self.post(("proc", w.wid, ("fatal", ErrorReport.capture(e, -1, None, f"worker {w.wid}"))))
        self.post(("died", w.wid, None))

    def send_dataset(self, payload: bytes) -> None:
        """Replace the dataset of every worker, and of those started later, by ``payload``
        (the dataset cloudpickled): ``persistent_workers=False``. An idle worker gets it now;
        one that is busy or not ready yet, before its next task: a worker reads its socket
        only between messages, and sending it a pickle larger than the socket's buffer would
        block the scheduler thread until then (a straggler of an abandoned epoch, a hung
        sample: the whole pipeline stalled with it, sample_timeout unchecked)."""
        self.dataset = payload
        for w in list(self.workers.values()):
            w.dataset_due = True
            if w.ready and w.task is None:
                self._send_due(w)

    def _send_heap(self, w: ProcWorker) -> None:
        if w.heap_sent != self.heap_keep:
            w.heap_sent = self.heap_keep
            self._send_control(w, ("heap", self.heap_keep, self.heap_whole))

    def _send_due(self, w: ProcWorker) -> None:
        self._send_heap(w)
        if w.dataset_due:
            w.dataset_due = False
            self._send_control(w, ("dataset", self.dataset))

    def set_heap_keep(self, keep: int) -> None:
        """Let every worker keep up to ``keep`` bytes of free heap warm between samples
        (``worker.HeapTrim.set_keep``): an idle worker is told now, a busy one (or one not
        ready yet) as soon as it is idle again (:meth:`task_done`) or right before its next
        task, so that a worker stuck on a sample gets no pile of messages while the keep
        moves (a socket's buffer holds a few hundred)."""
        self.heap_keep = max(0, int(keep))
        for w in list(self.workers.values()):
            if w.ready and w.task is None:
                self._send_heap(w)

    def broadcast(self, msg: tuple) -> None:
        """Send ``msg`` to every worker (served after the message each is on)."""
        for w in list(self.workers.values()):
            self._send_control(w, msg)

    def idle(self) -> list[ProcWorker]:
        return [w for w in list(self.workers.values()) if w.ready and w.task is None and not w.retiring]

    def send(self, w: ProcWorker, task: Any, msg: tuple) -> None:
        self._send_due(w)  # idle now: it reads the dataset at once
        w.task = task
        w.task_started = time.monotonic()
        try:
            w.send(msg)
        except (BrokenPipeError, OSError):
            pass  # its death is reported by the collector; the task is re-dispatched then

    def _send_control(self, w: ProcWorker, msg: tuple) -> None:
        try:
            w.send(msg)
        except (BrokenPipeError, OSError):
            pass  # a dead worker: the collector reports it

    def task_done(self, w: ProcWorker) -> None:
        w.task = None
        if w.retiring:
            self._stop(w)
        elif w.ready:
            self._send_heap(w)  # (a keep that moved while it was busy)

    def _stop(self, w: ProcWorker) -> None:
        # Forgotten before it is told to end: the collector thread may see it exit before this
        # thread runs again (a GIL switch is 5 ms), and a worker still listed was a death,
        # "died (exit code 0); replacing it" (trial 84, lowering the worker count).
        with self._lock:
            self.workers.pop(w.wid, None)
        w.proc.stop_deadline = time.monotonic() + 5.0  # then the collector SIGKILLs it
        try:
            w.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._wake()
        w.close_conn()

    def kill(self, w: ProcWorker) -> None:
        """SIGKILL ``w`` (a hung worker); its death is then handled like any other."""
        w.proc.kill()

    def remove_dead(self, wid: int) -> ProcWorker | None:
        """Forget a worker whose death was posted; returns it (with the task it held)."""
        with self._lock:
            w = self.dead.pop(wid, None)
        if w is not None:
            w.close_conn()
        return w

    def pids(self) -> list[int]:
        return [w.pid for w in list(self.workers.values()) if w.pid is not None]

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True  # no more events
        deadline = time.monotonic() + timeout
        for w in list(self.workers.values()):
            try:
                w.send(None)
            except (BrokenPipeError, OSError):
                pass
        # Idle workers exit at once; one busy on a long sample would finish it first: do not
        # wait for that (the zygote SIGKILLs what is left when its socket closes).
        soft = min(deadline, time.monotonic() + 0.5)
        for w in list(self._children.values()):
            w.proc.join(max(0.0, soft - time.monotonic()))
        self._stop_collector = True
        self._wake()
        if self._collector is not None:
            self._collector.join(timeout=2.0)
        for z in self._zygotes:
            if z.exitcode is None:
                z.close(max(0.1, deadline - time.monotonic()))
        for w in list(self._children.values()):
            z = w.proc.zygote
            if not (z is not None and z.ended_workers) and not w.proc.eof:
                w.proc.kill()  # its zygote died earlier (an orphan) or had to be killed
        with self._lock:
            ws = list(self._children.values()) + list(self.workers.values()) + list(self.dead.values())
            self._children.clear()
            self.workers.clear()
        for w in ws:
            w.close_conn()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"w")
        except OSError:
            pass

    # -- collector thread ----------------------------------------------------------------
    def _collect(self) -> None:
        while not self._stop_collector:
            with self._lock:
                conns = {w.conn: w for w in self._children.values()
                         if not w.proc.eof and not w.conn.closed and not w.proc.starting}
                ctrls = {z.ctrl: z for z in self._zygotes if not z.gone}
            try:
                ready = wait([self._wake_r, *conns, *ctrls], timeout=0.5)
            except (OSError, ValueError):
                continue  # a connection closed under us; rebuild the list
            for r in ready:
                if r is self._wake_r:
                    try:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                    except (EOFError, OSError):
                        return
                elif r in ctrls:
                    self._from_zygote(ctrls[r])
                else:
                    w = conns[r]
                    z = w.proc.zygote
                    if self._drain(w) and (z is None or z.gone):
                        if z is not None and w.pid is None:
                            self._post_fatal(w, z)  # a worker that was starting when it died
                        self._ended(w, None)  # no zygote will report its exit
            now = time.monotonic()
            for w in list(self._children.values()):
                if w.proc.stop_deadline is not None and now > w.proc.stop_deadline:
                    w.proc.stop_deadline = None
                    w.proc.kill()  # asked to stop 5 s ago and still there

    def _drain(self, w: ProcWorker) -> bool:
        """Post the replies waiting from ``w``; True when its connection reached its end."""
        try:
            while w.conn.poll():
                reply = w.conn.recv()
                if reply[0] == "claim":  # ("claim", key, signature): answered here, at once
                    w.send(self._answer_claim(reply[1], reply[2]))
                    continue
                if reply[0] == "many":
                    try:
                        _receive_fds(w.fd_sock, reply[1])
                    except (EOFError, OSError):
                        # its files did not all arrive (it died, or this process is out of
                        # descriptors): end it, so that its tasks come back as a death's do
                        # instead of waiting for a worker that no one reads any more
                        w.proc.kill()
                        raise
                if reply[0] == "ready" and w.pid is None:
                    w.pid = w.proc.pid = reply[1]
                self.post(("proc", w.wid, reply))
        except (EOFError, OSError):
            w.proc.eof = True
        return w.proc.eof

    def _answer_claim(self, key: tuple, sig: tuple) -> tuple:
        """The answer to a worker's claim of a batch row (see ``on_claim``); ``("norow",)``
        when there is no handler or it failed (the worker then sends its sample without one:
        an error here must neither pass for the worker's end nor stop this thread)."""
        claim = self.on_claim
        if claim is None:
            return ("norow",)
        try:
            return claim(key, sig)
        except Exception as e:  # noqa: BLE001 - logged; the sample travels another way
            log.warning("could not give a batch row to a sample (%s); it travels without one",
                        describe(e))
            return ("norow",)

    def _from_zygote(self, z: Zygote) -> None:
        for msg in z.receive():
            kind = msg[0]
            if kind == "fatal":
                z.fatal = msg[1]
                continue
            w = self._children.get(msg[1])
            if w is None:
                continue
            if kind == "started":
                w.proc.started = True
                w.proc.pid = msg[2]
                if w.pid is None:
                    w.pid = msg[2]
            elif kind == "exit":
                self._ended(w, msg[2])
            elif kind == "failed":
                log.warning("could not start transform worker %d: %s", w.wid, msg[2])
                self._ended(w, None)
        if not z.gone:
            return
        code = z.reap(2.0)
        if not self._closing:
            log.warning("the transform workers' fork server (pid %s) ended (%s); later workers "
                        "start from a new one", z.pid, _how(code))
        for w in [w for w in list(self._children.values())
                  if w.proc.zygote is z and not w.proc.starting]:
            if w.pid is not None and not self._drain(w):
                continue  # running: an orphan now, whose end shows as its connection's end
            if w.pid is None:
                self._post_fatal(w, z)
            # a nested zygote's exit status is not known here (it is not this process's child)
            self._ended(w, None if w.pid is not None or z.kind == "nested" else code)

    def _post_fatal(self, w: ProcWorker, z: Zygote) -> None:
        """Why ``w`` could not start, when its zygote said (once per zygote)."""
        if z.fatal is not None and not z.fatal_posted:
            z.fatal_posted = True
            self.post(("proc", w.wid, ("fatal", z.fatal)))

    def _ended(self, w: ProcWorker, exitcode: int | None) -> None:
        """``w``'s process is gone: post its death unless it was stopped on purpose."""
        if w.wid not in self._children:
            return
        if not w.proc.eof and not w.conn.closed:
            self._drain(w)  # a reply sent just before dying still counts
        with self._lock:
            self._children.pop(w.wid, None)
            unexpected = self.workers.pop(w.wid, None) is not None
            if unexpected:
                self.dead[w.wid] = w
        w.proc.exitcode = exitcode
        w.proc.exited.set()
        if unexpected and not self._closing:
            self.post(("died", w.wid, exitcode))


def _receive_fds(sock: Any, replies: list) -> None:
    """Map the memory files of ``replies`` (:class:`~autominato.pipeline.shm.FdDesc`), which
    their worker sent right after the message that carried them, on ``sock`` (the
    connection's :func:`~autominato.pipeline.shm.fd_socket`), at most
    :data:`~autominato.pipeline.shm.SCM_MAX_FD` in each message.

    Raises:
        EOFError: the worker died before sending them all (its tasks are then re-sent as a
            death's are). Every descriptor received is closed, mapped or not.
    """
    subs = [r for r in replies if r[0] == "ok" and type(r[2]) is FdDesc]
    if not subs:
        return
    fds: list[int] = []
    try:
        while len(fds) < len(subs):
            want = min(SCM_MAX_FD, len(subs) - len(fds))
            msg, got, _, _ = socket.recv_fds(sock, 1, want)
            fds.extend(got)
            if not msg or len(got) < want:
                raise EOFError("a worker ended before sending its results' memory files")
        for i, (r, fd) in enumerate(zip(subs, fds, strict=True)):
            fds[i] = -1  # map_memfd closes it
            map_memfd(r[2], fd, r[3])
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {-exitcode}"
    return f"exit code {exitcode}"
