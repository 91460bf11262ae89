"""A model's recommended sampling: what a request leaves out takes it, whatever asks (the CLI,
the console's chat, the API)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from exo_tui.cluster.view import ChatParams
from exo_tui.inference.sampling import SamplingParams, with_defaults
from exo_tui.models.model import Model
from tests.factory import write_tiny_llama


def test_given_values_win_then_the_model_then_the_callers_default() -> None:
    model = {"temperature": 0.2, "top_p": 0.9}
    openai = {"temperature": 1.0, "top_p": 1.0, "top_k": 3}
    s = with_defaults({"temperature": None, "top_p": 0.5, "seed": 7}, model, openai)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.2, 0.5, 3, 7)
    assert with_defaults({}) == SamplingParams()  # nothing anywhere: the dataclass's own defaults
    assert with_defaults({"temperature": 0}, model).temperature == 0  # 0 is a value, not "left out"
    with pytest.raises(ValueError, match="top_p must be in"):
        with_defaults({}, {"top_p": 0.0})


def test_a_gguf_recommendation_is_read_and_bad_values_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", sampling={
        "general.sampling.temp": 0.0, "general.sampling.top_k": 5, "general.sampling.top_p": 7.5,
    })
    with caplog.at_level(logging.WARNING):
        model = Model(path)
        assert model.sampling == {"temperature": 0.0, "top_k": 5}
    assert "ignoring general.sampling.top_p = 7.5" in caplog.text
    assert Model(write_tiny_llama(tmp_path / "plain.gguf")).sampling == {}


def test_the_default_model_has_its_cards_sampling() -> None:
    assert Model().sampling == {"temperature": 0.2, "top_p": 0.9}


def test_chat_settings_left_out_take_the_models_and_say_so() -> None:
    recommended = {"temperature": 0.2, "top_p": 0.9}
    p = ChatParams()
    assert p.sampling(recommended) == SamplingParams(temperature=0.2, top_p=0.9)
    assert p.describe(recommended).startswith("temperature 0.2 (model's) · top_p 0.9 (model's) · top_k 0 · ")
    q = p.with_setting("temperature", "0")
    assert q.sampling(recommended).temperature == 0 and q.describe(recommended).startswith("temperature 0 · ")
    assert q.with_setting("temperature", "default").temperature is None
    assert ChatParams().describe().startswith("temperature 0.7 · top_p 1 · ")  # no recommendation
