"""The ReAct loop of one workflow: model call -> action -> tool -> observation -> ...

Each model call yields a thought and an action under a per-step JSON schema
(:mod:`ladsd.agent.actions`), natural stop with a token cap. Tool results and
errors (bad tool call, or an output cut at the cap) come back as tool
messages and the loop goes on, bounded by the step limit. Model calls go
through a :class:`~ladsd.agent.backend.Backend`; the loop only builds token
ids (each continuation extends the previous prompt + output exactly) and
records the workflow.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ladsd import clock
from ladsd.agent import actions
from ladsd.agent.backend import Backend
from ladsd.agent.prompt import ChatML, system_prompt, user_prompt
from ladsd.engine.params import sampling
from ladsd.records import ContinuationId
from ladsd.workloads.trace import (
    Action,
    Observation,
    TraceCall,
    TraceWorkflow,
)
from web_catalog.db import Catalog
from web_catalog.tasks import Task
from web_catalog.tools import call_tool

OnCall = Callable[[str, TraceCall], None]


class AgentError(RuntimeError):
    """The backend broke the loop's contract (e.g. ran a different prompt)."""


@dataclass(frozen=True)
class AgentConfig:
    step_limit: int = 10  # model calls per workflow, at most
    max_tokens: int = 256  # output cap per call (natural stop before it)
    thought_chars: int = 200
    answer_chars: int = 400
    temperature: float = 0.7
    top_p: float = 0.95
    progress_note: bool = True  # a checklist turn after each observation
    # Per-call sampling seeds (reproducible paths). Off by default: vLLM 0.32's
    # CPU runner fails a whole engine step when a seeded request's prefill is
    # chunked (it rewinds the generator offset, which CPU generators lack).
    per_call_seed: bool = False
    repeats: bool = True  # may the model open / read a page it has seen already?

    def __post_init__(self) -> None:
        if self.step_limit < 1 or self.max_tokens < 1:
            raise ValueError("step_limit and max_tokens must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def call_seed(seed: int, workflow: str, turn: int) -> int:
    """A per-call sampling seed: reproducible, distinct per workflow and turn."""
    h = hashlib.sha256(f"{seed}/{workflow}/{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def step_params(cfg: AgentConfig, offered: actions.Offered, seed: int | None) -> Any:
    schema = actions.action_schema(offered, cfg.thought_chars, cfg.answer_chars)
    return sampling(
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=seed,
        json_schema=schema,
    )


async def run_workflow(
    task: Task,
    backend: Backend,
    db: Catalog,
    cfg: AgentConfig = AgentConfig(),
    *,
    seed: int = 0,
    origin: float | None = None,
    workflow: str | None = None,
    on_call: OnCall | None = None,
) -> TraceWorkflow:
    """Run ``task`` to its end and return its record (times relative to ``origin``,
    default the workflow's arrival). A failing model call ends the workflow
    with termination ``error``; what ran before it is kept."""
    chat = ChatML(backend.tokenizer)
    wf = workflow or task.task_id
    arrival = clock.now()
    origin = arrival if origin is None else origin

    pids = task.product_ids
    opened: set[int] = set()
    read: set[int] = set()
    prompt = chat.cold(system_prompt(), user_prompt(task))
    history: list[int] = []
    obs: Observation | None = None
    render = chat.renderer(history)
    r: float | None = None
    calls: list[TraceCall] = []
    termination, answer, error = "step_limit", None, None

    for turn in range(cfg.step_limit):
        offered = actions.offered_actions(opened, read, pids, cfg.repeats)
        cseed = call_seed(seed, wf, turn) if cfg.per_call_seed else None
        params = step_params(cfg, offered, cseed)
        try:
            if obs is None:
                reply = await backend.cold(wf, prompt, params)
            else:
                reply = await backend.resume(
                    ContinuationId(wf, turn),
                    history,
                    obs.payload,
                    render,
                    params,
                    workflow_arrival=arrival,
                    tool_seconds=obs.tool_seconds,
                )
            out = reply.completion
            sent = tuple(out.prompt_token_ids)
            if sent and sent != tuple(prompt):
                raise AgentError(f"{wf} call {turn}: the engine ran a different prompt")
        except Exception as e:  # one failing workflow must not end the others
            termination, error = "error", f"{type(e).__name__}: {e}"
            break
        action = actions.parse_action(out.text, offered)
        st = reply.stamps if reply.stamps.r is not None else replace(reply.stamps, r=r)
        times = st.shift(origin)
        call = TraceCall(
            turn=turn,
            depends_on=None if turn == 0 else turn - 1,
            observation=obs,
            prompt_ids=tuple(prompt),
            output_ids=tuple(out.token_ids),
            text=out.text,
            finish_reason=out.finish_reason,
            cached_tokens=out.num_cached_tokens,
            offered=offered,
            action=action,
            times=times,
        )
        calls.append(call)
        if on_call is not None:
            on_call(wf, call)
        if action.name == actions.FINISH:
            termination, answer = "finish", action.answer
            break
        if turn + 1 == cfg.step_limit:
            break  # the last allowed call chose a tool: it is not run
        obs = await _observe(db, action, opened, read)
        r = clock.now()
        history = chat.history(prompt, out.token_ids)
        note = actions.progress_note(opened, read, pids) if cfg.progress_note else None
        render = chat.renderer(history, note)
        prompt = render(obs.payload)
        if len(prompt) + cfg.max_tokens > backend.max_model_len:
            termination = "context_limit"
            break

    return TraceWorkflow(
        workflow=wf,
        task_id=task.task_id,
        product_ids=pids,
        arrival=arrival - origin,
        end=clock.now() - origin,
        termination=termination,
        answer=answer,
        calls=tuple(calls),
        error=error,
    )


async def _observe(db: Catalog, action: Action, opened: set[int], read: set[int]) -> Observation:
    """Run the action's tool (or describe the invalid reply) as an observation."""
    if not action.is_tool:
        return Observation(None, {}, False, actions.error_observation(action), 0.0)
    res = await call_tool(db, action.name, {"product_id": action.product_id})
    if res.ok:
        (opened if action.name == "open" else read).add(int(action.product_id or 0))
    return Observation(res.tool, res.args, res.ok, res.text, res.service_seconds)
