"""The explicit-state model of nvidia-uvm's replayable-fault loop with gpuos's
fault isolation (patches/model/replay_model.py): the new scratch design holds
P1, P2, P3 and SAFETY, with the VA space lock tried (the patch, default) or
taken in read mode, not when waited for in write mode; the old park design and
stock do not, with the counterexamples naming the step; mutations of scratch
are caught."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "patches" / "model" / "replay_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpuos_replay_model", MODEL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


rm = _load()

CORE = ("P1", "P2", "P3", "SAFETY", "RULES", "NODEADLOCK")


def failing(r):
    return {n for n, p in r.properties.items() if not p.ok}


def trace_text(r, prop):
    return "\n".join(r.properties[prop].trace)


# ------------------------------------------------------------ scratch holds

SCRATCH_OK = {
    "default: KILL_CLIENT, one 1-slot uTLB shared with the co-runner": {},
    "ISOLATE, B on its own uTLB, 2 slots": dict(policy="isolate", same_utlb=False, utlb_slots=2),
    "permission fault and a legit fault of A too": dict(perm_page=True, bad_managed_page=True),
    "A alone in its TSG": dict(shared_tsg=False, same_utlb=False),
    "two faulting warps, one pass = one batch": dict(bad_warps=2, bad_accesses=2, max_batches=1,
                                                      deadline=1),
    "slow SIGKILL, long deadline, no scheduler preempts": dict(kill_delay=3, deadline=3,
                                                                preempt_requests=False),
}


@pytest.mark.parametrize("lock", ["try", "read"])
@pytest.mark.parametrize("params", list(SCRATCH_OK.values()), ids=list(SCRATCH_OK))
def test_scratch_satisfies_every_property(params, lock):
    """Both the try-lock of patches/0005 (the default) and mapping under the read
    lock keep P1, P2, P3, SAFETY and RULES (P1 counting an RC at the deadline
    as justified: see the try tests below)."""
    r = rm.check("scratch", scratch_lock=lock, **params)
    assert r.complete and r.states > 100
    assert failing(r) == set(), {n: r.properties[n].message for n in failing(r)}


def test_scratch_maps_and_replays_in_the_same_pass():
    """Not vacuous: the scratch path is taken (and the isolated client completes
    its access on the scratch page), the fallbacks the design names are reached,
    and they are the only way the co-runner dies."""
    r = rm.check("scratch")
    assert "co-runner RC (alloc_fail)" in r.info
    assert "co-runner RC (deadline)" in r.info
    assert not any("preempt_timeout" in k or "global_cancel" in k or "(stock)" in k for k in r.info)
    tr = "\n".join(r.info["co-runner RC (deadline)"])
    assert "scratch region #1 mapped" in tr
    assert "A.w0 retry u0 (replayed): hit, completes" in tr


# ---------------------------------------------------------------- baselines

def test_stock_kills_the_co_runner():
    r = rm.check("stock")
    assert failing(r) == {"P1"}
    p1 = r.properties["P1"]
    assert "co-runner B killed by RC of TSG0 (stock)" in p1.message
    assert "cancel_fault_precise_va A.w0@u0" in trace_text(r, "P1")
    assert len(p1.trace) == 4 + 2          # BFS: the 4-step path, then the verdict lines


def test_stock_harms_nobody_when_the_client_has_its_own_tsg():
    assert failing(rm.check("stock", shared_tsg=False, same_utlb=False)) == set()


def test_park_blocks_preemption_and_starves_the_co_runner():
    r = rm.check("park")
    assert {"P1", "P2", "P3"} <= failing(r)
    assert "SAFETY" not in failing(r)
    p2 = trace_text(r, "P2")
    assert "parked (skipped)" in p2
    assert "BH skips the replay (parked-only batch)" in p2
    assert "WITHOUT the closing replay" in p2
    p1 = trace_text(r, "P1")
    assert "stalls behind them" in p1 and "BH skips the replay (parked-only batch)" in p1
    assert "not completed after" in r.properties["P1"].message


def test_park_preempt_timeout_kills_the_co_runner_on_another_utlb():
    r = rm.check("park", same_utlb=False)
    assert "P1" in failing(r)
    tr = trace_text(r, "P1")
    assert "RM preempt timeout on TSG0" in tr
    assert "co-runner B killed by RC of TSG0 (preempt_timeout)" in r.properties["P1"].message


def test_park_teardown_races_the_parked_fault_into_a_global_cancel():
    """README's open question, found: a co-runner's replay unparks A's warp for an
    instant, the teardown's preempt completes, A's retry faults without a subcontext."""
    r = rm.check("park", teardown="run_on", client_exit=False, same_utlb=False)
    assert "SAFETY" in failing(r)
    tr = trace_text(r, "SAFETY")
    assert "SIGKILL delivered to A" in tr
    assert "NV_ERR_PAGE_TABLE_NOT_AVAIL" in tr and "push_cancel_on_gpu_global" in tr


# ----------------------------------------------------------------- findings

def test_scratch_is_unsafe_if_a_killed_clients_work_outlives_its_teardown():
    r = rm.check("scratch", teardown="run_on", client_exit=False)
    assert {"SAFETY", "P1"} <= failing(r)
    tr = trace_text(r, "SAFETY")
    assert tr.index("scratch region #1 mapped") < tr.index("SIGKILL delivered to A") \
        < tr.index("subcontext detached") < tr.index("NV_ERR_PAGE_TABLE_NOT_AVAIL")


def test_scratch_with_the_va_space_write_lock_deadlocks_against_teardown():
    """Waiting for the write lock: the bottom half blocks while the teardown holds
    the VA space waiting for its preempt, which waits for the pending fault."""
    r = rm.check("scratch", scratch_lock="write")
    assert failing(r) == {"P1", "P2"}
    assert "blocked in uvm_va_space_down_write" in trace_text(r, "P2")
    assert any("preempt_timeout" in k for k in r.info)


ONCE = dict(bad_accesses=1, alloc_can_fail=False)     # A faults once; scratch never fails


def test_scratch_default_is_the_try_lock_of_the_patch():
    assert rm.check("scratch", max_states=10).params["scratch_lock"] == "try"
    with pytest.raises(ValueError):
        rm.check("scratch", scratch_lock="nonsense")


def test_scratch_try_lock_never_blocks_the_bottom_half():
    """try: the busy lock is hit (a teardown racing the fault), the batch is
    replayed without mapping or cancelling, and nothing waits: no blocked bottom
    half, no preempt timeout; the write variant's P1/P2 failures are gone."""
    r = rm.check("scratch")
    assert failing(r) == set()
    busy = "\n".join(r.info["scratch lock busy, A replayed unmapped"])
    assert "teardown starts" in busy
    assert busy.index("teardown starts") < busy.index("gpuos_va_space_trylock_write fails")
    assert not any("preempt_timeout" in k for k in r.info)
    assert "scratch lock busy, A replayed unmapped" not in rm.check("scratch", scratch_lock="read").info


