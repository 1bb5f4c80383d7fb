/* SPDX-License-Identifier: MIT */
/*
 * fakecuda.c - a fake CUDA driver (libcuda.so.1) for host tests of libgpuos.
 *
 * Built against the real cuda.h with __CUDA_API_VERSION_INTERNAL, like the real
 * driver: every name below is the exported ABI name (cuMemAlloc_v2,
 * cuLaunchKernel_ptsz, ...) and the compiler checks each signature against cuda.h.
 * Linked with -Bsymbolic so the addresses cuGetProcAddress hands out are the ones
 * dlsym finds, and an LD_PRELOADed interposer never sees the fake's own references.
 *
 * Model: one device (0), a primary context and created contexts (a per-thread
 * current-context stack), host memory standing in for device memory, everything
 * synchronous.  One process-wide mutex guards all state; each exported function
 * counts its call, checks cuInit, takes the mutex and runs a static implementation.
 */
#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fakecuda.h"
#include "kernels.h"

/* ---------------------------------------------------------------------------------
 * Every exported entry point, for the per-name call counters.
 */
#define FAKE_API(X) \
	X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) \
	X(cuDeviceGetUuid_v2) X(cuIpcGetMemHandle) \
	X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) \
	X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxGetState) X(cuCtxCreate_v2) \
	X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuCtxGetCurrent) X(cuCtxSetCurrent) \
	X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxGetDevice_v2) \
	X(cuCtxSynchronize) X(cuCtxSynchronize_v2) X(cuCtxGetApiVersion) X(cuCtxGetId) X(cuGetErrorName) \
	X(cuGetErrorString) X(cuGetProcAddress) X(cuGetProcAddress_v2) \
	X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemFree_v2) X(cuMemAllocManaged) X(cuMemPrefetchAsync_v2) \
	X(cuMemAllocHost_v2) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemHostRegister_v2) \
	X(cuMemHostUnregister) X(cuMemHostGetDevicePointer_v2) X(cuMemAllocAsync) \
	X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) \
	X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuDeviceGetDefaultMemPool) X(cuMemGetInfo_v2) \
	X(cuMemGetAddressRange_v2) X(cuPointerGetAttribute) \
	X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) \
	X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) \
	X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) \
	X(cuMemcpy) X(cuMemcpy_ptds) X(cuMemcpyAsync) X(cuMemcpyAsync_ptsz) \
	X(cuMemcpyHtoD_v2) X(cuMemcpyHtoD_v2_ptds) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoH_v2_ptds) \
	X(cuMemcpyDtoD_v2) X(cuMemcpyDtoD_v2_ptds) X(cuMemcpyHtoDAsync_v2) \
	X(cuMemcpyHtoDAsync_v2_ptsz) X(cuMemcpyDtoHAsync_v2) X(cuMemcpyDtoHAsync_v2_ptsz) \
	X(cuMemcpyDtoDAsync_v2) X(cuMemcpyDtoDAsync_v2_ptsz) X(cuMemcpy2D_v2) X(cuMemcpy2D_v2_ptds) \
	X(cuMemcpy2DUnaligned_v2) X(cuMemcpy2DUnaligned_v2_ptds) X(cuMemcpy2DAsync_v2) \
	X(cuMemcpy2DAsync_v2_ptsz) X(cuMemcpy3D_v2) X(cuMemcpy3D_v2_ptds) X(cuMemcpy3DAsync_v2) \
	X(cuMemcpy3DAsync_v2_ptsz) X(cuMemcpyPeer) X(cuMemcpyPeer_ptds) X(cuMemcpyPeerAsync) \
	X(cuMemcpyPeerAsync_ptsz) \
	X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuMemsetD16_v2) X(cuMemsetD16_v2_ptds) \
	X(cuMemsetD32_v2) X(cuMemsetD32_v2_ptds) X(cuMemsetD8Async) X(cuMemsetD8Async_ptsz) \
	X(cuMemsetD16Async) X(cuMemsetD16Async_ptsz) X(cuMemsetD32Async) X(cuMemsetD32Async_ptsz) \
	X(cuMemsetD2D8_v2) X(cuMemsetD2D8_v2_ptds) X(cuMemsetD2D16_v2) X(cuMemsetD2D16_v2_ptds) \
	X(cuMemsetD2D32_v2) X(cuMemsetD2D32_v2_ptds) X(cuMemsetD2D8Async) X(cuMemsetD2D8Async_ptsz) \
	X(cuMemsetD2D16Async) X(cuMemsetD2D16Async_ptsz) X(cuMemsetD2D32Async) \
	X(cuMemsetD2D32Async_ptsz) X(cuStreamWriteValue32_v2) X(cuStreamWriteValue32_v2_ptsz) \
	X(cuStreamWriteValue64_v2) X(cuStreamWriteValue64_v2_ptsz) X(cuStreamBatchMemOp_v2) \
	X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary) \
	X(cuModuleUnload) X(cuModuleGetFunction) X(cuLibraryLoadData) X(cuLibraryLoadFromFile) \
	X(cuLibraryUnload) X(cuLibraryGetKernel) X(cuLibraryGetModule) X(cuKernelGetFunction) \
	X(cuFuncGetName) X(cuKernelGetName) X(cuFuncLoad) X(cuKernelGetLibrary) X(cuFuncGetParamInfo) X(cuKernelGetParamInfo) \
	X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy_v2) X(cuThreadExchangeStreamCaptureMode) \
	X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuStreamQuery) X(cuStreamQuery_ptsz) \
	X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuStreamGetCaptureInfo_v3) \
	X(cuStreamGetCaptureInfo_v3_ptsz) X(cuEventCreate) X(cuEventDestroy_v2) X(cuEventRecord) \
	X(cuEventRecord_ptsz) X(cuEventSynchronize) X(cuEventQuery) X(cuEventElapsedTime) X(cuStreamWaitEvent) \
	X(cuStreamWaitEvent_ptsz) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) \
	X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) \
	X(cuStreamBeginCapture_v2) X(cuStreamBeginCapture_v2_ptsz) X(cuStreamBeginCaptureToGraph) \
	X(cuStreamBeginCaptureToGraph_ptsz) X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz) \
	X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddKernelNode_v2) X(cuGraphGetNodes) \
	X(cuGraphNodeGetType) X(cuGraphKernelNodeGetParams_v2) X(cuGraphMemcpyNodeGetParams) \
	X(cuGraphMemsetNodeGetParams) X(cuGraphChildGraphNodeGetGraph) \
	X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams) \
	X(cuGraphInstantiateWithParams_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) \
	X(cuGraphExecDestroy) X(cuGraphExecUpdate_v2) X(cuGraphExecKernelNodeSetParams_v2) \
	X(cuFakeInternalOnly)

#define X_ENUM(s) C_##s,
enum { FAKE_API(X_ENUM) C__N };
#define X_NAME(s) #s,
static const char *const api_names[C__N] = { FAKE_API(X_NAME) };

/* ---------------------------------------------------------------------------------
 * Global state, statistics, errors.
 */
static pthread_mutex_t L = PTHREAD_MUTEX_INITIALIZER;
static int g_inited, g_debug;
static uint64_t g_calls[C__N];
static struct fakecuda_stats S;   /* calls/errors: atomics; the rest under L */
static uint64_t g_dev_used;       /* device bytes (for cuMemGetInfo and out-of-memory) */

