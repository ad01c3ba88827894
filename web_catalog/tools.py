"""The agent's catalog tools: ``open``, ``read_reviews``, ``search``.

:func:`call_tool` never raises for a bad call: unknown tools, bad arguments and
unknown ids come back as an error observation (``ok=False``) the agent can read
and recover from, so one bad action does not end a workflow.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ladsd.clock import Clock, now
from web_catalog import pages
from web_catalog.db import Catalog, Product

MAX_QUERY_CHARS = 200


class ToolError(ValueError):
    """A bad tool call; its message becomes the error observation."""


@dataclass(frozen=True)
class ToolResult:
    tool: str
    args: dict[str, object]
    ok: bool
    text: str  # the observation (a page, or an error message when not ok)
    service_seconds: float  # measured on ladsd.clock


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # JSON schema type: "integer" | "string"
    description: str


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    run: Callable[..., Awaitable[str]] = field(repr=False)


def _product_id(v: object) -> int:
    # Models often quote numbers; accept "12" but not 12.5, True or "twelve".
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ToolError(f"product_id must be an integer, got {v!r}")
    if isinstance(v, str):
        if not v.strip().isdigit():
            raise ToolError(f"product_id must be an integer, got {v!r}")
        v = int(v.strip())
    return v


def _query(v: object) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ToolError(f"query must be a non-empty string, got {v!r}")
    if len(v) > MAX_QUERY_CHARS:
        raise ToolError(f"query is {len(v)} characters; at most {MAX_QUERY_CHARS}")
    return v.strip()


def _get(db: Catalog, product_id: int) -> Product:
    p = db.product(product_id)
    if p is None:
        lo, hi = db.id_range()
        raise ToolError(f"no product with id {product_id} (product ids run from {lo} to {hi})")
    return p


async def open_product(db: Catalog, product_id: int) -> str:
    """The product page of ``product_id``."""
    p = _get(db, product_id)
    return pages.product_page(p, db.variants(p.product_id))


async def read_reviews(db: Catalog, product_id: int) -> str:
    """The review page of ``product_id``."""
    p = _get(db, product_id)
    return pages.review_page(p, db.reviews(p.product_id))


async def search(db: Catalog, query: str) -> str:
    """Products whose name or category contains every word of ``query``."""
    found, total = db.search(query)
    return pages.search_page(query, found, total)


_PID = Param("product_id", "integer", "the product's numeric id")
_COERCE: dict[str, Callable[[object], object]] = {"product_id": _product_id, "query": _query}

TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "open",
            "Open a product page: name, SKU, price, categories, description, sizes and colours.",
            (_PID,),
            open_product,
        ),
        Tool(
            "read_reviews",
            "Read a product's customer reviews: rating out of 5, title, text and reviewer.",
            (_PID,),
            read_reviews,
        ),
        Tool(
            "search",
            "Search products by words in their name or category.",
            (Param("query", "string", "words to look for"),),
            search,
        ),
    )
}


def tool_specs(names: list[str] | None = None) -> list[dict[str, object]]:
    """Name, description and JSON argument schema of each tool, for the system prompt."""
    chosen = [TOOLS[n] for n in names] if names is not None else list(TOOLS.values())
    return [
        {
            "name": t.name,
            "description": t.description,
            "parameters": {
                "type": "object",
                "properties": {
                    p.name: {"type": p.type, "description": p.description} for p in t.params
                },
                "required": [p.name for p in t.params],
                "additionalProperties": False,
            },
        }
        for t in chosen
    ]


def _check_args(tool: Tool, args: object) -> dict[str, object]:
    if not isinstance(args, Mapping):
        raise ToolError(f"arguments must be an object, got {type(args).__name__}")
    want = [p.name for p in tool.params]
    extra = sorted(str(k) for k in args if k not in want)
    missing = [n for n in want if n not in args]
    if extra or missing:
        raise ToolError(
            f"{tool.name} takes {', '.join(want)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(extra)}" if extra else "")
        )
    return {n: _COERCE[n](args[n]) for n in want}


async def call_tool(db: Catalog, name: str, args: object, clock: Clock = now) -> ToolResult:
    """Run one tool call; every failure is an error observation, never an exception."""
    start = clock()
    shown = dict(args) if isinstance(args, Mapping) else {}
    tool = TOOLS.get(name) if isinstance(name, str) else None
    try:
        if tool is None:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(TOOLS)}")
        text, ok = await tool.run(db, **_check_args(tool, args)), True
    except ToolError as e:
        text, ok = f"Error: {e}\n", False
    except Exception as e:  # a broken catalog must not kill the workflow either
        text, ok = f"Error: {name} failed: {type(e).__name__}: {e}\n", False
    return ToolResult(str(name), shown, ok, text, clock() - start)
