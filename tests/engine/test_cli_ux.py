"""The first five minutes: fast help, quiet runs, tables that fit, progress that tells the time.

The CLI tests run the real ``ladsd`` executable in a subprocess (the real
engine, smoke profile), with ``COLUMNS`` set to 80 or 200; output is captured,
so rich renders at exactly that width.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from rich.cells import cell_len
from rich.console import Console

from cli.progress import RunProgress, clock, time_left
from ladsd.delivery import registry
from ladsd.metrics import events, grid, summary

LADSD = str(Path(sys.executable).with_name("ladsd"))
ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = (
    (),
    ("replay",),
    ("compare",),
    ("serve",),
    ("capture",),
    ("capture", "tasks"),
    ("model",),
    ("model", "prepare"),
    ("catalog",),
)
# What vLLM, torch and the CPU platform print while an engine starts.
ENGINE_NOISE = (
    "vllm",
    "Triton",
    "LD_PRELOAD",
    "InputProcessor",
    "custom scheduler",
    "NUMA",
    "FutureWarning",
    "Initializing a V1 LLM engine",
)
VLLM_FORMAT = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR)\b.*\[")


def ladsd(*args: str, columns: int = 80, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    env.pop("VLLM_LOGGING_LEVEL", None)  # the user's defaults, not the test suite's
    return subprocess.run(
        [LADSD, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )


def engine_log(stdout: str) -> Path:
    m = re.search(r"engine log: (\S+)", stdout)
    assert m, stdout
    return Path(m.group(1))


def assert_quiet(res: subprocess.CompletedProcess) -> None:
    """No engine log line anywhere on the terminal: stdout is ours, stderr is empty."""
    for noise in ENGINE_NOISE:
        assert noise not in res.stdout, noise
    assert not any(VLLM_FORMAT.search(line) for line in res.stdout.splitlines()), res.stdout
    assert res.stderr == "", res.stderr


def assert_fits(stdout: str, width: int) -> None:
    assert "…" not in stdout, stdout  # rich's mark of a cut cell
    assert max(cell_len(line) for line in stdout.splitlines()) <= width, stdout


def table_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("│", "┃"))]


# ---- help: fast, clean, no engine import ------------------------------------


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda a: " ".join(a) or "ladsd")
def test_help_starts_with_usage_and_prints_nothing_else(args: tuple[str, ...]) -> None:
    res = ladsd(*args, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: ladsd"), res.stdout[:200]
    assert res.stderr == ""


def test_help_imports_neither_vllm_nor_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        from cli.main import app
        for args in SUBCOMMANDS:
            try:
                app([*args, "--help"])
            except SystemExit as e:
                assert e.code == 0, (args, e.code)
        heavy = ("vllm", "torch", "transformers", "matplotlib")
        print(sorted(m for m in heavy if m in sys.modules))
        """
    ).replace("SUBCOMMANDS", repr(SUBCOMMANDS))
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_bad_arguments_fail_before_any_engine_start() -> None:
    res = ladsd("replay", "--policy", "nope")
    assert res.returncode != 0
    assert "unknown policies" in res.stdout + res.stderr
    assert "Triton" not in res.stdout + res.stderr


# ---- table layouts (no engine) ------------------------------------------------

ROW = ("cache-first-noleases", "1", "8", "123.45", "130.00", "140.00", "0.001", "0.002")
ROW += ("0.003", "0.004", "24320", "8", "8", "0", "0", "0", "0", "12.50", "0.01")
RUN_GRID = grid.Grid(
    "Runs",
    ("policy", "seed", "wf", "mean s", "P95 s", "makespan s", "s-r", "c-s", "n-c", "f-n")
    + ("cached tok", "grants", "handoffs", "expiries", "revoked", "promoted", "preempted")
    + ("U·s", "ctrl CPU s"),
    (ROW, ("lads", "2", *ROW[2:]), ("fifo", "3", *ROW[2:]), ("size-first", "4", *ROW[2:])),
    keys=2,
)


def render(grids: list[grid.Grid], width: int) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None)
    for g in grids:
        for t in grid.rich_tables(g, width):
            con.print(t)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_run_grid_fits_every_width_with_every_cell_whole(width: int) -> None:
    out = render([RUN_GRID], width)
    assert_fits(out, width)
    for row in RUN_GRID.rows:
        assert row[0] in out and row[3] in out
    for cell in {*RUN_GRID.headers, *(c for r in RUN_GRID.rows for c in r)}:
        assert cell in out, cell  # every layout keeps every cell


