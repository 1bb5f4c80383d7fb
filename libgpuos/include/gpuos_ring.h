/* SPDX-License-Identifier: MIT */
/*
 * gpuos_ring.h - the shared-memory launch log of libgpuos (format version 2).
 *
 * libgpuos, preloaded into a process by `gpuos run`, records what the process does
 * with the GPU into a ring in a memfd named "gpuos-ring" (so /proc/PID/fd shows
 * "/memfd:gpuos-ring (deleted)").  Readers map it read-only: `gpuos run` (which also
 * receives the fd over its control socket and drains it into the --log file) and
 * `gpuos trace launches PID` (which opens /proc/PID/fd/N; the kernel allows that to
 * the same user or root).  Readers never write records (only hdr.ops_paused, see
 * Pausing), so a slow reader cannot stall the application; it loses the oldest
 * records instead and can tell how many.
 *
 * Layout of the memfd (all little-endian):
 *
 *   [0, 4096)                    struct gpuos_ring_hdr
 *   [4096, 4096 + nslots * 64)   slots
 *   [strtab_off, +strtab_size)   function table: struct gpuos_func_ent[func_cap],
 *                                then name bytes (NUL-terminated, at name_off)
 *
 * Slots.  A slot is 64 bytes: an 8-byte sequence word and 56 payload bytes.  A record
 * is a struct gpuos_rec_hdr followed by its body; its bytes are split across
 * consecutive slots' payloads (56 bytes each).  A writer claims k slots with one
 * atomic fetch-add on hdr.head, never across the end of the ring (if it would wrap,
 * it first fills the tail with a GPUOS_REC_PAD record); it writes all payloads, then
 * the continuation slots' seq words, then the first slot's seq word with release
 * order.  The seq word of the slot with absolute index i is (i + 1), with
 * GPUOS_SLOT_START set on the first slot of a record.
 *
 * A reader keeps an absolute cursor r (start at max(0, head - nslots)), loads the seq
 * of slot r % nslots with acquire order and:
 *   - seq == (r + 1) | START: copy the record's k slots, then load head again; if head
 *     > r + nslots the copy may be torn (a writer has claimed one of its slots): drop it.
 *     Otherwise it is good; r += k.
 *   - (seq & ~START) < r + 1: not written yet; wait (the writer is between claim and
 *     commit; a writer that died there leaves a hole that `head` has passed: after a
 *     timeout a reader may skip one slot).
 *   - (seq & ~START) > r + 1, or a continuation slot: the reader was lapped; count
 *     and skip to the next START slot.
 *
 * Pausing.  hdr.ops_paused is the one field a process other than the writer may
 * store to: while it is 1, launches, copies, memsets and graph launches are neither
 * scanned nor recorded (their wrappers only call through), so a paused process pays
 * almost nothing; allocations, frees and objects are still tracked.  Records resume
 * exact with the first operation after it goes back to 0.  It exists to switch
 * recording off where nothing consumes it, and lets the overhead benchmark compare
 * recording with not recording inside one process (bench/intercept_overhead.py).
 *
 * Function table.  Launch records name functions by func_id, an index into the
 * table.  An entry is published by writing its fields, then storing `ready` = 1
 * with release order; hdr.func_count only grows.  Handles may repeat (a module was
 * unloaded and its address reused): the id, not the handle, identifies the entry.
 *
 * Records (type: body) — every size in bytes, every address a device virtual address:
 *   PAD         nothing; skip.
 *   ALLOC       struct gpuos_rec_alloc: an allocation or mapping became live.
 *   FREE        struct gpuos_rec_alloc: it went away (size and kind as recorded).
 *   OBJECT      struct gpuos_rec_object: a module, library, function, kernel, stream,
 *               event or graph exec was created or destroyed.
 *   LAUNCH      struct gpuos_rec_launch + nbuf * struct gpuos_rec_buf: a kernel
 *               launch and the buffers it may access (speculative: see the flags).
 *   COPY        struct gpuos_rec_copy: a copy or memset; its ranges are exact.
 *   GRAPH       struct gpuos_rec_graph: a graph launch; the kernels it runs follow as
 *               LAUNCH records with GPUOS_LAUNCH_GRAPH set and the same graph_exec.
 *   VALIDATE    struct gpuos_rec_validate + nmiss * struct gpuos_rec_miss: the outcome
 *               of validating one launch, copy or graph launch (`gpuos run --validate`).
 *   STATUS      struct gpuos_rec_status: tracking changed state (turned off, or became
 *               incomplete: then err holds the GPUOS_INCOMPLETE_* bit that was set).
 *   PARAMS      struct gpuos_rec_params + nparams * struct gpuos_rec_param + the bytes:
 *               the raw parameters of a launch whose kernel name matched
 *               GPUOS_DUMP_PARAMS (`gpuos run --dump-params`), to study a blind spot.
 *               It precedes the launch's LAUNCH record and carries the same seq.
 *   TOUCHED     struct gpuos_rec_touched + nrun * struct gpuos_rec_run: the pages one
 *               launch touched, measured from the GPU faults of the process's VA space
 *               (GPUOS_VALIDATE=touched, `gpuos run --record-touched`; touched.c).  Only
 *               allocations whose ALLOC record has GPUOS_ALLOC_F_MEASURED are measured.
 *               Comes with the launch's VALIDATE record, whose "changed" bytes are then
 *               the touched ones; records of one launch share its seq, in no set order.
 */
