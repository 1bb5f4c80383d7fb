#!/usr/bin/env python3
"""Which VA space does UVM charge a GPU fault to?  An event tracker on another process's
/dev/nvidia-uvm, through the stock driver's tools interface (issue 20; GPU host, root).

    uvm_tools_probe.py --pid PID [--pid PID2 ...] [--mps-servers] [--seconds S] [--out FILE.json]
    uvm_tools_probe.py --self-test

WHAT IT SHOWS
  For every /dev/nvidia-uvm file that the given processes hold (found through
  /proc/PID/fd, copied into this process with pidfd_open + pidfd_getfd, identical files
  merged with kcmp), it opens /dev/nvidia-uvm-tools, binds an event tracker to that
  file's VA space, enables the fault events and polls the queue for S seconds. Every
  event decoded (type, timestamps, address, GPU index, fault/access type, GPC or
  channel, MMU client id, fatal reason; raw bytes in hex for what it cannot decode) and
  every step's outcome (ok, errno, NV_STATUS) go to the JSON. The point: attach it to
  every MPS client (and the MPS server), fault one client, and see whose tracker gets
  UvmEventTypeGpuFault / UvmEventTypeFatalFault. UVM puts a replayable fault in the VA
  space it translates from (instance pointer, VEID), so the tracker that records it
  names the faulting client, which the Xid line under MPS does not. See
  docs/notes-uvm-tools.md.

  It never writes to the target: it holds duplicates of the target's uvm files (the
  tracker holds one more reference until it is closed), and by default it makes one
  read-only ioctl on them (UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2, to map GPU indices to
  UUIDs; --no-target-ioctls skips it). It stops early when every target has exited, so
  it does not keep an exited process's VA space alive.

STRUCT LAYOUTS ASSUMED (NVIDIA open-gpu-kernel-modules tag 580.142, kernel-open/; the GPU
hosts run 580.159.04, which is not published: re-check there). --self-test checks every
ctypes size below against these numbers (which gcc gave for the headers, x86_64).
  ioctl numbers are plain integers, not _IOWR codes: UVM_IOCTL_BASE(i) is i on Linux
    (nvidia-uvm/uvm_ioctl.h:37-40). Every UVM ioctl returns 0 and puts an NV_STATUS in
    the params' rmStatus (nvidia-uvm/uvm_api.h:45-67); -EFAULT / -EINVAL only for bad
    pointers / unknown commands (uvm_tools.c:670-685).
  UVM_TOOLS_INIT_EVENT_TRACKER (56) / _V2 (76), 56 bytes (uvm_ioctl.h:822-832, 1094-1095):
    u64 queueBuffer @0, u64 queueBufferSize @8 (entries, power of two >= 2), u64
    controlBuffer @16, NvProcessorUuid processor @24 (16 bytes; counters only), u32
    allProcessors @40 (counters only), u32 uvmFd @44 (a fd number in THIS process),
    u32 rmStatus @48.
  UVM_TOOLS_SET_NOTIFICATION_THRESHOLD (57), 8 bytes: u32 threshold, u32 rmStatus
    (uvm_ioctl.h:837-842).
  UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS (58) / DISABLE (59), 16 bytes: u64 eventTypeFlags,
    u32 rmStatus (uvm_ioctl.h:847-862).
  UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2 (77) / (64) on the uvm fd, 16 bytes: u64 tablePtr,
    u32 rmStatus; fills 257 (v1: 33) x 16-byte UUIDs, index = the events' gpuIndex /
    processorIndex, 0 = CPU (uvm_ioctl.h:913-918, 1097-1098; uvm_tools.c:2664-2723;
    UVM_ID_MAX_PROCESSORS = 32*8+1, uvm_processors.h:293-294).
  UvmToolsEventControlData, 528 bytes (uvm_types.h:1401-1412): u32 get_ahead, get_behind,
    put_ahead, put_behind; u64 dropped[64] @16 (UvmEventNumTypesAll = 64,
    uvm_types.h:281-313).
  UvmEventEntry (v1 queue) 64 bytes, UvmEventEntry_V2 (v2 queue) 72 bytes
    (uvm_types.h:1302-1334, 1336-1368); byte 0 is the event type.
  UvmEventGpuFaultInfo_V2, 40 bytes (uvm_types.h:629-677): u8 eventType @0, u8 faultType
    @1, u16 gpuIndex @2, u16 gpcId|channelId @4 (gpcId for replayable, channelId for
    non-replayable: uvm_tools.c:811-814), u16 clientId @6 (HW MMU client id), u64
    address @8, u64 timeStamp @16 (CPU, CLOCK_MONOTONIC_RAW ns: uvm_linux.h:136-142),
    u64 timeStampGpu @24, u32 batchId @32, u8 clientType @36 (1 GPC, 2 HUB), u8
    accessType @37. v1 (uvm_types.h:577-627): u8 accessType @2, u8 gpuIndex @3,
    clientType @36. No VEID in either: the VA space the tracker is bound to is the
    attribution.
  UvmEventFatalFaultInfo_V2, 24 bytes (uvm_types.h:753-770): u8 eventType, faultType,
    accessType, reason; u16 processorIndex @4; u64 address @8; u64 timeStamp @16.
    v1 (uvm_types.h:733-751): u8 processorIndex @3, u8 reason @4.
  UvmEventGpuFaultReplayInfo_V2, 24 bytes (uvm_types.h:712-728). Replay events are
    broadcast to every VA space with tools enabled (uvm_tools.c:1061-1081): they say
    nothing about who faulted.
  The kernel writes entry put_behind, then sets put_ahead = put_behind = next; it drops
  (dropped[type]++) when ((count + get_behind - put_behind) & (count-1)) == 1
  (uvm_tools.c:448-499). The reader consumes [get, put_behind) and stores get_ahead and
  get_behind. Queue and control buffers are this process's own memory, pinned by the
  driver (map_user_pages, uvm_tools.c:257-326): they must be page aligned (the driver
  vmaps whole pages and ignores the offset) and must not be nvidia-uvm mappings.

OPEN QUESTIONS (what a GPU run must answer)
  - Under MPS, which process holds the uvm file of a client's VA space (the client, the
    server, both through SCM_RIGHTS)? The probe lists every holder it sees.
  - Is every MPS client's work in its own subcontext, so that a GPC fault translates to
    that client's VA space (uvm_gpu.c:3534-3595), or does it land in another VA space?
  - Do the GpuFault / FatalFault events reach the queue before robust-channel recovery
    tears the server down? From source they are written synchronously in the fault
    bottom half before the cancel is pushed (uvm_gpu_replayable_faults.c:2008-2028,
    438-459); timing on the host is unmeasured.
  - Non-replayable (HUB: copy engine) faults report VEID 0 and go to the channel's VA
    space (uvm_gpu.c:3554-3569): under MPS, whose?
  - The struct layouts of 580.159.04 (the host's driver) versus 580.142 (this source).

Exit status: 0 ran (at least one tracker), 1 self-test failed or an unexpected error,
2 bad usage, 3 no tracker could be created, 4 environment (not root, not Linux x86_64 or
aarch64, no /dev/nvidia-uvm-tools).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import mmap
import os
import platform
import select
import signal
import stat
import sys
import time

from gpuos.faults.uvm_tools import (  # shared with gpuos's own fault trackers
    ACCESS_TYPES, ENTRY_SIZE, FATAL_REASONS, FAULT_TYPES, NVIDIA_UVM_PRIMARY_MINOR,
    UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS, UVM_TOOLS_INIT_EVENT_TRACKER,
    UVM_TOOLS_INIT_EVENT_TRACKER_V2, UVM_TOOLS_SET_NOTIFICATION_THRESHOLD, U8, U16, U32, U64,
    ControlData, EnableEventsParams, FatalFaultInfoV2, InitEventTrackerParams, NvProcessorUuid,
    SetThresholdParams, Sys, _struct, ioctl_struct, uvm_major)
from gpuos.faults.uvm_tools import FatalFault, decode_fatal
from gpuos.faults.uvm_tools import Queue as SharedQueue

# --------------------------------------------------------------------------------------
# Constants (kernel-open/ of 580.142)

UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS = 59   # uvm_ioctl.h:857
UVM_TOOLS_GET_PROCESSOR_UUID_TABLE = 64     # uvm_ioctl.h:913
UVM_TOOLS_FLUSH_EVENTS = 67                 # uvm_ioctl.h:948
UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2 = 77  # uvm_ioctl.h:1097

NVIDIA_UVM_TOOLS_MINOR = 1                  # uvm_common.h:47
UVM_ID_MAX_PROCESSORS = 32 * 8 + 1          # uvm_processors.h:293-294, nvlimits.h:37
UVM_MAX_PROCESSORS_V1 = 32 + 1              # uvm_types.h:62-63
UVM_EVENT_NUM_TYPES = 15                    # uvm_types.h:302 (valid: 1..14)

# uvm_types.h:281-313
EVENT_TYPES = {
    1: "cpu_fault", 2: "migration", 3: "gpu_fault", 4: "gpu_fault_replay",
    5: "fault_buffer_overflow", 6: "fatal_fault", 7: "read_duplicate",
    8: "read_duplicate_invalidate", 9: "page_size_change", 10: "thrashing_detected",
    11: "throttling_start", 12: "throttling_end", 13: "map_remote", 14: "eviction",
    62: "test_hmm_split_invalidate", 63: "test_access_counter",
}
EVENT_BY_NAME = {v: k for k, v in EVENT_TYPES.items() if k < UVM_EVENT_NUM_TYPES}
DEFAULT_EVENTS = "gpu_fault,fatal_fault,gpu_fault_replay"

# uvm_types.h:270-279, 407-433, 435-450: ACCESS_TYPES, FAULT_TYPES, FATAL_REASONS (gpuos.faults.uvm_tools)
# uvm_types.h:563-571
CLIENT_TYPES = {0: "invalid", 1: "gpc (replayable)", 2: "hub (non-replayable)"}
# uvm_types.h:452-476
MIGRATION_CAUSES = {0: "invalid", 1: "user", 2: "coherence", 3: "prefetch", 4: "eviction",
                    5: "access_counters"}

# common/inc/nvstatuscodes.h (the codes these paths return)
NV_STATUS_NAMES = {
    0x00: "NV_OK", 0x03: "NV_ERR_BUSY_RETRY", 0x10: "NV_ERR_GPU_IN_FULLCHIP_RESET",
    0x16: "NV_ERR_ILLEGAL_ACTION", 0x1B: "NV_ERR_INSUFFICIENT_PERMISSIONS",
    0x1E: "NV_ERR_INVALID_ADDRESS", 0x1F: "NV_ERR_INVALID_ARGUMENT",
    0x26: "NV_ERR_INVALID_DEVICE", 0x40: "NV_ERR_INVALID_STATE", 0x51: "NV_ERR_NO_MEMORY",
    0x56: "NV_ERR_NOT_SUPPORTED", 0x59: "NV_ERR_OPERATING_SYSTEM", 0xFFFF: "NV_ERR_GENERIC",
}

# --------------------------------------------------------------------------------------
# ctypes layouts

# NvProcessorUuid, the INIT_EVENT_TRACKER / SET_NOTIFICATION_THRESHOLD / ENABLE_EVENTS
# params, ControlData and FatalFaultInfoV2 are gpuos.faults.uvm_tools's (imported above)
S32 = ctypes.c_int32
UuidTableParams = _struct("UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_PARAMS", [  # uvm_ioctl.h:914-918
    ("tablePtr", U64), ("rmStatus", U32)])
FlushEventsParams = _struct("UVM_TOOLS_FLUSH_EVENTS_PARAMS", [("rmStatus", U32)])  # uvm_ioctl.h:949-952

# ---- event payloads, v1 (UvmEventEntry) -------------------------------------------
CpuFaultInfo = _struct("UvmEventCpuFaultInfo", [  # uvm_types.h:339-359 (v1 and v2)
    ("eventType", U8), ("accessType", U8), ("padding16Bits", U16), ("cpuId", U32),
    ("address", U64), ("timeStamp", U64), ("pid", U32), ("threadId", U32), ("pc", U64)])
MigrationInfoLite = _struct("UvmEventMigrationInfo_Lite", [  # uvm_types.h:373-405
    ("eventType", U8), ("direction", U8), ("srcIndex", U8), ("dstIndex", U8),
    ("padding32Bits", U32), ("address", U64), ("migratedBytes", U64),
    ("beginTimeStamp", U64), ("endTimeStamp", U64), ("streamId", U64)])
MigrationInfo = _struct("UvmEventMigrationInfo", [  # uvm_types.h:481-519
    ("eventType", U8), ("migrationCause", U8), ("srcIndex", U8), ("dstIndex", U8),
    ("padding32Bits", U32), ("address", U64), ("migratedBytes", U64),
    ("beginTimeStamp", U64), ("endTimeStamp", U64), ("rangeGroupId", U64),
    ("beginTimeStampGpu", U64), ("endTimeStampGpu", U64)])
GpuFaultInfo = _struct("UvmEventGpuFaultInfo", [  # uvm_types.h:577-627
    ("eventType", U8), ("faultType", U8), ("accessType", U8), ("gpuIndex", U8),
    ("gpcIdOrChannelId", U16), ("clientId", U16), ("address", U64), ("timeStamp", U64),
    ("timeStampGpu", U64), ("batchId", U32), ("clientType", U8), ("padding8Bits", U8),
    ("padding16Bits", U16)])
GpuFaultReplayInfo = _struct("UvmEventGpuFaultReplayInfo", [  # uvm_types.h:688-710
    ("eventType", U8), ("gpuIndex", U8), ("clientType", U8), ("padding8bits", U8),
    ("batchId", U32), ("timeStamp", U64), ("timeStampGpu", U64)])
FatalFaultInfo = _struct("UvmEventFatalFaultInfo", [  # uvm_types.h:733-751
    ("eventType", U8), ("faultType", U8), ("accessType", U8), ("processorIndex", U8),
    ("reason", U8), ("padding8bits", U8), ("padding16bits", U16), ("address", U64),
    ("timeStamp", U64)])
ReadDuplicateInfo = _struct("UvmEventReadDuplicateInfo", [  # uvm_types.h:772-799
    ("eventType", U8), ("padding8bits", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("processors", U64), ("address", U64), ("size", U64), ("timeStamp", U64)])
ReadDuplicateInvalidateInfo = _struct("UvmEventReadDuplicateInvalidateInfo", [  # uvm_types.h:832-858
    ("eventType", U8), ("residentIndex", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("address", U64), ("size", U64), ("timeStamp", U64)])
PageSizeChangeInfo = _struct("UvmEventPageSizeChangeInfo", [  # uvm_types.h:887-908
    ("eventType", U8), ("processorIndex", U8), ("padding16bits", U16), ("size", U32),
    ("address", U64), ("timeStamp", U64)])
ThrashingDetectedInfo = _struct("UvmEventThrashingDetectedInfo", [  # uvm_types.h:933-955
    ("eventType", U8), ("padding8bits", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("processors", U64), ("address", U64), ("size", U64), ("timeStamp", U64)])
ThrottlingInfo = _struct("UvmEventThrottlingStartInfo", [  # uvm_types.h:983-1002 (End: 1025-1044)
    ("eventType", U8), ("processorIndex", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("address", U64), ("timeStamp", U64)])
MapRemoteInfo = _struct("UvmEventMapRemoteInfo", [  # uvm_types.h:1094-1121
    ("eventType", U8), ("srcIndex", U8), ("dstIndex", U8), ("mapRemoteCause", U8),
    ("padding32bits", U32), ("address", U64), ("size", U64), ("timeStamp", U64),
    ("timeStampGpu", U64)])
EvictionInfo = _struct("UvmEventEvictionInfo", [  # uvm_types.h:1152-1176
    ("eventType", U8), ("srcIndex", U8), ("dstIndex", U8), ("padding8bits", U8),
    ("padding32bits", U32), ("addressOut", U64), ("addressIn", U64), ("size", U64),
    ("timeStamp", U64)])
TestAccessCounterInfo = _struct("UvmEventTestAccessCounterInfo", [  # uvm_types.h:1228-1259
    ("eventType", U8), ("srcIndex", U8), ("aperture", U8), ("instancePtrAperture", U8),
    ("padding8bits", U8), ("veId", U8), ("padding16bits", U16), ("value", U32),
    ("subGranularity", U32), ("tag", U32), ("bank", U32), ("address", U64),
    ("instancePtr", U64)])
TestSplitInvalidateInfo = _struct("UvmEventTestSplitInvalidateInfo", [("eventType", U8)])  # uvm_types.h:1293-1296

# ---- event payloads, v2 (UvmEventEntry_V2) ----------------------------------------
UVM_PROCESSOR_MASK_SIZE = (UVM_ID_MAX_PROCESSORS + 63) // 64  # uvm_types.h:67 -> 5
MigrationInfoV2 = _struct("UvmEventMigrationInfo_V2", [  # uvm_types.h:521-561
    ("eventType", U8), ("migrationCause", U8), ("padding16Bits", U16), ("srcIndex", U16),
    ("dstIndex", U16), ("srcNid", S32), ("dstNid", S32), ("address", U64),
    ("migratedBytes", U64), ("beginTimeStamp", U64), ("endTimeStamp", U64),
    ("rangeGroupId", U64), ("beginTimeStampGpu", U64), ("endTimeStampGpu", U64)])
GpuFaultInfoV2 = _struct("UvmEventGpuFaultInfo_V2", [  # uvm_types.h:629-677
    ("eventType", U8), ("faultType", U8), ("gpuIndex", U16), ("gpcIdOrChannelId", U16),
    ("clientId", U16), ("address", U64), ("timeStamp", U64), ("timeStampGpu", U64),
    ("batchId", U32), ("clientType", U8), ("accessType", U8), ("padding16bits", U16)])
GpuFaultReplayInfoV2 = _struct("UvmEventGpuFaultReplayInfo_V2", [  # uvm_types.h:712-728
    ("eventType", U8), ("clientType", U8), ("gpuIndex", U16), ("batchId", U32),
    ("timeStamp", U64), ("timeStampGpu", U64)])
ReadDuplicateInfoV2 = _struct("UvmEventReadDuplicateInfo_V2", [  # uvm_types.h:801-830
    ("eventType", U8), ("padding8bits", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("address", U64), ("size", U64), ("timeStamp", U64),
    ("processors", U64 * UVM_PROCESSOR_MASK_SIZE)])
ReadDuplicateInvalidateInfoV2 = _struct("UvmEventReadDuplicateInvalidateInfo_V2", [  # uvm_types.h:860-885
    ("eventType", U8), ("padding8bits", U8), ("residentIndex", U16), ("padding32bits", U32),
    ("address", U64), ("size", U64), ("timeStamp", U64)])
PageSizeChangeInfoV2 = _struct("UvmEventPageSizeChangeInfo_V2", [  # uvm_types.h:910-931
    ("eventType", U8), ("padding8bits", U8), ("processorIndex", U16), ("size", U32),
    ("address", U64), ("timeStamp", U64)])
ThrashingDetectedInfoV2 = _struct("UvmEventThrashingDetectedInfo_V2", [  # uvm_types.h:957-981
    ("eventType", U8), ("padding8bits", U8), ("padding16bits", U16), ("padding32bits", U32),
    ("address", U64), ("size", U64), ("timeStamp", U64),
    ("processors", U64 * UVM_PROCESSOR_MASK_SIZE)])
ThrottlingInfoV2 = _struct("UvmEventThrottlingStartInfo_V2", [  # uvm_types.h:1004-1023 (End: 1046-1065)
    ("eventType", U8), ("padding8bits", U8), ("processorIndex", U16), ("padding32bits", U32),
    ("address", U64), ("timeStamp", U64)])
MapRemoteInfoV2 = _struct("UvmEventMapRemoteInfo_V2", [  # uvm_types.h:1123-1150
    ("eventType", U8), ("mapRemoteCause", U8), ("padding16bits", U16), ("srcIndex", U16),
    ("dstIndex", U16), ("address", U64), ("size", U64), ("timeStamp", U64),
    ("timeStampGpu", U64)])
EvictionInfoV2 = _struct("UvmEventEvictionInfo_V2", [  # uvm_types.h:1178-1202
    ("eventType", U8), ("padding8bits", U8), ("padding16bits", U16), ("srcIndex", U16),
    ("dstIndex", U16), ("addressOut", U64), ("addressIn", U64), ("size", U64),
    ("timeStamp", U64)])
TestAccessCounterInfoV2 = _struct("UvmEventTestAccessCounterInfo_V2", [  # uvm_types.h:1261-1291
    ("eventType", U8), ("aperture", U8), ("instancePtrAperture", U8), ("veId", U8),
    ("padding16bits", U16), ("srcIndex", U16), ("value", U32), ("subGranularity", U32),
    ("tag", U32), ("bank", U32), ("padding32bits", U32), ("address", U64),
    ("instancePtr", U64)])


def _union(name, members):
    return type(name, (ctypes.Union,), {"_fields_": members})


EventDataV1 = _union("UvmEventEntry_eventData", [
    ("eventType", U8), ("migration_Lite", MigrationInfoLite), ("cpuFault", CpuFaultInfo),
    ("migration", MigrationInfo), ("gpuFault", GpuFaultInfo), ("gpuFaultReplay", GpuFaultReplayInfo),
    ("fatalFault", FatalFaultInfo), ("readDuplicate", ReadDuplicateInfo),
    ("readDuplicateInvalidate", ReadDuplicateInvalidateInfo), ("pageSizeChange", PageSizeChangeInfo),
    ("thrashing", ThrashingDetectedInfo), ("throttlingStart", ThrottlingInfo),
    ("throttlingEnd", ThrottlingInfo), ("mapRemote", MapRemoteInfo), ("eviction", EvictionInfo)])
TestEventDataV1 = _union("UvmEventEntry_testEventData", [
    ("eventType", U8), ("accessCounter", TestAccessCounterInfo), ("splitInvalidate", TestSplitInvalidateInfo)])
UvmEventEntry = _union("UvmEventEntry", [("eventData", EventDataV1), ("testEventData", TestEventDataV1)])

EventDataV2 = _union("UvmEventEntry_V2_eventData", [
    ("eventType", U8), ("migration_Lite", MigrationInfoLite), ("cpuFault", CpuFaultInfo),
    ("migration", MigrationInfoV2), ("gpuFault", GpuFaultInfoV2), ("gpuFaultReplay", GpuFaultReplayInfoV2),
    ("fatalFault", FatalFaultInfoV2), ("readDuplicate", ReadDuplicateInfoV2),
    ("readDuplicateInvalidate", ReadDuplicateInvalidateInfoV2), ("pageSizeChange", PageSizeChangeInfoV2),
    ("thrashing", ThrashingDetectedInfoV2), ("throttlingStart", ThrottlingInfoV2),
    ("throttlingEnd", ThrottlingInfoV2), ("mapRemote", MapRemoteInfoV2), ("eviction", EvictionInfoV2)])
TestEventDataV2 = _union("UvmEventEntry_V2_testEventData", [
    ("eventType", U8), ("accessCounter", TestAccessCounterInfoV2), ("splitInvalidate", TestSplitInvalidateInfo)])
UvmEventEntryV2 = _union("UvmEventEntry_V2", [("eventData", EventDataV2), ("testEventData", TestEventDataV2)])

# event type -> payload struct, per queue version
PAYLOADS = {
    1: {1: CpuFaultInfo, 2: MigrationInfo, 3: GpuFaultInfo, 4: GpuFaultReplayInfo, 6: FatalFaultInfo,
        7: ReadDuplicateInfo, 8: ReadDuplicateInvalidateInfo, 9: PageSizeChangeInfo,
        10: ThrashingDetectedInfo, 11: ThrottlingInfo, 12: ThrottlingInfo, 13: MapRemoteInfo,
        14: EvictionInfo, 63: TestAccessCounterInfo},
    2: {1: CpuFaultInfo, 2: MigrationInfoV2, 3: GpuFaultInfoV2, 4: GpuFaultReplayInfoV2, 6: FatalFaultInfoV2,
        7: ReadDuplicateInfoV2, 8: ReadDuplicateInvalidateInfoV2, 9: PageSizeChangeInfoV2,
        10: ThrashingDetectedInfoV2, 11: ThrottlingInfoV2, 12: ThrottlingInfoV2, 13: MapRemoteInfoV2,
        14: EvictionInfoV2, 63: TestAccessCounterInfoV2},
}
ENTRY_TYPES = {1: UvmEventEntry, 2: UvmEventEntryV2}
INIT_IOCTL = {1: UVM_TOOLS_INIT_EVENT_TRACKER, 2: UVM_TOOLS_INIT_EVENT_TRACKER_V2}

# Sizes gcc gives for the 580.142 headers (x86_64), with where each type is declared.
EXPECTED_SIZES = [
    (NvProcessorUuid, 16, "common/inc/nvCpuUuid.h:29-40"),
    (InitEventTrackerParams, 56, "nvidia-uvm/uvm_ioctl.h:823-832"),
    (SetThresholdParams, 8, "nvidia-uvm/uvm_ioctl.h:838-842"),
    (EnableEventsParams, 16, "nvidia-uvm/uvm_ioctl.h:848-852"),
    (UuidTableParams, 16, "nvidia-uvm/uvm_ioctl.h:914-918"),
    (FlushEventsParams, 4, "nvidia-uvm/uvm_ioctl.h:949-952"),
    (ControlData, 528, "nvidia-uvm/uvm_types.h:1401-1412"),
    (UvmEventEntry, 64, "nvidia-uvm/uvm_types.h:1302-1334"),
    (UvmEventEntryV2, 72, "nvidia-uvm/uvm_types.h:1336-1368"),
    (CpuFaultInfo, 40, "nvidia-uvm/uvm_types.h:339-359"),
    (MigrationInfoLite, 48, "nvidia-uvm/uvm_types.h:373-405"),
    (MigrationInfo, 64, "nvidia-uvm/uvm_types.h:481-519"),
    (MigrationInfoV2, 72, "nvidia-uvm/uvm_types.h:521-561"),
    (GpuFaultInfo, 40, "nvidia-uvm/uvm_types.h:577-627"),
    (GpuFaultInfoV2, 40, "nvidia-uvm/uvm_types.h:629-677"),
    (GpuFaultReplayInfo, 24, "nvidia-uvm/uvm_types.h:688-710"),
    (GpuFaultReplayInfoV2, 24, "nvidia-uvm/uvm_types.h:712-728"),
    (FatalFaultInfo, 24, "nvidia-uvm/uvm_types.h:733-751"),
    (FatalFaultInfoV2, 24, "nvidia-uvm/uvm_types.h:753-770"),
    (ReadDuplicateInfo, 40, "nvidia-uvm/uvm_types.h:772-799"),
    (ReadDuplicateInfoV2, 72, "nvidia-uvm/uvm_types.h:801-830"),
    (ReadDuplicateInvalidateInfo, 32, "nvidia-uvm/uvm_types.h:832-858"),
    (ReadDuplicateInvalidateInfoV2, 32, "nvidia-uvm/uvm_types.h:860-885"),
    (PageSizeChangeInfo, 24, "nvidia-uvm/uvm_types.h:887-908"),
    (PageSizeChangeInfoV2, 24, "nvidia-uvm/uvm_types.h:910-931"),
    (ThrashingDetectedInfo, 40, "nvidia-uvm/uvm_types.h:933-955"),
    (ThrashingDetectedInfoV2, 72, "nvidia-uvm/uvm_types.h:957-981"),
    (ThrottlingInfo, 24, "nvidia-uvm/uvm_types.h:983-1002"),
    (ThrottlingInfoV2, 24, "nvidia-uvm/uvm_types.h:1004-1023"),
    (MapRemoteInfo, 40, "nvidia-uvm/uvm_types.h:1094-1121"),
    (MapRemoteInfoV2, 40, "nvidia-uvm/uvm_types.h:1123-1150"),
    (EvictionInfo, 40, "nvidia-uvm/uvm_types.h:1152-1176"),
    (EvictionInfoV2, 40, "nvidia-uvm/uvm_types.h:1178-1202"),
    (TestAccessCounterInfo, 40, "nvidia-uvm/uvm_types.h:1228-1259"),
    (TestAccessCounterInfoV2, 48, "nvidia-uvm/uvm_types.h:1261-1291"),
]
# Field offsets the decoder relies on (gcc, same headers).
EXPECTED_OFFSETS = [
    (InitEventTrackerParams, "queueBufferSize", 8), (InitEventTrackerParams, "controlBuffer", 16),
    (InitEventTrackerParams, "processor", 24), (InitEventTrackerParams, "allProcessors", 40),
    (InitEventTrackerParams, "uvmFd", 44), (InitEventTrackerParams, "rmStatus", 48),
    (EnableEventsParams, "rmStatus", 8), (ControlData, "put_behind", 12), (ControlData, "dropped", 16),
    (GpuFaultInfo, "gpuIndex", 3), (GpuFaultInfo, "gpcIdOrChannelId", 4), (GpuFaultInfo, "clientId", 6),
    (GpuFaultInfo, "address", 8), (GpuFaultInfo, "timeStampGpu", 24), (GpuFaultInfo, "batchId", 32),
    (GpuFaultInfo, "clientType", 36),
    (GpuFaultInfoV2, "gpuIndex", 2), (GpuFaultInfoV2, "gpcIdOrChannelId", 4), (GpuFaultInfoV2, "clientId", 6),
    (GpuFaultInfoV2, "address", 8), (GpuFaultInfoV2, "timeStamp", 16), (GpuFaultInfoV2, "timeStampGpu", 24),
    (GpuFaultInfoV2, "batchId", 32), (GpuFaultInfoV2, "clientType", 36), (GpuFaultInfoV2, "accessType", 37),
    (GpuFaultReplayInfoV2, "batchId", 4), (GpuFaultReplayInfoV2, "timeStamp", 8),
    (FatalFaultInfo, "processorIndex", 3), (FatalFaultInfo, "reason", 4), (FatalFaultInfo, "address", 8),
    (FatalFaultInfoV2, "processorIndex", 4), (FatalFaultInfoV2, "address", 8), (FatalFaultInfoV2, "timeStamp", 16),
]

PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------
# Small helpers

def nv_status(code: int) -> str:
    return f"{NV_STATUS_NAMES.get(code, 'NV_STATUS')} (0x{code:x})"


def fmt_uuid(b: bytes) -> str:
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def now_raw() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)


class Log:
    """Steps, printed one line each (stderr) and kept for the JSON."""

    def __init__(self, quiet: bool = False):
        self.steps: list[dict] = []
        self.quiet = quiet

    def step(self, name: str, ok: bool, detail: str = "", **extra) -> dict:
        rec = {"step": name, "ok": ok, "detail": detail, "t_raw_ns": now_raw(), **extra}
        self.steps.append(rec)
        if not self.quiet:
            print(f"uvm_tools_probe: {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
                  file=sys.stderr, flush=True)
        return rec


def oserr(e: OSError) -> dict:
    return {"errno": e.errno, "errno_name": errno.errorcode.get(e.errno or 0, "?"), "strerror": e.strerror}


def read_text(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return None


# --------------------------------------------------------------------------------------
# Decoding

def decode_entry(raw: bytes, version: int) -> dict:
    etype = raw[0]
    ev = {"type": etype, "type_name": EVENT_TYPES.get(etype, "unknown")}
    cls = PAYLOADS[version].get(etype)
    if cls is None:
        ev["raw_hex"] = raw.hex()
        return ev
    s = cls.from_buffer_copy(raw[:ctypes.sizeof(cls)])
    for name, _t in cls._fields_:
        if name.startswith("padding") or name == "eventType":
            continue
        v = getattr(s, name)
        if isinstance(v, ctypes.Array):
            v = list(v)
        ev[name] = v
    for k in ("address", "addressIn", "addressOut", "instancePtr"):
        if k in ev:
            ev[k + "_hex"] = hex(ev[k])
    if "faultType" in ev:
        ev["faultType_name"] = FAULT_TYPES.get(ev["faultType"], "?")
    if "accessType" in ev:
        ev["accessType_name"] = ACCESS_TYPES.get(ev["accessType"], "?")
    if "reason" in ev:
        ev["reason_name"] = FATAL_REASONS.get(ev["reason"], "?")
    if "clientType" in ev:
        ev["clientType_name"] = CLIENT_TYPES.get(ev["clientType"], "?")
    if "migrationCause" in ev:
        ev["migrationCause_name"] = MIGRATION_CAUSES.get(ev["migrationCause"], "?")
    if etype == 3:
        # uvm_tools.c:789-792 / 811-814: gpcId if replayable, channelId otherwise;
        # clientType GPC means replayable (uvm_types.h:615-618).
        gc = ev.pop("gpcIdOrChannelId")
        if ev.get("clientType") == 1:
            ev["gpcId"] = gc
        else:
            ev["channelId"] = gc
    if etype == 4:
        ev["note"] = "broadcast to every VA space with tools enabled: not attributable"
    return ev


# --------------------------------------------------------------------------------------
# The queue

class Queue(SharedQueue):
    """gpuos's tracker queue, with the driver's drop counts."""

    def dropped(self) -> dict:
        return {EVENT_TYPES.get(i, str(i)): int(n) for i, n in enumerate(self.ctrl.dropped) if n}


# --------------------------------------------------------------------------------------
# The probe

class Probe:
    def __init__(self, args, log: Log):
        self.args = args
        self.log = log
        self.sys = None
        self.targets: dict[int, dict] = {}   # pid -> info (pidfd, comm, ...)
        self.files: list[dict] = []          # distinct uvm files: {"fd", "holders", ...}
        self.trackers: list[dict] = []
        self.events: list[dict] = []
        self.tools_path = "/dev/nvidia-uvm-tools"
        self._tmpnode = None

    # ---- environment -------------------------------------------------------------
    def environment(self) -> dict:
        env = {
            "uname": " ".join(os.uname()),
            "euid": os.geteuid(),
            "python": sys.version.split()[0],
            "nvidia_version": (read_text("/proc/driver/nvidia/version") or "").strip() or None,
            "nvidia_uvm_version": (read_text("/sys/module/nvidia_uvm/version") or "").strip() or None,
            "nvidia_uvm_major": uvm_major(),
            "uvm_params": {},
            "clock": {"monotonic_raw_ns": now_raw(), "monotonic_ns": time.monotonic_ns(),
                      "realtime_ns": time.time_ns()},
        }
        pdir = "/sys/module/nvidia_uvm/parameters"
        for p in ("uvm_enable_builtin_tests", "uvm_perf_fault_replay_policy", "uvm_enable_va_space_mm",
                  "uvm_disable_hmm", "uvm_perf_fault_batch_count"):
            v = read_text(os.path.join(pdir, p))
            if v is not None:
                env["uvm_params"][p] = v.strip()
        return env

    def check_env(self) -> bool:
        ok = True
        if platform.system() != "Linux":
            self.log.step("platform", False, f"{platform.system()}: Linux only")
            return False
        try:
            self.sys = Sys()
            self.log.step("platform", True, f"{platform.machine()}, syscalls {self.sys.nr}")
        except OSError as e:
            self.log.step("platform", False, str(e))
            return False
        if os.geteuid() != 0:
            # Not fatal: pidfd_getfd may still work on one's own processes (ptrace rules).
            self.log.step("root", False, f"euid {os.geteuid()}: pidfd_getfd needs ptrace rights over the "
                                         "target (run as root); trying anyway")
        return ok

    # ---- targets -------------------------------------------------------------------
    def find_mps_servers(self) -> list[int]:
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            # comm is cut to 15 characters ("nvidia-cuda-mps" for server and control alike):
            # look at the executable, or argv[0] when the link cannot be read.
            try:
                exe = os.readlink(f"/proc/{d}/exe")
            except OSError:
                exe = (read_text(f"/proc/{d}/cmdline", 256) or "").split("\0")[0]
            if os.path.basename(exe).replace(" (deleted)", "") == "nvidia-cuda-mps-server":
                pids.append(int(d))
        self.log.step("find MPS servers", True, f"{pids or 'none'}")
        return pids

    def collect(self, pids: list[int]) -> None:
        major = uvm_major()
        for pid in pids:
            info = {"pid": pid, "comm": (read_text(f"/proc/{pid}/comm") or "").strip() or None,
                    "cmdline": (read_text(f"/proc/{pid}/cmdline", 400) or "").replace("\0", " ").strip() or None,
                    "pidfd": None, "uvm_fds": [], "exited_raw_ns": None}
            self.targets[pid] = info
            try:
                info["pidfd"] = self.sys.pidfd_open(pid)
            except OSError as e:
                self.log.step(f"pidfd_open {pid}", False, str(e), **oserr(e))
                continue
            self.log.step(f"pidfd_open {pid}", True, f"comm {info['comm']}")
            try:
                fds = sorted(int(x) for x in os.listdir(f"/proc/{pid}/fd"))
            except OSError as e:
                self.log.step(f"list /proc/{pid}/fd", False, str(e), **oserr(e))
                continue
            found = []
            for n in fds:
                path = f"/proc/{pid}/fd/{n}"
                try:
                    target = os.readlink(path)
                except OSError:
                    continue
                is_uvm = target == "/dev/nvidia-uvm"
                try:
                    st = os.stat(path)
                    if stat.S_ISCHR(st.st_mode) and major is not None:
                        is_uvm = (os.major(st.st_rdev) == major and os.minor(st.st_rdev) == NVIDIA_UVM_PRIMARY_MINOR)
                except OSError:
                    pass
                if is_uvm:
                    found.append((n, target))
            if not found:
                self.log.step(f"uvm fds of {pid}", False, "no /dev/nvidia-uvm among its fds (no CUDA context yet, "
                                                        "or not a CUDA process)")
                continue
            self.log.step(f"uvm fds of {pid}", True, ", ".join(str(n) for n, _ in found))
            for n, target in found:
                rec = {"pid": pid, "fd": n, "path": target,
                       "fdinfo": (read_text(f"/proc/{pid}/fdinfo/{n}") or "").strip()}
                info["uvm_fds"].append(rec)
                try:
                    local = self.sys.pidfd_getfd(info["pidfd"], n)
                except OSError as e:
                    self.log.step(f"pidfd_getfd {pid}:{n}", False, str(e), **oserr(e))
                    continue
                self.log.step(f"pidfd_getfd {pid}:{n}", True, f"local fd {local}")
                rec["same_file_as"] = self._merge(local, pid, n)

    def _merge(self, local: int, pid: int, fd: int) -> dict | None:
        """Keep local if it is a new struct file; else close it and return the first holder."""
        for f in self.files:
            try:
                same = self.sys.same_file(f["fd"], local)
            except OSError as e:
                self.log.step("kcmp", False, f"{e} (files not merged: trackers may repeat)", **oserr(e))
                same = False
            if same:
                f["holders"].append({"pid": pid, "fd": fd})
                os.close(local)
                self.log.step(f"kcmp {pid}:{fd}", True, f"same struct file as {f['holders'][0]}")
                return f["holders"][0]
        self.files.append({"fd": local, "holders": [{"pid": pid, "fd": fd}]})
        return None

    # ---- trackers -------------------------------------------------------------------
    def open_tools(self) -> int | None:
        try:
            fd = os.open(self.tools_path, os.O_RDWR | os.O_CLOEXEC)
            return fd
        except OSError as e:
            if e.errno == errno.ENOENT and self.args.mknod:
                return self._open_private_node()
            self.log.step("open /dev/nvidia-uvm-tools", False,
                          f"{e}" + (" (try --mknod)" if e.errno == errno.ENOENT else ""), **oserr(e))
            return None

    def _open_private_node(self) -> int | None:
        major = uvm_major()
        if major is None:
            self.log.step("mknod nvidia-uvm-tools", False, "nvidia-uvm not in /proc/devices")
            return None
        d = f"/tmp/uvm_tools_probe.{os.getpid()}"
        path = os.path.join(d, "nvidia-uvm-tools")
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            if not os.path.exists(path):
                os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, NVIDIA_UVM_TOOLS_MINOR))
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            self.log.step("mknod nvidia-uvm-tools", False, str(e), **oserr(e))
            return None
        self._tmpnode = (d, path)
        self.tools_path = path
        self.log.step("mknod nvidia-uvm-tools", True, f"{path} ({major}:{NVIDIA_UVM_TOOLS_MINOR})")
        return fd

    def attach(self, f: dict, mask: int) -> None:
        label = "+".join(f"{h['pid']}:{h['fd']}" for h in f["holders"])
        tr = {"file": label, "holders": f["holders"], "ok": False, "queue_version": None, "events": 0}
        self.trackers.append(tr)
        tools_fd = self.open_tools()
        if tools_fd is None:
            tr["error"] = "cannot open /dev/nvidia-uvm-tools"
            return
        self.log.step(f"open tools [{label}]", True, f"{self.tools_path} fd {tools_fd}")
        versions = [self.args.queue_version] if self.args.no_fallback else \
            [self.args.queue_version] + [v for v in (2, 1) if v != self.args.queue_version]
        q = None
        for v in versions:
            q = Queue(self.args.queue_entries, v)
            p = InitEventTrackerParams(queueBuffer=q.qaddr, queueBufferSize=q.entries,
                                       controlBuffer=q.caddr, allProcessors=0, uvmFd=f["fd"])
            name = f"INIT_EVENT_TRACKER{'_V2' if v == 2 else ''} [{label}]"
            try:
                r = ioctl_struct(tools_fd, INIT_IOCTL[v], p)
            except OSError as e:
                self.log.step(name, False, f"ioctl: {e}", **oserr(e))
                q.close()
                q = None
                if e.errno in (errno.EINVAL, errno.ENOTTY):
                    continue   # unknown command: an older driver without the v2 ioctl
                break
            if r.rmStatus != 0:
                why = {0x1B: "the fd is not a /dev/nvidia-uvm file in this process",
                       0x16: "the uvm file is not an initialized VA space (UVM_FD_MM, or not UVM_INITIALIZEd)",
                       0x1F: "queue size / buffer rejected"}.get(r.rmStatus, "")
                self.log.step(name, False, f"{nv_status(r.rmStatus)}{': ' + why if why else ''}",
                              rmStatus=r.rmStatus)
                q.close()
                q = None
                break
            self.log.step(name, True, f"{q.entries} entries x {q.entry_size} B, queue 0x{q.qaddr:x}, "
                                      f"control 0x{q.caddr:x}")
            tr["queue_version"] = v
            break
        if q is None:
            os.close(tools_fd)
            tr["error"] = "tracker not created"
            return
        tr["tools_fd"], tr["queue"] = tools_fd, q
        # Wake at every event (the default is half the queue, uvm_tools.c:2072).
        try:
            r = ioctl_struct(tools_fd, UVM_TOOLS_SET_NOTIFICATION_THRESHOLD, SetThresholdParams(notificationThreshold=1))
            self.log.step(f"SET_NOTIFICATION_THRESHOLD 1 [{label}]", r.rmStatus == 0, nv_status(r.rmStatus))
        except OSError as e:
            self.log.step(f"SET_NOTIFICATION_THRESHOLD 1 [{label}]", False, f"ioctl: {e} (polling anyway)", **oserr(e))
        try:
            r = ioctl_struct(tools_fd, UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS, EnableEventsParams(eventTypeFlags=mask))
        except OSError as e:
            self.log.step(f"ENABLE_EVENTS 0x{mask:x} [{label}]", False, f"ioctl: {e}", **oserr(e))
            tr["error"] = "events not enabled"
            return
        if r.rmStatus != 0:
            self.log.step(f"ENABLE_EVENTS 0x{mask:x} [{label}]", False, nv_status(r.rmStatus), rmStatus=r.rmStatus)
            tr["error"] = "events not enabled"
            return
        self.log.step(f"ENABLE_EVENTS 0x{mask:x} [{label}]", True,
                      ",".join(EVENT_TYPES[i] for i in range(64) if mask >> i & 1))
        tr["ok"] = True
        tr["enabled_at_raw_ns"] = now_raw()
        if not self.args.no_target_ioctls:
            tr["processors"] = self.uuid_table(f["fd"], label, tr["queue_version"])

    def uuid_table(self, uvm_fd: int, label: str, version: int) -> dict | None:
        """Read-only ioctl on the target's uvm file: processor index (as the events of a queue
        of this version give it) -> UUID (uvm_tools.c:2664-2723). v2: uvm_id_value, 257
        entries; v1: parent GPU index, 33 entries."""
        count = UVM_ID_MAX_PROCESSORS if version == 2 else UVM_MAX_PROCESSORS_V1
        req = UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2 if version == 2 else UVM_TOOLS_GET_PROCESSOR_UUID_TABLE
        name = f"GET_PROCESSOR_UUID_TABLE{'_V2' if version == 2 else ''} [{label}]"
        table = ctypes.create_string_buffer(16 * count)
        p = UuidTableParams(tablePtr=ctypes.addressof(table))
        try:
            r = ioctl_struct(uvm_fd, req, p)
        except OSError as e:
            self.log.step(name, False, f"ioctl: {e}", **oserr(e))
            return None
        if r.rmStatus != 0:
            self.log.step(name, False, nv_status(r.rmStatus))
            return None
        raw = table.raw
        out = {}
        for i in range(count):
            b = raw[16 * i:16 * i + 16]
            if any(b):
                out[str(i)] = "cpu" if i == 0 else fmt_uuid(b)
        self.log.step(name, True,
                      f"{len(out) - ('0' in out)} GPU(s) registered in this VA space: "
                      + ", ".join(f"{k}={v}" for k, v in out.items() if k != "0"))
        return out

    # ---- polling -------------------------------------------------------------------
    def poll(self, seconds: float) -> None:
        live = [t for t in self.trackers if t["ok"]]
        poller = select.poll()
        by_fd = {}
        for t in live:
            poller.register(t["tools_fd"], select.POLLIN)
            by_fd[t["tools_fd"]] = ("tracker", t)
        for pid, info in self.targets.items():
            if info["pidfd"] is not None:
                poller.register(info["pidfd"], select.POLLIN)
                by_fd[info["pidfd"]] = ("pid", info)
        watched = [i for i in self.targets.values() if i["pidfd"] is not None]
        self.log.step("poll", True, f"{len(live)} tracker(s), {seconds:g} s; Ctrl-C ends early")
        deadline = time.monotonic() + seconds
        stop = {"flag": False}
        old = signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
        try:
            while not stop["flag"]:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    ready = poller.poll(min(left, 0.2) * 1000)
                except InterruptedError:
                    ready = []
                for fd, ev in ready:
                    kind, obj = by_fd[fd]
                    if kind == "pid" and obj["exited_raw_ns"] is None:
                        obj["exited_raw_ns"] = now_raw()
                        self.log.step(f"target {obj['pid']} exited", True, "")
                        poller.unregister(fd)
                    elif kind == "tracker" and ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                        pass  # POLLERR: tracker not a queue or driver in error; drained below anyway
                for t in live:
                    self.drain(t)
                if watched and all(i["exited_raw_ns"] is not None for i in watched):
                    time.sleep(0.2)
                    self.log.step("poll", True, "every target exited: stopping (releases their VA spaces)")
                    break
        finally:
            signal.signal(signal.SIGINT, old)
        for t in live:
            self.drain(t)

    def drain(self, t: dict) -> None:
        q: Queue = t["queue"]
        if not q.pending():
            return
        seen = now_raw()
        for raw in q.drain():
            ev = decode_entry(raw, q.version)
            ev["tracker"] = t["file"]
            ev["holder_pids"] = sorted({h["pid"] for h in t["holders"]})
            ev["read_raw_ns"] = seen
            if "timeStamp" in ev:
                ev["latency_ns"] = seen - ev["timeStamp"]
            if ev["type"] not in PAYLOADS[q.version] or self.args.raw:
                ev["raw_hex"] = raw.hex()
            t["events"] += 1
            self.events.append(ev)
            self.print_event(ev)

    def print_event(self, ev: dict) -> None:
        if self.args.quiet or len(self.events) > 200:
            if len(self.events) == 201 and not self.args.quiet:
                print("uvm_tools_probe: more events: see the JSON", file=sys.stderr, flush=True)
            return
        bits = [f"[{ev['tracker']}]", ev["type_name"]]
        for k in ("faultType_name", "accessType_name", "reason_name", "clientType_name"):
            if k in ev:
                bits.append(f"{k[:-5]}={ev[k]}")
        for k in ("address_hex", "gpuIndex", "processorIndex", "gpcId", "channelId", "clientId", "batchId"):
            if k in ev:
                bits.append(f"{k}={ev[k]}")
        print("uvm_tools_probe: event " + " ".join(str(b) for b in bits), file=sys.stderr, flush=True)

    # ---- teardown ------------------------------------------------------------------
    def close(self) -> None:
        for t in self.trackers:
            q = t.pop("queue", None)
            if q is not None:
                t["dropped"] = q.dropped()
                if t["dropped"]:
                    self.log.step(f"dropped [{t['file']}]", False, json.dumps(t["dropped"]))
            fd = t.pop("tools_fd", None)
            if fd is not None:
                os.close(fd)       # destroy_event_tracker: unpins, fput(uvm file)
            if q is not None:
                q.close()
        for f in self.files:
            try:
                os.close(f["fd"])
            except OSError:
                pass
        for info in self.targets.values():
            if info["pidfd"] is not None:
                os.close(info["pidfd"])
                info["pidfd"] = None
        if self._tmpnode:
            d, path = self._tmpnode
            for fn in (lambda: os.unlink(path), lambda: os.rmdir(d)):
                try:
                    fn()
                except OSError:
                    pass


def event_mask(spec: str) -> int:
    mask = 0
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if name == "all":
            mask |= sum(1 << i for i in range(1, UVM_EVENT_NUM_TYPES))
        elif name in EVENT_BY_NAME:
            mask |= 1 << EVENT_BY_NAME[name]
        else:
            raise ValueError(f"unknown event {name!r}; known: all, {', '.join(sorted(EVENT_BY_NAME))}")
    if not mask:
        raise ValueError("no events")
    return mask


def summarize(probe: Probe) -> dict:
    by_tracker = {}
    for ev in probe.events:
        d = by_tracker.setdefault(ev["tracker"], {})
        d[ev["type_name"]] = d.get(ev["type_name"], 0) + 1
    attributable = sorted({ev["tracker"] for ev in probe.events if ev["type"] in (3, 6)})
    return {"events_by_tracker": by_tracker,
            "trackers_with_gpu_or_fatal_fault": attributable,
            "pids_named": sorted({p for ev in probe.events if ev["type"] in (3, 6) for p in ev["holder_pids"]})}


def run(args) -> int:
    log = Log(quiet=args.quiet)
    try:
        mask = event_mask(args.events)
    except ValueError as e:
        print(f"uvm_tools_probe: {e}", file=sys.stderr)
        return 2
    if args.queue_entries < 2 or args.queue_entries & (args.queue_entries - 1):
        print("uvm_tools_probe: --queue-entries must be a power of two >= 2 (uvm_tools.c:2074-2078)", file=sys.stderr)
        return 2
    probe = Probe(args, log)
    result = {"tool": "uvm_tools_probe", "argv": sys.argv[1:], "event_mask": hex(mask)}
    rc = 0
    try:
        result["environment"] = probe.environment()
        if not probe.check_env():
            rc = 4
        else:
            pids = list(dict.fromkeys(args.pid or []))
            if args.mps_servers:
                pids += [p for p in probe.find_mps_servers() if p not in pids]
            if not pids:
                log.step("targets", False, "no pid given (--pid) and no MPS server found")
                rc = 2
            else:
                probe.collect(pids)
                if not probe.files:
                    log.step("targets", False, "no /dev/nvidia-uvm file could be taken from any target")
                    rc = 3
                else:
                    if not os.path.exists(probe.tools_path) and not args.mknod:
                        log.step("open /dev/nvidia-uvm-tools", False, "missing (container?): pass --mknod")
                        rc = 4
                    else:
                        for f in probe.files:
                            probe.attach(f, mask)
                        if not any(t["ok"] for t in probe.trackers):
                            log.step("trackers", False, "no tracker could be created")
                            rc = 3 if rc == 0 else rc
                        else:
                            probe.poll(args.seconds)
    except Exception as e:  # one line, never a traceback on the target host
        log.step("unexpected", False, f"{type(e).__name__}: {e}")
        rc = 1
    finally:
        probe.close()
    result["targets"] = [{k: v for k, v in i.items() if k != "pidfd"} for i in probe.targets.values()]
    result["trackers"] = [{k: v for k, v in t.items() if k not in ("queue", "tools_fd")} for t in probe.trackers]
    result["events"] = probe.events
    result["summary"] = summarize(probe)
    result["steps"] = log.steps
    result["exit_status"] = rc
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            log.step("write", True, args.out)
        except OSError as e:
            log.step("write", False, f"{args.out}: {e}")
            print(text)
    else:
        try:
            print(text, flush=True)
        except BrokenPipeError:
            pass
    s = result["summary"]
    if not args.quiet:
        print(f"uvm_tools_probe: {len(probe.events)} event(s); GpuFault/FatalFault in "
              f"{s['trackers_with_gpu_or_fatal_fault'] or 'no tracker'}", file=sys.stderr)
    return rc


# --------------------------------------------------------------------------------------
# Self-test (no driver needed)

def fatal_entry() -> ctypes.Union:
    """A v2 FatalFault entry filled the way uvm_tools.c fills it."""
    e = UvmEventEntryV2()
    f = e.eventData.fatalFault
    f.eventType, f.faultType, f.accessType, f.reason, f.processorIndex = 6, 1, 2, 1, 1
    f.address, f.timeStamp = 0xdead000, 333
    return e


def self_test() -> int:
    fails = []

    def check(cond, what):
        print(f"{'ok  ' if cond else 'FAIL'} {what}")
        if not cond:
            fails.append(what)

    for cls, want, where in EXPECTED_SIZES:
        got = ctypes.sizeof(cls)
        check(got == want, f"sizeof {cls.__name__} = {got}, headers say {want} ({where})")
    for cls, field, want in EXPECTED_OFFSETS:
        got = getattr(cls, field).offset
        check(got == want, f"offsetof {cls.__name__}.{field} = {got}, headers say {want}")
    check(all(ctypes.sizeof(ENTRY_TYPES[v]) == ENTRY_SIZE[v] for v in (1, 2)),
          f"gpuos.faults.uvm_tools's entry sizes {ENTRY_SIZE} are the unions'")
    check(decode_fatal(bytes(fatal_entry()), 7) == FatalFault(7, 0xdead000, "write", "invalid_pde",
                                                            "invalid_address", 333),
          "gpuos.faults.uvm_tools decodes a v2 fatal fault")
    check(ctypes.alignment(UvmEventEntry) == 8 and ctypes.alignment(UvmEventEntryV2) == 8,
          "event entries are 8-byte aligned (uvm_types.h:1299-1300)")
    check(event_mask(DEFAULT_EVENTS) == (1 << 3) | (1 << 4) | (1 << 6), f"default mask {DEFAULT_EVENTS} = 0x58")
    check(event_mask("all") == 0x7ffe, "'all' = bits 1..14 (mask_contains_invalid_events, uvm_tools.c:2233-2268)")

    # Decoding: a v2 GpuFault and FatalFault built the way uvm_tools.c fills them.
    e = UvmEventEntryV2()
    g = e.eventData.gpuFault
    g.eventType, g.faultType, g.gpuIndex, g.gpcIdOrChannelId, g.clientId = 3, 1, 1, 5, 0x2b
    g.address, g.timeStamp, g.timeStampGpu, g.batchId, g.clientType, g.accessType = 0x834e8be00000, 111, 222, 7, 1, 2
    d = decode_entry(bytes(e), 2)
    check(d["type_name"] == "gpu_fault" and d["gpcId"] == 5 and d["clientId"] == 0x2b
          and d["address"] == 0x834e8be00000 and d["accessType_name"] == "write"
          and d["faultType_name"] == "invalid_pde" and "channelId" not in d, "decode v2 gpu_fault (GPC)")
    g.clientType = 2
    d = decode_entry(bytes(e), 2)
    check(d.get("channelId") == 5 and "gpcId" not in d, "decode v2 gpu_fault (HUB: channelId)")
    e = UvmEventEntryV2()
    f = e.eventData.fatalFault
    f.eventType, f.faultType, f.accessType, f.reason, f.processorIndex, f.address, f.timeStamp = 6, 1, 2, 1, 1, 0x1000, 9
    d = decode_entry(bytes(e), 2)
    check(d["type_name"] == "fatal_fault" and d["reason_name"] == "invalid_address" and d["processorIndex"] == 1,
          "decode v2 fatal_fault")
    e1 = UvmEventEntry()
    f1 = e1.eventData.fatalFault
    f1.eventType, f1.processorIndex, f1.reason, f1.address = 6, 1, 2, 0x2000
    d = decode_entry(bytes(e1), 1)
    check(d["processorIndex"] == 1 and d["reason_name"] == "invalid_permissions", "decode v1 fatal_fault")
    d = decode_entry(bytes([99]) + bytes(71), 2)
    check(d["type_name"] == "unknown" and len(d["raw_hex"]) == 144, "unknown type kept as raw hex")

    # The queue protocol against a Python model of enqueue_event (uvm_tools.c:448-499).
    q = Queue(4, 2)

    def enqueue(etype):
        size, mask = q.entries, q.entries - 1
        gb, pb = q.ctrl.get_behind & mask, q.ctrl.put_behind & mask
        if ((size + gb - pb) & mask) == 1:
            q.ctrl.dropped[etype] += 1
            return
        off = pb * q.entry_size
        q.qmap[off:off + q.entry_size] = bytes([etype]) + bytes(q.entry_size - 1)
        q.ctrl.put_ahead = q.ctrl.put_behind = (pb + 1) & mask

    for t in (3, 6, 3, 6, 4):
        enqueue(t)
    got = [r[0] for r in q.drain()]
    check(got == [3, 6, 3] and q.dropped() == {"fatal_fault": 1, "gpu_fault_replay": 1},
          f"queue of 4 keeps 3, drops 2 (got {got}, dropped {q.dropped()})")
    enqueue(6)
    enqueue(3)
    got = [r[0] for r in q.drain()]
    check(got == [6, 3] and q.ctrl.get_ahead == q.ctrl.get_behind == q.ctrl.put_behind, "wrap-around and get pointers")
    check(q.qaddr % PAGE == 0 and q.caddr % PAGE == 0, "queue and control buffers page aligned (map_user_pages)")
    q.close()

    print(f"self-test: {'passed' if not fails else f'{len(fails)} failed'}")
    return 0 if not fails else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="uvm_tools_probe.py",
        description="Bind UVM tools event trackers to other processes' /dev/nvidia-uvm VA spaces and record "
                    "the GPU fault events each receives (stock driver, root). See the header of this file "
                    "and docs/notes-uvm-tools.md.",
        epilog="Exit: 0 ran, 1 self-test failed/unexpected error, 2 usage, 3 no tracker, 4 environment.")
    ap.add_argument("--pid", type=int, action="append", help="target process (repeatable)")
    ap.add_argument("--mps-servers", action="store_true",
                    help="also attach to every nvidia-cuda-mps-server process")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to poll (default 10)")
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    ap.add_argument("--events", default=DEFAULT_EVENTS,
                    help=f"comma list, or 'all' (default {DEFAULT_EVENTS}); known: {', '.join(sorted(EVENT_BY_NAME))}")
    ap.add_argument("--queue-entries", type=int, default=4096, help="entries per queue, power of two (default 4096)")
    ap.add_argument("--queue-version", type=int, choices=(1, 2), default=2,
                    help="2: UVM_TOOLS_INIT_EVENT_TRACKER_V2, 72-byte entries (default); 1: 64-byte entries")
    ap.add_argument("--no-fallback", action="store_true", help="do not try the other queue version on EINVAL")
    ap.add_argument("--no-target-ioctls", action="store_true",
                    help="make no ioctl on the targets' uvm files (skips the read-only UUID table)")
    ap.add_argument("--mknod", action="store_true",
                    help="if /dev/nvidia-uvm-tools is missing, make a private node (nvidia-uvm major, minor 1)")
    ap.add_argument("--raw", action="store_true", help="add raw_hex to every event")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--self-test", action="store_true", help="check struct sizes and the queue logic; no driver")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    if not args.pid and not args.mps_servers:
        ap.error("--pid (or --mps-servers) is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
