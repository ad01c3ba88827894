"""Captured agent traces: versioned JSONL (see traces/README.md).

Line 1 is a :class:`TraceHeader`; then one line per :class:`TraceWorkflow`.
A continuation's prompt is stored as the ids it *adds* to the previous call's
prompt + output, so every history is a token-exact extension of the one
before by construction (what the engine's prefix cache needs). Observations
are stored as UTF-8 text with their byte length and sha256, so the bytes a
replay sends are exactly the captured ones.

:func:`load` validates everything and raises :class:`TraceError` naming the
line; the writer is :mod:`ladsd.workloads.trace_write`, and
``dumps(loads(b)) == b`` and ``loads(dumps(t)) == t``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ladsd.clock import Stamps
from ladsd.workloads.fields import Where
from ladsd.workloads.fields import get as _get
from ladsd.workloads.fields import obj as _obj

FORMAT = "ladsd-trace"
VERSION = 1
ACTIONS = ("open", "read_reviews", "finish", "invalid")
TERMINATIONS = ("finish", "step_limit", "context_limit", "error")


class TraceError(ValueError):
    """A trace file (or record) that breaks the format; the message names the line."""


@dataclass(frozen=True)
class Action:
    """What a model call chose. ``invalid``: the output did not parse (``error`` says why)."""

    name: str  # open | read_reviews | finish | invalid
    thought: str | None = None
    product_id: int | None = None
    answer: str | None = None
    error: str | None = None

    @property
    def is_tool(self) -> bool:
        return self.name in ("open", "read_reviews")


@dataclass(frozen=True)
class Observation:
    """The tool result a continuation resumes with (exact text; bytes = UTF-8).

    ``tool`` is None for the harness's own error observation after an invalid
    model output (no tool ran; ``tool_seconds`` is 0).
    """

    tool: str | None
    args: Mapping[str, Any]
    ok: bool
    text: str
    tool_seconds: float

    @property
    def payload(self) -> bytes:
        return self.text.encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()


@dataclass(frozen=True)
class TraceCall:
    """One model call. Call 0 is cold; call k > 0 resumes with ``observation``,
    the result of call ``depends_on``'s action."""

    turn: int
    depends_on: int | None
    observation: Observation | None
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    cached_tokens: int
    offered: Mapping[str, tuple[int, ...]]  # the step's schema: action -> product ids
    action: Action
    times: Stamps = field(default_factory=Stamps)  # relative to the capture's origin


@dataclass(frozen=True)
class TraceWorkflow:
    workflow: str
    task_id: str
    product_ids: tuple[int, ...]
    arrival: float
    end: float
    termination: str  # finish | step_limit | context_limit | error
    answer: str | None
    calls: tuple[TraceCall, ...]
    error: str | None = None


@dataclass(frozen=True)
class TraceHeader:
    model: str
    tokenizer: str
    tokenizer_sha256: str
    ladsd_version: str
    vllm_version: str
    seed: int
    catalog_digest: str
    tasks_sha256: str
    created: str  # ISO 8601, UTC
    workflows: int  # number of workflow lines that follow (detects lost lines)
    backend: str  # which backend captured: direct | link
    agent: Mapping[str, Any]  # the agent's settings (step limit, caps, sampling)
    format: str = FORMAT
    version: int = VERSION


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    workflows: tuple[TraceWorkflow, ...]


# ---- reading ---------------------------------------------------------------


class _Where(Where):
    """Builds errors that name the line and the field."""

    def __init__(self, line: int, path: str = "") -> None:
        self.line, self.path = line, path

    def fail(self, what: str) -> TraceError:
        field_ = f" {self.path}:" if self.path else ""
        return TraceError(f"line {self.line}:{field_} {what}")


_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))


def _ids(v: Any, w: _Where) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise w.fail(f"expected a list of token ids, got {type(v).__name__}")
    for k, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise w.at(k).fail(f"not a token id: {t!r}")
    return tuple(v)


