"""Samples and batches as trees: tuples, lists, dicts and namedtuples around leaves.

One walker serves packing into shared memory, unpacking, copying out of a slot and moving a
batch to a device, so that every path agrees on what a container is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Rebuild ``obj`` with ``fn(leaf)`` in place of every leaf (``is_leaf(x)`` true).

    Containers are tuples, lists, dicts (rebuilt as ``dict``) and namedtuples (rebuilt as
    their own type); anything else that is not a leaf is returned as it is.
    """
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_leaves(o, fn, is_leaf) for o in obj))
    if isinstance(obj, tuple):
        return tuple(map_leaves(o, fn, is_leaf) for o in obj)
    if isinstance(obj, list):
        return [map_leaves(o, fn, is_leaf) for o in obj]
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn, is_leaf) for k, v in obj.items()}
    return obj
