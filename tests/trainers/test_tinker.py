"""tinker-cookbook's RL rollouts over gym-grpc environments (gym_grpc.adapters.tinker).

tinker-cookbook's own rollout code (`do_group_rollout`, its rollout strategies,
`EnvFromMessageEnv`, the qwen3_instruct renderer) drives our Env and EnvGroupBuilder
against real resources servers from `gym-grpc run`. The policy is a `TokenCompleter`
of our own: a scripted one, and the real CPU vLLM with SmolLM2 (the renderer's ChatML
is SmolLM2's). Tinker's service, which samples and trains for `tinker_cookbook.rl.train`,
needs an API key and the network; it is not used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.engines import local_vllm
from gym_grpc.testing.processes import GymRun
from tests.real_engine.gym_cli import post_json
from tests.support import REPO, start_run

pytestmark = pytest.mark.trainers

LOCAL_POLICY = REPO / "configs" / "local_policy.yaml"
WEATHER = REPO / "servers" / "resources" / "weather" / "config.yaml"
MATH = REPO / "servers" / "resources" / "math" / "config.yaml"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _weather_task(city: str) -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"What's the weather like in {city} right now?"}],
            "tools": [WEATHER_TOOL],
        },
        "expected_city": city,
    }


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def servers() -> Any:
    run = start_run(configs=(LOCAL_POLICY, WEATHER, MATH))
    yield run
    run.stop()


def _scripted_policy(model_dir: Path, in_flight: list[int]) -> Any:
    """A TokenCompleter that asks get_weather for the city in the question, then reports the
    temperature the tool returned; it records how many rollouts hold a slot at each call."""
    from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
    from transformers import AutoTokenizer

    from gym_grpc.client import rollouts_in_flight

    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # its own: the renderers' is used from threads
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    class ScriptedWeather(TokenCompleter):
        async def __call__(self, model_input: Any, stop: Any, *, max_tokens: int | None = None) -> Any:
            in_flight.append(rollouts_in_flight())
            seen = tokenizer.decode(model_input.to_ints())
            responses = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", seen, re.S)
            if responses:
                text = f"It is {json.loads(responses[-1])['temperature_c']} C there."
            else:
                city = re.findall(r"weather like in (.+?) right now", seen)[-1]
                call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
                text = f"<tool_call>\n{call}\n</tool_call>"
            tokens = [*tokenizer.encode(text, add_special_tokens=False), end]
            return TokensWithLogprobs(tokens=tokens, maybe_logprobs=[-0.5] * len(tokens))

    return ScriptedWeather()


def said_by_tinker(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What tinker-cookbook's rollout strategies logged about failed trajectories."""
    return [r.getMessage() for r in caplog.records if r.name == "tinker_cookbook.rl.rollout_strategy"]


def _answer_policy(model_dir: Path, text: str) -> Any:
    """A TokenCompleter that answers `text` to anything."""
    from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]

    class Answer(TokenCompleter):
        async def __call__(self, model_input: Any, stop: Any, *, max_tokens: int | None = None) -> Any:
            return TokensWithLogprobs(tokens=list(tokens), maybe_logprobs=[-0.5] * len(tokens))

    return Answer()


async def test_group_rollouts_of_training_and_evaluation_share_one_logged_limit(
    servers: GymRun, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tinker_cookbook.rl.rollouts import do_group_rollout

    from gym_grpc.adapters.tinker import GymDatasetBuilder, GymEnvGroupBuilder
    from gym_grpc.client import rollouts_in_flight

    caplog.set_level(logging.INFO, logger="gym_grpc.client.training")
    builder = GymDatasetBuilder(
        registry=servers.registry,
        resources="weather",
        train_tasks=_write(tmp_path / "train.jsonl", [_weather_task("Paris"), _weather_task("Tokyo")]),
        eval_tasks=_write(tmp_path / "eval.jsonl", [_weather_task("Lima"), _weather_task("Oslo")]),
        renderer_name="qwen3_instruct",
        tokenizer=str(model_dir),
        group_size=2,
        batch_size=2,
        max_concurrent_rollouts=2,
    )
    train, evaluation = await builder()
    assert evaluation is not None and len(train) == len(evaluation) == 1
    groups = [*train.get_batch(0), *evaluation.get_batch(0)]
    assert all(pickle.loads(pickle.dumps(g)).row == g.row for g in groups)  # tinker ships builders to workers
    assert isinstance(groups[0], GymEnvGroupBuilder)
    in_flight: list[int] = []
    policy = _scripted_policy(model_dir, in_flight)

    # Training's groups and evaluation's, all at once, as a trainer that evaluates while it trains.
    results = await asyncio.gather(*(do_group_rollout(group, policy) for group in groups))

    assert [len(r.trajectories_G) for r in results] == [2, 2, 1, 1]
    for result in results:
        assert result.rollout_errors == []
        assert result.get_total_rewards() == [1.0] * len(result.trajectories_G)
        for trajectory in result.trajectories_G:
            first, second = trajectory.transitions
            assert first.reward == 0.0 and not first.episode_done and first.metrics["tool_calls"] == 1
            assert second.episode_done and second.metrics["gym_reward"] == 1.0
            assert second.ob.length > first.ob.length + len(first.ac.tokens)  # the tool's output came in between
    # Six rollouts of two tool-calling turns each, never more than two holding a slot at once.
    assert len(in_flight) == 12 and max(in_flight) == 2 and min(in_flight) >= 1
    assert rollouts_in_flight() == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Concurrency]")]
    assert said == ["[Concurrency] Set max concurrent rollouts to 2"]


