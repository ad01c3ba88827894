"""A real ``ladsd serve`` subprocess on SmolLM2-135M (real weights, CPU), policy LADS,
driven by the official ``openai`` client and plain HTTP.

One server for the module, on a small pool so a flood is cheap: 40 blocks of 32
tokens, context 1,024, ``H`` = 16 blocks, ``l`` = 120 s (long enough that no
lease expires while this machine is slow: no test depends on timing).

* chat, streaming, a tool-call round trip with a ``tool`` message, OpenAI's
  error shape, ``cached_tokens``;
* the lease test: session A ends in a tool call and its history is leased;
  sessions B..K flood the pool with distinct prompts; A's next turn still finds
  its whole history cached (tests/engine/test_serve_fifo.py: near 0 without leases);
  ``/v1/events`` shows the grant and the handoff; the lease counters of
  ``/metrics`` move;
* a preference is revoked when a large request takes the pool below ``H`` (the
  event says so); a requirement that cannot be held is refused with 409, one
  that can is held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.helpers import Server
from tests.rigs.server import (
    BLOCK,
    MODEL,
    answer_turn,
    lease_run,
    serve,
    tool_turn,
    wait_for,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def srv(model_ready) -> Iterator[Server]:
    yield from serve("--policy", "lads")


# ---- OpenAI compatibility --------------------------------------------------------------


def test_models_and_a_chat(srv: Server):
    c = srv.client()
    assert [m.id for m in c.models.list()] == [MODEL]
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)


def test_streaming(srv: Server):
    stream = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "Paris" in text
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_bad_requests_get_openais_error_shape(srv: Server):
    c = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert e.value.status_code == 400 and e.value.param == "messages[0].role"
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    status, body = srv.http("POST", "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_tool_call_round_trip_with_a_tool_message(srv: Server):
    c = srv.client()
    msgs, first = tool_turn(c, "T", "What is the weather in Oslo?")
    call = first.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert first.choices[0].message.content is None
    nxt = answer_turn(c, "T", msgs, first, "Snow, -3 C.", raw=True)
    assert nxt.choices[0].finish_reason in ("stop", "length")
    # The history was extended token-exactly, nothing evicted it: whole blocks cached.
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    assert nxt.usage.prompt_tokens_details.cached_tokens >= history - BLOCK
    assert srv.http("DELETE", "/v1/sessions/T")[0] == 200


# ---- leases over HTTP ---------------------------------------------------------------------


def test_a_leased_history_survives_a_flood(srv: Server):
    before = srv.metrics()
    history, cached = lease_run(srv)
    assert cached >= history - BLOCK  # all but the partial last block
    kinds = [e["type"] for e in srv.events("A", {"grant", "handoff"})]
    assert "grant" in kinds and "handoff" in kinds
    assert kinds.index("grant") < kinds.index("handoff")
    after = srv.metrics()
    assert after["ladsd_lease_grants"] > before["ladsd_lease_grants"]
    assert after["ladsd_lease_handoffs"] > before["ladsd_lease_handoffs"]
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] >= cached
    assert srv.get("/v1/sessions/A")["lease"]["status"] == "handed_off"


def test_preference_revoked_requirement_refused_or_held(srv: Server):
    c = srv.client()
    tool_turn(c, "R", "Weather in Rome, please.")
    wait_for("R's lease", lambda: srv.get("/v1/sessions/R")["lease"]["status"] == "granted")
    # Z's ~850-token prompt takes the pool below H while it runs: R's lease is revoked.
    # Its history (27 blocks) is more than U + F - H can ever hold: the requirement fails.
    facts = " ".join(f"city{j} has {j % 9} parks" for j in range(100))
    tool_turn(c, "Z", f"Facts: {facts}. What is the weather in Zurich?")
    kinds = [e["type"] for e in srv.events("R", {"revocation"})]
    assert "revocation" in kinds
    # The session's record says so too (R stays a candidate: it may be granted again later).
    assert "revocation" in [e["type"] for e in srv.get("/v1/sessions/R")["lease"]["events"]]
    status, out = srv.http("POST", "/v1/sessions/Z/retention", {"mode": "requirement"})
    assert status == 409 and out["error"]["code"] == "refused", out
    assert out["error"]["message"]  # the engine's reason
    assert srv.get("/v1/sessions/Z")["lease"]["status"] == "refused"
    # A small history fits: the requirement is held (and stays bounded by l and H).
    tool_turn(c, "Q", "Weather in Quito?")
    status, out = srv.http("POST", "/v1/sessions/Q/retention", {"mode": "requirement"})
    assert status == 200 and out["status"] == "held", out
    st = srv.get("/v1/engine/state")
    assert st["U"] <= st["total_blocks"] - st["H"] and st["l"] == 120.0
    for sid in ("R", "Z", "Q"):
        assert srv.http("DELETE", f"/v1/sessions/{sid}")[0] == 200
    kinds = [e["type"] for e in srv.events("Q", {"cancellation"})]
    assert "cancellation" in kinds  # DELETE released Q's lease


def test_metrics_parse(srv: Server):
    m = srv.metrics()
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
        "ladsd_lease_grants", "ladsd_lease_denials", "ladsd_lease_handoffs",
        "ladsd_lease_expiries", "ladsd_lease_revocations", "ladsd_lease_active",
        "ladsd_lease_protected_blocks", "ladsd_lease_budget_blocks",
        "ladsd_delivery_queued_results", "ladsd_delivery_decisions",
        "ladsd_delivery_promotions", "ladsd_delivery_fallbacks", "ladsd_delivery_link_bytes",
        "ladsd_sessions_active",
    ):  # fmt: skip
        assert name in m, name
    assert m["vllm:prefix_cache_queries"] >= m["vllm:prefix_cache_hits"] > 0
    assert m["ladsd_engine_alive"] == 1
