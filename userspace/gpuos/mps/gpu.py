"""Which GPU a supervisor serves, where its files live, and the GPU's compute mode.

    $GPUOS_HOME/mps/<GPU UUID, or index when NVML cannot say>/
      state.json        the supervisor's state (state.py snapshot), written atomically
      events.jsonl      every event, one JSON object a line
      supervisor.sock   requests from `gpuos mps run|stop|policy`
      supervisor.lock   flock held by the running supervisor
      supervisor.log    its stdout/stderr when daemonized
      pipe/ log/        CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY of its MPS daemon
      clients/          one file per client: command, cwd, environment (mode 0600)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..config import Paths
from ..errors import GpuosError, NoGpu, NotPermitted

NVIDIA_BIN_DIRS = (Path("/usr/local/nvidia/bin"), Path("/usr/bin"))
_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]+$")


@dataclass(frozen=True)
class GpuRef:
    index: int | None
    uuid: str | None
    pci: str | None = None
    name: str | None = None

    @property
    def key(self) -> str:
        """The directory name under $GPUOS_HOME/mps."""
        return self.uuid or str(self.index)

    @property
    def visible(self) -> str:
        """The CUDA_VISIBLE_DEVICES value that pins a process to this GPU."""
        return self.uuid or str(self.index)

    def describe(self) -> str:
        parts = [f"GPU {self.index}" if self.index is not None else self.uuid or "GPU ?"]
        if self.uuid and self.index is not None:
            parts.append(self.uuid)
        if self.name:
            parts.append(f"({self.name})")
        return " ".join(parts)

    def matches(self, spec: str) -> bool:
        return spec in (self.uuid, str(self.index), self.key)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GpuRef":
        return cls(**{k: d.get(k) for k in ("index", "uuid", "pci", "name")})


@contextmanager
def nvml() -> Iterator[Any]:
    """pynvml, initialized (and shut down after), or None where NVML is not usable."""
    try:
        import pynvml  # type: ignore[import-not-found]
        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver, no GPU
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _nvml_devices() -> list[GpuRef] | None:
    """Every GPU NVML sees, or None where NVML is not usable (no driver, no nvidia-ml-py)."""
    with nvml() as nv:
        if nv is None:
            return None
        try:
            out = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                out.append(GpuRef(index=i, uuid=_text(nv.nvmlDeviceGetUUID(h)),
                                  pci=_text(nv.nvmlDeviceGetPciInfo(h).busId),
                                  name=_text(nv.nvmlDeviceGetName(h))))
            return out
        except Exception:
            return None


def process_memory(gpu: GpuRef) -> dict[int, int] | None:
    """pid -> bytes of GPU memory NVML reports on gpu (MPS clients too where the driver lists
    them), or None where NVML cannot say."""
    if gpu.index is None:
        return None
    with nvml() as nv:
        if nv is None:
            return None
        try:
            h = nv.nvmlDeviceGetHandleByIndex(gpu.index)
        except Exception:
            return None
        out: dict[int, int] = {}
        for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            call = getattr(nv, name, None)
            try:
                procs = call(h) if call is not None else []
            except Exception:
                continue
            for p in procs:
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                out[int(p.pid)] = max(out.get(int(p.pid), 0), used)
        return out


def resolve_gpu(spec: str | None, devices: list[GpuRef] | None | str = "nvml") -> GpuRef:
    """--gpu N or --gpu UUID to a GpuRef.  Without NVML the value is taken as given."""
    spec = (spec or "0").strip()
    if devices == "nvml":
        devices = _nvml_devices()
    if spec.isdigit():
        index = int(spec)
        if devices is None:
            return GpuRef(index=index, uuid=None)
        for d in devices:
            if d.index == index:
                return d
        raise NoGpu(f"no GPU {index}: NVML sees {len(devices)} GPU(s)")
    if not _UUID.match(spec):
        raise GpuosError(f"--gpu {spec!r}: give a GPU index (0, 1, ...) or a UUID (GPU-...)")
    if devices is None:
        return GpuRef(index=None, uuid=spec)
    for d in devices:
        if d.uuid and d.uuid.lower() == spec.lower():
            return d
    raise NoGpu(f"no GPU with UUID {spec} on this host")


@dataclass(frozen=True)
class MpsDirs:
    root: Path

    @classmethod
    def for_gpu(cls, paths: Paths, gpu: GpuRef) -> "MpsDirs":
        return cls(paths.home / "mps" / gpu.key)

    @property
    def pipe(self) -> Path:
        """The daemon's pipe directory; with a spare server, a link to the active one's."""
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    def pipe_of(self, slot: int | None) -> Path:
        """A control daemon's own pipe directory: slot None (no spare server) is `pipe`;
        with a spare, slot 0 and 1 are `slot0/pipe` and `slot1/pipe`."""
        return self.pipe if slot is None else self.root / f"slot{slot}" / "pipe"

    def log_of(self, slot: int | None) -> Path:
        return self.log if slot is None else self.root / f"slot{slot}" / "log"

    def point_at(self, slot: int) -> None:
        """With a spare server: `pipe` and `log` made links to the active slot's (what
        `gpuos mps env` gives clients gpuos does not start), replaced atomically."""
        for link, target in ((self.pipe, self.pipe_of(slot)), (self.log, self.log_of(slot))):
            rel = target.relative_to(self.root)
            if link.is_symlink() and Path(os.readlink(link)) == rel:
                continue
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)  # a run without a spare left it; its daemon is gone
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(rel)
            os.replace(tmp, link)

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def socket(self) -> Path:
        return self.root / "supervisor.sock"

    @property
    def lock(self) -> Path:
        return self.root / "supervisor.lock"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    @property
    def standby(self) -> Path:
        return self.root / "standby"

    def create(self, spare: bool = False) -> None:
        """spare: with a spare server, two slots' directories (pipe and log are then links,
        made by point_at); else one pipe and log."""
        for d in (self.root, self.clients):
            d.mkdir(parents=True, exist_ok=True)
        # MPS clients of any user must reach the daemon's sockets in pipe/, and standbys
        # their FIFOs (each the client's user's own) in standby/.
        dirs = [self.pipe_of(s) for s in (0, 1)] + [self.log_of(s) for s in (0, 1)] if spare \
            else [self.pipe, self.log]
        for link in ([] if spare else [self.pipe, self.log]):
            if link.is_symlink():  # a run with a spare left it
                link.unlink()
        for d in dirs + [self.standby]:
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)
        if spare:
            os.chmod(self.root / "slot0", 0o755)
            os.chmod(self.root / "slot1", 0o755)
        os.chmod(self.clients, 0o700)


def all_dirs(paths: Paths) -> list[MpsDirs]:
    base = paths.home / "mps"
    if not base.is_dir():
        return []
    return [MpsDirs(d) for d in sorted(base.iterdir()) if (d / "state.json").is_file()]


# -- compute mode (nvidia-smi) -----------------------------------------------------------

def find_nvidia_smi(env: dict[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    explicit = env.get("GPUOS_NVIDIA_SMI")
    if explicit:
        return Path(explicit)
    found = shutil.which("nvidia-smi", path=env.get("PATH"))
    if found:
        return Path(found)
    for d in NVIDIA_BIN_DIRS:
        if (d / "nvidia-smi").is_file():
            return d / "nvidia-smi"
    return None


class ComputeMode:
    """Read and set a GPU's compute mode with nvidia-smi.

    Modes as nvidia-smi prints them: Default, Exclusive_Process, Prohibited.
    """

    def __init__(self, smi: Path | None):
        self.smi = smi

    def query(self, gpu: GpuRef) -> str | None:
        """The mode, or None where nvidia-smi is missing or cannot say."""
        if self.smi is None:
            return None
        try:
            res = subprocess.run([str(self.smi), "-i", gpu.visible, "--query-gpu=compute_mode",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if res.returncode != 0:
            return None
        out = res.stdout.strip().splitlines()
        return out[0].strip() if out else None

    def set(self, gpu: GpuRef, mode: str) -> None:
        if self.smi is None:
            raise GpuosError("nvidia-smi not found: cannot change the compute mode "
                             "(set GPUOS_NVIDIA_SMI)")
        arg = mode.upper()
        try:
            res = subprocess.run([str(self.smi), "-i", gpu.visible, "-c", arg], capture_output=True,
                                 text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpuosError(f"nvidia-smi -c {arg} failed: {exc}") from None
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip().splitlines()
            msg = msg[-1] if msg else f"exit status {res.returncode}"
            if "permission" in msg.lower() or "insufficient" in msg.lower():
                raise NotPermitted(f"nvidia-smi -c {arg}: {msg} (changing the compute mode needs root)")
            raise GpuosError(f"nvidia-smi -i {gpu.visible} -c {arg} failed: {msg}")
