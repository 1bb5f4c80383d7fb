/* SPDX-License-Identifier: MIT */
/*
 * core.h - what the files of libgpuos's core share (not an interface of the library).
 *
 *   hooks.c    the real driver, dlsym / cuGetProcAddress interposition, exported wrappers
 *   ctl.c      lazy start, control socket, turning tracking off, fork
 *   ring.c     the ring writer and the function table
 *   track.c    allocation interval map, handle table, gpuos_track_snapshot/ignore
 *   scan.c     parameter layouts, function entries, the speculative pointer scan
 *   ops.c      launches, copies, memsets: records and validation around the real call
 *   alloc.c    allocations and VMM
 *   objects.c  modules, libraries, functions, kernels, streams, events, stream capture
 *   graph.c    graph execs: node extraction at instantiate/update, replay at launch
 *   defer.c    per-thread queues and the recording thread: operations recorded off the
 *              launching thread
 *   resident.c GPU memory oversubscription (--gpu-memory): movable memory made resident
 *              before the calls that touch it
 *   validate.c validation mode: predictions against what each operation changed (or,
 *              GPUOS_VALIDATE=touched, touched)
 *   touched.c  ... the touches, measured: managed memory for cuMemAlloc, a UVM event
 *              tracker on the process's own VA space
 *
 * Every wrapper of the hook table calls a handler (HANDLER(real, pt, args...)): `real`
 * is the driver's entry point of exactly that exported symbol, `pt` is 1 for the
 * _ptsz/_ptds variants (stream 0 means the per-thread stream there).
 */
#ifndef GPUOS_CORE_H
#define GPUOS_CORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

/* The exported wrappers redeclare cuda.h's functions: give those declarations default
 * visibility so that the definitions (GPUOS_EXPORT) agree with them. */
#pragma GCC visibility push(default)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#pragma GCC visibility pop

#include "gpuos_agent.h"
#include "gpuos_ring.h"
#include "selftime.h"
#include "validate.h"

/* cuda.h maps these names to their newest ABI; the hook table needs the exported
 * symbols of every ABI (old runtimes ask cuGetProcAddress for the old ones). */
#undef cuGetProcAddress
#undef cuMemHostRegister
#undef cuStreamDestroy
#undef cuEventDestroy
#undef cuStreamBeginCapture
#undef cuMemcpyBatchAsync
#undef cuStreamWriteValue32
#undef cuStreamWriteValue64
#undef cuGraphInstantiate
#undef cuGraphExecUpdate
#undef cuGraphExecKernelNodeSetParams

/* Legacy ABIs whose PFN typedefs cudaTypedefs.h only has for the driver's own build. */
typedef CUresult (CUDAAPI *gpuos_pfn_cuStreamBeginCapture_v10000)(CUstream hStream);
typedef CUresult (CUDAAPI *gpuos_pfn_cuGraphInstantiate_v10000)(CUgraphExec *phGraphExec, CUgraph hGraph,
								  CUgraphNode *phErrorNode, char *logBuffer,
								  size_t bufferSize);

#define GPUOS_EXPORT __attribute__((visibility("default")))
#define GPUOS_TLS __thread __attribute__((tls_model("initial-exec")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
#define GPUOS_UNPAREN(...) __VA_ARGS__

#define GPUOS_NO_FUNC 0xffffffffu
#define GPUOS_LAYOUT_UNKNOWN 0xffffu

/* ---- hooks.c ------------------------------------------------------------------------ */

enum gpuos_hook_idx {
#define X(name, pfn, handler, pt, params, args) HK_##name,
#include "hooktable.h"
#undef X
	HK_COUNT
};

/* Handler prototypes, from the table (variants sharing a handler redeclare it with a
 * compatible pointer type). */
#define X(name, pfn, handler, pt, params, args) \
	CUresult handler(pfn real, int pt_, GPUOS_UNPAREN params);
#include "hooktable.h"
#undef X

extern void *gpuos_realfn[HK_COUNT];
extern int gpuos_resolved;
void gpuos_resolve(void);

static inline void *gpuos_real_at(int idx)
{
	if (unlikely(!__atomic_load_n(&gpuos_resolved, __ATOMIC_ACQUIRE)))
		gpuos_resolve();
	return gpuos_realfn[idx];
}

