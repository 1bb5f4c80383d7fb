// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuos_testdrv: a stand-in GPU driver, so that tests can drive every path
 * of gpuos.ko without a GPU.  It registers as "gpuos-testdrv" and is steered
 * through /sys/kernel/debug/gpuos_testdrv/:
 *
 *   register       r/w  "1" registered, "0" not; write 1 or 0 to change it
 *   inject_fault   w    "pid veid as_id addr access type gpu" (numbers, 0x
 *                       for hex) -> gpuos_report_fault(); values are passed
 *                       as given, so malformed reports can be tested too
 *   last_decision  r    the decision for the last injected fault
 *   inject_fault_batch
 *                  w    "pid as_id gpu batch_id faults instances fatal
 *                       throttled skipped read write atomic prefetch
 *                       addr_min addr_max nr_addrs [addr ...]" (at most
 *                       GPUOS_FAULT_BATCH_ADDRS addresses; those not given
 *                       are 0) -> gpuos_report_fault_batch(); nr_addrs is
 *                       passed as given, whatever the number of addresses
 *   mode           r/w  "async" (keep batches pending; default), "sync"
 *                       (complete each at once, status 0), "fail" (submit
 *                       returns -EIO)
 *   pending        r    one line per pending batch: "id as_id op nr_ranges"
 *   complete       w    "id status" (every range) or "id s0 s1 ..." (one per
 *                       range) -> gpuos_batch_done().  An unknown id or a
 *                       count that does not match is passed to gpuos as is
 *                       (it must ignore it) and the batch stays pending.
 *   stopped        r    one line "as_id pid" per stop_client call (the
 *                       last TESTDRV_MAX_STOPPED)
 *   stop_delay_ms  r/w  how long stop_client takes (default 0): kills pile up
 *   plant          w    "uaf", "sleep_in_atomic" or "lock_inversion": commits that
 *                       bug once, so that a test can show a debug kernel's KASAN,
 *                       DEBUG_ATOMIC_SLEEP and lockdep report it
 *   prefetch_lookup
 *                  r/w  write "as_id addr [max]" (max defaults to, and is
 *                       at most, TESTDRV_MAX_PREFETCH) ->
 *                       gpuos_prefetch_lookup(); read: one line "base len"
 *                       (hex) per range the last lookup returned
 *   as_gone        w    "as_id" -> gpuos_address_space_gone()
 *   fault_storm    r/w  write "count interval_us pid veid as_id addr access
 *                       type gpu": an hrtimer reports that fault count times,
 *                       from hard interrupt context as the real driver's
 *                       bottom half is atomic (addr + 4 KiB each time), one
 *                       every interval_us; "0" stops it.  read: "left N
 *                       fired N"
 *
 * Every write is one write(2) from offset 0, bounded, NUL-free, parsed with
 * kstrto*; anything else is -EINVAL.  Module parameters: caps (the caps it
 * registers with; default all), autoregister (default 1).
 */
#include <linux/debugfs.h>
#include <linux/err.h>
#include <linux/fs.h>
#include <linux/delay.h>
#include <linux/hrtimer.h>
#include <linux/kernel.h>
#include <linux/list.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/uaccess.h>

#include "../include/gpuos_hooks.h"

#define TESTDRV_NAME		"gpuos-testdrv"
#define TESTDRV_MAX_STOPPED	4096
#define TESTDRV_MAX_WRITE	256		/* every file but the two below */
#define TESTDRV_MAX_BATCH_WRITE	1024		/* inject_fault_batch */
#define TESTDRV_MAX_COMPLETE	(64 * 1024)	/* "id" + 4096 statuses */

static uint caps = GPUOS_CAP_FAULT_REPORTS | GPUOS_CAP_MIGRATE |
		   GPUOS_CAP_HINT | GPUOS_CAP_STOP_CLIENT;
module_param(caps, uint, 0444);
MODULE_PARM_DESC(caps, "Capabilities to register with (enum gpuos_driver_caps bits; default: all)");

