"""What a client in any language can discover on every server before its first call:
health (Check, Watch and List), reflection (v1 and v1alpha, with the .proto comments),
the protocol handshake, and the .proto files shipped with the package."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import zipfile

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.models.openai_model.server import OpenAIModel
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import AgentClient, ModelClient, ResourcesClient
from gym_grpc.client.training import GymClient
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.rpc import protocol, transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server import reflection
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import task_pb2
from tests.support import REPO, Calculator, static_registry, task, tool


async def _grpcurl(*args: str) -> str:
    """grpcurl in a thread: the server under test runs on this event loop."""
    done = await asyncio.to_thread(
        subprocess.run, [tool("grpcurl"), "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_health_list_answers_every_service_and_follows_updates(start):
    server = await start(Calculator())
    async with transport.open_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        listed = await health.List(health_pb2.HealthListRequest(), timeout=30)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert {name: s.status for name, s in listed.statuses.items()} == {
            "": serving,
            "gym.v1.ResourcesService": serving,
            "gym.v1.AdminService": serving,
        }
        await server.health.set("gym.v1.ResourcesService", health_pb2.HealthCheckResponse.NOT_SERVING)
        listed = await health.List(health_pb2.HealthListRequest(), timeout=30)
        assert listed.statuses["gym.v1.ResourcesService"].status == health_pb2.HealthCheckResponse.NOT_SERVING
    by_grpcurl = json.loads(await _grpcurl(server.address, "grpc.health.v1.Health/List"))
    assert by_grpcurl["statuses"][""] == {"status": "SERVING"}


async def _agent(start):
    model = await start(LocalPolicyModel(name="model"))
    env = await start(Calculator(name="calc"))
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "calc"},
        name="agent",
        registry=static_registry(model=model, calc=env),
    )
    running = await start(agent)
    return static_registry(agent=running, model=model, calc=env), running


async def test_server_info_states_the_protocol_version_services_and_capabilities(start):
    registry, _ = await _agent(start)
    agent = await AgentClient(registry, "agent").server_info()
    assert (agent.protocol.major, agent.protocol.minor) == protocol.VERSION
    services = {s.name: {m.name: (m.client_streaming, m.server_streaming) for m in s.methods} for s in agent.services}
    assert services["gym.v1.AgentService"] == {
        "Run": (False, False),
        "RunJson": (False, False),
        "RunStream": (False, True),
        "RunMany": (True, True),
    }
    assert {"gym.v1.AdminService", "grpc.health.v1.Health"} <= set(services)
    assert agent.capabilities.max_receive_message_bytes == transport.MAX_MESSAGE_BYTES
    assert agent.capabilities.max_send_message_bytes == transport.MAX_MESSAGE_BYTES
    assert not agent.capabilities.token_ids and agent.capabilities.max_sessions == 0
    model = await ModelClient(registry, "model").server_info()
    assert model.capabilities.token_ids and model.capabilities.token_in_token_out
    calc = await ResourcesClient(registry, "calc").server_info()
    assert calc.capabilities.max_sessions == Calculator().config.max_sessions > 0
    assert "gym.v1.ResourcesService" in {s.name for s in calc.services}
    await registry.close()


async def test_a_resources_server_states_its_configured_session_cap(start):
    env = await start(Calculator({"max_sessions": 7}, name="calc"))
    registry = static_registry(calc=env)
    assert (await ResourcesClient(registry, "calc").server_info()).capabilities.max_sessions == 7
    await registry.close()


def test_engine_model_servers_declare_token_ids_only_when_they_return_them():
    engine = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}
    assert not OpenAIModel(engine).capabilities().token_ids
    assert not VLLMModel(engine).capabilities().token_in_token_out
    with_ids = VLLMModel({**engine, "return_token_ids": True}).capabilities()
    assert with_ids.token_ids and with_ids.token_in_token_out


async def test_a_client_refuses_an_agent_of_another_major_version_before_any_rollout(start, monkeypatch):
    """The servers run in this process, so the agent is made to answer the handshake as a
    gym-grpc of protocol 2.3 would; the client's own version stays 1.0."""
    registry, agent = await _agent(start)
    monkeypatch.setattr(protocol, "version", lambda: admin_pb.ProtocolVersion(major=2, minor=3))
    async with GymClient("agent", registry) as gym:
        ours = r"\.".join(map(str, protocol.VERSION))
        with pytest.raises(errors.IncompatibleServer, match=rf"agent 'agent' speaks gym protocol 2\.3.*speaks {ours}"):
            await gym.run(task("1 + 1", expected="2"))
        with pytest.raises(errors.IncompatibleServer):  # asked once, refused every time
            await gym.run(task("1 + 1", expected="2"))
    assert agent.app.counters.to_proto().calls_total == 0  # no Run reached the agent
    await registry.close()


