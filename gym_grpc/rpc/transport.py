"""gRPC options shared by every gym-grpc server and client, and channel creation.

The defaults are chosen for thousands of concurrent rollouts on one machine:

* grpcio's C-core server cancels calls once more than
  `grpc.server.max_pending_requests` (default 1,000; hard limit 3,000) wait
  for the application, so under a few thousand concurrent calls clients see
  CANCELLED for no visible reason. Both limits are raised far past any
  in-flight window we use.
* Servers own their port (`grpc.so_reuseport` off): on Linux two servers
  could otherwise silently share a port.
* A call waiting in a server is never cancelled by the server before its
  deadline, and a client call to a peer that is slow to connect waits for it
  (wait_for_ready) within its deadline rather than failing at once.
* Rollouts carry whole conversations with token ids and log-probs, so
  messages may be large.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import json
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from gym_grpc.rpc.security import Security

S = TypeVar("S")

#: Largest message a server or client sends or accepts, in bytes.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Calls a server lets wait for the application before it cancels them.
MAX_PENDING_REQUESTS = 1 << 20

#: Seconds a call may wait in a server for the application to take it up
#: (grpc's default is 30 s, after which it cancels the call: 16,000 calls into
#: a slow server, or a server paused for 30 s, lose calls that had minutes of
#: deadline left). Every call is bounded by its own deadline instead.
MAX_UNREQUESTED_SECONDS = 7 * 24 * 3600


#: How long a peer may stop reading (a paused or starved process) before its
#: connection is dropped, in ms. grpc's defaults are 20 s for a server (its
#: TCP_USER_TIMEOUT, which aborts a connection whose peer keeps a zero receive
#: window that long: a client paused for 20 s loses every call it had in
#: flight) and 60 s for an unanswered ping. A peer that dies on the same host
#: is noticed at once (the kernel resets its connections), one on another
#: host after this long.
PAUSE_TOLERANCE_MS = 300_000


def _common_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # How long a peer may stay silent (a ping unanswered, a full receive
        # window) before the connection is dropped; see PAUSE_TOLERANCE_MS.
        ("grpc.keepalive_timeout_ms", PAUSE_TOLERANCE_MS),
        ("grpc.http2.ping_timeout_ms", PAUSE_TOLERANCE_MS),
    ]


# After a failed connection grpc waits before it tries again, doubling up to
# two minutes by default: a server restarted on its port would stay
# unreachable from an existing channel that long. We start at 100 ms and
# never wait more than a second. grpc's minimum connect timeout
# (`grpc.min_reconnect_backoff_ms`, 20 s) is left alone: lowered, a server
# that is merely slow to answer (paused, starved of CPU, just started) fails
# its connection attempt at once with "timed out before receiving SETTINGS
# frame". Calls wait for a connection (wait_for_ready, see `call_options`)
# until their deadline, so a pause costs time, not the call.
_RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Each channel keeps its own connections. By default grpc shares them across the process by
    # target and arguments, and a connection that failed to a server which then stopped is shared
    # too: a new channel to a new server on that port (a restart, or the OS giving the port to
    # another server) had its first call fail at once with the old "Connection refused".
    ("grpc.use_local_subchannel_pool", 1),
]


#: Connections a client opens to each worker process of a multi-process server.
CONNECTIONS_PER_WORKER = 8

# A channel over several replicas: gRPC's round_robin spreads calls over the
# replicas whose connection is ready, and client-side health checking (the
# grpc.health.v1 Watch every gym-grpc server serves) takes a replica out of the
# rotation while it is NOT_SERVING (stopping) and puts it back when it serves.
_BALANCED_SERVICE_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


def reachable_host(host: str) -> str:
    """The host to reach a server that binds `host` on (loopback for every interface)."""
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def server_options(*, reuse_port: bool = False) -> list[tuple[str, int]]:
    """Server options; `reuse_port` lets the worker processes of one server share its port."""
    return _common_options() + [
        ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_REQUESTS),
        ("grpc.server_max_unrequested_time_in_server", MAX_UNREQUESTED_SECONDS),
        ("grpc.so_reuseport", int(reuse_port)),
    ]


def open_channel(address: str | list[str], security: Security | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port") with our options, over TLS and
    with the bearer token when `security` says so. Given several addresses (the
    replicas of a server), one channel balanced over them (round_robin, with
    client-side health checking).

    Every channel has its own connection: a client reaches the several worker
    processes behind one port through several channels (the kernel spreads
    connections, not calls).
    """
    options: list[tuple[str, str | int]] = [*_common_options(), *_RECONNECT_OPTIONS]
    if isinstance(address, list):
        if len(address) == 1:
            address = address[0]
        else:
            address = balanced_target(address)
            options.append(("grpc.service_config", _BALANCED_SERVICE_CONFIG))
    if security is None:
        return grpc.aio.insecure_channel(address, options=options)
    options += security.channel_options()
    interceptors = security.client_interceptors()
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def balanced_target(addresses: list[str]) -> str:
    """A gRPC target naming several "host:port" addresses at once ("ipv4:a:1,b:2"),
    the form whose addresses a load-balancing policy spreads calls over. Host
    names are resolved here (gRPC's own resolver takes one name per target)."""
    resolved = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
        resolved.append((ip, int(port)))
    if all(ip.version == 4 for ip, _ in resolved):
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in resolved)
    if all(ip.version == 6 for ip, _ in resolved):
        return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in resolved)
    raise ValueError(f"replicas on both IPv4 and IPv6 addresses cannot share a channel: {', '.join(addresses)}")


