#!/usr/bin/env bash
# Build nvidia-uvm.ko from NVIDIA's open kernel modules with the gpuos patches
# (patches/series) against Debian's packaged kernel headers, and check what it links.
#
# Usage: tools/nvidia-build.sh [--cache DIR] [--kver VER] [--jobs N] [--clean]
#   --cache DIR  cache directory (default $GPUOS_NVIDIA_CACHE or /var/cache/gpuos-nvidia)
#   --kver VER   kernel ABI, e.g. 6.1.0-56 (default: what linux-headers-amd64 depends on)
#   --jobs N     make -j (default: number of CPUs)
#   --clean      start from an empty build directory (a cold build)
# The source comes from tools/nvidia-src.sh (its environment applies:
# GPUOS_NVIDIA_TARBALL, GPUOS_NVIDIA_VENDOR, ...).
#
# Only nvidia-uvm.ko is built.  The source is the kernel-open/ tree of NVIDIA's
# open-gpu-kernel-modules (the pinned tag, verified by nvidia-src.sh); it has no
# src/, the OS-agnostic resource manager whose compiled form, nv-kernel.o_binary,
# is the core of nvidia.ko, so nvidia.ko cannot be linked from it.  nvidia-uvm.ko
# has no such binary part, and it is what the patches change.
#
# How: nvidia-uvm's objects include the common headers, whose conftests are
# registered by nvidia/nvidia.Kbuild, which a build of nvidia-uvm alone does not
# read.  So the build directory (not the patched tree) gets
# nvidia-conftests/nvidia-conftests.Kbuild: the NV_CONFTEST lines of
# nvidia/nvidia.Kbuild (no obj-m: it builds nothing), and the build is
#   make modules -jN SYSSRC=/usr/src/linux-headers-<abi>-common
#        SYSOUT=/usr/src/linux-headers-<abi>-amd64
#        NV_KERNEL_MODULES="nvidia-conftests nvidia-uvm" KBUILD_MODPOST_WARN=1
# (through ccache if installed).  modpost only warns that nvidia.ko's symbols are
# undefined, since nvidia.ko is not built; this script checks them instead: every
# undefined symbol of nvidia-uvm.ko must be exported by the kernel (the headers'
# Module.symvers) or by nvidia.ko's sources in the same tree (EXPORT_SYMBOL,
# EXPORT_SYMBOL_GPL or NV_EXPORT_SYMBOL in the files nvidia/nvidia-sources.Kbuild
# lists, or in a header of nvidia/ or common/).
#
# Steps: tools/nvidia-src.sh (fetch, verify, patch); sync the patched tree into
# $CACHE/build-<kver>-uvm/ (only changed files are touched, so make rebuilds only
# what changed); make; fail on a build error or on any compiler warning in a file
# the patches touch (the unpatched tree builds without a single warning against
# Debian bookworm's 6.1 headers, so any warning is new; others are counted); then
# check nvidia-uvm.ko with nm and modinfo:
#   - its undefined symbols, as above;
#   - no "depends: gpuos", no undefined gpuos_* symbol (gpuos.ko is optional: bound
#     at run time with symbol_get), __symbol_get/__symbol_put imported, and the
#     names symbol_get looks up present; the vermagic of the headers;
#   - the functions and module parameters the patches add (the lists below).
# Prints the build directory (nvidia-uvm.ko is in it) as the last line of stdout;
# the build log is $CACHE/build-<kver>-uvm/gpuos-build.log.
set -euo pipefail

