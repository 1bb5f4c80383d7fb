/* SPDX-License-Identifier: MIT */
/*
 * objects.c - modules, libraries, functions and kernels, streams, events, and stream
 * capture: the handle table and OBJECT records.
 *
 * Unloading a module or library forgets its functions and kernels (their handles may
 * come back for other code: the function table id, not the handle, names a function).
 * Stream capture is only counted: while any capture is in progress the operations ask
 * the driver whether their stream is capturing, and only then.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

void gpuos_obj_record(uint32_t objtype, uint16_t flags, uint64_t handle, uint64_t parent, uint32_t func_id)
{
	struct gpuos_rec_object r;
	memset(&r, 0, sizeof r);
	r.handle = handle;
	r.parent = parent;
	r.objtype = objtype;
	r.func_id = func_id;
	gpuos_ring_emit(GPUOS_REC_OBJECT, flags, &r, sizeof r, NULL, 0);
}

/* A new object of the table (kind) and its OBJECT record (objtype). */
static void created(uint32_t kind, uint32_t objtype, uint64_t handle, uint64_t parent)
{
	pthread_rwlock_wrlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_put(kind, handle);
	if (o)
		o->parent = parent;
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (o)
		gpuos_obj_record(objtype, GPUOS_OBJ_CREATED, handle, parent, GPUOS_NO_FUNC);
}

static void destroyed(uint32_t kind, uint32_t objtype, uint64_t handle)
{
	struct gpuos_obj o;
	pthread_rwlock_wrlock(&gpuos_lock.v);
	int had = gpuos_obj_del(kind, handle, &o);
	pthread_rwlock_unlock(&gpuos_lock.v);
	gpuos_obj_record(objtype, GPUOS_OBJ_DESTROYED, handle, had ? o.parent : 0, GPUOS_NO_FUNC);
}

#define H(x) ((uint64_t)(uintptr_t)(x))

/* ---- modules and libraries ------------------------------------------------------------------- */

static CUresult module_loaded(int on, CUresult r, CUmodule *m)
{
	if (r == CUDA_SUCCESS)
		gpuos_preload_code(H(*m), 1, 1);
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_MODULE, GPUOS_OBJ_MODULE, H(*m), 0);
	return r;
}

CUresult gpuos_h_module_load(PFN_cuModuleLoad_v2000 real, int pt, CUmodule *m, const char *fname)
{
	(void)pt;
	int on = gpuos_on();
	return module_loaded(on, real(m, fname), m);
}

CUresult gpuos_h_module_load_data(PFN_cuModuleLoadData_v2000 real, int pt, CUmodule *m, const void *image)
{
	(void)pt;
	int on = gpuos_on();
	uint64_t t0 = gpuos_now_ns();
	CUresult r = real(m, image);
	gpuos_preload_debug_load("cuModuleLoadData", image, t0);
	return module_loaded(on, r, m);
}

CUresult gpuos_h_module_load_data_ex(PFN_cuModuleLoadDataEx_v2010 real, int pt, CUmodule *m, const void *image,
				     unsigned int n, CUjit_option *options, void **values)
{
	(void)pt;
	int on = gpuos_on();
	uint64_t t0 = gpuos_now_ns();
	CUresult r = real(m, image, n, options, values);
	gpuos_preload_debug_load("cuModuleLoadDataEx", image, t0);
	return module_loaded(on, r, m);
}

CUresult gpuos_h_module_load_fat_binary(PFN_cuModuleLoadFatBinary_v2000 real, int pt, CUmodule *m,
					const void *fatCubin)
{
	(void)pt;
	int on = gpuos_on();
	uint64_t t0 = gpuos_now_ns();
	CUresult r = real(m, fatCubin);
	gpuos_preload_debug_load("cuModuleLoadFatBinary", fatCubin, t0);
	return module_loaded(on, r, m);
}

static int child_of(const struct gpuos_obj *o, void *parent)
{
	return o->parent == H(parent) && (o->kind == GPUOS_O_FN || o->kind == GPUOS_O_MODULE);
}

static int fn_of_library_module(const struct gpuos_obj *o, void *lib)
{
	if (o->kind != GPUOS_O_FN || !o->parent)
		return 0;
	const struct gpuos_obj *m = gpuos_obj_get(GPUOS_O_MODULE, o->parent);
	return m && m->parent == H(lib);
}

static void forget_fn(struct gpuos_obj *o)
{
	if (o->kind == GPUOS_O_FN)
		free(o->ptr);
}

