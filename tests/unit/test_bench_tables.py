"""The benchmarks' arithmetic and README tables, from their committed results and from
made-up runs (the benchmarks themselves need a GPU; what they compute from runs does not)."""

from __future__ import annotations

import collections
import itertools
import json
import math
import random
import statistics
import sys
import time
import types
from pathlib import Path

import pytest

from gpuos.workloads.run import Finished

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import intercept_overhead as icpt  # noqa: E402
import mps_faults  # noqa: E402
import paired  # noqa: E402


def rows(table: str) -> list[list[str]]:
    out = []
    for line in table.splitlines():
        if line.startswith("|"):
            out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table of text (blocks of | lines), as rows of cells."""
    return [t for t in (rows(block) for block in text.split("\n\n")) if t]


def test_committed_results_make_tables_with_one_cell_per_column():
    for path in sorted((BENCH / "results").glob("intercept-*.json")):
        found = tables(icpt.markdown(json.loads(path.read_text())))
        assert len(found) == 3, path
        for table in found:
            assert len(table) > 2 and all(len(r) == len(table[0]) for r in table), path
    for path in sorted((BENCH / "results").glob("mps-faults-*.json")):
        r = json.loads(path.read_text())
        text = mps_faults.markdown(r)
        table = rows(text)
        if not r["scenarios"]:  # a --cost-rounds run alone: its costs, no table
            assert r.get("cost") and not table and "Fault-free cost" in text, path
            continue
        assert len(table) > 2 and all(len(r) == len(table[0]) for r in table), path


def run(mode: str, sps: float, cpu: float, checksum: str = "c") -> dict:
    result = {"steps_per_s": sps, "checksum": checksum, "cpu_s": cpu, "steps": 20}
    row = {"mode": mode, "result": result}
    if mode == "gpuos":
        row["process"] = {"state": "on", "counters": {"launches": 1000}}
    return row


def test_overheads_from_medians_of_steps_and_cpu_time():
    runs = []
    for sps, cpu in ((10.0, 2.0), (11.0, 2.2), (12.0, 2.4)):
        runs += [run("plain", sps, cpu), run("passive", sps * 0.99, cpu), run("gpuos", sps / 1.1, cpu * 1.05)]
    s = icpt.summarize(runs)
    assert s["overhead_pct"] == pytest.approx(10.0)
    assert s["passive_overhead_pct"] == pytest.approx((1 / 0.99 - 1) * 100)
    assert s["passive_steps_per_s"] == pytest.approx(11.0 * 0.99)
    assert s["cpu_overhead_pct"] == pytest.approx(5.0)
    assert s["passive_cpu_overhead_pct"] == pytest.approx(0.0)
    assert s["plain_spread_pct"] == pytest.approx(20.0) and s["identical"]
    cells = icpt.timed_cells(s)
    assert cells[2].startswith("+10.0% (passive +1.0%)") and cells[3] == "+5.0%"


def test_rounds_give_passive_recording_and_total_costs_with_intervals():
    """Rounds of plain / passive / gpuos in rotating order: passive costs 2% over plain,
    recording 3% over passive, whatever the round's own speed (the host's drift)."""
    runs = []
    for rnd, speed in enumerate((10.0, 12.0, 9.0, 11.0, 10.5, 9.5)):
        t = {"plain": 1 / speed, "passive": 1.02 / speed, "gpuos": 1.02 * 1.03 / speed}
        for mode in icpt.round_order(rnd):
            runs.append(dict(run(mode, 1 / t[mode], 1.0), round=rnd))
    assert [r["mode"] for r in runs[:6]] == ["plain", "passive", "gpuos", "passive", "gpuos", "plain"]
    x = icpt.summarize(runs)["across_processes"]
    # relative to the mean of the cheaper mode's times: exact when every round agrees
    assert x["passive"]["overhead_pct"] == pytest.approx(2.0)
    assert x["recording"]["overhead_pct"] == pytest.approx(3.0)
    assert x["total"]["overhead_pct"] == pytest.approx((1.02 * 1.03 - 1) * 100)
    assert x["total"]["rounds"] == 6 and x["passive"]["ci95_pct"] < 0.5
    cells = icpt.cost_cells(icpt.summarize(runs))
    assert cells[0].startswith("+2.0 ± ") and cells[1].startswith("+3.0 ± ")
    assert cells[3:] == ["6", "—", "yes"]  # no paired run in this one


def test_a_different_checksum_anywhere_hides_the_overhead():
    runs = [run("plain", 10, 1), run("passive", 10, 1, checksum="other"), run("gpuos", 9, 1)]
    s = icpt.summarize(runs)
    assert not s["identical"]
    assert icpt.timed_cells(s)[2:4] == ["—", "—"]


def scenario(mode: str, died: int, n: int = 2, **extra) -> dict:
    return {"mode": mode, "n": n, "kind": "assert" if not died else "oob-write",
            "clients_died": died, "victims_recovered": died if mode == "supervised" else 0,
            "detect_s": None if not died else 0.6, "server_back_s": 0.5,
            "downtime_median_s": 7.0 if died and mode == "supervised" else None,
            "downtime_max_s": 9.0 if died and mode == "supervised" else None, "notes": [], **extra}


def test_mps_table_says_what_happened():
    r = {"device": "GPU", "driver": "1", "gpuos": "0", "date": "2026-11-24", "notes": [],
         "scenarios": {"stock/2/assert": scenario("stock", 0),
                       "supervised/2/assert": scenario("supervised", 0, incident_opened_s=None),
                       "stock/2/oob-write": scenario("stock", 2),
                       "supervised/2/oob-write": scenario("supervised", 2, incident_opened_s=0.6,
                                                          incident_outcome="recovered", rate_median=812.4),
                       "standby/2/oob-write": scenario("standby", 2, incident_opened_s=0.6,
                                                       incident_outcome="recovered", took_over=1,
                                                       victims_recovered=2, downtime_median_s=1.5,
                                                       downtime_max_s=2.0),
                       "spare/2/oob-write": scenario("spare", 2, incident_opened_s=0.0,
                                                     incident_outcome="recovered", took_over=2,
                                                     victims_recovered=2, downtime_median_s=0.4,
                                                     downtime_max_s=0.4, released_s=0.28, reaped_s=0.3,
                                                     faulter_named_s=0.004,
                                                     bystander={"stall_s": 0.15, "from_s": 0.0, "to_s": 0.15,
                                                                "usual_s": 0.0008, "kind": "alloc"},
                                                     clients=[{"role": "infer", "first_phases": {"inputs": 0.1}},
                                                              {"role": "train", "first_phases": {
                                                                  "inputs": 0.05, "forward": 0.31}},
                                                              {"role": "infer"}],
                                                     slow_turns=[{"at_s": 0.1, "seconds": 0.06,
                                                                  "parts": {"persist": 0.05}},
                                                                 {"at_s": 0.2, "seconds": 0.12,
                                                                  "parts": {"faults": 0.1, "reap": 0.01}}])}}
    table = {(c[0], c[2]): c for c in rows(mps_faults.markdown(r))[2:]}
    # a spare's row says when the standbys were let go and the victims reaped, what a
    # bystander saw, where the last victim's new first iteration went, and the
    # supervisor's slowest turn
    assert table[("spare", "oob-write")][8] == (
        "incident recovered; 2/2 taken over by standbys, released at 0.28, victims reaped by 0.30; "
        "faulter named at 0.00; alloc bystander on the spare stalled 0.15 (0.00 to 0.15; usually 0.8 ms); the train victim's "
        "new first iteration: inputs 0.05, forward 0.31; slowest supervisor turn 0.12 (faults)")
    assert table[("stock", "assert")][5] == "never down" and table[("stock", "assert")][6] == "no victims"
    assert table[("supervised", "assert")][8] == "no incident"
    assert table[("stock", "oob-write")][6] == "not recovered"
    assert table[("supervised", "oob-write")][6] == "7.00 / 9.00"
    assert table[("supervised", "oob-write")][7] == "812"
    assert table[("supervised", "oob-write")][8] == "incident recovered"
    assert table[("standby", "oob-write")][6] == "1.50 / 2.00"
    assert table[("standby", "oob-write")][8] == "incident recovered; 1/2 taken over by standbys"
    # --share-standby-memory: what the released standbys still share (the next standbys'
    # reports, not released, are not counted)
    shared = lambda b, g, c: {"asked": True, "allocations": 1, "bytes": b, "given_back": int(g > 0),
                              "given_back_bytes": g, "restored": 0, "restored_bytes": 0, "check_seconds": c}
    r["scenarios"]["standby/2/oob-write"]["t_fault"] = 1000.0
    r["scenarios"]["standby/2/oob-write"]["preloads"] = [
        {"released": True, "memory_shared": dict(shared(512 << 20, 0, 0.18), check_started_at=1000.05)},
        {"released": True, "memory_shared": shared(512 << 20, 512 << 20, 0.0)},
        {"released": False, "memory_shared": shared(512 << 20, 0, 0.0)}, {"released": True, "memory_shared": None}]
    table = {(c[0], c[2]): c for c in rows(mps_faults.markdown(r))[2:]}
    assert table[("standby", "oob-write")][8] == (
        "incident recovered; 1/2 taken over by standbys; standbys shared 512 MiB of their clients' memory "
        "after the release, checks 0.18 s at most, the last ending 0.23 s after the fault")
    assert [c[0] for c in rows(mps_faults.markdown(r))[2:] if c[2] == "oob-write"] == [
        "stock", "supervised", "standby", "spare"]


def test_mps_first_phases_and_bystander_stall_read_their_logs():
    text = "5 1 inputs 10.5\n5 1 forward 10.7\n5 2 inputs 11.0\n6 1 inputs 9.0\nbad line\n"
    assert mps_faults.first_phases(text, 5, 10.0) == pytest.approx({"inputs": 0.5, "forward": 0.7})
    assert mps_faults.first_phases(text, 7, 10.0) == {}
    # the longest gap that ends after the fault, against the median gap
    st = mps_faults.bystander_stall([1.0, 2.0, 3.0, 4.5, 5.0, 6.0], 3.2)
    assert st == pytest.approx({"stall_s": 1.5, "from_s": -0.2, "to_s": 1.3, "usual_s": 1.0})
    assert mps_faults.bystander_stall([1.0, 2.0], 5.0) is None


def test_a_checkpointing_victims_work_lost_is_from_where_its_new_run_resumed():
    """--train-checkpoint: the iterations between the victim's heartbeat at the fault and the
    iteration its new process says it resumed from, at its rate; from its start when no
    line says so (nothing to resume from); beside the supervisor's record."""
    c = {"id": 1, "new_pid": 77, "before": [0.0, 120, 5]}
    log = "mps_client: pid 5 resumed from iteration 40\nmps_client: pid 77 resumed from iteration 100\n"
    got = mps_faults.work_lost(c, log, [10.0, 20.0], {"lost_s": 1.1, "resumes_from": "checkpoint"})
    assert got == {"lost_recorded_s": 1.1, "resumes_from_recorded": "checkpoint", "resumed_iteration": 100,
                   "lost_iterations": 20, "lost_measured_s": 1.0}
    got = mps_faults.work_lost(c, "mps_client: pid 5 resumed from iteration 40\n", [10.0, 20.0], None)
    assert (got["resumed_iteration"], got["lost_iterations"], got["lost_measured_s"]) == (0, 120, 6.0)
    assert got["lost_recorded_s"] is None


