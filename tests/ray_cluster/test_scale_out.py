"""`gym-grpc run --ray` on a three-node Ray cluster: replicas spread over the nodes,
calls balanced over them, sessions pinned to their replica under load, and a node
lost in the middle of a collection. Everything is real: the raylets, the actors,
the servers in them, `gym-grpc run` and `gym-grpc collect` as processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.client.training import GymClient
from gym_grpc.data import record
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from tests.ray_cluster.conftest import AGENT, MATH_TASKS, NODES, TASKS, kill_node, start_ray_run
from tests.support import tool

pytestmark = [pytest.mark.ray_cluster, pytest.mark.slow]

TASK_ROWS = len(TASKS.read_text().splitlines())


def collect_command(registry: str, output: Path, repeats: int, *extra: str) -> list[str]:
    return [
        tool("gym-grpc"),
        "collect",
        "--registry",
        registry,
        "--agent",
        AGENT,
        "--input",
        str(TASKS),
        "--output",
        str(output),
        "--num-repeats",
        str(repeats),
        "--no-progress",
        *extra,
    ]


def rows(path: Path) -> list[dict[str, Any]]:
    """The rows written so far: complete lines only, as the file may be read while a row is half written."""
    data = path.read_bytes() if path.exists() else b""  # bytes: split at "\n" only, not at U+2028 in a string
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def keys(path: Path) -> list[tuple[int, int]]:
    return [(row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows(path)]


async def entries(registry: str) -> dict[str, reg.ServerInfo]:
    client = Registry(registry)
    try:
        return {info.name: info for info in await client.list()}
    finally:
        await client.close()


async def calls_per_replica(info: reg.ServerInfo) -> list[dict[str, int]]:
    """Each replica's finished calls by method, from its own AdminService counters."""
    counts = []
    for replica in info.replicas:
        channel = transport.open_channel(replica.address)
        try:
            reply = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
        finally:
            await channel.close()
        counts.append({m.method: sum(m.calls_by_status.values()) for m in reply.methods})
    return counts


def test_replicas_spread_over_the_nodes_share_the_calls_and_keep_their_sessions(cluster, tmp_path):
    run = start_ray_run(cluster, tmp_path)
    try:
        servers = asyncio.run(entries(run.registry))
        for name, replicas in [("policy_model", 2), ("session_state", 3), (AGENT, 3), ("math", 2)]:
            info = servers[name]
            assert len(info.replicas) == replicas, info
            assert len({r.node for r in info.replicas}) == replicas  # SPREAD: one per node
            assert list(info.addresses) == [r.address for r in info.replicas]
        assert len({r.node for info in servers.values() for r in info.replicas}) == NODES
        assert len(servers["math_agent"].replicas) == 1

        repeats = 60  # 300 rollouts, all in flight at once: sessions on three replicas under load
        output = tmp_path / "rollouts.jsonl"
        command = collect_command(run.registry, output, repeats)
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        total = TASK_ROWS * repeats
        assert sorted(keys(output)) == [(t, r) for t in range(TASK_ROWS) for r in range(repeats)]

        agents = asyncio.run(calls_per_replica(servers[AGENT]))

        # An agent closes a session once the rollout's result has gone out: the last closes may
        # still be on their way when collect ends.
        def closed() -> list[dict[str, int]] | None:
            counts = asyncio.run(calls_per_replica(servers["session_state"]))
            return counts if all(c.get("CloseSession", 0) == c["SeedSession"] for c in counts) else None

        environments = _wait(closed, 60, "every session closed")
        models = asyncio.run(calls_per_replica(servers["policy_model"]))
        print("Run per agent replica:", [c["Run"] for c in agents])
        print("SeedSession per environment replica:", [c["SeedSession"] for c in environments])
        print("CreateResponse per model replica:", [c["CreateResponse"] for c in models])
        # round_robin over the replicas: every one takes a fair share.
        for counts, method in [(agents, "Run"), (environments, "SeedSession"), (models, "CreateResponse")]:
            shares = [c.get(method, 0) for c in counts]
            assert min(shares) >= sum(shares) / len(shares) / 2, (method, shares)
        assert sum(c["Run"] for c in agents) == total
        # Affinity: a session's calls all reach the replica that opened it. A call sent
        # elsewhere would fail (that replica has no such session), so every replica
        # closed and verified exactly the sessions it opened, and no call failed.
        for counts in environments:
            assert counts["SeedSession"] == counts["Verify"] == counts["CloseSession"], counts
            assert counts["CallTool"] >= counts["SeedSession"], counts
        assert sum(c["SeedSession"] for c in environments) == total

        # A trainer through the client library: math problems, checked by math-verify in the
        # verify pool each math replica runs inside its actor.
        rows = [json.loads(line) for line in MATH_TASKS.read_text().splitlines()]
        results = asyncio.run(_through_the_client_library(run.registry, rows))
        assert all(result.ok for result in results), [result.failure for result in results]
        assert [result.reward for result in results] == [1.0] * len(rows)
        math_verifies = [c.get("Verify", 0) for c in asyncio.run(calls_per_replica(servers["math"]))]
        assert sum(math_verifies) == len(rows) and min(math_verifies) > 0, math_verifies
    finally:
        assert run.stop() == 0, run.log()


