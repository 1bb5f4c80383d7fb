/* SPDX-License-Identifier: MIT */
/*
 * agent.c - the movable-memory agent: gpuos's commands inside the process
 * (include/gpuos_agent.h is the protocol), and the gate that holds the application.
 *
 * The gate.  Every exported wrapper marks its thread inside (a per-thread slot, one
 * plain store) and then reads gpuos_hot.gate; HOLD sets the gate and then runs
 * membarrier(PRIVATE_EXPEDITED), a full barrier on every thread of the process, so that
 * a thread that read the gate open has its mark visible: the agent waits until no slot
 * is marked.  A thread that finds the gate set unmarks itself and waits on a condition
 * variable.  The cost on every call is two stores and a load, no atomic read-modify-write.
 * Nested wrappers (a handler reaching another wrapper) keep their thread's mark.
 *
 * The agent thread serves one client at a time, and is the only thread that moves
 * movable memory; while it works the gate is set, so the allocation map stands still
 * (frees and allocations wait at the gate too).
 *
 * Filling (a restore on demand).  FILL with GPUOS_AGENT_FILL_LATER gives every allocation
 * new memory and leaves its contents to come; RESUME with GPUOS_AGENT_RESUME_FILLING sets
 * the gate to GPUOS_GATE_FILLING instead of opening it.  The application then runs: a
 * wrapper that touches no existing device memory goes on; a launch, copy or memset waits
 * (fill_wait) until the allocations it touches, as libgpuos predicts them (ops.c), are
 * filled; anything else, and a launch whose layout is unknown, waits until all are.
 * FILL_PARTS copies parts of the allocations from the staging area, on the agent's own
 * streams, and marks an allocation filled once all its bytes are in and the copies are
 * done; the last one opens the gate.  The allocation map is the one HOLD saw: the calls
 * that could change it for a movable allocation (frees, context teardown) wait for
 * everything.
 */
#include <errno.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "core.h"
#include "gpuos_agent.h"

/* ---- the gate ---------------------------------------------------------------------------- */

#define GATE_SLOTS 4096
#define HOLD_TIMEOUT_NS (30ull * 1000000000ull)

static struct gpuos_gate_slot slots[GATE_SLOTS];
static int overflow_inside; /* atomic: threads beyond GATE_SLOTS, counted the slow way */
GPUOS_TLS struct gpuos_gate_slot *gpuos_tls_gate;
#define tls_slot gpuos_tls_gate
static GPUOS_TLS int tls_overflow, tls_is_agent;
static pthread_key_t slot_key;
static pthread_once_t slot_key_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int membarrier_ok;

static void slot_free(void *p)
{
	__atomic_store_n(&((struct gpuos_gate_slot *)p)->used, 0, __ATOMIC_RELEASE);
}

static void make_slot_key(void)
{
	pthread_key_create(&slot_key, slot_free);
}

struct gpuos_gate_slot *gpuos_gate_slot_slow(void)
{
	if (tls_overflow)
		return NULL;
	pthread_once(&slot_key_once, make_slot_key);
	for (size_t i = 0; i < GATE_SLOTS; i++) {
		int z = 0;
		if (!__atomic_load_n(&slots[i].used, __ATOMIC_RELAXED) &&
		    __atomic_compare_exchange_n(&slots[i].used, &z, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
			slots[i].inside = 0;
			tls_slot = &slots[i];
			pthread_setspecific(slot_key, &slots[i]);
			return &slots[i];
		}
	}
	tls_overflow = 1;
	return NULL;
}

static int gate_set(void)
{
	return __atomic_load_n(&gpuos_hot.gate, __ATOMIC_ACQUIRE);
}

static int gate_held(void)
{
	return gate_set() == GPUOS_GATE_HELD;
}

static void wait_open(void)
{
	pthread_mutex_lock(&gate_mu);
	while (gate_held())
		pthread_cond_wait(&gate_cv, &gate_mu);
	pthread_mutex_unlock(&gate_mu);
}

static void fill_gate(int hk);
static void resident_gate(int hk);

/* The gate was found set at the entry of a wrapper (slot marked; NULL: an overflow thread,
 * counted in overflow_inside). */
void gpuos_gate_wait(struct gpuos_gate_slot *s, int hk)
{
	if (tls_is_agent)
		return;
	if (s && s->inside > 1)
		return; /* nested: the outer call holds the thread's mark */
	for (;;) {
		int g = gate_set();
		if (g == GPUOS_GATE_FILLING)
			return fill_gate(hk);
		if (g == GPUOS_GATE_RESIDENT)
			return resident_gate(hk);
		if (!g)
			return;
		if (s)
			__atomic_store_n(&s->inside, 0, __ATOMIC_RELEASE);
		else
			__atomic_sub_fetch(&overflow_inside, 1, __ATOMIC_SEQ_CST);
		wait_open();
		if (s) {
			__atomic_exchange_n(&s->inside, 1, __ATOMIC_SEQ_CST); /* a full barrier before the load */
		} else {
			__atomic_add_fetch(&overflow_inside, 1, __ATOMIC_SEQ_CST);
		}
	}
}

void gpuos_gate_overflow_enter(int hk)
{
	__atomic_add_fetch(&overflow_inside, 1, __ATOMIC_SEQ_CST);
	if (gate_set())
		gpuos_gate_wait(NULL, hk);
}

void gpuos_gate_overflow_exit(void)
{
	__atomic_sub_fetch(&overflow_inside, 1, __ATOMIC_SEQ_CST);
}

static int quiescent(void)
{
	if (__atomic_load_n(&overflow_inside, __ATOMIC_SEQ_CST))
		return 0;
	for (size_t i = 0; i < GATE_SLOTS; i++)
		if (__atomic_load_n(&slots[i].used, __ATOMIC_ACQUIRE) &&
		    __atomic_load_n(&slots[i].inside, __ATOMIC_ACQUIRE) && &slots[i] != tls_slot)
			return 0;
	return 1;
}

static void gate_open(void)
{
	pthread_mutex_lock(&gate_mu);
	__atomic_store_n(&gpuos_hot.gate, 0, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&gate_cv);
	pthread_mutex_unlock(&gate_mu);
}

/* Close the gate and wait until no thread is inside a wrapper: 0, or an errno. */
static int gate_close(void)
{
	if (!membarrier_ok)
		return ENOSYS;
	pthread_mutex_lock(&gate_mu);
	__atomic_store_n(&gpuos_hot.gate, 1, __ATOMIC_SEQ_CST);
	pthread_mutex_unlock(&gate_mu);
	if (syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0)) {
		int e = errno;
		gate_open();
		return e;
	}
	uint64_t deadline = gpuos_now_ns() + HOLD_TIMEOUT_NS;
	while (!quiescent()) {
		if (gpuos_now_ns() > deadline) {
			gate_open();
			return ETIMEDOUT;
		}
		usleep(100);
	}
	return 0;
}

