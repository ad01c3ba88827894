"""OpenAI compatibility that agent frameworks hit (issue 24): the tools-offered output
streamed as it is decoded, several tool calls in one reply with their ids in the prompt,
``response_format`` with tools, sampling fields honoured or refused (never ignored),
deeply nested JSON refused with 400.

The first part needs no engine (the decoder, schemas, parsing, canonical turns); the
second runs the Daemon in process on the tiny dummy-weight model (smoke profile) through
its HTTP server. The tiny model's text is noise: ``logit_bias`` steers it where a test
needs one branch of the output (the grammar masks every token the branch does not allow).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
import pytest_asyncio

from ladsd.engine.params import sampling
from ladsd.serve import chat, fields, replies
from ladsd.serve.envelope import MAX_DEPTH, Decoder, Reply, ToolCall, obj_depth, text_depth
from ladsd.serve.errors import ApiError
from tests.helpers import FORCE, free_port, running, weather_tool

WEATHER = weather_tool(max_len=8)
GUARD_S = 120  # hang guard only


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(b: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat.parse(b)
    return e.value


def tool(name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    p = params or {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": p}}


# ---- the envelope decoder --------------------------------------------------------------

SAMPLES = [
    # (output text, json_content): the answer with every JSON escape and a split-able pair
    ('{"content":"caf\\u00e9 \\"q\\" \\\\ \\/ \\b\\f\\n\\r\\t \\ud83d\\ude00 \\u2603 ok"}', False),
    ('{"content":"plain: \u00e9\u20ac\U0001f600, no escapes"}', False),
    ('{"name":"get_weather","arguments":{"city":"Pa\\"ris \\u00e9","n":[1,2.5e3,{"x":null}]}}',
     False),
    ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},'
     '{"name":"ping","arguments":{}},{"name":"get_weather","arguments":{"city":"}]"}}]}', False),
    ('{ "name" : "ping" , "arguments" : { } }', False),  # whitespace is tolerated
    ('{"content":{"answer":"4 \\"}\\" ","n":[1,{"a":true}]}}', True),  # response_format
    ('{"content":12.5}', True),
    ("The capital is Paris.", False),  # not an envelope: content as it is
    ('{"content":"cut short \\ud83d', False),  # cut while answering: the answer so far
    ('{"name":"get_wea', False),  # cut before a call was known: content as it is
    ('{"name":"get_weather","arguments":{"city":"Os', False),  # cut inside a call
    ('{"name":"nope","arguments":{}}', False),  # not an offered tool
]


def decode(pieces: list[str], json_content: bool = False) -> tuple[list[dict], Reply]:
    ids = iter(f"call_{i}" for i in range(100))
    dec = Decoder(["get_weather", "ping"], json_content=json_content, new_id=ids.__next__)
    deltas = [d for p in pieces for d in dec.feed(p)]
    return deltas + dec.close(), dec.reply()


def assemble(deltas: list[dict]) -> tuple[str, list[list[str]]]:
    """What a client makes of the deltas: content, and [id, name, arguments] per index."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function"
                calls.append([c["id"], c["function"]["name"], c["function"]["arguments"]])
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]][2] += c["function"]["arguments"]
    return content, calls


def without_ids(r: Reply) -> tuple[str | None, list[tuple[str, str]]]:
    return r.content, [(c.name, c.arguments) for c in r.calls]


@pytest.mark.parametrize("text,json_content", SAMPLES)
def test_every_split_point_decodes_the_same(text: str, json_content: bool):
    whole, reply = decode([text], json_content)
    fmt = {"response_format": {"type": "json_object"}} if json_content else {}
    req = chat.parse(body(tools=[WEATHER, tool("ping")], **fmt))
    assert without_ids(replies.parse_reply(text, req)) == without_ids(reply)  # a plain reply
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7)
             for j in range(i, len(text), 5)]  # fmt: skip
    cuts.append(list(text))  # one character at a time
    for pieces in cuts:
        deltas, got = decode(pieces, json_content)
        assert got == reply, pieces
        assert assemble(deltas) == assemble(whole), pieces
    content, calls = assemble(whole)
    if reply.calls:  # the deltas add up to the reply
        assert calls == [[c.id, c.name, c.arguments] for c in reply.calls] and not content
    elif calls:  # a call was streamed, then cut: the plain reply is the text as it is
        assert reply.content == text and not content
    else:
        assert content == reply.content


