"""The arms of the benchmark: the loaders a user would pick, each set up as its docs suggest.

Every arm runs the same :class:`~autominato.bench.workload.SampleFn` work (read, then
transform with the generator of ``(seed, epoch, index)``), the same collate (torch's
``default_collate``) and a sequential sampler; only the scheduling differs. Each arm's loader is
iterated once per epoch (``--epochs``), as a training loop does: the DataLoader with
``persistent_workers=True`` (else it would start its workers again every epoch), torchdata's
``Loader`` and autominato's as they are, SPDL with one pipeline per epoch (its pipelines are
iterated once). Every arm draws epoch ``e``'s augmentation in its ``e``-th pass: the peers get
``(epoch, index)`` pairs from an :class:`~autominato.bench.workload.EpochIndices` sampler (SPDL
counts its pipelines), autominato uses its own epoch counter; a sample's cost depends on its
random draws, so the arms do the same work in every epoch.

=====================  =====================================================================
arm                    set-up
=====================  =====================================================================
dataloader             ``torch.utils.data.DataLoader``: ``num_workers`` = usable cores,
                       ``pin_memory=True``, ``prefetch_factor=2`` (as users commonly set it),
                       ``persistent_workers=True``
dataloader-unordered   the same with ``in_order=False`` (torch >= 2.6)
dataloader-best        the fastest of a small grid of ``num_workers`` x ``prefetch_factor``
                       x ``in_order``, probed on part of the epoch before the timed runs
torchdata              ``torchdata.nodes``: ``ParallelMapper`` (processes, ``num_workers`` =
                       cores, ``in_order=False``) -> ``Batcher`` -> collate ``Mapper`` ->
                       ``PinMemory`` (with CUDA only) -> ``Prefetcher(2)``
spdl                   ``spdl.pipeline``: read stage (threads, concurrency 2 x cores) ->
                       transform stage (concurrency = cores; threads, SPDL's default, or a
                       process pool) -> ``aggregate`` -> collate -> sink(2); completion order
autominato             ``autominato.Loader`` with defaults (controller on)
autominato-tuned       ``autominato.Loader(config=...)`` with a file ``autominato tune`` wrote
autominato-ray         ``autominato.Loader(worker_kind="ray", workers=1)``, controller on: the
                       transform stage on Ray actors, grown by the controller from one; Ray
                       is ``RAY_ADDRESS``'s cluster or a local instance of the usable cores,
                       started before the timed span (opt-in: not in :data:`DEFAULT_ARMS`)
autominato-drain       ``autominato.Loader(prefetch_next_epoch=False)``: defaults, but every epoch
                       boundary drains and refills (as before issue 14), for the before/after
autominato-in-order    ``autominato.Loader(in_order=True)``, controller on: the DataLoader's batches
                       (sampler order, reproducible), against the ``dataloader`` arm like for
                       like (opt-in: not in :data:`DEFAULT_ARMS`)
autominato-memory-off  ``autominato.Loader(memory_aware=False)``, controller on: no sample held
                       back for memory and each worker's whole freed heap kept warm
                       (docs/memory.md), the trade in one run (opt-in)
autominato-cold-heap   ``autominato.Loader(warm_heap=False)``, controller on: workers give all
                       their free heap back after each sample (docs/memory.md, "The warm
                       heap"), the trade in one run (opt-in)
=====================  =====================================================================

An arm whose library cannot be imported is reported as missing with the import error; it is
never dropped silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from autominato.bench.workload import SampleFn, Workload, sample_rng

#: Arm names in the order the report lists them.
ARM_NAMES = (
    "dataloader",
    "dataloader-unordered",
    "dataloader-best",
    "torchdata",
    "spdl",
    "autominato",
    "autominato-tuned",
    "autominato-ray",
    "autominato-drain",
    "autominato-in-order",
    "autominato-memory-off",
    "autominato-cold-heap",
)

#: The arms run when none are named: ``autominato-ray`` needs Ray (``autominato[ray]``) and
#: starts a Ray instance, so it runs when asked for; ``autominato-in-order`` when asked for
#: (one run more per repeat otherwise).
DEFAULT_ARMS = tuple(a for a in ARM_NAMES
                     if a not in ("autominato-ray", "autominato-in-order", "autominato-memory-off",
                                  "autominato-cold-heap"))

Built = tuple[Iterable[Any], Callable[[], None]]


@dataclass
class Context:
    """What every arm needs besides the workload.

    Attributes:
        cores: usable CPU cores (``autominato.pipeline.knobs.usable_cores``).
        device: ``"cpu"`` or ``"cuda"``; with ``"cuda"`` pinning is on where an arm offers it.
        tuned_config: path of a configuration written by ``autominato tune`` (or ``None``).
        spdl_executor: ``"thread"`` (SPDL's default) or ``"process"`` for its transform stage.
    """

    cores: int
    device: str = "cpu"
    tuned_config: str | None = None
    spdl_executor: str = "thread"


@dataclass
class Arm:
    """One arm: its name, the kind of loader, and its settings (shown in the report)."""

    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # said after the settings (``dataloader-best``: another arm's setting)

    def describe(self) -> str:
        """The settings, as the report lists them under the table (with what the arm sets
        without a parameter: the DataLoader's ``persistent_workers``, see ``_dataloader``),
        then :attr:`note` in brackets."""
        text = " ".join(f"{k}={v}" for k, v in self.params.items())
        if self.kind == "dataloader" and int(self.params.get("num_workers", 0)) > 0:
            text += " persistent_workers=True"
        return f"{text} ({self.note})" if self.note else text


def default_arms(ctx: Context) -> dict[str, Arm]:
    """The arms with their settings for ``ctx`` (``dataloader-best`` is filled by its grid)."""
    c = ctx.cores
    dl = {"num_workers": c, "prefetch_factor": 2, "pin_memory": True}
    return {
        "dataloader": Arm("dataloader", "dataloader", {**dl, "in_order": True}),
        "dataloader-unordered": Arm(
            "dataloader-unordered", "dataloader", {**dl, "in_order": False}
        ),
        "dataloader-best": Arm("dataloader-best", "dataloader", {}),
        "torchdata": Arm(
            "torchdata",
            "torchdata",
            {"num_workers": c, "method": "process", "in_order": False, "prefetch_factor": 2},
        ),
        "spdl": Arm(
            "spdl",
            "spdl",
            {"read_concurrency": 2 * c, "transform_concurrency": c, "executor": ctx.spdl_executor},
        ),
        "autominato": Arm("autominato", "autominato", {"autotune": True}),
        "autominato-tuned": Arm(
            "autominato-tuned",
            "autominato",
            {"config": ctx.tuned_config} if ctx.tuned_config else {},
        ),
        "autominato-ray": Arm(
            "autominato-ray", "autominato", {"autotune": True, "worker_kind": "ray", "workers": 1}
        ),
        "autominato-drain": Arm(
            "autominato-drain", "autominato", {"autotune": True, "prefetch_next_epoch": False}
        ),
        "autominato-in-order": Arm(
            "autominato-in-order", "autominato", {"autotune": True, "in_order": True}
        ),
        "autominato-memory-off": Arm(
            "autominato-memory-off", "autominato", {"autotune": True, "memory_aware": False}
        ),
        "autominato-cold-heap": Arm(
            "autominato-cold-heap", "autominato", {"autotune": True, "warm_heap": False}
        ),
    }


def dataloader_grid(
    cores: int,
    workers: Iterable[int] | None = None,
    prefetch: Iterable[int] = (2, 4),
    in_order: Iterable[bool] = (True, False),
) -> list[dict[str, Any]]:
    """The DataLoader settings ``dataloader-best`` chooses from.

    Defaults: ``num_workers`` in {cores, 2 x cores} (more workers than cores overlaps reads
    with transforms), ``prefetch_factor`` in {2, 4}, ``in_order`` in {True, False}: 8 settings.
    """
    ws = sorted(set(workers)) if workers is not None else sorted({cores, 2 * cores})
    return [
        {"num_workers": w, "prefetch_factor": p, "pin_memory": True, "in_order": o}
        for w in ws
        for p in prefetch
        for o in in_order
    ]


def preload(arm: Arm, *, connect: bool = True) -> None:
    """Import what ``arm`` needs (torch first), so that no import lands in the timed span;
    with ``connect``, also connect the process to Ray for ``worker_kind="ray"`` (the run's
    own process does; the bench's checking that an arm can run does not, or a local Ray
    instance would run beside every other arm's timed span).

    Raises:
        ImportError: (or whatever the import raises) the arm's library is not usable.
    """
    import torch.utils.data  # noqa: F401

    if arm.kind == "torchdata":
        import torchdata.nodes  # noqa: F401
    elif arm.kind == "spdl":
        import spdl.pipeline  # noqa: F401
    elif arm.kind == "autominato":
        from autominato import Loader  # noqa: F401

        if arm.params.get("worker_kind") == "ray":
            from autominato.pipeline import ray_executor

            if connect:
                ray_executor.connect()  # Ray's start-up is the cluster's: before the span
            else:
                ray_executor._ray()  # importable: ImportError names the extra


def unavailable(arm: Arm) -> str | None:
    """Why ``arm`` cannot run here (``"missing: ..."`` / ``"not given: ..."``), else ``None``."""
    try:
        preload(arm, connect=False)
    except Exception as e:  # an import may fail with more than ImportError (ABI, CUDA)
        return f"missing: {type(e).__name__}: {e}"
    if arm.name == "autominato-tuned" and not arm.params.get("config"):
        return "not given: pass --tuned-config FILE (written by `autominato tune`)"
    return None


def build(arm: Arm, workload: Workload, ctx: Context) -> Built:
    """Build ``arm``'s loader over ``workload``.

    Returns:
        ``(iterable of batches, close)``: iterable once per epoch; each batch is
        ``[indices (B,) int64, samples]``.

    Raises:
        ValueError: unknown arm kind.
    """
    builders = {
        "dataloader": _dataloader,
        "torchdata": _torchdata,
        "spdl": _spdl,
        "autominato": _autominato,
    }
    if arm.kind not in builders:
        raise ValueError(f"unknown arm kind {arm.kind!r} (arm {arm.name!r})")
    return builders[arm.kind](arm.params, workload, ctx)


class _Quiet:
    """Iterates ``inner`` with the warnings that the benchmark's settings cause on purpose
    silenced: ``pin_memory=True`` without an accelerator (it does nothing), and the grid's
    more workers than cores."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            return iter(self.inner)


def _dataloader(p: dict[str, Any], wl: Workload, ctx: Context) -> Built:
    from torch.utils.data import DataLoader

    workers = int(p["num_workers"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        dl = DataLoader(
            SampleFn(wl),
            batch_size=wl.batch_size,
            sampler=wl.epoch_sampler(),
            num_workers=workers,
            pin_memory=bool(p.get("pin_memory", True)),
            prefetch_factor=int(p["prefetch_factor"]) if workers > 0 else None,
            persistent_workers=workers > 0,
            in_order=bool(p.get("in_order", True)),
        )

    def close() -> None:
        shutdown = getattr(getattr(dl, "_iterator", None), "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    return _Quiet(dl), close


def _torchdata(p: dict[str, Any], wl: Workload, ctx: Context) -> Built:
    import torchdata.nodes as tn
    from torch.utils.data import default_collate

    node: Any = tn.SamplerWrapper(wl.epoch_sampler())
    mapper = tn.ParallelMapper(
        node,
        map_fn=SampleFn(wl),
        num_workers=int(p["num_workers"]),
        in_order=bool(p["in_order"]),
        method=p["method"],
    )
    node = tn.Batcher(mapper, batch_size=wl.batch_size, drop_last=False)
    node = tn.Mapper(node, default_collate)
    if ctx.device == "cuda":
        node = tn.PinMemory(node)
    node = tn.Prefetcher(node, prefetch_factor=int(p["prefetch_factor"]))
    loader = tn.Loader(node)

    def close() -> None:
        # torchdata has no public close: its map node stops its workers in _shutdown().
        inner = getattr(mapper, "_it", None)
        for obj in (inner, getattr(inner, "source", None)):
            fn = getattr(obj, "_shutdown", None)
            if fn is not None:
                fn()

    return loader, close


class _SpdlRead:
    def __init__(self, wl: Workload) -> None:
        self.dataset = wl.indexed_dataset()

    def __call__(self, index: int) -> Any:
        return self.dataset[index]


class _SpdlTransform:
    def __init__(self, wl: Workload, epoch: int = 0) -> None:
        self.transform = wl.indexed_transform()
        self.seed = wl.seed
        self.epoch = epoch

    def __call__(self, item: tuple[int, Any]) -> Any:
        return self.transform(item, sample_rng(self.seed, self.epoch, item[0]))


class _SpdlEpochs:
    """One SPDL pipeline per epoch (a pipeline is iterated once); the process pool, if any,
    lives across epochs as a loader's workers do."""

    def __init__(self, p: dict[str, Any], wl: Workload) -> None:
        from concurrent.futures import ProcessPoolExecutor

        self.p, self.wl = p, wl
        self.tc = int(p["transform_concurrency"])
        self.executor = (
            ProcessPoolExecutor(max_workers=self.tc) if p["executor"] == "process" else None
        )
        self.pipeline: Any = None
        self.epoch = -1

    def __iter__(self) -> Any:
        from spdl.pipeline import PipelineBuilder
        from torch.utils.data import default_collate

        if self.pipeline is not None:
            self.pipeline.stop()
        rc = int(self.p["read_concurrency"])
        self.epoch += 1
        self.pipeline = (
            PipelineBuilder()
            .add_source(self.wl.epoch_indices(self.epoch))
            .pipe(_SpdlRead(self.wl), concurrency=rc)
            .pipe(_SpdlTransform(self.wl, self.epoch), concurrency=self.tc, executor=self.executor)
            .aggregate(self.wl.batch_size, drop_last=False)
            .pipe(default_collate)
            .add_sink(2)
            .build(num_threads=rc + self.tc)
        )
        self.pipeline.start()
        return iter(self.pipeline.get_iterator())

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def _spdl(p: dict[str, Any], wl: Workload, ctx: Context) -> Built:
    epochs = _SpdlEpochs(p, wl)
    return epochs, epochs.close


def _autominato(p: dict[str, Any], wl: Workload, ctx: Context) -> Built:
    from autominato import Loader

    kwargs: dict[str, Any] = {
        "batch_size": wl.batch_size,
        "shuffle": wl.shuffle,  # Loader(shuffle=True, seed) draws epoch_order's order
        "transform": wl.indexed_transform(),
        "seed": wl.seed,
        "autotune": bool(p.get("autotune", True)),
    }
    if wl.world_size > 1:  # rank 0's share of each epoch, as DistributedSampler's
        kwargs.update(rank=0, world_size=wl.world_size)
    if p.get("config"):
        kwargs["config"] = p["config"]
    # Every other setting of the arm is a Loader argument (a list of names let
    # autominato-memory-off's memory_aware=False drop silently: that arm ran with it on).
    kwargs.update({k: v for k, v in p.items() if k not in ("autotune", "config")})
    if ctx.device == "cuda":
        kwargs["device"] = "cuda"
    loader = Loader(wl.indexed_dataset(), **kwargs)
    return loader, loader.close
