"""vLLM stopped and started again on its port in the middle of a collection through vllm_model.

What really happens (vLLM 0.32 CPU, configs/vllm.yaml: max_retries 5):

* SIGTERM reaches vLLM's API server and its engine core (one process group). The
  requests in flight are answered HTTP 500 "EngineCore encountered an issue" by the
  API server while it shuts down (or their connection drops); then connections are
  refused. gym-grpc retries the 500 as a server_error and the refusals as connect
  failures.
* startup_wait_seconds does not apply: the engine has answered before. Five connect
  retries back off 0.5 + 1 + 2 + 4 + 8 s, jittered down to half, so a request gives up
  after 7.75 to 15.5 s of waiting, and vLLM takes longer than that to start again. Every
  rollout that reaches the model while it is down fails UNAVAILABLE, naming the engine;
  the collector moves on to the next rows, which fail the same way until the engine
  serves again, and those after it are collected.
* Nothing hangs, and the failures sidecar lists exactly the keys missing from the
  output; the same collect command run again collects exactly those.

The new engine is started only once a failure is recorded, so that the collection
surely meets the engine down, however fast or loaded the machine is.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

ROWS = 40


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def _wait_for(condition: Callable[[], bool], collector: subprocess.Popen, what: str) -> None:
    """Until `condition` holds; fail if the collector ends first."""
    while not condition():
        assert collector.poll() is None, f"collect ended ({collector.returncode}) before {what}"
        time.sleep(0.2)


def test_an_engine_restarted_mid_collection_costs_unavailable_rows_that_a_rerun_completes(tmp_path: Path) -> None:
    first = local_vllm.start(log_path=tmp_path / "vllm-1.log")
    engines = [first]
    try:
        port = int(first.base_url.removesuffix("/v1").rsplit(":", 1)[1])
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(gym_cli.WEATHER_TASKS.read_text() * (ROWS // 5))
        output, sidecar = tmp_path / "out.jsonl", tmp_path / "out.failures.jsonl"
        with gym_cli.serving(first, tmp_path, gym_cli.VLLM, gym_cli.WEATHER_CONFIG) as run:
            args = gym_cli.collect_args(
                run, "weather_agent", tasks, output, "--max-in-flight", "8", "temperature=0", "max_output_tokens=64"
            )
            with (tmp_path / "collect.log").open("w") as log:
                collector = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
            try:
                _wait_for(lambda: _lines(output) >= 8, collector, "8 rows were written")
                local_vllm.stop(first.pid)
                _wait_for(lambda: _lines(sidecar) >= 1, collector, "a rollout failed on the stopped engine")
                engines.append(local_vllm.start(log_path=tmp_path / "vllm-2.log", port=port))
                returncode = collector.wait(timeout=3600)  # a bound on a hang, not a timing claim
            finally:
                if collector.poll() is None:
                    collector.kill()
            report = (tmp_path / "collect.log").read_text()
            written, failed = gym_cli.rows(output), gym_cli.rows(sidecar)
            assert returncode == 1, report
            written_keys = [(row["task_index"], row["repeat_index"]) for row in written]
            failed_keys = [(row["task_index"], row["repeat_index"]) for row in failed]
            # Each key once: collected or failed, never both, none lost.
            assert sorted(written_keys + failed_keys) == [(t, 0) for t in range(ROWS)], report
            for row in failed:
                error = row["error"]
                assert error["code"] == "UNAVAILABLE", error
                # The engine by its address: /v1/completions, or /tokenize at its root (token path).
                assert f"engine {first.base_url.removesuffix('/v1')}/" in error["message"], error
                assert "gave up after 5 connect retries" in error["message"], error
            assert f"{len(written)} rollouts collected, {len(failed)} failed" in report

            again = subprocess.run(args, capture_output=True, text=True, timeout=3600)
            assert again.returncode == 0, again.stderr
            assert f"{len(failed)} rollouts collected, 0 failed, {len(written)} already done" in again.stderr
        keys = [(row["task_index"], row["repeat_index"]) for row in gym_cli.rows(output)]
        assert sorted(keys) == [(t, 0) for t in range(ROWS)]
        assert gym_cli.rows(output)[: len(written)] == written  # the first run's rows are kept as they were
    finally:
        for engine in engines:
            local_vllm.stop(engine.pid)
