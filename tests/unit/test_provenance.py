"""The git commit a run file or bench result names (ladsd.provenance)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ladsd import provenance


def test_the_commit_is_the_checkouts_head() -> None:
    head = subprocess.run(
        ["git", "-C", str(provenance.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    commit, dirty = provenance.git_state()
    assert commit == head
    assert provenance.git_commit() == head + ("+dirty" if dirty else "")


def test_outside_a_checkout_it_says_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(provenance, "ROOT", tmp_path)  # no .git above tmp
    provenance.git_state.cache_clear()
    try:
        assert provenance.git_state() == ("unknown", False)
        assert provenance.git_commit() == "unknown"
    finally:
        provenance.git_state.cache_clear()
