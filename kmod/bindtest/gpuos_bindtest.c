// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuos_bindtest: nvidia-uvm's binding to gpuos.ko
 * (patches/nvidia-uvm/uvm_gpuos_bind.c, compiled here unchanged), exercised
 * against the real gpuos.ko without nvidia-uvm: attach at load and through
 * /sys/module/gpuos_bindtest/parameters/uvm_gpuos_attach, every call from
 * hard interrupt context as nvidia-uvm's fault path makes them, detach while
 * they run, batches gpuos submits finished before it unregisters.  It
 * registers as "gpuos-bindtest" with MIGRATE and HINT.  Steered through
 * /sys/kernel/debug/gpuos_bindtest/:
 *
 *   storm      w  "count interval_us pid as_id": an hrtimer makes count
 *                 rounds, one every interval_us, each a fault report, a
 *                 fault batch report and a prefetch lookup for pid/as_id;
 *                 "0" stops it.  r: "left N fired N default N isolate N
 *                 kill N ranges N"
 *   batches    r  "accepted N done N refused N": batches gpuos submitted,
 *                 finished (gpuos_bind_batch_done, status 0 for every range,
 *                 after batch_delay_ms in the work item), refused (not
 *                 accepting)
 *   batch_delay_ms rw  how long a batch takes (default 0)
 *   gone       w  "as_id" -> gpuos_bind_address_space_gone()
 */
#include <linux/atomic.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/hrtimer.h>
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>

#include "uvm_gpuos_bind.h"
#include "uvm_gpuos_bind.c"

static struct dentry *bt_dir;

/* Batches: accepted on an ordered queue, as nvidia-uvm does. */

struct bt_batch {
	struct work_struct work;
	u64 id;
	u32 nr;
	s32 status[];
};

static struct workqueue_struct *bt_wq;
static DEFINE_SPINLOCK(bt_submit_lock);
static bool bt_accepting;		/* under bt_submit_lock */
static atomic_t bt_accepted, bt_done, bt_refused;
static u32 bt_batch_delay_ms;

static void bt_batch_work(struct work_struct *work)
{
	struct bt_batch *b = container_of(work, struct bt_batch, work);

	msleep(READ_ONCE(bt_batch_delay_ms));	/* the migration */
	gpuos_bind_batch_done(b->id, b->status, b->nr);
	atomic_inc(&bt_done);
	kfree(b);
}

static int bt_submit(const struct gpuos_batch_req *req)
{
	struct bt_batch *b = kzalloc(struct_size(b, status, req->nr_ranges), GFP_KERNEL);
	int ret = 0;

	if (!b)
		return -ENOMEM;
	INIT_WORK(&b->work, bt_batch_work);
	b->id = req->id;
	b->nr = req->nr_ranges;
	spin_lock(&bt_submit_lock);
	if (bt_accepting) {
		queue_work(bt_wq, &b->work);
		atomic_inc(&bt_accepted);
	} else {
		ret = -ENODEV;
	}
	spin_unlock(&bt_submit_lock);
	if (ret) {
		atomic_inc(&bt_refused);
		kfree(b);
	}
	return ret;
}

static void bt_set_accepting(bool on)
{
	spin_lock(&bt_submit_lock);
	bt_accepting = on;
	spin_unlock(&bt_submit_lock);
}

static void bt_drain(void)
{
	flush_workqueue(bt_wq);
}

static struct gpuos_driver_ops bt_ops = {
	.name = "gpuos-bindtest",
	.owner = THIS_MODULE,
	.caps = GPUOS_CAP_MIGRATE | GPUOS_CAP_HINT,
	.submit = bt_submit,
};

static const struct gpuos_bind_driver bt_driver = {
	.ops = &bt_ops,
	.accepting = bt_set_accepting,
	.drain = bt_drain,
};

/* The storm: nvidia-uvm's three fault-path calls, from hard interrupt context. */

static struct hrtimer bt_timer;
static ktime_t bt_interval;
static u32 bt_pid;
static u64 bt_as_id;
static atomic_t bt_left, bt_fired, bt_ranges;
#define BT_DECISIONS (GPUOS_DECISION_KILL_CLIENT + 1)
static atomic_t bt_decisions[BT_DECISIONS];
static DEFINE_MUTEX(bt_storm_mutex);

static enum hrtimer_restart bt_storm_fn(struct hrtimer *t)
{
	struct gpuos_prefetch_range r[4];
	struct gpuos_fault_report f = {
		.pid = bt_pid, .veid = 1, .as_id = bt_as_id, .access = GPUOS_ACCESS_WRITE,
		.type = GPUOS_FAULT_TYPE_INVALID_PTE, .gpu = 0,
	};
	struct gpuos_fault_batch_report b = {
		.as_id = bt_as_id, .pid = bt_pid, .gpu = 0, .nr_faults = 1, .nr_instances = 1,
		.nr_addrs = 1,
	};
	int fired = atomic_read(&bt_fired);
	u32 d;

