"""Builds libgpuos.so (libgpuos/, with make) into the package as gpuos/_native/libgpuos.so,
and the fault injector (inject/, with make and nvcc) as gpuos/_native/gpuos-inject.

Everything else about the package is in pyproject.toml.  Neither is a Python extension;
each is declared as one so that setuptools builds it in every kind of install (wheel,
regular and editable) and tags the wheel for this platform.
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
# extension name's last part -> (directory with the Makefile, make targets, the file built)
NATIVE = {
    "libgpuos": ("libgpuos", ["lib"], "libgpuos.so"),
    "gpuos_inject": ("inject", [], "gpuos-inject"),
}


class BuildLibgpuos(build_ext):
    def build_extension(self, ext: Extension) -> None:
        subdir, targets, built = NATIVE[ext.name.rsplit(".", 1)[-1]]
        out = Path(self.build_temp).resolve() / subdir
        subprocess.run(["make", "-C", str(HERE / subdir), f"O={out}", *targets], check=True)
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / built, dest)
        os.chmod(dest, 0o755)

    def get_ext_filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        return os.path.join(*parts[:-1], NATIVE[parts[-1]][2])


class PlatformWheel(bdist_wheel):
    """py3-none-PLATFORM: the library does not depend on the Python version."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(ext_modules=[Extension("gpuos._native.libgpuos", sources=[]),
                   Extension("gpuos._native.gpuos_inject", sources=[])],
      cmdclass={"build_ext": BuildLibgpuos, "bdist_wheel": PlatformWheel})
