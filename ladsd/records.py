"""The shared vocabulary of the engine thread, the sender and the policies.

Transport, delivery and engine all import these types; ``ladsd.engine``
means vLLM only.

Two directions, nothing else crosses (architecture.md):

* sender -> engine: :class:`SenderInventory`, the causal inventory of pending
  results (FIFO order, payload bytes, ``Q_B``) and :class:`HistoryNotice`, the
  token history of a continuation announced at readiness;
* engine -> sender: :class:`EngineState`, one frozen, timestamped snapshot
  published after every step and every lease change, carrying the
  version-bound :class:`LeaseRecord` s and budget-denial events.

All are frozen dataclasses; :func:`check_record` is the sender-side validity
rule of spec section 3.4 as a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ladsd.config import FRAME_OVERHEAD

# The lease book's counters, always published in EngineState.counters (zero
# until they happen); run records (ladsd.metrics.events) report them too.
LEASE_COUNTERS: tuple[str, ...] = (
    "grants",
    "grants_before_commit",
    "grants_after_commit",
    "expiries",
    "handoffs",
    "handoff_mismatches",
    "revocations",
    "denials",
    "headroom_refusals",
    "cancellations",
    "invalidations",
)

# Retention outside the LADS budget (pins: ttl-pin and AugServe's Preserve), always
# published beside LEASE_COUNTERS (zero under policies that never pin).
RETENTION_COUNTERS: tuple[str, ...] = (
    "pins",
    "pin_handoffs",
    "pin_handoff_mismatches",
    "pin_expiries",
    "pin_cancels",
    "pin_cold",
    "pin_stripped",
    "pin_stripped_blocks",
    "preserves",
    "preserve_repeats",
    "preserve_refused_not_candidate",
    "preserve_refused_cold",
    "leases_to_pins",
    "sessions",
    "session_reorders",
)

# How the session order was kept and how sessions left (``SessionCounts``' fields ->
# their names in the lease audit and the run files): the one list of them.
SESSION_AUDIT: dict[str, str] = {
    "computed": "session_order_computed",
    "splices": "session_order_spliced",
    "put_back": "session_blocks_put_back",
    "let_go": "sessions_let_go",
    "allocated": "sessions_allocated",
    "unbound": "sessions_unbound",
    "ended": "sessions_ended",
    "replaced": "sessions_replaced",
    "kept": "sessions_kept",
    "expired": "sessions_expired",
    "aborted": "sessions_aborted",
}


@dataclass(frozen=True, order=True)
class ContinuationId:
    """Identity of a continuation: (workflow, turn, version)."""

    workflow: str
    turn: int
    version: int = 0

    def key(self) -> str:
        return f"{self.workflow}/{self.turn}/{self.version}"


class Phase(StrEnum):
    """Where a result is on the return path."""

    PENDING = "pending"  # ready, uncommitted: in F(t)
    COMMITTED = "committed"  # transport order fixed, not yet completely received
    RECEIVED = "received"  # completely received and registered with the engine
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class HistoryNotice:
    """A continuation's history, announced at readiness (before the sender sees it).

    ``token_ids`` is everything before the new observation; the engine hashes
    it with its own block hasher to find the resident prefix ``P_i``.
    """

    cid: ContinuationId
    token_ids: tuple[int, ...]
    prefix_digest: str
    payload_digest: str
    ready_time: float
    payload_bytes: int
    cache_salt: str | None = None
    # Intent (ladsd serve): the harness's expected seconds until the result is
    # back, used for T_B in place of the link estimate when the result does not
    # travel the daemon's own link. A prediction, not a promise.
    expected_wait_s: float | None = None
    # HEAR session retention: the probability that this session makes another
    # call after the one that produced ``token_ids``, estimated by the harness
    # from completed sessions only (ladsd.continuation). None: the engine's prior.
    continuation_p: float | None = None
    # This continuation's lease lifetime ``l_i`` (ours; ladsd serve's session rule,
    # :func:`ladsd.engine.budget.lease_lifetime`). None: the config's ``l``, as the spec.
    lifetime_s: float | None = None


@dataclass(frozen=True)
class InventoryItem:
    cid: ContinuationId
    phase: Phase
    payload_bytes: int  # p_i (frame payload, after the codec)
    ready_time: float  # r_i


@dataclass(frozen=True)
class SenderInventory:
    """The sender's causal inventory, published at readiness and on every change.

    ``items`` are in FIFO (ready-time) order; ``q_b`` is committed bytes not
    yet on the wire; ``rate`` is R in bytes/s; ``overhead`` is h.
    """

    time: float
    items: tuple[InventoryItem, ...]
    q_b: int
    rate: float
    overhead: int = FRAME_OVERHEAD

    def pending(self) -> tuple[InventoryItem, ...]:
        return tuple(i for i in self.items if i.phase is Phase.PENDING)


class LeaseEventKind(StrEnum):
    """What happened to a lease candidate (the daemon's outcome stream)."""

    GRANT = "grant"
    DENIAL = "denial"
    HANDOFF = "handoff"
    EXPIRY = "expiry"
    REVOCATION = "revocation"
    CANCELLATION = "cancellation"


@dataclass(frozen=True)
class LeaseEvent:
    """One lease outcome, published once in the next EngineState after it happened."""

    kind: LeaseEventKind
    cid: ContinuationId
    time: float
    blocks: int = 0  # protected blocks at the event (0 for a denial)


class LeaseStatus(StrEnum):
    """GRANTED while a lease holds its references; otherwise how it ended.

    The engine stamps the end on its lease when it releases it.
    :class:`EngineState` publishes active leases only, so a published record
    is GRANTED; a record of any other status stands for no protection.
    """

    GRANTED = "granted"
    HANDED_OFF = "handed_off"
    EXPIRED = "expired"
    REVOKED = "revoked"
    CANCELLED = "cancelled"


class LeaseKind(StrEnum):
    """What holds a published record's references.

    ``LADS``: a budgeted, revocable lease (spec 3). ``PIN``: a pin outside the
    budget (ttl-pin, AugServe's Preserve): never revoked for headroom, not in
    ``U`` or ``B``, and its handoff returns no budget quota, so its record
    says ``exclusive_blocks == 0``.
    """

    LADS = "lads"
    PIN = "pin"


@dataclass(frozen=True)
class LeaseRecord:
    """A version-bound lease record (spec 3.4); ``kind`` tells pins from LADS leases."""

    cid: ContinuationId
    prefix_digest: str
    payload_digest: str
    protected_blocks: tuple[int, ...]  # block ids of P_i held by this lease
    exclusive_blocks: int  # |E_i|
    granted_at: float  # g_i (first grant)
    deadline: float  # d_i = g_i + l
    generation: int  # budget generation at publication
    status: LeaseStatus = LeaseStatus.GRANTED  # the lease's own status when published
    committed_before_grant: bool = False  # grant recorded after commitment?
    kind: LeaseKind = LeaseKind.LADS


@dataclass(frozen=True)
class DenialEvent:
    """A feasible i in N(t) refused because U + Delta_i > B."""

    cid: ContinuationId
    time: float
    generation: int
    delta: int
    budget: int
    used: int


@dataclass(frozen=True)
class RefusalEvent:
    """A candidate refused because its grant would leave fewer than H blocks free (ours).

    Published like :class:`DenialEvent` (this generation's, once per identity), so
    the sender can tell a headroom regime from a budget one: a handoff returns
    quota (``U``) but frees no block (``F``), so it cannot help these.
    """

    cid: ContinuationId
    time: float
    generation: int
    free: int  # F at the refusal
    taken: int  # free blocks the grant and the pending allocation would take


@dataclass(frozen=True)
class EngineState:
    """Snapshot published from the engine thread (spec 3.4).

    ``resident`` maps each announced pending continuation to ``|P_i|`` (0 =
    cold); ``leases`` holds the active leases; ``denials`` the denial events
    of the current generation, ``refusals`` its headroom refusals (ours).
    """

    time: float
    seq: int
    generation: int
    U: int = 0
    B: int = 0
    C: int = 0
    F: int = 0
    w: int = 0  # waiting requests (preempted included)
    a: int = 0  # running requests
    m: int = 8  # max_num_seqs
    total_blocks: int = 0
    block_size: int = 0  # tokens per KV block (|P_i| * block_size = resident tokens)
    kappa: float = 0.0
    leases: tuple[LeaseRecord, ...] = ()
    denials: tuple[DenialEvent, ...] = ()
    resident: tuple[tuple[ContinuationId, int], ...] = ()
    counters: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    events: tuple[LeaseEvent, ...] = ()  # lease outcomes since the previous publication
    refusals: tuple[RefusalEvent, ...] = ()  # headroom refusals of the current generation

    def lease_for(self, cid: ContinuationId) -> LeaseRecord | None:
        for rec in self.leases:
            if rec.cid == cid:
                return rec
        return None

    def resident_blocks(self, cid: ContinuationId) -> int | None:
        """|P_i| as last published, or None if the engine has not seen ``cid``."""
        for c, n in self.resident:
            if c == cid:
                return n
        return None


class RecordInvalid(StrEnum):
    IDENTITY = "identity"
    DIGEST = "digest"
    STALE = "stale"
    FUTURE = "future"
    DUPLICATE = "duplicate"
    ORDER = "order"
    GENERATION = "generation"


def check_record(
    state: EngineState,
    record: LeaseRecord | None,
    *,
    cid: ContinuationId,
    prefix_digest: str,
    payload_digest: str,
    now: float,
    last_seq: int,
    max_age_s: float = 1.0,
) -> RecordInvalid | None:
    """Sender-side validity of ``record`` within ``state`` (spec 3.4).

    Returns None if the record may be used for this decision, else the first
    rule it breaks. ``last_seq`` is the highest state sequence number the
    sender accepted before; a state at or below it is a duplicate (equal) or
    out of order (lower). Callers pass ``last_seq=-1`` to skip that rule when
    re-reading the state they already accepted in this decision.
    """
    if record is None or record.cid != cid:
        return RecordInvalid.IDENTITY
    if record.prefix_digest != prefix_digest or record.payload_digest != payload_digest:
        return RecordInvalid.DIGEST
    if state.time > now + 1e-6:
        return RecordInvalid.FUTURE
    if now - state.time > max_age_s:
        return RecordInvalid.STALE
    if last_seq >= 0 and state.seq == last_seq:
        return RecordInvalid.DUPLICATE
    if last_seq >= 0 and state.seq < last_seq:
        return RecordInvalid.ORDER
    if record.generation != state.generation:
        return RecordInvalid.GENERATION
    if any(d.generation != state.generation for d in state.denials):
        return RecordInvalid.GENERATION
    return None
