/* SPDX-License-Identifier: MIT */
/*
 * selftime.h - what libgpuos's part of a kernel launch costs inside a running
 * application.  `make selftime` builds $(O)/selftime/libgpuos.so with -DGPUOS_SELFTIME:
 * the launch path then sums TSC cycles around its stages (before the real call, the
 * real call, after it) and, wherever they run, the parameter scan and the ring record
 * (inside "before" and "after" when recorded inline, on the recording thread for
 * launches queued to it), and counts the scan's lookup-cache hits and misses and the
 * queued launches; at exit it prints one line to stderr (selftime.c).
 * Without GPUOS_SELFTIME the macros compile to nothing.  Why this exists: the same code
 * costs several times more between an application's own work, which evicts its cache
 * lines, than in a loop (docs/interception.md).
 */
#ifndef GPUOS_SELFTIME_H
#define GPUOS_SELFTIME_H

#include <stdint.h>

enum gpuos_st {
	GPUOS_ST_LAUNCHES, GPUOS_ST_BEGIN, GPUOS_ST_REAL, GPUOS_ST_END, GPUOS_ST_QUEUED,
	GPUOS_ST_SCAN, GPUOS_ST_RECORD, GPUOS_ST_HITS, GPUOS_ST_MISSES, GPUOS_ST_WORDS,
	GPUOS_ST_COUNT
};

#ifdef GPUOS_SELFTIME
#include <x86intrin.h>
/* Each thread adds to counters of its own (plain adds: an atomic add on a shared line
 * would cost more than some of what it measures); the report sums them. */
extern __thread __attribute__((tls_model("initial-exec"))) uint64_t *gpuos_st_mine;
uint64_t *gpuos_st_new(void);
#define ST_NOW() __rdtsc()
#define ST_ADD(i, n) \
	((__builtin_expect(gpuos_st_mine != 0, 1) ? gpuos_st_mine : gpuos_st_new())[GPUOS_ST_##i] += (n))
#else
#define ST_NOW() 0ull
#define ST_ADD(i, n) ((void)(n))
#endif

#endif
