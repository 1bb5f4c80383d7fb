/* SPDX-License-Identifier: MIT */
/*
 * track.c - the allocation interval map and the handle table.
 *
 * Maps are sorted arrays of non-overlapping ranges: lookups (every parameter word of
 * every launch) are a range check and a binary search; changes (allocations, frees)
 * are rare and pay the memmove.  Three maps hold what the VMM API builds: the
 * reservations (address space only, never buffers), the individual cuMemMap ranges
 * (with their handles, for the records), and in the buffer map the coalesced runs of
 * adjacent mappings, because a tensor of an expandable segment may span mappings.
 *
 * The handle table (functions and kernels, modules, libraries, streams, events,
 * graph execs, VMM handles) is open addressing with linear probing and
 * backward-shift deletion, keyed by (kind, handle).  gpuos_lock guards all of it.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

gpuos_alone_rwlock_t gpuos_lock = { .v = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP };

struct gpuos_map gpuos_allocs = { .what = "allocation map" };
struct gpuos_map gpuos_vmm_maps = { .what = "VMM mapping map" };
struct gpuos_map gpuos_reservations = { .what = "VMM reservation map" };
static struct gpuos_map ignored = { .what = "validator's ignore list" };

static struct {
	struct gpuos_obj *v;
	size_t cap, n; /* cap: 0 or a power of two */
} T;

/* ---- maps ------------------------------------------------------------------------------------ */

static int map_reserve(struct gpuos_map *m, size_t more)
{
	if (m->n + more <= m->cap)
		return 0;
	m->gen++;
	size_t cap = m->cap ? m->cap * 2 : 256;
	while (cap < m->n + more)
		cap *= 2;
	struct gpuos_alloc *v = realloc(m->v, cap * sizeof *v);
	if (!v) {
		gpuos_track_off(ENOMEM, "out of memory for the %s (%zu entries)", m->what, m->n);
		return -1;
	}
	m->v = v;
	m->cap = cap;
	return 0;
}

/* The first entry whose end is above lo (touch: at or above lo). */
static size_t first_ending_after(const struct gpuos_map *m, uint64_t lo, int touch)
{
	size_t a = 0, b = m->n;
	while (a < b) {
		size_t mid = (a + b) / 2;
		if (m->v[mid].end > lo || (touch && m->v[mid].end == lo))
			b = mid;
		else
			a = mid + 1;
	}
	return a;
}

/* Entries overlapping [lo, hi) (touch: or adjacent to it). */
static size_t span(const struct gpuos_map *m, uint64_t lo, uint64_t hi, size_t *n, int touch)
{
	size_t i = first_ending_after(m, lo, touch), j = i;
	while (j < m->n && (m->v[j].base < hi || (touch && m->v[j].base == hi)))
		j++;
	*n = j - i;
	return i;
}

size_t gpuos_map_span(const struct gpuos_map *m, uint64_t lo, uint64_t hi, size_t *n)
{
	return span(m, lo, hi, n, 1);
}

static void remove_n(struct gpuos_map *m, size_t i, size_t n)
{
	m->gen++;
	memmove(&m->v[i], &m->v[i + n], (m->n - i - n) * sizeof *m->v);
	m->n -= n;
}

void gpuos_map_remove_at(struct gpuos_map *m, size_t i)
{
	remove_n(m, i, 1);
}

int gpuos_map_insert(struct gpuos_map *m, const struct gpuos_alloc *a)
{
	if (a->end <= a->base)
		return 0;
	m->gen++;
	/* Whatever overlaps is stale (freed by a path we do not see): the new range wins. */
	size_t n, i = span(m, a->base, a->end, &n, 0);
	if (n) {
		gpuos_dbg("%s: [%#llx, %#llx) replaces %zu stale entries", m->what, (unsigned long long)a->base,
			  (unsigned long long)a->end, n);
		remove_n(m, i, n);
	}
	if (map_reserve(m, 1))
		return -1;
	memmove(&m->v[i + 1], &m->v[i], (m->n - i) * sizeof *m->v);
	m->v[i] = *a;
	m->n++;
	return 0;
}

ssize_t gpuos_map_index(const struct gpuos_map *m, uint64_t base)
{
	size_t i = first_ending_after(m, base, 0);
	return i < m->n && m->v[i].base == base ? (ssize_t)i : -1;
}

