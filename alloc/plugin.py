"""The arena inside PyTorch, in one of two scopes.

``install()`` (scope ``"process"``) makes the C core PyTorch's CUDA allocator, through a subclass
of PyTorch's ``CUDAPluggableAllocator`` compiled against the installed torch
(csrc/torch/torch_allocator.cpp); from then on every CUDA tensor of the process, CUDA graph pools
included, comes from this package's arenas.

``install(scope="workspace")`` leaves PyTorch's own allocator in charge of every other tensor and
puts the workspace arena behind one ``torch.cuda.MemPool`` per device (``workspace_pool()``). The
pool's caching layer keeps each segment it is given, so the pool is first handed one segment of
the whole budget, and PyTorch splits every workspace out of it: one reservation, no growth.

In both scopes ``workspace()`` routes the calling thread's allocations to the workspace arena.

The scope is a type, chosen once by ``install()``: ``_ProcessScope`` or ``_WorkspaceScope``, each
method of theirs one thing the scopes do differently; the functions below ask the installed one
(``_scope()``; before ``install()``, ``_CoreScope``, the C core on its own). What the core holds
per device, alike in either scope, is read through ``alloc.devices``, whose names this module
offers too.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from . import config as config_mod
from ._lib import ffi, lib
from .arena import stats_dict
from .devices import (MAX_DEVICES, POOLS, SMALL_REQUEST, device_arena, device_index,  # noqa: F401
                      device_is_expandable, device_is_unified, graph_pool_blocks, graph_pools,
                      in_workspace, pool_options, workspace_reserved)
from .errors import InstallError, WorkspaceBusy
from .units import fmt_bytes

SCOPES = config_mod.SCOPES


@dataclass
class _Installed:
    config: config_mod.Config
    scope: _CoreScope  # a _ProcessScope or a _WorkspaceScope, chosen once by install()
    keepalive: tuple


_state_lock = threading.Lock()
_installed: _Installed | None = None


class _CoreScope:
    """What differs between the scopes, one method each. This base is the C core on its own, what
    the functions do before ``install()``: ``workspace()`` routes through the core, the statistics
    are the core's, and there is no workspace pool."""
    name: str | None = None

    def reserve(self, device: int) -> None:
        _reserve_arena(device)

    def release_pool(self, index: int) -> None:
        """Before the device's workspace arena is released: nothing to give back but the arena."""

    def pool(self, device):
        now = f"installed in {self.name} scope" if self.name else "not installed"
        raise InstallError(f"alloc.workspace_pool() needs alloc.install(scope=\"workspace\") "
                           f"first; the allocator is {now}")

    @contextlib.contextmanager
    def workspace(self) -> Iterator[None]:
        lib.ia_workspace_enter()
        try:
            yield
        finally:
            lib.ia_workspace_exit()

    def memory_stats(self, device: int, pools: dict[str, dict]) -> dict:
        return _core_memory_stats(device, pools)

    def reset_peaks(self, device: int) -> None:
        lib.ia_plugin_reset_peaks(device)

    def device_total(self, total: str, field: str, torch_name: str, device: int) -> int:
        return int(getattr(getattr(lib.ia_plugin_device_totals(device), total), field))


class _ProcessScope(_CoreScope):
    """The C core is PyTorch's CUDA allocator: every tensor of the process comes from it."""
    name = "process"
    code = lib.IA_SCOPE_PROCESS

    def check(self, torch, config: config_mod.Config, cudart: str | None) -> None:
        if torch.cuda.is_initialized():
            raise InstallError(
                "CUDA is already initialised in this process, and PyTorch cannot change its "
                "allocator after that. Call alloc.install() first thing in the worker, before any "
                "tensor is moved to the GPU and before torch.cuda.set_device() or a MemPool; or "
                "install(scope=\"workspace\"), which works at any time")
        if config.expandable == "on":
            _check_mapping(cudart, torch.cuda.device_count())

    def put_in(self, torch) -> None:
        from . import shims
        shims.install_allocator(int(ffi.cast("uintptr_t", lib.ia_torch_entry_points())))


