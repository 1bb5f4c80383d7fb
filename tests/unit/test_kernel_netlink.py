"""The netlink client's messages: requests round-trip through the nla classes, and events
and replies built by hand byte by byte (as gpuos.ko sends them) decode to the dataclasses.

No gpuos.ko here: the in-guest tests (tests/vm/) drive the same code against the module.
"""

from __future__ import annotations

import errno
import struct

import pytest

pytest.importorskip("pyroute2")

from gpuos.errors import GpuosError, KmodVersionMismatch  # noqa: E402
from gpuos.kernel import netlink as nlk  # noqa: E402
from gpuos.kernel.model import Client, Event, Fault, FaultBatch, Range  # noqa: E402
from gpuos.kernel.uapi import (GENL_VERSION, Attr, Cmd, Decision, EventType,  # noqa: E402
                               FaultAccess, FaultPolicy, FaultType, Op, DEST_GPU,
                               RANGE_EVICT_LAST)

from netlink_wire import (FAMILY, NESTED, event, info_reply, message, nest, nla,  # noqa: E402
                          s32, string, u32, u64, walk)

# -- requests ---------------------------------------------------------------------------


def roundtrip(cmd: Cmd, attrs) -> tuple[bytes, object]:
    data = nlk.encode(nlk.request_msg(cmd, attrs), FAMILY, seq=7, pid=42)
    return data, nlk.decode(data)


def test_get_info_request_is_bare():
    data, msg = roundtrip(Cmd.GET_INFO, [])
    assert len(data) == 20  # nlmsghdr + genlmsghdr, no attributes
    assert struct.unpack_from("=IHHII", data) == (20, FAMILY, 1, 7, 42)
    assert struct.unpack_from("=BBH", data, 16) == (Cmd.GET_INFO, GENL_VERSION, 0)
    assert msg["cmd"] == Cmd.GET_INFO and msg["version"] == GENL_VERSION and msg["attrs"] == []


@pytest.mark.parametrize("client", [Client(pid=1234), Client(cgroup=(1 << 40) + 5)])
def test_set_policy_round_trip(client):
    data, msg = roundtrip(Cmd.SET_POLICY, [*nlk.client_attrs(client),
                                          (Attr.FAULT_POLICY, FaultPolicy.KILL_CLIENT)])
    assert nlk.parse_client(msg) == client
    assert msg.get_attr("GPUOS_A_FAULT_POLICY") == FaultPolicy.KILL_CLIENT
    attrs = list(walk(data, 20, len(data)))
    if client.pid is not None:
        assert attrs[0] == (Attr.CLIENT_PID, struct.pack("=I", 1234))
    else:
        assert attrs[0] == (Attr.CLIENT_CGROUP, struct.pack("=Q", client.cgroup))
    assert attrs[1] == (Attr.FAULT_POLICY, struct.pack("=I", 2))


def test_client_attrs_send_what_they_are_given():
    # the module must refuse these; the client does not stop tests from sending them
    assert nlk.client_attrs(Client()) == []
    assert nlk.client_attrs(Client(pid=1, cgroup=2)) == [(Attr.CLIENT_PID, 1), (Attr.CLIENT_CGROUP, 2)]


def test_migrate_round_trip_and_wire_layout():
    ranges = [Range(0x7F0000000000, 1 << 21, DEST_GPU(3), 7, 0),
              Range(4096, 4096, 0, 0, RANGE_EVICT_LAST)]
    data, msg = roundtrip(Cmd.MIGRATE, nlk.migrate_attrs(0xDEADBEEF00, Op.HINT, ranges))
    assert msg.get_attr("GPUOS_A_AS_ID") == 0xDEADBEEF00
    assert msg.get_attr("GPUOS_A_OP") == Op.HINT
    decoded = [Range(r.get_attr("GPUOS_A_RANGE_BASE"), r.get_attr("GPUOS_A_RANGE_LEN"),
                     r.get_attr("GPUOS_A_RANGE_DEST"), r.get_attr("GPUOS_A_RANGE_PRIO"),
                     r.get_attr("GPUOS_A_RANGE_FLAGS"))
               for r in msg.get_attr("GPUOS_A_RANGES").get_attrs("GPUOS_A_RANGE")]
    assert decoded == ranges
    # strict validation: nested attributes carry NLA_F_NESTED, leaves do not
    top = list(walk(data, 20, len(data)))
    assert [t for t, _ in top] == [Attr.AS_ID, Attr.OP, Attr.RANGES | NESTED]
    inner = list(walk(top[2][1], 0, len(top[2][1])))
    assert [t for t, _ in inner] == [Attr.RANGE | NESTED] * 2
    leaves = list(walk(inner[0][1], 0, len(inner[0][1])))
    assert [t for t, _ in leaves] == [Attr.RANGE_BASE, Attr.RANGE_LEN, Attr.RANGE_DEST,
                                      Attr.RANGE_PRIO, Attr.RANGE_FLAGS]
    assert struct.unpack("=Q", leaves[0][1])[0] == 0x7F0000000000
    assert len(leaves[0][1]) == 8 and len(leaves[2][1]) == 4


