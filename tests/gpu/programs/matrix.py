"""The programs of the C/R transparency matrix (tests/gpu/test_cr_matrix.py), one per mode.

    python3 matrix.py MODE --log FILE [--steps N] [--step-sleep S]

Every mode draws seeded random inputs and logs each step's result exactly, so a run
that was checkpointed, killed and restored must log what an uninterrupted run logs.
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from steplog import StepLog, digest, parser  # noqa: E402

MODES = {}


def mode(fn):
    MODES[fn.__name__.replace("_", "-")] = fn
    return fn


def _torch():
    import torch
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    return torch


def _thash(t) -> str:
    return digest(t.detach().contiguous().cpu().numpy().tobytes())


@mode
def torch_compile(args, log):
    """torch.compile training (Inductor, Triton kernels, compile-worker processes)."""
    torch = _torch()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step_fn = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y))
    for step in range(args.steps):
        g = torch.Generator(device="cuda").manual_seed(args.seed * 7919 + step)
        x = torch.randn(128, 256, device="cuda", generator=g)
        y = torch.randint(0, 10, (128,), device="cuda", generator=g)
        loss = step_fn(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.step(step, "loss", loss.item().hex())


@mode
def cuda_graphs(args, log):
    """A captured CUDA graph replayed every step (static input buffer refilled each time)."""
    torch = _torch()
    torch.manual_seed(args.seed)
    w = torch.randn(1024, 1024, device="cuda")
    static_x = torch.zeros(256, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            static_y = torch.tanh(static_x @ w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = torch.tanh(static_x @ w)
    for step in range(args.steps):
        g = torch.Generator(device="cuda").manual_seed(args.seed + step)
        static_x.copy_(torch.randn(256, 1024, device="cuda", generator=g))
        graph.replay()
        w.add_(static_y[:1].T @ static_y[:1] * 1e-4)  # state carried across steps
        log.step(step, "out", _thash(static_y))


@mode
def threads_streams(args, log):
    """Four threads, each on its own CUDA stream, each carrying its own state."""
    torch = _torch()
    results: dict[int, list[str]] = {i: [] for i in range(4)}
    barrier = threading.Barrier(5)

    def worker(i: int) -> None:
        stream = torch.cuda.Stream()
        g = torch.Generator(device="cuda").manual_seed(args.seed + i)
        with torch.cuda.stream(stream):
            state = torch.randn(512, 512, device="cuda", generator=g)
            for step in range(args.steps):
                state = torch.tanh(state @ state.T * 0.01 + 0.1)
                stream.synchronize()
                results[i].append(_thash(state))
                barrier.wait()
                barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for step in range(args.steps):
        barrier.wait()
        log.step(step, "streams", digest("".join(results[i][step] for i in range(4)).encode()))
        barrier.wait()
    for t in threads:
        t.join()


@mode
def dataloader(args, log):
    """PyTorch DataLoader with worker processes and pin_memory feeding a training loop."""
    torch = _torch()
    from torch.utils.data import DataLoader, Dataset

    class Seeded(Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(args.seed * 31 + i)
            return torch.randn(64, generator=g), torch.randint(0, 4, (), generator=g)

    torch.manual_seed(args.seed)
    model = torch.nn.Linear(64, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = iter(DataLoader(Seeded(), batch_size=32, num_workers=2, pin_memory=True,
                             persistent_workers=True))
    for step in range(args.steps):
        x, y = next(loader)
        loss = torch.nn.functional.cross_entropy(model(x.cuda(non_blocking=True)), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.step(step, "loss", loss.item().hex())


@mode
def two_processes(args, log):
    """Two GPU processes in one tree: the parent and a child it started, each computing."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_two_child, args=(args.seed, q_in, q_out))
    child.start()
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    state = torch.randn(256, 256, device="cuda", generator=g)
    for step in range(args.steps):
        q_in.put(step)
        state = torch.tanh(state @ state * 0.01 + 0.5)
        log.step(step, "pair", _thash(state) + "-" + q_out.get())
    q_in.put(None)
    child.join()


