"""Importing the coordinator set's Raft library leaves the socket module as it was."""

import socket

import psutil


def test_the_coordinator_set_leaves_inet_ntop_working() -> None:
    import exo_tui.cluster.consensus  # noqa: F401  (imports pysyncobj)

    assert socket.inet_ntop(socket.AF_INET, b"\x7f\x00\x00\x01") == "127.0.0.1"
    assert socket.inet_ntop(socket.AF_INET6, b"\x00" * 15 + b"\x01") == "::1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        listening = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.laddr}
    assert port in listening
