/* SPDX-License-Identifier: MIT */
/*
 * gpuos_agent.h - gpuos's commands to libgpuos inside a process: the movable-memory agent.
 *
 * A process under `gpuos run --memory movable` (libgpuos/src/memory.c) serves this
 * protocol from its agent thread (libgpuos/src/agent.c), on an abstract unix stream
 * socket named "gpuos-agent-<pid>" (sun_path = "\0gpuos-agent-<pid>").  A client must be
 * root or the process's uid (SO_PEERCRED); one client at a time.  Each request is one
 * struct gpuos_agent_req; each gets one struct gpuos_agent_reply, followed by `count`
 * entries for LIST, or carrying file descriptors (SCM_RIGHTS) for EXPORT.  Descriptors
 * sent with MAP travel with the request.  status is 0 or an errno; msg says why.
 *
 *   HOLD     Every thread that enters a CUDA driver call libgpuos wraps waits at its
 *            entry; calls already inside finish; then every context with movable memory
 *            is synchronized.  From here on nothing changes device memory, and the
 *            allocation map stands still.  Reply: count = movable allocations, bytes =
 *            their physical bytes.  Nests: one HOLD, one RESUME.  arg may have
 *            GPUOS_AGENT_HOLD_DETACH: the connection to `gpuos run` is closed too (CRIU
 *            cannot dump a socket connected outside the process) and made again at RESUME.
 *   LIST     (held) count entries struct gpuos_agent_alloc, in the map's order (by
 *            address): the order CAPTURE, EXPORT, MAP and FILL use.
 *   PREPARE  the memfd sent with the request (arg = its bytes) becomes the staging area:
 *            mapped shared and registered with the driver (its pages pinned: seconds for
 *            gigabytes, so before HOLD).  Reply: ns, arg = 1 if registered (else the copies
 *            are the driver's slower pageable ones).  UNPREPARE (or closing the connection)
 *            unregisters and unmaps it: before a dump.
 *   CAPTURE  (held, prepared) every allocation's physical memory (`reserved` bytes) copied
 *            into the staging area back to back, in LIST order, on the agent's own streams.
 *            Reply: bytes, ns.
 *   EXPORT   (held) the physical memory of every allocation as a POSIX fd, in LIST
 *            order, GPUOS_AGENT_FDS_PER_MSG per reply message: count says how many follow
 *            in this one, arg of the last is 1.
 *   RELEASE  (held) every allocation's physical memory unmapped and released; the
 *            address ranges stay reserved.  The process now holds no movable memory:
 *            only descriptors held elsewhere (EXPORT) keep it.
 *   MAP      (held, released) one fd per allocation in LIST order with the request (in as
 *            many requests as needed, arg = index of the first): imported, mapped at the
 *            same address, made read-write.  With arg | GPUOS_AGENT_SHADOWS: imported as
 *            the shadows (addresses of the agent's own), a snapshot handed out coming back
 *            or (held, no snapshot) memory filled outside the process, from which
 *            FILL_PARTS copies on the device (a restore's prefill); DROP lets them go.
 *   FILL     (held, released, prepared) new physical memory for every allocation, mapped
 *            at the same address, filled from the staging area (laid out as CAPTURE writes
 *            it); with arg = GPUOS_AGENT_SHADOWS (held, released, snapshot mapped) filled
 *            from the snapshot by device-to-device copies instead.  Memory made here is
 *            the process's own, so a later EXPORT can hand it out again (the driver
 *            refuses to export memory a process imported).  Reply: bytes, ns.
 *            With arg = GPUOS_AGENT_FILL_LATER (held, released): new memory for every
 *            allocation, mapped, its contents to come by FILL_PARTS (the allocations are
 *            pending).  Reply: bytes.
 *   FILL_PARTS (pending allocations, prepared) arg parts struct gpuos_agent_part follow the
 *            request (GPUOS_AGENT_PARTS_MAX at most): each copies `length` bytes from the
 *            staging area at `stage` to allocation `index` (LIST order) at `offset`, on
 *            the agent's streams; the reply comes once they are done.  An allocation all of
 *            whose bytes have come is filled, once the reply is sent (what waited for it
 *            may end the process); the last one filled opens the gate.  A part with
 *            flags GPUOS_AGENT_PART_SHADOW copies from its allocation's shadow at the
 *            same offset (mapped; stage 0), device to device.  Parts
 *            must not overlap (a part longer than what is left of its allocation is
 *            refused).  Reply: bytes; arg = an allocation a thread of the application
 *            waits for (UINT64_MAX: none), to fill next; count = calls that had to wait
 *            for everything since the last reply (a launch of unknown layout, a free,
 *            ...), msg = the last one's reason.
 *   RESUME   Calls go on.  Refused while released (MAP or FILL first).  With arg =
 *            GPUOS_AGENT_RESUME_FILLING and allocations pending: the application goes on
 *            while they are filled; a launch, copy or memset waits only until the
 *            allocations it touches (libgpuos's prediction) are filled, any other call that
 *            may touch device memory until all are.  HOLD is refused until all are.
 *   SNAPSHOT (held, mapped) a shadow of every allocation, in device memory of the agent's
 *            own at addresses the application never sees, filled by device-to-device
 *            copies (TB/s): the contents as they are now, to CAPTURE after RESUME.
 *            ENOMEM: not enough device memory (CAPTURE while held instead).  EXPORT and
 *            MAP with arg | GPUOS_AGENT_SHADOWS act on the shadows; RELEASE releases them
 *            with the allocations (a driver checkpoint then holds neither).  While a
 *            snapshot exists CAPTURE copies from it, held or not, and then drops it; DROP
 *            drops it without a copy, and so does the end of the connection unless it is
 *            handed out.
 *
 *   MEM_STATS  (any time) one struct gpuos_res_stats follows the reply (count = 1): the
 *            memory scheduler's figures (`gpuos run --gpu-memory`; limit 0: no limit).
 *
 * Under --gpu-memory (libgpuos/src/resident.c) HOLD is refused (EOPNOTSUPP): part of the
 * memory may live in host memory only, which the checkpoint's steps do not know yet.
 *
 * Closing the connection while held resumes the process if its memory is mapped (a
 * client that died must not leave the application stopped); while released it stays
 * held until a client maps or fills it (its memory exists only in what the client held).
 */
