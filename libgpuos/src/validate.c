/* SPDX-License-Identifier: MIT */
/*
 * validate.c - validation mode of libgpuos (GPUOS_VALIDATE=1, `gpuos run --validate`).
 *
 * For every launch, copy, memset and graph launch the core calls gpuos_val_before()
 * just before the real driver call and gpuos_val_after() right after, holding
 * gpuos_val_lock from one to the other, so one operation at a time is validated
 * process-wide and the static state below needs no lock of its own.
 *
 *   before: synchronize the context; snapshot its live device allocations (the core's
 *           map); hash every 4 KiB chunk of them on the GPU (fingerprint.cu,
 *           gpuos_fp_hash) into "before".
 *   after:  synchronize the context (the operation has finished); hash again into
 *           "after"; gpuos_fp_diff lists the chunks whose hash changed; compare the
 *           changed chunks with what the core predicted and emit one VALIDATE record
 *           (changed / predicted / over-predicted / missed bytes, up to 64 misses).
 *
 * Everything the validator does on the GPU goes through the real driver entry points
 * (gpuos_drv), never through the exported cu* names (those are libgpuos's own
 * wrappers: calling them would record our work as the application's, or recurse into
 * gpuos_val_before() and deadlock on gpuos_val_lock).  Our device buffers are hidden
 * from the core's map with gpuos_track_ignore() so they are neither fingerprinted nor
 * predicted.  Work is issued on a private CU_STREAM_NON_BLOCKING stream per context.
 *
 * Stream capture.  Synchronizing the context while one of its streams is capturing
 * breaks the application's capture, so before synchronizing the validator looks for
 * captures in progress (see "stream captures" below) and skips the operation with
 * GPUOS_VAL_SKIP_CAPTURE if it finds one, or if cuCtxSynchronize answers with a
 * stream-capture error after all.  It also switches its thread to the relaxed capture
 * interaction mode around its own driver calls (cuThreadExchangeStreamCaptureMode,
 * restored afterwards) so that its allocations and module loads are not "unsafe calls"
 * that invalidate other threads' global-mode captures.  Captured work is validated
 * when its graph is launched.
 *
 * Failure.  The validator never fails the application and never turns tracking off:
 * validation failing is not tracking failing.  Any driver error skips the operation
 * (GPUOS_VAL_SKIP_ERROR, or _NOMEM when the GPU or host is out of memory, or _CAPTURE)
 * and the record says so.  When validation cannot work at all (a required driver
 * entry point is missing, or the fingerprint PTX cannot be loaded, e.g. a driver too
 * old for it), every operation of that context is skipped with GPUOS_VAL_SKIP_ERROR
 * and ONE STATUS record (state GPUOS_TRACK_ON: tracking goes on) says
 * "validation unavailable: ..." the first time it happens in the process.
 *
 * Accounting (all in bytes, over the allocations fingerprinted, i.e. the snapshot taken
 * before the operation less any that went away during it):
 *   changed   the changed chunks, a short last chunk of an allocation by its real length;
 *   predicted the union of the predictions clipped to the fingerprinted allocations:
 *             kernels: whole allocations (deduplicated); copies/memsets (GPUOS_BUF_EXACT):
 *             their written [ptr, ptr + len) ranges (a source, GPUOS_BUF_READ alone, is
 *             known not to change); touch_all: everything fingerprinted.
 *             Host (GPUOS_BUF_HOST) and managed buffers are not fingerprinted: they count
 *             neither as predicted nor as misses;
 *   missed    changed chunks that overlap no prediction;
 *   over-predicted  predicted bytes outside the changed chunks.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "validate.h"

pthread_mutex_t gpuos_val_lock = PTHREAD_MUTEX_INITIALIZER;
uint64_t gpuos_val_busy, gpuos_val_overlaps;
static uint64_t g_overlaps_before; /* gpuos_val_overlaps when the operation's before() ran */

#define CHUNK ((uint64_t)GPUOS_VALIDATE_CHUNK)
#define MAX_MISS 64
#define MAX_CTX 16

/* ---- real driver entry points ---------------------------------------------------- */

/* The validator calls the driver through gpuos_drv (hooks.c resolves every entry point
 * libgpuos calls itself, once), never through the exported cu* names: those are
 * libgpuos's own wrappers, and calling them would record our work as the application's,
 * or recurse into gpuos_val_before() and deadlock on gpuos_val_lock. */

static int g_resolved;          /* 0: not yet, 1: all required found, -1: unavailable */
static int g_status_emitted;    /* the one "validation unavailable" STATUS record */

/* ---- per-context state ----------------------------------------------------------- */

struct vctx {
	CUcontext ctx;                /* NULL: free slot */
	unsigned long long ctx_id;    /* cuCtxGetId, or 0 without it */
	int broken;                   /* the fingerprint module cannot be used here */
	CUmodule mod;
	CUfunction f_hash, f_diff;
	CUstream stream;
	CUdeviceptr d_count;          /* unsigned int, in a 16-byte allocation */
	CUdeviceptr d_segs;           /* struct gpuos_fp_seg[] */
	size_t segs_cap;              /* bytes */
	CUdeviceptr d_before, d_after, d_changed; /* uint64_t[chunk_cap] each */
	size_t chunk_cap;             /* chunks */
};

static struct vctx g_ctx[MAX_CTX];

/* ---- per-operation state (one operation at a time: gpuos_val_lock) --------------- */

struct val_state {
	struct vctx *vc;
	size_t nseg;                  /* segments in g_snap / g_fseg */
	uint64_t nchunks;
};

static struct val_state g_op;

/* Host arrays, kept and grown (never shrunk). */
static struct gpuos_seg *g_snap;   static size_t g_snap_cap;   /* before the operation */
static struct gpuos_seg *g_snap2;  static size_t g_snap2_cap;  /* after it */
static struct gpuos_fp_seg *g_fseg;      static size_t g_fseg_cap;   /* the "before" table */
static struct gpuos_fp_seg *g_fseg2;     static size_t g_fseg2_cap;  /* survivors, for "after" */
static unsigned char *g_alive;     static size_t g_alive_cap;
static uint64_t *g_changed;        static size_t g_changed_cap;

