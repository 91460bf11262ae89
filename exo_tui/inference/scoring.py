"""Scoring a prompt: the logprob of each of its tokens given those before it.

The last shard's step for such a prompt needs every row's logits, not only the last: a row is the
vocabulary (49,152 floats for the default model), so a 2,000-token prompt's logits would be
400 MB at once. The step runs in pieces of ``SCORE_ROWS`` positions instead, each piece's rows
scored and let go.
"""

from __future__ import annotations

import numpy as np

from backends.base import Shard
from exo_tui.inference.sampling import TokenLogprobs, check_scored_top, score_tokens

SCORE_ROWS = 256  # rows of logits held at once (256 x 49,152 floats: 50 MB)


def forward_scored(shard: Shard, request_id: str, x: np.ndarray, positions: np.ndarray,
                   targets: list[int], top: int, rows: int = SCORE_ROWS) -> tuple[np.ndarray, list[TokenLogprobs]]:
    """``shard.forward`` (the last shard) for rows whose first ``len(targets)`` score ``targets``
    (row ``i`` scores ``targets[i]``), ``rows`` at a time: the last row's logits ``(1, vocab)``
    and the scores."""
    if len(targets) >= len(positions):
        raise ValueError(f"{len(targets)} tokens to score, but the step runs {len(positions)}: a prompt is "
                         "scored by the step that runs it from its start")
    check_scored_top(top)  # before any row runs
    scores: list[TokenLogprobs] = []
    last = np.empty(0)
    for a in range(0, len(positions), rows):
        b = min(a + rows, len(positions))
        logits = shard.forward(request_id, x[a:b], positions[a:b], all_logits=True)
        scores += score_tokens(logits, targets[a:b], top)
        last = logits[-1:]
    return last, scores
