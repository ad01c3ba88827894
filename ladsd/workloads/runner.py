"""Run one workload instance under one policy on the real engine and link.

Every workflow runs concurrently: call 0 enters the engine directly; each
later call waits for its tool (cohort barrier or recorded service time), then
its result travels the return link and resumes the model. Outputs are forced
to the spec's lengths. The run ends with the lease audit.
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import replace
from typing import Any

from ladsd import clock, sizing
from ladsd.audit import check_refs
from ladsd.config import Profile, kappa_ref
from ladsd.delivery.registry import PAPER, RunName
from ladsd.engine import cpu
from ladsd.engine.params import forced
from ladsd.metrics.events import (
    CPU_PARTS,
    CallRecord,
    LeaseSample,
    RunRecord,
    WorkflowRecord,
    new_counters,
)
from ladsd.provenance import git_commit
from ladsd.records import SESSION_AUDIT, ContinuationId
from ladsd.runtime import CallOutcome, Runtime
from ladsd.wiring import open_runtime
from ladsd.workloads import dilation as dil
from ladsd.workloads.cohort import Cohorts
from ladsd.workloads.spec import WorkflowSpec, Workload

# The seven policies plus the infinite-cache reference; ``run`` also takes peers'
# delivery policies and engine policies by run name (ladsd.delivery.registry).
REPLAY_POLICIES = PAPER

Progress = Callable[[str, int, int], None]  # (workflow, calls done, calls total)


class RunFailed(RuntimeError):
    """A run did not complete (engine error, link failure, policy error, audit mismatch).

    ``audit`` is the lease audit taken on the way out (None if none could be taken).
    """

    def __init__(self, msg: str, audit: dict[str, float] | None = None) -> None:
        super().__init__(msg)
        self.audit = audit


@functools.cache
def tool_tokens(model: str) -> Callable[[bytes], int]:
    """Tokens of an observation as its tool message, with ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    from ladsd.engine import models

    render = tool_message(AutoTokenizer.from_pretrained(str(models.model_path(model))))
    return lambda obs: len(render(obs))


