"""``exo-tui serve --join TOKEN``: a coordinator joins a set as a standby with a one-time token
from ``exo-tui join-token --coordinator``, from an exo-tui home of its own (it gets the cluster's
secrets with the token), and holds the state the set had before it came; a set of one admits a
second so. A node's token is refused. Two serve processes (a set of one, then the one that joins),
no node agents."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.factory import write_tiny_llama
from tests.helpers.sshd import free_port
from tests.integration.cluster_helpers import stop_groups

pytestmark = pytest.mark.slow

WAIT_S = 90.0  # fails a hung test only


def serve(d: Path, name: str, home: Path, config: str, *args: str) -> subprocess.Popen[str]:
    (d / f"{name}.yaml").write_text(config)
    env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(d / f"{name}.yaml")}
    env.pop("EXO_TUI_API_KEY", None)
    with open(d / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "exo_tui.cli", "serve", "--model", str(d / "tiny-join.gguf"), *args],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exo_tui.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EXO_TUI_HOME": str(home)})


def test_a_coordinator_joins_a_set_with_a_token_and_catches_up(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny-join.gguf", weight_type="Q8_0", seed=5)
    home_a, home_b = tmp_path / "home-a", tmp_path / "home-b"
    home_a.mkdir(mode=0o700)
    join_port, api_a, api_b = free_port(), free_port(), free_port()
    raft_a, raft_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{api_a}", f"http://127.0.0.1:{api_b}"
    procs = []
    try:
        # a set of one: it leads alone, and admits the second (whose vote the change needs) once it starts
        procs.append(serve(tmp_path, "a", home_a, f"network:\n  join:\n    host: 127.0.0.1\n    port: {join_port}\n",
                           "--api-port", str(api_a), "--coordinators", f"127.0.0.1:{raft_a}", "--coordinator-port",
                           str(raft_a), "--state-dir", str(tmp_path / "state-a")))
        assert procs[-1].stdout is not None and procs[-1].stdout.readline().startswith(READY_PREFIX)
        deadline = time.monotonic() + WAIT_S
        while not httpx.get(f"{url_a}/health", timeout=10).json()["in_charge"]:
            assert time.monotonic() < deadline, "the set of one did not take charge"
            time.sleep(0.1)
        added = httpx.post(f"{url_a}/v1/cluster/hosts", json={"host": "10.7.7.7"}, timeout=30)
        assert added.status_code == 200, added.text

        node_token = cli(home_a, "join-token", "--address", f"127.0.0.1:{join_port}").stdout.strip()
        refused = serve(tmp_path, "refused", tmp_path / "home-r", "network:\n  join:\n    enabled: false\n",
                        "--api-port", str(free_port()), "--join", node_token, "--coordinator-port", str(free_port()),
                        "--state-dir", str(tmp_path / "state-r"))
        assert refused.wait(60) == 2
        assert "this join token is for a node, not a coordinator" in (tmp_path / "refused.err").read_text()

        made = cli(home_a, "join-token", "--coordinator", "--address", f"127.0.0.1:{join_port}")
        assert made.returncode == 0, made.stderr
        procs.append(serve(tmp_path, "b", home_b, "network:\n  join:\n    enabled: false\n", "--api-port", str(api_b),
                           "--join", made.stdout.strip(), "--coordinator-port", str(raft_b),
                           "--state-dir", str(tmp_path / "state-b")))
        line = procs[-1].stdout.readline() if procs[-1].stdout else ""
        assert line.startswith(READY_PREFIX), (tmp_path / "b.err").read_text()[-3000:]
        deadline = time.monotonic() + WAIT_S
        while True:
            h = httpx.get(f"{url_b}/health", timeout=10).json()
            # the join tokens' records (made in the first's home) are replicated state too
            if h["role"] == "standby" and h["leader_api"] == url_a and "10.7.7.7" in h["hosts"] \
                    and len(h["join_tokens"]) == 2:
                break
            assert time.monotonic() < deadline, f"the joined coordinator did not catch up: {h}"
            time.sleep(0.1)
        assert (home_b / "cluster" / "cluster.key").read_bytes() == (home_a / "cluster" / "cluster.key").read_bytes()
        assert sorted(c["role"] for c in httpx.get(f"{url_a}/health", timeout=10).json()["coordinators"]) == \
            ["leader", "standby"]
        # a change made through the new member reaches the leader, a majority, and the new member
        assert httpx.post(f"{url_b}/v1/cluster/hosts", json={"host": "10.7.7.8"}, timeout=30).status_code == 200
        deadline = time.monotonic() + WAIT_S
        while "10.7.7.8" not in httpx.get(f"{url_b}/health", timeout=10).json()["hosts"]:
            assert time.monotonic() < deadline, "the new member did not apply a later change"
            time.sleep(0.1)
    finally:
        stop_groups(procs)
