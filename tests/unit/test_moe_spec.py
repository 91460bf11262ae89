"""The scheduler's model of a mixture of experts: memory counts every expert, time the chosen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from exo_tui.models.spec import spec_from_gguf
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.spec import ModelSpec

FIXTURES = Path(__file__).parents[1] / "fixtures" / "families"


def test_a_layers_time_scales_with_the_experts_used_not_their_count() -> None:
    moe = spec_from_gguf(FIXTURES / "qwen3moe.gguf")
    assert moe.experts == (8, 2)
    assert moe.range_bytes(0, moe.n_layers) > moe.weight_bytes * 0.99  # every expert's bytes held
    dense_twin = dataclasses.replace(moe, active_layer_bytes=(), experts=(0, 0))
    node = DeviceProfile("n", decode_s_per_layer={"onnx": 1e-3}, compute_ref_layer_bytes=moe.layers[0])
    ratio = node.layer_s(moe) / node.layer_s(dense_twin)
    assert ratio == pytest.approx(moe.mean_active_layer_bytes / moe.mean_layer_bytes)
    assert ratio < 0.6  # 2 of 8 experts: most of the layer is not read
    assert ModelSpec.from_dict(moe.to_dict()) == moe


def test_active_bytes_cannot_exceed_the_layer() -> None:
    with pytest.raises(ValueError, match="at most the layer's"):
        ModelSpec("m", 2, 100, 10, 10, 8, 16, active_layer_bytes=(50, 150))


def test_a_spec_whose_experts_are_not_a_pair_is_refused() -> None:
    d = ModelSpec("m", 2, 100, 10, 10, 8, 16).to_dict()
    assert ModelSpec.from_dict({**d, "experts": [8, 2]}).experts == (8, 2)
    with pytest.raises(ValueError, match="experts must be two integers, not \\[8\\]"):
        ModelSpec.from_dict({**d, "experts": [8]})
