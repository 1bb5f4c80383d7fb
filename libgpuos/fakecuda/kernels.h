/* SPDX-License-Identifier: MIT */
/* kernels.h - the fake driver's built-in kernel registry (internal to libcuda.so.1). */
#ifndef FAKECUDA_KERNELS_H
#define FAKECUDA_KERNELS_H

#define FK_MAXP 8

struct fk {
	const char *name;
	void (*fn)(void **params);   /* runs the whole grid; params[i] points at parameter i */
	unsigned nparams;
	unsigned off[FK_MAXP];       /* parameter layout (as cuFuncGetParamInfo reports it) */
	unsigned size[FK_MAXP];
	unsigned total;              /* bytes of the parameter buffer (extra / captured copies) */
	int opaque;                  /* cuFuncGetParamInfo says CUDA_ERROR_NOT_SUPPORTED */
	int fp;                      /* libgpuos's own: gpuos_fp_* (validator), gpuos_printf_ready */
};

extern const struct fk fake_kernels[] __attribute__((visibility("hidden")));

/* For kernels: [p, p + bytes) is GPU-accessible memory (bytes <= 0: nothing to check).
 * On failure it marks the running launch as faulted (CUDA_ERROR_ILLEGAL_ADDRESS) and
 * the kernel must return without touching memory. */
int fake_range_ok(const void *p, long long bytes) __attribute__((visibility("hidden")));
extern const unsigned fake_nkernels __attribute__((visibility("hidden")));

#endif
