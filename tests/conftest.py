"""Shared fixtures: tiny random GGUF models, the real default model, process cleanup; how
``make test`` spreads the suite over workers (tests/helpers/schedule.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.factory import write_tiny_llama

# One Hypothesis profile for the suite: no per-example deadline (a 200 ms bound is a wall-clock
# bound, and fails on a busy 2-core machine for no reason of the code's), and no complaint that
# drawing examples is slow. A test that needs more names it in its own settings.
settings.register_profile("exo-tui", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("exo-tui")

# Every coordinator a test starts (a serve, the console) serves its join endpoint on loopback, not
# on every interface as an operator's does: tests talk to loopback only. (A test that joins sets
# its own port; two workers' serves may both want 52417, and the second then serves no join.)
os.environ.setdefault("EXO_TUI__NETWORK__JOIN__HOST", "127.0.0.1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: see tests/helpers/schedule.py (xdist's own count where
    PYTEST_XDIST_AUTO_NUM_WORKERS is set)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    from tests.helpers.schedule import auto_workers

    return auto_workers()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.helpers.schedule import FileScheduling

    return FileScheduling(config, log)


WEIGHT_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random llama GGUF per weight type (tied embeddings, except F32's untied twin)."""
    d = tmp_path_factory.mktemp("models")
    models = {wt: write_tiny_llama(d / f"tiny-{wt}.gguf", weight_type=wt, seed=1) for wt in WEIGHT_TYPES}
    models["F32-untied"] = write_tiny_llama(d / "tiny-F32-untied.gguf", weight_type="F32", tied=False, seed=2)
    return models


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["Q4_1"]


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from exo_tui.models.catalog import resolve_model

    return resolve_model()


@pytest.fixture(scope="session")
def default_gguf(default_model_path: Path):  # -> GGUFModel, opened once (seconds on a busy machine)
    from exo_tui.models.gguf_file import GGUFModel

    return GGUFModel(default_model_path)


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf):  # -> Tokenizer of the default model (SmolLM2)
    from exo_tui.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf)
