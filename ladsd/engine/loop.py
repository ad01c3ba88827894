"""The engine thread's loop: drain commands -> step -> deliver -> lease tick -> publish.

Contract:

* Engine thread only: the only code that touches vLLM state. Commands come
  from the :class:`~ladsd.engine.commands.Inbox` and are acted on in one
  place (:meth:`EngineLoop._dispatch`); everything back is a record of
  :mod:`ladsd.engine.outbound`, put through one :class:`~ladsd.engine.outbound.Sink`.
* ``State`` is a barrier: the state is published, then the reply is its seq.
* Counters (:class:`~ladsd.engine.outbound.Counters`) are this thread's and
  travel in every ``Published`` and ``Reply``; every lease command, tick and
  query counts its CPU, also those that reply at once. They add up in a mutable
  :class:`~ladsd.engine.outbound.Tally`, frozen only when a record carries them
  (a ``dataclasses.replace`` per step was 5,000 copies a run).
* Upkeep (:class:`~ladsd.engine.upkeep.Upkeep`): a replay's engine ticks every
  ``tick_s`` and publishes after every command, step and tick that changed what a
  state shows (a step whose state would equal the last one but for its time
  publishes nothing while that one is younger than a tick); the daemon's is
  quiet when idle (no tick while nothing is live and nothing changed since the
  last one; no state after a query; the thread sleeps until a command).
* Fail fast: any error of this thread declares the engine dead (a step that
  raised may have registered block hashes for KV it never computed, so the
  prefix cache can no longer be trusted): every lease is released and the
  final audit kept, every request in flight and every queued command fail
  with :class:`~ladsd.engine.outbound.EngineDead`, and the loop stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ladsd import clock
from ladsd.clock import Stamps
from ladsd.engine import commands as cmd
from ladsd.engine.build import Built
from ladsd.engine.kappa import Kappa
from ladsd.engine.outbound import (
    Dead,
    Done,
    EngineDead,
    EngineError,
    Failed,
    Output,
    Published,
    Reply,
    Sink,
    Tally,
)
from ladsd.engine.upkeep import Activity, Upkeep
from ladsd.records import EngineState, SenderInventory

log = logging.getLogger("ladsd.engine")
# A step that scheduled nothing (unfinished requests, none allocatable: e.g. hard pins
# hold the pool) is retried after this wait, not at once, and publishes no state:
# spinning published thousands of states a second and starved the event loop.
STALL_WAIT_S = 0.005
# Commands that only read: under quiet idle (Upkeep) they publish no state.
_QUERIES = (cmd.Snapshot, cmd.State, cmd.Sizes)
_REQUESTS = (cmd.Submit, cmd.Abort)  # vLLM's request path: not the controller's CPU


@dataclass(frozen=True)
class PoolSnapshot:
    free_blocks: int
    total_blocks: int
    waiting: int
    running: int
    max_num_seqs: int
    block_size: int
    kappa: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Publication:
    """The last published state's mark (``lease_mark``: all it shows but its time) and time."""

    mark: tuple[float, ...] | None = None
    time: float = float("-inf")


@dataclass
class _Req:
    """Engine-thread book-keeping of one registered request."""

    internal_id: str
    a: float


