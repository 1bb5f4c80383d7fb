/*******************************************************************************
    gpuos prefetch ranges: which of the ranges gpuos.ko holds for an address
    space fall in one va_block, apart from UVM's state.

    nvidia-uvm (uvm_gpuos.c, uvm_gpuos_prefetch_pages) looks up the ranges near
    a va_block (gpuos_prefetch_lookup: those meeting its 2 MiB window, clipped
    to it), clips them here to the block's [start, end], and adds their pages
    that are neither faulted nor resident to the block's prefetch mask.  No
    lock, no allocation: gpuos's tests compile this file unchanged in user
    space (ASan/UBSan) and in a kernel test module.  It lives in the gpuos
    repository (patches/nvidia-uvm/); tools/nvidia-src.sh copies it into the
    patched tree as nvidia-uvm/gpuos/.

    SPDX-License-Identifier: MIT
*******************************************************************************/

#ifndef __UVM_GPUOS_PREFETCH_H__
#define __UVM_GPUOS_PREFETCH_H__

#include "uvm_gpuos_types.h"
#include "include/gpuos_hooks.h"

// An inclusive span of addresses within a block.
struct gpuos_span
{
    u64 first;
    u64 last;
};

// Writes to out (n entries at most) the part of each of ranges[0..n) that
// lies within [block_start, block_last], in the order given, skipping empty
// ranges and those outside the block; returns how many.  Never overflows:
// a range running past the top of the address space ends there.
u32 gpuos_prefetch_clip(const struct gpuos_prefetch_range *ranges, u32 n,
                        u64 block_start, u64 block_last, struct gpuos_span *out);

#endif // __UVM_GPUOS_PREFETCH_H__
