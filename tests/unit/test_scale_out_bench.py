"""bench/agent_sessions.py --scale-out: what each cluster server is given and how its ratios
to one replica are formed (no engine; the cluster itself is tested in test_cluster.py)."""

from __future__ import annotations

import argparse

from tests.helpers import bench_script

agents = bench_script("agent_sessions")


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        profile="cpu", model="smollm2-135m", h=170, headroom=0.166, src=".", home="."
    )


def _engine() -> dict:
    return {"num_gpu_blocks_override": 1024, "max_num_seqs": 8, "max_model_len": 8192,
            "dtype": "bfloat16"}  # fmt: skip


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_a_cluster_splits_the_pool_and_its_headroom() -> None:
    one = agents.command(agents.SERVERS["lads"], _args(), _engine(), 9000)
    two = agents.command(agents.SERVERS["rr-fifo"], _args(), _engine(), 9000)
    assert "serve" in one and "cluster" not in one
    assert _after(one, "--kv-blocks") == "1024" and _after(one, "--headroom-blocks") == "170"
    assert "cluster" in two and _after(two, "--replicas") == str(agents.REPLICAS)
    assert _after(two, "--kv-blocks") == str(1024 // agents.REPLICAS)
    assert _after(two, "--headroom-blocks") == str(round(0.166 * (1024 // agents.REPLICAS)))
    assert _after(two, "--routing") == "round_robin" and _after(two, "--policy") == "fifo"


def test_every_scale_out_server_is_known_and_the_routings_are_all_there() -> None:
    names = agents.SCALE_OUT.split(",")
    assert all(n in agents.SERVERS for n in names)
    routings = {agents.SERVERS[n].routing for n in names if agents.SERVERS[n].kind == "cluster"}
    assert routings == {"consistent_hash", "round_robin", "cache_aware"}
    # LADS servers carry the intent, FIFO ones do not, as on one replica.
    assert agents.SERVERS["ch-lads"].intent and not agents.SERVERS["ch-fifo"].intent


def test_ratios_to_one_replica_pair_each_cluster_with_its_own_policy() -> None:
    def run(server: str, seed: int, v: float) -> dict:
        return {"server": server, "seed": seed, "repeat": 0, "summary": {"session_s": v}}

    runs = [run("lads", 1, 10.0), run("fifo", 1, 20.0), run("ch-lads", 1, 12.0),
            run("rr-fifo", 1, 30.0), run("ch-lads", 2, 9.0)]  # fmt: skip
    got = agents.vs_one(runs, "session_s")
    assert got == {"ch-lads/lads": [1.2], "rr-fifo/fifo": [1.5]}  # seed 2 has no one-replica run
