"""Install and start a node agent on a host over SSH, and stop it.

Steps (each reported as a :class:`~exo_tui.events.BootstrapProgress` event, ``running``
then ``ok`` or ``failed``):

``connect``   SSH with host-key checks (:mod:`exo_tui.bootstrap.ssh`)
``detect``    OS, architecture, Apple silicon, Python ≥ 3.11 with venv, free disk, systemd --user
``venv``      ``<data>/venv`` where ``<data>`` is ``${XDG_DATA_HOME:-~/.local/share}/exo-tui``
``upload``    this project's wheel (and the ``--wheelhouse`` files) by SFTP, or over the SSH
              channel where the host has no SFTP (:mod:`.files`)
``install``   ``pip install`` (dependencies from the host's index, or only the wheelhouse)
``key``       the node bundle (cluster key, CA, node certificate) written 0600
``start``     ``exo-tui node`` detached: a systemd user unit where systemd --user works, else a
              new session (setsid) with a pid file and a log file
``handshake`` the node answers the authenticated handshake on its port

Running it again upgrades the project and restarts the node. :func:`stop_node` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

import exo_tui
from exo_tui.bootstrap.files import output_text, remote_files
from exo_tui.bootstrap.remote import (
    RemoteHost,
    _detect_script,
    _parse_detect,
    _pip_hint,
    _q,
    choose_python,
)
from exo_tui.bootstrap.ssh import BootstrapError, ConfirmHostKey, Target, connect, parse_target, run
from exo_tui.bootstrap.wheel import _tail, project_wheel
from exo_tui.events import BootstrapProgress, EventBus

UNIT = "exo-tui-node"
PYTHON_CANDIDATES = ("python3.13", "python3.12", "python3.11", "python3")
# Room the install needs: the dependencies (onnxruntime, mlx, numpy...) are some hundreds of MB.
NEED_FREE_BYTES = 1_500_000_000
NEED_FREE_BYTES_WHEELHOUSE_FACTOR = 3

Progress = Callable[[BootstrapProgress], Any]


@dataclass
class BootstrapOptions:
    accept_new_host_key: bool | str = False  # or the "SHA256:..." fingerprint the operator accepted
    confirm_host_key: ConfirmHostKey | None = None
    known_hosts: Path | None = None
    client_keys: Sequence[str | Path] | None = None  # None: ssh's defaults
    agent_path: str | None | bool = True  # True: $SSH_AUTH_SOCK; False: no agent
    ssh_config: Sequence[str | Path] | None | bool = True  # True: ~/.ssh/config; False: none
    python: str | None = None  # a remote interpreter path; default: the newest python3.x ≥ 3.11
    wheelhouse: Path | None = None  # local directory of wheels: install offline from it
    node_port: int = 52416
    node_name: str | None = None  # default: the host's hostname
    node_host: str = "0.0.0.0"  # the address the node listens on
    backend: str | None = None
    memory_limit_gb: float | None = None
    node_args: Sequence[str] = ()  # more `exo-tui node` arguments
    advertise: bool = True
    connect_timeout_s: float = 10.0
    handshake_timeout_s: float = 120.0  # the node profiles and benchmarks its device first
    home: Path | None = None  # exo-tui home holding the cluster (default: EXO_TUI_HOME / config dir)
    handshake_address: str | None = None  # where to reach the node; default: the SSH peer address
    use_systemd: bool | None = None  # None: when systemd --user works there
    pip_timeout_s: float = 1800.0
    install: bool = True  # False: skip venv/upload/install, only (re)start what is installed


@dataclass
class BootstrapResult:
    """What a bootstrap did. ``host``/``port``: where the coordinator reaches the node."""

    target: str
    remote: RemoteHost
    host: str
    port: int
    node_name: str
    node_id: str = ""
    manager: str = ""  # systemd | setsid
    durations_s: dict[str, float] = field(default_factory=dict)
    log_path: str = ""

    @property
    def total_s(self) -> float:
        return sum(self.durations_s.values())

    @property
    def address(self) -> str:
        return self.host


class _Reporter:
    def __init__(self, host: str, bus: EventBus | None, on_progress: Progress | None) -> None:
        self.host = host
        self.bus = bus
        self.on_progress = on_progress
        self.durations: dict[str, float] = {}

    def emit(self, step: str, status: str, message: str = "") -> None:
        ev = BootstrapProgress(host=self.host, step=step, status=status, message=message)
        if self.bus is not None:
            self.bus.publish(ev)
        if self.on_progress is not None:
            self.on_progress(ev)

    @contextlib.asynccontextmanager
    async def step(self, name: str, message: str = ""):  # noqa: ANN201
        self.emit(name, "running", message)
        t0 = time.monotonic()
        box: dict[str, str] = {"ok": ""}
        try:
            yield box
        except BootstrapError as exc:
            self.durations[name] = time.monotonic() - t0
            self.emit(exc.step, "failed", exc.message)
            raise
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            self.durations[name] = time.monotonic() - t0
            err = BootstrapError(name, f"lost the SSH session or a remote operation failed: {exc}")
            self.emit(name, "failed", err.message)
            raise err from exc
        self.durations[name] = time.monotonic() - t0
        self.emit(name, "ok", box["ok"])


# ---------------------------------------------------------------------- bootstrap


async def bootstrap(
    target: str | Target,
    options: BootstrapOptions | None = None,
    *,
    bus: EventBus | None = None,
    on_progress: Progress | None = None,
) -> BootstrapResult:
    """Install (or upgrade) exo-tui on ``target`` and (re)start its node agent.

    Raises :class:`BootstrapError` (``.step`` names the failing step; the message says what to do),
    or its subclasses ``HostKeyUnknown`` / ``HostKeyChanged``.
    """
    opts = options or BootstrapOptions()
    t = parse_target(target) if isinstance(target, str) else target
    rep = _Reporter(str(t), bus, on_progress)
    conn: asyncssh.SSHClientConnection | None = None
    try:
        async with rep.step("connect", f"ssh {t}") as box:
            conn = await _connect(t, opts)
            peer = conn.get_extra_info("peername")
            address = opts.handshake_address or (peer[0] if peer else t.host)
            box["ok"] = f"connected as {conn.get_extra_info('username')} to {address}"
        async with rep.step("detect", "OS, architecture, Python ≥ 3.11, disk space") as box:
            host = await _detect(conn, opts)
            box["ok"] = (
                f"{host.os} {host.arch}{' (Apple silicon)' if host.apple_silicon else ''}, "
                f"Python {host.python_version} at {host.python}"
            )
        if opts.install:
            async with rep.step("venv", "creating or reusing the venv") as box:
                await _make_venv(conn, host)
                box["ok"] = host.venv
            async with rep.step("upload", "the exo-tui wheel" + (" and the wheelhouse" if opts.wheelhouse else "")) as box:
                remote_wheel, remote_wh, nfiles = await _upload(conn, host, opts)
                box["ok"] = f"{Path(remote_wheel).name}" + (f" and {nfiles} wheelhouse files" if remote_wh else "")
            async with rep.step("install", "pip install (the dependencies take a while the first time)") as box:
                await _install(conn, host, remote_wheel, remote_wh, opts)
                box["ok"] = f"exo-tui {exo_tui.__version__} in {host.venv}"
        else:
            res = await run(conn, f"test -x {_q(host.exe)}", timeout_s=30)
            if res.exit_status != 0:
                raise BootstrapError("start", f"exo-tui is not installed in {host.venv} on {host.hostname}: "
                                              "run bootstrap without --no-install first")
        name = opts.node_name or host.hostname or t.host
        async with rep.step("key", "node bundle: cluster key, CA, node certificate") as box:
            bundle_path = await _write_bundle(conn, host, name, opts)
            box["ok"] = f"{bundle_path} (0600)"
        async with rep.step("start", f"exo-tui node --name {name} --port {opts.node_port}") as box:
            await _stop(conn, host)
            manager, log_path = await _start(conn, host, name, bundle_path, opts)
            box["ok"] = f"{manager}; log {log_path}"
        result = BootstrapResult(
            target=str(t), remote=host, host=address, port=opts.node_port, node_name=name,
            manager=manager, log_path=log_path,
        )
        async with rep.step("handshake", f"{address}:{opts.node_port}") as box:
            result.node_id = await _handshake(conn, host, result, opts)
            box["ok"] = f"node {name} ({result.node_id}) answers on {address}:{opts.node_port}"
        result.durations_s = dict(rep.durations)
        rep.emit("done", "ok", f"{name} is a node of this cluster ({result.total_s:.1f} s)")
        return result
    finally:
        if conn is not None:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.wait_closed()


async def _connect(t: Target, opts: BootstrapOptions) -> asyncssh.SSHClientConnection:
    return await connect(
        t,
        known_hosts=opts.known_hosts,
        accept_new_host_key=opts.accept_new_host_key,
        confirm_host_key=opts.confirm_host_key,
        client_keys=opts.client_keys,
        agent_path=opts.agent_path,
        ssh_config=opts.ssh_config,
        connect_timeout_s=opts.connect_timeout_s,
    )


async def _detect(conn: asyncssh.SSHClientConnection, opts: BootstrapOptions) -> RemoteHost:
    cands = list(PYTHON_CANDIDATES)
    if opts.python:
        cands = [opts.python]
    res = await run(conn, _detect_script(cands), timeout_s=60)
    if res.exit_status not in (0, None) and not res.stdout:
        raise BootstrapError("detect", f"the detection script failed: {_tail(str(res.stderr))}")
    host = _parse_detect(str(res.stdout))
    if not host.home or not host.data_dir:
        raise BootstrapError("detect", f"could not read the remote home directory: {_tail(str(res.stderr))}")
    choose_python(host, opts.python)
    need = NEED_FREE_BYTES
    if opts.wheelhouse:
        need = NEED_FREE_BYTES_WHEELHOUSE_FACTOR * sum(
            p.stat().st_size for p in Path(opts.wheelhouse).glob("*") if p.is_file()
        )
    if host.free_bytes is not None and host.free_bytes < need:
        raise BootstrapError(
            "detect",
            f"only {host.free_bytes / 1e6:.0f} MB free in {host.free_dir or host.home} on {host.hostname}; the install needs "
            f"about {need / 1e6:.0f} MB: free disk space there and run again",
        )
    return host


NO_SPACE_EXIT = 28  # the venv script's exit status when the disk is full (errno ENOSPC's number)
NO_SPACE_BYTES = 50_000_000  # a failed venv with less than this free there failed for want of space


def venv_script(host: RemoteHost) -> str:
    """The POSIX sh script that makes (or reuses) ``host``'s venv: prints ``reuse`` or ``created``;
    exits :data:`NO_SPACE_EXIT` where it failed for want of disk space (ENOSPC, or under
    :data:`NO_SPACE_BYTES` left there when it failed), else non-zero with the reason on stderr."""
    minor = ".".join(host.python_version.split(".")[:2])
    return f"""
