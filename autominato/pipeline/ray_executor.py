"""The transform stage on Ray actors (``Loader(worker_kind="ray")``): :class:`RayExecutor`.

Scale-out rests on an existing engine, not on a home-made RPC layer: the samples run on Ray
actors, travel back through Ray's object store, and a dead actor or a lost node is what Ray's
fault handling says it is (an ``ActorDiedError`` on the sample's result). The executor sits
behind the same :class:`~autominato.pipeline.stage.Executor` protocol as threads and
processes, so exactly-once, completion order, the error policies and timeouts are the
scheduler's, unchanged.

* The :class:`~autominato.pipeline.worker.WorkSpec` (dataset, transform, seed) is put in the
  object store once (``ray.put``); every actor fetches it when it starts, never per sample.
* An actor holds one sample at a time (a straggler never has work queued behind it). It runs
  :func:`~autominato.pipeline.worker.serve_sample`, as a worker process does, so a sample's
  result is bit-identical between ``worker_kind="process"`` and ``"ray"``.
* It packs the sample's arrays into one contiguous ``uint8`` buffer (:func:`shm.pack`), which
  Ray stores out of band: the training process maps the buffer from its local object store
  (zero-copy; Ray pulls it from the actor's node first) and the arrays are views into it,
  copied once, by the batch stage, into the pooled batch buffers. The object is freed when the
  batch is assembled.
* ``workers`` is the actor count. The cluster bounds it: :meth:`RayExecutor.capacity` is the
  actors that this loader's actors plus the cluster's free CPUs (``ray.available_resources()``)
  can hold, refreshed every :data:`CAPACITY_S` while the epoch runs.

Results come back on Ray's own threads (``ObjectRef.future()`` callbacks), which post a
:class:`~autominato.pipeline.stage.Result` to the scheduler's queue, as thread workers do; a
lock guards the executor's state between them and the scheduler thread.

``ray`` is an optional dependency (``pip install "autominato[ray]"``): this module imports it
only when a :class:`RayExecutor` is built or :func:`connect` is called.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autominato.pipeline.errors import ErrorReport, SampleTimeout, WorkerDied
from autominato.pipeline.knobs import usable_cores
from autominato.pipeline.shm import pack, packed_nbytes, unpack
from autominato.pipeline.stage import Result
from autominato.pipeline.stats import NodeSnapshot
from autominato.pipeline.worker import (
    WorkSpec,
    limit_threads,
    sample_path,
    serve_sample,
    start_worker,
)
from autominato.telemetry.process import count_from, own_usage

log = logging.getLogger("autominato.pipeline")

#: This process's Ray executors (one a Loader): a Loader built while the others hold the
#: cluster's CPUs shares their cores (:class:`RayExecutor`'s ``share``).
_EXECUTORS: weakref.WeakSet = weakref.WeakSet()

#: Seconds between two reads of the cluster's free CPUs (``ray.available_resources()`` asks
#: the cluster's control store: about a millisecond, not for every dispatch round).
CAPACITY_S = 2.0

#: Seconds an actor may wait to be placed before the cluster is taken to have no room for it
#: (Ray keeps an actor that no node can hold pending for ever, without an error).
PLACEMENT_GRACE_S = 30.0

#: Seconds after this loader killed an actor during which the cluster's free CPUs are not read:
#: Ray returns a killed actor's CPUs a moment later, and the reading would be short by them.
RELEASE_S = 3.0

#: Seconds :meth:`RayExecutor.stop` waits for the cluster's free CPUs to rise again before it
#: takes the rest of its actors' CPUs to be taken by others (or gone with a node).
RELEASE_STALL_S = 0.5

#: Distinct node labels of one loader's metrics at most; later nodes are labelled ``other``
#: (a label of bounded cardinality, as Prometheus asks).
MAX_NODES = 64

#: Actor options the executor sets itself: it replaces dead actors and re-dispatches their
#: samples (counting them against ``max_tries``), so Ray must not restart or retry them.
OWN_OPTIONS = {"max_restarts": 0, "max_task_retries": 0}


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            'worker_kind="ray" needs Ray: pip install "autominato[ray]"') from e
    return ray


def connect(address: str | None = None) -> None:
    """Connect this process to Ray, once.

    Args:
        address: ``None``: the cluster in ``RAY_ADDRESS`` when that is set, else one started
            on this machine (``ray start --head``: Ray finds it by the address file it
            wrote), else a new local Ray instance sized to the usable cores
            (:func:`usable_cores`); ``"auto"`` or ``"ray://host:port"`` (Ray Client) or
            ``"host:port"``, as ``ray.init`` takes them. Ignored when this process is
            connected already (``ray.is_initialized()``).

    Raises:
        ImportError: Ray is not installed.
        ConnectionError: from ``ray.init``, when nothing answers at ``address``.
    """
    ray = _ray()
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(address=address)
        return
    try:
        ray.init(num_cpus=usable_cores(), include_dashboard=False)
    except ValueError as e:
        # ray.init() without an address joins a cluster started on this machine (its
        # address file), and then refuses num_cpus (trial 173: "When connecting to an
        # existing cluster, num_cpus and num_gpus must not be provided", the README's
        # `ray start --head` then the script): join it as it is
        if "existing cluster" not in str(e):
            raise
        ray.shutdown()  # (the refused call's half-made state: its actors died at start)
        ray.init(address="auto")
        log.info("joined the Ray cluster started on this machine (ray start --head; "
                 "ray_address='local' starts a new instance instead)")


_forks_guarded = False


def guard_forks() -> None:
    """Freeze the garbage collector in every process forked from this one from now on
    (``os.register_at_fork``; once a process). A child forked while the parent holds garbage
    that refers to Ray objects (an ``ObjectRef``, an actor handle in a reference cycle not
    collected yet) collected it, and its finalizers spoke to Ray over the connections the
    child inherited: the parent's own requests to Ray then never got an answer (trial 162:
    after a Ray Loader closed, a ``DataLoader(num_workers=2)`` ran, then
    ``ray.available_resources()`` hung, 3 runs of 3; with the collector frozen in the
    children, 7 loops of 7 answered). Frozen, a child never collects the cycles it inherited
    (whose pages it shares with the parent, copy-on-write); what it makes itself is
    collected as usual. It covers children that leave with ``os._exit`` (a DataLoader's
    workers, ``multiprocessing``'s): one that unwinds and finalizes the interpreter still
    frees the Ray objects it inherited. The hook stays for the process's life (review
    164)."""
    global _forks_guarded
    if not _forks_guarded and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=gc.freeze)
        _forks_guarded = True


def actor_options(options: dict | None) -> dict:
    """The options of a transform actor: ``{"num_cpus": 1}`` updated with ``options``
    (anything ``ActorClass.options`` takes: ``num_cpus``, ``memory``, ``resources``,
    ``scheduling_strategy``, ``runtime_env``...).

    Raises:
        ValueError: ``options`` is not a dict, sets ``max_restarts`` / ``max_task_retries``
            (the loader replaces actors itself), or ``num_cpus`` is not a number > 0.
    """
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"ray_actor_options must be a dict, got {type(options).__name__}")
    opts = {"num_cpus": 1, **(options or {})}
    clash = sorted(set(opts) & set(OWN_OPTIONS))
    if clash:
        raise ValueError(f"ray_actor_options may not set {', '.join(clash)}: the loader replaces "
                         "dead actors and re-dispatches their samples itself (see max_tries)")
    cpus = opts["num_cpus"]
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
        raise ValueError(f"ray_actor_options['num_cpus'] must be a number > 0, got {cpus!r}")
    return opts


def _held_here(me: Any = None) -> float:
    """CPUs that this process's live Ray executors (``me`` left out; those that share the
    cores ask for none) hold or are placing actors on: what they want, as their actors still
    being placed are not out of the cluster's free CPUs yet."""
    held = 0.0
    for e in list(_EXECUTORS):
        if e is me or e._stopped or e.shared:
            continue
        with e._lock:  # (its actors change in Ray's callback threads: review 174)
            held += e._cpus * max(e.want, e._live())
    return held


