"""bench/run.py --peer nemo-gym's scripted engine and tasks (the run itself needs NeMo Gym: bench only)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gym_grpc.bundled.servers.resources.math.server import check_answer

REPO = Path(__file__).resolve().parent.parent
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture
def engine(tmp_path):
    port_file = tmp_path / "port"
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / "instant_engine.py"), str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        process.kill()
        process.wait()


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


@pytest.fixture
def peer(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import nemo_gym_peer

    return nemo_gym_peer


def test_the_engine_calls_the_tool_until_the_asked_outputs_are_in_then_answers(engine):
    _post(f"{engine}/bench/reset")
    messages = [{"role": "user", "content": "[3 tool calls] What's the weather in Paris?"}]
    for outputs in range(4):
        answer = _post(f"{engine}/v1/chat/completions", {"messages": messages, "tools": TOOLS})
        message = answer["choices"][0]["message"]
        if outputs < 3:
            assert message["tool_calls"] and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
                "city": "Paris"
            }
            messages += [message, {"role": "tool", "tool_call_id": "x", "content": f"output {outputs}"}]
        else:
            assert not message["tool_calls"] and message["content"] == "According to the tool: output 2"
    with urllib.request.urlopen(f"{engine}/bench/stats", timeout=30) as answer:
        stats = json.loads(answer.read())
    assert stats["calls"] == 4 and stats["first"] <= stats["last"]


def test_without_a_count_the_engine_answers_after_one_tool_output(engine):
    messages = [{"role": "user", "content": "Weather in Tokyo?"}, {"role": "tool", "content": "cold"}]
    message = _post(f"{engine}/v1/chat/completions", {"messages": messages, "tools": TOOLS})["choices"][0]["message"]
    assert message["content"] == "According to the tool: cold"


def test_the_math_rows_are_answered_as_latex_that_math_verify_accepts(engine, peer):
    for row in peer.task_rows("math", 5):
        messages = row["responses_create_params"]["input"]
        text = _post(f"{engine}/v1/chat/completions", {"messages": messages})["choices"][0]["message"]["content"]
        assert "\\frac" in text
        assert check_answer(row["expected_answer"], text, 5)[0]
        assert row["question"] == messages[0]["content"]  # NeMo Gym's math environment reads `question`


def test_multi_turn_rows_are_the_weather_rows_asking_for_three_tool_calls(peer):
    weather, multi = peer.task_rows("weather", 6), peer.task_rows("multi_turn", 6)
    for plain, asking in zip(weather, multi, strict=True):
        text = plain["responses_create_params"]["input"][-1]["content"]
        assert asking["responses_create_params"]["input"][-1]["content"] == f"[3 tool calls] {text}"
        assert asking["responses_create_params"]["tools"] == plain["responses_create_params"]["tools"]


def test_repeats_report_the_run_of_median_rate_with_every_rate_and_all_failures(peer):
    runs = [
        {"rollouts_per_second": 30.0, "failed": 0, "cpu_ms_per_rollout": 3.0},
        {"rollouts_per_second": 10.0, "failed": 2, "cpu_ms_per_rollout": 1.0},
        {"rollouts_per_second": 20.0, "failed": 0, "cpu_ms_per_rollout": 2.0},
    ]
    row = peer._median_run(runs)
    assert row["rollouts_per_second"] == 20.0 and row["cpu_ms_per_rollout"] == 2.0  # one run's figures
    assert row["rollouts_per_second_each"] == [30.0, 10.0, 20.0] and row["failed"] == 2
    assert peer._median_run(runs[:2])["rollouts_per_second"] == 10.0  # even: the lower middle
