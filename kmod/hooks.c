// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * The driver registry and the fault path (include/gpuos_hooks.h).
 *
 * One driver at a time.  Its ops pointer is published with RCU and read
 * under SRCU, because calls into ops may sleep (submit, stop_client):
 * unregistering clears the pointer and then waits, with synchronize_srcu(),
 * for every call into ops still running, so the driver may free its ops or
 * unload as soon as gpuos_unregister_driver() returns.
 *
 * gpuos_report_fault() runs in the driver's fault path, possibly atomic: it
 * takes no lock that sleeps and allocates only with GFP_ATOMIC.  Killing a
 * client can sleep (stop_client), so it happens later, from a work item.
 * gpuos_report_fault_batch() runs there too, under the same rules.
 */
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/rcupdate.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/srcu.h>
#include <linux/string.h>
#include <linux/threads.h>
#include <linux/kernel.h>
#include <linux/ktime.h>
#include <linux/workqueue.h>

#include "batch.h"
#include "counters.h"
#include "event.h"
#include "hooks.h"
#include "policy.h"
#include "trace.h"

/*
 * Kill work items not yet run.  A fault storm must not turn into an
 * allocation storm: past this, KILL_CLIENT is answered as ISOLATE (the
 * client is still stopped by the driver, just not killed by us).
 */
#define GPUOS_MAX_KILL_PENDING	256

static const struct gpuos_driver_ops __rcu *gpuos_driver;
static DEFINE_MUTEX(gpuos_driver_mutex);	/* serializes (un)registration */
static struct srcu_struct gpuos_srcu;
/* Ordered: MIGRATION_DONE events leave in the order batches completed. */
static struct workqueue_struct *gpuos_wq;
static atomic_t gpuos_kill_pending = ATOMIC_INIT(0);

struct gpuos_kill_work {
	struct work_struct work;
	struct pid *pid;	/* the faulting process (a reference), or NULL */
	u64 as_id;
	u32 pid_nr;
};

const struct gpuos_driver_ops *gpuos_driver_get(int *srcu_idx)
	__acquires(gpuos_srcu)
{
	*srcu_idx = srcu_read_lock(&gpuos_srcu);
	return srcu_dereference(gpuos_driver, &gpuos_srcu);
}

void gpuos_driver_put(int srcu_idx)
	__releases(gpuos_srcu)
{
	srcu_read_unlock(&gpuos_srcu, srcu_idx);
}

void gpuos_queue_work(struct work_struct *work)
{
	queue_work(gpuos_wq, work);
}

int gpuos_register_driver(const struct gpuos_driver_ops *ops)
{
	size_t len;

	if (!ops || !ops->name)
		return -EINVAL;
	len = strnlen(ops->name, GPUOS_DRIVER_NAME_MAX);
	if (!len || len >= GPUOS_DRIVER_NAME_MAX)
		return -EINVAL;
	/* Claiming an operation without a way to start it is a driver bug. */
	if ((ops->caps & (GPUOS_CAP_MIGRATE | GPUOS_CAP_HINT)) && !ops->submit)
		return -EINVAL;

	mutex_lock(&gpuos_driver_mutex);
	if (rcu_dereference_protected(gpuos_driver,
				      lockdep_is_held(&gpuos_driver_mutex))) {
		mutex_unlock(&gpuos_driver_mutex);
		return -EBUSY;
	}
	rcu_assign_pointer(gpuos_driver, ops);
	pr_info("gpuos: driver %s registered (caps %#x)\n", ops->name,
		ops->caps & GPUOS_CAPS_ALL);
	/* Under the mutex, so that REGISTERED and UNREGISTERED stay in order. */
	gpuos_event_driver(GPUOS_EVENT_DRIVER_REGISTERED, ops->name);
	mutex_unlock(&gpuos_driver_mutex);
	return 0;
}
EXPORT_SYMBOL_GPL(gpuos_register_driver);

void gpuos_unregister_driver(const struct gpuos_driver_ops *ops)
{
	mutex_lock(&gpuos_driver_mutex);
	if (!ops || rcu_dereference_protected(gpuos_driver,
			lockdep_is_held(&gpuos_driver_mutex)) != ops) {
		mutex_unlock(&gpuos_driver_mutex);
		pr_warn("gpuos: unregistering a driver that is not registered\n");
		return;
	}
	RCU_INIT_POINTER(gpuos_driver, NULL);
	/* From here on no call into ops is running or can start. */
	synchronize_srcu(&gpuos_srcu);
	gpuos_batch_abort_all(-ENODEV);
	/* Their MIGRATION_DONE events are out; kill work items are done. */
	flush_workqueue(gpuos_wq);
	pr_info("gpuos: driver %s unregistered\n", ops->name);
	gpuos_event_driver(GPUOS_EVENT_DRIVER_UNREGISTERED, ops->name);
	mutex_unlock(&gpuos_driver_mutex);
}
EXPORT_SYMBOL_GPL(gpuos_unregister_driver);

