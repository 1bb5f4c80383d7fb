"""Fixtures of the host tests that run libgpuos on the fake driver."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def libgpuos_build(tmp_path_factory) -> Path:
    """libgpuos, the fake driver and the C test programs, built once (make all)."""
    out = tmp_path_factory.mktemp("libgpuos")
    res = subprocess.run(["make", "-s", "-j2", "-C", str(REPO / "libgpuos"), f"O={out}", "all"],
                         capture_output=True, text=True)
    if res.returncode and "no cuda.h found" in res.stderr:
        pytest.skip("no CUDA toolkit headers (cuda.h) to build libgpuos against")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def libgpuos_env(libgpuos_build) -> dict[str, str]:
    """An environment running programs on the fake driver, `gpuos run` preloading the
    freshly built libgpuos, and nothing of gpuos's from outside (GPUOS_*)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUOS_")}
    e["GPUOS_LIBGPUOS"] = str(libgpuos_build / "libgpuos.so")
    e["LD_LIBRARY_PATH"] = str(libgpuos_build / "fakecuda")
    return e
