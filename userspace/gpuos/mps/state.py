"""The MPS supervisor's state machine: inputs in, actions out.

Pure: no processes, no clock, no files.  ``Machine.handle(input, now)`` updates the
machine and returns the actions the runtime (supervisor.py) must carry out, each
step announced by an ``Emit`` action (the events of docs/mps.md).  The runtime
persists ``Machine.snapshot()`` before it acts, so a gpuos killed at any point
resumes from the snapshot with ``Machine.resume(now)``.

    STARTING --daemon up--> RUNNING --fault / server died or faulted--> DRAINING
    DRAINING --every victim gone (or killed)--> RESTARTING
    RESTARTING --server accepts clients--> RECOVERING --every victim handled--> RUNNING
    RESTARTING --attempts exhausted--> FAILED;  STARTING --daemon failed--> FAILED
    any --stop--> STOPPING --clients and daemon gone--> STOPPED

Stock MPS takes every client of a server down when one of them faults, and the
server accepts no new client until all of them have exited; so every client of
the server is a victim, the machine waits for them to go (killing those that do
not), makes sure a server is back, then recovers each victim by its policy:
``restart`` (run its command again), ``standby`` (release the copy of its command
that waits, started in advance, at its first cuInit: libgpuos/src/standby.c),
``hook`` (run a recovery command) or ``none``.

With a spare server (``Settings.spare_server``, `gpuos mps start --spare-server`) the
supervisor runs two MPS control daemons on the GPU, in slots 0 and 1 (each its own
pipe directory): the active one serves the clients, the spare one only the standbys,
which are then warm: past cuInit, their context made, waiting at their first kernel
launch.  A fault on the active server swaps the two at once (``_swap``); as soon as
the faulted server's victims have exited, each one's warm standby is released on the
new active server (or, without one, its command started there), with no server restart
in the way.  The faulted server is then restarted and is the spare from then on; if it
will not come back, or the spare dies, standbys are cold until a spare is started again.

Standbys are kept by one rule applied after every input (``_keep_standbys``): a
running client whose policy is standby has one while the machine runs; a standby
whose client ended, changed policy, or whose supervisor stops, is stopped.

A client may name the checkpoint its application writes and resumes from at its start
(``Client.checkpoint``; the runtime reports its newest time: ``CheckpointSeen``).  Each
victim's record then says how much work the fault cost it (``Victim.lost_s``): the time
since the state its replacement resumes from, the newest checkpoint before the fault for
a restart, the one there was when its standby started for a take-over; and a standby
older than a newer checkpoint is replaced by one that starts from it (``_keep_standbys``).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..faults.uvm_tools import SOURCE as TRACKER_SOURCE  # faults whose pid is the faulter's, for certain


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    RESTARTING = "restarting"
    RECOVERING = "recovering"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


INCIDENT_STATES = frozenset({State.DRAINING, State.RESTARTING, State.RECOVERING})
POLICIES = ("restart", "standby", "hook", "none")
# Fault classes (faults/model.py FaultClass values) that take an MPS server's clients down.
ACTIONABLE = frozenset({"memory", "sm", "copy", "channel", "device"})
# Victim recovery outcomes; "pending" and "in-progress" are not outcomes yet.
RECOVERY_OK = frozenset({"restarted", "took-over", "hook-ok", "not-recovered", "unmanaged"})
RECOVERY_DONE = RECOVERY_OK | {"hook-failed", "hook-unknown", "gave-up", "failed"}
HISTORY_KEPT = 50
# A client's standbys that ended before they were needed, in a row, after which it gets
# no more (a command that never calls cuInit would otherwise be run again and again).
STANDBY_LOSSES = 3
# A standby is replaced to start from a newer checkpoint once that checkpoint has not
# changed for CHECKPOINT_SETTLE_S (one written in parts is not read half-written), or at
# once where checkpoints come more often than that (waiting would never end: they are
# small, or written aside and renamed), and not before the standby is
# Settings.standby_refresh old.  Make before break: the replacement is started beside it,
# and the old one stopped only once the replacement waits (StandbyWaiting), so a fault
# meanwhile still finds a standby to take over.
CHECKPOINT_SETTLE_S = 2.0


def fault_pid(fault: dict) -> int | None:
    """The process a fault event names, as the machine knows processes: the client (or
    standby) whose session the faulting process runs in (the supervisor's `client_pid`: a
    client's child, a shell's or a launcher's worker), else the faulting process itself."""
    return fault.get("client_pid") or fault.get("pid")


@dataclass
class Settings:
    """The supervisor's knobs (`gpuos mps start` options); persisted with the state."""

    drain_grace: float = 10.0       # s victims get to exit on their own after a fault
    kill_grace: float = 5.0         # s from SIGTERM to SIGKILL, and from SIGKILL to giving up
    restart_attempts: int = 8       # tries to get a server that accepts clients
    backoff_initial: float = 0.5    # s before the 2nd try; doubles each time
    backoff_max: float = 30.0
    max_restarts: int = 3           # fault restarts of one client, over its lifetime
    max_faults: int = 2             # faults a client may cause (named by UVM's fault tracker)
                                    # before it is no longer restarted
    hook_timeout: float = 300.0     # s a recovery hook may run
    recent_window: float = 10.0     # s: a client that failed this long before a fault is a victim
    stop_grace: float = 10.0        # s clients get to exit at `gpuos mps stop`
    default_policy: str = "restart"
    default_hook: str | None = None
    spare_server: bool = False      # a second control daemon hosts warm standbys (module doc)
    end_faulted_server: bool = False  # SIGKILL the faulted MPS server when the incident opens
                                    # (Machine._end_faulted_server), not waiting for its clients
    hold_victims: float = 0.0       # s a swapped incident's victims are held stopped before
                                    # SIGKILL (Machine._hold_victims); 0: not held
    # s a standby lives at least before it is replaced to start from its client's newer
    # checkpoint: a replacement is a whole start-up of the application (5-10 s for PyTorch),
    # a time with no warm standby, so a client that checkpoints often would otherwise
    # never have one ready.
    standby_refresh: float = 30.0
    # warm standbys map their clients' start-up memory instead of a copy (sharemem.c)
    share_standby_memory: bool = False

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_max, self.backoff_initial * 2 ** max(0, attempt - 1))

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Client:
    """A client started through `gpuos mps run`: what it takes to run it again."""

    id: str
    cmd: list[str]
    cwd: str
    uid: int
    gid: int
    policy: str | None = None       # None: the supervisor's default policy
    hook: str | None = None
    max_restarts: int | None = None
    max_faults: int | None = None   # None: the supervisor's
    output: str | None = None       # file for its stdout and stderr
    # The checkpoint its application writes and resumes from at its start (a file, a
    # directory or a glob: the newest match counts), and that newest one's time.
    checkpoint: str | None = None
    checkpoint_at: float | None = None
    checkpoint_gap: float | None = None  # between the last two newest times seen
    pid: int | None = None
    starttime: int | None = None    # /proc starttime: (pid, starttime) names one process
    # pending | starting | running | exited | failed | victim | hooked | not-recovered
    # | gave-up | stopped | cancelled
    state: str = "pending"
    restarts: int = 0               # times restarted after a fault
    faults: int = 0                 # faults it caused (named by UVM's fault tracker)
    spawns: int = 0                 # times started, for spawn tokens
    spawn_token: str | None = None  # in the environment of the last spawn: finds it after a crash
    exit_status: int | None = None  # returncode, -N for signal N, None if unknown
    exited_at: float | None = None
    started_at: float | None = None
    # Its standby (policy standby): a copy of the command waiting at its first cuInit.
    standby_token: str | None = None     # set before it is started: finds it after a crash
    standby_pid: int | None = None
    standby_starttime: int | None = None
    standby_spawns: int = 0
    standby_losses: int = 0              # standbys in a row that ended unused
    standby_slot: int | None = None      # the slot whose pipe directory it was given
    standby_warm: bool = False           # waits at its first launch, a spare server's client
    standby_spawned_at: float | None = None
    standby_state_at: float | None = None  # the checkpoint it resumed from (None: its start)
    # Its replacement from a newer checkpoint, while it starts (same slot and warmth): it
    # becomes the standby once it waits, and is stopped if anything else comes first.
    next_standby_token: str | None = None
    next_standby_pid: int | None = None
    next_standby_starttime: int | None = None
    next_standby_state_at: float | None = None


def _forget_next_standby(c: Client) -> None:
    c.next_standby_token = c.next_standby_pid = c.next_standby_starttime = c.next_standby_state_at = None


@dataclass
class Victim:
    client: str | None              # a managed client's id; None: a client gpuos did not start
    pid: int | None
    role: str = "victim"            # "named" when a fault event names its pid (under MPS
                                    # that need not be the faulter: docs/mps.md); "faulter"
                                    # when UVM's fault tracker on its VA space took the fault
    exited: bool = False
    exiting: bool = False           # every thread has begun to exit (ClientExiting)
    held: bool = False              # stopped (SIGSTOP) by _hold_victims, to be killed later
    exit_status: int | None = None
    signalled: str | None = None    # what gpuos sent to make it go
    # pending | in-progress | restarted | hook-ok | hook-failed | hook-unknown | not-recovered
    # | gave-up | failed | unmanaged
    recovery: str = "pending"
    detail: str = ""
    token: str | None = None        # spawn/hook token while in progress
    hook_deadline: float | None = None
    # The run the fault ended: seconds from the victim's start (by gpuos) to the incident.
    # A restarted or taken-over victim starts from its beginning again: that much work is
    # lost unless the application saves its own progress (a hook may resume from it).
    ran_s: float | None = None
    starttime: int | None = None    # the victim process's: signals reach no other process
    started_at: float | None = None     # when the run the fault ended began
    checkpoint_at: float | None = None  # its newest checkpoint when the incident opened
    # The work the fault cost it: seconds from the state its replacement resumes from
    # (resumes_from: "checkpoint", or "start": the victim's own start) to the incident.
    lost_s: float | None = None
    resumes_from: str | None = None


