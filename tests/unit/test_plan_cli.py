"""``exo-tui plan``: the simulator on the example clusters, JSON output, pins, drains, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exo_tui.cli import main
from exo_tui.config import load_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "clusters").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path))
    monkeypatch.delenv("EXO_TUI_CONFIG", raising=False)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_there_are_the_three_example_clusters() -> None:
    assert {p.stem for p in EXAMPLES} == {"home-mixed", "four-pis", "thunderbolt-pair"}


@pytest.mark.parametrize("cluster", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("model", ["synthetic:8b", "synthetic:1b"])
def test_examples_plan_and_latency_beats_exo_ring(capsys: pytest.CaptureFixture[str], cluster: Path, model: str) -> None:
    code, out = run_json(capsys, "--cluster", str(cluster), "--model", model)
    assert code == 0
    plan = out["plan"]
    assert plan["strategy"] == "latency"
    assert plan["shards"][0]["start"] == 0 and plan["shards"][-1]["end"] == out["model"]["n_layers"]
    cmp = out["comparison"]
    assert set(cmp) == {"latency", "throughput", "memory", "exo-ring"}
    assert cmp["latency"]["tok_per_s_single"] >= cmp["exo-ring"]["tok_per_s_single"]
    assert cmp["latency"]["single_vs_exo_ring"] >= 1.0

    ids = {n["id"] for n in load_yaml(cluster.read_text())["nodes"]}
    assert set(out["scores"]) == ids
    assert all(set(s["parts"]) == {"vram_fit", "cpu", "ram", "device_type", "performance", "load_balance", "network"}
               for s in out["scores"].values())


def test_70b_on_the_home_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, "--cluster", str(ROOT / "examples/clusters/home-mixed.yaml"), "--model", "synthetic:70b")
    assert code == 0
    assert out["model"]["n_layers"] == 80
    # the Mac Studio and the RTX box together beat the Mac Studio alone; Wi-Fi devices stay out
    assert {s["node_id"] for s in out["plan"]["shards"]} == {"studio", "rtx"}
    assert not out["comparison"]["exo-ring"]["fits_memory"]  # exo's split overfills the phone
    assert out["comparison"]["latency"]["single_vs_exo_ring"] > 2


def test_rich_output_has_the_table_predictions_and_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--cluster", str(ROOT / "examples/clusters/four-pis.yaml"), "--model", "synthetic:3b",
                 "--strategy", "throughput"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("four-pis", "strategy throughput", "pi-1", "stage", "one stream", "saturated", "exo-ring",
                 "strategies compared"):
        assert text in out


def test_pins_and_drains(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, "--cluster", str(ROOT / "examples/clusters/four-pis.yaml"), "--model", "synthetic:3b",
                         "--strategy", "throughput", "--pin", "pi-3:0-4", "--drain", "pi-4")
    assert code == 0
    shards = {s["node_id"]: s for s in out["plan"]["shards"]}
    assert (shards["pi-3"]["start"], shards["pi-3"]["end"], shards["pi-3"]["pinned"]) == (0, 4, True)
    assert "pi-4" not in shards


def test_infeasible_plan_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, "--cluster", str(ROOT / "examples/clusters/four-pis.yaml"), "--model", "synthetic:70b")
    assert code == 1
    assert out["constraint"] == "memory" and "more" in out["error"] and out["shortfall_bytes"] > 0
    code = main(["plan", "--cluster", str(ROOT / "examples/clusters/four-pis.yaml"), "--model", "synthetic:70b"])
    err = capsys.readouterr().err
    assert code == 1 and "no latency plan" in err and "largest free is" in err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--cluster", "/nonexistent.yaml"], "cannot read cluster file"),
        (["--cluster", "{ex}", "--model", "synthetic:7z"], "unknown synthetic model"),
        (["--cluster", "{ex}", "--drain", "nobody"], "no such node"),
        (["--cluster", "{ex}", "--pin", "pi-1"], "NODE:START-END"),
        (["--cluster", "{ex}", "--model", "/no/such/model.gguf"], "does not exist"),
    ],
)
def test_operator_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    ex = str(ROOT / "examples/clusters/four-pis.yaml")
    code = main(["plan", *[a.replace("{ex}", ex) for a in args]])
    assert code == 2
    assert fragment in capsys.readouterr().err


def test_bad_cluster_file_names_the_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("nodes:\n  - id: x\n    kind: toaster\n")
    assert main(["plan", "--cluster", str(f)]) == 2
    assert "node x: unknown kind 'toaster'" in capsys.readouterr().err
    f.write_text("nodes:\n  - id: x\n    memory_gb: 8\n")
    assert main(["plan", "--cluster", str(f)]) == 2
    assert "node x: give a `kind:`" in capsys.readouterr().err


def test_explicit_compute_and_a_gguf_file(tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "name: two\nnodes:\n"
        "  - {id: a, memory_gb: 8, decode_ms_per_layer: 1.0}\n"
        "  - {id: b, memory_gb: 8, decode_ms_per_layer: 3.0}\n"
        "links:\n  - {between: [a, b], latency_ms: 0.5, bandwidth_mbps: 1000}\n"
    )
    code, out = run_json(capsys, "--cluster", str(f), "--model", str(tiny_model), "--strategy", "latency")
    assert code == 0
    assert out["model"]["n_layers"] == 4
    assert [s["node_id"] for s in out["plan"]["shards"]] == ["a"]
    node = out["plan"]["predictions"]["nodes"][0]
    assert node["compute_s"] == pytest.approx(4 * 0.001 + 0.001 * out["model"]["head_bytes"] / out["model"]["layer_bytes"], rel=0.05)


@pytest.mark.slow
def test_the_default_model(capsys: pytest.CaptureFixture[str], default_model_path: Path) -> None:
    code, out = run_json(capsys, "--cluster", str(ROOT / "examples/clusters/four-pis.yaml"))
    assert code == 0 and out["model"]["n_layers"] == 30
