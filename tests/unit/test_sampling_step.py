"""The last hop's part of a step (exo_tui.node.sampling_step): samplers kept per request, the
token's logprobs on request. (A malformed ask is refused where the step's body is decoded:
tests/unit/test_messages.py.)"""

from __future__ import annotations

import numpy as np

from exo_tui.net.messages import Forward
from exo_tui.node.sampling_step import Samplers


def step(rid: str, n_tokens: int, **fields: object) -> Forward:
    return Forward.decode({"rid": rid, "hop": 0, "pos": n_tokens - 1, "step": 0, "n_tokens": n_tokens, **fields})


def logits(rows: int = 2, vocab: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32)


def test_a_request_keeps_its_sampler_and_its_seed_until_it_is_forgotten() -> None:
    samplers = Samplers()
    body = step("r", 5, sampling={"temperature": 1.0})
    x = logits()
    first = samplers.sample(body, x)
    # the seed resolved at the first step stays: the same logits at the same position, the same token
    assert all(samplers.sample(body, x) == first for _ in range(5))
    seed = samplers._samplers["r"].seed
    samplers.forget("r")
    samplers.forget("r")  # forgetting twice is harmless
    samplers.sample(body, x)
    assert "r" in samplers._samplers and samplers._samplers["r"].seed != seed


def test_the_token_comes_from_the_last_row_with_its_logprobs_only_when_asked() -> None:
    samplers = Samplers()
    x = logits()
    token, lp = samplers.sample(step("g", 1, sampling={"temperature": 0.0}), x)
    assert token == int(np.argmax(x[-1])) and lp is None
    token, lp = samplers.sample(step("g", 1, logprobs=3), x)
    assert lp is not None and lp.token == token and len(lp.top) == 3
