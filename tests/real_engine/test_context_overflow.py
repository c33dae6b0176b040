"""A conversation that does not fit the engine's context (max_model_len 4096) through
vllm_model ends as an incomplete rollout that is scored, never as a failed row.

Two ways to get there, as vLLM 0.32 handles them:

* an input longer than the context: vLLM answers HTTP 400 ("This model's maximum
  context length is 4096 tokens. However, your prompt contains at least 4097 input
  tokens..."); the model server answers an incomplete response with an empty message;
* a generation that runs into the end of the context: with no max_output_tokens (or
  one larger than what is left), vLLM generates up to max_model_len - prompt tokens and
  stops with finish_reason "length"; the prompt and generated ids then fill the context
  exactly.

(A max_output_tokens above max_model_len itself is an HTTP 400 that names
max_model_len: "max_tokens=5000 cannot be greater than max_model_len=4096".)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

CONTEXT = 4096


def test_a_conversation_past_the_context_ends_incomplete_and_is_scored(
    policy: local_vllm.Engine, tmp_path: Path
) -> None:
    """On vLLM's HTTP server and on its gRPC one (`policy`): over gRPC the model server knows the context
    from GetModelInfo and sends no prompt that cannot fit."""
    tasks = gym_cli.rows(gym_cli.WEATHER_TASKS)
    too_long = json.loads(json.dumps(tasks[0]))
    too_long["responses_create_params"]["input"][0]["content"] = "Hello. " * 5000 + "What is the weather in Paris?"
    # A generation that runs into the end of the context: ignore_eos, for the greedy model does not always
    # write on until then (on the gRPC engine it once ended its answer 300 tokens short).
    runs_on = json.loads(json.dumps(tasks[1]))
    runs_on["responses_create_params"]["metadata"] = {"extra_body": json.dumps({"ignore_eos": True})}
    question = runs_on["responses_create_params"]["input"][0]
    question["content"] = "Hello. " * 1800 + question["content"]  # 3,600 tokens: little room left to fill
    output = tmp_path / "out.jsonl"
    with gym_cli.serving(policy, tmp_path, gym_cli.VLLM, gym_cli.WEATHER_CONFIG) as run:
        done = gym_cli.collect(
            run, "weather_agent", gym_cli.tasks_file(tmp_path / "tasks.jsonl", [too_long, runs_on]), output,
            "temperature=0",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not gym_cli.failures(output)
    by_task = {row["task_index"]: row for row in gym_cli.rows(output)}
    assert sorted(by_task) == [0, 1]
    for row in by_task.values():
        assert row["stop_reason"] == "incomplete" and row["reward"] == 0.0 and row["model_calls"] == 1
        assert row["response"]["status"] == "incomplete"
        assert row["response"]["incomplete_details"] == {"reason": "max_output_tokens"}

    [empty] = by_task[0]["response"]["output"]  # the engine refused the prompt: nothing generated
    assert empty["type"] == "message" and empty["status"] == "incomplete"
    assert "".join(part["text"] for part in empty["content"]) == ""
    assert not empty.get("generation_token_ids")

    [full] = by_task[1]["response"]["output"]
    assert full["type"] == "message" and full["status"] == "incomplete"
    assert len(full["prompt_token_ids"]) + len(full["generation_token_ids"]) == CONTEXT
    usage = by_task[1]["response"]["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == CONTEXT
