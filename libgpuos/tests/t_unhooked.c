/* SPDX-License-Identifier: MIT */
/*
 * t_unhooked - writes device memory through an entry point libgpuos does not track
 * (cuStreamBatchMemOp_v2, a batch of two write-value operations), reached directly and
 * through cuGetProcAddress (only the latter with the argument "proc"), and checks the
 * values landed. Prints "ok". Linked with -lcuda.
 */
#include <cuda.h>
#include <stdio.h>
#include <string.h>

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	fprintf(stderr, "%s failed: %d\n", #call, (int)r_); return 1; } } while (0)

static int batch(CUresult (*fn)(CUstream, unsigned int, CUstreamBatchMemOpParams *, unsigned int),
		 CUdeviceptr d, unsigned v)
{
	CUstreamBatchMemOpParams ops[2];
	memset(ops, 0, sizeof ops);
	for (int i = 0; i < 2; i++) {
		ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
		ops[i].writeValue.address = d + 4 * i;
		ops[i].writeValue.value = v + i;
	}
	return fn(0, 2, ops, 0) != CUDA_SUCCESS;
}

int main(int argc, char **argv)
{
	int direct = !(argc > 1 && !strcmp(argv[1], "proc"));
	CUdevice dev;
	CUcontext ctx;
	CUdeviceptr d;
	unsigned host[2];
	void *viaproc = NULL;
	CUdriverProcAddressQueryResult st;
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	CK(cuMemAlloc(&d, 8));
	if (direct) {
		if (batch(cuStreamBatchMemOp_v2, d, 7))
			return fprintf(stderr, "direct batch failed\n"), 1;
		CK(cuMemcpyDtoH(host, d, 8));
		if (host[0] != 7 || host[1] != 8)
			return fprintf(stderr, "direct: wrote %u %u\n", host[0], host[1]), 1;
	}
	CK(cuGetProcAddress("cuStreamBatchMemOp", &viaproc, 12000, 0, &st));
	if (batch((CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams *, unsigned int))viaproc, d, 40))
		return fprintf(stderr, "batch through cuGetProcAddress failed\n"), 1;
	CK(cuMemcpyDtoH(host, d, 8));
	if (host[0] != 40 || host[1] != 41)
		return fprintf(stderr, "cuGetProcAddress: wrote %u %u\n", host[0], host[1]), 1;
	CK(cuMemFree(d));
	printf("ok\n");
	return 0;
}
