"""`gym-grpc engine start|stop|status` as a user runs them (real processes), with a fake vLLM.

The cache the commands use is a temporary one that looks prepared: its
virtualenv's `python` runs tests/programs/fake_vllm.py with vLLM's arguments,
so prepare() returns at once and start() serves in a second. The real engine
goes through the same commands in tests/real_engine/test_engine_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gym_grpc.engines import local_vllm
from gym_grpc.engines.local_vllm import installation
from tests.support import alive

FAKE_VLLM = Path(__file__).parent / "programs" / "fake_vllm.py"


@dataclass
class Shell:
    """A working directory and an environment in which to run gym-grpc, with a fake prepared engine."""

    cwd: Path
    env: dict[str, str]
    cache: Path
    pids: Path

    def run(self, *args: str, mode: str = "serve") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gym_grpc", *args],
            cwd=self.cwd,
            env={**self.env, "FAKE_VLLM_MODE": mode},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def local_vllm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gym_grpc.engines.local_vllm", *args],
            cwd=self.cwd,
            env={**self.env, "FAKE_VLLM_MODE": "serve"},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def started(self) -> list[int]:
        return [int(line) for line in self.pids.read_text().split()] if self.pids.exists() else []


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    cache = tmp_path / "cache"
    python = cache / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # Keeps vLLM's arguments (-m vllm.entrypoints...), so the process reads as a vLLM to the run file's checks.
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    python.chmod(0o755)
    (cache / "venv" / installation._MARKER).write_text(json.dumps(installation.VENV_SPEC))
    model_dir = cache / "models" / installation.MODEL_NAME
    model_dir.mkdir(parents=True)
    (model_dir / installation._MARKER).write_text(json.dumps(installation._model_spec()))
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "GYM_GRPC_ENGINE_RUN_FILE"}
    pids = tmp_path / "pids"
    env.update(GYM_GRPC_ENGINE_CACHE=str(cache), FAKE_VLLM_PIDS=str(pids))
    yield Shell(cwd, env, cache, pids)
    for pid in Shell(cwd, env, cache, pids).started():  # whatever a failed test left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _models(base_url: str) -> list[str]:
    with urllib.request.urlopen(f"{base_url}/models", timeout=10) as reply:
        return [model["id"] for model in json.loads(reply.read())["data"]]


@pytest.mark.slow
def test_start_writes_env_yaml_keeping_the_users_keys_and_stop_ends_the_engine(shell: Shell) -> None:
    env_yaml = shell.cwd / "env.yaml"
    env_yaml.write_text("# my secrets\nhf_token: hf_abc  # for the Hub\npolicy_model_name: Qwen/Qwen3-4B\n")
    started = shell.run("engine", "start")
    assert started.returncode == 0, started.stderr
    env = yaml.safe_load(env_yaml.read_text())
    assert env["hf_token"] == "hf_abc" and env["policy_api_key"] == "EMPTY"
    assert env["policy_model_name"] == installation.MODEL_NAME
    assert env["policy_chat_template"].endswith("hermes_tools.jinja")  # what the engine was started with
    assert env["policy_keepalive_seconds"] == str(local_vllm.CLIENT_KEEPALIVE_SECONDS)  # under the engine's 300 s
    assert env["policy_base_url"].startswith("http://127.0.0.1:") and env["policy_base_url"].endswith("/v1")
    assert _models(env["policy_base_url"]) == ["fake"]  # the URL written is the engine's
    assert env_yaml.read_text().startswith("# my secrets\nhf_token: hf_abc  # for the Hub\n")
    assert "comments kept" in started.stdout and "gym-grpc run configs/vllm.yaml" in started.stdout
    server, child = shell.started()
    assert f"(pid {server})" in started.stdout

    status = shell.run("engine", "status")
    assert status.returncode == 0
    assert f"base_url: {env['policy_base_url']}\npid: {server}\n" in status.stdout
    assert f"run file: {shell.cache / 'run' / 'vllm.json'}" in status.stdout

    again = shell.run("engine", "start")
    assert again.returncode == 1 and f"already running at {env['policy_base_url']} (pid {server})" in again.stderr
    assert shell.started() == [server, child]  # the refused start started nothing

    stopped = shell.run("engine", "stop")
    assert stopped.returncode == 0 and f"stopped vLLM (pid {server})" in stopped.stdout
    assert not alive(server) and not alive(child)
    after = shell.run("engine", "status")
    assert after.returncode == 1 and after.stdout.startswith("not running")
    assert "nothing to stop" in shell.run("engine", "stop").stdout


@pytest.mark.slow
def test_start_grpc_serves_vllms_grpc_server_and_points_env_yaml_at_it(shell: Shell) -> None:
    started = shell.run("engine", "start", "--grpc")
    assert started.returncode == 0, started.stderr
    env = yaml.safe_load((shell.cwd / "env.yaml").read_text())
    assert env["policy_base_url"].startswith("grpc://127.0.0.1:")  # configs/vllm.yaml then speaks gRPC
    assert env["policy_chat_template"].endswith("hermes_tools.jinja")
    server, _ = shell.started()
    assert "vllm.entrypoints.launchers.grpc_server" in Path(f"/proc/{server}/cmdline").read_text()
    stopped = shell.run("engine", "stop")
    assert stopped.returncode == 0 and not alive(server)


def test_an_engine_that_fails_to_start_is_an_error_with_the_end_of_its_log(shell: Shell) -> None:
    started = shell.run("engine", "start", mode="die")
    assert started.returncode == 1
    assert "exited with status 3 before serving" in started.stderr
    assert "boom, the model did not load" in started.stderr  # the tail of the log
    logs = list((shell.cache / "logs").glob("vllm-*.log"))
    assert len(logs) == 1 and str(logs[0]) in started.stderr
    assert not (shell.cwd / "env.yaml").exists()  # nothing points at an engine that is not there
    assert shell.run("engine", "status").returncode == 1


def test_a_broken_env_yaml_fails_before_the_engine_starts(shell: Shell) -> None:
    (shell.cwd / "env.yaml").write_text("policy_base_url: [unclosed\n")
    started = shell.run("engine", "start")
    assert started.returncode == 1 and "not valid YAML" in started.stderr
    assert shell.started() == []


@pytest.mark.slow
def test_env_file_option_names_the_file_written(shell: Shell) -> None:
    started = shell.run("engine", "start", "--env-file", "secrets/engine.yaml")
    try:
        assert started.returncode == 1 and "cannot write" in started.stderr  # secrets/ does not exist
        assert "vLLM is running" in started.stderr
        (shell.cwd / "secrets").mkdir()
    finally:
        assert shell.run("engine", "stop").returncode == 0
    started = shell.run("engine", "start", "--env-file", "secrets/engine.yaml")
    shell.run("engine", "stop")
    assert started.returncode == 0, started.stderr
    assert set(yaml.safe_load((shell.cwd / "secrets" / "engine.yaml").read_text())) == {
        "policy_base_url",
        "policy_api_key",
        "policy_model_name",
        "policy_tokenizer_dir",
        "policy_chat_template",
        "policy_keepalive_seconds",
    }
    assert "gym-grpc run --env-file secrets/engine.yaml configs/vllm.yaml" in started.stdout


@pytest.mark.slow
def test_a_stale_run_file_neither_refuses_a_start_nor_stops_the_process_that_reused_its_pid(shell: Shell) -> None:
    # A process that is not a vLLM holds the PID in the run file (and process group, as vLLM's would).
    reuser = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        run_file = shell.cache / "run" / "vllm.json"
        run_file.parent.mkdir(parents=True)
        stale = {"base_url": "http://127.0.0.1:9/v1", "pid": reuser.pid, "log_path": "/nowhere", "model": "m"}
        run_file.write_text(json.dumps(stale))
        status = shell.run("engine", "status")
        assert status.returncode == 1 and f"the run file of pid {reuser.pid} is stale" in status.stdout
        stopped = shell.run("engine", "stop")
        assert stopped.returncode == 0 and "is not a running vLLM: nothing to stop" in stopped.stdout
        assert not run_file.exists() and reuser.poll() is None
        run_file.write_text(json.dumps(stale))
        started = shell.run("engine", "start")
        assert started.returncode == 0, started.stderr
        assert shell.run("engine", "stop").returncode == 0
        assert reuser.poll() is None
    finally:
        reuser.kill()
        reuser.wait()


@pytest.mark.slow
def test_gym_grpc_engine_and_python_m_local_vllm_share_one_run_file(shell: Shell) -> None:
    started = shell.local_vllm("start")
    assert started.returncode == 0, started.stderr
    engine = json.loads(started.stdout)
    status = shell.run("engine", "status")
    assert status.returncode == 0 and f"pid: {engine['pid']}\n" in status.stdout
    refused = shell.local_vllm("start")
    assert refused.returncode == 1 and "already running" in refused.stderr
    stopped = shell.run("engine", "stop")
    assert f"stopped vLLM (pid {engine['pid']})" in stopped.stdout
    assert not any(alive(pid) for pid in shell.started())


@pytest.mark.slow
def test_gym_grpc_engine_run_file_variable_keeps_a_second_engine_apart(shell: Shell) -> None:
    first = shell.run("engine", "start")
    assert first.returncode == 0, first.stderr
    apart = Shell(
        shell.cwd, {**shell.env, "GYM_GRPC_ENGINE_RUN_FILE": str(shell.cwd / "mine.json")}, shell.cache, shell.pids
    )
    try:
        assert apart.run("engine", "status").returncode == 1  # it does not see the first engine
        second = apart.run("engine", "start", "--env-file", "mine.yaml")
        assert second.returncode == 0, second.stderr
        first_server, _, second_server, _ = shell.started()
        assert apart.run("engine", "stop").returncode == 0
        assert not alive(second_server) and alive(first_server)  # only its own engine was stopped
    finally:
        shell.run("engine", "stop")
    assert not any(alive(pid) for pid in shell.started())


def test_is_prepared_needs_both_the_virtualenv_and_the_model(shell: Shell) -> None:
    assert installation.is_prepared(shell.cache)
    (shell.cache / "models" / installation.MODEL_NAME / installation._MARKER).unlink()
    assert not installation.is_prepared(shell.cache)
