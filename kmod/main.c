// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * gpuos.ko: OS services for NVIDIA GPU processes.  A patched GPU driver
 * reports faults and runs batched migrations through the hooks of
 * include/gpuos_hooks.h; user space sets policies, submits batches and
 * listens to events through uapi/gpuos.h.
 *
 * Init order goes from what depends on nothing to what user space reaches:
 * policies, prefetch ranges, the driver registry (and its workqueue), the netlink family,
 * the device node.  Exit is the reverse, and safe at every step: the device
 * and netlink go first so no request can arrive; events stop before the
 * family goes; the registry drains its workqueue; policies are freed last,
 * after an RCU barrier.  A GPU driver pins this module while it is loaded
 * (it uses our symbols), so none is registered at exit.
 */
#include <linux/module.h>

#include "chardev.h"
#include "hooks.h"
#include "netlink.h"
#include "policy.h"
#include "prefetch.h"
#include "version.h"

static int __init gpuos_init(void)
{
	int err;

	err = gpuos_policy_init();
	if (err)
		return err;
	err = gpuos_prefetch_init();
	if (err)
		goto err_policy;
	err = gpuos_hooks_init();
	if (err)
		goto err_prefetch;
	err = gpuos_netlink_init();
	if (err)
		goto err_hooks;
	err = gpuos_chardev_init();
	if (err)
		goto err_netlink;

	pr_info("gpuos: " GPUOS_MODULE_VERSION " loaded\n");
	return 0;

err_netlink:
	gpuos_netlink_exit();
err_hooks:
	gpuos_hooks_exit();
err_prefetch:
	gpuos_prefetch_exit();
err_policy:
	gpuos_policy_exit();
	return err;
}

static void __exit gpuos_exit(void)
{
	gpuos_chardev_exit();
	gpuos_netlink_exit();
	gpuos_hooks_exit();
	gpuos_prefetch_exit();
	gpuos_policy_exit();
	pr_info("gpuos: unloaded\n");
}

module_init(gpuos_init);
module_exit(gpuos_exit);
MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("gpuos: fault policies, batched migration and events for GPU processes");
MODULE_AUTHOR("gpuos developers");
MODULE_VERSION(GPUOS_MODULE_VERSION);
MODULE_ALIAS_GENL_FAMILY(GPUOS_GENL_NAME);
