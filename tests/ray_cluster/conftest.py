"""A Ray cluster of three real nodes on this machine, and `gym-grpc run --ray` on it.

Run these with `pytest --ray-cluster tests/ray_cluster`. Each node of
`ray.cluster_utils.Cluster` is a real raylet with its own worker processes;
the head also runs the GCS. The runner is started as a user would, as a
`gym-grpc run --ray ADDRESS` process that joins the cluster as a driver.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.testing.processes import GymRun
from tests.support import REPO, start_run

#: CPUs of each node. The replicas ask for a quarter CPU each (see CONFIG), so
#: that all of them fit on two nodes when the third is lost.
NODE_CPUS = 2

#: Nodes of the cluster, the head included.
NODES = 3

# Node loss is noticed by the GCS's health checks of the raylets; Ray's default
# (a check every 3 s, dead after 5 failures) would make the test wait ~15 s.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}

CONFIG = """\
include:
  - {repo}/configs/local_policy.yaml
  - {repo}/servers/resources/session_state/config.yaml
  - {repo}/servers/resources/math/config.yaml
ray:
  max_restarts: 2
servers:
  math:
    replicas: 2
    num_cpus: 0.25
  math_agent:
    num_cpus: 0.25
  policy_model:
    replicas: 2
    num_cpus: 0.25
    config: {{latency_seconds: {latency}}}
  session_state:
    replicas: 3
    num_cpus: 0.25
  session_state_agent:
    replicas: 3
    num_cpus: 0.25
"""

TASKS = REPO / "servers" / "resources" / "session_state" / "data" / "example.jsonl"
MATH_TASKS = REPO / "servers" / "resources" / "math" / "data" / "example.jsonl"
AGENT = "session_state_agent"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False, "_system_config": SYSTEM_CONFIG},
    )
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def start_ray_run(cluster: Any, directory: Path, latency: float = 0.0, *overrides: str) -> GymRun:
    """`gym-grpc run CONFIG --ray ADDRESS registry.port=0` until it says the servers are healthy."""
    config = directory / "scale_out.yaml"
    config.write_text(CONFIG.format(repo=REPO, latency=latency))
    return start_run("--ray", cluster.address, *overrides, configs=(config,))


def _descendants(pid: int) -> list[int]:
    """Every process started by `pid`, and by those, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(cluster: Any, node: Any) -> None:
    """A node dies as a machine does: every process on it gets SIGKILL at once (its
    worker processes, the replicas' actors among them, then its raylet and the rest).
    Ray's own `remove_node` kills the raylet only; its workers would notice and shut
    down over the next seconds, still answering meanwhile, which no dead machine does."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    for pid in _descendants(raylet.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)
