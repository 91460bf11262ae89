"""Plan diffs, migration steps, the rebalance rule, and previews of plan changes.

A diff lists the layer moves from the current plan to a new one: contiguous layer ranges that
change owner, with the bytes each move carries (weights, plus the embedding or the output head
when the first or last layer moves). A move is a copy: the new home loads the layers while the
old home keeps serving them; the old home drops them only once the step that moved them is done
and the route has switched. :func:`migration_steps` groups the moves into steps of at most
``max_task_migration`` moves, and says after each step which node serves each layer, so every
layer is served at every moment (except layers whose old home has failed: those are loaded
first, because nothing serves them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from exo_tui.config import SchedulerConfig
from exo_tui.scheduler.context import InfeasiblePlan
from exo_tui.scheduler.partition import make_plan
from exo_tui.scheduler.plan import Constraints, Plan
from exo_tui.scheduler.prediction import predict
from exo_tui.scheduler.profile import DeviceProfile
from exo_tui.scheduler.spec import ModelSpec


@dataclass(frozen=True)
class LayerMove:
    """Layers ``[start, end)`` go from ``src`` to ``dst`` (``src`` None: loaded from the model file)."""

    start: int
    end: int
    src: str | None
    dst: str
    nbytes: int


@dataclass(frozen=True)
class MigrationStep:
    """One step: load ``moves`` on their new homes, switch the route, then drop from the old."""

    index: int
    moves: tuple[LayerMove, ...]
    serving: tuple[tuple[int, int, str | None], ...]  # after the step: (start, end, node) in layer order
    drops: tuple[tuple[str, int, int], ...]  # (node, start, end) dropped at the end of the step

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


@dataclass(frozen=True)
class PlanDiff:
    old_version: int
    new_version: int
    moves: tuple[LayerMove, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(m.nbytes for m in self.moves)

    @property
    def layers_moved(self) -> int:
        return sum(m.end - m.start for m in self.moves)

    def steps(self, max_moves: int = 5, old: Plan | None = None) -> list[MigrationStep]:
        return migration_steps(self, max_moves, old)

    def to_dict(self) -> dict[str, Any]:
        return {
            "old_version": self.old_version,
            "new_version": self.new_version,
            "moves": [asdict(m) for m in self.moves],
            "bytes_moved": self.bytes_moved,
            "layers_moved": self.layers_moved,
        }


def _owners(plan: Plan) -> list[str]:
    out: list[str] = []
    for s in plan.shards:
        out.extend([s.node_id] * (s.end - s.start))
    return out


def plan_diff(old: Plan | None, new: Plan, spec: ModelSpec, failed: Iterable[str] = ()) -> PlanDiff:
    """The layer moves from ``old`` to ``new`` (``old`` None: everything is loaded fresh).

    Moves from a failed node (``failed``) have ``src=None``: the layers are read from the model
    file. Moves are ordered: unserved layers (from failed nodes or no plan) first, then by layer.
    """
    if old is not None and old.n_layers != new.n_layers:
        raise ValueError(f"plans of different models ({old.n_layers} and {new.n_layers} layers) cannot be diffed")
    dead = set(failed)
    L = new.n_layers
    before: list[str | None] = list(_owners(old)) if old is not None else [None] * L
    after = _owners(new)
    moves: list[LayerMove] = []
    layer = 0
    while layer < L:
        src, dst = before[layer], after[layer]
        if src == dst:
            layer += 1
            continue
        end = layer + 1
        while end < L and before[end] == src and after[end] == dst:
            end += 1
        nbytes = sum(spec.layers[layer:end])
        if layer == 0:
            nbytes += spec.embed_bytes
        if end == L:
            nbytes += spec.head_bytes
            if layer == 0 and spec.tied_embeddings:  # one matrix, carried once
                nbytes -= min(spec.embed_bytes, spec.head_bytes)
        moves.append(LayerMove(layer, end, None if src in dead else src, dst, nbytes))
        layer = end
    moves.sort(key=lambda m: (m.src is not None, m.start))
    return PlanDiff(old.version if old is not None else 0, new.version, tuple(moves))


def migration_steps(diff: PlanDiff, max_moves: int = 5, old: Plan | None = None) -> list[MigrationStep]:
    """Group the moves into steps of at most ``max_moves``; after each, who serves each layer."""
    if max_moves < 1:
        raise ValueError("max_task_migration must be at least 1")
    L = old.n_layers if old is not None else max((m.end for m in diff.moves), default=0)
    serving: list[str | None] = list(_owners(old)) if old is not None else [None] * L
    steps: list[MigrationStep] = []
    moves = list(diff.moves)
    for i in range(0, len(moves), max_moves):
        chunk = tuple(moves[i : i + max_moves])
        drops = []
        for m in chunk:
            for layer in range(m.start, m.end):
                serving[layer] = m.dst
            if m.src is not None:
                drops.append((m.src, m.start, m.end))
        steps.append(MigrationStep(len(steps), chunk, _runs(serving), tuple(drops)))
    return steps


def _runs(owners: Sequence[str | None]) -> tuple[tuple[int, int, str | None], ...]:
    out: list[tuple[int, int, str | None]] = []
    for i, o in enumerate(owners):
        if out and out[-1][2] == o:
            out[-1] = (out[-1][0], i + 1, o)
        else:
            out.append((i, i + 1, o))
    return tuple(out)


def should_rebalance(coefficient: float, last_time: float | None, now: float, config: SchedulerConfig | None = None) -> bool:
    """Propose a rebalance when stage times are uneven (std/mean above ``rebalance_threshold``),
    no sooner than ``rebalance_interval`` seconds after the last one (``last_time`` None: never)."""
    lb = (config or SchedulerConfig()).load_balancing
    if coefficient <= lb.rebalance_threshold:
        return False
    return last_time is None or now - last_time >= lb.rebalance_interval


@dataclass(frozen=True)
class ChangePreview:
    """What a plan change will do, for the operator's confirmation."""

    new_plan: Plan | None
    diff: PlanDiff | None
    steps: tuple[MigrationStep, ...] = ()
    tok_per_s_before: float = 0.0
    tok_per_s_after: float = 0.0
    saturated_tok_per_s_before: float = 0.0
    saturated_tok_per_s_after: float = 0.0
    error: str = ""
    constraint: str = ""  # when error: which constraint failed
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bytes_moved(self) -> int:
        return self.diff.bytes_moved if self.diff else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_plan": self.new_plan.to_dict() if self.new_plan else None,
            "diff": self.diff.to_dict() if self.diff else None,
            "steps": [{"index": s.index, "moves": [asdict(m) for m in s.moves], "nbytes": s.nbytes} for s in self.steps],
            "tok_per_s_before": self.tok_per_s_before,
            "tok_per_s_after": self.tok_per_s_after,
            "saturated_tok_per_s_before": self.saturated_tok_per_s_before,
            "saturated_tok_per_s_after": self.saturated_tok_per_s_after,
            "bytes_moved": self.bytes_moved,
            "error": self.error,
            "constraint": self.constraint,
            "notes": list(self.notes),
        }