def test_the_copy_in_rate_is_of_the_copies_waited_for():
    """A turn's batch and copies ahead are timed only to their issue (ahead_ns, inside
    in_ns): their bytes and that time are both left out; results from before ahead_ns
    keep the old reading."""
    import oversub

    st = {"bytes_in": 30_000, "ahead_bytes": 20_000, "in_ns": 1_500, "ahead_ns": 1_000}
    assert oversub.own_copy_rate([st]) == pytest.approx(10_000 / 500)
    old = {k: v for k, v in st.items() if k != "ahead_ns"}
    assert oversub.own_copy_rate([old]) == pytest.approx(10_000 / 1_500)
    assert oversub.own_copy_rate([{"bytes_in": 5, "ahead_bytes": 5, "in_ns": 9, "ahead_ns": 9}]) is None


def test_the_mapping_share_is_of_the_copies_waited_for():
    """map_ns is within in_ns less ahead_ns (the copies calls waited for); results from
    before it existed say nothing rather than 0."""
    import oversub

    st = {"bytes_in": 30_000, "ahead_bytes": 20_000, "in_ns": 1_500, "ahead_ns": 1_000, "map_ns": 125}
    assert oversub.own_map_share([st, dict(st, map_ns=375)]) == 500 / 1000
    assert oversub.own_map_share([{k: v for k, v in st.items() if k != "map_ns"}]) is None


