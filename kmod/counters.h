/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * The GPUOS_CTR_* counters (GPUOS_A_COUNTERS in GET_INFO), and the allocation
 * wrappers that keep GPUOS_CTR_OBJECTS equal to the number of live objects
 * the module allocated, so that a test can look for leaks after a fuzz run.
 */
#ifndef _GPUOS_COUNTERS_H
#define _GPUOS_COUNTERS_H

#include <linux/atomic.h>
#include <linux/types.h>
#include <linux/gfp.h>

#include "uapi/gpuos.h"

extern atomic64_t gpuos_counters[__GPUOS_CTR_MAX];

static inline void gpuos_ctr_add(enum gpuos_counter c, s64 n)
{
	atomic64_add(n, &gpuos_counters[c]);
}

static inline void gpuos_ctr_inc(enum gpuos_counter c)
{
	atomic64_inc(&gpuos_counters[c]);
}

static inline void gpuos_ctr_set(enum gpuos_counter c, s64 v)
{
	atomic64_set(&gpuos_counters[c], v);
}

static inline u64 gpuos_ctr_read(enum gpuos_counter c)
{
	return atomic64_read(&gpuos_counters[c]);
}

/* Counts @err as a request refused for bad input, and returns it. */
static inline int gpuos_reject(int err)
{
	gpuos_ctr_inc(GPUOS_CTR_REJECTED);
	return err;
}

/*
 * Every allocation of policies, batches and work items goes through these.
 * An object stops counting when it is released for good, which for a
 * policy is when it is handed to call_rcu() (the memory follows a grace
 * period later; module exit waits for it with rcu_barrier()): so once a
 * DEL_POLICY reply is out, OBJECTS no longer counts that policy.
 */
void *gpuos_kmalloc(size_t size, gfp_t gfp);
void *gpuos_kvmalloc(size_t size, gfp_t gfp);
void gpuos_kfree(const void *p);
void gpuos_kvfree(const void *p);

/* The object is released; kfree() it later without counting again. */
static inline void gpuos_obj_released(void)
{
	gpuos_ctr_add(GPUOS_CTR_OBJECTS, -1);
}

#endif /* _GPUOS_COUNTERS_H */
