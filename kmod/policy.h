/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * Per-client fault policies: a client is a process (pid in the initial pid
 * namespace) or a cgroup v2 (its id).
 */
#ifndef _GPUOS_POLICY_H
#define _GPUOS_POLICY_H

#include <linux/types.h>

struct pid;
struct task_struct;

enum gpuos_client_kind {
	GPUOS_CLIENT_PID = 1,
	GPUOS_CLIENT_CGROUP = 2,
};

struct gpuos_client {
	enum gpuos_client_kind kind;
	u64 id;			/* pid (> 0, fits u32) or cgroup id (> 0) */
};

/* Where a fault's decision came from (the `decision` tracepoint). */
enum gpuos_policy_source {
	GPUOS_SRC_DEFAULT = 0,
	GPUOS_SRC_PID = 1,
	GPUOS_SRC_CGROUP = 2,
};

/* Process context; each returns 0 or -errno as the protocol says. */
int gpuos_policy_set(const struct gpuos_client *c, u32 policy);
int gpuos_policy_get(const struct gpuos_client *c, u32 *policy);
int gpuos_policy_del(const struct gpuos_client *c, u32 *old_policy);

/*
 * A dump cursor that survives between dumpit calls.  Policies changed during a
 * dump may be missed or repeated; gpuos_policy_generation() tells a dump that
 * this happened (NLM_F_DUMP_INTR).
 */
struct gpuos_policy_cursor {
	unsigned long bucket;
	unsigned long skip;
};

typedef int (*gpuos_policy_fn)(const struct gpuos_client *c, u32 policy,
			       void *arg);
int gpuos_policy_walk(struct gpuos_policy_cursor *cur, gpuos_policy_fn fn,
		      void *arg);
unsigned int gpuos_policy_generation(void);

/*
 * The policy for a fault of process @pid_nr.  Caller holds rcu_read_lock();
 * @spid and @task are what @pid_nr resolves to now (either may be NULL).
 * Never sleeps; safe in atomic context.  *cgroup is the task's own cgroup v2
 * id, 0 if there is no task.
 */
u32 gpuos_policy_lookup_rcu(u32 pid_nr, struct pid *spid,
			    struct task_struct *task, u64 *cgroup,
			    enum gpuos_policy_source *src);

/* The task's own cgroup v2 id; 0 without a task.  Caller holds rcu_read_lock(). */
u64 gpuos_task_cgroup_rcu(struct task_struct *task);

int gpuos_policy_init(void);
void gpuos_policy_exit(void);

#endif /* _GPUOS_POLICY_H */