/* Driver entry points the core calls itself (never our wrappers).  Any may be NULL. */
struct gpuos_drv {
	PFN_cuDriverGetVersion_v2020 driver_get_version;
	PFN_cuCtxGetCurrent_v4000 ctx_get_current;
	PFN_cuCtxGetDevice_v2000 ctx_get_device;
	PFN_cuStreamIsCapturing_v10000 stream_is_capturing;
	PFN_cuFuncGetParamInfo_v12040 func_get_param_info;
	PFN_cuKernelGetParamInfo_v12040 kernel_get_param_info;
	PFN_cuFuncGetName_v12030 func_get_name;
	PFN_cuKernelGetName_v12030 kernel_get_name;
	PFN_cuGraphGetNodes_v10000 graph_get_nodes;
	PFN_cuGraphNodeGetType_v10000 graph_node_get_type;
	PFN_cuGraphKernelNodeGetParams_v12000 graph_kernel_node_get_params;
	PFN_cuGraphMemcpyNodeGetParams_v10000 graph_memcpy_node_get_params;
	PFN_cuGraphMemsetNodeGetParams_v10000 graph_memset_node_get_params;
	PFN_cuGraphChildGraphNodeGetGraph_v10000 graph_child_graph;
	PFN_cuGraphMemAllocNodeGetParams_v11040 graph_mem_alloc_node_get_params;
	PFN_cuGraphMemFreeNodeGetParams_v11040 graph_mem_free_node_get_params;
	/* the validator's (validate.c) */
	PFN_cuCtxPushCurrent_v4000 ctx_push;
	PFN_cuCtxPopCurrent_v4000 ctx_pop;
	PFN_cuCtxSynchronize_v2000 ctx_sync;
	PFN_cuCtxGetId_v12000 ctx_get_id;
	PFN_cuModuleLoadData_v2000 module_load_data;
	PFN_cuModuleGetFunction_v2000 module_get_function;
	PFN_cuStreamCreate_v2000 stream_create;
	PFN_cuStreamSynchronize_v2000 stream_sync;
	PFN_cuLaunchKernel_v4000 launch_kernel;
	PFN_cuMemGetAddressRange_v3020 mem_get_address_range;
	PFN_cuMemAlloc_v3020 mem_alloc;
	PFN_cuMemFree_v3020 mem_free;
	PFN_cuMemcpyHtoDAsync_v3020 memcpy_htod_async;
	PFN_cuMemcpyDtoHAsync_v3020 memcpy_dtoh_async;
	PFN_cuGetErrorName_v6000 get_error_name;
	PFN_cuThreadExchangeStreamCaptureMode_v10010 thread_exchange_capture_mode;
	/* a warm standby's kernel preloading (preload.c) */
	PFN_cuLibraryGetKernel_v12000 library_get_kernel;
	PFN_cuKernelGetFunction_v12000 kernel_get_function;
	PFN_cuFuncLoad_v12040 func_load;
	PFN_cuKernelGetLibrary_v12050 kernel_get_library;
	/* movable memory's (memory.c) */
	PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity;
	PFN_cuMemAddressReserve_v10020 mem_address_reserve;
	PFN_cuMemAddressFree_v10020 mem_address_free;
	PFN_cuMemCreate_v10020 mem_create;
	PFN_cuMemRelease_v10020 mem_release;
	PFN_cuMemMap_v10020 mem_map;
	PFN_cuMemUnmap_v10020 mem_unmap;
	PFN_cuMemSetAccess_v10020 mem_set_access;
	/* the agent's (agent.c) */
	PFN_cuMemExportToShareableHandle_v10020 mem_export;
	PFN_cuMemImportFromShareableHandle_v10020 mem_import;
	PFN_cuMemHostRegister_v6050 mem_host_register;
	PFN_cuMemHostUnregister_v4000 mem_host_unregister;
	PFN_cuStreamDestroy_v4000 stream_destroy;
	PFN_cuMemcpyDtoDAsync_v3020 memcpy_dtod_async;
	PFN_cuDeviceGetCount_v2000 device_get_count;
	PFN_cuDeviceCanAccessPeer_v4000 device_can_access_peer;
	/* the memory scheduler's (resident.c: copies ahead) */
	PFN_cuEventCreate_v2000 event_create;
	PFN_cuEventRecord_v2000 event_record;
	PFN_cuEventQuery_v2000 event_query;
	PFN_cuEventSynchronize_v2000 event_sync;
	PFN_cuEventElapsedTime_v2000 event_elapsed;
	/* measuring touches (touched.c, validate.c) */
	PFN_cuMemAllocManaged_v6000 mem_alloc_managed;
	PFN_cuMemGetInfo_v3020 mem_get_info;
	PFN_cuMemPrefetchAsync_v12020 mem_prefetch;
};
extern struct gpuos_drv gpuos_drv;

/* ---- ctl.c -------------------------------------------------------------------------- */

enum gpuos_run {
	GPUOS_RUN_UNSTARTED = 0,
	GPUOS_RUN_STARTING,
	GPUOS_RUN_PASSIVE, /* no GPUOS_CTL: every wrapper only calls through */
	GPUOS_RUN_ON,
	GPUOS_RUN_OFF,
};
/* What every operation reads and almost nothing writes, alone on its cache lines: one
 * line to fetch between two launches instead of five, and none that the recording
 * thread writes (GPUOS_ALONE). */
struct gpuos_hot {
	int run_state;              /* enum above (ctl.c) */
	int capturing;              /* stream captures in progress, process-wide (objects.c) */
	int tsc_ok;                 /* queue entries are stamped with the TSC (defer.c) */
	const uint32_t *pause_word; /* hdr.ops_paused of the ring, or gpuos_not_paused (ring.c) */
	uint64_t fn_gen;            /* bumped when function entries are freed (objects.c) */
	int gate;                   /* the agent holds the process: wrappers wait (agent.c) */
} __attribute__((aligned(128)));
extern struct gpuos_hot gpuos_hot;
extern const uint32_t gpuos_not_paused; /* a constant 0 */
/* GPUOS_VALIDATE=1 (or =touched: GPUOS_VALIDATE_TOUCHED) and tracking started */
extern int gpuos_validating;
#define GPUOS_VALIDATE_TOUCHED 2
int gpuos_start(void);

/* Is tracking on?  Starts it at the first call of a process (or of a forked child). */
static inline int gpuos_on(void)
{
	int s = __atomic_load_n(&gpuos_hot.run_state, __ATOMIC_ACQUIRE);
	if (unlikely(s < GPUOS_RUN_PASSIVE))
		s = gpuos_start();
	return s == GPUOS_RUN_ON;
}

void gpuos_dbg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int gpuos_debugging(void); /* GPUOS_LIB_DEBUG=1: gpuos_dbg writes */

/* standby.c: a warm standby (GPUOS_MPS_STANDBY_AT=launch) waits at its first launch;
 * every launch wrapper looks here first (one load once passed). */
