"""Token in, token out on the real CPU vLLM: multi-turn tool rollouts collected with the CLI as a
user would, at temperature 1.0, where re-rendered history parts from the sampled ids; each test on
vLLM's HTTP server and on its gRPC server (the `policy` fixture), the HTTP engine's /tokenize and
/detokenize the reference for both.

Every turn after the first must begin with exactly the previous turn's prompt + generated ids;
ids and log-probs must be what the engine sampled (its own detokenizer gives back the text);
tool calls and reasoning must be read from the real generated text; the tool schema must render
to the same ids in every worker process; an edited history must be detected by the real
template.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.engines import local_vllm
from gym_grpc.testing.processes import GymRun
from tests.real_engine.gym_cli import (
    REPO,
    WEATHER_CONFIG,
    WEATHER_TASKS,
    carriers,
    collect,
    extension_share,
    is_grpc,
    post_json,
    rows,
    serving,
)
from tests.support import tool

pytestmark = pytest.mark.real_engine

MULTI_STEP_CONFIG = REPO / "servers/resources/multi_step/config.yaml"
MULTI_STEP_TASKS = REPO / "servers/resources/multi_step/data/example.jsonl"


@pytest.fixture
def stack(policy: local_vllm.Engine, tmp_path: Path) -> Iterator[Any]:
    """stack(*configs, overrides=()): `gym-grpc run configs/vllm.yaml CONFIGS` on the policy engine (vLLM's
    HTTP server, then its gRPC one), for the test."""
    with contextlib.ExitStack() as started:
        yield lambda *configs, overrides=(): started.enter_context(
            serving(policy, tmp_path, REPO / "configs/vllm.yaml", *configs, overrides=overrides)
        )


def _collected(run: GymRun, agent: str, tasks: Path, output: Path, *args: str) -> list[dict[str, Any]]:
    done = collect(run, agent, tasks, output, *args)
    assert done.returncode == 0, done.stderr[-3000:] + run.log()[-3000:]
    return rows(output)


COMMON = ("temperature=1.0", "tool_choice=required", "parallel_tool_calls=false", "max_output_tokens=160")


def test_multi_turn_tool_rollouts_extend_the_sampled_ids_on_every_turn(policy, stack, tmp_path):
    running = stack(WEATHER_CONFIG, MULTI_STEP_CONFIG)
    weather = _collected(running, "weather_agent", WEATHER_TASKS, tmp_path / "w.jsonl", "--num-repeats", "3", *COMMON)
    support = _collected(
        running, "multi_step_agent", MULTI_STEP_TASKS, tmp_path / "m.jsonl", "--num-repeats", "2", *COMMON
    )
    collected = weather + support
    assert len(weather) == 15 and len(support) == 10
    extending, later = extension_share(collected)
    assert later >= 20, f"only {later} later turns: the test needs multi-turn rollouts"
    assert extending == later
    calls = [item for row in collected for item in row["response"]["output"] if item["type"] == "function_call"]
    assert calls, "tool_choice=required made no tool call"
    for call in calls:  # constrained by the structural tag: JSON that names a tool
        assert isinstance(json.loads(call["arguments"]), dict)
    for row in collected:
        for carrier in carriers(row):
            assert len(carrier["generation_token_ids"]) == len(carrier["generation_log_probs"]) > 0
            assert all(value <= 0.0 for value in carrier["generation_log_probs"])
    counters = _post_counters(running)
    assert counters.get("non_monotonic_histories", {}) == {}
    # SmolLM2's byte-level tokenizer and ChatML: every later turn tokenizes only the text it adds.
    assert "later turns tokenize only the text they add" in running.log()
    assert "a later turn was tokenized whole" not in running.log()
    if is_grpc(policy):  # the tokenizer the engine sent, its prompts compared with /tokenize's below
        assert f"prompts rendered here, with the tokenizer {policy.base_url} sent" in running.log()
        return
    # Every prompt of these 25 rollouts was rendered in the model server and checked, id for id,
    # against the engine's own /tokenize (verify_render), the later turns' added ids against what
    # two /tokenize say they add: the two agree on tools, tool calls and their results, multi-turn
    # conversations, reasoning tags and the generation prompt.
    assert "prompts rendered here, with the tokenizer of" in running.log()
    assert "checked against the engine's /tokenize (verify_render)" in running.log()


def _post_counters(running: GymRun) -> dict[str, Any]:
    """The policy model server's row of `gym-grpc status --json`."""
    done = subprocess.run(
        [tool("gym-grpc"), "status", "--registry", running.registry, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return next(row for row in json.loads(done.stdout) if row["name"] == "policy_model")


def test_ids_are_what_the_engine_sampled_and_calls_and_reasoning_come_from_its_text(engine, stack, tmp_path):
    running = stack(WEATHER_CONFIG)
    collected = _collected(running, "weather_agent", WEATHER_TASKS, tmp_path / "w.jsonl", "--num-repeats", "2", *COMMON)
    root = engine.base_url.removesuffix("/v1")
    calls = 0
    for row in collected:
        first = carriers(row)[0]
        text = post_json(f"{root}/detokenize", {"model": engine.model, "tokens": first["generation_token_ids"]})[
            "prompt"
        ]
        if first["type"] != "function_call":  # the call was cut at max_output_tokens: the text as generated
            assert row["response"]["status"] == "incomplete" and "<|im_end|>" not in text
            assert first["content"][0]["text"] == text.strip()
            continue
        calls += 1
        # The engine's own text of the sampled ids holds the call the server parsed from it.
        match = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", text, re.DOTALL)
        assert match, text
        parsed = json.loads(match.group(1))
        assert parsed["name"] == first["name"] == "get_weather"
        assert json.loads(first["arguments"]) == parsed["arguments"]
        # The model ended its turn, or the structural tag did after the one call allowed
        # (parallel_tool_calls=false): then the next prompt closes the turn as the template does.
        assert text.endswith(("<|im_end|>", "</tool_call>")), text
    assert calls >= 3, f"only {calls} of {len(collected)} first turns made a whole call"
    # Reasoning: real output whose shape a regex fixes (SmolLM2 does not reason by itself).
    reasoning = tmp_path / "reasoning.jsonl"
    reasoning.write_text(
        json.dumps(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": "Say hello after thinking."}],
                    "metadata": {
                        "extra_body": json.dumps(
                            {"structured_outputs": {"regex": "<think>[a-z ]{5,40}</think>[A-Za-z ]{3,30}"}}
                        )
                    },
                },
                "expected_city": "Paris",
            }
        )
        + "\n"
    )
    row = _collected(running, "weather_agent", reasoning, tmp_path / "r.jsonl", "temperature=1.0")[0]
    output = row["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    sampled = post_json(f"{root}/detokenize", {"model": engine.model, "tokens": output[-1]["generation_token_ids"]})
    thought = output[0]["summary"][0]["text"]
    said = output[1]["content"][0]["text"]
    assert sampled["prompt"].startswith("<think>") and thought and said
    assert thought in sampled["prompt"] and said in sampled["prompt"].split("</think>", 1)[1]


def test_the_tool_schema_renders_to_the_same_ids_in_every_worker(engine, stack, tmp_path):
    # Only the first turn's prompt is compared: one model call per rollout is all it takes.
    one_turn = ("servers.policy_model.num_workers=2", "servers.weather_agent.config.max_steps=1")
    running = stack(WEATHER_CONFIG, overrides=one_turn)
    collected = _collected(running, "weather_agent", WEATHER_TASKS, tmp_path / "w.jsonl", "--num-repeats", "6", *COMMON)
    first_prompts: dict[int, set[tuple[int, ...]]] = {}
    for row in collected:
        first_prompts.setdefault(row["task_index"], set()).add(tuple(carriers(row)[0]["prompt_token_ids"]))
    assert all(len(prompts) == 1 for prompts in first_prompts.values()), {
        task: len(prompts) for task, prompts in first_prompts.items()
    }
    # And they are what the engine's template renders for the row, as another process would ask for it.
    data = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()]
    params = data[0]["responses_create_params"]
    tools = [
        {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}
        for tool in params["tools"]
    ]
    rendered = post_json(
        f"{engine.base_url.removesuffix('/v1')}/tokenize",
        {"model": engine.model, "messages": params["input"], "tools": tools, "add_generation_prompt": True},
    )["tokens"]
    assert first_prompts[0] == {tuple(rendered)}
