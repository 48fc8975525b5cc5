"""The transform stage on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster):
a node lost mid-epoch loses and repeats no sample."""

from __future__ import annotations

import collections
import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from autominato import Loader  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True,
                                    head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, worker
    ray.shutdown()
    cluster.shutdown()


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
