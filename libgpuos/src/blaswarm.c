/* SPDX-License-Identifier: MIT */
/*
 * blaswarm.c - a warm standby starts cuBLAS while it waits (docs/mps.md).
 *
 * A warm standby (GPUOS_MPS_STANDBY_AT=launch) waits at its first kernel launch with its
 * context made; its first iteration after the release then spent most of its time in its
 * first cuBLAS calls: cuBLAS unpacks the images of its GEMM kernels into memory of its
 * own and loads them, which preload.c cannot do for it.  cuBLAS keeps what it loads for
 * every handle of the process and for other shapes of the same kind (H100, probe
 * tools/probes/first_iteration_probe.py: the first iteration 35-63 ms after GEMMs on a
 * handle of the probe's own, in the client's shapes or others, against 126-198 ms).  So,
 * in a standby whose program has loaded cuBLAS, a thread of ours makes GEMMs of the
 * common kinds (fp32, TF32, fp16, bf16; cublasGemmEx with each transposition and
 * cublasLt with a bias, as PyTorch's Linear calls it) on handles, a stream and scratch
 * memory of its own, while the program waits.  Its launches pass the standby's wait
 * (gpuos_blaswarm_thread) and are not noted as the client's kernels.  Nothing it makes
 * is handed to the program; handles stay alive (their loaded code is what it is for),
 * scratch memory is freed.  GPUOS_MPS_STANDBY_CUBLAS=0 turns it off.  With it, H100,
 * bench/mps_faults.py spare-hold oob-write: victims back in 0.20-0.22 s at N = 4 and 8,
 * against 0.26-0.27 s and 0.52 s without (README).
 */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

GPUOS_TLS int gpuos_blaswarm_thread; /* this thread is ours: past the wait, not noted */
struct gpuos_blaswarm_report gpuos_blaswarm; /* what it did, once done (preload.c reports it) */

/* cuBLAS's and cublasLt's types, as ints and pointers (cublas_api.h, cublasLt.h) */
typedef int (*create_fn)(void **);
typedef int (*set_stream_fn)(void *, CUstream);
typedef int (*gemm_ex_fn)(void *, int, int, int, int, int, const void *, const void *, int, int,
			  const void *, int, int, const void *, void *, int, int, int, int);
typedef int (*lt_desc_create_fn)(void **, int, int);
typedef int (*lt_desc_set_fn)(void *, int, const void *, size_t);
typedef int (*lt_layout_create_fn)(void **, int, uint64_t, uint64_t, int64_t);
typedef int (*lt_pref_create_fn)(void **);
typedef int (*lt_heuristic_fn)(void *, void *, void *, void *, void *, void *, void *, int, void *, int *);
typedef int (*lt_matmul_fn)(void *, void *, const void *, const void *, void *, const void *, void *,
			    const void *, const void *, void *, void *, void *, const void *, void *,
			    size_t, CUstream);

enum { OP_N = 0, OP_T = 1 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };             /* cudaDataType */
enum { COMPUTE_32F = 68, COMPUTE_32F_FAST_TF32 = 77 };  /* cublasComputeType_t */
enum { GEMM_DEFAULT = -1 };
enum { LT_TRANSA = 3, LT_TRANSB = 4, LT_EPILOGUE = 7, LT_BIAS_POINTER = 8, LT_EPILOGUE_BIAS = 4 };
enum { LT_PREF_MAX_WORKSPACE = 1 };

#define DIM 1024           /* the larger shapes: m = k = DIM, n = BATCH */
#define BATCH 256
#define SMALL 64
#define WORKSPACE (4u << 20)
#define SCRATCH (3u * DIM * DIM * 4u) /* A, B and C of the largest call, fp32 */

struct found {
	const char *prefix;
	char path[4096];
};

static int find_loaded(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	struct found *f = arg;
	const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
	base = base ? base + 1 : info->dlpi_name;
	if (!base || strncmp(base, f->prefix, strlen(f->prefix)))
		return 0;
	snprintf(f->path, sizeof f->path, "%s", info->dlpi_name);
	return 1;
}

/* The library the program has loaded whose file name starts with prefix ("libcublas.so"),
 * opened once more (not loaded: a program without it gets none); NULL if none. */
