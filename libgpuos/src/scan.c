/* SPDX-License-Identifier: MIT */
/*
 * scan.c - function entries (parameter layout, name) and the speculative scan.
 *
 * A function's layout comes from cuFuncGetParamInfo, or cuKernelGetParamInfo for a
 * CUkernel (the CUDA runtime launches CUkernel handles as if they were CUfunctions),
 * asked once per handle and cached in the handle table with its function table id,
 * "unknown" included.  The scan looks every 8-byte-aligned word of every parameter up
 * in the allocation map (through a per-thread cache of recent hits); hits become buffers
 * (one per allocation, the first place it was seen), the other words into a hash of
 * the launch's scalars (hash_term).  The per-launch path allocates nothing: each thread has
 * its scratch (buffers, the cache, a dedupe set).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define DEDUPE_BITS 12 /* 4096 slots: at most GPUOS_MAX_BUFS used, so probes stay short */
#define DEDUPE_LINEAR 8 /* up to this many buffers a launch's list is searched instead */
#define LOOKUP_SET_BITS 7 /* the per-thread lookup cache: 128 sets of 2 entries */
#define LOOKUP_GRAIN 16 /* keyed by the address's 64 KiB block */
#define MAX_PARAM_BUFFER 65536 /* `extra` buffers above this are not scanned */

_Static_assert((1u << DEDUPE_BITS) >= 2 * GPUOS_MAX_BUFS, "dedupe set too small");

/* A launch's pointers mostly point where the last launches' did: each thread keeps the
 * allocations it found last, by address block, valid while the map's gen is unchanged.
 * Two ways per set: where a launch's buffers' blocks share a set (addresses are random),
 * one way would make both miss at every launch. */
struct lookup_ent {
	uint64_t base, size, gen;
	uint32_t idx;    /* in the map */
	uint16_t flags;  /* GPUOS_BUF_* of the allocation */
	uint16_t pad;
};

struct scratch {
	struct gpuos_scan s;
	uint64_t lo, hi;    /* the map's span: words outside it are no pointers */
	uint64_t span_gen;  /* the map's gen when lo and hi were read (0: never) */
	uint64_t sum;       /* the launch's hash so far (scan_bytes) */
	uint32_t nwords;    /* words scanned so far (their index in the hash) */
	uint32_t gen;
	uint32_t small_idx[DEDUPE_LINEAR]; /* allocation indices of bufs[0..DEDUPE_LINEAR) */
	_Alignas(64) struct lookup_ent lookup[1u << LOOKUP_SET_BITS][2]; /* a set: one cache line */
	struct {
		uint32_t gen, idx;
	} seen[1u << DEDUPE_BITS];
	struct gpuos_rec_buf bufs[GPUOS_MAX_BUFS];
};

static GPUOS_TLS struct scratch *tls_scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t create_mu = PTHREAD_MUTEX_INITIALIZER;
/* Kernel-name substrings from a comma-separated environment variable. */
struct patterns {
	char **v;
	size_t n;
};

static struct patterns touch_pats; /* GPUOS_TOUCH_ALL */
static struct patterns dump_pats;  /* GPUOS_DUMP_PARAMS */

/* ---- configuration -------------------------------------------------------------------------- */

static void patterns_read(struct patterns *ps, const char *var)
{
	for (size_t i = 0; i < ps->n; i++)
		free(ps->v[i]);
	free(ps->v);
	ps->v = NULL;
	ps->n = 0;
	const char *env = getenv(var);
	if (!env || !*env)
		return;
	size_t cap = 1;
	for (const char *c = env; *c; c++)
		cap += *c == ',';
	ps->v = calloc(cap, sizeof *ps->v);
	if (!ps->v)
		return;
	for (const char *p = env; *p;) {
		size_t len = strcspn(p, ",");
		if (len && (ps->v[ps->n] = strndup(p, len)))
			ps->n++;
		p += len + (p[len] == ',');
	}
}

