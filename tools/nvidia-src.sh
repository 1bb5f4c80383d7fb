#!/usr/bin/env bash
# Fetch NVIDIA's open kernel module source as Debian packages it, pinned by
# patches/series.lock (package, version, sha256), and apply patches/series to a
# fresh copy.  Prints the patched tree's path as the last line of stdout.
#
# Usage: tools/nvidia-src.sh [--cache DIR] [--pristine] [--refresh]
#   --cache DIR   cache directory (default $GPUOS_NVIDIA_CACHE or /var/cache/gpuos-nvidia)
#   --pristine    print the unpatched tree instead (fetched and unpacked, not patched)
#   --refresh     re-create the patched tree even if one with the same inputs exists
#
# The system's apt state is never touched: apt runs with a private sources file,
# private lists and a private cache under the cache directory.  The mirror is the
# one the system's own apt sources use for its release (override: GPUOS_DEBIAN_MIRROR).
# apt checks the archive's signature (debian-archive-keyring) and the package's
# hash from the signed index; this script then checks the pinned sha256.
#
# Cache layout (everything is created atomically: temp dir, then rename):
#   deb/<package>_<version>_amd64.deb     the verified package
#   apt/                                  private apt configuration, lists, cache
#   pristine-<version>/                   the unpacked kernel-open tree (never modified)
#   tree-<key>/                           a patched copy; key = hash of every input
#                                         (lock, series, patches, gpuos headers)
#   tree -> tree-<key>                    the current one
# Idempotent: a second run with the same inputs does nothing but print the path.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCHES=$ROOT/patches
LOCK=$PATCHES/series.lock
CACHE=${GPUOS_NVIDIA_CACHE:-/var/cache/gpuos-nvidia}
MODE=patched
REFRESH=0

while [ $# -gt 0 ]; do
    case $1 in
        --cache) CACHE=$2; shift 2 ;;
        --pristine) MODE=pristine; shift ;;
        --refresh) REFRESH=1; shift ;;
        -h|--help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "nvidia-src: unknown argument $1" >&2; exit 2 ;;
    esac
done

log() { echo "nvidia-src: $*" >&2; }
die() { echo "nvidia-src: error: $*" >&2; exit 1; }

lock_get() {  # lock_get KEY -> value from series.lock ("key value" lines, # comments)
    local v
    v=$(awk -v k="$1" '$1 == k { print $2; found = 1 } END { exit !found }' "$LOCK") ||
        die "$LOCK has no '$1'"
    printf '%s\n' "$v"
}

PKG=$(lock_get package)
VERSION=$(lock_get version)
SUITE=$(lock_get suite)
COMPONENT=$(lock_get component)
SHA256=$(lock_get sha256)
TARBALL=$(lock_get tarball)
TREE_IN_TARBALL=$(lock_get tree)
DEB_NAME=${PKG}_${VERSION}_amd64.deb

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

# The Debian mirror the system's apt uses for its own release, e.g.
# http://deb.debian.org/debian/ (never a hard-coded host).
system_mirror() {
    if [ -n "${GPUOS_DEBIAN_MIRROR:-}" ]; then
        echo "$GPUOS_DEBIAN_MIRROR"; return
    fi
    local codename
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ -n "$codename" ] || die "no VERSION_CODENAME in /etc/os-release; set GPUOS_DEBIAN_MIRROR"
    # Sources files, one-line (.list) and deb822 (.sources): the first enabled
    # "deb" entry whose suite is this release.
    python3 - "$codename" <<'EOF' || die "no apt source for this release found; set GPUOS_DEBIAN_MIRROR"
import glob, sys
codename = sys.argv[1]
files = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
for path in files:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = [w for w in words[1:] if not (w.startswith("[") or w.endswith("]") or "=" in w)]
        if len(words) >= 2 and words[1] == codename:
            print(words[0]); sys.exit(0)
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        text = open(path).read()
    except OSError:
        continue
    for stanza in text.split("\n\n"):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" in fields.get("types", "").split() and codename in fields.get("suites", "").split():
            print(fields["uris"].split()[0]); sys.exit(0)
sys.exit(1)
EOF
}

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

