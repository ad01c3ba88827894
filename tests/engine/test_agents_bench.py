"""bench/agent_sessions.py: its text is token-exact, and a tiny run through its driver completes.

The driver (the official ``openai`` client, streaming, ``x-session-id``, the chat body's
``intent``) runs two cc-traces sessions of two turns against a real ``ladsd serve``
subprocess on SmolLM2-135M (real weights): every turn is a tool call, the second turn of
a session finds its history cached, and the daemon exits with a balanced lease audit.
Nothing here asserts a time.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ladsd.engine import models
from ladsd.workloads import cc_traces
from tests.helpers import bench_script

ROOT = Path(__file__).resolve().parents[2]
agents = bench_script("agent_sessions")

needs_traces = pytest.mark.skipif(
    not cc_traces.DEFAULT_TRACES.is_dir(), reason="../shared/data/cc-traces is absent"
)


def test_block_text_tokenises_back_to_its_ids() -> None:
    from transformers import AutoTokenizer

    path = str(models.model_path("smollm2-135m"))
    words = agents.one_token_words(path)
    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(7)
    ids = tuple(rng.randrange(len(words)) for _ in range(640))
    got = tok.encode(agents.text(ids, words), add_special_tokens=False)
    vocab = tok.get_vocab()
    assert got == [vocab["Ġ" + words[i]] for i in ids]  # one token per id, no merges


@pytest.mark.engine
@needs_traces
def test_two_sessions_through_the_driver(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(ROOT / "bench" / "agent_sessions.py"), "--no-pin", "--out", str(out)]
    cmd += ["--servers", "lads", "--seeds", "1", "--sessions", "2", "--max-turns", "2"]
    cmd += ["--token-scale", "0.03", "--time-factor", "0.02", "--max-context", "1200"]
    cmd += ["--kv-blocks", "160", "--max-model-len", "2048", "--stagger-s", "0.5"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["exit"] == 0 and run["audit_balanced"] is True
    assert run["pool_blocks"] == 160
    sessions = run["sessions"]
    assert len(sessions) >= 2
    turns = [t for s in sessions for t in s["turns"]]
    assert all(t["completion_tokens"] > 0 and t["prompt_tokens"] >= t["tokens"] for t in turns)
    later = [t for t in turns if t["kind"] == "extends"]
    assert later, "no session had a second turn that extends its first"
    for s in sessions:
        for a, b in zip(s["turns"], s["turns"][1:], strict=False):
            if b["kind"] == "extends":  # the whole previous prompt but its last partial block
                assert b["cached_tokens"] >= a["prompt_tokens"] - 32
    assert run["counters"]["grants"] >= 1 and run["counters"]["handoffs"] >= 1
    assert doc["workload"]["traces_commit"]
    assert re.fullmatch("[0-9a-f]{40}", doc["git"]["commit"])  # not "unknown": git was read