/* Forget the functions, kernels and modules of a module or library, then itself. */
static void unloaded(uint32_t kind, uint32_t objtype, uint64_t handle)
{
	gpuos_write_lock_drained(); /* queued launches may be of these functions */
	__atomic_add_fetch(&gpuos_hot.fn_gen, 1, __ATOMIC_RELEASE); /* threads' cached entries go */
	if (kind == GPUOS_O_LIBRARY)
		gpuos_obj_sweep(fn_of_library_module, forget_fn, (void *)(uintptr_t)handle);
	gpuos_obj_sweep(child_of, forget_fn, (void *)(uintptr_t)handle);
	pthread_rwlock_unlock(&gpuos_lock.v);
	destroyed(kind, objtype, handle);
}

CUresult gpuos_h_module_unload(PFN_cuModuleUnload_v2000 real, int pt, CUmodule hmod)
{
	(void)pt;
	int on = gpuos_on();
	gpuos_preload_code(H(hmod), 1, 0); /* before the driver forgets it */
	CUresult r = real(hmod);
	if (on && r == CUDA_SUCCESS)
		unloaded(GPUOS_O_MODULE, GPUOS_OBJ_MODULE, H(hmod));
	return r;
}

CUresult gpuos_h_module_get_function(PFN_cuModuleGetFunction_v2000 real, int pt, CUfunction *hfunc,
				     CUmodule hmod, const char *name)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(hfunc, hmod, name);
	if (on && r == CUDA_SUCCESS)
		gpuos_fn_ensure(H(*hfunc), GPUOS_HINT_FUNCTION, H(hmod));
	return r;
}

CUresult gpuos_h_library_load_data(PFN_cuLibraryLoadData_v12000 real, int pt, CUlibrary *lib, const void *code,
				   CUjit_option *jo, void **jv, unsigned int nj, CUlibraryOption *lo, void **lv,
				   unsigned int nl)
{
	(void)pt;
	int on = gpuos_on();
	uint64_t t0 = gpuos_now_ns();
	CUresult r;
	if (lib && gpuos_preload_take(code, nj, lo, lv, nl, lib)) {
		r = CUDA_SUCCESS; /* loaded ahead by this standby (preload.c), known there */
	} else {
		r = real(lib, code, jo, jv, nj, lo, lv, nl);
		gpuos_preload_debug_load("cuLibraryLoadData", code, t0);
		if (r == CUDA_SUCCESS)
			gpuos_preload_library(H(*lib), code, nj, lo, lv, nl);
	}
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_LIBRARY, GPUOS_OBJ_LIBRARY, H(*lib), 0);
	return r;
}

CUresult gpuos_h_library_load_from_file(PFN_cuLibraryLoadFromFile_v12000 real, int pt, CUlibrary *lib,
					const char *file, CUjit_option *jo, void **jv, unsigned int nj,
					CUlibraryOption *lo, void **lv, unsigned int nl)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(lib, file, jo, jv, nj, lo, lv, nl);
	if (r == CUDA_SUCCESS)
		gpuos_preload_code(H(*lib), 0, 1);
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_LIBRARY, GPUOS_OBJ_LIBRARY, H(*lib), 0);
	return r;
}

CUresult gpuos_h_library_unload(PFN_cuLibraryUnload_v12000 real, int pt, CUlibrary lib)
{
	(void)pt;
	int on = gpuos_on();
	gpuos_preload_code(H(lib), 0, 0); /* before the driver forgets it */
	CUresult r = real(lib);
	if (on && r == CUDA_SUCCESS)
		unloaded(GPUOS_O_LIBRARY, GPUOS_OBJ_LIBRARY, H(lib));
	return r;
}

CUresult gpuos_h_library_get_kernel(PFN_cuLibraryGetKernel_v12000 real, int pt, CUkernel *k, CUlibrary lib,
				    const char *name)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(k, lib, name);
	if (on && r == CUDA_SUCCESS)
		gpuos_fn_ensure(H(*k), GPUOS_HINT_KERNEL, H(lib));
	return r;
}

CUresult gpuos_h_library_get_module(PFN_cuLibraryGetModule_v12000 real, int pt, CUmodule *m, CUlibrary lib)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(m, lib);
	if (!on || r != CUDA_SUCCESS)
		return r;
	pthread_rwlock_rdlock(&gpuos_lock.v);
	int known = gpuos_obj_get(GPUOS_O_MODULE, H(*m)) != NULL;
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (!known)
		created(GPUOS_O_MODULE, GPUOS_OBJ_MODULE, H(*m), H(lib));
	return r;
}