#define ERRS(E) \
	E(CUDA_SUCCESS, "no error") \
	E(CUDA_ERROR_INVALID_VALUE, "invalid argument") \
	E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory") \
	E(CUDA_ERROR_NOT_INITIALIZED, "initialization error") \
	E(CUDA_ERROR_DEINITIALIZED, "driver shutting down") \
	E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected") \
	E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal") \
	E(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid") \
	E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context") \
	E(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped") \
	E(CUDA_ERROR_NOT_MAPPED, "resource not mapped") \
	E(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed") \
	E(CUDA_ERROR_FILE_NOT_FOUND, "file not found") \
	E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle") \
	E(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state") \
	E(CUDA_ERROR_NOT_FOUND, "named symbol not found") \
	E(CUDA_ERROR_NOT_READY, "device not ready") \
	E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered") \
	E(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch") \
	E(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure") \
	E(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped") \
	E(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region") \
	E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted") \
	E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported") \
	E(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing") \
	E(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture") \
	E(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update") \
	E(CUDA_ERROR_UNKNOWN, "unknown error")

static const char *err_name(CUresult r)
{
#define E_NAME(c, s) if (r == c) return #c;
	ERRS(E_NAME)
	return NULL;
}

static const char *err_string(CUresult r)
{
#define E_STR(c, s) if (r == c) return s;
	ERRS(E_STR)
	return NULL;
}

static CUresult ret(int idx, CUresult r)
{
	if (r != CUDA_SUCCESS) {
		__atomic_fetch_add(&S.errors, 1, __ATOMIC_RELAXED);
		if (g_debug)
			fprintf(stderr, "fakecuda: %s -> %s\n", api_names[idx],
				err_name(r) ? err_name(r) : "?");
	}
	return r;
}

static void count(int idx)
{
	__atomic_fetch_add(&g_calls[idx], 1, __ATOMIC_RELAXED);
	__atomic_fetch_add(&S.calls, 1, __ATOMIC_RELAXED);
}

/* Each exported function: count, check cuInit, run `expr` under the mutex. */
#define CALL_(sym, needinit, expr) do { \
	count(C_##sym); \
	if ((needinit) && !g_inited) \
		return ret(C_##sym, CUDA_ERROR_NOT_INITIALIZED); \
	pthread_mutex_lock(&L); \
	CUresult r_ = (expr); \
	pthread_mutex_unlock(&L); \
	return ret(C_##sym, r_); \
} while (0)
#define CALL(sym, expr) CALL_(sym, 1, expr)
#define API(sym, params, expr) CUresult CUDAAPI sym params { CALL(sym, expr); }
#define API_PTSZ(sym, params, expr) API(sym, params, expr) API(sym##_ptsz, params, expr)
#define API_PTDS(sym, params, expr) API(sym, params, expr) API(sym##_ptds, params, expr)

/* ---------------------------------------------------------------------------------
 * Handles: every object starts with a type tag and is registered; a handle is valid
 * while registered with the expected type (unknown handles never get dereferenced).
 */
enum { O_CTX = 1, O_MOD, O_FUNC, O_LIB, O_KERN, O_STREAM, O_EVENT, O_GRAPH, O_NODE, O_EXEC,
       O_MEMH, O_POOL };

struct obj { uint32_t type; };
static struct obj **objs;
static size_t nobj, capobj;

static int oreg(struct obj *o)
{
	if (nobj == capobj) {
		size_t cap = capobj ? 2 * capobj : 64;
		struct obj **n = realloc(objs, cap * sizeof(*n));
		if (!n)
			return -1;
		objs = n;
		capobj = cap;
	}
	objs[nobj++] = o;
	return 0;
}

static void *onew(size_t sz, uint32_t type)
{
	struct obj *o = calloc(1, sz);
	if (!o)
		return NULL;
	o->type = type;
	if (oreg(o)) {
		free(o);
		return NULL;
	}
	return o;
}

static void *oget(const void *h, uint32_t type)
{
	if (!h)
		return NULL;
	for (size_t i = nobj; i-- > 0;)
		if (objs[i] == h)
			return objs[i]->type == type ? objs[i] : NULL;
	return NULL;
}

static void odel(void *o)
{
	for (size_t i = 0; i < nobj; i++)
		if (objs[i] == o) {
			objs[i] = objs[--nobj];
			free(o);
			return;
		}
}

/* ---------------------------------------------------------------------------------
 * Contexts: the primary context and created ones; a per-thread current stack.
 */
/* dead: a kernel touched memory outside every allocation and FAKECUDA_STICKY_FAULTS=1:
 * like a GPU context after an illegal address, every later call in it fails. (By
 * default a fault fails only its launch, which the semantics tests rely on.) */
struct ctx { struct obj o; int primary; unsigned flags; unsigned long long id; int dead; };
static struct ctx g_pctx = { { O_CTX }, 1, 0, 1, 0 };
static unsigned long long g_ctx_ids = 1;
static struct ctx *g_spare_ctx;
static int g_sticky_faults;
static int g_pctx_refs;
struct pool { struct obj o; };
static struct pool g_pool = { { O_POOL } };

#define CTX_STACK 16
static __thread struct ctx *t_stack[CTX_STACK];
static __thread int t_depth;
#define CUR (t_depth ? t_stack[t_depth - 1] : NULL)
#define NEED_CTX() do { if (!CUR) return CUDA_ERROR_INVALID_CONTEXT; \
	if (CUR->dead) return CUDA_ERROR_ILLEGAL_ADDRESS; } while (0)

static CUresult do_init(unsigned flags)
{
	if (flags)
		return CUDA_ERROR_INVALID_VALUE;
	if (!g_inited) {
		if (oreg(&g_pctx.o) || oreg(&g_pool.o))
			return CUDA_ERROR_OUT_OF_MEMORY;
		g_inited = 1;
	}
	return CUDA_SUCCESS;
}

static CUresult set_current(struct ctx *c)
{
	if (t_depth == 0) {
		if (c)
			t_stack[t_depth++] = c;
	} else if (c) {
		t_stack[t_depth - 1] = c;
	} else {
		t_depth--;
	}
	return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev)
{
	struct ctx *c;
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	if (t_depth == CTX_STACK)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (g_spare_ctx) { /* the handle of the last destroyed context, as drivers do */
		c = g_spare_ctx;
		g_spare_ctx = NULL;
		memset(c, 0, sizeof *c);
		c->o.type = O_CTX;
		if (oreg(&c->o)) {
			free(c);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	} else if (!(c = onew(sizeof(*c), O_CTX))) {
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	c->flags = flags;
	c->id = ++g_ctx_ids;
	t_stack[t_depth++] = c;
	*pctx = (CUcontext)c;
	return CUDA_SUCCESS;
}

static void ctx_free_memory(struct ctx *c);

static CUresult ctx_destroy(CUcontext h)
{
	struct ctx *c = oget(h, O_CTX);
	if (!c || c->primary)
		return CUDA_ERROR_INVALID_CONTEXT;
	for (int i = 0; i < t_depth; i++)
		if (t_stack[i] == c) { /* drop it from this thread's stack */
			memmove(&t_stack[i], &t_stack[i + 1], (t_depth - i - 1) * sizeof(t_stack[0]));
			t_depth--;
			i--;
		}
	ctx_free_memory(c); /* like the real driver: the context's memory goes with it */
	for (size_t i = 0; i < nobj; i++)
		if (objs[i] == &c->o)
			objs[i] = objs[--nobj];
	free(g_spare_ctx);
	g_spare_ctx = c; /* the next context created gets this handle again */
	return CUDA_SUCCESS;
}

static CUresult ctx_arg(CUcontext h)
{
	if (!h)
		return CUR ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	return oget(h, O_CTX) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* ---------------------------------------------------------------------------------
 * Allocations: an unsorted table of live ranges.
 */
enum { A_DEV = 1, A_PITCH, A_ASYNC, A_MANAGED, A_HOST, A_REG, A_RES, A_MAP };
#define DEVICE_KINDS ((1 << A_DEV) | (1 << A_PITCH) | (1 << A_ASYNC) | (1 << A_MANAGED))

struct memh { struct obj o; size_t size; int released; int maps; int fd; /* a memfd: the contents */
	       int imported; };

struct alloc {
	uintptr_t base;
	size_t size;
	int kind;
	int access;        /* VMM maps: cuMemSetAccess made it accessible */
	struct memh *h;    /* VMM maps */
	struct ctx *ctx;
};
static struct alloc *al;
static size_t nal, capal;

static struct alloc *al_add(uintptr_t base, size_t size, int kind)
{
	if (nal == capal) {
		size_t cap = capal ? 2 * capal : 64;
		struct alloc *n = realloc(al, cap * sizeof(*n));
		if (!n)
			return NULL;
		al = n;
		capal = cap;
	}
	al[nal] = (struct alloc){ base, size, kind, 0, NULL, CUR };
	if (kind != A_RES) {
		S.allocs++;
		S.live_allocs++;
		S.live_bytes += size;
	}
	if ((1 << kind) & DEVICE_KINDS)
		g_dev_used += size;
	return &al[nal++];
}

static void al_del(struct alloc *a)
{
	if (a->kind != A_RES) {
		S.frees++;
		S.live_allocs--;
		S.live_bytes -= a->size;
	}
	if ((1 << a->kind) & DEVICE_KINDS)
		g_dev_used -= a->size;
	*a = al[--nal];
}

/* The buffer (not a reservation) holding address p. */
static struct alloc *al_find(uintptr_t p)
{
	for (size_t i = 0; i < nal; i++)
		if (al[i].kind != A_RES && p - al[i].base < al[i].size)
			return &al[i];
	return NULL;
}

/* The allocation starting at p, of one of the kinds in mask. */
static struct alloc *al_base(uintptr_t p, unsigned mask)
{
	for (size_t i = 0; i < nal; i++)
		if (al[i].base == p && ((1u << al[i].kind) & mask))
			return &al[i];
	return NULL;
}

/* CUDA IPC: the driver's device allocations only (VMM memory is refused, as by the real
 * driver); the handle is the base address (nothing imports it in the fake). */
static CUresult ipc_handle(CUipcMemHandle *h, CUdeviceptr p)
{
	struct alloc *a = al_find(p);
	if (!h || !a || a->kind != A_DEV)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof *h);
	memcpy(h->reserved, &a->base, sizeof a->base);
	return CUDA_SUCCESS;
}

/* [p, p + n) lies in one GPU-accessible allocation. */
static CUresult dev_range(uintptr_t p, size_t n)
{
	struct alloc *a = al_find(p);
	if (!a || (a->kind == A_MAP && !a->access) || n > a->base + a->size - p)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static CUresult mem_alloc(CUdeviceptr *dptr, size_t n, int kind)
{
	void *p;
	NEED_CTX();
	if (!dptr || !n)
		return CUDA_ERROR_INVALID_VALUE;
	/* mmap'd, so that touching it once freed faults, as on a GPU */
	if (n > FAKECUDA_TOTAL_MEM - g_dev_used ||
	    (p = mmap(NULL, round_up(n, 4096), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
		      -1, 0)) == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (!al_add((uintptr_t)p, n, kind)) {
		munmap(p, round_up(n, 4096));
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*dptr = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

/* Unmap and forget an allocation made by mem_alloc. */
static void mem_release(struct alloc *a)
{
	munmap((void *)a->base, round_up(a->size, 4096));
	al_del(a);
}

static void ctx_free_memory(struct ctx *c)
{
	for (size_t i = nal; i-- > 0;)
		if (al[i].ctx == c && ((1 << al[i].kind) & (DEVICE_KINDS | (1 << A_HOST))))
			mem_release(&al[i]);
}

static CUresult mem_free(CUdeviceptr p)
{
	struct alloc *a = al_base(p, DEVICE_KINDS);
	NEED_CTX();
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	mem_release(a);
	return CUDA_SUCCESS;
}

static CUresult mem_alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned es)
{
	CUresult r;
	if (!pitch || !w || !h || (es != 4 && es != 8 && es != 16))
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = mem_alloc(dptr, round_up(w, 512) * h, A_PITCH)) == CUDA_SUCCESS)
		*pitch = round_up(w, 512);
	return r;
}

static CUresult host_alloc(void **pp, size_t n, unsigned flags)
{
	CUdeviceptr d;
	CUresult r;
	if (!pp || (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
					   CU_MEMHOSTALLOC_WRITECOMBINED)))
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = mem_alloc(&d, n, A_HOST)) == CUDA_SUCCESS)
		*pp = (void *)(uintptr_t)d;
	return r;
}

static CUresult host_free(void *p)
{
	struct alloc *a = al_base((uintptr_t)p, 1 << A_HOST);
	NEED_CTX();
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	mem_release(a);
	return CUDA_SUCCESS;
}

static CUresult host_register(void *p, size_t n, unsigned flags)
{
	uintptr_t b = (uintptr_t)p;
	NEED_CTX();
	if (!p || !n || (flags & ~0xfu))
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < nal; i++)
		if ((al[i].kind == A_HOST || al[i].kind == A_REG) &&
		    b < al[i].base + al[i].size && al[i].base < b + n)
			return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	return al_add(b, n, A_REG) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult host_unregister(void *p)
{
	struct alloc *a = al_base((uintptr_t)p, 1 << A_REG);
	NEED_CTX();
	if (!a)
		return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
	al_del(a);
	return CUDA_SUCCESS;
}

static CUresult host_devptr(CUdeviceptr *d, void *p, unsigned flags)
{
	struct alloc *a = al_find((uintptr_t)p);
	NEED_CTX();
	if (!d || flags || !a || (a->kind != A_HOST && a->kind != A_REG))
		return CUDA_ERROR_INVALID_VALUE;
	*d = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

static CUresult mem_info(size_t *fr, size_t *total)
{
	NEED_CTX();
	if (!fr || !total)
		return CUDA_ERROR_INVALID_VALUE;
	*total = FAKECUDA_TOTAL_MEM;
	*fr = FAKECUDA_TOTAL_MEM - g_dev_used;
	return CUDA_SUCCESS;
}

static CUresult addr_range(CUdeviceptr *pbase, size_t *psize, CUdeviceptr p)
{
	struct alloc *a = al_find(p);
	NEED_CTX();
	if (!a || a->kind == A_HOST || a->kind == A_REG)
		return CUDA_ERROR_NOT_FOUND;
	if (pbase)
		*pbase = a->base;
	if (psize)
		*psize = a->size;
	return CUDA_SUCCESS;
}

/* Managed memory lives in host memory here: a prefetch only checks its arguments. */
static CUresult prefetch(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags)
{
	struct alloc *a = al_find(p);
	NEED_CTX();
	if (flags || (loc.type != CU_MEM_LOCATION_TYPE_HOST && loc.type != CU_MEM_LOCATION_TYPE_DEVICE))
		return CUDA_ERROR_INVALID_VALUE;
	if (!a || a->kind != A_MANAGED || p + n > a->base + a->size)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

static CUresult ptr_attr(void *data, CUpointer_attribute attr, CUdeviceptr p)
{
	struct alloc *a = al_find(p);
	int host;
	if (!data)
		return CUDA_ERROR_INVALID_VALUE;
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	host = a->kind == A_HOST || a->kind == A_REG;
	switch (attr) {
	case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)a->ctx; break;
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
		*(unsigned *)data = host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE; break;
	case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = p; break;
	case CU_POINTER_ATTRIBUTE_HOST_POINTER:
		if (!host && a->kind != A_MANAGED)
			return CUDA_ERROR_INVALID_VALUE;
		*(void **)data = (void *)(uintptr_t)p; break;
	case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = a->kind == A_MANAGED; break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
	case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = a->base; break;
	case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = a->size; break;
	case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
	default: return CUDA_ERROR_NOT_SUPPORTED;
	}
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------
 * Virtual memory management: reservations are PROT_NONE mmaps; physical memory is a
 * memfd, which cuMemMap maps shared (PROT_NONE) over a part of a reservation and
 * cuMemSetAccess mprotects: every mapping of a handle, in this process or another that
 * imported it (cuMemExportToShareableHandle gives a dup of the memfd), sees the same
 * bytes.  FAKECUDA_VMM_CREATE_FAIL=1 makes cuMemCreate fail (out of memory).
 */
static int g_vmm_create_fail;

static int vmm_prop_ok(const CUmemAllocationProp *prop)
{
	return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
	       prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id == 0;
}

static CUresult vmm_gran(size_t *g, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags opt)
{
	if (!g || !vmm_prop_ok(prop) ||
	    (opt != CU_MEM_ALLOC_GRANULARITY_MINIMUM && opt != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
		return CUDA_ERROR_INVALID_VALUE;
	*g = FAKECUDA_GRANULARITY;
	return CUDA_SUCCESS;
}

static CUresult vmm_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
			    unsigned long long flags)
{
	size_t g = FAKECUDA_GRANULARITY;
	uintptr_t b, e;
	char *m;
	(void)addr; /* a hint */
	if (!ptr || !size || size % g || flags || (align & (align - 1)))
		return CUDA_ERROR_INVALID_VALUE;
	if (align > g)
		g = align;
	m = mmap(NULL, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	b = round_up((uintptr_t)m, g);
	e = (uintptr_t)m + size + g;
	if (b > (uintptr_t)m)
		munmap(m, b - (uintptr_t)m);
	if (e > b + size)
		munmap((void *)(b + size), e - (b + size));
	if (!al_add(b, size, A_RES)) {
		munmap((void *)b, size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	S.vmm_reserves++;
	*ptr = b;
	return CUDA_SUCCESS;
}

static CUresult vmm_free(CUdeviceptr ptr, size_t size)
{
	struct alloc *a = al_base(ptr, 1 << A_RES);
	if (!a || a->size != size)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < nal; i++)
		if (al[i].kind == A_MAP && al[i].base - ptr < size)
			return CUDA_ERROR_INVALID_VALUE; /* still mapped */
	munmap((void *)(uintptr_t)ptr, size);
	al_del(a);
	return CUDA_SUCCESS;
}

static CUresult vmm_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
			   unsigned long long flags)
{
	struct memh *m;
	if (!h || !size || size % FAKECUDA_GRANULARITY || flags || !vmm_prop_ok(prop))
		return CUDA_ERROR_INVALID_VALUE;
	if (g_vmm_create_fail || size > FAKECUDA_TOTAL_MEM - g_dev_used)
		return CUDA_ERROR_OUT_OF_MEMORY;
	int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)size) || !(m = onew(sizeof(*m), O_MEMH))) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->fd = fd;
	m->size = size;
	g_dev_used += size;
	S.vmm_creates++;
	*h = (CUmemGenericAllocationHandle)(uintptr_t)m;
	return CUDA_SUCCESS;
}

static void memh_put(struct memh *m)
{
	if (m->released && m->maps == 0) {
		g_dev_used -= m->size;
		close(m->fd);
		odel(m);
	}
}

static CUresult vmm_release(CUmemGenericAllocationHandle h)
{
	struct memh *m = oget((void *)(uintptr_t)h, O_MEMH);
	if (!m || m->released)
		return CUDA_ERROR_INVALID_VALUE;
	m->released = 1;
	memh_put(m);
	return CUDA_SUCCESS;
}

static CUresult vmm_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
			unsigned long long flags)
{
	struct memh *m = oget((void *)(uintptr_t)h, O_MEMH);
	struct alloc *res = NULL, *a;
	if (!m || m->released)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!size || flags || size % FAKECUDA_GRANULARITY || ptr % FAKECUDA_GRANULARITY ||
	    offset % FAKECUDA_GRANULARITY || offset > m->size || size > m->size - offset)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < nal; i++) {
		if (al[i].kind == A_RES && ptr - al[i].base < al[i].size &&
		    size <= al[i].base + al[i].size - ptr)
			res = &al[i];
		if (al[i].kind == A_MAP && ptr < al[i].base + al[i].size && al[i].base < ptr + size)
			return CUDA_ERROR_ALREADY_MAPPED;
	}
	if (!res)
		return CUDA_ERROR_INVALID_VALUE;
	if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, m->fd, (off_t)offset) == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (!(a = al_add(ptr, size, A_MAP)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	a->h = m;
	m->maps++;
	return CUDA_SUCCESS;
}

static CUresult vmm_export(void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t,
			   unsigned long long flags)
{
	struct memh *m = oget((void *)(uintptr_t)h, O_MEMH);
	if (!m || m->released)
		return CUDA_ERROR_INVALID_HANDLE;
	/* As the real driver (measured on H100, r580): a handle the process imported is not
	 * exported again. */
	if (!out || flags || t != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || m->imported)
		return CUDA_ERROR_INVALID_VALUE;
	int fd = fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*(int *)out = fd;
	return CUDA_SUCCESS;
}

static CUresult vmm_import(CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType t)
{
	struct stat st;
	struct memh *m;
	int fd = (int)(uintptr_t)os;
	if (!h || t != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) || st.st_size <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	if ((fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0 || !(m = onew(sizeof(*m), O_MEMH))) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->fd = fd;
	m->size = (size_t)st.st_size;
	m->imported = 1;
	g_dev_used += m->size;
	*h = (CUmemGenericAllocationHandle)(uintptr_t)m;
	return CUDA_SUCCESS;
}

/* The VMM maps inside [ptr, ptr + size) cover it exactly (and there is one). */
static int vmm_covered(uintptr_t ptr, size_t size)
{
	size_t got = 0;
	for (size_t i = 0; i < nal; i++)
		if (al[i].kind == A_MAP && al[i].base < ptr + size && ptr < al[i].base + al[i].size) {
			if (al[i].base < ptr || al[i].base + al[i].size > ptr + size)
				return 0;
			got += al[i].size;
		}
	return got && got == size;
}

static CUresult vmm_unmap(CUdeviceptr ptr, size_t size)
{
	if (!size || !vmm_covered(ptr, size))
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = nal; i-- > 0;)
		if (al[i].kind == A_MAP && al[i].base - ptr < size) {
			struct memh *m = al[i].h;
			mmap((void *)al[i].base, al[i].size, PROT_NONE,
			     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
			al_del(&al[i]);
			m->maps--;
			memh_put(m);
		}
	return CUDA_SUCCESS;
}

static CUresult vmm_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
	int prot = PROT_NONE, acc = 0;
	if (!desc || !count || !size || !vmm_covered(ptr, size))
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id != 0)
			return CUDA_ERROR_INVALID_DEVICE;
		switch (desc[i].flags) {
		case CU_MEM_ACCESS_FLAGS_PROT_NONE: prot = PROT_NONE; acc = 0; break;
		case CU_MEM_ACCESS_FLAGS_PROT_READ: prot = PROT_READ; acc = 1; break;
		case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot = PROT_READ | PROT_WRITE; acc = 1; break;
		default: return CUDA_ERROR_INVALID_VALUE;
		}
	}
	if (mprotect((void *)(uintptr_t)ptr, size, prot))
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < nal; i++)
		if (al[i].kind == A_MAP && al[i].base - ptr < size)
			al[i].access = acc;
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------
 * Operations as graph nodes: kernel launches, copies (all as CUDA_MEMCPY3D) and
 * memsets.  A direct call builds a node on the stack and runs it (or, on a capturing
 * stream, appends a copy of it to the capture graph).
 */