static bool autoregister = true;
module_param(autoregister, bool, 0444);
MODULE_PARM_DESC(autoregister, "Register with gpuos at load (default: 1)");

enum testdrv_mode {
	TESTDRV_ASYNC,
	TESTDRV_SYNC,
	TESTDRV_FAIL,
};

static const char *const testdrv_mode_names[] = {
	[TESTDRV_ASYNC] = "async",
	[TESTDRV_SYNC] = "sync",
	[TESTDRV_FAIL] = "fail",
};

struct testdrv_batch {
	struct list_head node;
	u64 id;
	u64 as_id;
	u32 op;
	u32 nr;
};

struct testdrv_stop {
	struct list_head node;
	u64 as_id;
	u32 pid;
};

/*
 * Registration state.  Never taken by the ops: gpuos_unregister_driver()
 * waits for ops in flight, so an op taking it could deadlock.
 */
static DEFINE_MUTEX(testdrv_reg_lock);
static bool testdrv_registered;

/* The lists; taken by the ops and the debugfs files, never held across gpuos calls. */
static DEFINE_SPINLOCK(testdrv_lock);
static LIST_HEAD(testdrv_pending);
static LIST_HEAD(testdrv_stopped);
static unsigned int testdrv_nstopped;

static enum testdrv_mode testdrv_mode = TESTDRV_ASYNC;
static u32 testdrv_last_decision;
static const s32 testdrv_zero_status[GPUOS_MAX_RANGES];
static struct dentry *testdrv_dir;

static int testdrv_submit(const struct gpuos_batch_req *req)
{
	struct testdrv_batch *tb;

	if (!req || !req->nr_ranges || req->nr_ranges > GPUOS_MAX_RANGES)
		return -EINVAL;

	switch (READ_ONCE(testdrv_mode)) {
	case TESTDRV_FAIL:
		return -EIO;
	case TESTDRV_SYNC:
		/* Completing from inside submit is allowed, and worth testing. */
		gpuos_batch_done(req->id, testdrv_zero_status, req->nr_ranges);
		return 0;
	case TESTDRV_ASYNC:
		break;
	}

	tb = kmalloc(sizeof(*tb), GFP_KERNEL);
	if (!tb)
		return -ENOMEM;
	tb->id = req->id;
	tb->as_id = req->as_id;
	tb->op = req->op;
	tb->nr = req->nr_ranges;
	spin_lock(&testdrv_lock);
	list_add_tail(&tb->node, &testdrv_pending);
	spin_unlock(&testdrv_lock);
	return 0;
}

static u32 testdrv_stop_delay_ms;

static int testdrv_stop_client(u64 as_id, u32 pid)
{
	struct testdrv_stop *st, *old = NULL;
	u32 delay = READ_ONCE(testdrv_stop_delay_ms);

	if (delay)
		msleep(min(delay, 1000u));

	st = kmalloc(sizeof(*st), GFP_KERNEL);
	if (!st)
		return -ENOMEM;
	st->as_id = as_id;
	st->pid = pid;
	spin_lock(&testdrv_lock);
	list_add_tail(&st->node, &testdrv_stopped);
	if (++testdrv_nstopped > TESTDRV_MAX_STOPPED) {
		/* Keep the most recent; a test reads them soon after. */
		old = list_first_entry(&testdrv_stopped, struct testdrv_stop, node);
		list_del(&old->node);
		testdrv_nstopped--;
	}
	spin_unlock(&testdrv_lock);
	kfree(old);
	return 0;
}

static struct gpuos_driver_ops testdrv_ops = {
	.name = TESTDRV_NAME,
	.owner = THIS_MODULE,
	.submit = testdrv_submit,
	.stop_client = testdrv_stop_client,
};

static void testdrv_forget_pending(void)
{
	struct testdrv_batch *tb, *tmp;
	LIST_HEAD(list);

	spin_lock(&testdrv_lock);
	list_splice_init(&testdrv_pending, &list);
	spin_unlock(&testdrv_lock);
	list_for_each_entry_safe(tb, tmp, &list, node)
		kfree(tb);
}

