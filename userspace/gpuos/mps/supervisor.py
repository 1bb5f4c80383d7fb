"""The MPS supervisor process: drives the state machine (state.py) with real processes.

One per GPU, holding supervisor.lock.  Its loop, every `poll` seconds:

1. requests on supervisor.sock (`gpuos mps run|stop|policy`), SIGTERM/SIGINT (= stop);
2. exits of the clients and hooks it started (or adopted after a restart);
3. fault events (faults/watch.py's stream, feed files);
4. the MPS daemon: alive? its servers (get_server_list), the server's clients
   (get_client_list) and status (get_server_status);
5. a timer tick.

Each input goes through the machine; the events it emits are appended to
events.jsonl (and the fault journal), the new state is written to state.json, and only
then are its actions carried out.  So a supervisor killed at any point is resumed from
state.json by the next one (`gpuos mps start` or `gpuos mps recover`): what it had
started is found again by pid and start time or by the token in its environment.

Run as ``python -m gpuos.mps.supervisor --dir DIR [--fresh]`` (what `gpuos mps start`
does), or in the foreground by `gpuos mps start --foreground`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import procs
from ..config import Paths
from ..errors import (ALL_ERRORS, Busy, GpuosError, MpsFailed, MpsNotReady, MpsNotRunning,
                      NoSuchProcess, NotPermitted)
from ..journal import HOLD_ENV, HOLD_FILE_ENV
from .control import (MpsCommandError, MpsControl, find_mps_binaries, foreign_daemons,
                      is_server, server_ready)
from .faultsrc import FeedFiles, MpsPeers, client_of, gpu_match, open_sources
from .gpu import ComputeMode, GpuRef, MpsDirs, find_nvidia_smi
from .launch import (SIGNALS, ClientSpec, find_by_token, output_path, same_process, signal_tree,
                     spec_path, start_client, start_hook, starttime)
from .state import (POLICIES, CheckpointSeen, Client, ClientExited, ClientExiting, ClientRequest,
                    ClientSpawnFailed, ClientStarted, DaemonExited, DaemonFailed, DaemonStopped, DaemonUp, Emit,
                    EndServer, Fault,
                    HookFinished, KillHook, Machine, PolicySet, ProbeServer, ReleaseStandby,
                    RestartServer, RunHook, ServerGone, ServerRestarted, ServerSeen, ServerStatus,
                    SignalClient, SpawnClient, SpawnStandby, StandbyExited, StandbySpawnFailed,
                    StandbyStarted, StandbyWaiting, StartDaemon, State, StopDaemon, StopRequested, StopStandby,
                    TerminateMpsClient, Tick, TRACKER_SOURCE, UnmanagedClients, UnmanagedGone)
from .checkpoint import newest as newest_checkpoint
from .standby import Releases, drop_fifo, fifo_path, start_standby, waiting
from .store import EventLog, StateStore, SupervisorLock, boot_id, describe_event

MAX_REQUEST = 1 << 20
SLOW_TURN_S = 0.05   # a loop turn's work this long is said (event slow-turn), with
SLOW_PART_S = 0.005  # each part of it this long
TRACK_YOUNG_S = 10.0  # a followed process this young without a fault tracker yet is looked
TRACK_SOON_S = 0.02   # at this often, to have its tracker from its first context on
LEAVING_POLL_S = 0.01  # a swapped incident's victims are looked at this often until they exit
CHECKPOINT_POLL_S = 1.0  # clients' checkpoints (--checkpoint) are looked at this often


@dataclass
class Options:
    feeds: list[str] = field(default_factory=list)
    feed_offsets: dict[str, int] = field(default_factory=dict)
    kmsg: bool = True
    nvml: bool = True
    trackers: bool = True       # UVM fault trackers on the clients (names the faulter; root)
    poll: float = 0.25          # s between loop turns
    mps_poll: float = 0.5       # s between get_server_list calls
    status_poll: float = 2.0    # s between get_server_status / get_client_list calls

    @classmethod
    def from_dict(cls, d: dict | None) -> "Options":
        d = d or {}
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})


# -- the supervisor's socket -------------------------------------------------------------------

class _UnixPath:
    """A unix socket path that may be longer than sun_path: reached through /proc/self/fd."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> str:
        s = str(self.path)
        if len(s.encode()) < 100:
            return s
        self.fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        return f"/proc/self/fd/{self.fd}/{self.path.name}"

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def request(dirs: MpsDirs, req: dict, timeout: float = 30.0) -> dict:
    """Send one request to the supervisor of dirs; its reply.  GpuosError on a refusal."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        with _UnixPath(dirs.socket) as addr:
            try:
                s.connect(addr)
            except (FileNotFoundError, ConnectionRefusedError):
                raise MpsNotRunning(f"no gpuos MPS supervisor answers on {dirs.socket}") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise GpuosError(f"the MPS supervisor did not answer in {timeout:g} s") from None
    finally:
        s.close()
    try:
        reply = json.loads(data)
    except ValueError:
        raise GpuosError(f"the MPS supervisor gave no answer ({data[:100]!r})") from None
    if not reply.get("ok"):
        kind = reply.get("error", "error")
        cls = next((e for e in ALL_ERRORS if e.kind == kind), GpuosError)
        raise cls(reply.get("message", "the supervisor refused"))
    return reply


# -- the runtime ------------------------------------------------------------------------------

def journal_mirror(paths: Paths) -> Callable[[dict], None] | None:
    """Appends our events to the shared fault journal (faults/journal.py), if there is one."""
    try:
        from ..faults.journal import FaultJournal
    except ImportError:  # pragma: no cover - part of gpuos
        return None
    journal = FaultJournal(getattr(paths, "faults", paths.home / "faults"))
    return lambda ev: journal.append({**ev, "type": f"mps-{ev['event']}"})


class Supervisor:
    def __init__(self, paths: Paths, dirs: MpsDirs, say: Callable[[str], None] | None = None):
        self.paths, self.dirs, self.say = paths, dirs, say
        self.store = StateStore(dirs)
        saved = self.store.load()
        if saved is None:
            raise MpsNotRunning(f"no MPS state in {dirs.root}")
        self.saved = saved
        self.gpu = GpuRef.from_dict(saved.gpu)
        self.machine = Machine.from_snapshot(saved.machine)
        self.options = Options.from_dict(saved.options)
        self.binaries = find_mps_binaries()
        # One control daemon, or with a spare server one per slot (state.py).
        slots = (0, 1) if self.machine.settings.spare_server else (None,)
        self.controls = {s: MpsControl(self.binaries, dirs.pipe_of(s), dirs.log_of(s), self.gpu.visible)
                         for s in slots}
        self.events = EventLog(dirs.events, journal_mirror(paths))
        self.lock = SupervisorLock(dirs)
        self.children: dict[int, tuple[str, str, subprocess.Popen]] = {}
        self.adopted: dict[int, tuple[str, str, int | None]] = {}
        self.hooks: dict[str, int] = {}
        self.releases = Releases()
        self.inbox: collections.deque = collections.deque()
        self.daemon_start: dict[int | None, int | None] = {}  # by slot
        self._pointed: int | None = None  # the slot `pipe` links to (spare server)
        self.feeds: FeedFiles | None = None
        self.sources: list = []
        self.peers: MpsPeers | None = None  # with trackers: our servers' clients, found by their environment
        self._last_saved: str | None = None
        self._stop_signal = False
        self._turn: dict[str, float] = {}  # this loop turn's seconds by part (_timed)
        self._next_mps = 0.0
        self._next_status = 0.0
        self._next_checkpoints = 0.0
        self._watch_error: str | None = None
        self.listener: socket.socket | None = None

    @property
    def control(self) -> MpsControl:
        """The active daemon's."""
        return self.controls[self.machine.slot]

    def _foreign(self) -> list[str]:
        """Control daemons gpuos did not start that serve our GPU; the other slot's is ours."""
        m = self.machine
        return foreign_daemons([c.pipe_dir for c in self.controls.values()],
                               {p for p in (m.daemon_pid, m.spare_daemon_pid) if p}, self.gpu,
                               self.binaries)

    def _point_pipe(self) -> None:
        """With a spare server, `pipe` and `log` follow the active slot (looked at again only
        when the slot changes: this runs after every input)."""
        slot = self.machine.slot
        if slot is not None and slot != self._pointed:
            try:
                self.dirs.point_at(slot)
                self._pointed = slot
            except OSError as exc:
                self._note("point pipe", f"cannot link {self.dirs.pipe} to the active slot: {exc}")

    # -- life ---------------------------------------------------------------------------
    def run(self, fresh: bool = False, stop: float | None | bool = False) -> int:
        """Supervise until STOPPED or FAILED; the exit status (0, or MpsFailed's code).

        stop: do not resume, stop right away (grace seconds, or None for the default).
        """
        if not self.lock.try_acquire():
            raise Busy(f"another gpuos MPS supervisor runs for {self.gpu.describe()}")
        try:
            return self._run(fresh, stop)
        finally:
            self._shutdown()
            self.lock.release()

    def _run(self, fresh: bool, stop) -> int:
        self.dirs.create(spare=self.machine.settings.spare_server)
        self._point_pipe()
        self.saved.supervisor = {"pid": os.getpid(), "starttime": starttime(os.getpid())}
        self.saved.boot_id = boot_id()
        self._listen()
        self._signals()
        if self.options.trackers:
            # Every pipe directory of ours: the link `gpuos mps env` gives clients gpuos does
            # not start, and with a spare server each slot's own, which the clients and
            # standbys gpuos starts are given and their children inherit.  Measured on an
            # H100: a client's CUDA process was its child (`gpuos faults inject` running
            # gpuos-inject); followed by pid only, its fault went unnamed.
            self.peers = MpsPeers([str(self.dirs.pipe), str(self.dirs.pipe_of(0)),
                                   str(self.dirs.pipe_of(1))])
        self.sources, self.feeds = open_sources(self.options.feeds, self.options.feed_offsets,
                                                self.options.kmsg, self.options.nvml,
                                                lambda n: self.inbox.append(("note", n)),
                                                self._tracked if self.options.trackers else None)
        # What a previous supervisor started and may still run: watched by pid and start time.
        inc = self.machine.incident
        for c in self.machine.clients.values():
            v = inc.victim_of(c.id) if inc else None
            if c.pid and (c.state == "running" or (c.state == "victim" and v and not v.exited)):
                self.adopted[c.pid] = ("client", c.id, c.starttime)
            if c.standby_pid:
                self.adopted[c.standby_pid] = ("standby", c.id, c.standby_starttime)
        recorded = self.machine.daemon_pid
        daemon_ok = recorded is not None and self.control.daemon_pid() == recorded
        if daemon_ok:
            self.daemon_start[self.machine.slot] = starttime(recorded)
        now = time.time()
        if stop is not False:
            acts = self.machine.handle(StopRequested(None if stop is True else stop), now)
        elif fresh:
            acts = self.machine.start(now)
        else:
            acts = self.machine.resume(now)
        self._apply(acts)
        if recorded is not None and not daemon_ok and self.machine.daemon_pid == recorded \
                and self.machine.state not in (State.STARTING, State.STOPPING, State.STOPPED):
            self.inbox.append(DaemonExited(recorded))  # it died (or its pid was reused) meanwhile
        self._drain()
        quiet = 0  # turns in a row that a fault source woke and gave nothing
        while self.machine.state not in (State.STOPPED, State.FAILED):
            # A fault wakes the loop at once (its source's fds), not at the next poll: the
            # standbys' take-over waits for it.  A source whose fd stays readable with
            # nothing to give is left to the poll interval, not spun on.
            fault_fds = [fd for src in self.sources for fd in src.fds()] if quiet < 2 else []
            try:
                ready, _, _ = select.select([self.listener, self._wake_r, *fault_fds], [], [],
                                            self._poll_timeout())
            except InterruptedError:
                ready = []
            if self.listener in ready:
                self._accept()
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            woken_by_source = bool(set(ready) & set(fault_fds))
            self._turn, turn_start = {}, time.monotonic()
            if self._stop_signal:
                self._stop_signal = False
                self._feed(StopRequested())
            with self._timed("reap"):
                self._reap()
            with self._timed("faults"):
                got = self._faults()
            quiet = 0 if got or not woken_by_source else quiet + 1
            with self._timed("mps"):
                self._watch_mps()
            with self._timed("checkpoints"):
                self._look_at_checkpoints()
            with self._timed("tick"):
                self._feed(Tick())
            self._say_slow_turn(time.monotonic() - turn_start)
        if self.machine.state is State.STOPPED:
            self._restore_compute_mode()
            return 0
        return MpsFailed.exit_code

    def _look_at_checkpoints(self) -> None:
        """Every CHECKPOINT_POLL_S, the newest time of each client's checkpoint
        (--checkpoint), fed when it is new.  After the turn's faults and releases: a stat
        per client is never on a recovery's path.  A checkpoint written in the last poll
        before a fault may be missed: the work lost is then said too high, never too low."""
        now = time.monotonic()
        if now < self._next_checkpoints:
            return
        self._next_checkpoints = now + CHECKPOINT_POLL_S
        for c in list(self.machine.clients.values()):
            if not c.checkpoint or c.state not in ("running", "starting"):
                continue
            at = newest_checkpoint(c.checkpoint, c.uid)
            if at is not None and (c.checkpoint_at is None or at > c.checkpoint_at):
                self._feed(CheckpointSeen(c.id, at))

    def _poll_timeout(self) -> float:
        """The poll interval; LEAVING_POLL_S while a swapped incident waits for its victims
        to begin their exit (no signal says so: SIGCHLD comes when the exit is done); until
        the moment held victims are to be killed (Settings.hold_victims); or
        TRACK_SOON_S while a process the fault trackers follow is
        younger than TRACK_YOUNG_S and has no tracker yet: a client may fault within 0.1 s
        of making its context (H200: 4 of 13 injectors, faulting 0.3 s after their start,
        went unnamed with a 0.25 s poll; the incident then went by an Xid naming a victim)."""
        if self.machine.leaving_victims():
            return min(self.options.poll, LEAVING_POLL_S)
        kill_at = self.machine.held_victims_deadline()
        if kill_at is not None:  # held victims to kill on time
            return max(0.001, min(self.options.poll, kill_at - time.time()))
        for src in self.sources:
            for pid in getattr(src, "untracked", ()):
                try:
                    if procs.age(pid) < TRACK_YOUNG_S:
                        return min(self.options.poll, TRACK_SOON_S)
                except (NoSuchProcess, OSError, ValueError):
                    continue  # gone: nothing to hurry for
        return self.options.poll

    @contextlib.contextmanager
    def _timed(self, part: str):
        """Adds the time spent in the block to this loop turn's `part` (_say_slow_turn)."""
        t = time.monotonic()
        try:
            yield
        finally:
            self._turn[part] = self._turn.get(part, 0.0) + time.monotonic() - t

    def _say_slow_turn(self, seconds: float) -> None:
        """A loop turn of an incident whose work took SLOW_TURN_S or more: an event naming
        where it went.  While the loop works it sees nothing else (a victim gone, a fault),
        so a slow turn is time added to the recovery; bench/mps_faults.py keeps these.
        Parts overlap: an action's events are also in "events", a source in "faults"."""
        if seconds < SLOW_TURN_S or self.machine.incident is None:
            return  # outside an incident nothing waits on the loop (and MPS commands are slow)
        parts = {k: round(v, 4) for k, v in sorted(self._turn.items(), key=lambda kv: -kv[1])
                 if v >= SLOW_PART_S}
        m = self.machine
        self._event({"time": time.time(), "gpu": m.gpu, "event": "slow-turn", "state": m.state.value,
                     "incident": m.incident.id, "seconds": round(seconds, 4), "parts": parts})

    def _listen(self) -> None:
        try:
            self.dirs.socket.unlink()
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _UnixPath(self.dirs.socket) as addr:
            s.bind(addr)
        os.chmod(self.dirs.socket, 0o666)  # anyone may ask; SO_PEERCRED says who asks
        s.listen(16)
        s.setblocking(False)
        self.listener = s

    def _signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

        def on_stop(signum, frame):
            self._stop_signal = True
            try:
                os.write(self._wake_w, b"s")
            except OSError:
                pass
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)

        def on_child(signum, frame):
            try:
                os.write(self._wake_w, b"c")
            except OSError:  # the pipe is full: the loop is awake anyway
                pass
        signal.signal(signal.SIGCHLD, on_child)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _shutdown(self) -> None:
        self.releases.close()
        for src in self.sources:
            try:
                src.close()
            except Exception:
                pass
        if self.listener is not None:
            self.listener.close()
            try:
                self.dirs.socket.unlink()
            except FileNotFoundError:
                pass
        try:
            self._persist()
        except Exception:
            pass

    # -- the machine ---------------------------------------------------------------------
    def _feed(self, inp: Any) -> None:
        self.inbox.append(inp)
        self._drain()

    def _drain(self) -> None:
        while self.inbox:
            inp = self.inbox.popleft()
            if isinstance(inp, tuple) and inp[0] == "note":
                self._event({"time": time.time(), "gpu": self.machine.gpu, "event": "note",
                             "state": self.machine.state.value, "incident": None, "note": inp[1]})
                continue
            self._apply(self.machine.handle(inp, time.time()))

    def _apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self._event(a.event)
        with self._timed("persist"):
            self._persist()
            self._point_pipe()
        for a in actions:
            if not isinstance(a, Emit):
                with self._timed("action " + type(a).__name__):
                    self._act(a)

    def _persist(self) -> None:
        self.saved.machine = self.machine.snapshot()
        opts = asdict(self.options)
        if self.feeds is not None:
            opts["feed_offsets"] = dict(self.feeds.offsets)
        self.saved.options = opts
        text = json.dumps(self.saved.to_dict(), sort_keys=True)
        if text != self._last_saved:
            self.store.save(self.saved)
            self._last_saved = text

    def _event(self, ev: dict) -> None:
        with self._timed("events"):  # a line of events.jsonl and the fault journal's copy
            self.events.append(ev)
        if self.say is not None:
            self.say(describe_event(ev))

    def _hold(self, name: str) -> None:
        """Tests: stop here (GPUOS_TEST_HOLD_AT=name) so that they can kill us at a known step."""
        if os.environ.get(HOLD_ENV) == name:
            Path(os.environ[HOLD_FILE_ENV]).write_text(f"{os.getpid()} {name}\n")
            while True:
                time.sleep(3600)

    def _note(self, action: str, detail: str) -> None:
        self._event({"time": time.time(), "gpu": self.machine.gpu, "event": "action-failed",
                     "state": self.machine.state.value,
                     "incident": self.machine.incident.id if self.machine.incident else None,
                     "action": action, "detail": detail})

    # -- actions ---------------------------------------------------------------------------
    def _act(self, a: Any) -> None:
        handler = getattr(self, "_do_" + type(a).__name__, None)
        if handler is None:
            self._note(type(a).__name__, "no handler for this action")
            return
        try:
            handler(a)
        except Exception as exc:  # a bug or a surprise: say it, and give the machine its answer
            why = f"{type(exc).__name__}: {exc}"
            self._note(type(a).__name__, why)
            answer = {
                StartDaemon: lambda: DaemonFailed(why, a.slot),
                StopDaemon: lambda: DaemonStopped(f"error: {why}", a.slot),
                SpawnClient: lambda: ClientSpawnFailed(a.client_id, why),
                SpawnStandby: lambda: StandbySpawnFailed(a.client_id, a.token, why),
                RestartServer: lambda: ServerRestarted(False, detail=why, slot=a.slot),
                RunHook: lambda: HookFinished(a.client_id, None, why),
            }.get(type(a))
            if answer is not None:
                self.inbox.append(answer())

    def _adopt(self, kind: str, client_id: str, token: str) -> tuple[int, int] | None:
        """A process a killed supervisor had started with this token, now watched by pid."""
        found = find_by_token(token)
        if found is not None:
            self.adopted[found[0]] = (kind, client_id, found[1])
        return found

    def _do_StartDaemon(self, a: StartDaemon) -> None:
        control = self.controls[a.slot]
        pid = control.daemon_pid()
        if pid is not None:
            self.daemon_start[a.slot] = starttime(pid)
            self.inbox.append(DaemonUp(pid, adopted=True, slot=a.slot))
            return
        foreign = self._foreign()
        if foreign:
            self.inbox.append(DaemonFailed("an MPS control daemon gpuos did not start serves "
                                           f"this GPU: {'; '.join(foreign)}", a.slot))
            return
        try:
            pid = control.start_daemon()
        except MpsCommandError as exc:
            self.inbox.append(DaemonFailed(str(exc), a.slot))
            return
        self.daemon_start[a.slot] = starttime(pid)
        self.inbox.append(DaemonUp(pid, slot=a.slot))

    def _do_StopDaemon(self, a: StopDaemon) -> None:
        control = self.controls[a.slot]
        pid = control.daemon_pid()  # only a live control daemon of our pipe directory
        servers: list[int] = []
        try:
            servers = control.server_list()
        except MpsCommandError:
            pass
        grace = max(2.0, self.machine.settings.kill_grace)
        ok = control.quit(timeout=grace)
        detail = "quit"
        if not ok:
            for p, sig in [(q, signal.SIGTERM) for q in [pid, *servers] if q] + \
                          [(q, signal.SIGKILL) for q in [pid, *servers] if q]:
                if procs.alive(p):
                    try:
                        os.kill(p, sig)
                    except OSError:
                        pass
                    deadline = time.monotonic() + grace
                    while procs.alive(p) and time.monotonic() < deadline:
                        time.sleep(0.05)
            detail = "quit did not stop it in time: signalled"
        self.inbox.append(DaemonStopped(detail, a.slot))

    def _do_SpawnClient(self, a: SpawnClient) -> None:
        c = self.machine.clients[a.client_id]
        recovering = self.machine.state is State.RECOVERING
        if a.adopt and (found := self._adopt("client", c.id, a.token)):
            self.inbox.append(ClientStarted(c.id, *found, adopted=True))
            return
        if recovering:
            self._hold("mps-recovering")
        try:
            p = start_client(self.dirs, self.gpu, c, a.token, a.slot, note_kernels=a.note_kernels,
                             share_memory=a.note_kernels and self.machine.settings.share_standby_memory)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            self.inbox.append(ClientSpawnFailed(c.id, f"cannot start {c.cmd[0] if c.cmd else '?'}: "
                                                      f"{exc}"))
            return
        self.children[p.pid] = ("client", c.id, p)
        if recovering:
            self._hold("mps-spawned")
        self.inbox.append(ClientStarted(c.id, p.pid, starttime(p.pid)))

    def _do_SpawnStandby(self, a: SpawnStandby) -> None:
        c = self.machine.clients[a.client_id]
        if a.adopt and (found := self._adopt("standby", c.id, a.token)):
            self.inbox.append(StandbyStarted(c.id, a.token, *found, adopted=True))
            return
        try:
            p = start_standby(self.dirs, self.gpu, c, a.token, a.slot, a.warm,
                              share_memory=a.warm and self.machine.settings.share_standby_memory)
        except (GpuosError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            self.inbox.append(StandbySpawnFailed(c.id, a.token, f"cannot start a standby: "
                                                                f"{getattr(exc, 'message', exc)}"))
            return
        self.children[p.pid] = ("standby", c.id, p)
        self.inbox.append(StandbyStarted(c.id, a.token, p.pid, starttime(p.pid)))

    def _do_ReleaseStandby(self, a: ReleaseStandby) -> None:
        if not same_process(a.pid, a.starttime):
            self.inbox.append(StandbyExited(a.client_id, a.pid, None))
            return
        self.releases.release(fifo_path(self.dirs, a.token))
        # From here on it is the client: its exit is the client's.
        if a.pid in self.children:
            self.children[a.pid] = ("client",) + self.children[a.pid][1:]
        if a.pid in self.adopted:
            self.adopted[a.pid] = ("client",) + self.adopted[a.pid][1:]
        self.inbox.append(ClientStarted(a.client_id, a.pid, a.starttime))

    def _do_StopStandby(self, a: StopStandby) -> None:
        pid, st = a.pid, a.starttime
        if pid is None:
            pid, st = find_by_token(a.token) or (None, None)
        if pid is not None and same_process(pid, st):
            signal_tree(pid, signal.SIGKILL)
        drop_fifo(fifo_path(self.dirs, a.token))

    def _do_SignalClient(self, a: SignalClient) -> None:
        if a.client_id not in self.machine.clients or not same_process(a.pid, a.starttime):
            return
        if not signal_tree(a.pid, SIGNALS[a.signal]):
            self._note("SignalClient", f"cannot send {a.signal} to pid {a.pid}")

    def _do_TerminateMpsClient(self, a: TerminateMpsClient) -> None:
        try:
            self.controls[a.slot].terminate_client(a.server_pid, a.pid)
        except MpsCommandError as exc:
            self._note("TerminateMpsClient", str(exc))

    def _do_EndServer(self, a: EndServer) -> None:
        # Only a live MPS server: by now the pid may be gone, or (rarely) someone else's.
        if is_server(a.pid):
            try:
                os.kill(a.pid, signal.SIGKILL)
            except OSError as exc:
                self._note("EndServer", f"cannot kill MPS server {a.pid}: {exc}")

    def _do_ProbeServer(self, a: ProbeServer) -> None:
        try:
            servers = self.control.server_list()
        except MpsCommandError as exc:
            self._note("ProbeServer", str(exc))
            return
        if a.pid not in servers or not procs.alive(a.pid):
            self.inbox.append(ServerGone(a.pid))
            return
        try:
            self.inbox.append(ServerStatus(a.pid, self.control.server_status(a.pid)))
        except MpsCommandError as exc:
            self._note("ProbeServer", str(exc))

    def _do_RestartServer(self, a: RestartServer) -> None:
        self._hold("mps-restarting")
        self.inbox.append(self._restart_server(a.uid, a.old_server_pid, a.slot))

    def _restart_server(self, uid: int | None, old: int | None, slot: int | None) -> ServerRestarted:
        control = self.controls[slot]

        def answer(ok: bool, server: int | None = None, daemon: int | None = None,
                   detail: str = "") -> ServerRestarted:
            return ServerRestarted(ok, server, daemon, detail, slot)

        daemon = control.daemon_pid()
        if daemon is None:
            foreign = self._foreign()
            if foreign:
                return answer(False, detail="a foreign MPS daemon appeared: " + "; ".join(foreign))
            try:
                daemon = control.start_daemon()
            except MpsCommandError as exc:
                return answer(False, detail=f"control daemon: {exc}")
            self.daemon_start[slot] = starttime(daemon)
        try:
            servers = [s for s in control.server_list() if procs.alive(s)]
            for s in ([old] if old in servers else []) + [s for s in servers if s != old]:
                status = control.server_status(s)
                if server_ready(status):
                    return answer(True, s, daemon, f"server {s} is {status}")
            if servers:
                return answer(False, daemon=daemon,
                              detail=f"server {servers[0]} is "
                                     f"{control.server_status(servers[0]) or 'not ready'}")
            control.start_server(os.geteuid() if uid is None else uid)
            deadline = time.monotonic() + 10.0
            last = "no server appeared"
            while time.monotonic() < deadline:
                for s in control.server_list():
                    if not procs.alive(s):
                        continue
                    status = control.server_status(s)
                    if server_ready(status):
                        return answer(True, s, daemon, f"started server {s} ({status})")
                    last = f"server {s} is {status or 'not ready'}"
                time.sleep(0.1)
            return answer(False, daemon=daemon, detail=last)
        except MpsCommandError as exc:
            return answer(False, daemon=daemon, detail=str(exc))

    def _do_RunHook(self, a: RunHook) -> None:
        c = self.machine.clients[a.client_id]
        if a.adopt:
            if found := self._adopt("hook", c.id, a.token):
                self.hooks[c.id] = found[0]
                return
            self.inbox.append(HookFinished(c.id, None, "gpuos was killed while the hook ran; it "
                                                       "was not run again (its outcome is unknown)"))
            return
        inc = self.machine.incident
        v = inc.victim_of(c.id) if inc else None
        info = {"id": inc.id if inc else None, "pid": v.pid if v else c.pid,
                "exit_status": v.exit_status if v else c.exit_status,
                "xids": [f.get("xid") for f in (inc.faults if inc else [])]}
        hook = self.machine.policy_of(c)[1] or ""
        self._hold("mps-recovering")
        try:
            p = start_hook(self.dirs, self.gpu, c, hook, a.token, info)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            self.inbox.append(HookFinished(c.id, 127, f"cannot start the hook: {exc}"))
            return
        self.children[p.pid] = ("hook", c.id, p)
        self.hooks[c.id] = p.pid

    def _do_KillHook(self, a: KillHook) -> None:
        pid = self.hooks.get(a.client_id)
        if pid is not None:
            signal_tree(pid, signal.SIGKILL)

    # -- watching ------------------------------------------------------------------------------
    def _reap(self) -> None:
        self.releases.expire()
        for c in self.machine.clients.values():  # a replacement standby that now waits
            if c.next_standby_pid and c.next_standby_token \
                    and waiting(fifo_path(self.dirs, c.next_standby_token)):
                self.inbox.append(StandbyWaiting(c.id, c.next_standby_token))
        for pid in self.machine.watched_unmanaged():
            if not procs.alive(pid):
                self.inbox.append(UnmanagedGone(pid))
        for cid, pid in self.machine.leaving_victims():
            if procs.ending(pid):
                self.inbox.append(ClientExiting(cid, pid))
        for pid, (kind, cid, p) in list(self.children.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.children[pid]
            if kind == "client":
                self.inbox.append(ClientExited(cid, rc, pid))
            elif kind == "standby":
                self._drop_fifo(cid, pid)
                self.inbox.append(StandbyExited(cid, pid, rc))
            else:
                self.hooks.pop(cid, None)
                self.inbox.append(HookFinished(cid, rc, "hook timed out (killed)" if rc == -9 else ""))
        for pid, (kind, cid, st) in list(self.adopted.items()):
            if same_process(pid, st):
                continue
            del self.adopted[pid]
            if kind == "client":
                self.inbox.append(ClientExited(cid, None, pid))
            elif kind == "standby":
                self._drop_fifo(cid, pid)
                self.inbox.append(StandbyExited(cid, pid, None))
            else:
                self.hooks.pop(cid, None)
                self.inbox.append(HookFinished(cid, None, "the hook found running after a gpuos "
                                                          "restart exited; exit status unknown"))
        self._drain()

    def _drop_fifo(self, client_id: str, pid: int) -> None:
        c = self.machine.clients.get(client_id)
        if c is not None and c.standby_pid == pid and c.standby_token:
            drop_fifo(fifo_path(self.dirs, c.standby_token))
        if c is not None and c.next_standby_pid == pid and c.next_standby_token:
            drop_fifo(fifo_path(self.dirs, c.next_standby_token))

    def _tracked(self) -> list[int]:
        """The processes whose VA spaces the fault trackers follow: the server's clients
        (managed or not: those the client list has shown, and those whose environment
        names a pipe of ours) and the server."""
        m = self.machine
        peers = self.peers.scan() if self.peers is not None else []
        return ([c.pid for c in m.live_clients()] + list(m.unmanaged) + peers
                + ([m.server_pid] if m.server_pid else []))

    def _faults(self) -> int:
        """Fault events and notes from every source into the machine; how many there were."""
        got = 0
        for src in self.sources:
            try:
                with self._timed("source " + type(src).__name__):
                    evs, notes = src.poll()
            except Exception as exc:  # a source broke: say so once, keep the others
                self.sources.remove(src)
                self.inbox.append(("note", f"fault source stopped: {exc}"))
                continue
            got += len(evs) + len(notes)
            for n in notes:
                self.inbox.append(("note", n))
            for ev in evs:
                # A tracker follows only processes of ours (_tracked): its fault is ours even
                # where the machine does not know the pid (a client found by its environment).
                ours = True if ev.get("source") == TRACKER_SOURCE else gpu_match(ev, self.gpu)
                owner = client_of(ev.get("pid"), {p for c in self.machine.clients.values()
                                                  for p in (c.pid, c.standby_pid) if p})
                if owner is not None:
                    ev["client_pid"] = owner
                self.inbox.append(Fault(ev, ours))
        self._drain()
        return got

    def _watch_mps(self) -> None:
        m = self.machine
        now = time.monotonic()
        if m.state in (State.STARTING, State.STOPPING, State.RESTARTING) or now < self._next_mps:
            return
        self._next_mps = now + self.options.mps_poll
        if m.spare_daemon_pid is not None and m.spare == "ready" \
                and not same_process(m.spare_daemon_pid, self.daemon_start.get(1 - m.slot)):
            self._feed(DaemonExited(m.spare_daemon_pid))
        if m.daemon_pid is not None and not same_process(m.daemon_pid, self.daemon_start.get(m.slot)):
            self._feed(DaemonExited(m.daemon_pid))
            return
        if m.daemon_pid is None:
            return
        try:
            servers = [s for s in self.control.server_list() if procs.alive(s)]
        except MpsCommandError as exc:
            if str(exc) != self._watch_error:
                self._watch_error = str(exc)
                self._note("get_server_list", str(exc))
            return
        self._watch_error = None
        if m.server_pid is not None and m.server_pid not in servers:
            self._feed(ServerGone(m.server_pid))
        if m.state in (State.STOPPING, State.STOPPED, State.FAILED):
            return
        cur = m.server_pid if m.server_pid in servers else (servers[0] if servers else None)
        if cur is not None and cur != m.server_pid:
            self._feed(ServerSeen(cur))
        if cur is None or now < self._next_status:
            return
        self._next_status = now + self.options.status_poll
        try:
            self._feed(UnmanagedClients(tuple(self.control.client_list(cur))))
            if self.machine.state is State.RUNNING:
                self._feed(ServerStatus(cur, self.control.server_status(cur)))
        except MpsCommandError as exc:
            self._note("get_client_list/get_server_status", str(exc))

    # -- requests --------------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        with conn:
            conn.setblocking(True)
            conn.settimeout(5.0)
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _, uid, gid = struct.unpack("3i", creds)
                data = b""
                while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                try:
                    reply = self._request(json.loads(data), uid, gid)
                except GpuosError as exc:
                    reply = {"ok": False, "error": exc.kind, "exit_code": exc.exit_code,
                             "message": exc.message}
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "error": "error", "exit_code": 1,
                             "message": f"bad request: {exc}"}
                conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
            except OSError:
                return

    def _may_control(self, uid: int) -> None:
        if uid not in (0, os.geteuid()):
            raise NotPermitted(f"uid {uid} may not control the MPS supervisor of uid {os.geteuid()}")

    def _request(self, req: dict, uid: int, gid: int) -> dict:
        op = req.get("op")
        m = self.machine
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "state": m.state.value}
        if op == "run":
            return self._run_request(req, uid, gid)
        if op == "stop":
            self._may_control(uid)
            grace = req.get("grace")
            self._feed(StopRequested(None if grace is None else float(grace)))
            return {"ok": True, "state": self.machine.state.value}
        if op == "policy":
            cid = req.get("client")
            if cid is not None:
                c = m.clients.get(cid)
                if c is None:
                    raise GpuosError(f"no client {cid} on {self.gpu.describe()}")
                if uid not in (0, os.geteuid(), c.uid):
                    raise NotPermitted(f"uid {uid} may not change client {cid}'s policy")
            else:
                self._may_control(uid)
            if req.get("policy") not in POLICIES:
                raise GpuosError(f"unknown policy {req.get('policy')!r}")
            self._feed(PolicySet(cid, req["policy"], req.get("hook")))
            return {"ok": True}
        raise GpuosError(f"unknown request {op!r}")

    def _run_request(self, req: dict, uid: int, gid: int) -> dict:
        m = self.machine
        if m.state in (State.STOPPING, State.STOPPED):
            raise MpsNotRunning(f"the MPS supervisor of {self.gpu.describe()} is stopping")
        if m.state is State.FAILED:
            raise MpsNotReady(f"the MPS supervisor of {self.gpu.describe()} failed: {m.failure}")
        if os.geteuid() != 0 and uid != os.geteuid():
            raise NotPermitted(f"the supervisor runs as uid {os.geteuid()}, not root: it can only "
                               f"start clients of its own user")
        cmd = [str(x) for x in req["cmd"]]
        if not cmd:
            raise GpuosError("no command")
        policy = req.get("policy")
        if policy is not None and policy not in POLICIES:
            raise GpuosError(f"unknown policy {policy!r}")
        for key, least in (("max_restarts", 0), ("max_faults", 1)):
            v = req.get(key)
            if v is not None and (type(v) is not int or v < least):
                raise GpuosError(f"{key} must be an integer of at least {least}, not {v!r}")
        checkpoint = req.get("checkpoint")
        if checkpoint is not None and (type(checkpoint) is not str or not os.path.isabs(checkpoint)
                                       or len(checkpoint) > 4096 or "\0" in checkpoint):
            raise GpuosError(f"checkpoint must be an absolute path, not {checkpoint!r}")
        n = 1 + max([int(k[1:]) for k in m.clients if k[1:].isdigit()] or [0])
        cid = f"c{n}"
        ClientSpec(cmd=cmd, cwd=str(req["cwd"]), env={str(k): str(v) for k, v in req["env"].items()},
                   uid=uid, gid=gid).save(spec_path(self.dirs, cid))
        c = Client(id=cid, cmd=cmd, cwd=str(req["cwd"]), uid=uid, gid=gid, policy=policy,
                   hook=req.get("hook"), max_restarts=req.get("max_restarts"),
                   max_faults=req.get("max_faults"), output=req.get("output"),
                   checkpoint=checkpoint)
        self._feed(ClientRequest(c))
        c = self.machine.clients.get(cid, c)
        return {"ok": True, "client": cid, "pid": c.pid, "state": c.state,
                "supervisor_state": self.machine.state.value,
                "output": str(output_path(self.dirs, c)),
                "policy": self.machine.policy_of(c)[0]}

    # -- compute mode --------------------------------------------------------------------------
    def _restore_compute_mode(self) -> None:
        cm = self.saved.compute_mode
        if not cm or not cm.get("set") or cm.get("restored"):
            return
        ev = {"time": time.time(), "gpu": self.machine.gpu, "state": self.machine.state.value,
              "incident": None, "previous": cm["set"], "mode": cm["previous"]}
        try:
            ComputeMode(find_nvidia_smi()).set(self.gpu, cm["previous"])
            cm["restored"] = cm["previous"]
            self._event({**ev, "event": "compute-mode-restored"})
        except GpuosError as exc:
            cm["restore_error"] = exc.message
            self._event({**ev, "event": "compute-mode-restore-failed", "detail": exc.message})
        self._persist()


