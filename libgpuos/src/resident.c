/* SPDX-License-Identifier: MIT */
/*
 * resident.c - GPU memory oversubscription: movable memory made resident before the
 * calls that touch it, within a limit (`gpuos run --gpu-memory LIMIT`, GPUOS_GPU_MEMORY).
 *
 * Under a limit a movable allocation (memory.c) is only its reserved address range until
 * a call touches it.  Its physical memory then comes from a pool of at most LIMIT bytes.
 * When the pool is full, resident allocations the call does not touch are evicted:
 * copied to pinned host memory (kept for the allocation's life: pinning costs far more
 * than copying), unmapped and released.  The next call that touches one maps new memory
 * at the same address and copies its contents back.  The application's pointers never
 * change.
 *
 * While all allocations fit under the limit, their memory is made at once and nothing
 * is checked: the process runs as with plain movable memory.  From the first one that
 * does not fit, gpuos_hot.gate rests at GPUOS_GATE_RESIDENT (set once every call that
 * passed it open has returned, agent.c), so every wrapper passes the gate's slow path.
 * What a call touches is libgpuos's prediction, made before the real call (the path an
 * on-demand restore uses); a launch, copy or memset has its
 * allocations made resident (gpuos_res_need) before its real call, and anything that
 * may touch any allocation (a graph launch, a batched copy, a stream memory operation, a
 * launch of unknown layout) needs all of them resident.  If they cannot all fit, that
 * is said on stderr and counted: a misprediction is never silent.  The lock is held
 * from the first need until the outermost wrapper returns, so an eviction by another
 * thread cannot come between a call's residency and its submission; an eviction waits
 * for the context's work first, as cuMemFree does.
 *
 * Eviction by the known future.  Each call that needs memory is a tick; its signature is
 * a hash of the allocations it needs.  Training steps and decode loops repeat the same
 * calls, so the signatures repeat with a period P (in ticks), found online: the lags to
 * the last 8 ticks with the same signature are candidates, one kept once the 64 ticks
 * before agree at that lag, dropped after 8 that do not.  With P known, an allocation's next use is estimated
 * from its own recent uses one period back (its first use after t - P, plus P), and the
 * resident allocation used farthest in the future is evicted (Belady's choice); one
 * unused for a whole period goes first.  Without P, the least recently used goes, and the
 * stats say so (period 0).  GPUOS_GPU_MEMORY_EVICT=lru keeps LRU (the baseline).
 * Copies run on a stream of gpuos's own per context, one synchronisation per batch.
 *
 * Copies ahead.  With a period learned (and no group), each call, after its own copies,
 * brings in the evicted allocations the sequence will use next (within a period,
 * soonest first, at most AHEAD_MAX), into free room or the room of resident ones the
 * sequence does not use for a period.  Never by evicting one it still uses: the call
 * in progress holds the allocation Belady would evict (the one just used), and evicting
 * the next farthest instead turns a cycle into a sliding window that moves everything
 * every period (measured: as many bytes as LRU).  These copies are not waited for: they
 * run on gpuos's stream while the call's own work runs, and an event after them is
 * waited for only by a call that needs one of them before they are done (or by a free).
 *
 * In a group (share.c), a call whose memory is resident goes on at once, and so does one
 * that fits in the pool's free room while no member waits for the GPU, is asked to evict,
 * or is making room as its holder: members run side by side while their memory fits
 * together.  Any other call waits for the GPU's turn, and runs again from its marks
 * (same tick) once it has it.
 *
 * A call that begins a turn taken from another member brings back,
 * besides its own memory, what this process used in its last turn, as one batch: the
 * others evict for all of it at once.  Batches stop while their memory is evicted again
 * unused more often than used.
 *
 * Host memory is prepared ahead.  Pinning runs at the speed the kernel hands out zeroed
 * pages (1.3-2 GB/s in the GPU machines' VMs): a member of a group that had never been
 * evicted took 6 s to pin the host copy of 15 GB while the member whose turn it was
 * waited.  Once the process is oversubscribed (or in a group), a thread of its own pins
 * host memory for allocations that have none, outside the lock, huge pages asked for
 * (several times faster to fault in), and hands it over; host_prepared counts it.  Alone,
 * until the allocations with host memory cover the excess over the limit; in a group,
 * all of them.  An eviction that finds none pins its own as before.
 *
 * Only what changed is copied out.  A victim is hashed on the GPU first (fingerprint.cu:
 * 64 bits per 4 KiB chunk, at memory speed, far above the copy's), and the hashes are
 * kept with its host copy; at its next eviction, only the chunks whose hash differs from
 * the kept one are copied (runs a little apart merged into one copy).  Weights an
 * inference only reads are copied out once.  Where the hashes cannot be had (no memory
 * for them, the module cannot be loaded), everything is copied and the kept hashes are
 * dropped: they would no longer describe the host copy.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"
#include "gpuos_agent.h"
#include "usdt.h"

#define MAX_CTX 16
#define USES 64          /* recent use ticks kept per allocation */
#define SIGS (1u << 16)  /* call signatures kept: the longest period learned */
#define SEEN (1u << 14)  /* distinct signatures remembered */
#define LAGS 8           /* ticks remembered per signature: candidate periods */
#define CONFIRM 64       /* ticks that must agree at a lag before it is the period */
#define DOUBTS 8         /* ticks in a row that disagree before it is dropped */
#define CHUNK ((uint64_t)GPUOS_VALIDATE_CHUNK) /* fingerprinted bytes per hash */
#define EVICT_BATCH 64   /* allocations evicted at once, at most */
#define AHEAD_MAX 16     /* allocations brought in ahead of their use at once, at most */
#define TIMED_BATCHES 4  /* batches of copies ahead timed at once, per context */
#define TURN_TRIES 16    /* allocations a turn's batches may bring in unused before they stop */
#define GAP_CHUNKS 16    /* changed chunks at most this far apart are copied as one run */

struct res {
	uint64_t base;
	uint64_t size;                  /* the reservation: what residency costs */
	uint64_t ctx;
	int32_t device;
	uint32_t call;                  /* the call in progress needs it (== R.call) */
	CUmemGenericAllocationHandle h; /* 0: not resident */
	void *host;                     /* its contents while evicted (NULL: never evicted) */
	int host_pinned;
	int has_content;                /* evicted after use: host holds the contents */
	uint64_t *ref;                  /* the host copy's chunk hashes (NULL: not known) */
	int ahead;                      /* brought in ahead of its use, not used since */
	int in_flight;                  /* ... its copy may still run: done when ahead_ev is */
	CUevent ahead_ev;
	int turn;                       /* in the batch of a turn beginning */
	uint64_t tick;                  /* the last call that needed it */
	uint64_t uses[USES];            /* ring: the ticks of its last USES uses */
	uint32_t nuse;                  /* uses recorded (uses[nuse % USES] is the next slot) */
};

