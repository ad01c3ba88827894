"""The engine's dtype by the CPU (ladsd.engine.cpu) and where it is recorded.

* the rule and the /proc/cpuinfo parsing, on fake flag sets (no engine);
* ``--dtype`` on every command that builds an engine: checked before any run;
* a replay's run file records the dtype vLLM ran and the CPU; ``--dtype float32``
  reaches the tiny engine (vLLM casts the bf16-prepared shape);
* the daemon reports its dtype (``/health``, ``/v1/engine/state``) and keys its kappa
  cache by it; run files from before these keys still load and render.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
import pytest
from typer.testing import CliRunner

from cli.main import app
from ladsd.config import PROFILES, has_cuda
from ladsd.engine import cpu
from ladsd.engine import kappa as kappa_cache
from ladsd.engine.cpu import CpuInfo, native_bf16, parse_cpuinfo, resolve_dtype
from ladsd.engine.thread import EngineThread
from ladsd.metrics import comparison, events, grid, summary
from tests.helpers import free_port, linked_home, running

ROOT = Path(__file__).resolve().parents[2]
SMOKE = PROFILES["smoke"]
GUARD_S = 300  # hang guard only

# Flag lines as Linux prints them (shortened).
EPYC_AVX2 = "fpu sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 sha_ni".split()  # Zen 2/3
SKYLAKE_X = "avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni".split()  # AVX-512, no BF16
ZEN4 = "avx2 avx512f avx512bw avx512_bf16 avx512_vnni".split()
SAPPHIRE = "avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8".split()
AMX_ONLY = "avx2 amx_bf16 amx_tile".split()
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimdhp asimddp".split()
GRAVITON3 = "fp asimd sve sve2 svebf16 i8mm bf16 dcpop".split()
SVE_ONLY = "fp asimd sve".split()
SVEBF16_ONLY = "fp asimd sve svebf16".split()

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu avx avx2 fma
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve svebf16 bf16
CPU implementer\t: 0x41
"""


# ---- the rule (pure) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        (EPYC_AVX2, False),
        (SKYLAKE_X, False),  # avx512f is not bf16
        (ZEN4, True),
        (SAPPHIRE, True),
        (AMX_ONLY, True),
        (GRAVITON2, False),
        (GRAVITON3, True),
        (SVE_ONLY, False),  # sve is not bf16
        (SVEBF16_ONLY, True),
        ([], False),  # flags unread: emulated, the safe choice
    ],
)
def test_native_bf16_by_flags(flags: list[str], native: bool) -> None:
    assert native_bf16(flags) is native
    assert native_bf16(set(flags)) is native  # any iterable


def test_auto_on_a_cpu_is_bf16_only_where_native() -> None:
    assert resolve_dtype("auto", False, SAPPHIRE) == "bfloat16"
    assert resolve_dtype("auto", False, GRAVITON3) == "bfloat16"
    assert resolve_dtype("auto", False, EPYC_AVX2) == "float32"
    assert resolve_dtype("auto", False, []) == "float32"


def test_auto_on_cuda_stays_vllms_and_an_explicit_dtype_is_kept() -> None:
    assert resolve_dtype("auto", True, EPYC_AVX2) == "auto"
    for d in ("bfloat16", "float32", "float16"):
        for on_cuda in (False, True):
            for flags in (EPYC_AVX2, SAPPHIRE):
                assert resolve_dtype(d, on_cuda, flags) == d


def test_cpuinfo_parsing_x86_and_arm() -> None:
    x86 = parse_cpuinfo(X86_CPUINFO, "fallback")
    assert x86 == CpuInfo("AMD EPYC 7B13 64-Core Processor", ("fpu", "avx", "avx2", "fma"))
    assert not x86.native_bf16 and x86.notable() == ["avx2"]
    arm = parse_cpuinfo(ARM_CPUINFO, "aarch64")  # Arm's cpuinfo has no model name
    assert arm.model == "aarch64" and arm.flags == ("fp", "asimd", "sve", "svebf16", "bf16")
    assert arm.native_bf16 and arm.notable() == ["bf16", "sve", "svebf16"]
    assert parse_cpuinfo("", "x86_64") == CpuInfo("x86_64", ())


