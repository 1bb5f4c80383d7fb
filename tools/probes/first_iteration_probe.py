#!/usr/bin/env python3
"""What in a warm standby's first iteration could be done while it is held?  (issue 20; GPU host.)

    python3 tools/probes/first_iteration_probe.py [--repeats 3] [--modes infer,train]
                                                  [--variants none,gemm,...] [--out FILE.json]

WHY
  A warm standby (`gpuos mps start --spare-server`) waits at its first kernel launch: its
  context made, its weights copied in.  After its release its first iteration still took
  0.17-0.29 s on an H200 with no fault anywhere (standby_release_probe), against about
  1 ms for the next; that is half of an inference victim's 0.4-0.5 s downtime.  Eager
  module loading made it 2 s worse.  Which part could libgpuos do while the standby is
  held, before the fault: cuBLAS's start (its library, handle and workspace), or the
  first launch of each kernel (lazy loading)?

WHAT IT DOES
  For each variant, in a fresh process and in the benchmark client's shape (the MLP of
  gpuos.workloads.mps_client, weights made on the CPU and copied in, so no kernel has
  run): do the variant's warm-up, then time the client's first iteration (synchronised)
  and its second.  Variants, each a superset of what the one before it did:
  - none: nothing (what a standby does today);
  - cublas: cublasCreate and cublasLtCreate through ctypes, on handles of the probe's
    own (what libgpuos could do in any process that has loaded cuBLAS);
  - torch-handle: torch's own cuBLAS handle and workspace (torch.cuda.current_blas_handle);
  - gemm: cublas, and on that private handle a cublasGemmEx of each of the forward
    pass's shapes (fp32, A transposed, as torch calls it for x @ W^T), on scratch memory;
  - lt-bias: cublas, and on the private cublasLt handle each forward shape as torch's
    Linear runs it (cublasLtMatmul with the bias epilogue, the heuristic's first algorithm);
    with gemm: whether cuBLAS keeps what it unpacks and loads for every handle, so that a
    standby could warm it up with calls of its own while it waits (design.md);
  - gemm-other, lt-other: the same calls in other shapes (every dimension 64, and 4096):
    whether a warm-up must know its client's shapes;
  - same-kernels: one iteration on other tensors of the same shapes (every kernel of the
    iteration loaded: the most any preloading could give).
  Modes infer and train, the order of variants rotated per repeat.

Everything measured goes to the JSON.  Exit 0 when it ran, 1 when a child failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("none", "cublas", "gemm", "lt-bias", "gemm-other", "lt-other", "torch-handle", "same-kernels")


def _loaded(name: str) -> str | None:
    """Path of a loaded shared object whose file name starts with NAME, from our own maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if os.path.basename(path).startswith(name):
                return path
    return None


