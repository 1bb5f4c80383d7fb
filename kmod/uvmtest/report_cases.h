/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * report_cases.h - the tests of the fault batch report builder
 * (patches/nvidia-uvm/uvm_gpuos_report.c); see uvm_cases.h.  Whatever the
 * faults, the report must be one gpuos.ko accepts (its checks, gpuos_hooks.h)
 * and hold the lowest distinct pages.
 */
#ifndef REPORT_CASES_H
#define REPORT_CASES_H

#define RPT_PAGE 4096ull

/* What gpuos_report_fault_batch() refuses (kmod/hooks.c), for the fields built here. */
static bool report_acceptable(const struct gpuos_fault_batch_report *r)
{
	u32 i, sum = 0;

	if (r->nr_faults == 0 || r->nr_faults > GPUOS_FAULT_BATCH_MAX_FAULTS)
		return false;
	if (r->nr_instances < r->nr_faults || r->nr_fatal > r->nr_faults || r->nr_throttled > r->nr_faults)
		return false;
	for (i = 0; i < __GPUOS_ACCESS_MAX; i++)
		sum += r->nr_by_access[i];
	if (sum != r->nr_faults)
		return false;
	if (r->nr_addrs == 0 || r->nr_addrs > GPUOS_FAULT_BATCH_ADDRS || r->nr_addrs > r->nr_faults)
		return false;
	if (r->addr_min > r->addr_max || r->addr_min % RPT_PAGE || r->addr_max % RPT_PAGE)
		return false;
	for (i = 0; i < r->nr_addrs; i++) {
		if (r->addrs[i] % RPT_PAGE || r->addrs[i] < r->addr_min || r->addrs[i] > r->addr_max)
			return false;
		if (i > 0 && r->addrs[i] <= r->addrs[i - 1])
			return false;
	}
	return true;
}

static void report_case_one_fault(void)
{
	struct gpuos_fault_batch_report r = { 0 };

	gpuos_report_add_fault(&r, 0x7000, 3, true, false, GPUOS_ACCESS_WRITE);
	CHECK(r.nr_faults == 1 && r.nr_instances == 3 && r.nr_fatal == 1 && r.nr_throttled == 0);
	CHECK(r.nr_by_access[GPUOS_ACCESS_WRITE] == 1);
	CHECK(r.addr_min == 0x7000 && r.addr_max == 0x7000);
	CHECK(r.nr_addrs == 1 && r.addrs[0] == 0x7000);
	CHECK(report_acceptable(&r));
}

/* 580 sorts by VA space, then GPU, then address: two ascending runs, pages repeated. */
static void report_case_two_gpus(void)
{
	struct gpuos_fault_batch_report r = { 0 };
	static const u64 gpu0[] = { 0x10000, 0x11000, 0x30000, 0x31000, 0x50000 };
	static const u64 gpu1[] = { 0x08000, 0x11000, 0x20000, 0x30000, 0x40000, 0x60000 };
	static const u64 want[] = { 0x08000, 0x10000, 0x11000, 0x20000, 0x30000, 0x31000, 0x40000, 0x50000 };
	u32 i;

	for (i = 0; i < ARRAY_SIZE(gpu0); i++)
		gpuos_report_add_fault(&r, gpu0[i], 1, false, false, GPUOS_ACCESS_READ);
	for (i = 0; i < ARRAY_SIZE(gpu1); i++)
		gpuos_report_add_fault(&r, gpu1[i], 1, false, i == 0, GPUOS_ACCESS_READ);
	CHECK(r.nr_faults == 11 && r.nr_throttled == 1);
	CHECK(r.addr_min == 0x08000 && r.addr_max == 0x60000);
	CHECK(r.nr_addrs == GPUOS_FAULT_BATCH_ADDRS);
	for (i = 0; i < ARRAY_SIZE(want); i++)
		CHECK(r.addrs[i] == want[i]);
	CHECK(report_acceptable(&r));
}

