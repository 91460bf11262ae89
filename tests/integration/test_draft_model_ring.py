"""A draft model (``--draft``, issue 42) through a ring of real node processes: a tiny random model
drafts for its F32 twin (the same weights at 4 bits) on the node the plan places it on, its weights
streamed there; greedy answers are token for token those of one process without speculation;
sampled answers (drafts drawn with their distributions, checked by speculative sampling) repeat
with their seed; a kill -9 of the draft model's node mid-answer turns the stream's drafts from it
off and gives the same text, and the next stream drafts from the node the plan places it on then."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from exo_tui.cluster.drafting import load_draft
from exo_tui.cluster.view import ChatParams
from tests.factory import write_tiny_llama
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer
from tests.integration.test_speculative_ring import PROMPT, answer

pytestmark = pytest.mark.slow

N = 40


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> list[int]:
    return reference_answer(tiny_models["F32-untied"], PROMPT, N)


def greedy(k: int = 4) -> ChatParams:
    return ChatParams(temperature=0.0, max_tokens=N, speculative=k)


def test_a_draft_model_gives_the_plain_greedy_answer_and_its_node_dying_only_stops_its_drafts(
        exo_home: Path, tiny_models: dict[str, Path], reference: list[int], tmp_path: Path) -> None:
    # the target's weights again at 4 bits (untied: a tied tiny random model only repeats its last token)
    draft = write_tiny_llama(tmp_path / "draft-Q4_0.gguf", weight_type="Q4_0", tied=False, seed=2)
    with node_processes(exo_home, ["onnx", "onnx"]) as ns:

        async def run() -> None:
            async with coordinator(ns, model=tiny_models["F32-untied"]) as c:
                assert len(c.plan.shards) == 2
                c.draft = load_draft(str(draft), c, c.model)
                c.weights_mode = "stream"  # as to a node on another host: the draft's weights streamed to it
                await c.replan("a draft model")  # the plan places it and counts its bytes
                assert c.plan.draft is not None and c.plan.draft.nbytes > draft.stat().st_size
                first = c.draft.node_id()
                assert first == c.plan.draft.node_id and first in c.plan.node_ids
                assert any(r.startswith(f"draft model {c.draft.name} on ") for r in c.plan.reasons)
                tokens, drafted, accepted = await answer(c, greedy())
                assert tokens == reference
                assert drafted > accepted > 0  # some drafts rejected: the draft cache was cut back
                assert c.draft.streamed == {first}
                assert c.draft.turned_off == 0 and c.pipeline.failed_steps == 0
                assert "draft model" in c.draft.describe() and c.nodes[first].name in c.draft.describe()
                # sampled: the drafts come with their distributions (speculative sampling draws other
                # tokens than plain decoding, from the same distribution), and a seed repeats its answer
                sampled = ChatParams(temperature=0.9, seed=7, max_tokens=N, speculative=4)
                tokens, drafted, accepted = await answer(c, sampled)
                assert drafted > accepted > 0
                assert (await answer(c, sampled))[0] == tokens
                plain, _, _ = await answer(c, replace(sampled, speculative="off"))
                assert plain != tokens
                # under auto too, whatever the plan's step costs measure: rows measured dear would
                # make auto stop drafting, were a sampled stream's k not its answer's alone
                auto = replace(sampled, speculative="auto")
                tokens, drafted, _ = await answer(c, auto)
                assert drafted > 0
                costs = c.step_costs()
                for k in (1, 2, 3, 4) * 3:
                    costs.add(k, 3.0 * k)
                assert (await answer(c, auto))[0] == tokens

                async def kill_draft_node() -> None:
                    proc = next(n for n in ns.nodes if n.port == c.nodes[first].port)
                    os.kill(proc.pid, signal.SIGKILL)

                tokens, _, _ = await answer(c, greedy(), during=kill_draft_node)
                assert tokens == reference
                assert c.draft.turned_off == 1 and first in c.draft.failed
                assert first not in c.plan.node_ids
                # the plan after the failure places it on the node left: new streams draft from it there
                tokens, drafted, accepted = await answer(c, greedy())
                assert tokens == reference and drafted >= accepted > 0
                assert c.draft.node_id() == c.plan.node_ids[0] and c.draft.streamed == {c.plan.node_ids[0]}

        asyncio.run(run())


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_models: dict[str, Path], default_model_path: Path) -> None:
    from exo_tui.models.model import Model

    with pytest.raises(ValueError, match="vocabulary of 49152 tokens.*must share the served model's tokenizer"):
        load_draft(str(default_model_path), None, Model(tiny_models["F32"]))  # type: ignore[arg-type]


@pytest.mark.parametrize("coordinators", [False, True], ids=["one", "set"])
def test_serve_refuses_a_draft_model_of_another_vocabulary_before_starting(exo_home: Path, tmp_path: Path,
                                                                         tiny_models: dict[str, Path],
                                                                         coordinators: bool) -> None:
    """One coordinator, and one of a set (each is given the set's --draft; whichever leads runs it)."""
    from tests.helpers.sshd import free_port

    env = {**os.environ, "EXO_TUI_HOME": str(exo_home)}
    raft = free_port()
    one_set = ["--coordinators", f"127.0.0.1:{raft}", "--coordinator-port", str(raft), "--state-dir",
               str(tmp_path / "state")] if coordinators else ["--local-nodes", "0"]
    r = subprocess.run([sys.executable, "-m", "exo_tui.cli", "serve", *one_set, "--api-port",
                        str(free_port()), "--draft", str(tiny_models["F32"])],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "exo-tui serve: the draft model tiny-llama has a vocabulary of 264 tokens, the model served 49152: a draft "
        "model must share the served model's tokenizer (the same family)")
