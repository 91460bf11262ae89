"""Sampling: greedy, temperature, top-k/top-p/min-p supports, penalties, seeded determinism."""

from __future__ import annotations

import json
import math

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from exo_tui.inference.sampling import (
    MAX_TOP_LOGPROBS,
    Sampler,
    SamplingParams,
    TokenLogprobs,
    _draw,
    scores_from_array,
    scores_to_array,
    token_logprobs,
)

logit_arrays = arrays(
    np.float32,
    st.integers(2, 300),
    elements=st.floats(-30, 30, width=32, allow_nan=False, allow_infinity=False),
)
histories = st.lists(st.integers(0, 299), max_size=20)


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def test_params_defaults_and_validation() -> None:
    p = SamplingParams()
    assert (p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (0, 1.0, 0.0, 1.0, None)
    for bad in (
        {"temperature": -1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 1.0},
        {"repetition_penalty": 0},
        {"temperature": float("nan")},
        {"seed": -1},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
    ):
        with pytest.raises(ValueError, match="bad sampling parameters"):
            SamplingParams(**bad)


@given(
    st.builds(
        SamplingParams,
        temperature=st.floats(0, 5),
        top_k=st.integers(0, 100),
        top_p=st.floats(0.01, 1.0),
        min_p=st.floats(0, 0.99),
        repetition_penalty=st.floats(0.5, 2),
        repetition_window=st.integers(0, 100),
        frequency_penalty=st.floats(-2, 2),
        presence_penalty=st.floats(-2, 2),
        seed=st.none() | st.integers(0, 2**64 - 1),
    )
)
def test_params_round_trip_through_json_and_msgpack(p: SamplingParams) -> None:
    d = p.to_dict()
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(d))) == p


def test_from_dict_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameters: evil"):
        SamplingParams.from_dict({"evil": 1})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams.from_dict({"top_k": 1.5})
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams.from_dict({"temperature": "hot"})
    assert SamplingParams.from_dict({"temperature": 1}).temperature == 1.0
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_with_seed_fixes_a_seed_once() -> None:
    p = SamplingParams(seed=None).with_seed()
    assert p.seed is not None and p.with_seed() == p
    assert Sampler(SamplingParams(seed=None)).seed is not None


@given(logit_arrays, histories)
def test_greedy_is_argmax_drawn_with_certainty(logits: np.ndarray, history: list[int]) -> None:
    assert Sampler(SamplingParams(temperature=0, seed=1)).sample(logits, history) == (int(np.argmax(logits)), 0.0)


@given(logit_arrays, st.integers(0, MAX_TOP_LOGPROBS), st.data())
def test_token_logprobs_are_the_models_log_softmax_and_its_likeliest_tokens(
    logits: np.ndarray, top: int, data: st.DataObject
) -> None:
    token = data.draw(st.integers(0, logits.size - 1))
    got = token_logprobs(logits, token, top)
    exact = np.log(softmax(logits))
    assert got.token == token
    assert got.logprob == pytest.approx(exact[token], abs=1e-4)
    assert len(got.top) == min(top, logits.size)
    ids = [t for t, _ in got.top]
    assert len(set(ids)) == len(ids)
    for t, lp in got.top:
        assert lp == pytest.approx(exact[t], abs=1e-4)
    if got.top:  # the best first, and nothing left out is likelier than the last listed
        assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True)
        assert ids[0] == int(np.argmax(logits)) or logits[ids[0]] == logits.max()
        outside = np.delete(logits, ids)
        assert outside.size == 0 or outside.max() <= logits[ids[-1]]
    assert TokenLogprobs.from_wire(msgpack.unpackb(msgpack.packb(got.to_wire()))) == got


@given(st.integers(0, 5), st.integers(0, 40), st.data())
def test_scores_travel_as_one_array_and_back(k: int, n: int, data: st.DataObject) -> None:
    ids, values = st.integers(0, 2**31 - 1), st.floats(-1e4, 0, allow_nan=False)
    scores = [TokenLogprobs(data.draw(ids), data.draw(values), tuple((data.draw(ids), data.draw(values)) for _ in range(k)))
              for _ in range(n)]
    array = scores_to_array(scores)
    assert array.shape == ((n, 2 + 2 * k) if n else (0, 2))  # no rows: nothing says how many alternatives
    assert scores_from_array(array) == scores


