/* SPDX-License-Identifier: MIT */
/*
 * t_validate - launches for `gpuos run --validate` (linked with -lcuda).
 * Usage: t_validate [SEED]
 *
 *   fake_fill(A) and fake_saxpy(X, Y): every written buffer is a parameter: no misses.
 *   fake_indirect(P, 3, N): P is a device array holding D0, D1, D2; the kernel writes
 *     D0..D2 [0, N floats), which no parameter names: the validator must report them
 *     as misses (the first 2 chunks of each).
 *   fake_opaque(O): no parameter layout: flagged layout-unknown, touching everything.
 *   Q is allocated and never written after its upload.
 *
 * The JSON line adds "buffers" (name -> base address, hex), "sizes", the operations in
 * order ("ops": copies and launches, as libgpuos numbers them in seq order),
 * "indirect_targets" (the bases fake_indirect wrote) and "indirect_written" (bytes
 * written at the start of each).
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

enum { N = 1500, DSIZE = 3 * 4096 + 100 };

static char ops[4096];
static size_t nops;

static void op(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void op(const char *fmt, ...)
{
	va_list ap;
	size_t o = strlen(ops);
	if (o + 2 >= sizeof(ops))
		return;
	o += (size_t)snprintf(ops + o, sizeof(ops) - o, "%s", nops++ ? ", " : "");
	va_start(ap, fmt);
	vsnprintf(ops + o, sizeof(ops) - o, fmt, ap);
	va_end(ap);
}

static void dtoh_op(void *h, CUdeviceptr d, size_t n)
{
	dtoh(h, d, n);
	op("{\"op\": \"copy\", \"src\": \"0x%llx\", \"bytes\": %zu}", (unsigned long long)d, n);
}

int main(int argc, char **argv)
{
	uint64_t seed = seed_from_args(argc, argv);
	static float hx[N], hy[N], out[DSIZE / 4];
	char extra[8192];
	CUdeviceptr A, X, Y, P, O, Q, D[3];
	float fv = 2.5f, a;
	int n = N, nptrs = 3;

	rng_seed(seed);
	work_init();
	A = dalloc(N * 4), X = dalloc(N * 4), Y = dalloc(N * 4), P = dalloc(3 * 8), O = dalloc(N * 4);
	Q = dalloc(N * 4);
	for (int j = 0; j < 3; j++)
		D[j] = dalloc(DSIZE);
	rng_fill(hx, N);
	rng_fill(hy, N);
	a = rng_float();
	htod(X, hx, sizeof(hx));
	op("{\"op\": \"copy\", \"dst\": \"0x%llx\", \"bytes\": %d}", (unsigned long long)X, N * 4);
	htod(Y, hy, sizeof(hy));
	op("{\"op\": \"copy\", \"dst\": \"0x%llx\", \"bytes\": %d}", (unsigned long long)Y, N * 4);
	htod(Q, hy, sizeof(hy));
	op("{\"op\": \"copy\", \"dst\": \"0x%llx\", \"bytes\": %d}", (unsigned long long)Q, N * 4);
	htod(P, D, sizeof(D));
	op("{\"op\": \"copy\", \"dst\": \"0x%llx\", \"bytes\": %d}", (unsigned long long)P, (int)sizeof(D));

	void *pf[] = { &A, &fv, &n };
	launch_n(w_fill, N, NULL, pf);
	op("{\"op\": \"launch\", \"kernel\": \"fake_fill\", \"misses\": false}");
	void *ps[] = { &a, &X, &Y, &n };
	launch_n(w_saxpy, N, NULL, ps);
	op("{\"op\": \"launch\", \"kernel\": \"fake_saxpy\", \"misses\": false}");
	void *pi[] = { &P, &nptrs, &n };
	launch_n(w_indirect, N, NULL, pi);
	op("{\"op\": \"launch\", \"kernel\": \"fake_indirect\", \"misses\": true}");
	void *po[] = { &O, &n };
	launch_n(w_opaque, N, NULL, po);
	op("{\"op\": \"launch\", \"kernel\": \"fake_opaque\", \"misses\": false}");

	dtoh_op(out, A, N * 4);
	for (int i = 0; i < N; i++)
		CHECK(out[i] == 2.5f, "A[%d] = %g", i, out[i]);
	sum_bytes(out, N * 4);
	dtoh_op(out, Y, N * 4);
	for (int i = 0; i < N; i++)
		CHECK(feq(out[i], a * hx[i] + hy[i]), "Y[%d]", i);
	sum_bytes(out, N * 4);
	for (int j = 0; j < 3; j++) {
		dtoh_op(out, D[j], DSIZE);
		for (int i = 0; i < N; i++)
			CHECK(out[i] == (float)(j + 1), "D%d[%d] = %g", j, i, out[i]);
		sum_bytes(out, N * 4);
	}
	dtoh_op(out, O, N * 4);
	for (int i = 0; i < N; i++)
		CHECK(out[i] == 7.0f, "O[%d] = %g", i, out[i]);
	dtoh_op(out, Q, N * 4);
	check_floats("Q", out, hy, N);

	snprintf(extra, sizeof(extra),
		 ", \"seed\": %" PRIu64 ", \"buffers\": {\"A\": \"0x%llx\", \"X\": \"0x%llx\", \"Y\": \"0x%llx\", "
		 "\"P\": \"0x%llx\", \"O\": \"0x%llx\", \"Q\": \"0x%llx\", \"D0\": \"0x%llx\", \"D1\": \"0x%llx\", "
		 "\"D2\": \"0x%llx\"}, \"sizes\": {\"A\": %d, \"X\": %d, \"Y\": %d, \"P\": 24, \"O\": %d, \"Q\": %d, "
		 "\"D0\": %d, \"D1\": %d, \"D2\": %d}, \"indirect_targets\": [\"0x%llx\", \"0x%llx\", \"0x%llx\"], "
		 "\"indirect_written\": %d, \"ops\": [%s]",
		 seed, (unsigned long long)A, (unsigned long long)X, (unsigned long long)Y, (unsigned long long)P,
		 (unsigned long long)O, (unsigned long long)Q, (unsigned long long)D[0], (unsigned long long)D[1],
		 (unsigned long long)D[2], N * 4, N * 4, N * 4, N * 4, N * 4, DSIZE, DSIZE, DSIZE,
		 (unsigned long long)D[0], (unsigned long long)D[1], (unsigned long long)D[2], N * 4, ops);
	dfree(A), dfree(X), dfree(Y), dfree(P), dfree(O), dfree(Q);
	for (int j = 0; j < 3; j++)
		dfree(D[j]);
	work_fini();
	return finish("t_validate", extra);
}
