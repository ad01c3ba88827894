"""The git commit a run file or bench result names (ladsd.provenance)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ladsd import provenance

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git on this machine")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No git variables from the caller (a hook's GIT_DIR would point elsewhere); the
    cached state is read again and dropped after."""
    for var in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(var, raising=False)
    provenance.git_state.cache_clear()
    yield
    provenance.git_state.cache_clear()


@needs_git
def test_the_commit_is_the_checkouts_head() -> None:
    root = str(provenance.ROOT)
    p = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip("not a git checkout")
    porcelain = ["git", "-C", root, "status", "--porcelain", "-uno"]
    dirty = bool(subprocess.run(porcelain, capture_output=True, text=True).stdout.strip())
    assert provenance.git_state() == (p.stdout.strip(), dirty)
    assert provenance.git_commit() == p.stdout.strip() + ("+dirty" if dirty else "")


@needs_git
def test_outside_a_checkout_it_says_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    bare = tmp_path / "not-a-checkout"
    bare.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher
    monkeypatch.setattr(provenance, "ROOT", bare)
    assert provenance.git_state() == ("unknown", False)
    assert provenance.git_commit() == "unknown"
