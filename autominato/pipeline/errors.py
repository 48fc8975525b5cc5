"""Errors that cross from a worker to the training loop.

An exception raised while reading or transforming a sample is caught where it happened, sent
back as an :class:`ErrorReport` (always picklable), and re-raised in the training loop:

* when the original exception survives a pickle round trip with its message, that same type
  and message is raised, with the worker's traceback as its ``__cause__`` (as
  :mod:`concurrent.futures` does) and a note naming the sample index, file and worker;
* otherwise (a constructor with several required arguments, or one that formats its message
  from its argument, so that loading formats it twice) the same type is rebuilt without
  calling its ``__init__``: its class, ``args`` and attributes (the builtin base's
  ``__init__`` fills what C code derives from ``args``, as ``OSError.errno``, and from the
  ``filename`` an ``OSError`` keeps out of ``args``); a class pickled by a builtin base's
  ``__reduce__`` (``OSError``'s too) is checked for its message like any other; when an
  argument or attribute does not pickle (an open file, a lock), its type with its message,
  as the DataLoader rebuilds it;
* when none of that can be rebuilt in the training process (a class defined in a function, a
  ``__str__`` that needs a dropped attribute), and for an exception that is no ``Exception``
  (``SystemExit`` from ``sys.exit`` in a sample, which re-raised would end the training
  process with status 0, as if it had succeeded), a :class:`SampleError` carrying the
  original type name, message and traceback is raised.

Either way the raised exception has the attributes ``sample_index``, ``sample_path`` and
``worker``.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass


class SampleError(RuntimeError):
    """A sample could not be read or transformed.

    Attributes:
        sample_index: the dataset index of the sample.
        sample_path: the file the dataset reads it from (``None`` if the dataset does not say).
        worker: ``"process <pid>"``, ``"thread <name>"`` or ``None``.
        original_type: qualified name of the exception raised in the worker.
        remote_traceback: the worker's formatted traceback.
    """

    def __init__(
        self,
        message: str,
        *,
        sample_index: int | None = None,
        sample_path: str | None = None,
        worker: str | None = None,
        original_type: str | None = None,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.sample_index = sample_index
        self.sample_path = sample_path
        self.worker = worker
        self.original_type = original_type
        self.remote_traceback = remote_traceback

    def __reduce__(self):  # keep the keyword-only attributes through pickling
        return (
            _rebuild_sample_error,
            (
                self.args[0] if self.args else "",
                self.sample_index,
                self.sample_path,
                self.worker,
                self.original_type,
                self.remote_traceback,
            ),
        )


def _rebuild_sample_error(message, index, path, worker, original_type, tb):
    return SampleError(
        message,
        sample_index=index,
        sample_path=path,
        worker=worker,
        original_type=original_type,
        remote_traceback=tb,
    )


class WorkerDied(SampleError):
    """A worker process died (a signal such as SIGKILL from the OOM killer, or an exit)."""


class SampleTimeout(SampleError, TimeoutError):
    """A sample took longer than the loader's ``sample_timeout``; its worker was replaced."""


class WorkerInitError(RuntimeError):
    """``worker_init_fn`` raised in a worker; the original exception is the cause.

    What the training loop gets is also of the original exception's type (a class deriving
    from both, made by :func:`with_original_type`), as the DataLoader re-raises the original
    type: ``except ValueError`` catches a ``worker_init_fn`` that raised ``ValueError``. Not
    for a ``StopIteration`` (it would end the training loop's ``for`` silently) nor for what
    is no ``Exception`` (``SystemExit``, ``KeyboardInterrupt``).

    Attributes:
        original_type: ``(module, qualname)`` of the exception ``worker_init_fn`` raised.
    """

    def __init__(self, *args: object, original_type: tuple[str, str] | None = None) -> None:
        super().__init__(*args)
        self.original_type = original_type

    def __reduce__(self) -> tuple:
        # The class made by with_original_type has no importable name: rebuild it on load.
        return (_rebuild_init_error, (self.args, dict(self.__dict__)))


def _rebuild_init_error(args: tuple, state: dict) -> BaseException:
    err = WorkerInitError(*args)
    err.__dict__.update(state)
    return with_original_type(err)


