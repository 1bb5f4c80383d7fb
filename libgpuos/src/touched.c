/* SPDX-License-Identifier: MIT */
/*
 * touched.c - the bytes each launch touched, measured: ground truth for working sets
 * finer than an allocation (GPUOS_VALIDATE=touched, `gpuos run --record-touched`).
 *
 * Fingerprints (validate.c) show what a launch wrote, never what it read.  In this mode
 * the device memory of cuMemAlloc is managed memory instead (cuMemAllocManaged, same
 * size; its ALLOC record carries GPUOS_ALLOC_F_MEASURED), the validator moves every such
 * allocation to host memory before each launch (validate.c), and every page the launch
 * then touches faults on the GPU.  UVM records each fault in the event queue of a
 * tracker that this process binds to its own VA space through the stock driver's tools
 * interface (/dev/nvidia-uvm-tools; docs/notes-uvm-tools.md: no capability is checked,
 * the queue and control page are our own page-aligned memory).  Only the events that
 * matter are enabled: GPU faults, and those that mean a touch may have gone unseen (UVM
 * mapped pages remotely or throttled them as thrashing; the fault buffer overflowed).
 *
 * What it cannot see, from UVM's source: servicing a fault also migrates nearby pages of
 * the same 2 MiB VA block (prefetching), and a page touched after it came that way does
 * not fault.  So within a block the faulted pages are a subset of the touched ones; the
 * set of touched 2 MiB blocks is exact.
 *
 * Managed memory is only given while the measured allocations fit in the GPU memory that
 * was free at the first one (less a margin): never more managed memory than is free.
 * Past that, cuMemAlloc gives device memory as usual, unmeasured, and counts it.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"

/* UVM's ABI at 580.142 (kernel-open/nvidia-uvm; the Python twin is faults/uvm_tools.py). */
#define UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS 58 /* uvm_ioctl.h:847 */
#define UVM_TOOLS_INIT_EVENT_TRACKER_V2 76     /* uvm_ioctl.h:1094 */
#define EV_GPU_FAULT 3                         /* uvm_types.h:281-313 */
#define EV_FAULT_BUFFER_OVERFLOW 5
#define EV_THRASHING_DETECTED 10
#define EV_THROTTLING_START 11
#define EV_MAP_REMOTE 13
#define EV_TYPES_ALL 64
#define ENTRY_BYTES 72 /* UvmEventEntry_V2 */
#define QUEUE_ENTRIES (1u << 17) /* 9 MiB: a launch's faults until the next drain */
#define BUDGET_MARGIN (1ull << 30) /* GPU memory left free besides the measured */

struct uvm_init_tracker { /* UVM_TOOLS_INIT_EVENT_TRACKER_PARAMS, uvm_ioctl.h:823-832 */
	uint64_t queue;
	uint64_t queue_entries;
	uint64_t control;
	uint8_t processor[16];
	uint32_t all_processors;
	uint32_t uvm_fd;
	uint32_t rm_status;
	uint32_t pad;
};
_Static_assert(sizeof(struct uvm_init_tracker) == 56, "UVM_TOOLS_INIT_EVENT_TRACKER_PARAMS");

struct uvm_enable_events { /* uvm_ioctl.h:848-852 */
	uint64_t flags;
	uint32_t rm_status;
	uint32_t pad;
};

struct uvm_control { /* UvmToolsEventControlData, uvm_types.h:1401-1412 */
	uint32_t get_ahead, get_behind, put_ahead, put_behind;
	uint64_t dropped[EV_TYPES_ALL];
};
_Static_assert(sizeof(struct uvm_control) == 528, "UvmToolsEventControlData");

struct uvm_gpu_fault { /* UvmEventGpuFaultInfo_V2, uvm_types.h:629-677 */
	uint8_t event_type, fault_type;
	uint16_t gpu_index, gpc_id, client_id;
	uint64_t address, ts, ts_gpu;
	uint32_t batch;
	uint8_t client_type, access;
	uint16_t pad;
};
_Static_assert(sizeof(struct uvm_gpu_fault) == 40, "UvmEventGpuFaultInfo_V2");