async def test_a_rollout_the_environment_fails_is_dropped_by_tinkers_strategy_never_scored_zero(
    servers: GymRun, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tinker_cookbook.exceptions import AllTrajectoriesFailedError
    from tinker_cookbook.rl.rollout_strategy import MinViableGroup, RetryOnFailure
    from tinker_cookbook.rl.rollouts import do_group_rollout

    from gym_grpc.adapters.tinker import GymEnvGroupBuilder
    from gym_grpc.client import rollouts_in_flight
    from gym_grpc.errors import GymError

    # The math environment refuses to verify a task without expected_answer: every rollout fails.
    no_answer = {"responses_create_params": {"input": "What is 2 + 2? Put the final answer in \\boxed{}."}}
    group = GymEnvGroupBuilder(
        registry=servers.registry,
        resources="math",
        row=no_answer,
        group_size=2,
        renderer_name="qwen3_instruct",
        tokenizer=str(model_dir),
    )
    policy = _answer_policy(model_dir, "\\boxed{4}")
    with pytest.raises(AllTrajectoriesFailedError) as dropped:
        await do_group_rollout(group, policy, strategy=MinViableGroup(min_successful=1, max_retries=0))
    assert "0/2 rollouts succeeded" in str(dropped.value)
    said = said_by_tinker(caplog)
    assert len(said) == 2 and all("INVALID_ARGUMENT: task.data.expected_answer" in m for m in said)
    with pytest.raises(GymError, match="expected_answer"):
        await do_group_rollout(group, policy)  # FailFast, tinker's default
    caplog.clear()
    # Retried in fresh envs (make_envs again, mid-group), then re-raised for the caller to skip the group.
    with pytest.raises(GymError, match="expected_answer"):
        await do_group_rollout(group, policy, strategy=RetryOnFailure(max_retries=2))
    assert any("Retry budget exhausted (2 retries)" in m for m in said_by_tinker(caplog))
    assert rollouts_in_flight() == 0  # every failed rollout gave its slot back


async def test_smollm2_on_the_cpu_vllm_drives_the_math_environment_through_tinkers_rollouts(
    engine: local_vllm.Engine, servers: GymRun, model_dir: Path
) -> None:
    """The policy is the real model: its samples, with the engine's log-probs, scored by the math env."""
    from tinker_cookbook.completers import TokenCompleter, TokensWithLogprobs
    from tinker_cookbook.rl.rollouts import do_group_rollout

    from gym_grpc.adapters.tinker import GymEnvGroupBuilder

    class EnginePolicy(TokenCompleter):
        async def __call__(self, model_input: Any, stop: Any, *, max_tokens: int | None = None) -> Any:
            body = {
                "model": engine.model,
                "prompt": model_input.to_ints(),
                "max_tokens": max_tokens or 48,
                "temperature": 1.0,
                "seed": 7,
                "logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "stop_token_ids": list(stop),
            }
            choice = (await asyncio.to_thread(post_json, f"{engine.base_url}/completions", body))["choices"][0]
            stop_reason = "length" if choice["finish_reason"] == "length" else "stop"
            tokens = list(choice["token_ids"])
            return TokensWithLogprobs(tokens, choice["logprobs"]["token_logprobs"], stop_reason=stop_reason)

    task = {
        "responses_create_params": {"input": "What is 1 + 1? Put the final answer in \\boxed{}."},
        "expected_answer": "2",
    }
    group = GymEnvGroupBuilder(
        registry=servers.registry,
        resources="math",
        row=task,
        group_size=2,
        renderer_name="qwen3_instruct",
        tokenizer=str(model_dir),
        max_generation_tokens=48,
    )
    result = await do_group_rollout(group, EnginePolicy())
    assert len(result.trajectories_G) == 2 and result.rollout_errors == []
    for trajectory, reward in zip(result.trajectories_G, result.get_total_rewards(), strict=True):
        for transition in trajectory.transitions:
            assert transition.ac.tokens and len(transition.ac.logprobs) == len(transition.ac.tokens)
            assert all(lp <= 0.0 for lp in transition.ac.logprobs) and any(lp < 0.0 for lp in transition.ac.logprobs)
        transition = trajectory.transitions[-1]
        assert transition.episode_done
        # A finished answer is scored by the environment (0 or 1); one cut at 48 tokens gets
        # EnvFromMessageEnv's own overflow reward and never reaches it.
        if transition.ac.stop_reason == "stop":
            assert transition.metrics["gym_reward"] == reward and reward in (0.0, 1.0)
        else:
            assert transition.metrics.get("max_tokens_reached") == 1.0