_DUAL: dict[type, type] = {}


def with_original_type(err: BaseException) -> BaseException:
    """``err`` as an exception of both ``WorkerInitError`` and the type ``worker_init_fn``
    raised (``err.original_type``, looked up among the modules already imported), with the
    same message, cause, notes and attributes; ``err`` itself when there is no such type, or
    it is no ``Exception`` or a ``StopIteration``, or the two cannot be combined. The original
    type's ``__init__`` is not run (its arguments are not the message's)."""
    import sys

    spec = getattr(err, "original_type", None)
    if not isinstance(err, WorkerInitError) or not spec or type(err) is not WorkerInitError:
        return err
    try:
        cls = _exception_class(spec[0], spec[1], sys.modules.get(spec[0]))
        if (not issubclass(cls, Exception)
                or issubclass(cls, (StopIteration, StopAsyncIteration, WorkerInitError))):
            return err
        dual = _DUAL.get(cls)
        if dual is None:
            dual = _DUAL[cls] = type("WorkerInitError", (cls, WorkerInitError), {
                "__module__": __name__, "__qualname__": "WorkerInitError",
                "__str__": BaseException.__str__, "__init__": BaseException.__init__,
                "__reduce__": WorkerInitError.__reduce__})
        new = dual.__new__(dual, *err.args)
        new.args = err.args
    except Exception:
        return err
    new.__dict__.update(err.__dict__)
    new.__cause__ = err.__cause__
    new.__traceback__ = err.__traceback__
    return new


class CollateError(RuntimeError, ValueError):
    """Samples that cannot be stacked into one batch (arrays of different shapes or dtypes,
    sequences of different lengths).

    A ``RuntimeError``, as ``torch.utils.data.default_collate``'s error for samples of
    unequal shapes or sequence lengths (so code written for DataLoader catches it), and a
    ``ValueError`` (what autominato raised up to 0.1.0; kept so that code written for that
    still catches it). Unlike ``default_collate``, which promotes arrays of different dtypes
    to a common one (float32 and float64 stack as float64), autominato refuses them: the
    batch buffers are pooled per dtype.
    """


def note_batch(error: BaseException, indices: list,
               path_of: Callable[[int], str | None]) -> None:
    """Add to ``error`` (a collate function's, or a pin's) a note naming the batch's samples:
    their dataset indices and, where ``path_of(index)`` tells them, files (trial 82: a file
    that loaded with a wrong shape failed its batch, and the error named no sample). An
    iterable dataset's samples (index -1) are not named."""
    if not isinstance(error, Exception) or not hasattr(error, "add_note"):
        return
    notes = getattr(error, "__notes__", [])
    if any(n.startswith("[autominato] collating") for n in notes):
        return  # (one instance raised again: its first batch's note stays)
    if not indices:  # (the DataLoader too calls collate_fn([]): default_collate's IndexError)
        error.add_note("[autominato] collating an empty batch (the batch_sampler gave []) "
                       "failed")
    elif any(int(i) < 0 for i in indices):  # an iterable dataset's: no index
        error.add_note("[autominato] collating a batch failed")
    else:
        paths = [path_of(int(i)) for i in indices]
        error.add_note(f"[autominato] collating the batch of sample indices "
                       f"{[int(i) for i in indices]}"
                       + (f" (files {paths})" if any(paths) else "") + " failed")


class _RemoteTraceback(Exception):
    """Holds a worker's traceback text so that it prints under the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` of ``exc``, even when its ``__str__`` raises."""
    try:
        message = str(exc)
    except Exception:
        message = "<str() failed>"
    return f"{type(exc).__name__}: {message}"


