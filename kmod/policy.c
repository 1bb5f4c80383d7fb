// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * Per-client fault policies.
 *
 * One hash table of at most GPUOS_MAX_POLICIES entries, keyed by (kind, id).
 * The fault path reads it under RCU, from any atomic context, and never
 * takes a lock; writers (netlink, process context) serialize on a spinlock
 * and never change an entry in place: a new policy replaces the old entry,
 * which is freed after a grace period.
 */
#include <linux/cgroup.h>
#include <linux/hashtable.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/rcupdate.h>
#include <linux/sched.h>
#include <linux/spinlock.h>

#include "counters.h"
#include "policy.h"
#include "trace.h"

#define GPUOS_POLICY_HASH_BITS	8

struct gpuos_policy {
	struct hlist_node node;
	struct rcu_head rcu;
	struct gpuos_client client;
	u32 policy;
	/*
	 * For a pid client: the process the number named when the policy was
	 * set (a reference is held, so the pointer cannot be reused; NULL for a
	 * cgroup).  A pid policy needs a live process, and never applies to a
	 * later process that reuses its number.
	 */
	struct pid *spid;
};

static DEFINE_HASHTABLE(gpuos_policies, GPUOS_POLICY_HASH_BITS);
static DEFINE_SPINLOCK(gpuos_policy_lock);	/* writers only */
static unsigned int gpuos_policy_count;		/* under gpuos_policy_lock */
/* Bumped by 2 on each change so that it is never 0 (dump consistency). */
static unsigned int gpuos_policy_gen = 1;

static u64 gpuos_policy_key(const struct gpuos_client *c)
{
	return c->id ^ ((u64)c->kind << 60);
}

static bool gpuos_client_valid(const struct gpuos_client *c)
{
	switch (c->kind) {
	case GPUOS_CLIENT_PID:
		return c->id > 0 && c->id <= U32_MAX;
	case GPUOS_CLIENT_CGROUP:
		return c->id > 0;
	}
	return false;
}

/* Caller holds rcu_read_lock() or gpuos_policy_lock. */
static struct gpuos_policy *gpuos_policy_find(const struct gpuos_client *c)
{
	struct gpuos_policy *p;

	hash_for_each_possible_rcu(gpuos_policies, p, node, gpuos_policy_key(c),
				   lockdep_is_held(&gpuos_policy_lock)) {
		if (p->client.kind == c->kind && p->client.id == c->id)
			return p;
	}
	return NULL;
}

static void gpuos_policy_free(struct gpuos_policy *p)
{
	put_pid(p->spid);
	gpuos_kfree(p);
}

static void gpuos_policy_free_rcu(struct rcu_head *rcu)
{
	struct gpuos_policy *p = container_of(rcu, struct gpuos_policy, rcu);

	put_pid(p->spid);
	kfree(p);	/* uncounted: see gpuos_policy_release() */
}

/* Unpublished already; readers may still see it until a grace period ends. */
static void gpuos_policy_release(struct gpuos_policy *p)
{
	gpuos_obj_released();
	call_rcu(&p->rcu, gpuos_policy_free_rcu);
}

static void gpuos_policy_trace(const struct gpuos_client *c, u32 policy,
			       bool set)
{
	trace_policy(c->kind == GPUOS_CLIENT_PID ? (u32)c->id : 0,
		     c->kind == GPUOS_CLIENT_CGROUP ? c->id : 0, policy, set);
}

int gpuos_policy_set(const struct gpuos_client *c, u32 policy)
{
	struct gpuos_policy *p, *old;

	if (!gpuos_client_valid(c) || policy >= __GPUOS_FAULT_POLICY_MAX)
		return -EINVAL;

	p = gpuos_kmalloc(sizeof(*p), GFP_KERNEL);
	if (!p)
		return -ENOMEM;
	p->client = *c;
	p->policy = policy;
	p->spid = NULL;
	if (c->kind == GPUOS_CLIENT_PID) {
		rcu_read_lock();
		p->spid = get_pid(find_pid_ns((pid_t)c->id, &init_pid_ns));
		rcu_read_unlock();
		if (!p->spid || !pid_has_task(p->spid, PIDTYPE_TGID)) {
			/* No process: it would apply to whichever comes to have the number. */
			gpuos_policy_free(p);
			return -ESRCH;
		}
	}

	spin_lock(&gpuos_policy_lock);
	old = gpuos_policy_find(c);
	if (old) {
		hlist_replace_rcu(&old->node, &p->node);
	} else if (gpuos_policy_count >= GPUOS_MAX_POLICIES) {
		spin_unlock(&gpuos_policy_lock);
		gpuos_policy_free(p);	/* never published */
		return -ENOSPC;
	} else {
		hash_add_rcu(gpuos_policies, &p->node, gpuos_policy_key(c));
		gpuos_ctr_set(GPUOS_CTR_POLICIES, ++gpuos_policy_count);
	}
	WRITE_ONCE(gpuos_policy_gen, gpuos_policy_gen + 2);
	spin_unlock(&gpuos_policy_lock);

	if (old)
		gpuos_policy_release(old);
	gpuos_policy_trace(c, policy, true);
	return 0;
}

