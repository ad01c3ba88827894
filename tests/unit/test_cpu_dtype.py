"""The cpu profile's dtype (float32 on every CPU) and the calibration check's band.

docs/profiles.md, "Why float32": bf16's speed-ups depend on the CPU, so the
calibrated profile pins float32; another model served keeps the CPU's rule.
"""

from __future__ import annotations

import pytest

from cli.main import _serve_profile
from ladsd.config import PROFILES, kappa_ref
from ladsd.engine.cpu import resolve_dtype
from ladsd.workloads import dilation
from tests.helpers import bench_script

calibrate = bench_script("calibrate")
CPU = PROFILES["cpu"]


def test_cpu_profile_runs_float32_on_any_cpu() -> None:
    assert CPU.engine.dtype == "float32"
    for flags in ((), ("avx2",), ("avx512_bf16", "amx_bf16")):
        assert resolve_dtype(CPU.engine.dtype, False, flags) == "float32"


def test_float32_dilation_uses_the_float32_reference() -> None:
    assert kappa_ref(CPU, "float32") == CPU.kappa_ref_float32_s == 0.038
    # A kappa at the reference plays the calibrated run as it is.
    assert dilation.of_kappa(CPU, 0.038, "float32") == pytest.approx(1.0)
    assert dilation.of_kappa(CPU, 0.076, "float32") == pytest.approx(2.0)


def test_serve_of_the_profiles_own_model_keeps_float32() -> None:
    prof = _serve_profile("cpu", CPU.engine.model, None, None, None, None, None)
    assert prof.engine.dtype == "float32"
    assert prof.kappa_ref_float32_s == CPU.kappa_ref_float32_s


def test_serve_of_another_model_follows_the_cpu() -> None:
    prof = _serve_profile("cpu", "smollm2-135m", None, None, None, None, None)
    assert prof.engine.dtype == "auto"
    assert prof.kappa_ref_s is None and prof.kappa_ref_float32_s is None


@pytest.mark.parametrize(
    ("reuse", "noreuse", "ok"),
    [
        (0.66, 2.11, True),  # the calibration
        (0.73, 1.94, True),  # float32 on the AMX Xeon, seed 1, dilated
        (0.84, 1.64, False),  # bf16 there: both sides just out
        (0.70, 1.60, False),
        (0.85, 2.0, False),
        (0.5, 3.0, True),  # the band's edges are in
    ],
)
def test_calibration_band(reuse: float, noreuse: float, ok: bool) -> None:
    assert calibrate.in_band(reuse, noreuse) is ok