#ifndef GPUOS_RING_H
#define GPUOS_RING_H

#include <stdint.h>

#define GPUOS_RING_MAGIC 0x31474e4952534f47ULL /* "GOSRING1" */
#define GPUOS_RING_VERSION 3 /* 2: GPUOS_TRACK_INCOMPLETE and hdr.incomplete; 3: movable memory */
#define GPUOS_RING_HDR_SIZE 4096
#define GPUOS_SLOT_SIZE 64
#define GPUOS_SLOT_PAYLOAD 56
#define GPUOS_SLOT_START (1ULL << 63)
#define GPUOS_MEMFD_NAME "gpuos-ring"

/* hdr.state */
enum gpuos_track_state {
	GPUOS_TRACK_ON = 1,         /* tracking: the record is complete */
	GPUOS_TRACK_OFF = 2,        /* turned off for good; hdr.reason says why; the app runs on untouched */
	GPUOS_TRACK_INCOMPLETE = 3, /* tracking, but something went unrecorded: hdr.incomplete says what */
};

/* hdr.incomplete: why a record is incomplete (bits only ever set). A reader's own
 * losses (the ring lapped it) are the reader's to add. */
#define GPUOS_INCOMPLETE_UNKNOWN_ENTRY (1u << 0) /* cuGetProcAddress gave a hooked name's entry point
						  * that matches no hooked variant: it runs unseen */
#define GPUOS_INCOMPLETE_RECORD_LOST   (1u << 1) /* a record larger than the ring was not written (hdr.lost) */
#define GPUOS_INCOMPLETE_UNHOOKED_WRITER (1u << 2) /* the application called an entry point that
						    * writes device memory and is not tracked */

/* hdr.flags */
#define GPUOS_RING_VALIDATE (1u << 0) /* validation mode is on */
#define GPUOS_RING_TOUCHED  (1u << 1) /* ... measuring what launches touch (GPUOS_VALIDATE=touched) */

