"""``/v1/chat/completions`` without an engine: the request, tool schemas, the reply.

* :func:`parse` validates an OpenAI chat body into a frozen :class:`ChatRequest`
  (400 with the offending ``param`` otherwise). Fields OpenAI has and ladsd
  cannot honour (``n`` > 1, ``logprobs``, penalties) are refused, not ignored;
  fields that change nothing here (``user``, ``metadata``, ``store``, ...) are
  ignored, as OpenAI-compatible servers do.
* Tools: when tools are offered (and ``tool_choice`` is not ``none``) the output
  is structured (xgrammar) by :func:`output_schema`: one object
  ``{"name": <tool>, "arguments": <its parameters' schema>}``; with ``auto``
  also ``{"content": <text>}``, the model's way to answer without a call.
  :func:`parse_reply` turns that JSON back into ``tool_calls`` or content.
* :func:`pieces`: the conversation as canonical ``(role, text)`` turns: an
  assistant tool call is its JSON, the tools are described at the end of the
  system turn. Two requests with equal pieces mean the same conversation,
  however the client spelled it (this is how a session recognises its history).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ladsd.serve.errors import ApiError, bad

SESSION_HEADER = "x-session-id"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")  # session ids (they name engine workflows)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CONTENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool ("developer" is read as system)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"  # none | auto | required | the name of one offered tool
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    json_schema: Mapping[str, Any] | None = None  # response_format
    min_tokens: int = 0  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    session_id: str | None = None

    @property
    def calls_tools(self) -> bool:
        """Is the output a structured tool call (or the ``content`` envelope)?"""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class Reply:
    content: str | None
    calls: tuple[ToolCall, ...] = ()


# ---- parsing -------------------------------------------------------------------


def _num(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise bad(f"'{key}' must be a number in [{lo:g}, {hi:g}]", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(f"'{key}' must be an integer >= {lo}", key)
    return v


def _text(content: Any, where: str, *, optional: bool = False) -> str:
    """A message's content: a string or a list of text parts."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text content parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs a string 'text'", where)
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _args(text: Any, where: str) -> str:
    if not isinstance(text, str):
        raise bad(f"{where} must be a string holding a JSON object", where)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise bad(f"{where} is not valid JSON", where) from None
    if not isinstance(obj, dict):
        raise bad(f"{where} must be a JSON object", where)
    return text


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"{where} must be a list", where)
    calls = []
    for j, c in enumerate(raw):
        w = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{w} needs function.name", w)
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{w}.id must be a non-empty string", f"{w}.id")
        calls.append(
            ToolCall(cid, fn["name"], _args(fn.get("arguments"), f"{w}.function.arguments"))
        )
    return tuple(calls)


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
    role = "system" if role == "developer" else role
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    content = _text(m.get("content"), f"{where}.content", optional=role == "assistant")
    if role == "assistant" and not content and not calls:
        raise bad(f"{where}: an assistant message needs content or tool_calls", where)
    tcid = m.get("tool_call_id")
    if role == "tool" and (not isinstance(tcid, str) or not tcid):
        raise bad(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id")
    return Message(role, content, calls, tcid if role == "tool" else None)


def _tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad("'tools' must be a list", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", f"{where}.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object", where)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise bad(f"{where}.function.description must be a string", where)
        if any(x.name == name for x in tools):
            raise bad(f"tool {name!r} is offered twice", "tools")
        tools.append(Tool(name, desc, params))
    return tuple(tools)


def _tool_choice(raw: Any, tools: Sequence[Tool]) -> str:
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        choice = raw
    elif isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        choice = raw["function"].get("name")
        if not isinstance(choice, str) or all(t.name != choice for t in tools):
            raise bad(f"tool_choice names {choice!r}, which is not in 'tools'", "tool_choice")
    else:
        raise bad("'tool_choice' must be none, auto, required or a named function", "tool_choice")
    if choice != "none" and not tools:
        raise bad("'tool_choice' needs 'tools'", "tool_choice")
    return choice


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    ok = isinstance(stops, list) and len(stops) <= MAX_STOP
    if not ok or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP}", "stop")
    return tuple(stops)


def _response_format(raw: Any) -> Mapping[str, Any] | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(raw.get("json_schema"), dict):
        schema = raw["json_schema"].get("schema")
        if isinstance(schema, dict):
            return schema
    raise bad("'response_format' must be text, json_object or json_schema", "response_format")


def session_of(body_value: Any, header: str | None) -> str | None:
    sid = header if header is not None else body_value
    if sid is None:
        return None
    if not isinstance(sid, str) or not _ID.match(sid):
        raise bad("a session id is 1-128 characters of A-Z a-z 0-9 _ . : @ -", "session_id")
    return sid


def parse(body: Any, header_session: str | None = None) -> ChatRequest:
    """Validate an OpenAI chat body; raise :class:`ApiError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(msgs))
    if body.get("n") not in (None, 1):
        raise bad("only n = 1 is supported", "n")
    if body.get("logprobs"):
        raise bad("logprobs are not supported", "logprobs")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"'{key}' is not supported (only 0)", key)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    schema = _response_format(body.get("response_format"))
    if schema is not None and tools and choice != "none":
        raise bad("'response_format' with tools needs tool_choice none", "response_format")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise bad("'stream_options' must be {'include_usage': bool}", "stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be a boolean", "ignore_eos")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 1e-9, 1.0, 1.0),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        seed=_int(body, "seed", 0),
        json_schema=schema,
        min_tokens=_int(body, "min_tokens", 0) or 0,
        ignore_eos=ignore_eos,
        session_id=session_of(body.get("session_id"), header_session),
    )


# ---- tools: prompt text, output schema, reply ------------------------------------


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def tools_text(tools: Sequence[Tool]) -> str:
    """What the model reads about the tools (the end of the system turn)."""
    specs = [
        compact({"name": t.name, "description": t.description, "parameters": t.parameters})
        for t in tools
    ]
    return "\n".join(
        [
            "# Tools",
            "",
            "You may call these functions:",
            *specs,
            "",
            'To call a function, reply with one JSON object: {"name": <function name>, '
            '"arguments": <its arguments>}. To answer without calling one, reply '
            '{"content": <your answer>}. A function\'s result comes back in a tool message.',
        ]
    )


def call_schema(t: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def output_schema(req: ChatRequest) -> Mapping[str, Any] | None:
    """The JSON schema the output must follow (None: free text)."""
    if not req.calls_tools:
        return req.json_schema
    offered = [t for t in req.tools if req.tool_choice in ("auto", "required", t.name)]
    branches = [call_schema(t) for t in offered]
    if req.tool_choice == "auto":
        branches.append(CONTENT_SCHEMA)
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_reply(text: str, req: ChatRequest) -> Reply:
    """The model's output as a tool call or content.

    An output cut at ``max_tokens`` is not complete JSON: it is returned as
    content, as it is (the finish reason says ``length``).
    """
    if not req.calls_tools:
        return Reply(text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return Reply(text)
    if isinstance(obj, dict) and isinstance(obj.get("arguments"), dict):
        if any(t.name == obj.get("name") for t in req.tools):
            return Reply(None, (ToolCall(new_call_id(), obj["name"], compact(obj["arguments"])),))
    if isinstance(obj, dict) and isinstance(obj.get("content"), str):
        return Reply(obj["content"])
    return Reply(text)


# ---- canonical turns ---------------------------------------------------------------

Piece = tuple[str, str]  # (role, text)


def call_text(c: ToolCall) -> str:
    return compact({"name": c.name, "arguments": json.loads(c.arguments)})


def message_text(content: str | None, calls: Sequence[ToolCall]) -> str:
    lines = [content] if content else []
    return "\n".join([*lines, *(call_text(c) for c in calls)])


def pieces(req: ChatRequest) -> tuple[Piece, ...]:
    """The conversation as canonical turns; the tools close the (first) system turn."""
    out = [(m.role, message_text(m.content, m.tool_calls)) for m in req.messages]
    if req.tools:
        text = tools_text(req.tools)
        if out[0][0] == "system":
            out[0] = ("system", f"{out[0][1]}\n\n{text}")
        else:
            out.insert(0, ("system", text))
    return tuple(out)


def reply_piece(reply: Reply) -> Piece:
    return ("assistant", message_text(reply.content, reply.calls))


# ---- response bodies -----------------------------------------------------------------


def finish_reason(engine_reason: str | None, reply: Reply) -> str:
    if reply.calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def calls_body(calls: Sequence[ToolCall], *, index: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        item: dict[str, Any] = {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        if index:
            item["index"] = i
        out.append(item)
    return out


def message_body(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        msg["tool_calls"] = calls_body(reply.calls)
    return msg


def completion_body(
    rid: str, created: int, model: str, reply: Reply, finish: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message_body(reply), "finish_reason": finish, "logprobs": None}
        ],
        "usage": use,
    }


def chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta`` None gives the usage-only chunk (no choices)."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(
            404,
            f"the model {requested!r} does not exist; this daemon serves {served!r}",
            param="model",
            code="model_not_found",
        )