void gpuos_scan_config(void)
{
	patterns_read(&touch_pats, "GPUOS_TOUCH_ALL");
	patterns_read(&dump_pats, "GPUOS_DUMP_PARAMS");
}

static int patterns_match(const struct patterns *ps, const char *name)
{
	for (size_t i = 0; name && i < ps->n; i++)
		if (strstr(name, ps->v[i]))
			return 1;
	return 0;
}

/* ---- function entries ------------------------------------------------------------------------- */

struct layout {
	struct {
		uint32_t off, size;
	} *p;
	size_t n, cap;
};

/* Ask the driver for the layout of h as a function or as a kernel.  1: known (lay->n
 * parameters), 0: unavailable. */
static int query_layout(uint64_t h, int kernel, struct layout *lay)
{
	lay->n = 0;
	if (kernel ? !gpuos_drv.kernel_get_param_info : !gpuos_drv.func_get_param_info)
		return 0;
	for (size_t i = 0;; i++) {
		size_t off = 0, size = 0;
		CUresult r = kernel ? gpuos_drv.kernel_get_param_info((CUkernel)(uintptr_t)h, i, &off, &size)
				    : gpuos_drv.func_get_param_info((CUfunction)(uintptr_t)h, i, &off, &size);
		if (r != CUDA_SUCCESS) /* past the last parameter: CUDA_ERROR_INVALID_VALUE */
			return i > 0 || r == CUDA_ERROR_INVALID_VALUE;
		if (i >= GPUOS_LAYOUT_UNKNOWN - 1 || off > UINT32_MAX || size > UINT32_MAX)
			return 0;
		if (lay->n == lay->cap) {
			size_t cap = lay->cap ? lay->cap * 2 : 16;
			void *p = realloc(lay->p, cap * sizeof lay->p[0]);
			if (!p)
				return 0;
			lay->p = p;
			lay->cap = cap;
		}
		lay->p[lay->n].off = (uint32_t)off;
		lay->p[lay->n++].size = (uint32_t)size;
	}
}

/* A new entry for h (driver calls; no lock held).  NULL when out of memory. */
static struct gpuos_fn *fn_make(uint64_t h, enum gpuos_fn_hint hint)
{
	struct layout lay = { 0 };
	int kernel = hint == GPUOS_HINT_KERNEL;
	int known = query_layout(h, kernel, &lay);
	if (hint == GPUOS_HINT_UNKNOWN && (!known || !lay.n)) {
		/* Not a CUfunction, or one without parameters: is it a CUkernel? */
		struct layout k = { 0 };
		if (query_layout(h, 1, &k) && (!known || k.n)) {
			free(lay.p);
			lay = k;
			known = kernel = 1;
		} else {
			free(k.p);
		}
	}
	const char *name = NULL;
	if (kernel ? gpuos_drv.kernel_get_name != NULL : gpuos_drv.func_get_name != NULL) {
		CUresult r = kernel ? gpuos_drv.kernel_get_name(&name, (CUkernel)(uintptr_t)h)
				    : gpuos_drv.func_get_name(&name, (CUfunction)(uintptr_t)h);
		if (r != CUDA_SUCCESS)
			name = NULL;
	}
	size_t n = known ? lay.n : 0;
	struct gpuos_fn *fn = malloc(sizeof *fn + n * sizeof fn->p[0]);
	if (!fn) {
		free(lay.p);
		gpuos_track_off(ENOMEM, "out of memory for a function entry");
		return NULL;
	}
	fn->nparams = known ? (uint16_t)n : GPUOS_LAYOUT_UNKNOWN;
	fn->flags = (kernel ? GPUOS_FN_KERNEL : 0) | (patterns_match(&touch_pats, name) ? GPUOS_FN_TOUCH_ALL : 0) |
		    (gpuos_validating == GPUOS_VALIDATE_TOUCHED || patterns_match(&dump_pats, name) ? GPUOS_FN_DUMP : 0);
	fn->params_bytes = 0;
	fn->pad = 0;
	for (size_t i = 0; i < n; i++) {
		fn->p[i].off = lay.p[i].off;
		fn->p[i].size = lay.p[i].size;
		if (lay.p[i].off + lay.p[i].size > fn->params_bytes)
			fn->params_bytes = lay.p[i].off + lay.p[i].size;
	}
	free(lay.p);
	fn->func_id = gpuos_func_publish(h, name, fn->nparams, fn->params_bytes);
	gpuos_dbg("function %#llx %s: id %u, %s%u params", (unsigned long long)h, name ? name : "(no name)",
		  fn->func_id, known ? "" : "layout unknown, ", (unsigned)n);
	return fn;
}

