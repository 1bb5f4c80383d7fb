/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * Tracepoints: /sys/kernel/tracing/events/gpuos/{fault,decision,migrate,
 * batch_done,policy,fault_batch}.  CREATE_TRACE_POINTS is defined in trace.c only.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM gpuos

#if !defined(_GPUOS_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _GPUOS_TRACE_H

#include <linux/tracepoint.h>

#include "uapi/gpuos.h"
#include "include/gpuos_hooks.h"
#include "policy.h"

#define gpuos_show_access(a)					\
	__print_symbolic(a,					\
			 { GPUOS_ACCESS_READ, "read" },		\
			 { GPUOS_ACCESS_WRITE, "write" },	\
			 { GPUOS_ACCESS_ATOMIC, "atomic" },	\
			 { GPUOS_ACCESS_PREFETCH, "prefetch" })

#define gpuos_show_fault_type(t)					\
	__print_symbolic(t,						\
			 { GPUOS_FAULT_TYPE_INVALID_PDE, "invalid_pde" },\
			 { GPUOS_FAULT_TYPE_INVALID_PTE, "invalid_pte" },\
			 { GPUOS_FAULT_TYPE_WRITE, "write" },		\
			 { GPUOS_FAULT_TYPE_ATOMIC, "atomic" },		\
			 { GPUOS_FAULT_TYPE_OTHER, "other" })

#define gpuos_show_decision(d)						\
	__print_symbolic(d,						\
			 { GPUOS_DECISION_DEFAULT, "default" },		\
			 { GPUOS_DECISION_ISOLATE, "isolate" },		\
			 { GPUOS_DECISION_KILL_CLIENT, "kill_client" })

#define gpuos_show_source(s)					\
	__print_symbolic(s,					\
			 { GPUOS_SRC_DEFAULT, "default" },	\
			 { GPUOS_SRC_PID, "pid" },		\
			 { GPUOS_SRC_CGROUP, "cgroup" })

#define gpuos_show_op(o)					\
	__print_symbolic(o,					\
			 { GPUOS_OP_MIGRATE, "migrate" },	\
			 { GPUOS_OP_HINT, "hint" })

/* A (well-formed) fault report, before its policy is looked up. */
TRACE_EVENT(fault,
	TP_PROTO(const struct gpuos_fault_report *r, u64 cgroup),
	TP_ARGS(r, cgroup),
	TP_STRUCT__entry(
		__field(u32, pid)
		__field(u64, cgroup)
		__field(u64, as_id)
		__field(u32, veid)
		__field(u64, addr)
		__field(u32, access)
		__field(u32, type)
		__field(u32, gpu)
	),
	TP_fast_assign(
		__entry->pid = r->pid;
		__entry->cgroup = cgroup;
		__entry->as_id = r->as_id;
		__entry->veid = r->veid;
		__entry->addr = r->addr;
		__entry->access = r->access;
		__entry->type = r->type;
		__entry->gpu = r->gpu;
	),
	TP_printk("pid=%u cgroup=%llu as_id=0x%llx veid=%u addr=0x%llx access=%s type=%s gpu=%u",
		  __entry->pid, __entry->cgroup, __entry->as_id, __entry->veid,
		  __entry->addr, gpuos_show_access(__entry->access),
		  gpuos_show_fault_type(__entry->type), __entry->gpu)
);

/* The decision for that fault; latency_ns counts from gpuos_report_fault's entry. */
TRACE_EVENT(decision,
	TP_PROTO(u32 pid, u64 cgroup, int source, u32 decision, u64 latency_ns),
	TP_ARGS(pid, cgroup, source, decision, latency_ns),
	TP_STRUCT__entry(
		__field(u32, pid)
		__field(u64, cgroup)
		__field(int, source)
		__field(u32, decision)
		__field(u64, latency_ns)
	),
	TP_fast_assign(
		__entry->pid = pid;
		__entry->cgroup = cgroup;
		__entry->source = source;
		__entry->decision = decision;
		__entry->latency_ns = latency_ns;
	),
	TP_printk("pid=%u cgroup=%llu source=%s decision=%s latency_ns=%llu",
		  __entry->pid, __entry->cgroup, gpuos_show_source(__entry->source),
		  gpuos_show_decision(__entry->decision), __entry->latency_ns)
);

/* A validated batch offered to the driver; result is 0 or -errno. */
TRACE_EVENT(migrate,
	TP_PROTO(u64 batch_id, u64 as_id, u32 op, u32 nr_ranges, int result),
	TP_ARGS(batch_id, as_id, op, nr_ranges, result),
	TP_STRUCT__entry(
		__field(u64, batch_id)
		__field(u64, as_id)
		__field(u32, op)
		__field(u32, nr_ranges)
		__field(int, result)
	),
	TP_fast_assign(
		__entry->batch_id = batch_id;
		__entry->as_id = as_id;
		__entry->op = op;
		__entry->nr_ranges = nr_ranges;
		__entry->result = result;
	),
	TP_printk("batch_id=%llu as_id=0x%llx op=%s nr_ranges=%u result=%d",
		  __entry->batch_id, __entry->as_id, gpuos_show_op(__entry->op),
		  __entry->nr_ranges, __entry->result)
);