def others_hold_the_cpus(cpus: float, me: Any = None) -> bool:
    """This process's live Ray executors (``me`` left out) hold, or are placing, actors whose
    CPUs leave the cluster's CPUs no room for an actor of ``cpus`` (their actors still being
    placed are not in the free CPUs yet: counted by what they want)."""
    held = _held_here(me)
    if held <= 0:
        return False
    try:
        total = cluster_cpus()
    except Exception:  # noqa: BLE001 - the cluster did not answer: no sharing
        return False
    return held + cpus > total + 1e-9


def cluster_cpus() -> float:
    """The Ray cluster's CPUs, free or not (``ray.cluster_resources()``)."""
    return float(_ray().cluster_resources().get("CPU", 0.0))


def say_if_no_node_fits(cpus: float) -> None:
    """Warn at once where no node of the cluster has ``cpus`` CPUs: its actors wait until
    one joins (an autoscaler may add it), where a warning came after 30 s (trial 173:
    ``num_cpus=8`` on a 2-CPU cluster waited for ever)."""
    try:
        largest = max((n.get("Resources", {}).get("CPU", 0.0) for n in _ray().nodes()
                       if n.get("Alive")), default=0.0)
    except Exception:  # noqa: BLE001 - the cluster did not answer: nothing to say
        return
    if largest < cpus:
        log.warning("no node of the Ray cluster has %g CPUs (ray_actor_options num_cpus; the "
                    "largest has %g): the transform actors wait until such a node joins (an "
                    "autoscaler), and the samples with them; ask for fewer CPUs an actor",
                    cpus, largest)


def free_actors(cpus_per_actor: float) -> int:
    """Actors of ``cpus_per_actor`` CPUs that the cluster's free CPUs hold now."""
    free = _ray().available_resources().get("CPU", 0.0)
    return int(math.floor(free / cpus_per_actor + 1e-9))


