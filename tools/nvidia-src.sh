#!/usr/bin/env bash
# Get NVIDIA's open kernel module source (the kernel-open/ tree of
# github.com/NVIDIA/open-gpu-kernel-modules), verify it against the pin in
# patches/series.lock, and apply patches/series to a fresh copy.  Prints the
# patched tree's path (the kernel-open directory) as the last line of stdout.
#
# Usage: tools/nvidia-src.sh [--cache DIR] [--tarball FILE] [--tag TAG] [--pristine] [--refresh]
#   --cache DIR     cache directory (default $GPUOS_NVIDIA_CACHE or /var/cache/gpuos-nvidia)
#   --tarball FILE  take the source from this archive (.tar.xz, .tar.gz, ...; anything
#                   GNU tar reads), which holds kernel-open/ at its top or one level
#                   down (GitHub's tag archive, the vendor copy, a repacked tree)
#   --tag TAG       another tag than the pinned one (downloaded unless --tarball): no
#                   pin exists for it, so the tree is NOT verified, and the patches,
#                   maintained for the pinned tag only, may not apply (then: error)
#   --pristine      print the unpatched tree instead (verified and unpacked, not patched)
#   --refresh       re-read the source and re-create the trees even if cached
#
# Where the source comes from, the first that applies:
#   1. --tarball FILE;
#   2. $GPUOS_NVIDIA_TARBALL;
#   3. the vendor copy <vendor>/open-gpu-kernel-modules-<tag>-kernel-open.tar.xz,
#      <vendor> = $GPUOS_NVIDIA_VENDOR or ../shared/vendor next to this checkout
#      (for the pinned tag: the file named by 'vendor' in series.lock);
#   4. GitHub's archive of the tag, $GPUOS_NVIDIA_GITHUB (default https://github.com)
#      /<repository>/archive/refs/tags/<tag>.tar.gz, with curl; only kernel-open/
#      is extracted.
# A pristine tree already cached for the tag (and, if pinned, the pin) is used as it
# is: no source is read (--refresh to re-read and re-verify one).
#
# Verification: the pin is tree-sha256 in series.lock, a hash of the content of the
# kernel-open/ tree, the same for every archive of the same tree (see tree_hash
# below and the comment in series.lock); a tree that does not match is refused.
#
# Cache layout (each directory is created atomically: temp dir, then rename):
#   pristine-<tag>-<tree hash, 16 hex>/kernel-open/   the unpacked tree (never modified)
#   pristine-<tag>-<...>/.gpuos-pristine              tag, tree hash, pinned or not, origin
#   tree-<key>/kernel-open/    a patched copy, with the gpuos headers copied in; key =
#                              hash of every input (lock, series, patches, gpuos headers,
#                              tag and tree hash of the pristine tree)
#   tree-<key>/.gpuos-patched  the key and the patches applied
#   tree -> tree-<key>         the current one
# Idempotent: a second run with the same inputs does nothing but print the path.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCHES=$ROOT/patches
LOCK=$PATCHES/series.lock
CACHE=${GPUOS_NVIDIA_CACHE:-/var/cache/gpuos-nvidia}
VENDOR=${GPUOS_NVIDIA_VENDOR:-$ROOT/../shared/vendor}
GITHUB=${GPUOS_NVIDIA_GITHUB:-https://github.com}
TARBALL=${GPUOS_NVIDIA_TARBALL:-}
TARBALL_FROM=GPUOS_NVIDIA_TARBALL
TAG=
MODE=patched
REFRESH=0

log() { echo "nvidia-src: $*" >&2; }
die() { echo "nvidia-src: error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case $1 in
        --cache|--tarball|--tag)
            if [ $# -lt 2 ] || [ -z "$2" ]; then echo "nvidia-src: $1 needs a value" >&2; exit 2; fi
            case $1 in
                --cache) CACHE=$2 ;;
                --tarball) TARBALL=$2; TARBALL_FROM=--tarball ;;
                --tag) TAG=$2 ;;
            esac
            shift 2 ;;
        --pristine) MODE=pristine; shift ;;
        --refresh) REFRESH=1; shift ;;
        -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "nvidia-src: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