#: Seconds a peer we reached before may stay unreachable before the calls
#: waiting for it fail (a restart takes a second or two; a peer that stays
#: down must not hold every rollout until its deadline).
UNREACHABLE_SECONDS = 30.0


class Connection:
    """A channel to one server process, and whether a call should wait for it.

    A call to a peer that answered before waits for it (wait_for_ready) while
    it cannot be reached: a server that is paused, restarting or slow to
    accept costs time, not the call. Once the peer has been unreachable for
    `unreachable_seconds`, the calls waiting for it are cancelled (the caller
    reports them as UNAVAILABLE) and later calls fail at once, with grpc's
    reason, until it is back. A peer never reached is not waited for: a wrong
    address or TLS setting is an error to show, not to wait out.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        unreachable_seconds: float = UNREACHABLE_SECONDS,
        *,
        replica: bool = False,
    ):
        self.channel = channel
        self.address = address
        self.unreachable_seconds = unreachable_seconds
        #: A channel to one replica that holds sessions (see `Registry.replica`): never
        #: waited for, because a replica that went away took its sessions with it.
        self.replica = replica
        self._stubs: dict[Callable[[grpc.aio.Channel], Any], Any] = {}
        #: The peer answered at least once.
        self.reached = False
        #: The peer has been unreachable for longer than `unreachable_seconds`.
        self.given_up = False
        self._down_since: float | None = None
        self._give_up: asyncio.TimerHandle | None = None
        self._waiting: set[grpc.aio.Call] = set()
        self._follow = asyncio.get_running_loop().create_task(self._follow_state())

    @property
    def wait(self) -> bool:
        """Whether a call now should wait for the peer to be reachable."""
        return self.reached and not self.given_up and not self.replica

    def stub(self, stub_class: Callable[[grpc.aio.Channel], S]) -> S:
        """A generated stub of `stub_class` over this channel (made once)."""
        stub = self._stubs.get(stub_class)
        if stub is None:
            stub = self._stubs[stub_class] = stub_class(self.channel)
        return stub

    def answered(self) -> None:
        """The peer answered a call. The state follower may not have seen READY (it
        can change and change back before the follower runs), and a later call must
        still wait for this peer if it goes away."""
        self.reached = True

    def waiting(self, call: grpc.aio.Call) -> None:
        """`call` waits for the peer; it is cancelled if the peer is given up."""
        self._waiting.add(call)
        call.add_done_callback(self._waiting.discard)

    async def _follow_state(self) -> None:
        state = self.channel.get_state()
        while True:
            if state == grpc.ChannelConnectivity.READY:
                self.reached, self.given_up, self._down_since = True, False, None
                if self._give_up is not None:
                    self._give_up.cancel()
                    self._give_up = None
            elif state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and self._down_since is None:
                self._down_since = time.monotonic()
                self._give_up = asyncio.get_running_loop().call_later(self.unreachable_seconds, self._give_up_on_peer)
            await self.channel.wait_for_state_change(state)
            state = self.channel.get_state()

    def _give_up_on_peer(self) -> None:
        self._give_up = None
        self.given_up = True
        for call in list(self._waiting):
            call.cancel()

    async def close(self, grace: float | None = None) -> None:
        """Close the channel; with a `grace`, calls in flight get that long to finish."""
        self._follow.cancel()
        if self._give_up is not None:
            self._give_up.cancel()
        await self.channel.close(grace)


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
