"""Small helpers shared by the serve tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

FORCE = {"type": "function", "function": {"name": "get_weather"}}  # tool_choice naming it


def weather_tool(description: str = "The weather in a city.", max_len: int | None = None) -> dict:
    """An OpenAI function tool ``get_weather(city)`` (``max_len`` caps the city's length)."""
    city: dict[str, Any] = {"type": "string"}
    if max_len is not None:
        city["maxLength"] = max_len
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"city": city},
                "required": ["city"],
            },
        },
    }


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def linked_home(root: Path) -> Path:
    """A fresh ``$LADSD_HOME`` under ``root`` that links the prepared models (no kappa cache,
    no logs, no catalog of the user's)."""
    from ladsd.engine import models

    home = root / "ladsd-home"
    home.mkdir()
    (home / "models").symlink_to(models.model_path("tiny").parent)
    return home


def serve_log(home: Path, pid: int) -> str:
    """The engine log of the ``ladsd serve`` process ``pid`` under ``home`` ('' until it exists)."""
    for path in (home / "logs").glob(f"serve-*-{pid}.log"):
        return path.read_text(errors="replace")
    return ""
