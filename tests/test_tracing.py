"""OpenTelemetry traces (gym_grpc/tracing.py): one trace per rollout, across the processes it passes.

The receiver is a real OTLP/gRPC endpoint in the test's process (opentelemetry-proto's
TraceService, the protocol every OTel collector speaks); the processes are a real `gym-grpc run`
(agent, embedded policy model server and weather environment, each in its own process) and a real
`gym-grpc collect`, configured only by the standard OTEL_* variables.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gym_grpc import tracing
from gym_grpc.testing.processes import GymRun
from tests.otlp import Receiver, grpc_receiver, http_receiver, otel_env
from tests.support import REPO, WEATHER, collect_args, gym

WEATHER_CONFIG = REPO / "servers" / "resources" / "weather" / "config.yaml"
LOCAL_POLICY = REPO / "configs" / "local_policy.yaml"


@pytest.fixture
def receiver():
    with grpc_receiver() as received:
        yield received


@pytest.fixture
def http_receiver_():
    with http_receiver() as received:
        yield received


def _one_traced_rollout(receiver: Receiver, tmp_path, *overrides: str) -> tuple[list[dict], dict]:
    """Collect one weather rollout through a traced `gym-grpc run` (with `overrides`) and a traced
    `gym-grpc collect` (service "trainer"); the spans of its trace, checked to be one tree, and its root."""
    env = otel_env(receiver)
    output = tmp_path / "rollouts.jsonl"
    # A policy that does not slip: the rollout calls get_weather, then answers.
    configs = (LOCAL_POLICY, WEATHER_CONFIG, "servers.policy_model.config.error_rate=0", *overrides)
    with GymRun.start(*configs, env=env) as run:
        collect = [*collect_args(run.registry, "weather_agent", WEATHER, output), "--limit", "1", "--no-progress"]
        done = gym(*collect, env={**env, "OTEL_SERVICE_NAME": "trainer"})
        assert done.returncode == 0, done.stderr
        assert run.stop() == 0  # the servers send their last spans as they stop
    assert json.loads(output.read_text())["reward"] == 1.0

    roots = [s for s in receiver.spans if s["name"] == "rl.sample"]
    assert len(roots) == 1, [s["name"] for s in receiver.spans]
    root = roots[0]
    spans = [s for s in receiver.spans if s["trace"] == root["trace"]]
    ids = {s["id"] for s in spans}
    assert [s for s in spans if not s["parent"]] == [root]
    orphans = [s["name"] for s in spans if s["parent"] and s["parent"] not in ids]
    assert orphans == []
    return spans, root


def test_servers_of_one_process_group_pass_the_trace_on_in_process(receiver, tmp_path):
    """Servers of one `process:` group call each other without gRPC: the trace goes with the
    in-process call's metadata, and the rollout is still one tree (two processes now)."""
    group = [f"servers.{name}.process=rollout" for name in ("policy_model", "weather", "weather_agent")]
    spans, root = _one_traced_rollout(receiver, tmp_path, *group)
    assert {s["service"] for s in spans} == {"trainer", "rollout"}
    names = [s["name"] for s in spans]
    assert names.count("gym.v1.ModelService/CreateResponse") == 2
    assert names.count("gym.v1.ResourcesService/CallTool") == 1
    assert names.count("gym.v1.ResourcesService/Verify") == 1


