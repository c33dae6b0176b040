"""Fuzzing every running service: hypothesis-made request messages and random bytes.

No server process may die, every request must be answered (before the test's
deadline) with a response or a gRPC error (never UNKNOWN, never our catch-all
"internal error" that marks a bug), and every server must still serve afterwards.
"""

import grpc
import pytest
from google.protobuf import descriptor as d
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_grpc.v1 import (
    admin_service_pb2,
    agent_service_pb2,
    model_service_pb2,
    registry_service_pb2,
    resources_service_pb2,
)
from tests.support import start_run

FD = d.FieldDescriptor
_INTS = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _scalar(field: d.FieldDescriptor) -> st.SearchStrategy:
    if field.type == FD.TYPE_STRING:
        return st.text(max_size=40)
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=20)
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in _INTS:
        return st.integers(*_INTS[field.type])
    if field.type == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FD.TYPE_DOUBLE:
        return st.floats()
    if field.type == FD.TYPE_ENUM:  # open enums: unknown numbers too
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-3, 50)
    raise AssertionError(field.type)


def messages(descriptor: d.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Any message of a type: each field set or not, oneofs respected, nesting bounded."""
    cls = message_factory.GetMessageClass(descriptor)
    if descriptor.full_name == "google.protobuf.Struct":
        return st.dictionaries(st.text(max_size=10), _JSON, max_size=3).map(lambda v: _struct(cls, v))

    @st.composite
    def build(draw: st.DrawFn):
        msg = cls()
        if depth > 6:
            return msg
        chosen = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs}
        for field in descriptor.fields:
            if field.containing_oneof is not None:
                if chosen[field.containing_oneof.name] != field.name:
                    continue
            elif not draw(st.booleans()):
                continue
            target = getattr(msg, field.name)
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                if value.message_type is None:
                    target.update(draw(st.dictionaries(_scalar(key), _scalar(value), max_size=2)))
            elif field.message_type is not None:
                inner = messages(field.message_type, depth + 1)
                if field.is_repeated:
                    for item in draw(st.lists(inner, max_size=2)):
                        target.add().CopyFrom(item)
                else:
                    target.CopyFrom(draw(inner))
            elif field.is_repeated:
                target.extend(draw(st.lists(_scalar(field), max_size=4)))
            else:
                setattr(msg, field.name, draw(_scalar(field)))
        return msg

    return build()


def _struct(cls, value):
    msg = cls()
    msg.update(value)
    return msg


SERVICES = {
    "model": model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
    "resources": resources_service_pb2.DESCRIPTOR.services_by_name["ResourcesService"],
    "agent": agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"],
    "registry": registry_service_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    "admin": admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"],
}
TARGETS = {"model": "policy_model", "resources": "math", "agent": "weather_agent", "admin": "weather"}
METHODS = [(kind, method.name) for kind, service in SERVICES.items() for method in service.methods]


@pytest.fixture(scope="module")
def live():
    run = start_run()
    addresses = {kind: run.servers[name] for kind, name in TARGETS.items()} | {"registry": run.registry}
    channels = {kind: grpc.insecure_channel(address) for kind, address in addresses.items()}
    yield run, channels
    for channel in channels.values():
        channel.close()
    run.stop()


#: Streams that follow until their caller cancels: one message is their answer.
FOLLOWING = {"gym.v1.RegistryService.WatchServer"}


def _call(channel: grpc.Channel, method: d.MethodDescriptor, payload: bytes) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            replies = channel.unary_stream(path)(payload, timeout=20)
            for _ in replies:
                if method.full_name in FOLLOWING:
                    replies.cancel()
                    break
        else:
            channel.unary_unary(path)(payload, timeout=20)
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.UNKNOWN, (path, e.details())
        # Only the test sets a deadline; past it, the server left the request unanswered.
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, (path, "no answer in 20 s")
        assert not (e.details() or "").startswith("internal error in"), (path, e.details())


@pytest.mark.parametrize("kind, name", METHODS, ids=[f"{kind}.{name}" for kind, name in METHODS])
def test_fuzzed_requests_get_a_response_or_a_clean_error(live, kind, name):
    _, channels = live
    method = SERVICES[kind].methods_by_name[name]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=messages(method.input_type), noise=st.binary(max_size=64))
    def fuzz(request, noise):
        _call(channels[kind], method, request.SerializeToString())
        _call(channels[kind], method, noise)

    fuzz()


def test_every_server_still_serves_after_the_fuzzing(live):
    run, _ = live
    assert run.process.poll() is None
    for name, address in run.servers.items():
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
