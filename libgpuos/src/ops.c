/* SPDX-License-Identifier: MIT */
/*
 * ops.c - the operations that change device memory: kernel launches, copies, memsets
 * and stream memory writes.
 *
 * Without validation a handler hands the operation to the recording thread (defer.c):
 * it copies what the record needs into its thread's queue, makes the real call and
 * commits the entry if the call succeeded; gpuos_play_* make the records.  Otherwise
 * (validation, or no room in the queue) it records inline: begin (predict: scan the
 * parameters or compute the exact ranges; with validation on, take gpuos_val_lock and
 * call gpuos_val_before), the real call, end (on success write the record;
 * gpuos_val_after; unlock).  Nothing here changes an argument or a result, and a
 * wrapper that cannot track just calls through.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

gpuos_alone_u64_t gpuos_seq;

uint64_t gpuos_current_ctx(void)
{
	CUcontext c = NULL;
	if (gpuos_drv.ctx_get_current)
		gpuos_drv.ctx_get_current(&c);
	return (uint64_t)(uintptr_t)c;
}

int gpuos_captures_in_progress(void)
{
	return __atomic_load_n(&gpuos_hot.capturing, __ATOMIC_ACQUIRE);
}

int gpuos_stream_captured_ask(uint64_t stream)
{
	if (!gpuos_drv.stream_is_capturing)
		return 0;
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	if (gpuos_drv.stream_is_capturing((CUstream)(uintptr_t)stream, &st) != CUDA_SUCCESS)
		return 0;
	return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* Validation holds gpuos_val_lock from before the operation to after it has finished
 * on the GPU. An operation may wait for another thread's (a kernel spinning on a flag
 * that thread's copy sets): that thread must not wait for the lock for ever. It waits
 * GPUOS_VAL_WAIT_MS (default 1000), then runs its operation unvalidated (skipped: busy). */
static long val_wait_ms(void)
{
	static long ms = -1; /* racing first callers store the same value */
	long v = __atomic_load_n(&ms, __ATOMIC_RELAXED);
	if (v < 0) {
		const char *e = getenv("GPUOS_VAL_WAIT_MS");
		v = e && *e ? strtol(e, NULL, 10) : 1000;
		v = v > 0 ? v : 1000;
		__atomic_store_n(&ms, v, __ATOMIC_RELAXED);
	}
	return v;
}

void gpuos_val_begin(struct gpuos_val_op *op)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	long ms = val_wait_ms();
	until.tv_sec += ms / 1000;
	until.tv_nsec += (ms % 1000) * 1000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	if (pthread_mutex_timedlock(&gpuos_val_lock, &until) != 0) {
		op->skip_reason = GPUOS_VAL_SKIP_BUSY; /* not holding the lock */
		op->state = NULL;
		/* It runs while another is validated: that one's changes are no longer its own. */
		__atomic_add_fetch(&gpuos_val_busy, 1, __ATOMIC_ACQ_REL);
		__atomic_add_fetch(&gpuos_val_overlaps, 1, __ATOMIC_ACQ_REL);
		return;
	}
	gpuos_val_before(op);
}

CUresult gpuos_val_end(struct gpuos_val_op *op, CUresult res)
{
	if (op->skip_reason == GPUOS_VAL_SKIP_BUSY) {
		__atomic_add_fetch(&gpuos_val_overlaps, 1, __ATOMIC_ACQ_REL);
		__atomic_sub_fetch(&gpuos_val_busy, 1, __ATOMIC_ACQ_REL);
		gpuos_val_after(op, res); /* records it skipped; touches no shared state */
		return res;
	}
	gpuos_val_after(op, res);
	pthread_mutex_unlock(&gpuos_val_lock);
	return res;
}

void gpuos_exact_buf(struct gpuos_rec_buf *b, const struct gpuos_alloc *a, uint64_t ptr, uint64_t len,
		     uint16_t flags)
{
	b->base = a ? a->base : ptr;
	b->size = a ? a->end - a->base : len;
	b->ptr = ptr;
	b->len = len;
	b->param = 0xffff;
	b->flags = flags | GPUOS_BUF_EXACT | (a ? gpuos_buf_flags(a) : 0);
	b->offset = 0;
}

/* ---- kernel launches ---------------------------------------------------------------------- */

struct launch {
	struct gpuos_rec_launch rec;
	uint16_t flags;
	int validating;
	struct gpuos_scan *s;
	struct gpuos_val_op op;
};

static void launch_init(struct launch *L, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
			unsigned bz, unsigned shmem, uint64_t stream, uint16_t flags)
{
	memset(&L->rec, 0, sizeof L->rec);
	L->rec.grid[0] = gx;
	L->rec.grid[1] = gy;
	L->rec.grid[2] = gz;
	L->rec.block[0] = bx;
	L->rec.block[1] = by;
	L->rec.block[2] = bz;
	L->rec.shmem = shmem;
	L->rec.stream = stream;
	L->flags = flags;
}

