// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// trace_faults.bpf.c - GPU faults per client and gpuos's decision latency.
//
// Counts, per client process (the pid the driver reported, not the task that
// happens to run the fault handler), the faults gpuos.ko was told about and the
// decisions it answered with; and keeps a log2 histogram of each decision's
// latency_ns (time from the driver's report to gpuos's answer), and which kind
// of policy decided (source: the pid's own, a cgroup's, or none: default).
//
// Attaches only to gpuos.ko's own tracepoints, gpuos:fault and gpuos:decision
// (kmod/trace.h); no kprobes or fentry, which some hosts refuse.  Loaded with
// bcc by userspace/gpuos/kernel/trace.py: `gpuos trace faults`.

struct decision_key {
	u32 pid;
	u32 decision;	/* enum gpuos_decision */
};

BPF_HASH(faults, u32, u64, 10240);			/* pid -> faults */
BPF_HASH(decisions, struct decision_key, u64, 10240);	/* (pid, decision) -> count */
BPF_HISTOGRAM(latency, int, 64);			/* log2(latency_ns) slot -> count */
BPF_HASH(sources, int, u64, 16);			/* decision source -> count */

TRACEPOINT_PROBE(gpuos, fault)
{
	u32 pid = args->pid;

	faults.increment(pid);
	return 0;
}

TRACEPOINT_PROBE(gpuos, decision)
{
	struct decision_key key = {};

	key.pid = args->pid;
	key.decision = args->decision;
	decisions.increment(key);
	sources.increment(args->source);
	latency.increment(bpf_log2l(args->latency_ns));
	return 0;
}
