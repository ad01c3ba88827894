"""The chat reply side, without an engine: tools as prompt text, the output schema,
the reply parsed back, canonical turns, and the response bodies.

* Tools: when tools are offered (and ``tool_choice`` is not ``none``) the output
  is structured (xgrammar) by :func:`output_schema`: one call
  ``{"name": <tool>, "arguments": <its parameters' schema>}``, or with
  ``parallel_tool_calls`` (the default) also ``{"tool_calls": [<call>, ...]}``
  (two or more); with ``auto`` also ``{"content": <text>}``, the model's way to
  answer without a call (with ``response_format``, ``<text>`` is a JSON value
  of its schema). :func:`parse_reply` (:mod:`.envelope`, which also decodes it
  as it streams) turns that JSON back into ``tool_calls`` or content.
* :func:`pieces`: the conversation as canonical ``(role, text)`` turns: an
  assistant tool call is its JSON with its id, a tool message's text starts
  with the id of the call it answers, the tools are described at the end of the
  system turn. Two requests with equal pieces mean the same conversation,
  however the client spelled it (this is how a session recognises its history:
  the call ids the daemon generated come back unchanged).
* The bodies of ``chat.completion`` and its stream's ``chat.completion.chunk``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ladsd.serve.chat import ChatRequest, Message, Tool
from ladsd.serve.envelope import Decoder, Reply, ToolCall

CONTENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


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
            '"arguments": <its arguments>}. To call several at once, reply {"tool_calls": '
            '[<call>, <call>, ...]}. To answer without calling one, reply {"content": <your '
            "answer>}. A function's result comes back in a tool message whose first line is "
            "the id of the call it answers.",
        ]
    )


def _embed(schema: Mapping[str, Any], tag: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema``, to be placed below the root of another: its definitions move to the
    root's ``$defs`` as ``tag.<name>`` and its local refs follow ("#" itself: ``tag``)."""
    local = {
        f"#/{kind}/{name}": d for kind in ("$defs", "definitions")
        if isinstance(schema.get(kind), dict) for name, d in schema[kind].items()
    }  # fmt: skip
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    rooted: list[bool] = []  # a ref into the schema itself: it becomes a definition too

    def ref(r: str) -> str:
        for old in local:
            if r == old or r.startswith(old + "/"):
                return f"#/$defs/{tag}.{old.split('/', 2)[2]}{r[len(old):]}"
        if r == "#" or r.startswith("#/"):
            rooted.append(True)
            return f"#/$defs/{tag}{r[1:]}"
        return r

    def moved(o: Any) -> Any:  # depth <= MAX_DEPTH (checked at parse): recursion is safe
        if isinstance(o, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else moved(v)
                    for k, v in o.items()}  # fmt: skip
        return [moved(v) for v in o] if isinstance(o, list) else o

    for old, d in local.items():
        defs[f"{tag}.{old.split('/', 2)[2]}"] = moved(d)
    out = moved(body)
    if rooted:
        defs[tag] = out
    return out


def call_schema(t: Tool, tag: str, defs: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": _embed(t.parameters, tag, defs)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def output_schema(req: ChatRequest) -> Mapping[str, Any] | None:
    """The JSON schema the output must follow (None: free text).

    A named ``tool_choice`` is one call of it; ``auto`` and ``required`` allow one
    call of any offered tool or, with ``parallel_tool_calls``, a list of two or more;
    ``auto`` also the answer (``response_format``'s schema, or a string).
    """
    tooling = req.tooling
    if not req.calls_tools:
        return req.output.json_schema
    defs: dict[str, Any] = {}
    named = tooling.tool_choice not in ("auto", "required")
    calls = [
        call_schema(t, f"tool{i}", defs)
        for i, t in enumerate(tooling.tools)
        if not named or t.name == tooling.tool_choice
    ]
    branches = list(calls)
    if tooling.parallel_tool_calls and not named:
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        many = {"type": "array", "items": item, "minItems": 2}
        branches.append(_object("tool_calls", many))
    if tooling.tool_choice == "auto":
        answer = req.output.json_schema
        branches.append(
            CONTENT_SCHEMA if answer is None else _object("content", _embed(answer, "answer", defs))
        )
    out = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**out, "$defs": defs} if defs else out


def _object(key: str, value: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }


def decoder(req: ChatRequest) -> Decoder:
    """The envelope decoder of a tools-offered request's output (:mod:`.envelope`)."""
    tools = [t.name for t in req.tooling.tools]
    return Decoder(tools, json_content=req.output.json_schema is not None)


def parse_reply(text: str, req: ChatRequest) -> Reply:
    """The model's whole output as tool calls or content.

    An output cut at ``max_tokens`` while answering is the answer so far; one cut in
    a call (or one that is not the envelope) is content as it is (the finish reason
    says ``length``).
    """
    if not req.calls_tools:
        return Reply(text)
    dec = decoder(req)
    dec.feed(text)
    return dec.reply()


# ---- canonical turns ---------------------------------------------------------------

Piece = tuple[str, str]  # (role, text)


def _call_obj(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)}


def message_text(content: str | None, calls: Sequence[ToolCall]) -> str:
    """An assistant turn: its content, then its call (or ``{"tool_calls": [...]}``), with ids."""
    lines = [content] if content else []
    if len(calls) == 1:
        lines.append(compact(_call_obj(calls[0])))
    elif calls:
        lines.append(compact({"tool_calls": [_call_obj(c) for c in calls]}))
    return "\n".join(lines)


def tool_text(m: Message) -> str:
    """A tool message: the id of the call it answers, then its content."""
    return f"{m.tool_call_id}\n{m.content}"


def pieces(req: ChatRequest) -> tuple[Piece, ...]:
    """The conversation as canonical turns; the tools close the (first) system turn."""
    out = [
        (m.role, tool_text(m) if m.role == "tool" else message_text(m.content, m.tool_calls))
        for m in req.messages
    ]
    if req.tooling.tools:
        text = tools_text(req.tooling.tools)
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