/* The entry of handle, with its parent filled in when it had none (write lock held). */
static struct gpuos_obj *fn_lookup_locked(uint64_t handle, uint64_t parent)
{
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, handle);
	if (o && !o->parent)
		o->parent = parent;
	return o;
}

uint32_t gpuos_fn_ensure(uint64_t handle, enum gpuos_fn_hint hint, uint64_t parent)
{
	/* Fast path: known already (cuModuleGetFunction may be called before every launch). */
	pthread_rwlock_rdlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, handle);
	uint32_t id = o && (o->parent || !parent) ? ((struct gpuos_fn *)o->ptr)->func_id : GPUOS_NO_FUNC;
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (id != GPUOS_NO_FUNC)
		return id;
	/* One creator at a time, so that a handle gets one id. */
	pthread_mutex_lock(&create_mu);
	pthread_rwlock_wrlock(&gpuos_lock.v);
	o = fn_lookup_locked(handle, parent);
	if (o)
		id = ((struct gpuos_fn *)o->ptr)->func_id;
	pthread_rwlock_unlock(&gpuos_lock.v);
	struct gpuos_fn *fn = o ? NULL : fn_make(handle, hint);
	if (fn) {
		pthread_rwlock_wrlock(&gpuos_lock.v);
		o = gpuos_obj_put(GPUOS_O_FN, handle);
		if (o) {
			o->ptr = fn;
			o->parent = parent;
			id = fn->func_id;
		}
		pthread_rwlock_unlock(&gpuos_lock.v);
		if (o) {
			gpuos_obj_record(fn->flags & GPUOS_FN_KERNEL ? GPUOS_OBJ_KERNEL : GPUOS_OBJ_FUNCTION,
					 GPUOS_OBJ_CREATED, handle, parent, id);
		} else {
			free(fn);
		}
	}
	pthread_mutex_unlock(&create_mu);
	return id;
}

void gpuos_scan_forget(void)
{
	pthread_mutex_init(&create_mu, NULL);
}

/* ---- the scan ----------------------------------------------------------------------------------- */

static void scratch_free(void *p)
{
	free(p);
	tls_scratch = NULL; /* a later driver call from a TLS destructor gets a new one */
}

static void scratch_key_init(void)
{
	pthread_key_create(&scratch_key, scratch_free);
}

struct gpuos_scan *gpuos_scan_tls(void)
{
	struct scratch *t = tls_scratch;
	if (likely(t != NULL)) {
		__builtin_prefetch(&t->small_idx, 1, 3);
		__builtin_prefetch(&t->bufs[0], 1, 3);
		__builtin_prefetch(&t->bufs[1], 1, 3);
		return &t->s;
	}
	pthread_once(&scratch_once, scratch_key_init);
	struct scratch *x = aligned_alloc(_Alignof(struct scratch), sizeof *x);
	if (x)
		memset(x, 0, sizeof *x);
	if (!x) {
		gpuos_track_off(ENOMEM, "out of memory for a thread's scan buffer");
		return NULL;
	}
	x->s.bufs = x->bufs;
	pthread_setspecific(scratch_key, x);
	tls_scratch = x;
	return &x->s;
}

