"""Where ``ctrl CPU s``'s engine part goes: profile the engine thread's lease commands.

Runs one ``ladsd`` command (normally a ``replay``) in this process with the engine
loop's dispatch wrapped: every command that ``command_cpu_s`` counts (lease
notices, inventories, ticks, states and the rest; not Submit or Abort) runs under
one ``cProfile.Profile`` enabled on the engine thread only. Prints each command
type's CPU seconds and count, then the top functions by cumulative and by own
time. cProfile roughly doubles the times; compare policies by the same script
(FIFO's run is the baseline ``bench/ctrl_cpu.py`` divides by). Measures; never
asserts. Run it alone on the machine.

    .venv/bin/python bench/profile_commands.py replay --policy lads \\
        --workload captured-scaled --seeds 8 --kv-blocks 2300 --dilation 1.0
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import sys
import time
from typing import Any

from ladsd.engine import loop

TOP = 40
PROFILE = cProfile.Profile()
CPU: collections.Counter[str] = collections.Counter()
COUNT: collections.Counter[str] = collections.Counter()
_dispatch = loop.EngineLoop._dispatch


def profiled(self: loop.EngineLoop, c: Any) -> Any:
    """The loop's dispatch, profiled for the commands ``command_cpu_s`` counts."""
    if isinstance(c, loop._REQUESTS):
        return _dispatch(self, c)
    t0 = time.thread_time()
    PROFILE.enable()
    try:
        return _dispatch(self, c)
    finally:
        PROFILE.disable()
        CPU[type(c).__name__] += time.thread_time() - t0
        COUNT[type(c).__name__] += 1


def report() -> None:
    print("\ncommand CPU under the profiler (s, calls):")
    for name, s in CPU.most_common():
        print(f"  {name:<10} {s:8.4f}  {COUNT[name]:6d}")
    stats = pstats.Stats(PROFILE, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(TOP)
    stats.sort_stats("tottime").print_stats(TOP)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    loop.EngineLoop._dispatch = profiled  # type: ignore[method-assign]
    from cli.main import app

    code = 0
    try:
        app(sys.argv[1:], standalone_mode=False)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        report()
        sys.stdout.flush()
    # As `ladsd` does: vLLM's native threads can abort Python's normal teardown.
    os._exit(code)


if __name__ == "__main__":
    main()
