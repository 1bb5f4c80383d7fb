#!/usr/bin/env bash
# install-bundle.sh - install a gpuos bundle made by tools/bundle.sh; needs no network.
#
# Usage: install-bundle.sh BUNDLE [--prefix DIR] [--python PYTHON] [--target DIR] [--no-python]
#
# 1. checks BUNDLE/MANIFEST.sha256;
# 2. unpacks every BUNDLE/debs/*.deb into PREFIX/root (dpkg-deb -x) and writes PREFIX/bin/criu,
#    which runs the bundled criu through the bundled dynamic loader with --library-path, so
#    LD_LIBRARY_PATH is never set and nothing else sees the bundled libraries; then checks
#    that `PREFIX/bin/criu --version` works;
# 3. installs gpuos from BUNDLE/wheels, one of:
#      (default)     PYTHON -m pip install --no-index --find-links BUNDLE/wheels gpuos
#                    If PYTHON is externally managed (PEP 668), this goes into a venv
#                    PREFIX/venv that also sees PYTHON's packages, and PREFIX/bin/gpuos.
#      --target DIR  the bundle's wheels (gpuos, and with --only-gpuos bundles the few
#                    dependencies GPU hosts lack), without resolving dependencies, into
#                    DIR (pip --target);
#                    PYTHON's own site-packages are not touched. Run it with
#                    PYTHONPATH=DIR DIR/bin/gpuos.
#      --no-python   nothing (CRIU only).
#
# Options:
#   --prefix DIR      where CRIU goes (default /opt/gpuos)
#   --python PYTHON   the interpreter to install gpuos for (default python3)
set -euo pipefail

die() { echo "install-bundle.sh: error: $*" >&2; exit 1; }
say() { echo "install-bundle.sh: $*"; }
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; }

bundle="" prefix=/opt/gpuos python=python3 target="" nopy=0
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --prefix) prefix=${2:?--prefix needs a value}; shift ;;
    --python) python=${2:?--python needs a value}; shift ;;
    --target) target=${2:?--target needs a value}; shift ;;
    --no-python) nopy=1 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$bundle" ] || die "only one BUNDLE"; bundle=$1 ;;
  esac
  shift
done
[ -n "$bundle" ] || { usage >&2; exit 2; }
bundle=$(cd "$bundle" && pwd) || die "no bundle directory $bundle"
prefix=$(realpath -m "$prefix")

[ -f "$bundle/MANIFEST.sha256" ] || die "$bundle has no MANIFEST.sha256"
(cd "$bundle" && sha256sum --quiet --strict -c MANIFEST.sha256) || die "$bundle does not match its MANIFEST.sha256"
say "verified $(wc -l <"$bundle/MANIFEST.sha256") files in $bundle"

# CRIU: unpack into a fresh PREFIX/root.new, then swap it in.
debs=("$bundle"/debs/*.deb)
[ -f "${debs[0]}" ] || die "no .deb files in $bundle/debs"
root=$prefix/root
if [ -e "$root" ] && [ ! -e "$root/.gpuos-bundle" ]; then
  die "$root exists and was not made by install-bundle.sh; not replacing it"
fi
mkdir -p "$prefix/bin"
rm -rf "$root.new"
mkdir "$root.new"
for d in "${debs[@]}"; do dpkg-deb -x "$d" "$root.new" || die "cannot unpack $d"; done
touch "$root.new/.gpuos-bundle"
rm -rf "$root"
mv "$root.new" "$root"
say "unpacked ${#debs[@]} packages into $root"

# The wrapper finds PREFIX/root from its own location, so the prefix can be moved.
cat >"$prefix/bin/criu.new" <<'EOF'
#!/bin/sh
# Written by gpuos install-bundle.sh: run the bundled criu with the bundled loader and libraries.
r=$(dirname "$(readlink -f "$0")")/../root
l=$r/usr/lib/x86_64-linux-gnu
exec "$l/ld-linux-x86-64.so.2" --library-path "$l" --argv0 criu "$r/usr/sbin/criu" "$@"
EOF
chmod 755 "$prefix/bin/criu.new"
mv "$prefix/bin/criu.new" "$prefix/bin/criu"
version=$("$prefix/bin/criu" --version) || die "$prefix/bin/criu --version failed"
say "$prefix/bin/criu works: $(echo "$version" | head -n1)"

[ "$nopy" = 0 ] || exit 0
wheel=$(compgen -G "$bundle/wheels/gpuos-*.whl" | head -n1) || die "no gpuos wheel in $bundle/wheels (bundle made with --no-wheels? use --no-python)"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "$target" ]; then
  if "$python" -m pip --version >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --upgrade --target "$target" "$bundle"/wheels/*.whl
  else  # no pip: a wheel is a zip file, so unzipping it is an install (minus DIR/bin/gpuos)
    rm -rf "$target/gpuos" "$target"/gpuos-*.dist-info
    mkdir -p "$target"
    for w in "$bundle"/wheels/*.whl; do "$python" -m zipfile -e "$w" "$target"; done
  fi
  say "installed $(cd "$bundle/wheels" && echo *.whl) into $target (use PYTHONPATH=$target)"
  exit 0
fi
if "$python" -c 'import os, sys, sysconfig
sys.exit(sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
  py=$python
else
  say "$python is externally managed (PEP 668): installing into the venv $prefix/venv"
  [ -x "$prefix/venv/bin/python" ] || "$python" -m venv --system-site-packages "$prefix/venv" \
    || die "cannot create $prefix/venv (on Debian/Ubuntu: apt-get install python3-venv)"
  py=$prefix/venv/bin/python
fi
"$py" -m pip --version >/dev/null 2>&1 || die "$py has no pip"
"$py" -m pip install -q --no-index --find-links "$bundle/wheels" "$wheel"
# A rebuilt wheel of the same version must replace the installed one.
"$py" -m pip install -q --no-index --no-deps --force-reinstall "$wheel"
[ ! -x "$prefix/venv/bin/gpuos" ] || ln -sfn ../venv/bin/gpuos "$prefix/bin/gpuos"
say "installed $(basename "$wheel") for $("$py" -c 'import sys; print(sys.executable)')"