def test_meta_names_the_cpu() -> None:
    info = CpuInfo("AMD EPYC", tuple(EPYC_AVX2))
    assert cpu.meta(info) == {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "bf16_native": False}
    spr = cpu.meta(CpuInfo("Xeon", tuple(SAPPHIRE)))
    assert spr["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    assert spr["bf16_native"] is True


def test_kappa_key_reads_the_one_cpu_parser() -> None:
    # Same model and flag digest as before the parser moved: cached entries stay valid.
    info = cpu.cpu_info()
    digest = hashlib.sha256(" ".join(sorted(info.flags)).encode()).hexdigest()[:16]
    assert kappa_cache._cpu() == (info.model, digest) and info.model


def test_engine_thread_resolves_its_dtype_once() -> None:
    flags = cpu.cpu_info().flags
    assert EngineThread(SMOKE.engine).dtype == resolve_dtype("auto", has_cuda(), flags)
    assert EngineThread(replace(SMOKE.engine, dtype="float32")).dtype == "float32"


# ---- the command line --------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("command", [("replay",), ("compare",), ("serve",), ("capture", "tasks")])
def test_every_engine_command_takes_dtype(command: tuple[str, ...]) -> None:
    text = " ".join(invoke(*command, "--help").output.split())
    assert "--dtype" in text and "else float32" in text  # the auto rule
    res = invoke(*command, "--dtype", "int8")
    assert res.exit_code != 0 and "unknown dtype 'int8'" in res.output


# ---- run files ---------------------------------------------------------------------


@pytest.mark.engine
def test_replay_run_file_records_dtype_and_cpu(tmp_path: Path, model_ready) -> None:
    path = tmp_path / "runs.json"
    args = ("replay", "--profile", "smoke", "--policy", "fifo", "--dtype", "float32")
    res = invoke(*args, "--json", str(path))
    assert res.exit_code == 0, res.output
    (rec,) = [events.from_dict(d) for d in orjson.loads(path.read_bytes())]
    summary.audit(rec)
    info = cpu.cpu_info()
    assert rec.meta["dtype"] == "float32"  # what vLLM built: the bf16 shape cast
    assert rec.meta["profile"]["engine"]["dtype"] == "float32"  # what was asked
    assert rec.meta["cpu_model"] == info.model and rec.meta["cpu_flags"] == info.notable()
    assert rec.meta["bf16_native"] is info.native_bf16
    assert sum(c.output_tokens for w in rec.workflows for c in w.calls) > 0
    # ctrl CPU s and its parts (sender; engine thread: commands, states, inside schedule())
    c = rec.counters
    parts = ("decision_cpu_s", "command_cpu_s", "publish_cpu_s", "schedule_cpu_s")
    assert c["controller_cpu_s"] == pytest.approx(sum(c[k] for k in parts))
    assert c["decision_cpu_s"] >= 0 and c["command_cpu_s"] > 0 and c["publish_cpu_s"] > 0
    assert c["schedule_cpu_s"] > 0  # FIFO too runs the book's expiry and handoff checks
    # How that work was done: the engine's steps and states, the audit's extras.
    assert 0 < c["engine_steps"] <= c["engine_loops"] and c["states_published"] > 0
    assert c["session_order_computed"] == c["session_order_spliced"] == 0  # FIFO: no order
    assert c["sessions_kept"] == c["sessions_allocated"] == 0  # and no waiting session
    assert c["notice_blocks_hashed"] > 0 and c["notice_blocks_reused"] > 0


def test_run_files_with_and_without_the_cpu_keys_render(tmp_path: Path) -> None:
    packed = ROOT / "bench" / "results" / "cpu-quarter" / "runs.tar.xz"
    runs: dict[str, list[events.RunRecord]] = {}
    for policy in ("fifo", "cache-first", "lads", "infinite-cache"):
        name = f"controlled-c8-cpu-{policy}-s1.json"
        with tarfile.open(packed) as tar:
            tar.extract(name, tmp_path, filter="data")
        rec = events.load(tmp_path / name)
        assert "dtype" not in rec.meta and "cpu_model" not in rec.meta  # made before the keys
        # The same run as a new file would be (its A/A repeat, so both are tabled).
        meta = {**rec.meta, "repeat": 2, "dtype": "float32", **cpu.meta()}
        new = replace(rec, meta=meta)
        again = events.from_dict(json.loads(events.to_json(new)))
        assert again.meta["dtype"] == "float32"
        runs.setdefault(rec.policy, []).extend([rec, again])
    comp = comparison.compare(runs)
    grids = [*comparison.comparison_grids(comp), comparison.drivers_grid(runs)]
    assert "FIFO" in grid.markdown(grids)


# ---- the daemon --------------------------------------------------------------------


@pytest.mark.engine
async def test_daemon_reports_its_dtype_and_keys_kappa_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_ready
) -> None:
    from ladsd.serve.daemon import Daemon, ServeConfig

    home = linked_home(tmp_path)
    monkeypatch.setenv("LADSD_HOME", str(home))
    want = resolve_dtype("auto", has_cuda(), cpu.cpu_info().flags)
    async with running(Daemon(SMOKE, "fifo", ServeConfig(port=free_port())), GUARD_S) as d:
        base = f"http://127.0.0.1:{d.cfg.port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/health") as r:
                health = await r.json()
            async with http.get(base + "/v1/engine/state") as r:
                state = await r.json()
        assert health["dtype"] == state["dtype"] == d.rt.engine_info().dtype == want
    (entry,) = (home / "kappa").glob("*.json")
    assert json.loads(entry.read_text())["key"]["dtype"] == f"torch.{want}"
