"""Clients that give up, time out or die mid-call never take a server down.

Real processes on both sides: `gym-grpc run` serves the quickstart, and the
clients are separate processes (a Python client, grpcurl) that cancel streams
(RunStream, RunMany and runs on it), give them deadlines from 1 ms to 2 s, or
are SIGKILLed while a stream is open.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import json_format

from gym_grpc.data import rows
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from tests.support import REPO, WEATHER, alive, run_status, start_run, tool


@pytest.mark.slow
def test_streams_cancelled_timed_out_or_killed_mid_call_never_crash_the_agent():
    run = start_run("servers.policy_model.config.latency_seconds=0.05")
    try:
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
        workers = run.pids("weather_agent")
        assert [w["pid"] for w in after["weather_agent"]["workers"]] == workers  # none was started again
        assert all(alive(pid) for pid in workers)  # and none died (restart is off: it would stay dead)
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


def _run_counts(address: str) -> tuple[int, int]:
    """(Run calls finished, Run calls in flight) of the agent at `address`, from its GetCounters."""
    with grpc.insecure_channel(address) as channel:
        counters = admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
    run = next((m for m in counters.methods if m.method == "Run"), None)
    return (0, 0) if run is None else (sum(run.calls_by_status.values()), run.in_flight)


@pytest.mark.slow
def test_a_client_that_sends_runs_and_reads_no_result_gets_no_more_read_than_the_agent_may_hold():
    """100,000 runs on one RunMany call from a client process that reads nothing. The agent reads and
    runs as many as its run_many_max_runs (here 1,000) and what gRPC buffers of their results allow,
    then reads no more: gRPC's flow control holds the client's writes. Before, it read all 100,000
    (about 1 GB of the agent's memory). The agent keeps serving others. In one process: the call
    reaches one, whose counters and memory are read."""
    run = start_run("group_workers=1", "servers.weather_agent.config.run_many_max_runs=1000")
    agent = run.servers["weather_agent"]
    client = subprocess.Popen(
        [sys.executable, "-m", "tests.programs.unread_run_many", agent, "100000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert client.stdout is not None
    os.set_blocking(client.stdout.fileno(), False)
    try:
        said, deadline = b"", time.monotonic() + 300  # (a bound on a hang)
        while True:
            with contextlib.suppress(BlockingIOError):
                said += os.read(client.stdout.fileno(), 1 << 16)
            sent = max(map(int, said.split() or [0]))
            finished, in_flight = _run_counts(agent)
            if sent == 100_000 or (finished >= 1000 and in_flight == 0):  # all sent, or the agent stopped reading
                break
            assert client.poll() is None, client.stderr.read() if client.stderr else ""
            assert time.monotonic() < deadline, f"{sent} runs sent, {finished} finished, {in_flight} in flight"
            time.sleep(0.2)
        assert finished + in_flight < 50_000, f"the agent read {finished + in_flight} of the {sent} runs sent"
        (pid,) = run.pids("weather_agent")
        rss_kib = int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS")).split()[1])
        assert rss_kib < 400 * 1024, f"the agent holds {rss_kib / 1024:.0f} MiB"
        request = json.dumps({"task": {"responses_create_params": {"input_text": "hi"}}})
        done = subprocess.run(  # the agent still serves others
            [tool("grpcurl"), "-plaintext", "-d", request, agent, "gym.v1.AgentService/Run"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    finally:
        client.kill()
        client.wait()
        run.stop()