class _WorkspaceScope(_CoreScope):
    """PyTorch's allocator serves the process and keeps the statistics; workspaces come from one
    ``torch.cuda.MemPool`` a device over the workspace arena."""
    name = "workspace"
    code = lib.IA_SCOPE_WORKSPACE

    def __init__(self) -> None:
        self.allocator = None  # the MemPools' CUDAPluggableAllocator, made by put_in
        self.pools: dict = {}  # device index -> MemPool

    def check(self, torch, config: config_mod.Config, cudart: str | None) -> None:
        _check_pool_settings()

    def put_in(self, torch) -> None:
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(
            core_library_path(), "ia_pool_alloc", "ia_pool_free")

    def reserve(self, device: int) -> None:
        workspace_pool(device)

    def release_pool(self, index: int) -> None:
        pool = self.pools.get(index)
        if pool is None:
            return
        import torch
        live = sum(b["size"] for seg in pool_snapshot(index) for b in seg["blocks"]
                   if b["state"] != "inactive")
        if live:
            raise WorkspaceBusy(f"cannot release the workspace of cuda:{index}: "
                                f"{fmt_bytes(live)} of its pool are live; free those tensors first")
        del self.pools[index]
        del pool  # PyTorch frees a released pool's segment at the next empty_cache()
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()

    def pool(self, device):
        import torch
        index = device_index(device)
        with _pool_lock:
            pool = self.pools.get(index)
            if pool is not None:
                return pool
            _reserve_arena(index)
            try:
                pool = torch.cuda.MemPool(self.allocator.allocator())
            except RuntimeError as e:
                raise InstallError(f"PyTorch refused a MemPool on cuda:{index} ({e}); the workspace "
                                   "scope needs PyTorch's own caching allocator as the process's "
                                   "allocator") from None
            segment = pool_segment_bytes()
            with torch.cuda.device(index), torch.cuda.use_mem_pool(pool, index):
                torch.empty(segment, dtype=torch.uint8, device=index)  # freed at once; kept cached
            # One block of one reservation: the arena outlives a release (Note [Device lifetime],
            # csrc/torch/plugin.h), so its cumulative counters count earlier reservations too.
            held = device_arena(index, "workspace").stats()
            if held["in_use"] != segment or held["blocks"] != 1 or held["regions"] != 1:
                raise InstallError(
                    f"the workspace pool of cuda:{index} asked its arena for {held['in_use']} bytes "
                    f"where {segment} were expected; this PyTorch ({torch.__version__}) sizes pool "
                    "segments differently, so use the process scope")
            self.pools[index] = pool
            return pool

    @contextlib.contextmanager
    def workspace(self) -> Iterator[None]:
        import torch
        if torch.cuda.is_current_stream_capturing():
            # PyTorch gives a pool's blocks to the stream that made its segment only, and the
            # budget is that one segment: a capturing stream's request would need another. The
            # graph's own private pool serves it instead, as every other tensor of the capture.
            with super().workspace():
                yield
            return
        device = torch.cuda.current_device()
        pool = workspace_pool(device)
        refusals = lib.ia_plugin_pool_refusals()
        lib.ia_workspace_enter()
        try:
            with torch.cuda.use_mem_pool(pool, device):
                yield
        except torch.OutOfMemoryError as e:
            if lib.ia_plugin_pool_refusals() == refusals:  # not the pool's: PyTorch's own error
                raise
            raise torch.OutOfMemoryError(f"{e} {_pool_state(device)}") from None
        finally:
            lib.ia_workspace_exit()

    def memory_stats(self, device: int, pools: dict[str, dict]) -> dict:
        import torch
        out = dict(torch.cuda.memory_stats(device))  # the workspace pool's segments among them
        out.update({f"arena.workspace.{k}": v for k, v in pools["workspace"].items()})
        return out

    def reset_peaks(self, device: int) -> None:
        super().reset_peaks(device)
        import torch
        torch.cuda.reset_peak_memory_stats(device)

    def device_total(self, total: str, field: str, torch_name: str, device: int) -> int:
        import torch
        return getattr(torch.cuda, torch_name)(device)


