"""Running a pipeline of shards inside this process (``exo-tui chat`` without nodes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from backends import get_backend
from backends.base import HeadRows, Shard
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import Length, Sampler, TokenLogprobs, token_logprobs
from exo_tui.inference.scoring import forward_scored
from exo_tui.inference.speculative import Draft, Verdict, verify
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


def run_shards(shards: list[Shard], request_id: str, tokens: list[int], start: int,
               all_logits: bool = False) -> np.ndarray:
    """Forward ``tokens`` (positions ``start..``) through the shards; the last row's logits (every
    row's with ``all_logits``)."""
    x: np.ndarray = np.asarray(tokens, dtype=np.int64)
    positions = np.arange(start, start + len(tokens), dtype=np.int64)
    for shard in shards:
        x = shard.forward(request_id, x, positions, all_logits=all_logits and shard is shards[-1])
    return x if all_logits else x[-1]


def _scored(shards: list[Shard], request: Request) -> tuple[np.ndarray, list[TokenLogprobs]]:
    """A request's first step, its prompt scored: the last row's logits and the scores."""
    x = run_shards(shards[:-1], request.id, request.tokens, 0, all_logits=True) if len(shards) > 1 \
        else np.asarray(request.tokens, dtype=np.int64)
    positions = np.arange(len(x), dtype=np.int64)
    logits, scores = forward_scored(shards[-1], request.id, x, positions, request.prompt_ids[1:],
                                    request.prompt_logprobs or 0)
    return logits[-1], scores


class LocalPipeline:
    """A :class:`~exo_tui.inference.generate.StepRunner` over shards in this process.

    Every backend call (loading, steps, dropping) runs on one worker thread: the event loop (the
    console, the API) stays responsive, and backends that keep per-thread state (MLX streams)
    always see the same thread.
    """

    def __init__(self) -> None:
        self.shards: list[Shard] = []
        self.names: tuple[str, ...] = ()
        self._samplers: dict[str, Sampler] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-local-worker")

    async def _call(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _each(self, fn: Callable[[Shard], object]) -> None:
        for shard in self.shards:
            fn(shard)

    async def load(self, model: GGUFModel, stages: list[Stage]) -> None:
        self.shards = await self._call(load_shards, model, stages)
        self.names = tuple(f"{s.backend}[{s.start}:{s.end})" for s in stages)

    async def step(self, request: Request, start: int) -> tuple[int, TokenLogprobs | None]:
        sampler = self._samplers.setdefault(request.id, Sampler(request.sampling))
        tokens = request.tokens
        if start == 0 and request.wants_prompt_scores:
            logits, request.prompt_scores = await self._call(_scored, self.shards, request)
        else:
            logits = await self._call(run_shards, self.shards, request.id, tokens[start:], start)
        token, _ = sampler.sample(logits, tokens)
        if request.top_logprobs is None:
            return token, None
        return token, token_logprobs(logits, token, request.top_logprobs)

    async def verify(self, request: Request, start: int, draft: Draft) -> tuple[Verdict, list[TokenLogprobs] | None]:
        sampler = self._samplers.setdefault(request.id, Sampler(request.sampling))
        tokens = request.tokens
        rows = [*tokens[start:], *draft.tokens]
        history = tokens if sampler.params.uses_history else Length(len(tokens))

        def check() -> tuple[HeadRows, Verdict]:  # on the worker: the head runs on the rows the check reads
            x = run_shards(self.shards[:-1], request.id, rows, start, True) if len(self.shards) > 1 else rows
            last = self.shards[-1].forward_rows(request.id, np.asarray(x), np.arange(start, start + len(rows)))
            logits = last.last(len(draft) + 1)
            return logits, verify(sampler, logits, history, draft)

        logits, verdict = await self._call(check)
        kept = len(tokens) + verdict.accepted  # the request's tokens and the accepted drafts
        await self._call(self._each, lambda shard: shard.truncate_kv(request.id, kept))
        if request.top_logprobs is None:
            return verdict, None
        return verdict, [token_logprobs(logits[i], t, request.top_logprobs) for i, t in enumerate(verdict.tokens)]

    async def release(self, request: Request) -> None:
        self._samplers.pop(request.id, None)
        await self._call(self._each, lambda shard: shard.drop(request.id))

    def served_by(self) -> tuple[str, ...]:
        return self.names

    async def close(self) -> None:
        await self._call(self._each, lambda shard: shard.close())
        self._worker.shutdown(wait=True)
