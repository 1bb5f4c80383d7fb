#!/usr/bin/env python3
"""Explicit-state model checker for the replayable-fault service loop of
nvidia-uvm 580.142 with gpuos's fault isolation (stock, park, scratch).

Plain Python 3.11, standard library only.  ``check(design, **params)``
explores every reachable state of a small closed model by breadth-first
search over a hashable state with a visited set, and returns a ``Result``
holding, per property, OK or the shortest counterexample trace (shortest in
number of steps, because the search is breadth first).

    python3 patches/model/replay_model.py [--design stock|park|scratch|all] [--json]

What is modelled
================

Two MPS clients on one GPU: ``A``, the faulting client (it may touch unmapped
addresses, a read-only page, or its own managed page), and ``B``, the
co-runner, which only touches its own managed, not-yet-resident pages (it
does nothing wrong).  With ``shared_tsg`` (the MPS case) both are
subcontexts (VEIDs) of the MPS server's single channel group (TSG0), each
with its own VA space; without it A is alone in TSG0 and B is in TSG1.

* Warps.  Each client has 1-2 warps, each on a uTLB (1-2 uTLBs with 1-2
  outstanding-fault slots).  A warp runs a finite program of accesses
  (B: its pages g0, g1, ... in order; A: at each access any of: the next
  unmapped page(s), a page it already has scratch-mapped, ``ro`` when
  ``perm_page``, ``m`` when ``bad_managed_page``).  A warp is RUN, FAULT
  (its miss holds a uTLB slot and is pending: "pending fault"), WAIT (missed
  while its uTLB's slots were full: stalled behind them, no packet), RETRY
  (replayed, access in flight), DONE or DEAD.  A FAULT warp's packet is in
  the HW fault buffer, in the bottom half's current batch, or consumed
  (fetched, not yet replayed).
* Bottom half (one thread per GPU), one step per action where order
  matters: fetch (+ instance-pointer translation), service, scratch map
  (``scratch`` only), replay or cancel, pass end.  Replay policy BATCH_FLUSH
  (the 580 default, ``UVM_PERF_FAULT_REPLAY_POLICY_DEFAULT``): the replay
  discards the packets still in the buffer and retries every pending access
  on the GPU (FAULT and WAIT warps -> RETRY); a retried access that hits a
  mapped page completes, otherwise it faults again (re-fault on replay),
  competing for its uTLB's slots in the order the RETRY steps run.  A pass
  ends when a fetch finds the buffer empty or after ``max_batches`` batches
  (``uvm_perf_fault_max_batches_per_service``); the closing replay is issued
  when the pass issued none.
* Cancel (stock): precise cancel of the fatal VA space's fatal faults; the
  NACKed access raises an MMU-fault exception handled by the resource manager
  (GSP-RM) with TSG scope: robust-channel recovery (RC) kills every client of
  the TSG.  The cancel path's closing flush replays everyone else.
* Preemption: a pending (FAULT) replayable fault blocks preemption of its
  TSG.  Preempt requests come from the scheduler (nondeterministic, while a
  fault is pending) and from teardown; one with ``preempt_timeout`` ticks of
  waiting makes RM recover the TSG (RC, reason ``preempt_timeout``).
* Teardown of A (voluntary exit at any time when ``client_exit``, or the
  SIGKILL gpuos sends on KILL_CLIENT, delivered nondeterministically but
  within ``kill_delay`` ticks): stop the channels (a preempt of the TSG,
  blocked by pending faults), then detach the subcontext.  What happens to
  A's warps still on the GPU at that point is the ``teardown`` parameter:
  ``evict`` (default: the MPS server removes the dying client's work when
  the preempt completes), ``drain`` (teardown waits until A's warps have
  finished, then preempts: nvUvmInterfaceStopChannel without bImmediate
  "idles the channel and takes it off the runlist", nv_uvm_interface.h),
  ``run_on`` (NVIDIA's table at the top of
  uvm_va_space_mm.c for MPS: after "Stop channels"/"Detach channels" the
  client's work can still access memory and fault; it keeps running after
  the detach and every access it makes faults, the page directory being
  gone).  A fault of A fetched after the detach cannot be translated
  (NV_ERR_PAGE_TABLE_NOT_AVAIL) and is cancelled GLOBALLY on the TSG's
  instance pointer: RC of the whole TSG.
* Time: a tick is one bottom-half pass (the pass-end step) or one idle
  period (bottom half idle, buffer empty).  Retries of replayed accesses,
  a SIGKILL whose delay has run out, a teardown or preempt that can
  complete, and RM's preempt timeout are urgent: no tick while one is
  enabled.  Counters (ages, busy periods, preempt waits, deadline) saturate
  just past their bound, so the state space is finite and the bounded
  properties below are checked exactly, over every path of unbounded length.

Designs (``design``):

``stock``
    fatal fault -> precise cancel -> RC of the TSG.
``park``
    gpuos's old 550 design (patches/0003): on ISOLATE/KILL_CLIENT the
    client's VA space is parked: its faults are never serviced nor
    cancelled; a batch of parked faults only is not replayed, nor is the
    closing replay issued when every batch of the pass was parked-only;
    KILL_CLIENT sends SIGKILL (asynchronous).
``scratch``
    the new design: when the faulting VA space is an MPS subcontext sharing
    its TSG with another live client, the fatal fault is on an unmapped
    address, the policy is ISOLATE or KILL_CLIENT, the client has budget
    left (``budget`` scratch regions) and the deadline (``deadline`` ticks
    since its first isolated fault) has not passed: map a scratch region at
    the faulting page in the same pass, before any cancel, then the normal
    replay; KILL_CLIENT also sends SIGKILL.  Anything else, or a failed
    scratch allocation (nondeterministic when ``alloc_can_fail``), gets the
    stock cancel (RC).  ``scratch_lock`` is how the scratch step gets the
    VA space lock.  Creating a new VA range needs it in write mode
    (uvm_va_range.c:uvm_va_range_initialize asserts it), and a teardown of
    that client sitting in uvm_va_space_stop_all_user_channels holds it
    (uvm_va_space_down_read_rm, with serialize_writers_lock, which
    uvm_va_space_down_write also takes) while its StopChannel preempt waits
    for the very fault the bottom half is trying to fix ("busy" below: a
    fault that would be mapped, of a client draining or stopping).

    ``try`` (the default: what patches/0005 does): gpuos_map_scratch TRIES
        the write lock (gpuos_va_space_trylock_write: uvm_mutex_trylock of
        serialize_writers_lock and read_acquire_write_release_lock,
        uvm_down_write_trylock of the lock).  Busy: nothing mapped, nothing
        cancelled; uvm_gpuos_contain_fatal_faults clears fatal_va_space and
        the batch is replayed like one without fatal faults; the fault
        re-faults and comes back in a later batch, where containment is
        tried again.  The rules' decision stands (the client is ACTIVE from
        that first decision: its deadline runs, KILL_CLIENT sends SIGKILL);
        after the deadline its fatal faults get the stock cancel (RC) for
        good (GAVE_UP).  The model finds that this keeps every property, but
        only because P1 counts an RC at the deadline as a fallback the
        design names: a client whose exit races its first fatal fault (it
        faults once) is retried until its deadline and then RC'd with its
        co-runners, where ``read`` contains it with no RC at all.
    ``read``: the mapping is made under the lock the bottom half already
        holds while servicing (read mode): never busy.  The design the
        README names as the real fix (PTEs outside any VA range); not done.
    ``write``: the step WAITS for the write lock: the bottom half blocks
        while the lock is busy (a deadlock with the teardown until RM's
        preempt timeout: P1 and P2 fail).

``policy`` is gpuos's decision for A: ``kill`` (KILL_CLIENT), ``isolate``
(ISOLATE) or ``default`` (stock behaviour).

Mutations of ``scratch`` (``mutations=[...]``), each a plausible
implementation mistake the properties must catch: ``no_deadline``,
``no_budget``, ``no_replay_after_map`` (the batch whose fatal faults were
scratch-mapped is treated like park's parked-only batch: no replay, and no
closing replay if every batch was such), ``no_shared_check`` (scratch also
for a client alone in its TSG), ``scratch_on_perm`` (scratch also over a
permission fault on a mapped page), ``no_sigkill`` (KILL_CLIENT never sends
the signal).

What is abstracted away
=======================

Addresses are pages; a scratch region is one page and its allocation
either succeeds or fails.  No prefetch faults, throttling, duplicate/merge
bookkeeping beyond "one packet per pending access", access types other than
the read-only page, ATS/HMM, non-replayable faults, access counters, the
BATCH / BLOCK / ONCE replay policies, Confidential Computing's shadow
buffer, pre-Volta cancel paths, OOM/ECC (cancel_fault_batch), locks other
than the one conflict ``scratch_lock`` models (every step is atomic),
CPU-side process state other than "alive / dying / gone", the freeing of
scratch regions, what the MPS server and RM really do with a dying client's
work (the ``teardown`` choice), and real time (ticks are passes).  One fault
buffer, one GPU.  The service of a fault on a managed page always succeeds.

Mapping of model steps to the 580.142 source (nvidia-uvm/)
==========================================================

=================  =========================================================
model step         source
=================  =========================================================
access (miss)      hardware: uTLB miss, MMU writes a packet to the
                   replayable fault buffer (read by
                   uvm_gpu_replayable_faults.c:fetch_fault_buffer_entries)
retry              hardware: the replay (host_hal->replay_faults pushed by
                   uvm_gpu_replayable_faults.c:push_replay_on_gpu) retries
                   the pending access
fetch              uvm_gpu_replayable_faults.c:uvm_parent_gpu_service_replayable_faults
                   -> fetch_fault_buffer_entries -> preprocess_fault_batch
                   -> translate_instance_ptrs
                   (uvm_gpu.c:uvm_parent_gpu_fault_entry_to_va_space)
global cancel      uvm_gpu_replayable_faults.c:translate_instance_ptrs,
                   NV_ERR_PAGE_TABLE_NOT_AVAIL -> push_cancel_on_gpu_global
                   -> fault_buffer_flush_locked; NV_WARN_MORE_PROCESSING_REQUIRED
                   -> the loop's ``continue``
service            uvm_gpu_replayable_faults.c:service_fault_batch ->
                   service_fault_batch_dispatch -> service_fault_batch_block
                   (resident) / service_fault_batch_fatal -> mark_fault_fatal
                   (fatal, batch_context->fatal_va_space); park: 0003's skip
                   of parked VA spaces and the gpuos report
                   (uvm_gpuos.c:uvm_gpuos_fatal_faults)
map_scratch        scratch design: uvm_gpuos.c:uvm_gpuos_contain_fatal_faults,
                   called between service_fault_batch and
                   ``if (batch_context->fatal_va_space)`` in
                   uvm_parent_gpu_service_replayable_faults: the rules
                   (uvm_gpuos_isolate.c:gpuos_iso_check / gpuos_iso_decided),
                   then gpuos_map_scratch (uvm_va_range_create_gpuos_scratch);
                   ``try`` busy: gpuos_va_space_trylock_write fails,
                   NV_ERR_BUSY_RETRY, fatal_va_space/fatal_gpu cleared
cancel             uvm_gpu_replayable_faults.c:cancel_faults_precise ->
                   service_fault_batch_for_cancel -> cancel_fault_precise_va,
                   closing fault_buffer_flush_locked (replay); then GSP-RM RC
                   of the TSG (outside nvidia-uvm)
replay             uvm_gpu_replayable_faults.c:fault_buffer_flush_locked
                   (BATCH_FLUSH policy branch of the loop) -> push_replay_on_gpu
pass_end           end of uvm_parent_gpu_service_replayable_faults: the
                   closing push_replay_on_parent_gpu when num_replays == 0
                   (park: skipped when every batch was parked-only)
sigkill / exit     gpuos.ko work item (KILL_CLIENT) / process exit ->
                   uvm_va_space.c:uvm_va_space_destroy
teardown preempt   uvm_va_space.c:uvm_va_space_stop_all_user_channels ->
                   uvm_user_channel.c:uvm_user_channel_stop
                   (nvUvmInterfaceStopChannel: RM preempt), then
                   uvm_va_space_detach_all_user_channels ->
                   uvm_user_channel_detach -> uvm_gpu.c:uvm_parent_gpu_remove_user_channel
                   (from then on the subcontext no longer translates)
preempt / timeout  RM / host scheduler (not in nvidia-uvm)
tick               time: one bottom-half pass or one idle period
=================  =========================================================

Properties
==========

P1      every co-runner (B) access that misses completes (its fault is
        serviced and replayed) within ``K`` ticks of the miss, and B is never
        killed by RC unless the cause is a fallback the design names
        (scratch: budget, deadline, alloc_fail, not_unmapped, sole_tsg;
        every design: policy_default).  RC from a stock cancel the design
        should have prevented, from a preempt timeout or from a global
        cancel violates P1.
P2      no channel stays unpreemptible longer than ``p2_bound`` ticks: no
        fault stays pending (neither replayed nor cancelled) for more than
        ``p2_bound`` ticks, and the faulting client A does not have a pending
        fault at more than ``p2_bound`` consecutive ticks (a run of fresh
        faults keeps its TSG unpreemptible just the same).  The run rule
        counts A's faults only: a stream of the co-runner's legitimate faults
        is not the design's doing (its delays are P1's business).
P3      (KILL_CLIENT) the isolated/parked client is stopped (RC'd, torn down,
        or all its warps finished) within ``p3_bound`` ticks of its first
        isolated fault; scratch never maps more than ``budget`` regions for a
        client, nor after its deadline.
SAFETY  no global cancel because of NV_ERR_PAGE_TABLE_NOT_AVAIL.
RULES   (scratch) a scratch region is only mapped at an unmapped page of a
        client that shares its TSG with another live client, under ISOLATE or
        KILL_CLIENT.
NODEADLOCK  every reachable state has a successor (model sanity).

Bounds, from the model's size (G = the co-runner's accesses, good_accesses x
good_warps; under an adversarial schedule each of its faults can hold a
preempt request for one pass; L = 1 when A has a managed page, whose
legitimate fault precedes its first isolated one):
``K = p2_bound = deadline + 1 + L``, ``p3_bound = kill_delay + deadline + G +
2``, ``preempt_timeout = deadline + G + 2`` (the model's stand-in for RM's preemption timeout, which is far longer
than a pass in reality: the deadline must stay well below it).

Scheduling is adversarial: nothing forces a warp to issue, or forces a
preempt to complete before a warp's next access; only the urgent steps above
are forced before time advances.  A violation may therefore need an unlucky
but possible timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

# ---------------------------------------------------------------- constants

RUN, FAULT, WAIT, RETRY, DONE, DEAD = range(6)
ST_NAME = ("RUN", "FAULT", "WAIT", "RETRY", "DONE", "DEAD")
# packet location of a FAULT warp
PK_NONE, PK_BUF, PK_BATCH = range(3)
# client teardown state
ALIVE, DRAIN, STOP, GONE, RCD = range(5)
TD_NAME = ("alive", "draining", "stopping", "gone", "rc")
# page kinds
UNMAPPED, PERM, MANAGED = range(3)
# bottom-half phases
IDLE, FETCHED, SERVICED, LOOP = range(4)
PH_NAME = ("idle", "fetched", "serviced", "loop")

# batch entry outcomes: 'P' fetched, 'S' serviced/ok, 'K' parked,
# 'M' scratch-mapped, '?' fatal awaiting the scratch decision,
# 'F:<reason>' fatal, to be cancelled (stock)
ALLOWED_FALLBACK = {
    "stock": {"policy_default"},
    "park": {"policy_default"},
    "scratch": {"policy_default", "budget", "deadline", "alloc_fail",
                "not_unmapped", "sole_tsg"},
}

DESIGNS = ("stock", "park", "scratch")
PROPS = ("P1", "P2", "P3", "SAFETY", "RULES", "NODEADLOCK")
PROP_TITLE = {
    "P1": "co-runner faults serviced within K; no unjustified RC of a co-runner",
    "P2": "no TSG unpreemptible (pending fault) for more than p2_bound ticks",
    "P3": "KILL_CLIENT: isolated client stopped in bound; scratch within budget/deadline",
    "SAFETY": "no global cancel (NV_ERR_PAGE_TABLE_NOT_AVAIL)",
    "RULES": "scratch only at unmapped pages of shared-TSG clients under ISOLATE/KILL",
    "NODEADLOCK": "every state has a successor",
}
MUTATIONS = ("no_deadline", "no_budget", "no_replay_after_map",
             "no_shared_check", "scratch_on_perm", "no_sigkill")

DEFAULTS = dict(
    policy="kill",            # kill | isolate | default
    shared_tsg=True,          # A and B subcontexts of one TSG (MPS)
    bad_warps=1,
    good_warps=1,
    same_utlb=True,           # B's warps on A's uTLB (else on uTLB1)
    utlb_slots=1,
    bad_pages=2,              # unmapped pages A may touch
    perm_page=False,          # A may write its mapped read-only page
    bad_managed_page=False,   # A may touch a legit managed page of its own
    bad_accesses=3,
    good_accesses=2,
    budget=2,
    deadline=2,
    kill_delay=1,
    alloc_can_fail=True,
    client_exit=True,
    preempt_requests=True,
    preempt_timeout="auto",   # ticks; None: no RM preempt timeout
    teardown="evict",         # evict | drain | run_on
    scratch_lock="try",       # try | read | write: how the scratch step gets the VA space lock
    max_batches=2,
    K=None,
    p2_bound=None,
    p3_bound=None,
    mutations=(),
    max_states=3_000_000,
)


# ------------------------------------------------------------------ results

@dataclass
class PropertyResult:
    name: str
    title: str
    applicable: bool = True
    ok: bool = True
    violations: int = 0           # violating transitions/states found
    message: str = ""
    trace: list = field(default_factory=list)


@dataclass
class Result:
    design: str
    params: dict
    states: int
    transitions: int
    seconds: float
    complete: bool                # False if max_states cut the search
    properties: dict              # name -> PropertyResult
    info: dict                    # reachable notable events -> shortest trace

    def ok(self, prop: str) -> bool:
        return self.properties[prop].ok

    def violated(self) -> list:
        return [n for n, p in self.properties.items() if not p.ok]

    def to_dict(self) -> dict:
        d = asdict(self)
        return d


# -------------------------------------------------------------------- model

class Model:
    def __init__(self, design: str, p: dict):
        if design not in DESIGNS:
            raise ValueError(f"design must be one of {DESIGNS}")
        self.design = design
        self.p = p
        for m in p["mutations"]:
            if m not in MUTATIONS:
                raise ValueError(f"unknown mutation {m!r}")
        if p["teardown"] not in ("evict", "drain", "run_on"):
            raise ValueError("teardown must be evict, drain or run_on")
        if p["scratch_lock"] not in ("try", "read", "write"):
            raise ValueError("scratch_lock must be try, read or write")
        if p["policy"] not in ("kill", "isolate", "default"):
            raise ValueError("policy must be kill, isolate or default")
        self.mut = frozenset(p["mutations"])
        T = p["deadline"]
        self.T = T
        # A's own legitimate faults (its managed page) before its first isolated
        # fault are ordinary traffic the design cannot shorten: one pass each
        L = 1 if p["bad_managed_page"] else 0
        self.K = p["K"] if p["K"] is not None else T + 1 + L
        self.p2 = p["p2_bound"] if p["p2_bound"] is not None else T + 1 + L
        # the co-runner's own fault traffic: under an adversarial schedule each of its
        # faults can hold a preempt request for one pass
        G = p["good_accesses"] * p["good_warps"]
        self.p3 = p["p3_bound"] if p["p3_bound"] is not None else p["kill_delay"] + T + G + 2
        pt = p["preempt_timeout"]
        self.ptimeout = (T + G + 2) if pt == "auto" else pt
        self.pcap = (self.ptimeout + 1) if self.ptimeout is not None else self.p2 + 1
        self.agecap = max(T, self.p3) + 1

        # clients: 0 = A (faulting), 1 = B (co-runner)
        self.cname = ("A", "B")
        self.good = (False, True)
        self.ctsg = (0, 0 if p["shared_tsg"] else 1)
        self.ntsg = 1 if p["shared_tsg"] else 2
        # warps
        wc, wu, wn = [], [], []
        for k in range(p["bad_warps"]):
            wc.append(0); wu.append(0); wn.append(f"A.w{k}")
        for k in range(p["good_warps"]):
            wc.append(1); wu.append(0 if p["same_utlb"] else 1); wn.append(f"B.w{k}")
        self.wclient, self.wutlb, self.wname = tuple(wc), tuple(wu), tuple(wn)
        self.nw = len(wc)
        self.cwarps = tuple(tuple(i for i in range(self.nw) if wc[i] == c) for c in range(2))
        # pages
        pn, pk, po = [], [], []
        self.upages = []
        for k in range(p["bad_pages"]):
            self.upages.append(len(pn)); pn.append(f"u{k}"); pk.append(UNMAPPED); po.append(0)
        self.ro = self.mpage = None
        if p["perm_page"]:
            self.ro = len(pn); pn.append("ro"); pk.append(PERM); po.append(0)
        if p["bad_managed_page"]:
            self.mpage = len(pn); pn.append("m"); pk.append(MANAGED); po.append(0)
        self.gseq = []
        for k in range(p["good_accesses"]):
            self.gseq.append(len(pn)); pn.append(f"g{k}"); pk.append(MANAGED); po.append(1)
        self.pname, self.pkind, self.powner = tuple(pn), tuple(pk), tuple(po)
        self.allowed = ALLOWED_FALLBACK[design]

    # ---- state layout
    # state = (warps, mapped, clients, tsgs, bh)
    # warp   = (st, page, rem, pk, wage, fage)
    # client = (td, killcd, iso_age, nscratch, parked)
    # tsg    = (busy, pwait)   busy: consecutive ticks with a pending fault of A
    # bh     = (phase, batch, nb, nrep, allskip)   batch = ((wid, outcome), ...)

    def initial(self):
        p = self.p
        warps = []
        for i in range(self.nw):
            rem = p["bad_accesses"] if self.wclient[i] == 0 else p["good_accesses"]
            warps.append((RUN if rem else DONE, -1, rem, PK_NONE, 0, 0))
        clients = tuple((ALIVE, -1, -1, 0, False) for _ in range(2))
        tsgs = tuple((0, -1) for _ in range(self.ntsg))
        return (tuple(warps), 0, clients, tsgs, (IDLE, (), 0, 0, True))

    # ---- description helpers
    def wdesc(self, i, page):
        return f"{self.wname[i]}@{self.pname[page]}" if page >= 0 else self.wname[i]

    def describe(self, s) -> str:
        warps, mapped, clients, tsgs, bh = s
        ws = []
        for i, (st, page, rem, pk, wage, fage) in enumerate(warps):
            extra = ""
            if st in (FAULT, WAIT, RETRY):
                extra = f"@{self.pname[page]}"
            if st == FAULT:
                extra += ("", "[buf]", "[batch]")[pk] + (f" pending={fage}" if fage else "")
            ws.append(f"{self.wname[i]}={ST_NAME[st]}{extra} rem={rem}"
                      + (f" age={wage}" if self.good[self.wclient[i]] and wage else ""))
        mp = [self.pname[k] for k in range(len(self.pname)) if mapped >> k & 1]
        cs = []
        for c, (td, kcd, age, nsc, parked) in enumerate(clients):
            x = f"{self.cname[c]}:{TD_NAME[td]}"
            if kcd >= 0:
                x += f" sigkill-in<={kcd}"
            if age >= 0:
                x += f" iso_age={age}"
            if nsc:
                x += f" scratch={nsc}"
            if parked:
                x += " parked"
            cs.append(x)
        ts = [f"TSG{t}: busy={b}" + (f" preempt-wait={w}" if w >= 0 else "")
              for t, (b, w) in enumerate(tsgs)]
        ph, batch, nb, nrep, allskip = bh
        b = ",".join(f"{self.wname[i]}:{o}" for i, o in batch)
        return (f"[{'; '.join(ws)}] mapped={{{','.join(mp)}}} "
                f"{' '.join(cs)} | {' '.join(ts)} | BH {PH_NAME[ph]}"
                + (f" batch=({b})" if batch else "") + f" batches={nb} replays={nrep}")

    # ---- successor function
    def successors(self, s):
        """Yield (label, state, events); events = [(prop_or_info, message)]."""
        warps, mapped, clients, tsgs, bh = s
        p = self.p
        out = []
        phase, batch, nb, nrep, allskip = bh

        def m():
            return Mut(self, s)

        buf_nonempty = any(w[0] == FAULT and w[3] == PK_BUF for w in warps)
        any_retry = any(w[0] == RETRY for w in warps)

        # ---------------- warps: accesses and retries
        for i, w in enumerate(warps):
            st, page, rem, pk, wage, fage = w
            c = self.wclient[i]
            if st == RUN and rem > 0:
                for tgt in self.targets(s, i):
                    x = m()
                    lab = x.resolve(i, tgt, fresh=True)
                    out.append((f"{self.wname[i]} access {self.pname[tgt]}: {lab}", x.freeze(), x.ev))
            elif st == RETRY:
                x = m()
                lab = x.resolve(i, page, fresh=False)
                out.append((f"{self.wname[i]} retry {self.pname[page]} (replayed): {lab}",
                            x.freeze(), x.ev))

        # ---------------- bottom half
        if phase == IDLE and buf_nonempty or phase == LOOP and buf_nonempty and nb < p["max_batches"]:
            out.append(self.step_fetch(s))
        if phase == FETCHED:
            out.append(self.step_service(s))
        bh_blocked = False
        if phase == SERVICED:
            outs = [o for _, o in batch]
            if "?" in outs:
                if self.map_blocked(s):
                    if p["scratch_lock"] == "try":
                        out.append(self.step_map_busy(s))
                    else:
                        bh_blocked = True
                else:
                    out.extend(self.step_map_scratch(s))
            elif any(o.startswith("F:") for o in outs):
                out.append(self.step_cancel(s))
            else:
                out.append(self.step_replay(s))

        # ---------------- environment: signals, teardown, preemption
        urgent = False
        for c in range(2):
            td, kcd, age, nsc, parked = clients[c]
            if kcd >= 0 and td in (ALIVE,):
                x = m()
                x.begin_teardown(c)
                out.append((f"SIGKILL delivered to {self.cname[c]} (gpuos work item): process dies, "
                            f"teardown starts (uvm_va_space_destroy)", x.freeze(), x.ev))
                if kcd == 0:
                    urgent = True
            if c == 0 and td == ALIVE and kcd < 0 and p["client_exit"]:
                x = m()
                x.begin_teardown(c)
                out.append((f"{self.cname[c]} exits: teardown starts (uvm_va_space_destroy)",
                            x.freeze(), x.ev))
            if td == DRAIN and all(warps[i][0] in (DONE, DEAD) for i in self.cwarps[c]):
                x = m()
                x.C[c][0] = STOP
                t = self.ctsg[c]
                if x.T[t][1] < 0:
                    x.T[t][1] = 0
                out.append((f"{self.cname[c]}'s work drained: stop channels, preempt TSG{t} requested",
                            x.freeze(), x.ev))
                urgent = True
        for t in range(self.ntsg):
            busy, pwait = tsgs[t]
            tsg_fault = any(warps[i][0] == FAULT and self.ctsg[self.wclient[i]] == t
                            for i in range(self.nw))
            alive = any(clients[c][0] in (ALIVE, DRAIN, STOP) for c in range(2) if self.ctsg[c] == t)
            if pwait < 0 and tsg_fault and p["preempt_requests"] and alive:
                x = m()
                x.T[t][1] = 0
                out.append((f"scheduler requests preempt of TSG{t} (blocked while a fault is pending)",
                            x.freeze(), x.ev))
            if pwait >= 0 and not tsg_fault:
                x = m()
                lab = x.preempt_complete(t)
                out.append((lab, x.freeze(), x.ev))
                urgent = True
            if pwait >= 0 and self.ptimeout is not None and pwait > self.ptimeout:
                x = m()
                x.rc(t, "preempt_timeout")
                out.append((f"RM preempt timeout on TSG{t} (waited {pwait} ticks): RC of TSG{t}",
                            x.freeze(), x.ev))
                urgent = True

        # ---------------- time
        if not urgent and not any_retry:
            if phase == LOOP and (not buf_nonempty or nb >= p["max_batches"]):
                out.append(self.step_pass_end(s))
            elif phase == IDLE and not buf_nonempty:
                x = m()
                x.tick()
                out.append(("tick (bottom half idle)", x.freeze(), x.ev))
            elif bh_blocked:
                x = m()
                x.tick()
                out.append(("tick (bottom half blocked in uvm_va_space_down_write: the teardown "
                            "holds the VA space lock (down_read_rm) while its StopChannel waits)",
                            x.freeze(), x.ev))
        return out

    def map_blocked(self, s):
        """scratch_lock=write/try: the scratch step needs the VA space lock for
        write (uvm_va_range_initialize asserts it); a teardown in
        uvm_va_space_stop_all_user_channels holds it (down_read_rm, with
        serialize_writers_lock) until its StopChannel (a preempt) returns.
        True when a fault of the batch would be mapped while that lock is
        busy: ``write`` then waits (the bottom half blocks), ``try`` fails the
        trylock (step_map_busy)."""
        if self.p["scratch_lock"] not in ("write", "try"):
            return False
        warps, mapped, clients = s[0], s[1], s[2]
        for i, o in s[4][1]:
            c, page = self.wclient[i], warps[i][1]
            if (o == "?" and clients[c][0] in (DRAIN, STOP) and not mapped >> page & 1
                    and self.fallback_reason(clients, c, page)[0] is None):
                return True       # this one would be mapped: needs the write lock
        return False

    def targets(self, s, i):
        """Pages warp i may access next."""
        warps, mapped, clients, tsgs, bh = s
        c = self.wclient[i]
        if c == 1:
            rem = warps[i][2]
            return [self.gseq[self.p["good_accesses"] - rem]]
        res = []
        unm = [pg for pg in self.upages if not mapped >> pg & 1]
        res.extend(unm[: self.p["bad_warps"]])     # symmetry: the next fresh pages
        scr = [pg for pg in self.upages if mapped >> pg & 1]
        if scr:
            res.append(scr[0])                      # runs on its scratch page
        if self.ro is not None:
            res.append(self.ro)
        if self.mpage is not None:
            res.append(self.mpage)
        return res

    # ---- bottom-half steps
    def step_fetch(self, s):
        x = Mut(self, s)
        if x.phase == IDLE:
            x.nb, x.nrep, x.allskip = 0, 0, True
        entries = [i for i in range(self.nw) if x.W[i][0] == FAULT and x.W[i][3] == PK_BUF]
        gone = [i for i in entries if x.C[self.wclient[i]][0] == GONE]
        if gone:
            i = gone[0]
            t = self.ctsg[self.wclient[i]]
            x.ev.append(("SAFETY", f"fault of {self.wname[i]} whose subcontext was detached: "
                                   f"NV_ERR_PAGE_TABLE_NOT_AVAIL -> global cancel of TSG{t}"))
            x.rc(t, "global_cancel")
            x.flush_and_replay()          # fault_buffer_flush_locked: counts as a replay
            x.nrep += 1
            x.allskip = False
            x.phase = LOOP
            return (f"BH fetch_fault_buffer_entries+translate_instance_ptrs: {self.wname[i]}'s "
                    f"subcontext is gone (NV_ERR_PAGE_TABLE_NOT_AVAIL) -> push_cancel_on_gpu_global "
                    f"on TSG{t} -> RC of TSG{t}; flush+replay, continue", x.freeze(), x.ev)
        for i in entries:
            x.W[i][3] = PK_BATCH
        x.batch = [(i, "P") for i in entries]
        x.phase = FETCHED
        names = ",".join(self.wdesc(i, x.W[i][1]) for i in entries)
        return (f"BH fetch_fault_buffer_entries: batch [{names}]", x.freeze(), x.ev)

    def step_service(self, s):
        x = Mut(self, s)
        res = []
        pol = self.p["policy"]
        for k, (i, _) in enumerate(x.batch):
            c = self.wclient[i]
            page = x.W[i][1]
            kind = self.pkind[page]
            if self.design == "park" and x.C[c][4]:
                o = "K"
            elif x.mapped >> page & 1:
                o = "S"
            elif kind == MANAGED:
                x.mapped |= 1 << page
                o = "S"
            else:  # fatal: unmapped address or permission violation
                if pol == "default":
                    o = "F:policy_default"
                elif self.design == "stock":
                    o = "F:stock"
                elif self.design == "park":
                    cl = x.C[c]
                    cl[4] = True
                    if cl[2] < 0:
                        cl[2] = 0
                    if pol == "kill" and cl[1] < 0 and cl[0] == ALIVE:
                        cl[1] = self.p["kill_delay"]
                    o = "K"
                else:
                    o = "?"
            x.batch[k] = (i, o)
            res.append(f"{self.wdesc(i, page)}->{self.oname(o)}")
        x.phase = SERVICED
        return (f"BH service_fault_batch: {', '.join(res)}", x.freeze(), x.ev)

    @staticmethod
    def oname(o):
        return {"S": "serviced", "K": "parked (skipped)", "M": "scratch-mapped",
                "B": "lock busy, replayed unmapped",
                "?": "fatal (gpuos decides)", "P": "fetched"}.get(o, "fatal/" + o[2:])

    def step_map_scratch(self, s):
        """Scratch design: decide each fatal fault; map scratch or fall back."""
        base = Mut(self, s)
        pol = self.p["policy"]
        # list of partial results: (Mut, labels)
        partial = [(base, [])]
        for k, (i, o) in enumerate(base.batch):
            if o != "?":
                continue
            c = self.wclient[i]
            page = base.W[i][1]
            nxt = []
            for x, labs in partial:
                cl = x.C[c]
                tsg = self.ctsg[c]
                if x.mapped >> page & 1:
                    x.batch[k] = (i, "S")
                    nxt.append((x, labs + [f"{self.wdesc(i, page)} already scratch-mapped"]))
                    continue
                reason, shared, unmapped = self.fallback_reason(x.C, c, page)
                if reason:
                    x.batch[k] = (i, "F:" + reason)
                    nxt.append((x, labs + [f"{self.wdesc(i, page)}: stock cancel ({reason})"]))
                    continue
                if self.p["alloc_can_fail"]:
                    y = x.copy()
                    y.batch[k] = (i, "F:alloc_fail")
                    nxt.append((y, labs + [f"{self.wdesc(i, page)}: scratch allocation FAILS "
                                                  "-> stock cancel"]))
                # success
                if cl[3] >= self.p["budget"]:
                    x.ev.append(("P3", f"scratch region #{cl[3] + 1} for {self.cname[c]} exceeds the budget "
                                       f"{self.p['budget']}"))
                if cl[2] >= self.T:
                    x.ev.append(("P3", f"scratch mapped for {self.cname[c]} {cl[2]} ticks after its first "
                                       f"isolated fault (deadline {self.T})"))
                if not unmapped:
                    x.ev.append(("RULES", f"scratch mapped over {self.pname[page]}, a mapped page "
                                          f"(permission fault), replacing the client's mapping"))
                if not shared:
                    x.ev.append(("RULES", f"scratch mapped for {self.cname[c]}, alone in TSG{tsg} "
                                          f"(the stock cancel would harm nobody)"))
                x.mapped |= 1 << page
                cl[3] += 1
                if cl[2] < 0:
                    cl[2] = 0
                if pol == "kill" and cl[1] < 0 and cl[0] == ALIVE and "no_sigkill" not in self.mut:
                    cl[1] = self.p["kill_delay"]
                x.batch[k] = (i, "M")
                nxt.append((x, labs + [f"{self.wdesc(i, page)}: scratch region #{cl[3]} mapped"]))
            partial = nxt
        res = []
        for x, labs in partial:
            res.append((f"BH gpuos scratch step (before any cancel): {'; '.join(labs)}", x.freeze(), x.ev))
        return res

    def step_map_busy(self, s):
        """scratch_lock=try, lock busy (map_blocked): gpuos_map_scratch's
        gpuos_va_space_trylock_write fails -> NV_ERR_BUSY_RETRY:
        uvm_gpuos_contain_fatal_faults maps nothing, cancels nothing, clears
        fatal_va_space; the loop replays the batch as one without fatal
        faults, and the fault re-faults and comes back in a later batch.  The
        rules already decided (gpuos_iso_decided): the client is ACTIVE, its
        deadline runs from this first decision, KILL_CLIENT sends SIGKILL.
        Faults the rules send to the stock cancel keep that outcome.  Only A
        faults fatally, so every fault it would map is of the one client whose
        teardown holds the lock."""
        x = Mut(self, s)
        pol = self.p["policy"]
        labs = []
        for k, (i, o) in enumerate(x.batch):
            if o != "?":
                continue
            c = self.wclient[i]
            page = x.W[i][1]
            cl = x.C[c]
            if x.mapped >> page & 1:
                x.batch[k] = (i, "S")
                labs.append(f"{self.wdesc(i, page)} already scratch-mapped")
                continue
            reason = self.fallback_reason(x.C, c, page)[0]
            if reason:
                x.batch[k] = (i, "F:" + reason)
                labs.append(f"{self.wdesc(i, page)}: stock cancel ({reason})")
                continue
            if cl[2] < 0:
                cl[2] = 0
            if pol == "kill" and cl[1] < 0 and cl[0] == ALIVE and "no_sigkill" not in self.mut:
                cl[1] = self.p["kill_delay"]
            x.batch[k] = (i, "B")
            x.ev.append((f"info:scratch lock busy, {self.cname[c]} replayed unmapped",
                         f"{self.wdesc(i, page)}: VA space write lock busy ({self.cname[c]} "
                         f"{TD_NAME[cl[0]]}), replayed without mapping or cancelling"))
            labs.append(f"{self.wdesc(i, page)}: VA space lock busy ({self.cname[c]}'s teardown "
                        f"holds it) -> not mapped, not cancelled, fatal_va_space cleared")
        return (f"BH gpuos scratch step, gpuos_va_space_trylock_write fails (NV_ERR_BUSY_RETRY): "
                f"{'; '.join(labs)}", x.freeze(), x.ev)

    def fallback_reason(self, clients, c, page):
        """The scratch design's rule: (reason for the stock cancel or None, shared, unmapped)."""
        cl = clients[c]
        shared = any(clients[d][0] in (ALIVE, DRAIN, STOP) for d in range(2)
                     if d != c and self.ctsg[d] == self.ctsg[c])
        unmapped = self.pkind[page] == UNMAPPED
        reason = None
        if self.p["policy"] not in ("kill", "isolate"):
            reason = "policy_default"
        elif not unmapped and "scratch_on_perm" not in self.mut:
            reason = "not_unmapped"
        elif not shared and "no_shared_check" not in self.mut:
            reason = "sole_tsg"
        elif cl[3] >= self.p["budget"] and "no_budget" not in self.mut:
            reason = "budget"
        elif cl[2] >= self.T and "no_deadline" not in self.mut:
            reason = "deadline"
        return reason, shared, unmapped

    def step_cancel(self, s):
        x = Mut(self, s)
        fatal = sorted((self.wclient[i], i, o) for i, o in x.batch if o.startswith("F:"))
        c, i, o = fatal[0]
        reason = o[2:]
        t = self.ctsg[c]
        x.rc(t, reason)
        x.flush_and_replay()
        x.nrep += 1
        x.allskip = False
        x.nb += 1
        x.batch = []
        x.phase = LOOP
        return (f"BH cancel_faults_precise -> service_fault_batch_for_cancel: cancel_fault_precise_va "
                f"{self.wdesc(i, s[0][i][1])} ({reason}) -> GSP-RM RC of TSG{t}; closing "
                f"fault_buffer_flush_locked replays the rest", x.freeze(), x.ev)

    def step_replay(self, s):
        x = Mut(self, s)
        outs = [o for _, o in x.batch]
        skip = False
        why = ""
        if self.design == "park" and outs and all(o == "K" for o in outs):
            skip, why = True, "parked-only batch"
        if ("no_replay_after_map" in self.mut and outs and "M" in outs
                and all(o in ("M", "K") for o in outs)):
            skip, why = True, "scratch-mapped-only batch (mutation)"
        x.nb += 1
        x.phase = LOOP
        if skip:
            for i, _ in x.batch:
                if x.W[i][0] == FAULT:
                    x.W[i][3] = PK_NONE     # packet consumed, warp still stalled
            x.batch = []
            return (f"BH skips the replay ({why}): its warps stay stalled", x.freeze(), x.ev)
        x.flush_and_replay()
        x.nrep += 1
        x.allskip = False
        x.batch = []
        return ("BH fault_buffer_flush_locked + push_replay_on_gpu (BATCH_FLUSH): "
                "all pending accesses retried", x.freeze(), x.ev)

    def step_pass_end(self, s):
        x = Mut(self, s)
        skip_closing = (x.allskip and x.nb > 0 and
                        (self.design == "park" or "no_replay_after_map" in self.mut))
        lab = "BH pass ends"
        if x.nrep == 0 and not skip_closing:
            x.flush_and_replay()
            lab += " with the closing push_replay_on_parent_gpu (no replay yet in this pass)"
        elif x.nrep == 0:
            lab += " WITHOUT the closing replay (every batch was skipped)"
        x.phase = IDLE
        x.batch = []
        x.nb, x.nrep, x.allskip = 0, 0, True
        x.tick()
        return (lab + "; tick", x.freeze(), x.ev)


