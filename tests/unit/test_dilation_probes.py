"""A compare pass's dilation is the median of several probe engine starts (issue 23 item 1).

One start's kappa moved 28-67 ms between starts on one VM; the median of three keeps one
slow start from setting the whole pass's link. The engine is a fake here: only the rule
is under test (tests/engine/test_dilation.py runs the real probe).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ladsd.config import PROFILES
from ladsd.engine import thread
from ladsd.workloads import dilation as dil

PROF = replace(PROFILES["smoke"], kappa_ref_s=0.04, kappa_ref_float32_s=0.04)


def fake_engine(monkeypatch: pytest.MonkeyPatch, kappas: list[float]) -> list[int]:
    starts: list[int] = []

    class Engine:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.kappa, self.dtype = kappas[len(starts)], "float32"
            starts.append(1)

        async def __aenter__(self) -> Engine:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(thread, "EngineThread", Engine)
    return starts


def test_the_pass_takes_the_median_of_its_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_engine(monkeypatch, [0.067, 0.030, 0.031])  # one slow start of three
    pd = asyncio.run(dil.measure(PROF, dil.PASS_PROBES))
    assert len(starts) == dil.PASS_PROBES == 3
    assert pd.kappa_probes == (0.067, 0.030, 0.031)
    assert pd.kappa_s == 0.031 and pd.dilation == pytest.approx(0.031 / 0.04)
    assert pd.meta()["kappa_probes"] == pd.kappa_probes  # every run file keeps them


def test_a_replay_probes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_engine(monkeypatch, [0.05])
    pd = asyncio.run(dil.measure(PROF))
    assert len(starts) == 1 and pd.kappa_s == 0.05 and pd.kappa_probes == (0.05,)
    with pytest.raises(ValueError, match="at least 1"):
        asyncio.run(dil.measure(PROF, 0))


def test_probes_survive_the_folder_file_and_older_files_load(tmp_path: Path) -> None:
    pd = dil.PassDilation(
        0.8, "measured", 0.032, 0.04, "float32", "smoke", kappa_probes=(0.03, 0.032, 0.05)
    )
    dil.save(pd, tmp_path)
    assert dil.load(tmp_path) == pd
    old = tmp_path / "old"
    old.mkdir()
    (old / dil.FILE).write_text('{"dilation": 1.1, "source": "measured", "kappa_s": 0.04}')
    assert dil.load(old).kappa_probes == ()  # written before probes were kept
