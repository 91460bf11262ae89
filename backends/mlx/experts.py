"""A mixture of experts' MLP in MLX, in the shape of mlx-lm's ``SwitchGLU``
(``models/switch_layers.py``, as ``qwen3_moe.py``'s sparse block uses it).

A router ``(n_experts, hidden)`` scores each row; the softmax over its logits (float32) picks the
``n_experts_used`` largest (ties to the lower index: MLX's argsort is stable), whose weights are
renormalised to sum to 1 where the model does (``expert_weights_norm``); the row's output is the
weighted sum of the chosen experts' SwiGLU MLPs ``down(act(gate(x)) * up(x))``.

Each kind of matrix (gate and up fused where they share a format, and down) is stacked over the
experts ``(n_experts, out, in)`` in the format of its file (:mod:`backends.mlx.quant`: MLX's
affine groups, Q6_K's packed groups of 16, or float32) and run with ``mx.gather_qmm`` /
``mx.gather_mm``, which read only the chosen experts' matrices. With more than one row (a prompt,
or a batch of decode steps) the (row, expert) pairs are sorted by expert first, as mlx-lm does
(``sorted_indices``): on a GPU each expert's matrix is then read once for all the rows routed to
it. MLX's CPU kernels run each pair of a gathered product as its own product whatever the order,
so on the CPU an eager step with several rows (a prompt, or a batch of decode steps, which the
shard runs eagerly there for a mixture) reads the routing back and runs each chosen expert once,
one product on all the rows routed to it (:meth:`StackedExperts.grouped`). A gathered product
takes the distinct experts chosen, their codes and their float32 scales made from the held form
(:class:`~backends.mlx.scales.GroupScales`) for them alone: in a compiled decode step at most
``min(pairs, n_experts)`` of them; in an eager step one at a time, each then multiplying all its
rows at once. Q6_K's experts (whose groups of 16 MLX's gathered products do not take) are so
unpacked to float32.

On this CPU build (MLX 0.32) the grouped products give the same numbers as the pairs, to the bit,
and take about as long: a quantized product's cost there grows with its rows. A batch of 8 decode
steps through one layer of ``benchmarks/big_model.py``'s ``moe`` shape (top 8 of 128 experts of
width 768; 53 distinct experts for 64 pairs) took 0.78-0.91 s grouped against 0.82-1.06 s as
compiled pairs (one run each, a loaded 2-core machine), and the grouped batch has no trace to
compile first (7.5 s). On the CPU the grouping saves kernel calls, not bytes.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from backends.base import BackendError, ModelConfig
from backends.mlx.quant import (
    MLXDense,
    MLXQuantized,
    MLXSmallGroups,
    fuse_rows,
    small_group_weights,
    split_rows,
    thread_streams,
    to_mlx,
)
from backends.mlx.scales import GroupScales
from backends.weights import LayerWeights, Weight


def on_cpu() -> bool:
    """Whether MLX runs on the CPU here (its gathered products then run pair by pair)."""
    return mx.default_device() == mx.cpu


# a row block of the stacked experts: their main arrays and, quantized, their scales
Part = tuple[mx.array, GroupScales | None]

class StackedExperts:
    """One kind of matrix of all the experts, ``(n_experts, out, in)`` as MLX arrays of one
    format; ``n_parts`` row blocks run at once on CPU streams, as :class:`~backends.mlx.quant.MLXQuantized`."""

    def __init__(self, weights: list[Weight], name: str, n_parts: int = 1) -> None:
        stacked = fuse_rows(weights)
        if stacked is None:
            raise BackendError(f"{name}: the experts' matrices differ in format; MLX runs them stacked in one")
        self.n_experts = len(weights)
        self.out = weights[0].shape[0]
        w = to_mlx(stacked, name)
        self.kind = type(w)

        def stack(a: mx.array) -> mx.array:  # (n_experts * out, ...) -> (n_experts, out, ...)
            return a.reshape(self.n_experts, self.out, -1)

        if isinstance(w, MLXDense):
            whole: tuple = (stack(w.weight), None)
        else:
            whole = (stack(w.packed), w.scales.map(stack))
            self.bits, self.group = w.bits, w.group
        self.whole = whole  # (the float32 matrices, None) or (the packed codes, their GroupScales)
        ranges = split_rows(self.out, n_parts) if n_parts > 1 else []
        self.parts = [(whole[0][:, a0:b0], None if whole[1] is None else whole[1].map(lambda a, a0=a0, b0=b0: a[:, a0:b0]))
                      for a0, b0 in ranges] or [whole]

    def arrays(self) -> list[mx.array]:
        """Every array, the row blocks' views included (all made at load: an array left lazy
        belongs to the loading thread's stream, which another thread cannot run)."""
        return [a for main, scales in [self.whole, *self.parts] for a in (main, *(scales.arrays() if scales else []))]

    def __call__(self, x: mx.array, experts: mx.array, sorted_indices: bool,
                 runs: list[tuple[int, int, int]] | None = None) -> mx.array:
        """``x`` ``(P, 1, in)``, one row for each (row, expert) pair; ``experts`` ``(P,)`` uint32:
        each pair's expert; ``runs``: the pairs are sorted and this is no compiled step, and these
        are its runs of one expert, ``(expert, first pair, end)`` (:meth:`grouped`). Returns ``(P, 1, out)``."""
        if runs is not None:
            return self.grouped(x, runs)
        if len(self.parts) == 1:
            return self._run(x, experts, sorted_indices, self.parts[0])
        outs = []
        for part, st in zip(self.parts, thread_streams(len(self.parts)), strict=True):
            with mx.stream(st):
                outs.append(self._run(x, experts, sorted_indices, part))
        return mx.concatenate(outs, axis=-1)

    def _run(self, x: mx.array, experts: mx.array, sorted_indices: bool, part: Part) -> mx.array:
        main, scales = part
        if self.kind is MLXDense:
            return mx.gather_mm(x, main.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=sorted_indices)
        if scales is None:
            raise BackendError("quantized experts without their scales")
        # the chosen experts only: their scales are made (and Q6_K's codes unpacked) for them alone
        chosen, slot = distinct(experts, sorted_indices, self.n_experts)
        if chosen is not None:
            main, scales = main[chosen], scales.map(lambda a: a[chosen])
        if self.kind is MLXQuantized:
            return mx.gather_qmm(x, main, *scales.pair(), rhs_indices=slot, transpose=True, group_size=self.group,
                                 bits=self.bits, sorted_indices=sorted_indices)
        # Q6_K's groups of 16: unpacked, then a float32 gathered product
        w = small_group_weights(main, scales, self.bits, self.group)  # (n, out part, in) float32
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=slot, sorted_indices=sorted_indices)

    def grouped(self, x: mx.array, runs: list[tuple[int, int, int]]) -> mx.array:
        """Each run of one expert's pairs ``(expert, a, b)`` times that expert once: one product
        of rows ``a:b`` (each row block on its CPU stream). Q6_K's are unpacked one expert at a
        time and evaluated before the next (one expert's float32 at a time, not the layer's: 128
        experts of 2048 x 768 would be 800 MB)."""
        streams = thread_streams(len(self.parts)) if len(self.parts) > 1 else [None]
        outs = []
        for e, a, b in runs:
            rows = x[a:b, 0]
            parts = []
            for part, st in zip(self.parts, streams, strict=True):
                with mx.stream(st) if st is not None else contextlib.nullcontext():
                    parts.append(self._expert(rows, e, part))
            outs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))
            if self.kind is MLXSmallGroups:
                mx.eval(outs[-1])
        return mx.concatenate(outs)[:, None]

    def _expert(self, rows: mx.array, e: int, part: Part) -> mx.array:
        main, scales = part
        if self.kind is MLXDense:
            return rows @ main[e].T
        if scales is None:
            raise BackendError("quantized experts without their scales")
        scales = scales.map(lambda a: a[e])
        if self.kind is MLXQuantized:
            return mx.quantized_matmul(rows, main[e], *scales.pair(), transpose=True, group_size=self.group,
                                       bits=self.bits)
        return rows @ small_group_weights(main[e], scales, self.bits, self.group).T