@pytest.mark.parametrize("over", ["receiver", "http_receiver_"])
def test_one_rollout_is_one_trace_across_the_collector_agent_model_server_and_environment(over, request, tmp_path):
    """A rollout's spans, exported by four processes, form one tree: one root (the collector's
    rl.sample), every other span's parent in the trace, with the queue wait, each model call with
    its token counts, the tool call and the verification. OTLP over gRPC, and over HTTP."""
    receiver = request.getfixturevalue(over)
    spans, root = _one_traced_rollout(receiver, tmp_path, "layout=per_server")
    by_id = {s["id"]: s for s in spans}
    services = {s["service"] for s in spans}
    assert services == {"trainer", "weather_agent", "policy_model", "weather"}
    assert len({s["pid"] for s in spans}) == 4

    def children(span: dict) -> list[str]:
        return sorted(s["name"] for s in spans if s["parent"] == span["id"])

    def one(name: str) -> dict:
        found = [s for s in spans if s["name"] == name]
        assert len(found) == 1, f"{name}: {len(found)} spans in {sorted(s['name'] for s in spans)}"
        return found[0]

    assert root["service"] == "trainer"
    assert root["attributes"]["rl.reward.score"] == 1.0
    assert root["attributes"]["gym_grpc.agent"] == "weather_agent"
    assert children(root) == ["gym.v1.AgentService/Run", "gym_grpc.queue_wait"]
    run_span = one("gym.v1.AgentService/Run")
    assert run_span["service"] == "weather_agent"
    # The weather environment is stateless: no SeedSession, no CloseSession.
    assert children(run_span) == [
        *["chat"] * 2,
        "execute_tool get_weather",
        "gym.v1.ResourcesService/DescribeTools",  # asked once, by the agent's first rollout
        "gym_grpc.verify",
    ]
    model_calls = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert len(model_calls) == 2  # the tool call, then the answer
    for call in model_calls:
        assert call["parent"] == run_span["id"]
        assert call["attributes"]["gen_ai.usage.input_tokens"] > 0
        assert call["attributes"]["gen_ai.usage.output_tokens"] > 0
        assert children(call) == ["gym.v1.ModelService/CreateResponse"]
    served = [s for s in spans if s["name"] == "gym.v1.ModelService/CreateResponse"]
    assert {s["service"] for s in served} == {"policy_model"}
    tool = one("execute_tool get_weather")
    assert tool["parent"] == run_span["id"]
    assert tool["attributes"]["gen_ai.tool.name"] == "get_weather"
    assert children(tool) == ["gym.v1.ResourcesService/CallTool"]
    assert by_id[tool["id"]]["service"] == "weather_agent"
    verify = one("gym_grpc.verify")
    assert verify["parent"] == run_span["id"]
    assert verify["attributes"]["rl.reward.score"] == 1.0
    assert children(verify) == ["gym.v1.ResourcesService/Verify"]
    assert one("gym.v1.ResourcesService/Verify")["service"] == "weather"
    assert sum(root["attributes"][f"rl.sample.{k}_tokens"] for k in ("input", "output")) == sum(
        c["attributes"][f"gen_ai.usage.{k}_tokens"] for c in model_calls for k in ("input", "output")
    )


async def test_the_model_server_sends_its_trace_to_the_engine_as_traceparent(start):
    """The model server's request to its engine carries W3C `traceparent`: the trace of the call
    it serves, with the engine request's span as parent, for vLLM (--otlp-traces-endpoint) to
    continue. The engine is gym_grpc/testing/fake_engine.py, an HTTP server in this process that
    records the headers it gets; the spans go to the SDK's in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
    from gym_grpc.client.stubs import ModelClient
    from gym_grpc.testing import static_registry
    from gym_grpc.testing.fake_engine import FakeEngine, Turn
    from gym_grpc.v1 import model_service_pb2 as model_pb
    from gym_grpc.v1 import responses_pb2 as r

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    engine = FakeEngine([Turn(content="5")])
    base_url = await engine.start()
    tracing.use_provider(provider)
    try:
        server = await start(VLLMModel({"base_url": base_url, "model": "policy"}, name="model"))
        client = ModelClient(static_registry(model=server), "model")
        request = model_pb.CreateResponseRequest(session_id="s")
        request.params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text="2 + 3?"))
        with provider.get_tracer("test").start_as_current_span("rollout") as rollout:
            await client.send(request)
    finally:
        tracing.use_provider(None)
        await engine.stop()
    spans = {span.name: span for span in exported.get_finished_spans()}
    served = spans["gym.v1.ModelService/CreateResponse"]
    to_engine = next(span for name, span in spans.items() if name.startswith("POST "))
    assert served.parent.span_id == rollout.get_span_context().span_id
    assert to_engine.parent.span_id == served.context.span_id
    assert to_engine.attributes["gen_ai.usage.output_tokens"] > 0
    sent = [headers.get("traceparent") for headers in engine.headers if "traceparent" in headers]
    trace_id = f"{rollout.get_span_context().trace_id:032x}"
    assert len(sent) == 1
    version, sent_trace, parent, flags = sent[0].split("-")
    assert (version, sent_trace, parent) == ("00", trace_id, f"{to_engine.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled


async def test_a_model_server_sends_its_trace_to_a_vllm_grpc_engine_as_metadata(tmp_path):
    """Toward vLLM's gRPC server the trace goes as `traceparent` metadata of Generate, its parent the
    engine request's span, which carries the token counts. The engine is
    gym_grpc/testing/fake_vllm_grpc.py, a grpc.aio server in this process recording the metadata."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from smg_grpc_proto import vllm_engine_pb2 as pb

    from gym_grpc.engines.settings import EngineSettings
    from gym_grpc.engines.vllm_grpc import GrpcEngine
    from gym_grpc.testing.fake_engine import FakeEngine, Turn, write_tokenizer
    from gym_grpc.testing.fake_vllm_grpc import FakeGrpcEngine

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    fake = FakeGrpcEngine(FakeEngine([Turn(content="5")]), write_tokenizer(tmp_path / "tok"))
    base_url = await fake.start()
    link = GrpcEngine(base_url, EngineSettings(base_url=[base_url], model="p"))
    tracing.use_provider(provider)
    try:
        with provider.get_tracer("test").start_as_current_span("model call"):
            complete = await link.generate([1, 2, 3], pb.SamplingParams(max_tokens=4))
    finally:
        tracing.use_provider(None)
        await link.close()
        await fake.stop()
    (to_engine,) = [s for s in exported.get_finished_spans() if s.name.endswith("/Generate")]
    assert to_engine.attributes["gen_ai.usage.input_tokens"] == 3
    assert to_engine.attributes["gen_ai.usage.output_tokens"] == complete.completion_tokens > 0
    (sent,) = [m["traceparent"] for m in fake.metadata]
    assert sent.split("-")[1:3] == [f"{to_engine.context.trace_id:032x}", f"{to_engine.context.span_id:016x}"]