class Mut:
    """Mutable copy of a state, for building one successor."""

    __slots__ = ("md", "W", "mapped", "C", "T", "phase", "batch", "nb", "nrep", "allskip", "ev")

    def __init__(self, md, s=None):
        self.md = md
        if s is None:
            return
        warps, mapped, clients, tsgs, bh = s
        self.W = [list(w) for w in warps]
        self.mapped = mapped
        self.C = [list(c) for c in clients]
        self.T = [list(t) for t in tsgs]
        self.phase, batch, self.nb, self.nrep, self.allskip = bh
        self.batch = list(batch)
        self.ev = []

    def copy(self):
        y = Mut(self.md)
        y.W = [list(w) for w in self.W]
        y.mapped = self.mapped
        y.C = [list(c) for c in self.C]
        y.T = [list(t) for t in self.T]
        y.phase, y.batch = self.phase, list(self.batch)
        y.nb, y.nrep, y.allskip = self.nb, self.nrep, self.allskip
        y.ev = list(self.ev)
        return y

    def freeze(self):
        return (tuple(tuple(w) for w in self.W), self.mapped,
                tuple(tuple(c) for c in self.C), tuple(tuple(t) for t in self.T),
                (self.phase, tuple(self.batch), self.nb, self.nrep, self.allskip))

    def slots_used(self, u):
        md = self.md
        return sum(1 for i in range(md.nw) if self.W[i][0] == FAULT and md.wutlb[i] == u)

    def resolve(self, i, page, fresh):
        """Warp i accesses page (a new access or the retry of a replayed one)."""
        md = self.md
        w = self.W[i]
        c = md.wclient[i]
        gone = self.C[c][0] == GONE          # run_on only: page directory unset
        if not gone and self.mapped >> page & 1:
            w[2] -= 1
            w[0] = DONE if w[2] == 0 else RUN
            w[1] = -1
            w[3] = PK_NONE
            w[4] = 0
            w[5] = 0
            return "hit, completes"
        w[1] = page
        u = md.wutlb[i]
        w[5] = 0
        why = "subcontext gone, page directory unset" if gone else "miss"
        if self.slots_used(u) < md.p["utlb_slots"]:
            w[0] = FAULT
            w[3] = PK_BUF
            return f"{why} -> fault packet (uTLB{u} slot {self.slots_used(u)}/{md.p['utlb_slots']})"
        w[0] = WAIT
        w[3] = PK_NONE
        return f"{why}, uTLB{u} slots full -> stalls behind them (no packet)"

    def flush_and_replay(self):
        """fault_buffer_flush_locked + replay: packets discarded, all pending accesses retried."""
        for w in self.W:
            if w[0] in (FAULT, WAIT):
                w[0] = RETRY
            w[3] = PK_NONE
            w[5] = 0

    def rc(self, t, reason):
        """Robust-channel recovery of TSG t: every client of it dies."""
        md = self.md
        for c in range(2):
            if md.ctsg[c] != t or self.C[c][0] == RCD:
                continue
            was = self.C[c][0]
            self.C[c][0] = RCD
            self.C[c][1] = -1
            for i in md.cwarps[c]:
                if self.W[i][0] != DONE:
                    self.W[i][0] = DEAD
                self.W[i][3] = PK_NONE
                self.W[i][5] = 0
            if md.good[c] and was != GONE:
                if reason in md.allowed:
                    self.ev.append((f"info:co-runner RC ({reason})",
                                    f"co-runner {md.cname[c]} killed by RC of TSG{t}: "
                                    f"allowed fallback '{reason}'"))
                else:
                    self.ev.append(("P1", f"co-runner {md.cname[c]} killed by RC of TSG{t} ({reason}), "
                                          f"which the design should have prevented"))
            elif not md.good[c]:
                self.ev.append((f"info:RC of {md.cname[c]} ({reason})",
                                f"{md.cname[c]} killed by RC of TSG{t} ({reason})"))
        self.T[t] = [0, -1]
        self.batch = [(i, o) for i, o in self.batch if self.W[i][0] == FAULT]

    def begin_teardown(self, c):
        md = self.md
        self.C[c][1] = -1
        if md.p["teardown"] == "drain":
            self.C[c][0] = DRAIN
        else:
            self.C[c][0] = STOP
            t = md.ctsg[c]
            if self.T[t][1] < 0:
                self.T[t][1] = 0

    def preempt_complete(self, t):
        md = self.md
        self.T[t][1] = -1
        lab = f"preempt of TSG{t} completes (no pending fault)"
        for c in range(2):
            if md.ctsg[c] == t and self.C[c][0] == STOP:
                self.C[c][0] = GONE
                if md.p["teardown"] in ("evict", "drain"):
                    for i in md.cwarps[c]:
                        if self.W[i][0] != DONE:
                            self.W[i][0] = DEAD
                        self.W[i][3] = PK_NONE
                        self.W[i][5] = 0
                    lab += f"; {md.cname[c]}'s work evicted, subcontext detached (uvm_user_channel_detach)"
                else:
                    running = [md.wname[i] for i in md.cwarps[c] if self.W[i][0] not in (DONE, DEAD)]
                    lab += (f"; {md.cname[c]}'s channels stopped and subcontext detached "
                            f"(uvm_user_channel_detach); its work keeps running: {running or 'none'}")
        return lab

    def tick(self):
        md = self.md
        for i in range(md.nw):
            if self.W[i][0] == FAULT:
                self.W[i][5] = min(self.W[i][5] + 1, md.p2 + 1)
                if self.W[i][5] > md.p2:
                    self.ev.append(("P2", f"{md.wname[i]}'s fault on {md.pname[self.W[i][1]]} pending "
                                          f"(neither replayed nor cancelled) for {self.W[i][5]} ticks "
                                          f"(bound {md.p2}): TSG{md.ctsg[md.wclient[i]]} unpreemptible"))
        for t in range(md.ntsg):
            pending = any(self.W[i][0] == FAULT and md.ctsg[md.wclient[i]] == t
                          and not md.good[md.wclient[i]] for i in range(md.nw))
            if pending:
                self.T[t][0] = min(self.T[t][0] + 1, md.p2 + 1)
                if self.T[t][0] > md.p2:
                    self.ev.append(("P2", f"TSG{t} has had a pending fault of the faulting client at "
                                          f"{self.T[t][0]} consecutive ticks (bound {md.p2}): unpreemptible"))
            else:
                self.T[t][0] = 0
            if self.T[t][1] >= 0:
                self.T[t][1] = min(self.T[t][1] + 1, md.pcap)
        for i in range(md.nw):
            if md.good[md.wclient[i]] and self.W[i][0] in (FAULT, WAIT, RETRY):
                self.W[i][4] = min(self.W[i][4] + 1, md.K + 1)
                if self.W[i][4] > md.K:
                    self.ev.append(("P1", f"co-runner {md.wname[i]}'s access to "
                                          f"{md.pname[self.W[i][1]]} not completed after {self.W[i][4]} "
                                          f"ticks (bound K={md.K}): {ST_NAME[self.W[i][0]]}"))
        for c in range(2):
            cl = self.C[c]
            if cl[1] > 0:
                cl[1] -= 1
            if cl[2] >= 0:
                cl[2] = min(cl[2] + 1, md.agecap)
                running = cl[0] != RCD and any(self.W[i][0] not in (DONE, DEAD) for i in md.cwarps[c])
                if (md.p["policy"] == "kill" and md.design != "stock" and running
                        and cl[2] > md.p3):
                    self.ev.append(("P3", f"{md.cname[c]} (KILL_CLIENT) still on the GPU {cl[2]} ticks after "
                                          f"its first isolated fault (bound {md.p3}), "
                                          f"{TD_NAME[cl[0]]}"))


