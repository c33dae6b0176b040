"""Clients that give up, time out or die mid-call never take a server down.

Real processes on both sides: `gym-grpc run` serves the quickstart, and the
clients are separate processes (a Python client, grpcurl) that cancel streams
(RunStream, RunMany and runs on it), give them deadlines from 1 ms to 2 s, or
are SIGKILLed while a stream is open.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from google.protobuf import json_format

from gym_grpc.data import rows
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from tests.support import REPO, WEATHER, run_status, start_run, tool


@pytest.mark.slow
def test_streams_cancelled_timed_out_or_killed_mid_call_never_crash_the_agent():
    run = start_run("servers.policy_model.config.latency_seconds=0.05")
    try:
        _, before = run_status(run.registry)
        agent = run.servers["weather_agent"]
        # 1,000 RunStream calls and 1,000 RunMany calls (with up to 4 runs each, some cancelled
        # by id) in four client processes, each call ended early by a cancel or a deadline.
        cancellers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.programs.stream_canceller",
                    agent,
                    str(WEATHER),
                    "500",
                    str(seed),
                    method,
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in (1, 2)
            for method in ("RunStream", "RunMany")
        ]
        try:
            for canceller in cancellers:
                out, err = canceller.communicate(timeout=300)
                assert canceller.returncode == 0, err
                ended = json.loads(out)
                assert ended.pop("final_run_ok") == 1  # the agent served the next rollout
                assert sum(ended.values()) == 500
                assert ended.get("CANCELLED", 0) > 0 and ended.get("DEADLINE_EXCEEDED", 0) > 0, ended
        finally:  # a client that hangs fails the test, and does not outlive it
            for canceller in cancellers:
                canceller.kill()

        # 50 grpcurl processes on RunStream, each SIGKILLed once its stream has delivered an event,
        # and 50 on RunMany, each SIGKILLed once a result arrived, with the other runs in flight.
        task = rows.task_from_row(json.loads(WEATHER.read_text().splitlines()[0]))
        runs = [{"id": str(i), "run": {"task": json_format.MessageToDict(task)}} for i in range(4)]
        for _ in range(50):
            _killed_mid_stream(agent, "RunStream", json_format.MessageToJson(agent_pb.RunStreamRequest(task=task)))
            _killed_mid_stream(agent, "RunMany", json.dumps({"runs": runs}))

        _, after = run_status(run.registry)
        assert after["weather_agent"]["health"] == "serving"
        assert after["weather_agent"]["pid"] == before["weather_agent"]["pid"]  # never died, never restarted
    finally:
        run.stop()
    log = run.log()
    assert "exited with code" not in log and "Traceback" not in log, log[-3000:]


def _killed_mid_stream(agent: str, method: str, request: str) -> None:
    """grpcurl calls `method` with `request` and is SIGKILLed once the first reply arrived. On
    RunMany its input is left open, as a client's that could send more runs."""
    client = subprocess.Popen(
        [tool("grpcurl"), "-plaintext", "-d", "@", agent, f"gym.v1.AgentService/{method}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    client.stdin.write(request + "\n")
    client.stdin.flush()
    if method != "RunMany":
        client.stdin.close()
    assert client.stdout.readline().startswith("{")  # mid-stream: the first reply arrived
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    for pipe in (client.stdin, client.stdout):
        pipe.close()
