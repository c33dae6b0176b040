"""openai_model (configs/openai.yaml) against vLLM's own /v1/responses: weather and math
rollouts collected with the gym-grpc command, as a user pointing it at a local vLLM would.

What works against vLLM 0.32's Responses endpoint: messages, tools, parsed tool calls
(function_call items, vLLM's call ids), a second-turn input with a function_call and
its function_call_output, string input, system messages, reasoning items in the input
(a trajectory of a reasoning model; this model emits none itself), usage, an incomplete
answer (max_output_tokens), and output_text log-probs asked for with `include`. What
does not: no token ids (the Responses API has none; use vllm_model for training).

Greedy, this model runs on after its </tool_call> until max_output_tokens: with 128
(and 400) tokens vLLM answers "incomplete" and still parses the call into a
function_call item (status "completed"); the agent ends the rollout there, as
incomplete, without calling the tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_grpc.bundled.servers.resources.weather.server import forecast
from gym_grpc.engines import local_vllm
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

TRAINING_FIELDS = {"prompt_token_ids", "generation_token_ids", "generation_log_probs"}


def _check_usage(response: dict) -> None:
    usage = response["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def _check_scored(row: dict) -> None:
    """Scored, and finished as the response says: completed, or incomplete at max_output_tokens."""
    assert row["reward"] in (0.0, 1.0)
    response = row["response"]
    if response["status"] == "incomplete":
        assert row["stop_reason"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert response["status"] == "completed" and row["stop_reason"] == "final_message"
    for item in response["output"]:
        assert not TRAINING_FIELDS & set(item), "the Responses API gives no token ids"
        assert item["type"] != "reasoning", "this model emits no reasoning"


def test_weather_rollouts_parse_tool_calls_and_take_their_outputs_back(
    engine: local_vllm.Engine, tmp_path: Path
) -> None:
    tasks = gym_cli.rows(gym_cli.WEATHER_TASKS)
    # A conversation the model already called the tool in: the input of a second turn.
    second_turn = json.loads(json.dumps(tasks[0]))
    second_turn["responses_create_params"]["input"] += [
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": json.dumps(forecast("Paris"))},
    ]
    tasks.append(second_turn)
    output = tmp_path / "weather.jsonl"
    with gym_cli.serving(engine, tmp_path, gym_cli.OPENAI, gym_cli.WEATHER_CONFIG) as run:
        # One at a time and greedy: the same answers whatever else the engine is doing.
        done = gym_cli.collect(
            run, "weather_agent", gym_cli.tasks_file(tmp_path / "tasks.jsonl", tasks), output,
            "--max-in-flight", "1", "temperature=0", "max_output_tokens=400",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    by_task = {row["task_index"]: row for row in gym_cli.rows(output)}
    assert sorted(by_task) == list(range(6))
    for row in by_task.values():
        _check_scored(row)
        _check_usage(row["response"])
        assert row["model_calls"] == 1
    # Task 3 (Buenos Aires): the call is parsed from an answer cut at max_output_tokens, and
    # not run: the rollout ends with the incomplete turn.
    [call] = by_task[3]["response"]["output"]
    assert by_task[3]["response"]["status"] == "incomplete"
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("chatcmpl-tool-")  # vLLM's call id, kept
    assert json.loads(call["arguments"]) == {"city": "Barcelona"}
    for index in (0, 1, 2, 4, 5):
        [message] = by_task[index]["response"]["output"]
        assert message["type"] == "message" and message["content"][0]["text"]
    # The second-turn input (function_call, function_call_output) was accepted and answered.
    assert by_task[5]["response"]["status"] == "completed"


def test_math_rollouts_with_reasoning_input_and_logprobs(engine: local_vllm.Engine, tmp_path: Path) -> None:
    tasks = gym_cli.rows(gym_cli.MATH_TASKS)
    earlier = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "One plus one."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{2}"}]},
        {"role": "user", "content": "What is 2 + 2? Put the final answer in \\boxed{}."},
    ]
    tasks.append({"responses_create_params": {"input": earlier}, "expected_answer": "4"})
    output = tmp_path / "math.jsonl"
    with gym_cli.serving(engine, tmp_path, gym_cli.OPENAI, gym_cli.MATH_CONFIG) as run:
        done = gym_cli.collect(
            run, "math_agent", gym_cli.tasks_file(tmp_path / "tasks.jsonl", tasks), output,
            "temperature=0", "max_output_tokens=128", 'include=["message.output_text.logprobs"]', "top_logprobs=0",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = gym_cli.rows(output)
    assert sorted(row["task_index"] for row in written) == list(range(len(tasks)))
    for row in written:
        _check_scored(row)
        _check_usage(row["response"])
        assert row["model_calls"] == 1
        [message] = row["response"]["output"]
        [text] = message["content"]
        # One log-prob per generated token, the closing <|im_end|> among them (it is not in the
        # text) unless the answer was cut at max_output_tokens.
        end = "" if row["response"]["status"] == "incomplete" else "<|im_end|>"
        assert len(text["logprobs"]) == row["response"]["usage"]["output_tokens"]
        assert "".join(entry["token"] for entry in text["logprobs"]) == text["text"] + end