# ------------------------------------------------------------------ checker

def _params(params: dict) -> dict:
    p = dict(DEFAULTS)
    for k, v in params.items():
        if k not in DEFAULTS:
            raise TypeError(f"unknown parameter {k!r}")
        p[k] = v
    p["mutations"] = tuple(sorted(p["mutations"]))
    return p


def check(design: str, **params) -> Result:
    """Explore every reachable state of the model of `design`; see module doc."""
    p = _params(params)
    md = Model(design, p)
    t0 = time.perf_counter()
    init = md.initial()
    parent = {init: None}
    queue = deque([init])
    first = {}          # prop/info -> (state_before, label, message)
    counts = {}
    transitions = 0
    complete = True
    while queue:
        s = queue.popleft()
        succ = md.successors(s)
        if not succ:
            counts["NODEADLOCK"] = counts.get("NODEADLOCK", 0) + 1
            if "NODEADLOCK" not in first:
                first["NODEADLOCK"] = (s, None, "no step enabled: " + md.describe(s))
        for label, t, events in succ:
            transitions += 1
            for prop, msg in events:
                counts[prop] = counts.get(prop, 0) + 1
                if prop not in first:
                    first[prop] = (s, label, msg)
            if t not in parent:
                parent[t] = (s, label)
                if len(parent) >= p["max_states"]:
                    complete = False
                    queue.clear()
                    break
                queue.append(t)
    secs = time.perf_counter() - t0

    def trace_to(s, label, msg):
        steps = []
        cur = s
        while parent[cur] is not None:
            prev, lab = parent[cur]
            steps.append(lab)
            cur = prev
        steps.reverse()
        if label is not None:
            steps.append(label)
        steps.append("=> " + msg)
        steps.append("   state before the last step: " + md.describe(s))
        return steps

    props = {}
    for name in PROPS:
        pr = PropertyResult(name=name, title=PROP_TITLE[name])
        if name == "RULES" and design != "scratch":
            pr.applicable = False
        if name == "P3" and (p["policy"] != "kill" or design == "stock") and design != "scratch":
            pr.applicable = False
        if name in first:
            s, label, msg = first[name]
            pr.ok = False
            pr.violations = counts[name]
            pr.message = msg
            pr.trace = trace_to(s, label, msg)
        props[name] = pr
    info = {}
    for name, (s, label, msg) in sorted(first.items()):
        if name.startswith("info:"):
            info[name[5:]] = trace_to(s, label, msg)
    shown = {k: v for k, v in p.items() if k != "max_states"}
    shown.update(K=md.K, p2_bound=md.p2, p3_bound=md.p3, preempt_timeout=md.ptimeout)
    return Result(design=design, params=shown, states=len(parent), transitions=transitions,
                  seconds=round(secs, 3), complete=complete, properties=props, info=info)


