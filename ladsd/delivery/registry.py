"""The one policy registry: every run name with its label, group, delivery class and engine.

A *run name* names what a run compares: a delivery policy (``lads``), an engine
policy alone, which delivers FIFO on that engine (``augserve``), or both
(``augserve+lads``). :data:`REGISTRY` lists the named ones in the catalogue's
order (labels, plot colours); every list the CLI, the plan, the tables and the
plots use is derived from it here. :class:`RunName` is a run name parsed once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from ladsd.delivery.base import BasePolicy
from ladsd.delivery.cache_first import CacheFirst, CacheFirstNoLeases
from ladsd.delivery.fifo import Fifo
from ladsd.delivery.hear import HearCacheAware, HearGuard, HearSession
from ladsd.delivery.lads import Lads, LadsDenial, TurnoverOff
from ladsd.delivery.lads_adaptive import LadsAdaptive
from ladsd.delivery.size_first import SizeFirst
from ladsd.delivery.tail_release import TailRelease
from ladsd.delivery.ttl_pin import TtlPin
from ladsd.modes import EnginePolicy, Retention

VLLM, AUGSERVE = EnginePolicy.VLLM, EnginePolicy.AUGSERVE


class Group(StrEnum):
    OURS = "ours"  # the candidate every reduction is about
    BASELINE = "baseline"
    ABLATION = "ablation"
    LIMIT = "limit"  # the infinite-cache reference: a bound, not a policy to beat
    PEER = "peer"  # the neighbouring designs of docs/peers.md


@dataclass(frozen=True)
class Entry:
    """One named run: what it delivers with, on which engine, and where it appears."""

    name: str
    label: str
    group: Group
    delivery: type[BasePolicy]
    engine: EnginePolicy = VLLM
    paper: bool = False  # one of the spec's eight: the default compare set, first in tables
    core: bool = False  # repeated per seed by the plan (its repeats are the A/A noise floor)
    unbounded_pool: bool = False  # a KV pool nothing outgrows, never sized by the pool rule

    @property
    def uses_leases(self) -> bool:
        """Does the engine side grant prefix leases for this run (unless a run flag says no)?"""
        return self.delivery.uses_leases

    @property
    def retention(self) -> Retention:
        """What protects a waiting history on the engine side (leases, pins, none, session)."""
        own = self.delivery.retention
        return own or (Retention.LADS if self.uses_leases else Retention.NONE)


B, A, P = Group.BASELINE, Group.ABLATION, Group.PEER
REGISTRY: tuple[Entry, ...] = (
    Entry("fifo", "FIFO", B, Fifo, paper=True, core=True),
    Entry("size-first", "Size-first", B, SizeFirst, paper=True),
    Entry("tail-release", "Tail-aware", B, TailRelease, paper=True),
    Entry("cache-first", "Cache-first", A, CacheFirst, paper=True, core=True),
    Entry("cache-first-noleases", "Cache-first (no leases)", A, CacheFirstNoLeases, paper=True),
    Entry("turnover-off", "Turnover-off", A, TurnoverOff, paper=True),
    Entry("lads", "LADS", Group.OURS, Lads, paper=True, core=True),
    Entry("lads-denial", "LADS, override on denial only", A, LadsDenial),
    # issue 23: the paper's LADS plus three rules (ours); after ``lads``, so the
    # candidate stays the spec's mechanism; core: its repeats give its pairs' A/A floor
    Entry("lads-adaptive", "LADS adaptive", Group.OURS, LadsAdaptive, core=True),
    Entry(
        "infinite-cache", "Infinite cache (reference)", Group.LIMIT, Fifo,
        paper=True, core=True, unbounded_pool=True,
    ),
    # peers.md: the neighbouring designs on the same engine
    Entry("augserve", "AugServe", P, Fifo, engine=AUGSERVE),
    Entry("hear-cache-aware", "HEAR cache-aware", P, HearCacheAware),
    Entry("hear-guard", "HEAR guard", P, HearGuard),
    Entry("hear-session", "HEAR session", P, HearSession),
    Entry("ttl-pin", "TTL pin", P, TtlPin),
    Entry("augserve+lads", "AugServe+LADS", P, Lads, engine=AUGSERVE),
)
BY_NAME: dict[str, Entry] = {e.name: e for e in REGISTRY}


def _names(group: Group) -> tuple[str, ...]:
    return tuple(e.name for e in REGISTRY if e.group is group)


CANDIDATE: str = _names(Group.OURS)[0]
BASELINES: tuple[str, ...] = _names(Group.BASELINE)
ABLATION: tuple[str, ...] = _names(Group.ABLATION)
REFERENCE: str = _names(Group.LIMIT)[0]
PEERS: tuple[str, ...] = _names(Group.PEER)  # ``ladsd compare --peers``, in table order
PAPER: tuple[str, ...] = tuple(e.name for e in REGISTRY if e.paper)  # the tables' eight
CORE: tuple[str, ...] = tuple(e.name for e in REGISTRY if e.core)
LABELS: dict[str, str] = {e.name: e.label for e in REGISTRY}
# Delivery names a run (or ``ladsd serve --policy``) may use: the run names on vLLM's
# own engine, the tables' eight first.
DELIVERY: tuple[str, ...] = (
    *PAPER,
    *(e.name for e in REGISTRY if e.engine is VLLM and not e.paper),
)
# The delivery classes by their own name (``infinite-cache`` delivers with FIFO's).
CLASSES: dict[str, type[BasePolicy]] = {e.delivery.name: e.delivery for e in REGISTRY}


def label(name: str) -> str:
    """A run name's table label (the name itself when it has none)."""
    return LABELS.get(name, name)


