// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * /dev/gpuos: the high-rate path for batches (GPUOS_IOC_SUBMIT).
 *
 * The node is 0666 so that anyone can ask for the ABI version; submitting
 * needs CAP_SYS_ADMIN, checked per ioctl (not at open: a descriptor passed
 * to an unprivileged process must not carry the privilege with it).
 *
 * struct gpuos_batch and struct gpuos_range have the same layout for 32-bit
 * and 64-bit user space (explicit u64 fields, naturally aligned, no
 * pointers), so compat_ptr_ioctl is all compat needs.
 */
#include <linux/capability.h>
#include <linux/fs.h>
#include <linux/kernel.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/uaccess.h>

#include "batch.h"
#include "chardev.h"
#include "counters.h"

static_assert(sizeof(struct gpuos_range) == 32);
static_assert(sizeof(struct gpuos_batch) == 40);

/* Best effort: the error is what the caller is told in any case. */
static void gpuos_put_statuses(struct gpuos_range __user *uranges,
			       const struct gpuos_kbatch *b)
{
	u32 i;

	for (i = 0; i < b->nr; i++)
		if (put_user(b->ranges[i].status, &uranges[i].status))
			return;
}

static long gpuos_ioc_submit(struct gpuos_batch __user *ubatch)
{
	struct gpuos_range __user *uranges;
	struct gpuos_batch kb;
	struct gpuos_kbatch *b;
	u64 id;
	u32 i;
	int err;

	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	if (copy_from_user(&kb, ubatch, sizeof(kb)))
		return gpuos_reject(-EFAULT);
	if (kb.size != sizeof(kb) || kb.op >= __GPUOS_OP_MAX || kb.flags ||
	    !kb.nr_ranges)
		return gpuos_reject(-EINVAL);
	if (kb.nr_ranges > GPUOS_MAX_RANGES)
		return gpuos_reject(-E2BIG);

	uranges = u64_to_user_ptr(kb.ranges);
	b = gpuos_kbatch_alloc(kb.op, kb.as_id, kb.nr_ranges);
	if (!b)
		return -ENOMEM;
	if (copy_from_user(b->ranges, uranges,
			   array_size(kb.nr_ranges, sizeof(*uranges)))) {
		err = gpuos_reject(-EFAULT);
		goto free;
	}
	err = gpuos_kbatch_validate(b);
	if (err) {
		gpuos_put_statuses(uranges, b);
		goto free;
	}

	err = gpuos_kbatch_submit(b, &id);	/* consumes b */
	if (err)
		return err;

	/*
	 * The batch is with the driver now; if these writes fault the caller
	 * learns it (EFAULT) but the batch still completes, with its event.
	 */
	for (i = 0; i < kb.nr_ranges; i++)
		if (put_user(0, &uranges[i].status))
			return -EFAULT;
	if (put_user(id, &ubatch->batch_id))
		return -EFAULT;
	return 0;

free:
	gpuos_kbatch_free(b);
	return err;
}

static long gpuos_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case GPUOS_IOC_ABI_VERSION:
		return put_user((u32)GPUOS_ABI_VERSION, (u32 __user *)uarg);
	case GPUOS_IOC_SUBMIT:
		return gpuos_ioc_submit(uarg);
	}
	return -ENOTTY;
}

static const struct file_operations gpuos_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = gpuos_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

static struct miscdevice gpuos_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "gpuos",
	.fops = &gpuos_fops,
	.mode = 0666,
};

int gpuos_chardev_init(void)
{
	return misc_register(&gpuos_misc);
}

void gpuos_chardev_exit(void)
{
	misc_deregister(&gpuos_misc);
}