# ---------------------------------------------------------------------- CLI

# rows of the CLI's table: (label, design, params)
SCENARIOS = [
    ("stock", "stock", {}),
    ("park", "park", {}),
    ("scratch (scratch_lock=try)", "scratch", {}),
    ("scratch scratch_lock=read", "scratch", dict(scratch_lock="read")),
    ("scratch scratch_lock=write", "scratch", dict(scratch_lock="write")),
    ("scratch try, A faults once, no alloc fail", "scratch", dict(bad_accesses=1, alloc_can_fail=False)),
    ("scratch read, A faults once, no alloc fail", "scratch", dict(bad_accesses=1, alloc_can_fail=False,
                                                                   scratch_lock="read")),
    ("scratch isolate, 2 uTLBs x2", "scratch", dict(policy="isolate", same_utlb=False, utlb_slots=2,
                                                    bad_warps=2, bad_accesses=2)),
    ("scratch perm+managed pages", "scratch", dict(perm_page=True, bad_managed_page=True)),
    ("scratch sole TSG", "scratch", dict(shared_tsg=False, same_utlb=False)),
    ("scratch teardown=drain", "scratch", dict(teardown="drain")),
    ("scratch teardown=run_on, SIGKILL only", "scratch", dict(teardown="run_on", client_exit=False)),
    ("park teardown=run_on, B on uTLB1", "park", dict(teardown="run_on", client_exit=False,
                                                       same_utlb=False)),
    ("stock teardown=run_on", "stock", dict(teardown="run_on")),
]

