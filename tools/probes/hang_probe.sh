#!/usr/bin/env bash
# Where does `gpuos checkpoint` of a CUDA process hang? A traceback of gpuos after 30 s,
# the target's thread states and wchans (GPU host, root; gpuos and criu installed).
out=${1:?OUT}; shift  # then extra gpuos checkpoint options
python3 "$(dirname "$0")/../../userspace/gpuos/workloads/torchjob.py" --mode train --steps 100000 --step-sleep 0.05 --log /tmp/hp.log </dev/null >/tmp/hp.out 2>&1 &
pid=$!
while [ "$(cat /tmp/hp.log 2>/dev/null | wc -l)" -lt 10 ]; do sleep 0.2; done
GPUOS_HOME=/tmp/hph timeout 45 python3 -c "
import faulthandler, sys; faulthandler.dump_traceback_later(30, exit=False)
from gpuos.cli.main import main; sys.argv=['gpuos','checkpoint','$pid','--image','hp']+'$*'.split(); main()" > $out/gpuos.txt 2>&1 &
g=$!
sleep 28
for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $3}' $t/stat) $(cat $t/wchan) $(cat $t/syscall | cut -c1-40)"; done > $out/threads.txt
ps -eo pid,stat,etime,wchan:30,args | grep -E "criu|gpuos|torchjob" | grep -v grep > $out/ps.txt
wait $g; echo "gpuos rc $?" >> $out/gpuos.txt
cat /tmp/hph/run/*.json >> $out/gpuos.txt 2>/dev/null
ls /tmp/hph/images/.*/criu 2>/dev/null | head >> $out/gpuos.txt; tail -20 /tmp/hph/images/.*/criu/dump.log >> $out/gpuos.txt 2>/dev/null
kill -9 $pid