struct graph;
struct node {
	struct obj o;
	struct graph *g;
	CUgraphNodeType type;
	/* kernel */
	const struct fk *k;
	CUfunction fh;                /* as given (may be a CUkernel cast) */
	CUkernel kh;                  /* as given through CUDA_KERNEL_NODE_PARAMS.kern */
	unsigned grid[3], block[3], shmem;
	void *pp[FK_MAXP];            /* parameter i; into pbuf when the node owns its values */
	unsigned char *pbuf;
	/* copy, memset */
	CUDA_MEMCPY3D cp;
	CUDA_MEMSET_NODE_PARAMS ms;
	const struct node *orig, *upd; /* exec copies: the graph node(s) they stand for */
};

struct graph { struct obj o; struct node **n; size_t nn, cap; };
struct gexec { struct obj o; struct node **n; size_t nn; };
struct stream {
	struct obj o;
	struct ctx *ctx;
	unsigned flags;
	int prio;
	int capturing;                /* 1: into its own graph, 2: into the application's */
	int invalid;                  /* the capture was invalidated (it stays until ended) */
	struct graph *g;
	unsigned long long cap_id;
};
struct event { struct obj o; unsigned flags; uint64_t at_ns; /* when last recorded (0: never) */ };

static unsigned long long g_cap_id;

static CUresult get_stream(CUstream h, struct stream **out)
{
	*out = NULL;
	if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD)
		return CUDA_SUCCESS;
	return (*out = oget(h, O_STREAM)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Captures in progress (blocking streams only: those the legacy stream waits for). */
static int any_capturing(int blocking_only)
{
	for (size_t i = 0; i < nobj; i++) {
		struct stream *s = (struct stream *)objs[i];
		if (s->o.type == O_STREAM && s->capturing && !s->invalid &&
		    (!blocking_only || !(s->flags & CU_STREAM_NON_BLOCKING)))
			return 1;
	}
	return 0;
}

static void invalidate_captures(int blocking_only)
{
	for (size_t i = 0; i < nobj; i++) {
		struct stream *s = (struct stream *)objs[i];
		if (s->o.type == O_STREAM && s->capturing &&
		    (!blocking_only || !(s->flags & CU_STREAM_NON_BLOCKING)))
			s->invalid = 1;
	}
}

/* A stream an operation is issued to, with the real driver's capture rules: work on
 * an invalidated capture fails; work on the legacy stream while a blocking stream
 * captures fails with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates that capture. */
static CUresult stream_use(CUstream h, struct stream **out)
{
	CUresult r = get_stream(h, out);
	if (r)
		return r;
	if (*out && (*out)->capturing && (*out)->invalid)
		return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
	if (!*out && h != CU_STREAM_PER_THREAD && any_capturing(1)) {
		invalidate_captures(1);
		return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
	}
	return CUDA_SUCCESS;
}

/* The kernel behind a CUfunction or a CUkernel (cast to CUfunction). */
static const struct fk *func_fk(const void *h);

struct func { struct obj o; const struct fk *k; struct mod *m; };
struct kern { struct obj o; const struct fk *k; struct lib *l; };
struct mod { struct obj o; struct func **f; struct lib *lib; };
struct lib { struct obj o; struct kern **k; struct mod *m; };

static const struct fk *func_fk(const void *h)
{
	struct func *f = oget(h, O_FUNC);
	struct kern *k;
	if (f)
		return f->k;
	k = oget(h, O_KERN);
	return k ? k->k : NULL;
}

static unsigned param_need(const struct fk *k)
{
	return k->nparams ? k->off[k->nparams - 1] + k->size[k->nparams - 1] : 0;
}

static CUresult kernel_node(struct node *n, CUfunction f, CUkernel kern, const unsigned grid[3],
			    const unsigned block[3], unsigned shmem, void **params, void **extra)
{
	const struct fk *k = f ? func_fk(f) : (kern ? func_fk(kern) : NULL);
	unsigned char *buf = NULL;
	size_t bufsize = 0;
	int have_size = 0;
	if (!k)
		return CUDA_ERROR_INVALID_HANDLE;
	for (int i = 0; i < 3; i++)
		if (!grid[i] || !block[i])
			return CUDA_ERROR_INVALID_VALUE;
	if ((unsigned long long)block[0] * block[1] * block[2] > 1024 || grid[1] > 65535 ||
	    grid[2] > 65535 || grid[0] > 0x7fffffffu)
		return CUDA_ERROR_INVALID_VALUE;
	memset(n, 0, sizeof(*n));
	n->type = CU_GRAPH_NODE_TYPE_KERNEL;
	n->k = k;
	n->fh = f;
	n->kh = kern;
	memcpy(n->grid, grid, sizeof(n->grid));
	memcpy(n->block, block, sizeof(n->block));
	n->shmem = shmem;
	if (params && extra)
		return CUDA_ERROR_INVALID_VALUE;
	if (extra) {
		for (void **e = extra; *e != CU_LAUNCH_PARAM_END; e += 2) {
			if (e[0] == CU_LAUNCH_PARAM_BUFFER_POINTER)
				buf = e[1];
			else if (e[0] == CU_LAUNCH_PARAM_BUFFER_SIZE && e[1])
				bufsize = *(size_t *)e[1], have_size = 1;
			else
				return CUDA_ERROR_INVALID_VALUE;
		}
		if (k->nparams && (!buf || !have_size || bufsize < param_need(k)))
			return CUDA_ERROR_INVALID_VALUE;
		for (unsigned i = 0; i < k->nparams; i++)
			n->pp[i] = buf + k->off[i];
		return CUDA_SUCCESS;
	}
	if (k->nparams && !params)
		return CUDA_ERROR_INVALID_VALUE;
	for (unsigned i = 0; i < k->nparams; i++)
		if (!(n->pp[i] = params[i]))
			return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* Where one side of a copy starts; checks that device memory covers what it spans. */
static CUresult cp_side(CUmemorytype t, const void *host, CUdeviceptr dev, size_t x, size_t y,
			size_t z, size_t pitch, size_t height, const CUDA_MEMCPY3D *c, uintptr_t *addr)
{
	size_t W = c->WidthInBytes, H = c->Height, D = c->Depth, span;
	uintptr_t a;
	if (t == CU_MEMORYTYPE_ARRAY)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (t != CU_MEMORYTYPE_HOST && t != CU_MEMORYTYPE_DEVICE && t != CU_MEMORYTYPE_UNIFIED)
		return CUDA_ERROR_INVALID_VALUE;
	a = t == CU_MEMORYTYPE_HOST ? (uintptr_t)host : (uintptr_t)dev;
	if ((H > 1 || D > 1) && pitch < W)
		return CUDA_ERROR_INVALID_VALUE;
	if ((D > 1 || z) && height < H + y)
		return CUDA_ERROR_INVALID_VALUE;
	*addr = a + (z * height + y) * pitch + x;
	if (!W || !H || !D)
		return CUDA_SUCCESS;
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	span = ((D - 1) * height + (H - 1)) * pitch + W;
	if (t == CU_MEMORYTYPE_DEVICE || (t == CU_MEMORYTYPE_UNIFIED && al_find(*addr)))
		return dev_range(*addr, span);
	return CUDA_SUCCESS;
}

static CUresult copy_check(const CUDA_MEMCPY3D *c, uintptr_t *d, uintptr_t *s)
{
	CUresult r = cp_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes, c->srcY,
			     c->srcZ, c->srcPitch, c->srcHeight, c, s);
	if (r == CUDA_SUCCESS)
		r = cp_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes, c->dstY,
			    c->dstZ, c->dstPitch, c->dstHeight, c, d);
	return r;
}

static CUresult copy_run(const CUDA_MEMCPY3D *c)
{
	uintptr_t d, s;
	CUresult r = copy_check(c, &d, &s);
	if (r)
		return r;
	for (size_t z = 0; z < c->Depth; z++)
		for (size_t y = 0; y < c->Height; y++)
			memmove((void *)(d + (z * c->dstHeight + y) * c->dstPitch),
				(const void *)(s + (z * c->srcHeight + y) * c->srcPitch), c->WidthInBytes);
	S.copies++;
	S.bytes_copied += (uint64_t)c->WidthInBytes * c->Height * c->Depth;
	return CUDA_SUCCESS;
}

static CUresult memset_check(const CUDA_MEMSET_NODE_PARAMS *m)
{
	unsigned es = m->elementSize;
	if ((es != 1 && es != 2 && es != 4) || m->dst % es)
		return CUDA_ERROR_INVALID_VALUE;
	if (m->height > 1 && (m->pitch < m->width * es || m->pitch % es))
		return CUDA_ERROR_INVALID_VALUE;
	if (!m->width || !m->height)
		return CUDA_SUCCESS;
	return dev_range(m->dst, (m->height - 1) * m->pitch + m->width * es);
}

static CUresult memset_run(const CUDA_MEMSET_NODE_PARAMS *m)
{
	CUresult r = memset_check(m);
	if (r)
		return r;
	for (size_t y = 0; y < m->height; y++) {
		unsigned char *row = (unsigned char *)(uintptr_t)(m->dst + y * m->pitch);
		for (size_t i = 0; i < m->width; i++)
			switch (m->elementSize) {
			case 1: row[i] = (unsigned char)m->value; break;
			case 2: ((uint16_t *)row)[i] = (uint16_t)m->value; break;
			default: ((uint32_t *)row)[i] = m->value; break;
			}
	}
	S.memsets++;
	S.bytes_set += (uint64_t)m->width * m->height * m->elementSize;
	return CUDA_SUCCESS;
}

/* Kernels check the memory they touch (an illegal address fails the launch with
 * CUDA_ERROR_ILLEGAL_ADDRESS, synchronously, instead of crashing the process). */
static int g_fault;

int fake_range_ok(const void *p, long long bytes)
{
	if (bytes <= 0 || dev_range((uintptr_t)p, (size_t)bytes) == CUDA_SUCCESS)
		return 1;
	if (g_debug)
		fprintf(stderr, "fakecuda: kernel touched %p + %lld outside device memory\n", p, bytes);
	g_fault = 1;
	return 0;
}

static CUresult node_run(const struct node *n)
{
	switch (n->type) {
	case CU_GRAPH_NODE_TYPE_KERNEL:
		g_fault = 0;
		n->k->fn((void **)n->pp);
		if (g_fault) {
			if (CUR && g_sticky_faults)
				CUR->dead = 1;
			return CUDA_ERROR_ILLEGAL_ADDRESS;
		}
		if (n->k->fp)
			S.fp_launches++;
		else
			S.launches++;
		return CUDA_SUCCESS;
	case CU_GRAPH_NODE_TYPE_MEMCPY: return copy_run(&n->cp);
	case CU_GRAPH_NODE_TYPE_MEMSET: return memset_run(&n->ms);
	default: return CUDA_ERROR_NOT_SUPPORTED;
	}
}

static CUresult node_check(const struct node *n)
{
	uintptr_t d, s;
	switch (n->type) {
	case CU_GRAPH_NODE_TYPE_KERNEL: return CUDA_SUCCESS;
	case CU_GRAPH_NODE_TYPE_MEMCPY: return copy_check(&n->cp, &d, &s);
	case CU_GRAPH_NODE_TYPE_MEMSET: return memset_check(&n->ms);
	default: return CUDA_ERROR_NOT_SUPPORTED;
	}
}

/* A copy of n that owns its kernel parameter values; registered as a graph node or not
 * (exec copies). */
static struct node *node_dup(const struct node *n, int reg)
{
	struct node *c = reg ? onew(sizeof(*c), O_NODE) : calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	*c = *n;
	c->o.type = O_NODE;
	c->pbuf = NULL;
	if (n->type == CU_GRAPH_NODE_TYPE_KERNEL && n->k->nparams) {
		if (!(c->pbuf = calloc(1, n->k->total))) {
			reg ? odel(c) : free(c);
			return NULL;
		}
		for (unsigned i = 0; i < n->k->nparams; i++) {
			memcpy(c->pbuf + n->k->off[i], n->pp[i], n->k->size[i]);
			c->pp[i] = c->pbuf + n->k->off[i];
		}
	}
	return c;
}

static void node_free(struct node *n, int reg)
{
	free(n->pbuf);
	reg ? odel(n) : free(n);
}

