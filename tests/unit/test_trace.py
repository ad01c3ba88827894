"""Trace I/O: round trips, and clear errors that name the line for broken files."""

from __future__ import annotations

import orjson
import pytest

from ladsd.clock import Stamps
from ladsd.workloads import trace as tr
from ladsd.workloads import trace_write as tw
from ladsd.workloads.trace import (
    Action,
    Observation,
    Trace,
    TraceCall,
    TraceError,
    TraceHeader,
    TraceWorkflow,
)

PIDS = (1, 2, 3)


def header(n: int) -> TraceHeader:
    return TraceHeader(
        model="smollm2-135m",
        tokenizer="smollm2-135m-instruct",
        tokenizer_sha256="ab" * 32,
        ladsd_version="0.1.0",
        vllm_version="0.32.0",
        seed=7,
        catalog_digest="cd" * 32,
        tasks_sha256="ef" * 32,
        created="2025-01-01T00:00:00+00:00",
        workflows=n,
        backend="direct",
        agent={"step_limit": 10, "max_tokens": 256, "temperature": 0.7},
    )


def workflow(
    name: str, obs_text: str = "Product 1: Joust Duffle Bag\nPrice: $34.00\n"
) -> TraceWorkflow:
    c0 = TraceCall(
        turn=0,
        depends_on=None,
        observation=None,
        prompt_ids=(1, 10, 11, 2, 198, 1, 12),
        output_ids=(20, 21, 2),
        text='{"thought":"t","action":"open","product_id":1}',
        finish_reason="stop",
        cached_tokens=0,
        offered={"open": PIDS, "read_reviews": PIDS},
        action=Action("open", thought="t", product_id=1),
        times=Stamps(a=0.0, n=0.01, f=0.5),
    )
    obs = Observation("open", {"product_id": 1}, True, obs_text, 0.0012)
    c1 = TraceCall(
        turn=1,
        depends_on=0,
        observation=obs,
        prompt_ids=c0.prompt_ids + c0.output_ids + (198, 1, 30, 31, 2, 198, 1, 12),
        output_ids=(22, 23),
        text='{"thought":"cut',
        finish_reason="length",
        cached_tokens=0,
        offered={"open": PIDS, "read_reviews": PIDS},
        action=Action("invalid", error="the reply is not a complete JSON object"),
        times=Stamps(r=0.51, a=0.52, n=0.53, f=0.9),
    )
    err = Observation(None, {}, False, "Error: your reply was not a valid action.\n", 0.0)
    c2 = TraceCall(
        turn=2,
        depends_on=1,
        observation=err,
        prompt_ids=c1.prompt_ids + c1.output_ids + (2, 198, 1, 40, 2, 198, 1, 12),
        output_ids=(24, 2),
        text='{"thought":"done","action":"finish","answer":"the bag"}',
        finish_reason="stop",
        cached_tokens=16,
        offered={"open": PIDS, "read_reviews": PIDS, "finish": ()},
        action=Action("finish", thought="done", answer="the bag"),
        times=Stamps(r=0.91, s=0.92, c=0.95, a=0.95, n=None, f=1.2),
    )
    return TraceWorkflow(name, name, (1, 2, 3), 0.0, 1.25, "finish", "the bag", (c0, c1, c2))


def sample(n: int = 2) -> Trace:
    flows = [workflow(f"shop-{k:02d}") for k in range(1, n + 1)]
    return Trace(header(n), tuple(flows))


def lines(t: Trace) -> list[bytes]:
    return tw.dumps(t).split(b"\n")[:-1]


def test_round_trip_is_identical(tmp_path):
    t = sample()
    path = tw.dump(t, tmp_path / "t.jsonl")
    back = tr.load(path)
    assert back == t
    assert tw.dumps(back) == path.read_bytes()
    assert path.read_bytes().count(b"\n") == 3


def test_observation_bytes_exact_through_non_ascii_text():
    text = "Quest Lumaflex\u2122 Band \u2014 \u00e9t\u00e9\n<|im_end|>\ttab\r\n"
    t = Trace(header(1), (workflow("w", obs_text=text),))
    back = tr.loads(tw.dumps(t))
    obs = back.workflows[0].calls[1].observation
    assert obs is not None and obs.payload == text.encode("utf-8")
    assert obs.sha256 == t.workflows[0].calls[1].observation.sha256


def test_continuations_stored_as_added_ids():
    raw = orjson.loads(lines(sample(1))[1])
    c0, c1, c2 = raw["calls"]
    assert "prompt_ids" in c0 and "added_ids" not in c0
    assert c1["added_ids"] == [198, 1, 30, 31, 2, 198, 1, 12]
    assert c2["added_ids"][0] == 2  # the end-of-turn a truncated output lacked
    assert c2["prompt_len"] == len(sample(1).workflows[0].calls[2].prompt_ids)


def test_dump_refuses_a_prompt_that_is_not_an_extension():
    w = workflow("w")
    bad = TraceCall(**{**w.calls[1].__dict__, "prompt_ids": (9, 9, 9)})
    t = Trace(header(1), (TraceWorkflow(**{**w.__dict__, "calls": (w.calls[0], bad)}),))
    with pytest.raises(TraceError, match="not an extension"):
        tw.dumps(t)


