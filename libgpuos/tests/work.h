/* SPDX-License-Identifier: MIT */
/*
 * work.h - the workload shared by t_direct, t_dlsym, t_procaddr and t_fork: real work
 * on the fake driver through FN(sym), every result checked on the host.
 *
 *   work_init()       cuInit, device, primary context made current, a module
 *   work_main()       allocations of every kind, copies (1D, 2D, 3D, peer, unified,
 *                     async), memsets, launches (cuLaunchKernel, cuLaunchKernelEx,
 *                     cooperative, `extra`, CUkernel, interior pointer, by-value
 *                     struct, pinned/registered/managed/VMM memory as arguments)
 *                     modules from files and data, created contexts, a small graph
 *   work_semantics()  the fake's handle and parameter-info rules, error returns
 *                     (needs entry points of CUDA >= 12.4)
 *   work_fini()       unload, release the primary context
 */
#ifndef GPUOS_TESTS_WORK_H
#define GPUOS_TESTS_WORK_H

#include "common.h"

static CUdevice w_dev;
static CUcontext w_ctx;
static CUmodule w_mod;
static CUfunction w_fill, w_saxpy, w_struct, w_interior, w_indirect, w_opaque, w_noop, w_hash, w_diff;

static __attribute__((unused)) unsigned blocks(int n) { return (unsigned)((n + 255) / 256); }

static __attribute__((unused)) void launch_n(CUfunction f, int n, CUstream s, void **params)
{
	CU(cuLaunchKernel, f, blocks(n), 1, 1, 256, 1, 1, 0, s, params, NULL);
	C.launches++;
}

static __attribute__((unused)) CUdeviceptr dalloc(size_t n)
{
	CUdeviceptr d = 0;
	if (CU(cuMemAlloc_v2, &d, n) == CUDA_SUCCESS)
		COUNT_ALLOC(device);
	return d;
}

static __attribute__((unused)) void dfree(CUdeviceptr d)
{
	if (CU(cuMemFree_v2, d) == CUDA_SUCCESS)
		C.frees++;
}

static __attribute__((unused)) void htod(CUdeviceptr d, const void *h, size_t n)
{
	CU(cuMemcpyHtoD_v2, d, h, n);
	C.copies++;
}

static __attribute__((unused)) void dtoh(void *h, CUdeviceptr d, size_t n)
{
	CU(cuMemcpyDtoH_v2, h, d, n);
	C.copies++;
}

static __attribute__((unused)) unsigned fbits(float f)
{
	unsigned u;
	memcpy(&u, &f, 4);
	return u;
}

static __attribute__((unused)) void work_init(void)
{
	int ver = 0, count = 0;
	char name[128];
	CUcontext cur = NULL;
	CU(cuInit, 0);
	CU(cuDriverGetVersion, &ver);
	CHECK(ver == 13000, "driver version %d", ver);
	CU(cuDeviceGetCount, &count);
	CHECK(count == 1, "%d devices", count);
	CU(cuDeviceGet, &w_dev, 0);
	CU(cuDeviceGetName, name, (int)sizeof(name), w_dev);
	CU(cuDevicePrimaryCtxRetain, &w_ctx, w_dev);
	CU(cuCtxSetCurrent, w_ctx);
	CU(cuCtxGetCurrent, &cur);
	CHECK(cur == w_ctx, "current context %p, expected %p", (void *)cur, (void *)w_ctx);
	CU(cuModuleLoadData, &w_mod, "fake module image: any NUL-terminated text");
	CU(cuModuleGetFunction, &w_fill, w_mod, "fake_fill");
	CU(cuModuleGetFunction, &w_saxpy, w_mod, "fake_saxpy");
	CU(cuModuleGetFunction, &w_struct, w_mod, "fake_struct");
	CU(cuModuleGetFunction, &w_interior, w_mod, "fake_interior");
	CU(cuModuleGetFunction, &w_indirect, w_mod, "fake_indirect");
	CU(cuModuleGetFunction, &w_opaque, w_mod, "fake_opaque");
	CU(cuModuleGetFunction, &w_noop, w_mod, "fake_noop");
	CU(cuModuleGetFunction, &w_hash, w_mod, "gpuos_fp_hash");
	CU(cuModuleGetFunction, &w_diff, w_mod, "gpuos_fp_diff");
}

static __attribute__((unused)) void work_fini(void)
{
	CU(cuModuleUnload, w_mod);
	CU(cuDevicePrimaryCtxRelease_v2, w_dev);
}

/* Device buffers, a struct parameter, an interior pointer, Ex and extra launches,
 * memsets, DtoD/unified/peer copies, 2D/3D copies on a pitched allocation. */
