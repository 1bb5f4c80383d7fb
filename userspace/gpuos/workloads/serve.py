"""An inference server that answers requests dropped into a directory: what a cold start,
and a restore, must bring back to its first answer.

    python3 -m gpuos.workloads.serve --model gpt2-large --requests DIR

Models (random weights from the seed, so that a run needs no download):

  gpt2-large  GPT-2-large-sized (transformers, 774M parameters, about 3 GB on the GPU;
              built on the CPU and moved, as `from_pretrained` does); a request's answer
              is four greedy tokens after a 32-token prompt from the request's seed
  resnet50    torchvision's ResNet-50 (25M parameters); a batch of 8 images from the seed
  big-NN      a GPT-2-style model of about NN GiB of bfloat16 weights, made on the GPU
              (loading a checkpoint of that size from disk is slower still)

A request is a file `req-<n>` (any content) in DIR; the answer is written to `resp-<n>`
(atomically) as one JSON line: the request, a hash of the output, the time the request
was seen and answered, and a random token; the line is also appended to DIR/answers
(replicas of one server share DIR: each of their answers is there).  The server polls DIR every millisecond, and writes `ready` (its
pid) once the model is built.  Answers depend only on the model's seed and the request
number, so a restored server must answer exactly as a server that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

REQ = re.compile(r"req-(\d+)")


def output_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def build(name: str, seed: int, dev: torch.device):
    """(model, answer(n) -> tensor) for the named model."""
    torch.manual_seed(seed)
    if name == "gpt2-large" or name.startswith("big-"):
        from transformers import GPT2Config, GPT2LMHeadModel

        if name == "gpt2-large":
            cfg = GPT2Config(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257)
            model = GPT2LMHeadModel(cfg).to(dev).eval()
        else:  # about 12 * n_embd^2 parameters a layer, bfloat16
            gib = float(name[4:])
            n_embd = 4096
            layers = max(1, round(gib * (1 << 30) / 2 / (12 * n_embd * n_embd)))
            cfg = GPT2Config(n_layer=layers, n_embd=n_embd, n_head=32, n_positions=1024, vocab_size=50257)
            torch.set_default_dtype(torch.bfloat16)
            with dev:
                model = GPT2LMHeadModel(cfg).eval()
            torch.set_default_dtype(torch.float32)

        def answer(n: int) -> torch.Tensor:
            g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + n)
            ids = torch.randint(0, cfg.vocab_size, (1, 32), device=dev, generator=g)
            for _ in range(4):  # four greedy tokens, without a cache
                nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            return ids[:, -4:]
        return model, answer
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).to(dev).eval()

        def answer(n: int) -> torch.Tensor:
            g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + n)
            x = torch.randn(8, 3, 224, 224, device=dev, generator=g)
            return model(x)
        return model, answer
    raise SystemExit(f"serve: unknown model {name!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-large")
    p.add_argument("--requests", required=True, help="the directory requests arrive in")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    _, answer = build(args.model, args.seed, dev)
    torch.cuda.synchronize()
    d = args.requests
    with open(os.path.join(d, "ready.tmp"), "w") as f:
        f.write(f"{os.getpid()}\n")
    os.rename(os.path.join(d, "ready.tmp"), os.path.join(d, "ready"))
    done: set[int] = set()
    with torch.inference_mode():
        while True:
            todo = sorted(int(m.group(1)) for e in os.listdir(d) if (m := REQ.fullmatch(e)))
            todo = [n for n in todo if n not in done]
            if not todo:
                time.sleep(0.001)
                continue
            for n in todo:
                seen = time.time()
                out = answer(n)
                h = output_hash(out)
                # Replicas (`gpuos restore --replicas`) share the directory, and their pids:
                # a random token tells their answers apart, each appended to `answers`.
                token = os.urandom(8).hex()
                line = json.dumps({"request": n, "output": h, "seen": seen, "answered": time.time(),
                                   "pid": os.getpid(), "token": token}) + "\n"
                tmp = os.path.join(d, f"resp-{n}.{token}.tmp")
                with open(tmp, "w") as f:
                    f.write(line)
                os.rename(tmp, os.path.join(d, f"resp-{n}"))
                fd = os.open(os.path.join(d, "answers"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
                done.add(n)


if __name__ == "__main__":
    main()
