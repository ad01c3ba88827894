"""Strict loader of the cc-traces: recorded Claude Code conversations (../shared/data/README.md).

One JSON file per conversation, ``trace_NNNN.json``: ``id`` (the file's stem),
``block_size`` (64 tokens per hash id), ``hash_id_scope`` (``local``),
``tool_tokens``, ``system_tokens``, ``models``, ``totals`` and ``requests`` in
order. A model request (``type`` ``n`` or ``s``) has ``t``, ``in``, ``out``,
``hash_ids`` (one per *full* input block: ``len == in // block_size``),
``input_types``, ``output_types``, ``stop``, ``think_time`` and, where recorded,
``api_time`` and ``ttft``. A ``subagent`` entry has its own ``requests`` (model
requests only; nesting is refused) and starts at its ``t``.

:func:`load` checks every field, the ordering of ``t``, the hash-id count and
the file's ``totals`` against its requests, and raises :class:`CcTraceError`
naming the file, the request index and the field; nothing is half loaded.
Directory resolution (an explicit path, ``$LADSD_CC_TRACES``, the shared copy
beside the checkout, or a sha256-checked download): :mod:`.cc_source`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ladsd.workloads.fields import Where, kind_ok
from ladsd.workloads.fields import get as _get
from ladsd.workloads.fields import obj as _obj

ENV_TRACES = "LADSD_CC_TRACES"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = REPO_ROOT.parent / "shared" / "data" / "cc-traces"
MODEL_TYPES = ("n", "s")
SCOPES = ("local",)  # ids are unique within one file (the only scope the set uses)


class CcTraceError(ValueError):
    """A cc-traces file that breaks the format; the message names file, request and field."""


@dataclass(frozen=True)
class Request:
    """One model request as recorded (times in seconds, token counts as in the trace)."""

    t: float  # since the (sub)conversation's first request
    kind: str  # n | s
    model: str
    input_tokens: int  # ``in``
    output_tokens: int  # ``out``
    hash_ids: tuple[int, ...]  # one per full input block
    input_types: tuple[str, ...]
    output_types: tuple[str, ...]
    stop: str
    think_time: float  # tool (or user) time waited before this request
    api_time: float | None = None
    ttft: float | None = None


@dataclass(frozen=True)
class Subagent:
    """A nested agent: its own model requests, started at ``t`` of the parent's clock."""

    t: float
    agent_id: str
    subagent_type: str
    after: int  # how many of the parent's model requests precede it
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Conversation:
    id: str
    block_size: int
    models: tuple[str, ...]
    tool_tokens: int
    system_tokens: int
    requests: tuple[Request, ...]  # the main agent's model requests, in order
    subagents: tuple[Subagent, ...] = ()


@dataclass(frozen=True)
class TraceSet:
    root: Path
    commit: str | None  # from the directory's SOURCE file, if present
    conversations: tuple[Conversation, ...]  # sorted by id


class _At(Where):
    """Builds errors naming the file and the field path (``requests[3].hash_ids[7]``)."""

    def __init__(self, file: str, path: str = "") -> None:
        self.file, self.path = file, path

    def fail(self, what: str) -> CcTraceError:
        return CcTraceError(f"{self.file}: {self.path or '(top level)'}: {what}")


def _count(d: Mapping[str, Any], key: str, w: _At) -> int:
    v = _get(d, key, (int,), w)
    if v < 0:
        raise w.at(key).fail(f"must be >= 0, got {v}")
    return v


def _opt_secs(d: Mapping[str, Any], key: str, w: _At, opt: bool = True) -> float | None:
    v = _get(d, key, (int, float), w, opt)
    if v is not None and v < 0:
        raise w.at(key).fail(f"must be >= 0, got {v}")
    return None if v is None else float(v)


def _secs(d: Mapping[str, Any], key: str, w: _At) -> float:
    v = _opt_secs(d, key, w, opt=False)
    assert v is not None  # a required field: missing raised above
    return v


def _strs(d: Mapping[str, Any], key: str, w: _At) -> tuple[str, ...]:
    v = _get(d, key, (list,), w)
    for k, s in enumerate(v):
        if not isinstance(s, str):
            raise w.at(key).at(k).fail(f"expected str, got {type(s).__name__}")
    return tuple(v)


def _request(v: Any, block: int, w: _At) -> Request:
    d = _obj(v, w)
    kind = _get(d, "type", (str,), w)
    if kind not in MODEL_TYPES:
        raise w.at("type").fail(f"expected a model request ({'/'.join(MODEL_TYPES)}), got {kind!r}")
    n_in = _count(d, "in", w)
    ids = _get(d, "hash_ids", (list,), w)
    for k, h in enumerate(ids):
        if not kind_ok(h, int) or h < 0:
            raise w.at("hash_ids").at(k).fail(f"not a block id: {h!r}")
    if len(ids) != n_in // block:
        raise w.at("hash_ids").fail(
            f"{len(ids)} ids for {n_in} input tokens (expected {n_in // block}, one per "
            f"full {block}-token block)"
        )
    return Request(
        t=_secs(d, "t", w),
        kind=kind,
        model=_get(d, "model", (str,), w),
        input_tokens=n_in,
        output_tokens=_count(d, "out", w),
        hash_ids=tuple(ids),
        input_types=_strs(d, "input_types", w),
        output_types=_strs(d, "output_types", w),
        stop=_get(d, "stop", (str,), w),
        think_time=_secs(d, "think_time", w),
        api_time=_opt_secs(d, "api_time", w),
        ttft=_opt_secs(d, "ttft", w),
    )


