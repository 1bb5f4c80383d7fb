#!/usr/bin/env python3
"""Which of a PyTorch client's first operations has the driver allocate RM objects?  (issue 20; GPU host.)

    gcc -shared -fPIC -O2 -o /tmp/rm_alloc_shim.so tools/probes/rm_alloc_shim.c -ldl
    LD_PRELOAD=/tmp/rm_alloc_shim.so python3 tools/probes/rm_alloc_probe.py [--variant V] 2> LOG

WHY
  A released warm standby's first kernel launch has the driver allocate host memory
  (RM_ALLOC_MEMORY of class 0x71, an OS descriptor: bench/kwait.py's user frames on an
  H200), and that allocation waits for the driver's lock, which the faulting client's
  teardown holds for up to 0.45 s.  A kernel of libgpuos's own on the legacy stream before
  the fault did not take it off the path.  Which first use is it?

WHAT IT DOES
  In the benchmark client's shape (gpuos.workloads.mps_client's MLP, weights made on the
  CPU and copied in), writes a marker to stderr before and after each step, each step
  synchronised; the shim (rm_alloc_shim.c) writes every RM allocation between them.
  Variants: main (every step on the main thread), thread (a first tiny launch on another
  thread, then the rest on the main thread, as a standby's loader thread does), launches
  (before the model, kernels of the probe's own: parameter blocks of growing size, then
  dynamic shared memory of growing size, local memory, then a kernel that can printf and
  one that can assert, neither reaching the call), reduction (a small torch.mean first).

WHAT IT FOUND (H200, driver 580.159, 2026-11-28: bench/results/rm-alloc-probe-H200-2026-11-28/)
  Two OS-descriptor allocations (about 1 and 4 ms) in the client's first iteration, at its
  first cuBLAS call and its first reduction, on the main thread or another, with MPS or
  without, with lazy or eager module loading.  No parameter block size, dynamic shared
  memory or local memory made them; a module with a kernel that can printf made them (one
  at its load, one at the kernel's first launch), after which the client's iterations made
  none: the context's printf buffer, which CUDA's device-side asserts (PyTorch's
  reductions) need too.  libgpuos's warm standbys now have it made while they wait
  (preload.c ready_printf_buffer).
"""
import argparse
import os
import threading


def mark(what: str) -> None:
    os.write(2, f"== {what}\n".encode())


PARAM_SIZES = (16, 256, 1024, 2048, 4096, 8192, 16384, 32000)
SHARED_SIZES = (1024, 8192, 32768)
LOCAL_SIZES = (64, 1024, 16384)


