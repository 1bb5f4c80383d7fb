"""Fixtures for the host tests; fakes in fakes.py, helpers in helpers.py, tests/vm in vmproxy.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuos.config import Paths, find_criu
from gpuos.store import ImageStore

from helpers import Processes, criu_unusable
from vmproxy import pytest_collection_modifyitems, pytest_pycollect_makemodule  # noqa: F401  (tests/vm)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Paths:
    """A private GPUOS_HOME (never /var/lib/gpuos), also in this process's environment."""
    for var in ("GPUOS_STORE", "GPUOS_CRIU", "GPUOS_TEST_HOLD_AT", "GPUOS_TEST_HOLD_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUOS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUOS_HOT", str(tmp_path / "home" / "hot"))
    paths = Paths.from_env()
    assert paths.home == tmp_path / "home"
    return paths


@pytest.fixture
def store(home: Paths) -> ImageStore:
    return ImageStore(home.store, home.hot)


@pytest.fixture
def processes(tmp_path: Path):
    ps = Processes(tmp_path)
    yield ps
    ps.cleanup()


@pytest.fixture(scope="session")
def criu_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A criu that works here, or the test is skipped."""
    why = criu_unusable(tmp_path_factory.mktemp("plugins"))
    if why:
        pytest.skip(f"criu tests: {why}")
    return find_criu()
