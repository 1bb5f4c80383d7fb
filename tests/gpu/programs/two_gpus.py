"""Tensors moved between two GPUs of one process (PyTorch's peer copies, with peer access
on where the GPUs allow it), and kernels on each: prints a checksum of the results."""
import hashlib

import torch

assert torch.cuda.device_count() >= 2, "needs two GPUs"
g = torch.Generator(device="cuda:0").manual_seed(7)
x = torch.rand(64 << 20, device="cuda:0", generator=g)  # 256 MiB: movable memory
h = hashlib.sha256()
for step in range(5):
    y = x.to("cuda:1", non_blocking=True) * (step + 1)
    z = (y.sin() + 1).to("cuda:0")
    x = (x + z) / 2
    h.update(x[::4096].cpu().numpy().tobytes())
print(h.hexdigest())
