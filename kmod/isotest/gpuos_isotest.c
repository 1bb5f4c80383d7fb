// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuos_isotest: nvidia-uvm's fault-isolation rules
 * (patches/nvidia-uvm/uvm_gpuos_isolate.c, compiled here unchanged) run in
 * the kernel against isolate_cases.h when the module loads: once in process
 * context, once under a spinlock with interrupts off, as nvidia-uvm calls
 * them (on a kernel with DEBUG_ATOMIC_SLEEP and KASAN, anything that sleeps
 * or touches memory it should not is reported).  The result is in the kernel
 * log and in /sys/module/gpuos_isotest/parameters/failed (-1 until run).
 * Parameters: seed, rounds (random runs per pass).
 */
#include <linux/module.h>
#include <linux/spinlock.h>

#include "uvm_gpuos_isolate.h"
#include "uvm_gpuos_isolate.c"

#define ISO_FAIL(fmt, ...) pr_err("gpuos_isotest: FAIL " fmt "\n", __VA_ARGS__)
#include "isolate_cases.h"

static ulong seed = 1;
module_param(seed, ulong, 0444);
static uint rounds = 500;
module_param(rounds, uint, 0444);
static int failed = -1;
module_param(failed, int, 0444);

static DEFINE_SPINLOCK(isotest_lock);

static int __init isotest_init(void)
{
	unsigned long flags;
	u32 n;

	n = iso_run_all(seed, rounds);
	spin_lock_irqsave(&isotest_lock, flags);
	n += iso_run_all(seed + 1000003, rounds);
	spin_unlock_irqrestore(&isotest_lock, flags);
	failed = n;
	pr_info("gpuos_isotest: seed %lu, %u random runs twice (process context, then atomic): %u failed checks\n",
		seed, rounds, n);
	return 0;
}

static void __exit isotest_exit(void)
{
}

module_init(isotest_init);
module_exit(isotest_exit);
MODULE_DESCRIPTION("gpuos: nvidia-uvm's fault-isolation rules, tested in the kernel");
MODULE_LICENSE("Dual MIT/GPL");
