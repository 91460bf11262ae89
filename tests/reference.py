"""A NumPy float32 (float64 accumulation where noted) reference of the decoder's layers, written
from the conventions in ``backends/base.py`` (and the angles of ``backends/rope.py``) and nothing
else, to check the backends against."""

from __future__ import annotations

import numpy as np

from backends.base import ModelConfig
from backends.rope import angles
from backends.weights import ShardWeights, dense


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate adjacent pairs by plain angles ``p * theta ** (-2i / d)``. x: (heads, T, head_dim)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]  # (T, d/2)
    return rotate(x, np.cos(ang), np.sin(ang))


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Adjacent pairs of ``x`` (heads, T, head_dim) turned by (cos, sin) ``(T, head_dim / 2)``."""
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


OPTIONAL = ("bq", "bk", "bv", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm")


class ReferenceShard:
    """Runs layers [start, end) of a model in NumPy, with a KV cache per request."""

    def __init__(self, config: ModelConfig, weights: ShardWeights) -> None:
        self.c = config
        self.w = weights
        def value(w):
            if w is None:
                return None
            return [dense(e) for e in w] if isinstance(w, list) else dense(w)

        self.layers = [{k: value(getattr(lw, k)) for k in lw.__dataclass_fields__} for lw in weights.layers]
        self.embed = dense(weights.embed) if weights.embed is not None else None
        self.output = dense(weights.output) if weights.output is not None else None
        self.cache: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _heads(self, x: np.ndarray, n: int, norm: np.ndarray | None) -> np.ndarray:
        t = x.shape[0]
        x = x.reshape(t, n, self.c.head_dim)
        if norm is not None:
            x = rms_norm(x, norm, self.c.rms_eps)
        return x.transpose(1, 0, 2)

    def forward(self, rid: str, x: np.ndarray, positions: np.ndarray, all_logits: bool = False) -> np.ndarray:
        c = self.c
        h = (self.embed[x] * np.float32(c.embed_scale)) if self.embed is not None else x.astype(np.float32)
        t = h.shape[0]
        cache = self.cache.setdefault(rid, [(np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32),) * 2 for _ in self.layers])
        rep = c.n_heads // c.n_kv_heads
        act = gelu_tanh if c.activation == "gelu_tanh" else silu
        for i, lw in enumerate(self.layers):
            layer = self.w.start + i
            a = rms_norm(h, lw["attn_norm"], c.rms_eps)
            q, k, v = a @ lw["wq"].T, a @ lw["wk"].T, a @ lw["wv"].T
            if lw["bq"] is not None:
                q, k, v = q + lw["bq"], k + lw["bk"], v + lw["bv"]
            q = self._heads(q, c.n_heads, lw["q_norm"])
            k = self._heads(k, c.n_kv_heads, lw["k_norm"])
            v = self._heads(v, c.n_kv_heads, None)
            cos, sin = angles(c, layer, positions)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            pk, pv = cache[i]
            k, v = np.concatenate([pk, k], axis=1), np.concatenate([pv, v], axis=1)
            cache[i] = (k, v)
            total = k.shape[1]
            kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            scores = (q.astype(np.float64) @ kk.transpose(0, 2, 1)) * c.query_scale
            qpos = positions[:, None]
            kpos = np.arange(int(positions[-1]) + 1 - total, int(positions[-1]) + 1)[None, :]  # a cache's last positions
            seen = kpos <= qpos
            if c.window(layer):
                seen &= kpos > qpos - c.window(layer)
            scores = np.where(seen, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = (p @ vv).astype(np.float32).transpose(1, 0, 2).reshape(t, c.n_heads * c.head_dim)
            o = o @ lw["wo"].T
            if lw["attn_post_norm"] is not None:
                o = rms_norm(o, lw["attn_post_norm"], c.rms_eps)
            h = h + o
            m = rms_norm(h, lw["ffn_norm"], c.rms_eps)
            if c.n_experts:
                f = self._experts(lw, m, act)
            else:
                g = m @ lw["w_gate"].T
                u = m @ lw["w_up"].T
                f = (act(g) * u) @ lw["w_down"].T
            if lw["ffn_post_norm"] is not None:
                f = rms_norm(f, lw["ffn_post_norm"], c.rms_eps)
            h = h + f
        if self.output is None:
            return h
        if not all_logits:
            h = h[-1:]
        logits = rms_norm(h, self.w.norm, c.rms_eps) @ self.output.T
        if c.logit_softcap:
            logits = (np.tanh(logits.astype(np.float64) / c.logit_softcap) * c.logit_softcap).astype(np.float32)
        return logits

    def _experts(self, lw: dict, m: np.ndarray, act) -> np.ndarray:
        """Each row through its top-k experts: softmax over the router's logits, the k largest
        (ties to the lower index), their weights renormalised when ``expert_weights_norm``."""
        c = self.c
        logits = (m.astype(np.float64) @ lw["router"].T.astype(np.float64))
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out = np.zeros_like(m)
        for t in range(m.shape[0]):
            chosen = np.argsort(-p[t], kind="stable")[: c.n_experts_used]
            w = p[t, chosen] / (p[t, chosen].sum() if c.expert_weights_norm else 1.0)
            for e, we in zip(chosen, w, strict=True):
                g = m[t] @ lw["experts_gate"][e].T
                u = m[t] @ lw["experts_up"][e].T
                out[t] += np.float32(we) * ((act(g) * u) @ lw["experts_down"][e].T)
        return out
