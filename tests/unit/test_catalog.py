"""The web catalog: build, read-only access, pages, tools, tasks, source resolution."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.catalog import catalog_app
from ladsd.clock import ManualClock
from web_catalog import source
from web_catalog.build import BuildResult, build, plain_text
from web_catalog.db import Catalog, CatalogMissing, Product, Review, Variant, open_catalog
from web_catalog.pages import product_page, review_page
from web_catalog.source import (
    PINNED_DIGEST,
    SOURCE_FILES,
    CatalogSourceError,
    download,
    find_source,
)
from web_catalog.tasks import (
    NUM_TASKS,
    TASKS_PATH,
    TaskFileError,
    check_tasks,
    load_tasks,
    parse_tasks,
    regenerate,
)
from web_catalog.tools import TOOLS, call_tool, tool_specs

DATA = source.DEFAULT_SOURCE

# Counted once from the fixtures: 147 configurable + 44 gear + 1 bundle +
# 1 grouped + 6 downloadable products; 1847 configurable children; 348 of the
# 500 reviews name one of these products, spread over 125 products.
N_PRODUCTS, N_VARIANTS, N_REVIEWS, N_SKIPPED, N_REVIEWED = 199, 1847, 348, 152, 125


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ladsd_home")


@pytest.fixture(autouse=True)
def _isolate(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADSD_HOME", str(home))
    monkeypatch.delenv(source.ENV_SOURCE, raising=False)


@pytest.fixture(scope="session")
def built(home: Path) -> BuildResult:
    if not DATA.is_dir():
        pytest.skip(f"shared fixtures not found at {DATA}")
    return build(DATA, home / "catalog.sqlite")


@pytest.fixture
def db(built: BuildResult):
    with open_catalog(built.path) as cat:
        yield cat


def _by_sku(db: Catalog, sku: str) -> Product:
    (p,) = [p for p in db.products() if p.sku == sku]
    return p


# -- build ------------------------------------------------------------------


def test_counts(built: BuildResult, db: Catalog) -> None:
    assert (built.products, built.variants, built.reviews, built.skipped_reviews) == (
        N_PRODUCTS,
        N_VARIANTS,
        N_REVIEWS,
        N_SKIPPED,
    )
    assert db.counts() == {"products": N_PRODUCTS, "variants": N_VARIANTS, "reviews": N_REVIEWS}
    assert len(db.reviewed_products()) == N_REVIEWED
    kinds = [p.type for p in db.products()]
    assert kinds.count("configurable") == 147 and kinds.count("downloadable") == 6
    assert built.pinned and db.meta()["digest"] == PINNED_DIGEST
    assert db.meta()["source_commit"] == source.PINNED_COMMIT


def test_ids_follow_sku_order(db: Catalog) -> None:
    prods = db.products()
    assert [p.product_id for p in prods] == list(range(1, N_PRODUCTS + 1))
    assert [p.sku for p in prods] == sorted(p.sku for p in prods)
    assert db.id_range() == (1, N_PRODUCTS)


def test_fields_are_plain_text(db: Catalog) -> None:
    tank = _by_sku(db, "MT01")
    assert tank.name == "Erikssen CoolTech\u2122 Fitness Tank"  # &trade; unescaped
    assert tank.price == 29.0 and tank.categories == ("Men/Tops/Tanks",)
    for p in db.products():
        assert "<" not in p.description and "&bull;" not in p.description, p.sku
        assert p.description, p.sku
    # gear categories walk the category tree as Magento's sample installer does
    assert _by_sku(db, "24-UG05").categories == ("Gear/Fitness Equipment", "Promotions")
    assert _by_sku(db, "24-MB04").categories == ("Gear/Bags", "Collections/Erin Recommends")
    assert _by_sku(db, "240-LV04").short_description  # downloadables have one
    assert _by_sku(db, "24-WG080").price is None  # bundle: priced by its parts


def test_variants(db: Catalog) -> None:
    vs = db.variants(_by_sku(db, "MH01").product_id)
    assert len(vs) == 15
    assert vs[0] == Variant("MH01-XS-Black", "XS", "Black", 52.0)
    assert db.variants(_by_sku(db, "24-MB01").product_id) == []


def test_reviews_attach_to_products(db: Catalog) -> None:
    rs = db.reviews(_by_sku(db, "24-MB01").product_id)
    assert [(r.rating, r.title, r.reviewer) for r in rs] == [
        (2, "I prefer more compartments", "Chi"),
        (3, "I use it a lot", "Filiberto"),
    ]


def test_plain_text() -> None:
    html = "<p>A &amp; B</p>\n<ul><li>x</li><li> y  z </li></ul>&bull; w<br />v"
    assert plain_text(html) == "A & B\n- x\n- y z\n- w\nv"
    assert plain_text("") == ""


def test_rebuild_is_noop_and_deterministic(built: BuildResult, tmp_path: Path) -> None:
    before = built.path.read_bytes()
    again = build(DATA, built.path)
    assert not again.built and again.digest == built.digest
    assert built.path.read_bytes() == before
    fresh = build(DATA, tmp_path / "other.sqlite", force=True)
    assert fresh.built and fresh.path.read_bytes() == before


def test_stale_catalog_is_rebuilt(built: BuildResult, tmp_path: Path) -> None:
    out = tmp_path / "c.sqlite"
    shutil.copy(built.path, out)
    con = sqlite3.connect(out)
    con.execute("UPDATE meta SET value = 'stale' WHERE key = 'digest'")
    con.commit()
    con.close()
    r = build(DATA, out)
    assert r.built and r.path.read_bytes() == built.path.read_bytes()


def test_default_path_honours_ladsd_home(built: BuildResult, home: Path) -> None:
    assert built.path == home / "catalog.sqlite"
    assert build(DATA).path == home / "catalog.sqlite"


# -- read-only access -------------------------------------------------------


def test_writes_fail(db: Catalog, built: BuildResult) -> None:
    before = built.path.read_bytes()
    for sql in (
        "DELETE FROM reviews",
        "UPDATE products SET price = 0",
        "INSERT INTO meta VALUES ('x', 'y')",
        "CREATE TABLE t (x)",
    ):
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.con.execute(sql)
    assert built.path.read_bytes() == before


def test_missing_catalog(tmp_path: Path) -> None:
    with pytest.raises(CatalogMissing, match="ladsd catalog build"):
        open_catalog(tmp_path / "none.sqlite")


def test_search(db: Catalog) -> None:
    found, total = db.search("TANK erikssen")
    assert [p.sku for p in found] == ["MT01"] and total == 1
    found, total = db.search("watches", limit=3)
    assert len(found) == 3 and total == 9
    assert db.search("   ") == ([], 0)
    assert db.search("100%_") == ([], 0)  # no LIKE wildcards


# -- pages ------------------------------------------------------------------

SHIRT = Product(7, "T1", "configurable", "Test Tee", 12.5, ("Men/Tops/Tees", "Sale"), "Soft.", "")
VARIANTS = [Variant("T1-S-Red", "S", "Red", 12.5), Variant("T1-M-Red", "M", "Red", 12.5)]


def test_product_page_exact() -> None:
    assert product_page(SHIRT, VARIANTS) == (
        "Product 7: Test Tee\n"
        "SKU: T1\n"
        "Price: $12.50\n"
        "Categories: Men/Tops/Tees; Sale\n"
        "Variants: 2 variants; sizes: S, M; colours: Red\n"
        "\n"
        "Description:\n"
        "Soft.\n"
    )


def test_review_page_exact() -> None:
    rs = [Review(1, 7, 4, "Nice", "Fits well.", "Ann"), Review(2, 7, 1, "Bad", "Tore.", "Bo")]
    assert review_page(SHIRT, rs) == (
        "Reviews of product 7: Test Tee\n"
        "2 reviews, average rating 2.5/5\n"
        "\n1. 4/5 - Nice\nFits well.\nby Ann\n"
        "\n2. 1/5 - Bad\nTore.\nby Bo\n"
    )
    assert "No reviews yet" in review_page(SHIRT, [])


def test_real_pages(db: Catalog) -> None:
    p = _by_sku(db, "MT01")
    page = product_page(p, db.variants(p.product_id))
    assert "Variants: 15 variants; sizes: XS, S, M, L, XL; colours: Gray, Orange, Red" in page
    assert page == product_page(db.product(p.product_id), db.variants(p.product_id))


# -- tools ------------------------------------------------------------------


async def test_tools_return_pages(db: Catalog) -> None:
    pid = _by_sku(db, "MT01").product_id
    r = await call_tool(db, "open", {"product_id": pid})
    assert r.ok and r.tool == "open" and r.args == {"product_id": pid}
    assert r.text == product_page(db.product(pid), db.variants(pid))
    r = await call_tool(db, "read_reviews", {"product_id": str(pid)})  # quoted ids are fine
    assert r.ok and r.text == review_page(db.product(pid), db.reviews(pid))
    r = await call_tool(db, "search", {"query": "erikssen"})
    assert r.ok and f"product {pid}: Erikssen" in r.text


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("open", {"product_id": 9999}, "no product with id 9999"),
        ("read_reviews", {"product_id": 0}, "no product with id 0"),
        ("open", {}, "missing product_id"),
        ("open", {"product_id": 1, "page": 2}, "unexpected page"),
        ("open", {"product_id": "abc"}, "must be an integer"),
        ("open", {"product_id": 1.5}, "must be an integer"),
        ("open", {"product_id": True}, "must be an integer"),
        ("open", {"product_id": None}, "must be an integer"),
        ("open", [1], "arguments must be an object"),
        ("search", {"query": "  "}, "non-empty string"),
        ("search", {"query": "x" * 500}, "at most"),
        ("buy", {"product_id": 1}, "unknown tool 'buy'"),
    ],
)
async def test_bad_calls_are_error_observations(
    db: Catalog, name: str, args: object, needle: str
) -> None:
    r = await call_tool(db, name, args)
    assert not r.ok and r.tool == name
    assert r.text.startswith("Error: ") and needle in r.text


async def test_tool_failure_is_an_observation(built: BuildResult) -> None:
    cat = open_catalog(built.path)
    cat.close()  # any use now raises sqlite3.ProgrammingError
    r = await call_tool(cat, "open", {"product_id": 1})
    assert not r.ok and "ProgrammingError" in r.text


async def test_service_time_uses_the_clock(db: Catalog) -> None:
    clock = ManualClock(10.0)
    ticks = iter([10.0, 10.25])
    r = await call_tool(db, "open", {"product_id": 1}, clock=lambda: next(ticks))
    assert r.service_seconds == 0.25
    r = await call_tool(db, "open", {"product_id": 1}, clock=clock)
    assert r.service_seconds == 0.0


def test_tool_specs() -> None:
    specs = tool_specs()
    assert [s["name"] for s in specs] == list(TOOLS) == ["open", "read_reviews", "search"]
    assert specs[0]["parameters"]["required"] == ["product_id"]
    assert specs[0]["parameters"]["properties"]["product_id"]["type"] == "integer"
    assert [s["name"] for s in tool_specs(["read_reviews"])] == ["read_reviews"]


# -- tasks ------------------------------------------------------------------


def test_tasks_file_is_valid_and_regenerable(db: Catalog) -> None:
    tasks = load_tasks()
    assert len(tasks) == NUM_TASKS
    check_tasks(tasks, db)  # products exist under those names and have reviews
    assert TASKS_PATH.read_text(encoding="utf-8") == regenerate(db)
    assert all(len(set(t.product_ids)) == 3 for t in tasks)
    assert "product 1: Joust Duffle Bag" in tasks[0].prompt()


def test_bad_tasks_files_are_rejected() -> None:
    import json

    doc = json.loads(TASKS_PATH.read_text(encoding="utf-8"))
    with pytest.raises(TaskFileError, match="not JSON"):
        parse_tasks("{")
    short = dict(doc, tasks=doc["tasks"][:-1])
    with pytest.raises(TaskFileError, match="16 tasks"):
        parse_tasks(json.dumps(short))
    dup = json.loads(json.dumps(doc))
    dup["tasks"][0]["products"][1] = dup["tasks"][0]["products"][0]
    with pytest.raises(TaskFileError, match="distinct"):
        parse_tasks(json.dumps(dup))
    gone = json.loads(json.dumps(doc))
    del gone["tasks"][3]["question"]
    with pytest.raises(TaskFileError, match="task 3"):
        parse_tasks(json.dumps(gone))


def test_check_tasks_catches_wrong_names(db: Catalog) -> None:
    tasks = load_tasks()
    t = tasks[0]
    wrong = type(t)(t.task_id, t.category, (type(t.products[0])(1, "Nope"),) + t.products[1:], "q")
    with pytest.raises(TaskFileError, match="is not 'Nope'"):
        check_tasks([wrong], db)


# -- source resolution and download -----------------------------------------


def _fake_source(root: Path) -> Path:
    for rel in SOURCE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    return root


def test_source_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = _fake_source(tmp_path / "explicit")
    env = _fake_source(tmp_path / "env")
    sibling = _fake_source(tmp_path / "sibling")
    monkeypatch.setattr(source, "DEFAULT_SOURCE", sibling)
    assert find_source() == sibling
    monkeypatch.setenv(source.ENV_SOURCE, str(env))
    assert find_source() == env
    assert find_source(explicit) == explicit
    monkeypatch.delenv(source.ENV_SOURCE)
    monkeypatch.setattr(source, "DEFAULT_SOURCE", tmp_path / "absent")
    assert find_source() is None  # -> download
    nested = _fake_source(tmp_path / "repo" / "app" / "code" / "Magento")
    assert find_source(tmp_path / "repo") == nested


def test_bad_explicit_sources_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CatalogSourceError, match="not a directory"):
        find_source(tmp_path / "absent")
    partial = _fake_source(tmp_path / "partial")
    (partial / "ReviewSampleData/fixtures/products_reviews.csv").unlink()
    with pytest.raises(CatalogSourceError, match="lacks 1 fixture"):
        find_source(partial)
    monkeypatch.setenv(source.ENV_SOURCE, str(tmp_path / "absent"))
    with pytest.raises(CatalogSourceError, match=source.ENV_SOURCE):
        find_source()


def test_default_source_is_beside_the_checkout() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert source.DEFAULT_SOURCE == repo.parent / "shared" / "data" / "magento2-sample-data"


def _mirror(tmp_path: Path) -> str:
    """A file:// copy of the pinned fixtures laid out like raw.githubusercontent."""
    if not DATA.is_dir():
        pytest.skip(f"shared fixtures not found at {DATA}")
    for rel in SOURCE_FILES:
        (tmp_path / "mirror" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DATA / rel, tmp_path / "mirror" / rel)
    return (tmp_path / "mirror").as_uri() + "/"


