"""The transform stage on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster):
a node lost mid-epoch loses and repeats no sample."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from conftest import forget_ray_callback_threads  # noqa: E402  (tests/ is on sys.path)

from autominato import Loader  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    # A temp dir of its own: Cluster writes its address where ray.init() looks for a local
    # cluster to join (RAY_TMPDIR, else /tmp/ray), so a Ray loader of another test process
    # (pytest-xdist) would have joined this cluster and lost its actors with the node.
    tmp = tempfile.mkdtemp(prefix="rc")  # short: Ray's socket paths live under it
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    os.mkdir(os.path.join(tmp, "ray"))  # (where the address is written)
    try:
        cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False,
                            "temp_dir": os.path.join(tmp, "ray")})
        worker = cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster, worker
        ray.shutdown()
        forget_ray_callback_threads()
        cluster.shutdown()
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(tmp, ignore_errors=True)


class Slow:
    """Sample i: ((4, 5) float32 filled with i, i, the pid of the actor), ``seconds`` each."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return np.full((4, 5), i, np.float32), i, os.getpid()


def test_a_node_lost_mid_epoch_loses_and_repeats_nothing(two_nodes):
    cluster, worker = two_nodes
    n = 60
    with Loader(Slow(n, 0.05), 2, shuffle=True, seed=3, worker_kind="ray", workers=3,
                autotune=False) as loader:
        assert loader.knobs.workers == 3  # the cluster's 3 CPUs, not this process's node's 1
        it = iter(loader)
        got = next(it)[1].tolist()
        deadline = time.monotonic() + 60
        while len({nd.node for nd in loader.snapshot().nodes if nd.workers}) < 2:
            assert time.monotonic() < deadline, loader.snapshot().nodes
            time.sleep(0.05)
        cluster.remove_node(worker)  # its two actors and the samples they hold are lost
        for _, idx, _ in it:
            got += idx.tolist()
        assert collections.Counter(got) == collections.Counter(range(n))
        assert loader.snapshot().worker_restarts_total >= 2
