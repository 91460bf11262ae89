"""Three ``exo-tui serve --coordinators`` processes over two ONNX node agents (a tiny random
model), as operators run them: one leads, two stand by.

In order, on one set: a drain and a pin are made through a standby; the leader is killed (-9)
while a stream runs through a standby, whose text goes on identical to an undisturbed run with
the same seed; the new leader keeps the drain and the pin, re-adopts the plan (the nodes keep
their shards) and takes over the dead leader's KV caches; a standby killed and started again
with its state dir gone rejoins; the leader frozen (SIGSTOP) for 10 s, another leading meanwhile,
then thawed, steps down, and every node's log shows commands of the newest term only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.factory import write_tiny_llama
from tests.helpers.sshd import free_port
from tests.integration.cluster_helpers import NodeSet, node_processes, stop_groups

pytestmark = pytest.mark.slow

MODEL_ID = "tiny-set"
WAIT_S = 90.0  # fails a hung test only
FREEZE_S = 10.0  # how long the leader is frozen (SIGSTOP, then SIGCONT): the scenario
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600, "temperature": 0.8,
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}}


class CoordinatorSet:
    def __init__(self, d: Path, model: Path, nodes: NodeSet) -> None:
        self.d, self.model, self.nodes = d, model, nodes
        self.rafts = [free_port() for _ in range(3)]
        self.apis = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[str] | None] = [None, None, None]
        self.env = {**os.environ, "EXO_TUI_HOME": str(nodes.home), "EXO_TUI_CONFIG": str(d / "config.yaml")}
        self.env.pop("EXO_TUI_API_KEY", None)

    def start(self, i: int) -> None:
        self.launch(i)
        self.ready(i)

    def launch(self, i: int) -> None:
        peers = sum((["--peer", p] for p in self.nodes.peers), [])
        with open(self.d / f"c{i}.err", "a") as err:
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "exo_tui.cli", "serve", "--model", str(self.model), "--strategy", "even",
                 "--api-port", str(self.apis[i]), "--coordinators", ",".join(f"127.0.0.1:{p}" for p in self.rafts),
                 "--coordinator-port", str(self.rafts[i]), "--state-dir", str(self.d / f"state{i}"), *peers],
                stdout=subprocess.PIPE, stderr=err, text=True, env=self.env, start_new_session=True)

    def ready(self, i: int) -> None:
        """Waits for coordinator ``i``'s ready line."""
        proc = self.procs[i]
        line = proc.stdout.readline() if proc is not None and proc.stdout else ""
        assert line.startswith(READY_PREFIX), f"coordinator {i} did not start: {line!r}\n{self.log(i)[-3000:]}"

    def log(self, i: int) -> str:
        return (self.d / f"c{i}.err").read_text(errors="replace")

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.apis[i]}"

    def health(self, i: int) -> dict:
        return httpx.get(f"{self.url(i)}/health", timeout=10).json()

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def leader(self, among: list[int] | None = None) -> int:
        """The coordinator that leads and is in charge (waits for one)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            for i in among if among is not None else self.alive():
                try:
                    h = self.health(i)
                except httpx.HTTPError:
                    continue
                if h["role"] == "leader" and h["ready"]:
                    return i
            assert time.monotonic() < deadline, "no coordinator took charge"
            time.sleep(0.1)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)
            if sig == signal.SIGKILL:
                proc.wait(30)

    def stop(self) -> None:
        stop_groups(self.procs)


@pytest.fixture(scope="module")
def cset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorSet]:
    d = tmp_path_factory.mktemp("coordinators")
    home = d / "home"
    home.mkdir(mode=0o700)
    model = write_tiny_llama(d / f"{MODEL_ID}.gguf", weight_type="Q8_0", seed=5, context_length=2048)
    # nodes are not the subject: a starved node on a 2-core machine must not look failed
    (d / "config.yaml").write_text("scheduler:\n  fault_tolerance:\n    heartbeat_timeout: 10\n"
                                   "network:\n  join:\n    enabled: false\n")
    with node_processes(home, ["onnx", "onnx"]) as nodes:
        s = CoordinatorSet(d, model, nodes)
        try:
            for i in range(3):  # all three start at once (their imports overlap), as a set's members may
                s.launch(i)
            for i in range(3):
                s.ready(i)
            yield s
        finally:
            s.stop()


def stream(url: str, on_piece=None) -> tuple[str, dict]:
    """A streamed chat completion's text and usage; ``on_piece(n)`` after the n-th piece."""
    pieces, usage = [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY, timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            usage = d.get("usage") or usage
            if d["choices"] and d["choices"][0]["delta"].get("content"):
                pieces.append(d["choices"][0]["delta"]["content"])
                if on_piece is not None:
                    on_piece(len(pieces))
    return "".join(pieces), usage


def node_view(cset: CoordinatorSet, i: int) -> dict[str, dict]:
    data = httpx.get(f"{cset.url(i)}/v1/cluster", timeout=30).json()
    return {n["name"]: n for n in data["nodes"]} | {"plan": data["plan"]}


def shards(view: dict) -> list[tuple[str, int, int]]:
    return [(s["node_id"], s["start"], s["end"]) for s in view["plan"]["shards"]]


def test_kill_9_of_the_leader_mid_stream_through_a_standby(cset: CoordinatorSet) -> None:
    lead = cset.leader()
    standby = next(i for i in range(3) if i != lead)
    term = cset.health(lead)["term"]
    # A drain and a pin, made through a standby (forwarded; acknowledged once a majority holds them).
    names = sorted(n for n in node_view(cset, standby) if n != "plan")
    drained, pinned = names
    r = httpx.post(f"{cset.url(standby)}/v1/cluster/nodes/{drained}/drain", json={}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{cset.url(standby)}/v1/cluster/pins", json={"node": pinned, "start": 0, "end": 4}, timeout=60)
    assert r.status_code == 200, r.text
    before = node_view(cset, lead)
    assert before[pinned]["layers"] == [0, 4] and before[drained]["drained"]

    reference, _ = stream(cset.url(standby))
    assert len(reference) > 200, "the seeded answer is too short to kill the leader in the middle of it"

    def kill_at(n: int) -> None:
        if n == 20:
            cset.kill(lead)

    text, usage = stream(cset.url(standby), kill_at)
    assert cset.procs[lead].poll() is not None, "the leader was not killed mid-stream: the answer ended first"
    assert text == reference
    assert usage["completion_tokens"] == BODY["max_tokens"]
    # the resumed request took over the caches the dead leader's steps left on the node: no prefill
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert "re-issued to" in cset.log(standby)

    new = cset.leader([i for i in range(3) if i != lead])
    h = cset.health(new)
    assert h["term"] > term and h["leader_api"] == cset.url(new)
    assert cset.health(next(i for i in range(3) if i not in (lead, new)))["leader_api"] == cset.url(new)
    after = node_view(cset, new)
    assert after[drained]["drained"] and after[drained]["layers"] is None
    assert after[pinned]["pinned"] == [0, 4] and after[pinned]["layers"] == [0, 4]
    # the plan in force re-adopted as it was (a plan is re-adopted only where its nodes hold its shards)
    assert shards(after) == shards(before)
    assert re.search(rf"plan {after['plan']['version']} in force \(re-adopted after a coordinator restart\)", cset.log(new))
    cset.start(lead)  # back as a standby
    deadline = time.monotonic() + WAIT_S
    while cset.health(lead)["leader_api"] != cset.url(new):
        assert time.monotonic() < deadline, "the restarted coordinator did not find the leader"
        time.sleep(0.1)
    assert cset.health(lead)["role"] == "standby"


def test_a_coordinator_whose_state_dir_is_lost_rejoins_and_catches_up(cset: CoordinatorSet) -> None:
    lead = cset.leader()
    lost = next(i for i in range(3) if i != lead)
    cset.kill(lost)
    shutil.rmtree(cset.d / f"state{lost}")
    cset.start(lost)
    deadline = time.monotonic() + WAIT_S
    while True:
        h = cset.health(lost)
        me = next(c for c in h["coordinators"] if c["address"].endswith(f":{cset.rafts[lost]}"))
        if h["leader_api"] == cset.url(lead) and me["applied"] >= cset.health(lead)["commit"] and me["lag"] == 0:
            break
        assert time.monotonic() < deadline, f"it did not catch up: {h}"
        time.sleep(0.1)
    assert h["role"] == "standby" and h["drains"] == cset.health(lead)["drains"] != []


def test_a_frozen_leader_steps_down_and_the_nodes_obey_the_newest_term_only(cset: CoordinatorSet) -> None:
    lead = cset.leader()
    old_term = cset.health(lead)["term"]
    cset.kill(lead, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        new = cset.leader([i for i in range(3) if i != lead])
        new_term = cset.health(new)["term"]
        assert new_term > old_term
        text, _ = stream(cset.url(new))  # the new leader drives the nodes while the old one is frozen
        assert text
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))  # the scenario: frozen 10 s in all
    finally:
        cset.kill(lead, signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while (h := cset.health(lead))["role"] != "standby" or h["leader_api"] != cset.url(new):
        assert time.monotonic() < deadline, f"the thawed leader did not step down: {h}"
        time.sleep(0.1)
    assert "stepping down from term" in cset.log(lead)
    kinds = set()
    for node in cset.nodes.nodes:
        log = node.log_path.read_text(errors="replace")
        attached = [int(t) for t in re.findall(r"coordinator of term (\d+) attached", log)]
        assert attached == sorted(attached) and attached[-1] == new_term, attached
        # from the new term's attach on, every command the node obeyed was of that term (its steps too)
        since = log[log.index(f"coordinator of term {new_term} attached"):]
        obeyed = re.findall(r"obeyed (\w+) from coordinator term (\d+)", since)
        assert {int(t) for _, t in obeyed} <= {new_term}, obeyed
        kinds |= {op for op, _ in obeyed}
        refused = [int(t) for t in re.findall(r"from coordinator term (\d+): term (?:\d+) leads now", log)]
        assert all(t < new_term for t in refused), refused
    assert kinds >= {"plan", "forward"}, kinds  # the new leader's re-adoption and the stream's steps


def test_status_shows_the_coordinators_roles_terms_and_lag(cset: CoordinatorSet) -> None:
    lead = cset.leader()
    standby = next(i for i in cset.alive() if i != lead)
    env = {**cset.env, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "exo_tui.cli", "status", "--url", cset.url(standby)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rows = {c["api"]: c for c in json.loads(out.stdout)["coordinators"]}
    assert rows[cset.url(lead)]["role"] == "leader" and rows[cset.url(standby)]["role"] == "standby"
    assert len({c["term"] for c in rows.values()}) == 1
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert table.returncode == 0, table.stderr
    assert f"leader {cset.url(lead)}" in table.stdout and "★ leader" in table.stdout and "(this one)" in table.stdout
    # the snapshot an attached console shows them from (its coordinators pane)
    snap = httpx.get(f"{cset.url(standby)}/v1/cluster", timeout=30).json()["coordinators"]
    assert sorted(c["role"] for c in snap) == ["leader", "standby", "standby"]


async def test_an_attached_console_follows_the_set_when_its_coordinator_dies(cset: CoordinatorSet) -> None:
    from exo_tui.api.client import ClusterClient
    from exo_tui.events import Notice

    lead = await asyncio.to_thread(cset.leader)
    client = ClusterClient(cset.url(lead))
    sub = client.events.subscribe()
    await client.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(client.coordinator_apis) < 2:
            assert time.monotonic() < deadline, "the console never learned the set"
            await asyncio.sleep(0.1)
        await asyncio.to_thread(cset.kill, lead)
        notices: list[str] = []
        # both notices, in either order: the new leader's, and the console's move to another coordinator
        while not any("leads in term" in n for n in notices) or not any("following its set at" in n for n in notices):
            assert time.monotonic() < deadline + WAIT_S, f"the console did not follow the set: {notices}"
            try:
                event = await asyncio.wait_for(sub.get(), 1.0)
            except TimeoutError:
                continue
            if isinstance(event, Notice):
                notices.append(event.message)
        assert client.url != cset.url(lead)
        assert any(f"following its set at {client.url}" in n for n in notices)
    finally:
        sub.close()
        await client.stop()
        await asyncio.to_thread(cset.start, lead)


async def test_the_console_runs_as_one_of_the_set(cset: CoordinatorSet, monkeypatch: pytest.MonkeyPatch) -> None:
    """``exo-tui --coordinators ...``: the console in place of one ``serve`` of the set (its Raft
    port, state dir and API port) is a member, shows the set, and, the leader (or, where the console
    leads, a standby) killed, goes on with whichever of the two left leads (itself, running the
    coordinator in the console's process, or the other)."""
    from exo_tui.cli import build_parser
    from exo_tui.commands.tui import _set_member
    from exo_tui.config import load_config
    from exo_tui.tui.app import ExoApp
    from exo_tui.tui.widgets.coordinators import CoordinatorsPane
    from tests.tui.conftest import wait_until

    lead = await asyncio.to_thread(cset.leader)
    me = next(i for i in range(3) if i != lead)
    await asyncio.to_thread(cset.kill, me)
    monkeypatch.setenv("EXO_TUI_HOME", str(cset.nodes.home))
    args = build_parser().parse_args([
        "tui", "--config", str(cset.d / "config.yaml"), "--model", str(cset.model), "--no-discover",
        "--coordinators", ",".join(f"127.0.0.1:{p}" for p in cset.rafts), "--coordinator-port", str(cset.rafts[me]),
        "--state-dir", str(cset.d / f"state{me}"), "--api-port", str(cset.apis[me]),
        *sum((["--peer", p] for p in cset.nodes.peers), [])])
    control, start, stop = _set_member(args, load_config(args.config))
    app = ExoApp(control, on_start=start, on_stop=stop)

    def pane() -> str:
        found = app.main_screen.query(CoordinatorsPane) if app.main_screen is not None else []
        last = found[0]._last if found else None
        return last.plain if last is not None else ""

    # the module's last test: it leaves one serve of the three (the fixture stops it)
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: pane().count("★") == 1 and pane().count("standby") == 2, timeout=WAIT_S)
        # back in the set it may have called an election and won it (Raft without pre-vote)
        lead = await asyncio.to_thread(cset.leader, [0, 1, 2])
        assert (await asyncio.to_thread(cset.health, me))["role"] == ("leader" if lead == me else "standby")
        victim = lead if lead != me else next(i for i in range(3) if i != me)
        await asyncio.to_thread(cset.kill, victim)
        new = await asyncio.to_thread(cset.leader, [i for i in range(3) if i != victim])
        h = await asyncio.to_thread(cset.health, me)
        assert h["role"] == ("leader" if new == me else "standby") and h["leader_api"] == cset.url(new)
        await wait_until(pilot, lambda: pane().count("★") == 1 and "unreachable" in pane(), timeout=WAIT_S)
        assert cset.url(new) in {c.api for c in control.snapshot().coordinators if c.role == "leader"}
