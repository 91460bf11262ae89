"""exo_tui.inference.speculative: drafted tokens checked against the model.

Deterministic drafts (prompt lookup, a prediction) give exactly the tokens decoding without
speculation gives, greedy and sampled, with every step of the sampler (penalties, temperature,
top-k, top-p, min-p); drafts with a draft model's probabilities keep the model's distribution:
the joint distribution of three tokens of a tiny bigram model, over many seeds, with and without
speculation, against the exact one (a chi-square test at a fixed set of seeds)."""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_tui.inference.sampling import Length, Sampler, SamplingParams
from exo_tui.inference.speculative import Draft, DraftProbs, Verdict, verify

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy-penalised": SamplingParams(temperature=0.0, repetition_penalty=1.3),
    "plain": SamplingParams(temperature=0.9),
    "top-k": SamplingParams(temperature=0.7, top_k=5),
    "top-p": SamplingParams(temperature=1.2, top_p=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
}


class Bigram:
    """A tiny model: the next token's logits depend on the last token only."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0) -> None:
        self.table = np.random.default_rng(seed).standard_normal((vocab, vocab)).astype(np.float32) * scale

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.table[tokens[-1]]

    def rows(self, history: list[int], drafts: tuple[int, ...]) -> np.ndarray:
        """A verify step's rows: after the history, then after each draft."""
        seq = list(history)
        out = [self.logits(seq)]
        for d in drafts:
            seq.append(d)
            out.append(self.logits(seq))
        return np.stack(out)


def plain(model: Bigram, sampler: Sampler, history: list[int], n: int) -> list[int]:
    """``n`` tokens decoded one at a time, without speculation."""
    seq = list(history)
    for _ in range(n):
        seq.append(sampler.sample(model.logits(seq), seen(sampler, seq))[0])
    return seq[len(history):]


def seen(sampler: Sampler, seq: list[int]):
    return seq if sampler.params.uses_history else Length(len(seq))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(list(PARAMS)), seed=st.integers(0, 2**32), k=st.integers(1, 8),
       wrong_at=st.integers(0, 9), vocab=st.sampled_from([3, 17, 300]))
def test_deterministic_drafts_give_the_tokens_decoding_without_speculation_gives(name, seed, k, wrong_at, vocab) -> None:
    """Drafts that are the plain decode's tokens with one changed at ``wrong_at`` (past ``k``: none):
    the verdict keeps them up to it and then the plain decode's token, for every sampling setup."""
    model = Bigram(vocab, seed % 1000)
    sampler = Sampler(SamplingParams(**{**PARAMS[name].to_dict(), "seed": seed}))
    history = [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=5)]
    want = plain(model, sampler, history, k + 1)
    drafts = list(want[:k])
    if wrong_at < k:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab
    verdict = verify(sampler, model.rows(history, tuple(drafts)), seen(sampler, history), Draft(tuple(drafts)))
    accepted = min(wrong_at, k)
    assert verdict == Verdict(tuple(want[: accepted + 1]), accepted, k)
    assert verdict.rejected == k - accepted


def test_a_verdict_of_k_accepted_drafts_adds_the_next_token() -> None:
    model = Bigram(50, 1)
    sampler = Sampler(SamplingParams(temperature=0.0))
    want = plain(model, sampler, [3], 5)
    verdict = verify(sampler, model.rows([3], tuple(want[:4])), Length(1), Draft(tuple(want[:4])))
    assert verdict.tokens == tuple(want) and verdict.accepted == 4


def test_rows_that_do_not_fit_the_draft_are_refused() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="a draft of 2 tokens is checked against 3 rows of logits"):
        verify(sampler, np.zeros((2, 10)), Length(1), Draft((1, 2)))
    with pytest.raises(ValueError, match=r"needs as many rows of q, not 3"):
        Draft((1, 2), q=DraftProbs.dense(np.ones((3, 10))))


# ------------------------------------------------------------------ the distribution kept

VOCAB, N_TOKENS, RUNS = 4, 3, 4000


