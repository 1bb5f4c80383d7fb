// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * The generic netlink family "gpuos" (uapi/gpuos.h has the protocol).
 *
 * Every command has its own policy, sized for the whole attribute space:
 * an attribute a command does not take is NLA_UNSPEC there, which strict
 * validation rejects; resv_start_op 0 makes every command strict and
 * requires genlmsghdr.reserved to be 0.  The policies check types, lengths
 * and ranges; what they cannot express (one client of two, alignment of
 * ranges, required attributes) is checked here and in batch.c.
 *
 * The family is not parallel_ops: genetlink serializes our doits, which
 * keeps POLICY_SET/POLICY_DELETED events in the order of the changes.
 */
#include <linux/module.h>
#include <net/genetlink.h>
#include <net/netlink.h>
#include <linux/mm.h>

#include "batch.h"
#include "counters.h"
#include "event.h"
#include "hooks.h"
#include "netlink.h"
#include "policy.h"
#include "prefetch.h"
#include "version.h"

/* Commands without attributes: everything is NLA_UNSPEC, so rejected. */
static const struct nla_policy gpuos_nl_none_policy[GPUOS_A_MAX + 1] = {};

static const struct nla_policy gpuos_nl_client_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_CLIENT_PID]	= NLA_POLICY_MIN(NLA_U32, 1),
	[GPUOS_A_CLIENT_CGROUP]	= NLA_POLICY_MIN(NLA_U64, 1),
};

static const struct nla_policy gpuos_nl_set_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_CLIENT_PID]	= NLA_POLICY_MIN(NLA_U32, 1),
	[GPUOS_A_CLIENT_CGROUP]	= NLA_POLICY_MIN(NLA_U64, 1),
	[GPUOS_A_FAULT_POLICY]	= NLA_POLICY_MAX(NLA_U32, __GPUOS_FAULT_POLICY_MAX - 1),
};

static const struct nla_policy gpuos_nl_range_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_RANGE_BASE]	= { .type = NLA_U64 },
	[GPUOS_A_RANGE_LEN]	= NLA_POLICY_MIN(NLA_U64, 1),
	[GPUOS_A_RANGE_DEST]	= NLA_POLICY_MAX(NLA_U32, GPUOS_DEST_GPU(GPUOS_MAX_GPUS - 1)),
	[GPUOS_A_RANGE_PRIO]	= NLA_POLICY_MAX(NLA_U32, GPUOS_MAX_PRIO),
	[GPUOS_A_RANGE_FLAGS]	= NLA_POLICY_MASK(NLA_U32, GPUOS_RANGE_EVICT_FIRST |
						  GPUOS_RANGE_EVICT_LAST),
};

static const struct nla_policy gpuos_nl_ranges_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_RANGE]		= NLA_POLICY_NESTED(gpuos_nl_range_policy),
};

static const struct nla_policy gpuos_nl_migrate_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_AS_ID]		= { .type = NLA_U64 },
	[GPUOS_A_OP]		= NLA_POLICY_MAX(NLA_U32, __GPUOS_OP_MAX - 1),
	[GPUOS_A_RANGES]	= NLA_POLICY_NESTED(gpuos_nl_ranges_policy),
};

/* Prefetch ranges: base and len only. */
static const struct nla_policy gpuos_nl_pf_range_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_RANGE_BASE]	= { .type = NLA_U64 },
	[GPUOS_A_RANGE_LEN]	= NLA_POLICY_MIN(NLA_U64, 1),
};

static const struct nla_policy gpuos_nl_pf_ranges_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_RANGE]		= NLA_POLICY_NESTED(gpuos_nl_pf_range_policy),
};

static const struct nla_policy gpuos_nl_set_prefetch_policy[GPUOS_A_MAX + 1] = {
	[GPUOS_A_AS_ID]		= { .type = NLA_U64 },
	[GPUOS_A_RANGES]	= NLA_POLICY_NESTED(gpuos_nl_pf_ranges_policy),
};

/*
 * Events carry other users' pids, cgroups and fault addresses (CPU virtual
 * addresses under UVM): only CAP_SYS_ADMIN may listen, as only it may change
 * anything.  The netlink core checks it when a socket joins the group.
 */
#ifndef GENL_MCAST_CAP_SYS_ADMIN
#error "gpuos.ko needs GENL_MCAST_CAP_SYS_ADMIN (Linux 6.7, or 6.1.66 / 6.6.5 and later stable kernels)"
#endif
static const struct genl_multicast_group gpuos_nl_mcgrps[] = {
	[GPUOS_MCGRP_EVENTS_IDX] = { .name = GPUOS_MCGRP_EVENTS, .flags = GENL_MCAST_CAP_SYS_ADMIN },
};