def placed_starting(handles: Sequence[Any]) -> int:
    """How many of these actors, none ready yet, Ray has placed: the control store's actor
    table gives an actor a worker process (its pid) once a node holds it and its
    ``runtime_env`` is set up, and none while it waits for a node with its resources; both
    are ``PENDING_CREATION`` until the constructor returns (Ray's state API,
    ``ray.util.state``, would tell them apart too, but needs the dashboard). One call to the
    control store for them all (this job's actors pending creation:
    ``ray._private.state.actors``); a dead actor keeps its pid there and is not counted.
    ``0`` where the call fails or the API is gone (a Ray that moved it): the actors are then
    taken for unplaced, as before this was read."""
    if not handles:
        return 0
    try:
        import ray
        from ray._private import state

        table = state.actors(job_id=ray.JobID.from_hex(ray.get_runtime_context().get_job_id()),
                             actor_state_name="PENDING_CREATION")
        return sum(1 for h in handles
                   if (info := table.get(h._actor_id.hex()))
                   and info.get("State") == "PENDING_CREATION" and info.get("Pid"))
    except Exception:  # noqa: BLE001 - a private API: any failure reads as not placed
        # (Ray Client, ray://, has no control store in the driver: always here)
        log.debug("Ray's actor table could not be read: actors not ready count as unplaced",
                  exc_info=True)
        return 0


def free_actors_beside_mine(cpus_per_actor: float, me: Any = None, placed: int = 0) -> int:
    """:func:`free_actors`, less the actors that this process's live Ray executors (``me``
    left out, whose ``placed`` actors hold CPUs already) are still placing: the cluster's
    free CPUs do not show those yet (a validation Loader built just after a training one
    read the second training actor's CPU as free, took it with one actor of its own, and the
    training Loader's second actor waited), so the free CPUs are at most the cluster's CPUs
    less what those executors hold or are placing, less ``me``'s placed actors."""
    free = free_actors(cpus_per_actor)
    held = _held_here(me)
    if held <= 0:
        return free
    room = cluster_cpus() - held
    return max(0, min(free, int(math.floor(room / cpus_per_actor + 1e-9)) - placed))


class SampleActor:
    """What one Ray actor runs: the body of a transform worker, one sample per call.

    Args:
        wid: the actor's number in its loader (for its first global seeding and its name).
        spec_box: ``[ObjectRef]`` of the :class:`WorkSpec` (boxed so that Ray hands the
            reference over unresolved: the driver's ``sys.path`` is extended first).
        sys_path: the driver's ``sys.path``; entries that exist on this node are appended,
            so that a dataset class defined next to the training script unpickles here.
        threads: intra-op (BLAS / OpenMP / torch) threads, the actor's CPUs.
        slot, workers: its worker id in ``[0, workers)``: ``get_worker_info()`` returns it and
            ``worker_init_fn(slot)`` runs here.

    A start that raises (``worker_init_fn``: a ``WorkerInitError``; the dataset or transform
    that does not unpickle on this node) does not fail the actor's creation: :meth:`ready`
    reports it (``("fatal", ErrorReport)``), so that the training loop gets the error itself,
    as from a worker process, not Ray's ``ActorDiedError`` holding its text.
    """

    def __init__(self, wid: int, spec_box: list, sys_path: list[str], threads: int,
                 slot: int = 0, workers: int = 1) -> None:
        # Where this process begins working for the loader: Ray's start of it before (its
        # imports, connecting) is not the loader's (process.count_from, in the driver).
        self.usage0 = own_usage()
        for p in sys_path:
            if p and p not in sys.path and os.path.isdir(p):
                sys.path.append(p)
        import ray

        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.name = f"Ray actor {wid} (pid {os.getpid()}, node {self.ip})"
        self.failed: ErrorReport | None = None
        try:
            try:
                self.spec: WorkSpec = ray.get(spec_box[0])
            except Exception as e:
                # Ray wraps what unpickling raised (a RaySystemError around it): the user's own
                cause = getattr(e, "client_exc", None)
                err = cause if isinstance(cause, Exception) else e
                # ImportError: a module missing on the node; pickle's AttributeError "Can't
                # get attribute": a class or function the node's copy of the module lacks.
                if isinstance(err, ImportError) or (
                    isinstance(err, AttributeError) and "Can't get attribute" in str(err)
                ):
                    err.add_note(f"[autominato] the dataset or transform could not be unpickled "
                                 f"on node {self.ip}: its code must be importable on every node "
                                 "of the cluster")
                raise err from None
            limit_threads(threads)
            start_worker(self.spec, slot, workers, self.name, process=True)
        except Exception as e:  # noqa: BLE001 - reported by ready()
            self.failed = ErrorReport.capture(e, -1, None, self.name)

    def ready(self) -> tuple:
        """``(pid, node id, node IP address, usage)``, ``usage`` the process's
        :func:`~autominato.telemetry.process.own_usage` when its constructor began, or
        ``("fatal", ErrorReport)`` when the actor's start raised."""
        if self.failed is not None:
            return ("fatal", self.failed)
        return os.getpid(), self.node_id, self.ip, self.usage0

    def run(self, index: int, epoch: int, draw: int = 0, sample: Any = None) -> tuple:
        """Read (unless ``sample`` is given) and transform sample ``index`` (``draw``: see
        :func:`~autominato.pipeline.worker.serve_sample`).

        Returns:
            ``("ok", descriptor, buffer, read_s, transform_s, pack_s)``, ``buffer`` a ``uint8``
            array holding the sample's arrays (:func:`shm.pack`), or ``("err", ErrorReport)``.
        """
        spec = self.spec
        try:
            sample, read_s, transform_s = serve_sample(spec, index, epoch, sample is None, sample,
                                                       draw)
            t = time.perf_counter()
            buf = np.empty(packed_nbytes(sample), np.uint8)
            desc, _ = pack(sample, buf, keep_order=spec.keep_layout)
            return ("ok", desc, buf, read_s, transform_s, time.perf_counter() - t)
        except BaseException as e:  # noqa: BLE001 - every failure is the sample's, reported
            return ("err", ErrorReport.capture(e, index, sample_path(spec.dataset, index, e), self.name))