def test_an_empty_batch_encodes_an_empty_nest():
    data, msg = roundtrip(Cmd.MIGRATE, nlk.migrate_attrs(1, Op.MIGRATE, []))
    assert msg.get_attr("GPUOS_A_RANGES").get_attrs("GPUOS_A_RANGE") == []


def test_request_version_can_be_forced_for_tests():
    data = nlk.encode(nlk.request_msg(Cmd.GET_INFO, version=9), FAMILY)
    assert data[17] == 9


# -- replies ----------------------------------------------------------------------------


def test_info_reply():
    info = nlk.parse_info(nlk.decode(info_reply()))
    assert (info.genl_version, info.abi_version, info.module_version) == (1, 1, "0.1.0")
    assert info.driver_name == "nvidia-uvm" and info.caps == ["fault-reports", "migrate",
                                                              "stop-client"]
    assert info.event_seq == 41
    assert info.counters == {"faults": 12, "decisions_isolate": 10, "events_unsent": 3,
                             "objects": 0}
    js = info.to_json()
    assert js["driver"] == {"name": "nvidia-uvm", "caps": ["fault-reports", "migrate",
                                                           "stop-client"], "caps_mask": 11}


def test_info_reply_without_driver_and_with_a_newer_counter():
    info = nlk.parse_info(nlk.decode(info_reply(driver=None, extra_counter=u64(20, 99))))
    assert info.driver_name is None and info.driver_caps == 0 and info.caps == []
    assert info.to_json()["driver"] is None
    assert info.counters["counter_20"] == 99


def test_a_reply_of_another_family_version_is_refused():
    with pytest.raises(KmodVersionMismatch, match="version 2"):
        nlk.parse_info(nlk.decode(info_reply(version=2)))


def test_policy_dump_message():
    msg = nlk.decode(message(Cmd.LIST_POLICIES, nest(Attr.POLICY, u64(Attr.CLIENT_CGROUP, 77),
                                                     u32(Attr.FAULT_POLICY, 1)), flags=2))
    p = nlk.parse_policy(msg.get_attr("GPUOS_A_POLICY"))
    assert p.client == Client(cgroup=77) and p.policy is FaultPolicy.ISOLATE
    assert p.to_json() == {"client": {"pid": None, "cgroup": 77}, "policy": "isolate"}


# -- events -------------------------------------------------------------------------------


def test_fault_event():
    fault = nest(Attr.FAULT, u32(Attr.CLIENT_PID, 4321), u64(Attr.CLIENT_CGROUP, 9),
                 u64(Attr.AS_ID, 0xFFFF888000001000), u32(Attr.FAULT_VEID, 2),
                 u64(Attr.FAULT_ADDR, 0x834E8BE00000), u32(Attr.FAULT_ACCESS, 1),
                 u32(Attr.FAULT_TYPE, 0), u32(Attr.FAULT_GPU, 0), u32(Attr.DECISION, 1))
    ev = nlk.parse_event(nlk.decode(event(EventType.CLIENT_ISOLATED, 5, fault)))
    assert ev == Event(seq=5, time_ns=123_456_789_005, type=EventType.CLIENT_ISOLATED,
                       fault=Fault(pid=4321, cgroup=9, as_id=0xFFFF888000001000, veid=2,
                                   addr=0x834E8BE00000, access=FaultAccess.WRITE,
                                   type=FaultType.INVALID_PDE, gpu=0, decision=Decision.ISOLATE))
    js = ev.to_json()
    assert js["type"] == "client-isolated"
    assert js["fault"]["access"] == "write" and js["fault"]["type"] == "invalid-pde"
    assert js["fault"]["decision"] == "isolate"


