"""gpuos: OS-level services for Linux processes that use NVIDIA GPUs."""

__version__ = "0.1.0"
