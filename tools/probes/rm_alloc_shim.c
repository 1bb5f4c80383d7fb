/* SPDX-License-Identifier: MIT */
/*
 * rm_alloc_shim.c - LD_PRELOAD: log the driver's RM object allocations (rm_alloc_probe.py).
 *
 * Each ioctl on an NVIDIA device whose number is NV_ESC_RM_ALLOC_MEMORY (0x27) or
 * NV_ESC_RM_ALLOC (0x2b) is written to stderr as "rm ESC CLASS THREAD SECONDS" with the
 * call's duration, in the order it happened beside the workload's own markers: which of a
 * program's operations has the driver allocate, and what (its class).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int ioctl(int fd, unsigned long req, ...)
{
	static int (*real)(int, unsigned long, void *);
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	if (!real)
		real = (int (*)(int, unsigned long, void *))dlsym(RTLD_NEXT, "ioctl");
	unsigned nr = req & 0xff, type = (req >> 8) & 0xff;
	if (type != 'F' || (nr != 0x27 && nr != 0x2b) || !arg)
		return real(fd, req, arg);
	uint32_t cls;
	memcpy(&cls, (char *)arg + 12, 4); /* hClass: NVOS02 and NVOS21 alike */
	double t0 = now();
	int r = real(fd, req, arg);
	char line[160];
	int n = snprintf(line, sizeof line, "rm %#x class %#x tid %ld took %.6f\n", nr, cls,
			 (long)syscall(SYS_gettid), now() - t0);
	if (n > 0)
		(void)!write(2, line, (size_t)n);
	return r;
}
