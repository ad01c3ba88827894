"""The tools-offered output (an xgrammar-constrained JSON envelope), decoded as it streams.

With tools offered the model writes one of (:func:`ladsd.serve.replies.output_schema`):

* ``{"content": <the answer>}``: a JSON string, or with ``response_format`` the
  JSON value of the response schema (its text is the answer);
* ``{"name": <tool>, "arguments": {...}}``: one call;
* ``{"tool_calls": [<call>, <call>, ...]}``: several (``parallel_tool_calls``).

:class:`Decoder` reads it in pieces split anywhere (the engine's text deltas)
and emits OpenAI stream deltas as soon as they are known: the answer's text as
it is decoded (JSON escapes, ``\\uXXXX`` surrogate pairs split across pieces; a
lone surrogate becomes U+FFFD, which UTF-8 can carry), a call's id, type and
name once its name is complete, then its arguments' JSON text as it comes.
:meth:`Decoder.reply` is what those deltas add up to; a plain (non-streamed)
reply is the same decoder fed the whole text, so both agree. One exception: a
call cut before its envelope closes (``max_tokens``) has streamed its partial
deltas, but its reply, and so the session's record, is the raw text as
content (partial arguments are no JSON a client could send back); the finish
reason says ``length`` either way.

An output that is not such an envelope (it never was one, or was cut before
anything was emitted) is content as it is. JSON the daemon parses is nested at
most :data:`MAX_DEPTH` levels, checked without recursion (:func:`text_depth`,
:func:`obj_depth`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # objects/arrays in tool schemas, response schemas, call arguments
_WS = " \t\n\r"
_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_SCALAR = frozenset("0123456789+-.eEtrufalsn")  # the characters of numbers, true, false, null
_NAME_MAX = 128  # keys and tool names (tool names are at most 64)
# Possessive, and an unclosed string runs to the end: linear on any input (the
# backtracking form took seconds on 32 KB of '"\\"\\"...', on the event loop).
_STRINGS = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\Z)', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")

Parser = Generator[None, str, Any]  # is sent one character at a time


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)


@dataclass(frozen=True)
class Reply:
    content: str | None
    calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def text_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (strings skipped); no recursion."""
    depth = top = 0
    for ch in _NOT_BRACKETS.sub("", _STRINGS.sub("", text)):
        depth += 1 if ch in "[{" else -1
        top = max(top, depth)
    return top


def obj_depth(obj: Any, bound: int = MAX_DEPTH) -> int:
    """How deep parsed JSON nests (dicts and lists), counted up to ``bound`` + 1; no recursion."""
    top, stack = 0, [(obj, 1)]
    while stack and top <= bound:
        o, d = stack.pop()
        kids = o.values() if isinstance(o, dict) else o if isinstance(o, list) else None
        if kids is not None:
            top = max(top, d)
            stack.extend((k, d + 1) for k in kids)
    return top


class _Off(Exception):
    """The output left the envelope's shape."""


