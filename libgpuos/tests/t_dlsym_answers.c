/* SPDX-License-Identifier: MIT */
/*
 * t_dlsym_answers - what dlsym answers for each name given, through RTLD_DEFAULT, a
 * handle on libcuda.so.1 and RTLD_NEXT: one line per lookup, "found" or "absent" and
 * whether dlerror() then reports an error. Run with and without libgpuos preloaded, the
 * lines must be the same (libgpuos exports every name of its hook table, but must not
 * answer for one the driver lacks). Usage: t_dlsym_answers NAME...
 */
#include <dlfcn.h>
#include <stdio.h>

static void ask(const char *how, void *handle, const char *name)
{
	dlerror();
	void *p = dlsym(handle, name);
	const char *err = dlerror();
	printf("%s %s %s %s\n", how, name, p ? "found" : "absent", err ? "error" : "no-error");
}

int main(int argc, char **argv)
{
	void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cuda) {
		fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
		return 1;
	}
	for (int i = 1; i < argc; i++) {
		ask("default", RTLD_DEFAULT, argv[i]);
		ask("handle", cuda, argv[i]);
		ask("next", RTLD_NEXT, argv[i]);
	}
	return 0;
}
