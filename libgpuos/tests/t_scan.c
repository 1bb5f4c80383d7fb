/* SPDX-License-Identifier: MIT */
/*
 * t_scan - the parameter scan against a map that changes under it (linked with -lcuda).
 *
 * Rounds of fake_gather launches whose by-value struct holds 16 pointers (repeats and
 * interior pointers among them, more distinct buffers than a small list holds), each
 * round after freeing some buffers and allocating others of other sizes (the fake may
 * hand out the freed addresses again), then a fake_noop launch with a pointer into a
 * freed buffer.  What an interposer must report for each launch is printed as
 * "expect": per launch (in order), the [base, size] of every live allocation one of its
 * pointer parameters points into, first appearance first.  Results are checked on
 * the host.  Usage: t_scan [SEED]
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

enum { NB = 12, N = 200, ROUNDS = 6, MAXE = 4096 };

struct buf {
	CUdeviceptr d;
	size_t size;
};

static struct buf bufs[NB + 1]; /* bufs[NB]: the output, never freed */
static char expect[MAXE];
static size_t elen;

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(expect + elen, sizeof(expect) - elen, fmt, ap);
	va_end(ap);
	if (n > 0 && (size_t)n < sizeof(expect) - elen)
		elen += (size_t)n;
	else
		CHECK(0, "expect buffer full");
}

/* The live buffer containing p, or -1. */
static int owner(CUdeviceptr p)
{
	for (int i = 0; i <= NB; i++)
		if (bufs[i].d && p >= bufs[i].d && p < bufs[i].d + bufs[i].size)
			return i;
	return -1;
}

/* One launch's expected list: the owners of ptrs, first appearance first. */
static void expect_launch(const CUdeviceptr *ptrs, int n)
{
	int seen[NB + 1] = { 0 }, first = 1;
	emit("%s[", elen > 1 ? ", " : "");
	for (int i = 0; i < n; i++) {
		int o = owner(ptrs[i]);
		if (o < 0 || seen[o])
			continue;
		seen[o] = 1;
		emit("%s[%llu, %zu]", first ? "" : ", ", (unsigned long long)bufs[o].d, bufs[o].size);
		first = 0;
	}
	emit("]");
}

static void fill(int i, float base)
{
	float *h = malloc(bufs[i].size);
	for (size_t k = 0; k < bufs[i].size / 4; k++)
		h[k] = base + (float)(k % 7);
	htod(bufs[i].d, h, bufs[i].size);
	free(h);
}

int main(int argc, char **argv)
{
	unsigned seed = argc > 1 ? (unsigned)atoi(argv[1]) : 1;
	char extra[MAXE + 64];
	CUdeviceptr out = 0;
	float *h[NB], got[N];

	work_init();
	CUfunction gather;
	CU(cuModuleGetFunction, &gather, w_mod, "fake_gather");
	srand(seed);
	emit("[");
	out = dalloc(4 * N);
	bufs[NB].d = out;
	bufs[NB].size = 4 * N;
	for (int i = 0; i < NB; i++) {
		bufs[i].size = 4096 + 1024 * (size_t)(i % 3);
		bufs[i].d = dalloc(bufs[i].size);
		fill(i, (float)i);
	}
	for (int r = 0; r < ROUNDS; r++) {
		/* Free two buffers, allocate two of other sizes: the map changes between launches. */
		for (int k = 0; k < 2; k++) {
			int i = rand() % NB;
			CUdeviceptr stale = bufs[i].d;
			dfree(bufs[i].d);
			bufs[i].d = 0;
			/* A launch naming the freed address: only a live allocation there may be reported. */
			CUdeviceptr a0 = stale + 8, a1 = bufs[(i + 1) % NB].d, a2 = 12345, a3 = out;
			void *np[] = { &a0, &a1, &a2, &a3 };
			CUdeviceptr nptrs[] = { a0, a1, a2, a3 };
			launch_n(w_noop, 1, NULL, np);
			expect_launch(nptrs, 4);
			bufs[i].size = 4096 + 512 * (size_t)(rand() % 8);
			bufs[i].d = dalloc(bufs[i].size);
			fill(i, (float)(r * NB + i));
		}
		struct fake_gather_arg g;
		CUdeviceptr ptrs[FAKE_GATHER_SRCS + 1];
		for (int j = 0; j < FAKE_GATHER_SRCS; j++) {
			/* 0..11 each once, then repeats, one of them interior (the kernel reads N
			 * floats from it: every buffer has room for 64 bytes more). */
			int i = j < NB ? (j + r) % NB : rand() % NB;
			CUdeviceptr p = bufs[i].d + (j == FAKE_GATHER_SRCS - 1 ? 64 : 0);
			g.src[j] = (const float *)(uintptr_t)p;
			ptrs[j] = p;
		}
		ptrs[FAKE_GATHER_SRCS] = out;
		int n = N;
		void *params[] = { &g, &out, &n };
		launch_n(gather, N, NULL, params);
		expect_launch(ptrs, FAKE_GATHER_SRCS + 1);
		/* The kernel's result, checked on the host. */
		for (int i = 0; i < NB; i++) {
			h[i] = malloc(bufs[i].size);
			dtoh(h[i], bufs[i].d, bufs[i].size);
		}
		dtoh(got, out, sizeof(got));
		for (int k = 0; k < N; k++) {
			float want = 0.0f;
			for (int j = 0; j < FAKE_GATHER_SRCS; j++)
				want += h[owner(ptrs[j])][(ptrs[j] - bufs[owner(ptrs[j])].d) / 4 + (size_t)k];
			CHECK(got[k] == want, "round %d: out[%d] = %g, want %g", r, k, got[k], want);
		}
		for (int i = 0; i < NB; i++)
			free(h[i]);
	}
	emit("]");
	for (int i = 0; i < NB; i++)
		dfree(bufs[i].d);
	dfree(out);
	work_fini();
	snprintf(extra, sizeof(extra), ", \"expect\": %s", expect);
	return finish("t_scan", extra);
}
