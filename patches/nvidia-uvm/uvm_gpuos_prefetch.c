/*******************************************************************************
    gpuos prefetch ranges (see uvm_gpuos_prefetch.h).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#include "uvm_gpuos_prefetch.h"

u32 gpuos_prefetch_clip(const struct gpuos_prefetch_range *ranges, u32 n,
                        u64 block_start, u64 block_last, struct gpuos_span *out)
{
    u32 i, nr = 0;

    for (i = 0; i < n; i++) {
        u64 first = ranges[i].base;
        u64 last = ranges[i].base + ranges[i].len - 1;

        if (ranges[i].len == 0)
            continue;
        if (last < first)   // wrapped past the top
            last = ~0ull;
        if (first > block_last || last < block_start)
            continue;

        out[nr].first = first > block_start ? first : block_start;
        out[nr].last = last < block_last ? last : block_last;
        nr++;
    }
    return nr;
}