/* 0: cannot track this launch (out of memory), call through.  launch_prepare ran first. */
static int launch_begin(struct launch *L, CUfunction f, void **kp, void **extra)
{
	/* An application runs microseconds of its own code between two launches and evicts
	 * what a launch touches: ask for all of it at once, so that the misses overlap. */
	__builtin_prefetch(&gpuos_lock.v, 1, 3);
	__builtin_prefetch(&gpuos_allocs, 0, 3);
	__builtin_prefetch(&gpuos_seq.v, 1, 3);
	gpuos_ring_prefetch_hdr();
	struct gpuos_scan *s = gpuos_scan_tls();
	if (!s)
		return 0;
	uint64_t h = (uint64_t)(uintptr_t)f;
	pthread_rwlock_rdlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, h);
	if (unlikely(!o && f)) { /* first seen here (cuModuleEnumerateFunctions, ...) */
		pthread_rwlock_unlock(&gpuos_lock.v);
		gpuos_fn_ensure(h, GPUOS_HINT_UNKNOWN, 0);
		pthread_rwlock_rdlock(&gpuos_lock.v);
		o = gpuos_obj_get(GPUOS_O_FN, h);
	}
	const struct gpuos_fn *fn = o ? o->ptr : NULL;
	if (fn) {
		__builtin_prefetch(fn, 0, 3);
		__builtin_prefetch((const char *)fn + 64, 0, 3);
	}
	uint64_t t_scan = ST_NOW();
	gpuos_scan_launch(s, fn, kp, extra);
	ST_ADD(SCAN, ST_NOW() - t_scan);
	L->rec.func_id = fn ? fn->func_id : GPUOS_NO_FUNC;
	L->rec.seq = gpuos_next_seq();
	if (unlikely(fn && (fn->flags & GPUOS_FN_DUMP)))
		gpuos_scan_dump(fn, kp, extra, L->rec.seq);
	pthread_rwlock_unlock(&gpuos_lock.v);

	L->s = s;
	L->rec.ctx = gpuos_current_ctx();
	L->rec.arg_hash = s->hash;
	L->rec.nbuf = s->nbuf;
	L->flags |= s->lflags;
	gpuos_ring_prefetch_slots(); /* the record is written after the real call */
	L->validating = gpuos_validating;
	if (L->validating) {
		memset(&L->op, 0, sizeof L->op);
		L->op.op_type = GPUOS_REC_LAUNCH;
		L->op.seq = L->rec.seq;
		L->op.func_id = L->rec.func_id;
		L->op.ctx = (CUcontext)(uintptr_t)L->rec.ctx;
		L->op.stream = (CUstream)(uintptr_t)L->rec.stream;
		L->op.touch_all = !!(L->flags & (GPUOS_LAUNCH_LAYOUT_UNKNOWN | GPUOS_LAUNCH_TOUCH_ALL |
						 GPUOS_LAUNCH_TRUNCATED));
		L->op.bufs = s->bufs;
		L->op.nbuf = s->nbuf;
		gpuos_val_begin(&L->op);
	}
	return 1;
}

/* The LAUNCH record of a launch and the scan's buffers. */
static void launch_record(struct gpuos_rec_launch *rec, uint16_t flags, const struct gpuos_scan *s)
{
	/* Counters first: a locked add after the record would wait for its stores. */
	GPUOS_COUNT(n_launches, 1);
	if (flags & GPUOS_LAUNCH_LAYOUT_UNKNOWN)
		GPUOS_COUNT(n_unknown_layout, 1);
	uint64_t t_rec = ST_NOW();
	gpuos_ring_emit(GPUOS_REC_LAUNCH, flags, rec, sizeof *rec, s->bufs, rec->nbuf * sizeof *s->bufs);
	ST_ADD(RECORD, ST_NOW() - t_rec);
}

static CUresult launch_end(struct launch *L, CUresult r)
{
	if (r == CUDA_SUCCESS) {
		pthread_rwlock_rdlock(&gpuos_lock.v);
		for (uint32_t i = 0; i < L->s->nbuf; i++)
			gpuos_note_use_locked(L->s->bufs[i].base, L->rec.seq);
		pthread_rwlock_unlock(&gpuos_lock.v);
		launch_record(&L->rec, L->flags, L->s);
	}
	if (L->validating)
		gpuos_val_end(&L->op, r);
	return r;
}

/* A launch in a queue: what its record needs, the parameters copied to their offsets
 * (or the `extra` buffer). */
struct qe_launch {
	struct gpuos_qe h;
	uint64_t func, stream, ctx;
	uint32_t grid[3], block[3];
	uint32_t shmem, nbytes;
	uint32_t from_extra, pad;
	uint8_t image[];
};

#define DEFER_MAX_IMAGE 4096 /* larger parameter buffers are scanned inline */

/* Copy a parameter of size bytes to image + off (within n bytes): most are 4 or 8
 * bytes, copied without a call to memcpy. */
static inline void copy_param(uint8_t *image, size_t n, uint32_t off, uint32_t size, const void *src)
{
	if ((size_t)off + size > n) /* params_bytes bounds them all */
		return;
	uint8_t *dst = image + off;
	if (size == 8)
		__builtin_memcpy(dst, src, 8);
	else if (size == 4)
		__builtin_memcpy(dst, src, 4);
	else
		memcpy(dst, src, size);
}

/* Queue the launch L of fn: the entry to commit, or NULL (nothing reserved). */
static struct gpuos_qe *launch_queue(const struct launch *L, const struct gpuos_fn *fn, uint64_t func,
				     void **kp, void **extra)
{
	const uint8_t *ebuf = NULL;
	size_t n = 0;
	int known = fn->nparams != GPUOS_LAYOUT_UNKNOWN;
	if (fn->flags & GPUOS_FN_DUMP)
		return NULL; /* the dump reads the caller's parameters */
	if (kp)
		n = known ? fn->params_bytes : 0;
	else if (extra && !gpuos_extra_buffer(extra, &ebuf, &n))
		return NULL;
	if (n > DEFER_MAX_IMAGE)
		return NULL;
	struct gpuos_qe *e = gpuos_defer_reserve(sizeof(struct qe_launch) + n, GPUOS_QE_LAUNCH, L->flags);
	if (!e)
		return NULL;
	struct qe_launch *q = (struct qe_launch *)e;
	q->func = func;
	q->stream = L->rec.stream;
	q->ctx = gpuos_current_ctx();
	memcpy(q->grid, L->rec.grid, sizeof q->grid);
	memcpy(q->block, L->rec.block, sizeof q->block);
	q->shmem = L->rec.shmem;
	q->nbytes = (uint32_t)n;
	q->from_extra = ebuf != NULL;
	if (ebuf) {
		memcpy(q->image, ebuf, n);
		return e;
	}
	for (uint16_t i = 0; kp && known && i < fn->nparams; i++) {
		if (unlikely(!kp[i])) { /* the inline scan says what it makes of it */
			gpuos_defer_commit(0);
			return NULL;
		}
		copy_param(q->image, n, fn->p[i].off, fn->p[i].size, kp[i]);
	}
	return e;
}