def test_download_checks_hashes(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    dest = tmp_path / "dl"
    assert download(dest, base_url=base) == dest
    assert source.source_digest(dest) == PINNED_DIGEST
    assert source.source_commit(dest) == source.PINNED_COMMIT
    # reused without fetching once verified
    assert download(dest, base_url=base, fetch=lambda url: b"") == dest


def test_download_rejects_a_changed_file(tmp_path: Path) -> None:
    base = _mirror(tmp_path)
    rel = "ReviewSampleData/fixtures/products_reviews.csv"
    with open(tmp_path / "mirror" / rel, "ab") as f:
        f.write(b"24-MB01,Rating,5,fake,fake,Mallory,\n")
    dest = tmp_path / "dl"
    with pytest.raises(CatalogSourceError, match=f"{rel}: SHA-256 mismatch"):
        download(dest, base_url=base)
    assert not dest.exists() and not (tmp_path / "dl.partial").exists()


def test_unreachable_download_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source, "DEFAULT_SOURCE", tmp_path / "absent")

    def offline(url: str) -> bytes:
        raise OSError("network unreachable")

    with pytest.raises(CatalogSourceError, match="could not download .*--source"):
        build(out=tmp_path / "c.sqlite", fetch=offline)
    assert not (tmp_path / "c.sqlite").exists()


