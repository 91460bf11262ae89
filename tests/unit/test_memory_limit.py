"""``--memory-limit`` is the memory a node gives to models (shards' weights, KV caches, a load's
transients), above its runtime's own resident memory, which the node measures when it starts: the
process may hold baseline + limit, the node enforces that, reports both, and the coordinator offers
the limit less what the runtime grew since."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import exo_tui.node.agent as agent_module
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.metrics import node_memory
from exo_tui.cluster.node_handle import NodeHandle
from exo_tui.commands.operator import _memory
from exo_tui.config import GB, Config
from exo_tui.net.protocol import PlanEntry
from exo_tui.node.agent import NodeAgent
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, KVBudget
from exo_tui.node.profile import device_profile, runs_on

MB = 10**6


def test_the_process_may_hold_its_runtime_baseline_plus_the_limit() -> None:
    b = KVBudget(limit_bytes=500 * MB, baseline_bytes=150 * MB)
    assert b.process_limit_bytes == 650 * MB
    b.set_shards({(0, 10): 1000})
    b.observe(rss_bytes=300 * MB, available_bytes=10**10, settled=True)  # the runtime, 150 MB of weights
    room = 650 * MB - 300 * MB  # the limit less the weights: caches may have what the models are given
    assert b.budget_bytes == room - b.reserve_bytes
    report = b.report()
    assert report["limit_bytes"] == 500 * MB and report["runtime_baseline_bytes"] == 150 * MB
    assert KVBudget(limit_bytes=None, baseline_bytes=150 * MB).process_limit_bytes is None


def test_the_runtime_growing_between_steps_takes_the_reserve_before_the_budget() -> None:
    """What the runtime grows by after a load (ONNX Runtime's arenas, freed caches kept by the
    allocator: seen when no cache is held) comes out of the reserve: the budget admission was
    given holds until the growth passes the reserve, then shrinks by what passes it. Caches at the
    budget, the runtime grown and what is left of the reserve make the process's limit."""
    b = KVBudget(limit_bytes=500 * MB, baseline_bytes=150 * MB)
    b.set_shards({(0, 10): 1000})
    b.observe(rss_bytes=300 * MB, available_bytes=10**10, settled=True)  # the runtime, 150 MB of weights
    budget, reserve = b.budget_bytes, b.reserve_bytes
    assert reserve == 70 * MB and budget == 280 * MB
    b.record("r1", (0, 10), 20_000)
    b.observe(rss_bytes=400 * MB, available_bytes=10**10)  # caches held: the runtime is not measured
    assert b.runtime_bytes == 300 * MB and b.budget_bytes == budget
    b.drop("r1")

    b.observe(rss_bytes=340 * MB, available_bytes=10**10)  # nothing held: grown 40 MB, within the reserve
    assert b.runtime_bytes == 340 * MB and b.budget_bytes == budget and b.reserve_bytes == reserve
    assert b.check({("r2", (0, 10)): budget // 1000}) == {}  # what admission was given still runs
    assert b.runtime_growth_bytes == 40 * MB
    assert b.runtime_bytes + b.budget_bytes + (reserve - b.runtime_growth_bytes) == b.process_limit_bytes

    b.observe(rss_bytes=380 * MB, available_bytes=10**10)  # grown 80 MB: 10 MB past the reserve
    assert b.budget_bytes == budget - 10 * MB
    assert b.runtime_bytes + b.budget_bytes == b.process_limit_bytes
    report = b.report()
    assert report["runtime_bytes"] == 380 * MB and report["runtime_growth_bytes"] == 80 * MB
    assert report["budget_bytes"] == budget - 10 * MB and report["reserve_bytes"] == reserve

    b.observe(rss_bytes=320 * MB, available_bytes=10**10)  # it gave 60 MB back: within the reserve again
    assert b.runtime_growth_bytes == 20 * MB and b.budget_bytes == budget
    b.observe(rss_bytes=290 * MB, available_bytes=10**10)  # below the runtime as settled: the growth counts from here
    assert b.runtime_growth_bytes == 0 and b.budget_bytes == 650 * MB - 290 * MB - b.reserve_bytes > budget
    b.observe(rss_bytes=310 * MB, available_bytes=10**10, settled=True)  # a load or unload settles it again
    assert b.runtime_growth_bytes == 0 and b.budget_bytes == 650 * MB - 310 * MB - b.reserve_bytes


def test_a_node_measures_its_runtime_baseline_with_its_backend_imported(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    profile = device_profile("n1", memory_limit_bytes=500 * MB)
    runs_on(profile, "onnx")
    assert 0 < profile.runtime_baseline_bytes <= psutil.Process().memory_info().rss
    assert profile.memory_limit_bytes == 500 * MB  # the limit as given, beside the baseline


def test_a_load_may_take_the_limit_above_the_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = NodeAgent(name="n1", backend="onnx", memory_limit_bytes=500 * MB, run_benchmark=False)
    agent.kv.baseline_bytes = 150 * MB
    monkeypatch.setattr(agent_module, "process_rss_bytes", lambda: 250 * MB)  # 100 MB held for models already
    assert agent._load_room() == 400 * MB - RESERVE_MIN_BYTES
    assert NodeAgent(name="n2", backend="onnx", run_benchmark=False)._load_room() is None


def limited_node(runtime_bytes: int) -> NodeHandle:
    """A node of a 500 MB limit above a 150 MB baseline, holding a 100 MB shard and 20 MB of caches,
    whose runtime (weights included) last measured ``runtime_bytes``."""
    profile = device_profile("n1", memory_limit_bytes=500 * MB, backends=["onnx"])
    profile.backend, profile.runtime_baseline_bytes = "onnx", 150 * MB
    kv = {"limit_bytes": 500 * MB, "runtime_baseline_bytes": 150 * MB, "runtime_bytes": runtime_bytes,
          "used_bytes": 20 * MB}
    return NodeHandle(node_id=profile.node_id, name="n1", host="127.0.0.1", port=1, profile=profile,
                      metrics={"ram_available_bytes": 64 * GB, "ram_total_bytes": 128 * GB, "kv": kv},
                      shards=[{"start": 0, "end": 4, "nbytes": 100 * MB}])


@pytest.mark.parametrize("grown", [0, 30 * MB])
def test_the_coordinator_offers_the_limit_less_what_the_runtime_grew_and_the_reserve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grown: int) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    c = Coordinator(config=Config(), home=tmp_path, persist=False)
    h = limited_node(150 * MB + 100 * MB + grown)
    c.nodes[h.node_id] = h
    rr = c.config.scheduler.resource_reservation
    [p] = c.device_profiles()
    usable = p.usable_bytes(rr.system_reserved_ram * GB, rr.system_reserved_vram * GB, rr.emergency_reserve)
    # its shard's bytes are offered again (the plan may keep them there); the least reserve is not:
    # the node keeps it out of its KV budget, and a plan counting it would give the node caches at
    # the served context that it cannot hold
    assert usable == pytest.approx(500 * MB - grown - RESERVE_MIN_BYTES, abs=1)
    assert node_memory(h) == (120 * MB, 500 * MB)  # the console: the models' memory (shards, caches) of the limit


@pytest.mark.parametrize(("need", "short"), [(300 * MB, False), (340 * MB, True)])
def test_a_node_is_short_of_room_past_its_baseline_plus_its_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  need: int, short: bool) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    c = Coordinator(config=Config(), home=tmp_path, persist=False)
    h = limited_node(250 * MB)
    h.held = {(0, 4)}
    c.nodes[h.node_id] = h
    c.spec = SimpleNamespace(layers=[], load_peaks=(("onnx", 0),), range_bytes=lambda start, end, _kv, _backend=None: need)
    # 650 MB the process may hold, less 250 MB held besides caches, 20 MB of caches and the least reserve
    assert 650 * MB - 250 * MB - 20 * MB - RESERVE_MIN_BYTES in range(300 * MB, 340 * MB)
    assert c._short_of_room([PlanEntry(h.node_id, "127.0.0.1", 1, 4, 8)]) == ({h.node_id} if short else set())


def test_status_says_a_limit_lies_above_the_runtime() -> None:
    node = {"memory_used_bytes": 120 * MB, "memory_total_bytes": 500 * MB,
            "profile": {"memory_limit_bytes": 500 * MB, "runtime_baseline_bytes": 150 * MB}}
    assert _memory(node) == "0.1/0.5 limit (+0.15 runtime)"
    assert _memory({"memory_used_bytes": 2 * GB, "memory_total_bytes": 8 * GB, "profile": {}}) == "2.1/8.6"


def test_a_node_under_a_limit_runs_a_prompt_in_chunks_its_reserve_holds() -> None:
    """A prompt's chunk on a node under a limit is as many rows as fit the reserve's step share
    with their step's temporaries and the chunks that may wait beside it (a multiple of
    MIN_PREFILL_CHUNK, between it and PREFILL_CHUNK); without a limit, PREFILL_CHUNK."""
    from backends.base import PREFILL_CHUNK, ModelConfig
    from backends.memory import MIN_PREFILL_CHUNK, prefill_row_bytes, prefill_rows, step_row_bytes
    from exo_tui.net.protocol import FILL_QUEUED
    from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, STEP_SHARE

    wide = ModelConfig(n_layers=16, hidden_size=2048, intermediate_size=5632, n_heads=16, n_kv_heads=2, head_dim=128,
                       vocab_size=32000)
    room = int(STEP_SHARE * RESERVE_MIN_BYTES)
    rows = prefill_rows(wide, room, FILL_QUEUED)
    assert rows % MIN_PREFILL_CHUNK == 0 and MIN_PREFILL_CHUNK <= rows < PREFILL_CHUNK
    assert rows * prefill_row_bytes(wide, FILL_QUEUED) <= room < (rows + MIN_PREFILL_CHUNK) * prefill_row_bytes(wide, FILL_QUEUED)
    assert prefill_row_bytes(wide, FILL_QUEUED) == step_row_bytes(wide) + FILL_QUEUED * 4 * wide.hidden_size
    assert prefill_rows(wide, None, FILL_QUEUED) == PREFILL_CHUNK and prefill_rows(wide, 1 << 40, FILL_QUEUED) == PREFILL_CHUNK
    assert prefill_rows(wide, 1, FILL_QUEUED) == MIN_PREFILL_CHUNK  # a step runs however little is left
    experts = ModelConfig(n_layers=2, hidden_size=2048, intermediate_size=768, n_heads=16, n_kv_heads=2, head_dim=128,
                          vocab_size=32000, n_experts=8, n_experts_used=4)
    assert step_row_bytes(experts) > step_row_bytes(dataclasses.replace(experts, n_experts=0, n_experts_used=0))


def test_a_scored_prompt_holds_as_many_rows_of_logits_as_the_reserve_takes() -> None:
    """A prompt scored under a limit (every position's logits, a vocabulary of floats a row) runs
    in pieces the reserve's step share holds, however large the vocabulary."""
    from backends.base import ModelConfig
    from backends.memory import logit_rows
    from exo_tui.inference.scoring import SCORE_ROWS
    from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, STEP_SHARE

    llama3 = ModelConfig(n_layers=16, hidden_size=2048, intermediate_size=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                         vocab_size=128256)
    room = int(STEP_SHARE * RESERVE_MIN_BYTES)
    rows = logit_rows(llama3, room, SCORE_ROWS)
    assert 1 <= rows < SCORE_ROWS and 2 * 4 * llama3.vocab_size * rows <= room  # 24 of 256
    assert logit_rows(llama3, None, SCORE_ROWS) == SCORE_ROWS and logit_rows(llama3, 1, SCORE_ROWS) == 1
