"""Delivery policies (spec section 4): one module per policy, one interface.

``make_policy(name, **kw)`` builds any of :data:`POLICY_NAMES` without an
engine. Keyword arguments are shared across policies (``theta``,
``max_age_s``, ``output_prior``, ``beta``, ``adapt_s``, ``cap``, ``guard_s``,
``uses_leases``); each policy takes the ones it uses and ignores the rest, so
one config can build every policy. An unknown keyword is an error.
"""

from __future__ import annotations

import inspect
from typing import Any

from ladsd.delivery.base import BasePolicy
from ladsd.delivery.policy import Pending, Policy, SenderView
from ladsd.delivery.registry import CLASSES

# The delivery classes by name, in the registry's order (ladsd.delivery.registry).
POLICIES: dict[str, type[BasePolicy]] = CLASSES
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def _params(cls: type) -> set[str]:
    return {
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


KNOWN_KW: frozenset[str] = frozenset().union(*(_params(c) for c in POLICIES.values()))


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy named ``name`` (one of :data:`POLICY_NAMES`)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    unknown = set(kw) - KNOWN_KW
    if unknown:
        raise ValueError(f"unknown policy option(s) {sorted(unknown)}; known: {sorted(KNOWN_KW)}")
    own = _params(cls)
    return cls(**{k: v for k, v in kw.items() if k in own})


__all__ = ["POLICY_NAMES", "POLICIES", "Pending", "Policy", "SenderView", "make_policy"]
