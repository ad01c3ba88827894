"""`ladsd replay` and `ladsd compare` through the command line (smoke profile, real engine)."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest
from typer.testing import CliRunner

from cli.main import app
from ladsd.metrics import events, summary


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("replay", "--policy", "nope"), "unknown policies"),
        (("replay", "--seeds", "1,x"), "comma-separated integers"),
        (("replay", "--workload", "bogus"), "unknown workload"),
        (("compare", "--profile", "huge"), "unknown profile"),
    ],
)
def test_bad_arguments_fail_clearly_before_any_run(args, message) -> None:
    res = invoke(*args)
    assert res.exit_code != 0
    assert message in res.output


@pytest.mark.engine
def test_compare_writes_runs_table_plots_and_resumes(tmp_path, model_ready) -> None:
    out = tmp_path / "cmp"
    args = ("compare", "--profile", "smoke", "--workload", "controlled")
    args += ("--policies", "fifo,lads", "--seeds", "1", "--repeats", "2", "--out", str(out))
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    runs = {
        (p, r): out / f"controlled-smoke-{p}-s1{'' if r == 1 else '-r2'}.json"
        for p in ("fifo", "lads")
        for r in (1, 2)
    }
    order = {}
    for (p, r), f in runs.items():
        rec = events.load(f)
        assert rec.policy == p and rec.seed == 1 and rec.meta["repeat"] == r
        assert rec.meta["config"]["profile"]["name"] == "smoke" and rec.meta["git"]
        order[(p, r)] = rec.meta["order_position"]
        summary.audit(rec)
    # The second block runs the policies in the rotated order.
    assert order == {("fifo", 1): 0, ("lads", 1): 1, ("fifo", 2): 1, ("lads", 2): 0}
    md = (out / "controlled-smoke-table.md").read_text()
    assert "| LADS vs FIFO |" in md and "What drives it" in md
    assert "Noise floor: A/A pairs" in md and "| FIFO repeat 2 vs 1 |" in md
    assert "repeat spread %" in md
    for plot in ("cdf", "stages", "lease-timeline"):
        assert (out / f"controlled-smoke-{plot}.png").stat().st_size > 0
    # A second call reads the finished runs back instead of running them again.
    stamp = {k: f.stat().st_mtime_ns for k, f in runs.items()}
    again = invoke(*args)
    assert again.exit_code == 0, again.output
    assert {k: f.stat().st_mtime_ns for k, f in runs.items()} == stamp
    assert (out / "controlled-smoke-table.md").read_text() == md
    # A resume under another configuration is refused, naming what differs.
    other = invoke(*args, "--kv-blocks", "200")
    assert other.exit_code != 0
    assert "was made with" in other.output and "kv_blocks" in other.output
    # A run file of another commit re-renders, but no run is added beside it: a pass
    # is one frozen code (a stored run under the same policy name may be another rule).
    f = runs[("lads", 1)]
    rec = events.load(f)
    events.save(replace(rec, meta={**rec.meta, "git": "0" * 40 + "+dirty"}), f)
    assert invoke(*args).exit_code == 0
    more = invoke(*(a if a != "1" else "1,2" for a in args))  # --seeds 1,2
    assert more.exit_code != 0
    assert "one pass is one frozen code" in more.output and "0000000" in more.output
    assert not (out / "controlled-smoke-fifo-s2.json").exists()


@pytest.mark.engine
def test_replay_json_holds_every_seed(tmp_path, model_ready) -> None:
    path = tmp_path / "runs.json"
    res = invoke(
        "replay", "--profile", "smoke", "--policy", "lads", "--seeds", "1,2", "--json", str(path)
    )
    assert res.exit_code == 0, res.output
    assert "audit ok" in res.output
    recs = [events.from_dict(d) for d in orjson.loads(path.read_bytes())]
    assert [(r.policy, r.seed) for r in recs] == [("lads", 1), ("lads", 2)]