static CUresult graph_append(struct graph *g, const struct node *n, struct node **out)
{
	struct node *c;
	if (g->nn == g->cap) {
		size_t cap = g->cap ? 2 * g->cap : 16;
		struct node **a = realloc(g->n, cap * sizeof(*a));
		if (!a)
			return CUDA_ERROR_OUT_OF_MEMORY;
		g->n = a;
		g->cap = cap;
	}
	if (!(c = node_dup(n, 1)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	c->g = g;
	g->n[g->nn++] = c;
	if (out)
		*out = c;
	return CUDA_SUCCESS;
}

/* Run a node on a stream, or record it if the stream captures. */
static CUresult submit(CUstream hs, const struct node *n)
{
	struct stream *s;
	CUresult r;
	NEED_CTX();
	if ((r = stream_use(hs, &s)))
		return r;
	if (s && s->capturing) {
		if ((r = node_check(n)))
			return r;
		if ((r = graph_append(s->g, n, NULL)) == CUDA_SUCCESS)
			S.captured++;
		return r;
	}
	return node_run(n);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
		       unsigned bz, unsigned shmem, CUstream hs, void **params, void **extra)
{
	const unsigned grid[3] = { gx, gy, gz }, block[3] = { bx, by, bz };
	struct node n;
	CUresult r;
	NEED_CTX();
	if ((r = kernel_node(&n, f, NULL, grid, block, shmem, params, extra)))
		return r;
	return submit(hs, &n);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
	if (!c || (c->numAttrs && !c->attrs))
		return CUDA_ERROR_INVALID_VALUE;
	return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
		      c->blockDimZ, c->sharedMemBytes, c->hStream, params, extra);
}

/* Copies. */
static void cp_1d(CUDA_MEMCPY3D *c, CUmemorytype dt, uintptr_t d, CUmemorytype st, uintptr_t s, size_t n)
{
	memset(c, 0, sizeof(*c));
	c->dstMemoryType = dt;
	if (dt == CU_MEMORYTYPE_HOST)
		c->dstHost = (void *)d;
	else
		c->dstDevice = d;
	c->srcMemoryType = st;
	if (st == CU_MEMORYTYPE_HOST)
		c->srcHost = (const void *)s;
	else
		c->srcDevice = s;
	c->WidthInBytes = n;
	c->Height = 1;
	c->Depth = 1;
}

static CUresult copy(CUstream hs, CUmemorytype dt, uintptr_t d, CUmemorytype st, uintptr_t s, size_t n)
{
	struct node nd = { .type = CU_GRAPH_NODE_TYPE_MEMCPY };
	if (n && (!d || !s))
		return CUDA_ERROR_INVALID_VALUE;
	cp_1d(&nd.cp, dt, d, st, s, n);
	return submit(hs, &nd);
}

#define MH CU_MEMORYTYPE_HOST
#define MD CU_MEMORYTYPE_DEVICE
#define MU CU_MEMORYTYPE_UNIFIED

static CUresult copy_peer(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream hs)
{
	if (!oget(dc, O_CTX) || !oget(sc, O_CTX))
		return CUDA_ERROR_INVALID_CONTEXT;
	return copy(hs, MD, d, MD, s, n);
}

static CUresult copy_2d(const CUDA_MEMCPY2D *p, CUstream hs)
{
	struct node nd = { .type = CU_GRAPH_NODE_TYPE_MEMCPY };
	CUDA_MEMCPY3D *c = &nd.cp;
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	memset(c, 0, sizeof(*c));
	c->srcXInBytes = p->srcXInBytes;
	c->srcY = p->srcY;
	c->srcMemoryType = p->srcMemoryType;
	c->srcHost = p->srcHost;
	c->srcDevice = p->srcDevice;
	c->srcArray = p->srcArray;
	c->srcPitch = p->srcPitch;
	c->srcHeight = p->Height + p->srcY;
	c->dstXInBytes = p->dstXInBytes;
	c->dstY = p->dstY;
	c->dstMemoryType = p->dstMemoryType;
	c->dstHost = p->dstHost;
	c->dstDevice = p->dstDevice;
	c->dstArray = p->dstArray;
	c->dstPitch = p->dstPitch;
	c->dstHeight = p->Height + p->dstY;
	c->WidthInBytes = p->WidthInBytes;
	c->Height = p->Height;
	c->Depth = 1;
	return submit(hs, &nd);
}

static CUresult copy_3d(const CUDA_MEMCPY3D *p, CUstream hs)
{
	struct node nd = { .type = CU_GRAPH_NODE_TYPE_MEMCPY };
	if (!p || p->srcLOD || p->dstLOD || p->reserved0 || p->reserved1)
		return CUDA_ERROR_INVALID_VALUE;
	nd.cp = *p;
	return submit(hs, &nd);
}

static CUresult mset(CUstream hs, CUdeviceptr d, size_t pitch, unsigned v, unsigned es, size_t w, size_t h)
{
	struct node nd = { .type = CU_GRAPH_NODE_TYPE_MEMSET };
	nd.ms = (CUDA_MEMSET_NODE_PARAMS){ d, h > 1 ? pitch : w * es, v, es, w, h };
	return submit(hs, &nd);
}

static CUresult write_value(CUstream hs, CUdeviceptr addr, uint64_t v, unsigned size, unsigned flags)
{
	struct stream *s;
	CUresult r = stream_use(hs, &s);
	if (r)
		return r;
	NEED_CTX();
	if (flags & ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)
		return CUDA_ERROR_INVALID_VALUE;
	if (s && s->capturing)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* no mem-op nodes in the fake */
	if (addr % size || (r = dev_range(addr, size)))
		return CUDA_ERROR_INVALID_VALUE;
	if (size == 4)
		*(uint32_t *)(uintptr_t)addr = (uint32_t)v;
	else
		*(uint64_t *)(uintptr_t)addr = v;
	S.write_values++;
	return CUDA_SUCCESS;
}

/* Stream-ordered allocation (not capturable in the fake). */
static CUresult alloc_async(CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream hs)
{
	struct stream *s;
	CUresult r = stream_use(hs, &s);
	if (r)
		return r;
	if (pool != (CUmemoryPool)&g_pool)
		return CUDA_ERROR_INVALID_VALUE;
	if (s && s->capturing)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	return mem_alloc(d, n, A_ASYNC);
}

static CUresult free_async(CUdeviceptr d, CUstream hs)
{
	struct stream *s;
	CUresult r = stream_use(hs, &s);
	if (r)
		return r;
	if (s && s->capturing)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	return mem_free(d);
}

/* ---------------------------------------------------------------------------------
 * Modules and libraries: every one exposes every registry kernel.
 */
static CUresult image_ok(const void *image)
{
	if (!image)
		return CUDA_ERROR_INVALID_VALUE;
	return *(const char *)image ? CUDA_SUCCESS : CUDA_ERROR_INVALID_IMAGE;
}

static void mod_free(struct mod *m)
{
	for (unsigned i = 0; m->f && i < fake_nkernels; i++)
		if (m->f[i])
			odel(m->f[i]);
	free(m->f);
	odel(m);
}

static CUresult mod_new(struct mod **out, struct lib *lib)
{
	struct mod *m = onew(sizeof(*m), O_MOD);
	if (!m || !(m->f = calloc(fake_nkernels, sizeof(*m->f)))) {
		if (m)
			odel(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->lib = lib;
	for (unsigned i = 0; i < fake_nkernels; i++) {
		if (!(m->f[i] = onew(sizeof(*m->f[i]), O_FUNC))) {
			mod_free(m);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
		m->f[i]->k = &fake_kernels[i];
		m->f[i]->m = m;
	}
	*out = m;
	return CUDA_SUCCESS;
}

static CUresult mod_load(CUmodule *pm, const void *image)
{
	struct mod *m;
	CUresult r;
	NEED_CTX();
	if (!pm)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = image_ok(image)) || (r = mod_new(&m, NULL)))
		return r;
	*pm = (CUmodule)m;
	return CUDA_SUCCESS;
}

/* Read a whole file, NUL-terminated. */
static CUresult read_file(const char *path, char **out)
{
	FILE *f;
	char *b = NULL;
	size_t n = 0, cap = 0, got;
	if (!path)
		return CUDA_ERROR_INVALID_VALUE;
	if (!(f = fopen(path, "rb")))
		return CUDA_ERROR_FILE_NOT_FOUND;
	do {
		if (cap - n < 4097) {
			char *nb = realloc(b, cap = cap ? 2 * cap : 8192);
			if (!nb) {
				free(b);
				fclose(f);
				return CUDA_ERROR_OUT_OF_MEMORY;
			}
			b = nb;
		}
		n += got = fread(b + n, 1, 4096, f);
	} while (got);
	fclose(f);
	b[n] = 0;
	*out = b;
	return CUDA_SUCCESS;
}

static CUresult mod_load_file(CUmodule *pm, const char *path)
{
	char *img;
	CUresult r;
	NEED_CTX();
	if (!pm)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = read_file(path, &img)))
		return r;
	r = mod_load(pm, img);
	free(img);
	return r;
}

static CUresult mod_unload(CUmodule h)
{
	struct mod *m = oget(h, O_MOD);
	if (!m)
		return CUDA_ERROR_INVALID_HANDLE;
	if (m->lib)
		return CUDA_ERROR_NOT_PERMITTED; /* owned by its library */
	mod_free(m);
	return CUDA_SUCCESS;
}

static int kernel_index(const char *name)
{
	for (unsigned i = 0; i < fake_nkernels; i++)
		if (!strcmp(fake_kernels[i].name, name))
			return (int)i;
	return -1;
}

static CUresult mod_func(CUfunction *pf, CUmodule h, const char *name)
{
	struct mod *m = oget(h, O_MOD);
	int i;
	if (!pf || !name)
		return CUDA_ERROR_INVALID_VALUE;
	if (!m)
		return CUDA_ERROR_INVALID_HANDLE;
	if ((i = kernel_index(name)) < 0)
		return CUDA_ERROR_NOT_FOUND;
	*pf = (CUfunction)m->f[i];
	return CUDA_SUCCESS;
}

static void lib_free(struct lib *l)
{
	for (unsigned i = 0; l->k && i < fake_nkernels; i++)
		if (l->k[i])
			odel(l->k[i]);
	free(l->k);
	if (l->m)
		mod_free(l->m);
	odel(l);
}

static CUresult lib_load(CUlibrary *pl, const void *image)
{
	struct lib *l;
	CUresult r;
	if (!pl)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = image_ok(image)))
		return r;
	if (!(l = onew(sizeof(*l), O_LIB)) || !(l->k = calloc(fake_nkernels, sizeof(*l->k))))
		goto oom;
	for (unsigned i = 0; i < fake_nkernels; i++) {
		if (!(l->k[i] = onew(sizeof(*l->k[i]), O_KERN)))
			goto oom;
		l->k[i]->k = &fake_kernels[i];
		l->k[i]->l = l;
	}
	if (mod_new(&l->m, l))
		goto oom;
	*pl = (CUlibrary)l;
	return CUDA_SUCCESS;
oom:
	if (l)
		lib_free(l);
	return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult lib_load_file(CUlibrary *pl, const char *path)
{
	char *img;
	CUresult r;
	if (!pl)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = read_file(path, &img)))
		return r;
	r = lib_load(pl, img);
	free(img);
	return r;
}

static CUresult lib_unload(CUlibrary h)
{
	struct lib *l = oget(h, O_LIB);
	if (!l)
		return CUDA_ERROR_INVALID_HANDLE;
	lib_free(l);
	return CUDA_SUCCESS;
}

static CUresult lib_kernel(CUkernel *pk, CUlibrary h, const char *name)
{
	struct lib *l = oget(h, O_LIB);
	int i;
	if (!pk || !name)
		return CUDA_ERROR_INVALID_VALUE;
	if (!l)
		return CUDA_ERROR_INVALID_HANDLE;
	if ((i = kernel_index(name)) < 0)
		return CUDA_ERROR_NOT_FOUND;
	*pk = (CUkernel)l->k[i];
	return CUDA_SUCCESS;
}

static CUresult lib_module(CUmodule *pm, CUlibrary h)
{
	struct lib *l = oget(h, O_LIB);
	NEED_CTX();
	if (!pm)
		return CUDA_ERROR_INVALID_VALUE;
	if (!l)
		return CUDA_ERROR_INVALID_HANDLE;
	*pm = (CUmodule)l->m;
	return CUDA_SUCCESS;
}

static CUresult kernel_func(CUfunction *pf, CUkernel h)
{
	struct kern *k = oget(h, O_KERN);
	NEED_CTX();
	if (!pf)
		return CUDA_ERROR_INVALID_VALUE;
	if (!k)
		return CUDA_ERROR_INVALID_HANDLE;
	*pf = (CUfunction)k->l->m->f[k->k - fake_kernels];
	return CUDA_SUCCESS;
}

static CUresult kernel_library(CUlibrary *pl, CUkernel h)
{
	struct kern *k = oget(h, O_KERN);
	if (!pl)
		return CUDA_ERROR_INVALID_VALUE;
	if (!k)
		return CUDA_ERROR_INVALID_HANDLE;
	*pl = (CUlibrary)k->l;
	return CUDA_SUCCESS;
}

/* Name and parameter info; `type` is O_FUNC or O_KERN: the other kind of handle is
 * refused with CUDA_ERROR_INVALID_HANDLE, like the real driver. */
static CUresult get_name(const char **name, const void *h, uint32_t type)
{
	struct obj *o = oget(h, type);
	if (!name)
		return CUDA_ERROR_INVALID_VALUE;
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	*name = type == O_FUNC ? ((struct func *)o)->k->name : ((struct kern *)o)->k->name;
	return CUDA_SUCCESS;
}

