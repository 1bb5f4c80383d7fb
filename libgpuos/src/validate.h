/* SPDX-License-Identifier: MIT */
/*
 * validate.h - the interface between libgpuos's core and its validator (validate.c).
 *
 * The core (hooks.c, track.c, scan.c, ring.c) calls gpuos_val_before() just before it
 * calls the real driver for an operation that can change device memory (a launch, a
 * copy, a memset, a graph launch) and gpuos_val_after() right after, only when
 * validation is on (GPUOS_VALIDATE=1 or =touched).  Between the two calls the core holds
 * gpuos_val_lock so that one operation at a time is validated process-wide.
 */
#ifndef GPUOS_VALIDATE_H
#define GPUOS_VALIDATE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <cuda.h>

#include "gpuos_ring.h"

/* A live device allocation of the context being validated (from the core's map). */
struct gpuos_seg {
	uint64_t base;
	uint64_t size;
};

/* What the core predicted for one operation. */
struct gpuos_val_op {
	uint32_t op_type;                  /* GPUOS_REC_LAUNCH, _COPY or _GRAPH */
	uint64_t seq;                      /* the operation's seq (same as its record) */
	uint32_t func_id;                  /* launches: function table id; else 0xffffffff */
	CUcontext ctx;                     /* context current at the call */
	CUstream stream;                   /* the operation's stream */
	int touch_all;                     /* predicted: everything (unknown layout, rule) */
	const struct gpuos_rec_buf *bufs;  /* predicted buffers (copies: EXACT ranges) */
	uint32_t nbuf;
	/* filled by gpuos_val_before(), read by gpuos_val_after() */
	int skip_reason;                   /* enum gpuos_val_skip_reason; 0 = validating */
	void *state;                       /* the validator's per-operation state */
};

extern pthread_mutex_t gpuos_val_lock;
/* Operations that run unvalidated (busy) while validation is held: gpuos_val_busy are
 * under way; gpuos_val_overlaps counts their starts and ends. A validation during which
 * either moved, or that ends with one under way, is skipped too (busy): the changes it
 * saw are not its operation's alone. */
extern uint64_t gpuos_val_busy, gpuos_val_overlaps;

/* Before the operation.  Never fails the application: on any error it sets
 * op->skip_reason and the operation runs unvalidated. */
void gpuos_val_before(struct gpuos_val_op *op);

/* After the real call returned `res`.  Emits one GPUOS_REC_VALIDATE record (or a
 * skipped one) and updates the header counters.  Does nothing more if res != 0. */
void gpuos_val_after(struct gpuos_val_op *op, CUresult res);

/* In a forked child: forget the parent's per-context state (called by the core). */
void gpuos_val_forget(void);

/* Provided by the core for the validator. */

/* Copy the live allocations of `ctx` that have all GPUOS_A_* `flags` (GPUOS_A_DEVMEM: the
 * GPU-fingerprintable ones: device, pitched, async/pool, VMM mappings with access set,
 * graph allocations; not managed, not host), sorted by base and non-overlapping, into
 * out[0..cap).  Returns how many there are (may exceed cap: call again with a larger
 * array).  Allocations the validator made itself are excluded (it marks them with
 * gpuos_track_ignore()). */
size_t gpuos_track_snapshot(CUcontext ctx, uint32_t flags, struct gpuos_seg *out, size_t cap);

/* How many stream captures are in progress in the process (the core's
 * cuStreamBeginCapture* and cuStreamEndCapture hooks count them). */
int gpuos_captures_in_progress(void);

/* Exclude [base, base+size) from tracking (the validator's own buffers). */
void gpuos_track_ignore(uint64_t base, uint64_t size, int ignore);

/* Append a record (header fields type/flags/size/ts/tid are filled in) with an
 * optional tail (e.g. miss entries).  Never blocks; drops and counts when it cannot. */
void gpuos_ring_emit(uint16_t type, uint16_t flags, void *rec, size_t rec_len,
		     const void *tail, size_t tail_len);

/* Header counters: the ring header's field, by offsetof(struct gpuos_ring_hdr, F). */
void gpuos_ring_count(size_t counter_offset, uint64_t n);

/* Turn tracking off for good with a reason (idempotent, async-signal-unsafe). */
void gpuos_track_off(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* GPUOS_VALIDATE_H */
