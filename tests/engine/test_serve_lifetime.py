"""``ladsd serve``'s per-session lease lifetime (ours, issue 21 item 4): ``--lease-rule``.

``session`` (the default): a tool wait's expected time is the intent's, else the
session's own learned tool time (:class:`ToolTimes`), else 1 s; its lease lifetime
is ``l_i = min(cap, max(l, 1.5 x expected))``. ``fixed``: today's notice (no lifetime,
nothing learned). Units without an engine, then one in-process daemon on the tiny
model (the wait it learns is made long by moving the notice's ready time back: no
test waits, none asserts a time).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from ladsd.config import PROFILES
from ladsd.engine import budget as bud
from ladsd.serve.harness import Intent, ToolTimes
from ladsd.serve.protocol import DEFAULT_TOOL_S, notice
from ladsd.serve.sessions import LeaseRule, SessionTable
from tests.helpers import FORCE, Api, free_port, running, weather_tool

GUARD_S = 120  # hang guard only
ROOT = Path(__file__).resolve().parents[2]
SESSION = LeaseRule.of("session", 8.0, None)


def a_session():
    s = SessionTable(8, 60.0, lambda _: None).open("a")
    s.transcript.history, s.turn = (1, 2, 3), 1
    return s


# ---- units -----------------------------------------------------------------------------


def test_tool_times_learn_an_ewma_of_the_observed_waits() -> None:
    t = ToolTimes()
    assert (t.expected_s, t.observed) == (None, 0)  # nothing observed: no estimate
    t.observe(12.0)
    assert (t.expected_s, t.observed, t.last_s) == (12.0, 1, 12.0)
    t.observe(4.0)  # alpha 0.5
    assert (t.expected_s, t.observed, t.last_s) == (8.0, 2, 4.0)
    t.observe(-1.0)  # a clock step back counts as no wait, never an error
    assert t.expected_s == 4.0 and t.as_dict() == {"observed": 3, "expected_s": 4.0, "last_s": 0.0}


def test_the_rule_names_its_cap_and_refuses_bad_settings() -> None:
    assert (SESSION.name, SESSION.base_s, SESSION.cap_s) == ("session", 8.0, 64.0)  # 8 x l
    assert LeaseRule.of("fixed", 8.0, 20.0).as_dict() == {
        "lease_rule": "fixed", "lease_max_s": 20.0, "lease_margin": bud.LIFETIME_MARGIN,
    }  # fmt: skip
    for name, cap in (("ttl", None), ("session", 7.9), ("session", float("inf"))):
        with pytest.raises(ValueError):
            LeaseRule.of(name, 8.0, cap)


def test_session_rule_first_wait_keeps_the_default_then_learns() -> None:
    s = a_session()
    n = notice(s, "search", rule=SESSION)
    assert (n.expected_wait_s, n.lifetime_s) == (DEFAULT_TOOL_S, 8.0)  # nothing observed: l
    s.harness.tools.observe(11.0)
    n = notice(s, "search", rule=SESSION)
    assert n.expected_wait_s == 11.0 and n.lifetime_s == pytest.approx(16.5)
    s.harness.tools.observe(200.0)  # a long wait: the lifetime stops at the cap
    assert notice(s, "search", rule=SESSION).lifetime_s == 64.0


def test_session_rule_takes_the_intent_over_the_learned_wait() -> None:
    s = a_session()
    s.harness.tools.observe(2.0)
    s.harness.intents["search"] = Intent("search", 30.0, None)
    n = notice(s, "search", rule=SESSION)
    assert n.expected_wait_s == 30.0 and n.lifetime_s == pytest.approx(45.0)
    both = notice(s, ["search", "open"], rule=SESSION)  # "open": no intent, the learned 2 s
    assert both.expected_wait_s == 30.0 and both.lifetime_s == pytest.approx(45.0)
    assert notice(s, "open", rule=SESSION).expected_wait_s == 2.0


def test_fixed_rule_is_today_s_notice() -> None:
    s = a_session()
    s.harness.tools.observe(11.0)  # observed, never used
    for rule in (LeaseRule.of("fixed", 8.0, None), None):
        n = notice(s, "search", rule=rule)
        assert (n.expected_wait_s, n.lifetime_s) == (DEFAULT_TOOL_S, None)
    s.harness.intents["*"] = Intent("*", 11.0, None)
    assert notice(s, "search").lifetime_s is None and notice(s, "x").expected_wait_s == 11.0


@pytest.mark.parametrize(
    ("flags", "says"),
    [(("--lease-rule", "ttl"), "--lease-rule"), (("--lease-max-s", "4"), "--lease-max-s")],
)
def test_serve_refuses_a_bad_lease_rule_or_cap_before_starting(
    flags: tuple[str, ...], says: str
) -> None:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "--profile", "smoke", *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=GUARD_S,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert says in res.stdout + res.stderr


# ---- one daemon on the tiny model ----------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module")
async def daemon(model_ready: None) -> AsyncIterator:
    from ladsd.serve.daemon import Daemon, ServeConfig

    prof = PROFILES["smoke"]
    d = Daemon(prof, "lads", ServeConfig(port=free_port(), max_waiting=2))
    async with running(d, GUARD_S):
        yield d


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="module")
async def test_a_session_without_intent_learns_its_tool_time_and_leases_for_it(daemon) -> None:
    weather = weather_tool(max_len=8)
    l_s = daemon.profile.lease.lease_lifetime_s
    async with aiohttp.ClientSession() as http:
        api = Api(f"http://127.0.0.1:{daemon.cfg.port}", http)
        status, st = await api.call("GET", "/v1/engine/state")
        assert (st["lease_rule"], st["lease_max_s"]) == ("session", 8 * l_s)
        msgs = [{"role": "user", "content": "Paris?"}]
        status, out = await api.chat("L", messages=msgs, tools=[weather], tool_choice=FORCE,
                                     max_tokens=40)  # fmt: skip
        assert status == 200 and out["choices"][0]["finish_reason"] == "tool_calls", out
        s = daemon.sessions.get("L")
        assert s.wait.notice.lifetime_s == l_s  # the first wait: nothing learned, l_i = l
        # The tool "took" 11 s more: the wait runs from the notice's ready time.
        w = s.wait
        w.notice = replace(w.notice, ready_time=w.notice.ready_time - 11.0)
        msg = out["choices"][0]["message"]
        call = msg["tool_calls"][0]
        msgs += [msg, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]
        status, out = await api.chat("L", messages=msgs, tools=[weather], tool_choice=FORCE,
                                     max_tokens=40)  # fmt: skip
        assert status == 200 and out["choices"][0]["finish_reason"] == "tool_calls", out
        learned = s.harness.tools.expected_s
        assert s.harness.tools.observed == 1 and learned is not None and learned >= 11.0
        n = s.wait.notice
        want = bud.lease_lifetime(l_s, learned, bud.LIFETIME_MARGIN, 8 * l_s)
        assert n.expected_wait_s == learned and n.lifetime_s == want and want > l_s
        view: dict = {}
        for _ in range(400):  # the record comes with a published state (hang guard only)
            status, view = await api.call("GET", "/v1/sessions/L")
            lease = view["lease"]
            if lease["status"] == "granted" and lease["deadline"] is not None:
                break
            await asyncio.sleep(0.05)
        lease = view["lease"]
        assert lease["status"] == "granted", view  # T_B = learned <= tau = l_i
        assert lease["deadline"] - lease["granted_at"] == pytest.approx(want)
        assert lease["lifetime_s"] == want and view["tool_times"]["observed"] == 1
        assert (await api.call("DELETE", "/v1/sessions/L"))[0] == 200
