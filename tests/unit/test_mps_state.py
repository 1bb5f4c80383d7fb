"""The MPS supervisor's state machine (gpuos/mps/state.py), without processes.

Every state against every kind of input; the recovery paths (restart, hook, none,
limits, backoff, escalation); faults that are unknown, of another GPU or not ours;
resuming from a snapshot at each step.
"""

from __future__ import annotations

import itertools

import pytest

from gpuos.mps.state import (CHECKPOINT_SETTLE_S, INPUTS, TRACKER_SOURCE,
                             CheckpointSeen, Client, StandbyWaiting, ClientExited, ClientExiting, ClientRequest, ClientSpawnFailed,
                             ClientStarted, DaemonExited, DaemonFailed, DaemonStopped, DaemonUp,
                             Emit, EndServer, Fault, HookFinished, KillHook, Machine, PolicySet,
                             ProbeServer,
                             ReleaseStandby, RestartServer, RunHook, ServerGone, ServerRestarted,
                             ServerSeen, ServerStatus, Settings, SignalClient, SpawnClient,
                             SpawnStandby, StandbyExited, StandbySpawnFailed, StandbyStarted,
                             StartDaemon, State, StopDaemon, StopRequested, StopStandby,
                             TerminateMpsClient, Tick, UnmanagedClients, UnmanagedGone)

S = State
SERVER, DAEMON = 555, 100
REFRESH = Settings().standby_refresh  # a standby's least age before one from a newer checkpoint

# Every transition the machine may make, one "state" event each (docs/mps.md draws them).
EDGES = {
    (S.STARTING, S.RUNNING), (S.STARTING, S.FAILED),
    (S.RUNNING, S.DRAINING), (S.DRAINING, S.RESTARTING),
    (S.RESTARTING, S.RECOVERING), (S.RESTARTING, S.FAILED),
    (S.RECOVERING, S.RUNNING), (S.RECOVERING, S.DRAINING),
    (S.STOPPING, S.STOPPED),
    # resume() only:
    (S.FAILED, S.RESTARTING), (S.FAILED, S.STARTING), (S.STOPPED, S.STARTING),
} | {(s, S.STOPPING) for s in S if s not in (S.STOPPING, S.STOPPED)}


class Run:
    """A machine, a clock, and what it said."""

    def __init__(self, settings: Settings | None = None, gpu: str = "GPU-test"):
        self.m = Machine(gpu, settings or Settings(drain_grace=10, kill_grace=5, restart_attempts=3,
                                                   backoff_initial=1, backoff_max=4, max_restarts=2,
                                                   hook_timeout=30, recent_window=10, stop_grace=10))
        self.t = 1000.0
        self.events: list[dict] = []

    def _take(self, actions: list) -> list:
        for a in actions:
            if isinstance(a, Emit):
                self.events.append(a.event)
                if a.event["event"] == "state":
                    edge = (S(a.event["previous"]), S(a.event["state"]))
                    assert edge in EDGES, f"illegal transition {edge}"
        snap = self.m.snapshot()
        assert Machine.from_snapshot(snap).snapshot() == snap  # persisted as is, every step
        return [a for a in actions if not isinstance(a, Emit)]

    def start(self) -> list:
        return self._take(self.m.start(self.t))

    def resume(self) -> list:
        return self._take(self.m.resume(self.t))

    def feed(self, inp, dt: float = 0.0) -> list:
        self.t += dt
        return self._take(self.m.handle(inp, self.t))

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    def last(self, name: str) -> dict:
        return next(e for e in reversed(self.events) if e["event"] == name)

    # -- scenarios
    def client(self, cid: str, policy: str | None = None, hook: str | None = None, **kw) -> list:
        return self.feed(ClientRequest(Client(id=cid, cmd=["job", cid], cwd="/w", uid=1000, gid=1000,
                                              policy=policy, hook=hook, **kw)))

    def running(self, n: int = 2, **client_kw) -> "Run":
        assert self.start() == [StartDaemon()]
        self.feed(DaemonUp(DAEMON))
        for i in range(1, n + 1):
            acts = self.client(f"c{i}", **client_kw)
            assert acts == [SpawnClient(f"c{i}", f"GPU-test:c{i}:1")]
            self.feed(ClientStarted(f"c{i}", 2000 + i, 77))
        self.feed(ServerSeen(SERVER))
        assert self.m.state is S.RUNNING
        return self

    def fault(self, pid: int | None = 2001, cls: str = "memory", ours: bool | None = True,
              xid: int | None = 31, dt: float = 0.0) -> list:
        return self.feed(Fault({"xid": xid, "fault_class": cls, "pid": pid, "source": "kmsg"}, ours), dt)

    def drained(self) -> list:
        acts = []
        for c in list(self.m.clients.values()):
            if c.state == "victim" and c.pid:
                acts += self.feed(ClientExited(c.id, 1, c.pid))
        return acts


def of(actions: list, kind) -> list:
    return [a for a in actions if isinstance(a, kind)]


# -- starting -------------------------------------------------------------------------------

def test_start_runs_the_daemon_then_queued_clients():
    r = Run()
    assert r.start() == [StartDaemon()]
    assert r.client("c1") == []  # queued while starting
    assert r.m.clients["c1"].state == "pending" and "client-queued" in r.names()
    acts = r.feed(DaemonUp(DAEMON))
    assert r.m.state is S.RUNNING and r.m.daemon_pid == DAEMON
    assert acts == [SpawnClient("c1", "GPU-test:c1:1")]
    r.feed(ClientStarted("c1", 2001, 5))
    c = r.m.clients["c1"]
    assert (c.state, c.pid, c.starttime) == ("running", 2001, 5)


def test_daemon_that_fails_to_start_fails_the_supervisor():
    r = Run()
    r.start()
    r.feed(DaemonFailed("nvidia-cuda-mps-control -d failed: boom"))
    assert r.m.state is S.FAILED and "boom" in r.m.failure
    # A failed supervisor takes no clients and moves only for a stop.
    r.client("c9")
    assert "c9" not in r.m.clients and "client-refused" in r.names()
    for inp in (Tick(), DaemonUp(1), ServerSeen(2)):
        r.feed(inp, 100)
        assert r.m.state is S.FAILED
    r.feed(StopRequested())
    assert r.m.state is S.STOPPING


def test_client_that_cannot_start_is_failed():
    r = Run().running(1)
    r.client("c2")
    r.feed(ClientSpawnFailed("c2", "no such file"))
    assert r.m.clients["c2"].state == "failed" and "client-spawn-failed" in r.names()
    assert r.m.state is S.RUNNING


def test_client_exits_outside_incidents():
    r = Run().running(2)
    r.feed(ClientExited("c1", 0, 2001))
    assert r.m.clients["c1"].state == "exited"
    acts = r.feed(ClientExited("c2", 3, 2002))
    assert r.m.clients["c2"].state == "failed"
    assert acts == [ProbeServer(SERVER)]  # a failure may be a fault: ask the server
    assert r.m.state is S.RUNNING
    # A stale pid (an old process of a client) is ignored.
    r.client("c3")
    r.feed(ClientStarted("c3", 3003))
    r.feed(ClientExited("c3", 1, 999))
    assert r.m.clients["c3"].state == "running"


# -- the recovery, by policy ----------------------------------------------------------------------

def test_fault_takes_every_client_and_restart_brings_them_back():
    r = Run().running(3)
    acts = r.fault(pid=2002)
    assert r.m.state is S.DRAINING and acts == []
    inc = r.m.incident
    assert inc.cause == "fault" and inc.server_pid == SERVER
    assert [(v.client, v.pid, v.role) for v in inc.victims] == [
        ("c1", 2001, "victim"), ("c2", 2002, "named"), ("c3", 2003, "victim")]
    opened = r.last("incident-opened")
    assert opened["incident"] == inc.id and opened["faults"][0]["xid"] == 31
    r.feed(ClientExited("c1", 1, 2001))
    r.feed(ClientExited("c2", 1, 2002))
    assert r.m.state is S.DRAINING
    acts = r.feed(ClientExited("c3", -6, 2003))
    assert r.m.state is S.RESTARTING
    assert acts == [RestartServer(1000, SERVER)]
    acts = r.feed(ServerRestarted(True, SERVER, DAEMON, "server 555 is ACTIVE"))
    assert r.m.state is S.RECOVERING
    assert acts == [SpawnClient(f"c{i}", f"GPU-test:c{i}:2") for i in (1, 2, 3)]
    for i in (1, 2, 3):
        r.feed(ClientStarted(f"c{i}", 3000 + i))
    assert r.m.state is S.RUNNING and r.m.incident is None
    h = r.m.history[-1]
    assert h["outcome"] == "recovered" and h["cause"] == "fault"
    assert [v["recovery"] for v in h["victims"]] == ["restarted"] * 3
    assert [r.m.clients[f"c{i}"].restarts for i in (1, 2, 3)] == [1, 1, 1]
    assert [r.m.clients[f"c{i}"].pid for i in (1, 2, 3)] == [3001, 3002, 3003]
    closed = r.last("incident-closed")
    assert closed["incident"] == 1 and closed["outcome"] == "recovered"
    # Every step announced itself, in this order.
    steps = ["incident-opened", "victim-exited", "drained", "server-ready", "victim-restarting",
             "victim-restarted", "incident-closed"]
    names = r.names()
    assert [n for n in names if n in steps] == sorted((n for n in names if n in steps),
                                                      key=lambda n: names.index(n))
    assert all(n in names for n in steps)


def test_the_incident_says_how_long_each_victim_had_run():
    """A restarted (or taken-over) victim starts from its beginning: the record says how
    much of a run the fault ended."""
    r = Run().running(2)
    r.feed(ClientExited("c2", 1, 2002), 30.0)  # failed first: its run ended there
    r.fault(pid=2001, ours=True)
    r.feed(Tick(), 5.0)
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))
    r.feed(ClientStarted("c2", 3002))
    ran = {v["client"]: v["ran_s"] for v in r.m.history[-1]["victims"]}
    assert ran == {"c1": 30.0, "c2": 30.0}
    assert {v["client"]: v["ran_s"] for v in r.last("incident-closed")["victims"]} == ran


def test_the_incident_says_how_much_work_was_lost_since_the_checkpoint():
    """A client that names its checkpoint: a restarted victim resumes from the newest one
    written during its run, so it lost only the time since; one written before its run
    (where it began) or after the fault does not count, nor does one of a client that
    names none."""
    r = Run().running(3, checkpoint="/w/ckpt")
    r.m.clients["c3"].checkpoint = None
    t0 = r.t
    r.feed(CheckpointSeen("c1", t0 + 20.0), 25.0)   # during c1's run
    r.feed(CheckpointSeen("c2", t0 - 100.0))        # from before c2's run: where it began
    r.feed(CheckpointSeen("c3", t0 + 20.0))         # c3 names no checkpoint
    assert r.last("input-ignored")["why"] == "it names no checkpoint"
    r.feed(CheckpointSeen("c1", t0 + 10.0))         # older than the one seen: kept
    assert r.m.clients["c1"].checkpoint_at == t0 + 20.0
    r.fault(pid=2001, dt=5.0)                        # at t0 + 30
    r.feed(CheckpointSeen("c1", t0 + 31.0), 1.0)    # after the fault: not for this incident
    r.feed(Tick(), 1.0)
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    for i in (1, 2, 3):
        r.feed(ClientStarted(f"c{i}", 3000 + i))
    got = {v["client"]: (v["ran_s"], v["lost_s"], v["resumes_from"]) for v in r.m.history[-1]["victims"]}
    assert got == {"c1": (30.0, 10.0, "checkpoint"), "c2": (30.0, 30.0, "start"),
                   "c3": (30.0, 30.0, "start")}
    assert {v["client"]: v["lost_s"] for v in r.last("incident-closed")["victims"]} == \
        {"c1": 10.0, "c2": 30.0, "c3": 30.0}


