// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * Batches: validation, submission to the driver, completion.
 *
 * A batch lives in the pending table from just before ops->submit() (a
 * driver may complete it from inside submit) until gpuos_batch_done() or
 * unregistering takes it out.  Whoever takes it out owns it and hands it to
 * its done_work, which emits MIGRATION_DONE and frees it.  So a batch is
 * freed exactly once, and after ops->submit() returns the submitter touches
 * it only after finding it, by id, still in the table.
 *
 * gpuos_batch_done() may come from any context of the driver's (it copies
 * the statuses and queues work; no allocation, an irq-safe spinlock).
 */
#include <linux/hashtable.h>
#include <linux/overflow.h>
#include <linux/spinlock.h>
#include <linux/err.h>
#include <linux/align.h>

#include "batch.h"
#include "counters.h"
#include "event.h"
#include "hooks.h"
#include "trace.h"

#define GPUOS_PENDING_HASH_BITS	6

static DEFINE_HASHTABLE(gpuos_pending, GPUOS_PENDING_HASH_BITS);
static DEFINE_SPINLOCK(gpuos_pending_lock);
static unsigned int gpuos_npending;		/* under gpuos_pending_lock */
static atomic64_t gpuos_batch_ids = ATOMIC64_INIT(0);

static void gpuos_kbatch_done_work(struct work_struct *work);

/* What a driver returns is not trusted to be an errno. */
static int gpuos_errno(int err)
{
	if (err > 0 || err < -MAX_ERRNO)
		return -EIO;
	return err;
}

struct gpuos_kbatch *gpuos_kbatch_alloc(u32 op, u64 as_id, u32 nr)
{
	struct gpuos_kbatch *b;

	if (!nr || nr > GPUOS_MAX_RANGES)
		return NULL;
	/* Up to 128 KiB of ranges: kvmalloc falls back to vmalloc. */
	b = gpuos_kvmalloc(struct_size(b, ranges, nr), GFP_KERNEL | __GFP_ZERO);
	if (!b)
		return NULL;
	INIT_HLIST_NODE(&b->node);
	INIT_WORK(&b->done_work, gpuos_kbatch_done_work);
	b->op = op;
	b->as_id = as_id;
	b->nr = nr;
	return b;
}

void gpuos_kbatch_free(struct gpuos_kbatch *b)
{
	gpuos_kvfree(b);
}

int gpuos_range_check(u32 op, const struct gpuos_range *r)
{
	u64 end;

	if (!r->len || !IS_ALIGNED(r->base, GPUOS_PAGE_SIZE) ||
	    !IS_ALIGNED(r->len, GPUOS_PAGE_SIZE))
		return -EINVAL;
	if (check_add_overflow(r->base, r->len, &end))
		return -EINVAL;
	if (r->dest > GPUOS_DEST_GPU(GPUOS_MAX_GPUS - 1))
		return -EINVAL;
	if (r->prio > GPUOS_MAX_PRIO)
		return -EINVAL;
	switch (op) {
	case GPUOS_OP_MIGRATE:
		return r->flags ? -EINVAL : 0;
	case GPUOS_OP_HINT:
		return r->flags == GPUOS_RANGE_EVICT_FIRST ||
		       r->flags == GPUOS_RANGE_EVICT_LAST ? 0 : -EINVAL;
	}
	return -EINVAL;
}

/* Sets every status; returns how many ranges are bad. */
static u32 gpuos_kbatch_check(struct gpuos_kbatch *b)
{
	u32 i, bad = 0;

	for (i = 0; i < b->nr; i++) {
		b->ranges[i].status = gpuos_range_check(b->op, &b->ranges[i]);
		if (b->ranges[i].status)
			bad++;
	}
	return bad;
}

int gpuos_kbatch_validate(struct gpuos_kbatch *b)
{
	return gpuos_kbatch_check(b) ? gpuos_reject(-EINVAL) : 0;
}

/* Caller holds gpuos_pending_lock. */
static struct gpuos_kbatch *gpuos_pending_find(u64 id)
{
	struct gpuos_kbatch *b;

	hash_for_each_possible(gpuos_pending, b, node, id) {
		if (b->id == id)
			return b;
	}
	return NULL;
}

