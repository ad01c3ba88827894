"""Workload construction and cohort tool service (no engine)."""

from __future__ import annotations

import asyncio

import pytest

from ladsd.config import PROFILES
from ladsd.workloads import controlled
from ladsd.workloads.cohort import Cohorts
from ladsd.workloads.factory import make

ARCHIVE = [f"archived page {i} ".encode() * 20 for i in range(12)]


def test_controlled_is_deterministic_per_seed_and_varies_across_seeds():
    cfg = PROFILES["cpu"].workload
    a = controlled.build(cfg, 1, ARCHIVE)
    b = controlled.build(cfg, 1, ARCHIVE)
    c = controlled.build(cfg, 2, ARCHIVE)
    assert a == b
    assert a != c
    assert len(a.workflows) == 16 and a.continuations == 80


def test_controlled_history_sizes_and_cohorts():
    cfg = PROFILES["cpu"].workload
    wl = controlled.build(cfg, 3, ARCHIVE, cohort=8)
    sizes = sorted(len(w.prompt_ids) for w in wl.workflows)
    assert sizes == sorted(list(cfg.history_tokens) * 4)
    assert [w.cohort for w in wl.workflows] == [0] * 8 + [1] * 8
    assert all(c.output_tokens == 64 for w in wl.workflows for c in w.calls)
    # no two workflows share a first block: leases and caching are per workflow
    firsts = {w.prompt_ids[:32] for w in wl.workflows}
    assert len(firsts) == 16
    arrivals = [w.arrival for w in wl.workflows]
    assert (
        arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] <= cfg.arrival_spread_s
    )


def test_controlled_rejects_empty_archive():
    with pytest.raises(ValueError, match="archive"):
        controlled.build(PROFILES["cpu"].workload, 1, [])


async def test_cohort_releases_together_after_last_start():
    loop = asyncio.get_running_loop()
    co = Cohorts({0: 3}, gap=0.05, limit=10.0)
    done: dict[int, float] = {}
    started: dict[int, float] = {}

    async def member(i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        started[i] = loop.time()
        await co.tool(0, 1)
        done[i] = loop.time()
        assert len(started) == 3  # nobody completes before the last member started

    await asyncio.gather(member(0, 0.0), member(1, 0.02), member(2, 0.1))
    assert min(done.values()) >= max(started.values()) + 0.05
    assert co.partial_releases == 0


async def test_cohort_partial_release_after_limit_and_leave():
    co = Cohorts({0: 3}, gap=0.01, limit=0.1)
    await asyncio.wait_for(asyncio.gather(co.tool(0, 1), co.tool(0, 1)), 2)
    assert co.partial_releases == 1
    late = asyncio.create_task(co.tool(0, 1))  # started after the release: alone
    await asyncio.wait_for(late, 1)
    # a member that terminated no longer holds its cohort back
    co.leave(0)
    await asyncio.wait_for(asyncio.gather(co.tool(0, 2), co.tool(0, 2)), 1)
    assert co.partial_releases == 1


def test_run_inputs_record_the_workload_as_built_not_the_profile_defaults() -> None:
    """Run files say which cohorts were run (the profile's cohort is only a default)."""
    from ladsd.workloads.runner import inputs_dict

    cpu = PROFILES["cpu"]
    c8 = inputs_dict(make("controlled", cpu, 1))
    assert c8["cohort_sizes"] == [8, 8] and c8["continuations"] == 80
    assert inputs_dict(make("controlled", cpu, 1, cohort=16))["cohort_sizes"] == [16]
    assert inputs_dict(make("web-burst", cpu, 1))["cohort_sizes"] == [16]
    cap = inputs_dict(make("captured", cpu, 2))
    assert cap["cohort_sizes"] == [] and cap["codec"] == "gzip6" and cap["seed"] == 2
    assert cap["rate_bytes_per_s"] == 6000.0


def test_captured_scaled_grows_first_prompts_and_keeps_the_paths() -> None:
    """The scaled variant: first prompts at the profile's sizes, paths and arrivals as recorded."""
    cpu = PROFILES["cpu"]
    plain, scaled = make("captured", cpu, 2), make("captured-scaled", cpu, 2)
    assert scaled.name == "captured-scaled" and plain.name == "captured"
    assert len(plain.workflows) == len(scaled.workflows) == 16
    sizes = sorted(len(w.prompt_ids) for w in scaled.workflows)
    assert sizes == sorted(list(cpu.workload.history_tokens) * 4)
    for p, s in zip(plain.workflows, scaled.workflows, strict=True):
        assert s.prompt_ids[-len(p.prompt_ids) :] == p.prompt_ids  # recorded prompt kept at the end
        assert (s.wid, s.arrival, s.calls) == (p.wid, p.arrival, p.calls)
    # no two scaled workflows share a first block (the recorded system prompt is behind the padding)
    assert len({w.prompt_ids[:32] for w in scaled.workflows}) == 16
    assert make("captured-scaled", cpu, 2) == scaled
    assert make("captured-scaled", cpu, 3) != scaled