#ifndef GPUOS_AGENT_H
#define GPUOS_AGENT_H

#include <stdint.h>

#define GPUOS_AGENT_MAGIC 0x544e4741u /* "AGNT" */
#define GPUOS_AGENT_NAME "gpuos-agent-" /* + decimal pid, in the abstract namespace */
#define GPUOS_AGENT_FDS_PER_MSG 200
#define GPUOS_AGENT_HOLD_DETACH 1u /* HOLD's arg */
#define GPUOS_AGENT_SHADOWS (1ull << 63) /* EXPORT's, MAP's and FILL's arg: the snapshot's memory */
#define GPUOS_AGENT_FILL_LATER (1ull << 62) /* FILL's arg: new memory, contents by FILL_PARTS */
#define GPUOS_AGENT_RESUME_FILLING 1u /* RESUME's arg: go on while the memory is filled */
#define GPUOS_AGENT_PART_SHADOW 1u /* a part's flags: its bytes are the shadow's, on the device */
#define GPUOS_AGENT_PARTS_MAX 4096

enum gpuos_agent_cmd {
	GPUOS_AGENT_HOLD = 1,
	GPUOS_AGENT_LIST = 2,
	GPUOS_AGENT_CAPTURE = 3,
	GPUOS_AGENT_EXPORT = 4,
	GPUOS_AGENT_RELEASE = 5,
	GPUOS_AGENT_MAP = 6,
	GPUOS_AGENT_FILL = 7,
	GPUOS_AGENT_RESUME = 8,
	GPUOS_AGENT_PREPARE = 9,
	GPUOS_AGENT_UNPREPARE = 10,
	GPUOS_AGENT_SNAPSHOT = 11,
	GPUOS_AGENT_DROP = 12,
	GPUOS_AGENT_FILL_PARTS = 13,
	GPUOS_AGENT_MEM_STATS = 14,
};

struct gpuos_agent_req {
	uint32_t magic;
	uint32_t cmd;  /* enum gpuos_agent_cmd */
	uint64_t arg;
};

struct gpuos_agent_reply {
	uint32_t magic;
	int32_t status; /* 0, or an errno */
	uint32_t count;
	uint32_t pad;
	uint64_t arg;
	uint64_t bytes;
	uint64_t ns;
	char msg[200];  /* NUL-terminated; why status is not 0 */
};

struct gpuos_agent_alloc {
	uint64_t base;
	uint64_t size;     /* as the application asked */
	uint64_t reserved; /* the address range and its physical memory: size rounded up */
	uint64_t ctx;
	int32_t device;
	uint32_t pad;
	uint64_t last_use; /* the sequence number of the last recorded operation that touched it (0: none) */
};

