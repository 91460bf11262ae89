"""How the "even" strategy deals unpinned nodes to the ranges of layers that pins leave free."""

from __future__ import annotations

import pytest

from exo_tui.cluster.coordinator import _share


@pytest.mark.parametrize(
    ("nodes", "sizes", "want"),
    [
        (["a", "b", "c"], [30], [["a", "b", "c"]]),
        (["a", "b", "c"], [10, 20], [["a"], ["b", "c"]]),  # the larger range gets the spare node
        (["a", "b"], [1, 1], [["a"], ["b"]]),
        (["a", "b", "c", "d"], [1, 2], [["a"], ["b", "c"]]),  # never more nodes than layers
        (["a"], [], []),
    ],
)
def test_share(nodes, sizes, want):
    assert _share(nodes, sizes) == want


def test_every_range_gets_a_node_and_every_node_at_most_one_range():
    nodes = [f"n{i}" for i in range(7)]
    for sizes in ([5, 1, 9], [1, 1, 1, 1, 1, 1, 1], [3, 30], [2, 2, 2]):
        groups = _share(nodes, sizes)
        assert all(1 <= len(g) <= s for g, s in zip(groups, sizes, strict=True))
        dealt = [n for g in groups for n in g]
        assert dealt == nodes[: len(dealt)] and len(dealt) == min(len(nodes), sum(sizes))
