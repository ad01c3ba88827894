"""Magento 2 sample fixtures -> one SQLite catalog (deterministic, idempotent).

Products are the 147 configurable products plus the gear, bundle, grouped and
downloadable products; a configurable product's simple children become its
size/colour variants. Product ids are 1..N in SKU order. Reviews whose SKU is
not a product are skipped (the review fixture covers products not shipped).
"""

from __future__ import annotations

import csv
import html
import os
import re
import sqlite3
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ladsd.config import ladsd_home
from web_catalog import source as src

SCHEMA_VERSION = "1"  # bump when the schema or parsing changes: forces a rebuild
CATALOG_NAME = "catalog.sqlite"

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE products (
    product_id INTEGER PRIMARY KEY, sku TEXT NOT NULL UNIQUE, type TEXT NOT NULL,
    name TEXT NOT NULL, price REAL, categories TEXT NOT NULL,
    description TEXT NOT NULL, short_description TEXT NOT NULL);
CREATE TABLE variants (
    variant_id INTEGER PRIMARY KEY, product_id INTEGER NOT NULL REFERENCES products,
    sku TEXT NOT NULL UNIQUE, size TEXT, color TEXT, price REAL);
CREATE TABLE reviews (
    review_id INTEGER PRIMARY KEY, product_id INTEGER NOT NULL REFERENCES products,
    rating INTEGER NOT NULL CHECK (rating BETWEEN 1 AND 5), title TEXT NOT NULL,
    text TEXT NOT NULL, reviewer TEXT NOT NULL);
