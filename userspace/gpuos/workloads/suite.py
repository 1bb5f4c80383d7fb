"""The GPU workload suite: deterministic programs to measure and validate libgpuos with.

    python3 -m gpuos.workloads.suite WORKLOAD [--steps N] [--warmup N] [--batch B] [--seed S] [--json]
    python3 -m gpuos.workloads.suite --list

Runs one workload on cuda:0 and prints one line at the end (with --json, a JSON object):
workload, steps, warmup, batch, seconds (the timed steps only, between two device
synchronizations), cpu_s (the CPU time all the process's threads spent in those steps),
steps_per_s, items_per_s, checksum, torch, cuda, device, pid.

The checksum is the sha256 of the exact bytes of the final state: for training every
parameter after the last step and the last loss, for inference every output of the timed
steps, for CuPy the final arrays.  Runs are repeatable bit for bit (fixed seeds,
deterministic algorithms, a fixed cuBLAS workspace, random data made on the GPU from the
seed), so a run under `gpuos run` must print the checksum a plain run prints.
``--exit-code N`` exits with N after printing, to check that `gpuos run` passes it on.

``--step-log FILE`` is for measuring within one run (bench/intercept_overhead.py
--paired): the first line, written before the first CUDA call, is {"pid": PID}; the
last, written at the end, is {"marks": [[t, cpu, paused], ...]}: CLOCK_MONOTONIC
seconds and the process's CPU seconds at the start of the timed steps and after each of
them (noop-launch: after each block of STEP_LOG_LAUNCHES launches), and whether the step
that starts at the mark ran with libgpuos's recording paused.  ``--toggle-recording K``
(under `gpuos run`) pauses and resumes that recording every K steps, between two steps:
the paired benchmark compares neighbouring steps recorded and not.

``--start-gate DIR`` is for processes timed together (bench/oversub.py's groups): after
the warmup, the process creates DIR/ready-PID and times its steps only once DIR/go
exists (at most GATE_TIMEOUT_S later).

``--turns DIR INDEX COUNT K`` is for processes timed in turns (bench/oversub.py's
overhead at 100%): COUNT processes alive at once, each with the same steps, take the GPU
in turns of K steps, in the order DIR/order lists (their indices, whitespace-separated:
the benchmark balances who runs before whom), so that the host's drift falls on all of
them alike (the same process runs alone 1.7x slower or faster from one minute to the
next on the GPU machines).  After the warmup a process creates DIR/ready-INDEX; it runs
a turn when DIR/turn holds a position of DIR/order that names INDEX (the benchmark
writes 0 once all are ready), synchronizes the device at the turn's end and writes the
next position there; DIR/abort ends the wait (exit status 2).  Its JSON then has
``windows``: each turn's [start, end] in CLOCK_MONOTONIC seconds, and ``seconds`` is
their sum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

GATE_TIMEOUT_S = 600.0  # --start-gate: the longest wait for DIR/go; --turns: for a turn

# Keys of the JSON line that differ between two runs of the same workload.
VOLATILE_KEYS = ("seconds", "cpu_s", "steps_per_s", "items_per_s", "ns_per_launch", "pid", "windows")


@dataclass
class Measured:
    seconds: float
    checksum: str
    info: dict[str, Any]  # versions, device, extras
    cpu_s: float | None = None  # process CPU time of the timed steps


# -- PyTorch ------------------------------------------------------------------------------------

def setup_torch(seed: int):
    """torch, made deterministic; CUBLAS_WORKSPACE_CONFIG is set by main() before this."""
    import torch
    import torch.utils.deterministic

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)  # also puts Inductor in its deterministic mode
    # With deterministic algorithms torch fills every torch.empty with NaN: one extra kernel per
    # allocation that real programs do not run.  No workload here reads memory it did not write.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return torch


def torch_info(torch, extra: dict[str, Any]) -> dict[str, Any]:
    """Versions and device, the peak of torch's GPU memory (after the run), and extra."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0),
            "peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2), **extra}