struct range {
	uint64_t start, end;
};
static struct range *g_pred;       static size_t g_pred_cap;
static size_t g_npred;

/* ---- helpers ------------------------------------------------------------------- */

/* In a forked child: the parent's contexts, modules and buffers are not the child's. */
void gpuos_val_forget(void)
{
	memset(g_ctx, 0, sizeof(g_ctx));
	g_status_emitted = 0;
}

/* One switch for all of libgpuos's diagnostics (ctl.c: GPUOS_LIB_DEBUG=1). */
#define dbg(fmt, ...) gpuos_dbg("validate: " fmt, ##__VA_ARGS__)

static const char *errname(CUresult r)
{
	const char *s = NULL;
	if (gpuos_drv.get_error_name && gpuos_drv.get_error_name(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA error";
}

static int is_capture_error(CUresult r)
{
	return (r >= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED &&
		r <= CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
}

/* The skip reason for a failed driver call of the validator. */
static int reason_of(CUresult r)
{
	if (r == CUDA_ERROR_OUT_OF_MEMORY)
		return GPUOS_VAL_SKIP_NOMEM;
	if (is_capture_error(r))
		return GPUOS_VAL_SKIP_CAPTURE;
	return GPUOS_VAL_SKIP_ERROR;
}

/* Grow a host array to hold `need` elements (amortized); 0 or ENOMEM. */
static int grow(void **p, size_t *cap, size_t need, size_t elsize)
{
	if (need <= *cap)
		return 0;
	size_t n = need + need / 2 + 16;
	if (n < need || n > SIZE_MAX / elsize)
		return ENOMEM;
	void *q = realloc(*p, n * elsize);
	if (!q)
		return ENOMEM;
	*p = q;
	*cap = n;
	return 0;
}

#define GROW(arr, cap, need) grow((void **)&(arr), &(cap), (need), sizeof *(arr))

/* The one STATUS record saying validation cannot work (tracking goes on). */
static void unavailable(CUresult err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void unavailable(CUresult err, const char *fmt, ...)
{
	struct gpuos_rec_status st;
	memset(&st, 0, sizeof st);
	int n = snprintf(st.reason, sizeof st.reason, "validation unavailable: ");
	va_list ap;
	va_start(ap, fmt);
	if (n > 0 && (size_t)n < sizeof st.reason)
		vsnprintf(st.reason + n, sizeof st.reason - (size_t)n, fmt, ap);
	va_end(ap);
	dbg("%s", st.reason);
	if (g_status_emitted)
		return;
	g_status_emitted = 1;
	st.state = GPUOS_TRACK_ON;
	st.err = (int32_t)err;
	gpuos_ring_emit(GPUOS_REC_STATUS, 0, &st, sizeof st, NULL, 0);
}

/* Whether the driver has what validation needs (once).  1: usable, 0: unavailable. */
static int resolve(void)
{
	if (g_resolved)
		return g_resolved > 0;
	if (!__atomic_load_n(&gpuos_resolved, __ATOMIC_ACQUIRE))
		gpuos_resolve();
	static const struct {
		size_t off;
		const char *name;
	} required[] = {
#define REQ(field, name) { offsetof(struct gpuos_drv, field), name }
		REQ(ctx_get_current, "cuCtxGetCurrent"), REQ(ctx_push, "cuCtxPushCurrent_v2"),
		REQ(ctx_pop, "cuCtxPopCurrent_v2"), REQ(ctx_sync, "cuCtxSynchronize"),
		REQ(module_load_data, "cuModuleLoadData"), REQ(module_get_function, "cuModuleGetFunction"),
		REQ(stream_create, "cuStreamCreate"), REQ(stream_sync, "cuStreamSynchronize"),
		REQ(launch_kernel, "cuLaunchKernel"), REQ(mem_get_address_range, "cuMemGetAddressRange_v2"),
		REQ(mem_alloc, "cuMemAlloc_v2"), REQ(mem_free, "cuMemFree_v2"),
		REQ(memcpy_htod_async, "cuMemcpyHtoDAsync_v2"), REQ(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2"),
#undef REQ
	}; /* the others (capture queries, cuCtxGetId, cuGetErrorName) are optional */
	for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
		if (!*(void **)((char *)&gpuos_drv + required[i].off)) {
			g_resolved = -1;
			unavailable(CUDA_ERROR_NOT_FOUND, "the driver has no %s", required[i].name);
			return 0;
		}
	}
	g_resolved = 1;
	return 1;
}

/* ---- context entry and capture mode -------------------------------------------- */

struct scope {
	int pushed;
	int mode_set;
	CUstreamCaptureMode old_mode;
};

/* Make `want` (or the current context when NULL) current and our thread's capture
 * mode relaxed.  Returns the context or NULL (*res says why). */
static CUcontext scope_enter(struct scope *sc, CUcontext want, CUresult *res)
{
	memset(sc, 0, sizeof *sc);
	if (gpuos_drv.thread_exchange_capture_mode) {
		CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
		if (gpuos_drv.thread_exchange_capture_mode(&m) == CUDA_SUCCESS) {
			sc->mode_set = 1;
			sc->old_mode = m;
		}
	}
	CUcontext cur = NULL;
	CUresult r = gpuos_drv.ctx_get_current(&cur);
	if (r != CUDA_SUCCESS) {
		*res = r;
		return NULL;
	}
	if (!want)
		want = cur;
	if (!want) {
		*res = CUDA_ERROR_INVALID_CONTEXT;
		return NULL;
	}
	if (cur != want) {
		r = gpuos_drv.ctx_push(want);
		if (r != CUDA_SUCCESS) {
			*res = r;
			return NULL;
		}
		sc->pushed = 1;
	}
	*res = CUDA_SUCCESS;
	return want;
}

static void scope_leave(struct scope *sc)
{
	if (sc->pushed) {
		CUcontext dummy;
		gpuos_drv.ctx_pop(&dummy);
	}
	if (sc->mode_set) {
		CUstreamCaptureMode m = sc->old_mode;
		gpuos_drv.thread_exchange_capture_mode(&m);
	}
}

/* ---- device buffers -------------------------------------------------------------- */

/* Room for `nchunks` hashes (x3) and `nseg` segments.  Frees before allocating anew
 * to keep the peak low; asks for a quarter more than needed, then exactly that. */
static CUresult vctx_reserve(struct vctx *vc, uint64_t nchunks, size_t nseg)
{
	CUresult r;
	if (nchunks > vc->chunk_cap) {
		gpuos_own_dev_free(&vc->d_before, vc->chunk_cap * 8);
		gpuos_own_dev_free(&vc->d_after, vc->chunk_cap * 8);
		gpuos_own_dev_free(&vc->d_changed, vc->chunk_cap * 8);
		vc->chunk_cap = 0;
		uint64_t want = nchunks + nchunks / 4;
		want = (want + 8191) & ~(uint64_t)8191; /* 64 KiB of hashes */
		for (int attempt = 0; attempt < 2; attempt++) {
			size_t bytes = (size_t)want * 8;
			r = gpuos_own_dev_alloc(&vc->d_before, bytes);
			if (r == CUDA_SUCCESS)
				r = gpuos_own_dev_alloc(&vc->d_after, bytes);
			if (r == CUDA_SUCCESS)
				r = gpuos_own_dev_alloc(&vc->d_changed, bytes);
			if (r == CUDA_SUCCESS) {
				vc->chunk_cap = (size_t)want;
				break;
			}
			/* undo (each is freed only if it was allocated) */
			gpuos_own_dev_free(&vc->d_before, bytes);
			gpuos_own_dev_free(&vc->d_after, bytes);
			gpuos_own_dev_free(&vc->d_changed, bytes);
			if (r != CUDA_ERROR_OUT_OF_MEMORY || want == nchunks)
				return r;
			want = nchunks;
		}
		if (!vc->chunk_cap)
			return r;
	}
	size_t sbytes = nseg * sizeof(struct gpuos_fp_seg);
	if (sbytes > vc->segs_cap) {
		gpuos_own_dev_free(&vc->d_segs, vc->segs_cap);
		vc->segs_cap = 0;
		size_t want = sbytes + sbytes / 2 + 4096;
		r = gpuos_own_dev_alloc(&vc->d_segs, want);
		if (r != CUDA_SUCCESS) {
			want = sbytes;
			r = gpuos_own_dev_alloc(&vc->d_segs, want);
			if (r != CUDA_SUCCESS)
				return r;
		}
		vc->segs_cap = want;
	}
	return CUDA_SUCCESS;
}

/* Load the module, functions, stream and count word of the current context `vc->ctx`.
 * Permanent failures (the PTX cannot be used) mark the context broken. */
static CUresult vctx_init(struct vctx *vc)
{
	CUresult r;
	if (!vc->mod) {
		r = gpuos_fp_load(&vc->mod);
		if (r != CUDA_SUCCESS) {
			if (r == CUDA_ERROR_OUT_OF_MEMORY)
				return r;
			vc->broken = 1;
			unavailable(r, "cuModuleLoadData of the fingerprint PTX failed: %s (%d)",
				    errname(r), (int)r);
			return r;
		}
	}
	if (!vc->f_hash || !vc->f_diff) {
		r = gpuos_drv.module_get_function(&vc->f_hash, vc->mod, "gpuos_fp_hash");
		if (r == CUDA_SUCCESS)
			r = gpuos_drv.module_get_function(&vc->f_diff, vc->mod, "gpuos_fp_diff");
		if (r != CUDA_SUCCESS) {
			vc->f_hash = vc->f_diff = NULL;
			if (r == CUDA_ERROR_OUT_OF_MEMORY)
				return r;
			vc->broken = 1;
			unavailable(r, "cuModuleGetFunction(gpuos_fp_hash/diff) failed: %s (%d)",
				    errname(r), (int)r);
			return r;
		}
	}
	if (!vc->stream) {
		r = gpuos_drv.stream_create(&vc->stream, CU_STREAM_NON_BLOCKING);
		if (r != CUDA_SUCCESS) {
			vc->stream = NULL;
			return r;
		}
	}
	if (!vc->d_count) {
		r = gpuos_own_dev_alloc(&vc->d_count, 16);
		if (r != CUDA_SUCCESS)
			return r;
	}
	return CUDA_SUCCESS;
}

/* The state of context `ctx` (current), or NULL when the table is full. */
static struct vctx *vctx_get(CUcontext ctx)
{
	unsigned long long id = 0;
	if (gpuos_drv.ctx_get_id && gpuos_drv.ctx_get_id(ctx, &id) != CUDA_SUCCESS)
		id = 0;
	struct vctx *free_slot = NULL;
	for (int i = 0; i < MAX_CTX; i++) {
		struct vctx *vc = &g_ctx[i];
		if (vc->ctx == ctx) {
			if (vc->ctx_id == id)
				return vc;
			/* The handle was reused by a new context: the old one's module,
			 * stream and memory went with it.  Only our ignore marks remain:
			 * drop them (the address ranges may be reused by the application). */
			dbg("context %p was recreated (id %llu -> %llu)", (void *)ctx,
			    vc->ctx_id, id);
			gpuos_track_ignore((uint64_t)vc->d_count, 16, 0);
			gpuos_track_ignore((uint64_t)vc->d_segs, vc->segs_cap, 0);
			gpuos_track_ignore((uint64_t)vc->d_before, vc->chunk_cap * 8, 0);
			gpuos_track_ignore((uint64_t)vc->d_after, vc->chunk_cap * 8, 0);
			gpuos_track_ignore((uint64_t)vc->d_changed, vc->chunk_cap * 8, 0);
			memset(vc, 0, sizeof *vc);
			vc->ctx = ctx;
			vc->ctx_id = id;
			return vc;
		}
		if (!vc->ctx && !free_slot)
			free_slot = vc;
	}
	if (!free_slot)
		return NULL;
	memset(free_slot, 0, sizeof *free_slot);
	free_slot->ctx = ctx;
	free_slot->ctx_id = id;
	return free_slot;
}

/* ---- GPU work ------------------------------------------------------------------ */

/* Upload `nseg` segments and hash them into `out` on the private stream (async). */
static CUresult hash_into(struct vctx *vc, const struct gpuos_fp_seg *segs, size_t nseg,
			  CUdeviceptr out, uint64_t nchunks)
{
	if (nseg == 0 || nchunks == 0)
		return CUDA_SUCCESS;
	CUresult r = gpuos_drv.memcpy_htod_async(vc->d_segs, segs, nseg * sizeof *segs, vc->stream);
	if (r != CUDA_SUCCESS)
		return r;
	return gpuos_fp_hash(vc->f_hash, vc->d_segs, (unsigned int)nseg, out, nchunks, vc->stream);
}

/* qsort order of struct gpuos_seg, struct range and uint64_t: all start with a
 * uint64_t key. */
static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Snapshot the context's allocations into *arr (grown); returns the count or
 * (size_t)-1 without memory. */
static size_t take_snapshot(CUcontext ctx, struct gpuos_seg **arr, size_t *cap)
{
	/* measuring touches: only the allocations whose touches fault */
	uint32_t flags = gpuos_validating == GPUOS_VALIDATE_TOUCHED ? GPUOS_A_DEVMEM | GPUOS_A_MEASURED : GPUOS_A_DEVMEM;
	size_t n = gpuos_track_snapshot(ctx, flags, *arr, *cap);
	while (n > *cap) {
		if (grow((void **)arr, cap, n, sizeof **arr))
			return (size_t)-1;
		n = gpuos_track_snapshot(ctx, flags, *arr, *cap);
	}
	/* Only what the driver still knows in this context is fingerprinted: an allocation
	 * the map kept past its end (its context destroyed, maybe a new one at the same
	 * handle) may be unmapped, and hashing it would fault the application's context. */
	size_t kept = 0;
	for (size_t i = 0; i < n; i++) {
		CUdeviceptr base = 0;
		size_t size = 0;
		if (gpuos_drv.mem_get_address_range(&base, &size, (CUdeviceptr)(*arr)[i].base) == CUDA_SUCCESS)
			(*arr)[kept++] = (*arr)[i];
		else
			dbg("allocation %#llx + %llu is no longer the driver's: not fingerprinted",
			    (unsigned long long)(*arr)[i].base, (unsigned long long)(*arr)[i].size);
	}
	n = kept;
	/* The core promises sorted, non-overlapping segments; the binary searches below
	 * rely on it, so make sure of the order at least. */
	for (size_t i = 1; i < n; i++) {
		if ((*arr)[i].base < (*arr)[i - 1].base) {
			qsort(*arr, n, sizeof **arr, cmp_u64);
			break;
		}
	}
	return n;
}

/* ---- stream captures ------------------------------------------------------------ */

/*
 * cuCtxSynchronize while any stream of the context is capturing fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and INVALIDATES that capture, whatever the
 * calling thread's capture interaction mode (seen on an H100, driver 580 / CUDA 13.0:
 * a global-mode capture on a non-blocking stream ends with
 * CUDA_ERROR_STREAM_CAPTURE_INVALIDATED).  So the validator must know of every capture
 * in progress in the context BEFORE it synchronizes.  It asks, in this order:
 *   - the core's count of captures in progress in the process,
 *     gpuos_captures_in_progress();
 *   - cuStreamIsCapturing on the operation's stream;
 *   - cuStreamIsCapturing on CU_STREAM_LEGACY (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: a
 *     blocking stream of the context is capturing; the query does not harm it).
 * Without the core's count, a capture on a non-blocking stream other than the
 * operation's is not seen: the synchronization then invalidates it (the operation is
 * skipped with _CAPTURE, the application's cuStreamEndCapture fails).  The validator
 * does not remember streams it saw capturing to ask them again later: a stream may be
 * destroyed right after its capture ends, and cuStreamIsCapturing on a destroyed
 * stream crashes (segfault, driver 580).
 */

/* 1 if a capture is known to be in progress (in the process, or in the current
 * context's blocking streams). */
static int capture_in_progress(void)
{
	if (gpuos_captures_in_progress() > 0)
		return 1;
	if (!gpuos_drv.stream_is_capturing)
		return 0;
	/* A blocking stream of the context capturing makes the legacy stream answer
	 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (without harming the capture). */
	CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult r = gpuos_drv.stream_is_capturing(CU_STREAM_LEGACY, &cs);
	if (is_capture_error(r) || (r == CUDA_SUCCESS && cs != CU_STREAM_CAPTURE_STATUS_NONE))
		return 1;
	return 0;
}

/* The context's allocations (g_snap) and their chunks numbered in one table (g_fseg):
 * *nseg of them, *nchunks chunks.  Returns a skip reason or 0. */
static int snapshot_chunks(CUcontext ctx, size_t *nseg, uint64_t *nchunks)
{
	size_t n = take_snapshot(ctx, &g_snap, &g_snap_cap);
	if (n == (size_t)-1)
		return GPUOS_VAL_SKIP_NOMEM;
	if (n > 0xffffffffu) /* the hash kernel's segment count */
		return GPUOS_VAL_SKIP_ERROR;
	if (GROW(g_fseg, g_fseg_cap, n))
		return GPUOS_VAL_SKIP_NOMEM;
	*nchunks = 0;
	for (size_t i = 0; i < n; i++) {
		g_fseg[i].base = g_snap[i].base;
		g_fseg[i].size = g_snap[i].size;
		g_fseg[i].first_chunk = *nchunks;
		*nchunks += (g_snap[i].size + CHUNK - 1) / CHUNK;
	}
	*nseg = n;
	return 0;
}

/* ---- measuring touches (GPUOS_VALIDATE=touched; touched.c) ---------------------- */

static struct gpuos_touch_pages g_touch;
static struct gpuos_rec_run *g_runs;  static size_t g_runs_cap;

static int mark_alive(const struct gpuos_val_op *op, struct vctx *vc, size_t nseg, size_t *nalive);
static size_t seg_lower(size_t n, uint64_t addr);

/* Before a launch: every measured allocation to host memory, so that whatever the launch
 * touches faults; the events of that move are dropped. */
static int touched_before(struct gpuos_val_op *op, CUcontext ctx, struct vctx *vc)
{
	if (op->op_type != GPUOS_REC_LAUNCH)
		return GPUOS_VAL_SKIP_NOT_MEASURED; /* copies' ranges are exact already */
	const char *why;
	if (!gpuos_drv.mem_prefetch) {
		unavailable(CUDA_ERROR_NOT_FOUND, "the driver has no cuMemPrefetchAsync_v2");
		return GPUOS_VAL_SKIP_ERROR;
	}
	if (!gpuos_touched_tracker(&why)) {
		unavailable(CUDA_ERROR_NOT_SUPPORTED, "%s", why);
		return GPUOS_VAL_SKIP_ERROR;
	}
	size_t nseg;
	uint64_t nchunks;
	int why_not = snapshot_chunks(ctx, &nseg, &nchunks);
	if (why_not)
		return why_not;
	CUresult r = CUDA_SUCCESS;
	if (!vc->stream)
		r = gpuos_drv.stream_create(&vc->stream, CU_STREAM_NON_BLOCKING);
	CUmemLocation host = { .type = CU_MEM_LOCATION_TYPE_HOST, .id = 0 };
	for (size_t i = 0; i < nseg && r == CUDA_SUCCESS; i++)
		r = gpuos_drv.mem_prefetch((CUdeviceptr)g_snap[i].base, g_snap[i].size, host, 0, vc->stream);
	if (r == CUDA_SUCCESS)
		r = gpuos_drv.stream_sync(vc->stream);
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: moving the measured allocations to host memory: %s (%d)",
		    (unsigned long long)op->seq, errname(r), (int)r);
		return reason_of(r);
	}
	gpuos_touched_drain(NULL, NULL);
	g_op.vc = vc;
	g_op.nseg = nseg;
	g_op.nchunks = nchunks;
	op->state = &g_op;
	return GPUOS_VAL_SKIP_NONE;
}

static int cmp_page(const void *a, const void *b)
{
	uint64_t x = ((const struct gpuos_touch_page *)a)->page, y = ((const struct gpuos_touch_page *)b)->page;
	return x < y ? -1 : x > y;
}

/* The TOUCHED record of pages g_touch.v[0..n) (sorted, unique): runs of pages at most
 * `gap` bytes apart, the gap doubled until the runs fit one record. */
static void emit_touched(const struct gpuos_val_op *op, size_t n, uint64_t faults, uint16_t flags)
{
	if (GROW(g_runs, g_runs_cap, n ? n : 1)) {
		flags |= GPUOS_TOUCHED_DROPPED;
		n = 0;
	}
	uint64_t gap = 0;
	size_t nrun;
	for (;;) {
		nrun = 0;
		for (size_t i = 0; i < n; i++) {
			uint64_t p = g_touch.v[i].page;
			struct gpuos_rec_run *last = nrun ? &g_runs[nrun - 1] : NULL;
			uint64_t end = last ? last->start + (uint64_t)last->pages * GPUOS_TOUCH_PAGE : 0;
			if (last && p - end <= gap && (p - last->start) / GPUOS_TOUCH_PAGE < UINT32_MAX) {
				last->pages = (uint32_t)((p - last->start) / GPUOS_TOUCH_PAGE + 1);
				last->access |= g_touch.v[i].access;
			} else {
				g_runs[nrun].start = p;
				g_runs[nrun].pages = 1;
				g_runs[nrun].access = g_touch.v[i].access;
				nrun++;
			}
		}
		if (nrun <= GPUOS_MAX_TOUCHED_RUNS)
			break;
		gap = gap ? gap * 2 : GPUOS_TOUCH_PAGE;
	}
	struct gpuos_rec_touched rec;
	memset(&rec, 0, sizeof rec);
	rec.seq = op->seq;
	rec.faults = faults;
	rec.gap = gap;
	rec.func_id = op->func_id;
	rec.nrun = (uint32_t)nrun;
	gpuos_ring_emit(GPUOS_REC_TOUCHED, flags, &rec, sizeof rec, g_runs, nrun * sizeof *g_runs);
}

/* After the launch (finished): its faulted pages, as a TOUCHED record and as the chunks
 * of the snapshot the accounting compares with the prediction (g_changed). */
static int touched_after(struct gpuos_val_op *op, struct vctx *vc, size_t nseg, size_t *nchanged)
{
	*nchanged = 0;
	uint16_t flags = 0;
	g_touch.n = 0;
	int64_t faults = gpuos_touched_drain(&g_touch, &flags);
	if (faults < 0)
		return GPUOS_VAL_SKIP_NOMEM;
	size_t nalive, n = 0;
	int why = mark_alive(op, vc, nseg, &nalive);
	if (why)
		return why;
	qsort(g_touch.v, g_touch.n, sizeof *g_touch.v, cmp_page);
	for (size_t i = 0; i < g_touch.n; i++) {
		if (n && g_touch.v[n - 1].page == g_touch.v[i].page)
			g_touch.v[n - 1].access |= g_touch.v[i].access;
		else
			g_touch.v[n++] = g_touch.v[i];
	}
	emit_touched(op, n, (uint64_t)faults, flags);
	/* a page may straddle two chunks of an allocation that does not start on a page */
	if (GROW(g_changed, g_changed_cap, 2 * n + 1))
		return GPUOS_VAL_SKIP_NOMEM;
	for (size_t i = 0; i < n; i++) {
		uint64_t p = g_touch.v[i].page, pe = p + GPUOS_TOUCH_PAGE;
		size_t si = seg_lower(nseg, p);
		if (si >= nseg || g_snap[si].base >= pe)
			continue; /* not a measured allocation */
		uint64_t base = g_snap[si].base, end = base + g_snap[si].size;
		uint64_t first = (p > base ? p - base : 0) / CHUNK, last = ((pe < end ? pe : end) - 1 - base) / CHUNK;
		for (uint64_t c = first; c <= last; c++)
			g_changed[(*nchanged)++] = g_fseg[si].first_chunk + c;
	}
	return 0;
}

/* ---- before -------------------------------------------------------------------- */

static int before_in_ctx(struct gpuos_val_op *op, CUcontext ctx)
{
	CUresult r;
	CUstreamCaptureStatus cs;

	if (gpuos_drv.stream_is_capturing) {
		cs = CU_STREAM_CAPTURE_STATUS_NONE;
		r = gpuos_drv.stream_is_capturing(op->stream, &cs);
		if (is_capture_error(r) || (r == CUDA_SUCCESS && cs != CU_STREAM_CAPTURE_STATUS_NONE))
			return GPUOS_VAL_SKIP_CAPTURE;
		if (r != CUDA_SUCCESS) {
			dbg("seq %llu: cuStreamIsCapturing: %s (%d)",
			    (unsigned long long)op->seq, errname(r), (int)r);
			return GPUOS_VAL_SKIP_ERROR;
		}
	}
	if (capture_in_progress())
		return GPUOS_VAL_SKIP_CAPTURE;

	struct vctx *vc = vctx_get(ctx);
	if (!vc)
		return GPUOS_VAL_SKIP_OTHER_CTX;
	if (vc->broken)
		return GPUOS_VAL_SKIP_ERROR;

	r = gpuos_drv.ctx_sync();
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: cuCtxSynchronize before: %s (%d)",
		    (unsigned long long)op->seq, errname(r), (int)r);
		return is_capture_error(r) ? GPUOS_VAL_SKIP_CAPTURE : GPUOS_VAL_SKIP_ERROR;
	}
	if (gpuos_validating == GPUOS_VALIDATE_TOUCHED)
		return touched_before(op, ctx, vc);

	r = vctx_init(vc);
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: setup: %s (%d)", (unsigned long long)op->seq, errname(r), (int)r);
		return reason_of(r);
	}

	size_t nseg;
	uint64_t nchunks;
	int why_not = snapshot_chunks(ctx, &nseg, &nchunks);
	if (why_not)
		return why_not;

	r = vctx_reserve(vc, nchunks, nseg);
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: no room for %llu chunk hashes: %s (%d)",
		    (unsigned long long)op->seq, (unsigned long long)nchunks, errname(r), (int)r);
		return reason_of(r);
	}
	r = hash_into(vc, g_fseg, nseg, vc->d_before, nchunks);
	if (r == CUDA_SUCCESS)
		r = gpuos_drv.stream_sync(vc->stream);
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: hashing before: %s (%d)", (unsigned long long)op->seq,
		    errname(r), (int)r);
		return reason_of(r);
	}

	g_op.vc = vc;
	g_op.nseg = nseg;
	g_op.nchunks = nchunks;
	op->state = &g_op;
	return GPUOS_VAL_SKIP_NONE;
}