void gpuos_gate_resident(void)
{
	pthread_mutex_lock(&gate_mu);
	int open = 0;
	__atomic_compare_exchange_n(&gpuos_hot.gate, &open, GPUOS_GATE_RESIDENT, 0, __ATOMIC_SEQ_CST,
				    __ATOMIC_RELAXED);
	pthread_mutex_unlock(&gate_mu);
	/* A thread that read the gate open may be about to submit work on memory that an
	 * eviction could take: wait until each has left its wrapper (as HOLD does). */
	if (!membarrier_ok || syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0)) {
		fprintf(stderr, "gpuos: --gpu-memory: no membarrier; calls in flight while the limit was "
				"first exceeded are not waited for\n");
		return;
	}
	uint64_t deadline = gpuos_now_ns() + HOLD_TIMEOUT_NS;
	while (!quiescent() && gpuos_now_ns() < deadline)
		usleep(50);
}

/* ---- the agent's state --------------------------------------------------------------------- */

#define PIECE (64ull << 20) /* bytes per copy */
#define NSTREAMS 4

struct held {
	int depth;    /* HOLDs not yet RESUMEd */
	int detached; /* HOLD with GPUOS_AGENT_HOLD_DETACH closed the control connection */
	int released; /* the physical memory is unmapped and released */
	struct gpuos_alloc *v;
	size_t n;
	uint64_t bytes;
};
static struct held H;

/* Filling (its section below): the lock, and each allocation's bytes still to come. */
static pthread_mutex_t fill_mu;
static uint64_t *fill_left;

/* SNAPSHOT's shadows: a device-to-device copy of every allocation taken while held, at
 * addresses of the agent's own (the application never sees them), captured to the host
 * later while the application runs. */
struct shadow {
	uint64_t va;
	CUmemGenericAllocationHandle h;
};
static struct shadow *SH; /* H.n of them while a snapshot exists */
static int sh_released;   /* handed out with the application's memory */
static size_t sh_map_next;

static void drop_shadows(void)
{
	for (size_t i = 0; SH && i < H.n; i++) {
		size_t size = gpuos_movable_reserved(&H.v[i]);
		if (SH[i].va && SH[i].h) { /* mapped: also what a MAP cut short mapped */
			gpuos_drv.mem_unmap(SH[i].va, size);
			gpuos_drv.mem_release(SH[i].h);
		}
		if (SH[i].va)
			gpuos_drv.mem_address_free(SH[i].va, size);
	}
	free(SH);
	SH = NULL;
	sh_released = 0;
	sh_map_next = 0;
}

