"""``ladsd catalog``: build the local shopping catalog, look at pages and tasks."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from web_catalog.build import build
from web_catalog.db import CatalogMissing, open_catalog
from web_catalog.pages import product_page, review_page
from web_catalog.source import CatalogSourceError
from web_catalog.tasks import TaskFileError, load_tasks

catalog_app = typer.Typer(
    help="The local Magento sample catalog the web agents browse.", rich_markup_mode=None
)
console = Console()


def _fail(msg: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {msg}")
    return typer.Exit(1)


def _db(path: Path | None):
    try:
        return open_catalog(path)
    except CatalogMissing as e:
        raise _fail(str(e)) from None


@catalog_app.command("build")
def build_cmd(
    source: Path | None = typer.Option(None, help="Fixture folder (magento2-sample-data)."),
    out: Path | None = typer.Option(None, help="SQLite file [default: $LADSD_HOME/catalog.sqlite]"),
    force: bool = typer.Option(False, help="Rebuild even if the catalog is up to date."),
) -> None:
    """Build the catalog SQLite file (a no-op when it is already up to date)."""
    try:
        r = build(source, out, force)
    except CatalogSourceError as e:
        raise _fail(str(e)) from None
    state = "built" if r.built else "up to date"
    console.print(f"[green]{state}[/green] {r.path}")
    t = Table(show_header=False, box=None)
    for k, v in [
        ("products", r.products),
        ("variants", r.variants),
        ("reviews", f"{r.reviews} ({r.skipped_reviews} skipped: product not in fixtures)"),
        ("source", r.source or "(not read)"),
        (
            "digest",
            r.digest + ("  [pinned fixtures]" if r.pinned else "  [NOT the pinned fixtures]"),
        ),
    ]:
        t.add_row(k, str(v))
    console.print(t)


def _product(cat, product_id: int):  # noqa: ANN001, ANN202
    p = cat.product(product_id)
    if p is None:
        raise _fail(f"no product with id {product_id}")
    return p


@catalog_app.command("show")
def show_cmd(
    product_id: int,
    db: Path | None = typer.Option(None, help="Catalog file [default: catalog path]"),
) -> None:
    """Print a product page as the agent sees it."""
    with _db(db) as cat:
        p = _product(cat, product_id)
        typer.echo(product_page(p, cat.variants(product_id)), nl=False)


@catalog_app.command("reviews")
def reviews_cmd(
    product_id: int,
    db: Path | None = typer.Option(None, help="Catalog file [default: catalog path]"),
) -> None:
    """Print a product's review page as the agent sees it."""
    with _db(db) as cat:
        p = _product(cat, product_id)
        typer.echo(review_page(p, cat.reviews(product_id)), nl=False)


@catalog_app.command("tasks")
def tasks_cmd() -> None:
    """List the 16 shopping tasks."""
    try:
        tasks = load_tasks()
    except (OSError, TaskFileError) as e:
        raise _fail(str(e)) from None
    t = Table(title="shopping tasks")
    for col in ("task", "category", "products", "question"):
        t.add_column(col)
    for task in tasks:
        prods = "\n".join(f"{p.product_id}: {p.name}" for p in task.products)
        t.add_row(task.task_id, task.category, prods, task.question)
    console.print(t)