_NOT_INSTALLED = _CoreScope()
_SCOPE_TYPES = {"process": _ProcessScope, "workspace": _WorkspaceScope}  # of config.SCOPES


def core_library_path() -> str:
    """Path of the loaded C core: the .so PyTorch must dlopen to find the entry points."""
    from ._lib import PATH
    return PATH


def loaded_cudart() -> str | None:
    """The CUDA runtime PyTorch loaded into this process (read from /proc/self/maps), or None when
    torch links it statically (the core then loads libcudart by name)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if "/libcudart.so" in path:
                return path
    return None


def is_installed() -> bool:
    return _installed is not None


def installed_config() -> config_mod.Config | None:
    return _installed.config if _installed else None


def installed_scope() -> str | None:
    """``"process"``, ``"workspace"``, or None before ``install()``."""
    return _installed.scope.name if _installed else None


def _scope() -> _CoreScope:
    """The installed scope; before ``install()``, the C core's own routing and counters."""
    return _installed.scope if _installed is not None else _NOT_INSTALLED


def install(config: config_mod.Config | None = None, *, devices: Iterable[int] = (),
            scope: str = "process") -> config_mod.Config:
    """Puts the arena into PyTorch for this process.

    ``scope="process"`` makes it PyTorch's CUDA allocator. It must run before anything
    initialises CUDA (any ``.cuda()``, ``torch.cuda.set_device``, a ``MemPool``...). A device's
    general pools start at its first allocation and its workspace arena at its first workspace
    allocation.

    ``scope="workspace"`` keeps PyTorch's allocator and serves only ``workspace()`` allocations,
    from one ``torch.cuda.MemPool`` per device over the workspace arena (``workspace_pool()``); it
    may run at any time, and a device's pool is made at its first workspace allocation.

    ``config`` defaults to the environment (INDEXER_ARENA_CONF and
    VLLM_SPARSE_INDEXER_MAX_LOGITS_MB). ``devices`` reserves the workspace arenas of those device
    indices right away (what unified-memory machines want: the budget is taken and committed
    before the model loads). A second call with the same configuration and scope does nothing;
    with another one it raises, since the first one's arenas already exist: one process has one
    scope.
    """
    global _installed
    if scope not in SCOPES:
        raise InstallError(f"unknown scope {scope!r}; accepted: {', '.join(SCOPES)}")
    config = config if config is not None else config_mod.from_env()
    with _state_lock:
        if _installed is not None:
            if scope != _installed.scope.name:
                raise InstallError(
                    f"the allocator is already installed in {_installed.scope.name} scope; one process "
                    f"cannot also use the {scope} scope. Choose one scope for the whole process")
            if config != _installed.config:
                raise InstallError(
                    f"the allocator is already installed with {_installed.config}; it cannot be "
                    f"installed again with {config} in the same process")
        else:
            _installed = _install(config, _SCOPE_TYPES[scope]())
    for device in devices:
        reserve(device)
    return config


def _install(config: config_mod.Config, scope: _ProcessScope | _WorkspaceScope) -> _Installed:
    import torch
    if not torch.cuda.is_available():
        raise InstallError("torch sees no CUDA device; the arena allocator needs one "
                           "(on the CPU use alloc.Arena with the host backend)")
    cudart = loaded_cudart()
    scope.check(torch, config, cudart)
    strings = tuple(ffi.new("char[]", config_mod.c_path(s)) if s else ffi.NULL
                    for s in (cudart, config.meminfo, config.oom_report))
    c = ffi.new("ia_plugin_config_t *")
    c.scope = scope.code
    c.budget = config.budget_bytes
    c.alignment = config.alignment
    c.cudart_path, c.meminfo_path, c.oom_report_path = strings
    c.unified = {"auto": -1, "off": 0, "on": 1}[config.unified]
    c.expandable = {"auto": -1, "off": 0, "on": 1}[config.expandable]
    c.host_headroom = config.host_headroom_bytes
    from . import shims
    c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())
    if lib.ia_plugin_configure(c) != lib.IA_OK:
        raise InstallError("the C core refused the configuration: a device already has arenas")
    if config.trace and lib.ia_plugin_trace_start(config.trace) != lib.IA_OK:
        raise InstallError(f"could not allocate a trace ring of {config.trace} events")
    if config.trace_file:  # written at exit, as RMM's log file
        from .ring import write_at_exit
        write_at_exit(config.trace_file, config.trace)
    scope.put_in(torch)
    return _Installed(config, scope, (strings, c))