/* SIGKILL to the process, unless it is init or a kernel thread. */
static void gpuos_kill(struct pid *pid)
{
	struct task_struct *task;
	bool ok;

	rcu_read_lock();
	task = pid_task(pid, PIDTYPE_PID);
	/* A cgroup policy on a wide cgroup must not take the system down. */
	ok = task && !is_global_init(task) && !(task->flags & PF_KTHREAD);
	rcu_read_unlock();
	if (ok)
		kill_pid(pid, SIGKILL, 1);
}

static void gpuos_kill_work_fn(struct work_struct *work)
{
	struct gpuos_kill_work *kw = container_of(work, struct gpuos_kill_work, work);
	const struct gpuos_driver_ops *ops;
	struct pid *pid = kw->pid;
	u64 as_id = kw->as_id;
	u32 pid_nr = kw->pid_nr;
	bool stopped = false;
	int idx, err;

	/* Freed first, so that OBJECTS is exact once the client is stopped. */
	gpuos_kfree(kw);

	ops = gpuos_driver_get(&idx);
	if (ops && (ops->caps & GPUOS_CAP_STOP_CLIENT) && ops->stop_client) {
		err = ops->stop_client(as_id, pid_nr);
		stopped = !err;
		if (err)
			pr_warn_ratelimited("gpuos: %s could not stop client %u (as_id %#llx): %d; sending SIGKILL\n",
					    ops->name, pid_nr, as_id, err);
	}
	gpuos_driver_put(idx);

	/* The decision was to kill: if the driver could not, a signal does. */
	if (!stopped && pid)
		gpuos_kill(pid);

	put_pid(pid);
	atomic_dec(&gpuos_kill_pending);
}

/* Atomic context.  Consumes @pid; false if the kill cannot be scheduled. */
static bool gpuos_kill_schedule(const struct gpuos_fault_report *r,
				struct pid *pid)
{
	struct gpuos_kill_work *kw = NULL;

	if (atomic_inc_return(&gpuos_kill_pending) <= GPUOS_MAX_KILL_PENDING)
		kw = gpuos_kmalloc(sizeof(*kw), GFP_ATOMIC | __GFP_NOWARN);
	if (!kw) {
		atomic_dec(&gpuos_kill_pending);
		put_pid(pid);
		pr_warn_ratelimited("gpuos: cannot schedule the kill of client %u; the driver's default instead\n",
				    r->pid);
		return false;
	}
	INIT_WORK(&kw->work, gpuos_kill_work_fn);
	kw->pid = pid;
	kw->as_id = r->as_id;
	kw->pid_nr = r->pid;
	queue_work(gpuos_wq, &kw->work);
	return true;
}

static bool gpuos_fault_report_valid(const struct gpuos_fault_report *r)
{
	return r && r->access < __GPUOS_ACCESS_MAX &&
	       r->type < __GPUOS_FAULT_TYPE_MAX && r->gpu < GPUOS_MAX_GPUS;
}

u32 gpuos_report_fault(const struct gpuos_fault_report *r)
{
	u64 t0 = ktime_get_ns();
	enum gpuos_policy_source src;
	struct pid *spid, *kpid = NULL;
	struct task_struct *task;
	u32 decision;
	u64 cgroup;

	BUILD_BUG_ON(GPUOS_FAULT_DEFAULT != (int)GPUOS_DECISION_DEFAULT ||
		     GPUOS_FAULT_ISOLATE != (int)GPUOS_DECISION_ISOLATE ||
		     GPUOS_FAULT_KILL_CLIENT != (int)GPUOS_DECISION_KILL_CLIENT);

	/* A report we cannot describe gets no decision from us. */
	if (!gpuos_fault_report_valid(r)) {
		gpuos_reject(0);
		return GPUOS_DECISION_DEFAULT;
	}
	gpuos_ctr_inc(GPUOS_CTR_FAULTS);

	rcu_read_lock();
	spid = r->pid && r->pid <= PID_MAX_LIMIT ?
		find_pid_ns((pid_t)r->pid, &init_pid_ns) : NULL;
	task = spid ? pid_task(spid, PIDTYPE_PID) : NULL;
	decision = gpuos_policy_lookup_rcu(r->pid, spid, task, &cgroup, &src);
	if (decision == GPUOS_DECISION_KILL_CLIENT)
		kpid = get_pid(spid);
	rcu_read_unlock();

	trace_fault(r, cgroup);
	/*
	 * A kill that cannot be scheduled must not leave the client isolated for
	 * good (running on scratch, stopped by nobody): the driver's default,
	 * never worse than a driver without gpuos.
	 */
	if (decision == GPUOS_DECISION_KILL_CLIENT && !gpuos_kill_schedule(r, kpid))
		decision = GPUOS_DECISION_DEFAULT;
	trace_decision(r->pid, cgroup, src, decision, ktime_get_ns() - t0);

	switch (decision) {
	case GPUOS_DECISION_KILL_CLIENT:
		gpuos_ctr_inc(GPUOS_CTR_DECISIONS_KILL);
		break;
	case GPUOS_DECISION_ISOLATE:
		gpuos_ctr_inc(GPUOS_CTR_DECISIONS_ISOLATE);
		break;
	default:
		gpuos_ctr_inc(GPUOS_CTR_DECISIONS_DEFAULT);
		break;
	}

	gpuos_event_fault(GPUOS_EVENT_FAULT, r, cgroup, decision);
	if (decision != GPUOS_DECISION_DEFAULT)
		gpuos_event_fault(GPUOS_EVENT_CLIENT_ISOLATED, r, cgroup, decision);
	return decision;
}
EXPORT_SYMBOL_GPL(gpuos_report_fault);