	if (atomic_dec_if_positive(&bt_left) < 0)
		return HRTIMER_NORESTART;
	f.addr = 0x100000 + (u64)fired * 4096;
	d = gpuos_bind_report_fault(&f);
	if (d < BT_DECISIONS)
		atomic_inc(&bt_decisions[d]);
	b.batch_id = fired;
	b.nr_by_access[GPUOS_ACCESS_WRITE] = 1;
	b.addr_min = b.addr_max = b.addrs[0] = f.addr;
	gpuos_bind_report_fault_batch(&b);
	atomic_add(gpuos_bind_prefetch_lookup(bt_as_id, f.addr, r, ARRAY_SIZE(r)), &bt_ranges);
	atomic_inc(&bt_fired);
	if (!atomic_read(&bt_left))
		return HRTIMER_NORESTART;
	hrtimer_forward_now(t, bt_interval);
	return HRTIMER_RESTART;
}

static ssize_t bt_storm_write(struct file *file, const char __user *ubuf, size_t len, loff_t *ppos)
{
	u32 count = 0, interval_us = 0, pid = 0;
	u64 as_id = 0;
	char buf[96];
	int n, i;

	if (*ppos || len >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, len))
		return -EFAULT;
	buf[len] = 0;
	n = sscanf(buf, "%u %u %u %llu", &count, &interval_us, &pid, &as_id);
	if (n != 1 && n != 4)
		return -EINVAL;
	if (count && !interval_us)
		return -EINVAL;
	mutex_lock(&bt_storm_mutex);
	hrtimer_cancel(&bt_timer);
	atomic_set(&bt_left, 0);
	if (count) {
		bt_pid = pid;
		bt_as_id = as_id;
		bt_interval = ns_to_ktime((u64)interval_us * 1000);
		atomic_set(&bt_fired, 0);
		atomic_set(&bt_ranges, 0);
		for (i = 0; i < BT_DECISIONS; i++)
			atomic_set(&bt_decisions[i], 0);
		atomic_set(&bt_left, count);
		hrtimer_start(&bt_timer, bt_interval, HRTIMER_MODE_REL_HARD);
	}
	mutex_unlock(&bt_storm_mutex);
	return len;
}

static int bt_storm_show(struct seq_file *m, void *v)
{
	seq_printf(m, "left %d fired %d default %d isolate %d kill %d ranges %d\n",
		   atomic_read(&bt_left), atomic_read(&bt_fired),
		   atomic_read(&bt_decisions[GPUOS_DECISION_DEFAULT]),
		   atomic_read(&bt_decisions[GPUOS_DECISION_ISOLATE]),
		   atomic_read(&bt_decisions[GPUOS_DECISION_KILL_CLIENT]),
		   atomic_read(&bt_ranges));
	return 0;
}

static int bt_storm_open(struct inode *inode, struct file *file)
{
	return single_open(file, bt_storm_show, NULL);
}

static const struct file_operations bt_storm_fops = {
	.owner = THIS_MODULE,
	.open = bt_storm_open,
	.read = seq_read,
	.write = bt_storm_write,
	.llseek = seq_lseek,
	.release = single_release,
};

static int bt_batches_show(struct seq_file *m, void *v)
{
	seq_printf(m, "accepted %d done %d refused %d\n", atomic_read(&bt_accepted),
		   atomic_read(&bt_done), atomic_read(&bt_refused));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(bt_batches);

static ssize_t bt_gone_write(struct file *file, const char __user *ubuf, size_t len, loff_t *ppos)
{
	u64 as_id;
	int err = kstrtou64_from_user(ubuf, len, 0, &as_id);

	if (err)
		return err;
	gpuos_bind_address_space_gone(as_id);
	return len;
}

static const struct file_operations bt_gone_fops = {
	.owner = THIS_MODULE,
	.write = bt_gone_write,
};

static int __init bt_init(void)
{
	bt_wq = alloc_ordered_workqueue("gpuos-bindtest", 0);
	if (!bt_wq)
		return -ENOMEM;
	hrtimer_init(&bt_timer, CLOCK_MONOTONIC, HRTIMER_MODE_REL_HARD);
	bt_timer.function = bt_storm_fn;
	bt_dir = debugfs_create_dir("gpuos_bindtest", NULL);
	debugfs_create_file("storm", 0600, bt_dir, NULL, &bt_storm_fops);
	debugfs_create_file("batches", 0400, bt_dir, NULL, &bt_batches_fops);
	debugfs_create_u32("batch_delay_ms", 0600, bt_dir, &bt_batch_delay_ms);
	debugfs_create_file("gone", 0200, bt_dir, NULL, &bt_gone_fops);
	gpuos_bind_init(&bt_driver);	/* as nvidia-uvm's module init */
	return 0;
}

static void __exit bt_exit(void)
{
	debugfs_remove_recursive(bt_dir);	/* no writer can restart the timer */
	hrtimer_cancel(&bt_timer);
	gpuos_bind_exit();			/* as nvidia-uvm's module exit */
	destroy_workqueue(bt_wq);
}

module_init(bt_init);
module_exit(bt_exit);
MODULE_DESCRIPTION("gpuos: nvidia-uvm's binding to gpuos.ko, tested without nvidia-uvm");
MODULE_LICENSE("Dual MIT/GPL");
