/* SPDX-License-Identifier: MIT */
/*
 * common.h - helpers of the C test programs that drive the fake CUDA driver.
 *
 * A program calls the driver through CU(sym, args...) (or CU_ERR(expected, sym, ...)),
 * where sym is the exported name it means (cuMemAlloc_v2, cuLaunchKernel, ...).
 * How sym is reached is the program's FN(sym) macro, defined before including this
 * file: directly (linked with -lcuda), through dlsym, or through cuGetProcAddress.
 * FN tallies the exported name actually called; at the end finish() checks that the
 * fake saw exactly as many calls of each (so an interposer such as libgpuos.so called
 * through exactly once; queries it may make itself: at least as many), checks the fake's counts of kernels run and copies, and
 * prints the program's one JSON line.  With GPUOS_VALIDATE=1 in the environment the
 * validator adds its own calls: then only kernel runs (the fake counts the
 * validator's fingerprint kernels apart) are compared.
 */
#ifndef GPUOS_TESTS_COMMON_H
#define GPUOS_TESTS_COMMON_H

#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fakecuda.h"

static int g_fail;

/* Failed checks are counted; the first 20 are printed. */
#define CHECK(cond, ...) do { \
	if (!(cond)) { \
		if (g_fail < 20) { \
			fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__); \
			fputc('\n', stderr); \
		} \
		g_fail++; \
	} \
} while (0)

/* Calls per exported name, as the program made them. */
#define MAX_TALLY 256
static struct { const char *name; long long n; } g_tally[MAX_TALLY];
static int g_ntally;

static inline void tally(const char *name)
{
	for (int i = 0; i < g_ntally; i++)
		if (!strcmp(g_tally[i].name, name)) {
			g_tally[i].n++;
			return;
		}
	if (g_ntally < MAX_TALLY) {
		g_tally[g_ntally].name = name;
		g_tally[g_ntally++].n = 1;
	}
}

static const char *cu_name(CUresult r)
{
	static char buf[32];
	switch (r) {
	case CUDA_SUCCESS: return "CUDA_SUCCESS";
	case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
	case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
	case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
	case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
	case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
	case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
	case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
	case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
	case CUDA_ERROR_ILLEGAL_STATE: return "CUDA_ERROR_ILLEGAL_STATE";
	case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
	case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
	case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
	default: snprintf(buf, sizeof(buf), "CUresult %d", (int)r); return buf;
	}
}

static inline CUresult cu_check(CUresult r, CUresult want, const char *sym, const char *file, int line)
{
	if (r != want) {
		if (g_fail < 20)
			fprintf(stderr, "%s:%d: %s returned %s, expected %s\n", file, line, sym, cu_name(r),
				cu_name(want));
		g_fail++;
	}
	return r;
}

#define CU(sym, ...) cu_check(FN(sym)(__VA_ARGS__), CUDA_SUCCESS, #sym, __FILE__, __LINE__)
#define CU_ERR(want, sym, ...) cu_check(FN(sym)(__VA_ARGS__), want, #sym, __FILE__, __LINE__)
/* A call made some other way (a pointer the program holds): not tallied here. */
#define CU_CALL(want, call) cu_check((call), want, #call, __FILE__, __LINE__)

/* Deterministic pseudo-random numbers (xorshift64*). */
static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static inline void rng_seed(uint64_t s) { g_rng = s ? s * 0x9e3779b97f4a7c15ULL : 1; }
static inline uint64_t rng_next(void)
{
	g_rng ^= g_rng >> 12;
	g_rng ^= g_rng << 25;
	g_rng ^= g_rng >> 27;
	return g_rng * 0x2545f4914f6cdd1dULL;
}
static inline float rng_float(void) { return (float)(rng_next() >> 40) / (float)(1 << 24) * 2.0f - 1.0f; }
static inline void rng_fill(float *p, size_t n) { for (size_t i = 0; i < n; i++) p[i] = rng_float(); }

static inline uint64_t seed_from_args(int argc, char **argv)
{
	if (argc > 1)
		return strtoull(argv[1], NULL, 0);
	return (uint64_t)time(NULL);
}

/* FNV-1a over result bytes: the checksum the programs print. */
static uint64_t g_sum = 0xcbf29ce484222325ULL;
static inline void sum_bytes(const void *p, size_t n)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < n; i++) {
		g_sum ^= b[i];
		g_sum *= 0x100000001b3ULL;
	}
}

static inline int feq(float a, float b) { return fabsf(a - b) <= 1e-5f * (1.0f + fabsf(b)); }

/* Check out[0..n) == want[0..n). */
static inline void check_floats(const char *what, const float *out, const float *want, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!feq(out[i], want[i])) {
			CHECK(0, "%s[%zu] = %g, expected %g", what, i, out[i], want[i]);
			return;
		}
}

