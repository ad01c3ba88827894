"""The cc-traces loader and the session workload built from it (no engine)."""

from __future__ import annotations

import json
import math
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from ladsd.workloads import cc_traces
from ladsd.workloads.cc_traces import CcTraceError, Conversation, Request, Subagent
from ladsd.workloads.sessions import SessionParams, block_tokens, build, kept, sessions_of

B = 64


def req(ids: list[int], t: float = 0.0, think: float = 0.0, out: int = 100) -> Request:
    n = len(ids) * B + 10  # a partial last block, as the traces have
    return Request(t, "n", "m", n, out, tuple(ids), ("text",), ("text",), "tool_use", think)


def conv(cid: str, *reqs: Request, subs: tuple[Subagent, ...] = ()) -> Conversation:
    return Conversation(cid, B, ("m",), 0, 0, tuple(reqs), subs)


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


BIG = SessionParams(sessions=1, token_scale=1.0, max_context=10**6, max_output_tokens=10**6)


# ---- generator --------------------------------------------------------------


def test_equal_ids_equal_blocks_and_prompts_extend() -> None:
    c = conv(
        "c1",
        req([1, 2, 3]),
        req([1, 2, 3, 4, 5], t=5, think=3),
        req([1, 2, 9, 10, 11, 12], t=9, think=2),
    )
    t0, t1, t2 = sessions_of(c, BIG, 0.0)[0].turns
    assert len(t0.prompt_ids) == 3 * B  # the partial block is dropped
    assert t1.prompt_ids[: len(t0.prompt_ids)] == t0.prompt_ids  # extends where the ids do
    assert common(t1.prompt_ids, t2.prompt_ids) == 2 * B  # ids diverge at block 2: tokens too
    assert t2.prompt_ids[2 * B : 3 * B] == block_tokens("c1", 9, B, BIG.vocab)
    assert block_tokens("c1", 4, B, BIG.vocab) == block_tokens("c1", 4, B, BIG.vocab)
    assert block_tokens("c1", 4, B, BIG.vocab) != block_tokens("c1", 5, B, BIG.vocab)
    # ids are local to a file: the same id of another conversation is other text
    assert block_tokens("c1", 4, B, BIG.vocab) != block_tokens("c2", 4, B, BIG.vocab)
    lo, hi = BIG.vocab
    assert all(lo <= x < hi for x in t2.prompt_ids)


def test_waits_outputs_and_caps() -> None:
    p = SessionParams(
        sessions=1, token_scale=0.5, time_factor=2.0, max_output_tokens=64, max_tool_wait_s=60
    )
    c = conv("c", req([1, 2], out=500), req([1, 2, 3, 4], think=10, out=0), req([1] * 6, think=900))
    turns = sessions_of(c, p, 0.0)[0].turns
    assert [t.tool_wait_s for t in turns] == [20.0, 60.0, 0.0]  # think_time * 2, capped, last 0
    assert [t.output_tokens for t in turns] == [64, 1, 50]  # ceil(out * s), capped, >= 1
    two = SessionParams(sessions=1, token_scale=1.0, max_turns=2)
    assert [t.tool_wait_s for t in sessions_of(c, two, 0.0)[0].turns] == [10.0, 0.0]


def test_scaling_keeps_the_prefix_property() -> None:
    base = list(range(1, 41))
    c = conv("c", req(base[:17]), req(base[:29]), req(base[:23] + [100 + i for i in range(10)]))
    for scale in (0.25, 1 / 3, 0.5, 0.7):
        p = SessionParams(sessions=1, token_scale=scale, max_context=10**6)
        t0, t1, t2 = sessions_of(c, p, 0.0)[0].turns
        s = Fraction(scale).limit_denominator(1 << 20)
        assert len(t0.prompt_ids) == math.floor(17 * s) * B
        assert t1.prompt_ids[: len(t0.prompt_ids)] == t0.prompt_ids
        # shared 23 blocks -> floor(23 s) kept blocks shared; the kept block after them differs
        assert common(t1.prompt_ids, t2.prompt_ids) == math.floor(23 * s) * B
    assert kept(8, Fraction(1, 4)) == [3, 7]


