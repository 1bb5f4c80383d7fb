"""Movable memory: the device memory libgpuos owns under `gpuos run`, and its agent.

libgpuos/src/memory.c makes the allocations; libgpuos/src/agent.c moves them on request
(libgpuos/include/gpuos_agent.h is the protocol).  `Agent` is the client: hold the
application at its CUDA calls, list, capture, export, release, map back, fill, resume.
"""

from .agent import Agent, AgentError, MovableAlloc, agent_available

__all__ = ["Agent", "AgentError", "MovableAlloc", "agent_available"]
