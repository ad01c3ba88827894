"""What one run records, as frozen plain data, and its JSON file format.

A :class:`RunRecord` holds every workflow with its model calls (timestamps of
spec section 1 on the one clock), the lease timeline (``U, B, C, F``) and the
run's counters. It is written with :func:`to_json` / :func:`save` and read
back with :func:`from_json` / :func:`load`, which check the structure and
types and name the first bad field, so a malformed file fails loudly instead
of producing wrong figures.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import orjson

from ladsd.clock import STAMP_NAMES, Stamps
from ladsd.records import LEASE_COUNTERS

FORMAT = 1  # bump on any incompatible change of the file layout

# Counters every run reports (0 where a policy has no such event); free-form
# extra counters are allowed beside them.
COUNTERS: tuple[str, ...] = (
    *LEASE_COUNTERS,
    "promotions",
    "fallbacks",
    "preemptions",
    "protection_block_seconds",
    "controller_cpu_s",
    "control_bytes",
    "refs_added",
    "refs_released",
    "cached_prompt_tokens",
)


# ctrl CPU s's parts, in ``Runtime.controller_cpu``'s order; ``controller_cpu_s`` is
# their sum. Extra counters: older run files lack the later ones.
CPU_PARTS: tuple[str, ...] = ("decision_cpu_s", "command_cpu_s", "publish_cpu_s", "schedule_cpu_s")


class RecordFormatError(ValueError):
    """A run file (or dict) that does not match the run-record format."""


@dataclass(frozen=True)
class CallRecord:
    """One model call of a workflow.

    ``is_cold``: model call 0, which enters the engine directly, so it has no
    return-path stamps (``r, s, c`` are None). Stamps not reached are None.
    """

    workflow: str
    turn: int
    version: int
    is_cold: bool
    stamps: Stamps  # r, s, c, a, n, f (written flat in the file: one key per stamp)
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    payload_bytes: int  # p_i after the codec (0 for a cold call)
    frame_bytes: int  # h + p_i (0 for a cold call)


@dataclass(frozen=True)
class WorkflowRecord:
    workflow: str
    arrival: float
    termination: float
    calls: tuple[CallRecord, ...]


@dataclass(frozen=True)
class LeaseSample:
    """One point of the lease timeline: protected U, target B, committed C, free F."""

    t: float
    U: int
    B: int
    C: int
    F: int


@dataclass(frozen=True)
class RunRecord:
    policy: str
    workload: str
    profile: str
    seed: int
    workflows: tuple[WorkflowRecord, ...]
    lease_samples: tuple[LeaseSample, ...] = ()
    counters: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # machine, versions, profile dict


def new_counters() -> dict[str, float]:
    """All standard counters at zero (a run fills in what happened)."""
    return dict.fromkeys(COUNTERS, 0)


# ---------------------------------------------------------------- writing


def to_dict(run: RunRecord) -> dict[str, Any]:
    d = {"format": FORMAT, **asdict(run)}
    for w in d["workflows"]:
        for c in w["calls"]:
            c.update(c.pop("stamps"))  # the file keeps one key per stamp
    return d


def to_json(run: RunRecord) -> bytes:
    """Stable JSON bytes (sorted keys, indented); round-trips through :func:`from_json`."""
    d = to_dict(run)
    _check_run(d)  # refuse to write what could not be read back (NaN, bad types)
    try:
        return orjson.dumps(d, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
    except TypeError as e:  # orjson.JSONEncodeError: e.g. a non-JSON value in meta
        raise RecordFormatError(f"run record is not JSON-serialisable: {e}") from e


def save(run: RunRecord, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(to_json(run))
    return p


# ---------------------------------------------------------------- reading


def from_json(data: bytes | str) -> RunRecord:
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RecordFormatError(f"not valid JSON: {e}") from e
    return from_dict(d)


def load(path: str | Path) -> RunRecord:
    """One run file; ``*.gz`` is read through gzip (archived results are kept compressed)."""
    p = Path(path)
    try:
        data = p.read_bytes()
        if p.suffix == ".gz":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as e:
                raise RecordFormatError(f"not a gzip file: {e}") from e
        return from_json(data)
    except RecordFormatError as e:
        raise RecordFormatError(f"{p}: {e}") from e


def from_dict(d: Any) -> RunRecord:
    _check_run(d)
    return RunRecord(
        policy=d["policy"],
        workload=d["workload"],
        profile=d["profile"],
        seed=d["seed"],
        workflows=tuple(
            WorkflowRecord(
                workflow=w["workflow"],
                arrival=float(w["arrival"]),
                termination=float(w["termination"]),
                calls=tuple(_call(c) for c in w["calls"]),
            )
            for w in d["workflows"]
        ),
        lease_samples=tuple(
            LeaseSample(t=float(x["t"]), U=x["U"], B=x["B"], C=x["C"], F=x["F"])
            for x in d["lease_samples"]
        ),
        counters=dict(d["counters"]),
        meta=dict(d["meta"]),
    )


def _call(c: dict[str, Any]) -> CallRecord:
    kw = {k: c[k] for k in _CALL_FIELDS if k not in _STAMPS}
    stamps = Stamps(**{k: None if c[k] is None else float(c[k]) for k in _STAMPS})
    return CallRecord(**kw, stamps=stamps)


# ---------------------------------------------------------------- validation

_STAMPS = STAMP_NAMES
_CALL_INTS = (
    "turn",
    "version",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "payload_bytes",
    "frame_bytes",
)
_CALL_FIELDS = ("workflow", "is_cold", *_STAMPS, *_CALL_INTS)


def _fail(where: str, msg: str) -> NoReturn:
    raise RecordFormatError(f"{where}: {msg}")


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _obj(d: Any, where: str, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        _fail(where, f"expected an object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        _fail(where, f"missing field(s) {', '.join(missing)}")


def _typed(d: dict[str, Any], where: str, key: str, kind: str) -> None:
    x = d[key]
    ok = {
        "str": isinstance(x, str),
        "int": _is_int(x),
        "nat": _is_int(x) and x >= 0,
        "num": _is_num(x),
        "num?": x is None or _is_num(x),
        "bool": isinstance(x, bool),
        "list": isinstance(x, list | tuple),
        "dict": isinstance(x, dict),
    }[kind]
    if not ok:
        want = {
            "str": "a string",
            "int": "an integer",
            "nat": "a non-negative integer",
            "num": "a finite number",
            "num?": "a finite number or null",
            "bool": "true or false",
            "list": "a list",
            "dict": "an object",
        }[kind]
        _fail(f"{where}.{key}", f"expected {want}, got {x!r}")


def _check_run(d: Any) -> None:
    keys = ("format", "policy", "workload", "profile", "seed", "workflows")
    _obj(d, "run", (*keys, "lease_samples", "counters", "meta"))
    if d["format"] != FORMAT:
        _fail("run.format", f"unsupported format {d['format']!r} (this reader knows {FORMAT})")
    for k, kind in [("policy", "str"), ("workload", "str"), ("profile", "str"), ("seed", "int")]:
        _typed(d, "run", k, kind)
    for k, kind in [("workflows", "list"), ("lease_samples", "list")]:
        _typed(d, "run", k, kind)
    for k in ("counters", "meta"):
        _typed(d, "run", k, "dict")
    for k, v in d["counters"].items():
        if not _is_num(v):
            _fail(f"run.counters.{k}", f"expected a finite number, got {v!r}")
    seen: set[str] = set()
    for i, w in enumerate(d["workflows"]):
        _check_workflow(w, f"workflows[{i}]")
        if w["workflow"] in seen:
            _fail(f"workflows[{i}].workflow", f"duplicate workflow id {w['workflow']!r}")
        seen.add(w["workflow"])
    for i, x in enumerate(d["lease_samples"]):
        where = f"lease_samples[{i}]"
        _obj(x, where, ("t", "U", "B", "C", "F"))
        _typed(x, where, "t", "num")
        for k in ("U", "B", "C", "F"):
            _typed(x, where, k, "nat")


def _check_workflow(w: Any, where: str) -> None:
    _obj(w, where, ("workflow", "arrival", "termination", "calls"))
    _typed(w, where, "workflow", "str")
    _typed(w, where, "arrival", "num")
    _typed(w, where, "termination", "num")
    _typed(w, where, "calls", "list")
    if w["termination"] < w["arrival"]:
        _fail(where, f"termination {w['termination']} before arrival {w['arrival']}")
    for j, c in enumerate(w["calls"]):
        cw = f"{where}.calls[{j}]"
        _obj(c, cw, _CALL_FIELDS)
        _typed(c, cw, "workflow", "str")
        _typed(c, cw, "is_cold", "bool")
        for k in _STAMPS:
            _typed(c, cw, k, "num?")
        for k in _CALL_INTS:
            _typed(c, cw, k, "nat")
        if c["workflow"] != w["workflow"]:
            _fail(f"{cw}.workflow", f"{c['workflow']!r} inside workflow {w['workflow']!r}")
        if c["is_cold"] and any(c[k] is not None for k in ("r", "s", "c")):
            _fail(cw, "a cold call has no return-path stamps (r, s, c must be null)")
