// SPDX-License-Identifier: GPL-2.0 OR MIT
// gpuos's own nvidia-uvm logic in user space: patches/nvidia-uvm/uvm_gpuos_{isolate,report,
// prefetch}.c compiled unchanged with this file (tests/unit/test_uvm_logic.py builds it
// under ASan and UBSan) and run against kmod/uvmtest/uvm_cases.h.
// Usage: uvm_logic_user [SEED [ROUNDS]]; exit 0 if every check passed.
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#include "uvm_gpuos_isolate.h"
#include "uvm_gpuos_report.h"
#include "uvm_gpuos_prefetch.h"

#define UVM_FAIL(fmt, ...) fprintf(stderr, "FAIL " fmt "\n", __VA_ARGS__)
#include "uvm_cases.h"

int main(int argc, char **argv)
{
	u64 seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 1;
	u32 rounds = argc > 2 ? (u32)strtoul(argv[2], NULL, 0) : 2000;
	u32 failed = uvm_run_all(seed, rounds);

	printf("uvm_logic_user: seed %llu, %u random runs: %u failed checks\n",
	       (unsigned long long)seed, rounds, failed);
	return failed != 0;
}
