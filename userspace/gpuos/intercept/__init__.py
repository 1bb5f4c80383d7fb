"""The Python side of libgpuos: `gpuos run`, the ring reader, the launch log (docs/interception.md)."""
