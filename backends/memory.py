"""What a shard takes in memory besides its weights and caches: a load's peak, a step's temporaries.

A node under ``--memory-limit`` checks a load against :func:`load_peak_bytes` before it starts,
and runs a prompt in chunks of :func:`prefill_rows`, whose temporaries fit its reserve; the
scheduler plans with the same numbers (``exo_tui.models.gguf_file``, ``exo_tui.node.kv_budget``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from backends.base import PREFILL_CHUNK
from backends.weights import BLOCK_TYPES, KQUANT_BLOCK_BYTES

if TYPE_CHECKING:
    from backends.base import ModelConfig

# A load's peak beside its shard's arrays (measured by tests/unit/test_node_memory.py): a matrix
# decoded whole takes LOAD_PEAK_DECODED times its file bytes while its layer is built (its codes a
# byte each with float32 scales and biases, and the packing's temporaries; 3.0 for a 2048-wide
# Q4_K_M layer decoded so): the types read by dequantizing to float32; a matrix a backend reads a
# chunk at a time (CHUNKED_TYPES: ONNX's tiles read blocks of 32 and K-quant super-blocks so)
# takes only a chunk's temporaries, LOAD_CHUNK_BYTES (7-12 MB measured); one it makes a chunk at a
# time and then copies whole (COPIED_TYPES: MLX's arrays, made in NumPy, then copied into MLX's
# own) takes its arrays once more besides, the matrices it stacks into one (gate and up; q, k and
# v) together: counted as a piece's two largest (a 2048-wide Q4_K layer: 22-26 MB over what it
# holds after, against 112-122 MB decoded whole).
LOAD_PEAK_DECODED = 3.5
LOAD_CHUNK_BYTES = 16 << 20
CHUNKED_TYPES = {"onnx": frozenset(KQUANT_BLOCK_BYTES) | frozenset(BLOCK_TYPES)}
COPIED_TYPES = {"mlx": frozenset(KQUANT_BLOCK_BYTES) | frozenset(BLOCK_TYPES)}

LoadPiece = list[tuple[str, int, int]]
"""What a load reads at once (a layer's tensors, the embedding, the head): each tensor's GGUF type
name ("" where decoded whole whatever it is), its bytes in the file and as the backend holds it."""


def load_peak_bytes(backend: str, pieces: list[LoadPiece], held: list[int] | None = None) -> int:
    """The bytes a load on ``backend`` takes at its peak beside its shard's arrays, its ``pieces``
    read in turn: a piece's temporaries are its matrices decoded whole, a chunk's where any is
    read or made so, and the arrays of those made a chunk at a time before they are copied.

    Without ``held``, the most any shard of such pieces may take: the largest piece's
    temporaries. With ``held`` (each piece's bytes as the backend holds them, the pieces in the
    order the load reads them), this shard's: at piece ``i`` the load holds the arrays of the
    pieces up to ``i`` and ``i``'s temporaries, which is less than all the arrays and the largest
    temporaries where a large piece comes early (the default model's embedding on ONNX)."""
    chunked = CHUNKED_TYPES.get(backend, frozenset())
    copied = COPIED_TYPES.get(backend, frozenset())

    def temporaries(piece: LoadPiece) -> float:
        whole = sum(LOAD_PEAK_DECODED * n for t, n, _ in piece
                    if t not in chunked and t not in copied)
        copies = sum(sorted((h for t, _, h in piece if t in copied), reverse=True)[:2])
        return whole + copies + (LOAD_CHUNK_BYTES if any(t in chunked or t in copied for t, _, _ in piece) else 0)

    temps = [temporaries(piece) for piece in pieces]
    if held is None:
        return int(max(temps, default=0))
    peak = max((c + t for c, t in zip(itertools.accumulate(held), temps, strict=True)), default=0)
    return max(0, int(peak) - sum(held))


# A step's temporaries. A prompt's rows run in chunks of at most PREFILL_CHUNK (a shard's
# ``prefill_chunk``); a chunk's step holds, at its peak, about STEP_ROW_VALUES float32 values a row
# per unit of the model's widths (hidden + the MLP's), the attention's scores and the new caches
# included: 4.0 measured on the default model (hidden 576, MLP 1536), 5.1-6.4 on hidden 2048 with
# an MLP of 5632, 64-512 rows (benchmarks/step_memory.py, ONNX Runtime's memory patterns off), and
# ONNX Runtime's arena keeps it for the next step. A node under a memory limit runs smaller chunks,
# whose temporaries fit its reserve (exo_tui/node/kv_budget.py); a decode step's are ~1 MB.
MIN_PREFILL_CHUNK = 32
STEP_ROW_VALUES = 6.5


def step_row_bytes(config: ModelConfig) -> int:
    """The temporaries one row of a prompt's chunk takes at a step's peak, on any shard of
    ``config`` (the head's logits aside: only the last row's are computed but where a request
    asks for every position's)."""
    mlp = max(config.intermediate_size, config.expert_width * max(1, config.n_experts_used))
    return int(STEP_ROW_VALUES * 4 * (config.hidden_size + mlp))


def logit_rows(config: ModelConfig, room_bytes: int | None, most: int) -> int:
    """The rows of every-position logits (a prompt scored) a step may hold at once in
    ``room_bytes`` (None: no bound): ``most`` at most, 1 at least. A row is the vocabulary in
    float32, held twice where the shard runs the rows in chunks and joins them."""
    if room_bytes is None:
        return most
    return int(min(most, max(1, room_bytes // (2 * 4 * config.vocab_size))))


def prefill_row_bytes(config: ModelConfig, queued: int) -> int:
    """What a row of a prompt's chunk takes at a node while it runs: its step's temporaries
    (:func:`step_row_bytes`) and the rows of the ``queued`` chunks that may wait there meanwhile
    (a row of hidden states, float32, each; the coordinator's bound:
    :data:`exo_tui.net.protocol.FILL_QUEUED`)."""
    return step_row_bytes(config) + queued * 4 * config.hidden_size


def prefill_rows(config: ModelConfig, room_bytes: int | None, queued: int) -> int:
    """The rows of a prompt's chunk that fit in ``room_bytes`` as it runs, ``queued`` more waiting
    (None: no bound; :func:`prefill_row_bytes`): ``PREFILL_CHUNK`` at most, ``MIN_PREFILL_CHUNK``
    at least, a multiple of it."""
    if room_bytes is None:
        return PREFILL_CHUNK
    rows = room_bytes // prefill_row_bytes(config, queued) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK
    return int(min(PREFILL_CHUNK, max(MIN_PREFILL_CHUNK, rows)))
