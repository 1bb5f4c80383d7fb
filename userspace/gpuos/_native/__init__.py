"""libgpuos.so lives here: setup.py builds it from libgpuos/ (gpuos.intercept.runner.libgpuos_path)."""
