"""The services one gpuos command works with, built once from its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import Paths, find_criu
from .criu import Criu
from .cudadrv import CudaDriver, GpuDriver
from .journal import RecoveryAction, recover
from .store import ImageStore


@dataclass
class Runtime:
    paths: Paths
    criu_path: str | None = None
    _driver: GpuDriver | None = field(default=None, repr=False)

    @property
    def store(self) -> ImageStore:
        return ImageStore(self.paths.store, self.paths.hot)

    def criu(self) -> Criu:
        return Criu(binary=find_criu(self.criu_path), plugin_dir=self.paths.run / "criu-plugins")

    def driver(self, wait_for_init: bool = True) -> GpuDriver:
        """The driver (one per runtime); wait_for_init: CudaDriver's."""
        if self._driver is None:
            self._driver = CudaDriver(wait_for_init)
        return self._driver

    def recover(self) -> list[RecoveryAction]:
        return recover(self.paths.run, self.store, self.driver)
