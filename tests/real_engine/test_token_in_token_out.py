"""Token in, token out on the real CPU vLLM: multi-turn tool rollouts collected with the CLI as a
user would, at temperature 1.0, where re-rendered history parts from the sampled ids.

Every turn after the first must begin with exactly the previous turn's prompt + generated ids;
ids and log-probs must be what the engine sampled (its own detokenizer gives back the text);
tool calls and reasoning must be read from the real generated text; the tool schema must render
to the same ids in every worker process; an edited history must be detected by the real
template.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_grpc import local_vllm

pytestmark = pytest.mark.real_engine

REPO = Path(__file__).resolve().parents[2]
GYM = str(Path(sys.executable).with_name("gym-grpc"))
WEATHER = REPO / "servers/resources/weather"
MULTI_STEP = REPO / "servers/resources/multi_step"


class Stack:
    """`gym-grpc run` of the vLLM config and environments against the engine, in the background."""

    def __init__(self, engine: local_vllm.Engine, directory: Path, *configs: Path, overrides: tuple[str, ...] = ()):
        env_file = directory / "env.yaml"
        env_file.write_text(
            f"policy_base_url: {engine.base_url}\npolicy_api_key: EMPTY\npolicy_model_name: {engine.model}\n"
        )
        self.log = tempfile.NamedTemporaryFile("w+", prefix="gym-grpc-run-", suffix=".log", dir=directory)
        command = [GYM, "run", str(REPO / "configs/vllm.yaml"), *map(str, configs), "registry.port=0", *overrides]
        self.process = subprocess.Popen(
            [*command, "--env-file", str(env_file)], stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        lines = []
        assert self.process.stdout is not None
        for line in self.process.stdout:
            lines.append(line)
            if "servers healthy" in line:
                break
        else:
            self.process.wait(timeout=30)
            pytest.fail("gym-grpc run stopped before it was ready:\n" + "".join(lines) + self.text())
        self.registry = re.search(r"^registry\s+(\S+)", lines[0]).group(1)  # type: ignore[union-attr]

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def collect(self, agent: str, data: Path, output: Path, *args: str) -> list[dict[str, Any]]:
        done = subprocess.run(
            [GYM, "collect", "--agent", agent, "--input", str(data), "--output", str(output)]
            + ["--registry", self.registry, *args],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert done.returncode == 0, done.stderr[-3000:] + self.text()[-3000:]
        return [json.loads(line) for line in output.read_text().splitlines()]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)


@pytest.fixture
def stack(engine: local_vllm.Engine, tmp_path: Path) -> Iterator[Any]:
    started: list[Stack] = []

    def make(*configs: Path, overrides: tuple[str, ...] = ()) -> Stack:
        started.append(Stack(engine, tmp_path, *configs, overrides=overrides))
        return started[-1]

    yield make
    for running in started:
        running.stop()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _carriers(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in row["response"]["output"] if item.get("generation_token_ids")]


def _extension_share(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(turns whose prompt begins with the previous turn's prompt + generated ids, turns after a first)."""
    extending = later = 0
    for row in rows:
        carriers = _carriers(row)
        for earlier, turn in zip(carriers, carriers[1:], strict=False):
            sampled = earlier["prompt_token_ids"] + earlier["generation_token_ids"]
            later += 1
            extending += turn["prompt_token_ids"][: len(sampled)] == sampled
    return extending, later


COMMON = ("temperature=1.0", "tool_choice=required", "parallel_tool_calls=false", "max_output_tokens=160")


