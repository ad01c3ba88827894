"""``ladsd serve`` parts without an engine: chat parsing, tools, rendering, sessions,
events, metrics, the app's error shape, API key and bind rules."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from ladsd.config import PROFILES
from ladsd.records import ContinuationId, EngineState, LeaseEvent, LeaseEventKind, LeaseRecord
from ladsd.serve import chat, replies
from ladsd.serve.app import check_bind, is_loopback
from ladsd.serve.chat import ChatRequest
from ladsd.serve.daemon import Daemon, ServeConfig
from ladsd.serve.envelope import Reply, ToolCall
from ladsd.serve.errors import ApiError
from ladsd.serve.events import EventHub
from ladsd.serve.harness import Intent
from ladsd.serve.metrics import registry
from ladsd.serve.protocol import DEFAULT_TOOL_S, notice, parse_intent
from ladsd.serve.render import Renderer
from ladsd.serve.sessions import LeaseView, SessionTable
from tests.helpers import weather_tool

WEATHER = weather_tool()


def body(**kw: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(b: object, header: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat.parse(b, header)
    return e.value


# ---- parsing -------------------------------------------------------------------------


def test_defaults_follow_openai():
    r = chat.parse(body())
    smp, out = r.sampling, r.output
    assert (smp.temperature, smp.top_p, out.max_tokens, out.stream, r.tooling.tool_choice) == (
        1.0,
        1.0,
        None,
        False,
        "none",
    )
    assert chat.parse(body(tools=[WEATHER])).tooling.tool_choice == "auto"


def test_session_from_header_or_body():
    assert chat.parse(body(session_id="a-1")).session_id == "a-1"
    assert chat.parse(body(session_id="x"), "h.2").session_id == "h.2"
    assert refused(body(session_id="bad id")).param == "session_id"


@pytest.mark.parametrize(
    "b,param",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (body(messages=[]), "messages"),
        (body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (body(messages=[{"role": "assistant"}]), "messages[0]"),
        (body(max_tokens=0), "max_tokens"),
        (body(temperature=3), "temperature"),
        (body(temperature=True), "temperature"),
        (body(n=2), "n"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (body(tool_choice="auto"), "tool_choice"),
        (body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
         "tool_choice"),
        (body(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].name"),
        (body(logprobs=True), "logprobs"),
        (body(frequency_penalty=3), "frequency_penalty"),  # honoured in [-2, 2]
        (body(stream="yes"), "stream"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400_with_the_param(b, param):
    e = refused(b)
    assert e.status == 400 and e.param == param
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_assistant_tool_calls_and_tool_messages_parse():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "wea"},
                                     {"type": "text", "text": "ther"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = chat.parse(body(messages=msgs, tools=[WEATHER]))
    assert r.messages[0].content == "weather"
    assert r.messages[1].tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    assert r.messages[2].tool_call_id == "call_1"
    bad_args = [msgs[0], {**msgs[1], "tool_calls": [{**msgs[1]["tool_calls"][0]}]}]
    bad_args[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": "[1]"}
    assert "arguments" in refused(body(messages=bad_args)).param


# ---- tools ---------------------------------------------------------------------------


def test_output_schema_per_tool_choice():
    named = chat.parse(
        body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    s = replies.output_schema(named)
    assert s["properties"]["name"] == {"const": "get_weather"}
    auto = replies.output_schema(chat.parse(body(tools=[WEATHER])))
    assert len(auto["anyOf"]) == 3 and auto["anyOf"][2] == replies.CONTENT_SCHEMA
    assert replies.output_schema(chat.parse(body(tools=[WEATHER], tool_choice="none"))) is None
    assert replies.output_schema(chat.parse(body())) is None
    fmt = chat.parse(body(response_format={"type": "json_object"}))
    assert replies.output_schema(fmt) == {"type": "object"}


def test_replies_become_tool_calls_or_content():
    req = chat.parse(body(tools=[WEATHER]))
    r = replies.parse_reply('{"name":"get_weather","arguments":{"city":"Paris"}}', req)
    assert r.content is None and r.calls[0].name == "get_weather"
    assert json.loads(r.calls[0].arguments) == {"city": "Paris"}
    assert replies.finish_reason("stop", r) == "tool_calls"
    assert replies.parse_reply('{"content":"It is sunny."}', req) == Reply("It is sunny.")
    cut = replies.parse_reply('{"name":"get_wea', req)  # cut at max_tokens: content as it is
    assert cut == Reply('{"name":"get_wea') and replies.finish_reason("length", cut) == "length"
    plain = chat.parse(body())
    assert replies.parse_reply('{"name":"x"}', plain) == Reply('{"name":"x"}')


def test_an_echoed_reply_renders_as_the_same_turns():
    """A client sends back our reply in its own spelling: the turns are equal."""
    req = chat.parse(body(tools=[WEATHER]))
    reply = replies.parse_reply('{"name":"get_weather","arguments":{"city":"Paris"}}', req)
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": reply.calls[0].id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
        "refusal": None,
    }
    nxt = chat.parse(
        body(
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": "hi"},
                echoed,
                {"role": "tool", "tool_call_id": reply.calls[0].id, "content": "sunny"},
            ],
        )
    )
    turns = (*replies.pieces(req), replies.reply_piece(reply))
    assert replies.pieces(nxt)[: len(turns)] == turns
    assert turns[0][0] == "system" and "get_weather" in turns[0][1]  # tools close the system turn


# ---- rendering ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(model_ready):
    from transformers import AutoTokenizer

    from ladsd.engine import models

    return AutoTokenizer.from_pretrained(str(models.model_path("smollm2-135m")))


def test_render_is_the_chat_template(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "done"},
    ]
    want = tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    got = Renderer(tok).prompt([(m["role"], m["content"]) for m in msgs])
    assert got == list(want)


def test_extension_keeps_the_history_token_exact(tok):
    """The next prompt is the history's own ids + new turns, equal to a full render when
    the output ids are the canonical ones."""
    r = Renderer(tok)
    first = [("system", "S"), ("user", "weather?")]
    prompt = r.prompt(first)
    output = r.ml.text('{"name":"w","arguments":{}}') + [r.ml.end]
    hist = r.history(prompt, output)
    nxt = r.extend(hist, [("tool", "sunny")])
    assert nxt[: len(hist)] == hist
    full = r.prompt([*first, ("assistant", '{"name":"w","arguments":{}}'), ("tool", "sunny")])
    assert nxt == full
    odd = [*prompt, 100, 200]  # ids that are not the canonical tokenization: still the prefix
    assert r.extend(r.history(prompt, [100, 200]), [("tool", "x")])[: len(odd)] == odd


# ---- sessions -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def table(n: int = 2, ttl: float = 10.0) -> tuple[SessionTable, list[str], Clock]:
    released: list[str] = []
    clk = Clock()
    return SessionTable(n, ttl, lambda s: released.append(s.id), clk), released, clk


def test_table_is_bounded_lru_and_refuses_when_all_busy():
    t, released, clk = table(2)
    a, b = t.open("a"), t.open("b")
    t.open("a")  # a is now the most recently used
    t.open("c")
    assert released == ["b"] and t.get("b") is None and len(t) == 2
    for s in t:
        s.busy = True
    with pytest.raises(ApiError) as e:
        t.open("d")
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    assert a.version != b.version


def test_idle_sessions_expire_busy_ones_stay():
    t, released, clk = table(4, ttl=10)
    t.open("a")
    t.open("b").busy = True
    clk.t = 5
    t.open("c")
    clk.t = 11
    assert t.expire() == ["a"] and released == ["a"]
    clk.t = 100
    t.get("b").busy = False
    assert sorted(t.expire()) == ["b", "c"]
    assert t.end("zz") is None and t.ended == 3


def test_a_new_incarnation_has_a_new_version_and_releases_what_it_held():
    t, released, _ = table()
    s = t.open("a")
    s.transcript.history = (1, 2, 3)
    s.wait.notice = notice(s, "tool")
    assert s.held() == [ContinuationId(s.workflow, 0, s.version)]  # "local/a"
    t.end("a")
    assert released == ["a"] and t.open("a").version > s.version


def test_observe_follows_records_and_events():
    t, _, _ = table()
    s = t.open("a")
    cid = s.cid(1)
    s.wait.lease = LeaseView(cid)
    other = ContinuationId("a", 1, s.version + 7)  # an old incarnation: ignored
    rec = LeaseRecord(cid, "d", "", (5, 6, 7), 3, 1.0, 9.0, 4)
    ev = [
        LeaseEvent(LeaseEventKind.GRANT, cid, 1.0, 3),
        LeaseEvent(LeaseEventKind.EXPIRY, other, 2),
    ]
    t.observe(EngineState(time=1, seq=1, generation=4, leases=(rec,), events=tuple(ev)))
    v = s.wait.lease
    assert (v.status, v.protected_blocks, v.deadline, v.generation) == ("granted", 3, 9.0, 4)
    deny = LeaseEvent(LeaseEventKind.DENIAL, cid, 3.0)
    t.observe(EngineState(time=3, seq=2, generation=5, events=(deny,)))
    assert v.status == "granted"  # a later denial does not undo a grant
    t.observe(EngineState(time=4, seq=3, generation=5, events=(LeaseEvent(
        LeaseEventKind.REVOCATION, cid, 4.0, 3),)))  # fmt: skip
    assert v.status == "revoked" and [e["type"] for e in v.events] == [
        "grant",
        "denial",
        "revocation",
    ]


def test_intent_parsing_and_its_notice():
    assert parse_intent({"tool": "t", "expected_tool_s": 2, "expected_result_bytes": 10}) == Intent(
        "t", 2.0, 10
    )
    for bad_body in ({}, {"expected_tool_s": -1}, {"expected_result_bytes": 1.5}, {"x": 1}, []):
        with pytest.raises(ApiError):
            parse_intent(bad_body)
    t, _, _ = table()
    s = t.open("a")
    s.transcript.history = (1, 2, 3)
    s.turn = 2
    n = notice(s, "search")
    assert (n.expected_wait_s, n.payload_bytes, n.cid.turn) == (DEFAULT_TOOL_S, 1024, 2)
    s.harness.intents["search"] = Intent("search", 4.5, 99)
    s.harness.intents["*"] = Intent("*", 0.5, None)
    assert (notice(s, "search").expected_wait_s, notice(s, "search").payload_bytes) == (4.5, 99)
    assert notice(s, "open").expected_wait_s == 0.5
    # one reply's parallel calls: the wait ends with the slowest, the results add up
    both = notice(s, ["search", "open"])
    assert (both.expected_wait_s, both.payload_bytes) == (4.5, 99 + 1024)
    # HEAR's continuation probability travels with the notice when the daemon knows it.
    assert notice(s, "open").continuation_p is None
    assert notice(s, "open", 0.75).continuation_p == 0.75


# ---- events ---------------------------------------------------------------------------


async def test_event_hub_filters_replays_and_bounds():
    hub = EventHub(backlog=3, queue_size=2)
    hub.publish("completion", "a", n=1)
    hub.publish("completion", "b", n=2)
    got: list = []

    async def read(session: str | None, backlog: int) -> None:
        async for ev in hub.subscribe(session, backlog, heartbeat_s=60):
            got.append(ev)

    task = asyncio.create_task(read("a", 10))
    await asyncio.sleep(0)
    hub.on_state(
        EngineState(
            time=1,
            seq=1,
            generation=1,
            events=(LeaseEvent(LeaseEventKind.GRANT, ContinuationId("a", 1), 1.0, 4),),
        )
    )
    for i in range(3):
        hub.publish("completion", "a", n=10 + i)  # the reader is behind: oldest dropped
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    hub.close()
    await asyncio.wait_for(task, 5)
    kinds = [(e["type"], e.get("n")) for e in got]
    assert kinds[0] == ("completion", 1)  # the backlog, only session a
    assert ("dropped", None) in kinds and kinds[-2:] == [("completion", 11), ("completion", 12)]
    assert len(hub.backlog) == 3 and hub.subscribers == 0


# ---- metrics --------------------------------------------------------------------------


def test_metrics_parse_with_vllm_and_ladsd_names():
    state = EngineState(
        time=1, seq=1, generation=1, U=4, B=10, F=50, w=2, a=3, total_blocks=100,
        counters={"grants": 3.0, "handoffs": 2.0, "preemptions": 1.0},
    )  # fmt: skip
    sessions, _, _ = table()
    d = SimpleNamespace(
        state=state,
        model="m",
        stats={"prompt_tokens": 100, "cached_tokens": 64, "requests": 5, "rejected": 1,
               "disconnected": 0},
        rt=None,
        sessions=sessions,
        in_flight=2,
        alive=True,
    )  # fmt: skip
    from prometheus_client import generate_latest

    text = generate_latest(registry(d)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    val = {n: f.samples[0].value for n, f in fams.items()}
    assert val["vllm:num_requests_running"] == 3 and val["vllm:num_requests_waiting"] == 2
    assert val["vllm:kv_cache_usage_perc"] == 0.5
    assert val["vllm:prefix_cache_queries"] == 100 and val["vllm:prefix_cache_hits"] == 64
    assert val["vllm:num_preemptions"] == 1
    assert val["ladsd_lease_grants"] == 3 and val["ladsd_lease_handoffs"] == 2
    assert val["ladsd_lease_protected_blocks"] == 4 and val["ladsd_lease_budget_blocks"] == 10
    assert val["ladsd_requests_rejected"] == 1 and val["ladsd_sessions_active"] == 0
    for name in ("queued_results", "decisions", "promotions", "fallbacks", "link_bytes"):
        assert f"ladsd_delivery_{name}" in val
    for name in ("denials", "expiries", "revocations", "active"):
        assert f"ladsd_lease_{name}" in val


# ---- the app without an engine: error shape, API key, bind rule -------------------------


def test_bind_rule():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "k")
    with pytest.raises(ValueError, match="--api-key"):
        check_bind("0.0.0.0", None)
    with pytest.raises(ValueError, match="--api-key"):
        Daemon(PROFILES["smoke"], "lads", ServeConfig(host="0.0.0.0"))


async def test_app_before_the_engine_starts_key_body_limit_and_errors():
    d = Daemon(PROFILES["smoke"], "lads", ServeConfig(api_key="sekret", max_body_bytes=1024))
    server = TestServer(d.app, host="127.0.0.1")
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    ok = {"Authorization": "Bearer sekret"}
    raw = ok | {"Content-Type": "application/json"}  # a raw JSON body (else 415)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/health") as r:  # open without the key
                assert r.status == 503 and (await r.json())["status"] == "starting"
            async with s.get(f"{base}/v1/models") as r:
                err = (await r.json())["error"]
                assert r.status == 401 and err["code"] == "invalid_api_key"
            async with s.get(f"{base}/v1/models", headers={"Authorization": "Bearer no"}) as r:
                assert r.status == 401
            async with s.get(f"{base}/v1/models", headers=ok) as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
            async with s.post(f"{base}/v1/chat/completions", data=b"x" * 4096, headers=raw) as r:
                err = (await r.json())["error"]
                assert r.status == 413 and err["type"] == "invalid_request_error"
            async with s.post(f"{base}/v1/chat/completions", data=b"{no", headers=raw) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
            b = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
            async with s.post(f"{base}/v1/chat/completions", json=b, headers=ok) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "engine_starting"
            async with s.post(
                f"{base}/v1/chat/completions", json=b | {"model": "x"}, headers=ok
            ) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            async with s.get(f"{base}/v1/sessions/nobody", headers=ok) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "session_not_found"
            async with s.get(f"{base}/nowhere", headers=ok) as r:
                assert r.status == 404 and "error" in await r.json()
            async with s.delete(f"{base}/v1/models", headers=ok) as r:
                assert r.status == 405 and "error" in await r.json()
    finally:
        await server.close()
        if d.catalog is not None:
            d.catalog.close()


def test_request_dataclass_is_frozen():
    r = chat.parse(body())
    assert isinstance(r, ChatRequest)
    with pytest.raises(AttributeError):
        r.model = "x"  # type: ignore[misc]
