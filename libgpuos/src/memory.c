/* SPDX-License-Identifier: MIT */
/*
 * memory.c - movable device memory: the application's cuMemAlloc backed by the VMM API.
 *
 * Under `gpuos run` (GPUOS_MEMORY=movable, its default), a cuMemAlloc of at least the
 * device's allocation granularity (2 MiB on an H100) is served as:
 *   an address range reserved     cuMemAddressReserve(size rounded up to the granularity)
 *   physical memory               cuMemCreate(pinned, on the current device, exportable
 *                                 as a POSIX file descriptor)
 *   mapped read-write             cuMemMap + cuMemSetAccess at the start of the range.
 * The application holds the address and never sees another.  gpuos holds the physical
 * memory: it can unmap it, hand it to another process (cuMemExportToShareableHandle), and
 * map it, or new memory with the same contents, at the same address again.  That is what
 * a concurrent checkpoint, an on-demand restore and the memory scheduler move
 * (docs/design.md, "Movable memory").
 *
 * Smaller allocations stay the driver's: rounding them up would waste most of the
 * granularity, and together they are small.  So does any allocation whose VMM step fails
 * (counted in the ring header: n_movable_fallbacks); the application gets what the driver
 * would have given it.  Differences the application can see: cuMemGetAddressRange gives
 * the rounded size, and CUDA IPC (cuIpcGetMemHandle) refuses movable memory; a program
 * that shares device memory through CUDA IPC runs with `gpuos run --memory driver`.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"

#define MAX_DEVICES 64

static int mode = -1; /* GPUOS_MEMORY_*: read once, at the first allocation */
static size_t granularity[MAX_DEVICES]; /* 0: not asked yet; SIZE_MAX: no VMM on that device */

int gpuos_memory_mode(void)
{
	int m = __atomic_load_n(&mode, __ATOMIC_RELAXED);
	if (m >= 0)
		return m;
	const char *e = getenv("GPUOS_MEMORY");
	m = e && !strcmp(e, "movable") ? GPUOS_MEMORY_MOVABLE : GPUOS_MEMORY_DRIVER;
	__atomic_store_n(&mode, m, __ATOMIC_RELAXED);
	struct gpuos_ring_hdr *h = gpuos_ring_hdr();
	if (h)
		__atomic_store_n(&h->memory_mode, (uint32_t)m, __ATOMIC_RELAXED);
	return m;
}

