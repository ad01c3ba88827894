"""Time dilation: one measured slow-down per pass, applied to every time constant of a run.

A profile is calibrated on one CPU (docs/profiles.md): its link/engine time ratio
puts the machine in the paper's regime. On a CPU ``d`` times slower (or faster)
the engine's steps take ``d`` times as long, so a run there is the calibrated run
played ``d`` times slower: the link rate is divided by ``d`` and every time
constant is multiplied by it.

Contract:

* ``d = kappa / kappa_ref(dtype)`` (:func:`of_kappa`): kappa (one 512-token step)
  measured by probe engine starts (:func:`measure`: the median of ``probes`` starts;
  a compare pass takes :data:`PASS_PROBES`), the reference of the dtype that engine
  ran (:func:`ladsd.config.kappa_ref`); 1.0 where the profile has no reference.
* A *pass* (``ladsd replay``, ``ladsd compare``, ``bench/paper_cpu.sh``'s five
  compares into one folder) measures ``d`` once at its start and gives it to
  every run (``runner.run(..., dilation=d)``); a compare keeps it in
  ``<out>/dilation.json`` (:class:`PassDilation`) so a resumed pass and the other
  workloads of the folder use the same ``d``. Each run still measures its own
  kappa at engine start, for its decisions and as a check in its file.
* :func:`dilated` scales, on the profile: the link rate (/ d), the lease
  lifetime ``l``, the lease tick, the record age and HEAR's guard ``W`` (x d),
  applied once, where the runtime is built (``open_runtime(..., dilation=d)``);
  :func:`dilated_workload` on the workload instance: arrivals, tool-service
  times, the cohort gap and the cohort timeout (x d) and a workload's own link
  rate (/ d). Token quantities and counts do not change.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from ladsd.config import Profile, kappa_ref
from ladsd.engine import cpu
from ladsd.workloads.spec import Workload

FILE = "dilation.json"  # a compare folder's pass dilation
# Probe engine starts of a compare pass; its kappa is their median. One start's kappa is
# itself a median of 15 steps, yet it moved 28-67 ms between starts on one VM (issue 23,
# AMD EPYC): a single probe could set a whole pass's link 2x off.
PASS_PROBES = 3


class DilationMismatch(ValueError):
    """A stored pass dilation was measured for another profile, model, dtype or CPU."""


@dataclass(frozen=True)
class PassDilation:
    """The one dilation of a pass and what it was measured from."""

    dilation: float
    source: str  # "measured" (a probe engine start), "given" (--dilation), "none" (no ref)
    kappa_s: float | None = None  # the probes' (median) kappa
    kappa_ref_s: float | None = None  # the profile's reference for ``dtype``
    dtype: str = ""
    profile: str = ""
    model: str = ""
    cpu_model: str = ""
    cpu_flags: tuple[str, ...] = ()
    measured: str = ""  # UTC time of the measurement
    kappa_probes: tuple[float, ...] = ()  # each probe start's kappa (older files: none kept)

    def meta(self) -> dict[str, Any]:
        """What a run file records of its pass (besides ``dilation`` itself)."""
        keys = ("source", "kappa_s", "kappa_ref_s", "dtype", "measured", "kappa_probes")
        return {k: getattr(self, k) for k in keys}

    def check(self, profile: Profile, where: Path) -> None:
        """Raise :class:`DilationMismatch` unless this was measured for ``profile`` here
        (a given dilation holds wherever it was given; "none", the 1.0 of a profile
        without a kappa reference, on every CPU, so it records none)."""
        if self.source == "given":
            return
        want = {"profile": profile.name, "model": profile.engine.model}
        have = {"profile": self.profile, "model": self.model}
        if self.source != "none":
            want["cpu_model"], have["cpu_model"] = cpu.cpu_info().model, self.cpu_model
        for k, v in want.items():
            if have[k] != v:
                raise DilationMismatch(
                    f"{where} was measured with {k} = {have[k]!r}, this pass runs {v!r}; "
                    "use another --out or --no-resume"
                )


def none(profile: Profile) -> PassDilation:
    """No dilation (1.0): the profile has no kappa reference."""
    return PassDilation(1.0, "none", profile=profile.name, model=profile.engine.model)


def given(profile: Profile, d: float) -> PassDilation:
    """A dilation the user gave (``--dilation``); it must be positive and finite."""
    if not 0 < d < float("inf"):
        raise ValueError(f"a dilation must be a positive number, got {d}")
    return PassDilation(d, "given", profile=profile.name, model=profile.engine.model, **_cpu())


def has_reference(profile: Profile) -> bool:
    return profile.kappa_ref_s is not None or profile.kappa_ref_float32_s is not None


def of_kappa(profile: Profile, kappa: float, dtype: str) -> float:
    """``kappa / kappa_ref(dtype)``: how much slower an engine that runs ``dtype`` and
    measured ``kappa`` is than at calibration (1.0 without a reference for ``dtype``)."""
    ref = kappa_ref(profile, dtype)
    return kappa / ref if ref and kappa > 0 else 1.0


async def measure(profile: Profile, probes: int = 1) -> PassDilation:
    """The pass's dilation: ``probes`` probe engine starts of ``profile``'s engine
    measure kappa; the pass's is their median (a ``ladsd replay`` probes once, a
    compare pass :data:`PASS_PROBES` times).

    A probe builds the engine the runs build (model, dtype, step tokens) with no
    leases, so its kappa is the one each run measures; without a reference for the
    dtype it ran, the dilation is 1.0.
    """
    if probes < 1:
        raise ValueError(f"probes must be at least 1, got {probes}")
    if not has_reference(profile):
        return none(profile)
    from ladsd.engine.thread import EngineThread

    lease = replace(profile.lease, enabled=False, kappa_s=None)
    kappas: list[float] = []
    dtype = ""
    for _ in range(probes):
        async with EngineThread(profile.engine, lease) as eng:
            kappas.append(eng.kappa)
            dtype = eng.dtype
    kappa = statistics.median(kappas)
    ref = kappa_ref(profile, dtype)
    d = of_kappa(profile, kappa, dtype)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return PassDilation(
        d,
        "measured" if ref else "none",
        kappa,
        ref,
        dtype,
        profile.name,
        profile.engine.model,
        measured=stamp,
        kappa_probes=tuple(kappas),
        **_cpu(),
    )


def _cpu() -> dict[str, Any]:
    info = cpu.cpu_info()
    return {"cpu_model": info.model, "cpu_flags": tuple(info.notable())}


def save(p: PassDilation, folder: Path) -> Path:
    path = folder / FILE
    path.write_bytes(orjson.dumps(asdict(p), option=orjson.OPT_INDENT_2) + b"\n")
    return path


def load(folder: Path) -> PassDilation | None:
    """The folder's pass dilation (None: none stored); ``ValueError`` if unreadable."""
    path = folder / FILE
    if not path.exists():
        return None
    try:
        d = orjson.loads(path.read_bytes())
        d["cpu_flags"] = tuple(d.get("cpu_flags", ()))
        d["kappa_probes"] = tuple(d.get("kappa_probes", ()))
        p = PassDilation(**d)
    except (orjson.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path} is not a pass dilation file: {e}") from None
    if not 0 < p.dilation < float("inf"):
        raise ValueError(f"{path}: dilation {p.dilation} is not a positive number")
    return p