async def _through_the_client_library(registry: str, rows: list[dict[str, Any]]) -> list[Any]:
    async with GymClient("math_agent", registry) as gym:
        return list(
            await asyncio.gather(
                *(
                    gym.run({**row, "responses_create_params": {**row["responses_create_params"], "temperature": 0}})
                    for row in rows
                )
            )
        )


def test_a_replica_lost_for_good_leaves_the_registry_and_the_others_serve(cluster, tmp_path):
    run = start_ray_run(cluster, tmp_path, 0.0, "ray.max_restarts=0")
    try:
        before = asyncio.run(entries(run.registry))["session_state"]
        doomed = before.replicas[0]
        pid = asyncio.run(_pid(doomed.address))
        os.kill(pid, signal.SIGKILL)

        def dropped() -> reg.ServerInfo | None:
            info = asyncio.run(entries(run.registry))["session_state"]
            return info if len(info.replicas) == len(before.replicas) - 1 else None

        after = _wait(dropped, 60, "the dead replica taken out of the registry")
        assert doomed.address not in after.addresses
        output = tmp_path / "rollouts.jsonl"
        done = subprocess.run(collect_command(run.registry, output, 20), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert len(keys(output)) == TASK_ROWS * 20
        assert len(asyncio.run(entries(run.registry))["session_state"].replicas) == len(before.replicas) - 1
    finally:
        code = run.stop()
    assert code == 1
    assert "session_state#0 is lost for good (Ray gave up after 0 restarts)" in run.log()


async def _pid(address: str) -> int:
    async with transport.open_channel(address) as channel:
        info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=10)
    return info.pid


