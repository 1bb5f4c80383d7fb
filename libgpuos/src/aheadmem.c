/* SPDX-License-Identifier: MIT */
/*
 * aheadmem.c - a warm standby makes ahead the device memory its client allocated after
 * its first kernel launch (docs/mps.md).
 *
 * After a fault, a released standby's first iteration allocated device memory (cuMemAlloc:
 * an RM allocation, and UVM's mapping of it).  While the driver tears down the faulted
 * processes it holds the RM lock, and those calls waited for it: after a trap, 0.2-1.3 s
 * (H100, bench/mps_faults.py --kernel-waits).  So the client (GPUOS_MPS_KERNELS, preload.c)
 * writes down the sizes of its first cuMemAllocs after its first launch (AHEAD_ALLOCS at
 * most, AHEAD_BYTES in all) to LIST.allocs; its warm standby, while it waits, makes
 * allocations of those sizes, and after its release hands one out for a cuMemAlloc of the
 * same size instead of asking the driver.  They are ordinary allocations: freed, they go
 * back to the driver; those never asked for stay the standby's until it exits.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"

#define AHEAD_ALLOCS 64
#define AHEAD_BYTES (1ull << 30)

/* The client: the sizes noted, to write. */
static pthread_mutex_t note_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t noted[AHEAD_ALLOCS];
static size_t nnoted, noted_bytes;
static int noted_dirty;

/* The standby: the allocations made, each handed out once. */
static struct made {
	uint64_t size;
	CUdeviceptr ptr;
	int taken;
} made[AHEAD_ALLOCS];
static size_t nmade;
static CUcontext made_ctx; /* where they were made: handed out only to calls in it */
int gpuos_aheadmem_left; /* made and not handed out (read without the lock first) */
static pthread_mutex_t made_mu = PTHREAD_MUTEX_INITIALIZER;

void gpuos_aheadmem_note(uint64_t bytes)
{
	if (!gpuos_preload_launched() || gpuos_blaswarm_thread)
		return; /* before the first launch (the standby makes those itself), or ours */
	pthread_mutex_lock(&note_mu);
	if (nnoted < AHEAD_ALLOCS && noted_bytes + bytes <= AHEAD_BYTES) {
		noted[nnoted++] = bytes;
		noted_bytes += bytes;
		noted_dirty = 1;
	}
	pthread_mutex_unlock(&note_mu);
}

void gpuos_aheadmem_write(const char *list_path)
{
	pthread_mutex_lock(&note_mu);
	if (!noted_dirty) {
		pthread_mutex_unlock(&note_mu);
		return;
	}
	noted_dirty = 0;
	char path[4096], tmp[4200];
	FILE *f = NULL;
	if (snprintf(path, sizeof path, "%s.allocs", list_path) < (int)sizeof path &&
	    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) < (int)sizeof tmp)
		f = fopen(tmp, "we");
	if (f) {
		for (size_t i = 0; i < nnoted; i++)
			fprintf(f, "%llu\n", (unsigned long long)noted[i]);
		if (fclose(f) || rename(tmp, path)) {
			gpuos_dbg("aheadmem: cannot write %s: %s", path, strerror(errno));
			unlink(tmp);
		}
	}
	pthread_mutex_unlock(&note_mu);
}

/* In the standby's context (the loader's thread): 1 made, 0 no list yet, -1 never. */
int gpuos_aheadmem_make(const char *list_path)
{
	char path[4096];
	if (snprintf(path, sizeof path, "%s.allocs", list_path) >= (int)sizeof path)
		return -1;
	FILE *f = fopen(path, "re");
	if (!f)
		return 0; /* not written yet: the client may not have launched */
	CUcontext ctx = NULL;
	if (!gpuos_drv.ctx_get_current || gpuos_drv.ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx) {
		fclose(f);
		return -1; /* (the loader runs in the standby's context: not expected) */
	}
	unsigned long long size;
	uint64_t bytes = 0;
	size_t n = 0;
	pthread_mutex_lock(&made_mu);
	made_ctx = ctx;
	while (n < AHEAD_ALLOCS && fscanf(f, "%llu", &size) == 1) {
		if (!size || bytes + size > AHEAD_BYTES)
			break;
		if (gpuos_drv.mem_alloc(&made[n].ptr, (size_t)size) != CUDA_SUCCESS)
			break; /* no more room on the GPU: what was made is handed out */
		made[n].size = size;
		bytes += size;
		n++;
	}
	nmade = n;
	__atomic_store_n(&gpuos_aheadmem_left, (int)n, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&made_mu);
	fclose(f);
	gpuos_dbg("aheadmem: %zu allocations (%llu bytes) made ahead", n, (unsigned long long)bytes);
	return 1;
}

int gpuos_aheadmem_take(CUdeviceptr *dptr, uint64_t bytes)
{
	if (gpuos_blaswarm_thread || !__atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE))
		return 0; /* the warm-up's own, or (nothing else allocates then) before the release */
	CUcontext ctx = NULL;
	if (!gpuos_drv.ctx_get_current || gpuos_drv.ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx)
		return 0;
	int got = 0;
	pthread_mutex_lock(&made_mu);
	for (size_t i = 0; ctx == made_ctx && i < nmade; i++)
		if (!made[i].taken && made[i].size == bytes) {
			made[i].taken = 1;
			*dptr = made[i].ptr;
			__atomic_sub_fetch(&gpuos_aheadmem_left, 1, __ATOMIC_RELEASE);
			got = 1;
			break;
		}
	pthread_mutex_unlock(&made_mu);
	return got;
}

void gpuos_aheadmem_counts(size_t *n_made, size_t *n_taken)
{
	pthread_mutex_lock(&made_mu);
	*n_made = nmade;
	*n_taken = nmade - (size_t)__atomic_load_n(&gpuos_aheadmem_left, __ATOMIC_ACQUIRE);
	pthread_mutex_unlock(&made_mu);
}
