"""Draft sources (prompt lookup, a prediction) and a stream's choice of k (exo_tui.inference.drafts,
exo_tui.inference.speculation)."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import MAX_DRAFT
from exo_tui.inference.drafts import Drafter, Prediction, PromptLookup
from exo_tui.inference.speculation import PROBES, Speculation, StepCosts, parse_mode
from exo_tui.inference.speculative import Draft, Verdict


def propose(source, tokens: list[int], prompt_len: int, k: int) -> tuple[int, ...]:
    return asyncio.run(source.propose(tokens, prompt_len, k)).tokens


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    lookup = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the trigram 1 2 3 occurred at 0 only: 4 5 9 followed
    assert propose(lookup, tokens, 5, 3) == (4, 5, 9)
    # the answer grows: "3 7" occurred once, "7 8 1" followed it
    tokens += [7]
    assert propose(lookup, tokens, 5, 3) == (8, 1, 2)
    assert propose(lookup, [10, 11, 12], 3, 4) == ()  # nothing repeats
    assert propose(lookup, [1, 2, 1, 2], 3, 4) == (1, 2)  # runs up to the end of what there is
    assert propose(lookup, [5, 6, 7, 5], 3, 4) == ()  # one token is not enough to go on
    assert propose(PromptLookup(min_ngram=1), [5, 6, 7, 5], 3, 4) == (6, 7, 5)


def test_a_new_history_starts_the_index_again() -> None:
    lookup = PromptLookup()
    assert propose(lookup, [1, 2, 3, 1, 2], 3, 2) == (3, 1)
    assert propose(lookup, [7, 8, 9, 7, 8], 2, 2) == (9, 7)  # another request's tokens: not 1 2 3's


def test_a_prediction_is_followed_from_where_the_answer_is_in_it() -> None:
    pred = Prediction([10, 11, 12, 13, 10, 11, 14, 15])
    assert propose(pred, [1, 2], 2, 3) == (10, 11, 12)  # no answer yet: its beginning
    assert propose(pred, [1, 2, 10, 11, 12], 2, 3) == (13, 10, 11)
    assert propose(pred, [1, 2, 10, 11, 12, 13, 10, 11], 2, 3) == (14, 15)  # the second "10 11", near the last place
    assert propose(pred, [1, 2, 99], 2, 3) == ()  # the answer left the prediction


def test_a_drafter_takes_the_first_source_that_proposes() -> None:
    drafter = Drafter([Prediction([5, 6, 7]), PromptLookup()])
    assert asyncio.run(drafter.propose([1, 2, 1], 3, 2)) == Draft((5, 6), "prediction")  # no answer yet
    assert asyncio.run(drafter.propose([1, 2, 1, 2], 3, 2)) == Draft((1, 2), "lookup")  # 2 is not in the prediction
    assert asyncio.run(drafter.propose([1, 2, 1, 2], 3, 0)) == Draft(())


def test_modes() -> None:
    assert [parse_mode(x) for x in ("off", "AUTO", "4", 0, None)] == ["off", "auto", 4, "off", "auto"]
    for bad in ("fast", str(MAX_DRAFT + 1), "-1"):
        with pytest.raises(ValueError, match="speculative must be off, auto or a number of drafted tokens"):
            parse_mode(bad)
    assert Speculation.for_request("off") is None


def test_auto_drafts_more_where_more_is_accepted_and_none_where_it_would_slow() -> None:
    spec = Speculation("auto", [PromptLookup()])
    spec.timed(1, 0.010)
    spec.timed(5, 0.014)  # each row past the first: 1 ms, a tenth of a step
    assert spec.row_cost() == pytest.approx(0.1)
    spec.accept_rate = 0.9
    high = spec.best_k(MAX_DRAFT)
    spec.accept_rate = 0.5
    mid = spec.best_k(MAX_DRAFT)
    spec.accept_rate = 0.05
    assert high > mid > 0 == spec.best_k(MAX_DRAFT)
    spec.timed(9, 0.10)  # rows that cost a step each: nothing pays
    for _ in range(20):
        spec.timed(9, 0.10)
    spec.accept_rate = 0.5
    assert spec.best_k(MAX_DRAFT) == 0


def test_a_stream_that_stopped_drafting_learns_from_drafts_it_did_not_run() -> None:
    spec = Speculation("auto", [PromptLookup()])
    spec.accept_rate = 0.01  # off
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert asyncio.run(spec.draft(tokens, 2, 10)) == Draft(())  # not run ...
    for t in (3, 4, 5, 6, 1, 2):  # ... and the answer went on as drafted
        tokens.append(t)
        asyncio.run(spec.draft(tokens, 2, 10))
    assert spec.accept_rate > 0.1
    assert spec.stats.drafted == 0 and spec.stats.shadowed == spec.stats.shadow_kept > 0  # counted, not run


def test_verified_steps_are_counted_by_source() -> None:
    spec = Speculation(4, [PromptLookup()])
    spec.verified(Draft((1, 2, 3), "prediction"), Verdict((1, 2, 9), 2, 3))
    spec.verified(Draft((1, 2), "lookup"), Verdict((1, 2, 5), 2, 2))
    s = spec.stats
    assert (s.steps, s.drafted, s.accepted, s.prediction_accepted, s.prediction_rejected, s.k_chosen) == \
        (2, 5, 4, 2, 1, [3, 2])


def test_the_console_sets_a_chats_speculation() -> None:
    from exo_tui.cluster.view import ChatParams

    params = ChatParams()
    assert params.with_setting("speculative", "8").speculative == 8
    assert params.with_setting("speculative", "off").speculative == "off"
    assert "speculative auto" in params.with_setting("speculative", "AUTO").describe()
    with pytest.raises(ValueError, match="speculative must be off, auto or a number of drafted tokens"):
        params.with_setting("speculative", "lots")


def test_the_cluster_figures_count_the_drafts_kept() -> None:
    from types import SimpleNamespace

    from exo_tui.cluster.metrics import ClusterMetrics

    m = ClusterMetrics(clock=lambda: 100.0)
    assert m.figures([]).draft_acceptance is None
    for drafted, accepted in ((10, 9), (0, 0), (30, 21)):
        spec = Speculation(4, [PromptLookup()])
        spec.stats.drafted, spec.stats.accepted = drafted, accepted
        request = SimpleNamespace(id=f"r{drafted}", prompt_ids=[1], created_s=100.0, speculation=spec)
        m.started(request)
        m.ended(request)
    m.ended(SimpleNamespace(id="plain", speculation=None))
    assert m.figures([]).draft_acceptance == pytest.approx(30 / 40)


def test_a_busy_ring_drafts_where_the_batch_gains() -> None:
    """n streams share a step: a stream's rows slow the other n - 1 too, so what pays one stream
    alone does not pay eight, unless the drafts are kept and cheap against the batch's step."""
    spec = Speculation("auto", [PromptLookup()])
    spec.timed(1, 0.010)  # a 1-row step: 10 ms
    for k in (1, 4, 8):  # the plan's measure: each row past the first adds 2.5 ms
        spec.costs.add(k, 0.0025 * k)
    spec.accept_rate = 0.7
    alone = spec.best_k(8)
    spec.streams = lambda: 8
    assert alone > 0 and spec.best_k(8) == 0
    spec.accept_rate = 0.999  # a prediction copied ...
    spec.costs = StepCosts()
    for k in (1, 8, 16):  # ... by a verify step that runs apart from the batch: 20 ms, and 0.5 ms a row
        spec.costs.add(k, 0.020 + 0.0005 * k)
    assert spec.costs.fit() == pytest.approx((0.020, 0.0005))
    assert spec.best_k(16) == 0  # against 10 ms steps: not worth it
    spec.step_s = 0.040  # the eight streams' batched steps take 40 ms: now it is
    assert spec.best_k(16) > 0


