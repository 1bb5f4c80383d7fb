/* SPDX-License-Identifier: MIT */
/*
 * t_agent - an application whose device memory gpuos moves under it (the agent's host
 * test): three large allocations (2 MiB, 5 MiB + 3 bytes, 8 MiB) and a small one; at
 * iteration k every byte j of allocation i is (j * 31 + i * 7 + k) & 0xff.  Each
 * iteration reads all four back, checks them against iteration k, and writes k + 1.
 * Prints "ready PID BASE..." once allocated, and "ok ITERATIONS" when the file named by
 * argv[1] exists (at least argv[2] iterations, default 1); exits 1 at the first byte that
 * differs.  With argv[3] "free-early": once argv[1] exists, it frees the allocations
 * after the next one it touches and prints "freed" (a free while gpuos fills them).
 * Linked with -lcuda.
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	fprintf(stderr, "%s failed: %d\n", #call, (int)r_); return 1; } } while (0)

static const size_t sizes[] = { 2u << 20, (5u << 20) + 3, 8u << 20, 4096 };
#define N (sizeof sizes / sizeof sizes[0])

static void content(unsigned char *p, size_t n, unsigned i, unsigned k)
{
	for (size_t j = 0; j < n; j++)
		p[j] = (unsigned char)(j * 31 + i * 7 + k);
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return fprintf(stderr, "usage: t_agent STOPFILE [MIN_ITERATIONS]\n"), 2;
	long min_iters = argc > 2 ? atol(argv[2]) : 1;
	CUdevice dev;
	CUcontext ctx;
	CUdeviceptr d[N];
	unsigned char *want = malloc(8u << 20), *got = malloc(8u << 20);
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	for (unsigned i = 0; i < N; i++) {
		CK(cuMemAlloc(&d[i], sizes[i]));
		content(want, sizes[i], i, 0);
		CK(cuMemcpyHtoD(d[i], want, sizes[i]));
	}
	printf("ready %d", (int)getpid());
	for (unsigned i = 0; i < N; i++)
		printf(" %llu", (unsigned long long)d[i]);
	printf("\n");
	fflush(stdout);
	long k = 0;
	int free_early = argc > 3 && strcmp(argv[3], "free-early") == 0;
	for (;; k++) {
		for (unsigned i = 0; i < N; i++) {
			CK(cuMemcpyDtoH(got, d[i], sizes[i]));
			content(want, sizes[i], i, (unsigned)k);
			if (memcmp(got, want, sizes[i])) {
				size_t j = 0;
				while (got[j] == want[j])
					j++;
				fprintf(stderr, "iteration %ld: allocation %u byte %zu is %u, not %u\n", k, i, j, got[j], want[j]);
				return 1;
			}
			content(want, sizes[i], i, (unsigned)k + 1);
			CK(cuMemcpyHtoD(d[i], want, sizes[i]));
			if (free_early && access(argv[1], F_OK) == 0) {
				for (unsigned j = 0; j < N; j++)
					CK(cuMemFree(d[j]));
				printf("freed\n");
				return 0;
			}
		}
		if (k + 1 >= min_iters && access(argv[1], F_OK) == 0)
			break;
		struct timespec ts = { 0, 1000000 };
		nanosleep(&ts, NULL);
	}
	for (unsigned i = 0; i < N; i++)
		CK(cuMemFree(d[i]));
	printf("ok %ld\n", k + 1);
	return 0;
}
