"""A batch of requests through a mixture of experts: each request's greedy tokens are its tokens
when alone (the experts run once per step for all their rows; no row leaks into another's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends import available_backends, get_backend
from exo_tui.models.gguf_file import GGUFModel

FIXTURES = Path(__file__).parents[1] / "fixtures" / "families"
EXPERT_BACKENDS = [b for b in ("onnx", "mlx") if b in available_backends() and get_backend(b).experts]


def greedy(shard, prompts: list[np.ndarray], steps: int, batched: bool) -> list[list[int]]:
    """Each prompt's ``steps`` greedy tokens: prompts one by one, then decode steps together
    (``forward_batch``) or each request alone."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        logits = shard.forward(f"r{i}", p, np.arange(len(p)))
        out.append([int(np.argmax(logits[-1]))])
    for _ in range(steps - 1):
        items = [(f"r{i}", np.array([toks[-1]]), np.array([len(p) + len(toks) - 1]))
                 for i, (p, toks) in enumerate(zip(prompts, out, strict=True))]
        results = shard.forward_batch(items) if batched else [shard.forward(*item) for item in items]
        for toks, logits in zip(out, results, strict=True):
            toks.append(int(np.argmax(logits[-1])))
    for i in range(len(prompts)):
        shard.drop(f"r{i}")
    return out


@pytest.mark.parametrize("name", EXPERT_BACKENDS)
@pytest.mark.parametrize("fixture", ["qwen3moe.gguf", "qwen3moe-wide.Q4_K_M.gguf"])
def test_eight_requests_in_a_batch_give_their_solo_tokens(name: str, fixture: str) -> None:
    model = GGUFModel(FIXTURES / fixture)
    cfg = model.config
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, 5 + 3 * i) for i in range(8)]
    engine = get_backend(name)
    if name == "onnx":
        from backends.onnx import ONNXBackend

        engine = ONNXBackend(threads=2, precision="float32")
    shard = engine.load_shard(cfg, model.shard_weights(0, cfg.n_layers))
    solo = greedy(shard, prompts, 8, batched=False)
    together = greedy(shard, prompts, 8, batched=True)
    assert together == solo
    assert len({tuple(t) for t in solo}) > 1  # the requests differ: the check can tell rows apart