static void movable_prop(CUmemAllocationProp *p, int device)
{
	memset(p, 0, sizeof *p);
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = device;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

/* The device's VMM granularity; SIZE_MAX where it has none (or the driver lacks the API). */
size_t gpuos_movable_granularity(int device)
{
	if (device < 0 || device >= MAX_DEVICES)
		return SIZE_MAX;
	size_t g = __atomic_load_n(&granularity[device], __ATOMIC_RELAXED);
	if (g)
		return g;
	CUmemAllocationProp prop;
	movable_prop(&prop, device);
	if (!gpuos_drv.mem_get_allocation_granularity || !gpuos_drv.mem_address_reserve ||
	    !gpuos_drv.mem_create || !gpuos_drv.mem_map || !gpuos_drv.mem_set_access ||
	    !gpuos_drv.mem_unmap || !gpuos_drv.mem_release || !gpuos_drv.mem_address_free ||
	    gpuos_drv.mem_get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
	    !g || (g & (g - 1)))
		g = SIZE_MAX;
	__atomic_store_n(&granularity[device], g, __ATOMIC_RELAXED);
	return g;
}

size_t gpuos_movable_reserved(const struct gpuos_alloc *a)
{
	size_t g = gpuos_movable_granularity(a->device);
	size_t n = a->end - a->base;
	return g == SIZE_MAX ? n : (n + g - 1) & ~(g - 1);
}

/* Who may access movable memory on `device`: the device, and every device that can reach
 * it peer to peer.  The driver's own allocations are reachable from a peer once the
 * program enables peer access (cuCtxEnablePeerAccess, as PyTorch does for copies between
 * its GPUs); VMM memory is reachable only by the devices cuMemSetAccess names (measured on
 * 2 x H200: without the peers, a PyTorch copy between GPUs failed).  So every peer that
 * could be given access is, from the start.  The list, computed once per device. */
static CUmemAccessDesc accessors[MAX_DEVICES][MAX_DEVICES];
static int naccess[MAX_DEVICES]; /* 0: not computed */

size_t gpuos_movable_access(int device, const CUmemAccessDesc **out)
{
	if (device < 0 || device >= MAX_DEVICES)
		return 0;
	int n = __atomic_load_n(&naccess[device], __ATOMIC_ACQUIRE);
	if (!n) {
		CUmemAccessDesc *d = accessors[device];
		d[n++] = (CUmemAccessDesc){ .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device },
					    .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
		int count = 0;
		if (gpuos_drv.device_get_count && gpuos_drv.device_can_access_peer &&
		    gpuos_drv.device_get_count(&count) == CUDA_SUCCESS)
			for (int peer = 0; peer < count && peer < MAX_DEVICES; peer++) {
				int can = 0;
				if (peer != device && gpuos_drv.device_can_access_peer(&can, peer, device) == CUDA_SUCCESS && can)
					d[n++] = (CUmemAccessDesc){ .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = peer },
								    .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
			}
		__atomic_store_n(&naccess[device], n, __ATOMIC_RELEASE);
	}
	*out = accessors[device];
	return (size_t)n;
}

CUresult gpuos_movable_map_new(uint64_t va, size_t size, int device, CUmemGenericAllocationHandle *out)
{
	return gpuos_movable_map_timed(va, size, device, out, NULL);
}

CUresult gpuos_movable_map_timed(uint64_t va, size_t size, int device, CUmemGenericAllocationHandle *out,
				 struct gpuos_map_times *t)
{
	CUmemAllocationProp prop;
	movable_prop(&prop, device);
	CUmemGenericAllocationHandle h;
	uint64_t t0 = t ? gpuos_now_ns() : 0;
	CUresult r = gpuos_drv.mem_create(&h, size, &prop, 0);
	if (t)
		t->create_ns += gpuos_now_ns() - t0;
	if (r != CUDA_SUCCESS)
		return r;
	r = gpuos_drv.mem_map(va, size, 0, h, 0);
	if (r != CUDA_SUCCESS) {
		gpuos_drv.mem_release(h);
		return r;
	}
	const CUmemAccessDesc *acc;
	size_t nacc = gpuos_movable_access(device, &acc);
	t0 = t ? gpuos_now_ns() : 0;
	r = gpuos_drv.mem_set_access(va, size, acc, nacc);
	if (t)
		t->access_ns += gpuos_now_ns() - t0;
	if (r != CUDA_SUCCESS) {
		gpuos_drv.mem_unmap(va, size);
		gpuos_drv.mem_release(h);
		return r;
	}
	*out = h;
	return CUDA_SUCCESS;
}

int gpuos_movable_alloc(CUdeviceptr *dptr, size_t bytes, struct gpuos_alloc *a)
{
	if (gpuos_memory_mode() != GPUOS_MEMORY_MOVABLE)
		return 0;
	CUdevice dev;
	if (!gpuos_drv.ctx_get_device || gpuos_drv.ctx_get_device(&dev) != CUDA_SUCCESS)
		return 0;
	size_t g = gpuos_movable_granularity(dev);
	if (g == SIZE_MAX || bytes < g || bytes > SIZE_MAX - g)
		return 0;
	size_t size = (bytes + g - 1) & ~(g - 1);
	CUdeviceptr va;
	CUmemGenericAllocationHandle h = 0;
	if (gpuos_drv.mem_address_reserve(&va, size, 0, 0, 0) != CUDA_SUCCESS)
		goto fallback;
	if (gpuos_res_limit()) {
		/* Under --gpu-memory only the range: physical memory when a call touches it
		 * (resident.c).  Its handle is resident.c's. */
		if (gpuos_res_add(va, size, dev, gpuos_current_ctx())) {
			gpuos_drv.mem_address_free(va, size);
			goto fallback;
		}
	} else if (gpuos_movable_map_new(va, size, dev, &h) != CUDA_SUCCESS) {
		gpuos_drv.mem_address_free(va, size);
		goto fallback;
	}
	*dptr = va;
	*a = (struct gpuos_alloc){ .base = va, .end = va + bytes, .ctx = gpuos_current_ctx(), .aux = h,
				   .kind = GPUOS_ALLOC_DEVICE,
				   .flags = GPUOS_A_DEVMEM | GPUOS_A_MOVABLE, .device = dev };
	GPUOS_COUNT(movable_bytes, size);
	return 1;
fallback:
	/* Out of memory with the rounding, or a driver without VMM for this device: the
	 * driver's own allocation, as without gpuos. */
	GPUOS_COUNT(n_movable_fallbacks, 1);
	return 0;
}

CUresult gpuos_vmm_free(uint64_t va, size_t size, CUmemGenericAllocationHandle h)
{
	/* cuMemFree waits for the work that may still use the memory; cuMemUnmap does not. */
	CUresult r = gpuos_drv.ctx_sync ? gpuos_drv.ctx_sync() : CUDA_SUCCESS;
	if (r != CUDA_SUCCESS)
		return r;
	if (h) {
		r = gpuos_drv.mem_unmap(va, size);
		if (r != CUDA_SUCCESS)
			return r;
		gpuos_drv.mem_release(h);
	}
	gpuos_drv.mem_address_free(va, size);
	return CUDA_SUCCESS;
}

CUresult gpuos_movable_free(const struct gpuos_alloc *a)
{
	size_t size = gpuos_movable_reserved(a);
	CUmemGenericAllocationHandle h = gpuos_res_limit() ? gpuos_res_forget(a->base) : a->aux;
	CUresult r = gpuos_vmm_free(a->base, size, h);
	if (r == CUDA_SUCCESS)
		GPUOS_COUNT(movable_bytes, -(uint64_t)size);
	return r;
}

/* CUDA IPC cannot share VMM memory: the driver refuses it.  The program would fail with
 * only the driver's error, so say once, on stderr, what to do about it. */
CUresult gpuos_h_ipc_get_mem_handle(PFN_cuIpcGetMemHandle_v4010 real, int pt, CUipcMemHandle *h, CUdeviceptr p)
{
	(void)pt;
	CUresult r = real(h, p);
	if (r == CUDA_SUCCESS || gpuos_memory_mode() != GPUOS_MEMORY_MOVABLE)
		return r;
	pthread_rwlock_rdlock(&gpuos_lock.v);
	const struct gpuos_alloc *a = gpuos_map_find(&gpuos_allocs, p);
	int movable = a && (a->flags & GPUOS_A_MOVABLE);
	pthread_rwlock_unlock(&gpuos_lock.v);
	static int said;
	if (movable && !__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
		fprintf(stderr, "gpuos: cuIpcGetMemHandle: this memory is gpuos's movable memory, which CUDA IPC "
				"cannot share; run the program with `gpuos run --memory driver`\n");
	return r;
}