int gpuos_map_cut(struct gpuos_map *m, uint64_t lo, uint64_t hi, void (*cut)(const struct gpuos_alloc *part))
{
	size_t n, i = span(m, lo, hi, &n, 0);
	m->gen++;
	for (size_t j = i; j < i + n; j++) {
		struct gpuos_alloc *e = &m->v[j], part = *e;
		if (part.base < lo)
			part.base = lo;
		if (part.end > hi)
			part.end = hi;
		cut(&part);
		if (e->base < lo && e->end > hi) { /* a hole in the middle: split */
			struct gpuos_alloc right = *e;
			right.base = hi;
			e->end = lo;
			return gpuos_map_insert(m, &right);
		}
		if (e->base < lo)
			e->end = lo;
		else if (e->end > hi)
			e->base = hi;
		else
			e->end = e->base; /* fully cut: removed below */
	}
	size_t k = i;
	for (size_t j = i; j < i + n; j++)
		if (m->v[j].end > m->v[j].base)
			m->v[k++] = m->v[j];
	remove_n(m, k, i + n - k);
	return 0;
}

static int vmm_joinable(const struct gpuos_alloc *a, const struct gpuos_alloc *b)
{
	return a->kind == GPUOS_ALLOC_VMM_MAP && b->kind == GPUOS_ALLOC_VMM_MAP && a->end == b->base &&
	       a->flags == b->flags && a->ctx == b->ctx && a->device == b->device;
}

void gpuos_vmm_rebuild(uint64_t lo, uint64_t hi)
{
	struct gpuos_map *m = &gpuos_allocs;
	m->gen++;
	/* Drop the runs overlapping [lo, hi), widening it to cover them... */
	size_t n, i = span(m, lo, hi, &n, 0);
	for (size_t j = i + n; j-- > i;) {
		if (m->v[j].kind != GPUOS_ALLOC_VMM_MAP)
			continue;
		if (m->v[j].base < lo)
			lo = m->v[j].base;
		if (m->v[j].end > hi)
			hi = m->v[j].end;
		remove_n(m, j, 1);
	}
	/* ...make them again from the mappings inside... */
	size_t k, first = span(&gpuos_vmm_maps, lo, hi, &k, 0);
	for (size_t j = first; j < first + k;) {
		struct gpuos_alloc run = gpuos_vmm_maps.v[j];
		run.aux = 0;
		for (j++; j < first + k && vmm_joinable(&run, &gpuos_vmm_maps.v[j]); j++)
			run.end = gpuos_vmm_maps.v[j].end;
		if (gpuos_map_insert(m, &run))
			return;
	}
	/* ...and join them with the runs just outside. */
	for (int side = 0; side < 2; side++) {
		uint64_t at = side ? hi : lo;
		size_t c, s = span(m, at, at, &c, 1);
		if (c == 2 && vmm_joinable(&m->v[s], &m->v[s + 1])) {
			m->v[s].end = m->v[s + 1].end;
			remove_n(m, s + 1, 1);
		}
	}
}

void gpuos_write_lock_drained(void)
{
	gpuos_defer_drain_all();
	pthread_rwlock_wrlock(&gpuos_lock.v);
}

/* ---- validator interface ---------------------------------------------------------------------- */

static int overlaps(const struct gpuos_map *m, uint64_t lo, uint64_t hi)
{
	size_t n;
	span(m, lo, hi, &n, 0);
	return n != 0;
}