/*
 * One rule for every change, through netlink or the ioctl (chardev.c):
 * CAP_SYS_ADMIN in the initial user namespace, of the caller and of whoever
 * opened the socket.  Checked first in each changing command (after the
 * netlink core's stateless validation of the request's form).
 */
static int gpuos_nl_admin(struct sk_buff *skb, struct genl_info *info)
{
	if (netlink_capable(skb, CAP_SYS_ADMIN))
		return 0;
	NL_SET_ERR_MSG(info->extack, "needs CAP_SYS_ADMIN");
	return -EPERM;
}

size_t gpuos_nl_policy_size(void)
{
	return nla_total_size(0) + nla_total_size_64bit(sizeof(u64)) +
	       nla_total_size(sizeof(u32));
}

int gpuos_nl_put_policy(struct sk_buff *skb, const struct gpuos_client *c,
			u32 policy)
{
	struct nlattr *nest;
	int err;

	nest = nla_nest_start(skb, GPUOS_A_POLICY);
	if (!nest)
		return -EMSGSIZE;
	if (c->kind == GPUOS_CLIENT_PID)
		err = nla_put_u32(skb, GPUOS_A_CLIENT_PID, (u32)c->id);
	else
		err = nla_put_u64_64bit(skb, GPUOS_A_CLIENT_CGROUP, c->id,
					GPUOS_A_PAD);
	if (err || nla_put_u32(skb, GPUOS_A_FAULT_POLICY, policy)) {
		nla_nest_cancel(skb, nest);
		return -EMSGSIZE;
	}
	nla_nest_end(skb, nest);
	return 0;
}

/* Exactly one of GPUOS_A_CLIENT_PID and GPUOS_A_CLIENT_CGROUP. */
static int gpuos_nl_client(struct genl_info *info, struct gpuos_client *c)
{
	struct nlattr *pid = info->attrs[GPUOS_A_CLIENT_PID];
	struct nlattr *cg = info->attrs[GPUOS_A_CLIENT_CGROUP];

	if (pid && cg) {
		NL_SET_ERR_MSG_ATTR(info->extack, cg,
				    "give one client: a pid or a cgroup");
		return gpuos_reject(-EINVAL);
	}
	if (pid) {
		c->kind = GPUOS_CLIENT_PID;
		c->id = nla_get_u32(pid);
	} else if (cg) {
		c->kind = GPUOS_CLIENT_CGROUP;
		c->id = nla_get_u64(cg);
	} else {
		NL_SET_ERR_MSG(info->extack, "missing client: a pid or a cgroup");
		return gpuos_reject(-EINVAL);
	}
	if (!c->id)	/* the policy says so too */
		return gpuos_reject(-EINVAL);
	return 0;
}

static int gpuos_nl_get_info(struct sk_buff *skb, struct genl_info *info)
{
	const struct gpuos_driver_ops *ops;
	struct nlattr *ctrs;
	struct sk_buff *msg;
	int idx, i, bad;
	void *hdr;

	msg = genlmsg_new(NLMSG_DEFAULT_SIZE, GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &gpuos_genl_family, 0,
				GPUOS_CMD_GET_INFO);
	if (!hdr ||
	    nla_put_u32(msg, GPUOS_A_GENL_VERSION, GPUOS_GENL_VERSION) ||
	    nla_put_u32(msg, GPUOS_A_ABI_VERSION, GPUOS_ABI_VERSION) ||
	    nla_put_string(msg, GPUOS_A_MODULE_VERSION, GPUOS_MODULE_VERSION))
		goto nospace;

	/* The name is the driver's memory: read it only inside SRCU. */
	ops = gpuos_driver_get(&idx);
	if (ops)
		bad = nla_put_string(msg, GPUOS_A_DRIVER_NAME, ops->name) ||
		      nla_put_u32(msg, GPUOS_A_DRIVER_CAPS,
				  ops->caps & GPUOS_CAPS_ALL);
	else
		bad = nla_put_u32(msg, GPUOS_A_DRIVER_CAPS, 0);
	gpuos_driver_put(idx);
	if (bad)
		goto nospace;

	if (nla_put_u64_64bit(msg, GPUOS_A_EVENT_SEQ, gpuos_event_last_seq(),
			      GPUOS_A_PAD))
		goto nospace;
	ctrs = nla_nest_start(msg, GPUOS_A_COUNTERS);
	if (!ctrs)
		goto nospace;
	for (i = GPUOS_CTR_PAD + 1; i <= GPUOS_CTR_MAX; i++)
		if (nla_put_u64_64bit(msg, i, gpuos_ctr_read(i), GPUOS_CTR_PAD))
			goto nospace;
	nla_nest_end(msg, ctrs);

	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);

