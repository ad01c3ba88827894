"""Strict readers of JSON records: every error names where the bad value sits.

Shared by the trace loader (:mod:`.trace`) and the cc-traces loader
(:mod:`.cc_traces`). A :class:`Where` is a path of keys and indexes
(``requests[3].hash_ids[7]``); each loader's subclass says how its errors
name the record (a line, a file) in :meth:`Where.fail`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

Kinds = type | tuple[type, ...]


class Where:
    """Where a value sits (``path``); :meth:`fail` builds the loader's error for it."""

    path: str = ""

    def at(self, name: str | int) -> Any:
        """The place of key ``name`` (or index) inside this one (same subclass)."""
        sub = f"{self.path}.{name}" if isinstance(name, str) else f"{self.path}[{name}]"
        w = copy.copy(self)
        w.path = sub.lstrip(".")
        return w

    def fail(self, what: str) -> Exception:
        raise NotImplementedError


def as_tuple(kinds: Kinds) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def kind_ok(v: Any, kinds: Kinds) -> bool:
    """``v`` is one of ``kinds``; JSON ``true`` is no number unless ``bool`` is asked for."""
    if isinstance(v, bool):
        return bool in as_tuple(kinds)
    return isinstance(v, kinds)


def names(kinds: Kinds) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in as_tuple(kinds))


def get(d: Mapping[str, Any], key: str, kinds: Kinds, w: Where, opt: bool = False) -> Any:
    """``d[key]`` if it is one of ``kinds``; a missing key is None when ``opt``."""
    if key not in d:
        if opt:
            return None
        raise w.at(key).fail("missing field")
    v = d[key]
    if not kind_ok(v, kinds):
        raise w.at(key).fail(f"expected {names(kinds)}, got {type(v).__name__}")
    return v


def obj(v: Any, w: Where) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise w.fail(f"expected an object, got {type(v).__name__}")
    return v
