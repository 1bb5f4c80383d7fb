/*******************************************************************************
    gpuos fault batch reports (see uvm_gpuos_report.h).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#include "uvm_gpuos_report.h"

// Keeps the lowest GPUOS_FAULT_BATCH_ADDRS distinct pages, ascending.
static void add_addr(struct gpuos_fault_batch_report *r, u64 addr)
{
    u32 i = r->nr_addrs;
    u32 j;

    while (i > 0 && r->addrs[i - 1] > addr)
        i--;
    if ((i > 0 && r->addrs[i - 1] == addr) || i == GPUOS_FAULT_BATCH_ADDRS)
        return;

    // Shift the higher ones up, dropping the highest if full.
    j = r->nr_addrs < GPUOS_FAULT_BATCH_ADDRS ? r->nr_addrs : GPUOS_FAULT_BATCH_ADDRS - 1;
    for (; j > i; j--)
        r->addrs[j] = r->addrs[j - 1];
    r->addrs[i] = addr;
    if (r->nr_addrs < GPUOS_FAULT_BATCH_ADDRS)
        r->nr_addrs++;
}

void gpuos_report_add_fault(struct gpuos_fault_batch_report *r, u64 addr, u32 instances,
                            bool fatal, bool throttled, u32 access)
{
    r->nr_faults++;
    r->nr_instances += instances;
    r->nr_fatal += fatal;
    r->nr_throttled += throttled;
    r->nr_by_access[access < __GPUOS_ACCESS_MAX ? access : GPUOS_ACCESS_ATOMIC]++;

    if (r->nr_faults == 1 || addr < r->addr_min)
        r->addr_min = addr;
    if (addr > r->addr_max)
        r->addr_max = addr;

    add_addr(r, addr);
}