struct gpuos_agent_part {
	uint32_t index;  /* the allocation, in LIST order */
	uint32_t flags;  /* GPUOS_AGENT_PART_SHADOW or 0 (from the staging area) */
	uint64_t offset; /* bytes into the allocation */
	uint64_t length;
	uint64_t stage;  /* where the bytes are in the staging area */
};

#define GPUOS_STALL_BUCKETS 24

/* The memory scheduler's figures since the process started (bytes, counts, nanoseconds). */
struct gpuos_res_stats {
	uint64_t limit;          /* --gpu-memory; 0: no limit, nothing below applies */
	uint64_t allocations;    /* movable allocations now */
	uint64_t reserved_bytes; /* their address ranges */
	uint64_t resident_bytes; /* of those, with physical memory (<= limit) */
	uint64_t evicted_bytes;  /* of those, whose contents are in host memory only */
	uint64_t bytes_in;       /* copied back to the GPU */
	uint64_t bytes_out;      /* copied out at evictions */
	uint64_t swap_ins;       /* allocations copied back */
	uint64_t evictions;
	uint64_t launches;       /* launches checked */
	uint64_t calls_swapped;  /* calls that had to bring something in */
	uint64_t need_all;       /* calls that needed every allocation (unpredictable) */
	uint64_t over_limit;     /* calls refused: what they need does not fit (CUDA_ERROR_OUT_OF_MEMORY) */
	uint64_t stall_ns;       /* time the application's calls spent making memory resident */
	uint64_t in_ns;          /* of it, copying in */
	uint64_t out_ns;         /* of it, evicting */
	uint64_t pageable_hosts; /* evicted allocations whose host memory could not be pinned */
	uint64_t capture_unchecked; /* calls not checked: a stream capture was in progress */
	uint64_t period;         /* the learned period of the calls' sequence, in calls that need
				  * memory; 0: none (evictions least recently used) */
	uint64_t evictions_future; /* evictions chosen by the learned sequence (Belady) */
	uint64_t lru_only;       /* 1: GPUOS_GPU_MEMORY_EVICT=lru (the baseline) */
	uint64_t reserved_peak;  /* the most reserved_bytes has been */
	uint64_t clean_bytes;    /* evicted without being copied out: unchanged since their last
				  * copy-out (their fingerprints, 4 KiB chunks, agree) */
	uint64_t ahead_bytes;    /* copied in ahead of their use (counted in bytes_in too) */
	uint64_t ahead_hits;     /* allocations a call found brought in ahead for it */
	uint64_t ahead_unused;   /* ... evicted again before any call used them */
	uint64_t ahead_waits;    /* calls that waited for a copy ahead still running */
	uint64_t host_prepared;  /* bytes of pinned host memory made for evictions before any
				  * needed it (resident.c: pinning runs at the kernel's page speed) */
	uint64_t ahead_ns;       /* of in_ns, issuing copies ahead and turns' batches (mapping
				  * their memory, queueing their copies: not waited for) */
	uint64_t map_ns;         /* of in_ns less ahead_ns, making and mapping the physical memory
				  * the copies waited for went to (cuMemCreate, cuMemMap, access) */
	uint64_t batch_bytes;    /* of ahead_bytes, those whose batches were timed on the GPU */
	uint64_t batch_ns;       /* their batches' GPU time, the first copy's start to the last
				  * one's end (gaps between copies while libgpuos mapped the next
				  * allocation included): the rate copies ahead and turns' batches ran at */
	uint64_t ahead_map_ns;   /* of ahead_ns, making and mapping the physical memory copies
				  * ahead and turns' batches went to (cuMemCreate, cuMemMap, access) */
	uint64_t room_ns;        /* of ahead_ns, turns' batches waiting for the room the others' evictions
				  * free, part by part (a group's holder): with ahead_map_ns, what
				  * of batch_ns was not copying */
	uint64_t maps;           /* physical memory made and mapped for copies in (waited for or
				  * ahead), which map_ns and ahead_map_ns time; of that time: */
	uint64_t create_ns;      /* ... in cuMemCreate */
	uint64_t access_ns;      /* ... in cuMemSetAccess (the rest: cuMemMap, and waits for a
				  * member that just left to give its memory back) */
	uint64_t release_ns;     /* of out_ns, unmapping and releasing evicted memory (the room it
				  * frees is given back only after) */
	uint64_t stall_hist[GPUOS_STALL_BUCKETS]; /* calls that brought memory in, by how long they
				  * waited: bucket i counts [2^i, 2^(i+1)) microseconds (the first,
				  * also less; the last, also more) */
};

#endif /* GPUOS_AGENT_H */
