/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * uvm_cases.h - the tests of gpuos's own nvidia-uvm logic (patches/nvidia-uvm/:
 * the fault-isolation rules, the fault batch report builder, the prefetch
 * clipping), for two harnesses that compile those files unchanged:
 * tests/nvidia/uvm_logic_user.c (user space, ASan and UBSan) and
 * kmod/uvmtest/gpuos_uvmtest.c (a module the VM tests load, also on the debug
 * kernel).  The harness includes the three .h files of patches/nvidia-uvm/,
 * defines
 *
 *   UVM_FAIL(fmt, ...)   report one failed check (printf-like)
 *
 * includes this file, and calls uvm_run_all(seed, rounds), which returns the
 * number of failed checks.  No allocation, no libc: both run it as is.
 */
#ifndef UVM_CASES_H
#define UVM_CASES_H

static u32 uvm_failures;

#define CHECK(cond) do {						\
	if (!(cond)) {							\
		uvm_failures++;						\
		UVM_FAIL("%s:%d: %s", __func__, __LINE__, #cond);	\
	}								\
} while (0)

/* xorshift64*: the same sequence in both harnesses. */
static u64 uvm_rand(u64 *s)
{
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 0x2545F4914F6CDD1Dull;
}

#include "isolate_cases.h"
#include "report_cases.h"
#include "prefetch_cases.h"

static u32 uvm_run_all(u64 seed, u32 rounds)
{
	uvm_failures = 0;
	iso_run_all(seed, rounds);
	report_run_all(seed, rounds);
	prefetch_run_all(seed, rounds);
	return uvm_failures;
}

#endif /* UVM_CASES_H */
