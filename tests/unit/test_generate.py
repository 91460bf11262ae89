"""The generation loop over an in-process pipeline of a tiny model: lengths, stops, seeds,
cancellation."""

from __future__ import annotations

import asyncio
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_tui.inference import scoring
from exo_tui.inference.generate import Chunk, GenerationError, generate
from exo_tui.inference.local import LocalPipeline, even_split, run_shards
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams, token_logprobs
from exo_tui.models.detokenizer import StreamingDetokenizer
from exo_tui.models.model import Model


async def _run(model: Model, request: Request, backends: list[str] | None = None, stop_after: int | None = None) -> tuple[list[Chunk], LocalPipeline]:
    pipeline = LocalPipeline()
    await pipeline.load(model.gguf, even_split(model.config.n_layers, backends or ["onnx"]))
    chunks: list[Chunk] = []
    agen = generate(pipeline, model.tokenizer, request, context_length=model.config.context_length)
    async for chunk in agen:
        chunks.append(chunk)
        if stop_after is not None and len(chunks) >= stop_after:
            break
    await agen.aclose()
    return chunks, pipeline


def _answer(model: Model, request: Request, backends: list[str] | None = None) -> list[Chunk]:
    """The whole answer, its pipeline closed after it."""
    chunks, pipeline = asyncio.run(_run(model, request, backends))
    asyncio.run(pipeline.close())
    return chunks


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Model:
    return Model(tiny_models["Q8_0"])


def test_max_tokens_and_text(model: Model) -> None:
    request = Request(model.tokenizer.encode("hello there"), SamplingParams(temperature=0.0), max_tokens=7)
    chunks, pipeline = asyncio.run(_run(model, request))
    assert chunks[-1].finish_reason == "length"  # the seeded tiny model's greedy answer has no end-of-text
    assert len(request.generated) == 7
    text = "".join(c.text for c in chunks)
    eos = model.tokenizer.eos_ids
    assert text == model.tokenizer.decode([t for t in request.generated if t not in eos], skip_special=True)
    asyncio.run(pipeline.close())


def test_same_seed_same_tokens_and_split_does_not_matter(model: Model) -> None:
    def once(backends: list[str]) -> list[int]:
        request = Request(model.tokenizer.encode("the cat"), SamplingParams(temperature=50.0, seed=11), 12)
        _answer(model, request, backends)
        return request.generated

    a, b, c = once(["onnx"]), once(["onnx"]), once(["onnx", "mlx"])
    assert a == b == c
    request = Request(model.tokenizer.encode("the cat"), SamplingParams(temperature=50.0, seed=12), 12)
    _answer(model, request)
    assert request.generated != a  # another seed, another draw


@pytest.mark.parametrize("held", [False, True])
def test_a_request_resumed_from_its_answer_so_far_goes_on_with_the_same_text(model: Model, held: bool) -> None:
    """What a standby coordinator does when the leader dies mid-stream (exo_tui/api/forwarding.py):
    the request again, with the tokens whose text the client has, gives the rest of the text."""
    prompt, sampling = model.tokenizer.encode("the cat"), SamplingParams(temperature=50.0, seed=11)
    plain = [c for c in _answer(model, Request(prompt, sampling, 16)) if c.token_id is not None]
    # The cut after a token of several characters. ``held``: with a stop string that begins with
    # its last character (and never completes), which the stop matcher holds back until the next
    # token: the resumed request must start with the matcher where it was, or that character is lost.
    cut = next(i + 1 for i, c in enumerate(plain) if len(c.text) > 1 and c.text.isprintable())
    stop = (plain[cut - 1].text[-1] + "\x07\x07",) if held else ()
    whole = _answer(model, Request(prompt, sampling, 16, stop))
    sent = [c for c in whole if c.token_id is not None][:cut]
    resumed = _answer(model, Request(prompt, sampling, 16, stop, generated=[t for c in sent for t in c.token_ids]))
    assert "".join(c.text for c in sent) + "".join(c.text for c in resumed) == "".join(c.text for c in whole)
    assert resumed[-1].finish_reason == whole[-1].finish_reason