def own_launches() -> None:
    """Kernels that do nothing, with a parameter block of each size, then with dynamic
    shared memory of each size: each launched once on the legacy stream (torch's context)."""
    import ctypes

    from cuda.bindings import driver as cu  # type: ignore[import-not-found]

    def check(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error: {result[0]}")
        return result[1] if len(result) > 1 else None

    ptx = ".version 8.5\n.target sm_90\n.address_size 64\n"
    for n in PARAM_SIZES:
        ptx += f".visible .entry p{n}(.param .align 8 .b8 a[{n}])\n{{\n ret;\n}}\n"
    mod = check(cu.cuModuleLoadData(ptx.encode() + b"\0"))
    for n in PARAM_SIZES:
        fn = check(cu.cuModuleGetFunction(mod, f"p{n}".encode()))
        buf = ctypes.create_string_buffer(n)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        mark(f"launch with {n} bytes of parameters")
        check(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, ctypes.addressof(args), 0))
        check(cu.cuCtxSynchronize())
    fn = check(cu.cuModuleGetFunction(mod, b"p16"))
    buf = ctypes.create_string_buffer(16)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    for s in SHARED_SIZES:
        mark(f"launch with {s} bytes of dynamic shared memory")
        if s > 48 * 1024:
            check(cu.cuFuncSetAttribute(
                fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, s))
        check(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, s, 0, ctypes.addressof(args), 0))
        check(cu.cuCtxSynchronize())
    lptx = ".version 8.5\n.target sm_90\n.address_size 64\n"
    for n in LOCAL_SIZES:  # stored at one index, loaded at another: kept in local memory
        lptx += (f".visible .entry l{n}(.param .u64 out, .param .u32 i, .param .u32 j)\n{{\n"
                 f" .local .align 8 .b8 buf[{n}];\n .reg .u32 r<4>;\n .reg .u64 a<5>;\n"
                 " ld.param.u64 a3, [out];\n ld.param.u32 r1, [i];\n ld.param.u32 r3, [j];\n"
                 " mov.u64 a1, buf;\n cvt.u64.u32 a2, r1;\n add.u64 a2, a1, a2;\n"
                 " st.local.u32 [a2], r1;\n cvt.u64.u32 a4, r3;\n add.u64 a4, a1, a4;\n"
                 " ld.local.u32 r2, [a4];\n st.global.u32 [a3], r2;\n ret;\n}\n")
    lmod = check(cu.cuModuleLoadData(lptx.encode() + b"\0"))
    out = ctypes.c_uint64(int(check(cu.cuMemAlloc(64))))
    i, j = ctypes.c_uint32(8), ctypes.c_uint32(16)
    largs = (ctypes.c_void_p * 3)(ctypes.addressof(out), ctypes.addressof(i), ctypes.addressof(j))
    for n in LOCAL_SIZES:
        lfn = check(cu.cuModuleGetFunction(lmod, f"l{n}".encode()))
        local = check(cu.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, lfn))
        mark(f"launch with {n} bytes of local memory per thread (the function's: {local})")
        check(cu.cuLaunchKernel(lfn, 132, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(largs), 0))
        check(cu.cuCtxSynchronize())
    # printf and assert, in a branch never taken: does a function that can print or assert
    # have the driver set up host memory for it at its first launch?
    fptx = (".version 8.5\n.target sm_90\n.address_size 64\n"
            ".extern .func (.param .b32 r) vprintf (.param .b64 f, .param .b64 a);\n"
            ".extern .func __assertfail (.param .b64 m, .param .b64 f, .param .b32 l, "
            ".param .b64 fn, .param .b64 cs);\n"
            ".global .align 1 .b8 msg[4] = {104, 105, 10, 0};\n"
            ".visible .entry with_printf(.param .u32 go)\n{\n .reg .pred p;\n .reg .u32 g;\n"
            " .reg .b64 m;\n ld.param.u32 g, [go];\n setp.eq.u32 p, g, 0;\n @p bra done;\n"
            " cvta.global.u64 m, msg;\n { .param .b64 f0; .param .b64 a0; .param .b32 r0;\n"
            "   st.param.b64 [f0], m;\n st.param.b64 [a0], 0;\n"
            "   call.uni (r0), vprintf, (f0, a0); }\n done:\n ret;\n}\n"
            ".visible .entry with_assert(.param .u32 go)\n{\n .reg .pred p;\n .reg .u32 g;\n"
            " .reg .b64 m;\n ld.param.u32 g, [go];\n setp.eq.u32 p, g, 0;\n @p bra done;\n"
            " cvta.global.u64 m, msg;\n { .param .b64 m0; .param .b64 f0; .param .b32 l0;"
            " .param .b64 n0; .param .b64 c0;\n"
            "   st.param.b64 [m0], m;\n st.param.b64 [f0], m;\n st.param.b32 [l0], 1;\n"
            "   st.param.b64 [n0], m;\n st.param.b64 [c0], 1;\n"
            "   call.uni __assertfail, (m0, f0, l0, n0, c0); }\n done:\n ret;\n}\n")
    fmod = check(cu.cuModuleLoadData(fptx.encode() + b"\0"))
    go = ctypes.c_uint32(0)
    gargs = (ctypes.c_void_p * 1)(ctypes.addressof(go))
    for name in ("with_printf", "with_assert"):
        ffn = check(cu.cuModuleGetFunction(fmod, name.encode()))
        mark(f"launch of a kernel {name.replace('_', ' ')} (not reached)")
        check(cu.cuLaunchKernel(ffn, 1, 1, 1, 32, 1, 1, 0, 0, ctypes.addressof(gargs), 0))
        check(cu.cuCtxSynchronize())
    mark("launch with 1024 blocks")
    check(cu.cuLaunchKernel(fn, 1024, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(args), 0))
    check(cu.cuCtxSynchronize())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="main", choices=["main", "thread", "launches", "reduction"])
    ap.add_argument("--size", type=int, default=8192)
    args = ap.parse_args()
    import torch
    from gpuos.workloads import mps_client

    dev = torch.device("cuda")
    mark("init")
    torch.cuda.init()
    torch.cuda.synchronize()
    if args.variant == "thread":
        def tiny():
            mark("thread: first launch")
            torch.zeros(1, device=dev)
            torch.cuda.synchronize()
            mark("thread: done")
        t = threading.Thread(target=tiny)
        t.start()
        t.join()
    if args.variant == "launches":
        own_launches()
    if args.variant == "reduction":
        mark("small mean")
        torch.zeros(4, 4, device=dev).mean()
        torch.cuda.synchronize()
    mark("model")
    model, opt = mps_client.make_model(torch, dev, "train", args.size)
    torch.cuda.synchronize()
    for it in range(3):
        mark(f"iteration {it}: randn")
        x = torch.randn(64, args.size, device=dev)
        y = torch.randn(64, 16, device=dev)
        torch.cuda.synchronize()
        mark(f"iteration {it}: forward")
        out = model(x)
        torch.cuda.synchronize()
        mark(f"iteration {it}: loss")
        loss = torch.nn.functional.mse_loss(out, y)
        torch.cuda.synchronize()
        mark(f"iteration {it}: backward")
        opt.zero_grad()
        loss.backward()
        torch.cuda.synchronize()
        mark(f"iteration {it}: step")
        opt.step()
        torch.cuda.synchronize()
    mark("end")


if __name__ == "__main__":
    main()
