"""gRPC options shared by every gym-grpc server and client, and channel creation.

The defaults are chosen for thousands of concurrent rollouts on one machine:

* grpcio's C-core server cancels calls once more than
  `grpc.server.max_pending_requests` (default 1,000; hard limit 3,000) wait
  for the application, so under a few thousand concurrent calls clients see
  CANCELLED for no visible reason. Both limits are raised far past any
  in-flight window we use.
* Servers own their port (`grpc.so_reuseport` off): on Linux two servers
  could otherwise silently share a port.
* Rollouts carry whole conversations with token ids and log-probs, so
  messages may be large.
"""

from __future__ import annotations

import contextvars
import time

import grpc

from gym_grpc.security import Security

#: Largest message a server or client sends or accepts, in bytes.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Calls a server lets wait for the application before it cancels them.
MAX_PENDING_REQUESTS = 1 << 20


def _message_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


# After a failed connection grpc waits before it tries again, doubling up to
# two minutes by default: a server restarted on its port would stay
# unreachable from an existing channel that long. Calls fail fast meanwhile
# (they are not wait_for_ready), so trying again often costs little.
_RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


#: Connections a client opens to each worker process of a multi-process server.
CONNECTIONS_PER_WORKER = 8


def server_options(*, reuse_port: bool = False) -> list[tuple[str, int]]:
    """Server options; `reuse_port` lets the worker processes of one server share its port."""
    return _message_options() + [
        ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_REQUESTS),
        ("grpc.so_reuseport", int(reuse_port)),
    ]


def open_channel(address: str, index: int = 0, security: Security | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port") with our options, over TLS and
    with the bearer token when `security` says so.

    Channels with the same arguments share one connection; a distinct `index`
    gives a channel its own, which is how a client reaches several worker
    processes behind one port (the kernel spreads connections, not calls).
    """
    options = _message_options() + _RECONNECT_OPTIONS + ([("grpc.gym_channel_index", index)] if index else [])
    if security is None:
        return grpc.aio.insecure_channel(address, options=options)
    options += security.channel_options()
    interceptors = security.client_interceptors()
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


# --- deadline propagation ----------------------------------------------------
#
# gRPC deadlines do not propagate by themselves. The servicer plumbing records
# the deadline of the call being handled here; every client call made while
# handling it (in the same task or a task it spawned) uses what is left of it.

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("gym_grpc_deadline", default=None)


def set_deadline(seconds_left: float | None) -> contextvars.Token:
    """Record that the current call must finish within `seconds_left` (None: no deadline)."""
    return _deadline.set(None if seconds_left is None else time.monotonic() + seconds_left)


def reset_deadline(token: contextvars.Token) -> None:
    """Undo a set_deadline."""
    _deadline.reset(token)


def timeout_for(default: float | None) -> float | None:
    """Timeout for a downstream call: what is left of the current deadline, or `default`."""
    deadline = _deadline.get()
    if deadline is None:
        return default
    left = max(deadline - time.monotonic(), 0.0)
    return left if default is None else min(left, default)
