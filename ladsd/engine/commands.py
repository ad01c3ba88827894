"""Typed commands from the asyncio side to the engine thread.

Everything the asyncio side asks of the engine crosses the thread boundary as
one of these frozen records, through the one :class:`Inbox`, and is handled
in one place: :meth:`ladsd.engine.loop.EngineLoop._dispatch` on the engine
thread. No command carries code. Everything that comes back (replies, outputs, published states)
is a record of :mod:`ladsd.engine.outbound`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any

from ladsd.engine.outbound import EngineDead, EngineError
from ladsd.records import ContinuationId, HistoryNotice, SenderInventory


@dataclass(frozen=True)
class Submit:
    """Register a request (stamped ``a`` on the asyncio side); bind ``cid`` if given."""

    rid: str
    ids: tuple[int, ...]
    params: Any  # vllm.SamplingParams
    a: float
    cid: ContinuationId | None = None


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Notice:
    """A result is ready: the lease provider sees its history before the sender does."""

    notice: HistoryNotice


@dataclass(frozen=True)
class Require:
    """Retention as a requirement: lease now or refuse. Reply: None, or the reason."""

    notice: HistoryNotice


@dataclass(frozen=True)
class Inventory:
    """The sender's latest inventory; a drained batch keeps only the newest (coalesced)."""

    inventory: SenderInventory


@dataclass(frozen=True)
class Cancel:
    """The workflow was cancelled: drop its lease and candidate."""

    cid: ContinuationId


@dataclass(frozen=True)
class Tick:
    """The 100 ms lease tick (posted by the engine thread to itself)."""


@dataclass(frozen=True)
class Snapshot:
    """Reply: a :class:`ladsd.engine.thread.PoolSnapshot`."""


@dataclass(frozen=True)
class State:
    """A barrier: publish a fresh ``EngineState`` now (after the integrity check if
    ``check``); reply: its seq. The publication reaches every subscriber first."""

    check: bool = True


@dataclass(frozen=True)
class Sizes:
    """Reply: entries per engine-side table (requests, stamps, lease book), for leak checks."""


@dataclass(frozen=True)
class Finish:
    """End of run: release every lease, check integrity; reply: the lease audit."""


@dataclass(frozen=True)
class Stop:
    """Leave the serve loop (``EngineThread.stop``)."""


Command = (
    Submit
    | Abort
    | Notice
    | Require
    | Inventory
    | Cancel
    | Tick
    | Snapshot
    | State
    | Sizes
    | Finish
    | Stop
)
Queued = tuple[Command, "asyncio.Future | None"]  # a command and where its reply goes


class Inbox:
    """The one queue into the engine thread; closed for good when the engine dies.

    One lock orders puts against death: a command is either refused (the death
    raised) or queued before the death took the queue (:meth:`close`), never orphaned.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Queued] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.error: EngineDead | None = None
        self.open = False  # the engine thread takes commands (started, not stopped)

    def put(self, command: Command, fut: asyncio.Future | None = None) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            if not self.open:
                raise EngineError("engine not started")
            self._q.put((command, fut))

    def offer(self, command: Command) -> None:
        """Queue ``command`` if the engine takes commands; else drop it (an abort of a
        request the engine has already ended with its stop or death)."""
        with self._lock:
            if self.error is None and self.open:
                self._q.put((command, None))

    def stop(self) -> None:
        """Queue a Stop (a start given up, or a clean stop); nothing after it is taken."""
        with self._lock:
            if self.error is None:
                self._q.put((Stop(), None))
            self.open = False

    def get(self, wait: float | None) -> list[Queued]:
        """Every queued command; waits for the first up to ``wait`` s (None: for ever)."""
        try:
            if wait is None:
                first = self._q.get()
            else:
                first = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
        except queue.Empty:
            return []
        batch = [first]
        while True:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                return batch

    def close(self, error: EngineDead) -> list[Queued]:
        """The engine died: refuse every later command; return those still queued."""
        with self._lock:
            self.error = error
        return self.get(0)