def mapping_refusal(device: int, cudart: str | None = None) -> str | None:
    """Why the driver cannot map pages for ``device`` (asked of the driver alone, which creates no
    CUDA context), or None when it can. ``cudart`` defaults to the loaded runtime."""
    cudart = loaded_cudart() if cudart is None else cudart
    path = ffi.new("char[]", cudart.encode()) if cudart else ffi.NULL
    if lib.ia_vmm_supported(device, path) == lib.IA_OK:
        return None
    return ffi.string(lib.ia_cuda_last_error()).decode()


def _check_mapping(cudart: str | None, devices: int) -> None:
    """expandable:on: every device's driver must map pages."""
    for device in range(devices):
        why = mapping_refusal(device, cudart)
        if why is not None:
            raise InstallError(
                f"expandable:on in {config_mod.ENV_VAR}, but {why}; set expandable:auto (pages where "
                "the driver maps them, regions elsewhere) or expandable:off (regions, one cudaMalloc each)")


def _check_pool_settings() -> None:
    """PyTorch settings under which a MemPool cannot hold the budget as one split segment."""
    import torch
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        text = os.environ.get(var, "")
        if "max_split_size_mb" in text:
            raise InstallError(
                f"{var}={text!r} sets max_split_size_mb, under which PyTorch never splits a "
                "segment that large, so the workspace pool's one budget-sized segment could serve "
                "one workspace at a time; drop max_split_size_mb, or use the process scope")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise InstallError(
            f"PyTorch's CUDA allocator backend is {backend!r}; the workspace scope needs the "
            "native caching allocator, whose MemPools it uses (drop backend:cudaMallocAsync from "
            "PYTORCH_CUDA_ALLOC_CONF, or use the process scope)")


def reserve(device: int) -> None:
    """Creates the device's arenas now, reserving its workspace budget (one cudaMalloc); in
    workspace scope, also the device's workspace pool (``workspace_pool``). After ``release``,
    reserves the budget again."""
    if not is_installed():
        raise InstallError("alloc.reserve() needs alloc.install() first")
    _installed.scope.reserve(device)


def release(device: int) -> None:
    """Gives the device's workspace arena back to the driver (an engine going to sleep), when no
    workspace block is live; ``reserve(device)`` or the next workspace takes the budget again.
    Workspace scope: the device's pool goes with it. Raises ``WorkspaceBusy`` naming what is live;
    nothing is released then."""
    if not is_installed():
        raise InstallError("alloc.release() needs alloc.install() first")
    index = device_index(device)
    with _pool_lock:
        _installed.scope.release_pool(index)
        if lib.ia_plugin_release(index) != lib.IA_OK:
            why = ffi.string(lib.ia_plugin_failure()).decode()
            raise WorkspaceBusy(f"cannot release the workspace of cuda:{index}: {why}")


def _reserve_arena(device: int) -> None:
    if lib.ia_plugin_reserve(device) != lib.IA_OK:
        import torch
        why = ffi.string(lib.ia_plugin_failure()).decode()
        budget = _installed.config.budget_mb
        raise torch.OutOfMemoryError(
            f"indexer-arena: cannot create the arenas of cuda:{device} (workspace budget {budget} "
            f"MiB): {why}. Lower budget_mb in {config_mod.ENV_VAR} or free device memory")


