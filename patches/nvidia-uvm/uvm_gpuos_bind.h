/*******************************************************************************
    gpuos binding of nvidia-uvm: how it finds gpuos.ko, and calls it.

    gpuos.ko is optional.  nvidia-uvm never links against it: its entry points
    are looked up at run time with symbol_get() when nvidia-uvm loads (or when
    1 is written to /sys/module/nvidia_uvm/parameters/uvm_gpuos_attach) and
    released with symbol_put() when it unloads (or 0 is written).  So modinfo
    shows no "depends: gpuos", nvidia-uvm loads without gpuos.ko, and then
    every call below is one test of a NULL pointer.  While attached,
    nvidia-uvm holds a reference on gpuos.ko (rmmod gpuos fails, "in use",
    until it detaches or unloads).

    Callers of the gpuos_bind_*() calls (the fault path) run under SRCU; detach
    clears the pointers, waits for them, lets the driver finish what gpuos
    gave it (drain), and only then unregisters and puts the symbols.

    No UVM type in here: it lives in the gpuos repository
    (patches/nvidia-uvm/), tools/nvidia-src.sh copies it into the patched tree
    as nvidia-uvm/gpuos/, and gpuos's VM tests compile it unchanged into a test
    module that attaches to the real gpuos.ko (kmod/bindtest/).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#ifndef __UVM_GPUOS_BIND_H__
#define __UVM_GPUOS_BIND_H__

#include <linux/types.h>

#include "include/gpuos_hooks.h"

struct gpuos_bind_driver
{
    // Registered with gpuos.ko while attached.
    struct gpuos_driver_ops *ops;

    // Optional.  accepting(true) before registering (gpuos may submit as soon
    // as it is registered), accepting(false) when detaching; drain() then
    // returns once every accepted batch has called gpuos_bind_batch_done().
    void (*accepting)(bool on);
    void (*drain)(void);
};

// Module init: attach if wanted (uvm_gpuos_attach, default 1) and gpuos.ko is
// loaded.  Never fails.  Module exit: detach.  Process context.
void gpuos_bind_init(const struct gpuos_bind_driver *driver);
void gpuos_bind_exit(void);

// Whether an optional entry point is bound now: one load, for a fast path
// that then calls the gpuos_bind_*() below (which check again).
bool gpuos_bind_has_fault_batch(void);
bool gpuos_bind_has_prefetch(void);

// gpuos.ko's calls (gpuos_hooks.h), or what they mean without gpuos.ko:
// GPUOS_DECISION_DEFAULT, nothing, 0 ranges.  Never sleep (the first three).
u32 gpuos_bind_report_fault(const struct gpuos_fault_report *report);
void gpuos_bind_report_fault_batch(const struct gpuos_fault_batch_report *report);
u32 gpuos_bind_prefetch_lookup(u64 as_id, u64 addr, struct gpuos_prefetch_range *out, u32 max);
void gpuos_bind_address_space_gone(u64 as_id);

// A batch gpuos submitted is done.  Only between accepting(true) and the end
// of drain(): while attached.
void gpuos_bind_batch_done(u64 batch_id, const s32 *status, u32 nr);

#endif // __UVM_GPUOS_BIND_H__