/* One process, one VA space, one tracker; the validator's lock serialises its use. */
static struct {
	int state; /* 0: not tried, 1: tracking, -1: unavailable (why says) */
	char why[160];
	int tools_fd;
	uint8_t *queue;
	struct uvm_control *ctl;
	uint64_t dropped_seen;
} T = { .tools_fd = -1 };

/* The measured allocations' bytes and their budget (atomics: any thread allocates). */
static uint64_t managed_bytes, managed_budget, unmeasured_allocs;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(T.why, sizeof T.why, fmt, ap);
	va_end(ap);
	T.state = -1;
}

/* A tracker on the VA space of uvm file `fd` of this process; 0 or an errno (T.why). */
static int bind_tracker(int fd)
{
	struct uvm_init_tracker p = {
		.queue = (uint64_t)(uintptr_t)T.queue,
		.queue_entries = QUEUE_ENTRIES,
		.control = (uint64_t)(uintptr_t)T.ctl,
		.uvm_fd = (uint32_t)fd,
	};
	if (ioctl(T.tools_fd, UVM_TOOLS_INIT_EVENT_TRACKER_V2, &p))
		return errno;
	if (p.rm_status) /* 0x16: the file given to UVM_MM_INITIALIZE, not a VA space */
		return EINVAL;
	struct uvm_enable_events en = {
		.flags = 1ull << EV_GPU_FAULT | 1ull << EV_FAULT_BUFFER_OVERFLOW | 1ull << EV_THRASHING_DETECTED |
			 1ull << EV_THROTTLING_START | 1ull << EV_MAP_REMOTE,
	};
	if (ioctl(T.tools_fd, UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS, &en))
		return errno;
	return en.rm_status ? EINVAL : 0;
}

