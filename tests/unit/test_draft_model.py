"""A draft model's op (exo_tui.inference.draft_model): k greedy drafts from its own cache, cut back
to the accepted tokens on the next ask, the same drafts a fresh cache gives; vocabularies compared
token by token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exo_tui.inference.draft_model import DraftModel, DraftStateLost, vocabulary_mismatch
from exo_tui.inference.local import run_shards
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.tokenizer import Tokenizer


def greedy(model: DraftModel, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``tokens``, on a cache of their own."""
    out: list[int] = []
    seq = list(tokens)
    for _ in range(n):
        model.shard.drop("ref")
        logits = run_shards([model.shard], "ref", seq, 0)
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    model.shard.drop("ref")
    return out


@pytest.mark.parametrize("backend", ["onnx", "mlx"])
def test_drafts_follow_the_accepted_tokens_after_a_cut_back(tiny_models: dict[str, Path], backend: str) -> None:
    model = DraftModel(GGUFModel(tiny_models["Q8_0"]), backend)
    try:
        prompt = [5, 17, 40, 99, 3, 8]
        first = model.propose("r", 0, prompt, 4)
        assert first == greedy(model, prompt, 4)
        # two drafts accepted, then a token of the target's own: the cache (prompt + 3 drafts) goes back to 8
        accepted = [*prompt, *first[:2], (first[2] + 1) % 256]
        held = len(prompt) + 3
        again = model.propose("r", len(prompt) + 2, accepted[len(prompt) + 2:], 5)
        assert again == greedy(model, accepted, 5)
        assert model.shard.kv_length("r") == len(accepted) + 4 and held < len(accepted) + 4
        with pytest.raises(DraftStateLost):  # more positions than it holds: ask again from 0
            model.propose("r", 100, [1], 2)
        assert model.propose("r", 0, accepted, 2) == again[:2]
    finally:
        model.close()


def test_vocabularies_are_compared_token_by_token(tiny_models: dict[str, Path]) -> None:
    gguf = GGUFModel(tiny_models["F32"])
    target = Tokenizer.from_gguf(gguf)
    assert vocabulary_mismatch(target, Tokenizer.from_gguf(GGUFModel(tiny_models["Q4_1"])), "q") == ""
    fields = {k: gguf.field(k) for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                          "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id")}
    fields["tokenizer.ggml.token_type"] = gguf.field_array("tokenizer.ggml.token_type")
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[200], tokens[201] = tokens[201], tokens[200]  # the same size, two tokens swapped
    other = Tokenizer.from_fields({**fields, "tokenizer.ggml.tokens": tokens})
    why = vocabulary_mismatch(target, other, "swapped")
    assert why.startswith("the draft model swapped's token 200 is") and why.count(".") <= 1