static struct {
	pthread_mutex_t mu;
	struct res *v;
	size_t n, cap;
	uint64_t limit;     /* bytes; 0: off */
	uint64_t tick;
	uint32_t call;
	uint64_t sig;               /* the call in progress: hash of what it needs */
	uint32_t ticked;            /* the call that took the last tick (R.call: this one) */
	uint32_t swapped;           /* the call that last brought memory in (R.call: this one) */
	int lru_only;               /* GPUOS_GPU_MEMORY_EVICT=lru */
	uint64_t period;            /* learned, in ticks; 0: none (LRU) */
	uint32_t doubts;
	uint64_t sigs[SIGS];        /* signature of tick t at t % SIGS */
	struct { uint64_t sig, ticks[LAGS]; uint32_t n; } seen[SEEN]; /* hash table: a signature
				    * and the last ticks it was seen at */
	int oversubscribed;         /* the allocations outgrew the limit: calls are checked */
	int shared;                 /* in a group (share.c): its pool is the limit, calls always checked */
	int turn_begins;            /* this call begins a turn on the GPU taken from another member */
	uint64_t turn_tick;         /* the tick the last turn began at */
	uint64_t turn_tick_before;  /* ... and the one before it */
	struct swap_ctx {
		uint64_t ctx;       /* its id (ctx_key) */
		CUstream s;         /* NULL: free slot */
		struct gpuos_fp_hasher fp; /* loaded at the first eviction (broken: copy everything) */
		CUevent ahead;      /* recorded after the last copies ahead (NULL: none made yet) */
		/* batches of copies ahead timed on the GPU (their copies are never waited for
		 * as they run): events around each, read once both have passed */
		struct timed_batch {
			CUevent start, end; /* timing events (NULL: not made yet) */
			uint64_t bytes;
			int pending;        /* recorded, not read yet */
		} timed[TIMED_BATCHES];
		struct timed_batch *open; /* the batch being issued, its start recorded */
		int began;                /* a batch is being issued (timed or not) */
		CUevent out_ends[EVICT_BATCH]; /* after each victim's copy-out (evict_batch) */
		int out_ends_made;        /* 1: made; -1: could not be */
	} swap[MAX_CTX];
	pthread_cond_t prepare;     /* signalled when an allocation may need host memory prepared */
	int preparer;               /* 1: its thread runs; -1: it failed for good */
	uint64_t *h_hash;           /* the batch's hashes, read back */
	uint64_t h_cap;
	struct gpuos_res_stats st;
} R = { .mu = PTHREAD_MUTEX_INITIALIZER, .prepare = PTHREAD_COND_INITIALIZER };

static int limit_read = 0; /* atomic: 0 not yet, 1 read */
GPUOS_TLS int gpuos_tls_res_held;

uint64_t gpuos_res_limit(void)
{
	if (__atomic_load_n(&limit_read, __ATOMIC_ACQUIRE))
		return R.limit;
	pthread_mutex_lock(&R.mu);
	if (!limit_read) {
		const char *e = getenv("GPUOS_GPU_MEMORY");
		if (e && *e) { /* bytes: `gpuos run --gpu-memory` parses what the user wrote */
			char *end;
			errno = 0;
			R.limit = strtoull(e, &end, 10);
			if (errno || *end || !R.limit) {
				R.limit = 0;
				fprintf(stderr, "gpuos: GPUOS_GPU_MEMORY=%s is not a number of bytes; no limit\n", e);
			}
		}
		const char *share = getenv("GPUOS_SHARE");
		if (R.limit && share && *share && !gpuos_share_join(share, &R.limit))
			R.shared = 1;
		R.st.limit = R.limit;
		const char *ev = getenv("GPUOS_GPU_MEMORY_EVICT");
		R.lru_only = ev && !strcmp(ev, "lru");
		R.st.lru_only = (uint64_t)R.lru_only;
		__atomic_store_n(&limit_read, 1, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&R.mu);
	return R.limit;
}

/* r's physical memory unmapped and given back to the driver: it is no longer resident
 * (its room is the caller's to give back). */
static void unmap_res(struct res *r)
{
	gpuos_drv.mem_unmap(r->base, r->size);
	gpuos_drv.mem_release(r->h);
	r->h = 0;
	R.st.resident_bytes -= r->size;
}

/* The lock outside a call's need (this thread may hold it already: a nested wrapper). */
static int lock_unless_held(void)
{
	if (gpuos_tls_res_held)
		return 0;
	pthread_mutex_lock(&R.mu);
	return 1;
}

static void unlock_if(int locked)
{
	if (locked)
		pthread_mutex_unlock(&R.mu);
}

static ssize_t find(uint64_t p) /* the entry holding p, or -1 (R.mu held) */
{
	size_t lo = 0, hi = R.n;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (p < R.v[mid].base)
			hi = mid;
		else if (p >= R.v[mid].base + R.v[mid].size)
			lo = mid + 1;
		else
			return (ssize_t)mid;
	}
	return -1;
}

/* Room for `bytes` more resident, charged to the group if there is one. */
static int take_room(uint64_t bytes)
{
	if (R.shared)
		return gpuos_share_take(bytes);
	return R.st.resident_bytes + bytes <= R.limit;
}

static void give_room(uint64_t bytes)
{
	if (R.shared && bytes)
		gpuos_share_give(bytes);
}

/* New physical memory at base; in a group, a member that just exited may still be
 * giving its memory back to the driver: wait for it a little. */
static CUresult map_new(uint64_t base, uint64_t size, int device, CUmemGenericAllocationHandle *h,
			struct gpuos_map_times *t)
{
	CUresult c = gpuos_movable_map_timed(base, size, device, h, t);
	for (int i = 0; R.shared && c == CUDA_ERROR_OUT_OF_MEMORY && i < 200; i++) {
		usleep(10000);
		c = gpuos_movable_map_timed(base, size, device, h, t);
	}
	return c;
}

static void prepare_host(void);