@dataclass
class _Actor:
    wid: int
    handle: Any
    born: float
    ready: bool = False
    ready_at: float = 0.0  # time.monotonic() when it said it was ready
    pid: int | None = None
    node: str = "?"  # the bounded label of its node
    local: bool = False  # on this process's node
    key: Any = None  # the sample it holds
    sent: float = 0.0  # when it got it (time.monotonic())
    retiring: bool = False
    timed_out: float | None = None
    slot: int = 0  # its worker id for get_worker_info / worker_init_fn, in [0, workers)
    wave: int = 0  # the executor's start wave when it was started (see _startup_failed)
    spec_gen: int = 0  # the spec it holds (see reload)


@dataclass
class _Node:
    items: int = 0
    nbytes: int = 0
    service_s: float = 0.0
    round_trip_s: float = 0.0


class RayExecutor:
    """Ray actors running the transform stage (see the module docstring).

    Args:
        name: the stage's name.
        spec: what an actor needs to read and transform a sample; put in the object store.
        post: ``post(Result)``, called from Ray's threads.
        size: actors to start with.
        options: actor options (:func:`actor_options`).
        copy: copy each sample out of the object store (a user ``collate_fn`` may keep
            references to its arrays, and object-store arrays are read-only); otherwise
            samples are views, copied once by the batch stage.
        max_startup_deaths: actors in a row that may fail to start; then ``on_fatal`` is
            called once (a dataset that does not unpickle on the cluster fails every actor).
        on_fatal: ``on_fatal(exception)``, called on the scheduler thread.
        on_capacity: ``on_capacity(actors)`` when :meth:`capacity` changes, called on the
            scheduler thread (the loader bounds its ``workers`` knob with it).

    Raises:
        ImportError: Ray is not installed.
    """

    def __init__(self, name: str, spec: WorkSpec, post: Callable[[Result], None], size: int,
                 options: dict, copy: bool, max_startup_deaths: int,
                 on_fatal: Callable[[BaseException], None],
                 on_capacity: Callable[[int], None] | None = None,
                 share: bool = False) -> None:
        ray = _ray()
        guard_forks()
        self._ray = ray
        self.name = name
        self._post = post
        self._copy = copy
        self._opts = dict(options)
        self._cpus = float(self._opts["num_cpus"])
        self._threads = max(1, int(self._cpus))
        self._stopped = False
        self._actors: dict[int, _Actor] = {}
        # Another Loader of this process holds the CPUs (a training Loader beside which a
        # validation one is built: trial 173, the second waited for ever, in a plain loop
        # and under Lightning): this one's actors ask for no CPU and share the cores, as
        # two DataLoaders' worker processes do. Only where num_cpus is the default (a
        # number the user gave is a request to wait for).
        self.shared = share and others_hold_the_cpus(self._cpus, self)
        if self.shared:
            self._opts["num_cpus"] = 0
            log.warning(
                "another Loader of this process holds (or is placing) actors on the Ray "
                "cluster's CPUs, leaving none for this one: its transform actors share the "
                "cores with them (num_cpus=0, as worker processes of two DataLoaders share "
                "them); ray_actor_options={'num_cpus': ...} would make them wait for CPUs of "
                "their own instead, until the other Loader's actors give some back (close it, "
                "or give it fewer workers)")
        elif not share and others_hold_the_cpus(self._cpus, self):
            # (trial 207: the README's example, num_cpus given, beside a training Loader:
            # the validation Loader waited for ever, told only after 30 s, and told to ask
            # for fewer CPUs when it asked for 1)
            log.warning(
                "another Loader of this process holds (or is placing) actors on every CPU of "
                "the Ray cluster: this one's actors, asking for num_cpus=%g each "
                "(ray_actor_options), wait for CPUs of their own until that Loader's actors "
                "give some back, and its samples with them. Leave num_cpus out of "
                "ray_actor_options to share the cores with them, as two DataLoaders' worker "
                "processes do, or close the other Loader or give it fewer workers first",
                self._cpus)
        self._cls = ray.remote(SampleActor).options(**self._opts, **OWN_OPTIONS)
        self._spec_ref = ray.put(spec)
        self._here = ray.get_runtime_context().get_node_id()
        self.max_startup_deaths = max_startup_deaths
        self.on_fatal = on_fatal
        self.on_capacity = on_capacity
        self.restarts = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, Any]] = []  # submitted, not yet sent
        self._next_wid = 0
        self._startup_deaths = 0
        self._fatal: BaseException | None = None
        self._gave_up = False  # actors failed to start max_startup_deaths times in a row
        self._wave = 0  # bumped at each new chance (resize): see _startup_failed
        self._spec_gen = 0  # bumped by reload: actors of an older spec are not kept
        self._doomed: list[_Actor] = []  # to kill (retired, or dead) from the scheduler thread
        self._nodes: dict[str, _Node] = {}
        self._capacity: int | None = None
        self._next_capacity = 0.0
        self._last_kill = -math.inf
        self._told_unplaced = False  # said that none of its actors could be placed
        self.want = 0
        _quiet_read_only_warning()
        self._refresh_capacity()
        self.resize(size)
        _EXECUTORS.add(self)  # (whole: another Loader's construction reads it)

    # -- the Executor protocol (scheduler thread) ----------------------------------------------
    # Ray is called only from here, never from its own callback threads (an actor started or
    # killed from one of them can wait for that very thread), and never under the lock.
    def submit(self, key: Any, item: Any) -> None:
        self._pending.append((key, item))

    def flush(self) -> None:
        """Send submitted samples to idle actors, one each; replace dead actors and kill
        retired ones (noted by Ray's threads); refresh :meth:`capacity` when due."""
        fatal, self._fatal = self._fatal, None
        if fatal is not None:
            self.on_fatal(fatal)
        if self._stopped:
            return
        now = time.monotonic()
        with self._lock:
            doomed, self._doomed = self._doomed, []
            # A retired actor still starting is killed once ready (see _ready); one that no
            # node placed (or whose start hangs) is killed after PLACEMENT_GRACE_S instead of
            # waiting for a CPU to run worker_init_fn for a worker that is gone.
            for a in [a for a in self._actors.values()
                      if a.retiring and not a.ready and now - a.born > PLACEMENT_GRACE_S]:
                del self._actors[a.wid]
                doomed.append(a)
            replace = 0 if self._gave_up else max(0, self.want - self._live())
            unplaced = (not self._told_unplaced and not any(a.ready for a in self._actors.values())
                        and any(not a.retiring and now - a.born > PLACEMENT_GRACE_S
                                for a in self._actors.values()))
            if unplaced:
                self._told_unplaced = True
            sends = []
            for a in self._idle():
                if not self._pending:
                    break
                key, item = self._pending.pop(0)
                a.key, a.sent = key, time.monotonic()
                sends.append((a, key, item))
        self._kill(doomed)
        if unplaced:
            self._say_unplaced()
        for _ in range(replace):
            self._start()
        for a, key, item in sends:
            ref = a.handle.run.remote(*item)
            ref.future().add_done_callback(lambda f, a=a, key=key: self._done(a, key, f))
        if time.monotonic() >= self._next_capacity:
            self._refresh_capacity()

    def resize(self, n: int) -> None:
        with self._lock:
            self.want = n
            live = [a for a in self._actors.values() if not a.retiring]
            # Actors retired while busy still run (and hold their ids): they serve on, lowest
            # id first, rather than new actors taking the same ids beside them.
            for a in sorted((a for a in self._actors.values()
                             if a.retiring and a.timed_out is None
                             and a.spec_gen == self._spec_gen), key=lambda a: a.slot):
                if len(live) >= n:
                    break
                a.retiring = False
                live.append(a)
            start = max(0, n - len(live))
            if start:
                self._new_chance()
            # Retire the surplus, the highest ids first as with worker processes, so that ids
            # stay in [0, n) (busy ones finish their sample first).
            live.sort(key=lambda a: -a.slot)
            doomed = [a for a in live[:max(0, len(live) - n)] if self._retire(a)]
        self._kill(doomed)
        for _ in range(start):
            self._start()

    def reload(self, spec: WorkSpec) -> None:
        """Serve ``spec`` from now on (``persistent_workers=False``, the dataset changed since
        the actors got theirs): every actor is replaced by a new one that holds it, a busy one
        once its sample is done, as the DataLoader's workers are new at each epoch
        (``worker_init_fn`` runs again). Call from the scheduler thread."""
        ref = self._ray.put(spec)
        with self._lock:
            self._spec_ref = ref
            self._spec_gen += 1
            self._new_chance()
            doomed = [a for a in list(self._actors.values()) if self._retire(a)]
            n = self.want
        self._kill(doomed)
        for _ in range(n):
            self._start()

    def new_pass(self) -> None:
        pass  # a new chance comes with resize (see _new_chance), as the pass sizes the actors

    def _new_chance(self) -> None:  # under the lock
        """New actors are to start: the count of failed starts begins again, and a start
        error of an actor started before is stale (see _startup_failed)."""
        self._startup_deaths, self._gave_up, self._fatal = 0, False, None
        self._wave += 1

    def _retire(self, a: _Actor) -> bool:  # under the lock
        """Retire ``a``; True when it is to be killed now (idle and ready). A busy one goes
        after its sample (_done), one still starting once ready (_ready)."""
        a.retiring = True
        if a.key is None and a.ready:
            del self._actors[a.wid]
            return True
        return False

    @property
    def size(self) -> int:
        with self._lock:
            return self._live()

    @property
    def busy(self) -> int:
        with self._lock:
            return sum(1 for a in self._actors.values() if a.key is not None)

    def free(self) -> int:
        with self._lock:
            return len(self._idle()) - len(self._pending)

    def expire(self, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            late = [a for a in self._actors.values()
                    if a.key is not None and a.timed_out is None and now - a.sent > seconds]
            for a in late:
                a.timed_out = seconds
        self._kill(late)  # their results then say that they died

    def stop(self) -> None:
        """Kill every actor, and wait until the cluster's free CPUs show those the live ones
        (ready, or placed and still starting: :func:`placed_starting`) held (at
        most :data:`RELEASE_S`, less where they stop coming back:
        :data:`RELEASE_STALL_S`): Ray returns them a moment after the kill, and a Loader
        built next (the next rank's, a validation Loader, a resumed run) read the cluster
        short by them (trial 139: it started with fewer actors, warning of a cluster that
        held fewer, its predecessor's). Nothing is killed where Ray was shut down first."""
        with self._lock:
            self._stopped = True
            # (the live ones hold CPUs; a dead one, or one killed for its sample_timeout,
            # may have given them back already)
            live = [a for a in self._actors.values() if a.ready and a.timed_out is None]
            starting = [a.handle for a in self._actors.values() if not a.ready]
            actors, self._actors = list(self._actors.values()), {}
            actors += self._doomed
            self._pending.clear()
        try:
            up = self._ray.is_initialized()
        except Exception:  # noqa: BLE001
            up = False
        if not up:
            # Shut down by the training script first: its actors went with it, and a kill
            # would start a new local Ray instance (review 140).
            return
        # (shared: none held; those still starting that a node placed hold theirs too)
        held = 0.0 if self.shared else (len(live) + placed_starting(starting)) * self._cpus
        before = self._free_cpus() if held else None
        if before is not None:
            # An actor just placed has its pid in the control store a moment before the free
            # CPUs leave its out (review 210: `before` still held them, the target was past
            # the cluster's CPUs, and close() waited RELEASE_STALL_S): at most what is taken.
            try:
                held = min(held, max(0.0, cluster_cpus() - before))
            except Exception:  # noqa: BLE001 - the cluster did not answer: as read
                pass
            if held <= 0:
                before = None
        self._kill(actors)
        if before is not None:
            # Until the free CPUs show them, or stop rising for RELEASE_STALL_S (another
            # job, or a Loader whose actors waited for CPUs, took them; a node was lost),
            # at most RELEASE_S. They came back 15-50 ms after the kill on a local instance.
            now = time.monotonic()
            deadline, rose, last = now + RELEASE_S, now, before
            while now < deadline and now - rose < RELEASE_STALL_S:
                time.sleep(0.02)
                free = self._free_cpus()
                if free is None or free >= before + held - 1e-6:
                    break
                now = time.monotonic()
                if free > last:
                    rose, last = now, free

    def _free_cpus(self) -> float | None:
        """The cluster's free CPUs now, ``None`` where Ray does not answer (shut down)."""
        try:
            return float(self._ray.available_resources().get("CPU", 0.0))
        except Exception:  # noqa: BLE001 - Ray is down, or the cluster did not answer
            return None

    def _say_unplaced(self) -> None:
        """Say once why no sample runs: none of this loader's actors is ready after
        :data:`PLACEMENT_GRACE_S` (Ray keeps an actor no node can hold pending, without an
        error; trial 139: a validation Loader beside a training Loader that held every CPU
        waited in silence). The actors a node placed (:func:`placed_starting`) are said to be
        starting slowly; the others to wait for a node, with the CPUs free."""
        actors = [a for a in list(self._actors.values()) if not a.retiring]
        started = placed_starting([a.handle for a in actors if not a.ready])
        if actors and started == len(actors):
            log.warning(
                "none of this Loader's %d Ray transform actors (num_cpus=%g each) is ready "
                "after %g s, though a node holds each: their start is slow (a loaded node "
                "importing torch, worker_init_fn, the dataset to unpickle); its samples wait "
                "meanwhile", len(actors), self._cpus, PLACEMENT_GRACE_S)
            return
        free = self._free_cpus()
        log.warning(
            "none of this Loader's %d Ray transform actors (num_cpus=%g each) is ready after "
            "%g s, and the cluster has %s CPUs free: %s wait for a node with its CPUs "
            "free (other actors, another Loader's or another job's, may hold them) or for "
            "their runtime_env to be set up%s; its "
            "samples wait meanwhile. Where the CPUs are taken: give the other "
            "Loader fewer workers, close it first, pass ray_actor_options={'num_cpus': ...} "
            "with less, or, where this process's other Loader holds them, leave num_cpus out "
            "to share the cores with it", len(actors), self._cpus, PLACEMENT_GRACE_S,
            "?" if free is None else f"{free:g}",
            f"{len(actors) - started} of them" if started else "they",
            f", and {started} placed are still starting" if started else "")

    # -- figures ----------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """PIDs of the actors on this process's node (the process meter can read those)."""
        with self._lock:
            return [a.pid for a in self._actors.values() if a.local and a.pid is not None]

    def nodes(self) -> tuple[NodeSnapshot, ...]:
        """The actors and their traffic by node (labels of bounded number, :data:`MAX_NODES`)."""
        with self._lock:
            count: dict[str, int] = {}
            for a in self._actors.values():
                if a.ready and not a.retiring:
                    count[a.node] = count.get(a.node, 0) + 1
            return tuple(
                NodeSnapshot(node, count.get(node, 0), n.items, n.nbytes, n.service_s, n.round_trip_s)
                for node, n in sorted(self._nodes.items()))

    def capacity(self) -> int | None:
        """Actors this loader may hold on the cluster now: its placed actors plus those the
        free CPUs hold (at least 1); ``None`` before the first reading."""
        return self._capacity

    def _refresh_capacity(self) -> None:
        self._next_capacity = time.monotonic() + CAPACITY_S
        now = time.monotonic()
        if now - self._last_kill < RELEASE_S:
            return  # a killed actor's CPUs are on their way back
        with self._lock:
            starting = [a for a in self._actors.values() if not a.ready]
            if any(now - a.born < PLACEMENT_GRACE_S for a in starting):
                return  # an actor being placed holds CPUs that its readiness does not show yet
            placed = sum(1 for a in self._actors.values() if a.ready)
        if self.shared:
            # No CPU asked: nothing of the cluster's bounds them; the Loader bounds them as it
            # bounds process workers (review 174: cut to the cluster's CPUs, num_workers given
            # included, with a warning of CPUs that held them)
            return
        # Actors still starting after the grace that a node placed hold their CPUs: they are
        # not room lost (a CI run under three test processes: actors that took over 30 s to
        # import torch were read as unplaceable, and the Loader's workers cut to the one ready).
        placed += placed_starting([a.handle for a in starting])
        try:
            # (the other Loaders' actors being placed are not out of the free CPUs yet:
            # review 206, the bound read them as room every 2 s after the build)
            cap = max(1, placed + free_actors_beside_mine(self._cpus, self, placed))
        except Exception:  # noqa: BLE001 - the cluster did not answer: keep the last bound
            log.debug("could not read the Ray cluster's free CPUs", exc_info=True)
            return
        if cap != self._capacity:
            self._capacity = cap
            if self.on_capacity is not None:
                self.on_capacity(cap)

    # -- actors ---------------------------------------------------------------------------------
    def _idle(self) -> list[_Actor]:  # under the lock
        return [a for a in self._actors.values()
                if a.ready and a.key is None and not a.retiring and a.timed_out is None]

    def _live(self) -> int:  # under the lock
        return sum(1 for a in self._actors.values() if not a.retiring)

    def _start(self) -> None:
        with self._lock:
            wid = self._next_wid
            self._next_wid += 1
            # DataLoader's worker ids: the lowest id no live actor has (a replacement's is the
            # dead one's), so that get_worker_info() sharding idioms hold.
            taken = {a.slot for a in self._actors.values() if not a.retiring}
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            workers = max(self.want, slot + 1)
            wave, spec_ref, spec_gen = self._wave, self._spec_ref, self._spec_gen
        handle = self._cls.remote(wid, [spec_ref], list(sys.path), self._threads, slot, workers)
        a = _Actor(wid, handle, time.monotonic(), slot=slot, wave=wave, spec_gen=spec_gen)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._actors[wid] = a
        if stopped:  # stop() ran meanwhile (from another thread): leave no actor behind
            self._kill([a])
            return
        handle.ready.remote().future().add_done_callback(lambda f, a=a: self._ready(a, f))

    def _kill(self, actors: list[_Actor]) -> None:
        if actors:
            self._last_kill = time.monotonic()
        for a in actors:
            try:
                self._ray.kill(a.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already (its node was lost), or Ray is down
                pass

    def _label(self, node_id: str, ip: str) -> str:  # under the lock
        label = f"{ip}/{node_id[:8]}"
        if label not in self._nodes and len(self._nodes) >= MAX_NODES:
            label = "other"
        self._nodes.setdefault(label, _Node())
        return label

    def ready_since(self) -> float | None:
        """``time.monotonic()`` since when an actor has been ready to run samples (the
        earliest of those ready now), ``None`` while none is."""
        with self._lock:
            return min((a.ready_at for a in self._actors.values() if a.ready), default=None)

    # -- Ray's threads: note what happened and post results; no Ray call here ------------------
    def _ready(self, a: _Actor, f: Any) -> None:
        try:
            reply = f.result()
        except BaseException as e:  # noqa: BLE001 - the actor could not start
            self._startup_failed(a, e)
            return
        if reply[0] == "fatal":  # its start raised: the same in every actor, raised at once
            self._startup_failed(a, reply[1].to_exception(), fatal=True)
            return
        pid, node_id, ip, usage0 = reply
        with self._lock:
            if self._stopped or a.wid not in self._actors:
                return
            if node_id == self._here and usage0[0] == pid:
                # metered here (pids()): from its constructor on, before pids() names it
                count_from(*usage0)
            a.ready, a.ready_at, a.pid = True, time.monotonic(), pid
            a.node, a.local = self._label(node_id, ip), node_id == self._here
            self._startup_deaths = 0
            if a.retiring:
                # Retired while it started (resize, reload): killed only now. Ray can keep
                # the CPUs of an actor killed during its creation for good
                # (ray-project/ray#27743; seen with Ray 2.60 here, in plain Ray too).
                del self._actors[a.wid]
                self._doomed.append(a)

    def _startup_failed(self, a: _Actor, e: BaseException, fatal: bool = False) -> None:
        """Actor ``a`` did not start: it died (``e``: Ray's error; replaced until
        ``max_startup_deaths`` in a row), or its start raised (``fatal``: ``e`` is that error,
        raised in the training loop at once, as a worker process's ``worker_init_fn`` error;
        no actor is started again until the workers are resized, a new pass). The error of an
        actor started before the latest new chance is stale (the cause may be fixed since, as
        the process workers' ``_fatal_wave``): it is replaced, not raised."""
        with self._lock:
            if self._stopped or self._actors.pop(a.wid, None) is None:
                return
            self._doomed.append(a)  # a start that raised leaves the actor alive
            if a.retiring:
                return
            if fatal:
                if a.wave < self._wave:
                    log.debug("Ray actor %d: a stale start error (%s); replacing it", a.wid,
                              _first_line(e))
                elif not self._gave_up:  # (its companions of the same start fail alike)
                    self._gave_up = True
                    self._fatal = e
                return
            self.restarts += 1  # replaced, as a worker process that dies before it is ready
            self._startup_deaths += 1
            if self._startup_deaths < self.max_startup_deaths:
                log.warning("Ray actor %d failed to start (%s); replacing it", a.wid, _first_line(e))
                return
            if not self._gave_up:
                self._gave_up = True
                self._fatal = WorkerDied(
                    f"{self._startup_deaths} Ray actors in a row failed to start (the last: "
                    f"actor {a.wid}: {_first_line(e)}). The dataset or transform cannot be set "
                    "up on the cluster (it is unpickled there: its code must be importable on "
                    f"every node), or no node can hold an actor with options {self._opts}",
                    worker=f"Ray actor {a.wid}")

    def _done(self, a: _Actor, key: Any, f: Any) -> None:
        now = time.monotonic()
        try:
            reply = f.result()
        except BaseException as e:  # noqa: BLE001 - the actor died, or its node was lost
            self._died(a, key, e)
            return
        with self._lock:
            if self._stopped:
                return
            a.key = None
            # Retired, or killed for a timeout just after it finished: either way it goes
            # (a killed actor that reports no death would otherwise count as live for ever).
            if (a.retiring or a.timed_out is not None) and self._actors.pop(a.wid, None) is not None:
                self._doomed.append(a)
            if reply[0] == "ok":
                node = self._nodes[a.node]
                node.items += 1
                node.nbytes += reply[2].nbytes + len(reply[1])
                node.service_s += sum(reply[3:])
                node.round_trip_s += now - a.sent
        if reply[0] == "err":
            self._post(Result(self.name, key, ok=False, error=reply[1].to_exception()))
            return
        _, desc, buf, read_s, transform_s, pack_s = reply
        sample = unpack(desc, buf, copy=self._copy)
        self._post(Result(self.name, key, sample, service_s=transform_s + pack_s, read_s=read_s,
                          nbytes=buf.nbytes))

    def _died(self, a: _Actor, key: Any, e: BaseException) -> None:
        with self._lock:
            if self._stopped or self._actors.pop(a.wid, None) is None:
                return
            self._doomed.append(a)  # dead, or only its result lost: either way it goes
            self.restarts += 1
            timed_out = a.timed_out
        who = f"Ray actor {a.wid}" + (f" (pid {a.pid}, node {a.node})" if a.ready else "")
        if timed_out:
            err: BaseException = SampleTimeout(
                f"took longer than sample_timeout={timed_out} s in {who}; the actor was replaced",
                worker=who)
        else:
            log.warning("%s died (%s); replacing it", who, _first_line(e))
            err = WorkerDied(f"{who} died ({_first_line(e)})", worker=who)
        self._post(Result(self.name, key, ok=False, lost=True, timed_out=bool(timed_out), error=err))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _quiet_read_only_warning() -> None:
    # Samples are views into Ray's object store, which is read-only; torch warns once per
    # process when a tensor is made over a read-only array. The views are only read (the batch
    # stage copies them into its buffers), so the warning is spent here, once, silently.
    import torch

    a = np.zeros(1)
    a.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(a)
