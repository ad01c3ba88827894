"""The docs' tables are written from run files (bench/write_docs.py), and every link resolves.

Model-free: the committed run files under bench/results/ are read, nothing is run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


@pytest.fixture(scope="module")
def write_docs() -> object:
    return bench_script("write_docs")


def test_every_marked_table_is_what_its_run_files_render(write_docs) -> None:
    changed = []
    for doc in write_docs.docs():
        _, seen = write_docs.written(doc)
        changed += [f"{doc.name}: {r.source}" for r, diff in seen if diff]
    assert changed == [], "run `bench/write_docs.py` (or fix the run files): " + ", ".join(changed)


def test_the_docs_mark_their_rendered_tables(write_docs) -> None:
    # The results, peers, agents, scale-out and serve pages hold tables of run files.
    marked = {d.name: len(write_docs.regions(d, d.read_text())) for d in write_docs.docs()}
    assert marked["results.md"] >= 11 and marked["peers.md"] >= 4
    assert marked["agents.md"] >= 2 and marked["scale-out.md"] >= 1 and marked["serve.md"] >= 2


def test_a_table_edited_by_hand_is_found(write_docs, tmp_path: Path) -> None:
    doc = ROOT / "docs" / "peers.md"
    text = doc.read_text()
    r = write_docs.regions(doc, text)[0]
    body = text[r.start : r.end]
    edited = re.sub(r"\| 5 \| \d+\.\d\d \|", "| 5 | 1.23 |", body, count=1)
    assert edited != body
    page = tmp_path / "peers.md"
    page.write_text(text[: r.start] + edited + text[r.end :])
    new, seen = write_docs.written(page)
    assert [diff for _, diff in seen][0] is True
    assert new == text  # writing restores the rendered table and leaves the prose alone


def test_a_marker_without_its_close_is_refused(write_docs, tmp_path: Path) -> None:
    page = tmp_path / "x.md"
    page.write_text("prose\n<!-- table: bench/results/cpu-quarter/web-burst-cpu-table.md 1 -->\n")
    with pytest.raises(write_docs.MarkerError, match="no <!-- /table -->"):
        write_docs.written(page)


def test_a_grid_range_beyond_the_table_is_refused(write_docs) -> None:
    with pytest.raises(write_docs.MarkerError, match="grids 7 of 6"):
        write_docs.render("bench/results/cpu-quarter/web-burst-cpu-table.md 7")


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves_in_the_repository(page: Path) -> None:
    missing = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of this page
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            missing.append(target)
    assert missing == [], f"{page.relative_to(ROOT)}: links that do not resolve: {missing}"


def test_every_committed_table_re_renders_from_its_run_files() -> None:
    # bench/results/*/ tables and the agents README, rendered again from their run files.
    rerender = bench_script("rerender")
    rendered = rerender.everything()
    assert len(rendered) >= 25
    assert [str(r.path.relative_to(ROOT)) for r in rendered if not r.same] == []


def test_smoke_counters_diff_excuses_only_what_varied_run_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench/smoke_counters.py --diff: A, B two runs of the old code, C the new one.
    sc = bench_script("smoke_counters")
    base = {"grants": 8.0, "evaluations": 20.0, "controller_cpu_s": 0.01}
    files = []
    for name, change in (("a", {}), ("b", {"evaluations": 21.0}), ("c", {"evaluations": 19.0})):
        runs = {"controlled/lads": base | change, "controlled/fifo": {"evaluations": 5.0}}
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"runs": runs}))
    assert sc.diff(files) == 0  # evaluations varied between A and B too
    assert "evaluations: 1 run(s): controlled/lads (20 vs 21)" in capsys.readouterr().out
    c = json.loads(files[2].read_text())
    c["runs"]["controlled/lads"]["grants"] = 7.0
    c["runs"]["controlled/fifo"]["evaluations"] = 6.0  # it varied in another run only
    c["runs"]["controlled/new-policy"] = {"grants": 1.0}
    files[2].write_text(json.dumps(c))
    assert sc.diff(files) == 1
    out = capsys.readouterr().out
    assert "variation: evaluations (controlled/fifo), grants (controlled/lads)" in out
    assert "run controlled/new-policy only in the other" in out
