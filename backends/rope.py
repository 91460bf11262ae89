"""Rotary angles of each layer, from a :class:`~backends.base.ModelConfig`: the one place every
backend (and the NumPy reference) takes them from, so a KV cache rotated on one backend is the
same on another.

Pair ``i`` of a head (``i < head_dim / 2``) turns by ``position * f_i`` with

* ``f_i = base ** (-2i / head_dim)``, ``base`` the layer's (``rope_theta``, or
  ``rope_theta_local`` on gemma3's windowed layers);
* divided by ``rope_freq_factors[i]`` where the file gives them (llama 3's ``rope_freqs``,
  phi3's long or short factors);
* ``linear`` scaling: divided by ``rope_factor`` (positions interpolated);
* ``yarn``: each frequency between its extrapolated (``f_i``) and interpolated (``f_i / factor``)
  value by a linear ramp over the pairs whose wavelengths lie between ``beta_fast`` and
  ``beta_slow`` rotations of the original context, as transformers' ``_compute_yarn_parameters``
  and ggml's ``rope_yarn`` compute it;

and cos and sin multiplied by ``rope_attn_factor`` (yarn's and longrope's magnitude correction).
Gemma3's windowed layers are never scaled (its scaling is for the global layers' long context).
Angles are computed in float64 and rounded once to float32.
"""

from __future__ import annotations

import math

import numpy as np

from backends.base import ModelConfig


def _layer_base(config: ModelConfig, layer: int) -> tuple[float, bool]:
    """The layer's base and whether its frequencies are scaled."""
    if config.windowed(layer) and config.rope_theta_local:
        return config.rope_theta_local, False
    return config.rope_theta, True


def frequencies(config: ModelConfig, layer: int = 0) -> np.ndarray:
    """``f_i`` of each rotary pair of ``layer``, float64 ``(head_dim / 2,)``."""
    d = config.head_dim
    base, scaled = _layer_base(config, layer)
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    freqs = base ** -exponents
    if not scaled:
        return freqs
    if config.rope_freq_factors:
        freqs = freqs / np.asarray(config.rope_freq_factors, dtype=np.float64)
    if config.rope_scaling == "linear":
        freqs = freqs / config.rope_factor
    elif config.rope_scaling == "yarn":
        freqs = _yarn(config, base, freqs)
    return freqs


def _yarn(config: ModelConfig, base: float, freqs: np.ndarray) -> np.ndarray:
    d = config.head_dim
    original = config.rope_original_context or config.context_length

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.rope_yarn_beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(config.rope_yarn_beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # the share of each pair kept at its trained frequency
    return freqs / config.rope_factor * (1.0 - extrapolated) + freqs * extrapolated


def rope_tables(config: ModelConfig, layer: int = 0, n_positions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's angles for ``layer``, float32 ``(n_positions, head_dim / 2)``
    (``n_positions`` defaults to the context length), times ``rope_attn_factor``."""
    n = config.context_length if n_positions is None else n_positions
    ang = np.arange(n, dtype=np.float64)[:, None] * frequencies(config, layer)[None, :]
    m = config.rope_attn_factor
    return (np.cos(ang) * m).astype(np.float32), (np.sin(ang) * m).astype(np.float32)


def angles(config: ModelConfig, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (float64, times ``rope_attn_factor``) of ``positions``' angles, ``(T, head_dim / 2)``."""
    ang = np.asarray(positions, dtype=np.float64)[:, None] * frequencies(config, layer)[None, :]
    m = config.rope_attn_factor
    return np.cos(ang) * m, np.sin(ang) * m


def table_key(config: ModelConfig, layer: int) -> tuple[float, bool]:
    """Layers with equal keys share their tables (a graph keeps one copy of each)."""
    return _layer_base(config, layer)
