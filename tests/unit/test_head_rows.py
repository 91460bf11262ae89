"""A verify step's head on the rows its check reads (``Shard.forward_rows``): the rows' logits are
``forward(..., all_logits=True)``'s, the cache is the same after it, the verdict is the same, and
where the backend runs the head a row at a time (MLX on the CPU) a check that rejects the first
draft runs the head on one row only."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import HeadRows
from exo_tui.inference.sampling import Length, Sampler, SamplingParams
from exo_tui.inference.speculative import Draft, verify
from tests.unit.test_family_logits import BACKENDS, DENSE, assert_close, backend, fixture

LLAMA = next(e for e in DENSE if e["name"] == "llama3")


@pytest.mark.parametrize("name", BACKENDS)
def test_the_rows_head_gives_all_logits_rows_and_stops_at_the_first_rejection(name: str) -> None:
    gguf, tokens, want = fixture(LLAMA)
    n = gguf.config.n_layers
    first, last = (backend(name).load_shard(gguf.config, gguf.shard_weights(a, b)) for a, b in ((0, 1), (1, n)))
    sampler = Sampler(SamplingParams(temperature=0.0))
    try:
        for rid in ("rows", "all"):
            last.forward(rid, first.forward(rid, tokens[:5], np.arange(5)), np.arange(5))
        # a verify step: the true next token, then 3 right drafts and 2 wrong ones
        drafts = np.concatenate([tokens[5:9], [1, 2]])
        pos = np.arange(5, 5 + len(drafts))
        hidden = first.forward("rows", drafts, pos)
        first.truncate_kv("rows", 5)
        rows = last.forward_rows("rows", hidden, pos)
        full = last.forward("all", first.forward("all", drafts, pos), pos, all_logits=True)
        assert isinstance(rows, HeadRows) and len(rows) == len(drafts)
        got = np.stack([rows[i] for i in range(len(rows))])
        assert_close(got, full, f"{name}: rows against all_logits")
        assert_close(got[:4], want[5:9], f"{name}: rows against transformers")
        assert last.kv_length("rows") == last.kv_length("all") == 5 + len(drafts)

        # the check reads rows up to the first rejected draft and no further
        wrong = Draft((int(tokens[6]) + 1, int(tokens[7]), int(tokens[8])))  # the first draft is wrong
        x = np.array([tokens[5], *wrong.tokens])
        pos = np.arange(5, 9)
        for rid in ("rows", "all"):
            first.truncate_kv(rid, 5)
            last.truncate_kv(rid, 5)
        rows = last.forward_rows("rows", first.forward("rows", x, pos), pos)
        full = last.forward("all", first.forward("all", x, pos), pos, all_logits=True)
        verdict = verify(sampler, rows, Length(5), wrong)
        assert verdict == verify(sampler, full, Length(5), wrong)
        assert verdict.accepted == 0 and verdict.tokens == (int(np.argmax(want[5])),)
        if name == "mlx":
            from backends.mlx.experts import on_cpu

            assert rows.computed == (1 if on_cpu() else len(rows))
        else:
            assert rows.computed == len(rows)  # ONNX: its head costs about the same for a few rows as for one
        # the request goes on from the kept token as one that never ran the drafts
        for shard in (first, last):
            shard.truncate_kv("rows", 6)
        nxt = last.forward("rows", first.forward("rows", tokens[6:7], np.arange(6, 7)), np.arange(6, 7))
        assert_close(nxt, want[6:7], f"{name}: the step after a rejection")
    finally:
        first.close()
        last.close()
