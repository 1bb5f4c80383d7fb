/*******************************************************************************
    gpuos binding of nvidia-uvm (see uvm_gpuos_bind.h).

    SPDX-License-Identifier: MIT
*******************************************************************************/

#include "uvm_gpuos_bind.h"

#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/printk.h>
#include <linux/srcu.h>

// The bound entry points of gpuos.ko; NULL while detached.
static struct
{
    typeof(&gpuos_register_driver) register_driver;
    typeof(&gpuos_unregister_driver) unregister_driver;
    typeof(&gpuos_report_fault) report_fault;
    typeof(&gpuos_batch_done) batch_done;
    typeof(&gpuos_report_fault_batch) report_fault_batch;   // optional: an older gpuos.ko lacks it
    typeof(&gpuos_address_space_gone) address_space_gone;   // optional, as above
    typeof(&gpuos_prefetch_lookup) prefetch_lookup;         // optional, likewise
} g_bound;

static DEFINE_MUTEX(g_bind_mutex);          // attach and detach
DEFINE_STATIC_SRCU(g_bind_srcu);            // readers of g_bound's pointers
static const struct gpuos_bind_driver *g_driver;    // set by init (under g_bind_mutex)
static bool g_want = true;                  // uvm_gpuos_attach (under g_bind_mutex)

#define GPUOS_PUT(sym, ptr) do { if (ptr) symbol_put(sym); } while (0)

static int attach_locked(void)
{
    typeof(&gpuos_register_driver) reg;
    typeof(&gpuos_unregister_driver) unreg;
    typeof(&gpuos_report_fault) report;
    typeof(&gpuos_batch_done) done;
    typeof(&gpuos_report_fault_batch) batch;
    typeof(&gpuos_address_space_gone) gone;
    typeof(&gpuos_prefetch_lookup) prefetch;
    int ret;

    if (g_bound.register_driver)
        return 0;

    reg = symbol_get(gpuos_register_driver);
    unreg = symbol_get(gpuos_unregister_driver);
    report = symbol_get(gpuos_report_fault);
    done = symbol_get(gpuos_batch_done);
    batch = symbol_get(gpuos_report_fault_batch);
    gone = symbol_get(gpuos_address_space_gone);
    prefetch = symbol_get(gpuos_prefetch_lookup);
    if (!reg || !unreg || !report || !done) {
        ret = -ENOENT;
        goto fail;
    }

    // Before registering: gpuos may call ops->submit (which completes with
    // batch_done) as soon as gpuos_register_driver() returns.
    WRITE_ONCE(g_bound.batch_done, done);
    if (g_driver->accepting)
        g_driver->accepting(true);

    ret = reg(g_driver->ops);
    if (ret != 0) {
        pr_warn("%s: gpuos.ko refused registration: %d\n", g_driver->ops->name, ret);
        if (g_driver->accepting)
            g_driver->accepting(false);
        WRITE_ONCE(g_bound.batch_done, NULL);
        goto fail;
    }

    g_bound.register_driver = reg;
    g_bound.unregister_driver = unreg;
    WRITE_ONCE(g_bound.report_fault, report);
    WRITE_ONCE(g_bound.report_fault_batch, batch);
    WRITE_ONCE(g_bound.address_space_gone, gone);
    WRITE_ONCE(g_bound.prefetch_lookup, prefetch);

    pr_info("%s: attached to gpuos.ko (caps %#x)%s%s%s\n",
            g_driver->ops->name, g_driver->ops->caps,
            batch ? "" : "; it has no gpuos_report_fault_batch: no fault batch reports",
            gone ? "" : "; it has no gpuos_address_space_gone: it keeps dead address spaces' prefetch ranges",
            prefetch ? "" : "; it has no gpuos_prefetch_lookup: no prefetch ranges");
    return 0;

fail:
    GPUOS_PUT(gpuos_register_driver, reg);
    GPUOS_PUT(gpuos_unregister_driver, unreg);
    GPUOS_PUT(gpuos_report_fault, report);
    GPUOS_PUT(gpuos_batch_done, done);
    GPUOS_PUT(gpuos_report_fault_batch, batch);
    GPUOS_PUT(gpuos_address_space_gone, gone);
    GPUOS_PUT(gpuos_prefetch_lookup, prefetch);
    return ret;
}