def test_scratch_try_lock_rcs_the_co_runner_at_the_deadline_where_read_does_not():
    """The price of try, found by the model: a client whose exit races its one
    fatal fault is retried (busy lock) pass after pass until its deadline, then
    cancelled: RC of the TSG, co-runner included.  P1 holds only because an RC at
    the deadline is a fallback the design names; mapping under the read lock
    contains the same client with no RC at all."""
    r = rm.check("scratch", **ONCE)
    assert failing(r) == set()
    tr = "\n".join(r.info["co-runner RC (deadline)"])
    assert tr.index("A exits: teardown starts") < tr.index("gpuos_va_space_trylock_write fails") \
        < tr.index("stock cancel (deadline)") < tr.index("co-runner B killed by RC of TSG0")
    assert "scratch region #" not in tr
    assert tr.count("gpuos_va_space_trylock_write fails") >= 2
    rd = rm.check("scratch", scratch_lock="read", **ONCE)
    assert failing(rd) == set()
    assert not any(k.startswith("co-runner RC") for k in rd.info)


def test_scratch_try_lock_keeps_p1_only_through_the_deadline_fallback(monkeypatch):
    """Without the deadline among the justified fallbacks, try violates P1 (the
    co-runner's RC above) and read does not: P1's pass for try rests on it."""
    allowed = rm.ALLOWED_FALLBACK["scratch"] - {"deadline"}
    monkeypatch.setitem(rm.ALLOWED_FALLBACK, "scratch", allowed)
    r = rm.check("scratch", **ONCE)
    assert failing(r) == {"P1"}
    assert "co-runner B killed by RC of TSG0 (deadline)" in r.properties["P1"].message
    assert "gpuos_va_space_trylock_write fails" in trace_text(r, "P1")
    assert failing(rm.check("scratch", scratch_lock="read", **ONCE)) == set()


