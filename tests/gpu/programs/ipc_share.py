"""A PyTorch process that shares a CUDA tensor with a spawned child (CUDA IPC): the
exporter prints ``ready <child pid>`` once the child has imported and read it, then both
wait. The C/R matrix expects gpuos to refuse it before changing anything."""

import sys
import time

import torch
import torch.multiprocessing as mp


def child(q, done):
    t = q.get()
    print("child read", float(t.sum()), flush=True)
    done.wait()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    x = torch.ones(1 << 20, device="cuda")
    p = ctx.Process(target=child, args=(q, done))
    p.start()
    q.put(x)
    time.sleep(8)  # the child has imported it by now
    print("ready", p.pid, flush=True)
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
    done.set()
    p.join()
