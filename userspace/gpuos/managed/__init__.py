"""Managed memory (CUDA's cuMemAllocManaged) moved ahead of the launches that need it, by
the patched driver through gpuos.ko: libgpuos's predictions fed to batched migration,
eviction hints and prefetch ranges (ahead.py)."""

from .ahead import AheadFeeder, LaunchSequence, Planner, Stats, Step, driver_not_ready, merge, working_set

__all__ = ["AheadFeeder", "LaunchSequence", "Planner", "Stats", "Step", "driver_not_ready", "merge", "working_set"]