class Decoder:
    """One output's envelope, fed in pieces (:meth:`feed`), ended by :meth:`close`."""

    def __init__(
        self,
        names: Collection[str],
        *,
        json_content: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.names = frozenset(names)
        self.json_content = json_content  # the answer is a JSON value (response_format)
        self.new_id = new_id
        self.text: list[str] = []  # every piece fed
        self.content: list[str] | None = None  # the answer's text (None: not that branch)
        self.calls: list[tuple[str, str, list[str]]] = []  # id, name, the arguments' pieces
        self.complete = False  # the envelope closed
        self.mode = "envelope"  # envelope | raw (not one: passed through) | off (left it)
        self._out: list[list[Any]] = []  # deltas not returned yet: [kind, index, parts]
        self._emitted = False
        self._gen = self._envelope()
        next(self._gen)

    # ---- the interface ------------------------------------------------------------
    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The OpenAI deltas that ``piece`` (the next text of the output) makes known."""
        self.text.append(piece)
        if self.mode == "raw":
            self._put("content", 0, piece)
        elif self.mode == "envelope":
            for ch in piece:
                try:
                    self._gen.send(ch)
                except _Off:
                    self._leave()
                    break
        return self._flush()

    def close(self) -> list[dict[str, Any]]:
        """The deltas a stream still owes at the end: an output that emitted nothing is its
        reply's content (e.g. cut inside the first key)."""
        if not self._emitted and (content := self.reply().content):
            self._put("content", 0, content)
        return self._flush()

    def reply(self) -> Reply:
        """The reply the output makes; a cut or broken call is content as it is."""
        text = "".join(self.text)
        if self.mode == "raw":
            return Reply(text)
        if self.content is not None:
            return Reply("".join(self.content))
        if self.complete and self.calls:
            return Reply(None, tuple(ToolCall(i, n, "".join(a)) for i, n, a in self.calls))
        return Reply(text)

    # ---- deltas ---------------------------------------------------------------------
    def _leave(self) -> None:
        if self._emitted:
            self.mode = "off"  # what was sent stands; the rest is not streamed
        else:
            self.mode = "raw"
            self._put("content", 0, "".join(self.text))

    def _put(self, kind: str, index: int, part: Any) -> None:
        self._emitted = True
        last = self._out[-1] if self._out else None
        if kind != "call" and last is not None and last[:2] == [kind, index]:
            last[2].append(part)
        else:
            self._out.append([kind, index, [part]])

    def _flush(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, index, parts in self._out:
            if kind == "call":
                cid, name = parts[0]
                fn = {"name": name, "arguments": ""}
                call = {"index": index, "id": cid, "type": "function", "function": fn}
                out.append({"tool_calls": [call]})
            elif text := "".join(parts):
                if kind == "content":
                    out.append({"content": text})
                else:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        self._out = []
        return out

    # ---- the parser (a generator sent one character at a time) ---------------------------
    def _envelope(self) -> Parser:
        c = yield from self._ws((yield))
        if c != "{":
            raise _Off
        key, c = yield from self._key((yield))
        if key == "content":
            self.content = []
            c = yield from self._content(c)
        elif key == "name":
            c = yield from self._call(c)
        elif key == "tool_calls":
            c = yield from self._call_list(c)
        else:
            raise _Off
        c = yield from self._ws(c)
        if c != "}":
            raise _Off
        self.complete = True
        while True:
            if (yield) not in _WS:
                raise _Off

    def _ws(self, c: str) -> Parser:
        while c in _WS:
            c = yield
        return c

    def _key(self, c: str) -> Parser:
        """A member's key and ``:``; returns (key, the first character of its value)."""
        buf: list[str] = []
        yield from self._string((yield from self._ws(c)), buf.append, _NAME_MAX)
        c = yield from self._ws((yield))
        if c != ":":
            raise _Off
        return "".join(buf), (yield from self._ws((yield)))

    def _string(self, c: str, put: Callable[[str], Any], limit: int | None = None) -> Parser:
        """A JSON string from its opening quote ``c`` through its closing one, decoded."""
        if c != '"':
            raise _Off
        high, n = None, 0  # a high surrogate waiting for its low half
        while True:
            c = yield
            if c == '"':
                code = -1
            elif c == "\\":
                e = yield
                if e == "u":
                    code = yield from self._hex4()
                elif e in _ESC:
                    code = ord(_ESC[e])
                else:
                    raise _Off
            elif c < " ":
                raise _Off  # JSON strings hold no raw control characters
            else:
                code = ord(c)
            if high is not None:
                if 0xDC00 <= code < 0xE000:
                    put(chr(0x10000 + (high - 0xD800) * 0x400 + code - 0xDC00))
                    high = None
                    continue
                put("\ufffd")
                high = None
            if code == -1:
                return None
            if 0xD800 <= code < 0xDC00:
                high = code
                continue
            put("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))
            n += 1
            if limit is not None and n > limit:
                raise _Off

    def _hex4(self) -> Parser:
        v = 0
        for _ in range(4):
            h = yield
            if h not in _HEX:
                raise _Off
            v = v * 16 + int(h, 16)
        return v

    def _raw(self, c: str, put: Callable[[str], Any]) -> Parser:
        """One JSON value passed through as text; returns the character after it."""
        if c in "{[":
            depth, in_str, esc = 0, False, False
            while True:
                put(c)
                if in_str:
                    esc, in_str = (False, True) if esc else (c == "\\", c != '"')
                elif c == '"':
                    in_str = True
                elif c in "{[":
                    depth += 1
                    if depth > MAX_DEPTH:
                        raise _Off
                elif c in "}]":
                    depth -= 1
                    if depth == 0:
                        return (yield)
                c = yield
        if c == '"':
            put(c)
            esc = False
            while True:
                c = yield
                put(c)
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    return (yield)
        if c not in _SCALAR:
            raise _Off
        while c in _SCALAR:
            put(c)
            c = yield
        return c

    def _content(self, c: str) -> Parser:
        assert self.content is not None
        content = self.content

        def put(s: str) -> None:
            content.append(s)
            self._put("content", 0, s)

        if self.json_content:
            return (yield from self._raw(c, put))
        yield from self._string(c, put)
        return (yield)

    def _call(self, c: str) -> Parser:
        """A call from its name's value on; returns the first character after its members."""
        buf: list[str] = []
        yield from self._string(c, buf.append, _NAME_MAX)
        name = "".join(buf)
        if name not in self.names:
            raise _Off
        index, cid, args = len(self.calls), self.new_id(), []
        self.calls.append((cid, name, args))
        self._put("call", index, (cid, name))
        if (yield from self._ws((yield))) != ",":
            raise _Off
        key, c = yield from self._key((yield))
        if key != "arguments" or c != "{":
            raise _Off

        def put(s: str) -> None:
            args.append(s)
            self._put("args", index, s)

        c = yield from self._raw(c, put)
        try:  # nested at most MAX_DEPTH: json.loads cannot exhaust its recursion
            ok = isinstance(json.loads("".join(args)), dict)
        except ValueError:
            ok = False
        if not ok:
            raise _Off
        return (yield from self._ws(c))

    def _call_list(self, c: str) -> Parser:
        if c != "[":
            raise _Off
        c = yield from self._ws((yield))
        while True:
            if c != "{":
                raise _Off
            key, c = yield from self._key((yield))
            if key != "name" or (yield from self._call(c)) != "}":
                raise _Off
            c = yield from self._ws((yield))
            if c == "]":
                return (yield)
            if c != ",":
                raise _Off
            c = yield from self._ws((yield))