set -e
mkdir -p {_q(host.data_dir)}
chmod 700 {_q(host.data_dir)}
v={_q(host.venv)}
if [ -x "$v/bin/python" ] && [ "$("$v/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = {minor} ]; then
  echo reuse
else
  rm -rf "$v"
  {_q(host.python)} - "$v" <<'EOF'
import errno, os, subprocess, sys, venv
target = sys.argv[1]
try:
    venv.EnvBuilder(with_pip=True, symlinks=os.name != "nt").create(target)
except (OSError, subprocess.CalledProcessError) as e:
    print(e, file=sys.stderr)
    st = os.statvfs(os.path.dirname(target))
    full = getattr(e, "errno", None) == errno.ENOSPC or st.f_bavail * st.f_frsize < {NO_SPACE_BYTES}
    sys.exit({NO_SPACE_EXIT} if full else 1)
EOF
  echo created
fi
"""


async def _make_venv(conn: asyncssh.SSHClientConnection, host: RemoteHost) -> None:
    res = await run(conn, venv_script(host), timeout_s=300)
    if res.exit_status != 0:
        err = _tail(f"{output_text(res.stdout)}\n{output_text(res.stderr)}")
        hint = "free disk space there" if res.exit_status == NO_SPACE_EXIT else "check the directory's owner and permissions"
        raise BootstrapError("venv", f"creating {host.venv} with {host.python} failed:\n{err}\n{hint}, then run again")


async def _upload(
    conn: asyncssh.SSHClientConnection, host: RemoteHost, opts: BootstrapOptions
) -> tuple[str, str | None, int]:
    wheel = await project_wheel(opts.wheelhouse)
    dist = f"{host.data_dir}/dist"
    remote_wh = f"{host.data_dir}/wheelhouse" if opts.wheelhouse else None
    async with remote_files(conn) as files:
        await files.makedirs(dist)
        remote_wheel = f"{dist}/{wheel.name}"
        await files.put(wheel, remote_wheel)
        n = 0
        if remote_wh and opts.wheelhouse:
            await files.makedirs(remote_wh)
            present = await files.sizes(remote_wh)
            for f in sorted(Path(opts.wheelhouse).iterdir()):
                if not f.is_file() or f.name.startswith("exo_tui-"):
                    continue
                if present.get(f.name) != f.stat().st_size:
                    await files.put(f, f"{remote_wh}/{f.name}")
                n += 1
    return remote_wheel, remote_wh, n


async def _install(
    conn: asyncssh.SSHClientConnection,
    host: RemoteHost,
    remote_wheel: str,
    remote_wh: str | None,
    opts: BootstrapOptions,
) -> None:
    pip = f"{_q(host.venv)}/bin/python -m pip --disable-pip-version-check --no-input"
    index = f"--no-index --find-links {_q(remote_wh)}" if remote_wh else ""
    w = _q(remote_wheel)
    # Dependencies first (a no-op when satisfied), then this wheel again even if the version is
    # unchanged, so a rerun always installs the code that bootstrap uploaded.
    script = f"""