def test_group_members_are_matched_to_members_by_reserved_bytes():
    """The group's file names members by pid; each member gets the record nearest its
    reserved peak, each record once; a member without figures gets none."""
    import oversub

    members = [{"workload": "a", "stats": {"reserved_peak": 2_000}},
               {"workload": "b", "stats": {"reserved_peak": 5_000}},
               {"workload": "c"}]
    seen = [{"pid": 1, "reserved": 4_900, "held_ns": 7}, {"pid": 2, "reserved": 2_100, "held_ns": 9}]
    oversub.attach_group_members(members, seen)
    assert [m.get("group_member", {}).get("pid") for m in members] == [2, 1, None]
    # two members near one record: the larger is matched first, the other takes what is left
    members = [{"stats": {"reserved_peak": 3_000}}, {"stats": {"reserved_peak": 3_100}}]
    oversub.attach_group_members(members, [{"pid": 5, "reserved": 3_050}, {"pid": 6, "reserved": 100}])
    assert [m["group_member"]["pid"] for m in members] == [6, 5]


def test_results_keep_step_times_on_one_line_and_read_back_the_same():
    result = {"workloads": {"w": {"paired": {"step_times": [[45.1, 44.9, 0], [46.2, 46.0, 1]] * 50,
                                             "wall": {"overhead_pct": 1.0}}},
                            "old": {"paired": {"step_ms": [45.1, -46.2]}}}}
    text = icpt.dumps(result)
    assert json.loads(text) == result
    assert len(text.splitlines()) < 20  # not one line per number


def test_reestimate_uses_the_kept_step_times():
    steps = [[50.0 if i % 2 == 0 else 49.0, 49.0, i % 2] for i in range(300)]  # recording 1 ms slower
    result = {"workloads": {"w": {"paired": {"step_times": steps, "wall": {"overhead_pct": 99.0}}},
                            "none": {"paired": {"wall": {"overhead_pct": 5.0}}}}}
    assert icpt.reestimate(result)
    p = result["workloads"]["w"]["paired"]
    assert p["wall"]["overhead_pct"] == pytest.approx(100 / 49, rel=1e-3)
    assert p["cpu"]["overhead_pct"] == pytest.approx(0.0, abs=1e-6)
    assert result["workloads"]["none"]["paired"]["wall"]["overhead_pct"] == 5.0  # nothing to estimate from


