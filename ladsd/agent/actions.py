"""Structured actions: what each step offers, its JSON schema, parsing an output.

SmolLM2-135M, free to choose, finishes at once. So each step's schema offers
``finish`` only once every task product has been opened and its reviews
read. Product ids are restricted to the task's three (an enum). Which tool
and product come next stays the model's choice; so do repeats, unless the
capture turns them off (``repeats=False``: a page already seen is no longer
offered, so a task takes exactly 6 tool calls + finish). The trace records
what each step offered: ``{action: product ids}``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ladsd.workloads.trace import Action

TOOL_ACTIONS = ("open", "read_reviews")
FINISH = "finish"
Offered = Mapping[str, tuple[int, ...]]  # action -> product ids it may take (finish: ())


def _seen(tool: str, opened: Collection[int], read: Collection[int]) -> Collection[int]:
    return opened if tool == "open" else read


def offered_actions(
    opened: Collection[int],
    read: Collection[int],
    product_ids: Sequence[int],
    repeats: bool = True,
) -> dict[str, tuple[int, ...]]:
    """The tools over the task's products; ``finish`` once every page is seen.

    With ``repeats=False`` a tool offers only the products whose page it has
    not shown yet (and drops out when none is left).
    """
    offered: dict[str, tuple[int, ...]] = {}
    for tool in TOOL_ACTIONS:
        seen = _seen(tool, opened, read)
        ids = tuple(p for p in product_ids if repeats or p not in seen)
        if ids:
            offered[tool] = ids
    if all(p in opened and p in read for p in product_ids):
        offered[FINISH] = ()
    return offered


def action_schema(
    offered: Offered, thought_chars: int = 200, answer_chars: int = 400
) -> dict[str, Any]:
    """JSON schema of one reply: ``{"thought", "action", "product_id" | "answer"}``."""
    if not offered:
        raise ValueError("no action offered")
    branches = []
    for name, ids in offered.items():
        props: dict[str, Any] = {
            "thought": {"type": "string", "maxLength": thought_chars},
            "action": {"const": name},
        }
        if name == FINISH:
            props["answer"] = {"type": "string", "minLength": 1, "maxLength": answer_chars}
        elif name in TOOL_ACTIONS and ids:
            props["product_id"] = {"enum": list(ids)}
        else:
            raise ValueError(f"cannot offer {name!r} with products {list(ids)}")
        branches.append(
            {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            }
        )
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def parse_action(text: str, offered: Offered) -> Action:
    """The action in a model output, or ``Action("invalid", error=...)`` saying why.

    The grammar makes a complete output valid; an output cut at the token cap
    is not, and this reports it instead of raising.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Action("invalid", error=f"the reply is not a complete JSON object ({e.msg})")
    if not isinstance(obj, dict):
        return Action("invalid", error="the reply is not a JSON object")
    name, thought = obj.get("action"), obj.get("thought")
    if not isinstance(thought, str):
        return Action("invalid", error='"thought" must be a string')
    if name not in offered:
        allowed = ", ".join(offered)
        return Action("invalid", thought=thought, error=f"action {name!r} is not one of {allowed}")
    want = {"thought", "action", "answer" if name == FINISH else "product_id"}
    if set(obj) != want:
        keys = ", ".join(sorted(want))
        return Action("invalid", thought=thought, error=f"{name} takes exactly the keys {keys}")
    if name == FINISH:
        answer = obj["answer"]
        if not isinstance(answer, str) or not answer.strip():
            return Action("invalid", thought=thought, error='"answer" must be a non-empty string')
        return Action(FINISH, thought=thought, answer=answer)
    pid, ids = obj["product_id"], offered[name]
    if isinstance(pid, bool) or not isinstance(pid, int) or pid not in ids:
        allowed = ", ".join(map(str, ids))
        return Action(
            "invalid", thought=thought, error=f"product_id {pid!r} is not one of {allowed}"
        )
    return Action(name, thought=thought, product_id=pid)


def error_observation(action: Action) -> str:
    """The observation an invalid reply gets back (the loop goes on)."""
    return (
        f"Error: your reply was not a valid action: {action.error}. "
        "Reply with one JSON object as shown in the instructions.\n"
    )


def progress_note(
    opened: Collection[int], read: Collection[int], product_ids: Sequence[int]
) -> str:
    """The harness's checklist after each observation: the pages not seen yet.

    A checklist, not a command: which page comes next stays the model's choice.
    """
    todo = [
        f"{tool} {p}"
        for p in product_ids
        for tool in TOOL_ACTIONS
        if p not in _seen(tool, opened, read)
    ]
    if not todo:
        return "Progress: every product page and review page is seen. You can finish now."
    return f"Progress: not seen yet: {', '.join(todo)}."
