"""The executors behind :class:`~autominato.pipeline.stage.Stage`: threads and processes.

Both implement :class:`~autominato.pipeline.stage.Executor` over the resizable pools of
:mod:`autominato.pipeline.executor` and report every outcome as a
:class:`~autominato.pipeline.stage.Result`. The scheduler thread is the only caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from autominato.pipeline.errors import SampleTimeout, WorkerDied
from autominato.pipeline.executor import ProcessWorkers, ThreadWorkers
from autominato.pipeline.stage import Result

log = logging.getLogger("autominato.pipeline")

#: Seconds of work a worker process is given in one message at most: samples that take less
#: go in chunks of up to the batch size; samples that take this long or longer go one at a time.
CHUNK_BUDGET_S = 0.01


class ThreadExecutor:
    """Threads of this process running ``fn(key, item) -> Result``.

    ``fn`` must not raise (it returns a failed :class:`Result`). A thread stuck past the
    timeout cannot be killed: it is abandoned and replaced, and its late result is still
    posted (the scheduler frees what it holds).
    """

    def __init__(self, name: str, fn: Callable[[Any, Any], Result], post: Callable[[Result], None],
                 size: int, init: Callable[[int], bool] | None = None) -> None:
        self.name = name
        self._post = post
        self._pool = ThreadWorkers(name, lambda task: _guarded(name, fn, *task), post, init)
        self._pool.resize(size)

    def submit(self, key: Any, item: Any) -> None:
        self._pool.submit((key, item))

    def resize(self, n: int) -> None:
        self._pool.resize(n)

    @property
    def size(self) -> int:
        return self._pool.size

    @property
    def busy(self) -> int:
        return self._pool.in_flight

    def free(self) -> int:
        return self._pool.capacity()

    def flush(self) -> None:
        pass  # threads take each item as it is submitted

    def new_pass(self) -> None:
        pass  # a thread whose worker_init_fn failed is started again by resize

    def expire(self, seconds: float) -> None:
        for task in self._pool.overdue(seconds):
            if self._pool.abandon(task):
                key = task[0]
                self._post(Result(self.name, key, ok=False, lost=True, timed_out=True, error=SampleTimeout(
                    f"took longer than sample_timeout={seconds} s in a {self.name} thread; the thread "
                    "was abandoned (a thread cannot be killed) and a new one took its place",
                    worker=f"{self.name} thread")))

    def stop(self) -> None:
        self._pool.close()

    def running(self) -> bool:
        """A thread still runs its function (after :meth:`stop`: one that outlived its wait)."""
        return self._pool.running()


def _guarded(name: str, fn: Callable[[Any, Any], Result], key: Any, item: Any) -> Result:
    # A stage function reports its own errors; one that raises all the same (a bug) must not
    # kill its thread and leave the item's consumer waiting for ever.
    try:
        return fn(key, item)
    except BaseException as e:  # noqa: BLE001
        return Result(name, key, ok=False, error=e)


class ProcessExecutor:
    """Worker processes (:class:`ProcessWorkers`) running :func:`worker.process_main`.

    An item is the task message without its key: ``(index, epoch, draw, read, in_slot,
    in_desc, out_slot)``. Items are sent in *chunks*: up to :attr:`chunk` items per worker in one
    message, answered in one message (the worker sends early every ``worker.FLUSH_S``).
    :attr:`chunk` follows the measured time per item (:data:`CHUNK_BUDGET_S` of work per
    message at most), so that samples that take microseconds cost one pipe round trip per
    chunk instead of one each (the DataLoader's workers likewise get one message per batch),
    while a sample that takes longer than the budget goes alone (a straggler never holds
    others back). When a worker dies or hangs holding several unanswered items, they are sent
    again one per message, so that the guilty one is found and no other is blamed.

    The pool posts raw events (``("proc", wid, reply)``, ``("died", wid, code)``) to the
    scheduler's queue; the scheduler hands them to :meth:`handle`, which turns them into
    :class:`Result` s (``value`` = ``(descriptor, nbytes)``, see :func:`shm.pack`).

    Args:
        name: the stage's name.
        workers: the pool.
        max_chunk: most items in one message (the batch size).
        max_startup_deaths: workers in a row that may die before they are ready; then
            ``on_fatal`` is called (replacing them forever would hang the training loop).
        on_fatal: ``on_fatal(exception)``: the live epochs cannot go on.
        start_method: for the message that explains start-up deaths.
    """

    def __init__(self, name: str, workers: ProcessWorkers, max_chunk: int, max_startup_deaths: int,
                 on_fatal: Callable[[BaseException], None], start_method: str) -> None:
        self.name = name
        self.pool = workers
        self.max_chunk = max_chunk
        self._service_s = CHUNK_BUDGET_S  # running mean seconds of worker time per item
        self.max_startup_deaths = max_startup_deaths
        self.on_fatal = on_fatal
        self._fatal_wave: set[int] = set()  # workers starting when the last fatal was raised
        # A worker_init_fn error was raised: workers that exit after theirs are replaced when
        # the next pass begins (new_pass), not at once, so that none runs worker_init_fn
        # before the training loop could fix the cause (its later report failed that pass).
        self._hold = False
        self.start_method = start_method
        self.restarts = 0
        self.chunk = 1
        self._startup_deaths = 0
        self._pending: list[tuple[Any, Any]] = []  # submitted, not yet sent
        self._pulls: list[tuple[int, Any, tuple]] = []  # (worker id, key, message), not yet sent
        self._held: dict[int, list] = {}  # wid -> keys sent and not answered, in order
        self._alone: set = set()  # (gen, pos) of items to send one per message (suspects)
        self.want = workers.size
        #: ``task_heap(item) -> (bytes, cold) or None``: the figure of ``item`` sent alone,
        #: for its worker to trim its warm heap to (plus ``worker.HEAP_SLACK_BYTES``) before
        #: it runs it, or with ``cold`` to run it without one; ``None``: neither (set by the
        #: scheduler: ``Pipeline._task_heap``).
        self.task_heap: Callable[[Any], tuple[int, bool] | None] | None = None

    def submit(self, key: Any, item: Any) -> None:
        self._pending.append((key, item))

    def pull(self, slot: int, key: Any, msg: tuple) -> None:
        """Send ``msg`` (a pull of an iterable dataset's shard, see ``worker.process_main``) to
        the worker of id ``slot`` when it is idle; its outcomes come back as :class:`Result` s
        of ``key`` whose ``value`` is a list of outcomes."""
        self._pulls.append((slot, key, msg))

    def flush(self) -> None:
        """Send the submitted items, spread evenly over the idle workers."""
        if self._pulls:
            idle = {w.slot: w for w in self.pool.idle()}
            waiting = []
            for slot, key, msg in self._pulls:
                w = idle.pop(slot, None)
                if w is None:
                    waiting.append((slot, key, msg))
                    continue
                self._held[w.wid] = [key]
                self.pool.send(w, [key], msg)
            self._pulls = waiting
        if not self._pending:
            return
        idle = self.pool.idle()
        per = max(1, -(-len(self._pending) // max(1, len(idle))))
        for w in idle:
            if not self._pending:
                break
            n = per
            if self._alone:
                for i, (k, _) in enumerate(self._pending[:per]):
                    if k[:2] in self._alone:
                        n = max(1, i)  # a suspect goes alone, in a message of its own
                        if i == 0:
                            self._alone.discard(k[:2])
                        break
            part, self._pending = self._pending[:n], self._pending[n:]
            keys = [k for k, _ in part]
            self._held[w.wid] = keys
            msg: tuple = ("many", [(k, *item) for k, item in part])
            if len(part) == 1 and self.task_heap is not None:
                trim = self.task_heap(part[0][1])
                if trim is not None:
                    msg = (*msg, *trim)  # the worker trims its warm heap to it first
            self.pool.send(w, keys, msg)

    def new_pass(self) -> None:
        """A pass begins (the scheduler, before it sizes the workers): workers held back
        after a raised worker_init_fn error may start again."""
        self._hold = False

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Every worker ends and none serves again (``Pipeline.park``): an idle one now, a
        busy one after its sample, SIGKILLed when that takes more than ``grace_s`` seconds
        (a hung sample would else keep it after a fit: review 149), with no death reported."""
        self.want = 0
        self.pool.renew(0)
        self.pool.kill_busy_after(grace_s)

    def wait_ended(self, timeout_s: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """``ProcessWorkers.wait_ended``: every worker process gone, within ``timeout_s``."""
        return self.pool.wait_ended(timeout_s, stop)

    def renew(self, n: int) -> None:
        """Replace every worker by ``n`` new ones (``ProcessWorkers.renew``)."""
        self.want = n
        if self._hold:  # (a raised worker_init_fn: the new ones start at the next pass)
            self.pool.renew(0)
            return
        self._startup_deaths = 0
        self.pool.renew(n)

    def counts(self) -> set[int]:
        """The ``num_workers`` values the serving workers were started with."""
        return self.pool.counts()

    def resize(self, n: int) -> None:
        self.want = n
        if self._hold and n >= self.pool.size:
            return  # (a knob change between passes): the missing workers start at new_pass
        if n > self.pool.size:
            self._startup_deaths = 0  # workers that could not start get a new chance
        self.pool.resize(n)

    @property
    def size(self) -> int:
        return self.pool.size

    @property
    def busy(self) -> int:
        return sum(len(keys) for keys in self._held.values())

    def free(self) -> int:
        return len(self.pool.idle()) * self.chunk - len(self._pending)

    def held_keys(self) -> Iterator[Any]:
        """Keys of the items the workers hold or are about to be sent (submitted)."""
        for keys in self._held.values():
            yield from keys
        for key, _ in self._pending:
            yield key

    def pids(self) -> list[int]:
        return self.pool.pids()

    def forget(self, gen: int) -> list[Any]:
        """A run ended: its suspects need not go alone any more, and its pulls not yet sent are
        dropped (returned)."""
        self._alone = {k for k in self._alone if k[0] != gen}
        gone = [(key, msg) for _, key, msg in self._pulls if key[0] == gen]
        self._pulls = [p for p in self._pulls if p[1][0] != gen]
        return gone

    def expire(self, seconds: float) -> None:
        now = time.monotonic()
        for w in list(self.pool.workers.values()):
            if w.task is not None and not w.info.get("timed_out") and now - w.task_started > seconds:
                w.info["timed_out"] = seconds
                self.pool.kill(w)  # its death event then reports the item as timed out

    def kill_all(self) -> None:
        """SIGKILL every worker at once, taking no lock (for a dying main process)."""
        for w in list(self.pool.workers.values()):
            self.pool.kill(w)

    def stop(self) -> None:
        self.pool.close()

    # -- events of the pool (scheduler thread) ---------------------------------------------
    def handle(self, ev: tuple) -> list[Result]:
        """The results a pool event (a reply, or a worker's death) brings; possibly none."""
        if ev[0] == "proc":
            return self._reply(ev[1], ev[2])
        return self._died(ev[1], ev[2])

    def _reply(self, wid: int, reply: tuple) -> list[Result]:
        pool = self.pool
        w = pool.workers.get(wid) or pool.dead.get(wid)
        kind = reply[0]
        if kind == "ready":
            if w is not None:
                w.ready, w.ready_at = True, time.monotonic()
            self._startup_deaths = 0
            return []
        if kind == "fatal":
            if w is not None:
                w.info["fatal"] = reply[1]  # it exits now, having said why: no unexplained death
            if wid in self._fatal_wave:
                # Was starting with the worker whose failure was raised already (worker_init_fn
                # fails in every worker): a late report must not end a pass begun since then.
                log.debug("transform worker %s: %s: %s (raised already)", wid, reply[1].type_name,
                          reply[1].message)
                return []
            # The workers starting now fail alike; a ready one (re-initialised later, with
            # persistent_workers=False) or one started later is a new failure.
            self._fatal_wave = {wid, *(i for i, x in {**pool.dead, **pool.workers}.items()
                                       if not x.ready)}
            self._hold = True
            self.on_fatal(reply[1].to_exception())
            return []
        if kind == "stream":  # ("stream", key, [outcome, ...], final)
            _, key, outcomes, final = reply
            if w is not None:
                w.task_started = time.monotonic()
                if final and w.task is not None:
                    self._held.pop(wid, None)
                    pool.task_done(w)
            return [Result(self.name, key, outcomes)]
        held = self._held.get(wid, [])
        out = []
        for sub in reply[1]:
            key = sub[1]
            if key in held:
                held.remove(key)
            if sub[0] == "ok":
                _, _, desc, need, read_s, transform_s, pack_s, peak = sub
                out.append(Result(self.name, key, (desc, need), service_s=transform_s + pack_s,
                                  read_s=read_s, nbytes=need, peak_bytes=peak))
            else:
                out.append(Result(self.name, key, ok=False, error=sub[2].to_exception()))
        if out:  # the chunk size follows the measured time per item (mean over this reply)
            mean = sum(r.service_s + r.read_s for r in out) / len(out)
            self._service_s += (mean - self._service_s) * min(1.0, 0.05 * len(out))
            self.chunk = max(1, min(self.max_chunk, int(CHUNK_BUDGET_S / max(self._service_s, 1e-6))))
        if w is not None:
            w.task_started = time.monotonic()  # the next item held started about now
            if not held and w.task is not None:
                self._held.pop(wid, None)
                pool.task_done(w)
        return out

    def _died(self, wid: int, exitcode: int | None) -> list[Result]:
        w = self.pool.remove_dead(wid)
        if w is None:
            return []
        stopped = w.info.get("stopped")  # (stop_all: its sample outlasted the grace)
        if not stopped:
            self.restarts += 1
        held = self._held.pop(wid, [])
        sig = -exitcode if exitcode is not None and exitcode < 0 else None
        how = f"signal {sig}" if sig else f"exit code {exitcode}"
        who = f"worker {w.slot} (pid {w.pid})"
        fatal = w.info.get("fatal")  # it said why (worker_init_fn raised): no unexplained death
        if not w.ready and not fatal:
            # Deaths before ready that no worker explained: replaced up to max_startup_deaths
            # in a row. A worker whose start raised said why, and its error was raised (or was
            # stale, see _reply); it is replaced at the next pass (_hold) or now if one began:
            # counting it would raise an error already raised in the pass begun after it.
            self._startup_deaths += 1
            if self._startup_deaths >= self.max_startup_deaths:
                if self._startup_deaths == self.max_startup_deaths:
                    self.on_fatal(WorkerDied(
                        f"{self._startup_deaths} transform worker processes in a row died before "
                        f"they were ready (the last: worker {w.slot}, pid {w.pid}, {how}). The "
                        "dataset or transform cannot be set up in a worker process (it is "
                        "unpickled or inherited there; check its imports and __setstate__), "
                        f"or memory is short (workers start with {self.start_method!r})",
                        worker=who))
                return []
        timed_out = w.info.get("timed_out")
        if stopped:  # (no restart: its samples' runs have ended; they free what it held)
            log.info("transform %s was still busy on a sample %g s after the workers were "
                     "stopped: killed", who, stopped)
        elif fatal:
            log.info("transform %s exited after its error (%s); %s", who, how,
                     "another starts with the next pass" if self._hold else "starting another")
        elif not timed_out:
            log.warning("transform %s died (%s); replacing it", who, how)
        if self.pool.size < self.want and not (self._hold and fatal):
            self.pool.start_one()
        if not held:
            return []
        if timed_out:
            err: BaseException = SampleTimeout(
                f"took longer than sample_timeout={timed_out} s in {who}; the worker was replaced",
                worker=who)
        else:
            err = WorkerDied(f"{who} died ({how})", worker=who)
        if len(held) == 1:
            return [Result(self.name, held[0], ok=False, lost=True, timed_out=bool(timed_out), error=err)]
        # Replies of a chunk travel together, so which of its unanswered items the worker was
        # on is unknown: each goes back to the queue, blameless, to be sent alone; the guilty
        # one then dies (or hangs) alone and is blamed.
        self._alone.update(key[:2] for key in held)
        return [Result(self.name, key, ok=False, lost=True, requeue=True, error=err) for key in held]