int gpuos_res_add(uint64_t base, uint64_t size, int device, uint64_t ctx)
{
	int locked = lock_unless_held();
	if (R.n == R.cap) {
		size_t cap = R.cap ? 2 * R.cap : 64;
		struct res *v = realloc(R.v, cap * sizeof *v);
		if (!v) {
			unlock_if(locked);
			return -1;
		}
		R.v = v;
		R.cap = cap;
	}
	/* While everything fits, memory is made at once and no call is checked: the process
	 * runs as under plain movable memory.  The first allocation that does not fit turns
	 * the checks on, for good. */
	CUmemGenericAllocationHandle h = 0;
	int flip = 0;
	if (!R.oversubscribed && (R.shared || R.st.reserved_bytes + size > R.limit))
		R.oversubscribed = flip = 1; /* a group's pool is anyone's: always checked */
	/* In a group, memory is made at first use, under the pool's rules (bring_in): one
	 * that waits must not take what the holder has just had evicted for itself. */
	if (!R.oversubscribed || (!R.shared && take_room(size))) {
		if (map_new(base, size, device, &h, NULL) != CUDA_SUCCESS) {
			unlock_if(locked);
			return -1;
		}
		R.st.resident_bytes += size;
	}
	size_t i = R.n;
	while (i && R.v[i - 1].base > base)
		i--;
	memmove(&R.v[i + 1], &R.v[i], (R.n - i) * sizeof *R.v);
	R.v[i] = (struct res){ .base = base, .size = size, .ctx = ctx, .device = device, .h = h };
	R.n++;
	R.st.allocations++;
	R.st.reserved_bytes += size;
	if (R.st.reserved_bytes > R.st.reserved_peak)
		R.st.reserved_peak = R.st.reserved_bytes;
	if (R.shared)
		gpuos_share_reserved((int64_t)size);
	prepare_host();
	unlock_if(locked);
	if (flip)
		gpuos_gate_resident(); /* not under the lock: a thread it waits for may want it */
	return 0;
}

static void drop_host(struct res *r)
{
	if (!r->host)
		return;
	if (r->host_pinned && gpuos_drv.mem_host_unregister)
		gpuos_drv.mem_host_unregister(r->host);
	munmap(r->host, r->size);
	r->host = NULL;
	r->has_content = 0;
	free(r->ref);
	r->ref = NULL;
}

CUmemGenericAllocationHandle gpuos_res_forget(uint64_t base)
{
	int locked = lock_unless_held();
	ssize_t i = find(base);
	CUmemGenericAllocationHandle h = 0;
	if (i >= 0) {
		struct res *r = &R.v[i];
		if (r->in_flight)
			gpuos_drv.event_sync(r->ahead_ev); /* its copy ahead must end before it is unmapped */
		h = r->h;
		if (h) {
			R.st.resident_bytes -= r->size;
			give_room(r->size);
		}
		if (R.shared)
			gpuos_share_reserved(-(int64_t)r->size);
		R.st.allocations--;
		R.st.reserved_bytes -= r->size;
		if (r->has_content && !h)
			R.st.evicted_bytes -= r->size;
		drop_host(r);
		memmove(r, r + 1, (R.n - (size_t)i - 1) * sizeof *r);
		R.n--;
	}
	unlock_if(locked);
	return h;
}

/* The current context's unique id (a destroyed context's handle can come back for a new
 * one; its id does not), else its handle. */
static uint64_t ctx_key(void)
{
	CUcontext c = NULL;
	unsigned long long id;
	if (gpuos_drv.ctx_get_current && gpuos_drv.ctx_get_current(&c) == CUDA_SUCCESS && c &&
	    gpuos_drv.ctx_get_id && gpuos_drv.ctx_get_id(c, &id) == CUDA_SUCCESS)
		return id;
	return (uint64_t)(uintptr_t)c;
}

/* gpuos's copy stream and fingerprint state in the current context (made at its first
 * use), or NULL: more contexts than slots, or no stream (the legacy stream is used,
 * synchronised all the same, and everything is copied). */
static struct swap_ctx *swap_ctx(void)
{
	uint64_t ctx = ctx_key();
	for (int i = 0; i < MAX_CTX; i++) {
		struct swap_ctx *sc = &R.swap[i];
		if (sc->s && sc->ctx == ctx)
			return sc;
		if (!sc->s) {
			if (!gpuos_drv.stream_create || gpuos_drv.stream_create(&sc->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
				sc->s = NULL;
				return NULL;
			}
			sc->ctx = ctx;
			return sc;
		}
	}
	return NULL;
}

static CUstream swap_stream(struct swap_ctx *sc)
{
	return sc ? sc->s : NULL;
}

static uint64_t chunks(uint64_t size)
{
	return (size + CHUNK - 1) / CHUNK;
}

/* The victims' chunk hashes, in victim order, read back to R.h_hash (the context is
 * synchronised: their contents are final), or NULL if they cannot be had. */
static const uint64_t *hash_victims(struct swap_ctx *sc, struct res *const *victims, size_t nv)
{
	if (!sc || sc->fp.broken || !gpuos_drv.mem_alloc || !gpuos_drv.mem_free || !gpuos_drv.launch_kernel)
		return NULL;
	struct gpuos_fp_seg segs[EVICT_BATCH];
	uint64_t n = 0;
	for (size_t k = 0; k < nv; k++) {
		segs[k] = (struct gpuos_fp_seg){ .base = victims[k]->base, .size = victims[k]->size, .first_chunk = n };
		n += chunks(victims[k]->size);
	}
	if (n > R.h_cap) {
		uint64_t *h = realloc(R.h_hash, n * 8);
		if (!h)
			return NULL;
		R.h_hash = h;
		R.h_cap = n;
	}
	if (gpuos_fp_hasher_run(&sc->fp, segs, nv, R.h_hash, n, sc->s)) {
		if (sc->fp.broken)
			fprintf(stderr, "gpuos: the fingerprint kernel cannot be loaded; evictions copy everything out\n");
		return NULL;
	}
	return R.h_hash;
}

/* Copy out what of r changed since its host copy was made (all of it without hashes
 * or a kept copy's); the bytes copied. */
static CUresult copy_out(struct res *r, const uint64_t *hashes, CUstream s, uint64_t *copied)
{
	if (!hashes || !r->ref || !r->has_content) {
		*copied = r->size;
		return gpuos_drv.memcpy_dtoh_async(r->host, r->base, r->size, s);
	}
	uint64_t n = chunks(r->size), i = 0;
	*copied = 0;
	while (i < n) {
		if (hashes[i] == r->ref[i]) {
			i++;
			continue;
		}
		uint64_t last = i; /* the run's last changed chunk */
		for (uint64_t j = i + 1; j < n && j <= last + GAP_CHUNKS; j++)
			if (hashes[j] != r->ref[j])
				last = j;
		uint64_t off = i * CHUNK, end = (last + 1) * CHUNK < r->size ? (last + 1) * CHUNK : r->size;
		CUresult c = gpuos_drv.memcpy_dtoh_async((char *)r->host + off, r->base + off, end - off, s);
		if (c != CUDA_SUCCESS)
			return c;
		*copied += end - off;
		i = last + 1;
	}
	return CUDA_SUCCESS;
}

/* After r's copy-out: its kept hashes are those of the new host copy (dropped when they
 * are not known). */
static void keep_hashes(struct res *r, const uint64_t *hashes)
{
	if (hashes && !r->ref)
		r->ref = malloc(chunks(r->size) * 8);
	if (hashes && r->ref) {
		memcpy(r->ref, hashes, chunks(r->size) * 8);
		return;
	}
	free(r->ref);
	r->ref = NULL;
}

/* `size` bytes of host memory for an allocation's contents, huge pages asked for, pinned
 * if the driver lets it (*pinned; else pageable: slower); NULL if there is none. */
static void *host_memory(uint64_t size, int *pinned)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return NULL;
	madvise(p, size, MADV_HUGEPAGE); /* (where THP is "madvise"; failing, small pages) */
	*pinned = gpuos_drv.mem_host_register &&
		  gpuos_drv.mem_host_register(p, size, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
	return p;
}

/* Host memory for r's contents (R.mu held), unless it has some (prepared ahead, or kept
 * from an earlier eviction). */
static int host_for(struct res *r)
{
	if (r->host)
		return 0;
	r->host = host_memory(r->size, &r->host_pinned);
	if (!r->host)
		return -1;
	if (!r->host_pinned)
		R.st.pageable_hosts++;
	return 0;
}

/* The thread that prepares host memory ahead (the top comment): one allocation at a time,
 * pinned outside the lock in the allocation's context, handed over if the allocation is
 * still there without host memory.  It stops for good at the first that cannot be pinned
 * (evictions then make their own, as without it). */
static void *prepare_main(void *arg)
{
	(void)arg;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL); /* the application's signals are not ours */
	pthread_mutex_lock(&R.mu);
	for (;;) {
		/* Alone, at most the excess over the limit is evicted at once: that much host
		 * memory, not the whole footprint (pinned memory cannot be swapped: a process
		 * of 80 GB under a 75 GB limit pins 5 GB ahead, not 80).  In a group, all of a
		 * member's memory may have to leave for another's turn. */
		uint64_t hosted = 0, need = R.shared ? R.st.reserved_bytes
				  : R.st.reserved_bytes > R.limit ? R.st.reserved_bytes - R.limit : 0;
		struct res *r = NULL;
		for (size_t i = 0; i < R.n; i++) {
			hosted += R.v[i].host ? R.v[i].size : 0;
			r = r || R.v[i].host ? r : &R.v[i];
		}
		if (!r || hosted >= need) {
			pthread_cond_wait(&R.prepare, &R.mu);
			continue;
		}
		uint64_t base = r->base, size = r->size, ctx = r->ctx;
		pthread_mutex_unlock(&R.mu);
		int pinned = 0;
		void *p = NULL;
		if (gpuos_drv.ctx_push && gpuos_drv.ctx_push((CUcontext)(uintptr_t)ctx) == CUDA_SUCCESS) {
			p = host_memory(size, &pinned);
			CUcontext popped;
			gpuos_drv.ctx_pop(&popped);
		}
		pthread_mutex_lock(&R.mu);
		ssize_t i = p && pinned ? find(base) : -1;
		if (i >= 0 && R.v[i].base == base && R.v[i].size == size && !R.v[i].host) {
			R.v[i].host = p;
			R.v[i].host_pinned = 1;
			R.st.host_prepared += size;
			continue;
		}
		if (p) { /* freed meanwhile, or an eviction made its own */
			if (pinned)
				gpuos_drv.mem_host_unregister(p);
			munmap(p, size);
		}
		if (!p || !pinned)
			break;
	}
	R.preparer = -1;
	pthread_mutex_unlock(&R.mu);
	return NULL;
}