static __attribute__((unused)) void work_basic(void)
{
	enum { N1 = 1000, N2 = 3001, N3 = 2500, WOFF = 300, PW = 100, PH = 7 };
	float *hx = malloc(N2 * 4), *hy = malloc(N2 * 4), *want = malloc(N2 * 4), *out = malloc(N2 * 4);
	float hm[PH][PW], hm2[PH][PW], h3[3][40];
	unsigned char hb[777];
	CUdeviceptr x = dalloc(N2 * 4), y = dalloc(N2 * 4), z = dalloc(N2 * 4), w = dalloc((N3 + WOFF) * 4);
	CUdeviceptr u = dalloc(N1 * 4), v = dalloc(N1 * 4), t = dalloc(N2 * 4), t2 = dalloc(N2 * 4);
	CUdeviceptr b8 = dalloc(777), pd = 0;
	size_t pitch = 0;

	rng_fill(hx, N2);
	rng_fill(hy, N2);
	htod(x, hx, N2 * 4);
	htod(y, hy, N2 * 4);

	/* y = a*x + y */
	float a = 1.5f + rng_float();
	int n = N2;
	void *p_saxpy[] = { &a, &x, &y, &n };
	launch_n(w_saxpy, N2, NULL, p_saxpy);
	for (int i = 0; i < N2; i++)
		want[i] = a * hx[i] + hy[i];

	/* z = 2*y through a 24-byte struct passed by value, with cuLaunchKernelEx */
	struct fake_struct_arg sa = { N2, 0, (float *)(uintptr_t)y, (float *)(uintptr_t)z };
	void *p_struct[] = { &sa };
	CUlaunchConfig cfg = { blocks(N2), 1, 1, 256, 1, 1, 0, NULL, NULL, 0 };
	CU(cuLaunchKernelEx, &cfg, w_struct, p_struct, NULL);
	C.launches++;

	/* an interior pointer: w + WOFF floats */
	CUdeviceptr wi = w + WOFF * sizeof(float);
	int ni = N3;
	void *p_int[] = { &wi, &ni };
	launch_n(w_interior, N3, NULL, p_int);

	/* u = 3.25 with cuLaunchKernelEx and a launch attribute */
	float fv = 3.25f;
	int nu = N1;
	void *p_fill[] = { &u, &fv, &nu };
	CUlaunchAttribute attr;
	memset(&attr, 0, sizeof(attr));
	attr.id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
	attr.value.priority = 0;
	CUlaunchConfig cfg2 = { blocks(N1), 1, 1, 256, 1, 1, 0, NULL, &attr, 1 };
	CU(cuLaunchKernelEx, &cfg2, w_fill, p_fill, NULL);
	C.launches++;

	/* v = -2 with the parameters in an `extra` buffer */
	struct { CUdeviceptr out; float v; int n; } eb = { v, -2.0f, N1 };
	size_t ebs = sizeof(eb);
	void *extra[] = { CU_LAUNCH_PARAM_BUFFER_POINTER, &eb, CU_LAUNCH_PARAM_BUFFER_SIZE, &ebs,
			  CU_LAUNCH_PARAM_END };
	CU(cuLaunchKernel, w_fill, blocks(N1), 1, 1, 256, 1, 1, 0, NULL, NULL, extra);
	C.launches++;

	/* cooperative: t2 = 11 */
	float cv = 11.0f;
	int cn = N2;
	void *p_coop[] = { &t2, &cv, &cn };
	CU(cuLaunchCooperativeKernel, w_fill, blocks(N2), 1, 1, 256, 1, 1, 0, NULL, p_coop);
	C.launches++;

	/* memsets: u[100..150) = 9.5; b8 = 0xab, then 16-bit 0x1234 at [2, 22) */
	CU(cuMemsetD32_v2, u + 100 * 4, fbits(9.5f), 50);
	CU(cuMemsetD8_v2, b8, 0xab, 777);
	CU(cuMemsetD16_v2, b8 + 2, 0x1234, 10);
	C.memsets += 3;
	CU(cuStreamWriteValue32_v2, NULL, b8 + 64, 0xdeadbeefu, 0);
	C.write_values++;

	/* t = z (DtoD), then t = 2*x + t through cuMemcpy and a peer copy round trip */
	CU(cuMemcpyDtoD_v2, t, z, N2 * 4);
	CU(cuMemcpy, t2 + 8, t + 8, 400);   /* t2[2..102) = t[2..102) */
	CU(cuMemcpyPeer, t2 + 8, w_ctx, t + 8, w_ctx, 400);
	C.copies += 3;

	/* read back and check */
	dtoh(out, y, N2 * 4);
	check_floats("saxpy y", out, want, N2);
	sum_bytes(out, N2 * 4);
	dtoh(out, z, N2 * 4);
	for (int i = 0; i < N2; i++)
		want[i] *= 2.0f;
	check_floats("struct z", out, want, N2);
	sum_bytes(out, N2 * 4);
	dtoh(out, t, N2 * 4);
	check_floats("dtod t", out, want, N2);
	dtoh(out, t2, N2 * 4);
	for (int i = 0; i < N2; i++)
		CHECK(out[i] == (i >= 2 && i < 102 ? want[i] : 11.0f), "t2[%d] = %g", i, out[i]);
	sum_bytes(out, N2 * 4);
	dtoh(out, w + WOFF * 4, N3 * 4);
	for (int i = 0; i < N3; i++)
		CHECK(out[i] == (float)i + 0.5f, "interior w[%d] = %g", i, out[i]);
	sum_bytes(out, N3 * 4);
	dtoh(out, u, N1 * 4);
	for (int i = 0; i < N1; i++)
		CHECK(out[i] == (i >= 100 && i < 150 ? 9.5f : 3.25f), "u[%d] = %g", i, out[i]);
	sum_bytes(out, N1 * 4);
	dtoh(out, v, N1 * 4);
	for (int i = 0; i < N1; i++)
		CHECK(out[i] == -2.0f, "extra v[%d] = %g", i, out[i]);
	dtoh(hb, b8, 777);
	for (int i = 0; i < 777; i++) {
		unsigned char e = i >= 2 && i < 22 ? (i % 2 ? 0x12 : 0x34) : 0xab;
		if (i >= 64 && i < 68)
			e = (unsigned char)(0xdeadbeefu >> (8 * (i - 64)));
		CHECK(hb[i] == e, "b8[%d] = %#x, expected %#x", i, hb[i], e);
	}
	sum_bytes(hb, 777);

	/* 2D: host matrix -> pitched allocation, a 2D memset, back with another pitch;
	 * 3D: rows 1..3 from column 2 of the pitched allocation */
	if (CU(cuMemAllocPitch_v2, &pd, &pitch, PW * 4, PH, 4) == CUDA_SUCCESS)
		COUNT_ALLOC(pitch);
	CHECK(pitch >= PW * 4, "pitch %zu", pitch);
	for (int r = 0; r < PH; r++)
		rng_fill(hm[r], PW);
	CUDA_MEMCPY2D c2;
	memset(&c2, 0, sizeof(c2));
	c2.srcMemoryType = CU_MEMORYTYPE_HOST;
	c2.srcHost = hm;
	c2.srcPitch = PW * 4;
	c2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
	c2.dstDevice = pd;
	c2.dstPitch = pitch;
	c2.WidthInBytes = PW * 4;
	c2.Height = PH;
	CU(cuMemcpy2D_v2, &c2);
	CU(cuMemsetD2D32_v2, pd + 2 * pitch + 10 * 4, pitch, fbits(1.0f), 5, 3);
	memset(&c2, 0, sizeof(c2));
	c2.srcMemoryType = CU_MEMORYTYPE_DEVICE;
	c2.srcDevice = pd;
	c2.srcPitch = pitch;
	c2.dstMemoryType = CU_MEMORYTYPE_HOST;
	c2.dstHost = hm2;
	c2.dstPitch = PW * 4;
	c2.WidthInBytes = PW * 4;
	c2.Height = PH;
	CU(cuMemcpy2DUnaligned_v2, &c2);
	CUDA_MEMCPY3D c3;
	memset(&c3, 0, sizeof(c3));
	c3.srcMemoryType = CU_MEMORYTYPE_DEVICE;
	c3.srcDevice = pd;
	c3.srcXInBytes = 2 * 4;
	c3.srcY = 1;
	c3.srcPitch = pitch;
	c3.srcHeight = PH;
	c3.dstMemoryType = CU_MEMORYTYPE_HOST;
	c3.dstHost = h3;
	c3.dstPitch = 40 * 4;
	c3.dstHeight = 3;
	c3.WidthInBytes = 40 * 4;
	c3.Height = 3;
	c3.Depth = 1;
	CU(cuMemcpy3D_v2, &c3);
	C.copies += 3;
	C.memsets++;
	for (int r = 0; r < PH; r++)
		for (int i = 0; i < PW; i++) {
			float e = r >= 2 && r < 5 && i >= 10 && i < 15 ? 1.0f : hm[r][i];
			CHECK(hm2[r][i] == e, "2D [%d][%d] = %g, expected %g", r, i, hm2[r][i], e);
		}
	for (int r = 0; r < 3; r++)
		for (int i = 0; i < 40; i++)
			CHECK(h3[r][i] == hm2[r + 1][i + 2], "3D [%d][%d]", r, i);
	sum_bytes(hm2, sizeof(hm2));

	dfree(x), dfree(y), dfree(z), dfree(w), dfree(u), dfree(v), dfree(t), dfree(t2), dfree(b8), dfree(pd);
	free(hx), free(hy), free(want), free(out);
}