static void say(struct gpuos_agent_reply *r, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void say(struct gpuos_agent_reply *r, int status, const char *fmt, ...)
{
	r->status = status;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(r->msg, sizeof r->msg, fmt, ap);
	va_end(ap);
}

static const char *cuerr(CUresult c)
{
	static __thread char buf[32];
	const char *s = NULL;
	if (gpuos_drv.get_error_name)
		gpuos_drv.get_error_name(c, &s);
	if (s)
		return s;
	snprintf(buf, sizeof buf, "CUDA error %d", (int)c);
	return buf;
}

/* The movable allocations of the map, in its order. */
static int snapshot(void)
{
	pthread_rwlock_rdlock(&gpuos_lock.v);
	size_t n = 0;
	for (size_t i = 0; i < gpuos_allocs.n; i++)
		n += !!(gpuos_allocs.v[i].flags & GPUOS_A_MOVABLE);
	struct gpuos_alloc *v = n ? malloc(n * sizeof *v) : NULL;
	if (n && !v) {
		pthread_rwlock_unlock(&gpuos_lock.v);
		return ENOMEM;
	}
	size_t j = 0;
	H.bytes = 0;
	for (size_t i = 0; i < gpuos_allocs.n; i++)
		if (gpuos_allocs.v[i].flags & GPUOS_A_MOVABLE) {
			v[j] = gpuos_allocs.v[i];
			H.bytes += gpuos_movable_reserved(&v[j]);
			j++;
		}
	pthread_rwlock_unlock(&gpuos_lock.v);
	free(H.v);
	H.v = v;
	H.n = n;
	return 0;
}

/* Synchronize every context that holds movable memory. */
static CUresult sync_contexts(void)
{
	for (size_t i = 0; i < H.n; i++) {
		int seen = 0;
		for (size_t j = 0; j < i; j++)
			seen |= H.v[j].ctx == H.v[i].ctx;
		if (seen)
			continue;
		CUcontext c;
		CUresult r = gpuos_drv.ctx_push((CUcontext)(uintptr_t)H.v[i].ctx);
		if (r != CUDA_SUCCESS)
			return r;
		r = gpuos_drv.ctx_sync();
		gpuos_drv.ctx_pop(&c);
		if (r != CUDA_SUCCESS)
			return r;
	}
	return CUDA_SUCCESS;
}

/* The new handle of allocation i, in the map too (gpuos_movable_free releases it). */
static void set_handle(size_t i, CUmemGenericAllocationHandle h)
{
	H.v[i].aux = h;
	gpuos_write_lock_drained();
	ssize_t k = gpuos_map_index(&gpuos_allocs, H.v[i].base);
	if (k >= 0)
		gpuos_allocs.v[k].aux = h;
	pthread_rwlock_unlock(&gpuos_lock.v);
}

static void do_hold(uint64_t flags, struct gpuos_agent_reply *r)
{
	if (flags & ~(uint64_t)GPUOS_AGENT_HOLD_DETACH)
		return say(r, EINVAL, "unknown HOLD flags %#llx", (unsigned long long)flags);
	if (H.depth && (flags & GPUOS_AGENT_HOLD_DETACH) && !H.detached) {
		gpuos_ctl_detach();
		H.detached = 1;
	}
	if (!H.depth && __atomic_load_n(&fill_left, __ATOMIC_ACQUIRE))
		return say(r, EBUSY, "its memory is still being filled");
	if (gpuos_res_limit())
		return say(r, EOPNOTSUPP, "a process under --gpu-memory cannot be held (checkpointed) yet");
	if (H.depth++) {
		r->count = (uint32_t)H.n;
		r->bytes = H.bytes;
		return;
	}
	int e = gate_close();
	if (e) {
		H.depth = 0;
		say(r, e, e == ETIMEDOUT ? "threads stayed inside CUDA calls for 30 s" :
			  "membarrier(PRIVATE_EXPEDITED) is not available: %s", strerror(e));
		return;
	}
	if ((e = snapshot())) {
		H.depth = 0;
		gate_open();
		say(r, e, "out of memory");
		return;
	}
	CUresult c = sync_contexts();
	if (c != CUDA_SUCCESS) {
		H.depth = 0;
		gate_open();
		say(r, EIO, "cuCtxSynchronize: %s", cuerr(c));
		return;
	}
	if (flags & GPUOS_AGENT_HOLD_DETACH) {
		gpuos_ctl_detach();
		H.detached = 1;
	}
	r->count = (uint32_t)H.n;
	r->bytes = H.bytes;
}

static void resume_now(void)
{
	H.depth = 0;
	gate_open();
	if (H.detached) {
		H.detached = 0;
		gpuos_ctl_reattach();
	}
}

static void do_resume(uint64_t flags, struct gpuos_agent_reply *r)
{
	if (flags & ~(uint64_t)GPUOS_AGENT_RESUME_FILLING)
		return say(r, EINVAL, "unknown RESUME flags %#llx", (unsigned long long)flags);
	if (!H.depth)
		return say(r, EINVAL, "not held");
	if (H.released)
		return say(r, EBUSY, "the memory is released: MAP or FILL first");
	if (--H.depth)
		return;
	pthread_mutex_lock(&fill_mu);
	int filling = (flags & GPUOS_AGENT_RESUME_FILLING) && fill_left;
	if (filling) { /* the application goes on; its calls wait for what is not filled yet */
		pthread_mutex_lock(&gate_mu);
		__atomic_store_n(&gpuos_hot.gate, GPUOS_GATE_FILLING, __ATOMIC_RELEASE);
		pthread_cond_broadcast(&gate_cv);
		pthread_mutex_unlock(&gate_mu);
	}
	pthread_mutex_unlock(&fill_mu);
	if (!filling) {
		resume_now();
		return;
	}
	if (H.detached) {
		H.detached = 0;
		gpuos_ctl_reattach();
	}
}

/* ---- copies between the allocations and the staging memfd --------------------------------- */

/* The client's memfd, mapped shared and registered with the driver (PREPARE): registering
 * pins its pages, at about 4 GB/s (bench/host_register.py, H100), so it happens before
 * the process is held, and the copies while it is held are the copy engines' DMA at PCIe
 * speed.  It is registered in windows: one registration holds the driver's locks while it
 * pins, and the application's calls wait meanwhile (measured: 20 GiB at once stalled a
 * running process 5 s); between windows they go on.  No copy crosses a window. */
#define WINDOW (256ull << 20)

static struct {
	uint8_t *p;
	size_t size;
	size_t registered; /* bytes from p registered, in windows */
} stage;

/* A context of the application's, current on the agent's thread for calls that need one
 * (registering host memory): its first movable allocation's. */
static uint64_t stage_ctx;

static int push_app_ctx(void)
{
	if (!stage_ctx) {
		pthread_rwlock_rdlock(&gpuos_lock.v);
		for (size_t i = 0; i < gpuos_allocs.n && !stage_ctx; i++)
			if (gpuos_allocs.v[i].flags & GPUOS_A_MOVABLE)
				stage_ctx = gpuos_allocs.v[i].ctx;
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
	return stage_ctx && gpuos_drv.ctx_push((CUcontext)(uintptr_t)stage_ctx) == CUDA_SUCCESS;
}

static void pop_ctx(void)
{
	CUcontext c;
	gpuos_drv.ctx_pop(&c);
}

static void unprepare(void)
{
	if (stage.registered && push_app_ctx()) {
		for (size_t o = 0; o < stage.registered; o += WINDOW)
			gpuos_drv.mem_host_unregister(stage.p + o);
		pop_ctx();
	}
	if (stage.p)
		munmap(stage.p, stage.size);
	memset(&stage, 0, sizeof stage);
}

static void do_prepare(int fd, uint64_t size, struct gpuos_agent_reply *r)
{
	uint64_t t0 = gpuos_now_ns();
	unprepare();
	if (!size)
		return say(r, EINVAL, "PREPARE needs the memfd's size");
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return say(r, errno, "mmap of the memfd: %s", strerror(errno));
	stage.p = p;
	stage.size = size;
	/* Unpinned, the copies still work, slower: the reply says which (arg).  Registering
	 * needs a current context (measured on H100: without one it fails at once). */
	if (gpuos_drv.mem_host_register) {
		for (size_t o = 0; o < size; o += WINDOW) {
			size_t n = size - o < WINDOW ? size - o : WINDOW;
			if (!push_app_ctx())
				break;
			CUresult c = gpuos_drv.mem_host_register(stage.p + o, n, CU_MEMHOSTREGISTER_PORTABLE);
			pop_ctx();
			if (c != CUDA_SUCCESS)
				break;
			stage.registered = o + n;
			usleep(2000); /* the driver's lock is not fair: let the application's calls in */
		}
	}
	r->arg = stage.registered == size;
	r->bytes = size;
	r->ns = gpuos_now_ns() - t0;
}

static int staged_enough(struct gpuos_agent_reply *r)
{
	if (stage.size >= H.bytes)
		return 1;
	say(r, ENOSPC, "the prepared memfd has %zu bytes, the allocations %llu: PREPARE a larger one", stage.size,
	    (unsigned long long)H.bytes);
	return 0;
}

/* The agent's own streams for a context made current: NSTREAMS, non-blocking. */
static CUresult streams_create(CUstream st[NSTREAMS])
{
	CUresult res = CUDA_SUCCESS;
	for (int s = 0; s < NSTREAMS && res == CUDA_SUCCESS; s++)
		res = gpuos_drv.stream_create(&st[s], CU_STREAM_NON_BLOCKING);
	return res;
}

/* Wait for the streams' copies, destroy them and pop their context: res, or the first
 * error of the waits. */
static CUresult streams_finish(CUstream st[NSTREAMS], CUresult res)
{
	for (int s = 0; s < NSTREAMS; s++)
		if (st[s]) {
			CUresult e = gpuos_drv.stream_sync(st[s]);
			if (res == CUDA_SUCCESS)
				res = e;
			gpuos_drv.stream_destroy(st[s]);
		}
	CUcontext c;
	gpuos_drv.ctx_pop(&c);
	return res;
}

/* n bytes of a copy at staging offset `at`, cut at the end of its registered window: a
 * copy never spans two registrations. */
static uint64_t in_window(uint64_t at, uint64_t n)
{
	return n > WINDOW - at % WINDOW ? WINDOW - at % WINDOW : n;
}

/* Copy every allocation to (to_host) or from the staging memfd, laid out back to back in
 * LIST order: all copies of a context issued on NSTREAMS streams of its own, then waited for. */
static CUresult copy_all(int to_host, int from_shadows)
{
	uint64_t off = 0;
	CUresult res = CUDA_SUCCESS;
	for (size_t i = 0; i < H.n && res == CUDA_SUCCESS; i++) {
		int first = 1;
		for (size_t j = 0; j < i; j++)
			first &= H.v[j].ctx != H.v[i].ctx;
		if (!first)
			continue;
		CUstream st[NSTREAMS] = { 0 };
		if ((res = gpuos_drv.ctx_push((CUcontext)(uintptr_t)H.v[i].ctx)) != CUDA_SUCCESS)
			break;
		res = streams_create(st);
		off = 0;
		uint64_t k = 0;
		for (size_t j = 0; j < H.n; j++) {
			struct gpuos_alloc *a = &H.v[j];
			size_t size = gpuos_movable_reserved(a);
			uint64_t dev = from_shadows ? SH[j].va : a->base;
			for (uint64_t o = 0, n; a->ctx == H.v[i].ctx && o < size && res == CUDA_SUCCESS; o += n, k++) {
				n = in_window(off + o, size - o < PIECE ? size - o : PIECE);
				res = to_host ? gpuos_drv.memcpy_dtoh_async(stage.p + off + o, dev + o, n, st[k % NSTREAMS])
					      : gpuos_drv.memcpy_htod_async(dev + o, stage.p + off + o, n, st[k % NSTREAMS]);
			}
			off += size;
		}
		res = streams_finish(st, res);
	}
	return res;
}

static void do_capture(struct gpuos_agent_reply *r)
{
	if (SH ? sh_released : (!H.depth || H.released))
		return say(r, EINVAL, SH ? "the snapshot is handed out: MAP it back first" :
				      H.depth ? "the memory is released" : "not held");
	if (!staged_enough(r))
		return;
	uint64_t t0 = gpuos_now_ns();
	CUresult c = copy_all(1, SH != NULL);
	if (c != CUDA_SUCCESS)
		return say(r, EIO, "copy to the host: %s", cuerr(c));
	r->arg = SH != NULL;
	drop_shadows(); /* captured: the snapshot has served */
	r->bytes = H.bytes;
	r->ns = gpuos_now_ns() - t0;
}

/* Shadows for every allocation, filled by device-to-device copies on the agent's streams. */
static void do_snapshot(struct gpuos_agent_reply *r)
{
	if (!H.depth || H.released)
		return say(r, EINVAL, H.depth ? "the memory is released" : "not held");
	if (SH)
		return say(r, EEXIST, "a snapshot exists (CAPTURE or DROP it)");
	uint64_t t0 = gpuos_now_ns();
	if (H.n && !(SH = calloc(H.n, sizeof *SH)))
		return say(r, ENOMEM, "out of host memory");
	CUresult c = CUDA_SUCCESS;
	for (size_t i = 0; i < H.n && c == CUDA_SUCCESS; i++) {
		size_t size = gpuos_movable_reserved(&H.v[i]);
		CUdeviceptr va;
		if ((c = gpuos_drv.mem_address_reserve(&va, size, 0, 0, 0)) != CUDA_SUCCESS)
			break;
		SH[i].va = va;
		c = gpuos_movable_map_new(va, size, H.v[i].device, &SH[i].h);
	}
	for (size_t i = 0; i < H.n && c == CUDA_SUCCESS; i++) {
		CUcontext ctx;
		if ((c = gpuos_drv.ctx_push((CUcontext)(uintptr_t)H.v[i].ctx)) != CUDA_SUCCESS)
			break;
		c = gpuos_drv.memcpy_dtod_async(SH[i].va, H.v[i].base, gpuos_movable_reserved(&H.v[i]), 0);
		gpuos_drv.ctx_pop(&ctx);
	}
	if (c == CUDA_SUCCESS)
		c = sync_contexts();
	if (c != CUDA_SUCCESS) {
		drop_shadows();
		/* ENOMEM: not enough device memory for a copy: the client captures while held instead */
		return say(r, c == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : EIO, "snapshot: %s", cuerr(c));
	}
	r->bytes = H.bytes;
	r->ns = gpuos_now_ns() - t0;
}

static void do_release(struct gpuos_agent_reply *r)
{
	if (!H.depth || H.released)
		return say(r, EINVAL, H.depth ? "released already" : "not held");
	for (size_t i = 0; i < H.n; i++) {
		struct gpuos_alloc *a = &H.v[i];
		CUresult c = gpuos_drv.mem_unmap(a->base, gpuos_movable_reserved(a));
		if (c != CUDA_SUCCESS) {
			/* the ones before are gone: only a MAP or FILL of all brings them back */
			H.released = i > 0;
			return say(r, EIO, "cuMemUnmap of %#llx: %s", (unsigned long long)a->base, cuerr(c));
		}
		gpuos_drv.mem_release(a->aux);
		H.released = 1;
	}
	H.released = 1;
	for (size_t i = 0; SH && i < H.n; i++) { /* the snapshot goes out with it */
		gpuos_drv.mem_unmap(SH[i].va, gpuos_movable_reserved(&H.v[i]));
		gpuos_drv.mem_release(SH[i].h);
		SH[i].h = 0;
		sh_released = 1;
	}
}

static CUresult import_at(uint64_t va, size_t size, int device, int fd, CUmemGenericAllocationHandle *out);

/* New physical memory for allocation i at its address: imported from fd, or created. */
static CUresult remap_one(size_t i, int fd)
{
	struct gpuos_alloc *a = &H.v[i];
	size_t size = gpuos_movable_reserved(a);
	CUmemGenericAllocationHandle h;
	CUresult c;
	if ((c = fd >= 0 ? import_at(a->base, size, a->device, fd, &h)
			 : gpuos_movable_map_new(a->base, size, a->device, &h)) != CUDA_SUCCESS)
		return c;
	set_handle(i, h);
	return CUDA_SUCCESS;
}

static size_t map_next; /* MAP: allocations mapped so far */

static CUresult import_at(uint64_t va, size_t size, int device, int fd, CUmemGenericAllocationHandle *out)
{
	CUmemGenericAllocationHandle h;
	CUresult c = gpuos_drv.mem_import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (c != CUDA_SUCCESS)
		return c;
	if ((c = gpuos_drv.mem_map(va, size, 0, h, 0)) != CUDA_SUCCESS) {
		gpuos_drv.mem_release(h);
		return c;
	}
	const CUmemAccessDesc *acc;
	size_t nacc = gpuos_movable_access(device, &acc);
	if ((c = gpuos_drv.mem_set_access(va, size, acc, nacc)) != CUDA_SUCCESS) {
		gpuos_drv.mem_unmap(va, size);
		gpuos_drv.mem_release(h);
		return c;
	}
	*out = h;
	return CUDA_SUCCESS;
}

/* No snapshot (a restore): shadows' address ranges for memory filled outside the process. */
static int shadows_reserve(struct gpuos_agent_reply *r)
{
	if (!H.depth)
		return say(r, EINVAL, "not held"), -1;
	if (H.n && !(SH = calloc(H.n, sizeof *SH)))
		return say(r, ENOMEM, "out of host memory"), -1;
	sh_released = 1;
	sh_map_next = 0;
	for (size_t i = 0; i < H.n; i++) {
		CUdeviceptr va;
		CUresult c = gpuos_drv.mem_address_reserve(&va, gpuos_movable_reserved(&H.v[i]), 0, 0, 0);
		if (c != CUDA_SUCCESS) {
			drop_shadows();
			return say(r, EIO, "address range for shadow %zu: %s", i, cuerr(c)), -1;
		}
		SH[i].va = va;
	}
	return 0;
}

static void do_map_shadows(const int *fds, size_t nfds, uint64_t first, struct gpuos_agent_reply *r)
{
	if (!SH && first == 0 && shadows_reserve(r))
		return;
	if (!SH || !sh_released)
		return say(r, EINVAL, SH ? "the snapshot is mapped" : "no snapshot");
	if (first != sh_map_next || first + nfds > H.n)
		return say(r, EINVAL, "expected snapshot fds from index %zu (of %zu), got %zu from %llu", sh_map_next,
			   H.n, nfds, (unsigned long long)first);
	for (size_t i = 0; i < nfds; i++, sh_map_next++) {
		size_t k = first + i;
		CUresult c = import_at(SH[k].va, gpuos_movable_reserved(&H.v[k]), H.v[k].device, fds[i], &SH[k].h);
		if (c != CUDA_SUCCESS)
			return say(r, EIO, "mapping snapshot %zu back: %s", k, cuerr(c));
	}
	if (sh_map_next == H.n) {
		sh_released = 0;
		sh_map_next = 0;
	}
	r->count = (uint32_t)sh_map_next;
}

static void do_map(const int *fds, size_t nfds, uint64_t first, struct gpuos_agent_reply *r)
{
	if (first & GPUOS_AGENT_SHADOWS)
		return do_map_shadows(fds, nfds, first & ~GPUOS_AGENT_SHADOWS, r);
	if (!H.depth || !H.released)
		return say(r, EINVAL, H.depth ? "the memory is mapped" : "not held");
	if (first != map_next || first + nfds > H.n)
		return say(r, EINVAL, "expected fds from index %zu (of %zu), got %zu from %llu", map_next, H.n, nfds,
			   (unsigned long long)first);
	for (size_t i = 0; i < nfds; i++) {
		CUresult c = remap_one(first + i, fds[i]);
		if (c != CUDA_SUCCESS)
			return say(r, EIO, "mapping allocation %llu back: %s", (unsigned long long)(first + i), cuerr(c));
		map_next++;
	}
	if (map_next == H.n) {
		H.released = 0;
		map_next = 0;
	}
	r->count = (uint32_t)map_next;
}

/* Device-to-device copies from the (mapped) snapshot into the allocations, then waited for. */
static CUresult copy_from_shadows(void)
{
	CUresult c = CUDA_SUCCESS;
	for (size_t i = 0; i < H.n && c == CUDA_SUCCESS; i++) {
		CUcontext ctx;
		if ((c = gpuos_drv.ctx_push((CUcontext)(uintptr_t)H.v[i].ctx)) != CUDA_SUCCESS)
			break;
		c = gpuos_drv.memcpy_dtod_async(H.v[i].base, SH[i].va, gpuos_movable_reserved(&H.v[i]), 0);
		gpuos_drv.ctx_pop(&ctx);
	}
	return c == CUDA_SUCCESS ? sync_contexts() : c;
}

static void do_fill_later(struct gpuos_agent_reply *r);

static void do_fill(uint64_t flags, struct gpuos_agent_reply *r)
{
	int from_shadows = (flags & GPUOS_AGENT_SHADOWS) != 0;
	if (flags == GPUOS_AGENT_FILL_LATER)
		return do_fill_later(r);
	if (flags & ~GPUOS_AGENT_SHADOWS)
		return say(r, EINVAL, "unknown FILL flags %#llx", (unsigned long long)flags);
	if (!H.depth || !H.released)
		return say(r, EINVAL, H.depth ? "the memory is mapped" : "not held");
	if (from_shadows && (!SH || sh_released))
		return say(r, EINVAL, SH ? "the snapshot is handed out: MAP it back first" : "no snapshot");
	if (!from_shadows && !staged_enough(r))
		return;
	uint64_t t0 = gpuos_now_ns();
	for (size_t i = map_next; i < H.n; i++) {
		CUresult c = remap_one(i, -1);
		if (c != CUDA_SUCCESS) {
			if (from_shadows) { /* all or nothing: the client can still MAP the snapshot instead */
				for (size_t j = 0; j < i; j++) {
					gpuos_drv.mem_unmap(H.v[j].base, gpuos_movable_reserved(&H.v[j]));
					gpuos_drv.mem_release(H.v[j].aux);
				}
				map_next = 0;
			}
			return say(r, c == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : EIO, "new memory for allocation %zu: %s", i,
				   cuerr(c));
		}
		map_next = i + 1;
	}
	CUresult c = from_shadows ? copy_from_shadows() : copy_all(0, 0);
	if (c != CUDA_SUCCESS)
		return say(r, EIO, "copy from the %s: %s", from_shadows ? "snapshot" : "host", cuerr(c));
	H.released = 0;
	map_next = 0;
	r->bytes = H.bytes;
	r->ns = gpuos_now_ns() - t0;
}

/* ---- filling while the application runs ---------------------------------------------------- */

static pthread_mutex_t fill_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fill_cv = PTHREAD_COND_INITIALIZER;
static uint64_t *fill_left = NULL; /* per allocation of H: bytes still to come (NULL: none pending) */
static size_t fill_pending;  /* allocations with bytes to come */
static uint64_t fill_wanted = UINT64_MAX; /* an allocation a thread waits for, for FILL_PARTS' reply */
static uint32_t fill_all_waits; /* calls that waited for everything, since the last reply */
static const char *fill_all_why; /* the last one's reason */
static uint8_t hook_class[HK_COUNT];
GPUOS_TLS int gpuos_tls_fill_check;

static void fill_gate(int hk)
{
	int c = hk >= 0 && hk < HK_COUNT ? hook_class[hk] : GPUOS_FILL_ALL;
	if (c == GPUOS_FILL_PRECISE)
		gpuos_tls_fill_check = 1;
	else if (c == GPUOS_FILL_ALL)
		gpuos_fill_wait_all(gpuos_hook_name(hk));
}

/* Under --gpu-memory: a launch, copy or memset makes resident what it touches (its
 * handler, from the prediction); a call that may touch any allocation, all of them. */
static uint8_t res_class[HK_COUNT];
static int res_class_made; /* atomic */

static void resident_gate(int hk)
{
	if (!__atomic_load_n(&res_class_made, __ATOMIC_ACQUIRE)) {
		for (int k = 0; k < HK_COUNT; k++)
			res_class[k] = (uint8_t)gpuos_hook_res_class(k);
		__atomic_store_n(&res_class_made, 1, __ATOMIC_RELEASE);
	}
	int c = hk >= 0 && hk < HK_COUNT ? res_class[hk] : GPUOS_FILL_ALL;
	if (c == GPUOS_FILL_PRECISE)
		gpuos_tls_fill_check = 1;
	else if (c == GPUOS_FILL_ALL)
		gpuos_fill_wait_all(gpuos_hook_name(hk)); /* if that fails, the call may fault: said on stderr */
}

/* Wait for allocation i of H (SIZE_MAX: all) to be filled. */
static void fill_wait(size_t i)
{
	pthread_mutex_lock(&fill_mu);
	while (fill_left && (i == SIZE_MAX ? fill_pending : fill_left[i])) {
		if (i != SIZE_MAX && fill_wanted == UINT64_MAX)
			fill_wanted = i;
		pthread_cond_wait(&fill_cv, &fill_mu);
	}
	pthread_mutex_unlock(&fill_mu);
}

CUresult gpuos_fill_wait_all(const char *why)
{
	if (tls_is_agent)
		return CUDA_SUCCESS;
	if (gate_set() == GPUOS_GATE_RESIDENT)
		return gpuos_res_need_all(why);
	pthread_mutex_lock(&fill_mu);
	int pending = fill_left && fill_pending;
	if (pending) {
		fill_all_waits++;
		fill_all_why = why;
	}
	pthread_mutex_unlock(&fill_mu);
	if (pending)
		fill_wait(SIZE_MAX);
	return CUDA_SUCCESS;
}

static void fill_wait_ptr(uint64_t ptr)
{
	size_t lo = 0, hi = H.n; /* H stands still while filling: HOLD is refused */
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (ptr < H.v[mid].base)
			hi = mid;
		else if (ptr >= H.v[mid].base + gpuos_movable_reserved(&H.v[mid]))
			lo = mid + 1;
		else
			return fill_wait(mid);
	}
}

/* n addresses `stride` bytes apart (a launch's buffers, a copy's sides): waited for while
 * filling, made resident under --gpu-memory. */
static CUresult wait_for(const uint64_t *p, size_t n, size_t stride, int launch)
{
	if (tls_is_agent)
		return CUDA_SUCCESS;
	if (gate_set() == GPUOS_GATE_RESIDENT)
		return gpuos_res_need(p, n, stride, launch);
	if (__atomic_load_n(&fill_left, __ATOMIC_ACQUIRE))
		for (size_t i = 0; i < n; i++)
			fill_wait_ptr(*(const uint64_t *)((const char *)p + i * stride));
	return CUDA_SUCCESS;
}

CUresult gpuos_fill_wait_ptrs(const uint64_t *ptrs, size_t n)
{
	return wait_for(ptrs, n, sizeof *ptrs, 0);
}

CUresult gpuos_fill_wait_bufs(const struct gpuos_rec_buf *b, uint32_t n, uint16_t lflags)
{
	if (lflags & (GPUOS_LAUNCH_LAYOUT_UNKNOWN | GPUOS_LAUNCH_TOUCH_ALL | GPUOS_LAUNCH_TRUNCATED))
		return gpuos_fill_wait_all(lflags & GPUOS_LAUNCH_LAYOUT_UNKNOWN ? "a launch of unknown layout" :
					   lflags & GPUOS_LAUNCH_TOUCH_ALL ? "a launch that touches everything" :
									     "a launch with more buffers than recorded");
	return wait_for(&b->base, n, sizeof *b, 1);
}

/* FILL with GPUOS_AGENT_FILL_LATER: new memory for every allocation, its contents to come. */
static void do_fill_later(struct gpuos_agent_reply *r)
{
	if (!H.depth || !H.released)
		return say(r, EINVAL, H.depth ? "the memory is mapped" : "not held");
	uint64_t *left = H.n ? calloc(H.n, sizeof *left) : NULL;
	if (H.n && !left)
		return say(r, ENOMEM, "out of host memory");
	for (size_t i = map_next; i < H.n; i++) {
		CUresult c = remap_one(i, -1);
		if (c != CUDA_SUCCESS) {
			free(left);
			return say(r, c == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : EIO, "new memory for allocation %zu: %s", i,
				   cuerr(c));
		}
		map_next = i + 1;
	}
	for (int hk = 0; hk < HK_COUNT; hk++)
		hook_class[hk] = (uint8_t)gpuos_hook_fill_class(hk);
	pthread_mutex_lock(&fill_mu);
	fill_pending = 0;
	for (size_t i = 0; i < H.n; i++)
		fill_pending += !!(left[i] = gpuos_movable_reserved(&H.v[i]));
	fill_wanted = UINT64_MAX;
	fill_all_waits = 0;
	__atomic_store_n(&fill_left, fill_pending ? left : NULL, __ATOMIC_RELEASE);
	if (!fill_pending)
		free(left);
	pthread_mutex_unlock(&fill_mu);
	H.released = 0;
	map_next = 0;
	r->bytes = H.bytes;
}

/* The last allocation filled: nothing to wait for any more, the gate opens. */
static void fill_done_locked(void)
{
	free(fill_left);
	__atomic_store_n(&fill_left, NULL, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&fill_cv);
	if (gate_set() == GPUOS_GATE_FILLING)
		gate_open();
}

/* FILL_PARTS: `n` parts from the staging area into their allocations, then waited for. */
static void do_fill_parts(const struct gpuos_agent_part *p, size_t n, struct gpuos_agent_reply *r)
{
	if (!fill_left)
		return say(r, EINVAL, "nothing is being filled (FILL with GPUOS_AGENT_FILL_LATER first)");
	for (size_t k = 0; k < n; k++) {
		int shadow = p[k].flags == GPUOS_AGENT_PART_SHADOW;
		if (p[k].flags & ~GPUOS_AGENT_PART_SHADOW)
			return say(r, EINVAL, "part %zu: unknown flags %#x", k, p[k].flags);
		if (shadow && (!SH || sh_released))
			return say(r, EINVAL, "part %zu is from a shadow, and none is mapped", k);
		if (!shadow && !stage.p)
			return say(r, EINVAL, "not prepared");
		uint64_t room = shadow ? 0 : stage.size; /* a shadow part's stage must be 0 */
		if (p[k].index >= H.n || p[k].offset > gpuos_movable_reserved(&H.v[p[k].index]) ||
		    p[k].length > gpuos_movable_reserved(&H.v[p[k].index]) - p[k].offset ||
		    p[k].length > fill_left[p[k].index] || p[k].stage > room ||
		    (!shadow && p[k].length > stage.size - p[k].stage))
			return say(r, EINVAL, "part %zu (allocation %u, bytes %llu+%llu, staged at %llu) is out of bounds",
				   k, p[k].index, (unsigned long long)p[k].offset, (unsigned long long)p[k].length,
				   (unsigned long long)p[k].stage);
	}
	uint64_t t0 = gpuos_now_ns();
	CUresult res = CUDA_SUCCESS;
	uint64_t bytes = 0;
	for (size_t k = 0; k < n && res == CUDA_SUCCESS;) {
		/* the parts of one context in a row, on streams of the agent's own */
		uint64_t ctx = H.v[p[k].index].ctx;
		size_t end = k;
		while (end < n && H.v[p[end].index].ctx == ctx)
			end++;
		CUstream st[NSTREAMS] = { 0 };
		if ((res = gpuos_drv.ctx_push((CUcontext)(uintptr_t)ctx)) != CUDA_SUCCESS)
			break;
		res = streams_create(st);
		uint64_t q = 0;
		for (; k < end && res == CUDA_SUCCESS; k++) {
			uint64_t dev = H.v[p[k].index].base + p[k].offset;
			if (p[k].flags == GPUOS_AGENT_PART_SHADOW) { /* device to device: one copy */
				res = gpuos_drv.memcpy_dtod_async(dev, SH[p[k].index].va + p[k].offset, p[k].length,
								  st[q++ % NSTREAMS]);
				bytes += p[k].length;
				continue;
			}
			for (uint64_t o = 0, m; o < p[k].length && res == CUDA_SUCCESS; o += m, q++) {
				m = in_window(p[k].stage + o, p[k].length - o);
				res = gpuos_drv.memcpy_htod_async(dev + o, stage.p + p[k].stage + o, m, st[q % NSTREAMS]);
			}
			bytes += p[k].length;
		}
		res = streams_finish(st, res);
	}
	if (res != CUDA_SUCCESS)
		return say(r, EIO, "copy into the allocations: %s", cuerr(res));
	pthread_mutex_lock(&fill_mu);
	/* the allocation a thread waits for, unless these parts complete it */
	uint64_t wanted = fill_wanted;
	if (wanted != UINT64_MAX) {
		uint64_t left = fill_left[wanted];
		for (size_t k = 0; k < n; k++)
			if (p[k].index == wanted)
				left -= p[k].length < left ? p[k].length : left;
		if (!left)
			wanted = UINT64_MAX;
	}
	r->arg = wanted;
	r->count = fill_all_waits;
	if (fill_all_waits)
		snprintf(r->msg, sizeof r->msg, "%s", fill_all_why);
	fill_all_waits = 0;
	pthread_mutex_unlock(&fill_mu);
	r->bytes = bytes;
	r->ns = gpuos_now_ns() - t0;
}

/* FILL_PARTS' parts are counted filled, and their waiters woken, only once its reply is
 * sent: a waiter may end the process, and the client must have its answer first. */
static void fill_parts_count(const struct gpuos_agent_part *p, size_t n)
{
	pthread_mutex_lock(&fill_mu);
	for (size_t k = 0; fill_left && k < n; k++) {
		uint64_t *left = &fill_left[p[k].index];
		if (!*left)
			continue;
		/* saturating: overlapping parts (a client's bug) must not wrap an allocation
		 * round to "never filled" */
		*left -= p[k].length < *left ? p[k].length : *left;
		if (!*left)
			fill_pending--;
	}
	if (fill_left && fill_wanted != UINT64_MAX && !fill_left[fill_wanted])
		fill_wanted = UINT64_MAX;
	pthread_cond_broadcast(&fill_cv);
	if (fill_left && !fill_pending)
		fill_done_locked();
	pthread_mutex_unlock(&fill_mu);
}

/* ---- the socket ------------------------------------------------------------------------------ */

static int send_all(int fd, const void *buf, size_t n, const int *fds, size_t nfds)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * GPUOS_AGENT_FDS_PER_MSG)];
		struct cmsghdr align;
	} ctrl;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = n };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (nfds) {
		memset(&ctrl, 0, sizeof ctrl);
		msg.msg_control = ctrl.buf;
		msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	while (n) {
		ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		n -= (size_t)k;
		iov.iov_base = (char *)iov.iov_base + k;
		iov.iov_len = n;
		msg.msg_control = NULL; /* the descriptors went with the first bytes */
		msg.msg_controllen = 0;
	}
	return 0;
}

