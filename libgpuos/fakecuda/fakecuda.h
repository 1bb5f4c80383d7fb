/* SPDX-License-Identifier: MIT */
/*
 * fakecuda.h - a fake libcuda.so.1 for host tests of libgpuos (no GPU needed).
 *
 * The fake exports the real CUDA 13 driver ABI (names and signatures of cuda.h) for
 * the subset of entry points that libgpuos hooks.  "Device" memory is host memory
 * (a CUdeviceptr is a host address, 4096-aligned), kernels are C functions of a
 * built-in registry that run synchronously, once per launch, under one process-wide
 * mutex.  Every module (cuModuleLoad*, cuLibraryLoad*) exposes every registry kernel
 * whatever the image holds (any NUL-terminated text).
 *
 * Built-in kernels (their parameter layouts are what cuFuncGetParamInfo /
 * cuKernelGetParamInfo report):
 *   fake_fill(float *out, float v, int n)                 out[i] = v
 *   fake_saxpy(float a, const float *x, float *y, int n)  y[i] = a*x[i] + y[i]
 *   fake_struct(struct fake_struct_arg s)                 s.dst[i] = 2*s.src[i] (one 24-byte param)
 *   fake_interior(float *p, int n)                        p[i] = i + 0.5 (p may be interior)
 *   fake_indirect(float **ptrs, int nptrs, int n)         ptrs[j][i] = j + 1 (ptrs: device array)
 *   fake_opaque(float *out, int n)                        out[i] = 7; param info: NOT_SUPPORTED
 *   fake_noop(void *a, void *b, void *c, void *d)         nothing
 *   fake_gather(struct fake_gather_arg g, float *out, int n)  out[i] = sum over j of g.src[j][i]
 *                                                         (16 pointers in one by-value struct)
 *   fake_strided(int n, struct fake_strided_arg f)        f.data[0][i] = f.data[1][i] + f.data[2][i]
 *                                                         (PyTorch's elementwise_kernel shape: 504
 *                                                         bytes of integers, then 3 pointers)
 *   gpuos_fp_hash(const struct fakecuda_fp_seg *segs, unsigned nsegs, uint64_t *out,
 *                 uint64_t nchunks)   out[first_chunk + c] = FNV-1a of 4 KiB chunk c of each seg
 *   gpuos_fp_diff(const uint64_t *before, const uint64_t *after, uint64_t nchunks,
 *                 uint64_t *changed, unsigned *count)  changed[(*count)++] = c where they differ
 *
 * Statistics: fakecuda_stats() and fakecuda_calls() below.  With FAKECUDA_STATS=PATH
 * in the environment the fake writes its statistics as one JSON object to PATH at exit
 * ("%p" in PATH is replaced by the pid, for forked children).  FAKECUDA_DEBUG=1 prints
 * every failing call on stderr.
 */
#ifndef FAKECUDA_H
#define FAKECUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The by-value parameter of fake_struct (24 bytes). */
#define FAKE_GATHER_SRCS 16
struct fake_gather_arg {
	const float *src[FAKE_GATHER_SRCS];
};

/* The by-value functor of fake_strided, shaped like the lambda of PyTorch's
 * elementwise_kernel: an offset calculator (per dimension a divisor with its magic number
 * and shift, and strides) and then the data pointers (528 bytes). */
#define FAKE_STRIDED_DIMS 25
struct fake_strided_arg {
	int dims;
	unsigned divisor[FAKE_STRIDED_DIMS][3];
	unsigned stride[FAKE_STRIDED_DIMS][2];
	float *data[3];
};

struct fake_struct_arg {
	int n;
	int pad;
	float *src;
	float *dst;
};

/* One segment of gpuos_fp_hash. */
struct fakecuda_fp_seg {
	uint64_t base;
	uint64_t size;
	uint64_t first_chunk;
};

#define FAKECUDA_CHUNK 4096
#define FAKECUDA_DRIVER_VERSION 13000
#define FAKECUDA_TOTAL_MEM (16ULL << 30)   /* what cuMemGetInfo/cuDeviceTotalMem report */
#define FAKECUDA_GRANULARITY (2ULL << 20)  /* VMM granularity */

struct fakecuda_stats {
	uint64_t calls;          /* entry-point calls (all of them) */
	uint64_t errors;         /* calls that returned an error */
	uint64_t launches;       /* kernels run: launches and graph kernel nodes, not gpuos_fp_* */
	uint64_t fp_launches;    /* gpuos_fp_hash / gpuos_fp_diff runs (the validator's) */
	uint64_t captured;       /* operations recorded into a capturing stream's graph */
	uint64_t graph_launches; /* cuGraphLaunch runs */
	uint64_t copies;         /* copies run (every cuMemcpy* and graph memcpy node) */
	uint64_t bytes_copied;
	uint64_t memsets;        /* memsets run (cuMemset* and graph memset nodes) */
	uint64_t bytes_set;
	uint64_t write_values;   /* cuStreamWriteValue32/64 */
	uint64_t allocs;         /* allocations made (device, pitch, async, managed, host, registered, VMM maps) */
	uint64_t frees;          /* and released */
	uint64_t live_allocs;    /* of those kinds, now live */
	uint64_t live_bytes;
	uint64_t vmm_reserves;   /* cuMemAddressReserve */
	uint64_t vmm_creates;    /* cuMemCreate */
};

/* Fill *out; returns 0. */
int fakecuda_stats(struct fakecuda_stats *out);

/* Calls of one exported entry point by its exported name ("cuMemAlloc_v2",
 * "cuLaunchKernel_ptsz"; "cuFakeInternalOnly" for the internal one); -1 for an
 * unknown name. */
long long fakecuda_calls(const char *exported_name);

/* Zero every counter (live_* excepted). */
void fakecuda_reset_stats(void);

#ifdef __cplusplus
}
#endif

#endif /* FAKECUDA_H */