# -- starting a supervisor ------------------------------------------------------------------------

def spawn_supervisor(dirs: MpsDirs, fresh: bool) -> subprocess.Popen:
    """Start `python -m gpuos.mps.supervisor` detached (own session, output to supervisor.log)."""
    import gpuos
    env = dict(os.environ)
    pkg_parent = str(Path(gpuos.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    dirs.root.mkdir(parents=True, exist_ok=True)  # the rest is the supervisor's (create)
    log = os.open(dirs.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        argv = [sys.executable, "-m", "gpuos.mps.supervisor", "--dir", str(dirs.root.absolute())]
        if fresh:
            argv.append("--fresh")
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True, cwd="/")
    finally:
        os.close(log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuos.mps.supervisor")
    ap.add_argument("--dir", required=True, help="the GPU's directory under $GPUOS_HOME/mps")
    ap.add_argument("--fresh", action="store_true", help="start anew (else resume the state)")
    args = ap.parse_args(argv)
    dirs = MpsDirs(Path(args.dir))
    paths = Paths.from_env()
    say = lambda s: print(s, flush=True)  # noqa: E731  (supervisor.log)
    try:
        sup = Supervisor(paths, dirs, say=say)
        return sup.run(fresh=args.fresh)
    except GpuosError as exc:
        print(f"gpuos mps supervisor: {exc.message}", flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
