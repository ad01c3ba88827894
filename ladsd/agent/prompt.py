"""Prompt rendering: the system prompt, and ChatML token ids built by extension.

A continuation's prompt is never re-templated from the whole conversation:
it is the previous prompt + the previous output (+ the end-of-turn token if
the output lacks it) + the tokens of one rendered tool message + the
assistant header. The model's output ids are often not the canonical
tokenization of its text (the grammar lets it pick odd splits), so
re-tokenizing the conversation would change the history and miss the
engine's prefix cache. Pieces between special tokens are encoded exactly as
the chat template would be tokenized (tests check the equality), with
special-token strings inside text kept as plain text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from web_catalog.tasks import Task
from web_catalog.tools import tool_specs

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOLS = ("open", "read_reviews")
TOOL_ROLE = "tool"

FINISH_SPEC = {
    "name": "finish",
    "description": "Give your final answer to the user's question and stop.",
    "parameters": {"properties": {"answer": {"type": "string"}}},
}


def _signature(spec: dict[str, Any]) -> str:
    props = spec["parameters"]["properties"]  # type: ignore[index]
    args = ", ".join(f"{name}: {p['type']}" for name, p in props.items())
    return f"- {spec['name']}({args}): {spec['description']}"


def system_prompt() -> str:
    """The tools (from the catalog's specs) and the reply format, with one example each."""
    specs = [*tool_specs(list(TOOLS)), FINISH_SPEC]
    lines = [
        "You are a shopping assistant. You answer a question about three products of an "
        "online shop by calling tools, one call per turn.",
        "",
        "Tools:",
        *(_signature(s) for s in specs),
        "",
        "Reply to every turn with one JSON object: a short thought, then an action.",
        'To open a product: {"thought":"I open product 12.","action":"open","product_id":12}',
        'To read its reviews: {"thought":"I read the reviews of product 12.",'
        '"action":"read_reviews","product_id":12}',
        'To finish: {"thought":"I have seen every page.","action":"finish",'
        '"answer":"Product 12, because its reviews are the best."}',
        "The tool's result comes back in the next message.",
    ]
    return "\n".join(lines)


def user_prompt(task: Task) -> str:
    return f"{task.prompt()}\nOpen each product and read its reviews, then finish with your answer."


class ChatML:
    """Token ids of ChatML turns for one tokenizer (SmolLM2 and the shape profiles)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.start = self._special(IM_START)
        self.end = self._special(IM_END)

    def _special(self, token: str) -> int:
        tid = self.tok.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid == self.tok.unk_token_id:
            raise ValueError(f"tokenizer has no {token} token: not a ChatML model")
        return tid

    def text(self, s: str) -> list[int]:
        """Plain text between special tokens (special-token strings stay text)."""
        return list(self.tok.encode(s, add_special_tokens=False, split_special_tokens=True))

    def turn(self, role: str, content: str) -> list[int]:
        """``<|im_start|>role\\ncontent<|im_end|>\\n``."""
        return [self.start, *self.text(f"{role}\n{content}"), self.end, *self.text("\n")]

    def header(self) -> list[int]:
        """The generation prompt: ``<|im_start|>assistant\\n``."""
        return [self.start, *self.text("assistant\n")]

    def cold(self, system: str, user: str) -> list[int]:
        """Model call 0: system + user turn + assistant header."""
        return self.turn("system", system) + self.turn("user", user) + self.header()

    def history(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """Everything before the next observation: prompt + output, closed by end-of-turn."""
        ids = [*prompt, *output]
        if not output or output[-1] != self.end:
            ids.append(self.end)  # truncated at the cap (or stopped otherwise)
        return ids

    def tool_turn(self, observation: bytes, note: str | None = None) -> list[int]:
        """What a continuation appends to the history: the rest of the closed
        assistant turn (newline), the tool message, the harness's optional
        progress note (a user turn), the assistant header."""
        text = observation.decode("utf-8")
        ids = self.text("\n") + [self.start, *self.text(f"{TOOL_ROLE}\n{text}"), self.end]
        ids += self.text("\n")
        if note is not None:
            ids += self.turn("user", note)
        return ids + self.header()

    def renderer(
        self, history: Sequence[int], note: str | None = None
    ) -> Callable[[bytes], list[int]]:
        """``render(observation)``: the continuation prompt after ``history``."""
        base = list(history)
        return lambda observation: base + self.tool_turn(observation, note)