def test_a_standby_resumes_from_the_checkpoint_it_started_from_and_is_started_again_from_a_newer():
    """A standby's application read its checkpoint at its own start: a take-over loses the
    work since that one, not since the newest.  So a standby older than a newer, settled
    checkpoint is replaced (once it is Settings.standby_refresh old), and the replacement's
    take-over loses only the time since the newer one.  Make before break: the old
    standby stays until its replacement waits, and is the one released by a fault before."""
    r = Run()
    r.start()
    r.feed(DaemonUp(DAEMON))
    r.client("c1", policy="standby", checkpoint="/w/ckpt")
    t0 = r.t
    assert r.feed(ClientStarted("c1", 2001, 77)) == [SpawnStandby("c1", standby_token("c1"))]
    r.feed(StandbyStarted("c1", standby_token("c1"), 4001, 88))
    r.feed(ServerSeen(SERVER))
    # a checkpoint 10 s in: the standby is too young to be replaced, then it is not settled
    assert r.feed(CheckpointSeen("c1", t0 + 10.0), 10.0) == []
    # settled, and the standby old enough: its replacement starts beside it
    assert r.feed(Tick(), REFRESH) == [SpawnStandby("c1", standby_token("c1", 2))]
    c = r.m.clients["c1"]
    assert (c.standby_pid, c.next_standby_token) == (4001, standby_token("c1", 2))
    assert r.last("standby-refreshing")["checkpoint_at"] == t0 + 10.0
    r.feed(StandbyStarted("c1", standby_token("c1", 2), 4002, 89))
    assert c.standby_pid == 4001 and c.next_standby_pid == 4002
    assert r.m._managed_pids() >= {2001, 4001, 4002}  # not an unmanaged client of the server
    assert r.feed(Tick(), 5.0) == []  # not waiting yet: both kept
    assert r.feed(StandbyWaiting("c1", standby_token("c1"))) == []  # the old one's: nothing
    # it waits: it is the standby, the old one stopped
    assert r.feed(StandbyWaiting("c1", standby_token("c1", 2))) == [StopStandby("c1", standby_token("c1"), 4001, 88)]
    assert (c.standby_token, c.standby_pid, c.standby_state_at, c.next_standby_token) == \
        (standby_token("c1", 2), 4002, t0 + 10.0, None)
    stop = r.last("standby-stopped")
    assert (stop["pid"], stop["why"]) == (4001, "a newer checkpoint: its replacement, started from it, waits")
    # a newer checkpoint just written: not settled, the standby is kept
    t_new = r.t + REFRESH
    r.feed(CheckpointSeen("c1", t_new), REFRESH)
    assert r.feed(Tick(), CHECKPOINT_SETTLE_S / 2) == []
    # settled: a third starts; the fault comes before it waits: the second takes over and
    # the third is stopped
    assert r.feed(Tick(), CHECKPOINT_SETTLE_S) == [SpawnStandby("c1", standby_token("c1", 3))]
    r.feed(StandbyStarted("c1", standby_token("c1", 3), 4003, 90))
    acts = r.fault(pid=2001)
    assert StopStandby("c1", standby_token("c1", 3), 4003, 90) in acts
    assert not any(isinstance(a, StopStandby) and a.pid == 4002 for a in acts)
    assert c.next_standby_token is None
    assert r.feed(StandbyWaiting("c1", standby_token("c1", 3))) == []  # too late: stopped
    opened = r.t
    r.drained()
    assert of(r.feed(ServerRestarted(True, SERVER)), ReleaseStandby) == \
        [ReleaseStandby("c1", standby_token("c1", 2), 4002, 89)]
    r.feed(ClientStarted("c1", 4002, 89))
    v = r.m.history[-1]["victims"][0]
    assert v["recovery"] == "took-over"
    assert (v["lost_s"], v["resumes_from"]) == (round(opened - (t0 + 10.0), 3), "checkpoint")
    assert v["lost_s"] > round(opened - t_new, 3)  # more than since the newest: what it cost


def _checkpointing_client() -> Run:
    """c1 (policy standby, --checkpoint: pid 2001) and its standby 4001, the server seen."""
    r = Run()
    r.start()
    r.feed(DaemonUp(DAEMON))
    r.client("c1", policy="standby", checkpoint="/w/ckpt")
    r.feed(ClientStarted("c1", 2001, 77))
    r.feed(StandbyStarted("c1", standby_token("c1"), 4001, 88))
    r.feed(ServerSeen(SERVER))
    return r


def _stale_standby_run() -> Run:
    """_checkpointing_client whose standby is due for a replacement (token 2 started)."""
    r = _checkpointing_client()
    r.feed(CheckpointSeen("c1", r.t + REFRESH), REFRESH)  # just written: not settled
    assert r.feed(Tick(), CHECKPOINT_SETTLE_S) == [SpawnStandby("c1", standby_token("c1", 2))]
    return r


def test_a_replacement_standby_that_fails_leaves_the_standby_in_place_and_is_tried_a_few_times():
    r = _stale_standby_run()
    c = r.m.clients["c1"]
    assert r.feed(StandbySpawnFailed("c1", standby_token("c1", 2), "no such file")) == \
        [SpawnStandby("c1", standby_token("c1", 3))]
    r.feed(StandbyStarted("c1", standby_token("c1", 3), 4003, 90))
    assert r.feed(StandbyExited("c1", 4003, 1)) == [SpawnStandby("c1", standby_token("c1", 4))]
    assert r.last("standby-exited")["replacement"] is True
    assert r.feed(StandbySpawnFailed("c1", standby_token("c1", 4), "no such file")) == []  # STANDBY_LOSSES
    assert (c.standby_pid, c.next_standby_token, c.standby_losses) == (4001, None, 3)
    assert r.feed(Tick(), 10 * REFRESH) == []


def test_when_the_standby_in_place_ends_its_replacement_is_the_standby_at_once():
    r = _stale_standby_run()
    c = r.m.clients["c1"]
    r.feed(StandbyStarted("c1", standby_token("c1", 2), 4002, 89))
    assert r.feed(StandbyExited("c1", 4001, -9)) == []  # no third one
    assert (c.standby_token, c.standby_pid, c.next_standby_token) == (standby_token("c1", 2), 4002, None)
    assert c.standby_state_at == c.checkpoint_at


def test_a_standby_follows_checkpoints_that_come_faster_than_they_settle():
    """A loop that checkpoints every second never leaves its newest one unchanged for
    CHECKPOINT_SETTLE_S: its standby is replaced all the same once it is old enough."""
    r = _checkpointing_client()
    spawns = []
    for _ in range(int(REFRESH) + 2):
        spawn = of(r.feed(CheckpointSeen("c1", r.t + 1.0), 1.0), SpawnStandby)
        if spawn:
            spawns.append((spawn, r.m.clients["c1"].checkpoint_at))
    assert [s for s, _ in spawns] == [[SpawnStandby("c1", standby_token("c1", 2))]]
    assert r.m.clients["c1"].next_standby_state_at == spawns[0][1]  # the newest when it started


def test_no_standby_is_replaced_during_an_incident_or_without_a_newer_checkpoint():
    r = Run()
    r.start()
    r.feed(DaemonUp(DAEMON))
    r.client("c1", policy="standby", checkpoint="/w/ckpt")
    r.feed(CheckpointSeen("c1", r.t - 5.0))  # before its start: its standby starts from it
    r.feed(ClientStarted("c1", 2001, 77))
    r.feed(StandbyStarted("c1", standby_token("c1"), 4001, 88))
    r.feed(ServerSeen(SERVER))
    assert r.m.clients["c1"].standby_state_at is not None
    assert not of(r.feed(Tick(), 10 * REFRESH), StopStandby)  # nothing newer
    r.feed(CheckpointSeen("c1", r.t))
    r.fault(pid=2001)
    assert not of(r.feed(Tick(), 10 * REFRESH), StopStandby)  # draining: kept to be released


def test_hook_and_none_policies():
    r = Run().running(0)
    r.client("h", policy="hook", hook="resume-from-ckpt")
    r.feed(ClientStarted("h", 2001))
    r.client("n", policy="none")
    r.feed(ClientStarted("n", 2002))
    r.client("x", policy="hook")  # no hook anywhere
    r.feed(ClientStarted("x", 2003))
    r.fault(pid=2002)
    r.drained()
    acts = r.feed(ServerRestarted(True, SERVER))
    assert acts == [RunHook("h", "GPU-test:h:hook:1:1")]
    inc = r.m.incident
    assert inc.victim_of("n").recovery == "not-recovered"
    assert inc.victim_of("x").recovery == "failed" and "no hook" in inc.victim_of("x").detail
    assert r.m.state is S.RECOVERING
    r.feed(HookFinished("h", 0))
    assert r.m.state is S.RUNNING
    h = r.m.history[-1]
    assert h["outcome"] == "partial"  # x could not be recovered
    assert {v["client"]: v["recovery"] for v in h["victims"]} == {
        "h": "hook-ok", "n": "not-recovered", "x": "failed"}
    assert r.m.clients["h"].state == "hooked" and r.m.clients["n"].state == "not-recovered"


def test_default_hook_and_policy_changes():
    r = Run().running(1)
    r.feed(PolicySet(None, "hook", "default-hook"))
    assert r.m.settings.default_policy == "hook" and r.m.policy_of(r.m.clients["c1"]) == ("hook", "default-hook")
    r.feed(PolicySet("c1", "none"))
    assert r.m.policy_of(r.m.clients["c1"])[0] == "none"
    r.feed(PolicySet("c1", "bogus"))
    r.feed(PolicySet("nobody", "restart"))
    assert r.m.clients["c1"].policy == "none"
    assert [e["why"] for e in r.events if e["event"] == "input-ignored"] == [
        "unknown policy 'bogus'", "no client nobody"]