def test_merged_parts_keep_what_only_an_earlier_part_measured():
    """A workload measured in rounds by one run and in one run (paired) by another: the
    merged table shows both, the later part's rounds and the earlier part's pairing."""
    early = {"device": "X", "workloads": {"w": {"paired": {"wall": {"overhead_pct": 0.8, "ci95_pct": 0.4}},
                                                "identical": True, "reps": 1}}, "notes": []}
    late = {"device": "Y", "workloads": {"w": {"identical": True, "reps": 3}}, "notes": ["n"]}
    merged = icpt.merge([early, late])
    assert merged["device"] == "X" and merged["notes"] == ["n"]
    assert merged["workloads"]["w"]["reps"] == 3
    assert icpt.in_one_run(merged["workloads"]["w"]) == "+0.8 ± 0.4%"


def test_mps_standby_cost_pairs_rounds_and_cancels_drift():
    """--cost-rounds: the cost of standbys from paired windows.  A 1% slower rate with
    standbys is +1% however much the machine drifts from round to round (±20%), and no
    cost is 0 within its interval."""
    drift = [100, 80, 120, 90, 110, 95]
    est = mps_faults.cost_estimate(drift, [r / 1.01 for r in drift])
    assert est["rounds"] == 6 and est["overhead_pct"] == pytest.approx(1.0, abs=1e-9)
    assert 0 < est["ci95_pct"] < 0.5  # drift widens it a little: differences are absolute
    noisy = mps_faults.cost_estimate(drift, [r * (1 + e) for r, e in zip(drift, [.004, -.003, .002, -.004, .003, -.002])])
    assert abs(noisy["overhead_pct"]) < noisy["ci95_pct"]
    assert mps_faults.cost_estimate([100], [99]) == {"rounds": 1}  # no interval from one round


FAKE_MEMBER = """
import json, sys, time
from gpuos.workloads.suite import wait_at_gate
startup, argv = sys.argv[1], sys.argv[2:]
log, gate = argv[argv.index("--step-log") + 1], argv[argv.index("--start-gate") + 1]
open(log, "w").write(json.dumps({"pid": 0}) + "\\n")
if startup == "fail":
    sys.exit(3)
time.sleep(float(startup))
wait_at_gate(gate)
t0 = time.monotonic(); time.sleep(0.1); t1 = time.monotonic()
open(log, "a").write(json.dumps({"marks": [[t0, 0, False], [t1, 0, False]]}) + "\\n")
print(json.dumps({"items_per_s": 10 / (t1 - t0), "seconds": t1 - t0, "checksum": "c"}))
"""


@pytest.fixture
def fake_members(tmp_path, monkeypatch):
    import oversub

    script = tmp_path / "member.py"
    script.write_text(FAKE_MEMBER)
    # a member's "workload" is its start-up time (or "fail"); no gpuos run around it
    monkeypatch.setattr(oversub, "suite_cmd", lambda w, args: [sys.executable, str(script), w, *args])
    monkeypatch.setattr(oversub, "under_gpuos", lambda cmd, *options: cmd)
    return oversub


def test_group_members_time_their_steps_from_one_moment(fake_members):
    """Members whose start-ups take 0 to 1.5 s begin their timed steps together."""
    out = fake_members.run_members([("0", []), ("1.5", []), ("0.5", [])], [], None)
    assert out["started_together"] is True
    starts = [m["timed_from"] for m in out["members"]]
    assert max(starts) - min(starts) < 0.1, out
    assert out["items_per_s"] == pytest.approx(30 / (max(m["timed_to"] for m in out["members"]) - min(starts)))


def test_a_member_that_ends_before_the_gate_does_not_hold_the_others(fake_members):
    t0 = time.monotonic()
    out = fake_members.run_members([("0", []), ("fail", [])], [], None)
    assert time.monotonic() - t0 < 60 and out["started_together"] is False
    assert [m["returncode"] for m in out["members"]] == [0, 3] and "items_per_s" not in out


def test_a_group_runs_longer_by_its_steps_alone():
    import oversub

    args = ["--layers", "8", "--steps", "30", "--warmup", "3"]
    assert oversub.longer(args, 4) == ["--layers", "8", "--steps", "120", "--warmup", "3"]
    assert oversub.longer(args, 1) == args


def test_the_group_table_shows_the_one_at_a_time_bound():
    import oversub

    cell = {"relative": 0.5, "checksums_equal": True, "bytes_in": 2e9, "in_GBps": 40.0, "switch_mean_ms": 10.0,
            "switch_p99_ms": 20.0, "group": {"switches": 3, "beside_turns": 1}}
    row = {"group": "g", "one_at_a_time": 0.42, "pressures": [{"pressure": 150, "reactive": cell, "proactive": cell}]}
    lines = oversub.group_markdown({"groups": [row]}).splitlines()
    assert len({line.count("|") for line in lines}) == 1, lines  # every row as wide as the header
    assert lines[2].startswith("| g | 150% | 50.0% | 50.0% | 42.0% | True | 2.0 / 2.0 GB | 40.0 / - GB/s | 3 | 1 |")
    # batches timed on the GPU: their rate beside the waited copies'
    row["pressures"][0]["proactive"] = dict(cell, batch_GBps=45.5)
    lines = oversub.group_markdown({"groups": [row]}).splitlines()
    assert "| 40.0 / 45.5 GB/s |" in lines[2]