def preview_change(
    current: Plan | None,
    profiles: Iterable[DeviceProfile],
    spec: ModelSpec,
    constraints: Constraints | None = None,
    config: SchedulerConfig | None = None,
    *,
    now: float,
    strategy: str | None = None,
) -> ChangePreview:
    """The plan the scheduler would choose now, and what switching to it would move.

    For a drain, pass the node in ``constraints.drained``; for a pin, in ``constraints.pins``;
    for a rebalance, the current profiles. "Before" is the current plan predicted on the current
    profiles (0 when one of its nodes has failed). An infeasible change comes back with ``error``
    (the operator-facing reason) and no plan; nothing raises.
    """
    config = config or SchedulerConfig()
    constraints = constraints or Constraints()
    ps = {p.node_id: p for p in profiles}
    failed = {n for n, p in ps.items() if p.failed} | set(constraints.failed)
    before = sat_before = 0.0
    notes = []
    if current is not None:
        if all(s.node_id in ps and s.node_id not in failed for s in current.shards):
            now_pr = predict(current.shards, ps, spec, config, constraints.prompt_tokens, constraints.coordinator_s,
                             constraints.coordinator_links, constraints.handed_share)
            before, sat_before = now_pr.tok_per_s_single, now_pr.tok_per_s_saturated
        else:
            lost = sorted({s.node_id for s in current.shards} & failed | {s.node_id for s in current.shards} - set(ps))
            notes.append(f"the current plan has lost {', '.join(lost)}: it serves nothing until the change")
    version = (current.version + 1) if current is not None else 1
    try:
        plan = make_plan(ps.values(), spec, strategy, constraints, config, now=now, version=version, current=current)
    except InfeasiblePlan as exc:
        return ChangePreview(None, None, (), before, 0.0, sat_before, 0.0, str(exc), exc.constraint, tuple(notes))
    if current is not None and plan.shards == current.shards:
        plan = plan.with_version(current.version)
        notes.append("the plan does not change")
    gone = {s.node_id for s in current.shards} - set(ps) if current is not None else set()
    diff = plan_diff(current, plan, spec, failed | gone)
    steps = tuple(migration_steps(diff, config.load_balancing.max_task_migration, current))
    pr = plan.predictions
    return ChangePreview(
        plan, diff, steps, before, pr.tok_per_s_single if pr else 0.0, sat_before,
        pr.tok_per_s_saturated if pr else 0.0, "", "", tuple(notes),
    )
