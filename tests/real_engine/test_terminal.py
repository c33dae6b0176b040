"""Terminal tasks on the real CPU vLLM, with an agent program inside each rollout's sandbox.

`gym-grpc run` of configs/vllm.yaml and the terminal environment, then `gym-grpc collect` with
terminal_sandboxed_agent: the external agent starts the openai-SDK example program inside the
rollout's bubblewrap sandbox (SandboxService.Exec, the model endpoint forwarded in), and every turn
SmolLM2-135M takes reaches the engine and comes back with its token ids. What the model scores
does not matter here; that each rollout is recorded, turn by turn, and scored by the task's tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine.gym_cli import REPO, VLLM, carriers, collect, failures, rows, serving, tasks_file

pytestmark = pytest.mark.real_engine

TERMINAL = REPO / "servers" / "resources" / "terminal"


def test_an_agent_program_in_each_rollouts_sandbox_is_recorded_and_scored_on_the_real_engine(
    engine: local_vllm.Engine, tmp_path: Path
) -> None:
    chosen = ("json-config-edit", "python-fix-slugify")
    tasks = tasks_file(
        tmp_path / "tasks.jsonl",
        [row for row in map(json.loads, (TERMINAL / "data" / "example.jsonl").open()) if row["task"] in chosen],
    )
    output = tmp_path / "terminal.jsonl"
    overrides = ("servers.terminal_sandboxed_agent.config.max_steps=4",)
    with serving(engine, tmp_path, VLLM, TERMINAL / "config.yaml", overrides=overrides) as run:
        done = collect(run, "terminal_sandboxed_agent", tasks, output, "max_output_tokens=48")
        assert done.returncode == 0, done.stderr[-3000:] + run.log()[-3000:]
    assert failures(output) == []
    written = rows(output)
    assert sorted(row["task"] for row in written) == sorted(chosen)
    for row in written:
        assert row["reward"] in (0.0, 1.0) and row["reward_file"] == "reward.txt" and not row["tests_timed_out"]
        turns = carriers(row)
        assert len(turns) == row["model_calls"] >= 1
        for turn in turns:
            assert turn["prompt_token_ids"] and turn["generation_token_ids"]
            assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
    print("terminal rollouts:", json.dumps([(r["task"], r["reward"], r["model_calls"]) for r in written]))