def ordered(names: Iterable[str]) -> list[str]:
    """Run names in table order: the eight, then the peers, then any others alphabetically.

    ``lads-denial`` (a later ablation) and ``lads-adaptive`` (issue 23) are among the
    others, so committed tables keep their row order.
    """
    p = set(names)
    known = (*PAPER, *PEERS)
    return [x for x in known if x in p] + sorted(p - set(known))


def delivery_class(name: str) -> str:
    """The delivery policy a delivery name runs (``infinite-cache`` -> ``fifo``).

    A name that is no delivery name is returned as it is (``make_policy`` rejects it).
    """
    e = BY_NAME.get(name)
    return e.delivery.name if e is not None and e.engine is VLLM else name


def unbounded_pool(name: str) -> bool:
    """Does the delivery name run on a pool nothing outgrows (``infinite-cache``)?"""
    e = BY_NAME.get(name)
    return e is not None and e.unbounded_pool


@dataclass(frozen=True)
class RunName:
    """A run name parsed once: its delivery name and its engine policy.

    ``lads`` -> (lads, vllm); ``augserve`` -> (fifo, augserve); ``augserve+lads`` ->
    (lads, augserve). ``vllm`` and ``vllm+x`` are accepted and mean ``fifo``, ``x``.
    ``str()`` gives the canonical name (the default engine unnamed).
    """

    delivery: str
    engine: EnginePolicy = VLLM

    @classmethod
    def parse(cls, text: str) -> RunName:
        """``text`` as a run name; ``ValueError`` naming the choices if it is none."""
        engines = {e.value: e for e in EnginePolicy}
        head, plus, tail = text.partition("+")
        delivery, engine = (tail, engines.get(head)) if plus else ("fifo", engines.get(text))
        if engine is None:
            if plus:
                raise ValueError(
                    f"unknown engine policy {head!r} in {text!r}; choose from {', '.join(engines)}"
                )
            delivery, engine = text, VLLM
        if delivery not in DELIVERY:
            raise ValueError(
                f"unknown policy {delivery!r}; choose from {', '.join(DELIVERY)}, "
                f"an engine policy ({', '.join(engines)}) or engine+policy (augserve+lads)"
            )
        return cls(delivery, engine)

    def __str__(self) -> str:
        if self.engine is VLLM:
            return self.delivery
        if self.delivery == "fifo":
            return self.engine.value
        return f"{self.engine.value}+{self.delivery}"


__all__ = [
    "ABLATION",
    "BASELINES",
    "BY_NAME",
    "CANDIDATE",
    "CLASSES",
    "CORE",
    "DELIVERY",
    "LABELS",
    "PAPER",
    "PEERS",
    "REFERENCE",
    "REGISTRY",
    "Entry",
    "Group",
    "RunName",
    "delivery_class",
    "label",
    "ordered",
    "unbounded_pool",
]