def test_replies_follow_the_json():
    for text, jc in SAMPLES[:7]:
        deltas, reply = decode([text], jc)
        want = json.loads(text)
        if "content" in want:
            c = want["content"]
            assert reply.content == (c if not jc else text[len('{"content":') : -1])
            assert len([d for d in deltas if "content" in d]) == 1  # one feed, one delta
        else:
            calls = want.get("tool_calls", [want])
            assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
                (c["name"], c["arguments"]) for c in calls
            ]
            assert reply.content is None
    assert decode(["The capital is Paris."])[1] == Reply("The capital is Paris.")
    assert decode(['{"content":"cut short \\ud83d'])[1] == Reply("cut short ")
    assert decode(['{"name":"get_wea'])[1] == Reply('{"name":"get_wea')
    cut = '{"name":"get_weather","arguments":{"city":"Os'
    deltas, reply = decode([cut])
    assert reply == Reply(cut)  # a cut call is content as it is (finish_reason: length)
    assert assemble(deltas)[1] == [["call_0", "get_weather", '{"city":"Os']]  # as streamed


def test_content_streams_before_the_envelope_closes():
    dec = Decoder(["ping"])
    assert dec.feed('{"con') == []
    assert dec.feed('tent":"Hel') == [{"content": "Hel"}]
    assert dec.feed("lo \\ud83") == [{"content": "lo "}]  # half an escape waits
    assert dec.feed("d\\ude") == []  # half a surrogate pair waits
    assert dec.feed('00!"}') == [{"content": "\U0001f600!"}]
    assert dec.close() == [] and dec.reply() == Reply("Hello \U0001f600!")


def test_a_call_streams_its_name_then_its_arguments():
    dec = Decoder(["get_weather"], new_id=lambda: "call_x")
    assert dec.feed('{"name":"get_wea') == []
    first = dec.feed('ther","arguments":{"ci')
    assert first == [
        {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]  # fmt: skip
    assert dec.feed('ty":"Rome"}}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Rome"}'}}]}
    ]
    assert dec.reply() == Reply(None, (ToolCall("call_x", "get_weather", '{"city":"Rome"}'),))


def test_lone_surrogates_become_replacement_characters_utf8_can_send():
    deltas, reply = decode(['{"content":"a\\ud800b\\udc00c\\ud800"}'])
    assert reply.content == "a\ufffdb\ufffdc\ufffd"
    assert orjson.dumps(deltas)  # orjson (the SSE writer) refuses lone surrogates


def test_depth_is_counted_without_recursion():
    deep = "[" * 100_000 + "]" * 100_000
    assert text_depth(deep) == 100_000
    assert text_depth('{"a":"[[[[","b":[{"c":"\\"]]"}]}') == 3
    # an unclosed string runs to the end (its brackets are text); this input made the old
    # backtracking pattern quadratic: seconds per 32 KB, on the event loop
    assert text_depth('"' + '\\"' * 20_000 + "[" * 100) == 0
    assert text_depth('["' + '\\"' * 20_000 + '"]') == 1
    nested: Any = {}
    for _ in range(5_000):
        nested = {"a": [nested]}
    assert obj_depth(nested) == MAX_DEPTH + 1  # stops counting past the bound
    assert obj_depth({"a": [1, {"b": 2}]}) == 3
    # arguments nested past the bound: the decoder leaves the envelope (content as it is)
    text = '{"name":"ping","arguments":{"a":' + deep[:2 * MAX_DEPTH] + "]" * MAX_DEPTH + "}}"
    assert decode([text])[1] == Reply(text)


# ---- output schemas ---------------------------------------------------------------------


def grammar(schema: Any) -> Any:
    xgr = pytest.importorskip("xgrammar")
    # as vLLM compiles it with disable_any_whitespace
    return xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )


def accepts(schema: Any, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar(schema), text)


ONE = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
TWO = ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},'
       '{"name":"ping","arguments":{}}]}')  # fmt: skip
ANSWER = '{"content":"Sunny."}'


def test_parallel_tool_calls_allow_a_list_of_two_or_more():
    tools = [WEATHER, tool("ping")]
    auto = replies.output_schema(chat.parse(body(tools=tools)))
    assert all(accepts(auto, t) for t in (ONE, TWO, ANSWER))
    only_one = '{"tool_calls":[{"name":"ping","arguments":{}}]}'
    assert not accepts(auto, only_one)  # one call has one spelling
    single = replies.output_schema(chat.parse(body(tools=tools, parallel_tool_calls=False)))
    assert accepts(single, ONE) and accepts(single, ANSWER) and not accepts(single, TWO)
    required = replies.output_schema(chat.parse(body(tools=tools, tool_choice="required")))
    assert accepts(required, ONE) and accepts(required, TWO) and not accepts(required, ANSWER)
    named = replies.output_schema(chat.parse(body(tools=tools, tool_choice=FORCE)))
    assert accepts(named, ONE) and not accepts(named, TWO)
    assert refused(body(tools=tools, parallel_tool_calls="yes")).param == "parallel_tool_calls"