set -e
{pip} install -q --no-compile {index} {w}
{pip} install -q --no-compile --force-reinstall --no-deps {w}
"""
    res = await run(conn, script, timeout_s=opts.pip_timeout_s)
    if res.exit_status != 0:
        out = f"{output_text(res.stdout)}\n{output_text(res.stderr)}"
        raise BootstrapError("install", f"pip failed on {host.hostname}:\n{_tail(out)}\n{_pip_hint(out)}")


async def _write_bundle(
    conn: asyncssh.SSHClientConnection, host: RemoteHost, name: str, opts: BootstrapOptions
) -> str:
    from exo_tui.net.security import ensure_cluster

    cluster = ensure_cluster(opts.home)
    bundle = cluster.node_bundle(name)
    path = f"{host.data_dir}/node.bundle"
    tmp = f"{path}.tmp"
    async with remote_files(conn) as files:
        await files.write(tmp, bundle, 0o600)
    res = await run(conn, f"mv -f {_q(tmp)} {_q(path)} 2>/dev/null; chmod 600 {_q(path)}; ls -l {_q(path)}")
    if res.exit_status != 0 or not str(res.stdout).startswith("-rw-------"):
        raise BootstrapError("key", f"could not write {path} with mode 0600: {_tail(str(res.stderr) or str(res.stdout))}")
    return path


def _node_argv(host: RemoteHost, name: str, bundle_path: str, opts: BootstrapOptions) -> list[str]:
    argv = [
        host.exe, "node", "--host", opts.node_host, "--port", str(opts.node_port),
        "--name", name, "--key-file", bundle_path,
    ]
    if opts.backend:
        argv += ["--backend", opts.backend]
    if opts.memory_limit_gb:
        argv += ["--memory-limit", str(opts.memory_limit_gb)]
    if not opts.advertise:
        argv.append("--no-advertise")
    argv += list(opts.node_args)
    return argv


def _unit_text(argv: list[str], host: RemoteHost) -> str:
    return f"""[Unit]