static void close_fds(int *fds, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (fds[i] >= 0)
			close(fds[i]);
}

static int do_export(int conn, uint64_t flags, struct gpuos_agent_reply *r)
{
	int shadows = !!(flags & GPUOS_AGENT_SHADOWS);
	if (!H.depth || H.released || (shadows && !SH)) {
		say(r, EINVAL, !H.depth ? "not held" : H.released ? "the memory is released" : "no snapshot");
		return send_all(conn, r, sizeof *r, NULL, 0);
	}
	int fds[GPUOS_AGENT_FDS_PER_MSG];
	size_t i = 0;
	do {
		size_t k = 0;
		for (; k < GPUOS_AGENT_FDS_PER_MSG && i < H.n; k++, i++) {
			int fd = -1;
			CUresult c = gpuos_drv.mem_export(&fd, shadows ? SH[i].h : H.v[i].aux,
							  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
			if (c != CUDA_SUCCESS) {
				close_fds(fds, k);
				say(r, EIO, "cuMemExportToShareableHandle of allocation %zu: %s", i, cuerr(c));
				r->count = 0;
				return send_all(conn, r, sizeof *r, NULL, 0);
			}
			fds[k] = fd;
		}
		r->count = (uint32_t)k;
		r->arg = i == H.n;
		int e = send_all(conn, r, sizeof *r, fds, k);
		close_fds(fds, k);
		if (e)
			return -1;
	} while (i < H.n);
	return 0;
}

static int check_peer(int conn)
{
	struct ucred cr;
	socklen_t len = sizeof cr;
	if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0)
		return -1;
	return cr.uid == 0 || cr.uid == getuid() ? 0 : -1;
}