def test_fault_batch_event():
    fault = nest(Attr.FAULT, u32(Attr.CLIENT_PID, 4321), u64(Attr.CLIENT_CGROUP, 9),
                 u64(Attr.AS_ID, 7), u32(Attr.FAULT_GPU, 3), u64(Attr.FAULT_BATCH_ID, 1 << 40),
                 u32(Attr.FAULT_NR, 5), u32(Attr.FAULT_NR_INSTANCES, 9),
                 u32(Attr.FAULT_NR_FATAL, 1), u32(Attr.FAULT_NR_THROTTLED, 0),
                 u32(Attr.FAULT_NR_SKIPPED, 12), u32(Attr.FAULT_NR_READ, 2),
                 u32(Attr.FAULT_NR_WRITE, 1), u32(Attr.FAULT_NR_ATOMIC, 0),
                 u32(Attr.FAULT_NR_PREFETCH, 2), u64(Attr.FAULT_ADDR_MIN, 0x1000),
                 u64(Attr.FAULT_ADDR_MAX, 0x9000),
                 nest(Attr.FAULT_ADDRS, u64(Attr.FAULT_ADDR, 0x1000),
                      u64(Attr.FAULT_ADDR, 0x3000), u64(Attr.FAULT_ADDR, 0x9000)))
    ev = nlk.parse_event(nlk.decode(event(EventType.FAULT_BATCH, 8, fault)))
    assert ev.fault is None and ev.type_name == "fault-batch"
    assert ev.fault_batch == FaultBatch(
        pid=4321, cgroup=9, as_id=7, gpu=3, batch_id=1 << 40, faults=5, instances=9, fatal=1,
        throttled=0, skipped=12, by_access={"read": 2, "write": 1, "atomic": 0, "prefetch": 2},
        addr_min=0x1000, addr_max=0x9000, addrs=[0x1000, 0x3000, 0x9000])
    js = ev.to_json()
    assert js["fault_batch"]["addrs"] == [0x1000, 0x3000, 0x9000]
    assert js["fault_batch"]["by_access"]["prefetch"] == 2 and "fault" not in js


def test_migration_done_event_with_nested_ranges():
    ranges = nest(Attr.RANGES, *[nest(Attr.RANGE, s32(Attr.RANGE_STATUS, s))
                                 for s in (0, -errno.EINVAL, -errno.ENODEV)])
    ev = nlk.parse_event(nlk.decode(event(EventType.MIGRATION_DONE, 6, nla(Attr.PAD, b""),
                                          u64(Attr.BATCH_ID, 17), u64(Attr.AS_ID, 3), ranges)))
    assert (ev.type, ev.batch_id, ev.as_id) == (EventType.MIGRATION_DONE, 17, 3)
    assert ev.statuses == [0, -22, -19]
    assert ev.to_json() == {"seq": 6, "time_ns": 123_456_789_006, "type": "migration-done",
                            "batch_id": 17, "as_id": 3, "statuses": [0, -22, -19]}


def test_driver_and_policy_events():
    ev = nlk.parse_event(nlk.decode(event(EventType.DRIVER_REGISTERED, 1,
                                          string(Attr.DRIVER_NAME, "gpuos_testdrv"))))
    assert ev.driver_name == "gpuos_testdrv" and ev.type_name == "driver-registered"
    ev = nlk.parse_event(nlk.decode(event(EventType.POLICY_DELETED, 2, nest(
        Attr.POLICY, u32(Attr.CLIENT_PID, 8), u32(Attr.FAULT_POLICY, 2)))))
    assert ev.policy.client == Client(pid=8) and ev.policy.policy is FaultPolicy.KILL_CLIENT
    assert ev.to_json()["policy"] == "kill-client" and ev.to_json()["client"]["pid"] == 8


def test_an_event_type_this_version_does_not_know_still_decodes():
    ev = nlk.parse_event(nlk.decode(event(99, 3)))
    assert ev.type == 99 and ev.type_name == "unknown-99" and ev.fault is None


def test_an_event_of_another_family_version_is_refused():
    with pytest.raises(KmodVersionMismatch):
        nlk.parse_event(nlk.decode(event(EventType.FAULT, 1, version=GENL_VERSION + 1)))


def test_a_non_event_is_not_an_event():
    with pytest.raises(GpuosError, match="expected an event"):
        nlk.parse_event(nlk.decode(info_reply()))
