/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * gpuos_hooks_ext.h - PROPOSED additions to kmod/include/gpuos_hooks.h.
 *
 * gpuos.ko does not export this yet.  The patched nvidia-uvm already calls it:
 * it binds every gpuos entry point at run time with symbol_get(), so until
 * gpuos.ko exports gpuos_report_fault_batch the call site is simply inactive
 * (patches/README.md, "Binding to gpuos.ko").  When the kmod side lands, move
 * these declarations into gpuos_hooks.h (and this file becomes an empty
 * include of it), export the function with EXPORT_SYMBOL_GPL, and turn each
 * report into a GPUOS_EVENT_FAULT_BATCH event and a gpuos:fault_batch
 * tracepoint.
 *
 *   gpuos_report_fault_batch(report)
 *                      serviced replayable faults of one client in one fault
 *                      batch of one GPU: counts by access type, the address
 *                      span, the first few distinct page addresses.  Called
 *                      from the driver's fault-servicing bottom half (process
 *                      context, but it must not sleep: it holds the GPU's
 *                      fault-buffer lock and every other fault on that GPU
 *                      waits).  Never called for a batch with no client
 *                      faults.  The driver rate-limits the calls (at most one
 *                      batch per GPU per nvidia-uvm's uvm_gpuos_batch_notify_us,
 *                      default 1000 us; clients of a batch are reported
 *                      together, one call each), so gpuos sees a sample of
 *                      batches, not every one; nr_skipped says how many
 *                      batches of that GPU were not reported since the last
 *                      report.  The report is valid only during the call.
 *                      Malformed reports (gpu >= GPUOS_MAX_GPUS, nr_addrs >
 *                      GPUOS_FAULT_BATCH_ADDRS) are counted as rejected.
 *
 * Prefetch: the issue also asks for "a policy hook through which gpuos can add
 * prefetch ranges to a client's fault servicing".  Not part of this proposal:
 * gpuos can already act on these reports by submitting GPUOS_OP_MIGRATE
 * batches (ops->submit), which run outside the fault path.  A synchronous
 * hook inside fault servicing would put gpuos's latency on every fault.
 */
#ifndef _GPUOS_HOOKS_EXT_H
#define _GPUOS_HOOKS_EXT_H

#include "gpuos_hooks.h"

#define GPUOS_FAULT_BATCH_ADDRS	8

struct gpuos_fault_batch_report {
	u64 batch_id;		/* the driver's fault batch number on this GPU */
	u64 as_id;		/* the client's address space, as in fault reports */
	u32 pid;		/* the client's process (initial pid namespace) */
	u32 gpu;		/* GPU index, as in fault reports */
	u32 nr_faults;		/* this client's distinct faults in the batch */
	u32 nr_instances;	/* ... counting duplicates the hardware merged */
	u32 nr_fatal;		/* ... of them not serviceable */
	u32 nr_throttled;	/* ... of them throttled (thrashing) */
	u32 nr_skipped;		/* batches on this GPU not reported since the last report */
	u32 nr_by_access[__GPUOS_ACCESS_MAX];	/* enum gpuos_fault_access */
	u32 nr_addrs;		/* entries used in addrs */
	u64 addr_min;		/* lowest faulting address (page aligned) */
	u64 addr_max;		/* highest faulting address (page aligned) */
	u64 addrs[GPUOS_FAULT_BATCH_ADDRS];	/* first distinct pages, ascending */
};

void gpuos_report_fault_batch(const struct gpuos_fault_batch_report *report);

#endif /* _GPUOS_HOOKS_EXT_H */