static CUresult param_info(const void *h, uint32_t type, size_t idx, size_t *off, size_t *size)
{
	struct obj *o = oget(h, type);
	const struct fk *k;
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	k = type == O_FUNC ? ((struct func *)o)->k : ((struct kern *)o)->k;
	if (k->opaque)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (!off || idx >= k->nparams)
		return CUDA_ERROR_INVALID_VALUE;
	*off = k->off[idx];
	if (size)
		*size = k->size[idx];
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------
 * Streams, events, capture.
 */
static CUresult stream_create(CUstream *ps, unsigned flags, int prio)
{
	struct stream *s;
	NEED_CTX();
	if (!ps || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
		return CUDA_ERROR_INVALID_VALUE;
	if (!(s = onew(sizeof(*s), O_STREAM)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->ctx = CUR;
	s->flags = flags;
	s->prio = prio;
	*ps = (CUstream)s;
	return CUDA_SUCCESS;
}

static void graph_free(struct graph *g)
{
	for (size_t i = 0; i < g->nn; i++)
		node_free(g->n[i], 1);
	free(g->n);
	odel(g);
}

static CUresult stream_destroy(CUstream h)
{
	struct stream *s = oget(h, O_STREAM);
	if (!s)
		return CUDA_ERROR_INVALID_HANDLE;
	if (s->capturing == 1 && s->g)
		graph_free(s->g);
	odel(s);
	return CUDA_SUCCESS;
}

/* Synchronizing a capturing stream fails and invalidates its capture. */
static CUresult stream_sync(CUstream h)
{
	struct stream *s;
	CUresult r;
	NEED_CTX();
	if ((r = stream_use(h, &s)))
		return r;
	if (s && s->capturing) {
		s->invalid = 1;
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	}
	return CUDA_SUCCESS;
}

/* cuCtxSynchronize while any stream captures fails and invalidates every capture. */
static CUresult ctx_sync(CUcontext h)
{
	CUresult r = ctx_arg(h);
	if (r)
		return r;
	if (any_capturing(0)) {
		invalidate_captures(0);
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	}
	return CUDA_SUCCESS;
}

static CUresult stream_is_capturing(CUstream h, CUstreamCaptureStatus *st)
{
	struct stream *s;
	CUresult r = get_stream(h, &s);
	if (r)
		return r;
	if (!st)
		return CUDA_ERROR_INVALID_VALUE;
	/* the legacy stream answers so while a blocking stream captures (no harm done) */
	if (!s && h != CU_STREAM_PER_THREAD && any_capturing(1))
		return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
	*st = !s || !s->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
	      : s->invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
	return CUDA_SUCCESS;
}

static CUresult capture_info(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *graph,
			     const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps)
{
	struct stream *s;
	CUresult r = stream_is_capturing(h, st);
	if (r)
		return r;
	get_stream(h, &s);
	if (!s || !s->capturing)
		return CUDA_SUCCESS;
	if (id)
		*id = s->cap_id;
	if (graph)
		*graph = (CUgraph)s->g;
	if (deps)
		*deps = s->g->nn ? (const CUgraphNode *)&s->g->n[s->g->nn - 1] : NULL;
	if (edges)
		*edges = NULL;
	if (ndeps)
		*ndeps = s->g->nn ? 1 : 0;
	return CUDA_SUCCESS;
}

static CUresult begin_capture(CUstream h, CUgraph into, CUstreamCaptureMode mode)
{
	struct stream *s;
	struct graph *g = NULL;
	CUresult r = get_stream(h, &s);
	if (r)
		return r;
	if (!s)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy / per-thread stream */
	if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
	    mode != CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	if (s->capturing)
		return CUDA_ERROR_ILLEGAL_STATE;
	if (into && !(g = oget(into, O_GRAPH)))
		return CUDA_ERROR_INVALID_VALUE;
	if (!g && !(g = onew(sizeof(*g), O_GRAPH)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->g = g;
	s->capturing = into ? 2 : 1;
	s->cap_id = ++g_cap_id;
	return CUDA_SUCCESS;
}

static CUresult end_capture(CUstream h, CUgraph *pg)
{
	struct stream *s;
	CUresult r = get_stream(h, &s);
	if (r)
		return r;
	if (!pg)
		return CUDA_ERROR_INVALID_VALUE;
	if (!s || !s->capturing)
		return CUDA_ERROR_ILLEGAL_STATE;
	if (s->invalid) {
		if (s->capturing == 1)
			graph_free(s->g);
		*pg = NULL;
		s->capturing = s->invalid = 0;
		s->g = NULL;
		return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
	}
	*pg = (CUgraph)s->g;
	s->capturing = 0;
	s->g = NULL;
	return CUDA_SUCCESS;
}

static CUresult event_create(CUevent *pe, unsigned flags)
{
	struct event *e;
	NEED_CTX();
	if (!pe || (flags & ~0xfu))
		return CUDA_ERROR_INVALID_VALUE;
	if (!(e = onew(sizeof(*e), O_EVENT)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->flags = flags;
	*pe = (CUevent)e;
	return CUDA_SUCCESS;
}

static CUresult event_destroy(CUevent h)
{
	struct event *e = oget(h, O_EVENT);
	if (!e)
		return CUDA_ERROR_INVALID_HANDLE;
	odel(e);
	return CUDA_SUCCESS;
}

static CUresult event_elapsed(float *ms, CUevent a, CUevent b)
{
	struct event *x = oget(a, O_EVENT), *y = oget(b, O_EVENT);
	if (!ms)
		return CUDA_ERROR_INVALID_VALUE;
	if (!x || !y || (x->flags | y->flags) & CU_EVENT_DISABLE_TIMING)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!x->at_ns || !y->at_ns)
		return CUDA_ERROR_INVALID_HANDLE;
	*ms = (float)(((double)y->at_ns - (double)x->at_ns) / 1e6);
	return CUDA_SUCCESS;
}

static CUresult event_stream(CUevent e, CUstream h)
{
	struct stream *s;
	CUresult r = get_stream(h, &s);
	if (r)
		return r;
	return oget(e, O_EVENT) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Work runs at its issue here: an event passes when it is recorded. */
static CUresult event_record(CUevent h, CUstream st)
{
	CUresult r = event_stream(h, st);
	if (r == CUDA_SUCCESS) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		((struct event *)oget(h, O_EVENT))->at_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	}
	return r;
}

/* ---------------------------------------------------------------------------------
 * Graphs.
 */
static CUresult graph_create(CUgraph *pg, unsigned flags)
{
	struct graph *g;
	if (!pg || flags)
		return CUDA_ERROR_INVALID_VALUE;
	if (!(g = onew(sizeof(*g), O_GRAPH)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	*pg = (CUgraph)g;
	return CUDA_SUCCESS;
}

static CUresult graph_destroy(CUgraph h)
{
	struct graph *g = oget(h, O_GRAPH);
	if (!g)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < nobj; i++) /* a stream still capturing into it stops */
		if (objs[i]->type == O_STREAM && ((struct stream *)objs[i])->g == g) {
			((struct stream *)objs[i])->g = NULL;
			((struct stream *)objs[i])->capturing = 0;
			((struct stream *)objs[i])->invalid = 0;
		}
	graph_free(g);
	return CUDA_SUCCESS;
}

static CUresult kparams_node(struct node *n, const CUDA_KERNEL_NODE_PARAMS *p)
{
	const unsigned grid[3] = { p->gridDimX, p->gridDimY, p->gridDimZ };
	const unsigned block[3] = { p->blockDimX, p->blockDimY, p->blockDimZ };
	if (p->ctx && !oget(p->ctx, O_CTX))
		return CUDA_ERROR_INVALID_CONTEXT;
	return kernel_node(n, p->func, p->func ? NULL : p->kern, grid, block, p->sharedMemBytes,
			   p->kernelParams, p->extra);
}

static CUresult graph_add_kernel(CUgraphNode *pn, CUgraph h, const CUgraphNode *deps, size_t ndeps,
				 const CUDA_KERNEL_NODE_PARAMS *p)
{
	struct graph *g = oget(h, O_GRAPH);
	struct node n, *out;
	CUresult r;
	if (!pn || !p || (ndeps && !deps))
		return CUDA_ERROR_INVALID_VALUE;
	if (!g)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < ndeps; i++)
		if (!oget(deps[i], O_NODE))
			return CUDA_ERROR_INVALID_VALUE;
	if ((r = kparams_node(&n, p)) || (r = graph_append(g, &n, &out)))
		return r;
	*pn = (CUgraphNode)out;
	return CUDA_SUCCESS;
}

static CUresult graph_nodes(CUgraph h, CUgraphNode *nodes, size_t *num)
{
	struct graph *g = oget(h, O_GRAPH);
	if (!g || !num)
		return CUDA_ERROR_INVALID_VALUE;
	if (nodes) {
		for (size_t i = 0; i < *num; i++)
			nodes[i] = i < g->nn ? (CUgraphNode)g->n[i] : NULL;
		if (*num > g->nn)
			*num = g->nn;
	} else {
		*num = g->nn;
	}
	return CUDA_SUCCESS;
}

static struct node *get_node(CUgraphNode h, CUgraphNodeType type)
{
	struct node *n = oget(h, O_NODE);
	return n && (type == (CUgraphNodeType)-1 || n->type == type) ? n : NULL;
}

static CUresult node_type(CUgraphNode h, CUgraphNodeType *t)
{
	struct node *n = get_node(h, (CUgraphNodeType)-1);
	if (!n || !t)
		return CUDA_ERROR_INVALID_VALUE;
	*t = n->type;
	return CUDA_SUCCESS;
}

static CUresult kernel_node_get(CUgraphNode h, CUDA_KERNEL_NODE_PARAMS *p)
{
	struct node *n = get_node(h, CU_GRAPH_NODE_TYPE_KERNEL);
	if (!n || !p)
		return CUDA_ERROR_INVALID_VALUE;
	memset(p, 0, sizeof(*p));
	p->func = n->fh;
	p->kern = n->kh;
	p->gridDimX = n->grid[0];
	p->gridDimY = n->grid[1];
	p->gridDimZ = n->grid[2];
	p->blockDimX = n->block[0];
	p->blockDimY = n->block[1];
	p->blockDimZ = n->block[2];
	p->sharedMemBytes = n->shmem;
	p->kernelParams = n->pp;   /* the node's stored copies */
	p->extra = NULL;
	return CUDA_SUCCESS;
}

static CUresult memcpy_node_get(CUgraphNode h, CUDA_MEMCPY3D *p)
{
	struct node *n = get_node(h, CU_GRAPH_NODE_TYPE_MEMCPY);
	if (!n || !p)
		return CUDA_ERROR_INVALID_VALUE;
	*p = n->cp;
	return CUDA_SUCCESS;
}

static CUresult memset_node_get(CUgraphNode h, CUDA_MEMSET_NODE_PARAMS *p)
{
	struct node *n = get_node(h, CU_GRAPH_NODE_TYPE_MEMSET);
	if (!n || !p)
		return CUDA_ERROR_INVALID_VALUE;
	*p = n->ms;
	return CUDA_SUCCESS;
}

static void exec_nodes_free(struct gexec *x)
{
	for (size_t i = 0; i < x->nn; i++)
		node_free(x->n[i], 0);
	free(x->n);
	x->n = NULL;
	x->nn = 0;
}

/* Copy g's nodes into x (replacing x's); keeps `orig` of nodes already there. */
static CUresult exec_fill(struct gexec *x, const struct graph *g, int update)
{
	struct node **n = calloc(g->nn ? g->nn : 1, sizeof(*n));
	if (!n)
		return CUDA_ERROR_OUT_OF_MEMORY;
	for (size_t i = 0; i < g->nn; i++) {
		if (!(n[i] = node_dup(g->n[i], 0))) {
			while (i-- > 0)
				node_free(n[i], 0);
			free(n);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
		n[i]->orig = update ? x->n[i]->orig : g->n[i];
		n[i]->upd = g->n[i];
	}
	exec_nodes_free(x);
	x->n = n;
	x->nn = g->nn;
	return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *px, CUgraph h)
{
	struct graph *g = oget(h, O_GRAPH);
	struct gexec *x;
	CUresult r;
	NEED_CTX();
	if (!px || !g)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < g->nn; i++)
		if ((r = node_check(g->n[i])))
			return r;
	if (!(x = onew(sizeof(*x), O_EXEC)))
		return CUDA_ERROR_OUT_OF_MEMORY;
	if ((r = exec_fill(x, g, 0))) {
		odel(x);
		return r;
	}
	*px = (CUgraphExec)x;
	return CUDA_SUCCESS;
}

static CUresult instantiate_params(CUgraphExec *px, CUgraph h, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
	CUresult r;
	struct stream *s;
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = get_stream(p->hUploadStream, &s)))
		return r;
	r = instantiate(px, h);
	p->hErrNode_out = NULL;
	p->result_out = r ? CUDA_GRAPH_INSTANTIATE_ERROR : CUDA_GRAPH_INSTANTIATE_SUCCESS;
	return r;
}

static CUresult graph_launch(CUgraphExec h, CUstream hs)
{
	struct gexec *x = oget(h, O_EXEC);
	struct stream *s;
	CUresult r;
	NEED_CTX();
	if (!x)
		return CUDA_ERROR_INVALID_VALUE;
	if ((r = stream_use(hs, &s)))
		return r;
	if (s && s->capturing)
		return CUDA_ERROR_NOT_SUPPORTED; /* no child-graph nodes in the fake */
	for (size_t i = 0; i < x->nn; i++)
		if ((r = node_check(x->n[i])))
			return r;
	S.graph_launches++;
	for (size_t i = 0; i < x->nn; i++)
		if ((r = node_run(x->n[i])))
			return r;
	return CUDA_SUCCESS;
}

static CUresult exec_destroy(CUgraphExec h)
{
	struct gexec *x = oget(h, O_EXEC);
	if (!x)
		return CUDA_ERROR_INVALID_VALUE;
	exec_nodes_free(x);
	odel(x);
	return CUDA_SUCCESS;
}

static CUresult exec_update(CUgraphExec hx, CUgraph hg, CUgraphExecUpdateResultInfo *info)
{
	struct gexec *x = oget(hx, O_EXEC);
	struct graph *g = oget(hg, O_GRAPH);
	int same = 1;
	if (!x || !g || !info)
		return CUDA_ERROR_INVALID_VALUE;
	memset(info, 0, sizeof(*info));
	same = g->nn == x->nn;
	for (size_t i = 0; same && i < g->nn; i++)
		same = g->n[i]->type == x->n[i]->type;
	if (!same) {
		info->result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
		return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
	}
	info->result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
	return exec_fill(x, g, 1);
}

static CUresult exec_kernel_set(CUgraphExec hx, CUgraphNode hn, const CUDA_KERNEL_NODE_PARAMS *p)
{
	struct gexec *x = oget(hx, O_EXEC);
	struct node n, *c;
	CUresult r;
	if (!x || !p)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < x->nn; i++) {
		struct node *e = x->n[i];
		if (e->type != CU_GRAPH_NODE_TYPE_KERNEL ||
		    (e->orig != (struct node *)hn && e->upd != (struct node *)hn))
			continue;
		if ((r = kparams_node(&n, p)))
			return r;
		if (!(c = node_dup(&n, 0)))
			return CUDA_ERROR_OUT_OF_MEMORY;
		c->orig = e->orig;
		c->upd = e->upd;
		node_free(e, 0);
		x->n[i] = c;
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------------------------
 * cuGetProcAddress: (base name, cudaVersion, flags) -> an exported variant, like the
 * real driver.  PA: default variants; PT: per-thread default stream (_ptds/_ptsz).
 */
static CUresult fake_internal_only(int *out);

struct pa { const char *base; int ver; int pt; void *fn; };
#define PA(b, v, s) { #b, v, 0, (void *)s },
#define PT(b, v, s) { #b, v, 1, (void *)s },
static const struct pa proc_table[] = {
	PA(cuInit, 2000, cuInit) PA(cuDriverGetVersion, 2020, cuDriverGetVersion)
	PA(cuDeviceGet, 2000, cuDeviceGet) PA(cuDeviceGetCount, 2000, cuDeviceGetCount)
	PA(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2) PA(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle)
	PA(cuDeviceGetName, 2000, cuDeviceGetName) PA(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2)
	PA(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute)
	PA(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain)
	PA(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2)
	PA(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState)
	PA(cuCtxCreate, 3020, cuCtxCreate_v2) PA(cuCtxCreate, 12050, cuCtxCreate_v4)
	PA(cuCtxDestroy, 4000, cuCtxDestroy_v2) PA(cuCtxGetCurrent, 4000, cuCtxGetCurrent)
	PA(cuCtxSetCurrent, 4000, cuCtxSetCurrent) PA(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2)
	PA(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2)
	PA(cuCtxGetDevice, 2000, cuCtxGetDevice) PA(cuCtxGetDevice, 13000, cuCtxGetDevice_v2)
	PA(cuCtxSynchronize, 2000, cuCtxSynchronize) PA(cuCtxSynchronize, 13000, cuCtxSynchronize_v2)
	PA(cuCtxGetApiVersion, 3020, cuCtxGetApiVersion) PA(cuCtxGetId, 12000, cuCtxGetId)
	PA(cuGetErrorName, 6000, cuGetErrorName) PA(cuGetErrorString, 6000, cuGetErrorString)
	PA(cuGetProcAddress, 11030, cuGetProcAddress) PA(cuGetProcAddress, 12000, cuGetProcAddress_v2)
	PA(cuMemAlloc, 3020, cuMemAlloc_v2) PA(cuMemAllocPitch, 3020, cuMemAllocPitch_v2)
	PA(cuMemFree, 3020, cuMemFree_v2) PA(cuMemAllocManaged, 6000, cuMemAllocManaged)
	PA(cuMemAllocHost, 3020, cuMemAllocHost_v2) PA(cuMemHostAlloc, 2020, cuMemHostAlloc)
	PA(cuMemFreeHost, 2000, cuMemFreeHost) PA(cuMemHostRegister, 6050, cuMemHostRegister_v2)
	PA(cuMemHostUnregister, 4000, cuMemHostUnregister)
	PA(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer_v2)
	PA(cuMemAllocAsync, 11020, cuMemAllocAsync) PT(cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz)
	PA(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync)
	PT(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz)
	PA(cuMemFreeAsync, 11020, cuMemFreeAsync) PT(cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz)
	PA(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool)
	PA(cuMemGetInfo, 3020, cuMemGetInfo_v2) PA(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2)
	PA(cuPointerGetAttribute, 4000, cuPointerGetAttribute)
	PA(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity)
	PA(cuMemAddressReserve, 10020, cuMemAddressReserve) PA(cuMemAddressFree, 10020, cuMemAddressFree)
	PA(cuMemCreate, 10020, cuMemCreate) PA(cuMemRelease, 10020, cuMemRelease)
	PA(cuMemMap, 10020, cuMemMap) PA(cuMemUnmap, 10020, cuMemUnmap)
	PA(cuMemSetAccess, 10020, cuMemSetAccess)
	PA(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle)
	PA(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle)
	PA(cuMemcpy, 4000, cuMemcpy) PT(cuMemcpy, 7000, cuMemcpy_ptds)
	PA(cuMemcpyAsync, 4000, cuMemcpyAsync) PT(cuMemcpyAsync, 7000, cuMemcpyAsync_ptsz)
	PA(cuMemcpyHtoD, 3020, cuMemcpyHtoD_v2) PT(cuMemcpyHtoD, 7000, cuMemcpyHtoD_v2_ptds)
	PA(cuMemcpyDtoH, 3020, cuMemcpyDtoH_v2) PT(cuMemcpyDtoH, 7000, cuMemcpyDtoH_v2_ptds)
	PA(cuMemcpyDtoD, 3020, cuMemcpyDtoD_v2) PT(cuMemcpyDtoD, 7000, cuMemcpyDtoD_v2_ptds)
	PA(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync_v2)
	PT(cuMemcpyHtoDAsync, 7000, cuMemcpyHtoDAsync_v2_ptsz)
	PA(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync_v2)
	PT(cuMemcpyDtoHAsync, 7000, cuMemcpyDtoHAsync_v2_ptsz)
	PA(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync_v2)
	PT(cuMemcpyDtoDAsync, 7000, cuMemcpyDtoDAsync_v2_ptsz)
	PA(cuMemcpy2D, 3020, cuMemcpy2D_v2) PT(cuMemcpy2D, 7000, cuMemcpy2D_v2_ptds)
	PA(cuMemcpy2DUnaligned, 3020, cuMemcpy2DUnaligned_v2)
	PT(cuMemcpy2DUnaligned, 7000, cuMemcpy2DUnaligned_v2_ptds)
	PA(cuMemcpy2DAsync, 3020, cuMemcpy2DAsync_v2) PT(cuMemcpy2DAsync, 7000, cuMemcpy2DAsync_v2_ptsz)
	PA(cuMemcpy3D, 3020, cuMemcpy3D_v2) PT(cuMemcpy3D, 7000, cuMemcpy3D_v2_ptds)
	PA(cuMemcpy3DAsync, 3020, cuMemcpy3DAsync_v2) PT(cuMemcpy3DAsync, 7000, cuMemcpy3DAsync_v2_ptsz)
	PA(cuMemcpyPeer, 4000, cuMemcpyPeer) PT(cuMemcpyPeer, 7000, cuMemcpyPeer_ptds)
	PA(cuMemcpyPeerAsync, 4000, cuMemcpyPeerAsync) PT(cuMemcpyPeerAsync, 7000, cuMemcpyPeerAsync_ptsz)
	PA(cuMemsetD8, 3020, cuMemsetD8_v2) PT(cuMemsetD8, 7000, cuMemsetD8_v2_ptds)
	PA(cuMemsetD16, 3020, cuMemsetD16_v2) PT(cuMemsetD16, 7000, cuMemsetD16_v2_ptds)
	PA(cuMemsetD32, 3020, cuMemsetD32_v2) PT(cuMemsetD32, 7000, cuMemsetD32_v2_ptds)
	PA(cuMemsetD8Async, 3020, cuMemsetD8Async) PT(cuMemsetD8Async, 7000, cuMemsetD8Async_ptsz)
	PA(cuMemsetD16Async, 3020, cuMemsetD16Async) PT(cuMemsetD16Async, 7000, cuMemsetD16Async_ptsz)
	PA(cuMemsetD32Async, 3020, cuMemsetD32Async) PT(cuMemsetD32Async, 7000, cuMemsetD32Async_ptsz)
	PA(cuMemsetD2D8, 3020, cuMemsetD2D8_v2) PT(cuMemsetD2D8, 7000, cuMemsetD2D8_v2_ptds)
	PA(cuMemsetD2D16, 3020, cuMemsetD2D16_v2) PT(cuMemsetD2D16, 7000, cuMemsetD2D16_v2_ptds)
	PA(cuMemsetD2D32, 3020, cuMemsetD2D32_v2) PT(cuMemsetD2D32, 7000, cuMemsetD2D32_v2_ptds)
	PA(cuMemsetD2D8Async, 3020, cuMemsetD2D8Async) PT(cuMemsetD2D8Async, 7000, cuMemsetD2D8Async_ptsz)
	PA(cuMemsetD2D16Async, 3020, cuMemsetD2D16Async)
	PT(cuMemsetD2D16Async, 7000, cuMemsetD2D16Async_ptsz)
	PA(cuMemsetD2D32Async, 3020, cuMemsetD2D32Async)
	PT(cuMemsetD2D32Async, 7000, cuMemsetD2D32Async_ptsz)
	PA(cuStreamWriteValue32, 11070, cuStreamWriteValue32_v2)
	PT(cuStreamWriteValue32, 11070, cuStreamWriteValue32_v2_ptsz)
	PA(cuStreamWriteValue64, 11070, cuStreamWriteValue64_v2)
	PA(cuStreamBatchMemOp, 11070, cuStreamBatchMemOp_v2)
	PT(cuStreamWriteValue64, 11070, cuStreamWriteValue64_v2_ptsz)
	PA(cuModuleLoad, 2000, cuModuleLoad) PA(cuModuleLoadData, 2000, cuModuleLoadData)
	PA(cuModuleLoadDataEx, 2010, cuModuleLoadDataEx)
	PA(cuModuleLoadFatBinary, 2000, cuModuleLoadFatBinary) PA(cuModuleUnload, 2000, cuModuleUnload)
	PA(cuModuleGetFunction, 2000, cuModuleGetFunction)
	PA(cuLibraryLoadData, 12000, cuLibraryLoadData) PA(cuLibraryLoadFromFile, 12000, cuLibraryLoadFromFile)
	PA(cuLibraryUnload, 12000, cuLibraryUnload) PA(cuLibraryGetKernel, 12000, cuLibraryGetKernel)
	PA(cuLibraryGetModule, 12000, cuLibraryGetModule) PA(cuKernelGetFunction, 12000, cuKernelGetFunction)
	PA(cuFuncGetName, 12030, cuFuncGetName) PA(cuKernelGetName, 12030, cuKernelGetName) PA(cuFuncLoad, 12040, cuFuncLoad)
	PA(cuKernelGetLibrary, 12050, cuKernelGetLibrary)
	PA(cuFuncGetParamInfo, 12040, cuFuncGetParamInfo) PA(cuKernelGetParamInfo, 12040, cuKernelGetParamInfo)
	PA(cuStreamCreate, 2000, cuStreamCreate) PA(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority)
	PA(cuStreamDestroy, 4000, cuStreamDestroy_v2)
	PA(cuThreadExchangeStreamCaptureMode, 10010, cuThreadExchangeStreamCaptureMode)
	PA(cuStreamSynchronize, 2000, cuStreamSynchronize) PT(cuStreamSynchronize, 7000, cuStreamSynchronize_ptsz)
	PA(cuStreamQuery, 2000, cuStreamQuery) PT(cuStreamQuery, 7000, cuStreamQuery_ptsz)
	PA(cuStreamIsCapturing, 10000, cuStreamIsCapturing) PT(cuStreamIsCapturing, 10000, cuStreamIsCapturing_ptsz)
	PA(cuStreamGetCaptureInfo, 12030, cuStreamGetCaptureInfo_v3)
	PT(cuStreamGetCaptureInfo, 12030, cuStreamGetCaptureInfo_v3_ptsz)
	PA(cuEventCreate, 2000, cuEventCreate) PA(cuEventDestroy, 4000, cuEventDestroy_v2)
	PA(cuEventRecord, 2000, cuEventRecord) PT(cuEventRecord, 7000, cuEventRecord_ptsz)
	PA(cuEventSynchronize, 2000, cuEventSynchronize) PA(cuEventQuery, 2000, cuEventQuery)
	PA(cuEventElapsedTime, 2000, cuEventElapsedTime)
	PA(cuStreamWaitEvent, 3020, cuStreamWaitEvent) PT(cuStreamWaitEvent, 7000, cuStreamWaitEvent_ptsz)
	PA(cuLaunchKernel, 4000, cuLaunchKernel) PT(cuLaunchKernel, 7000, cuLaunchKernel_ptsz)
	PA(cuLaunchKernelEx, 11060, cuLaunchKernelEx) PT(cuLaunchKernelEx, 11060, cuLaunchKernelEx_ptsz)
	PA(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel)
	PT(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel_ptsz)
	PA(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2)
	PT(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2_ptsz)
	PA(cuStreamBeginCaptureToGraph, 12030, cuStreamBeginCaptureToGraph)
	PT(cuStreamBeginCaptureToGraph, 12030, cuStreamBeginCaptureToGraph_ptsz)
	PA(cuStreamEndCapture, 10000, cuStreamEndCapture) PT(cuStreamEndCapture, 10000, cuStreamEndCapture_ptsz)
	PA(cuGraphCreate, 10000, cuGraphCreate) PA(cuGraphDestroy, 10000, cuGraphDestroy)
	PA(cuGraphAddKernelNode, 12000, cuGraphAddKernelNode_v2) PA(cuGraphGetNodes, 10000, cuGraphGetNodes)
	PA(cuGraphNodeGetType, 10000, cuGraphNodeGetType)
	PA(cuGraphKernelNodeGetParams, 12000, cuGraphKernelNodeGetParams_v2)
	PA(cuGraphMemcpyNodeGetParams, 10000, cuGraphMemcpyNodeGetParams)
	PA(cuGraphMemsetNodeGetParams, 10000, cuGraphMemsetNodeGetParams)
	PA(cuGraphChildGraphNodeGetGraph, 10000, cuGraphChildGraphNodeGetGraph)
	PA(cuGraphInstantiate, 12000, cuGraphInstantiateWithFlags)
	PA(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags)
	PA(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams)
	PT(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams_ptsz)
	PA(cuGraphLaunch, 10000, cuGraphLaunch) PT(cuGraphLaunch, 10000, cuGraphLaunch_ptsz)
	PA(cuGraphExecDestroy, 10000, cuGraphExecDestroy)
	PA(cuGraphExecUpdate, 12000, cuGraphExecUpdate_v2)
	PA(cuGraphExecKernelNodeSetParams, 12000, cuGraphExecKernelNodeSetParams_v2)
	PA(cuFakeInternalOnly, 0, fake_internal_only)
};

/* What a newer driver's entry point looks like to libgpuos: an address that is none of
 * the exported variants (FAKECUDA_NEW_VARIANT=cuName makes cuGetProcAddress("cuName")
 * answer with it). Never meant to be called. */
static CUresult fake_new_variant(void)
{
	return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult proc_address(const char *sym, void **pfn, int ver, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *status)
{
	const char *newer = getenv("FAKECUDA_NEW_VARIANT");
	if (sym && pfn && newer && !strcmp(sym, newer)) {
		*pfn = (void *)fake_new_variant;
		if (status)
			*status = CU_GET_PROC_ADDRESS_SUCCESS;
		return CUDA_SUCCESS;
	}
	const struct pa *best = NULL;
	int known = 0, pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
	if (status)
		*status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	if (!sym || !pfn || (flags & ~(cuuint64_t)3))
		return CUDA_ERROR_INVALID_VALUE;
	*pfn = NULL;
	/* the per-thread variant when asked for and there is one for this version, else
	 * the default one */
	for (int pass = pt ? 1 : 0; pass >= 0 && !best; pass--)
		for (size_t i = 0; i < sizeof(proc_table) / sizeof(proc_table[0]); i++) {
			const struct pa *e = &proc_table[i];
			if (strcmp(e->base, sym))
				continue;
			known = 1;
			if (e->pt == pass && e->ver <= ver && (!best || e->ver > best->ver))
				best = e;
		}
	if (!best) {
		if (status && known)
			*status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
		return CUDA_ERROR_NOT_FOUND;
	}
	*pfn = best->fn;
	if (status)
		*status = CU_GET_PROC_ADDRESS_SUCCESS;
	return CUDA_SUCCESS;
}

/* Reachable only through cuGetProcAddress("cuFakeInternalOnly"): *out = 42. */
static CUresult fake_internal_only(int *out)
{
	count(C_cuFakeInternalOnly);
	if (!out)
		return ret(C_cuFakeInternalOnly, CUDA_ERROR_INVALID_VALUE);
	*out = 42;
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------
 * Device and context entry points.
 */
static CUresult dev_ok(CUdevice d) { return d == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }

static CUresult device_get(CUdevice *d, int ord)
{
	if (!d)
		return CUDA_ERROR_INVALID_VALUE;
	if (ord != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	*d = 0;
	return CUDA_SUCCESS;
}

static CUresult device_name(char *name, int len, CUdevice d)
{
	if (!name || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	snprintf(name, (size_t)len, "%s", "Fake CUDA Device (gpuos fakecuda)");
	return CUDA_SUCCESS;
}

static CUresult device_attr(int *v, CUdevice_attribute a, CUdevice d)
{
	if (!v || a <= 0 || a >= CU_DEVICE_ATTRIBUTE_MAX)
		return CUDA_ERROR_INVALID_VALUE;
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	switch (a) {
	case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
	case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
	case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
	case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 0x7fffffff; break;
	case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
	case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
	case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
	case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
	case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *v = 1; break;
	case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 49152; break;
	default: *v = 0; break;
	}
	return CUDA_SUCCESS;
}

static CUresult primary_retain(CUcontext *pc, CUdevice d)
{
	if (!pc)
		return CUDA_ERROR_INVALID_VALUE;
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	g_pctx_refs++;
	*pc = (CUcontext)&g_pctx;
	return CUDA_SUCCESS;
}

static CUresult primary_release(CUdevice d)
{
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	if (g_pctx_refs <= 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	g_pctx_refs--;
	return CUDA_SUCCESS;
}

static CUresult primary_state(CUdevice d, unsigned *flags, int *active)
{
	if (!flags || !active)
		return CUDA_ERROR_INVALID_VALUE;
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	*flags = g_pctx.flags;
	*active = g_pctx_refs > 0;
	return CUDA_SUCCESS;
}

static CUresult ctx_get_current(CUcontext *pc)
{
	if (!pc)
		return CUDA_ERROR_INVALID_VALUE;
	*pc = (CUcontext)CUR;
	return CUDA_SUCCESS;
}

static CUresult ctx_set_current(CUcontext h)
{
	struct ctx *c = oget(h, O_CTX);
	if (h && !c)
		return CUDA_ERROR_INVALID_CONTEXT;
	return set_current(c);
}

static CUresult ctx_push(CUcontext h)
{
	struct ctx *c = oget(h, O_CTX);
	if (!c)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (t_depth == CTX_STACK)
		return CUDA_ERROR_OUT_OF_MEMORY;
	t_stack[t_depth++] = c;
	return CUDA_SUCCESS;
}

static CUresult ctx_pop(CUcontext *pc)
{
	if (!t_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (pc)
		*pc = (CUcontext)t_stack[t_depth - 1];
	t_depth--;
	return CUDA_SUCCESS;
}

static CUresult ctx_device(CUdevice *d, CUcontext h)
{
	CUresult r = ctx_arg(h);
	if (r)
		return r;
	if (!d)
		return CUDA_ERROR_INVALID_VALUE;
	*d = 0;
	return CUDA_SUCCESS;
}

static CUresult ctx_api_version(CUcontext h, unsigned *v)
{
	CUresult r = ctx_arg(h);
	if (r)
		return r;
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	*v = 3020;
	return CUDA_SUCCESS;
}

static CUresult ctx_id(CUcontext h, unsigned long long *id)
{
	CUresult r = ctx_arg(h);
	if (r)
		return r;
	if (!id)
		return CUDA_ERROR_INVALID_VALUE;
	*id = h ? ((struct ctx *)h)->id : CUR->id;
	return CUDA_SUCCESS;
}

/* The calling thread's capture interaction mode (stored; the fake applies no rules). */
static __thread CUstreamCaptureMode t_capmode = CU_STREAM_CAPTURE_MODE_GLOBAL;

static CUresult exchange_capture_mode(CUstreamCaptureMode *mode)
{
	CUstreamCaptureMode old = t_capmode;
	if (!mode || (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
		      *mode != CU_STREAM_CAPTURE_MODE_RELAXED))
		return CUDA_ERROR_INVALID_VALUE;
	t_capmode = *mode;
	*mode = old;
	return CUDA_SUCCESS;
}

/* Device 0's UUID, as tests/fakes.py names GPU 0: GPU-00000000-0000-4000-8000-000000000000. */
static CUresult device_uuid(CUuuid *u, CUdevice d)
{
	static const unsigned char id[16] = { 0, 0, 0, 0, 0, 0, 0x40, 0, 0x80, 0 };
	if (!u)
		return CUDA_ERROR_INVALID_VALUE;
	if (d != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	memcpy(u->bytes, id, sizeof id);
	return CUDA_SUCCESS;
}

static CUresult out_int(int *p, int v)
{
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	*p = v;
	return CUDA_SUCCESS;
}

static CUresult err_str(CUresult e, const char **p, int name)
{
	const char *s;
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	s = name ? err_name(e) : err_string(e);
	*p = s;
	return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------------------------
 * The exported entry points.
 */
CUresult CUDAAPI cuInit(unsigned int Flags) { CALL_(cuInit, 0, do_init(Flags)); }
CUresult CUDAAPI cuDriverGetVersion(int *v) { CALL_(cuDriverGetVersion, 0, out_int(v, FAKECUDA_DRIVER_VERSION)); }
API(cuDeviceGet, (CUdevice *d, int ord), device_get(d, ord))
API(cuDeviceGetCount, (int *n), out_int(n, 1))
API(cuDeviceGetUuid_v2, (CUuuid *u, CUdevice d), device_uuid(u, d))
API(cuIpcGetMemHandle, (CUipcMemHandle *h, CUdeviceptr p), ipc_handle(h, p))
API(cuDeviceGetName, (char *name, int len, CUdevice d), device_name(name, len, d))
API(cuDeviceTotalMem_v2, (size_t *b, CUdevice d),
    !b ? CUDA_ERROR_INVALID_VALUE : dev_ok(d) ? CUDA_ERROR_INVALID_DEVICE : (*b = FAKECUDA_TOTAL_MEM, CUDA_SUCCESS))
API(cuDeviceGetAttribute, (int *v, CUdevice_attribute a, CUdevice d), device_attr(v, a, d))
API(cuDevicePrimaryCtxRetain, (CUcontext *pc, CUdevice d), primary_retain(pc, d))
API(cuDevicePrimaryCtxRelease_v2, (CUdevice d), primary_release(d))
API(cuDevicePrimaryCtxGetState, (CUdevice d, unsigned int *flags, int *active), primary_state(d, flags, active))
API(cuCtxCreate_v2, (CUcontext *pc, unsigned int flags, CUdevice d), ctx_create(pc, flags, d))
API(cuCtxCreate_v4, (CUcontext *pc, CUctxCreateParams *p, unsigned int flags, CUdevice d),
    (p && (p->execAffinityParams || p->cigParams)) ? CUDA_ERROR_NOT_SUPPORTED : ctx_create(pc, flags, d))
API(cuCtxDestroy_v2, (CUcontext c), ctx_destroy(c))
API(cuCtxGetCurrent, (CUcontext *pc), ctx_get_current(pc))
API(cuCtxSetCurrent, (CUcontext c), ctx_set_current(c))
API(cuCtxPushCurrent_v2, (CUcontext c), ctx_push(c))
API(cuCtxPopCurrent_v2, (CUcontext *pc), ctx_pop(pc))
API(cuCtxGetDevice, (CUdevice *d), ctx_device(d, NULL))
API(cuCtxGetDevice_v2, (CUdevice *d, CUcontext c), ctx_device(d, c))
API(cuCtxSynchronize, (void), ctx_sync(NULL))
API(cuCtxSynchronize_v2, (CUcontext c), ctx_sync(c))
API(cuCtxGetApiVersion, (CUcontext c, unsigned int *v), ctx_api_version(c, v))
API(cuCtxGetId, (CUcontext c, unsigned long long *id), ctx_id(c, id))
CUresult CUDAAPI cuGetErrorName(CUresult e, const char **p) { CALL_(cuGetErrorName, 0, err_str(e, p, 1)); }
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **p) { CALL_(cuGetErrorString, 0, err_str(e, p, 0)); }
CUresult CUDAAPI cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
	CALL_(cuGetProcAddress, 0, proc_address(sym, pfn, ver, flags, NULL));
}
CUresult CUDAAPI cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
				     CUdriverProcAddressQueryResult *status)
{
	CALL_(cuGetProcAddress_v2, 0, proc_address(sym, pfn, ver, flags, status));
}

/* Memory. */
API(cuMemAlloc_v2, (CUdeviceptr *d, size_t n), mem_alloc(d, n, A_DEV))
API(cuMemAllocPitch_v2, (CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned int es),
    mem_alloc_pitch(d, pitch, w, h, es))
API(cuMemFree_v2, (CUdeviceptr d), mem_free(d))
API(cuMemAllocManaged, (CUdeviceptr *d, size_t n, unsigned int flags),
    (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) ? CUDA_ERROR_INVALID_VALUE
								     : mem_alloc(d, n, A_MANAGED))
API(cuMemPrefetchAsync_v2, (CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream s),
    ((void)s, prefetch(p, n, loc, flags)))
API(cuMemAllocHost_v2, (void **pp, size_t n), host_alloc(pp, n, 0))
API(cuMemHostAlloc, (void **pp, size_t n, unsigned int flags), host_alloc(pp, n, flags))
API(cuMemFreeHost, (void *p), host_free(p))
API(cuMemHostRegister_v2, (void *p, size_t n, unsigned int flags), host_register(p, n, flags))
API(cuMemHostUnregister, (void *p), host_unregister(p))
API(cuMemHostGetDevicePointer_v2, (CUdeviceptr *d, void *p, unsigned int flags), host_devptr(d, p, flags))
API_PTSZ(cuMemAllocAsync, (CUdeviceptr *d, size_t n, CUstream s), alloc_async(d, n, (CUmemoryPool)&g_pool, s))
API_PTSZ(cuMemAllocFromPoolAsync, (CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s),
	 alloc_async(d, n, pool, s))
API_PTSZ(cuMemFreeAsync, (CUdeviceptr d, CUstream s), free_async(d, s))
API(cuDeviceGetDefaultMemPool, (CUmemoryPool *p, CUdevice d),
    !p ? CUDA_ERROR_INVALID_VALUE : dev_ok(d) ? CUDA_ERROR_INVALID_DEVICE : (*p = (CUmemoryPool)&g_pool, CUDA_SUCCESS))
API(cuMemGetInfo_v2, (size_t *fr, size_t *total), mem_info(fr, total))
API(cuMemGetAddressRange_v2, (CUdeviceptr *b, size_t *n, CUdeviceptr p), addr_range(b, n, p))
API(cuPointerGetAttribute, (void *data, CUpointer_attribute a, CUdeviceptr p), ptr_attr(data, a, p))
API(cuMemGetAllocationGranularity, (size_t *g, const CUmemAllocationProp *prop,
				    CUmemAllocationGranularity_flags o), vmm_gran(g, prop, o))
API(cuMemAddressReserve, (CUdeviceptr *p, size_t n, size_t al, CUdeviceptr addr, unsigned long long f),
    vmm_reserve(p, n, al, addr, f))
API(cuMemAddressFree, (CUdeviceptr p, size_t n), vmm_free(p, n))
API(cuMemCreate, (CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
		  unsigned long long f), vmm_create(h, n, prop, f))
API(cuMemRelease, (CUmemGenericAllocationHandle h), vmm_release(h))
API(cuMemMap, (CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long f),
    vmm_map(p, n, off, h, f))
API(cuMemUnmap, (CUdeviceptr p, size_t n), vmm_unmap(p, n))
API(cuMemSetAccess, (CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t c), vmm_access(p, n, d, c))
API(cuMemExportToShareableHandle, (void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t,
				   unsigned long long f), vmm_export(out, h, t, f))
API(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType t),
    vmm_import(h, os, t))

/* Copies and memsets. */
API_PTDS(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), copy(NULL, MU, d, MU, s, n))
API_PTSZ(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), copy(st, MU, d, MU, s, n))
API_PTDS(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *s, size_t n), copy(NULL, MD, d, MH, (uintptr_t)s, n))
API_PTDS(cuMemcpyDtoH_v2, (void *d, CUdeviceptr s, size_t n), copy(NULL, MH, (uintptr_t)d, MD, s, n))
API_PTDS(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), copy(NULL, MD, d, MD, s, n))
API_PTSZ(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *s, size_t n, CUstream st),
	 copy(st, MD, d, MH, (uintptr_t)s, n))
API_PTSZ(cuMemcpyDtoHAsync_v2, (void *d, CUdeviceptr s, size_t n, CUstream st),
	 copy(st, MH, (uintptr_t)d, MD, s, n))
API_PTSZ(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), copy(st, MD, d, MD, s, n))
API_PTDS(cuMemcpy2D_v2, (const CUDA_MEMCPY2D *p), copy_2d(p, NULL))
API_PTDS(cuMemcpy2DUnaligned_v2, (const CUDA_MEMCPY2D *p), copy_2d(p, NULL))
API_PTSZ(cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D *p, CUstream st), copy_2d(p, st))
API_PTDS(cuMemcpy3D_v2, (const CUDA_MEMCPY3D *p), copy_3d(p, NULL))
API_PTSZ(cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D *p, CUstream st), copy_3d(p, st))
API_PTDS(cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),
	 copy_peer(d, dc, s, sc, n, NULL))
API_PTSZ(cuMemcpyPeerAsync, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),
	 copy_peer(d, dc, s, sc, n, st))
