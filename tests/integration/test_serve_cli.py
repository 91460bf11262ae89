"""``exo-tui serve`` as an operator runs it, and the operator commands against it.

One ``exo-tui serve`` process (a tiny random model, three local ONNX node agents, layers split
evenly) serves the whole module: ``status``/``drain``/``undrain``/``pin``/``unpin``/``rebalance``
change the cluster as the console's keys do, 16 concurrent streams each equal their solo greedy
answer, schemathesis finds no 5xx and no schema violation, the ``--attach`` client works, and
SIGTERM stops the server and every node process it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from exo_tui.commands.serve import READY_PREFIX
from tests.factory import write_tiny_llama
from tests.helpers.benchmarks import share_benchmarks
from tests.helpers.sshd import free_port

pytestmark = pytest.mark.slow

MODEL_ID = "tiny-serve"


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str, home: Path, stderr: Path) -> None:
        self.proc, self.url, self.home, self.stderr = proc, url, home, stderr
        self.children: list[psutil.Process] = []

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "exo_tui.cli", *args, "--url", self.url], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "EXO_TUI_HOME": str(self.home)})
        if check:
            assert out.returncode == 0, f"exo-tui {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        return out

    def cluster(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster", timeout=30).json()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("serve")
    home = d / "home"
    home.mkdir(mode=0o700)
    share_benchmarks(home)  # the local nodes' start-up benchmark, once a session
    model = write_tiny_llama(d / f"{MODEL_ID}.gguf", weight_type="Q8_0", seed=5)
    port = free_port()
    stderr = d / "serve.err"
    # a 2-core machine running several node processes can starve one for a moment
    (d / "config.yaml").write_text("scheduler:\n  fault_tolerance:\n    heartbeat_timeout: 10\n")
    env = {**os.environ, "EXO_TUI_HOME": str(home), "EXO_TUI_CONFIG": str(d / "config.yaml")}
    env.pop("EXO_TUI_API_KEY", None)
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exo_tui.cli", "serve", "--model", str(model), "--local-nodes", "3",
             "--backends", "onnx", "--strategy", "even", "--api-port", str(port)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True,
        )
    try:
        line = proc.stdout.readline()  # the ready line (or EOF when it failed)
        assert line.startswith(READY_PREFIX), f"serve did not start: {line!r}\n{stderr.read_text()[-3000:]}"
        assert "on 3 node(s)" in line
        s = Served(proc, f"http://127.0.0.1:{port}", home, stderr)
        s.children = psutil.Process(proc.pid).children(recursive=True)
        yield s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _layers(cluster: dict) -> dict[str, tuple[int, int] | None]:
    return {n["name"]: tuple(n["layers"]) if n["layers"] else None for n in cluster["nodes"]}


def test_status_shows_the_cluster(served: Served) -> None:
    data = json.loads(served.cli("status", "--json").stdout)
    assert data["model"] == "tiny-llama" and len(data["nodes"]) == 3
    assert all(n["state"] == "ready" and n["layers"] for n in data["nodes"])
    assert data["plan"]["n_layers"] == 4 and len(data["plan"]["shards"]) == 3
    table = served.cli("status").stdout
    for n in data["nodes"]:
        assert n["name"] in table
    assert f"plan v{data['plan']['version']}" in table
    heading = next(line for line in table.splitlines() if line.startswith("plan v"))
    assert "tok/s, ttft" in heading, table  # on one line, not wrapped to the stage table's width
    # what each node runs its shard at, as its heartbeats say: a Q8_0 file runs at int16 (auto)
    deadline = time.monotonic() + 30
    while any(not s["precision"] for s in served.cluster()["plan"]["shards"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {s["precision"] for s in served.cluster()["plan"]["shards"]} == {"int16"}
    table = served.cli("status").stdout
    assert "runs at" in table and "int16" in table, table


def test_drain_undrain_pin_unpin_rebalance_change_the_cluster(served: Served) -> None:
    before = served.cluster()
    layers = _layers(before)
    victim = next(name for name, r in layers.items() if r is not None)
    dry = json.loads(served.cli("drain", victim, "--dry-run", "--json").stdout)
    assert dry["moves"] and dry["new_plan"]
    assert served.cluster()["plan"]["version"] == before["plan"]["version"], "a dry run changed the plan"

    out = served.cli("drain", victim).stdout
    assert "moved" in out and victim in out
    after = served.cluster()
    node = next(n for n in after["nodes"] if n["name"] == victim)
    assert node["layers"] is None and node["drained"] and node["state"] == "drained"
    assert after["plan"]["version"] > before["plan"]["version"]
    covered = sorted((s["start"], s["end"]) for s in after["plan"]["shards"])
    assert covered[0][0] == 0 and covered[-1][1] == 4 and len(covered) == 2

    served.cli("undrain", victim)
    back = served.cluster()
    assert _layers(back)[victim] is not None and not next(n for n in back["nodes"] if n["name"] == victim)["drained"]

    start, end = _layers(back)[victim]
    served.cli("pin", victim, f"{start}-{end - 1}")
    pinned = next(n for n in served.cluster()["nodes"] if n["name"] == victim)
    assert tuple(pinned["pinned"]) == (start, end)
    wrong = served.cli("pin", victim, "2-9", check=False)
    assert wrong.returncode == 1 and "not within the model's 0-3" in wrong.stderr
    served.cli("unpin", victim)
    held = _layers(served.cluster())[victim]
    other = (0, 1) if held != (0, 1) else (3, 4)  # a range it does not hold: the plan moves
    out = served.cli("pin", victim, f"{other[0]}-{other[1] - 1}").stdout
    assert "moved" in out
    now = served.cluster()
    assert _layers(now)[victim] == other
    assert tuple(next(n for n in now["nodes"] if n["name"] == victim)["pinned"]) == other
    served.cli("unpin", victim)
    assert next(n for n in served.cluster()["nodes"] if n["name"] == victim)["pinned"] is None

    version = served.cluster()["plan"]["version"]
    assert "dry run" in served.cli("rebalance", "--dry-run").stdout
    assert served.cluster()["plan"]["version"] == version

    unknown = served.cli("drain", "no-such-node", check=False)
    assert unknown.returncode == 1 and "no node 'no-such-node'" in unknown.stderr


def test_cli_says_when_no_coordinator_runs(served: Served) -> None:
    out = subprocess.run([sys.executable, "-m", "exo_tui.cli", "status", "--url", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no coordinator at" in out.stderr and "exo-tui serve" in out.stderr


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    pieces, finish = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                pieces.append(c["delta"].get("content") or "")
                finish = c["finish_reason"] or finish
    return "".join(pieces), finish


def test_sixteen_concurrent_streams_equal_their_solo_answers(served: Served) -> None:
    prompts = [f"question {i}: tell me about {w}" for i, w in enumerate("abcdefghijklmnop")]
    solo = [_stream(served.url, p, 12) for p in prompts]
    assert all(text for text, _ in solo)
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _stream(served.url, p, 12), prompts))
    elapsed = time.monotonic() - t0
    assert together == solo, "a batched answer differs from its solo greedy answer"
    assert elapsed < 120


def test_schemathesis_finds_no_server_error_or_schema_violation(served: Served, tmp_path: Path) -> None:
    """Every route's schema fuzzed, each body also with an integer past 64 bits or a string with a
    lone surrogate in it (tests/helpers/fuzz_hooks.py): 4xx, never 5xx."""
    st = Path(sys.executable).with_name("schemathesis")
    hooks = Path(__file__).resolve().parents[1] / "helpers" / "fuzz_hooks.py"
    out = subprocess.run(
        [str(st), "run", f"{served.url}/openapi.json", "--max-examples", "6", "--phases", "examples,fuzzing",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         # the event stream never ends; bootstrap would SSH to generated hosts; model loads generated paths
         "--exclude-path-regex", "(events|hosts|bootstrap|model)$",
         "--request-timeout", "60", "--seed", "1", "--no-color", "--generation-database", "none"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "SCHEMATHESIS_HOOKS": str(hooks)},
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "passed" in out.stdout
    assert served.proc.poll() is None


def test_attach_client_follows_and_drives_the_cluster(served: Served) -> None:
    from exo_tui.api.client import ClusterClient
    from exo_tui.cluster.view import ChatParams, ClusterControl, Command

    async def run() -> None:
        client = ClusterClient(served.url, api_key="")
        assert isinstance(client, ClusterControl)
        await client.start()
        try:
            # the events from before it attached come first (the nodes joining, the plan)
            deadline = time.monotonic() + 20
            while not {"node_joined", "plan_changed"} <= {e.kind for e in client.events.history}:
                assert time.monotonic() < deadline, [e.kind for e in client.events.history]
                await asyncio.sleep(0.05)
            snap = client.snapshot()
            assert len(snap.nodes) == 3 and snap.plan is not None and snap.model == "tiny-llama"
            holder = next(n for n in snap.nodes if n.layers)
            preview = await client.preview(Command("drain", (holder.name,)))
            assert not preview.error and preview.moves and preview.new_plan is not None
            assert all(s.node_id != holder.node_id for s in preview.new_plan.shards)
            missing = await client.preview(Command("drain", ("nobody",)))
            assert "no node 'nobody'" in missing.error

            sub = client.events.subscribe()
            chunks = [c async for c in client.chat([{"role": "user", "content": "hello"}],
                                                   ChatParams(max_tokens=5, temperature=0.0))]
            assert chunks[-1].finish_reason in ("stop", "length") and not chunks[-1].error
            assert chunks[-1].completion_tokens >= 1 and chunks[-1].prompt_tokens > 0
            deadline = time.monotonic() + 20
            kinds = set()
            while "request_done" not in kinds and time.monotonic() < deadline:
                event = await asyncio.wait_for(sub.get(), deadline - time.monotonic())
                kinds.add(event.kind)
            assert "request_done" in kinds and "token" not in kinds  # a chat has its tokens from its own stream
        finally:
            await client.stop()

    asyncio.run(run())


def test_event_stream_leaves_out_the_types_asked(served: Served) -> None:
    """``exclude`` leaves event types out of ``/v1/cluster/events``; an unknown type is a 422 that
    lists the known ones."""
    with httpx.stream("GET", f"{served.url}/v1/cluster/events", params={"exclude": "token,tokens"}, timeout=30) as bad:
        assert bad.status_code == 422  # (a stream that started would never end: its body is read only now)
        message = json.loads(bad.read())["error"]["message"]
    assert "unknown event type(s) tokens" in message and "node_joined" in message

    def kinds(exclude: str) -> set[str]:
        seen: set[str] = set()
        with httpx.stream("GET", f"{served.url}/v1/cluster/events", params={"replay": "true", "exclude": exclude},
                          timeout=30) as r:
            lines = r.iter_lines()
            answer = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
            rid = answer.json()["id"].removeprefix("chatcmpl-")
            for line in lines:  # the replayed events, then this request's, to its end
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    seen.add(event["type"])
                    if event["type"] == "request_done" and event["request_id"] == rid:
                        return seen
        return seen

    assert {"token", "plan_changed", "request_done"} <= kinds("")
    left = kinds("token,plan_changed")
    assert "request_done" in left and not {"token", "plan_changed"} & left


def test_sigterm_stops_serve_and_its_nodes(served: Served) -> None:
    """SIGTERM stops serve, its nodes, and the event streams of attached consoles (open ones had
    kept the server waiting out its graceful shutdown, then cancelled with a traceback)."""
    assert len([p for p in served.children if "node" in " ".join(p.cmdline())]) == 3
    with httpx.stream("GET", f"{served.url}/v1/cluster/events", params={"replay": "true"}, timeout=30) as events:
        lines = events.iter_lines()
        assert next(lines).startswith(": exo-tui events")
        served.proc.send_signal(signal.SIGTERM)
        code = served.proc.wait(30)
        assert code in (0, 128 + signal.SIGTERM), served.stderr.read_text()[-2000:]
        rest = list(lines)  # the stream ended (the replayed events, then the end)
        assert any(line.startswith("data: ") for line in rest)
    log = served.stderr.read_text()
    assert "graceful shutdown exceeded" not in log and "Exception in ASGI application" not in log, log[-3000:]
    gone, alive = psutil.wait_procs(served.children, timeout=15)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    assert "Traceback" not in served.stderr.read_text()
