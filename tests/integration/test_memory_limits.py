"""``exo-tui serve --local-nodes 3 --local-memory-limit GB --context 1024`` on the default model,
as an operator types it: it serves, or it stops with one line saying what limit it needs (never a
traceback). The plan gives a node only what the node's own accounting accepts: a load it refuses
(its runtime grew since its report: it opened the model's file) makes the plan again with the room
it said it has (exo_tui/cluster/room.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.helpers.benchmarks import share_benchmarks
from tests.helpers.sshd import free_port

pytestmark = pytest.mark.slow


def _serve(tmp_path: Path, limit_gb: float, *, ask: bool) -> tuple[int | None, str, str]:
    """(return code, or None while it serves; its stdout's first line; its stderr), after a chat
    of a few tokens where it serves and ``ask``."""
    home = tmp_path / f"home-{limit_gb}"
    home.mkdir(mode=0o700)
    share_benchmarks(home)
    config = tmp_path / "config.yaml"
    config.write_text("scheduler:\n  fault_tolerance:\n    heartbeat_timeout: 10\n")
    env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(config)}
    env.pop("EXO_TUI_API_KEY", None)
    port = free_port()
    err = tmp_path / f"serve-{limit_gb}.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "exo_tui.cli", "serve", "--local-nodes", "3", "--local-memory-limit",
                                 str(limit_gb), "--context", "1024", "--api-port", str(port)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()  # the ready line, or EOF when it stopped
        if line.startswith(READY_PREFIX) and ask:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
                "model": "smollm2-135m", "temperature": 0, "max_tokens": 4,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
        code = proc.wait(timeout=60) if not line else proc.poll()
        return code, line, err.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.mark.parametrize("limit_gb", [0.2, 0.3])
def test_serve_under_a_limit_that_holds_the_model_serves(tmp_path: Path, limit_gb: float) -> None:
    code, line, err = _serve(tmp_path, limit_gb, ask=limit_gb == 0.2)
    assert code is None and line.startswith(READY_PREFIX), err[-3000:]
    assert "Traceback" not in err


def test_serve_under_too_small_a_limit_says_in_one_line_what_limit_it_needs(tmp_path: Path) -> None:
    code, line, err = _serve(tmp_path, 0.12, ask=False)
    assert code == 2 and not line, err[-3000:]
    assert "Traceback" not in err
    said = [x for x in err.splitlines() if x.startswith("exo-tui serve:")]
    assert len(said) == 1, err[-3000:]
    needed = re.search(r"memory limit of (\d+\.\d+) GB or more", said[0])
    assert needed is not None, said[0]
    # the limit it names is one that serves
    code, line, err = _serve(tmp_path, float(needed.group(1)), ask=True)
    assert code is None and line.startswith(READY_PREFIX), err[-3000:]