def _parse_header(d: Mapping[str, Any]) -> TraceHeader:
    w = _Where(1)
    fmt = d.get("format")
    if fmt != FORMAT:
        raise w.fail(f"not a ladsd trace (format {fmt!r}, expected {FORMAT!r})")
    version = d.get("version")
    if version != VERSION:
        raise w.fail(f"unsupported trace version {version!r} (this ladsd reads {VERSION})")
    n = _get(d, "workflows", int, w)
    if n < 0:
        raise w.at("workflows").fail("must be >= 0")
    return TraceHeader(
        model=_get(d, "model", str, w),
        tokenizer=_get(d, "tokenizer", str, w),
        tokenizer_sha256=_get(d, "tokenizer_sha256", str, w),
        ladsd_version=_get(d, "ladsd_version", str, w),
        vllm_version=_get(d, "vllm_version", str, w),
        seed=_get(d, "seed", int, w),
        catalog_digest=_get(d, "catalog_digest", str, w),
        tasks_sha256=_get(d, "tasks_sha256", str, w),
        created=_get(d, "created", str, w),
        workflows=n,
        backend=_get(d, "backend", str, w),
        agent=_get(d, "agent", dict, w),
    )


def _parse_obs(v: Any, w: _Where) -> Observation | None:
    if v is None:
        return None
    d = _obj(v, w)
    obs = Observation(
        tool=_get(d, "tool", _OPT_STR, w),
        args=_get(d, "args", dict, w),
        ok=_get(d, "ok", bool, w),
        text=_get(d, "text", str, w),
        tool_seconds=float(_get(d, "tool_seconds", _NUM, w)),
    )
    nbytes = _get(d, "bytes", int, w)
    if nbytes != len(obs.payload):
        raise w.at("bytes").fail(f"{nbytes} but the text is {len(obs.payload)} bytes")
    if _get(d, "sha256", str, w) != obs.sha256:
        raise w.at("sha256").fail("does not match the text")
    return obs


def _parse_action(v: Any, w: _Where) -> Action:
    d = _obj(v, w)
    name = _get(d, "name", str, w)
    if name not in ACTIONS:
        raise w.at("name").fail(f"unknown action {name!r}")
    a = Action(
        name=name,
        thought=_get(d, "thought", _OPT_STR, w),
        product_id=_get(d, "product_id", _OPT_INT, w),
        answer=_get(d, "answer", _OPT_STR, w),
        error=_get(d, "error", _OPT_STR, w),
    )
    if a.is_tool and a.product_id is None:
        raise w.at("product_id").fail(f"{name} needs a product id")
    if name == "finish" and a.answer is None:
        raise w.at("answer").fail("finish needs an answer")
    if name == "invalid" and a.error is None:
        raise w.at("error").fail("an invalid action says why")
    return a


def _parse_times(v: Any, w: _Where) -> Stamps:
    d = _obj(v, w)
    vals = {k: _get(d, k, _OPT_NUM, w) for k in ("r", "s", "c", "a", "n", "f")}
    return Stamps(**{k: None if x is None else float(x) for k, x in vals.items()})