def test_hook_failures_and_timeouts():
    r = Run().running(2, policy="hook", hook="h.sh")
    r.fault()
    r.drained()
    acts = r.feed(ServerRestarted(True, SERVER))
    assert of(acts, RunHook) == [RunHook("c1", "GPU-test:c1:hook:1:1"), RunHook("c2", "GPU-test:c2:hook:1:1")]
    r.feed(HookFinished("c1", 2))
    assert r.feed(Tick(), 29) == []
    assert r.feed(Tick(), 2) == [KillHook("c2")]
    r.feed(HookFinished("c2", -9, "hook timed out (killed)"))
    h = r.m.history[-1]
    assert h["outcome"] == "partial"
    assert {v["client"]: v["recovery"] for v in h["victims"]} == {"c1": "hook-failed", "c2": "hook-failed"}
    # A HookFinished nobody waits for is ignored.
    r.feed(HookFinished("c1", 0))
    assert r.last("input-ignored")["input"] == "HookFinished"


def test_recovery_limit():
    r = Run().running(1)  # max_restarts 2
    for round_ in (1, 2, 3):
        r.t += 11  # past recent_window: a new fault, not an echo of the last one
        r.fault(pid=r.m.clients["c1"].pid)
        r.drained()
        acts = r.feed(ServerRestarted(True, SERVER))
        if round_ < 3:
            r.feed(ClientStarted("c1", 4000 + round_))
            assert r.m.state is S.RUNNING
        else:
            assert acts == []
            assert r.m.state is S.RUNNING
    assert r.m.clients["c1"].state == "gave-up"
    v = r.m.history[-1]["victims"][0]
    assert v["recovery"] == "gave-up" and "limit 2" in v["detail"]
    assert r.m.history[-1]["outcome"] == "partial"


def test_a_late_report_of_a_handled_fault_is_an_echo():
    """NVML's report of an Xid came 4 s after the kernel log's on an H100 under MPS, after
    the incident had closed: it must not open a second incident that kills the victims
    just restarted.  Evidence still counts: a client failing with it opens one."""
    r = Run().running(2)
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001), 0.5)
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and len(r.m.history) == 1
    acts = r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": None, "source": "nvml"}, True), 2.0)
    assert r.m.state is S.RUNNING and r.m.incident is None and acts == [ProbeServer(SERVER)]
    assert r.last("fault")["echo"] is True
    # another Xid is a fault of its own
    r.fault(pid=None, xid=13, cls="sm")
    assert r.m.state is S.DRAINING and r.m.incident.id == 2
    # an echo while recovering is put on record and drains nothing again
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3101))
    rounds = r.m.incident.rounds
    r.fault(pid=None, xid=13, cls="sm")
    assert r.m.state is S.RECOVERING and r.m.incident.rounds == rounds
    assert r.m.incident.faults[-1]["xid"] == 13
    r.feed(ClientStarted("c2", 3102))
    assert r.m.state is S.RUNNING
    # an echo with a client failing: an incident after all
    r.fault(pid=None, xid=13, cls="sm")
    assert r.m.incident is None
    r.feed(ClientExited("c1", 3, 3101), 0.1)
    assert r.m.state is S.DRAINING and r.m.incident.id == 3
    # past recent_window the same Xid is new again
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3201))
    r.feed(ClientStarted("c2", 3202))
    r.t += 11
    r.fault(pid=None, xid=13, cls="sm")
    assert r.m.incident is not None and r.m.incident.id == 4


def test_per_client_limit_overrides_the_default():
    r = Run().running(1, max_restarts=0)
    r.fault()
    r.drained()
    assert r.feed(ServerRestarted(True, SERVER)) == []
    assert r.m.clients["c1"].state == "gave-up"


def tracker_fault(pid: int) -> Fault:
    """What faultsrc.TrackerSource makes of a fatal fault in pid's address space (no GPU
    named: attributed by its pid)."""
    return Fault({"xid": 31, "fault_class": "memory", "pid": pid, "source": TRACKER_SOURCE}, None)


def test_the_faulter_named_by_the_tracker_is_not_restarted_after_max_faults():
    """The tracker names the faulter for certain: it is marked so (not merely "named"), its
    faults are counted once an incident, and at max_faults (default 2) it is no longer
    recovered while its co-runner is."""
    r = Run(Settings(max_restarts=10, recent_window=10))
    r.running(2)
    for round_ in (1, 2):
        r.t += 11  # past recent_window: a new fault, not an echo of the last one
        r.fault(pid=r.m.clients["c1"].pid)  # the Xid line names c1 too: still one fault of c1's
        r.feed(tracker_fault(r.m.clients["c1"].pid))
        roles = {v.client: v.role for v in r.m.incident.victims}
        assert roles == {"c1": "faulter", "c2": "victim"}
        r.drained()
        r.feed(ServerRestarted(True, SERVER))
        if round_ == 1:
            r.feed(ClientStarted("c1", 4001))
        r.feed(ClientStarted("c2", 4100 + round_))
        assert r.m.state is S.RUNNING
    assert r.m.clients["c1"].faults == 2 and r.m.clients["c1"].state == "gave-up"
    v = {v["client"]: v for v in r.m.history[-1]["victims"]}
    assert v["c1"]["recovery"] == "gave-up" and "caused 2 GPU faults (limit 2)" in v["c1"]["detail"]
    assert v["c2"]["recovery"] == "restarted" and r.m.clients["c2"].faults == 0


def test_a_fault_only_the_xid_names_counts_against_no_one():
    """An Xid's pid under MPS need not be the faulter's: "named", never counted."""
    r = Run(Settings(max_restarts=10, max_faults=1, recent_window=10))
    r.running(1)
    r.fault(pid=r.m.clients["c1"].pid)
    assert r.m.incident.victims[0].role == "named"
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    assert r.m.clients["c1"].faults == 0 and r.m.clients["c1"].state == "starting"


def test_per_client_fault_limit_overrides_the_default():
    r = Run().running(1, max_faults=1)
    r.feed(tracker_fault(2001))
    assert r.m.state is S.DRAINING  # the tracker's fault alone opens the incident
    r.drained()
    assert r.feed(ServerRestarted(True, SERVER)) == []
    assert r.m.clients["c1"].state == "gave-up"


def test_restarted_victim_that_dies_again_is_recovered_again():
    r = Run().running(2)
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))
    acts = r.feed(ClientExited("c1", 1, 3001))  # died again before c2 was back
    assert acts == [SpawnClient("c1", "GPU-test:c1:3")]
    assert r.m.state is S.RECOVERING
    r.feed(ClientStarted("c1", 3101))
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and r.m.clients["c1"].restarts == 2


# -- draining ------------------------------------------------------------------------------------

def test_victims_that_do_not_exit_are_killed():
    r = Run().running(2)
    r.feed(UnmanagedClients((2001, 2002, 7777)))  # 7777: not started by gpuos
    assert r.m.unmanaged == [7777]
    r.fault()
    inc = r.m.incident
    other = [v for v in inc.victims if v.client is None]
    assert [(v.pid, v.recovery) for v in other] == [(7777, "unmanaged")]
    r.feed(ClientExited("c1", 1, 2001))
    assert r.feed(Tick(), 9.9) == []
    acts = r.feed(Tick(), 0.2)
    assert acts == [SignalClient("c2", 2002, "SIGTERM", 77), TerminateMpsClient(SERVER, 7777)]
    assert r.last("drain-timeout")["stage"] == "SIGTERM"
    acts = r.feed(Tick(), 5.1)
    assert acts == [SignalClient("c2", 2002, "SIGKILL", 77)]  # never signals what is not ours
    r.feed(UnmanagedGone(7777))
    assert r.m.state is S.DRAINING
    acts = r.feed(Tick(), 5.1)  # c2 survived SIGKILL (stuck in D state?): go on without it
    assert r.m.state is S.RESTARTING and of(acts, RestartServer)
    assert "did not exit" in inc.victim_of("c2").detail
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))
    r.feed(ClientStarted("c2", 3002))
    h = r.m.history[-1]
    assert h["outcome"] == "recovered"
    assert {v["pid"]: v["recovery"] for v in h["victims"]} == {2001: "restarted", 2002: "restarted",
                                                                7777: "unmanaged"}
    assert {v["pid"]: v["signalled"] for v in h["victims"]}[2002] == "SIGKILL"


def test_unmanaged_client_list_updates_drain():
    r = Run().running(0)
    r.feed(UnmanagedClients((7,)))
    r.fault(pid=7)
    assert r.m.incident.victims[0].role == "named"
    r.feed(UnmanagedClients(()))
    assert r.m.state is S.RESTARTING


def test_client_exits_before_the_fault_report_are_its_victims():
    r = Run().running(2)
    r.feed(ClientExited("c2", 1, 2002), 0.1)      # the named one dies first ...
    r.feed(ClientExited("c1", 1, 2001), 0.1)      # ... its co-runner too
    r.fault(pid=2002)                             # the kernel log says why, later
    inc = r.m.incident
    assert {(v.client, v.role, v.exited) for v in inc.victims} == {("c1", "victim", True),
                                                                   ("c2", "named", True)}
    assert r.m.state is S.RESTARTING  # nothing left to drain


def test_old_failures_are_not_victims():
    r = Run().running(2)
    r.feed(ClientExited("c2", 1, 2002))
    r.t += 60
    r.fault(pid=2001)
    assert [v.client for v in r.m.incident.victims] == ["c1"]


# -- what opens an incident ---------------------------------------------------------------------------

def test_server_death_with_clients_is_an_incident():
    r = Run().running(1)
    r.feed(ServerGone(SERVER))
    assert r.m.state is S.DRAINING and r.m.incident.cause == "server-exit"
    assert r.m.server_pid is None


def test_server_death_without_clients_is_not():
    r = Run().running(0)
    r.feed(ServerGone(SERVER))
    assert r.m.state is S.RUNNING and r.m.incident is None
    assert "server-exited" in r.names()
    r.feed(ServerGone(12345))  # not our server
    assert r.m.state is S.RUNNING


def test_server_reporting_fault_is_an_incident():
    r = Run().running(1)
    r.feed(ServerStatus(SERVER, "ACTIVE"))
    assert r.m.state is S.RUNNING
    r.feed(ServerStatus(SERVER, "FAULT"))
    assert r.m.state is S.DRAINING and r.m.incident.cause == "server-fault"
    r.feed(ServerStatus(999, "FAULT"))  # another server's status changes nothing


def test_daemon_death_is_an_incident_and_the_restart_starts_it():
    r = Run().running(2)
    acts = r.feed(DaemonExited(DAEMON))
    inc = r.m.incident
    assert r.m.daemon_pid is None and inc.cause == "daemon-exit"
    # Its server and clients may be fine: they are no victims, nobody is killed.
    assert inc.victims == [] and r.m.state is S.RESTARTING and of(acts, RestartServer)
    r.feed(ClientExited("c2", 1, 2002))  # but one that fails meanwhile is
    assert [v.client for v in inc.victims] == ["c2"]
    r.feed(ServerRestarted(True, 600, 101))
    assert r.m.daemon_pid == 101 and r.m.server_pid == 600
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and r.m.clients["c1"].state == "running"
    assert r.m.history[-1]["outcome"] == "recovered"
    r.feed(DaemonExited(99))  # not ours
    assert r.m.daemon_pid == 101