/* The CUkernel path: cuLibraryLoadData + cuLibraryGetKernel, launched as a CUfunction. */
static __attribute__((unused)) void work_library(void)
{
	enum { N = 1537 };
	float hx[N], hy[N], out[N];
	CUlibrary lib;
	CUkernel k;
	CUdeviceptr x = dalloc(N * 4), y = dalloc(N * 4);
	float a = 2.0f + rng_float();
	int n = N;
	void *p[] = { &a, &x, &y, &n };
	rng_fill(hx, N);
	rng_fill(hy, N);
	htod(x, hx, sizeof(hx));
	htod(y, hy, sizeof(hy));
	CU(cuLibraryLoadData, &lib, "fake library image", NULL, NULL, 0, NULL, NULL, 0);
	CU(cuLibraryGetKernel, &k, lib, "fake_saxpy");
	CU(cuLaunchKernel, (CUfunction)k, blocks(N), 1, 1, 256, 1, 1, 0, NULL, p, NULL);
	C.launches++;
	dtoh(out, y, sizeof(out));
	for (int i = 0; i < N; i++)
		CHECK(feq(out[i], a * hx[i] + hy[i]), "CUkernel saxpy [%d]", i);
	sum_bytes(out, sizeof(out));
	CU(cuLibraryUnload, lib);
	dfree(x), dfree(y);
}

