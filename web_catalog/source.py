"""Where the Magento sample fixtures come from, and proof that they are the pinned ones.

Resolution order: an explicit path, else ``$LADSD_CATALOG_SOURCE``, else
``../shared/data/magento2-sample-data`` beside the checkout, else a download of
the same files from GitHub at :data:`PINNED_COMMIT`, each checked against
:data:`SOURCE_FILES` before it is used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ladsd.config import ladsd_home
from ladsd.download import fetch_checked

ENV_SOURCE = "LADSD_CATALOG_SOURCE"
GITHUB_REPO = "magento/magento2-sample-data"
PINNED_COMMIT = "53807565ba9f23c9409268c02bb995cf39ef553d"
RAW_BASE = f"https://raw.githubusercontent.com/{GITHUB_REPO}/{PINNED_COMMIT}/app/code/Magento/"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "data" / "magento2-sample-data"

# The fixtures the catalog is built from, with their SHA-256 at PINNED_COMMIT
# (computed from the shared copy). Paths are relative to app/code/Magento/.
SOURCE_FILES: dict[str, str] = {
    "BundleSampleData/fixtures/yoga_bundle.csv": (
        "f44f8313e577e213a5a817e2dc5a616a11263b777840ede20e4543f4a5dfe64d"
    ),
    "CatalogSampleData/fixtures/SimpleProduct/products_gear_bags.csv": (
        "b1a97ddfc0bdb1dbb21055e40f00ff09f9f8df1ebe5273c93466778acaf5d938"
    ),
    "CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment.csv": (
        "3e41d9ce27d6623bb4f125917ead4d28ceca2ab2164f5c1ac037c1ac27cc2ca8"
    ),
    "CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment_ball.csv": (
        "7366ca3edaf5ffa43c7bcc1952f9f981f950b18f698bc9a4e7217131fefb5bf6"
    ),
    "CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment_strap.csv": (
        "e3cd173ecb61144d3411b08b6e8562c0f067fb2e709811f84917a8d4b8f88ef4"
    ),
    "CatalogSampleData/fixtures/SimpleProduct/products_gear_watches.csv": (
        "78b75d524604c7a1a39a02e3d753e1a303fabdf59af2ef8ff320696c26b49c44"
    ),
    "CatalogSampleData/fixtures/categories.csv": (
        "e467e3dd00b797b456704504a58608505453d4d91ec6d0d5d4bf5cfe6febae60"
    ),
    "ConfigurableSampleData/fixtures/categories.csv": (
        "55d8cb977988ebf3af24465c57ccf343dcd54e3356d13141374126e8edf8f10e"
    ),
    "ConfigurableSampleData/fixtures/products.csv": (
        "4cdee0a21f6c124e93dc273f97a8d4875e99d933300a538fb6ca2dd54a2ae45b"
    ),
    "DownloadableSampleData/fixtures/categories.csv": (
        "4680083be28d47c1f85d320ae9ea4cee2a412d95d9da5d393a399d72761e632f"
    ),
    "DownloadableSampleData/fixtures/products_training_video_download.csv": (
        "ba57ef1a8080964c873cb9e84562b09b304714cfe03871e635f6b1132a49de26"
    ),
    "GroupedProductSampleData/fixtures/yoga_grouped.csv": (
        "58ed549c6377a73fc7e07b189065a2502cd2b8dabef2b93e46e180ea3279fe06"
    ),
    "ReviewSampleData/fixtures/products_reviews.csv": (
        "fbdf688da741d7229816b0aa0fe3b0b0ba9f2f9e2a4e345b44215a5ca7a10510"
    ),
}

Fetch = Callable[[str], bytes]


class CatalogSourceError(RuntimeError):
    """The fixtures cannot be found, fetched or trusted."""


def digest_of(hashes: dict[str, str]) -> str:
    """Catalog digest: SHA-256 of ``"<sha256>  <path>\\n"`` lines in sorted path order.

    A manifest digest (as ``sha256sum`` prints it) rather than one pass over
    the concatenated bytes, so the pinned digest is known without the files.
    """
    lines = "".join(f"{hashes[p]}  {p}\n" for p in sorted(hashes))
    return hashlib.sha256(lines.encode()).hexdigest()


PINNED_DIGEST = digest_of(SOURCE_FILES)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_digest(root: Path) -> str:
    """The catalog digest of the fixtures under ``root`` (a fixture root)."""
    return digest_of({p: sha256_file(root / p) for p in SOURCE_FILES})


def fixture_root(path: Path) -> Path:
    """The folder holding ``<Module>/fixtures``: ``path`` or its ``app/code/Magento``.

    Raises :class:`CatalogSourceError` naming the first missing fixture.
    """
    path = Path(path).expanduser()
    nested = path / "app" / "code" / "Magento"
    root = nested if nested.is_dir() else path
    if not root.is_dir():
        raise CatalogSourceError(f"catalog source {path} is not a directory")
    missing = [p for p in sorted(SOURCE_FILES) if not (root / p).is_file()]
    if missing:
        raise CatalogSourceError(
            f"catalog source {path} lacks {len(missing)} fixture file(s), first: {missing[0]}"
        )
    return root


def find_source(source: Path | str | None = None) -> Path | None:
    """A local fixture root by the resolution order, or None when a download is needed.

    An explicit path or ``$LADSD_CATALOG_SOURCE`` that is not a valid source is an
    error (it was asked for); a missing sibling copy just falls through.
    """
    if source is not None:
        return fixture_root(Path(source))
    env = os.environ.get(ENV_SOURCE, "").strip()
    if env:
        try:
            return fixture_root(Path(env))
        except CatalogSourceError as e:
            raise CatalogSourceError(f"${ENV_SOURCE}: {e}") from None
    try:
        return fixture_root(DEFAULT_SOURCE)
    except CatalogSourceError:
        return None


def download_dir() -> Path:
    return ladsd_home() / f"magento2-sample-data-{PINNED_COMMIT[:12]}"


def fetch_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as resp:  # https, or file:// in tests
        return resp.read()


def download(dest: Path | None = None, base_url: str = RAW_BASE, fetch: Fetch = fetch_url) -> Path:
    """Fetch every fixture into ``dest``, checking each SHA-256; return the fixture root.

    Files land in ``<dest>.partial`` first and the folder is renamed only when all
    of them verified, so a failed download leaves nothing that looks usable.
    An existing ``dest`` whose files all verify is reused without fetching.
    """
    dest = Path(dest) if dest is not None else download_dir()
    if dest.is_dir() and all(
        (dest / p).is_file() and sha256_file(dest / p) == h for p, h in SOURCE_FILES.items()
    ):
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for rel in sorted(SOURCE_FILES):
            url = base_url + urllib.parse.quote(rel)
            hint = f"Pass --source PATH or set ${ENV_SOURCE} to a local copy of {GITHUB_REPO}."
            data = fetch_checked(url, SOURCE_FILES[rel], fetch, CatalogSourceError, rel, hint)
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            (partial / rel).write_bytes(data)
        (partial / "SOURCE").write_text(f"commit {PINNED_COMMIT}\n")
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def source_commit(root: Path) -> str:
    """The commit named in the ``SOURCE`` file beside the fixtures, or ``unknown``."""
    for cand in (root / "SOURCE", root.parent.parent.parent / "SOURCE"):
        if cand.is_file():
            words = cand.read_text().split()
            if len(words) >= 2 and words[0] == "commit":
                return words[1]
    return "unknown"
