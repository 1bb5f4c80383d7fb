#!/usr/bin/env bash
# gpu-tests.sh - run gpuos's GPU test suite (and optionally the demo and benchmarks) on a GPU
# host, and collect the results for committing.
#
# Usage: tools/gpu-tests.sh RESULTS_DIR [--bundle DIR] [--demo] [--bench SIZES] [-- PYTEST_ARGS...]
#
#   RESULTS_DIR     where pytest's log and JUnit XML, the demo's output and benchmark JSON go
#   --bundle DIR    first install this offline bundle (tools/bundle.sh): CRIU into /opt/gpuos,
#                   gpuos itself into /tmp/gpuos-site (pip --target; the host's Python and its
#                   torch / cuda-python are used as they are)
#   --demo          also run `gpuos demo`
#   --bench SIZES   also run bench/cr_baseline.py --sizes SIZES (e.g. 1,4,16)
#
# Runs as root. Exits non-zero if any step failed; every step still runs.
set -uo pipefail

usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
results=$1; shift
bundle="" demo=0 bench=""
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --bundle) bundle=$2; shift ;;
    --demo) demo=1 ;;
    --bench) bench=$2; shift ;;
    --) shift; break ;;
    *) echo "gpu-tests.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
mkdir -p "$results"
rc=0
export PYTHONUNBUFFERED=1
if [ -n "$bundle" ]; then
  ./tools/install-bundle.sh "$bundle" --target /tmp/gpuos-site || exit 1
  export PYTHONPATH=/tmp/gpuos-site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/gpuos-site/bin:$PATH
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 -c 'import gpuos, sys; print("gpuos", gpuos.__version__, gpuos.__file__, sys.version.split()[0])'
  /opt/gpuos/bin/criu --version | head -1; date -u +%FT%TZ; } | tee "$results/host.txt"
python3 -m pytest tests -v -m "gpu or criu" -p no:cacheprovider --junitxml="$results/pytest.xml" "$@" \
  2>&1 | tee "$results/pytest.log" || rc=1
if [ $demo = 1 ]; then
  python3 -m gpuos.cli demo 2>&1 | tee "$results/demo.txt" || rc=1
fi
if [ -n "$bench" ]; then
  python3 bench/cr_baseline.py --sizes "$bench" --out "$results" 2>&1 | tee "$results/bench.txt" || rc=1
fi
exit $rc
