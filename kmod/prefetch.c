// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * Prefetch ranges per address space.
 *
 * User space stores them ahead of time (GPUOS_CMD_SET_PREFETCH); the
 * driver's fault servicing reads them with gpuos_prefetch_lookup(), which
 * takes no lock, never sleeps and never allocates: so a fault never waits
 * for gpuos or for user space.  One hash table of at most
 * GPUOS_MAX_PREFETCH_AS lists, keyed by as_id; a list is immutable once
 * published (sorted by base, no overlaps) and a new one replaces it, the old
 * one being freed after an RCU grace period.  Writers serialize on a
 * spinlock.
 */
#include <linux/hashtable.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/rcupdate.h>
#include <linux/slab.h>
#include <linux/sort.h>
#include <linux/spinlock.h>

#include "counters.h"
#include "prefetch.h"

#define GPUOS_PREFETCH_HASH_BITS	6

struct gpuos_prefetch_list {
	struct hlist_node node;
	struct rcu_head rcu;
	u64 as_id;
	u32 nr;
	struct gpuos_prefetch_range r[];	/* sorted by base, disjoint */
};

static DEFINE_HASHTABLE(gpuos_prefetch, GPUOS_PREFETCH_HASH_BITS);
static DEFINE_SPINLOCK(gpuos_prefetch_lock);	/* writers only */
static unsigned int gpuos_prefetch_count;	/* under gpuos_prefetch_lock */

/* Caller holds rcu_read_lock() or gpuos_prefetch_lock. */
static struct gpuos_prefetch_list *gpuos_prefetch_find(u64 as_id)
{
	struct gpuos_prefetch_list *l;

	hash_for_each_possible_rcu(gpuos_prefetch, l, node, as_id,
				   lockdep_is_held(&gpuos_prefetch_lock)) {
		if (l->as_id == as_id)
			return l;
	}
	return NULL;
}

static void gpuos_prefetch_free_rcu(struct rcu_head *rcu)
{
	/* uncounted: gpuos_prefetch_release() did */
	kfree(container_of(rcu, struct gpuos_prefetch_list, rcu));
}

/* Unpublished already; readers may still see it until a grace period ends. */
static void gpuos_prefetch_release(struct gpuos_prefetch_list *l)
{
	gpuos_obj_released();
	call_rcu(&l->rcu, gpuos_prefetch_free_rcu);
}

static int gpuos_prefetch_cmp(const void *a, const void *b)
{
	const struct gpuos_prefetch_range *x = a, *y = b;

	return x->base < y->base ? -1 : x->base > y->base;
}

int gpuos_prefetch_set(u64 as_id, struct gpuos_prefetch_range *r, u32 nr)
{
	struct gpuos_prefetch_list *l = NULL, *old;
	u64 end;
	u32 i;

	if (nr > GPUOS_MAX_NL_RANGES)
		return -E2BIG;
	for (i = 0; i < nr; i++) {
		if (!r[i].len || !IS_ALIGNED(r[i].base, GPUOS_PAGE_SIZE) ||
		    !IS_ALIGNED(r[i].len, GPUOS_PAGE_SIZE) ||
		    check_add_overflow(r[i].base, r[i].len, &end))
			return -EINVAL;
	}
	sort(r, nr, sizeof(*r), gpuos_prefetch_cmp, NULL);
	for (i = 1; i < nr; i++)
		if (r[i - 1].base + r[i - 1].len > r[i].base)
			return -EINVAL;

	if (nr) {
		l = gpuos_kmalloc(struct_size(l, r, nr), GFP_KERNEL);
		if (!l)
			return -ENOMEM;
		l->as_id = as_id;
		l->nr = nr;
		memcpy(l->r, r, nr * sizeof(*r));
	}

	spin_lock(&gpuos_prefetch_lock);
	old = gpuos_prefetch_find(as_id);
	if (old && l) {
		hlist_replace_rcu(&old->node, &l->node);
	} else if (old) {
		hash_del_rcu(&old->node);
		gpuos_prefetch_count--;
	} else if (l && gpuos_prefetch_count >= GPUOS_MAX_PREFETCH_AS) {
		spin_unlock(&gpuos_prefetch_lock);
		gpuos_kfree(l);		/* never published */
		return -ENOSPC;
	} else if (l) {
		hash_add_rcu(gpuos_prefetch, &l->node, as_id);
		gpuos_prefetch_count++;
	}
	spin_unlock(&gpuos_prefetch_lock);

	if (old)
		gpuos_prefetch_release(old);
	return 0;
}

void gpuos_address_space_gone(u64 as_id)
{
	might_sleep();
	gpuos_prefetch_set(as_id, NULL, 0);	/* no list: nothing to drop */
}
EXPORT_SYMBOL_GPL(gpuos_address_space_gone);

u32 gpuos_prefetch_lookup(u64 as_id, u64 addr, struct gpuos_prefetch_range *out,
			  u32 max)
{
	u64 win_start = round_down(addr, (u64)GPUOS_PREFETCH_WINDOW);
	u64 win_end = win_start + GPUOS_PREFETCH_WINDOW;	/* 0 past the top */
	const struct gpuos_prefetch_list *l;
	u32 i, n = 0;

	if (!max || !out)
		return 0;
	rcu_read_lock();
	l = gpuos_prefetch_find(as_id);
	for (i = 0; l && i < l->nr && n < max; i++) {
		u64 start = l->r[i].base;
		u64 end = start + l->r[i].len;	/* no overflow: checked at set */

		if (win_end && start >= win_end)
			break;			/* sorted: none further meets */
		if (end <= win_start)
			continue;
		start = max(start, win_start);
		if (win_end)
			end = min(end, win_end);
		out[n].base = start;
		out[n].len = end - start;
		n++;
	}
	rcu_read_unlock();
	return n;
}
EXPORT_SYMBOL_GPL(gpuos_prefetch_lookup);

int gpuos_prefetch_init(void)
{
	return 0;
}

void gpuos_prefetch_exit(void)
{
	struct gpuos_prefetch_list *l;
	struct hlist_node *tmp;
	int bkt;

	spin_lock(&gpuos_prefetch_lock);
	hash_for_each_safe(gpuos_prefetch, bkt, tmp, l, node) {
		hash_del_rcu(&l->node);
		gpuos_prefetch_release(l);
	}
	gpuos_prefetch_count = 0;
	spin_unlock(&gpuos_prefetch_lock);

	/* The callbacks above run module code: wait for them before unload. */
	rcu_barrier();
}
