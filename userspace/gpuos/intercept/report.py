"""What `gpuos run` reports: per-process tracking state and the validation summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STAT_FIELDS = ("missed_bytes", "changed_bytes", "predicted_bytes", "overpredicted_bytes")


@dataclass
class KernelStats:
    name: str
    launches: int = 0
    validated: int = 0
    skipped: int = 0
    with_misses: int = 0
    missed_bytes: int = 0
    changed_bytes: int = 0
    predicted_bytes: int = 0
    overpredicted_bytes: int = 0


@dataclass
class ValidationSummary:
    """Validation outcomes summed over every process, in total and per kernel name.

    Copies, memsets and graph launches count in the totals; their "kernel" rows are
    named "(copy)" and "(graph)".
    """

    touched: bool = False  # --record-touched: "changed" bytes are the bytes launches touched
    operations: int = 0
    skipped: int = 0
    with_misses: int = 0
    missed_bytes: int = 0
    changed_bytes: int = 0
    predicted_bytes: int = 0
    overpredicted_bytes: int = 0
    kernels: dict[str, KernelStats] = field(default_factory=dict)

    def _row(self, name: str) -> KernelStats:
        row = self.kernels.get(name)
        if row is None:
            row = self.kernels[name] = KernelStats(name)
        return row

    def launched(self, name: str) -> None:
        self._row(name).launches += 1

    def add(self, name: str, rec: dict) -> None:
        row = self._row(name)
        if rec["skipped"]:
            self.skipped += 1
            row.skipped += 1
            return
        self.operations += 1
        row.validated += 1
        missed = rec["missed_bytes"] > 0
        self.with_misses += missed
        row.with_misses += missed
        for f in STAT_FIELDS:
            setattr(self, f, getattr(self, f) + rec[f])
            setattr(row, f, getattr(row, f) + rec[f])

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "kernels"}
        d["kernels"] = sorted((asdict(k) for k in self.kernels.values()),
                              key=lambda k: (-k["with_misses"], -k["launches"], k["name"]))
        return d


@dataclass
class ProcessReport:
    pid: int
    ppid: int
    exe: str
    state: str                # "on" | "incomplete" | "off"
    reason: str | None        # why off
    counters: dict[str, int]
    incomplete: list[str] = field(default_factory=list)  # why incomplete (ring.INCOMPLETE, reader-lapped)
    memory: str = "driver"    # "movable": its cuMemAlloc served by gpuos (ring.MEMORY_MODES)
