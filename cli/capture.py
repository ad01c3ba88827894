"""``ladsd capture tasks``: run the shopping tasks as real workflows, write the trace.

:func:`capture_tasks` is the reusable part: give it any backend factory (an
async context manager yielding a :class:`~ladsd.agent.backend.Backend`), e.g.
the link-backed one; the command uses a :class:`DirectBackend` over a fresh
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.replay import dtype_option, parse_dtype
from ladsd import clock, logs
from ladsd.workloads import trace as tr
from ladsd.workloads import trace_write
from ladsd.workloads.trace import Trace, TraceCall, TraceWorkflow
from web_catalog.db import open_catalog
from web_catalog.tasks import TASKS_PATH, Task

if TYPE_CHECKING:  # the agent modules import vLLM: only inside the commands
    from ladsd.agent.backend import Backend
    from ladsd.agent.loop import AgentConfig

BackendFactory = Callable[[], AbstractAsyncContextManager["Backend"]]
DEFAULT_OUT = Path("traces/smollm2-16tasks.jsonl")

capture_app = typer.Typer(
    help="Run agent workflows and record their paths as traces (JSONL).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
console = Console()


@capture_app.callback()
def _group() -> None:
    """Run agent workflows and record their paths as traces (JSONL)."""


def _describe(call: TraceCall) -> str:
    a = call.action
    what = f"{a.name} {a.product_id}" if a.is_tool else a.name
    return f"call {call.turn}: {what}"


async def capture_tasks(
    backend_factory: BackendFactory,
    tasks: Sequence[Task],
    seed: int,
    out: Path | str,
    *,
    cfg: AgentConfig | None = None,
    db_path: Path | str | None = None,
    tasks_file: Path | str = TASKS_PATH,
    show: Console | None = console,
) -> Path:
    """Run ``tasks`` concurrently through the backend, write the trace to ``out``,
    print progress and a summary (unless ``show`` is None); return the path.
    ``cfg`` defaults to ``AgentConfig()``."""
    from ladsd.agent.capture import capture
    from ladsd.agent.loop import AgentConfig

    cfg = cfg or AgentConfig()
    with open_catalog(db_path) as db:
        async with backend_factory() as backend:
            t0 = clock.now()
            if show is None:
                trace = await capture(backend, tasks, db, cfg, seed=seed, tasks_file=tasks_file)
            else:
                trace = await _with_progress(backend, tasks, db, cfg, seed, tasks_file, show)
            wall = clock.now() - t0
    path = trace_write.dump(trace, out)
    if show is not None:
        show.print(summary_table(trace))
        show.print(totals_line(trace, wall))
        show.print(f"[green]trace written[/green]: {path}")
    return path


async def _with_progress(backend, tasks, db, cfg, seed, tasks_file, show) -> Trace:
    from ladsd.agent.capture import capture

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=show,
    )
    rows = {t.task_id: bar.add_task(t.task_id, total=cfg.step_limit, status="cold") for t in tasks}

    def on_call(wf: str, call: TraceCall) -> None:
        bar.update(rows[wf], completed=call.turn + 1, status=_describe(call))

    def on_done(w: TraceWorkflow) -> None:
        status = w.termination + (f" ({w.error})" if w.error else "")
        bar.update(rows[w.workflow], total=len(w.calls), completed=len(w.calls), status=status)

    with bar:
        return await capture(
            backend,
            tasks,
            db,
            cfg,
            seed=seed,
            tasks_file=tasks_file,
            on_call=on_call,
            on_done=on_done,
        )


def summary_table(trace: Trace) -> Table:
    from ladsd.agent.capture import summarize

    t = Table(title=f"captured {len(trace.workflows)} workflows (seed {trace.header.seed})")
    for col in ("task", "calls", "open", "reviews", "invalid", "opened 3", "read 3", "cached"):
        t.add_column(col, justify="left" if col == "task" else "right")
    t.add_column("end")
    t.add_column("s", justify="right")
    for w in trace.workflows:
        s = summarize(w)
        share = "-" if s.cached_share is None else f"{100 * s.cached_share:.0f}%"
        t.add_row(
            s.workflow,
            str(s.steps),
            str(s.tools.get("open", 0)),
            str(s.tools.get("read_reviews", 0)),
            str(s.invalid),
            "yes" if s.opened_all else "no",
            "yes" if s.read_all else "no",
            share,
            s.termination,
            f"{s.seconds:.1f}",
        )
    return t


def totals_line(trace: Trace, wall: float) -> str:
    from ladsd.agent.capture import summarize

    sums = [summarize(w) for w in trace.workflows]
    n = len(sums)
    both = sum(s.opened_all and s.read_all for s in sums)
    fin = sum(s.termination == "finish" for s in sums)
    steps = sum(s.steps for s in sums) / n if n else 0.0
    cached = sum(c.cached_tokens for w in trace.workflows for c in w.calls[1:])
    prompt = sum(len(c.prompt_ids) for w in trace.workflows for c in w.calls[1:])
    share = f"{100 * cached / prompt:.0f}%" if prompt else "-"
    return (
        f"{both}/{n} opened all three products and read all their reviews; {fin}/{n} finished; "
        f"{steps:.1f} model calls per task; continuation prompt tokens cached: {share}; "
        f"wall {wall:.1f} s"
    )


def pick_tasks(spec: str, all_tasks: Sequence[Task]) -> list[Task]:
    """``all`` or N (the first N tasks)."""
    if spec == "all":
        return list(all_tasks)
    try:
        n = int(spec)
    except ValueError:
        raise typer.BadParameter(f"--tasks takes a number or 'all', not {spec!r}") from None
    if not 1 <= n <= len(all_tasks):
        raise typer.BadParameter(f"--tasks must be between 1 and {len(all_tasks)}, got {n}")
    return list(all_tasks[:n])


@capture_app.command("tasks")
def tasks_cmd(
    tasks: str = typer.Option(
        "all", "--tasks", help="How many shopping tasks: N (first N) or all."
    ),
    out: Path = typer.Option(DEFAULT_OUT, "--out", help="Trace file to write (JSONL)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (engine; per call if asked)."),
    step_limit: int = typer.Option(10, help="Model calls per task, at most."),
    temperature: float = typer.Option(0.7, help="Sampling temperature of every model call."),
    progress_note: bool = typer.Option(True, help="Checklist turn after each observation."),
    repeats: bool = typer.Option(
        True, help="Offer pages already seen again (--no-repeats: 6 tool calls + finish)."
    ),
    per_call_seed: bool = typer.Option(
        False, help="Seed every call (seed/task/turn). Not on CPU: vLLM 0.32 fails the step."
    ),
    backend: str = typer.Option(
        "link", help="link: results travel the paced TCP link (gzip6, 48 kbit/s); direct: none."
    ),
    policy: str = typer.Option("fifo", help="Delivery policy of the link backend."),
    model: str = typer.Option("smollm2-135m", help="Model profile (see `ladsd model list`)."),
    max_model_len: int = typer.Option(8192, help="Context limit in tokens."),
    dtype: str = dtype_option("auto"),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Show vLLM's and torch's logs (always in the log file)."
    ),
) -> None:
    """Run the shopping tasks concurrently as ReAct workflows; write the trace."""
    from web_catalog.tasks import TaskFileError, load_tasks

    dtype = parse_dtype(dtype)
    if backend not in ("link", "direct"):
        console.print(f"[red]error:[/red] unknown backend {escape(repr(backend))} (link or direct)")
        raise typer.Exit(1)
    try:
        chosen = pick_tasks(tasks, load_tasks())
    except (TaskFileError, ValueError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    with logs.session("capture", verbose) as log:
        import uvloop

        from ladsd.agent.backend import direct_backend
        from ladsd.agent.link_backend import link_backend
        from ladsd.agent.loop import AgentConfig
        from ladsd.config import EngineConfig
        from ladsd.engine.models import ModelError
        from ladsd.engine.thread import EngineError
        from web_catalog.db import CatalogMissing

        try:
            cfg = AgentConfig(
                step_limit=step_limit,
                temperature=temperature,
                progress_note=progress_note,
                repeats=repeats,
                per_call_seed=per_call_seed,
            )
        except ValueError as e:
            console.print(f"[red]error:[/red] {escape(str(e))}")
            raise typer.Exit(1) from None
        engine = EngineConfig(model=model, max_model_len=max_model_len, seed=seed, dtype=dtype)

        def factory():  # noqa: ANN202 - an async context manager yielding a Backend
            if backend == "direct":
                return direct_backend(engine)
            return link_backend(engine, policy)

        try:
            uvloop.run(capture_tasks(factory, chosen, seed, out, cfg=cfg))
        except (CatalogMissing, ModelError, EngineError, tr.TraceError, OSError) as e:
            logs.to_file(str(e), e)
            console.print(f"[red]error:[/red] {escape(str(e))}")
            console.print(f"[dim]full log: {escape(str(log.path))}[/dim]")
            raise typer.Exit(1) from None
    if any(w.termination == "error" for w in tr.load(out).workflows):
        console.print("[red]some workflows failed[/red] (see the end column)")
        raise typer.Exit(1)
