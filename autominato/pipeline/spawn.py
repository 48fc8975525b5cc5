"""How worker processes start: a per-loader fork server, the *zygote*.

Each :class:`~autominato.pipeline.executor.ProcessWorkers` starts one small, single-threaded
process when it is built, the zygote, which holds the loader's :class:`WorkSpec` (dataset and
transform) and forks every worker on request, for the whole life of the loader: the first
workers, those the controller adds, and replacements after a death.

* Forking is safe when the loader is built (one thread, CUDA not initialised: see
  :func:`can_fork_now`): the zygote is forked from the training process. It and its workers
  inherit the spec copy-on-write and never pickle it, so an in-memory dataset (a large NumPy
  array, a MONAI ``CacheDataset``) is shared by every worker instead of copied into each.
* Threads already run (a second loader, built while the first one's threads run) but an
  earlier loader's zygote, forked while this process ran one thread, still runs: that
  zygote, a copy of this process that has run nothing of the user's, forks the new loader's
  (a *nested* zygote), which unpickles the spec once and forks workers. It outlives the zygote it was forked from, and ends with its
  loader. No interpreter starts, no torch is imported again (~2 s saved on the 2-core
  machine).
* Otherwise (``start_method="forkserver"``, or threads run and no zygote of this process
  does): the zygote is a new interpreter (``python -c``) that unpickles the spec once and
  forks workers, which share that one copy. ``start_method="spawn"``: the new interpreter
  starts each worker as a new interpreter of its own (multiprocessing's ``spawn``), each
  unpickling the spec.

Either way no worker ever runs the user's ``__main__``: the spec is cloudpickled (functions
and classes of ``__main__`` travel by value) or inherited, so a script without an
``if __name__ == "__main__":`` guard, or one read from stdin, works.

Why this and not multiprocessing's forkserver. multiprocessing's forkserver and spawn import
``__main__`` in every child (preparation data ``init_main_from_path``/``_name``), which
re-runs an unguarded script and fails for ``python - < script.py``; avoiding that means
subclassing private, version-dependent internals (``Popen._launch``,
``spawn.get_preparation_data``, the forkserver's wire protocol, which changed between 3.10
and 3.13). The forkserver is also one per process with a global preload list, it stalls the
caller for seconds while it first starts, and a spec sent through it is pickled for, and
copied into, every worker. The zygote needs only public APIs, one protocol whatever the
start method, and makes a start one write on a socket.

Protocol. One ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair per zygote (message boundaries kept,
descriptors passed with ``SCM_RIGHTS``). The loader sends ``("start", wid, threads)`` with
the worker's end of its own socket pair attached; the worker talks to the loader straight
through that socket (the zygote keeps no copy). The zygote answers ``("started", wid, pid)``,
``("exit", wid, exitcode)`` when it reaps the worker (``exitcode`` as multiprocessing's: a
signal is its negative number), ``("failed", wid, reason)`` when it cannot fork, and
``("fatal", ErrorReport)`` when a nested or new-interpreter zygote cannot unpickle the spec (it then
exits). A nested zygote says ``("hello", pid)`` first (its loader is not its parent). The
loader asks a zygote for a nested one with ``("zygote",)``, the new zygote's socket and a
bootstrap file (the pickled spec) attached; the zygote it came from reaps it and never kills
it. The zygote exits, SIGKILLing the workers left, when the loader's end closes (the
loader closed or died) or its loader is gone (its parent changed, or, nested, the loader's
process ended) while another process holds the loader's end.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from importlib import import_module
from multiprocessing import spawn as mp_spawn
from multiprocessing.connection import Connection, wait
from typing import Any

#: The start methods a loader accepts (see :func:`zygote_kind` for what each starts).
START_METHODS = ("auto", "fork", "forkserver", "spawn")


def can_fork_now() -> bool:
    """Whether this process may fork workers safely: Linux-style ``fork`` exists, only one
    thread runs (a lock held by another thread at fork time stays held in the child forever)
    and CUDA is not initialised (a forked child cannot use it)."""
    if "fork" not in mp.get_all_start_methods() or _python_threads() != 1:
        return False
    try:
        import torch

        return not torch.cuda.is_initialized()
    except ImportError:  # pragma: no cover
        return True


log = logging.getLogger("autominato.pipeline")

_said_fresh_start = False


def say_fresh_start() -> None:
    """Say once a process (in the log, at INFO) why its loaders' workers start from a new
    interpreter, about 1-2 s more to the first batch (trial 120 found it unsaid), and what
    avoids it for that cause (review 121: CUDA was blamed on threads)."""
    global _said_fresh_start
    if _said_fresh_start:
        return
    _said_fresh_start = True
    threads = _python_threads()
    if threads > 1:
        log.info("this process runs %d threads: the workers start from a new interpreter "
                 "(about 1-2 s, importing torch) rather than a fork of it; build the Loader "
                 "before starting threads, or pass start_method='fork' if no thread can hold "
                 "a lock the workers need (see Loader's start_method)", threads)
    else:
        log.info("CUDA is initialised in this process: the workers start from a new "
                 "interpreter (about 1-2 s, importing torch), as a fork could not use it; "
                 "build the Loader before the first CUDA call to fork them")


def _python_threads() -> int:
    """Threads that run Python code in this process, without the stale entries of
    :func:`threading.active_count`: a thread started outside :mod:`threading` (by Ray's or
    gRPC's C++ core, say) that once called into Python stays listed, as a ``_DummyThread``,
    after it has ended (until a new thread happens to get its id); it holds no lock and
    cannot stop a fork being safe. Linux: a thread whose id is no longer in
    ``/proc/self/task`` has ended, unless a live thread holds its entry: one that the C
    library gave the ended thread's ``pthread`` id (it reuses them, with the stack) gets that
    entry, with the ended thread's native id, when it calls into Python; it counts while it
    has a Python thread state (``sys._current_frames``)."""
    count = threading.active_count()
    dummies = [t for t in threading.enumerate()
               if isinstance(t, threading._DummyThread) and t.native_id is not None]
    if not dummies:
        return count
    try:
        running = set(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: count them all
        return count
    if str(threading.get_native_id()) not in running:
        return count  # a /proc of another PID namespace: its ids are not this process's
    in_python = sys._current_frames()
    return count - sum(str(t.native_id) not in running and t.ident not in in_python
                       for t in dummies)


def zygote_kind(start_method: str) -> str:
    """``"fork"`` (forked from this process), ``"nested"`` (forked by a clean zygote of this
    process, see :func:`clean_zygote`), ``"fresh"`` (a new interpreter forks the workers) or
    ``"spawn"`` (a new interpreter spawns each worker) for ``start_method``.

    ``"auto"`` forks when it is safe (:func:`can_fork_now`); else, when an earlier loader's
    zygote was forked from this process and still runs, that zygote forks this loader's (the
    usual second loader, a validation loader built while the training loader's threads run);
    else a new interpreter starts (~2 s, importing torch).

    Raises:
        ValueError: ``start_method`` is not one of :data:`START_METHODS`.
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
                         f"got {start_method!r}")
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    if start_method == "auto":
        if can_fork_now():
            return "fork"
        if clean_zygote() is not None:
            return "nested"
        if log.isEnabledFor(logging.DEBUG):  # (why, for a rare "fresh" seen in a test run)
            me = os.getpid()
            log.debug("no clean zygote to fork this loader's from: %s",
                      [(z.pid, "gone" if z.gone else "broken" if z.broken else "fatal")
                       for z in list(_clean) if z.owner == me]
                      or "none left (none forked while one thread ran, or dropped: its hello "
                         "did not come, or its loader was collected)")
        return "fresh"
    return {"fork": "fork", "forkserver": "fresh", "spawn": "spawn"}[start_method]


