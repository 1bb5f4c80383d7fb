/* SPDX-License-Identifier: MIT */
/*
 * t_bench - the host cost of a launch: N cuLaunchKernel calls, timed with
 * CLOCK_MONOTONIC (linked with -lcuda), of fake_noop with 4 pointer arguments (into
 * allocated buffers) or, with KIND strided, of fake_strided (PyTorch's elementwise
 * shape: 532 bytes of parameters, 3 pointers after 504 bytes of integers).
 * Usage: t_bench [N [NBUFS [KIND [EVICT_KB]]]]   (N = 100000; NBUFS = 0 extra live
 * buffers, to grow an interposer's allocation map; KIND = noop; EVICT_KB = 0: between
 * two launches, write this much other memory, as an application does, so that what a
 * launch touches is no longer in the caches close to the core)
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

	const char *kind = argc > 3 ? argv[3] : "noop";
	int strided = !strcmp(kind, "strided");
	long long evict_kb = argc > 4 ? atoll(argv[4]) : 0;
	if (n <= 0 || nbufs < 0 || (!strided && strcmp(kind, "noop")) || evict_kb < 0) {
		fprintf(stderr, "usage: t_bench [N [NBUFS [noop|strided [EVICT_KB]]]]\n");
		return 2;
	}
	size_t evict_n = (size_t)evict_kb * 1024 / sizeof(uint64_t);
	uint64_t *evict = calloc(evict_n + 1, sizeof *evict);

	work_init();
	for (int i = 0; i < 4; i++)
		b[i] = dalloc(1 << 20);
	extra_bufs = calloc((size_t)nbufs + 1, sizeof(*extra_bufs));
	for (long long i = 0; i < nbufs; i++)
		extra_bufs[i] = dalloc(4096 + 64 * (size_t)(i % 7));
	CUdeviceptr a0 = b[0], a1 = b[1] + 64, a2 = b[2] + 4096, a3 = b[3] + 12345;
	void *noop_params[] = { &a0, &a1, &a2, &a3 };
	/* a 64-element add over three buffers; the divisors and strides are what PyTorch's
	 * offset calculator holds for a 4-d tensor (the rest of the 25 dims zero) */
	int count = 64;
	struct fake_strided_arg f = { .dims = 4, .data = { (float *)(uintptr_t)b[0], (float *)(uintptr_t)b[1],
							  (float *)(uintptr_t)b[2] } };
	for (int d = 0; d < 4; d++) {
		f.divisor[d][0] = 7u << d;
		f.divisor[d][1] = 0x92492493u >> d;
		f.divisor[d][2] = 2 + d;
		f.stride[d][0] = f.stride[d][1] = 4u << (2 * d);
	}
	void *strided_params[] = { &count, &f };
	CUfunction fn = w_noop;
	void **params = noop_params;
	if (strided) {
		CU(cuModuleGetFunction, &fn, w_mod, "fake_strided");
		params = strided_params;
	}

	for (long long i = 0; i < warm; i++)
		bad += cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) != CUDA_SUCCESS;
	/* with eviction only the calls are timed, each on its own */
	double in_calls = 0;
	t0 = now_ns();
	for (long long i = 0; i < n; i++) {
		double c0 = evict_n ? now_ns() : 0;
		bad += cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) != CUDA_SUCCESS;
		if (evict_n) {
			in_calls += now_ns() - c0;
			for (size_t j = 0; j < evict_n; j += 8)
				evict[j] += (uint64_t)i;
		}
	}
	t1 = evict_n ? t0 + in_calls : now_ns();
	free(evict);
	tally_n("cuLaunchKernel", warm + n);
	C.launches += warm + n - bad;
	CHECK(bad == 0, "%lld launches failed", bad);

	for (long long i = 0; i < nbufs; i++)
		dfree(extra_bufs[i]);
	free(extra_bufs);
	for (int i = 0; i < 4; i++)
		dfree(b[i]);
	work_fini();
	snprintf(extra, sizeof(extra), ", \"n\": %lld, \"nbufs\": %lld, \"kind\": \"%s\", \"ns_per_launch\": %.1f",
		 n, nbufs, kind, (t1 - t0) / (double)n);
	return finish("t_bench", extra);
}
