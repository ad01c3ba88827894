"""The serve package's layers: handlers read one narrow context, never the daemon.

``daemon.py`` builds the app and runs the life cycle; the handler modules export
their routes and import nothing of it back (issue 20: "no import of serve/daemon.py
by its handlers"), and they reach the engine only through the runtime. The daemon
and the serve records stay small (<= ~12 fields). Model-free: the Daemon is built
without starting an engine.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ladsd.config import PROFILES
from ladsd.serve import agent_run, chat, sessions
from ladsd.serve.daemon import Daemon, ServeConfig

SERVE = Path(__file__).resolve().parents[2] / "ladsd" / "serve"
HANDLERS = ("completions", "metrics", "protocol", "agents", "context", "submission", "agent_run")
DAEMON = "ladsd.serve.daemon"
GUARD_S = 120  # hang guard of the import subprocess (never a speed assertion)
MAX_FIELDS = 12


def imported(module: str) -> set[str]:
    """Every module ``ladsd/serve/<module>.py`` names in an import (TYPE_CHECKING ones too)."""
    tree = ast.parse((SERVE / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("module", HANDLERS)
def test_no_handler_module_names_the_daemon(module: str) -> None:
    assert DAEMON not in imported(module), f"{module}.py imports {DAEMON}"


def _engine_reads(module: str) -> list[int]:
    """Lines of ``module`` that reach the engine thread itself: ``x.engine`` (but not a
    profile's engine settings) or the daemon's ``live_engine``."""
    tree = ast.parse((SERVE / f"{module}.py").read_text())
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        on_profile = getattr(base, "attr", getattr(base, "id", None)) == "profile"
        if (node.attr == "engine" and not on_profile) or node.attr == "live_engine":
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", HANDLERS)
def test_handlers_reach_the_engine_only_through_the_runtime(module: str) -> None:
    assert _engine_reads(module) == [], f"{module}.py reads the engine thread directly"


def test_importing_the_handlers_does_not_load_the_daemon() -> None:
    """In a fresh interpreter: the handlers (and what they import) never load daemon.py."""
    mods = ", ".join(f"ladsd.serve.{m}" for m in HANDLERS)
    code = f"import sys, {mods}; print({DAEMON!r} in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_the_app_carries_one_context_and_the_handlers_routes() -> None:
    from ladsd.serve.context import CONTEXT, ServeContext

    d = Daemon(PROFILES["smoke"], "lads", ServeConfig())
    try:
        ctx = d.app[CONTEXT]
        assert ctx is d.ctx and isinstance(ctx, ServeContext)
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.sessions = None  # type: ignore[misc]
        paths = {r.resource.canonical for r in d.app.router.routes() if r.resource is not None}
        want = {"/health", "/metrics", "/v1/chat/completions", "/v1/models", "/v1/events",
                "/v1/engine/state", "/v1/sessions/{id}/retention", "/v1/agent/runs"}  # fmt: skip
        assert want <= paths
        # Before the engine is up: the runtime slot is empty, the daemon reads through it.
        assert ctx.rt is None and d.rt is None and not ctx.alive
        assert d.sessions is ctx.sessions and d.events is ctx.events
        assert d.admit_limit == ctx.admission.limit
    finally:
        if d.catalog is not None:
            d.catalog.close()


def _init_fields(cls: type) -> set[str]:
    """The ``self.x`` a class's ``__init__`` assigns (its instance fields)."""
    src = ast.parse(Path(sys.modules[cls.__module__].__file__ or "").read_text())
    for node in ast.walk(src):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            init = next(
                f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"
            )
            return {
                t.attr
                for n in ast.walk(init)
                for target in getattr(n, "targets", [getattr(n, "target", None)])
                for t in getattr(target, "elts", [target])  # a, b = ...: each
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            }  # fmt: skip
    raise AssertionError(f"no class {cls.__name__}")


def test_the_daemon_keeps_few_fields() -> None:
    fields = _init_fields(Daemon)
    assert len(fields) <= MAX_FIELDS, sorted(fields)


@pytest.mark.parametrize("cls", [sessions.Session, chat.ChatRequest, agent_run.AgentRun])
def test_serve_records_are_split_by_concern(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    assert len(names) <= MAX_FIELDS, names
