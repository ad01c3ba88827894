"""Where the cc-traces come from: the resolution order and the sha256-checked download.

No network: downloads come from a ``file://`` mirror of the shared copy laid
out like raw.githubusercontent (``<commit>/traces/`` and ``<commit>/LICENSE``),
or from an injected ``fetch``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from ladsd.workloads import cc_source, cc_traces
from ladsd.workloads.cc_source import CcSourceError, check, download, find_traces
from ladsd.workloads.cc_traces import CcTraceError

SHARED = cc_traces.DEFAULT_TRACES


def _mirror(tmp_path: Path) -> str:
    """A file:// copy of the pinned files; returns the base URL of its ``traces/``."""
    if not SHARED.is_dir():
        pytest.skip(f"shared traces not found at {SHARED}")
    traces = tmp_path / "mirror" / "traces"
    traces.mkdir(parents=True)
    for name in cc_source.FILES:  # LICENSE sits at the repository root, beside traces/
        shutil.copy(SHARED / name, (traces / cc_source.UPSTREAM.get(name, name)).resolve())
    return traces.as_uri() + "/"


def _offline(url: str) -> bytes:
    raise AssertionError(f"must not download {url}")


def test_manifest_is_the_shared_copy() -> None:
    if not SHARED.is_dir():
        pytest.skip(f"shared traces not found at {SHARED}")
    names = {p.name for p in SHARED.iterdir()} - {"SOURCE"}
    assert set(cc_source.FILES) == names and len(names) == 65  # 64 traces + LICENSE
    assert check(SHARED) == ()
    assert cc_source.PINNED_COMMIT in (SHARED / "SOURCE").read_text()


def test_download_from_a_mirror_checks_and_loads(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    dest = tmp_path / "home" / "cc-traces"
    assert download(dest, base_url=base) == dest
    assert check(dest) == ()
    assert sorted(p.name for p in dest.iterdir()) == sorted([*cc_source.FILES, "SOURCE"])
    ts = cc_traces.load(dest)  # the strict loader accepts what was downloaded
    assert len(ts.conversations) == 64 and ts.commit == cc_source.PINNED_COMMIT
    assert download(dest, base_url=base, fetch=_offline) == dest  # verified: reused
    assert [p.name for p in dest.parent.iterdir()] == ["cc-traces"]  # no temp folder left


def test_a_tampered_file_is_refused_by_name(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    with open(tmp_path / "mirror" / "traces" / "trace_0030.json", "ab") as f:
        f.write(b" ")
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(CcSourceError, match=r"trace_0030.json: SHA-256 mismatch"):
        download(home / "cc-traces", base_url=base)
    assert list(home.iterdir()) == []  # nothing half-written


def test_a_missing_file_is_refused_by_name(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    (tmp_path / "mirror" / "LICENSE").unlink()  # the one file outside traces/
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(CcSourceError, match=r"LICENSE: could not download .*--traces DIR"):
        download(home / "cc-traces", base_url=base)
    assert list(home.iterdir()) == []


def test_a_failed_download_keeps_the_previous_folder(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    dest = tmp_path / "cc-traces"
    dest.mkdir()
    (dest / "trace_0002.json").write_text("mine")
    (tmp_path / "mirror" / "traces" / "trace_0039.json").write_text("{}")
    with pytest.raises(CcSourceError, match="trace_0039.json: SHA-256 mismatch"):
        download(dest, base_url=base)
    assert [p.name for p in dest.iterdir()] == ["trace_0002.json"]
    assert (dest / "trace_0002.json").read_text() == "mine"


# ---- resolution order (a small synthetic pinned set: no shared copy needed) --


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PINNED = {"LICENSE": b"license\n", "trace_0001.json": b"{}\n"}


@pytest.fixture
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A two-file pinned set, no shared copy, ``$LADSD_HOME`` in tmp; returns fetched URLs."""
    monkeypatch.setattr(cc_source, "FILES", {n: _sha(d) for n, d in PINNED.items()})
    monkeypatch.setattr(cc_source, "DEFAULT_TRACES", tmp_path / "absent")
    monkeypatch.setenv("LADSD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(cc_traces.ENV_TRACES, raising=False)
    urls: list[str] = []

    def fetch(url: str) -> bytes:
        urls.append(url)
        return PINNED[url.rsplit("/", 1)[1]]

    monkeypatch.setattr(cc_source, "fetch_url", fetch)
    return urls


def test_resolution_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: list[str]
) -> None:
    home = tmp_path / "home" / "cc-traces"
    assert find_traces() == home  # nothing local: downloaded
    root = cc_source.RAW_BASE.removesuffix("traces/")
    assert sorted(pinned) == [root + "LICENSE", cc_source.RAW_BASE + "trace_0001.json"]
    assert find_traces(fetch=_offline) == home  # the previous download checks: reused
    (home / "trace_0001.json").write_text("changed")
    assert find_traces() == home and check(home) == ()  # a bad one is fetched again
    for name in ("shared", "env", "explicit"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(cc_source, "DEFAULT_TRACES", tmp_path / "shared")
    assert find_traces(fetch=_offline) == tmp_path / "shared"
    monkeypatch.setenv(cc_traces.ENV_TRACES, str(tmp_path / "env"))
    assert find_traces(fetch=_offline) == tmp_path / "env"
    assert find_traces(tmp_path / "explicit", fetch=_offline) == tmp_path / "explicit"


def test_given_directories_are_used_as_they_are(tmp_path: Path, pinned: list[str]) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "trace_0001.json").write_text("not the pinned bytes")
    assert find_traces(own) == own and check(own) == ("LICENSE", "trace_0001.json")


def test_bad_explicit_or_env_directories_are_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: list[str]
) -> None:
    with pytest.raises(CcSourceError, match="absent: no cc-traces directory"):
        find_traces(tmp_path / "absent")
    monkeypatch.setenv(cc_traces.ENV_TRACES, str(tmp_path / "absent"))
    with pytest.raises(CcTraceError, match=r"\$LADSD_CC_TRACES: .*no cc-traces directory"):
        find_traces()
    assert pinned == []  # neither fell through to a download


def test_the_loader_resolves_through_find_traces(pinned: list[str], tmp_path: Path) -> None:
    home = tmp_path / "home" / "cc-traces"
    assert cc_traces.traces_dir() == home and check(home) == ()


def test_a_malformed_manifest_line_is_an_error() -> None:
    assert cc_source.read_manifest(f"{'a' * 64}  x.json\n") == {"x.json": "a" * 64}
    with pytest.raises(CcSourceError, match=r"cc_traces.sha256:2"):
        cc_source.read_manifest(f"{'a' * 64}  x.json\nabc x.json\n")
