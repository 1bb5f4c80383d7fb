/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * isolate_cases.h - the tests of nvidia-uvm's fault-isolation rules
 * (patches/nvidia-uvm/uvm_gpuos_isolate.c); see uvm_cases.h.
 */
#ifndef ISOLATE_CASES_H
#define ISOLATE_CASES_H

#define ISO_REGION GPUOS_ISO_REGION_SIZE
#define ISO_MS 1000000ull

static const struct gpuos_iso_limits iso_on = {
	.enabled = true, .window_ns = 2000 * ISO_MS, .max_bytes = 16 * ISO_REGION,
};

/* One fatal fault, as the driver has it. */
struct iso_fault {
	u64 addr;
	bool unmapped;
};

static struct gpuos_iso_batch iso_batch;
#define iso_regions iso_batch.regions

/* Check faults f[0..n): the batch built, then the verdict; *nr_regions after it. */
static enum gpuos_iso_verdict iso_check_faults(struct gpuos_iso *iso, const struct gpuos_iso_limits *lim,
					       u64 now, bool shares, const struct iso_fault *f, u32 n,
					       u32 *nr_regions)
{
	enum gpuos_iso_verdict v;
	u32 i;

	iso_batch = (struct gpuos_iso_batch){ 0 };
	for (i = 0; i < n; i++)
		gpuos_iso_add_fault(&iso_batch, f[i].addr, f[i].unmapped);
	v = gpuos_iso_check(iso, lim, now, shares, &iso_batch);
	*nr_regions = iso_batch.nr_regions;
	return v;
}

/* Check an unmapped (or mapped) fault at each of addrs (n of them). */
static enum gpuos_iso_verdict iso_check(struct gpuos_iso *iso, const struct gpuos_iso_limits *lim,
					u64 now, bool shares, const u64 *addrs, u32 n,
					bool unmapped, u32 *nr_regions)
{
	struct iso_fault f[GPUOS_ISO_MAX_REGIONS + 2];
	u32 i;

	for (i = 0; i < n; i++) {
		f[i].addr = addrs[i];
		f[i].unmapped = unmapped;
	}
	return iso_check_faults(iso, lim, now, shares, f, n, nr_regions);
}

static void iso_case_not_asked_when_off_or_alone(void)
{
	struct gpuos_iso iso = { 0 };
	struct gpuos_iso_limits off = iso_on;
	u64 a = 0x7f0000001234ull;
	u32 nr = 99;

	off.enabled = false;
	CHECK(iso_check(&iso, &off, 0, true, &a, 1, true, &nr) == GPUOS_ISO_STOCK && nr == 0);
	/* Alone in its channel group: the stock cancel harms nobody else. */
	CHECK(iso_check(&iso, &iso_on, 0, false, &a, 1, true, &nr) == GPUOS_ISO_STOCK && nr == 0);
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 0, true, &nr) == GPUOS_ISO_STOCK && nr == 0);
	CHECK(iso.state == GPUOS_ISO_NONE);
}

static void iso_case_first_fault_asks_then_maps(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x7f0000011234ull;
	u32 nr;

	CHECK(iso_check(&iso, &iso_on, 5 * ISO_MS, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(nr == 1);
	CHECK(iso_regions[0].base == 0x7f0000010000ull);
	CHECK(iso_regions[0].page == 0x7f0000011000ull);
	CHECK(iso.state == GPUOS_ISO_NONE);	/* asking changes nothing */
	CHECK(gpuos_iso_decided(&iso, &iso_on, 5 * ISO_MS, true, nr) == GPUOS_ISO_MAP);
	CHECK(iso.state == GPUOS_ISO_ACTIVE);
	CHECK(iso.deadline_ns == 2005 * ISO_MS);
	gpuos_iso_mapped(&iso, ISO_REGION);
	CHECK(iso.mapped_bytes == ISO_REGION);

	/* Faulting again within the window and the budget: mapped again, no question. */
	a = 0x7f0000020000ull;
	CHECK(iso_check(&iso, &iso_on, 2005 * ISO_MS, true, &a, 1, true, &nr) == GPUOS_ISO_MAP && nr == 1);
	CHECK(iso.state == GPUOS_ISO_ACTIVE);
}

static void iso_case_default_decision_is_stock(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x1000;
	u32 nr;

	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, false, nr) == GPUOS_ISO_STOCK);
	CHECK(iso.state == GPUOS_ISO_NONE);
	/* A second answer for a client already contained (two GPUs asked at once). */
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, true, nr) == GPUOS_ISO_MAP);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, true, nr) == GPUOS_ISO_STOCK);
	CHECK(iso.state == GPUOS_ISO_ACTIVE);
}

