"""A NumPy float32 (float64 accumulation where noted) reference of the llama layers, written from
the conventions in ``backends/base.py`` and nothing else, to check the backends against."""

from __future__ import annotations

import numpy as np

from backends.base import ModelConfig, ShardWeights, dense


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate adjacent pairs. x: (heads, T, head_dim)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]  # (T, d/2)
    cos, sin = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


class ReferenceShard:
    """Runs layers [start, end) of a model in NumPy, with a KV cache per request."""

    def __init__(self, config: ModelConfig, weights: ShardWeights) -> None:
        self.c = config
        self.w = weights
        self.layers = [{k: dense(getattr(lw, k)) for k in lw.__dataclass_fields__} for lw in weights.layers]
        self.embed = dense(weights.embed) if weights.embed is not None else None
        self.output = dense(weights.output) if weights.output is not None else None
        self.cache: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def forward(self, rid: str, x: np.ndarray, positions: np.ndarray, all_logits: bool = False) -> np.ndarray:
        c = self.c
        h = self.embed[x] if self.embed is not None else x.astype(np.float32)
        t = h.shape[0]
        cache = self.cache.setdefault(rid, [(np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32),) * 2 for _ in self.layers])
        rep = c.n_heads // c.n_kv_heads
        for i, lw in enumerate(self.layers):
            a = rms_norm(h, lw["attn_norm"], c.rms_eps)
            q = (a @ lw["wq"].T).reshape(t, c.n_heads, c.head_dim).transpose(1, 0, 2)
            k = (a @ lw["wk"].T).reshape(t, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = (a @ lw["wv"].T).reshape(t, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
            pk, pv = cache[i]
            k, v = np.concatenate([pk, k], axis=1), np.concatenate([pv, v], axis=1)
            cache[i] = (k, v)
            total = k.shape[1]
            kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            scores = (q.astype(np.float64) @ kk.transpose(0, 2, 1)) / np.sqrt(c.head_dim)
            qpos = positions[:, None]
            kpos = np.arange(total)[None, :]
            scores = np.where(kpos <= qpos, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = (p @ vv).astype(np.float32).transpose(1, 0, 2).reshape(t, c.n_heads * c.head_dim)
            h = h + o @ lw["wo"].T
            m = rms_norm(h, lw["ffn_norm"], c.rms_eps)
            g = m @ lw["w_gate"].T
            u = m @ lw["w_up"].T
            h = h + ((g / (1 + np.exp(-g))) * u) @ lw["w_down"].T
        if self.output is None:
            return h
        if not all_logits:
            h = h[-1:]
        return rms_norm(h, self.w.norm, c.rms_eps) @ self.output.T
