"""Speculative decoding in the generation loop over an in-process pipeline (ONNX, MLX, split and
mixed): with each draft source (prompt lookup, a prediction that is the answer, one that is an
edit of it) the answer is the one decoding without speculation gives, token for token, greedy and
sampled, logprobs included; drafts were run and accepted; usage counts add up."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from backends import available_backends
from exo_tui.inference.draft_model import DraftModel
from exo_tui.inference.drafts import DraftSource
from exo_tui.inference.generate import generate
from exo_tui.inference.local import LocalPipeline, even_split
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams
from exo_tui.inference.speculation import Speculation, StepCosts
from exo_tui.inference.speculative import Draft
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.model import Model
from tests.factory import write_tiny_llama

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


class InProcessDrafts(DraftSource):
    """A real draft model in this process, asked as a node's ``draft_step`` asks it (the tokens
    its cache holds kept, the rest run; :class:`~exo_tui.cluster.drafting.ModelDrafts` without
    the network)."""

    name = "model"
    cheap = False

    def __init__(self, model: DraftModel, rid: str, sampling: SamplingParams) -> None:
        self.model, self.rid, self.sampling = model, rid, sampling
        self.held: list[int] = []

    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> Draft:
        n = next((i for i, (a, b) in enumerate(zip(tokens, self.held, strict=False)) if a != b),
                 min(len(tokens), len(self.held)))
        draft = self.model.propose(self.rid, n, list(tokens[n:]), k, self.sampling)
        self.held = [*tokens, *draft.tokens[:-1]]
        return draft


def measured(per_row: float) -> StepCosts:
    """A plan's cost as its streams measured it: ``k`` drafts add ``per_row * k`` of a 1-row step."""
    costs = StepCosts()
    for k in (1, 2, 3, 4, 1, 2, 3, 4):
        costs.add(k, per_row * k)
    return costs


# What auto reads besides the answer: the plan's measured step costs, the streams running, a 1-row
# step's time (what enables a probe). Each would change k, so the places of the verify steps.
CONDITIONS = {"nothing measured": (StepCosts(), 1, None), "cheap rows": (measured(0.02), 1, 0.01),
              "dear rows, 8 streams": (measured(2.0), 8, 0.01), "a busy ring": (measured(0.3), 16, 0.01)}


@pytest.mark.parametrize("source", ["model", "prediction", "lookup"])
def test_a_seeded_sampled_answer_repeats_under_auto_whatever_it_measures(
        model: Model, tmp_path: Path, source: str) -> None:
    """The same seeded sampled request, sent under auto with the step costs and load it reads
    injected differently each time (so auto would choose another k, or none), gives the same
    answer every time, with a real draft model (whose drafts are checked with min(1, p/q) and
    the residual: its tokens depend on where verify steps fall), a prediction or prompt lookup."""
    sampling = SamplingParams(temperature=0.9, seed=11)
    plain = request_of(model, sampling)
    asyncio.run(answer(model, plain, ["onnx"]))
    draft = DraftModel.open(GGUFModel(write_tiny_llama(tmp_path / "d.gguf", weight_type="Q4_0", seed=3)), "onnx")
    texts, ks = [], []
    try:
        for i, (costs, streams, step_s) in enumerate(CONDITIONS.values()):
            spec = Speculation.for_request("auto", plain.generated if source == "prediction" else None,
                                           lookup=source != "prediction", seeded=True)
            assert spec is not None
            if source == "model":
                spec.drafter.sources.insert(0, InProcessDrafts(draft, f"r{i}", sampling))
            spec.costs, spec.step_s = costs, step_s
            spec.streams = lambda n=streams: n
            request = request_of(model, sampling, spec)
            texts.append(asyncio.run(answer(model, request, ["onnx"])))
            ks.append(spec.stats.k_chosen)
    finally:
        draft.close()
    assert texts == [texts[0]] * len(texts), ks
    assert any(ks) and len(texts[0]) > 20
    if source != "model":  # drafts without probabilities: the tokens plain steps give
        assert request.generated == plain.generated


def test_a_draft_model_turns_off_where_it_slows_the_ring_unless_the_client_seeded_the_answer(
        model: Model, tmp_path: Path) -> None:
    """Under 8 streams whose verify rows cost a ring's step each, a sampled stream whose seed
    exo-tui chose (nobody can ask for its answer again) runs none of its draft model's drafts,
    as a greedy one would not; one whose client gave the seed keeps the k its answer alone gives
    (above: the seed gives the same answer again)."""
    sampling = SamplingParams(temperature=0.9, seed=11)
    draft = DraftModel.open(GGUFModel(write_tiny_llama(tmp_path / "d.gguf", weight_type="Q4_0", seed=3)), "onnx")
    drafted = {}
    try:
        for seeded in (True, False):
            spec = Speculation.for_request("auto", lookup=False, seeded=seeded)
            assert spec is not None
            spec.drafter.sources.insert(0, InProcessDrafts(draft, f"r{seeded}", sampling))
            spec.costs, spec.step_s, spec.streams = measured(2.0), 0.01, lambda: 8
            asyncio.run(answer(model, request_of(model, sampling, spec), ["onnx"]))
            drafted[seeded] = spec.stats.drafted
    finally:
        draft.close()
    assert drafted[True] > 0 and drafted[False] == 0, drafted