def test_unknown_xid_is_reported_never_dropped():
    r = Run().running(1)
    acts = r.fault(pid=None, cls="unknown", xid=4242)
    ev = r.last("fault")
    assert ev["unknown"] is True and ev["fault"]["xid"] == 4242 and not ev["actionable"]
    assert r.m.state is S.RUNNING and acts == [ProbeServer(SERVER)]
    # The probe shows the damage: the incident carries the unknown Xid as its cause.
    r.feed(ServerStatus(SERVER, "FAULT"), 0.5)
    assert [f["xid"] for f in r.m.incident.faults] == [4242]
    assert r.last("incident-opened")["faults"][0]["fault_class"] == "unknown"


def test_unknown_xid_with_a_healthy_server_stays_on_record_only():
    r = Run().running(1)
    r.fault(pid=None, cls="unknown", xid=4242)
    r.feed(ServerStatus(SERVER, "ACTIVE"))
    assert r.m.state is S.RUNNING
    assert any(e["event"] == "fault" and e["fault"]["xid"] == 4242 for e in r.events)
    r.t += 60  # long after: not the cause of a later incident
    r.fault(pid=2001, xid=13, cls="sm")
    assert [f["xid"] for f in r.m.incident.faults] == [13]


def test_faults_of_other_gpus_and_unattributed_faults():
    r = Run().running(1)
    r.fault(pid=99999, ours=False)
    assert r.m.state is S.RUNNING and r.last("fault-other-gpu")["fault"]["pid"] == 99999
    r.fault(pid=2001, ours=False)  # names our client: it is ours, whatever the GPU field says
    assert r.m.state is S.DRAINING and r.last("fault")["attributed"] is True


def test_fault_not_known_to_be_ours_only_probes():
    r = Run().running(1)
    acts = r.fault(pid=None, ours=None)
    assert r.m.state is S.RUNNING and acts == [ProbeServer(SERVER)]
    assert r.last("fault")["attributed"] is False
    r.feed(ServerGone(SERVER))
    assert r.m.incident.cause == "server-exit" and r.m.incident.faults[0]["xid"] == 31


def test_info_faults_are_recorded_only():
    r = Run().running(1)
    r.fault(cls="info", xid=154)
    assert r.m.state is S.RUNNING and r.last("fault")["fault"]["xid"] == 154


def test_device_fault_marks_the_incident_and_the_failure():
    r = Run().running(1)
    r.fault(cls="device", xid=79)
    assert r.m.incident.needs_reset
    r.drained()
    for _ in range(3):
        r.feed(ServerRestarted(False, detail="no server"))
        r.feed(Tick(), 10)
    assert r.m.state is S.FAILED and "reset" in r.m.failure


def test_fault_while_starting_is_kept_for_later():
    r = Run()
    r.start()
    r.fault(pid=None)
    assert r.m.state is S.STARTING and len(r.m.recent_faults) == 1


# -- restarting the server -----------------------------------------------------------------------------

def test_restart_backoff_then_failure_then_resume():
    r = Run().running(1)
    r.fault()
    r.drained()
    acts = r.feed(ServerRestarted(False, detail="server 555 is FAULT"))
    assert acts == [] and r.m.incident.next_attempt_at == r.t + 1
    assert r.feed(Tick(), 0.9) == []
    assert of(r.feed(Tick(), 0.2), RestartServer)
    r.feed(ServerRestarted(False, detail="still FAULT"))
    assert r.m.incident.next_attempt_at == pytest.approx(r.t + 2)
    r.feed(Tick(), 2.1)
    r.feed(ServerRestarted(False, detail="still FAULT"))
    assert r.m.state is S.FAILED
    assert "3 attempts" in r.m.failure and "still FAULT" in r.m.failure
    assert r.m.incident is not None and r.m.incident.closed is None  # unfinished: kept
    final = r.last("server-restart-failed")
    assert final["final"] is True
    # `gpuos mps recover`: a new supervisor resumes the incident.
    r2 = Run()
    r2.m = Machine.from_snapshot(r.m.snapshot())
    acts = r2.resume()
    assert r2.m.state is S.RESTARTING and acts == [RestartServer(1000, SERVER)]
    r2.feed(ServerRestarted(True, 556))
    r2.feed(ClientStarted("c1", 3001))
    assert r2.m.state is S.RUNNING and r2.m.history[-1]["outcome"] == "recovered"


def test_backoff_is_capped():
    st = Settings(backoff_initial=0.5, backoff_max=30)
    assert [st.backoff(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_restart_results_outside_restarting_are_ignored():
    r = Run().running(1)
    r.feed(ServerRestarted(True, 1))
    assert r.m.state is S.RUNNING and r.m.server_pid == SERVER
    assert r.last("input-ignored")["input"] == "ServerRestarted"


# -- during an incident ---------------------------------------------------------------------------------

def test_new_clients_wait_for_the_recovery():
    r = Run().running(1)
    r.fault()
    assert r.client("late") == []
    assert r.m.clients["late"].state == "pending"
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    acts = r.feed(ClientStarted("c1", 3001))
    assert acts == [SpawnClient("late", "GPU-test:late:1")]


def test_fault_during_recovery_drains_again():
    r = Run().running(2)
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))
    r.fault(pid=3001)
    inc = r.m.incident
    assert r.m.state is S.DRAINING and inc.rounds == 2 and inc.id == 1
    assert "incident-reopened" in r.names()
    assert inc.victim_of("c1").recovery == "pending" and inc.victim_of("c1").role == "named"
    r.feed(ClientExited("c1", 1, 3001))
    # c2's restart had not been confirmed; it still is, and then it is a victim of round 2
    r.feed(ClientStarted("c2", 3002))
    r.feed(ClientExited("c2", 1, 3002))
    assert r.m.state is S.RESTARTING
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3101))
    r.feed(ClientStarted("c2", 3102))
    assert r.m.state is S.RUNNING and r.m.history[-1]["rounds"] == 2


def test_more_faults_join_the_open_incident():
    r = Run().running(2)
    r.fault(pid=2001)
    r.fault(pid=2002, xid=43, cls="channel")
    inc = r.m.incident
    assert [f["xid"] for f in inc.faults] == [31, 43]
    assert {v.client: v.role for v in inc.victims} == {"c1": "named", "c2": "named"}


# -- stopping ---------------------------------------------------------------------------------------------

def test_stop_terminates_clients_then_the_daemon():
    r = Run().running(2)
    r.client("queued")
    r.feed(ClientSpawnFailed("queued", "x"))
    acts = r.feed(StopRequested())
    assert r.m.state is S.STOPPING
    assert acts == [SignalClient("c1", 2001, "SIGTERM", 77), SignalClient("c2", 2002, "SIGTERM", 77)]
    r.feed(ClientExited("c1", -15, 2001))
    acts = r.feed(ClientExited("c2", -15, 2002))
    assert acts == [StopDaemon()]
    r.feed(DaemonStopped("quit"))
    assert r.m.state is S.STOPPED and r.m.daemon_pid is None
    assert {c.state for c in r.m.clients.values() if c.id != "queued"} == {"stopped"}
    assert r.feed(StopRequested()) == [] and r.m.state is S.STOPPED


def test_stop_escalates_to_sigkill_and_goes_on():
    r = Run().running(1)
    r.feed(StopRequested(grace=2))
    assert r.feed(Tick(), 1) == []
    assert r.feed(Tick(), 1.1) == [SignalClient("c1", 2001, "SIGKILL", 77)]
    assert r.feed(Tick(), 5.1) == []
    assert r.feed(Tick(), 0.1) == [StopDaemon()]
    r.feed(DaemonStopped())
    assert r.m.state is S.STOPPED


def test_stop_during_an_incident_aborts_it():
    r = Run().running(1, policy="hook", hook="h")
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    acts = r.feed(StopRequested())
    assert KillHook("c1") in acts and StopDaemon() in acts
    assert r.m.incident is None and r.m.history[-1]["outcome"] == "aborted"


def test_resume_after_a_kill_during_stop():
    r = Run().running(0)
    r.feed(StopRequested())
    snap = r.m.snapshot()
    r2 = Run()
    r2.m = Machine.from_snapshot(snap)
    assert r2.resume() == [StopDaemon()]


# -- resuming ---------------------------------------------------------------------------------------------

def test_resume_mid_recovery_adopts_by_token():
    r = Run().running(2, policy=None)
    r.m.clients["c2"].policy, r.m.clients["c2"].hook = "hook", "h"
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    # Killed here: c1's spawn and c2's hook were under way.
    r2 = Run()
    r2.m = Machine.from_snapshot(r.m.snapshot())
    acts = r2.resume()
    assert acts == [SpawnClient("c1", "GPU-test:c1:2", adopt=True),
                    RunHook("c2", "GPU-test:c2:hook:1:1", adopt=True)]
    assert r2.last("supervisor-resumed")["in_flight"] == [{"client": "c1", "recovery": "in-progress"},
                                                           {"client": "c2", "recovery": "in-progress"}]
    r2.feed(ClientStarted("c1", 3001, adopted=True))
    r2.feed(HookFinished("c2", None, "gpuos was killed while the hook ran"))
    h = r2.m.history[-1]
    assert {v["client"]: v["recovery"] for v in h["victims"]} == {"c1": "restarted", "c2": "hook-unknown"}
    assert h["outcome"] == "partial"
    assert "found running after a gpuos restart" in h["victims"][0]["detail"]


# -- policy standby ----------------------------------------------------------------------------

def standby_token(cid: str, n: int = 1) -> str:
    return f"GPU-test:{cid}:standby:{n}"


def with_standbys(n: int = 2) -> Run:
    """n clients of policy standby, each with its standby waiting (pid 4000 + i)."""
    r = Run()
    assert r.start() == [StartDaemon()]
    r.feed(DaemonUp(DAEMON))
    for i in range(1, n + 1):
        r.client(f"c{i}", policy="standby")
        # the standby is started once the client runs, not before
        assert r.feed(ClientStarted(f"c{i}", 2000 + i, 77)) == [SpawnStandby(f"c{i}", standby_token(f"c{i}"))]
        assert r.feed(StandbyStarted(f"c{i}", standby_token(f"c{i}"), 4000 + i, 88)) == []
    r.feed(ServerSeen(SERVER))
    assert [r.m.clients[f"c{i}"].standby_pid for i in range(1, n + 1)] == [4000 + i for i in range(1, n + 1)]
    return r


def test_standby_takes_the_victims_place_and_a_new_one_is_started():
    r = with_standbys(2)
    assert r.fault(pid=2002) == []  # the standbys are kept through the incident
    acts = r.drained()
    assert not of(acts, StopStandby)
    acts = r.feed(ServerRestarted(True, SERVER, DAEMON))
    assert acts == [ReleaseStandby("c1", standby_token("c1"), 4001, 88),
                    ReleaseStandby("c2", standby_token("c2"), 4002, 88)]
    assert r.m.clients["c1"].state == "starting"
    assert r.feed(ClientStarted("c1", 4001, 88)) == []  # no new standby while recovering
    acts = r.feed(ClientStarted("c2", 4002, 88))
    assert r.m.state is S.RUNNING
    assert acts == [SpawnStandby("c1", standby_token("c1", 2)), SpawnStandby("c2", standby_token("c2", 2))]
    h = r.m.history[-1]
    assert [v["recovery"] for v in h["victims"]] == ["took-over", "took-over"]
    assert h["outcome"] == "recovered"
    c1 = r.m.clients["c1"]
    assert (c1.pid, c1.restarts, c1.standby_pid, c1.standby_token) == (4001, 1, None, standby_token("c1", 2))
    assert [e["pid"] for e in r.events if e["event"] == "victim-took-over"] == [4001, 4002]