/* Check out[0..n) == value, exactly (what a fill or a memset of it must leave). */
static inline void check_all(const char *what, const float *out, size_t n, float value)
{
	for (size_t i = 0; i < n; i++)
		if (out[i] != value) {
			CHECK(0, "%s[%zu] = %g, expected %g", what, i, out[i], value);
			return;
		}
}

/* What the program did, by category (printed, and compared with the fake's counts). */
struct counts {
	long long allocs, frees;
	long long alloc_device, alloc_pitch, alloc_async, alloc_managed, alloc_host, alloc_registered;
	long long vmm_reserve, vmm_create, alloc_vmm_map;
	long long launches;       /* launch calls that ran a kernel */
	long long captured;       /* operations issued into a capturing stream */
	long long copies, memsets, write_values;
	long long graph_launches, graph_kernels, graph_copies, graph_memsets;
};
static struct counts C;

/* The fake's statistics functions, found in the loaded libcuda.so.1. */
static void *fake_sym(const char *name)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	void *p = h ? dlsym(h, name) : NULL;
	if (!p) {
		fprintf(stderr, "fake driver symbol %s not found (not running on the fake?)\n", name);
		exit(2);
	}
	return p;
}

static inline int validating(void)
{
	const char *v = getenv("GPUOS_VALIDATE");
	return v && *v && *v != '0';
}

static int listed(const char *name, const char *const *q, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(q[i], name))
			return 1;
	return 0;
}

/* Queries an interposer may also make itself (layouts, names, capture state, the
 * current context, ...): the fake may see more of them than the program made.  Every
 * other entry point must reach the fake exactly as often as the program called it. */
static int query_call(const char *name)
{
	static const char *const q[] = {
		"cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName",
		"cuDeviceGetAttribute", "cuCtxGetCurrent", "cuCtxGetDevice", "cuCtxGetDevice_v2",
		"cuCtxSynchronize", "cuCtxSynchronize_v2", "cuCtxGetApiVersion", "cuGetErrorName",
		"cuGetErrorString", "cuGetProcAddress", "cuGetProcAddress_v2", "cuFuncGetName",
		"cuKernelGetName", "cuFuncGetParamInfo", "cuKernelGetParamInfo", "cuKernelGetFunction",
		"cuLibraryGetModule", "cuPointerGetAttribute", "cuMemGetAddressRange_v2", "cuMemGetInfo_v2",
		"cuStreamIsCapturing", "cuStreamIsCapturing_ptsz", "cuStreamGetCaptureInfo_v3",
		"cuStreamGetCaptureInfo_v3_ptsz", "cuStreamQuery", "cuStreamQuery_ptsz", "cuEventQuery",
		"cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2",
		"cuGraphMemcpyNodeGetParams", "cuGraphMemsetNodeGetParams", "cuGraphChildGraphNodeGetGraph",
	};
	return listed(name, q, sizeof(q) / sizeof(q[0]));
}

/* Under `gpuos run --memory movable` libgpuos serves large cuMemAllocs with VMM calls of
 * its own (libgpuos/src/memory.c): the fake's counts of allocation calls are then not the
 * program's. */
static int movable_call(const char *name)
{
	static const char *const q[] = {
		"cuMemAlloc_v2", "cuMemFree_v2", "cuMemFreeAsync", "cuMemFreeAsync_ptsz",
		"cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
		"cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuStreamSynchronize",
	};
	const char *m = getenv("GPUOS_MEMORY");
	if (!m || strcmp(m, "movable"))
		return 0;
	return listed(name, q, sizeof(q) / sizeof(q[0]));
}

/* A warm standby (waiting at its first launch) whose environment sets `var`. */
static int warm_standby_with(const char *var)
{
	const char *v = getenv(var), *at = getenv("GPUOS_MPS_STANDBY_AT");
	return v && *v && at && !strcmp(at, "launch");
}

/* Calls a warm standby's preloading makes too (libgpuos/src/preload.c; the last three:
 * its kernel that can print, to have the printf buffer made). */
static int preload_call(const char *name)
{
	static const char *const q[] = {
		"cuModuleGetFunction", "cuLibraryGetKernel", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
		"cuModuleLoadData", "cuLaunchKernel", "cuStreamSynchronize",
	};
	return warm_standby_with("GPUOS_MPS_KERNELS") && listed(name, q, sizeof(q) / sizeof(q[0]));
}

/* A warm standby's cuBLAS warm-up runs (libgpuos/src/blaswarm.c; the test preloads a
 * stand-in cuBLAS that logs to FAKE_CUBLAS_LOG): its calls are not the program's. */
static int blaswarm_on(void)
{
	const char *off = getenv("GPUOS_MPS_STANDBY_CUBLAS");
	return warm_standby_with("FAKE_CUBLAS_LOG") && !(off && !strcmp(off, "0"));
}

