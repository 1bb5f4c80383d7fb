"""A small, deterministic PyTorch job to checkpoint: the demo's, the tests' and the benchmark's.

    python3 -m gpuos.workloads.torchjob --mode train --steps 200 --log FILE

train   a CNN + MLP classifier (cuDNN convolutions, cuBLAS matmuls, Adam) on
        batches that a second thread makes from a seeded generator; each step
        logs its loss exactly (float.hex), the end logs a hash of the weights.
infer   a transformer encoder on seeded random inputs; each request logs a
        hash of its output.
serve   a GPT-2-large-sized language model (transformers, 774M parameters, random
        weights from the seed, about 3 GB on the GPU) answering one seeded prompt
        per step; each answer (greedy next tokens) is logged.
busy    keeps the GPU busy with one-second spin kernels (for lock timeouts).

Every line starts with the step number, so two runs compare line by line: a
checkpointed and restored run must log exactly what an uninterrupted run
logs.  ``--hold-gib`` keeps that much extra random data on the GPU and logs
an exact integer checksum of it at the start and the end (and every
``--check-every`` steps).  ``--step-sleep``
paces the job so a checkpoint can land mid-run.  Lines go to ``--log``
(line-buffered); ``--ready FILE`` is written once the GPU is set up.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import threading
import time

# Deterministic cuBLAS needs this before the CUDA context exists.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def exact_checksum(t: torch.Tensor) -> int:
    """An exact checksum computed on the GPU (integer sum of the bits), in slices so that
    no large temporary grows the process's GPU footprint beyond the data itself."""
    total = 0
    for part in t.view(torch.int32).split(1 << 24):
        total += int(part.to(torch.int64).sum().item())
    return total


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(),
                                  nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def batches(seed: int, steps: int, out: queue.Queue) -> None:
    """The data-loader thread: CPU batches from a per-step seeded generator."""
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x = torch.randn(128, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (128,), generator=g)
        out.put((step, x.pin_memory(), y.pin_memory()))
    out.put(None)


def train(args: argparse.Namespace, dev: torch.device, log, after_step) -> None:
    torch.manual_seed(args.seed)
    model = Net().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    q: queue.Queue = queue.Queue(maxsize=4)
    threading.Thread(target=batches, args=(args.seed, args.steps, q), daemon=True).start()
    ready(args)
    while (item := q.get()) is not None:
        step, x, y = item
        loss = nn.functional.cross_entropy(model(x.to(dev, non_blocking=True)),
                                           y.to(dev, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log(f"{step} loss {loss.item().hex()} t {time.time():.6f}")
        after_step(step)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    log(f"{args.steps} weights {tensor_hash(flat)}")


def infer(args: argparse.Namespace, dev: torch.device, log, after_step) -> None:
    torch.manual_seed(args.seed)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                       batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=4).to(dev).eval()
    ready(args)
    with torch.inference_mode():
        for step in range(args.steps):
            g = torch.Generator(device=dev).manual_seed(args.seed * 1_000_003 + step)
            x = torch.randn(16, 64, 256, device=dev, generator=g)
            log(f"{step} output {tensor_hash(model(x))} t {time.time():.6f}")
            after_step(step)


def serve(args: argparse.Namespace, dev: torch.device, log, after_step) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    cfg = GPT2Config(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).to(dev).eval()
    ready(args)
    with torch.inference_mode():
        for step in range(args.steps):
            g = torch.Generator(device=dev).manual_seed(args.seed * 1_000_003 + step)
            ids = torch.randint(0, cfg.vocab_size, (1, 32), device=dev, generator=g)
            for _ in range(4):  # four greedy tokens, without a cache: a request's answer
                nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            log(f"{step} output {tensor_hash(ids[:, -4:])} t {time.time():.6f}")
            after_step(step)


def busy(args: argparse.Namespace, dev: torch.device, log, after_step) -> None:
    ready(args)
    for step in range(args.steps):
        torch.cuda._sleep(2_000_000_000)  # about a second of one SM spinning
        torch.cuda.synchronize()
        log(f"{step} busy 1 t {time.time():.6f}")
        after_step(step)


def ready(args: argparse.Namespace) -> None:
    if args.ready:
        with open(args.ready + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.rename(args.ready + ".tmp", args.ready)




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("train", "infer", "serve", "busy"), default="train")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log", required=True)
    p.add_argument("--ready")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold-gib", type=float, default=0.0)
    p.add_argument("--check-every", type=int, default=0,
                   help="Also log the held data's checksum every N steps.")
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    f = open(args.log, "a", buffering=1)

    def log(line: str) -> None:
        f.write(line + "\n")

    held = None
    if args.hold_gib:
        g = torch.Generator(device=dev).manual_seed(args.seed + 7)
        held = torch.rand(int(args.hold_gib * (1 << 30) // 4), device=dev, generator=g)
        log(f"-1 held {exact_checksum(held)}")

    def after_step(step: int) -> None:
        if held is not None and args.check_every and step % args.check_every == 0:
            log(f"{step} held {exact_checksum(held)}")
        if args.step_sleep:
            time.sleep(args.step_sleep)

    {"train": train, "infer": infer, "serve": serve, "busy": busy}[args.mode](args, dev, log, after_step)
    if held is not None:
        log(f"{args.steps} held {exact_checksum(held)}")
    torch.cuda.synchronize()
    log("done")
    f.close()


if __name__ == "__main__":
    main()
