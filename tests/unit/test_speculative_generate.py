"""Speculative decoding in the generation loop over an in-process pipeline (ONNX, MLX, split and
mixed): with each draft source (prompt lookup, a prediction that is the answer, one that is an
edit of it) the answer is the one decoding without speculation gives, token for token, greedy and
sampled, logprobs included; drafts were run and accepted; usage counts add up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends import available_backends
from exo_tui.inference.generate import generate
from exo_tui.inference.local import LocalPipeline, even_split
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams
from exo_tui.inference.speculation import Speculation
from exo_tui.models.model import Model

PLANS = [p for p in (["onnx"], ["mlx"], ["onnx", "mlx"], ["mlx", "onnx", "onnx"])
         if set(p) <= set(available_backends())]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Model:
    return Model(tiny_models["Q8_0"])


async def answer(model: Model, request: Request, backends: list[str]) -> str:
    pipeline = LocalPipeline()
    await pipeline.load(model.gguf, even_split(model.config.n_layers, backends))
    try:
        text = ""
        async for chunk in generate(pipeline, model.tokenizer, request, context_length=model.config.context_length):
            text += chunk.text
        for shard in pipeline.shards:
            assert not shard.requests()  # released
        return text
    finally:
        await pipeline.close()


def request_of(model: Model, sampling: SamplingParams, speculation: Speculation | None = None,
               logprobs: int | None = None) -> Request:
    return Request(model.tokenizer.encode("one two three one two three one two"), sampling, max_tokens=40,
                   top_logprobs=logprobs, speculation=speculation)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5),
                                      SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1, seed=9)],
                         ids=["greedy", "sampled", "penalised"])
@pytest.mark.parametrize("backends", PLANS, ids=["+".join(p) for p in PLANS])
def test_every_draft_source_gives_the_answer_without_speculation(model: Model, backends: list[str],
                                                                  sampling: SamplingParams) -> None:
    plain = request_of(model, sampling, logprobs=2)
    want = asyncio.run(answer(model, plain, backends))
    assert len(plain.generated) > 10
    vocab = model.config.vocab_size
    edited = [(t + 1) % vocab if i % 7 == 3 else t for i, t in enumerate(plain.generated)]  # edits all along
    sources = {"lookup": Speculation.for_request(4),
               "prediction": Speculation.for_request("auto", plain.generated, lookup=False),
               "edited prediction": Speculation.for_request(8, edited)}
    for name, spec in sources.items():
        assert spec is not None
        request = request_of(model, sampling, spec, logprobs=2)
        got = asyncio.run(answer(model, request, backends))
        assert (got, request.generated) == (want, plain.generated), name
        assert [(x.token, [t for t, _ in x.top]) for x in request.logprobs] == \
            [(x.token, [t for t, _ in x.top]) for x in plain.logprobs]
        assert [x.logprob for x in request.logprobs] == pytest.approx([x.logprob for x in plain.logprobs], abs=1e-3)
        stats = spec.stats
        assert stats.steps > 0 and stats.drafted >= stats.accepted > 0, name
        if name == "prediction":  # the answer itself: every draft kept, a few steps for 40 tokens
            assert stats.accepted == stats.drafted and stats.prediction_accepted == stats.accepted
            assert stats.steps < len(plain.generated) // 2
        if name == "edited prediction":
            assert stats.prediction_rejected > 0
