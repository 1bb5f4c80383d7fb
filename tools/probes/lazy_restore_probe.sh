#!/bin/bash
# Does CRIU's lazy restore (userfaultfd) work for a CUDA process, and what does it
# change? (GPU host, root; gpuos and torch importable.)
#
#   tools/probes/lazy_restore_probe.sh [ROUNDS]
#
# Per round, twice (plain, then lazy): a PyTorch training process (gpuos's torchjob,
# 0.02 s a step) is checkpointed by `gpuos checkpoint` (stop-the-world, killed) after
# 30 steps, the page cache is dropped, and `gpuos restore` brings it back, plain or
# through a criu wrapper ($GPUOS_CRIU) that starts `criu lazy-pages` for the images
# and adds --lazy-pages. Prints the restore command's time, the time to 5 more steps,
# gpuos's phase timings and the size of CRIU's images.
set -u
ROUNDS=${1:-2}
REAL_CRIU=$(python3 -c "from gpuos.config import find_criu; print(find_criu())") || exit 1
export REAL_CRIU
H=$(mktemp -d /tmp/lazy-probe.XXXXXX)
WRAP=$H/criu-lazy
cat >"$WRAP" <<'W'
#!/bin/bash
if [ "$1" = restore ]; then
  args=("$@"); D=; W=
  for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in -D) D=${args[i+1]} ;; -W) W=${args[i+1]} ;; esac
  done
  mkdir -p "$W"
  setsid "$REAL_CRIU" lazy-pages -D "$D" -W "$W" -o lazy-pages.log -v2 </dev/null >/dev/null 2>&1 &
  sleep 0.3   # its socket, which restore connects to
  exec "$REAL_CRIU" "$@" --lazy-pages
fi
exec "$REAL_CRIU" "$@"
W
chmod +x "$WRAP"

one() {  # one MODE ROUND
  local mode=$1 d=$H/$1-$2 pid n0 t0 t1 t2
  mkdir -p "$d"
  export GPUOS_HOME=$d/home
  python3 -m gpuos.workloads.torchjob --mode train --steps 100000 --step-sleep 0.02 \
      --log "$d/steps.log" >"$d/prog.out" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    [ "$(grep -cs . "$d/steps.log" || true)" -ge 30 ] 2>/dev/null && break
    sleep 0.1
  done
  gpuos checkpoint "$pid" --image img --json >"$d/ckpt.json" 2>"$d/ckpt.err" || { cat "$d/ckpt.err"; return; }
  wait "$pid" 2>/dev/null
  sync; echo 3 >/proc/sys/vm/drop_caches
  n0=$(grep -c . "$d/steps.log"); t0=$(date +%s%N)
  if [ "$mode" = lazy ]; then
    GPUOS_CRIU=$WRAP gpuos restore img --json >"$d/rest.json" 2>"$d/rest.err"
  else
    gpuos restore img --json >"$d/rest.json" 2>"$d/rest.err"
  fi || { cat "$d/rest.err"; return; }
  t1=$(date +%s%N)
  for _ in $(seq 3000); do
    [ "$(grep -c . "$d/steps.log")" -ge $((n0 + 5)) ] && break
    sleep 0.01
  done
  t2=$(date +%s%N)
  echo "$mode: restore_ms=$(( (t1 - t0) / 1000000 )) five_steps_ms=$(( (t2 - t0) / 1000000 ))" \
       "criu_images_mb=$(du -sm "$d/home/images/img/criu" | cut -f1)" \
       "$(python3 -c 'import json,sys; print({k: round(v, 3) for k, v in json.load(open(sys.argv[1]))["timings"].items()})' "$d/rest.json")"
  pkill -f "torchjob.*$d"
  sleep 1
}

for r in $(seq "$ROUNDS"); do
  one plain "$r"
  one lazy "$r"
done
rm -rf "$H"
