"""Engine tests: they need the model (``ladsd model prepare``, which the install runs).

``smol``: one SmolLM2 engine thread per module (``tests/rigs/engine.py::SMOL``).
``model_ready``: fails (not skips) with the install command when the model is missing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.rigs.engine import SMOL


@pytest.fixture(scope="session")
def model_ready() -> None:
    """Fail (not skip) with the command to run when the model is missing."""
    from ladsd.engine import models

    try:
        models.model_path("smollm2-135m")
    except models.ModelError as e:
        pytest.fail(f"{e} (the README install command prepares it)")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol(model_ready: None) -> AsyncIterator[Any]:
    from ladsd.engine.thread import EngineThread  # vLLM loads only when a test needs it

    async with EngineThread(SMOL) as eng:
        yield eng