@dataclass
class Incident:
    id: int
    opened: float
    cause: str                      # fault | server-exit | server-fault | daemon-exit
    server_pid: int | None
    faults: list[dict] = field(default_factory=list)
    victims: list[Victim] = field(default_factory=list)
    needs_reset: bool = False       # a DEVICE-class fault: the GPU may need a reset
    rounds: int = 1                 # a fault during recovery drains again
    drain_stage: int = 0            # 0 waiting, 1 SIGTERM sent, 2 SIGKILL sent, 3 gave up
    stage_deadline: float | None = None
    restart_attempts: int = 0
    next_attempt_at: float | None = None
    restart_detail: str = ""
    server_ready_at: float | None = None
    closed: float | None = None
    outcome: str | None = None      # recovered | partial | aborted
    slot: int | None = None         # the faulted server's slot (None: no spare server)
    swapped: bool = False           # the spare took over at once (Machine._swap)
    hold_until: float | None = None  # held victims are killed then (Machine._hold_victims)

    def victim_of(self, client_id: str) -> Victim | None:
        return next((v for v in self.victims if v.client == client_id), None)

    def summary(self) -> dict:
        return {"id": self.id, "opened": self.opened, "closed": self.closed, "cause": self.cause,
                "outcome": self.outcome, "rounds": self.rounds, "needs_reset": self.needs_reset,
                "faults": [{k: f.get(k) for k in ("xid", "fault_class", "pid", "source")}
                           for f in self.faults],
                "victims": [{"client": v.client, "pid": v.pid, "role": v.role,
                             "exit_status": v.exit_status, "signalled": v.signalled,
                             "recovery": v.recovery, "detail": v.detail, "ran_s": v.ran_s,
                             "lost_s": v.lost_s, "resumes_from": v.resumes_from}
                            for v in self.victims]}


# -- inputs ------------------------------------------------------------------------

@dataclass(frozen=True)
class DaemonUp:
    pid: int
    adopted: bool = False           # it was running already (a resumed supervisor)
    slot: int | None = None         # with a spare server: which daemon (0, 1)


@dataclass(frozen=True)
class DaemonFailed:
    reason: str
    slot: int | None = None


@dataclass(frozen=True)
class DaemonExited:
    pid: int


@dataclass(frozen=True)
class DaemonStopped:
    detail: str = ""
    slot: int | None = None


@dataclass(frozen=True)
class ServerSeen:
    pid: int


@dataclass(frozen=True)
class ServerGone:
    pid: int


@dataclass(frozen=True)
class ServerStatus:
    pid: int
    status: str                     # get_server_status's answer (ACTIVE, FAULT, ...)


@dataclass(frozen=True)
class ServerRestarted:
    ok: bool
    server_pid: int | None = None
    daemon_pid: int | None = None
    detail: str = ""
    slot: int | None = None


@dataclass(frozen=True)
class Fault:
    event: dict                     # a FaultEvent as a dict (fault_class as its value)
    ours: bool | None = None        # names our GPU: True, another: False, none: None


@dataclass(frozen=True)
class ClientRequest:
    client: Client


@dataclass(frozen=True)
class CheckpointSeen:
    """The newest file of a client's checkpoint (Client.checkpoint) is from `at`."""

    client_id: str
    at: float


@dataclass(frozen=True)
class ClientStarted:
    client_id: str
    pid: int
    starttime: int | None = None
    adopted: bool = False           # found running by its token after a gpuos restart


@dataclass(frozen=True)
class ClientSpawnFailed:
    client_id: str
    reason: str


@dataclass(frozen=True)
class ClientExited:
    client_id: str
    status: int | None              # returncode (-N: signal N); None: unknown
    pid: int | None = None          # the process that exited; a stale one is ignored


@dataclass(frozen=True)
class ClientExiting:
    """Every thread of a victim's process has begun to exit (procs.ending): none of its
    code runs again, while the driver may still be tearing its context down."""

    client_id: str
    pid: int


@dataclass(frozen=True)
class StandbyStarted:
    client_id: str
    token: str
    pid: int
    starttime: int | None = None
    adopted: bool = False


@dataclass(frozen=True)
class StandbyWaiting:
    """The standby started with this token waits (at its cuInit, or warm at its first
    launch): libgpuos wrote so beside its FIFO (standby.py state_path)."""

    client_id: str
    token: str


@dataclass(frozen=True)
class StandbySpawnFailed:
    client_id: str
    token: str
    reason: str


@dataclass(frozen=True)
class StandbyExited:
    client_id: str
    pid: int
    status: int | None              # returncode (-N: signal N); None: unknown