static int testdrv_set_registered(bool on)
{
	int err = 0;

	mutex_lock(&testdrv_reg_lock);
	if (on && !testdrv_registered) {
		err = gpuos_register_driver(&testdrv_ops);
		if (!err)
			testdrv_registered = true;
	} else if (!on && testdrv_registered) {
		/* gpuos completes what was pending with -ENODEV. */
		gpuos_unregister_driver(&testdrv_ops);
		testdrv_registered = false;
		testdrv_forget_pending();
	}
	mutex_unlock(&testdrv_reg_lock);
	return err;
}

/* One bounded write from offset 0, NUL-terminated, with no NUL inside. */
static char *testdrv_get_write(const char __user *ubuf, size_t len,
			       loff_t *ppos, size_t max)
{
	char *buf;

	if (*ppos || !len || len > max)
		return ERR_PTR(-EINVAL);
	buf = kvmalloc(len + 1, GFP_KERNEL);
	if (!buf)
		return ERR_PTR(-ENOMEM);
	if (copy_from_user(buf, ubuf, len)) {
		kvfree(buf);
		return ERR_PTR(-EFAULT);
	}
	if (memchr(buf, '\0', len)) {
		kvfree(buf);
		return ERR_PTR(-EINVAL);
	}
	buf[len] = '\0';
	return buf;
}

static char *testdrv_next_token(char **s)
{
	char *tok;

	do {
		tok = strsep(s, " \t\n");
	} while (tok && !*tok);
	return tok;
}

static int testdrv_next_u32(char **s, u32 *v)
{
	char *tok = testdrv_next_token(s);

	return tok ? kstrtou32(tok, 0, v) : -EINVAL;
}

static int testdrv_next_u64(char **s, u64 *v)
{
	char *tok = testdrv_next_token(s);

	return tok ? kstrtou64(tok, 0, v) : -EINVAL;
}

/* register */

static ssize_t testdrv_register_read(struct file *file, char __user *ubuf,
				     size_t len, loff_t *ppos)
{
	char buf[3];
	int n;

	n = scnprintf(buf, sizeof(buf), "%d\n", READ_ONCE(testdrv_registered));
	return simple_read_from_buffer(ubuf, len, ppos, buf, n);
}

static ssize_t testdrv_register_write(struct file *file,
				      const char __user *ubuf, size_t len,
				      loff_t *ppos)
{
	bool on;
	int err;

	if (*ppos || len > TESTDRV_MAX_WRITE)
		return -EINVAL;
	err = kstrtobool_from_user(ubuf, len, &on);
	if (err)
		return err;
	err = testdrv_set_registered(on);
	return err ?: len;
}

static const struct file_operations testdrv_register_fops = {
	.owner = THIS_MODULE,
	.read = testdrv_register_read,
	.write = testdrv_register_write,
	.llseek = default_llseek,
};

/* inject_fault */

/* "pid veid as_id addr access type gpu" */
static int testdrv_next_report(char **s, struct gpuos_fault_report *r)
{
	return testdrv_next_u32(s, &r->pid) ?:
	       testdrv_next_u32(s, &r->veid) ?:
	       testdrv_next_u64(s, &r->as_id) ?:
	       testdrv_next_u64(s, &r->addr) ?:
	       testdrv_next_u32(s, &r->access) ?:
	       testdrv_next_u32(s, &r->type) ?:
	       testdrv_next_u32(s, &r->gpu);
}

static ssize_t testdrv_inject_write(struct file *file, const char __user *ubuf,
				    size_t len, loff_t *ppos)
{
	struct gpuos_fault_report r = {};
	char *buf, *s;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	err = testdrv_next_report(&s, &r);
	if (!err && testdrv_next_token(&s))
		err = -EINVAL;		/* trailing garbage */
	kvfree(buf);
	if (err)
		return -EINVAL;

	WRITE_ONCE(testdrv_last_decision, gpuos_report_fault(&r));
	return len;
}

static const struct file_operations testdrv_inject_fops = {
	.owner = THIS_MODULE,
	.write = testdrv_inject_write,
	.llseek = default_llseek,
};