def test_multi_turn_tool_rollouts_extend_the_sampled_ids_on_every_turn(engine, stack, tmp_path):
    running = stack(WEATHER / "config.yaml", MULTI_STEP / "config.yaml")
    weather = running.collect(
        "weather_agent", WEATHER / "data/example.jsonl", tmp_path / "w.jsonl", "--num-repeats", "3", *COMMON
    )
    support = running.collect(
        "multi_step_agent", MULTI_STEP / "data/example.jsonl", tmp_path / "m.jsonl", "--num-repeats", "2", *COMMON
    )
    rows = weather + support
    assert len(weather) == 15 and len(support) == 10
    extending, later = _extension_share(rows)
    assert later >= 20, f"only {later} later turns: the test needs multi-turn rollouts"
    assert extending == later
    calls = [item for row in rows for item in row["response"]["output"] if item["type"] == "function_call"]
    assert calls, "tool_choice=required made no tool call"
    for call in calls:  # constrained by the structural tag: JSON that names a tool
        assert isinstance(json.loads(call["arguments"]), dict)
    for row in rows:
        for carrier in _carriers(row):
            assert len(carrier["generation_token_ids"]) == len(carrier["generation_log_probs"]) > 0
            assert all(value <= 0.0 for value in carrier["generation_log_probs"])
    counters = _post_counters(running)
    assert counters.get("non_monotonic_histories", {}) == {}


def _post_counters(running: Stack) -> dict[str, Any]:
    """The policy model server's row of `gym-grpc status --json`."""
    done = subprocess.run(
        [GYM, "status", "--registry", running.registry, "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    return next(row for row in rows if row["name"] == "policy_model")


def test_ids_are_what_the_engine_sampled_and_calls_and_reasoning_come_from_its_text(engine, stack, tmp_path):
    running = stack(WEATHER / "config.yaml")
    rows = running.collect(
        "weather_agent", WEATHER / "data/example.jsonl", tmp_path / "w.jsonl", "--num-repeats", "2", *COMMON
    )
    root = engine.base_url.removesuffix("/v1")
    calls = 0
    for row in rows:
        first = _carriers(row)[0]
        text = _post(f"{root}/detokenize", {"model": engine.model, "tokens": first["generation_token_ids"]})["prompt"]
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
        assert text.endswith("<|im_end|>")  # the turn ended with the template's end-of-turn token
    assert calls >= 3, f"only {calls} of {len(rows)} first turns made a whole call"
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
    row = running.collect("weather_agent", reasoning, tmp_path / "r.jsonl", "temperature=1.0")[0]
    output = row["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    sampled = _post(f"{root}/detokenize", {"model": engine.model, "tokens": output[-1]["generation_token_ids"]})
    thought = output[0]["summary"][0]["text"]
    said = output[1]["content"][0]["text"]
    assert sampled["prompt"].startswith("<think>") and thought and said
    assert thought in sampled["prompt"] and said in sampled["prompt"].split("</think>", 1)[1]


def test_the_tool_schema_renders_to_the_same_ids_in_every_worker(engine, stack, tmp_path):
    running = stack(WEATHER / "config.yaml", overrides=("servers.policy_model.num_workers=2",))
    rows = running.collect(
        "weather_agent", WEATHER / "data/example.jsonl", tmp_path / "w.jsonl", "--num-repeats", "6", *COMMON
    )
    first_prompts: dict[int, set[tuple[int, ...]]] = {}
    for row in rows:
        first_prompts.setdefault(row["task_index"], set()).add(tuple(_carriers(row)[0]["prompt_token_ids"]))
    assert all(len(prompts) == 1 for prompts in first_prompts.values()), {
        task: len(prompts) for task, prompts in first_prompts.items()
    }
    # And they are what the engine's template renders for the row, as another process would ask for it.
    data = [json.loads(line) for line in (WEATHER / "data/example.jsonl").read_text().splitlines()]
    params = data[0]["responses_create_params"]
    tools = [
        {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}
        for tool in params["tools"]
    ]
    rendered = _post(
        f"{engine.base_url.removesuffix('/v1')}/tokenize",
        {"model": engine.model, "messages": params["input"], "tools": tools, "add_generation_prompt": True},
    )["tokens"]
    assert first_prompts[0] == {tuple(rendered)}
