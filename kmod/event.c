// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * Events on the "events" multicast group.
 *
 * The sequence number is taken and the event multicast under one spinlock,
 * so that every listener receives events in sequence order and a gap means
 * a loss, never a reordering.  The message is built outside the lock (with
 * the caller's gfp) and its SEQ and TIME attributes are filled in under it.
 * Events no one can receive (no listener, no memory, interrupts disabled)
 * still take a number and are counted in GPUOS_CTR_EVENTS_UNSENT.
 */
#include <linux/irqflags.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/ktime.h>
#include <net/genetlink.h>
#include <net/net_namespace.h>

#include "batch.h"
#include "counters.h"
#include "event.h"
#include "hooks.h"
#include "netlink.h"
#include "policy.h"

static DEFINE_SPINLOCK(gpuos_event_lock);
static bool gpuos_events_live;		/* under gpuos_event_lock */
static atomic64_t gpuos_event_seq = ATOMIC64_INIT(0);

/* Wide enough for the largest MIGRATION_DONE: a nest's length is 16 bits. */
#define GPUOS_EV_RANGE_STATUS_SIZE \
	(NLA_HDRLEN + NLA_ALIGN(NLA_HDRLEN + sizeof(s32)))
static_assert(NLA_HDRLEN + GPUOS_MAX_RANGES * GPUOS_EV_RANGE_STATUS_SIZE <= U16_MAX);

u64 gpuos_event_last_seq(void)
{
	return atomic64_read(&gpuos_event_seq);
}

void gpuos_events_start(void)
{
	spin_lock_bh(&gpuos_event_lock);
	gpuos_events_live = true;
	spin_unlock_bh(&gpuos_event_lock);
}

void gpuos_events_stop(void)
{
	spin_lock_bh(&gpuos_event_lock);
	gpuos_events_live = false;
	spin_unlock_bh(&gpuos_event_lock);
}

static void gpuos_ev_unsent(void)
{
	atomic64_inc(&gpuos_event_seq);
	gpuos_ctr_inc(GPUOS_CTR_EVENTS_UNSENT);
}

static bool gpuos_ev_begin(struct gpuos_ev *ev, u32 type, size_t payload,
			   gfp_t gfp)
{
	gpuos_ctr_inc(GPUOS_CTR_EVENTS);

	/*
	 * Netlink delivery may enable bottom halves, which must not happen
	 * with interrupts disabled; and no one listening costs nothing.
	 */
	if (irqs_disabled() || !READ_ONCE(gpuos_events_live) ||
	    genl_has_listeners(&gpuos_genl_family, &init_net,
			       GPUOS_MCGRP_EVENTS_IDX) <= 0)
		goto unsent;

	payload += nla_total_size(sizeof(u32)) +
		   2 * nla_total_size_64bit(sizeof(u64));
	ev->skb = genlmsg_new(payload, gfp | __GFP_NOWARN);
	if (!ev->skb)
		goto unsent;
	ev->hdr = genlmsg_put(ev->skb, 0, 0, &gpuos_genl_family, 0,
			      GPUOS_CMD_EVENT);
	if (!ev->hdr || nla_put_u32(ev->skb, GPUOS_A_EVENT_TYPE, type))
		goto free;
	ev->seq = nla_reserve_64bit(ev->skb, GPUOS_A_EVENT_SEQ, sizeof(u64),
				    GPUOS_A_PAD);
	ev->time = nla_reserve_64bit(ev->skb, GPUOS_A_EVENT_TIME_NS,
				     sizeof(u64), GPUOS_A_PAD);
	if (!ev->seq || !ev->time)
		goto free;
	return true;

free:
	nlmsg_free(ev->skb);
unsent:
	gpuos_ev_unsent();
	return false;
}

static void gpuos_ev_cancel(struct gpuos_ev *ev)
{
	nlmsg_free(ev->skb);
	gpuos_ev_unsent();
}

static void gpuos_ev_send(struct gpuos_ev *ev)
{
	int ret = -ESRCH;
	u64 seq, now;

	genlmsg_end(ev->skb, ev->hdr);

	spin_lock_bh(&gpuos_event_lock);
	seq = atomic64_inc_return(&gpuos_event_seq);
	if (gpuos_events_live) {
		now = ktime_get_ns();
		memcpy(nla_data(ev->seq), &seq, sizeof(seq));
		memcpy(nla_data(ev->time), &now, sizeof(now));
		/* Consumes the skb whatever happens. */
		ret = genlmsg_multicast(&gpuos_genl_family, ev->skb, 0,
					GPUOS_MCGRP_EVENTS_IDX, GFP_ATOMIC);
	} else {
		nlmsg_free(ev->skb);
	}
	spin_unlock_bh(&gpuos_event_lock);

	/*
	 * -ESRCH: no listener took it.  -ENOBUFS means some listener's socket
	 * was full; it sees the gap, and others may have received it.
	 */
	if (ret == -ESRCH)
		gpuos_ctr_inc(GPUOS_CTR_EVENTS_UNSENT);
}

/* The client of a fault event: pid, its cgroup (0: none known), address space. */
static int gpuos_put_client(struct sk_buff *skb, u32 pid, u64 cgroup, u64 as_id)
{
	return nla_put_u32(skb, GPUOS_A_CLIENT_PID, pid) ||
	       (cgroup && nla_put_u64_64bit(skb, GPUOS_A_CLIENT_CGROUP, cgroup,
					    GPUOS_A_PAD)) ||
	       nla_put_u64_64bit(skb, GPUOS_A_AS_ID, as_id, GPUOS_A_PAD);
}

void gpuos_event_fault(u32 type, const struct gpuos_fault_report *r,
		       u64 cgroup, u32 decision)
{
	struct gpuos_ev ev;
	struct nlattr *nest;

	if (!gpuos_ev_begin(&ev, type, nla_total_size(0) +
			    6 * nla_total_size(sizeof(u32)) +
			    3 * nla_total_size_64bit(sizeof(u64)), GFP_ATOMIC))
		return;

	nest = nla_nest_start(ev.skb, GPUOS_A_FAULT);
	if (!nest ||
	    gpuos_put_client(ev.skb, r->pid, cgroup, r->as_id) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_VEID, r->veid) ||
	    nla_put_u64_64bit(ev.skb, GPUOS_A_FAULT_ADDR, r->addr, GPUOS_A_PAD) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_ACCESS, r->access) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_TYPE, r->type) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_GPU, r->gpu) ||
	    nla_put_u32(ev.skb, GPUOS_A_DECISION, decision)) {
		gpuos_ev_cancel(&ev);
		return;
	}
	nla_nest_end(ev.skb, nest);
	gpuos_ev_send(&ev);
}