def test_stop_string_is_not_emitted(model: Model) -> None:
    probe = Request(model.tokenizer.encode("abc"), SamplingParams(temperature=0.0), 20)
    chunks = _answer(model, probe)
    full = "".join(c.text for c in chunks)
    assert len(full) >= 4, f"the seeded tiny model's answer {full!r} is too short to cut"
    stop = full[2:4]
    request = Request(model.tokenizer.encode("abc"), SamplingParams(temperature=0.0), 20, stop=(stop,))
    chunks = _answer(model, request)
    text = "".join(c.text for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_a_stop_known_only_when_the_stream_ends_still_says_stop(model: Model) -> None:
    """The answer's first two characters are a stop, and a longer stop starts the same way: the
    text is held back (the longer one would win), the stream ends after two tokens, and the stop
    still ends the text, with finish "stop"."""
    probe = Request(model.tokenizer.encode("abc"), SamplingParams(temperature=0.0), 2)
    chunks = _answer(model, probe)
    two = "".join(c.text for c in chunks)
    assert len(two) >= 2, f"the seeded tiny model's first two tokens make {two!r}"
    request = Request(model.tokenizer.encode("abc"), SamplingParams(temperature=0.0), 2, stop=(two, two + "\x07"),
                      top_logprobs=0)
    chunks = _answer(model, request)
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == "stop"
    assert len(request.logprobs) == 2 and all(c.logprobs == () for c in chunks)  # both tokens cut off whole


def test_closing_the_stream_releases_caches(model: Model) -> None:
    request = Request(model.tokenizer.encode("hello"), SamplingParams(temperature=0.0), 50)
    chunks, pipeline = asyncio.run(_run(model, request, stop_after=2))
    assert all(not shard.requests() for shard in pipeline.shards)
    asyncio.run(pipeline.close())


def test_empty_prompt_is_an_error(model: Model) -> None:
    with pytest.raises(GenerationError, match="prompt is empty"):
        asyncio.run(_run(model, Request([], SamplingParams(temperature=0.0), 5)))


# Stops that never match but hold each character back until the next token's text comes.
HOLDING = tuple(f"{c}\x07" for c in string.printable)


@pytest.mark.parametrize("stop", [(), HOLDING], ids=["no-stops", "held-back"])
def test_logprobs_list_each_answer_token_with_the_chunk_where_its_text_begins(model: Model, stop: tuple[str, ...]) -> None:
    request = Request(model.tokenizer.encode("hello there"), SamplingParams(temperature=0.0), 24, stop=stop, top_logprobs=3)
    chunks = _answer(model, request)
    text = "".join(c.text for c in chunks)
    answer = [t for t in request.generated if t not in model.tokenizer.eos_ids]
    listed = [x for c in chunks for x in c.logprobs]
    assert [lp.token for _, lp in listed] == answer
    assert [lp for _, lp in listed] == request.logprobs[: len(answer)]
    seen = 0
    for c in chunks:  # a chunk lists the tokens whose text begins inside it (the last: what is left)
        end = seen + len(c.text) if c is not chunks[-1] else len(text) + 1
        assert all(seen <= at < end for at, _ in c.logprobs)
        seen += len(c.text)
    offsets = [at for at, _ in listed]
    assert offsets == sorted(offsets) and offsets[0] == 0
    whole = 0
    for at, lp in listed:
        piece = model.tokenizer.token_bytes(lp.token)
        if at and piece and piece.isascii() and not model.tokenizer.is_special(lp.token):
            assert text[at:].startswith(piece.decode())  # a whole-character token: its text is there
            whole += 1
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the likeliest token was chosen
    assert whole


def test_tokens_a_stop_string_cut_off_are_not_listed(model: Model) -> None:
    sampling = SamplingParams(temperature=1.5, seed=7)  # a varied answer (greedy repeats one token)
    probe = Request(model.tokenizer.encode("abc"), sampling, 20, top_logprobs=0)
    chunks = _answer(model, probe)
    full = "".join(c.text for c in chunks)
    assert len(full) >= 6, f"the seeded tiny model's answer {full!r} is too short to cut"
    everything = [x for c in chunks for x in c.logprobs]
    # a stop that begins where a token's text begins: that token is cut off whole
    stop = next((full[at : at + 2] for at, _ in everything[2:] if full.find(full[at : at + 2]) == at > 0), full[4:6])
    request = Request(model.tokenizer.encode("abc"), sampling, 20, stop=(stop,), top_logprobs=0)
    chunks = _answer(model, request)
    cut = full.index(stop)
    assert "".join(c.text for c in chunks) == full[:cut]
    listed = [x for c in chunks for x in c.logprobs]
    assert listed == [x for x in everything if x[0] < cut] and len(listed) < len(everything)


def test_no_logprobs_unless_asked(model: Model) -> None:
    request = Request(model.tokenizer.encode("hello there"), SamplingParams(temperature=0.7, seed=3), 8)
    chunks = _answer(model, request)
    assert request.logprobs == [] and all(c.logprobs == () for c in chunks)


@pytest.mark.parametrize(("max_tokens", "backends"), [(0, ["onnx"]), (3, ["onnx", "mlx"])])
def test_a_scored_prompt_gets_each_tokens_logprob_given_those_before(
    model: Model, monkeypatch: pytest.MonkeyPatch, max_tokens: int, backends: list[str]
) -> None:
    monkeypatch.setattr(scoring, "SCORE_ROWS", 3)  # the prompt's rows run in pieces
    ids = model.tokenizer.encode("hello there, my old friend from far away")
    request = Request(ids, SamplingParams(temperature=0.0), max_tokens, prompt_logprobs=2)
    chunks = _answer(model, request, backends)
    assert len(request.generated) == max_tokens and chunks[-1].finish_reason == "length"
    assert [s.token for s in request.prompt_scores] == ids[1:] and len(ids) > 2 * scoring.SCORE_ROWS

    async def whole() -> np.ndarray:  # every row's logits from one forward
        pipeline = LocalPipeline()
        await pipeline.load(model.gguf, even_split(model.config.n_layers, backends))
        try:
            return run_shards(pipeline.shards, "whole", ids, 0, all_logits=True)
        finally:
            await pipeline.close()

    logits = asyncio.run(whole())
    for i, s in enumerate(request.prompt_scores):
        want = token_logprobs(logits[i], ids[i + 1], 2)
        assert s.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in s.top] == [t for t, _ in want.top]
    unscored = Request(ids, SamplingParams(temperature=0.0), max_tokens)
    _answer(model, unscored, backends)
    assert unscored.prompt_scores == [] and unscored.generated == request.generated


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.data())
def test_listed_tokens_are_those_whose_text_begins_before_the_answer_ends(model: Model, seed: int,
                                                                         data: st.DataObject) -> None:
    """Whatever the stops: the tokens listed are, in order, those whose text begins inside the
    answer the client gets (all of them when no stop string ended it), each with the chunk where
    its text begins."""
    sampling = SamplingParams(temperature=50.0, seed=seed)  # the tiny random model's answers vary only when hot
    probe = Request(model.tokenizer.encode("abc"), sampling, 16, top_logprobs=0)
    full = "".join(c.text for c in _answer(model, probe))
    everything = list(zip(_offsets(model, probe.generated), probe.logprobs, strict=False))
    pieces = st.integers(0, max(len(full) - 1, 0)).flatmap(lambda a: st.just(full[a : a + 3]))  # they match
    holding = st.sampled_from(full or "x").map(lambda c: c + "\x07")  # never match, but hold c back
    stops = data.draw(st.lists(pieces | holding | st.text(min_size=1, max_size=3), max_size=4)
                      .map(lambda x: tuple(s for s in x if s)))
    request = Request(model.tokenizer.encode("abc"), sampling, 16, stop=stops, top_logprobs=0)
    chunks = _answer(model, request)
    text = "".join(c.text for c in chunks)
    listed = [x for c in chunks for x in c.logprobs]
    # A stop string ended it where the text is short of the whole answer: also one found in the
    # text an end-of-sequence token flushes (two bytes of no character, "\ufffd\ufffd", a stop of
    # them, found by Hypothesis: no token's text begins inside the empty answer).
    if text != full:
        assert chunks[-1].finish_reason == "stop"
        assert listed == [x for x in everything if x[0] < len(text)]
    else:
        assert listed == everything[: len(listed)] and len(listed) == len(everything)
    seen = 0
    for c in chunks:
        assert all(seen <= at for at, _ in c.logprobs)
        if c is not chunks[-1]:  # a token of no text at the answer's very end: listed where the text ends
            end = seen + len(c.text)
            assert all(at < end or at == end == len(text) for at, _ in c.logprobs)
        seen += len(c.text)


