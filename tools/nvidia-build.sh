#!/usr/bin/env bash
# Build NVIDIA's open kernel modules with the gpuos patches (patches/series) against
# Debian's packaged kernel headers, and check what the patched nvidia-uvm.ko links.
#
# Usage: tools/nvidia-build.sh [--cache DIR] [--kver VER] [--all] [--jobs N] [--clean]
#   --cache DIR  cache directory (default $GPUOS_NVIDIA_CACHE or /var/cache/gpuos-nvidia)
#   --kver VER   kernel ABI, e.g. 6.1.0-56 (default: what linux-headers-amd64 depends on)
#   --all        every module of the tree (nvidia-modeset, nvidia-drm, nvidia-peermem
#                too); default: nvidia.ko (links the shipped RM blob) and nvidia-uvm.ko
#   --jobs N     make -j (default: number of CPUs)
#   --clean      start from an empty build directory (a cold build)
#
# Steps: tools/nvidia-src.sh (fetch, verify, patch); sync the patched tree into
# $CACHE/build-<kver>-{core,all}/ (only changed files are touched, so make
# rebuilds only what changed); make modules SYSSRC=<headers>-common SYSOUT=<headers>-amd64 (through
# ccache if installed); fail on a build error or on any compiler warning in a file
# the patches touch; then check nvidia-uvm.ko with modinfo and nm:
#   - no "depends: gpuos", no undefined gpuos_* symbol (gpuos.ko is optional: bound
#     at run time with symbol_get), __symbol_get/__symbol_put imported, and the
#     names symbol_get looks up present;
#   - the patches' functions, parameters and ioctl handler present.
# Prints the built modules' directory as the last line of stdout; the build log is
# $CACHE/build-<kver>-{core,all}/gpuos-build.log.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GPUOS_NVIDIA_CACHE:-/var/cache/gpuos-nvidia}
KVER=${GPUOS_NVIDIA_KVER:-}
MODULES="nvidia nvidia-uvm"
JOBS=$(nproc)
CLEAN=0

while [ $# -gt 0 ]; do
    case $1 in
        --cache) CACHE=$2; shift 2 ;;
        --kver) KVER=$2; shift 2 ;;
        --all) MODULES=""; shift ;;
        --jobs) JOBS=$2; shift 2 ;;
        --clean) CLEAN=1; shift ;;
        -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "nvidia-build: unknown argument $1" >&2; exit 2 ;;
    esac
done

log() { echo "nvidia-build: $*" >&2; }
die() { echo "nvidia-build: error: $*" >&2; exit 1; }
T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# Debian's headers: linux-headers-amd64 depends on linux-headers-<abi>-amd64.
if [ -z "$KVER" ]; then
    dep=$(dpkg-query -W -f='${Depends}' linux-headers-amd64 2>/dev/null) ||
        die "linux-headers-amd64 is not installed (or pass --kver)"
    KVER=$(sed -n 's/.*linux-headers-\([0-9][^ ,]*\)-amd64.*/\1/p' <<<"$dep")
    [ -n "$KVER" ] || die "cannot read the kernel ABI from linux-headers-amd64's Depends: $dep"
fi
KVER=${KVER%-amd64}
SYSSRC=/usr/src/linux-headers-$KVER-common
SYSOUT=/usr/src/linux-headers-$KVER-amd64
[ -d "$SYSSRC" ] && [ -d "$SYSOUT" ] || die "headers for $KVER missing: $SYSSRC, $SYSOUT"

TREE=$(GPUOS_NVIDIA_CACHE=$CACHE "$ROOT/tools/nvidia-src.sh" --cache "$CACHE")
# One build directory per module set: conftest results are generated for the modules
# being built, and a directory built for fewer modules lacks the others' results.
BUILD=$CACHE/build-$KVER-${MODULES:+core}
[ -n "$MODULES" ] || BUILD=${BUILD}all
LOG=$BUILD/gpuos-build.log

exec 8>"$CACHE/.build.lock"
flock 8

if [ "$CLEAN" = 1 ]; then
    rm -rf "$BUILD"
fi
mkdir -p "$BUILD"

# Make the build directory's sources equal to the tree's; a file whose content
# changed gets a fresh mtime, so make rebuilds exactly what depends on it.
python3 - "$TREE" "$BUILD" <<'EOF'
import filecmp, os, shutil, sys
tree, build = sys.argv[1], sys.argv[2]
manifest = os.path.join(build, ".gpuos-sources")
old = set()
if os.path.exists(manifest):
    old = set(open(manifest).read().split("\n")) - {""}
new = set()
for dirpath, dirnames, filenames in os.walk(tree):
    for name in filenames:
        src = os.path.join(dirpath, name)
        rel = os.path.relpath(src, tree)
        new.add(rel)
        dst = os.path.join(build, rel)
        if os.path.exists(dst) and filecmp.cmp(src, dst, shallow=False):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        os.utime(dst)   # newer than any object built from the old content
for rel in old - new:
    try:
        os.remove(os.path.join(build, rel))
    except FileNotFoundError:
        pass
with open(manifest + ".tmp", "w") as f:
    f.write("\n".join(sorted(new)) + "\n")
os.replace(manifest + ".tmp", manifest)
EOF

