/* SPDX-License-Identifier: MIT */
/*
 * defer.c - recording off the launching thread.
 *
 * Inside an application the library's part of a launch costs several times what it
 * costs in a loop: between two launches the application evicts the lines that the
 * scan and the record touch (docs/interception.md).  So the launching thread only
 * copies what a record needs (the parameter bytes, grid, stream, ...) into a queue of
 * its own and goes on; the library's recording thread ("gpuos-rec") scans and writes
 * the records, every millisecond while operations come, napping up to 64 ms when none
 * do (the next operation wakes it).
 *
 * Each queue has one producer, its thread, and one consumer at a time: whoever holds
 * drain_mu (the recording thread; a thread whose queue is full, for its own; a thread
 * about to change what records are made from, for all of them).  A queue is drained
 * in order, so one thread's records keep their order; seq is given when recorded.
 * Whatever changes what a record is made from (the allocation map, function entries,
 * graph execs) takes gpuos_write_lock_drained(), which drains every queue first, so
 * each operation is recorded against the state it was issued in.  An exiting thread's
 * queue is drained and freed by the recording thread; the process's exit drains them
 * all (a process killed, or ending in _exit, loses the last milliseconds of records).
 *
 * Validation records inline (it must see each operation around its real call), and
 * GPUOS_RECORD_INLINE=1 does too, to compare.  If the thread cannot be started, or a
 * queue cannot be allocated, operations are recorded inline.
 */
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core.h"

#if defined(__x86_64__)
#include <x86intrin.h>
#define HAVE_TSC 1
#else
#define HAVE_TSC 0
#endif

#define QUEUE_BYTES (256u << 10) /* per thread: ~700 launches of PyTorch's ~350 bytes */
#define FN_CACHE_BITS 10          /* the thread's function entries: 1024 of them */
#define QUEUE_MASK (QUEUE_BYTES - 1)
#define NAP_NS 1000000ll         /* between two drains while operations come */
#define IDLE_NAP_NS 64000000ll   /* the longest nap: the bound on a missed wakeup */

_Static_assert((QUEUE_BYTES & QUEUE_MASK) == 0, "queue size must be a power of two");

struct queue {
	/* the owner's line */
	uint64_t head;     /* bytes published (release) */
	uint64_t tail_seen; /* the owner's last look at tail */
	uint64_t pending;  /* bytes the reserved entry takes (with a skip before it) */
	uint32_t tid;
	uint8_t reserved;  /* an entry is reserved: a nested call records inline */
	uint8_t wake;      /* the recording thread naps long: the next commit wakes it */
	/* the owner's function entries by handle, good while gpuos_hot.fn_gen holds */
	struct {
		uint64_t handle, gen;
		const struct gpuos_fn *fn;
	} fns[1u << FN_CACHE_BITS];
	/* the consumer's line */
	uint64_t tail __attribute__((aligned(64)));
	struct queue *next; /* list_mu */
	int closed;         /* its thread has exited */
	uint8_t buf[QUEUE_BYTES] __attribute__((aligned(64)));
};

enum { WORKER_UNSTARTED, WORKER_RUNNING, WORKER_NONE };

/* Both are taken at every drain: alone (GPUOS_ALONE), like cal. */
static GPUOS_ALONE(pthread_mutex_t) drain_mu = { .v = PTHREAD_MUTEX_INITIALIZER };
static GPUOS_ALONE(pthread_mutex_t) list_mu = { .v = PTHREAD_MUTEX_INITIALIZER }; /* queues, worker_state */
static struct queue *queues;   /* written under list_mu, read by the recording thread: atomics */
static int worker_state;       /* written under list_mu, read by launching threads: atomics */

/* ThreadSanitizer cannot see the atomics of this (uninstrumented) library: a queue entry
 * published by a launching thread and read by the recording thread would look like a
 * race in a TSan-built application. Its runtime, when present, is told of each handoff
 * (__tsan_release/__tsan_acquire on the index that publishes it); NULL otherwise. */