def generator(torch, seed: int):
    """The one source of input data: a CUDA generator, so inputs are made on the GPU."""
    return torch.Generator(device="cuda").manual_seed(seed)


def sha256_tensors(torch, tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class ToggleError(Exception):
    """--toggle-recording cannot reach this process's recording switch."""


class StepMarks:
    """The step log's marks: (time, CPU time, paused) at the start of the timed steps and
    after each; with toggle_every K, this process's recording is resumed at the first
    mark and then paused and resumed every K steps (gpuos.intercept.ring.OpsPause: one
    store into the ring header), so that every step runs wholly in one state."""

    def __init__(self, toggle_every: int = 0):
        self.rows: list[tuple[float, float, bool]] = []
        self.toggle_every = toggle_every
        self._switch = None
        self._paused = False

    def mark(self) -> None:
        t, cpu = time.monotonic(), time.process_time()
        if self.toggle_every:
            if self._switch is None:
                self._switch = self._open()
                self._switch.set(False)
            elif len(self.rows) % self.toggle_every == 0:
                self._paused = not self._paused
                self._switch.set(self._paused)
        self.rows.append((t, cpu, self._paused))

    def finish(self) -> list[tuple[float, float, bool]]:
        """Resume the recording (the rest of the run is recorded as usual)."""
        if self._switch is not None:
            self._switch.set(False)
            self._switch.close()
            self._switch = None
        return self.rows

    @staticmethod
    def _open():
        from gpuos.intercept.ring import OpsPause, RingError

        try:
            return OpsPause(os.getpid())
        except (LookupError, RingError, OSError) as exc:
            raise ToggleError(f"--toggle-recording needs this process to run under `gpuos run` "
                              f"(without --validate): {exc}") from exc


def mark(marks: StepMarks | None) -> None:
    """Note a mark in the step log (if kept)."""
    if marks is not None:
        marks.mark()


def say_ready(path: str) -> None:
    """An empty file at path: what a process waiting at a gate or for its turns shows."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def wait_at_gate(gate: str | None, timeout_s: float = GATE_TIMEOUT_S) -> bool:
    """--start-gate DIR: say this process is ready (DIR/ready-PID) and wait for DIR/go, so
    that processes started together time their steps together (bench/oversub.py's groups:
    their start-ups take different times).  False if the gate stayed shut for timeout_s
    (the steps are timed anyway, and stderr says so)."""
    if gate is None:
        return True
    say_ready(os.path.join(gate, f"ready-{os.getpid()}"))
    go, deadline = os.path.join(gate, "go"), time.monotonic() + timeout_s
    while not os.path.exists(go):
        if time.monotonic() >= deadline:
            print(f"suite: {go} did not appear within {timeout_s:.0f} s; timing without it",
                  file=sys.stderr, flush=True)
            return False
        time.sleep(0.001)
    return True


class TurnError(Exception):
    """--turns: the turn did not come (another process of the ring has gone)."""


class Turns:
    """--turns DIR INDEX COUNT K (module doc): this process's place among COUNT processes
    taking turns of K steps in the order DIR/order lists, and the windows of its turns so far."""

    def __init__(self, directory: str, index: int, count: int, steps: int,
                 timeout_s: float = GATE_TIMEOUT_S):
        self.dir, self.index, self.count, self.steps = directory, index, count, steps
        self.timeout_s = timeout_s
        self.windows: list[tuple[float, float]] = []
        self.order: list[int] | None = None  # read once the turns begin
        self.position = 0  # of the turn held last, in the order

    def ready(self) -> None:
        say_ready(os.path.join(self.dir, f"ready-{self.index}"))

    def holder(self) -> tuple[int, int] | None:
        """(the position DIR/turn holds, the index the order names there), or None
        before the turns begin or after the last."""
        try:
            with open(os.path.join(self.dir, "turn")) as f:
                position = int(f.read())
            if self.order is None:
                with open(os.path.join(self.dir, "order")) as f:
                    self.order = [int(x) for x in f.read().split()]
        except (FileNotFoundError, ValueError):
            return None
        return (position, self.order[position]) if 0 <= position < len(self.order) else None

    def wait(self) -> float:
        """Until it is this process's turn; its start (time.monotonic())."""
        deadline = time.monotonic() + self.timeout_s
        while (now := self.holder()) is None or now[1] != self.index:
            if os.path.exists(os.path.join(self.dir, "abort")):
                raise TurnError(f"--turns: {self.dir}/abort: the ring was ended (another process failed)")
            if time.monotonic() >= deadline:
                raise TurnError(f"--turns: turn {len(self.windows) + 1} did not come within "
                                f"{self.timeout_s:.0f} s ({self.dir}/turn: {now})")
            time.sleep(0.0002)
        self.position = now[0]
        return time.monotonic()

    def pass_on(self, started: float) -> None:
        self.windows.append((started, time.monotonic()))
        tmp = os.path.join(self.dir, f".turn-{self.index}")
        with open(tmp, "w") as f:
            f.write(str(self.position + 1))
        os.replace(tmp, os.path.join(self.dir, "turn"))


def timed(step: Callable[[], Any], warmup: int, steps: int, sync: Callable[[], None],
          marks: StepMarks | None = None, gate: str | None = None, turns: Turns | None = None):
    """Run warmup steps, then time `steps` steps; returns (seconds, CPU seconds of the whole
    process, their return values).  With `marks`, marks the start and each step's end;
    with `gate`, waits there between the warmup and the timed steps (wait_at_gate); with
    `turns`, runs the steps in its turns, synchronized at each turn's end, and the
    seconds are the turns' (Turns)."""
    for _ in range(warmup):
        step()
    sync()
    if turns:
        turns.ready()
    else:
        wait_at_gate(gate)
    t0, c0 = time.perf_counter(), time.process_time()
    mark(marks)
    out = []
    started = 0.0
    for i in range(steps):
        if turns and i % turns.steps == 0:
            started = turns.wait()
        out.append(step())
        mark(marks)
        if turns and (i + 1) % turns.steps == 0:
            sync()
            turns.pass_on(started)
    sync()
    seconds = sum(b - a for a, b in turns.windows) if turns else time.perf_counter() - t0
    return seconds, time.process_time() - c0, out


def train(a: argparse.Namespace, torch, model, forward, batch: Callable[[], tuple],
          extra: dict[str, Any] | None = None) -> Measured:
    """Train with AdamW (foreach), bf16 autocast and gradient clipping; checksum the
    parameters after the last step and the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=False)
    params = list(model.parameters())

    def step():
        x, y = batch()
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    seconds, cpu, losses = timed(step, a.warmup, a.steps, torch.cuda.synchronize, a.marks, a.start_gate, a.turns)
    checksum = sha256_tensors(torch, [*params, losses[-1]])
    return Measured(seconds, checksum, torch_info(torch, extra or {}), cpu)


def infer(a: argparse.Namespace, torch, step: Callable[[], Any],
          extra: dict[str, Any] | None = None) -> Measured:
    """Time inference steps; checksum every output of the timed steps."""
    with torch.no_grad():
        seconds, cpu, outputs = timed(step, a.warmup, a.steps, torch.cuda.synchronize, a.marks, a.start_gate, a.turns)
    return Measured(seconds, sha256_tensors(torch, outputs), torch_info(torch, extra or {}), cpu)


def resnet(a: argparse.Namespace, training: bool) -> Measured:
    from . import nets

    torch = setup_torch(a.seed)
    with torch.device("cuda"):
        model, impl = nets.resnet50()
    model = model.to(memory_format=torch.channels_last).train(training)
    g = generator(torch, a.seed)

    def images():
        x = torch.randn(a.batch, 3, a.image_size, a.image_size, device="cuda", generator=g)
        return x.contiguous(memory_format=torch.channels_last)

    extra = {"model": f"resnet50 ({impl})"}
    if training:
        def batch():
            return images(), torch.randint(1000, (a.batch,), device="cuda", generator=g)
        return train(a, torch, model, model, batch, extra)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            return model(images())
    return infer(a, torch, step, extra)


def gpt_model(a: argparse.Namespace, torch):
    from . import nets

    with torch.device("cuda"):
        return nets.GPT(a.vocab, a.seq, a.d_model, a.layers, a.heads)


def tokens(a: argparse.Namespace, torch, g, extra: int = 0):
    return torch.randint(a.vocab, (a.batch, a.seq + extra), device="cuda", generator=g)


def gpt_train(a: argparse.Namespace, compiled: bool = False) -> Measured:
    torch = setup_torch(a.seed)
    model = gpt_model(a, torch)
    g = generator(torch, a.seed)
    forward = torch.compile(model) if compiled else model

    def batch():
        idx = tokens(a, torch, g, extra=1)  # inputs and next-token targets
        return idx[:, :-1], idx[:, 1:].reshape(-1)

    def logits(x):
        return forward(x).reshape(-1, a.vocab)

    return train(a, torch, model, logits, batch)


def gpt_infer(a: argparse.Namespace) -> Measured:
    torch = setup_torch(a.seed)
    model = gpt_model(a, torch).eval()
    g = generator(torch, a.seed)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            return model(tokens(a, torch, g), last_only=True)
    return infer(a, torch, step)


def gpt_graphs(a: argparse.Namespace) -> Measured:
    """gpt-infer captured once into a CUDA graph; each step copies fresh tokens into the
    graph's static input and replays it."""
    torch = setup_torch(a.seed)
    model = gpt_model(a, torch).eval()
    g = generator(torch, a.seed)
    static_in = tokens(a, torch, g)
    graph = torch.cuda.CUDAGraph()
    # The autocast cache would keep casts made during capture outside the graph's pool.
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        side = torch.cuda.Stream()  # torch.cuda.graphs: warm up on a side stream first
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_in, last_only=True)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_out = model(static_in, last_only=True)

    def step():
        static_in.copy_(tokens(a, torch, g))
        graph.replay()
        return static_out.clone()  # the next replay overwrites static_out
    return infer(a, torch, step)