class EngineLoop:
    """Serves one built engine until Stop or death (see the module contract)."""

    def __init__(
        self,
        built: Built,
        kappa: Kappa,
        inbox: cmd.Inbox,
        sink: Sink,
        upkeep: Upkeep,
        *,
        tick_s: float,
        block_size: int,
    ) -> None:
        self.built = built
        self.kappa = kappa
        self.inbox = inbox
        self.sink = sink
        self.upkeep = upkeep
        self.activity = Activity(kappa_steps=kappa.steps, kappa_from=kappa.source)
        self.tick_s = tick_s
        self.block_size = block_size
        self.reqs: dict[str, _Req] = {}
        self.tally = Tally()  # what the next record's Counters will say
        self.final_audit: dict[str, float] | None = None
        self.last = Publication()  # what the last published state showed, and when

    @property
    def sched(self) -> Any:
        return self.built.sched

    def run(self) -> None:
        """Serve; on any error die (the contract); on a clean stop fail what is left."""
        try:
            self._serve()
        except BaseException as e:
            log.exception("engine thread failed")
            self._die(e)
        finally:
            if self.inbox.error is None:  # clean stop: fail what is still queued or running
                self._fail_reqs(EngineError("engine stopped"))
                self._fail_queued(self.inbox.get(0), EngineError("engine stopped"))
            try:
                self.built.engine.engine_core.shutdown()
            except Exception:  # already down
                pass

    def _serve(self) -> None:
        engine, tick = self.built.engine, self.tick_s
        next_tick = clock.now() + tick
        stalled = False
        dirty = True  # (quiet idle) something changed since the last tick
        while True:
            self.activity.loops += 1
            busy = engine.has_unfinished_requests()
            wait = max(0.0, next_tick - clock.now())
            if busy:
                wait = min(wait, STALL_WAIT_S) if stalled else 0.0
            # Nothing to tick for (quiet idle): sleep until the next command.
            idle = not busy and self._at_rest(dirty)
            stop, changed = self._drain(None if idle else wait)
            if stop:
                return
            if idle:
                next_tick = clock.now() + tick  # the first tick after idle is a period away
            with self.sink.batch():  # the step's outputs and the state after it: one wake
                if engine.has_unfinished_requests():
                    worked = self._step()
                    stalled = not worked
                    changed = changed or worked
                dirty = dirty or changed
                if clock.now() >= next_tick:
                    if not self._at_rest(dirty):
                        self._dispatch(cmd.Tick())
                        self.activity.ticks += 1
                        changed, dirty = True, False
                    next_tick = clock.now() + tick
                if changed:
                    self._publish_step()
            # A wake that only states needed: the controller's.
            self.tally.publish_cpu_s += self.sink.state_wake_cpu_s

    def _at_rest(self, dirty: bool) -> bool:
        """Quiet idle: nothing changed since the last tick and no lease, candidate or pin
        is live, so a tick has nothing to do."""
        return self.upkeep.quiet_idle and not dirty and self.sched.lease_quiet()

    def _drain(self, wait: float | None) -> tuple[bool, bool]:
        """Run every queued command (None: wait for one); return (stop, anything changed).

        Under quiet idle a query (:data:`_QUERIES`) changes nothing. An inventory
        changes something only if the book's mark differs from the one at the last
        publication (``lease_mark``): most inventories are a chunk written, and a
        state that differs from the last one only in its time tells the sender
        nothing (the tick still publishes every period, so records stay young).
        Every other command counts, as a replay always did.
        """
        changed = False
        for command, fut in _coalesce(self.inbox.get(wait)):
            if isinstance(command, cmd.Stop):
                return True, True
            inventory = isinstance(command, cmd.Inventory)
            queried = self.upkeep.quiet_idle and isinstance(command, _QUERIES)
            changed = changed or not (queried or inventory)
            try:
                res = self._dispatch(command)
            except Exception as e:
                if fut is None:  # nobody to tell: fatal (see the contract)
                    raise
                res = e  # e.g. an audit mismatch: the caller's error
            if inventory:
                changed = changed or res is True  # the book's mark moved
            if fut is not None:
                self.reply(fut, res)
        return False, changed

    def _dispatch(self, c: cmd.Command) -> Any:
        """Act on a command, counting its CPU: every lease command and query (early
        replies too), not vLLM's own request path (Submit, Abort: any server pays it)."""
        if isinstance(c, _REQUESTS):
            return self._act(c)
        t0 = time.thread_time()
        try:
            return self._act(c)
        finally:
            self.tally.command_cpu_s += time.thread_time() - t0

    def _act(self, c: cmd.Command) -> Any:
        """The one place that acts on a command (engine thread)."""
        s = self.sched
        match c:
            case cmd.Submit():
                return self._add(c)
            case cmd.Abort(rid):
                return self._abort(rid)
            case cmd.Notice(notice):
                return s.lease_notice(notice)
            case cmd.Require(notice):
                return s.lease_require(notice)
            case cmd.Inventory(inv):
                self.tally.inventory_bytes += inv_bytes(inv)
                s.lease_inventory(inv)
                # Against the last published state (a stalled step may have expired a
                # lease unpublished); inside the command, so its CPU counts with it.
                return s.lease_mark() != self.last.mark
            case cmd.Cancel(cid):
                return s.lease_cancel(cid)
            case cmd.Tick():
                return s.lease_tick()
            case cmd.Snapshot():
                return self._pool()
            case cmd.State(check):
                if check:
                    s.check_integrity()
                # A barrier: published first, so the lease events this state took from
                # the book reach every subscriber before the reply (its seq) does.
                return self._publish().seq
            case cmd.Sizes():
                book = {f"lease_book.{k}": v for k, v in s.lease_book.sizes().items()}
                return {"requests": len(self.reqs), "first_alloc": len(s.first_alloc), **book}
            case cmd.Finish():
                s.lease_release_all()
                s.check_integrity()
                return s.lease_audit()
            case _:
                raise TypeError(f"not an engine command: {c!r}")

    def _add(self, c: cmd.Submit) -> None:
        from vllm.inputs.engine import tokens_input

        try:
            internal = self.built.engine.add_request(c.rid, tokens_input(list(c.ids)), c.params)
        except Exception as e:
            self.sink.put(Failed(c.rid, EngineError(f"request {c.rid} rejected: {e}")))
            return
        self.reqs[c.rid] = _Req(internal, c.a)
        if c.cid is not None:
            self.sched.lease_bind(c.cid, internal)

    def _abort(self, rid: str) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:  # finished, or rejected at registration
            return
        self.built.engine.abort_request([rid])
        self.sched.pop_first_alloc(req.internal_id)

    def _step(self) -> bool:
        """One engine step; whether it did anything (scheduled tokens or gave outputs)."""
        try:
            outs = self.built.engine.step()
        except Exception as e:
            raise EngineDead(f"engine step failed: {e!r}") from e
        self.tally.schedule_cpu_s = self.sched.lease_schedule_cpu_s  # inside schedule()
        if not outs and self.sched.last_scheduled_tokens == 0:
            return False
        self.activity.steps += 1
        t = clock.now()
        for out in outs:
            req = self.reqs.get(out.request_id)
            if req is None:
                continue
            if out.finished:
                del self.reqs[out.request_id]
                n = self.sched.pop_first_alloc(req.internal_id)
                self.sink.put(Done(out.request_id, out, Stamps(a=req.a, n=n, f=t)))
            else:
                self.sink.put(Output(out.request_id, out))
        return True

    def _die(self, err: BaseException) -> None:
        """Declare the engine dead: fail everything, release leases, keep the audit."""
        dead = err if isinstance(err, EngineDead) else EngineDead(f"engine failed: {err!r}")
        try:  # before anyone hears of the death, so the audit is there when they ask
            self.sched.lease_release_all()
            self.final_audit = self.sched.lease_audit()
        except Exception:
            log.exception("lease release after engine failure")
        queued = self.inbox.close(dead)
        self._fail_reqs(dead)
        self._fail_queued(queued, dead)
        self.sink.put(Dead(dead))

    def _fail_reqs(self, err: EngineError) -> None:
        for rid in list(self.reqs):
            self.sink.put(Failed(rid, err))
        self.reqs.clear()

    def _fail_queued(self, queued: list[cmd.Queued], err: EngineError) -> None:
        for command, fut in queued:
            if fut is not None:
                self.reply(fut, err)
            elif isinstance(command, cmd.Submit):
                self.sink.put(Failed(command.rid, err))

    def _publish_step(self) -> None:
        """Publish after a loop iteration that changed something, counting its CPU: the
        states the sender reads are the controller's work too (spec 3.4), not only the
        commands (a ``State`` barrier's publication counts as its command's).

        Skipped while the state would equal the last one but for its time (equal
        marks) and that one is younger than a tick: most decode steps move no block,
        lease, budget or load (55 % of LADS adaptive's post-step states on
        captured-scaled, 37 % of FIFO's, counted at stop 49). The age bound keeps
        every state the sender holds at most a tick old, as the tick alone did.
        """
        t0 = time.thread_time()
        young = clock.now() - self.last.time < self.tick_s
        if young and self.sched.lease_mark() == self.last.mark:
            self.activity.unchanged += 1
        else:
            self._publish()
        self.tally.publish_cpu_s += time.thread_time() - t0

    def _publish(self) -> EngineState:
        """Publish a fresh state (in engine order, with the counters)."""
        state = self.sched.lease_state()
        self.last = Publication(self.sched.lease_mark(), state.time)  # see _drain, _publish_step
        self.activity.published += 1
        self.sink.put(Published(state, self.tally.frozen()))
        return state

    def reply(self, fut: asyncio.Future, value: object) -> None:
        self.sink.put(Reply(fut, value, self.tally.frozen()))

    def _pool(self) -> PoolSnapshot:
        s = self.sched
        pool = s.kv_cache_manager.block_pool
        return PoolSnapshot(
            free_blocks=pool.get_num_free_blocks(),
            total_blocks=pool.num_gpu_blocks,
            waiting=len(s.waiting),
            running=len(s.running),
            max_num_seqs=s.max_num_running_reqs,
            block_size=self.block_size,
            kappa=self.kappa.seconds,
        )


def inv_bytes(inv: SenderInventory) -> int:
    """Bytes of an inventory as a control record (what crosses to the engine)."""
    import orjson

    return len(orjson.dumps(inv))


def _coalesce(batch: list[cmd.Queued]) -> list[cmd.Queued]:
    """Only the newest inventory of a drained batch crosses, at the first one's place."""
    invs = [i for i, (c, _) in enumerate(batch) if isinstance(c, cmd.Inventory)]
    if len(invs) < 2:
        return batch
    out = list(batch)
    out[invs[0]] = batch[invs[-1]]
    drop = set(invs[1:])
    return [x for i, x in enumerate(out) if i not in drop]