def _parse_call(v: Any, turn: int, prev: TraceCall | None, w: _Where) -> TraceCall:
    d = _obj(v, w)
    if _get(d, "turn", int, w) != turn:
        raise w.at("turn").fail(f"expected {turn}")
    dep = _get(d, "depends_on", _OPT_INT, w)
    if dep != (None if prev is None else turn - 1):
        raise w.at("depends_on").fail(f"{dep!r} is not the previous call")
    if "observation" not in d:
        raise w.at("observation").fail("missing field")
    obs = _parse_obs(d["observation"], w.at("observation"))
    if (obs is None) != (prev is None):
        raise w.at("observation").fail("the cold call has none; every continuation has one")
    if prev is None:
        prompt = _ids(_get(d, "prompt_ids", list, w), w.at("prompt_ids"))
    else:
        added = _ids(_get(d, "added_ids", list, w), w.at("added_ids"))
        prompt = prev.prompt_ids + prev.output_ids + added
    if _get(d, "prompt_len", int, w) != len(prompt):
        raise w.at("prompt_len").fail(f"says {d['prompt_len']}, ids give {len(prompt)}")
    offered = {
        name: _ids(ids, w.at("offered").at(name))
        for name, ids in _get(d, "offered", dict, w).items()
    }
    if not offered or not all(a in ACTIONS and a != "invalid" for a in offered):
        raise w.at("offered").fail(f"expected offered actions, got {list(offered)}")
    return TraceCall(
        turn=turn,
        depends_on=dep,
        observation=obs,
        prompt_ids=prompt,
        output_ids=_ids(_get(d, "output_ids", list, w), w.at("output_ids")),
        text=_get(d, "text", str, w),
        finish_reason=_get(d, "finish_reason", _OPT_STR, w),
        cached_tokens=_get(d, "cached_tokens", int, w),
        offered=offered,
        action=_parse_action(_get(d, "action", dict, w), w.at("action")),
        times=_parse_times(_get(d, "times", dict, w), w.at("times")),
    )


def _parse_workflow(d: Mapping[str, Any], w: _Where) -> TraceWorkflow:
    term = _get(d, "termination", str, w)
    if term not in TERMINATIONS:
        raise w.at("termination").fail(f"unknown termination {term!r}")
    pids = _get(d, "product_ids", list, w)
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in pids):
        raise w.at("product_ids").fail("expected integers")
    raw = _get(d, "calls", list, w)
    if not raw:
        raise w.at("calls").fail("a workflow has at least its cold call")
    calls: list[TraceCall] = []
    for k, c in enumerate(raw):
        calls.append(_parse_call(c, k, calls[-1] if calls else None, w.at("calls").at(k)))
    return TraceWorkflow(
        workflow=_get(d, "workflow", str, w),
        task_id=_get(d, "task_id", str, w),
        product_ids=tuple(pids),
        arrival=float(_get(d, "arrival", _NUM, w)),
        end=float(_get(d, "end", _NUM, w)),
        termination=term,
        answer=_get(d, "answer", _OPT_STR, w),
        error=_get(d, "error", _OPT_STR, w),
        calls=tuple(calls),
    )


def _lines(data: bytes) -> Iterable[tuple[int, bytes]]:
    if not data:
        raise TraceError("line 1: empty file, expected a trace header")
    parts = data.split(b"\n")
    last = parts.pop()  # b"" when the file ends with a newline
    yield from enumerate(parts, start=1)
    if last:
        raise TraceError(f"line {len(parts) + 1}: truncated (the file does not end with a newline)")


def loads(data: bytes, where: str = "trace") -> Trace:
    """Parse and validate trace bytes; errors name ``where`` and the line."""
    try:
        return _loads(data)
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None


def _loads(data: bytes) -> Trace:
    header: TraceHeader | None = None
    flows: list[TraceWorkflow] = []
    seen: set[str] = set()
    for k, line in _lines(data):
        w = _Where(k)
        if not line.strip():
            raise w.fail("empty line")
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise w.fail(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise w.fail(f"expected an object, got {type(d).__name__}")
        if header is None:
            header = _parse_header(d)
            continue
        wf = _parse_workflow(d, w)
        if wf.workflow in seen:
            raise w.at("workflow").fail(f"duplicate workflow {wf.workflow!r}")
        seen.add(wf.workflow)
        flows.append(wf)
    assert header is not None  # _lines yields at least one line for non-empty data
    if len(flows) != header.workflows:
        raise TraceError(
            f"line {len(flows) + 2}: header announces {header.workflows} workflows, "
            f"the file has {len(flows)} (truncated?)"
        )
    return Trace(header, tuple(flows))


def load(path: Path | str) -> Trace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    return loads(data, str(path))
