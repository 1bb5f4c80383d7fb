/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * Per-address-space prefetch ranges (GPUOS_CMD_SET_PREFETCH), read by the
 * driver's fault servicing through gpuos_prefetch_lookup (gpuos_hooks.h).
 */
#ifndef _GPUOS_PREFETCH_H
#define _GPUOS_PREFETCH_H

#include "include/gpuos_hooks.h"

/*
 * Replaces @as_id's ranges with @r[0..nr) (nr 0: clears them).  Sorts @r in
 * place.  0, -EINVAL (a range misaligned, empty, overflowing, or two
 * overlapping), -E2BIG (nr > GPUOS_MAX_NL_RANGES), -ENOSPC (a new address
 * space past GPUOS_MAX_PREFETCH_AS), -ENOMEM.  Process context.
 */
int gpuos_prefetch_set(u64 as_id, struct gpuos_prefetch_range *r, u32 nr);

int gpuos_prefetch_init(void);
void gpuos_prefetch_exit(void);

#endif /* _GPUOS_PREFETCH_H */