/* Before the real call of a launch that may be queued: its function entry (NULL: record
 * it inline), and the lines the queueing will touch requested from memory, so that
 * their misses overlap the driver's microseconds instead of following them. */
static const struct gpuos_fn *launch_prepare(struct launch *L, CUfunction f)
{
	if (gpuos_stream_captured(L->rec.stream)) /* for the inline path too */
		L->flags |= GPUOS_LAUNCH_CAPTURED;
	const struct gpuos_fn *fn = gpuos_defer_fn((uint64_t)(uintptr_t)f);
	if (fn)
		for (int i = 0; i < 4; i++) /* the layout of 30 parameters */
			__builtin_prefetch((const char *)fn + 64 * i, 0, 3);
	return fn;
}

/* After a successful real call: queue launch L of fn (its parameters are still the
 * caller's), or record it inline (this thread's queue first, to keep its order). */
static void launch_queued(struct launch *L, const struct gpuos_fn *fn, CUfunction f, void **kp, void **extra)
{
	struct gpuos_qe *e = launch_queue(L, fn, (uint64_t)(uintptr_t)f, kp, extra);
	if (e) {
		gpuos_defer_commit(1);
		ST_ADD(QUEUED, 1);
		return;
	}
	gpuos_defer_drain_self();
	if (launch_begin(L, f, kp, extra))
		launch_end(L, CUDA_SUCCESS);
}

void gpuos_play_launch(const struct gpuos_qe *e)
{
	const struct qe_launch *q = (const struct qe_launch *)e;
	struct gpuos_scan *s = gpuos_scan_tls();
	if (!s)
		return;
	struct gpuos_rec_launch rec = { .stream = q->stream, .ctx = q->ctx, .shmem = q->shmem };
	memcpy(rec.grid, q->grid, sizeof rec.grid);
	memcpy(rec.block, q->block, sizeof rec.block);
	/* Its entry, as it was at the call: changing or removing one drains the queues. */
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, q->func);
	const struct gpuos_fn *fn = o ? o->ptr : NULL;
	uint64_t t_scan = ST_NOW();
	gpuos_scan_image(s, fn, q->image, q->nbytes, (int)q->from_extra);
	ST_ADD(SCAN, ST_NOW() - t_scan);
	rec.func_id = fn ? fn->func_id : GPUOS_NO_FUNC;
	rec.seq = gpuos_next_seq();
	rec.arg_hash = s->hash;
	rec.nbuf = s->nbuf;
	for (uint32_t i = 0; i < s->nbuf; i++) /* the recording thread holds the read lock */
		gpuos_note_use_locked(s->bufs[i].base, rec.seq);
	launch_record(&rec, e->flags | s->lflags, s);
}

/* While filling, a launch that is not recorded (tracking paused): nothing predicts what it
 * touches, so it waits for everything. */
static inline CUresult fill_untracked(void)
{
	if (unlikely(gpuos_fill_checking()))
		return gpuos_fill_wait_all("a launch while tracking is paused");
	return CUDA_SUCCESS;
}

/* A launch's result, its stages timed in a selftime build: t0 the handler's start, t1
 * the real call's, t2 its end. */
static CUresult launch_timed(CUresult r, uint64_t t0, uint64_t t1, uint64_t t2)
{
	ST_ADD(LAUNCHES, 1);
	ST_ADD(BEGIN, t1 - t0);
	ST_ADD(REAL, t2 - t1);
	ST_ADD(END, ST_NOW() - t2);
	return r;
}

/* Launch L (started at t0) around the real call `call`: queued after it, else recorded
 * inline, else (out of memory) only called.  `call` is evaluated once. */
#define LAUNCH_OP(L, t0, f, kp, extra, call)                                   \
	do {                                                                   \
		const struct gpuos_fn *fn_ = launch_prepare(&(L), f);          \
		uint64_t t1_;                                                  \
		CUresult r_;                                                   \
		int filling_ = gpuos_fill_checking();                          \
		if (fn_ && !filling_) {                                        \
			t1_ = ST_NOW();                                        \
			r_ = (call);                                           \
			uint64_t t2_ = ST_NOW();                               \
			if (r_ == CUDA_SUCCESS)                                \
				launch_queued(&(L), fn_, f, kp, extra);        \
			return launch_timed(r_, t0, t1_, t2_);                 \
		}                                                              \
		gpuos_defer_drain_self();                                      \
		if (!launch_begin(&(L), f, kp, extra)) {                       \
			if (filling_ && (r_ = gpuos_fill_wait_all("a launch not tracked")) != CUDA_SUCCESS) \
				return r_;                                     \
			return (call);                                         \
		}                                                              \
		/* predicted before the call: wait for them (make them resident) */ \
		if (filling_ && (r_ = gpuos_fill_wait_bufs((L).s->bufs, (L).s->nbuf, (L).flags)) != CUDA_SUCCESS) \
			return launch_end(&(L), r_);                           \
		t1_ = ST_NOW();                                                \
		r_ = (call);                                                   \
		uint64_t t2_ = ST_NOW();                                       \
		return launch_timed(launch_end(&(L), r_), t0, t1_, t2_);       \
	} while (0)