async def test_collect_refuses_an_agent_of_another_major_version_before_any_rollout(start, monkeypatch, tmp_path):
    """`gym-grpc collect` is a real process (protocol 1.0); the registry and agent run in this
    one and answer the handshake as a gym-grpc of protocol 2.3 would."""
    registry_app = RegistryServer()
    registry_server = await start(registry_app)
    _, agent = await _agent(start)
    registry_app.servicer.add(reg.ServerInfo(name="agent", role=reg.SERVER_ROLE_AGENT, addresses=[agent.address]))
    monkeypatch.setattr(protocol, "version", lambda: admin_pb.ProtocolVersion(major=2, minor=3))
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    tasks.write_text(json.dumps({"responses_create_params": {"input": "1 + 1"}}) + "\n")
    args = ["collect", "--registry", registry_server.address, "--agent", "agent", "--input", str(tasks)]
    done = await asyncio.to_thread(
        subprocess.run,
        [tool("gym-grpc"), *args, "--output", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "server 'agent' speaks gym protocol 2.3" in done.stderr and "is `gym-grpc run` up" not in done.stderr
    assert agent.app.counters.to_proto().calls_total == 0 and not out.exists()


def test_a_server_that_sends_no_version_is_taken_for_1_0_and_another_major_is_refused():
    protocol.check(admin_pb.GetServerInfoResponse(), "server 'old'")  # from before the handshake
    protocol.check(admin_pb.GetServerInfoResponse(protocol=admin_pb.ProtocolVersion(major=1, minor=9)), "x")
    with pytest.raises(errors.IncompatibleServer, match="server 'new' speaks gym protocol 2.0"):
        protocol.check(admin_pb.GetServerInfoResponse(protocol=admin_pb.ProtocolVersion(major=2)), "server 'new'")


async def test_a_client_runs_rollouts_on_an_agent_of_its_own_major_version(start):
    registry, agent = await _agent(start)
    async with GymClient("agent", registry) as gym:
        result = await gym.run(task("What is 6 times 7?", expected="42"))
    assert result.ok, result.failure
    runs = {m.method: m for m in agent.app.counters.to_proto().methods}["Run"]  # RunMany counts each of its runs
    assert dict(runs.calls_by_status) == {"OK": 1}
    await registry.close()


async def test_reflection_answers_under_v1_and_v1alpha_with_the_proto_comments(start):
    server = await start(Calculator())
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="gym.v1.ResourcesService"),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="gym.v1.NoSuchThing"),
    ]
    async with transport.open_channel(server.address) as channel:
        for name in ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"):
            call = channel.stream_stream(
                f"/{name}/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            listed, described, missing = [reply async for reply in call(iter(asks), timeout=30)]
            names = {s.name for s in listed.list_services_response.service}
            assert {"gym.v1.ResourcesService", *reflection.SERVICE_NAMES} <= names
            files = [
                descriptor_pb2.FileDescriptorProto.FromString(data)
                for data in described.file_descriptor_response.file_descriptor_proto
            ]
            assert files[0].name == "gym/v1/resources_service.proto"
            assert {"google/protobuf/struct.proto", "gym/v1/task.proto"} <= {f.name for f in files}
            comments = " ".join(loc.leading_comments for loc in files[0].source_code_info.location)
            assert "An agent drives one rollout through" in comments
            assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_grpcurl_describe_shows_the_proto_comments(start):
    server = await start(Calculator())
    service = await _grpcurl(server.address, "describe", "gym.v1.ResourcesService")
    assert "A resources server (an environment)." in service
    assert "rpc Verify ( .gym.v1.VerifyRequest ) returns ( .gym.v1.VerifyResponse )" in service
    message = await _grpcurl(server.address, "describe", "gym.v1.Capabilities")
    assert "token in, token out" in message
    health = await _grpcurl(server.address, "describe", "grpc.health.v1.Health")
    assert "rpc List ( .grpc.health.v1.HealthListRequest )" in health
    everything = await _grpcurl(server.address, "describe")  # every listed service, v1 reflection among them
    assert "grpc.reflection.v1.ServerReflection is a service" in everything


def _fields_set(message) -> set[str]:
    """Full names of every field set anywhere in `message`, nested messages included."""
    found = set()
    for field, value in message.ListFields():
        found.add(field.full_name)
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue  # no gym.v1 map holds messages
        for inner in value if field.is_repeated else [value]:
            found |= _fields_set(inner)
    return found


async def test_the_handshake_lists_the_deprecated_fields_the_server_leaves_empty(start):
    """Every server lists them (grpcurl reads the list through reflection too), and what a rollout
    brings back (Run, RunStream's events, Verify, DescribeTools) has none of them set, while the
    fields written in their place are: the verifier's fields, the tools' schemas."""
    registry, agent = await _agent(start)
    listed = sorted(protocol.UNFILLED)
    assert "gym.v1.Rollout.verifier_fields" in listed and "gym.v1.FunctionTool.parameters" in listed
    for client in (AgentClient(registry, "agent"), ModelClient(registry, "model"), ResourcesClient(registry, "calc")):
        assert list((await client.server_info()).unfilled_fields) == listed
    by_grpcurl = json.loads(await _grpcurl(agent.address, "gym.v1.AdminService/GetServerInfo"))
    assert by_grpcurl["unfilled_fields"] == listed

    the_task = task("What is 2 + 3? Use the add tool.")
    the_task.data_json = json.dumps({"expected_answer": "5"})  # as a client of today sends it
    replies = []
    async with transport.open_channel(agent.address) as channel:
        run = await agent_grpc.AgentServiceStub(channel).Run(agent_pb.RunRequest(task=the_task), timeout=60)
        replies.append(run)
        stream = agent_grpc.AgentServiceStub(channel).RunStream(agent_pb.RunStreamRequest(task=the_task), timeout=60)
        replies += [event async for event in stream]
    calc = ResourcesClient(registry, "calc")
    await calc.seed_session("s-unfilled", the_task)
    replies.append(await calc.verify("s-unfilled", the_task, run.rollout.response))
    await calc.close_session("s-unfilled")
    replies.append(await calc.describe_tools())
    written = set().union(*(_fields_set(reply) for reply in replies))
    assert written & set(listed) == set()
    assert {"gym.v1.Rollout.verifier_fields_json", "gym.v1.VerificationEvent.fields_json"} <= written
    assert {"gym.v1.VerifyResponse.fields_json", "gym.v1.FunctionTool.parameters_json"} <= written
    await registry.close()


async def test_a_client_that_reads_a_field_the_server_no_longer_writes_is_refused(start):
    env = await start(Calculator(name="calc"))
    registry = static_registry(calc=env)
    info = await ResourcesClient(registry, "calc").server_info()
    await registry.close()
    with pytest.raises(
        errors.IncompatibleServer,
        match=r"server 'calc' \(gym protocol 1\.\d+\) no longer writes the deprecated gym\.v1\.VerifyResponse\.fields, "
        r"which this client reads; it writes gym\.v1\.VerifyResponse\.fields_json instead",
    ):
        protocol.check(info, "server 'calc'", reads=["gym.v1.VerifyResponse.reward", "gym.v1.VerifyResponse.fields"])
    protocol.check(info, "server 'calc'", reads=["gym.v1.VerifyResponse.reward", "gym.v1.VerifyResponse.fields_json"])
    protocol.check(info, "server 'calc'")  # reads nothing deprecated
    with pytest.raises(ValueError, match="'gym.v1.VerifyResponse.feilds' is not a gym.v1 field"):
        protocol.check(info, "server 'calc'", reads=["gym.v1.VerifyResponse.feilds"])


def test_what_a_server_leaves_empty_is_what_it_lists_or_for_an_older_one_what_1_0_stopped_writing():
    def info(minor: int, unfilled: list[str] | None = None) -> admin_pb.GetServerInfoResponse:
        return admin_pb.GetServerInfoResponse(
            protocol=admin_pb.ProtocolVersion(major=1, minor=minor), unfilled_fields=unfilled or []
        )

    reads = ["gym.v1.Task.data"]
    for older in (admin_pb.GetServerInfoResponse(), info(0), info(5)):  # none of them sends a list
        assert protocol.unfilled(older) == set(protocol.UNFILLED)
        with pytest.raises(errors.IncompatibleServer, match="no longer writes the deprecated gym.v1.Task.data"):
            protocol.check(older, "x", reads=reads)
    protocol.check(info(6), "x", reads=reads)  # a 1.6 server that lists nothing writes them all
    later = info(9, ["gym.v1.Rollout.reward"])  # a field deprecated after this client was built
    with pytest.raises(errors.IncompatibleServer, match=r"gym.v1.Rollout.reward, which this client reads; see what"):
        protocol.check(later, "x", reads=["gym.v1.Rollout.reward"])


def test_each_unfilled_field_is_deprecated_and_names_a_field_that_is_not():
    pool = descriptor_pool.Default()
    for name, field in protocol.UNFILLED.items():
        assert pool.FindFieldByName(name).GetOptions().deprecated, name
        instead = pool.FindFieldByName(field.instead)
        assert not instead.GetOptions().deprecated and instead.containing_type.full_name == name.rpartition(".")[0]
        assert field.since <= protocol.VERSION


def test_the_wheel_ships_protos_that_compile_on_their_own(tmp_path):
    """The wheel is built from a copy of the source (the checkout stays clean) and unpacked,
    not installed; `python -m gym_grpc.protos` runs from it, and protoc gets only that copy
    and its own well-known types (google/protobuf/*.proto) as include paths."""
    source = tmp_path / "source"
    for name in ("gym_grpc", "servers", "configs", "proto"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    built = subprocess.run([*build, "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    with zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))) as wheel:
        wheel.extractall(tmp_path / "site")
    assert (tmp_path / "site" / "gym_grpc" / "v1" / "descriptor_set.binpb").is_file()  # reflection reads it
    out = tmp_path / "protos"
    copied = subprocess.run(
        [sys.executable, "-m", "gym_grpc.protos", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )
    assert copied.returncode == 0, copied.stderr
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.proto"))
    assert {"gym/v1/agent_service.proto", "grpc/health/v1/health.proto", "google/rpc/error_details.proto"} <= set(names)
    assert {p.name for p in (REPO / "proto" / "gym" / "v1").glob("*.proto")} == {
        n.removeprefix("gym/v1/") for n in names if n.startswith("gym/v1/")
    }
    (tmp_path / "stubs").mkdir()
    compiled = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{out}", f"--python_out={tmp_path / 'stubs'}"]
        + [f"--descriptor_set_out={tmp_path / 'all.binpb'}", *names],
        capture_output=True,
        text=True,
    )
    assert compiled.returncode == 0, compiled.stderr
    described = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "all.binpb").read_bytes())
    services = {f"{f.package}.{s.name}": [m.name for m in s.method] for f in described.file for s in f.service}
    assert services["gym.v1.AdminService"][0] == "GetServerInfo"
    assert "List" in services["grpc.health.v1.Health"]
    assert "BadRequest" in {m.name for f in described.file if f.package == "google.rpc" for m in f.message_type}


class _BareAgent(agent_grpc.AgentServiceServicer):
    """An agent written without gym-grpc: AgentService only, no AdminService to shake hands with."""

    async def Run(self, request, context):
        return agent_pb.RunResponse(rollout=task_pb2.Rollout(reward=1.0))


async def test_an_agent_without_the_handshake_is_taken_as_it_comes():
    server = grpc.aio.server()
    agent_grpc.add_AgentServiceServicer_to_server(_BareAgent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with GymClient("agent", Registry(static={"agent": f"127.0.0.1:{port}"})) as gym:
            result = await gym.run(task("1 + 1", expected="2"))
        assert result.ok and result.reward == 1.0
    finally:
        await server.stop(0)