/* An allocation may lack host memory while the process is oversubscribed (R.mu held). */
static void prepare_host(void)
{
	if (!R.oversubscribed || R.preparer < 0)
		return;
	if (R.preparer) {
		pthread_cond_signal(&R.prepare);
		return;
	}
	pthread_t t;
	if (pthread_create(&t, NULL, prepare_main, NULL)) {
		R.preparer = -1;
		return;
	}
	pthread_detach(t);
	R.preparer = 1;
}

/* How good a victim r is (larger: better).  With a period: the ticks until its estimated
 * next use (its first use after now - P, plus P; UINT64_MAX - 1 if it was not used in the
 * last period); used at least USES times in that period, it is hot (0).  Without one:
 * the ticks since its last use (LRU). */
static uint64_t victim_score(const struct res *r)
{
	uint64_t t = R.tick, p = R.period;
	if (!p)
		return t - r->tick;
	if (!r->nuse || r->tick + p <= t)
		return UINT64_MAX - 1;
	uint32_t kept = r->nuse < USES ? r->nuse : USES;
	uint64_t first = UINT64_MAX; /* its earliest kept use after t - p */
	for (uint32_t k = 0; k < kept; k++) {
		uint64_t u = r->uses[k];
		if (u + p > t && u < first)
			first = u;
	}
	if (kept == USES && first == r->uses[r->nuse % USES])
		return 0; /* even its oldest kept use is within the period: used too often to tell */
	return first + p - t;
}

/* The call in progress (tick t, signature R.sig): learn or check the period. */
static void learn_period(void)
{
	uint64_t t = R.tick, s = R.sig;
	R.sigs[t % SIGS] = s;
	if (R.period) {
		if (t >= R.period && R.sigs[(t - R.period) % SIGS] == s)
			R.doubts = 0;
		else if (++R.doubts >= DOUBTS)
			R.period = 0;
	}
	/* Candidates: the lags to this signature's last LAGS ticks (a signature that comes
	 * back several times a period, as one of a segment many kernels use does, still has
	 * its occurrence one period back among them, if fewer than LAGS came since). */
	size_t h = (size_t)(s * 0x9e3779b97f4a7c15ull >> 50) % SEEN;
	for (int probe = 0; probe < 8; probe++, h = (h + 1) % SEEN) {
		if (R.seen[h].n && R.seen[h].sig != s)
			continue;
		uint32_t kept = R.seen[h].n < LAGS ? R.seen[h].n : LAGS;
		for (uint32_t k = 0; !R.period && k < kept; k++) {
			uint64_t lag = t - R.seen[h].ticks[k];
			if (lag >= SIGS - CONFIRM || t <= lag + CONFIRM)
				continue;
			int agree = 1;
			for (uint64_t j = 1; agree && j <= CONFIRM; j++)
				agree = R.sigs[(t - j) % SIGS] == R.sigs[(t - j - lag) % SIGS];
			if (agree) {
				R.period = lag;
				R.doubts = 0;
			}
		}
		R.seen[h].sig = s;
		R.seen[h].ticks[R.seen[h].n++ % LAGS] = t;
		break;
	}
	R.st.period = R.period;
}

/* The resident allocation of context ctx that the call does not need, used farthest
 * ahead (victim_score), not taken yet; NULL if none.  *score: its score. */
