"""Samples and batches as trees: tuples, lists, dicts and namedtuples around leaves.

One walker serves packing into shared memory, unpacking, copying out of a slot and moving a
batch to a device, so that every path agrees on what a container is.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Rebuild ``obj`` with ``fn(leaf)`` in place of every leaf (``is_leaf(x)`` true).

    Containers are tuples, lists and dicts (a list or dict subclass as a shallow copy with its
    items replaced, where that works, else as a plain ``list`` or ``dict``; a ``defaultdict``
    whose factory does not pickle as a plain ``dict``) and namedtuples (rebuilt as their own type); anything else
    that is not a leaf is returned as it is.
    """
    if is_leaf(obj):
        return fn(obj)
    # Exact types first: this runs for every sample on the transport path, and plain tuples,
    # lists and dicts are what samples are made of; list comprehensions beat generators here.
    t = type(obj)
    if t is tuple:
        return tuple([map_leaves(o, fn, is_leaf) for o in obj])
    if t is list:
        return [map_leaves(o, fn, is_leaf) for o in obj]
    if t is dict:
        return {k: map_leaves(v, fn, is_leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        # A user's list subclass stays one, with its attributes, as default_collate and the
        # DataLoader's pin_memory keep it: a shallow copy (its constructor may not take a
        # list: review 107) whose items are replaced by list's own __setitem__, since they may
        # be the transport's placeholders, which a converting __setitem__ of the user's would
        # mangle (review 109); else a plain list.
        items = [map_leaves(o, fn, is_leaf) for o in obj]
        try:
            clone = copy.copy(obj)
        except Exception:
            return items
        if clone is obj or not isinstance(clone, list):  # (a __copy__ that returns self)
            return items
        list.__setitem__(clone, slice(None), items)
        return clone
    if isinstance(obj, dict):
        # An OrderedDict, a defaultdict or a user's dict subclass stays one, with its
        # attributes, as default_collate and the DataLoader's pin_memory keep it (trial 102:
        # it crossed the worker processes as a plain dict): a shallow copy (its constructor
        # may not take a dict) filled by dict's own methods, never the user's ``update``
        # (a merging one would write into ``obj``'s nested values: review 103) or
        # ``__setitem__`` (the items may be the transport's placeholders); else a plain dict.
        out = {k: map_leaves(v, fn, is_leaf) for k, v in obj.items()}
        if isinstance(obj, defaultdict) and not _pickles(obj.default_factory):
            return out  # (a local factory would not cross the processes in the skeleton)
        try:
            clone = copy.copy(obj)
        except Exception:
            return out
        if clone is obj or not isinstance(clone, dict):  # (a __copy__ that returns self)
            return out
        # (an OrderedDict keeps its order in a structure of its own, which dict's methods
        # would bypass: the methods of the nearest of the two in its bases)
        base = OrderedDict if isinstance(clone, OrderedDict) else dict
        base.clear(clone)
        for k, v in out.items():
            base.__setitem__(clone, k, v)
        return clone
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):
            return t(*[map_leaves(o, fn, is_leaf) for o in obj])
        return tuple([map_leaves(o, fn, is_leaf) for o in obj])
    return obj


_PICKLES: dict = {}


def _pickles(factory: Any) -> bool:
    """Whether a defaultdict's ``factory`` pickles (remembered per factory: a builtin or a
    module-level function does, a lambda or a local function does not)."""
    try:
        return _PICKLES[factory]
    except (KeyError, TypeError):
        pass
    try:
        pickle.dumps(factory)
        ok = True
    except Exception:
        ok = False
    try:
        if len(_PICKLES) < 256:
            _PICKLES[factory] = ok
    except TypeError:  # (an unhashable factory)
        pass
    return ok


def for_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> None:
    """Call ``fn(leaf)`` on every leaf of ``obj`` (the containers of :func:`map_leaves`),
    building nothing."""
    if is_leaf(obj):
        fn(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            for_leaves(o, fn, is_leaf)
    elif isinstance(obj, dict):
        for v in obj.values():
            for_leaves(v, fn, is_leaf)
