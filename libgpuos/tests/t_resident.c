/* SPDX-License-Identifier: MIT */
/*
 * t_resident - an application with more device memory than `gpuos run --gpu-memory`
 * lets be resident (the memory scheduler's host test): six large allocations (2, 4, 2,
 * 6 MiB + 12 bytes, 2, 4 MiB) and a small one, each with a host copy of what it must
 * hold.  ROUNDS rounds of random work: saxpy launches between two allocations (y += a * x,
 * a kernel that reads one and writes the other), memsets, host-to-device copies of new
 * contents and device-to-device copies; every few rounds an allocation is read back and
 * compared with its host copy, and at the end all are.  Exits 1 at the first byte that
 * differs, else prints "ok ROUNDS" and "ready PID", then waits until the file STOP
 * exists (so that the test can ask for the process's figures).
 *
 *   t_resident STOP ROUNDS SEED           the work above
 *   t_resident STOP 0 SEED big            one launch whose allocations cannot all be
 *                                         resident: prints "refused" if it fails with
 *                                         CUDA_ERROR_OUT_OF_MEMORY
 *   t_resident STOP ROUNDS SEED cycle     ROUNDS rounds that each fill the large
 *                                         allocations in the same order (a training step's
 *                                         pattern: what least-recently-used eviction does
 *                                         worst), then the same checks and wait
 *   t_resident STOP ROUNDS SEED read      ROUNDS rounds that each read the large
 *                                         allocations in the same order (y += a * x into
 *                                         the small one: an inference's weights), then
 *                                         the same checks and wait
 *   t_resident STOP ROUNDS SEED phases    as read, in blocks of PHASE rounds that read only
 *                                         allocations 0 and 1 (6 MiB) and blocks that read
 *                                         them all, one after the other: a working set
 *                                         that grows and shrinks
 *   t_resident STOP ROUNDS SEED small     as read, allocations 0 and 1 only (6 MiB): an
 *                                         application that launches without pause on
 *                                         memory that stays resident
 *   t_resident STOP ROUNDS SEED threads   4 threads at once, each with two 2 MiB
 *                                         allocations of its own and their host copies:
 *                                         ROUNDS launches y += a * x between them, every 5th
 *                                         followed by reading one back and comparing it; the
 *                                         threads' memory evicts each other's under the limit
 *   t_resident STOP 0 SEED opaque         a launch of a kernel without a parameter layout
 *                                         (nothing is predicted: it needs everything),
 *                                         writing 7.0 to allocation 0: prints "refused"
 *                                         as above, or "ok opaque" once that is read back
 *                                         and every other allocation is intact
 *
 * Linked with -lcuda; the fake driver's saxpy checks that its memory is mapped.
 */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	fprintf(stderr, "%s failed: %d\n", #call, (int)r_); return 1; } } while (0)

static const size_t sizes[] = { 2u << 20, 4u << 20, 2u << 20, (6u << 20) + 12, 2u << 20, 4u << 20, 4096 };
#define N (sizeof sizes / sizeof sizes[0])
#define PHASE 2000 /* rounds of each block in mode phases */

static CUdeviceptr dev[N];
static float *host[N];
static CUfunction saxpy;

static size_t nfloats(int i)
{
	return sizes[i] / sizeof(float);
}

static int check(int i)
{
	float *got = malloc(sizes[i]);
	if (!got)
		return 1;
	CK(cuMemcpyDtoH(got, dev[i], sizes[i]));
	int bad = memcmp(got, host[i], sizes[i]);
	if (bad) {
		for (size_t k = 0; k < nfloats(i); k++)
			if (memcmp(&got[k], &host[i][k], sizeof(float))) {
				fprintf(stderr, "allocation %d, float %zu: %g, expected %g\n", i, k, got[k], host[i][k]);
				break;
			}
	}
	free(got);
	return bad ? 1 : 0;
}

static int launch_saxpy(float a, int x, int y, size_t n)
{
	int ni = (int)n;
	void *params[] = { &a, &dev[x], &dev[y], &ni };
	CK(cuLaunchKernel(saxpy, 1, 1, 1, 1, 1, 1, 0, 0, params, NULL));
	for (size_t k = 0; k < n; k++)
		host[y][k] = a * host[x][k] + host[y][k];
	return 0;
}

#define TH 4
#define TH_BYTES (2u << 20)

struct worker {
	pthread_t t;
	CUcontext ctx;
	unsigned seed;
	int rounds, failed;
	CUdeviceptr d[2];
	float *h[2];
};

static int worker_check(struct worker *w, int i, float *got)
{
	if (cuMemcpyDtoH(got, w->d[i], TH_BYTES) != CUDA_SUCCESS)
		return 1;
	return memcmp(got, w->h[i], TH_BYTES) != 0;
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	float *got = malloc(TH_BYTES);
	size_t n = TH_BYTES / sizeof(float);
	if (!got || cuCtxSetCurrent(w->ctx) != CUDA_SUCCESS)
		return w->failed = 1, NULL;
	for (int r = 0; r < w->rounds && !w->failed; r++) {
		int y = (int)(rand_r(&w->seed) % 2), x = 1 - y;
		float a = (float)((int)(rand_r(&w->seed) % 5) - 2) / 4.0f;
		int ni = (int)n;
		void *params[] = { &a, &w->d[x], &w->d[y], &ni };
		if (cuLaunchKernel(saxpy, 1, 1, 1, 1, 1, 1, 0, 0, params, NULL) != CUDA_SUCCESS) {
			w->failed = 1;
			break;
		}
		for (size_t k = 0; k < n; k++)
			w->h[y][k] = a * w->h[x][k] + w->h[y][k];
		if (r % 5 == 4 && worker_check(w, (int)(rand_r(&w->seed) % 2), got))
			w->failed = 1;
	}
	for (int i = 0; i < 2 && !w->failed; i++)
		w->failed = worker_check(w, i, got);
	free(got);
	return NULL;
}

/* "threads": TH threads, each on allocations of its own, evicting each other's. */
static int threads(CUcontext ctx, int rounds, unsigned seed)
{
	struct worker w[TH];
	for (int t = 0; t < TH; t++) {
		w[t] = (struct worker){ .ctx = ctx, .seed = seed * 31 + (unsigned)t, .rounds = rounds };
		for (int i = 0; i < 2; i++) {
			CK(cuMemAlloc(&w[t].d[i], TH_BYTES));
			if (!(w[t].h[i] = malloc(TH_BYTES)))
				return 1;
			for (size_t k = 0; k < TH_BYTES / sizeof(float); k++)
				w[t].h[i][k] = (float)((int)(rand_r(&w[t].seed) % 2001) - 1000) / 64.0f;
			CK(cuMemcpyHtoD(w[t].d[i], w[t].h[i], TH_BYTES));
		}
	}
	for (int t = 0; t < TH; t++)
		if (pthread_create(&w[t].t, NULL, worker_main, &w[t]))
			return 1;
	int failed = 0;
	for (int t = 0; t < TH; t++) {
		pthread_join(w[t].t, NULL);
		if (w[t].failed)
			failed = fprintf(stderr, "thread %d: its memory differs or a call failed\n", t);
	}
	return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc < 4)
		return fprintf(stderr, "usage: t_resident STOP ROUNDS SEED [big]\n"), 2;
	int rounds = atoi(argv[2]);
	srand((unsigned)atoi(argv[3]));
	CUdevice d;
	CUcontext ctx;
	CUmodule mod;
	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, d));
	CK(cuCtxSetCurrent(ctx));
	CK(cuModuleLoadData(&mod, "fake module image: any NUL-terminated text"));
	CK(cuModuleGetFunction(&saxpy, mod, "fake_saxpy"));
	if (argc > 4 && !strcmp(argv[4], "threads")) {
		if (threads(ctx, rounds, (unsigned)atoi(argv[3])))
			return 1;
		printf("ok %d\nready %d\n", rounds, (int)getpid());
		fflush(stdout);
		while (access(argv[1], F_OK))
			usleep(10000);
		return 0;
	}
	for (int i = 0; i < (int)N; i++) {
		CK(cuMemAlloc(&dev[i], sizes[i]));
		host[i] = malloc(sizes[i]);
		if (!host[i])
			return 1;
		for (size_t k = 0; k < nfloats(i); k++)
			host[i][k] = (float)((rand() % 2001) - 1000) / 64.0f;
		CK(cuMemcpyHtoD(dev[i], host[i], sizes[i]));
	}
	/* T_RESIDENT_GATE=DIR: DIR/ready-PID made, then DIR/go waited for (at most 120 s):
	 * the members of a group test begin their rounds together, however long their
	 * start-ups took on a loaded machine */
	const char *gate = getenv("T_RESIDENT_GATE");
	if (gate && *gate) {
		char path[4096];
		snprintf(path, sizeof path, "%s/ready-%d", gate, (int)getpid());
		FILE *f = fopen(path, "w");
		if (f)
			fclose(f);
		snprintf(path, sizeof path, "%s/go", gate);
		for (int waited = 0; access(path, F_OK) && waited < 12000; waited++)
			usleep(10000);
	}
	if (argc > 4 && !strcmp(argv[4], "big")) {
		/* 6 MiB + 4 MiB with a limit below 10 MiB: both cannot be resident at once */
		float a = 1.0f;
		int n = 1024;
		void *params[] = { &a, &dev[3], &dev[5], &n };
		CUresult r = cuLaunchKernel(saxpy, 1, 1, 1, 1, 1, 1, 0, 0, params, NULL);
		printf(r == CUDA_ERROR_OUT_OF_MEMORY ? "refused\n" : "launched: %d\n", (int)r);
		return 0;
	}
	if (argc > 4 && !strcmp(argv[4], "opaque")) {
		CUfunction opaque;
		CK(cuModuleGetFunction(&opaque, mod, "fake_opaque"));
		int n = (int)nfloats(0);
		void *params[] = { &dev[0], &n };
		CUresult r = cuLaunchKernel(opaque, 1, 1, 1, 1, 1, 1, 0, 0, params, NULL);
		if (r == CUDA_ERROR_OUT_OF_MEMORY)
			return printf("refused\n"), 0;
		CK(r);
		for (size_t k = 0; k < nfloats(0); k++)
			host[0][k] = 7.0f;
		for (int i = 0; i < (int)N; i++)
			if (check(i))
				return 1;
		return printf("ok opaque\n"), 0;
	}
	int phases = argc > 4 && !strcmp(argv[4], "phases");
	int small = argc > 4 && !strcmp(argv[4], "small");
	int read = phases || small || (argc > 4 && !strcmp(argv[4], "read"));
	for (int r = 0; read && r < rounds; r++)
		for (int x = 0; x + 1 < (small || (phases && (r / PHASE) % 2 == 0) ? 3 : (int)N); x++)
			if (launch_saxpy((float)(rand() % 5 - 2) / 4.0f, x, (int)N - 1, nfloats((int)N - 1)))
				return 1;
	int cycle = argc > 4 && !strcmp(argv[4], "cycle");
	CUfunction fill = NULL;
	if (cycle)
		CK(cuModuleGetFunction(&fill, mod, "fake_fill"));
	for (int r = 0; cycle && r < rounds; r++)
		for (int i = 0; i + 1 < (int)N; i++) {
			float v = (float)(r * (int)N + i);
			int n = (int)nfloats(i);
			void *params[] = { &dev[i], &v, &n };
			CK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, params, NULL));
			for (size_t k = 0; k < nfloats(i); k++)
				host[i][k] = v;
		}
	for (int r = 0; !cycle && !read && r < rounds; r++) {
		int x = rand() % (int)N, y = rand() % (int)N;
		switch (rand() % 8) {
		case 0: { /* a memset of part of y */
			size_t n = (size_t)rand() % nfloats(y);
			unsigned v = (unsigned)rand();
			CK(cuMemsetD32(dev[y], v, n));
			for (size_t k = 0; k < n; k++)
				memcpy(&host[y][k], &v, sizeof v);
			break;
		}
		case 1: { /* new contents for y, from the host */
			for (size_t k = 0; k < nfloats(y); k++)
				host[y][k] = (float)(rand() % 100);
			CK(cuMemcpyHtoD(dev[y], host[y], sizes[y]));
			break;
		}
		case 2: /* device to device */
			if (x != y) {
				size_t n = sizes[x] < sizes[y] ? sizes[x] : sizes[y];
				CK(cuMemcpyDtoD(dev[y], dev[x], n));
				memcpy(host[y], host[x], n);
			}
			break;
		default: { /* a kernel reading x and writing y */
			if (x == y)
				break;
			size_t n = nfloats(x) < nfloats(y) ? nfloats(x) : nfloats(y);
			if (launch_saxpy((float)(rand() % 5 - 2) / 4.0f, x, y, n))
				return 1;
		}
		}
		if (r % 7 == 6 && check(rand() % (int)N))
			return 1;
	}
	for (int i = 0; i < (int)N; i++)
		if (check(i))
			return 1;
	printf("ok %d\nready %d\n", rounds, (int)getpid());
	fflush(stdout);
	while (access(argv[1], F_OK))
		usleep(10000);
	for (int i = 0; i < (int)N; i++)
		CK(cuMemFree(dev[i]));
	return 0;
}
