"""Shared fixtures. Engine tests need `ladsd model prepare` (the install does it)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def model_ready() -> None:
    """Fail (not skip) with the command to run when the model is missing."""
    from ladsd.engine import models

    try:
        models.model_path("smollm2-135m")
    except models.ModelError as e:
        pytest.fail(f"{e} (the README install command prepares it)")