CUresult gpuos_h_launch_kernel(PFN_cuLaunchKernel_v4000 real, int pt, CUfunction f, unsigned int gx,
			       unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
			       unsigned int shmem, CUstream st, void **kp, void **extra)
{
	struct launch L;
	gpuos_standby_at_launch();
	gpuos_preload_note(f);
	if (!gpuos_recording()) {
		CUresult w = fill_untracked();
		return w != CUDA_SUCCESS ? w : real(f, gx, gy, gz, bx, by, bz, shmem, st, kp, extra);
	}
	uint64_t t0 = ST_NOW();
	launch_init(&L, gx, gy, gz, bx, by, bz, shmem, gpuos_eff_stream(st, pt), 0);
	LAUNCH_OP(L, t0, f, kp, extra, real(f, gx, gy, gz, bx, by, bz, shmem, st, kp, extra));
}

CUresult gpuos_h_launch_kernel_ex(PFN_cuLaunchKernelEx_v11060 real, int pt, const CUlaunchConfig *config,
				  CUfunction f, void **kp, void **extra)
{
	struct launch L;
	gpuos_standby_at_launch();
	gpuos_preload_note(f);
	if (!config || !gpuos_recording()) {
		CUresult w = fill_untracked();
		return w != CUDA_SUCCESS ? w : real(config, f, kp, extra);
	}
	uint16_t flags = GPUOS_LAUNCH_EX;
	for (unsigned i = 0; config->attrs && i < config->numAttrs; i++)
		if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && config->attrs[i].value.cooperative)
			flags |= GPUOS_LAUNCH_COOPERATIVE;
	uint64_t t0 = ST_NOW();
	launch_init(&L, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
		    config->blockDimZ, config->sharedMemBytes, gpuos_eff_stream(config->hStream, pt), flags);
	LAUNCH_OP(L, t0, f, kp, extra, real(config, f, kp, extra));
}

CUresult gpuos_h_launch_cooperative(PFN_cuLaunchCooperativeKernel_v9000 real, int pt, CUfunction f,
				    unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
				    unsigned int by, unsigned int bz, unsigned int shmem, CUstream st, void **kp)
{
	struct launch L;
	gpuos_standby_at_launch();
	gpuos_preload_note(f);
	if (!gpuos_recording()) {
		CUresult w = fill_untracked();
		return w != CUDA_SUCCESS ? w : real(f, gx, gy, gz, bx, by, bz, shmem, st, kp);
	}
	uint64_t t0 = ST_NOW();
	launch_init(&L, gx, gy, gz, bx, by, bz, shmem, gpuos_eff_stream(st, pt), GPUOS_LAUNCH_COOPERATIVE);
	LAUNCH_OP(L, t0, f, kp, NULL, real(f, gx, gy, gz, bx, by, bz, shmem, st, kp));
}

/* ---- copies and memsets ------------------------------------------------------------------------ */

enum side {
	SIDE_NONE,   /* no linear range (a CUDA array, or nothing to copy) */
	SIDE_DEVICE,
	SIDE_HOST,
	SIDE_LOOKUP, /* unified addressing: host or device as the map says */
};

struct copy_desc {
	uint32_t kind;
	uint16_t flags;
	uint8_t dst_side, src_side;
	uint64_t stream, dst, src, dst_len, src_len;
	uint32_t value;
};

struct copy {
	struct gpuos_rec_copy rec;
	uint16_t flags;
	int validating;
	struct gpuos_rec_buf bufs[2];
	struct gpuos_val_op op;
};

static int is_device(const struct gpuos_alloc *a)
{
	return a && !(a->flags & GPUOS_A_HOST);
}

/* Fill rec from d and, with bufs, its exact buffers (lookup: read lock held, the map
 * is asked).  Returns how many buffers. */
static uint32_t describe(const struct copy_desc *d, struct gpuos_rec_copy *rec, struct gpuos_rec_buf *bufs,
			 int lookup)
{
	memset(rec, 0, sizeof *rec);
	rec->stream = d->stream;
	rec->dst = d->dst;
	rec->src = d->src;
	rec->dst_len = d->dst_len;
	rec->src_len = d->src_len;
	rec->kind = d->kind;
	rec->value = d->value;
	int dside = d->dst_len ? d->dst_side : SIDE_NONE, sside = d->src_len ? d->src_side : SIDE_NONE;
	const struct gpuos_alloc *da = NULL, *sa = NULL;
	if (lookup) {
		da = dside ? gpuos_map_find(&gpuos_allocs, d->dst) : NULL;
		sa = sside ? gpuos_map_find(&gpuos_allocs, d->src) : NULL;
	}
	if (d->kind == GPUOS_COPY_UNIFIED && (da || sa)) {
		/* Direction from the map; an address it does not know is pageable host memory. */
		int dd = is_device(da), sd = is_device(sa);
		rec->kind = dd ? (sd ? GPUOS_COPY_DTOD : GPUOS_COPY_HTOD) : (sd ? GPUOS_COPY_DTOH : GPUOS_COPY_HTOH);
	}
	if (dside == SIDE_LOOKUP)
		dside = da && !is_device(da) ? SIDE_HOST : SIDE_DEVICE;
	if (sside == SIDE_LOOKUP)
		sside = sa && !is_device(sa) ? SIDE_HOST : SIDE_DEVICE;
	uint32_t nbuf = 0;
	if (bufs && dside)
		gpuos_exact_buf(&bufs[nbuf++], da, d->dst, d->dst_len,
				GPUOS_BUF_WRITE | (dside == SIDE_HOST ? GPUOS_BUF_HOST : 0));
	if (bufs && sside)
		gpuos_exact_buf(&bufs[nbuf++], sa, d->src, d->src_len,
				GPUOS_BUF_READ | (sside == SIDE_HOST ? GPUOS_BUF_HOST : 0));
	return nbuf;
}

/* A copy or memset in a queue. */
struct qe_copy {
	struct gpuos_qe h;
	struct copy_desc d;
};