nospace:
	nlmsg_free(msg);
	return -EMSGSIZE;
}

static int gpuos_nl_set_policy_doit(struct sk_buff *skb, struct genl_info *info)
{
	struct gpuos_client c;
	u32 policy;
	int err;

	err = gpuos_nl_admin(skb, info);
	if (err)
		return err;
	err = gpuos_nl_client(info, &c);
	if (err)
		return err;
	if (GENL_REQ_ATTR_CHECK(info, GPUOS_A_FAULT_POLICY))
		return gpuos_reject(-EINVAL);
	policy = nla_get_u32(info->attrs[GPUOS_A_FAULT_POLICY]);

	err = gpuos_policy_set(&c, policy);
	if (err == -ENOSPC)
		NL_SET_ERR_MSG(info->extack, "too many policies");
	if (err)
		return err;
	gpuos_event_policy(GPUOS_EVENT_POLICY_SET, &c, policy);
	return 0;
}

static int gpuos_nl_get_policy_doit(struct sk_buff *skb, struct genl_info *info)
{
	struct gpuos_client c;
	struct sk_buff *msg;
	u32 policy;
	void *hdr;
	int err;

	err = gpuos_nl_client(info, &c);
	if (err)
		return err;
	err = gpuos_policy_get(&c, &policy);
	if (err == -ENOENT)
		NL_SET_ERR_MSG(info->extack, "the client has no policy");
	if (err)
		return err;

	msg = genlmsg_new(gpuos_nl_policy_size(), GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &gpuos_genl_family, 0,
				GPUOS_CMD_GET_POLICY);
	if (!hdr || gpuos_nl_put_policy(msg, &c, policy)) {
		nlmsg_free(msg);
		return -EMSGSIZE;
	}
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);
}

static int gpuos_nl_del_policy_doit(struct sk_buff *skb, struct genl_info *info)
{
	struct gpuos_client c;
	u32 old;
	int err;

	err = gpuos_nl_admin(skb, info);
	if (err)
		return err;
	err = gpuos_nl_client(info, &c);
	if (err)
		return err;
	err = gpuos_policy_del(&c, &old);
	if (err == -ENOENT)
		NL_SET_ERR_MSG(info->extack, "the client has no policy");
	if (err)
		return err;
	gpuos_event_policy(GPUOS_EVENT_POLICY_DELETED, &c, old);
	return 0;
}

struct gpuos_nl_dump {
	struct sk_buff *skb;
	struct netlink_callback *cb;
};

/* Under RCU (gpuos_policy_walk): must not sleep. */
static int gpuos_nl_dump_one(const struct gpuos_client *c, u32 policy,
			     void *arg)
{
	struct gpuos_nl_dump *d = arg;
	void *hdr;

	hdr = genlmsg_put(d->skb, NETLINK_CB(d->cb->skb).portid,
			  d->cb->nlh->nlmsg_seq, &gpuos_genl_family,
			  NLM_F_MULTI, GPUOS_CMD_LIST_POLICIES);
	if (!hdr)
		return -EMSGSIZE;
	genl_dump_check_consistent(d->cb, hdr);
	if (gpuos_nl_put_policy(d->skb, c, policy)) {
		genlmsg_cancel(d->skb, hdr);
		return -EMSGSIZE;
	}
	genlmsg_end(d->skb, hdr);
	return 0;
}

/*
 * One skb per call, from the cursor in cb->args (bucket, position in it);
 * the next call goes on where this one stopped, and the call that adds
 * nothing ends the dump.  cb->seq flags a dump that raced with changes.
 */
static int gpuos_nl_list_policies(struct sk_buff *skb,
				  struct netlink_callback *cb)
{
	struct gpuos_policy_cursor cur = {
		.bucket = cb->args[0],
		.skip = cb->args[1],
	};
	struct gpuos_nl_dump d = { .skb = skb, .cb = cb };
	int err;

	cb->seq = gpuos_policy_generation();
	err = gpuos_policy_walk(&cur, gpuos_nl_dump_one, &d);
	cb->args[0] = cur.bucket;
	cb->args[1] = cur.skip;
	if (err && !skb->len)
		return err;	/* one policy larger than a dump skb: cannot happen */
	return skb->len;
}