_pool_lock = threading.Lock()


def workspace_pool(device=None):
    """The device's workspace ``torch.cuda.MemPool`` (workspace scope), made at the first call.

    Making it reserves the workspace arena (one cudaMalloc, checked against host memory on
    unified-memory devices) and hands the pool one segment of the whole budget
    (``pool_segment_bytes()``), allocated and freed at once on the current stream. PyTorch keeps
    that segment while the pool lives and splits every workspace out of it; PyTorch gives a
    segment's blocks to the stream it was made on only, so a device's workspaces belong on that
    one stream. Later calls return the same pool.
    """
    return _scope().pool(device)


def pool_segment_bytes() -> int:
    """Workspace scope: the pool's one segment, the budget rounded up the way PyTorch rounds a
    segment (to 2 MiB, 20 MiB at least). The arena reserves it and 2 MiB more, PyTorch's segment
    of small blocks, for workspace requests of 1 MiB or less."""
    return int(lib.ia_plugin_pool_segment())


@contextlib.contextmanager
def workspace() -> Iterator[None]:
    """CUDA allocations of this thread inside the block come from the device's workspace arena.

    Process scope: the C core routes them. Workspace scope: the block enters the current
    device's workspace pool (``torch.cuda.use_mem_pool``); a request the pool cannot place raises
    ``torch.OutOfMemoryError`` naming the budget and the segment asked for, and once it leaves the
    block, also what the pool has in use and its largest free block (read from PyTorch then, not
    inside its allocator). Without ``install()`` the scope changes nothing: tensors come from
    whatever allocator PyTorch has. Scopes nest.
    """
    with _scope().workspace():
        yield


def pool_snapshot(device=None) -> list[dict]:
    """Workspace scope: the segments of the device's workspace pool, as
    ``torch.cuda.memory_snapshot()`` describes segments (each with its blocks); PyTorch splits the
    pool's workspaces out of them."""
    import torch
    arena = device_arena(device_index(device), "workspace")
    if arena is None:
        return []
    inside = [(r.base, r.base + r.size) for r in arena.regions()]
    return [seg for seg in torch.cuda.memory_snapshot()
            if any(lo <= seg["address"] < hi for lo, hi in inside)]


def _pool_state(device: int) -> str:
    """What the pool holds, from PyTorch's own view of its segments."""
    used = largest = 0
    for seg in pool_snapshot(device):
        for block in seg["blocks"]:
            if block["state"] == "inactive":
                largest = max(largest, block["size"])
            else:
                used += block["size"]
    return (f"The pool had {fmt_bytes(used)} in use, largest free block {fmt_bytes(largest)}, "
            f"and never grows: raise budget_mb in {config_mod.ENV_VAR} (or "
            f"{config_mod.VLLM_BUDGET_VAR}), or plan smaller pieces.")


def _pool_stats(device: int) -> dict[str, dict]:
    out = {}
    for pool in POOLS:
        arena = device_arena(device, pool)
        out[pool] = arena.stats() if arena else stats_dict(ffi.new("ia_stats_t *"))
    return out


#: PyTorch's kinds, as torch.cuda.memory_stats() names them, in ia_torch_stats_t's order (PyTorch's
#: StatType: IA_STAT_ALL, then IA_POOL_SMALL and IA_POOL_LARGE).
TORCH_KINDS = ("all", "small_pool", "large_pool")
_TORCH_FIELDS = ("current", "peak", "allocated", "freed")