MAKE_ARGS=(modules -j"$JOBS" SYSSRC="$SYSSRC" SYSOUT="$SYSOUT")
if [ -n "$MODULES" ]; then
    MAKE_ARGS+=(NV_KERNEL_MODULES="$MODULES")
fi
if command -v ccache >/dev/null; then
    # The Makefile would pick the compiler from CONFIG_CC_VERSION_TEXT; name it.
    cc=$(. "$SYSOUT/.config" && echo "${CONFIG_CC_VERSION_TEXT%% *}")
    command -v "$cc" >/dev/null || cc=gcc
    MAKE_ARGS+=(CC="ccache $cc")
    log "using ccache ($cc)"
fi

log "building ${MODULES:-all modules} for $KVER in $BUILD (make -j$JOBS)"
set +e
make -C "$BUILD" "${MAKE_ARGS[@]}" >"$LOG" 2>&1
rc=$?
set -e
if [ $rc -ne 0 ]; then
    grep -E '(error|Error)' "$LOG" | grep -v -E 'CONFTEST|CFLAGS=|-Werror' | tail -20 >&2 || true
    die "make failed ($rc); log: $LOG"
fi

# Warnings in what the patches touch (and the headers they bring) fail the build.
# The unpatched 550.163.01 tree builds without a single compiler warning against
# these headers, so any warning there is new.
mapfile -t PATCHED < <(
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$ROOT/patches/series" |
    while read -r p _; do sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$ROOT/patches/$p"; done | sort -u
)
warnings=$(grep -E '^[^ ]+:[0-9]+:[0-9]+: warning:' "$LOG" | sed "s|^$BUILD/||" | sort -u || true)
bad=""
while IFS= read -r w; do
    [ -n "$w" ] || continue
    f=${w%%:*}
    for p in "${PATCHED[@]}" nvidia-uvm/gpuos/; do
        case $f in "$p"|"$p"*) bad+="$w"$'\n'; break ;; esac
    done
done <<<"$warnings"
if [ -n "$bad" ]; then
    printf '%s' "$bad" >&2
    die "compiler warnings in patched files (log: $LOG)"
fi
other=$(grep -c . <<<"$warnings" || true)
[ "$other" = 0 ] || log "note: $other compiler warning(s) in files the patches do not touch"

# What nvidia-uvm.ko links: gpuos.ko must stay optional.
UVM=$BUILD/nvidia-uvm.ko
[ -f "$UVM" ] || die "no nvidia-uvm.ko"
fail() { echo "nvidia-build: check failed: $*" >&2; FAILED=1; }
FAILED=0
depends=$(modinfo -F depends "$UVM")
case ",$depends," in *,gpuos,*) fail "nvidia-uvm.ko depends on gpuos (depends: $depends)" ;; esac
vermagic=$(modinfo -F vermagic "$UVM")
case $vermagic in "$KVER-amd64 "*) ;; *) fail "vermagic '$vermagic' is not for $KVER-amd64" ;; esac
undefined=$(nm -u "$UVM" | awk '{ print $2 }')
if grep -q '^gpuos_' <<<"$undefined"; then
    fail "nvidia-uvm.ko has undefined gpuos symbols: $(grep '^gpuos_' <<<"$undefined" | tr '\n' ' ')"
fi
for s in __symbol_get __symbol_put; do
    grep -qx "$s" <<<"$undefined" || fail "nvidia-uvm.ko does not import $s"
done
# The names symbol_get looks up, as strings in the module's data (not its debug info).
stripped=$(mktemp)
objcopy --strip-debug "$UVM" "$stripped"
names=$(strings -a "$stripped")
rm -f "$stripped"
for s in gpuos_register_driver gpuos_unregister_driver gpuos_report_fault gpuos_batch_done gpuos_report_fault_batch; do
    grep -qx "$s" <<<"$names" || fail "no symbol_get name $s in nvidia-uvm.ko"
done
defined=$(nm --defined-only "$UVM" | awk '{ print $3 }')
for s in uvm_gpuos_init uvm_gpuos_exit uvm_gpuos_va_space_init uvm_gpuos_fatal_faults uvm_gpuos_batch_parked_only \
         uvm_gpuos_fault_batch_serviced uvm_api_gpuos_migrate_ranges uvm_migrate_gpuos \
         uvm_pmm_gpu_mark_root_chunk_evict_first; do
    grep -qx "$s" <<<"$defined" || fail "nvidia-uvm.ko lacks $s"
done
params=$(modinfo -F parm "$UVM" | cut -d: -f1)
for p in uvm_gpuos_attach uvm_gpuos_isolate uvm_gpuos_batch_notify_us; do
    grep -qx "$p" <<<"$params" || fail "nvidia-uvm.ko lacks parameter $p"
done
if [ -z "$MODULES" ] || [[ " $MODULES " == *" nvidia "* ]]; then
    [ -f "$BUILD/nvidia.ko" ] || fail "no nvidia.ko"
fi
[ "$FAILED" = 0 ] || die "nvidia-uvm.ko is not what the patches should produce"

log "ok in $(elapsed) s: $(cd "$BUILD" && ls -1 ./*.ko | sed 's|^\./||' | tr '\n' ' ')"
log "nvidia-uvm.ko: depends '$depends', imports __symbol_get/__symbol_put, no gpuos symbol linked"
echo "$BUILD"