API_PTDS(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), mset(NULL, d, 0, v, 1, n, 1))
API_PTDS(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), mset(NULL, d, 0, v, 2, n, 1))
API_PTDS(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), mset(NULL, d, 0, v, 4, n, 1))
API_PTSZ(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), mset(s, d, 0, v, 1, n, 1))
API_PTSZ(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream s), mset(s, d, 0, v, 2, n, 1))
API_PTSZ(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), mset(s, d, 0, v, 4, n, 1))
API_PTDS(cuMemsetD2D8_v2, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),
	 mset(NULL, d, p, v, 1, w, h))
API_PTDS(cuMemsetD2D16_v2, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),
	 mset(NULL, d, p, v, 2, w, h))
API_PTDS(cuMemsetD2D32_v2, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h),
	 mset(NULL, d, p, v, 4, w, h))
API_PTSZ(cuMemsetD2D8Async, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s),
	 mset(s, d, p, v, 1, w, h))
API_PTSZ(cuMemsetD2D16Async, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s),
	 mset(s, d, p, v, 2, w, h))
API_PTSZ(cuMemsetD2D32Async, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream s),
	 mset(s, d, p, v, 4, w, h))
API_PTSZ(cuStreamWriteValue32_v2, (CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f),
	 write_value(s, a, v, 4, f))