/* inject_fault_batch */

static ssize_t testdrv_inject_batch_write(struct file *file,
					  const char __user *ubuf, size_t len,
					  loff_t *ppos)
{
	struct gpuos_fault_batch_report r = {};
	char *buf, *s, *tok;
	u32 i, n = 0;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_BATCH_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	err = testdrv_next_u32(&s, &r.pid) ?:
	      testdrv_next_u64(&s, &r.as_id) ?:
	      testdrv_next_u32(&s, &r.gpu) ?:
	      testdrv_next_u64(&s, &r.batch_id) ?:
	      testdrv_next_u32(&s, &r.nr_faults) ?:
	      testdrv_next_u32(&s, &r.nr_instances) ?:
	      testdrv_next_u32(&s, &r.nr_fatal) ?:
	      testdrv_next_u32(&s, &r.nr_throttled) ?:
	      testdrv_next_u32(&s, &r.nr_skipped);
	for (i = 0; !err && i < ARRAY_SIZE(r.nr_by_access); i++)
		err = testdrv_next_u32(&s, &r.nr_by_access[i]);
	err = err ?:
	      testdrv_next_u64(&s, &r.addr_min) ?:
	      testdrv_next_u64(&s, &r.addr_max) ?:
	      testdrv_next_u32(&s, &r.nr_addrs);
	while (!err && (tok = testdrv_next_token(&s))) {
		if (n >= ARRAY_SIZE(r.addrs))
			err = -EINVAL;	/* more addresses than a report holds */
		else
			err = kstrtou64(tok, 0, &r.addrs[n++]);
	}
	kvfree(buf);
	if (err)
		return -EINVAL;

	gpuos_report_fault_batch(&r);
	return len;
}

static const struct file_operations testdrv_inject_batch_fops = {
	.owner = THIS_MODULE,
	.write = testdrv_inject_batch_write,
	.llseek = default_llseek,
};

/* prefetch_lookup */

#define TESTDRV_MAX_PREFETCH	16

static DEFINE_MUTEX(testdrv_pf_mutex);
static struct gpuos_prefetch_range testdrv_pf[TESTDRV_MAX_PREFETCH];
static u32 testdrv_pf_nr;		/* under testdrv_pf_mutex */

static ssize_t testdrv_pf_write(struct file *file, const char __user *ubuf,
				size_t len, loff_t *ppos)
{
	u32 max = TESTDRV_MAX_PREFETCH;
	char *buf, *s, *tok;
	u64 as_id, addr;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	err = testdrv_next_u64(&s, &as_id) ?:
	      testdrv_next_u64(&s, &addr);
	tok = err ? NULL : testdrv_next_token(&s);	/* optional max */
	if (tok)
		err = kstrtou32(tok, 0, &max);
	if (!err && ((tok && testdrv_next_token(&s)) ||
		     max > TESTDRV_MAX_PREFETCH))
		err = -EINVAL;
	kvfree(buf);
	if (err)
		return -EINVAL;

	mutex_lock(&testdrv_pf_mutex);
	testdrv_pf_nr = gpuos_prefetch_lookup(as_id, addr, testdrv_pf, max);
	mutex_unlock(&testdrv_pf_mutex);
	return len;
}

static int testdrv_pf_show(struct seq_file *m, void *v)
{
	u32 i;

	mutex_lock(&testdrv_pf_mutex);
	for (i = 0; i < testdrv_pf_nr; i++)
		seq_printf(m, "%#llx %#llx\n", testdrv_pf[i].base,
			   testdrv_pf[i].len);
	mutex_unlock(&testdrv_pf_mutex);
	return 0;
}

static int testdrv_pf_open(struct inode *inode, struct file *file)
{
	return single_open(file, testdrv_pf_show, NULL);
}

static const struct file_operations testdrv_pf_fops = {
	.owner = THIS_MODULE,
	.open = testdrv_pf_open,
	.read = seq_read,
	.write = testdrv_pf_write,
	.llseek = seq_lseek,
	.release = single_release,
};

/* fault_storm */

