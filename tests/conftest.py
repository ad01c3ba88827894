"""Shared fixtures. Engine tests need `ladsd model prepare` (the install does it)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """The catalog built from ../shared/data into a temporary SQLite file (read-only use)."""
    from web_catalog import source
    from web_catalog.build import build
    from web_catalog.db import open_catalog

    if not source.DEFAULT_SOURCE.is_dir():
        pytest.skip(f"shared fixtures not found at {source.DEFAULT_SOURCE}")
    path = tmp_path_factory.mktemp("catalog") / "catalog.sqlite"
    build(source.DEFAULT_SOURCE, path)
    with open_catalog(path) as cat:
        yield cat
