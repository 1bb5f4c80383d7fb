/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * gpuos_hooks.h - how a GPU driver (the patched nvidia-uvm, or the test
 * driver) plugs into gpuos.ko.
 *
 * The driver registers one ops table.  gpuos calls its ops from process
 * context (they may sleep); the driver calls gpuos from its fault-servicing
 * path (process context in nvidia-uvm: the bottom half is a work item) and
 * from wherever it completes migrations.
 *
 *   gpuos_register_driver(ops)    0, -EBUSY if another driver is registered,
 *                                 -EINVAL if ops lacks a name (1..31 bytes)
 *                                 or claims GPUOS_CAP_MIGRATE/HINT without
 *                                 submit.  The driver must unregister before
 *                                 it unloads (in its module exit at the
 *                                 latest).  Process context.
 *   gpuos_unregister_driver(ops)  returns only when no gpuos call into ops is
 *                                 still running (SRCU), so the caller may
 *                                 then free ops or unload.  Batches the driver
 *                                 had not completed are completed with
 *                                 -ENODEV (their MIGRATION_DONE events are
 *                                 out when it returns); the driver must not
 *                                 touch their ranges any more.  Process
 *                                 context; never from inside an op.
 *   gpuos_report_fault(report)    a fault the driver cannot service (no valid
 *                                 mapping): gpuos looks up the client's
 *                                 policy (pid, then its cgroup and ancestors),
 *                                 emits events and tracepoints, and returns
 *                                 the decision (enum gpuos_decision).  With
 *                                 KILL_CLIENT gpuos also stops the client
 *                                 (ops->stop_client, else SIGKILL) from a work
 *                                 item (if stop_client fails, SIGKILL; never
 *                                 to init or a kernel thread).  pid is in the
 *                                 initial pid namespace.  A malformed report
 *                                 (access, type unknown, gpu >=
 *                                 GPUOS_MAX_GPUS) is counted as rejected and
 *                                 answered DEFAULT.  Never sleeps; safe in
 *                                 atomic context (with interrupts disabled
 *                                 its events are counted unsent, not sent:
 *                                 netlink delivery needs them enabled).
 *   gpuos_report_fault_batch(report)
 *                                 serviced replayable faults of one client
 *                                 in one fault batch of one GPU: counts by
 *                                 access type, the address span, the first
 *                                 few distinct pages.  gpuos emits a
 *                                 GPUOS_EVENT_FAULT_BATCH event and the
 *                                 gpuos:fault_batch tracepoint, and counts
 *                                 it (GPUOS_CTR_FAULT_BATCHES); nothing is
 *                                 decided.  Called from the driver's fault
 *                                 servicing (it may hold the GPU's fault
 *                                 lock, so every other fault on that GPU
 *                                 waits): never sleeps, allocates only with
 *                                 GFP_ATOMIC; safe in atomic context (with
 *                                 interrupts disabled the event is counted
 *                                 unsent).  Not called for a batch without
 *                                 faults of that client.  The driver
 *                                 rate-limits the calls (nvidia-uvm: at most
 *                                 one batch per GPU per
 *                                 uvm_gpuos_batch_notify_us, default 1000 us;
 *                                 one call per client of that batch), so
 *                                 gpuos sees a sample of batches; nr_skipped
 *                                 says how many batches of that GPU were not
 *                                 reported since the last report.  The
 *                                 report is read only during the call.  A
 *                                 malformed report is counted as rejected
 *                                 and dropped: gpu >= GPUOS_MAX_GPUS;
 *                                 nr_faults 0 or past
 *                                 GPUOS_FAULT_BATCH_MAX_FAULTS; nr_instances
 *                                 below nr_faults or past the same bound;
 *                                 nr_fatal or nr_throttled past nr_faults;
 *                                 nr_by_access[] not adding up to nr_faults;
 *                                 nr_addrs 0, past GPUOS_FAULT_BATCH_ADDRS
 *                                 or past nr_faults; addr_min > addr_max;
 *                                 addrs[0..nr_addrs) not strictly ascending
 *                                 or outside [addr_min, addr_max]; an
 *                                 address (min, max or addrs[]) not
 *                                 GPUOS_PAGE_SIZE-aligned.  Entries of
 *                                 addrs past nr_addrs are ignored.
 *   gpuos_prefetch_lookup(as_id, addr, out, max)
 *                                 the prefetch ranges user space stored for
 *                                 address space as_id (GPUOS_CMD_SET_PREFETCH)
 *                                 near a fault at addr, for the driver to
 *                                 service along with the fault.  The rule:
 *                                 the window is the GPUOS_PREFETCH_WINDOW
 *                                 (2 MiB) aligned block that contains addr;
 *                                 every stored range that meets the window
 *                                 (contains addr, lies within the window or
 *                                 overlaps it) is written to out, clipped to
 *                                 the window, in ascending order of base, at
 *                                 most max of them (the lowest ones); returns
 *                                 how many were written (0 without ranges,
 *                                 with max 0 or out NULL).  Ranges are
 *                                 page-aligned and disjoint; they need not
 *                                 contain addr.  Lock-free (RCU): never
 *                                 sleeps, never allocates, takes no lock;
 *                                 safe in any context, including with
 *                                 interrupts disabled.  Not counted, no
 *                                 event: it is on every fault's path.  The
 *                                 driver decides what to do with the
 *                                 ranges (nvidia-uvm clips them to the
 *                                 faulting va_block).
 *   gpuos_batch_done(id, status, nr)
 *                                 the driver finished batch `id`; status[i] is
 *                                 range i's result (0 or -errno; anything
 *                                 else is reported as -EIO).  Unknown ids
 *                                 and a wrong nr are ignored (counted as
 *                                 rejected; the batch stays pending).  Any
 *                                 context, also from inside ops->submit; it
 *                                 copies the statuses and returns.
 *
 * Without a registered driver every migration request fails with -ENODEV and
 * the rest of gpuos (policies, events, info) still works.
 */
