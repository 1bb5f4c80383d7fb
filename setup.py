"""Builds libgpuos.so (libgpuos/, with make) into the package as gpuos/_native/libgpuos.so.

Everything else about the package is in pyproject.toml.  The library is not a Python
extension; it is declared as one so that setuptools builds it in every kind of install
(wheel, regular and editable) and tags the wheel for this platform.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent


class BuildLibgpuos(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out = Path(self.build_temp).resolve() / "libgpuos"
        subprocess.run(["make", "-C", str(HERE / "libgpuos"), f"O={out}", "lib"], check=True)
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "libgpuos.so", dest)
        os.chmod(dest, 0o755)

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")[:-1], "libgpuos.so")


class PlatformWheel(bdist_wheel):
    """py3-none-PLATFORM: the library does not depend on the Python version."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(ext_modules=[Extension("gpuos._native.libgpuos", sources=[])],
      cmdclass={"build_ext": BuildLibgpuos, "bdist_wheel": PlatformWheel})
