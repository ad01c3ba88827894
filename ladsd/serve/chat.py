"""``/v1/chat/completions`` without an engine: the request, tool schemas, the reply.

* :func:`parse` validates an OpenAI chat body into a frozen :class:`ChatRequest`
  (400 with the offending ``param`` otherwise). Sampling honours what vLLM's
  SamplingParams has (``temperature``, ``top_p``, ``frequency_penalty``,
  ``presence_penalty``, ``logit_bias``; vLLM's ``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``). Fields of OpenAI or
  vLLM that ladsd cannot honour (:data:`REFUSED`: ``n`` > 1, ``logprobs``,
  ``top_logprobs``, audio, beam search, ...) are refused, not ignored; fields
  that change nothing here (:data:`IGNORED`: ``user``, ``metadata``, ``store``,
  ...) are ignored, and so are fields neither defines, as vLLM does.
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
* JSON the daemon parses (tool schemas, ``response_format``, call arguments)
  is nested at most ``MAX_DEPTH`` (64) levels.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ladsd.serve.envelope import (
    MAX_DEPTH,
    Decoder,
    Reply,
    ToolCall,
    obj_depth,
    text_depth,
)
from ladsd.serve.errors import ApiError, bad

SESSION_HEADER = "x-session-id"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed refuses more, and vLLM calls it in its step
_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")  # session ids (they name engine workflows)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CONTENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


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
class Sampling:
    """Sampling beyond temperature and top_p, as vLLM's SamplingParams has it."""

    top_k: int = 0  # vLLM's; 0 (or -1): every token
    min_p: float = 0.0  # vLLM's
    repetition_penalty: float = 1.0  # vLLM's
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def knobs(self) -> dict[str, Any]:
        """SamplingParams keywords."""
        return {
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": dict(self.logit_bias) or None,
        }


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
    parallel_tool_calls: bool = True  # several calls in one reply may be made
    sampling: Sampling = field(default_factory=Sampling)

    @property
    def calls_tools(self) -> bool:
        """Is the output a structured tool call (or the ``content`` envelope)?"""
        return bool(self.tools) and self.tool_choice != "none"


# ---- parsing -------------------------------------------------------------------


def _num(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise bad(f"'{key}' must be a number in [{lo:g}, {hi:g}]", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be an integer {span}", key)
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
    if text_depth(text) > MAX_DEPTH:  # before json.loads, whose recursion it would exhaust
        raise bad(f"{where} is nested deeper than {MAX_DEPTH} levels", where)
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
        if obj_depth(params) > MAX_DEPTH:
            raise bad(
                f"{where}.function.parameters is nested deeper than {MAX_DEPTH} levels",
                f"{where}.function.parameters",
            )
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
            if obj_depth(schema) > MAX_DEPTH:
                raise bad(f"the schema is nested deeper than {MAX_DEPTH} levels", "response_format")
            return schema
    raise bad("'response_format' must be text, json_object or json_schema", "response_format")


# Fields OpenAI or vLLM define that ladsd does not honour: refused unless absent, null or
# one of these values (which mean "off").
REFUSED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),  # needs logprobs
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "functions": (),  # the deprecated form of tools
    "function_call": (),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "prompt_logprobs": (0,),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "chat_template_kwargs": (),
    "documents": (),
    "mm_processor_kwargs": (),
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "priority": (0,),  # the delivery policy orders requests
    "cache_salt": (),  # a client asking for cache isolation must not be silently shared
    "kv_transfer_params": (),
    "vllm_xargs": (),
}
# Fields that change nothing here (OpenAI's bookkeeping, hints for other models): ignored.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",  # the model does not reason
        "verbosity",
        "request_id",
    }
)
MAX_LOGIT_BIAS = 1024  # entries
_TOKEN_ID = re.compile(r"^[0-9]{1,9}$")


def _refuse(body: Mapping[str, Any]) -> None:
    for key, off in REFUSED.items():
        v = body.get(key)
        if v is not None and v not in off:
            only = f" (only {json.dumps(off[0])})" if off else ""
            raise bad(f"'{key}' is not supported{only}", key)


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    if raw is None:
        return ()
    msg = f"'logit_bias' maps up to {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]"
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad(msg, "logit_bias")
    out = []
    for k, v in raw.items():
        num = isinstance(v, int | float) and not isinstance(v, bool)
        if not _TOKEN_ID.match(str(k)) or not num or not -100 <= v <= 100:
            raise bad(msg, "logit_bias")
        out.append((int(k), float(v)))
    return tuple(sorted(out))


def _sampling(body: Mapping[str, Any]) -> Sampling:
    top_k = _int(body, "top_k", -1)
    rep = body.get("repetition_penalty")
    if rep is not None and (
        isinstance(rep, bool) or not isinstance(rep, int | float) or not 0 < rep < math.inf
    ):
        raise bad("'repetition_penalty' must be a number > 0", "repetition_penalty")
    return Sampling(
        top_k=0 if top_k is None else top_k,
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        repetition_penalty=1.0 if rep is None else float(rep),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


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
    _refuse(body)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    schema = _response_format(body.get("response_format"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options") or {}
    if (
        not isinstance(opts, dict)
        or not isinstance(opts.get("include_usage", False), bool)
        or opts.get("continuous_usage_stats")  # vLLM's usage in every chunk
    ):
        raise bad("'stream_options' must be {'include_usage': bool}", "stream_options")
    ignore_eos = _bool(body, "ignore_eos", False)
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
        seed=_int(body, "seed", 0, SEED_MAX),
        json_schema=schema,
        min_tokens=_int(body, "min_tokens", 0) or 0,
        ignore_eos=ignore_eos,
        session_id=session_of(body.get("session_id"), header_session),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        sampling=_sampling(body),
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
    if not req.calls_tools:
        return req.json_schema
    defs: dict[str, Any] = {}
    named = req.tool_choice not in ("auto", "required")
    calls = [
        call_schema(t, f"tool{i}", defs)
        for i, t in enumerate(req.tools)
        if not named or t.name == req.tool_choice
    ]
    branches = list(calls)
    if req.parallel_tool_calls and not named:
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        many = {"type": "array", "items": item, "minItems": 2}
        branches.append(_object("tool_calls", many))
    if req.tool_choice == "auto":
        answer = req.json_schema
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
    return Decoder([t.name for t in req.tools], json_content=req.json_schema is not None)


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