static void iso_case_permission_fault_is_stock(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x200000;
	u32 nr;

	/* First fault on mapped memory: cancelled, but the client may still be
	 * contained later (nothing was tried). */
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, false, &nr) == GPUOS_ISO_STOCK && nr == 0);
	CHECK(iso.state == GPUOS_ISO_NONE);

	/* A contained client that then faults on mapped memory: given up for good. */
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, true, nr) == GPUOS_ISO_MAP);
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, false, &nr) == GPUOS_ISO_STOCK && nr == 0);
	CHECK(iso.state == GPUOS_ISO_GAVE_UP);
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, true, &nr) == GPUOS_ISO_STOCK && nr == 0);
}

static void iso_case_mixed_batch_is_stock(void)
{
	struct gpuos_iso iso = { 0 };
	struct iso_fault f[2] = { { 0x10000, true }, { 0x30000, false } };
	u32 nr;

	CHECK(iso_check_faults(&iso, &iso_on, 0, true, f, 2, &nr) == GPUOS_ISO_STOCK);
	CHECK(nr == 0);
}

static void iso_case_deadline(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x40000;
	u32 nr;

	CHECK(iso_check(&iso, &iso_on, 10 * ISO_MS, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 10 * ISO_MS, true, nr) == GPUOS_ISO_MAP);
	CHECK(iso_check(&iso, &iso_on, 2010 * ISO_MS, true, &a, 1, true, &nr) == GPUOS_ISO_MAP);
	CHECK(iso_check(&iso, &iso_on, 2010 * ISO_MS + 1, true, &a, 1, true, &nr) == GPUOS_ISO_STOCK);
	CHECK(iso.state == GPUOS_ISO_GAVE_UP);
	/* Never again, even back within the window. */
	CHECK(iso_check(&iso, &iso_on, 20 * ISO_MS, true, &a, 1, true, &nr) == GPUOS_ISO_STOCK);
}

static void iso_case_deadline_saturates(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x40000, now = ~0ull - 5;
	u32 nr;

	CHECK(iso_check(&iso, &iso_on, now, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, now, true, nr) == GPUOS_ISO_MAP);
	CHECK(iso.deadline_ns == ~0ull);
	CHECK(iso_check(&iso, &iso_on, ~0ull, true, &a, 1, true, &nr) == GPUOS_ISO_MAP);
}

static void iso_case_budget(void)
{
	struct gpuos_iso iso = { 0 };
	struct gpuos_iso_limits lim = iso_on;
	u64 addrs[3] = { 0x100000, 0x110000, 0x120000 };
	u32 nr;

	lim.max_bytes = 4 * ISO_REGION;
	CHECK(iso_check(&iso, &lim, 0, true, addrs, 3, true, &nr) == GPUOS_ISO_ASK && nr == 3);
	CHECK(gpuos_iso_decided(&iso, &lim, 0, true, nr) == GPUOS_ISO_MAP);
	gpuos_iso_mapped(&iso, 3 * ISO_REGION);
	CHECK(iso_check(&iso, &lim, 0, true, addrs, 1, true, &nr) == GPUOS_ISO_MAP && nr == 1);
	gpuos_iso_mapped(&iso, ISO_REGION);
	/* Budget spent: the next one is cancelled. */
	CHECK(iso_check(&iso, &lim, 0, true, addrs, 1, true, &nr) == GPUOS_ISO_STOCK && nr == 0);
	CHECK(iso.state == GPUOS_ISO_GAVE_UP);

	/* A first batch larger than the whole budget. */
	iso = (struct gpuos_iso){ 0 };
	lim.max_bytes = 2 * ISO_REGION;
	CHECK(iso_check(&iso, &lim, 0, true, addrs, 3, true, &nr) == GPUOS_ISO_ASK && nr == 3);
	CHECK(gpuos_iso_decided(&iso, &lim, 0, true, nr) == GPUOS_ISO_STOCK);
	CHECK(iso.state == GPUOS_ISO_GAVE_UP);

	/* mapped_bytes past the limit (the limit lowered at run time): no wrap-around. */
	iso = (struct gpuos_iso){ .state = GPUOS_ISO_ACTIVE, .deadline_ns = ~0ull, .mapped_bytes = 8 * ISO_REGION };
	CHECK(iso_check(&iso, &lim, 0, true, addrs, 1, true, &nr) == GPUOS_ISO_STOCK);
}

