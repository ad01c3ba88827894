"""Controlled bursts (spec 5): N workflows x K calls, cohorts, inert archived text.

Histories are resized per seed to the profile's sizes (each workflow's call-0
prompt has one of ``history_tokens``); every tool result is inert archived
text (catalog pages rendered once); a cohort's same-round tool calls complete
together (see :mod:`ladsd.workloads.cohort`). Arrivals and the history
assignment come from the seed, so every policy sees identical inputs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ladsd.config import WorkloadConfig
from ladsd.workloads.spec import CallSpec, WorkflowSpec, Workload

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # plain-text token ids of the SmolLM2 vocabulary


def history_ids(n: int, rng: random.Random) -> tuple[int, ...]:
    """A distinct, deterministic history of ``n`` tokens (no shared prefixes)."""
    return tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n))


def assign_sizes(history_tokens: Sequence[int], n: int, rng: random.Random) -> list[int]:
    """The history size of each of ``n`` workflows: the sizes in turn, shuffled by ``rng``."""
    sizes = [history_tokens[i % len(history_tokens)] for i in range(n)]
    rng.shuffle(sizes)
    return sizes


def build(
    cfg: WorkloadConfig,
    seed: int,
    archive: Sequence[bytes],
    name: str = "controlled",
    cohort: int | None = None,
) -> Workload:
    """The controlled workload for ``seed``; ``archive`` supplies the tool texts."""
    if not archive:
        raise ValueError("the archive of tool texts is empty")
    rng = random.Random(f"controlled/{seed}")
    size = cohort or cfg.cohort
    n = cfg.n_workflows
    sizes = assign_sizes(cfg.history_tokens, n, rng)
    arrivals = sorted(rng.uniform(0.0, cfg.arrival_spread_s) for _ in range(n))
    texts = list(archive)
    rng.shuffle(texts)
    flows = []
    for i in range(n):
        calls = tuple(
            CallSpec(
                observation=texts[(i * cfg.calls_per_workflow + k) % len(texts)],
                tool_seconds=0.0,
                output_tokens=cfg.output_tokens,
            )
            for k in range(1, cfg.calls_per_workflow)
        )
        flows.append(
            WorkflowSpec(
                wid=f"w{i:02d}",
                arrival=arrivals[i],
                prompt_ids=history_ids(sizes[i], rng),
                first_output_tokens=cfg.output_tokens,
                calls=calls,
                cohort=i // size,
            )
        )
    return Workload(name, seed, tuple(flows), cfg.cohort_gap_s, cfg.cohort_limit_s)


def archive_from_catalog(limit: int = 96) -> list[bytes]:
    """Inert archived tool text: product and review pages of the local catalog."""
    from web_catalog.db import open_catalog
    from web_catalog.pages import product_page, review_page

    out: list[bytes] = []
    with open_catalog() as db:
        for p in db.reviewed_products():
            out.append(product_page(p, db.variants(p.product_id)).encode())
            out.append(review_page(p, db.reviews(p.product_id)).encode())
            if len(out) >= limit:
                break
    return out