def test_context_limit_ends_a_session() -> None:
    c = conv("c", req([1, 2]), req([1, 2, 3, 4]), req([1, 2, 3, 4, 5, 6]))
    p = SessionParams(sessions=1, token_scale=1.0, max_context=4 * B + 64)
    assert len(sessions_of(c, p, 0.0)[0].turns) == 2


def test_subagents_are_sessions_started_at_their_t() -> None:
    sub = Subagent(30.0, "agent_001", "Explore", 2, (req([50, 51]), req([50, 51, 52], think=4)))
    c = conv("c", req([1]), req([1, 2], think=1), req([1, 2, 3], think=5), subs=(sub,))
    p = SessionParams(sessions=1, token_scale=1.0, time_factor=0.5)
    main, child = sessions_of(c, p, 10.0)
    assert (child.sid, child.parent, child.after_turns) == ("c/agent_001", "c", 2)
    assert child.arrival == 10.0 + 30.0 * 0.5
    assert [t.tool_wait_s for t in child.turns] == [2.0, 0.0]
    # the parent stops after one turn: it never reaches the subagent
    short = SessionParams(sessions=1, token_scale=1.0, max_turns=1)
    assert [s.sid for s in sessions_of(c, short, 0.0)] == ["c"]


def _many() -> list[Conversation]:
    return [conv(f"c{i:02d}", req([1, 2, 3]), req([1, 2, 3, 4], think=1)) for i in range(20)]


def test_generator_is_deterministic_per_seed() -> None:
    p = SessionParams(sessions=6, token_scale=1.0, stagger_s=1.5)
    a, b = build(_many(), 7, p), build(_many(), 7, p)
    assert a == b
    orders = {tuple(s.sid for s in build(_many(), seed, p).sessions) for seed in range(5)}
    assert len(orders) == 5  # other seeds choose other sessions or another order
    assert [s.arrival for s in a.sessions] == [i * 1.5 for i in range(6)]


def test_too_few_fitting_conversations_is_refused() -> None:
    with pytest.raises(ValueError, match="21 sessions asked, 20 of 20"):
        build(_many(), 0, SessionParams(sessions=21, token_scale=1.0))
    with pytest.raises(ValueError, match="token_scale"):
        build(_many(), 0, SessionParams(token_scale=0.0))


# ---- loader -----------------------------------------------------------------


def _request(ids: list[int], t: float) -> dict[str, Any]:
    return {
        "t": t, "type": "n", "model": "m", "in": len(ids) * B + 5, "out": 20,
        "hash_ids": ids, "input_types": ["text"], "output_types": ["tool_use"],
        "stop": "tool_use", "api_time": 1.5, "think_time": 2.0,
    }  # fmt: skip


def _file(name: str = "trace_0001") -> dict[str, Any]:
    reqs = [_request([1, 2], 0.0), _request([1, 2, 3], 4.0)]
    sub = {
        "t": 5.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
        "requests": [_request([9], 0.0)],
    }  # fmt: skip
    n_in = sum(r["in"] for r in reqs)
    return {
        "id": name, "models": ["m"], "block_size": B, "hash_id_scope": "local",
        "tool_tokens": 10, "system_tokens": 20, "requests": [*reqs, sub],
        "totals": {
            "parent_tokens": {"input": n_in, "output": 40},
            "subagent_tokens": {"input": B + 5, "output": 20},
            "subagent_count": 1,
        },
    }  # fmt: skip


def _write(tmp: Path, d: Any, name: str = "trace_0001") -> Path:
    path = tmp / f"{name}.json"
    path.write_text(d if isinstance(d, str) else json.dumps(d))
    return path


def test_loader_reads_a_valid_file(tmp_path: Path) -> None:
    c = cc_traces.load_file(_write(tmp_path, _file()))
    assert [r.hash_ids for r in c.requests] == [(1, 2), (1, 2, 3)]
    assert c.subagents[0].after == 2 and c.subagents[0].requests[0].hash_ids == (9,)


