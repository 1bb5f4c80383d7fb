/* SPDX-License-Identifier: MIT */
/*
 * t_threads - launches from several threads at once while the map changes under them
 * (linked with -lcuda).
 *
 * THREADS threads each keep a few buffers of their own and, ROUNDS times: launch
 * fake_saxpy (y = a*x + y) over two of them, free one and allocate it again with another
 * size, fill it (a copy) and launch fake_noop with pointers into its buffers (one of them
 * interior) and a scalar.  Threads exit with launches just made (an interposer that
 * queues work must still record them), then the main thread launches once more.  What
 * an interposer must report is printed as "threads": per thread its tid and, per launch
 * in its order, the [base, size] of each buffer its pointers point into, first
 * appearance first.  Results are checked on the host.  Usage: t_threads [SEED]
 */
#include <pthread.h>
#include <sys/syscall.h>

static pthread_mutex_t tally_mu = PTHREAD_MUTEX_INITIALIZER;
#define FN(sym) (locked_tally(#sym), sym)
static void locked_tally(const char *name);
#include "work.h"

enum { THREADS = 4, NB = 4, ROUNDS = 150, N = 300 };

static void locked_tally(const char *name)
{
	pthread_mutex_lock(&tally_mu);
	tally(name);
	pthread_mutex_unlock(&tally_mu);
}

static void count(long long *c)
{
	pthread_mutex_lock(&tally_mu);
	(*c)++;
	pthread_mutex_unlock(&tally_mu);
}

struct worker {
	pthread_t t;
	unsigned seed;
	int tid;
	CUdeviceptr d[NB];
	size_t size[NB];
	char *expect; /* this thread's launches, as JSON */
	size_t len, cap;
};

static void emit(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(struct worker *w, const char *fmt, ...)
{
	for (;;) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(w->expect + w->len, w->cap - w->len, fmt, ap);
		va_end(ap);
		if (n >= 0 && (size_t)n < w->cap - w->len) {
			w->len += (size_t)n;
			return;
		}
		w->cap = w->cap * 2 + (size_t)n + 64;
		w->expect = realloc(w->expect, w->cap);
		if (!w->expect)
			abort();
	}
}

/* One launch's expected list: the buffers of w that ptrs point into, first appearance first. */
static void expect_launch(struct worker *w, const CUdeviceptr *ptrs, int n)
{
	int seen[NB] = { 0 }, first = 1;
	emit(w, "%s[", w->len > 1 ? ", " : "");
	for (int i = 0; i < n; i++)
		for (int b = 0; b < NB; b++)
			if (!seen[b] && ptrs[i] >= w->d[b] && ptrs[i] < w->d[b] + w->size[b]) {
				seen[b] = 1;
				emit(w, "%s[%llu, %zu]", first ? "" : ", ", (unsigned long long)w->d[b], w->size[b]);
				first = 0;
			}
	emit(w, "]");
}

static void launch(CUfunction f, void **params)
{
	CU(cuLaunchKernel, f, blocks(N), 1, 1, 256, 1, 1, 0, NULL, params, NULL);
	count(&C.launches);
}

static void *run(void *arg)
{
	struct worker *w = arg;
	w->tid = (int)syscall(SYS_gettid);
	CU(cuCtxSetCurrent, w_ctx);
	float host[N], want[N], got[N];
	for (int b = 0; b < NB; b++) {
		w->size[b] = 4 * N + 256 * (size_t)b;
		CU(cuMemAlloc_v2, &w->d[b], w->size[b]);
		count(&C.allocs);
		count(&C.alloc_device);
	}
	emit(w, "[");
	for (int r = 0; r < ROUNDS; r++) {
		int x = rand_r(&w->seed) % NB, y = (x + 1 + rand_r(&w->seed) % (NB - 1)) % NB;
		for (int i = 0; i < N; i++) {
			host[i] = (float)(rand_r(&w->seed) % 1000) / 7.0f;
			want[i] = (float)(rand_r(&w->seed) % 1000) / 3.0f;
		}
		CU(cuMemcpyHtoD_v2, w->d[x], host, 4 * N);
		CU(cuMemcpyHtoD_v2, w->d[y], want, 4 * N);
		count(&C.copies);
		count(&C.copies);
		float a = 0.5f + (float)r;
		int n = N;
		void *p_saxpy[] = { &a, &w->d[x], &w->d[y], &n };
		launch(w_saxpy, p_saxpy);
		expect_launch(w, (CUdeviceptr[]){ w->d[x], w->d[y] }, 2);
		for (int i = 0; i < N; i++)
			want[i] = a * host[i] + want[i];
		CU(cuMemcpyDtoH_v2, got, w->d[y], 4 * N);
		count(&C.copies);
		CHECK(!memcmp(got, want, sizeof got), "thread %d round %d: saxpy result differs", w->tid, r);

		/* the map changes: another size, maybe another address */
		int f = rand_r(&w->seed) % NB;
		CU(cuMemFree_v2, w->d[f]);
		count(&C.frees);
		w->size[f] = 4 * N + 64 * (size_t)(rand_r(&w->seed) % 16);
		CU(cuMemAlloc_v2, &w->d[f], w->size[f]);
		count(&C.allocs);
		count(&C.alloc_device);
		CUdeviceptr a0 = w->d[f] + 8, a1 = (CUdeviceptr)r, a2 = w->d[(f + 1) % NB], a3 = w->d[f];
		void *p_noop[] = { &a0, &a1, &a2, &a3 };
		launch(w_noop, p_noop);
		expect_launch(w, (CUdeviceptr[]){ a0, a1, a2, a3 }, 4);
	}
	emit(w, "]");
	/* exit with the last launches just made: no free, no synchronization after them */
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned seed = argc > 1 ? (unsigned)atoi(argv[1]) : 1;
	struct worker w[THREADS];
	memset(w, 0, sizeof w);
	work_init();
	for (int i = 0; i < THREADS; i++) {
		w[i].seed = seed * 7919u + (unsigned)i;
		CHECK(!pthread_create(&w[i].t, NULL, run, &w[i]), "pthread_create");
	}
	for (int i = 0; i < THREADS; i++)
		pthread_join(w[i].t, NULL);

	/* the main thread, after the others are gone */
	CUdeviceptr last = w[0].d[0];
	int n = N;
	float a = 2.0f;
	void *p_saxpy[] = { &a, &last, &last, &n };
	launch(w_saxpy, p_saxpy);

	size_t cap = 64;
	for (int i = 0; i < THREADS; i++)
		cap += w[i].len + 64;
	char *extra = malloc(cap);
	size_t len = (size_t)snprintf(extra, cap, ", \"main_tid\": %d, \"threads\": [", (int)syscall(SYS_gettid));
	for (int i = 0; i < THREADS; i++)
		len += (size_t)snprintf(extra + len, cap - len, "%s{\"tid\": %d, \"expect\": %s}", i ? ", " : "", w[i].tid,
					w[i].expect);
	snprintf(extra + len, cap - len, "]");
	for (int i = 0; i < THREADS; i++) {
		for (int b = 0; b < NB; b++) {
			CU(cuMemFree_v2, w[i].d[b]);
			count(&C.frees);
		}
		free(w[i].expect);
	}
	work_fini();
	int rc = finish("t_threads", extra);
	free(extra);
	return rc;
}
