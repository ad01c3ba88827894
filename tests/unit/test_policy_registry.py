"""The one policy registry: every list derived from it, typed run names, one audit error."""

from __future__ import annotations

import pytest

from ladsd.audit import LeaseIntegrityError, check_refs
from ladsd.delivery import POLICY_NAMES, make_policy, registry
from ladsd.delivery.registry import REGISTRY, RunName
from ladsd.modes import EnginePolicy, Retention

VLLM, AUG = EnginePolicy.VLLM, EnginePolicy.AUGSERVE


def test_the_derived_lists_keep_their_members_and_order() -> None:
    # The literal lists that lived in seven places before the registry.
    eight = (
        "fifo", "size-first", "tail-release", "cache-first", "cache-first-noleases",
        "turnover-off", "lads", "infinite-cache",
    )  # fmt: skip
    peers = ("augserve", "hear-cache-aware", "hear-guard", "hear-session", "ttl-pin")
    assert registry.PAPER == eight
    assert registry.PEERS == (*peers, "augserve+lads")
    assert registry.CANDIDATE == "lads" and registry.REFERENCE == "infinite-cache"
    assert registry.BASELINES == ("fifo", "size-first", "tail-release")
    assert registry.ABLATION == (*eight[3:6], "lads-denial")
    assert registry.CORE == ("fifo", "cache-first", "lads", "lads-adaptive", "infinite-cache")
    assert registry.DELIVERY == (*eight, "lads-denial", "lads-adaptive", *peers[1:])
    # the catalogue's order (plot styles are keyed by name, not by this position)
    assert list(registry.LABELS)[6:10] == [
        "lads", "lads-denial", "lads-adaptive", "infinite-cache",
    ]  # fmt: skip
    assert set(POLICY_NAMES) == set(registry.DELIVERY) - {"infinite-cache"}


def test_tables_order_the_eight_then_the_peers_then_the_rest() -> None:
    names = ["lads-denial", "zz", "augserve+lads", "lads", "fifo", "ttl-pin", "aa"]
    assert registry.ordered(names) == [
        "fifo", "lads", "ttl-pin", "augserve+lads", "aa", "lads-denial", "zz",
    ]  # fmt: skip


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_every_entry_parses_to_its_engine_and_delivery_and_back(entry: registry.Entry) -> None:
    run = RunName.parse(entry.name)
    assert run.engine is entry.engine and str(run) == entry.name
    assert registry.CLASSES[registry.delivery_class(run.delivery)] is entry.delivery
    pol = make_policy(registry.delivery_class(run.delivery))
    assert (pol.uses_leases, pol.retention) == (entry.uses_leases, entry.retention)
    assert registry.label(entry.name) == entry.label


def test_leases_and_pins_per_entry_and_the_one_unbounded_pool() -> None:
    by = registry.BY_NAME
    assert [e.name for e in REGISTRY if e.unbounded_pool] == ["infinite-cache"]
    assert registry.unbounded_pool("infinite-cache") and not registry.unbounded_pool("fifo")
    assert registry.delivery_class("infinite-cache") == "fifo"
    assert registry.delivery_class("augserve") == "augserve"  # an engine name: not delivery
    assert by["lads"].uses_leases and not by["fifo"].uses_leases
    assert by["ttl-pin"].retention is Retention.TTL_PIN and not by["ttl-pin"].uses_leases
    assert by["hear-session"].retention is Retention.SESSION


def test_run_names_parse_once_and_refuse_unknown_parts() -> None:
    assert RunName.parse("vllm+lads") == RunName("lads", VLLM)
    assert RunName.parse("vllm") == RunName("fifo", VLLM)
    assert str(RunName("fifo", AUG)) == "augserve"
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        RunName.parse("lifo")
    with pytest.raises(ValueError, match="unknown engine policy 'sglang'"):
        RunName.parse("sglang+lads")


def test_one_audit_error_for_the_reference_rule() -> None:
    check_refs(5, 3, 2)
    with pytest.raises(LeaseIntegrityError, match=r"added 5 != released 3 \+ held 1 \(\+1 leaked"):
        check_refs(5, 3, 1)
    with pytest.raises(LeaseIntegrityError, match=r"^run x: lease references added 4 != released"):
        check_refs(4, 2, what="run x: lease references")
