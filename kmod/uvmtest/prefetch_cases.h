/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * prefetch_cases.h - the tests of the prefetch clipping
 * (patches/nvidia-uvm/uvm_gpuos_prefetch.c); see uvm_cases.h.
 */
#ifndef PREFETCH_CASES_H
#define PREFETCH_CASES_H

static void prefetch_case_fixed(void)
{
	/* a va_block [0x200000, 0x3fffff] */
	const u64 first = 0x200000, last = 0x3fffff;
	struct gpuos_prefetch_range r[] = {
		{ 0x210000, 0x1000 },		/* inside */
		{ 0x1ff000, 0x3000 },		/* across the start */
		{ 0x3ff000, 0x2000 },		/* across the end */
		{ 0x100000, 0x400000 },		/* over the whole block */
		{ 0x100000, 0x100000 },		/* ends just below */
		{ 0x400000, 0x1000 },		/* starts just above */
		{ 0x220000, 0 },		/* empty */
		{ ~0ull - 0xfff, 0x2000 },	/* runs past the top of the address space */
	};
	struct gpuos_span out[ARRAY_SIZE(r)];
	u32 n = gpuos_prefetch_clip(r, ARRAY_SIZE(r), first, last, out);

	CHECK(n == 4);
	CHECK(out[0].first == 0x210000 && out[0].last == 0x210fff);
	CHECK(out[1].first == 0x200000 && out[1].last == 0x201fff);
	CHECK(out[2].first == 0x3ff000 && out[2].last == 0x3fffff);
	CHECK(out[3].first == first && out[3].last == last);

	/* The wrapping range meets a block at the very top. */
	n = gpuos_prefetch_clip(&r[7], 1, ~0ull - 0x1fffff, ~0ull, out);
	CHECK(n == 1 && out[0].first == ~0ull - 0xfff && out[0].last == ~0ull);
	CHECK(gpuos_prefetch_clip(r, 0, first, last, out) == 0);
}

static void prefetch_case_random(u64 seed, u32 rounds)
{
	u32 round;

	for (round = 0; round < rounds; round++) {
		struct gpuos_prefetch_range r[16];
		struct gpuos_span out[16];
		u64 s = seed * 104729 + round + 1;
		u64 bfirst = (uvm_rand(&s) % 64) << 21, blast = bfirst + (1ull << 21) - 1;
		u32 n = uvm_rand(&s) % 17, i, k = 0, got;

		if (round % 50 == 0)	/* the top of the address space */
			bfirst = ~0ull - (1ull << 21) + 1, blast = ~0ull;
		for (i = 0; i < n; i++) {
			r[i].base = bfirst - (2ull << 20) + (uvm_rand(&s) % 1536) * 4096;
			r[i].len = (uvm_rand(&s) % 1200) * 4096;
		}
		got = gpuos_prefetch_clip(r, n, bfirst, blast, out);
		CHECK(got <= n);
		/* the reference: the same walk, the range's last byte computed without wrapping */
		for (i = 0; i < n && k <= got; i++) {
			u64 rlast = r[i].len > ~0ull - r[i].base ? ~0ull : r[i].base + r[i].len - 1;
			u64 f, l;

			if (r[i].len == 0 || r[i].base > blast || rlast < bfirst)
				continue;
			f = r[i].base > bfirst ? r[i].base : bfirst;
			l = rlast < blast ? rlast : blast;
			CHECK(k < got);
			if (k < got)
				CHECK(out[k].first == f && out[k].last == l);
			k++;
		}
		CHECK(k == got);
		for (i = 0; i < got; i++)
			CHECK(out[i].first >= bfirst && out[i].last <= blast && out[i].first <= out[i].last);
	}
}

static void prefetch_run_all(u64 seed, u32 rounds)
{
	prefetch_case_fixed();
	prefetch_case_random(seed, rounds);
}

#endif /* PREFETCH_CASES_H */
