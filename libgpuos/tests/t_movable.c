/* SPDX-License-Identifier: MIT */
/*
 * t_movable - device allocations as an application makes them, checked for what it can
 * see: three large ones (3 MiB + 5 bytes, 8 MiB, 2 MiB) and a small one (4 KiB), filled
 * from the host, copied device to device both ways between large and small, memset,
 * read back; cuMemGetAddressRange contains each; freed, and allocated again.  Prints
 * "ok" and, per allocation, "ALLOC base size" (the test reads the launch log for which
 * of them libgpuos made movable).  With the argument "ctx": allocations of a context of
 * its own are freed with it; "ipc": CUDA IPC handles of a large and a small allocation.  Linked with -lcuda.
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	fprintf(stderr, "%s failed: %d\n", #call, (int)r_); return 1; } } while (0)

static const size_t sizes[] = { (3u << 20) + 5, 8u << 20, 2u << 20, 4096 };
#define N (sizeof sizes / sizeof sizes[0])

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 131 + seed * 7 + (i >> 12));
}

/* "ctx": allocations made in a context of its own go with it when it is destroyed (device
 * memory free again, as with the driver's own allocations), three times over. */
static int destroyed_context_frees(CUdevice dev)
{
	size_t free0, free1, total;
	CUcontext primary;
	CK(cuDevicePrimaryCtxRetain(&primary, dev));
	CK(cuCtxSetCurrent(primary));
	CK(cuMemGetInfo(&free0, &total));
	for (int round = 0; round < 3; round++) {
		CUcontext c;
		CUdeviceptr big, small;
		CK(cuCtxCreate(&c, NULL, 0, dev));
		CK(cuMemAlloc(&big, 8u << 20));
		CK(cuMemAlloc(&small, 4096));
		CK(cuMemsetD8(big, 1, 8u << 20));
		CK(cuCtxDestroy(c));
		CK(cuMemGetInfo(&free1, &total));
		if (free1 != free0)
			return fprintf(stderr, "round %d: %zu bytes free after the destroy, %zu before\n", round, free1,
				       free0), 1;
	}
	printf("ok\n");
	return 0;
}

/* "ipc": cuIpcGetMemHandle of a large and a small allocation; prints both results. */
static int ipc(void)
{
	CUdeviceptr big, small;
	CUipcMemHandle h;
	CK(cuMemAlloc(&big, 8u << 20));
	CK(cuMemAlloc(&small, 4096));
	printf("ipc big=%d small=%d\n", (int)cuIpcGetMemHandle(&h, big), (int)cuIpcGetMemHandle(&h, small));
	return 0;
}

int main(int argc, char **argv)
{
	CUdevice dev;
	CUcontext ctx;
	CUdeviceptr d[N];
	unsigned char *want[N], *got = malloc(8u << 20);
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	if (argc > 1 && !strcmp(argv[1], "ctx"))
		return destroyed_context_frees(dev);
	if (argc > 1 && !strcmp(argv[1], "ipc")) {
		CK(cuDevicePrimaryCtxRetain(&ctx, dev));
		CK(cuCtxSetCurrent(ctx));
		return ipc();
	}
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	for (int round = 0; round < 2; round++) {
		for (size_t i = 0; i < N; i++) {
			CK(cuMemAlloc(&d[i], sizes[i]));
			want[i] = malloc(sizes[i]);
			fill(want[i], sizes[i], (unsigned)(i + 10 * round));
			CK(cuMemcpyHtoD(d[i], want[i], sizes[i]));
			CUdeviceptr base;
			size_t size;
			CK(cuMemGetAddressRange(&base, &size, d[i] + sizes[i] - 1));
			if (base != d[i] || size < sizes[i])
				return fprintf(stderr, "range of %zu: %llx+%zu\n", i, (unsigned long long)base, size), 1;
			printf("ALLOC %llu %zu\n", (unsigned long long)d[i], sizes[i]);
		}
		/* small <-> large, memset in the middle of a large one */
		CK(cuMemcpyDtoD(d[3], d[0] + 4096, 4096));
		memcpy(want[3], want[0] + 4096, 4096);
		CK(cuMemcpyDtoD(d[1] + (5u << 20), d[3], 4096));
		memcpy(want[1] + (5u << 20), want[3], 4096);
		CK(cuMemsetD8(d[2] + 100, 0xab, 1000));
		memset(want[2] + 100, 0xab, 1000);
		CK(cuCtxSynchronize());
		for (size_t i = 0; i < N; i++) {
			CK(cuMemcpyDtoH(got, d[i], sizes[i]));
			if (memcmp(got, want[i], sizes[i]))
				return fprintf(stderr, "allocation %zu differs (round %d)\n", i, round), 1;
		}
		for (size_t i = 0; i < N; i++) {
			CK(cuMemFree(d[i]));
			free(want[i]);
		}
	}
	printf("ok\n");
	return 0;
}
