"""``ladsd replay`` and ``ladsd compare``: workloads under delivery policies."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ladsd.config import PROFILES, Profile
from ladsd.metrics import events, summary, table
from ladsd.workloads.factory import WORKLOADS, make
from ladsd.workloads.runner import REPLAY_POLICIES, RunFailed, run

console = Console()


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise typer.BadParameter("give at least one seed")
    return seeds


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in REPLAY_POLICIES]
    if bad:
        raise typer.BadParameter(
            f"unknown policies {bad}; choose from {', '.join(REPLAY_POLICIES)}"
        )
    return names


def _profile(name: str, kv_blocks: int | None) -> Profile:
    if name not in PROFILES:
        raise typer.BadParameter(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    prof = PROFILES[name]
    if kv_blocks:
        prof = replace(prof, engine=replace(prof.engine, num_gpu_blocks_override=kv_blocks))
    return prof


def _check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise typer.BadParameter(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def run_one(
    policy: str, workload: str, prof: Profile, seed: int, cohort: int | None, trace: Path | None
) -> events.RunRecord:
    wl = make(workload, prof, seed, cohort=cohort, trace=trace)
    with Progress(
        TextColumn(f"[bold]{policy}[/bold] {workload} seed {seed}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("calls"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("run", total=wl.continuations + len(wl.workflows))

        def progress(_: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return asyncio.run(run(wl, prof, policy, progress))


def replay(
    policy: str = typer.Option("lads", help=f"One of: {', '.join(REPLAY_POLICIES)}."),
    workload: str = typer.Option("controlled", help=f"One of: {', '.join(WORKLOADS)}."),
    profile: str = typer.Option("cpu", help=f"One of: {', '.join(PROFILES)}."),
    seeds: str = typer.Option("1", help="Comma-separated input seeds, e.g. 1,2,3."),
    cohort: int = typer.Option(None, help="Cohort size C (8 or 16; default: the workload's)."),
    trace: Path = typer.Option(None, help="Trace for web-burst/captured [default: traces/]."),
    kv_blocks: int = typer.Option(None, help="Override the profile's KV pool (blocks)."),
    json_out: Path = typer.Option(None, "--json", help="Write the run records (JSON list)."),
) -> None:
    """Replay a workload under one delivery policy; print a summary table."""
    parse_policies(policy)
    _check_workload(workload)
    prof = _profile(profile, kv_blocks)
    runs: list[events.RunRecord] = []
    sums: list[summary.Summary] = []
    for seed in parse_seeds(seeds):
        try:
            rec = run_one(policy, workload, prof, seed, cohort, trace)
        except (RunFailed, FileNotFoundError, ValueError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        runs.append(rec)
        s = summary.summarize(rec)
        sums.append(s)
        console.print(
            f"{policy} seed {seed}: mean {s.mean_s:.2f} s, P95 {s.p95_s:.2f} s, "
            f"makespan {s.makespan_s:.2f} s, audit ok "
            f"({int(rec.counters['refs_added'])} refs added = released)"
        )
    console.print(table.rich_table(table.run_grid(sums)))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_bytes(b"[" + b",".join(events.to_json(r) for r in runs) + b"]")
        console.print(f"wrote {json_out}")


def compare(
    workload: str = typer.Option("controlled", help=f"One of: {', '.join(WORKLOADS)}."),
    policies: str = typer.Option(",".join(REPLAY_POLICIES), help="Comma-separated policies."),
    profile: str = typer.Option("cpu", help=f"One of: {', '.join(PROFILES)}."),
    seeds: str = typer.Option("1,2,3", help="Comma-separated input seeds."),
    cohort: int = typer.Option(None, help="Cohort size C (8 or 16)."),
    trace: Path = typer.Option(None, help="Trace for web-burst/captured."),
    kv_blocks: int = typer.Option(None, help="Override the profile's KV pool (blocks)."),
    out: Path = typer.Option(Path("bench/results/compare"), help="Folder for JSON and plots."),
    resume: bool = typer.Option(True, help="Reuse run files already in --out."),
) -> None:
    """Run several policies over the same seeds; paper-style table, JSON and plots."""
    _check_workload(workload)
    names = parse_policies(policies)
    prof = _profile(profile, kv_blocks)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{workload}" + (f"-c{cohort}" if cohort else "") + f"-{prof.name}"
    runs: dict[str, list[events.RunRecord]] = {}
    for seed in parse_seeds(seeds):
        for pol in names:
            path = out / f"{tag}-{pol}-s{seed}.json"
            if resume and path.exists():
                rec = events.load(path)
            else:
                try:
                    rec = run_one(pol, workload, prof, seed, cohort, trace)
                except (RunFailed, FileNotFoundError, ValueError) as e:
                    console.print(f"[red]error:[/red] {pol} seed {seed}: {e}")
                    raise typer.Exit(1) from None
                events.save(rec, path)
            summary.audit(rec)
            runs.setdefault(pol, []).append(rec)
            console.print(f"{pol:>22} seed {seed}: mean {summary.mean_latency(rec):7.2f} s")
    comp = table.compare(runs)
    grids = [*table.comparison_grids(comp), table.drivers_grid(runs)]
    for g in grids:
        console.print(table.rich_table(g))
    (out / f"{tag}-table.md").write_text(table.markdown(grids))
    from ladsd.metrics import plots

    plots.latency_cdf(runs, out / f"{tag}-cdf.png")
    plots.stage_breakdown(runs, out / f"{tag}-stages.png")
    if "lads" in runs:
        plots.lease_timeline(runs["lads"][0], out / f"{tag}-lease-timeline.png")
    console.print(f"wrote {out}/{tag}-*.json, -table.md and plots")