/* Tests only: hold validation this long in every operation, as one whose kernel waits
 * for another thread would (GPUOS_TEST_VAL_HOLD_MS). */
static void test_hold(void)
{
	static long ms = -1;
	if (ms < 0) {
		const char *e = getenv("GPUOS_TEST_VAL_HOLD_MS");
		ms = e && *e ? strtol(e, NULL, 10) : 0;
	}
	if (ms > 0) {
		struct timespec t = { ms / 1000, (ms % 1000) * 1000000L };
		nanosleep(&t, NULL);
	}
}

void gpuos_val_before(struct gpuos_val_op *op)
{
	op->skip_reason = GPUOS_VAL_SKIP_NONE;
	op->state = NULL;
	g_overlaps_before = __atomic_load_n(&gpuos_val_overlaps, __ATOMIC_ACQUIRE);
	test_hold();
	if (!resolve()) {
		op->skip_reason = GPUOS_VAL_SKIP_ERROR;
		return;
	}
	struct scope sc;
	CUresult r;
	CUcontext ctx = scope_enter(&sc, op->ctx, &r);
	if (!ctx) {
		dbg("seq %llu: no context: %s (%d)", (unsigned long long)op->seq, errname(r), (int)r);
		op->skip_reason = GPUOS_VAL_SKIP_ERROR;
	} else {
		op->skip_reason = before_in_ctx(op, ctx);
	}
	if (op->skip_reason)
		op->state = NULL;
	scope_leave(&sc);
}

