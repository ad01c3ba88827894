"""Re-render every committed table of bench/results/ from its run files, and diff.

    .venv/bin/python bench/rerender.py --check        # exit 1 if any differs
    .venv/bin/python bench/rerender.py --check -v     # and show the first differing lines

What is rendered, and how (nothing is run again, nothing under bench/results/ is written):

* ``<tag>-table.md``: the tables ``ladsd compare`` writes (cli/replay.py): the comparison
  grids of ``ladsd.metrics.comparison.compare`` and the drivers grid, from the run files
  ``<tag>-<policy>-s<seed>[-r<k>].json[.gz]`` beside it (or in its ``runs.tar.xz``);
* ``<tag>-peers.md`` and ``<tag>-peers.json``: the peer tables (``write_peers``);
* ``agents/README.md``: ``bench/agent_sessions_report.py`` run on a copy of the folder's
  result files in a temporary directory (its plots are drawn there and dropped).

A table without run files (the folder README.md files, serve/README.md) is hand-written
and is not checked. Two tables were made from part of their folder (:data:`SUBSETS`), and
the archived folders of :data:`EARLIER` hold an earlier table format.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import io
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's ladsd, before any installed one

from ladsd.metrics import comparison, events, grid, peer_compare  # noqa: E402
from ladsd.metrics.events import RunRecord  # noqa: E402
from ladsd.metrics.summary import repeat_of  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RUN = re.compile(r"-s(?P<seed>\d+)(-r\d+)?\.json(\.gz)?$")


@dataclass(frozen=True)
class Subset:
    """A table made from part of a folder's run files (its tag, or those runs, differ)."""

    tag: str
    seeds: tuple[int, ...] = ()
    policies: tuple[str, ...] = ()


SUBSETS: dict[str, Subset] = {  # folder/tag of the table -> what it was made from
    "cpu-loaded/controlled-c8-cpu-seed1-all-policies": Subset("controlled-c8-cpu", (1,)),
    # Stopped by a deadline after seed 2 (its README): the table is of seeds 1-2.
    "cpu-f32/web-burst-cpu": Subset("web-burst-cpu", (1, 2)),
    "cpu-loaded/controlled-c8-cpu": Subset(
        "controlled-c8-cpu", policies=("fifo", "lads", "infinite-cache")
    ),
}
# Archived folders whose tables were written by an earlier table format (no drivers grid,
# no "workflows faster" column, the ablation as mean seconds, "| --- |" alignment): only
# their first grid (latency per policy) is in today's format, and only it is compared.
EARLIER = ("cpu-loaded", "cpu-pool769")
Runs = dict[str, list[RunRecord]]


@dataclass(frozen=True)
class Rendered:
    """One committed file and what its run files render it to now."""

    path: Path
    text: str
    earlier: bool = False  # an earlier format: the first grid alone is compared

    @property
    def same(self) -> bool:
        old = self.path.read_text()
        if self.earlier:
            return old.split("\n\n**")[0] == self.text.split("\n\n**")[0]
        return old == self.text


PACKED = "runs.tar.xz"  # a folder's run files, compressed to keep bench/results/ small
RUN_FILE = re.compile(r"-s\d+(-r\d+)?\.json$")  # run files, not the -table/-peers summaries
_unpacked: dict[Path, Path] = {}


def run_dir(folder: Path) -> Path:
    """Where ``folder``'s run files are: the folder, or its ``runs.tar.xz`` unpacked once into
    a temporary directory (removed at exit)."""
    if not (folder / PACKED).exists():
        return folder
    if folder not in _unpacked:
        import atexit
        import tarfile

        tmp = Path(tempfile.mkdtemp(prefix="rerender-runs-"))
        atexit.register(shutil.rmtree, tmp, True)
        with tarfile.open(folder / PACKED) as tar:
            tar.extractall(tmp, filter="data")
        _unpacked[folder] = tmp
    return _unpacked[folder]


def run_files(folder: Path, prefix: str = "") -> list[Path]:
    """``folder``'s run files (or its pack's) whose names start with ``prefix``, sorted."""
    return [p for p in sorted(run_dir(folder).glob(f"{prefix}*.json")) if RUN_FILE.search(p.name)]