def test_a_plans_cost_is_measured_once_for_its_streams() -> None:
    """Until the plan's cost is measured a lookup's proposal runs as one draft (a probe); then
    every stream of the plan reads that measure, whatever it measured itself."""
    costs = StepCosts()
    first = Speculation("auto", [PromptLookup()])
    first.costs = costs
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert asyncio.run(first.draft(tokens, 2, 10)) == Draft(())  # no 1-row step timed yet: not run
    first.timed(1, 0.010)
    assert asyncio.run(first.draft(tokens, 2, 10)).tokens == (3,)  # a probe: one draft
    for _ in range(PROBES):
        first.timed(2, 0.0105)  # a 2-row step costs 5 % more
    assert costs.measured and costs.extra(1) == pytest.approx(0.0005)
    second = Speculation("auto", [PromptLookup()])
    second.costs = costs
    second.timed(1, 0.010)
    assert second.row_cost() == pytest.approx(0.05)
    assert asyncio.run(second.draft(tokens, 2, 10)) == Draft(())  # measured: no more probes at 0.2


def test_a_prediction_that_repeats_itself_is_followed_where_the_answer_is() -> None:
    """The answer went on as predicted past a second "1 2 3": drafts come from after that one."""
    predicted = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6]
    pred = Prediction(predicted)
    assert propose(pred, [0, 1], 1, 2) == (2, 3)  # the answer [1] is at the prediction's start
    assert propose(pred, [0, *predicted[:9]], 1, 2) == (5, 6)  # not (4, 9): it is past the second "1 2 3"


