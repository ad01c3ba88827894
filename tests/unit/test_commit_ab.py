"""bench/commit_ab.py: commits side by side, read back from the committed stop-48 pack.

Model-free: nothing is run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "bench/results/issue23-ctrl48"


def rows(lines: list[str]) -> list[dict[str, str]]:
    table = [[c.strip() for c in x.strip("| ").split(" | ")] for x in lines if x.startswith("| ")]
    head = table[0]
    return [dict(zip(head, r, strict=True)) for r in table[1:]]  # '|---' is not listed


def variants(
    pack: str, policy: str = "lads-adaptive", counters: tuple[str, ...] = ()
) -> dict[str, dict[str, str]]:
    """A one-seed pack's rows by variant (``counters``: the policy's, as extra columns)."""
    got = bench_script("commit_ab").report(ROOT / "bench/results" / pack, policy, counters)
    return {r["variant"]: r for r in rows(got)}


def column(by: dict[str, dict[str, str]], name: str, part: int | None = None) -> dict[str, str]:
    """One column per variant (``part``: one of its `` / ``-separated fields)."""
    return {v: r[name] if part is None else r[name].split(" / ")[part] for v, r in by.items()}


def test_the_pack_gives_every_variant_and_its_commit() -> None:
    ab = bench_script("commit_ab")
    got = rows(ab.report(FOLDER, "lads-adaptive"))
    seen = {(r["workload"], r["seed"], r["variant"]) for r in got}
    assert {("cs", "16", v) for v in ("base", "cand", "head")} <= seen
    by = {(r["workload"], r["seed"], r["variant"]): r for r in got}
    # The README's figures: the accounting commit, then the inventory rule.
    assert by[("cs", "16", "base")]["commit"] == "27a509f"
    assert by[("cs", "16", "base")]["ratio"] == "1.51x"
    assert by[("c8", "18", "cand")]["below FIFO %"] == "38.6"
    # Every run of the pack counts the published states (no '-'); none yet counts the
    # lease work inside schedule() (stop 50's part: '-').
    split = [r["parts policy"].split(" / ") for r in got]
    assert all("-" not in x[:3] and x[3] == "-" for x in split)


def test_a_repeat_listed_twice_is_refused(tmp_path: Path) -> None:
    ab = bench_script("commit_ab")
    src = ab.run_dir(FOLDER) / "base-cs-s16"
    dst = tmp_path / "base-cs-s16"
    shutil.copytree(src, dst)
    r2 = next(dst.glob("*-fifo-s16-r2.json"))
    doc = json.loads(r2.read_text())
    doc["meta"]["repeat"] = 1
    r2.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="not 1..n once each"):
        ab.load(tmp_path)


def test_the_stop_49_pack_gives_the_readmes_figures() -> None:
    """bench/results/issue23-ctrl49: the published-state rule against main before it, on
    one AMD EPYC; the figures its README quotes come from the run files."""
    ab = bench_script("commit_ab")
    got = rows(ab.report(ROOT / "bench/results/issue23-ctrl49", "lads-adaptive"))
    by = {(r["workload"], r["seed"], r["variant"]): r for r in got}
    assert len(by) == 8 and {r["commit"] for r in got} == {"addffcc", "354a127"}
    assert by[("web", "16", "cand")]["ratio"] == "1.30x"
    assert by[("cs", "16", "base")]["ratio"] == "1.61x"
    published = {v: by[("c8", "18", v)]["parts policy"].split(" / ")[2] for v in ("base", "cand")}
    assert published == {"base": "0.305", "cand": "0.149"}


def test_the_stop_50_pack_counts_the_schedule_part() -> None:
    """bench/results/issue23-ctrl50: every run counts the fourth part, and the figures
    its README quotes come from the run files."""
    ab = bench_script("commit_ab")
    got = rows(ab.report(ROOT / "bench/results/issue23-ctrl50", "lads-adaptive"))
    by = {(r["workload"], r["seed"], r["variant"]): r for r in got}
    assert {r["commit"] for r in got} == {"98a0a4f", "0ead622", "62483c0"}
    assert all("-" not in r["parts policy"].split(" / ") for r in got)
    assert by[("cs", "16", "count")]["ratio"] == "2.46x"
    assert by[("web", "16", "count")]["ratio"] == "1.82x"
    schedule = {v: by[("cs", "16", v)]["parts policy"].split(" / ")[3] for v in ("count", "splice")}
    assert schedule == {"count": "0.414", "splice": "0.335"}


def test_the_stop_52_pack_gives_the_readmes_figures() -> None:
    """bench/results/issue23-ctrl52: the freed session block put back by the splice, ABBA
    against the commit before it; the figures its README quotes come from the run files."""
    by = variants("issue23-ctrl52")
    assert {r["commit"] for r in by.values()} == {"8f66153", "19be686"} and len(by) == 4
    schedule = column(by, "parts policy", 3)
    assert schedule == {"base": "0.720", "base2": "0.499", "inc": "0.700", "inc2": "0.636"}
    ratio = column(by, "ratio")
    assert ratio == {"base": "2.56x", "base2": "2.28x", "inc": "2.61x", "inc2": "2.57x"}


def test_the_stop_53_pack_gives_the_readmes_figures() -> None:
    """bench/results/issue23-ctrl53: the schedule part's cuts and the notices' hashes
    against stop 52 as landed; the figures its README quotes come from the run files."""
    by = variants("issue23-ctrl53")
    assert {r["commit"] for r in by.values()} == {"0506674", "a1c2822"} and len(by) == 3
    schedule = column(by, "parts policy", 3)
    assert schedule == {"base": "0.448", "new": "0.265", "new2": "0.271"}
    ctrl = column(by, "ctrl CPU s (FIFO / policy)")
    assert ctrl == {"base": "0.506 / 1.154", "new": "0.407 / 0.889", "new2": "0.413 / 0.920"}
    ratio = column(by, "ratio")
    assert ratio == {"base": "2.28x", "new": "2.18x", "new2": "2.22x"}


def test_the_stop_54_pack_gives_the_readmes_figures() -> None:
    """bench/results/issue23-ctrl54: stop 53 as landed against the per-step cuts, ABBA; the
    figures its README quotes, the steps included, come from the run files."""
    by = variants("issue23-ctrl54")
    assert {r["commit"] for r in by.values()} == {"a04daae", "8013616"} and len(by) == 4
    schedule = column(by, "parts policy", 3)
    assert schedule == {"base": "0.264", "base2": "0.251", "new": "0.216", "new2": "0.231"}
    ctrl = column(by, "ctrl CPU s (FIFO / policy)")
    assert ctrl == {
        "base": "0.405 / 0.899",
        "base2": "0.417 / 0.872",
        "new": "0.407 / 0.829",
        "new2": "0.403 / 0.864",
    }
    ratio = column(by, "ratio")
    assert ratio == {"base": "2.22x", "base2": "2.09x", "new": "2.04x", "new2": "2.14x"}
    steps = column(by, "steps")
    assert steps == {"base": "- / -", "base2": "- / -", "new": "1737 / 3136", "new2": "1699 / 3063"}


def test_the_stop_55_pack_gives_the_readmes_figures() -> None:
    """bench/results/issue23-sessions55: stop 54 as landed against sessions kept from their
    receipt to their allocation, ABBA, three policies; the README's figures and session
    counters come from the run files."""
    keys = ("sessions_kept", "sessions_allocated", "sessions_unbound", "session_order_computed")
    la = variants("issue23-sessions55", "lads-adaptive", keys)
    hs = variants("issue23-sessions55", "hear-session", keys)
    assert {r["commit"] for r in la.values()} == {"2ddfc4a", "f676a9c"} and len(la) == 4
    assert column(la, "policy s") == {
        "base": "90.77",
        "base2": "89.51",
        "new": "90.53",
        "new2": "90.20",
    }
    assert column(la, "parts policy", 3) == {
        "base": "0.233",
        "base2": "0.219",
        "new": "0.228",
        "new2": "0.236",
    }
    assert column(la, "ratio") == {
        "base": "2.17x",
        "base2": "2.05x",
        "new": "2.08x",
        "new2": "2.24x",
    }
    assert column(la, "session_order_computed") == {
        "base": "152",
        "base2": "141",
        "new": "93",
        "new2": "96",
    }
    assert column(hs, "session_order_computed") == {
        "base": "145",
        "base2": "144",
        "new": "96",
        "new2": "97",
    }
    for by in (la, hs):  # every session leaves by its allocation at the new commit
        assert column(by, "sessions_allocated") == {
            "base": "-",
            "base2": "-",
            "new": "96",
            "new2": "96",
        }
        assert {by[v]["sessions_unbound"] for v in ("new", "new2")} == {"0"}
    assert column(la, "sessions_kept")["new"] == "80" and column(hs, "sessions_kept")["new"] == "71"


def test_ctrl_cpu_per_step_takes_the_step_counts_out_of_the_ratio() -> None:
    """The per-step view of the stop-55 pack: LADS adaptive's ctrl CPU is 2.05-2.24x FIFO's
    a run but 1.16-1.26x a step, HEAR session's 1.62-1.68x a run and below FIFO's a step
    (both run ~3,300 steps to FIFO's ~1,850); a pack without steps shows '-'."""
    la = variants("issue23-sessions55", "lads-adaptive")
    hs = variants("issue23-sessions55", "hear-session")
    assert column(la, "µs/step (FIFO / policy)") == {
        "base": "226 / 282",
        "base2": "226 / 262",
        "new": "222 / 265",
        "new2": "215 / 270",
    }
    assert column(la, "per step") == {
        "base": "1.25x",
        "base2": "1.16x",
        "new": "1.19x",
        "new2": "1.26x",
    }
    assert column(hs, "per step") == {
        "base": "0.94x",
        "base2": "0.91x",
        "new": "0.97x",
        "new2": "0.91x",
    }
    ratio = {"base": "1.66x", "base2": "1.63x", "new": "1.68x", "new2": "1.62x"}
    assert column(hs, "ratio") == ratio
    old = variants("issue23-ctrl54")  # its base runs predate the steps
    assert old["base"]["per step"] == "-" and old["new"]["per step"] == "1.13x"