def test_the_batch_rate_is_the_timed_batches_bytes_over_their_gpu_time():
    import oversub

    st = [{"batch_bytes": 40_000, "batch_ns": 1_000}, {"batch_bytes": 10_000, "batch_ns": 250}]
    assert oversub.batch_rate(st) == 50_000 / 1_250
    assert oversub.batch_rate([{"bytes_in": 5}]) is None  # from before the figures


FAKE_TURNS_MEMBER = """
import json, sys, time
from gpuos.workloads.suite import Turns, timed
argv = sys.argv[1:]
step_s, scale = float(argv[0]), float(argv[-1])  # the last --scale: under_gpuos adds its own
steps = int(argv[argv.index("--steps") + 1])
d, i, n, k = argv[argv.index("--turns") + 1:argv.index("--turns") + 5]
turns = Turns(d, int(i), int(n), int(k), timeout_s=30)
seconds, _, _ = timed(lambda: time.sleep(step_s * scale), 1, steps, lambda: None, turns=turns)
print(json.dumps({"seconds": seconds, "checksum": "c", "windows": turns.windows}))
"""


@pytest.fixture
def fake_turns(tmp_path, monkeypatch):
    """overhead_turns over three real processes taking turns, each step a sleep: the
    workload's name is the step's seconds; limited's steps last 20% longer."""
    import oversub

    script = tmp_path / "member.py"
    script.write_text(FAKE_TURNS_MEMBER)
    monkeypatch.setattr(oversub, "suite_cmd", lambda w, args: [sys.executable, str(script), w, *args, "--scale", "1"])
    calls: dict[str, list] = {"under_gpuos": [], "peak_run": []}  # what the tests check

    def under_gpuos(cmd, *options):
        calls["under_gpuos"].append(options)
        return [*cmd, "--scale", "1.2" if "--evict" in options else "1"]

    def peak_run(cmd, timeout):  # the run that finds the turns' peak
        calls["peak_run"].append(cmd)
        return Finished(cmd, 0, "", "", 0.1), types.SimpleNamespace(reserved_peak=3 << 20, launches=0, evictions=0)

    monkeypatch.setattr(oversub, "test_calls", calls, raising=False)
    monkeypatch.setattr(oversub, "under_gpuos", under_gpuos)
    monkeypatch.setattr(oversub, "run_polling_mem_stats", peak_run)
    monkeypatch.setitem(oversub.WORKLOADS, "0.01", ["--steps", "30", "--warmup", "1"])
    return oversub


def test_overhead_turns_take_turns_in_balanced_orders_and_pair_by_round(fake_turns):
    out = fake_turns.overhead_turns("0.01", 4, 2 << 30, step_s=0.01, turn_s=0.05)
    assert out["turn_steps"] == 5 and out["rounds"] == 6 and out["checksums_equal"]  # 4 rounded up
    [peak_cmd] = fake_turns.test_calls["peak_run"]
    assert peak_cmd[peak_cmd.index("--steps") + 1] == "30" and out["limit"] == 3 << 20  # the turns' steps' peak
    limited = [o for o in fake_turns.test_calls["under_gpuos"] if "--evict" in o]
    assert limited == [("-q", "--gpu-memory", str(3 << 20), "--evict", "future")]
    order = [out["systems"][i] for i in out["order"]]
    rounds = [order[r * 3:r * 3 + 3] for r in range(6)]
    assert all(sorted(r) == sorted(out["systems"]) for r in rounds)  # one turn of each a round
    assert len({tuple(r) for r in rounds}) == 6  # every order once: each first, second, third twice
    assert all(len(v) == 6 for v in out["per_step_s"].values())
    lp, ip = out["limited_over_plain"], out["ideal_over_plain"]
    assert lp["rounds"] == 6 and 10 < lp["overhead_pct"] < 30, out  # the 20% longer steps
    assert abs(ip["overhead_pct"]) < 8, out  # the same steps
    table = rows(fake_turns.overhead_markdown({"rows": [{"workload": "w", "overhead": out}]}))
    assert table[2][:2] == ["w", "6 x 5"] and table[2][2].startswith("**+") and table[2][5] == "True"


def test_the_balanced_orders_cancel_a_bias_by_place_in_the_round():
    """Systems with the same steps compare equal although the first turn of a round runs
    5% faster and the third 10% slower: each system takes each place equally often, and
    follows each other one equally often, for any number of systems."""
    import oversub

    orders = oversub.balanced_orders(3)
    order = [i for r in orders for i in r]
    per_step: dict[int, list[float]] = {i: [] for i in range(3)}
    for pos, i in enumerate(order):
        per_step[i].append({0: 0.95, 1: 1.0, 2: 1.1}[pos % 3])
    for a, b in itertools.combinations(range(3), 2):
        assert paired.rounds_overhead(per_step[a], per_step[b])["overhead_pct"] == pytest.approx(0, abs=1e-9)
    for n in range(2, 8):
        orders = oversub.balanced_orders(n)
        assert all(sorted(r) == list(range(n)) for r in orders)
        places = collections.Counter((i, place) for r in orders for place, i in enumerate(r))
        after = collections.Counter((r[j], r[j + 1]) for r in orders for j in range(n - 1))
        assert len(places) == n * n and len(set(places.values())) == 1, n
        assert len(after) == n * (n - 1) and len(set(after.values())) == 1, n


