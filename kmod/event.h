/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * Events on the "events" multicast group (GPUOS_CMD_EVENT).  Every event
 * takes the next sequence number, whether anyone receives it or not.
 */
#ifndef _GPUOS_EVENT_H
#define _GPUOS_EVENT_H

#include <linux/types.h>
#include <linux/gfp.h>

struct gpuos_fault_report;
struct gpuos_fault_batch_report;
struct nlattr;
struct sk_buff;
struct gpuos_kbatch;
struct gpuos_client;

/*
 * FAULT or CLIENT_ISOLATED.  Atomic context allowed (not with interrupts
 * disabled: then the event is counted as unsent).  @cgroup 0: unknown.
 */
void gpuos_event_fault(u32 type, const struct gpuos_fault_report *r,
		       u64 cgroup, u32 decision);
/* FAULT_BATCH, from a well-formed report; the same contexts as above. */
void gpuos_event_fault_batch(const struct gpuos_fault_batch_report *r,
			     u64 cgroup);
/*
 * The rest: process context.  MIGRATION_DONE comes in two steps, so that
 * the batch can be freed between them: once a listener has the event, the
 * batch no longer counts in OBJECTS.  gpuos_event_send() consumes @ev.
 */
struct gpuos_ev {
	struct sk_buff *skb;	/* NULL: nothing to send (counted as unsent) */
	void *hdr;
	struct nlattr *seq;
	struct nlattr *time;
};
void gpuos_event_batch_done_prepare(struct gpuos_ev *ev,
				    const struct gpuos_kbatch *b);
void gpuos_event_send(struct gpuos_ev *ev);
void gpuos_event_driver(u32 type, const char *name);
void gpuos_event_policy(u32 type, const struct gpuos_client *c, u32 policy);

/* Events flow only between these two (around the family's registration). */
void gpuos_events_start(void);
void gpuos_events_stop(void);

u64 gpuos_event_last_seq(void);

#endif /* _GPUOS_EVENT_H */
