"""Where a result came from: the checkout's git commit (a leaf: the standard library only).

Every run file (``meta.git``) and every bench result (``git``) names the commit its
code was at, so a table can be held against the code that made it.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def git_state() -> tuple[str, bool]:
    """(HEAD's commit, whether tracked files differ from it); ("unknown", False) outside git."""

    def git(*args: str) -> str:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        if p.returncode != 0:
            raise OSError(p.stderr.strip())
        return p.stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "-uno"))
    except OSError:  # no git, or not a checkout (an installed wheel)
        return "unknown", False


def git_commit() -> str:
    """The commit as one string: ``<sha>``, ``<sha>+dirty`` or ``unknown``."""
    head, dirty = git_state()
    return head + ("+dirty" if dirty else "")