static void *loaded(const char *prefix)
{
	struct found f = { prefix, "" };
	if (!dl_iterate_phdr(find_loaded, &f))
		return NULL;
	return dlopen(f.path, RTLD_LAZY | RTLD_NOLOAD);
}

struct warm {
	CUcontext ctx;
	void *blas, *lt;      /* the libraries */
	void *h, *lth;        /* our handles */
	CUstream s;
	CUdeviceptr a, b, c, bias, ws;
	int calls, failed;
};

static void gemms(struct warm *w, int type, int compute)
{
	gemm_ex_fn gemm = (gemm_ex_fn)dlsym(w->blas, "cublasGemmEx");
	if (!gemm || !w->h)
		return;
	static const int ops[][2] = { { OP_T, OP_N }, { OP_N, OP_N }, { OP_N, OP_T } };
	static const int shapes[][3] = { { DIM, BATCH, DIM }, { SMALL, SMALL, SMALL } };
	const float one = 1.0f, zero = 0.0f; /* scale type fp32 for every compute type here */
	for (size_t o = 0; o < sizeof ops / sizeof *ops; o++)
		for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
			int m = shapes[k][0], n = shapes[k][1], kk = shapes[k][2];
			int lda = ops[o][0] == OP_T ? kk : m, ldb = ops[o][1] == OP_T ? n : kk;
			int rc = gemm(w->h, ops[o][0], ops[o][1], m, n, kk, &one, (void *)(uintptr_t)w->a, type,
				      lda, (void *)(uintptr_t)w->b, type, ldb, &zero, (void *)(uintptr_t)w->c, type,
				      m, compute, GEMM_DEFAULT);
			w->calls++;
			w->failed += rc != 0;
		}
}

/* y = W^T x + bias through cublasLt, as PyTorch's Linear runs it, the heuristic's first
 * algorithm. */
static void lt_bias(struct warm *w, int type, int compute)
{
	lt_desc_create_fn desc_create = (lt_desc_create_fn)dlsym(w->lt, "cublasLtMatmulDescCreate");
	lt_desc_set_fn desc_set = (lt_desc_set_fn)dlsym(w->lt, "cublasLtMatmulDescSetAttribute");
	lt_layout_create_fn layout = (lt_layout_create_fn)dlsym(w->lt, "cublasLtMatrixLayoutCreate");
	lt_pref_create_fn pref_create = (lt_pref_create_fn)dlsym(w->lt, "cublasLtMatmulPreferenceCreate");
	lt_desc_set_fn pref_set = (lt_desc_set_fn)dlsym(w->lt, "cublasLtMatmulPreferenceSetAttribute");
	lt_heuristic_fn heuristic = (lt_heuristic_fn)dlsym(w->lt, "cublasLtMatmulAlgoGetHeuristic");
	lt_matmul_fn matmul = (lt_matmul_fn)dlsym(w->lt, "cublasLtMatmul");
	if (!w->lth || !desc_create || !desc_set || !layout || !pref_create || !pref_set || !heuristic ||
	    !matmul)
		return;
	const int m = DIM, n = BATCH, k = DIM;
	const int ta = OP_T, tb = OP_N, epi = LT_EPILOGUE_BIAS;
	void *bias = (void *)(uintptr_t)w->bias, *desc = NULL, *pref = NULL, *la = NULL, *lb = NULL, *lc = NULL;
	uint64_t ws = WORKSPACE;
	/* cublasLtMatmulHeuristicResult_t: the algorithm (64 bytes), workspace size, state,
	 * waves, 4 reserved ints */
	_Alignas(8) unsigned char result[96];
	int found = 0;
	const float one = 1.0f, zero = 0.0f;
	if (desc_create(&desc, compute, R_32F) || desc_set(desc, LT_TRANSA, &ta, sizeof ta) ||
	    desc_set(desc, LT_TRANSB, &tb, sizeof tb) || desc_set(desc, LT_EPILOGUE, &epi, sizeof epi) ||
	    desc_set(desc, LT_BIAS_POINTER, &bias, sizeof bias) || layout(&la, type, k, m, k) ||
	    layout(&lb, type, k, n, k) || layout(&lc, type, m, n, m) || pref_create(&pref) ||
	    pref_set(pref, LT_PREF_MAX_WORKSPACE, &ws, sizeof ws) ||
	    heuristic(w->lth, desc, la, lb, lc, lc, pref, 1, result, &found) || !found) {
		w->failed++;
		return; /* (descriptors are a few bytes each: not destroyed, as the handles) */
	}
	int rc = matmul(w->lth, desc, &one, (void *)(uintptr_t)w->a, la, (void *)(uintptr_t)w->b, lb, &zero,
			(void *)(uintptr_t)w->c, lc, (void *)(uintptr_t)w->c, lc, result,
			(void *)(uintptr_t)w->ws, WORKSPACE, w->s);
	w->calls++;
	w->failed += rc != 0;
}