/* Hand copy d to the recording thread: the entry to commit, or NULL (record inline;
 * this thread's queue is recorded first). */
static struct gpuos_qe *copy_defer(const struct copy_desc *d)
{
	uint16_t flags = d->flags | (gpuos_stream_captured(d->stream) ? GPUOS_COPY_CAPTURED : 0);
	struct gpuos_qe *e = gpuos_defer_reserve(sizeof(struct qe_copy), GPUOS_QE_COPY, flags);
	if (!e) {
		gpuos_defer_drain_self();
		return NULL;
	}
	((struct qe_copy *)e)->d = *d;
	return e;
}

void gpuos_play_copy(const struct gpuos_qe *e)
{
	const struct copy_desc *d = &((const struct qe_copy *)e)->d;
	struct gpuos_rec_copy rec;
	describe(d, &rec, NULL, d->kind == GPUOS_COPY_UNIFIED); /* the map decides its direction */
	rec.seq = gpuos_next_seq();
	gpuos_note_use_locked(d->dst, rec.seq); /* the recording thread holds the read lock */
	gpuos_note_use_locked(d->src, rec.seq);
	gpuos_ring_emit(GPUOS_REC_COPY, e->flags, &rec, sizeof rec, NULL, 0);
	GPUOS_COUNT(n_copies, 1);
}

static void copy_begin(struct copy *c, const struct copy_desc *d)
{
	c->flags = d->flags;
	c->validating = gpuos_validating;
	/* The map decides a unified copy's direction and, for validation, the buffers. */
	int lookup = c->validating || d->kind == GPUOS_COPY_UNIFIED;
	if (lookup)
		pthread_rwlock_rdlock(&gpuos_lock.v);
	uint32_t nbuf = describe(d, &c->rec, c->validating ? c->bufs : NULL, lookup);
	if (lookup)
		pthread_rwlock_unlock(&gpuos_lock.v);
	c->rec.seq = gpuos_next_seq();
	if (gpuos_stream_captured(d->stream))
		c->flags |= GPUOS_COPY_CAPTURED;
	if (c->validating) {
		memset(&c->op, 0, sizeof c->op);
		c->op.op_type = GPUOS_REC_COPY;
		c->op.seq = c->rec.seq;
		c->op.func_id = GPUOS_NO_FUNC;
		c->op.ctx = (CUcontext)(uintptr_t)gpuos_current_ctx();
		c->op.stream = (CUstream)(uintptr_t)d->stream;
		c->op.bufs = c->bufs;
		c->op.nbuf = nbuf;
		gpuos_val_begin(&c->op);
	}
}

static CUresult copy_end(struct copy *c, CUresult r)
{
	if (r == CUDA_SUCCESS) {
		pthread_rwlock_rdlock(&gpuos_lock.v);
		gpuos_note_use_locked(c->rec.dst, c->rec.seq);
		gpuos_note_use_locked(c->rec.src, c->rec.seq);
		pthread_rwlock_unlock(&gpuos_lock.v);
		gpuos_ring_emit(GPUOS_REC_COPY, c->flags, &c->rec, sizeof c->rec, NULL, 0);
		GPUOS_COUNT(n_copies, 1);
	}
	if (c->validating)
		gpuos_val_end(&c->op, r);
	return r;
}

/* While filling (or under --gpu-memory): wait for the movable allocations a copy or
 * memset touches, or make them resident (an address on either side may be one; a CUDA
 * array is not). */
static CUresult fill_wait_copy(const struct copy_desc *d)
{
	uint64_t p[2];
	size_t n = 0;
	if (d->dst_side != SIDE_NONE && d->dst_side != SIDE_HOST)
		p[n++] = d->dst;
	if (d->src_side != SIDE_NONE && d->src_side != SIDE_HOST)
		p[n++] = d->src;
	return gpuos_fill_wait_ptrs(p, n);
}

/* Around the real call `call`: queued, else recorded inline, else only called.  `call`
 * is evaluated once. */
#define COPY_OP(desc, call)                                              \
	do {                                                             \
		struct copy c_;                                          \
		struct gpuos_qe *e_;                                     \
		if (unlikely(gpuos_fill_checking())) {                   \
			struct copy_desc f_ = (desc);                    \
			CUresult w_ = fill_wait_copy(&f_);               \
			if (w_ != CUDA_SUCCESS)                          \
				return w_;                               \
		}                                                        \
		if (!gpuos_recording())                                  \
			return (call);                                   \
		struct copy_desc d_ = (desc);                            \
		if ((e_ = copy_defer(&d_)) != NULL) {                    \
			CUresult r_ = (call);                            \
			gpuos_defer_commit(r_ == CUDA_SUCCESS);          \
			return r_;                                       \
		}                                                        \
		copy_begin(&c_, &d_);                                    \
		return copy_end(&c_, (call));                            \
	} while (0)

static struct copy_desc linear(uint32_t kind, uint16_t flags, uint64_t stream, uint64_t dst, uint8_t dside,
			       uint64_t src, uint8_t sside, uint64_t len)
{
	return (struct copy_desc){ .kind = kind, .flags = flags, .stream = stream, .dst = dst, .dst_side = dside,
				   .src = src, .src_side = sside, .dst_len = len, .src_len = len };
}

/* A memset of height rows of width elements (elem bytes each), pitch bytes apart. */
static struct copy_desc set(uint64_t dst, size_t pitch, size_t elem, size_t width, size_t height, uint32_t value,
			    uint64_t stream, uint16_t flags)
{
	return (struct copy_desc){ .kind = GPUOS_COPY_MEMSET, .flags = flags, .stream = stream, .dst = dst,
				   .dst_side = SIDE_LOOKUP, .value = value,
				   .dst_len = width && height ? (height - 1) * pitch + width * elem : 0 };
}

