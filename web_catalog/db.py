"""Read-only access to the built catalog (``file:...?mode=ro``: writes fail)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from web_catalog.build import catalog_path


class CatalogMissing(FileNotFoundError):
    """No catalog at the path: build it first."""


@dataclass(frozen=True)
class Product:
    product_id: int
    sku: str
    type: str  # simple | configurable | bundle | grouped | downloadable
    name: str
    price: float | None  # None: bundle / grouped (priced by their parts)
    categories: tuple[str, ...]
    description: str
    short_description: str


@dataclass(frozen=True)
class Variant:
    sku: str
    size: str | None
    color: str | None
    price: float | None


@dataclass(frozen=True)
class Review:
    review_id: int
    product_id: int
    rating: int  # 1..5
    title: str
    text: str
    reviewer: str


_PRODUCT_COLS = "product_id, sku, type, name, price, categories, description, short_description"


def _product(row: tuple) -> Product:
    pid, sku, kind, name, price, cats, desc, short = row
    return Product(
        pid, sku, kind, name, price, tuple(cats.split("\n")) if cats else (), desc, short
    )


class Catalog:
    """A read-only catalog connection with the lookups the tools need."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else catalog_path()
        if not self.path.is_file():
            raise CatalogMissing(f"no catalog at {self.path}; run `ladsd catalog build` first")
        # check_same_thread=False: read-only, so a worker thread may share it.
        self.con = sqlite3.connect(
            f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
        )

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def meta(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT key, value FROM meta").fetchall())

    def product(self, product_id: int) -> Product | None:
        row = self.con.execute(
            f"SELECT {_PRODUCT_COLS} FROM products WHERE product_id = ?", (product_id,)
        ).fetchone()
        return _product(row) if row else None

    def variants(self, product_id: int) -> list[Variant]:
        rows = self.con.execute(
            "SELECT sku, size, color, price FROM variants WHERE product_id = ? ORDER BY variant_id",
            (product_id,),
        )
        return [Variant(*r) for r in rows]

    def reviews(self, product_id: int) -> list[Review]:
        rows = self.con.execute(
            "SELECT review_id, product_id, rating, title, text, reviewer FROM reviews"
            " WHERE product_id = ? ORDER BY review_id",
            (product_id,),
        )
        return [Review(*r) for r in rows]

    def products(self) -> list[Product]:
        rows = self.con.execute(f"SELECT {_PRODUCT_COLS} FROM products ORDER BY product_id")
        return [_product(r) for r in rows]

    def reviewed_products(self) -> list[Product]:
        """Products with at least one review, by id."""
        rows = self.con.execute(
            f"SELECT {_PRODUCT_COLS} FROM products WHERE product_id IN"
            " (SELECT product_id FROM reviews) ORDER BY product_id"
        )
        return [_product(r) for r in rows]

    def id_range(self) -> tuple[int, int]:
        lo, hi = self.con.execute(
            "SELECT min(product_id), max(product_id) FROM products"
        ).fetchone()
        return lo, hi

    def search(self, query: str, limit: int = 10) -> tuple[list[Product], int]:
        """Products whose name or categories contain every word of ``query``
        (case-insensitive), by id: (first ``limit`` matches, total matches)."""
        words = query.lower().split()
        if not words:
            return [], 0
        cond = " AND ".join(["instr(lower(name || ' ' || categories), ?) > 0"] * len(words))
        total = self.con.execute(f"SELECT count(*) FROM products WHERE {cond}", words).fetchone()
        rows = self.con.execute(
            f"SELECT {_PRODUCT_COLS} FROM products WHERE {cond} ORDER BY product_id LIMIT ?",
            (*words, limit),
        )
        return [_product(r) for r in rows], total[0]

    def counts(self) -> dict[str, int]:
        return {
            t: self.con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("products", "variants", "reviews")
        }


def open_catalog(path: Path | str | None = None) -> Catalog:
    """Open the catalog read-only (default ``ladsd_home()/catalog.sqlite``)."""
    return Catalog(path)
