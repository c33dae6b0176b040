"""The real vLLM continues a rollout's trace: its `llm_request` span (queue time, prefill, decode)
is a child of the model server's request to it, in the rollout's one trace.

The session's engine is started with `--otlp-traces-endpoint` at the session's OTLP receiver
(conftest.py), as is the engine .ci/run gives (GYM_GRPC_REAL_ENGINE_TRACES_PORT); another engine given
by URL exports nowhere this test knows, so then it starts one of its own.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.otlp import grpc_receiver, otel_env
from tests.real_engine.conftest import TRACES_PORT_VARIABLE, traced_vllm
from tests.real_engine.gym_cli import VLLM, WEATHER_CONFIG, WEATHER_TASKS, collect_args, env_file, rows
from tests.support import start_run

pytestmark = pytest.mark.real_engine

#: Seconds the engine may take to send its spans once the rollout is done (it sends in batches).
SPANS_WITHIN = 120.0

#: The answer's length does not matter here; uncapped, SmolLM2 can run on to the context's end
#: (4,096 tokens, near three minutes on the CPU engine, which CI saw on one engine state).
MAX_OUTPUT_TOKENS = "max_output_tokens=48"


@pytest.fixture
def traced(engine, engine_traces, tmp_path):
    """(an engine that sends its spans to a receiver, that receiver): the session's, unless it was given
    without saying where it sends its spans."""
    if engine.pid or os.environ.get(TRACES_PORT_VARIABLE):
        yield engine, engine_traces
        return
    with grpc_receiver() as receiver, traced_vllm(receiver, tmp_path / "vllm.log") as own:
        yield own, receiver


def test_vllm_continues_the_trace_of_the_rollout(tmp_path, traced):
    engine, receiver = traced
    env = otel_env(receiver)
    # a process per server, so that each span names the server that made it
    run = start_run(
        "--env-file", str(env_file(engine, tmp_path)), "layout=per_server", configs=(VLLM, WEATHER_CONFIG), env=env
    )
    try:
        output = tmp_path / "rollouts.jsonl"
        args = collect_args(run, "weather_agent", WEATHER_TASKS, output, "--limit", "1", MAX_OUTPUT_TOKENS)
        done = subprocess.run(args, capture_output=True, text=True, timeout=3600, env=env)
        assert done.returncode == 0, done.stderr
    finally:
        assert run.stop() == 0
    assert len(rows(output)) == 1
    (root,) = [s for s in receiver.spans if s["name"] == "rl.sample"]
    deadline = time.monotonic() + SPANS_WITHIN  # bounds a hang, not a timing assertion
    while not any(s["name"] == "llm_request" and s["trace"] == root["trace"] for s in receiver.spans):
        assert time.monotonic() < deadline, "vLLM sent no span of the rollout's requests"
        time.sleep(0.2)
    spans = {s["id"]: s for s in receiver.spans if s["trace"] == root["trace"]}
    generated = [s for s in spans.values() if s["name"] == "llm_request"]
    assert generated, sorted({s["name"] for s in receiver.spans})
    for span in generated:
        parent = spans[span["parent"]]
        assert parent["service"] == "policy_model" and parent["name"].startswith("POST /")
        assert span["attributes"]["gen_ai.usage.completion_tokens"] > 0
        assert "gen_ai.latency.time_in_queue" in span["attributes"]
    orphans = [s["name"] for s in spans.values() if s["parent"] and s["parent"] not in spans]
    assert orphans == []
    assert {s["service"] for s in spans.values()} >= {"gym-grpc-collect", "weather_agent", "policy_model", "vllm"}