# -- CuPy ---------------------------------------------------------------------------------------

CUPY_KERNELS = r"""
extern "C" {
// out = a*b + c*d: a kernel taking a plain list of pointers (no struct).
__global__ void mix4(const float* a, const float* b, const float* c, const float* d,
                     float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = a[i] * b[i] + c[i] * d[i];
}

// partial[blockIdx.x] = sum over this block's share of x (squared if square != 0).  Each
// thread and the tree below add in a fixed order, and there are no atomics: deterministic.
__global__ void block_sum(const float* x, float* partial, long long n, int square) {
    __shared__ float s[256];
    float acc = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        acc += square ? x[i] * x[i] : x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// out = x / rms(x), the sum of squares read from device memory: the elementwise kernel.
__global__ void normalize(const float* x, const float* sumsq, float* out, long long n) {
    float scale = rsqrtf(*sumsq / (float)n + 1e-12f);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] * scale;
}

__global__ void noop(float* a, float* b, float* c, float* d) {}
}
"""
THREADS, BLOCKS = 256, 1024
LAUNCH_BLOCKS = 20  # noop-launch times its launches in this many blocks
STEP_LOG_LAUNCHES = 1000  # ... or, with --step-log, in blocks of about this many


def cupy_info(cupy) -> dict[str, Any]:
    v = cupy.cuda.runtime.runtimeGetVersion()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return {"torch": None, "cuda": f"{v // 1000}.{v % 1000 // 10}", "cupy": cupy.__version__,
            "device": name.decode() if isinstance(name, bytes) else name}


