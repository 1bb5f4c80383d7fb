/* SPDX-License-Identifier: MIT */
/*
 * selftime.c - the self-time report of a `make selftime` build (selftime.h); empty
 * otherwise.
 */
#ifdef GPUOS_SELFTIME
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "core.h"

__thread __attribute__((tls_model("initial-exec"))) uint64_t *gpuos_st_mine;

/* Every thread's counters, kept after it exits (a diagnostic build: never freed). */
struct counters {
	uint64_t v[GPUOS_ST_COUNT];
	struct counters *next;
};
static struct counters *all;
static pthread_mutex_t all_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t tsc0, ns0, gpuos_st[GPUOS_ST_COUNT];
static uint64_t no_counters[GPUOS_ST_COUNT]; /* out of memory: shared, racy, rare */

uint64_t *gpuos_st_new(void)
{
	struct counters *c = calloc(1, sizeof *c);
	if (!c)
		return no_counters;
	pthread_mutex_lock(&all_mu);
	c->next = all;
	all = c;
	pthread_mutex_unlock(&all_mu);
	return gpuos_st_mine = c->v;
}

static void report(void)
{
	gpuos_defer_drain_all(); /* atexit runs before the library's destructors */
	pthread_mutex_lock(&all_mu);
	for (int i = 0; i < GPUOS_ST_COUNT; i++)
		gpuos_st[i] = no_counters[i];
	for (struct counters *c = all; c; c = c->next)
		for (int i = 0; i < GPUOS_ST_COUNT; i++)
			gpuos_st[i] += c->v[i];
	pthread_mutex_unlock(&all_mu);
	uint64_t n = gpuos_st[GPUOS_ST_LAUNCHES], dns = gpuos_now_ns() - ns0;
	if (!n || !dns)
		return;
	double ghz = (double)(__rdtsc() - tsc0) / (double)dns, per = ghz * (double)n;
	fprintf(stderr,
		"libgpuos selftime: pid %d, %llu launches, %llu queued, TSC %.3f GHz; ns per launch: "
		"before the call %.0f, driver %.0f, after %.0f; scan %.0f, record %.0f; lookups %llu hits, "
		"%llu misses; %.1f words per launch\n",
		(int)getpid(), (unsigned long long)n, (unsigned long long)gpuos_st[GPUOS_ST_QUEUED], ghz,
		gpuos_st[GPUOS_ST_BEGIN] / per, gpuos_st[GPUOS_ST_REAL] / per, gpuos_st[GPUOS_ST_END] / per,
		gpuos_st[GPUOS_ST_SCAN] / per, gpuos_st[GPUOS_ST_RECORD] / per,
		(unsigned long long)gpuos_st[GPUOS_ST_HITS], (unsigned long long)gpuos_st[GPUOS_ST_MISSES],
		(double)gpuos_st[GPUOS_ST_WORDS] / (double)n);
}

__attribute__((constructor)) static void selftime_init(void)
{
	tsc0 = __rdtsc();
	ns0 = gpuos_now_ns();
	atexit(report);
}
#else
typedef int gpuos_selftime_unused; /* ISO C wants something in a translation unit */
#endif