def test_a_replica_that_cannot_start_stops_the_run_with_its_reason(cluster, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(
        f"servers:\n  weather:\n    entrypoint: {TASKS.parents[2]}/weather/server.py:WeatherEnvv\n    replicas: 2\n"
    )
    command = [tool("gym-grpc"), "run", str(config), "--ray", cluster.address, "registry.port=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Error: replica weather#" in done.stderr
    assert "could not start: entrypoint" in done.stderr and "no GymServer subclass 'WeatherEnvv'" in done.stderr


def test_a_task_server_in_two_replicas_stops_the_run_naming_the_setting(cluster, tmp_path):
    """A task server's draws and pools are one state (TaskServer.one_process): two replicas would
    each serve the batches that reach them from pools of their own."""
    config = tmp_path / "tasks.yaml"
    dataset = {"name": "math", "jsonl_fpath": str(MATH_TASKS)}
    spec = {"entrypoint": "gym_grpc.tasks:TaskServer", "replicas": 2, "config": {"agent": "a", "datasets": [dataset]}}
    config.write_text(json.dumps({"servers": {"tasks": spec}}))  # JSON is YAML
    command = [tool("gym-grpc"), "run", str(config), "--ray", cluster.address, "registry.port=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Error: replica tasks#" in done.stderr
    assert "replicas is 2, but TaskServer runs in one process: its draws, pools" in done.stderr


def _wait(predicate: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"not within {seconds:.0f} s: {what}")


def test_a_node_lost_mid_collection_costs_no_rollout_each_lost_one_goes_on_from_its_last_turn(cluster, tmp_path):
    """The last test of the module: it leaves the cluster a node short."""
    run = start_ray_run(cluster, tmp_path, 0.2)
    try:
        before = asyncio.run(entries(run.registry))
        # A worker node (the head holds the GCS) with an agent and an environment replica on it.
        victim = next(
            node
            for node in cluster.worker_nodes
            if any(r.node == node.node_id for r in before[AGENT].replicas)
            and any(r.node == node.node_id for r in before["session_state"].replicas)
        )
        lost = {r.address for info in before.values() for r in info.replicas if r.node == victim.node_id}

        repeats = 80  # 400 rollouts of ~0.5 s, 60 at a time: plenty in flight when the node goes
        output = tmp_path / "rollouts.jsonl"
        command = collect_command(run.registry, output, repeats, "--max-in-flight", "60")
        collect = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait(lambda: len(rows(output)) >= 60 or collect.poll() is not None, 120, "60 rollouts collected")
        assert collect.poll() is None, "the collection ended before the node could be lost"
        kill_node(cluster, victim)
        _, stderr = collect.communicate(timeout=600)
        assert collect.returncode == 0, stderr
        assert not rows(output.with_suffix(".failures.jsonl")), stderr
        done = keys(output)
        assert len(done) == len(set(done)) == TASK_ROWS * repeats  # every rollout, in the same collect
        resumed = [row for row in rows(output) if "attempts" in row]
        regenerated = sum(record.turns_regenerated(row) for row in resumed)
        went_on = [row for row in resumed if row["attempts"][-1]["first_turn"] > 0]
        replayed = [row for row in resumed if any(a.get("session_replayed") for a in row["attempts"])]
        print(
            f"node lost mid-run: {len(done)} rollouts completed, {len(resumed)} resumed ({len(went_on)} after "
            f"their first turn, {len(replayed)} on a replayed session), {regenerated} turns generated again"
        )
        assert resumed, "the node took no rollout with it"
        summary = f"{len(resumed)} rollouts resumed from a turn boundary after a lost attempt ({regenerated} turns"
        assert summary in stderr
        for row in resumed:
            attempts = row["attempts"]
            for gone, after in zip(attempts, attempts[1:], strict=False):
                assert gone["ended"].startswith("UNAVAILABLE"), row["attempts"]
                assert after["first_turn"] >= gone["first_turn"], row["attempts"]  # never back to its prompt
            assert "ended" not in attempts[-1]
            assert row["reward"] == 1.0 or row["verifier_fields"], row  # verified, as any rollout
        # Only a turn in flight when its attempt was lost is generated again: at most one per lost attempt.
        assert regenerated <= sum(len(row["attempts"]) - 1 for row in resumed)

        # Ray starts the lost replicas again on the nodes left; the registry lists them.
        def replaced() -> dict[str, reg.ServerInfo] | None:
            now = asyncio.run(entries(run.registry))
            counts = {name: len(info.replicas) for name, info in now.items()}
            on_victim = [r for info in now.values() for r in info.replicas if r.node == victim.node_id]
            full = counts == {name: len(info.replicas) for name, info in before.items()}
            return now if full and not on_victim else None

        after = _wait(replaced, 120, "every lost replica started again on another node")
        restarted = [r for info in after.values() for r in info.replicas if r.restarts]
        # `replaced` tells them apart by node, not by address: the cluster's nodes share one IP, and the OS
        # may give a replacement the port its killed predecessor freed (a CI run saw it).
        assert len(restarted) == len(lost), after
    finally:
        code = run.stop()
    assert code == 1  # a replica died during the run, as the local runner reports a dead server
    assert "restarted by Ray" in run.log()