def test_a_token_of_no_text_at_the_answers_end_is_listed_with_the_text_that_ends_it(model: Model) -> None:
    """Seed 1155363 (found by Hypothesis): the answer's last token before max_tokens decodes to
    nothing; its text would begin at the answer's end, and the chunk that flushes the end lists it
    (every token is listed when no stop string ended the answer), not the finishing chunk."""
    request = Request(model.tokenizer.encode("abc"), SamplingParams(temperature=50.0, seed=1155363), 16,
                      top_logprobs=0)
    chunks = _answer(model, request)
    text = "".join(c.text for c in chunks)
    assert len(request.generated) == 16 and _offsets(model, request.generated)[-1] == len(text)
    listed = [x for c in chunks for x in c.logprobs]
    assert len(listed) == 16 and listed[-1][0] == len(text)
    assert chunks[-1].finish_reason == "length" and not chunks[-1].logprobs and listed[-1] in chunks[-2].logprobs


def test_a_stop_string_in_the_text_an_end_of_sequence_flushes_ends_the_answer(model: Model) -> None:
    """Seed 1912773091: two bytes of no character, then end of sequence; the flushed text is
    "\ufffd\ufffd", and a stop string of it ends the answer there: empty, finished by the stop,
    no token listed (none's text begins inside it)."""
    sampling = SamplingParams(temperature=50.0, seed=1912773091)
    probe = Request(model.tokenizer.encode("abc"), sampling, 16, top_logprobs=0)
    assert "".join(c.text for c in _answer(model, probe)) == "\ufffd\ufffd"
    assert probe.generated[-1] in model.tokenizer.eos_ids
    request = Request(model.tokenizer.encode("abc"), sampling, 16, stop=("\ufffd\ufffd",), top_logprobs=0)
    chunks = _answer(model, request)
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "stop"
    assert [x for c in chunks for x in c.logprobs] == []


