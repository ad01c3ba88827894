"""The peers in runs, comparisons and tables: run names, flags, --peers, peer tables, one replay."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from cli import replay as replay_cmd
from cli.main import app
from ladsd.config import PROFILES, PeerConfig
from ladsd.delivery import hear
from ladsd.delivery.registry import RunName
from ladsd.metrics import comparison, events, grid, peer_compare, summary
from ladsd.metrics.events import RunRecord
from ladsd.modes import EnginePolicy
from ladsd.sizing import engine_for
from ladsd.wiring import policy_for
from ladsd.workloads import plan
from tests.rigs.runs import run

VLLM, AUG = EnginePolicy.VLLM, EnginePolicy.AUGSERVE


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ---------------------------------------------------------------- run names


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("lads", ("lads", VLLM)),
        ("infinite-cache", ("infinite-cache", VLLM)),
        ("ttl-pin", ("ttl-pin", VLLM)),
        ("augserve", ("fifo", AUG)),
        ("augserve+lads", ("lads", AUG)),
        ("augserve+hear-guard", ("hear-guard", AUG)),
    ],
)
def test_run_name_maps_to_delivery_and_engine_policy_and_back(name, parts) -> None:
    run = RunName.parse(name)
    assert (run.delivery, run.engine) == parts
    assert str(RunName(*parts)) == name


def test_unknown_run_names_are_refused_naming_the_bad_part() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        RunName.parse("nope")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        RunName.parse("augserve+nope")
    with pytest.raises(ValueError, match="unknown engine policy 'sglang'"):
        RunName.parse("sglang+lads")


def test_engine_option_applies_to_names_without_their_own_engine() -> None:
    assert plan.with_engine("lads", AUG) == "augserve+lads"
    assert plan.with_engine("fifo", AUG) == "augserve"
    assert plan.with_engine("augserve+lads", VLLM) == "augserve+lads"
    assert plan.with_engine("vllm+lads", AUG) == "lads"  # canonical: the default engine unnamed
    assert replay_cmd.parse_policies("fifo,lads,augserve", AUG) == ["augserve", "augserve+lads"]


# ---------------------------------------------------------------- flags and configs


def test_engine_policy_is_recorded_in_flags_only_when_not_the_default() -> None:
    flags = replay_cmd.compare_flags(8, None, None)
    assert flags == {"cohort": 8}
    assert plan.run_flags(flags, "lads") == {"cohort": 8}
    assert plan.run_flags(flags, "hear-guard") == {"cohort": 8}
    assert plan.run_flags(flags, "augserve+lads") == {"cohort": 8, "engine_policy": "augserve"}
    prof = PROFILES["smoke"]
    # A run file made before engine policies existed matches a default-engine run ...
    old = plan.config(prof, "controlled", 1, {"cohort": 8})
    plan.check(old, plan.config(prof, "controlled", 1, plan.run_flags(flags, "lads")), Path("f"))
    # ... and not one on another engine policy.
    aug = plan.config(prof, "controlled", 1, plan.run_flags(flags, "augserve+lads"))
    with pytest.raises(plan.ConfigMismatch, match="flags.engine_policy"):
        plan.check(old, aug, Path("f"))


def test_peer_knobs_enter_the_config_only_when_a_profile_changes_them() -> None:
    prof = PROFILES["smoke"]
    assert "peers" not in plan.config(prof, "controlled", 1, {})["profile"]
    guarded = dataclasses.replace(prof, peers=PeerConfig(guard_s=3.0))
    want = plan.config(guarded, "controlled", 1, {})
    assert want["profile"]["peers"] == {"guard_s": 3.0}
    with pytest.raises(plan.ConfigMismatch, match="peers"):
        plan.check(plan.config(prof, "controlled", 1, {}), want, Path("f"))


def test_policy_for_passes_the_profiles_guard() -> None:
    assert PeerConfig().guard_s == hear.GUARD_S  # one default: the profile's is HEAR's
    prof = dataclasses.replace(PROFILES["smoke"], peers=PeerConfig(guard_s=3.0))
    assert policy_for(prof, "hear-guard").guard_s == 3.0
    assert policy_for(prof, "lads").name == "lads"  # a policy without a guard ignores it


def test_augserve_engine_gets_a_step_buffer_its_budget_can_fill() -> None:
    prof = PROFILES["cpu"]
    assert engine_for(prof, "lads") is prof  # vLLM's scheduler: the profile's fixed 512
    aug = engine_for(prof, "lads", AUG)
    assert (prof.engine.max_num_batched_tokens, aug.engine.max_num_batched_tokens) == (512, 1024)
    both = engine_for(prof, "infinite-cache", AUG)
    assert both.engine.max_num_batched_tokens == 1024
    assert (
        both.engine.num_gpu_blocks_override
        == engine_for(prof, "infinite-cache").engine.num_gpu_blocks_override
    )


# ---------------------------------------------------------------- --peers


def test_peers_join_the_list_once_per_seed_with_run_name_files() -> None:
    names = plan.with_peers(replay_cmd.parse_policies("fifo,lads,augserve"))
    assert names == ["fifo", "lads", "augserve", *(p for p in plan.PEERS if p != "augserve")]
    slots = plan.plan(names, [1, 2], 2, Path("o"), "t")
    for p in plan.PEERS:  # peers are not core: one run per seed
        assert sorted(s.seed for s in slots if s.policy == p) == [1, 2]
    assert len([s for s in slots if s.policy == "lads"]) == 4
    assert Path("o/t-augserve+lads-s2.json") in {s.path for s in slots}
    # Only peers (e.g. --engine-policy augserve --policies fifo,lads): each once per seed.
    only = plan.plan(["augserve", "augserve+lads"], [1, 2], 2, Path("o"), "t")
    assert [(s.seed, s.policy, s.repeat) for s in only] == [
        (1, "augserve", 1),
        (1, "augserve+lads", 1),
        (2, "augserve+lads", 1),
        (2, "augserve", 1),
    ]


def test_cli_options_are_documented_and_checked_before_any_run() -> None:
    assert "--engine-policy" in invoke("replay", "--help").output
    helptext = invoke("compare", "--help").output
    assert "--peers" in helptext and "--engine-policy" in helptext
    assert "--engine-policy" in invoke("serve", "--help").output
    for cmd in ("replay", "compare", "serve"):
        res = invoke(cmd, "--engine-policy", "sglang")
        assert res.exit_code != 0 and "unknown engine policy" in res.output
    res = invoke("replay", "--policy", "augserve+nope")
    assert res.exit_code != 0 and "unknown policies" in res.output


# ---------------------------------------------------------------- tables


def _rep(r: RunRecord, k: int) -> RunRecord:
    return dataclasses.replace(r, meta={**r.meta, "repeat": k})


def _peer_runs() -> dict[str, list[RunRecord]]:
    """LADS twice per seed (A/A), three peers once; latencies by hand."""
    runs = {
        "lads": [
            _rep(run("lads", 1, [50.0, 50.0], preemptions=1), 1),
            _rep(run("lads", 1, [60.0, 60.0], preemptions=3), 2),
            _rep(run("lads", 2, [40.0, 40.0]), 1),
            _rep(run("lads", 2, [40.0, 40.0]), 2),
        ],
        "augserve": [run("augserve", 1, [110.0, 110.0]), run("augserve", 2, [80.0, 80.0])],
        "ttl-pin": [run("ttl-pin", 1, [55.0, 55.0]), run("ttl-pin", 2, [40.0, 40.0])],
        "fifo": [run("fifo", 1, [100.0, 100.0]), run("fifo", 2, [100.0, 100.0])],
    }
    return {p: summary.group(rs)[p] for p, rs in runs.items()}


def test_peer_table_from_hand_built_runs() -> None:
    peer = peer_compare.peer_comparison(_peer_runs())
    assert peer is not None
    assert [r.policy for r in peer.rows] == ["augserve", "ttl-pin", "lads"]
    lads = peer.rows[-1]
    # seed means 55 and 40 -> 47.5; preemptions (1 + 3) / 2 = 2 then 0 -> 1
    assert (lads.mean_s, lads.preemptions) == (47.5, 1.0)
    # vs AugServe: 100*(110-55)/110 = 50.0, 100*(80-40)/80 = 50.0; vs TTL pin: 0.0 and 0.0
    assert peer.reductions["augserve"].mean == pytest.approx(50.0)
    assert peer.reductions["ttl-pin"].per_seed == {1: 0.0, 2: 0.0}
    # A/A floor of LADS: |100*(50-60)/50| = 20 on seed 1, 0 on seed 2 -> 10
    assert peer.floor == {"augserve": pytest.approx(10.0), "ttl-pin": pytest.approx(10.0)}
    grids = peer_compare.peer_grids(peer)
    md = grid.markdown(grids)
    assert "| AugServe | 2 | 95.00 | 95.00 | 96.00 | 192 | 0 |" in md
    assert "| AugServe | 50.0 | 10.0 | 50.0 | 50.0 | 4/4 |" in md
    assert "| TTL pin | 0.0 | 10.0 | 0.0 | 0.0 | 0/4 |" in md
    # The yardstick table covers every policy compared, FIFO too.
    assert set(peer.yardsticks) == {"fifo", "lads", "augserve", "ttl-pin"}
    assert peer.yardsticks["augserve"]["batch_completion_s"] == pytest.approx(96.0)
    assert "P50 TTFT s (HEAR)" in md and "| FIFO |" in md
    for g in grids:  # the terminal layout fits 80 columns
        assert all(grid.table_width(part) <= 80 for part in grid.fit(g, 80))
    doc = orjson.loads(orjson.dumps(peer_compare.peer_dict(peer)))
    assert doc["reductions"]["augserve"]["per_seed"] == {"1": 50.0, "2": 50.0}
    assert doc["reductions"]["augserve"]["aa_floor"] == pytest.approx(10.0)


def test_runs_without_peers_have_no_peer_tables() -> None:
    runs = _peer_runs()
    core = {p: runs[p] for p in ("fifo", "lads")}
    assert peer_compare.peer_comparison(core) is None
    # Peers sort after the core policies: the core rows keep their place.
    rows = comparison.compare(runs).rows
    assert [r.policy for r in rows] == ["fifo", "lads", "augserve", "ttl-pin"]


# ---------------------------------------------------------------- serve


def test_serve_reports_only_idle_sessions_with_calls_as_completed_workflows() -> None:
    from ladsd.serve.daemon import completed
    from ladsd.serve.sessions import Session

    s = Session("a", 1, created=0.0, last_used=0.0, turn=3, ended_by="delete")
    assert completed(s, draining=False)
    assert not completed(s, draining=True)  # ended by the shutdown
    assert not completed(dataclasses.replace(s, busy=True), draining=False)  # client went away
    assert not completed(dataclasses.replace(s, turn=0), draining=False)  # never called


# ---------------------------------------------------------------- one run end to end


@pytest.mark.engine
def test_replay_a_peer_through_the_cli_ends_with_a_balanced_audit(tmp_path, model_ready) -> None:
    """One run: ttl-pin delivery on the augserve engine policy, option to engine."""
    path = tmp_path / "runs.json"
    args = ("replay", "--profile", "smoke", "--policy", "ttl-pin", "--engine-policy", "augserve")
    res = invoke(*args, "--json", str(path))
    assert res.exit_code == 0, res.output
    assert "augserve+ttl-pin seed 1" in res.output and "audit ok" in res.output
    (rec,) = [events.from_dict(d) for d in orjson.loads(path.read_bytes())]
    assert rec.policy == "augserve+ttl-pin"
    assert (rec.meta["delivery_policy"], rec.meta["engine_policy"]) == ("ttl-pin", "augserve")
    assert rec.counters["augserve_steps"] > 0  # the AugServe scheduler ran the engine
    assert rec.counters["pins"] > 0  # ttl-pin pinned the waiting histories ...
    assert rec.counters["refs_added"] > 0
    summary.audit(rec)  # ... and every reference, pins included, was released