fetch_deb() {
    local deb=$CACHE/deb/$DEB_NAME
    if sha_ok "$deb"; then
        return
    fi
    rm -f "$deb"
    local mirror apt=$CACHE/apt
    mirror=$(system_mirror)
    log "fetching $PKG $VERSION from $mirror ($SUITE $COMPONENT)"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc" "$CACHE/deb"
    cat >"$apt/etc/sources.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $SUITE
Components: $COMPONENT
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    local -a opts=(
        -o "Dir::Etc::sourcelist=$apt/etc/sources.sources"
        -o "Dir::Etc::sourceparts=/dev/null"
        -o "Dir::Etc::preferences=/dev/null"
        -o "Dir::Etc::preferencesparts=/dev/null"
        -o "Dir::State::Lists=$apt/lists"
        -o "Dir::State::status=/dev/null"
        -o "Dir::Cache=$apt/cache"
        -o "Dir::Cache::pkgcache="
        -o "Dir::Cache::srcpkgcache="
        -o "APT::Architecture=amd64"
        -o "APT::Architectures=amd64"
        -o "APT::Sandbox::User=root"
        -q
    )
    apt-get "${opts[@]}" update >&2 || die "apt-get update (private lists) failed"
    local tmp
    tmp=$(mktemp -d "$CACHE/deb/.dl.XXXXXX")
    (cd "$tmp" && apt-get "${opts[@]}" download "$PKG=$VERSION" >&2) ||
        { rm -rf "$tmp"; die "apt-get download $PKG=$VERSION failed (not on $mirror $SUITE?)"; }
    if ! sha_ok "$tmp/$DEB_NAME"; then
        local got
        got=$(sha256sum "$tmp"/*.deb 2>/dev/null | cut -d' ' -f1 || true)
        rm -rf "$tmp"
        die "sha256 mismatch for $DEB_NAME: got ${got:-nothing}, pinned $SHA256 (patches/series.lock)"
    fi
    mv "$tmp/$DEB_NAME" "$deb"
    rm -rf "$tmp"
    log "verified $DEB_NAME (sha256 $SHA256)"
}

unpack_pristine() {
    local dir=$CACHE/pristine-$VERSION
    if [ -f "$dir/.gpuos-pristine" ]; then
        echo "$dir"; return
    fi
    fetch_deb
    rm -rf "$dir"
    local tmp
    tmp=$(mktemp -d "$CACHE/.unpack.XXXXXX")
    log "unpacking /$TARBALL"
    dpkg-deb --fsys-tarfile "$CACHE/deb/$DEB_NAME" | tar -C "$tmp" -x "./$TARBALL"
    mkdir "$tmp/x"
    tar -C "$tmp/x" -xJf "$tmp/$TARBALL"
    [ -f "$tmp/x/$TREE_IN_TARBALL/Kbuild" ] || { rm -rf "$tmp"; die "no $TREE_IN_TARBALL/Kbuild in the tarball"; }
    mv "$tmp/x/$TREE_IN_TARBALL" "$tmp/tree"
    echo "$PKG $VERSION $SHA256" >"$tmp/tree/.gpuos-pristine"
    mv "$tmp/tree" "$dir"
    rm -rf "$tmp"
    echo "$dir"
}

# Files copied into the patched tree next to the patches: the gpuos interface the
# patches compile against (one source of truth: kmod/).
GPUOS_HEADERS=(
    "kmod/include/gpuos_hooks.h:nvidia-uvm/gpuos/include/gpuos_hooks.h"
    "kmod/uapi/gpuos.h:nvidia-uvm/gpuos/uapi/gpuos.h"
)

series() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$PATCHES/series" | awk '{ print $1 }'; }

inputs_key() {
    {
        cat "$LOCK" "$PATCHES/series"
        local p
        for p in $(series); do echo "== $p"; cat "$PATCHES/$p"; done
        local m
        for m in "${GPUOS_HEADERS[@]}"; do echo "== ${m%%:*}"; cat "$ROOT/${m%%:*}"; done
    } | sha256sum | cut -c1-16
}

patched_tree() {
    local pristine key dir
    pristine=$(unpack_pristine)
    key=$(inputs_key)
    dir=$CACHE/tree-$key
    if [ "$REFRESH" = 1 ]; then
        rm -rf "$dir"
    fi
    if [ ! -f "$dir/.gpuos-patched" ]; then
        rm -rf "$dir"
        local tmp p m
        tmp=$(mktemp -d "$CACHE/.tree.XXXXXX")
        cp -a "$pristine/." "$tmp/"
        rm -f "$tmp/.gpuos-pristine"
        for p in $(series); do
            log "applying $p"
            patch -d "$tmp" -p1 --forward --batch --fuzz=0 --no-backup-if-mismatch -s \
                -i "$PATCHES/$p" >&2 || { rm -rf "$tmp"; die "$p does not apply to $PKG $VERSION"; }
        done
        for m in "${GPUOS_HEADERS[@]}"; do
            mkdir -p "$(dirname "$tmp/${m#*:}")"
            cp "$ROOT/${m%%:*}" "$tmp/${m#*:}"
        done
        printf '%s\n' "$key" "$(series)" >"$tmp/.gpuos-patched"
        mv "$tmp" "$dir"
        log "patched tree $dir"
    fi
    ln -sfn "tree-$key" "$CACHE/.tree.new" && mv -T "$CACHE/.tree.new" "$CACHE/tree"
    # Keep the current tree and the one before it (a build cache); drop older ones.
    local old
    for old in $(ls -1dt "$CACHE"/tree-* 2>/dev/null | tail -n +3); do
        rm -rf "$old"
    done
    echo "$dir"
}

if [ "$MODE" = pristine ]; then
    unpack_pristine
else
    patched_tree
fi