def test_layouts_whole_when_wide_split_with_keys_when_narrow_transposed_for_one_row() -> None:
    assert grid.fit(RUN_GRID, 200) == [RUN_GRID]
    parts = grid.fit(RUN_GRID, 80)
    assert len(parts) > 1
    assert all(p.headers[:2] == ("policy", "seed") for p in parts)
    assert parts[0].headers[3] == "mean s"  # the first part has the mean latency
    assert all(grid.table_width(p) <= 80 for p in parts)
    assert [p.title for p in parts][:2] == [f"Runs (1/{len(parts)})", f"Runs (2/{len(parts)})"]
    one = grid.Grid("Runs", RUN_GRID.headers, RUN_GRID.rows[1:2], keys=2)
    (flipped,) = grid.fit(one, 80)
    assert flipped.headers == ("policy", "lads seed 2")
    assert ("mean s", "123.45") in flipped.rows


def test_table_width_is_what_rich_needs() -> None:
    for width in (grid.table_width(RUN_GRID), grid.table_width(RUN_GRID) - 1):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).print(grid.rich_table(RUN_GRID))
        cut = "…" in buf.getvalue()
        assert cut == (width < grid.table_width(RUN_GRID))


def test_markdown_does_not_depend_on_the_layout() -> None:
    md = grid.markdown([RUN_GRID])
    assert md.count("\n| ") == 2 + len(RUN_GRID.rows)  # header, rule, one line per row
    assert "| cache-first-noleases | 1 | 8 | 123.45 |" in md


# ---- progress (no engine) -------------------------------------------------------


def test_time_left_from_the_rate_since_the_first_call() -> None:
    assert time_left(1, 10.0, 1, 9, 12.0) is None  # no progress since the first point yet
    assert time_left(1, 10.0, 5, 9, 14.0) == pytest.approx(4.0)  # 4 calls in 4 s, 4 to go
    assert time_left(1, 10.0, 9, 9, 20.0) == 0.0
    assert [clock(s) for s in (0, 59.6, 61, 3725)] == ["0:00", "1:00", "1:01", "1:02:05"]


def test_run_progress_counts_finished_workflows() -> None:
    wfs = (SimpleNamespace(wid="a", calls=(1, 2)), SimpleNamespace(wid="b", calls=(1,)))
    wl = SimpleNamespace(workflows=wfs, continuations=3)
    con = Console(file=io.StringIO(), width=80)
    with RunProgress(con, "run 1/1 lads seed 1", wl) as p:
        for n, wid in enumerate(["a", "b", "a", "b", "a"], start=1):
            p(wid, n, 5)
        assert p.workflows_done == 2
        task = p._bar.tasks[0]
        assert task.completed == 5 and task.fields["status"] == "2/2 workflows"


# ---- log routing (subprocess: it moves file descriptor 2) ----------------------


def test_session_sends_engine_logs_and_raw_stderr_to_the_file_and_errors_to_the_terminal(
    tmp_path: Path,
) -> None:
    script = textwrap.dedent(
        """
        import logging, os, sys, warnings
        from ladsd import logs
        with logs.session("probe") as log:
            logging.getLogger("vllm.config").info("engine info line")
            logging.getLogger("vllm.worker").warning("engine warning line")
            os.write(2, b"raw C++ line on fd 2\\n")
            warnings.warn("a library FutureWarning", FutureWarning)
            logging.getLogger("vllm.engine").error("engine error line")
            logging.getLogger("ladsd.runner").warning("our own warning line")
            logs.to_file("failure detail for the file only")
            print("our result line")
            assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
        os.write(2, b"after the session\\n")
        print(log.path)
        """
    )
    env = {**os.environ, "LADSD_HOME": str(tmp_path)}
    for k in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL"):
        env.pop(k, None)
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert res.returncode == 0, res.stderr
    out, path = res.stdout.splitlines()
    assert out == "our result line"
    assert Path(path).parent == tmp_path / "logs"
    assert res.stderr.splitlines() == [
        "ERROR [vllm.engine] engine error line",
        "WARNING [ladsd.runner] our own warning line",
        "after the session",
    ]
    text = Path(path).read_text()
    for line in (
        "engine info line",
        "engine warning line",
        "raw C++ line on fd 2",
        "a library FutureWarning",
        "engine error line",
        "our own warning line",
        "failure detail for the file only",
    ):
        assert line in text, line