#: The zygotes this process forked while it ran one thread (:func:`can_fork_now`): clean
#: copies of it that have run nothing of the user's, which can fork another loader's. Not a
#: zygote forced with ``start_method="fork"`` while threads ran, nor a nested one (it ran
#: the unpickling of a spec: a ``__setstate__`` may start threads).
_clean: weakref.WeakSet = weakref.WeakSet()

#: Seconds a loader waits for a nested zygote's hello before it starts a new interpreter. The
#: hello comes as soon as the fork is done (milliseconds), and a zygote that ended says so at
#: once (its socket closes), so only a zygote that cannot run (stopped, stuck) waits this
#: long, and once: it is then asked for no other loader's; on a loaded
#: machine a slow fork is better waited for than replaced by a new interpreter (~2 s more,
#: importing torch). 15 (5 until December 2026: a nested zygote's test saw a new interpreter
#: once in a full run of the suite on the 2-core machine; the cause was not seen).
HELLO_TIMEOUT_S = 15.0


def clean_zygote() -> Zygote | None:
    """A running zygote that this process forked while it was safe to, to fork a later
    loader's zygote from; ``None`` when there is none."""
    me = os.getpid()
    for z in list(_clean):
        if z.owner == me and not (z.gone or z.broken or z.fatal is not None):
            return z
    return None


