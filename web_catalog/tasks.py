"""The 16 shopping tasks: "inspect three products and their review pages".

Rule (deterministic): take reviewed products, group them by their first
category, sort groups by name and members by id; then go round the groups,
each round taking the next three unused products of every group that still
has three, until there are 16 tasks. Questions cycle through four templates
that need both the product page (price, description, variants) and the review
page. ``tasks.json`` is this function's output, committed; a test regenerates it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from web_catalog.db import Catalog, Product

NUM_TASKS = 16
PER_TASK = 3
TASKS_PATH = Path(__file__).with_name("tasks.json")
FORMAT_VERSION = 1

QUESTIONS = (
    "Which of these three {noun} do reviewers rate highest on average, and what does it cost?",
    "Considering price and what reviewers say, which of these three {noun} is the best value?",
    "Which of these three {noun} gets the most critical reviews, and does its product "
    "description explain the complaints?",
    "Which of these three {noun} would you recommend for everyday training, based on its "
    "description and its reviews?",
)
NOUNS = {"Fitness Equipment": "pieces of fitness equipment"}


class TaskFileError(ValueError):
    """tasks.json is malformed or does not match the catalog."""


@dataclass(frozen=True)
class TaskProduct:
    product_id: int
    name: str


@dataclass(frozen=True)
class Task:
    task_id: str
    category: str
    products: tuple[TaskProduct, ...]
    question: str

    @property
    def product_ids(self) -> tuple[int, ...]:
        return tuple(p.product_id for p in self.products)

    def prompt(self) -> str:
        """The user turn: the question plus the products to inspect."""
        listed = "\n".join(f"- product {p.product_id}: {p.name}" for p in self.products)
        return f"{self.question}\nProducts:\n{listed}"


def noun(category: str) -> str:
    """``Men/Tops/Tanks`` -> ``men's tanks``; ``Gear/Bags`` -> ``bags``."""
    parts = category.split("/")
    leaf = NOUNS.get(parts[-1], parts[-1].lower())
    if parts[0] in ("Men", "Women"):
        return f"{parts[0].lower()}'s {leaf}"
    return leaf


def make_tasks(db: Catalog) -> list[Task]:
    groups: dict[str, list[Product]] = {}
    for p in db.reviewed_products():
        if p.categories:
            groups.setdefault(p.categories[0], []).append(p)
    order = sorted(groups)
    tasks: list[Task] = []
    taken = dict.fromkeys(order, 0)
    while len(tasks) < NUM_TASKS:
        before = len(tasks)
        for cat in order:
            members, i = groups[cat], taken[cat]
            if len(tasks) == NUM_TASKS or len(members) - i < PER_TASK:
                continue
            picked = members[i : i + PER_TASK]
            taken[cat] = i + PER_TASK
            n = len(tasks)
            tasks.append(
                Task(
                    task_id=f"shop-{n + 1:02d}",
                    category=cat,
                    products=tuple(TaskProduct(p.product_id, p.name) for p in picked),
                    question=QUESTIONS[n % len(QUESTIONS)].format(noun=noun(cat)),
                )
            )
        if len(tasks) == before:
            raise TaskFileError(f"catalog has too few reviewed products for {NUM_TASKS} tasks")
    return tasks


def dump_tasks(tasks: list[Task], digest: str) -> str:
    doc = {
        "version": FORMAT_VERSION,
        "catalog_digest": digest,
        "tasks": [
            {
                "task_id": t.task_id,
                "category": t.category,
                "products": [{"product_id": p.product_id, "name": p.name} for p in t.products],
                "question": t.question,
            }
            for t in tasks
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def regenerate(db: Catalog) -> str:
    """The text ``tasks.json`` should hold for this catalog."""
    return dump_tasks(make_tasks(db), db.meta()["digest"])


def _fail(where: str, what: str) -> TaskFileError:
    return TaskFileError(f"tasks file {where}: {what}")


def parse_tasks(text: str, where: str = "tasks.json") -> list[Task]:
    """Parse and validate: 16 tasks, unique ids, three distinct products each."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(where, f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise _fail(where, f"expected an object with version {FORMAT_VERSION}")
    raw = doc.get("tasks")
    if not isinstance(raw, list) or len(raw) != NUM_TASKS:
        raise _fail(where, f"expected a list of {NUM_TASKS} tasks")
    tasks = []
    for k, t in enumerate(raw):
        try:
            prods = tuple(TaskProduct(int(p["product_id"]), str(p["name"])) for p in t["products"])
            task = Task(str(t["task_id"]), str(t["category"]), prods, str(t["question"]))
        except (KeyError, TypeError, ValueError) as e:
            raise _fail(where, f"task {k}: bad or missing field ({e!r})") from None
        if len(set(task.product_ids)) != PER_TASK or not task.question.strip():
            raise _fail(where, f"task {task.task_id}: needs {PER_TASK} distinct products")
        if any(not p.name for p in prods):
            raise _fail(where, f"task {task.task_id}: a product has no name")
        tasks.append(task)
    if len({t.task_id for t in tasks}) != NUM_TASKS:
        raise _fail(where, "task ids are not unique")
    return tasks


def load_tasks(path: Path | str | None = None) -> list[Task]:
    path = Path(path) if path is not None else TASKS_PATH
    return parse_tasks(path.read_text(encoding="utf-8"), str(path))


def check_tasks(tasks: list[Task], db: Catalog) -> None:
    """Every task product exists under that name and has reviews."""
    for t in tasks:
        for tp in t.products:
            p = db.product(tp.product_id)
            if p is None or p.name != tp.name:
                raise TaskFileError(f"{t.task_id}: product {tp.product_id} is not {tp.name!r}")
            if not db.reviews(tp.product_id):
                raise TaskFileError(f"{t.task_id}: product {tp.product_id} has no reviews")