def test_overhead_turns_of_five_systems_split_gpuos_cost(fake_turns):
    """passive (operations not recorded) and driver (the driver's memory) beside the three:
    each compared with plain, in balanced rounds, each with its own gpuos run options."""
    systems = ["plain", "ideal", "limited", "passive", "driver"]
    out = fake_turns.overhead_turns("0.01", 4, 2 << 30, step_s=0.01, turn_s=0.03, systems=systems)
    assert out["rounds"] == 10 and out["systems"] == systems and out["checksums_equal"]
    assert {k for k in out if "_over_" in k} == {"ideal_over_plain", "limited_over_plain", "passive_over_plain",
                                                 "driver_over_plain", "limited_over_ideal"}
    assert 10 < out["limited_over_plain"]["overhead_pct"] < 30 and abs(out["passive_over_plain"]["overhead_pct"]) < 8
    options = fake_turns.test_calls["under_gpuos"][1:]  # after the peak run's
    assert sorted(options) == sorted([("-q", "--gpu-memory", str(2 << 30)),
                                      ("-q", "--gpu-memory", str(3 << 20), "--evict", "future"),
                                      ("-q", "--gpu-memory", str(2 << 30), "--paused"),
                                      ("-q", "--memory", "driver")])
    table = rows(fake_turns.overhead_markdown({"rows": [{"workload": "w", "overhead": out}]}))
    assert table[0][2] == "limited (100%) over plain" and "passive (not recording) over plain" in table[0]
    assert len(table[2]) == len(table[0]) and table[2][-1] == "True"