/* The hash set of allocation indices seen in this launch (per-launch generations). */
static int seen_before_hashed(struct scratch *x, uint32_t idx)
{
	uint32_t key = idx + 1, mask = (1u << DEDUPE_BITS) - 1, i = (key * 0x9e3779b1u) >> (32 - DEDUPE_BITS);
	for (; x->seen[i].gen == x->gen; i = (i + 1) & mask)
		if (x->seen[i].idx == key)
			return 1;
	x->seen[i].gen = x->gen;
	x->seen[i].idx = key;
	return 0;
}

/* Is allocation idx in this launch's list already?  Marks it seen when not. */
static int seen_before(struct scratch *x, uint32_t idx)
{
	uint32_t n = x->s.nbuf;
	if (n <= DEDUPE_LINEAR) {
		for (uint32_t i = 0; i < n; i++)
			if (x->small_idx[i] == idx)
				return 1;
		if (n < DEDUPE_LINEAR) {
			x->small_idx[n] = idx;
			return 0;
		}
		/* The list outgrows a linear search: from here on the hash set holds it all. */
		for (uint32_t i = 0; i < n; i++)
			seen_before_hashed(x, x->small_idx[i]);
	}
	return seen_before_hashed(x, idx);
}

/* A buffer for the allocation of cache entry e, found at v (parameter param, offset off). */
static void add_buf(struct scratch *x, const struct lookup_ent *e, uint64_t v, uint16_t param, uint32_t off)
{
	if (seen_before(x, e->idx))
		return;
	if (x->s.nbuf == GPUOS_MAX_BUFS) {
		x->s.lflags |= GPUOS_LAUNCH_TRUNCATED;
		return;
	}
	struct gpuos_rec_buf *b = &x->bufs[x->s.nbuf++];
	b->base = e->base;
	b->size = e->size;
	b->ptr = v;
	b->len = 0;
	b->param = param;
	b->flags = e->flags;
	b->offset = off;
}

/* The thread's cache entry for the allocation containing v, or NULL (read lock held);
 * v is inside the map's span (x->lo <= v < x->hi).  An entry holds what a buffer needs,
 * so a hit reads one cache line. */
static inline const struct lookup_ent *lookup(struct scratch *x, uint64_t v)
{
	const struct gpuos_map *m = &gpuos_allocs;
	struct lookup_ent *set = x->lookup[((v >> LOOKUP_GRAIN) * 0x9e3779b97f4a7c15ull) >> (64 - LOOKUP_SET_BITS)];
	for (int w = 0; w < 2; w++) {
		if (set[w].gen == m->gen && v - set[w].base < set[w].size) {
			ST_ADD(HITS, 1);
			return &set[w];
		}
	}
	ST_ADD(MISSES, 1);
	const struct gpuos_alloc *a = gpuos_map_find(m, v);
	if (!a)
		return NULL;
	/* the newest in way 0, the one before in way 1 */
	set[1] = set[0];
	struct lookup_ent *e = &set[0];
	e->base = a->base;
	e->size = a->end - a->base;
	e->idx = (uint32_t)(a - m->v);
	e->flags = gpuos_buf_flags(a);
	e->gen = m->gen;
	return e;
}

/* A word that is no pointer adds (word ^ index * golden) * M to the launch's sum (index:
 * its place among the launch's words), so each word's multiply is independent of the
 * others' and the sum stays in a register; hash_final() mixes the sum at the end.
 * Scalars swapped between two places change the hash. */
#define HASH_GOLDEN 0x9e3779b97f4a7c15ull
#define HASH_MUL 0xff51afd7ed558ccdull

static inline uint64_t hash_term(uint64_t v, uint64_t salt)
{
	return (v ^ salt) * HASH_MUL;
}

/* Look every 8-byte word of a parameter up; hash the others (a shorter tail as one
 * zero-padded word). */
