"""Plans follow the measurements: the plan in force checked against what it measures, once a
second (a part of the Coordinator).

The ring's steps feed :class:`~exo_tui.cluster.calibrate.Calibrator`; the scheduler plans with
its figures (:meth:`~exo_tui.cluster.switching.PlanSwitching.device_profiles`,
:meth:`~exo_tui.cluster.switching.PlanSwitching.constraints`). When one stream's measured speed
is more than 15 % off the plan's prediction, the console and the events say so once for that plan
(:class:`~exo_tui.events.PredictionGap` and a notice), and again when the speed moves more than
15 % from the one it said: the plan predicted again on the measured figures, and the rebalance
the scheduler would make with them (``R`` previews it as usual). With
``scheduler.load_balancing.auto_rebalance`` the coordinator makes it alone, with the hysteresis
of :func:`exo_tui.scheduler.calibration.follow`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from exo_tui import events as ev
from exo_tui.cluster.metrics import StepSample
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.view import Action, Command
from exo_tui.scheduler.calibration import GAP, follow, prediction_gap

if TYPE_CHECKING:
    from exo_tui.scheduler.diff import ChangePreview

log = logging.getLogger("exo_tui.cluster")

FOLLOW_INTERVAL_S = 1.0


class Following(CoordinatorParts):
    """Measured figures in, gaps shown, rebalances made (a part of the Coordinator)."""

    def _step_timed(self, sample: StepSample) -> None:
        """The pipeline's timing of a step: the cluster strip's figures, and the scheduler's."""
        token = self.metrics.step(sample)
        act = self.spec.activation_bytes_per_token if self.spec is not None else 0
        self.calibrator.step(sample, self.ring, self.spec, self.metrics.running, act,
                             answering=self.metrics.has_first_token(sample.request_id), token=token)

    def remeasured_tok_per_s(self) -> float | None:
        """The plan in force predicted again on the measured figures (None before a check)."""
        got = self._remeasured
        return got[1] if got is not None and self.plan is not None and got[0] == self.plan.version else None

    async def _follow_loop(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            try:
                await self.follow_measurements()
            except Exception:  # the next check tries again; the plan in force serves on
                log.warning("checking the plan against its measurements failed", exc_info=True)

    async def follow_measurements(self) -> None:
        """One check of the plan in force against what it measures."""
        plan, ring = self.plan, self.ring
        if plan is None or ring is None or plan.predictions is None or not self._plan_ready.is_set():
            return
        got = self.calibrator.measured_tok_per_s(ring.version)
        if got is None:
            return
        measured = got[0]
        now = time.monotonic()
        gap = prediction_gap(plan.predictions.tok_per_s_single, measured)
        # the figures read here, on the loop's thread, where the ring's steps add to them
        change: ChangePreview = await asyncio.to_thread(self._preview, self.constraints(), self.device_profiles())
        self._remeasured = (plan.version, change.tok_per_s_before)
        if gap is None or abs(gap) <= GAP:
            self._follow_state, _ = follow(self._follow_state, gap, None, now)
            return
        moves = len(change.diff.moves) if change.diff is not None and change.new_plan is not None else 0
        gain = (change.tok_per_s_after / change.tok_per_s_before - 1.0) if moves and change.tok_per_s_before > 0 else None
        auto = self.config.scheduler.load_balancing.auto_rebalance
        self._follow_state, go = follow(self._follow_state, gap, gain, now)
        if go and auto:
            preview = await self.preview(Command(Action.REBALANCE))
            done = await self.apply(preview)
            applied = not done.error
            self.events.publish(ev.PredictionGap(
                plan_version=plan.version, predicted_tok_per_s=plan.predictions.tok_per_s_single,
                measured_tok_per_s=measured, remeasured_tok_per_s=change.tok_per_s_before,
                rebalance_tok_per_s=change.tok_per_s_after, moves=moves, applied=applied))
            self._notice("info" if applied else "warning",
                         f"plan v{plan.version} measured {measured:.1f} tok/s against {plan.predictions.tok_per_s_single:.1f} "
                         f"predicted: rebalanced on the measured figures ({moves} move(s), "
                         f"{change.tok_per_s_before:.1f} → {change.tok_per_s_after:.1f} tok/s)"
                         + ("" if applied else f", which failed: {done.error}"))
            return
        noted = self._gap_noted
        if noted is not None and noted[0] == plan.version and abs(measured / noted[1] - 1.0) <= GAP:
            return  # said for this plan at about this speed
        self._gap_noted = (plan.version, measured)
        self.events.publish(ev.PredictionGap(
            plan_version=plan.version, predicted_tok_per_s=plan.predictions.tok_per_s_single, measured_tok_per_s=measured,
            remeasured_tok_per_s=change.tok_per_s_before, rebalance_tok_per_s=change.tok_per_s_after if moves else 0.0,
            moves=moves))
        offer = (f"a rebalance would move {moves} layer range(s) ({change.bytes_moved / 1e6:.0f} MB), "
                 f"→ {change.tok_per_s_after:.1f} tok/s: press R to preview it"
                 + (" (auto_rebalance makes it once the gap holds)" if auto else "")) if moves else "no rebalance would do better"
        self._notice("warning", f"plan v{plan.version} measures {measured:.1f} tok/s, {gap:+.0%} off its prediction of "
                                f"{plan.predictions.tok_per_s_single:.1f}; on the measured figures it predicts "
                                f"{change.tok_per_s_before:.1f} tok/s; {offer}")