def dilated(profile: Profile, d: float) -> Profile:
    """``profile`` played ``d`` times slower: link rate / d, every time constant x d.

    Scaled: the link rate, ``l``, the lease tick, the record age, HEAR's guard ``W``,
    and the workload config's cohort gap, cohort timeout and arrival spread (what
    builds a workload; :func:`dilated_workload` scales one already built).
    """
    if d == 1.0:
        return profile
    lease = profile.lease
    w = profile.workload
    return replace(
        profile,
        link=replace(profile.link, rate_bytes_per_s=profile.link.rate_bytes_per_s / d),
        lease=replace(
            lease,
            lease_lifetime_s=lease.lease_lifetime_s * d,
            tick_s=lease.tick_s * d,
            record_max_age_s=lease.record_max_age_s * d,
        ),
        peers=replace(profile.peers, guard_s=profile.peers.guard_s * d),
        workload=replace(
            w,
            cohort_gap_s=w.cohort_gap_s * d,
            cohort_limit_s=w.cohort_limit_s * d,
            arrival_spread_s=w.arrival_spread_s * d,
        ),
    )


def dilated_workload(wl: Workload, d: float) -> Workload:
    """``wl`` played ``d`` times slower: arrivals, tool times, cohort gap and timeout x d."""
    if d == 1.0:
        return wl
    flows = tuple(
        replace(
            w,
            arrival=w.arrival * d,
            calls=tuple(replace(c, tool_seconds=c.tool_seconds * d) for c in w.calls),
        )
        for w in wl.workflows
    )
    rate = wl.rate_bytes_per_s / d if wl.rate_bytes_per_s is not None else None
    return replace(
        wl,
        workflows=flows,
        cohort_gap_s=wl.cohort_gap_s * d,
        cohort_limit_s=wl.cohort_limit_s * d,
        rate_bytes_per_s=rate,
    )


def time_constants(profile: Profile, wl: Workload) -> dict[str, float]:
    """The time constants a run used (after dilation), for its file."""
    return {
        "link_rate_bytes_per_s": wl.rate_bytes_per_s or profile.link.rate_bytes_per_s,
        "lease_lifetime_s": profile.lease.lease_lifetime_s,
        "tick_s": profile.lease.tick_s,
        "record_max_age_s": profile.lease.record_max_age_s,
        "guard_s": profile.peers.guard_s,
        "cohort_gap_s": wl.cohort_gap_s,
        "cohort_limit_s": wl.cohort_limit_s,
    }
