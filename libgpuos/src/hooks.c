/* SPDX-License-Identifier: MIT */
/*
 * hooks.c - how calls reach libgpuos, and how libgpuos reaches the real driver.
 *
 * Three ways into the driver, one table (hooktable.h):
 *   1. direct links: every table symbol is exported here with the driver's exact ABI,
 *      and LD_PRELOAD puts us first;
 *   2. dlsym: ours returns the wrapper for a table name whenever the real dlsym finds
 *      that name through the given handle (lookups that would fail still fail);
 *   3. cuGetProcAddress[_v2]: the real one answers, and when its pointer is the real
 *      address of a table symbol the caller gets that symbol's wrapper, so the exact ABI
 *      variant it asked for (_v2, _ptsz, ...) is kept.
 *
 * dlopen is not overridden: whoever loads libcuda.so.1 and however they do it, every
 * symbol they get from it passes through one of the three paths above, and our own
 * handle on the driver is opened lazily (GPUOS_REAL_LIBCUDA or libcuda.so.1: our
 * soname is libgpuos.so, so that dlopen finds the driver, not us).
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

void *gpuos_realfn[HK_COUNT];
int gpuos_resolved;
struct gpuos_drv gpuos_drv;

/* ---- the exported wrappers ------------------------------------------------------------ */

/* A wrapper runs before anything is initialised: resolving the real entry point is its
 * first step, and a symbol the driver lacks answers CUDA_ERROR_NOT_FOUND. */
