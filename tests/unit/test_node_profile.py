"""The node's profile: stable id, device facts, the measured layer time, the CLI's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exo_tui.node.profile import NodeProfile, device_profile, live_metrics, stable_node_id, time_layers


def test_node_id_is_stable_per_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    a = stable_node_id("pi-4")
    assert a == stable_node_id("pi-4")  # a restarted agent keeps its id
    assert a != stable_node_id("pi-5")
    assert (tmp_path / "node-ids" / "pi-4.id").read_text() == a


def test_device_profile_and_memory_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    p = device_profile("n1", memory_limit_bytes=1_000_000_000)
    assert p.ram_total_bytes > 0 and p.cpu_cores >= 1 and p.backends
    assert p.offered_memory_bytes() == min(p.ram_available_bytes, 1_000_000_000)
    assert NodeProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    m = live_metrics(memory_limit_bytes=1_000_000_000)
    assert m["ram_total_bytes"] <= 1_000_000_000 and 0 <= m["cpu_percent"] <= 100


def test_layer_timing_is_measured() -> None:
    t = time_layers("onnx")
    assert 0 < t.decode_layer_s < 1 and 0 < t.prefill_layer_token_s < 1


def test_print_profile(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "exo_tui.cli", "node", "--print-profile", "--name", "probe", "--backend", "onnx"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "EXO_TUI_HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    profile = json.loads(out.stdout)
    assert profile["name"] == "probe" and profile["node_id"].startswith("n-")
    assert profile["layer_timing"]["onnx"]["decode_layer_s"] > 0
    assert profile["memory_bandwidth_bytes_per_s"] > 0
