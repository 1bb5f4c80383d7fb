#!/usr/bin/env python3
"""Does GPU memory held outside MPS survive an MPS client's fault?  (issue 20, deliverable 2:
victims keep their GPU state across the fault; GPU host, root or the GPU's user.)

    python3 tools/probes/mps_vmm_probe.py [--mib 1024] [--made-by holder|client] [--out FILE.json]

WHAT IT DOES (--made-by holder, the default)
  holder    a process outside MPS (its own context) makes MIB of device memory with the
            VMM API, exportable as a POSIX fd, fills it with seeded random data and
            hands the fd to whoever asks on a Unix socket
  MPS       a control daemon of this probe's own (private pipe and log directories)
  client A  an MPS client: imports the fd, maps it, checks every byte, writes a marker
            over its first 4 MiB, then keeps the GPU busy on it (memsets, 20 ms apart)
  fault     gpuos-inject --kind oob-write as another MPS client: the server's fatal
            fault takes A down with it (stage 1's finding)
  holder    after the teardown: are the contents still there, marker included?
  client B  a new MPS client, once the server serves again: imports the same fd and
            checks the contents (the state a restarted victim would map back)

With --made-by client, the memory is the MPS client's own instead (what libgpuos's
movable memory is): client A makes it in its MPS context, fills it, exports it as a POSIX
fd and hands the fd to the holder, which imports and maps it in its context outside
MPS.  Then as above: does memory an MPS client made outlive the server's teardown when
a process outside MPS holds it?

Every step's outcome and time go to the JSON: whether an MPS client can import a
handle made outside MPS, how long importing and mapping take, whether the memory and
its contents outlive the server's teardown, and whether a new client can map it again.
Exit 0 when it ran (whatever it found), 1 when the setup failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = 0xA5A5A5A5
MARK_BYTES = 4 << 20
SEED = 20


def ck(result):
    err, rest = result[0], result[1:]
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else (rest if rest else None)


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def cuda_context():
    from cuda.bindings import driver as cu
    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    return cu


def expected(size: int, marked: bool):
    import numpy as np
    data = np.random.default_rng(SEED).integers(0, 2**32, size // 4, dtype=np.uint32)
    if marked:
        data[:MARK_BYTES // 4] = MARK
    return data


def read_back(cu, va: int, size: int):
    import numpy as np
    out = np.empty(size // 4, dtype=np.uint32)
    ck(cu.cuMemcpyDtoH(out.ctypes.data, va, size))
    return out


def access_desc(cu):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


FD_TYPE = "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"


# ---- roles (child processes) ------------------------------------------------------------

def make_filled(cu, size: int) -> tuple[int, int]:
    """Exportable device memory of size bytes, mapped and filled with the seeded data:
    (its address, its POSIX fd)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = getattr(cu.CUmemAllocationHandleType, FD_TYPE)
    va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
    handle = ck(cu.cuMemCreate(size, prop, 0))
    ck(cu.cuMemMap(va, size, 0, handle, 0))
    ck(cu.cuMemSetAccess(va, size, [access_desc(cu)], 1))
    data = expected(size, marked=False)
    ck(cu.cuMemcpyHtoD(va, data.ctypes.data, size))
    ck(cu.cuCtxSynchronize())
    return va, int(ck(cu.cuMemExportToShareableHandle(handle, prop.requestedHandleTypes, 0)))


def import_mapped(cu, fd: int, size: int) -> int:
    h = ck(cu.cuMemImportFromShareableHandle(fd, getattr(cu.CUmemAllocationHandleType, FD_TYPE)))
    va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
    ck(cu.cuMemMap(va, size, 0, h, 0))
    ck(cu.cuMemSetAccess(va, size, [access_desc(cu)], 1))
    return va


