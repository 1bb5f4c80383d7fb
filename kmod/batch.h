/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * Batches of ranges, shared by GPUOS_CMD_MIGRATE (netlink) and
 * GPUOS_IOC_SUBMIT (ioctl): one validation, one submission path.
 */
#ifndef _GPUOS_BATCH_H
#define _GPUOS_BATCH_H

#include <linux/types.h>
#include <linux/list.h>
#include <linux/workqueue.h>

#include "uapi/gpuos.h"

struct gpuos_kbatch {
	struct hlist_node node;		/* in the pending table while the driver has it */
	struct work_struct done_work;	/* emits MIGRATION_DONE, frees the batch */
	u64 id;
	u64 as_id;
	u32 op;
	u32 nr;
	bool by_driver;			/* completed by the driver, not by unregister */
	struct gpuos_range ranges[];	/* status doubles as the result */
};

/* Process context.  @nr must be 1..GPUOS_MAX_RANGES. */
struct gpuos_kbatch *gpuos_kbatch_alloc(u32 op, u64 as_id, u32 nr);
void gpuos_kbatch_free(struct gpuos_kbatch *b);

/* The one check of a range, as the header specifies it: 0 or -EINVAL. */
int gpuos_range_check(u32 op, const struct gpuos_range *r);

/*
 * Checks every range and sets its status (0 or -EINVAL); returns -EINVAL
 * (counted as rejected) if any is bad.  The caller keeps the batch.
 */
int gpuos_kbatch_validate(struct gpuos_kbatch *b);

/*
 * Hands a batch to the driver.  Always consumes @b.  0 and the batch id, or
 * -EINVAL, -ENODEV, -EOPNOTSUPP, -EAGAIN (too many pending) or the driver's
 * error.
 */
int gpuos_kbatch_submit(struct gpuos_kbatch *b, u64 *id);

/* Completes every pending batch with @err (unregister; after SRCU sync). */
void gpuos_batch_abort_all(int err);

#endif /* _GPUOS_BATCH_H */
