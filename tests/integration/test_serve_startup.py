"""A script that starts ``exo-tui serve --local-nodes 2`` and sends a chat at once gets its answer,
on OpenAI's API and on Ollama's: the request waits for the first plan (as the console's does), it is
not refused with a 503."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.helpers.sshd import free_port

pytestmark = pytest.mark.slow


def test_a_chat_sent_as_serve_starts_waits_for_the_plan_and_is_answered(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (tmp_path / "config.yaml").write_text("scheduler:\n  fault_tolerance:\n    heartbeat_timeout: 10\n")
    env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(tmp_path / "config.yaml")}
    env.pop("EXO_TUI_API_KEY", None)
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "exo_tui.cli", "serve", "--local-nodes", "2", "--api-port", str(port)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "w"), text=True, env=env,
                            start_new_session=True)
    try:
        while True:  # the first moment the API accepts a connection
            assert proc.poll() is None, (tmp_path / "serve.err").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        opened_s = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=10).json()["ready"] is False  # no plan yet
        question = [{"role": "user", "content": "What is the capital of France?"}]
        with ThreadPoolExecutor(2) as pool:  # both sent before the plan is ready
            asked = pool.submit(ollama.Client(host=url, timeout=600).chat, model="smollm2-135m", messages=question,
                                options={"temperature": 0, "num_predict": 12})
            r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": "smollm2-135m", "temperature": 0, "max_tokens": 12, "messages": question})
            assert "Paris" in asked.result().message.content
        print(f"\nAPI open {opened_s:.2f} s after the start; answered {time.monotonic() - t0:.1f} s after it")
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        assert proc.stdout.readline().startswith(READY_PREFIX)
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["ready"] is True and health["status"] == "ok"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
