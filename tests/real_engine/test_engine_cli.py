"""`gym-grpc engine start|status|stop` with the real CPU vLLM, as a user runs them.

The engine's virtualenv and model are the prepared ones (GYM_GRPC_ENGINE_CACHE
as given); the run file is the test's own (GYM_GRPC_ENGINE_RUN_FILE), so the
test neither refuses to start because of an engine in someone else's run file nor
stops it. It starts its own vLLM, not the session's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from gym_grpc.engines.local_vllm import installation

pytestmark = pytest.mark.real_engine

_SCRIPT = Path(sys.executable).with_name("gym-grpc")
GYM_GRPC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gym_grpc"]


def _gym_grpc(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GYM_GRPC_ENGINE_RUN_FILE": str(tmp_path / "run" / "vllm.json")}
    return subprocess.run([*GYM_GRPC, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _group(pgid: int) -> list[str]:
    """The names of the live (not zombie) processes in the group: vLLM runs in its own, with its engine core."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended meanwhile
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            names.append(name)
    return names


def _group_alive(pgid: int) -> bool:
    return bool(_group(pgid))


def test_engine_start_points_env_yaml_at_a_serving_vllm_and_stop_ends_it(tmp_path: Path) -> None:
    env_file = tmp_path / "secrets.yaml"
    env_file.write_text("# mine\nhf_organization: my-org  # for dataset upload\n")
    started = _gym_grpc(tmp_path, "engine", "start", "--env-file", env_file.name, timeout=1200)
    try:
        assert started.returncode == 0, f"{started.stdout}\n{started.stderr}"
        env = yaml.safe_load(env_file.read_text())
        assert env["hf_organization"] == "my-org" and env_file.read_text().startswith("# mine\n")
        assert env["policy_api_key"] == "EMPTY"
        assert env["policy_model_name"] == installation.MODEL_NAME
        with urllib.request.urlopen(f"{env['policy_base_url']}/models", timeout=30) as reply:
            assert [m["id"] for m in json.loads(reply.read())["data"]] == [installation.MODEL_NAME]
        status = _gym_grpc(tmp_path, "engine", "status")
        assert status.returncode == 0 and f"base_url: {env['policy_base_url']}\n" in status.stdout
        pid = int(status.stdout.split("pid: ")[1].split()[0])
        # The model runs in the engine core, not in a worker process that the engine core would wait
        # for by spinning on a core of its own (gym_grpc/engines/local_vllm/process.py).
        names = _group(pid)
        assert "VLLM::EngineCor" in names and not any(name.startswith("VLLM::Worker") for name in names), names
        # vLLM's ZeroMQ sockets are in a directory of this engine's own, which stop removes.
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        sockets = Path(environ["VLLM_RPC_BASE_PATH"])
        assert sockets.name.startswith("gym-vllm-") and any(path.is_socket() for path in sockets.iterdir())
    finally:
        stopped = _gym_grpc(tmp_path, "engine", "stop", timeout=60)
    assert stopped.returncode == 0 and f"stopped vLLM (pid {pid})" in stopped.stdout
    assert not _group_alive(pid)
    assert not sockets.exists()
    assert _gym_grpc(tmp_path, "engine", "status").returncode == 1
