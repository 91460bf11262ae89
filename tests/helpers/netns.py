"""Test hosts in network namespaces joined by a bridge (root only).

::

    root namespace: bridge exbrXXXX 10.250.N.1/24  (the coordinator/test process lives here)
        ├── veth ── netns exo-XXXX-a  10.250.N.11/24
        ├── veth ── netns exo-XXXX-b  10.250.N.12/24
        └── veth ── netns exo-XXXX-c  10.250.N.13/24

Each host can get a throwaway user with its own sshd (:meth:`NetnsLab.start_sshd`), so bootstrap
treats it as a separate machine (they share the file system, but each user has its own home).
:meth:`NetnsLab.set_delay` adds ``tc netem`` delay on a host's link when the kernel has netem;
:func:`netem_skip_reason` says when it does not. :meth:`NetnsLab.close` stops everything the lab
started, by pid, and deletes the namespaces, links and users.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.sshd import SshServer, ThrowawayUser
from tests.helpers.workers import share


class NetemUnavailable(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces, veth links and a bridge"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`): `make system-deps` or apt-get install iproute2"
    probe = f"exo-probe-{secrets.token_hex(2)}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_netem_reason: list[str | None] = []


def netem_skip_reason() -> str | None:
    """None when ``tc qdisc ... netem`` works here, else why not."""
    if _netem_reason:
        return _netem_reason[0]
    reason: str | None = None
    if shutil.which("tc") is None:
        reason = "needs `tc` (iproute2) for netem delays"
    else:
        ns = f"exo-netem-{secrets.token_hex(2)}"
        try:
            _ip("netns", "add", ns)
            res = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                capture_output=True, text=True,
            )
            if res.returncode != 0:
                reason = (
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set): "
                    f"`tc qdisc add ... netem` says {res.stderr.strip()!r}, so link delays cannot be emulated"
                )
        finally:
            _ip("netns", "del", ns, check=False)
    _netem_reason.append(reason)
    return reason


@dataclass
class NetnsHost:
    label: str  # a, b, c...
    ns: str
    address: str
    veth_root: str
    veth_ns: str
    user: ThrowawayUser | None = None
    sshd: SshServer | None = None

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *cmd], capture_output=True, text=True, check=check, timeout=timeout
        )

    def popen(self, *cmd: str, **kw) -> subprocess.Popen:  # noqa: ANN003
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kw)

    @property
    def ssh_target(self) -> str:
        assert self.user is not None and self.sshd is not None
        return f"{self.user.name}@{self.address}:{self.sshd.port}"


@dataclass
class NetnsLab:
    tag: str
    bridge: str
    subnet: str  # "10.250.N"
    bridge_address: str
    hosts: list[NetnsHost] = field(default_factory=list)
    workdir: Path = field(default=Path("/tmp"))
    _procs: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def create(cls, n: int = 3, workdir: Path | None = None) -> NetnsLab:
        tag = secrets.token_hex(2)
        used = _ip("-4", "addr").stdout
        thirds = share(1, 251)  # this worker's subnets: two workers never take the same one at once
        for _ in range(50):
            third = thirds[secrets.randbelow(len(thirds))]
            subnet = f"10.250.{third}"
            if f"inet {subnet}." not in used:
                break
        lab = cls(tag=tag, bridge=f"exbr{tag}", subnet=subnet, bridge_address=f"{subnet}.1",
                  workdir=workdir or Path(f"/tmp/exo-netns-{tag}"))
        lab.workdir.mkdir(parents=True, exist_ok=True)
        try:
            _ip("link", "add", "name", lab.bridge, "type", "bridge")
            _ip("addr", "add", f"{lab.bridge_address}/24", "dev", lab.bridge)
            _ip("link", "set", lab.bridge, "up")
            for i in range(n):
                label = chr(ord("a") + i)
                host = NetnsHost(
                    label=label, ns=f"exo-{tag}-{label}", address=f"{subnet}.{11 + i}",
                    veth_root=f"ex{tag}{label}", veth_ns=f"ex{tag}{label}p",
                )
                lab.hosts.append(host)  # before anything, so close() removes what was made
                _ip("netns", "add", host.ns)
                _ip("link", "add", host.veth_root, "type", "veth", "peer", "name", host.veth_ns)
                _ip("link", "set", host.veth_ns, "netns", host.ns)
                _ip("link", "set", host.veth_root, "master", lab.bridge)
                _ip("link", "set", host.veth_root, "up")
                _ip("link", "set", "lo", "up", ns=host.ns)
                _ip("addr", "add", f"{host.address}/24", "dev", host.veth_ns, ns=host.ns)
                _ip("link", "set", host.veth_ns, "up", ns=host.ns)
                _ip("route", "add", "default", "via", lab.bridge_address, ns=host.ns)
        except BaseException:
            lab.close()
            raise
        return lab

    def start_sshd(self, client_pubkeys: list[str]) -> None:
        """A throwaway user and an sshd on port 22 in each namespace."""
        for host in self.hosts:
            host.user = ThrowawayUser.create(prefix=f"exo{host.label}")
            host.sshd = SshServer.start(self.workdir / f"sshd-{host.label}", host.user,
                                        client_pubkeys=client_pubkeys, host=host.address, port=22, netns=host.ns)

    def known_hosts(self, path: Path) -> Path:
        path.write_text("".join(h.sshd.known_hosts_line() for h in self.hosts if h.sshd))
        return path

    def set_delay(self, host: NetnsHost, delay_ms: float) -> None:
        """Delay every packet leaving ``host`` by ``delay_ms`` (netem on its side of the link)."""
        reason = netem_skip_reason()
        if reason:
            raise NetemUnavailable(reason)
        host.run("tc", "qdisc", "replace", "dev", host.veth_ns, "root", "netem", "delay", f"{delay_ms}ms")

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
                if p.poll() is None:
                    p.kill()
        def teardown(host: NetnsHost) -> None:
            if host.user is not None:
                with contextlib.suppress(Exception):
                    host.user.stop_processes()
            if host.sshd is not None:
                with contextlib.suppress(Exception):
                    host.sshd.stop()
            if host.user is not None:
                with contextlib.suppress(Exception):
                    host.user.remove()  # deleting a home with a venv takes seconds: in parallel
            _ip("link", "del", host.veth_root, check=False)
            _ip("netns", "del", host.ns, check=False)

        if self.hosts:
            with ThreadPoolExecutor(len(self.hosts)) as pool:
                list(pool.map(teardown, self.hosts))
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
