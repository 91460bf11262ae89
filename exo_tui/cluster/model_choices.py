"""The models the cluster could serve: the machine's catalog, each planned on the cluster as it is.

For each model of :mod:`exo_tui.models.catalog` the runtime can run, the scheduler makes the plan
it would load (the same call a rebalance makes, from no plan: every layer a fresh load; the memory
the current model holds counts as free, since a switch unloads it): whether it fits now, and its
predicted tok/s. :func:`preview` is the plan diff of a switch, shown before the operator says yes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.cluster.view import Action, ModelChoice, PlanPreview
from exo_tui.models import catalog
from exo_tui.models.catalog import resolve_model
from exo_tui.models.gguf_file import ModelFileError
from exo_tui.models.spec import spec_from_gguf
from exo_tui.scheduler.diff import ChangePreview, preview_change
from exo_tui.scheduler.spec import ModelSpec

# the coordinator's view of a scheduler change (snapshots._to_view_preview)
PreviewView = Callable[[Action, tuple[str, ...], ChangePreview, CoordinatorParts, str, ModelSpec | None], PlanPreview]

SWITCH_NOTE = ("every layer of the new model is loaded fresh (from the file where a node can read it, else "
               "streamed to it) while the current one answers, then the switch happens between two tokens; where "
               "the nodes cannot hold both, the current model is unloaded first")


class SpecCache:
    """Scheduler specs of model files, by path, size and mtime (opening a GGUF takes a while), each
    at the context the cluster would serve it at (``context_limit``: ``models.context_length``)."""

    def __init__(self, context_limit: int = 0) -> None:
        self._specs: dict[str, tuple[tuple[int, int], ModelSpec]] = {}
        self.context_limit = context_limit

    def get(self, path: Path) -> ModelSpec:
        st = os.stat(path)
        key, stamp = str(path), (st.st_size, st.st_mtime_ns)
        hit = self._specs.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        spec = spec_from_gguf(path, context_limit=self.context_limit)
        self._specs[key] = (stamp, spec)
        return spec


def change_for(c: CoordinatorParts, spec: ModelSpec) -> ChangePreview:
    """The plan the scheduler would make for the model of ``spec`` on coordinator ``c``'s nodes
    (drains kept; pins, which name layers of the current model, left out)."""
    constraints = c.constraints(pins={})
    if c.strategy == "even":
        return c._even_preview(constraints, spec=spec, current=None)
    return preview_change(None, c.device_profiles(spec), spec, constraints, c.config.scheduler, now=time.monotonic(),
                          strategy=c.strategy)


def _same_file(a: Path, b: Path | None) -> bool:
    try:
        return b is not None and a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False


def choices(c: CoordinatorParts, specs: SpecCache) -> list[ModelChoice]:
    """Every model of the catalog, planned on the cluster (blocking: run it in a thread)."""
    current = Path(c.model.path) if c.model is not None else None
    out = []
    for e in catalog.scan(list(c.config.models.paths)):
        choice = ModelChoice(name=e.name, family=e.family, params=e.size_label, quant=e.quant, size_bytes=e.size_bytes,
                             context_length=e.context_length, where=e.where, source=e.source, usable=e.usable,
                             reason=e.reason, current=_same_file(e.path, current))
        if e.usable:
            try:
                change = change_for(c, specs.get(e.path))
            except (ModelFileError, OSError, ValueError) as exc:
                choice = replace(choice, usable=False, reason=str(exc))
            else:
                fits = not change.error and change.new_plan is not None
                choice = replace(choice, fits=fits, fit_reason=change.error, tok_per_s=change.tok_per_s_after)
        out.append(choice)
    return out


def preview(c: CoordinatorParts, name: str, specs: SpecCache, view: PreviewView) -> PlanPreview:
    """What switching coordinator ``c`` to the model ``name`` does (blocking). ``view`` turns the
    scheduler's change into the operator's preview (the coordinator's own)."""
    try:
        path = resolve_model(name, list(c.config.models.paths))
        spec = specs.get(path)
    except (ModelFileError, OSError, ValueError) as exc:  # ValueError: a name no path can have (a NUL)
        return PlanPreview(Action.MODEL, (name,), error=f"model {name!r}: {exc}" if isinstance(exc, ValueError) else str(exc))
    change = change_for(c, spec)
    before = c.plan.predictions.tok_per_s_single if c.plan is not None and c.plan.predictions else 0.0
    change = replace(change, tok_per_s_before=before)
    streaming = f"{len(c._active)} answer(s) streaming at the switch end with an error; " if c._active else ""
    result: PlanPreview = view(Action.MODEL, (name,), change, c, streaming + SWITCH_NOTE, spec)
    if result.new_plan is not None and c.plan is not None:  # planned from no plan: it would be v1
        result = replace(result, new_plan=replace(result.new_plan, version=c.plan.version + 1))
    if c.model is not None and _same_file(path, Path(c.model.path)):
        result = replace(result, note=f"the cluster serves this file already; {result.note}")
    return result
