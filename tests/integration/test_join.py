"""`exo-tui join-token` then `exo-tui node --join TOKEN`: a node joins without SSH."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from exo_tui.discovery.join import serve_join
from exo_tui.net.client import connect
from exo_tui.net.security import ensure_cluster
from tests.helpers.sshd import free_port

ROOT = Path(__file__).resolve().parents[2]


async def test_node_joins_with_a_token_and_the_token_is_then_spent(tmp_path: Path) -> None:
    home = tmp_path / "coordinator"
    node_home = tmp_path / "node"
    home.mkdir(mode=0o700)
    node_home.mkdir(mode=0o700)
    join_port, node_port = free_port(), free_port()
    env = dict(os.environ, EXO_TUI_HOME=str(home))
    made = subprocess.run(
        [sys.executable, "-m", "exo_tui.cli", "join-token", "--address", f"127.0.0.1:{join_port}", "--ttl", "5"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[0]
    assert "exo-tui node --join" in made.stderr

    server = await serve_join("127.0.0.1", join_port, home=home)
    node_env = dict(os.environ, EXO_TUI_HOME=str(node_home))
    cmd = [sys.executable, "-m", "exo_tui.cli", "node", "--join", token, "--host", "127.0.0.1", "--port",
           str(node_port), "--name", "joiner", "--no-benchmark", "--no-advertise"]
    node = subprocess.Popen(cmd, env=node_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        security = ensure_cluster(home).security()
        conn = None
        for _ in range(120):
            if node.poll() is not None:
                raise AssertionError(node.stdout.read().decode())
            try:
                conn = await connect("127.0.0.1", node_port, security=security, timeout=2)
                break
            except Exception:
                await asyncio.sleep(0.25)
        assert conn is not None, "the joined node never answered the handshake"
        assert conn.peer_name == "joiner"
        await conn.aclose()
        assert server.joined == ["joiner"]
        assert (node_home / "node.bundle").stat().st_mode & 0o777 == 0o600

        # The same token again: refused, and the node says why.
        cmd2 = [*cmd[:cmd.index("--port") + 1], str(free_port()), "--name", "twice", "--no-benchmark", "--no-advertise"]
        proc = await asyncio.create_subprocess_exec(
            *cmd2, env=dict(os.environ, EXO_TUI_HOME=str(tmp_path / "n2")), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _out, err = await asyncio.wait_for(proc.communicate(), 60)
        again = subprocess.CompletedProcess(cmd2, proc.returncode, "", err.decode())
        assert again.returncode != 0
        assert "already used" in again.stderr
    finally:
        node.terminate()
        try:
            node.wait(10)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(5)
        await server.close()


async def test_join_token_serve_waits_for_the_node_and_exits(tmp_path: Path) -> None:
    from exo_tui.discovery.join import EndpointUnreachable, fetch_bundle

    home = tmp_path / "coordinator"
    home.mkdir(mode=0o700)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "exo_tui.cli", "join-token", "--serve", "--port", str(port), "--address",
        f"127.0.0.1:{port}", env=dict(os.environ, EXO_TUI_HOME=str(home)), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        token = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        bundle = None
        for _ in range(40):  # until it listens
            try:
                bundle = await fetch_bundle(token, name="served", timeout_s=2)
                break
            except EndpointUnreachable:
                await asyncio.sleep(0.25)
        assert bundle is not None and b'"name": "served"' in bundle
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0 and "node served joined" in err.decode()
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