def print_runs(doc: str, line: Callable[[RunRecord, str], str], example: str) -> None:
    """The command line of a per-run reader: ``FOLDER [--workload PREFIX]``, a line a run."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--workload", default="", help=f"file prefix, e.g. {example}")
    a = ap.parse_args()
    for path in run_files(a.folder, a.workload):
        print(line(events.load(path), path.stem))


def runs_of(folder: Path, tag: str, only: Subset | None = None) -> Runs:
    """policy -> its runs of ``tag`` in ``folder``, by (seed, repeat) as compare lists them."""
    found: Runs = {}
    for p in sorted(run_dir(folder).iterdir()):
        m = RUN.search(p.name)
        if not (m and p.name.startswith(tag + "-")):
            continue
        if only and only.seeds and int(m["seed"]) not in only.seeds:
            continue
        rec = events.load(p)
        if only and only.policies and rec.policy not in only.policies:
            continue
        # The tag's own files only: "captured-cpu-" must not take "captured-cpu-eighth-...".
        if p.name[len(tag) + 1 : m.start()] not in (rec.policy, rec.policy.replace("+", "-")):
            continue
        found.setdefault(rec.policy, []).append(rec)
    return {p: sorted(rs, key=lambda r: (r.seed, repeat_of(r))) for p, rs in found.items()}


def table_md(runs: Mapping[str, Sequence[RunRecord]]) -> str:
    """``<tag>-table.md`` as ``ladsd compare`` writes it."""
    comp = comparison.compare(runs)
    grids = [*comparison.comparison_grids(comp), comparison.drivers_grid(runs)]
    return grid.markdown(grids)


def peers_md(runs: Mapping[str, Sequence[RunRecord]]) -> str:
    peer = peer_compare.peer_comparison(runs)
    return "" if peer is None else grid.markdown(peer_compare.peer_grids(peer))


def peers_json(runs: Mapping[str, Sequence[RunRecord]]) -> str:
    import orjson

    peer = peer_compare.peer_comparison(runs)
    doc = {} if peer is None else peer_compare.peer_dict(peer)
    return (orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n").decode()


KINDS: dict[str, Callable[[Mapping[str, Sequence[RunRecord]]], str]] = {
    "-table.md": table_md,
    "-peers.md": peers_md,
    "-peers.json": peers_json,
}


def render_file(path: Path, results: Path = RESULTS) -> Rendered:
    """One committed ``-table.md`` / ``-peers.md`` / ``-peers.json``, rendered from its runs."""
    suffix = next(k for k in KINDS if path.name.endswith(k))
    tag = path.name.removesuffix(suffix)
    folder = path.parent.relative_to(results).as_posix()
    only = SUBSETS.get(f"{folder}/{tag}")
    runs = runs_of(path.parent, only.tag if only else tag, only)
    try:
        text = KINDS[suffix](runs) if runs else "(no run files)\n"
    except ValueError as e:  # the run files do not make one comparison
        text = f"(cannot render: {e})\n"
    return Rendered(path, text, folder in EARLIER)


def compare_tables(results: Path = RESULTS) -> Iterator[Rendered]:
    """Every ``-table.md`` / ``-peers.md`` / ``-peers.json`` under ``results``, rendered."""
    for suffix in KINDS:
        for path in sorted(results.rglob(f"*{suffix}")):
            yield render_file(path, results)


def agents_readme(folder: Path = RESULTS / "agents") -> Rendered:
    """``agents/README.md`` by bench/agent_sessions_report.py, run on a copy of the folder."""
    script = ROOT / "bench" / "agent_sessions_report.py"
    spec = importlib.util.spec_from_file_location("_agent_sessions_report", script)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory(prefix="rerender-") as tmp:
        for p in folder.glob("*.json"):
            shutil.copy(p, tmp)
        with contextlib.redirect_stdout(io.StringIO()):  # its "wrote ..." names the temp dir
            mod.main(tmp)
        text = (Path(tmp) / "README.md").read_text()
    return Rendered(folder / "README.md", text)


def everything(results: Path = RESULTS) -> list[Rendered]:
    out = list(compare_tables(results))
    if (results / "agents" / "README.md").exists():
        out.append(agents_readme(results / "agents"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="diff; exit 1 if any file differs")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the differing lines")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--dump", type=Path, help="also write every rendering here (diff two trees)")
    a = ap.parse_args()
    bad = 0
    rendered = everything(a.results)
    for r in rendered:
        if a.dump:  # the whole rendering, the archived tables' later grids included
            out = a.dump / r.path.relative_to(a.results)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(r.text)
        rel = r.path.relative_to(ROOT) if r.path.is_relative_to(ROOT) else r.path
        ok = r.same
        bad += not ok
        how = " (first grid; earlier table format)" if r.earlier else ""
        print(f"{'same' if ok else 'DIFFERS'}  {rel}{how}")
        if not ok and a.verbose:
            old = r.path.read_text().splitlines()
            d = difflib.unified_diff(old, r.text.splitlines(), "committed", "rendered", n=0)
            print("\n".join(list(d)[:20]))
    early = sum(r.earlier for r in rendered)
    print(f"{bad} file(s) differ" if bad else "every committed table re-renders byte-identical"
          + (f" ({early} archived tables of an earlier format: their first grid)" if early else ""))
    if a.check and bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
