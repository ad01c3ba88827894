"""Plain-text pages the agent reads: a product page, a review page, a search listing.

Pure functions of catalog records, so the same product always renders to the
same bytes (observations must be reproducible across policies and runs).
"""

from __future__ import annotations

from web_catalog.db import Product, Review, Variant


def price_text(price: float | None) -> str:
    return f"${price:.2f}" if price is not None else "priced by its parts"


def _distinct(values: list[str | None]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v and v not in out:
            out.append(v)
    return out


def variants_summary(variants: list[Variant]) -> str:
    """E.g. ``15 variants; sizes: XS, S, M, L, XL; colours: Black, Gray, Orange``."""
    if not variants:
        return "none (one version)"
    parts = [f"{len(variants)} variants"]
    sizes = _distinct([v.size for v in variants])
    colours = _distinct([v.color for v in variants])
    if sizes:
        parts.append("sizes: " + ", ".join(sizes))
    if colours:
        parts.append("colours: " + ", ".join(colours))
    return "; ".join(parts)


def product_page(p: Product, variants: list[Variant]) -> str:
    lines = [
        f"Product {p.product_id}: {p.name}",
        f"SKU: {p.sku}",
        f"Price: {price_text(p.price)}",
        "Categories: " + ("; ".join(p.categories) if p.categories else "none"),
        f"Variants: {variants_summary(variants)}",
    ]
    if p.short_description:
        lines += ["", "Summary:", p.short_description]
    lines += ["", "Description:", p.description or "(none)"]
    return "\n".join(lines) + "\n"


def review_page(p: Product, reviews: list[Review]) -> str:
    if not reviews:
        return f"Reviews of product {p.product_id}: {p.name}\nNo reviews yet.\n"
    mean = sum(r.rating for r in reviews) / len(reviews)
    lines = [
        f"Reviews of product {p.product_id}: {p.name}",
        f"{len(reviews)} review{'s' if len(reviews) != 1 else ''}, average rating {mean:.1f}/5",
    ]
    for i, r in enumerate(reviews, start=1):
        lines += ["", f"{i}. {r.rating}/5 - {r.title}", r.text, f"by {r.reviewer}"]
    return "\n".join(lines) + "\n"


def search_page(query: str, found: list[Product], total: int) -> str:
    if not found:
        return f"No products match {query!r}.\n"
    lines = [f"Products matching {query!r}: showing {len(found)} of {total}"]
    for p in found:
        cat = p.categories[0] if p.categories else "uncategorised"
        lines.append(f"- product {p.product_id}: {p.name} ({price_text(p.price)}; {cat})")
    return "\n".join(lines) + "\n"
