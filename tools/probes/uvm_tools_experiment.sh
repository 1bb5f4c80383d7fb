#!/bin/bash
# Issue 20's experiment (docs/notes-uvm-tools.md, "The experiment"): do UVM tools event
# trackers bound to other processes' VA spaces (uvm_tools_probe.py) see a fatal GPU fault,
# and under MPS, in whose tracker does it land: the faulting client's, a victim's, the
# server's? Root on a GPU host with gpuos installed; nothing is changed but an MPS daemon
# of gpuos's own, stopped at the end.
#
#   tools/probes/uvm_tools_experiment.sh OUTDIR
#
# Writes into OUTDIR: self-test.json; control-*.json/txt (the injector alone, no MPS);
# mps-*.json/txt (two victims and the injector as clients of one MPS server).
set -u
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
probe=(python3 "$here/uvm_tools_probe.py")
inject=$(python3 -c 'from gpuos.faults import inject; print(inject.inject_binary())') || exit 2
kmsg() { dmesg --time-format iso 2>/dev/null | grep -iE "NVRM|xid" | tail -40; }

"${probe[@]}" --self-test > "$out/self-test.json" 2>&1
echo "self-test: exit $?"

# 1. Control: the injector alone. Expected: gpu_fault/fatal_fault in its own tracker.
kmsg > "$out/control-kmsg-before.txt"
"$inject" --kind oob-write --after-iterations 0 --json > "$out/control-inject.json" 2>&1 &
I=$!
sleep 5
"${probe[@]}" --pid "$I" --seconds 15 --out "$out/control.json" 2> "$out/control-probe.err" &
P=$!
sleep 3
kill -USR1 "$I"
wait "$P"; echo "control probe: exit $?"
wait "$I"; echo "control injector: exit $?"
kmsg > "$out/control-kmsg.txt"

# 2. Under MPS: victims A and B, the injector I, all clients of one server.
export GPUOS_HOME=${GPUOS_HOME:-/tmp/uvm-experiment-home}
gpuos mps start --gpu 0 --json > "$out/mps-start.json" 2>&1 || { echo "mps start failed"; cat "$out/mps-start.json"; exit 1; }
pipe=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["env"]["CUDA_MPS_PIPE_DIRECTORY"])' "$out/mps-start.json")
logd=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["env"]["CUDA_MPS_LOG_DIRECTORY"])' "$out/mps-start.json")
victims=()
for mode in infer train; do
  gpuos mps run --policy none --json -- python3 -m gpuos.workloads.mps_client --mode $mode \
      --heartbeat "$out/mps-heartbeat-$mode.txt" --max-seconds 60 > "$out/mps-run-$mode.json"
  victims+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$out/mps-run-$mode.json")")
done
CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logd \
  "$inject" --kind oob-write --after-iterations 0 --json > "$out/mps-inject.json" 2>&1 &
I=$!
sleep 10
echo "victims ${victims[*]}, injector $I" | tee "$out/mps-pids.txt"
kmsg > "$out/mps-kmsg-before.txt"
"${probe[@]}" --pid "${victims[0]}" --pid "${victims[1]}" --pid "$I" --mps-servers --seconds 25 \
  --out "$out/mps.json" 2> "$out/mps-probe.err" &
P=$!
sleep 3
kill -USR1 "$I"
wait "$P"; echo "mps probe: exit $?"
wait "$I"; echo "mps injector: exit $?"
kmsg > "$out/mps-kmsg.txt"
sleep 5
gpuos mps status --json > "$out/mps-status.json" 2>&1
cp -r "$GPUOS_HOME/mps" "$out/mps-home" 2>/dev/null
gpuos mps stop --json > "$out/mps-stop.json" 2>&1; echo "mps stop: exit $?"
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
for name in ("control", "mps"):
    p = Path(sys.argv[1]) / f"{name}.json"
    if p.exists():
        print(name, json.dumps(json.loads(p.read_text()).get("summary"), indent=1))
EOF