async def test_a_gym_client_rollout_is_one_trace_under_the_programs_span_with_its_session():
    """A trainer's GymClient, with the program's own tracer provider: each rollout is an rl.sample
    span under the span the program has current, with its queue wait, and everything the rollout
    does on a stateful environment is in its trace, the session's close too (a durable run closes
    it after its result went out, from the RunMany call's task)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gym_grpc.agent import ToolLoopAgent
    from gym_grpc.client.training import GymClient
    from gym_grpc.testing import Calculator, ScriptedModel, Servers, calculator_task, call, say, static_registry

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracing.use_provider(provider)
    try:
        async with Servers() as servers:
            model = await servers.start(ScriptedModel([[call("add", '{"a": 2, "b": 3}')], say("5")]))
            env = await servers.start(Calculator(name="calc"))
            config = {"model_server": "model", "resources_server": "calc"}
            registry = static_registry(model=model, calc=env)
            agent = await servers.start(ToolLoopAgent(config, name="agent", registry=registry))
            async with GymClient("agent", static_registry(agent=agent)) as client:
                with provider.get_tracer("trainer").start_as_current_span("train step") as step:
                    result = await client.run(calculator_task("2 + 3?", expected_answer="5"))
    finally:
        tracing.use_provider(None)
    assert result.ok and result.reward == 1.0
    spans = [s for s in exported.get_finished_spans() if s.context.trace_id == step.get_span_context().trace_id]
    by_id = {s.context.span_id: s for s in spans}
    names = sorted(s.name for s in spans)
    assert [s.name for s in spans if s.parent is None] == ["train step"]
    assert [s.name for s in spans if s.parent is not None and s.parent.span_id not in by_id] == []
    (sample,) = [s for s in spans if s.name == "rl.sample"]
    assert sample.parent.span_id == step.get_span_context().span_id
    assert sample.attributes["rl.reward.score"] == 1.0 and sample.attributes["rl.sample.turns"] == 2
    (run,) = [s for s in spans if s.name == "gym.v1.AgentService/Run"]
    assert by_id[run.parent.span_id].name == "rl.sample"
    for method in ("SeedSession", "CallTool", "Verify", "CloseSession"):
        assert f"gym.v1.ResourcesService/{method}" in names, names
    (close,) = [s for s in spans if s.name == "gym.v1.ResourcesService/CloseSession"]
    assert close.parent.span_id == run.context.span_id
    assert "gym_grpc.queue_wait" in names


_UNTRACED_ROLLOUT = """
import asyncio, sys
from gym_grpc.agent import ToolLoopAgent
from gym_grpc.client.training import GymClient
from gym_grpc.testing import Calculator, ScriptedModel, Servers, call, say, static_registry
from gym_grpc.testing import calculator_task

async def main():
    async with Servers() as servers:
        model = await servers.start(ScriptedModel([[call("add", '{"a": 2, "b": 3}')], say("5")]))
        env = await servers.start(Calculator(name="calc"))
        config = {"model_server": "model", "resources_server": "calc"}
        registry = static_registry(model=model, calc=env)
        agent = await servers.start(ToolLoopAgent(config, name="agent", registry=registry))
        async with GymClient("agent", static_registry(agent=agent)) as client:
            result = await client.run(calculator_task("2 + 3?", expected_answer="5"))
    assert result.ok and result.reward == 1.0, result
    assert not [m for m in sys.modules if m.startswith("opentelemetry")], "OpenTelemetry was imported"

asyncio.run(main())
"""


def test_with_tracing_off_nothing_is_exported_and_opentelemetry_is_never_imported(receiver, tmp_path):
    """OTEL_TRACES_EXPORTER unset (the default): a rollout through an agent, a model server and an
    environment, with an OTLP endpoint configured, exports nothing and never imports OpenTelemetry."""
    env = otel_env(receiver)
    del env["OTEL_TRACES_EXPORTER"]
    script = tmp_path / "rollout.py"
    script.write_text(_UNTRACED_ROLLOUT)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert receiver.spans == []


def test_a_traced_process_without_an_exporter_package_says_which_to_install(monkeypatch):
    """An exporter name nothing installed provides is a clear error, not traces silently lost."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin_json_nonexistent")
    with pytest.raises(ValueError, match="no exporter 'zipkin_json_nonexistent' is installed"):
        tracing._exporters()
