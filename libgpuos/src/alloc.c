/* SPDX-License-Identifier: MIT */
/*
 * alloc.c - allocations and the VMM API: the allocation map and ALLOC/FREE records.
 *
 * An allocation enters the map after the real call succeeded.  A free takes it out
 * *before* the real call (and puts it back if the call fails): once the driver has
 * freed an address another thread may get it from its next allocation, and that
 * newer entry must not be the one removed.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

void gpuos_alloc_record(uint16_t type, const struct gpuos_alloc *a, uint64_t stream)
{
	struct gpuos_rec_alloc r;
	memset(&r, 0, sizeof r);
	r.base = a->base;
	r.size = a->end - a->base;
	r.ctx = a->ctx;
	r.stream = stream;
	/* aux is the VMM handle (movable memory's too); for graph allocations the map keeps a
	 * count there */
	int movable = !!(a->flags & GPUOS_A_MOVABLE);
	r.aux = a->kind == GPUOS_ALLOC_VMM_MAP || a->kind == GPUOS_ALLOC_VMM_CREATE || movable ? a->aux : 0;
	r.kind = a->kind;
	r.device = a->device;
	uint16_t flags = (movable ? GPUOS_ALLOC_F_MOVABLE : 0) | (a->flags & GPUOS_A_MEASURED ? GPUOS_ALLOC_F_MEASURED : 0);
	gpuos_ring_emit(type, flags, &r, sizeof r, NULL, 0);
	if (type == GPUOS_REC_ALLOC)
		GPUOS_COUNT(n_allocs, 1);
	else
		GPUOS_COUNT(n_frees, 1);
}

static int current_device(void)
{
	CUdevice d;
	if (gpuos_drv.ctx_get_device && gpuos_drv.ctx_get_device(&d) == CUDA_SUCCESS)
		return d;
	return -1;
}

static void insert(const struct gpuos_alloc *a, uint64_t stream)
{
	gpuos_write_lock_drained();
	int e = gpuos_map_insert(&gpuos_allocs, a);
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (!e && a->end > a->base)
		gpuos_alloc_record(GPUOS_REC_ALLOC, a, stream);
}

static void add(uint32_t kind, uint32_t flags, uint64_t base, uint64_t size, uint64_t stream)
{
	struct gpuos_alloc a = {
		.base = base,
		.end = base + size,
		.ctx = gpuos_current_ctx(),
		.kind = kind,
		.flags = flags,
		.device = flags & GPUOS_A_HOST ? -1 : current_device(),
	};
	insert(&a, stream);
}