def test_without_a_waiting_standby_the_victim_is_restarted():
    r = Run().running(1, policy="standby")  # its standby's start is under way (no pid yet)
    assert r.m.clients["c1"].standby_token == standby_token("c1") and r.m.clients["c1"].standby_pid is None
    r.fault()
    r.drained()
    acts = r.feed(ServerRestarted(True, SERVER))
    assert acts == [SpawnClient("c1", "GPU-test:c1:2")]
    assert r.last("victim-restarting")["why"] == "no standby was ready: restarted"
    # the standby that was being started is kept for the next time
    assert r.feed(StandbyStarted("c1", standby_token("c1"), 4001)) == []
    r.feed(ClientStarted("c1", 3001))
    assert r.m.history[-1]["victims"][0]["recovery"] == "restarted"
    assert r.m.clients["c1"].standby_pid == 4001


def test_a_standby_gone_when_released_falls_back_to_a_restart():
    r = with_standbys(1)
    r.fault()
    r.drained()
    assert of(r.feed(ServerRestarted(True, SERVER)), ReleaseStandby)
    acts = r.feed(StandbyExited("c1", 4001, None))  # the runtime found it dead
    assert acts == [SpawnClient("c1", "GPU-test:c1:2")]
    r.feed(ClientStarted("c1", 3001))
    v = r.m.history[-1]["victims"][0]
    assert (v["recovery"], v["detail"]) == ("restarted", "new pid 3001")
    assert "its standby had ended: restarted" in r.last("victim-restarting")["why"]


def test_standbys_that_end_unused_are_replaced_a_few_times_only():
    r = with_standbys(1)
    for n in range(1, 4):
        acts = r.feed(StandbyExited("c1", 4000 + n, 1))
        c = r.m.clients["c1"]
        assert c.standby_losses == n
        if n < 3:
            assert acts == [SpawnStandby("c1", standby_token("c1", n + 1))]
            r.feed(StandbyStarted("c1", standby_token("c1", n + 1), 4001 + n))
        else:
            assert acts == []
    assert r.last("standby-exited")["losses"] == 3
    r2 = with_standbys(1)
    assert r2.feed(StandbySpawnFailed("c1", "stale", "boom")) == []  # not its standby now
    assert r2.m.clients["c1"].standby_losses == 0
    assert r2.feed(StandbyExited("c1", 4001, 1)) == [SpawnStandby("c1", standby_token("c1", 2))]
    assert r2.feed(StandbySpawnFailed("c1", standby_token("c1", 2), "boom")) == [
        SpawnStandby("c1", standby_token("c1", 3))]
    assert r2.feed(StandbySpawnFailed("c1", standby_token("c1", 3), "boom")) == []
    assert r2.last("standby-spawn-failed")["losses"] == 3
    # a take-over resets the count: losses are counted in a row
    r3 = with_standbys(1)
    r3.feed(StandbyExited("c1", 4001, 1))
    r3.feed(StandbyStarted("c1", standby_token("c1", 2), 4002))
    r3.fault()
    r3.drained()
    r3.feed(ServerRestarted(True, SERVER))
    r3.feed(ClientStarted("c1", 4002))
    assert r3.m.clients["c1"].standby_losses == 0


def test_standbys_are_stopped_with_their_client_policy_or_supervisor():
    r = with_standbys(3)
    acts = r.feed(ClientExited("c1", 0, 2001))
    assert acts == [StopStandby("c1", standby_token("c1"), 4001, 88)]
    assert r.last("standby-stopped")["why"] == "client exited"
    acts = r.feed(PolicySet("c2", "restart"))
    assert acts == [StopStandby("c2", standby_token("c2"), 4002, 88)]
    assert r.feed(StandbyExited("c2", 4002, -9)) == []  # stopped by us: not a loss
    assert r.m.clients["c2"].standby_losses == 0
    acts = r.feed(StopRequested())
    assert StopStandby("c3", standby_token("c3"), 4003, 88) in acts
    assert all(c.standby_token is None for c in r.m.clients.values())
    # a client that failed keeps its standby for the recent window: the failure may be the
    # first sign of a fault, whose report comes after
    r3 = with_standbys(2)
    assert r3.feed(ClientExited("c1", 1, 2001)) == [ProbeServer(SERVER)]
    assert r3.feed(Tick(), 5) == []
    r3.fault(pid=2002)
    r3.feed(ClientExited("c2", 1, 2002))
    acts = r3.feed(ServerRestarted(True, SERVER))
    assert of(acts, ReleaseStandby) == [ReleaseStandby("c1", standby_token("c1"), 4001, 88),
                                        ReleaseStandby("c2", standby_token("c2"), 4002, 88)]
    r4 = with_standbys(1)
    r4.feed(ClientExited("c1", 1, 2001))
    assert r4.feed(Tick(), 11) == [StopStandby("c1", standby_token("c1"), 4001, 88)]
    # a standby that was still starting when its client ended is stopped once it says so
    r2 = Run().running(1, policy="standby")
    r2.feed(ClientExited("c1", 0, 2001))
    assert r2.feed(StandbyStarted("c1", standby_token("c1"), 4001, 9)) == [
        StopStandby("c1", standby_token("c1"), 4001, 9)]


def test_a_faulter_given_up_loses_its_standby_and_its_co_runners_keep_theirs():
    r = with_standbys(2)
    r.m.settings.max_faults = 1
    r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": 2002, "source": TRACKER_SOURCE}, True))
    r.drained()
    acts = r.feed(ServerRestarted(True, SERVER))
    assert ReleaseStandby("c1", standby_token("c1"), 4001, 88) in acts
    assert StopStandby("c2", standby_token("c2"), 4002, 88) in acts
    r.feed(ClientStarted("c1", 4001, 88))
    assert {v["client"]: v["recovery"] for v in r.m.history[-1]["victims"]} == {"c1": "took-over",
                                                                                "c2": "gave-up"}


def test_resume_finds_standbys_being_started_or_released():
    r = with_standbys(2)
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 4001, 88))
    # Killed here: c2's release was under way; and a standby start of c1 (made up) too.
    r.m.clients["c1"].standby_token = standby_token("c1", 2)
    r2 = Run()
    r2.m = Machine.from_snapshot(r.m.snapshot())
    acts = r2.resume()
    assert acts == [ReleaseStandby("c2", standby_token("c2"), 4002, 88),
                    SpawnStandby("c1", standby_token("c1", 2), adopt=True)]
    r2.feed(ClientStarted("c2", 4002, 88))
    assert r2.m.history[-1]["victims"][1]["recovery"] == "took-over"


def test_resume_in_each_state():
    # RUNNING with a client whose start was not confirmed: adopt it by its token.
    r = Run().running(1)
    r.client("c2")
    r2 = Run()
    r2.m = Machine.from_snapshot(r.m.snapshot())
    assert r2.resume() == [SpawnClient("c2", "GPU-test:c2:1", adopt=True)]
    # STARTING: start (or adopt) the daemon.
    r = Run()
    r.start()
    assert Run.resume(_clone(r)) == [StartDaemon()]
    # DRAINING: deadlines go on.
    r = Run().running(1)
    r.fault()
    c = _clone(r)
    assert c.resume() == [] and c.m.state is S.DRAINING
    # FAILED at start: start again.  STOPPED: start again, forgetting stopped clients.
    r = Run()
    r.start()
    r.feed(DaemonFailed("x"))
    c = _clone(r)
    assert c.resume() == [StartDaemon()] and c.m.state is S.STARTING and c.m.failure is None
    r = Run().running(1)
    r.feed(StopRequested())
    r.feed(ClientExited("c1", 0, 2001))
    r.feed(DaemonStopped())
    c = _clone(r)
    assert c.resume() == [StartDaemon()] and c.m.clients == {} and c.m.history == r.m.history


# -- a spare server: warm standbys, released at once ---------------------------------------------

SPARE_DAEMON, SPARE_SERVER = 200, 666


def with_spare(n: int = 2, policies: tuple = ()) -> Run:
    """Clients running on slot 0, each of policy standby (or policies[i]) with a warm standby on
    the spare (slot 1)."""
    r = Run(Settings(drain_grace=10, kill_grace=5, restart_attempts=3, backoff_initial=1,
                     backoff_max=4, max_restarts=2, recent_window=10, spare_server=True))
    assert r.start() == [StartDaemon(0)]
    # the active daemon first; then the spare's
    assert r.feed(DaemonUp(DAEMON, slot=0)) == [StartDaemon(1)]
    assert r.m.spare == "starting"
    for i in range(1, n + 1):
        policy = policies[i - 1] if i <= len(policies) else "standby"
        # a client whose standbys are warm leaves its launched kernels for them
        assert r.client(f"c{i}", policy=policy) == [SpawnClient(f"c{i}", f"GPU-test:c{i}:1", slot=0,
                                                                note_kernels=policy == "standby")]
        # before the spare is up a standby would be cold: on the active server, at cuInit
        acts = r.feed(ClientStarted(f"c{i}", 2000 + i, 77))
        if policy == "standby":
            assert acts == [SpawnStandby(f"c{i}", standby_token(f"c{i}"), slot=0, warm=False)]
            r.feed(StandbyStarted(f"c{i}", standby_token(f"c{i}"), 3000 + i, 66))
    acts = r.feed(DaemonUp(SPARE_DAEMON, slot=1))
    # the spare is up: cold standbys are replaced by warm ones on it
    cold = [c for c in r.m.clients.values() if c.standby_token and not c.standby_warm]
    assert not cold and r.m.spare == "ready" and r.m.spare_daemon_pid == SPARE_DAEMON
    assert of(acts, StopStandby) == [StopStandby(f"c{i}", standby_token(f"c{i}"), 3000 + i, 66)
                                     for i in range(1, n + 1) if r.m.clients[f"c{i}"].policy == "standby"]
    assert of(acts, SpawnStandby) == [SpawnStandby(f"c{i}", standby_token(f"c{i}", 2), slot=1, warm=True)
                                      for i in range(1, n + 1) if r.m.clients[f"c{i}"].policy == "standby"]
    for a in of(acts, SpawnStandby):
        r.feed(StandbyStarted(a.client_id, a.token, 4000 + int(a.client_id[1:]), 88))
    r.feed(ServerSeen(SERVER))
    # the spare's server lists the standbys as its clients: they are not unmanaged
    r.feed(UnmanagedClients(tuple(c.standby_pid for c in r.m.clients.values() if c.standby_pid)))
    assert r.m.unmanaged == []
    return r