def _forward_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of each Linear of the model, in order."""
    return [(m.in_features, m.out_features) for m in model if hasattr(m, "in_features")]


def private_gemms(torch, libs: dict, handles: dict, shapes: list[tuple[int, int]], batch: int,
                  lt: bool) -> dict:
    """On the probe's own cuBLAS (or cublasLt) handle, each (in, out) shape as torch's
    Linear calls it: column-major C[out x batch] = W^T . x, fp32; scratch memory from
    torch (allocating launches nothing).  Return codes in the result."""
    c_i, c_u64, c_i64, c_sz = ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    keep, out = [], {}
    for i, (k, m) in enumerate(shapes):
        w = torch.empty(m * k, device="cuda")
        x = torch.empty(k * batch, device="cuda")
        y = torch.empty(m * batch, device="cuda")
        b = torch.empty(m, device="cuda")
        keep += [w, x, y, b]
        if not lt:
            f = libs["cublas"].cublasGemmEx
            rc = f(handles["cublas"], c_i(1), c_i(0), c_i(m), c_i(batch), c_i(k), ctypes.byref(one),
                   c_u64(w.data_ptr()), c_i(0), c_i(k), c_u64(x.data_ptr()), c_i(0), c_i(k),
                   ctypes.byref(zero), c_u64(y.data_ptr()), c_i(0), c_i(m), c_i(68), c_i(-1))
            out[f"gemm{i}_rc"] = rc
            continue
        L = libs["cublasLt"]
        desc = ctypes.c_void_p()
        rcs = [L.cublasLtMatmulDescCreate(ctypes.byref(desc), c_i(68), c_i(0))]
        for attr, val, size in ((3, c_i(1), 4), (4, c_i(0), 4), (7, c_i(4), 4),
                                (8, ctypes.c_void_p(b.data_ptr()), 8)):
            rcs.append(L.cublasLtMatmulDescSetAttribute(desc, c_i(attr), ctypes.byref(val), c_sz(size)))
        lay = []
        for rows, cols, ld in ((k, m, k), (k, batch, k), (m, batch, m)):
            h = ctypes.c_void_p()
            rcs.append(L.cublasLtMatrixLayoutCreate(ctypes.byref(h), c_i(0), c_u64(rows), c_u64(cols), c_i64(ld)))
            lay.append(h)
        pref = ctypes.c_void_p()
        ws_bytes = c_u64(32 << 20)
        ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        keep.append(ws)
        rcs.append(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        rcs.append(L.cublasLtMatmulPreferenceSetAttribute(pref, c_i(1), ctypes.byref(ws_bytes), c_sz(8)))
        result = (ctypes.c_char * 96)()  # cublasLtMatmulHeuristicResult_t: algo (64), size_t, state, waves, int[4]
        found = c_i(0)
        rcs.append(L.cublasLtMatmulAlgoGetHeuristic(handles["cublasLt"], desc, lay[0], lay[1], lay[2], lay[2],
                                                    pref, c_i(1), result, ctypes.byref(found)))
        if found.value:
            rcs.append(L.cublasLtMatmul(handles["cublasLt"], desc, ctypes.byref(one), c_u64(w.data_ptr()), lay[0],
                                        c_u64(x.data_ptr()), lay[1], ctypes.byref(zero), c_u64(y.data_ptr()),
                                        lay[2], c_u64(y.data_ptr()), lay[2], result, c_u64(ws.data_ptr()),
                                        ws_bytes, ctypes.c_void_p(0)))
        out[f"lt{i}_rcs"] = rcs
        out[f"lt{i}_algos"] = found.value
    torch.cuda.synchronize()
    return out


def child(mode: str, variant: str, size: int, batch: int) -> dict:
    t_start = time.perf_counter()
    import torch

    from gpuos.workloads.mps_client import iteration, make_model

    dev = torch.device("cuda")
    torch.manual_seed(1)

    model, opt = make_model(torch, dev, mode, size)  # the benchmark client's
    torch.cuda.synchronize()
    out: dict = {"mode": mode, "variant": variant, "setup_s": time.perf_counter() - t_start,
                 "memory_before_warm": torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]}

    t0 = time.perf_counter()
    if variant != "none":
        handles, libs = {}, {}  # kept alive to the end
        for name, lib, fn in (("cublas", "libcublas.so", "cublasCreate_v2"),
                              ("cublasLt", "libcublasLt.so", "cublasLtCreate")):
            path = _loaded(lib)
            out[f"{lib}_path"] = path
            if path is None:
                continue
            libs[name] = ctypes.CDLL(path)
            h = ctypes.c_void_p()
            rc = getattr(libs[name], fn)(ctypes.byref(h))
            out[f"{fn}_rc"] = rc
            handles[name] = h
        out["cublas_s"] = time.perf_counter() - t0
        if variant in ("gemm", "lt-bias"):
            out |= private_gemms(torch, libs, handles, _forward_shapes(model), batch, variant == "lt-bias")
        if variant in ("gemm-other", "lt-other"):
            for n in (64, 4096):
                out |= {f"{k}_{n}": v for k, v in private_gemms(torch, libs, handles, [(n, n)], n,
                                                                variant == "lt-other").items()}
    if variant in ("torch-handle", "same-kernels"):
        torch.cuda.current_blas_handle()
        torch.cuda.synchronize()
    if variant == "same-kernels":
        iteration(torch, dev, *make_model(torch, dev, mode, size), size, batch)
    out["warm_s"] = time.perf_counter() - t0
    out["memory_after_warm"] = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    t1 = time.perf_counter()
    iteration(torch, dev, model, opt, size, batch)
    out["iter1_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    iteration(torch, dev, model, opt, size, batch)
    out["iter2_s"] = time.perf_counter() - t2
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="infer,train")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset, comma-separated, of "
                    + ", ".join(VARIANTS))
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default="first-iteration-probe.json")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.size, a.batch)), flush=True)
        return 0
    variants = tuple(a.variants.split(","))
    if set(variants) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}")
    runs, failed = [], 0
    for r in range(a.repeats):
        for mode in a.modes.split(","):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                p = subprocess.run([sys.executable, __file__, "--size", str(a.size), "--batch",
                                    str(a.batch), "--child", mode, variant],
                                   capture_output=True, text=True, timeout=120)
                if p.returncode != 0:
                    failed += 1
                    runs.append({"mode": mode, "variant": variant, "repeat": r,
                                 "error": p.stderr.strip().splitlines()[-3:]})
                    continue
                rec = json.loads(p.stdout.strip().splitlines()[-1]) | {"repeat": r}
                runs.append(rec)
                print(f"{mode:5} {variant:13} warm {rec['warm_s']*1e3:7.1f} ms  iter1 "
                      f"{rec['iter1_s']*1e3:7.1f} ms  iter2 {rec['iter2_s']*1e3:6.1f} ms", flush=True)
    summary = {}
    for mode in a.modes.split(","):
        for variant in variants:
            xs = [x for x in runs if x.get("mode") == mode and x.get("variant") == variant
                  and "iter1_s" in x]
            if xs:
                summary[f"{mode}/{variant}"] = {
                    "iter1_median_s": statistics.median(x["iter1_s"] for x in xs),
                    "warm_median_s": statistics.median(x["warm_s"] for x in xs),
                    "memory_added_by_warm": statistics.median(
                        x["memory_after_warm"] - x["memory_before_warm"] for x in xs)}
    import torch
    doc = {"probe": "first-iteration", "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "loading": os.environ.get("CUDA_MODULE_LOADING", "lazy"),
           "size": a.size, "batch": a.batch, "summary": summary, "runs": runs}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