/* ---- after --------------------------------------------------------------------- */

static void emit_skipped(const struct gpuos_val_op *op, int reason)
{
	struct gpuos_rec_validate rec;
	memset(&rec, 0, sizeof rec);
	rec.seq = op->seq;
	rec.func_id = op->func_id;
	rec.op_type = op->op_type;
	rec.skip_reason = (uint32_t)reason;
	gpuos_ring_emit(GPUOS_REC_VALIDATE, GPUOS_VAL_SKIPPED, &rec, sizeof rec, NULL, 0);
	gpuos_ring_count(offsetof(struct gpuos_ring_hdr, n_validate_skipped), 1);
}

/* Index of the first segment of g_snap[0..n) whose end is above `addr`
 * (segments are sorted and disjoint, so ends are sorted too). */
static size_t seg_lower(size_t n, uint64_t addr)
{
	size_t lo = 0, hi = n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (g_snap[mid].base + g_snap[mid].size <= addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int pred_add(uint64_t start, uint64_t end)
{
	if (end <= start)
		return 0;
	if (GROW(g_pred, g_pred_cap, g_npred + 1))
		return ENOMEM;
	g_pred[g_npred].start = start;
	g_pred[g_npred].end = end;
	g_npred++;
	return 0;
}

/* The predicted ranges, clipped to the alive segments, sorted and merged; returns 0
 * or ENOMEM.  *predicted gets their total. */
static int build_predictions(const struct gpuos_val_op *op, size_t nseg, uint64_t *predicted)
{
	g_npred = 0;
	if (op->touch_all) {
		for (size_t i = 0; i < nseg; i++)
			if (g_alive[i] && pred_add(g_snap[i].base, g_snap[i].base + g_snap[i].size))
				return ENOMEM;
	} else {
		for (uint32_t b = 0; b < op->nbuf; b++) {
			const struct gpuos_rec_buf *buf = &op->bufs[b];
			if (buf->flags & (GPUOS_BUF_HOST | GPUOS_BUF_MANAGED))
				continue; /* not fingerprinted */
			if ((buf->flags & (GPUOS_BUF_READ | GPUOS_BUF_WRITE)) == GPUOS_BUF_READ)
				continue; /* a copy's source: known not to be written */
			uint64_t s, e;
			int exact = (buf->flags & GPUOS_BUF_EXACT) != 0;
			if (exact) {
				s = buf->ptr;
				e = buf->ptr + buf->len;
			} else if (buf->size) {
				s = buf->base;
				e = buf->base + buf->size;
			} else {
				s = buf->ptr;
				e = buf->ptr + 1;
			}
			if (e < s) /* wrapped */
				e = UINT64_MAX;
			for (size_t i = seg_lower(nseg, s); i < nseg && g_snap[i].base < e; i++) {
				if (!g_alive[i])
					continue;
				uint64_t ss = g_snap[i].base, se = ss + g_snap[i].size;
				if (exact) {
					/* the exact range, clipped to the allocation */
					if (pred_add(s > ss ? s : ss, e < se ? e : se))
						return ENOMEM;
				} else if (pred_add(ss, se)) { /* the whole allocation */
					return ENOMEM;
				}
			}
		}
	}
	qsort(g_pred, g_npred, sizeof *g_pred, cmp_u64);
	size_t m = 0;
	uint64_t total = 0;
	for (size_t i = 0; i < g_npred; i++) {
		if (m && g_pred[i].start <= g_pred[m - 1].end) {
			if (g_pred[i].end > g_pred[m - 1].end)
				g_pred[m - 1].end = g_pred[i].end;
		} else {
			g_pred[m++] = g_pred[i];
		}
	}
	g_npred = m;
	for (size_t i = 0; i < m; i++)
		total += g_pred[i].end - g_pred[i].start;
	*predicted = total;
	return 0;
}

/* Allocations that went away while the operation ran (another thread's free, a graph's
 * free node) must not be read again: g_alive marks the survivors, g_fseg2[0..*nalive)
 * lists them at their original chunk indices; their chunks are ignored below.  New
 * allocations have no "before" and are not looked at.  Returns a skip reason or 0. */
static int mark_alive(const struct gpuos_val_op *op, struct vctx *vc, size_t nseg, size_t *nalive)
{
	size_t n2 = take_snapshot(op->ctx ? op->ctx : vc->ctx, &g_snap2, &g_snap2_cap);
	if (n2 == (size_t)-1 || GROW(g_alive, g_alive_cap, nseg) || GROW(g_fseg2, g_fseg2_cap, nseg))
		return GPUOS_VAL_SKIP_NOMEM;
	*nalive = 0;
	for (size_t i = 0, j = 0; i < nseg; i++) {
		while (j < n2 && g_snap2[j].base < g_snap[i].base)
			j++;
		g_alive[i] = j < n2 && g_snap2[j].base == g_snap[i].base &&
			     g_snap2[j].size == g_snap[i].size;
		if (g_alive[i])
			g_fseg2[(*nalive)++] = g_fseg[i];
	}
	return 0;
}

/* Hash again, diff, fetch the changed chunk indices into g_changed.  Returns a skip
 * reason or 0 with *nchanged set. */
static int diff_after(struct gpuos_val_op *op, struct vctx *vc, size_t nseg,
		      uint64_t nchunks, size_t *nchanged)
{
	CUresult r;
	*nchanged = 0;
	size_t nalive;
	int why = mark_alive(op, vc, nseg, &nalive);
	if (why || nchunks == 0)
		return why;
	/* hash the survivors only (the kernel skips the gaps) */
	r = hash_into(vc, g_fseg2, nalive, vc->d_after, nchunks);
	static const unsigned int zero;
	if (r == CUDA_SUCCESS)
		r = gpuos_drv.memcpy_htod_async(vc->d_count, &zero, sizeof zero, vc->stream);
	if (r == CUDA_SUCCESS) {
		CUdeviceptr before = vc->d_before, after = vc->d_after;
		CUdeviceptr changed = vc->d_changed, count = vc->d_count;
		unsigned long long nch = nchunks;
		void *args[] = { &before, &after, &nch, &changed, &count };
		r = gpuos_drv.launch_kernel(vc->f_diff, gpuos_fp_grid(nchunks, GPUOS_FP_BLOCK), 1, 1, GPUOS_FP_BLOCK, 1, 1,
			     0, vc->stream, args, NULL);
	}
	unsigned int count = 0;
	if (r == CUDA_SUCCESS)
		r = gpuos_drv.memcpy_dtoh_async(&count, vc->d_count, sizeof count, vc->stream);
	if (r == CUDA_SUCCESS)
		r = gpuos_drv.stream_sync(vc->stream);
	if (r == CUDA_SUCCESS && count) {
		if (count > nchunks)
			count = (unsigned int)nchunks; /* cannot happen */
		if (GROW(g_changed, g_changed_cap, count))
			return GPUOS_VAL_SKIP_NOMEM;
		r = gpuos_drv.memcpy_dtoh_async(g_changed, vc->d_changed, (size_t)count * 8, vc->stream);
		if (r == CUDA_SUCCESS)
			r = gpuos_drv.stream_sync(vc->stream);
	}
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: hashing after: %s (%d)", (unsigned long long)op->seq,
		    errname(r), (int)r);
		return reason_of(r);
	}
	*nchanged = count;
	return 0;
}