static struct hrtimer testdrv_storm_timer;
static struct gpuos_fault_report testdrv_storm_report;	/* written only while stopped */
static ktime_t testdrv_storm_interval;
static atomic_t testdrv_storm_left = ATOMIC_INIT(0);
static atomic_t testdrv_storm_fired = ATOMIC_INIT(0);
static DEFINE_MUTEX(testdrv_storm_mutex);	/* writers of the file */

static enum hrtimer_restart testdrv_storm_fn(struct hrtimer *t)
{
	struct gpuos_fault_report r = testdrv_storm_report;
	int fired = atomic_read(&testdrv_storm_fired);

	if (atomic_dec_if_positive(&testdrv_storm_left) < 0)
		return HRTIMER_NORESTART;
	r.addr += (u64)fired * 4096;
	gpuos_report_fault(&r);		/* in hard interrupt context */
	atomic_inc(&testdrv_storm_fired);
	if (!atomic_read(&testdrv_storm_left))
		return HRTIMER_NORESTART;
	hrtimer_forward_now(t, testdrv_storm_interval);
	return HRTIMER_RESTART;
}

static ssize_t testdrv_storm_write(struct file *file, const char __user *ubuf,
				   size_t len, loff_t *ppos)
{
	struct gpuos_fault_report r = {};
	u32 count, interval_us = 0;
	char *buf, *s;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	err = testdrv_next_u32(&s, &count);
	if (!err && count)
		err = testdrv_next_u32(&s, &interval_us) ?: testdrv_next_report(&s, &r);
	if (!err && (testdrv_next_token(&s) || (count && !interval_us)))
		err = -EINVAL;
	kvfree(buf);
	if (err)
		return -EINVAL;

	mutex_lock(&testdrv_storm_mutex);
	hrtimer_cancel(&testdrv_storm_timer);	/* a storm running stops first */
	atomic_set(&testdrv_storm_left, count);
	atomic_set(&testdrv_storm_fired, 0);
	if (count) {
		testdrv_storm_report = r;
		testdrv_storm_interval = ns_to_ktime((u64)interval_us * NSEC_PER_USEC);
		hrtimer_start(&testdrv_storm_timer, testdrv_storm_interval, HRTIMER_MODE_REL_HARD);
	}
	mutex_unlock(&testdrv_storm_mutex);
	return len;
}

static ssize_t testdrv_storm_read(struct file *file, char __user *ubuf,
				  size_t len, loff_t *ppos)
{
	char out[48];
	int n = scnprintf(out, sizeof(out), "left %d fired %d\n",
			  atomic_read(&testdrv_storm_left), atomic_read(&testdrv_storm_fired));

	return simple_read_from_buffer(ubuf, len, ppos, out, n);
}

static const struct file_operations testdrv_storm_fops = {
	.owner = THIS_MODULE,
	.read = testdrv_storm_read,
	.write = testdrv_storm_write,
	.llseek = default_llseek,
};

/* plant */

static DEFINE_MUTEX(testdrv_plant_a);
static DEFINE_MUTEX(testdrv_plant_b);
static DEFINE_SPINLOCK(testdrv_plant_lock);

static ssize_t testdrv_plant_write(struct file *file, const char __user *ubuf,
				   size_t len, loff_t *ppos)
{
	char *buf, *s, *what;
	int err = 0;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	what = testdrv_next_token(&s);
	if (!what || testdrv_next_token(&s)) {
		err = -EINVAL;
	} else if (!strcmp(what, "uaf")) {
		volatile char *p = kmalloc(64, GFP_KERNEL);

		if (p) {
			kfree((void *)p);
			(void)p[8];	/* read after free: KASAN */
		}
	} else if (!strcmp(what, "sleep_in_atomic")) {
		spin_lock(&testdrv_plant_lock);
		might_sleep();	/* DEBUG_ATOMIC_SLEEP; nothing sleeps */
		spin_unlock(&testdrv_plant_lock);
	} else if (!strcmp(what, "lock_inversion")) {
		mutex_lock(&testdrv_plant_a);	/* a then b, then b then a: lockdep */
		mutex_lock(&testdrv_plant_b);
		mutex_unlock(&testdrv_plant_b);
		mutex_unlock(&testdrv_plant_a);
		mutex_lock(&testdrv_plant_b);
		mutex_lock(&testdrv_plant_a);
		mutex_unlock(&testdrv_plant_a);
		mutex_unlock(&testdrv_plant_b);
	} else {
		err = -EINVAL;
	}
	kvfree(buf);
	return err ?: len;
}