def holder(sock_path: str, size: int, made_by: str) -> None:
    """Outside MPS: make, fill and serve the memory (or take it from the client that
    made it: 'take' with its fd); on 'check', compare it."""
    import numpy as np
    cu = cuda_context()
    va = fd = None
    if made_by == "holder":
        va, fd = make_filled(cu, size)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)
    say(role="holder", step="ready", pid=os.getpid(), free=ck(cu.cuMemGetInfo())[0])
    while True:
        conn, _ = srv.accept()
        raw, fds, _, _ = socket.recv_fds(conn, 64, 1)
        req = raw.decode().strip()
        if req == "take" and fds:
            t = time.perf_counter()
            try:
                va, fd = import_mapped(cu, fds[0], size), fds[0]
                reply = {"imported": True, "import_map_s": time.perf_counter() - t}
            except Exception as exc:  # noqa: BLE001 - a measurement: say what failed
                reply = {"imported": False, "error": str(exc)}
            conn.sendall((json.dumps(reply) + "\n").encode())
        elif va is None:
            conn.sendall(b'{"error": "no memory yet"}\n')
        elif req == "fd":
            socket.send_fds(conn, [b"fd\n"], [fd])
        elif req in ("check", "check-marked"):
            t = time.perf_counter()
            got = read_back(cu, va, size)
            want = expected(size, marked=req == "check-marked")
            ok = bool(np.array_equal(got, want))
            conn.sendall((json.dumps({"identical": ok, "read_s": time.perf_counter() - t,
                                      "marked_words": int((got[:MARK_BYTES // 4] == MARK).sum())}) + "\n").encode())
        elif req == "quit":
            conn.close()
            return
        conn.close()


def ask(sock_path: str, req: str) -> tuple[bytes, list[int]]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(sock_path)
    c.sendall(req.encode() + b"\n")
    data, fds, _, _ = socket.recv_fds(c, 4096, 1)
    c.close()
    return data, list(fds)


def client(sock_path: str, size: int, name: str, mark: bool, busy: bool, make: bool) -> None:
    """An MPS client: import, map, check (or, with make, make the memory and hand it to
    the holder); A marks and keeps working until it fails."""
    import numpy as np
    t0 = time.perf_counter()
    try:
        cu = cuda_context()
    except Exception as exc:  # noqa: BLE001 - a measurement: say what failed
        say(role=name, step="context", ok=False, error=str(exc))
        return
    t_ctx = time.perf_counter() - t0
    if make:
        try:
            va, fd = make_filled(cu, size)
        except Exception as exc:  # noqa: BLE001
            say(role=name, step="make", ok=False, error=str(exc), context_s=t_ctx)
            return
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock_path)
        socket.send_fds(c, [b"take\n"], [fd])
        reply = json.loads(c.recv(4096).decode())
        c.close()
        say(role=name, step="made", ok=bool(reply.get("imported")), pid=os.getpid(), context_s=t_ctx,
            holder=reply)
        if not reply.get("imported"):
            return
    else:
        _, fds = ask(sock_path, "fd")
        t = time.perf_counter()
        try:
            va = import_mapped(cu, fds[0], size)
        except Exception as exc:  # noqa: BLE001
            say(role=name, step="import", ok=False, error=str(exc), context_s=t_ctx)
            return
        t_map = time.perf_counter() - t
        os.close(fds[0])
        got = read_back(cu, va, size)
        prior_marked = int((got[:MARK_BYTES // 4] == MARK).sum())
        identical = bool(np.array_equal(got, expected(size, marked=prior_marked == MARK_BYTES // 4)))
        say(role=name, step="mapped", ok=True, pid=os.getpid(), context_s=t_ctx, import_map_s=t_map,
            identical=identical, found_marked=prior_marked == MARK_BYTES // 4)
    if mark:
        ck(cu.cuMemsetD32(va, MARK, MARK_BYTES // 4))
        ck(cu.cuCtxSynchronize())
        say(role=name, step="marked", ok=True)
    n = 0
    while busy:
        try:
            ck(cu.cuMemsetD32(va, MARK, 1024))  # work on the memory that leaves it as it is
            ck(cu.cuCtxSynchronize())
        except Exception as exc:  # noqa: BLE001 - the fault reached this client
            say(role=name, step="failed", iterations=n, error=str(exc))
            return
        n += 1
        time.sleep(0.02)


# ---- the controller -----------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--made-by", choices=("holder", "client"), default="holder",
                    help="who makes the memory: the holder outside MPS, or MPS client A [holder]")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    ap.add_argument("--mark", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    size = a.mib << 20
    if a.role == "holder":
        holder(a.sock, size, a.made_by)
        return 0
    if a.role:
        client(a.sock, size, a.role, a.mark, a.busy, make=a.made_by == "client" and a.role == "A")
        return 0
    return controller(a, size)


def controller(a, size: int) -> int:
    work = Path(tempfile.mkdtemp(prefix="mps-vmm-probe-"))
    sock = str(work / "holder.sock")
    mps_env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(work / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(work / "log"))
    (work / "pipe").mkdir()
    (work / "log").mkdir()
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    out: dict = {"probe": "mps-vmm", "mib": a.mib, "made_by": a.made_by, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": []}
    me = [sys.executable, os.path.abspath(__file__), "--mib", str(a.mib), "--sock", sock, "--made-by", a.made_by]
    procs: list[subprocess.Popen] = []

    def start(role: str, env: dict, *extra: str) -> subprocess.Popen:
        p = subprocess.Popen([*me, "--role", role, *extra], env=env, stdout=subprocess.PIPE, bufsize=0)
        procs.append(p)
        return p

    pending: dict[int, bytes] = {}

    def line(p: subprocess.Popen, timeout: float = 120) -> dict:
        """The role's next line.  Read unbuffered: two lines that arrive together must not
        leave the second in a buffer that select() cannot see."""
        import select
        deadline = time.monotonic() + timeout
        buf = pending.get(p.pid, b"")
        while b"\n" not in buf:
            r, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                pending[p.pid] = buf
                return {"step": "timeout"}
            data = os.read(p.stdout.fileno(), 65536)
            if not data:
                break
            buf += data
        text, _, rest = buf.partition(b"\n")
        pending[p.pid] = rest
        text = text.decode(errors="replace")
        rec = json.loads(text) if text.startswith("{") else {"step": "exited", "returncode": p.poll()}
        out["steps"].append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        return rec

    def check(req: str) -> dict:
        data, _ = ask(sock, req)
        rec = {"role": "holder", "step": req, **json.loads(data.decode())}
        out["steps"].append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        return rec

    try:
        h = start("holder", plain_env)
        if line(h).get("step") != "ready":
            out["error"] = "the holder did not start"
            return 1
        d = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=mps_env, capture_output=True, text=True)
        out["mps_daemon"] = d.returncode
        if d.returncode:
            out["error"] = f"nvidia-cuda-mps-control -d: {d.stderr.strip()}"
            return 1
        ca = start("A", mps_env, "--mark", "--busy")
        out["A_mapped"] = line(ca)
        if not out["A_mapped"].get("ok"):
            out["error"] = "client A could not " + ("make and hand over" if a.made_by == "client" else "map") \
                + " the memory"
            return 0
        out["A_marked"] = line(ca)
        check("check-marked")
        from gpuos.faults.inject import inject_binary
        t = time.time()
        inj = subprocess.run([str(inject_binary()), "--kind", "oob-write", "--json"], env=mps_env,
                             capture_output=True, text=True, timeout=120)
        out["inject"] = {"returncode": inj.returncode, "last": (inj.stdout.strip().splitlines() or [""])[-1]}
        out["A_after_fault"] = line(ca, 30)
        if out["A_after_fault"].get("step") == "timeout":
            ca.kill()  # the fault did not reach it: the server survived
        ca.wait(timeout=30)
        out["A_exit"] = ca.returncode
        out["fault_to_A_failed_s"] = time.time() - t
        out["holder_after_fault"] = check("check-marked")
        t = time.time()
        cb = start("B", mps_env)
        out["B_mapped"] = line(cb, 120)
        out["fault_to_B_mapped_s"] = time.time() - t
        cb.wait(timeout=60)
        out["holder_at_end"] = check("check-marked")
        ask(sock, "quit")
    except Exception as exc:  # noqa: BLE001 - a measurement: say what failed
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=mps_env, capture_output=True, text=True,
                       timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
        logs = {f.name: f.read_text(errors="replace")[-3000:] for f in (work / "log").glob("*.log")}
        out["mps_logs"] = logs
        text = json.dumps(out, indent=1)
        if a.out:
            a.out.write_text(text + "\n")
        print(text)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