/* A batch completed (by the driver, or with -ENODEV at unregister). */
TRACE_EVENT(batch_done,
	TP_PROTO(u64 batch_id, u32 nr, int first_error),
	TP_ARGS(batch_id, nr, first_error),
	TP_STRUCT__entry(
		__field(u64, batch_id)
		__field(u32, nr)
		__field(int, first_error)
	),
	TP_fast_assign(
		__entry->batch_id = batch_id;
		__entry->nr = nr;
		__entry->first_error = first_error;
	),
	TP_printk("batch_id=%llu nr=%u first_error=%d",
		  __entry->batch_id, __entry->nr, __entry->first_error)
);

/* A policy set or deleted; one of pid and cgroup is 0. */
TRACE_EVENT(policy,
	TP_PROTO(u32 pid, u64 cgroup, u32 policy, bool set),
	TP_ARGS(pid, cgroup, policy, set),
	TP_STRUCT__entry(
		__field(u32, pid)
		__field(u64, cgroup)
		__field(u32, policy)
		__field(bool, set)
	),
	TP_fast_assign(
		__entry->pid = pid;
		__entry->cgroup = cgroup;
		__entry->policy = policy;
		__entry->set = set;
	),
	TP_printk("pid=%u cgroup=%llu policy=%u %s",
		  __entry->pid, __entry->cgroup, __entry->policy,
		  __entry->set ? "set" : "deleted")
);

/* A (well-formed) fault batch report: one client's serviced faults in one batch. */
TRACE_EVENT(fault_batch,
	TP_PROTO(const struct gpuos_fault_batch_report *r, u64 cgroup),
	TP_ARGS(r, cgroup),
	TP_STRUCT__entry(
		__field(u32, pid)
		__field(u64, cgroup)
		__field(u64, as_id)
		__field(u32, gpu)
		__field(u64, batch_id)
		__field(u32, nr_faults)
		__field(u32, nr_instances)
		__field(u32, nr_fatal)
		__field(u32, nr_throttled)
		__field(u32, nr_skipped)
		__field(u32, nr_read)
		__field(u32, nr_write)
		__field(u32, nr_atomic)
		__field(u32, nr_prefetch)
		__field(u64, addr_min)
		__field(u64, addr_max)
		__field(u32, nr_addrs)
	),
	TP_fast_assign(
		__entry->pid = r->pid;
		__entry->cgroup = cgroup;
		__entry->as_id = r->as_id;
		__entry->gpu = r->gpu;
		__entry->batch_id = r->batch_id;
		__entry->nr_faults = r->nr_faults;
		__entry->nr_instances = r->nr_instances;
		__entry->nr_fatal = r->nr_fatal;
		__entry->nr_throttled = r->nr_throttled;
		__entry->nr_skipped = r->nr_skipped;
		__entry->nr_read = r->nr_by_access[GPUOS_ACCESS_READ];
		__entry->nr_write = r->nr_by_access[GPUOS_ACCESS_WRITE];
		__entry->nr_atomic = r->nr_by_access[GPUOS_ACCESS_ATOMIC];
		__entry->nr_prefetch = r->nr_by_access[GPUOS_ACCESS_PREFETCH];
		__entry->addr_min = r->addr_min;
		__entry->addr_max = r->addr_max;
		__entry->nr_addrs = r->nr_addrs;
	),
	TP_printk("pid=%u cgroup=%llu as_id=0x%llx gpu=%u batch_id=%llu faults=%u instances=%u fatal=%u throttled=%u skipped=%u read=%u write=%u atomic=%u prefetch=%u addr_min=0x%llx addr_max=0x%llx nr_addrs=%u",
		  __entry->pid, __entry->cgroup, __entry->as_id, __entry->gpu,
		  __entry->batch_id, __entry->nr_faults, __entry->nr_instances,
		  __entry->nr_fatal, __entry->nr_throttled, __entry->nr_skipped,
		  __entry->nr_read, __entry->nr_write, __entry->nr_atomic,
		  __entry->nr_prefetch, __entry->addr_min, __entry->addr_max,
		  __entry->nr_addrs)
);

#endif /* _GPUOS_TRACE_H */

/* define_trace.h includes this file again, by this name, from -I$(src). */
#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#undef TRACE_INCLUDE_FILE
#define TRACE_INCLUDE_FILE trace
#include <trace/define_trace.h>
