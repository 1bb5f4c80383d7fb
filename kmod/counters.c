// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * Counters.  Plain atomics: they are read rarely (GET_INFO) and written from
 * every context, including the atomic fault path, so no locks and no per-CPU
 * sums that a reader would have to fold.
 */
#include <linux/slab.h>
#include <linux/mm.h>

#include "counters.h"

atomic64_t gpuos_counters[__GPUOS_CTR_MAX];

void *gpuos_kmalloc(size_t size, gfp_t gfp)
{
	void *p = kmalloc(size, gfp);

	if (p)
		gpuos_ctr_inc(GPUOS_CTR_OBJECTS);
	return p;
}

void *gpuos_kvmalloc(size_t size, gfp_t gfp)
{
	void *p = kvmalloc(size, gfp);

	if (p)
		gpuos_ctr_inc(GPUOS_CTR_OBJECTS);
	return p;
}

void gpuos_kfree(const void *p)
{
	if (!p)
		return;
	kfree(p);
	gpuos_ctr_add(GPUOS_CTR_OBJECTS, -1);
}

void gpuos_kvfree(const void *p)
{
	if (!p)
		return;
	kvfree(p);
	gpuos_ctr_add(GPUOS_CTR_OBJECTS, -1);
}
