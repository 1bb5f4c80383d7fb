/* SPDX-License-Identifier: MIT */
/*
 * t_ctx_reuse - a context destroyed with memory still allocated in it, then a new one
 * that gets the same handle (the fake, like a real driver, may hand it out again): the
 * old context's memory is gone (the fake unmaps it). Operations in the new context must
 * not make an interposer touch it (a validator that hashed it would fault). Prints
 * "reused 1" if the handle was reused, then "ok". Linked with -lcuda.
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	fprintf(stderr, "%s failed: %d\n", #call, (int)r_); return 1; } } while (0)

int main(void)
{
	CUdevice dev;
	CUcontext a, b;
	CUdeviceptr stale, buf;
	unsigned char host[4096];
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	CK(cuCtxCreate(&a, NULL, 0, dev));
	CK(cuMemAlloc(&stale, 1 << 20));
	CK(cuMemsetD8(stale, 7, 1 << 20));
	CK(cuCtxDestroy(a)); /* stale goes with it, never freed by the program */
	CK(cuCtxCreate(&b, NULL, 0, dev));
	printf("reused %d\n", a == b);
	CK(cuMemAlloc(&buf, sizeof host));
	for (int i = 0; i < 20; i++) {
		CK(cuMemsetD8(buf, (unsigned char)i, sizeof host));
		CK(cuMemcpyDtoH(host, buf, sizeof host));
		if (host[0] != (unsigned char)i || host[sizeof host - 1] != (unsigned char)i)
			return fprintf(stderr, "wrong contents\n"), 1;
	}
	CK(cuMemFree(buf));
	CK(cuCtxDestroy(b));
	printf("ok\n");
	return 0;
}