class _Foreign:
    """A nested zygote, forked by another zygote: not this process's child, unless this
    process adopted it (a subreaper, or PID 1 in a container) after its parent ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed = False
        self._code: int | None = None

    @property
    def exitcode(self) -> int | None:
        """``None`` while it runs; then its exit code when this process could wait for it
        (adopted), else ``-9`` when :meth:`kill` ended it, else ``0`` (unknown)."""
        if self._code is not None:
            return self._code
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not ours: see whether it still runs
            if _pid_runs(self.pid):
                return None
            self._code = -signal.SIGKILL if self.killed else 0
        else:
            if pid == 0:
                return None
            self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def kill(self) -> None:
        if self.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                self.killed = True
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        pass


def _pid_runs(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended). ``/proc`` tells
    a zombie apart when it is this process's (a ``/proc`` of another PID namespace is not
    read: there ``pid`` may be another process)."""
    try:
        own_proc = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        own_proc = False
    if own_proc:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Zygote:
    """The loader's handle of one zygote (see the module docstring).

    Args:
        kind: ``"fork"``, ``"nested"``, ``"fresh"`` or ``"spawn"`` (see :func:`zygote_kind`).
        spec: what the workers run (a :class:`~autominato.pipeline.worker.WorkSpec`); a
            ``"fork"`` zygote inherits it.
        payload: returns ``spec`` cloudpickled; called only for the other kinds.

    Raises:
        ValueError: ``payload`` does (the spec cannot be pickled).
        OSError: the process could not be started.
    """

    def __init__(self, kind: str, spec: Any, payload: Callable[[], bytes]) -> None:
        self.kind = kind
        #: Its workers descend from the training process by fork (see worker.py on threads).
        self.forked = kind in ("fork", "nested")
        self.owner = os.getpid()
        # a copy of this process while it ran one thread: it may fork other loaders' zygotes
        clean = kind == "fork" and can_fork_now()
        self.gone = False  # its end of the socket closed: it exited (or is exiting)
        self.broken = False  # a request could not be sent: start later workers elsewhere
        self.exitcode: int | None = None
        self.fatal: Any = None  # the ErrorReport of a spec it could not unpickle
        self.fatal_posted = False  # the loader was told (once, with a worker it could not start)
        self.ended_workers = False  # closed by the loader, it ended its workers and exited
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Blocking, whatever socket.setdefaulttimeout says: with a timeout, receive() waited
        # that long for a message (MSG_DONTWAIT or not), then took the zygote for gone
        ours.setblocking(True)
        theirs.setblocking(True)
        try:
            if kind == "fork":
                self._proc: Any = mp.get_context("fork").Process(
                    target=_forked_main, args=(ours, theirs, spec), name="autominato-zygote")
                self._proc.start()
            elif kind == "nested":
                via = clean_zygote()
                if via is None:
                    raise OSError("no zygote of this process to fork a new one from")
                with _boot_file(_meta("fork"), payload()) as boot:
                    via.fork_zygote(theirs.fileno(), boot.fileno())
                theirs.close()
                try:
                    self._proc = _Foreign(_hello(ours))
                except OSError:
                    # No later loader asks it again (each would wait HELLO_TIMEOUT_S): its
                    # own loader keeps it, as a zygote that may still serve that loader.
                    _clean.discard(via)
                    raise
            else:
                self._proc = _start_interpreter(theirs, kind, payload())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid: int = self._proc.pid
        self.ctrl = ours
        if clean:
            _clean.add(self)

    def fork_zygote(self, ctrl_fd: int, boot_fd: int) -> None:
        """Ask this zygote to fork a new one (a *nested* zygote) that serves on socket
        ``ctrl_fd`` the spec in the bootstrap file ``boot_fd`` (see :func:`_bootstrap`); the
        caller closes its copies afterwards. The new zygote says ``("hello", pid)`` first.

        Raises:
            OSError: this zygote is gone.
        """
        with self._lock:
            socket.send_fds(self.ctrl, [pickle.dumps(("zygote",))], [ctrl_fd, boot_fd])

    def request(self, wid: int, fd: int, threads: int | None) -> None:
        """Ask for worker ``wid`` on socket ``fd`` (the caller closes its copy afterwards).

        Raises:
            OSError: the zygote is gone.
        """
        with self._lock:
            socket.send_fds(self.ctrl, [pickle.dumps(("start", wid, threads))], [fd])

    def receive(self) -> list[tuple]:
        """Messages waiting from the zygote (never blocks); sets :attr:`gone` at its end."""
        out = []
        reset = False
        while not self.gone:
            try:
                data = self.ctrl.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except ConnectionResetError:
                if not reset:
                    # It exited with a message of ours unread (a start request, say):
                    # Linux reports that once, to this read or to a send, before the
                    # messages it sent last, which are still queued, its ("fatal", why)
                    # among them (net/unix/af_unix.c unix_release_sock sets the peer's
                    # ECONNRESET; net/core/datagram.c __skb_try_recv_datagram returns
                    # sock_error(), which clears it, before the queue)
                    reset = True
                    continue
                data = b""
            except OSError:
                data = b""
            if not data:
                self.gone = True
                break
            out.append(pickle.loads(data))
        return out

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the process to end (then SIGKILL it); its exit code."""
        deadline = time.monotonic() + timeout
        while self._poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._poll() is None:
            self._proc.kill()
            deadline = time.monotonic() + 1.0
            while self._poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        self.exitcode = self._poll()
        if self.forked and self.exitcode is not None:
            self._proc.close()  # its sentinel pipe, not left to the garbage collector
        return self.exitcode

    def _poll(self) -> int | None:
        # multiprocessing's join() waits on a pipe that the workers inherit too; waitpid does not.
        if self.exitcode is not None:
            return self.exitcode  # reaped (and closed) already
        return self._proc.exitcode if self.forked else self._proc.poll()

    def close(self, timeout: float) -> int | None:
        """Close the socket (the zygote then SIGKILLs the workers left and exits) and reap it.

        Sets :attr:`ended_workers` when it exited by itself (so its workers are gone too)."""
        with self._lock:
            self.ctrl.close()
        self.gone = True
        code = self.reap(timeout)
        # a nested zygote's exit status is unknown unless this process adopted it: the loader
        # ends any worker whose connection is still open itself
        self.ended_workers = code == 0 and self.kind != "nested"
        return code


def _hello(ours: socket.socket) -> int:
    """The pid a nested zygote says first (it is not this process's child).

    Raises:
        OSError: it did not say it within :data:`HELLO_TIMEOUT_S` (the zygote asked to fork
            it ended first, or could not fork): the loader starts a new interpreter instead.
    """
    if not wait([ours], HELLO_TIMEOUT_S):
        raise OSError(f"no nested zygote said hello within {HELLO_TIMEOUT_S:g} s")
    data = ours.recv(1 << 16)
    if not data:
        raise OSError("the zygote asked for a nested one ended first")
    kind, pid = pickle.loads(data)
    if kind != "hello":
        raise OSError(f"a nested zygote said {kind!r} first")
    return pid


def _meta(kind: str) -> dict:
    """What a zygote started from a bootstrap file needs besides the spec (see
    :func:`_bootstrap`): the kind it serves as, this process's ``argv``, ``sys.path``, working
    folder and environment (a nested zygote's are its parent's, from an earlier time), the
    modules to import before forking, and this process's pid (a nested zygote ends when it is
    gone)."""
    return {"kind": kind, "argv": list(sys.argv), "path": list(sys.path), "loader": os.getpid(),
            "cwd": os.getcwd(), "env": dict(os.environ),
            "preload": [m for m in ("numpy", "torch") if m in sys.modules]}


def _boot_file(meta: dict, payload: bytes) -> Any:
    """An anonymous file holding ``meta`` (pickled) then ``payload``, at its start."""
    try:
        boot = os.fdopen(os.memfd_create("autominato-spec"), "w+b")
    except (AttributeError, OSError):  # not Linux
        boot = tempfile.TemporaryFile()
    try:
        pickle.dump(meta, boot)
        boot.write(payload)
        boot.flush()
        boot.seek(0)
    except BaseException:
        boot.close()
        raise
    return boot


def _start_interpreter(ctrl: socket.socket, kind: str, payload: bytes) -> subprocess.Popen:
    """A new interpreter running :func:`_fresh_main`; it reads ``payload`` from a memory file."""
    with _boot_file(_meta(kind), payload) as boot:
        # -c: the new interpreter's __main__ has no file and no module name, so nothing it
        # starts with multiprocessing (spawn-kind workers) re-imports a main module either.
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"from autominato.pipeline.spawn import _fresh_main; "
                f"_fresh_main({ctrl.fileno()}, {boot.fileno()})")
        flags = getattr(subprocess, "_args_from_interpreter_flags", list)()
        return subprocess.Popen([mp_spawn.get_executable(), *flags, "-c", code],
                                pass_fds=(ctrl.fileno(), boot.fileno()), stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------
# Inside the zygote


def _forked_main(ours: socket.socket, theirs: socket.socket, spec: Any) -> None:
    ours.close()
    _exit_after(_serve, theirs, spec, "fork")


def _fresh_main(ctrl_fd: int, boot_fd: int) -> None:
    """Body of a new-interpreter zygote: read the bootstrap, unpickle the spec, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the loader ends it; no traceback on Ctrl-C
    _exit_after(_bootstrap, socket.socket(fileno=ctrl_fd), boot_fd)


