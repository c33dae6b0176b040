"""The handshake: which version of the gym protocol a server speaks and what it can do.

`AdminService.GetServerInfo` answers it on every server (see
admin_service.proto, field by field). A client in any language calls it once
before its first rollout and refuses a server whose major version differs
from its own; `clients.AgentClient` does before its first rollout.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import descriptor_pool

from gym_grpc import errors
from gym_grpc.rpc import transport
from gym_grpc.v1 import admin_service_pb2 as admin_pb

#: Version of the gym protocol this package speaks: (major, minor). The major
#: version is the package's (gym.v1); the minor grows with each addition.
#: 1.1: CallToolResponse.is_error (a tool that raised is answered OK, not ABORTED).
#: 1.2: replicas: ServerInfo.replicas and RegistryService.WatchServer;
#:      SeedSessionResponse.replica (session affinity); GetServerInfoResponse.instance_id.
#: 1.3: every worker process of a server: Replica.workers (pid, metrics address, restarts);
#:      GetServerInfoResponse.worker and .metrics_address (Prometheus).
#: 1.4: policy versions for async training: Run/RunStream/RunJsonRequest.policy_version,
#:      CreateResponseRequest.policy_version, ModelService.SetPolicyVersion, the assistant
#:      items' policy_version and Rollout.policy_version.
#: 1.5: AgentService.RunMany (many runs over one call).
VERSION = (1, 5)


def version() -> admin_pb.ProtocolVersion:
    """This package's protocol version as the handshake sends it."""
    return admin_pb.ProtocolVersion(major=VERSION[0], minor=VERSION[1])


def served(service_names: Iterable[str], pool: descriptor_pool.DescriptorPool) -> list[admin_pb.ServedService]:
    """The services (with their methods) a server serves, sorted by name, from their descriptors."""
    services = []
    for name in sorted(set(service_names)):
        descriptor = pool.FindServiceByName(name)
        methods = [
            admin_pb.ServedMethod(name=m.name, client_streaming=m.client_streaming, server_streaming=m.server_streaming)
            for m in descriptor.methods
        ]
        services.append(admin_pb.ServedService(name=name, methods=methods))
    return services


def methods(info: admin_pb.GetServerInfoResponse, service: str) -> set[str]:
    """The methods of `service` a server says it serves (none when it does not serve it)."""
    return {m.name for s in info.services if s.name == service for m in s.methods}


def base_capabilities() -> admin_pb.Capabilities:
    """What every server holds to, whatever its role: the message size limits."""
    return admin_pb.Capabilities(
        max_receive_message_bytes=transport.MAX_MESSAGE_BYTES, max_send_message_bytes=transport.MAX_MESSAGE_BYTES
    )


def check(info: admin_pb.GetServerInfoResponse, where: str) -> None:
    """Raise IncompatibleServer when the server's major version is not ours.

    A server that sends no version (major 0) predates the handshake and speaks 1.0."""
    major = info.protocol.major or 1
    if major != VERSION[0]:
        raise errors.IncompatibleServer(
            f"{where} speaks gym protocol {major}.{info.protocol.minor} (gym-grpc {info.version or '?'}); "
            f"this client speaks {VERSION[0]}.{VERSION[1]}: run a gym-grpc whose protocol major version "
            "matches on both sides",
            metadata={"server_protocol": f"{major}.{info.protocol.minor}"},
        )