static void report_case_unknown_access_counts_as_atomic(void)
{
	struct gpuos_fault_batch_report r = { 0 };

	u32 access[] = { GPUOS_ACCESS_PREFETCH, 4, 77, ~0u, GPUOS_ACCESS_READ };
	u32 i;

	for (i = 0; i < ARRAY_SIZE(access); i++)
		gpuos_report_add_fault(&r, 0x1000, 1, false, false, access[i]);
	CHECK(r.nr_by_access[GPUOS_ACCESS_ATOMIC] == 3);
	CHECK(r.nr_by_access[GPUOS_ACCESS_PREFETCH] == 1 && r.nr_by_access[GPUOS_ACCESS_READ] == 1);
	CHECK(r.nr_addrs == 1 && report_acceptable(&r));
}

/* Random batches of one client: against a reference (every distinct page).  The
 * pages are not on the stack: a kernel stack frame holds 2 KiB at most. */
static u64 report_pages[256];

static void report_case_random(u64 seed, u32 rounds)
{
	u32 round;

	for (round = 0; round < rounds; round++) {
		struct gpuos_fault_batch_report r = { 0 };
		u64 s = seed * 7919 + round + 1, *pages = report_pages;
		u32 by_access[__GPUOS_ACCESS_MAX] = { 0 }, instances = 0, fatal = 0;
		u32 n = 1 + uvm_rand(&s) % 256, npages = 0, i, j, runs = 1 + uvm_rand(&s) % 3;
		u64 span = 1 + uvm_rand(&s) % 64, base = (uvm_rand(&s) % (1ull << 30)) * RPT_PAGE;
		u32 per_run = (n + runs - 1) / runs, k = 0;

		/* runs ascending runs (GPUs), each sorted, with repeats */
		while (k < n) {
			u64 a = base, step;

			for (i = 0; i < per_run && k < n; i++, k++) {
				step = uvm_rand(&s) % 3;	/* 0: the same page again */
				a += step * RPT_PAGE * (1 + uvm_rand(&s) % span);
				{
					u32 inst = 1 + uvm_rand(&s) % 4, acc = uvm_rand(&s) % 6;
					bool fat = uvm_rand(&s) % 8 == 0;

					gpuos_report_add_fault(&r, a, inst, fat, uvm_rand(&s) % 8 == 0, acc);
					by_access[acc < __GPUOS_ACCESS_MAX ? acc : GPUOS_ACCESS_ATOMIC]++;
					instances += inst;
					fatal += fat;
				}
				for (j = 0; j < npages && pages[j] != a; j++)
					;
				if (j == npages)
					pages[npages++] = a;
			}
		}
		CHECK(r.nr_faults == n && r.nr_instances == instances && r.nr_fatal == fatal);
		for (i = 0; i < __GPUOS_ACCESS_MAX; i++)
			CHECK(r.nr_by_access[i] == by_access[i]);
		CHECK(report_acceptable(&r));
		/* the reference: the lowest distinct pages, selection by counting */
		for (i = 0; i < r.nr_addrs; i++) {
			u32 below = 0;

			for (j = 0; j < npages; j++)
				below += pages[j] < r.addrs[i];
			CHECK(below == i);		/* exactly i distinct pages are lower */
			for (j = 0; j < npages && pages[j] != r.addrs[i]; j++)
				;
			CHECK(j < npages);		/* a page that faulted */
		}
		CHECK(r.nr_addrs == (npages < GPUOS_FAULT_BATCH_ADDRS ? npages : GPUOS_FAULT_BATCH_ADDRS));
	}
}

static void report_run_all(u64 seed, u32 rounds)
{
	report_case_one_fault();
	report_case_two_gpus();
	report_case_unknown_access_counts_as_atomic();
	report_case_random(seed, rounds);
}

#endif /* REPORT_CASES_H */