def _broken(mutate: Any) -> dict[str, Any]:
    d = _file()
    mutate(d)
    return d


@pytest.mark.parametrize(
    ("broken", "expected"),
    [
        ('{"id": "trace_0001", ', "not JSON"),
        (_broken(lambda d: d["requests"][1].pop("out")), "requests[1].out: missing field"),
        (
            _broken(lambda d: d["requests"][1].update(hash_ids="1,2,3")),
            "requests[1].hash_ids: expected list, got str",
        ),
        (
            _broken(lambda d: d["requests"][0].update({"in": -64})),
            "requests[0].in: must be >= 0, got -64",
        ),
        (
            _broken(lambda d: d["requests"][0]["hash_ids"].append(7)),
            "requests[0].hash_ids: 3 ids for 133 input tokens",
        ),
        (
            _broken(lambda d: d["requests"][2]["requests"][0].update(think_time=True)),
            "requests[2].requests[0].think_time: expected int or float, got bool",
        ),
        (
            _broken(lambda d: d["requests"][1].update(t=-1.0)),
            "requests[1].t: must be >= 0",
        ),
        (_broken(lambda d: d["requests"].pop(1)), "totals.parent_tokens: says input/output"),
        (_broken(lambda d: d.update(id="trace_0002")), "id: 'trace_0002' does not match"),
    ],
)
def test_loader_refuses_broken_files(tmp_path: Path, broken: Any, expected: str) -> None:
    path = _write(tmp_path, broken)
    with pytest.raises(CcTraceError) as err:
        cc_traces.load_file(path)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_one_bad_file_fails_the_whole_directory(tmp_path: Path) -> None:
    _write(tmp_path, _file("trace_0001"), "trace_0001")
    _write(tmp_path, _broken(lambda d: d.update(id="trace_0009", block_size=0)), "trace_0009")
    with pytest.raises(CcTraceError, match=r"trace_0009.json: block_size: must be > 0"):
        cc_traces.load(tmp_path)
    with pytest.raises(CcTraceError, match="no cc-traces directory"):
        cc_traces.load(tmp_path / "absent")


# ---- the real traces --------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> cc_traces.TraceSet:
    if not cc_traces.DEFAULT_TRACES.is_dir():
        pytest.skip(f"shared traces not found at {cc_traces.DEFAULT_TRACES}")
    return cc_traces.load()


def test_all_real_traces_load_with_plausible_totals(real: cc_traces.TraceSet) -> None:
    convs = real.conversations
    assert len(convs) == 64 and real.commit is not None and len(real.commit) == 40
    assert all(8 <= len(c.requests) + len(c.subagents) <= 60 for c in convs)
    ins = [r.input_tokens for c in convs for r in c.requests]
    assert 8_000 <= min(ins) and max(ins) <= 160_000
    waits = [r.think_time for c in convs for r in c.requests[1:]]
    assert 5.0 <= statistics.median(waits) <= 20.0  # README: a median of about 11 s


def test_real_workload_keeps_the_traces_prefixes(real: cc_traces.TraceSet) -> None:
    p = SessionParams(sessions=12, token_scale=0.25, max_turns=20, max_context=40_000)
    w = build(real.conversations, 3, p, commit=real.commit)
    assert w == build(real.conversations, 3, p, commit=real.commit)
    by_id = {c.id: c for c in real.conversations}
    s = Fraction(1, 4)
    for sess in w.sessions:
        c = by_id[sess.conversation]
        reqs = c.requests if sess.parent is None else next(
            a.requests for a in c.subagents if sess.sid.endswith(a.agent_id)
        )
        for a, b in zip(sess.turns, sess.turns[1:], strict=False):
            m = common(reqs[a.request].hash_ids, reqs[b.request].hash_ids)
            assert common(a.prompt_ids, b.prompt_ids) == math.floor(m * s) * B
            assert len(a.prompt_ids) + a.output_tokens <= p.max_context