struct gpuos_ring_hdr {
	uint64_t magic;
	uint32_t version;
	uint32_t hdr_size;      /* GPUOS_RING_HDR_SIZE */
	uint32_t slot_size;     /* GPUOS_SLOT_SIZE */
	uint32_t nslots;        /* a power of two */
	uint32_t pid;
	uint32_t flags;         /* GPUOS_RING_* */
	uint64_t head;          /* atomic: next slot index to claim */
	uint64_t lost;          /* atomic: records not written (larger than the ring) */
	uint32_t state;         /* atomic: enum gpuos_track_state */
	int32_t reason_errno;   /* with GPUOS_TRACK_OFF: an errno, or 0 */
	char reason[256];       /* with GPUOS_TRACK_OFF: a sentence, NUL-terminated */
	uint64_t start_realtime_ns; /* CLOCK_REALTIME when the ring was made */
	uint64_t start_mono_ns;     /* CLOCK_MONOTONIC at the same moment (records use it) */
	uint64_t strtab_off;    /* offset of the function table in the memfd */
	uint64_t strtab_size;   /* bytes: func_cap entries, then names */
	uint32_t func_cap;      /* entries in the function table */
	uint32_t func_count;    /* atomic: entries published (ids 0..func_count-1) */
	uint64_t names_used;    /* atomic: name bytes used after the entries */
	uint32_t driver_version;/* cuDriverGetVersion, or 0 before cuInit */
	uint32_t lib_version;   /* GPUOS_RING_VERSION of the writer */
	/* counters, all atomic, never reset */
	uint64_t n_launches;
	uint64_t n_copies;
	uint64_t n_allocs;
	uint64_t n_frees;
	uint64_t n_graph_launches;
	uint64_t n_unknown_layout;  /* launches whose parameter layout was not available */
	uint64_t n_unmatched_procs; /* cuGetProcAddress results for hooked names not matched to a known variant (passed through) */
	uint64_t n_validated;       /* operations validated */
	uint64_t n_validate_skipped;/* operations not validated (during stream capture, ...) */
	uint64_t n_misses;          /* validated operations with at least one miss */
	/* The one field written from outside (a controller mapping the memfd read-write,
	 * `gpuos trace pause|resume PID`); libgpuos only reads it. */
	uint32_t ops_paused;        /* 1: record no operations (launches, copies, memsets,
				     * graph launches): their wrappers only call through.
				     * Allocations and objects are still tracked, so records
				     * are exact again from the first operation after 0.
				     * Ignored in validation mode. */
	uint32_t incomplete;        /* atomic: GPUOS_INCOMPLETE_* bits, with GPUOS_TRACK_INCOMPLETE */
	/* movable memory (libgpuos/src/memory.c; version 3) */
	uint32_t memory_mode;       /* 0: the driver's; 1: movable (GPUOS_MEMORY=movable) */
	uint32_t pad0;
	uint64_t movable_bytes;     /* atomic: physical bytes of live movable allocations */
	uint64_t n_movable_fallbacks; /* atomic: cuMemAlloc calls given the driver's memory because a
				     * VMM step failed */
};

struct gpuos_func_ent {
	uint64_t handle;   /* CUfunction or CUkernel as the application passed it */
	uint32_t name_off; /* from strtab_off + func_cap * sizeof(struct gpuos_func_ent) */
	uint16_t name_len; /* without the NUL; 0 when the driver gave no name */
	uint16_t nparams;  /* 0xffff: layout unknown */
	uint32_t params_bytes; /* total size of the parameters */
	uint32_t ready;    /* atomic: 1 when the entry is complete */
};

enum gpuos_rec_type {
	GPUOS_REC_PAD = 0,
	GPUOS_REC_ALLOC = 1,
	GPUOS_REC_FREE = 2,
	GPUOS_REC_OBJECT = 3,
	GPUOS_REC_LAUNCH = 4,
	GPUOS_REC_COPY = 5,
	GPUOS_REC_GRAPH = 6,
	GPUOS_REC_VALIDATE = 7,
	GPUOS_REC_STATUS = 8,
	GPUOS_REC_PARAMS = 9,
	GPUOS_REC_TOUCHED = 10,
};

struct gpuos_rec_hdr {
	uint16_t type;    /* enum gpuos_rec_type */
	uint16_t flags;   /* per type */
	uint32_t size;    /* bytes of this header and body */
	uint64_t ts_ns;   /* CLOCK_MONOTONIC */
	uint32_t tid;     /* gettid() of the calling thread */
	uint32_t reserved;
};

/* gpuos_rec_alloc.kind */
enum gpuos_alloc_kind {
	GPUOS_ALLOC_DEVICE = 1,      /* cuMemAlloc */
	GPUOS_ALLOC_PITCH = 2,       /* cuMemAllocPitch: size = pitch * height */
	GPUOS_ALLOC_ASYNC = 3,       /* cuMemAllocAsync / cuMemAllocFromPoolAsync */
	GPUOS_ALLOC_MANAGED = 4,     /* cuMemAllocManaged */
	GPUOS_ALLOC_HOST = 5,        /* cuMemAllocHost / cuMemHostAlloc (pinned) */
	GPUOS_ALLOC_HOST_REGISTERED = 6, /* cuMemHostRegister */
	GPUOS_ALLOC_VMM_RESERVE = 7, /* cuMemAddressReserve: VA only, not in the buffer map */
	GPUOS_ALLOC_VMM_MAP = 8,     /* cuMemMap of a cuMemCreate handle (handle in aux) */
	GPUOS_ALLOC_VMM_CREATE = 9,  /* cuMemCreate: physical memory, no VA (handle in aux, base 0) */
	GPUOS_ALLOC_GRAPH = 10,      /* a graph's memory allocation node */
};