def test_response_format_with_tools_shapes_the_answer():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "Out", "schema": schema}}
    req = chat.parse(body(tools=[WEATHER], response_format=fmt))  # refused before: 400
    out = replies.output_schema(req)
    assert accepts(out, '{"content":{"answer":"Oslo"}}') and accepts(out, ONE)
    assert not accepts(out, ANSWER) and not accepts(out, '{"content":{"x":1}}')
    assert replies.parse_reply('{"content":{"answer":"Oslo"}}', req) == Reply('{"answer":"Oslo"}')
    none = chat.parse(body(tools=[WEATHER], tool_choice="none", response_format=fmt))
    assert replies.output_schema(none) == schema
    obj = chat.parse(body(tools=[WEATHER], response_format={"type": "json_object"}))
    assert accepts(replies.output_schema(obj), '{"content":{"k":[1]}}')


def test_definitions_move_to_the_root_with_their_refs():
    """Pydantic-made schemas ($defs, $ref) keep working below the envelope's root."""
    city = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                               "required": ["name"], "additionalProperties": False}},
            "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"], "additionalProperties": False}  # fmt: skip
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["v", "kids"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "T", "schema": tree}}
    req = chat.parse(body(tools=[tool("visit", city)], response_format=fmt))
    out = replies.output_schema(req)
    assert accepts(out, '{"name":"visit","arguments":{"city":{"name":"Oslo"}}}')
    assert not accepts(out, '{"name":"visit","arguments":{"city":"Oslo"}}')
    assert accepts(out, '{"content":{"v":1,"kids":[{"v":2,"kids":[]}]}}')
    assert not accepts(out, '{"content":{"v":1,"kids":[{"v":"x","kids":[]}]}}')


# ---- fields: honoured, refused, ignored --------------------------------------------------


def test_sampling_fields_reach_vllms_sampling_params():
    req = chat.parse(body(top_k=5, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5,
                          presence_penalty=-0.5, logit_bias={"42": 100, "7": -12.5}))  # fmt: skip
    p = sampling(max_tokens=4, temperature=0.7, knobs=req.sampling.knobs())
    assert (p.top_k, p.min_p, p.repetition_penalty) == (5, 0.1, 1.3)
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.5)
    assert p.logit_bias == {42: 100.0, 7: -12.5}
    d = sampling(knobs=chat.parse(body()).sampling.knobs())
    assert (d.top_k, d.min_p, d.repetition_penalty, d.logit_bias) == (0, 0.0, 1.0, None)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(chat.MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True}, "logprobs"),
        ({"n": 3}, "n"), ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"functions": [{"name": "f"}]}, "functions"), ({"stop_token_ids": [3]}, "stop_token_ids"),
        ({"echo": True}, "echo"), ({"guided_json": {}}, "guided_json"),
        ({"cache_salt": "s"}, "cache_salt"), ({"priority": 5}, "priority"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"stream": None, "ignore_eos": "yes"}, "ignore_eos"),
        ({"seed": 2**64}, "seed"),  # torch.Generator.manual_seed refuses it (in the step)
    ],
)  # fmt: skip
def test_fields_ladsd_cannot_honour_are_refused(kw: dict[str, Any], param: str):
    e = refused(body(**kw))
    assert e.status == 400 and e.param == param
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_harmless_fields_are_ignored_and_off_values_accepted():
    harmless = {k: "x" for k in fields.IGNORED} | {"metadata": {"a": "b"}, "store": False}
    offs = {k: off[0] for k, off in fields.REFUSED.items() if off}
    r = chat.parse(body(**harmless, **offs, stream=None, parallel_tool_calls=None, tools=None))
    assert r.sampling == chat.Sampling() and r.tooling.parallel_tool_calls and not r.output.stream
    assert chat.parse(body(top_logprobs=0, logprobs=False)).model == "m"
    assert not set(fields.IGNORED) & set(fields.REFUSED)


# ---- deep JSON ------------------------------------------------------------------------------


def deep_arguments(n: int) -> str:
    return '{"a":' + "[" * n + "]" * n + "}"


def deep_schema(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def call_history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]