void gpuos_event_fault_batch(const struct gpuos_fault_batch_report *r,
			     u64 cgroup)
{
	static const int access_attr[__GPUOS_ACCESS_MAX] = {
		[GPUOS_ACCESS_READ] = GPUOS_A_FAULT_NR_READ,
		[GPUOS_ACCESS_WRITE] = GPUOS_A_FAULT_NR_WRITE,
		[GPUOS_ACCESS_ATOMIC] = GPUOS_A_FAULT_NR_ATOMIC,
		[GPUOS_ACCESS_PREFETCH] = GPUOS_A_FAULT_NR_PREFETCH,
	};
	struct nlattr *nest, *addrs;
	struct gpuos_ev ev;
	u32 i;

	if (!gpuos_ev_begin(&ev, GPUOS_EVENT_FAULT_BATCH,
			    2 * nla_total_size(0) +
			    (7 + __GPUOS_ACCESS_MAX) * nla_total_size(sizeof(u32)) +
			    (5 + GPUOS_FAULT_BATCH_ADDRS) *
			    nla_total_size_64bit(sizeof(u64)), GFP_ATOMIC))
		return;

	nest = nla_nest_start(ev.skb, GPUOS_A_FAULT);
	if (!nest ||
	    gpuos_put_client(ev.skb, r->pid, cgroup, r->as_id) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_GPU, r->gpu) ||
	    nla_put_u64_64bit(ev.skb, GPUOS_A_FAULT_BATCH_ID, r->batch_id,
			      GPUOS_A_PAD) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_NR, r->nr_faults) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_NR_INSTANCES, r->nr_instances) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_NR_FATAL, r->nr_fatal) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_NR_THROTTLED, r->nr_throttled) ||
	    nla_put_u32(ev.skb, GPUOS_A_FAULT_NR_SKIPPED, r->nr_skipped))
		goto cancel;
	for (i = 0; i < __GPUOS_ACCESS_MAX; i++)
		if (nla_put_u32(ev.skb, access_attr[i], r->nr_by_access[i]))
			goto cancel;
	if (nla_put_u64_64bit(ev.skb, GPUOS_A_FAULT_ADDR_MIN, r->addr_min,
			      GPUOS_A_PAD) ||
	    nla_put_u64_64bit(ev.skb, GPUOS_A_FAULT_ADDR_MAX, r->addr_max,
			      GPUOS_A_PAD))
		goto cancel;
	addrs = nla_nest_start(ev.skb, GPUOS_A_FAULT_ADDRS);
	if (!addrs)
		goto cancel;
	for (i = 0; i < r->nr_addrs; i++)
		if (nla_put_u64_64bit(ev.skb, GPUOS_A_FAULT_ADDR, r->addrs[i],
				      GPUOS_A_PAD))
			goto cancel;
	nla_nest_end(ev.skb, addrs);
	nla_nest_end(ev.skb, nest);
	gpuos_ev_send(&ev);
	return;