CREATE INDEX variants_product ON variants (product_id);
CREATE INDEX reviews_product ON reviews (product_id);
"""

# Simple-product fixture files: (path, Magento product type).
SIMPLE_FILES = (
    ("CatalogSampleData/fixtures/SimpleProduct/products_gear_bags.csv", "simple"),
    ("CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment.csv", "simple"),
    (
        "CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment_ball.csv",
        "simple",
    ),
    (
        "CatalogSampleData/fixtures/SimpleProduct/products_gear_fitness_equipment_strap.csv",
        "simple",
    ),
    ("CatalogSampleData/fixtures/SimpleProduct/products_gear_watches.csv", "simple"),
    ("BundleSampleData/fixtures/yoga_bundle.csv", "bundle"),
    ("GroupedProductSampleData/fixtures/yoga_grouped.csv", "grouped"),
    ("DownloadableSampleData/fixtures/products_training_video_download.csv", "downloadable"),
)
CONFIGURABLE_FILE = "ConfigurableSampleData/fixtures/products.csv"
REVIEW_FILE = "ReviewSampleData/fixtures/products_reviews.csv"
CATEGORY_FILES = (
    "CatalogSampleData/fixtures/categories.csv",
    "ConfigurableSampleData/fixtures/categories.csv",
    "DownloadableSampleData/fixtures/categories.csv",
)


@dataclass(frozen=True)
class BuildResult:
    path: Path
    digest: str
    built: bool  # False: an up-to-date catalog was already there
    products: int
    variants: int
    reviews: int
    skipped_reviews: int  # reviews of SKUs that are not products
    source: Path | None  # None when nothing had to be read
    pinned: bool  # the digest is that of the pinned fixtures


def catalog_path() -> Path:
    return ladsd_home() / CATALOG_NAME


class _Text(HTMLParser):
    BLOCK = {"p", "br", "div", "ul", "ol", "li", "h1", "h2", "h3", "h4", "tr", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCK:
            self.parts.append("\n- " if tag == "li" else "\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def plain_text(html: str) -> str:
    """HTML fragment -> plain text: one line per block, bullets as ``- ``."""
    p = _Text()
    p.feed(html)
    p.close()
    text = "".join(p.parts).replace("\u2022", "- ").replace("\xa0", " ")
    lines = (re.sub(r"\s+", " ", ln).strip() for ln in text.split("\n"))
    return "\n".join(re.sub(r"^(- )+", "- ", ln) for ln in lines if ln and ln != "-")


def _rows(root: Path, rel: str) -> list[dict[str, str]]:
    with open(root / rel, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def _name(v: str) -> str:
    """Names carry entities (``CoolTech&trade;``) and stray double spaces."""
    return re.sub(r"\s+", " ", html.unescape(v)).strip()


def _price(v: str) -> float | None:
    v = v.strip()
    return float(v) if v else None


def _category_tree(root: Path) -> dict[str, list[str]]:
    """Category path -> child names ("" is the root), merged over the modules."""
    tree: dict[str, list[str]] = {"": []}
    for rel in CATEGORY_FILES:
        for r in _rows(root, rel):
            parent, name = r["path"].strip(), r["name"].strip()
            path = f"{parent}/{name}" if parent else name
            tree.setdefault(parent, [])
            if name not in tree[parent]:
                tree[parent].append(name)
            tree.setdefault(path, [])
    return tree


def _walk_categories(names: str, tree: dict[str, list[str]]) -> list[str]:
    """Newline-separated names -> assigned category paths, as Magento's sample
    Converter::getCategoryIds walks them: descend while a name is a child of the
    current node, restart at the root after a leaf, ignore unknown names."""
    at, paths = "", []
    for name in filter(None, (n.strip() for n in names.split("\n"))):
        if name in tree[at]:
            at = f"{at}/{name}" if at else name
            paths.append(at)
            if not tree[at]:
                at = ""
    return _most_specific(paths)


def _most_specific(paths: list[str]) -> list[str]:
    """Drop paths that are ancestors of another path; keep first-seen order."""
    out: list[str] = []
    for p in paths:
        if p not in out and not any(q.startswith(p + "/") for q in paths):
            out.append(p)
    return out


def _configurable_categories(field: str) -> list[str]:
    prefix = "Default Category/"
    return _most_specific([c[len(prefix) :] for c in field.split(",") if c.startswith(prefix)])


def parse(root: Path) -> tuple[list[dict], list[dict], list[dict], int]:
    """Fixture root -> (products, variants, reviews, skipped review count), ids assigned."""
    tree = _category_tree(root)
    products: dict[str, dict] = {}
    for rel, kind in SIMPLE_FILES:
        for r in _rows(root, rel):
            products[r["sku"].strip()] = dict(
                type=kind,
                name=_name(r["name"]),
                price=_price(r.get("price", "")),
                categories=_walk_categories(r["category"], tree),
                description=plain_text(r.get("description", "")),
                short_description=plain_text(r.get("short_description", "")),
            )
    conf_rows = _rows(root, CONFIGURABLE_FILE)
    by_sku = {r["sku"]: r for r in conf_rows}
    children: dict[str, list[dict]] = {}
    for r in conf_rows:
        if r["product_type"] != "configurable":
            continue
        sku = r["sku"].strip()
        products[sku] = dict(
            type="configurable",
            name=_name(r["name"]),
            price=_price(r["price"]),
            categories=_configurable_categories(r["categories"]),
            description=plain_text(r["description"]),
            short_description=plain_text(r["short_description"]),
        )
        kids = []
        for var in filter(None, r["configurable_variations"].split("|")):
            f = dict(kv.split("=", 1) for kv in var.split(","))
            child = by_sku.get(f["sku"])
            kids.append(
                dict(
                    sku=f["sku"],
                    size=f.get("size"),
                    color=f.get("color"),
                    price=_price(child["price"]) if child else products[sku]["price"],
                )
            )
        children[sku] = kids
    ids = {sku: i for i, sku in enumerate(sorted(products), start=1)}
    prods = [dict(product_id=ids[s], sku=s, **products[s]) for s in sorted(products)]
    variants = [dict(product_id=ids[s], **v) for s in sorted(children) for v in children[s]]
    reviews, skipped = [], 0
    for r in _rows(root, REVIEW_FILE):
        pid = ids.get(r["sku"].strip())
        if pid is None:
            skipped += 1
            continue
        reviews.append(
            dict(
                product_id=pid,
                rating=int(r["rating_value"]),
                title=r["title"].strip(),
                text=r["review"].strip(),
                reviewer=r["reviewer"].strip(),
            )
        )
    return prods, variants, reviews, skipped


def _write(path: Path, root: Path, digest: str) -> BuildResult:
    prods, variants, reviews, skipped = parse(root)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        con.executemany(
            "INSERT INTO products VALUES (:product_id, :sku, :type, :name, :price,"
            " :categories, :description, :short_description)",
            [dict(p, categories="\n".join(p["categories"])) for p in prods],
        )
        con.executemany(
            "INSERT INTO variants (product_id, sku, size, color, price)"
            " VALUES (:product_id, :sku, :size, :color, :price)",
            variants,
        )
        con.executemany(
            "INSERT INTO reviews (product_id, rating, title, text, reviewer)"
            " VALUES (:product_id, :rating, :title, :text, :reviewer)",
            reviews,
        )
        meta = dict(
            digest=digest,
            schema_version=SCHEMA_VERSION,
            source_commit=src.source_commit(root),
            products=str(len(prods)),
            variants=str(len(variants)),
            reviews=str(len(reviews)),
            skipped_reviews=str(skipped),
        )
        con.executemany("INSERT INTO meta VALUES (?, ?)", sorted(meta.items()))
        con.commit()
        con.execute("VACUUM")
    finally:
        con.close()
    os.replace(tmp, path)
    return BuildResult(
        path,
        digest,
        True,
        len(prods),
        len(variants),
        len(reviews),
        skipped,
        root,
        digest == src.PINNED_DIGEST,
    )


def read_meta(path: Path) -> dict[str, str] | None:
    """The meta table of an existing catalog, or None if absent or unreadable."""
    if not path.is_file():
        return None
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return dict(con.execute("SELECT key, value FROM meta").fetchall())
        finally:
            con.close()
    except sqlite3.Error:
        return None


def _existing(
    path: Path, meta: dict[str, str], digest: str, root: Path | None
) -> BuildResult | None:
    if meta.get("digest") != digest or meta.get("schema_version") != SCHEMA_VERSION:
        return None
    return BuildResult(
        path,
        digest,
        False,
        int(meta["products"]),
        int(meta["variants"]),
        int(meta["reviews"]),
        int(meta["skipped_reviews"]),
        root,
        digest == src.PINNED_DIGEST,
    )


def build(
    source: Path | str | None = None,
    out: Path | str | None = None,
    force: bool = False,
    fetch: src.Fetch = src.fetch_url,
) -> BuildResult:
    """Build the catalog at ``out`` (default ``ladsd_home()/catalog.sqlite``).

    A catalog whose stored digest and schema match the source is left alone
    (unless ``force``); with no local source and an up-to-date pinned catalog,
    nothing is downloaded.
    """
    path = Path(out) if out is not None else catalog_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = None if force else read_meta(path)
    root = src.find_source(source)
    if root is None:
        if meta and (done := _existing(path, meta, src.PINNED_DIGEST, None)):
            return done
        root = src.download(fetch=fetch)
    digest = src.source_digest(root)
    if meta and (done := _existing(path, meta, digest, root)):
        return done
    return _write(path, root, digest)
