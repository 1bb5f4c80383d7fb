#!/usr/bin/env python3
"""Can a warm standby wait on a second MPS server and take over in milliseconds?  (issue 20,
fast restart; GPU host.)

    python3 tools/probes/mps_two_servers_probe.py [--seconds 5] [--out FILE.json]

WHY
  A standby held at its first cuInit (`gpuos mps run --policy standby`) still builds its
  context, weights and first forward after the fault, and waits for the faulted server
  to come back.  A standby that is already a client of *another* MPS server, with all of
  that done, would need neither.  Before building that, measure:

WHAT IT DOES
  A, B      two MPS control daemons of this probe's own, on the same GPU (private pipe
            and log directories; the compute mode is left as it is)
  client 1  an inference loop on A (python -m gpuos.workloads.mps_client)
            its rate alone, over --seconds
  standby   the same loop on B, held after its first iteration (--hold-file): a context,
            weights and a first forward, then idle; client 1's rate beside it
  fault     gpuos faults inject --kind oob-write on A: client 1 dies with A's clients
  release   1 s after client 1 is gone, the standby is let go: does it still work, and
            how long from the release to its next iteration?  And from the fault?

Everything measured goes to the JSON.  Exit 0 when it ran (whatever it found), 1 when
the setup failed.  Everything it started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuos.mps.control import MpsControl, find_mps_binaries
from gpuos.workloads.mps_client import read_heartbeat
from gpuos.workloads.run import kill_tree


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.005)
    raise TimeoutError(what)


def rate(hb: Path, seconds: float) -> float:
    a = read_heartbeat(hb)
    time.sleep(seconds)
    b = read_heartbeat(hb)
    return (b[1] - a[1]) / (b[0] - a[0])


def gpu_memory(pids: list[int]) -> dict:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
        except ValueError:
            continue
        got[pid] = mib
    return {"by_pid_mib": got, "asked": pids}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default="mps-two-servers-probe.json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="g2s-", dir="/tmp"))
    bins = find_mps_binaries()
    ctl = {k: MpsControl(bins, tmp / k / "pipe", tmp / k / "log", None) for k in ("A", "B")}
    procs: list[subprocess.Popen] = []
    r: dict = {"probe": "mps_two_servers", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        r["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_mode",
                                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        for k, c in ctl.items():
            (tmp / k / "pipe").mkdir(parents=True)
            r[f"daemon_{k}"] = c.start_daemon()

        def client(server: str, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
            hb = tmp / f"{name}.hb"
            p = subprocess.Popen([sys.executable, "-m", "gpuos.workloads.mps_client", "--mode", "infer",
                                  "--heartbeat", str(hb), "--max-seconds", "300", *extra],
                                 env=ctl[server].env(), stdout=open(tmp / f"{name}.log", "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            return p, hb

        c1, hb1 = client("A", "client1")
        wait(lambda: read_heartbeat(hb1), 120, "client 1's first iteration")
        r["client1_alone_it_per_s"] = rate(hb1, a.seconds)
        hold = tmp / "go"
        t = time.time()
        sb, hbs = client("B", "standby", "--hold-file", str(hold))
        wait(lambda: (tmp / "go.ready").exists(), 120, "the standby held")
        r["standby_warm_up_s"] = float((tmp / "go.ready").read_text()) - t
        r["servers"] = {k: c.server_list() for k, c in ctl.items()}
        r["gpu_memory"] = gpu_memory([c1.pid, sb.pid] + [s for v in r["servers"].values() for s in v])
        r["client1_beside_held_standby_it_per_s"] = rate(hb1, a.seconds)

        env_a = ctl["A"].env()
        inj = subprocess.Popen([sys.executable, "-m", "gpuos.cli", "faults", "inject", "--kind", "oob-write",
                                "--json"], env=env_a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
        procs.append(inj)
        t_fault = None
        for line in inj.stdout:
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if o.get("stage") == "armed" and t_fault is None:
                t_fault = time.time()
        inj.wait(timeout=60)
        r["injector_exit"] = inj.returncode
        try:
            wait(lambda: c1.poll() is not None, 30, "client 1 to die")
            r["client1_exit"] = c1.returncode
            r["client1_gone_s"] = time.time() - t_fault
        except TimeoutError:
            r["client1_exit"] = None
        time.sleep(1.0)
        r["standby_alive_after_fault"] = sb.poll() is None
        before = read_heartbeat(hbs)
        t_rel = time.time()
        hold.touch()
        try:
            b = wait(lambda: (x := read_heartbeat(hbs)) and x[1] > before[1] and x, 30, "the standby's iteration")
            r["standby_next_iteration_after_release_s"] = b[0] - t_rel
            r["standby_next_iteration_after_fault_s"] = b[0] - t_fault
            r["standby_rate_after_it_per_s"] = rate(hbs, a.seconds)
            r["standby_survived"] = True
        except TimeoutError:
            r["standby_survived"] = False
            r["standby_exit"] = sb.poll()
        r["standby_log"] = (tmp / "standby.log").read_text()[-1500:]
        r["client1_log"] = (tmp / "client1.log").read_text()[-1500:]
        r["servers_after"] = {k: c.server_list() for k, c in ctl.items()}
    except Exception as exc:  # noqa: BLE001 - a probe: say what broke
        r["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        for c in ctl.values():
            try:
                c.quit(timeout=20)
            except Exception:  # noqa: BLE001
                pass
        Path(a.out).write_text(json.dumps(r, indent=2) + "\n")
        print(json.dumps(r, indent=2))
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main())