def test_rounds_sharing_a_slow_stretch_widen_the_interval_by_blocks():
    """Turns of processes alive together: a process runs slow or fast for stretches of
    about ten rounds (H200).  Simulated so, with no true overhead: the interval over
    single rounds misses 0 most of the time, the one over blocks of neighbouring rounds
    (batch means) about as seldom as a 95% interval should.  Independent rounds get
    about the same interval either way."""
    rng = random.Random(7)

    def series(n: int = 150) -> tuple[list[float], list[float]]:
        levels = [rng.choice((-0.04, 0.04)) for _ in range(n // 10 + 1)]  # each stretch: 4% slow or fast
        base = [1 + rng.gauss(0, 0.01) for _ in range(n)]
        return base, [b + levels[i // 10] + rng.gauss(0, 0.01) for i, b in enumerate(base)]

    covered = {"single": 0, "blocked": 0}
    for _ in range(200):
        base, other = series()
        single, blocked = paired.rounds_overhead(base, other), paired.rounds_overhead(base, other, blocks=12)
        assert blocked["blocks"] == 12 and "blocks" not in single
        assert blocked["overhead_pct"] == single["overhead_pct"]
        covered["single"] += abs(single["overhead_pct"]) < single["ci95_pct"]
        covered["blocked"] += abs(blocked["overhead_pct"]) < blocked["ci95_pct"]
    assert covered["single"] < 120 and covered["blocked"] > 175, covered
    base, _ = series()
    independent = [b + rng.gauss(0, 0.03) for b in base]
    a, b = paired.rounds_overhead(base, independent), paired.rounds_overhead(base, independent, blocks=12)
    assert 0.5 < b["ci95_pct"] / a["ci95_pct"] < 2
    assert paired.rounds_overhead(base[:3], independent[:3], blocks=12)["blocks"] == 3  # at most one a round


def test_independent_runs_pool_by_the_inverse_of_their_variance():
    one, two = {"overhead_pct": 1.0, "ci95_pct": 2.0}, {"overhead_pct": 4.0, "ci95_pct": 4.0}
    est = paired.pooled([one, two, {"rounds": 1}])  # one round: no interval, left out
    assert est["runs"] == 2 and est["overhead_pct"] == pytest.approx((1 * 4 + 4 * 1) / 5)
    assert est["ci95_pct"] == pytest.approx(1.96 / math.sqrt((1.96 / 2) ** 2 + (1.96 / 4) ** 2))
    assert est["ci95_pct"] < 2.0
    assert paired.pooled([{"rounds": 1}]) == {"runs": 0}


def test_overhead_from_recomputes_stored_turns_and_pools_them(tmp_path, capsys):
    """--overhead-from: stored per-step times, whatever intervals the file holds, get the
    current method's (blocks of rounds), and each workload is pooled over the files."""
    import oversub

    rng = random.Random(3)

    def result(shift: float) -> dict:
        plain = [0.03 + rng.gauss(0, 0.001) for _ in range(36)]
        ideal = [p + rng.gauss(0, 0.0005) for p in plain]
        limited = [p * (1 + shift) + rng.gauss(0, 0.0005) for p in plain]
        o = {"method": "balanced-turns", "turn_steps": 3, "rounds": 36, "systems": ["plain", "ideal", "limited"],
             "per_step_s": {"plain": plain, "ideal": ideal, "limited": limited}, "checksums_equal": True,
             "limited_over_plain": {"rounds": 36, "overhead_pct": 99.0, "ci95_pct": 0.1}}  # stale: replaced
        return {"device": "NVIDIA H200", "date": "2026-11-28T00:00:00+00:00",
                "rows": [{"workload": "w", "overhead": o}, {"workload": "v", "pressures": []}]}

    paths = []
    for i, shift in enumerate((0.02, 0.04)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result(shift)))
    out = oversub.overhead_from([str(p) for p in paths])
    stored = json.loads(paths[0].read_text())["rows"][0]["overhead"]["per_step_s"]
    first = paired.rounds_overhead(stored["plain"], stored["limited"], blocks=oversub.overhead_blocks(36))
    assert first["blocks"] == 6
    per_run = [r for r in rows(out) if r and r[0] == "w" and "x" in r[1]]
    assert len(per_run) == 2 and per_run[0][2] == f"**{oversub.pct(first)}**"
    [pool] = [r for r in rows(out) if r and r[0] == "w" and r[1] == "2"]
    assert pool[2] == "72" and 2 < float(pool[3].strip("*").split()[0]) < 4 and pool[-1] == "True"
    (tmp_path / "none.json").write_text(json.dumps({"rows": [{"workload": "v", "pressures": []}]}))
    for bad, says in (("none.json", "no overhead turns"), ("missing.json", "No such file")):
        with pytest.raises(SystemExit, match=says):
            oversub.overhead_from([str(tmp_path / bad)])


def test_a_failed_system_ends_the_others_turns_at_once(fake_turns, monkeypatch):
    real = fake_turns.under_gpuos
    monkeypatch.setattr(fake_turns, "under_gpuos",
                        lambda cmd, *o: [sys.executable, "-c", "raise SystemExit(5)"] if "--evict" in o else real(cmd, *o))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="overhead turns"):
        fake_turns.overhead_turns("0.01", 6, 2 << 30, step_s=0.01, turn_s=0.05)
    assert time.monotonic() - t0 < 20  # not the members' 30 s wait for a turn


def test_group_cells_of_several_slices_say_their_slice():
    import argparse

    import oversub

    cell = {"relative": 0.5, "checksums_equal": True, "bytes_in": 2e9, "in_GBps": 40.0, "switch_mean_ms": 10.0,
            "switch_p99_ms": 20.0, "group": {"switches": 3, "beside_turns": 1}}
    row = {"group": "g", "one_at_a_time": 0.42, "slices_ms": [1000, 3000],
           "pressures": [{"pressure": 150, "slice_ms": s, "reactive": cell, "proactive": cell} for s in (1000, 3000)]}
    lines = oversub.group_markdown({"groups": [row]}).splitlines()
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["150%, 1000 ms slices", "150%, 3000 ms slices"]
    row["slices_ms"], row["pressures"] = [1000], row["pressures"][:1]
    assert oversub.group_markdown({"groups": [row]}).splitlines()[2].startswith("| g | 150% |")
    assert oversub.slice_list("1000,3000") == [1000, 3000]
    for bad in ("0", "1000,x", "-5"):
        with pytest.raises(argparse.ArgumentTypeError):
            oversub.slice_list(bad)


def _watched_exit(argv: list[str]) -> tuple[float, "mps_faults.ExitWatch"]:
    """Start argv, watch it with ExitWatch until it is gone: (its start time, the watch)."""
    import subprocess

    p = subprocess.Popen(argv)
    t0 = time.time()
    w = mps_faults.ExitWatch(p.pid)
    deadline = time.time() + 10
    while w.gone is None and time.time() < deadline:
        time.sleep(0.01)
    p.wait()
    w.stop()
    assert w.gone is not None and w.exiting is not None
    return t0, w


def test_the_faulters_process_is_watched_until_it_is_gone():
    """ExitWatch: when a process began to exit and when it was gone, never before it
    exits."""
    t0, w = _watched_exit(["sleep", "0.2"])
    assert t0 + 0.19 <= w.exiting <= w.gone


def test_a_process_whose_leader_ended_first_is_gone_only_with_its_last_thread():
    """The leader is a zombie while another thread runs on (it may still be closing the
    process's GPU files): ExitWatch says gone only when the whole thread group is."""
    import sys

    code = ("import ctypes, os, threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(0))).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    t0, w = _watched_exit([sys.executable, "-c", code])
    assert w.gone >= t0 + 0.4 and w.exiting <= w.gone


def test_members_that_cannot_share_the_pool_cap_the_group():
    """No two of gpt-train (4.8 GB) and resnet50-train (2.0 GB) fit a 6.16 GB pool
    together: the scheduler never sets them in one turn, so their alone times (6.19 +
    6.95 s) add up to at least the span: 7.09 s of ideal over 13.14 s.  A member whose
    working set is not known yet (0) or that fits beside the others is left out."""
    import oversub

    names = ["gpt-train", "resnet50-train", "gpt-infer", "resnet50-infer"]
    alone = [6.19, 6.95, 3.71, 2.36]
    got = oversub.exclusive_ceiling(names, alone, [4_800, 2_020, 1_600, 630], 6_160, 7.09)
    assert got["members"] == ["gpt-train", "resnet50-train"]
    assert abs(got["alone_s"] - 13.14) < 1e-9 and abs(got["ceiling"] - 7.09 / 13.14) < 1e-9
    # three that pairwise cannot share: all three, the largest sum
    got = oversub.exclusive_ceiling(names, alone, [4_000, 3_000, 3_500, 630], 6_160, 7.09)
    assert got["members"] == ["gpt-train", "resnet50-train", "gpt-infer"]
    # every pair fits, or working sets not known: nothing to say
    assert oversub.exclusive_ceiling(names, alone, [3_000, 2_000, 1_000, 100], 6_160, 7.09) is None
    assert oversub.exclusive_ceiling(names, alone, [4_800, 0, None, 630], 6_160, 7.09) is None


def test_a_groups_idle_time_is_where_no_running_member_makes_a_step():
    """oversub.idle_spans: a steps every 0.1 s to 1.0 s, then waits until 2.1 s; b waits
    from 0.2 s to 1.6 s and ends at 1.8 s.  No running member steps from 1.0 to 1.6 s
    (b's turn) and from 1.8 to 2.1 s (only a runs, waiting): 0.9 s."""
    import oversub

    a = [0.1 * i for i in range(1, 11)] + [2.0 + 0.1 * i for i in range(1, 6)]
    members = [{"workload": "a", "timed_from": 0.0, "step_ends": a},
               {"workload": "b", "timed_from": 0.0, "step_ends": [0.1, 0.2, 1.6, 1.7, 1.8]},
               {"workload": "c", "returncode": 1}]  # failed: no steps, left out
    got = oversub.idle_spans(members, [[0.0, 11, [], []], [1.0, 22, [], [11]]], {11: "a", 22: "b"})
    assert got["gaps"] == {"a": {"count": 1, "seconds": 1.1}, "b": {"count": 1, "seconds": 1.4}}
    assert got["none_progress_s"] == pytest.approx(0.9, abs=0.011)
    assert set(got["none_progress_by_holder"]) == {"b"}
    assert oversub.idle_spans([{"workload": "a", "timed_from": 0.0}], [], {}) is None


def test_the_standbys_driver_wait_after_their_release_is_told_beside_the_faulters_exit():
    """mps_faults.standby_driver_wait: of the standbys' ioctl waits on an NVIDIA device
    that end after the release (at 0.05 s), the longest part after it, with its ioctl,
    when the faulter was gone, and how many standbys had the printf buffer made."""
    import mps_faults

    s = {"released_s": 0.05, "faulter": {"process_gone_s": 0.43},
         "preloads": [{"released": True, "printf_buffer_made": True}, {"released": True}],
         "kernel_waits": [
             {"role": "standby c1", "call": "ioctl", "file": "/dev/nvidia0", "arg": "0xc0384627 rm-alloc-memory 0x71",
              "from_s": 0.06, "to_s": 0.34},
             {"role": "standby c2", "call": "ioctl", "file": "/dev/nvidia0", "arg": "x", "from_s": -2.0, "to_s": 0.02},
             {"role": "standby c2", "call": "read", "file": "pipe:[1]", "arg": "", "from_s": 0.1, "to_s": 0.9},
             {"role": "client c1", "call": "ioctl", "file": "/dev/nvidiactl", "arg": "y", "from_s": 0.0, "to_s": 0.9}]}
    assert mps_faults.standby_driver_wait(s) == (
        "standbys' longest driver wait after the release 0.28 s (0xc0384627 rm-alloc-memory 0x71, until 0.34), "
        "the faulter gone at 0.43, printf buffer made ahead in 1/2")
    assert mps_faults.standby_driver_wait({"released_s": 0.05, "kernel_waits": []}) == ""


def test_issuing_batches_is_split_into_mapping_waiting_for_room_and_the_rest():
    import oversub

    st = [{"ahead_ns": 3_000_000_000, "ahead_map_ns": 1_000_000_000, "room_ns": 500_000_000, "batch_ns": 2_000_000_000},
          {"ahead_ns": 1_000_000_000, "ahead_map_ns": 0, "room_ns": 0, "batch_ns": 0}]
    assert oversub.ahead_issue_split(st) == {"issue_s": 4.0, "map_s": 1.0, "room_s": 0.5, "batch_gpu_s": 2.0}
    assert oversub.ahead_issue_split([{"ahead_ns": 5, "batch_ns": 1}]) is None  # before the figures


def test_making_and_mapping_memory_is_split_by_call():
    import oversub

    st = [{"maps": 3, "map_ns": 1_000_000, "ahead_map_ns": 2_000_000, "create_ns": 600_000, "access_ns": 1_500_000,
           "release_ns": 400_000}, {"maps": 1, "map_ns": 0, "ahead_map_ns": 1_000_000, "create_ns": 200_000,
                                    "access_ns": 500_000, "release_ns": 0}]
    assert oversub.map_split(st) == {"maps": 4, "map_s": 0.004, "create_s": 0.0008, "access_s": 0.002,
                                     "per_map_ms": 1.0, "release_s": 0.0004}
    assert oversub.map_split([{"map_ns": 5}]) is None  # before the figures
