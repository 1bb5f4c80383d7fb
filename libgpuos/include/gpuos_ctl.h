/* SPDX-License-Identifier: MIT */
/*
 * gpuos_ctl.h - the control-socket handshake between libgpuos and `gpuos run`.
 *
 * `gpuos run` listens on a unix stream socket in a directory only its user can enter
 * (mode 0700) and passes the path in GPUOS_CTL.  When libgpuos starts tracking in a
 * process (lazily, at the first CUDA driver call it sees), it:
 *   1. creates its ring (memfd "gpuos-ring", see gpuos_ring.h),
 *   2. connects to GPUOS_CTL and checks the server with SO_PEERCRED: same uid or root,
 *      else it turns tracking off ("control socket owned by uid N"),
 *   3. sends one struct gpuos_ctl_hello with the ring's fd attached (SCM_RIGHTS),
 *   4. reads one struct gpuos_ctl_reply; status 0 means accepted.  Anything else, or no
 *      reply within 5 s, turns tracking off with the reason in the ring header.
 * The connection then stays open for the life of the process: `gpuos run` sees EOF
 * when the process exits, and will use it to send commands in later versions.
 * The server checks the client with SO_PEERCRED as well (same uid or root) and that
 * hello.pid matches the credentials' pid.
 */
#ifndef GPUOS_CTL_H
#define GPUOS_CTL_H

#include <stdint.h>

#define GPUOS_CTL_MAGIC 0x4c54434fu /* "OCTL" */
#define GPUOS_CTL_VERSION 1

/* gpuos_ctl_hello.flags */
#define GPUOS_CTL_VALIDATE (1u << 0)

struct gpuos_ctl_hello {
	uint32_t magic;
	uint32_t version;
	uint32_t pid;
	uint32_t ppid;
	uint64_t ring_bytes;  /* size of the memfd */
	uint32_t flags;       /* GPUOS_CTL_* */
	uint32_t state;       /* enum gpuos_track_state at the time of the hello */
	char exe[256];        /* readlink(/proc/self/exe), NUL-terminated, may be cut */
};

struct gpuos_ctl_reply {
	uint32_t magic;
	uint32_t status;      /* 0: accepted; else an errno */
};

#endif /* GPUOS_CTL_H */