cancel:
	gpuos_ev_cancel(&ev);
}

void gpuos_event_batch_done_prepare(struct gpuos_ev *ev,
				    const struct gpuos_kbatch *b)
{
	struct nlattr *ranges, *range;
	u32 i;

	if (!gpuos_ev_begin(ev, GPUOS_EVENT_MIGRATION_DONE,
			    2 * nla_total_size_64bit(sizeof(u64)) + NLA_HDRLEN +
			    (size_t)b->nr * GPUOS_EV_RANGE_STATUS_SIZE, GFP_KERNEL)) {
		ev->skb = NULL;		/* already counted as unsent */
		return;
	}

	if (nla_put_u64_64bit(ev->skb, GPUOS_A_BATCH_ID, b->id, GPUOS_A_PAD) ||
	    nla_put_u64_64bit(ev->skb, GPUOS_A_AS_ID, b->as_id, GPUOS_A_PAD))
		goto cancel;
	ranges = nla_nest_start(ev->skb, GPUOS_A_RANGES);
	if (!ranges)
		goto cancel;
	for (i = 0; i < b->nr; i++) {
		range = nla_nest_start(ev->skb, GPUOS_A_RANGE);
		if (!range || nla_put_s32(ev->skb, GPUOS_A_RANGE_STATUS,
					  b->ranges[i].status))
			goto cancel;
		nla_nest_end(ev->skb, range);
	}
	nla_nest_end(ev->skb, ranges);
	return;

cancel:
	gpuos_ev_cancel(ev);
	ev->skb = NULL;
}

void gpuos_event_send(struct gpuos_ev *ev)
{
	if (ev->skb)
		gpuos_ev_send(ev);
}

void gpuos_event_driver(u32 type, const char *name)
{
	struct gpuos_ev ev;

	if (!gpuos_ev_begin(&ev, type, nla_total_size(GPUOS_DRIVER_NAME_MAX),
			    GFP_KERNEL))
		return;
	if (nla_put_string(ev.skb, GPUOS_A_DRIVER_NAME, name)) {
		gpuos_ev_cancel(&ev);
		return;
	}
	gpuos_ev_send(&ev);
}

void gpuos_event_policy(u32 type, const struct gpuos_client *c, u32 policy)
{
	struct gpuos_ev ev;

	if (!gpuos_ev_begin(&ev, type, gpuos_nl_policy_size(), GFP_KERNEL))
		return;
	if (gpuos_nl_put_policy(ev.skb, c, policy)) {
		gpuos_ev_cancel(&ev);
		return;
	}
	gpuos_ev_send(&ev);
}