def test_auto_starts_lookups_unrun_and_predictions_drafting() -> None:
    """Before anything is measured: a lookup's drafts are only checked against what comes (free
    chat must not get slower), a prediction's are run."""
    assert Speculation("auto", [PromptLookup()]).best_k(16) == 0
    assert Speculation("auto", [Prediction([1, 2, 3]), PromptLookup()]).best_k(16) >= 2


def test_a_stream_not_drafting_asks_only_its_cheap_sources() -> None:
    """A draft model's proposals cost k of its steps: not asked while the stream does not draft
    (lookups are, to learn); with one attached the stream starts drafting."""
    from exo_tui.inference.drafts import DraftSource
    from exo_tui.inference.speculation import PRIOR_MODEL

    class Counted(DraftSource):
        name, cheap, asked = "model", False, 0

        async def propose(self, tokens, prompt_len, k):  # noqa: ANN001, ANN201
            self.asked += 1
            return Draft(tuple(tokens[-1:]) * k, self.name)

    model = Counted()
    spec = Speculation("auto", [PromptLookup()])
    spec.drafter.sources.insert(0, model)  # attached after the speculation was made, as the coordinator does
    spec.streams = lambda: 9  # busy: nothing drafts
    assert asyncio.run(spec.draft([1, 2, 3, 1, 2], 3, 10)) == Draft(())
    assert model.asked == 0 and spec.accept_rate == PRIOR_MODEL
    spec.streams = lambda: 1
    assert len(asyncio.run(spec.draft([1, 2, 3, 1, 2], 3, 10))) > 0 and model.asked == 1


class _Asked(PromptLookup):
    """A prompt lookup that counts the times it is asked."""

    asked = 0

    async def propose(self, tokens, prompt_len, k):  # noqa: ANN001, ANN201
        self.asked += 1
        return await super().propose(tokens, prompt_len, k)