def distinct(experts: mx.array, sorted_indices: bool, n_experts: int) -> tuple[mx.array | None, mx.array]:
    """The experts to unpack for pairs ``experts`` ``(P,)`` and each pair's index among them:
    ``(None, experts)`` (all of them) when there are at least as many pairs as experts; one
    token's distinct top-k as they are; else, the pairs being sorted, each run of one expert
    numbered in turn (``chosen[slot[p]] == experts[p]``; slots past the distinct ones repeat 0)."""
    p = experts.shape[0]
    if p >= n_experts:
        return None, experts
    if not sorted_indices:
        return experts, mx.arange(p, dtype=mx.uint32)
    new = mx.concatenate([mx.ones((1,), mx.uint32), (experts[1:] != experts[:-1]).astype(mx.uint32)])
    slot = mx.cumsum(new) - 1
    chosen = mx.zeros((p,), mx.uint32).at[slot].maximum(experts)
    return chosen, slot


class SwitchGLU:
    """A layer's experts and router (``LayerWeights.router``, ``experts_gate/up/down``)."""

    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int, act) -> None:
        self.k = config.n_experts_used
        self.n_experts = config.n_experts
        self.norm = config.expert_weights_norm
        self.width = config.expert_width
        self.act = act
        if w.router is None or w.experts_gate is None or w.experts_up is None or w.experts_down is None:
            raise BackendError(f"{name} is a mixture-of-experts layer without its router and experts' matrices")
        self.router = to_mlx(w.router, f"{name}.ffn_gate_inp")
        fused = [fuse_rows([g, u]) for g, u in zip(w.experts_gate, w.experts_up, strict=True)]
        whole = [f for f in fused if f is not None]
        self.gate_up: StackedExperts | None = None
        self.gate: StackedExperts | None = None
        self.up: StackedExperts | None = None
        if len(whole) == len(fused) and fuse_rows(whole) is not None:
            self.gate_up = StackedExperts(whole, f"{name}.ffn_gate_up_exps", n_parts)
        else:  # gate and up in different formats
            self.gate = StackedExperts(w.experts_gate, f"{name}.ffn_gate_exps", n_parts)
            self.up = StackedExperts(w.experts_up, f"{name}.ffn_up_exps", n_parts)
        self.down = StackedExperts(w.experts_down, f"{name}.ffn_down_exps", n_parts)

    def arrays(self) -> list[mx.array]:
        parts = [self.gate_up, self.gate, self.up, self.down]
        return self.router.arrays() + [a for p in parts if p is not None for a in p.arrays()]

    def kinds(self) -> set[type]:
        return {m.kind for m in (self.gate_up, self.gate, self.up, self.down) if m is not None}

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chosen experts ``(N, k)`` uint32 of rows ``x`` ``(N, hidden)`` and their weights ``(N, k)``."""
        scores = mx.softmax(self.router.matmul(x), axis=-1, precise=True)
        chosen = mx.argsort(-scores, axis=-1)[:, : self.k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return chosen.astype(mx.uint32), weights

    def __call__(self, x: mx.array, eager: bool = False) -> mx.array:
        """``x`` ``(..., hidden)``; ``eager``: no compiled step (a prompt, or a batch of decode
        steps on the CPU), so with several rows the routing may be read back to the host and each
        chosen expert run once on its rows (on the CPU; Q6_K's experts on any device)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k = x.shape[0], self.k
        chosen, weights = self.route(x)
        pairs = chosen.flatten()  # (N * k,): row r's experts at r * k ..
        many = n > 1
        if many:  # sorted by expert, so each expert's rows are together (mlx-lm's _gather_sort)
            order = mx.argsort(pairs)
            pairs, rows, back = pairs[order], order // k, mx.argsort(order)
        else:
            rows = mx.zeros((k,), mx.uint32)
        xs = x[rows][:, None, :]  # (N * k, 1, hidden)
        runs = None
        if eager and many and (on_cpu() or MLXSmallGroups in self.kinds()):
            ids = np.array(pairs)  # the routing, read back (an eager step may)
            starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
            runs = list(zip(ids[starts].tolist(), starts.tolist(), np.r_[starts[1:], len(ids)].tolist(), strict=True))

        def grouping(m: StackedExperts) -> list[tuple[int, int, int]] | None:
            """The runs where ``m`` runs expert by expert: all kinds on the CPU, else Q6_K's."""
            return runs if on_cpu() or m.kind is MLXSmallGroups else None

        if self.gate_up is not None:
            gate, up = mx.split(self.gate_up(xs, pairs, many, grouping(self.gate_up)), [self.width], axis=-1)
        elif self.gate is not None and self.up is not None:
            gate, up = self.gate(xs, pairs, many, grouping(self.gate)), self.up(xs, pairs, many, grouping(self.up))
        else:
            raise BackendError("experts without their gate and up matrices")
        y = self.down(self.act(gate) * up, pairs, many, grouping(self.down))[:, 0]  # (N * k, hidden)
        if many:
            y = y[back]
        y = (y.reshape(n, k, -1) * weights[..., None]).sum(axis=1)
        return y.reshape(shape)