# What the patches add to nvidia-uvm.ko, checked after the build.  Extend these as
# patches land (patches/series).
EXPECT_FUNCTIONS=(      # defined functions
    uvm_gpuos_init uvm_gpuos_exit uvm_gpuos_va_space_init uvm_gpuos_va_space_destroy
    gpuos_bind_init gpuos_bind_exit gpuos_bind_report_fault
    uvm_gpuos_fault_batch_serviced gpuos_report_add_fault
    uvm_api_gpuos_migrate_ranges uvm_migrate_gpuos uvm_pmm_gpu_mark_root_chunk_evict_first
    uvm_gpuos_prefetch_pages gpuos_prefetch_clip
    uvm_gpuos_contain_fatal_faults uvm_parent_gpu_fault_entry_shares_tsg
    uvm_va_range_create_gpuos_scratch gpuos_iso_check
)
EXPECT_SYMBOL_GET=(     # names looked up with symbol_get() (strings in the module's data)
    gpuos_register_driver gpuos_unregister_driver gpuos_report_fault gpuos_batch_done
    gpuos_report_fault_batch gpuos_address_space_gone gpuos_prefetch_lookup
)
EXPECT_PARAMS=(         # module parameters
    uvm_gpuos_attach uvm_gpuos_batch_notify_us uvm_gpuos_prefetch
    uvm_gpuos_isolate uvm_gpuos_isolate_ms uvm_gpuos_isolate_max_kb
)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GPUOS_NVIDIA_CACHE:-/var/cache/gpuos-nvidia}
KVER=${GPUOS_NVIDIA_KVER:-}
JOBS=$(nproc)
CLEAN=0

while [ $# -gt 0 ]; do
    case $1 in
        --cache|--kver|--jobs)
            if [ $# -lt 2 ] || [ -z "$2" ]; then echo "nvidia-build: $1 needs a value" >&2; exit 2; fi
            case $1 in
                --cache) CACHE=$2 ;;
                --kver) KVER=$2 ;;
                --jobs) JOBS=$2 ;;
            esac
            shift 2 ;;
        --clean) CLEAN=1; shift ;;
        --all) echo "nvidia-build: --all is gone: only nvidia-uvm.ko can be built (see --help)" >&2; exit 2 ;;
        -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "nvidia-build: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "nvidia-build: $*" >&2; }
die() { echo "nvidia-build: error: $*" >&2; exit 1; }
T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "--jobs needs a positive number, not '$JOBS'"
for tool in make python3 nm modinfo objcopy strings; do
    command -v "$tool" >/dev/null || die "$tool is not installed"
done

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
if [ ! -d "$SYSSRC" ] || [ ! -d "$SYSOUT" ]; then
    die "headers for $KVER missing: $SYSSRC, $SYSOUT"
fi
[ -f "$SYSOUT/Module.symvers" ] || die "no $SYSOUT/Module.symvers"

TREE=$("$ROOT/tools/nvidia-src.sh" --cache "$CACHE" | tail -n 1) || die "tools/nvidia-src.sh failed"
[ -f "$TREE/nvidia-uvm/nvidia-uvm.Kbuild" ] || die "$TREE is not a kernel-open tree"
BUILD=$CACHE/build-$KVER-uvm
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

# The common headers' conftests, registered without building nvidia.ko (written only
# when it changes, so that make sees no change otherwise).
conftests=$(grep -E '^NV_CONFTEST' "$BUILD/nvidia/nvidia.Kbuild") ||
    die "no NV_CONFTEST lines in nvidia/nvidia.Kbuild"
mkdir -p "$BUILD/nvidia-conftests"
if [ "$(cat "$BUILD/nvidia-conftests/nvidia-conftests.Kbuild" 2>/dev/null)" != "$conftests" ]; then
    printf '%s\n' "$conftests" >"$BUILD/nvidia-conftests/nvidia-conftests.Kbuild"
fi

MAKE_ARGS=(modules -j"$JOBS" SYSSRC="$SYSSRC" SYSOUT="$SYSOUT"
           NV_KERNEL_MODULES="nvidia-conftests nvidia-uvm" KBUILD_MODPOST_WARN=1)
if command -v ccache >/dev/null; then
    # The Makefile would pick the compiler from CONFIG_CC_VERSION_TEXT; name it.
    # shellcheck source=/dev/null
    cc=$(. "$SYSOUT/.config" && echo "${CONFIG_CC_VERSION_TEXT%% *}")
    command -v "$cc" >/dev/null || cc=gcc
    MAKE_ARGS+=(CC="ccache $cc")
    log "using ccache ($cc)"
fi

log "building nvidia-uvm.ko for $KVER in $BUILD (make -j$JOBS)"
set +e
make -C "$BUILD" "${MAKE_ARGS[@]}" >"$LOG" 2>&1
rc=$?
set -e
if [ $rc -ne 0 ]; then
    grep -E '(error|Error)' "$LOG" | grep -v -E 'CONFTEST|CFLAGS=|-Werror' | tail -20 >&2 || true
    die "make failed ($rc); log: $LOG"