API_PTSZ(cuStreamWriteValue64_v2, (CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int f),
	 write_value(s, a, v, 8, f))
/* Only the write-value operations (an entry point libgpuos does not hook: it writes
 * device memory unseen). */
static CUresult batch_mem_op(CUstream s, unsigned n, CUstreamBatchMemOpParams *ops, unsigned f)
{
	CUresult r = CUDA_SUCCESS;
	if (f || (n && !ops))
		return CUDA_ERROR_INVALID_VALUE;
	for (unsigned i = 0; i < n && !r; i++) {
		const struct CUstreamMemOpWriteValueParams_st *w = &ops[i].writeValue;
		if (ops[i].operation != CU_STREAM_MEM_OP_WRITE_VALUE_32 &&
		    ops[i].operation != CU_STREAM_MEM_OP_WRITE_VALUE_64)
			return CUDA_ERROR_NOT_SUPPORTED;
		r = write_value(s, w->address, ops[i].operation == CU_STREAM_MEM_OP_WRITE_VALUE_32 ?
				w->value : w->value64, ops[i].operation == CU_STREAM_MEM_OP_WRITE_VALUE_32 ? 4 : 8,
				w->flags);
	}
	return r;
}
API(cuStreamBatchMemOp_v2, (CUstream s, unsigned int n, CUstreamBatchMemOpParams *ops, unsigned int f),
    batch_mem_op(s, n, ops, f))

