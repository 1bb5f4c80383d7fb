/* SPDX-License-Identifier: MIT */
/*
 * fake_cublas.c - a stand-in for libcublas.so, for the test of a warm standby's cuBLAS
 * warm-up (blaswarm.c): its handle calls succeed, and each cublasGemmEx launches through
 * the driver (a kernel the fake driver refuses: the launch is what the test looks at)
 * and writes one line to $FAKE_CUBLAS_LOG: the thread, the launch's result, the shape.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuda.h>

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			      unsigned, CUstream, void **, void **);

int cublasCreate_v2(void **h)
{
	static int handle;
	*h = &handle;
	return 0;
}

int cublasSetStream_v2(void *h, CUstream s)
{
	(void)h;
	(void)s;
	return 0;
}

int cublasGemmEx(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int at, int lda,
		 const void *b, int bt, int ldb, const void *beta, void *c, int ct, int ldc, int compute, int algo)
{
	(void)h, (void)alpha, (void)a, (void)at, (void)lda, (void)b, (void)bt, (void)ldb, (void)beta;
	(void)c, (void)ct, (void)ldc, (void)algo;
	launch_fn launch = (launch_fn)dlsym(RTLD_DEFAULT, "cuLaunchKernel"); /* libgpuos's, preloaded */
	CUresult rc = launch ? launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) : CUDA_ERROR_NOT_FOUND;
	const char *path = getenv("FAKE_CUBLAS_LOG");
	FILE *f = path ? fopen(path, "a") : NULL;
	if (f) {
		fprintf(f, "%d %d %d %d %d %d %d %d %d\n", gettid(), getpid(), (int)rc, ta, tb, m, n, k, compute);
		fclose(f);
	}
	return 0;
}