def test_scores_from_what_is_not_an_array_of_them_are_refused() -> None:
    good = scores_to_array([TokenLogprobs(3, -0.5, ((3, -0.5), (7, -1.0)))])
    for bad in (good.astype(np.float32), good[:, :3], good.reshape(-1), np.full((1, 44), -1.0),
                np.array([[1.5, -0.5]]), np.array([[-1.0, -0.5]]), np.array([[np.nan, -0.5]])):
        with pytest.raises(ValueError, match="scores"):
            scores_from_array(bad)
    with pytest.raises(ValueError, match="same number of alternatives"):
        scores_to_array([TokenLogprobs(1, -1.0, ((1, -1.0),)), TokenLogprobs(2, -1.0)])


def test_token_logprobs_refuse_what_they_cannot_be() -> None:
    with pytest.raises(ValueError, match=r"top logprobs must be in \[0, 20\]"):
        token_logprobs(np.zeros(4, np.float32), 0, 21)
    for bad in ([1, 0.5], [1, "x", []], [1, 0.5, [[1]]], {"token": 1}, [1, 0.5, [[i, 0.0] for i in range(21)]]):
        with pytest.raises(ValueError, match="bad token logprobs"):
            TokenLogprobs.from_wire(bad)


@given(logit_arrays, st.integers(0, 1000))
def test_tiny_temperature_is_greedy(logits: np.ndarray, step: int) -> None:
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] < 1e-3:
        return  # a near tie is a fair coin at any temperature
    token, logprob = Sampler(SamplingParams(temperature=1e-5, seed=3)).sample(logits, [0] * step)
    assert token == int(np.argmax(logits))
    assert logprob == pytest.approx(0.0, abs=1e-6)


def test_extreme_temperatures_stay_finite() -> None:
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    assert Sampler(SamplingParams(temperature=1e-45, seed=1)).sample(logits, []) == (1, 0.0)
    token, logprob = Sampler(SamplingParams(temperature=1e6, seed=1)).sample(logits, [])
    assert logprob == pytest.approx(math.log(1 / 3), abs=1e-4)


@settings(max_examples=300)
@example(np.array([5.0, 0.0, 1.1754944e-38], dtype=np.float32), 2, 0, [])  # ties at float32 resolution
@given(logit_arrays, st.integers(1, 20), st.integers(0, 2**32), histories)
def test_top_k_restricts_the_support(logits: np.ndarray, k: int, seed: int, history: list[int]) -> None:
    token, logprob = Sampler(SamplingParams(temperature=1.0, top_k=k, seed=seed)).sample(logits, history)
    # Compared as the sampler compares them, relative to the best in float32: logits closer than
    # float32 resolution there (0.0 and 1e-38 beside 5.0) are ties, and ties with the k-th are kept.
    centred = logits - logits.max()
    kth = np.sort(centred)[::-1][min(k, logits.size) - 1]
    assert centred[token] >= kth
    kept = logits[centred >= kth]
    assert logprob == pytest.approx(float(logits[token]) - float(np.log(np.exp(kept.astype(np.float64)).sum())), abs=1e-4)


@settings(max_examples=200)
@example(np.array([-3.396035e-15, 0.0, -1.0], dtype=np.float32), 0.25, 1.0, 0, [])  # a tie at float32 resolution
@given(logit_arrays, st.floats(0.05, 0.99), st.floats(0.3, 3), st.integers(0, 2**32), histories)
def test_top_p_restricts_the_support(logits: np.ndarray, top_p: float, temp: float, seed: int, history: list[int]) -> None:
    token, logprob = Sampler(SamplingParams(temperature=temp, top_p=top_p, seed=seed)).sample(logits, history)
    probs = softmax(logits.astype(np.float64) / temp)
    # The sampler weighs in float32: probabilities within float32 resolution of each other are
    # ties (logits -3e-15 and 0.0 both weigh exactly 1), and either may be the one it keeps.
    heavier = probs[probs > probs[token] * (1 + 1e-6)].sum()
    assert heavier < top_p + 1e-6  # the token is inside the nucleus
    nucleus_mass = probs[probs >= probs[token] * (1 - 1e-6)].sum()
    assert math.exp(logprob) >= probs[token] - 1e-6
    assert math.exp(logprob) <= probs[token] / min(top_p, nucleus_mass) * (1 + 1e-4) + 1e-6


