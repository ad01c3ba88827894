"""Compare two outcome files of vllm_compat.sh: the pass sets must be identical.

Usage: vllm_compat.py PLAIN.json LEASE.json SECONDS_PLAIN SECONDS_LEASE
Prints both counts; exits 1 if the pass sets differ or no lease pool was built.
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def main(argv: list[str]) -> int:
    plain, lease = (json.load(open(p)) for p in argv[1:3])
    t_plain, t_lease = (float(x) for x in argv[3:5])
    ok_plain = {k for k, v in plain["outcomes"].items() if v == "passed"}
    ok_lease = {k for k, v in lease["outcomes"].items() if v == "passed"}
    for name, res, t in (("plain BlockPool", plain, t_plain), ("LeaseBlockPool", lease, t_lease)):
        c = Counter(res["outcomes"].values())
        print(
            f"{name:16s} passed {c['passed']:4d}  failed {c['failed']:3d}  "
            f"skipped {c['skipped']:3d}  ({t:.0f} s)"
        )
    print(f"lease pools built by vLLM's coordinator: {lease['lease_pools_built']}")
    bad = 0
    if ok_plain != ok_lease:
        for k in sorted(ok_plain - ok_lease):
            print(f"passes only with the plain pool: {k}")
        for k in sorted(ok_lease - ok_plain):
            print(f"passes only with the lease pool: {k}")
        bad = 1
    if lease["lease_pools_built"] == 0:
        print("the lease pool was never installed: the comparison proves nothing")
        bad = 1
    if not ok_plain:
        print("nothing passed: the run is broken")
        bad = 1
    print("IDENTICAL pass sets" if not bad else "MISMATCH")
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv))
