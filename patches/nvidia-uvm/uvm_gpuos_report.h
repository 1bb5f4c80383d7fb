/*******************************************************************************
    gpuos fault batch reports: building one client's report from the faults of
    a batch, apart from UVM's state.

    nvidia-uvm (uvm_gpuos.c) adds each fault of the client to a zeroed report
    in the batch's order, which 580 sorts by VA space, then GPU (MIG
    instance), then address: within one client the addresses ascend per GPU,
    and a page can repeat with another access type or from another GPU.  The
    report must still be what gpuos.ko accepts (gpuos_hooks.h): addrs[]
    strictly ascending, the lowest GPUOS_FAULT_BATCH_ADDRS distinct pages,
    within [addr_min, addr_max].  No lock, no allocation: gpuos's tests
    compile this file unchanged in user space (ASan/UBSan) and in a kernel
    test module.  It lives in the gpuos repository (patches/nvidia-uvm/);
    tools/nvidia-src.sh copies it into the patched tree as nvidia-uvm/gpuos/.

    SPDX-License-Identifier: MIT
*******************************************************************************/

#ifndef __UVM_GPUOS_REPORT_H__
#define __UVM_GPUOS_REPORT_H__

#include "uvm_gpuos_types.h"
#include "include/gpuos_hooks.h"

// One fault of the client: its page-aligned address, how many hardware
// packets the driver merged into it, whether it was fatal or throttled, and
// its access (enum gpuos_fault_access; anything else counts as atomic).
void gpuos_report_add_fault(struct gpuos_fault_batch_report *r, u64 addr, u32 instances,
                            bool fatal, bool throttled, u32 access);

#endif // __UVM_GPUOS_REPORT_H__
