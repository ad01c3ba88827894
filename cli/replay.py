"""``ladsd replay`` and ``ladsd compare``: workloads under delivery policies."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from cli.progress import RunProgress, clock
from ladsd import logs, sizing
from ladsd.config import PROFILES, Profile
from ladsd.delivery import registry
from ladsd.engine import cpu
from ladsd.metrics import comparison, events, grid, peer_compare, summary
from ladsd.modes import EnginePolicy
from ladsd.provenance import git_commit
from ladsd.workloads import dilation as dil
from ladsd.workloads import plan as planning
from ladsd.workloads.factory import WORKLOADS, make

# Heavy modules (vLLM, torch) are imported inside the commands, after the log
# session is set up: `ladsd replay --help` stays fast and silent.

console = Console()
VERBOSE_HELP = "Show vLLM's and torch's logs on the terminal (always in the log file)."
REPLAY_POLICIES = registry.PAPER  # compare's default: the eight of the tables
DELIVERY_POLICIES = registry.DELIVERY  # the eight, then the other delivery names
ENGINE_HELP = (
    "vLLM's scheduler: vllm (its own FCFS order, fixed token budget), augserve "
    "(AugServe: value-density order, dynamic token budget, Preserve pins; docs/peers.md) "
    "or augserve-order (AugServe's order alone: vLLM's fixed budget, no Preserve)."
)
AUGSERVE_ENGINES = ", ".join(e.value for e in EnginePolicy if e.augserve)  # augserve, ...
POLICY_HELP = (
    f"One of: {', '.join(DELIVERY_POLICIES)}; or an engine policy ({AUGSERVE_ENGINES}: "
    "FIFO delivery on it) or ENGINE+POLICY (augserve+lads)."
)
PEERS_HELP = (
    f"Add the neighbouring designs ({', '.join(registry.PEERS)}; docs/peers.md), "
    "once per seed, and their tables."
)


def dtype_option(default: str = "the profile's: float32 for cpu, else auto") -> Any:
    """``--dtype`` of every command that builds an engine (None: the profile's)."""
    return typer.Option(None, help=f"{cpu.DTYPE_HELP} [default: {default}]")


def parse_dtype(dtype: str | None, default: str = "auto") -> str:
    """A ``--dtype`` value checked (None: ``default``)."""
    if dtype is None:
        return default
    if dtype not in cpu.DTYPES:
        raise typer.BadParameter(
            f"unknown dtype {dtype!r}; choose from {', '.join(cpu.DTYPES)}", param_hint="--dtype"
        )
    return dtype


def with_dtype(prof: Profile, dtype: str | None) -> Profile:
    """``prof`` with its engine's dtype set to ``dtype`` (None: as it is)."""
    dtype = parse_dtype(dtype, prof.engine.dtype)
    if dtype == prof.engine.dtype:
        return prof  # unchanged: compare's run files made before --dtype still resume
    return replace(prof, engine=replace(prof.engine, dtype=dtype))


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise typer.BadParameter("give at least one seed")
    return seeds


def parse_engine(text: str) -> EnginePolicy:
    try:
        return EnginePolicy(text)
    except ValueError:
        choices = ", ".join(e.value for e in EnginePolicy)
        raise typer.BadParameter(f"unknown engine policy {text!r}; choose from {choices}") from None


def parse_policies(text: str, engine: EnginePolicy = EnginePolicy.VLLM) -> list[str]:
    """Comma-separated run names, each on ``engine`` unless it names its own (canonical)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    out, bad = [], []
    for p in names:
        try:
            out.append(planning.with_engine(p, engine))
        except ValueError:
            bad.append(p)
    if bad:
        raise typer.BadParameter(
            f"unknown policies {bad}; choose from {', '.join(DELIVERY_POLICIES)}, "
            f"an engine policy ({AUGSERVE_ENGINES}) "
            "or ENGINE+POLICY"
        )
    return list(dict.fromkeys(out))


def compare_flags(
    cohort: int | None, trace: Path | None, kv_blocks: int | None
) -> dict[str, int | str]:
    """The options a compare's run files record (those given; engine policy: per run)."""
    flags = {"cohort": cohort, "trace": str(trace) if trace else None, "kv_blocks": kv_blocks}
    return {k: v for k, v in flags.items() if v is not None}


def _profile(name: str, kv_blocks: int | None) -> Profile:
    if name not in PROFILES:
        raise typer.BadParameter(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    prof = PROFILES[name]
    if not kv_blocks:
        return prof
    # An explicit pool replaces the per-workload pool rule; where the profile sizes
    # pools by the rule, H stays the rule's fraction of the pool.
    if prof.pool_rule:
        return replace(sizing.with_pool(prof, kv_blocks), pool_rule=False)
    return replace(prof, engine=replace(prof.engine, num_gpu_blocks_override=kv_blocks))


def _check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise typer.BadParameter(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _run_errors() -> tuple[type[BaseException], ...]:
    """What a run raises when it fails for a reason worth one line (not a traceback)."""
    from ladsd.engine.models import ModelError
    from ladsd.engine.thread import EngineError
    from ladsd.workloads.runner import RunFailed
    from ladsd.workloads.trace import TraceError

    return (RunFailed, EngineError, ModelError, TraceError, OSError, ValueError)


def fail(what: str, e: BaseException, log: logs.LogSession) -> typer.Exit:
    """Print the error (the engine's own message included) and where the full log is."""
    logs.to_file(f"{what}{e}", e)
    console.print(f"[red]error:[/red] {escape(what)}{escape(str(e))}")
    console.print(f"[dim]full log: {escape(str(log.path))}[/dim]")
    return typer.Exit(1)


def show_log(log: logs.LogSession) -> None:
    """Say where the engine's log went (when something was logged)."""
    if log.path.exists() and log.path.stat().st_size:
        console.print(f"[dim]engine log: {escape(str(log.path))}[/dim]")


def run_one(
    label: str,
    policy: str,
    workload: str,
    prof: Profile,
    seed: int,
    cohort: int | None,
    trace: Path | None,
    meta: dict | None = None,
    dilation: dil.PassDilation | None = None,
) -> tuple[events.RunRecord, float]:
    """One run with its progress line; returns the record and its wall time in seconds."""
    from ladsd.workloads.runner import run

    wl = make(workload, prof, seed, cohort=cohort, trace=trace)
    t0 = time.monotonic()
    with RunProgress(console, label, wl) as progress:
        rec = asyncio.run(run(wl, prof, policy, progress, meta, dilation=dilation))
    return rec, time.monotonic() - t0


DILATION_HELP = (
    "The pass's link dilation: every run's link rate / D and its time constants (lease "
    "lifetime, tick, record age, cohort timeout, arrivals, tool times) x D [default: "
    "measured once at the start of the pass: kappa / the profile's kappa_ref for the dtype]."
)


def pass_dilation(
    prof: Profile, given: float | None, out: Path | None = None, resume: bool = True
) -> dil.PassDilation:
    """The one dilation of this pass: ``--dilation``, the one stored in ``out`` by an
    earlier part of the pass (a resume, another workload of paper_cpu.sh), or measured
    now by one probe engine start; a compare stores it in ``out/dilation.json``."""
    where = out / dil.FILE if out is not None else None
    try:
        stored = dil.load(out) if out is not None and resume else None
        if stored is not None:
            stored.check(prof, where or Path(dil.FILE))
    except ValueError as e:  # unreadable, or measured for another profile or CPU
        raise typer.BadParameter(str(e), param_hint="--out") from None
    if stored is not None:
        if given is not None and given != stored.dilation:
            raise typer.BadParameter(
                f"{where} says this folder's pass runs at dilation "
                f"{stored.dilation:.4g}; --dilation {given:g} would mix two in one pass: "
                "use another --out or --no-resume",
                param_hint="--dilation",
            )
        pd = stored
    elif given is not None:
        try:
            pd = dil.given(prof, given)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--dilation") from None
    else:
        n = dil.PASS_PROBES
        with console.status(f"measuring kappa ({n} probe engine starts) for the link dilation ..."):
            pd = asyncio.run(dil.measure(prof, n))
    if out is not None and stored is None:
        dil.save(pd, out)
    console.print(describe_dilation(pd, stored is not None))
    return pd


def describe_dilation(pd: dil.PassDilation, stored: bool = False) -> str:
    """One line: the pass's dilation and where it came from."""
    if pd.source == "none":
        return "link dilation 1 (the profile has no kappa reference)"
    how = "given"
    if pd.kappa_s is not None and pd.kappa_ref_s is not None:
        how = f"kappa {pd.kappa_s * 1e3:.1f} ms / reference {pd.kappa_ref_s * 1e3:.1f} ms"
        how += f", {pd.dtype}"
    where = ", this folder's pass" if stored else ""
    return f"link dilation {pd.dilation:.3f} ({how}{where}): one for every run of this pass"


def check_dilation(rec: events.RunRecord, pd: dil.PassDilation, path: Path) -> None:
    """Refuse to add runs to a folder whose run ``rec`` was made at another dilation."""
    d = float(rec.meta.get("dilation", 1.0))
    per_run = "dilation_pass" not in rec.meta and pd.source != "none"
    if d != pd.dilation or per_run:
        how = "its own (per-run) dilation" if per_run else "another pass's dilation"
        raise typer.BadParameter(
            f"{path} was made at {how} {d:.4g}, this pass runs at {pd.dilation:.4g}: "
            "one pass has one dilation; use another --out or --no-resume"
        )


def check_commit(rec: events.RunRecord, here: str, path: Path) -> None:
    """Refuse to add runs to a folder whose run ``rec`` was made at another commit.

    A pass is one frozen code: a stored file of another commit under the same
    policy name may be another rule. Taken as unknowable: a file without a commit
    (older formats) or made outside git (``unknown``), a checkout outside git, and
    uncommitted edits (``+dirty`` is ignored: two dirty trees at one commit pass,
    so a frozen pass runs from a clean worktree).
    """
    made = str(rec.meta.get("git") or "")
    if made in ("", "unknown") or here == "unknown":
        return
    if made.split("+")[0] != here.split("+")[0]:
        raise typer.BadParameter(
            f"{path} was made at commit {made}, this pass runs at {here}: "
            "one pass is one frozen code; use another --out or --no-resume"
        )


def print_grids(grids: Sequence[grid.Grid]) -> None:
    """Tables laid out for the terminal's width (split or transposed when narrow)."""
    for g in grids:
        for t in grid.rich_tables(g, console.width):
            console.print(t)


def write_peers(runs: dict[str, list[events.RunRecord]], out: Path, tag: str) -> None:
    """With peers among ``runs``: print their tables, write -peers.md and -peers.json."""
    import orjson

    peer = peer_compare.peer_comparison(runs)
    if peer is None:
        return
    grids = peer_compare.peer_grids(peer)
    print_grids(grids)
    (out / f"{tag}-peers.md").write_text(grid.markdown(grids))
    doc = peer_compare.peer_dict(peer)
    (out / f"{tag}-peers.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


def replay(
    policy: str = typer.Option("lads", help=POLICY_HELP),
    engine_policy: str = typer.Option("vllm", help=ENGINE_HELP),
    workload: str = typer.Option("controlled", help=f"One of: {', '.join(WORKLOADS)}."),
    profile: str = typer.Option("cpu", help=f"One of: {', '.join(PROFILES)}."),
    seeds: str = typer.Option("1", help="Comma-separated input seeds, e.g. 1,2,3."),
    cohort: int = typer.Option(None, help="Cohort size C (8 or 16; default: the workload's)."),
    trace: Path = typer.Option(None, help="Trace for web-burst/captured [default: traces/]."),
    kv_blocks: int = typer.Option(None, help="Override the profile's KV pool (blocks)."),
    dtype: str = dtype_option(),
    dilation: float = typer.Option(None, help=DILATION_HELP),
    json_out: Path = typer.Option(None, "--json", help="Write the run records (JSON list)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Replay a workload under one policy (on an engine policy); print a summary table."""
    names = parse_policies(policy, parse_engine(engine_policy))
    if len(names) != 1:
        raise typer.BadParameter(f"give one policy, got {policy!r}")
    policy = names[0]
    _check_workload(workload)
    prof = with_dtype(_profile(profile, kv_blocks), dtype)
    seed_list = parse_seeds(seeds)
    runs: list[events.RunRecord] = []
    sums: list[summary.Summary] = []
    with logs.session("replay", verbose) as log:
        errors = _run_errors()
        try:  # one dilation for every seed of this replay
            pd = pass_dilation(prof, dilation)
        except errors as e:
            raise fail("measuring the link dilation: ", e, log) from None
        for i, seed in enumerate(seed_list, start=1):
            label = f"{policy} seed {seed}"
            if len(seed_list) > 1:
                label = f"run {i}/{len(seed_list)} {label}"
            try:
                rec, took = run_one(label, policy, workload, prof, seed, cohort, trace, None, pd)
            except errors as e:
                raise fail(f"{policy} seed {seed}: ", e, log) from None
            runs.append(rec)
            s = summary.summarize(rec)
            sums.append(s)
            console.print(
                f"{policy} seed {seed}: mean {s.mean_s:.2f} s, P95 {s.p95_s:.2f} s, "
                f"makespan {s.makespan_s:.2f} s, audit ok; took {clock(took)}"
            )
        print_grids([comparison.run_grid(sums)])
        if json_out:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_bytes(b"[" + b",".join(events.to_json(r) for r in runs) + b"]")
            console.print(f"wrote {json_out}")
        show_log(log)


def compare(
    workload: str = typer.Option("controlled", help=f"One of: {', '.join(WORKLOADS)}."),
    policies: str = typer.Option(
        ",".join(REPLAY_POLICIES), help="Comma-separated policies (see replay --help)."
    ),
    peers: bool = typer.Option(False, "--peers", help=PEERS_HELP),
    engine_policy: str = typer.Option(
        "vllm", help=ENGINE_HELP + " Policies without their own engine run on it."
    ),
    profile: str = typer.Option("cpu", help=f"One of: {', '.join(PROFILES)}."),
    seeds: str = typer.Option("1,2,3", help="Comma-separated input seeds."),
    cohort: int = typer.Option(None, help="Cohort size C (8 or 16)."),
    trace: Path = typer.Option(None, help="Trace for web-burst/captured."),
    kv_blocks: int = typer.Option(None, help="Override the profile's KV pool (blocks)."),
    dtype: str = dtype_option(),
    dilation: float = typer.Option(None, help=DILATION_HELP),
    repeats: int = typer.Option(
        2,
        help=f"Runs per seed of the core policies ({', '.join(registry.CORE)}; every policy "
        "with --repeat-all): their repeats are the A/A pairs.",
    ),
    repeat_all: bool = typer.Option(
        False, "--repeat-all", help="Repeat every policy, peers too (each gets its A/A pair)."
    ),
    out: Path = typer.Option(Path("bench/results/compare"), help="Folder for JSON and plots."),
    resume: bool = typer.Option(True, help="Reuse run files already in --out."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Run several policies over the same seeds; paper-style table, JSON and plots.

    Each (seed, repeat) block runs its policies in a rotated order; the core
    policies (every policy with --repeat-all) run --repeats times per seed and
    their repeats are the noise floor.
    Every run file records its configuration; a resume refuses a file made with
    another one. With --peers, the neighbouring designs run beside them (once per
    seed) and -peers.md / -peers.json hold their tables. The link dilation is
    measured once, kept in --out's dilation.json, and every run of the folder uses
    it (a resume too; files made at another dilation are refused). A resume that
    adds runs also refuses files made at another git commit: one pass, one code.
    """
    _check_workload(workload)
    names = parse_policies(policies, parse_engine(engine_policy))
    if peers:  # checked again: a peer whose policy is not registered fails here, not mid-run
        names = parse_policies(",".join(planning.with_peers(names)))
    prof = with_dtype(_profile(profile, kv_blocks), dtype)
    seed_list = parse_seeds(seeds)
    if repeats < 1:
        raise typer.BadParameter("--repeats must be at least 1")
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{workload}" + (f"-c{cohort}" if cohort else "") + f"-{prof.name}"
    flags = compare_flags(cohort, trace, kv_blocks)
    slots = planning.plan(names, seed_list, repeats, out, tag, repeat_all=repeat_all)
    stored = {s.path for s in slots if resume and s.path.exists()}
    n = len(slots)
    console.print(
        f"compare {workload} ({prof.name} profile): {len(names)} policies x "
        f"{len(seed_list)} seeds, {'all' if repeat_all else 'core'} policies x{repeats} "
        f"= {n} runs" + (f", {len(stored)} read back from {out}" if stored else "")
    )
    loaded = functools.cache(events.load)  # stored files: read once, checked before any run
    runs: dict[str, list[events.RunRecord]] = {}
    took: list[float] = []
    legacy = 0
    with logs.session("compare", verbose) as log:
        errors = _run_errors() if len(stored) < n else ()  # () when nothing runs: no vLLM import
        pd = None  # nothing runs (a re-render): no dilation is measured
        if len(stored) < n:
            # Before any run: a refused folder must not get this commit's runs first.
            here = git_commit()
            for path in sorted(stored):
                check_commit(loaded(path), here, path)
            try:
                pd = pass_dilation(prof, dilation, out, resume)
            except errors as e:
                raise fail("measuring the link dilation: ", e, log) from None
        for i, slot in enumerate(slots, start=1):
            seed, pol, path = slot.seed, slot.policy, slot.path
            head = f"run {i}/{n} {pol} seed {seed}" + (
                f" repeat {slot.repeat}" if slot.repeat > 1 else ""
            )
            want = planning.config(prof, workload, seed, planning.run_flags(flags, pol))
            if path in stored:
                rec = loaded(path)
                if "config" in rec.meta:
                    try:
                        planning.check(rec.meta["config"], want, path)
                    except planning.ConfigMismatch as e:
                        raise typer.BadParameter(str(e)) from None
                else:
                    legacy += 1  # written before run files recorded their configuration
                if pd is not None:  # runs are added to this folder: at one dilation
                    check_dilation(rec, pd, path)
                note = "read back"
            else:
                meta = {
                    "repeat": slot.repeat,
                    "order_position": slot.position,
                    "config": want,
                }
                try:
                    rec, dt = run_one(head, pol, workload, prof, seed, cohort, trace, meta, pd)
                except errors as e:
                    raise fail(f"{head}: ", e, log) from None
                events.save(rec, path)
                took.append(dt)
                left = sum(1 for s in slots[i:] if s.path not in stored)
                note = f"took {clock(dt)}"
                if left:
                    runs_left = f"{left} run" + ("s" if left > 1 else "")
                    note += f"; ~{clock(left * sum(took) / len(took))} left for {runs_left}"
            summary.audit(rec)
            runs.setdefault(pol, []).append(rec)
            console.print(
                f"{head}: mean {summary.mean_latency(rec):.2f} s, "
                f"P95 {summary.p95_latency(rec):.2f} s ({note})"
            )
        if legacy:
            console.print(
                f"[yellow]note:[/yellow] {legacy} run file(s) predate configuration records; "
                "their configuration was not checked"
            )
        comp = comparison.compare(runs)
        grids = [*comparison.comparison_grids(comp), comparison.drivers_grid(runs)]
        print_grids(grids)
        (out / f"{tag}-table.md").write_text(grid.markdown(grids))
        write_peers(runs, out, tag)
        from ladsd.metrics import plots

        plots.latency_cdf(runs, out / f"{tag}-cdf.png")
        plots.stage_breakdown(runs, out / f"{tag}-stages.png")
        if registry.CANDIDATE in runs:
            plots.lease_timeline(runs[registry.CANDIDATE][0], out / f"{tag}-lease-timeline.png")
        console.print(f"wrote {out}/{tag}-*.json, -table.md and plots")
        show_log(log)
