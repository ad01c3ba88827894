"""The one wiring of a run: policy -> lease config -> engine -> runtime -> audit -> close.

:func:`open_runtime` is what the replay runner, capture's link backend and
``ladsd serve`` open, and nothing else; it takes the run's profile as sized once
by the caller (:func:`ladsd.sizing.for_run`) and applies the time dilation
(:mod:`ladsd.workloads.dilation`) where the runtime is built.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from ladsd.config import LinkConfig, Profile
from ladsd.delivery import make_policy
from ladsd.delivery.policy import Policy
from ladsd.delivery.registry import delivery_class
from ladsd.engine.thread import EngineThread, Upkeep
from ladsd.modes import EnginePolicy
from ladsd.runtime import Runtime
from ladsd.workloads import dilation as dil

log = logging.getLogger("ladsd.runtime")


def policy_for(profile: Profile, name: str) -> Policy:
    """The delivery policy ``name`` with the profile's knobs.

    Lease knobs (theta, record age) and the peers' (HEAR's guard W); each policy
    takes the ones it uses. ``infinite-cache`` is FIFO delivery on a pool
    nothing outgrows (:func:`ladsd.sizing.engine_for`).
    """
    return make_policy(
        delivery_class(name),
        theta=profile.lease.theta,
        max_age_s=profile.lease.record_max_age_s,
        guard_s=profile.peers.guard_s,
    )


@asynccontextmanager
async def open_runtime(
    profile: Profile,
    policy: str,
    *,
    link: LinkConfig | None = None,
    engine_policy: EnginePolicy = EnginePolicy.VLLM,
    upkeep: Upkeep = Upkeep(),
    dilation: float | None = None,
) -> AsyncIterator[Runtime]:
    """The one wiring: policy -> lease config -> engine -> runtime -> audit -> close.

    ``profile`` is the run's own, sized once by the caller
    (:func:`ladsd.sizing.for_run`); ``link`` (default: the profile's) is undilated.
    ``dilation`` is a replay pass's (:mod:`ladsd.workloads.dilation`): the
    profile and the link are played that many times slower (link rate / d; ``l``,
    the lease tick, the record age, HEAR's ``W`` x d) before the engine starts.
    None (``ladsd serve``, capture): this engine's own kappa / the reference of
    the dtype it runs, on the link rate only (1.0 without a reference).

    Yields a started :class:`Runtime`. On the way out the lease audit always
    runs (after a failure too: a dead engine reports the audit it took when it
    died); an unbalanced audit raises ``LeaseIntegrityError``. The replay
    runner, capture's link backend and the daemon use this and nothing else;
    the daemon passes its :class:`~ladsd.engine.thread.Upkeep` (cached kappa,
    quiet idle, a bounded timeline), replays the default.
    """
    prof = dil.dilated(profile, dilation) if dilation is not None else profile
    pol = policy_for(prof, policy)
    lease = replace(prof.lease, enabled=prof.lease.enabled and pol.uses_leases)
    async with EngineThread(
        prof.engine,
        lease,
        retention=pol.retention,
        engine_policy=engine_policy,
        upkeep=upkeep,
        augserve=prof.peers.augserve,
    ) as eng:
        d = dilation if dilation is not None else dil.of_kappa(prof, eng.kappa, eng.dtype)
        link = link or profile.link
        link = replace(link, rate_bytes_per_s=link.rate_bytes_per_s / d)
        rt = await Runtime(eng, pol, link, timeline_samples=upkeep.timeline_samples).start()
        rt.dilation = d
        try:
            yield rt
            await rt.finish()
        except BaseException:
            try:
                await rt.finish()
            except Exception:
                log.exception("lease audit after a failed run")
            raise
        finally:
            await rt.close()
