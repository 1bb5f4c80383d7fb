/* SPDX-License-Identifier: MIT */
/*
 * kernels.c - the fake driver's built-in kernels: C functions over host memory.
 * A kernel's parameter layout is taken from a C struct of its parameters (the CUDA
 * ABI lays parameters out like the members of such a struct).
 */
#include <stddef.h>
#include <stdint.h>

#include "fakecuda.h"
#include "kernels.h"

#define ARG(T, i) (*(T *)p[i])
#define PM(S, m) offsetof(S, m)
#define PS(S, m) sizeof(((S *)0)->m)

struct a_fill { float *out; float v; int n; };
static void k_fill(void **p)
{
	float *out = ARG(float *, 0);
	float v = ARG(float, 1);
	if (!fake_range_ok(out, 4LL * ARG(int, 2)))
		return;
	for (int i = 0; i < ARG(int, 2); i++)
		out[i] = v;
}

struct a_saxpy { float a; const float *x; float *y; int n; };
static void k_saxpy(void **p)
{
	float a = ARG(float, 0);
	const float *x = ARG(const float *, 1);
	float *y = ARG(float *, 2);
	if (!fake_range_ok(x, 4LL * ARG(int, 3)) || !fake_range_ok(y, 4LL * ARG(int, 3)))
		return;
	for (int i = 0; i < ARG(int, 3); i++)
		y[i] = a * x[i] + y[i];
}

struct a_struct { struct fake_struct_arg s; };
static void k_struct(void **p)
{
	struct fake_struct_arg s = ARG(struct fake_struct_arg, 0);
	if (!fake_range_ok(s.src, 4LL * s.n) || !fake_range_ok(s.dst, 4LL * s.n))
		return;
	for (int i = 0; i < s.n; i++)
		s.dst[i] = 2.0f * s.src[i];
}

struct a_interior { float *p; int n; };
static void k_interior(void **p)
{
	float *q = ARG(float *, 0);
	if (!fake_range_ok(q, 4LL * ARG(int, 1)))
		return;
	for (int i = 0; i < ARG(int, 1); i++)
		q[i] = (float)i + 0.5f;
}

struct a_indirect { float **ptrs; int nptrs; int n; };
static void k_indirect(void **p)
{
	float **ptrs = ARG(float **, 0);
	if (!fake_range_ok(ptrs, 8LL * ARG(int, 1)))
		return;
	for (int j = 0; j < ARG(int, 1); j++)
		if (!fake_range_ok(ptrs[j], 4LL * ARG(int, 2)))
			return;
	for (int j = 0; j < ARG(int, 1); j++)
		for (int i = 0; i < ARG(int, 2); i++)
			ptrs[j][i] = (float)(j + 1);
}

struct a_opaque { float *out; int n; };
static void k_opaque(void **p)
{
	float *out = ARG(float *, 0);
	if (!fake_range_ok(out, 4LL * ARG(int, 1)))
		return;
	for (int i = 0; i < ARG(int, 1); i++)
		out[i] = 7.0f;
}

struct a_strided { int n; struct fake_strided_arg f; };
static void k_strided(void **p)
{
	int n = ARG(int, 0);
	struct fake_strided_arg f = ARG(struct fake_strided_arg, 1);
	for (int j = 0; j < 3; j++)
		if (!fake_range_ok(f.data[j], 4LL * n))
			return;
	for (int i = 0; i < n; i++)
		f.data[0][i] = f.data[1][i] + f.data[2][i];
}

struct a_gather { struct fake_gather_arg g; float *out; int n; };
static void k_gather(void **p)
{
	struct fake_gather_arg g = ARG(struct fake_gather_arg, 0);
	float *out = ARG(float *, 1);
	int n = ARG(int, 2);
	for (int j = 0; j < FAKE_GATHER_SRCS; j++)
		if (!fake_range_ok(g.src[j], 4LL * n))
			return;
	if (!fake_range_ok(out, 4LL * n))
		return;
	for (int i = 0; i < n; i++) {
		float sum = 0.0f;
		for (int j = 0; j < FAKE_GATHER_SRCS; j++)
			sum += g.src[j][i];
		out[i] = sum;
	}
}

struct a_noop { void *a, *b, *c, *d; };
static void k_noop(void **p)
{
	(void)p;
}

