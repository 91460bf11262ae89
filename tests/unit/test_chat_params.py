"""The console's ``:set NAME VALUE``: one sampling setting from text, checked."""

from __future__ import annotations

import pytest

from exo_tui.cluster.view import ChatParams


def test_settings_change_one_value_and_keep_the_rest() -> None:
    p = ChatParams(temperature=0.7, max_tokens=512)
    q = p.with_setting("temperature", "0")
    assert q.temperature == 0.0 and q.max_tokens == 512 and p.temperature == 0.7
    assert p.with_setting("max-tokens", " 64 ").max_tokens == 64  # dashes and spaces are forgiven
    assert p.with_setting("TOP_P", "0.9").top_p == 0.9
    assert p.with_setting("top_k", "0").top_k == 0
    assert p.with_setting("repetition_penalty", "1.1").repetition_penalty == 1.1
    assert p.with_setting("seed", "7").with_setting("seed", "none").seed is None
    assert "temperature 0 · " in q.describe() and "seed none" in q.describe()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("warmth", "1", "no setting 'warmth': choose one of temperature"),
        ("temperature", "hot", "temperature takes a number, not 'hot'"),
        ("temperature", "-0.1", "temperature takes 0 up to 2"),
        ("temperature", "nan", "temperature takes 0 up to 2"),
        ("top_p", "0", "top_p takes above 0 up to 1"),
        ("top_p", "1.5", "top_p takes above 0 up to 1"),
        ("top_k", "-1", "top_k takes 0 (off) or more"),
        ("top_k", "2.5", "top_k takes a whole number"),
        ("max_tokens", "0", "max_tokens takes 1 or more"),
        ("seed", "lucky", "seed takes a whole number"),
        ("repetition_penalty", "0", "repetition_penalty takes above 0"),
    ],
)
def test_bad_settings_say_what_is_allowed(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ChatParams().with_setting(name, value)
