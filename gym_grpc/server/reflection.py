"""Server reflection under both of its names, with the .proto comments.

grpcio-reflection (1.85, the newest) serves only `grpc.reflection.v1alpha`, and
answers from the descriptors compiled into the _pb2 modules, which carry no
comments. Newer clients (grpcurl 1.8.8 and later, grpc-java, Postman) ask
`grpc.reflection.v1` first; the two services' messages are the same on the
wire. This servicer answers under both names, and sends the files of
`gym_grpc/v1/descriptor_set.binpb` (written by dev/codegen.py with their source
info) so that `grpcurl describe` shows each service's, message's and field's
comment. Any other file (google.protobuf, a server's own service) comes from
the default pool, without comments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from importlib.resources import files
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as pb

#: The names the service answers under, the current one first.
SERVICE_NAMES = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")


class _Files:
    """The files that describe a server's services, by name, with comments where we have them."""

    def __init__(self, service_names: Iterable[str]) -> None:
        data = files("gym_grpc.v1").joinpath("descriptor_set.binpb").read_bytes()
        self._commented = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(data).file}
        for proto in self._commented.values():
            _drop_json_names(proto.extension, proto.message_type)
        self.pool = descriptor_pool.DescriptorPool()
        self._serialized: dict[str, bytes] = {}
        self._imports: dict[str, list[str]] = {}
        for name in self._commented:
            self._add(name)
        for service in service_names:
            try:
                self.pool.FindServiceByName(service)
            except KeyError:
                self._add(descriptor_pool.Default().FindServiceByName(service).file.name)

    def _add(self, name: str) -> None:
        if name in self._serialized:
            return
        proto = self._commented.get(name)
        if proto is None:
            proto = descriptor_pb2.FileDescriptorProto()
            descriptor_pool.Default().FindFileByName(name).CopyToProto(proto)
        for dependency in proto.dependency:
            self._add(dependency)
        self.pool.Add(proto)
        self._serialized[name] = proto.SerializeToString()
        self._imports[name] = list(proto.dependency)

    def with_imports(self, name: str) -> list[bytes]:
        """The file `name` and every file it imports, directly or not, itself first."""
        if name not in self._serialized:
            raise KeyError(name)
        found: dict[str, bytes] = {}
        pending = [name]
        while pending:
            current = pending.pop()
            if current not in found:
                found[current] = self._serialized[current]
                pending.extend(self._imports[current])
        return list(found.values())


def _drop_json_names(
    fields: Iterable[descriptor_pb2.FieldDescriptorProto], messages: Iterable[descriptor_pb2.DescriptorProto]
) -> None:
    """Clear the json_name protoc writes on every field. Descriptors from the default pool
    have none, and grpcurl then prints JSON with the .proto's field names (`calls_by_status`,
    as the docs and recipes show) rather than lowerCamelCase."""
    for field in fields:
        field.ClearField("json_name")
    for message in messages:
        _drop_json_names([*message.field, *message.extension], message.nested_type)


class ReflectionServicer:
    """grpc.reflection.v1 (and v1alpha) ServerReflection over `_Files`."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self._names = sorted(set(service_names))
        self._files = _Files(self._names)
        #: Every file the services need, by name.
        self.pool = self._files.pool

    async def ServerReflectionInfo(
        self, requests: AsyncIterator[pb.ServerReflectionRequest], context: Any
    ) -> AsyncIterator[pb.ServerReflectionResponse]:
        async for request in requests:
            yield self._answer(request)

    def _answer(self, request: pb.ServerReflectionRequest) -> pb.ServerReflectionResponse:
        reply = pb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        pool = self.pool
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                reply.list_services_response.service.extend(pb.ServiceResponse(name=n) for n in self._names)
            elif kind == "file_by_filename":
                self._send_file(reply, request.file_by_filename)
            elif kind == "file_containing_symbol":
                self._send_file(reply, pool.FindFileContainingSymbol(request.file_containing_symbol).name)
            elif kind == "file_containing_extension":
                asked = request.file_containing_extension
                message = pool.FindMessageTypeByName(asked.containing_type)
                extension = pool.FindExtensionByNumber(message, asked.extension_number)
                self._send_file(reply, extension.file.name)  # type: ignore[attr-defined]  # types-protobuf lacks .file
            elif kind == "all_extension_numbers_of_type":
                message = pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = reply.all_extension_numbers_response
                numbers.base_type_name = message.full_name
                numbers.extension_number.extend(sorted(e.number for e in pool.FindAllExtensions(message)))
            else:
                return _error(reply, grpc.StatusCode.INVALID_ARGUMENT, "no request in the message")
        except KeyError as e:
            return _error(reply, grpc.StatusCode.NOT_FOUND, f"not found: {e.args[0] if e.args else kind}")
        return reply

    def _send_file(self, reply: pb.ServerReflectionResponse, name: str) -> None:
        reply.file_descriptor_response.file_descriptor_proto.extend(self._files.with_imports(name))


def _error(reply: pb.ServerReflectionResponse, code: grpc.StatusCode, message: str) -> pb.ServerReflectionResponse:
    reply.error_response.error_code = code.value[0]
    reply.error_response.error_message = message
    return reply


def add_to_server(service_names: Iterable[str], server: grpc.aio.Server) -> descriptor_pool.DescriptorPool:
    """Serve reflection for `service_names` (the reflection services among them) under both
    names; return the pool that describes them."""
    servicer = ReflectionServicer(service_names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=pb.ServerReflectionRequest.FromString,
        response_serializer=pb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method}) for name in SERVICE_NAMES]
    )
    return servicer.pool