static struct res *best_victim(uint64_t ctx, uint64_t *score)
{
	struct res *best = NULL;
	for (size_t i = 0; i < R.n; i++) {
		struct res *r = &R.v[i];
		if (!r->h || r->call == R.call || r->tick == UINT64_MAX || r->ctx != ctx)
			continue;
		uint64_t sc = victim_score(r);
		if (!best || sc > *score) {
			best = r;
			*score = sc;
		}
	}
	return best;
}

/* sc's events for the end of each victim's copy-out (NULL: none, the stream is waited
 * for instead). */
static CUevent *copy_out_events(struct swap_ctx *sc)
{
	if (!sc || sc->out_ends_made < 0 || !gpuos_drv.event_create || !gpuos_drv.event_record ||
	    !gpuos_drv.event_sync)
		return NULL;
	for (int i = 0; !sc->out_ends_made && i < EVICT_BATCH; i++)
		if (gpuos_drv.event_create(&sc->out_ends[i], CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
			sc->out_ends_made = -1;
			return NULL;
		}
	sc->out_ends_made = 1;
	return sc->out_ends;
}

/* Evict up to EVICT_BATCH resident allocations of the current context that the call does
 * not need, the best victims first (victim_score), and only those scoring above *above
 * (NULL: any), as one batch, until `excess` bytes are freed.  0, or -1 if there is none
 * to evict (or a step failed). */
static int evict_batch(uint64_t excess, const uint64_t *above)
{
	struct res *victims[EVICT_BATCH];
	size_t nv = 0;
	uint64_t freed = 0, score = 0;
	/* Only the current context's: its synchronisation covers their work (a process with
	 * memory in several contexts makes room in each from a call of that context). */
	uint64_t ctx = gpuos_current_ctx();
	struct res *best;
	while (freed < excess && nv < EVICT_BATCH && (best = best_victim(ctx, &score)) != NULL &&
	       (!above || score > *above)) {
		victims[nv++] = best;
		freed += best->size;
		best->tick = UINT64_MAX; /* taken (set again below) */
	}
	if (!nv)
		return -1;
	/* The victims may still be in use by work already submitted, on any stream. */
	int ok = !gpuos_drv.ctx_sync || gpuos_drv.ctx_sync() == CUDA_SUCCESS;
	struct swap_ctx *sc = swap_ctx();
	CUstream s = swap_stream(sc);
	uint64_t t0 = gpuos_now_ns(), copied = 0, released = 0;
	const uint64_t *hashes = ok ? hash_victims(sc, victims, nv) : NULL;
	uint64_t out[EVICT_BATCH] = {0};
	CUevent *ends = ok ? copy_out_events(sc) : NULL;
	for (size_t k = 0, first = 0; ok && k < nv; first += chunks(victims[k]->size), k++) {
		struct res *r = victims[k];
		ok = !host_for(r) && copy_out(r, hashes ? hashes + first : NULL, s, &out[k]) == CUDA_SUCCESS;
		if (ok && ends && out[k] && gpuos_drv.event_record(ends[k], s) != CUDA_SUCCESS)
			ends = NULL; /* wait for the stream instead */
	}
	if (ok && !ends)
		ok = gpuos_drv.stream_sync(s) == CUDA_SUCCESS;
	/* Each victim's room is given back as its copy ends, those with nothing to copy
	 * first, not when the batch's last copy does: a member waiting for room (a group's
	 * holder at its turn's start) copies in meanwhile, PCIe carrying both directions. */
	for (int dirty = 0; dirty < 2; dirty++)
		for (size_t k = 0, first = 0; k < nv; first += chunks(victims[k]->size), k++) {
			struct res *r = victims[k];
			if (!!out[k] != dirty)
				continue;
			if (ok && ends && out[k])
				ok = gpuos_drv.event_sync(ends[k]) == CUDA_SUCCESS;
			r->tick = r->uses[(r->nuse + USES - 1) % USES]; /* its last use, as it was */
			/* A failed batch may have copied part: the kept hashes no longer describe the
			 * host copy (r stays resident, its contents where they were). */
			keep_hashes(r, ok && hashes ? hashes + first : NULL);
			if (!ok)
				continue;
			uint64_t t1 = gpuos_now_ns();
			unmap_res(r);
			R.st.release_ns += gpuos_now_ns() - t1;
			r->has_content = 1;
			GPUOS_USDT3(evict, r->base, r->size, out[k]);
			R.st.evicted_bytes += r->size;
			R.st.evictions_future += !!R.period;
			R.st.evictions++;
			R.st.ahead_unused += r->ahead;
			r->ahead = r->in_flight = 0;
			copied += out[k];
			released += r->size;
			give_room(r->size);
		}
	R.st.bytes_out += copied;
	R.st.clean_bytes += released - copied;
	R.st.out_ns += gpuos_now_ns() - t0;
	return ok ? 0 : -1;
}

/* Room for `want` more resident bytes (charged to the group if there is one): 0, or -1.
 * In a group the others are asked first: their memory is needed after this slice; this
 * process's own is evicted only if `own` (a turn's batch must not evict its own working
 * set). */
static int make_room(uint64_t want, int own)
{
	while (!take_room(want)) {
		uint64_t used = R.shared ? gpuos_share_used() : R.st.resident_bytes;
		if (used + want <= R.limit)
			continue; /* room came back meanwhile */
		uint64_t excess = used + want - R.limit;
		if (R.shared && gpuos_share_ask(excess, want))
			continue;
		if (!own || evict_batch(excess, NULL)) {
			if (R.shared)
				gpuos_share_unclaim();
			return -1;
		}
	}
	return 0;
}

/* `bytes` of the room a group's holder claimed for its turn (`claim`: what is left of the
 * claim, these included), once the evictions under way have made it: 0, or -1 if none
 * under way will (nothing taken). */
static int turn_take(uint64_t bytes, uint64_t claim)
{
	while (!take_room(bytes))
		if (!gpuos_share_ask_claim(0, bytes, claim))
			return -1;
	return 0;
}

/* A turn's start (a group's holder): the others asked at once for the room of this call's
 * memory and the turn's batch (`total`), claimed whole; this call's part (`want`) taken as
 * soon as it is made, the batch's later, part by part (turn_take).  0, or -1 (nothing
 * taken, nothing claimed). */
static int turn_room(uint64_t want, uint64_t total)
{
	uint64_t used = gpuos_share_used();
	if (used + total > R.limit)
		gpuos_share_ask_claim(used + total - R.limit, 0, total); /* asks; waits for none */
	if (turn_take(want, total) == 0)
		return 0;
	gpuos_share_unclaim();
	return -1;
}

/* The timings of sc's batches that have passed: bytes and GPU time into the stats. */
static void batches_read(struct swap_ctx *sc)
{
	for (int i = 0; i < TIMED_BATCHES; i++) {
		struct timed_batch *b = &sc->timed[i];
		if (!b->pending || gpuos_drv.event_query(b->end) == CUDA_ERROR_NOT_READY)
			continue;
		float ms = 0;
		if (gpuos_drv.event_elapsed(&ms, b->start, b->end) == CUDA_SUCCESS && ms > 0) {
			R.st.batch_bytes += b->bytes;
			R.st.batch_ns += (uint64_t)((double)ms * 1e6);
		}
		b->pending = 0;
	}
}

/* Before the first copy of a batch of copies ahead on sc's stream s: its start recorded,
 * if a timing slot is free (else the batch goes untimed: nothing waits for a slot). */
static void batch_begin(struct swap_ctx *sc, CUstream s)
{
	if (sc->began || !gpuos_drv.event_elapsed)
		return; /* (a batch untimed at its first copy stays so: its bytes are all of it) */
	sc->began = 1;
	batches_read(sc);
	for (int i = 0; i < TIMED_BATCHES; i++) {
		struct timed_batch *b = &sc->timed[i];
		if (b->pending)
			continue;
		if (!b->start && gpuos_drv.event_create(&b->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
			b->start = NULL;
			return;
		}
		if (!b->end && gpuos_drv.event_create(&b->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
			b->end = NULL;
			return;
		}
		if (gpuos_drv.event_record(b->start, s) == CUDA_SUCCESS)
			sc->open = b;
		return;
	}
}

/* Map new memory for r and, if it has contents, copy them back on s (not waited for);
 * *copied: the bytes; *map_ns (if given) grows by the time making and mapping took; a
 * copy ahead (batch: its context) opens a timed batch if none is. */
static CUresult make_resident(struct res *r, CUstream s, uint64_t *copied, uint64_t *map_ns,
			      struct swap_ctx *batch)
{
	uint64_t t0 = gpuos_now_ns();
	struct gpuos_map_times t = { 0 };
	CUresult c = map_new(r->base, r->size, r->device, &r->h, &t);
	if (map_ns)
		*map_ns += gpuos_now_ns() - t0;
	R.st.maps += c == CUDA_SUCCESS;
	R.st.create_ns += t.create_ns;
	R.st.access_ns += t.access_ns;
	if (c != CUDA_SUCCESS) {
		r->h = 0;
		return c;
	}
	R.st.resident_bytes += r->size;
	if (!r->has_content)
		return CUDA_SUCCESS;
	if (batch)
		batch_begin(batch, s);
	c = gpuos_drv.memcpy_htod_async(r->base, r->host, r->size, s);
	if (c != CUDA_SUCCESS)
		return c; /* resident, its contents where they were (host) */
	*copied = r->size;
	R.st.evicted_bytes -= r->size;
	R.st.swap_ins++;
	GPUOS_USDT2(swap_in, r->base, r->size);
	return CUDA_SUCCESS;
}

/* r made resident ahead of its use: its copy (if any) on sc's stream, not waited for.
 * *bytes grows by what is copied. */
static CUresult bring_ahead(struct swap_ctx *sc, struct res *r, uint64_t *bytes)
{
	uint64_t copied = 0;
	CUresult c = make_resident(r, sc->s, &copied, &R.st.ahead_map_ns, sc);
	if (c != CUDA_SUCCESS)
		return c;
	r->ahead = 1;
	r->in_flight = copied > 0;
	r->ahead_ev = sc->ahead;
	*bytes += copied;
	GPUOS_USDT2(swap_ahead, r->base, r->size);
	return CUDA_SUCCESS;
}

/* The copies ahead issued, `ns` spent issuing them (mapping, queueing): the event after
 * them, the counts, the end of their timed batch.  Their copies are not waited for: the
 * figures of copies waited for are bytes_in - ahead_bytes in in_ns - ahead_ns; theirs,
 * as the GPU ran them, batch_bytes in batch_ns. */
static void ahead_issued(struct swap_ctx *sc, uint64_t bytes, uint64_t ns)
{
	struct timed_batch *b = sc ? sc->open : NULL;
	if (sc) {
		sc->open = NULL;
		sc->began = 0;
	}
	if (!bytes)
		return;
	uint64_t t0 = gpuos_now_ns();
	if (gpuos_drv.event_record(sc->ahead, sc->s) != CUDA_SUCCESS)
		gpuos_drv.stream_sync(sc->s); /* no event to wait on: wait now */
	if (b && gpuos_drv.event_record(b->end, sc->s) == CUDA_SUCCESS) {
		b->bytes = bytes;
		b->pending = 1;
	}
	ns += gpuos_now_ns() - t0;
	R.st.ahead_bytes += bytes;
	R.st.bytes_in += bytes;
	R.st.in_ns += ns;
	R.st.ahead_ns += ns;
}

/* Whether copies ahead can be made in sc (the driver has events, sc has one). */
static int ahead_ready(struct swap_ctx *sc)
{
	if (!sc || !gpuos_drv.event_create || !gpuos_drv.event_record || !gpuos_drv.event_query ||
	    !gpuos_drv.event_sync)
		return 0;
	if (!sc->ahead && gpuos_drv.event_create(&sc->ahead, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
		sc->ahead = NULL;
		return 0;
	}
	return 1;
}

/* After a call's own copies: bring in the evicted allocations of this context that the
 * learned sequence uses next (within a period, soonest first), into free room or the
 * room of resident ones it does not use for a period.  The copies are not waited for;
 * an event after them is. */
static void copy_ahead(struct swap_ctx *sc)
{
	if (!ahead_ready(sc))
		return;
	uint64_t ctx = gpuos_current_ctx();
	struct res *cand[AHEAD_MAX];
	uint64_t dist[AHEAD_MAX];
	size_t nc = 0;
	for (size_t i = 0; i < R.n; i++) {
		struct res *r = &R.v[i];
		if (r->h || r->ctx != ctx || !r->nuse)
			continue;
		uint64_t d = victim_score(r); /* for one not resident: the ticks until its next use */
		if (d >= R.period || (nc == AHEAD_MAX && d >= dist[nc - 1]))
			continue;
		size_t k = nc < AHEAD_MAX ? nc++ : AHEAD_MAX - 1;
		for (; k > 0 && dist[k - 1] > d; k--) {
			cand[k] = cand[k - 1];
			dist[k] = dist[k - 1];
		}
		cand[k] = r;
		dist[k] = d;
	}
	uint64_t bytes = 0, ns = 0;
	static const uint64_t unused_for_a_period = UINT64_MAX - 2; /* victim_score above it */
	for (size_t k = 0; k < nc; k++) {
		struct res *r = cand[k];
		if (R.st.resident_bytes + r->size > R.limit &&
		    (evict_batch(R.st.resident_bytes + r->size - R.limit, &unused_for_a_period) ||
		     R.st.resident_bytes + r->size > R.limit))
			break; /* no room but that of allocations the sequence still uses (out_ns) */
		uint64_t t0 = gpuos_now_ns();
		CUresult c = bring_ahead(sc, r, &bytes);
		ns += gpuos_now_ns() - t0;
		if (c != CUDA_SUCCESS)
			break;
	}
	ahead_issued(sc, bytes, ns);
}

static GPUOS_TLS int tls_share_busy; /* this thread's call took the GPU's turn (share.c) */
static void share_done(void);

/* Make the entries marked for this call resident: room first, then new memory mapped and
 * the evicted contents copied back, one synchronisation for all.  In a group, a call
 * without the GPU's turn that cannot have its room without it sets *need_turn and
 * changes nothing. */
static CUresult bring_in(int *need_turn)
{
	uint64_t want = 0;
	CUevent wait_ev = NULL;
	for (size_t i = 0; i < R.n; i++) {
		struct res *r = &R.v[i];
		if (r->call != R.call)
			continue;
		if (!r->h)
			want += r->size;
		if (r->ahead) {
			R.st.ahead_hits++;
			r->ahead = 0;
		}
		if (r->in_flight)
			wait_ev = r->ahead_ev;
	}
	if (wait_ev) { /* a copy ahead for this call may still run */
		if (gpuos_drv.event_query(wait_ev) != CUDA_SUCCESS)
			R.st.ahead_waits++;
		CUresult c = gpuos_drv.event_sync(wait_ev);
		if (c != CUDA_SUCCESS)
			return c;
		for (size_t i = 0; i < R.n; i++)
			if (R.v[i].ahead_ev == wait_ev)
				R.v[i].in_flight = 0; /* recorded after every copy before it */
	}
	struct swap_ctx *sc = swap_ctx();
	if (wait_ev && sc)
		batches_read(sc); /* what was waited for has passed */
	/* A turn taken from another member begins: what this process used in its last turn
	 * comes back with this call's memory, the others evicting for all of it at once (one
	 * request, one synchronisation each) instead of call by call. */
	uint64_t turn = 0, ctx = gpuos_current_ctx();
	if (R.turn_begins) {
		R.turn_begins = 0;
		/* (only members of a group begin turns) this member's working set for the
		 * group: what its calls needed since the turn before its last began (the next
		 * holder admits it beside itself by that; two turns, as one may have been cut
		 * short) */
		uint64_t used = 0;
		for (size_t i = 0; i < R.n; i++)
			used += R.v[i].nuse && R.v[i].tick >= R.turn_tick_before ? R.v[i].size : 0;
		gpuos_share_working_set(used);
		/* only while it pays: batches whose memory is evicted again unused (a turn
		 * that does not use what the last one did) stop them */
		int pays = R.st.ahead_unused <= R.st.ahead_hits + TURN_TRIES;
		for (size_t i = 0; pays && ahead_ready(sc) && i < R.n; i++) {
			struct res *r = &R.v[i];
			r->turn = !r->h && r->call != R.call && r->ctx == ctx && r->nuse && r->tick >= R.turn_tick;
			turn += r->turn ? r->size : 0;
		}
		R.turn_tick_before = R.turn_tick;
		R.turn_tick = R.tick;
	}
	if (!want && !turn) {
		if (R.period && !R.lru_only && !R.shared)
			copy_ahead(sc);
		return CUDA_SUCCESS;
	}
	/* In a group without the GPU's turn: free room only, else the turn first */
	int charged = R.shared && !tls_share_busy && need_turn;
	if (charged && !gpuos_share_take_free(want)) {
		*need_turn = 1;
		return CUDA_SUCCESS;
	}
	/* A thread whose member has left the turn's set since its turn was taken (another of
	 * its threads stepped aside for it, below) waits for a turn again: outside the set it
	 * can ask no one, and its own memory may be none (fake driver, two members of four
	 * threads in 12 MiB: 2 runs in 117 failed with out-of-memory so). */
	int role = !charged && need_turn && R.shared ? gpuos_share_role() : GPUOS_SHARE_HOLDER;
	if (role == GPUOS_SHARE_OUT) {
		for (size_t i = 0; turn && i < R.n; i++)
			R.v[i].turn = 0; /* the turn's batch comes with the next turn's first call */
		share_done();
		*need_turn = 1;
		return CUDA_SUCCESS;
	}
	R.st.calls_swapped += !!want;
	R.swapped = R.call;
	if (turn && (want + turn > R.limit || turn_room(want, want + turn))) {
		for (size_t i = 0; i < R.n; i++)
			R.v[i].turn = 0; /* not all of it fits: this call's memory alone */
		turn = 0;
	}
	/* A member beside the holder does not evict its own memory for room: lacking room
	 * (its working set grew), it takes a turn of its own instead, where it may ask every
	 * member (evicting its own, it would swap call by call in what is left it, and the
	 * turn would never end: no one waits). */
	int beside = !turn && role == GPUOS_SHARE_BESIDE;
	if (!charged && !turn && make_room(want, !beside)) {
		if (beside) { /* (the turn may have ended meanwhile: it waits all the same) */
			gpuos_share_step_aside();
			share_done();
			*need_turn = 1;
			return CUDA_SUCCESS;
		}
		R.st.over_limit++;
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	CUstream s = swap_stream(sc);
	uint64_t t0 = gpuos_now_ns(), copied = 0, mapped = 0, map_ns = 0;
	CUresult c = CUDA_SUCCESS;
	for (size_t i = 0; i < R.n && c == CUDA_SUCCESS; i++) {
		struct res *r = &R.v[i];
		if (r->call != R.call || r->h)
			continue;
		uint64_t bytes = 0;
		c = make_resident(r, s, &bytes, &map_ns, NULL);
		mapped += r->h ? r->size : 0; /* mapped, even if its copy failed */
		copied += bytes;
	}
	if (c == CUDA_SUCCESS && copied)
		c = gpuos_drv.stream_sync(s);
	if (copied) { /* map_ns: the part of in_ns (a call that only maps memory never
		       * written copies nothing: H200, that time was 13x the copies' own) */
		R.st.bytes_in += copied;
		R.st.in_ns += gpuos_now_ns() - t0;
		R.st.map_ns += map_ns;
	}
	GPUOS_USDT3(call_in, want, copied, gpuos_now_ns() - t0);
	/* the turn's batch, after this call's own: each part as the others' evictions make
	 * its room (its copy in runs while theirs out go on) */
	uint64_t ahead = 0, t1 = gpuos_now_ns(), claim = turn, taken = 0;
	for (size_t i = 0; i < R.n; i++) {
		struct res *r = &R.v[i];
		if (!r->turn)
			continue;
		r->turn = 0;
		if (r->h)
			continue; /* resident already: neither charged nor brought */
		uint64_t tw = gpuos_now_ns();
		int no_room = c != CUDA_SUCCESS || !claim || turn_take(r->size, claim);
		R.st.room_ns += gpuos_now_ns() - tw;
		if (no_room) {
			claim = 0; /* (a part that does not come: the rest comes with its calls) */
			continue;
		}
		claim -= r->size;
		taken += r->size;
		bring_ahead(sc, r, &ahead);
		mapped += r->h ? r->size : 0;
	}
	if (turn)
		gpuos_share_unclaim(); /* what the batch did not take is not its */
	ahead_issued(sc, ahead, gpuos_now_ns() - t1);
	give_room(want + taken - mapped); /* charged for these, made only those mapped */
	if (c == CUDA_SUCCESS && R.period && !R.lru_only && !R.shared)
		copy_ahead(sc);
	return c;
}

static void share_done(void)
{
	if (tls_share_busy) {
		tls_share_busy = 0;
		gpuos_share_done();
	}
}

/* The lock, for the rest of this call (released at the outermost wrapper's exit); with
 * `turn` (in a group), the GPU's turn first, waited for without the lock: the release
 * thread may need it to evict for the holder meanwhile.  0, or -1 if the lock is held
 * already (a nested wrapper's call: it goes on as its outermost one does). */
static int enter(int turn)
{
	if (gpuos_tls_res_held)
		return -1;
	int begins = 0;
	if (turn && R.shared) {
		begins = gpuos_share_acquire();
		tls_share_busy = 1;
	}
	pthread_mutex_lock(&R.mu);
	gpuos_tls_res_held = 1;
	R.turn_begins |= begins;
	R.call++;
	if (!R.call)
		R.call = 1;
	R.sig = 0xcbf29ce484222325ull;
	return 0;
}

void gpuos_res_release(void)
{
	if (!gpuos_tls_res_held)
		return;
	gpuos_tls_res_held = 0;
	pthread_mutex_unlock(&R.mu);
}

static void mark(uint64_t p)
{
	ssize_t i = find(p);
	if (i < 0)
		return;
	struct res *r = &R.v[i];
	if (R.ticked != R.call) { /* a tick is a call that needs movable memory */
		R.ticked = R.call;
		R.tick++;
	}
	R.sig = (R.sig ^ r->base) * 0x100000001b3ull;
	if (r->call == R.call)
		return; /* twice in one call */
	r->call = R.call;
	r->tick = R.tick;
	if (!r->nuse || r->uses[(r->nuse - 1) % USES] != R.tick) /* a call run again: one use */
		r->uses[r->nuse++ % USES] = R.tick;
}

static CUresult finish(uint64_t t0, CUresult c, const char *what)
{
	uint64_t ns = gpuos_now_ns() - t0;
	R.st.stall_ns += ns;
	share_done();
	if (R.swapped == R.call)
		R.st.stall_hist[gpuos_stall_bucket(ns)]++;
	if (c == CUDA_ERROR_OUT_OF_MEMORY) {
		static int said;
		if (!said++)
			fprintf(stderr, "gpuos: %s needs more movable memory resident than --gpu-memory allows "
					"(%llu bytes); it fails with CUDA_ERROR_OUT_OF_MEMORY\n",
				what, (unsigned long long)R.limit);
	}
	return c;
}

/* A stream capture records calls instead of running them, and forbids the
 * synchronisation an eviction needs: calls are not checked meanwhile (counted); the graph
 * launch that runs them later needs everything. */
static int capturing(void)
{
	if (!__atomic_load_n(&gpuos_hot.capturing, __ATOMIC_RELAXED))
		return 0;
	R.st.capture_unchecked++;
	return 1;
}

/* Evict what the group asked of this process (R.mu held): outside any call's marks, so
 * nothing is spared. */
static void evict_asked(void)
{
	uint64_t bytes = gpuos_share_release_asked();
	if (!bytes)
		return;
	R.call++; /* no call in progress: nothing is spared */
	if (!R.call)
		R.call = 1;
	uint64_t before = R.st.resident_bytes;
	/* context by context: an eviction synchronises and copies in its context */
	for (size_t i = 0; i < R.n && before - R.st.resident_bytes < bytes; i++) {
		uint64_t ctx = R.v[i].ctx;
		if (!R.v[i].h || !gpuos_drv.ctx_push || gpuos_drv.ctx_push((CUcontext)(uintptr_t)ctx) != CUDA_SUCCESS)
			continue;
		while (before - R.st.resident_bytes < bytes && !evict_batch(bytes - (before - R.st.resident_bytes), NULL))
			;
		CUcontext popped;
		gpuos_drv.ctx_pop(&popped);
	}
	gpuos_share_released(bytes, before - R.st.resident_bytes);
}

/* The call's memory (p[i * stride] for i < n, or every allocation if all) made resident.  In a
 * group, first without the GPU's turn; if it needs the turn, the lock is let go, the turn
 * waited for, and the call marked again as the same tick (one call: one use, one
 * signature).  A call nested in another that holds the lock cannot let it go: it makes
 * its room as a member without the turn can (free room, else its own memory). */
static CUresult need(const uint64_t *p, size_t n, size_t stride, int all, int launch, const char *what)
{
	uint64_t t0 = gpuos_now_ns();
	int ticked = 0;
	for (int again = 0;; again = 1) {
		int outermost = enter(again) == 0;
		if (!again) {
			R.st.launches += !!launch;
			R.st.need_all += !!all;
		}
		if (capturing()) {
			share_done();
			return CUDA_SUCCESS;
		}
		if (outermost && R.shared)
			evict_asked(); /* before the call's marks: its release thread may wait long for the lock */
		if (ticked)
			R.ticked = R.call; /* the tick it took before */
		for (size_t i = 0; i < (all ? R.n : n); i++)
			mark(all ? R.v[i].base : *(const uint64_t *)((const char *)p + i * stride));
		if (!again && R.ticked == R.call && !R.lru_only)
			learn_period();
		ticked = R.ticked == R.call;
		int need_turn = 0;
		CUresult c = bring_in(outermost ? &need_turn : NULL);
		if (!need_turn)
			return finish(t0, c, what);
		gpuos_res_release();
	}
}

CUresult gpuos_res_need(const uint64_t *p, size_t n, size_t stride, int launch)
{
	return need(p, n, stride, 0, launch, launch ? "a launch" : "a copy or memset");
}

CUresult gpuos_res_need_all(const char *why)
{
	return need(NULL, 0, 0, 1, 0, why);
}

void gpuos_res_evict_for_others(void)
{
	pthread_mutex_lock(&R.mu);
	evict_asked();
	pthread_mutex_unlock(&R.mu);
}

void gpuos_res_stats(struct gpuos_res_stats *out)
{
	int locked = lock_unless_held();
	*out = R.st;
	unlock_if(locked);
}
