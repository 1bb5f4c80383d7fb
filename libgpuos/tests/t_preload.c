/* SPDX-License-Identifier: MIT */
/*
 * t_preload - a module's kernel launched first, then a library loaded from an image in
 * this program (as the CUDA runtime loads a fatbin only when one of its kernels is first
 * needed) and its kernel launched: what a warm standby loads ahead while it waits at its
 * first launch (libgpuos/src/preload.c).  Results checked on the host.  Usage: t_preload
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

static const char image[] = "fake library of t_preload, loaded after the first launch";

static void fill(CUfunction f, CUdeviceptr d, float v, int n)
{
	void *params[] = { &d, &v, &n };
	launch_n(f, n, NULL, params);
}

int main(void)
{
	enum { N = 1000 };
	float out[N];
	CUlibrary lib;
	CUkernel k;
	CUlibraryOption opt = CU_LIBRARY_BINARY_IS_PRESERVED;
	void *preserved = (void *)(uintptr_t)1;

	work_init();
	CUdeviceptr d = dalloc(N * 4);
	fill(w_fill, d, 1.0f, N); /* the first launch: a warm standby stops here */
	CU(cuLibraryLoadData, &lib, image, NULL, NULL, 0, &opt, &preserved, 1);
	CU(cuLibraryGetKernel, &k, lib, "fake_fill");
	fill((CUfunction)k, d, 2.0f, N);
	CU(cuCtxSynchronize);
	dtoh(out, d, N * 4);
	check_all("after the library's fill: out", out, N, 2.0f);
	sum_bytes(out, N * 4);
	CU(cuLibraryUnload, lib);
	dfree(d);
	work_fini();
	return finish("t_preload", "");
}