static bool gpuos_fault_batch_report_valid(const struct gpuos_fault_batch_report *r)
{
	u64 sum = 0;
	u32 i;

	if (!r || r->gpu >= GPUOS_MAX_GPUS ||
	    !r->nr_faults || r->nr_faults > GPUOS_FAULT_BATCH_MAX_FAULTS ||
	    r->nr_instances < r->nr_faults ||
	    r->nr_instances > GPUOS_FAULT_BATCH_MAX_FAULTS ||
	    r->nr_fatal > r->nr_faults || r->nr_throttled > r->nr_faults ||
	    !r->nr_addrs || r->nr_addrs > GPUOS_FAULT_BATCH_ADDRS ||
	    r->nr_addrs > r->nr_faults ||
	    r->addr_min > r->addr_max ||
	    !IS_ALIGNED(r->addr_min, GPUOS_PAGE_SIZE) ||
	    !IS_ALIGNED(r->addr_max, GPUOS_PAGE_SIZE))
		return false;
	for (i = 0; i < ARRAY_SIZE(r->nr_by_access); i++)
		sum += r->nr_by_access[i];
	if (sum != r->nr_faults)
		return false;
	for (i = 0; i < r->nr_addrs; i++) {
		if (r->addrs[i] < r->addr_min || r->addrs[i] > r->addr_max ||
		    !IS_ALIGNED(r->addrs[i], GPUOS_PAGE_SIZE) ||
		    (i && r->addrs[i] <= r->addrs[i - 1]))
			return false;
	}
	return true;
}

void gpuos_report_fault_batch(const struct gpuos_fault_batch_report *r)
{
	struct task_struct *task = NULL;
	u64 cgroup;

	/* A report we cannot describe is dropped, not half-reported. */
	if (!gpuos_fault_batch_report_valid(r)) {
		gpuos_reject(0);
		return;
	}
	gpuos_ctr_inc(GPUOS_CTR_FAULT_BATCHES);

	rcu_read_lock();
	if (r->pid && r->pid <= PID_MAX_LIMIT)
		task = pid_task(find_pid_ns((pid_t)r->pid, &init_pid_ns),
				PIDTYPE_PID);
	cgroup = gpuos_task_cgroup_rcu(task);
	rcu_read_unlock();

	trace_fault_batch(r, cgroup);
	gpuos_event_fault_batch(r, cgroup);
}
EXPORT_SYMBOL_GPL(gpuos_report_fault_batch);

int gpuos_hooks_init(void)
{
	int err;

	err = init_srcu_struct(&gpuos_srcu);
	if (err)
		return err;
	gpuos_wq = alloc_ordered_workqueue("gpuos", 0);
	if (!gpuos_wq) {
		cleanup_srcu_struct(&gpuos_srcu);
		return -ENOMEM;
	}
	return 0;
}

void gpuos_hooks_exit(void)
{
	/*
	 * No driver can be registered here: a driver module uses our symbols,
	 * which pins gpuos until that module is gone, and it unregisters in
	 * its exit at the latest.  Finish what is left: batches (none, unless
	 * a driver broke that rule) and queued work items.
	 */
	if (rcu_access_pointer(gpuos_driver))
		pr_err("gpuos: unloading with a driver still registered\n");
	gpuos_batch_abort_all(-ENODEV);
	destroy_workqueue(gpuos_wq);	/* drains it */
	cleanup_srcu_struct(&gpuos_srcu);
}