def _requests(
    raw: list[Any], block: int, w: _At, nested: bool
) -> tuple[list[Request], list[Subagent]]:
    """(model requests, subagents) of a request list; ``t`` must not go back."""
    reqs: list[Request] = []
    subs: list[Subagent] = []
    last = 0.0
    for k, v in enumerate(raw):
        wk = w.at(k)
        d = _obj(v, wk)
        if _get(d, "type", (str,), wk) == "subagent":
            if nested:
                raise wk.at("type").fail("a subagent inside a subagent is not supported")
            inner = _get(d, "requests", (list,), wk)
            if not inner:
                raise wk.at("requests").fail("a subagent has at least one request")
            own, _ = _requests(inner, block, wk.at("requests"), nested=True)
            t = _secs(d, "t", wk)
            agent = _get(d, "agent_id", (str,), wk)
            kind = _get(d, "subagent_type", (str,), wk)
            subs.append(Subagent(t, agent, kind, len(reqs), tuple(own)))
            cur = subs[-1].t
        else:
            reqs.append(_request(d, block, wk))
            cur = reqs[-1].t
        if cur < last:
            raise wk.at("t").fail(f"{cur} is before the previous entry's {last}")
        last = cur
    return reqs, subs


def _check_totals(d: Mapping[str, Any], reqs: list[Request], subs: list[Subagent], w: _At) -> None:
    tot = _obj(_get(d, "totals", (dict,), w), w.at("totals"))
    inner = [r for s in subs for r in s.requests]
    want = {
        "parent_tokens": (sum(r.input_tokens for r in reqs), sum(r.output_tokens for r in reqs)),
        "subagent_tokens": (
            sum(r.input_tokens for r in inner),
            sum(r.output_tokens for r in inner),
        ),
    }
    for key, (i, o) in want.items():
        wk = w.at("totals").at(key)
        part = _obj(_get(tot, key, (dict,), w.at("totals")), wk)
        got = (_count(part, "input", wk), _count(part, "output", wk))
        if got != (i, o):
            raise wk.fail(f"says input/output {got}, the requests sum to {(i, o)} (truncated?)")
    n = _count(tot, "subagent_count", w.at("totals"))
    if n != len(subs):
        raise w.at("totals").at("subagent_count").fail(f"says {n}, the file has {len(subs)}")


def parse(d: Any, name: str, where: str | None = None) -> Conversation:
    """Validate one decoded file (``name``: the expected id, the file's stem)."""
    w = _At(where or name)
    d = _obj(d, w)
    cid = _get(d, "id", (str,), w)
    if cid != name:
        raise w.at("id").fail(f"{cid!r} does not match the file name {name!r}")
    block = _get(d, "block_size", (int,), w)
    if block <= 0:
        raise w.at("block_size").fail(f"must be > 0, got {block}")
    scope = _get(d, "hash_id_scope", (str,), w)
    if scope not in SCOPES:
        raise w.at("hash_id_scope").fail(f"unsupported scope {scope!r} (expected {SCOPES})")
    raw = _get(d, "requests", (list,), w)
    reqs, subs = _requests(raw, block, w.at("requests"), nested=False)
    if not reqs:
        raise w.at("requests").fail("no model request of the main agent")
    _check_totals(d, reqs, subs, w)
    return Conversation(
        id=cid,
        block_size=block,
        models=_strs(d, "models", w),
        tool_tokens=_count(d, "tool_tokens", w),
        system_tokens=_count(d, "system_tokens", w),
        requests=tuple(reqs),
        subagents=tuple(subs),
    )


def load_file(path: Path | str) -> Conversation:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CcTraceError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise CcTraceError(f"{path}: not JSON ({e})") from None
    return parse(d, path.stem, str(path))


def traces_dir(path: Path | str | None = None) -> Path:
    """The traces directory by :func:`.cc_source.find_traces`, the one resolution rule."""
    from ladsd.workloads.cc_source import find_traces  # it imports this module's error type

    return find_traces(path)


def load(path: Path | str | None = None) -> TraceSet:
    """Every ``trace_*.json`` of the directory, validated; any bad file fails the whole load."""
    root = traces_dir(path)
    files = sorted(root.glob("trace_*.json"))
    if not files:
        raise CcTraceError(f"{root}: no trace_*.json files")
    convs = tuple(load_file(f) for f in files)
    src = root / "SOURCE"
    commit = None
    if src.is_file():
        words = src.read_text(encoding="utf-8").split()
        commit = next((x for x in words if len(x) == 40 and x.isalnum()), None)
    return TraceSet(root, commit, convs)