def test_spare_server_swaps_at_the_fault_and_releases_warm_standbys_once_the_victims_are_gone():
    r = with_spare(2)
    acts = r.fault(pid=2002)
    # at once: the servers swap; nothing is released while the faulted server's clients
    # live (it holds the GPU until they are gone)
    assert acts == []
    assert (r.m.slot, r.m.daemon_pid, r.m.spare, r.m.state) == (1, SPARE_DAEMON, "restarting", S.DRAINING)
    assert r.last("servers-swapped")["faulted_server_pid"] == SERVER
    assert r.feed(ClientExited("c1", 3, 2001)) == []
    acts = r.feed(ClientExited("c2", 3, 2002))
    # drained: the warm standbys are released on the new active server, and the faulted
    # daemon (slot 0) is restarted, to be the spare
    assert acts == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88),
                    ReleaseStandby("c2", standby_token("c2", 2), 4002, 88),
                    RestartServer(1000, SERVER, 0)]
    assert r.feed(ClientStarted("c1", 4001, 88)) == []
    assert r.feed(ClientStarted("c2", 4002, 88)) == []
    assert [v.recovery for v in r.m.incident.victims] == ["took-over", "took-over"]
    acts = r.feed(ServerRestarted(True, 777, DAEMON, slot=0))
    assert r.m.state is S.RUNNING and r.m.spare == "ready" and r.m.spare_server_pid == 777
    # new warm standbys, on slot 0 now
    assert acts == [SpawnStandby("c1", standby_token("c1", 3), slot=0, warm=True),
                    SpawnStandby("c2", standby_token("c2", 3), slot=0, warm=True)]
    h = r.m.history[-1]
    assert h["outcome"] == "recovered" and [v["recovery"] for v in h["victims"]] == ["took-over"] * 2


def test_spare_server_releases_standbys_once_every_victim_is_exiting_and_restarts_when_gone():
    """A victim whose every thread is exiting runs no code of its own again: its standby is
    released then, not when the driver has torn its context down (its reap); the faulted
    server is restarted only once they are gone."""
    r = with_spare(2)
    assert r.m.leaving_victims() == []
    r.fault(pid=2002)
    assert r.m.leaving_victims() == [("c1", 2001), ("c2", 2002)]
    assert r.feed(ClientExiting("c1", 2001)) == []
    assert r.last("victim-exiting")["pid"] == 2001 and r.m.leaving_victims() == [("c2", 2002)]
    assert r.feed(ClientExiting("c2", 9999)) == []  # not the victim's process: ignored
    acts = r.feed(ClientExiting("c2", 2002))
    assert acts == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88),
                    ReleaseStandby("c2", standby_token("c2", 2), 4002, 88)]
    assert r.m.state is S.DRAINING and r.m.leaving_victims() == []
    assert r.feed(ClientExiting("c2", 2002)) == []  # said twice: nothing more
    r.feed(ClientStarted("c1", 4001, 88))
    assert r.feed(ClientExited("c1", 3, 2001)) == []
    # the old processes' exits, after the take-over: the drain ends, the faulted server
    # is restarted to be the spare, the taken-over clients run on
    assert r.feed(ClientExited("c2", 3, 2002)) == [RestartServer(1000, SERVER, 0)]
    r.feed(ClientStarted("c2", 4002, 88))
    assert [r.m.clients[c].pid for c in ("c1", "c2")] == [4001, 4002]
    r.feed(ServerRestarted(True, 777, DAEMON, slot=0))
    assert r.m.state is S.RUNNING
    assert [v["recovery"] for v in r.m.history[-1]["victims"]] == ["took-over"] * 2
    # without a spare nothing is released before the server is back: exiting is not asked
    r = Run().running(2)
    r.fault(pid=2001)
    assert r.m.leaving_victims() == []


def test_end_faulted_server_kills_the_faulted_server_at_the_incident_and_changes_nothing_else():
    r = with_spare(2)
    r.m.settings.end_faulted_server = True
    # the faulted server (slot 0's) is killed as the incident opens; the swap is as without it
    assert r.fault(pid=2002) == [EndServer(SERVER, 0)]
    assert r.last("server-ended")["server_pid"] == SERVER
    assert (r.m.slot, r.m.state) == (1, S.DRAINING)
    r.feed(ClientExited("c1", 3, 2001))
    acts = r.feed(ClientExited("c2", 3, 2002))
    assert of(acts, ReleaseStandby) and of(acts, RestartServer) == [RestartServer(1000, SERVER, 0)]
    # without a spare, and once per incident: a second fault during the drain kills nothing
    r = Run(Settings(end_faulted_server=True)).running(2)
    assert r.fault(pid=2001) == [EndServer(SERVER, None)]
    assert of(r.fault(pid=2002), EndServer) == []
    # off (the default): nothing is killed
    assert of(Run().running(2).fault(pid=2001), EndServer) == []


def test_hold_victims_stops_them_releases_standbys_at_once_and_kills_them_later():
    r = with_spare(2)
    r.m.settings.hold_victims = 0.5
    # both victims stopped as the incident opens, and their standbys released in the same
    # turn: a stopped victim runs none of its code again
    acts = r.fault(pid=2002)
    assert of(acts, SignalClient) == [SignalClient("c1", 2001, "SIGSTOP", 77),
                                      SignalClient("c2", 2002, "SIGSTOP", 77)]
    assert of(acts, ReleaseStandby) == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88),
                                        ReleaseStandby("c2", standby_token("c2", 2), 4002, 88)]
    assert r.last("victims-held")["pids"] == [2001, 2002] and r.m.leaving_victims() == []
    assert r.m.state is S.DRAINING and r.m.held_victims_deadline() == r.m.incident.hold_until
    assert r.m.incident.hold_until is not None
    r.feed(ClientStarted("c1", 4001, 88))
    r.feed(ClientStarted("c2", 4002, 88))
    # held for the whole hold, then killed (not before: the drain's own SIGTERM is 10 s off)
    assert r.feed(Tick(), 0.3) == []
    assert r.feed(Tick(), 0.2) == [SignalClient("c1", 2001, "SIGKILL", 77),
                                   SignalClient("c2", 2002, "SIGKILL", 77)]
    assert r.feed(Tick(), 1) == []  # once
    assert r.feed(ClientExited("c1", -9, 2001)) == []
    assert r.feed(ClientExited("c2", -9, 2002)) == [RestartServer(1000, SERVER, 0)]
    assert [r.m.clients[c].pid for c in ("c1", "c2")] == [4001, 4002]
    r.feed(ServerRestarted(True, 777, DAEMON, slot=0))
    assert r.m.state is S.RUNNING
    assert [v["recovery"] for v in r.m.history[-1]["victims"]] == ["took-over"] * 2
    # a victim already gone is not signalled, nor held; the other is
    r = with_spare(2)
    r.m.settings.hold_victims = 0.5
    r.feed(ClientExited("c1", 3, 2001))
    acts = r.fault(pid=2002)
    assert of(acts, SignalClient) == [SignalClient("c2", 2002, "SIGSTOP", 77)]
    # without a spare server (no swap) victims are never held; nor with the setting off
    r = Run(Settings(hold_victims=0.5)).running(2)
    assert of(r.fault(pid=2001), SignalClient) == []
    assert of(with_spare(2).fault(pid=2001), SignalClient) == []


def test_hold_victims_holds_only_those_a_standby_takes_over_and_never_the_named_faulter():
    """Holding is for a standby's first work; a held process that faulted kept the others
    from working (H200: standbys back only when the held faulter was killed)."""
    r = with_spare(3, policies=("standby", "none", "standby"))
    r.m.settings.hold_victims = 0.5
    acts = r.feed(tracker_fault(2003))  # c3 faulted, named by its tracker
    assert of(acts, SignalClient) == [SignalClient("c1", 2001, "SIGSTOP", 77)]
    assert of(acts, ReleaseStandby) == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88)]
    assert r.last("victims-held")["pids"] == [2001]
    # the faulter's standby goes once the others are gone or going (not beside them)
    assert r.feed(ClientExited("c2", 1, 2002)) == []
    acts = r.feed(ClientExited("c3", 1, 2003))
    assert of(acts, ReleaseStandby) == [ReleaseStandby("c3", standby_token("c3", 2), 4003, 88)]
    # only the held one is killed at the hold's end
    r.feed(ClientStarted("c1", 4001, 88))
    assert r.feed(Tick(), 0.5) == [SignalClient("c1", 2001, "SIGKILL", 77)]


def test_a_victim_decided_before_it_has_gone_is_still_waited_for_until_it_exits():
    """A swapped incident decides a victim's recovery once it begins to exit: one not
    recovered (policy none) exits after that, and the drain must see it (H200: it was
    ignored as a stale pid, and the drain gave up only 20 s later)."""
    r = with_spare(2, policies=("standby", "none"))
    r.m.settings.hold_victims = 0.5
    r.feed(tracker_fault(2002))
    assert r.feed(ClientExiting("c2", 2002)) == []
    assert r.last("victim-not-recovered")["client"] == "c2"
    r.feed(ClientExited("c2", 1, 2002))
    assert r.last("victim-exited")["client"] == "c2"
    r.feed(ClientStarted("c1", 4001, 88))
    r.feed(Tick(), 0.5)
    assert r.feed(ClientExited("c1", -9, 2001)) == [RestartServer(1000, SERVER, 0)]


def test_a_standbys_own_fault_drains_nothing_on_the_active_server():
    """Trackers follow standbys too (their environment names a slot's pipe): a warm
    standby is the spare server's client, and its fault is not the active server's."""
    r = with_spare(2)
    acts = r.feed(Fault({**tracker_fault(4001).event}, True))
    assert r.m.state is S.RUNNING and r.m.incident is None and not of(acts, SignalClient)
    assert r.last("fault-in-standby")["client"] == "c1"
    # a standby's child, named by its session, the same
    r.feed(Fault({**tracker_fault(9100).event, "client_pid": 4002}, True))
    assert r.m.incident is None and r.last("fault-in-standby")["client"] == "c2"


def test_spare_server_victims_without_standby_start_on_the_new_server():
    r = with_spare(2, policies=("restart", "standby"))
    assert r.fault(pid=2001) == []
    assert r.feed(ClientExited("c1", 1, 2001)) == []
    # c2's old process does not exit: the drain's SIGTERM and SIGKILL reach it, not its standby
    assert r.feed(Tick(), 10) == [SignalClient("c2", 2002, "SIGTERM", 77)]
    assert r.feed(Tick(), 5) == [SignalClient("c2", 2002, "SIGKILL", 77)]
    acts = r.feed(ClientExited("c2", -9, 2002))
    assert acts == [SpawnClient("c1", "GPU-test:c1:2", slot=1),  # on the new active server
                    ReleaseStandby("c2", standby_token("c2", 2), 4002, 88),
                    RestartServer(1000, SERVER, 0)]
    r.feed(ClientStarted("c1", 5001, 99))
    r.feed(ClientStarted("c2", 4002, 88))
    assert r.m.clients["c2"].pid == 4002 and r.m.clients["c2"].state == "running"
    # the taken-over client's exit is its own, not the old victim's
    r.feed(ServerRestarted(True, 777, DAEMON, slot=0))
    assert r.m.state is S.RUNNING
    r.feed(ClientExited("c2", 0, 4002))
    assert r.m.clients["c2"].state == "exited"