/* Modules, libraries, functions, kernels. */
API(cuModuleLoad, (CUmodule *m, const char *path), mod_load_file(m, path))
API(cuModuleLoadData, (CUmodule *m, const void *image), mod_load(m, image))
API(cuModuleLoadDataEx, (CUmodule *m, const void *image, unsigned int n, CUjit_option *o, void **v),
    (n && (!o || !v)) ? CUDA_ERROR_INVALID_VALUE : mod_load(m, image))
API(cuModuleLoadFatBinary, (CUmodule *m, const void *fatbin), mod_load(m, fatbin))
API(cuModuleUnload, (CUmodule m), mod_unload(m))
API(cuModuleGetFunction, (CUfunction *f, CUmodule m, const char *name), mod_func(f, m, name))
API(cuLibraryLoadData, (CUlibrary *l, const void *code, CUjit_option *jo, void **jv, unsigned int njo,
			CUlibraryOption *lo, void **lv, unsigned int nlo),
    ((njo && (!jo || !jv)) || (nlo && (!lo || !lv))) ? CUDA_ERROR_INVALID_VALUE : lib_load(l, code))
API(cuLibraryLoadFromFile, (CUlibrary *l, const char *path, CUjit_option *jo, void **jv, unsigned int njo,
			    CUlibraryOption *lo, void **lv, unsigned int nlo),
    ((njo && (!jo || !jv)) || (nlo && (!lo || !lv))) ? CUDA_ERROR_INVALID_VALUE : lib_load_file(l, path))
API(cuLibraryUnload, (CUlibrary l), lib_unload(l))
API(cuLibraryGetKernel, (CUkernel *k, CUlibrary l, const char *name), lib_kernel(k, l, name))
API(cuLibraryGetModule, (CUmodule *m, CUlibrary l), lib_module(m, l))
API(cuKernelGetFunction, (CUfunction *f, CUkernel k), kernel_func(f, k))
API(cuFuncGetName, (const char **name, CUfunction f), get_name(name, f, O_FUNC))
API(cuKernelGetName, (const char **name, CUkernel k), get_name(name, k, O_KERN))
API(cuFuncLoad, (CUfunction f), oget(f, O_FUNC) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE)
API(cuKernelGetLibrary, (CUlibrary *l, CUkernel k), kernel_library(l, k))
API(cuFuncGetParamInfo, (CUfunction f, size_t i, size_t *off, size_t *size), param_info(f, O_FUNC, i, off, size))
API(cuKernelGetParamInfo, (CUkernel k, size_t i, size_t *off, size_t *size), param_info(k, O_KERN, i, off, size))

/* Streams, events, launches. */
API(cuStreamCreate, (CUstream *s, unsigned int flags), stream_create(s, flags, 0))
API(cuStreamCreateWithPriority, (CUstream *s, unsigned int flags, int prio), stream_create(s, flags, prio))
API(cuStreamDestroy_v2, (CUstream s), stream_destroy(s))
API(cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode *mode), exchange_capture_mode(mode))
API_PTSZ(cuStreamSynchronize, (CUstream s), stream_sync(s))
API_PTSZ(cuStreamQuery, (CUstream s), stream_sync(s))
API_PTSZ(cuStreamIsCapturing, (CUstream s, CUstreamCaptureStatus *st), stream_is_capturing(s, st))
API_PTSZ(cuStreamGetCaptureInfo_v3, (CUstream s, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
				     const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *n),
	 capture_info(s, st, id, g, deps, edges, n))
API(cuEventCreate, (CUevent *e, unsigned int flags), event_create(e, flags))
API(cuEventDestroy_v2, (CUevent e), event_destroy(e))
API_PTSZ(cuEventRecord, (CUevent e, CUstream s), event_record(e, s))
API(cuEventElapsedTime, (float *ms, CUevent a, CUevent b), event_elapsed(ms, a, b))
API(cuEventSynchronize, (CUevent e), oget(e, O_EVENT) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE)
API(cuEventQuery, (CUevent e), oget(e, O_EVENT) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE)
API_PTSZ(cuStreamWaitEvent, (CUstream s, CUevent e, unsigned int flags),
	 flags > 1 ? CUDA_ERROR_INVALID_VALUE : event_stream(e, s))
API_PTSZ(cuLaunchKernel, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
			  unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params,
			  void **extra),
	 launch(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
API_PTSZ(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **params, void **extra),
	 launch_ex(c, f, params, extra))
API_PTSZ(cuLaunchCooperativeKernel, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
				     unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
				     CUstream s, void **params),
	 launch(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL))

/* Capture and graphs. */
API_PTSZ(cuStreamBeginCapture_v2, (CUstream s, CUstreamCaptureMode mode), begin_capture(s, NULL, mode))
API_PTSZ(cuStreamBeginCaptureToGraph, (CUstream s, CUgraph g, const CUgraphNode *deps,
				       const CUgraphEdgeData *edata, size_t ndeps, CUstreamCaptureMode mode),
	 (!g || (ndeps && !deps) || (edata && !ndeps)) ? CUDA_ERROR_INVALID_VALUE : begin_capture(s, g, mode))
API_PTSZ(cuStreamEndCapture, (CUstream s, CUgraph *g), end_capture(s, g))
API(cuGraphCreate, (CUgraph *g, unsigned int flags), graph_create(g, flags))
API(cuGraphDestroy, (CUgraph g), graph_destroy(g))
API(cuGraphAddKernelNode_v2, (CUgraphNode *n, CUgraph g, const CUgraphNode *deps, size_t ndeps,
			      const CUDA_KERNEL_NODE_PARAMS *p), graph_add_kernel(n, g, deps, ndeps, p))
API(cuGraphGetNodes, (CUgraph g, CUgraphNode *nodes, size_t *n), graph_nodes(g, nodes, n))
API(cuGraphNodeGetType, (CUgraphNode n, CUgraphNodeType *t), node_type(n, t))
API(cuGraphKernelNodeGetParams_v2, (CUgraphNode n, CUDA_KERNEL_NODE_PARAMS *p), kernel_node_get(n, p))
API(cuGraphMemcpyNodeGetParams, (CUgraphNode n, CUDA_MEMCPY3D *p), memcpy_node_get(n, p))
API(cuGraphMemsetNodeGetParams, (CUgraphNode n, CUDA_MEMSET_NODE_PARAMS *p), memset_node_get(n, p))
API(cuGraphChildGraphNodeGetGraph, (CUgraphNode n, CUgraph *g),
    (!g || !oget(n, O_NODE)) ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED)
API(cuGraphInstantiateWithFlags, (CUgraphExec *x, CUgraph g, unsigned long long flags),
    (flags & ~0xfULL) ? CUDA_ERROR_INVALID_VALUE : instantiate(x, g))
API_PTSZ(cuGraphInstantiateWithParams, (CUgraphExec *x, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p),
	 instantiate_params(x, g, p))
API_PTSZ(cuGraphLaunch, (CUgraphExec x, CUstream s), graph_launch(x, s))
API(cuGraphExecDestroy, (CUgraphExec x), exec_destroy(x))
API(cuGraphExecUpdate_v2, (CUgraphExec x, CUgraph g, CUgraphExecUpdateResultInfo *info), exec_update(x, g, info))
API(cuGraphExecKernelNodeSetParams_v2, (CUgraphExec x, CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS *p),
    exec_kernel_set(x, n, p))

/* ---------------------------------------------------------------------------------
 * Statistics.
 */
int fakecuda_stats(struct fakecuda_stats *out)
{
	if (!out)
		return -1;
	pthread_mutex_lock(&L);
	*out = S;
	out->calls = __atomic_load_n(&S.calls, __ATOMIC_RELAXED);
	out->errors = __atomic_load_n(&S.errors, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&L);
	return 0;
}

long long fakecuda_calls(const char *name)
{
	for (int i = 0; name && i < C__N; i++)
		if (!strcmp(api_names[i], name))
			return (long long)__atomic_load_n(&g_calls[i], __ATOMIC_RELAXED);
	return -1;
}

void fakecuda_reset_stats(void)
{
	pthread_mutex_lock(&L);
	uint64_t la = S.live_allocs, lb = S.live_bytes;
	memset(&S, 0, sizeof(S));
	S.live_allocs = la;
	S.live_bytes = lb;
	for (int i = 0; i < C__N; i++)
		__atomic_store_n(&g_calls[i], 0, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&L);
}

__attribute__((constructor)) static void fake_ctor(void)
{
	const char *d = getenv("FAKECUDA_DEBUG");
	g_debug = d && *d && *d != '0';
	d = getenv("FAKECUDA_STICKY_FAULTS");
	g_sticky_faults = d && *d && *d != '0';
	d = getenv("FAKECUDA_VMM_CREATE_FAIL");
	g_vmm_create_fail = d && *d && *d != '0';
}

__attribute__((destructor)) static void fake_dtor(void)
{
	const char *path = getenv("FAKECUDA_STATS");
	char buf[4096];
	struct fakecuda_stats s;
	FILE *f;
	size_t o = 0;
	if (!path || !*path)
		return;
	for (const char *p = path; *p && o < sizeof(buf) - 24; p++) {
		if (p[0] == '%' && p[1] == 'p') {
			o += (size_t)snprintf(buf + o, sizeof(buf) - o, "%d", (int)getpid());
			p++;
		} else {
			buf[o++] = *p;
		}
	}
	buf[o] = 0;
	if (!(f = fopen(buf, "w")))
		return;
	fakecuda_stats(&s);
	fprintf(f, "{\"pid\": %d, \"calls\": %llu, \"errors\": %llu, \"launches\": %llu, "
		"\"fp_launches\": %llu, \"captured\": %llu, \"graph_launches\": %llu, \"copies\": %llu, "
		"\"bytes_copied\": %llu, \"memsets\": %llu, \"bytes_set\": %llu, \"write_values\": %llu, "
		"\"allocs\": %llu, \"frees\": %llu, \"live_allocs\": %llu, \"live_bytes\": %llu, "
		"\"vmm_reserves\": %llu, \"vmm_creates\": %llu, \"per_call\": {",
		(int)getpid(), (unsigned long long)s.calls, (unsigned long long)s.errors,
		(unsigned long long)s.launches, (unsigned long long)s.fp_launches,
		(unsigned long long)s.captured, (unsigned long long)s.graph_launches,
		(unsigned long long)s.copies, (unsigned long long)s.bytes_copied,
		(unsigned long long)s.memsets, (unsigned long long)s.bytes_set,
		(unsigned long long)s.write_values, (unsigned long long)s.allocs,
		(unsigned long long)s.frees, (unsigned long long)s.live_allocs,
		(unsigned long long)s.live_bytes, (unsigned long long)s.vmm_reserves,
		(unsigned long long)s.vmm_creates);
	for (int i = 0, first = 1; i < C__N; i++)
		if (g_calls[i]) {
			fprintf(f, "%s\"%s\": %llu", first ? "" : ", ", api_names[i],
				(unsigned long long)g_calls[i]);
			first = 0;
		}
	fprintf(f, "}}\n");
	fclose(f);
}
