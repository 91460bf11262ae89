"""Streaming detokenization: whole characters only, and the same text as a full decode."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_tui.models.detokenizer import StreamingDetokenizer
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.tokenizer import Tokenizer
from tests.unit.test_tokenizer import spm_fields

MULTIBYTE = [
    "Hello 😀 world",
    "日本語のテキストと中文和한국어",
    "family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "math ∑∫√ and arrows ⟶ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "😀😀😀😀😀",
]


@pytest.fixture(scope="module")
def smol(default_tokenizer: Tokenizer) -> Tokenizer:
    return default_tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFModel(tiny_model))


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    d = StreamingDetokenizer(tok, skip_special=skip_special)
    return [d.add(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_text_streams_whole_characters(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    outs = stream(smol, ids)
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs)  # never half a character


def test_emoji_split_across_tokens_is_held_back(smol: Tokenizer) -> None:
    ids = smol.encode("😀")
    assert len(ids) > 1, "the emoji takes several byte-level tokens"
    d = StreamingDetokenizer(smol)
    outs = []
    for i in ids[:-1]:
        outs.append(d.add(i))
        assert d.pending_bytes > 0
    assert outs == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "😀" and d.pending_bytes == 0
    assert d.flush() == ""


def test_cjk_characters_split_across_tokens(smol: Tokenizer) -> None:
    text = "世界"
    ids = smol.encode(text)
    pieces = [smol.token_bytes(i) for i in ids]
    assert any(len(p) < 3 for p in pieces), "a CJK character (3 bytes) spans tokens"
    outs = stream(smol, ids)
    assert "".join(outs) == text and set(outs) <= {"", "世", "界", "世界"}


def test_unfinished_character_at_the_end(smol: Tokenizer) -> None:
    ids = smol.encode("a😀")[:-1]  # stop in the middle of the emoji
    d = StreamingDetokenizer(smol)
    assert "".join(d.add(i) for i in ids) == "a"
    assert d.flush() == "\ufffd"
    assert smol.decode(ids) == "a\ufffd"


def test_special_tokens_are_skipped_by_default(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(stream(smol, ids)) == "assistant\nHi"
    assert "".join(stream(smol, ids, skip_special=False)) == "<|im_start|>assistant\nHi<|im_end|>"


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_for_random_tokens_default(smol: Tokenizer, data: st.DataObject, skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, smol.vocab_size - 1), max_size=40))
    assert "".join(stream(smol, ids, skip)) == smol.decode(ids, skip_special=skip)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_for_random_tokens_tiny(tiny: Tokenizer, data: st.DataObject, skip: bool) -> None:
    # the tiny vocabulary is mostly single bytes, so random ids make broken UTF-8 often
    ids = data.draw(st.lists(st.integers(0, tiny.vocab_size - 1), max_size=60))
    outs = stream(tiny, ids, skip)
    assert "".join(outs) == tiny.decode(ids, skip_special=skip)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_stream_of_encoded_text_is_the_text(tiny: Tokenizer, text: str) -> None:
    outs = stream(tiny, tiny.encode(text, parse_special=False), skip_special=False)
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs) or "\ufffd" in text


def test_sentencepiece_stream_drops_the_prefix_space() -> None:
    tok = Tokenizer.from_fields(spm_fields())
    ids = tok.encode("hello world é", add_special=False)
    assert "".join(stream(tok, ids)) == "hello world é" == tok.decode(ids)
    with_bos = tok.encode("hello world")
    assert "".join(stream(tok, with_bos)) == "hello world" == tok.decode(with_bos, skip_special=True)


def test_work_per_token_does_not_grow(smol: Tokenizer) -> None:
    """No re-decoding of the history: the decoder holds at most one unfinished character."""
    d = StreamingDetokenizer(smol)
    ids = smol.encode("word 😀 " * 500)
    for i in ids:
        d.add(i)
        assert d.pending_bytes < 4
    assert d.tokens == len(ids)
