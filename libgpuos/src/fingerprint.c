/* SPDX-License-Identifier: MIT */
/*
 * fingerprint.c - the host side of fingerprint.cu: its module, loaded into the current
 * context, and the launch of its hash kernel.
 *
 * Three users: validation (validate.c) hashes every live allocation before and after an
 * operation to see what it changed; eviction under a memory limit (resident.c) hashes
 * a victim to copy out only the chunks that changed since its contents were last
 * copied out; a warm standby (sharemem.c) compares its memory with its client's, and
 * sees what its client wrote.  The last two hash through a gpuos_fp_hasher (module
 * and buffers kept, results read back).  All call the driver through gpuos_drv, on streams of their own, with
 * device memory of libgpuos's own (gpuos_own_dev_alloc: hidden from the allocation map,
 * so neither fingerprinted nor predicted).
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

/* The PTX of fingerprint.cu, embedded by the Makefile (NUL-terminated). */
extern const char gpuos_fingerprint_ptx[];

#define MAX_GRID 65535u

CUresult gpuos_own_dev_alloc(CUdeviceptr *p, size_t bytes)
{
	CUresult r = gpuos_drv.mem_alloc(p, bytes);
	if (r != CUDA_SUCCESS) {
		*p = 0;
		return r;
	}
	gpuos_track_ignore((uint64_t)*p, bytes, 1);
	return CUDA_SUCCESS;
}

void gpuos_own_dev_free(CUdeviceptr *p, size_t bytes)
{
	if (!*p)
		return;
	gpuos_track_ignore((uint64_t)*p, bytes, 0);
	gpuos_drv.mem_free(*p);
	*p = 0;
}

unsigned int gpuos_fp_grid(uint64_t items, uint64_t per_block)
{
	uint64_t g = (items + per_block - 1) / per_block;
	if (g < 1)
		g = 1;
	return g > MAX_GRID ? MAX_GRID : (unsigned int)g;
}

/* The PTX with its ".version" line lowered to 6.4 (CUDA 10.1, the first ISA with sm_75),
 * for drivers older than the nvcc that built it: the kernels use nothing newer.  NULL if
 * there is no such line or no memory.  Caller frees. */
static char *ptx_lowered(void)
{
	const char *s = gpuos_fingerprint_ptx;
	const char *v = strstr(s, "\n.version ");
	if (!v)
		return NULL;
	v++;
	const char *eol = strchr(v, '\n');
	if (!eol)
		return NULL;
	static const char repl[] = ".version 6.4";
	size_t head = (size_t)(v - s), tail = strlen(eol);
	char *out = malloc(head + sizeof repl - 1 + tail + 1);
	if (!out)
		return NULL;
	memcpy(out, s, head);
	memcpy(out + head, repl, sizeof repl - 1);
	memcpy(out + head + sizeof repl - 1, eol, tail + 1);
	return out;
}

CUresult gpuos_fp_load(CUmodule *mod)
{
	if (!gpuos_drv.module_load_data)
		return CUDA_ERROR_NOT_FOUND;
	CUresult r = gpuos_drv.module_load_data(mod, gpuos_fingerprint_ptx);
	if (r == CUDA_ERROR_UNSUPPORTED_PTX_VERSION || r == CUDA_ERROR_INVALID_PTX || r == CUDA_ERROR_INVALID_IMAGE) {
		char *low = ptx_lowered();
		if (low) {
			CUresult r2 = gpuos_drv.module_load_data(mod, low);
			free(low);
			if (r2 == CUDA_SUCCESS)
				r = r2;
		}
	}
	if (r != CUDA_SUCCESS)
		*mod = NULL;
	return r;
}

int gpuos_fp_hasher_reserve(struct gpuos_fp_hasher *h, size_t nseg, uint64_t n)
{
	if (h->broken)
		return -1;
	if (!h->fn && (gpuos_fp_load(&h->mod) != CUDA_SUCCESS ||
		       gpuos_drv.module_get_function(&h->fn, h->mod, "gpuos_fp_hash") != CUDA_SUCCESS)) {
		h->fn = NULL;
		h->broken = 1;
		return -1;
	}
	if (nseg > h->cap_segs) {
		gpuos_own_dev_free(&h->d_segs, h->cap_segs * sizeof(struct gpuos_fp_seg));
		h->cap_segs = 0;
		if (gpuos_own_dev_alloc(&h->d_segs, nseg * sizeof(struct gpuos_fp_seg)) != CUDA_SUCCESS)
			return -1;
		h->cap_segs = nseg;
	}
	if (n > h->cap_n) {
		gpuos_own_dev_free(&h->d_out, h->cap_n * 8);
		h->cap_n = 0;
		if (gpuos_own_dev_alloc(&h->d_out, n * 8) != CUDA_SUCCESS)
			return -1;
		h->cap_n = n;
	}
	return 0;
}

int gpuos_fp_hasher_run(struct gpuos_fp_hasher *h, const struct gpuos_fp_seg *segs, size_t nseg, uint64_t *out,
			uint64_t n, CUstream s)
{
	if (gpuos_fp_hasher_reserve(h, nseg, n))
		return -1;
	return gpuos_drv.memcpy_htod_async(h->d_segs, segs, nseg * sizeof *segs, s) == CUDA_SUCCESS &&
			       gpuos_fp_hash(h->fn, h->d_segs, (unsigned int)nseg, h->d_out, n, s) == CUDA_SUCCESS &&
			       gpuos_drv.memcpy_dtoh_async(out, h->d_out, n * 8, s) == CUDA_SUCCESS &&
			       gpuos_drv.stream_sync(s) == CUDA_SUCCESS
		       ? 0
		       : -1;
}

CUresult gpuos_fp_hash(CUfunction hash, CUdeviceptr segs, unsigned int nseg, CUdeviceptr out, uint64_t nchunks,
		       CUstream s)
{
	if (!nseg || !nchunks)
		return CUDA_SUCCESS;
	unsigned long long nch = nchunks;
	void *args[] = { &segs, &nseg, &out, &nch };
	return gpuos_drv.launch_kernel(hash, gpuos_fp_grid(nchunks, GPUOS_FP_BLOCK / 32), 1, 1, GPUOS_FP_BLOCK, 1, 1, 0,
				       s, args, NULL);
}