def _exit_after(fn: Callable[..., int | None], *args: Any) -> None:
    """Run ``fn`` and exit without the interpreter's exit handlers: multiprocessing's would
    join the workers, which the zygote has already ended (and whose own children may hold
    the pipe that join waits on)."""
    code = 1
    try:
        code = fn(*args) or 0
    except BaseException:  # noqa: BLE001 - a bug here: say what it was, then exit
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _bootstrap(ctrl: socket.socket, boot_fd: int) -> int | None:
    with os.fdopen(boot_fd, "rb") as boot:
        meta = pickle.load(boot)
        sys.argv[:] = meta["argv"]
        # a nested zygote's are its parent zygote's, as the training process had them earlier
        sys.path[:] = meta.get("path", sys.path)
        if "cwd" in meta:
            try:
                os.chdir(meta["cwd"])
            except OSError:
                pass
        if "env" in meta:
            os.environ.clear()
            os.environ.update(meta["env"])
        if meta["kind"] == "spawn":
            spec: Any = boot.read()  # each spawned worker unpickles its own copy
        else:
            try:

                from autominato.pipeline.worker import loads_for_worker

                spec = loads_for_worker(boot)
            except BaseException as e:  # noqa: BLE001 - reported to the training loop
                from autominato.pipeline.errors import ErrorReport

                where = f"the workers' fork server (process {os.getpid()})"
                _send(ctrl, ("fatal", ErrorReport.capture(e, -1, None, where)))
                return 1
    # What the training process had imported and the workers will need: import it once here.
    for name in meta["preload"]:
        try:
            import_module(name)
        except Exception:  # noqa: BLE001 - a worker that needs it reports the error
            pass
    import autominato.pipeline.worker  # noqa: F401
    return _serve(ctrl, spec, meta["kind"], meta.get("loader"))


