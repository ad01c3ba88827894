"""One sizing path (ladsd.sizing) and the dilation at the depth that builds the runtime.

Model-free: a stand-in for the engine thread records what the run would build it
with and stops there, so each case costs a workload build, not an engine start
(the ``cpu`` profile's pool rule reads the prepared tokenizer, no weights).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

import ladsd.wiring as wiring_mod
from ladsd.config import PROFILES, EngineConfig, LeaseConfig
from ladsd.modes import EnginePolicy
from ladsd.workloads import dilation as dil
from ladsd.workloads import runner
from ladsd.workloads.factory import WORKLOADS, make

RUNS = ("fifo", "lads", "infinite-cache", "augserve", "augserve+lads")
Pinned = tuple[int | None, int, int, bool]  # pool, H, step tokens, leases on

# Today's numbers (pinned before the sizing moved into one module): per profile and
# workload (seed 1), the pool, H, max_num_batched_tokens and leases-on each run name's
# engine is built with.
_PAPER = {
    "fifo": (12315, 2048, 512, False),
    "lads": (12315, 2048, 512, True),
    "infinite-cache": (126976, 2048, 512, False),
    "augserve": (12315, 2048, 1024, False),
    "augserve+lads": (12315, 2048, 1024, True),
}
_EIGHTH = {
    "fifo": (1150, 128, 512, False),
    "lads": (1150, 128, 512, True),
    "infinite-cache": (7936, 128, 512, False),
    "augserve": (1150, 128, 1024, False),
    "augserve+lads": (1150, 128, 1024, True),
}
_SMOKE = {
    "fifo": (160, 8, 512, False),
    "lads": (160, 8, 512, True),
    "infinite-cache": (224, 8, 512, False),
    "augserve": (160, 8, 1024, False),
    "augserve+lads": (160, 8, 1024, True),
}


def _cpu(pool: int, h: int) -> dict[str, Pinned]:
    return {
        "fifo": (pool, h, 512, False),
        "lads": (pool, h, 512, True),
        "infinite-cache": (15872, 382, 512, False),
        "augserve": (pool, h, 1024, False),
        "augserve+lads": (pool, h, 1024, True),
    }


PINNED: dict[tuple[str, str], dict[str, Pinned]] = {
    **{("paper", w): _PAPER for w in WORKLOADS},
    **{("cpu-eighth", w): _EIGHTH for w in WORKLOADS},
    **{("smoke", w): _SMOKE for w in WORKLOADS},
    ("cpu", "controlled"): _cpu(1868, 311),
    ("cpu", "web-burst"): _cpu(1879, 312),
    ("cpu", "captured"): _cpu(672, 112),
    ("cpu", "captured-scaled"): _cpu(1982, 330),
}


class Built(Exception):
    """The stand-in engine was built: what it was built with."""

    def __init__(self, cfg: EngineConfig, lease: LeaseConfig, kw: dict[str, Any]) -> None:
        super().__init__("built")
        self.cfg, self.lease, self.kw = cfg, lease, kw


class NoEngine:
    """Stands in for EngineThread: records its arguments and stops the run there."""

    def __init__(self, cfg: EngineConfig, lease: LeaseConfig, **kw: Any) -> None:
        raise Built(cfg, lease, kw)


def built_by_replay(monkeypatch: pytest.MonkeyPatch, prof: Any, workload: Any, run: str) -> Built:
    monkeypatch.setattr(wiring_mod, "EngineThread", NoEngine)
    with pytest.raises(runner.RunFailed) as e:
        asyncio.run(runner.run(workload, prof, run, dilation=dil.given(prof, 1.0)))
    assert isinstance(e.value.__cause__, Built), e.value
    return e.value.__cause__


def pinned(b: Built) -> Pinned:
    c, lease = b.cfg, b.lease
    return (
        c.num_gpu_blocks_override,
        lease.headroom_blocks,
        c.max_num_batched_tokens,
        lease.enabled,
    )


@pytest.mark.parametrize("key", sorted(PINNED))
def test_replay_engines_keep_todays_pool_h_and_step(
    monkeypatch: pytest.MonkeyPatch, key: tuple[str, str]
) -> None:
    pname, wname = key
    prof = PROFILES[pname]
    wl = make(wname, prof, 1)
    got = {run: pinned(built_by_replay(monkeypatch, prof, wl, run)) for run in RUNS}
    assert got == PINNED[key]
    # Nothing else of the engine config moves.
    b = built_by_replay(monkeypatch, prof, wl, "lads")
    assert replace(b.cfg, num_gpu_blocks_override=None) == replace(
        prof.engine, num_gpu_blocks_override=None
    )


def test_an_explicit_pool_keeps_todays_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.replay import _profile

    prof = _profile("cpu", 2300)  # bench/paper_cpu.sh's captured-scaled pool
    wl = make("captured-scaled", prof, 1)
    got = {run: pinned(built_by_replay(monkeypatch, prof, wl, run)) for run in RUNS}
    assert got == {
        "fifo": (2300, 382, 512, False),
        "lads": (2300, 382, 512, True),
        "infinite-cache": (15872, 382, 512, False),
        "augserve": (2300, 382, 1024, False),
        "augserve+lads": (2300, 382, 1024, True),
    }


SERVE_PINNED = {
    # (profile, run name) -> pool, H, step, leases on (``ladsd serve --policy``)
    ("cpu", "lads"): (2300, 382, 512, True),
    ("cpu", "infinite-cache"): (15872, 382, 512, False),
    ("cpu", "augserve+lads"): (2300, 382, 1024, True),
    ("smoke", "fifo"): (160, 8, 512, False),
    ("smoke", "augserve"): (160, 8, 1024, False),
    ("paper", "lads"): (12315, 2048, 512, True),
}


@pytest.mark.parametrize("key", sorted(SERVE_PINNED))
def test_serve_engines_keep_todays_pool_h_and_step(
    monkeypatch: pytest.MonkeyPatch, key: tuple[str, str]
) -> None:
    from ladsd.delivery.registry import RunName
    from ladsd.serve.daemon import Daemon, StartInterrupted

    pname, run = key
    name = RunName.parse(run)
    monkeypatch.setattr(wiring_mod, "EngineThread", NoEngine)
    daemon = Daemon(PROFILES[pname], name.delivery, engine_policy=name.engine)

    async def start() -> None:
        daemon._stop = asyncio.Event()
        async with daemon._runtime():
            pass

    with pytest.raises((Built, StartInterrupted)) as e:
        asyncio.run(start())
    assert isinstance(e.value, Built)
    assert pinned(e.value) == SERVE_PINNED[key]
    assert e.value.kw["engine_policy"] is EnginePolicy(name.engine)


# ---- AugServe's knobs are the profile's ------------------------------------------------


def test_augserve_knobs_come_from_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from ladsd.config import AugServeConfig, PeerConfig
    from ladsd.engine.thread import EngineThread

    smoke = PROFILES["smoke"]
    wide = AugServeConfig(beta_high=3.0)
    prof = replace(smoke, peers=replace(smoke.peers, augserve=wide))
    b = built_by_replay(monkeypatch, prof, make("controlled", prof, 1), "augserve+lads")
    assert b.cfg.max_num_batched_tokens == 3 * 512  # beta_high * T_max of this profile
    assert b.kw["augserve"] is wide  # and the scheduler gets the same knobs
    o = built_by_replay(monkeypatch, prof, make("controlled", prof, 1), "augserve-order+lads")
    assert o.cfg.max_num_batched_tokens == 512  # the order alone keeps vLLM's step and budget
    assert o.kw["engine_policy"] == "augserve-order" and o.kw["augserve"] is wide
    assert EngineThread(smoke.engine, augserve=wide).settings.augserve is wide
    assert EngineThread(smoke.engine).settings.augserve == PeerConfig().augserve


# ---- the dilation, at the depth that builds the runtime --------------------------------

CPU = PROFILES["cpu"]


def fake_engine(kappa: float, dtype: str) -> type:
    """An engine thread that starts at once with this kappa and dtype (no vLLM)."""

    class FakeEngine:
        alive, published = True, None

        def __init__(self, cfg: EngineConfig, lease: LeaseConfig, **kw: Any) -> None:
            self.cfg, self.lease, self.kw = cfg, lease, kw
            self.kappa, self.dtype = kappa, dtype

        async def __aenter__(self) -> FakeEngine:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        def subscribe(self, fn: Any) -> None:
            pass

        def inventory(self, inv: Any) -> None:
            pass

        async def finish(self) -> dict[str, float]:
            return {"refs_added": 0, "refs_released": 0}

    return FakeEngine


def opened(monkeypatch: pytest.MonkeyPatch, prof: Any, kappa: float, dtype: str, **kw: Any):
    """(runtime, engine) of ``open_runtime(prof, "lads", **kw)`` on a fake engine."""
    monkeypatch.setattr(wiring_mod, "EngineThread", fake_engine(kappa, dtype))

    async def go() -> Any:
        async with wiring_mod.open_runtime(prof, "lads", **kw) as rt:
            return rt, rt.engine

    return asyncio.run(go())


def test_open_runtime_plays_the_pass_dilation_on_every_time_constant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's own kappa says 3x; the pass says 2x: the pass's wins, applied once.
    rt, eng = opened(monkeypatch, CPU, 3 * CPU.kappa_ref_s, "bfloat16", dilation=2.0)
    assert rt.dilation == 2.0
    assert rt.link.rate_bytes_per_s == pytest.approx(CPU.link.rate_bytes_per_s / 2)
    assert eng.lease.lease_lifetime_s == pytest.approx(2 * CPU.lease.lease_lifetime_s)
    assert eng.lease.tick_s == pytest.approx(2 * CPU.lease.tick_s)
    assert rt.policy.max_age_s == pytest.approx(2 * CPU.lease.record_max_age_s)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runtimes_own_dilation_uses_the_reference_of_the_dtype_it_runs(
    monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    from ladsd.config import kappa_ref

    ref = kappa_ref(CPU, dtype)
    assert ref is not None
    rt, eng = opened(monkeypatch, CPU, 2 * ref, dtype)  # serve, capture: no pass dilation
    assert rt.dilation == pytest.approx(2.0)
    assert rt.link.rate_bytes_per_s == pytest.approx(CPU.link.rate_bytes_per_s / 2)
    assert eng.lease.lease_lifetime_s == CPU.lease.lease_lifetime_s  # the link only


def test_the_replay_runner_hands_open_runtime_its_pass_dilation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def spy(profile: Any, policy: str, **kw: Any) -> Any:
        seen.update(profile=profile, **kw)
        raise Built(profile.engine, profile.lease, kw)

    monkeypatch.setattr(runner, "open_runtime", spy)
    wl = make("controlled", CPU, 1)
    with pytest.raises(runner.RunFailed):
        asyncio.run(runner.run(wl, CPU, "lads", dilation=dil.given(CPU, 2.5)))
    assert seen["dilation"] == 2.5
    # Undilated, references kept: open_runtime dilates, once (no blanked references).
    prof = seen["profile"]
    assert prof.kappa_ref_s == CPU.kappa_ref_s and prof.kappa_ref_float32_s is not None
    assert prof.lease.lease_lifetime_s == CPU.lease.lease_lifetime_s
    assert seen["link"].rate_bytes_per_s == CPU.link.rate_bytes_per_s


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_serve_dilates_its_own_model_only_in_either_dtype(
    monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    from cli.main import _serve_profile
    from ladsd.config import kappa_ref

    own = _serve_profile("cpu", CPU.engine.model, None, None, None, None, None)
    other = _serve_profile("cpu", "smollm2-135m", None, None, None, None, None)
    assert kappa_ref(own, dtype) == kappa_ref(CPU, dtype) is not None
    assert kappa_ref(other, dtype) is None
    k = 4 * kappa_ref(CPU, dtype)
    assert opened(monkeypatch, own, k, dtype)[0].dilation == pytest.approx(4.0)
    assert opened(monkeypatch, other, k, dtype)[0].dilation == 1.0


def test_a_changed_augserve_knob_enters_the_run_config() -> None:
    from ladsd.config import AugServeConfig
    from ladsd.workloads import plan

    smoke = PROFILES["smoke"]
    assert "peers" not in plan.config(smoke, "controlled", 1, {})["profile"]
    changed = replace(smoke, peers=replace(smoke.peers, augserve=AugServeConfig(mu=2.0)))
    peers = plan.config(changed, "controlled", 1, {})["profile"]["peers"]
    assert list(peers) == ["augserve"] and peers["augserve"]["mu"] == 2.0
