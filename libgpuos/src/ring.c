/* SPDX-License-Identifier: MIT */
/*
 * ring.c - the writer side of the ring and the function table (gpuos_ring.h).
 *
 * Writers never wait: a record claims its slots with one fetch-add on hdr.head; a
 * claim that would cross the end of the ring is turned into padding (the tail before
 * the end and the part after it, both as PAD records) and the record claims again.
 * Payloads first, then the continuation slots' seq words, then the first slot's seq
 * word with release order: a reader that sees the START seq sees the whole record.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"

#define FUNC_CAP_DEFAULT (1u << 17)  /* function table entries (GPUOS_FUNC_TABLE) */
#define FUNC_CAP_MIN 1u
#define FUNC_CAP_MAX (1u << 22)
#define NAMES_BYTES (32ull << 20)    /* function names (the memfd is sparse: untouched pages cost nothing) */
#define DEFAULT_SLOTS (1u << 20)
#define MIN_SLOTS 1024u
#define MAX_SLOTS (1u << 24)

_Static_assert(sizeof(struct gpuos_ring_hdr) <= GPUOS_RING_HDR_SIZE, "ring header too large");
_Static_assert(sizeof(struct gpuos_rec_hdr) <= GPUOS_SLOT_PAYLOAD, "record header must fit a slot");

static struct {
	struct gpuos_ring_hdr *hdr;
	uint8_t *slots;
	uint64_t nslots;
	struct gpuos_func_ent *funcs;
	char *names;
	uint32_t func_cap;
	uint64_t bytes;
	int fd;
} R = { .fd = -1 };


/* Serializes function table entries so that they are published in id order. */
static pthread_mutex_t func_mu = PTHREAD_MUTEX_INITIALIZER;

static uint32_t ring_slots(void)
{
	const char *s = getenv("GPUOS_RING_SLOTS");
	if (!s || !*s)
		return DEFAULT_SLOTS;
	char *end;
	unsigned long long v = strtoull(s, &end, 0);
	if (*end || v < MIN_SLOTS || v > MAX_SLOTS || (v & (v - 1))) {
		gpuos_dbg("GPUOS_RING_SLOTS=%s is not a power of two in [%u, %u]: using %u", s, MIN_SLOTS,
			  MAX_SLOTS, DEFAULT_SLOTS);
		return DEFAULT_SLOTS;
	}
	return (uint32_t)v;
}

/* Entries in the function table: GPUOS_FUNC_TABLE, for programs with very many kernels
 * (and for testing what happens when it is full). */
static uint32_t func_cap(void)
{
	const char *s = getenv("GPUOS_FUNC_TABLE");
	if (!s || !*s)
		return FUNC_CAP_DEFAULT;
	char *end;
	unsigned long long v = strtoull(s, &end, 0);
	if (*end || v < FUNC_CAP_MIN || v > FUNC_CAP_MAX) {
		gpuos_dbg("GPUOS_FUNC_TABLE=%s is not in [%u, %u]: using %u", s, FUNC_CAP_MIN, FUNC_CAP_MAX,
			  FUNC_CAP_DEFAULT);
		return FUNC_CAP_DEFAULT;
	}
	return (uint32_t)v;
}

int gpuos_ring_create(uint32_t flags)
{
	uint32_t nslots = ring_slots();
	uint32_t fcap = func_cap();
	uint64_t strtab_off = GPUOS_RING_HDR_SIZE + (uint64_t)nslots * GPUOS_SLOT_SIZE;
	uint64_t strtab_size = (uint64_t)fcap * sizeof(struct gpuos_func_ent) + NAMES_BYTES;
	uint64_t bytes = strtab_off + strtab_size;
	/* One ring per process: a child after exec makes its own, hence CLOEXEC. */
	int fd = memfd_create(GPUOS_MEMFD_NAME, MFD_CLOEXEC);
	if (fd < 0)
		return errno;
	if (ftruncate(fd, (off_t)bytes) < 0) {
		int e = errno;
		close(fd);
		return e;
	}
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		int e = errno;
		close(fd);
		return e;
	}
	struct gpuos_ring_hdr *h = p;
	struct timespec rt, mono;
	clock_gettime(CLOCK_REALTIME, &rt);
	clock_gettime(CLOCK_MONOTONIC, &mono);
	h->version = GPUOS_RING_VERSION;
	h->hdr_size = GPUOS_RING_HDR_SIZE;
	h->slot_size = GPUOS_SLOT_SIZE;
	h->nslots = nslots;
	h->pid = (uint32_t)getpid();
	h->flags = flags;
	h->state = GPUOS_TRACK_ON;
	h->start_realtime_ns = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
	h->start_mono_ns = (uint64_t)mono.tv_sec * 1000000000ull + (uint64_t)mono.tv_nsec;
	h->strtab_off = strtab_off;
	h->strtab_size = strtab_size;
	h->func_cap = fcap;
	h->lib_version = GPUOS_RING_VERSION;
	__atomic_store_n(&h->magic, GPUOS_RING_MAGIC, __ATOMIC_RELEASE);

	R.slots = (uint8_t *)p + GPUOS_RING_HDR_SIZE;
	R.nslots = nslots;
	R.funcs = (struct gpuos_func_ent *)((char *)p + strtab_off);
	R.names = (char *)(R.funcs + fcap);
	R.func_cap = fcap;
	R.bytes = bytes;
	R.fd = fd;
	if (!(flags & GPUOS_RING_VALIDATE))
		gpuos_hot.pause_word = &h->ops_paused;
	__atomic_store_n(&R.hdr, h, __ATOMIC_RELEASE);
	return 0;
}