static int after_in_ctx(struct gpuos_val_op *op, struct val_state *st)
{
	struct vctx *vc = st->vc;
	const size_t nseg = st->nseg;
	/* A capture may have begun in another thread since before(). */
	if (capture_in_progress())
		return GPUOS_VAL_SKIP_CAPTURE;
	CUresult r = gpuos_drv.ctx_sync(); /* waits for the operation */
	if (r != CUDA_SUCCESS) {
		dbg("seq %llu: cuCtxSynchronize after: %s (%d)", (unsigned long long)op->seq,
		    errname(r), (int)r);
		return is_capture_error(r) ? GPUOS_VAL_SKIP_CAPTURE : GPUOS_VAL_SKIP_ERROR;
	}
	size_t nchanged = 0;
	int why = gpuos_validating == GPUOS_VALIDATE_TOUCHED ? touched_after(op, vc, nseg, &nchanged) :
							       diff_after(op, vc, nseg, st->nchunks, &nchanged);
	if (why)
		return why;

	uint64_t tracked = 0;
	for (size_t i = 0; i < nseg; i++)
		if (g_alive[i])
			tracked += g_snap[i].size;
	uint64_t predicted = 0;
	if (build_predictions(op, nseg, &predicted))
		return GPUOS_VAL_SKIP_NOMEM;

	qsort(g_changed, nchanged, sizeof *g_changed, cmp_u64);

	struct gpuos_rec_miss miss[MAX_MISS];
	uint32_t nmiss = 0;
	int open = 0;               /* miss[nmiss - 1] may be extended */
	uint64_t last_missed = 0;
	size_t last_miss_seg = 0;
	uint64_t changed_bytes = 0, missed = 0, pred_in_changed = 0;
	size_t si = 0, pj = 0;
	for (size_t k = 0; k < nchanged; k++) {
		uint64_t c = g_changed[k];
		if (k && c == g_changed[k - 1])
			continue;
		while (si + 1 < nseg && g_fseg[si + 1].first_chunk <= c)
			si++;
		if (si >= nseg || c < g_fseg[si].first_chunk || !g_alive[si])
			continue;
		uint64_t off = (c - g_fseg[si].first_chunk) * CHUNK;
		if (off >= g_fseg[si].size)
			continue;
		uint64_t a = g_fseg[si].base + off;
		uint64_t len = g_fseg[si].size - off < CHUNK ? g_fseg[si].size - off : CHUNK;
		uint64_t e = a + len;
		changed_bytes += len;

		uint64_t inter = 0;
		while (pj < g_npred && g_pred[pj].end <= a)
			pj++;
		for (size_t q = pj; q < g_npred && g_pred[q].start < e; q++) {
			uint64_t s0 = g_pred[q].start > a ? g_pred[q].start : a;
			uint64_t e0 = g_pred[q].end < e ? g_pred[q].end : e;
			if (e0 > s0)
				inter += e0 - s0;
		}
		if (inter) {
			pred_in_changed += inter;
			continue;
		}
		missed += len;
		if (open && last_miss_seg == si && c == last_missed + 1) {
			miss[nmiss - 1].len = e - miss[nmiss - 1].first;
		} else if (nmiss < MAX_MISS) {
			miss[nmiss].base = g_fseg[si].base;
			miss[nmiss].size = g_fseg[si].size;
			miss[nmiss].first = a;
			miss[nmiss].len = len;
			nmiss++;
			open = 1;
		} else {
			open = 0;
		}
		last_missed = c;
		last_miss_seg = si;
	}

	struct gpuos_rec_validate rec;
	memset(&rec, 0, sizeof rec);
	rec.seq = op->seq;
	rec.changed_bytes = changed_bytes;
	rec.predicted_bytes = predicted;
	rec.overpredicted_bytes = predicted - pred_in_changed;
	rec.missed_bytes = missed;
	rec.tracked_bytes = tracked;
	rec.func_id = op->func_id;
	rec.nmiss = nmiss;
	rec.skip_reason = GPUOS_VAL_SKIP_NONE;
	rec.op_type = op->op_type;
	gpuos_ring_emit(GPUOS_REC_VALIDATE, 0, &rec, sizeof rec, miss, nmiss * sizeof *miss);
	gpuos_ring_count(offsetof(struct gpuos_ring_hdr, n_validated), 1);
	if (missed)
		gpuos_ring_count(offsetof(struct gpuos_ring_hdr, n_misses), 1);
	if (missed)
		dbg("seq %llu: %llu bytes changed outside the prediction (%u ranges)",
		    (unsigned long long)op->seq, (unsigned long long)missed, nmiss);
	return 0;
}

