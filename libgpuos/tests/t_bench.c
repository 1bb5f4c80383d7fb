/* SPDX-License-Identifier: MIT */
/*
 * t_bench - the host cost of a launch: N cuLaunchKernel calls of fake_noop with 4
 * pointer arguments (into allocated buffers), timed with CLOCK_MONOTONIC (linked with
 * -lcuda).  Usage: t_bench [N [NBUFS]]   (N = 100000; NBUFS = 0 extra live buffers,
 * to grow an interposer's allocation map)
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

static void tally_n(const char *name, long long n)
{
	if (n <= 0)
		return;
	tally(name);
	for (int i = 0; i < g_ntally; i++)
		if (!strcmp(g_tally[i].name, name))
			g_tally[i].n += n - 1;
}

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	long long n = argc > 1 ? atoll(argv[1]) : 100000, nbufs = argc > 2 ? atoll(argv[2]) : 0, bad = 0;
	const long long warm = 1000;
	CUdeviceptr b[4], *extra_bufs;
	char extra[160];
	double t0, t1;

	if (n <= 0 || nbufs < 0) {
		fprintf(stderr, "usage: t_bench [N [NBUFS]]\n");
		return 2;
	}
	work_init();
	for (int i = 0; i < 4; i++)
		b[i] = dalloc(1 << 20);
	extra_bufs = calloc((size_t)nbufs + 1, sizeof(*extra_bufs));
	for (long long i = 0; i < nbufs; i++)
		extra_bufs[i] = dalloc(4096 + 64 * (size_t)(i % 7));
	CUdeviceptr a0 = b[0], a1 = b[1] + 64, a2 = b[2] + 4096, a3 = b[3] + 12345;
	void *params[] = { &a0, &a1, &a2, &a3 };

	for (long long i = 0; i < warm; i++)
		bad += cuLaunchKernel(w_noop, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) != CUDA_SUCCESS;
	t0 = now_ns();
	for (long long i = 0; i < n; i++)
		bad += cuLaunchKernel(w_noop, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) != CUDA_SUCCESS;
	t1 = now_ns();
	tally_n("cuLaunchKernel", warm + n);
	C.launches += warm + n - bad;
	CHECK(bad == 0, "%lld launches failed", bad);

	for (long long i = 0; i < nbufs; i++)
		dfree(extra_bufs[i]);
	free(extra_bufs);
	for (int i = 0; i < 4; i++)
		dfree(b[i]);
	work_fini();
	snprintf(extra, sizeof(extra), ", \"n\": %lld, \"nbufs\": %lld, \"ns_per_launch\": %.1f", n, nbufs,
		 (t1 - t0) / (double)n);
	return finish("t_bench", extra);
}