def test_pinned_catalog_needs_no_download(
    built: BuildResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source, "DEFAULT_SOURCE", tmp_path / "absent")

    def offline(url: str) -> bytes:
        raise AssertionError("must not download")

    r = build(out=built.path, fetch=offline)
    assert not r.built and r.pinned and r.source is None


def test_digest_is_a_manifest_digest() -> None:
    rev = dict(reversed(list(SOURCE_FILES.items())))
    assert source.digest_of(rev) == PINNED_DIGEST
    assert source.digest_of({**SOURCE_FILES, "x.csv": "0" * 64}) != PINNED_DIGEST


# -- cli --------------------------------------------------------------------


def test_cli(built: BuildResult) -> None:
    run = CliRunner().invoke
    r = run(catalog_app, ["build", "--source", str(DATA), "--out", str(built.path)])
    assert r.exit_code == 0 and "up to date" in r.output and str(N_PRODUCTS) in r.output
    pid = 113
    r = run(catalog_app, ["show", str(pid)])
    assert r.exit_code == 0 and r.output.startswith(f"Product {pid}: ")
    r = run(catalog_app, ["reviews", "1"])
    assert r.exit_code == 0 and "average rating 2.5/5" in r.output
    r = run(catalog_app, ["show", "9999"])
    assert r.exit_code == 1 and "no product with id 9999" in r.output
    r = run(catalog_app, ["tasks"])
    assert r.exit_code == 0 and "shop-16" in r.output
