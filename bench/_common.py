"""Helpers the bench scripts share (imported as ``_common``: scripts run from bench/)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_meta() -> dict[str, Any]:
    """A result file's ``git``: the commit of the checkout ``ladsd`` is imported from
    (:func:`ladsd.provenance.git_state`), the code the runs ran."""
    from ladsd.provenance import git_state

    commit, dirty = git_state()
    return {"commit": commit, "dirty": dirty}


def pinned_tree(into: Path) -> Path:
    """HEAD as files (``git archive``): the servers run from it, so edits made in the
    working tree while the bench runs (other sessions) never reach them."""
    dest = into / "src"
    dest.mkdir()
    tar = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    return dest


def result_head(bench: str, stamp: str) -> dict[str, Any]:
    """What every result file starts with: the bench, when, the git commit, the argv,
    and the CPU (model, notable flags, native bf16: ladsd.engine.cpu.meta)."""
    import sys

    from ladsd.engine import cpu

    head = {"bench": bench, "created": stamp, "git": git_meta(), "argv": sys.argv[1:]}
    return head | cpu.meta()
