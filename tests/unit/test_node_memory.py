"""A node gives the memory a shard load freed back to the system."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from exo_tui.node.host import _malloc_trim

# Streams the default model's tensors into a ShardHost as the coordinator does (a transfer:
# begin, chunks, commit) and prints the resident memory afterwards.
LOAD = r"""
import gc, hashlib, json, sys
import exo_tui.node.host as host_module
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.registry import resolve_model

if sys.argv[1] == "keep":
    host_module.return_freed_memory = lambda: None
model = GGUFModel(resolve_model())
config = model.config
payload = [model.raw_tensor(n) for n in model.shard_tensor_names(0, config.n_layers)]
payload = [(info, bytes(raw)) for info, raw in payload]
del model
gc.collect()
host = host_module.ShardHost("n-test", "onnx")
transfer = host.begin_transfer("t", config, 0, config.n_layers, "onnx", [info for info, _ in payload])
offset = 0
for info, data in payload:
    transfer.add_chunk(offset, data, hashlib.sha256(data).hexdigest())
    offset += len(data)
del payload, data
host.commit_transfer("t")
gc.collect()
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(json.dumps({"rss_mb": rss / 1024}))
"""


def resident_after_load(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", LOAD, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_mb"]


@pytest.mark.skipif(_malloc_trim() is None, reason="this C library has no malloc_trim (not glibc)")
def test_a_shard_load_gives_its_temporaries_back() -> None:
    """Loading the default model on a node frees ~300 MB of temporaries (weights as received,
    unpacked, repacked); glibc would keep them for reuse, the node hands them back."""
    kept = resident_after_load("keep")
    returned = resident_after_load("return")
    assert returned < kept - 100, (returned, kept)
