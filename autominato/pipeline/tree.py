"""Samples and batches as trees: tuples, lists, dicts and namedtuples around leaves.

One walker serves packing into shared memory, unpacking, copying out of a slot and moving a
batch to a device, so that every path agrees on what a container is.
"""

from __future__ import annotations

import copy
import functools
import pickle
import types
from collections import Counter, OrderedDict, UserDict, defaultdict
from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool],
               portable: bool = False) -> Any:
    """Rebuild ``obj`` with ``fn(leaf)`` in place of every leaf (``is_leaf(x)`` true).

    Containers are tuples, lists, dicts and namedtuples (rebuilt as their own type). A list
    or dict subclass (an ``OrderedDict``, a ``defaultdict``, a user's) or a ``UserDict``
    stays one, with its attributes, as ``default_collate`` and the DataLoader's
    ``pin_memory`` keep it: a shallow copy (its constructor may take other arguments)
    refilled with ``list``'s or ``dict``'s own methods (``OrderedDict``'s for one), never the
    user's ``__setitem__``, ``update`` or ``append`` (a converting or merging one would see
    ``fn``'s results or write into ``obj``'s values: reviews 103, 109), with its attributes
    that held an item (an ``EasyDict``'s, in ``__dict__`` or slots) set to the new item; where
    the copy fails or is ``obj`` itself, ``type(obj)(items)`` if that keeps the items, else a
    plain ``list`` or ``dict``. ``obj`` is never changed. Anything else that is not a leaf is
    returned as it is.

    ``portable``: the result is a skeleton to pickle to another process (``shm.prepare``):
    such a subclass becomes a :class:`Node`, which :func:`map_leaves` on the other side turns
    back into the subclass, so that unpickling never calls the user's methods with ``fn``'s
    placeholders and no item is pickled twice (review 112). A class with pickling of its own
    (``__reduce__``, ``__getstate__``, ...) crosses filled instead, its state being free to
    read its items (review 113). A container that does not survive a pickle round trip
    (a ``defaultdict``'s local factory, an attribute holding a lambda, a validating
    constructor) comes back as a plain ``list`` or ``dict``.
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
    kind = _KINDS.get(t) or _kind(t)
    if kind is _LEAF:
        return obj
    if kind is _LIST:
        return _subclass(obj, [map_leaves(o, fn, is_leaf, portable) for o in obj], portable)
    if kind is _DICT:
        return _subclass(obj, {k: map_leaves(v, fn, is_leaf, portable) for k, v in obj.items()},
                         portable)
    if kind is _USERDICT:  # (transformers' BatchEncoding is one)
        return _subclass(obj, {k: map_leaves(v, fn, is_leaf, portable)
                               for k, v in obj.data.items()}, portable)
    if kind is _NAMEDTUPLE:
        return t(*[map_leaves(o, fn, is_leaf, portable) for o in obj])
    if kind is _TUPLE:
        return tuple([map_leaves(o, fn, is_leaf, portable) for o in obj])
    return obj.rebuild(map_leaves(obj.items, fn, is_leaf, portable))  # a Node


# What each type of object is to map_leaves, by type: isinstance against UserDict (an ABC's
# subclass) costs ~0.2 us, paid by every leaf that is not an array (a list of 10k ints)
_LEAF, _LIST, _DICT, _USERDICT, _NAMEDTUPLE, _TUPLE, _NODE = (
    "leaf", "list", "dict", "userdict", "namedtuple", "tuple", "node")
_KINDS: dict[type, str] = {int: _LEAF, float: _LEAF, str: _LEAF, bytes: _LEAF, bool: _LEAF,
                           type(None): _LEAF, tuple: _TUPLE, list: _LIST, dict: _DICT}


def _kind(t: type) -> str:
    if issubclass(t, list):
        kind = _LIST
    elif issubclass(t, dict):
        kind = _DICT
    elif issubclass(t, UserDict):
        kind = _USERDICT
    elif issubclass(t, tuple):
        kind = _NAMEDTUPLE if hasattr(t, "_fields") else _TUPLE
    elif t is Node:
        kind = _NODE
    else:
        kind = _LEAF
    if len(_KINDS) < 4096:  # (types made at run time: a bound)
        _KINDS[t] = kind
    return kind


class Node:
    """A list or dict subclass in a skeleton that crosses processes (``map_leaves(portable=
    True)``): ``shell``, the container copied and emptied (``None``: a plain one is rebuilt),
    ``items``, a plain ``list`` or ``dict`` of its mapped items, and ``mirrors``, the
    attributes of ``shell`` that held an item (``(name, key or index, in a slot)``), cleared
    there."""

    __slots__ = ("shell", "items", "mirrors")

    def __init__(self, shell: Any, items: Any, mirrors: tuple = ()) -> None:
        self.shell, self.items, self.mirrors = shell, items, mirrors

    def __reduce__(self) -> tuple:
        return Node, (self.shell, self.items, self.mirrors)

    def rebuild(self, items: Any) -> Any:
        """The subclass around ``items`` (mapped on this side), or ``items`` with no shell.
        The shell is filled in place: a skeleton is unpacked once."""
        if self.shell is None:
            return items
        return _refill(self.shell, items, self.mirrors)


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


def _refill(clone: Any, items: Any, mirrors: tuple) -> Any:
    """``clone`` with ``items`` (:func:`_fill`) and its ``mirrors`` (:func:`_mirrors`) set
    to the items they held; ``clone``."""
    _fill(clone, items)
    for name, key, slot in mirrors:
        _set(clone, name, items[key], slot)
    return clone


def _items(c: Any) -> Any:
    """``(key or index, item)`` pairs of a container, through the built-in type's methods."""
    if isinstance(c, list):
        return enumerate(list.__iter__(c))
    if isinstance(c, UserDict):
        return vars(c)["data"].items()
    return dict.items(c)


