"""Records from the engine thread to the asyncio side, and the one sink they go through.

Contract:

* Everything the engine thread tells the asyncio side is one of the frozen
  records of :data:`Record`, put through :class:`Sink` (one
  ``call_soon_threadsafe`` path, so records arrive in the order they were put;
  :meth:`Sink.batch` hands an engine step's records over together)
  and handled in one place: :meth:`ladsd.engine.client.EngineClient._on_record`.
* :class:`Published` and :class:`Reply` carry the engine thread's
  :class:`Counters`: the asyncio side reads counters from records only, never
  from the engine thread's fields.
* ``State`` is a barrier: its :class:`Published` is put before its
  :class:`Reply` (the seq), so the state, and every lease event in it, has
  reached every subscriber when the reply does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ladsd.clock import Stamps
from ladsd.records import EngineState

log = logging.getLogger("ladsd.engine")


class EngineError(RuntimeError):
    """The engine rejected a request or failed while running it."""


class EngineDead(EngineError):
    """The engine thread stopped after an error; it refuses all work."""


@dataclass(frozen=True)
class Counters:
    """Engine-thread counters, as of the record that carries them (cumulative)."""

    command_cpu_s: float = 0.0  # engine-thread CPU in lease commands, queries and ticks
    inventory_bytes: int = 0  # inventories that crossed (after coalescing)
    publish_cpu_s: float = 0.0  # engine-thread CPU building the states published after steps
    schedule_cpu_s: float = 0.0  # engine-thread CPU of the lease work inside vLLM's schedule()


@dataclass(slots=True)
class Tally:
    """The engine thread's running :class:`Counters` (that thread only), frozen per record."""

    command_cpu_s: float = 0.0
    inventory_bytes: int = 0
    publish_cpu_s: float = 0.0
    schedule_cpu_s: float = 0.0

    def frozen(self) -> Counters:
        return Counters(
            self.command_cpu_s, self.inventory_bytes, self.publish_cpu_s, self.schedule_cpu_s
        )


@dataclass(frozen=True)
class Published:
    """A lease state, published in engine order."""

    state: EngineState
    counters: Counters


@dataclass(frozen=True)
class Output:
    """A request's newest cumulative output (vLLM ``RequestOutput``)."""

    rid: str
    out: Any


@dataclass(frozen=True)
class Done:
    """A request's final output and its engine-side stamps a, n, f."""

    rid: str
    out: Any  # vllm RequestOutput
    stamps: Stamps


@dataclass(frozen=True)
class Failed:
    """A request was rejected, or failed with the engine (its stream's last item)."""

    rid: str
    error: EngineError


@dataclass(frozen=True)
class Reply:
    """The answer to a command that has one: ``value`` (an exception: raised there)."""

    fut: asyncio.Future
    value: object
    counters: Counters


@dataclass(frozen=True)
class Dead:
    """The engine died: every stream still open fails with ``error``."""

    error: EngineDead


Record = Published | Output | Done | Failed | Reply | Dead


class Sink:
    """The engine thread's one way out: ``put`` hands a record to the loop, in order.

    Inside :meth:`batch` the records are held and handed over together when it
    ends (also on an error): an engine step's outputs and the state published
    after it wake the event loop once, not once each (every
    ``call_soon_threadsafe`` writes to the loop's self-pipe). Outside a batch a
    record goes at once, so a reply is never held behind a step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_record: Callable[[Record], None]):
        self._loop = loop
        self._on_record = on_record
        self._held: list[Record] | None = None  # a batch is open
        # This thread's CPU waking the loop for the last batch when it held only states:
        # a wake the controller alone needed (the step's outputs need theirs anyway).
        self.state_wake_cpu_s = 0.0

    def put(self, record: Record) -> None:
        if self._held is not None:
            self._held.append(record)
            return
        self._send(self._on_record, record)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the records put inside; hand them over in order when it ends."""
        if self._held is not None:
            raise RuntimeError("a sink batch is already open")
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            t0 = time.thread_time()
            if len(held) == 1:
                self._send(self._on_record, held[0])
            elif held:
                self._send(self._take, held)
            states = bool(held) and all(isinstance(r, Published) for r in held)
            self.state_wake_cpu_s = time.thread_time() - t0 if states else 0.0

    def _take(self, records: list[Record]) -> None:
        """Each record of a batch, as its own callback would be: one that raises is
        reported to the loop's exception handler and the rest still go."""
        for r in records:
            try:
                self._on_record(r)
            except Exception as e:
                self._loop.call_exception_handler(
                    {"message": f"handling {type(r).__name__} failed", "exception": e}
                )

    def _send(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed: a start given up while the engine loaded
            log.debug("event loop closed; dropped %s", type(arg).__name__)
