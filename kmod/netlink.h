/* SPDX-License-Identifier: GPL-2.0 OR MIT */
#ifndef _GPUOS_NETLINK_H
#define _GPUOS_NETLINK_H

#include <net/genetlink.h>

struct gpuos_client;

extern struct genl_family gpuos_genl_family;

/* Index of "events" in the family's multicast groups. */
#define GPUOS_MCGRP_EVENTS_IDX	0

/* GPUOS_A_POLICY nested { client, GPUOS_A_FAULT_POLICY }. */
int gpuos_nl_put_policy(struct sk_buff *skb, const struct gpuos_client *c,
			u32 policy);
size_t gpuos_nl_policy_size(void);

int gpuos_netlink_init(void);
void gpuos_netlink_exit(void);

#endif /* _GPUOS_NETLINK_H */