@dataclass
class ErrorReport:
    """A picklable description of an exception raised for one sample."""

    index: int
    path: str | None
    worker: str
    type_name: str
    message: str
    traceback: str
    pickled: bytes | None
    original: BaseException | None = None  # set only when raised in this process

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["original"] = None  # the live object never crosses a process boundary
        return state

    @classmethod
    def capture(cls, exc: BaseException, index: int, path: str | None, worker: str) -> ErrorReport:
        """Describe ``exc`` (call inside the ``except`` block that caught it)."""
        t = type(exc)
        tb = "".join(traceback.format_exception(t, exc, exc.__traceback__))
        pickled: bytes | None
        whole: bytes | None = None  # it pickles and loads, its message changed or not
        try:
            pickled = pickle.dumps(exc)
            back = pickle.loads(pickled)  # a multi-argument constructor fails only on load
            whole = pickled
            if _builtin_reduce(t) and _message(back) != _message(exc):
                # Loading calls __init__(*args) again: a constructor that formats its message
                # (super().__init__(f"code {code}")) formats it twice, "code code 5". (A class
                # that defines how it pickles is trusted with it; a builtin base's, such as
                # OSError's, is not the class's own.)
                raise ValueError("the message changed through pickle")
        except Exception:
            # Rebuild without calling __init__ (which may need other arguments than .args):
            # the class, .args and the attributes are enough for a readable original.
            # Then, when an argument or attribute cannot be pickled (an open file, a lock), the
            # type with its message alone, as the DataLoader rebuilds it (``exc_type(msg)``).
            pickled = None
            # First with what the builtin base keeps outside args and vars (an OSError's
            # filename and errno, an ImportError's name), then without (a filename that does
            # not pickle), then the message alone.
            for parts in (lambda: (exc.args, vars(exc), _init_args(exc), _c_fields(exc)),
                          lambda: (exc.args, vars(exc), exc.args, {}),
                          lambda: ((_message(exc),), {}, (_message(exc),), {})):
                try:
                    pickled = pickle.dumps(("parts", t.__module__, t.__qualname__, *parts()))
                    # (and it must print: a __str__ that reads a dropped attribute would not)
                    str(_from_parts(pickle.loads(pickled)))
                    break
                except Exception:
                    pickled = whole  # (its own round trip, message and all, as a last resort)
        return cls(index, path, worker, f"{t.__module__}.{t.__qualname__}", _message(exc), tb,
                   pickled)

    def where(self) -> str:
        if self.index < 0:  # not a dataset index (worker_init_fn, an iterable's stream)
            return f"in {self.worker}"
        where = f"sample index {self.index}"
        if self.path:
            where += f" (file {self.path})"
        return f"{where} failed in {self.worker}"

    def to_exception(self) -> BaseException:
        """Rebuild the exception to raise in the training loop (see the module docstring)."""
        exc: BaseException | None = self.original
        if exc is None and self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
                if isinstance(exc, tuple):
                    exc = _from_parts(exc)
            except Exception:
                exc = None
        exit_like = exc is not None and not isinstance(exc, Exception)
        if exit_like:
            # SystemExit (sys.exit in a sample), GeneratorExit, a KeyboardInterrupt the sample
            # raised itself: re-raised as such they would end the training process quietly, with
            # sys.exit's status (0: as if it had succeeded). The DataLoader raises a
            # RuntimeError there ("worker exited unexpectedly").
            exc = None
        if exc is None:
            hint = " (sys.exit in the sample's code?)" if self.type_name.endswith(
                "SystemExit") else ""
            what = (f"{self.type_name}: {self.message}" if not exit_like else
                    f"{self.type_name}({self.message}) was raised{hint}, which is raised here "
                    "as a SampleError, not as itself, so that the training process does not "
                    "end quietly")
            exc = SampleError(
                f"{self.where()}: {what}",
                sample_index=self.index,
                sample_path=self.path,
                worker=self.worker,
                original_type=self.type_name,
                remote_traceback=self.traceback,
            )
        else:
            try:
                exc.sample_index = self.index  # type: ignore[attr-defined]
                exc.sample_path = self.path  # type: ignore[attr-defined]
                exc.worker = self.worker  # type: ignore[attr-defined]
            except Exception:
                pass
            if hasattr(exc, "add_note"):
                exc.add_note(f"[autominato] {self.where()}")
        if exc is not self.original:
            # (before Python 3.11 no note: the sample's index and file head the cause)
            head = (f"Traceback in {self.worker}" if hasattr(exc, "add_note")
                    else f"[autominato] {self.where()}; traceback in {self.worker}")
            exc.__cause__ = _RemoteTraceback(f"\n\n{head}:\n{self.traceback}")
        return with_original_type(exc)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: str() failed>"