def _offsets(model: Model, tokens: list[int]) -> list[int]:
    """Where each token's text begins in the detokenized answer (the end-of-sequence token ends it)."""
    detok = StreamingDetokenizer(model.tokenizer)
    out, at = [], 0
    for t in tokens:
        if t in model.tokenizer.eos_ids:
            break
        out.append(at)
        at += len(detok.add(t))
    return out


def test_every_answered_token_is_in_some_chunk() -> None:
    """A token that gives no text of its own (a byte of a character the next one completes) is
    reported with the chunk that carries its text: the chunks' token ids are the answer's. The
    llama3 fixture's greedy answer to this prompt starts with such a byte."""
    fixture = Path(__file__).parents[1] / "fixtures" / "families" / "llama3.gguf"
    model = Model(fixture)
    request = Request(model.chat_prompt_ids([{"role": "user", "content": "Who moves the layers when a node fails?"}]),
                      SamplingParams(temperature=0.0), max_tokens=16)
    chunks = _answer(model, request)
    first = model.tokenizer.token_bytes(request.generated[0])
    assert first and not first.decode("utf-8", errors="ignore")  # the case this is about
    eos = model.tokenizer.eos_ids
    assert [t for c in chunks for t in c.token_ids] == [t for t in request.generated if t not in eos]
