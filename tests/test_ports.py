"""gym_grpc.rpc.ports: a port for a server told its port before it binds it."""

import random
import socket

from gym_grpc.rpc import ports


def test_a_free_port_is_below_the_ephemeral_range_and_binds():
    first = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    port = ports.free_port()
    assert ports.LOWEST <= port < first  # never one the kernel hands to a connection meanwhile
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        in_use = taken.getsockname()[1]
        monkeypatch.setattr(random, "sample", lambda population, k: [in_use, in_use + 1])
        assert ports.free_port() == in_use + 1
