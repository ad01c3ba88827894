"""Prometheus ``GET /metrics`` (``prometheus_client``, the daemon's own registry).

Everything is read at scrape time from what the daemon already has: the
engine's last published :class:`~ladsd.records.EngineState` (load, pool, lease
counters), the sender and the policy (delivery), the session table and the
daemon's request counters. vLLM's names where the meaning is the same:

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``  (``a``, ``w``)
* ``vllm:kv_cache_usage_perc``  1 - F / total, a fraction as vLLM reports it
  (F counts evictable cached blocks as free, as vLLM's usage does)
* ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``  prompt tokens
  queried / found cached, over the daemon's chat completions
* ``vllm:num_preemptions``  the engine's real preemptions

Every sample carries ``model_name``, and ``replica`` when ``serve --replica NAME``
(``ladsd cluster`` names its replicas) so a scrape of many replicas tells them apart.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ladsd.serve.context import CONTEXT, ServeContext

# ladsd_lease_<name>_total: (engine counter, help)
LEASE_COUNTERS = {
    "grants": ("grants", "Leases granted."),
    "denials": ("denials", "Budget denials (U + Delta_i > B)."),
    "headroom_refusals": ("headroom_refusals", "Grants refused to keep H blocks free."),
    "handoffs": ("handoffs", "Leases handed off to the resumed request at allocation."),
    "expiries": ("expiries", "Leases that reached their deadline g_i + l."),
    "revocations": ("revocations", "Leases revoked to keep H blocks free."),
    "cancellations": ("cancellations", "Leases and candidates cancelled (session ended)."),
}


class Collector:
    """Builds every family at scrape time (no state of its own); ``replica``: the label
    value every sample carries (none without it)."""

    def __init__(self, ctx: ServeContext, replica: str | None = None) -> None:
        self.ctx = ctx
        self.replica = replica

    def describe(self) -> list[Metric]:
        return []  # families are built per scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        d = self.ctx
        s = d.state
        label = ["model_name"]
        model = [d.model]
        if self.replica is not None:  # a cluster's replicas: one scrape target each, told apart
            label, model = [*label, "replica"], [*model, self.replica]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric(model, value)
            return c

        counters = s.counters if s is not None else {}
        total = s.total_blocks if s is not None else 0
        yield gauge("vllm:num_requests_running", "Requests running in the engine.", s.a if s else 0)
        yield gauge("vllm:num_requests_waiting", "Requests waiting in the engine.", s.w if s else 0)
        usage = 1.0 - s.F / total if s is not None and total else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens queried in the prefix cache.",
            d.stats["prompt_tokens"],
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            d.stats["cached_tokens"],
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted by the engine.",
            counters.get("preemptions", 0),
        )
        for name, (key, doc) in LEASE_COUNTERS.items():
            yield counter(f"ladsd_lease_{name}", doc, counters.get(key, 0))
        yield gauge("ladsd_lease_active", "Active leases.", len(s.leases) if s else 0)
        yield gauge("ladsd_lease_protected_blocks", "Blocks under a lease (U).", s.U if s else 0)
        yield gauge("ladsd_lease_budget_blocks", "Lease budget target (B).", s.B if s else 0)
        yield gauge(
            "ladsd_kv_free_blocks", "Free KV blocks, evictable included (F).", s.F if s else 0
        )
        yield from self._delivery(gauge, counter)
        yield gauge("ladsd_sessions_active", "Sessions in the table.", len(d.sessions))
        yield counter("ladsd_sessions_ended", "Sessions ended (any way).", d.sessions.ended)
        yield gauge("ladsd_requests_in_flight", "Chat requests admitted and not done.", d.in_flight)
        yield counter("ladsd_requests", "Chat requests admitted.", d.stats["requests"])
        yield counter(
            "ladsd_requests_rejected",
            "Chat requests refused by the admission limit (429).",
            d.stats["rejected"],
        )
        yield counter(
            "ladsd_requests_disconnected",
            "Chat requests whose client went away.",
            d.stats["disconnected"],
        )
        yield gauge("ladsd_engine_alive", "1 while the engine thread runs.", float(d.alive))

    def _delivery(self, gauge, counter) -> Iterator[Metric]:  # type: ignore[no-untyped-def]
        rt = self.ctx.rt
        link = rt.sender.stats() if rt is not None else {}
        pol = rt.policy.stats() if rt is not None else {}
        yield gauge(
            "ladsd_delivery_queued_results",
            "Ready results not yet committed (F(t)).",
            link.get("pending", 0),
        )
        yield gauge(
            "ladsd_delivery_in_flight_results",
            "Committed results not yet received.",
            link.get("in_flight", 0),
        )
        yield counter("ladsd_delivery_decisions", "Policy decisions.", link.get("decisions", 0))
        yield counter("ladsd_delivery_promotions", "LADS promotions.", pol.get("promotions", 0))
        yield counter(
            "ladsd_delivery_fallbacks",
            "Decisions that fell back to Cache-first.",
            pol.get("fallback", 0),
        )
        yield counter(
            "ladsd_delivery_link_bytes",
            "Bytes put on the paced link (resends included).",
            link.get("bytes", 0),
        )


def registry(ctx: ServeContext, replica: str | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(ctx, replica))  # type: ignore[arg-type]
    return reg


def install(app: web.Application) -> None:
    """Add ``GET /metrics`` to ``app`` (its :data:`~.context.CONTEXT` set)."""
    ctx = app[CONTEXT]
    reg = registry(ctx, ctx.cfg.replica)

    async def metrics(_: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(reg))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app.router.add_get("/metrics", metrics)