@given(logit_arrays, st.floats(0.01, 0.9), st.integers(0, 2**32))
def test_min_p_restricts_the_support(logits: np.ndarray, min_p: float, seed: int) -> None:
    token, _ = Sampler(SamplingParams(temperature=1.0, min_p=min_p, seed=seed)).sample(logits, [])
    probs = softmax(logits)
    assert probs[token] >= min_p * probs.max() * (1 - 1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    pos = np.array([2.0, 1.9, -5.0], np.float32)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert Sampler(greedy).sample(pos, [])[0] == 0
    assert Sampler(greedy).sample(pos, [0])[0] == 1  # 2.0 / 1.2 < 1.9
    neg = np.array([-1.0, -1.1, -5.0], np.float32)
    assert Sampler(greedy).sample(neg, [0])[0] == 1  # -1.0 * 1.2 < -1.1
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.0)).sample(pos, [0])[0] == 0
    # only the last tokens count when a window is set
    windowed = SamplingParams(temperature=0, repetition_penalty=1.2, repetition_window=1)
    assert Sampler(windowed).sample(pos, [0, 2])[0] == 0
    assert Sampler(windowed).sample(pos, [2, 0])[0] == 1


def test_frequency_and_presence_penalties() -> None:
    logits = np.array([5.0, 4.0, 3.5, 0.0], np.float32)
    freq = Sampler(SamplingParams(temperature=0, frequency_penalty=0.6))
    assert freq.sample(logits, [])[0] == 0
    assert freq.sample(logits, [0, 0]) == (1, 0.0)  # 3.8 < 4
    # what the model gives the token is reported as it is, before any penalty
    assert token_logprobs(logits, 1).logprob == pytest.approx(math.log(softmax(logits)[1]), abs=1e-6)
    assert freq.sample(logits, [0, 0, 0, 1])[0] == 2  # 3.2 and 3.4 against 3.5
    pres = Sampler(SamplingParams(temperature=0, presence_penalty=1.6))
    assert pres.sample(logits, [0, 0, 0])[0] == 1  # once, however often: 3.4 < 4
    assert pres.sample(logits, [0, 1])[0] == 2  # 3.4 and 2.4 against 3.5


def test_repetition_penalty_changes_the_sampled_distribution() -> None:
    logits = np.array([2.0, 2.0], np.float32)
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0, seed=11)
    draws = [Sampler(params).sample(logits, [0] * n)[0] for n in range(1, 2001)]
    counts = np.bincount(draws, minlength=2)
    expected = softmax(np.array([2.0 / 3.0, 2.0]))  # token 0 is in the history: 2.0 / 3
    assert chi_square(counts, expected) < 10.83  # 1 degree of freedom, p = 0.001
    assert counts[0] < 0.3 * counts.sum()


def test_same_seed_and_history_same_token() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(49152).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    history = [5, 6, 7]
    first = [Sampler(params).sample(logits, history) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    other = [Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=s)).sample(logits, history)[0] for s in range(20)]
    assert len(set(other)) > 10  # seeds matter