def _exception_class(module: str, qualname: str, found: object) -> type[BaseException]:
    """The class ``qualname`` in the module object ``found`` (named ``module``).

    Raises:
        AttributeError: no such name; TypeError: it is no exception class.
    """
    cls = found
    for name in qualname.split("."):
        cls = getattr(cls, name)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise TypeError(f"{module}.{qualname} is not an exception class")
    return cls


def _builtin_reduce(t: type) -> bool:
    """Whether class ``t`` pickles by a builtin base's ``__reduce__`` (``BaseException``'s,
    ``OSError``'s: its constructor called again with the arguments), not one of its own."""
    owner = next((c for c in t.__mro__ if "__reduce__" in vars(c)), object)
    return owner.__module__ == "builtins"


def _init_args(exc: BaseException) -> tuple:
    """The arguments ``exc``'s builtin base is built from: ``exc.args``, but an ``OSError``'s
    with its ``filename`` (and ``filename2``), which it keeps out of ``args``: what the
    builtin ``__reduce__`` gives, when the class pickles by it."""
    if _builtin_reduce(type(exc)):
        try:
            reduced = exc.__reduce__()
            if isinstance(reduced, tuple) and len(reduced) > 1 and isinstance(reduced[1], tuple):
                return reduced[1]
        except Exception:  # noqa: BLE001 - a broken exception: its args as they are
            pass
    return exc.args


#: Fields builtin exceptions keep in C (data descriptors: neither in ``args`` nor in
#: ``vars()``), by the builtin class that has them.
_C_FIELDS = ((OSError, ("errno", "strerror", "filename", "filename2")),
             (BlockingIOError, ("characters_written",)),
             (ImportError, ("name", "path")))


def _c_fields(exc: BaseException) -> dict:
    """The :data:`_C_FIELDS` that ``exc`` has set (not ``None``), by name."""
    fields = {}
    for cls, names in _C_FIELDS:
        if isinstance(exc, cls):
            for name in names:
                value = getattr(exc, name, None)  # (BlockingIOError's: AttributeError unset)
                if value is not None:
                    fields[name] = value
    return fields


def _from_parts(parts: tuple) -> BaseException:
    import importlib

    _, module, qualname, args, attrs, *more = parts
    init = more[0] if more else args  # (what the builtin base is built from: see _init_args)
    fields = more[1] if len(more) > 1 else {}  # (see _c_fields)
    cls = _exception_class(module, qualname, importlib.import_module(module))
    exc = cls.__new__(cls, *init)
    # Not the class's __init__ (it may need other arguments, or format the message anew), but
    # its builtin base's: fields that C code derives from the arguments (OSError's errno,
    # strerror and filename, a UnicodeError's start and end) are set there.
    base = next(c for c in cls.__mro__ if c.__module__ == "builtins")
    try:
        base.__init__(exc, *init)
    except Exception:  # noqa: BLE001 - arguments that base does not take: args alone
        pass
    for name, value in fields.items():  # (set after __init__: the class may have set them so)
        try:
            setattr(exc, name, value)
        except (AttributeError, TypeError):  # a subclass that made one read-only
            pass
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


def log_skip(index: int, path: str | None, error: BaseException, logged: set) -> None:
    """Log sample ``index`` (file ``path``) skipped by ``on_error="skip"``: a warning the first
    time (a corrupt file is skipped every epoch), then at debug level; ``logged`` holds the
    indices warned about already and is updated. ``index < 0``: a sample of an iterable
    dataset (no index; its error's note names the shard), told once per distinct error."""
    what = describe(error)
    key = index if index >= 0 else what
    level = logging.DEBUG if key in logged else logging.WARNING
    if len(logged) < 100_000:  # an endless stream of distinct errors: bounded memory
        logged.add(key)
    if index < 0:
        logging.getLogger("autominato.pipeline").log(
            level, "skipping a sample of the iterable dataset: %s", what)
        return
    logging.getLogger("autominato.pipeline").log(
        level, "skipping sample index %d%s: %s", index, f" (file {path})" if path else "", what)
