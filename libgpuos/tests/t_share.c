/* SPDX-License-Identifier: MIT */
/*
 * t_share - start-up memory a warm standby maps from its client (libgpuos/src/sharemem.c).
 * Usage: t_share client|standby
 *
 * Both: four 4 MiB buffers (twice the fake's VMM granularity) copied in before the first
 * launch, buffers 0-2 with a pattern every process writes alike, buffer 3 with one of
 * this process's own (its pid); then the first launch, on a small buffer.
 * client: prints {"ready": true}, then for each line "write" on stdin copies a new
 * pattern into buffer 0 (as a training client changes its weights) and prints
 * {"written": true}; ends at the end of its input.
 * standby: after its first launch (where a warm standby waits until it is released),
 * reads the buffers back: each must hold what this process put there, whatever its
 * client wrote since.  Prints {"ok": ..., "bad": [...]}, and runs 3 s more (the
 * standby's report after its release is written 2 s after it).
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

enum { NBUF = 4, WORDS = (4 << 20) / 4 };

static void pattern(uint32_t *w, int i, uint32_t salt)
{
	for (uint32_t j = 0; j < WORDS; j++)
		w[j] = i == 3 ? (uint32_t)getpid() * 2654435761u ^ j : (uint32_t)i * 1000003u + j + salt;
}

int main(int argc, char **argv)
{
	int client = argc > 1 && !strcmp(argv[1], "client");
	uint32_t *h = malloc((size_t)WORDS * 4), *back = malloc((size_t)WORDS * 4);
	CUdeviceptr d[NBUF];
	work_init();
	for (int i = 0; i < NBUF; i++) {
		d[i] = dalloc((size_t)WORDS * 4);
		pattern(h, i, 0);
		htod(d[i], h, (size_t)WORDS * 4);
	}
	enum { N = 1000 };
	CUdeviceptr small = dalloc(N * 4);
	float v = 1.0f;
	int n = N;
	void *params[] = { &small, &v, &n };
	launch_n(w_fill, N, NULL, params); /* the first launch: a warm standby waits here */
	CU(cuCtxSynchronize);
	if (client) {
		printf("{\"ready\": true}\n");
		fflush(stdout);
		char line[64];
		while (fgets(line, sizeof line, stdin)) {
			if (strncmp(line, "write", 5))
				continue;
			pattern(h, 0, 7);
			htod(d[0], h, (size_t)WORDS * 4);
			CU(cuCtxSynchronize);
			printf("{\"written\": true}\n");
			fflush(stdout);
		}
	} else {
		char bad[64] = "";
		size_t o = 0;
		for (int i = 0; i < NBUF; i++) {
			pattern(h, i, 0);
			dtoh(back, d[i], (size_t)WORDS * 4);
			if (memcmp(h, back, (size_t)WORDS * 4))
				o += (size_t)snprintf(bad + o, sizeof bad - o, "%s%d", o ? ", " : "", i);
		}
		printf("{\"ok\": %s, \"bad\": [%s]}\n", o ? "false" : "true", bad);
		fflush(stdout);
		sleep(3); /* a program that runs on: libgpuos's report after the release is written */
	}
	for (int i = 0; i < NBUF; i++)
		dfree(d[i]);
	dfree(small);
	work_fini();
	free(h);
	free(back);
	(void)finish; /* libgpuos makes calls of its own here: the fake's counts are not the program's */
	return 0;
}