size_t gpuos_track_snapshot(CUcontext ctx, uint32_t flags, struct gpuos_seg *out, size_t cap)
{
	size_t n = 0;
	pthread_rwlock_rdlock(&gpuos_lock.v);
	for (size_t i = 0; i < gpuos_allocs.n; i++) {
		const struct gpuos_alloc *a = &gpuos_allocs.v[i];
		if ((a->flags & flags) != flags || a->ctx != (uint64_t)(uintptr_t)ctx ||
		    overlaps(&ignored, a->base, a->end))
			continue;
		if (n < cap) {
			out[n].base = a->base;
			out[n].size = a->end - a->base;
		}
		n++;
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	return n;
}

void gpuos_track_ignore(uint64_t base, uint64_t size, int ignore)
{
	pthread_rwlock_wrlock(&gpuos_lock.v);
	if (ignore) {
		struct gpuos_alloc a = { .base = base, .end = base + size };
		gpuos_map_insert(&ignored, &a);
	} else {
		size_t n, i = span(&ignored, base, base + size, &n, 0);
		remove_n(&ignored, i, n);
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
}

/* ---- the handle table ------------------------------------------------------------------------- */

static size_t obj_hash(uint32_t kind, uint64_t handle)
{
	uint64_t x = handle ^ ((uint64_t)kind << 56);
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)x;
}

static size_t obj_slot(uint32_t kind, uint64_t handle)
{
	size_t mask = T.cap - 1, i = obj_hash(kind, handle) & mask;
	while (T.v[i].kind && (T.v[i].kind != kind || T.v[i].handle != handle))
		i = (i + 1) & mask;
	return i;
}

struct gpuos_obj *gpuos_obj_get(uint32_t kind, uint64_t handle)
{
	if (!T.cap)
		return NULL;
	struct gpuos_obj *o = &T.v[obj_slot(kind, handle)];
	return o->kind ? o : NULL;
}

static int obj_grow(void)
{
	size_t cap = T.cap ? T.cap * 2 : 1024;
	struct gpuos_obj *v = calloc(cap, sizeof *v);
	if (!v) {
		gpuos_track_off(ENOMEM, "out of memory for the handle table (%zu entries)", T.n);
		return -1;
	}
	struct gpuos_obj *old = T.v;
	size_t old_cap = T.cap;
	T.v = v;
	T.cap = cap;
	for (size_t i = 0; i < old_cap; i++)
		if (old[i].kind)
			T.v[obj_slot(old[i].kind, old[i].handle)] = old[i];
	free(old);
	return 0;
}

struct gpuos_obj *gpuos_obj_put(uint32_t kind, uint64_t handle)
{
	if ((T.n + 1) * 2 > T.cap && obj_grow())
		return NULL;
	struct gpuos_obj *o = &T.v[obj_slot(kind, handle)];
	if (!o->kind) {
		memset(o, 0, sizeof *o);
		o->kind = kind;
		o->handle = handle;
		T.n++;
	}
	return o;
}

static void obj_remove_slot(size_t i)
{
	size_t mask = T.cap - 1;
	for (size_t j = (i + 1) & mask; T.v[j].kind; j = (j + 1) & mask) {
		size_t home = obj_hash(T.v[j].kind, T.v[j].handle) & mask;
		/* j's entry may move into the hole at i unless its home lies in (i, j] */
		int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
		if (!stays) {
			T.v[i] = T.v[j];
			i = j;
		}
	}
	T.v[i].kind = 0;
	T.n--;
}

int gpuos_obj_del(uint32_t kind, uint64_t handle, struct gpuos_obj *out)
{
	if (!T.cap)
		return 0;
	size_t i = obj_slot(kind, handle);
	if (!T.v[i].kind)
		return 0;
	if (out)
		*out = T.v[i];
	obj_remove_slot(i);
	return 1;
}

void gpuos_obj_sweep(int (*pred)(const struct gpuos_obj *, void *), void (*done)(struct gpuos_obj *), void *arg)
{
	/* Slots before i hold no match, so whatever the backward shift moves there
	 * needs no second look; slot i is looked at again after a removal. */
	for (size_t i = 0; i < T.cap;) {
		if (T.v[i].kind && pred(&T.v[i], arg)) {
			struct gpuos_obj o = T.v[i];
			obj_remove_slot(i);
			if (done)
				done(&o);
		} else {
			i++;
		}
	}
}

void gpuos_track_forget(void)
{
	/* Fork child: the parent's tables may be mid-change; drop them (leaked, not freed). */
	static const pthread_rwlock_t fresh = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
	memcpy(&gpuos_lock.v, &fresh, sizeof fresh);
	struct gpuos_map *maps[] = { &gpuos_allocs, &gpuos_vmm_maps, &gpuos_reservations, &ignored };
	for (size_t i = 0; i < sizeof maps / sizeof maps[0]; i++) {
		maps[i]->v = NULL;
		maps[i]->n = maps[i]->cap = 0;
		maps[i]->gen++;
	}
	memset(&T, 0, sizeof T);
}
