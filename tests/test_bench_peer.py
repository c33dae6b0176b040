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


def _stats(engine: str) -> dict:
    with urllib.request.urlopen(f"{engine}/bench/stats", timeout=30) as answer:
        return json.loads(answer.read())


def test_the_token_path_reads_the_turn_from_the_prompt_ids_and_calls_the_tool_as_hermes_writes_it(engine):
    """The engine's /tokenize renders what /v1/completions then answers from ids alone: the tool
    named in the prompt, called until the asked outputs are in, then the answer."""
    _post(f"{engine}/bench/reset")
    messages = [{"role": "user", "content": "[2 tool calls] What's the weather in Paris?"}]
    for outputs in range(3):
        prompt = _post(f"{engine}/tokenize", {"messages": messages, "tools": TOOLS, "add_generation_prompt": True})
        body = {"prompt": prompt["tokens"], "logprobs": 0, "return_token_ids": True}
        choice = _post(f"{engine}/v1/completions", body)["choices"][0]
        assert choice["prompt_token_ids"] == prompt["tokens"]
        assert choice["token_ids"][-1] == 257 and len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
        if outputs < 2:
            call = json.loads(choice["text"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [{"function": {**call, "arguments": "{}"}}]},
                {"role": "tool", "content": f"output {outputs}"},
            ]
        else:
            assert choice["text"] == "According to the tool: output 1"
    stats = _stats(engine)
    assert stats["calls"] == 3 and stats["tokenize"] == 3 and len(stats["times"]) == 3


def test_the_engine_honours_a_required_prefix_and_counts_the_calls_that_send_one(engine):
    _post(f"{engine}/bench/reset")
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = _post(f"{engine}/v1/chat/completions", {"messages": messages, "tools": TOOLS, "return_token_ids": True})
    prefix = [*first["prompt_token_ids"], 7, 7, 7]
    body = {"messages": messages, "tools": TOOLS, "return_token_ids": True, "required_prefix_token_ids": prefix}
    second = _post(f"{engine}/v1/chat/completions", body)
    assert second["prompt_token_ids"][: len(prefix)] == prefix
    assert _stats(engine)["prefixed"] == 1


def test_the_steady_rate_counts_the_calls_between_the_10_and_90_percent_marks_in_rollouts(peer):
    # A slow start (a call a second for 10 s), then 100 calls a second; 4 calls a rollout: 25 rollouts/s.
    times = [float(i) for i in range(10)] + [10 + i / 100 for i in range(900)]
    assert peer.steady_rate(times, 4.0) == pytest.approx(25.0)
    assert peer.steady_rate([1.0, 2.0], 4.0) is None  # too few to tell


def test_each_gym_grpc_run_is_4000_rollouts_or_16000_calls_and_nemo_gyms_3000_model_calls(peer):
    assert peer.rows_per_run("gym_grpc_default", "weather", 64) == 4000
    assert peer.rows_per_run("gym_grpc_one_process", "weather", 8192) == 8192  # never fewer than in flight
    assert peer.rows_per_run("gym_grpc_default", "long_horizon", 64) == 1000  # or 16,000 model calls
    assert peer.rows_per_run("nemo_gym", "weather", 64) == 1500  # 2 calls each
    assert peer.rows_per_run("nemo_gym", "long_horizon", 64) == 188  # 16 calls each
    assert peer.rows_per_run("nemo_gym", "multi_turn", 4096) == 4096


def test_the_long_horizon_rows_ask_for_fifteen_tool_calls(peer):
    text = peer.task_rows("long_horizon", 1)[0]["responses_create_params"]["input"][-1]["content"]
    assert text.startswith("[15 tool calls] ")


def test_the_tables_show_each_layout_run_and_a_dash_for_a_layout_a_workload_did_not_run(peer):
    def run(rate: float, cpu: float) -> dict:
        return {
            "rollouts": 4000,
            "seconds": 4.0,
            "rollouts_per_second": rate * 0.9,
            "steady_rollouts_per_second": rate,
            "cpu_ms_per_rollout": cpu,
            "cpu_ms_per_model_call": cpu / 4,
            "engine_cpu_ms_per_rollout": 0.5,
            "failed": 0,
            "mean_reward": 1.0,
        }

    ours, theirs = run(1000.0, 2.0), run(50.0, 30.0)
    row = {
        "in_flight": 64,
        "nemo_gym": theirs,
        "gym_grpc_default": ours,
        "ratio_gym_grpc_default_over_nemo_gym": peer._ratio(ours, theirs),
        "gym_grpc_one_process": ours,
        "ratio_gym_grpc_one_process_over_nemo_gym": peer._ratio(ours, theirs),
    }
    workload = {
        "workload": "tokens",
        "model_calls": 4,
        "path": "token in / token out",
        "layouts": ["gym_grpc_default", "gym_grpc_one_process"],
        "ready_seconds": {"gym_grpc_default": 1.0, "gym_grpc_one_process": 1.0, "nemo_gym": 12.0},
        "idle": {},
        "runs": [row],
    }
    result = {"workloads": [workload], "nemo_gym_install": {"versions": {}, "python": "3.13", "commands": []}}
    summary = peer.summary(result)
    assert "| tokens (4 calls) | 64 | 1,000 / – / 1,000; 50.0 | **20.0×** / – / **20.0×** |" in summary
    assert peer.table(result).count("| tokens (4 calls) | 64 |") == 3  # default, one process, NeMo Gym
