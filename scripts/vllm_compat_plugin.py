"""pytest plugin for scripts/vllm_compat.sh: record outcomes, optionally install the lease pool.

With ``LADSD_LEASE_POOL=1`` every block pool that vLLM's KV cache coordinator
builds is a :class:`ladsd.engine.lease_pool.LeaseBlockPool` (the class vLLM
looks up as ``vllm.v1.core.kv_cache_coordinator.BlockPool``). Outcomes per
test id and the number of lease pools built go to ``$LADSD_COMPAT_OUT`` (JSON).
"""

from __future__ import annotations

import json
import os
from typing import Any

_outcomes: dict[str, str] = {}
_built = [0]


def pytest_configure(config: Any) -> None:
    if os.environ.get("LADSD_LEASE_POOL") != "1":
        return
    import vllm.v1.core.kv_cache_coordinator as coord

    from ladsd.engine.lease_pool import LeaseBlockPool

    class CountedLeasePool(LeaseBlockPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _built[0] += 1

    coord.BlockPool = CountedLeasePool


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        # A setup error or skip has no call phase; a teardown error spoils a pass.
        prev = _outcomes.get(report.nodeid)
        if prev is None or prev == "passed":
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    out = os.environ.get("LADSD_COMPAT_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"outcomes": _outcomes, "lease_pools_built": _built[0]}, f, indent=0)