static const struct file_operations testdrv_plant_fops = {
	.owner = THIS_MODULE,
	.write = testdrv_plant_write,
	.llseek = default_llseek,
};

/* as_gone */

static ssize_t testdrv_as_gone_write(struct file *file, const char __user *ubuf,
				     size_t len, loff_t *ppos)
{
	char *buf, *s;
	u64 as_id;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	s = buf;
	err = testdrv_next_u64(&s, &as_id);
	if (!err && testdrv_next_token(&s))
		err = -EINVAL;
	kvfree(buf);
	if (err)
		return -EINVAL;
	gpuos_address_space_gone(as_id);
	return len;
}

static const struct file_operations testdrv_as_gone_fops = {
	.owner = THIS_MODULE,
	.write = testdrv_as_gone_write,
	.llseek = default_llseek,
};

/* mode */

static ssize_t testdrv_mode_read(struct file *file, char __user *ubuf,
				 size_t len, loff_t *ppos)
{
	char buf[8];
	int n;

	n = scnprintf(buf, sizeof(buf), "%s\n",
		      testdrv_mode_names[READ_ONCE(testdrv_mode)]);
	return simple_read_from_buffer(ubuf, len, ppos, buf, n);
}

static ssize_t testdrv_mode_write(struct file *file, const char __user *ubuf,
				  size_t len, loff_t *ppos)
{
	char *buf;
	int mode;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_WRITE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	mode = sysfs_match_string(testdrv_mode_names, buf);
	kvfree(buf);
	if (mode < 0)
		return -EINVAL;
	WRITE_ONCE(testdrv_mode, mode);
	return len;
}

static const struct file_operations testdrv_mode_fops = {
	.owner = THIS_MODULE,
	.read = testdrv_mode_read,
	.write = testdrv_mode_write,
	.llseek = default_llseek,
};

/* pending */