def memory_stats(device: int | None = None) -> dict:
    """PyTorch's ``memory_stats()`` keys, with PyTorch's meaning, as the C core fills them for
    ``torch.cuda.memory_stats()`` too (ia_plugin_torch_stats; csrc/arena/arena.h, IA_STAT_QUADS, pairs
    each of PyTorch's families with the arena's quantity and says what it counts):

    - ``allocated_bytes``, ``requested_bytes``, ``allocation``: bytes (rounded; as asked) and blocks
      handed out and not yet freed;
    - ``active``, ``active_bytes``: those plus blocks freed but not yet reusable, which the arena
      never has (a free is reusable at once: another stream's reuse waits on an event on the GPU);
    - ``reserved_bytes``, ``segment``: memory held from the driver and its regions (mapped pools:
      the mapped stretches of the address range);
    - ``inactive_split``, ``inactive_split_bytes``: free blocks of regions that are split (none in
      mapped pools, as PyTorch counts none in expandable segments);
    - each as ``<family>.<all|small_pool|large_pool>.<current|peak|allocated|freed>``: ``all`` is
      every arena of the device, graph pools included, ``small_pool``/``large_pool`` the general
      pools; ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free``.

    Beside them, ``arena.<pool>.<stat>`` for every statistic of every arena (pools: workspace,
    small, large; ``alloc.Arena.stats()`` keys), ``arena.expandable`` (1 when the general pools map
    pages), ``arena.graphs.*`` and ``arena.outside.*`` (``outside_stats``). In workspace scope
    PyTorch's keys are PyTorch's own (``torch.cuda.memory_stats()``, which counts the workspace
    pool)."""
    device = device_index(device)
    return {**_scope().memory_stats(device, _pool_stats(device)), **outside_stats(device)}


def _core_memory_stats(device: int, pools: dict[str, dict]) -> dict:
    """``memory_stats`` as the C core counts: PyTorch's keys for every arena of the device."""
    s = ffi.new("ia_torch_stats_t *")
    lib.ia_plugin_torch_stats(device, s)
    out: dict[str, float] = {}
    for family, member in ffi.typeof("ia_torch_stats_t").fields:
        value = getattr(s, family)
        if member.type.kind != "array":  # num_alloc_retries, num_ooms, num_device_alloc/free
            out[family] = int(value)
            continue
        for kind, stat in zip(TORCH_KINDS, value):
            for name in _TORCH_FIELDS:
                out[f"{family}.{kind}.{name}"] = int(getattr(stat, name))
    out["arena.expandable"] = int(device_is_expandable(device))
    for pool, stats in pools.items():
        for key, value in stats.items():
            out[f"arena.{pool}.{key}"] = value
    held = graph_pools(device)
    for key in ("capacity", "in_use", "workspace"):
        out[f"arena.graphs.{key}"] = sum(p[key] for p in held)
        for p in held:
            out[f"arena.graphs.{p['id'][0]}_{p['id'][1]}.{key}"] = p[key]
    return out


_outside: dict[int, tuple[int, int]] = {}
_outside_lock = threading.Lock()


def count_outside(device: int, nbytes: int) -> None:
    """Counts a workspace request served outside the arena (alloc.engines: decode logits larger
    than the budget go to the current allocator instead of failing)."""
    with _outside_lock:
        calls, total = _outside.get(device, (0, 0))
        _outside[device] = (calls + 1, total + nbytes)


def outside_stats(device: int) -> dict:
    """``arena.outside.calls`` and ``arena.outside.bytes``: the device's workspace requests served
    outside the arena (``count_outside``), bytes as estimated when they were diverted."""
    calls, total = _outside.get(device, (0, 0))
    return {"arena.outside.calls": calls, "arena.outside.bytes": total}


def reset_peak_memory_stats(device: int | None = None) -> None:
    _scope().reset_peaks(device_index(device))


def _device_total(total: str, field: str, torch_name: str, device) -> int:
    return _scope().device_total(total, field, torch_name, device_index(device))


def memory_allocated(device: int | None = None) -> int:
    return _device_total("in_use", "current", "memory_allocated", device)


def max_memory_allocated(device: int | None = None) -> int:
    return _device_total("in_use", "peak", "max_memory_allocated", device)


def memory_reserved(device: int | None = None) -> int:
    return _device_total("capacity", "current", "memory_reserved", device)


def max_memory_reserved(device: int | None = None) -> int:
    return _device_total("capacity", "peak", "max_memory_reserved", device)

