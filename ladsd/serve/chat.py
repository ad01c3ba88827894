"""``/v1/chat/completions`` without an engine: the request, parsed and checked.

* :func:`parse` validates an OpenAI chat body into a frozen :class:`ChatRequest`
  (400 with the offending ``param`` otherwise). Sampling honours what vLLM's
  SamplingParams has (``temperature``, ``top_p``, ``frequency_penalty``,
  ``presence_penalty``, ``logit_bias``; vLLM's ``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``). Fields of OpenAI or
  vLLM that ladsd cannot honour are refused, not ignored; fields that change
  nothing here are ignored, and so are fields neither defines, as vLLM does
  (:mod:`.fields`).
* Tools are parsed and checked here; the output schema they make, the reply
  parsed back and the canonical turns are in :mod:`.replies`.
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

from ladsd.serve.envelope import MAX_DEPTH, ToolCall, obj_depth, text_depth
from ladsd.serve.errors import ApiError, bad
from ladsd.serve.fields import refuse

SESSION_HEADER = "x-session-id"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed refuses more, and vLLM calls it in its step
_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")  # session ids (they name engine workflows)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


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
    """How tokens are drawn, as vLLM's SamplingParams has it."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # vLLM's; 0 (or -1): every token
    min_p: float = 0.0  # vLLM's
    repetition_penalty: float = 1.0  # vLLM's
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def knobs(self) -> dict[str, Any]:
        """SamplingParams keywords beyond temperature, top_p and seed."""
        return {
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": dict(self.logit_bias) or None,
        }


@dataclass(frozen=True)
class Tooling:
    """The tools offered and how the reply may call them."""

    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"  # none | auto | required | the name of one offered tool
    parallel_tool_calls: bool = True  # several calls in one reply may be made


@dataclass(frozen=True)
class Output:
    """The reply's length, stops and form, and how it is sent."""

    max_tokens: int | None = None  # None: the rest of the context
    min_tokens: int = 0  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stop: tuple[str, ...] = ()
    json_schema: Mapping[str, Any] | None = None  # response_format
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    session_id: str | None = None  # ladsd's extension (or the x-session-id header)
    sampling: Sampling = field(default_factory=Sampling)
    tooling: Tooling = field(default_factory=Tooling)
    output: Output = field(default_factory=Output)

    @property
    def calls_tools(self) -> bool:
        """Is the output a structured tool call (or the ``content`` envelope)?"""
        return bool(self.tooling.tools) and self.tooling.tool_choice != "none"


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


MAX_LOGIT_BIAS = 1024  # entries
_TOKEN_ID = re.compile(r"^[0-9]{1,9}$")


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


def _sampling(
    body: Mapping[str, Any], temperature: float, top_p: float, seed: int | None
) -> Sampling:
    """The rest of the sampling fields, after ``temperature``, ``top_p`` and ``seed``."""
    top_k = _int(body, "top_k", -1)
    rep = body.get("repetition_penalty")
    if rep is not None and (
        isinstance(rep, bool) or not isinstance(rep, int | float) or not 0 < rep < math.inf
    ):
        raise bad("'repetition_penalty' must be a number > 0", "repetition_penalty")
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        seed=seed,
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
    refuse(body)
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
    # The fields are read in the order they always were: the first bad one is the one named.
    temperature = _num(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _num(body, "top_p", 1e-9, 1.0, 1.0)
    stop = _stop(body.get("stop"))
    seed = _int(body, "seed", 0, SEED_MAX)
    output = Output(
        max_tokens=max_tokens,
        min_tokens=_int(body, "min_tokens", 0) or 0,
        ignore_eos=ignore_eos,
        stop=stop,
        json_schema=schema,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
    )
    sid = session_of(body.get("session_id"), header_session)
    tooling = Tooling(tools, choice, _bool(body, "parallel_tool_calls", True))
    sampling = _sampling(body, temperature, top_p, seed)
    return ChatRequest(model, messages, sid, sampling, tooling, output)


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(
            404,
            f"the model {requested!r} does not exist; this daemon serves {served!r}",
            param="model",
            code="model_not_found",
        )