/* A stream: stream-ordered and pool allocations, async memset/launch/copies, an event. */
static __attribute__((unused)) void work_stream(void)
{
	enum { N = 5000, M = 4000 };
	static float out[N];
	float in[750];
	CUstream s;
	CUevent e;
	CUmemoryPool pool;
	CUdeviceptr as = 0, ap = 0;
	CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
	if (CU(cuMemAllocAsync, &as, N * 4, s) == CUDA_SUCCESS)
		COUNT_ALLOC(async);
	CU(cuMemsetD32Async, as, 0, N, s);
	C.memsets++;
	float v = 4.5f;
	int m = M;
	void *p[] = { &as, &v, &m };
	launch_n(w_fill, M, s, p);
	CU(cuMemcpyDtoHAsync_v2, out, as, N * 4, s);
	C.copies++;
	CU(cuStreamSynchronize, s);
	for (int i = 0; i < N; i++)
		CHECK(out[i] == (i < M ? 4.5f : 0.0f), "async [%d] = %g", i, out[i]);
	sum_bytes(out, sizeof(out));
	CU(cuMemFreeAsync, as, s);
	C.frees++;

	CU(cuDeviceGetDefaultMemPool, &pool, w_dev);
	if (CU(cuMemAllocFromPoolAsync, &ap, sizeof(in), pool, s) == CUDA_SUCCESS)
		COUNT_ALLOC(async);
	rng_fill(in, 750);
	CU(cuMemcpyHtoDAsync_v2, ap, in, sizeof(in), s);
	CU(cuMemcpyDtoDAsync_v2, ap, ap + 1000, 1000, s); /* overlapping: [0,1000) = [1000,2000) */
	CU(cuMemcpyDtoHAsync_v2, out, ap, sizeof(in), s);
	C.copies += 3;
	/* 2D/3D async copies, async memsets of every width, a unified and a peer async copy,
	 * a 64-bit stream write, on a second stream with a priority */
	{
		CUstream s2;
		CUdeviceptr b = dalloc(4096), b2 = dalloc(4096);
		unsigned char hb[4096];
		CUDA_MEMCPY2D c2;
		CUDA_MEMCPY3D c3;
		CU(cuStreamCreateWithPriority, &s2, CU_STREAM_NON_BLOCKING, -1);
		CU(cuMemsetD8Async, b2, 0, 4096, s2);
		CU(cuMemsetD8Async, b, 0x11, 4096, s2);
		CU(cuMemsetD16Async, b + 64, 0x2222, 32, s2);          /* [64, 128) */
		CU(cuMemsetD2D8_v2, b + 1024, 64, 0x33, 16, 4);          /* 4 rows of 16 at pitch 64 */
		CU(cuMemsetD2D16Async, b + 2048, 128, 0x4444, 8, 2, s2); /* 2 rows of 16 bytes */
		CU(cuMemsetD2D32Async, b + 3072, 256, 0x55555555u, 4, 2, s2);
		C.memsets += 6;
		memset(&c2, 0, sizeof(c2));                              /* b2[0..4) rows of 32 = b rows */
		c2.srcMemoryType = CU_MEMORYTYPE_DEVICE, c2.srcDevice = b + 1024, c2.srcPitch = 64;
		c2.dstMemoryType = CU_MEMORYTYPE_DEVICE, c2.dstDevice = b2, c2.dstPitch = 32;
		c2.WidthInBytes = 32, c2.Height = 4;
		CU(cuMemcpy2DAsync_v2, &c2, s2);
		memset(&c3, 0, sizeof(c3));                              /* 2 slices of 2 rows of 8 */
		c3.srcMemoryType = CU_MEMORYTYPE_DEVICE, c3.srcDevice = b + 2048, c3.srcPitch = 128, c3.srcHeight = 2;
		c3.dstMemoryType = CU_MEMORYTYPE_DEVICE, c3.dstDevice = b2 + 512, c3.dstPitch = 8, c3.dstHeight = 2;
		c3.WidthInBytes = 8, c3.Height = 2, c3.Depth = 2;
		CU(cuMemcpy3DAsync_v2, &c3, s2);
		CU(cuMemcpyAsync, b2 + 1024, b + 64, 64, s2);
		CU(cuMemcpyPeerAsync, b2 + 2048, w_ctx, b + 3072, w_ctx, 16, s2);
		C.copies += 4;
		CU(cuStreamWriteValue64_v2, s2, b2 + 4088, 0x0123456789abcdefULL, 0);
		C.write_values++;
		CU(cuStreamSynchronize, s2);
		dtoh(hb, b2, 4096);
		for (int i = 0; i < 4096; i++) {
			unsigned e = 0;
			if (i < 128)
				e = (i % 32) < 16 ? 0x33 : 0x11;
			else if (i >= 512 && i < 544)
				e = i < 528 ? 0x44 : 0x11; /* slice 0 from the 2D memset; slice 1 not */
			else if (i >= 1024 && i < 1088)
				e = 0x22;
			else if (i >= 2048 && i < 2064)
				e = 0x55;
			else if (i >= 4088)
				e = (unsigned)(0x0123456789abcdefULL >> (8 * (i - 4088))) & 0xff;
			if (hb[i] != e) {
				CHECK(0, "async mix b2[%d] = %#x, expected %#x", i, hb[i], e);
				break;
			}
		}
		sum_bytes(hb, sizeof(hb));
		CU(cuStreamDestroy_v2, s2);
		dfree(b), dfree(b2);
	}
	CU(cuEventCreate, &e, 0);
	CU(cuEventRecord, e, s);
	CU(cuStreamWaitEvent, NULL, e, 0);
	CU(cuEventSynchronize, e);
	CU(cuEventDestroy_v2, e);
	for (int i = 0; i < 750; i++)
		CHECK(out[i] == (i < 250 ? in[i + 250] : in[i]), "pool [%d]", i);
	CU(cuMemFreeAsync, ap, s);
	C.frees++;
	CU(cuStreamSynchronize, s);
	CU(cuStreamDestroy_v2, s);
}