# mutation rows (--with-mutations): each with the parameters that expose it
MUTATION_SCENARIOS = [
    ("scratch -no_deadline (budget 5)", "scratch",
     dict(mutations=("no_deadline",), budget=5, bad_pages=5, bad_accesses=6, deadline=1)),
    ("scratch -no_budget", "scratch", dict(mutations=("no_budget",), bad_pages=3)),
    ("scratch -no_replay_after_map", "scratch", dict(mutations=("no_replay_after_map",))),
    ("scratch -no_shared_check, sole TSG", "scratch",
     dict(mutations=("no_shared_check",), shared_tsg=False, same_utlb=False)),
    ("scratch -scratch_on_perm", "scratch", dict(mutations=("scratch_on_perm",), perm_page=True)),
    ("scratch -no_sigkill", "scratch", dict(mutations=("no_sigkill",))),
]


def _cell(pr: PropertyResult) -> str:
    if not pr.applicable and pr.ok:
        return "n/a"
    return "OK" if pr.ok else f"FAIL({pr.violations})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", default="all", choices=DESIGNS + ("all",))
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--policy", choices=("kill", "isolate", "default"))
    ap.add_argument("--teardown", choices=("evict", "drain", "run_on"))
    ap.add_argument("--mutation", action="append", default=[], choices=MUTATIONS)
    ap.add_argument("--with-mutations", action="store_true",
                    help="with --design all: also the rows of the scratch mutations")
    ap.add_argument("--no-info", action="store_true", help="omit the traces of notable reachable events")
    a = ap.parse_args(argv)
    extra = {}
    if a.policy:
        extra["policy"] = a.policy
    if a.teardown:
        extra["teardown"] = a.teardown
    if a.mutation:
        extra["mutations"] = tuple(a.mutation)
    if a.design == "all" and not extra:
        rows = SCENARIOS + (MUTATION_SCENARIOS if a.with_mutations else [])
    else:
        designs = DESIGNS if a.design == "all" else (a.design,)
        rows = [(d + (" " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""), d, extra)
                for d in designs]
    results = []
    for label, d, prm in rows:
        results.append((label, check(d, **prm)))
    if a.json:
        json.dump([{"scenario": lab, **r.to_dict()} for lab, r in results], sys.stdout, indent=1)
        print()
        return 0
    w = max(len(lab) for lab, _ in results)
    head = f"{'scenario':<{w}}  " + "  ".join(f"{n:<10}" for n in PROPS) + "  states   transitions  secs"
    print(head)
    print("-" * len(head))
    for lab, r in results:
        print(f"{lab:<{w}}  " + "  ".join(f"{_cell(r.properties[n]):<10}" for n in PROPS)
              + f"  {r.states:<8} {r.transitions:<12} {r.seconds:.2f}" + ("" if r.complete else " (cut)"))
    print()
    for n in PROPS:
        print(f"  {n}: {PROP_TITLE[n]}")
    for lab, r in results:
        bad = r.violated()
        if not bad and (a.no_info or not r.info):
            continue
        print(f"\n=== {lab}: params {', '.join(f'{k}={v}' for k, v in r.params.items())}")
        for n in bad:
            pr = r.properties[n]
            print(f"\n  {n} violated ({pr.violations}x): {pr.message}\n  shortest counterexample:")
            for k, st in enumerate(pr.trace, 1):
                print(f"    {k:2}. {st}" if not st.startswith(("=>", "   ")) else f"        {st}")
        if not a.no_info:
            for name, tr in r.info.items():
                print(f"\n  reachable: {name}; shortest path:")
                for k, st in enumerate(tr, 1):
                    print(f"    {k:2}. {st}" if not st.startswith(("=>", "   ")) else f"        {st}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
