"""What the GPU tests need, each probed in a fresh interpreter (a CUDA context made here
would change what the tests measure)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def probe(code: str) -> str | None:
    """None if the code runs in a fresh interpreter, else why not."""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "timed out"
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["failed"])[-1]


# None, or why torch cannot use a CUDA GPU here.
NO_TORCH_GPU = probe("import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'")


def torch_gpu_marks() -> list:
    """A GPU test module's pytestmark: marked gpu, and skipped without torch and a GPU."""
    if NO_TORCH_GPU:
        return [pytest.mark.gpu, pytest.mark.skip(reason=f"needs torch and a CUDA GPU: {NO_TORCH_GPU}")]
    return [pytest.mark.gpu]
