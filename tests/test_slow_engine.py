"""`gym-grpc collect` with its defaults against an engine that serves fewer calls at once than it
is sent (a real engine on a CPU makes 10-20 tokens a second): the rollouts wait, they do not fail.

Real processes: `gym-grpc run` of the quickstart whose embedded policy answers 2 calls at a time,
each after 0.5 s (4 calls a second, as a queueing engine would), and `gym-grpc collect` as a user
runs it, with its default window of 4,096. Before, all 60 rollouts started at once and waited in the
engine's queue on their deadlines: those served last failed (the same on the real CPU vLLM: 139 of 139).
"""

from __future__ import annotations

import json

import pytest

from tests.support import WEATHER, collect_args, gym, read_rows, start_run


@pytest.mark.slow
def test_a_collection_against_an_engine_slower_than_its_window_waits_instead_of_failing(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    rows = WEATHER.read_text().splitlines()
    tasks.write_text("".join(rows[i % len(rows)] + "\n" for i in range(60)))
    out = tmp_path / "out.jsonl"
    with start_run(
        "servers.policy_model.config.latency_seconds=0.5", "servers.policy_model.config.max_concurrent_calls=2"
    ) as run:
        # ~108 model calls at 4 a second: ~27 s of the engine's time; each rollout may take 20 s
        done = gym(*collect_args(run.registry, "weather_agent", tasks, out), "--timeout", "20", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert len(read_rows(out)) == 60
    assert json.loads(done.stdout)["weather_agent"]["rollouts"] == 60