/* Take the allocation at base out of m before freeing it; 1 if it was there. */
static int take(struct gpuos_map *m, uint64_t base, struct gpuos_alloc *out)
{
	gpuos_write_lock_drained();
	ssize_t i = gpuos_map_index(m, base);
	if (i >= 0) {
		*out = m->v[i];
		gpuos_map_remove_at(m, (size_t)i);
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	return i >= 0;
}

/* After the real free: the record, or the entry back if the free failed. */
static CUresult freed(struct gpuos_map *m, int had, const struct gpuos_alloc *a, uint64_t stream, CUresult r)
{
	if (!had)
		return r;
	if (r == CUDA_SUCCESS) {
		if (a->flags & GPUOS_A_MEASURED)
			gpuos_touched_freed(a->end - a->base);
		gpuos_alloc_record(GPUOS_REC_FREE, a, stream);
	} else {
		gpuos_write_lock_drained();
		gpuos_map_insert(m, a);
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
	return r;
}

/* ---- allocations --------------------------------------------------------------------------- */

CUresult gpuos_h_mem_alloc(PFN_cuMemAlloc_v3020 real, int pt, CUdeviceptr *dptr, size_t bytesize)
{
	(void)pt;
	int on = gpuos_on();
	struct gpuos_alloc a;
	CUresult r;
	if (on && dptr && gpuos_validating == GPUOS_VALIDATE_TOUCHED && gpuos_touched_alloc(dptr, bytesize, &r)) {
		if (r == CUDA_SUCCESS)
			add(GPUOS_ALLOC_DEVICE, GPUOS_A_DEVMEM | GPUOS_A_MEASURED, *dptr, bytesize, 0);
		return r;
	}
	if (on && dptr && gpuos_movable_alloc(dptr, bytesize, &a)) {
		insert(&a, 0);
		return CUDA_SUCCESS;
	}
	/* an MPS client's or its warm standby's start-up memory, shareable (sharemem.c) */
	if (!on && dptr && gpuos_sharemem_alloc(dptr, bytesize))
		return CUDA_SUCCESS;
	/* a warm standby, released: memory its client allocated at this point, made ahead
	 * (aheadmem.c: the driver's allocation may wait for a fault's teardown) */
	if (!on && dptr && __atomic_load_n(&gpuos_aheadmem_left, __ATOMIC_RELAXED) > 0 &&
	    gpuos_aheadmem_take(dptr, bytesize)) {
		gpuos_aheadmem_note(bytesize);
		return CUDA_SUCCESS;
	}
	r = real(dptr, bytesize);
	if (r == CUDA_SUCCESS)
		gpuos_aheadmem_note(bytesize); /* an MPS client's, for its standby */
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_DEVICE, GPUOS_A_DEVMEM, *dptr, bytesize, 0);
	return r;
}

CUresult gpuos_h_mem_alloc_pitch(PFN_cuMemAllocPitch_v3020 real, int pt, CUdeviceptr *dptr, size_t *pPitch,
				 size_t width, size_t height, unsigned int elem)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(dptr, pPitch, width, height, elem);
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_PITCH, GPUOS_A_DEVMEM, *dptr, *pPitch * height, 0);
	return r;
}

CUresult gpuos_h_mem_alloc_managed(PFN_cuMemAllocManaged_v6000 real, int pt, CUdeviceptr *dptr, size_t bytesize,
				   unsigned int flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(dptr, bytesize, flags);
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_MANAGED, GPUOS_A_MANAGED, *dptr, bytesize, 0);
	return r;
}

CUresult gpuos_h_mem_alloc_host(PFN_cuMemAllocHost_v3020 real, int pt, void **pp, size_t bytesize)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(pp, bytesize);
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_HOST, GPUOS_A_HOST, (uint64_t)(uintptr_t)*pp, bytesize, 0);
	return r;
}

CUresult gpuos_h_mem_host_alloc(PFN_cuMemHostAlloc_v2020 real, int pt, void **pp, size_t bytesize,
				unsigned int flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(pp, bytesize, flags);
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_HOST, GPUOS_A_HOST, (uint64_t)(uintptr_t)*pp, bytesize, 0);
	return r;
}

CUresult gpuos_h_mem_host_register(PFN_cuMemHostRegister_v6050 real, int pt, void *p, size_t bytesize,
				   unsigned int flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(p, bytesize, flags);
	if (on && r == CUDA_SUCCESS)
		add(GPUOS_ALLOC_HOST_REGISTERED, GPUOS_A_HOST, (uint64_t)(uintptr_t)p, bytesize, 0);
	return r;
}

/* Stream-ordered allocations and frees captured into a graph are its memory nodes:
 * they happen when the graph runs, and the graph's extraction accounts for them. */
static void add_async(CUresult r, CUdeviceptr *dptr, size_t bytesize, uint64_t stream)
{
	if (r == CUDA_SUCCESS && !gpuos_stream_captured(stream))
		add(GPUOS_ALLOC_ASYNC, GPUOS_A_DEVMEM, *dptr, bytesize, stream);
}

CUresult gpuos_h_mem_alloc_async(PFN_cuMemAllocAsync_v11020 real, int pt, CUdeviceptr *dptr, size_t bytesize,
				 CUstream st)
{
	if (!gpuos_on())
		return real(dptr, bytesize, st);
	CUresult r = real(dptr, bytesize, st);
	add_async(r, dptr, bytesize, gpuos_eff_stream(st, pt));
	return r;
}