def test_after_a_tracker_report_the_kernel_logs_xid_naming_a_co_runner_is_an_echo():
    """Under MPS the kernel log's Xid 31 names a co-runner, 0.4-0.65 s after the tracker
    named the faulter: once the incident has closed (a spare server's can, in 0.3 s) it
    must not open a second one that kills the clients just recovered.  Without a tracker
    report, an Xid naming another process is still a fault of its own."""
    r = Run().running(2)
    r.feed(tracker_fault(r.m.clients["c1"].pid))
    assert r.m.state is S.DRAINING and r.m.incident.victims[0].role == "faulter"
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and r.m.incident is None
    acts = r.fault(pid=2002)  # the kernel log's line, naming the co-runner c2 (old pid)
    assert r.m.state is S.RUNNING and r.m.incident is None and r.last("fault")["echo"]
    assert not of(acts, SignalClient)
    # a new fault the tracker takes is one, whoever it names
    r.feed(tracker_fault(3002))
    assert r.m.state is S.DRAINING and r.m.incident.id == 2
    # and with no tracker report, an Xid naming another process than the handled one is new
    r2 = Run().running(2)
    r2.fault(pid=2001)
    r2.drained()
    r2.feed(ServerRestarted(True, SERVER))
    r2.feed(ClientStarted("c1", 3001))
    r2.feed(ClientStarted("c2", 3002))
    r2.fault(pid=3002)
    assert r2.m.incident is not None and r2.m.incident.id == 2


def test_a_long_incidents_late_xid_reports_are_echoes_after_it_closes():
    r = Run().running(2)
    r.fault(pid=2001)
    r.feed(Tick(), 9)
    r.drained()
    r.feed(ServerRestarted(True, SERVER), 3)  # closed 12 s after the fault
    r.feed(ClientStarted("c1", 3001))
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and r.m.incident is None
    # NVML's report of the same Xid, no pid, 1.5 s after the close: an echo, no incident
    acts = r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": None, "source": "nvml"}, True), 1.5)
    assert r.m.state is S.RUNNING and r.last("fault")["echo"] and not of(acts, SignalClient)


def test_an_incident_longer_than_recent_window_keeps_its_xids_handled_until_it_closes():
    """Measured on an H100: a 36 s incident saw other faults 10 s in (each prunes what
    is recent); NVML's late Xid 31 1 s after the close must still be an echo of it."""
    r = Run().running(2)
    r.fault(pid=2001)
    r.fault(pid=SERVER, xid=109, cls="channel", dt=11)  # pruned here, before the fix
    r.feed(Tick(), 20)
    r.drained()
    r.feed(ServerRestarted(True, SERVER), 3)
    r.feed(ClientStarted("c1", 3001))
    r.feed(ClientStarted("c2", 3002))
    assert r.m.state is S.RUNNING and r.m.incident is None
    acts = r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": None, "source": "nvml"}, True), 1)
    assert r.m.state is S.RUNNING and r.last("fault")["echo"] and not of(acts, SignalClient)
    # recent_window after the close, the same Xid is a new fault again
    r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": None, "source": "nvml"}, True), 11)
    assert r.m.incident is not None and r.m.incident.id == 2


def test_an_incident_has_one_faulter_the_first_a_tracker_reports():
    """Measured on an H100: after one client's fault, four victims' address spaces took
    faults of their own (its consequences); they are not faulters, nor counted as such."""
    r = Run().running(3)
    r.feed(tracker_fault(2001))
    for pid in (2002, 2003, 2002):  # ours: the supervisor's trackers follow only its processes
        r.feed(Fault({**tracker_fault(pid).event}, True), 0.1)
    roles = {v.client: v.role for v in r.m.incident.victims}
    assert roles == {"c1": "faulter", "c2": "victim", "c3": "victim"}
    assert [r.m.clients[c].faults for c in ("c1", "c2", "c3")] == [1, 0, 0]


def test_a_fault_of_a_clients_child_names_the_client():
    """The supervisor gives a fault of a process in a client's session that client's pid
    (client_pid): a shell's or launcher's child is the client's CUDA process."""
    r = Run().running(2)
    ev = {"xid": 31, "fault_class": "memory", "pid": 9001, "client_pid": 2002, "source": TRACKER_SOURCE}
    r.feed(Fault(ev, None))
    assert r.m.state is S.DRAINING
    assert {v.client: v.role for v in r.m.incident.victims} == {"c1": "victim", "c2": "faulter"}
    # and an Xid of the kernel log naming the child names the client, with no tracker
    r2 = Run().running(2)
    r2.feed(Fault({"xid": 31, "fault_class": "memory", "pid": 9001, "client_pid": 2001,
                   "source": "kmsg"}, None))
    assert {v.client: v.role for v in r2.m.incident.victims} == {"c1": "named", "c2": "victim"}


def test_spare_server_releases_without_waiting_for_unmanaged_victims_seen_gone_by_pid():
    r = with_spare(1)
    r.feed(UnmanagedClients((7777,)))  # a client gpuos did not start, on the active server
    r.fault(pid=7777)
    assert r.m.watched_unmanaged() == [7777]
    # c1 is released once it has gone, not waiting for the client gpuos did not start
    acts = r.feed(ClientExited("c1", 3, 2001))
    assert acts == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88)]
    # the new active server's list does not have it: that says nothing of the faulted one's
    assert r.feed(UnmanagedClients(())) == [] and r.m.state is S.DRAINING
    # the faulted server is restarted once that one has gone too
    assert r.feed(UnmanagedGone(7777)) == [RestartServer(1000, SERVER, 0)]


def test_spare_server_that_will_not_restart_is_lost_not_the_supervisor():
    r = with_spare(1)
    r.fault(pid=2001)
    r.feed(ClientExited("c1", 1, 2001))
    r.feed(ClientStarted("c1", 4001, 88))
    for _ in range(3):
        r.feed(ServerRestarted(False, detail="no", slot=0))
        r.feed(Tick(), 10)
    # lost, then tried again after its backoff
    assert r.m.state is S.RUNNING and r.last("spare-lost") and r.m.spare == "starting"
    assert r.m.history[-1]["outcome"] == "recovered"
    # standbys are cold from then on, on the active server (slot 1)
    c1 = r.m.clients["c1"]
    assert (c1.standby_slot, c1.standby_warm) == (1, False)
    # with no spare, the next fault is handled the stock way: drain, restart, release
    acts = r.fault(pid=4001)
    assert not of(acts, ReleaseStandby) and r.m.slot == 1


def test_spare_server_stop_takes_standbys_then_both_daemons():
    r = with_spare(1)
    acts = r.feed(StopRequested())
    assert acts == [SignalClient("c1", 2001, "SIGTERM", 77), StopStandby("c1", standby_token("c1", 2), 4001, 88)]
    acts = r.feed(ClientExited("c1", 0, 2001))
    assert acts == [StopDaemon(1), StopDaemon(0)]
    r.feed(DaemonStopped("quit", slot=1))
    assert r.m.state is S.STOPPING
    r.feed(DaemonStopped("quit", slot=0))
    assert r.m.state is S.STOPPED


def test_spare_server_exit_or_start_failure_leaves_cold_standbys():
    r = with_spare(1)
    acts = r.feed(DaemonExited(SPARE_DAEMON))
    assert r.m.spare == "lost" and r.m.state is S.RUNNING
    assert acts == [StopStandby("c1", standby_token("c1", 2), 4001, 88),
                    SpawnStandby("c1", standby_token("c1", 3), slot=0, warm=False)]
    # started again after a backoff (backoff_initial, 1 s here, then doubling): warm again
    assert r.feed(Tick(), 0.9) == []
    assert r.feed(Tick(), 0.2) == [StartDaemon(1)] and r.m.spare == "starting"
    acts = r.feed(DaemonUp(SPARE_DAEMON + 1, slot=1))
    assert r.m.spare == "ready" and r.m.spare_losses == 0
    assert acts == [StopStandby("c1", standby_token("c1", 3), None, None),
                    SpawnStandby("c1", standby_token("c1", 4), slot=1, warm=True)]
    r2 = Run(Settings(spare_server=True, backoff_initial=1, backoff_max=4))
    r2.start()
    r2.feed(DaemonUp(DAEMON, slot=0))
    r2.feed(DaemonFailed("no", slot=1))
    assert r2.m.state is S.RUNNING and r2.m.spare == "lost"
    assert r2.feed(Tick(), 1) == [StartDaemon(1)]
    r2.feed(DaemonFailed("no", slot=1))
    assert r2.feed(Tick(), 1.5) == [] and r2.feed(Tick(), 0.5) == [StartDaemon(1)]  # 2 s now


def test_spare_server_resume_adopts_the_spare_and_goes_on_with_a_swapped_incident():
    r = with_spare(1)
    c = _clone(r)
    assert c.resume() == [StartDaemon(1)]
    c.feed(DaemonUp(SPARE_DAEMON, adopted=True, slot=1))
    assert c.m.spare == "ready" and c.last("spare-adopted")
    r.fault(pid=2001)
    r.feed(ClientExited("c1", 1, 2001))  # restarting the faulted server (slot 0); c1 released
    # killed before the release was seen through: released again, with the restart
    c = _clone(r)
    assert c.resume() == [ReleaseStandby("c1", standby_token("c1", 2), 4001, 88),
                          RestartServer(1000, SERVER, 0)]
    r.feed(ClientStarted("c1", 4001, 88))
    c = _clone(r)
    assert c.resume() == [RestartServer(1000, SERVER, 0)]
    c.feed(ServerRestarted(True, 777, DAEMON, slot=0))
    assert c.m.state is S.RUNNING and c.m.spare == "ready" and c.m.slot == 1


def _clone(r: Run) -> Run:
    c = Run()
    c.m = Machine.from_snapshot(r.m.snapshot())
    c.t = r.t
    return c


# -- every state, every input ------------------------------------------------------------------------------

def _in_state(state: State | str) -> Run:
    r = Run()
    if state == "failed-in-incident":  # no server came back: an incident left open
        r.running(2)
        r.fault()
        r.drained()
        for _ in range(3):
            r.feed(ServerRestarted(False, detail="no"))
            r.feed(Tick(), 10)
        assert r.m.state is S.FAILED and r.m.incident is not None
        return r
    if state is S.STARTING:
        r.start()
        return r
    if state is S.FAILED:
        r.start()
        r.feed(DaemonFailed("x"))
        return r
    r.running(2, policy="hook", hook="h")
    if state is S.RUNNING:
        return r
    if state is S.STOPPING:
        r.feed(StopRequested())
        return r
    if state is S.STOPPED:
        r.feed(StopRequested())
        for c in list(r.m.clients.values()):
            r.feed(ClientExited(c.id, 0, c.pid))
        r.feed(DaemonStopped())
        return r
    r.fault()
    if state is S.DRAINING:
        return r
    r.drained()
    if state is S.RESTARTING:
        return r
    r.feed(ServerRestarted(True, SERVER))
    assert state is S.RECOVERING
    return r