#define H(p) ((uint64_t)(uintptr_t)(p))
#define SYNC(pt) gpuos_eff_stream(NULL, pt)
#define ASYNC GPUOS_COPY_ASYNC

CUresult gpuos_h_memcpy(PFN_cuMemcpy_v4000 real, int pt, CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	COPY_OP(linear(GPUOS_COPY_UNIFIED, 0, SYNC(pt), dst, SIDE_LOOKUP, src, SIDE_LOOKUP, n), real(dst, src, n));
}

CUresult gpuos_h_memcpy_async(PFN_cuMemcpyAsync_v4000 real, int pt, CUdeviceptr dst, CUdeviceptr src, size_t n,
			      CUstream st)
{
	COPY_OP(linear(GPUOS_COPY_UNIFIED, ASYNC, gpuos_eff_stream(st, pt), dst, SIDE_LOOKUP, src, SIDE_LOOKUP, n),
		real(dst, src, n, st));
}

CUresult gpuos_h_memcpy_htod(PFN_cuMemcpyHtoD_v3020 real, int pt, CUdeviceptr dst, const void *src, size_t n)
{
	COPY_OP(linear(GPUOS_COPY_HTOD, 0, SYNC(pt), dst, SIDE_DEVICE, H(src), SIDE_HOST, n), real(dst, src, n));
}

CUresult gpuos_h_memcpy_dtoh(PFN_cuMemcpyDtoH_v3020 real, int pt, void *dst, CUdeviceptr src, size_t n)
{
	COPY_OP(linear(GPUOS_COPY_DTOH, 0, SYNC(pt), H(dst), SIDE_HOST, src, SIDE_DEVICE, n), real(dst, src, n));
}

CUresult gpuos_h_memcpy_dtod(PFN_cuMemcpyDtoD_v3020 real, int pt, CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	COPY_OP(linear(GPUOS_COPY_DTOD, 0, SYNC(pt), dst, SIDE_DEVICE, src, SIDE_DEVICE, n), real(dst, src, n));
}

CUresult gpuos_h_memcpy_htod_async(PFN_cuMemcpyHtoDAsync_v3020 real, int pt, CUdeviceptr dst, const void *src,
				   size_t n, CUstream st)
{
	COPY_OP(linear(GPUOS_COPY_HTOD, ASYNC, gpuos_eff_stream(st, pt), dst, SIDE_DEVICE, H(src), SIDE_HOST, n),
		real(dst, src, n, st));
}

CUresult gpuos_h_memcpy_dtoh_async(PFN_cuMemcpyDtoHAsync_v3020 real, int pt, void *dst, CUdeviceptr src,
				   size_t n, CUstream st)
{
	COPY_OP(linear(GPUOS_COPY_DTOH, ASYNC, gpuos_eff_stream(st, pt), H(dst), SIDE_HOST, src, SIDE_DEVICE, n),
		real(dst, src, n, st));
}

CUresult gpuos_h_memcpy_dtod_async(PFN_cuMemcpyDtoDAsync_v3020 real, int pt, CUdeviceptr dst, CUdeviceptr src,
				   size_t n, CUstream st)
{
	COPY_OP(linear(GPUOS_COPY_DTOD, ASYNC, gpuos_eff_stream(st, pt), dst, SIDE_DEVICE, src, SIDE_DEVICE, n),
		real(dst, src, n, st));
}

CUresult gpuos_h_memcpy_peer(PFN_cuMemcpyPeer_v4000 real, int pt, CUdeviceptr dst, CUcontext dctx,
			     CUdeviceptr src, CUcontext sctx, size_t n)
{
	COPY_OP(linear(GPUOS_COPY_PEER, 0, SYNC(pt), dst, SIDE_DEVICE, src, SIDE_DEVICE, n),
		real(dst, dctx, src, sctx, n));
}

CUresult gpuos_h_memcpy_peer_async(PFN_cuMemcpyPeerAsync_v4000 real, int pt, CUdeviceptr dst, CUcontext dctx,
				   CUdeviceptr src, CUcontext sctx, size_t n, CUstream st)
{
	COPY_OP(linear(GPUOS_COPY_PEER, ASYNC, gpuos_eff_stream(st, pt), dst, SIDE_DEVICE, src, SIDE_DEVICE, n),
		real(dst, dctx, src, sctx, n, st));
}

/* One side of a 2D/3D copy: its first byte and the bytes up to its last. */
static void side_span(CUmemorytype type, const void *host, CUdeviceptr dev, size_t x, size_t y, size_t z,
		      size_t pitch, size_t height, size_t w, size_t h, size_t d, uint64_t *addr, uint64_t *len,
		      uint8_t *side)
{
	*addr = *len = 0;
	*side = SIDE_NONE;
	if (type == CU_MEMORYTYPE_ARRAY || !w || !h || !d)
		return;
	uint64_t base = type == CU_MEMORYTYPE_HOST ? H(host) : dev;
	*side = type == CU_MEMORYTYPE_HOST ? SIDE_HOST : type == CU_MEMORYTYPE_DEVICE ? SIDE_DEVICE : SIDE_LOOKUP;
	*addr = base + (z * height + y) * pitch + x;
	*len = ((d - 1) * height + (h - 1)) * pitch + w;
}

static struct copy_desc copy_2d(const CUDA_MEMCPY2D *p, uint64_t stream, uint16_t flags)
{
	struct copy_desc d = { .kind = GPUOS_COPY_2D, .flags = flags, .stream = stream };
	side_span(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstXInBytes, p->dstY, 0, p->dstPitch, 0,
		  p->WidthInBytes, p->Height, 1, &d.dst, &d.dst_len, &d.dst_side);
	side_span(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes, p->srcY, 0, p->srcPitch, 0,
		  p->WidthInBytes, p->Height, 1, &d.src, &d.src_len, &d.src_side);
	return d;
}

