"""Stop strings over streamed chunks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exo_tui.inference.stops import StopMatcher


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], bool, StopMatcher]:
    m = StopMatcher(stops)
    outs = []
    stopped = False
    for c in chunks:
        text, stopped = m.feed(c)
        outs.append(text)
        if stopped:
            break
    if not stopped:
        outs.append(m.flush())
    return outs, stopped, m


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_inside_one_chunk() -> None:
    outs, stopped, m = run(["STOP"], ["hello STOP world"])
    assert outs == ["hello "] and stopped and m.matched == "STOP"


def test_stop_spanning_chunks_is_never_emitted() -> None:
    outs, stopped, _ = run(["STOP"], ["Hel", "lo ST", "O", "P more"])
    assert outs == ["Hel", "lo ", "", ""] and stopped
    assert "ST" not in "".join(outs)


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("xST") == ("x", False)
    assert m.held == "ST"
    assert m.feed("AR") == ("STAR", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_after_a_stop_nothing_more() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == ("a", False)
    assert m.feed("\nb") == ("", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_earliest_stop_wins_and_longest_at_a_tie() -> None:
    assert StopMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xabcd") == ("x", True) and m.matched == "abc"


def test_overlapping_partial_prefixes() -> None:
    outs, stopped, m = run(["abc", "bd"], ["ab", "d"])
    assert "".join(outs) == "a" and stopped and m.matched == "bd"
    outs, stopped, _ = run(["aab"], ["a", "a", "a", "b"])
    assert "".join(outs) == "a" and stopped


def test_a_complete_stop_waits_for_an_earlier_one_that_may_still_complete() -> None:
    """Found by the property below: with stops "S" and "aSS", "aS" holds everything back (an "S"
    would make "aSS", which starts first), and the next chunk decides."""
    m = StopMatcher(["S", "aSS"])
    assert m.feed("aS") == ("", False)
    assert m.feed("S") == ("", True) and m.matched == "aSS"
    m = StopMatcher(["S", "aSS"])
    assert m.feed("aS") == ("", False)
    assert m.feed("x") == ("a", True) and m.matched == "S"


def test_a_stop_held_at_the_end_of_the_stream_still_ends_it() -> None:
    m = StopMatcher(["S", "aSS"])
    assert m.feed("baS") == ("b", False)
    assert m.flush() == "a" and m.stopped and m.matched == "S"


def test_empty_stop_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])


@given(
    text=st.text(alphabet="abcS\n ", max_size=40),
    stops=st.lists(st.text(alphabet="abcS\n ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_chunking_gives_the_text_up_to_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    m = StopMatcher(stops)
    emitted = ""
    stopped = False
    for c in chunks:
        out, stopped = m.feed(c)
        emitted += out
        assert expected.startswith(emitted)  # never emits what a stop would take back
        if stopped:
            break
    if not stopped:
        emitted += m.flush()
    assert emitted == expected
    assert m.stopped == bool(hits)  # a stop may be known only at the end (a longer one could have come)