static int blaswarm_call(const char *name)
{
	static const char *const q[] = {
		"cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuStreamCreate", "cuLaunchKernel",
		"cuStreamSynchronize", "cuMemAlloc_v2", "cuMemFree_v2",
	};
	return blaswarm_on() && listed(name, q, sizeof(q) / sizeof(q[0]));
}

/* Compare with the fake; print {"prog": ..., counts..., extra..., "checksum": ...}.
 * extra: more JSON members (", \"k\": v" ...) or "". Returns the exit status. */
static int finish(const char *prog, const char *extra)
{
	int (*stats)(struct fakecuda_stats *) = (int (*)(struct fakecuda_stats *))fake_sym("fakecuda_stats");
	long long (*calls)(const char *) = (long long (*)(const char *))fake_sym("fakecuda_calls");
	struct fakecuda_stats s;
	stats(&s);
	CHECK((long long)s.launches == C.launches + C.graph_kernels,
	      "fake ran %llu kernels, program launched %lld (+%lld in graphs)",
	      (unsigned long long)s.launches, C.launches, C.graph_kernels);
	if (!validating()) {
		for (int i = 0; i < g_ntally; i++) {
			long long got = calls(g_tally[i].name), want = g_tally[i].n;
			if (movable_call(g_tally[i].name))
				continue;
			if (query_call(g_tally[i].name) || preload_call(g_tally[i].name) ||
			    blaswarm_call(g_tally[i].name))
				CHECK(got >= want, "%s: fake saw %lld calls, program made %lld",
				      g_tally[i].name, got, want);
			else
				CHECK(got == want, "%s: fake saw %lld calls, program made %lld (exactly once each?)",
				      g_tally[i].name, got, want);
		}
		CHECK((long long)s.copies == C.copies + C.graph_copies, "fake ran %llu copies, expected %lld",
		      (unsigned long long)s.copies, C.copies + C.graph_copies);
		CHECK((long long)s.memsets == C.memsets + C.graph_memsets, "fake ran %llu memsets, expected %lld",
		      (unsigned long long)s.memsets, C.memsets + C.graph_memsets);
		CHECK(movable_call("cuMemAlloc_v2") || (long long)s.allocs == C.allocs ||
		      (blaswarm_on() && (long long)s.allocs > C.allocs),
		      "fake made %llu allocations, expected %lld", (unsigned long long)s.allocs, C.allocs);
		CHECK(movable_call("cuMemFree_v2") || (long long)s.frees == C.frees ||
		      (blaswarm_on() && (long long)s.frees > C.frees),
		      "fake freed %llu allocations, expected %lld", (unsigned long long)s.frees, C.frees);
		CHECK((long long)s.captured == C.captured, "fake captured %llu operations, expected %lld",
		      (unsigned long long)s.captured, C.captured);
		CHECK((long long)s.graph_launches == C.graph_launches, "fake ran %llu graph launches, expected %lld",
		      (unsigned long long)s.graph_launches, C.graph_launches);
	}
	printf("{\"prog\": \"%s\", \"pid\": %d, \"ok\": %s, \"allocs\": %lld, \"frees\": %lld, "
	       "\"alloc_kinds\": {\"device\": %lld, \"pitch\": %lld, \"async\": %lld, \"managed\": %lld, "
	       "\"host\": %lld, \"registered\": %lld, \"vmm_map\": %lld}, \"vmm_reserve\": %lld, "
	       "\"vmm_create\": %lld, \"launches\": %lld, \"captured\": %lld, \"copies\": %lld, "
	       "\"memsets\": %lld, \"write_values\": %lld, \"graph_launches\": %lld, \"graph_kernels\": %lld, "
	       "\"graph_copies\": %lld, \"graph_memsets\": %lld%s, \"checksum\": \"%016" PRIx64 "\"}\n",
	       prog, (int)getpid(), g_fail ? "false" : "true", C.allocs, C.frees, C.alloc_device,
	       C.alloc_pitch, C.alloc_async, C.alloc_managed, C.alloc_host, C.alloc_registered, C.alloc_vmm_map,
	       C.vmm_reserve, C.vmm_create, C.launches, C.captured, C.copies, C.memsets, C.write_values,
	       C.graph_launches, C.graph_kernels, C.graph_copies, C.graph_memsets, extra ? extra : "", g_sum);
	fflush(stdout);
	if (g_fail)
		fprintf(stderr, "%s: %d check(s) failed\n", prog, g_fail);
	return g_fail ? 1 : 0;
}

/* Count helpers used by the workloads. */
#define COUNT_ALLOC(kind) (C.allocs++, C.alloc_##kind++)

#endif /* GPUOS_TESTS_COMMON_H */
