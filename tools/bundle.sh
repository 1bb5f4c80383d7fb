#!/usr/bin/env bash
# bundle.sh - make an offline gpuos bundle, on a machine that reaches a Debian mirror and PyPI.
#
# Usage: tools/bundle.sh OUTDIR [--python-version X.Y] [--platform TAG] [--only-gpuos] [--no-wheels]
#
# Writes into OUTDIR (created if needed; an earlier bundle there is replaced):
#   debs/              CRIU and the libraries it needs (glibc's loader included), from
#                      Debian unstable, fetched with a private apt state (the system's apt
#                      configuration and lists are not touched)
#   wheels/            a wheel of gpuos built from this checkout, plus wheels of its runtime
#                      dependencies for the target Python and platform
#   install-bundle.sh  the installer to run on the target machine (see its --help)
#   MANIFEST.sha256    sha256sum of every file above
#
# Options:
#   --python-version X.Y  target Python of the dependency wheels (default 3.12)
#   --platform TAG        target wheel platform (default manylinux_2_28_x86_64: glibc >= 2.28;
#                         older manylinux tags are accepted too)
#   --only-gpuos          wheels/ holds the gpuos wheel and those of the dependencies a
#                         GPU host seldom has (blake3, zstandard); the target has the others
#                         (click, numpy, nvidia-ml-py, cuda-bindings)
#   --no-wheels           no wheels/ at all (CRIU only)
#
# Environment:
#   GPUOS_DEBIAN_MIRROR   Debian mirror URI; default: the first .../debian URI in the
#                         system's apt sources
#   GPUOS_DEBIAN_KEYRING  default /usr/share/keyrings/debian-archive-keyring.gpg
set -euo pipefail

die() { echo "bundle.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; }

CRIU_DEBS="criu libcompel1 libnet9 libnftables1 libprotobuf-c1 libnl-3-200 libnftnl11
  libjansson4 libxtables12 libmnl0 libgnutls30t64 libnettle8t64 libhogweed6t64 libidn2-0
  libunistring5 libtasn1-6 libp11-kit0 libffi8 libbsd0 libmd0 libc6 libuuid1 libgmp10
  libzstd1 libedit2"

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
out="" pyver=3.12 platform=manylinux_2_28_x86_64 wheels=1 deps=1
RARE_DEPS="blake3 zstandard"  # --only-gpuos: dependencies a GPU host seldom has
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --python-version) pyver=${2:?--python-version needs a value}; shift ;;
    --platform) platform=${2:?--platform needs a value}; shift ;;
    --only-gpuos) deps=0 ;;
    --no-wheels) wheels=0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$out" ] || die "only one OUTDIR"; out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { usage >&2; exit 2; }

keyring=${GPUOS_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
[ -r "$keyring" ] || die "no Debian archive keyring at $keyring (install debian-archive-keyring or set GPUOS_DEBIAN_KEYRING)"
mirror=${GPUOS_DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
  /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | sed -n -e 's/^URIs:\(.*\)/\1/p' -e 's/^deb\( \[[^]]*\]\)\? \+\([^ ]*\).*/\2/p' \
  | tr -s ' \t' '\n' | grep -m1 -E '^https?://.*/debian/?$' || true)}
[ -n "$mirror" ] || die "no Debian mirror in the apt sources; set GPUOS_DEBIAN_MIRROR"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage=$tmp/bundle a=$tmp/apt
mkdir -p "$stage/debs" "$a/lists/partial" "$a/cache/archives/partial"

echo "bundle.sh: CRIU debs from $mirror (unstable)"
echo "deb [signed-by=$keyring] $mirror sid main" >"$a/sources.list"
apt=(apt-get -q -o Dir::Etc::sourcelist="$a/sources.list" -o Dir::Etc::sourceparts=/dev/null
  -o Dir::Etc::preferences=/dev/null -o Dir::Etc::preferencesparts=/dev/null
  -o Dir::State::Lists="$a/lists" -o Dir::State::status=/dev/null -o Dir::Cache="$a/cache"
  -o APT::Architecture=amd64 -o APT::Architectures=amd64)
[ "$(id -u)" != 0 ] || apt+=(-o APT::Sandbox::User=root)
"${apt[@]}" update --error-on=any >"$a/update.log" 2>&1 || { cat "$a/update.log" >&2; die "apt-get update from $mirror failed"; }
# shellcheck disable=SC2086
(cd "$stage/debs" && "${apt[@]}" download $CRIU_DEBS) || die "apt-get download failed"

if [ "$wheels" = 1 ]; then
  echo "bundle.sh: gpuos wheel from $repo"
  # Build from a clean copy so stale build/ trees never leak into the wheel.
  mkdir "$tmp/src"
  tar -C "$repo" --exclude=./.git --exclude=./.bundle --exclude=./.venv --exclude=./build \
    --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$tmp/src" -xf -
  python3 -m pip wheel -q --no-deps -w "$stage/wheels" "$tmp/src" || die "building the gpuos wheel failed"
  plats=("$platform")  # pip takes manylinux_2_N literally: list every older tag too
  if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    n=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
    for ((v = n - 1; v >= 5; v--)); do plats+=("manylinux_2_${v}_$arch"); done
    plats+=("linux_$arch")  # the gpuos wheel itself (it carries libgpuos.so)
    for t in 17:manylinux2014 12:manylinux2010 5:manylinux1; do
      [ "$n" -lt "${t%%:*}" ] || plats+=("${t#*:}_$arch")
    done
  fi
  if [ "$deps" = 1 ]; then
    echo "bundle.sh: dependency wheels for Python $pyver, $platform"
    python3 -m pip download -q --only-binary=:all: --python-version "$pyver" "${plats[@]/#/--platform=}" \
      -d "$stage/wheels" "$stage"/wheels/gpuos-*.whl || die "downloading dependency wheels failed"
  else
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" "${plats[@]/#/--platform=}" \
      -d "$stage/wheels" $RARE_DEPS || die "downloading $RARE_DEPS failed"
  fi
fi

cp "$here/install-bundle.sh" "$stage/"
(cd "$stage" && find . -type f | sed 's|^\./||' | sort | xargs -d '\n' sha256sum >"$tmp/MANIFEST.sha256")
mv "$tmp/MANIFEST.sha256" "$stage/"

# Self-test: the unpacked CRIU must start through the bundled loader and libraries.
if [ "$(uname -m)" = x86_64 ]; then
  bash "$stage/install-bundle.sh" "$stage" --prefix "$tmp/check" --no-python >"$tmp/check.log" 2>&1 \
    || { cat "$tmp/check.log" >&2; die "self-test of the bundled criu failed"; }
fi

mkdir -p "$out"
rm -rf "$out/debs" "$out/wheels" "$out/install-bundle.sh" "$out/MANIFEST.sha256"
mv "$stage"/* "$out/"
echo "bundle.sh: wrote $out ($(du -sh "$out" | cut -f1)):"
(cd "$out" && find debs wheels \( -name 'criu_*' -o -name '*.whl' \) 2>/dev/null | sort | sed 's/^/  /') || true
