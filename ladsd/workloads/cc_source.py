"""Where the cc-traces come from (issue 21), and proof that a download is the pinned set.

The one resolution rule (:func:`find_traces`; ``cc_traces.load`` goes through
it): an explicit path (``--traces DIR``), else ``$LADSD_CC_TRACES``, else
``../shared/data/cc-traces`` beside the checkout, else a previous download in
``$LADSD_HOME/cc-traces`` whose files all check, else :func:`download` of the
same files from GitHub at :data:`PINNED_COMMIT`.

Only a download is hash-checked, each file against the committed manifest
``cc_traces.sha256`` (``sha256sum`` format, so ``sha256sum -c`` works in a
traces directory too). A directory that is given, set or shared is used as it
is: a user's own traces may differ from the pinned set (a subset, newer
recordings), and the strict loader checks their format. :func:`check` says
whether a directory is the pinned set, for a results file to record.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ladsd.config import ladsd_home
from ladsd.download import fetch_checked
from ladsd.workloads.cc_traces import DEFAULT_TRACES, ENV_TRACES, CcTraceError

GITHUB_REPO = "callanjfox/kv-cache-tester"
PINNED_COMMIT = "94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf"
RAW_BASE = f"https://raw.githubusercontent.com/{GITHUB_REPO}/{PINNED_COMMIT}/traces/"
MANIFEST = Path(__file__).with_name("cc_traces.sha256")
# Where a manifest name lives relative to RAW_BASE when not in traces/ itself.
UPSTREAM = {"LICENSE": "../LICENSE"}  # Apache-2.0 text, at the repository root

Fetch = Callable[[str], bytes]


class CcSourceError(CcTraceError):
    """The traces cannot be found, fetched or trusted; the message names the file."""


def read_manifest(text: str) -> dict[str, str]:
    """``{name: sha256}`` from ``sha256sum`` lines (``<64 hex>  <name>``)."""
    files: dict[str, str] = {}
    for k, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or "/" in name or name in files:
            raise CcSourceError(f"{MANIFEST.name}:{k}: not a '<sha256>  <name>' line: {line!r}")
        files[name] = digest.lower()
    return files


FILES = read_manifest(MANIFEST.read_text(encoding="utf-8"))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(root: Path | str) -> tuple[str, ...]:
    """The manifest names missing under ``root`` or differing from the pinned set (sorted)."""
    root = Path(root)
    bad = (n for n, h in FILES.items() if not (root / n).is_file() or sha256_file(root / n) != h)
    return tuple(sorted(bad))


def download_dir() -> Path:
    return ladsd_home() / "cc-traces"


def _given(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise CcSourceError(
            f"{what}{path}: no cc-traces directory (pass one, or set ${ENV_TRACES})"
        )
    return path


def find_traces(path: Path | str | None = None, fetch: Fetch | None = None) -> Path:
    """The traces directory by the resolution order above (``fetch``: for the download).

    An explicit path or ``$LADSD_CC_TRACES`` that is not a directory is an error
    (it was asked for); a missing shared copy or a previous download that does
    not check just falls through.
    """
    if path is not None:
        return _given(Path(path).expanduser(), "")
    env = os.environ.get(ENV_TRACES, "").strip()
    if env:
        return _given(Path(env).expanduser(), f"${ENV_TRACES}: ")
    if DEFAULT_TRACES.is_dir():
        return DEFAULT_TRACES
    prev = download_dir()
    if prev.is_dir() and not check(prev):
        return prev
    return download(prev, fetch=fetch or fetch_url)


def fetch_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as resp:  # https, or file:// in tests
        return resp.read()


def _fetch_checked(name: str, base_url: str, fetch: Fetch) -> bytes:
    url = urllib.parse.urljoin(base_url, UPSTREAM.get(name, name))
    hint = f"Pass --traces DIR or set ${ENV_TRACES} to a local copy of {GITHUB_REPO} traces/."
    return fetch_checked(url, FILES[name], fetch, CcSourceError, name, hint)


def download(dest: Path | None = None, base_url: str = RAW_BASE, fetch: Fetch = fetch_url) -> Path:
    """Fetch every manifest file into ``dest`` (default ``$LADSD_HOME/cc-traces``); return it.

    Each file's SHA-256 is checked before it is written. Files land in a temp
    folder beside ``dest`` that is renamed only when all of them verified, so a
    failed download leaves nothing behind. A ``dest`` that already checks is
    reused without fetching; one that does not is replaced.
    """
    dest = Path(dest) if dest is not None else download_dir()
    if dest.is_dir() and not check(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))  # same fs: rename
    try:
        for name in sorted(FILES):
            (tmp / name).write_bytes(_fetch_checked(name, base_url, fetch))
        (tmp / "SOURCE").write_text(f"{GITHUB_REPO} traces/ at commit {PINNED_COMMIT}\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
