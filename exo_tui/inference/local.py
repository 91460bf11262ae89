"""Running a pipeline of shards inside this process (``exo-tui chat`` without nodes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from backends import get_backend
from backends.base import Shard
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import Sampler
from exo_tui.models.gguf_file import GGUFModel


@dataclass(frozen=True)
class Stage:
    backend: str
    start: int
    end: int


def even_split(n_layers: int, backends: list[str]) -> list[Stage]:
    """Layers split as evenly as possible over the given backends, in order."""
    n = len(backends)
    if not 0 < n <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n} stages")
    bounds = [round(i * n_layers / n) for i in range(n + 1)]
    return [Stage(b, bounds[i], bounds[i + 1]) for i, b in enumerate(backends)]


def load_shards(model: GGUFModel, stages: list[Stage]) -> list[Shard]:
    """Load each stage's layers on its backend."""
    shards = []
    for stage in stages:
        backend = get_backend(stage.backend)
        shards.append(backend.load_shard(model.config, model.shard_weights(stage.start, stage.end)))
    return shards


def run_shards(shards: list[Shard], request_id: str, tokens: list[int], start: int) -> np.ndarray:
    """Forward ``tokens`` (positions ``start..``) through the shards; the last row's logits."""
    x: np.ndarray = np.asarray(tokens, dtype=np.int64)
    positions = np.arange(start, start + len(tokens), dtype=np.int64)
    for shard in shards:
        x = shard.forward(request_id, x, positions)
    return x[-1]


class LocalPipeline:
    """A :class:`~exo_tui.inference.generate.StepRunner` over shards in this process.

    Steps run in a worker thread so the event loop (the console, the API) stays responsive.
    """

    def __init__(self, shards: list[Shard], names: tuple[str, ...] | None = None) -> None:
        self.shards = shards
        self.names = names or tuple(type(s).__module__.split(".")[1] for s in shards)
        self._samplers: dict[str, Sampler] = {}
        self._lock = asyncio.Lock()

    async def step(self, request: Request, start: int) -> tuple[int, float]:
        sampler = self._samplers.setdefault(request.id, Sampler(request.sampling))
        tokens = request.tokens
        async with self._lock:
            logits = await asyncio.to_thread(run_shards, self.shards, request.id, tokens[start:], start)
        return sampler.sample(logits, tokens)

    async def release(self, request: Request) -> None:
        self._samplers.pop(request.id, None)
        for shard in self.shards:
            shard.drop(request.id)

    def served_by(self) -> tuple[str, ...]:
        return self.names

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