static void scan_bytes(struct scratch *x, const uint8_t *p, size_t size, uint16_t param)
{
	const uint64_t lo = x->lo, span = x->hi - x->lo;
	uint64_t sum = x->sum, salt = x->nwords * HASH_GOLDEN;
	size_t off = 0;
	for (; off + 8 <= size; off += 8, salt += HASH_GOLDEN) {
		uint64_t v;
		memcpy(&v, p + off, 8);
		const struct lookup_ent *e;
		if (unlikely(v - lo < span) && (e = lookup(x, v)) != NULL)
			add_buf(x, e, v, param, (uint32_t)off);
		else
			sum += hash_term(v, salt);
	}
	if (off < size) {
		uint64_t v = 0;
		memcpy(&v, p + off, size - off);
		sum += hash_term(v, salt);
		off += 8;
	}
	x->sum = sum;
	x->nwords += (uint32_t)(off / 8);
}

static uint64_t hash_final(const struct scratch *x)
{
	uint64_t h = x->sum ^ x->nwords;  /* murmur3's 64-bit finalizer */
	h = (h ^ (h >> 33)) * 0xff51afd7ed558ccdull;
	h = (h ^ (h >> 33)) * 0xc4ceb9fe1a85ec53ull;
	return h ^ (h >> 33);
}

int gpuos_extra_buffer(void **extra, const uint8_t **buf, size_t *size)
{
	*buf = NULL;
	*size = 0;
	int sized = 0;
	for (int i = 0; i < 64 && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
		if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) {
			*buf = extra[i + 1];
		} else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1]) {
			*size = *(const size_t *)extra[i + 1];
			sized = 1;
		}
	}
	return *buf && sized && *size <= MAX_PARAM_BUFFER;
}

/* The parameters as one buffer: an `extra` buffer, or a launch's parameters copied to
 * their offsets (defer.c).  Each parameter is scanned where it lies inside size bytes. */
static void scan_image(struct scratch *x, const struct gpuos_fn *fn, const uint8_t *buf, size_t size)
{
	if (!fn || fn->nparams == GPUOS_LAYOUT_UNKNOWN) {
		/* Word by word (parameter index 0xffff, offset into the buffer); still flagged. */
		x->s.lflags |= GPUOS_LAUNCH_LAYOUT_UNKNOWN;
		scan_bytes(x, buf, size, 0xffff);
		return;
	}
	for (uint16_t i = 0; i < fn->nparams && (size_t)fn->p[i].off + fn->p[i].size <= size; i++)
		scan_bytes(x, buf + fn->p[i].off, fn->p[i].size, i);
}

static void scan_params(struct scratch *x, const struct gpuos_fn *fn, void **kp, void **extra)
{
	struct gpuos_scan *s = &x->s;
	int known = fn && fn->nparams != GPUOS_LAYOUT_UNKNOWN;
	if (kp) {
		if (!known) {
			s->lflags |= GPUOS_LAUNCH_LAYOUT_UNKNOWN;
			return;
		}
		for (uint16_t i = 0; i < fn->nparams; i++)
			if (kp[i])
				scan_bytes(x, kp[i], fn->p[i].size, i);
		return;
	}
	if (!extra)
		return;
	const uint8_t *buf;
	size_t size;
	s->lflags |= GPUOS_LAUNCH_EXTRA;
	if (!gpuos_extra_buffer(extra, &buf, &size)) {
		s->lflags |= GPUOS_LAUNCH_LAYOUT_UNKNOWN;
		return;
	}
	scan_image(x, fn, buf, size);
}