CUresult gpuos_h_kernel_get_function(PFN_cuKernelGetFunction_v12000 real, int pt, CUfunction *f, CUkernel k)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(f, k);
	if (r == CUDA_SUCCESS)
		gpuos_preload_function(H(*f), H(k));
	if (!on || r != CUDA_SUCCESS)
		return r;
	/* The function goes with the kernel's library (forgotten when it is unloaded). */
	pthread_rwlock_rdlock(&gpuos_lock.v);
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_FN, H(k));
	uint64_t lib = o ? o->parent : 0;
	pthread_rwlock_unlock(&gpuos_lock.v);
	gpuos_fn_ensure(H(*f), GPUOS_HINT_FUNCTION, lib);
	return r;
}

/* ---- streams and events --------------------------------------------------------------------- */

CUresult gpuos_h_stream_create(PFN_cuStreamCreate_v2000 real, int pt, CUstream *s, unsigned int flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(s, flags);
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_STREAM, GPUOS_OBJ_STREAM, H(*s), gpuos_current_ctx());
	return r;
}

CUresult gpuos_h_stream_create_with_priority(PFN_cuStreamCreateWithPriority_v5050 real, int pt, CUstream *s,
					     unsigned int flags, int priority)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(s, flags, priority);
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_STREAM, GPUOS_OBJ_STREAM, H(*s), gpuos_current_ctx());
	return r;
}

CUresult gpuos_h_stream_destroy(PFN_cuStreamDestroy_v4000 real, int pt, CUstream s)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(s);
	if (on && r == CUDA_SUCCESS)
		destroyed(GPUOS_O_STREAM, GPUOS_OBJ_STREAM, H(s));
	return r;
}

CUresult gpuos_h_event_create(PFN_cuEventCreate_v2000 real, int pt, CUevent *e, unsigned int flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(e, flags);
	if (on && r == CUDA_SUCCESS)
		created(GPUOS_O_EVENT, GPUOS_OBJ_EVENT, H(*e), gpuos_current_ctx());
	return r;
}

CUresult gpuos_h_event_destroy(PFN_cuEventDestroy_v4000 real, int pt, CUevent e)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(e);
	if (on && r == CUDA_SUCCESS)
		destroyed(GPUOS_O_EVENT, GPUOS_OBJ_EVENT, H(e));
	return r;
}

/* ---- stream capture ---------------------------------------------------------------------- */

static CUresult capture_began(int on, CUresult r)
{
	if (on && r == CUDA_SUCCESS)
		__atomic_add_fetch(&gpuos_hot.capturing, 1, __ATOMIC_RELAXED);
	return r;
}

CUresult gpuos_h_begin_capture(PFN_cuStreamBeginCapture_v10010 real, int pt, CUstream s,
			       CUstreamCaptureMode mode)
{
	(void)pt;
	int on = gpuos_on();
	return capture_began(on, real(s, mode));
}

CUresult gpuos_h_begin_capture_v1(gpuos_pfn_cuStreamBeginCapture_v10000 real, int pt, CUstream s)
{
	(void)pt;
	int on = gpuos_on();
	return capture_began(on, real(s));
}

CUresult gpuos_h_begin_capture_to_graph(PFN_cuStreamBeginCaptureToGraph_v12030 real, int pt, CUstream s,
					CUgraph g, const CUgraphNode *deps, const CUgraphEdgeData *data, size_t n,
					CUstreamCaptureMode mode)
{
	(void)pt;
	int on = gpuos_on();
	return capture_began(on, real(s, g, deps, data, n, mode));
}

CUresult gpuos_h_end_capture(PFN_cuStreamEndCapture_v10000 real, int pt, CUstream s, CUgraph *g)
{
	/* Ending a capture ends it even when the capture was invalidated (the call then
	 * fails): what counts is whether the stream was capturing before. */
	int was = gpuos_on() && gpuos_stream_captured(gpuos_eff_stream(s, pt));
	CUresult r = real(s, g);
	if (was) {
		int n = __atomic_load_n(&gpuos_hot.capturing, __ATOMIC_RELAXED);
		while (n > 0 && !__atomic_compare_exchange_n(&gpuos_hot.capturing, &n, n - 1, 0, __ATOMIC_RELAXED,
							     __ATOMIC_RELAXED))
			;
	}
	return r;
}
