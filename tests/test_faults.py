"""Servers that die mid-collection, and verifiers that raise or hang: each costs
rollouts, never a hang and never the other servers; a re-run completes the rest."""

import asyncio
import io
import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.resources import ResourcesServer, Session
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import (
    MATH,
    REPO,
    EchoModel,
    collect_args,
    gym,
    read_rows,
    run_status,
    start_run,
    static_registry,
    tool,
)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["math", "policy_model", "math_agent"])
def test_a_server_killed_and_restarted_mid_collection_costs_at_most_its_calls_in_flight(victim, tmp_path):
    """Calls that were running in the killed process fail; later ones wait for the
    restart (within their deadline) and succeed; a re-run completes the rest.

    "Later" means after the client saw the connection close: a call started as
    the first failures came back (a window slot freed) can still be written to
    the closing socket and fail with it ("Delayed close due to in-progress
    write"), so up to one more call per slot may fail, all UNAVAILABLE.

    The deadline is generous on purpose: on a loaded 2-core machine the restarted
    process takes more than 10 s to start, and a call whose deadline passes while
    it waits is lost for that reason, not because the server died under it."""
    # a process per server: only the victim's calls are lost
    run = start_run(
        "layout=per_server", f"servers.{victim}.restart=true", "servers.policy_model.config.latency_seconds=0.1"
    )
    try:
        tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
        tasks.write_text(MATH.read_text() * 20)  # 120 tasks: about 1.5 s at 8 in flight
        args = [
            tool("gym-grpc"),
            *collect_args(run.registry, "math_agent", str(tasks), str(out)),
            "--max-in-flight",
            "8",
            "--timeout",
            "120",
            "--no-progress",
        ]
        _, before = run_status(run.registry)
        report = tmp_path / "collect.log"
        with report.open("w") as log:
            collector = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        while not out.exists() or len(out.read_bytes().splitlines()) < 16:
            time.sleep(0.01)
        os.kill(before[victim]["pid"], signal.SIGKILL)
        collector.wait(timeout=300)  # no hang
        failures = tmp_path / "out.failures.jsonl"
        failed = len(read_rows(failures)) if failures.exists() else 0
        why = [f"{row['error']['class']}: {row['error']['message']}" for row in read_rows(failures)] if failed else []
        assert failed <= 2 * 8, why  # what was in flight (--max-in-flight 8), and what was started as it closed
        assert all(reason.startswith("Unavailable: ") for reason in why), why
        assert collector.returncode == (1 if failed else 0), report.read_text()
        assert len(read_rows(out)) + failed == 120
        for _ in range(100):  # the runner starts it again on its port
            code, after = run_status(run.registry)
            if after[victim]["health"] == "serving" and after[victim].get("pid") != before[victim]["pid"]:
                break
            time.sleep(0.1)
        assert after[victim]["health"] == "serving" and after[victim]["pid"] != before[victim]["pid"]
        again = gym(*args[1:])
        assert again.returncode == 0, again.stderr
        keys = sorted((row["task_index"], row["repeat_index"]) for row in read_rows(out))
        assert keys == [(t, 0) for t in range(120)]
    finally:
        run.stop()
    assert f"server '{victim}' restarted" in run.log()


def _crashing_config(tmp_path: Path) -> tuple[Path, Path]:
    """A config of two restartable CrashingEnv servers, `crashing` (whose starts crash
    while the returned crash file says so) and `steady`; the config and that file."""
    crashes = tmp_path / "crashes"
    entrypoint = f"{REPO / 'tests' / 'programs' / 'crashing_env.py'}:CrashingEnv"
    config = tmp_path / "crashing.yaml"
    config.write_text(
        "servers:\n"
        f"  crashing: {{entrypoint: '{entrypoint}', restart: true, config: {{crash_file: '{crashes}'}}}}\n"
        f"  steady: {{entrypoint: '{entrypoint}', restart: true, config: {{crash_file: '{tmp_path / 'never'}'}}}}\n"
    )
    return config, crashes


