"""What an operator's :class:`~exo_tui.cluster.view.Command` asks of the cluster as it is: the
node a target names, and the drains and pins the command would leave.

Pure: the coordinator, the API and the console's test fake all ask these two functions, so an
ambiguous name, an undrain of a node that is not drained or a pin no plan can keep are refused
alike everywhere, with the same words. The plan itself is the scheduler's (``constraints``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from exo_tui.cluster.view import Action, Command
from exo_tui.scheduler.plan import Pin


class NodeNotFound(ValueError):
    """A target names no node (or several): the message says which nodes there are."""


def resolve_node(target: str, nodes: Iterable[tuple[str, str]], *, pinned: Iterable[str] = ()) -> str:
    """The id of the node ``target`` (an id, or a name only one node has) names among ``nodes``
    (``(id, name)`` pairs). ``pinned``: ids of pinned nodes that count though they are not among
    ``nodes`` (their pin can be taken off). Raises :class:`NodeNotFound`."""
    nodes = list(nodes)
    if target in {nid for nid, _ in nodes} or target in set(pinned):
        return target
    named = [nid for nid, name in nodes if name == target]
    if len(named) == 1:
        return named[0]
    if named:
        raise NodeNotFound(f"no node {target!r}: {len(named)} nodes have that name: use its id "
                           f"({', '.join(sorted(named))})")
    known = ", ".join(sorted(name for _, name in nodes)) or "none"
    raise NodeNotFound(f"no node {target!r}: known nodes are {known}")


@dataclass(frozen=True)
class ClusterState:
    """What a command is checked against: the nodes (id -> name), the failed ones, the drains and
    pins in force, the layers each node holds in the current plan, and the model's layer count."""

    names: Mapping[str, str]
    drained: frozenset[str] = frozenset()
    pins: Mapping[str, Pin] = field(default_factory=dict)
    held: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    failed: frozenset[str] = frozenset()
    n_layers: int = 0

    def resolve(self, command: Command) -> tuple[str, ...]:
        """``command``'s targets as node ids (an unpin may name a pinned node that has gone)."""
        pinned = self.pins if command.action is Action.UNPIN else ()
        return tuple(resolve_node(t, self.names.items(), pinned=pinned) for t in command.targets)

    def name(self, node_id: str) -> str:
        return self.names.get(node_id, node_id)


def propose(command: Command, ids: tuple[str, ...], state: ClusterState) -> tuple[set[str], dict[str, Pin]]:
    """The drains and pins ``command`` (a plan change) on the nodes ``ids`` would leave; raises
    ``ValueError`` with what to do when it cannot be done."""
    drained, pins = set(state.drained), dict(state.pins)
    match command.action:
        case Action.DRAIN | Action.REMOVE:
            drained |= set(ids)
        case Action.UNDRAIN:
            idle = [state.name(n) for n in ids if n not in drained]
            if idle:  # (not a fresh plan in disguise: on tight memory that moves every shard)
                raise ValueError(f"node {', '.join(idle)} is not drained: nothing to undrain")
            drained -= set(ids)
        case Action.PIN if command.layers is not None:
            pins.update(_ranged_pin(ids[0], command.layers, pins, state))
        case Action.PIN:
            for nid in ids:
                if nid not in state.held:
                    raise ValueError(f"node {state.name(nid)} holds no layers to pin: pin a node that serves layers")
                pins[nid] = Pin(nid, *state.held[nid])
        case Action.UNPIN:
            for nid in ids:
                pins.pop(nid, None)
        case Action.REBALANCE:
            pass
        case Action.MODEL:
            raise ValueError("a model switch is not a plan change: use set_model (or run_command)")
    return drained, pins


def _ranged_pin(nid: str, layers: tuple[int, int], pins: dict[str, Pin], state: ClusterState) -> dict[str, Pin]:
    """The pin of one node to ``layers`` (raises ValueError for a range no plan can keep)."""
    start, end = layers
    n_layers = state.n_layers
    if not end <= n_layers:
        raise ValueError(f"layers {start}-{end - 1} are not within the model's 0-{n_layers - 1}: "
                         f"give START-END with 0 <= START <= END <= {n_layers - 1}")
    for other, p in pins.items():
        if other != nid and p.start < end and start < p.end:
            raise ValueError(f"layers {start}-{end - 1} overlap the pin of {state.name(other)} "
                             f"({p.start}-{p.end - 1}): unpin it first")
    if nid in state.failed:
        raise ValueError(f"node {state.name(nid)} has failed: a pin needs a node that is up")
    if nid in state.drained:
        raise ValueError(f"node {state.name(nid)} is drained: undrain it before pinning layers to it")
    return {nid: Pin(nid, start, end)}