def tool_message(tokenizer: Any) -> Callable[[bytes], list[int]]:
    """Tokens of a tool message + assistant header, appended after a model output."""

    def render(obs: bytes) -> list[int]:
        text = (
            "\n<|im_start|>tool\n"
            + obs.decode("utf-8", errors="replace")
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    return render


async def run(
    workload: Workload,
    profile: Profile,
    policy_name: str,
    progress: Progress | None = None,
    meta: dict[str, Any] | None = None,
    *,
    dilation: dil.PassDilation | None = None,
) -> RunRecord:
    """Run ``workload`` under the run name ``policy_name``; return the run record (audit checked).

    ``policy_name`` is a delivery policy, optionally with an engine policy
    (``augserve``, ``augserve+lads``: :class:`ladsd.delivery.registry.RunName`); the
    record carries the run name, its meta both parts. ``meta`` is added to the
    record's meta (e.g. the plan's repeat and config).

    ``dilation`` is the pass's (:mod:`ladsd.workloads.dilation`): the run plays
    the profile and the workload that many times slower (link rate / d, every time
    constant x d). None: this run is a pass of its own and measures one first.

    Fails fast: the first failing workflow (a failed link, a dead engine, a
    policy error) cancels the others, the lease audit still runs, and
    :class:`RunFailed` names the cause.
    """
    name = RunName.parse(policy_name)
    delivery, engine_policy = name.delivery, name.engine
    prof = sizing.for_run(profile, delivery, engine_policy, workload, tool_tokens)
    pd = dilation or await dil.measure(prof)
    # open_runtime plays the profile and the link d times slower before the engine
    # starts (l and the tick are the engine's); the workload instance is slowed here.
    wl = dil.dilated_workload(workload, pd.dilation)
    link = replace(prof.link, codec=workload.codec)
    if workload.rate_bytes_per_s is not None:  # the workload's own link rate
        link = replace(link, rate_bytes_per_s=workload.rate_bytes_per_s)
    rt: Runtime | None = None
    try:
        async with open_runtime(
            prof, delivery, link=link, engine_policy=engine_policy, dilation=pd.dilation
        ) as rt:
            rec = await _run(wl, prof, policy_name, rt, progress)
            parts = {"delivery_policy": delivery, "engine_policy": engine_policy.value}
            slow = dil.dilated(prof, pd.dilation)
            timing = _dilation_meta(pd, rt, prof, dil.time_constants(slow, wl))
            own = {"inputs": inputs_dict(workload)}  # as built, before the dilation
            return replace(rec, meta={**rec.meta, **parts, **timing, **own, **(meta or {})})
    except Exception as e:
        audit = rt.audit if rt is not None else None
        if isinstance(e, RunFailed):
            e.audit = e.audit or audit
            raise
        raise RunFailed(f"run failed: {e}", audit) from e


async def _run(
    wl: Workload,
    prof: Profile,
    policy_name: str,
    rt: Runtime,
    progress: Progress | None,
) -> RunRecord:
    eng = rt.engine
    cohorts = Cohorts(cohort_sizes(wl), wl.cohort_gap_s, wl.cohort_limit_s)
    render_tool = tool_message(eng.tokenizer)
    total = wl.continuations + len(wl.workflows)
    done = 0
    cpu0 = rt.controller_cpu()
    t0 = clock.now()

    async def flow(w: WorkflowSpec) -> WorkflowRecord:
        nonlocal done
        await asyncio.sleep(max(0.0, t0 + w.arrival - clock.now()))
        arrival = clock.now()
        calls: list[CallRecord] = []
        cid0 = ContinuationId(w.wid, 0)
        out = await rt.cold(w.prompt_ids, forced(w.first_output_tokens), cid=cid0)
        calls.append(_record(w.wid, 0, out))
        prompt = list(w.prompt_ids)
        try:
            for k, call in enumerate(w.calls, start=1):
                done += 1
                if progress:
                    progress(w.wid, done, total)
                history = prompt + list(out.completion.token_ids)
                await cohorts.tool(w.cohort, k, call.tool_seconds)
                suffix = call.suffix_ids

                def render(obs: bytes, h=history, sfx=suffix) -> list[int]:
                    return h + (list(sfx) if sfx is not None else render_tool(obs))

                params = forced(call.output_tokens)
                cid = ContinuationId(w.wid, k)
                out = await rt.resume(
                    cid,
                    history,
                    call.observation,
                    render,
                    params,
                    workflow_arrival=arrival,
                )
                prompt = list(out.completion.prompt_token_ids)
                calls.append(_record(w.wid, k, out))
        finally:
            if w.cohort is not None:
                cohorts.leave(w.cohort)
        rt.end_workflow(w.wid, len(calls))  # completed: HEAR's continuation estimate learns it
        done += 1
        if progress:
            progress(w.wid, done, total)
        return WorkflowRecord(w.wid, arrival, clock.now(), tuple(calls))

    flows = await _all(flow(w) for w in wl.workflows)
    audit = await rt.finish()
    counters = _counters(rt, audit, flows, cpu0)
    counters["partial_cohort_releases"] = cohorts.partial_releases
    samples = tuple(LeaseSample(t - t0, U, B, C, F) for t, U, B, C, F in rt.timeline.samples)
    check_refs(counters["refs_added"], counters["refs_released"], what="lease references")
    return RunRecord(
        policy=policy_name,
        workload=wl.name,
        profile=prof.name,
        seed=wl.seed,
        workflows=tuple(
            replace(
                f,
                arrival=f.arrival - t0,
                termination=f.termination - t0,
                calls=tuple(_shift(c, t0) for c in f.calls),
            )
            for f in flows
        ),
        lease_samples=samples,
        counters=counters,
        meta=_meta(prof, rt, wl),
    )


async def _all(coros: Iterable[Coroutine[Any, Any, WorkflowRecord]]) -> tuple:
    """Every workflow's record; the first failure cancels the rest and raises RunFailed."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            err = failed[0].exception()
            raise RunFailed(f"{len(failed)} workflow(s) failed; first: {err!r}") from err
        return tuple(t.result() for t in tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _record(wid: str, turn: int, out: CallOutcome) -> CallRecord:
    comp = out.completion
    return CallRecord(
        workflow=wid,
        turn=turn,
        version=0,
        is_cold=turn == 0,
        stamps=out.stamps,
        prompt_tokens=len(comp.prompt_token_ids),
        cached_tokens=comp.num_cached_tokens,
        output_tokens=len(comp.token_ids),
        payload_bytes=out.payload_bytes,
        frame_bytes=out.frame_bytes,
    )


def _shift(c: CallRecord, t0: float) -> CallRecord:
    return replace(c, stamps=c.stamps.shift(t0))


# The lease audit's figures a run file keeps beside its counters (LeaseBook.audit).
AUDIT_EXTRAS: tuple[str, ...] = (
    *SESSION_AUDIT.values(),
    "notice_blocks_reused",
    "notice_blocks_hashed",
)


def _counters(rt: Runtime, audit: dict, flows: tuple, cpu0: tuple[float, ...]) -> dict[str, float]:
    out = new_counters()
    st = rt.state.counters if rt.state is not None else {}
    for k, v in st.items():
        if isinstance(v, (int, float)):
            out[k] = v
    for k in ("refs_added", "refs_released"):
        out[k] = audit.get(k, 0)
    # Extra counters: how the controller's work was done (bench/commit_ab.py reads them).
    out.update({k: audit[k] for k in AUDIT_EXTRAS if k in audit})
    act = rt.engine.activity
    out["engine_steps"], out["engine_loops"] = act.steps, act.loops
    out["states_published"], out["states_unchanged"] = act.published, act.unchanged
    pol = rt.policy.stats()
    out["promotions"] = pol.get("promotions", 0)
    out["fallbacks"] = pol.get("fallback", 0)
    # Which validity rule each fallback broke (fallback_stale, fallback_duplicate, ...).
    out.update({k: v for k, v in pol.items() if k.startswith("fallback_")})
    # lads-adaptive's own rules (absent elsewhere, so other run files stay as they were).
    out.update({k: pol[k] for k in ("progress", "stood_down") if k in pol})
    link = rt.sender.stats()
    out["control_bytes"] = rt.control_bytes()
    # ctrl CPU s and its four parts (extra counters: the tables show only the sum).
    parts = [b - a for a, b in zip(cpu0, rt.controller_cpu(), strict=True)]
    out["controller_cpu_s"] = sum(parts)
    out.update(zip(CPU_PARTS, parts, strict=True))
    out["link_frames"] = link.get("frames", 0)
    out["link_resends"] = link.get("resends", 0)
    out["cached_prompt_tokens"] = sum(c.cached_tokens for f in flows for c in f.calls)
    return out


def cohort_sizes(wl: Workload) -> dict[int, int]:
    """Members per tool-service cohort id (workflows without a cohort are left out)."""
    sizes: dict[int, int] = {}
    for w in wl.workflows:
        if w.cohort is not None:
            sizes[w.cohort] = sizes.get(w.cohort, 0) + 1
    return sizes


def inputs_dict(wl: Workload) -> dict[str, Any]:
    """What the run was fed, as built (the profile holds only defaults, e.g. cohort 8).

    cohort_sizes: members per tool-service cohort, in cohort order ([] without barriers).
    """
    sizes = cohort_sizes(wl)
    return {
        "workload": wl.name,
        "seed": wl.seed,
        "workflows": len(wl.workflows),
        "continuations": wl.continuations,
        "cohort_sizes": [sizes[k] for k in sorted(sizes)],
        "codec": wl.codec,
        "rate_bytes_per_s": wl.rate_bytes_per_s,
    }


def _meta(prof: Profile, rt: Runtime, wl: Workload) -> dict[str, Any]:
    import vllm

    from ladsd.config import has_cuda

    eng = rt.engine
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus"
        + (" + cuda" if has_cuda() else ""),
        "vllm": vllm.__version__,
        "git": git_commit(),
        "kappa_s": eng.kappa,
        "link_rate_bytes_per_s": rt.link.rate_bytes_per_s,
        "engine_startup_s": eng.startup_s,
        # The dtype vLLM ran (profile's engine.dtype is the one asked) and the CPU that
        # chose it (ladsd.engine.cpu); files from before these keys lack them.
        "dtype": eng.dtype,
        **cpu.meta(),
        "profile": _profile_dict(prof),
        "inputs": inputs_dict(wl),
    }


def _dilation_meta(
    pd: dil.PassDilation, rt: Runtime, prof: Profile, constants: dict[str, float]
) -> dict[str, Any]:
    """The pass's dilation, what it scaled, and this run's own kappa beside it (the check)."""
    ref = kappa_ref(prof, rt.engine.dtype)
    kappa = rt.engine.kappa
    return {
        "dilation": pd.dilation,
        "dilation_pass": pd.meta(),
        # What this run's own kappa alone would have set (the per-run dilation of old).
        "run_dilation": kappa / ref if ref and kappa > 0 else None,
        "kappa_ref_s": ref,
        "time_constants": constants,
    }


def _profile_dict(prof: Profile) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(prof)
    d.pop("extra", None)
    return d