static int testdrv_pending_show(struct seq_file *m, void *v)
{
	struct testdrv_batch *tb;

	spin_lock(&testdrv_lock);
	list_for_each_entry(tb, &testdrv_pending, node)
		seq_printf(m, "%llu %llu %u %u\n", tb->id, tb->as_id, tb->op,
			   tb->nr);
	spin_unlock(&testdrv_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(testdrv_pending);

/* complete */

static ssize_t testdrv_complete_write(struct file *file,
				      const char __user *ubuf, size_t len,
				      loff_t *ppos)
{
	struct testdrv_batch *tb, *found = NULL;
	u32 n = 0, nr, i;
	s32 *status;
	char *buf, *s, *tok;
	u64 id;
	int err;

	buf = testdrv_get_write(ubuf, len, ppos, TESTDRV_MAX_COMPLETE);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	status = kvmalloc_array(GPUOS_MAX_RANGES, sizeof(*status), GFP_KERNEL);
	if (!status) {
		err = -ENOMEM;
		goto out;
	}

	s = buf;
	err = testdrv_next_u64(&s, &id);
	while (!err && (tok = testdrv_next_token(&s))) {
		if (n >= GPUOS_MAX_RANGES)
			err = -EINVAL;
		else
			err = kstrtos32(tok, 0, &status[n++]);
	}
	if (!err && !n)
		err = -EINVAL;
	if (err) {
		err = -EINVAL;
		goto out;
	}

	spin_lock(&testdrv_lock);
	list_for_each_entry(tb, &testdrv_pending, node) {
		if (tb->id == id && (n == 1 || n == tb->nr)) {
			list_del(&tb->node);
			found = tb;
			break;
		}
	}
	spin_unlock(&testdrv_lock);

	nr = n;
	if (found) {
		nr = found->nr;
		for (i = n; i < nr; i++)
			status[i] = status[0];
		kfree(found);
	}
	gpuos_batch_done(id, status, nr);
	err = len;
out:
	kvfree(status);
	kvfree(buf);
	return err;
}

static const struct file_operations testdrv_complete_fops = {
	.owner = THIS_MODULE,
	.write = testdrv_complete_write,
	.llseek = default_llseek,
};

/* stopped */

static int testdrv_stopped_show(struct seq_file *m, void *v)
{
	struct testdrv_stop *st;

	spin_lock(&testdrv_lock);
	list_for_each_entry(st, &testdrv_stopped, node)
		seq_printf(m, "%llu %u\n", st->as_id, st->pid);
	spin_unlock(&testdrv_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(testdrv_stopped);

static void testdrv_free_stopped(void)
{
	struct testdrv_stop *st, *tmp;
	LIST_HEAD(list);

	spin_lock(&testdrv_lock);
	list_splice_init(&testdrv_stopped, &list);
	testdrv_nstopped = 0;
	spin_unlock(&testdrv_lock);
	list_for_each_entry_safe(st, tmp, &list, node)
		kfree(st);
}

static int __init testdrv_init(void)
{
	int err;

	testdrv_ops.caps = caps;
	hrtimer_init(&testdrv_storm_timer, CLOCK_MONOTONIC, HRTIMER_MODE_REL_HARD);
	testdrv_storm_timer.function = testdrv_storm_fn;

	/* debugfs errors are not checked, by convention: tests will notice. */
	testdrv_dir = debugfs_create_dir("gpuos_testdrv", NULL);
	debugfs_create_file("register", 0600, testdrv_dir, NULL,
			    &testdrv_register_fops);
	debugfs_create_file("inject_fault", 0200, testdrv_dir, NULL,
			    &testdrv_inject_fops);
	debugfs_create_u32("last_decision", 0400, testdrv_dir,
			   &testdrv_last_decision);
	debugfs_create_file("inject_fault_batch", 0200, testdrv_dir, NULL,
			    &testdrv_inject_batch_fops);
	debugfs_create_file("mode", 0600, testdrv_dir, NULL, &testdrv_mode_fops);
	debugfs_create_file("as_gone", 0200, testdrv_dir, NULL, &testdrv_as_gone_fops);
	debugfs_create_file("fault_storm", 0600, testdrv_dir, NULL, &testdrv_storm_fops);
	debugfs_create_u32("stop_delay_ms", 0600, testdrv_dir, &testdrv_stop_delay_ms);
	debugfs_create_file("plant", 0200, testdrv_dir, NULL, &testdrv_plant_fops);
	debugfs_create_file("pending", 0400, testdrv_dir, NULL,
			    &testdrv_pending_fops);
	debugfs_create_file("complete", 0200, testdrv_dir, NULL,
			    &testdrv_complete_fops);
	debugfs_create_file("stopped", 0400, testdrv_dir, NULL,
			    &testdrv_stopped_fops);
	debugfs_create_file("prefetch_lookup", 0600, testdrv_dir, NULL,
			    &testdrv_pf_fops);

	if (autoregister) {
		err = testdrv_set_registered(true);
		if (err) {
			pr_err("gpuos_testdrv: cannot register with gpuos: %d\n", err);
			debugfs_remove_recursive(testdrv_dir);
			return err;
		}
	}
	return 0;
}

static void __exit testdrv_exit(void)
{
	/* Removal waits for debugfs reads and writes in flight. */
	debugfs_remove_recursive(testdrv_dir);
	hrtimer_cancel(&testdrv_storm_timer);	/* a storm may still be reporting */
	testdrv_set_registered(false);
	testdrv_forget_pending();
	testdrv_free_stopped();
}

module_init(testdrv_init);
module_exit(testdrv_exit);
MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("gpuos test driver: a stand-in GPU driver steered through debugfs");
MODULE_AUTHOR("gpuos developers");
MODULE_VERSION("0.1.0");