void gpuos_val_after(struct gpuos_val_op *op, CUresult res)
{
	struct val_state *st = op->state;
	op->state = NULL;
	if (res != CUDA_SUCCESS) {
		emit_skipped(op, GPUOS_VAL_SKIP_ERROR);
		return;
	}
	if (op->skip_reason || st != &g_op || !st->vc) {
		emit_skipped(op, op->skip_reason ? op->skip_reason : GPUOS_VAL_SKIP_ERROR);
		return;
	}
	if (__atomic_load_n(&gpuos_val_busy, __ATOMIC_ACQUIRE) ||
	    __atomic_load_n(&gpuos_val_overlaps, __ATOMIC_ACQUIRE) != g_overlaps_before) {
		st->vc = NULL;
		emit_skipped(op, GPUOS_VAL_SKIP_BUSY);
		return;
	}
	struct scope sc;
	CUresult r;
	int why;
	CUcontext ctx = scope_enter(&sc, op->ctx ? op->ctx : st->vc->ctx, &r);
	if (!ctx) {
		dbg("seq %llu: no context after: %s (%d)", (unsigned long long)op->seq,
		    errname(r), (int)r);
		why = GPUOS_VAL_SKIP_ERROR;
	} else {
		why = after_in_ctx(op, st);
	}
	scope_leave(&sc);
	st->vc = NULL;
	if (why) {
		op->skip_reason = why;
		emit_skipped(op, why);
	}
}
