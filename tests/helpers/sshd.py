"""A real OpenSSH ``sshd`` for tests: throwaway user, host key and client key.

Needs root (``useradd``, sshd's privilege separation) and Debian's ``openssh-server``
(``make test`` installs it through the Makefile's ``system-deps`` target). :func:`skip_reason`
says why a test cannot run here, or ``None``.

Typical use (see ``tests/integration/conftest.py`` for the fixtures)::

    user = ThrowawayUser.create()
    server = SshServer.start(workdir, user, client_pubkeys=[client.public])
    ...  # connect to server.host:server.port as user.name with client.private
    server.stop(); user.remove()

Everything started here is stopped by pid; the user's leftover processes (a node agent the test
bootstrapped) are found by that throwaway uid and stopped by pid too.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.helpers.workers import share

SSHD = Path("/usr/sbin/sshd")
TEST_ROOT = Path("/tmp/exo-tui-test-hosts")  # world-traversable, so throwaway homes can live here


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (throwaway users and sshd); run the tests as root, e.g. in CI"
    if not SSHD.exists():
        return "needs OpenSSH's sshd (/usr/sbin/sshd): `make system-deps` or apt-get install openssh-server"
    if shutil.which("ssh-keygen") is None:
        return "needs ssh-keygen (apt-get install openssh-client)"
    if shutil.which("useradd") is None:
        return "needs useradd (passwd package)"
    return None


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives a socket bound to port 0 or an outgoing connection."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process to bind a little later: below the kernel's ephemeral range,
    so no socket bound to port 0 (a node agent's, a local node's) and no outgoing connection can
    take it in the meantime (one from that range once was: a join endpoint's port went to the
    serve's own local node), and never the same one twice in a test run: each worker of the run
    takes its own part of the range (:func:`tests.helpers.workers.share`) and remembers what it
    gave."""
    lo, _ = _ephemeral_range()
    ports = share(10000, lo) if lo > 10000 else range(0)
    for _ in range(200 if ports else 0):
        port = ports[secrets.randbelow(len(ports))]
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # nothing free below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path

    @property
    def public_line(self) -> str:
        return self.public.read_text().strip()

    @classmethod
    def generate(cls, path: Path, comment: str = "exo-tui-test") -> KeyPair:
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
        return cls(path, path.with_name(path.name + ".pub"))


@dataclass
class ThrowawayUser:
    """A Unix user made for one test session, with its home under :data:`TEST_ROOT`."""

    name: str
    home: Path
    uid: int
    gid: int

    @classmethod
    def create(cls, prefix: str = "exot") -> ThrowawayUser:
        TEST_ROOT.mkdir(mode=0o755, exist_ok=True)
        os.chmod(TEST_ROOT, 0o755)
        name = f"{prefix}{secrets.token_hex(3)}"
        home = TEST_ROOT / name
        subprocess.run(
            ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", "--user-group", name],
            check=True,
            capture_output=True,
        )
        # "*": no password, but not locked ("!"), so sshd lets the key in.
        subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
        pw = pwd.getpwnam(name)
        os.chmod(home, 0o755)
        return cls(name=name, home=home, uid=pw.pw_uid, gid=pw.pw_gid)

    def authorize(self, *public_lines: str) -> None:
        ssh = self.home / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        ak = ssh / "authorized_keys"
        ak.write_text("".join(line.strip() + "\n" for line in public_lines))
        os.chmod(ak, 0o600)
        for p in (ssh, ak):
            os.chown(p, self.uid, self.gid)

    def processes(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["uids"]):
            with contextlib.suppress(psutil.Error):
                if p.info["uids"] and p.info["uids"].real == self.uid:
                    out.append(p)
        return out

    def stop_processes(self, timeout_s: float = 5.0) -> None:
        """Stop, by pid, every process running as this throwaway user (e.g. a bootstrapped node)."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=timeout_s)

    def remove(self) -> None:
        self.stop_processes()
        for _ in range(3):
            res = subprocess.run(["userdel", "--force", "--remove", self.name], capture_output=True, text=True)
            if res.returncode in (0, 6):  # 6: no such user
                break
            self.stop_processes()  # e.g. an sshd session child that was still closing
        shutil.rmtree(self.home, ignore_errors=True)


@dataclass
class SshServer:
    """One ``sshd -D`` on ``host:port`` that lets in ``user`` with the authorized keys."""

    host: str
    port: int
    user: ThrowawayUser
    workdir: Path
    host_key: KeyPair
    proc: subprocess.Popen[bytes]
    netns: str | None = None
    log_path: Path = field(default=Path())

    @classmethod
    def start(
        cls,
        workdir: Path,
        user: ThrowawayUser,
        *,
        client_pubkeys: list[str],
        host: str = "127.0.0.1",
        port: int | None = None,
        netns: str | None = None,
        host_key: KeyPair | None = None,
        timeout_s: float = 10.0,
        sftp: bool = True,
    ) -> SshServer:
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
        host_key = host_key or KeyPair.generate(workdir / "ssh_host_ed25519_key", comment="test-host")
        user.authorize(*client_pubkeys)
        if port is None:
            port = 22 if netns else free_port(host)
        config = workdir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {port}",
                    f"ListenAddress {host}",
                    f"HostKey {host_key.private}",
                    f"PidFile {workdir / 'sshd.pid'}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "PermitRootLogin no",
                    f"AllowUsers {user.name}",
                    "StrictModes yes",
                    "PrintMotd no",
                    "Subsystem sftp internal-sftp" if sftp else "",  # without: a host with no SFTP
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        log_path = workdir / "sshd.log"
        cmd = [str(SSHD), "-D", "-e", "-f", str(config)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = cls(host, port, user, workdir, host_key, proc, netns, log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            if "Server listening on" in log_path.read_text(errors="replace"):
                return server
            time.sleep(0.05)
        server.stop()
        raise RuntimeError(f"sshd did not listen within {timeout_s} s: {log_path.read_text()[-2000:]}")

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user.name}@{host}:{self.port}"

    def known_hosts_line(self, key: KeyPair | None = None) -> str:
        host = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        return f"{host} {(key or self.host_key).public_line}\n"

    def write_known_hosts(self, path: Path, key: KeyPair | None = None) -> Path:
        path.write_text(self.known_hosts_line(key))
        return path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
