"""A draft model's op (exo_tui.inference.draft_model): k greedy drafts from its own cache, cut back
to the accepted tokens on the next ask, the same drafts a fresh cache gives; vocabularies compared
token by token. Sampled drafts with their distributions, checked by the last stage's speculative
sampling, keep the target's distribution (issue 42's must-show, with a real draft model)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from backends import get_backend
from exo_tui.inference.draft_model import DraftModel, DraftStateLost, vocabulary_mismatch
from exo_tui.inference.local import Stage, load_shards, run_shards
from exo_tui.inference.sampling import Length, Sampler, SamplingParams
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.tokenizer import Tokenizer
from exo_tui.net.messages import Drafted, DraftQ, DraftStep, Forward
from exo_tui.node.drafting import NodeDrafts
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES, KVBudget, bytes_per_position
from exo_tui.node.sampling_step import Samplers
from tests.factory import write_tiny_llama
from tests.unit.test_speculative import chi_square, critical


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
    model = DraftModel.open(GGUFModel(tiny_models["Q8_0"]), backend)
    try:
        prompt = [5, 17, 40, 99, 3, 8]
        first = list(model.propose("r", 0, prompt, 4).tokens)
        assert first == greedy(model, prompt, 4)
        # two drafts accepted, then a token of the target's own: the cache (prompt + 3 drafts) goes back to 8
        accepted = [*prompt, *first[:2], (first[2] + 1) % 256]
        held = len(prompt) + 3
        again = list(model.propose("r", len(prompt) + 2, accepted[len(prompt) + 2:], 5).tokens)
        assert again == greedy(model, accepted, 5)
        assert model.shard.kv_length("r") == len(accepted) + 4 and held < len(accepted) + 4
        with pytest.raises(DraftStateLost):  # more positions than it holds: ask again from 0
            model.propose("r", 100, [1], 2)
        assert list(model.propose("r", 0, accepted, 2).tokens) == again[:2]
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


# ------------------------------------------------------------------ speculative sampling with a draft model

RUNS = 2000
SAMPLED = {  # the request's sampling, how many of the answer's first tokens are counted, the draft's seed
    "plain": (SamplingParams(temperature=1.0), 1, 3),  # 264 tokens: the draft's rows are cut to their heaviest 256
    "top-k": (SamplingParams(temperature=0.7, top_k=6), 2, 2),  # the draft: the target's weights at 4 bits
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_speculative_sampling_with_a_draft_model_keeps_the_models_distribution(
        tiny_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Over 2000 seeds, the answer's first tokens with a real draft model's drafts (k = 2, drawn
    with each seed and checked by the last stage's sampler from the wire's encoding of their
    distributions) and without speculation fit the tiny target's exact distribution (chi-square);
    the draft is not the target, so drafts are accepted and rejected often."""
    params, n, draft_seed = SAMPLED[name]
    target_gguf = GGUFModel(tiny_models["F32-untied"])
    (target,) = load_shards(target_gguf, [Stage("onnx", 0, target_gguf.config.n_layers)])
    draft = DraftModel.open(GGUFModel(write_tiny_llama(tmp_path / "d.gguf", weight_type="Q4_0", tied=False,
                                                        seed=draft_seed)),
                       "onnx")
    prompt = [5, 17, 40, 99, 3, 8]
    rows: dict[tuple[int, ...], np.ndarray] = {}  # the target's logits after the prompt and these tokens

    def logits(after: tuple[int, ...]) -> np.ndarray:
        if after not in rows:
            target.drop("ref")
            rows[after] = run_shards([target], "ref", [*prompt, *after], 0)
        return rows[after]

    try:
        exact: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(n):
            exact = {(*seq, t): prob * p for seq, prob in exact.items()
                     for t, p in enumerate(Sampler(params).probabilities(logits(seq), Length(len(prompt) + len(seq))))
                     if p > 0}
        with_spec: Counter[tuple[int, ...]] = Counter()
        without: Counter[tuple[int, ...]] = Counter()
        tally: Counter[str] = Counter()
        run_shards([target], "t", prompt[:-1], 0)
        draft.propose("d", 0, prompt[:-1], 1)
        for seed in range(RUNS):
            sampling = replace(params, seed=seed)
            sampler, samplers, seq = Sampler(sampling), Samplers(), list(prompt)
            while len(seq) < len(prompt) + n:
                d = draft.propose("d", len(prompt) - 1, seq[len(prompt) - 1:], 2, sampling)
                assert d.q is not None and len(d.q) == 2
                target.truncate_kv("t", len(seq) - 1)
                got = run_shards([target], "t", [seq[-1], *d.tokens], len(seq) - 1, all_logits=True)
                step = Forward(rid=f"r{seed}", hop=0, pos=len(seq) - 1, step=0, n_tokens=len(seq),
                               sampling=sampling.to_dict(), draft=list(d.tokens), draft_q=DraftQ(*d.q.to_wire()))
                verdict, _ = samplers.verify(step, got)
                seq += verdict.tokens
                tally["drafted"] += verdict.drafted
                tally["accepted"] += verdict.accepted
            with_spec[tuple(seq[len(prompt) : len(prompt) + n])] += 1
            plain: list[int] = []
            for _ in range(n):
                plain.append(sampler.sample(logits(tuple(plain)), Length(len(prompt) + len(plain)))[0])
            without[tuple(plain)] += 1
    finally:
        draft.close()
        target.close()
    for what, counts in (("with speculation", with_spec), ("without", without)):
        stat, df = chi_square(counts, exact, RUNS)
        assert stat < critical(df), f"{name} {what}: chi-square {stat:.1f} on {df} degrees of freedom"
    assert 0.2 < tally["accepted"] / tally["drafted"] < 0.8  # both ways taken, often