int gpuos_ring_fd(void)
{
	return R.fd;
}

uint64_t gpuos_ring_bytes(void)
{
	return R.bytes;
}

struct gpuos_ring_hdr *gpuos_ring_hdr(void)
{
	return __atomic_load_n(&R.hdr, __ATOMIC_ACQUIRE);
}

void gpuos_ring_forget(void)
{
	/* The parent's ring is shared memory: the child must not write into it. */
	gpuos_hot.pause_word = &gpuos_not_paused;
	if (R.hdr)
		munmap(R.hdr, R.bytes);
	if (R.fd >= 0)
		close(R.fd);
	memset(&R, 0, sizeof R);
	R.fd = -1;
	pthread_mutex_init(&func_mu, NULL);
}

/* ---- records ------------------------------------------------------------------------------ */

struct src {
	const uint8_t *a;
	size_t alen;
	const uint8_t *b;
	size_t blen;
};

/* Copy n bytes into the slots' payloads from pos on, over the seq word at the start of
 * each slot (pos never rests on one): 8-byte words while they last (every record but
 * PARAMS is made of them), then the bytes left. */
static uint8_t *put(uint8_t *pos, const uint8_t *src, size_t n)
{
	for (; n >= 8; n -= 8, src += 8) {
		memcpy(pos, src, 8);
		pos += 8;
		if (((uintptr_t)pos & (GPUOS_SLOT_SIZE - 1)) == 0)
			pos += 8;
	}
	while (n) {
		size_t room = GPUOS_SLOT_SIZE - ((uintptr_t)pos & (GPUOS_SLOT_SIZE - 1));
		size_t c = room < n ? room : n;
		memcpy(pos, src, c);
		src += c;
		n -= c;
		pos += c;
		if (((uintptr_t)pos & (GPUOS_SLOT_SIZE - 1)) == 0)
			pos += 8;
	}
	return pos;
}

static void fill(uint64_t abs, uint64_t k, struct src *s)
{
	/* slots are 64-byte aligned (the ring starts page aligned): the offset in a slot
	 * tells how much payload room is left in it */
	uint8_t *base = R.slots + (abs & (R.nslots - 1)) * GPUOS_SLOT_SIZE;
	put(put(base + 8, s->a, s->alen), s->b, s->blen);
	for (uint64_t j = 1; j < k; j++)
		__atomic_store_n((uint64_t *)(base + j * GPUOS_SLOT_SIZE), abs + j + 1, __ATOMIC_RELAXED);
	__atomic_store_n((uint64_t *)base, (abs + 1) | GPUOS_SLOT_START, __ATOMIC_RELEASE);
}

/* k slots of padding: a PAD record whose size spans them (k = ceil(size / 56)). */
static void pad(uint64_t abs, uint64_t k)
{
	struct gpuos_rec_hdr h = {
		.type = GPUOS_REC_PAD,
		.size = (uint32_t)(k * GPUOS_SLOT_PAYLOAD),
		.ts_ns = gpuos_now_ns(),
		.tid = gpuos_tid(),
	};
	struct src s = { (const uint8_t *)&h, sizeof h, NULL, 0 };
	fill(abs, k, &s);
}

/* What the next record writes (its header lines; then, once the head line is in, its
 * slots), requested for writing before the operation's real call, which takes
 * microseconds: the ring is larger than the caches close to the core, and the
 * application evicts its lines between two launches. */
#define PREFETCH_SLOTS 8

void gpuos_ring_prefetch_hdr(void)
{
	struct gpuos_ring_hdr *h = gpuos_ring_hdr();
	if (h) {
		__builtin_prefetch(&h->head, 1, 3);
		__builtin_prefetch(&h->n_launches, 1, 3);
	}
}

