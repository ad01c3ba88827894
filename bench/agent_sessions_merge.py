"""Join passes of bench/agent_sessions.py run one after another into one result file.

    .venv/bin/python bench/agent_sessions_merge.py A.json B.json --out C.json [--scale-out]

A second pass (another order of the servers, the same seeds) is a repeat: its runs get
repeat indices after the first file's. The files must agree on the engine, the workload
and the commit, or nothing is written. The tables and ratios are computed again from all
runs except those marked ``disturbed`` (kept in the file, with the reason).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_head  # noqa: E402

SAME = ("engine", "workload", "machine")


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    first = docs[0]
    for d in docs[1:]:
        for k in SAME:
            if d[k] != first[k]:
                raise SystemExit(f"the passes differ in {k!r}: not one experiment")
        if d["git"]["commit"] != first["git"]["commit"]:
            raise SystemExit("the passes ran different commits")
    runs, base = [], 0
    for d in docs:
        for r in d["runs"]:
            runs.append(r | {"repeat": base + r["repeat"]})
        base = max(r["repeat"] for r in runs) + 1
    return {k: v for k, v in first.items() if k not in ("runs", "table", "ratios")} | {
        "merged": [
            {"argv": d["argv"], "created": d["created"], "runs": len(d["runs"])} for d in docs
        ],  # fmt: skip
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scale-out", action="store_true", help="the passes are a --scale-out run")
    args = ap.parse_args()
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_sessions", Path(__file__).with_name("agent_sessions.py")
    )
    assert spec is not None and spec.loader is not None
    drv = importlib.util.module_from_spec(spec)
    sys.modules["bench_sessions"] = drv
    spec.loader.exec_module(drv)
    doc = merge([json.loads(p.read_text()) for p in args.files])
    doc["bench"] = "agents/scale-out" if args.scale_out else doc["bench"]
    doc["merged_by"] = result_head("agents/merge", doc["created"])
    kept = [r for r in doc["runs"] if not r.get("disturbed")]
    doc["table"] = drv.table(kept, drv.COLUMNS, "coding-agent sessions (all passes)")
    if args.scale_out:
        doc["ratios"] = {k: drv.ratios(kept, k, "ch-lads", ("ch-lads", "ch-lads-aa"))
                         for k in ("session_s", "session_model_s", "cached_frac")}  # fmt: skip
        doc["vs_one_replica"] = {
            k: drv.vs_one(kept, k) for k in ("session_s", "session_model_s", "cached_frac")
        }
    else:
        doc["ratios"] = {k: drv.ratios(kept, k, "vllm", ("lads", "lads-aa"))
                         for k in ("session_s", "session_model_s", "turn_s")}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out} ({len(doc['runs'])} runs, {len(doc['runs']) - len(kept)} disturbed)")


if __name__ == "__main__":
    main()