/* Start a launch's scan: no buffers yet, the map's span and the dedupe set current. */
static struct scratch *scan_start(struct gpuos_scan *s, const struct gpuos_fn *fn)
{
	struct scratch *x = (struct scratch *)s;
	s->nbuf = 0;
	s->lflags = fn && (fn->flags & GPUOS_FN_TOUCH_ALL) ? GPUOS_LAUNCH_TOUCH_ALL : 0;
	x->sum = 0;
	x->nwords = 0;
	if (unlikely(x->span_gen != gpuos_allocs.gen + 1)) { /* + 1: gen 0 is a gen too */
		x->lo = gpuos_allocs.n ? gpuos_allocs.v[0].base : 0;
		x->hi = gpuos_allocs.n ? gpuos_allocs.v[gpuos_allocs.n - 1].end : 0;
		x->span_gen = gpuos_allocs.gen + 1;
	}
	if (unlikely(++x->gen == 0)) {
		memset(x->seen, 0, sizeof x->seen);
		x->gen = 1;
	}
	return x;
}

static void scan_finish(struct scratch *x)
{
	ST_ADD(WORDS, x->nwords);
	x->s.hash = hash_final(x);
}

void gpuos_scan_launch(struct gpuos_scan *s, const struct gpuos_fn *fn, void **kp, void **extra)
{
	struct scratch *x = scan_start(s, fn);
	scan_params(x, fn, kp, extra);
	scan_finish(x);
}

void gpuos_scan_image(struct gpuos_scan *s, const struct gpuos_fn *fn, const uint8_t *image, size_t size,
		      int from_extra)
{
	struct scratch *x = scan_start(s, fn);
	if (from_extra)
		s->lflags |= GPUOS_LAUNCH_EXTRA;
	if (from_extra || (fn && fn->nparams != GPUOS_LAYOUT_UNKNOWN))
		scan_image(x, fn, image, size);
	else
		s->lflags |= GPUOS_LAUNCH_LAYOUT_UNKNOWN;
	scan_finish(x);
}

/* ---- parameter dumps ---------------------------------------------------------------------------- */

static __thread uint8_t *dump_buf; /* grown, never freed: only threads that dump have one */
static __thread size_t dump_cap;

void gpuos_scan_dump(const struct gpuos_fn *fn, void **kp, void **extra, uint64_t seq)
{
	struct gpuos_rec_params rec = { .seq = seq, .func_id = fn->func_id };
	uint16_t flags = 0;
	const uint8_t *ebuf = NULL;
	size_t esize = 0;
	uint32_t n;
	if (kp && fn->nparams != GPUOS_LAYOUT_UNKNOWN) {
		n = fn->nparams;
	} else if (!kp && extra && gpuos_extra_buffer(extra, &ebuf, &esize)) {
		n = 1;
		flags |= GPUOS_PARAMS_EXTRA;
	} else {
		return; /* nothing whose size we know */
	}
	size_t need = n * sizeof(struct gpuos_rec_param) + GPUOS_MAX_PARAM_DUMP;
	if (need > dump_cap) {
		uint8_t *p = realloc(dump_buf, need);
		if (!p)
			return; /* a debugging aid: skip it rather than stop tracking */
		dump_buf = p;
		dump_cap = need;
	}
	struct gpuos_rec_param *ent = (struct gpuos_rec_param *)dump_buf;
	uint8_t *bytes = dump_buf + n * sizeof *ent;
	size_t used = 0;
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *src = ebuf ? ebuf : kp[i];
		size_t size = ebuf ? esize : fn->p[i].size;
		if (!src)
			size = 0;
		if (used + size > GPUOS_MAX_PARAM_DUMP) {
			size = GPUOS_MAX_PARAM_DUMP - used;
			flags |= GPUOS_PARAMS_TRUNCATED;
		}
		ent[i].offset = ebuf ? 0 : fn->p[i].off;
		ent[i].size = (uint32_t)size;
		memcpy(bytes + used, src, size);
		used += size;
	}
	rec.nparams = n;
	gpuos_ring_emit(GPUOS_REC_PARAMS, flags, &rec, sizeof rec, dump_buf, n * sizeof *ent + used);
}