static void detach_locked(void)
{
    typeof(&gpuos_report_fault_batch) batch = g_bound.report_fault_batch;
    typeof(&gpuos_address_space_gone) gone = g_bound.address_space_gone;
    typeof(&gpuos_prefetch_lookup) prefetch = g_bound.prefetch_lookup;

    if (!g_bound.register_driver)
        return;

    // No new calls from the fault path; wait for those running.
    WRITE_ONCE(g_bound.report_fault, NULL);
    WRITE_ONCE(g_bound.report_fault_batch, NULL);
    WRITE_ONCE(g_bound.address_space_gone, NULL);
    WRITE_ONCE(g_bound.prefetch_lookup, NULL);
    synchronize_srcu(&g_bind_srcu);

    // Refuse new batches, finish the accepted ones (they call batch_done),
    // then unregister: gpuos no longer calls into the ops after that.
    if (g_driver->accepting)
        g_driver->accepting(false);
    if (g_driver->drain)
        g_driver->drain();
    g_bound.unregister_driver(g_driver->ops);

    g_bound.register_driver = NULL;
    g_bound.unregister_driver = NULL;
    WRITE_ONCE(g_bound.batch_done, NULL);

    symbol_put(gpuos_register_driver);
    symbol_put(gpuos_unregister_driver);
    symbol_put(gpuos_report_fault);
    symbol_put(gpuos_batch_done);
    GPUOS_PUT(gpuos_report_fault_batch, batch);
    GPUOS_PUT(gpuos_address_space_gone, gone);
    GPUOS_PUT(gpuos_prefetch_lookup, prefetch);

    pr_info("%s: detached from gpuos.ko\n", g_driver->ops->name);
}

// <module>/parameters/uvm_gpuos_attach: reads 1 while attached; write 1 to
// attach (ENOENT if gpuos.ko is not loaded), 0 to detach.  As a load-time
// parameter, 0 keeps the module from attaching when it loads.
static int attach_set(const char *val, const struct kernel_param *kp)
{
    bool want;
    int ret = kstrtobool(val, &want);

    if (ret)
        return ret;

    mutex_lock(&g_bind_mutex);
    g_want = want;
    if (g_driver) {
        if (want)
            ret = attach_locked();
        else
            detach_locked();
    }
    mutex_unlock(&g_bind_mutex);
    return ret;
}

static int attach_get(char *buffer, const struct kernel_param *kp)
{
    return sprintf(buffer, "%d\n", READ_ONCE(g_bound.register_driver) ? 1 : 0);
}

static const struct kernel_param_ops attach_ops =
{
    .set = attach_set,
    .get = attach_get,
};

module_param_cb(uvm_gpuos_attach, &attach_ops, NULL, 0644);
MODULE_PARM_DESC(uvm_gpuos_attach,
                 "1 while attached to gpuos.ko; write 1 to attach, 0 to detach. "
                 "Load with 0 to not attach at load time.");

void gpuos_bind_init(const struct gpuos_bind_driver *driver)
{
    mutex_lock(&g_bind_mutex);
    g_driver = driver;
    if (g_want)
        attach_locked();    // gpuos.ko not loaded: nothing to do
    mutex_unlock(&g_bind_mutex);
}

void gpuos_bind_exit(void)
{
    mutex_lock(&g_bind_mutex);
    if (g_driver)
        detach_locked();
    g_driver = NULL;
    mutex_unlock(&g_bind_mutex);
}

bool gpuos_bind_has_fault_batch(void)
{
    return READ_ONCE(g_bound.report_fault_batch) != NULL;
}

bool gpuos_bind_has_prefetch(void)
{
    return READ_ONCE(g_bound.prefetch_lookup) != NULL;
}

u32 gpuos_bind_report_fault(const struct gpuos_fault_report *report)
{
    typeof(&gpuos_report_fault) fn;
    u32 decision = GPUOS_DECISION_DEFAULT;
    int idx = srcu_read_lock(&g_bind_srcu);

    fn = READ_ONCE(g_bound.report_fault);
    if (fn)
        decision = fn(report);
    srcu_read_unlock(&g_bind_srcu, idx);
    return decision;
}

void gpuos_bind_report_fault_batch(const struct gpuos_fault_batch_report *report)
{
    typeof(&gpuos_report_fault_batch) fn;
    int idx = srcu_read_lock(&g_bind_srcu);

    fn = READ_ONCE(g_bound.report_fault_batch);
    if (fn)
        fn(report);
    srcu_read_unlock(&g_bind_srcu, idx);
}

u32 gpuos_bind_prefetch_lookup(u64 as_id, u64 addr, struct gpuos_prefetch_range *out, u32 max)
{
    typeof(&gpuos_prefetch_lookup) fn;
    u32 n = 0;
    int idx = srcu_read_lock(&g_bind_srcu);

    fn = READ_ONCE(g_bound.prefetch_lookup);
    if (fn)
        n = fn(as_id, addr, out, max);
    srcu_read_unlock(&g_bind_srcu, idx);
    return n;
}

void gpuos_bind_address_space_gone(u64 as_id)
{
    typeof(&gpuos_address_space_gone) fn;
    int idx = srcu_read_lock(&g_bind_srcu);

    fn = READ_ONCE(g_bound.address_space_gone);
    if (fn)
        fn(as_id);
    srcu_read_unlock(&g_bind_srcu, idx);
}

void gpuos_bind_batch_done(u64 batch_id, const s32 *status, u32 nr)
{
    // Bound from before accepting(true) until after drain() returns.
    typeof(&gpuos_batch_done) fn = READ_ONCE(g_bound.batch_done);

    if (!WARN_ON_ONCE(!fn))
        fn(batch_id, status, nr);
}
