"""One link dilation per pass, applied to every time constant (ladsd.workloads.dilation).

Unit tests on the scaling (no engine); then the real engine and CLI: a dilated run's
engine, policy, link and cohorts use the scaled constants, and a compare measures one
dilation and gives it to every run of its folder.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from cli import replay as replay_cmd
from cli.main import app
from ladsd.config import PROFILES, Profile, kappa_ref
from ladsd.engine import cpu
from ladsd.metrics import events, summary
from ladsd.workloads import dilation as dil
from ladsd.workloads import runner
from ladsd.workloads.factory import make

SMOKE = PROFILES["smoke"]
CPU = PROFILES["cpu"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ---- the scaling (no engine) ---------------------------------------------------------


def test_a_dilated_profile_scales_every_time_constant_and_the_link() -> None:
    slow = dil.dilated(CPU, 2.5)
    assert slow.link.rate_bytes_per_s == pytest.approx(CPU.link.rate_bytes_per_s / 2.5)
    assert slow.lease.lease_lifetime_s == pytest.approx(2.5 * CPU.lease.lease_lifetime_s)
    assert slow.lease.tick_s == pytest.approx(2.5 * CPU.lease.tick_s)
    assert slow.lease.record_max_age_s == pytest.approx(2.5 * CPU.lease.record_max_age_s)
    assert slow.peers.guard_s == pytest.approx(2.5 * CPU.peers.guard_s)
    w, w0 = slow.workload, CPU.workload
    assert w.cohort_limit_s == pytest.approx(2.5 * w0.cohort_limit_s)
    assert w.cohort_gap_s == pytest.approx(2.5 * w0.cohort_gap_s)
    assert w.arrival_spread_s == pytest.approx(2.5 * w0.arrival_spread_s)
    # Token quantities, pool and H stay.
    assert slow.engine == CPU.engine and slow.lease.headroom_blocks == CPU.lease.headroom_blocks
    assert w.history_tokens == w0.history_tokens and slow.lease.theta == CPU.lease.theta
    assert dil.dilated(CPU, 1.0) is CPU


def test_a_dilated_workload_scales_arrivals_tool_times_and_cohort_timeout() -> None:
    wl = make("captured", SMOKE, 1)
    wl = replace(wl, rate_bytes_per_s=6000.0)
    slow = dil.dilated_workload(wl, 3.0)
    assert slow.cohort_limit_s == pytest.approx(3 * wl.cohort_limit_s)
    assert slow.cohort_gap_s == pytest.approx(3 * wl.cohort_gap_s)
    assert slow.rate_bytes_per_s == pytest.approx(2000.0)
    for a, b in zip(wl.workflows, slow.workflows, strict=True):
        assert b.arrival == pytest.approx(3 * a.arrival)
        assert [c.tool_seconds * 3 for c in a.calls] == pytest.approx(
            [c.tool_seconds for c in b.calls]
        )
        assert [c.observation for c in a.calls] == [c.observation for c in b.calls]
        assert b.prompt_ids == a.prompt_ids
    assert any(c.tool_seconds > 0 for w in wl.workflows for c in w.calls)


def test_kappa_ref_is_per_dtype() -> None:
    assert kappa_ref(CPU, "bfloat16") == CPU.kappa_ref_s
    assert kappa_ref(CPU, "float32") == CPU.kappa_ref_float32_s
    assert CPU.kappa_ref_float32_s is not None and CPU.kappa_ref_float32_s != CPU.kappa_ref_s
    assert kappa_ref(CPU, "float16") is None and kappa_ref(SMOKE, "bfloat16") is None


def test_a_pass_file_round_trips_and_refuses_another_cpu_or_profile(tmp_path: Path) -> None:
    model = cpu.cpu_info().model
    pd = dil.PassDilation(
        1.25, "measured", 0.0425, 0.034, "bfloat16", "cpu", CPU.engine.model, model, ("avx2",)
    )
    dil.save(pd, tmp_path)
    back = dil.load(tmp_path)
    assert back == pd
    back.check(CPU, tmp_path / dil.FILE)  # same profile, model and CPU: fine
    with pytest.raises(dil.DilationMismatch, match="profile"):
        back.check(SMOKE, tmp_path / dil.FILE)
    with pytest.raises(dil.DilationMismatch, match="cpu_model"):
        replace(back, cpu_model="AMD EPYC 7B13").check(CPU, tmp_path / dil.FILE)
    # A profile without a kappa reference runs at 1.0 on every CPU: its file (no CPU
    # recorded) takes more runs anywhere (it refused every resume that added runs).
    dil.none(SMOKE).check(SMOKE, tmp_path / dil.FILE)
    with pytest.raises(dil.DilationMismatch, match="profile"):  # but only for its profile
        dil.none(SMOKE).check(CPU, tmp_path / dil.FILE)
    (tmp_path / dil.FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a pass dilation file"):
        dil.load(tmp_path)
    with pytest.raises(ValueError, match="positive"):
        dil.given(CPU, 0.0)


def test_adding_runs_refuses_a_file_made_at_another_dilation(tmp_path: Path) -> None:
    import typer

    pd = dil.given(CPU, 1.5)
    rec = events.RunRecord("fifo", "controlled", "cpu", 1, ())
    same = replace(rec, meta={"dilation": 1.5, "dilation_pass": pd.meta()})
    replay_cmd.check_dilation(same, pd, tmp_path / "a.json")
    for meta in ({"dilation": 1.2, "dilation_pass": {}}, {"dilation": 1.5}):  # per-run: old
        with pytest.raises(typer.BadParameter, match="one pass has one dilation"):
            replay_cmd.check_dilation(replace(rec, meta=meta), pd, tmp_path / "a.json")


@pytest.mark.parametrize(
    ("made", "here", "refused"),
    [
        ("a" * 40, "a" * 40, False),
        ("a" * 40 + "+dirty", "a" * 40, False),  # uncommitted edits cannot be told apart
        ("a" * 40, "b" * 40, True),
        ("a" * 40 + "+dirty", "b" * 40 + "+dirty", True),
        (None, "b" * 40, False),  # older files recorded no commit
        ("unknown", "b" * 40, False),  # made outside git
        ("a" * 40, "unknown", False),  # this checkout is outside git
    ],
)
def test_adding_runs_refuses_a_file_made_at_another_commit(
    tmp_path: Path, made: str | None, here: str, refused: bool
) -> None:
    import typer

    meta = {} if made is None else {"git": made}
    rec = events.RunRecord("fifo", "controlled", "cpu", 1, (), meta=meta)
    if refused:
        with pytest.raises(typer.BadParameter, match="one pass is one frozen code"):
            replay_cmd.check_commit(rec, here, tmp_path / "a.json")
    else:
        replay_cmd.check_commit(rec, here, tmp_path / "a.json")


# ---- the real engine -----------------------------------------------------------------


@pytest.mark.engine
async def test_a_dilated_run_scales_l_tick_record_age_cohort_timeout_and_arrivals(
    monkeypatch: pytest.MonkeyPatch, model_ready
) -> None:
    seen: dict[str, object] = {}
    real_open, real_cohorts = runner.open_runtime, runner.Cohorts

    def open_spy(*a, **kw):
        cm = real_open(*a, **kw)

        class Spy:
            async def __aenter__(self):
                seen["rt"] = rt = await cm.__aenter__()
                return rt

            async def __aexit__(self, *exc):
                return await cm.__aexit__(*exc)

        return Spy()

    def cohorts_spy(members, gap, limit):
        seen["cohort"] = (gap, limit)
        return real_cohorts(members, gap, limit)

    monkeypatch.setattr(runner, "open_runtime", open_spy)
    monkeypatch.setattr(runner, "Cohorts", cohorts_spy)
    d = 2.0
    wl = make("controlled", SMOKE, 1)
    rec = await runner.run(wl, SMOKE, "lads", dilation=dil.given(SMOKE, d))
    summary.audit(rec)
    rt = seen["rt"]
    lease = rt.engine.lease  # what the engine's lease provider runs with
    assert lease.lease_lifetime_s == pytest.approx(d * SMOKE.lease.lease_lifetime_s)
    assert lease.tick_s == pytest.approx(d * SMOKE.lease.tick_s)
    assert rt.policy.max_age_s == pytest.approx(d * SMOKE.lease.record_max_age_s)
    assert rt.link.rate_bytes_per_s == pytest.approx(SMOKE.link.rate_bytes_per_s / d)
    assert seen["cohort"] == pytest.approx((d * wl.cohort_gap_s, d * wl.cohort_limit_s))
    # Workflows arrive at the dilated times (never before them; clock granularity aside).
    by_id = {w.wid: w for w in wl.workflows}
    for f in rec.workflows:
        assert f.arrival >= d * by_id[f.workflow].arrival - 1e-3
    assert max(f.arrival for f in rec.workflows) > max(w.arrival for w in wl.workflows)
    # The file says what scaled, and keeps the run's own kappa beside the pass's.
    m = rec.meta
    assert m["dilation"] == d and m["dilation_pass"]["source"] == "given"
    assert m["time_constants"]["lease_lifetime_s"] == pytest.approx(d * 8.0)
    assert m["time_constants"]["cohort_limit_s"] == pytest.approx(d * wl.cohort_limit_s)
    assert m["kappa_s"] > 0 and m["cpu_model"] and isinstance(m["cpu_flags"], list)
    assert m["profile"]["lease"]["lease_lifetime_s"] == SMOKE.lease.lease_lifetime_s  # as asked
    assert m["inputs"]["rate_bytes_per_s"] == wl.rate_bytes_per_s


def _with_reference(prof: Profile, kappa: float) -> Profile:
    return replace(prof, kappa_ref_s=kappa, kappa_ref_float32_s=kappa)


@pytest.mark.engine
def test_a_compare_pass_measures_one_dilation_and_applies_it_to_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_ready
) -> None:
    import asyncio

    # The smoke engine's own kappa as its reference: the pass's dilation is near 1.
    probe = asyncio.run(dil.measure(_with_reference(SMOKE, 1.0)))
    assert probe.source == "measured" and probe.kappa_s and probe.kappa_s > 0
    assert probe.dilation == pytest.approx(probe.kappa_s)  # reference 1 s
    monkeypatch.setitem(PROFILES, "smoke", _with_reference(SMOKE, probe.kappa_s))
    calls = []
    real = dil.measure

    async def counted(prof: Profile, probes: int = 1) -> dil.PassDilation:
        calls.append(prof.name)
        assert probes == dil.PASS_PROBES  # a compare pass takes the median of several
        return await real(prof, probes)

    monkeypatch.setattr(dil, "measure", counted)
    out = tmp_path / "pass"
    args = ("compare", "--profile", "smoke", "--workload", "controlled", "--seeds", "1")
    args += ("--repeats", "1", "--out", str(out))
    res = invoke(*args, "--policies", "fifo,lads")
    assert res.exit_code == 0, res.output
    assert calls == ["smoke"]
    assert "one for every run of this pass" in " ".join(res.output.split())  # rich wraps
    pd = orjson.loads((out / dil.FILE).read_bytes())
    assert pd["source"] == "measured" and pd["cpu_model"] == cpu.cpu_info().model
    assert len(pd["kappa_probes"]) == dil.PASS_PROBES
    assert pd["kappa_s"] == pytest.approx(statistics.median(pd["kappa_probes"]))
    # A resume that adds a policy measures nothing: the folder's pass dilation.
    res = invoke(*args, "--policies", "fifo,lads,cache-first")
    assert res.exit_code == 0, res.output
    assert calls == ["smoke"]
    recs = [events.load(p) for p in sorted(out.glob("controlled-smoke-*-s1.json"))]
    assert sorted(r.policy for r in recs) == ["cache-first", "fifo", "lads"]
    for r in recs:
        assert r.meta["dilation"] == pd["dilation"]  # one per pass, not each run's own
        assert r.meta["dilation_pass"]["kappa_s"] == pd["kappa_s"]
        assert r.meta["run_dilation"] == pytest.approx(r.meta["kappa_s"] / probe.kappa_s)
        tc = r.meta["time_constants"]
        assert tc["lease_lifetime_s"] == pytest.approx(8.0 * pd["dilation"])
        assert tc["tick_s"] == pytest.approx(0.1 * pd["dilation"])
    # Another dilation in the same folder is refused before anything runs.
    res = invoke(*args, "--policies", "fifo,lads,size-first", "--dilation", "3")
    assert res.exit_code != 0 and "would mix two in one pass" in " ".join(res.output.split())