extern int gpuos_standby_passed;
void gpuos_standby_launch_slow(void);
/* blaswarm.c: a warm standby starts cuBLAS on a thread of its own while it waits */
extern GPUOS_TLS int gpuos_blaswarm_thread;
void gpuos_blaswarm_start(void);
struct gpuos_blaswarm_report {
	int calls, failed; /* GEMMs made, of which the library refused */
	uint64_t ns;       /* from the thread's start to the last one's end */
	int done;          /* 1 once the rest is written (atomic) */
};
extern struct gpuos_blaswarm_report gpuos_blaswarm;

/* aheadmem.c: a warm standby makes ahead the allocations its client made after its first
 * launch, and hands them out after its release */
int gpuos_preload_launched(void);             /* (preload.c) this process has launched */
void gpuos_aheadmem_note(uint64_t bytes);     /* the client: a cuMemAlloc of bytes done */
void gpuos_aheadmem_write(const char *list_path); /* ... written to LIST.allocs if new */
int gpuos_aheadmem_make(const char *list_path);   /* the standby: 1 made, 0 no list yet */
int gpuos_aheadmem_take(CUdeviceptr *dptr, uint64_t bytes); /* 1: one of that size handed out */
void gpuos_aheadmem_counts(size_t *made, size_t *taken);
extern int gpuos_aheadmem_left;

/* sharemem.c: a warm standby maps its client's start-up memory instead of a copy
 * (GPUOS_MPS_SHARE_MEMORY=1) */
int gpuos_sharemem_alloc(CUdeviceptr *dptr, size_t bytes); /* 1: made exportable (before the first launch) */
int gpuos_sharemem_free(CUdeviceptr p, CUresult *r);       /* 1: it was one of those (*r: the free's) */
void gpuos_sharemem_launched(void);     /* the client's first launch: serve them */
int gpuos_sharemem_standby_pass(void);  /* the waiting standby: 1 once its client answered */
int gpuos_sharemem_standby_recheck(void); /* waiting: own content back where the client wrote (1: some) */
void gpuos_sharemem_released(void);     /* the standby, released: its own content where changed */
void gpuos_sharemem_report(char *out, size_t cap);

static inline void gpuos_standby_at_launch(void)
{
	if (__builtin_expect(!__atomic_load_n(&gpuos_standby_passed, __ATOMIC_ACQUIRE), 0))
		gpuos_standby_launch_slow();
}

/* preload.c: with GPUOS_MPS_KERNELS, every launch notes its function for the client's
 * warm standby, which loads them while it waits (gpuos_preload_standby_waits). */
extern int gpuos_preload_noting;
void gpuos_preload_note_slow(uint64_t handle);
static inline void gpuos_preload_note(const void *f)
{
	if (__builtin_expect(__atomic_load_n(&gpuos_preload_noting, __ATOMIC_RELAXED), 0))
		gpuos_preload_note_slow((uint64_t)(uintptr_t)f);
}
void gpuos_preload_standby_waits(void);
/* A library loaded from image with these options (a client writes the image's place and
 * the options down with its kernels), or a library loaded from a file, or a module,
 * loaded (loaded=1) or unloaded: where a client's launches come from and a standby looks
 * for names. */
void gpuos_preload_library(uint64_t handle, const void *image, unsigned int njit, const CUlibraryOption *lo,
			   void *const *lv, unsigned int nl);
void gpuos_preload_code(uint64_t handle, int module, int loaded);
/* cuKernelGetFunction's pair, for a client that launches the function */
void gpuos_preload_function(uint64_t f, uint64_t k);
/* A library this standby loaded ahead from image, with the same options: 1 and *lib. */
int gpuos_preload_take(const void *image, unsigned int njit, CUlibraryOption *lo, void **lv, unsigned int nl,
		       CUlibrary *lib);
void gpuos_preload_forget(void); /* fork child */
void gpuos_preload_debug_load(const char *call, const void *image, uint64_t t0_ns); /* GPUOS_LIB_DEBUG */
/* Tracking goes on, but the record misses something (GPUOS_INCOMPLETE_* bit `why`):
 * the ring says so, once per reason, with a STATUS record. */
