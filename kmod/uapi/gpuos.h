/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * gpuos.h - the user-space interface of gpuos.ko.
 *
 * gpuos.ko is where a patched NVIDIA driver reports GPU memory faults and asks
 * for policy decisions, and where user space sets those policies, submits
 * batched migrations and listens to events.  Two interfaces:
 *
 *   generic netlink family "gpuos"   control, policies, events (this header)
 *   character device /dev/gpuos      the high-rate path: batches of ranges
 *
 * Compatibility: GPUOS_GENL_VERSION is the family's version (genlmsghdr.version
 * of every reply and event, and GPUOS_A_GENL_VERSION in GET_INFO);
 * GPUOS_ABI_VERSION is the version of the ioctl structures below
 * (GPUOS_IOC_ABI_VERSION).  Either changes when an existing command, attribute,
 * ioctl or struct changes meaning; user space refuses a version it does not know.
 *
 * ========================================================================
 * Generic netlink family "gpuos", multicast group "events"
 * ========================================================================
 *
 * Every attribute lives in one space, enum gpuos_attr; nested attributes
 * (GPUOS_A_POLICY, GPUOS_A_RANGES, GPUOS_A_RANGE, GPUOS_A_FAULT,
 * GPUOS_A_FAULT_ADDRS) contain attributes of that same space.  The one exception is GPUOS_A_COUNTERS
 * (replies only): its attribute types are enum gpuos_counter, padded with
 * GPUOS_CTR_PAD.  Unknown attributes are rejected (strict validation: nested
 * attributes must carry NLA_F_NESTED, genlmsghdr.reserved must be 0, and a
 * command that takes no attributes rejects any); every length is checked by
 * the policy.  Values outside the range an attribute's policy declares (the
 * bounds below; CTRL_CMD_GETPOLICY shows them) are refused by the netlink
 * core with ERANGE, a flags attribute with unknown bits with EINVAL, before
 * gpuos sees the request; the extended ack names the attribute.
 *
 * Privileges, one rule for netlink and the ioctl: every change ("admin"
 * below, and GPUOS_IOC_SUBMIT) needs CAP_SYS_ADMIN in the initial user
 * namespace, of the caller (and, for netlink, of the socket's opener);
 * others fail with EPERM, after the netlink core's stateless check of the
 * request's form.  Joining the "events" group needs CAP_SYS_ADMIN too
 * (EPERM): events carry other users' pids, cgroups and fault addresses.
 * Reading (GET_INFO, GET_POLICY, LIST_POLICIES, GPUOS_IOC_ABI_VERSION) is
 * open to anyone.
 *
 *   GPUOS_CMD_GET_INFO (doit; anyone)
 *     request:  no attributes
 *     reply:    GPUOS_A_GENL_VERSION u32, GPUOS_A_ABI_VERSION u32,
 *               GPUOS_A_MODULE_VERSION string, GPUOS_A_DRIVER_NAME string
 *               (only while a driver is registered), GPUOS_A_DRIVER_CAPS u32
 *               (enum gpuos_driver_caps bits; 0 without a driver),
 *               GPUOS_A_EVENT_SEQ u64 (sequence number of the last event),
 *               GPUOS_A_COUNTERS nested { GPUOS_CTR_* u64 }.
 *
 *   GPUOS_CMD_SET_POLICY (doit; admin)
 *     request:  exactly one client: GPUOS_A_CLIENT_PID u32 (> 0) or
 *               GPUOS_A_CLIENT_CGROUP u64 (a cgroup v2 id, > 0);
 *               GPUOS_A_FAULT_POLICY u32 (enum gpuos_fault_policy).
 *     Replaces the client's policy.  At most GPUOS_MAX_POLICIES policies
 *     (ENOSPC past that).  Emits GPUOS_EVENT_POLICY_SET.
 *     Pids are those of the initial pid namespace.  A pid policy needs a
 *     live process (ESRCH otherwise) and applies to it alone: once it has
 *     exited, the policy no longer matches a new process that reuses the
 *     number (it stays listed until deleted).  Cgroups need not exist yet.
 *
 *   GPUOS_CMD_GET_POLICY (doit; anyone)
 *     request:  one client as above.
 *     reply:    GPUOS_A_POLICY nested { client, GPUOS_A_FAULT_POLICY }.
 *     ENOENT if the client has no policy of its own.
 *
 *   GPUOS_CMD_DEL_POLICY (doit; admin)
 *     request:  one client as above.  ENOENT if it had none.
 *
 *   GPUOS_CMD_LIST_POLICIES (dumpit; anyone)
 *     one message per policy: GPUOS_A_POLICY nested { client, GPUOS_A_FAULT_POLICY }.
 *
 *   GPUOS_CMD_MIGRATE (doit; admin)
 *     request:  GPUOS_A_AS_ID u64 (the address space, as the driver names it),
 *               GPUOS_A_OP u32 (enum gpuos_op),
 *               GPUOS_A_RANGES nested, containing 1..GPUOS_MAX_NL_RANGES
 *               (E2BIG above; a netlink attribute is at most 64 KiB, too
 *               small for GPUOS_MAX_RANGES ranges: use the ioctl for more)
 *               GPUOS_A_RANGE nested { GPUOS_A_RANGE_BASE u64,
 *               GPUOS_A_RANGE_LEN u64, GPUOS_A_RANGE_DEST u32,
 *               GPUOS_A_RANGE_PRIO u32, GPUOS_A_RANGE_FLAGS u32 (optional, 0) }.
 *     Each range is validated as struct gpuos_range below.
 *     reply:    GPUOS_A_BATCH_ID u64.  The driver completes the batch later:
 *               GPUOS_EVENT_MIGRATION_DONE carries the per-range status.
 *     ENODEV without a registered driver, EOPNOTSUPP if the driver lacks the
 *     operation, EINVAL (or ERANGE, see above) for a malformed batch (checked
 *     first, with or without a driver), EAGAIN while GPUOS_MAX_PENDING
 *     batches await the driver.  The MIGRATION_DONE event can arrive before
 *     the reply (a driver may complete a batch at once): subscribe first.
 *
 *   GPUOS_CMD_SET_PREFETCH (doit; admin)
 *     request:  GPUOS_A_AS_ID u64 (the address space, as the driver names
 *               it), GPUOS_A_RANGES nested (optional), containing
 *               0..GPUOS_MAX_NL_RANGES (E2BIG above) GPUOS_A_RANGE nested
 *               { GPUOS_A_RANGE_BASE u64, GPUOS_A_RANGE_LEN u64 } (no other
 *               range attribute).  Each range: base and len page-aligned,
 *               len > 0, base + len must not overflow; ranges must not
 *               overlap (any order); EINVAL otherwise.
 *     Replaces the address space's prefetch ranges; absent or empty
 *     GPUOS_A_RANGES clears them (no error if there were none).  At most
 *     GPUOS_MAX_PREFETCH_AS address spaces have ranges at once (ENOSPC for
 *     one more).  No event.  The driver reads these ranges, without waiting
 *     for gpuos, while it services a fault of that address space
 *     (gpuos_prefetch_lookup in gpuos_hooks.h: the stored ranges that meet
 *     the GPUOS_PREFETCH_WINDOW-aligned window around the fault) and
 *     services them with the fault; a patched nvidia-uvm clips them to the
 *     faulting va_block.  They stay set until replaced or cleared, until
 *     the driver reports the address space destroyed
 *     (gpuos_address_space_gone), or until the module unloads.
 *
 *   GPUOS_CMD_EVENT (multicast only, group "events")
 *     GPUOS_A_EVENT_TYPE u32 (enum gpuos_event_type), GPUOS_A_EVENT_SEQ u64,
 *     GPUOS_A_EVENT_TIME_NS u64 (CLOCK_MONOTONIC), then by type:
 *       FAULT, CLIENT_ISOLATED:  GPUOS_A_FAULT nested { GPUOS_A_CLIENT_PID,
 *           GPUOS_A_CLIENT_CGROUP (the process's own cgroup; absent when
 *           the pid names no live process), GPUOS_A_AS_ID,
 *           GPUOS_A_FAULT_VEID u32,
 *           GPUOS_A_FAULT_ADDR u64, GPUOS_A_FAULT_ACCESS u32,
 *           GPUOS_A_FAULT_TYPE u32, GPUOS_A_FAULT_GPU u32,
 *           GPUOS_A_DECISION u32 (enum gpuos_decision) }
 *       MIGRATION_DONE:  GPUOS_A_BATCH_ID, GPUOS_A_AS_ID, GPUOS_A_RANGES
 *           nested { GPUOS_A_RANGE nested { GPUOS_A_RANGE_STATUS s32 } ... }
 *           (one per range, in the order submitted; 0 or a negative errno;
 *           -ENODEV for every range when the driver unregistered first)
 *       FAULT_BATCH:  GPUOS_A_FAULT nested { GPUOS_A_CLIENT_PID,
 *           GPUOS_A_CLIENT_CGROUP (as in FAULT), GPUOS_A_AS_ID,
 *           GPUOS_A_FAULT_GPU, GPUOS_A_FAULT_BATCH_ID u64 (the driver's
 *           fault batch number on that GPU), GPUOS_A_FAULT_NR u32 (the
 *           client's distinct faults in the batch,
 *           1..GPUOS_FAULT_BATCH_MAX_FAULTS), GPUOS_A_FAULT_NR_INSTANCES u32
 *           (counting the duplicates the hardware merged; >= NR),
 *           GPUOS_A_FAULT_NR_FATAL u32, GPUOS_A_FAULT_NR_THROTTLED u32
 *           (each <= NR), GPUOS_A_FAULT_NR_SKIPPED u32 (batches of that GPU
 *           the driver did not report since its previous report),
 *           GPUOS_A_FAULT_NR_READ, _NR_WRITE, _NR_ATOMIC, _NR_PREFETCH u32
 *           (faults by access type; they add up to NR),
 *           GPUOS_A_FAULT_ADDR_MIN u64, GPUOS_A_FAULT_ADDR_MAX u64 (the
 *           lowest and highest faulting page), GPUOS_A_FAULT_ADDRS nested
 *           { GPUOS_A_FAULT_ADDR u64 ... } (1..GPUOS_FAULT_BATCH_ADDRS
 *           distinct pages in ascending order, each in [MIN, MAX]) }.
 *           Pages are GPUOS_PAGE_SIZE-aligned.  A sample, not every batch:
 *           the driver reports serviced replayable fault batches,
 *           rate-limited, one event per client of a batch; no decision.
 *       DRIVER_REGISTERED, DRIVER_UNREGISTERED:  GPUOS_A_DRIVER_NAME
 *       POLICY_SET, POLICY_DELETED:  GPUOS_A_POLICY nested { client, policy }
 *     Every event takes the next sequence number, sent or not: a listener
 *     that sees a gap has missed events (its socket overflowed, or it
 *     subscribed late); GPUOS_CTR_EVENTS_UNSENT counts events no one received.
 *     Events reach a listener in sequence order.  Anyone may subscribe.
 *
 * ========================================================================
 * Character device /dev/gpuos (mode 0666; ioctls check privileges)
 * ========================================================================
 *
 *   GPUOS_IOC_ABI_VERSION   _IOR('G', 0x00, __u32): writes GPUOS_ABI_VERSION.
 *                           Anyone.
 *   GPUOS_IOC_SUBMIT        _IOWR('G', 0x01, struct gpuos_batch): submits a
 *                           batch of ranges.  CAP_SYS_ADMIN, else EPERM.
 *     struct gpuos_batch:
 *       size        in   sizeof(struct gpuos_batch); anything else: EINVAL
 *       op          in   enum gpuos_op
 *       as_id       in   address space, as the driver names it
 *       nr_ranges   in   1..GPUOS_MAX_RANGES, else EINVAL (E2BIG above the max)
 *       flags       in   must be 0
 *       ranges      in   user pointer to nr_ranges struct gpuos_range; EFAULT
 *                        if unreadable
 *       batch_id    out  the batch's id, as in GPUOS_EVENT_MIGRATION_DONE
 *     struct gpuos_range (32 bytes; every field checked, EINVAL on any error):
 *       base        in   page-aligned (4096), base + len must not overflow
 *       len         in   > 0, page-aligned
 *       dest        in   GPUOS_DEST_CPU (0) or GPUOS_DEST_GPU(i) = i + 1,
 *                        i < GPUOS_MAX_GPUS
 *       prio        in   0..GPUOS_MAX_PRIO (0 most urgent)
 *       flags       in   GPUOS_OP_MIGRATE: 0; GPUOS_OP_HINT: exactly one of
 *                        GPUOS_RANGE_EVICT_FIRST, GPUOS_RANGE_EVICT_LAST
 *       status      out  0 when accepted; the driver's result arrives in
 *                        GPUOS_EVENT_MIGRATION_DONE
 *     ENODEV without a registered driver; EOPNOTSUPP if it lacks the op;
 *     EAGAIN while GPUOS_MAX_PENDING batches await the driver.  Checked in
 *     this order: EPERM, then the struct (EFAULT, EINVAL, E2BIG), then the
 *     ranges (EFAULT; EINVAL with each range's status set to 0 or -EINVAL
 *     and copied back), then ENODEV, EOPNOTSUPP, EAGAIN.  Other ioctls:
 *     ENOTTY.
 *
 * ========================================================================
 * Limits
 * ========================================================================
 *   GPUOS_MAX_RANGES    ranges per batch (ioctl)
 *   GPUOS_MAX_NL_RANGES ranges per GPUOS_CMD_MIGRATE (netlink)
 *   GPUOS_MAX_PENDING   batches submitted and not yet completed by the driver
 *   GPUOS_MAX_POLICIES  policies at once
 *   GPUOS_MAX_GPUS      GPU indices a destination may name
 *   GPUOS_FAULT_BATCH_ADDRS       addresses in one FAULT_BATCH event
 *   GPUOS_MAX_PREFETCH_AS  address spaces with prefetch ranges at once
 *   GPUOS_PREFETCH_WINDOW  size and alignment of the window that
 *                          gpuos_prefetch_lookup searches around a fault
 *   GPUOS_FAULT_BATCH_MAX_FAULTS  faults of one client in one fault batch
 *                                 (nvidia-uvm fetches at most
 *                                 uvm_perf_fault_batch_count, default 256,
 *                                 per batch; more is a malformed report)
 */
#ifndef _UAPI_LINUX_GPUOS_H
#define _UAPI_LINUX_GPUOS_H

#include <linux/types.h>
#include <linux/ioctl.h>

#define GPUOS_GENL_NAME		"gpuos"
#define GPUOS_GENL_VERSION	1
#define GPUOS_MCGRP_EVENTS	"events"
#define GPUOS_ABI_VERSION	1

#define GPUOS_MAX_RANGES	4096
#define GPUOS_MAX_NL_RANGES	1024
#define GPUOS_MAX_PENDING	1024
#define GPUOS_MAX_POLICIES	4096
#define GPUOS_MAX_GPUS		32
#define GPUOS_MAX_PRIO		7
#define GPUOS_PAGE_SIZE		4096
#define GPUOS_FAULT_BATCH_ADDRS	8
#define GPUOS_FAULT_BATCH_MAX_FAULTS	65536
#define GPUOS_MAX_PREFETCH_AS	256
#define GPUOS_PREFETCH_WINDOW	(2U << 20)

enum gpuos_cmd {
	GPUOS_CMD_UNSPEC,
	GPUOS_CMD_GET_INFO,
	GPUOS_CMD_SET_POLICY,
	GPUOS_CMD_GET_POLICY,
	GPUOS_CMD_DEL_POLICY,
	GPUOS_CMD_LIST_POLICIES,
	GPUOS_CMD_MIGRATE,
	GPUOS_CMD_EVENT,
	GPUOS_CMD_SET_PREFETCH,
	__GPUOS_CMD_MAX,
};
#define GPUOS_CMD_MAX (__GPUOS_CMD_MAX - 1)

enum gpuos_attr {
	GPUOS_A_UNSPEC,
	GPUOS_A_PAD,			/* alignment padding for u64 attributes */
	GPUOS_A_GENL_VERSION,		/* u32 */
	GPUOS_A_ABI_VERSION,		/* u32 */
	GPUOS_A_MODULE_VERSION,		/* string, < 32 bytes */
	GPUOS_A_DRIVER_NAME,		/* string, < 32 bytes */
	GPUOS_A_DRIVER_CAPS,		/* u32, enum gpuos_driver_caps bits */
	GPUOS_A_COUNTERS,		/* nested: GPUOS_CTR_* u64 */
	GPUOS_A_CLIENT_PID,		/* u32, > 0 */
	GPUOS_A_CLIENT_CGROUP,		/* u64, cgroup v2 id, > 0 */
	GPUOS_A_FAULT_POLICY,		/* u32, enum gpuos_fault_policy */
	GPUOS_A_POLICY,			/* nested: client + GPUOS_A_FAULT_POLICY */
	GPUOS_A_AS_ID,			/* u64 */
	GPUOS_A_OP,			/* u32, enum gpuos_op */
	GPUOS_A_RANGES,			/* nested: GPUOS_A_RANGE ... */
	GPUOS_A_RANGE,			/* nested: GPUOS_A_RANGE_* */
	GPUOS_A_RANGE_BASE,		/* u64 */
	GPUOS_A_RANGE_LEN,		/* u64 */
	GPUOS_A_RANGE_DEST,		/* u32 */
	GPUOS_A_RANGE_PRIO,		/* u32 */
	GPUOS_A_RANGE_FLAGS,		/* u32 */
	GPUOS_A_RANGE_STATUS,		/* s32 */
	GPUOS_A_BATCH_ID,		/* u64 */
	GPUOS_A_EVENT_TYPE,		/* u32, enum gpuos_event_type */
	GPUOS_A_EVENT_SEQ,		/* u64 */
	GPUOS_A_EVENT_TIME_NS,		/* u64 */
	GPUOS_A_FAULT,			/* nested: GPUOS_A_FAULT_*, client, decision */
	GPUOS_A_FAULT_VEID,		/* u32 */
	GPUOS_A_FAULT_ADDR,		/* u64 */
	GPUOS_A_FAULT_ACCESS,		/* u32, enum gpuos_fault_access */
	GPUOS_A_FAULT_TYPE,		/* u32, enum gpuos_fault_type */
	GPUOS_A_FAULT_GPU,		/* u32, GPU index */
	GPUOS_A_DECISION,		/* u32, enum gpuos_decision */
	GPUOS_A_FAULT_BATCH_ID,		/* u64, the driver's fault batch number */
	GPUOS_A_FAULT_NR,		/* u32, distinct faults */
	GPUOS_A_FAULT_NR_INSTANCES,	/* u32, faults with merged duplicates */
	GPUOS_A_FAULT_NR_FATAL,		/* u32 */
	GPUOS_A_FAULT_NR_THROTTLED,	/* u32 */
	GPUOS_A_FAULT_NR_SKIPPED,	/* u32, batches not reported */
	GPUOS_A_FAULT_NR_READ,		/* u32 */
	GPUOS_A_FAULT_NR_WRITE,		/* u32 */
	GPUOS_A_FAULT_NR_ATOMIC,	/* u32 */
	GPUOS_A_FAULT_NR_PREFETCH,	/* u32 */
	GPUOS_A_FAULT_ADDR_MIN,		/* u64 */
	GPUOS_A_FAULT_ADDR_MAX,		/* u64 */
	GPUOS_A_FAULT_ADDRS,		/* nested: GPUOS_A_FAULT_ADDR ... */
	__GPUOS_A_MAX,
};
#define GPUOS_A_MAX (__GPUOS_A_MAX - 1)

/* Counters in GPUOS_A_COUNTERS (all u64, since the module was loaded). */
enum gpuos_counter {
	GPUOS_CTR_UNSPEC,
	GPUOS_CTR_PAD,
	GPUOS_CTR_FAULTS,		/* fault reports from the driver */
	GPUOS_CTR_DECISIONS_DEFAULT,	/* ... answered "driver's default" */
	GPUOS_CTR_DECISIONS_ISOLATE,	/* ... answered "isolate the client" */
	GPUOS_CTR_DECISIONS_KILL,	/* ... answered "kill the client" */
	GPUOS_CTR_BATCHES,		/* batches handed to the driver */
	GPUOS_CTR_RANGES,		/* ranges in those batches */
	GPUOS_CTR_BATCHES_DONE,		/* batches the driver completed (not those
					 * completed with -ENODEV at unregister) */
	GPUOS_CTR_REJECTED,		/* requests refused for bad input (by gpuos's own
					 * checks: messages the netlink policy refuses are
					 * not counted), malformed fault reports and
					 * fault batch reports, and
					 * gpuos_batch_done calls it ignored */
	GPUOS_CTR_EVENTS,		/* events generated */
	GPUOS_CTR_EVENTS_UNSENT,	/* events no listener received */
	GPUOS_CTR_POLICIES,		/* policies now set */
	GPUOS_CTR_OBJECTS,		/* live allocations of the module (leak check) */
	GPUOS_CTR_FAULT_BATCHES,	/* fault batch reports from the driver
					 * (well-formed ones; one per client and batch) */
	__GPUOS_CTR_MAX,
};
#define GPUOS_CTR_MAX (__GPUOS_CTR_MAX - 1)

enum gpuos_fault_policy {
	GPUOS_FAULT_DEFAULT = 0,	/* the driver does what it always did */
	GPUOS_FAULT_ISOLATE = 1,	/* stop only the faulting client; others go on */
	GPUOS_FAULT_KILL_CLIENT = 2,	/* isolate, then kill the client process */
	__GPUOS_FAULT_POLICY_MAX,
};

enum gpuos_decision {
	GPUOS_DECISION_DEFAULT = 0,
	GPUOS_DECISION_ISOLATE = 1,
	GPUOS_DECISION_KILL_CLIENT = 2,
};

enum gpuos_fault_access {
	GPUOS_ACCESS_READ = 0,
	GPUOS_ACCESS_WRITE = 1,
	GPUOS_ACCESS_ATOMIC = 2,
	GPUOS_ACCESS_PREFETCH = 3,
	__GPUOS_ACCESS_MAX,
};

enum gpuos_fault_type {
	GPUOS_FAULT_TYPE_INVALID_PDE = 0,	/* no mapping (the fatal kind) */
	GPUOS_FAULT_TYPE_INVALID_PTE = 1,
	GPUOS_FAULT_TYPE_WRITE = 2,		/* write to read-only */
	GPUOS_FAULT_TYPE_ATOMIC = 3,
	GPUOS_FAULT_TYPE_OTHER = 4,
	__GPUOS_FAULT_TYPE_MAX,
};

enum gpuos_op {
	GPUOS_OP_MIGRATE = 0,		/* move ranges to dest, by priority */
	GPUOS_OP_HINT = 1,		/* move ranges on the eviction list */
	__GPUOS_OP_MAX,
};

enum gpuos_event_type {
	GPUOS_EVENT_FAULT = 1,
	GPUOS_EVENT_CLIENT_ISOLATED = 2,
	GPUOS_EVENT_MIGRATION_DONE = 3,
	GPUOS_EVENT_DRIVER_REGISTERED = 4,
	GPUOS_EVENT_DRIVER_UNREGISTERED = 5,
	GPUOS_EVENT_POLICY_SET = 6,
	GPUOS_EVENT_POLICY_DELETED = 7,
	GPUOS_EVENT_FAULT_BATCH = 8,
	__GPUOS_EVENT_MAX,
};

enum gpuos_driver_caps {
	GPUOS_CAP_FAULT_REPORTS = 1 << 0,	/* reports faults, obeys decisions */
	GPUOS_CAP_MIGRATE = 1 << 1,		/* GPUOS_OP_MIGRATE */
	GPUOS_CAP_HINT = 1 << 2,		/* GPUOS_OP_HINT */
	GPUOS_CAP_STOP_CLIENT = 1 << 3,		/* can stop one client */
};

#define GPUOS_DEST_CPU		0
#define GPUOS_DEST_GPU(i)	((i) + 1)
#define GPUOS_RANGE_EVICT_FIRST	(1U << 0)	/* GPUOS_OP_HINT: head of the eviction list */
#define GPUOS_RANGE_EVICT_LAST	(1U << 1)	/* GPUOS_OP_HINT: tail of the eviction list */

struct gpuos_range {
	__u64 base;
	__u64 len;
	__u32 dest;
	__u32 prio;
	__u32 flags;
	__s32 status;
};

struct gpuos_batch {
	__u32 size;
	__u32 op;
	__u64 as_id;
	__u32 nr_ranges;
	__u32 flags;
	__u64 ranges;		/* user pointer to struct gpuos_range[nr_ranges] */
	__u64 batch_id;
};

#define GPUOS_IOC_MAGIC		'G'
#define GPUOS_IOC_ABI_VERSION	_IOR(GPUOS_IOC_MAGIC, 0x00, __u32)
#define GPUOS_IOC_SUBMIT	_IOWR(GPUOS_IOC_MAGIC, 0x01, struct gpuos_batch)

#endif /* _UAPI_LINUX_GPUOS_H */
