"""NVML figures of the machine's NVIDIA GPUs, labelled like NVIDIA's DCGM exporter.

Uses nvidia-ml-py (``import pynvml``; the ``pynvml`` distribution on PyPI is deprecated).
Without the package, the driver or a GPU, :func:`nvml_collector` returns None after one debug
log line and no ``autominato_gpu_*`` family is exported; nothing fails and nothing warns.

Per GPU (label ``gpu`` = NVML index, ``UUID`` = the GPU's UUID, as DCGM exporter spells them):

* ``autominato_gpu_utilization_ratio``: ``nvmlDeviceGetUtilizationRates().gpu / 100``, the
  share of the driver's last sample period (1/6 s to 1 s) in which a kernel ran.
* ``autominato_gpu_memory_used_bytes``: ``nvmlDeviceGetMemoryInfo().used``.
* ``autominato_gpu_pcie_{tx,rx}_bytes_per_second``: ``nvmlDeviceGetPcieThroughput``, which
  counts bytes over a 20 ms window and returns KB/s; converted with 1 KB = 1024 bytes (NVML's
  convention for its other KB figures). Each call blocks about 20 ms, so a scrape of n GPUs
  costs about 40 ms x n, on the scraping thread, never on the data path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from autominato.telemetry.metrics import NVML_METRICS, REGISTRY

log = logging.getLogger(__name__)

#: NVML reports PCIe throughput in KB/s.
KIB = 1024


class NvmlCollector(Collector):
    """Collects :data:`~autominato.telemetry.metrics.NVML_METRICS` for every visible GPU.

    Args:
        nvml: the ``pynvml`` module, already initialised (``nvmlInit()`` succeeded).

    A figure a GPU does not support (``NVMLError_NotSupported``, e.g. PCIe counters under
    MIG or vGPU) is left out for that GPU; other errors at scrape time are logged at debug
    level and the figure is left out, so a flaky driver never breaks the scrape.
    """

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self.devices: list[tuple[str, str, Any]] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if isinstance(uuid, bytes):  # older nvidia-ml-py returns bytes
                uuid = uuid.decode()
            self.devices.append((str(i), str(uuid), handle))

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily(n, doc, labels=["gpu", "UUID"])
            for n, (doc, _) in NVML_METRICS.items()
        ]

    def _read(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as e:
            log.debug("NVML %s%s failed: %s", getattr(fn, "__name__", fn), args[1:], e)
            return None

    def collect(self) -> Iterator[Metric]:
        nv = self._nvml
        fams = {
            n: GaugeMetricFamily(n, doc, labels=["gpu", "UUID"])
            for n, (doc, _) in NVML_METRICS.items()
        }
        with self._lock:  # NVML calls are not documented as thread-safe per handle
            for index, uuid, h in self.devices:
                labels = [index, uuid]
                util = self._read(nv.nvmlDeviceGetUtilizationRates, h)
                if util is not None:
                    fams["autominato_gpu_utilization_ratio"].add_metric(labels, util.gpu / 100.0)
                mem = self._read(nv.nvmlDeviceGetMemoryInfo, h)
                if mem is not None:
                    fams["autominato_gpu_memory_used_bytes"].add_metric(labels, float(mem.used))
                for name, counter in (
                    ("autominato_gpu_pcie_tx_bytes_per_second", nv.NVML_PCIE_UTIL_TX_BYTES),
                    ("autominato_gpu_pcie_rx_bytes_per_second", nv.NVML_PCIE_UTIL_RX_BYTES),
                ):
                    kbs = self._read(nv.nvmlDeviceGetPcieThroughput, h, counter)
                    if kbs is not None:
                        fams[name].add_metric(labels, float(kbs) * KIB)
        for fam in fams.values():
            if fam.samples:
                yield fam


_lock = threading.Lock()
_state: dict[str, Any] = {}


def nvml_collector() -> NvmlCollector | None:
    """The process's NVML collector, registered in the telemetry registry on first call.

    Returns None, silently (one debug log line), when nvidia-ml-py is not installed, the
    NVIDIA driver library is absent, NVML fails to initialise, or it sees no GPU. The outcome
    is cached for the life of the process.
    """
    with _lock:
        if "collector" in _state:
            return _state["collector"]
        _state["collector"] = None
        try:
            import pynvml
        except ImportError:
            log.debug("nvidia-ml-py is not installed: no NVML metrics")
            return None
        try:
            pynvml.nvmlInit()
            collector = NvmlCollector(pynvml)
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... : no GPU here
            log.debug("NVML unavailable (%s): no GPU metrics", e)
            return None
        if not collector.devices:
            log.debug("NVML sees no GPU: no GPU metrics")
            return None
        REGISTRY.register(collector)
        _state["collector"] = collector
        return collector


def _reset_for_tests() -> None:
    """Forget the cached outcome (and unregister the collector) so a test can probe again."""
    with _lock:
        collector = _state.pop("collector", None)
        if collector is not None:
            REGISTRY.unregister(collector)
