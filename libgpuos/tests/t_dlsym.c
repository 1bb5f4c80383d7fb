/* SPDX-License-Identifier: MIT */
/*
 * t_dlsym - the shared workload (work.h) with libcuda.so.1 opened by dlopen and every
 * entry point found with dlsym, as the CUDA runtime does for cuGetProcAddress.  Not
 * linked with -lcuda.  Usage: t_dlsym [SEED]
 */
#include "common.h"

static void *g_h;

static void *dl(const char *name)
{
	void *p = dlsym(g_h, name);
	if (!p) {
		fprintf(stderr, "dlsym(libcuda.so.1, %s) failed: %s\n", name, dlerror());
		exit(1);
	}
	return p;
}

#define FN(sym) (*({ static void *p_; if (!p_) p_ = dl(#sym); tally(#sym); (__typeof__(&sym))p_; }))
#include "work.h"

int main(int argc, char **argv)
{
	uint64_t seed = seed_from_args(argc, argv);
	char extra[64];
	if (!(g_h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL))) {
		fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
		return 1;
	}
	rng_seed(seed);
	work_init();
	work_main();
	work_semantics();
	work_fini();
	snprintf(extra, sizeof(extra), ", \"seed\": %" PRIu64, seed);
	return finish("t_dlsym", extra);
}
