"""The Python client of gpuos.ko.

    uapi.py      kmod/uapi/gpuos.h mirrored: constants, enums, structs, ioctl numbers
    model.py     dataclasses: Client, Policy, Range, KmodInfo, Event, Gap, ...
    netlink.py   the generic netlink family "gpuos" (GpuosNetlink, EventSubscription)
    chardev.py   /dev/gpuos ioctls (Chardev)
    errnos.py    the module's errnos as GpuosErrors
    cgroups.py   cgroup v2 paths to ids
    trace.py     bcc on the tracepoints gpuos:fault and gpuos:decision

netlink.py needs pyroute2 (0.7.x); ``connect()`` turns its absence into a
clear error.  trace.py imports bcc only when a tracer is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import GpuosError

if TYPE_CHECKING:
    from .netlink import GpuosNetlink


def connect() -> GpuosNetlink:
    """A GpuosNetlink; a clear GpuosError if pyroute2 is missing."""
    try:
        from .netlink import GpuosNetlink
    except ImportError as exc:
        raise GpuosError(f"pyroute2 is not installed ({exc.name}); "
                         "pip install 'pyroute2>=0.7.2,<0.8'") from None
    return GpuosNetlink()
