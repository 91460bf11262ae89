"""The body of ``POST /exo/v1/resume`` (exo_tui/api/resume_body.py): a stream a standby resumes on
a new leader keeps every field that decides its tokens or its drafts; a bad body is refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from exo_tui.api.resume_body import ResumeBody
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams


@pytest.mark.parametrize(("speculative", "predicted", "seeded"), [(4, [5, 6, 7], False), ("off", None, True),
                                                                  (None, [9], True), ("auto", None, False)])
def test_a_resumed_request_keeps_its_speculation_prediction_and_seed_rule(speculative: str | int | None,
                                                                          predicted: list[int] | None,
                                                                          seeded: bool) -> None:
    sent = Request([1, 2, 3], SamplingParams(temperature=0.7, top_k=40, seed=11), 32, ("END",), top_logprobs=2,
                   speculative=speculative, predicted=predicted, seeded=seeded)
    wire = json.dumps(ResumeBody.of(sent, id="r-r1", left="r", generated=[4, 5]).model_dump())  # as httpx sends it
    body = ResumeBody.model_validate_json(wire)  # as the leader reads it
    got = body.request()
    assert (body.id, body.left) == ("r-r1", "r")
    assert (got.id, got.prompt_ids, got.generated, got.max_tokens, got.stop, got.top_logprobs) == \
        ("r-r1", [1, 2, 3], [4, 5], 32, ("END",), 2)
    assert got.sampling == sent.sampling
    assert (got.speculative, got.predicted, got.seeded) == (speculative, predicted, seeded)


@pytest.mark.parametrize(("change", "says"), [
    ({"speculative": "fast"}, "speculative"), ({"speculative": 99}, "speculative"),
    ({"predicted": [1, -2]}, "predicted"), ({"seeded": "maybe"}, "seeded"),
    ({"sampling": {"temperature": -1}}, "temperature"), ({"prompt_ids": []}, "prompt_ids"),
    ({"draft_model": "x"}, "draft_model"),  # a field this version does not know: not run without it
])
def test_a_bad_resume_body_is_refused_with_what_is_wrong(change: dict[str, object], says: str) -> None:
    good = ResumeBody.of(Request([1, 2], SamplingParams(temperature=0.0), 8, speculative=2, predicted=[3]), id="r")
    with pytest.raises(ValidationError, match=says):
        ResumeBody.model_validate_json(json.dumps({**good.model_dump(), **change}))


def test_numpy_token_ids_make_a_body_the_leader_takes() -> None:
    """A sampler's or a tokenizer's ids may be NumPy ints: the standby's body was refused by its own
    strict fields mid-failover (pydantic's int_type), the stream lost."""
    import numpy as np

    sent = Request([np.int64(1), np.int32(2)], SamplingParams(temperature=0.0), 8, predicted=[np.int64(7)])
    body = ResumeBody.model_validate_json(json.dumps(ResumeBody.of(sent, id="r", generated=[np.int64(4)]).model_dump()))
    assert (body.prompt_ids, body.generated, body.predicted) == ([1, 2], [4], [7])