static void iso_case_regions_dedup_and_bound(void)
{
	struct gpuos_iso iso = { 0 };
	u64 addrs[GPUOS_ISO_MAX_REGIONS + 1];
	u32 i, nr;

	/* 16 pages of one 64 KiB block, twice: one region, the first page kept. */
	for (i = 0; i < 32; i++)
		addrs[i] = 0x7000000000ull + (u64)(i % 16) * GPUOS_ISO_PAGE_SIZE + 8;
	CHECK(iso_check(&iso, &iso_on, 0, true, addrs, 32, true, &nr) == GPUOS_ISO_ASK && nr == 1);
	CHECK(iso_regions[0].base == 0x7000000000ull && iso_regions[0].page == 0x7000000000ull);

	/* Exactly the most regions one batch may map, then one more. */
	for (i = 0; i <= GPUOS_ISO_MAX_REGIONS; i++)
		addrs[i] = 0x7000000000ull + (u64)i * ISO_REGION;
	CHECK(iso_check(&iso, &iso_on, 0, true, addrs, GPUOS_ISO_MAX_REGIONS, true, &nr) == GPUOS_ISO_ASK);
	CHECK(nr == GPUOS_ISO_MAX_REGIONS);
	CHECK(iso_check(&iso, &iso_on, 0, true, addrs, GPUOS_ISO_MAX_REGIONS + 1, true, &nr) == GPUOS_ISO_STOCK);
	CHECK(nr == 0 && iso.state == GPUOS_ISO_NONE);
}

/* The bound is on regions, not faults: a warp sweeping three blocks page by page. */
static void iso_case_many_faults_few_regions(void)
{
	struct gpuos_iso iso = { 0 };
	u32 i;

	iso_batch = (struct gpuos_iso_batch){ 0 };
	for (i = 0; i < 48; i++)
		gpuos_iso_add_fault(&iso_batch, 0x7000000000ull + (u64)i * GPUOS_ISO_PAGE_SIZE, true);
	CHECK(!iso_batch.uncontainable && iso_batch.nr_regions == 3);
	CHECK(gpuos_iso_check(&iso, &iso_on, 0, true, &iso_batch) == GPUOS_ISO_ASK);
	CHECK(iso_batch.nr_regions == 3 && iso_regions[2].base == 0x7000020000ull);
}

static void iso_case_give_up_is_final(void)
{
	struct gpuos_iso iso = { 0 };
	u64 a = 0x9000;
	u32 nr;

	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, true, &nr) == GPUOS_ISO_ASK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, true, nr) == GPUOS_ISO_MAP);
	gpuos_iso_give_up(&iso);	/* the mapping failed */
	CHECK(iso_check(&iso, &iso_on, 0, true, &a, 1, true, &nr) == GPUOS_ISO_STOCK);
	CHECK(gpuos_iso_decided(&iso, &iso_on, 0, true, 1) == GPUOS_ISO_STOCK);
}

/*
 * Random runs of one client: batches of 1..40 faults (some on mapped memory),
 * time moving on, gpuos answering either way, mappings failing now and then,
 * the limits changed at run time.  What must hold whatever happens:
 *  - MAP only while ACTIVE, never after the deadline, never past the budget;
 *  - after GAVE_UP, only STOCK;
 *  - the regions: aligned, distinct, each holding its page, every fault in one;
 *  - ASK only from NONE; nothing but STOCK when off, alone, or a fault mapped.
 */
