"""Run the arms of the benchmark, interleaved and repeated, each in a fresh process.

For each workload the runner

1. measures the epoch's work serially (:func:`~autominato.bench.workload.measure_serial`),
   calibrates the simulated step if none was given (to the first floor, step 4, measured
   here for it and kept as repeat 0's, when the workload's ``step_basis`` is ``"floor"``;
   see :func:`~autominato.bench.workload.calibrate_step`), and computes the physical limit;
2. picks ``dataloader-best`` by probing a small grid on part of the epoch (not timed);
3. runs every available arm ``repeats`` times, interleaved (repeat ``r`` starts at arm
   ``r mod k``, so no arm always runs first or after the same neighbour), each run in a fresh
   Python process (``python -m autominato.bench.child``) so that no arm inherits another's
   warm pools, threads or heap; ``isolate=False`` runs them in this process (tests);
4. measures the *floor* once per repeat, before that repeat's arms (repeat 0's is the one
   step 1 measured, before the grid of step 2, when the step is calibrated to it): the reads' CPU and the
   transforms of every sample of every epoch in ``cores`` warm processes with nothing else
   running
   (:func:`~autominato.bench.workload.measure_floor`), in the arms' order. Each run's
   ``ratio_to_floor`` is its wall time over ``max(median floor, its consumer's step time)``
   (a simulated step's: the batches times the step it was given).

Every run yields a :class:`RunRecord`; an arm that cannot run yields one record whose status
says why (``missing: ...``, ``not given: ...``, ``error: ...``, ``timeout``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

from autominato.bench.arms import (
    ARM_NAMES,
    DEFAULT_ARMS,
    Arm,
    Context,
    build,
    dataloader_grid,
    default_arms,
    preload,
)
from autominato.bench.arms import unavailable as arm_unavailable
from autominato.bench.measure import ForkedTreeSampler, NvmlSampler, TreeSampler, consume
from autominato.bench.replay import any_loader_bound
from autominato.bench.step import make_step, unet_step
from autominato.bench.workload import (
    Floor,
    SampleFn,
    SerialCost,
    Workload,
    calibrate_step,
    measure_floor,
    measure_serial,
    physical_limit,
)
from autominato.pipeline.spawn import can_fork_now


@dataclass
class RunRecord:
    """The figures of one run of one arm (one CSV row; ``busy`` is kept for plots only).

    Units: seconds, bytes, samples/s; ratios in [0, 1] except ``ratio_to_limit`` (>= 1 for a
    loader that does not beat physics). ``build_s`` is the time to construct the loader and
    call ``iter``; ``first_batch_s`` the time from the span's start until the first batch
    arrived (worker start-up). ``gpu_*`` / ``pcie_*`` are NaN without NVML. ``epochs``:
    passes over the workload in the run; ``next_epoch_wait_s``: mean wait for the first batch
    of every epoch after the first (NaN with one); ``floor_s``: the median measured floor
    (reads' CPU + transforms); ``floor_transform_s``: the median floor of the transforms
    alone; ``ratio_to_floor``: ``wall_s / max(floor_s, steps)`` where ``steps`` is the run's total
    step time: ``step_s`` for the real step, batches x ``step_batch_s`` for a simulated one
    (a sleep that ends late is the loader's cost); ``floor_bound_s``: the wall time no loader can beat with the timed sample
    durations at this step, whatever its order or look-ahead (:func:`~autominato.bench.replay.
    any_loader_bound` of each sample's least time over the floors and the serial measurement);
    ``bound_to_floor``: ``floor_bound_s / max(floor_s, steps)``, the lowest ``ratio_to_floor``
    any loader could reach in this run; ``step_batch_s``: the step per batch the run was given (simulated, or the
    real step's calibration), ``step_origin`` how it was set (``floor #0 / 66 batches``,
    ``serial CPU-s per batch / 2 cores``, ``given``, ...); ``memory_wait_s``: an autominato loader's ``memory_wait_seconds_total`` at the
    end of the run (seconds free workers waited for memory-aware dispatch, summed over
    workers; NaN for other loaders).
    """

    workload: str
    arm: str
    repeat: int
    position: int
    status: str
    detail: str = ""
    samples: int = 0
    unique_samples: int = 0
    batches: int = 0
    wall_s: float = float("nan")
    build_s: float = float("nan")
    first_batch_s: float = float("nan")
    samples_per_s: float = float("nan")
    limit_s: float = float("nan")
    ratio_to_limit: float = float("nan")
    epochs: int = 1
    step_s: float = float("nan")
    step_batch_s: float = float("nan")
    step_origin: str = ""
    floor_s: float = float("nan")
    floor_transform_s: float = float("nan")
    ratio_to_floor: float = float("nan")
    floor_bound_s: float = float("nan")
    bound_to_floor: float = float("nan")
    next_epoch_wait_s: float = float("nan")
    idle_ratio: float = float("nan")
    p99_wait_s: float = float("nan")
    memory_wait_s: float = float("nan")
    cpu_s: float = float("nan")
    peak_memory_bytes: float = float("nan")
    start_memory_bytes: float = float("nan")
    gpu_util_mean: float = float("nan")
    pcie_rx_bytes_per_s: float = float("nan")
    pcie_tx_bytes_per_s: float = float("nan")
    busy: list[tuple[float, float]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "busy"}


#: Columns of ``runs.csv``, in order (pinned by the tests: change them deliberately).
RUN_COLUMNS = tuple(f.name for f in fields(RunRecord) if f.name != "busy")

#: Ratio of the largest to the smallest floor of a run above which the runner says that the
#: machine's speed moved (the same work, measured the same way, once per repeat). Five
#: KiTS19 runs on this project's 2-core VM in one session spread 11%, 13%, 17%, 22% and 30%.
FLOOR_SPREAD = 1.3

#: Ratio of the floor (the median) to the serial CPU over the cores beyond which (either way)
#: the runner says the two disagree (trial 189: 0.58x and 2.3x in loaded runs, unsaid). On a
#: quiet machine the floor's two processes at once cost 1.0-1.3x the serial CPU (KiTS19 on
#: the 2-core VM: the floor 1.13x; the warm heap brings it lower), the reads' waits aside.
FLOOR_LIMIT_APART = 1.5

#: Seconds between two readings of a run's process tree. A reading of a process's PSS walks
#: its page tables (``/proc/PID/smaps_rollup``: 5-11 ms for a KiTS19 loader's processes on
#: the 2-core machine), so the sampler reads it once every ``TreeSampler.PSS_EVERY_S`` per
#: process (and all of them when a process starts or exits) and, in between, adds the growth
#: of the process's private memory (``statm``, microseconds). Measured against autominato's
#: 4-process loader on KiTS19 (three runs of 1.5-3 s each way): reading every rollup at every
#: reading every 0.2 s cost 28-37 ms of CPU a reading, 3.5-3.9 readings a second (each
#: reading's wall time adds to the interval), 9.6-14.7% of a core; every 0.1 s with the
#: rollups every 2 s, 2.3-2.5 ms a reading, 9.4-9.8 readings a second, 1.1-2.3% of a core.
SAMPLER_INTERVAL_S = 0.1


@dataclass
class RunSpec:
    """Everything a (child) process needs for one run; pickled with cloudpickle.

    ``sample_in_process=False`` leaves CPU, memory and NVML sampling to the parent (the
    process-tree sampler's thread would otherwise run inside the measured process).
    """

    workload: Workload
    arm: Arm
    ctx: Context
    step: dict[str, Any]
    sampler_interval: float = SAMPLER_INTERVAL_S
    nvml: bool = False
    sample_in_process: bool = True
    epochs: int = 1


def execute(spec: RunSpec) -> dict[str, Any]:
    """Run one arm over one epoch in this process and return its raw figures.

    The arm's libraries are imported and the step (for the UNet, the model) is built before
    the measured span; the loader is built inside it and closed after it. Without in-process
    sampling, ``cpu_s``, ``peak_memory_bytes``, ``start_memory_bytes`` and the NVML figures
    are NaN here and filled in by the parent from ``span_start`` / ``span_end``.
    """
    preload(spec.arm)
    step = make_step(spec.step)
    inproc = spec.sample_in_process
    samplers: list[Any] = []  # [tree, gpu]: stopped, in that order, whatever happens
    try:
        if inproc:
            # A sampler thread here would make autominato's loader start its workers from a
            # new interpreter; a forked sampler leaves this process one thread, as a script.
            kind = ForkedTreeSampler if can_fork_now() else TreeSampler
            samplers.append(kind(spec.sampler_interval).start())
            if spec.nvml:
                samplers.append(NvmlSampler().start())
        built: list[Any] = []

        def _build() -> Any:
            b = build(spec.arm, spec.workload, spec.ctx)
            built.append(b[0])
            return b

        c, close = consume(_build, step, spec.epochs)
    except BaseException:
        _stop_all(samplers, quiet=True)  # the run's exception is the one to see
        raise
    try:
        usage, g = (_stop_all(samplers) + [None, None])[:2]
    except BaseException:
        close()
        raise
    nan = float("nan")
    snapshot = getattr(built[0], "snapshot", None) if built else None
    memory_wait = (getattr(snapshot(), "memory_wait_seconds_total", nan)
                   if callable(snapshot) else nan)
    if not inproc:
        # Let the parent's sampler see the tree once after the span, before workers leave
        # (a worker started late in the span is listed up to TREE_EVERY_S after it began).
        time.sleep(max(3 * spec.sampler_interval,
                       TreeSampler.TREE_EVERY_S + 2 * spec.sampler_interval))
    close()
    return {
        "indices": c.indices,
        "epoch_ends": c.epoch_ends,
        "next_epoch_wait_s": c.next_epoch_wait_s,
        "step_s": c.busy_s,
        "batches": len(c.waits_s),
        "wall_s": c.wall_s,
        "build_s": c.build_s,
        "first_batch_s": c.busy[0][0] if c.busy else nan,
        "idle_ratio": c.idle_ratio,
        "p99_wait_s": c.p99_wait_s,
        "memory_wait_s": memory_wait,
        "span_start": c.span_start,
        "span_end": c.span_end,
        "cpu_s": usage.cpu_s if usage else nan,
        "peak_memory_bytes": usage.peak_memory_bytes if usage else nan,
        "start_memory_bytes": usage.start_memory_bytes if usage else nan,
        "busy": c.busy,
        "gpu_util_mean": g.util_mean if g else nan,
        "pcie_rx_bytes_per_s": g.pcie_rx_bytes_per_s if g else nan,
        "pcie_tx_bytes_per_s": g.pcie_tx_bytes_per_s if g else nan,
    }


def _stop_all(samplers: list[Any], quiet: bool = False) -> list[Any]:
    """Stop every sampler (each even when one before it raised) and return their figures;
    then raise the first error, unless ``quiet``."""
    out, first = [], None
    for s in samplers:
        try:
            out.append(s.stop())
        except Exception as e:  # noqa: BLE001 -- the others must still stop
            out.append(None)
            first = first or e
    if first is not None and not quiet:
        raise first
    return out


class RunFailed(RuntimeError):
    """A run did not finish: ``status`` is ``error: ...`` or ``timeout``."""

    def __init__(self, status: str, detail: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.detail = detail


def error_status(e: BaseException) -> str:
    """``error: Type: message`` in one line of at most 200 characters.

    Loaders that re-raise a worker's exception put the original traceback in the message
    (the DataLoader's "Caught ... in DataLoader worker process 0"); its last line is the
    original error, which names the sample, so that line is kept.
    """
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[-1] if lines else ""
    return f"error: {type(e).__name__}: {msg}"[:200]


def run_once(spec: RunSpec, *, isolate: bool = True, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (``isolate``) or in this one; return its raw figures.

    In a fresh process the child times the span and this process samples the child's tree
    (and NVML), then cuts the child's span out of the samples: no sampling thread runs in
    the measured process.

    Raises:
        RunFailed: the run raised, crashed or exceeded ``timeout_s`` (its whole process group
            is then killed: the child and the loader workers it started).
    """
    if not isolate:
        try:
            return execute(spec)
        except Exception as e:
            raise RunFailed(error_status(e), traceback.format_exc()) from e
    spec = replace(spec, sample_in_process=False)
    with tempfile.TemporaryDirectory(prefix="autominato-bench-run-") as d:
        spec_path, out_path = Path(d, "spec.pkl"), Path(d, "result.json")
        spec_path.write_bytes(cloudpickle.dumps(spec))
        cmd = [sys.executable, "-m", "autominato.bench.child", str(spec_path), str(out_path)]
        # A new session makes the child the leader of a process group that holds its
        # workers too, so a hung run can be killed whole and no orphan outlives it.
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            sampler = TreeSampler(spec.sampler_interval, pid=proc.pid).start()
            gpu = NvmlSampler().start() if spec.nvml else None
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        exited = _wait_unreaped(proc.pid, timeout_s)
        sampler.stop()
        if gpu is not None:
            gpu.stop()
        # The exited child stays a zombie until reaped, so its pid (the group's id) cannot
        # be reused by an unrelated process before the group is killed.
        _kill_group(proc.pid)
        rc = proc.wait()
        if not exited:
            raise RunFailed("timeout", f"no result after {timeout_s:.0f} s")
        if not out_path.exists():
            raise RunFailed(f"error: child exited with status {rc} and no result")
        result = json.loads(out_path.read_text())
    if "error" in result:
        raise RunFailed(result["error"], result.get("traceback", ""))
    span = (result["span_start"], result["span_end"])
    u = sampler.usage_between(*span)
    result.update(cpu_s=u.cpu_s, peak_memory_bytes=u.peak_memory_bytes,
                  start_memory_bytes=u.start_memory_bytes)
    if gpu is not None:
        g = gpu.usage_between(*span)
        result.update(
            gpu_util_mean=g.util_mean,
            pcie_rx_bytes_per_s=g.pcie_rx_bytes_per_s,
            pcie_tx_bytes_per_s=g.pcie_tx_bytes_per_s,
        )
    return result


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until child ``pid`` exits, without reaping it; False if ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        time.sleep(0.05)
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Options:
    """How to run the benchmark.

    Attributes:
        arms: arm names to run, in report order (a subset of :data:`ARM_NAMES`).
        repeats: timed runs per arm (the issue asks >= 3; tests use 1).
        isolate: each run in a fresh process.
        ctx: cores, device, tuned configuration, SPDL executor.
        grid: DataLoader settings ``dataloader-best`` chooses from (``None``: the default grid).
        grid_fraction: part of the epoch each grid probe runs (at least 4 batches).
        serial_samples: measure the limit's serial cost on this many samples only and
            extrapolate (``None``: all; the report says when the limit is an estimate).
        step: ``"sleep"`` (simulated accelerator) or ``"unet"`` (real step, CUDA only).
        unet_model: ``"mlperf"`` or ``"compact"`` for the real step.
        sampler_interval: seconds between process-tree samples (see
            :data:`SAMPLER_INTERVAL_S`).
        nvml: sample GPU utilisation and PCIe throughput.
        epochs: passes over the workload per run (a training loop's epochs, back to back).
        floor: measure the floor once per repeat (see the module's steps 1 and 4).
        timeout_s: per-run timeout; ``None``: 10 x the limit + 120 s.
        log: progress messages.
    """

    arms: Sequence[str] = DEFAULT_ARMS
    repeats: int = 3
    isolate: bool = True
    ctx: Context = field(default_factory=lambda: Context(cores=1))
    grid: list[dict[str, Any]] | None = None
    grid_fraction: float = 0.5
    serial_samples: int | None = None
    step: str = "sleep"
    unet_model: str = "mlperf"
    sampler_interval: float = SAMPLER_INTERVAL_S
    nvml: bool = False
    epochs: int = 1
    floor: bool = True
    timeout_s: float | None = None
    log: Callable[[str], None] = print


@dataclass
class WorkloadResult:
    """All runs of one workload, with what the limit was computed from."""

    workload: Workload
    serial: SerialCost
    step_s: float
    limit_s: float
    records: list[RunRecord]
    best_grid: dict[str, Any] | None = None
    floor_s: list[float] = field(default_factory=list)
    floor_transform_s: list[float] = field(default_factory=list)
    step_origin: str = ""


def _least(floors: Sequence[tuple], serial: SerialCost) -> tuple:
    """Each sample's least duration over ``floors`` (each a :attr:`Floor.epochs_s`: per-epoch
    tuples of seconds) and the serial measurement (flat, in the same order; left out when it
    is a subset, ``--serial-samples``), shaped as ``floors[0]``. A sample's time moved up to
    20x between measurements on the 2-core VM (a floor's first samples pay its processes'
    first page faults; two at once contend; a loader that runs a long one alone runs it
    faster), and the bound, built on the longest and the heaviest, would carry every such
    high reading (trial 82: the 8-case runs beat a bound built on one floor's times)."""
    flat = [[d for e in f for d in e] for f in floors]
    if not serial.estimated:
        flat.append([float(w) for w in serial.wall_s])
    least = np.min([f for f in flat if len(f) == len(flat[0])], axis=0)
    out, j = [], 0
    for e in floors[0]:
        out.append(tuple(float(x) for x in least[j:j + len(e)]))
        j += len(e)
    return tuple(out)


def _floor(opts: Options, wl: Workload, serial: SerialCost, rep: int) -> Floor | None:
    """Repeat ``rep``'s floor (:func:`measure_floor`), or None, logged, where it failed (a
    process killed, the time limit: ``opts.timeout_s``, else 10 x the serial measurement's
    total over the cores + 120 s, its CPU or, where more, its wall time: a floor process
    waits out each read; the workload raising): the arms still run, ratios to the floor
    then come from the other repeats' floors, or are left out."""
    timeout_s = (opts.timeout_s if opts.timeout_s is not None
                 else 10 * max(serial.cpu_total_s, serial.wall_total_s) / opts.ctx.cores + 120)
    try:
        return measure_floor(wl, opts.ctx.cores, opts.epochs, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 -- as an arm's failure: logged, the bench goes on
        opts.log(f"[{wl.name}] floor #{rep}: not measured: {type(e).__name__}: {e}")
        return None


def _log_floor(opts: Options, wl: Workload, rep: int, f: Floor, why: str = "") -> None:
    opts.log(f"[{wl.name}] floor #{rep}: {f.s:.2f} s ({opts.ctx.cores} processes, reads' CPU + "
             f"transforms; the transforms alone {f.transform_s:.2f} s){why}")


def _step_spec(wl: Workload, opts: Options, serial: SerialCost,
               floor: Floor | None = None) -> tuple[dict[str, Any], float, str]:
    """The step the runs take (:func:`~autominato.bench.step.make_step`'s spec), its seconds
    per batch, and how it was set, in words (the log, the table's title, ``step_origin``)."""
    if opts.step == "unet":
        import torch

        from autominato.models.step import image_label

        image, _ = image_label(SampleFn(wl)(0)[1])
        shape = (wl.batch_size, *image.shape)
        step = unet_step(opts.unet_model)
        step_s = step.calibrate(shape)
        del step
        torch.cuda.empty_cache()  # the runs build their own model in their own process
        spec = {"kind": "unet", "model": opts.unet_model, "image_shape": shape}
        return spec, step_s, "the real step, timed"
    if wl.step_s is not None:
        return {"kind": "sleep", "step_s": wl.step_s}, wl.step_s, "given"
    step_s = calibrate_step(wl, serial, opts.ctx.cores, floor, opts.epochs)
    factor = f" x {wl.step_factor:g}" if wl.step_factor != 1 else ""
    if wl.step_basis == "floor" and floor is not None:
        origin = f"floor #0 / {opts.epochs * wl.n_batches} batches{factor}"
    else:
        per = "wall s" if wl.step_basis == "wall" else "CPU-s"
        origin = f"serial {per} per batch / {opts.ctx.cores} cores{factor}"
    return {"kind": "sleep", "step_s": step_s}, step_s, origin


def _record(
    wl: Workload, arm: Arm, repeat: int, position: int, limit_s: float, r: dict[str, Any]
) -> RunRecord:
    n = len(wl)
    idx = r["indices"]
    ends = r.get("epoch_ends") or [len(idx)]
    samples, unique = len(idx), len(set(idx))
    status = "ok"
    for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        got = idx[a:b]
        if len(got) != n or len(set(got)) != n:
            status = (f"wrong: epoch {e} delivered {len(got)} samples ({len(set(got))} "
                      f"distinct) of {n}")
            break
        if wl.world_size > 1 and sorted(got) != sorted(wl.epoch_indices(e)):
            status = f"wrong: epoch {e} delivered other samples than rank 0's share"
            break
    if len(ends) * n != samples:
        status = f"wrong: delivered {samples} samples in {len(ends)} epochs of {n}"
    wall = float(r["wall_s"])
    return RunRecord(
        workload=wl.name,
        arm=arm.name,
        repeat=repeat,
        position=position,
        status=status,
        detail=arm.describe(),
        samples=samples,
        unique_samples=unique,
        batches=int(r["batches"]),
        wall_s=wall,
        build_s=float(r["build_s"]),
        first_batch_s=float(r["first_batch_s"]),
        samples_per_s=samples / wall if wall > 0 else float("nan"),
        limit_s=limit_s,
        ratio_to_limit=wall / limit_s if limit_s > 0 else float("nan"),
        epochs=len(ends),
        step_s=float(r.get("step_s", float("nan"))),
        next_epoch_wait_s=float(r.get("next_epoch_wait_s", float("nan"))),
        idle_ratio=float(r["idle_ratio"]),
        p99_wait_s=float(r["p99_wait_s"]),
        memory_wait_s=float(r.get("memory_wait_s", float("nan"))),
        cpu_s=float(r["cpu_s"]),
        peak_memory_bytes=float(r["peak_memory_bytes"]),
        start_memory_bytes=float(r["start_memory_bytes"]),
        gpu_util_mean=float(r["gpu_util_mean"]),
        pcie_rx_bytes_per_s=float(r["pcie_rx_bytes_per_s"]),
        pcie_tx_bytes_per_s=float(r["pcie_tx_bytes_per_s"]),
        busy=[(float(a), float(b)) for a, b in r["busy"]],
    )


def choose_dataloader(
    wl: Workload, opts: Options, step: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any] | None, str]:
    """Probe the DataLoader grid on the first part of the epoch; return the fastest setting.

    Returns:
        ``(settings, note)``; settings is ``None`` when every probe failed (note says why).
    """
    grid = opts.grid if opts.grid is not None else dataloader_grid(opts.ctx.cores)
    n = min(len(wl), max(4 * wl.batch_size, int(len(wl) * opts.grid_fraction)))
    probe_wl = wl.subset(n)
    best: tuple[float, dict[str, Any]] | None = None
    last_error = "empty grid"
    for cfg in grid:
        spec = RunSpec(
            probe_wl,
            Arm("dataloader-probe", "dataloader", cfg),
            opts.ctx,
            step,
            opts.sampler_interval,
        )
        try:
            r = run_once(spec, isolate=opts.isolate, timeout_s=timeout_s)
        except RunFailed as e:
            last_error = e.status
            opts.log(f"  grid {Arm('', 'dataloader', cfg).describe()}: {e.status}")
            continue
        opts.log(f"  grid {Arm('', 'dataloader', cfg).describe()}: {r['wall_s']:.2f} s on {n} samples")
        if best is None or r["wall_s"] < best[0]:
            best = (r["wall_s"], cfg)
    if best is None:
        return None, last_error
    return best[1], f"fastest of {len(grid)} on {n} samples"


def run_order(arms: Sequence[Arm], repeat: int) -> list[Arm]:
    """The order of ``arms`` in repeat ``repeat``: rotated by ``repeat`` places.

    Over ``len(arms)`` repeats every arm runs once in every position, so a slow first run
    (cold page cache, CPU frequency ramp) or a noisy neighbour is not always charged to the
    same arm.
    """
    k = len(arms)
    return list(arms[repeat % k :]) + list(arms[: repeat % k]) if k else []


def run_workload(wl: Workload, opts: Options) -> WorkloadResult:
    """Measure the limit, pick ``dataloader-best``, then run the arms interleaved."""
    unknown = [a for a in opts.arms if a not in ARM_NAMES]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; arms are {', '.join(ARM_NAMES)}")
    cores = opts.ctx.cores
    opts.log(f"[{wl.name}] {wl.description}; measuring the work serially ...")
    E = opts.epochs
    serial = measure_serial(wl, samples=opts.serial_samples, epochs=E)
    first_floor: Floor | None = None
    first_tried = False  # (a first floor that failed is not measured again for repeat 0)
    if opts.step == "sleep" and wl.step_s is None and wl.step_basis == "floor":
        if opts.floor:
            # the step is calibrated to it; it is also repeat 0's floor
            first_floor, first_tried = _floor(opts, wl, serial, 0), True
            if first_floor is not None:
                _log_floor(opts, wl, 0, first_floor, " (the step is calibrated to it)")
            else:
                opts.log(f"[{wl.name}] the step is calibrated to the serial CPU instead")
        else:
            opts.log(f"[{wl.name}] --no-floor: the step is calibrated to the serial CPU "
                     "instead of the floor")
    step, step_s, origin = _step_spec(wl, opts, serial, first_floor)
    limit = physical_limit(serial, E * wl.n_batches, step_s, cores)
    est = f" (estimated from {len(serial.cpu_s)} samples)" if serial.estimated else ""
    per = f"{E} epochs x {wl.n_batches} steps" if E > 1 else f"{wl.n_batches} steps"
    opts.log(
        f"[{wl.name}] serial CPU {serial.cpu_total_s:.2f} s{est}"
        + (f" for the {E} epochs" if E > 1 else "")
        + f" / {cores} cores; {per} x {step_s * 1e3:.1f} ms ({origin}) -> limit {limit:.2f} s"
    )
    timeout_s = opts.timeout_s if opts.timeout_s is not None else 10 * limit + 120
    arms = default_arms(opts.ctx)
    records: list[RunRecord] = []
    runnable: list[Arm] = []
    for name in opts.arms:
        arm = arms[name]
        why = arm_unavailable(arm)
        if why is None and name == "dataloader-best":
            cfg, note = choose_dataloader(wl, opts, step, timeout_s)
            if cfg is None:
                why = f"error: every grid setting failed ({note})"
            else:
                arm.params = dict(cfg)
                # (trial 184: two arms of one setting; the goals' best peer is then the
                # faster of two runs of it)
                same = [o for o in opts.arms if o != name and arms[o].kind == "dataloader"
                        and arms[o].describe() == arm.describe()]
                if same:
                    arm.note = f"the grid's pick is {same[0]}'s setting: one setting, run twice"
        if why is not None:
            opts.log(f"[{wl.name}] {name}: {why}")
            records.append(RunRecord(wl.name, name, 0, 0, why, arm.describe(), limit_s=limit,
                                     epochs=E))
        else:
            runnable.append(arm)
    floors: list[float] = []
    transform_floors: list[float] = []
    timings: list[tuple] = []  # each floor's per-sample durations (Floor.epochs_s)
    for rep in range(opts.repeats):
        if opts.floor and runnable:
            if rep == 0 and first_tried:
                f = first_floor  # logged when it was measured (or failed)
            else:
                f = _floor(opts, wl, serial, rep)
                if f is not None:
                    _log_floor(opts, wl, rep, f)
            if f is not None:
                floors.append(f.s)
                transform_floors.append(f.transform_s)
                if f.epochs_s:
                    timings.append(f.epochs_s)
        for pos, arm in enumerate(run_order(runnable, rep)):
            spec = RunSpec(wl, arm, opts.ctx, step, opts.sampler_interval, opts.nvml,
                           epochs=E)
            try:
                r = run_once(spec, isolate=opts.isolate, timeout_s=timeout_s)
            except RunFailed as e:
                opts.log(f"[{wl.name}] {arm.name} #{rep}: {e.status}")
                if e.detail:
                    opts.log(e.detail.rstrip())
                records.append(  # (trial 189: a failed run's row said 1 epoch)
                    RunRecord(wl.name, arm.name, rep, pos, e.status, arm.describe(),
                              limit_s=limit, epochs=E)
                )
                continue
            rec = _record(wl, arm, rep, pos, limit, r)
            records.append(rec)
            opts.log(
                f"[{wl.name}] {arm.name} #{rep}: {rec.wall_s:.2f} s "
                f"(x{rec.ratio_to_limit:.2f} limit), idle {rec.idle_ratio:.1%}"
                + (f", workers waited {rec.memory_wait_s:.2f} s for memory"
                   if rec.memory_wait_s > 0 else "")
                + ("" if rec.ok else f" -- {rec.status}")
            )
    below = [r for r in records if r.ok and r.ratio_to_limit < 1.0]
    if below:
        opts.log(
            f"[{wl.name}] {', '.join(sorted({r.arm for r in below}))}: below the limit "
            f"({min(r.ratio_to_limit for r in below):.2f}x): the limit was measured high (the "
            "serial CPU measurement, or the real step's timing, in a slower spell), so the x "
            "limit column is not to be trusted; x floor is measured beside the arms"
        )
    if floors:
        floor = float(np.median(floors))
        cpu_share = serial.cpu_total_s / cores
        if cpu_share > 0 and not 1 / FLOOR_LIMIT_APART <= floor / cpu_share <= FLOOR_LIMIT_APART:
            opts.log(
                f"[{wl.name}] the floor ({floor:.2f} s) is {floor / cpu_share:.2f}x the serial "
                f"CPU over the cores ({cpu_share:.2f} s), the same work measured in parallel "
                "and serially: one ran slower (other jobs, or the first reads of the files in a "
                "while, which cost the kernel more: measure on a quieter machine), or the "
                "transforms wait (the floor counts their wall time, the serial measurement "
                "their CPU), so x floor and x limit disagree"
            )
        if len(floors) > 1 and max(floors) > FLOOR_SPREAD * min(floors):
            opts.log(
                f"[{wl.name}] the floors measured ranged {min(floors):.2f}-{max(floors):.2f} s "
                f"(more than {FLOOR_SPREAD - 1:.0%} apart): the machine's speed moved during "
                "this run, and with it every ratio; measure on a quieter machine"
            )
        timed = _least(timings, serial) if timings else ()
        nb = E * wl.n_batches
        simulated = step.get("kind") == "sleep"
        bound = (any_loader_bound(timed, cores, wl.batch_size, step_s) if timed
                 else float("nan"))
        if timed:
            opts.log(f"[{wl.name}] with the sample durations timed (each the least of the "
                     "floors'" + ("" if serial.estimated else " and the serial measurement's")
                     + f"), no loader could beat {bound:.2f} s at this step ("
                     f"{bound / max(floor, nb * step_s):.2f}x the floor or the "
                     "steps): an epoch's last batch waits for every sample of it and of the "
                     "epochs before it")
        for rec in records:
            rec.floor_s = floor
            rec.floor_transform_s = float(np.median(transform_floors))
            rec.floor_bound_s = bound
            if rec.ok:
                # A simulated step's time is the one it was given: a sleep that ends late
                # (the loader's threads holding the GIL in the training process: 2-4% more
                # over 24 steps of 19 ms, trial 91) is the loader's cost, not more steps.
                steps = nb * step_s if simulated else rec.step_s
                if timed and steps < nb * step_s:  # (a real step beat its calibration)
                    rec.floor_bound_s = any_loader_bound(timed, cores, wl.batch_size,
                                                         steps / nb)
                rec.ratio_to_floor = rec.wall_s / max(floor, steps)
                rec.bound_to_floor = rec.floor_bound_s / max(floor, steps)
                if rec.ratio_to_floor >= 1.0 and rec.wall_s < rec.floor_bound_s:
                    opts.log(
                        f"[{wl.name}] {rec.arm} #{rec.repeat}: {rec.wall_s:.2f} s, below the "
                        f"{rec.floor_bound_s:.2f} s that the timed sample durations allow: "
                        "this run's "
                        "samples ran faster than every timing of them (other jobs, two at "
                        "once, first page faults: one sample's time moved 20x here), so the "
                        "bound is not to be trusted in this run")
                if rec.ratio_to_floor < 1.0:
                    opts.log(
                        f"[{wl.name}] {rec.arm} #{rec.repeat}: {rec.ratio_to_floor:.2f}x the "
                        "floor, below it: the machine was slower while the floor was measured "
                        "(other jobs), so this run's ratios are not to be trusted"
                    )
    for rec in records:
        rec.step_batch_s, rec.step_origin = step_s, origin
    return WorkloadResult(wl, serial, step_s, limit, records, floor_s=floors,
                          floor_transform_s=transform_floors, step_origin=origin)
