"""Supervised MPS: gpuos runs NVIDIA's MPS control daemon for a GPU and recovers its clients.

``control.py`` talks to ``nvidia-cuda-mps-control``; ``state.py`` is the supervisor's
state machine (pure: inputs in, actions out); ``supervisor.py`` is the process that
drives it; ``store.py`` keeps its state file and event log; ``launch.py`` starts
clients and recovery hooks; ``gpu.py`` resolves the GPU and its compute mode;
``faultsrc.py`` feeds it fault events.  docs/mps.md describes it all.
"""
