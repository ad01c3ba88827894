"""Live progress of a replay run: workflows done, elapsed, time left.

:class:`RunProgress` is the ``progress(workflow_id, calls_done, calls_total)``
callback of :func:`ladsd.workloads.runner.run` and draws one line, e.g.::

    run 3/16 lads seed 2 ━━━━━━━━━━╺━━━━━━━  5/8 workflows  0:41  ~0:22 left

Until the first call returns it says "starting engine". The time left is the
calls still to come at the rate observed since the first call finished (the
engine start is not part of that rate). The line is transient: it disappears
when the run ends, and it is not drawn at all when stdout is not a terminal.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

if TYPE_CHECKING:
    from ladsd.workloads.spec import Workload


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss`` from an hour on)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def time_left(done0: int, t0: float, done: int, total: int, now: float) -> float | None:
    """Seconds left at the rate seen since ``(t0, done0)``; None before there is a rate."""
    if done >= total:
        return 0.0
    if done <= done0 or now <= t0:
        return None
    return (total - done) * (now - t0) / (done - done0)


class _Times(ProgressColumn):
    """Elapsed and the estimated time left."""

    def render(self, task: Task) -> Text:
        elapsed = clock(task.elapsed or 0.0)
        first = task.fields.get("first")
        left = None
        if first is not None:
            left = time_left(first[0], first[1], int(task.completed), int(task.total or 0), now())
        tail = "estimating" if left is None else f"~{clock(left)} left"
        return Text(f"{elapsed}  {tail}", style="progress.remaining")


def now() -> float:
    return time.monotonic()


class RunProgress:
    """The progress line of one run; use as a context manager and pass it as ``progress``."""

    def __init__(self, console: Console, label: str, workload: Workload) -> None:
        self._calls = {w.wid: len(w.calls) + 1 for w in workload.workflows}
        self._seen: dict[str, int] = {}
        self.workflows_done = 0
        self._live = console.is_terminal  # no live line into pipes and files
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=16),
            TextColumn("{task.fields[status]}"),
            _Times(),
            console=console,
            transient=True,
        )
        total = workload.continuations + len(workload.workflows)
        self._task = self._bar.add_task(
            label, total=total, status="starting engine", first=None, start=True
        )

    def __enter__(self) -> RunProgress:
        if self._live:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self._bar.stop()

    def __call__(self, workflow_id: str, calls_done: int, calls_total: int) -> None:
        n = self._seen.get(workflow_id, 0) + 1
        self._seen[workflow_id] = n
        if n == self._calls.get(workflow_id):
            self.workflows_done += 1
        fields = {"status": f"{self.workflows_done}/{len(self._calls)} workflows"}
        task = self._bar.tasks[0]
        if task.fields.get("first") is None:
            fields["first"] = (calls_done, now())
        self._bar.update(self._task, completed=calls_done, total=calls_total, **fields)
