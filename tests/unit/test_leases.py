"""The hand-off's leases as the coordinator keeps them (exo_tui/cluster/handoff.py): a stream in a
lease whose drafts become worth a verify step again leaves the lease at its next token (the tokens
the ring already gave still count), rather than waiting for the lease's last step; the token of a
handed step given up is not taken for the reply of the verify step sent in its place."""

from __future__ import annotations

import asyncio

import pytest

from exo_tui.cluster.pipeline import RemotePipeline
from exo_tui.cluster.ring_steps import Cached, Lease, Result, Sent
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams
from exo_tui.net.protocol import PlanEntry, RingPlan


@pytest.mark.parametrize("drafts", [False, True])
def test_a_stream_with_drafts_leaves_its_lease_at_the_next_token(drafts: bool) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        plan = RingPlan(1, 6, (PlanEntry("n", "127.0.0.1", 1, 0, 6),))
        pipeline = RemotePipeline(host=None)  # type: ignore[arg-type]  # a lease without a step in flight touches no host
        request = Request([1, 2, 3], SamplingParams(temperature=0.0), 32, generated=[4, 5])
        steps: dict[int, Sent] = {}
        for step in range(2, 8):  # a lease sent at the answer's 2nd token, running 5 steps on
            fut: asyncio.Future[Result] = loop.create_future()
            key = (request.id, step, plan.version)
            pipeline._pending[key] = fut
            steps[step] = Sent(key, fut, plan, 1, request.n_tokens + step - 2, handed=step > 2)
        lease = pipeline._leases[request.id] = Lease(plan, 2, request.n_tokens, dict(steps), 7)
        for step in (2, 3):  # the ring gave two tokens; the others are on their way
            steps[step].fut.set_result((10 + step, None, None))
        assert pipeline._leased(request, drafts=drafts) is steps[2]
        request.generated.append(12)
        assert pipeline._leased(request) is steps[3]  # a token the ring gave is taken either way
        request.generated.append(13)
        if drafts:  # the steps not run yet were given up: the next step is the coordinator's, with the drafts
            assert not lease.open and all(steps[s].fut.cancelled() for s in range(4, 8))
            assert pipeline._leased(request, drafts=True) is None and request.id not in pipeline._leases
            assert all(steps[s].key not in pipeline._pending for s in range(4, 8))  # their replies are dropped
            # the verify step sent next takes step 4: the ring's token for the handed step 4 (it may
            # have run it before the verify step superseded the lease) is not its reply
            verify: asyncio.Future[Result] = loop.create_future()
            pipeline._pending[steps[4].key] = verify
            pipeline._verifying.add(steps[4].key)
            pipeline.on_token(request.id, 4, plan.version, 14, None)
            assert not verify.done()
            pipeline._abandon(steps[4])  # the handed step given up again (a second drop): the verify step stays
            assert pipeline._pending[steps[4].key] is verify and steps[4].key in pipeline._verifying
            pipeline.on_token(request.id, 4, plan.version, 14, None, verdict=((9, 14), 1, None))
            assert verify.result() == (14, None, None) and pipeline._verdicts[steps[4].key] == ((9, 14), 1, None)
        else:  # the lease runs on to its last step
            assert lease.open and pipeline._leased(request) is steps[4]
            assert not any(steps[s].fut.done() for s in range(4, 8))

    asyncio.run(run())


def test_a_leases_tokens_that_came_before_its_first_steps_return_stay_counted() -> None:
    """A node sends a lease's tokens a few to a write: the tokens of later steps can come in the
    same loop turn as the first step's, before the coordinator's step returns. Its return must not
    set the caches' length back to the first step's (they hold the later steps' positions too: a
    kept cache counted 5 positions short, and the nodes' KV report disagreed with it)."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        plan = RingPlan(1, 6, (PlanEntry("n", "127.0.0.1", 1, 0, 6),))
        pipeline = RemotePipeline(host=None)  # type: ignore[arg-type]  # tokens and their counts touch no host
        request = Request([1, 2, 3], SamplingParams(temperature=0.0), 32, generated=[4, 5])
        n0, steps = request.n_tokens, {}
        for step in range(2, 8):
            fut: asyncio.Future[Result] = loop.create_future()
            key = (request.id, step, plan.version)
            pipeline._pending[key] = fut
            steps[step] = Sent(key, fut, plan, 1, n0 + step - 2, handed=step > 2)
        pipeline._leases[request.id] = Lease(plan, 2, n0, dict(steps), 7)
        for step in (2, 3, 4):  # one write: the first step's token and two handed ones
            pipeline.on_token(request.id, step, plan.version, 10 + step, None)
        assert pipeline.cached(request.id) == (plan.version, n0 + 2)
        pipeline._ran(request, plan, n0, leased=True)  # the step that opened the lease returns now
        assert pipeline.cached(request.id) == (plan.version, n0 + 2)
        pipeline._ran(request, plan, n0 + 1, leased=False)  # a verify step's: its rejected drafts are cut back
        assert pipeline.cached(request.id) == (plan.version, n0 + 1)
        # an earlier lease's count is not this one's: the lease left (its tokens dropped), the
        # coordinator sent the step again from the request's tokens, and the nodes cut back there
        pipeline._cached[request.id] = Cached(plan.version, n0 + 5)
        pipeline._leases[request.id] = Lease(plan, 2, n0, {}, 7)
        pipeline._ran(request, plan, n0, leased=True)
        assert pipeline.cached(request.id) == (plan.version, n0)

    asyncio.run(run())
