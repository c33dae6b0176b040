"""TLS, mutual TLS and the bearer token, in process and through `gym-grpc run`."""

import asyncio
import json
import logging
import os
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security, TlsSettings
from gym_grpc.server.serving import serve
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from tests.certs import make_certs
from tests.support import MATH, REPO, Calculator, ScriptedModel, gym, say, start_run, task, tool


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _serve(security):
    server = await serve(Calculator(name="calc"), security=security)
    return server


async def _call(address: str, security: Security | None):
    client = ResourcesClient(Registry(static={"calc": address}, security=security), "calc", timeout=5)
    try:
        await client.seed_session("s", task("x"))
        return await client.call_tool("s", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
    finally:
        await client.registry.close()


async def test_a_call_without_the_token_is_unauthenticated():
    server = await _serve(Security(token="s3cret-token"))
    try:
        with pytest.raises(errors.GymError) as error:
            await _call(server.address, None)
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(errors.GymError) as error:
            await _call(server.address, Security(token="wrong"))
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED and "s3cret" not in error.value.message
        assert (await _call(server.address, Security(token="s3cret-token"))).output == "3"
        async with transport.open_channel(server.address) as channel:  # health stays open, for probes
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0.5)


async def test_a_streaming_call_carries_the_token():
    security = Security(token="s3cret-token")
    model = await serve(ScriptedModel([say("3")]), security=security)
    env = await serve(Calculator(name="calc"), security=security)
    peers = Registry(static={"model": model.address, "calc": env.address}, security=security)
    agent = await serve(
        SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=peers),
        security=security,
    )
    client = AgentClient(Registry(static={"agent": agent.address}, security=security), "agent")
    try:
        events = [event async for event in client.run_stream(task("1 + 2?", expected_answer=3), timeout=10)]
        assert events[-1].rollout.reward == 1.0
    finally:
        await client.registry.close()
        for server in (agent, env, model):
            await server.stop(0.5)


async def test_a_refused_call_is_logged_with_its_peer_and_method(caplog):
    caplog.set_level(logging.WARNING, logger="gym_grpc.rpc.security")
    agent = SimpleAgent({"model_server": "m", "resources_server": "calc"}, name="agent")
    server = await serve(agent, security=Security(token="s3cret-token"))
    client = AgentClient(Registry(static={"agent": server.address}, security=Security(token="wrong")), "agent")
    try:
        with pytest.raises(errors.GymError) as error:
            async for _ in client.run_stream(task("x"), timeout=10):
                pass
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await client.registry.close()
        await server.stop(0.5)
    refused = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(refused) == 1
    # The client's first call is the protocol handshake, refused like any other.
    assert "/gym.v1.AdminService/GetServerInfo" in refused[0] and "127.0.0.1" in refused[0]
    assert "wrong bearer token" in refused[0] and "s3cret" not in refused[0]


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.slow
async def test_an_unauthenticated_huge_message_is_refused_without_being_read(tmp_path):
    """A 200 MB request without the token: the server process (a real `gym-grpc run`) refuses it
    from the metadata alone. Its peak memory does not grow by the message, and the log says who."""
    config = tmp_path / "weather.yaml"
    config.write_text(f"servers:\n  weather:\n    entrypoint: {REPO}/servers/resources/weather/server.py:WeatherEnv\n")
    token = "s3cret-token"
    run = start_run(f"security.token={token}", configs=(config,))
    size = 200 * 1024 * 1024
    try:
        address = run.servers["weather"]
        async with transport.open_channel(address, security=Security(token=token)) as channel:
            info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=10)
        before = _peak_rss_kb(info.pid)
        huge = res_pb.CallToolRequest(session_id="s", name="get_weather", arguments="x" * size)
        async with transport.open_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await res_grpc.ResourcesServiceStub(channel).CallTool(huge, timeout=120)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        grown = _peak_rss_kb(info.pid) - before
        assert grown * 1024 < size / 4, f"the server's peak RSS grew by {grown} kB"
        deadline = time.monotonic() + 30
        while "refused /gym.v1.ResourcesService/CallTool from ipv4:127.0.0.1:" not in run.log():
            assert time.monotonic() < deadline, run.log()
            await asyncio.sleep(0.1)
        assert "missing bearer token" in run.log()
    finally:
        run.stop()


