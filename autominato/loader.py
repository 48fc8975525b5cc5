"""``autominato.Loader``: a drop-in for ``torch.utils.data.DataLoader`` on heavy samples.

This is the one module that wires the pipeline (:mod:`autominato.pipeline`, which knows
nothing else) to telemetry, the online controller and configuration files written by
``autominato tune``. Telemetry and the controller see the loader through a weak proxy, so a
Loader dropped without ``close()`` is collected and frees its workers and shared memory.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler, default_convert

from autominato import resume

# Imported with the Loader, not in its constructor: the controller runs by default, and
# importing it (and the telemetry switch) there delayed the first batch by tens of ms.
from autominato.control import Controller
from autominato.pipeline import cleanup, random_state
from autominato.pipeline.collate import batch_nbytes, collate, pin, to_device
from autominato.pipeline.costs import SampleCosts
from autominato.pipeline.epoch import Completed, Emit, End, Epoch, Failed, Raise, Skip
from autominato.pipeline.errors import ErrorReport, log_skip, note_batch
from autominato.pipeline.knobs import KNOB_NAMES, Knobs, usable_cores, workers_bound
from autominato.pipeline.memory import SampleMemory
from autominato.pipeline.sampler import epoch_order, read_sampler
from autominato.pipeline.scheduler import Pipeline, PipelineConfig, Run
from autominato.pipeline.shm import shm_free_bytes
from autominato.pipeline.stats import RECENT, LoaderSnapshot, StageStats
from autominato.pipeline.stream import PullDone, Stream, Yielded, YieldFailed
from autominato.pipeline.worker import Streams, WorkSpec, run_sample, sample_path, takes_rng
from autominato.telemetry.switch import monitor_interval_from_env

log = logging.getLogger("autominato.pipeline")

STAGES = ("read", "transform", "batch", "transfer", "consumer")

#: Seconds of the worker processes' start (until one is ready) that an iterator's wait for a
#: batch does not count against ``timeout`` (see ``Loader``'s ``timeout``): a fresh
#: interpreter takes ~1-2.5 s (``start_method`` "auto" where the process runs threads)
#: where the DataLoader forks in milliseconds; bounded, so that a worker that never starts
#: (a ``worker_init_fn`` that hangs) still times out.
START_GRACE_S = 30.0
_live: weakref.WeakSet = weakref.WeakSet()


def default_knobs(batch_size: int, cores: int, workers: int | None = None) -> tuple[dict, dict]:
    """Starting values and bounds of the knobs.

    ``workers`` defaults to the usable cores (what users commonly give the DataLoader);
    ``pool_size`` (samples in flight) to ``2 * batch_size + workers + read_threads``: enough to
    keep every worker busy while one batch fills and one waits. The controller may take
    ``workers`` up to ``4 * cores`` (workers that wait on I/O leave cores idle).
    """
    w = cores if workers is None else workers
    values = {"depth": 2, "read_threads": 2, "workers": w, "pool_size": 2 * batch_size + w + 2}
    bounds = {
        "depth": (1, 32),
        "read_threads": (1, 32),
        "workers": (0, 0) if w == 0 else (1, workers_bound(cores)),
        "pool_size": (batch_size, max(64 * batch_size, 256)),
    }
    return values, bounds


#: Arguments other loaders take that Loader does not, and what to use instead.
OTHER_ARGS = {
    "num_threads": "use workers=N with worker_kind='thread'",
    "buffer_size": "use pool_size=N (samples in flight)",
    "max_workers": "use workers=N (the controller's bound comes from the usable cores)",
}


def _ray_capacity(address: str | None, options: dict | None) -> int:
    """Connect to Ray (:func:`~autominato.pipeline.ray_executor.connect`) and return the
    transform actors the cluster's free CPUs hold (at least 1)."""
    from autominato.pipeline.ray_executor import (
        actor_options,
        cluster_cpus,
        connect,
        free_actors_beside_mine,
        others_hold_the_cpus,
        say_if_no_node_fits,
    )

    opts = actor_options(options)
    connect(address)
    say_if_no_node_fits(opts["num_cpus"])
    free = free_actors_beside_mine(opts["num_cpus"])
    if (free < 1 and "num_cpus" not in (options or {})
            and others_hold_the_cpus(opts["num_cpus"])):
        # Its actors will share the cores with this process's other Ray Loaders'
        # (RayExecutor's ``shared``): sized on the cluster's CPUs, as process workers on the
        # machine's (review 174: one actor)
        return max(1, int(cluster_cpus()))
    return max(1, free)


def fixed_order(dataset: Any, shuffle: bool | None, sampler: Any, batch_sampler: Any) -> bool:
    """Whether an epoch takes a map-style dataset in an order fixed in advance: its own,
    ``0 .. n - 1`` (or a rank's share of it: no ``shuffle`` and no sampler, a
    ``SequentialSampler`` or a subclass that keeps its ``__iter__``, a ``DistributedSampler``
    with ``shuffle=False``), or a list, tuple, ``range``, array or tensor of indices given as
    the sampler (a validation split), also as a ``batch_sampler``'s ``sampler``, or a list or
    tuple of batches given as the ``batch_sampler``. That is how evaluation and prediction
    run, where an output is matched to its sample by position, so the Loader's ``in_order``
    defaults to it. An iterable dataset, a shuffle, any other sampler (random, weighted,
    bucketing, a user's class) or a batch sampler without a ``sampler`` attribute: ``False``
    (its order is drawn, or not known). (Trial 179: a tensor of indices, a subclass of
    ``SequentialSampler`` and a list of batches came back in completion order.)"""
    if shuffle or is_iterable_dataset(dataset):
        return False
    if batch_sampler is not None:
        if isinstance(batch_sampler, (list, tuple)):
            return True
        sampler = getattr(batch_sampler, "sampler", None)
        if sampler is None:
            return False
    if sampler is None or (isinstance(sampler, SequentialSampler)
                           and type(sampler).__iter__ is SequentialSampler.__iter__):
        return True
    if isinstance(sampler, (list, tuple, range, np.ndarray, torch.Tensor)):
        return True
    return isinstance(sampler, DistributedSampler) and not sampler.shuffle


#: Set while ``_copy_of`` builds a copy: its metrics endpoint binds a free port when the
#: original's is taken (each rank of Lightning's ddp_spawn unpickles one, the parent holds it).
_copying = threading.local()


def _copy_of(cls: type, given: dict[str, Any], seed: int, epoch: int, epoch_set: bool) -> Loader:
    """A Loader built from another's arguments, with its seed and epoch (``Loader.__reduce__``)."""
    _copying.active = True
    try:
        loader = cls(**{**given, "seed": seed})
    finally:
        _copying.active = False
    # The shuffle's rule across ranks follows the seed as the user gave it (0 when drawn).
    loader._seed_given = given.get("seed") is not None
    loader._set_ranks()
    loader._epoch, loader._epoch_set = epoch, epoch_set
    return loader