static void *warm_main(void *arg)
{
	struct warm *w = arg;
	gpuos_blaswarm_thread = 1;
	uint64_t t0 = gpuos_now_ns();
	if (gpuos_drv.ctx_push(w->ctx) != CUDA_SUCCESS)
		goto out;
	if (gpuos_drv.stream_create(&w->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
	    gpuos_drv.mem_alloc(&w->a, SCRATCH) != CUDA_SUCCESS ||
	    gpuos_drv.mem_alloc(&w->ws, WORKSPACE) != CUDA_SUCCESS) {
		gpuos_dbg("cuBLAS warm-up: no stream or scratch memory");
		if (w->a)
			gpuos_drv.mem_free(w->a);
		goto pop;
	}
	w->b = w->a + DIM * DIM * 4u;
	w->c = w->b + DIM * DIM * 4u;
	w->bias = w->ws; /* read only by the bias epilogue; any bytes do */
	create_fn create = w->blas ? (create_fn)dlsym(w->blas, "cublasCreate_v2") : NULL;
	set_stream_fn set_stream = w->blas ? (set_stream_fn)dlsym(w->blas, "cublasSetStream_v2") : NULL;
	create_fn lt_create = w->lt ? (create_fn)dlsym(w->lt, "cublasLtCreate") : NULL;
	if (create && set_stream && (create(&w->h) || set_stream(w->h, w->s)))
		w->h = NULL;
	if (lt_create && lt_create(&w->lth))
		w->lth = NULL;
	static const int kinds[][2] = { { R_32F, COMPUTE_32F }, { R_32F, COMPUTE_32F_FAST_TF32 },
					{ R_16F, COMPUTE_32F }, { R_16BF, COMPUTE_32F } };
	for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
		gemms(w, kinds[i][0], kinds[i][1]);
		if (w->lt)
			lt_bias(w, kinds[i][0], kinds[i][1]);
	}
	gpuos_drv.stream_sync(w->s);
	gpuos_blaswarm.calls = w->calls;
	gpuos_blaswarm.failed = w->failed;
	gpuos_blaswarm.ns = gpuos_now_ns() - t0;
	__atomic_store_n(&gpuos_blaswarm.done, 1, __ATOMIC_RELEASE);
	gpuos_dbg("cuBLAS warm-up: %d calls (%d failed) in %.1f ms", w->calls, w->failed,
		  (double)gpuos_blaswarm.ns / 1e6);
	gpuos_drv.mem_free(w->a);
	gpuos_drv.mem_free(w->ws);
pop:;
	CUcontext old;
	gpuos_drv.ctx_pop(&old);
out:
	return NULL;
}

void gpuos_blaswarm_start(void)
{
	const char *off = getenv("GPUOS_MPS_STANDBY_CUBLAS");
	if (off && !strcmp(off, "0"))
		return;
	static struct warm w;
	w.blas = loaded("libcublas.so");
	w.lt = loaded("libcublasLt.so");
	if (!w.blas && !w.lt)
		return; /* the program has not loaded cuBLAS: nothing to start */
	if (!gpuos_drv.ctx_get_current || gpuos_drv.ctx_get_current(&w.ctx) != CUDA_SUCCESS || !w.ctx ||
	    !gpuos_drv.ctx_push || !gpuos_drv.ctx_pop || !gpuos_drv.stream_create || !gpuos_drv.stream_sync ||
	    !gpuos_drv.mem_alloc || !gpuos_drv.mem_free)
		return;
	if (gpuos_thread_detached(warm_main, &w))
		gpuos_dbg("cuBLAS warm-up: no thread");
}