#ifndef _GPUOS_HOOKS_H
#define _GPUOS_HOOKS_H

#include <linux/types.h>

#include "../uapi/gpuos.h"

struct module;

struct gpuos_fault_report {
	u32 pid;		/* the client's process, as the driver knows it */
	u32 veid;		/* subcontext (MPS client) within its channel group */
	u64 as_id;		/* the client's address space (e.g. its va_space) */
	u64 addr;		/* faulting GPU virtual address */
	u32 access;		/* enum gpuos_fault_access */
	u32 type;		/* enum gpuos_fault_type */
	u32 gpu;		/* GPU index */
};

/* Serviced faults of one client in one fault batch (gpuos_report_fault_batch). */
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

/* One prefetch range (gpuos_prefetch_lookup): [base, base + len). */
struct gpuos_prefetch_range {
	u64 base;
	u64 len;
};

/* A validated batch, as gpuos hands it to ops->submit. */
struct gpuos_batch_req {
	u64 id;
	u64 as_id;
	u32 op;			/* enum gpuos_op */
	u32 nr_ranges;
	const struct gpuos_range *ranges;	/* valid until gpuos_batch_done, or
						 * until unregistering returns */
};

struct gpuos_driver_ops {
	const char *name;	/* < 32 bytes */
	struct module *owner;
	u32 caps;		/* enum gpuos_driver_caps */
	/*
	 * Start a batch; 0 if accepted (complete it later with gpuos_batch_done,
	 * possibly before returning), else -errno (the batch is then dropped).
	 */
	int (*submit)(const struct gpuos_batch_req *req);
	/*
	 * Stop one client after a KILL_CLIENT decision (with GPUOS_CAP_STOP_CLIENT;
	 * may be NULL); 0 if stopped, else gpuos sends SIGKILL instead.
	 */
	int (*stop_client)(u64 as_id, u32 pid);
};

int gpuos_register_driver(const struct gpuos_driver_ops *ops);
void gpuos_unregister_driver(const struct gpuos_driver_ops *ops);
u32 gpuos_report_fault(const struct gpuos_fault_report *report);
void gpuos_batch_done(u64 batch_id, const s32 *status, u32 nr);
void gpuos_report_fault_batch(const struct gpuos_fault_batch_report *report);
u32 gpuos_prefetch_lookup(u64 as_id, u64 addr, struct gpuos_prefetch_range *out,
			  u32 max);
/*
 * The driver destroyed address space as_id (its process closed the GPU or
 * exited): what gpuos keeps for it, its prefetch ranges, goes, so that dead
 * address spaces never use up GPUOS_MAX_PREFETCH_AS.  Process context.
 */
void gpuos_address_space_gone(u64 as_id);

#endif /* _GPUOS_HOOKS_H */