def test_a_stream_not_drafting_whose_lookup_finds_nothing_asks_it_every_few_tokens() -> None:
    """Asked before every token of every stream, a lookup that finds nothing costs the
    coordinator's Python what a plain stream's step does not: it waits QUIET tokens before asking
    again, and then finds what the tokens it skipped repeated (its index caught up)."""
    from exo_tui.inference.speculation import QUIET

    lookup = _Asked()
    spec = Speculation("auto", [lookup])
    spec.streams = lambda: 8  # busy: nothing drafts
    tokens = list(range(100, 110))
    for t in range(10, 10 + 4 * QUIET):  # free text: nothing repeats
        tokens.append(t)
        assert asyncio.run(spec.draft(tokens, 10, 10)) == Draft(())
    assert lookup.asked == 4
    tokens += [100, 101]  # the answer turns to quoting its prompt
    for _ in range(QUIET):
        asyncio.run(spec.draft(tokens, 10, 10))
        tokens.append(tokens[-1] + 1)
    assert lookup.asked == 5 and spec._shadow is not None  # found within QUIET tokens, checked as they come


def test_a_stream_not_drafting_does_not_ask_while_its_last_proposal_is_being_checked() -> None:
    """What it proposed and did not run is checked against the tokens that come; a proposal made
    meanwhile would be dropped, so its sources are not asked until that check ends."""
    lookup = _Asked()
    spec = Speculation("auto", [lookup])
    spec.streams = lambda: 8
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    asyncio.run(spec.draft(tokens, 2, 10))
    for t in (3, 4, 5):  # the answer goes on as proposed (3 4 5 6 7 8 1 2)
        tokens.append(t)
        asyncio.run(spec.draft(tokens, 2, 10))
    assert lookup.asked == 1 and spec.stats.shadowed == 0
    tokens.append(9)  # it leaves the proposal: checked (3 of 4 kept), and the lookup asked again
    asyncio.run(spec.draft(tokens, 2, 10))
    assert (spec.stats.shadowed, spec.stats.shadow_kept, lookup.asked) == (4, 3, 2)


def test_best_k_stops_early_with_the_k_every_k_gives() -> None:
    """best_k stops where no larger k can win; it chooses what weighing every k chooses."""
    def every_k(spec: Speculation, most: int) -> int:
        n = spec.streams() if spec.streams else 1
        a = min(spec.accept_rate, 0.999)
        best, gain = 0, 1 + 0.15 / n
        for k in range(1, most + 1):
            g = (n - 1 + (1 - a ** (k + 1)) / (1 - a)) / (n * (1 + spec.step_cost(k)))
            if g > gain:
                best, gain = k, g
        return best

    chosen = set()
    for n in (1, 2, 8):
        for fixed, per_row in ((None, None), (0.0, 0.0005), (0.002, 0.0001), (0.02, 0.0005), (0.0, 0.004)):
            spec = Speculation("auto", [PromptLookup()])
            spec.streams = lambda n=n: n
            spec.timed(1, 0.010)
            if fixed is not None:
                for k in (1, 4, 8, 16):
                    spec.costs.add(k, fixed + per_row * k)
            for a in (0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0):
                spec.accept_rate = a
                for most in (1, 4, MAX_DRAFT):
                    assert spec.best_k(most) == every_k(spec, most), (n, fixed, per_row, a, most)
                    chosen.add(spec.best_k(most))
    assert len(chosen) > 5  # the grid reaches many k, 0 among them


def test_a_lookups_index_keeps_nothing_the_garbage_collector_tracks() -> None:
    """Every stream's lookup indexes each token as it comes: its keys and starts are ints, so
    the collector's young generation does not grow with the tokens (its collections, a full one
    of the coordinator's heap among them, would come with them)."""
    import gc

    lookup = PromptLookup()
    tokens = [(7 * i) % 1000 for i in range(50)]
    asyncio.run(lookup.propose(tokens, 10, 4))
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for i in range(2000):
            tokens.append((7919 * i) % 5000)
            lookup._index.extend(tokens)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 100  # not a tuple and a list for each n-gram of each of 2,000 tokens
    tokens += tokens[60:62]
    assert propose(lookup, tokens, 10, 3) == tuple(tokens[62:65])  # and it finds them