/* Once a context exists (the process's uvm file is open and initialised): 1 tracking. */
int gpuos_touched_tracker(const char **why)
{
	if (T.state) {
		*why = T.why;
		return T.state > 0;
	}
	size_t qbytes = (size_t)QUEUE_ENTRIES * ENTRY_BYTES;
	T.queue = mmap(NULL, qbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	T.ctl = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	T.tools_fd = open("/dev/nvidia-uvm-tools", O_RDWR | O_CLOEXEC);
	if (T.queue == MAP_FAILED || T.ctl == MAP_FAILED) {
		say("no memory for the UVM event queue");
	} else if (T.tools_fd < 0) {
		say("cannot open /dev/nvidia-uvm-tools: %s", strerror(errno));
	} else {
		/* The process's /dev/nvidia-uvm files: one is its VA space (the other, if any,
		 * was given to UVM_MM_INITIALIZE and is refused). */
		DIR *d = opendir("/proc/self/fd");
		int err = ENOENT;
		struct dirent *e;
		while (d && err && (e = readdir(d))) {
			char target[64];
			ssize_t n = readlinkat(dirfd(d), e->d_name, target, sizeof target - 1);
			if (n <= 0)
				continue;
			target[n] = 0;
			if (!strcmp(target, "/dev/nvidia-uvm"))
				err = bind_tracker(atoi(e->d_name));
		}
		if (d)
			closedir(d);
		if (err)
			say("no UVM event tracker on this process's VA space: %s", strerror(err));
		else
			T.state = 1;
	}
	if (T.state < 0) {
		if (T.tools_fd >= 0)
			close(T.tools_fd); /* before the unmap: the driver unpins then */
		T.tools_fd = -1;
	}
	*why = T.why;
	return T.state > 0;
}

static uint64_t dropped_total(void)
{
	uint64_t n = 0;
	for (int i = 0; i < EV_TYPES_ALL; i++)
		n += __atomic_load_n(&T.ctl->dropped[i], __ATOMIC_ACQUIRE);
	return n;
}

/* Read the queue up to what the driver has written.  With pages: each GPU fault's page
 * and access (GPUOS_TOUCH_*) appended; *flags gets GPUOS_TOUCHED_* for what may have gone
 * unseen.  Returns the faults read, or -1 without memory for them. */
int64_t gpuos_touched_drain(struct gpuos_touch_pages *pages, uint16_t *flags)
{
	const uint32_t mask = QUEUE_ENTRIES - 1;
	uint32_t get = __atomic_load_n(&T.ctl->get_behind, __ATOMIC_RELAXED) & mask;
	uint32_t put = __atomic_load_n(&T.ctl->put_behind, __ATOMIC_ACQUIRE) & mask;
	int64_t faults = 0;
	int nomem = 0;
	for (; get != put; get = (get + 1) & mask) {
		const uint8_t *ev = T.queue + (size_t)get * ENTRY_BYTES;
		switch (ev[0]) {
		case EV_GPU_FAULT: {
			struct uvm_gpu_fault f;
			memcpy(&f, ev, sizeof f);
			faults++;
			if (!pages)
				break;
			if (pages->n == pages->cap) {
				size_t cap = pages->cap ? pages->cap * 2 : 4096;
				struct gpuos_touch_page *v = realloc(pages->v, cap * sizeof *v);
				if (!v) {
					nomem = 1;
					break;
				}
				pages->v = v;
				pages->cap = cap;
			}
			pages->v[pages->n].page = f.address & ~(uint64_t)(GPUOS_TOUCH_PAGE - 1);
			pages->v[pages->n].access = f.access == 2 ? GPUOS_TOUCH_WRITE :
						    f.access == 3 ? GPUOS_TOUCH_ATOMIC :
						    f.access == 4 ? GPUOS_TOUCH_PREFETCH : GPUOS_TOUCH_READ;
			pages->n++;
			break;
		}
		case EV_THRASHING_DETECTED:
		case EV_THROTTLING_START:
		case EV_MAP_REMOTE:
			if (flags)
				*flags |= GPUOS_TOUCHED_REMOTE;
			break;
		case EV_FAULT_BUFFER_OVERFLOW:
			if (flags)
				*flags |= GPUOS_TOUCHED_DROPPED;
			break;
		}
	}
	__atomic_store_n(&T.ctl->get_ahead, put, __ATOMIC_RELAXED);
	__atomic_store_n(&T.ctl->get_behind, put, __ATOMIC_RELEASE);
	uint64_t dropped = dropped_total();
	if (dropped != T.dropped_seen && flags)
		*flags |= GPUOS_TOUCHED_DROPPED;
	T.dropped_seen = dropped;
	return nomem ? -1 : faults;
}

void gpuos_touched_forget(void)
{
	/* A forked child shares the parent's tracker file but not its VA space. */
	if (T.tools_fd >= 0)
		close(T.tools_fd);
	T.tools_fd = -1;
	T.state = 0;
}

/* ---- the managed stand-in for cuMemAlloc ------------------------------------------ */

int gpuos_touched_alloc(CUdeviceptr *dptr, size_t bytes, CUresult *res)
{
	if (!gpuos_drv.mem_alloc_managed || !gpuos_drv.mem_get_info)
		return 0;
	if (!__atomic_load_n(&managed_budget, __ATOMIC_ACQUIRE)) {
		size_t free_b = 0, total = 0;
		if (gpuos_drv.mem_get_info(&free_b, &total) != CUDA_SUCCESS)
			return 0;
		uint64_t budget = free_b > BUDGET_MARGIN ? free_b - BUDGET_MARGIN : 1;
		uint64_t zero = 0;
		__atomic_compare_exchange_n(&managed_budget, &zero, budget, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	}
	uint64_t now = __atomic_add_fetch(&managed_bytes, bytes, __ATOMIC_ACQ_REL);
	if (now > __atomic_load_n(&managed_budget, __ATOMIC_ACQUIRE)) {
		__atomic_sub_fetch(&managed_bytes, bytes, __ATOMIC_ACQ_REL);
		if (__atomic_fetch_add(&unmeasured_allocs, 1, __ATOMIC_ACQ_REL) == 0)
			fprintf(stderr, "gpuos: --record-touched: the measured allocations would exceed the GPU's free "
					"memory; later ones are plain device memory, not measured\n");
		return 0;
	}
	*res = gpuos_drv.mem_alloc_managed(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
	if (*res != CUDA_SUCCESS)
		__atomic_sub_fetch(&managed_bytes, bytes, __ATOMIC_ACQ_REL);
	return 1;
}

void gpuos_touched_freed(uint64_t bytes)
{
	__atomic_sub_fetch(&managed_bytes, bytes, __ATOMIC_ACQ_REL);
}