def _two_child(seed, q_in, q_out):
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    state = torch.randn(256, 256, device="cuda", generator=g)
    while q_in.get() is not None:
        state = torch.sin(state @ state * 0.01)
        q_out.put(_thash(state))


@mode
def cupy_mix(args, log):
    """CuPy: cuBLAS matmul, elementwise kernels and a RawKernel, from the async memory pool."""
    import cupy as cp
    cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
    scale = cp.RawKernel(r'''
    extern "C" __global__ void scale(float* x, float s, int n) {
        int i = blockDim.x * blockIdx.x + threadIdx.x;
        if (i < n) x[i] = x[i] * s + 0.25f;
    }''', "scale")
    rs = cp.random.RandomState(args.seed)
    state = rs.standard_normal((512, 512), dtype=cp.float32)
    for step in range(args.steps):
        state = cp.tanh(state @ state.T * 0.001)
        scale((state.size // 256,), (256,), (state, cp.float32(0.9), cp.int32(state.size)))
        log.step(step, "cupy", digest(cp.asnumpy(state).tobytes()))


@mode
def vmm(args, log):
    """Device memory from the driver's VMM API (cuMemCreate + cuMemMap at a reserved range),
    written by a cuModuleLoadData kernel (NVRTC PTX) and by copies each step."""
    import numpy as np
    from cuda.bindings import driver as cu, nvrtc

    def ok(res):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA error {err}")
        return rest[0] if len(rest) == 1 else rest

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    src = b'extern "C" __global__ void step(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = x[i] * 0.999f + (float)(i % 7) * 0.001f; }'
    prog = ok(nvrtc.nvrtcCreateProgram(src, b"step.cu", 0, [], []))
    ok(nvrtc.nvrtcCompileProgram(prog, 0, []))
    size = ok(nvrtc.nvrtcGetPTXSize(prog))
    ptx = b" " * size
    ok(nvrtc.nvrtcGetPTX(prog, ptx))
    module = ok(cu.cuModuleLoadData(ptx))
    kernel = ok(cu.cuModuleGetFunction(module, b"step"))

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = ok(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    n = 1 << 22
    nbytes = ((n * 4 + gran - 1) // gran) * gran
    ptr = ok(cu.cuMemAddressReserve(nbytes, 0, 0, 0))
    handle = ok(cu.cuMemCreate(nbytes, prop, 0))
    ok(cu.cuMemMap(ptr, nbytes, 0, handle, 0))
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(ptr, nbytes, [access], 1))
    host = np.random.default_rng(args.seed).standard_normal(n).astype(np.float32)
    ok(cu.cuMemcpyHtoD(ptr, host, n * 4))
    out = np.empty(n, dtype=np.float32)
    for step in range(args.steps):
        arg_ptr = np.array([int(ptr)], dtype=np.uint64)
        arg_n = np.array([n], dtype=np.int32)
        params = np.array([arg_ptr.ctypes.data, arg_n.ctypes.data], dtype=np.uint64)
        ok(cu.cuLaunchKernel(kernel, n // 256, 1, 1, 256, 1, 1, 0, 0, params.ctypes.data, 0))
        ok(cu.cuCtxSynchronize())
        ok(cu.cuMemcpyDtoH(out, ptr, n * 4))
        log.step(step, "vmm", digest(out.tobytes()))


@mode
def hf_generate(args, log):
    """Hugging Face transformers: a GPT-2 with random weights, greedy generate() per step."""
    torch = _torch()
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000)).cuda().eval()
    for step in range(args.steps):
        g = torch.Generator(device="cuda").manual_seed(args.seed + step)
        ids = torch.randint(0, 1000, (2, 8), device="cuda", generator=g)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        log.step(step, "tokens", "-".join(map(str, out[0].tolist())))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("mode", choices=sorted(MODES))
    args = p.parse_args()
    log = StepLog(args)
    MODES[args.mode](args, log)
    log.done()


if __name__ == "__main__":
    sys.exit(main())