static struct copy_desc copy_3d(const CUDA_MEMCPY3D *p, uint64_t stream, uint16_t flags)
{
	struct copy_desc d = { .kind = GPUOS_COPY_3D, .flags = flags, .stream = stream };
	side_span(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstXInBytes, p->dstY, p->dstZ, p->dstPitch,
		  p->dstHeight, p->WidthInBytes, p->Height, p->Depth, &d.dst, &d.dst_len, &d.dst_side);
	side_span(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes, p->srcY, p->srcZ, p->srcPitch,
		  p->srcHeight, p->WidthInBytes, p->Height, p->Depth, &d.src, &d.src_len, &d.src_side);
	return d;
}

CUresult gpuos_h_memcpy_2d(PFN_cuMemcpy2D_v3020 real, int pt, const CUDA_MEMCPY2D *p)
{
	if (!p)
		return real(p);
	COPY_OP(copy_2d(p, SYNC(pt), 0), real(p));
}

CUresult gpuos_h_memcpy_2d_async(PFN_cuMemcpy2DAsync_v3020 real, int pt, const CUDA_MEMCPY2D *p, CUstream st)
{
	if (!p)
		return real(p, st);
	COPY_OP(copy_2d(p, gpuos_eff_stream(st, pt), ASYNC), real(p, st));
}

CUresult gpuos_h_memcpy_3d(PFN_cuMemcpy3D_v3020 real, int pt, const CUDA_MEMCPY3D *p)
{
	if (!p)
		return real(p);
	COPY_OP(copy_3d(p, SYNC(pt), 0), real(p));
}

CUresult gpuos_h_memcpy_3d_async(PFN_cuMemcpy3DAsync_v3020 real, int pt, const CUDA_MEMCPY3D *p, CUstream st)
{
	if (!p)
		return real(p, st);
	COPY_OP(copy_3d(p, gpuos_eff_stream(st, pt), ASYNC), real(p, st));
}

CUresult gpuos_h_memset_d8(PFN_cuMemsetD8_v3020 real, int pt, CUdeviceptr d, unsigned char v, size_t n)
{
	COPY_OP(set(d, 0, 1, n, 1, v, SYNC(pt), 0), real(d, v, n));
}

CUresult gpuos_h_memset_d16(PFN_cuMemsetD16_v3020 real, int pt, CUdeviceptr d, unsigned short v, size_t n)
{
	COPY_OP(set(d, 0, 2, n, 1, v, SYNC(pt), 0), real(d, v, n));
}

CUresult gpuos_h_memset_d32(PFN_cuMemsetD32_v3020 real, int pt, CUdeviceptr d, unsigned int v, size_t n)
{
	COPY_OP(set(d, 0, 4, n, 1, v, SYNC(pt), 0), real(d, v, n));
}

CUresult gpuos_h_memset_d2d8(PFN_cuMemsetD2D8_v3020 real, int pt, CUdeviceptr d, size_t pitch, unsigned char v,
			     size_t w, size_t h)
{
	COPY_OP(set(d, pitch, 1, w, h, v, SYNC(pt), 0), real(d, pitch, v, w, h));
}

CUresult gpuos_h_memset_d2d16(PFN_cuMemsetD2D16_v3020 real, int pt, CUdeviceptr d, size_t pitch,
			      unsigned short v, size_t w, size_t h)
{
	COPY_OP(set(d, pitch, 2, w, h, v, SYNC(pt), 0), real(d, pitch, v, w, h));
}

CUresult gpuos_h_memset_d2d32(PFN_cuMemsetD2D32_v3020 real, int pt, CUdeviceptr d, size_t pitch, unsigned int v,
			      size_t w, size_t h)
{
	COPY_OP(set(d, pitch, 4, w, h, v, SYNC(pt), 0), real(d, pitch, v, w, h));
}

CUresult gpuos_h_memset_d8_async(PFN_cuMemsetD8Async_v3020 real, int pt, CUdeviceptr d, unsigned char v,
				 size_t n, CUstream st)
{
	COPY_OP(set(d, 0, 1, n, 1, v, gpuos_eff_stream(st, pt), ASYNC), real(d, v, n, st));
}

CUresult gpuos_h_memset_d16_async(PFN_cuMemsetD16Async_v3020 real, int pt, CUdeviceptr d, unsigned short v,
				  size_t n, CUstream st)
{
	COPY_OP(set(d, 0, 2, n, 1, v, gpuos_eff_stream(st, pt), ASYNC), real(d, v, n, st));
}

CUresult gpuos_h_memset_d32_async(PFN_cuMemsetD32Async_v3020 real, int pt, CUdeviceptr d, unsigned int v,
				  size_t n, CUstream st)
{
	COPY_OP(set(d, 0, 4, n, 1, v, gpuos_eff_stream(st, pt), ASYNC), real(d, v, n, st));
}

CUresult gpuos_h_memset_d2d8_async(PFN_cuMemsetD2D8Async_v3020 real, int pt, CUdeviceptr d, size_t pitch,
				   unsigned char v, size_t w, size_t h, CUstream st)
{
	COPY_OP(set(d, pitch, 1, w, h, v, gpuos_eff_stream(st, pt), ASYNC), real(d, pitch, v, w, h, st));
}

CUresult gpuos_h_memset_d2d16_async(PFN_cuMemsetD2D16Async_v3020 real, int pt, CUdeviceptr d, size_t pitch,
				    unsigned short v, size_t w, size_t h, CUstream st)
{
	COPY_OP(set(d, pitch, 2, w, h, v, gpuos_eff_stream(st, pt), ASYNC), real(d, pitch, v, w, h, st));
}