#define X(name, pfn, handler, pt, params, args)                                            \
	GPUOS_EXPORT CUresult name params                                                  \
	{                                                                                  \
		pfn real = (pfn)gpuos_real_at(HK_##name);                                  \
		if (unlikely(!real))                                                       \
			return CUDA_ERROR_NOT_FOUND;                                       \
		struct gpuos_gate_slot *gate_ = gpuos_gate_enter(HK_##name);               \
		CUresult r_ = handler(real, pt, GPUOS_UNPAREN args);                       \
		gpuos_gate_exit(gate_);                                                    \
		return r_;                                                                 \
	}                                                                                  \
	_Static_assert(__builtin_types_compatible_p(__typeof__(&name), pfn),               \
		       #name " does not have the ABI of " #pfn);
#include "hooktable.h"
#undef X

static void *const hook_wrappers[HK_COUNT] = {
#define X(name, pfn, handler, pt, params, args) [HK_##name] = (void *)&name,
#include "hooktable.h"
#undef X
};

static const char *const hook_names[HK_COUNT] = {
#define X(name, pfn, handler, pt, params, args) [HK_##name] = #name,
#include "hooktable.h"
#undef X
};

const char *gpuos_hook_name(int hk)
{
	return hk >= 0 && hk < HK_COUNT ? hook_names[hk] : "?";
}

static int has_prefix(const char *s, const char *p)
{
	return strncmp(s, p, strlen(p)) == 0;
}

/* What a wrapper may touch while the agent fills movable memory (core.h), from its name:
 * launches, copies and memsets say what they touch (ops.c); these create or look up
 * things, or free what is not movable memory; anything else (frees, graph launches,
 * stream memory operations, batched copies, IPC, context teardown) may touch any
 * allocation. */
static const char *const fill_neutral[] = {
	"cuGetProcAddress", "cuInit", "cuMemAlloc", "cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister",
	"cuMemHostUnregister", "cuMemCreate", "cuMemAddressReserve", "cuModule", "cuLibrary",
	"cuKernelGetFunction", "cuStreamCreate", "cuStreamDestroy", "cuEventCreate", "cuEventDestroy",
	"cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate", "cuGraphExecDestroy",
	"cuGraphExecUpdate", "cuGraphExecKernelNodeSetParams",
};

int gpuos_hook_fill_class(int hk)
{
	const char *n = gpuos_hook_name(hk);
	if (has_prefix(n, "cuMemcpyBatch"))
		return GPUOS_FILL_ALL;
	if (has_prefix(n, "cuLaunch") || has_prefix(n, "cuMemcpy") || has_prefix(n, "cuMemset"))
		return GPUOS_FILL_PRECISE;
	for (size_t i = 0; i < sizeof fill_neutral / sizeof *fill_neutral; i++)
		if (has_prefix(n, fill_neutral[i]))
			return GPUOS_FILL_NEUTRAL;
	return GPUOS_FILL_ALL;
}

/* Under --gpu-memory (resident.c): launches, copies and memsets make resident what they
 * touch; these may touch any allocation, so they need all of it; anything else (frees,
 * synchronisation, context teardown, ...) touches no contents and goes on. */
static const char *const res_all[] = {
	"cuGraphLaunch", "cuMemcpyBatch", "cuStreamWriteValue",
};

int gpuos_hook_res_class(int hk)
{
	const char *n = gpuos_hook_name(hk);
	for (size_t i = 0; i < sizeof res_all / sizeof *res_all; i++)
		if (has_prefix(n, res_all[i]))
			return GPUOS_FILL_ALL;
	if (has_prefix(n, "cuLaunch") || has_prefix(n, "cuMemcpy") || has_prefix(n, "cuMemset"))
		return GPUOS_FILL_PRECISE;
	return GPUOS_FILL_NEUTRAL;
}

/* The unhooked writers (unhooked.h): their trampolines (unhooked_x86_64.S), names and
 * the driver's entry points. */
/* The trampolines under names of their own (cuda.h declares the real prototypes). */
#define U(name) extern const char uh_##name[] __asm__(#name) __attribute__((visibility("default")));
#include "unhooked.h"
#undef U
enum {
	UH_COUNT = 0
#define U(name) +1
#include "unhooked.h"
#undef U
};
static void *const unhooked_tramps[UH_COUNT] = {
#define U(name) (void *)uh_##name,
#include "unhooked.h"
#undef U
};
static const char *const unhooked_names[UH_COUNT] = {
#define U(name) #name,
#include "unhooked.h"
#undef U
};
static void *unhooked_real[UH_COUNT];

/* ---- names ------------------------------------------------------------------------------ */

typedef void *(*dlsym_fn)(void *, const char *);
/* The real dlsym; read by dlsym_x86_64.S, set once by gpuos_dlsym_init (racing threads
 * store the same value). */
__attribute__((visibility("hidden"))) dlsym_fn gpuos_real_dlsym;
#define real_dlsym gpuos_real_dlsym
static pthread_once_t names_once = PTHREAD_ONCE_INIT;
static uint16_t by_name[HK_COUNT];    /* indices sorted by exported name */
static char base_names[HK_COUNT][64]; /* exported names less _ptsz/_ptds and _vN */

static int cmp_by_name(const void *a, const void *b)
{
	return strcmp(hook_names[*(const uint16_t *)a], hook_names[*(const uint16_t *)b]);
}

static void base_name(char *out, size_t cap, const char *name)
{
	size_t n = strlen(name);
	if (n >= cap)
		n = cap - 1;
	memcpy(out, name, n);
	out[n] = 0;
	if (n > 5 && (!strcmp(out + n - 5, "_ptsz") || !strcmp(out + n - 5, "_ptds")))
		out[n -= 5] = 0;
	size_t d = n;
	while (d > 0 && out[d - 1] >= '0' && out[d - 1] <= '9')
		d--;
	if (d < n && d >= 2 && out[d - 1] == 'v' && out[d - 2] == '_')
		out[d - 2] = 0;
}

/* glibc's dlsym: GLIBC_2.34 since libdl merged into libc, GLIBC_2.2.5 before (x86-64's
 * base version; dlsym_x86_64.S is the only dlsym there is, so no other matters). */
/* Runs before a sanitizer runtime is initialised (its first dlsym): never instrumented. */
__attribute__((visibility("hidden"), no_sanitize_thread, no_sanitize_address))
dlsym_fn gpuos_dlsym_init(void)
{
	dlsym_fn f = __atomic_load_n(&gpuos_real_dlsym, __ATOMIC_ACQUIRE);
	if (!f)
		f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
	if (!f)
		f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	__atomic_store_n(&gpuos_real_dlsym, f, __ATOMIC_RELEASE);
	return f;
}

static void init_names(void)
{
	gpuos_dlsym_init();
	for (uint16_t i = 0; i < HK_COUNT; i++) {
		by_name[i] = i;
		base_name(base_names[i], sizeof base_names[i], hook_names[i]);
	}
	qsort(by_name, HK_COUNT, sizeof by_name[0], cmp_by_name);
}

/* The table index of an exported name, or -1. */
static int hook_index(const char *name)
{
	size_t lo = 0, hi = HK_COUNT;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		int c = strcmp(name, hook_names[by_name[mid]]);
		if (!c)
			return by_name[mid];
		if (c < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return -1;
}

/* ---- the real driver --------------------------------------------------------------------- */

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static GPUOS_TLS int tls_resolving;
static void *driver;

static struct {
	uintptr_t addr;
	uint16_t idx;
} by_addr[HK_COUNT + UH_COUNT]; /* real addresses, sorted; idx >= HK_COUNT: unhooked */
static size_t n_by_addr;

static const struct {
	size_t off;
	const char *name;
} drv_syms[] = {
#define DRV(field, name) { offsetof(struct gpuos_drv, field), name }
	DRV(driver_get_version, "cuDriverGetVersion"),
	DRV(ctx_get_current, "cuCtxGetCurrent"),
	DRV(ctx_get_device, "cuCtxGetDevice"),
	DRV(stream_is_capturing, "cuStreamIsCapturing"),
	DRV(func_get_param_info, "cuFuncGetParamInfo"),
	DRV(kernel_get_param_info, "cuKernelGetParamInfo"),
	DRV(func_get_name, "cuFuncGetName"),
	DRV(kernel_get_name, "cuKernelGetName"),
	DRV(graph_get_nodes, "cuGraphGetNodes"),
	DRV(graph_node_get_type, "cuGraphNodeGetType"),
	DRV(graph_kernel_node_get_params, "cuGraphKernelNodeGetParams_v2"),
	DRV(graph_memcpy_node_get_params, "cuGraphMemcpyNodeGetParams"),
	DRV(graph_memset_node_get_params, "cuGraphMemsetNodeGetParams"),
	DRV(graph_child_graph, "cuGraphChildGraphNodeGetGraph"),
	DRV(graph_mem_alloc_node_get_params, "cuGraphMemAllocNodeGetParams"),
	DRV(graph_mem_free_node_get_params, "cuGraphMemFreeNodeGetParams"),
	DRV(ctx_push, "cuCtxPushCurrent_v2"),
	DRV(ctx_pop, "cuCtxPopCurrent_v2"),
	DRV(ctx_sync, "cuCtxSynchronize"),
	DRV(ctx_get_id, "cuCtxGetId"),
	DRV(module_load_data, "cuModuleLoadData"),
	DRV(module_get_function, "cuModuleGetFunction"),
	DRV(stream_create, "cuStreamCreate"),
	DRV(stream_sync, "cuStreamSynchronize"),
	DRV(launch_kernel, "cuLaunchKernel"),
	DRV(mem_get_address_range, "cuMemGetAddressRange_v2"),
	DRV(mem_alloc, "cuMemAlloc_v2"),
	DRV(mem_free, "cuMemFree_v2"),
	DRV(memcpy_htod_async, "cuMemcpyHtoDAsync_v2"),
	DRV(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2"),
	DRV(get_error_name, "cuGetErrorName"),
	DRV(thread_exchange_capture_mode, "cuThreadExchangeStreamCaptureMode"),
	DRV(library_get_kernel, "cuLibraryGetKernel"),
	DRV(kernel_get_function, "cuKernelGetFunction"),
	DRV(func_load, "cuFuncLoad"),
	DRV(kernel_get_library, "cuKernelGetLibrary"),
	DRV(mem_get_allocation_granularity, "cuMemGetAllocationGranularity"),
	DRV(mem_address_reserve, "cuMemAddressReserve"),
	DRV(mem_address_free, "cuMemAddressFree"),
	DRV(mem_create, "cuMemCreate"),
	DRV(mem_release, "cuMemRelease"),
	DRV(mem_map, "cuMemMap"),
	DRV(mem_unmap, "cuMemUnmap"),
	DRV(mem_set_access, "cuMemSetAccess"),
	DRV(mem_export, "cuMemExportToShareableHandle"),
	DRV(mem_import, "cuMemImportFromShareableHandle"),
	DRV(mem_host_register, "cuMemHostRegister_v2"),
	DRV(mem_host_unregister, "cuMemHostUnregister"),
	DRV(stream_destroy, "cuStreamDestroy_v2"),
	DRV(memcpy_dtod_async, "cuMemcpyDtoDAsync_v2"),
	DRV(device_get_count, "cuDeviceGetCount"),
	DRV(device_can_access_peer, "cuDeviceCanAccessPeer"),
	DRV(event_create, "cuEventCreate"),
	DRV(event_record, "cuEventRecord"),
	DRV(event_query, "cuEventQuery"),
	DRV(event_sync, "cuEventSynchronize"),
	DRV(event_elapsed, "cuEventElapsedTime"),
	DRV(mem_alloc_managed, "cuMemAllocManaged"),
	DRV(mem_get_info, "cuMemGetInfo_v2"),
	DRV(mem_prefetch, "cuMemPrefetchAsync_v2"),
#undef DRV
};

static int cmp_by_addr(const void *a, const void *b)
{
	uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
	return x < y ? -1 : x > y;
}

static void do_resolve(void)
{
	pthread_once(&names_once, init_names);
	const char *path = getenv("GPUOS_REAL_LIBCUDA");
	if (!path || !*path)
		path = "libcuda.so.1";
	driver = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (!driver || !real_dlsym) {
		gpuos_dbg("cannot load the driver %s: %s", path, driver ? "no real dlsym" : dlerror());
		__atomic_store_n(&gpuos_resolved, 1, __ATOMIC_RELEASE);
		return;
	}
	for (size_t i = 0; i < HK_COUNT; i++) {
		gpuos_realfn[i] = real_dlsym(driver, hook_names[i]);
		if (gpuos_realfn[i]) {
			by_addr[n_by_addr].addr = (uintptr_t)gpuos_realfn[i];
			by_addr[n_by_addr++].idx = (uint16_t)i;
		}
	}
	for (size_t i = 0; i < UH_COUNT; i++) {
		unhooked_real[i] = real_dlsym(driver, unhooked_names[i]);
		if (unhooked_real[i]) {
			by_addr[n_by_addr].addr = (uintptr_t)unhooked_real[i];
			by_addr[n_by_addr++].idx = (uint16_t)(HK_COUNT + i);
		}
	}
	qsort(by_addr, n_by_addr, sizeof by_addr[0], cmp_by_addr);
	for (size_t i = 0; i < sizeof drv_syms / sizeof drv_syms[0]; i++)
		*(void **)((char *)&gpuos_drv + drv_syms[i].off) = real_dlsym(driver, drv_syms[i].name);
	dlerror(); /* the misses above are ours, not the application's */
	__atomic_store_n(&gpuos_resolved, 1, __ATOMIC_RELEASE);
}

void gpuos_resolve(void)
{
	/* A wrapper called from inside our dlopen of the driver (its constructors) finds
	 * nothing resolved yet and answers CUDA_ERROR_NOT_FOUND instead of deadlocking. */
	if (tls_resolving)
		return;
	tls_resolving = 1;
	pthread_once(&resolve_once, do_resolve);
	tls_resolving = 0;
}

/* ---- dlsym -------------------------------------------------------------------------------- */

/* dlsym itself is dlsym_x86_64.S; it asks here for every name starting with "cu".
 * For a table name, the answer is the wrapper exactly when the lookup would succeed
 * without libgpuos: a lookup that finds our own export (RTLD_DEFAULT, or a handle whose
 * scope includes us) is made again past us (RTLD_NEXT from here), which finds the
 * driver's symbol if the driver has one and fails, with dlerror set, if it does not.
 * An RTLD_NEXT lookup of a table name is made relative to libgpuos (preloaded, so
 * ahead of any driver). Returns 0 for names outside the table. */
__attribute__((visibility("hidden"))) int gpuos_dlsym_table(void *handle, const char *name, void **out)
{
	pthread_once(&names_once, init_names);
	int i = hook_index(name);
	void *ours = i >= 0 ? hook_wrappers[i] : NULL;
	for (size_t u = 0; !ours && u < UH_COUNT; u++)
		if (!strcmp(name, unhooked_names[u]))
			ours = unhooked_tramps[u];
	if (!ours)
		return 0;
	void *p = real_dlsym ? real_dlsym(handle, name) : NULL;
	if (p == ours)
		p = real_dlsym(RTLD_NEXT, name);
	*out = p ? ours : NULL;
	return 1;
}

/* Called by an unhooked writer's trampoline: the record is incomplete from now on; the
 * driver's entry point to go on to (NULL: the driver has none). */
__attribute__((visibility("hidden"))) void *gpuos_unhooked_used(int i)
{
	if (!__atomic_load_n(&gpuos_resolved, __ATOMIC_ACQUIRE))
		gpuos_resolve();
	int gate = __atomic_load_n(&gpuos_hot.gate, __ATOMIC_ACQUIRE);
	if (unlikely(gate == GPUOS_GATE_FILLING))
		gpuos_fill_wait_all(unhooked_names[i]);
	if (unlikely(gate == GPUOS_GATE_RESIDENT)) {
		/* No wrapper returns through here to keep the scheduler's lock to the call:
		 * everything resident now, and another thread's launch could evict before it. */
		gpuos_fill_wait_all(unhooked_names[i]);
		gpuos_res_release();
	}
	gpuos_track_incomplete(GPUOS_INCOMPLETE_UNHOOKED_WRITER,
			       "the application called %s, which writes device memory and is not "
			       "tracked", unhooked_names[i]);
	return unhooked_real[i];
}

/* ---- cuGetProcAddress ----------------------------------------------------------------------- */

static void *proc_swap(const char *symbol, void *p)
{
	size_t lo = 0, hi = n_by_addr;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (by_addr[mid].addr == (uintptr_t)p)
			return by_addr[mid].idx < HK_COUNT ? hook_wrappers[by_addr[mid].idx]
							   : unhooked_tramps[by_addr[mid].idx - HK_COUNT];
		if (by_addr[mid].addr < (uintptr_t)p)
			lo = mid + 1;
		else
			hi = mid;
	}
	for (size_t i = 0; symbol && i < HK_COUNT; i++) {
		if (!strcmp(symbol, base_names[i])) {
			GPUOS_COUNT(n_unmatched_procs, 1);
			gpuos_track_incomplete(GPUOS_INCOMPLETE_UNKNOWN_ENTRY,
					       "cuGetProcAddress(%s) gave an entry point that matches no "
					       "hooked variant: its calls are not seen", symbol);
			break;
		}
	}
	return p;
}

CUresult gpuos_h_get_proc(PFN_cuGetProcAddress_v11030 real, int pt, const char *symbol, void **pfn,
			  int driverVersion, cuuint64_t flags)
{
	(void)pt;
	gpuos_on(); /* the first driver call of a CUDA runtime: start here */
	CUresult r = real(symbol, pfn, driverVersion, flags);
	if (r == CUDA_SUCCESS && pfn && *pfn)
		*pfn = proc_swap(symbol, *pfn);
	return r;
}

CUresult gpuos_h_get_proc_v2(PFN_cuGetProcAddress_v12000 real, int pt, const char *symbol, void **pfn,
			     int driverVersion, cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
	(void)pt;
	gpuos_on();
	CUresult r = real(symbol, pfn, driverVersion, flags, symbolStatus);
	if (r == CUDA_SUCCESS && pfn && *pfn)
		*pfn = proc_swap(symbol, *pfn);
	return r;
}