/* Fills @b from the GPUOS_A_RANGE nests, whose attributes the policy checked. */
static int gpuos_nl_parse_ranges(struct genl_info *info, struct nlattr *ranges,
				 struct gpuos_kbatch *b)
{
	struct nlattr *tb[GPUOS_A_MAX + 1];
	struct nlattr *r;
	u32 i = 0;
	int rem, err;

	nla_for_each_nested(r, ranges, rem) {
		if (i >= b->nr)
			return -EINVAL;
		err = nla_parse_nested(tb, GPUOS_A_MAX, r, gpuos_nl_range_policy,
				       info->extack);
		if (err)
			return err;
		if (NL_REQ_ATTR_CHECK(info->extack, r, tb, GPUOS_A_RANGE_BASE) ||
		    NL_REQ_ATTR_CHECK(info->extack, r, tb, GPUOS_A_RANGE_LEN) ||
		    NL_REQ_ATTR_CHECK(info->extack, r, tb, GPUOS_A_RANGE_DEST) ||
		    NL_REQ_ATTR_CHECK(info->extack, r, tb, GPUOS_A_RANGE_PRIO))
			return -EINVAL;
		b->ranges[i] = (struct gpuos_range) {
			.base = nla_get_u64(tb[GPUOS_A_RANGE_BASE]),
			.len = nla_get_u64(tb[GPUOS_A_RANGE_LEN]),
			.dest = nla_get_u32(tb[GPUOS_A_RANGE_DEST]),
			.prio = nla_get_u32(tb[GPUOS_A_RANGE_PRIO]),
			.flags = tb[GPUOS_A_RANGE_FLAGS] ?
				 nla_get_u32(tb[GPUOS_A_RANGE_FLAGS]) : 0,
		};
		i++;
	}
	return i == b->nr ? 0 : -EINVAL;
}

static int gpuos_nl_migrate(struct sk_buff *skb, struct genl_info *info)
{
	struct nlattr *ranges, *r;
	struct gpuos_kbatch *b;
	struct sk_buff *msg;
	u32 nr = 0, i = 0;
	void *hdr;
	int rem, err;
	u64 id;

	err = gpuos_nl_admin(skb, info);
	if (err)
		return err;
	if (GENL_REQ_ATTR_CHECK(info, GPUOS_A_AS_ID) ||
	    GENL_REQ_ATTR_CHECK(info, GPUOS_A_OP) ||
	    GENL_REQ_ATTR_CHECK(info, GPUOS_A_RANGES))
		return gpuos_reject(-EINVAL);
	ranges = info->attrs[GPUOS_A_RANGES];

	/* The policy let only GPUOS_A_RANGE nests in. */
	nla_for_each_nested(r, ranges, rem)
		nr++;
	if (!nr) {
		NL_SET_ERR_MSG_ATTR(info->extack, ranges, "no ranges");
		return gpuos_reject(-EINVAL);
	}
	if (nr > GPUOS_MAX_NL_RANGES) {
		NL_SET_ERR_MSG_ATTR(info->extack, ranges, "too many ranges");
		return gpuos_reject(-E2BIG);
	}

	b = gpuos_kbatch_alloc(nla_get_u32(info->attrs[GPUOS_A_OP]),
			       nla_get_u64(info->attrs[GPUOS_A_AS_ID]), nr);
	if (!b)
		return -ENOMEM;
	err = gpuos_nl_parse_ranges(info, ranges, b);
	if (err) {
		gpuos_reject(0);
		goto free;
	}
	err = gpuos_kbatch_validate(b);
	if (err) {
		nla_for_each_nested(r, ranges, rem) {
			if (b->ranges[i++].status) {
				NL_SET_ERR_MSG_ATTR(info->extack, r,
						    "invalid range");
				break;
			}
		}
		goto free;
	}

	/* Before submitting: once the driver has the batch, we must reply. */
	msg = genlmsg_new(nla_total_size_64bit(sizeof(u64)), GFP_KERNEL);
	if (!msg) {
		err = -ENOMEM;
		goto free;
	}
	err = gpuos_kbatch_submit(b, &id);	/* consumes b */
	if (err) {
		nlmsg_free(msg);
		return err;
	}
	hdr = genlmsg_put_reply(msg, info, &gpuos_genl_family, 0,
				GPUOS_CMD_MIGRATE);
	if (!hdr || nla_put_u64_64bit(msg, GPUOS_A_BATCH_ID, id, GPUOS_A_PAD)) {
		nlmsg_free(msg);
		return -EMSGSIZE;
	}
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);

free:
	gpuos_kbatch_free(b);
	return err;
}

