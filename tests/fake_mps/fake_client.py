#!/usr/bin/env python3
"""A fake CUDA program for the fake MPS: connects to the server and "computes" until told.

    fake_client.py --log FILE [--fault-when FILE] [--fault-after S] [--xid N]
                   [--fault-class C] [--stubborn [--ignore-term]] [--exit-after S] [--no-feed]
                   [--cuinit [--launch [--weights]]]

Connects like a CUDA program under MPS: asks the control daemon in
$CUDA_MPS_PIPE_DIRECTORY for a server (the daemon starts one for the first client),
then stays connected, appending "tick N" to --log every 50 ms.  Without a daemon it
runs without MPS ("no-mps"), like a real program.

It faults (a fatal GPU exception) --fault-after S seconds after it starts, or as soon
as the file --fault-when exists (it deletes it: only one client faults for one
file).  A fault: tell the server (which takes every client down), append a fault
event to $FAKE_MPS_FAULT_FEED (JSON, as `gpuos faults watch --json` writes;
--xid, default 31; --fault-class, default: none, gpuos classifies the Xid), exit 1.

When the server takes it down (an "ERR" from the server, the server gone, or
terminate_client) it prints the CUDA error and exits 1; with --stubborn it catches
the error and stays alive, doing nothing, until killed (a program that ignores
errors, which keeps an MPS server from recovering); --ignore-term: SIGTERM too.

With --cuinit it first calls cuInit of the libcuda.so.1 it finds (libgpuos's fake
driver in tests), as a CUDA program does before it becomes an MPS client: a standby
(GPUOS_MPS_STANDBY, libgpuos preloaded) waits there.  With --launch, once connected,
it calls cuLaunchKernel too, as a CUDA program's first kernel: a warm standby
(GPUOS_MPS_STANDBY_AT=launch) waits there, a client of the spare server.  With
--weights, before that launch it allocates 4 MiB and copies in the same bytes in every
process, as a model's weights (what a warm standby may share: libgpuos/src/sharemem.c).

Log lines: "start PID", "cuinit PID", "connected SERVER PID", "launched PID", "tick N",
"fault", "error TEXT", "stubborn", "exit CODE".
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fakemps as F  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--fault-when")
    ap.add_argument("--fault-after", type=float)
    ap.add_argument("--xid", type=int, default=31)
    ap.add_argument("--fault-class")
    ap.add_argument("--stubborn", action="store_true")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--exit-after", type=float)
    ap.add_argument("--no-feed", action="store_true")
    ap.add_argument("--cuinit", action="store_true")
    ap.add_argument("--launch", action="store_true")
    ap.add_argument("--weights", action="store_true")
    args = ap.parse_args()
    log = open(args.log, "a", buffering=1)
    pid = os.getpid()

    def finish(code: int, why: str = "") -> int:
        if why:
            print(why, file=sys.stderr, flush=True)
            log.write(f"error {why}\n")
        log.write(f"exit {code}\n")
        return code

    log.write(f"start {pid}\n")
    cuda = None
    if args.cuinit:
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        rc = cuda.cuInit(0)
        if rc != 0:
            return finish(1, f"CUDA error: cuInit returned {rc}")
        log.write(f"cuinit {pid}\n")
    pipe = F.pipe_dir()
    conn = None
    try:
        answer = F.ask(pipe / "control", f"_fake_connect {pid}")
    except OSError:
        answer = None
        log.write("no-mps\n")
    if answer is not None:
        status, _, text = answer.partition("\n")
        if status != "0":
            return finish(1, "CUDA error: MPS server is not ready to accept new MPS client "
                             "requests (cudaErrorMpsServerNotReady)")
        _, server, path = text.split()
        try:
            conn = F.connect(Path(path))
            conn.sendall(f"HELLO {pid}\n".encode())
            hello = conn.recv(64).decode()
        except OSError as exc:
            return finish(1, f"CUDA error: MPS connection failed ({exc})")
        if not hello.startswith("WELCOME"):
            return finish(1, "CUDA error: MPS server is not ready to accept new MPS client "
                             "requests (cudaErrorMpsServerNotReady)")
        log.write(f"connected {server} {pid}\n")
        conn.setblocking(False)
    if args.launch and cuda is not None:
        import ctypes
        # A kernel of a module, as a CUDA program's first (what a warm standby loads ahead
        # while it waits at that launch); the launch's answer is not ours to judge.
        dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        cuda.cuDeviceGet(ctypes.byref(dev), 0)
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        cuda.cuCtxSetCurrent(ctx)
        if args.weights:
            weights, size = ctypes.c_uint64(), 4 << 20
            data = (ctypes.c_ubyte * size).from_buffer_copy(bytes(range(256)) * (size // 256))
            cuda.cuMemAlloc_v2(ctypes.byref(weights), ctypes.c_size_t(size))
            cuda.cuMemcpyHtoD_v2(weights, data, ctypes.c_size_t(size))
        cuda.cuModuleLoadData(ctypes.byref(mod), b"fake module of fake_client")
        cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"fake_noop")
        cuda.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        log.write(f"launched {pid}\n")
    started = time.monotonic()
    tick = 0
    buf = b""
    while True:
        if args.exit_after is not None and time.monotonic() - started >= args.exit_after:
            if conn is not None:
                try:
                    conn.sendall(b"BYE\n")
                except OSError:
                    pass
            return finish(0)
        fault = args.fault_after is not None and time.monotonic() - started >= args.fault_after
        if args.fault_when:
            try:
                os.unlink(args.fault_when)
                fault = True
            except FileNotFoundError:
                pass
        if fault:
            log.write("fault\n")
            feed = os.environ.get("FAKE_MPS_FAULT_FEED")
            if feed and not args.no_feed:
                ev = {"type": "fault", "xid": args.xid, "pci": "0000:00:06", "time": time.time(),
                      "source": "kmsg", "pid": pid, "process": "python3",
                      "gpu_uuid": os.environ.get("GPUOS_MPS_GPU"),
                      "text": f"NVRM: Xid (PCI:0000:00:06): {args.xid}, pid={pid}, name=python3, "
                              "fake fault"}
                if args.fault_class:
                    ev["fault_class"] = args.fault_class
                with open(feed, "a") as f:
                    f.write(json.dumps(ev) + "\n")
            if conn is not None:
                try:
                    conn.sendall(b"FAULT\n")
                except OSError:
                    pass
            return finish(1, "CUDA error: an illegal memory access was encountered")
        if conn is not None:
            r, _, _ = select.select([conn], [], [], 0.05)
            if r:
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    why = "CUDA error: the MPS server died (cudaErrorMpsRpcFailure)"
                else:
                    buf += data
                    why = None
                    if b"ERR" in buf:
                        why = "CUDA error: an illegal memory access was encountered"
                    elif b"TERMINATED" in buf:
                        why = "CUDA error: MPS client terminated by the server " \
                              "(cudaErrorMpsClientTerminated)"
                if why is not None:
                    if args.stubborn:  # keeps its (dead) connection, as a process keeps its context
                        log.write(f"error {why}\nstubborn\n")
                        if args.ignore_term:
                            signal.signal(signal.SIGTERM, signal.SIG_IGN)
                        while True:
                            time.sleep(1)
                    return finish(1, why)
        else:
            time.sleep(0.05)
        log.write(f"tick {tick}\n")
        tick += 1


if __name__ == "__main__":
    sys.exit(main())
