/* SPDX-License-Identifier: MIT */
/*
 * t_direct - the shared workload (work.h) with the driver linked directly (-lcuda),
 * as plain CUDA C programs and CuPy do.  Usage: t_direct [SEED]
 */
#define FN(sym) (tally(#sym), sym)
#include "work.h"

int main(int argc, char **argv)
{
	uint64_t seed = seed_from_args(argc, argv);
	char extra[64];
	rng_seed(seed);
	work_init();
	work_main();
	work_semantics();
	work_fini();
	snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64, seed);
	return finish("t_direct", extra);
}