static int gpuos_nl_set_prefetch(struct sk_buff *skb, struct genl_info *info)
{
	struct nlattr *tb[GPUOS_A_MAX + 1];
	struct gpuos_prefetch_range *r = NULL;
	struct nlattr *ranges, *a;
	u32 nr = 0, i = 0;
	int rem, err;

	err = gpuos_nl_admin(skb, info);
	if (err)
		return err;
	if (GENL_REQ_ATTR_CHECK(info, GPUOS_A_AS_ID))
		return gpuos_reject(-EINVAL);
	ranges = info->attrs[GPUOS_A_RANGES];

	if (ranges) {
		/* The policy let only GPUOS_A_RANGE nests in. */
		nla_for_each_nested(a, ranges, rem)
			nr++;
		if (nr > GPUOS_MAX_NL_RANGES) {
			NL_SET_ERR_MSG_ATTR(info->extack, ranges, "too many ranges");
			return gpuos_reject(-E2BIG);
		}
	}
	if (nr) {
		r = kvmalloc_array(nr, sizeof(*r), GFP_KERNEL);	/* freed below */
		if (!r)
			return -ENOMEM;
		nla_for_each_nested(a, ranges, rem) {
			err = nla_parse_nested(tb, GPUOS_A_MAX, a,
					       gpuos_nl_pf_range_policy,
					       info->extack);
			if (err)
				goto out;
			if (NL_REQ_ATTR_CHECK(info->extack, a, tb, GPUOS_A_RANGE_BASE) ||
			    NL_REQ_ATTR_CHECK(info->extack, a, tb, GPUOS_A_RANGE_LEN)) {
				err = gpuos_reject(-EINVAL);
				goto out;
			}
			r[i].base = nla_get_u64(tb[GPUOS_A_RANGE_BASE]);
			r[i].len = nla_get_u64(tb[GPUOS_A_RANGE_LEN]);
			i++;
		}
	}

	err = gpuos_prefetch_set(nla_get_u64(info->attrs[GPUOS_A_AS_ID]), r, nr);
	if (err == -ENOSPC)
		NL_SET_ERR_MSG(info->extack, "too many address spaces with prefetch ranges");
	else if (err == -EINVAL) {
		NL_SET_ERR_MSG_ATTR(info->extack, ranges,
				    "ranges must be page-aligned, non-empty, not overflowing, disjoint");
		gpuos_reject(0);
	}
out:
	kvfree(r);
	return err;
}

static const struct genl_ops gpuos_nl_ops[] = {
	{
		.cmd = GPUOS_CMD_GET_INFO,
		.doit = gpuos_nl_get_info,
		.policy = gpuos_nl_none_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_SET_POLICY,
		.doit = gpuos_nl_set_policy_doit,
		.policy = gpuos_nl_set_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_GET_POLICY,
		.doit = gpuos_nl_get_policy_doit,
		.policy = gpuos_nl_client_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_DEL_POLICY,
		.doit = gpuos_nl_del_policy_doit,
		.policy = gpuos_nl_client_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_LIST_POLICIES,
		.dumpit = gpuos_nl_list_policies,
		.policy = gpuos_nl_none_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_MIGRATE,
		.doit = gpuos_nl_migrate,
		.policy = gpuos_nl_migrate_policy,
		.maxattr = GPUOS_A_MAX,
	},
	{
		.cmd = GPUOS_CMD_SET_PREFETCH,
		.doit = gpuos_nl_set_prefetch,
		.policy = gpuos_nl_set_prefetch_policy,
		.maxattr = GPUOS_A_MAX,
	},
	/* GPUOS_CMD_EVENT is multicast only: a request gets EOPNOTSUPP. */
};

struct genl_family gpuos_genl_family __ro_after_init = {
	.name = GPUOS_GENL_NAME,
	.version = GPUOS_GENL_VERSION,
	.module = THIS_MODULE,
	.ops = gpuos_nl_ops,
	.n_ops = ARRAY_SIZE(gpuos_nl_ops),
	.resv_start_op = 0,	/* every command strictly validated */
	.mcgrps = gpuos_nl_mcgrps,
	.n_mcgrps = ARRAY_SIZE(gpuos_nl_mcgrps),
};

int gpuos_netlink_init(void)
{
	int err;

	err = genl_register_family(&gpuos_genl_family);
	if (err)
		return err;
	gpuos_events_start();
	return 0;
}

void gpuos_netlink_exit(void)
{
	/* No event may reach the family once it starts going away. */
	gpuos_events_stop();
	genl_unregister_family(&gpuos_genl_family);
}