[ -f "$LOCK" ] || die "no $LOCK"
lock_get() {  # lock_get KEY -> value from series.lock ("key value" lines, # comments)
    local v
    v=$(awk -v k="$1" '{ sub(/#.*/, "") } $1 == k && NF == 2 { print $2; found = 1 } END { exit !found }' "$LOCK") ||
        die "$LOCK has no '$1'"
    printf '%s\n' "$v"
}

[ "$(lock_get source)" = github ] || die "$LOCK: source must be 'github'"
REPOSITORY=$(lock_get repository)
PIN_TAG=$(lock_get tag)
PIN_COMMIT=$(lock_get commit)
PIN_HASH=$(lock_get tree-sha256)
PIN_VENDOR=$(lock_get vendor)
[[ $PIN_HASH =~ ^[0-9a-f]{64}$ ]] || die "$LOCK: tree-sha256 is not 64 hex digits"

TAG=${TAG:-$PIN_TAG}
[[ $TAG =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "bad tag '$TAG'"
if [ "$TAG" = "$PIN_TAG" ]; then
    PIN=$PIN_HASH
    VENDOR_FILE=$VENDOR/$PIN_VENDOR
else
    PIN=
    VENDOR_FILE=$VENDOR/open-gpu-kernel-modules-$TAG-kernel-open.tar.xz
    log "warning: tag $TAG is not pinned (series.lock pins $PIN_TAG): its source is NOT verified," \
        "and the patches are maintained for $PIN_TAG only"
fi
if [ -n "$TARBALL" ]; then
    [ -f "$TARBALL" ] || die "$TARBALL_FROM: no such file: $TARBALL"
    TARBALL=$(cd "$(dirname "$TARBALL")" && pwd)/$(basename "$TARBALL")
fi

mkdir -p "$CACHE" || die "cannot create the cache directory $CACHE"
CACHE=$(cd "$CACHE" && pwd)
exec 9>"$CACHE/.lock" || die "cannot write to $CACHE"
flock 9
TMP=
trap '[ -z "$TMP" ] || rm -rf "$TMP"' EXIT

# tree_hash DIR: the content hash of a kernel-open tree, as pinned by series.lock.
# For every entry under DIR except directories, one line:
#   regular file:  <relative path> NUL <sha256 of its content, 64 lower-case hex> LF
#   symbolic link: <relative path> NUL "symlink " <its target> LF
# sorted by path (bytewise), concatenated; the tree hash is the sha256 of that text.
# Paths are relative to DIR (kernel-open/ itself), without "./".  Modes, owners and
# times are not part of it (archives and umasks differ in them; git records only
# the executable bit, which the build does not depend on), nor are empty directories
# (git has none).  Anything else (a device, a fifo) is refused.  For a tree of
# regular files the same as:
#   cd kernel-open && find . -type f -printf '%P\0' | LC_ALL=C sort -z |
#     while IFS= read -r -d '' f; do printf '%s\0%s\n' "$f" "$(sha256sum <"$f" | cut -c1-64)"; done |
#     sha256sum
tree_hash() {
    python3 - "$1" <<'EOF'
import hashlib, os, stat, sys
root = os.fsencode(sys.argv[1])
lines = []
for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            continue
        if stat.S_ISLNK(st.st_mode):
            lines.append((rel, b"symlink " + os.readlink(path)))
        elif stat.S_ISREG(st.st_mode):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            lines.append((rel, h.hexdigest().encode()))
        else:
            sys.exit(f"not a file or symlink: {os.fsdecode(rel)}")
total = hashlib.sha256()
for rel, value in sorted(lines):
    total.update(rel + b"\0" + value + b"\n")
print(total.hexdigest())
EOF
}

# The NV_VERSION_STRING a kernel-open tree's Kbuild builds with (e.g. 580.142).
tree_version() {
    sed -n 's/.*-DNV_VERSION_STRING=\\"\([^\\"]*\)\\".*/\1/p' "$1/Kbuild" | head -n 1
}

# extract_kernel_open ARCHIVE DEST: extract the archive's kernel-open/ (at its top or
# one level down) and nothing else to DEST/kernel-open.
extract_kernel_open() {
    local archive=$1 dest=$2 list member n
    list=$(tar -tf "$archive" 2>&1) || die "cannot read $archive as a tar archive: $(tail -n 1 <<<"$list")"
    # Members "kernel-open/...", "./kernel-open/..." or "<top>/kernel-open/...".
    member=$(sed -n -E 's#^((\./)?([^/]+/)?kernel-open)(/.*)?$#\1#p' <<<"$list" | sort -u)
    n=$(grep -c . <<<"$member" || true)
    [ "$n" -ge 1 ] || die "no kernel-open/ directory in $archive (at its top or one level down)"
    # Both kernel-open/ and <top>/kernel-open/: take the one at the top.
    [ "$n" = 1 ] || member=$(grep -E '^(\./)?kernel-open$' <<<"$member" || true)
    [ "$(grep -c . <<<"$member" || true)" = 1 ] ||
        die "more than one kernel-open/ directory in $archive: $(paste -sd " " - <<<"$member")"
    mkdir -p "$dest/x"
    tar -xf "$archive" -C "$dest/x" --no-same-owner "$member" ||
        die "cannot extract $member from $archive"
    [ -f "$dest/x/$member/Kbuild" ] || die "$archive: $member/ has no Kbuild (not NVIDIA's kernel-open tree?)"
    mv "$dest/x/$member" "$dest/kernel-open"
    rm -rf "$dest/x"
}

# download DEST: GitHub's archive of $TAG, kernel-open/ only, to DEST/kernel-open.
download() {
    local dest=$1 url=$GITHUB/$REPOSITORY/archive/refs/tags/$TAG.tar.gz top d
    command -v curl >/dev/null || die "curl is not installed; cannot download $url (or pass --tarball FILE)"
    log "downloading $url (kernel-open/ only)"
    mkdir -p "$dest/x"
    # GitHub's archive has one top directory, <name>-<tag>/.
    if ! curl -fsSL --retry 2 --connect-timeout 20 "$url" 2>"$dest/curl.err" |
            tar -xz -C "$dest/x" --no-same-owner --wildcards --no-wildcards-match-slash '*/kernel-open' 2>"$dest/tar.err"; then
        local why
        why=$(tail -n 1 "$dest/curl.err" 2>/dev/null)
        [ -n "$why" ] || why=$(tail -n 1 "$dest/tar.err" 2>/dev/null)
        die "cannot download $url (offline?): ${why:-curl or tar failed}; pass --tarball FILE or set GPUOS_NVIDIA_TARBALL"
    fi
    top=
    for d in "$dest"/x/*/kernel-open; do
        if [ -f "$d/Kbuild" ]; then top=$d; break; fi
    done
    [ -n "$top" ] || die "$url has no kernel-open/Kbuild"
    mv "$top" "$dest/kernel-open"
    rm -rf "$dest/x" "$dest/curl.err" "$dest/tar.err"
}

# A cached pristine tree for $TAG: for the pinned tag the one with the pinned hash,
# else the newest one of the tag.  Prints its directory, or nothing.
cached_pristine() {
    local d
    if [ -n "$PIN" ]; then
        d=$CACHE/pristine-$TAG-${PIN:0:16}
        [ -f "$d/.gpuos-pristine" ] && grep -qx "tree-sha256 $PIN" "$d/.gpuos-pristine" && echo "$d"
        return 0
    fi
    local newest=
    for d in "$CACHE/pristine-$TAG-"*; do
        if [ -f "$d/.gpuos-pristine" ] && { [ -z "$newest" ] || [ "$d" -nt "$newest" ]; }; then
            newest=$d
        fi
    done
    [ -z "$newest" ] || echo "$newest"
}

# PRISTINE=<the pristine tree's directory> (its kernel-open/ inside); fetched,
# verified and unpacked unless cached.
PRISTINE=
pristine_dir() {
    local dir origin hash version pinned=no
    if [ "$REFRESH" = 0 ]; then
        dir=$(cached_pristine)
        # An unpinned tree taken from an explicit archive is that archive's tree: read it.
        if [ -n "$dir" ] && { [ -n "$PIN" ] || [ -z "$TARBALL" ]; }; then
            [ "$TARBALL_FROM" != --tarball ] || log "$TAG is cached ($dir): $TARBALL not read (--refresh to verify it)"
            PRISTINE=$dir; return
        fi
    fi
    TMP=$(mktemp -d "$CACHE/.pristine.XXXXXX")
    chmod 755 "$TMP"
    if [ -n "$TARBALL" ]; then
        origin=$TARBALL
        log "unpacking kernel-open/ from $TARBALL ($TARBALL_FROM)"
        extract_kernel_open "$TARBALL" "$TMP"
    elif [ -f "$VENDOR_FILE" ]; then
        origin=$VENDOR_FILE
        log "unpacking kernel-open/ from the vendor copy $VENDOR_FILE"
        extract_kernel_open "$VENDOR_FILE" "$TMP"
    else
        origin=$GITHUB/$REPOSITORY/archive/refs/tags/$TAG.tar.gz
        download "$TMP"
    fi
    hash=$(tree_hash "$TMP/kernel-open") || die "cannot hash the tree from $origin"
    version=$(tree_version "$TMP/kernel-open")
    if [ -n "$PIN" ]; then
        if [ "$hash" != "$PIN" ]; then
            local also=
            [ "$version" = "$TAG" ] || also="; its Kbuild says version '${version:-none}'"
            die "tree hash mismatch for $TAG from $origin: expected $PIN (patches/series.lock), found $hash$also"
        fi
        pinned=yes
        log "verified $TAG (commit $PIN_COMMIT): tree-sha256 $hash"
    else
        [ "$version" = "$TAG" ] ||
            die "$origin holds version '${version:-none}' (kernel-open/Kbuild), not $TAG"
        log "warning: $TAG from $origin is unverified (tree-sha256 $hash; no pin for it in series.lock)"
    fi
    dir=$CACHE/pristine-$TAG-${hash:0:16}
    if [ "$REFRESH" = 0 ] && [ -f "$dir/.gpuos-pristine" ]; then
        rm -rf "$TMP"; TMP=
        PRISTINE=$dir; return
    fi
    printf 'tag %s\ntree-sha256 %s\npinned %s\norigin %s\n' "$TAG" "$hash" "$pinned" "$origin" \
        >"$TMP/.gpuos-pristine"
    rm -rf "$dir"
    mv "$TMP" "$dir"
    TMP=
    PRISTINE=$dir
}

# Files copied into the patched tree next to the patches: the gpuos interface the
# patches compile against (one source of truth: kmod/), and gpuos's own files of
# nvidia-uvm that touch no UVM state, which gpuos's tests compile unchanged
# (patches/nvidia-uvm/: the binding to gpuos.ko, the fault batch report builder,
# the prefetch clipping, the fault-isolation rules).
GPUOS_HEADERS=(
    "kmod/include/gpuos_hooks.h:nvidia-uvm/gpuos/include/gpuos_hooks.h"
    "kmod/uapi/gpuos.h:nvidia-uvm/gpuos/uapi/gpuos.h"
    "patches/nvidia-uvm/uvm_gpuos_types.h:nvidia-uvm/gpuos/uvm_gpuos_types.h"
    "patches/nvidia-uvm/uvm_gpuos_bind.h:nvidia-uvm/gpuos/uvm_gpuos_bind.h"
    "patches/nvidia-uvm/uvm_gpuos_bind.c:nvidia-uvm/gpuos/uvm_gpuos_bind.c"
    "patches/nvidia-uvm/uvm_gpuos_report.h:nvidia-uvm/gpuos/uvm_gpuos_report.h"
    "patches/nvidia-uvm/uvm_gpuos_report.c:nvidia-uvm/gpuos/uvm_gpuos_report.c"
    "patches/nvidia-uvm/uvm_gpuos_prefetch.h:nvidia-uvm/gpuos/uvm_gpuos_prefetch.h"
    "patches/nvidia-uvm/uvm_gpuos_prefetch.c:nvidia-uvm/gpuos/uvm_gpuos_prefetch.c"
    "patches/nvidia-uvm/uvm_gpuos_isolate.h:nvidia-uvm/gpuos/uvm_gpuos_isolate.h"
    "patches/nvidia-uvm/uvm_gpuos_isolate.c:nvidia-uvm/gpuos/uvm_gpuos_isolate.c"
)

series() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$PATCHES/series" | awk '{ print $1 }'; }

inputs_key() {  # inputs_key PRISTINE_DIR
    {
        grep -E '^(tag|tree-sha256) ' "$1/.gpuos-pristine"
        cat "$LOCK" "$PATCHES/series"
        local p m
        for p in $(series); do echo "== $p"; cat "$PATCHES/$p"; done
        for m in "${GPUOS_HEADERS[@]}"; do echo "== ${m%%:*}"; cat "$ROOT/${m%%:*}"; done
    } | sha256sum | cut -c1-16
}

patched_tree() {
    local pristine key dir p m out
    pristine_dir
    pristine=$PRISTINE
    for p in $(series); do
        [ -f "$PATCHES/$p" ] || die "patches/series names $p, which does not exist"
    done
    for m in "${GPUOS_HEADERS[@]}"; do
        [ -f "$ROOT/${m%%:*}" ] || die "no $ROOT/${m%%:*}"
    done
    key=$(inputs_key "$pristine")
    dir=$CACHE/tree-$key
    if [ "$REFRESH" = 1 ] || [ ! -f "$dir/.gpuos-patched" ]; then
        TMP=$(mktemp -d "$CACHE/.tree.XXXXXX")
        chmod 755 "$TMP"
        cp -a "$pristine/kernel-open" "$TMP/kernel-open"
        chmod -R u+w "$TMP/kernel-open"
        for p in $(series); do
            log "applying $p"
            if ! out=$(patch -d "$TMP/kernel-open" -p1 --forward --batch --fuzz=0 \
                    --no-backup-if-mismatch -r - -i "$PATCHES/$p" 2>&1); then
                printf '    %s\n' "${out//$'\n'/$'\n'    }" >&2
                if [ -n "$PIN" ]; then
                    die "$p does not apply to $TAG (with --fuzz=0)"
                else
                    die "$p does not apply to the unpinned tag $TAG (with --fuzz=0); the patches are maintained for $PIN_TAG"
                fi
            fi
        done
        for m in "${GPUOS_HEADERS[@]}"; do
            mkdir -p "$(dirname "$TMP/kernel-open/${m#*:}")"
            cp "$ROOT/${m%%:*}" "$TMP/kernel-open/${m#*:}"
        done
        printf '%s\n' "$key" "$(series)" >"$TMP/.gpuos-patched"
        rm -rf "$dir"
        mv "$TMP" "$dir"
        TMP=
        log "patched tree $dir/kernel-open"
    fi
    if [ "$(readlink "$CACHE/tree" 2>/dev/null)" != "tree-$key" ]; then
        ln -sfn "tree-$key" "$CACHE/.tree.new" && mv -T "$CACHE/.tree.new" "$CACHE/tree"
    fi
    # Keep the current tree and the newest other one (a build cache); drop older ones.
    local old keep=
    for old in "$CACHE"/tree-*; do
        if [ "$old" != "$dir" ] && [ -d "$old" ] && { [ -z "$keep" ] || [ "$old" -nt "$keep" ]; }; then
            keep=$old
        fi
    done
    for old in "$CACHE"/tree-*; do
        if [ "$old" != "$dir" ] && [ "$old" != "$keep" ] && [ -e "$old" ]; then
            rm -rf "$old"
        fi
    done
    echo "$dir/kernel-open"
}

if [ "$MODE" = pristine ]; then
    pristine_dir
    echo "$PRISTINE/kernel-open"
else
    patched_tree
fi
