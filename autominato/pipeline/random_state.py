"""Which objects of a dataset and a transform hold random state of their own, per worker.

MONAI's random transforms (``monai.transforms.Randomizable``: ``RandSpatialCropd``,
``RandFlipd``, ``Compose``, ``OneOf``, ...) draw from a ``numpy.random.RandomState`` of their
own, ``self.R``, not from a global generator. Left alone, that state advances per worker:
forked workers start from the same state, so the k-th sample of every worker gets the same
crop, and a sample's augmentation depends on the worker that ran it and on the worker count.
:func:`plan` finds these objects once per worker (thread or process) so that
:func:`autominato.pipeline.worker.run_sample` can reseed them before each sample from
``(seed, epoch, index)`` (and the occurrence of an index the sampler repeats: see
:func:`autominato.pipeline.worker.sample_rng`).

The walk follows attributes (``__dict__``), lists, tuples and dicts, as MONAI's own
``monai.data.utils.set_rnd`` walks a dataset for its ``worker_init_fn``, and goes on inside a
``Randomizable`` too (a dictionary transform keeps its array transform in an attribute:
``RandSpatialCropd.cropper``, ``RandAffined.rand_affine.rand_affine_grid``), and through the
user's code (:func:`_code_children`: a partial's arguments, a bound method's object, a user
function's closure, defaults and the globals it names, the functions of a user's class; trial
141: a transform behind a ``partial`` was not reseeded). Nothing is walked
unless MONAI is imported in the process (no MONAI object can exist otherwise).

Threads: MONAI marks ``Randomizable`` as ``ThreadUnsafe`` (``randomize()`` stores its draws on
the object for ``__call__`` to read), so a worker thread other than the process's main thread
works on its own copy: each ``Randomizable`` deep-copied, the objects and containers that lead
to one shallow-copied, everything else (a dataset's file list, its cache, open files) shared.
The main thread (a worker process, or ``num_workers=0`` loading in the training loop) uses the
objects themselves, as the DataLoader does.
"""

from __future__ import annotations

