/*******************************************************************************
    gpuos fault isolation: the rules (see uvm_gpuos_isolate.h).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#include "uvm_gpuos_isolate.h"

// Within the budget: every region of this batch fits in what is left.
static bool within_budget(const struct gpuos_iso *iso, const struct gpuos_iso_limits *limits, u32 nr_regions)
{
    u64 want = (u64)nr_regions * GPUOS_ISO_REGION_SIZE;

    return iso->mapped_bytes <= limits->max_bytes && want <= limits->max_bytes - iso->mapped_bytes;
}

void gpuos_iso_add_fault(struct gpuos_iso_batch *batch, u64 addr, bool unmapped)
{
    u64 base = addr & ~(GPUOS_ISO_REGION_SIZE - 1);
    u32 j;

    // A fault on memory that is mapped (a permission fault) cannot be backed
    // by scratch without replacing the application's mapping.
    if (!unmapped) {
        batch->uncontainable = true;
        return;
    }

    for (j = 0; j < batch->nr_regions; j++) {
        if (batch->regions[j].base == base)
            return;
    }
    if (batch->nr_regions == GPUOS_ISO_MAX_REGIONS) {
        batch->uncontainable = true;
        return;
    }

    batch->regions[j].base = base;
    batch->regions[j].page = addr & ~(GPUOS_ISO_PAGE_SIZE - 1);
    batch->nr_regions++;
}

enum gpuos_iso_verdict gpuos_iso_check(struct gpuos_iso *iso,
                                       const struct gpuos_iso_limits *limits,
                                       u64 now_ns,
                                       bool shares_tsg,
                                       struct gpuos_iso_batch *batch)
{
    // Nothing to protect, or not asked to: the driver's own behaviour, and the
    // client's state is left as it is.
    if (!limits->enabled || !shares_tsg || (batch->nr_regions == 0 && !batch->uncontainable))
        goto stock;

    if (iso->state == GPUOS_ISO_GAVE_UP)
        goto stock;

    if (batch->uncontainable)
        goto give_up;

    if (iso->state == GPUOS_ISO_NONE)
        return GPUOS_ISO_ASK;

    // ACTIVE: the client was contained before and faults again.  Past the
    // deadline it has had its time to be stopped; past the budget it is
    // walking through memory.  Either way: the stock cancel.
    if (now_ns > iso->deadline_ns || !within_budget(iso, limits, batch->nr_regions))
        goto give_up;

    return GPUOS_ISO_MAP;

give_up:
    // Only a client already contained changes state: a first fault that
    // cannot be contained is just cancelled, as stock.
    if (iso->state == GPUOS_ISO_ACTIVE)
        iso->state = GPUOS_ISO_GAVE_UP;
stock:
    batch->nr_regions = 0;
    return GPUOS_ISO_STOCK;
}

enum gpuos_iso_verdict gpuos_iso_decided(struct gpuos_iso *iso,
                                         const struct gpuos_iso_limits *limits,
                                         u64 now_ns,
                                         bool isolates,
                                         u32 nr_regions)
{
    if (iso->state != GPUOS_ISO_NONE || !isolates)
        return GPUOS_ISO_STOCK;

    iso->state = GPUOS_ISO_ACTIVE;
    iso->deadline_ns = now_ns + limits->window_ns;
    if (iso->deadline_ns < now_ns)
        iso->deadline_ns = ~0ull;

    if (!within_budget(iso, limits, nr_regions)) {
        iso->state = GPUOS_ISO_GAVE_UP;
        return GPUOS_ISO_STOCK;
    }

    return GPUOS_ISO_MAP;
}

void gpuos_iso_mapped(struct gpuos_iso *iso, u64 bytes)
{
    iso->mapped_bytes += bytes;
}

void gpuos_iso_give_up(struct gpuos_iso *iso)
{
    iso->state = GPUOS_ISO_GAVE_UP;
}