def test_dump_refuses_header_count_mismatch():
    t = sample(2)
    with pytest.raises(TraceError, match="header says 3"):
        tw.dumps(Trace(header(3), t.workflows))


def test_truncated_last_line_names_it():
    data = tw.dumps(sample(2))
    with pytest.raises(TraceError, match=r"line 3: truncated"):
        tr.loads(data[:-40])


def test_lost_whole_line_is_detected():
    data = b"\n".join(lines(sample(2))[:2]) + b"\n"
    with pytest.raises(TraceError, match="announces 2 workflows, the file has 1"):
        tr.loads(data)


def test_bad_json_names_the_line(tmp_path):
    ls = lines(sample(2))
    ls[2] = ls[2][:-1]  # the closing brace lost
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(ls) + b"\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl: line 3: not JSON"):
        tr.load(path)


def test_wrong_version_and_format():
    ls = lines(sample(1))
    h = orjson.loads(ls[0])
    for change, msg in (
        ({"version": 99}, "unsupported trace version 99"),
        ({"format": "x"}, "not a ladsd trace"),
    ):
        data = b"\n".join([orjson.dumps({**h, **change}), ls[1]]) + b"\n"
        with pytest.raises(TraceError, match=f"line 1: {msg}"):
            tr.loads(data)


@pytest.mark.parametrize(
    ("path", "msg"),
    [
        (("termination",), "line 2: termination: missing field"),
        (("calls", 1, "output_ids"), r"line 2: calls\[1\].output_ids: missing field"),
        (("calls", 0, "action", "name"), r"line 2: calls\[0\].action.name: missing field"),
        (("calls", 2, "times", "f"), r"line 2: calls\[2\].times.f: missing field"),
        (("calls", 1, "observation", "sha256"), r"calls\[1\].observation.sha256: missing"),
    ],
)
def test_missing_fields_are_named(path, msg):
    ls = lines(sample(1))
    d = orjson.loads(ls[1])
    node = d
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(TraceError, match=msg):
        tr.loads(ls[0] + b"\n" + orjson.dumps(d) + b"\n")


def test_header_missing_field():
    ls = lines(sample(1))
    h = orjson.loads(ls[0])
    del h["seed"]
    with pytest.raises(TraceError, match="line 1: seed: missing field"):
        tr.loads(orjson.dumps(h) + b"\n" + ls[1] + b"\n")


def edit(fn) -> bytes:
    ls = lines(sample(1))
    d = orjson.loads(ls[1])
    fn(d)
    return ls[0] + b"\n" + orjson.dumps(d) + b"\n"


def test_wrong_types_and_values_are_rejected():
    cases = [
        (
            lambda d: d["calls"][0].__setitem__("prompt_ids", [1, -2]),
            r"prompt_ids\[1\]: not a token",
        ),
        (lambda d: d["calls"][0].__setitem__("cached_tokens", True), "expected int, got bool"),
        (
            lambda d: d["calls"][1]["observation"].__setitem__("text", "other"),
            "bytes: 42 but the text is 5 bytes",
        ),
        (lambda d: d["calls"][1].__setitem__("turn", 5), r"calls\[1\].turn: expected 1"),
        (lambda d: d["calls"][2].__setitem__("depends_on", 0), "is not the previous call"),
        (lambda d: d["calls"][0].__setitem__("observation", d["calls"][1]["observation"]), "cold"),
        (lambda d: d["calls"][1].__setitem__("prompt_len", 3), "prompt_len: says 3"),
        (lambda d: d["calls"][0]["action"].__setitem__("name", "search"), "unknown action"),
        (lambda d: d["calls"][0]["action"].__setitem__("product_id", None), "needs a product id"),
        (lambda d: d["calls"][1].__setitem__("offered", {"fly": []}), "expected offered actions"),
        (lambda d: d["calls"][1]["offered"].__setitem__("open", [1, "x"]), r"offered.open\[1\]"),
        (lambda d: d.__setitem__("termination", "crash"), "unknown termination"),
        (lambda d: d.__setitem__("calls", []), "at least its cold call"),
    ]
    for fn, msg in cases:
        with pytest.raises(TraceError, match=msg):
            tr.loads(edit(fn))


def test_duplicate_workflow_rejected():
    ls = lines(sample(1))
    h = orjson.loads(ls[0])
    h["workflows"] = 2
    with pytest.raises(TraceError, match="line 3: workflow: duplicate"):
        tr.loads(b"\n".join([orjson.dumps(h), ls[1], ls[1]]) + b"\n")


def test_empty_and_unreadable_files(tmp_path):
    with pytest.raises(TraceError, match="empty file"):
        tr.loads(b"")
    with pytest.raises(TraceError, match="line 2: empty line"):
        tr.loads(lines(sample(1))[0] + b"\n\n")
    with pytest.raises(TraceError, match="cannot read"):
        tr.load(tmp_path / "missing.jsonl")


def test_dump_is_atomic_and_leaves_no_temp(tmp_path):
    path = tw.dump(sample(1), tmp_path / "sub" / "t.jsonl")
    assert [p.name for p in path.parent.iterdir()] == ["t.jsonl"]