int gpuos_policy_get(const struct gpuos_client *c, u32 *policy)
{
	struct gpuos_policy *p;
	int ret = -ENOENT;

	if (!gpuos_client_valid(c))
		return -EINVAL;
	rcu_read_lock();
	p = gpuos_policy_find(c);
	if (p) {
		*policy = p->policy;
		ret = 0;
	}
	rcu_read_unlock();
	return ret;
}

int gpuos_policy_del(const struct gpuos_client *c, u32 *old_policy)
{
	struct gpuos_policy *p;

	if (!gpuos_client_valid(c))
		return -EINVAL;

	spin_lock(&gpuos_policy_lock);
	p = gpuos_policy_find(c);
	if (!p) {
		spin_unlock(&gpuos_policy_lock);
		return -ENOENT;
	}
	hash_del_rcu(&p->node);
	gpuos_ctr_set(GPUOS_CTR_POLICIES, --gpuos_policy_count);
	WRITE_ONCE(gpuos_policy_gen, gpuos_policy_gen + 2);
	spin_unlock(&gpuos_policy_lock);

	*old_policy = p->policy;
	gpuos_policy_release(p);
	gpuos_policy_trace(c, *old_policy, false);
	return 0;
}

unsigned int gpuos_policy_generation(void)
{
	return READ_ONCE(gpuos_policy_gen);
}

/*
 * Calls @fn under RCU (so it must not sleep) for each policy from @cur on.
 * Stops at the first error of @fn and leaves @cur on that policy, so that the
 * next call starts with it; at the end @cur is past the last bucket.
 */
int gpuos_policy_walk(struct gpuos_policy_cursor *cur, gpuos_policy_fn fn,
		      void *arg)
{
	struct gpuos_policy *p;
	unsigned long i;
	int err = 0;

	rcu_read_lock();
	for (; cur->bucket < HASH_SIZE(gpuos_policies); cur->bucket++, cur->skip = 0) {
		i = 0;
		hlist_for_each_entry_rcu(p, &gpuos_policies[cur->bucket], node) {
			if (i++ < cur->skip)
				continue;
			err = fn(&p->client, p->policy, arg);
			if (err)
				goto out;
			cur->skip++;
		}
	}
out:
	rcu_read_unlock();
	return err;
}

u64 gpuos_task_cgroup_rcu(struct task_struct *task)
{
#ifdef CONFIG_CGROUPS
	struct cgroup *cg = task ? task_dfl_cgroup(task) : NULL;

	return cg ? cgroup_id(cg) : 0;
#else
	return 0;
#endif
}

u32 gpuos_policy_lookup_rcu(u32 pid_nr, struct pid *spid,
			    struct task_struct *task, u64 *cgroup,
			    enum gpuos_policy_source *src)
{
	struct gpuos_client c = { .kind = GPUOS_CLIENT_PID, .id = pid_nr };
	struct gpuos_policy *p;
#ifdef CONFIG_CGROUPS
	struct cgroup *cg = task ? task_dfl_cgroup(task) : NULL;

	*cgroup = cg ? cgroup_id(cg) : 0;
#else
	*cgroup = 0;
#endif

	if (pid_nr) {
		p = gpuos_policy_find(&c);
		/* A policy set for a process that has since exited is stale. */
		if (p && p->spid == spid) {
			*src = GPUOS_SRC_PID;
			return p->policy;
		}
	}

#ifdef CONFIG_CGROUPS
	/* The nearest cgroup with a policy wins: the task's, then its ancestors'. */
	c.kind = GPUOS_CLIENT_CGROUP;
	for (; cg; cg = cgroup_parent(cg)) {
		c.id = cgroup_id(cg);
		p = gpuos_policy_find(&c);
		if (p) {
			*src = GPUOS_SRC_CGROUP;
			return p->policy;
		}
	}
#endif

	*src = GPUOS_SRC_DEFAULT;
	return GPUOS_FAULT_DEFAULT;
}

int gpuos_policy_init(void)
{
	return 0;
}

void gpuos_policy_exit(void)
{
	struct gpuos_policy *p;
	struct hlist_node *tmp;
	int bkt;

	spin_lock(&gpuos_policy_lock);
	hash_for_each_safe(gpuos_policies, bkt, tmp, p, node) {
		hash_del_rcu(&p->node);
		gpuos_policy_release(p);
	}
	gpuos_policy_count = 0;
	gpuos_ctr_set(GPUOS_CTR_POLICIES, 0);
	spin_unlock(&gpuos_policy_lock);

	/* The callbacks above run module code: wait for them before unload. */
	rcu_barrier();
}
