"""One checked download: the bytes at ``url`` only if their SHA-256 is the pinned one.

Shared by the catalog fixtures (web_catalog/source.py) and the cc-traces
(ladsd/workloads/cc_source.py); each names its own error type and its way out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

Fetch = Callable[[str], bytes]


def fetch_checked(
    url: str, sha256: str, fetch: Fetch, error: type[Exception], name: str, hint: str
) -> bytes:
    """``fetch(url)``, refused with ``error`` naming ``name`` on a failure or a wrong hash."""
    try:
        data = fetch(url)
    except Exception as e:
        raise error(f"{name}: could not download {url}: {e}. {hint}") from e
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise error(f"{name}: SHA-256 mismatch from {url}: expected {sha256}, got {got}")
    return data
