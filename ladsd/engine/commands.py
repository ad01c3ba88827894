"""Typed commands from the asyncio side to the engine thread.

Everything the asyncio side asks of the engine crosses the thread boundary as
one of these frozen records, through ``EngineThread``'s queue, and is handled
in one place: ``EngineThread._dispatch`` on the engine thread. No command
carries code. Replies (where a command has one) come back on an asyncio
future; outputs of requests come back on their own streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """A barrier: a fresh ``EngineState`` (after the integrity check if ``check``) is
    published, and is the reply too; the publication reaches ``on_state`` first."""

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
    | Inventory
    | Cancel
    | Tick
    | Snapshot
    | State
    | Finish
    | Stop
)
