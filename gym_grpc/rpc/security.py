"""TLS, mutual TLS and a bearer token, for every server and every client.

    security:
      tls:
        ca: certs/ca.pem            # clients check servers against it; under mTLS servers check clients
        cert: certs/server.pem      # this party's certificate chain (servers: required; clients: for mTLS)
        key: certs/server-key.pem   # its private key
        require_client_cert: true   # mutual TLS
      token: ${gym_token}           # servers require "authorization: Bearer <token>"; clients send it

The health and reflection services stay open without the token (probes and
grpcurl's `list`); every gym.v1 service needs it. The token is compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

from gym_grpc import errors
from gym_grpc.errors import ConfigError

#: RPCs that answer without the token.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

log = logging.getLogger("gym_grpc.rpc.security")


class TlsSettings(BaseModel):
    """Certificates, as PEM files."""

    model_config = ConfigDict(extra="forbid")

    ca: str | None = Field(None, description="CA certificate that signs the others")
    cert: str | None = Field(None, description="this party's certificate chain")
    key: str | None = Field(None, description="this party's private key")
    require_client_cert: bool = Field(False, description="servers refuse clients without a certificate (mTLS)")
    server_name: str | None = Field(None, description="name to expect in server certificates, if not the host")


class Security(BaseModel):
    """How servers and clients of one configuration protect their calls; nothing by default."""

    model_config = ConfigDict(extra="forbid")

    tls: TlsSettings | None = None
    token: str | None = Field(None, description="bearer token every call must carry")

    def _read(self, what: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"security.tls.{what}: cannot read {path}: {e.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for a server, or None for plaintext."""
        if self.tls is None:
            return None
        cert, key = self._read("cert", self.tls.cert), self._read("key", self.tls.key)
        if cert is None or key is None:
            raise ConfigError("security.tls: a server needs cert and key")
        ca = self._read("ca", self.tls.ca)
        if self.tls.require_client_cert and ca is None:
            raise ConfigError("security.tls.require_client_cert needs ca, to check client certificates")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.tls.require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a client (with its certificate for mTLS), or None for plaintext."""
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self._read("ca", self.tls.ca),
            private_key=self._read("key", self.tls.key),
            certificate_chain=self._read("cert", self.tls.cert),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.tls is not None and self.tls.server_name:
            return [("grpc.ssl_target_name_override", self.tls.server_name)]
        return []

    def client_interceptors(self) -> list[Any]:
        if not self.token:
            return []
        return [_SendTokenUnary(self.token), _SendTokenStream(self.token), _SendTokenBidi(self.token)]

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_CheckToken(self.token)] if self.token else []


class _SendToken:
    """Adds the bearer token to a call's metadata.

    grpc.aio files an interceptor under the first call kind it implements
    only, so each kind gets its own subclass (one class for both would leave
    streaming calls without the token)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _SendTokenUnary(_SendToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _SendTokenStream(_SendToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _SendTokenBidi(_SendToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _CheckToken(grpc.aio.ServerInterceptor):
    """Refuses a gym.v1 call without the right token before reading its request.

    The token is in the call's metadata, which arrives first. A refused call
    gets a handler that takes the request as a stream and never reads it, so
    grpc neither receives nor parses the body: a stranger's 200 MB message
    costs the server nothing but the HTTP/2 flow-control window. Each refusal
    is logged at WARNING with the peer and the method (never the token)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return handler
        deny = _Deny(details.method, "wrong" if given else "missing")
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny.stream, None, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(deny.unary, None, handler.response_serializer)


class _Deny:
    """The behaviour of a refused call: log it, then abort without reading the request."""

    def __init__(self, method: str, why: str) -> None:
        self.method, self.why = method, why

    async def unary(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        # The peer is read at once: a context touched after its call ended can crash grpc.aio.
        log.warning("refused %s from %s: %s bearer token", self.method, context.peer(), self.why)
        refused = errors.GymError(
            "missing or wrong bearer token (authorization metadata)",
            code=grpc.StatusCode.UNAUTHENTICATED,
            reason=errors.Reason.BEARER_TOKEN_REJECTED,
        )
        await context.abort_with_status(refused.to_status())

    async def stream(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await self.unary(requests, context)
        yield  # never reached; makes this an async generator, as a streaming handler is
