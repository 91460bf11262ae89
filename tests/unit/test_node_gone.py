"""A command that needs a link to a node that has none says so in words."""

import pytest

from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.membership import NodeGone
from exo_tui.config import Config


def test_a_node_without_a_link_is_named_in_words(tmp_path) -> None:
    c = Coordinator(config=Config(), home=tmp_path, persist=False)
    with pytest.raises(KeyError) as caught:  # the type the handlers of a vanished node catch
        c.connection("n-83b6aa2509f1")
    assert isinstance(caught.value, NodeGone)
    assert str(caught.value) == ("node n-83b6aa2509f1 has no live link (it failed or left the cluster): "
                                 "wait for it to rejoin, or drain or remove it")