static void (*tsan_release)(void *);
static void (*tsan_acquire)(void *);
static uint32_t wake_word; /* the recording thread's futex */
static GPUOS_TLS struct queue *tls_q;
static GPUOS_TLS uint8_t *tls_next; /* where tls_q's next entry goes, unless it wraps */
static GPUOS_TLS uint8_t tls_no_queue; /* none could be made for this thread */
static pthread_key_t q_key;
static int q_key_made;
static pthread_once_t q_key_once = PTHREAD_ONCE_INIT;

/* When an operation was issued: the TSC where it ticks at a constant rate on every CPU
 * (an uncached clock_gettime cost 100 ns of a launch), converted to CLOCK_MONOTONIC ns
 * by the recording thread; else clock_gettime.  gpuos_hot.tsc_ok is set before the
 * first queue. */
static struct {
	uint64_t tsc0, ns0;  /* when the first queue was made */
	uint64_t tsc, ns;    /* the last calibration (drain_mu), written at every drain: */
	double ns_per_tick;
} __attribute__((aligned(128))) cal; /* alone, as GPUOS_ALONE */

static int tsc_constant(void)
{
	if (!HAVE_TSC)
		return 0;
	FILE *f = fopen("/proc/cpuinfo", "re");
	char line[4096];
	int ok = 0;
	while (f && fgets(line, sizeof line, f))
		if (!strncmp(line, "flags", 5)) {
			ok = strstr(line, " constant_tsc") && strstr(line, " nonstop_tsc");
			break;
		}
	if (f)
		fclose(f);
	return ok;
}

static inline uint64_t tsc_now(void)
{
#if HAVE_TSC
	return __rdtsc();
#else
	return 0;
#endif
}

static uint64_t stamp_now(void)
{
	return gpuos_hot.tsc_ok ? tsc_now() : gpuos_now_ns();
}

/* A TSC reading and CLOCK_MONOTONIC at the same moment: 0 if every try was interrupted
 * between the two (a preempted pair would skew the rate). */
#define PAIR_TICKS 10000 /* a few microseconds */

static int clock_pair(uint64_t *tsc, uint64_t *ns)
{
	for (int i = 0; i < 8; i++) {
		uint64_t a = tsc_now(), n = gpuos_now_ns(), b = tsc_now();
		if (b - a < PAIR_TICKS) {
			*tsc = a + (b - a) / 2;
			*ns = n;
			return 1;
		}
	}
	return 0;
}

/* A new reference point for stamp_ns (drain_mu held), the rate measured from the first
 * point: an entry's time is off by at most its age times the rate's error (under 0.1%). */
#define FIRST_RATE_NS 200000 /* the first rate is measured over at least this long */

static void calibrate(void)
{
	uint64_t t, n;
	if (!gpuos_hot.tsc_ok)
		return;
	/* Once: wait until the first rate can be good to 0.1% (young entries need it too). */
	while (!cal.ns_per_tick && gpuos_now_ns() - cal.ns0 < FIRST_RATE_NS)
		;
	if (!clock_pair(&t, &n) || t <= cal.tsc0 || n <= cal.ns0)
		return;
	cal.ns_per_tick = (double)(n - cal.ns0) / (double)(t - cal.tsc0);
	cal.tsc = t;
	cal.ns = n;
}

static uint64_t stamp_ns(uint64_t stamp)
{
	if (!gpuos_hot.tsc_ok || !cal.ns_per_tick) /* (every try at the first rate was interrupted) */
		return gpuos_hot.tsc_ok ? gpuos_now_ns() : stamp;
	return cal.ns + (uint64_t)(int64_t)((double)(int64_t)(stamp - cal.tsc) * cal.ns_per_tick);
}

static void futex_wait(uint32_t *w, uint32_t v, long long ns)
{
	struct timespec ts = { .tv_sec = ns / 1000000000ll, .tv_nsec = ns % 1000000000ll };
	syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, &ts, NULL, 0);
}

static void play(const struct gpuos_qe *e, uint32_t tid)
{
	gpuos_ring_as(tid, stamp_ns(e->stamp));
	switch (e->kind) {
	case GPUOS_QE_LAUNCH:
		gpuos_play_launch(e);
		break;
	case GPUOS_QE_COPY:
		gpuos_play_copy(e);
		break;
	case GPUOS_QE_GRAPH:
		gpuos_play_graph(e);
		break;
	}
	gpuos_ring_as(0, 0);
}