struct a_hash { const struct fakecuda_fp_seg *segs; unsigned nsegs; uint64_t *out; uint64_t nchunks; };
static void k_hash(void **p)
{
	const struct fakecuda_fp_seg *segs = ARG(const struct fakecuda_fp_seg *, 0);
	uint64_t *out = ARG(uint64_t *, 2), nchunks = ARG(uint64_t, 3);
	if (!fake_range_ok(segs, 24LL * ARG(unsigned, 1)) || !fake_range_ok(out, 8LL * (long long)nchunks))
		return;
	for (unsigned s = 0; s < ARG(unsigned, 1); s++)
		if (!fake_range_ok((const void *)(uintptr_t)segs[s].base, (long long)segs[s].size))
			return;
	for (unsigned s = 0; s < ARG(unsigned, 1); s++) {
		const unsigned char *b = (const unsigned char *)(uintptr_t)segs[s].base;
		uint64_t size = segs[s].size;
		for (uint64_t c = 0; c * FAKECUDA_CHUNK < size; c++) {
			uint64_t idx = segs[s].first_chunk + c, end = (c + 1) * FAKECUDA_CHUNK;
			uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a: position-dependent */
			if (idx >= nchunks)
				break;
			if (end > size)
				end = size;
			for (uint64_t i = c * FAKECUDA_CHUNK; i < end; i++) {
				h ^= b[i];
				h *= 0x100000001b3ULL;
			}
			out[idx] = h;
		}
	}
}

struct a_diff { const uint64_t *before; const uint64_t *after; uint64_t nchunks; uint64_t *changed; unsigned *count; };
static void k_diff(void **p)
{
	const uint64_t *before = ARG(const uint64_t *, 0), *after = ARG(const uint64_t *, 1);
	uint64_t *changed = ARG(uint64_t *, 3);
	unsigned *count = ARG(unsigned *, 4);
	long long n = (long long)ARG(uint64_t, 2);
	if (!fake_range_ok(before, 8 * n) || !fake_range_ok(after, 8 * n) || !fake_range_ok(changed, 8 * n) ||
	    !fake_range_ok(count, 4))
		return;
	for (uint64_t c = 0; c < ARG(uint64_t, 2); c++)
		if (before[c] != after[c])
			changed[(*count)++] = c;
}

/* preload.c's kernel that can print and never does: runs as k_noop */
struct a_never { unsigned never; };

#define L1(S, a) 1, {PM(S, a)}, {PS(S, a)}, sizeof(S)
#define L2(S, a, b) 2, {PM(S, a), PM(S, b)}, {PS(S, a), PS(S, b)}, sizeof(S)
#define L3(S, a, b, c) 3, {PM(S, a), PM(S, b), PM(S, c)}, {PS(S, a), PS(S, b), PS(S, c)}, sizeof(S)
#define L4(S, a, b, c, d) 4, {PM(S, a), PM(S, b), PM(S, c), PM(S, d)}, \
	{PS(S, a), PS(S, b), PS(S, c), PS(S, d)}, sizeof(S)
#define L5(S, a, b, c, d, e) 5, {PM(S, a), PM(S, b), PM(S, c), PM(S, d), PM(S, e)}, \
	{PS(S, a), PS(S, b), PS(S, c), PS(S, d), PS(S, e)}, sizeof(S)

const struct fk fake_kernels[] = {
	{"fake_fill", k_fill, L3(struct a_fill, out, v, n), 0, 0},
	{"fake_saxpy", k_saxpy, L4(struct a_saxpy, a, x, y, n), 0, 0},
	{"fake_struct", k_struct, L1(struct a_struct, s), 0, 0},
	{"fake_interior", k_interior, L2(struct a_interior, p, n), 0, 0},
	{"fake_indirect", k_indirect, L3(struct a_indirect, ptrs, nptrs, n), 0, 0},
	{"fake_opaque", k_opaque, L2(struct a_opaque, out, n), 1, 0},
	{"fake_noop", k_noop, L4(struct a_noop, a, b, c, d), 0, 0},
	{"fake_gather", k_gather, L3(struct a_gather, g, out, n), 0, 0},
	{"fake_strided", k_strided, L2(struct a_strided, n, f), 0, 0},
	{"gpuos_fp_hash", k_hash, L4(struct a_hash, segs, nsegs, out, nchunks), 0, 1},
	{"gpuos_fp_diff", k_diff, L5(struct a_diff, before, after, nchunks, changed, count), 0, 1},
	{"gpuos_printf_ready", k_noop, L1(struct a_never, never), 0, 1},
};
const unsigned fake_nkernels = sizeof(fake_kernels) / sizeof(fake_kernels[0]);

_Static_assert(sizeof(struct fake_struct_arg) == 24, "fake_struct param is 24 bytes");
_Static_assert(sizeof(struct fake_strided_arg) == 528, "fake_strided functor is 528 bytes");
_Static_assert(sizeof(struct fakecuda_fp_seg) == 24, "fp segment is 24 bytes");