def _nested_main(ctrl_fd: int, boot_fd: int, inherited: tuple) -> None:
    """Body of a nested zygote, forked by another: drop what is that zygote's, say hello
    (the loader cannot learn the pid of a process that is not its child otherwise), then
    serve the spec of the bootstrap file as a new-interpreter zygote does."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited[1:]:
        os.close(fd)
    inherited[0].close()
    ctrl = socket.socket(fileno=ctrl_fd)
    ctrl.setblocking(True)  # whatever socket.setdefaulttimeout the training process set
    if not _send(ctrl, ("hello", os.getpid())):
        os._exit(0)
    _exit_after(_bootstrap, ctrl, boot_fd)


def _serve(ctrl: socket.socket, spec: Any, kind: str, loader: int | None = None) -> None:
    """The zygote's loop: fork (or spawn) a worker per request, report starts and exits;
    fork a nested zygote on request (see :meth:`Zygote.fork_zygote`).

    It ends when the loader's end of ``ctrl`` closes, or when the loader is gone: its parent
    changed, or, for a nested zygote (whose parent is another zygote), process ``loader``
    ended."""
    from autominato.pipeline.shm import reap_stale_segments

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler inherited from the loader
    parent = os.getppid()
    if loader is None or loader == parent:
        def alive() -> bool:
            return os.getppid() == parent
    else:
        def alive() -> bool:
            return _pid_runs(loader)
    if kind != "spawn":
        try:
            import threadpoolctl

            # Every worker caps its threads with it: finding the libraries once here (their
            # handles are then inherited) takes ~3 ms off each worker's start.
            threadpoolctl.threadpool_info()
        except Exception:  # pragma: no cover - a dependency
            pass
        # Objects that exist now are never collected here or in the workers, so the garbage
        # collector does not write to (and thereby copy) the pages that hold them.
        gc.freeze()
        # Free heap pages are not needed here (a "fork" zygote's are the training process's
        # at the fork; a new interpreter's, what its imports and unpickling freed): given
        # back, they are neither kept here once the training process reuses (and so copies)
        # them, nor mapped into the workers forked from here.
        from autominato.pipeline.worker import give_back_free_heap

        give_back_free_heap()
    ctx = mp.get_context("spawn" if kind == "spawn" else "fork")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the wait below
    signal.signal(signal.SIGCHLD, _ignore)
    inherited = None if kind == "spawn" else (ctrl, wake_r, wake_w)
    children: dict[int, Any] = {}
    nested: list[Any] = []  # zygotes forked for other loaders: reaped here, never killed
    capped: int | None = None  # the thread cap applied here, which forked workers inherit
    try:
        while alive():
            ready = wait([ctrl, wake_r], timeout=1.0)
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            for wid, p in list(children.items()):
                if p.exitcode is not None:  # waitpid: a worker's own children do not delay it
                    del children[wid]
                    if not _send(ctrl, ("exit", wid, p.exitcode)):
                        return
            nested[:] = [p for p in nested if p.exitcode is None]
            if ctrl not in ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(ctrl, 1 << 16, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the loader closed its end, or died
            msg = pickle.loads(data)
            if msg[0] == "zygote":
                try:
                    if kind != "spawn" and len(fds) == 2:
                        p = ctx.Process(target=_nested_main, args=(*fds, inherited),
                                        name="autominato-zygote")
                        p.start()
                        nested.append(p)
                except Exception:  # noqa: BLE001 - the asking loader sees its socket end
                    pass
                finally:
                    for fd in fds:
                        os.close(fd)
                continue
            _, wid, threads = msg
            conn = Connection(fds[0])
            want = threads if threads is not None else getattr(spec, "threads_per_worker", None)
            if kind != "spawn" and want is not None and want != capped:
                # Capped here, the worker inherits the cap and leaves it (see limit_threads):
                # OpenBLAS's threads started by setting it stop at the fork below.
                from autominato.pipeline.worker import limit_threads

                limit_threads(want)
                capped = want
            try:
                # The spec in a list that the worker empties: a spawned worker then frees the
                # pickled bytes once it has unpickled them (the Process keeps its arguments).
                p = ctx.Process(target=_worker_main, args=(wid, conn, [spec], threads, inherited),
                                name=f"autominato-worker-{wid}")
                # Not a daemon: a transform may start a process pool of its own.
                p.start()
            except Exception as e:  # noqa: BLE001 - out of processes or memory: a death
                reply: tuple = ("failed", wid, f"{type(e).__name__}: {e}")
            else:
                children[wid] = p
                reply = ("started", wid, p.pid)
            finally:
                conn.close()
            if not _send(ctrl, reply):
                return
    finally:
        for p in children.values():
            p.kill()
        deadline = time.monotonic() + 2.0
        for p in children.values():
            while p.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
        # A loader killed (SIGKILL, the kernel's out-of-memory killer) cannot unlink its
        # segments: they stayed in /dev/shm, holding memory, until a pool of a later run
        # reaped them (trial 193). Its fork server outlives it and does so now (a fork child
        # holds no copy of a pool's lock: shm._drop_lock_fds); a pool alive holds its lock,
        # so only the segments of owners gone are removed.
        try:
            reap_stale_segments()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def _worker_main(wid: int, conn: Connection, box: list, threads: int | None,
                 inherited: tuple | None) -> None:
    if inherited is not None:  # forked from the zygote: drop what is the zygote's
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctrl, wake_r, wake_w = inherited
        ctrl.close()
        os.close(wake_r)
        os.close(wake_w)
    from autominato.pipeline.worker import process_main

    process_main(wid, conn, box.pop(), threads)


def _send(ctrl: socket.socket, msg: tuple) -> bool:
    try:
        ctrl.send(pickle.dumps(msg))
        return True
    except OSError:
        return False  # the loader is gone


def _ignore(signum: int, frame: Any) -> None:
    pass
