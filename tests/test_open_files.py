"""Open files: every gym-grpc process raises its soft limit to the hard limit at start,
`status` shows what each server got, and running out of them (EMFILE) is said in one
line naming the server, with each call it costs failing as RESOURCE_EXHAUSTED."""

import socket
import subprocess

import pytest

from tests.support import MATH, REPO, WEATHER, gym, limit_open_files, read_rows, run_status, start_run, tool


@pytest.mark.slow
def test_every_server_raises_its_open_file_limit_to_the_hard_limit_and_status_shows_it():
    run = start_run(open_files=(256, 4096))
    try:
        code, rows = run_status(run.registry)
        assert code == 0
        assert {name: row["open_files_limit"] for name, row in rows.items()} == {name: 4096 for name in rows}
        assert all(0 < row["open_files"] < 4096 for row in rows.values())
        table = gym("status", "--registry", run.registry, "--interval", "0.2").stdout
        servers = [line for line in table.splitlines()[1:] if not line.startswith("  ")]  # not a worker's line
        assert len(servers) == len(rows) and all(" of 4096" in line for line in servers)
    finally:
        run.stop()


@pytest.mark.slow
def test_a_model_server_out_of_open_files_says_so_once_and_its_calls_fail_as_resource_exhausted(tmp_path):
    """The engine is a socket that listens and never answers (a stand-in for a slow
    engine: each request holds a connection); the model server may hold 128 files."""
    engine = socket.create_server(("127.0.0.1", 0), backlog=4096)
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"include: ['{REPO / 'servers' / 'resources' / 'weather' / 'config.yaml'}']\n"
        "layout: per_server\n"  # the model server's own process runs out of files, not the agent's
        "servers:\n"
        "  policy_model:\n"
        f"    entrypoint: '{REPO / 'servers' / 'models' / 'openai_model' / 'server.py'}:OpenAIModel'\n"
        f"    config: {{base_url: 'http://127.0.0.1:{engine.getsockname()[1]}/v1', model: m}}\n"
    )
    run = start_run(configs=(config,), open_files=(128, 128))  # a hard limit: raising cannot help
    try:
        _, rows = run_status(run.registry)
        assert rows["policy_model"]["open_files_limit"] == 128
        tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
        tasks.write_text(WEATHER.read_text() * 60)  # 300 rollouts at once: more connections than files
        done = gym(
            "collect",
            *("--registry", run.registry, "--agent", "weather_agent", "--input", str(tasks), "--output", str(out)),
            *("--max-in-flight", "300", "--timeout", "5", "--no-progress"),
        )
        assert done.returncode == 1
    finally:
        run.stop()
        engine.close()
    failures = read_rows(tmp_path / "out.failures.jsonl")
    assert len(failures) == 300
    out_of_files = [f["error"] for f in failures if f["error"]["code"] == "RESOURCE_EXHAUSTED"]
    assert out_of_files, done.stderr
    for error in out_of_files:
        assert "server 'policy_model' is out of open files (EMFILE) connecting to engine" in error["message"]
        assert "limit 128 (hard limit 128)" in error["message"]
    log = run.log()
    said = [line for line in log.splitlines() if "[policy_model]" in line and "out of open files" in line]
    assert len(said) == 1, log[-3000:]
    assert "ClientConnectorError" not in log and "Too many open files" not in log


@pytest.fixture(scope="module")
def many_channels():
    """The quickstart with math_agent on 4 processes: a collector opens 32 connections to it."""
    run = start_run("servers.math_agent.num_workers=4")
    yield run
    run.stop()


def _collect_60(run, tmp_path, open_files: tuple[int, int]) -> subprocess.CompletedProcess:
    """`gym-grpc collect` of 60 math tasks at once (every connection used), with these open-file limits."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(MATH.read_text() * 10)
    args = ["--registry", run.registry, "--agent", "math_agent", "--input", str(tasks)]
    return subprocess.run(
        [tool("gym-grpc"), "collect", *args, "--output", str(tmp_path / "out.jsonl"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_open_files(*open_files),
    )


@pytest.mark.slow
def test_collect_raises_its_open_file_limit_so_a_low_soft_limit_costs_nothing(many_channels, tmp_path):
    done = _collect_60(many_channels, tmp_path, (32, 4096))  # 32 is fewer than it needs
    assert done.returncode == 0, done.stderr
    assert len(read_rows(tmp_path / "out.jsonl")) == 60


def test_collect_out_of_open_files_says_so_once_and_records_every_rollout_it_cost(many_channels, tmp_path):
    done = _collect_60(many_channels, tmp_path, (32, 32))  # a hard limit: raising cannot help
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "out of open files" in line]
    assert len(said) == 1, done.stderr
    # Its rollouts travel on RunMany calls (client/run_many.py); the call that could not be opened is named.
    assert "gym-grpc collect is out of open files (EMFILE) calling agent 'math_agent' RunMany: limit 32" in said[0]
    failures = read_rows(tmp_path / "out.failures.jsonl")
    assert failures and all(f["error"]["code"] == "RESOURCE_EXHAUSTED" for f in failures)
    assert len(read_rows(tmp_path / "out.jsonl")) + len(failures) == 60  # nothing lost, nothing twice
