"""Errors of the return link (frame errors live in :mod:`ladsd.transport.frame`)."""

from __future__ import annotations


class LinkError(Exception):
    """Base of the link's own errors."""


class OfferError(LinkError, ValueError):
    """An offered result that cannot be framed or contradicts its Pending record."""


class FrameRejected(LinkError):
    """The receiver rejected a result more often than ``max_rejects`` allows."""


class SendFailed(LinkError):
    """A committed frame on which the connection dropped ``max_drops`` times."""


class LinkDown(LinkError):
    """The connection dropped (or could not be re-dialled) more than ``max_drops`` times
    in a row with results outstanding and no answer from the receiver: the sender stops."""


class LinkClosed(LinkError):
    """The link closed before the result was received."""


class Cancelled(LinkError):
    """The result was cancelled before commitment."""


class PolicyError(LinkError):
    """The delivery policy failed: a hook raised, or it chose something not pending.

    Fatal: the sender stops and every outstanding ticket fails with it.
    """


class Rejected(Exception):
    """Raised by the receiver's registration callback to refuse a binding."""


class ControlError(LinkError):
    """A malformed control message (the connection is then re-dialled)."""
