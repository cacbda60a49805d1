"""The arena as a Python object: a thin layer over the C core that checks arguments and turns
status codes into exceptions."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Literal

from ._lib import ffi, lib
from .config import c_path
from .errors import ArenaOutOfMemory, BackendError, DoubleFree, ForeignPointer, InvariantError
from .units import MAX_SIZE, PAGE, U64_MAX, fmt_bytes


#: Streams are handles from 0 to 2**64 - 2: all bits set is the core's "no stream" (IA_STREAM_NONE),
#: which a block allocated or freed on it would carry as "ordered after nothing".
MAX_STREAM = U64_MAX - 1


def _checked(name: str, value, low: int, high: int) -> int:
    """An int argument, checked before it reaches C, where it would be wrapped to 64 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high}, got {value}")
    return value


def _power_of_two(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE \
            or value & (value - 1):
        raise ValueError(f"{name} must be a power of two from {low} to {MAX_SIZE}, got {value!r}")
    return value

_QUANTITY = ffi.typeof("ia_stat_t")
_FIELDS = ffi.typeof("ia_stats_t").fields
#: The quantities (csrc/arena/arena.h, IA_STAT_QUADS): each an ia_stat_t of current, peak, allocated, freed.
QUANTITIES = tuple(name for name, field in _FIELDS if field.type is _QUANTITY)


def _flat(name: str) -> tuple[str, str, str, str]:
    """A quantity's keys, flat as the C core's JSON report writes them: current, peak, sums."""
    return name, f"{name}_peak", f"{name}_allocated", f"{name}_freed"


#: Every key of stats_dict, in ia_stats_t order.
STAT_NAMES = tuple(key for name, field in _FIELDS
                   for key in (_flat(name) if field.type is _QUANTITY else (name,)))


def status_text(status: int) -> str:
    return ffi.string(lib.ia_status_str(status)).decode()


def stats_dict(stats) -> dict:
    """An ia_stats_t as a flat dict: a counter under its C name, a quantity `q` as `q` (current),
    `q_peak`, `q_allocated` and `q_freed`."""
    out = {}
    for name, field in _FIELDS:
        value = getattr(stats, name)
        if field.type is _QUANTITY:
            out.update(zip(_flat(name), (value.current, value.peak, value.allocated, value.freed)))
        else:
            out[name] = value
    return out


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Block:
    """One block of an arena: offset is from the start of its region."""
    region: int
    offset: int
    address: int
    size: int
    requested: int
    state: Literal["free", "used"]
    stream: int


@dataclass(frozen=True)
class Region:
    base: int
    size: int


@dataclass(frozen=True)
class HostGuard:
    """Unified-memory guard for an arena's backend: every reservation first checks that host
    memory stays above ``headroom`` after it. ``available``, a callable returning bytes, replaces
    reading ``meminfo``/the cgroup (for simulating a machine running out)."""
    headroom: int = 0
    meminfo: str | None = None
    cgroup_root: str | None = None
    available: object = None

    def __post_init__(self):
        _checked("headroom", self.headroom, 0, U64_MAX)
        for name in ("meminfo", "cgroup_root"):
            value = getattr(self, name)
            if value is not None and (value or name == "meminfo"):  # cgroup_root "": no cgroups
                path_bytes(name, value)


def path_bytes(name: str, value) -> bytes:
    """A path argument as the C core takes it; ValueError naming it when C cannot."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a path (str), got {value!r}")
    try:
        return c_path(value)
    except ValueError as e:
        raise ValueError(f"{name} {value!r}: {e}") from None


def _guarded(inner, guard: HostGuard, keepalive: list):
    opts = ffi.new("ia_guard_options_t *")
    opts.headroom = guard.headroom
    for field, value in (("meminfo_path", guard.meminfo), ("cgroup_root", guard.cgroup_root)):
        if value is not None:
            keepalive.append(ffi.new("char[]", os.fsencode(value)))
            setattr(opts, field, keepalive[-1])
    if guard.available is not None:
        fn = guard.available
        callback = ffi.callback("uint64_t(void *)", lambda _ctx: int(fn()), onerror=lambda *e: None)
        keepalive.append(callback)
        opts.available_fn = callback
    out = ffi.new("ia_backend_t **")
    status = lib.ia_guard_backend_create(inner, opts, out)  # takes `inner`, even on failure
    if status != lib.IA_OK:
        raise BackendError(f"could not create the host-memory guard: {status_text(status)}")
    return out[0]


def _new_backend(backend: str, device: int | None, host_limit: int | None, cudart: str | None,
                 mapping: bool = False, page_size: int = PAGE):
    """mapping: a backend that maps pages (host: simulated pages of page_size; cuda: the driver's)."""
    out = ffi.new("ia_backend_t **")
    if backend == "host":
        limit = physical_memory() if host_limit is None else host_limit
        status = lib.ia_host_mapping_backend_create(limit, page_size, out) if mapping else \
            lib.ia_host_backend_create(limit, out)
    elif backend == "cuda":
        if device is None or device < 0:
            raise ValueError("the cuda backend needs a device index >= 0")
        path = cudart.encode() if cudart else ffi.NULL
        create = lib.ia_vmm_backend_create if mapping else lib.ia_cuda_backend_create
        status = create(device, path, out)
        if status != lib.IA_OK:
            raise BackendError(ffi.string(lib.ia_cuda_last_error()).decode())
    else:
        raise ValueError(f"unknown backend {backend!r}; accepted: 'host', 'cuda'")
    if status != lib.IA_OK:
        raise BackendError(f"could not create the {backend} backend: {status_text(status)}")
    return out[0]


class Arena:
    """A budget arena over one reservation (or, with ``growable=True``, over regions added on
    demand). Addresses are plain ints; ``stream`` is an int handle the backend understands.

    ``address_range`` (growable only) makes it a mapping arena: one address range of that many
    bytes is reserved once, and its pages are mapped as blocks need them and unmapped by
    ``release_cached()`` (the host backend simulates pages of ``page_size`` bytes, 2 MiB by
    default; the cuda backend maps the driver's pages through its virtual memory management).

    >>> with Arena(1 << 20) as a:
    ...     p = a.allocate(1000)
    ...     a.free(p)

    Any thread may call any method at any time, ``close()`` included: a call that starts after
    ``close()`` began raises ValueError ("closed"), and ``close()`` waits for the calls already
    inside the C core before it destroys the arena. (In C, ia_arena_destroy must not overlap any
    other call on the arena; this object is what keeps that rule.)
    """

    def __init__(self, capacity: int, alignment: int = 256, backend: str = "host", *,
                 device: int | None = None, growable: bool = False, region_min: int = PAGE,
                 region_round: int = PAGE, region_exact_above: int | None = None,
                 limit: int = 0, host_limit: int | None = None, cudart: str | None = None,
                 guard: HostGuard | None = None, name: str = "arena", address_range: int = 0,
                 page_size: int | None = None):
        # Everything is checked before the backend exists, so that a refusal leaves nothing behind.
        _checked("capacity", capacity, 0, MAX_SIZE)
        _checked("limit", limit, 0, U64_MAX)
        _power_of_two("alignment", alignment, 16)
        if not growable and capacity == 0:
            raise ValueError("a fixed arena needs capacity > 0 (or pass growable=True)")
        _power_of_two("region_round", region_round, 16)
        _checked("region_min", region_min, 0, MAX_SIZE)
        if growable and region_round < alignment:
            raise ValueError(f"region_round must be at least the alignment ({alignment}), got {region_round}")
        if growable and region_min % alignment:
            raise ValueError(f"region_min must be a multiple of the alignment ({alignment}), got {region_min}")
        if region_exact_above is not None:
            _checked("region_exact_above", region_exact_above, 0, U64_MAX)
        if host_limit is not None:
            _checked("host_limit", host_limit, 0, U64_MAX)
        if device is not None:
            _checked("device", device, 0, 1 << 31)
        _checked("address_range", address_range, 0, MAX_SIZE)
        if address_range and not growable:
            raise ValueError("address_range needs growable=True: a mapping arena grows page by page")
        if address_range and capacity > address_range:
            raise ValueError(f"capacity {capacity} is more than address_range {address_range}: a mapping "
                             "arena maps its capacity inside its address range")
        if page_size is not None:
            _power_of_two("page_size", page_size, 4096)
            if backend != "host" or not address_range:
                raise ValueError("page_size is the host backend's simulated page: it needs backend='host' "
                                 "and an address_range (the cuda backend maps the driver's pages)")
        self.name = name
        self.backend_name = backend
        self.device = device
        self._cond, self._users, self._arena = threading.Condition(), 0, ffi.NULL
        self._keepalive: list = []
        self._backend = _new_backend(backend, device, host_limit, cudart, mapping=address_range > 0,
                                     page_size=page_size or PAGE)
        self._host_controls = self._backend
        if guard is not None:
            self._backend = _guarded(self._backend, guard, self._keepalive)
        opts = ffi.new("ia_arena_options_t *")
        lib.ia_arena_default_options(opts)
        opts.capacity = capacity
        opts.alignment = alignment
        opts.growable = growable
        opts.region_min = region_min
        opts.region_round = region_round
        opts.region_exact_above = region_exact_above if region_exact_above is not None else U64_MAX
        opts.limit = limit
        opts.address_range = address_range
        out = ffi.new("ia_arena_t **")
        status = lib.ia_arena_create(opts, self._backend, out)  # takes the backend, even on failure
        if status != lib.IA_OK:
            self._backend = self._host_controls = ffi.NULL
            why = self._backend_detail(status) or status_text(status)
            if status in (lib.IA_ERR_BACKEND_OUT_OF_MEMORY, lib.IA_ERR_HOST_MEMORY_GUARD):
                # A mapping arena reserves its address range first, then maps the capacity in it.
                what = fmt_bytes(capacity)
                if address_range:
                    what = f"an address range of {fmt_bytes(address_range)} (address_range={address_range})" \
                        + (f" with its first {what} mapped" if capacity else "")
                raise ArenaOutOfMemory(f"{name}: could not reserve {what} from the {backend} backend: "
                                       f"{why}", requested=address_range or capacity, stats={})
            raise BackendError(f"{name}: could not create the arena: {why}")
        self._arena = out[0]
        self._owned = True
        self.alignment = alignment
        self.growable = growable
        self.guarded = guard is not None
        self.page_size = int(lib.ia_arena_page_size(self._arena))
        self.capacity = self.stats()["capacity"]  # what was reserved: rounded to the alignment

    @classmethod
    def view(cls, handle, *, name: str, backend: str, device: int | None = None) -> Arena:
        """A non-owning view of an arena the C core owns (the plugin's per-device arenas)."""
        self = cls.__new__(cls)
        self.name, self.backend_name, self.device = name, backend, device
        self._cond, self._users = threading.Condition(), 0
        self._arena, self._backend, self._owned = handle, ffi.NULL, False
        self._host_controls, self._keepalive = ffi.NULL, []
        self.alignment = int(lib.ia_arena_alignment(handle))
        self.page_size, self.guarded = int(lib.ia_arena_page_size(handle)), None
        s = self.stats()
        self.capacity, self.growable = s["capacity"], None
        return self

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if not getattr(self, "_owned", False):
            return
        with self._cond:
            handle, self._arena = self._arena, ffi.NULL  # calls from now on raise "closed"
            while self._users:
                self._cond.wait()
            if handle != ffi.NULL:
                lib.ia_arena_destroy(handle)
                self._backend = self._host_controls = ffi.NULL

    def __repr__(self) -> str:
        state = "closed" if getattr(self, "_arena", ffi.NULL) == ffi.NULL else self.describe()
        return f"<Arena {self.name!r} ({self.backend_name}): {state}>"

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    @contextlib.contextmanager
    def _use(self):
        """The C handle, kept alive (close() waits) until the block ends."""
        with self._cond:
            if self._arena == ffi.NULL:
                raise ValueError(f"{self.name} is closed")
            self._users += 1
            handle = self._arena
        try:
            yield handle
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    def _handle(self):
        """The C handle of a view (the plugin's arenas, which live as long as the process)."""
        if self._arena == ffi.NULL:
            raise ValueError(f"{self.name} is closed")
        return self._arena

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, size: int, stream: int = 0) -> int:
        """Returns the address of a block of at least ``size`` bytes (0 for size 0)."""
        _checked("size", size, 0, U64_MAX)
        _checked("stream", stream, 0, MAX_STREAM)
        out = ffi.new("void **")
        with self._use() as h:
            status = lib.ia_arena_alloc(h, size, stream, out)
            if status != lib.IA_OK:
                raise self._out_of_memory(size, status)
        return int(ffi.cast("uintptr_t", out[0]))

    def free(self, address: int, stream: int = 0) -> None:
        self._on_block("free", lib.ia_arena_free, address, stream)

    def record_stream(self, address: int, stream: int) -> None:
        """Marks the block as used on ``stream`` too; its free waits for that stream's work."""
        self._on_block("record_stream", lib.ia_arena_record_stream, address, stream)

    def _on_block(self, op: str, fn, address: int, stream: int) -> None:
        _checked("address", address, 0, U64_MAX)
        _checked("stream", stream, 0, MAX_STREAM)
        with self._use() as h:
            status = fn(h, ffi.cast("void *", address), stream)
            if status != lib.IA_OK:
                raise self._bad_pointer(op, address, status)

    def release_cached(self) -> int:
        """Growable arenas: gives fully free regions back to the backend; returns the bytes."""
        with self._use() as h:
            return int(lib.ia_arena_release_cached(h))

    def owns(self, address: int) -> bool:
        _checked("address", address, 0, U64_MAX)
        with self._use() as h:
            return bool(lib.ia_arena_owns(h, ffi.cast("void *", address)))

    # -- inspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        s = ffi.new("ia_stats_t *")
        with self._use() as h:
            lib.ia_arena_stats(h, s)
        return stats_dict(s)

    def reset_peaks(self) -> None:
        with self._use() as h:
            lib.ia_arena_reset_peaks(h)

    def regions(self) -> list[Region]:
        with self._use() as h:
            n = lib.ia_arena_regions(h, ffi.NULL, 0)
            buf = ffi.new("ia_region_info_t[]", max(n, 1))
            n = min(n, lib.ia_arena_regions(h, buf, n))
        return [Region(int(buf[i].base), int(buf[i].size)) for i in range(n)]

    def address_range(self) -> Region | None:
        """A mapping arena's one address range (None for an arena of reservations); its
        ``regions()`` are the stretches of it mapped now."""
        out = ffi.new("ia_region_info_t *")
        with self._use() as h:
            found = lib.ia_arena_address_range(h, out)
        return Region(int(out.base), int(out.size)) if found else None

    def blocks(self) -> list[Block]:
        """Every block in address order within each region (regions oldest first)."""
        cap = 0
        with self._use() as h:
            while True:
                buf = ffi.new("ia_block_info_t[]", max(cap, 1))
                n = lib.ia_arena_blocks(h, buf, cap)
                if n <= cap:
                    break
                cap = 2 * n
        out = []
        for b in buf[0:n]:
            out.append(Block(region=int(b.region), offset=int(b.address - b.region_base),
                             address=int(b.address), size=int(b.size), requested=int(b.requested),
                             state="free" if b.is_free else "used", stream=int(b.stream)))
        return out

    def check(self) -> None:
        """Raises InvariantError if the blocks do not tile the regions exactly."""
        msg = ffi.new("char[]", 512)
        with self._use() as h:
            ok = lib.ia_arena_check(h, msg, 512)
        if not ok:
            raise InvariantError(f"{self.name}: {ffi.string(msg).decode()}")

    # -- host backend controls (tests and simulation) --------------------------------------------
    @contextlib.contextmanager
    def _host_backend(self):
        if self.backend_name != "host":
            raise ValueError("stream simulation controls exist only on the host backend")
        with self._use():  # the backend goes with the arena
            yield self._host_controls

    def set_auto_complete(self, on: bool) -> None:
        with self._host_backend() as b:
            lib.ia_host_set_auto_complete(b, bool(on))

    def complete(self, stream: int) -> None:
        """Host backend: completes all work recorded so far on ``stream``."""
        _checked("stream", stream, 0, U64_MAX)
        with self._host_backend() as b:
            lib.ia_host_complete(b, stream)

    def mapping_counters(self) -> dict:
        """Host backend of a mapping arena: what it mapped and unmapped (ia_mapping_counters_t)."""
        self._need_mapping()
        out = ffi.new("ia_mapping_counters_t *")
        with self._host_backend() as b:
            lib.ia_host_mapping_counters(b, out)
        return _counters(out)

    def guard_counters(self) -> dict:
        """A guarded mapping arena: what its host-memory guard checked and let through."""
        self._need_mapping()
        if not self.guarded:
            raise ValueError(f"{self.name} has no host-memory guard")
        out = ffi.new("ia_mapping_counters_t *")
        with self._use():
            lib.ia_guard_mapping_counters(self._backend, out)
        return _counters(out)

    def range_mapped(self, address: int, size: int) -> bool:
        """Host backend of a mapping arena: whether every page [address, address + size) touches
        is mapped now."""
        self._need_mapping()
        _checked("address", address, 0, U64_MAX)
        _checked("size", size, 0, U64_MAX)
        with self._host_backend() as b:
            return bool(lib.ia_host_range_mapped(b, address, size))

    def _need_mapping(self) -> None:
        if not self.page_size:
            raise ValueError(f"{self.name} does not map pages (make it with address_range=...)")

    def waits(self, waiter: int, waited_on: int) -> int:
        """Host backend: how many times ``waiter`` was made to wait on ``waited_on``."""
        _checked("waiter", waiter, 0, U64_MAX)
        _checked("waited_on", waited_on, 0, U64_MAX)
        with self._host_backend() as b:
            return int(lib.ia_host_waits(b, waiter, waited_on))

    # -- messages -------------------------------------------------------------------------------
    def describe(self) -> str:
        s = self.stats()
        return (f"capacity {fmt_bytes(s['capacity'])}, in use {fmt_bytes(s['in_use'])} in "
                f"{s['blocks']} blocks, free {fmt_bytes(s['free_bytes'])}, largest free block "
                f"{fmt_bytes(s['largest_free'])}")

    def _backend_detail(self, status: int) -> str:
        if status == lib.IA_ERR_HOST_MEMORY_GUARD:
            return ffi.string(lib.ia_guard_last_message()).decode()
        if self.backend_name == "cuda" and status in (lib.IA_ERR_BACKEND, lib.IA_ERR_BACKEND_OUT_OF_MEMORY):
            return ffi.string(lib.ia_cuda_last_error()).decode()
        return ""

    def _out_of_memory(self, size: int, status: int) -> Exception:
        stats = self.stats()
        what = self._backend_detail(status) or status_text(status)
        if status == lib.IA_ERR_BACKEND:
            return BackendError(f"{self.name}: {what}")
        if status == lib.IA_ERR_NO_HOST_MEMORY:
            return MemoryError(f"{self.name}: {what}")
        return ArenaOutOfMemory(
            f"{self.name}: cannot allocate {fmt_bytes(size)} ({size} bytes): {what}; "
            f"{self.describe()}", requested=size, stats=stats)

    def _bad_pointer(self, op: str, address: int, status: int) -> Exception:
        text = f"{self.name}: {op}({address:#x}): {status_text(status)}; {self.describe()}"
        if status == lib.IA_ERR_DOUBLE_FREE:
            return DoubleFree(text)
        if status == lib.IA_ERR_FOREIGN_POINTER:
            return ForeignPointer(text)
        return MemoryError(text)


def _counters(c) -> dict:
    return {name: int(getattr(c, name)) for name, _ in ffi.typeof("ia_mapping_counters_t").fields}


def workspace_arena(config, backend: str = "host", *, device: int | None = None,
                    cudart: str | None = None, name: str = "workspace arena") -> Arena:
    """The fixed workspace arena a Config describes. A budget the backend cannot reserve is a
    configuration error: it names budget_mb and the most this backend could take."""
    try:
        return Arena(config.budget_bytes, config.alignment, backend, device=device, cudart=cudart,
                     name=name)
    except ArenaOutOfMemory as e:
        from .errors import ConfigError
        if backend == "cuda":
            free = ffi.new("size_t *"), ffi.new("size_t *")
            ok = lib.ia_cuda_mem_info(device, free[0], free[1]) == lib.IA_OK
            room = f"{free[0][0] >> 20} MiB free on cuda:{device}" if ok else "the device's free memory"
        else:
            room = f"{physical_memory() >> 20} MiB of host memory"
        raise ConfigError("budget_mb", config.budget_mb, f"a positive integer no larger than {room}",
                          reason=str(e)) from None
