"""The classification table: Xid -> class, name, meaning, what gpuos does (docs/faults.md).

Names and mnemonics follow NVIDIA's Xid catalog ("Analyzing Xid Errors with the Xid
Catalog", docs.nvidia.com/deploy/xid-errors) and the driver's nverror.h.  The class
says what recovering takes, and follows NVIDIA's "immediate action" where the
catalog gives one: RESTART_APP -> the context is lost (MEMORY, SM, COPY or CHANNEL by
engine), IGNORE -> INFO, RESET_GPU / RESTART_BM -> DEVICE.  An Xid not in the table is
UNKNOWN: reported with its number and text, never dropped.

docs/faults.md lists the same table; tests/unit/test_faults.py keeps the two in step.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .model import FaultClass, FaultEvent, MmuFault


class XidInfo(NamedTuple):
    fault_class: FaultClass
    name: str          # NVIDIA's short description
    meaning: str       # what happened, in a sentence; "unsure" where the sources are thin
    action: str        # what gpuos does / what recovering takes (one line)
    mnemonic: str = ""  # the driver's name for it (nverror.h, NVIDIA's catalog)


# -- actions, by class ------------------------------------------------------------------
# gpuos itself always reports the event and keeps it in the journal; the action says
# what happens to the work and what recovering takes (docs/faults.md, "Actions").

ACT_MEMORY = ("containable: patched driver + gpuos.ko apply the client's fault policy (isolate, "
              "kill-client); stock driver: its context is torn down (MPS: every client)")
ACT_MEMORY_NONREPLAYABLE = ("not containable (non-replayable fault): the driver tears down the "
                            "context (MPS: every client)")
ACT_COPY = "not containable: the driver tears down the copy's context (MPS: every client)"
ACT_SM = ("not containable in the driver: the context is torn down (MPS: every client); "
          "restart the client")
ACT_CHANNEL = "the channel and its context are torn down (MPS: every client); restart the application"
ACT_CHANNEL_AFTER = ("the channel was torn down after a fault: see the Xid just before it for "
                     "the cause")
ACT_DEVICE = "drain the GPU (no new work) and reset it; gpuos reports, it does not reset"
ACT_DEVICE_LATER = "the affected work is lost, the rest runs on; drain and reset the GPU when convenient"
ACT_INFO = "reported; nothing to do"
ACT_UNKNOWN = "reported; no automatic action"

M, S, C, CH, D, I = (FaultClass.MEMORY, FaultClass.SM, FaultClass.COPY, FaultClass.CHANNEL,
                     FaultClass.DEVICE, FaultClass.INFO)


def _ce(n: int, mnemonic: str) -> XidInfo:
    return XidInfo(C, f"CE{n} error" if n > 2 else "Copy Engine Exception",
                   f"copy engine {n} raised an exception (NVIDIA: restart the application)",
                   ACT_COPY, mnemonic)


def _media(engine: str, mnemonic: str) -> XidInfo:
    return XidInfo(CH, f"{engine} error",
                   f"the {engine} media engine raised an exception on a channel (NVIDIA: restart "
                   "the application)", ACT_CHANNEL, mnemonic)


XID_TABLE: dict[int, XidInfo] = {
    8: XidInfo(CH, "GPU stopped processing",
               "a channel stopped making progress (FIFO idle timeout); NVIDIA: restart the application",
               ACT_CHANNEL, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT"),
    11: XidInfo(CH, "Invalid or corrupted push buffer stream",
                "the graphics engine got a method it has no hardware for; usually an application "
                "or CUDA bug", ACT_CHANNEL, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW"),
    13: XidInfo(S, "Graphics Engine Exception",
                "an SM or graphics exception in the application's kernel: out-of-range or "
                "misaligned address, illegal instruction, trap/assert; rarely hardware",
                ACT_SM, "ROBUST_CHANNEL_GR_EXCEPTION"),
    25: XidInfo(CH, "Invalid or illegal push buffer stream",
                "an illegal notifier or method in a channel's command stream; application or CUDA bug",
                ACT_CHANNEL, "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY"),
    31: XidInfo(M, "GPU memory page fault",
                "the GPU MMU could not translate an access (an unmapped or forbidden address); "
                "usually an application bug, the line names the engine, address, fault and "
                "access type", ACT_MEMORY, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT"),
    32: XidInfo(CH, "Invalid or corrupted push buffer stream",
                "the DMA controller (PBDMA) that fetches a channel's commands reported a fault; "
                "NVIDIA: mostly PCIe signal quality, rarely the application", ACT_CHANNEL,
                "ROBUST_CHANNEL_PBDMA_ERROR"),
    37: XidInfo(I, "Driver firmware error",
                "the context-switch firmware (FECS) got a method it does not implement; NVIDIA: "
                "ignore, check the application if it repeats", ACT_INFO,
                "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD"),
    38: XidInfo(I, "Driver firmware error",
                "the context-switch firmware (FECS) watchdog timed out; NVIDIA: ignore, contact "
                "support if it repeats (unsure whether a channel is torn down with it)", ACT_INFO,
                "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT"),
    39: _ce(0, "ROBUST_CHANNEL_CE0_ERROR"),
    40: _ce(1, "ROBUST_CHANNEL_CE1_ERROR"),
    41: _ce(2, "ROBUST_CHANNEL_CE2_ERROR"),
    43: XidInfo(CH, "GPU stopped processing",
                "the driver reset a channel after a fault in the application (the fault is "
                "usually reported just before); the GPU stays healthy", ACT_CHANNEL_AFTER,
                "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR"),
    44: XidInfo(CH, "Graphics Engine fault during context switch",
                "the graphics engine faulted while switching contexts; the channel is torn down",
                ACT_CHANNEL, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW"),
    45: XidInfo(I, "Preemptive cleanup, due to previous errors",
                "the driver tore down a process's channels because of an earlier error, or because "
                "the process ended (Ctrl-C, kill, GPU reset); alone it needs nothing, after another "
                "Xid follow that one", ACT_INFO, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL"),
    46: XidInfo(D, "GPU stopped processing",
                "the GPU timed out (GPU timeout error); NVIDIA: reset the GPU", ACT_DEVICE,
                "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR"),
    48: XidInfo(D, "Double Bit ECC Error",
                "an uncorrectable (double-bit) ECC error in GPU memory; applications using it get an "
                "error; a GPU reset or reboot clears it", ACT_DEVICE, "ROBUST_CHANNEL_GPU_ECC_DBE"),
    54: XidInfo(D, "Auxiliary power is not connected to the GPU board",
                "the board runs without its auxiliary power; NVIDIA: check the mechanics", ACT_DEVICE,
                "SILENT_RUNNING_PWR_REDUCED_CLOCKING"),
    60: _media("SEC2 video processor", "ROBUST_CHANNEL_SEC2_ERROR"),
    61: XidInfo(I, "Internal micro-controller breakpoint/warning",
                "the PMU hit a breakpoint; the driver calls it non-fatal and NVIDIA's catalog lists "
                "it unused on Ampere and newer (unsure on older GPUs)", ACT_INFO, "PMU_BREAKPOINT"),
    62: XidInfo(D, "Internal micro-controller halt",
                "the PMU micro-controller halted; NVIDIA: reset the GPU", ACT_DEVICE, "PMU_HALT_ERROR"),
    63: XidInfo(I, "ECC page retirement or row remapping recording event",
                "an ECC error was handled: a page retired (older GPUs) or a row marked for "
                "remapping (Ampere and newer), which takes effect at the next GPU reset",
                "reported; reset the GPU at the next convenient time to activate the remapping",
                "INFOROM_DRAM_RETIREMENT_EVENT"),
    64: XidInfo(D, "ECC page retirement or row remapper recording failure",
                "retiring a page or remapping a row failed (e.g. no spare rows left); NVIDIA: "
                "reset the GPU, contact support if it repeats", ACT_DEVICE,
                "INFOROM_DRAM_RETIREMENT_FAILURE"),
    66: XidInfo(I, "Illegal access by driver",
                "the context-switch firmware saw a register access violation; NVIDIA: ignore",
                ACT_INFO, "ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION"),
    67: XidInfo(I, "Illegal access by driver",
                "the context-switch firmware saw a verification violation; NVIDIA: ignore",
                ACT_INFO, "ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION"),
    68: _media("NVDEC0", "ROBUST_CHANNEL_NVDEC0_ERROR"),
    69: XidInfo(S, "Graphics Engine class error",
                "the graphics engine rejected a method of the channel's class (bad argument or "
                "state); application or CUDA bug", ACT_SM, "ROBUST_CHANNEL_GR_CLASS_ERROR"),
    70: _ce(3, "ROBUST_CHANNEL_CE3_ERROR"),
    71: _ce(4, "ROBUST_CHANNEL_CE4_ERROR"),
    72: _ce(5, "ROBUST_CHANNEL_CE5_ERROR"),
    74: XidInfo(D, "NVLink Error",
                "an NVLink connection to another GPU or NVSwitch failed (here or at the far end); "
                "a GPU reset or reboot clears it", ACT_DEVICE, "NVLINK_ERROR"),
    75: _ce(6, "ROBUST_CHANNEL_CE6_ERROR"),
    76: _ce(7, "ROBUST_CHANNEL_CE7_ERROR"),
    77: _ce(8, "ROBUST_CHANNEL_CE8_ERROR"),
    79: XidInfo(D, "GPU has fallen off the bus",
                "the driver cannot reach the GPU over PCIe any more (link down, hardware or power "
                "failure); every process on it is lost", "the GPU is gone: drain it; a reset or a "
                "reboot (NVIDIA: restart the machine) brings it back",
                "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"),
    80: XidInfo(CH, "Corrupted data sent to GPU",
                "a push buffer's CRC did not match (data corrupted on the way); NVIDIA: restart the "
                "application", ACT_CHANNEL, "PBDMA_PUSHBUFFER_CRC_MISMATCH"),
    82: _media("NVJPG0", "ROBUST_CHANNEL_NVJPG0_ERROR"),
    83: _media("NVDEC1", "ROBUST_CHANNEL_NVDEC1_ERROR"),
    84: _media("NVDEC2", "ROBUST_CHANNEL_NVDEC2_ERROR"),
    85: _ce(9, "ROBUST_CHANNEL_CE9_ERROR"),
    86: _media("OFA", "ROBUST_CHANNEL_OFA0_ERROR"),
    88: _media("NVDEC3", "ROBUST_CHANNEL_NVDEC3_ERROR"),
    89: _media("NVDEC4", "ROBUST_CHANNEL_NVDEC4_ERROR"),
    92: XidInfo(I, "High single-bit ECC error rate",
                "many corrected (single-bit) ECC errors; nothing was lost, the memory may be "
                "degrading", "reported; watch for it repeating", "EXCESSIVE_SBE_INTERRUPTS"),
    93: XidInfo(I, "Non-fatal violation of provisioned InfoROM wear limit",
                "the driver could not update the InfoROM because of its wear limit", ACT_INFO,
                "INFOROM_ERASE_LIMIT_EXCEEDED"),
    94: XidInfo(D, "Contained ECC error",
                "an uncorrectable memory error was contained to the application that hit it "
                "(A100 and newer): that application must restart, the others are unaffected",
                ACT_DEVICE_LATER, "ROBUST_CHANNEL_CONTAINED_ERROR"),
    95: XidInfo(D, "Uncontained ECC error",
                "an uncorrectable memory error could not be contained: every application on the "
                "GPU is affected and the GPU must be reset before work restarts", ACT_DEVICE,
                "ROBUST_CHANNEL_UNCONTAINED_ERROR"),
    96: _media("NVDEC5", "ROBUST_CHANNEL_NVDEC5_ERROR"),
    97: _media("NVDEC6", "ROBUST_CHANNEL_NVDEC6_ERROR"),
    98: _media("NVDEC7", "ROBUST_CHANNEL_NVDEC7_ERROR"),
    109: XidInfo(D, "Context Switch Timeout Error",
                 "a context switch did not complete in time (a hung or misbehaving context, or "
                 "hardware); NVIDIA: reset the GPU", ACT_DEVICE, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR"),
    110: XidInfo(D, "Security Fault Error",
                 "a security fault, uncommon unless the hardware fails; NVIDIA: cold reset",
                 ACT_DEVICE, "SEC_FAULT_ERROR"),
    119: XidInfo(D, "GSP RPC Timeout",
                 "the GPU System Processor (GSP) firmware did not answer a driver RPC in time",
                 ACT_DEVICE, "GSP_RPC_TIMEOUT"),
    120: XidInfo(D, "GSP Error",
                 "code running on the GPU System Processor (GSP) reported an error", ACT_DEVICE,
                 "GSP_ERROR"),
    121: XidInfo(I, "C2C Error",
                 "corrected errors on the chip-to-chip NVLink to a Grace CPU; no operational "
                 "impact (NVIDIA: a reset at a service window retrains the link)",
                 "reported; reset the GPU at a service window if it repeats", "C2C_ERROR"),
    136: XidInfo(D, "Link Training Failed", "an NVLink link failed to train; NVIDIA: reset the GPU",
                 ACT_DEVICE, "ALI_TRAINING_FAIL"),
    137: XidInfo(I, "NVLink Privilege Error",
                 "a remote MMU refused an illegal NVLink peer-to-peer access; usually an "
                 "application bug (unsure what happens to the context: NVIDIA says ignore)",
                 ACT_INFO, "NVLINK_PRIV_ERR"),
    140: XidInfo(D, "ECC Unrecovered Error",
                 "uncorrectable memory errors that the driver could not offline or remap; NVIDIA: "
                 "reset the GPU", ACT_DEVICE, "UNRECOVERABLE_ECC_ERROR_ESCAPE"),
    141: XidInfo(I, "CUDA Fast Path Error", "NVIDIA: ignore (no further description published)",
                 ACT_INFO, "ROBUST_CHANNEL_FAST_PATH_ERROR"),
    143: XidInfo(D, "GPU Initialization Error", "the GPU failed to initialize; NVIDIA: reset the GPU",
                 ACT_DEVICE, "GPU_INIT_ERROR"),
    **{x: XidInfo(D, f"NVLINK: {n} Error", f"an NVLink5 {n} error (Blackwell); NVIDIA's NVLink "
                  "workflow applies", ACT_DEVICE, f"NVLINK_{n}_ERROR")
       for x, n in ((144, "SAW"), (145, "RLW"), (146, "TLW"), (147, "TREX"), (148, "NVLPW_CTRL"),
                    (149, "NETIR"), (150, "MSE"))},
    154: XidInfo(D, "GPU Recovery Action Changed",
                 "the driver's summary of what recovering from the Xids before it takes: None, "
                 "Drain P2P, Drain and Reset, GPU Reset Required, Node Reboot Required",
                 "follow the recovery action it names (None: nothing)", "GPU_RECOVERY_ACTION_CHANGED"),
    155: XidInfo(D, "NVLINK: SW Defined Error",
                 "an NVLink link went down on purpose (including to sleep); NVIDIA: reset the GPU",
                 ACT_DEVICE, "NVLINK_SW_DEFINED_ERROR"),
    156: XidInfo(D, "Resource Retirement Event",
                 "a GPU resource was retired; NVIDIA: reset the GPU", ACT_DEVICE_LATER,
                 "RESOURCE_RETIREMENT_EVENT"),
    157: XidInfo(I, "Resource Retirement Failure",
                 "no repair possible for lack of spare resources; work may continue and the Xid "
                 "may repeat", ACT_INFO, "RESOURCE_RETIREMENT_FAILURE"),
    158: XidInfo(D, "GPU Fatal Timeout", "a fatal timeout on the GPU; NVIDIA: reset the GPU",
                 ACT_DEVICE, "GPU_FATAL_TIMEOUT"),
    160: XidInfo(I, "Channel Retirement Event", "a channel was retired; NVIDIA: ignore", ACT_INFO,
                 "CHANNEL_RETIREMENT_EVENT"),
    161: XidInfo(I, "Channel Retirement Failure", "retiring a channel failed; NVIDIA: ignore",
                 ACT_INFO, "CHANNEL_RETIREMENT_FAILURE"),
}

UNKNOWN_INFO = XidInfo(FaultClass.UNKNOWN, "unknown Xid",
                       "an Xid this version of gpuos has no entry for; see NVIDIA's Xid catalog",
                       ACT_UNKNOWN)

# Recovery actions that Xid 154 names ("... changed from 0x0 (None) to 0x2 (Node Reboot
# Required)") and NVML's GpuRecoveryAction event carries (nvmlDeviceGpuRecoveryAction_t).
RECOVERY_ACTIONS = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required",
                    3: "Drain P2P", 4: "Drain and Reset"}

_CE_ENGINE = re.compile(r"^CE\d*$")


def lookup(xid: int) -> XidInfo:
    return XID_TABLE.get(xid, UNKNOWN_INFO)


def replayable(mmu: MmuFault) -> bool:
    """Whether an MMU fault came through the replayable path, the one the patch contains.

    Faults of the SMs' texture/L1 units (GPC clients, "GRAPHICS GPC1 GPCCLIENT_T1_11")
    are replayable; copy engines, host/PBDMA and hub clients (HUBCLIENT_*, e.g. the
    FECS firmware) take the non-replayable path (patches/README.md).
    """
    return "GPCCLIENT" in mmu.engine.upper()


def copy_engine(mmu: MmuFault) -> bool:
    words = mmu.engine.split()
    return bool(words) and bool(_CE_ENGINE.match(words[0].upper()))


def classify(ev: FaultEvent) -> FaultEvent:
    """Set ev's class, name and action from the table and what its line says."""
    if ev.xid is None:  # an NVML event that is not an Xid: nvml.py classified it
        return ev
    info = lookup(ev.xid)
    ev.name, ev.fault_class, ev.action = info.name, info.fault_class, info.action
    if ev.xid == 31 and ev.mmu is not None:
        if copy_engine(ev.mmu):
            ev.fault_class, ev.action = FaultClass.COPY, ACT_COPY
        elif not replayable(ev.mmu):
            ev.action = ACT_MEMORY_NONREPLAYABLE
    elif ev.xid == 154 and ev.extra.get("recovery_action") == "None":
        ev.fault_class, ev.action = FaultClass.INFO, ACT_INFO
    return ev


def markdown_table() -> str:
    """The table as docs/faults.md shows it (a test checks that the two agree)."""
    rows = ["| Xid | name | class | meaning | action |", "| --- | --- | --- | --- | --- |"]
    for xid, i in sorted(XID_TABLE.items()):
        rows.append(f"| {xid} | {i.name} (`{i.mnemonic}`) | `{i.fault_class.value}` | "
                    f"{i.meaning} | {i.action} |")
    return "\n".join(rows)