import copy
import dis
import functools
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Objects never walked into: they cannot hold a transform. (Functions and methods are walked
#: where they are the user's code: :func:`_code_children`. A thread's target, a started
#: SmartCacheDataset's replacement thread, led the walk back to the original dataset:
#: review 156.)
_LEAVES = (str, bytes, bytearray, int, float, complex, type(None), np.ndarray, np.generic, type,
           types.ModuleType, types.BuiltinFunctionType, types.CodeType, threading.Thread,
           type(threading.Lock()), type(threading.RLock()), threading.Condition,
           threading.Event, threading.Semaphore)

#: Top-level packages whose code is never walked (their functions' globals are library
#: state, not the user's transforms): the standard library's and these.
_LIBRARY_TOPS = frozenset({"autominato", "numpy", "torch", "monai", "scipy", "nibabel",
                           "lightning", "pytorch_lightning", "ray", "cloudpickle", "pandas"})
_user_modules: dict[str, bool] = {}


def randomizable_class() -> type | None:
    """``monai.transforms.Randomizable`` when MONAI is imported in this process, else None."""
    mod = sys.modules.get("monai.transforms.transform")
    return getattr(mod, "Randomizable", None)


def _is_leaf(obj: Any) -> bool:
    if isinstance(obj, _LEAVES):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _users_module(name: Any) -> bool:
    """Whether module ``name`` is the user's code: a script (``__main__``, a spawned rank's
    ``__mp_main__``) or a module not of the standard library, of :data:`_LIBRARY_TOPS`, or
    installed (under ``site-packages`` / ``dist-packages``)."""
    if not isinstance(name, str):
        return False
    hit = _user_modules.get(name)
    if hit is None:
        top = name.partition(".")[0]
        if name in ("__main__", "__mp_main__"):
            hit = True
        elif top in sys.stdlib_module_names or top in _LIBRARY_TOPS:
            hit = False
        else:
            path = str(getattr(sys.modules.get(name), "__file__", None) or "")
            hit = "site-packages" not in path and "dist-packages" not in path
        _user_modules[name] = hit
    return hit


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` and the code nested in it (comprehensions, inner functions) use as
    globals: those of its global loads and stores (cloudpickle's rule for what a function
    needs), not every name of ``co_names``, which holds attribute names too (trial 155: a
    method's ``self.tf`` read the module's global ``tf``)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(n for n in names if isinstance(n, str))


def _function_reach(fn: types.FunctionType) -> tuple[list, dict[str, Any]]:
    """What a user's function ``fn`` reaches: its closure's values, defaults and keyword
    defaults (a list), and the module globals its code names (a dict by name)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            values.append(None)
    values += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    g = fn.__globals__
    return values, {n: g[n] for n in sorted(_global_names(fn.__code__)) if n in g}


def _code_children(obj: Any) -> list:
    """What a callable reaches through code rather than attributes: a ``functools.partial``'s
    function and arguments, a bound method's object and function, and a user's function's
    closure, defaults and the globals it names; an object of a user's class, the functions
    its class defines (``__call__``, ``__getitem__``: a transform they name as a global).
    Library code (:func:`_users_module`) is not walked."""
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *(obj.keywords or {}).values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        if not _users_module(getattr(obj, "__module__", None)):
            return []
        values, named = _function_reach(obj)
        return values + list(named.values())
    return _class_functions(type(obj))


_class_fns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _class_functions(klass: type) -> list:
    """The functions that the user's classes among ``klass``'s bases define (cached)."""
    try:
        return _class_fns[klass]
    except (KeyError, TypeError):
        pass
    out = [f for k in klass.__mro__ if k is not object and _users_module(k.__module__)
           for f in vars(k).values() if isinstance(f, types.FunctionType)]
    try:
        _class_fns[klass] = out
    except TypeError:  # (a class that takes no weak reference)
        pass
    return out


#: Objects reached through code (:func:`_code_children`) that the walk follows, at most:
#: beyond, the rest of what code reaches is not walked (review 154: a ``__getitem__`` that
#: named a global metadata list of 1M dicts took the walk 4-5 s per worker). Containers
#: reached so are followed up to :data:`CODE_CONTAINER_MAX` items.
CODE_WALK_MAX = 20_000
CODE_CONTAINER_MAX = 256


def _attr_ids(obj: Any) -> tuple:
    """``(name, id(value))`` of ``obj``'s attributes (what a shallow copy of it shares)."""
    d = _own_dict(obj)
    return tuple((k, id(v)) for k, v in list(d.items())) if d is not None else ()


def _smart_cache_class() -> type | None:
    """``monai.data.SmartCacheDataset`` when MONAI is imported, else None."""
    return getattr(sys.modules.get("monai.data"), "SmartCacheDataset", None)


def _replaces_cache(obj: Any) -> bool:
    """Whether ``obj`` is MONAI's ``SmartCacheDataset``."""
    cls = _smart_cache_class()
    return cls is not None and isinstance(obj, cls)


def holds_smart_cache(dataset: Any) -> bool:
    """Whether ``dataset`` is, or holds as a dataset, MONAI's ``SmartCacheDataset``, whose
    cache the training process replaces between epochs (``update_cache()``; trial 155:
    process workers trained on its first cache). Looked for in the datasets among the
    attributes, as a ``Subset``'s ``dataset`` or a ``ConcatDataset``'s ``datasets`` (review
    156), up to 64 datasets; ``False`` where MONAI is not imported."""
    cls = _smart_cache_class()
    base = getattr(sys.modules.get("torch.utils.data"), "Dataset", None)
    if cls is None or base is None:
        return False
    stack, seen = [dataset], set()
    while stack and len(seen) < 64:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if isinstance(d, cls):
            return True
        for v in (_own_dict(d) or {}).values():
            if isinstance(v, base):
                stack.append(v)
            elif (isinstance(v, (list, tuple)) and len(v) <= 64
                  and all(isinstance(x, base) for x in v)):
                stack.extend(v)
    return False


def _own_dict(obj: Any) -> dict | None:
    """``obj.__dict__`` read without ``__getattr__`` (a lazy proxy opened its file when the
    walk asked it; one that raised failed every epoch: review 154); ``None`` where it has
    none or reading it raises."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - any failure makes it a leaf
        return None
    return d if isinstance(d, dict) else None


def _children(obj: Any) -> Any:
    """What the walk follows from ``obj`` by data: a container's items, an object's
    attributes (not copied: a dataset's list of 100k file dicts is iterated once)."""
    if isinstance(obj, (list, tuple)):
        return obj
    if isinstance(obj, dict):
        return obj.values()
    d = _own_dict(obj)
    return d.values() if d is not None else ()


def _follow_from_code(obj: Any, cls: tuple) -> bool:
    """Whether the walk follows ``obj``, reached through code: what may hold a random
    transform of the user's (a function, partial or method; an instance of ``cls``, of a
    user's class or of MONAI's; a container of up to :data:`CODE_CONTAINER_MAX` items), not
    a library's other objects (a Loader, a model, a data frame: review 154 saw a global
    Loader copied by thread workers) nor a large container."""
    if isinstance(obj, (list, tuple, dict)):
        return len(obj) <= CODE_CONTAINER_MAX
    if isinstance(obj, (functools.partial, types.MethodType, types.FunctionType)):
        return True
    if cls and isinstance(obj, cls):
        return True
    module = getattr(type(obj), "__module__", None)
    return _users_module(module) or (isinstance(module, str)
                                     and module.partition(".")[0] == "monai")


def find_parts(root: Any, cls: type) -> list:
    """Every instance of ``cls`` reachable from ``root``, each once, in a fixed order (depth
    first, attributes in definition order), so that every copy of ``root`` lists its parts in
    the same order. Cycles are followed once."""
    return find_parts_of(root, (cls,))[0]


def find_parts_of(root: Any, classes: tuple) -> list[list]:
    """:func:`find_parts` of each class of ``classes`` in one walk (a list each; an object of
    several classes is in each of their lists; a class that is ``None`` finds nothing).
    What only code reaches (:func:`_code_children`) is followed as
    :func:`_follow_from_code` says, up to :data:`CODE_WALK_MAX` objects."""
    found: list[list] = [[] for _ in classes]
    kinds = [(k, c) for k, c in enumerate(classes) if c is not None]
    wanted = tuple(c for _, c in kinds)
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    by_code = 0
    while stack:
        obj, via_code = stack.pop()
        if _is_leaf(obj) or id(obj) in seen:
            continue
        if via_code:
            if by_code >= CODE_WALK_MAX or not _follow_from_code(obj, wanted):
                continue
            by_code += 1
        seen.add(id(obj))
        for k, cls in kinds:
            if isinstance(obj, cls):
                found[k].append(obj)
        try:
            code = [] if isinstance(obj, (list, tuple, dict)) else _code_children(obj)
        except Exception:  # noqa: BLE001 - an object the walk cannot read is a leaf
            code = []
        nxt = [(c, via_code) for c in _children(obj) if not _is_leaf(c)]
        nxt += [(c, True) for c in code if not _is_leaf(c)]
        stack.extend(reversed(nxt))
    if by_code >= CODE_WALK_MAX:
        log.debug("autominato: the walk for MONAI random transforms stopped following code "
                  "after %d objects", CODE_WALK_MAX)
    return found


def isolate(root: Any, cls: type) -> Any:
    """``root`` itself when no instance of ``cls`` is reachable from it; else a copy in which
    every such instance is deep-copied and the objects and containers on the way to one are
    shallow-copied (everything else is shared with ``root``)."""
    deep_memo: dict = {}
    done: dict[int, Any] = {}

    def walk(obj: Any) -> Any:
        key = id(obj)
        if key in done:
            return done[key]
        done[key] = obj  # a cycle back to obj keeps the original
        # MONAI's SmartCacheDataset, Randomizable itself (it shuffles what it caches next in
        # the training process), is not deep-copied, which copied its cache and its lock
        # (trial 155: every sample failed, "cannot pickle '_thread.lock'") and froze the cache
        # the training process replaces: it takes the shallow copy below, which shares its
        # data, with its own RandomState (other Randomizable datasets are deep-copied as
        # before: a shallow copy shared their state between the threads, review 156).
        smart = isinstance(obj, cls) and _replaces_cache(obj)
        if isinstance(obj, cls) and not smart:
            new = copy.deepcopy(obj, deep_memo)
        elif isinstance(obj, (functools.partial, types.MethodType)):
            new = _isolate_callable(obj, walk)
        elif isinstance(obj, types.FunctionType):
            new = obj  # (its closure and globals are shared: plan() says so where they hold one)
        elif isinstance(obj, (list, tuple, dict)):
            items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
            changed = {k: n for k, v in items if not _is_leaf(v) and (n := walk(v)) is not v}
            if not changed:
                new = obj
            elif isinstance(obj, dict):
                new = copy.copy(obj)
                new.update(changed)
            else:
                values = [changed.get(k, v) for k, v in items]
                new = (obj._make(values) if hasattr(obj, "_fields")
                       else values if isinstance(obj, list) else type(obj)(values))
        else:
            d = _own_dict(obj)
            changed = ({k: n for k, v in list(d.items()) if not _is_leaf(v) and (n := walk(v)) is not v}
                       if d is not None else {})
            if changed or smart:
                new = copy.copy(obj)
                new.__dict__.update(changed)
                if smart:
                    new.R = np.random.RandomState()
            else:
                new = obj
        done[key] = new
        return new

    return root if _is_leaf(root) else walk(root)


def _isolate_callable(obj: Any, walk: Callable[[Any], Any]) -> Any:
    """:func:`isolate`'s copy of a partial or bound method whose arguments or object hold a
    random transform: the same callable over the copies; else ``obj``. (A function's closure
    and globals are not copied: a copy of its module's globals would freeze them for the
    thread, and ``global`` / ``nonlocal`` writes would not reach the module: review 154.)"""

    def moved(v: Any) -> Any:
        return v if _is_leaf(v) else walk(v)

    if isinstance(obj, functools.partial):
        func, args = moved(obj.func), [moved(a) for a in obj.args]
        kw = {k: moved(v) for k, v in (obj.keywords or {}).items()}
        if func is obj.func and all(a is b for a, b in zip(args, obj.args, strict=True)) and all(
                kw[k] is v for k, v in (obj.keywords or {}).items()):
            return obj
        new = type(obj)(func, *args, **kw)
        new.__dict__.update(obj.__dict__)
        return new
    self_, func = moved(obj.__self__), obj.__func__
    return obj if self_ is obj.__self__ else types.MethodType(func, self_)


@dataclass
class Plan:
    """A worker's dataset and transform (its own copies in a non-main thread) and the
    ``Randomizable`` parts of each, in walk order."""

    dataset: Any
    transform: Any
    dataset_parts: list = field(default_factory=list)
    transform_parts: list = field(default_factory=list)
    #: ``id`` of each MONAI ``TraceableTransform`` copy here -> its original's in the training
    #: process, where they differ (:func:`_trace_map`); empty where the objects are the same.
    trace_map: dict = field(default_factory=dict)


_local = threading.local()
log = logging.getLogger("autominato.pipeline")


def plan(spec: Any) -> Plan:
    """The :class:`Plan` of ``spec`` (a :class:`~autominato.pipeline.worker.WorkSpec`) for the
    calling thread, built at its first call in the thread and cached while ``spec`` lives and
    holds the same dataset and transform.

    Every part is given a ``RandomState`` of its own when it still uses the class attribute
    ``Randomizable.R`` (shared by every instance that never called ``set_random_state``), so
    that reseeding it touches nothing else."""
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = {}
    hit = plans.get(id(spec))
    # The spec's dataset may be replaced (persistent_workers=False sends it anew each epoch).
    if (hit is not None and hit[0]() is spec and hit[2] is spec.dataset
            and hit[3] is spec.transform and (hit[4] is None or hit[4] == _attr_ids(spec.dataset))):
        return hit[1]
    cls = randomizable_class()
    dataset, transform = spec.dataset, spec.transform
    if cls is None:
        return Plan(dataset, transform)  # nothing to cache: MONAI may be imported later
    thread = threading.current_thread() is not threading.main_thread()
    if thread:
        try:
            dataset, transform = isolate(dataset, cls), isolate(transform, cls)
        except RecursionError:  # a structure nested deeper than Python's recursion limit
            log.warning("autominato: the dataset or transform is nested too deeply to copy its "
                        "MONAI random transforms for thread %s; the thread shares them (MONAI's "
                        "Randomizable is not thread-safe: use process workers)",
                        threading.current_thread().name)
    traceable = traceable_class()
    (d_parts, d_traced), (t_parts, t_traced) = (find_parts_of(dataset, (cls, traceable)),
                                                find_parts_of(transform, (cls, traceable)))
    if thread and (d_parts or t_parts):
        originals = {id(p) for root in (spec.dataset, spec.transform) for p in find_parts(root, cls)}
        shared = [type(p).__name__ for p in d_parts + t_parts if id(p) in originals]
        if shared and not getattr(_local, "warned_shared", False):
            _local.warned_shared = True
            log.warning("autominato: MONAI random transforms (%s) reachable only through "
                        "code (a function's closure or globals, a class's methods) or a "
                        "structure that cannot be copied are shared by thread %s and the "
                        "others (MONAI's Randomizable is not thread-safe: hold them in an "
                        "attribute or a functools.partial's arguments, or use process workers)",
                        ", ".join(sorted(set(shared))), threading.current_thread().name)
    p = Plan(dataset, transform, d_parts, t_parts,
             _trace_map(spec, dataset, transform, d_traced + t_traced))
    for part in (*p.dataset_parts, *p.transform_parts):
        if "R" not in vars(part):
            part.R = np.random.RandomState()
    for k in [k for k, (ref, *_) in plans.items() if ref() is None]:
        del plans[k]  # plans of loaders gone
    # A thread's copy of the dataset (a shallow copy on the way to its random transforms)
    # is made again when the training process rebinds one of the dataset's attributes
    # (``ds.data = new_list``, SmartCacheDataset's ``set_data()``: the copy served the old
    # ones, review 156); a change deeper down is seen where it is made in place.
    ids = _attr_ids(spec.dataset) if p.dataset is not spec.dataset else None
    plans[id(spec)] = (weakref.ref(spec), p, spec.dataset, spec.transform, ids)
    return p


# -- MONAI's invertible transforms: the ids they record ----------------------------------------
#
# An invertible transform records ``id(self)`` in each sample's ``applied_operations``
# (``TraceKeys.ID``), and ``Invertd`` / ``Compose.inverse`` in the training process refuse a
# record whose id is not the inverting transform's own there (``RuntimeError: ... getting the
# most recently applied invertible transform``; MONAI lets it pass by class name only where
# torch's start method is ``spawn``). A worker forked from the training process holds the same
# objects at the same addresses; one that unpickled them (a new interpreter, another Loader's
# zygote, a dataset sent again, a Ray actor) or a thread's copies hold others. The training
# process lists its transforms' ids in walk order (:func:`trace_ids`, ``WorkSpec.trace_ids``),
# a worker pairs them with its copies in the same order (:func:`_trace_map`), and
# :func:`retrace` puts them into each sample's records (trial 141: a validation Loader built
# while a training Loader ran gave batches no one could invert). Nothing is written on the
# user's objects (review 143: an attribute there changed their pickle, and with it MONAI's
# ``PersistentDataset`` hashes of the transforms, at every run).


def traceable_class() -> type | None:
    """``monai.transforms.inverse.TraceableTransform`` when MONAI is imported, else None."""
    mod = sys.modules.get("monai.transforms.inverse")
    return getattr(mod, "TraceableTransform", None)


def trace_ids(dataset: Any, transform: Any) -> tuple[tuple[str, int], ...]:
    """``(class name, id())`` of every MONAI ``TraceableTransform`` reachable from ``dataset``
    then from ``transform``, in :func:`find_parts` order (a walk: 0.2-0.7 s for a MONAI
    ``Dataset`` of 100k file dicts on the 2-core machine); ``()`` where MONAI is not
    imported."""
    cls = traceable_class()
    if cls is None:
        return ()
    return tuple((type(p).__qualname__, id(p))
                 for p in find_parts(dataset, cls) + find_parts(transform, cls))


def _trace_map(spec: Any, dataset: Any, transform: Any, mine: list) -> dict[int, int]:
    """``{id(part here): id(its original in the training process)}`` for ``mine``, the
    ``TraceableTransform`` s of this thread's ``dataset`` and ``transform`` in walk order,
    where they differ; empty where they are the originals (the training process's main
    thread, a forked worker). In the training process (a worker thread, or ``num_workers=0``
    from a thread other than the main one) the originals are ``spec``'s own; elsewhere their
    ids came in ``spec.trace_ids``.

    The k-th part of a class here is paired with the k-th of that class there, so that a
    transform one side has and the other has not (added by a ``worker_init_fn``; an original
    reachable both inside a random transform, which a thread copies, and outside it, where
    it stays the original) leaves the others paired (review 144: all were left unpaired)."""
    if not mine:
        return {}
    if os.getpid() == getattr(spec, "home_pid", None):
        if dataset is spec.dataset and transform is spec.transform:
            return {}
        home = trace_ids(spec.dataset, spec.transform)
    else:
        home = tuple(getattr(spec, "trace_ids", ()) or ())
    by_class: dict[str, list[int]] = {}
    for name, ident in home:
        by_class.setdefault(name, []).append(ident)
    taken: dict[str, int] = {}
    out: dict[int, int] = {}
    for p in mine:
        name = type(p).__qualname__
        k = taken.get(name, 0)
        ids = by_class.get(name, ())
        if k < len(ids):
            taken[name] = k + 1
            if id(p) != ids[k]:
                out[id(p)] = ids[k]
    if len(mine) != len(home) and home:
        log.debug("autominato: %d invertible transforms here, %d in the training process: "
                  "paired by class in walk order", len(mine), len(home))
    return out


def retrace(sample: Any, ids: dict[int, int]) -> None:
    """Put the training process's ids (``ids``: :func:`_trace_map`'s) in place of this
    process's in the transform records of ``sample``, in place: each ``MetaTensor``'s
    ``applied_operations`` and ``pending_operations``, and the ``<key>_transforms`` lists of
    a dictionary (MONAI's records beside arrays that are not ``MetaTensor`` s), nested records
    included. What is not a record is left alone."""
    if not ids:
        return
    from monai.utils import TraceKeys

    key, suffix = TraceKeys.ID, TraceKeys.KEY_SUFFIX
    seen: set[int] = set()

    def records(ops: Any) -> None:
        if isinstance(ops, dict):
            if id(ops) in seen:
                return
            seen.add(id(ops))
            old = ops.get(key)
            if isinstance(old, int) and old in ids:
                ops[key] = ids[old]
            for v in ops.values():
                if isinstance(v, (dict, list, tuple)):
                    records(v)
        elif isinstance(ops, (list, tuple)):
            for op in ops:
                records(op)

    def walk(obj: Any, depth: int = 0) -> None:
        if depth > 32 or id(obj) in seen:
            return
        for name in ("applied_operations", "pending_operations"):
            ops = getattr(obj, name, None) if hasattr(type(obj), name) else None
            if isinstance(ops, list):
                records(ops)
        if isinstance(obj, dict):
            seen.add(id(obj))
            for k, v in obj.items():
                if isinstance(k, str) and k.endswith(suffix) and isinstance(v, list):
                    records(v)
                elif not _is_leaf(v) or hasattr(type(v), "applied_operations"):
                    walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            for v in obj:
                if not _is_leaf(v) or hasattr(type(v), "applied_operations"):
                    walk(v, depth + 1)

    walk(sample)
