"""How an engine runs between requests (:class:`Upkeep`), and what its thread did
(:class:`Activity`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ladsd.engine.kappa import KappaSource


@dataclass(frozen=True)
class Upkeep:
    """How a long-lived engine (the daemon's) runs; the defaults are a replay's, unchanged.

    * ``kappa``: where kappa comes from (:mod:`ladsd.engine.kappa`);
    * ``quiet_idle``: no tick while no candidate, lease or pin is live and nothing
      changed since the last tick; no state published after a query (state,
      sizes, snapshot); an idle thread sleeps until the next command;
    * ``timeline_samples``: the runtime's lease timeline keeps its last samples
      only (None: every one, as a replay's run file needs);
    * ``progress``: told one line per start-up phase (on the engine thread).
    """

    kappa: KappaSource = KappaSource.MEASURE
    quiet_idle: bool = False
    timeline_samples: int | None = None
    progress: Callable[[str], None] | None = None


DAEMON_UPKEEP = Upkeep(KappaSource.CACHE, quiet_idle=True, timeline_samples=1024)


@dataclass
class Activity:
    """What the engine thread did (tests and bench figures count these, never time)."""

    loops: int = 0  # iterations of the engine loop
    ticks: int = 0  # lease ticks run
    published: int = 0  # engine states published
    unchanged: int = 0  # states not published after a step: the last one's but for time
    steps: int = 0  # engine steps that did something
    kappa_steps: int = 0  # engine steps run to measure kappa (0: not measured)
    kappa_from: str = ""  # "measured", "cache" or "config" (the lease config's kappa_s)