def test_resumed_request_samples_the_same_tokens() -> None:
    """A sampler rebuilt from the token history (failover) continues with the same tokens."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((64, 500)).astype(np.float32) * 2

    def logits_for(history: list[int]) -> np.ndarray:  # a deterministic stand-in for the model
        return table[(sum(history) * 31 + len(history)) % 64]

    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=77)
    history = [1, 2, 3]
    a = Sampler(params)
    for _ in range(40):
        history.append(a.sample(logits_for(history), history)[0])
    resumed = history[:23]
    b = Sampler(SamplingParams.from_dict(params.to_dict()))  # as it arrives over the wire
    while len(resumed) < len(history):
        resumed.append(b.sample(logits_for(resumed), resumed)[0])
    assert resumed == history
    assert len(set(history[3:])) > 5  # it did sample, not repeat one token


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_distribution() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=2024))
    counts = np.bincount([s.sample(logits, [0] * n)[0] for n in range(4000)], minlength=4)
    assert chi_square(counts, probs) < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_temperature_flattens_and_sharpens() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(probs).astype(np.float32)
    for temp in (0.5, 2.0):
        s = Sampler(SamplingParams(temperature=temp, seed=5))
        counts = np.bincount([s.sample(logits, [0] * n)[0] for n in range(4000)], minlength=4)
        assert chi_square(counts, softmax(np.log(probs) / temp)) < 16.27


def test_top_p_draws_follow_the_renormalised_nucleus() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=9))
    draws = [s.sample(np.log(probs).astype(np.float32), [0] * n) for n in range(3000)]
    counts = np.bincount([t for t, _ in draws], minlength=4)
    assert counts[0] == counts[1] == 0  # 0.4 + 0.3 reaches 0.5
    assert chi_square(counts[2:], np.array([3 / 7, 4 / 7])) < 10.83  # 1 degree of freedom, p = 0.001
    logprobs = {t: lp for t, lp in draws}
    assert logprobs[2] == pytest.approx(math.log(3 / 7), abs=1e-5)
    assert logprobs[3] == pytest.approx(math.log(4 / 7), abs=1e-5)


def test_large_vocab_never_picks_masked_tokens() -> None:
    logits = np.full(49152, -np.inf, np.float32)
    allowed = [3, 4097, 30000, 49151]
    logits[allowed] = [0.0, 1.0, 0.5, 2.0]
    s = Sampler(SamplingParams(temperature=1.5, seed=0))
    assert {s.sample(logits, [0] * n)[0] for n in range(300)} == set(allowed)


def test_unusable_logits_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams(temperature=1.0)).sample(np.array([0.0, np.nan], np.float32), [])
    with pytest.raises(ValueError, match="not usable"):
        Sampler(SamplingParams(temperature=0)).sample(np.array([np.nan, np.nan], np.float32), [])
    with pytest.raises(ValueError, match="not usable"):
        Sampler(SamplingParams(temperature=1.0)).sample(np.full(4, -np.inf, np.float32), [])


@given(
    arrays(np.float32, st.integers(1, 3000), elements=st.sampled_from([0.0, 1e-6, 0.01, 0.5, 1.0, 3.0])),
    st.floats(0, 1, exclude_max=True),
)
def test_blockwise_draw_matches_a_plain_cumulative_sum(w: np.ndarray, u: float) -> None:
    if not w.any():
        return
    j, total = _draw(w, u)
    cdf = np.cumsum(w.astype(np.float64))
    assert w[j] > 0
    assert total == pytest.approx(cdf[-1], rel=1e-9)
    target = u * cdf[-1]
    lo = cdf[j - 1] if j else 0.0
    assert lo - 1e-9 * cdf[-1] <= target <= cdf[j] + 1e-9 * cdf[-1]


@settings(max_examples=300)
@given(logit_arrays, st.floats(0.05, 0.99), st.floats(0.1, 3))
def test_the_nucleus_is_the_same_found_among_the_heavy_tokens_or_by_buckets(
    logits: np.ndarray, top_p: float, temp: float
) -> None:
    """top-p looks among the heavy tokens first (fast) and falls back to buckets over the whole
    vocabulary; where both apply they must keep the same tokens."""
    from exo_tui.inference import sampling

    logw = ((logits - logits.max()) * np.float32(1 / temp)).astype(np.float32)
    w = np.exp(logw)
    fast = np.sort(sampling._nucleus(logw, w, top_p))
    saved = sampling._HEAVY_MAX
    sampling._HEAVY_MAX = -1  # the bucket path only
    try:
        slow = np.sort(sampling._nucleus(logw, w, top_p))
    finally:
        sampling._HEAVY_MAX = saved
    assert np.array_equal(fast, slow)