def test_scratch_with_draining_teardown_never_stops_a_spinning_client():
    r = rm.check("scratch", teardown="drain")
    assert failing(r) == {"P3"}
    assert "draining" in r.properties["P3"].message


def test_deadline_must_stay_below_the_preempt_timeout():
    """A killed client that keeps faulting on new addresses (each one scratch-mapped)
    holds its teardown's preempt; if RM gives up first, RC takes the co-runner."""
    many = dict(budget=5, bad_pages=5, bad_accesses=6, max_batches=1, deadline=3)
    r = rm.check("scratch", preempt_timeout=2, **many)
    assert "P1" in failing(r)
    assert "(preempt_timeout)" in r.properties["P1"].message
    assert failing(rm.check("scratch", preempt_timeout=5, **many)) == set()


# ---------------------------------------------------------------- mutations

MUTANTS = {
    # mutation: (params exposing it, properties that must fail)
    "no_deadline": (dict(budget=5, bad_pages=5, bad_accesses=6, deadline=1), {"P2", "P3"}),
    "no_budget": (dict(bad_pages=3), {"P3"}),
    "no_replay_after_map": ({}, {"P1", "P2"}),
    "scratch_on_perm": (dict(perm_page=True), {"RULES"}),
    "no_sigkill": ({}, {"P3"}),
}


@pytest.mark.parametrize("mutation", list(MUTANTS))
def test_scratch_mutation_is_caught(mutation):
    params, must_fail = MUTANTS[mutation]
    assert failing(rm.check("scratch", **params)) == set()         # the design with these params
    r = rm.check("scratch", mutations=(mutation,), **params)
    assert must_fail <= failing(r), (mutation, failing(r))
    for prop in must_fail:
        assert r.properties[prop].trace[-2].startswith("=> ")


def test_no_deadline_counterexample_is_a_client_faulting_on_new_addresses():
    """(read lock: with the try lock the shorter counterexample is the one below.)"""
    params, _ = MUTANTS["no_deadline"]
    r = rm.check("scratch", mutations=("no_deadline",), scratch_lock="read", **params)
    tr = trace_text(r, "P2")
    assert "SIGKILL delivered to A" in tr
    for k in (1, 2, 3):
        assert f"scratch region #{k} mapped" in tr


def test_no_deadline_with_the_try_lock_retries_a_busy_fault_for_ever():
    """With the try lock the deadline is what ends the busy retries: without it a
    client whose teardown holds its VA space re-faults pass after pass (P2, and
    the co-runner starves: P1); with the read lock the same mutant keeps P1/P2."""
    r = rm.check("scratch", mutations=("no_deadline",))
    assert {"P1", "P2"} <= failing(r)
    tr = trace_text(r, "P2")
    assert "scratch region #" not in tr
    assert tr.count("gpuos_va_space_trylock_write fails") >= 3
    assert not {"P1", "P2"} & failing(rm.check("scratch", mutations=("no_deadline",), scratch_lock="read"))


def test_no_replay_after_map_names_the_skipped_replay():
    r = rm.check("scratch", mutations=("no_replay_after_map",))
    assert "BH skips the replay (scratch-mapped-only batch (mutation))" in trace_text(r, "P2")


def test_no_shared_check_is_harmless_to_others_but_breaks_the_rule():
    params = dict(shared_tsg=False, same_utlb=False)
    r = rm.check("scratch", mutations=("no_shared_check",), **params)
    assert failing(r) == {"RULES"}
    assert "alone in TSG0" in r.properties["RULES"].message


# ---------------------------------------------------------------- interface

def test_result_shape_and_parameters():
    r = rm.check("scratch")
    assert r.design == "scratch" and r.transitions > r.states > 0 and r.complete
    assert set(r.properties) == set(CORE)
    assert r.params["K"] == 3 and r.params["p2_bound"] == 3
    with pytest.raises(TypeError):
        rm.check("scratch", no_such_parameter=1)
    with pytest.raises(ValueError):
        rm.check("nonsense")
    with pytest.raises(ValueError):
        rm.check("scratch", mutations=("nonsense",))


def test_max_states_cuts_the_search_and_says_so():
    r = rm.check("scratch", max_states=50)
    assert not r.complete and r.states == 50


def test_cli_table_and_json(capsys):
    assert rm.main(["--design", "stock", "--no-info"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:7] == ["scenario", *CORE]
    assert "FAIL" in out and "shortest counterexample" in out
    assert rm.main(["--design", "scratch", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["design"] == "scratch"
    assert all(p["ok"] for p in data[0]["properties"].values())
