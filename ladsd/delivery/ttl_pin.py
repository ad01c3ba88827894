"""Continuum-style TTL pinning (peers.md section 3): FIFO delivery, hard pins.

The delivery order is FIFO (ready order, ties by identity), as Continuum
schedules FCFS at program level. The engine side pins every waiting history
at readiness for its predicted tool and delivery time plus a margin, capped at
``l``, with no budget and no revocation for headroom (``Retention.TTL_PIN``,
built in the engine's lease code). No LADS leases are granted
(``uses_leases`` False), so comparing with ``lads`` shows what the budget and
the revocation buy.
"""

from __future__ import annotations

from ladsd.delivery.fifo import Fifo
from ladsd.modes import Retention


class TtlPin(Fifo):
    name = "ttl-pin"
    uses_leases = False
    retention = Retention.TTL_PIN