def _inputs(m: Machine) -> list:
    cid = next(iter(m.clients), "c1")
    pid = m.clients[cid].pid if cid in m.clients else 2001
    return [
        DaemonUp(DAEMON), DaemonUp(101, adopted=True), DaemonFailed("boom"), DaemonExited(DAEMON),
        DaemonExited(4), DaemonStopped(), ServerSeen(SERVER), ServerSeen(600), ServerGone(SERVER),
        ServerStatus(SERVER, "FAULT"), ServerStatus(SERVER, "ACTIVE"), ServerRestarted(True, 600),
        ServerRestarted(False, detail="no"),
        Fault({"xid": 31, "fault_class": "memory", "pid": pid}, True),
        Fault({"xid": 4242, "fault_class": "unknown", "pid": None}, None),
        Fault({"xid": 31, "fault_class": "memory", "pid": 1}, False),
        Fault({"xid": 79, "fault_class": "device"}, True),
        Fault({}, None),
        ClientRequest(Client(id="new", cmd=["x"], cwd="/", uid=0, gid=0)),
        CheckpointSeen(cid, 1234.5), CheckpointSeen("nobody", 1.0),
        ClientStarted(cid, 3001), ClientSpawnFailed(cid, "x"), ClientExited(cid, 1, pid),
        ClientExited(cid, 0), ClientExited("nobody", 1), ClientExiting(cid, pid),
        ClientExiting("nobody", 1),
        StandbyStarted(cid, f"GPU-test:{cid}:standby:1", 4001), StandbyExited(cid, 4001, 1),
        StandbyWaiting(cid, f"GPU-test:{cid}:standby:1"), StandbyWaiting(cid, f"GPU-test:{cid}:standby:2"),
        StandbySpawnFailed(cid, f"GPU-test:{cid}:standby:1", "x"), UnmanagedClients((7777,)),
        UnmanagedGone(7777), HookFinished(cid, 0), HookFinished(cid, None),
        PolicySet(None, "none"), PolicySet(cid, "bogus"), StopRequested(), StopRequested(0), Tick(),
        object(), "garbage", None,
    ]


TERMINAL_MOVES = {S.STOPPED: {S.STOPPED}, S.FAILED: {S.FAILED, S.STOPPING}}


@pytest.mark.parametrize("state", list(S) + ["failed-in-incident"],
                         ids=lambda s: getattr(s, "value", s))
def test_every_input_in_every_state(state):
    probe = _in_state(state)
    assert probe.m.state is (S.FAILED if state == "failed-in-incident" else state)
    inputs = _inputs(probe.m)
    assert {type(i) for i in inputs if type(i) in INPUTS} == set(INPUTS)  # every kind covered
    for inp, dt in itertools.product(inputs, (0.0, 1e6)):
        r = _in_state(state)
        before = r.m.state
        r.feed(inp, dt)  # never raises; every transition is an edge (checked in Run._take)
        after = r.m.state
        if before in TERMINAL_MOVES:
            assert after in TERMINAL_MOVES[before], (inp, after)
        if type(inp) not in INPUTS:
            assert after is before and r.last("input-ignored")["why"] == "unknown input"
        # whatever happened, it can be written down and read back (Run._take), and the
        # incident's victims are never lost
        if r.m.incident and probe.m.incident and r.m.incident.id == probe.m.incident.id:
            assert {v.client for v in probe.m.incident.victims} <= {v.client for v in r.m.incident.victims}


def _in_spare_state(state: str) -> Run:
    """A spare-server machine: running, or in a swapped incident (draining, restarting the
    faulted server, recovering), or stopping."""
    r = with_spare(2, policies=("standby", "restart"))
    if state == "running":
        return r
    if state == "stopping":
        r.feed(StopRequested())
        return r
    r.fault(pid=2001)
    if state == "draining":
        return r
    r.feed(ClientExited("c1", 1, 2001))
    r.feed(ClientExited("c2", 1, 2002))
    if state == "restarting":
        return r
    r.feed(ServerRestarted(True, 777, DAEMON, slot=0))  # c2's restart still under way
    assert state == "recovering"
    return r


@pytest.mark.parametrize("state", ["running", "draining", "restarting", "recovering", "stopping"])
def test_every_input_in_every_spare_server_state(state):
    probe = _in_spare_state(state)
    assert probe.m.state.value == state
    inputs = _inputs(probe.m) + [
        DaemonUp(SPARE_DAEMON, slot=1), DaemonUp(201, adopted=True, slot=0), DaemonUp(300, slot=None),
        DaemonFailed("boom", slot=1), DaemonFailed("boom", slot=0), DaemonExited(SPARE_DAEMON),
        DaemonStopped("quit", slot=1), DaemonStopped("quit", slot=0), ServerRestarted(True, 600, slot=0),
        ServerRestarted(True, 600, slot=1), ServerRestarted(False, detail="no", slot=0),
        StandbyStarted("c1", standby_token("c1", 2), 4001, 88), StandbyExited("c1", 4001, 1),
        ClientExited("c1", 1, 2001), ClientExited("c1", 1, 4001), ClientStarted("c1", 4001, 88)]
    for inp, dt in itertools.product(inputs, (0.0, 1e6)):
        r = _in_spare_state(state)
        r.feed(inp, dt)  # never raises; every transition is an edge; persisted as is (Run._take)
        # the two slots are never the same, and the spare's state is one of its states
        assert r.m.slot in (0, 1) and r.m.spare in ("off", "starting", "ready", "restarting", "lost")
        assert r.m.spare_daemon_pid is None or r.m.spare_daemon_pid != r.m.daemon_pid, inp


def test_unknown_fault_with_failing_clients_is_an_incident():
    # The clients die first, the unknown Xid comes after: evidence enough.
    r = Run().running(2)
    r.feed(ClientExited("c1", 1, 2001), 0.1)
    r.feed(ClientExited("c2", 1, 2002), 0.1)
    r.fault(pid=2002, cls="unknown", xid=4242)
    assert r.m.incident is not None and r.m.incident.cause == "fault"
    assert [f["xid"] for f in r.m.incident.faults] == [4242]
    assert r.m.state is S.RESTARTING
    # The other way round: the unknown Xid first, then a client fails.
    r = Run().running(2)
    r.fault(pid=None, cls="unknown", xid=4242, ours=None)
    assert r.m.state is S.RUNNING
    r.feed(ClientExited("c1", 1, 2001), 0.5)
    assert r.m.incident is not None and [v.client for v in r.m.incident.victims] == ["c1", "c2"]
    # An info event is no evidence.
    r = Run().running(1)
    r.fault(cls="info", xid=154)
    acts = r.feed(ClientExited("c1", 1, 2001))
    assert r.m.state is S.RUNNING and acts == [ProbeServer(SERVER)]


def test_every_edge_is_reachable():
    seen: set = set()

    def take(r: Run) -> None:
        seen.update((S(e["previous"]), S(e["state"])) for e in r.events if e["event"] == "state")

    for state in list(S) + ["failed-in-incident"]:
        r = _in_state(state)
        take(r)
        stopper = _in_state(state)
        stopper.feed(StopRequested())
        take(stopper)
        if state in (S.FAILED, S.STOPPED, "failed-in-incident"):
            c = _clone(r)
            c.resume()
            take(c)
    r = _in_state(S.RECOVERING)
    r.fault(pid=r.m.clients["c1"].pid, xid=43, cls="channel")  # a new fault while recovering: drain again
    take(r)
    r = Run().running(1)
    r.fault()
    r.drained()
    r.feed(ServerRestarted(True, SERVER))
    r.feed(ClientStarted("c1", 3001))       # recovered
    take(r)
    assert seen == EDGES, (EDGES - seen, seen - EDGES)


def test_a_tracker_naming_a_process_gpuos_did_not_start_leaves_no_victim_named():
    """The benchmark's injector, a client gpuos did not start, found by its environment: the
    tracker's fault (attributed by the supervisor: trackers follow only processes of ours)
    opens the incident; NVML's Xid then names a co-runner, which is no faulter and is not
    "named" either, whichever comes first."""
    r = Run().running(2)
    r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": 7777, "source": TRACKER_SOURCE}, True))
    assert r.m.state is S.DRAINING
    r.fault(pid=r.m.clients["c2"].pid)  # NVML's report: an echo, naming c2
    assert {v.client: v.role for v in r.m.incident.victims} == {"c1": "victim", "c2": "victim"}
    assert [f.get("pid") for f in r.m.incident.faults] == [7777, 2002]
    # the other order: the Xid first names c1, then the tracker names the injector
    r2 = Run().running(2)
    r2.fault(pid=r2.m.clients["c1"].pid)
    assert {v.client: v.role for v in r2.m.incident.victims} == {"c1": "named", "c2": "victim"}
    r2.feed(Fault({"xid": 31, "fault_class": "memory", "pid": 7777, "source": TRACKER_SOURCE}, True))
    assert {v.client: v.role for v in r2.m.incident.victims} == {"c1": "victim", "c2": "victim"}
    assert r2.m.clients["c1"].faults == 0


def test_status_names_a_faulter_that_is_no_victim():
    """`gpuos mps status`: the incident's line says which process the tracker named when it is
    not one of the victims (a client gpuos did not start)."""
    from gpuos.cli.mps import _victims_line

    r = Run().running(2)
    r.feed(Fault({"xid": 31, "fault_class": "memory", "pid": 7777, "source": TRACKER_SOURCE}, True))
    r.fault(pid=r.m.clients["c2"].pid)
    line = _victims_line(r.m.incident.summary())
    assert line == "c1: pending; c2: pending; pid 7777 (the faulter, not started by gpuos mps run)"
    r2 = Run().running(2)
    r2.feed(tracker_fault(r2.m.clients["c1"].pid))
    assert _victims_line(r2.m.incident.summary()) == "c1 (the faulter): pending; c2: pending"


def test_clients_shows_what_a_warm_standby_did_ahead():
    """`gpuos mps clients`: a standby's cell says cold or warm, the kernels it loaded ahead,
    and once its cuBLAS warm-up is done (libgpuos blaswarm.c), how long it took."""
    from gpuos.cli.mps import _standby_cell

    row = {"standby_pid": 42, "standby_warm": False, "standby_preload": None}
    assert _standby_cell(row) == "42 (cold)"
    assert _standby_cell(dict(row, standby_warm=True)) == "42 (warm)"
    pre = {"loaded": 3, "names": 4, "cublas_warm_up": None}
    assert _standby_cell(dict(row, standby_warm=True, standby_preload=pre)) == "42 (warm, 3/4 kernels ahead)"
    pre["cublas_warm_up"] = {"calls": 32, "failed": 0, "seconds": 0.1234}
    assert _standby_cell(dict(row, standby_warm=True, standby_preload=pre)) == \
        "42 (warm, 3/4 kernels ahead, cuBLAS started in 0.12 s)"
