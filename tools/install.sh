#!/usr/bin/env bash
# install.sh - one-command install of gpuos and its private CRIU on a connected Debian/Ubuntu machine.
#
# Usage: tools/install.sh [--prefix DIR] [--dev] [--force]    (as root, from a checkout)
#
# Installs any missing system packages it needs (python3-pip, python3-venv,
# debian-archive-keyring; nothing when all are present), makes a bundle in a temporary
# directory (tools/bundle.sh) and installs it (tools/install-bundle.sh): CRIU into
# PREFIX/root with the wrapper PREFIX/bin/criu, gpuos into python3.
#
# Options:
#   --prefix DIR  where CRIU goes (default /opt/gpuos)
#   --dev         instead of the gpuos wheel, install this checkout editable with the test
#                 extras: python3 -m pip install -e '.[test]' (python3 must not be externally
#                 managed: use a pyenv or an activated venv); on Debian also the VM that runs
#                 the kernel-facing tests (docs/vm-testing.md): QEMU, the Debian kernel's
#                 headers and what builds the guest, with apt, then tools/vmtest/vmtest.py prepare;
#                 and NVIDIA's open kernel module source with patches/ applied (tools/nvidia-src.sh)
#   --force       with --dev: refetch and reinstall CRIU even if PREFIX/bin/criu already works
#                 (without --force, --dev keeps a working one)
set -euo pipefail

die() { echo "install.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; }

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
prefix=/opt/gpuos dev=0 force=0
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --prefix) prefix=${2:?--prefix needs a value}; shift ;;
    --dev) dev=1 ;;
    --force) force=1 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

managed() { python3 -c 'import os, sys, sysconfig
sys.exit(not (sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))'; }
if [ "$dev" = 1 ] && managed; then
  die "python3 ($(command -v python3)) is externally managed (PEP 668); activate a venv first"
fi

missing=()
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
[ -r "${GPUOS_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}" ] || missing+=(debian-archive-keyring)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run as root or install them"
  echo "install.sh: apt-get install ${missing[*]}"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "$force" = 0 ] && [ "$dev" = 1 ] && v=$("$prefix/bin/criu" --version 2>/dev/null); then
  echo "install.sh: keeping $prefix/bin/criu ($(echo "$v" | head -n1); --force to reinstall)"
elif [ "$dev" = 1 ]; then
  "$here/bundle.sh" "$tmp/bundle" --no-wheels
  "$here/install-bundle.sh" "$tmp/bundle" --prefix "$prefix" --no-python
else  # wheels for this python3 and this machine's glibc
  pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  platform=$(python3 -c 'import platform as p; print("manylinux_%s_%s" % (p.libc_ver()[1].replace(".", "_"), p.machine()))')
  "$here/bundle.sh" "$tmp/bundle" --python-version "$pyver" --platform "$platform"
  "$here/install-bundle.sh" "$tmp/bundle" --prefix "$prefix"
fi
if [ "$dev" = 1 ]; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q -e "${repo}[test]"
  echo "install.sh: installed $repo editable (with test extras) for $(python3 -c 'import sys; print(sys.executable)')"
fi

# The VM for tests/vm: linux-headers-amd64 names the guest's kernel (not the host's).
vm_debs=(qemu-system-x86 linux-headers-amd64 busybox-static mmdebstrap cpio kmod gcc make libc6-dev)
if [ "$dev" = 1 ] && ! grep -qx 'ID=debian' /etc/os-release; then
  echo "install.sh: not Debian, so no VM for the kernel tests (GPUOS_SKIP_VM=1 skips them)"
elif [ "$dev" = 1 ]; then
  missing=()
  for p in "${vm_debs[@]}"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run as root or install them"
    echo "install.sh: apt-get install ${missing[*]}"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  "$here/vmtest/vmtest.py" prepare
  # NVIDIA's open kernel module source, pinned and patched (patches/): its presence
  # is what makes the test suite build the patched driver (tests/unit/test_nvidia_patches.py).
  "$here/nvidia-src.sh" >/dev/null
fi