def cupy_suite(a: argparse.Namespace) -> Measured:
    """A non-PyTorch program: each step multiplies `batch` matrices by one (cuBLAS), filters
    them in the frequency domain (cuFFT), mixes (mix4), reduces (block_sum twice) and
    normalizes them (normalize); the state and every step's norm make the checksum."""
    import cupy
    import numpy as np

    mod = cupy.RawModule(code=CUPY_KERNELS)
    mix4, block_sum, normalize = (mod.get_function(k) for k in ("mix4", "block_sum", "normalize"))
    rs = cupy.random.RandomState(a.seed)
    n, shape = a.size, (a.batch, a.size, a.size)
    count = np.int64(a.batch * n * n)
    state = rs.standard_normal(shape, dtype=cupy.float32)
    weight = rs.standard_normal((n, n), dtype=cupy.float32) / np.float32(np.sqrt(n))
    spectrum_filter = rs.uniform(size=(n, n // 2 + 1), dtype=cupy.float32)
    mixed = cupy.empty_like(state)
    partial = cupy.empty(BLOCKS, cupy.float32)
    norms = cupy.zeros(a.warmup + a.steps, cupy.float32)
    done = 0

    def step():
        nonlocal done
        prod = cupy.matmul(state, weight)
        smooth = cupy.fft.irfft2(cupy.fft.rfft2(prod) * spectrum_filter, s=(n, n))
        mix4((BLOCKS,), (THREADS,), (state, prod, smooth, state, mixed, count))
        block_sum((BLOCKS,), (THREADS,), (mixed, partial, count, np.int32(1)))
        block_sum((1,), (THREADS,), (partial, norms[done:], np.int64(BLOCKS), np.int32(0)))
        normalize((BLOCKS,), (THREADS,), (mixed, norms[done:], state, count))
        done += 1

    seconds, cpu, _ = timed(step, a.warmup, a.steps, cupy.cuda.Device().synchronize, a.marks, a.start_gate, a.turns)
    checksum = hashlib.sha256(state.get().tobytes() + norms.get().tobytes()).hexdigest()
    return Measured(seconds, checksum, cupy_info(cupy), cpu)


def noop_launch(a: argparse.Namespace) -> Measured:
    """`steps` launches of an empty kernel with four pointer arguments, each a direct
    cuLaunchKernel call through ctypes with every argument prebuilt as a ctypes object (no
    argtypes: converting them costs about a microsecond per call), so Python adds only a
    few hundred nanoseconds to the driver's (and libgpuos's) own time.  The launches are
    timed in blocks and ns_per_launch is the best block's: interference from the rest of the
    host (seen as ±10% between runs on a VM) only ever adds time."""
    import ctypes

    import cupy

    bufs = [cupy.random.RandomState(a.seed + i).standard_normal(1024, dtype=cupy.float32)
            for i in range(4)]
    func = cupy.RawModule(code=CUPY_KERNELS).get_function("noop").kernel.ptr  # the CUfunction
    ptrs = [ctypes.c_void_p(b.data.ptr) for b in bufs]
    params = (ctypes.c_void_p * 4)(*(ctypes.addressof(p) for p in ptrs))
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel  # dlsym: libgpuos's wrapper when preloaded
    one, threads, no_shared = ctypes.c_uint(1), ctypes.c_uint(32), ctypes.c_uint(0)
    args = (ctypes.c_void_p(func), one, one, one, threads, one, one, no_shared,
            ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), params, None)
    sync = cupy.cuda.Device().synchronize

    def launches(count: int) -> None:
        for _ in range(count):
            err = launch(*args)
            if err:
                raise RuntimeError(f"cuLaunchKernel failed: CUresult {err}")

    launches(a.warmup)
    sync()
    wait_at_gate(a.start_gate)
    blocks = min(LAUNCH_BLOCKS, a.steps) if a.marks is None else -(-a.steps // STEP_LOG_LAUNCHES)
    mark(a.marks)
    times = []
    for i in range(blocks):
        times.append(timed_block(launches, a.steps // blocks + (i < a.steps % blocks), sync))
        mark(a.marks)
    checksum = hashlib.sha256(b"".join(b.get().tobytes() for b in bufs)).hexdigest()
    best = min(t / n for t, n in times)
    return Measured(sum(t for t, _ in times), checksum, {**cupy_info(cupy), "ns_per_launch": best * 1e9})


def timed_block(launches: Callable[[int], None], n: int, sync: Callable[[], None]) -> tuple[float, int]:
    t0 = time.perf_counter()
    launches(n)
    sync()
    return time.perf_counter() - t0, n


# -- the registry and the command line ----------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    run: Callable[[argparse.Namespace], Measured]
    about: str
    batch: int = 1
    steps: int = 20
    warmup: int = 3


# Cheapest first: a benchmark that runs out of time loses the expensive ones.
WORKLOADS: dict[str, Workload] = {
    "noop-launch": Workload(noop_launch, "launch latency: --steps launches of an empty kernel",
                            steps=100_000, warmup=1_000),
    "cupy": Workload(cupy_suite, "CuPy: RawKernels (elementwise, reduction, pointer list), "
                     "cuBLAS matmul, cuFFT", batch=8, steps=1000, warmup=10),
    "resnet50-infer": Workload(lambda a: resnet(a, training=False),
                               "ResNet-50 inference: bf16 autocast, channels_last", batch=64, steps=100),
    "resnet50-train": Workload(lambda a: resnet(a, training=True),
                               "ResNet-50 training: AdamW, bf16 autocast, channels_last", batch=64),
    "gpt-infer": Workload(gpt_infer, "GPT decoder prefill: next-token logits, bf16 autocast",
                          batch=8, steps=100),
    "gpt-train": Workload(gpt_train, "GPT decoder training: SDPA, AdamW, bf16 autocast, clipping",
                          batch=8),
    "gpt-graphs": Workload(gpt_graphs, "gpt-infer replayed from one CUDA graph", batch=8, steps=100),
    "gpt-compile": Workload(lambda a: gpt_train(a, compiled=True),
                            "gpt-train under torch.compile (Triton); warmup includes the compile",
                            batch=8),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m gpuos.workloads.suite",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("workload", nargs="?", choices=list(WORKLOADS))
    p.add_argument("--list", action="store_true", help="List the workloads and exit.")
    p.add_argument("--steps", type=int, help="Timed steps (noop-launch: launches) [per workload].")
    p.add_argument("--warmup", type=int, help="Untimed steps before them [per workload].")
    p.add_argument("--batch", type=int, help="Items per step [per workload; noop-launch: unused].")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="Print the result as one JSON line.")
    p.add_argument("--exit-code", type=int, default=0, help="Exit with this status after printing.")
    p.add_argument("--step-log", metavar="FILE",
                   help="Write the pid at once and the time and CPU time of every step at the end.")
    p.add_argument("--toggle-recording", type=int, default=0, metavar="K",
                   help="Under `gpuos run`, with --step-log: pause and resume libgpuos's recording of "
                        "this process's operations every K timed steps (the paired benchmark).")
    p.add_argument("--start-gate", metavar="DIR",
                   help="After the warmup, create DIR/ready-PID and wait for DIR/go before the timed "
                        "steps (processes started together then time their steps together).")
    p.add_argument("--turns", nargs=4, metavar=("DIR", "INDEX", "COUNT", "K"),
                   help="Take the GPU in turns of K steps with COUNT-1 other processes (module doc); "
                        "--steps a multiple of K.")
    g = p.add_argument_group("sizes")
    g.add_argument("--image-size", type=int, default=224, help="ResNet input side.")
    g.add_argument("--layers", type=int, default=12, help="GPT blocks.")
    g.add_argument("--d-model", type=int, default=768, help="GPT width.")
    g.add_argument("--heads", type=int, default=12, help="GPT attention heads.")
    g.add_argument("--seq", type=int, default=1024, help="GPT sequence length.")
    g.add_argument("--vocab", type=int, default=32768, help="GPT vocabulary.")
    g.add_argument("--size", type=int, default=1024, help="CuPy matrix side.")
    a = p.parse_args(argv)
    if a.toggle_recording < 0 or (a.toggle_recording and not a.step_log):
        p.error("--toggle-recording K wants K >= 1 and --step-log")
    # the step log's marks, kept by timed()
    a.marks = StepMarks(a.toggle_recording) if a.step_log else None
    a.turns = turns(p, a.turns)
    if a.list:
        return a
    if a.workload is None:
        p.error("a workload is required (--list shows them)")
    w = WORKLOADS[a.workload]
    a.steps = w.steps if a.steps is None else a.steps
    a.warmup = w.warmup if a.warmup is None else a.warmup
    a.batch = w.batch if a.batch is None else a.batch
    if a.steps < 1 or a.warmup < 0 or a.batch < 1:
        p.error("--steps and --batch must be at least 1, --warmup at least 0")
    if a.workload == "gpt-compile" and a.warmup < 1:
        p.error("gpt-compile needs --warmup 1 or more: the first step compiles")
    if a.turns and (a.steps % a.turns.steps or a.start_gate or a.workload == "noop-launch"):
        p.error("--turns wants --steps a multiple of K, no --start-gate, and a workload of steps "
                "(not noop-launch)")
    return a


def turns(p: argparse.ArgumentParser, values: list[str] | None) -> Turns | None:
    if values is None:
        return None
    directory, *numbers = values
    try:
        index, count, steps = (int(x) for x in numbers)
    except ValueError:
        p.error(f"--turns DIR INDEX COUNT K: {' '.join(numbers)} are not all integers")
    if not (0 <= index < count and steps >= 1) or not os.path.isdir(directory):
        p.error("--turns DIR INDEX COUNT K wants an existing DIR, 0 <= INDEX < COUNT and K >= 1")
    return Turns(directory, index, count, steps)


def report(a: argparse.Namespace, m: Measured) -> dict[str, Any]:
    out = {"workload": a.workload, "steps": a.steps, "warmup": a.warmup, "batch": a.batch,
           "seconds": m.seconds, "cpu_s": m.cpu_s, "steps_per_s": a.steps / m.seconds,
           "items_per_s": a.steps * a.batch / m.seconds, "checksum": m.checksum,
           "pid": os.getpid(), **m.info}
    if a.turns:
        out["windows"] = a.turns.windows
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.list:
        for name, w in WORKLOADS.items():
            print(f"{name:15} {w.about}")
        return 0
    # cuBLAS reads this when its first handle is created; without it, it is not deterministic.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if a.step_log:
        with open(a.step_log, "w") as f:
            f.write(json.dumps({"pid": os.getpid()}) + "\n")
    try:
        out = report(a, WORKLOADS[a.workload].run(a))
    except (ToggleError, TurnError) as exc:
        print(f"suite: {exc}", file=sys.stderr, flush=True)
        return 2
    if a.step_log:
        with open(a.step_log, "a") as f:
            f.write(json.dumps({"marks": a.marks.finish()}) + "\n")
    if a.json:
        print(json.dumps(out), flush=True)
    else:
        print(f"{a.workload}: {a.steps} steps in {out['seconds']:.3f} s ({out['steps_per_s']:.2f} "
              f"steps/s, {out['items_per_s']:.1f} items/s) on {out['device']}; "
              f"checksum {out['checksum'][:16]}", flush=True)
    if a.exit_code:
        print(f"suite: exiting with status {a.exit_code} as asked", file=sys.stderr, flush=True)
    return a.exit_code


if __name__ == "__main__":
    sys.exit(main())