def speculate(target: Bigram, drafter: Bigram, sampler: Sampler, draft_sampler: Sampler, history: list[int],
              n: int, k: int, tally: Counter) -> list[int]:
    """``n`` tokens by speculative steps of ``k`` tokens a draft model samples (its own seed);
    ``tally`` counts the drafted and accepted tokens."""
    seq = list(history)
    while len(seq) < len(history) + n:
        drafts, q, ctx = [], [], list(seq)
        for i in range(k):
            p = draft_sampler.probabilities(drafter.logits(ctx), Length(len(ctx)))
            d = draft_sampler.draw(p, Length(len(ctx)), 7 + i)[0]
            drafts.append(d)
            q.append(p)
            ctx.append(d)
        verdict = verify(sampler, target.rows(seq, tuple(drafts)), seen(sampler, seq), Draft(tuple(drafts), q=DraftProbs.dense(np.stack(q))))
        seq += verdict.tokens
        tally["drafted"] += verdict.drafted
        tally["accepted"] += verdict.accepted
    return seq[len(history) : len(history) + n]


def exact(target: Bigram, params: SamplingParams, history: list[int]) -> dict[tuple[int, ...], float]:
    """The model's probability of every sequence of N_TOKENS tokens after ``history``."""
    sampler = Sampler(params)
    out = {}
    for seq in product(range(VOCAB), repeat=N_TOKENS):
        prob, ctx = 1.0, list(history)
        for t in seq:
            prob *= sampler.probabilities(target.logits(ctx), seen(sampler, ctx))[t]
            ctx.append(t)
        out[seq] = prob
    return out


def chi_square(counts: Counter, probs: dict[tuple[int, ...], float], runs: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` (cells expecting under 5 pooled) and its
    degrees of freedom."""
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        e = p * runs
        if e < 5:
            pooled_o, pooled_e = pooled_o + counts.get(cell, 0), pooled_e + e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        cells += 1
    return stat, cells - 1


def critical(df: int, z: float = 3.719) -> float:
    """The chi-square statistic of ``df`` degrees of freedom exceeded with probability ~1e-4
    (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("name", ["plain", "top-k", "penalties"])
def test_speculative_sampling_keeps_the_models_distribution(name: str) -> None:
    """4000 seeds, three tokens each: with a draft model's samples checked (k = 3) and without
    speculation, the counts of each sequence fit the model's exact probabilities; a draft model
    that is not the model, so many drafts are rejected and drawn again from the residual."""
    target, drafter = Bigram(VOCAB, 11), Bigram(VOCAB, 12, scale=1.0)
    history = [1, 2]
    probs = exact(target, PARAMS[name], history)
    with_spec, without, tally = Counter(), Counter(), Counter()
    for run in range(RUNS):
        params = SamplingParams(**{**PARAMS[name].to_dict(), "seed": run})
        sampler, draft_sampler = Sampler(params), Sampler(SamplingParams(temperature=1.0, seed=run + 1))
        with_spec[tuple(speculate(target, drafter, sampler, draft_sampler, history, N_TOKENS, 3, tally))] += 1
        without[tuple(plain(target, sampler, history, N_TOKENS))] += 1
    for what, counts in (("with speculation", with_spec), ("without", without)):
        stat, df = chi_square(counts, probs, RUNS)
        assert stat < critical(df), f"{name} {what}: chi-square {stat:.1f} on {df} degrees of freedom"
    assert 0.1 < tally["accepted"] / tally["drafted"] < 0.9  # both ways taken, often


def test_a_draft_model_that_is_the_model_is_always_accepted() -> None:
    """q == p: every draft is accepted (u * q(d) < p(d) for u < 1)."""
    target = Bigram(VOCAB, 11)
    accepted = 0
    for run in range(200):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=run))
        p = sampler.probabilities(target.logits([1]), Length(1))
        d = int(np.argmax(p))
        verdict = verify(sampler, target.rows([1], (d,)), Length(1), Draft((d,), q=DraftProbs.dense(p[None, :])))
        accepted += verdict.accepted
    assert accepted == 200
