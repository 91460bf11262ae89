"""A coordinator set split by the network (root: three network namespaces, one coordinator each).

The leader is cut off from the other two (blackhole routes both ways; the test process still
reaches every coordinator's API over the bridge). Its lease runs out and it steps down; it refuses
a change with one sentence; the majority elects a leader and takes the change. When the partition
heals the cut-off coordinator follows the new leader and holds the change made without it: one
leader, one term, one state. No node agents: the change is an operator's host added
(``POST /v1/cluster/hosts``), part of the replicated state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.factory import write_tiny_llama
from tests.helpers.netns import NetnsHost, NetnsLab, skip_reason
from tests.integration.cluster_helpers import stop_groups

pytestmark = [pytest.mark.root, pytest.mark.slow]

RAFT_PORT, API_PORT = 52418, 52415
WAIT_S = 90.0  # fails a hung test only


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetnsLab, list[subprocess.Popen[str]], Path]]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("partition")
    home = d / "home"
    home.mkdir(mode=0o700)
    model = write_tiny_llama(d / "tiny-part.gguf", weight_type="Q8_0", seed=5)
    (d / "config.yaml").write_text("network:\n  join:\n    enabled: false\n")
    env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(d / "config.yaml")}
    env.pop("EXO_TUI_API_KEY", None)
    lab = NetnsLab.create(3, workdir=d / "lab")
    procs: list[subprocess.Popen[str]] = []
    try:
        peers = ",".join(f"{h.address}:{RAFT_PORT}" for h in lab.hosts)
        for h in lab.hosts:
            with open(d / f"{h.label}.err", "w") as err:
                procs.append(h.popen(sys.executable, "-m", "exo_tui.cli", "serve", "--model", str(model),
                                     "--api-host", h.address, "--api-port", str(API_PORT), "--coordinators", peers,
                                     "--coordinator-port", str(RAFT_PORT), "--state-dir", str(d / f"state-{h.label}"),
                                     stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True))
        for p, h in zip(procs, lab.hosts, strict=True):
            line = p.stdout.readline() if p.stdout else ""
            assert line.startswith(READY_PREFIX), f"coordinator {h.label} did not start: {line!r}\n" \
                                                  f"{(d / f'{h.label}.err').read_text()[-3000:]}"
        yield lab, procs, d
    finally:
        stop_groups(procs)
        lab.close()


def api(h: NetnsHost) -> str:
    return f"http://{h.address}:{API_PORT}"


def health(h: NetnsHost) -> dict:
    return httpx.get(f"{api(h)}/health", timeout=10).json()


def wait(cond, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + WAIT_S
    while not (result := cond()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)
    return result


def leaders(hosts: list[NetnsHost]) -> list[tuple[NetnsHost, dict]]:
    return [(h, x) for h in hosts if (x := health(h))["role"] == "leader"]


def cut(lab: NetnsLab, alone: NetnsHost, heal: bool = False) -> None:
    """Blackhole routes between ``alone`` and the others, both ways (``heal``: remove them)."""
    verb = "del" if heal else "add"
    for other in lab.hosts:
        if other is not alone:
            alone.run("ip", "route", verb, "blackhole", f"{other.address}/32")
            other.run("ip", "route", verb, "blackhole", f"{alone.address}/32")


def test_a_cut_off_leader_steps_down_refuses_changes_and_follows_after_the_heal(lab) -> None:  # noqa: ANN001
    lab, _procs, _d = lab
    hosts = lab.hosts
    old, h0 = wait(lambda: next(iter(leaders(hosts)), None), "a leader")
    others = [h for h in hosts if h is not old]
    cut(lab, old)
    try:
        new, h1 = wait(lambda: next(iter(leaders(others)), None), "a leader of the majority")
        assert h1["term"] > h0["term"]
        wait(lambda: health(old)["role"] == "standby", "the cut-off leader stepped down")
        refused = httpx.post(f"{api(old)}/v1/cluster/hosts", json={"host": "10.9.9.9"}, timeout=30)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "reaches 1 of the 3 coordinators, not a majority" in message, message
        peer = next(h for h in others if h is not new)
        # a standby forwards once it has heard from the new leader (until then it answers 503,
        # "an election is under way")
        wait(lambda: health(peer)["leader_api"] == api(new), "the majority's standby follows the new leader")
        taken = httpx.post(f"{api(peer)}/v1/cluster/hosts", json={"host": "10.8.8.8"}, timeout=30)
        assert taken.status_code == 200, taken.text
        assert "10.8.8.8" not in health(old)["hosts"]
    finally:
        cut(lab, old, heal=True)
    wait(lambda: health(old)["leader_api"] == api(new) and "10.8.8.8" in health(old)["hosts"],
         "the healed coordinator follows the new leader and holds the change made without it")
    views = [health(h) for h in hosts]
    assert [h for h, _ in leaders(hosts)] == [new], "more than one leader after the heal"
    assert len({v["term"] for v in views}) == 1 and len({v["leader_api"] for v in views}) == 1
    assert all("10.9.9.9" not in v["hosts"] for v in views), "the refused change took effect somewhere"