@dataclass(frozen=True)
class UnmanagedClients:
    """get_client_list of our server, less the clients gpuos started."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class UnmanagedGone:
    pid: int


@dataclass(frozen=True)
class HookFinished:
    client_id: str
    returncode: int | None          # None: unknown (adopted, or lost in a gpuos crash)
    detail: str = ""


@dataclass(frozen=True)
class PolicySet:
    client_id: str | None           # None: the default policy
    policy: str
    hook: str | None = None


@dataclass(frozen=True)
class StopRequested:
    grace: float | None = None


@dataclass(frozen=True)
class Tick:
    pass


SLOTTED = (DaemonUp, DaemonFailed, DaemonStopped, ServerRestarted)  # inputs that name a daemon
INPUTS = (DaemonUp, DaemonFailed, DaemonExited, DaemonStopped, ServerSeen, ServerGone,
          ServerStatus, ServerRestarted, Fault, ClientRequest, CheckpointSeen, ClientStarted,
          ClientSpawnFailed, ClientExited, ClientExiting, StandbyStarted, StandbyWaiting, StandbySpawnFailed, StandbyExited,
          UnmanagedClients, UnmanagedGone, HookFinished, PolicySet, StopRequested, Tick)


# -- actions -----------------------------------------------------------------------

@dataclass(frozen=True)
class Emit:
    event: dict


# slot, in the actions below: which control daemon (its pipe directory) with a spare
# server, 0 or 1; None without one.

@dataclass(frozen=True)
class StartDaemon:
    slot: int | None = None


@dataclass(frozen=True)
class StopDaemon:
    slot: int | None = None


@dataclass(frozen=True)
class SpawnClient:
    client_id: str
    token: str
    adopt: bool = False             # first look for a process started with this token
    slot: int | None = None
    note_kernels: bool = False      # leaves its launched kernels for a warm standby


@dataclass(frozen=True)
class SpawnStandby:
    client_id: str
    token: str
    adopt: bool = False             # first look for a process started with this token
    slot: int | None = None
    warm: bool = False              # waits at its first launch (a spare server's client)


@dataclass(frozen=True)
class ReleaseStandby:
    """Let the standby past its cuInit: it becomes the client (answered by ClientStarted,
    or StandbyExited if it is gone)."""

    client_id: str
    token: str
    pid: int
    starttime: int | None


@dataclass(frozen=True)
class StopStandby:
    client_id: str
    token: str
    pid: int | None                 # None: its start was under way; found by its token
    starttime: int | None


@dataclass(frozen=True)
class SignalClient:
    client_id: str
    pid: int
    signal: str                     # "SIGTERM" | "SIGKILL" | "SIGSTOP"
    starttime: int | None           # with pid, the one process to signal


@dataclass(frozen=True)
class TerminateMpsClient:
    server_pid: int
    pid: int
    slot: int | None = None


@dataclass(frozen=True)
class EndServer:
    """SIGKILL an MPS server (the faulted one), if that pid still is one."""
    pid: int
    slot: int | None = None


@dataclass(frozen=True)
class ProbeServer:
    pid: int


@dataclass(frozen=True)
class RestartServer:
    uid: int | None                 # the clients' user: MPS servers are per user
    old_server_pid: int | None
    slot: int | None = None


@dataclass(frozen=True)
class RunHook:
    client_id: str
    token: str
    adopt: bool = False             # a resumed supervisor: the hook may be running already


@dataclass(frozen=True)
class KillHook:
    client_id: str


Action = Any


class Machine:
    """One GPU's MPS supervisor, as data.  Not thread-safe: one runtime drives it."""

    def __init__(self, gpu: str, settings: Settings | None = None):
        self.gpu = gpu
        self.settings = settings or Settings()
        self.state = State.STARTING
        self.daemon_pid: int | None = None
        self.server_pid: int | None = None
        self.server_status: str | None = None
        self.clients: dict[str, Client] = {}
        self.unmanaged: list[int] = []
        self.incident: Incident | None = None
        self.history: list[dict] = []
        self.next_incident = 1
        self.failure: str | None = None
        self.recent_faults: list[dict] = []
        # Xids an incident took, and when: a later report of one is an echo (_echo).
        self.handled_xids: list[dict] = []
        self.stop_stage = 0
        self.stop_deadline: float | None = None
        # With a spare server: the active daemon's slot (daemon_pid, server_pid are its),
        # and the spare's pids and state: off | starting | ready | restarting | lost.
        self.slot: int | None = 0 if self.settings.spare_server else None
        self.spare_daemon_pid: int | None = None
        self.spare_server_pid: int | None = None
        self.spare = "off"
        self.spare_losses = 0                   # in a row; the next try backs off
        self.spare_retry_at: float | None = None
        self._out: list[Action] = []
        self._now = 0.0

    # -- entry points ---------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """A fresh supervisor: start the control daemon."""
        self._begin(now)
        self.state = State.STARTING
        self.failure = None
        self._emit("supervisor-started")
        self._out.append(StartDaemon(self.slot))
        return self._end()

    def resume(self, now: float) -> list[Action]:
        """A supervisor started over a snapshot: pick up where the last one stopped."""
        self._begin(now)
        was = self.state
        inc = self.incident
        self._emit("supervisor-resumed", was=was.value,
                   in_flight=[{"client": v.client, "recovery": v.recovery}
                              for v in (inc.victims if inc else []) if v.recovery == "in-progress"])
        if was is State.STOPPED:
            self.clients = {k: c for k, c in self.clients.items() if c.state in ("pending",)}
            self._goto(State.STARTING, "started again")
            self._out.append(StartDaemon(self.slot))
        elif was is State.STARTING:
            self._out.append(StartDaemon(self.slot))
        elif was is State.FAILED:
            self.failure = None
            if inc is not None and inc.closed is None:
                inc.restart_attempts = 0
                inc.next_attempt_at = None
                self._goto(State.RESTARTING, "recovery resumed")
                self._out.append(RestartServer(self._victim_uid(), inc.server_pid, inc.slot))
            else:
                self._goto(State.STARTING, "started again")
                self._out.append(StartDaemon(self.slot))
        elif was is State.RESTARTING:
            assert inc is not None
            inc.next_attempt_at = None
            if inc.swapped:
                self._resume_recoveries()  # begun once the victims were gone
            self._out.append(RestartServer(self._victim_uid(), inc.server_pid, inc.slot))
        elif was is State.RECOVERING:
            assert inc is not None
            self._resume_recoveries()
            for v in inc.victims:
                if v.recovery == "pending":
                    self._recover(v)
            self._check_recovered()
        elif was is State.STOPPING:
            if self.stop_stage >= 3:
                self._stop_daemons()
            else:
                self._stop_progress()
        if self.state in (State.RUNNING, State.DRAINING, State.RESTARTING, State.RECOVERING):
            for c in self.clients.values():
                if c.state == "starting" and c.spawn_token and not self._in_progress(c.id):
                    self._out.append(SpawnClient(c.id, c.spawn_token, adopt=True, slot=self.slot,
                                                 note_kernels=self._warm_standby(c)))
        for c in self.clients.values():
            if c.standby_token and c.standby_pid is None:  # its start was under way
                self._out.append(SpawnStandby(c.id, c.standby_token, adopt=True,
                                              slot=c.standby_slot, warm=c.standby_warm))
            if c.next_standby_token:  # a replacement not yet waiting: made again if still due
                self._stop_next_standby(c, "the supervisor restarted")
        if self.slot is not None and self.spare != "restarting" \
                and self.state in (State.RUNNING, State.DRAINING, State.RESTARTING, State.RECOVERING):
            if self.spare != "ready":
                self.spare = "starting"
            self._out.append(StartDaemon(1 - self.slot))  # a running one is adopted
        self._keep_standbys()
        return self._end()

    def _resume_recoveries(self) -> None:
        """Recoveries under way when the last supervisor died: found again by their token
        (a hook or a client adopted, a standby released again), or begun anew."""
        for v in self.incident.victims:
            if v.recovery == "in-progress" and v.client in self.clients:
                c = self.clients[v.client]
                if v.token and ":hook:" in v.token:  # by what was started, not the policy now
                    self._out.append(RunHook(c.id, v.token, adopt=True))
                elif v.token and v.token == c.standby_token and c.standby_pid:
                    self._out.append(ReleaseStandby(c.id, v.token, c.standby_pid,
                                                    c.standby_starttime))
                elif v.token:
                    self._out.append(SpawnClient(c.id, v.token, adopt=True, slot=self.slot,
                                                 note_kernels=self._warm_standby(c)))
                else:
                    v.recovery = "pending"

    def handle(self, inp: Any, now: float) -> list[Action]:
        self._begin(now)
        handler = _HANDLERS.get(type(inp))
        if handler is None:
            self._emit("input-ignored", input=type(inp).__name__, why="unknown input")
        elif isinstance(inp, SLOTTED) and (inp.slot is None) != (self.slot is None):
            self._emit("input-ignored", input=type(inp).__name__, slot=inp.slot,
                       why="a daemon slot of the other mode (with or without a spare server)")
        else:
            handler(self, inp)
        self._keep_standbys()
        return self._end()

    # -- queries -----------------------------------------------------------------------
    def live_clients(self) -> list[Client]:
        return [c for c in self.clients.values() if c.state in ("running", "starting") and c.pid]

    def watched_unmanaged(self) -> list[int]:
        """Pids of clients gpuos did not start that an incident waits for (the runtime says
        when each is gone: UnmanagedGone)."""
        inc = self.incident
        if inc is None or self.state is not State.DRAINING:
            return []
        return [v.pid for v in inc.victims if v.client is None and not v.exited and v.pid]

    def leaving_victims(self) -> list[tuple[str, int]]:
        """(client id, pid) of the victims gpuos started that a swapped incident's drain
        waits for and that have not begun to exit (the runtime says when: ClientExiting)."""
        inc = self.incident
        if inc is None or self.state is not State.DRAINING or not inc.swapped:
            return []
        return [(v.client, v.pid) for v in inc.victims
                if v.client is not None and v.pid and not v.exited and not v.exiting and not v.held]

    def held_victims_deadline(self) -> float | None:
        """When the held victims are to be killed (Settings.hold_victims), or None."""
        inc = self.incident
        return inc.hold_until if inc is not None and self.state is State.DRAINING else None

    def policy_of(self, c: Client) -> tuple[str, str | None]:
        return self._policy(c), c.hook or self.settings.default_hook

    # -- persistence ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "gpu": self.gpu, "state": self.state.value, "settings": asdict(self.settings),
            "daemon_pid": self.daemon_pid, "server_pid": self.server_pid,
            "server_status": self.server_status,
            "clients": {k: asdict(c) for k, c in self.clients.items()},
            "unmanaged": list(self.unmanaged),
            "incident": asdict(self.incident) if self.incident else None,
            "history": list(self.history), "next_incident": self.next_incident,
            "failure": self.failure, "recent_faults": list(self.recent_faults),
            "handled_xids": list(self.handled_xids),
            "stop_stage": self.stop_stage, "stop_deadline": self.stop_deadline,
            "slot": self.slot, "spare": self.spare, "spare_daemon_pid": self.spare_daemon_pid,
            "spare_server_pid": self.spare_server_pid, "spare_losses": self.spare_losses,
            "spare_retry_at": self.spare_retry_at,
        }

    @classmethod
    def from_snapshot(cls, d: dict) -> "Machine":
        m = cls(d["gpu"], Settings.from_dict(d.get("settings", {})))
        m.state = State(d["state"])
        m.daemon_pid, m.server_pid = d.get("daemon_pid"), d.get("server_pid")
        m.server_status = d.get("server_status")
        m.clients = {k: Client(**v) for k, v in d.get("clients", {}).items()}
        m.unmanaged = list(d.get("unmanaged", []))
        inc = d.get("incident")
        if inc:
            inc = dict(inc)
            inc["victims"] = [Victim(**v) for v in inc.get("victims", [])]
            m.incident = Incident(**inc)
        m.history = list(d.get("history", []))
        m.next_incident = d.get("next_incident", 1)
        m.failure = d.get("failure")
        m.recent_faults = list(d.get("recent_faults", []))
        m.handled_xids = list(d.get("handled_xids", []))
        m.stop_stage, m.stop_deadline = d.get("stop_stage", 0), d.get("stop_deadline")
        m.slot = d.get("slot", m.slot)
        m.spare = d.get("spare", "off")
        m.spare_daemon_pid, m.spare_server_pid = d.get("spare_daemon_pid"), d.get("spare_server_pid")
        m.spare_losses, m.spare_retry_at = d.get("spare_losses", 0), d.get("spare_retry_at")
        return m

    # -- plumbing ------------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        self._out = []
        self._now = now

    def _end(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    def _emit(self, event: str, **data: Any) -> None:
        ev = {"time": self._now, "gpu": self.gpu, "event": event, "state": self.state.value,
              "incident": self.incident.id if self.incident and self.incident.closed is None
              else None}
        ev.update(data)
        self._out.append(Emit(ev))

    def _goto(self, new: State, why: str) -> None:
        if new is self.state:
            return
        old, self.state = self.state, new
        self._emit("state", previous=old.value, why=why)

    def _policy(self, c: Client) -> str:
        return c.policy or self.settings.default_policy

    def _warm_standby(self, c: Client) -> bool:
        """Whether c's standbys wait warm on a spare server (when it is ready)."""
        return self.settings.spare_server and self._policy(c) == "standby"

    def _in_progress(self, client_id: str) -> bool:
        v = self.incident.victim_of(client_id) if self.incident else None
        return v is not None and v.recovery == "in-progress"

    def _victim_uid(self) -> int | None:
        inc = self.incident
        for v in inc.victims if inc else []:
            if v.client in self.clients:
                return self.clients[v.client].uid
        for c in self.clients.values():
            return c.uid
        return None

    def _spawn(self, c: Client) -> str:
        c.spawns += 1
        c.spawn_token = f"{self.gpu}:{c.id}:{c.spawns}"
        c.state = "starting"
        c.pid = c.starttime = c.exit_status = c.exited_at = None
        self._out.append(SpawnClient(c.id, c.spawn_token, slot=self.slot,
                                     note_kernels=self._warm_standby(c)))
        return c.spawn_token

    def _spawn_pending(self) -> None:
        for c in self.clients.values():
            if c.state == "pending":
                self._spawn(c)

    def _recent_failures(self) -> list[Client]:
        horizon = self._now - self.settings.recent_window
        return [c for c in self.clients.values()
                if c.state == "failed" and (c.exited_at or 0) >= horizon]

    def _prune_recent(self) -> None:
        horizon = self._now - self.settings.recent_window
        self.recent_faults = [f for f in self.recent_faults if f.get("seen", 0) >= horizon]
        if self.incident is None:
            # An open incident's Xids stay handled until recent_window after it closes
            # (_close_incident).  Measured on an H100: pruned 10 s into a 36 s incident,
            # NVML's late Xid 31, 1 s after it closed, opened a second incident that killed
            # every victim just recovered.
            self.handled_xids = [h for h in self.handled_xids if h["seen"] >= horizon]

    def _handled(self, faults: list[dict]) -> None:
        self.handled_xids += [{"seen": self._now, "xid": f["xid"], "pid": fault_pid(f),
                               "certain": f.get("source") == TRACKER_SOURCE}
                              for f in faults if f.get("xid") is not None]

    def _echo(self, ev: dict) -> bool:
        """Is ev a later report of a fault an incident already took: the same Xid within
        recent_window of it, naming no process or the same one?  Measured on an H100 under
        MPS: NVML reported an Xid 31 4 s after the kernel log, past the join window, and as
        a new fault it opened a second incident that killed the victims just restarted.  A
        fault naming another process (a restarted client's new pid) is a new one.  An echo
        needs evidence, as an unattributed fault does (clients failing, the server
        reporting FAULT).  handled_xids must be pruned first.

        After a fault a UVM tracker took (certain: its pid is the faulter's), the same Xid
        from the kernel log or NVML is an echo whatever pid it names: under MPS their pid
        is a co-runner's (measured on an H100 and an H200), and the kernel log's line comes
        0.4-0.65 s after the tracker's, when a spare server's incident may have closed.  A
        new fault of a tracked process comes with a tracker report of its own."""
        xid, pid = ev.get("xid"), fault_pid(ev)
        uncertain = ev.get("source") != TRACKER_SOURCE
        return xid is not None and any(h["xid"] == xid and (pid is None or h.get("pid") == pid
                                                            or (uncertain and h.get("certain")))
                                       for h in self.handled_xids)

    # -- incidents -----------------------------------------------------------------------
    def _open_incident(self, cause: str, fault: dict | None = None) -> None:
        """Every client of the server is a victim, except when only the daemon died: then its
        server and clients may well be fine, and only those that fail are victims."""
        self._prune_recent()
        inc = Incident(id=self.next_incident, opened=self._now, cause=cause,
                       server_pid=self.server_pid, slot=self.slot)
        self.next_incident += 1
        inc.faults = [f["event"] for f in self.recent_faults]
        self.recent_faults = []
        if fault is not None:
            inc.faults.append(fault)
        self._handled(inc.faults)
        self.incident = inc
        horizon = self._now - self.settings.recent_window
        for c in self.clients.values():
            # A client still being started is not one yet: if the server refuses it, it fails
            # and becomes a late victim.
            ran = None if c.started_at is None else round(
                (self._now if c.state == "running" else c.exited_at or self._now) - c.started_at, 3)
            if c.state == "running" and cause != "daemon-exit":
                inc.victims.append(Victim(client=c.id, pid=c.pid, ran_s=ran, starttime=c.starttime,
                                          started_at=c.started_at, checkpoint_at=c.checkpoint_at))
                c.state = "victim"
            elif c.state == "failed" and (c.exited_at or 0) >= horizon:
                inc.victims.append(Victim(client=c.id, pid=c.pid, exited=True,
                                          exit_status=c.exit_status, ran_s=ran,
                                          started_at=c.started_at, checkpoint_at=c.checkpoint_at))
                c.state = "victim"
        managed_pids = self._managed_pids()
        for pid in self.unmanaged if cause != "daemon-exit" else []:
            if pid not in managed_pids:
                inc.victims.append(Victim(client=None, pid=pid, recovery="unmanaged",
                                          detail="not started by gpuos mps run: cannot be restarted"))
        for f in inc.faults:
            self._mark_named(f)
            if f.get("fault_class") == "device":
                inc.needs_reset = True
        self._emit("incident-opened", cause=cause, server_pid=inc.server_pid,
                   faults=inc.faults, needs_reset=inc.needs_reset,
                   victims=[{"client": v.client, "pid": v.pid, "role": v.role} for v in inc.victims])
        if self.spare == "ready" and cause != "daemon-exit":
            self._swap()
            self._hold_victims()
        self._end_faulted_server()
        self._begin_drain()

    def _managed_pids(self) -> set[int]:
        """Processes gpuos started: clients and their standbys (a server's client list
        shows a standby that is its client)."""
        return {p for c in self.clients.values() for p in (c.pid, c.standby_pid, c.next_standby_pid) if p}

    def _swap(self) -> None:
        """The spare server becomes the active one, now; the faulted one is drained and
        restarted as the spare (_on_restart_result).  The victims are recovered on the new
        active server as soon as the last of those gpuos started has exited
        (_check_drained): a warm standby released, or the command started again.

        Not sooner: the faulted server's context keeps the GPU until its clients are gone,
        and work started on the other server meanwhile only competes with its teardown
        (measured on an H200, standbys released at the swap: their first kernels ran only
        once the victims had exited, and SM faults' victims took 1.1-3.5 s to exit at N=4
        and 8 against 0.4-1.1 s with nothing else running).  Nor are the victims killed:
        they exit by themselves once the driver lets go of them, and killed at the swap
        (SIGKILL) they took longer (N=8 memory faults: 4.6-4.96 s against 0.3-0.8 s)."""
        inc = self.incident
        inc.swapped = True
        self.slot = 1 - self.slot
        self.daemon_pid, self.spare_daemon_pid = self.spare_daemon_pid, self.daemon_pid
        self.server_pid, self.spare_server_pid = self.spare_server_pid, self.server_pid
        self.server_status = None
        self.spare = "restarting"
        self._emit("servers-swapped", slot=self.slot, daemon_pid=self.daemon_pid,
                   server_pid=self.server_pid, faulted_server_pid=inc.server_pid)

    def _signal(self, v: Victim, sig: str) -> None:
        """Send sig to the victim gpuos started (its pid and start time: that process only)."""
        v.signalled = sig
        self._out.append(SignalClient(v.client, v.pid, sig, v.starttime))

    def _hold_victims(self) -> None:
        """With Settings.hold_victims: every victim gpuos started is stopped (SIGSTOP to its
        process group) as the incident opens, and killed (SIGKILL) that many seconds later.
        A stopped victim runs none of its code again, so its standby is released at once,
        and the driver's teardown of its context waits until the standby's first work is
        done: measured on an H200 (bench/kwait.py), a released standby's first iteration
        made RM calls (allocations, mappings, clock queries) that each waited for the RM
        lock the victims' teardown held, so it ended only when they were reaped."""
        inc = self.incident
        if self.settings.hold_victims <= 0:
            return
        held = []
        for v in inc.victims:
            if v.pid and not v.exited and not v.exiting and self._taken_over_when_held(v):
                v.held = True
                self._signal(v, "SIGSTOP")
                held.append(v.pid)
        if held:
            inc.hold_until = self._now + self.settings.hold_victims
            self._emit("victims-held", pids=held, seconds=self.settings.hold_victims)

    def _taken_over_when_held(self, v: Victim) -> bool:
        """Is v held (_hold_victims): one gpuos started whose warm standby waits on the
        now active server, and not the faulter a tracker named?  Only those: holding is
        for a standby's first work, and a held process that faulted may keep others from
        working (measured on an H200: after a trap, the standbys' first iterations ended
        only once the trapping process was gone; held, when it was killed at the hold's
        end).  The others exit by themselves."""
        c = self.clients.get(v.client) if v.client else None
        return (c is not None and v.role != "faulter" and self._policy(c) == "standby"
                and bool(c.standby_pid) and c.standby_slot == self.slot)

    def _end_held_victims(self) -> None:
        inc = self.incident
        if inc.hold_until is None or self._now < inc.hold_until:
            return
        inc.hold_until = None
        killed = []
        for v in inc.victims:
            if v.held and not v.exited:
                self._signal(v, "SIGKILL")
                killed.append(v.pid)
        self._emit("held-victims-killed", pids=killed)

    def _end_faulted_server(self) -> None:
        """With Settings.end_faulted_server: the faulted server is killed at once, so that the
        driver tears its context down now instead of when the last of its clients has gone.
        Its clients' next calls fail and they begin to exit (on an H200 0.01-0.02 s after the
        fault, against 0.11-0.17 s); the drain and the restart then go as without it.  Off
        by default: their standbys, released that much sooner, were back only 0-0.06 s
        sooner, their first work waiting for the teardown (design.md, issue 20)."""
        inc = self.incident
        if (not self.settings.end_faulted_server or inc.cause in ("daemon-exit", "server-exit")
                or not inc.server_pid):
            return
        self._out.append(EndServer(inc.server_pid, inc.slot))
        self._emit("server-ended", server_pid=inc.server_pid, slot=inc.slot)

    def _mark_named(self, fault: dict) -> None:
        """The victim a fault names: "faulter" if UVM's tracker on its VA space took it
        (certain: it counts against the client's max_faults, once an incident), else
        "named", unless a tracker has named the faulter (a client gpuos did not start,
        perhaps, so no victim): then an Xid's pid is a co-runner's, and no one is
        "named".  An incident has one faulter, the process of its first tracker report:
        later reports of other processes are the fault's consequences (measured on an
        H100: four victims' address spaces took 71 faults 0.17-0.46 s after another
        client's fault)."""
        pid = fault_pid(fault)
        certain = fault.get("source") == TRACKER_SOURCE
        victims = self.incident.victims if self.incident else []
        trackers = [fault_pid(f) for f in (self.incident.faults if self.incident else [])
                    if f.get("source") == TRACKER_SOURCE]
        if certain and trackers and trackers[0] != pid:
            return  # a consequence: the incident's faulter is trackers[0]'s process
        if certain:  # the kernel log's or NVML's pid was a guess: under MPS, a co-runner's
            for v in victims:
                if v.role == "named":
                    v.role = "victim"
        elif trackers:
            return  # a tracker has named the faulter for certain
        for v in victims:
            if pid is None or v.pid != pid or v.role == "faulter":
                continue
            v.role = "faulter" if certain else "named"
            c = self.clients.get(v.client) if v.client else None
            if certain and c is not None:
                c.faults += 1

    def _begin_drain(self) -> None:
        inc = self.incident
        inc.drain_stage = 0
        inc.stage_deadline = self._now + self.settings.drain_grace
        self._goto(State.DRAINING, f"incident {inc.id}: waiting for the server's clients to exit")
        self._check_drained()

    def _undrained(self) -> list[Victim]:
        return [v for v in self.incident.victims if not v.exited]

    def _check_drained(self) -> None:
        if self.state is not State.DRAINING:
            return
        inc = self.incident
        if inc.swapped:
            # The victims gpuos started are gone, or all their threads are exiting: recover
            # them on the new active server now, not when the driver has torn their
            # contexts down (seen on an H200: victims exiting at 0.01-0.17 s after the fault
            # were reaped at 0.22-0.40 s), nor waiting for clients it did not start (a stuck
            # injector did not keep the other server from working once the others had gone).
            # A held victim runs none of its code again: its standby goes at once.
            everyone = all(v.exited or v.exiting or v.held for v in inc.victims if v.client is not None)
            for v in inc.victims:
                if v.recovery == "pending" and v.client is not None and (everyone or v.held):
                    self._recover(v)
        if not self._undrained():
            self._emit("drained", victims=len(inc.victims))
            self._begin_restart()

    def _drain_tick(self) -> None:
        inc = self.incident
        self._end_held_victims()
        if inc.stage_deadline is None or self._now < inc.stage_deadline:
            return
        left = self._undrained()
        if inc.drain_stage == 0:
            for v in left:
                if v.client is not None and v.pid:
                    self._signal(v, "SIGTERM")
                elif v.pid and inc.server_pid:
                    v.signalled = "terminate_client"
                    self._out.append(TerminateMpsClient(inc.server_pid, v.pid, inc.slot))
            self._emit("drain-timeout", stage="SIGTERM", pids=[v.pid for v in left])
        elif inc.drain_stage == 1:
            for v in left:
                if v.client is not None and v.pid:
                    self._signal(v, "SIGKILL")
            self._emit("drain-timeout", stage="SIGKILL", pids=[v.pid for v in left])
        else:
            self._emit("drain-gave-up", pids=[v.pid for v in left],
                       why="still running after SIGKILL (or not ours to kill); restarting anyway")
            for v in left:
                v.exited = True
                v.detail = (v.detail + "; " if v.detail else "") + "did not exit"
            inc.drain_stage = 3
            self._check_drained()
            return
        inc.drain_stage += 1
        inc.stage_deadline = self._now + self.settings.kill_grace

    def _begin_restart(self) -> None:
        inc = self.incident
        inc.restart_attempts = 0
        inc.next_attempt_at = None
        self._goto(State.RESTARTING, f"incident {inc.id}: bringing a server back"
                   + (" (the spare)" if inc.swapped else ""))
        self._out.append(RestartServer(self._victim_uid(), inc.server_pid, inc.slot))

    def _on_restart_result(self, r: ServerRestarted) -> None:
        """The faulted server back, or not.  In a swapped incident it is restarted to be the
        spare: if it will not come back the clients run on without one (cold standbys until
        a spare is started again), where otherwise the supervisor fails."""
        inc = self.incident
        spare = inc.swapped
        if r.daemon_pid:
            if spare:
                self.spare_daemon_pid = r.daemon_pid
            else:
                self.daemon_pid = r.daemon_pid
        if r.ok:
            inc.server_ready_at = self._now
            if spare:
                self.spare_server_pid, self.spare = r.server_pid, "ready"
                self._emit("spare-ready", slot=inc.slot, server_pid=r.server_pid,
                           attempts=inc.restart_attempts + 1, detail=r.detail)
            else:
                self.server_pid = r.server_pid
                self.server_status = "ACTIVE"
                self._emit("server-ready", server_pid=r.server_pid,
                           attempts=inc.restart_attempts + 1, detail=r.detail)
            self._begin_recovery()
            return
        inc.restart_attempts += 1
        inc.restart_detail = r.detail
        if inc.restart_attempts >= self.settings.restart_attempts and spare:
            self._spare_lost()
            self._emit("spare-lost", slot=inc.slot, attempts=inc.restart_attempts, detail=r.detail,
                       retry_in=round(self.spare_retry_at - self._now, 3))
            self._begin_recovery()
            return
        if inc.restart_attempts >= self.settings.restart_attempts:
            self.failure = (f"incident {inc.id}: no MPS server accepted clients after "
                            f"{inc.restart_attempts} attempts ({r.detail})"
                            + ("; the GPU may need a reset (a device fault), which gpuos never does"
                               if inc.needs_reset else ""))
            self._emit("server-restart-failed", attempt=inc.restart_attempts, detail=r.detail,
                       final=True)
            self._goto(State.FAILED, self.failure)
            return
        delay = self.settings.backoff(inc.restart_attempts)
        inc.next_attempt_at = self._now + delay
        self._emit("server-restart-failed", attempt=inc.restart_attempts, detail=r.detail,
                   retry_in=delay, final=False, **({"spare": True} if spare else {}))

    def _begin_recovery(self) -> None:
        self._goto(State.RECOVERING, f"incident {self.incident.id}: recovering the victims")
        for v in self.incident.victims:
            if v.recovery == "pending":
                self._recover(v)
        self._check_recovered()

    def _recover(self, v: Victim) -> None:
        c = self.clients.get(v.client) if v.client else None
        if c is None:
            v.recovery = "unmanaged"
            return
        self._work_lost(v, v.checkpoint_at)  # a standby released below resumes from its own
        policy = self._policy(c)
        limit = c.max_restarts if c.max_restarts is not None else self.settings.max_restarts
        fault_limit = c.max_faults if c.max_faults is not None else self.settings.max_faults
        if policy == "none":
            v.recovery, c.state = "not-recovered", "not-recovered"
            self._emit("victim-not-recovered", client=c.id, pid=v.pid, why="policy none")
        elif v.role == "faulter" and c.faults >= fault_limit:
            v.recovery, c.state = "gave-up", "gave-up"
            v.detail = (f"caused {c.faults} GPU faults (limit {fault_limit}), named by UVM's fault "
                        f"tracker on its address space")
            self._emit("victim-gave-up", client=c.id, pid=v.pid, faults=c.faults, fault_limit=fault_limit)
        elif c.restarts >= limit:
            v.recovery, c.state = "gave-up", "gave-up"
            v.detail = f"already recovered {c.restarts} times (limit {limit})"
            self._emit("victim-gave-up", client=c.id, pid=v.pid, restarts=c.restarts, limit=limit)
        elif policy == "hook":
            hook = c.hook or self.settings.default_hook
            if not hook:
                v.recovery, c.state = "failed", "not-recovered"
                v.detail = "policy hook but no hook command configured"
                self._emit("victim-recovery-failed", client=c.id, pid=v.pid, detail=v.detail)
                return
            c.restarts += 1
            v.recovery = "in-progress"
            v.token = f"{self.gpu}:{c.id}:hook:{self.incident.id}:{self.incident.rounds}"
            v.hook_deadline = self._now + self.settings.hook_timeout
            self._emit("hook-started", client=c.id, pid=v.pid, hook=hook)
            self._out.append(RunHook(c.id, v.token))
        elif policy == "standby" and c.standby_pid and c.standby_slot == self.slot:
            self._work_lost(v, c.standby_state_at)
            v.recovery = "in-progress"
            v.token = c.standby_token
            c.state = "starting"
            c.pid = c.starttime = c.exit_status = c.exited_at = None
            self._emit("standby-releasing", client=c.id, pid=v.pid, standby_pid=c.standby_pid)
            self._out.append(ReleaseStandby(c.id, c.standby_token, c.standby_pid, c.standby_starttime))
        else:
            v.recovery = "in-progress"
            v.token = self._spawn(c)
            if policy == "standby":
                v.detail = "no standby was ready: restarted"
            self._emit("victim-restarting", client=c.id, pid=v.pid, cmd=c.cmd,
                       **({"why": v.detail} if v.detail else {}))

    @staticmethod
    def _work_lost(v: Victim, state_at: float | None) -> None:
        """v.lost_s: the work its replacement does again, from the state it resumes from to
        the end of the victim's run.  That state is a checkpoint written during the run
        (state_at: the newest before the incident for a restart, the one its standby started
        from for a take-over), else the victim's own start: a checkpoint from before the
        run is where the victim itself began."""
        if v.ran_s is None or v.started_at is None:
            return
        end = v.started_at + v.ran_s
        if state_at is not None and v.started_at < state_at <= end:
            v.resumes_from, v.lost_s = "checkpoint", round(end - state_at, 3)
        else:
            v.resumes_from, v.lost_s = "start", v.ran_s

    def _check_recovered(self) -> None:
        inc = self.incident
        if self.state is not State.RECOVERING or inc is None:
            return
        if any(v.recovery not in RECOVERY_DONE for v in inc.victims):
            return
        ok = all(v.recovery in RECOVERY_OK for v in inc.victims)
        self._close_incident("recovered" if ok else "partial")
        self._goto(State.RUNNING, "recovered" if ok else "recovered in part")
        self._spawn_pending()

    def _close_incident(self, outcome: str) -> None:
        inc = self.incident
        inc.closed, inc.outcome = self._now, outcome
        # Its Xids are echoes for recent_window from now, not from when they came: a long
        # incident's late reports (measured on an H200: NVML's Xid 31 13 s after the fault,
        # 1.5 s after an 11 s incident closed) would otherwise open another.
        for h in self.handled_xids:
            h["seen"] = self._now
        summary = inc.summary()
        self.history = (self.history + [summary])[-HISTORY_KEPT:]
        self._emit("incident-closed", outcome=outcome, incident=inc.id,
                   seconds=round(self._now - inc.opened, 3), victims=summary["victims"])
        self.incident = None

    # -- stopping ------------------------------------------------------------------------
    def _begin_stop(self, grace: float | None) -> None:
        if self.incident is not None:
            for v in self.incident.victims:
                if v.recovery == "in-progress" and v.token and ":hook:" in v.token:
                    self._out.append(KillHook(v.client))
            self._close_incident("aborted")
        self._goto(State.STOPPING, "stop requested")
        self.stop_stage = 0
        self.stop_deadline = self._now + (self.settings.stop_grace if grace is None else grace)
        for c in self.clients.values():
            if c.state == "pending":
                c.state = "cancelled"
        for c in self.live_clients():
            self._out.append(SignalClient(c.id, c.pid, "SIGTERM", c.starttime))
        self._stop_progress()

    def _stop_progress(self) -> None:
        live = self.live_clients()
        if self.stop_stage < 3 and (not live or self.stop_stage == 2):
            self.stop_stage = 3
            self._emit("daemon-stopping", daemon_pid=self.daemon_pid,
                       left=[c.pid for c in live])
            self._stop_daemons()
            return
        if self.stop_stage < 2 and self.stop_deadline is not None and self._now >= self.stop_deadline:
            if self.stop_stage == 0:
                for c in live:
                    self._out.append(SignalClient(c.id, c.pid, "SIGKILL", c.starttime))
                self._emit("stop-timeout", pids=[c.pid for c in live])
            self.stop_stage += 1
            self.stop_deadline = self._now + self.settings.kill_grace

    def _spare_lost(self) -> None:
        """No spare for now: standbys are cold; it is started again after a backoff (Tick)."""
        self.spare = "lost"
        self.spare_losses += 1
        self.spare_retry_at = self._now + self.settings.backoff(self.spare_losses)

    def _stop_daemons(self) -> None:
        """The standbys first (a spare's clients), then the spare, then the active daemon:
        its DaemonStopped ends the stop."""
        self._keep_standbys()
        if self.slot is not None:
            self.spare, self.spare_daemon_pid, self.spare_server_pid = "off", None, None
            self._out.append(StopDaemon(1 - self.slot))
        self._out.append(StopDaemon(self.slot))

    # -- input handlers ----------------------------------------------------------------------
    def _on_daemon_up(self, i: DaemonUp) -> None:
        if self.slot is not None and i.slot == 1 - self.slot:
            if self.spare != "restarting" and self.state not in (
                    State.STOPPING, State.STOPPED, State.FAILED):
                self.spare_daemon_pid, self.spare = i.pid, "ready"
                self.spare_losses, self.spare_retry_at = 0, None
                self._emit("spare-adopted" if i.adopted else "spare-started", daemon_pid=i.pid,
                           slot=i.slot)
            return
        self.daemon_pid = i.pid
        self._emit("daemon-adopted" if i.adopted else "daemon-started", daemon_pid=i.pid)
        if self.state is State.STARTING:
            self._goto(State.RUNNING, "the control daemon is up")
            self._spawn_pending()
            if self.slot is not None and self.spare == "off":
                self.spare = "starting"
                self._out.append(StartDaemon(1 - self.slot))

    def _on_daemon_failed(self, i: DaemonFailed) -> None:
        if self.slot is not None and i.slot == 1 - self.slot:
            self._spare_lost()
            self._emit("spare-start-failed", reason=i.reason, slot=i.slot,
                       retry_in=round(self.spare_retry_at - self._now, 3),
                       why="standbys will be cold (waiting at cuInit) on the active server")
            return
        self._emit("daemon-start-failed", reason=i.reason)
        if self.state is State.STARTING:
            self.failure = i.reason
            self._goto(State.FAILED, i.reason)

    def _on_daemon_exited(self, i: DaemonExited) -> None:
        if i.pid is not None and i.pid == self.spare_daemon_pid and self.spare == "ready":
            self.spare_daemon_pid, self.spare_server_pid = None, None
            self._spare_lost()
            self._emit("spare-exited", daemon_pid=i.pid, retry_in=round(self.spare_retry_at - self._now, 3),
                       why="standbys will be cold (waiting at cuInit) on the active server")
            return
        if i.pid != self.daemon_pid:
            return
        self.daemon_pid = None
        self._emit("daemon-exited", daemon_pid=i.pid)
        if self.state is State.RUNNING:
            self._open_incident("daemon-exit")

    def _on_daemon_stopped(self, i: DaemonStopped) -> None:
        if self.slot is not None and i.slot == 1 - self.slot:
            return  # the spare: the active daemon's stop ends the stop
        if self.state is not State.STOPPING:
            self._emit("input-ignored", input="DaemonStopped", why=f"not stopping ({self.state.value})")
            return
        self.daemon_pid = self.server_pid = None
        self.server_status = None
        self._emit("daemon-stopped", detail=i.detail)
        self._goto(State.STOPPED, "stopped")

    def _on_server_seen(self, i: ServerSeen) -> None:
        if i.pid == self.server_pid:
            return
        self.server_pid, self.server_status = i.pid, None
        self._emit("server-started", server_pid=i.pid)

    def _on_server_gone(self, i: ServerGone) -> None:
        if i.pid != self.server_pid:
            return
        self.server_pid, self.server_status = None, None
        self._emit("server-exited", server_pid=i.pid)
        if self.state is State.RUNNING:
            if self.live_clients() or self.unmanaged or self._recent_failures():
                self._open_incident("server-exit")

    def _on_server_status(self, i: ServerStatus) -> None:
        if i.pid != self.server_pid:
            return
        changed = i.status != self.server_status
        self.server_status = i.status
        if changed:
            self._emit("server-status", server_pid=i.pid, status=i.status)
        if self.state is State.RUNNING and "FAULT" in i.status.upper():
            self._open_incident("server-fault")

    def _on_fault(self, i: Fault) -> None:
        ev = dict(i.event)
        cls = str(ev.get("fault_class") or "unknown")
        ev["fault_class"] = cls
        pid = fault_pid(ev)
        ours_pids = {c.pid for c in self.live_clients()} | {self.server_pid} | set(self.unmanaged)
        by_pid = pid is not None and pid in ours_pids
        if i.ours is False and not by_pid:
            self._emit("fault-other-gpu", fault=ev)
            return
        standby_of = next((c.id for c in self.clients.values()
                           if pid and pid in (c.standby_pid, c.next_standby_pid)), None)
        if standby_of is not None:
            # A standby's own fault (its tracker follows it; a warm one is a client of the
            # spare server): not the active server's, whose clients it must not drain.
            # Its exit, if it dies of it, is a standby's (StandbyExited).
            self._emit("fault-in-standby", fault=ev, client=standby_of)
            return
        attributed = bool(i.ours) or by_pid
        self._prune_recent()
        echo = self._echo(ev)
        self._emit("fault", fault=ev, attributed=attributed, actionable=cls in ACTIONABLE,
                   unknown=cls == "unknown", echo=echo)
        if self.state in (State.STOPPING, State.STOPPED, State.FAILED):
            return
        if echo and self.incident is not None:
            self.incident.faults.append(ev)  # on record; it drains nothing again
            self._mark_named(ev)  # (the tracker's report of the Xid names the faulter)
            return
        if cls not in ACTIONABLE or not attributed or echo:
            # Reported, never dropped: an unknown Xid, or one not known to be ours, opens an
            # incident only with evidence: clients of ours that failed around it, a server
            # that reports FAULT (probe) or dies.
            self.recent_faults.append({"seen": self._now, "event": ev})
            self._prune_recent()
            if self.state is State.RUNNING and cls != "info" and self._recent_failures():
                self._open_incident("fault")
            elif self.server_pid and self.state is State.RUNNING:
                self._out.append(ProbeServer(self.server_pid))
            return
        if self.state is State.STARTING:
            self.recent_faults.append({"seen": self._now, "event": ev})
            return
        if self.state is State.RUNNING:
            self._open_incident("fault", ev)
            return
        inc = self.incident
        inc.faults.append(ev)
        self._handled([ev])
        if cls == "device":
            inc.needs_reset = True
        if self.state is State.RECOVERING:
            # The server went down again while we were recovering: drain again.
            inc.rounds += 1
            for c in self.live_clients():
                v = inc.victim_of(c.id)
                if v is None:
                    inc.victims.append(Victim(client=c.id, pid=c.pid))
                else:
                    v.pid, v.exited, v.exit_status, v.signalled = c.pid, False, None, None
                    v.recovery, v.token = "pending", None
                c.state = "victim"
            self._mark_named(ev)
            self._emit("incident-reopened", round=inc.rounds)
            self._begin_drain()
        else:
            self._mark_named(ev)

    def _on_client_request(self, i: ClientRequest) -> None:
        c = i.client
        if c.id in self.clients:
            self._emit("input-ignored", input="ClientRequest", why=f"client {c.id} exists")
            return
        if self.state in (State.STOPPING, State.STOPPED, State.FAILED):
            self._emit("client-refused", client=c.id, why=f"supervisor {self.state.value}")
            return
        c.state = "pending"
        self.clients[c.id] = c
        self._emit("client-added", client=c.id, cmd=c.cmd, cwd=c.cwd, uid=c.uid,
                   policy=self._policy(c))
        if self.state is State.RUNNING:
            self._spawn(c)
        else:
            self._emit("client-queued", client=c.id, why=f"supervisor {self.state.value}")

    def _on_client_started(self, i: ClientStarted) -> None:
        c = self.clients.get(i.client_id)
        if c is None or c.state != "starting":
            self._emit("input-ignored", input="ClientStarted", client=i.client_id,
                       why="not starting")
            return
        c.pid, c.starttime, c.started_at, c.state = i.pid, i.starttime, self._now, "running"
        v = self.incident.victim_of(c.id) if self.incident else None
        if v is not None and v.recovery == "in-progress":
            c.restarts += 1
            if v.token is not None and v.token == c.standby_token:
                c.spawn_token = c.standby_token
                c.standby_token = c.standby_pid = c.standby_starttime = None
                c.standby_losses = 0
                v.recovery = "took-over"
                v.detail = f"its standby, pid {i.pid}, took over"
                self._emit("victim-took-over", client=c.id, pid=i.pid, old_pid=v.pid,
                           restarts=c.restarts)
            else:
                v.recovery = "restarted"
                v.detail = f"new pid {i.pid}" + (" (found running after a gpuos restart)"
                                                 if i.adopted else "")
                self._emit("victim-restarted", client=c.id, pid=i.pid, old_pid=v.pid,
                           restarts=c.restarts, adopted=i.adopted)
            self._check_recovered()
        else:
            self._emit("client-started", client=c.id, pid=i.pid, adopted=i.adopted)
        if self.state is State.STOPPING:
            self._out.append(SignalClient(c.id, c.pid, "SIGTERM", c.starttime))

    def _on_client_spawn_failed(self, i: ClientSpawnFailed) -> None:
        c = self.clients.get(i.client_id)
        if c is None or c.state != "starting":
            self._emit("input-ignored", input="ClientSpawnFailed", client=i.client_id,
                       why="not starting")
            return
        c.state, c.exited_at = "failed", self._now
        v = self.incident.victim_of(c.id) if self.incident else None
        if v is not None and v.recovery == "in-progress":
            v.recovery, v.detail = "failed", i.reason
            self._emit("victim-recovery-failed", client=c.id, detail=i.reason)
            self._check_recovered()
        else:
            self._emit("client-spawn-failed", client=c.id, reason=i.reason)
        if self.state is State.STOPPING:
            self._stop_progress()

    def _on_client_exiting(self, i: ClientExiting) -> None:
        inc = self.incident
        v = inc.victim_of(i.client_id) if inc else None
        if v is None or v.pid != i.pid or v.exited or v.exiting:
            return  # stale, or already known: nothing waits on it
        v.exiting = True
        self._emit("victim-exiting", client=i.client_id, pid=i.pid)
        self._check_drained()

    def _on_client_exited(self, i: ClientExited) -> None:
        c = self.clients.get(i.client_id)
        inc = self.incident
        v = inc.victim_of(i.client_id) if inc and c else None
        if v is not None and not v.exited and i.pid is not None and i.pid == v.pid \
                and (c.pid != v.pid or v.recovery in RECOVERY_DONE):
            # The victim's old process, its place already taken or its recovery decided
            # before it had gone (a swapped incident recovers victims once they exit).
            v.exited, v.exit_status = True, i.status
            self._emit("victim-exited", client=c.id, pid=i.pid, status=i.status,
                       signalled=v.signalled)
            self._check_drained()
            return
        if c is None or c.state not in ("running", "starting", "victim") \
                or (i.pid is not None and c.pid is not None and i.pid != c.pid):
            self._emit("input-ignored", input="ClientExited", client=i.client_id, pid=i.pid,
                       why="not running" if c is None or i.pid is None or c.pid is None
                       else f"stale pid (the client is now pid {c.pid})")
            return
        c.exit_status, c.exited_at = i.status, self._now
        ok = i.status == 0
        if self.state is State.STOPPING:
            c.state = "stopped"
            self._emit("client-stopped", client=c.id, pid=c.pid, status=i.status)
            self._stop_progress()
            return
        inc = self.incident
        v = inc.victim_of(c.id) if inc else None
        if inc is not None and v is not None and v.recovery in ("pending", "in-progress") \
                and not v.exited:
            v.exited, v.exit_status = True, i.status
            c.state = "victim"
            self._emit("victim-exited", client=c.id, pid=c.pid, status=i.status,
                       signalled=v.signalled)
            self._check_drained()
            return
        if inc is not None and not ok and self.state in INCIDENT_STATES:
            # A late victim, or a restarted one that died again: recover it in this incident.
            if v is None:
                v = Victim(client=c.id, pid=c.pid)
                inc.victims.append(v)
            else:
                v.pid, v.signalled, v.recovery, v.token = c.pid, None, "pending", None
            v.exited, v.exit_status = True, i.status
            c.state = "victim"
            self._emit("victim-exited", client=c.id, pid=c.pid, status=i.status, late=True)
            if self.state is State.RECOVERING or inc.swapped:
                self._recover(v)
                self._check_recovered()
            return
        if ok:
            c.state = "exited"
            self._emit("client-exited", client=c.id, pid=c.pid, status=i.status)
            return
        c.state = "failed"
        self._emit("client-failed", client=c.id, pid=c.pid, status=i.status)
        if self.state is not State.RUNNING:
            return
        self._prune_recent()
        if any(f["event"].get("fault_class") != "info" for f in self.recent_faults):
            self._open_incident("fault")  # the fault reported just before was the cause
        elif self.server_pid:
            self._out.append(ProbeServer(self.server_pid))

    # -- standbys ---------------------------------------------------------------------------
    def _keep_standbys(self) -> None:
        """The one rule for standbys, after every input: a client of policy standby that
        runs has one while the machine runs (and keeps it through an incident, to be
        released, and for recent_window after it failed, which may be an incident's
        first sign); any other standby is stopped.  Where: warm on the spare server when
        one is ready, else cold (at cuInit) for the active one; one in the wrong place is
        replaced while the machine runs."""
        serving = self.state in (State.RUNNING, State.DRAINING, State.RESTARTING, State.RECOVERING)
        warm = self.slot is not None and self.spare == "ready"
        place = 1 - self.slot if warm else self.slot
        for c in self.clients.values():
            # A client that just failed may be a victim whose fault is not reported yet.
            failing = c.state == "failed" and self._now - (c.exited_at or 0) < self.settings.recent_window
            wanted = serving and self._policy(c) == "standby" \
                and (c.state in ("running", "victim", "starting") or failing)
            releasing = self._in_progress(c.id) and self.incident.victim_of(c.id).token == c.standby_token
            misplaced = self.state is State.RUNNING and (c.standby_slot, c.standby_warm) != (place, warm)
            why = ("moved to the spare server" if wanted and warm and misplaced
                   else "the spare server is gone" if wanted and misplaced
                   else f"client {c.state}" if serving else f"supervisor {self.state.value}")
            if c.next_standby_token is not None and (
                    not wanted or misplaced or self.state is not State.RUNNING or c.state != "running"):
                self._stop_next_standby(c, why if not wanted or misplaced else "an incident")
            if c.standby_token is not None and not releasing and (not wanted or misplaced):
                self._out.append(StopStandby(c.id, c.standby_token, c.standby_pid, c.standby_starttime))
                self._emit("standby-stopped", client=c.id, pid=c.standby_pid, why=why)
                c.standby_token = c.standby_pid = c.standby_starttime = None
            if c.next_standby_token is None and self._stale_standby(c) and wanted and not misplaced \
                    and c.state == "running" and c.standby_losses < STANDBY_LOSSES:
                c.standby_spawns += 1
                c.next_standby_token = f"{self.gpu}:{c.id}:standby:{c.standby_spawns}"
                c.next_standby_state_at = c.checkpoint_at
                self._emit("standby-refreshing", client=c.id, pid=c.standby_pid,
                           checkpoint_at=c.checkpoint_at)
                self._out.append(SpawnStandby(c.id, c.next_standby_token, slot=place, warm=warm))
            if c.standby_token is None and c.next_standby_token is not None:
                # the standby in place ended first: its replacement, waiting or not, is it
                self._promote_next_standby(c)
            if c.standby_token is None and wanted and self.state is State.RUNNING \
                    and c.state == "running" and c.standby_losses < STANDBY_LOSSES:
                c.standby_spawns += 1
                c.standby_token = f"{self.gpu}:{c.id}:standby:{c.standby_spawns}"
                c.standby_slot, c.standby_warm = place, warm
                c.standby_spawned_at, c.standby_state_at = self._now, c.checkpoint_at
                self._out.append(SpawnStandby(c.id, c.standby_token, slot=place, warm=warm))

    def _stop_next_standby(self, c: Client, why: str) -> None:
        self._out.append(StopStandby(c.id, c.next_standby_token, c.next_standby_pid, c.next_standby_starttime))
        self._emit("standby-stopped", client=c.id, pid=c.next_standby_pid, why=why, replacement=True)
        _forget_next_standby(c)

    def _promote_next_standby(self, c: Client) -> None:
        """c's replacement standby is its standby from now (same slot and warmth)."""
        c.standby_token, c.standby_pid, c.standby_starttime = \
            c.next_standby_token, c.next_standby_pid, c.next_standby_starttime
        c.standby_spawned_at, c.standby_state_at = self._now, c.next_standby_state_at
        _forget_next_standby(c)

    def _stale_standby(self, c: Client) -> bool:
        """Is c's standby to be replaced by one that starts from its newer checkpoint: one
        that has settled (or checkpoints come faster than that), while the machine runs and
        the standby is old enough (CHECKPOINT_SETTLE_S, Settings.standby_refresh)."""
        return (self.state is State.RUNNING and c.standby_pid is not None and c.checkpoint_at is not None
                and (c.standby_state_at is None or c.checkpoint_at > c.standby_state_at)
                and (self._now - c.checkpoint_at >= CHECKPOINT_SETTLE_S
                     or (c.checkpoint_gap is not None and c.checkpoint_gap < CHECKPOINT_SETTLE_S))
                and self._now - (c.standby_spawned_at or 0) >= self.settings.standby_refresh)

    def _on_checkpoint_seen(self, i: CheckpointSeen) -> None:
        c = self.clients.get(i.client_id)
        if c is None or not c.checkpoint:
            self._emit("input-ignored", input="CheckpointSeen", client=i.client_id,
                       why="no such client" if c is None else "it names no checkpoint")
            return
        # No event: a loop that saves every second would fill the log (gpuos mps clients
        # --json shows it).
        if c.checkpoint_at is None or i.at > c.checkpoint_at:
            c.checkpoint_gap = None if c.checkpoint_at is None else i.at - c.checkpoint_at
            c.checkpoint_at = i.at

    def _on_standby_started(self, i: StandbyStarted) -> None:
        c = self.clients.get(i.client_id)
        if c is not None and c.next_standby_token is not None and c.next_standby_token == i.token:
            c.next_standby_pid, c.next_standby_starttime = i.pid, i.starttime
            self._emit("standby-started", client=c.id, pid=i.pid, adopted=i.adopted, replacement=True)
            return
        if c is None or c.standby_token != i.token:  # stopped while it was being started
            self._out.append(StopStandby(i.client_id, i.token, i.pid, i.starttime))
            return
        c.standby_pid, c.standby_starttime = i.pid, i.starttime
        self._emit("standby-started", client=c.id, pid=i.pid, adopted=i.adopted)

    def _on_standby_waiting(self, i: StandbyWaiting) -> None:
        """A replacement that waits takes its standby's place; the old one is stopped."""
        c = self.clients.get(i.client_id)
        if c is None or c.next_standby_token is None or c.next_standby_token != i.token \
                or c.next_standby_pid is None:
            return  # a standby in place, or one stopped since: nothing changes
        if self.state is not State.RUNNING or self._in_progress(c.id):
            return  # (_keep_standbys stops the replacement: the standby in place is released)
        old = (c.standby_token, c.standby_pid, c.standby_starttime)
        self._promote_next_standby(c)
        c.standby_losses = 0  # it got as far as waiting
        self._emit("standby-refreshed", client=c.id, pid=c.standby_pid, checkpoint_at=c.standby_state_at)
        if old[0] is not None:
            self._out.append(StopStandby(c.id, *old))
            self._emit("standby-stopped", client=c.id, pid=old[1],
                       why="a newer checkpoint: its replacement, started from it, waits")

    def _on_standby_spawn_failed(self, i: StandbySpawnFailed) -> None:
        c = self.clients.get(i.client_id)
        if c is not None and c.next_standby_token is not None and c.next_standby_token == i.token:
            _forget_next_standby(c)
            c.standby_losses += 1
            self._emit("standby-spawn-failed", client=c.id, reason=i.reason,
                       losses=c.standby_losses, limit=STANDBY_LOSSES, replacement=True)
            return
        if c is None or c.standby_token != i.token:
            return
        c.standby_token = None
        c.standby_losses += 1
        self._emit("standby-spawn-failed", client=c.id, reason=i.reason,
                   losses=c.standby_losses, limit=STANDBY_LOSSES)

    def _on_standby_exited(self, i: StandbyExited) -> None:
        c = self.clients.get(i.client_id)
        if c is not None and c.next_standby_pid is not None and c.next_standby_pid == i.pid:
            _forget_next_standby(c)
            c.standby_losses += 1
            self._emit("standby-exited", client=c.id, pid=i.pid, status=i.status,
                       losses=c.standby_losses, limit=STANDBY_LOSSES, replacement=True)
            return
        if c is None or c.standby_pid != i.pid:
            return  # stopped by us, or already the client
        token = c.standby_token
        c.standby_token = c.standby_pid = c.standby_starttime = None
        c.standby_losses += 1
        self._emit("standby-exited", client=c.id, pid=i.pid, status=i.status,
                   losses=c.standby_losses, limit=STANDBY_LOSSES)
        v = self.incident.victim_of(c.id) if self.incident else None
        if v is not None and v.recovery == "in-progress" and v.token == token:
            # It ended as it was released: the victim is restarted instead.
            self._work_lost(v, v.checkpoint_at)
            v.token = self._spawn(c)
            v.detail = "its standby had ended: restarted"
            self._emit("victim-restarting", client=c.id, pid=v.pid, cmd=c.cmd, why=v.detail)

    def _on_unmanaged(self, i: UnmanagedClients) -> None:
        pids = sorted(set(i.pids) - self._managed_pids())
        if pids != self.unmanaged:
            self._emit("unmanaged-clients", pids=pids, previous=self.unmanaged)
            self.unmanaged = pids
        # After a swap the list is the other server's: the faulted one's clients that gpuos
        # did not start are seen to exit by their pids (UnmanagedGone).
        if self.state is State.DRAINING and not self.incident.swapped:
            for v in self.incident.victims:
                if v.client is None and not v.exited and v.pid not in pids:
                    v.exited = True
                    self._emit("victim-exited", client=None, pid=v.pid, status=None)
            self._check_drained()

    def _on_unmanaged_gone(self, i: UnmanagedGone) -> None:
        if i.pid in self.unmanaged:
            self.unmanaged.remove(i.pid)
        inc = self.incident
        for v in inc.victims if inc else []:
            if v.client is None and v.pid == i.pid and not v.exited:
                v.exited = True
                self._emit("victim-exited", client=None, pid=v.pid, status=None)
        self._check_drained()

    def _on_hook_finished(self, i: HookFinished) -> None:
        inc = self.incident
        v = inc.victim_of(i.client_id) if inc else None
        if v is None or v.recovery != "in-progress":
            self._emit("input-ignored", input="HookFinished", client=i.client_id,
                       why="no hook running")
            return
        c = self.clients[i.client_id]
        if i.returncode == 0:
            v.recovery = "hook-ok"
        elif i.returncode is None:
            v.recovery = "hook-unknown"
        else:
            v.recovery = "hook-failed"
        v.detail = i.detail or (f"hook exit status {i.returncode}" if i.returncode is not None
                                else "hook exit status unknown")
        v.hook_deadline = None
        c.state = "hooked" if i.returncode == 0 else "not-recovered"
        self._emit("hook-finished", client=c.id, returncode=i.returncode, recovery=v.recovery,
                   detail=v.detail)
        self._check_recovered()

    def _on_policy_set(self, i: PolicySet) -> None:
        if i.policy not in POLICIES:
            self._emit("input-ignored", input="PolicySet", why=f"unknown policy {i.policy!r}")
            return
        if i.client_id is None:
            self.settings.default_policy = i.policy
            if i.hook is not None:
                self.settings.default_hook = i.hook
        else:
            c = self.clients.get(i.client_id)
            if c is None:
                self._emit("input-ignored", input="PolicySet", why=f"no client {i.client_id}")
                return
            c.policy = i.policy
            if i.hook is not None:
                c.hook = i.hook
        self._emit("policy-set", client=i.client_id, policy=i.policy, hook=i.hook)

    def _on_stop(self, i: StopRequested) -> None:
        if self.state is State.STOPPED:
            return
        if self.state is State.STOPPING:
            return
        self._begin_stop(i.grace)

    def _on_tick(self, i: Tick) -> None:
        if self.state is State.RUNNING and self.spare == "lost" and self.spare_retry_at is not None \
                and self._now >= self.spare_retry_at:
            self.spare, self.spare_retry_at = "starting", None
            self._emit("spare-retry", slot=1 - self.slot, attempt=self.spare_losses + 1)
            self._out.append(StartDaemon(1 - self.slot))
        if self.state is State.DRAINING:
            self._drain_tick()
        elif self.state is State.RESTARTING:
            inc = self.incident
            if inc.next_attempt_at is not None and self._now >= inc.next_attempt_at:
                inc.next_attempt_at = None
                self._emit("server-restart-attempt", attempt=inc.restart_attempts + 1)
                self._out.append(RestartServer(self._victim_uid(), inc.server_pid, inc.slot))
        elif self.state is State.RECOVERING:
            for v in self.incident.victims:
                if v.recovery == "in-progress" and v.hook_deadline and self._now >= v.hook_deadline:
                    v.hook_deadline = None
                    v.detail = "hook timed out"
                    self._emit("hook-timeout", client=v.client)
                    self._out.append(KillHook(v.client))
        elif self.state is State.STOPPING:
            self._stop_progress()

    def _on_restart(self, i: ServerRestarted) -> None:
        if self.state is not State.RESTARTING:
            self._emit("input-ignored", input="ServerRestarted", why=f"not restarting ({self.state.value})")
            return
        self._on_restart_result(i)


_HANDLERS = {
    DaemonUp: Machine._on_daemon_up,
    DaemonFailed: Machine._on_daemon_failed,
    DaemonExited: Machine._on_daemon_exited,
    DaemonStopped: Machine._on_daemon_stopped,
    ServerSeen: Machine._on_server_seen,
    ServerGone: Machine._on_server_gone,
    ServerStatus: Machine._on_server_status,
    ServerRestarted: Machine._on_restart,
    Fault: Machine._on_fault,
    ClientRequest: Machine._on_client_request,
    CheckpointSeen: Machine._on_checkpoint_seen,
    ClientStarted: Machine._on_client_started,
    ClientSpawnFailed: Machine._on_client_spawn_failed,
    ClientExited: Machine._on_client_exited,
    ClientExiting: Machine._on_client_exiting,
    StandbyStarted: Machine._on_standby_started,
    StandbySpawnFailed: Machine._on_standby_spawn_failed,
    StandbyWaiting: Machine._on_standby_waiting,
    StandbyExited: Machine._on_standby_exited,
    UnmanagedClients: Machine._on_unmanaged,
    UnmanagedGone: Machine._on_unmanaged_gone,
    HookFinished: Machine._on_hook_finished,
    PolicySet: Machine._on_policy_set,
    StopRequested: Machine._on_stop,
    Tick: Machine._on_tick,
}
assert set(_HANDLERS) == set(INPUTS)
