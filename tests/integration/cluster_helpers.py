"""Node agent processes for tests: started once, stopped always, attached to by coordinators."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.local_nodes import LocalNode, spawn_node, stop_node, wait_ready
from exo_tui.config import Config
from exo_tui.net.security import ensure_cluster, write_node_bundle
from tests.helpers.benchmarks import share_benchmarks


@dataclass
class NodeSet:
    home: Path
    nodes: list[LocalNode]

    @property
    def peers(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]


@contextlib.contextmanager
def node_processes(home: Path, backends: list[str], *, memory_limits_gb: list[float | None] | None = None,
                   extra_args: list[str] | None = None, shared_benchmark: bool = True) -> Iterator[NodeSet]:
    """Start one node agent process per backend (bundles issued by ``home``'s cluster).
    ``shared_benchmark``: the nodes take the start-up benchmark earlier nodes of the session
    measured (see :func:`~tests.helpers.benchmarks.share_benchmarks`) rather than measuring it."""
    cluster = ensure_cluster(home)
    if shared_benchmark:
        share_benchmarks(home)
    nodes: list[LocalNode] = []
    try:
        for i, backend in enumerate(backends):
            name = f"t{i}-{backend}"
            bundle = write_node_bundle(home / "nodes" / f"{name}.bundle", cluster.node_bundle(name))
            limit = memory_limits_gb[i] if memory_limits_gb else None
            nodes.append(spawn_node(name, backend=backend, key_file=str(bundle), memory_limit_gb=limit,
                                    log_dir=home / "logs", env={"EXO_TUI_HOME": str(home)}, extra_args=extra_args))
        asyncio.run(_wait_all(nodes))
        share_benchmarks(home)
        yield NodeSet(home, nodes)
    finally:
        for node in nodes:
            stop_node(node)


async def _wait_all(nodes: list[LocalNode]) -> None:
    await asyncio.gather(*(wait_ready(n, timeout_s=180) for n in nodes))


def cluster_config(**scheduler: object) -> Config:
    """Defaults, with a looser heartbeat timeout: a 2-core CI machine running several node
    processes can starve one for a moment, and these tests are not about heartbeats."""
    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = float(scheduler.pop("heartbeat_timeout", 10.0))
    for key, value in scheduler.items():
        section, name = key.split("__")
        setattr(getattr(config.scheduler, section), name, value)
    return config


@contextlib.asynccontextmanager
async def coordinator(nodes: NodeSet, *, model: str | Path | None = None, peers: list[str] | None = None,
                      strategy: str | None = "even", config: Config | None = None, weights: str = "auto",
                      persist: bool = False) -> AsyncIterator[Coordinator]:
    """A coordinator over ``peers`` (default: all the node set's nodes). ``persist=False`` keeps
    tests from re-adopting nodes that an earlier test's coordinator saved in the shared home."""
    c = Coordinator(model=str(model) if model else None, peers=peers if peers is not None else nodes.peers,
                    strategy=strategy, config=config or cluster_config(), home=nodes.home, weights=weights,
                    persist=persist)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


def reference_answer(model_path: Path, prompt: str, max_tokens: int, *, seed: int = 7, temperature: float = 0.0,
                     repetition_penalty: float = 1.0) -> list[int]:
    """The undisturbed single-process answer, greedy by default (ONNX, the whole model in one shard)."""
    from exo_tui.inference.generate import generate
    from exo_tui.inference.local import LocalPipeline, even_split
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams
    from exo_tui.models.model import Model

    async def run() -> list[int]:
        model = Model(model_path)
        messages = [{"role": "user", "content": prompt}]
        request = Request(model.chat_prompt_ids(messages), SamplingParams(temperature=temperature, seed=seed,
                                                                    repetition_penalty=repetition_penalty), max_tokens)
        pipeline = LocalPipeline()
        await pipeline.load(model.gguf, even_split(model.config.n_layers, ["onnx"]))
        try:
            async for _ in generate(pipeline, model.tokenizer, request, context_length=model.config.context_length):
                pass
        finally:
            await pipeline.close()
        return [t for t in request.generated if t not in model.tokenizer.eos_ids]

    return asyncio.run(run())


def stop_groups(procs: list) -> None:  # list[subprocess.Popen]
    """SIGCONT then SIGTERM each process group a test started (``start_new_session``), SIGKILL
    those that linger past 20 s, and reap them all."""
    import os
    import signal
    import subprocess

    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)  # a frozen one could not stop
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        if p is None:
            continue
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