Description=exo-tui node agent
After=network-online.target

[Service]
ExecStart={" ".join(shlex.quote(a) for a in argv)}
Restart=on-failure
RestartSec=3
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=default.target
"""


async def _start(
    conn: asyncssh.SSHClientConnection, host: RemoteHost, name: str, bundle_path: str, opts: BootstrapOptions
) -> tuple[str, str]:
    argv = _node_argv(host, name, bundle_path, opts)
    log_path = f"{host.data_dir}/node.log"
    use_systemd = host.systemd_user if opts.use_systemd is None else opts.use_systemd
    if use_systemd:
        unit_dir = f"{host.home}/.config/systemd/user"
        async with remote_files(conn) as files:
            await files.makedirs(unit_dir)
            await files.write(f"{unit_dir}/{UNIT}.service", _unit_text(argv, host).encode())
        res = await run(
            conn,
            f"systemctl --user daemon-reload && systemctl --user enable {UNIT} >/dev/null 2>&1; "
            f"systemctl --user restart {UNIT} && (loginctl enable-linger \"$(id -un)\" >/dev/null 2>&1 || true)",
            timeout_s=60,
        )
        if res.exit_status == 0:
            return "systemd", f"journalctl --user -u {UNIT}"
        if opts.use_systemd:
            raise BootstrapError("start", f"systemctl --user could not start {UNIT}: {_tail(str(res.stderr))}")
        # systemd --user is there but does not work for this session: fall back.
    pid_path = f"{host.data_dir}/node.pid"
    # The venv's Python starts the node in a new session (setsid), stdio to the log, and writes
    # the pid file; that works on Linux and macOS alike (macOS has no setsid command).
    starter = (
        "import os, subprocess, sys\n"
        "argv, log, pidf = sys.argv[1:-2], sys.argv[-2], sys.argv[-1]\n"
        "out = open(log, 'ab')\n"
        "p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,"
        " start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED='1'))\n"
        "open(pidf, 'w').write(str(p.pid))\n"
        "print(p.pid)\n"
    )
    cmd = " ".join(
        [f"{_q(host.venv)}/bin/python", "-c", shlex.quote(starter), *map(shlex.quote, argv), _q(log_path), _q(pid_path)]
    )
    res = await run(conn, f": > {_q(log_path)}; {cmd}", timeout_s=60)
    pid = str(res.stdout).strip()
    if res.exit_status != 0 or not pid.isdigit():
        raise BootstrapError("start", f"could not start the node: {_tail(str(res.stderr) or str(res.stdout))}")
    await asyncio.sleep(1.0)
    alive = await run(conn, f"kill -0 {pid} 2>/dev/null && echo alive; tail -n 15 {_q(log_path)}", timeout_s=30)
    if not str(alive.stdout).startswith("alive"):
        raise BootstrapError(
            "start",
            f"the node exited at once; the end of {log_path}:\n{_tail(str(alive.stdout), 15)}\n"
            "fix what it says (or run the command by hand on the host) and run bootstrap again",
        )
    return "setsid", log_path


async def _handshake(
    conn: asyncssh.SSHClientConnection, host: RemoteHost, result: BootstrapResult, opts: BootstrapOptions
) -> str:
    from exo_tui.net.client import connect as net_connect
    from exo_tui.net.codec import call
    from exo_tui.net.errors import AuthError, ConnectError, HandshakeError, ProtocolMismatch
    from exo_tui.net.messages import Profile, ProfileAsk
    from exo_tui.net.security import ensure_cluster

    security = ensure_cluster(opts.home).security()
    deadline = time.monotonic() + opts.handshake_timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            node = await net_connect(result.address, result.port, security=security, timeout=opts.connect_timeout_s)
        except (AuthError, ProtocolMismatch) as exc:
            raise BootstrapError(
                "handshake", f"the node at {result.address}:{result.port} refused this cluster's key: {exc}"
            ) from None
        except (ConnectError, HandshakeError, OSError) as exc:
            last = str(exc)
            # Still starting (profiling, benchmark)? Or did it die?
            if result.manager == "setsid":
                pid_alive = await run(
                    conn,
                    f"kill -0 \"$(cat {_q(host.data_dir)}/node.pid)\" 2>/dev/null && echo alive",
                    timeout_s=30,
                )
                if "alive" not in str(pid_alive.stdout):
                    tail = await run(conn, f"tail -n 20 {_q(result.log_path)}", timeout_s=30)
                    raise BootstrapError(
                        "handshake",
                        f"the node stopped before it answered; the end of {result.log_path}:\n"
                        f"{_tail(str(tail.stdout), 20)}",
                    ) from None
            await asyncio.sleep(0.5)
            continue
        try:
            profile = (await call(node, ProfileAsk(), Profile, timeout=opts.connect_timeout_s)).profile
            return str(profile.get("node_id", ""))
        finally:
            await node.aclose()
    raise BootstrapError(
        "handshake",
        f"the node did not answer on {result.address}:{result.port} within {opts.handshake_timeout_s:g} s "
        f"(last: {last}). Check that port {result.port} is open in the host's firewall and read {result.log_path}",
    )


async def bootstrap_host(
    target: str | Target,
    *,
    accept_new_host_key: bool | str = False,
    confirm_host_key: ConfirmHostKey | None = None,
    on_event: Progress | None = None,
    bus: EventBus | None = None,
    home: Path | None = None,
    **options: Any,
) -> BootstrapResult:
    """:func:`bootstrap` with keyword options (what the coordinator calls).

    ``options`` are :class:`BootstrapOptions` fields (``wheelhouse``, ``python``, ``node_port``...).
    """
    opts = BootstrapOptions(accept_new_host_key=accept_new_host_key, confirm_host_key=confirm_host_key,
                            home=home, **options)
    return await bootstrap(target, opts, bus=bus, on_progress=on_event)


# ---------------------------------------------------------------------- stop


async def _stop(conn: asyncssh.SSHClientConnection, host: RemoteHost) -> str:
    """Stop the node whichever way it was started. Returns what was stopped."""
    pid_path = f"{host.data_dir}/node.pid"
    script = f"""