/* gpuos_rec_hdr.flags of ALLOC and FREE */
#define GPUOS_ALLOC_F_MOVABLE (1u << 0) /* movable memory: aux is its physical memory's handle */
#define GPUOS_ALLOC_F_MEASURED (1u << 1) /* GPUOS_VALIDATE=touched: managed memory standing in for
					  * cuMemAlloc's, so the launches' touches are measured */

struct gpuos_rec_alloc {
	struct gpuos_rec_hdr h;
	uint64_t base;
	uint64_t size;
	uint64_t ctx;      /* CUcontext current at the call */
	uint64_t stream;   /* for stream-ordered allocation and free, else 0 */
	uint64_t aux;      /* VMM: the CUmemGenericAllocationHandle; else 0 */
	uint32_t kind;     /* enum gpuos_alloc_kind */
	int32_t device;    /* device ordinal, -1 for host memory or unknown */
};

enum gpuos_obj_type {
	GPUOS_OBJ_MODULE = 1,
	GPUOS_OBJ_LIBRARY = 2,
	GPUOS_OBJ_FUNCTION = 3,
	GPUOS_OBJ_KERNEL = 4,
	GPUOS_OBJ_STREAM = 5,
	GPUOS_OBJ_EVENT = 6,
	GPUOS_OBJ_GRAPH_EXEC = 7,
	GPUOS_OBJ_CONTEXT = 8,
};

/* gpuos_rec_object.h.flags */
#define GPUOS_OBJ_CREATED 1
#define GPUOS_OBJ_DESTROYED 2

struct gpuos_rec_object {
	struct gpuos_rec_hdr h;
	uint64_t handle;
	uint64_t parent;   /* module/library of a function or kernel, ctx of a stream */
	uint32_t objtype;  /* enum gpuos_obj_type */
	uint32_t func_id;  /* functions and kernels: the function table id, else 0xffffffff */
};

/* gpuos_rec_launch.h.flags */
#define GPUOS_LAUNCH_LAYOUT_UNKNOWN (1u << 0) /* no parameter layout: treat as touching every buffer */
#define GPUOS_LAUNCH_TOUCH_ALL      (1u << 1) /* a --touch-all rule matched: treat as touching every buffer */
#define GPUOS_LAUNCH_TRUNCATED      (1u << 2) /* more buffers than GPUOS_MAX_BUFS: the list is cut */
#define GPUOS_LAUNCH_GRAPH          (1u << 3) /* a kernel node of a graph launch */
#define GPUOS_LAUNCH_CAPTURED       (1u << 4) /* issued into a capturing stream: recorded, not run */
#define GPUOS_LAUNCH_EX             (1u << 5) /* cuLaunchKernelEx */
#define GPUOS_LAUNCH_COOPERATIVE    (1u << 6) /* cooperative launch */
#define GPUOS_LAUNCH_EXTRA          (1u << 7) /* parameters passed through `extra` */

#define GPUOS_MAX_BUFS 1024

struct gpuos_rec_launch {
	struct gpuos_rec_hdr h;
	uint64_t seq;        /* per-process operation number (launches, copies, graphs share it) */
	uint64_t stream;
	uint64_t ctx;
	uint64_t graph_exec; /* with GPUOS_LAUNCH_GRAPH */
	uint64_t arg_hash;   /* hash of the parameter words (8 bytes; a shorter tail zero-padded) that are not buffer pointers: the sum over them of (word ^ i * 0x9e3779b97f4a7c15) * 0xff51afd7ed558ccd, i the word's place among the launch's words, then murmur3's 64-bit finalizer of (sum ^ words) */
	uint32_t func_id;
	uint32_t grid[3];
	uint32_t block[3];
	uint32_t shmem;
	uint32_t nbuf;
	uint32_t reserved;
};

