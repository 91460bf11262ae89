"""A node holds about its layers' bytes in the file: the resident memory a K-quant model adds to a
node process, measured, is within 1.2x of its shard's file bytes plus the KV caches it writes
(ONNX), or 1.35x on MLX, whose own allocations beside its arrays vary from run to run."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from backends import available_backends
from exo_tui.cluster.view import ChatParams
from exo_tui.models.gguf_file import GGUFModel
from tests.factory import write_tiny_llama
from tests.integration.cluster_helpers import coordinator, node_processes

pytestmark = pytest.mark.slow


SHAPE = dict(hidden=1024, intermediate=2816, n_heads=8, n_kv_heads=2, weight_type="Q4_K", embed_type="Q6_K", tied=True,
             context_length=512)
PROMPT = "hello " * 40


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_a_k_quant_models_resident_memory_is_its_file_bytes(tmp_path: Path, backend: str) -> None:
    """Measured against the same node warmed up on a one-layer model of the same shape (loaded and
    run: ONNX Runtime's sessions, arenas and threads, the kernel library), so what the node holds
    whatever it runs is out of the figure: the sixteen-layer model's resident memory beyond that is
    within 1.2x of its extra file bytes and KV caches. Measured: ONNX 1.02-1.05x; MLX 1.12-1.28x
    over nine runs (1.56x while MLX made its float32 scales at load): beside its arrays, which are
    the file's bytes, MLX keeps freed step buffers for reuse (~15 MB after this answer, in-process)
    and each thread that ran a step its own compiled steps, which no count here sees."""
    os.environ["EXO_TUI_HOME"] = str(tmp_path)
    # 16 layers (102 MB) against 1: a step's buffers in ONNX Runtime's arena (~20 MB) grow a little
    # with the model, and stay well inside the 20 %
    small = GGUFModel(write_tiny_llama(tmp_path / "q4k-1.gguf", n_layers=1, **SHAPE))
    model = GGUFModel(write_tiny_llama(tmp_path / "q4k.gguf", n_layers=16, **SHAPE))
    assert {model.tensor_info("blk.0.attn_q.weight").type_name, model.tensor_info("token_embd.weight").type_name} == \
        {"Q4_K", "Q6_K"}
    if backend == "mlx" and "mlx" not in available_backends():
        pytest.skip("MLX is not installed here")
    with node_processes(tmp_path, [backend]) as ns:
        proc = psutil.Process(ns.nodes[0].pid)

        async def resident(m: GGUFModel) -> int:
            async with coordinator(ns, model=m.path) as c:
                assert len(c.plan.shards) == 1
                async for _ in c.chat([{"role": "user", "content": PROMPT}], ChatParams(temperature=0.0, max_tokens=8)):
                    pass
                return proc.memory_info().rss

        async def run() -> None:
            before = await resident(small)
            added = await resident(model) - before
            cfg = model.config
            kv = 2 * cfg.n_kv_heads * cfg.head_dim * 2 * (cfg.n_layers - 1) * 512  # float16 caches, a pool's 512 positions
            extra = model.nbytes - small.nbytes
            print(f"\n{backend}: added {added / 1e6:.1f} MB for {extra / 1e6:.1f} MB of file and {kv / 1e6:.1f} MB of caches: "
                  f"{added / (extra + kv):.3f}x")
            assert added <= {"onnx": 1.2, "mlx": 1.35}[backend] * (extra + kv), (added, extra, kv)
            assert added >= 0.5 * extra  # it did load the model

        asyncio.run(run())
