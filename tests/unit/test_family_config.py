"""A family's :class:`ModelConfig` read from its metadata alone (``read_config``), on synthetic
metadata: the rules the file does not state, which no tiny fixture exercises."""

from __future__ import annotations

import numpy as np
import pytest

from exo_tui.models.families import read_config

# Gemma 3's shapes as llama.cpp's GGUF files give them (config.json of each size)
GEMMA3 = {  # name: (block_count, embedding_length, head_count, key_length)
    "1b": (26, 1152, 4, 256),
    "4b": (34, 2560, 8, 256),
    "12b": (48, 3840, 16, 256),
    "27b": (62, 5376, 32, 128),
}


def gemma3(n_layers: int, hidden: int, n_heads: int, head_dim: int, **extra: object):
    meta = {
        "gemma3.block_count": n_layers, "gemma3.embedding_length": hidden, "gemma3.attention.head_count": n_heads,
        "gemma3.attention.head_count_kv": max(1, n_heads // 2), "gemma3.attention.key_length": head_dim,
        "gemma3.attention.value_length": head_dim, "gemma3.feed_forward_length": 4 * hidden,
        "gemma3.context_length": 8192, "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 262144,
        **{f"gemma3.{k}": v for k, v in extra.items()},
    }

    def no_tensor(name: str) -> np.ndarray:
        raise AssertionError(f"no tensor {name} in synthetic metadata")

    return read_config("gemma3", meta.get, lambda name: None, no_tensor, "synthetic gemma3")


@pytest.mark.parametrize("size", list(GEMMA3))
def test_gemma3_scales_queries_by_its_query_pre_attn_scalar(size: str) -> None:
    """The 27B (62 layers) scales queries by (hidden / heads) ** -0.5 (its query_pre_attn_scalar
    of 168, where its heads are 128 wide); the others by head_dim ** -0.5 (their scalar is 256,
    their heads' width)."""
    n_layers, hidden, n_heads, head_dim = GEMMA3[size]
    config = gemma3(n_layers, hidden, n_heads, head_dim)
    want = 168 ** -0.5 if size == "27b" else 256 ** -0.5
    assert config.attn_scale == pytest.approx(want)
    assert config.n_layers == n_layers and config.head_dim == head_dim


def test_a_scale_the_file_states_wins() -> None:
    config = gemma3(*GEMMA3["27b"], **{"attention.scale": 0.125})
    assert config.attn_scale == 0.125
