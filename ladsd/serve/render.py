"""Prompt token ids: ChatML turns, and the token-exact extension of a session's history.

The model's chat template (SmolLM2 and every shape profile use ChatML,
``ladsd.engine.models.CHATML_TEMPLATE``) is applied turn by turn with
:class:`ladsd.agent.prompt.ChatML`, whose pieces tokenize exactly as the
template would (``tests/engine/test_agent.py`` and ``tests/engine/test_serve_units.py``
check the equality); special-token strings inside a message stay text, so a
tool result cannot open a turn of its own.

A session's next prompt is never re-tokenized from the whole conversation: it
is the previous prompt + the model's own output ids (+ ``<|im_end|>`` if the
output was cut) + the new turns + the assistant header. The model's output ids
are often not the canonical tokenization of its text, so re-tokenizing would
change the history, miss the prefix cache and the history's lease.

Tokenising a long prompt takes seconds, so the daemon never does it on the
event loop: :meth:`Renderer.ids` runs on the renderer's one thread, with the
renderer's own copy of the tokenizer (fast tokenizers are not safe across
threads; the engine's asyncio-side tokenizer stays the loop's).
:meth:`Renderer.least` is the cheap bound checked before: no token stands for
more characters than the longest vocabulary entry, so text of ``n``
characters takes at least ``n // K`` tokens.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ladsd.agent.prompt import ChatML
from ladsd.serve.replies import Piece


def max_token_chars(tokenizer: Any) -> int | None:
    """``K``: characters of text one token stands for, at most; None if unknown.

    Measured on the vocabulary entries, which never take fewer characters
    than the text they stand for (byte-level entries: one character a byte;
    SentencePiece: the text itself, a space as one character). A normalizer
    could shrink the text before it is split, so with one there is no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    return max((len(t) for t in tokenizer.get_vocab()), default=0) or None


class Renderer:
    """Token ids of canonical turns for one tokenizer (a ChatML model).

    Owns a copy of ``tokenizer`` and the one thread that uses it (:meth:`ids`);
    the synchronous methods are for single-threaded callers (tests, tools).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.ml = ChatML(copy.deepcopy(tokenizer))
        self.k = max_token_chars(self.ml.tok)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ladsd-tokenizer")

    def least(self, turns: Sequence[Piece]) -> int:
        """Tokens ``turns`` take at least (a lower bound, computed without tokenising)."""
        if self.k is None:
            return 0
        return sum(len(role) + 1 + len(text) for role, text in turns) // self.k

    async def ids(self, turns: Sequence[Piece], history: Sequence[int] | None = None) -> list[int]:
        """:meth:`prompt` of ``turns``, or :meth:`extend` of ``history``, off the event loop."""
        loop = asyncio.get_running_loop()
        if history is None:
            return await loop.run_in_executor(self._thread, self.prompt, tuple(turns))
        return await loop.run_in_executor(self._thread, self.extend, tuple(history), tuple(turns))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def prompt(self, turns: Sequence[Piece]) -> list[int]:
        """A whole conversation + the assistant header (a request without history)."""
        ids: list[int] = []
        for role, text in turns:
            ids += self.ml.turn(role, text)
        return ids + self.ml.header()

    def history(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """What waits for the tool: prompt + output, closed by end-of-turn."""
        return self.ml.history(prompt, output)

    def extend(self, history: Sequence[int], turns: Sequence[Piece]) -> list[int]:
        """``history`` (closed by end-of-turn) + the newline that ends its turn + new turns."""
        ids = [*history, *self.ml.text("\n")]
        for role, text in turns:
            ids += self.ml.turn(role, text)
        return ids + self.ml.header()