/* Record q's published entries (drain_mu held).  Returns how many bytes. */
static uint64_t drain_queue(struct queue *q)
{
	uint64_t head = __atomic_load_n(&q->head, __ATOMIC_ACQUIRE), t = q->tail;
	if (head == t)
		return 0;
	if (tsan_acquire)
		tsan_acquire(&q->head);
	/* One read lock for them all: the launching threads do not take it. */
	pthread_rwlock_rdlock(&gpuos_lock.v);
	for (uint64_t at = t; at != head;) {
		const struct gpuos_qe *e = (const struct gpuos_qe *)(q->buf + (at & QUEUE_MASK));
		if (e->kind != GPUOS_QE_SKIP)
			play(e, q->tid);
		at += e->size;
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (tsan_release)
		tsan_release(&q->tail);
	__atomic_store_n(&q->tail, head, __ATOMIC_RELEASE);
	return head - t;
}

/* Drain every queue, freeing those of exited threads.  Returns how many bytes were
 * recorded. */
static uint64_t drain_queues(void)
{
	uint64_t n = 0;
	pthread_mutex_lock(&drain_mu.v);
	calibrate();
	pthread_mutex_lock(&list_mu.v);
	struct queue *q = queues;
	pthread_mutex_unlock(&list_mu.v);
	/* Queues are added at the front and freed only here (drain_mu held): the list from
	 * q on stays as it is while we walk it. */
	while (q) {
		struct queue *next = q->next;
		int closed = __atomic_load_n(&q->closed, __ATOMIC_ACQUIRE);
		n += drain_queue(q);
		if (closed) {
			pthread_mutex_lock(&list_mu.v);
			struct queue **pp = &queues;
			while (*pp != q)
				pp = &(*pp)->next;
			__atomic_store_n(pp, next, __ATOMIC_RELEASE);
			pthread_mutex_unlock(&list_mu.v);
			free(q);
		}
		q = next;
	}
	pthread_mutex_unlock(&drain_mu.v);
	return n;
}

/* Ask each queue's next commit to wake the recording thread (a commit that does not
 * see it yet is recorded after the nap). */
static void arm_wakeups(void)
{
	pthread_mutex_lock(&list_mu.v);
	for (struct queue *q = queues; q; q = q->next)
		__atomic_store_n(&q->wake, 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&list_mu.v);
}

/* GPUOS_RECORD_CPUS (a list such as "12" or "12-13,15"): the CPUs the recording thread
 * may run on, e.g. housekeeping CPUs away from the application's.  1 if set is that;
 * a bad list is ignored. */
static int record_cpus(cpu_set_t *set)
{
	const char *env = getenv("GPUOS_RECORD_CPUS");
	if (!env || !*env)
		return 0;
	CPU_ZERO(set);
	for (const char *p = env; *p;) {
		char *end;
		long lo = strtol(p, &end, 10), hi = lo;
		if (end == p || lo < 0 || lo >= CPU_SETSIZE)
			goto bad;
		if (*end == '-') {
			p = end + 1;
			hi = strtol(p, &end, 10);
			if (end == p || hi < lo || hi >= CPU_SETSIZE)
				goto bad;
		}
		for (long c = lo; c <= hi; c++)
			CPU_SET(c, set);
		if (*end != ',' && *end)
			goto bad;
		p = *end ? end + 1 : end;
	}
	return 1;
bad:
	gpuos_dbg("GPUOS_RECORD_CPUS=%s: not a CPU list, ignored", env);
	return 0;
}

static void *worker(void *arg)
{
	(void)arg;
	long long nap = NAP_NS;
	for (;;) {
		uint32_t w = __atomic_load_n(&wake_word, __ATOMIC_ACQUIRE);
		if (drain_queues()) {
			nap = NAP_NS;
		} else {
			nap = nap * 2 < IDLE_NAP_NS ? nap * 2 : IDLE_NAP_NS;
			arm_wakeups();
		}
		futex_wait(&wake_word, w, nap);
	}
	return NULL;
}

static void queue_closed(void *p)
{
	struct queue *q = p;
	tls_q = NULL; /* a later driver call from a TLS destructor makes a new queue */
	__atomic_store_n(&q->closed, 1, __ATOMIC_RELEASE);
}

static void q_key_init(void)
{
	q_key_made = !pthread_key_create(&q_key, queue_closed);
}

/* Start the recording thread, with every signal blocked (the application's handlers
 * run on its own threads).  list_mu held. */
static void worker_start(void)
{
	const char *inl = getenv("GPUOS_RECORD_INLINE");
	__atomic_store_n(&worker_state, WORKER_NONE, __ATOMIC_RELEASE);
	if (inl && !strcmp(inl, "1"))
		return;
	gpuos_hot.tsc_ok = tsc_constant() && clock_pair(&cal.tsc0, &cal.ns0);
	cal.tsc = cal.tsc0;
	cal.ns = cal.ns0;
	cal.ns_per_tick = 0; /* measured at the first calibration */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_t t;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	cpu_set_t cpus;
	if (record_cpus(&cpus))
		pthread_attr_setaffinity_np(&attr, sizeof cpus, &cpus);
	int e = pthread_create(&t, &attr, worker, NULL);
	if (e == EINVAL && record_cpus(&cpus)) { /* none of those CPUs is ours */
		gpuos_dbg("GPUOS_RECORD_CPUS: no usable CPU, ignored");
		pthread_attr_destroy(&attr);
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		e = pthread_create(&t, &attr, worker, NULL);
	}
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (e) {
		gpuos_dbg("no recording thread (%s): recording inline", strerror(e));
		return;
	}
	pthread_setname_np(t, "gpuos-rec");
	__atomic_store_n(&worker_state, WORKER_RUNNING, __ATOMIC_RELEASE);
}

static struct queue *queue_new(void)
{
	pthread_once(&q_key_once, q_key_init);
	pthread_mutex_lock(&list_mu.v);
	if (worker_state == WORKER_UNSTARTED) {
		if (gpuos_real_dlsym) {
			tsan_release = (void (*)(void *))gpuos_real_dlsym(RTLD_DEFAULT, "__tsan_release");
			tsan_acquire = (void (*)(void *))gpuos_real_dlsym(RTLD_DEFAULT, "__tsan_acquire");
			dlerror();
		}
		worker_start();
	}
	struct queue *q = NULL;
	if (worker_state == WORKER_RUNNING && (q = aligned_alloc(64, sizeof *q)) != NULL) {
		memset(q, 0, offsetof(struct queue, buf)); /* fns[].handle 0: no entry */
		q->tid = gpuos_tid();
		q->next = queues;
		__atomic_store_n(&queues, q, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&list_mu.v);
	if (q) {
		if (q_key_made)
			pthread_setspecific(q_key, q);
		tls_q = q;
		tls_next = q->buf;
	}
	return q;
}

/* The calling thread's queue, made at its first operation; NULL: record inline. */
static inline struct queue *queue_get(void)
{
	struct queue *q = tls_q;
	if (likely(q != NULL))
		return q;
	if (gpuos_validating || __atomic_load_n(&worker_state, __ATOMIC_ACQUIRE) == WORKER_NONE || tls_no_queue)
		return NULL;
	if (!(q = queue_new()))
		tls_no_queue = 1;
	return q;
}

const struct gpuos_fn *gpuos_defer_fn(uint64_t handle)
{
	struct queue *q = queue_get();
	if (unlikely(!q))
		return NULL;
	/* The lines the entry will write, wanted after the real call. */
	__builtin_prefetch(&q->head, 1, 3);
	for (int i = 0; i < 6; i++)
		__builtin_prefetch(tls_next + 64 * i, 1, 3);
	__typeof__(&q->fns[0]) c = &q->fns[(handle * 0x9e3779b97f4a7c15ull) >> (64 - FN_CACHE_BITS)];
	if (likely(c->handle == handle && c->gen == __atomic_load_n(&gpuos_hot.fn_gen, __ATOMIC_ACQUIRE)))
		return c->fn;
	pthread_rwlock_rdlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, handle);
	const struct gpuos_fn *fn = o ? o->ptr : NULL;
	if (fn) {
		c->handle = handle;
		c->gen = gpuos_hot.fn_gen;
		c->fn = fn;
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	return fn;
}

struct gpuos_qe *gpuos_defer_reserve(size_t size, uint16_t kind, uint16_t flags)
{
	struct queue *q = queue_get();
	if (unlikely(!q))
		return NULL;
	if (unlikely(q->reserved) || size > QUEUE_BYTES / 4)
		return NULL;
	size = (size + 7) & ~(size_t)7;
	uint64_t h = q->head, off = h & QUEUE_MASK;
	uint64_t skip = off + size > QUEUE_BYTES ? QUEUE_BYTES - off : 0;
	if (h + skip + size - q->tail_seen > QUEUE_BYTES) {
		q->tail_seen = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE);
		if (tsan_acquire)
			tsan_acquire(&q->tail); /* the space it frees is ours again */
		if (h + skip + size - q->tail_seen > QUEUE_BYTES)
			return NULL; /* full: the caller drains it and records inline */
	}
	if (skip) {
		/* Only size and kind of a skip are read: 8 bytes, as little as may be left. */
		struct gpuos_qe *s = (struct gpuos_qe *)(q->buf + off);
		s->size = (uint32_t)skip;
		s->kind = GPUOS_QE_SKIP;
		off = 0;
	}
	q->pending = skip + size;
	q->reserved = 1;
	struct gpuos_qe *e = (struct gpuos_qe *)(q->buf + off);
	e->size = (uint32_t)size;
	e->kind = kind;
	e->flags = flags;
	e->stamp = stamp_now();
	return e;
}

void gpuos_defer_commit(int ok)
{
	struct queue *q = tls_q;
	q->reserved = 0;
	if (!ok)
		return;
	uint64_t head = q->head + q->pending;
	if (tsan_release)
		tsan_release(&q->head);
	__atomic_store_n(&q->head, head, __ATOMIC_RELEASE);
	tls_next = q->buf + (head & QUEUE_MASK);
	/* Wake the recording thread if it naps long, or if the queue is half full (the
	 * next look at tail is then due: at most one wakeup per half queue). */
	if (unlikely(__atomic_load_n(&q->wake, __ATOMIC_RELAXED)) ||
	    unlikely(head - q->tail_seen > QUEUE_BYTES / 2 &&
		     head - (q->tail_seen = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE)) > QUEUE_BYTES / 2)) {
		__atomic_store_n(&q->wake, 0, __ATOMIC_RELAXED);
		__atomic_add_fetch(&wake_word, 1, __ATOMIC_RELEASE);
		syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
	}
}

void gpuos_defer_drain_self(void)
{
	struct queue *q = tls_q;
	if (likely(!q) || __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE) == q->head)
		return;
	pthread_mutex_lock(&drain_mu.v);
	calibrate();
	drain_queue(q);
	pthread_mutex_unlock(&drain_mu.v);
}

void gpuos_defer_drain_all(void)
{
	if (__atomic_load_n(&queues, __ATOMIC_ACQUIRE))
		drain_queues();
}

__attribute__((destructor)) static void drain_at_exit(void)
{
	gpuos_defer_drain_all();
}

void gpuos_defer_forget(void)
{
	/* The child's only thread is the one that forked: the parent's queues were the
	 * parent's (its recording thread records them), the child starts afresh. */
	pthread_mutex_init(&drain_mu.v, NULL);
	pthread_mutex_init(&list_mu.v, NULL);
	while (queues) {
		struct queue *next = queues->next;
		free(queues);
		queues = next;
	}
	tls_q = NULL;
	tls_next = NULL;
	tls_no_queue = 0;
	if (q_key_made)
		pthread_setspecific(q_key, NULL);
	worker_state = WORKER_UNSTARTED;
	wake_word = 0;
	gpuos_hot.tsc_ok = 0;
}