/* gpuos_rec_buf.flags */
#define GPUOS_BUF_MANAGED (1u << 0)
#define GPUOS_BUF_HOST    (1u << 1) /* pinned or registered host memory */
#define GPUOS_BUF_EXACT   (1u << 2) /* [ptr, ptr + len) is exact (copies, memsets), else the whole allocation may be touched */
#define GPUOS_BUF_WRITE   (1u << 3) /* written (copies and memsets: the destination) */
#define GPUOS_BUF_READ    (1u << 4) /* read (copies: the source) */

struct gpuos_rec_buf {
	uint64_t base;     /* allocation start */
	uint64_t size;     /* allocation size */
	uint64_t ptr;      /* the pointer found (a parameter word, or a copy's address) */
	uint64_t len;      /* with GPUOS_BUF_EXACT: bytes from ptr; else 0 */
	uint16_t param;    /* parameter index the pointer was found in; 0xffff for copies */
	uint16_t flags;    /* GPUOS_BUF_* */
	uint32_t offset;   /* byte offset of the pointer inside that parameter */
};

enum gpuos_copy_kind {
	GPUOS_COPY_HTOD = 1,
	GPUOS_COPY_DTOH = 2,
	GPUOS_COPY_DTOD = 3,
	GPUOS_COPY_HTOH = 4,
	GPUOS_COPY_UNIFIED = 5,  /* cuMemcpy / cuMemcpyAsync: direction from the pointers */
	GPUOS_COPY_PEER = 6,
	GPUOS_COPY_MEMSET = 7,
	GPUOS_COPY_2D = 8,
	GPUOS_COPY_3D = 9,
	GPUOS_COPY_BATCH = 10,   /* one entry of cuMemcpyBatchAsync */
};

/* gpuos_rec_copy.h.flags */
#define GPUOS_COPY_ASYNC    (1u << 0)
#define GPUOS_COPY_GRAPH    (1u << 1) /* a memcpy/memset node of a graph launch */
#define GPUOS_COPY_CAPTURED (1u << 2) /* issued into a capturing stream: recorded, not run */

struct gpuos_rec_copy {
	struct gpuos_rec_hdr h;
	uint64_t seq;
	uint64_t stream;
	uint64_t dst;      /* first byte written */
	uint64_t src;      /* first byte read, 0 for memsets */
	uint64_t dst_len;  /* bytes spanned at dst (2D/3D: from the first to the last byte written) */
	uint64_t src_len;  /* bytes spanned at src */
	uint64_t graph_exec;
	uint32_t kind;     /* enum gpuos_copy_kind */
	uint32_t value;    /* memsets: the value; else 0 */
};

/* gpuos_rec_graph.h.flags */
#define GPUOS_GRAPH_INCOMPLETE (1u << 0) /* nodes not (all) extracted: treat as touching every buffer */
#define GPUOS_GRAPH_CAPTURED   (1u << 1) /* launched into a capturing stream: recorded, not run */

struct gpuos_rec_graph {
	struct gpuos_rec_hdr h;
	uint64_t seq;
	uint64_t graph_exec;
	uint64_t stream;
	uint32_t nkernels; /* LAUNCH records that follow for this graph launch */
	uint32_t ncopies;  /* COPY records that follow */
};

/* gpuos_rec_validate.h.flags */
#define GPUOS_VAL_SKIPPED (1u << 0) /* not validated (stream capture in progress, ...); see reason */

enum gpuos_val_skip_reason {
	GPUOS_VAL_SKIP_NONE = 0,
	GPUOS_VAL_SKIP_CAPTURE = 1,   /* a stream capture was in progress */
	GPUOS_VAL_SKIP_NOMEM = 2,     /* no GPU memory for the fingerprints */
	GPUOS_VAL_SKIP_ERROR = 3,     /* a driver call of the validator failed */
	GPUOS_VAL_SKIP_OTHER_CTX = 4, /* the operation's context is not the one validated */
	GPUOS_VAL_SKIP_BUSY = 5,      /* another thread's operation held validation too long
				       * (GPUOS_VAL_WAIT_MS): waiting could deadlock, since that
				       * operation may be waiting for this one */
	GPUOS_VAL_SKIP_NOT_MEASURED = 6, /* GPUOS_VALIDATE=touched measures launches only */
};

