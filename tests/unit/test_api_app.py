"""The API's pure parts and its behaviour before a model is loaded (no node processes needed)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from exo_tui import events as ev
from exo_tui.api.app import create_app
from exo_tui.api.convert import (
    event_from_dict,
    event_to_dict,
    preview_from_dict,
    snapshot_from_dict,
    snapshot_to_dict,
    to_jsonable,
)
from exo_tui.api.schemas import ChatCompletionRequest
from exo_tui.api.server import ApiServer, ApiServerError, exposure_warning, is_loopback
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.view import (
    ClusterSnapshot,
    HostView,
    LayerMove,
    LinkView,
    NodeView,
    PlanPreview,
    PlanView,
    ShardView,
    parse_layers,
)
from exo_tui.config import Config

PLAN = PlanView(version=3, n_layers=30, shards=(ShardView("a", 0, 12, pinned=True), ShardView("b", 12, 30)),
                strategy="latency", predicted_tok_per_s=12.5, predicted_ttft_s=0.2, reasons=("why",))


def _snapshot() -> ClusterSnapshot:
    node = NodeView(node_id="a", name="mac", address="10.0.0.2", port=52416, state="ready", backend="mlx",
                    backends=("mlx", "onnx"), memory_total_bytes=16 * 2**30, memory_used_bytes=2**30, cpu_percent=12.0,
                    score=88.5, score_breakdown={"ram": 20.0}, weights={"resource": 40.0}, layers=(0, 12), pinned=(0, 12),
                    tok_per_s=9.0, heartbeat_age_s=0.4, profile={"cpu_cores": 8}, history={"cpu": (1.0, 2.0)})
    other = NodeView(node_id="b", name="pi", address="10.0.0.3", port=52416, state="failed", eligible=False,
                     ineligible_reason="gone", heartbeat_age_s=None, score=None)
    return ClusterSnapshot(name="home", model="smollm2", nodes=(node, other), links=(LinkView("a", "b", 0.8),),
                           plan=PLAN, hosts=(HostView("pi.local", source="mdns"),), tok_per_s=3.0, updated_at=5.0,
                           sampling={"temperature": 0.2, "top_p": 0.9})


def test_snapshot_round_trips_through_json() -> None:
    snap = _snapshot()
    data = snapshot_to_dict(snap)
    assert data["ready_count"] == 1
    assert snapshot_from_dict(data) == snap


def test_preview_round_trips_and_non_finite_floats_become_null() -> None:
    preview = PlanPreview("drain", ("b",), moves=(LayerMove(12, 30, "b", "a", 1000),), bytes_moved=1000,
                          tok_per_s_before=10.0, tok_per_s_after=8.0, new_plan=PLAN, note="n")
    assert preview_from_dict(to_jsonable(preview)) == preview
    assert to_jsonable({"x": float("inf"), "y": (float("nan"), 1.5)}) == {"x": None, "y": [None, 1.5]}


@pytest.mark.parametrize("event", [
    ev.NodeJoined(node_id="a", name="mac", address="h", port=1),
    ev.NodeDiscovered(node_id="a", name="mac", address="h", port=1, backends=("mlx",)),
    ev.PlanChanged(version=2, plan={"shards": []}, diff={"moves": []}, reason="drain"),
    ev.RequestDone(request_id="r", finish_reason="cancelled", nodes=("mac", "pi")),
    ev.TokenStreamed(request_id="r", token_id=5, text="x"),
    ev.OperatorAction(action="drain", target="pi", result="ok"),
    ev.Notice(level="info", message="hello"),
])
def test_events_round_trip(event: ev.Event) -> None:
    assert event_from_dict(event_to_dict(event)) == event


def test_unknown_event_types_are_skipped() -> None:
    assert event_from_dict({"type": "from_the_future", "ts": 1.0}) is None


def test_exposure_warning_only_for_non_loopback_without_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    text = exposure_warning("0.0.0.0", None)
    assert text and "without an API key" in text and "EXO_TUI_API_KEY" in text


@pytest.mark.parametrize(("fields", "limit"), [
    ({"max_completion_tokens": 5}, 5), ({"max_tokens": 7}, 7),
    ({"max_completion_tokens": 5, "max_tokens": 7}, 5), ({}, None),
])
def test_a_chat_answer_is_limited_by_max_completion_tokens_else_max_tokens(fields: dict, limit: int | None) -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    assert body.answer_limit == limit


def test_parse_layers_is_inclusive() -> None:
    assert parse_layers("0-14") == (0, 15)
    assert parse_layers("3-3") == (3, 4)
    for bad in ("x", "5-2", "-1-3", "4"):
        with pytest.raises(ValueError):
            parse_layers(bad)


@pytest.fixture
def idle(tmp_path: Path) -> Coordinator:
    """A coordinator that has not started: no model, no nodes (a request waits 0.3 s for a plan)."""
    config = Config()
    config.admission.plan_wait_s = 0.3
    return Coordinator(config=config, home=tmp_path, persist=False)


def test_before_the_model_is_loaded(idle: Coordinator) -> None:
    with TestClient(create_app(idle)) as http:
        assert http.get("/v1/models").json() == {"object": "list", "data": []}
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "cluster_unavailable"
        assert "not ready after waiting" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "2"  # a client (the openai package does) tries again, not gives up
        r = http.post("/api/chat", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "not ready after waiting" in r.json()["error"]  # Ollama's shape
        assert r.headers["retry-after"] == "2"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "robot", "content": "hi"}]})
        assert r.status_code == 422 and r.json()["error"]["param"].startswith("messages")
        r = http.post("/v1/completions", content=b"[1,", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert http.post("/v1/cluster/nodes/nobody/drain", json={}).status_code == 404
        half = http.post("/v1/cluster/pins", json={"node": "n", "start": 2})
        assert half.status_code == 422 and half.json()["error"]["param"] == "end"
        assert http.post("/v1/cluster/pins", json={"node": "n", "start": 3, "end": 2}).status_code == 422
        assert http.post("/v1/cluster/pins", json={"node": "n", "start": 0, "end": 2}).status_code == 404
        assert http.get("/health").json()["ready"] is False
        schema = http.get("/openapi.json").json()
        assert "/v1/chat/completions" in schema["paths"] and "/v1/cluster/rebalance" in schema["paths"]


def test_a_model_of_an_unsupported_family_is_refused_with_the_reason(idle: Coordinator) -> None:
    from tests.factory import write_tiny_llama

    moe = write_tiny_llama(idle.home / "moe.gguf", arch="qwen2moe")
    with TestClient(create_app(idle)) as http:
        r = http.post("/v1/cluster/model", json={"model": str(moe)})
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_not_supported"
        assert "architecture 'qwen2moe'" in r.json()["error"]["message"]
        assert "it runs llama, qwen2, qwen3, gemma3, phi3, qwen3moe" in r.json()["error"]["message"]
        missing = http.post("/v1/cluster/model", json={"model": "/nowhere/m.gguf"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_key_required_when_set(idle: Coordinator) -> None:
    with TestClient(create_app(idle, api_key="s3cret")) as http:
        r = http.get("/v1/cluster")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/v1/cluster", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = http.get("/v1/cluster", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["nodes"] == []
        assert http.get("/openapi.json").status_code == 401  # the documents are behind the key too
        assert http.get("/docs").status_code == 401
        assert http.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/docs", headers={"Authorization": "bearer s3cret"}).status_code == 200


def test_bodies_past_the_limit_are_413_with_or_without_a_length(idle: Coordinator) -> None:
    with TestClient(create_app(idle, max_body_bytes=4096)) as http:
        big = http.post("/v1/completions", content=b"x" * 5000, headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
        assert "network.api.max_body_bytes" in big.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"y" * 1000

        streamed = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413 and "4096 bytes" in streamed.json()["error"]["message"]
        assert streamed.json()["error"]["code"] == "body_too_large"
        small = http.post("/v1/completions", content=b"[1,", headers={"content-type": "application/json"})
        assert small.status_code == 400  # under the limit the body reaches the app as before


def test_busy_port_is_a_clear_error(idle: Coordinator) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]

        async def start() -> None:
            await ApiServer(idle, port=port).start()

        with pytest.raises(ApiServerError, match="another exo-tui serve"):
            asyncio.run(start())


def test_server_serves_and_stops(idle: Coordinator) -> None:
    import httpx

    async def run() -> int:
        async with ApiServer(idle, port=0) as server:
            async with httpx.AsyncClient() as c:
                r = await c.get(f"{server.url}/health")
            return r.status_code

    assert asyncio.run(run()) == 200


def test_a_null_where_a_field_takes_none_takes_its_default() -> None:
    """A non-finite float is written as null: read back, a field that takes no null has its default."""
    data = to_jsonable(PlanPreview("rebalance", (), tok_per_s_before=float("inf"), new_plan=PLAN))
    assert data["tok_per_s_before"] is None
    data["new_plan"]["shards"][0]["weight_bytes"] = None
    back = preview_from_dict(data | {"from_a_newer_server": 1})
    assert back.tok_per_s_before == 0.0 and back.new_plan.shards[0].weight_bytes == 0
    assert back.new_plan.shards == tuple(back.new_plan.shards) and back.action == "rebalance"
