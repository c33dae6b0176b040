"""The handshake: which version of the gym protocol a server speaks and what it can do.

`AdminService.GetServerInfo` answers it on every server (see
admin_service.proto, field by field). A client in any language calls it once
before its first rollout and refuses a server whose major version differs
from its own; `clients.AgentClient` does before its first rollout. A client
that reads a deprecated field also checks that the server still writes it
(`check(info, where, reads=[...])`); docs/changes.md holds the policy and every
version.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from google.protobuf import descriptor_pool

from gym_grpc import errors
from gym_grpc.rpc import transport
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import agent_service_pb2, resources_service_pb2  # noqa: F401  (every gym.v1 message, for reads)

#: Version of the gym protocol this package speaks: (major, minor). The major
#: version is the package's (gym.v1); the minor grows with each addition.
#: docs/changes.md says what each one changed on the wire (a test keeps it in step).
#: 1.0: the handshake: GetServerInfoResponse.protocol, .services and .capabilities (a server
#:      that sends no version speaks 1.0).
#: 1.1: CallToolResponse.is_error (a tool that raised is answered OK, not ABORTED).
#: 1.2: replicas: ServerInfo.replicas and RegistryService.WatchServer;
#:      SeedSessionResponse.replica (session affinity); GetServerInfoResponse.instance_id.
#: 1.3: every worker process of a server: Replica.workers (pid, metrics address, restarts);
#:      GetServerInfoResponse.worker and .metrics_address (Prometheus).
#: 1.4: policy versions for async training: Run/RunStream/RunJsonRequest.policy_version,
#:      CreateResponseRequest.policy_version, ModelService.SetPolicyVersion, the assistant
#:      items' policy_version and Rollout.policy_version.
#: 1.5: AgentService.RunMany (many runs over one call).
#: 1.6: GetServerInfoResponse.unfilled_fields (the deprecated fields a server no longer writes).
#: 1.7: GetCountersResponse.sessions_open (resources servers) and .sessions_not_closed (agents).
#: 1.8: ModelService.UpdateWeights, the items' policy_version_spans, GetCountersResponse.turns_caught_by_update.
#: 1.9: durable rollouts: RunRequest.rollout_id and resume, RunMany checkpoints and parking, ResumeSession, tool calls
#: with an idempotency key and an attempt, DescribeToolsResponse.session_recovery, Capabilities.resumable_rollouts.
#: 1.10: sandboxes: SandboxService, Capabilities.sandboxes, GetCountersResponse.sandboxes and .sandbox_start_failures.
#: 1.11: images by value and by reference: InputImage.data, .media_type and .sha256; CallToolResponse.parts.
#: 1.12: episodes with several roles: SeedSessionResponse.episode, ResourcesService.EndTurn,
#:       VerifyResponse.role_rewards, Rollout.roles, STOP_REASON_EPISODE_OVER.
#: 1.13: trainer services: TaskService (task_service.proto) and SERVER_ROLE_TASKS; STOP_REASON_TOKEN_BUDGET
#:       (an agent's token budget for the whole trajectory, max_rollout_tokens); GetCountersResponse.engines
#:       (EngineLoad: each engine's KV cache usage, requests running and waiting, preemptions);
#:       RunManyItem.trace_context (a run's W3C trace context).
#: 1.14: Worker.address: a worker process's own port, which SeedSessionResponse.replica names when a
#:       replica's workers share one (sessions stay in the process that opened them).
#: 1.15: RunManyResponse.load (WorkerLoad: the agent process's CPU and its CPU pools' use), by which a client
#:       fills an agent's worker processes in turn while the first has room.
#: 1.16: RunManyItem.acknowledge_result and RunManyRequest.received_ids: a durable run's session is closed once
#:       its client says it has the result, not once the result is written.
#: 1.17: RunManyItem.acknowledge_turns, RunCheckpoint.acknowledge and RunManyRequest.checkpoints_read: a durable
#:       run's tool calls are made once its client has the turn that asked for them.
#: 1.18: RunManyRequest.confirm_received and RunManyResponse.received_confirmed: the acknowledgements a client
#:       sends as a call falls idle are confirmed read before their runs return.
VERSION = (1, 18)


class Unfilled(NamedTuple):
    """A deprecated field servers no longer write."""

    #: The protocol version from which servers leave it empty.
    since: tuple[int, int]
    #: Full name of the field they write instead.
    instead: str


#: The deprecated fields gym-grpc servers no longer write, in their replies or in the requests
#: they make (a message a client sent is passed on as it came), by full name. The handshake lists them
#: (GetServerInfoResponse.unfilled_fields). A field deprecated later keeps being written until
#: a minor version adds it here and docs/changes.md says so. These nine went unwritten in 1.0
#: itself, before the handshake existed, when the `*_json` fields beside them replaced them.
UNFILLED: dict[str, Unfilled] = {
    "gym.v1.CreateParams.extra": Unfilled((1, 0), "gym.v1.CreateParams.extra_json"),
    "gym.v1.FunctionTool.parameters": Unfilled((1, 0), "gym.v1.FunctionTool.parameters_json"),
    "gym.v1.OutputText.annotations": Unfilled((1, 0), "gym.v1.OutputText.annotations_json"),
    "gym.v1.Rollout.verifier_fields": Unfilled((1, 0), "gym.v1.Rollout.verifier_fields_json"),
    "gym.v1.Task.data": Unfilled((1, 0), "gym.v1.Task.data_json"),
    "gym.v1.TextFormat.schema": Unfilled((1, 0), "gym.v1.TextFormat.schema_json"),
    "gym.v1.VerificationEvent.fields": Unfilled((1, 0), "gym.v1.VerificationEvent.fields_json"),
    "gym.v1.VerificationResult.fields": Unfilled((1, 0), "gym.v1.VerificationResult.fields_json"),
    "gym.v1.VerifyResponse.fields": Unfilled((1, 0), "gym.v1.VerifyResponse.fields_json"),
}

#: The version from which servers list their unfilled fields in the handshake.
_LISTED_SINCE = (1, 6)


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


def unfilled(info: admin_pb.GetServerInfoResponse) -> set[str]:
    """The deprecated fields the server that answered `info` leaves empty.

    A server of 1.6 or later says so itself. An older one sends no list; what it leaves empty
    is known: the fields UNFILLED dates at or before its version (a server that sends no
    version is taken for 1.0, so for all of them)."""
    speaks = (info.protocol.major or 1, info.protocol.minor)
    if speaks >= _LISTED_SINCE:
        return set(info.unfilled_fields)
    return {name for name, field in UNFILLED.items() if field.since <= speaks}


def check(info: admin_pb.GetServerInfoResponse, where: str, reads: Iterable[str] = ()) -> None:
    """Raise IncompatibleServer when the server's major version is not ours, or when it no
    longer writes a deprecated field the caller says it `reads` (full names, such as
    "gym.v1.Rollout.verifier_fields"; ValueError for a name gym.v1 does not have).

    A server that sends no version (major 0) predates the handshake and speaks 1.0."""
    reads = sorted(set(reads))
    for name in reads:
        _field(name)
    major = info.protocol.major or 1
    if major != VERSION[0]:
        raise errors.IncompatibleServer(
            f"{where} speaks gym protocol {major}.{info.protocol.minor} (gym-grpc {info.version or '?'}); "
            f"this client speaks {VERSION[0]}.{VERSION[1]}: run a gym-grpc whose protocol major version "
            "matches on both sides",
            metadata={"server_protocol": f"{major}.{info.protocol.minor}"},
        )
    gone = [name for name in reads if name in unfilled(info)]
    if gone:
        known = [UNFILLED[name].instead for name in gone if name in UNFILLED]
        instead = f"it writes {', '.join(known)} instead" if len(known) == len(gone) else "see what replaced them"
        raise errors.IncompatibleServer(
            f"{where} (gym protocol {major}.{info.protocol.minor}) no longer writes the deprecated "
            f"{', '.join(gone)}, which this client reads; {instead} (docs/changes.md)",
            metadata={"server_protocol": f"{major}.{info.protocol.minor}", "unfilled_fields": ",".join(gone)},
        )


def _field(name: str) -> None:
    """Raise ValueError unless `name` is the full name of a gym.v1 field."""
    try:
        if not name.startswith("gym.v1."):
            raise KeyError(name)
        descriptor_pool.Default().FindFieldByName(name)
    except KeyError:
        raise ValueError(f"reads: {name!r} is not a gym.v1 field (a full name, such as 'gym.v1.Task.data')") from None