def _set(clone: Any, name: str, value: Any, slot: bool) -> None:
    if slot:
        object.__setattr__(clone, name, value)
    else:
        vars(clone)[name] = value


@functools.lru_cache(maxsize=256)
def _slots(t: type) -> tuple[str, ...]:
    """The names of ``t``'s slots (mangled as stored), across its bases, but those a
    subclass hides (a property of the same name)."""
    return tuple(k for c in t.__mro__ for k, v in vars(c).items()
                 if type(v) is types.MemberDescriptorType and getattr(t, k, None) is v)


@functools.lru_cache(maxsize=256)
def _pickles_its_own_way(t: type) -> bool:
    """Whether a method of ``t``'s pickling (``__reduce__``, ``__getstate__``, ...) is not
    its built-in container's: its state may read its items, or its reconstruction need them
    (review 113; a mixin's after the built-in in its bases counts too, review 114)."""
    base = next((c for c in t.__mro__ if c in _BUILTIN), dict)
    return any(getattr(t, n, None) is not getattr(base, n, None) for n in _PICKLING)


_BUILTIN = (list, dict, OrderedDict, defaultdict, Counter, UserDict)
_PICKLING = ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__", "__getnewargs__",
             "__getnewargs_ex__")
_CONTAINERS = (list, dict, UserDict)


def _mirrors(obj: Any, clone: Any) -> tuple:
    """The attributes of ``clone`` (a copy of ``obj``) that hold one of the items of
    ``obj`` or of ``clone`` (an EasyDict's ``__setitem__`` wraps a list anew while it is
    copied: review 113): ``((name, key or index, in a slot), ...)``. A ``__dict__`` that
    ``clone`` shares with ``obj`` (a ``__setstate__`` that adopted it) is copied first, and
    where that cannot be done its attributes are not counted: writing them would write
    ``obj``'s."""
    where = {id(v): k for k, v in _items(obj)}
    where.update((id(v), k) for k, v in _items(clone))
    out = []
    attrs = getattr(clone, "__dict__", None)
    if type(attrs) is dict and attrs is not clone and attrs:
        if attrs is getattr(obj, "__dict__", None):
            try:
                object.__setattr__(clone, "__dict__", dict(attrs))
            except Exception:
                return ()
            attrs = vars(clone)
        out += [(a, where[id(v)], False) for a, v in attrs.items() if id(v) in where]
    for name in _slots(type(clone)):
        v = getattr(clone, name, _UNSET)
        if v is not _UNSET and id(v) in where:
            out.append((name, where[id(v)], True))
    return tuple(out)


_UNSET = object()


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
        return _refill(clone, items, mirrors)
    if _pickles_its_own_way(type(clone)):
        # A class that pickles its own way crosses filled, as before review 112 (its state
        # may read its items): its unpickling sees the placeholders, and the other side
        # refills a copy of it. Where that fails (a __setitem__ that refuses them, review
        # 114), emptied as the others.
        if _round_trips(_refill(clone, items, mirrors)):
            return clone
    _fill(clone, [] if isinstance(clone, list) else {})
    for name, _, slot in mirrors:
        _set(clone, name, None, slot)
    if not _round_trips(clone):
        return Node(None, items)
    return Node(clone, items, mirrors)


def _round_trips(shell: Any) -> bool:
    """Whether ``shell`` pickles and unpickles (a class may pickle and fail to unpickle: a
    constructor that validates, review 113; a property hiding a slot, review 114)."""
    try:
        pickle.loads(pickle.dumps(shell, pickle.HIGHEST_PROTOCOL))
    except Exception:
        return False
    return True


def for_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> None:
    """Call ``fn(leaf)`` on every leaf of ``obj`` (the containers of :func:`map_leaves`),
    building nothing."""
    if is_leaf(obj):
        fn(obj)
        return
    t = type(obj)
    kind = _KINDS.get(t) or _kind(t)
    if kind is _LEAF or kind is _NODE:
        return
    for o in (obj.values() if kind is _DICT else obj.data.values() if kind is _USERDICT
              else obj):
        for_leaves(o, fn, is_leaf)
