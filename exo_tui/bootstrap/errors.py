"""The errors of bootstrap: a failed step, and the host keys ``ssh`` would not accept either.

They live here, below the cluster, so the coordinator, the console and the API catch them by type
(the cluster's :mod:`exo_tui.cluster.view` re-exports :class:`HostKeyUnknown` for its front ends).
"""

from __future__ import annotations

from pathlib import Path

from exo_tui.net.address import host_port


class BootstrapError(Exception):
    """A bootstrap step failed. ``step`` names it; the message says what to do."""

    def __init__(self, step: str, message: str) -> None:
        Exception.__init__(self, f"{step}: {message}")
        self.step = step
        self.message = message


class HostKeyUnknown(BootstrapError):
    """A host key never seen: ask the operator, then call again with ``accept_new_host_key=True``.

    The SSH check raises it with the port and the known_hosts file (its message says how to check
    the key); the console's and the API's clients, which know only the host and the fingerprint,
    raise it without them. A key that *changed* is :class:`HostKeyChanged`, never accepted.
    """

    def __init__(
        self, host: str, fingerprint: str, key_type: str = "", *, port: int | None = None, known_hosts: Path | None = None
    ) -> None:
        self.host = host if port is None else host_port(host, port)
        self.fingerprint = fingerprint
        self.key_type = key_type
        self.port = port
        self.known_hosts = known_hosts
        if known_hosts is None:
            message = (
                f"{host} presents an unknown {key_type or 'host'} key {fingerprint}: check it, then accept it "
                f"to continue the bootstrap"
            )
            Exception.__init__(self, message)
            self.step, self.message = "connect", message
            return
        BootstrapError.__init__(
            self,
            "connect",
            f"{host_port(host, port or 22)} presents a {key_type} host key {fingerprint} that is not in {known_hosts}. "
            f"Check it on the host (ssh-keygen -lf /etc/ssh/ssh_host_{_short(key_type)}_key.pub), then "
            "run again with --accept-new-host-key (or accept it in the console) to record it",
        )


def known_hosts_name(host: str, port: int) -> str:
    """How OpenSSH names a host in known_hosts: ``host`` on port 22, else ``[host]:port`` (IPv4 too)."""
    return host if port == 22 else f"[{host}]:{port}"


class HostKeyChanged(BootstrapError):
    """The host offers a different key than the one recorded: never accepted."""

    def __init__(self, host: str, port: int, fingerprint: str, key_type: str, known_hosts: Path) -> None:
        entry = known_hosts_name(host, port)
        super().__init__(
            "connect",
            f"the host key of {host}:{port} has CHANGED: it now presents {key_type} {fingerprint}, "
            f"which is not the key recorded in {known_hosts}. Someone may be intercepting the "
            "connection, or the host was reinstalled. Check the new fingerprint on the host's own "
            f"console (ssh-keygen -lf /etc/ssh/ssh_host_{_short(key_type)}_key.pub); only if it "
            f"matches, remove the old entry with `ssh-keygen -R '{entry}' -f {known_hosts}` and "
            "run bootstrap again",
        )
        self.host, self.port, self.fingerprint = host, port, fingerprint


def _short(key_type: str) -> str:
    for name in ("ed25519", "ecdsa", "rsa", "dsa"):
        if name in key_type:
            return name
    return "ed25519"