/* Host memory the GPU can reach: pinned, mapped, registered, and managed memory. */
static __attribute__((unused)) void work_host_memory(void)
{
	enum { N = 2048 };
	float *ph = NULL, *pm = NULL, *reg = NULL, tmp[1024];
	CUdeviceptr dpm = 0, mg = 0, dev = dalloc(8192);
	int n = N;
	float v = 8.0f;
	if (CU(cuMemAllocHost_v2, (void **)&ph, N * 4) == CUDA_SUCCESS)
		COUNT_ALLOC(host);
	CUdeviceptr dph = (CUdeviceptr)(uintptr_t)ph;
	void *p1[] = { &dph, &v, &n };
	launch_n(w_fill, N, NULL, p1);
	CU(cuCtxSynchronize);
	for (int i = 0; ph && i < N; i++)
		CHECK(ph[i] == 8.0f, "pinned [%d] = %g", i, ph[i]);

	if (CU(cuMemHostAlloc, (void **)&pm, 4096, CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_SUCCESS)
		COUNT_ALLOC(host);
	CU(cuMemHostGetDevicePointer_v2, &dpm, pm, 0);
	int n2 = 1024;
	float v2 = -1.5f;
	void *p2[] = { &dpm, &v2, &n2 };
	launch_n(w_fill, n2, NULL, p2);
	CU(cuCtxSynchronize);
	for (int i = 0; pm && i < 1024; i++)
		CHECK(pm[i] == -1.5f, "mapped [%d]", i);

	/* registered: copy from it, and write it from a kernel */
	if (posix_memalign((void **)&reg, 4096, 8192))
		abort();
	for (int i = 0; i < 2048; i++)
		reg[i] = (float)i;
	if (CU(cuMemHostRegister_v2, reg, 8192, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS)
		COUNT_ALLOC(registered);
	htod(dev, reg, 8192);
	CUdeviceptr dreg = (CUdeviceptr)(uintptr_t)reg;
	float v3 = 6.5f;
	int n3 = 1024;
	void *p3[] = { &dreg, &v3, &n3 };
	launch_n(w_fill, n3, NULL, p3);
	CU(cuCtxSynchronize);
	dtoh(tmp, dev + 4096, 4096);
	for (int i = 0; i < 1024; i++) {
		CHECK(reg[i] == 6.5f, "registered [%d]", i);
		CHECK(tmp[i] == (float)(i + 1024), "from registered [%d]", i);
	}
	CU(cuMemHostUnregister, reg);
	C.frees++;
	free(reg);

	/* managed: the host writes it, a kernel updates it, the host reads it */
	if (CU(cuMemAllocManaged, &mg, N * 4, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS)
		COUNT_ALLOC(managed);
	float *hmg = (float *)(uintptr_t)mg, a = 0.5f;
	for (int i = 0; mg && i < N; i++)
		hmg[i] = (float)i;
	void *p4[] = { &a, &dph, &mg, &n }; /* mg = 0.5 * pinned + mg */
	launch_n(w_saxpy, N, NULL, p4);
	CU(cuCtxSynchronize);
	for (int i = 0; mg && i < N; i++)
		CHECK(hmg[i] == 4.0f + (float)i, "managed [%d] = %g", i, hmg[i]);
	if (mg)
		sum_bytes(hmg, N * 4);
	dfree(mg);
	CU(cuMemFreeHost, ph);
	CU(cuMemFreeHost, pm);
	C.frees += 2;
	dfree(dev);
}

/* A VMM range: reserve, create, map the middle, set access, use, unmap, release, free. */
static __attribute__((unused)) void work_vmm(void)
{
	enum { N = 3001 };
	CUmemAllocationProp prop;
	CUmemAccessDesc ad;
	CUmemGenericAllocationHandle mh;
	CUdeviceptr va = 0, x = dalloc(N * 4);
	size_t g = 0;
	static float hx[N], out[N];
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = 0;
	CU(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	CHECK(g == 2u << 20, "granularity %zu", g);
	if (CU(cuMemAddressReserve, &va, 4 * g, 0, 0, 0) == CUDA_SUCCESS)
		C.vmm_reserve++;
	if (CU(cuMemCreate, &mh, 2 * g, &prop, 0) == CUDA_SUCCESS)
		C.vmm_create++;
	if (CU(cuMemMap, va + g, 2 * g, 0, mh, 0) == CUDA_SUCCESS)
		COUNT_ALLOC(vmm_map);
	memset(&ad, 0, sizeof(ad));
	ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	ad.location.id = 0;
	ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CU(cuMemSetAccess, va + g, 2 * g, &ad, 1);

	CUdeviceptr m = va + g;
	float fv = 0.75f, a = -3.0f;
	int nf = (int)(2 * g / 4) - 3, n = N;
	void *pf[] = { &m, &fv, &nf };
	launch_n(w_fill, nf, NULL, pf);
	rng_fill(hx, N);
	htod(x, hx, sizeof(hx));
	void *ps[] = { &a, &x, &m, &n };
	launch_n(w_saxpy, N, NULL, ps);
	dtoh(out, m, sizeof(out));
	for (int i = 0; i < N; i++)
		CHECK(feq(out[i], a * hx[i] + 0.75f), "vmm [%d]", i);
	sum_bytes(out, sizeof(out));
	dtoh(out, m + 2 * g - 16, 16);
	CHECK(out[0] == 0.75f && out[1] == 0.0f, "vmm tail %g %g", out[0], out[1]);

	if (CU(cuMemUnmap, va + g, 2 * g) == CUDA_SUCCESS)
		C.frees++;
	CU(cuMemRelease, mh);
	CU(cuMemAddressFree, va, 4 * g);
	dfree(x);
}

/* Every way of loading code: a file (cuModuleLoad, cuLibraryLoadFromFile), data with
 * options, a "fat binary"; a missing file. */
static __attribute__((unused)) void work_modules(void)
{
	char path[] = "/tmp/gpuos-fake-module-XXXXXX";
	int fd = mkstemp(path);
	CUmodule m1, m2, m3;
	CUlibrary l;
	CUkernel k;
	CUfunction f;
	CUjit_option opt = CU_JIT_MAX_REGISTERS;
	void *optv = (void *)(uintptr_t)32;
	if (fd < 0 || write(fd, "fake module file\n", 17) != 17) {
		CHECK(0, "temporary module file %s", path);
		return;
	}
	close(fd);
	CU(cuModuleLoad, &m1, path);
	CU(cuModuleGetFunction, &f, m1, "fake_noop");
	CU(cuModuleLoadDataEx, &m2, "fake module with options", 1, &opt, &optv);
	CU(cuModuleLoadFatBinary, &m3, "fake fat binary");
	CU(cuLibraryLoadFromFile, &l, path, NULL, NULL, 0, NULL, NULL, 0);
	CU(cuLibraryGetKernel, &k, l, "fake_fill");
	CU_ERR(CUDA_ERROR_FILE_NOT_FOUND, cuModuleLoad, &m1, "/nonexistent/fake.ptx");
	CU(cuModuleUnload, m2);
	CU(cuModuleUnload, m3);
	CU(cuModuleUnload, m1);
	CU(cuLibraryUnload, l);
	unlink(path);
}

/* A small captured graph (a launch and a memset on a non-blocking stream), instantiated
 * with parameters and launched twice. */
static __attribute__((unused)) void work_graph(void)
{
	enum { N = 777 };
	float out[N], v = 0.5f, a = 2.0f;
	int n = N;
	CUstream s;
	CUgraph g = NULL;
	CUgraphExec ge = NULL;
	CUDA_GRAPH_INSTANTIATE_PARAMS ip;
	CUdeviceptr x = dalloc(N * 4), y = dalloc(N * 4);
	void *pf[] = { &x, &v, &n };
	void *ps[] = { &a, &x, &y, &n };
	CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
	CU(cuMemsetD32_v2, y, fbits(1.0f), N);
	C.memsets++;
	CU(cuStreamBeginCapture_v2, s, CU_STREAM_CAPTURE_MODE_GLOBAL);
	CU(cuMemsetD32Async, x, 0, N, s);
	CU(cuLaunchKernel, w_fill, blocks(N), 1, 1, 256, 1, 1, 0, s, pf, NULL);
	CU(cuLaunchKernel, w_saxpy, blocks(N), 1, 1, 256, 1, 1, 0, s, ps, NULL);
	C.captured += 3;
	CU(cuStreamEndCapture, s, &g);
	memset(&ip, 0, sizeof(ip));
	CU(cuGraphInstantiateWithParams, &ge, g, &ip);
	for (int i = 0; i < 2; i++) {
		CU(cuGraphLaunch, ge, s);
		C.graph_launches++;
		C.graph_kernels += 2;
		C.graph_memsets++;
	}
	CU(cuStreamSynchronize, s);
	dtoh(out, y, sizeof(out));
	for (int i = 0; i < N; i++)
		CHECK(out[i] == 3.0f, "graph y[%d] = %g", i, out[i]);
	sum_bytes(out, sizeof(out));
	CU(cuGraphExecDestroy, ge);
	CU(cuGraphDestroy, g);
	CU(cuStreamDestroy_v2, s);
	dfree(x), dfree(y);
}

/* Created contexts: cuCtxCreate_v4 makes one current, push/pop, destroy. */
static __attribute__((unused)) void work_contexts(void)
{
	CUcontext c = NULL, cur = NULL, popped = NULL;
	CUdeviceptr d = 0;
	CU(cuCtxCreate_v4, &c, NULL, 0, w_dev);
	CU(cuCtxGetCurrent, &cur);
	CHECK(cur == c && c != w_ctx, "cuCtxCreate_v4 did not make its context current");
	d = dalloc(1000);
	CU(cuMemsetD8_v2, d, 1, 1000);
	C.memsets++;
	dfree(d);
	CU(cuCtxPopCurrent_v2, &popped);
	CHECK(popped == c, "popped %p", (void *)popped);
	CU(cuCtxGetCurrent, &cur);
	CHECK(cur == w_ctx, "primary context not current again");
	CU(cuCtxPushCurrent_v2, c);
	CU(cuCtxDestroy_v2, c);
	CU(cuCtxGetCurrent, &cur);
	CHECK(cur == w_ctx, "primary context not current after cuCtxDestroy_v2");
}

static __attribute__((unused)) void work_main(void)
{
	work_modules();
	work_contexts();
	work_graph();
	work_basic();
	work_library();
	work_stream();
	work_host_memory();
	work_vmm();
}

/* The fake's rules that libgpuos depends on, and error returns passed through. */
static __attribute__((unused)) void work_semantics(void)
{
	static const struct { CUfunction *f; unsigned n, off[5], size[5]; } lay[] = {
		{ &w_fill, 3, { 0, 8, 12 }, { 8, 4, 4 } },
		{ &w_saxpy, 4, { 0, 8, 16, 24 }, { 4, 8, 8, 4 } },
		{ &w_struct, 1, { 0 }, { 24 } },
		{ &w_interior, 2, { 0, 8 }, { 8, 4 } },
		{ &w_indirect, 3, { 0, 8, 12 }, { 8, 4, 4 } },
		{ &w_noop, 4, { 0, 8, 16, 24 }, { 8, 8, 8, 8 } },
		{ &w_hash, 4, { 0, 8, 16, 24 }, { 8, 4, 8, 8 } },
		{ &w_diff, 5, { 0, 8, 16, 24, 32 }, { 8, 8, 8, 8, 8 } },
	};
	CUlibrary lib;
	CUkernel k;
	CUfunction kf = NULL, mf = NULL, f;
	CUmodule lm;
	const char *s = NULL;
	size_t off = 0, size = 0;
	CUdeviceptr d = 0, small = dalloc(100);
	CUdevice dev;
	char buf[256] = { 0 };
	float fv = 1.0f;
	int n = 4;
	void *pp[] = { &small, &fv, &n };

	for (size_t i = 0; i < sizeof(lay) / sizeof(lay[0]); i++) {
		for (unsigned j = 0; j < lay[i].n; j++) {
			CU(cuFuncGetParamInfo, *lay[i].f, j, &off, &size);
			CHECK(off == lay[i].off[j] && size == lay[i].size[j], "layout %zu param %u: %zu/%zu", i, j,
			      off, size);
		}
		CU_ERR(CUDA_ERROR_INVALID_VALUE, cuFuncGetParamInfo, *lay[i].f, lay[i].n, &off, &size);
	}
	CU_ERR(CUDA_ERROR_NOT_SUPPORTED, cuFuncGetParamInfo, w_opaque, 0, &off, &size);
	CU(cuFuncGetName, &s, w_struct);
	CHECK(s && !strcmp(s, "fake_struct"), "cuFuncGetName: %s", s ? s : "(null)");

	CU(cuLibraryLoadData, &lib, "another fake library", NULL, NULL, 0, NULL, NULL, 0);
	CU(cuLibraryGetKernel, &k, lib, "fake_saxpy");
	CU(cuKernelGetFunction, &kf, k);
	CHECK((void *)kf != (void *)k, "CUfunction and CUkernel of one kernel are the same pointer");
	CU(cuLibraryGetModule, &lm, lib);
	CU(cuModuleGetFunction, &mf, lm, "fake_saxpy");
	CHECK(mf == kf, "cuKernelGetFunction and the library's module disagree");
	CU(cuKernelGetName, &s, k);
	CHECK(s && !strcmp(s, "fake_saxpy"), "cuKernelGetName: %s", s ? s : "(null)");
	CU(cuKernelGetParamInfo, k, 2, &off, &size);
	CHECK(off == 16 && size == 8, "kernel param 2: %zu/%zu", off, size);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuFuncGetParamInfo, (CUfunction)k, 0, &off, &size);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuKernelGetParamInfo, (CUkernel)kf, 0, &off, &size);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuFuncGetName, &s, (CUfunction)k);
	CU(cuLibraryGetKernel, &k, lib, "fake_opaque");
	CU_ERR(CUDA_ERROR_NOT_SUPPORTED, cuKernelGetParamInfo, k, 0, &off, &size);
	CU_ERR(CUDA_ERROR_NOT_FOUND, cuLibraryGetKernel, &k, lib, "no_such_kernel");
	CU(cuLibraryUnload, lib);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuLibraryUnload, lib);

	/* errors, never crashes */
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFree_v2, (CUdeviceptr)0x1234);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFree_v2, small + 4);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAlloc_v2, NULL, 16);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAlloc_v2, &d, 0);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoD_v2, (CUdeviceptr)0x1000, buf, 16);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoD_v2, small, buf, 200);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpyDtoH_v2, buf, small + 64, 64);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemsetD32_v2, small + 2, 0, 4);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuLaunchKernel, (CUfunction)buf, 1, 1, 1, 1, 1, 1, 0, NULL, pp, NULL);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel, w_fill, 0, 1, 1, 1, 1, 1, 0, NULL, pp, NULL);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel, w_fill, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuLaunchKernel, w_fill, 1, 1, 1, 1, 1, 1, 0, (CUstream)buf, pp, NULL);
	int big = 26; /* small is 100 bytes: 104 are written */
	void *pbig[] = { &small, &fv, &big };
	CU_ERR(CUDA_ERROR_ILLEGAL_ADDRESS, cuLaunchKernel, w_fill, 1, 1, 1, 1, 1, 1, 0, NULL, pbig, NULL);
	CU_ERR(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction, &f, w_mod, "no_such_kernel");
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamSynchronize, (CUstream)buf);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFreeHost, (void *)buf);
	CU_ERR(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, cuMemHostUnregister, buf);
	CU_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet, &dev, 1);
	CU_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleUnload, (CUmodule)buf);
	CU_ERR(CUDA_ERROR_INVALID_IMAGE, cuModuleLoadData, &lm, "");
	CU(cuGetErrorName, CUDA_ERROR_INVALID_VALUE, &s);
	CHECK(s && !strcmp(s, "CUDA_ERROR_INVALID_VALUE"), "cuGetErrorName: %s", s ? s : "(null)");
	CU(cuGetErrorString, CUDA_ERROR_OUT_OF_MEMORY, &s);
	CU_ERR(CUDA_ERROR_INVALID_VALUE, cuGetErrorName, (CUresult)9999, &s);
	dfree(small);
}

#endif /* GPUOS_TESTS_WORK_H */