int gpuos_kbatch_submit(struct gpuos_kbatch *b, u64 *id_out)
{
	const struct gpuos_driver_ops *ops;
	struct gpuos_batch_req req;
	u32 nr = b->nr, op = b->op;
	u64 id = 0, as_id = b->as_id;
	unsigned long flags;
	bool owned = true;
	int idx, ret;

	/* Callers validate first; this makes the driver's input safe regardless. */
	if (gpuos_kbatch_check(b)) {
		gpuos_kbatch_free(b);
		return gpuos_reject(-EINVAL);
	}

	ops = gpuos_driver_get(&idx);
	if (!ops) {
		ret = -ENODEV;
		goto out;
	}
	if (!(ops->caps & (op == GPUOS_OP_MIGRATE ? GPUOS_CAP_MIGRATE : GPUOS_CAP_HINT)) ||
	    !ops->submit) {
		ret = -EOPNOTSUPP;
		goto out;
	}

	spin_lock_irqsave(&gpuos_pending_lock, flags);
	if (gpuos_npending >= GPUOS_MAX_PENDING) {
		spin_unlock_irqrestore(&gpuos_pending_lock, flags);
		ret = -EAGAIN;
		goto out;
	}
	id = atomic64_inc_return(&gpuos_batch_ids);
	b->id = id;
	hash_add(gpuos_pending, &b->node, id);
	gpuos_npending++;
	spin_unlock_irqrestore(&gpuos_pending_lock, flags);

	req = (struct gpuos_batch_req) {
		.id = id,
		.as_id = as_id,
		.op = op,
		.nr_ranges = nr,
		.ranges = b->ranges,
	};
	ret = gpuos_errno(ops->submit(&req));
	owned = false;
	if (ret) {
		/*
		 * Take it back.  If it is gone, the driver completed it before
		 * failing (a driver bug); then its completion owns it.
		 */
		spin_lock_irqsave(&gpuos_pending_lock, flags);
		if (gpuos_pending_find(id) == b) {
			hash_del(&b->node);
			gpuos_npending--;
			owned = true;
		}
		spin_unlock_irqrestore(&gpuos_pending_lock, flags);
	}
out:
	gpuos_driver_put(idx);
	trace_migrate(id, as_id, op, nr, ret);
	if (owned)
		gpuos_kbatch_free(b);
	if (ret)
		return ret;
	gpuos_ctr_inc(GPUOS_CTR_BATCHES);
	gpuos_ctr_add(GPUOS_CTR_RANGES, nr);
	*id_out = id;
	return 0;
}

void gpuos_batch_done(u64 batch_id, const s32 *status, u32 nr)
{
	struct gpuos_kbatch *b;
	unsigned long flags;
	u32 i;

	spin_lock_irqsave(&gpuos_pending_lock, flags);
	b = gpuos_pending_find(batch_id);
	if (!b || nr != b->nr || !status) {
		/* Unknown id or wrong count: ignore; the batch stays pending. */
		spin_unlock_irqrestore(&gpuos_pending_lock, flags);
		gpuos_reject(0);
		return;
	}
	hash_del(&b->node);
	gpuos_npending--;
	spin_unlock_irqrestore(&gpuos_pending_lock, flags);

	for (i = 0; i < nr; i++)
		b->ranges[i].status = gpuos_errno(status[i]);
	b->by_driver = true;
	gpuos_queue_work(&b->done_work);
}
EXPORT_SYMBOL_GPL(gpuos_batch_done);

void gpuos_batch_abort_all(int err)
{
	HLIST_HEAD(list);
	struct gpuos_kbatch *b;
	struct hlist_node *tmp;
	unsigned long flags;
	int bkt;
	u32 i;

	spin_lock_irqsave(&gpuos_pending_lock, flags);
	hash_for_each_safe(gpuos_pending, bkt, tmp, b, node) {
		hash_del(&b->node);
		hlist_add_head(&b->node, &list);
	}
	gpuos_npending = 0;
	spin_unlock_irqrestore(&gpuos_pending_lock, flags);

	hlist_for_each_entry_safe(b, tmp, &list, node) {
		hlist_del_init(&b->node);
		for (i = 0; i < b->nr; i++)
			b->ranges[i].status = err;
		b->by_driver = false;
		gpuos_queue_work(&b->done_work);	/* b is not ours after this */
	}
}

static void gpuos_kbatch_done_work(struct work_struct *work)
{
	struct gpuos_kbatch *b = container_of(work, struct gpuos_kbatch, done_work);
	int first_error = 0;
	struct gpuos_ev ev;
	u32 i;

	for (i = 0; i < b->nr; i++) {
		if (b->ranges[i].status) {
			first_error = b->ranges[i].status;
			break;
		}
	}
	trace_batch_done(b->id, b->nr, first_error);
	if (b->by_driver)
		gpuos_ctr_inc(GPUOS_CTR_BATCHES_DONE);
	/* Free before sending: whoever sees the event sees the batch gone. */
	gpuos_event_batch_done_prepare(&ev, b);
	gpuos_kbatch_free(b);
	gpuos_event_send(&ev);
}
