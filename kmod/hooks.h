/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * The registered driver (include/gpuos_hooks.h is its side of the interface),
 * as the rest of gpuos sees it.
 */
#ifndef _GPUOS_HOOKS_INTERNAL_H
#define _GPUOS_HOOKS_INTERNAL_H

#include <linux/compiler_types.h>
#include <linux/types.h>

#include "include/gpuos_hooks.h"

struct work_struct;

#define GPUOS_DRIVER_NAME_MAX	32	/* bytes, with the NUL */
#define GPUOS_CAPS_ALL		(GPUOS_CAP_FAULT_REPORTS | GPUOS_CAP_MIGRATE | \
				 GPUOS_CAP_HINT | GPUOS_CAP_STOP_CLIENT)

/*
 * Enters an SRCU read section and returns the registered driver's ops, or
 * NULL.  Until gpuos_driver_put(), the ops may be called (from process
 * context) and unregistering waits.  Always pair with gpuos_driver_put().
 */
const struct gpuos_driver_ops *gpuos_driver_get(int *srcu_idx)
	__acquires(gpuos_srcu);
void gpuos_driver_put(int srcu_idx) __releases(gpuos_srcu);

/* Runs @work on gpuos's ordered workqueue (process context). */
void gpuos_queue_work(struct work_struct *work);

int gpuos_hooks_init(void);
void gpuos_hooks_exit(void);

#endif /* _GPUOS_HOOKS_INTERNAL_H */
