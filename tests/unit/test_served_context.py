"""A model served at a shorter context than its file's (``models.context_length``, ``--context``):
the plan counts its caches at that context, the node sizes its rotary tables and caches for it
and refuses a step past it, and the angles of every position it serves are the model's own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from backends.base import BackendError, ModelConfig
from backends.rope import frequencies, rope_tables
from exo_tui.config import DEFAULT_CONTEXT, Config, ConfigError, load_config
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.spec import resolve_spec, served_context, spec_from_gguf
from exo_tui.node.host import ShardHost
from tests.factory import write_tiny_llama

LLAMA31 = ModelConfig(n_layers=2, hidden_size=64, intermediate_size=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=64, context_length=131072, rope_theta=500000.0)


def test_a_model_is_served_at_its_own_context_or_the_limit_where_shorter() -> None:
    assert served_context(131072, 8192) == 8192
    assert served_context(4096, 8192) == 4096
    assert served_context(131072, 0) == 131072  # 0: no limit
    assert Config().models.context_length == DEFAULT_CONTEXT == 8192


def test_a_negative_context_in_the_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("models:\n  context_length: -1\n")
    with pytest.raises(ConfigError, match="context_length"):
        load_config(path)


@pytest.mark.parametrize("config", [
    LLAMA31,
    replace(LLAMA31, rope_scaling="yarn", rope_factor=4.0),  # yarn from the file's context
    replace(LLAMA31, rope_scaling="yarn", rope_factor=4.0, rope_original_context=32768),
    replace(LLAMA31, rope_scaling="linear", rope_factor=8.0),
], ids=["plain", "yarn", "yarn-original", "linear"])
def test_a_shorter_context_keeps_every_positions_angles(config: ModelConfig) -> None:
    short = config.at_context(2048)
    assert short.context_length == 2048
    np.testing.assert_array_equal(frequencies(short, 0), frequencies(config, 0))
    cos, sin = rope_tables(short)
    assert cos.shape == (2048, 8)
    want_cos, want_sin = rope_tables(config, n_positions=2048)
    np.testing.assert_array_equal(cos, want_cos)
    np.testing.assert_array_equal(sin, want_sin)
    assert config.at_context(0) is config and config.at_context(200000) is config  # no limit, or none shorter


def test_the_plan_counts_caches_at_the_served_context(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "long.gguf", context_length=1 << 20)
    own = spec_from_gguf(path)
    served = spec_from_gguf(path, context_limit=8192)
    assert own.context_length == 1 << 20 and served.context_length == 8192
    assert own.kv_bytes_per_layer == 128 * served.kv_bytes_per_layer
    assert resolve_spec(str(path), context_limit=8192).context_length == 8192
    assert resolve_spec(str(path), 4096, context_limit=8192).context_length == 4096  # plan --context: as asked
    assert resolve_spec("synthetic:8b", context_limit=2048).context_length == 2048


def test_a_node_holds_a_shard_for_the_served_context_and_refuses_a_step_past_it(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "long.gguf", n_layers=2, context_length=1 << 20)
    model = GGUFModel(path)
    host = ShardHost("n", "onnx")
    hosted = host.load_from_file(str(path), 0, 2, "onnx", context=64)
    try:
        assert hosted.shard.config.context_length == 64
        assert hosted.shard.config == model.config.at_context(64)
        whole = ShardHost("w", "onnx").load_from_file(str(path), 0, 2, "onnx")
        try:
            ids = np.arange(40) % model.config.vocab_size
            got = hosted.shard.forward("r", ids, np.arange(40))
            np.testing.assert_allclose(got, whole.shard.forward("r", ids, np.arange(40)), rtol=0, atol=0)
        finally:
            whole.shard.close()
        with pytest.raises(BackendError, match="context"):
            hosted.shard.forward("r", ids[:30], np.arange(40, 70))
    finally:
        host.unload_all()


def test_the_time_to_first_token_is_predicted_for_a_prompt_the_context_holds() -> None:
    from exo_tui.scheduler import DeviceProfile, make_plan

    node = DeviceProfile("a", ram_total_bytes=64 << 30, ram_available_bytes=32 << 30, memory_bandwidth_bytes_per_s=1e11)
    spec = resolve_spec("synthetic:1b", context_limit=300)
    assert make_plan([node], spec, "latency", now=0.0).predictions.prompt_tokens == 299  # not the 512 asked
    long = resolve_spec("synthetic:1b")
    assert make_plan([node], long, "latency", now=0.0).predictions.prompt_tokens == 512
