"""Movable memory: the device memory libgpuos owns under `gpuos run`, and its agent.

libgpuos/src/memory.c makes the allocations; libgpuos/src/agent.c moves them on request
(libgpuos/include/gpuos_agent.h is the protocol).  `Agent` is the client: hold the
application at its CUDA calls, list, capture, export, release, map back, fill, resume.
`read_group` reads a group sharing one pool (`gpuos run --share`, gpuos_share.h).
"""

from .agent import Agent, AgentError, MovableAlloc, agent_available
from .share import GroupStats, check_name, group_limit, read_group

__all__ = ["Agent", "AgentError", "GroupStats", "MovableAlloc", "agent_available", "check_name", "group_limit",
           "read_group"]