void gpuos_track_incomplete(uint32_t why, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

extern GPUOS_TLS uint32_t gpuos_tls_tid;
/* The real dlsym (hooks.c; NULL until the process's first dlsym): libgpuos's own lookups
 * that must not go through its dlsym. */
extern void *(*gpuos_real_dlsym)(void *, const char *);
uint32_t gpuos_tid_slow(void);
static inline uint32_t gpuos_tid(void)
{
	return likely(gpuos_tls_tid) ? gpuos_tls_tid : gpuos_tid_slow();
}

static inline uint64_t gpuos_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A thread of libgpuos's own that nobody joins: 0, or pthread_create's error. */
static inline int gpuos_thread_detached(void *(*fn)(void *), void *arg)
{
	pthread_t t;
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	int e = pthread_create(&t, &at, fn, arg);
	pthread_attr_destroy(&at);
	return e;
}

/* ---- ring.c ------------------------------------------------------------------------- */

/* Record this operation?  Tracking is on and no controller has paused operations. */
static inline int gpuos_recording(void)
{
	return gpuos_on() && !__atomic_load_n(gpuos_hot.pause_word, __ATOMIC_RELAXED);
}

/* Records this thread writes from now on carry this tid and time (0, 0: its own). */
void gpuos_ring_as(uint32_t tid, uint64_t ts_ns);
int gpuos_ring_create(uint32_t flags);   /* 0 or an errno; turns nothing off itself */
void gpuos_ring_prefetch_hdr(void);      /* the header lines a record writes, */
void gpuos_ring_prefetch_slots(void);    /* then its slots (after the first: reads head) */
int gpuos_ring_fd(void);
uint64_t gpuos_ring_bytes(void);
struct gpuos_ring_hdr *gpuos_ring_hdr(void); /* NULL without a ring */
void gpuos_ring_forget(void);            /* fork child: drop the parent's ring */
/* Publish a function table entry; its id, or GPUOS_NO_FUNC (tracking is then off). */
uint32_t gpuos_func_publish(uint64_t handle, const char *name, uint16_t nparams, uint32_t params_bytes);

#define GPUOS_COUNT(field, n) gpuos_ring_count(offsetof(struct gpuos_ring_hdr, field), (n))

/* A variable written at every record or drain (by the recording thread), alone on two
 * cache lines: a word next to it that every launch reads would miss after each write
 * (the adjacent-line prefetcher fetches lines in pairs).  The variable is .v. */
#define GPUOS_ALONE(type) union { type v; char line_[128]; } __attribute__((aligned(128)))

/* ---- track.c ------------------------------------------------------------------------ */

/* One lock guards the allocation map and the handle table: a launch recorded inline
 * takes it once for reading, the recording thread once per queue drained.
 * Writer-preferring, so never take it twice for reading in one thread. */
typedef GPUOS_ALONE(pthread_rwlock_t) gpuos_alone_rwlock_t;
extern gpuos_alone_rwlock_t gpuos_lock;

/* gpuos_alloc.flags */
#define GPUOS_A_MANAGED 1u
#define GPUOS_A_HOST 2u
#define GPUOS_A_DEVMEM 4u /* plain device memory the validator can fingerprint */
#define GPUOS_A_MOVABLE 8u /* movable memory (memory.c): aux is its physical memory's handle */
#define GPUOS_A_MEASURED 16u /* managed memory standing in for cuMemAlloc's (touched.c) */

struct gpuos_alloc {
	uint64_t base, end;
	uint64_t ctx;
	uint64_t aux;    /* VMM handle; graph allocations: execs holding it */
	uint32_t kind;   /* enum gpuos_alloc_kind */
	uint32_t flags;  /* GPUOS_A_* */
	int32_t device;
	uint32_t pad;
	uint64_t last_use; /* movable: the seq of the last recorded operation that touched it (atomic) */
};

/* The last recorded operation of seq touched p: a movable allocation's last_use (the read
 * lock held).  At a restore, allocations are streamed back in the order of their last use
 * before the checkpoint: the order the next iteration needs them (movable/filler.py). */
static inline void gpuos_note_use_locked(uint64_t p, uint64_t seq);

/* The GPUOS_BUF_* flags a buffer record of allocation a carries (managed, host). */
static inline uint16_t gpuos_buf_flags(const struct gpuos_alloc *a)
{
	return (a->flags & GPUOS_A_MANAGED ? GPUOS_BUF_MANAGED : 0) | (a->flags & GPUOS_A_HOST ? GPUOS_BUF_HOST : 0);
}

/* A sorted array of non-overlapping ranges.  gen changes with every change that moves or
 * resizes an entry (write lock held), so that a reader may cache an entry's index. */
struct gpuos_map {
	struct gpuos_alloc *v;
	size_t n, cap;
	uint64_t gen;
	const char *what; /* for the out-of-memory reason */
};

extern struct gpuos_map gpuos_allocs; /* the buffers: what pointers are looked up in */

/* The allocation containing p, or NULL (read lock held). */
static inline const struct gpuos_alloc *gpuos_map_find(const struct gpuos_map *m, uint64_t p)
{
	size_t n = m->n;
	const struct gpuos_alloc *v = m->v;
	if (!n || p < v[0].base || p >= v[n - 1].end)
		return NULL;
	size_t lo = 0, hi = n; /* the last entry with base <= p is in [lo, hi) */
	while (hi - lo > 1) {
		size_t mid = (lo + hi) / 2;
		if (v[mid].base <= p)
			lo = mid;
		else
			hi = mid;
	}
	return p < v[lo].end ? &v[lo] : NULL;
}

static inline void gpuos_note_use_locked(uint64_t p, uint64_t seq)
{
	struct gpuos_alloc *a = (struct gpuos_alloc *)gpuos_map_find(&gpuos_allocs, p);
	if (a && (a->flags & GPUOS_A_MOVABLE))
		__atomic_store_n(&a->last_use, seq, __ATOMIC_RELAXED);
}

/* Write lock held for all of these. */
int gpuos_map_insert(struct gpuos_map *m, const struct gpuos_alloc *a); /* replaces overlaps; 0 or -1 (off) */
ssize_t gpuos_map_index(const struct gpuos_map *m, uint64_t base);      /* exact base, or -1 */
void gpuos_map_remove_at(struct gpuos_map *m, size_t i);
/* Cut [lo, hi) out of the map (trimming or splitting entries), calling cut() on each
 * piece removed.  0, or -1 when out of memory (tracking is then off). */
int gpuos_map_cut(struct gpuos_map *m, uint64_t lo, uint64_t hi, void (*cut)(const struct gpuos_alloc *part));
/* Entries overlapping or touching [lo, hi): the first index, count in *n. */
size_t gpuos_map_span(const struct gpuos_map *m, uint64_t lo, uint64_t hi, size_t *n);

extern struct gpuos_map gpuos_vmm_maps;     /* individual cuMemMap ranges (records) */
extern struct gpuos_map gpuos_reservations; /* cuMemAddressReserve ranges */
/* Rebuild the coalesced VMM buffers of gpuos_allocs around [lo, hi) from gpuos_vmm_maps. */
void gpuos_vmm_rebuild(uint64_t lo, uint64_t hi);

/* The handle table. */
enum gpuos_obj_kind {
	GPUOS_O_FN = 1,   /* CUfunction or CUkernel: ptr is a struct gpuos_fn */
	GPUOS_O_MODULE,   /* parent: the library of cuLibraryGetModule */
	GPUOS_O_LIBRARY,
	GPUOS_O_STREAM,   /* parent: ctx */
	GPUOS_O_EVENT,    /* parent: ctx */
	GPUOS_O_GEXEC,    /* ptr is a struct gpuos_gexec; parent: the graph */
	GPUOS_O_VMM,      /* cuMemCreate handle: u64 = size, parent = device */
};

struct gpuos_obj {
	uint64_t handle;
	uint32_t kind; /* enum gpuos_obj_kind; 0 = empty slot */
	uint32_t pad;
	uint64_t parent;
	uint64_t u64;
	void *ptr;
};

struct gpuos_obj *gpuos_obj_get(uint32_t kind, uint64_t handle);  /* read lock */
struct gpuos_obj *gpuos_obj_put(uint32_t kind, uint64_t handle);  /* write lock; NULL = off */
/* Write lock: remove, copying the entry to *out (if not NULL).  1 if it was there. */
int gpuos_obj_del(uint32_t kind, uint64_t handle, struct gpuos_obj *out);
/* Write lock: remove every entry for which pred() is true, calling done() on a copy. */
void gpuos_obj_sweep(int (*pred)(const struct gpuos_obj *, void *), void (*done)(struct gpuos_obj *),
		     void *arg);

void gpuos_track_forget(void); /* fork child */

/* ---- scan.c ------------------------------------------------------------------------- */

#define GPUOS_FN_KERNEL 1u    /* a CUkernel */
#define GPUOS_FN_TOUCH_ALL 2u /* a GPUOS_TOUCH_ALL pattern matched its name */
#define GPUOS_FN_DUMP 4u      /* a GPUOS_DUMP_PARAMS pattern matched its name */

struct gpuos_fn {
	uint32_t func_id;
	uint16_t nparams; /* GPUOS_LAYOUT_UNKNOWN */
	uint16_t flags;   /* GPUOS_FN_* */
	uint32_t params_bytes;
	uint32_t pad;
	struct {
		uint32_t off, size;
	} p[];
};

enum gpuos_fn_hint { GPUOS_HINT_UNKNOWN, GPUOS_HINT_FUNCTION, GPUOS_HINT_KERNEL };

void gpuos_scan_config(void); /* reads GPUOS_TOUCH_ALL and GPUOS_DUMP_PARAMS */
/* Changes (write lock held) whenever function entries are freed (module unload). */
/* The function table id of a handle, making its entry (layout, name) and writing its
 * OBJECT record on first sight.  Takes the lock itself: call without it. */
uint32_t gpuos_fn_ensure(uint64_t handle, enum gpuos_fn_hint hint, uint64_t parent);
void gpuos_scan_forget(void); /* fork child */

/* Per-thread result of one scan. */
struct gpuos_scan {
	struct gpuos_rec_buf *bufs; /* GPUOS_MAX_BUFS of them */
	uint32_t nbuf;
	uint16_t lflags;  /* GPUOS_LAUNCH_* found by the scan */
	uint64_t hash;
};
/* Scan a launch's parameters (read lock held).  fn may be NULL (unknown). */
void gpuos_scan_launch(struct gpuos_scan *s, const struct gpuos_fn *fn, void **kp, void **extra);
/* The same scan of a launch's parameters copied into one buffer: an `extra` buffer
 * (from_extra), or each parameter at its layout offset (read lock held). */
void gpuos_scan_image(struct gpuos_scan *s, const struct gpuos_fn *fn, const uint8_t *image, size_t size,
		      int from_extra);
/* The parameter buffer of an `extra` array and its size; 0 if it has none we scan. */
int gpuos_extra_buffer(void **extra, const uint8_t **buf, size_t *size);
/* Write a PARAMS record of a launch of fn (with GPUOS_FN_DUMP; read lock held). */
void gpuos_scan_dump(const struct gpuos_fn *fn, void **kp, void **extra, uint64_t seq);
/* The calling thread's scratch (NULL when out of memory: tracking is then off), its
 * lines a launch touches requested from memory. */
struct gpuos_scan *gpuos_scan_tls(void);

/* ---- ops.c -------------------------------------------------------------------------- */

typedef GPUOS_ALONE(uint64_t) gpuos_alone_u64_t;
extern gpuos_alone_u64_t gpuos_seq; /* the last operation number given */
static inline uint64_t gpuos_next_seq(void)
{
	return __atomic_add_fetch(&gpuos_seq.v, 1, __ATOMIC_RELAXED);
}
uint64_t gpuos_current_ctx(void);
/* Is `stream` capturing?  Asks the driver only while a capture is in progress. */
int gpuos_stream_captured_ask(uint64_t stream);
static inline int gpuos_stream_captured(uint64_t stream)
{
	if (likely(!__atomic_load_n(&gpuos_hot.capturing, __ATOMIC_RELAXED)))
		return 0;
	return gpuos_stream_captured_ask(stream);
}

static inline uint64_t gpuos_eff_stream(CUstream s, int pt)
{
	return (!s && pt) ? (uint64_t)(uintptr_t)CU_STREAM_PER_THREAD : (uint64_t)(uintptr_t)s;
}

/* ---- fingerprint.c: fingerprint.cu's module and hash --------------------------------- */

/* One 64-bit hash per GPUOS_VALIDATE_CHUNK bytes of a table of segments; the table's
 * layout must match struct gpuos_fp_seg of fingerprint.cu (and of the fake driver). */
struct gpuos_fp_seg {
	uint64_t base;
	uint64_t size;
	uint64_t first_chunk; /* its first chunk's index in the output array */
};
#define GPUOS_FP_BLOCK 256u /* threads per block: 8 warps, 8 chunks at a time */
/* Load the module into the current context (through gpuos_drv; *mod NULL on failure). */
CUresult gpuos_fp_load(CUmodule *mod);
/* Launch gpuos_fp_hash over `nseg` segments already on the device at `segs` (async). */
CUresult gpuos_fp_hash(CUfunction hash, CUdeviceptr segs, unsigned int nseg, CUdeviceptr out, uint64_t nchunks,
		       CUstream s);
unsigned int gpuos_fp_grid(uint64_t items, uint64_t per_block);
/* fingerprint.cu's module and device buffers of libgpuos's own for one context, kept
 * between uses and grown as needed (resident.c's evictions, sharemem.c). */
struct gpuos_fp_hasher {
	CUmodule mod;
	CUfunction fn;
	int broken; /* the module cannot be loaded here */
	CUdeviceptr d_segs, d_out;
	size_t cap_segs;
	uint64_t cap_n;
};
/* The module loaded (in the current context) and room for nseg segments and n hashes:
 * 0, or -1 (h->broken if the module cannot be loaded). */
int gpuos_fp_hasher_reserve(struct gpuos_fp_hasher *h, size_t nseg, uint64_t n);
/* The chunk hashes of segs (n in all) read back into out, waited for on s: 0 or -1. */
int gpuos_fp_hasher_run(struct gpuos_fp_hasher *h, const struct gpuos_fp_seg *segs, size_t nseg, uint64_t *out,
			uint64_t n, CUstream s);
/* Device memory of libgpuos's own, hidden from the allocation map (*p 0 on failure or
 * after the free). */
CUresult gpuos_own_dev_alloc(CUdeviceptr *p, size_t bytes);
void gpuos_own_dev_free(CUdeviceptr *p, size_t bytes);

/* ---- touched.c: what launches touch, measured (GPUOS_VALIDATE=touched) --------------- */

struct gpuos_touch_page {
	uint64_t page;   /* GPUOS_TOUCH_PAGE-aligned */
	uint32_t access; /* GPUOS_TOUCH_* */
};
struct gpuos_touch_pages {
	struct gpuos_touch_page *v;
	size_t n, cap;
};
/* The tracker on this process's VA space, made at the first call: 1 when tracking, else
 * 0 with *why saying why not. */
int gpuos_touched_tracker(const char **why);
/* The events since the last drain: faulted pages appended (pages may be NULL: dropped),
 * GPUOS_TOUCHED_* or'ed into *flags.  The faults read, or -1 without memory. */
int64_t gpuos_touched_drain(struct gpuos_touch_pages *pages, uint16_t *flags);
/* cuMemAlloc's stand-in: 1 if it answered (managed memory, *res the driver's result), 0
 * if the caller allocates as usual (over the budget of free GPU memory, or no driver
 * entry point). */
int gpuos_touched_alloc(CUdeviceptr *dptr, size_t bytes, CUresult *res);
void gpuos_touched_freed(uint64_t bytes);
void gpuos_touched_forget(void); /* fork child */

/* Validation around one real call (when gpuos_validating). */
void gpuos_val_begin(struct gpuos_val_op *op);
CUresult gpuos_val_end(struct gpuos_val_op *op, CUresult res);

/* Graph memcpy / memset nodes: the record (without seq, stream, graph_exec) and the
 * exact buffers (read lock held).  Returns how many buffers. */
uint32_t gpuos_node_memcpy(const CUDA_MEMCPY3D *p, struct gpuos_rec_copy *rec, struct gpuos_rec_buf bufs[2]);
uint32_t gpuos_node_memset(const CUDA_MEMSET_NODE_PARAMS *p, struct gpuos_rec_copy *rec,
			   struct gpuos_rec_buf bufs[2]);

/* A buffer entry for an exact range (copies, memsets): a is its allocation or NULL. */
void gpuos_exact_buf(struct gpuos_rec_buf *b, const struct gpuos_alloc *a, uint64_t ptr, uint64_t len,
		     uint16_t flags);

/* ---- defer.c ------------------------------------------------------------------------ */

/* An operation handed to the recording thread (defer.c): the launching thread copies
 * what the record needs (the parameter bytes, the stream, ...) into its own queue and
 * goes on; the recording thread scans and writes the record.  Everything that changes
 * what a recording reads (the map, the handle table, graph execs) first drains every
 * queue, taking gpuos_write_lock(), so each operation is recorded against the state it
 * was issued in.  Entries are 8-byte multiples. */
enum gpuos_qe_kind { GPUOS_QE_SKIP, GPUOS_QE_LAUNCH, GPUOS_QE_COPY, GPUOS_QE_GRAPH };

struct gpuos_qe {
	uint32_t size;  /* bytes of the entry */
	uint16_t kind;  /* enum gpuos_qe_kind */
	uint16_t flags; /* the record's flags known at the call */
	uint64_t stamp; /* when it was issued: the TSC where it is constant, else CLOCK_MONOTONIC
			 * ns (the recording thread writes ns) */
};

/* A queue entry of size bytes (header included) of this kind and record flags, stamped
 * now, in the calling thread's queue, to be filled and then committed (published if ok,
 * dropped if not).  NULL: record this operation inline (validation on, queue full, no
 * recording thread, nested call). */
struct gpuos_qe *gpuos_defer_reserve(size_t size, uint16_t kind, uint16_t flags);
void gpuos_defer_commit(int ok);
/* The function entry of a handle for the calling thread's queue (no lock held: the
 * thread's cache of entries, good while gpuos_hot.fn_gen holds); NULL: not known, or no
 * queue.  The entry stays valid until its module is unloaded.  Also requests the lines
 * the thread's next entry will take. */
const struct gpuos_fn *gpuos_defer_fn(uint64_t handle);
/* Record every queued operation of the calling thread / of all threads now.  Callers
 * hold no lock. */
void gpuos_defer_drain_self(void);
void gpuos_defer_drain_all(void);
void gpuos_defer_forget(void); /* fork child */

/* The recording thread's side (entries of each kind; read lock held).  Records
 * carry the issuing thread's tid and the entry's time (gpuos_ring_as). */
void gpuos_play_launch(const struct gpuos_qe *e);
void gpuos_play_copy(const struct gpuos_qe *e);
void gpuos_play_graph(const struct gpuos_qe *e);

/* Take gpuos_lock for writing to change what queued operations are recorded from (the
 * allocation map, function entries, graph execs): they are recorded first, against the
 * state they were issued in. */
void gpuos_write_lock_drained(void);

/* ---- memory.c ----------------------------------------------------------------------- */

enum gpuos_memory_mode { GPUOS_MEMORY_DRIVER = 0, GPUOS_MEMORY_MOVABLE = 1 };
int gpuos_memory_mode(void); /* GPUOS_MEMORY, read once */
/* Serve a cuMemAlloc of bytes as movable memory: 1 with *dptr and the map entry in *a,
 * 0 for the driver's own allocation (movable memory off, too small, or a VMM step failed). */
int gpuos_movable_alloc(CUdeviceptr *dptr, size_t bytes, struct gpuos_alloc *a);
/* Free movable memory a (out of the map already): waits for the context's work first. */
CUresult gpuos_movable_free(const struct gpuos_alloc *a);
/* Free a VMM allocation as cuMemFree would: wait for the context's work, unmap and
 * release h (0: nothing mapped), free the address range. */
CUresult gpuos_vmm_free(uint64_t va, size_t size, CUmemGenericAllocationHandle h);
/* The bytes of a's reservation and physical memory: its size rounded up to the granularity. */
size_t gpuos_movable_reserved(const struct gpuos_alloc *a);
/* The device's VMM granularity (asked once); SIZE_MAX where it has none. */
size_t gpuos_movable_granularity(int device);
/* The devices given access to movable memory on `device` (it, and its peers). */
size_t gpuos_movable_access(int device, const CUmemAccessDesc **out);
/* New physical memory for [va, va + size) on device, mapped read-write. */
CUresult gpuos_movable_map_new(uint64_t va, size_t size, int device, CUmemGenericAllocationHandle *out);
/* Where gpuos_movable_map_timed's time went (added to). */
struct gpuos_map_times {
	uint64_t create_ns, access_ns;
};
CUresult gpuos_movable_map_timed(uint64_t va, size_t size, int device, CUmemGenericAllocationHandle *out,
				 struct gpuos_map_times *t);

/* ---- resident.c --------------------------------------------------------------------- */

struct gpuos_res_stats;
uint64_t gpuos_res_limit(void); /* GPUOS_GPU_MEMORY in bytes; 0: no limit */
/* A movable allocation [base, base + size) with no physical memory yet: 0, or -1. */
int gpuos_res_add(uint64_t base, uint64_t size, int device, uint64_t ctx);
/* Forget an allocation being freed: its physical memory's handle (0: none to release). */
CUmemGenericAllocationHandle gpuos_res_forget(uint64_t base);
/* Make the allocations holding n addresses (`stride` bytes apart) resident for this call,
 * a launch or not; the lock is this call's until its outermost wrapper returns. */
CUresult gpuos_res_need(const uint64_t *p, size_t n, size_t stride, int launch);
CUresult gpuos_res_need_all(const char *why);
void gpuos_res_stats(struct gpuos_res_stats *out);
/* Evict what the group asked of this process (gpuos_share_release_asked), its lock taken
 * (share.c's release thread; the process's own calls do it under the lock they hold). */
void gpuos_res_evict_for_others(void);

/* The bucket of a stall of `ns` in libgpuos's histograms (struct gpuos_res_stats'
 * stall_hist, struct gpuos_share's switch_hist): [2^i, 2^(i+1)) microseconds, the first
 * also less, the last also more. */
static inline int gpuos_stall_bucket(uint64_t ns)
{
	uint64_t us = ns / 1000;
	int b = us ? 63 - __builtin_clzll(us) : 0;
	return b < GPUOS_STALL_BUCKETS ? b : GPUOS_STALL_BUCKETS - 1;
}

/* ---- share.c: a group sharing one pool (gpuos_share.h) -------------------------------- */

/* Join group `name`: 0, *limit the group's; -1 (said on stderr): not shared. */
int gpuos_share_join(const char *name, uint64_t *limit);
void gpuos_share_forget(void);         /* in a forked child */
int gpuos_share_acquire(void);         /* wait for the GPU's turn (1: a turn begins); busy */
int gpuos_share_take(uint64_t bytes);  /* charge if they fit: 1, else 0 */
int gpuos_share_take_free(uint64_t bytes); /* the same without the GPU's turn: only while no one
					   * waits for it, is asked to evict, or holds it busy */
void gpuos_share_give(uint64_t bytes);
uint64_t gpuos_share_used(void);
void gpuos_share_reserved(int64_t delta);
/* The turn's set lacks `excess` bytes to make `want` resident: others evict; 1 if the
 * group's resident bytes went down. */
int gpuos_share_ask(uint64_t excess, uint64_t want);
/* The same, the holder claiming `claim` bytes (>= want) of the room made: a turn's batch
 * whose parts are taken one by one as the evictions make their room; excess 0: only
 * wait for the evictions under way (0 if there are none). */
int gpuos_share_ask_claim(uint64_t excess, uint64_t want, uint64_t claim);
enum { GPUOS_SHARE_OUT, GPUOS_SHARE_BESIDE, GPUOS_SHARE_HOLDER };
int gpuos_share_role(void);       /* this member's place in the turn's set (GPUOS_SHARE_*) */
void gpuos_share_step_aside(void); /* beside the holder: leave its set */
void gpuos_share_unclaim(void);    /* the holder gives up the room it asked for */
void gpuos_share_working_set(uint64_t bytes);
void gpuos_share_done(void); /* the call's memory is resident: no longer busy */
uint64_t gpuos_share_release_asked(void); /* bytes the set asked this member to evict */
void gpuos_share_released(uint64_t asked, uint64_t done); /* ... and what was */

/* ---- agent.c ------------------------------------------------------------------------ */

/* The gate every exported wrapper passes (agent.c explains it): gpuos_hot.gate is 0 (open),
 * GPUOS_GATE_HELD (every wrapper waits) or GPUOS_GATE_FILLING (a restore on demand: the
 * application runs while the agent fills its movable memory; a call waits only for what it
 * touches). */
#define GPUOS_GATE_HELD 1
#define GPUOS_GATE_FILLING 2
#define GPUOS_GATE_RESIDENT 3 /* under --gpu-memory, for good: each call makes resident what it touches */
struct gpuos_gate_slot {
	int inside; /* wrappers of this thread in progress (only this thread writes it) */
	int used;   /* atomic: owned by a live thread */
} __attribute__((aligned(64)));
extern GPUOS_TLS struct gpuos_gate_slot *gpuos_tls_gate;
struct gpuos_gate_slot *gpuos_gate_slot_slow(void); /* NULL: no slot left, count the slow way */
void gpuos_gate_wait(struct gpuos_gate_slot *s, int hk);
void gpuos_gate_overflow_enter(int hk);
void gpuos_gate_overflow_exit(void);

/* hk: the wrapper's HK_ index (what it may touch, while filling) */
static inline struct gpuos_gate_slot *gpuos_gate_enter(int hk)
{
	struct gpuos_gate_slot *s = gpuos_tls_gate;
	if (unlikely(!s) && !(s = gpuos_gate_slot_slow())) {
		gpuos_gate_overflow_enter(hk);
		return NULL;
	}
	__atomic_store_n(&s->inside, s->inside + 1, __ATOMIC_RELAXED);
	/* no fence: the agent's membarrier orders this store before the load below */
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
	if (unlikely(__atomic_load_n(&gpuos_hot.gate, __ATOMIC_RELAXED)))
		gpuos_gate_wait(s, hk);
	return s;
}

extern GPUOS_TLS int gpuos_tls_res_held; /* resident.c: this call holds the scheduler's lock */
void gpuos_res_release(void);

static inline void gpuos_gate_exit(struct gpuos_gate_slot *s)
{
	if (unlikely(gpuos_tls_res_held) && (!s || s->inside == 1))
		gpuos_res_release(); /* the outermost wrapper: its real call is submitted */
	if (likely(s != NULL))
		__atomic_store_n(&s->inside, s->inside - 1, __ATOMIC_RELEASE);
	else
		gpuos_gate_overflow_exit();
}

/* While filling, the gate lets a launch, copy or memset through with this thread's
 * gpuos_tls_fill_check set: its handler (ops.c) must wait for the movable allocations it
 * touches before the real call, and clears it (gpuos_fill_checking).  What a wrapper
 * may touch, by its HK_ index (hooks.c). */
enum gpuos_fill_class {
	GPUOS_FILL_NEUTRAL, /* touches no existing device memory: goes on */
	GPUOS_FILL_PRECISE, /* its handler waits for the allocations it touches */
	GPUOS_FILL_ALL,     /* may touch any: waits until everything is filled */
};
int gpuos_hook_fill_class(int hk);
int gpuos_hook_res_class(int hk); /* the same, for the memory scheduler */
const char *gpuos_hook_name(int hk);
extern GPUOS_TLS int gpuos_tls_fill_check;
static inline int gpuos_fill_checking(void)
{
	if (likely(!gpuos_tls_fill_check))
		return 0;
	gpuos_tls_fill_check = 0;
	return 1;
}
/* Wait until the movable allocations holding ptrs (if any still being filled do) are
 * filled; under --gpu-memory, make them resident.  Not CUDA_SUCCESS: the call must fail
 * with that (they cannot be made resident). */
CUresult gpuos_fill_wait_ptrs(const uint64_t *ptrs, size_t n);
/* A launch's predicted buffers (lflags: its GPUOS_LAUNCH_* flags; an unknown layout
 * waits for everything). */
CUresult gpuos_fill_wait_bufs(const struct gpuos_rec_buf *b, uint32_t n, uint16_t lflags);
/* Wait until every movable allocation is filled (resident); `why` is counted and reported. */
CUresult gpuos_fill_wait_all(const char *why);

int gpuos_agent_start(void);    /* 0 or an errno: the agent's socket and thread */
/* Rest the gate at GPUOS_GATE_RESIDENT from now on; returns once every other thread that
 * passed it open has left its wrapper (resident.c: the allocations outgrew the limit). */
void gpuos_gate_resident(void);
/* ctl.c: close the control connection (no socket to an outside peer while CRIU dumps the
 * process), and connect again (a new hello with the same ring; nothing happens if `gpuos
 * run` is gone). */
void gpuos_ctl_detach(void);
void gpuos_ctl_reattach(void);
void gpuos_agent_forget(void);  /* fork child */

/* ---- objects.c, alloc.c, graph.c ------------------------------------------------------ */

/* An ALLOC or FREE record of a (base, end - base, ctx, aux, kind, device). */
void gpuos_alloc_record(uint16_t type, const struct gpuos_alloc *a, uint64_t stream);

void gpuos_obj_record(uint32_t objtype, uint16_t flags, uint64_t handle, uint64_t parent, uint32_t func_id);

#endif /* GPUOS_CORE_H */
