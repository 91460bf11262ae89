"""How the node detail writes a profile's values: durations and rates with units, not rounded away."""

from __future__ import annotations

from exo_tui.tui.format import fmt_seconds
from exo_tui.tui.screens.detail import _flatten


def test_a_layers_seconds_keep_their_digits() -> None:
    """A decode layer takes ~0.2 ms: three decimals of a second wrote it as 0."""
    assert fmt_seconds(0.000182) == "182 µs" and fmt_seconds(0.00145) == "1.45 ms" and fmt_seconds(2.1) == "2.1 s"
    rows = dict(_flatten({"layer_timing": {"onnx": {"decode_layer_s": 0.000182}}, "memory_bandwidth_bytes_per_s": 32.8e9,
                          "cpu_percent": 7.5, "ram_total_bytes": 25_300_000_000, "engine": {"matmul": "QLinear avx512"}}))
    assert rows == {"layer_timing.onnx.decode_layer_s": "182 µs", "memory_bandwidth_bytes_per_s": "32.8 GB/s",
                    "cpu_percent": "7.5", "ram_total_bytes": "25.3 GB", "engine.matmul": "QLinear avx512"}
