"""The bundled config as a user runs it: `gym-grpc run` and `gym-grpc collect`, real processes throughout.

The example program (the openai SDK) drives the embedded policy through both
APIs; our own agent runs the same tasks beside it, for comparison."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import start_run

HERE = Path(__file__).resolve().parent.parent
TASKS = HERE.parent.parent / "resources" / "weather" / "data" / "example.jsonl"
BIN = Path(sys.executable).parent


def _gym() -> str:
    path = shutil.which("gym-grpc", path=str(BIN)) or shutil.which("gym-grpc")
    assert path, "gym-grpc is not installed: pip install -e '.[test]'"
    return path


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """`gym-grpc run` of the bundled config plus a second external agent on the Responses API."""
    config = tmp_path_factory.mktemp("config") / "both.yaml"
    config.write_text(
        f"include: [{HERE / 'config.yaml'}]\n"
        "servers:\n"
        "  weather_external_responses:\n"
        f"    entrypoint: {HERE / 'agent.py'}:ExternalAgent\n"
        "    config: {model_server: policy_model, resources_server: weather, python: .example_agent:main,\n"
        "             env: {EXAMPLE_AGENT_API: responses}}\n"
    )
    with start_run(configs=(config,)) as run:
        yield run.registry


def _collect(registry: str, agent: str, output: Path, *extra: str) -> list[dict]:
    done = subprocess.run(
        [_gym(), "collect", "--registry", registry, "--agent", agent, "--input", str(TASKS), "--output", str(output)]
        + ["--no-progress", "temperature=0", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "0 failed" in done.stderr, done.stderr
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    return sorted(rows, key=lambda row: row["task_index"])


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["weather_external_agent", "weather_external_responses"])
def test_collect_through_an_openai_sdk_program_records_every_turn_and_scores_as_our_agent(registry, agent, tmp_path):
    ours = _collect(registry, "weather_agent", tmp_path / "ours.jsonl")
    theirs = _collect(registry, agent, tmp_path / "theirs.jsonl")
    assert len(theirs) == len(TASKS.read_text().splitlines())
    # Greedy (temperature 0), the embedded policy decides from the conversation: the program, which
    # rebuilt it in its own API's form, gets the same tool calls, answers and rewards as our agent.
    assert [row["reward"] for row in theirs] == [row["reward"] for row in ours]
    assert [row["model_calls"] for row in theirs] == [row["model_calls"] for row in ours]
    assert any(row["reward"] == 1.0 for row in theirs)
    for row in theirs:
        written = [item for item in row["response"]["output"] if item["type"] in ("function_call", "message")]
        assert len(written) == row["model_calls"]  # one item per turn here: a call, or the answer
        for item in written:  # each turn with what the model saw and sampled
            assert item["prompt_token_ids"] and item["generation_token_ids"]
            assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
        if row["reward"] == 1.0:
            assert [item["type"] for item in row["response"]["output"]] == [
                "function_call",
                "function_call_output",
                "message",
            ]


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["weather_external_agent", "weather_external_responses"])
def test_the_program_asks_each_answer_within_the_tasks_max_output_tokens(registry, agent, tmp_path):
    # Uncapped, the embedded policy's answers here run to 77-79 tokens; a real model's can run on to
    # the end of its context (minutes a call on a CPU engine).
    rows = _collect(registry, agent, tmp_path / "capped.jsonl", "--limit", "2", "max_output_tokens=24")
    assert len(rows) == 2
    for row in rows:
        assert row["response"]["max_output_tokens"] == 24  # what the program's last request asked
        turns = [item for item in row["response"]["output"] if "generation_token_ids" in item]
        assert turns and all(0 < len(item["generation_token_ids"]) <= 24 for item in turns)