/* One request with up to GPUOS_AGENT_FDS_PER_MSG descriptors: 1, 0 at EOF, -1 on error. */
static int recv_req(int conn, struct gpuos_agent_req *q, int *fds, size_t *nfds)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * GPUOS_AGENT_FDS_PER_MSG)];
		struct cmsghdr align;
	} ctrl;
	size_t got = 0;
	*nfds = 0;
	while (got < sizeof *q) {
		struct iovec iov = { .iov_base = (char *)q + got, .iov_len = sizeof *q - got };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl.buf,
				      .msg_controllen = sizeof ctrl.buf };
		ssize_t k = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return k == 0 && got == 0 ? 0 : -1;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
			if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
				size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
				for (size_t i = 0; i < n && *nfds < GPUOS_AGENT_FDS_PER_MSG; i++)
					memcpy(&fds[(*nfds)++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			}
		got += (size_t)k;
	}
	return q->magic == GPUOS_AGENT_MAGIC ? 1 : -1;
}

static int recv_all(int conn, void *buf, size_t n)
{
	for (size_t got = 0; got < n;) {
		ssize_t k = recv(conn, (char *)buf + got, n - got, 0);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		got += (size_t)k;
	}
	return 0;
}

static void serve(int conn)
{
	struct gpuos_agent_req q;
	int fds[GPUOS_AGENT_FDS_PER_MSG];
	size_t nfds;
	int k;
	while ((k = recv_req(conn, &q, fds, &nfds)) > 0) {
		struct gpuos_agent_part *parts = NULL; /* FILL_PARTS': counted after the reply */
		size_t nparts = 0;
		struct gpuos_agent_reply r;
		memset(&r, 0, sizeof r);
		r.magic = GPUOS_AGENT_MAGIC;
		int fd0 = nfds ? fds[0] : -1; /* PREPARE's memfd */
		switch (q.cmd) {
		case GPUOS_AGENT_HOLD: do_hold(q.arg, &r); break;
		case GPUOS_AGENT_RESUME: do_resume(q.arg, &r); break;
		case GPUOS_AGENT_FILL_PARTS: {
			size_t n = (size_t)q.arg;
			if (n > GPUOS_AGENT_PARTS_MAX) {
				say(&r, EINVAL, "FILL_PARTS of %zu parts: at most %d", n, GPUOS_AGENT_PARTS_MAX);
				close_fds(fds, nfds);
				send_all(conn, &r, sizeof r, NULL, 0);
				goto out; /* the parts that follow cannot be told from requests */
			}
			if (n && (!(parts = malloc(n * sizeof *parts)) || recv_all(conn, parts, n * sizeof *parts))) {
				free(parts);
				goto out;
			}
			do_fill_parts(parts, n, &r);
			if (!r.status)
				nparts = n;
			break;
		}
		case GPUOS_AGENT_LIST:
			if (!H.depth) {
				say(&r, EINVAL, "not held");
				break;
			}
			r.count = (uint32_t)H.n;
			r.bytes = H.bytes;
			break;
		case GPUOS_AGENT_PREPARE:
			if (fd0 < 0)
				say(&r, EINVAL, "PREPARE needs a memfd");
			else
				do_prepare(fd0, q.arg, &r);
			break;
		case GPUOS_AGENT_UNPREPARE: unprepare(); break;
		case GPUOS_AGENT_CAPTURE: do_capture(&r); break;
		case GPUOS_AGENT_SNAPSHOT: do_snapshot(&r); break;
		case GPUOS_AGENT_DROP: drop_shadows(); break;
		case GPUOS_AGENT_EXPORT:
			close_fds(fds, nfds);
			if (do_export(conn, q.arg, &r))
				goto out;
			continue;
		case GPUOS_AGENT_RELEASE: do_release(&r); break;
		case GPUOS_AGENT_MAP: do_map(fds, nfds, q.arg, &r); break;
		case GPUOS_AGENT_FILL: do_fill(q.arg, &r); break;
		case GPUOS_AGENT_MEM_STATS: r.count = 1; break;
		default: say(&r, EINVAL, "unknown command %u", q.cmd); break;
		}
		close_fds(fds, nfds);
		int unsent = send_all(conn, &r, sizeof r, NULL, 0);
		if (nparts)
			fill_parts_count(parts, nparts);
		free(parts);
		if (unsent)
			goto out;
		if (q.cmd == GPUOS_AGENT_LIST && r.status == 0 && H.n) {
			struct gpuos_agent_alloc *v = calloc(H.n, sizeof *v);
			if (!v)
				goto out;
			for (size_t i = 0; i < H.n; i++)
				v[i] = (struct gpuos_agent_alloc){ .base = H.v[i].base, .size = H.v[i].end - H.v[i].base,
								   .reserved = gpuos_movable_reserved(&H.v[i]),
								   .ctx = H.v[i].ctx, .device = H.v[i].device,
								   .last_use = __atomic_load_n(&H.v[i].last_use,
											       __ATOMIC_RELAXED) };
			int e = send_all(conn, v, H.n * sizeof *v, NULL, 0);
			free(v);
			if (e)
				goto out;
		}
		if (q.cmd == GPUOS_AGENT_MEM_STATS) {
			struct gpuos_res_stats st;
			gpuos_res_stats(&st);
			if (send_all(conn, &st, sizeof st, NULL, 0))
				goto out;
		}
	}
out:
	unprepare();
	if (SH && !sh_released)
		drop_shadows(); /* its client is gone: nobody will capture it */
	/* A client gone while its application is held: let the application go on, unless its
	 * memory is released (it exists only in what that client held).  Gone while filling:
	 * what is not filled yet existed only in what that client read; calls that need it
	 * keep waiting (gpuos recover ends a restore that did not complete). */
	if (H.depth && !H.released)
		resume_now();
}