fi

# Warnings in what the patches touch (and the headers they bring) fail the build.
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

UVM=$BUILD/nvidia-uvm.ko
[ -f "$UVM" ] || die "make succeeded but left no nvidia-uvm.ko (log: $LOG)"
fail() { echo "nvidia-build: check failed: $*" >&2; FAILED=1; }
FAILED=0

# modpost's check, ours: what nvidia-uvm.ko imports must be exported by the kernel
# or by nvidia.ko (built from the same tree, not here).
undefined=$(nm -u "$UVM" | awk '{ print $2 }' | sort -u)
kernel_exports=$(awk '{ print $2 }' "$SYSOUT/Module.symvers" | sort -u)
nvidia_sources=$(cd "$BUILD" &&
    { sed -n 's/^NVIDIA_SOURCES[[:space:]]*+=[[:space:]]*//p' nvidia/nvidia-sources.Kbuild
      find nvidia common -name '*.h'; } | sort -u)
[ -n "$nvidia_sources" ] || die "no sources in nvidia/nvidia-sources.Kbuild"
nvidia_exports=$(cd "$BUILD" && xargs -r cat -- <<<"$nvidia_sources" |
    sed -n -E 's/^[[:space:]]*(NV_)?EXPORT_SYMBOL(_GPL)?[[:space:]]*\([[:space:]]*([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*\).*/\3/p' |
    sort -u) || die "cannot read nvidia.ko's sources in $BUILD"
[ -n "$nvidia_exports" ] || die "found no EXPORT_SYMBOL in nvidia.ko's sources"
unresolved=$(comm -23 <(printf '%s\n' "$undefined") <(printf '%s\n' "$kernel_exports") |
             comm -23 - <(printf '%s\n' "$nvidia_exports"))
if [ -n "$unresolved" ]; then
    fail "nvidia-uvm.ko imports what neither the kernel ($SYSOUT/Module.symvers) nor nvidia.ko exports: $(paste -sd " " - <<<"$unresolved")"
fi
from_nvidia=$(comm -23 <(printf '%s\n' "$undefined") <(printf '%s\n' "$kernel_exports") | grep -c . || true)

# gpuos.ko must stay optional.
depends=$(modinfo -F depends "$UVM")
case ",$depends," in *,gpuos,*) fail "nvidia-uvm.ko depends on gpuos (depends: $depends)" ;; esac
vermagic=$(modinfo -F vermagic "$UVM")
case $vermagic in "$KVER-amd64 "*) ;; *) fail "vermagic '$vermagic' is not for $KVER-amd64" ;; esac
if grep -q '^gpuos_' <<<"$undefined"; then
    fail "nvidia-uvm.ko has undefined gpuos symbols: $(grep '^gpuos_' <<<"$undefined" | paste -sd " " -)"
fi
for s in __symbol_get __symbol_put; do
    grep -qx "$s" <<<"$undefined" || fail "nvidia-uvm.ko does not import $s"
done
# The names symbol_get looks up, as strings in the module's data (not its debug info).
stripped=$(mktemp)
objcopy --strip-debug "$UVM" "$stripped"
names=$(strings -a "$stripped")
rm -f "$stripped"
for s in "${EXPECT_SYMBOL_GET[@]}"; do
    grep -qx "$s" <<<"$names" || fail "no symbol_get name $s in nvidia-uvm.ko"
done
defined=$(nm --defined-only "$UVM" | awk '{ print $3 }')
for s in "${EXPECT_FUNCTIONS[@]}"; do
    grep -qx "$s" <<<"$defined" || fail "nvidia-uvm.ko lacks $s"
done
params=$(modinfo -F parm "$UVM" | cut -d: -f1)
for p in "${EXPECT_PARAMS[@]}"; do
    grep -qx "$p" <<<"$params" || fail "nvidia-uvm.ko lacks parameter $p"
done
[ "$FAILED" = 0 ] || die "nvidia-uvm.ko is not what the patches should produce"

log "ok in $(elapsed) s: $UVM"
log "nvidia-uvm.ko: $(grep -c . <<<"$undefined") imports resolved ($from_nvidia from nvidia.ko);" \
    "depends '$depends'; imports __symbol_get/__symbol_put, no gpuos symbol linked"
echo "$BUILD"
