"""The lease audit's one rule and its one error (spec 3.3).

Every lease or pin reference added to a KV block is released by the end of a
run (or still held while it runs). The engine's lease book checks it live, a
run file's counters are checked against it when read back; both raise
:class:`LeaseIntegrityError`. Nothing here imports vLLM.
"""

from __future__ import annotations


class LeaseIntegrityError(AssertionError):
    """Lease references or block counts that disagree with their holders (fails the run)."""


def check_refs(added: float, released: float, held: float = 0.0, what: str = "references") -> None:
    """Raise :class:`LeaseIntegrityError` unless ``added == released + held``.

    ``what`` names the references in the message (it reads ``<what> added ...``).
    """
    if added != released + held:
        also = f" + held {held:g}" if held else ""
        raise LeaseIntegrityError(
            f"{what} added {added:g} != released {released:g}{also} "
            f"({added - released - held:+g} leaked)"
        )