static void *agent_main(void *arg)
{
	int lfd = (int)(intptr_t)arg;
	tls_is_agent = 1;
	for (;;) {
		int conn = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
		if (conn < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			usleep(100000);
			continue;
		}
		if (check_peer(conn) == 0)
			serve(conn);
		close(conn);
	}
	return NULL;
}

int gpuos_agent_start(void)
{
	membarrier_ok = syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, GPUOS_AGENT_NAME "%d", (int)getpid());
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return errno;
	if (bind(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) < 0 ||
	    listen(fd, 4) < 0) {
		int e = errno;
		close(fd);
		return e;
	}
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old); /* the application's signals are not ours */
	pthread_t t;
	int e = pthread_create(&t, &at, agent_main, (void *)(intptr_t)fd);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&at);
	if (e) {
		close(fd);
		return e;
	}
	pthread_setname_np(t, "gpuos-agent");
	return 0;
}

/* fork child: one thread, no agent (gpuos run's child processes start their own when
 * they start tracking), the gate open. */
void gpuos_agent_forget(void)
{
	memset(slots, 0, sizeof slots);
	tls_slot = NULL;
	tls_overflow = 0;
	overflow_inside = 0;
	pthread_once(&slot_key_once, make_slot_key);
	pthread_setspecific(slot_key, NULL);
	pthread_mutex_init(&gate_mu, NULL);
	pthread_cond_init(&gate_cv, NULL);
	gpuos_hot.gate = 0;
	free(H.v);
	memset(&H, 0, sizeof H);
	map_next = 0;
	pthread_mutex_init(&fill_mu, NULL);
	pthread_cond_init(&fill_cv, NULL);
	free(fill_left); /* the child's copies of the parent's memory: its own, all there */
	fill_left = NULL;
	fill_pending = 0;
	free(SH);
	SH = NULL;
	sh_released = 0;
	sh_map_next = 0;
	stage_ctx = 0;
}
