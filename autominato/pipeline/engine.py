"""The scheduler: one thread that owns every sample's state between sampler and batch.

It dispatches positions of the epoch's order to the read and transform stages, receives
their results as events, assembles batches in completion order (or in sampler order with
``in_order``) and hands them to the batch thread, which collates them into pooled buffers,
starts the host-to-device copy and queues the batch for the training loop.

Exactly-once: a position of the epoch is *final* once it has been handed to the batch
thread or dropped by the ``skip`` error policy. A position is dispatched again only when the
worker that held it died before replying (its result can therefore never arrive); a reply
for a position that is already final, or of an earlier epoch, is discarded. Knob changes only
move limits, so they never touch a position in flight.

Positions, not indices, are the unit: a sampler may repeat an index.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autominato.pipeline.collate import BatchPool, batch_nbytes, collate, to_device
from autominato.pipeline.errors import ErrorReport, SampleTimeout, WorkerDied, describe
from autominato.pipeline.executor import ProcessWorkers, ThreadWorkers
from autominato.pipeline.shm import (
    SHM_DIR,
    SlotPool,
    is_array,
    leftover_segments,
    pack,
    packed_nbytes,
    unpack,
)
from autominato.pipeline.stats import StageStats
from autominato.pipeline.tree import map_leaves
from autominato.pipeline.worker import WorkSpec, run_sample, sample_path

log = logging.getLogger("autominato.pipeline")


@dataclass
class Rec:
    """State of one position of the current epoch."""

    pos: int
    index: int
    t_ready: float = 0.0  # when it became ready for the transform stage
    in_slot: Any = None
    in_desc: Any = None  # packed input (process transform) or the read sample (threads)
    out_slot: Any = None
    worker: Any = None  # "read", "thread", a ProcWorker, or None when no one holds it
    t_sent: float = 0.0  # when it was sent to a transform worker


class OutQueue:
    """Finished batches for the training loop; capacity is the live ``depth`` knob."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque = deque()
        self._cv = threading.Condition()
        self.closed = False

    def put(self, item: Any, stop: Callable[[], bool]) -> bool:
        with self._cv:
            while len(self._items) >= self.capacity and not stop() and not self.closed:
                self._cv.wait(0.1)
            if self.closed or stop():
                return False
            self._items.append(item)
            self._cv.notify_all()
            return True

    def put_now(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def get(self, timeout: float) -> Any:
        with self._cv:
            if not self._items:
                self._cv.wait(timeout)
            if not self._items:
                raise queue.Empty
            item = self._items.popleft()
            self._cv.notify_all()
            return item

    def set_capacity(self, n: int) -> None:
        with self._cv:
            self.capacity = n
            self._cv.notify_all()

    def clear(self) -> list:
        with self._cv:
            items = list(self._items)
            self._items.clear()
            self._cv.notify_all()
            return items

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


class Engine:
    """Owns workers, threads, pools and the scheduler thread of one :class:`Loader`."""

    def __init__(self, loader: Any, payload: bytes, spec: WorkSpec) -> None:
        self.L = loader
        self.spec = spec
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stats: dict[str, StageStats] = loader.stage_stats
        k = loader.knobs
        self.mode = loader._mode  # "inline" | "thread" | "fused" | "split"
        self.batch_size = loader.batch_size
        self.slots = SlotPool(max_slots=2 * k.pool_size, budget_bytes=loader._shm_budget)
        self.batch_pool = BatchPool(max_per_key=k.depth + 3, pin=loader._pin)
        self.out = OutQueue(k.depth)
        self.batch_q: queue.SimpleQueue = queue.SimpleQueue()
        self.reads = ThreadWorkers("read", self._read_task, self.events.put)
        self.threads: ThreadWorkers | None = None
        self.procs: ProcessWorkers | None = None
        if self.mode == "thread":
            self.threads = ThreadWorkers("transform", self._thread_transform_task, self.events.put)
        if self.mode in ("fused", "split"):
            try:
                self.procs = ProcessWorkers(spec, self.events.put, loader._start_method, initial=k.workers)
            except BaseException:  # ValueError: the spec must be pickled and cannot be
                self.slots.close()
                raise
        self.out_estimate = 0  # bytes of one transformed sample, learned from replies
        self.sample_bytes = 0.0
        self.worker_restarts = 0
        self.stragglers = 0
        self.skipped = 0
        self._skip_logged: set[int] = set()  # indices skipped (and warned about) so far
        self._startup_deaths = 0  # workers in a row that died before they were ready
        self._stop = threading.Event()
        self._fatal: BaseException | None = None
        self.gen = 0
        self._epoch_state: dict | None = None
        self._orphans: dict[tuple, Rec] = {}
        self._qlen = {"read": 0, "transform": 0, "batch": 0}
        self._apply_knobs()
        self._wire_stats()
        self.thread = threading.Thread(target=self._run, name="autominato-scheduler", daemon=True)
        self.batch_thread = threading.Thread(target=self._batch_loop, name="autominato-batch", daemon=True)
        self.thread.start()
        self.batch_thread.start()
        _live.add(self)
        _install_termination_cleanup()

    # ------------------------------------------------------------------ stats wiring
    def _wire_stats(self) -> None:
        s = self.stats
        s["read"].queue_capacity = lambda: self.L.knobs.pool_size
        s["read"].workers = lambda: self.reads.size if self.mode != "fused" else 0
        s["transform"].queue_capacity = lambda: self.L.knobs.pool_size
        s["transform"].workers = lambda: (
            self.procs.size if self.procs else self.threads.size if self.threads else self.reads.size
        )
        s["batch"].queue_capacity = lambda: self.L.knobs.pool_size
        s["batch"].workers = lambda: 1
        for name in ("read", "transform", "batch"):
            s[name].queue_len = lambda name=name: self._qlen[name]
        s["transfer"].queue_capacity = lambda: self.out.capacity
        s["transfer"].queue_len = lambda: len(self.out)
        s["transfer"].workers = lambda: 1

    # ------------------------------------------------------------------ public (any thread)
    def start_epoch(self, order: list[int], epoch: int) -> int:
        self.gen += 1
        self.events.put(("epoch", self.gen, order, epoch))
        return self.gen

    def stop_epoch(self, gen: int) -> None:
        self.events.put(("stop_epoch", gen))

    def knobs_changed(self) -> None:
        self.events.put(("knobs",))

    def fatal(self) -> BaseException | None:
        return self._fatal

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.events.put(("close",))
        self.out.close()
        self.thread.join(timeout=10)
        self.batch_q.put(("close",))
        self.batch_thread.join(timeout=10)
        self.reads.close()
        if self.threads:
            self.threads.close()
        if self.procs:
            self.procs.close()
        self.out.clear()
        self.batch_pool.clear()
        self.slots.close()

    def worker_pids(self) -> list[int]:
        return self.procs.pids() if self.procs else []

    def kill_workers(self) -> None:
        """SIGKILL every worker process at once, taking no lock (for a dying main process)."""
        if self.procs is not None:
            for w in list(self.procs.workers.values()):
                self.procs.kill(w)

    # ------------------------------------------------------------------ scheduler thread
    def _apply_knobs(self) -> None:
        k = self.L.knobs
        if self.mode != "fused":
            self.reads.resize(k.read_threads)
        if self.threads:
            self.threads.resize(k.workers)
        if self.procs:
            self.procs.resize(k.workers)
        self.slots.set_max_slots(2 * k.pool_size)
        self.out.set_capacity(k.depth)
        self.batch_pool.max_per_key = k.depth + 3

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ev = self.events.get(timeout=0.05)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    if ev[0] == "close":
                        return
                    self._handle(ev)
                    # Handle everything already queued before dispatching again.
                    while True:
                        try:
                            ev = self.events.get_nowait()
                        except queue.Empty:
                            break
                        if ev[0] == "close":
                            return
                        self._handle(ev)
                self._check_timeouts()
                self._dispatch()
        except BaseException as e:  # a bug here must surface in the training loop, not hang it
            log.exception("autominato scheduler failed")
            self._fatal = e
            self.out.put_now(("error", self.gen, e))

    # epoch bookkeeping ---------------------------------------------------------
    def _handle(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "epoch":
            self._begin(ev[1], ev[2], ev[3])
        elif kind == "stop_epoch":
            if self._epoch_state is not None and self._epoch_state["gen"] == ev[1]:
                self._abort()
        elif kind == "knobs":
            self._apply_knobs()
        elif kind == "proc":
            self._on_proc(ev[1], ev[2])
        elif kind == "died":
            self._on_died(ev[1], ev[2])
        elif kind in ("read_ok", "read_err", "thr_ok", "thr_err"):
            self._on_thread_event(ev)
        elif kind == "batched":
            st = self._epoch_state
            if st is not None and st["gen"] == ev[1]:
                st["window"] -= ev[2]

    def _begin(self, gen: int, order: list[int], epoch: int) -> None:
        if self._epoch_state is not None:
            self._abort()
        if self.procs is not None and self.procs.size < self.L.knobs.workers:
            self._startup_deaths = 0  # workers that could not start get a new chance
            self.procs.resize(self.L.knobs.workers)
        n = len(order)
        self._epoch_state = {
            "gen": gen,
            "epoch": epoch,
            "order": order,
            "cursor": 0,
            "redo": deque(),
            "tries": {},
            "recs": {},  # pos -> Rec for positions in flight (not final)
            "ready": deque(),  # recs read and waiting for a transform worker
            "done": [],  # (rec, sample) completed, not yet batched (completion order)
            "done_by_pos": {},  # in_order: pos -> (rec, sample)
            "next_pos": 0,  # in_order: first position of the next batch
            "remaining": n,  # positions not final
            "window": 0,  # positions dispatched and not yet collated
            "batches": 0,
        }
        if n == 0:
            self.batch_q.put(("end", gen, epoch))
            self._epoch_state = None

    def _abort(self) -> None:
        st = self._epoch_state
        self._epoch_state = None
        if st is None:
            return
        for rec in st["recs"].values():
            if rec.worker is None:  # not held by a worker: its slots are ours to free
                self.slots.release(rec.in_slot)
                self.slots.release(rec.out_slot)
            elif not isinstance(rec.worker, str):
                # A worker process still writes into its slots: free them when it replies.
                self._orphans[(st["gen"], rec.pos)] = rec
        for rec, _ in st["done"]:
            self.slots.release(rec.out_slot)
        for rec, _ in st["done_by_pos"].values():
            self.slots.release(rec.out_slot)

    def _next_position(self, st: dict) -> int | None:
        if st["redo"]:
            return st["redo"].popleft()
        if st["cursor"] < len(st["order"]):
            st["cursor"] += 1
            return st["cursor"] - 1
        return None

    def _dispatch(self) -> None:
        st = self._epoch_state
        if st is None:
            return
        k = self.L.knobs
        gen = st["gen"]
        # Transform stage first: samples already read should not wait behind new reads.
        if self.mode == "split":
            idle = self.procs.idle()
            while st["ready"] and idle:
                self._send_proc(st, st["ready"].popleft(), idle.pop())
        elif self.mode == "thread":
            while st["ready"] and self.threads.capacity() > 0:
                rec = st["ready"].popleft()
                rec.worker = "thread"
                self.threads.submit((gen, rec.pos, rec.index, st["epoch"], rec.in_desc, rec.t_ready))
        # New positions, within the window (pool_size) and the stage's free workers.
        while st["window"] < max(k.pool_size, 1):
            if self.mode == "fused":
                idle = self.procs.idle()
                if not idle:
                    break
            elif self.reads.capacity() <= 0:
                break
            elif self.mode in ("split", "thread") and len(st["ready"]) >= max(k.read_threads, 1) + k.workers:
                break  # read far enough ahead of the transform stage
            pos = self._next_position(st)
            if pos is None:
                break
            rec = st["recs"].get(pos) or Rec(pos, st["order"][pos])
            st["recs"][pos] = rec
            st["window"] += 1
            if self.mode == "fused":
                self._send_proc(st, rec, idle.pop())
            elif rec.in_desc is not None or rec.in_slot is not None:
                rec.t_ready = time.monotonic()
                st["ready"].append(rec)  # re-dispatch after a worker died: already read
            else:
                rec.worker = "read"
                self.reads.submit((gen, pos, rec.index, st["epoch"], time.monotonic()))
        self._qlen["read"] = self.reads.in_flight if self.mode != "fused" else 0
        self._qlen["transform"] = len(st["ready"])
        self._qlen["batch"] = len(st["done"]) + len(st["done_by_pos"])
        # Workers holding a sample now (the controller reads these as in-flight work).
        reading = self.reads.in_flight if self.mode != "fused" else 0
        self.stats["read"].busy = reading
        if self.procs is not None:
            self.stats["transform"].busy = sum(1 for w in self.procs.workers.values() if w.task is not None)
        else:
            self.stats["transform"].busy = self.threads.in_flight if self.threads else reading

    def _send_proc(self, st: dict, rec: Rec, w: Any) -> None:
        if rec.out_slot is None and self.out_estimate:
            rec.out_slot = self.slots.acquire(self.out_estimate)
        out = (rec.out_slot.name, rec.out_slot.size) if rec.out_slot is not None else None
        inp = (rec.in_slot.name, rec.in_slot.size) if rec.in_slot is not None else None
        read = self.mode == "fused"
        rec.worker = w
        rec.t_sent = time.monotonic()
        self.procs.send(w, (st["gen"], rec.pos), ((st["gen"], rec.pos), rec.index, st["epoch"], read, inp, rec.in_desc, out))

    # results ------------------------------------------------------------------
    def _current(self, gen: int, pos: int) -> tuple[dict, Rec] | None:
        st = self._epoch_state
        if st is None or st["gen"] != gen:
            return None
        rec = st["recs"].get(pos)
        return (st, rec) if rec is not None else None

    def _on_proc(self, wid: int, reply: tuple) -> None:
        w = self.procs.workers.get(wid) or self.procs.dead.get(wid)
        if reply[0] == "ready":
            if w is not None:
                w.ready = True
            self._startup_deaths = 0
            return
        if reply[0] == "fatal":
            self._fail(reply[1].to_exception())
            return
        (gen, pos) = reply[1]
        if w is not None and w.task == (gen, pos):
            self.procs.task_done(w)
        cur = self._current(gen, pos)
        if cur is None:
            self._release_orphan((gen, pos))
            return
        st, rec = cur
        rec.worker = None
        if reply[0] == "ok":
            _, _, desc, need, read_s, transform_s, pack_s = reply
            if need > (rec.out_slot.size if rec.out_slot is not None else 0):
                self.out_estimate = max(self.out_estimate, int(need * 1.05))
                self.slots.release(rec.out_slot)
                rec.out_slot = None
            sample = unpack(desc, rec.out_slot.mmap if rec.out_slot is not None else None)
            self.slots.release(rec.in_slot)
            rec.in_slot = rec.in_desc = None
            wait = rec.t_sent - rec.t_ready if self.mode == "split" else 0.0
            if self.mode == "fused":
                self.stats["read"].record(read_s, 0.0, 0)
            self.stats["transform"].record(transform_s + pack_s, max(0.0, wait), need)
            self.sample_bytes += (need - self.sample_bytes) * 0.1 if self.sample_bytes else need
            self._completed(st, rec, sample)
        else:
            self.slots.release(rec.out_slot)
            self.slots.release(rec.in_slot)
            rec.out_slot = rec.in_slot = rec.in_desc = None
            self._sample_failed(st, rec, reply[2])

    def _release_orphan(self, key: tuple) -> None:
        # The reply (or death) of a task whose epoch was aborted: free the slots it held.
        rec = self._orphans.pop(key, None)
        if rec is not None:
            self.slots.release(rec.in_slot)
            self.slots.release(rec.out_slot)

    def _on_died(self, wid: int, exitcode: int | None) -> None:
        w = self.procs.remove_dead(wid)
        if w is None:
            return
        timed_out = w.info.get("timed_out", False)
        self.worker_restarts += 1
        sig = -exitcode if exitcode is not None and exitcode < 0 else None
        how = f"signal {sig}" if sig else f"exit code {exitcode}"
        if not w.ready:
            # Dying before it is ready is no sample's fault (the dataset or transform cannot be
            # unpickled or imported there, or memory is short): replacing such workers forever
            # would hang the training loop with no error.
            self._startup_deaths += 1
            if self._startup_deaths >= self.L.max_tries:
                if self._startup_deaths == self.L.max_tries:
                    log.warning("transform worker %d (pid %s) died (%s) before it was ready",
                                wid, w.pid, how)
                    self._fail(WorkerDied(
                        f"{self._startup_deaths} transform worker processes in a row died before "
                        f"they were ready (the last: worker {wid}, pid {w.pid}, {how}). Workers "
                        f"start with {self.L._start_method!r}, which re-imports your main module: "
                        "a script that builds the Loader at top level needs an "
                        "`if __name__ == \"__main__\":` guard (or pass start_method=\"fork\" "
                        "before any thread starts, or worker_kind=\"thread\"). Otherwise the "
                        "dataset or transform cannot be set up in a worker process (it is "
                        "unpickled there; check its imports and __setstate__), or memory is short",
                        worker=f"worker {wid} (process {w.pid})"))
                return
        log.warning("transform worker %d (pid %s) died (%s)%s", wid, w.pid, how,
                    "; replacing it" if not self.L.on_worker_death == "raise" else "")
        held = w.task
        if self.procs.size < self.L.knobs.workers and not self._stop.is_set():
            self.procs.start_one()
        if held is None:
            return
        gen, pos = held
        cur = self._current(gen, pos)
        if cur is None:
            self._release_orphan((gen, pos))
            return
        st, rec = cur
        rec.worker = None
        if timed_out:
            exc = SampleTimeout(
                f"sample index {rec.index} ({sample_path(self.spec.dataset, rec.index) or 'no file'}) "
                f"took longer than timeout={self.L.timeout} s in worker {wid} (pid {w.pid}); "
                "the worker was replaced",
                sample_index=rec.index, sample_path=sample_path(self.spec.dataset, rec.index),
                worker=f"worker {wid} (process {w.pid})",
            )
            self._policy(st, rec, exc)
            return
        tries = st["tries"][pos] = st["tries"].get(pos, 0) + 1
        path = sample_path(self.spec.dataset, rec.index)
        if self.L.on_worker_death == "raise" or tries >= self.L.max_tries:
            why = (f"worker {wid} (pid {w.pid}) died ({how}) while holding sample index {rec.index}"
                   + (f" (file {path})" if path else ""))
            if tries >= self.L.max_tries and self.L.on_worker_death != "raise":
                why += f"; it killed {tries} workers, so it is not retried"
            exc = WorkerDied(why, sample_index=rec.index, sample_path=path,
                             worker=f"worker {wid} (process {w.pid})")
            if self.L.on_worker_death == "raise":
                self._fail(exc)
            else:
                self._policy(st, rec, exc)
            return
        st["window"] -= 1
        st["redo"].appendleft(pos)

    def _check_timeouts(self) -> None:
        if self.L.timeout is None:
            return
        if self.procs is not None:
            now = time.monotonic()
            for w in list(self.procs.workers.values()):
                if w.task is not None and not w.info.get("timed_out") and now - w.task_started > self.L.timeout:
                    w.info["timed_out"] = True
                    self.procs.kill(w)  # the death event then applies the error policy
        for pool in (self.reads, self.threads):
            if pool is None:
                continue
            for task in pool.overdue(self.L.timeout):
                if pool.abandon(task):
                    self._thread_timed_out(pool, task)

    def _thread_timed_out(self, pool: ThreadWorkers, task: tuple) -> None:
        gen, pos = task[0], task[1]
        self.worker_restarts += 1
        cur = self._current(gen, pos)
        if cur is None:
            return
        st, rec = cur
        rec.worker = None
        self.slots.release(rec.in_slot)
        rec.in_slot = rec.in_desc = None
        path = sample_path(self.spec.dataset, rec.index)
        log.warning("a %s thread is stuck on sample index %d for over timeout=%s s; a thread cannot "
                    "be killed, so it is abandoned and a new one takes its place", pool.name,
                    rec.index, self.L.timeout)
        exc = SampleTimeout(
            f"sample index {rec.index} ({path or 'no file'}) took longer than timeout="
            f"{self.L.timeout} s in a {pool.name} thread; the thread was abandoned and replaced",
            sample_index=rec.index, sample_path=path, worker=f"{pool.name} thread",
        )
        self._policy(st, rec, exc)

    def _on_thread_event(self, ev: tuple) -> None:
        kind, gen, pos = ev[0], ev[1], ev[2]
        cur = self._current(gen, pos)
        if cur is None:
            if kind == "read_ok":
                self.slots.release(ev[3])
            return
        st, rec = cur
        rec.worker = None
        if kind == "read_ok":
            _, _, _, slot, payload, read_s, wait_s, nbytes, transform_s = ev
            self.stats["read"].record(read_s, wait_s, nbytes)
            if self.mode == "inline":
                self.stats["transform"].record(transform_s, 0.0, nbytes)
                self._completed(st, rec, payload)
                return
            rec.in_slot, rec.in_desc = slot, payload
            rec.t_ready = time.monotonic()
            st["ready"].append(rec)
        elif kind == "thr_ok":
            _, _, _, sample, transform_s, wait_s, nbytes = ev
            rec.in_desc = None
            self.stats["transform"].record(transform_s, wait_s, nbytes)
            self._completed(st, rec, sample)
        else:
            self.slots.release(rec.in_slot)
            rec.in_slot = rec.in_desc = None
            self._sample_failed(st, rec, ev[3])

    # thread task bodies (run on pool threads; return an event) -------------------
    def _read_task(self, task: tuple) -> tuple:
        gen, pos, index, epoch, t_submit = task
        t_start = time.monotonic()
        try:
            if self.mode == "inline":
                sample, read_s, transform_s = run_sample(self.spec, index, epoch, read=True)
                return ("read_ok", gen, pos, None, sample, read_s, t_start - t_submit, packed_nbytes(sample), transform_s)
            sample, read_s, _ = run_sample(
                WorkSpec(self.spec.dataset, None, False, self.spec.seed), index, epoch, read=True
            )
            nbytes = packed_nbytes(sample)
            if self.mode == "thread":
                return ("read_ok", gen, pos, None, sample, read_s, t_start - t_submit, nbytes, 0.0)
            slot = self.slots.acquire(nbytes)  # None (pickle through the pipe) or big enough
            desc, _ = pack(sample, slot.mmap if slot is not None else None)
            return ("read_ok", gen, pos, slot, desc, read_s, t_start - t_submit, nbytes, 0.0)
        except BaseException as e:  # noqa: BLE001
            import threading as _t

            report = ErrorReport.capture(e, index, sample_path(self.spec.dataset, index), f"thread {_t.current_thread().name}")
            report.original = e
            return ("read_err", gen, pos, report)

    def _thread_transform_task(self, task: tuple) -> tuple:
        gen, pos, index, epoch, sample, t_ready = task
        t_start = time.monotonic()
        try:
            sample, _, transform_s = run_sample(self.spec, index, epoch, read=False, sample=sample)
            return ("thr_ok", gen, pos, sample, transform_s, t_start - t_ready, packed_nbytes(sample))
        except BaseException as e:  # noqa: BLE001
            report = ErrorReport.capture(e, index, sample_path(self.spec.dataset, index), f"thread {threading.current_thread().name}")
            report.original = e
            return ("thr_err", gen, pos, report)

    # completion, errors, batching --------------------------------------------------
    def _completed(self, st: dict, rec: Rec, sample: Any) -> None:
        del st["recs"][rec.pos]
        if self.L.in_order:
            st["done_by_pos"][rec.pos] = (rec, sample)
        else:
            st["done"].append((rec, sample))
        self._emit_batches(st)

    def _sample_failed(self, st: dict, rec: Rec, report: ErrorReport) -> None:
        self._policy(st, rec, report.to_exception(), report)

    def _policy(self, st: dict, rec: Rec, exc: BaseException, report: ErrorReport | None = None) -> None:
        if self.L.on_error == "skip":
            st["recs"].pop(rec.pos, None)
            st["window"] -= 1
            st["remaining"] -= 1
            self.skipped += 1
            path = sample_path(self.spec.dataset, rec.index)
            # A corrupt file is skipped every epoch: warn once per sample, count every time.
            level = logging.DEBUG if rec.index in self._skip_logged else logging.WARNING
            self._skip_logged.add(rec.index)
            log.log(level, "skipping sample index %d%s: %s", rec.index,
                    f" (file {path})" if path else "", describe(exc))
            if self.L._on_skip is not None:
                self.L._on_skip(rec.index, path, exc)
            if self.L.in_order:
                st["done_by_pos"][rec.pos] = (rec, _SKIPPED)
            self._emit_batches(st)
        else:
            self._fail(exc, st["gen"])

    def _fail(self, exc: BaseException, gen: int | None = None) -> None:
        g = self.gen if gen is None else gen
        self.batch_q.put(("error", g, exc))
        if self._epoch_state is not None and self._epoch_state["gen"] == g:
            self._abort()

    def _emit_batches(self, st: dict) -> None:
        B = self.batch_size
        gen = st["gen"]
        if self.L.in_order:
            d = st["done_by_pos"]
            n = len(st["order"])
            while True:
                start = st["next_pos"]
                if start >= n:
                    break
                end = min(start + B, n)
                if not all(p in d for p in range(start, end)):
                    break
                group = [d.pop(p) for p in range(start, end)]
                st["next_pos"] = end
                group = [g for g in group if g[1] is not _SKIPPED]
                self._hand_over(st, group)
        else:
            done = st["done"]
            while len(done) >= B:
                group, st["done"] = done[:B], done[B:]
                done = st["done"]
                self._hand_over(st, group)
            if st["remaining"] == len(done) and done:
                st["done"] = []
                self._hand_over(st, done)  # the epoch's last, short batch
        if st["remaining"] == 0:
            self.batch_q.put(("end", gen, st["epoch"]))
            self._epoch_state = None

    def _hand_over(self, st: dict, group: list) -> None:
        if not group:
            return
        k = st["batches"]
        B = self.batch_size
        if not self.L.in_order:
            self.stragglers += sum(1 for rec, _ in group if rec.pos // B < k)
        st["batches"] = k + 1
        st["remaining"] -= len(group)
        self.batch_q.put(("batch", st["gen"], group, time.monotonic()))

    # batch thread ------------------------------------------------------------------
    def _batch_loop(self) -> None:
        import torch

        device = self.L.device
        cuda = device is not None and device.type == "cuda"
        stream = torch.cuda.Stream(device=device) if cuda else None
        while True:
            item = self.batch_q.get()
            if item[0] == "close":
                return
            if item[0] != "batch":
                self.out.put(item, self._stop.is_set)
                continue
            _, gen, group, t_queued = item
            t0 = time.monotonic()
            try:
                samples = [s for _, s in group]
                if self.L.collate_fn is not None:
                    samples = [_copy_arrays(s) for s in samples]
                    for rec, _ in group:
                        self.slots.release(rec.out_slot)
                    batch = self.L.collate_fn(samples)
                else:
                    batch = collate(samples, self.batch_pool)
                    del samples
                    for rec, _ in group:
                        self.slots.release(rec.out_slot)
            except BaseException as e:  # noqa: BLE001
                for rec, _ in group:
                    self.slots.release(rec.out_slot)
                self.events.put(("batched", gen, len(group)))
                self.out.put(("error", gen, e), self._stop.is_set)
                continue
            indices = [rec.index for rec, _ in group]
            del group
            nbytes = batch_nbytes(batch)
            t1 = time.monotonic()
            self.stats["batch"].record(t1 - t0, t0 - t_queued, nbytes)
            self.events.put(("batched", gen, len(indices)))
            h2d = None
            if cuda:
                with torch.cuda.stream(stream):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    host = batch
                    batch = to_device(batch, device)
                    e1.record(stream)
                h2d = (e0, e1, nbytes, host)
            if not self.out.put(("batch", gen, batch, indices, h2d), self._stop.is_set):
                return


# ------------------------------------------------------------------------------------------
# Termination by signal. SIGINT raises KeyboardInterrupt and the loaders close on the way out
# (``with``, ``Loader.close`` or the atexit hook). SIGTERM's default action ends the process
# at once, without atexit, leaving /dev/shm segments (which outlive processes) and workers busy
# on a sample. So, where SIGTERM still has its default action, a handler cleans up first and
# then dies by SIGTERM all the same (the exit status a job scheduler expects).

_live: weakref.WeakSet = weakref.WeakSet()
_installed_in: int | None = None  # pid of the process whose SIGTERM handler is ours


def _install_termination_cleanup() -> None:
    global _installed_in
    if _installed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can be set only from the main thread
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the application handles SIGTERM itself (and its exit path closes loaders)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed_in = os.getpid()


def _on_sigterm(signum: int, frame: Any) -> None:
    # This runs in the main thread between two bytecodes, perhaps while it holds a lock that
    # an orderly close would need: take no lock, join nothing.
    if os.getpid() == _installed_in:  # not in a child forked after installing
        for engine in list(_live):
            try:
                engine.kill_workers()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for name in leftover_segments(os.getpid()):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class _Skipped:
    def __repr__(self) -> str:
        return "<skipped>"


_SKIPPED = _Skipped()


def _copy_arrays(obj: Any) -> Any:
    """Deep-copy the arrays of a sample out of its shared-memory slot."""
    return map_leaves(obj, lambda a: a.copy() if isinstance(a, np.ndarray) else a.clone(), is_array)
