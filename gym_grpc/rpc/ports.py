"""A free port for a server that is told its port before it binds it (vLLM, `mlflow server`, an
OTLP receiver opened later): one below the kernel's ephemeral range.

A server that can bind port 0 and say which port it got should do that instead. A port found by
binding 0 and closing the socket is free only for that moment: the kernel hands ports of its
ephemeral range to every outgoing connection and every bind to port 0, so another process may get
the same number before the server binds it (CI saw it: the OTLP receiver that the real-engine tests
open minutes after CI chose its port found it taken). The kernel never hands out a port below that
range by itself, so one chosen there stays free unless something asks for that very number."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Linux's ephemeral range: "first last".
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Where the search begins: above the ports services are commonly configured on.
LOWEST = 10_000
#: The start of IANA's dynamic range, which other systems hand out from.
IANA_DYNAMIC = 49_152


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that is free now and that the kernel will not hand to anyone else."""
    try:
        first = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        first = IANA_DYNAMIC
    below = range(LOWEST, first)
    for port in random.sample(below, min(len(below), 200)):  # random: callers side by side seldom collide
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: take the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