async def test_a_plaintext_client_cannot_talk_to_a_tls_server(certs):
    tls = TlsSettings(ca=certs.ca, cert=certs.server[0], key=certs.server[1])
    server = await _serve(Security(tls=tls))
    try:
        with pytest.raises(errors.Unavailable):
            await _call(server.address, None)
        assert (await _call(server.address, Security(tls=TlsSettings(ca=certs.ca)))).output == "3"
    finally:
        await server.stop(0.5)


async def test_mutual_tls_refuses_a_client_without_a_certificate_from_the_ca(certs):
    tls = TlsSettings(ca=certs.ca, cert=certs.server[0], key=certs.server[1], require_client_cert=True)
    server = await _serve(Security(tls=tls))
    try:
        for refused in (
            TlsSettings(ca=certs.ca),
            TlsSettings(ca=certs.ca, cert=certs.stranger[0], key=certs.stranger[1]),
        ):
            with pytest.raises(errors.Unavailable):
                await _call(server.address, Security(tls=refused))
        accepted = TlsSettings(ca=certs.ca, cert=certs.client[0], key=certs.client[1])
        assert (await _call(server.address, Security(tls=accepted))).output == "3"
    finally:
        await server.stop(0.5)


def test_a_missing_certificate_file_is_a_clear_config_error(tmp_path):
    with pytest.raises(errors.ConfigError, match="security.tls.cert: cannot read"):
        Security(tls=TlsSettings(cert=str(tmp_path / "nope.pem"), key=str(tmp_path / "k.pem"))).server_credentials()


@pytest.mark.slow
def test_tls_and_token_through_gym_grpc_run_and_secrets_stay_out_of_logs(certs, tmp_path):
    token = "tok-" + "9f3a7c1e5b" * 3
    env = tmp_path / "env.yaml"
    env.write_text(f"gym_token: {token}\npolicy_api_key: sk-also-secret-1234\n")
    settings = [
        "security.tls.ca=" + certs.ca,
        "security.tls.cert=" + certs.server[0],
        "security.tls.key=" + certs.server[1],
        "security.tls.require_client_cert=true",
        "security.token=${gym_token}",
    ]
    run = start_run(*settings, "--env-file", str(env))
    try:
        client = ["--ca", certs.ca, "--cert", certs.client[0], "--key", certs.client[1]]
        args = ["collect", "--registry", run.registry, "--agent", "math_agent", "--input", str(MATH), "--no-progress"]
        refused = gym(*args, "--output", str(tmp_path / "refused.jsonl"), *client)  # no token
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        done = gym(*args, "--output", str(tmp_path / "out.jsonl"), *client, env={**os.environ, "GYM_GRPC_TOKEN": token})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["math_agent"]["rollouts"] == 6
        status = gym(
            "status", "--registry", run.registry, "--json", *client, env={**os.environ, "GYM_GRPC_TOKEN": token}
        )
        assert all(row["health"] == "serving" for row in json.loads(status.stdout))
        plain = subprocess.run(
            [tool("grpcurl"), "-plaintext", "-max-time", "3", run.registry, "list"], capture_output=True, text=True
        )
        assert plain.returncode != 0  # TLS only
    finally:
        run.stop()
    logs = run.log() + refused.stderr + done.stderr + status.stderr
    assert token not in logs and "sk-also-secret-1234" not in logs
    dumped = gym("dump-config", str(REPO / "configs/quickstart.yaml"), *settings, "--env-file", str(env)).stdout
    assert token not in dumped and "token: '***'" in dumped and certs.ca in dumped