# ------------------------------------------------------------------ a node's draft caches in its KV budget

def test_a_nodes_draft_caches_count_against_its_kv_budget(tiny_models: dict[str, Path]) -> None:
    """The node's draft model (its ``draft_step``, the real tiny model) counts every stream's draft
    cache in the node's KV budget: a stream that would take the caches past it drops the least
    recently asked stream's draft cache first; one that cannot fit at all drafts nothing and says
    why; the caches counted never pass the budget, and a ring step sees the room they take."""
    path = str(tiny_models["Q8_0"])
    config = GGUFModel(path).config
    per_position = bytes_per_position(config.n_layers, config.n_kv_heads, config.head_dim,
                                      get_backend("onnx").kv_value_bytes())
    kv = KVBudget(RESERVE_MIN_BYTES + 50 * per_position)  # 50 positions of the draft's caches
    kv.observe(0, 0, settled=True)
    assert kv.budget_bytes == 50 * per_position
    drafts = NodeDrafts("onnx", kv)
    prompt = list(range(5, 25))  # 20 tokens: with k = 4 a stream holds 23 positions

    async def ask(rid: str, tokens: list[int], k: int = 4) -> Drafted:
        got = await drafts.step(DraftStep(rid, path, 0, k), np.asarray(tokens, np.int64))
        assert kv.used_bytes <= kv.budget_bytes
        return got

    async def run() -> None:
        assert len((await ask("a", prompt)).tokens) == 4
        assert len((await ask("b", prompt)).tokens) == 4
        assert kv.draft_held() == {"a": 23, "b": 23} and kv.used_bytes == 46 * per_position
        assert kv.report()["draft_bytes"] == kv.used_bytes
        # a ring shard loaded beside it; its step's cache finds the room the draft caches take
        ring = ("m", 0, config.n_layers)
        kv.set_shards({ring: per_position})
        assert kv.draft_held() == {"a": 23, "b": 23}
        assert kv.check({("r", ring): 5}) != {} and kv.check({("r", ring): 4}) == {}
        got = await ask("c", prompt)  # no room beside a and b: a (the least recently asked) is dropped
        assert len(got.tokens) == 4 and not got.refused
        assert kv.draft_held() == {"b": 23, "c": 23}
        assert drafts.model is not None and drafts.model.by_age() == ["b", "c"]
        got = await ask("d", list(range(60)))  # more than the whole budget: drafts nothing, says why
        assert got.tokens == [] and got.refused.startswith("no room for the draft model's cache of request d")
        assert "KV budget exceeded" in got.refused and kv.draft_held() == {}
        await drafts.drop("c")
        assert kv.used_bytes == 0
        assert len((await ask("c", prompt)).tokens) == 4  # asked again: from the start, counted again
        assert kv.draft_held() == {"c": 23}

    try:
        asyncio.run(run())
    finally:
        drafts.close()
    assert kv.draft_cost is None and kv.used_bytes == 0  # closed: its caches counted no more
