"""The run plan of a comparison: repeats, a rotated policy order, resumable files.

Benchmark discipline on a machine whose speed drifts: every seed is a block of
runs whose policy order rotates from block to block (so no policy always runs
first or last), the core policies (every policy with ``repeat_all``) run
``repeats`` times per seed (their repeats are the A/A noise floor), and every
run file records the configuration it was made with, so a resume never mixes
runs of different configurations.

Run files, tables and plots use the run name (ladsd.delivery.registry);
:class:`~ladsd.delivery.registry.RunName` takes it apart for the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ladsd.config import PeerConfig, Profile
from ladsd.delivery.registry import CORE, PEERS, RunName
from ladsd.modes import EnginePolicy


def with_engine(name: str, engine: EnginePolicy) -> str:
    """``name`` run on ``engine`` unless the name carries its own engine policy.

    ``--engine-policy augserve`` turns ``lads`` into ``augserve+lads`` and leaves
    ``augserve`` and ``augserve+lads`` as they are; the default changes nothing.
    """
    run = RunName.parse(name)
    named = "+" in name or name in {e.value for e in EnginePolicy}
    return str(run if named else RunName(run.delivery, EnginePolicy(engine)))


def with_peers(names: Sequence[str]) -> list[str]:
    """``names`` followed by the peers (:data:`PEERS`) not among them (``--peers``).

    Peers are not core policies: the plan runs them once per seed.
    """
    return [*names, *(p for p in PEERS if p not in names)]


def run_flags(flags: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A run's flags: ``flags`` plus its engine policy, recorded only when not vLLM's.

    Runs on the default engine keep the flags they always had, so run files made
    before engine policies existed still match on resume.
    """
    engine = RunName.parse(name).engine
    return dict(flags) | ({"engine_policy": engine.value} if engine != EnginePolicy.VLLM else {})


class ConfigMismatch(ValueError):
    """A stored run file was made with another configuration than the one asked for."""


@dataclass(frozen=True)
class Slot:
    """One planned run."""

    seed: int
    policy: str
    repeat: int  # 1-based
    position: int  # place in its block's rotated order (0-based)
    path: Path


def order(policies: Sequence[str], block: int) -> list[str]:
    """``policies`` rotated by ``block`` places."""
    k = block % len(policies)
    return list(policies[k:]) + list(policies[:k])


def plan(
    policies: Sequence[str],
    seeds: Sequence[int],
    repeats: int,
    out: Path,
    tag: str,
    *,
    repeat_all: bool = False,
) -> list[Slot]:
    """Blocks (seed, repeat) in order; each block runs its policies in rotated order.

    Core policies (:data:`CORE`, by run name: ``augserve+lads`` is a peer, not
    LADS) run ``repeats`` times per seed, the others once; ``repeat_all``
    repeats every policy (each then has its own A/A pair). Repeat 1 keeps the
    single-run file name, so older folders resume as they are.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    slots = []
    block = 0
    for seed in seeds:
        for rep in range(1, repeats + 1):
            names = [p for p in policies if rep == 1 or repeat_all or p in CORE]
            if not names:  # no core policy (e.g. only peers): nothing repeats
                break
            for pos, p in enumerate(order(names, block)):
                suffix = "" if rep == 1 else f"-r{rep}"
                slots.append(Slot(seed, p, rep, pos, out / f"{tag}-{p}-s{seed}{suffix}.json"))
            block += 1
    return slots


def config(prof: Profile, workload: str, seed: int, flags: Mapping[str, Any]) -> dict[str, Any]:
    """What a run is made from (its file must match it to be reused).

    Each peer knob is recorded only when the profile changes it, so run files
    made before it existed still match on resume.
    """
    p = asdict(prof)
    p.pop("extra", None)
    # It only sets a pass's dilation, which the pass checks on every file itself
    # (cli compare): files made before it existed still re-render.
    p.pop("kappa_ref_float32_s", None)
    default = asdict(PeerConfig())
    peers = {k: v for k, v in p.pop("peers").items() if v != default[k]}
    if peers:
        p["peers"] = peers
    return {"profile": p, "workload": workload, "seed": seed, "flags": dict(flags)}


def check(stored: Mapping[str, Any], want: Mapping[str, Any], path: Path) -> None:
    """Raise :class:`ConfigMismatch` naming the first field that differs."""
    for k, (a, b) in _diff(stored, want):
        raise ConfigMismatch(
            f"{path} was made with {k} = {a!r}, this run asks for {b!r}; "
            "use another --out or --no-resume"
        )


def _diff(a: Any, b: Any, where: str = "") -> list[tuple[str, tuple[Any, Any]]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        a, b = list(a), list(b)
    return [] if a == b else [(where, (a, b))]