static void iso_case_random(u64 seed, u32 rounds)
{
	u32 r;

	for (r = 0; r < rounds; r++) {
		struct gpuos_iso iso = { 0 };
		struct gpuos_iso_limits lim = iso_on;
		u64 s = seed + r + 1, now = uvm_rand(&s) % (1000 * ISO_MS), mapped = 0;
		u32 step;

		lim.window_ns = uvm_rand(&s) % (3000 * ISO_MS);
		lim.max_bytes = (uvm_rand(&s) % 40) * ISO_REGION / 2;
		for (step = 0; step < 50; step++) {
			struct iso_fault f[40];
			u32 n = 1 + uvm_rand(&s) % 40, nr = 0, i, j;
			bool shares = uvm_rand(&s) % 8 != 0, any_mapped = false;
			u32 before = iso.state;
			enum gpuos_iso_verdict v;

			lim.enabled = uvm_rand(&s) % 16 != 0;
			for (i = 0; i < n; i++) {
				f[i].addr = 0x7f0000000000ull + (uvm_rand(&s) % (1u << 26));
				f[i].unmapped = uvm_rand(&s) % 32 != 0;
				any_mapped |= !f[i].unmapped;
			}
			now += uvm_rand(&s) % (200 * ISO_MS);
			v = iso_check_faults(&iso, &lim, now, shares, f, n, &nr);

			if (!lim.enabled || !shares || any_mapped || before == GPUOS_ISO_GAVE_UP)
				CHECK(v == GPUOS_ISO_STOCK);
			if (v == GPUOS_ISO_ASK)
				CHECK(before == GPUOS_ISO_NONE && iso.state == GPUOS_ISO_NONE);
			if (v == GPUOS_ISO_STOCK)
				CHECK(nr == 0);
			if (v == GPUOS_ISO_ASK || v == GPUOS_ISO_MAP) {
				CHECK(nr >= 1 && nr <= GPUOS_ISO_MAX_REGIONS);
				for (i = 0; i < nr; i++) {
					CHECK(iso_regions[i].base % ISO_REGION == 0);
					CHECK(iso_regions[i].page % GPUOS_ISO_PAGE_SIZE == 0);
					CHECK(iso_regions[i].page - iso_regions[i].base < ISO_REGION);
					for (j = 0; j < i; j++)
						CHECK(iso_regions[i].base != iso_regions[j].base);
				}
				for (i = 0; i < n; i++) {
					for (j = 0; j < nr; j++)
						if (f[i].addr - iso_regions[j].base < ISO_REGION)
							break;
					CHECK(j < nr);
				}
			}
			if (v == GPUOS_ISO_ASK)
				v = gpuos_iso_decided(&iso, &lim, now, uvm_rand(&s) % 4 != 0, nr);
			if (v == GPUOS_ISO_MAP) {
				CHECK(iso.state == GPUOS_ISO_ACTIVE);
				CHECK(now <= iso.deadline_ns);
				CHECK(iso.mapped_bytes + (u64)nr * ISO_REGION <= lim.max_bytes);
				if (uvm_rand(&s) % 10 == 0) {
					gpuos_iso_give_up(&iso);
				} else {
					/* Some regions shrink to their page, some are in use. */
					u64 bytes = 0;

					for (i = 0; i < nr; i++)
						bytes += uvm_rand(&s) % 3 == 0 ? GPUOS_ISO_PAGE_SIZE :
							 uvm_rand(&s) % 5 == 0 ? 0 : ISO_REGION;
					gpuos_iso_mapped(&iso, bytes);
					mapped += bytes;
				}
			}
			if (before == GPUOS_ISO_GAVE_UP)
				CHECK(iso.state == GPUOS_ISO_GAVE_UP);
			CHECK(iso.mapped_bytes == mapped);
			/* The limit may have been lowered after mapping; raise it never changes this. */
			if (uvm_rand(&s) % 20 == 0)
				lim.max_bytes = (uvm_rand(&s) % 40) * ISO_REGION / 2;
		}
	}
}

static void iso_run_all(u64 seed, u32 rounds)
{
	iso_case_not_asked_when_off_or_alone();
	iso_case_first_fault_asks_then_maps();
	iso_case_default_decision_is_stock();
	iso_case_permission_fault_is_stock();
	iso_case_mixed_batch_is_stock();
	iso_case_deadline();
	iso_case_deadline_saturates();
	iso_case_budget();
	iso_case_regions_dedup_and_bound();
	iso_case_many_faults_few_regions();
	iso_case_give_up_is_final();
	iso_case_random(seed, rounds);
}

#endif /* ISOLATE_CASES_H */