stopped=""
if command -v systemctl >/dev/null 2>&1 && systemctl --user is-active --quiet {UNIT} 2>/dev/null; then
  systemctl --user stop {UNIT} && stopped="systemd unit {UNIT}"
fi
if [ -f {_q(pid_path)} ]; then
  pid=$(cat {_q(pid_path)})
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ps -p "$pid" -o command= 2>/dev/null | grep -q "exo-tui"; then
    kill "$pid"
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    stopped="${{stopped:+$stopped, }}pid $pid"
  fi
  rm -f {_q(pid_path)}
fi
echo "stopped=$stopped"
"""
    res = await run(conn, script, timeout_s=60)
    for line in str(res.stdout).splitlines():
        if line.startswith("stopped="):
            return line.partition("=")[2]
    return ""


async def stop_node(
    target: str | Target,
    options: BootstrapOptions | None = None,
    *,
    bus: EventBus | None = None,
    on_progress: Progress | None = None,
) -> str:
    """Stop the node agent that bootstrap started on ``target``. Returns what was stopped ("" if none)."""
    opts = options or BootstrapOptions()
    t = parse_target(target) if isinstance(target, str) else target
    rep = _Reporter(str(t), bus, on_progress)
    conn: asyncssh.SSHClientConnection | None = None
    try:
        async with rep.step("connect", f"ssh {t}"):
            conn = await _connect(t, opts)
        async with rep.step("stop") as box:
            res = await run(conn, 'echo "home=$HOME"; echo "data=${XDG_DATA_HOME:-$HOME/.local/share}/exo-tui"', timeout_s=30)
            host = _parse_detect(str(res.stdout))
            stopped = await _stop(conn, host)
            box["ok"] = f"stopped {stopped}" if stopped else "no node agent was running"
        return stopped
    finally:
        if conn is not None:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.wait_closed()
