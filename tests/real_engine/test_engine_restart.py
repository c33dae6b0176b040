"""vLLM stopped and started again on its port in the middle of a collection through vllm_model:
no rollout fails, and each one the engine's absence cut goes on from its last turn boundary.

What really happens (vLLM 0.32 CPU, configs/vllm.yaml: max_retries 5):

* SIGTERM reaches vLLM's API server and its engine core (one process group). The
  requests in flight are answered HTTP 500 "EngineCore encountered an issue" by the
  API server while it shuts down (or their connection drops); then connections are
  refused. The model server retries the 500 as a server_error and the refusals as
  connect failures: five connect retries back off 0.5 + 1 + 2 + 4 + 8 s, jittered down to
  half, so a model call gives up after 7.75 to 15.5 s, UNAVAILABLE naming the engine, and
  vLLM takes longer than that to start again.
* The agent fails that attempt UNAVAILABLE and keeps the rollout's environment session
  open (the run is durable); the collector resumes the rollout from its last checkpoint,
  on the next RunMany call, until the engine serves again (client/run_many.py). Only the
  turn whose model call failed is generated again; the turns before it keep the ids and
  log-probs the first engine sampled, and the next turns' prompts extend them.

The new engine is started only once a model call has failed on the stopped one (the model
server's own counters say so), so that the collection surely meets the engine down,
however fast or loaded the machine is.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gym_grpc.data import record
from gym_grpc.engines import local_vllm
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

ROWS = 10


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def _wait_for(condition: Callable[[], bool], collector: subprocess.Popen, what: str) -> None:
    """Until `condition` holds; fail if the collector ends first."""
    while not condition():
        assert collector.poll() is None, f"collect ended ({collector.returncode}) before {what}"
        time.sleep(0.2)


async def _failed_model_calls(registry_address: str) -> int:
    """CreateResponse calls the policy model server answered UNAVAILABLE, by its own counters."""
    registry = Registry(registry_address)
    try:
        address = (await registry.info("policy_model")).addresses[0]
    finally:
        await registry.close()
    async with transport.open_channel(address) as channel:
        counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
    return sum(m.calls_by_status.get("UNAVAILABLE", 0) for m in counters.methods if m.method == "CreateResponse")


def test_an_engine_restarted_mid_collection_fails_no_rollout_and_the_cut_ones_go_on_from_their_turn(
    tmp_path: Path,
) -> None:
    first = local_vllm.start(log_path=tmp_path / "vllm-1.log")
    engines = [first]
    try:
        port = int(first.base_url.removesuffix("/v1").rsplit(":", 1)[1])
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(gym_cli.WEATHER_TASKS.read_text() * (ROWS // 5 + 1))
        output, sidecar = tmp_path / "out.jsonl", tmp_path / "out.failures.jsonl"
        three_calls = ("servers.weather_agent.config.max_steps=3",)
        with gym_cli.serving(first, tmp_path, gym_cli.VLLM, gym_cli.WEATHER_CONFIG, overrides=three_calls) as run:
            # Three model calls a rollout (a tool call is required at each, max_steps 3), so that a
            # rollout is cut between turns, and its later turns show whether the ids still extend.
            args = gym_cli.collect_args(
                run,
                "weather_agent",
                tasks,
                output,
                "--limit",
                str(ROWS),
                "--max-in-flight",
                "6",
                "temperature=1.0",
                "tool_choice=required",
                "parallel_tool_calls=false",
                "max_output_tokens=40",
            )
            run_log = (tmp_path / "collect.log").open("w")
            with run_log:
                collector = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=run_log)
                try:
                    _wait_for(lambda: _lines(output) >= 2, collector, "2 rows were written")
                    local_vllm.stop(first.pid)
                    _wait_for(
                        lambda: asyncio.run(_failed_model_calls(run.registry)) >= 1,
                        collector,
                        "a model call failed on the stopped engine",
                    )
                    engines.append(local_vllm.start(log_path=tmp_path / "vllm-2.log", port=port))
                    returncode = collector.wait(timeout=3600)  # a bound on a hang, not a timing claim
                finally:
                    if collector.poll() is None:
                        collector.kill()
            report = (tmp_path / "collect.log").read_text()
            assert returncode == 0, report + run.log()[-3000:]
            assert _lines(sidecar) == 0, report
            written = gym_cli.rows(output)
            assert sorted((row["task_index"], row["repeat_index"]) for row in written) == [(t, 0) for t in range(ROWS)]
            assert f"{ROWS} rollouts collected, 0 failed" in report
        resumed = [row for row in written if "attempts" in row]
        print(
            f"engine restarted: {len(resumed)} of {ROWS} rollouts resumed, "
            f"{sum(record.turns_regenerated(row) for row in resumed)} turns generated again"
        )
        assert resumed, "no rollout met the stopped engine"
        assert f"{len(resumed)} rollouts resumed from a turn boundary after a lost attempt" in report
        engine = first.base_url.removesuffix("/v1")
        for row in resumed:
            attempts = row["attempts"]
            assert "ended" not in attempts[-1], attempts
            for cut, after in zip(attempts, attempts[1:], strict=False):
                assert cut["ended"].startswith("UNAVAILABLE: ") and f"engine {engine}/" in cut["ended"], cut
                assert after["first_turn"] >= cut["first_turn"], attempts  # never back to its prompt
            # Each turn once in the rollout: the one generated again replaced the one lost.
            assert len(gym_cli.carriers(row)) == row["model_calls"], row
        extending, later = gym_cli.extension_share(resumed)
        assert later >= 1, "no resumed rollout has a turn after its first"
        assert extending == later  # token in, token out across the restart and the resume
    finally:
        for engine in engines:
            local_vllm.stop(engine.pid)