def test_deep_json_is_refused_naming_the_param():
    e = refused(body(messages=call_history(deep_arguments(100_000)), tools=[WEATHER]))
    assert e.param == "messages[1].tool_calls[0].function.arguments"
    assert f"deeper than {MAX_DEPTH}" in e.message
    e = refused(body(tools=[tool("deep", deep_schema(500))]))
    assert e.param == "tools[0].function.parameters"
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema(500)}}
    assert refused(body(response_format=fmt)).param == "response_format"
    ok = chat.parse(body(messages=call_history(deep_arguments(MAX_DEPTH - 1)), tools=[WEATHER]))
    assert replies.pieces(ok)  # within the bound: parsed and rendered


# ---- canonical turns: call ids ---------------------------------------------------------------


def test_tool_results_and_calls_carry_their_ids_in_the_prompt():
    req = chat.parse(body(tools=[WEATHER, tool("ping")]))
    reply = replies.parse_reply(TWO, req)
    a, b = reply.calls
    assert a.id != b.id and a.id.startswith("call_")
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(json.loads(c.arguments))}}
        for c in reply.calls]}  # fmt: skip
    nxt = chat.parse(body(tools=[WEATHER, tool("ping")], messages=[
        {"role": "user", "content": "hi"}, echoed,
        {"role": "tool", "tool_call_id": b.id, "content": "pong"},
        {"role": "tool", "tool_call_id": a.id, "content": "Rain"}]))  # fmt: skip
    turns = (*replies.pieces(req), replies.reply_piece(reply))
    got = replies.pieces(nxt)
    assert got[: len(turns)] == turns  # the session recognises its history
    call_json = json.loads(turns[-1][1])
    assert [c["id"] for c in call_json["tool_calls"]] == [a.id, b.id]
    assert got[len(turns):] == (("tool", f"{b.id}\npong"), ("tool", f"{a.id}\nRain"))
    one = replies.reply_piece(replies.parse_reply(ONE, req))
    assert json.loads(one[1])["id"].startswith("call_")
    assert "id of the call" in replies.tools_text(req.tooling.tools)


# ---- through the daemon's HTTP server (tiny model) ------------------------------------------

engine = pytest.mark.engine
on_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(model_ready) -> AsyncIterator[Any]:
    from ladsd.config import PROFILES
    from ladsd.serve.daemon import Daemon, ServeConfig

    d = Daemon(PROFILES["smoke"], "lads", ServeConfig(port=free_port()))
    async with running(d, GUARD_S):
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def client(daemon: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{daemon.cfg.port}/v1", api_key="unused", max_retries=0,
        timeout=GUARD_S,
    )  # fmt: skip
    yield c
    await c.close()


def token(daemon: Any, text: str) -> int:
    (tid,) = daemon.rt.tokenizer.encode(text, add_special_tokens=False)
    return tid


def toward(daemon: Any, *texts: str, containing: str | None = None) -> dict[str, int]:
    """A logit_bias of +100 for these tokens (and for every token containing ``containing``)."""
    bias = {str(token(daemon, t)): 100 for t in texts}
    if containing is not None:
        vocab = daemon.rt.tokenizer.get_vocab()
        bias |= {str(i): 100 for k, i in vocab.items() if containing in k}
    return bias


async def collect(stream: Any) -> tuple[list[Any], str, list[list[str]], str | None]:
    """Chunks, content, [id, name, arguments] per call, finish reason of a chat stream."""
    chunks = [ch async for ch in stream]
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks if ch.choices]
    for d in deltas:
        d.pop("role", None)
        for c in d.get("tool_calls", []):
            c.get("function", {}).setdefault("arguments", "")
    content, calls = assemble(deltas)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    return chunks, content, calls, finish


@engine
@on_loop
async def test_a_tools_offered_answer_streams_in_many_chunks(daemon: Any, client: Any):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Say something long."}],
          "tools": [WEATHER], "max_tokens": 24, "temperature": 0,
          "logit_bias": toward(daemon, "content")}  # the answer branch, then any text  # fmt: skip
    stream = await client.chat.completions.create(**kw, stream=True)
    chunks, content, calls, finish = await collect(stream)
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    assert len([t for t in texts if t]) > 1  # not one chunk at the end (TTFT = generation)
    assert not calls and finish == "length" and content
    whole = await client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == content  # streamed == plain reply
    assert whole.choices[0].message.tool_calls is None


