/* SPDX-License-Identifier: MIT */
/*
 * t_fork - CUDA work, fork, the child does its own CUDA work (cuInit again) and exits,
 * the parent waits and does more (linked with -lcuda).  Under libgpuos the child must
 * get its own ring.  Usage: t_fork [SEED]
 *
 * Two JSON lines: the child's ("role": "child") first, then the parent's
 * ("role": "parent", "child_pid", "child_status").  Each line's counts include what
 * the process inherited (the parent's work before fork).
 */
#include <sys/wait.h>

#define FN(sym) (tally(#sym), sym)
#include "work.h"

int main(int argc, char **argv)
{
	uint64_t seed = seed_from_args(argc, argv);
	char extra[160];
	int status = -1;
	pid_t pid;

	rng_seed(seed);
	work_init();
	work_basic();
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0) {
		perror("fork");
		return 1;
	}
	if (pid == 0) {
		CUcontext c = NULL;
		rng_seed(seed + 1);
		CU(cuInit, 0);
		CU(cuDevicePrimaryCtxRetain, &c, 0);
		CU(cuCtxSetCurrent, c);
		work_library();
		work_stream();
		CU(cuDevicePrimaryCtxRelease_v2, 0);
		snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64 ", \"role\": \"child\", \"parent_pid\": %d",
			 seed, (int)getppid());
		exit(finish("t_fork", extra));
	}
	if (waitpid(pid, &status, 0) != pid)
		perror("waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %#x", status);
	work_host_memory();
	work_vmm();
	work_fini();
	snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64 ", \"role\": \"parent\", \"child_pid\": %d, "
		 "\"child_status\": %d", seed, (int)pid, status);
	return finish("t_fork", extra);
}
