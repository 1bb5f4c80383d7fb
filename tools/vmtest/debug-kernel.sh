#!/usr/bin/env bash
# debug-kernel.sh - build a kernel with KASAN, lockdep and DEBUG_ATOMIC_SLEEP for the VM
# tests (vmtest.py --kernel-tree DIR, or GPUOS_VM_KERNEL_TREE=DIR).
#
# Usage: tools/vmtest/debug-kernel.sh [DIR]     (default: $GPUOS_VM_CACHE/debug-kernel,
#                                                 $GPUOS_VM_CACHE defaulting to /var/cache/gpuos-vm)
#
# Debian's linux-source-6.1 (apt), x86_64 defconfig + kvm_guest.config, with what the
# VM needs built in (virtio-pci, 9p, overlayfs: the initramfs then loads no module) and
# the checks: KASAN (generic, inline), PROVE_LOCKING, DEBUG_ATOMIC_SLEEP, UBSAN bounds;
# IKHEADERS, so that bcc finds the headers of the running kernel (gpuos trace).
# Builds bzImage and vmlinux.symvers only (modules_prepare for out-of-tree modules):
# about 20 minutes on 2 cores. Does nothing if DIR already holds this configuration's
# build. Runs as root (apt-get).
set -euo pipefail

dir=${1:-${GPUOS_VM_CACHE:-/var/cache/gpuos-vm}/debug-kernel}
options=(DEBUG_KERNEL KASAN KASAN_GENERIC KASAN_INLINE PROVE_LOCKING LOCKDEP DEBUG_LOCK_ALLOC
         DEBUG_ATOMIC_SLEEP UBSAN UBSAN_BOUNDS NET_9P NET_9P_VIRTIO 9P_FS 9P_FS_POSIX_ACL
         OVERLAY_FS VIRTIO_PCI DEBUG_FS CGROUPS MEMCG BPF_SYSCALL FTRACE MODULES MODULE_UNLOAD
         IKHEADERS DEBUG_INFO_NONE)
key=$(printf '%s\n' "${options[@]}" | sha256sum | cut -c1-16)
if [ -f "$dir/.gpuos-key" ] && [ "$(cat "$dir/.gpuos-key")" = "$key" ] && [ -f "$dir/arch/x86/boot/bzImage" ]; then
  echo "debug-kernel.sh: $dir is built"; exit 0
fi
apt-get install -y -qq linux-source-6.1 bc bison flex libelf-dev libssl-dev >/dev/null
tarball=$(ls /usr/src/linux-source-6.1*.tar.xz | head -n1)
rm -rf "$dir.new" && mkdir -p "$dir.new"
tar -xf "$tarball" -C "$dir.new" --strip-components=1
cd "$dir.new"
make -s defconfig && make -s kvm_guest.config
./scripts/config $(printf -- '-e %s ' "${options[@]}") -d DEBUG_INFO -d DEBUG_INFO_BTF
make -s olddefconfig
for o in KASAN PROVE_LOCKING DEBUG_ATOMIC_SLEEP 9P_FS OVERLAY_FS VIRTIO_PCI; do
  grep -q "^CONFIG_$o=y" .config || { echo "debug-kernel.sh: CONFIG_$o did not stay on" >&2; exit 1; }
done
t0=$(date +%s)
make -j"$(nproc)" bzImage modules_prepare >build.log 2>&1 || { tail -40 build.log >&2; exit 1; }
echo "$key" > .gpuos-key
cd / && rm -rf "$dir" && mv "$dir.new" "$dir"
echo "debug-kernel.sh: built $dir ($(cat "$dir/include/config/kernel.release")) in $(( $(date +%s) - t0 )) s"
