"""GPU faults: kernel-log and NVML sources, classification, the fault journal (docs/faults.md)."""