@engine
@on_loop
async def test_a_streamed_call_sends_id_and_name_first_then_arguments(daemon: Any, client: Any):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Paris?"}],
          "tools": [WEATHER], "tool_choice": FORCE, "max_tokens": 40, "temperature": 0}
    stream = await client.chat.completions.create(**kw, stream=True)
    chunks, content, calls, finish = await collect(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(deltas) > 1 and all(d.tool_calls[0].id is None for d in deltas[1:])
    assert finish == "tool_calls" and not content and len(calls) == 1
    assert "city" in json.loads(calls[0][2])
    whole = await client.chat.completions.create(**kw)
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0][2]


@engine
@on_loop
async def test_several_calls_in_one_reply_and_their_results_by_id(daemon: Any, client: Any):
    tools = [tool("ping"), tool("pong")]
    msgs = [{"role": "user", "content": "Ping and pong."}]
    # toward the list ("tool" of "tool_calls") and its end (a token holding "]")
    bias = toward(daemon, "tool", containing="]")
    sid = {"x-session-id": "par"}
    r = await client.chat.completions.create(
        model="tiny", messages=msgs, tools=tools, tool_choice="required", max_tokens=60,
        temperature=0, logit_bias=bias, extra_headers=sid,
    )  # fmt: skip
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) >= 2, r
    assert len({c.id for c in m.tool_calls}) == len(m.tool_calls)
    msgs.append(m.model_dump(exclude_none=True))
    msgs += [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}"}
             for i, c in reversed(list(enumerate(m.tool_calls)))]  # fmt: skip
    nxt = await client.chat.completions.create(
        model="tiny", messages=msgs, tools=tools, tool_choice="none", max_tokens=4,
        temperature=0, extra_headers=sid,
    )  # fmt: skip
    assert nxt.choices[0].finish_reason in ("stop", "length")
    done = [e for e in daemon.events.backlog
            if e["type"] == "completion" and e["session_id"] == "par"]  # fmt: skip
    assert done[-1]["bound"] is not None  # the echoed calls (ids) were recognised: extended
    history = r.usage.prompt_tokens + r.usage.completion_tokens
    assert nxt.usage.prompt_tokens_details.cached_tokens >= history - 32  # whole blocks of it


@engine
@on_loop
async def test_response_format_with_tools_answers_json_of_the_schema(daemon: Any, client: Any):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    r = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Answer."}], tools=[WEATHER],
        response_format={"type": "json_schema", "json_schema": {"name": "Out", "schema": schema}},
        max_tokens=40, temperature=0, logit_bias=toward(daemon, "content"),
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["answer"], str)


@engine
@on_loop
async def test_sampling_fields_are_honoured_or_refused(daemon: Any, client: Any):
    tid = token(daemon, "content")
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
          "temperature": 0}  # fmt: skip
    r = await client.chat.completions.create(**kw, logit_bias={str(tid): 100})
    assert r.choices[0].message.content == daemon.rt.tokenizer.decode([tid] * 4)
    r = await client.chat.completions.create(
        **kw, frequency_penalty=1.0, presence_penalty=0.5,
        extra_body={"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.2},
    )  # fmt: skip
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(**kw, logprobs=False, top_logprobs=2)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(**kw, logit_bias={"10000000": 5})
    assert e.value.param == "logit_bias" and "vocabulary" in e.value.message


@engine
@on_loop
async def test_deep_json_is_a_400_over_http_never_a_500(daemon: Any):
    import aiohttp

    url = f"http://127.0.0.1:{daemon.cfg.port}/v1/chat/completions"
    n = 495  # the schema ~1,000 deep (as text: encoders stop far earlier)
    schema = '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n
    deep_tool = '{"type":"function","function":{"name":"deep","parameters":' + schema + "}}"
    bodies = [
        (orjson.dumps({"model": "tiny", "messages": call_history(deep_arguments(100_000)),
                       "tools": [WEATHER]}), "messages[1].tool_calls[0].function.arguments"),
        ('{"model":"tiny","messages":[{"role":"user","content":"x"}],"tools":[' + deep_tool
         + "]}", "tools[0].function.parameters"),
    ]  # fmt: skip
    got = []
    async with aiohttp.ClientSession() as http:
        for b, _ in bodies:
            async with http.post(url, data=b,
                                 headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                got.append((r.status, await r.json()))
        async with http.get(f"http://127.0.0.1:{daemon.cfg.port}/health") as r:
            assert r.status == 200
    assert [s for s, _ in got] == [400, 400], got
    for (_, out), (_, param) in zip(got, bodies, strict=True):
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert out["error"]["param"] == param
        assert out["error"]["type"] == "invalid_request_error"