CUresult gpuos_h_memset_d2d32_async(PFN_cuMemsetD2D32Async_v3020 real, int pt, CUdeviceptr d, size_t pitch,
				    unsigned int v, size_t w, size_t h, CUstream st)
{
	COPY_OP(set(d, pitch, 4, w, h, v, gpuos_eff_stream(st, pt), ASYNC), real(d, pitch, v, w, h, st));
}

/* Stream memory writes are recorded as 4- or 8-byte memsets (value: the low 32 bits). */
CUresult gpuos_h_write_value32(PFN_cuStreamWriteValue32_v11070 real, int pt, CUstream st, CUdeviceptr addr,
			       cuuint32_t value, unsigned int flags)
{
	COPY_OP(set(addr, 0, 4, 1, 1, value, gpuos_eff_stream(st, pt), ASYNC), real(st, addr, value, flags));
}

CUresult gpuos_h_write_value64(PFN_cuStreamWriteValue64_v11070 real, int pt, CUstream st, CUdeviceptr addr,
			       cuuint64_t value, unsigned int flags)
{
	COPY_OP(set(addr, 0, 8, 1, 1, (uint32_t)value, gpuos_eff_stream(st, pt), ASYNC),
		real(st, addr, value, flags));
}

/* ---- batched copies: one operation (one seq), one COPY record per entry --------------------- */

struct batch {
	uint64_t seq, stream;
	uint16_t flags;
	int validating;
	struct gpuos_val_op op;
};

static int batch_begin(struct batch *b, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
		       uint64_t stream)
{
	if (!dsts || !srcs || !sizes || !gpuos_recording())
		return 0;
	gpuos_defer_drain_self(); /* recorded inline, after what this thread queued */
	b->seq = gpuos_next_seq();
	b->stream = stream;
	b->flags = GPUOS_COPY_ASYNC | (gpuos_stream_captured(stream) ? GPUOS_COPY_CAPTURED : 0);
	b->validating = gpuos_validating;
	if (!b->validating)
		return 1;
	memset(&b->op, 0, sizeof b->op);
	b->op.op_type = GPUOS_REC_COPY;
	b->op.seq = b->seq;
	b->op.func_id = GPUOS_NO_FUNC;
	b->op.ctx = (CUcontext)(uintptr_t)gpuos_current_ctx();
	b->op.stream = (CUstream)(uintptr_t)stream;
	struct gpuos_scan *s = gpuos_scan_tls();
	if (!s || count > GPUOS_MAX_BUFS / 2) {
		b->op.touch_all = 1;
	} else {
		pthread_rwlock_rdlock(&gpuos_lock.v);
		for (size_t i = 0; i < count; i++) {
			const struct gpuos_alloc *da = gpuos_map_find(&gpuos_allocs, dsts[i]);
			const struct gpuos_alloc *sa = gpuos_map_find(&gpuos_allocs, srcs[i]);
			gpuos_exact_buf(&s->bufs[2 * i], da, dsts[i], sizes[i],
					GPUOS_BUF_WRITE | (is_device(da) ? 0 : GPUOS_BUF_HOST));
			gpuos_exact_buf(&s->bufs[2 * i + 1], sa, srcs[i], sizes[i],
					GPUOS_BUF_READ | (is_device(sa) ? 0 : GPUOS_BUF_HOST));
		}
		pthread_rwlock_unlock(&gpuos_lock.v);
		b->op.bufs = s->bufs;
		b->op.nbuf = (uint32_t)(2 * count);
	}
	gpuos_val_begin(&b->op);
	return 1;
}

static CUresult batch_end(struct batch *b, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
			  CUresult r)
{
	if (r == CUDA_SUCCESS) {
		for (size_t i = 0; i < count; i++) {
			struct gpuos_rec_copy rec = {
				.seq = b->seq, .stream = b->stream, .dst = dsts[i], .src = srcs[i],
				.dst_len = sizes[i], .src_len = sizes[i], .kind = GPUOS_COPY_BATCH,
			};
			gpuos_ring_emit(GPUOS_REC_COPY, b->flags, &rec, sizeof rec, NULL, 0);
		}
		GPUOS_COUNT(n_copies, count);
	}
	if (b->validating)
		gpuos_val_end(&b->op, r);
	return r;
}

CUresult gpuos_h_memcpy_batch_async(PFN_cuMemcpyBatchAsync_v13000 real, int pt, CUdeviceptr *dsts,
				    CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
				    size_t *attrIdxs, size_t numAttrs, CUstream st)
{
	struct batch b;
	if (!batch_begin(&b, dsts, srcs, sizes, count, gpuos_eff_stream(st, pt)))
		return real(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, st);
	return batch_end(&b, dsts, srcs, sizes, count,
			 real(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, st));
}

CUresult gpuos_h_memcpy_batch_async_v1(PFN_cuMemcpyBatchAsync_v12080 real, int pt, CUdeviceptr *dsts,
				       CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
				       size_t *attrIdxs, size_t numAttrs, size_t *failIdx, CUstream st)
{
	struct batch b;
	if (!batch_begin(&b, dsts, srcs, sizes, count, gpuos_eff_stream(st, pt)))
		return real(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, st);
	return batch_end(&b, dsts, srcs, sizes, count,
			 real(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, failIdx, st));
}

/* ---- graph nodes ------------------------------------------------------------------------------- */

uint32_t gpuos_node_memcpy(const CUDA_MEMCPY3D *p, struct gpuos_rec_copy *rec, struct gpuos_rec_buf bufs[2])
{
	struct copy_desc d = copy_3d(p, 0, 0);
	return describe(&d, rec, bufs, 1);
}

uint32_t gpuos_node_memset(const CUDA_MEMSET_NODE_PARAMS *p, struct gpuos_rec_copy *rec,
			   struct gpuos_rec_buf bufs[2])
{
	struct copy_desc d = set(p->dst, p->pitch, p->elementSize, p->width, p->height, p->value, 0, 0);
	return describe(&d, rec, bufs, 1);
}
