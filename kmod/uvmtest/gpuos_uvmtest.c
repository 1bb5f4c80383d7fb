// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuos_uvmtest: gpuos's own nvidia-uvm logic (patches/nvidia-uvm/: the
 * fault-isolation rules, the fault batch report builder, the prefetch
 * clipping, compiled here unchanged) run in the kernel against uvm_cases.h
 * when the module loads: once in process context, once under a spinlock with
 * interrupts off, as nvidia-uvm's fault path calls it (on a kernel with
 * DEBUG_ATOMIC_SLEEP and KASAN, anything that sleeps or touches memory it
 * should not is reported).  The result is in the kernel log and in
 * /sys/module/gpuos_uvmtest/parameters/failed (-1 until run).  Parameters:
 * seed, rounds (random runs per pass).
 */
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/spinlock.h>

#include "uvm_gpuos_isolate.c"
#include "uvm_gpuos_report.c"
#include "uvm_gpuos_prefetch.c"

#define UVM_FAIL(fmt, ...) pr_err("gpuos_uvmtest: FAIL " fmt "\n", __VA_ARGS__)
#include "uvm_cases.h"

static ulong seed = 1;
module_param(seed, ulong, 0444);
static uint rounds = 500;
module_param(rounds, uint, 0444);
static int failed = -1;
module_param(failed, int, 0444);

static DEFINE_SPINLOCK(uvmtest_lock);

static int __init uvmtest_init(void)
{
	unsigned long flags;
	u32 n;

	n = uvm_run_all(seed, rounds);
	spin_lock_irqsave(&uvmtest_lock, flags);
	n += uvm_run_all(seed + 1000003, rounds);
	spin_unlock_irqrestore(&uvmtest_lock, flags);
	failed = n;
	pr_info("gpuos_uvmtest: seed %lu, %u random runs twice (process context, then atomic): %u failed checks\n",
		seed, rounds, n);
	return 0;
}

static void __exit uvmtest_exit(void)
{
}

module_init(uvmtest_init);
module_exit(uvmtest_exit);
MODULE_DESCRIPTION("gpuos: its own nvidia-uvm logic, tested in the kernel");
MODULE_LICENSE("Dual MIT/GPL");