CUresult gpuos_h_mem_alloc_from_pool_async(PFN_cuMemAllocFromPoolAsync_v11020 real, int pt, CUdeviceptr *dptr,
					   size_t bytesize, CUmemoryPool pool, CUstream st)
{
	if (!gpuos_on())
		return real(dptr, bytesize, pool, st);
	CUresult r = real(dptr, bytesize, pool, st);
	add_async(r, dptr, bytesize, gpuos_eff_stream(st, pt));
	return r;
}

/* ---- frees ----------------------------------------------------------------------------------- */

/* Take the allocation at dptr out of the map if tracking is on, or if it may be movable
 * memory (which outlives tracking: only gpuos can free it). */
static int take_device(CUdeviceptr dptr, struct gpuos_alloc *a)
{
	if (gpuos_on())
		return take(&gpuos_allocs, dptr, a);
	if (gpuos_memory_mode() != GPUOS_MEMORY_MOVABLE || !take(&gpuos_allocs, dptr, a))
		return 0;
	if (a->flags & GPUOS_A_MOVABLE)
		return 1;
	/* tracking went off after it was made: the entry would not be updated anyway */
	return 0;
}

CUresult gpuos_h_mem_free(PFN_cuMemFree_v3020 real, int pt, CUdeviceptr dptr)
{
	(void)pt;
	struct gpuos_alloc a;
	int had = take_device(dptr, &a);
	CUresult r;
	if (!had && gpuos_sharemem_free(dptr, &r))
		return r;
	r = had && (a.flags & GPUOS_A_MOVABLE) ? gpuos_movable_free(&a) : real(dptr);
	return freed(&gpuos_allocs, had, &a, 0, r);
}

CUresult gpuos_h_mem_free_async(PFN_cuMemFreeAsync_v11020 real, int pt, CUdeviceptr dptr, CUstream st)
{
	struct gpuos_alloc a;
	uint64_t stream = gpuos_eff_stream(st, pt);
	int had = !gpuos_stream_captured(stream) && take_device(dptr, &a);
	/* Movable memory is freed at once, after all the context's work (gpuos_movable_free
	 * waits for it): the stream's work so far, which may use it, included.  So is
	 * shareable start-up memory (sharemem.c). */
	CUresult r;
	if (!had && gpuos_sharemem_free(dptr, &r))
		return r;
	r = had && (a.flags & GPUOS_A_MOVABLE) ? gpuos_movable_free(&a) : real(dptr, st);
	return freed(&gpuos_allocs, had, &a, stream, r);
}

CUresult gpuos_h_mem_free_host(PFN_cuMemFreeHost_v2000 real, int pt, void *p)
{
	(void)pt;
	struct gpuos_alloc a;
	int had = gpuos_on() && take(&gpuos_allocs, (uint64_t)(uintptr_t)p, &a);
	return freed(&gpuos_allocs, had, &a, 0, real(p));
}

CUresult gpuos_h_mem_host_unregister(PFN_cuMemHostUnregister_v4000 real, int pt, void *p)
{
	(void)pt;
	struct gpuos_alloc a;
	int had = gpuos_on() && take(&gpuos_allocs, (uint64_t)(uintptr_t)p, &a);
	return freed(&gpuos_allocs, had, &a, 0, real(p));
}

/* ---- VMM ----------------------------------------------------------------------------------------- */