def _wait_for(condition, what: str, seconds: float = 120.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after `seconds` (a bound on a hang)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {seconds:.0f} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_replacement_that_crashes_before_it_is_healthy_is_retried_until_one_serves(tmp_path):
    config, crashes = _crashing_config(tmp_path)
    run = start_run(configs=(config,))
    try:
        _, before = run_status(run.registry)
        crashes.write_text("1")  # the first replacement crashes, the second serves
        os.kill(before["crashing"]["pid"], signal.SIGKILL)

        def back() -> bool:
            _, now = run_status(run.registry)
            return now["crashing"]["health"] == "serving" and now["crashing"]["pid"] != before["crashing"]["pid"]

        _wait_for(back, "the second replacement to serve")
        assert crashes.read_text() == "0"
    finally:
        run.stop()
    log = run.log()
    assert "restarting 'crashing' (attempt 1 of 5)\n" in log
    assert "attempt 1 of 5 failed: server 'crashing' exited with code 3 before it was ready" in log
    assert "restarting 'crashing' (attempt 2 of 5) in 0.5 s" in log
    assert "server 'crashing' restarted" in log and "giving up" not in log


@pytest.mark.slow
def test_a_server_whose_replacements_keep_crashing_is_given_up_with_its_last_log_lines(tmp_path):
    config, crashes = _crashing_config(tmp_path)
    run = start_run(configs=(config,))
    try:
        _, before = run_status(run.registry)
        crashes.write_text("100")
        os.kill(before["crashing"]["pid"], signal.SIGKILL)
        _wait_for(lambda: "giving up on server 'crashing'" in run.log(), "the runner to give up")
        assert crashes.read_text() == "95"  # five attempts, no more
        _, after = run_status(run.registry)
        assert after["crashing"]["health"] == "down" and after["steady"]["health"] == "serving"
        assert run.process.poll() is None  # the run goes on with the other server
    finally:
        run.stop()
    log = run.log()
    for attempt, delay in [(2, "0.5"), (3, "1.0"), (4, "2.0"), (5, "4.0")]:
        assert f"restarting 'crashing' (attempt {attempt} of 5) in {delay} s" in log
    assert "attempt 5 of 5 failed: server 'crashing' exited with code 3 before it was ready" in log
    given_up = log[log.index("giving up on server 'crashing' after 5 attempts to restart it; its last log lines:\n") :]
    quoted = list(itertools.takewhile(lambda line: line.startswith("    "), given_up.splitlines()[1:]))
    assert quoted and quoted[-1].endswith("crashing on purpose, 95 more crashes to come")


def test_a_server_that_crashes_before_it_is_ready_fails_startup_quoting_its_last_log_lines(tmp_path):
    config, crashes = _crashing_config(tmp_path)
    crashes.write_text("1")
    done = gym("run", str(config), "registry.port=0")
    assert done.returncode == 1
    error = done.stderr[done.stderr.index("Error: ") :]
    assert error.startswith("Error: server 'crashing' exited with code 3 before it was ready; its last log lines:\n")
    assert "crashing on purpose, 0 more crashes to come" in error


class Moody(ResourcesServer):
    """A verifier that raises for one task and hangs for another."""

    async def verify(self, session: Session, response: r.Response) -> float:
        prompt = session.task.responses_create_params.input_text
        if prompt == "raise":
            raise RuntimeError("the verifier fell over")
        if prompt == "hang":
            await asyncio.Event().wait()
        if prompt == "block":  # past the limit without letting the event loop run its time-out
            time.sleep(0.5)
        return 1.0


async def test_a_verify_that_ends_past_its_limit_fails_whichever_the_loop_saw_first(start):
    """Seen under load: a check that ended itself at the verify's deadline answered before the
    event loop ran the verify's time-out, and the verify passed; which one won was chance."""
    env = await start(Moody({"verify_timeout_seconds": 0.3}, name="moody"))
    client = ResourcesClient(static_registry(moody=env), "moody")
    task = task_pb2.Task()
    task.responses_create_params.input_text = "block"
    with pytest.raises(errors.GymError, match=r"INTERNAL: verify did not finish within 0\.3 s"):
        await client.verify("s", task, r.Response())
    task.responses_create_params.input_text = "fine"
    assert (await client.verify("s", task, r.Response())).reward == 1.0
    await client.registry.close()


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
