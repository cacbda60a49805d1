"""Host memory as the unified-memory guard sees it: MemAvailable, bounded by the cgroup limit.

The reading itself is the C core's (the guard runs it before every reservation, with no Python on
that path); this module only calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lib import ffi, lib
from .arena import path_bytes
from .errors import BackendError


@dataclass(frozen=True)
class HostMemory:
    mem_available: int
    cgroup_limit: int | None
    cgroup_usage: int | None
    available: int


def read(meminfo: str | None = None, cgroup_root: str | None = None) -> HostMemory:
    """Reads ``meminfo`` (default /proc/meminfo) and the cgroup under ``cgroup_root`` (default
    /sys/fs/cgroup, v2 or v1; "" to ignore cgroups)."""
    out = ffi.new("ia_host_memory_t *")
    args = [ffi.new("char[]", path_bytes(name, p) if p else b"") if p is not None else ffi.NULL
            for name, p in (("meminfo", meminfo), ("cgroup_root", cgroup_root))]
    if lib.ia_host_memory_read(args[0], args[1], out) != lib.IA_OK:
        raise BackendError(ffi.string(lib.ia_guard_last_message()).decode())
    limit = int(out.cgroup_limit) if out.cgroup_limited else None
    return HostMemory(int(out.mem_available), limit, int(out.cgroup_usage) if limit is not None else None,
                      int(out.available))


def available_bytes() -> int:
    """What this machine can still give: MemAvailable bounded by the cgroup limit."""
    return read().available
