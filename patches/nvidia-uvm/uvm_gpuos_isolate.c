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

enum gpuos_iso_verdict gpuos_iso_check(struct gpuos_iso *iso,
                                       const struct gpuos_iso_limits *limits,
                                       u64 now_ns,
                                       bool shares_tsg,
                                       const struct gpuos_iso_fault *faults,
                                       u32 nr,
                                       struct gpuos_iso_region *regions,
                                       u32 *nr_regions)
{
    u32 i, j;

    *nr_regions = 0;

    // Nothing to protect, or not asked to: the driver's own behaviour, and the
    // client's state is left as it is.
    if (!limits->enabled || !shares_tsg || nr == 0)
        return GPUOS_ISO_STOCK;

    if (iso->state == GPUOS_ISO_GAVE_UP)
        return GPUOS_ISO_STOCK;

    for (i = 0; i < nr; i++) {
        u64 base = faults[i].addr & ~(GPUOS_ISO_REGION_SIZE - 1);

        // A fault on memory that is mapped (a permission fault) cannot be
        // backed by scratch without replacing the application's mapping.
        if (!faults[i].unmapped)
            goto give_up;

        for (j = 0; j < *nr_regions; j++) {
            if (regions[j].base == base)
                break;
        }
        if (j < *nr_regions)
            continue;
        if (*nr_regions == GPUOS_ISO_MAX_REGIONS)
            goto give_up;

        regions[j].base = base;
        regions[j].page = faults[i].addr & ~(GPUOS_ISO_PAGE_SIZE - 1);
        (*nr_regions)++;
    }

    if (iso->state == GPUOS_ISO_NONE)
        return GPUOS_ISO_ASK;

    // ACTIVE: the client was contained before and faults again.  Past the
    // deadline it has had its time to be stopped; past the budget it is
    // walking through memory.  Either way: the stock cancel.
    if (now_ns > iso->deadline_ns || !within_budget(iso, limits, *nr_regions))
        goto give_up;

    return GPUOS_ISO_MAP;

give_up:
    // Only a client already contained changes state: a first fault that
    // cannot be contained is just cancelled, as stock.
    if (iso->state == GPUOS_ISO_ACTIVE)
        iso->state = GPUOS_ISO_GAVE_UP;
    *nr_regions = 0;
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
