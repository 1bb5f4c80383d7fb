/*******************************************************************************
    gpuos fault isolation: the rules, apart from UVM's state.

    When an MPS client takes a fatal replayable fault, the stock driver cancels
    it, and the firmware's recovery of that cancel tears down the whole channel
    group: every client of the MPS server dies.  gpuos instead lets the faulting
    warps complete: it maps a small UVM-owned scratch region at each faulting
    page of that client and replays, so the access succeeds (on garbage), no
    fault stays pending, and gpuos.ko stops the client.  This file decides,
    for one client and one fault batch, whether to do that or to fall back to
    the stock cancel, and which regions to map.  It holds no lock, allocates
    nothing and touches no UVM object, so gpuos's tests compile it unchanged in
    user space (ASan/UBSan) and in a kernel test module.  It lives in the
    gpuos repository (patches/nvidia-uvm/); tools/nvidia-src.sh copies it into
    the patched tree as nvidia-uvm/gpuos/, with gpuos.ko's headers.

    The glue (uvm_gpuos.c) calls, for the fatal faults of one VA space in one
    batch:
      gpuos_iso_add_fault()    for each fatal fault: the regions;
      gpuos_iso_check()        STOCK, ASK or MAP;
      gpuos_iso_decided()      after ASK, with gpuos.ko's answer: STOCK or MAP;
      gpuos_iso_mapped()       after mapping, what was mapped;
      gpuos_iso_give_up()      when mapping failed: STOCK from then on.
    The caller serializes calls for one VA space (its lock).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#ifndef __UVM_GPUOS_ISOLATE_H__
#define __UVM_GPUOS_ISOLATE_H__

#include "uvm_gpuos_types.h"

// A scratch region covers the 64 KiB-aligned block of a faulting page (a warp
// walking a wild pointer faults page after page: one region serves 16 of them);
// where that block is partly in use, the faulting page alone.
#define GPUOS_ISO_PAGE_SIZE     4096ull
#define GPUOS_ISO_REGION_SIZE   (64ull * 1024)

// At most this many distinct regions in one batch; more gives up (the bound
// keeps the caller's batch on its stack).
#define GPUOS_ISO_MAX_REGIONS   32

enum gpuos_iso_state
{
    GPUOS_ISO_NONE = 0,     // no fatal fault contained yet
    GPUOS_ISO_ACTIVE,       // contained; more may be, until deadline or budget
    GPUOS_ISO_GAVE_UP,      // stock cancel for every fatal fault from now on
};

// Per VA space.  Zero is the initial state.
struct gpuos_iso
{
    u32 state;              // enum gpuos_iso_state
    u64 deadline_ns;        // ACTIVE: no region is mapped after this time
    u64 mapped_bytes;       // scratch mapped so far
};

struct gpuos_iso_limits
{
    bool enabled;           // uvm_gpuos_isolate
    u64 window_ns;          // uvm_gpuos_isolate_ms: from the first contained fault
    u64 max_bytes;          // uvm_gpuos_isolate_max_kb: scratch per VA space
};

struct gpuos_iso_region
{
    u64 base;               // GPUOS_ISO_REGION_SIZE-aligned
    u64 page;               // a faulting page within it (the fallback mapping)
};

// The fatal faults of one client in one batch, as the regions to map, built
// fault by fault (gpuos_iso_add_fault).  Zero is the empty batch.
struct gpuos_iso_batch
{
    u32 nr_regions;
    bool uncontainable;     // a fault on mapped memory, or regions past the bound
    struct gpuos_iso_region regions[GPUOS_ISO_MAX_REGIONS];
};

enum gpuos_iso_verdict
{
    GPUOS_ISO_STOCK = 0,    // cancel as the stock driver does
    GPUOS_ISO_ASK,          // ask gpuos.ko (first fault), then gpuos_iso_decided()
    GPUOS_ISO_MAP,          // map the regions, then replay like serviced faults
};

// Adds one fatal fault: its address, and whether it is fatal because nothing
// is mapped there (and nothing else: a permission fault on a mapping is not).
void gpuos_iso_add_fault(struct gpuos_iso_batch *batch, u64 addr, bool unmapped);

// shares_tsg: the client is a subcontext of a channel group that another
// address space also uses (an MPS server's clients).  Alone in its channel
// group, the stock cancel harms nobody else: no isolation.  For ASK and MAP,
// batch->regions[0..nr_regions) are the regions to map; for STOCK,
// batch->nr_regions is 0.
enum gpuos_iso_verdict gpuos_iso_check(struct gpuos_iso *iso,
                                       const struct gpuos_iso_limits *limits,
                                       u64 now_ns,
                                       bool shares_tsg,
                                       struct gpuos_iso_batch *batch);

// After GPUOS_ISO_ASK: isolates is gpuos.ko's decision (ISOLATE or
// KILL_CLIENT: true; DEFAULT: false).
enum gpuos_iso_verdict gpuos_iso_decided(struct gpuos_iso *iso,
                                         const struct gpuos_iso_limits *limits,
                                         u64 now_ns,
                                         bool isolates,
                                         u32 nr_regions);

void gpuos_iso_mapped(struct gpuos_iso *iso, u64 bytes);

void gpuos_iso_give_up(struct gpuos_iso *iso);

#endif // __UVM_GPUOS_ISOLATE_H__
