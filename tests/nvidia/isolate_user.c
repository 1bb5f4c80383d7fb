// SPDX-License-Identifier: GPL-2.0 OR MIT
// nvidia-uvm's fault-isolation rules in user space: patches/nvidia-uvm/uvm_gpuos_isolate.c
// compiled unchanged with this file (tests/unit/test_isolation_rules.py builds it under
// ASan and UBSan) and run against kmod/isotest/isolate_cases.h.
// Usage: isolate_user [SEED [ROUNDS]]; exit 0 if every check passed.
#include <stdio.h>
#include <stdlib.h>

#include "uvm_gpuos_isolate.h"

#define ISO_FAIL(fmt, ...) fprintf(stderr, "FAIL " fmt "\n", __VA_ARGS__)
#include "isolate_cases.h"

int main(int argc, char **argv)
{
	u64 seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 1;
	u32 rounds = argc > 2 ? (u32)strtoul(argv[2], NULL, 0) : 2000;
	u32 failed = iso_run_all(seed, rounds);

	printf("isolate_user: seed %llu, %u random runs: %u failed checks\n",
	       (unsigned long long)seed, rounds, failed);
	return failed != 0;
}