def test_verbose_session_shows_everything_on_stderr(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import logging, os
        from ladsd import logs
        with logs.session("probe", verbose=True):
            logging.getLogger("vllm.config").info("engine info line")
            os.write(2, b"raw C++ line on fd 2\\n")
        """
    )
    env = {**os.environ, "LADSD_HOME": str(tmp_path)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "INFO [vllm.config] engine info line" in res.stderr
    assert "raw C++ line on fd 2" in res.stderr


# ---- the real CLI on the smoke profile ------------------------------------------


@pytest.mark.engine
def test_replay_smoke_at_80_columns_is_quiet_and_shows_policy_and_mean(
    tmp_path: Path, model_ready: None
) -> None:
    runs = tmp_path / "runs.json"
    res = ladsd("replay", "--profile", "smoke", "--policy", "lads", "--json", str(runs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_quiet(res)
    assert_fits(res.stdout, 80)
    (rec,) = [events.from_dict(d) for d in orjson.loads(runs.read_bytes())]
    mean = f"{summary.mean_latency(rec):.2f}"
    assert f"lads seed 1: mean {mean} s" in res.stdout
    rows = table_lines(res.stdout)
    assert any("lads" in r for r in rows) and any("mean s" in r and mean in r for r in rows)
    log = engine_log(res.stdout)
    try:
        text = log.read_text()
        assert "[vllm." in text and "Initializing a V1 LLM engine" in text
    finally:
        log.unlink(missing_ok=True)


@pytest.mark.engine
def test_replay_smoke_verbose_shows_vllm_lines(tmp_path: Path, model_ready: None) -> None:
    res = ladsd("replay", "--profile", "smoke", "--policy", "lads", "-v", columns=200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[vllm." in res.stderr and "Initializing a V1 LLM engine" in res.stderr
    assert "[vllm." not in res.stdout  # the logs go to stderr; stdout stays ours
    assert_fits(res.stdout, 200)
    header = next(r for r in table_lines(res.stdout) if "mean s" in r)
    assert "policy" in header and "ctrl CPU s" in header  # the whole table at 200 columns
    engine_log(res.stdout).unlink(missing_ok=True)


@pytest.mark.engine
def test_compare_tables_fit_80_and_200_columns_and_show_progress_per_run(
    tmp_path: Path, model_ready: None
) -> None:
    out = tmp_path / "cmp"
    args = ("compare", "--profile", "smoke", "--policies", "fifo,lads", "--seeds", "1")
    args += ("--repeats", "1", "--out", str(out))
    first = ladsd(*args, columns=80)
    assert first.returncode == 0, first.stdout + first.stderr
    assert_quiet(first)
    assert "run 1/2 fifo seed 1: mean" in first.stdout
    assert "run 2/2 lads seed 1: mean" in first.stdout
    took = r"run 1/2 fifo seed 1: .*took \d+:\d\d; ~\d+:\d\d left for 1 run\)"
    assert re.search(took, first.stdout)
    runs = {p: [events.load(out / f"controlled-smoke-{p}-s1.json")] for p in ("fifo", "lads")}
    means = {registry.label(p): f"{summary.mean_latency(r[0]):.2f}" for p, r in runs.items()}
    md = (out / "controlled-smoke-table.md").read_text()
    engine_log(first.stdout).unlink(missing_ok=True)
    # Read back (no engine) at 200 columns: the same figures, the whole drivers table.
    again = ladsd(*args, columns=200)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "read back" in again.stdout
    assert (out / "controlled-smoke-table.md").read_text() == md
    assert "engine log" not in again.stdout  # nothing ran: vLLM not even imported
    for res, width in ((first, 80), (again, 200)):
        assert_fits(res.stdout, width)
        rows = table_lines(res.stdout)
        for name, mean in means.items():
            assert any(re.search(rf"│ {name} +│ +1 │ +{mean} │", r) for r in rows), (name, width)
            assert f"| {name} | 1 | {mean} |" in md
    wide_header = next(r for r in table_lines(again.stdout) if "budget denials" in r)
    assert "s-r" in wide_header and "kappa s" in wide_header


@pytest.mark.engine
def test_failed_engine_start_prints_vllms_message(model_ready: None) -> None:
    # Two KV blocks cannot hold one 4,096-token request: vLLM refuses to start.
    res = ladsd("replay", "--profile", "smoke", "--policy", "fifo", "--kv-blocks", "2")
    assert res.returncode == 1
    text = " ".join(res.stdout.split())  # undo rich's line wrapping
    assert "error:" in text and "To serve at least one request" in text
    log = Path(re.search(r"full log: (\S+)", text).group(1))
    try:
        assert "To serve at least one request" in log.read_text()  # with the traceback
    finally:
        log.unlink(missing_ok=True)
