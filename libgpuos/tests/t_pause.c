/* SPDX-License-Identifier: MIT */
/*
 * t_pause - operations while a controller has paused recording (linked with -lcuda).
 *
 * Three phases, each ended by a line on stdout ("phase N done") and begun by a line
 * read from stdin, so that a test can run `gpuos trace pause|resume PID` between them:
 *   1. allocate A, copy into it, launch fake_noop(A);
 *   2. (paused) allocate B, copy into it, launch fake_noop(B) three times, memset B;
 *   3. (resumed) launch fake_noop(B), free A and B.
 * The JSON line gives A and B so the test can check that the launch of phase 3 names
 * B, allocated while paused, and that nothing of phase 2 but B's allocation was
 * recorded.  Usage: t_pause [SEED]
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

enum { N = 256 };

static void next_phase(int done)
{
	char line[64];
	printf("phase %d done (pid %d)\n", done, (int)getpid());
	fflush(stdout);
	CHECK(fgets(line, sizeof line, stdin) != NULL, "no line on stdin after phase %d", done);
}

static void noop(CUdeviceptr p)
{
	void *params[] = { &p, &p, &p, &p };
	launch_n(w_noop, 1, NULL, params);
}

int main(int argc, char **argv)
{
	float h[N];
	char extra[128];

	rng_seed(seed_from_args(argc, argv));
	work_init();
	rng_fill(h, N);
	CUdeviceptr a = dalloc(sizeof h);
	htod(a, h, sizeof h);
	noop(a);
	next_phase(1);

	CUdeviceptr b = dalloc(sizeof h);
	htod(b, h, sizeof h);
	for (int i = 0; i < 3; i++)
		noop(b);
	CU(cuMemsetD32_v2, b, 7, N);
	C.memsets++;
	next_phase(2);

	noop(b);
	float got[N];
	dtoh(got, b, sizeof got);
	CHECK(fbits(got[0]) == 7u, "B[0] = %#x after the memset, want 7", fbits(got[0]));
	dfree(a);
	dfree(b);
	work_fini();
	snprintf(extra, sizeof extra, ", \"a\": %llu, \"b\": %llu", (unsigned long long)a, (unsigned long long)b);
	return finish("t_pause", extra);
}