CUresult gpuos_h_mem_create(PFN_cuMemCreate_v10020 real, int pt, CUmemGenericAllocationHandle *handle,
			    size_t size, const CUmemAllocationProp *prop, unsigned long long flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(handle, size, prop, flags);
	if (!on || r != CUDA_SUCCESS)
		return r;
	int device = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
	gpuos_write_lock_drained();
	struct gpuos_obj *o = gpuos_obj_put(GPUOS_O_VMM, *handle);
	if (o) {
		o->u64 = size;
		o->parent = (uint64_t)(int64_t)device;
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	struct gpuos_alloc a = { .end = size, .ctx = gpuos_current_ctx(), .aux = *handle,
				 .kind = GPUOS_ALLOC_VMM_CREATE, .device = device };
	gpuos_alloc_record(GPUOS_REC_ALLOC, &a, 0);
	return r;
}

CUresult gpuos_h_mem_release(PFN_cuMemRelease_v10020 real, int pt, CUmemGenericAllocationHandle handle)
{
	(void)pt;
	struct gpuos_obj o;
	int had = 0;
	if (gpuos_on()) {
		gpuos_write_lock_drained();
		had = gpuos_obj_del(GPUOS_O_VMM, handle, &o);
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
	CUresult r = real(handle);
	if (!had)
		return r;
	if (r == CUDA_SUCCESS) {
		struct gpuos_alloc a = { .end = o.u64, .ctx = gpuos_current_ctx(), .aux = handle,
					 .kind = GPUOS_ALLOC_VMM_CREATE, .device = (int32_t)o.parent };
		gpuos_alloc_record(GPUOS_REC_FREE, &a, 0);
	} else {
		gpuos_write_lock_drained();
		struct gpuos_obj *n = gpuos_obj_put(GPUOS_O_VMM, handle);
		if (n)
			*n = o;
		pthread_rwlock_unlock(&gpuos_lock.v);
	}
	return r;
}

CUresult gpuos_h_mem_address_reserve(PFN_cuMemAddressReserve_v10020 real, int pt, CUdeviceptr *ptr, size_t size,
				     size_t alignment, CUdeviceptr addr, unsigned long long flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(ptr, size, alignment, addr, flags);
	if (!on || r != CUDA_SUCCESS)
		return r;
	struct gpuos_alloc a = { .base = *ptr, .end = *ptr + size, .ctx = gpuos_current_ctx(),
				 .kind = GPUOS_ALLOC_VMM_RESERVE, .device = -1 };
	gpuos_write_lock_drained();
	int e = gpuos_map_insert(&gpuos_reservations, &a);
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (!e)
		gpuos_alloc_record(GPUOS_REC_ALLOC, &a, 0);
	return r;
}

CUresult gpuos_h_mem_address_free(PFN_cuMemAddressFree_v10020 real, int pt, CUdeviceptr ptr, size_t size)
{
	(void)pt;
	struct gpuos_alloc a;
	int had = gpuos_on() && take(&gpuos_reservations, ptr, &a);
	return freed(&gpuos_reservations, had, &a, 0, real(ptr, size));
}

CUresult gpuos_h_mem_map(PFN_cuMemMap_v10020 real, int pt, CUdeviceptr ptr, size_t size, size_t offset,
			 CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(ptr, size, offset, handle, flags);
	if (!on || r != CUDA_SUCCESS)
		return r;
	struct gpuos_alloc a = { .base = ptr, .end = ptr + size, .ctx = gpuos_current_ctx(), .aux = handle,
				 .kind = GPUOS_ALLOC_VMM_MAP, .device = -1 };
	gpuos_write_lock_drained();
	struct gpuos_obj *o = gpuos_obj_get(GPUOS_O_VMM, handle);
	if (o)
		a.device = (int32_t)o->parent;
	int e = gpuos_map_insert(&gpuos_vmm_maps, &a);
	if (!e)
		gpuos_vmm_rebuild(a.base, a.end);
	pthread_rwlock_unlock(&gpuos_lock.v);
	if (!e)
		gpuos_alloc_record(GPUOS_REC_ALLOC, &a, 0);
	return r;
}

static void unmapped(const struct gpuos_alloc *part)
{
	gpuos_alloc_record(GPUOS_REC_FREE, part, 0);
}

CUresult gpuos_h_mem_unmap(PFN_cuMemUnmap_v10020 real, int pt, CUdeviceptr ptr, size_t size)
{
	(void)pt;
	int on = gpuos_on();
	/* The range stays reserved by the application: nobody else can map it meanwhile,
	 * so the map is updated after the real call. */
	CUresult r = real(ptr, size);
	if (!on || r != CUDA_SUCCESS)
		return r;
	gpuos_write_lock_drained();
	if (!gpuos_map_cut(&gpuos_vmm_maps, ptr, ptr + size, unmapped))
		gpuos_vmm_rebuild(ptr, ptr + size);
	pthread_rwlock_unlock(&gpuos_lock.v);
	return r;
}

CUresult gpuos_h_mem_set_access(PFN_cuMemSetAccess_v10020 real, int pt, CUdeviceptr ptr, size_t size,
				const CUmemAccessDesc *desc, size_t count)
{
	(void)pt;
	int on = gpuos_on();
	CUresult r = real(ptr, size, desc, count);
	if (!on || r != CUDA_SUCCESS)
		return r;
	int readable = 0;
	for (size_t i = 0; desc && i < count; i++)
		if (desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
			readable = 1;
	/* Mappings the call covers whole become device memory the validator may read. */
	gpuos_write_lock_drained();
	size_t n, i = gpuos_map_span(&gpuos_vmm_maps, ptr, ptr + size, &n);
	for (size_t j = i; j < i + n; j++) {
		struct gpuos_alloc *m = &gpuos_vmm_maps.v[j];
		if (m->base >= ptr && m->end <= ptr + size)
			m->flags = readable ? m->flags | GPUOS_A_DEVMEM : m->flags & ~GPUOS_A_DEVMEM;
	}
	gpuos_vmm_rebuild(ptr, ptr + size);
	pthread_rwlock_unlock(&gpuos_lock.v);
	return r;
}

/* ---- contexts --------------------------------------------------------------------------------- */

/* A destroyed context takes the driver's allocations made in it along; movable memory is
 * not the context's (VMM memory outlives it), so gpuos frees it here, while the context
 * still exists, as the driver would have.  Every entry of the context leaves the map
 * (its FREE recorded): a later context may get the same handle and the same addresses. */
CUresult gpuos_h_ctx_destroy(PFN_cuCtxDestroy_v4000 real, int pt, CUcontext ctx)
{
	(void)pt;
	int on = gpuos_on();
	if (!on && gpuos_memory_mode() != GPUOS_MEMORY_MOVABLE)
		return real(ctx);
	struct gpuos_alloc *gone = NULL;
	size_t n = 0, cap = 0;
	gpuos_write_lock_drained();
	for (size_t i = gpuos_allocs.n; i-- > 0;) {
		const struct gpuos_alloc *a = &gpuos_allocs.v[i];
		if (a->ctx != (uint64_t)(uintptr_t)ctx || (!on && !(a->flags & GPUOS_A_MOVABLE)))
			continue;
		if (n == cap) {
			size_t ncap = cap ? 2 * cap : 16;
			struct gpuos_alloc *g = realloc(gone, ncap * sizeof *g);
			if (!g)
				break; /* out of memory: the rest stay (and leak, as before) */
			gone = g;
			cap = ncap;
		}
		gone[n++] = *a;
		gpuos_map_remove_at(&gpuos_allocs, i);
	}
	pthread_rwlock_unlock(&gpuos_lock.v);
	CUcontext was;
	int pushed = n && gpuos_drv.ctx_push && gpuos_drv.ctx_push(ctx) == CUDA_SUCCESS;
	for (size_t i = 0; i < n; i++) {
		if ((gone[i].flags & GPUOS_A_MOVABLE) && pushed)
			gpuos_movable_free(&gone[i]);
		if (on)
			gpuos_alloc_record(GPUOS_REC_FREE, &gone[i], 0);
	}
	if (pushed)
		gpuos_drv.ctx_pop(&was);
	free(gone);
	return real(ctx);
}

