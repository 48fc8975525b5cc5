"""Live knobs: the settings that may change while an epoch runs.

``loader.knobs.workers = 4`` takes effect without restarting the epoch and without losing or
repeating a sample: the pipeline reads the knobs each time it schedules work. Values are
clamped to each knob's bounds; bounds come from defaults, the user, or a configuration that
``autominato tune`` wrote.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def usable_cores() -> int:
    """CPU cores this process may use: affinity mask and cgroup v2 CPU quota (``cpu.max``),
    shared with the other ranks of this node where the launcher says how many run here
    (``LOCAL_WORLD_SIZE``: ``torchrun`` / ``torch.distributed.run``, which Accelerate and
    DeepSpeed launch through): a rank takes at most its share of the launcher's CPUs (its
    parent process's mask) and of the quota, and at most its own mask. So ranks that share a
    container's cpuset or a job's allocation divide it, ranks that ``torchrun
    --numa-binding=node`` binds four to a NUMA node take a quarter of it each (review 178),
    and a rank a wrapper pinned to fewer CPUs than its share keeps those. Trial 175: two
    ranks of a ``torchrun --nproc_per_node=2`` on 2 cores each took both cores, their default
    workers and the Data Monitor's verdict counted on 2 cores each. Limits: a rank started
    by a shell that a wrapper pinned (without ``exec``) divides its own CPUs again; Lightning's
    own launchers set no ``LOCAL_WORLD_SIZE``, so under them each rank counts every core."""
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = os.cpu_count() or 1
    ranks = local_ranks()
    n = mine
    if ranks > 1:
        try:
            launcher = len(os.sched_getaffinity(os.getppid()))
        except (AttributeError, OSError):  # (no parent to read: its own mask is the job's)
            launcher = mine
        n = min(mine, max(1, launcher // ranks))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period)) // ranks))
    except (OSError, ValueError):
        pass
    return max(1, n)


def local_ranks() -> int:
    """Processes of one distributed job on this node, as the launcher's ``LOCAL_WORLD_SIZE``
    says (1 where it is unset or not a positive integer)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def workers_bound(cores: int) -> int:
    """The most transform workers the online controller takes by itself: ``4 * cores``, at
    least 8 (workers that wait on I/O leave cores idle; ``loader.default_knobs``). A
    ``workers=`` or ``num_workers=`` given above it raises it."""
    return max(4 * cores, 8)


@dataclass
class Knob:
    """One tunable integer with inclusive bounds ``[low, high]``."""

    name: str
    value: int
    low: int
    high: int
    doc: str = ""

    def clamp(self, v: int) -> int:
        return max(self.low, min(self.high, int(v)))


#: Names in the order they are documented; the controller and the tuner use these names.
KNOB_NAMES = ("depth", "read_threads", "workers", "pool_size")

#: The least value of each knob that a user may set (``prefetch_factor=0`` is refused;
#: ``workers=0`` loads in the training loop's thread): configuration files
#: (``autominato.config``) and search spaces (``tuning.space``) hold to it.
KNOB_MIN = {"depth": 1, "read_threads": 1, "workers": 0, "pool_size": 1}


class Knobs:
    """The loader's live knobs.

    * ``depth``: finished batches that may wait ahead of the consumer (prefetch depth).
    * ``read_threads``: threads of the read stage (file I/O and decode).
    * ``workers``: transform workers (processes, or threads with ``worker_kind="thread"``);
      0 runs read and transform in the read threads of this process (no worker processes).
    * ``pool_size``: sample buffers (shared-memory slots) in flight at most; bounds the
      samples being read, transformed or waiting for a batch. The samples of the batches
      ready for the training loop (the next epoch's too) count in it as well, except within
      ``scheduler.LEAD_WAITS`` batches after the loop last waited for one: while the loader
      is ahead it holds ``pool_size`` samples ahead of the loop (or ``(depth + 1) x
      batch_size``, if more: a batch sampler's largest batch) instead of ``pool_size + depth x
      batch_size``. One figure per loader: any of its iterators' waits lifts it for all.

    Setting an attribute clamps the value to the knob's bounds and notifies the pipeline.
    """

    def __init__(self, values: dict[str, int], bounds: dict[str, tuple[int, int]]) -> None:
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_listeners", [])
        knobs = {}
        for name in KNOB_NAMES:
            lo, hi = bounds[name]
            if lo > hi:
                raise ValueError(f"knob {name!r}: lower bound {lo} > upper bound {hi}")
            knobs[name] = Knob(name, max(lo, min(hi, int(values[name]))), lo, hi)
        object.__setattr__(self, "_knobs", knobs)

    def __getattr__(self, name: str) -> int:
        knobs = object.__getattribute__(self, "_knobs")
        if name in knobs:
            return knobs[name].value
        raise AttributeError(name)

    def __setattr__(self, name: str, value: int) -> None:
        self.set(name, value)

    def set(self, name: str, value: int) -> int:
        """Set knob ``name`` to ``value`` clamped to its bounds; returns the value applied.

        Raises:
            KeyError: ``name`` is not a knob.
            TypeError: ``value`` is not an integer.
        """
        if name not in self._knobs:
            raise KeyError(f"unknown knob {name!r}; knobs are {', '.join(KNOB_NAMES)}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"knob {name} takes an integer, got {value!r}")
        with self._lock:
            knob = self._knobs[name]
            old, knob.value = knob.value, knob.clamp(value)
            new = knob.value
        if new != old:
            for fn in list(self._listeners):
                fn(name, old, new)
        return new

    def bounds(self, name: str) -> tuple[int, int]:
        k = self._knobs[name]
        return k.low, k.high

    def set_bounds(self, name: str, low: int, high: int) -> None:
        """Change knob ``name``'s bounds (the value is clamped into them)."""
        if low > high:
            raise ValueError(f"knob {name!r}: lower bound {low} > upper bound {high}")
        k = self._knobs[name]
        k.low, k.high = int(low), int(high)
        self.set(name, k.value)

    def as_dict(self) -> dict[str, int]:
        return {n: k.value for n, k in self._knobs.items()}

    def bounds_dict(self) -> dict[str, tuple[int, int]]:
        return {n: (k.low, k.high) for n, k in self._knobs.items()}

    def subscribe(self, fn: Callable[[str, int, int], None]) -> None:
        """Call ``fn(name, old, new)`` after every change of a knob's value."""
        self._listeners.append(fn)

    def unsubscribe(self, fn: Callable[[str, int, int], None]) -> None:
        """Stop calling ``fn`` (subscribed with :meth:`subscribe`)."""
        self._listeners.remove(fn)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={k.value} [{k.low}, {k.high}]" for n, k in self._knobs.items())
        return f"Knobs({inner})"
