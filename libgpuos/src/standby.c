/* SPDX-License-Identifier: MIT */
/*
 * standby.c - a standby copy of an MPS client waits at its first cuInit, or at its
 * first kernel launch (docs/mps.md).
 *
 * `gpuos mps run --policy standby` starts a second copy of the client's command beside
 * it, with GPUOS_MPS_STANDBY naming a FIFO of the supervisor's.  Where it waits:
 *
 * - cold (GPUOS_MPS_STANDBY_AT unset or "cuinit"): the copy runs its imports and
 *   CPU-side set-up, then its first cuInit waits here, before the driver is touched: it
 *   is no MPS client yet, so a fault that takes the server's clients down does not take
 *   it.  Released once the server takes clients again.
 * - warm (GPUOS_MPS_STANDBY_AT=launch; `gpuos mps start --spare-server`): the copy is a
 *   client of a second MPS server, the spare, and goes on to its first kernel launch
 *   (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch): its
 *   context made, its weights copied in.  A fault on the other server leaves it alone;
 *   it is released at once.  Nothing it launches has run, so it has done no work twice.
 *
 * The wait is open(2) of the FIFO for reading, which blocks until a writer opens it.
 * Release is the supervisor opening it for writing and then removing it: every process
 * of the standby's tree waiting at a cuInit goes on, and a later cuInit anywhere in the
 * tree finds no FIFO and does not wait.  A signal ends the wait only to resume it
 * (SA_RESTART, or EINTR: open again), so a standby cannot slip into the server early;
 * a signal that kills kills.  A FIFO that cannot be opened for another reason is said
 * on stderr, and the process goes on.
 *
 * Just before it waits it writes "waiting <pid>" into FIFO.state, a file the supervisor
 * made for it (never created here): a standby that replaces an older one (from a newer
 * checkpoint) takes its place only once it waits, so there is always one to take over.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"

int gpuos_standby_passed; /* this process has passed the wait once: later calls do not look */

static int waits_at_launch(void)
{
	const char *at = getenv("GPUOS_MPS_STANDBY_AT");
	return at && strcmp(at, "launch") == 0;
}

/* "waiting <pid>" into PATH.state, where the supervisor made that file (O_NOFOLLOW, no
 * O_CREAT: nothing is made here, and a link is not followed). */
static void say_waiting(const char *path)
{
	char state[4096], line[64];
	if (snprintf(state, sizeof state, "%s.state", path) >= (int)sizeof state)
		return;
	int fd = open(state, O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return;
	int n = snprintf(line, sizeof line, "waiting %d\n", (int)getpid());
	if (write(fd, line, (size_t)n) != n)
		gpuos_dbg("standby: cannot write %s: %s", state, strerror(errno));
	close(fd);
}

static void standby_wait(const char *where)
{
	if (__atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE))
		return;
	const char *path = getenv("GPUOS_MPS_STANDBY");
	if (path && *path) {
		gpuos_dbg("standby: waiting at %s for %s", where, path);
		say_waiting(path);
		int fd;
		do
			fd = open(path, O_RDONLY | O_CLOEXEC);
		while (fd < 0 && errno == EINTR);
		if (fd >= 0)
			close(fd);
		else if (errno == ENOENT)
			gpuos_dbg("standby: released");
		else
			fprintf(stderr, "libgpuos: standby: cannot wait on %s (%s): going on\n", path,
				strerror(errno));
	}
	__atomic_store_n(&gpuos_standby_passed, 1, __ATOMIC_RELEASE);
}

static pthread_once_t blaswarm_once = PTHREAD_ONCE_INIT;

void gpuos_standby_launch_slow(void)
{
	if (gpuos_blaswarm_thread)
		return; /* the warm-up's own launches, while the program waits */
	if (!__atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE) && getenv("GPUOS_MPS_STANDBY")) {
		gpuos_preload_standby_waits();
		pthread_once(&blaswarm_once, gpuos_blaswarm_start);
		standby_wait("a kernel launch");
		gpuos_sharemem_released(); /* its own start-up content where its client changed it */
		return;
	}
	standby_wait("a kernel launch");
}

CUresult gpuos_h_init(PFN_cuInit_v2000 real, int pt, unsigned int flags)
{
	(void)pt;
	if (!__atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE) && !waits_at_launch())
		standby_wait("cuInit");
	return real(flags);
}