struct gpuos_rec_validate {
	struct gpuos_rec_hdr h;
	uint64_t seq;              /* the operation validated */
	uint64_t changed_bytes;    /* bytes of device memory (whole 4 KiB chunks) that changed */
	uint64_t predicted_bytes;  /* bytes predicted (allocations for kernels, exact ranges for copies) */
	uint64_t overpredicted_bytes; /* predicted bytes that did not change */
	uint64_t missed_bytes;     /* changed bytes outside every prediction */
	uint64_t tracked_bytes;    /* device memory fingerprinted */
	uint32_t func_id;          /* kernels: the function; else 0xffffffff */
	uint32_t nmiss;            /* miss entries that follow (at most 64; missed_bytes counts all) */
	uint32_t skip_reason;      /* enum gpuos_val_skip_reason */
	uint32_t op_type;          /* GPUOS_REC_LAUNCH, GPUOS_REC_COPY or GPUOS_REC_GRAPH */
};

struct gpuos_rec_miss {
	uint64_t base;     /* allocation that changed without being predicted */
	uint64_t size;
	uint64_t first;    /* first changed byte (chunk-aligned) */
	uint64_t len;      /* from first to the end of the last changed chunk */
};

struct gpuos_rec_status {
	struct gpuos_rec_hdr h;
	uint32_t state;    /* enum gpuos_track_state */
	int32_t err;       /* errno or CUresult */
	char reason[256];
};

/* gpuos_rec_params.h.flags */
#define GPUOS_PARAMS_EXTRA     (1u << 0) /* one entry: the `extra` parameter buffer */
#define GPUOS_PARAMS_TRUNCATED (1u << 1) /* more than GPUOS_MAX_PARAM_DUMP bytes: cut */

#define GPUOS_MAX_PARAM_DUMP 32768

struct gpuos_rec_params {
	struct gpuos_rec_hdr h;
	uint64_t seq;      /* the launch's */
	uint32_t func_id;
	uint32_t nparams;  /* struct gpuos_rec_param entries that follow, then their bytes in order */
};

struct gpuos_rec_param {
	uint32_t offset;   /* in the parameter buffer, as the driver's layout says */
	uint32_t size;     /* bytes of this parameter that follow */
};

/* gpuos_rec_touched.h.flags: touches that may have gone unseen */
#define GPUOS_TOUCHED_DROPPED (1u << 0) /* fault events were lost (a queue overflowed) */
#define GPUOS_TOUCHED_REMOTE  (1u << 1) /* UVM mapped pages remotely or throttled them
					 * (thrashing): they were touched without faulting */

/* gpuos_rec_run.access: the accesses that faulted in the run */
#define GPUOS_TOUCH_READ     (1u << 0)
#define GPUOS_TOUCH_WRITE    (1u << 1)
#define GPUOS_TOUCH_ATOMIC   (1u << 2)
#define GPUOS_TOUCH_PREFETCH (1u << 3)

#define GPUOS_TOUCH_PAGE 4096
#define GPUOS_MAX_TOUCHED_RUNS 1024

struct gpuos_rec_touched {
	struct gpuos_rec_hdr h;
	uint64_t seq;      /* the launch's */
	uint64_t faults;   /* GPU fault events read for it (a page may fault more than once) */
	uint64_t gap;      /* runs join faulted pages up to this many bytes apart (0: adjacent
			    * only; raised until at most GPUOS_MAX_TOUCHED_RUNS runs remain) */
	uint32_t func_id;
	uint32_t nrun;     /* struct gpuos_rec_run entries that follow, by address */
};

/* Faulted 4 KiB pages from start to start + pages * 4096.  Within a 2 MiB-aligned VA
 * block UVM migrates pages near a faulted one along with it, and those are then touched
 * without a fault: the set of touched 2 MiB blocks is exact, the pages within are not. */
struct gpuos_rec_run {
	uint64_t start;
	uint32_t pages;
	uint32_t access;   /* GPUOS_TOUCH_* */
};

#define GPUOS_VALIDATE_CHUNK 4096

#endif /* GPUOS_RING_H */
