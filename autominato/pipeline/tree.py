"""Samples and batches as trees: tuples, lists, dicts and namedtuples around leaves.

One walker serves packing into shared memory, unpacking, copying out of a slot and moving a
batch to a device, so that every path agrees on what a container is.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict, UserDict
from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool],
               portable: bool = False) -> Any:
    """Rebuild ``obj`` with ``fn(leaf)`` in place of every leaf (``is_leaf(x)`` true).

    Containers are tuples, lists, dicts and namedtuples (rebuilt as their own type). A list
    or dict subclass (an ``OrderedDict``, a ``defaultdict``, a user's) or a ``UserDict``
    stays one, with its
    attributes, as ``default_collate`` and the DataLoader's ``pin_memory`` keep it: a shallow
    copy (its constructor may take other arguments) refilled with ``list``'s or ``dict``'s own
    methods (``OrderedDict``'s for one), never the user's ``__setitem__``, ``update`` or
    ``append`` (a converting or merging one would see ``fn``'s results or write into
    ``obj``'s values: reviews 103, 109), with its attributes that held an item (an
    ``EasyDict``'s) set to the new item; where the copy fails or is ``obj`` itself,
    ``type(obj)(items)``, else a plain ``list`` or ``dict``. Anything else that is not a leaf
    is returned as it is.

    ``portable``: the result is a skeleton to pickle to another process (``shm.prepare``):
    such a subclass becomes a :class:`Node`, which :func:`map_leaves` on the other side turns
    back into the subclass, so that unpickling never calls the user's methods with ``fn``'s
    placeholders and no item is pickled twice (review 112). A subclass whose emptied copy
    does not pickle (a ``defaultdict``'s local factory, an attribute holding a lambda) comes
    back as a plain ``list`` or ``dict``.
    """
    if is_leaf(obj):
        return fn(obj)
    # Exact types first: this runs for every sample on the transport path, and plain tuples,
    # lists and dicts are what samples are made of; list comprehensions beat generators here.
    t = type(obj)
    if t is tuple:
        return tuple([map_leaves(o, fn, is_leaf, portable) for o in obj])
    if t is list:
        return [map_leaves(o, fn, is_leaf, portable) for o in obj]
    if t is dict:
        return {k: map_leaves(v, fn, is_leaf, portable) for k, v in obj.items()}
    if isinstance(obj, list):
        return _subclass(obj, [map_leaves(o, fn, is_leaf, portable) for o in obj], portable)
    if isinstance(obj, dict):
        return _subclass(obj, {k: map_leaves(v, fn, is_leaf, portable) for k, v in obj.items()},
                         portable)
    if isinstance(obj, UserDict):  # (transformers' BatchEncoding is one)
        return _subclass(obj, {k: map_leaves(v, fn, is_leaf, portable)
                               for k, v in obj.data.items()}, portable)
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):
            return t(*[map_leaves(o, fn, is_leaf, portable) for o in obj])
        return tuple([map_leaves(o, fn, is_leaf, portable) for o in obj])
    if t is Node:
        return obj.rebuild(map_leaves(obj.items, fn, is_leaf, portable))
    return obj


class Node:
    """A list or dict subclass in a skeleton that crosses processes (``map_leaves(portable=
    True)``): ``shell``, the container copied and emptied (``None``: a plain one is rebuilt),
    ``items``, a plain ``list`` or ``dict`` of its mapped items, and ``mirrors``, the
    attributes of ``shell`` that held an item (``(name, key or index)``), cleared there."""

    __slots__ = ("shell", "items", "mirrors")

    def __init__(self, shell: Any, items: Any, mirrors: tuple = ()) -> None:
        self.shell, self.items, self.mirrors = shell, items, mirrors

    def __reduce__(self) -> tuple:
        return Node, (self.shell, self.items, self.mirrors)

    def rebuild(self, items: Any) -> Any:
        """The subclass around ``items`` (mapped on this side), or ``items`` with no shell.
        The shell is filled in place: a skeleton is unpacked once."""
        shell = self.shell
        if shell is None:
            return items
        _fill(shell, items)
        for name, key in self.mirrors:
            vars(shell)[name] = items[key]
        return shell


def _fill(clone: Any, items: Any) -> None:
    """Replace ``clone``'s items with ``items`` through the built-in type's own methods (an
    OrderedDict keeps its order in a structure of its own, which dict's would bypass)."""
    if isinstance(clone, list):
        list.__setitem__(clone, slice(None), items)
        return
    if isinstance(clone, UserDict):  # (its items are a plain dict, ``data``)
        vars(clone)["data"] = items
        return
    base = OrderedDict if isinstance(clone, OrderedDict) else dict
    base.clear(clone)
    for k, v in items.items():
        base.__setitem__(clone, k, v)


def _mirrors(obj: Any, clone: Any) -> tuple:
    """The attributes of ``clone`` (a copy of ``obj``) that hold one of ``obj``'s items:
    ``((name, key or index), ...)``."""
    attrs = getattr(clone, "__dict__", None)
    if not attrs:
        return ()
    where = {id(v): k for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj))}
    return tuple((a, where[id(v)]) for a, v in attrs.items() if id(v) in where)


_CONTAINERS = (list, dict, UserDict)


def _subclass(obj: Any, items: Any, portable: bool) -> Any:
    """``obj``'s type around ``items`` (its items mapped): see :func:`map_leaves`."""
    try:
        clone = copy.copy(obj)
    except Exception:
        clone = None
    mirrors: tuple = ()
    if clone is None or clone is obj or not isinstance(clone, _CONTAINERS):
        try:  # (as before review 112, where the type is built from its items as they are:
            # a constructor of items as arguments would make one item of them, review 107)
            clone = type(obj)(items)
            same = (isinstance(clone, list) and len(clone) == len(items)) if isinstance(
                items, list) else (isinstance(clone, (dict, UserDict))
                                   and clone.keys() == items.keys())
        except Exception:
            same = False
        if not same:
            return Node(None, items) if portable else items
    else:
        mirrors = _mirrors(obj, clone)
    if not portable:
        _fill(clone, items)
        for name, key in mirrors:
            vars(clone)[name] = items[key]
        return clone
    _fill(clone, [] if isinstance(clone, list) else {})
    for name, _ in mirrors:
        vars(clone)[name] = None
    try:
        pickle.dumps(clone, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return Node(None, items)
    return Node(clone, items, mirrors)


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
    elif isinstance(obj, UserDict):
        for v in obj.data.values():
            for_leaves(v, fn, is_leaf)
