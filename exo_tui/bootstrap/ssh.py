"""SSH connections for bootstrap: targets, host-key checks as ``ssh`` does them, clear failures.

Host keys are checked against ``known_hosts`` (``~/.ssh/known_hosts`` unless given):

- a key that matches → go on;
- no key known for the host → refused with :class:`HostKeyUnknown` (it carries the fingerprint),
  unless the operator accepts it (``accept_new_host_key``, or a ``confirm_host_key`` callback the
  console uses to show the fingerprint and ask); an accepted key is appended to known_hosts;
- a different key than the one known → always refused with :class:`HostKeyChanged`.

Authentication is the operator's: the keys ``ssh`` would use (``~/.ssh/id_*``, ``IdentityFile``
in ``~/.ssh/config``) and the agent (``SSH_AUTH_SOCK``), through asyncssh's defaults.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from exo_tui.bootstrap.errors import BootstrapError, HostKeyChanged, HostKeyUnknown, known_hosts_name
from exo_tui.net.address import bracketed, split_host_port


@dataclass(frozen=True)
class Target:
    host: str
    port: int | None = None  # None: ssh_config's Port, else 22
    user: str | None = None  # None: ssh_config's User, else the local user

    def __str__(self) -> str:
        host = bracketed(self.host)
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{host}{port}"


def parse_target(text: str) -> Target:
    """``[USER@]HOST[:PORT]`` (IPv6 as ``[addr]:port``) → :class:`Target`."""
    text = text.strip()
    user = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        if not user:
            raise ValueError("empty user name before '@'")
    host, port = split_host_port(text, 0)
    return Target(host=host, port=port or None, user=user)


ConfirmHostKey = Callable[[HostKeyUnknown], Awaitable[bool]]


def default_known_hosts() -> Path:
    return Path.home() / ".ssh" / "known_hosts"


class _HostKeyCheck:
    """known_hosts lookup for asyncssh that remembers what it found and what the host offered."""

    def __init__(self, path: Path, pinned: asyncssh.SSHKey | None, accept_new: bool | str) -> None:
        self.path = path
        self.pinned = pinned
        self.accept_new = accept_new  # True, or the one fingerprint the operator accepted
        self.known_count = 0
        self.presented: asyncssh.SSHKey | None = None
        self.host = ""
        self.addr = ""
        self.port = 22
        self.accepted_new = False

    def lookup(self, host: str, addr: str, port: int | None) -> Any:
        self.host, self.addr, self.port = host, addr, port or 22
        try:
            known = asyncssh.read_known_hosts(str(self.path)) if self.path.exists() else asyncssh.SSHKnownHosts()
        except (OSError, ValueError) as exc:
            raise BootstrapError(
                "connect", f"cannot read {self.path} ({exc}): fix or move the file, then run again"
            ) from None
        result = known.match(host, addr, port)
        self.known_count = len(result[0]) + len(result[1])
        return result

    def validate(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        """Called by asyncssh for a key not among the known ones."""
        self.presented = key
        if self.known_count:
            return False  # changed
        if self.pinned is not None and key == self.pinned:
            self.accepted_new = True
            return True
        if self.accept_new is True or (
            isinstance(self.accept_new, str) and self.accept_new == key.get_fingerprint("sha256")
        ):
            self.accepted_new = True
            return True
        return False

    def record(self) -> None:
        """Append the accepted key to known_hosts, the way ``ssh`` writes it."""
        if self.presented is None:
            return
        entry = known_hosts_name(self.host, self.port)
        key_type, key_data = self.presented.export_public_key("openssh").decode().split()[:2]
        line = f"{entry} {key_type} {key_data}\n"
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(line)


def _client_factory(check: _HostKeyCheck) -> type[asyncssh.SSHClient]:
    class _Client(asyncssh.SSHClient):
        def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
            return check.validate(host, addr, port, key)

    return _Client


async def connect(
    target: Target | str,
    *,
    known_hosts: Path | None = None,
    accept_new_host_key: bool | str = False,
    confirm_host_key: ConfirmHostKey | None = None,
    client_keys: Sequence[str | Path] | None = None,
    agent_path: str | None | bool = True,
    ssh_config: Sequence[str | Path] | None | bool = True,
    connect_timeout_s: float = 10.0,
) -> asyncssh.SSHClientConnection:
    """Open an SSH connection, checking the host key; every failure is a :class:`BootstrapError`.

    ``accept_new_host_key``: True accepts (and records) any key of a host not in known_hosts; a
    fingerprint string (``"SHA256:..."``, as :class:`HostKeyUnknown` showed it) accepts only that
    key — what a console should pass after the operator said yes to that fingerprint.

    ``client_keys``/``agent_path``/``ssh_config``: ``True``/``None`` mean ssh's defaults (keys in
    ``~/.ssh``, ``$SSH_AUTH_SOCK``, ``~/.ssh/config``); ``False`` turns the agent or config off.
    """
    t = parse_target(target) if isinstance(target, str) else target
    path = Path(known_hosts) if known_hosts else default_known_hosts()
    pinned: asyncssh.SSHKey | None = None
    for _attempt in range(2):
        check = _HostKeyCheck(path, pinned, accept_new_host_key)
        opts: dict[str, Any] = {
            "known_hosts": check.lookup,
            "client_factory": _client_factory(check),
            "connect_timeout": connect_timeout_s,
            "login_timeout": connect_timeout_s,
        }
        if t.port:
            opts["port"] = t.port
        if t.user:
            opts["username"] = t.user
        if client_keys is not None:
            opts["client_keys"] = [str(k) for k in client_keys]
        if agent_path is False:
            opts["agent_path"] = None
        elif isinstance(agent_path, str):
            opts["agent_path"] = agent_path
        if ssh_config is False:
            opts["config"] = None
        elif ssh_config is not True and ssh_config is not None:
            opts["config"] = [str(p) for p in ssh_config]
        where = str(t)
        try:
            async with asyncio.timeout(connect_timeout_s + 1):
                conn = await asyncssh.connect(t.host, **opts)
        except asyncssh.HostKeyNotVerifiable:
            key = check.presented
            if key is None:
                raise BootstrapError(
                    "connect", f"{where}: the host key could not be verified (revoked or unusable key type)"
                ) from None
            fp = key.get_fingerprint("sha256")
            kt = key.get_algorithm()
            host = check.host or t.host
            if check.known_count:
                raise HostKeyChanged(host, check.port, fp, kt, path) from None
            unknown = HostKeyUnknown(host, fp, kt, port=check.port, known_hosts=path)
            if confirm_host_key is not None and pinned is None and await confirm_host_key(unknown):
                pinned = key  # connect again trusting exactly the key the operator saw
                continue
            raise unknown from None
        except asyncssh.PermissionDenied as exc:
            user = t.user or "your user"
            raise BootstrapError(
                "connect",
                f"permission denied for {where} ({exc.reason}): exo-tui logs in with your SSH keys and "
                f"agent as ssh does. Check that `ssh {where.replace(':', ' -p ', 1) if t.port else where}` "
                f"works; install your public key for {user} there with ssh-copy-id, or load the key "
                "into your agent (ssh-add)",
            ) from None
        except TimeoutError:
            raise BootstrapError(
                "connect",
                f"no SSH answer from {where} within {connect_timeout_s:g} s: check the host is on and "
                "reachable and the port is right",
            ) from None
        except ConnectionRefusedError:
            raise BootstrapError(
                "connect",
                f"{where} refused the connection: no SSH server listens on that port. Start sshd "
                "there (or enable Remote Login on a Mac) or give the right :PORT",
            ) from None
        except OSError as exc:
            raise BootstrapError(
                "connect",
                f"cannot reach {where}: {exc.strerror or exc}. Check the host name, the network and the port",
            ) from None
        except asyncssh.Error as exc:
            raise BootstrapError("connect", f"SSH to {where} failed: {exc.reason}") from None
        if check.accepted_new:
            check.record()
        return conn
    raise AssertionError("unreachable")


async def run(
    conn: asyncssh.SSHClientConnection, script: str, *, timeout_s: float | None = None, input: str | None = None
) -> asyncssh.SSHCompletedProcess:
    """Run a POSIX ``sh`` script on the host (whatever the login shell is)."""
    import shlex

    cmd = "sh -c " + shlex.quote(script)
    async with asyncio.timeout(timeout_s):
        return await conn.run(cmd, check=False, input=input)
