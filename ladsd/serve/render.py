"""Prompt token ids: ChatML turns, and the token-exact extension of a session's history.

The model's chat template (SmolLM2 and every shape profile use ChatML,
``ladsd.engine.models.CHATML_TEMPLATE``) is applied turn by turn with
:class:`ladsd.agent.prompt.ChatML`, whose pieces tokenize exactly as the
template would (``tests/test_agent.py`` and ``tests/test_serve_units.py``
check the equality); special-token strings inside a message stay text, so a
tool result cannot open a turn of its own.

A session's next prompt is never re-tokenized from the whole conversation: it
is the previous prompt + the model's own output ids (+ ``<|im_end|>`` if the
output was cut) + the new turns + the assistant header. The model's output ids
are often not the canonical tokenization of its text, so re-tokenizing would
change the history, miss the prefix cache and the history's lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ladsd.agent.prompt import ChatML
from ladsd.serve.chat import Piece


class Renderer:
    """Token ids of canonical turns for one tokenizer (a ChatML model)."""

    def __init__(self, tokenizer: Any) -> None:
        self.ml = ChatML(tokenizer)

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
