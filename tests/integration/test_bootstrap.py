"""Bootstrap over a real OpenSSH sshd on loopback, as a throwaway user (root only)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import stat
import time
from pathlib import Path

import psutil
import pytest

from exo_tui.bootstrap import (
    BootstrapError,
    HostKeyChanged,
    HostKeyUnknown,
    bootstrap,
    bootstrap_host,
    connect,
    stop_node,
)
from exo_tui.events import BootstrapProgress, EventBus
from tests.helpers.sshd import KeyPair, free_port

pytestmark = pytest.mark.root


async def _connect(host, known_hosts: Path, **kw):  # noqa: ANN001, ANN202
    opts = dict(client_keys=[host.client.private], agent_path=False, ssh_config=False, connect_timeout_s=5.0)
    opts.update(kw)
    return await connect(host.target, known_hosts=known_hosts, **opts)


async def _whoami(conn) -> str:  # noqa: ANN001
    res = await conn.run("id -un", check=True)
    conn.close()
    await conn.wait_closed()
    return str(res.stdout).strip()


# ---------------------------------------------------------------------- host keys


async def test_unknown_host_key_is_refused_without_the_flag(ssh_host, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    with pytest.raises(HostKeyUnknown) as info:
        await _connect(ssh_host, kh)
    err = info.value
    assert err.step == "connect"
    expected_fp = ssh_host.server.host_key.public_line  # the fingerprint names this very key
    from asyncssh import import_public_key

    assert err.fingerprint == import_public_key(expected_fp).get_fingerprint("sha256")
    assert "--accept-new-host-key" in str(err)
    assert not kh.exists() or kh.read_text() == ""  # nothing recorded


async def test_confirmation_callback_sees_the_fingerprint_and_decides(ssh_host, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    seen: list[str] = []

    async def no(err: HostKeyUnknown) -> bool:
        seen.append(err.fingerprint)
        return False

    with pytest.raises(HostKeyUnknown):
        await _connect(ssh_host, kh, confirm_host_key=no)
    assert len(seen) == 1 and seen[0].startswith("SHA256:")
    assert not kh.exists()

    async def yes(err: HostKeyUnknown) -> bool:
        seen.append(err.fingerprint)
        return True

    conn = await _connect(ssh_host, kh, confirm_host_key=yes)
    assert await _whoami(conn) == ssh_host.user.name
    assert seen[1] == seen[0]
    assert f"[127.0.0.1]:{ssh_host.server.port} ssh-ed25519 " in kh.read_text()


async def test_accepted_key_is_recorded_and_then_trusted(ssh_host, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    conn = await _connect(ssh_host, kh, accept_new_host_key=True)
    assert await _whoami(conn) == ssh_host.user.name
    recorded = kh.read_text()
    assert ssh_host.server.host_key.public_line.split()[1] in recorded
    conn = await _connect(ssh_host, kh)  # no flag needed any more
    assert await _whoami(conn) == ssh_host.user.name
    assert kh.read_text() == recorded  # not recorded twice


async def test_accepting_a_fingerprint_accepts_only_that_key(ssh_host, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    with pytest.raises(HostKeyUnknown) as info:
        await _connect(ssh_host, kh, accept_new_host_key="SHA256:not-the-key-that-was-shown")
    assert not kh.exists()
    conn = await _connect(ssh_host, kh, accept_new_host_key=info.value.fingerprint)
    assert await _whoami(conn) == ssh_host.user.name
    assert ssh_host.server.host_key.public_line.split()[1] in kh.read_text()


async def test_an_ssh_config_alias_works_as_with_ssh(ssh_host, tmp_path: Path) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host labbox\n  HostName 127.0.0.1\n  Port {ssh_host.server.port}\n  User {ssh_host.user.name}\n"
                   f"  IdentityFile {ssh_host.client.private}\n")
    kh = ssh_host.known_hosts(tmp_path / "known_hosts")
    conn = await connect("labbox", known_hosts=kh, agent_path=False, ssh_config=[cfg], connect_timeout_s=5)
    assert await _whoami(conn) == ssh_host.user.name


async def test_changed_host_key_is_always_refused(ssh_host, tmp_path: Path) -> None:
    other = KeyPair.generate(tmp_path / "other_host_key", comment="impostor")
    kh = ssh_host.server.write_known_hosts(tmp_path / "known_hosts", key=other)
    before = kh.read_text()
    for accept in (False, True):
        with pytest.raises(HostKeyChanged) as info:
            await _connect(ssh_host, kh, accept_new_host_key=accept, confirm_host_key=_always_yes)
        msg = str(info.value)
        assert "CHANGED" in msg and "ssh-keygen -R" in msg and str(kh) in msg
    assert kh.read_text() == before  # the old entry stays until the operator removes it


async def _always_yes(err: HostKeyUnknown) -> bool:
    raise AssertionError("a changed key must never be offered for confirmation")


# ---------------------------------------------------------------------- auth and reachability


async def test_wrong_user_key_gives_a_clear_error(ssh_host, tmp_path: Path) -> None:
    kh = ssh_host.known_hosts(tmp_path / "known_hosts")
    with pytest.raises(BootstrapError) as info:
        await _connect(ssh_host, kh, client_keys=[ssh_host.wrong.private])
    msg = str(info.value)
    assert info.value.step == "connect"
    assert "permission denied" in msg and ssh_host.user.name in msg and "ssh-copy-id" in msg


async def test_refused_port_gives_a_clear_error_at_once(ssh_host, tmp_path: Path) -> None:
    """A refusal is reported as one, not waited out as a timeout (the timeout, 60 s, only ends a
    hung test, and would say "within")."""
    port = free_port()
    with pytest.raises(BootstrapError) as info:
        await connect(f"nobody@127.0.0.1:{port}", known_hosts=tmp_path / "kh", agent_path=False, ssh_config=False,
                      client_keys=[ssh_host.client.private], connect_timeout_s=60.0)
    assert info.value.step == "connect"
    assert "refused" in str(info.value) and "sshd" in str(info.value) and "within" not in str(info.value)


async def test_silent_port_gives_a_clear_error_within_the_connect_timeout(ssh_host, tmp_path: Path) -> None:
    # A listener that accepts TCP but never speaks SSH: a firewall/black-hole stand-in on loopback.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(BootstrapError) as info:
            await connect(f"nobody@127.0.0.1:{port}", known_hosts=tmp_path / "kh", agent_path=False,
                          ssh_config=False, client_keys=[ssh_host.client.private], connect_timeout_s=1.5)
        elapsed = time.monotonic() - t0
    assert elapsed >= 1.4  # it waited for the timeout (a busy machine only makes this longer)
    assert info.value.step == "connect" and "within 1.5 s" in str(info.value)


# ---------------------------------------------------------------------- the whole bootstrap


def _node_pids(user) -> list[int]:  # noqa: ANN001
    out = []
    for p in user.processes():
        try:
            if "node" in p.cmdline() and any("exo-tui" in a for a in p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


async def test_bootstrap_installs_starts_upgrades_and_stops_a_node(
    ssh_host, wheelhouse: Path, exo_home: Path, tmp_path: Path
) -> None:
    kh = ssh_host.known_hosts(tmp_path / "known_hosts")
    port = free_port()
    opts = ssh_host.options(
        kh, wheelhouse=wheelhouse, node_port=port, node_host="127.0.0.1",
        node_args=["--no-benchmark", "--precision", "int8", "--threads", "1"],  # what `bootstrap --precision` passes
        advertise=False, handshake_timeout_s=90,
    )
    bus = EventBus()
    sub = bus.subscribe()
    printed: list[BootstrapProgress] = []

    t0 = time.monotonic()
    result = await bootstrap(ssh_host.target, opts, bus=bus, on_progress=printed.append)
    first_s = time.monotonic() - t0
    print(f"\nfirst bootstrap {first_s:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in result.durations_s.items()))

    events = []
    while (e := sub.get_nowait()) is not None:
        events.append(e)
    assert events == printed
    ok_steps = [e.step for e in events if e.status == "ok"]
    assert ok_steps == ["connect", "detect", "venv", "upload", "install", "key", "start", "handshake", "done"]
    assert all(e.host == ssh_host.target for e in events)

    assert result.node_id.startswith("n-")
    assert result.remote.python.endswith("python3.11") or result.remote.python.endswith("python3")
    assert result.remote.os == "Linux" and not result.remote.apple_silicon
    data = ssh_host.user.home / ".local/share/exo-tui"
    assert result.remote.data_dir == str(data)
    bundle = data / "node.bundle"
    st = bundle.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == ssh_host.user.uid
    assert (data / "venv/bin/exo-tui").exists()
    pids = _node_pids(ssh_host.user)
    assert len(pids) == 1
    assert int((data / "node.pid").read_text()) == pids[0]

    # The node holds our cluster: an authenticated connection works from here.
    from exo_tui.net.client import connect as net_connect
    from exo_tui.net.security import ensure_cluster

    conn = await net_connect("127.0.0.1", port, security=ensure_cluster(exo_home).security(), timeout=5)
    reply = await conn.call("profile", timeout=5)
    assert reply.body["profile"]["node_id"] == result.node_id
    engine = reply.body["profile"]["engine"]  # the node runs as told on its command line
    assert engine["precision"] == "int8" and engine["threads"] == "1"
    await conn.aclose()

    # Again: upgrade and restart (a new process, same node id).
    t0 = time.monotonic()
    kw = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
          if f.name not in ("accept_new_host_key", "confirm_host_key", "home")}
    seen: list[BootstrapProgress] = []
    again = await bootstrap_host(ssh_host.target, on_event=seen.append, home=exo_home, **kw)  # the coordinator's call
    assert seen[-1].step == "done" and (again.host, again.port) == ("127.0.0.1", port)
    print(f"second bootstrap {time.monotonic() - t0:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in again.durations_s.items()))
    assert again.node_id == result.node_id
    new_pids = _node_pids(ssh_host.user)
    assert len(new_pids) == 1 and new_pids != pids

    stopped = await stop_node(ssh_host.target, opts)
    assert f"pid {new_pids[0]}" in stopped
    await asyncio.sleep(0.2)
    assert _node_pids(ssh_host.user) == []
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    assert await stop_node(ssh_host.target, opts) == ""  # nothing left to stop


async def test_missing_python_names_the_step_and_what_to_do(ssh_host, tmp_path: Path) -> None:
    opts = ssh_host.options(ssh_host.known_hosts(tmp_path / "kh"), python="/opt/no-such/python3.12")
    with pytest.raises(BootstrapError) as info:
        await bootstrap(ssh_host.target, opts)
    assert info.value.step == "detect"
    assert "--python" in str(info.value) and "3.11" in str(info.value)


async def test_pip_failure_reports_pips_last_lines_and_a_hint(fresh_ssh_host, tmp_path: Path, exo_home: Path) -> None:
    empty = tmp_path / "wheelhouse"
    empty.mkdir()
    opts = fresh_ssh_host.options(fresh_ssh_host.known_hosts(tmp_path / "kh"), wheelhouse=empty)
    with pytest.raises(BootstrapError, match="not installed .* without --no-install"):
        await bootstrap(fresh_ssh_host.target, dataclasses.replace(opts, install=False))
    events: list[BootstrapProgress] = []
    with pytest.raises(BootstrapError) as info:
        await bootstrap(fresh_ssh_host.target, opts, on_progress=events.append)
    err = info.value
    assert err.step == "install"
    assert "No matching distribution" in str(err) or "Could not find a version" in str(err)
    assert "--wheelhouse" in str(err)
    assert events[-1].step == "install" and events[-1].status == "failed"


async def test_too_little_disk_space_is_reported_before_installing(fresh_ssh_host, tmp_path: Path) -> None:
    import subprocess

    share = fresh_ssh_host.user.home / ".local" / "share"
    share.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m,mode=0755", "tmpfs", str(share)], check=True)
    try:
        os.chown(share, fresh_ssh_host.user.uid, fresh_ssh_host.user.gid)
        opts = fresh_ssh_host.options(fresh_ssh_host.known_hosts(tmp_path / "kh"))
        with pytest.raises(BootstrapError) as info:
            await bootstrap(fresh_ssh_host.target, opts)
        assert info.value.step == "detect"
        assert "MB free" in str(info.value) and "free disk space" in str(info.value)
    finally:
        subprocess.run(["umount", str(share)], check=False)


async def test_permission_denied_in_the_data_dir_is_reported(fresh_ssh_host, tmp_path: Path) -> None:
    share = fresh_ssh_host.user.home / ".local" / "share"
    share.mkdir(parents=True)
    os.chmod(share, 0o555)  # owned by root, not writable by the user
    opts = fresh_ssh_host.options(fresh_ssh_host.known_hosts(tmp_path / "kh"))
    with pytest.raises(BootstrapError) as info:
        await bootstrap(fresh_ssh_host.target, opts)
    assert info.value.step == "venv"
    assert "Permission denied" in str(info.value) and "permissions" in str(info.value)


def test_cli_refuses_an_unknown_key_without_a_terminal_and_says_what_to_do(ssh_host, tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["EXO_TUI_HOME"] = str(tmp_path / "home")
    cmd = [sys.executable, "-m", "exo_tui.cli", "bootstrap", ssh_host.target, "--known-hosts", str(tmp_path / "kh"),
           "-i", str(ssh_host.client.private), "--connect-timeout", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 1, res.stderr
    assert "step connect failed" in res.stderr and "--accept-new-host-key" in res.stderr
    assert "SHA256:" in res.stderr

    cmd += ["--stop", "--accept-new-host-key"]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    assert "no node agent was running" in res.stdout
    assert ssh_host.server.host_key.public_line.split()[1] in (tmp_path / "kh").read_text()


async def test_a_host_without_sftp_gets_its_files_over_the_ssh_channel(
    sftpless_ssh_host, wheelhouse: Path, exo_home: Path, tmp_path: Path
) -> None:
    host = sftpless_ssh_host
    kh = host.known_hosts(tmp_path / "known_hosts")
    conn = await _connect(host, kh)
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - the host really refuses SFTP
            await conn.start_sftp_client()
    finally:
        conn.close()
        await conn.wait_closed()
    port = free_port()
    opts = host.options(kh, wheelhouse=wheelhouse, node_port=port, node_host="127.0.0.1",
                        node_args=["--no-benchmark", "--threads", "1"], advertise=False, handshake_timeout_s=90)
    result = await bootstrap(host.target, opts)
    data = host.user.home / ".local/share/exo-tui"
    bundle = data / "node.bundle"
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600 and bundle.stat().st_uid == host.user.uid
    assert not list(data.rglob("*.part"))  # every file arrived whole and was moved into place
    from exo_tui.net.client import connect as net_connect
    from exo_tui.net.security import ensure_cluster

    node = await net_connect("127.0.0.1", port, security=ensure_cluster(exo_home).security(), timeout=5)
    assert (await node.call("profile", timeout=5)).body["profile"]["node_id"] == result.node_id
    await node.aclose()
    assert await stop_node(host.target, opts)
