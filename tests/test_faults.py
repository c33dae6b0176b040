"""Servers that die mid-collection, and verifiers that raise or hang: each costs
rollouts, never a hang and never the other servers; a re-run completes the rest."""

import asyncio
import io
import json
import os
import signal
import subprocess
import time

import pytest

from gym_grpc.collector import CollectOptions, collect
from gym_grpc.registry import Registry
from gym_grpc.resources import ResourcesServer, Session
from gym_grpc.v1 import responses_pb2 as r
from servers.agents.simple_agent.agent import SimpleAgent
from tests.support import EchoModel, static_registry
from tests.test_cli import MATH, _gym, _rows, _start_run, _status, _tool


@pytest.mark.parametrize("victim", ["math", "policy_model", "math_agent"])
def test_a_server_killed_and_restarted_mid_collection_costs_at_most_its_calls_in_flight(victim, tmp_path):
    """Calls that were running in the killed process fail; later ones wait for the
    restart (within their deadline) and succeed; a re-run completes the rest."""
    run = _start_run(f"servers.{victim}.restart=true", "servers.policy_model.config.latency_seconds=0.1")
    try:
        tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
        tasks.write_text(MATH.read_text() * 20)  # 120 tasks: about 1.5 s at 8 in flight
        args = [
            _tool("gym-grpc"),
            "collect",
            "--registry",
            run.registry,
            "--agent",
            "math_agent",
            "--input",
            str(tasks),
            "--output",
            str(out),
            "--max-in-flight",
            "8",
            "--timeout",
            "10",
            "--no-progress",
        ]
        _, before = _status(run.registry)
        report = tmp_path / "collect.log"
        with report.open("w") as log:
            collector = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        while not out.exists() or len(out.read_bytes().splitlines()) < 16:
            time.sleep(0.01)
        os.kill(before[victim]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        collector.wait(timeout=60)
        assert time.monotonic() - killed < 30  # no hang
        failures = tmp_path / "out.failures.jsonl"
        failed = len(_rows(failures)) if failures.exists() else 0
        assert failed <= 8  # at most what was in flight (--max-in-flight 8)
        assert collector.returncode == (1 if failed else 0), report.read_text()
        assert len(_rows(out)) + failed == 120
        for _ in range(100):  # the runner starts it again on its port
            code, after = _status(run.registry)
            if after[victim]["health"] == "serving" and after[victim].get("pid") != before[victim]["pid"]:
                break
            time.sleep(0.1)
        assert after[victim]["health"] == "serving" and after[victim]["pid"] != before[victim]["pid"]
        again = _gym(*args[1:])
        assert again.returncode == 0, again.stderr
        keys = sorted((row["task_index"], row["repeat_index"]) for row in _rows(out))
        assert keys == [(t, 0) for t in range(120)]
    finally:
        run.stop()
    assert f"server '{victim}' restarted" in run.log()


class Moody(ResourcesServer):
    """A verifier that raises for one task and hangs for another."""

    async def verify(self, session: Session, response: r.Response) -> float:
        prompt = session.task.responses_create_params.input_text
        if prompt == "raise":
            raise RuntimeError("the verifier fell over")
        if prompt == "hang":
            await asyncio.Event().wait()
        return 1.0


@pytest.mark.parametrize("server_timeout, code", [(0.3, "INTERNAL"), (300.0, "DEADLINE_EXCEEDED")])
async def test_a_verifier_that_raises_or_hangs_costs_one_rollout_not_the_server(start, tmp_path, server_timeout, code):
    model = await start(EchoModel())
    env = await start(Moody({"verify_timeout_seconds": server_timeout}, name="moody"))
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "moody"},
            name="agent",
            registry=static_registry(model=model, moody=env),
        )
    )
    tasks = tmp_path / "tasks.jsonl"
    prompts = ["fine", "raise", "fine", "hang", "fine"]
    tasks.write_text("".join(json.dumps({"responses_create_params": {"input": p}}) + "\n" for p in prompts))
    began = time.monotonic()
    options = CollectOptions(input=tasks, output=tmp_path / "out.jsonl", agent="agent", timeout=2, progress=False)
    summary = await collect(Registry(static={"agent": agent.address}), options, log=io.StringIO())
    assert time.monotonic() - began < 10
    assert (summary.done, summary.failed) == (3, 2)
    failures = {f["task_index"]: f["error"] for f in map(json.loads, (tmp_path / "out.failures.jsonl").open())}
    assert failures[1]["code"] == "INTERNAL" and "fell over" in failures[1]["message"]
    assert failures[3]["code"] == code
    again = await collect(
        Registry(static={"agent": agent.address}),
        CollectOptions(input=tasks, output=tmp_path / "more.jsonl", agent="agent", timeout=2, progress=False, limit=1),
        log=io.StringIO(),
    )
    assert again.done == 1  # the server still serves