def _monai_track_meta() -> bool | None:
    """MONAI's ``get_track_meta()`` in this process now, where MONAI is imported (else
    ``None``), for the workers to take (``WorkSpec.monai_track_meta``)."""
    meta_obj = sys.modules.get("monai.data.meta_obj")
    get = getattr(meta_obj, "get_track_meta", None)
    return bool(get()) if get is not None else None


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A base seed drawn from ``generator``, else torch's default generator, as the DataLoader
    draws its own (so ``torch.manual_seed`` makes a run reproducible)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` that is also a ``ValueError``, since the
    DataLoader raises ``ValueError`` for some (``batch_size=2.0``: its ``BatchSampler``'s
    check), and code written against it catches that (trial 141)."""


def _check_int(name: str, value: Any, low: int | None, bools: bool = False) -> int:
    """``value`` as an int, or an :class:`ArgumentTypeError` (not an integer) or a
    ``ValueError`` (under ``low``) naming the argument ``name``. A bool is refused unless
    ``bools`` (``num_workers``: the DataLoader takes ``True`` as 1, ``False`` as 0)."""
    if (isinstance(value, bool) and not bools) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


#: (configuration, its batch size, the Loader's) already warned of in this process: a copy
#: of the Loader (pickled to a spawned rank, deep-copied) is built again from its arguments.
_tuned_batch_said: set[tuple[str, int, int]] = set()


def _say_tuned_batch(config: Any, tuned: int, batch_size: int) -> None:
    """Warn, once a process, that ``config``'s knobs were tuned with another batch size
    (``depth`` counts batches, ``pool_size`` samples of the size they ran with; the file's
    batch size is the tune's, never the Loader's: trial 138 found it unused in silence)."""
    where = "the configuration" if isinstance(config, dict) else str(config)
    key = (repr(config) if isinstance(config, dict) else where, tuned, batch_size)
    if key in _tuned_batch_said:
        return
    _tuned_batch_said.add(key)
    warnings.warn(f"{where}: its knobs were tuned with batch size {tuned}, this Loader's is "
                  f"{batch_size}: use batch size {tuned}, or tune again with --batch-size "
                  f"{batch_size}", stacklevel=3)


def _stride(step: int, before: int | None) -> int:
    """The epoch's move expected after a pass, from its move between the last two passes
    (``step``) and between the two before (``before``): 0 (the same epoch again: a loop
    that sets it once) or 1 at once; another move (``set_epoch(2 * e)``) once it has
    repeated, so that a single jump (a resume, an epoch set out of sequence) is not taken
    for the loop's stride; else 1."""
    return step if step in (0, 1) or (step > 1 and step == before) else 1


def _samplers_name(at: dict[str, int], saved: dict[str, int] | None, ended: int) -> bool:
    """Whether the user's samplers at epochs ``at`` (``resume.sampler_epochs``) name the
    ended epoch ``ended`` of a state whose pass began with the samplers at ``saved`` (its
    ``began_sampler_epochs``): they are back at those epochs. A loop that sets its sampler's
    epoch itself counts in its own numbers, which may not be the Loader's (review 190: a
    loop of two passes an epoch, resumed at epoch 3, sets its sampler to 5 where the
    Loader's ended epoch is 5 and its sampler's was 4: taken as named, that epoch delivered
    nothing). A state without them (of an autominato before December 2026, whose
    ``sampler_epochs`` of an ended epoch are as the checkpoint found them, maybe the next
    epoch's already: review 191), or no sampler with an epoch then: at ``ended``, the
    Loader's number."""
    if saved:
        return all(saved.get(name) == v for name, v in at.items())
    return all(v == ended for v in at.values())


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is iterated rather than indexed: a ``torch.utils.data.IterableDataset``,
    or any iterable without ``__getitem__`` (a webdataset pipeline, a generator)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _start_method_of(context: Any) -> str:
    """The start method named by DataLoader's ``multiprocessing_context`` (a string or a
    ``multiprocessing`` context)."""
    if isinstance(context, str):
        name = context
    elif hasattr(context, "get_start_method"):
        name = context.get_start_method()
    else:
        raise TypeError("multiprocessing_context must be a start method name or a "
                        f"multiprocessing context, got {type(context).__name__}")
    if name not in ("fork", "forkserver", "spawn"):
        raise ValueError("multiprocessing_context must be 'fork', 'forkserver' or 'spawn', "
                         f"got {name!r}")
    return name


class _one:
    """The collate of ``batch_size=None``: one sample, through ``collate_fn`` or, as
    DataLoader's ``default_convert``, with arrays made tensors."""

    def __init__(self, collate_fn: Callable | None) -> None:
        self.fn = collate_fn

    def __call__(self, samples: list) -> Any:
        (sample,) = samples
        if self.fn is not None:
            return self.fn(sample)
        return default_convert(sample)


#: The pipeline's counters that go on across the pipeline load_state_dict rebuilds
#: (Loader._retired; attribute names of :class:`~autominato.pipeline.scheduler.Pipeline`).
_PIPELINE_COUNTERS = ("skipped", "stragglers", "worker_restarts", "speculative_discarded",
                      "memory_held", "memory_wait_s", "cold_starts")


def _allocator_free() -> bool:
    """Whether the workers may steer the C allocator for the warm heap
    (``worker.warm_heap_refused``); where the user tuned it, the log says so."""
    from autominato.pipeline.worker import warm_heap_refused

    why = warm_heap_refused()
    if why is not None and why != "glibc":
        log.info("warm_heap: off, %s tunes the C allocator (its settings stay)", why)
    return why is None


class Loader:
    """A staged asynchronous loader with completion-order batches and live knobs.

    It takes ``torch.utils.data.DataLoader``'s arguments, in DataLoader's positional order and
    with DataLoader's meaning (see the table in ``docs/parity.md``), plus its own.

    Args:
        dataset: a map-style dataset (``__len__``, ``__getitem__``; it may define
            ``sample_path(index) -> str | None`` so that errors name the file), or an iterable
            one (``torch.utils.data.IterableDataset``, or any iterable without ``__getitem__``):
            each worker iterates ``iter(dataset)`` with ``get_worker_info()`` naming it, so the
            dataset shards itself as under the DataLoader (see ``docs/workers.md``); no
            sampler, shuffle or batch_sampler then, and ``len()`` only when it has one.
        batch_size: samples per batch; ``None`` delivers samples one by one, unbatched (numpy
            arrays become tensors, as DataLoader's ``default_convert``; a ``collate_fn`` is
            applied to each sample).
        shuffle: reshuffle every epoch (seeded by ``seed + epoch``); ``None`` is ``False``.
        sampler: an iterable of indices used instead of ``shuffle``. It is iterated as it is
            (as the DataLoader does): its ``set_epoch`` is called only by
            :meth:`set_epoch`, so a sampler that the training loop set itself is respected.
            Without one, ``loader.sampler`` is an :class:`EpochSampler` whose ``set_epoch``
            sets the Loader's epoch (what Lightning calls at every epoch start).
        batch_sampler: an iterable of lists of indices, each list one batch (mutually
            exclusive with ``batch_size`` other than 1, ``shuffle``, ``sampler`` and
            ``drop_last``, as in DataLoader). A batch is delivered once all its samples are
            done: the first complete batch first, or in the sampler's order with ``in_order``.
            An empty list is a batch too: ``collate_fn([])``, as the DataLoader calls it
            (the default collation raises its ``IndexError`` in the batch's place).
            Ranks are the batch sampler's business (it is not split).
        num_workers: worker processes (or threads) to start with; the controller may change
            them (the ``workers`` knob). ``0``: no worker, every sample is loaded in the
            training loop's thread when a batch is asked for, as with the DataLoader (handy
            under a debugger). A bool is taken as the int it is (``True``: 1), as by the
            DataLoader. Default: the usable cores.
        collate_fn: builds a batch from a list of samples; default stacks arrays into pooled
            buffers like ``default_collate``.
        pin_memory: batches in page-locked host memory (needs an accelerator; without one it
            is ignored with a warning, as by the DataLoader). ``device="cuda"`` pins anyway.
        drop_last: drop the last short batch (the same indices the DataLoader drops); with
            ``on_error="skip"`` no batch is ever short.
        transform: ``transform(sample, rng)`` with a ``numpy.random.Generator`` seeded from
            ``(seed, epoch, index)`` (and, for an index the sampler repeats in the epoch, its
            occurrence: ``worker.sample_rng``), or a plain ``transform(sample)``. MONAI
            ``Randomizable`` transforms in it or in the dataset are reseeded per sample from
            the same key (see ``docs/monai.md``).
        seed: base seed of shuffling and augmentation. ``None``: drawn from torch's default
            generator (as the DataLoader does), except that with several ranks the shuffle
            uses seed 0, ``DistributedSampler``'s default, so that every rank draws the same
            permutation and the ranks' shards never overlap.
        timeout: seconds the training loop may wait for one batch before ``RuntimeError``
            (DataLoader's); ``0`` waits for ever. See ``sample_timeout`` for one sample. Not
            applied with ``num_workers=0`` (the batch is loaded in the caller's thread).
            While no worker process or Ray actor is ready yet (their start,
            ``worker_init_fn`` included: a fresh interpreter, ~1-2.5 s, where this process
            runs threads, against a DataLoader's fork) the clock stops, for up to
            ``START_GRACE_S`` (30 s) an iterator, so that a worker that never starts still
            times out.
        worker_init_fn: ``worker_init_fn(worker_id)`` runs once in every worker when it
            starts, replacements and workers added by the controller included; ids are in
            ``[0, workers)``, and ``torch.utils.data.get_worker_info()`` works in workers
            (``autominato.get_worker_info()`` too, thread workers included: see
            ``docs/workers.md``). An exception in it is raised in the training loop as
            ``WorkerInitError`` naming it.
        multiprocessing_context: ``"fork"``, ``"forkserver"``, ``"spawn"`` or a
            ``multiprocessing`` context; the same as ``start_method``.
        generator: a ``torch.Generator`` that draws ``seed`` when ``seed`` is not given.
        prefetch_factor: batches prepared ahead of the training loop (the ``depth`` knob's
            start value; DataLoader counts them per worker, autominato for the loader).
        persistent_workers: keep the workers, and the dataset they hold, across epochs
            (default (``None``): ``True``, unlike the DataLoader, and ``False`` with
            ``num_workers=0``; ``True`` given with ``num_workers=0`` raises ``ValueError``, as
            in DataLoader). ``False``: the dataset is sent to the
            workers again at the start of every epoch, so changes made to it between epochs
            are seen, and none the workers made to their copies, as by the DataLoader's
            fresh workers (one pickle per epoch and a copy to each worker; ``worker_init_fn``
            then runs again, from a new base seed; Ray actors are replaced by new ones).
        pin_memory_device: accepted for compatibility (deprecated in torch); use ``device``.
        in_order: deliver batches in sampler order (as the DataLoader); ``False``: completion
            order, where a slow sample joins a later batch of the same epoch. Default
            (``None``): ``True`` when the epoch's order is fixed in advance
            (:func:`fixed_order`: a map-style dataset without ``shuffle``, a
            ``SequentialSampler``, a ``DistributedSampler(shuffle=False)``, a list or
            ``range`` of indices as the sampler, as evaluation and prediction take it, so
            that outputs line up with the rows), else the ``config`` file's, else ``False``.
        transform: ``transform(sample, rng)`` with a ``numpy.random.Generator`` seeded from
            ``(seed, epoch, index)`` (and a repeat's occurrence, ``worker.sample_rng``), or a
            plain ``transform(sample)``.
        seed: base seed of shuffling and augmentation. ``None``: drawn from ``generator``, else
            from torch's default generator (as the DataLoader does), except that with several
            ranks the shuffle uses seed 0, ``DistributedSampler``'s default, so that every
            rank draws the same permutation and the ranks' shards never overlap.
        device: ``"cuda"`` etc.: batches arrive on this device, copied from pinned memory on a
            side stream. ``None`` leaves them on the host.
        rank, world_size: this process's share of each epoch (``DistributedSampler``
            semantics); when not given, read from ``torch.distributed`` once it is initialised
            (at every pass until then: a Loader built before Lightning's DDP strategy starts
            the process group shards when the group exists).
        worker_kind: ``"process"`` (the default, unless the ``config`` file names another),
            ``"thread"`` for GIL-free transforms, or
            ``"ray"``: the transform stage runs on Ray actors, on this machine or a cluster
            (``pip install "autominato[ray]"``; see the README's "Scale out"). ``workers`` is
            then the actor count, bounded by the cluster's free CPUs. The dataset's files
            must be reachable from every node (a shared file system, object storage), and
            its code importable there.
        ray_address: with ``worker_kind="ray"``: ``None`` connects to ``RAY_ADDRESS`` when
            set, else starts a local Ray instance sized to the usable cores; ``"auto"``,
            ``"host:port"`` or ``"ray://host:port"`` as ``ray.init`` takes them. Ignored when
            this process is connected to Ray already.
        ray_actor_options: options of each transform actor (``ActorClass.options``: default
            ``{"num_cpus": 1}``; ``memory``, ``resources``, ``scheduling_strategy``...).
        fuse_read: read inside the transform worker processes (default), so that only the
            transformed sample crosses to the main process. ``False`` adds a separate read
            stage of threads (``read_threads``) for I/O-bound reads (network storage).
        on_error: ``"raise"`` (the error reaches the training loop; a loop that catches it
            gets the rest of the epoch, as from DataLoader's iterator, less the failing
            sample's batch in order or the failing sample in completion order)
            or ``"skip"`` (log, count and continue without the sample).
        on_worker_death: ``"retry"`` (replace the worker, re-dispatch its sample) or ``"raise"``.
        max_tries: a sample whose worker dies this many times goes through ``on_error``.
        sample_timeout: seconds one sample may take in a worker before that worker is
            replaced and the sample goes through ``on_error`` as a ``SampleTimeout``; ``None``
            or ``0`` wait for ever. Fast samples travel to a worker in chunks: a sample that
            hangs in a chunk is first sent again alone (the others are not blamed), so it is
            given up after up to twice ``sample_timeout``. Not applied with ``num_workers=0``.
        memory_budget_bytes: most bytes of shared memory for sample slots (default: half of
            the free ``/dev/shm``, at most a quarter of the available RAM).
        start_method: how worker processes start. ``"auto"`` (default): a fork server of this
            loader's own (:mod:`autominato.pipeline.spawn`) is forked when the Loader is built,
            if no other thread runs and CUDA is not initialised (workers then share the
            dataset copy-on-write), else forked by an earlier loader's fork server of this
            process that was (it then unpickles the dataset once), else started as a new
            interpreter that unpickles the dataset once (~2 s, importing torch); ``"fork"``,
            ``"forkserver"`` force the first or the last; ``"spawn"`` starts each worker as a
            new interpreter. Workers never import ``__main__``.
        config: a file written by ``autominato tune`` (or its dict): starting knobs and bounds,
            and ``worker_kind``, ``in_order`` and ``memory_aware`` where the call does not
            give them (knobs and settings given as arguments win).
        metrics_port, metrics_host, monitor_interval: telemetry (see ``autominato.telemetry``).
        autotune: run the online controller (``autominato.control``).
        prefetch_next_epoch: start the next epoch's samples in the workers that the tail of
            this epoch frees (its first batches are ready when the training loop asks), as
            long as the next order is computable without side effects: the Loader's own
            shuffle / sequential order, or a ``DistributedSampler`` (other samplers: off;
            off for MONAI's ``SmartCacheDataset``, whose cache ``update_cache()`` replaces
            between the epochs).
            The next epoch is the current one + 1 (+ 0 after a pass that repeated the epoch
            set by :meth:`set_epoch`); a pass that asks for another epoch or order discards
            the speculative work (counted in ``speculative_discarded_total``). Memory: no
            more samples in flight than without it (the two epochs share the ``pool_size``
            window), plus up to ``depth`` assembled batches of the next epoch. The last
            epoch's speculation is wasted work (up to ``pool_size`` samples). A sample whose
            loading raised (or timed out) while loaded ahead is loaded again when its epoch
            begins; one that
            loaded is kept (a dataset or files changed between epochs need ``False``). Off with
            ``persistent_workers=False`` (the dataset may change between epochs). The
            controller's windows span prefetched epochs only: with every epoch started cold
            it acts only on epochs of 12 batches or more (docs/controller.md).
        memory_aware: (``True`` unless the ``config`` file says otherwise) process
            workers measure each sample's peak memory (the resident
            set's high-water mark, Linux), and a sample whose working set would not fit
            beside those in flight waits for them: at most ``1.35 * max(the largest sample's
            peak, workers * the upper quartile's)`` in flight, so that an outlier several
            times the upper quartile never runs beside other large ones (the loader's peak is
            then about the largest sample's alone, or all workers' on the upper quartile).
            A later sample overtakes one that waits only if it fits and leaves it its room
            (docs/memory.md); a sample starts at once when no other is in flight; samples
            under 10 ms, iterable datasets and ``fuse_read=False`` are not measured; thread
            workers and Ray actors are not held back. Cost: a worker idles while a large
            sample runs without room beside it (KiTS19 bench, 8 cases, 2 workers, at the
            former headroom of 1.25: median peak 825 -> 686 MiB, throughput 1.47x -> 1.39x
            the DataLoader's; 3.5-7% of the throughput at the two sizes measured; 1.35 now,
            docs/memory.md). Counted in
            ``samples_held_for_memory_total``; the workers' idle time in
            ``memory_wait_seconds_total``. ``False`` also lets each process worker keep its
            whole freed heap warm (``warm_heap``): faster, and more memory than the
            DataLoader's. ``autominato tune`` measures both and writes ``False`` in its file
            only where it idles less beyond the noise (docs/tune.md).
        warm_heap: with ``memory_aware``, once samples are measured each process worker
            keeps part of its free heap warm between samples instead of giving it all back
            (Linux, glibc): the upper quartile's figure, lowered to what the memory budget
            leaves beside a larger sample while one runs (:meth:`SampleMemory.heap_keep
            <autominato.pipeline.memory.SampleMemory.heap_keep>`), none while a sample waits
            for memory; an outlier (a figure above twice the upper quartile's) runs without
            one, its large arrays unmapped when freed. The next samples' arrays then need
            no new pages, which the kernel faults in and zeroes (half of a worker's CPU time
            on the KiTS19 bench); the cost is memory held by workers between samples, within
            the budget (docs/memory.md,
            "The warm heap", for the figures). With ``memory_aware=False`` no budget bounds
            it: each worker keeps all of its freed heap warm (the fastest setting; on the
            KiTS19 bench 1.16x and 1.31x the defaults' speed at 21 and 42 samples an epoch,
            at 1168 and 1343 MiB against the defaults' 958 and 994 and the DataLoader's 945
            and 1155, docs/memory.md, "Measured") until the workers idled 10 s, up to half
            the memory available at the first pass (the cgroup's limit where lower), split
            between the workers (beyond it a worker gives the rest back).
            ``False``: every freed page goes back after each sample, as before December
            2026. Off, too, where the environment tunes the
            C allocator (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_MMAP_MAX_``,
            ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``GLIBC_TUNABLES`` with malloc
            tunables, or jemalloc, tcmalloc or mimalloc in ``LD_PRELOAD``): those settings
            stay.
        depth, read_threads, workers, pool_size: starting knob values (see :class:`Knobs`);
            ``workers`` is the same as ``num_workers``, ``depth`` as ``prefetch_factor``.

    Raises:
        ValueError: invalid values (the message names the argument).
        TypeError: an argument of the wrong type or one Loader does not take (the message
            names it and, for a DataLoader argument with no meaning here, what to use).

    Live iterators each deliver a whole epoch, as the DataLoader's: ``zip(loader, loader)``
    gives ``len(loader)`` pairs. Unlike the DataLoader's RandomSampler, a pass begun before
    the last one delivered a batch is the same epoch (so zip's two sides share an order and
    augmentation; see docs/parity.md).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool | None = None,
        transform: Callable | None = None,
        seed: int | None = None,
        device: str | torch.device | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        worker_kind: str | None = None,
        ray_address: str | None = None,
        ray_actor_options: dict | None = None,
        fuse_read: bool | None = None,
        on_error: str = "raise",
        on_worker_death: str = "retry",
        max_tries: int = 3,
        sample_timeout: float | None = None,
        memory_budget_bytes: int | None = None,
        start_method: str = "auto",
        config: str | Path | dict | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        monitor_interval: float | None = None,
        autotune: bool = True,
        prefetch_next_epoch: bool = True,
        memory_aware: bool | None = None,
        warm_heap: bool = True,
        **knobs: int,
    ) -> None:
        # The arguments as given: a copy (pickle, deepcopy) is built from them (__reduce__).
        given = {k: v for k, v in locals().items() if k not in ("self", "knobs")
                 and not k.startswith("__")}
        # (before any check: __del__ closes a Loader whose construction raised)
        self._close_lock = threading.RLock()
        for name, flag in (("memory_aware", memory_aware), ("warm_heap", warm_heap)):
            if not isinstance(flag, (bool, np.bool_)) and not (name == "memory_aware"
                                                               and flag is None):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        given.update(knobs)
        unknown = set(knobs) - set(KNOB_NAMES)
        if unknown:
            hints = [f"{name}: {OTHER_ARGS.get(name, 'not an argument of Loader')}"
                     for name in sorted(unknown)]
            raise TypeError("Loader() got argument(s) it does not take: " + "; ".join(hints)
                            + f" (the knobs are {', '.join(KNOB_NAMES)})")
        for name, v in knobs.items():
            _check_int(name, v, 0)
        unbatched = batch_size is None
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last (as in DataLoader)")
            batch_size = 1
        elif unbatched:
            if drop_last:
                raise ValueError("batch_size=None option disables auto-batching and is mutually "
                                 "exclusive with drop_last (as in DataLoader)")
            batch_size = 1
        _check_int("batch_size", batch_size, 1)
        if not isinstance(drop_last, bool) and batch_sampler is None and not unbatched:
            # (the DataLoader's BatchSampler check, in its words; a "yes" read as True here)
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle (as in DataLoader)")
        if num_workers is not None:
            # A bool is an int, as the DataLoader takes it (True: one worker; trial: refused)
            num_workers = _check_int("num_workers", num_workers, 0, bools=True)
            if "workers" in knobs and knobs["workers"] != num_workers:
                raise ValueError(f"num_workers={num_workers} and workers={knobs['workers']} "
                                 "name the same knob: give one")
            knobs["workers"] = num_workers
        if prefetch_factor is not None:
            _check_int("prefetch_factor", prefetch_factor, 1)
            if num_workers == 0:
                raise ValueError("prefetch_factor option could only be specified in "
                                 "multiprocessing: let num_workers > 0 (as in DataLoader)")
            if "depth" in knobs and knobs["depth"] != prefetch_factor:
                raise ValueError(f"prefetch_factor={prefetch_factor} and depth={knobs['depth']} "
                                 "name the same knob: give one")
            knobs["depth"] = prefetch_factor
        if persistent_workers and knobs.get("workers", num_workers) == 0:
            raise ValueError("persistent_workers option needs num_workers > 0 (as in DataLoader)")
        if in_order is None and fixed_order(dataset, shuffle, sampler, batch_sampler):
            # An order fixed in advance (evaluation, prediction) is kept before a tuned
            # file's choice, made for training's drawn orders (review 101).
            in_order = True
        cfg = None
        if config is not None:
            from autominato.config import LoadedConfig, load_config

            cfg = load_config(config)
            if isinstance(config, (str, os.PathLike)) and not isinstance(config, LoadedConfig):
                # a copy is built from what this Loader read, not from the file as it is then
                given["config"] = LoadedConfig(config, cfg)
            # A tuned file's static settings fill what the call left out; an argument given
            # wins, as an explicit knob argument does over the file's knobs.
            static = cfg["loader"]
            tuned = static.get("batch_size")
            if (tuned is not None and batch_sampler is None and not unbatched
                    and batch_size != tuned):
                _say_tuned_batch(config, tuned, batch_size)
            if worker_kind is None:
                worker_kind = static.get("worker_kind")
            if in_order is None:
                in_order = static.get("in_order")
            if memory_aware is None:
                memory_aware = static.get("memory_aware")
            elif static.get("memory_aware") not in (None, bool(memory_aware)):
                # (said as a knob given over the file's is: the tuned trade is lost otherwise
                # without a word)
                log.warning("memory_aware=%s given to the Loader overrides the "
                            "configuration's memory_aware=%s (%s): an argument wins; leave it "
                            "out to use the configuration's", bool(memory_aware),
                            static["memory_aware"],
                            config if isinstance(config, (str, os.PathLike)) else "config=")
        worker_kind = "process" if worker_kind is None else worker_kind
        memory_aware = True if memory_aware is None else bool(memory_aware)
        in_order = False if in_order is None else bool(in_order)
        if worker_kind not in ("process", "thread", "ray"):
            raise ValueError(f"worker_kind must be 'process', 'thread' or 'ray', got {worker_kind!r}")
        if worker_kind == "ray" and is_iterable_dataset(dataset):
            raise ValueError("worker_kind='ray' takes a map-style dataset (an iterable dataset's "
                             "shards are iterated by process or thread workers)")
        if worker_kind != "ray" and (ray_address is not None or ray_actor_options is not None):
            raise ValueError("ray_address and ray_actor_options are for worker_kind='ray', "
                             f"got worker_kind={worker_kind!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_worker_death not in ("retry", "raise"):
            raise ValueError(f"on_worker_death must be 'retry' or 'raise', got {on_worker_death!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout option should be non-negative (seconds to wait for a "
                             f"batch, 0: for ever), got {timeout!r}")
        if sample_timeout is not None and (isinstance(sample_timeout, bool) or not isinstance(
                sample_timeout, (int, float)) or sample_timeout < 0):
            raise ValueError("sample_timeout must be seconds >= 0 (0 or None: no timeout), "
                             f"got {sample_timeout!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable, got {type(worker_init_fn).__name__}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if multiprocessing_context is not None:
            if num_workers == 0 or knobs.get("workers") == 0:  # (DataLoader's check, words)
                raise ValueError("multiprocessing_context can only be used with multi-process "
                                 "loading (num_workers > 0), but got num_workers=0")
            start_method = _start_method_of(multiprocessing_context)
        if start_method not in ("auto", "fork", "forkserver", "spawn"):
            raise ValueError("start_method must be 'auto', 'fork', 'forkserver' or 'spawn', "
                             f"got {start_method!r}")
        if pin_memory and device is None and not torch.cuda.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=2)
            pin_memory_effective = False
        else:
            pin_memory_effective = bool(pin_memory)
        self._iterable = is_iterable_dataset(dataset)
        self._iterable_len_said: int | None = None  # len(dataset) as len(loader) read it
        if self._iterable:
            # DataLoader's checks and words for an IterableDataset
            for name, value in (("shuffle", shuffle), ("sampler", sampler),
                                ("batch_sampler", batch_sampler)):
                if value not in (None, False):
                    raise ValueError(f"Loader with an iterable dataset: expected unspecified {name} "
                                     f"option, but got {name}={value!r} (the dataset orders and "
                                     "shards itself, as with DataLoader)")
            try:
                self._n_iterable: int | None = len(dataset)
            except TypeError:  # no __len__, or one that refuses (as IterableDataset's)
                self._n_iterable = None
        else:
            try:
                len(dataset)
            except TypeError as e:
                raise ValueError("dataset must be map-style (define __len__ and __getitem__) or "
                                 "iterable (a torch.utils.data.IterableDataset, or define __iter__)"
                                 ) from e

        self.dataset = dataset
        self._given = given
        self._batch = int(batch_size)  # samples per batch as the pipeline runs it
        #: DataLoader's attributes (``batch_size`` is ``None`` when unbatched or with a
        #: ``batch_sampler``, as DataLoader's).
        self.batch_size = None if unbatched or batch_sampler is not None else self._batch
        self.shuffle = bool(shuffle)
        if self.shuffle and sampler is None and batch_sampler is None and not self._iterable:
            try:
                empty = len(dataset) == 0
            except TypeError:
                empty = False
            if empty:  # (the DataLoader's RandomSampler refuses it, in these words)
                raise ValueError("num_samples should be a positive integer value, but got "
                                 "num_samples=0")
        self._sampler = sampler  # the user's (None: the Loader's own order)
        #: DataLoader's attribute: the user's sampler, or (as DataLoader's Sequential- /
        #: RandomSampler) one of this Loader's own whose ``set_epoch`` sets the Loader's epoch,
        #: so that a trainer calling ``dataloader.sampler.set_epoch`` (Lightning) sets it.
        self.sampler = sampler if sampler is not None else EpochSampler(self)
        self._batch_sampler = batch_sampler  # the user's (None: batches of batch_size)
        # loader.batch_sampler: the user's, else DataLoader's BatchSampler (None unbatched)
        self._batch_sampler_attr = (batch_sampler if batch_sampler is not None or unbatched
                                    else BatchSampler(self.sampler, self._batch,
                                                      bool(drop_last)))
        #: DataLoader's attribute: the ``collate_fn`` given, else the default collation
        #: (``collate``: ``default_collate``'s result; ``default_convert`` when unbatched)
        self.collate_fn = collate_fn if collate_fn is not None else (
            default_convert if unbatched else collate)
        self.drop_last = drop_last
        self.pin_memory = bool(pin_memory)
        self.pin_memory_device = pin_memory_device
        self.timeout = float(timeout)
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.transform = transform
        self.in_order = in_order
        self._unbatched = unbatched
        if unbatched:
            collate_fn = _one(collate_fn)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r}: torch has no CUDA device here "
                                 f"(torch {torch.__version__}); give device=None for host batches")
            if self.device.index is None:
                # The training loop's device now, without initialising CUDA (workers can then
                # still fork): uninitialised, it is device 0.
                index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
                self.device = torch.device("cuda", index)
        self.seed = draw_seed(generator) if seed is None else _check_int("seed", seed, None)
        self._seed_given = seed is not None
        self._ranks_given = (rank, world_size)
        self._set_ranks()
        self.worker_kind = worker_kind
        self.memory_aware = bool(memory_aware)
        self.on_error = on_error
        self.on_worker_death = on_worker_death
        self.max_tries = max(1, int(max_tries))
        self.sample_timeout = sample_timeout or None
        self.config = cfg
        self._on_skip: Callable | None = None
        self.decision_hooks: list[Callable[[Any], None]] = []
        self.decisions: deque = deque(maxlen=1000)

        cores = usable_cores()
        if worker_kind == "ray" and knobs.get("workers") != 0:
            # the cluster's free CPUs bound the actors, not this machine's (with no worker
            # there is no actor: no Ray to start, trial 173 waited 5-7 s for one)
            cores = _ray_capacity(ray_address, ray_actor_options)
        start = dict(knobs)
        if cfg is not None:
            # An argument wins over the file's knob: said, since a DataLoader call converted
            # as it was (num_workers=, prefetch_factor=) loses the tuned values without a
            # word otherwise (trial 173)
            said = {"workers": "num_workers" if num_workers is not None else "workers",
                    "depth": "prefetch_factor" if prefetch_factor is not None else "depth"}
            over = [(said.get(k, k), v, k, cfg["knobs"][k]) for k, v in knobs.items()
                    if k in cfg["knobs"] and cfg["knobs"][k] != v]
            if over:
                log.warning(
                    "%s given to the Loader override%s the configuration's %s (%s): an "
                    "argument wins; leave %s out to use the configuration's",
                    ", ".join(f"{a}={v}" for a, v, _, _ in over), "" if len(over) > 1 else "s",
                    ", ".join(f"{k}={c}" for _, _, k, c in over),
                    config if isinstance(config, (str, os.PathLike)) else "config=",
                    "it" if len(over) == 1 else "them")
            start = {**cfg["knobs"], **start}
        values, bounds = default_knobs(self._batch, cores, start.get("workers"))
        if cfg is not None:
            for name, (lo, hi) in cfg["bounds"].items():
                bounds[name] = (lo, hi)
        values.update(start)
        # (its cache is replaced between epochs: not after the look-ahead read it, not in
        # a worker process's copy)
        self._replaces_cache = random_state.holds_smart_cache(dataset)
        if values["workers"] > 0 and worker_kind != "thread" and self._replaces_cache:
            raise ValueError(
                "a SmartCacheDataset (MONAI's, in this dataset) replaces its cache in the "
                "training process (update_cache() before each epoch), and worker processes hold "
                "a copy of the "
                f"dataset: with worker_kind={worker_kind!r} every epoch would train on the first "
                "cache (MONAI: it does not work with persistent workers or spawn; "
                "persistent_workers=False does not help here: it sends the workers the dataset "
                "pickled, and a started SmartCacheDataset does not pickle, its replacement "
                "thread's lock). Use worker_kind='thread', whose workers share the dataset, or "
                "num_workers=0")
        if persistent_workers and values["workers"] == 0:  # (the file's knobs: the
            # arguments' were refused above, before any work)
            raise ValueError("persistent_workers option needs num_workers > 0 (as in "
                             "DataLoader); the configuration"
                             + (f" {config}" if isinstance(config, (str, os.PathLike))
                                else "") + " sets workers: 0")
        # (the default: persistent, unlike the DataLoader, where there are workers to keep)
        self.persistent_workers = (values["workers"] != 0 if persistent_workers is None
                                   else bool(persistent_workers))
        # The draws of the DataLoader as the user set it (_draw_as_the_dataloader): at every
        # iter(), or only the first with persistent workers given (its default: not persistent)
        self._draws_each_pass = not (persistent_workers and values["workers"] != 0)
        self._draws = 0 if seed is not None else 1  # numbers drawn for passes so far
        self._dl_passes = 0  # the passes the DataLoader would have made by now
        self._sampler_draws = 0  # passes its RandomSampler drew for (shuffle=True)
        # its permutations drawn at a pass's end, owed by the pass about to begin
        # (shuffle=True with a generator; see _draw_as_the_dataloader)
        self._tail_owed = 0
        self._last_pass: int | None = None  # id() of the latest pass's iterator
        self._asks = 0  # next() calls, of every pass
        self._asks_at_pass = 0  # next() calls when the latest pass began
        if values["workers"] == 0:
            bounds["workers"] = (0, 0)
        elif bounds["workers"][0] == 0:
            bounds["workers"] = (1, max(1, bounds["workers"][1]))
        if "workers" not in knobs and values["workers"] > bounds["workers"][1]:
            # A configuration tuned on a bigger machine: say so rather than oversubscribe.
            log.warning("the configuration asks for %d workers, more than the workers bound "
                        "of %d (the configuration's bounds, else 4 a %s and at least 8; %d "
                        "here); using %d", values["workers"], bounds["workers"][1],
                        "CPU of the Ray cluster free for actors" if worker_kind == "ray"
                        else "usable core", cores, bounds["workers"][1])
            if "pool_size" not in start:  # (sized for the workers used: trial 173, 109)
                values["pool_size"] = default_knobs(self._batch, cores,
                                                    bounds["workers"][1])[0]["pool_size"]
        #: knobs whose upper bound a user's value raised: the bound it raised (see _set_knob)
        self._raised: dict[str, int] = {}
        for name in knobs:  # the user's explicit choice raises the bound the controller keeps
            if (name != "workers" or values["workers"] > 0) and values[name] > bounds[name][1]:
                self._raised[name] = bounds[name][1]
                bounds[name] = (bounds[name][0], values[name])
        bounds["pool_size"] = (max(self._batch, bounds["pool_size"][0]),
                               max(self._batch, bounds["pool_size"][1]))
        self.knobs = Knobs(values, bounds)
        if cfg is not None:
            applied = self.knobs.as_dict()
            moved = [(k, v, applied[k]) for k, v in cfg["knobs"].items()
                     if k not in knobs and k != "workers" and applied[k] != v]
            if moved:
                # (workers above the bound are said above; the rest were clamped without a
                # word: trial 197's pool_size below the batch size)
                log.warning("the configuration's %s %s outside the Loader's bounds here "
                            "(%s): using %s",
                            ", ".join(f"{k}={v}" for k, v, _ in moved),
                            "is" if len(moved) == 1 else "are",
                            ", ".join(f"{k} {list(self.knobs.bounds(k))}" for k, _, _ in moved),
                            ", ".join(f"{k}={n}" for k, _, n in moved))
        if self.timeout > 0 and values["workers"] == 0:
            # The DataLoader refuses it (an AssertionError at iter()); the Loader goes on,
            # but says once that it is not applied (trial 111: silently ignored).
            warnings.warn(f"timeout={self.timeout:g} is not applied with num_workers=0: each "
                          "batch is loaded in the training loop's thread", stacklevel=2)
        if self._iterable and "workers" not in knobs and values["workers"] > 0:
            # DataLoader's default is no worker, under which any iterable dataset yields each
            # sample once; with workers, each iterates the dataset (review 100: a dataset
            # that does not shard by get_worker_info() came twice, silently).
            warnings.warn(
                f"{type(dataset).__name__} is an IterableDataset and num_workers was not "
                f"given: each of the {values['workers']} workers (the controller may change "
                "the count) iterates it, so it must take its share by "
                "torch.utils.data.get_worker_info(), as under DataLoader(num_workers=N); "
                "else every sample comes once per worker. Pass num_workers (0: no worker, "
                "DataLoader's default) to say which", stacklevel=2)

        fused = True if fuse_read is None else bool(fuse_read)
        if not fused and self._iterable:
            # (accepted without a word: trial 197, after the Data Monitor advised it)
            warnings.warn(f"fuse_read=False does not apply to {type(dataset).__name__}, an "
                          "IterableDataset: each worker iterates it, reading as it goes "
                          "(docs/workers.md)", stacklevel=2)
        avail = psutil.virtual_memory().available
        shm_budget = (int(memory_budget_bytes) if memory_budget_bytes is not None
                      else int(min(shm_free_bytes() * 0.5, avail * 0.25)))
        self._cfg = PipelineConfig(
            batch_size=self._batch, drop_last=drop_last, in_order=in_order, on_error=on_error,
            on_worker_death=on_worker_death, max_tries=self.max_tries,
            sample_timeout=self.sample_timeout, collate_fn=collate_fn, device=self.device,
            worker_kind=worker_kind, fuse_read=fused, start_method=start_method,
            shm_budget_bytes=shm_budget, persistent_workers=self.persistent_workers,
            pin_memory=pin_memory_effective, iterable=self._iterable,
            ray_actor_options=ray_actor_options, dataset_len=self._n,
            memory_aware=bool(memory_aware), warm_heap=bool(warm_heap) and _allocator_free(),
        )
        self.stage_stats: dict[str, StageStats] = {s: StageStats(s) for s in STAGES}
        self._consumer_busy = 0.0
        self._steps = 0  # steps that ended (their seconds: _consumer_busy)
        # The next() under way: when it began, and the latest snapshot that counted it as wait
        # (a training loop blocked in it, the first batch's too, is waiting now: review 85)
        self._wait_since: float | None = None
        self._wait_seen: float | None = None
        self._consumer_wait = 0.0
        self._cold_wait = 0.0  # of it, for cold passes' first batches (_back's cold)
        self._cold_shown = 0  # the most cold starts a snapshot showed (_cold_starts_shown)
        self._wait_cold = False  # the next() under way waits for a cold pass's first batch
        # The step of the batch returned last: (return time, its wait, its samples, the id of
        # the iterator that returned it), closed by the training loop's next request (see
        # _EpochIterator).
        self._step_open: tuple[float, float, int, int] | None = None
        # Re-entrant: a collection that an allocation under the lock triggers may finalize a
        # dropped iterator of this loader, whose __del__ closes its step (see _end_step)
        self._step_lock = threading.RLock()
        # A snapshot counted the open step up to this time: the step ends no earlier, so the
        # busy total never goes back between two snapshots (see snapshot)
        self._step_seen: float | None = None
        self._batches = 0
        # whether the next() of each recent batch found no batch ready (snapshot's
        # consumer_empty_recent)
        self._empty_recent: deque[bool] = deque(maxlen=RECENT)
        self._samples = 0
        self._h2d_bytes = 0
        self._h2d_seconds = 0.0
        self._epoch = 0
        self._epoch_set = False
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self._epoch_step = 1  # the epoch's move expected after this pass (see _stride)
        self._epoch_moved: int | None = None  # how it moved between the last two passes
        self._same_order_told = False  # warned that a DistributedSampler's epoch stood still
        self._last_whole_dist_epoch: int | None = None  # (see _pass_ended)
        self._same_dist_epoch_passes = 0  # whole passes in a row that began at it
        self._sampler_epoch_step = 1  # the same of a DistributedSampler's epoch
        self._sampler_epoch_moved: int | None = None
        self._last_sampler_epoch: int | None = None
        self._last_pass_epoch: int | None = None
        self._started = False
        self._batches_at_iter = 0
        self._sync_skipped = 0
        self._sync_cold_starts = 0  # passes with no worker (each loads from its start)
        # The training loop outside every pass (see _left): since when (time.monotonic()),
        # up to when a snapshot counted it (the total never goes back, as the step's), and
        # the seconds before
        self._away_since: float | None = None
        self._away_seen: float | None = None
        self._away_s = 0.0
        self._live_passes: set[int] = set()  # id()s of iterators not ended nor dropped
        self._errors_raised = 0  # errors raised in the training loop, the epoch going on
        self._samples_lost = 0  # samples lost with them
        # counters of a pipeline closed and rebuilt (load_state_dict): the totals go on from them
        self._retired = dict.fromkeys(_PIPELINE_COUNTERS, 0)
        # Guards only the swap of a retired pipeline for its counts (load_state_dict) against
        # snapshot(), and the once-only warning of _same_order_warn; never held around user
        # code (self._lock is: samplers run under it).
        self._counts_lock = threading.Lock()
        self._progress: resume.Progress | None = None  # the most recent iterator's
        self._resume: dict | None = None  # a loaded state, until the next iteration
        # memory-aware dispatch's figures (SampleMemory.saved) for the next pipeline: from a
        # loaded state, or from a pipeline that load_state_dict closed
        self._memory_figures: list[int] | None = None
        self._sample_seconds: list[float] | None = None  # slow first's (costs.py), likewise
        self._seeds_taken = 0  # times load_state_dict replaced the drawn seeds
        # Host-to-device copies of dropped iterators still to count, whose pinned host batches
        # must live until their copies end (else the pool refills them under the copy):
        # appended from __del__ (any thread: a deque, no lock), polled by the training loop.
        self._orphan_h2d: deque = deque()
        self._resumed: dict | None = None  # the state the most recent pass resumed
        self._restart_warned: Any = None  # the pass whose iterable restart was told
        self._sync_skip_logged: set[int] = set()
        self._pipeline: Pipeline | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._telemetry = None
        self._controller = None
        self._home_pid = os.getpid()  # (_close_all: a forked child's exit leaves it alone)
        _live.add(self)
        with _HeldInterrupt() as held:
            try:
                self._start(values, worker_kind, start_method, cores, cfg, autotune,
                            metrics_port, metrics_host, monitor_interval)
            except BaseException:
                self.close()  # what started before the error
                raise
        if held.hit:  # Ctrl-C while it started: it ends as if it had come before
            self.close()
            raise KeyboardInterrupt

    def _start(self, values: dict, worker_kind: str, start_method: str, cores: int,
               cfg: dict | None, autotune: bool, metrics_port: int | None,
               metrics_host: str, monitor_interval: float | None) -> None:
        """The end of ``__init__``: the workers (where they start with the Loader), the
        telemetry and the controller."""
        if values["workers"] > 0 and worker_kind == "process" and start_method in ("auto", "fork"):
            # Start the workers now, before telemetry and the controller start threads, so
            # that they can fork (see start_method).
            self._ensure_pipeline()
        if values["workers"] > 0 and worker_kind == "ray":
            self._ensure_pipeline()  # actors start placing while the training job sets up

        me = _Observed(self)
        if metrics_port is not None or monitor_interval is not None or monitor_interval_from_env():
            from autominato import telemetry
            from autominato.telemetry.cores import CoreBudget

            # The controller's core budget (below), so that the report never suggests what
            # the controller refuses: with Ray, the cluster's free CPUs.
            self._telemetry = telemetry.attach(
                me, port=metrics_port, host=metrics_host, monitor_interval=monitor_interval,
                budget=CoreBudget(cores, placed=worker_kind == "ray"),
                free_if_busy=getattr(_copying, "active", False),
            )
        if autotune:
            self._controller = Controller(me, config=cfg,
                                          cores=cores if worker_kind == "ray" else None)
            self._controller.start()
        self._initialized = True

    #: Attributes fixed once the Loader is built (DataLoader's list and error): the epoch's
    #: order, the batches, the workers' dataset and the pipeline are made from them.
    _FIXED = frozenset(("dataset", "batch_size", "batch_sampler", "sampler", "drop_last",
                        "persistent_workers"))

    #: DataLoader attributes that the DataLoader applies at the next ``iter()`` but that the
    #: Loader's pipeline is built from: setting them is refused rather than ignored.
    _BUILT = frozenset(("collate_fn", "in_order", "pin_memory", "pin_memory_device",
                        "multiprocessing_context", "generator"))

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_initialized", False):
            if name in self._FIXED:
                raise ValueError(f"{name} attribute should not be set after "
                                 f"{type(self).__name__} is initialized")
            if name in self._BUILT:
                raise ValueError(f"{name} cannot be set after the Loader is built: its workers "
                                 "and pipeline are made from it (the DataLoader would apply it "
                                 "at the next iter()); build a new Loader with it")
            if name == "worker_init_fn" and value is not self.__dict__.get(name):
                # Lightning's seed_everything(workers=True) sets its seeding function here
                # after the loader is built: the Loader's workers seed themselves
                # (worker.seed_globals), so the function is kept but not run.
                log.info("worker_init_fn set after the Loader was built is not run (its "
                         "workers already started, and seed themselves): pass it to Loader()")
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ DataLoader API
    @property
    def batch_sampler(self) -> Any:
        """DataLoader's attribute: the ``batch_sampler`` given, else (with ``batch_size``) a
        ``torch.utils.data.BatchSampler(loader.sampler, batch_size, drop_last)``, as the
        DataLoader makes one (``loader.batch_sampler.batch_size`` and ``.drop_last`` read as
        there), ``None`` when unbatched (``batch_size=None``). Its index lists are this
        rank's epoch cut in order; in completion order (``in_order=False``) a delivered batch
        takes the samples that finished first, so its indices may differ from the list's. Set
        only at construction (``ValueError`` after, as the DataLoader's)."""
        return self._batch_sampler_attr

    @property
    def _n(self) -> int | None:
        """The dataset's length: a map-style dataset's read again each time, as the
        DataLoader's samplers do at each pass (a dataset that grows or shrinks between
        epochs); an iterable dataset's as it was when the Loader was built, or ``None``."""
        if self._iterable:
            return self._n_iterable
        return len(self.dataset)

    def __len__(self) -> int:
        """Batches per epoch on this rank (an upper bound when ``on_error="skip"`` drops some).

        Raises:
            TypeError: the sampler has no length (a generator), or the dataset is iterable and
                has no ``__len__``, as with the DataLoader.
        """
        if self._iterable:
            if self._n is None:
                raise TypeError(f"the iterable dataset ({type(self.dataset).__name__}) has no "
                                "len(), so neither has the Loader (as with DataLoader)")
            # DataLoader's: from the dataset's own length, whatever the workers' sharding
            self._iterable_len_said = self._n  # (what a pass that yields more warns of)
            return self._n // self._batch if self.drop_last else -(-self._n // self._batch)
        if self._batch_sampler is not None:
            try:
                return len(self._batch_sampler)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(f"the batch_sampler ({type(self._batch_sampler).__name__}) has "
                                "no len(), so neither has the Loader (as with DataLoader)") from None
        n = self._samples_per_epoch()
        return n // self._batch if self.drop_last else -(-n // self._batch)

    @property
    def num_workers(self) -> int:
        """Workers now (the ``workers`` knob: the controller may change it); setting it
        sets the knob."""
        return self.knobs.workers

    @num_workers.setter
    def num_workers(self, n: int) -> None:
        self._set_knob("workers", "num_workers", _check_int("num_workers", n, 0, bools=True))

    @property
    def prefetch_factor(self) -> int | None:
        """Batches prepared ahead now (the ``depth`` knob); ``None`` with ``num_workers=0``,
        where nothing is prepared ahead, as the DataLoader's (trial 179: it read 2); setting
        it sets the knob."""
        return self.knobs.depth if self.knobs.workers > 0 else None

    @prefetch_factor.setter
    def prefetch_factor(self, n: int) -> None:
        self._set_knob("depth", "prefetch_factor", _check_int("prefetch_factor", n, 1))

    def _set_knob(self, knob: str, name: str, value: int) -> None:
        """Set ``knob`` as the user's ``name``. A value above its upper bound raises the bound
        (the user's explicit choice, as in the constructor: the DataLoader takes any
        ``prefetch_factor``); one below the lower bound is refused by name rather than clamped
        (``num_workers=0`` is a Loader without workers: build one)."""
        lo, hi = self.knobs.bounds(knob)
        if value > hi and not (knob == "workers" and hi == 0):
            self._raised.setdefault(knob, hi)
            hi = value
            self.knobs.set_bounds(knob, lo, hi)
        elif knob in self._raised and value <= self._raised[knob]:
            # a bound an earlier value raised falls back (prefetch_factor=200, then 4: the
            # controller is kept at 32 again); bounds set otherwise are left alone
            hi = max(lo, self._raised.pop(knob))
            self.knobs.set_bounds(knob, lo, hi)
        if not lo <= value <= hi:
            why = (" (whether a Loader has workers at all is fixed when it is built: "
                   "num_workers=0 loads in the training loop's thread; build a new Loader to "
                   "switch)"
                   if knob == "workers" and 0 in (value, lo) else "")
            raise ValueError(f"{name}={value} is outside this Loader's bounds [{lo}, {hi}]{why}")
        self.knobs.set(knob, value)

    def _samples_per_epoch(self) -> int:
        self._set_ranks()
        if self._sampler is not None:
            try:
                return len(self._sampler)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(
                    f"the sampler ({type(self._sampler).__name__}) has no len(), so neither has "
                    "the Loader (as with DataLoader); give a sampler with __len__") from None
        if self.world_size > 1:
            return -(-self._n // self.world_size)
        return self._n

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the shuffle and augmentation seeds of every iteration until the
        next call (as ``DistributedSampler.set_epoch``); a sampler with ``set_epoch`` gets it
        too. Without any call, each pass over the Loader that delivers a batch is a new epoch,
        moved up to a ``DistributedSampler``'s epoch of the user's where the loop set it above
        (docs/parity.md)."""
        self._epoch = int(epoch)
        self._epoch_set = True
        self._named = True
        if self._resume is not None and self._resume["epoch"] != self._epoch:
            log.warning("set_epoch(%d) after load_state_dict() of epoch %d: epoch %d starts "
                        "from its beginning", self._epoch, self._resume["epoch"], self._epoch)
            self._resume = None
        self._set_sampler_epochs()

    def _set_sampler_epochs(self) -> None:
        """``set_epoch(self.epoch)`` on the user's sampler, batch sampler and the batch
        sampler's sampler, those that have it (as ``DistributedSampler.set_epoch``)."""
        resume.set_sampler_epochs(self, dict.fromkeys(resume.SAMPLER_PATHS, self._epoch))

    @property
    def epoch(self) -> int:
        """The epoch of the latest pass (its shuffle and augmentation seeds); before the
        first, the one it will take (a DistributedSampler's set above the count, see
        docs/parity.md)."""
        if not self._started and self._resume is None and self._ended is None:
            return self._followed_epoch() or self._epoch
        return self._epoch

    def _set_ranks(self) -> None:
        """``rank`` and ``world_size``: as given, else from ``torch.distributed`` once it is
        initialised. Read again at every pass and ``len()`` while not given: Lightning's DDP
        strategies initialise the process group after a training script may have built the
        Loader (``Trainer.fit`` does it), and the Loader must not read one process's view.

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        rank, world_size = self._ranks_given
        if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
            rank = torch.distributed.get_rank() if rank is None else rank
        self.world_size = int(world_size or 1)
        self.rank = int(rank or 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        telemetry = getattr(self, "_telemetry", None)
        if telemetry is not None:
            telemetry.set_rank(self.rank)  # the series were labelled before the group existed
        # All ranks must draw one permutation (DistributedSampler's seed 0 when none is given).
        self.shuffle_seed = 0 if not self._seed_given and self.world_size > 1 else self.seed

    def _order(self, epoch: int, at_end: list | None = None) -> tuple[list[int], list[int] | None]:
        """The epoch's dataset indices in sampler order, and the sizes of the batch
        sampler's batches (``None`` without one). ``at_end``: what reads a user's
        ``RandomSampler`` to its end is put there (``sampler.read_sampler``)."""
        if self._batch_sampler is not None:
            batches = read_sampler(self._batch_sampler, self._n, "batch_sampler",
                                   batches=True, at_end=at_end)
            return [i for b in batches for i in b], [len(b) for b in batches]
        return epoch_order(
            self._n, epoch=epoch, seed=self.shuffle_seed, shuffle=self.shuffle, sampler=self._sampler,
            rank=self.rank, world_size=self.world_size, batch_size=self._batch, drop_last=self.drop_last,
            at_end=at_end,
        ), None

    #: What ``__iter__`` moves before its pass starts, put back when the start raises.
    _close_done = False  # close() ran to its end (``_closed``: it began)
    #: After ``load_state_dict`` of an ended map-style epoch, until a pass delivers a batch:
    #: ``(epoch, that epoch as a resumable state with nothing left, the state loaded)``, for
    #: a loop that names the epoch (:meth:`_named_ended`) and for ``state_dict()``.
    _ended: tuple[int, dict, dict] | None = None
    _named = False  # set_epoch was called since the Loader was built or last loaded a state
    #: The latest map-style pass's epoch as counted, before a DistributedSampler's moved it up
    #: (_followed_epoch): a set_epoch before its first batch restarts it from this count.
    _pass_counted: int | None = None

    _PASS_FIELDS = ("_epoch", "_batches_at_iter", "_started", "_progress", "_resume",
                    "_resumed", "_epoch_step", "_sampler_epoch_step", "_last_pass_epoch",
                    "_last_sampler_epoch", "_epoch_moved", "_sampler_epoch_moved", "_ended",
                    "_pass_counted")

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        with self._lock:
            # A pass that cannot start (a scheduler that failed, a dataset that no longer
            # pickles, a checkpoint that does not match) leaves the loader as it was: else
            # the epoch would move on and state_dict() describe a pass that never ran, and a
            # checkpoint taken then would skip the rest of the interrupted epoch.
            saved = [getattr(self, name) for name in self._PASS_FIELDS]
            try:
                it = self._start_pass()
                with self._step_lock:
                    self._live_passes.add(id(it))
                self._last_pass = id(it)
                if self._pipeline is not None:
                    # Its SIGTERM clean-up (only the main thread can set a handler: a Loader
                    # built in another thread had none, and SIGTERM left its shared memory
                    # in /dev/shm, trial 176); at once where it is set already.
                    cleanup.install()
                return it
            except BaseException:
                for name, value in zip(self._PASS_FIELDS, saved, strict=True):
                    setattr(self, name, value)
                raise

    def _start_pass(self) -> Iterator[Any]:
        """``__iter__``'s work, under ``self._lock``."""
        self._draw_as_the_dataloader()
        prev = self._progress
        # A resumed pass that ended delivered its epoch's batches before the checkpoint,
        # maybe all of them (a checkpoint after the last batch): it was an epoch too.
        ended_resumed = prev is not None and prev.finished and prev.batches > 0
        was_epoch = self._batches > self._batches_at_iter or ended_resumed
        if self._started and not self._epoch_set and was_epoch:
            # Like DataLoader's RandomSampler: a new shuffle each pass, until the training
            # loop sets the epoch itself; from then on, as with DistributedSampler, the
            # epoch is the one set (a peek with next(iter(loader)) does not advance it).
            # A pass that delivered no batch is not an epoch (RandomSampler draws its
            # permutation at the first batch): Lightning calls iter() once to check the
            # loader, then again for epoch 0, and only then set_epoch(0). So a pass begun
            # before the last one delivered a batch is the same epoch, also when that one is
            # still held: Lightning starts a pass it never uses before each reloaded epoch
            # (review 62), which cannot be told from zip(loader, loader)'s two passes.
            self._epoch += 1
        elif (self._started and not was_epoch and not self._epoch_set
              and self._pass_counted is not None):
            # The pass before delivered nothing, so this one is its epoch: as counted, not
            # as that pass followed a sampler (review 193: Lightning's check iter(), then the
            # fit's iter(), then set_epoch(0) on a sampler left at 3 by an earlier fit: the
            # fit counted from 3)
            self._epoch = self._pass_counted
        self._batches_at_iter = self._batches
        self._started = True
        self._end_step()
        self._set_ranks()
        if self._iterable:
            progress = self._progress = resume.Progress(self._epoch, None)
            if self.knobs.workers == 0:
                # One stream in the loop's thread: len() batches are all there is (a
                # dataset whose __len__ is true), as DataLoader's single-process iterator.
                progress.drained = lambda: True
                self._sync_cold_starts += 1
                return _SyncStreamIterator(self, self._epoch, progress)
            pipeline = self._ensure_pipeline()
            colds = pipeline.cold_starts
            run = pipeline.start_stream(self._epoch)
            progress.drained = functools.partial(_run_drained, run)
            it = _EpochIterator(self, pipeline, run, progress)
            it._cold = int(pipeline.cold_starts > colds)
            return it
        pending, self._resume = self._resume, None
        if pending is None:
            pending = self._named_ended()
            if pending is not None:
                self._ended = None  # (consumed: E is behind the loop, review 164)
        if (pending is None and not was_epoch and self._resumed is not None
                and prev is not None and prev.epoch == self._epoch and not prev.finished):
            pending = self._resumed  # the resumed pass delivered no batch: resume again
        self._pass_counted = self._epoch
        if pending is None:  # (a state resumed names its epoch itself)
            self._epoch = self._followed_epoch() or self._epoch
        it = self._map_pass(pending, was_epoch)
        # (the samplers' epochs as the order left them: a sampler may move its own on at the
        # end of __iter__, accelerate's SeedableRandomSampler: review 152)
        it._began = (self._epoch, pending is not None, resume.sampler_epochs(self))
        return it

    def _followed_epoch(self, sampler: Any = None, above: int | None = None) -> int | None:
        """The epoch of the user's ``DistributedSampler`` (given as ``sampler``, as
        ``batch_sampler``, a subclass that yields batches, or as the ``sampler`` of a batch
        sampler; ``sampler``: a copy of it to read instead) where it is above the Loader's
        (``above``, else ``self._epoch``: as counted for the pass) and ``loader.set_epoch`` was
        never called, else ``None``: the pass's epoch then moves up to it.

        A training loop that sets its sampler's epoch itself (DDP's habit:
        ``sampler.set_epoch(e)`` every epoch) and resumes at epoch ``e`` sets ``e`` on its first
        pass: that pass's augmentation and ``epoch`` are then ``e``'s, as its order (trial 189:
        pass 0's augmentation with epoch ``e``'s order). A sampler's epoch at or below the
        Loader's leaves the count as it is: every pass still draws anew, as the DataLoader's
        workers do (review 68: a loop that makes two passes an epoch, training and
        evaluation, drew the next epoch's augmentation in the second where the Loader took
        the sampler's epoch as it was), also where the loop never sets the sampler's epoch (0
        throughout: its order repeats, warned, the augmentation moves on) or sets it back.
        A ``DistributedSampler`` or a subclass (only the epoch is read), not other samplers
        with ``set_epoch`` (an epoch of their own: accelerate's ``SeedableRandomSampler``
        moves it as it is read), and not with an iterable dataset; not while a state loaded
        names the pass's epoch (``load_state_dict``: the resumed pass is the state's epoch;
        a state taken before a pass that would follow records the followed epoch,
        ``resume.build``)."""
        if self._epoch_set or self._iterable:
            return None
        for s in ((sampler,) if sampler is not None
                  else (self._sampler, self._batch_sampler,
                        getattr(self._batch_sampler, "sampler", None))):
            if isinstance(s, DistributedSampler) and resume._is_epoch(s.epoch):
                base = self._epoch if above is None else above
                return int(s.epoch) if int(s.epoch) > base else None
        return None

    def _named_ended(self, epoch: int | None = None, peek: bool = False) -> dict | None:
        """After ``load_state_dict`` of an ended epoch E (a state taken after its last
        batch), whose next pass is E + 1: where the training loop names E itself, E as a
        resumed state with nothing left (its pass ends at once; ``self._epoch`` set to E),
        else ``None``. Named: the Loader's epoch is E (``set_epoch(E)`` before or after the
        load), or it is E + 1 and the user's sampler is at E (``sampler.set_epoch(E)`` after
        the load, DDP's habit, or before it for E > 0). A loop that resumes the epoch its
        checkpoint was taken in then gets each sample once (trial 158: E was delivered again
        in full, or E + 1 twice); Lightning, which makes its iterator and then sets E + 1,
        gets E + 1. ``epoch``: the pass's epoch (else ``self._epoch``); ``peek``: nothing is
        changed (``resume.build``)."""
        ended = self._ended
        if ended is None:
            return None
        e = ended[0]
        epoch = self._epoch if epoch is None else epoch
        at = resume.sampler_epochs(self)
        names = bool(at) and _samplers_name(at, ended[2].get("began_sampler_epochs"), e)
        if epoch == e and (all(v == e for v in at.values()) or names):
            return ended[1]
        if epoch == e + 1 and names:
            if not peek:
                self._epoch = e
            return ended[1]
        return None

    def _restart_epoch(self, resumed: bool) -> int:
        """The epoch a pass restarted by a ``set_epoch`` before its first batch counts from
        (``_restart_pass``): the Loader's, where ``loader.set_epoch`` named it or the pass
        resumes a state; else the pass's count before a DistributedSampler moved it up at
        ``iter()`` (review 192: a sampler left at epoch 3 by an earlier fit, set to 0 after
        ``iter()``, ran the fit at augmentation epochs 3, 4, ... with orders 0, 1, ...)."""
        if resumed or self._epoch_set or self._pass_counted is None:
            return self._epoch
        return self._pass_counted

    def _map_pass(self, pending: dict | None, was_epoch: bool) -> Iterator[Any]:
        """A map-style dataset's pass over ``self._epoch`` (``_start_pass``'s; resuming
        ``pending``, a mid-epoch state, when given), under ``self._lock``."""
        self._resumed = pending
        if pending is not None:
            for name, sd in pending["samplers"].items():
                getattr(self, name).load_state_dict(sd)
        samplers = resume.sampler_states(self)
        sampler_epochs = resume.sampler_epochs(self)
        at_end: list = []  # (a RandomSampler of the user's: its end, read when the pass ends)
        order, groups = self._order(self._epoch, at_end)
        # (a checkpoint that does not match raises here and stays pending, __iter__ puts the
        # fields back: a later pass must not start the epoch afresh and deliver again what
        # was delivered before it, review 45)
        done = (resume.resumed_positions(pending, order, self._epoch, self._order_rank())
                if pending is not None else [])
        # A batch sampler's empty batches ([]) that reached the loop before the checkpoint
        # (no position marks them): the first so many, in the order the epoch emits them
        empty_total = 0 if groups is None else groups.count(0)
        done_empty = (min(int(pending.get("empty_batches", 0)), empty_total)
                      if pending is not None and pending["epoch_size"] is not None else 0)
        # A user's sampler may not rebuild the same order on resume: its fingerprint is
        # saved with a mid-epoch state and checked (the Loader's own order follows from
        # the seeds and shape that load_state_dict checks).
        user_order = self._sampler is not None or self._batch_sampler is not None
        progress = resume.Progress(self._epoch, len(order), done,
                                   pending["batches"] if done or done_empty else 0, samplers,
                                   order if user_order else None, self._order_rank(),
                                   empties=done_empty, empty_total=empty_total)
        progress.dataset_len = self._n
        progress.sampler_epochs = sampler_epochs
        progress.at_end = at_end
        # The DataLoader reads its sampler's end before it hands out the last batch where its
        # BatchSampler makes a short one, and with workers always (its prefetching is ahead:
        # review 174); only without workers and batches that come out even at the next()
        # after the last
        progress.tail_with_last = self._batch_sampler is None and (
            self.knobs.workers > 0
            or (not self.drop_last and self._batch > 1 and len(order) % self._batch != 0))
        # (shuffle=True with a generator: the DataLoader's RandomSampler's last draw, owed by
        # the pass that began; a pass that replaces it, _restart_pass, takes it on)
        progress.tail_draws, self._tail_owed = self._tail_owed, 0
        self._progress = progress
        if self.knobs.workers == 0:
            self._sync_cold_starts += 1
            return _SyncIterator(self, order, groups, self._epoch, progress)
        pipeline = self._ensure_pipeline()
        if self._last_pass_epoch is not None and was_epoch:
            # (after a pass that was no epoch, Lightning's check, the step is kept)
            step = self._epoch - self._last_pass_epoch
            self._epoch_step = _stride(step, self._epoch_moved)
            self._epoch_moved = step
            if self._last_sampler_epoch is not None:
                # (a DistributedSampler whose epoch the loop sets itself: its own step)
                step = getattr(self._sampler, "epoch", 0) - self._last_sampler_epoch
                self._sampler_epoch_step = _stride(step, self._sampler_epoch_moved)
                self._sampler_epoch_moved = step
        self._last_pass_epoch = self._epoch
        self._last_sampler_epoch = (self._sampler.epoch if type(self._sampler)
                                    is DistributedSampler else None)
        # The Loader's own orders (RandomSampler's, SequentialSampler's) and a
        # DistributedSampler's (its padding repeats an index on another rank only) hold
        # each index once: their repeats are not looked for.
        unique = self._batch_sampler is None and (
            self._sampler is None or type(self._sampler) is DistributedSampler)
        colds = pipeline.cold_starts
        run = pipeline.start(order, self._epoch, groups, done, self._next_epoch_order(),
                             unique=unique, done_empty=done_empty)
        it = _EpochIterator(self, pipeline, run, progress)
        it._cold = int(pipeline.cold_starts > colds)
        return it

    def _restart_pass(self, it: Any, epoch: int, resumed: bool) -> Iterator[Any]:
        """The pass that iterator ``it`` began as ``epoch`` (resuming it from a state when
        ``resumed``), and ``set_epoch`` (the Loader's or a sampler's of the user's) named
        another before its first batch: that epoch's pass, from its beginning, which ``it``
        hands on. As the DataLoader's sampler with no worker, whose order is read at the
        first ``next()``, not at ``iter()``: Lightning makes the first iterator of a fit,
        then calls ``set_epoch`` (trial 147: a resumed fit whose epoch
        ``limit_train_batches`` cut short delivered that epoch's leftovers; trial 151: a fit
        resumed from an end-of-epoch checkpoint, or a second fit on the same Loader, ran
        its first epoch as the epoch the Loader was at, order and augmentation)."""
        with self._lock:
            self._epoch = self._restart_epoch(resumed)
            named = None if resumed else self._named_ended()
            if named is not None:
                self._ended = None  # (consumed)
                # The loop named the ended epoch of the state it loaded, after iter() (see
                # _named_ended): that epoch, with nothing left.
                log.info("set_epoch after the pass of epoch %d began, before its first batch: "
                         "epoch %d, which the state loaded had ended, has nothing left",
                         epoch, self._epoch)
            elif resumed and self._epoch == epoch:
                # Only the user's sampler moved on (its set_epoch, not the Loader's): the
                # resumed epoch counts as ended, as for the sampler, and the next one begins.
                self._epoch += 1
            if named is None:
                self._epoch = self._followed_epoch() or self._epoch
                (log.warning if resumed else log.info)(
                    "set_epoch after the pass %s epoch %d began, before its first batch: "
                    "epoch %d starts from its beginning (samplers' epochs %s)",
                    "resuming" if resumed else "of", epoch, self._epoch,
                    resume.sampler_epochs(self) or "-")
            if not isinstance(it, _SyncIterator):
                it.pipeline.unadopt(it.run)  # (what it loaded ahead is discarded now)
            it.stop(keep_ahead=True)
            saved = [getattr(self, name) for name in self._PASS_FIELDS]
            # A single jump, not the loop's stride (the pass that began took its move from
            # the epoch it began at: a second fit's stride 0 loaded that epoch again ahead,
            # review 152).
            self._epoch_step, self._epoch_moved = 1, None
            if self._last_sampler_epoch is not None:
                self._sampler_epoch_step, self._sampler_epoch_moved = 1, None
            try:
                fresh = self._map_pass(named, False)
            except BaseException:  # (as __iter__: the loader as it was; the pass ends here)
                for name, value in zip(self._PASS_FIELDS, saved, strict=True):
                    setattr(self, name, value)
                raise
            # The DataLoader's RandomSampler draws at its pass's end: the fresh pass owes it
            fresh.progress.tail_draws += it.progress.tail_draws
            it.progress.tail_draws = 0
            # One pass, one cold start: the replaced pass's is taken back (counted in this
            # thread: start() and the sync passes)
            if isinstance(it, _SyncIterator):
                self._sync_cold_starts -= 1
            elif it._cold:
                it.pipeline.cold_starts -= 1
            with self._step_lock:
                self._live_passes.discard(id(it))  # (it only hands on the fresh one's batches)
                self._live_passes.add(id(fresh))
            self._last_pass = id(fresh)
            return fresh

    def _draw_as_the_dataloader(self) -> None:
        """Draw from ``generator`` (else torch's global generator) what the DataLoader's
        ``iter()`` would have drawn by now: its workers' base seed, one int64 at every
        ``iter()`` (``_BaseDataLoaderIter.__init__``), except that persistent workers keep
        their first iterator (``_reset`` draws nothing), the number drawn for ``seed`` when
        the Loader was built standing for the first pass's; so that the training loop and a
        sampler that draws from the global generator (a RandomSampler without one) get the
        DataLoader's numbers (docs/parity.md). A pass
        never asked for a batch (no ``next()`` on any pass since it began) and dropped before
        this one began is not counted: Lightning asks a loader that is not a
        ``torch.utils.data.DataLoader`` for an iterator it never uses
        (``_check_dataloader_iterable``), where it never iterates a DataLoader, so that its
        epochs draw as they do with the DataLoader (review 135). After a user's own unused
        ``iter(loader)`` the next pass then draws nothing, where the DataLoader draws."""
        with self._step_lock:
            unused = (self._last_pass is not None and self._asks == self._asks_at_pass
                      and self._last_pass not in self._live_passes)
            self._last_pass, self._asks_at_pass = None, self._asks
        if unused:
            self._dl_passes -= 1
            if self._progress is not None:  # (its permutation stands for this pass's: its end too)
                self._tail_owed += self._progress.tail_draws
                self._progress.tail_draws = 0
        self._dl_passes += 1
        owed = self._dl_passes if self._draws_each_pass else min(self._dl_passes, 1)
        while self._draws < owed:
            draw_seed(self.generator)
            self._draws += 1
        # shuffle=True: the DataLoader's RandomSampler, iterated at every pass, persistent
        # workers or not, draws its permutation's seed from the global generator, or from
        # ``generator`` a permutation as it starts and another as it ends (torch's
        # RandomSampler.__iter__: ``randperm(n)[:0]``, the last slice of ``num_samples``),
        # so a pass the loop leaves early draws one: the second is owed by the pass and
        # drawn when it ends whole (_pass_ended; trial 141: the training loop's numbers
        # after a shuffled pass differed; trial: both drawn at iter(), a pass left with a
        # break drew one too many, and the generator's permutations after it, a
        # RandomSampler's of the user's, were not the DataLoader's)
        if (self.shuffle and self._sampler is None and self._batch_sampler is None
                and not self._iterable and self.world_size == 1):
            while self._sampler_draws < self._dl_passes:
                if self.generator is None:
                    draw_seed(None)
                else:
                    torch.randperm(self._n, generator=self.generator)
                    self._tail_owed += 1
                self._sampler_draws += 1

    def state_dict(self) -> dict[str, Any]:
        """The state of the most recent iterator, to resume its epoch in a new process
        (torchdata ``StatefulDataLoader``'s name and meaning).

        Returns:
            A picklable dict of plain Python types (see :mod:`autominato.resume`): version,
            epoch, whether the epoch ended, the positions of the epoch's order delivered to
            the training loop (sorted ``[start, stop)`` ranges) and the batches yielded, the
            seeds, the epoch's shape (batch size, rank, world size, dataset length, shuffle,
            drop_last), ``in_order``, the ``state_dict()`` of a sampler or batch sampler that
            has one (as the epoch began), a fingerprint of the order a user's sampler gave
            the epoch, the knob values, and memory-aware dispatch's figures
            (``sample_memory``: peak bytes per index, 0 unknown, for datasets of up to
            65536 indices; ``None`` when nothing was measured, as without memory-aware
            dispatch, and for larger datasets; a loaded state's figures are passed on; a
            resumed memory-aware run then holds outliers apart from its first epoch, see
            docs/memory.md), and slow-first dispatch's (``sample_seconds``: each index's
            last service time in seconds, 0 unknown, likewise; a resumed run's first epoch
            then starts its slowest samples first). Before any iteration: the
            start of the next epoch. After an epoch ended: the next epoch, from its start.

        An iterable dataset's position in its stream is its own: in the middle of its epoch
        the state is that of the epoch from its start (a resume restarts the epoch, as
        DataLoader's under Lightning does; ``restarted`` holds the batches delivered before),
        with an :class:`~autominato.resume.IterableRestartWarning` once per pass; after
        ``len(loader)`` batches of a sized one, the epoch counts as ended.
        """
        return resume.build(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration delivers exactly the samples of
        the interrupted epoch not delivered before the checkpoint, each once, with the same
        augmentation (seeded by ``(seed, epoch, index)``); the iteration after it is the next
        epoch. An iterable dataset's epoch interrupted in the middle restarts from its first
        sample instead (an :class:`~autominato.resume.IterableRestartWarning` says so). Call it before iterating (a fresh Loader in a new process, typically). The
        knobs take the saved values (clamped to this Loader's bounds; ``workers`` is kept when
        either Loader has ``num_workers=0``), so a resumed job starts tuned; a Loader built without ``seed`` takes the state's. ``set_epoch`` with another
        epoch before iterating starts that epoch from its beginning instead.

        Raises:
            TypeError: ``state_dict`` is not a dict, or a mid-epoch state (not one this Loader
                writes) with an iterable dataset.
            ValueError: another state version, or a state saved with another batch size,
                world size, rank, dataset length, ``shuffle``, ``drop_last`` or (when this
                Loader's seed was given) seed; the message names the mismatch. The next
                iteration raises ``ValueError`` if the epoch's order has another length than
                at the checkpoint, or (made by a user's sampler) other indices: a sampler that
                is not deterministic for its epoch, such as a ``WeightedRandomSampler`` whose
                generator no ``set_epoch`` reseeds (see ``docs/resume.md``).
        """
        self._set_ranks()  # the rank the state is checked against (torch.distributed's now)
        state = resume.check(self, state_dict)
        with self._lock:
            if (state["seed"], state["shuffle_seed"]) != (self.seed, self.shuffle_seed):
                # This Loader drew its seeds (resume.check refuses a given one): take the state's.
                self.seed, self.shuffle_seed = int(state["seed"]), int(state["shuffle_seed"])
                self._seeds_taken += 1  # live iterators of the old seeds stop (_SEED_REPLACED)
                # Its workers hold the drawn seed. A live iterator cannot go on: it raises
                # rather than end as if its epoch were complete.
                self._drop_pipeline(RuntimeError(_SEED_REPLACED))
            n = self._n
            if state.get("sample_memory") is not None and len(state["sample_memory"]) == n:
                given = list(state["sample_memory"])
                # figures measured here win; the state's fill the indices not measured (those
                # of a dataset of another length, an ended epoch's state, are not taken)
                own = self._memory_figures
                self._memory_figures = SampleMemory.merge(
                    own if own is not None and len(own) == n else None, given)
                if self._pipeline is not None:
                    self._pipeline.restore_memory(given)
            if state.get("sample_seconds") is not None and len(state["sample_seconds"]) == n:
                given_s = list(state["sample_seconds"])
                own_s = self._sample_seconds
                self._sample_seconds = SampleCosts.merge(
                    own_s if own_s is not None and len(own_s) == n else None, given_s)
                if self._pipeline is not None:
                    self._pipeline.restore_costs(given_s)
            ended = int(state["epoch"]) if state["finished"] and not self._iterable else None
            # The training loop set the ended epoch before loading (set_epoch(e); load; for
            # ...: a loop that resumes the epoch its checkpoint was taken in): see
            # _named_ended. (A fresh sampler is at 0: only an epoch above it is named so.)
            at = resume.sampler_epochs(self)
            named = ended is not None and (
                (self._named and self._epoch == ended)
                or (bool(at) and all(v > 0 for v in at.values())
                    and _samplers_name(at, state.get("began_sampler_epochs"), ended)))
            self._named = False
            self._pass_counted = None  # (review 193: an earlier pass's count, not the state's)
            self._epoch = int(state["epoch"])
            self._epoch_set = bool(state["epoch_set"])
            self._progress = None
            # A finished epoch: the next iteration is the next epoch, also after set_epoch
            # (Lightning creates a resumed fit's first iterator before its set_epoch: the epoch
            # saved would run again, labelled as the next); a set_epoch before iterating wins.
            if state["finished"]:
                self._epoch += 1
                if named and not at:  # (Loader.set_epoch named it: its epoch stays E)
                    self._epoch = ended
            self._started = False
            self._batches_at_iter = self._batches
            self._resume = None if state["finished"] or self._iterable else state
            # A loop that names the ended epoch (set_epoch on the Loader or its sampler, before
            # this load or before iterating) resumes it, as a mid-epoch state: nothing of it
            # is left, so its pass ends at once and the loop's next epoch is the next (trial
            # 158: that epoch was delivered again in full, or the next epoch twice).
            self._ended = (None if ended is None else
                           (ended, {**state, "finished": False, "epoch": ended}, state))
            # The samplers' epoch too (a DistributedSampler's permutation is its epoch's), as
            # set_epoch would: else the rest of the epoch is cut from another epoch's order.
            if not named:  # (else the samplers stay at the epoch the loop named)
                self._set_sampler_epochs()
                began = state.get("began_sampler_epochs") if state["finished"] else None
                if began:
                    # each sampler the one after its own (its numbers may not be the
                    # Loader's: set to the Loader's next, one at the ended epoch's began
                    # value read as the loop naming it, and the pass delivered nothing,
                    # review 191)
                    resume.set_sampler_epochs(self, {k: v + 1 for k, v in began.items()})
            if not state["finished"] or named:
                # The epoch to resume was ordered with the samplers' own epochs, which a loop
                # that sets them itself counts (DDP's habit, from any epoch: a job restarted
                # at epoch 3, or never set): each takes the one it had as the epoch began. An
                # ended epoch's are not: the next epoch is the Loader's next, as above
                # (Lightning's resumed fit calls iter() before it sets the sampler's epoch).
                # (None: a state of an earlier autominato)
                resume.set_sampler_epochs(self, state.get("sampler_epochs") or {})
            else:
                for name, sd in state["samplers"].items():
                    getattr(self, name).load_state_dict(sd)
        for name, value in state["knobs"].items():
            if name == "workers" and (int(value) == 0) != (self.knobs.workers == 0):
                continue  # num_workers=0 is a mode (no worker), not a tuned count
            if name in KNOB_NAMES:
                self.knobs.set(name, int(value))

    def _work_spec(self) -> WorkSpec:
        return WorkSpec(
            dataset=self.dataset,
            transform=self.transform,
            transform_takes_rng=takes_rng(self.transform),
            seed=self.seed,
            threads_per_worker=max(1, usable_cores() // max(1, self.knobs.workers)),
            worker_init_fn=self.worker_init_fn,
            # (an iterable's shard: the seed of the epoch, unless persistent workers were asked)
            seeds_each_epoch=self._draws_each_pass,
            # (the samples seen as they are: the strides they had; else stacked C-contiguous)
            keep_layout=self.batch_size is None or self.collate_fn is not collate,
            monai_track_meta=_monai_track_meta(),
        )

    def _lost_to_error(self, lost: Sequence[Any]) -> None:
        """An error reached the training loop and the epoch goes on; ``lost``: the samples
        (their positions or items) that it cost (``errors_raised_total``,
        ``samples_lost_total``)."""
        self._errors_raised += 1
        self._samples_lost += len(lost)

    def _skip(self, index: int, error: BaseException) -> None:
        """A sample skipped without workers (``num_workers=0``): as the pipeline's skips."""
        self._sync_skipped += 1
        path = sample_path(self.dataset, index)
        log_skip(index, path, error, self._sync_skip_logged)
        if self._on_skip is not None:
            self._on_skip(index, path, error)

    def _order_rank(self) -> int:
        """The rank whose share the epoch's order is: a user sampler's own ``rank`` (a
        ``DistributedSampler`` given its rank under Horovod or torch-XLA, where the Loader,
        without ``torch.distributed``, is rank 0), else the Loader's."""
        for s in (self._sampler, getattr(self._batch_sampler, "sampler", None)):
            r = getattr(s, "rank", None)
            if isinstance(r, int):
                return r
        return self.rank

    def _next_epoch_order(self) -> tuple[list[int], int] | None:
        """``(order, epoch)`` of the pass expected after this one, or ``None`` when it cannot
        be computed without side effects (a user sampler other than ``DistributedSampler``,
        whose iteration may draw from a shared generator) or speculation is off."""
        if (not self.prefetch_next_epoch or not self.persistent_workers or self._iterable
                or self._batch_sampler is not None or self._replaces_cache):
            return None
        epoch = self._epoch + self._epoch_step
        sampler = self._sampler
        if sampler is not None:
            if type(sampler) is not DistributedSampler:  # a subclass may have side effects
                return None
            sampler = copy.copy(sampler)
            # The training loop sets the sampler's epoch itself (DDP's habit) or through
            # set_epoch: either way the next one is expected to follow.
            sampler.set_epoch(sampler.epoch + self._sampler_epoch_step)
            epoch = max(epoch, self._followed_epoch(sampler) or epoch)  # (as the pass will)
        order = epoch_order(
            self._n, epoch=epoch, seed=self.shuffle_seed, shuffle=self.shuffle, sampler=sampler,
            rank=self.rank, world_size=self.world_size, batch_size=self._batch,
            drop_last=self.drop_last,
        )
        return order, epoch

    def _ensure_pipeline(self) -> Pipeline:
        if self._pipeline is None:
            spec = self._work_spec()
            if self._cfg.worker_kind != "thread":
                # (MONAI's invertible transforms record their ids: workers that copied them
                # put these back, random_state.retrace; threads find the originals)
                spec.trace_ids = random_state.trace_ids(spec.dataset, spec.transform)
            me = weakref.ref(self)

            def on_skip(index: int, path: str | None, exc: BaseException) -> None:
                loader = me()
                if loader is not None and loader._on_skip is not None:
                    loader._on_skip(index, path, exc)

            # (the dataset's length now: what the workers' copy and the memory figures hold)
            cfg = dataclasses.replace(self._cfg, dataset_len=self._n)
            _arm_close_at_exit()
            # (Ctrl-C held while its threads and processes start: then raised with the
            # pipeline where close() finds it, see _HeldInterrupt)
            with _HeldInterrupt() as held:
                self._pipeline = Pipeline(cfg, spec, self.knobs, self.stage_stats,
                                          on_skip=on_skip)
                self._pipeline.restore_memory(self._memory_figures)
                self._pipeline.restore_costs(self._sample_seconds)
                self.knobs.subscribe(self._pipeline.knobs_changed)
            if held.hit:
                raise KeyboardInterrupt
        return self._pipeline

    def _count_yielded(self, it: Any) -> None:
        """A batch was returned by iterator ``it``: the DataLoader's warning when a pass over
        an iterable dataset yields more batches than the length ``len(loader)`` read from it
        (the same comparison of batches with the dataset's length, and the same text; once a
        pass here, where the DataLoader warns at every batch beyond it): the only hint that
        a dataset's ``__len__`` (progress bars, a scheduler's ``total_steps``, Lightning's
        epoch length) is wrong, or that its copies in the workers do not shard it."""
        n = it._yielded = it._yielded + 1
        said = it._len_said  # (as len(loader) read it when the pass began, as DataLoader's)
        if said is None or n <= said or it._len_warned:
            return
        it._len_warned = True
        msg = (f"Length of IterableDataset {self.dataset} was reported to be {said}"
               f"(when accessing len(dataloader)), but {n} samples have been fetched. ")
        if self.knobs.workers > 0:
            msg += ("For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples.")
        warnings.warn(msg, stacklevel=4)

    def _delivered(self, now: float, wait: float, samples: int, owner: int,
                   empty: bool | None = None) -> None:
        """A batch of ``samples`` reached the training loop at ``now`` (``time.monotonic()``
        seconds) after ``wait`` seconds in ``next()``; its step opens (see :meth:`_end_step`).
        ``owner``: ``id()`` of the iterator that returned it; ``empty``: that ``next()`` found
        no batch ready (``None``: no batch is made ahead, ``num_workers=0``, where the Data
        Monitor's queue wait share reads the waits instead: review 181). The wait of a
        ``next()`` that :meth:`_back` was told is cold counts in
        ``cold_start_wait_seconds_total`` too."""
        self._ended = None  # (a pass delivered: a loaded ended epoch is behind the loop)
        with self._step_lock:
            seen = self._wait_seen
            if seen is not None and seen > now:
                # ``now`` was read before the lock was taken, and a snapshot in between counted
                # the wait further than that: the total must not go back
                wait += seen - now
                now = seen
            self._wait_since = self._wait_seen = None  # (``wait`` covers the whole next())
            opened = (now, wait, samples, owner)
            self._consumer_wait += wait
            if self._wait_cold:
                self._cold_wait += wait
                self._wait_cold = False
            self._batches += 1
            if empty is not None:
                self._empty_recent.append(empty)
            self._samples += samples
            self._step_open = opened
            self._step_seen = None

    def _end_step(self, now: float | None = None, owner: int | None = None) -> float:
        """Close the open consumer step at ``now`` (default: the present) and record it: the
        training loop asked for the next batch, started a new pass or closed the loader.
        With ``owner``, only a step opened by that iterator (``id``) is closed.

        Returns the instant the step ended (``now``, or later when a snapshot taken meanwhile
        counted the step further): a wait that follows starts there, not counted twice."""
        # An iterator's __del__ may run this from whichever thread collects it: one lock makes
        # the step close once and the totals move with it
        with self._step_lock:
            opened = self._step_open
            if opened is None or (owner is not None and opened[3] != owner):
                return time.monotonic() if now is None else now
            self._step_open = None
            returned, wait, samples, _ = opened
            end = time.monotonic() if now is None else now
            if self._step_seen is not None:
                # ``now`` was read before the lock was taken, and a snapshot in between
                # counted the step further than that
                end = max(end, self._step_seen)
                self._step_seen = None
            step = max(0.0, end - returned)
            self._consumer_busy += step
            self._steps += 1
        self.stage_stats["consumer"].record(step, wait, 0, items=samples)
        return end

    def _left(self, owner: int) -> None:
        """The pass of iterator ``owner`` (``id``) ended (``StopIteration``, an error that
        ends it) or was dropped. When no other pass is live and no step open, the training
        loop has left the loader: the time until it next asks for a batch (``_back``) is
        neither step nor wait (a validation loop, a checkpoint) but time between epochs. A
        pass dropped while another is live (Lightning's unused one, a peek inside the loop,
        one side of ``zip``) is no leave."""
        with self._step_lock:
            self._live_passes.discard(owner)
            if (self._away_since is None and self._step_open is None
                    and not self._live_passes and not self._closed):
                self._away_since = time.monotonic()
                self._away_seen = None

    def _unasked(self) -> None:
        """The ``next()`` under way ended without a batch (the pass's end, an error, a
        timeout): its time was wait all the same, recorded to its end."""
        with self._step_lock:
            since = self._wait_since
            if since is None:
                return
            now = time.monotonic()
            end = now if self._wait_seen is None else max(now, self._wait_seen)
            self._wait_since = self._wait_seen = None
            self._consumer_wait += max(0.0, end - since)
            if self._wait_cold:  # (a snapshot may have counted it so: the total goes on)
                self._cold_wait += max(0.0, end - since)
                self._wait_cold = False

    def _back(self, now: float, asking: bool = False, cold: bool = False) -> None:
        """The training loop asks for a batch at ``now``: the time since it left a pass
        counts in ``between_epochs_seconds_total``. With ``asking`` (it entered ``next()``),
        until that returns, a snapshot counts the time so far as wait (:meth:`_delivered`
        then records the whole wait, :meth:`_unasked` the wait of one that gave no batch);
        with ``cold`` (the first batch of a pass that started cold) as cold-start wait too
        (``cold_start_wait_seconds_total``: a report whose window ends in that wait reads
        it as such, review 198)."""
        with self._step_lock:
            if asking:
                self._wait_since, self._wait_seen = now, None
                self._wait_cold = cold
                self._asks += 1
            since = self._away_since
            if since is None:
                return
            end = now if self._away_seen is None else max(now, self._away_seen)
            self._away_since = self._away_seen = None
            self._away_s += max(0.0, end - since)

    def _drop_pipeline(self, error: BaseException) -> None:
        """Stop the workers and the pipeline's threads and unlink its shared memory, keeping
        what the pipeline learnt (sample figures, counters): the next ``iter()`` builds a new
        one. A live iterator raises ``error`` at its next ``next()``. Call with ``_lock``
        held."""
        p = self._pipeline
        if p is None:
            return
        self.knobs.unsubscribe(p.knobs_changed)
        p.close(error)  # (counts a next epoch loaded ahead as discarded)
        # (its figures, else those it was given: memory_aware=False measures none)
        self._memory_figures = p.memory.saved() or self._memory_figures
        self._sample_seconds = p.costs.saved() or self._sample_seconds
        with self._counts_lock:  # snapshot() sees the pipeline or its counts
            self._pipeline = None
            for name in _PIPELINE_COUNTERS:
                self._retired[name] += getattr(p, name)  # (counters never go back)

    @property
    def _iterator(self) -> None:
        """The DataLoader's attribute for its iterator that holds persistent workers; always
        ``None`` here (no DataLoader iterator). Setting it to ``None``, or deleting it, stops
        the workers, as it does the DataLoader's persistent workers where the caller shuts
        them first: Lightning does so with every loader that has the attribute when a
        ``fit``, ``validate``, ``test`` or ``predict`` ends
        (``lightning.pytorch.utilities.combined_loader._shutdown_workers_and_reset_iterator``),
        so the Loader's workers and the shared memory no batch holds go then, not when the
        trainer and the module are deleted (see :meth:`Pipeline.park
        <autominato.pipeline.scheduler.Pipeline.park>`). Its fork server stays (one process,
        idle), so that the next ``iter()`` forks new workers as at the first (no new
        interpreter), with the sample figures and knobs the Loader had, and sends them the
        dataset as it is then where it pickles to ``PARK_RESEND_MAX_BYTES`` or less. A pass
        still live gets the batches already made, then raises ``RuntimeError``; a next epoch
        loaded ahead is discarded.

        Raises:
            ValueError: set to anything but ``None``.
        """
        return None

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        if value is not None:
            raise ValueError("Loader._iterator can only be set to None (which shuts the "
                             f"workers down), not {type(value).__name__}")
        del self._iterator

    @_iterator.deleter
    def _iterator(self) -> None:
        with self._lock:
            p = self._pipeline
            if self._closed or p is None:
                return
            log.debug("the loader's iterator was reset: its workers stop")
            p.park(_WORKERS_RESET)

    def close(self) -> None:
        """Stop workers and threads and unlink shared memory. Idempotent.

        A pass live then ends: the batches it can still hand over (a run that had finished
        loading) come first; then ``RuntimeError`` where a map-style epoch had batches that
        will not come (they were dropped), else ``StopIteration``."""
        self._close(wait_copies=True)

    def _close(self, wait_copies: bool) -> None:
        if self._close_done:
            return
        if getattr(self, "_home_pid", None) not in (None, os.getpid()):
            # A forked child's copy (os.fork): its workers, threads and shared memory are the
            # parent's; closing them here ended the parent's workers (review 156). Before the
            # lock: a child forked while a thread of the parent was closing inherits it held,
            # by a thread it does not have (review 164: the child's exit hung).
            self._closed = self._close_done = True
            return
        with self._close_lock:
            self._close_locked(wait_copies)

    def _close_locked(self, wait_copies: bool) -> None:
        # (two threads closing at once, a watchdog's and the loop's: the second waits for the
        # first, review 162)
        if self._close_done:
            return
        if not self._closed:
            self._end_step()
            self._back(time.monotonic())  # (the time after the last epoch ends with the loader)
        # Closed from here on (iterators end), done only at the end: a close that an
        # exception cut short (a second Ctrl-C inside ``with``'s close) is finished by the next
        # call, the exit's (trial 158: it was skipped, and the exit waited for the workers'
        # fork server for ever).
        self._closed = True
        if wait_copies and self._orphan_h2d:
            try:
                self._poll_orphan_h2d(wait=True)
            except Exception as e:  # noqa: BLE001 - a CUDA error: the loop has had it already
                log.warning("host-to-device copies of dropped iterators could not be waited "
                            "for at close (%s): not counted", e)
                self._orphan_h2d.clear()
        if self._controller is not None:
            self._controller.stop()
        if self._telemetry is not None:
            self._telemetry.close()  # its last report sees the workers still running
        p = self._pipeline
        if p is not None:
            p.close()
        self._close_done = True

    def __enter__(self) -> Loader:
        return self

    def _last_batch_out(self, progress: resume.Progress) -> None:
        """A batch (or its error) reached the training loop: where it was the epoch's last
        and the DataLoader's sampler has read its end by then (``Progress.tail_with_last``),
        what it draws there (:meth:`_sampler_end`)."""
        if progress.tail_with_last and progress.all_delivered:
            self._sampler_end(progress)
        if progress.same_order and progress.all_delivered:
            self._same_order_warn(progress)

    def _sampler_end(self, progress: resume.Progress) -> None:
        """What the DataLoader's sampler draws when its pass reaches the sampler's end (and a
        pass the loop leaves before does not): ``shuffle=True``'s RandomSampler's second
        permutation from ``generator``, a user's ``RandomSampler`` read to its end
        (``sampler.read_sampler``'s ``at_end``); once a pass. At the pass's end, or with its
        last batch where that batch is short (``Progress.tail_with_last``)."""
        at_end, progress.at_end = progress.at_end, []
        for finish in at_end:
            finish()
        for _ in range(progress.tail_draws):
            torch.randperm(progress.dataset_len, generator=self.generator)
        progress.tail_draws = 0

    def _pass_ended(self, progress: resume.Progress) -> None:
        """A pass delivered its whole epoch: count the whole passes in a row that a shuffling
        ``DistributedSampler`` began at one epoch, to warn (``_same_order_check``) when a third
        takes it and ``loader.set_epoch`` was never called. DataLoader is silent there, but a
        trainer that sets the epoch only on a DataLoader's sampler (MONAI's engines check
        ``isinstance(loader, DataLoader)``) leaves this one at its epoch: every epoch the same
        permutation. Two passes at one epoch are a loop's training and evaluation passes over
        the training loader, and a loop that calls ``loader.set_epoch`` names its epochs
        (trial 191: both were told to call set_epoch, which they did). Passes that deliver no
        batch (Lightning's check, an ``iter()`` made before ``set_epoch``) are no epochs here.

        First, what the DataLoader's sampler draws when its pass reaches the end
        (:meth:`_sampler_end`), where the last batch did not."""
        self._sampler_end(progress)
        if not (isinstance(self._sampler, DistributedSampler) and self._sampler.shuffle):
            return
        epoch = progress.sampler_epochs.get("sampler")  # as the pass began
        if epoch is None:
            return
        self._same_dist_epoch_passes = (self._same_dist_epoch_passes + 1
                                        if epoch == self._last_whole_dist_epoch else 1)
        self._last_whole_dist_epoch = epoch

    def _same_order_check(self, progress: resume.Progress) -> None:
        """At a pass's first ``next()`` (its sampler's epoch then final): where a shuffling
        ``DistributedSampler`` takes a third pass in a row at the epoch of the two whole
        passes before it (``_pass_ended``) and ``loader.set_epoch`` was never called, mark
        the pass (``progress.same_order``), to warn once it has delivered its last batch
        (``_last_batch_out``; a peek, ``next(iter(loader))``, is not a pass: review 193).
        Not at the third pass's end: ignite (MONAI's engines) ends a pass only at the next
        epoch's first ``next()``, so a warning there came an epoch later (review 192)."""
        sampler = self._sampler
        progress.same_order = not (
            self._same_order_told or self._epoch_set or self._same_dist_epoch_passes < 2
            or not (isinstance(sampler, DistributedSampler) and sampler.shuffle)
            or sampler.epoch != self._last_whole_dist_epoch)

    def _same_order_warn(self, progress: resume.Progress) -> None:
        """The warning ``_same_order_check`` marked ``progress`` for, once a Loader."""
        if not progress.same_order:
            return
        with self._counts_lock:  # (two iterators' last batches at once warn once)
            told, self._same_order_told = self._same_order_told, True
        if told:
            return
        log.warning("the DistributedSampler's epoch was %d for two whole passes in a row and "
                    "a third took it: all took the same permutation; call "
                    "sampler.set_epoch(epoch) (or loader.set_epoch) before each epoch",
                    progress.sampler_epochs.get("sampler"))

    def __reduce__(self) -> tuple:
        """Pickled and copied (``copy``, ``deepcopy``) as the DataLoader is: as its arguments
        (the dataset, sampler, functions must pickle, as there), so that Lightning's
        ``ddp_spawn`` can send it to each rank (a ``config`` file as the configuration this
        Loader read from it, not the file as it is then). The copy keeps the seed this Loader drew, so
        that every copy draws the same orders and augmentation, and starts workers of its own
        when it is built; it begins at this Loader's epoch (the one ``set_epoch`` gave, or the
        one it is in), and carries nothing else of its state (progress in an epoch, tuned
        knobs: ``state_dict()`` carries those).

        Raises:
            TypeError: a subclass with an ``__init__`` of its own (define ``__reduce__``).
        """
        cls = type(self)
        if cls.__init__ is not Loader.__init__:
            raise TypeError(f"{cls.__name__} defines its own __init__: define __reduce__ to "
                            "pickle or copy it")
        return (_copy_of, (cls, self._given, self.seed, self._epoch, self._epoch_set))

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close(wait_copies=False)  # (no CUDA call in a finalizer)
        except Exception:
            pass

    def _poll_orphan_h2d(self, wait: bool = False) -> None:
        """Count the copies of dropped iterators that have ended (with ``wait``: all, waiting)
        and let their pinned host batches go; the others stay."""
        dq = self._orphan_h2d
        for _ in range(len(dq)):
            try:
                item = dq.popleft()
            except IndexError:  # another thread's poll took the rest
                break
            if not self._count_copy(item, wait):
                dq.append(item)

    def _count_copy(self, copy: tuple, wait: bool = False) -> bool:
        """Count one host-to-device copy ``(start event, end event, bytes, host batch)`` in
        ``h2d_bytes_total`` / ``h2d_seconds_total`` (seconds from its CUDA events) if it has
        ended (with ``wait``: once it has); False while it still runs."""
        e0, e1, nbytes, _ = copy
        if wait:
            e1.synchronize()
        if not e1.query():
            return False
        seconds = e0.elapsed_time(e1) / 1000.0
        self._h2d_bytes += nbytes
        self._h2d_seconds += seconds
        self.stage_stats["transfer"].record(seconds, 0.0, nbytes)
        return True

    @property
    def telemetry(self) -> Any:
        """The telemetry handle (exporter ``.url``, ``.report()``), or ``None`` when off."""
        return self._telemetry

    @property
    def controller(self) -> Any:
        """The online controller (``.decisions``), or ``None`` with ``autotune=False``."""
        return self._controller

    # ------------------------------------------------------------------ control surface
    def worker_pids(self) -> list[int]:
        """PIDs of the transform worker processes (empty with thread workers; with Ray, the
        actors on this machine)."""
        p = self._pipeline  # (read once: load_state_dict may drop it meanwhile)
        return p.worker_pids() if p is not None else []

    def report_decision(self, decision: Any) -> None:
        """Record a controller decision and pass it to every hook in ``decision_hooks``."""
        self.decisions.append(decision)
        for hook in list(self.decision_hooks):
            hook(decision)

    def _cold_starts_shown(self, n: int) -> int:
        """``n`` cold starts, or the most a snapshot showed before: a counter never goes back.
        ``_restart_pass`` takes back the cold start of the pass it replaces once the fresh
        pass has begun (one pass, one cold start), and a snapshot in between read one more
        (review 200); Prometheus reads a counter that falls as reset to 0, its rate then
        the whole count. Such a snapshot's extra one stays until the next cold start."""
        with self._counts_lock:
            n = self._cold_shown = max(n, self._cold_shown)
        return n

    def snapshot(self) -> LoaderSnapshot:
        """A frozen copy of every figure the telemetry and the controller read."""
        with self._counts_lock:  # the pipeline, or the counts of the one load_state_dict retired
            p, retired = self._pipeline, dict(self._retired)
        count = {name: n + (getattr(p, name) if p else 0) for name, n in retired.items()}
        stages = {name: st.snapshot() for name, st in self.stage_stats.items()}
        cons = stages["consumer"]
        with self._step_lock:
            now = time.monotonic()
            wait, batches, samples = self._consumer_wait, self._batches, self._samples
            cold_wait = self._cold_wait
            # the step under way counts as far as it went: its batch's wait is in ``wait``
            # already, so a window that ends mid-step would else read idle high
            busy = steps_s = self._consumer_busy
            steps = self._steps
            if self._step_open is not None:
                busy += max(0.0, now - self._step_open[0])
                self._step_seen = now
            if self._wait_since is not None:  # blocked in next() now (the first batch too)
                wait += max(0.0, now - self._wait_since)
                if self._wait_cold:
                    cold_wait += max(0.0, now - self._wait_since)
                self._wait_seen = now
            away = self._away_s
            if self._away_since is not None:
                away += max(0.0, now - self._away_since)
                self._away_seen = now
            empty = tuple(self._empty_recent)
        return LoaderSnapshot(
            time=now,
            stages=stages,
            consumer_wait_seconds_total=wait,
            consumer_wait_recent_s=cons.recent_wait_s[-RECENT:],
            consumer_empty_recent=empty,
            consumer_busy_seconds_total=busy,
            consumer_steps_total=steps,
            consumer_steps_seconds_total=steps_s,
            batches_total=batches,
            samples_total=samples,
            epoch=self.epoch,
            stragglers_total=count["stragglers"],
            skipped_total=count["skipped"] + self._sync_skipped,
            worker_restarts_total=count["worker_restarts"],
            h2d_bytes_total=self._h2d_bytes,
            h2d_seconds_total=self._h2d_seconds,
            knobs=self.knobs.as_dict(),
            sample_bytes=p.sample_bytes if p else 0.0,
            pool_bytes=p.pool_bytes if p else 0,
            nodes=p.nodes() if p else (),
            speculative_discarded_total=count["speculative_discarded"],
            cold_starts_total=self._cold_starts_shown(count["cold_starts"]
                                                      + self._sync_cold_starts),
            cold_start_wait_seconds_total=cold_wait,
            iterable=self._iterable,
            memory_aware=self._cfg.memory_aware,
            warm_heap=self._cfg.warm_heap,
            between_epochs_seconds_total=away,
            samples_held_for_memory_total=count["memory_held"],
            memory_wait_seconds_total=count["memory_wait_s"],
            sample_memory_budget_bytes=p.sample_memory_budget_bytes if p else 0.0,
            worker_heap_keep_bytes=p.worker_heap_keep_bytes if p else 0.0,
            errors_raised_total=self._errors_raised,
            samples_lost_total=self._samples_lost,
            worker_kind=self.worker_kind,
            workers_bound=self.knobs.bounds("workers")[1] if self._controller is not None else 0,
        )


class EpochSampler(torch.utils.data.Sampler):
    """``loader.sampler`` of a Loader given no sampler (the DataLoader's would be a
    ``SequentialSampler`` or ``RandomSampler``): iterates this rank's dataset indices of the
    Loader's current epoch (``loader.epoch``) in the order the Loader uses them, and
    ``set_epoch(e)`` is ``loader.set_epoch(e)``. Lightning calls ``set_epoch`` on
    ``dataloader.sampler`` at the start of every epoch (``_set_sampler_epoch`` in its fit
    loop), so a Loader follows Lightning's epoch, reloaded loaders included (Lightning
    creates the first epoch's iterator of a fit before it calls ``set_epoch``: see
    ``docs/lightning.md``).

    Holds the Loader weakly (a dropped Loader is collected); raises ``ReferenceError`` once it
    is gone.
    """

    def __init__(self, loader: Loader) -> None:
        self._ref = weakref.ref(loader)

    def _loader(self) -> Loader:
        loader = self._ref()
        if loader is None:
            raise ReferenceError("the Loader was garbage-collected")
        return loader

    def __iter__(self) -> Iterator[int]:
        L = self._loader()
        L._set_ranks()
        return iter(epoch_order(L._n, epoch=L.epoch, seed=L.shuffle_seed, shuffle=L.shuffle,
                                rank=L.rank, world_size=L.world_size))

    def __len__(self) -> int:
        L = self._loader()
        L._set_ranks()
        return -(-L._n // L.world_size)

    def set_epoch(self, epoch: int) -> None:
        L = self._loader()
        if not (L._epoch_set and L.epoch == int(epoch)):  # (Loader.set_epoch calls back)
            L.set_epoch(epoch)


class _HeldInterrupt:
    """Ctrl-C held while a Loader starts its threads, fork server and workers: a
    ``KeyboardInterrupt`` raised in the middle (a thread's start, a fork) left what was started
    so far where nothing could reach or close it (trial 176: child processes, threads, file
    descriptors and /dev/shm locks that piled up over interrupted constructions, until the
    interpreter exited). In the main thread, where SIGINT raises ``KeyboardInterrupt`` as
    Python's default handler does, the signal is noted instead; :attr:`hit` says so once
    the block ends, and the caller, with everything assigned where ``close()`` finds it, then
    raises it. A second Ctrl-C is not held: it raises at once, as before (the block runs
    user code too, pickling the dataset for ``persistent_workers=False``, spawned workers or
    Ray, which may take seconds or never return: review 177 saw the first Ctrl-C wait 4 s for
    a slow ``__getstate__``). Elsewhere (another thread, an application's own SIGINT handler)
    nothing changes. Nested blocks: the outermost holds."""

    def __enter__(self) -> _HeldInterrupt:
        self.hit = False
        self._old: Any = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        if self.hit:  # the second: at once
            signal.signal(signal.SIGINT, self._old)
            self._old = None
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc: Any) -> None:
        # (a handler that code in the block installed, a dataset's __getstate__, a library
        # imported there, stays: review 178)
        if self._old is not None and signal.getsignal(signal.SIGINT) == self._note:
            signal.signal(signal.SIGINT, self._old)


class _Observed:
    """What telemetry and the controller see of a Loader: its figures and knobs, through a
    weak reference, so that their threads never keep a dropped Loader (and its workers and
    shared memory) alive.

    Raises:
        ReferenceError: from :meth:`snapshot` once the Loader is gone.
    """

    def __init__(self, loader: Loader) -> None:
        self._ref = weakref.ref(loader)
        self.stage_stats = loader.stage_stats
        self.knobs = loader.knobs
        self.decision_hooks = loader.decision_hooks
        self.config = loader.config

    @property
    def rank(self) -> int:
        """The Loader's rank now (read from ``torch.distributed`` once it is initialised)."""
        return self._loader().rank

    def _loader(self) -> Loader:
        loader = self._ref()
        if loader is None:
            raise ReferenceError("the Loader was garbage-collected")
        return loader

    def snapshot(self) -> LoaderSnapshot:
        return self._loader().snapshot()

    def worker_pids(self) -> list[int]:
        return self._loader().worker_pids()

    def report_decision(self, decision: Any) -> None:
        self._loader().report_decision(decision)


class _EpochIterator:
    """One epoch of batches; the training loop's waits in ``__next__`` are its idle time.

    What is measured per batch (the consumer's figures, seconds of ``time.monotonic()``):

    * **wait**: from the call of ``__next__`` to its return with the batch (the accelerator's
      idle time while the loader is behind).
    * **step**: from the return of the batch to the training loop's next request of this
      loader: ``__next__`` on any of its iterators (the one that ends an epoch with
      ``StopIteration`` too), ``iter(loader)``, the iterator being dropped (a ``break``), or
      ``close()``. So the last step of every epoch counts whole, and time spent outside any
      epoch (a validation loop after ``StopIteration``) is no step. A step and the wait of
      the batch it consumed are recorded together when the step ends.
    """

    def __init__(self, loader: Loader, pipeline: Pipeline, run: Run,
                 progress: resume.Progress) -> None:
        self.L = loader
        # (_count_yielded: the length len(loader) read as the pass began, batches returned)
        self._len_said = loader._iterable_len_said
        self._yielded, self._len_warned = 0, False
        self.pipeline = pipeline
        self.run = run
        self.progress = progress
        self.epoch = run.epoch_no
        self._done = False
        self._pending_h2d: list = []
        self._found = False  # the loop found a batch ready when it asked (the run has filled)
        self._taken = 0  # batches taken
        # Batches after which a cold run has filled, whatever the loop found: its window's.
        # (an iterable dataset's Stream has no min_window; an Epoch's is at least 1)
        self._fill = -(-max(1, loader.knobs.pool_size) // getattr(run.epoch, "min_window", 1))
        self._timed_out = False  # a wait timed out (timeout=) since the last item taken
        # timeout= does not count the workers' start, up to START_GRACE_S an iterator: what
        # is left of it
        self._grace_left = START_GRACE_S

    #: A map-style pass's epoch and whether it resumed a state, until its first ``next()``
    #: (``_restarts``); the pass that replaced it, to which ``next()`` hands on.
    _began: tuple[int, bool, dict] | None = None
    _cold = 0  # 1 when its run started cold (Pipeline.cold_starts)
    _asked = False  # next() was called (an iterator never asked lets the look-ahead go)
    _keep_ahead = False
    _delegate: Any = None

    def __iter__(self) -> _EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self.L)

    def __next__(self) -> Any:
        self._asked = True
        if self._delegate is not None or (self._began is not None and _restarts(self)):
            return next(self._delegate)
        L = self.L
        t0 = L._end_step(time.monotonic())  # (where a snapshot counted the step to)
        # (no batch nor error received yet: a next() after one that raised waits for the
        # pass's samples, not its start, review 200)
        L._back(t0, asking=True, cold=bool(self._cold) and self.run.received == 0)
        try:
            return self._next(t0)
        except BaseException:
            L._unasked()
            # Neither this iterator nor the loader in a frame of the traceback (see _next's
            # errors): a kept error (sys.last_value) would keep the loader and its workers
            del self, L
            raise

    def _next(self, t0: float) -> Any:
        if self._done:
            self.L._left(id(self))
            raise StopIteration
        self._poll_h2d()
        if self.L._orphan_h2d:
            self.L._poll_orphan_h2d()
        run = self.run
        limit = self.L.timeout
        clock = looked = t0  # timeout's start (moved past the workers' start, below)
        item = None
        with run.cv:
            # It waits for this batch, or a wait of its timed out since the last batch: the
            # loader is not ahead of the training loop (Pipeline.consumed). Not while a cold
            # run fills (until the loop first found a batch ready, or took as many batches as
            # the window holds: a loader that starts each epoch cold, prefetch_next_epoch=
            # False, would else give the whole window back at every epoch's start, trial 97):
            # None, which leaves the pipeline's count of batches taken at once alone.
            filled = self._found or run.warm or self._taken >= self._fill
            waited = True if self._timed_out else (not run.out if filled else None)
            empty = not run.out  # (the Data Monitor's queue wait share)
            if run.out and run.out[0][0] == "batch":
                self._found = True
            while not run.out:
                self.pipeline.orphaned(run)  # (a start the closed pipeline never took)
                if run.out:
                    continue  # (its final item: taken below)
                # A failed scheduler may never have seen this run (it died before the run's
                # start reached it): its failure ends the wait too.
                if self.L._closed or run.closed or self.pipeline.fatal() is not None:
                    self._finish()
                    self.L._left(id(self))
                    fatal = self.pipeline.fatal()
                    if fatal is not None:
                        raise RuntimeError("autominato's scheduler failed") from fatal
                    if self.L._closed and self._cut(run):
                        raise RuntimeError(_CLOSED_LIVE.format(self.progress.batches))
                    raise StopIteration
                left = 0.5
                if limit > 0:
                    now = time.monotonic()
                    if self._grace_left > 0:
                        # The workers' start is not the wait timeout bounds (see timeout):
                        # the clock moves on by the time since the last look that came
                        # before a worker was ready (review 109: the wait is not woken when
                        # one gets ready, so "not ready now" alone counted too little). The
                        # wait itself (t0: the consumer's wait, idle time) is left whole
                        # (review 110).
                        ready_at = self.pipeline.workers_ready_at()
                        end = now if ready_at is None else min(now, ready_at)
                        shift = min(max(0.0, end - max(clock, looked)), self._grace_left)
                        clock += shift
                        self._grace_left -= shift
                    looked = now
                    left = limit - (now - clock)
                    if left <= 0:
                        break
                run.cv.wait(min(0.5, left))
            else:
                item = run.out.popleft()
        if item is None:
            self._timed_out = True
            why = None
            if self.L.worker_kind == "ray" and self.pipeline.workers_ready_at() is None:
                # (trial 139: a Loader whose actors no node could place timed out unexplained)
                why = ("[autominato] none of this Loader's Ray actors is ready: each waits for "
                       "a node with its num_cpus free (another Loader's actors may hold them), "
                       "or its start is slow (a warning in the log says how many CPUs are "
                       "free once they have waited 30 s)")
            # Raised with neither this iterator nor its run in a frame: a kept error (a
            # notebook's sys.last_value) would keep the run loading, and its window, slots
            # and batches, when the training loop drops the iterator (review 45).
            del self, run
            # DataLoader's words; the epoch goes on (a later next() may succeed).
            err = RuntimeError(f"Loader timed out after {limit:g} seconds waiting for a batch "
                               f"(timeout={limit:g})")
            if why is not None:
                err.add_note(why)
            raise err
        kind = item[0]
        if kind in ("batch", "raise"):
            run.received += 1
        if kind != "batch":
            err = item[1] if len(item) > 1 else None
            lost = item[2] if len(item) > 2 else None  # an error's: the positions lost with it
            del item  # no frame of this call keeps the error (its traceback holds this frame)
            if kind == "raise":  # a sample's or a batch's error: the epoch goes on, as DataLoader's
                self._timed_out = False
                self.pipeline.consumed(run, waited)
                self.L._lost_to_error(lost or ())
                if lost is not None:  # (none: a batch sampler's [] whose collate failed)
                    self.progress.lose(lost)
                self.L._last_batch_out(self.progress)  # (its last batch raised: review 174)
            else:
                self._finish()
                if kind == "end":
                    self.progress.finished = True
                    self.L._pass_ended(self.progress)
                    self.L._left(id(self))
                    raise StopIteration
            if kind != "raise":  # an error that ends the pass (a "raise" one: it goes on)
                self.L._left(id(self))
            # Nor this iterator or its run: a kept error (a notebook's sys.last_value, a
            # debugger's post-mortem) would keep the run's window, slots and batches.
            del self, run
            try:
                raise err
            finally:
                del err
        self._timed_out = False
        _, batch, indices, h2d, positions = item
        self._taken += 1
        self.pipeline.consumed(run, waited, len(positions))
        self.progress.deliver(positions)
        self.L._last_batch_out(self.progress)
        if h2d is not None:
            from autominato.pipeline.collate import record_stream

            e0, e1, nbytes, host = h2d
            stream = torch.cuda.current_stream(self.L.device)
            stream.wait_event(e1)
            record_stream(batch, stream)
            self._pending_h2d.append(h2d)
        now = time.monotonic()
        wait = now - t0
        L = self.L
        L._delivered(now, wait, len(indices), id(self), empty)
        if L._iterable:
            L._count_yielded(self)
        return batch

    def _cut(self, run: Run) -> bool:
        """Whether ``close()`` cut this map-style pass: batches of its epoch had not reached
        the training loop (its end not decided yet, or items before it not taken), and its
        positions were not all delivered (the end travels behind the last batch: a loop that
        closes the Loader after taking it has its whole epoch). An iterable dataset's pass
        cannot tell a cut from its end (that the shards are exhausted comes after the last
        batch): never."""
        if self.L._iterable:
            return False
        if run.ends_after is not None and run.received >= run.ends_after:
            return False
        return not self.progress.all_delivered

    def _poll_h2d(self, wait: bool = False) -> None:
        """Count the host-to-device copies of delivered batches that have finished (with
        ``wait``, all of them, waiting for the last: the epoch's end, so that its last
        batches are counted too) and let their pinned host buffers go."""
        self._pending_h2d = [c for c in self._pending_h2d if not self.L._count_copy(c, wait)]

    def _finish(self, count_copies: bool = True) -> None:
        """End the pass: the pipeline frees what it holds for it. With ``count_copies``, the
        last batches' host-to-device copies are waited for and counted; without (``__del__``,
        which may run in any thread, inside a CUDA graph capture too, and makes no CUDA
        call) they go to the Loader, which keeps their pinned host batches until they end
        and counts them at the training loop's next ``next()`` or at ``close()``."""
        if not self._done:
            self._done = True
            try:
                if self._pending_h2d and count_copies:
                    self._poll_h2d(wait=True)
            finally:
                if self._pending_h2d:
                    if not self.L._closed:  # (after close() nothing would poll them)
                        self.L._orphan_h2d.extend(self._pending_h2d)  # a failed wait's too
                    self._pending_h2d = []
                if not self._asked and not self._keep_ahead:
                    self.pipeline.drop_ahead(self.run)
                self.pipeline.stop(self.run)

    def stop(self, keep_ahead: bool = False) -> None:
        """Abandon the epoch: what the pipeline holds for it is freed; the next epoch loaded
        ahead of it too when it was never asked for a batch, unless ``keep_ahead``
        (``Loader._restart_pass``: the epoch named may be that one)."""
        self._keep_ahead = keep_ahead
        self._finish()

    def __del__(self) -> None:
        try:
            with self.L._step_lock:  # (one step: a pass begun in between keeps its own)
                self.L._end_step(owner=id(self))  # dropped by a ``break``: its last step ended
                self.L._left(id(self))
            self._finish(count_copies=False)
        except Exception:
            pass


def _restarts(it: Any) -> bool:
    """At ``it``'s first ``next()``: whether ``set_epoch`` has named another epoch since its
    map-style pass began, on the Loader or on a sampler of the user's (Lightning calls
    ``loader.sampler.set_epoch``: a ``DistributedSampler``'s, review 150), then
    ``it._delegate`` is the new epoch's pass (``Loader._restart_pass``)."""
    began, it._began = it._began, None
    restarted = began is not None and _restart(it, began)
    if began is not None:  # (the pass that delivers: the new one where it restarted)
        it.L._same_order_check((it._delegate if restarted else it).progress)
    return restarted


def _restart(it: Any, began: tuple) -> bool:
    """``_restarts``'s decision and restart."""
    L = it.L
    # Only the Loader's latest pass follows (an older one that another pass followed keeps
    # its epoch, and the Loader's state stays the latest's: review 152), and not while a
    # loaded state waits for the next pass (load_state_dict applies at the next iter()).
    if L._closed or L._last_pass != id(it) or L._resume is not None:
        return False
    epoch, resumed, samplers = began
    loader_moved = L._epoch_set and L._epoch != epoch
    sampler_moved = bool(samplers) and resume.sampler_epochs(L) != samplers
    if not (loader_moved or sampler_moved):
        return False
    it._delegate = L._restart_pass(it, epoch, resumed)
    return True


def _run_drained(run: Run, wait_s: float = 2.0) -> bool:
    """Whether ``run`` has no batch left for the training loop (see ``resume.build``: asked
    once ``len(loader)`` batches were delivered). The run's end travels behind its last batch,
    so this waits, up to ``wait_s`` seconds, for the end or another batch to reach ``run.out``;
    ``False`` when neither came (the state then restarts the epoch: nothing is lost), when
    the run ended with an error, or when its consumer left it."""
    deadline = time.monotonic() + wait_s
    with run.cv:
        while True:
            if run.dropped or any(item[0] == "batch" for item in run.out):
                return False
            if run.closed:
                return bool(run.out) and run.out[-1][0] == "end"
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            run.cv.wait(left)


#: A live iterator's error once ``load_state_dict`` replaced the Loader's seeds under it.
_SEED_REPLACED = ("load_state_dict() took the state's seed while an iterator of this Loader was "
                  "live: that iterator's epoch was stopped; start a new pass (iter(loader)) to "
                  "resume from the state")
_CLOSED_LIVE = ("Loader.close() was called while this pass was live: it ended after {} batches of "
                "its epoch, before the last (the batches not taken were dropped); a pass that "
                "has taken its whole epoch ends with StopIteration")
_WORKERS_RESET = ("the Loader's workers were shut down while this pass was live (loader._iterator "
                  "was reset to None, as Lightning does when a fit or validation ends): start a "
                  "new pass (iter(loader))")


class _SyncIterator:
    """One epoch with no worker (``num_workers=0``): each batch is loaded in the training
    loop's thread when it is asked for, as the DataLoader's single-process iterator does.
    The same :class:`~autominato.pipeline.epoch.Epoch` decides batches, skips and the end, so
    ``on_error``, ``drop_last``, a batch sampler and the seeds behave as with workers (samples
    complete in sampler order, so completion order is sampler order)."""

    def __init__(self, loader: Loader, order: list[int], groups: list[int] | None,
                 epoch: int, progress: resume.Progress) -> None:
        self.L = loader
        # (_count_yielded: the length len(loader) read as the pass began, batches returned)
        self._len_said = loader._iterable_len_said
        self._yielded, self._len_warned = 0, False
        self.epoch = epoch
        self.spec = loader._work_spec()
        self.seeds = loader._seeds_taken  # a load_state_dict may replace the seeds
        self.progress = progress
        self.ep = Epoch(order, loader._batch, drop_last=loader.drop_last, in_order=True,
                        skip_errors=loader.on_error == "skip", max_tries=1, groups=groups,
                        done=np.flatnonzero(progress.delivered).tolist(),
                        done_empty=progress.empties)
        self.todo: deque = deque(self.ep.start())
        self._done = False

    _began: tuple[int, bool, dict] | None = None  # (as _EpochIterator's)
    _delegate: Any = None

    def __iter__(self) -> _SyncIterator:
        return self

    def __len__(self) -> int:
        return len(self.L)

    def __next__(self) -> Any:
        if self._delegate is not None or (self._began is not None and _restarts(self)):
            return next(self._delegate)
        L = self.L
        t0 = L._end_step(time.monotonic())  # the step of the batch returned last (as above)
        L._back(t0, asking=True)
        try:
            return self._next(t0)
        except BaseException as e:
            L._unasked()
            if isinstance(e, StopIteration) or self._done:  # the pass ended
                L._left(id(self))
            del self, L, e  # (a kept error must not keep the loader: see _EpochIterator)
            raise

    def _next(self, t0: float) -> Any:
        L = self.L
        if self._done:
            raise StopIteration
        if L._closed:
            self._done = True
            if not L._iterable and not self._drained():
                raise RuntimeError(_CLOSED_LIVE.format(self.progress.batches))
            raise StopIteration
        if self.seeds != L._seeds_taken:
            self.stop()  # (an iterable dataset's stream is closed too)
            raise RuntimeError(_SEED_REPLACED)
        while True:
            while self.todo:
                d = self.todo.popleft()
                if isinstance(d, Emit):
                    try:
                        batch, n = self._batch(d.items), len(d.items)
                    except Exception:
                        # lost with its error, as the DataLoader's batch: not loaded again
                        # after a resume; the epoch goes on
                        self.progress.lose(pos for pos, _, _ in d.items)
                        L._lost_to_error(d.items)
                        L._last_batch_out(self.progress)
                        raise
                    now = time.monotonic()
                    L._delivered(now, now - t0, n, id(self))
                    self.progress.deliver(pos for pos, _, _ in d.items)
                    L._last_batch_out(self.progress)
                    if L._iterable:
                        L._count_yielded(self)
                    return batch
                if isinstance(d, Skip):
                    L._skip(d.index, d.error)
                elif isinstance(d, Raise):
                    self._done = d.final  # a sample's error: the epoch goes on after it
                    self.progress.lose(d.lost)  # not loaded again after a resume
                    L._last_batch_out(self.progress)  # (its last batch raised: review 174)
                    if not d.final:
                        L._lost_to_error(d.lost)
                    raise d.error
                elif isinstance(d, End):
                    self._done = True
                    self.progress.finished = True
                    self.L._pass_ended(self.progress)
                    raise StopIteration
            self._step()

    def _drained(self) -> bool:
        """Every batch of the epoch returned (its end may be decided and not yet seen), or
        every position delivered: a pass that ``close()`` did not cut (see
        ``_EpochIterator._cut``)."""
        return (self.ep.finished and not any(isinstance(d, (Emit, Raise)) for d in self.todo)
                ) or self.progress.all_delivered

    def _step(self) -> None:
        """Load the next sample; its decisions go to ``todo``."""
        L = self.L
        (task,) = self.ep.take(1)
        try:
            sample, read_s, transform_s = run_sample(self.spec, task.index, self.epoch, read=True,
                                                     draw=task.draw)
        except Exception as e:  # noqa: BLE001 - through on_error, as with workers
            report = ErrorReport.capture(e, task.index, sample_path(L.dataset, task.index),
                                         "the training loop's thread (num_workers=0)")
            report.original = e
            self.todo.extend(self.ep.on(Failed(task.pos, task.attempt, report.to_exception())))
            return
        L.stage_stats["read"].record(read_s)
        L.stage_stats["transform"].record(transform_s)
        self.todo.extend(self.ep.on(Completed(task.pos, task.attempt, sample)))

    def _batch(self, items: tuple) -> Any:
        L = self.L
        t = time.perf_counter()
        samples = [sample for _, _, sample in items]
        try:
            batch = (L._cfg.collate_fn(samples) if L._cfg.collate_fn is not None
                     else collate(samples))
            if L._cfg.pin_memory or L._cfg.cuda:
                batch = pin(batch)
        except Exception as e:
            note_batch(e, [index for _, index, _ in items],
                       functools.partial(sample_path, L.dataset))
            raise
        if L._cfg.cuda:
            batch = to_device(batch, L.device)
        L.stage_stats["batch"].record(time.perf_counter() - t, 0.0, batch_nbytes(batch))
        return batch

    def stop(self, keep_ahead: bool = False) -> None:  # (no look-ahead without workers)
        self._done = True

    def __del__(self) -> None:
        try:
            with self.L._step_lock:  # (one step: a pass begun in between keeps its own)
                self.L._end_step(owner=id(self))  # dropped by a ``break``: its last step ended
                self.L._left(id(self))
        except Exception:
            pass


class _SyncStreamIterator(_SyncIterator):
    """One epoch of an iterable dataset with no worker (``num_workers=0``): ``iter(dataset)``
    in the training loop's thread, one sample per step, as the DataLoader's single-process
    iterator (``get_worker_info()`` is ``None`` there, so the dataset does not shard). The
    k-th sample is transformed with ``sample_rng(seed, epoch, (0, k))``; a one-shard
    :class:`~autominato.pipeline.stream.Stream` decides batches, skips and the end."""

    def __init__(self, loader: Loader, epoch: int, progress: resume.Progress) -> None:
        self.L = loader
        # (_count_yielded: the length len(loader) read as the pass began, batches returned)
        self._len_said = loader._iterable_len_said
        self._yielded, self._len_warned = 0, False
        self.epoch = epoch
        self.spec = loader._work_spec()
        self.seeds = loader._seeds_taken
        self.progress = progress
        self.ep = Stream(1, loader._batch, drop_last=loader.drop_last, in_order=True,
                         skip_errors=loader.on_error == "skip", max_pull=1)
        self.streams = Streams(self.spec, process=False, info=False)
        self.todo: deque = deque(self.ep.start())
        self._done = False

    def _step(self) -> None:
        L = self.L
        (pull,) = self.ep.take(1)
        for out in self.streams.pull(0, 0, 1, self.epoch, pull.seq, pull.n,
                                     "the training loop's thread (num_workers=0)"):
            if out[0] == "ok":
                _, _, sample, read_s, transform_s = out
                L.stage_stats["read"].record(read_s)
                L.stage_stats["transform"].record(transform_s)
                self.todo.extend(self.ep.on(Yielded(0, sample)))
            elif out[0] == "err":
                self.todo.extend(self.ep.on(YieldFailed(0, out[2].to_exception())))
            else:  # "done"
                self.todo.extend(self.ep.on(PullDone(0, out[1], out[2])))

    def stop(self, keep_ahead: bool = False) -> None:  # (no look-ahead without workers)
        self._done = True
        self.streams.drop(0)

    def __del__(self) -> None:
        super().__del__()  # its last step ended
        try:
            self.streams.drop(0)
        except Exception:
            pass


def _close_all() -> None:
    """Close the live Loaders (at this process's exit: atexit, multiprocessing's exit hook).
    A forked child's copies of its parent's Loaders close nothing (``Loader._close``: closing
    them there ended the parent's workers and unlinked its shared memory, through the pipes
    the child inherited, and could hang on a lock held when it forked, reviews 154, 156)."""
    for loader in list(_live):  # (a copy from the parent is left alone by _close)
        try:
            loader.close()
        except Exception:
            pass
    from autominato.pipeline.executor import join_at_exit

    join_at_exit()  # no thread worker inside a sample when the interpreter finalizes


import atexit  # noqa: E402

atexit.register(_close_all)

_exit_finalizer: Any = None


def _arm_close_at_exit() -> None:
    """Close the live Loaders in ``multiprocessing``'s exit hook too, before it joins this
    process's children (``util._exit_function``, with a finalizer of exit priority >= 0):
    a process that ``multiprocessing`` started (a ``ddp_spawn`` rank, a ``Process`` target)
    runs that hook when its target returns, before ``atexit``, and joined the Loader's fork
    server, a child that waits for the Loader to close: it never exited (trial 153). Armed
    when a pipeline starts (the registry is cleared when such a process begins)."""
    global _exit_finalizer
    from multiprocessing import util

    if _exit_finalizer is None or not _exit_finalizer.still_active():
        _exit_finalizer = util.Finalize(None, _close_all, exitpriority=100)