void gpuos_ring_prefetch_slots(void)
{
	struct gpuos_ring_hdr *h = gpuos_ring_hdr();
	if (!h)
		return;
	uint64_t abs = __atomic_load_n(&h->head, __ATOMIC_RELAXED);
	for (uint64_t j = 0; j < PREFETCH_SLOTS; j++)
		__builtin_prefetch(R.slots + ((abs + j) & (R.nslots - 1)) * GPUOS_SLOT_SIZE, 1, 3);
}

/* The recording thread writes records of other threads' operations. */
static GPUOS_TLS struct {
	uint64_t ts_ns;
	uint32_t tid;
} as;

void gpuos_ring_as(uint32_t tid, uint64_t ts_ns)
{
	as.tid = tid;
	as.ts_ns = ts_ns;
}

void gpuos_ring_emit(uint16_t type, uint16_t flags, void *rec, size_t rec_len, const void *tail, size_t tail_len)
{
	struct gpuos_ring_hdr *hdr = gpuos_ring_hdr();
	if (!hdr || rec_len < sizeof(struct gpuos_rec_hdr))
		return;
	uint64_t k = (rec_len + tail_len + GPUOS_SLOT_PAYLOAD - 1) / GPUOS_SLOT_PAYLOAD;
	if (k > R.nslots) {
		__atomic_fetch_add(&hdr->lost, 1, __ATOMIC_RELAXED);
		if (type != GPUOS_REC_STATUS) /* the status saying so fits: never recursive */
			gpuos_track_incomplete(GPUOS_INCOMPLETE_RECORD_LOST,
					       "a record of %zu bytes did not fit the ring (%u slots)",
					       rec_len + tail_len, (unsigned)R.nslots);
		return;
	}
	struct gpuos_rec_hdr *h = rec;
	h->type = type;
	h->flags = flags;
	h->size = (uint32_t)(rec_len + tail_len);
	h->ts_ns = as.ts_ns ? as.ts_ns : gpuos_now_ns();
	h->tid = as.tid ? as.tid : gpuos_tid();
	h->reserved = 0;
	struct src s = { rec, rec_len, tail, tail_len };
	for (;;) {
		uint64_t abs = __atomic_fetch_add(&hdr->head, k, __ATOMIC_SEQ_CST);
		uint64_t idx = abs & (R.nslots - 1);
		if (idx + k <= R.nslots) {
			fill(abs, k, &s);
			return;
		}
		uint64_t before_end = R.nslots - idx;
		pad(abs, before_end);
		pad(abs + before_end, k - before_end);
	}
}

void gpuos_ring_count(size_t counter_offset, uint64_t n)
{
	struct gpuos_ring_hdr *hdr = gpuos_ring_hdr();
	if (hdr && counter_offset + sizeof(uint64_t) <= sizeof *hdr)
		__atomic_fetch_add((uint64_t *)((char *)hdr + counter_offset), n, __ATOMIC_RELAXED);
}

/* ---- the function table ------------------------------------------------------------------- */

uint32_t gpuos_func_publish(uint64_t handle, const char *name, uint16_t nparams, uint32_t params_bytes)
{
	struct gpuos_ring_hdr *hdr = gpuos_ring_hdr();
	if (!hdr)
		return GPUOS_NO_FUNC;
	size_t len = name ? strnlen(name, UINT16_MAX) : 0;
	pthread_mutex_lock(&func_mu);
	uint32_t id = hdr->func_count;
	uint64_t used = hdr->names_used;
	if (id >= R.func_cap || used + len + 1 > NAMES_BYTES) {
		pthread_mutex_unlock(&func_mu);
		if (id >= R.func_cap)
			gpuos_track_off(ENOSPC, "function table full (%u entries)", R.func_cap);
		else
			gpuos_track_off(ENOSPC, "function name table full (%llu bytes)", NAMES_BYTES);
		return GPUOS_NO_FUNC;
	}
	memcpy(R.names + used, name ? name : "", len);
	R.names[used + len] = 0;
	struct gpuos_func_ent *e = &R.funcs[id];
	e->handle = handle;
	e->name_off = (uint32_t)used;
	e->name_len = (uint16_t)len;
	e->nparams = nparams;
	e->params_bytes = params_bytes;
	__atomic_store_n(&e->ready, 1, __ATOMIC_RELEASE);
	__atomic_store_n(&hdr->names_used, used + len + 1, __ATOMIC_RELEASE);
	__atomic_store_n(&hdr->func_count, id + 1, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&func_mu);
	return id;
}
