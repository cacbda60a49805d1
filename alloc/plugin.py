"""The arena as PyTorch's CUDA allocator.

``install()`` hands PyTorch the C core's entry points through ``CUDAPluggableAllocator``; from then
on every CUDA tensor of the process comes from this package's arenas. ``workspace()`` routes the
allocations of the calling thread to the device's fixed workspace arena. ``memory_stats()`` stands
in for ``torch.cuda.memory_stats()``, which raises under any pluggable allocator.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from . import config as config_mod
from ._core import ffi, lib
from .arena import Arena, stats_dict
from .errors import InstallError

POOLS = ("workspace", "small", "large")


@dataclass
class _Installed:
    config: config_mod.Config
    allocator: object  # torch.cuda.memory.CUDAPluggableAllocator; keeps the hooks alive
    keepalive: tuple


_state_lock = threading.Lock()
_installed: _Installed | None = None


def core_library_path() -> str:
    """Path of the loaded C core: the .so PyTorch must dlopen to find the entry points."""
    import alloc._core as core
    return core.__file__


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


def install(config: config_mod.Config | None = None, *, devices: Iterable[int] = ()) -> config_mod.Config:
    """Makes the arena PyTorch's CUDA allocator for this process.

    Must run before anything initialises CUDA (any ``.cuda()``, ``torch.cuda.set_device``, a
    ``MemPool``...). ``config`` defaults to the environment (INDEXER_ARENA_CONF and
    VLLM_SPARSE_INDEXER_MAX_LOGITS_MB). A device's general pools start at its first allocation and
    its workspace arena at its first workspace allocation; ``devices`` reserves the workspace
    arenas of those device indices right away (what unified-memory machines want: the budget is
    taken and committed before the model loads). A second call with the same configuration does
    nothing; with another one it raises, since the first one's arenas already exist.
    """
    global _installed
    config = config if config is not None else config_mod.from_env()
    with _state_lock:
        if _installed is not None:
            if config != _installed.config:
                raise InstallError(
                    f"the allocator is already installed with {_installed.config}; it cannot be "
                    f"installed again with {config} in the same process")
            for device in devices:
                reserve(device)
            return _installed.config
        import torch
        if not torch.cuda.is_available():
            raise InstallError("torch sees no CUDA device; the arena allocator needs one "
                               "(on the CPU use alloc.Arena with the host backend)")
        if torch.cuda.is_initialized():
            raise InstallError(
                "CUDA is already initialised in this process, and PyTorch cannot change its "
                "allocator after that. Call alloc.install() first thing in the worker, before any "
                "tensor is moved to the GPU and before torch.cuda.set_device() or a MemPool")
        from . import oom_shim
        cudart = loaded_cudart()
        strings = tuple(ffi.new("char[]", s.encode()) if s else ffi.NULL
                        for s in (cudart, config.meminfo, config.oom_report))
        c = ffi.new("ia_plugin_config_t *")
        c.budget = config.budget_bytes
        c.alignment = config.alignment
        c.cudart_path, c.meminfo_path, c.oom_report_path = strings
        c.unified = {"auto": -1, "off": 0, "on": 1}[config.unified]
        c.host_headroom = config.host_headroom_bytes
        c.raise_oom = ffi.cast("void (*)(const char *)", oom_shim.raise_oom_address())
        if lib.ia_plugin_configure(c) != lib.IA_OK:
            raise InstallError("the C core refused the configuration: a device already has arenas")
        if config.trace and lib.ia_plugin_trace_start(config.trace) != lib.IA_OK:
            raise InstallError(f"could not allocate a trace ring of {config.trace} events")

        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            core_library_path(), "ia_torch_alloc", "ia_torch_free")
        hooks = allocator.allocator()
        hooks.set_reset_fn(_address("ia_torch_empty_cache"))
        hooks.set_record_stream_fn(_address("ia_torch_record_stream"))
        hooks.set_memory_fraction_fn(_address("ia_torch_memory_fraction"))
        torch.cuda.memory.change_current_allocator(allocator)
        _installed = _Installed(config, allocator, (strings, c))
    for device in devices:
        reserve(device)
    return config


def _address(function: str) -> int:
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, function)))


def reserve(device: int) -> None:
    """Creates the device's arenas now, reserving its workspace budget (one cudaMalloc)."""
    if not is_installed():
        raise InstallError("alloc.reserve() needs alloc.install() first")
    if lib.ia_plugin_reserve(device) != lib.IA_OK:
        import torch
        why = ffi.string(lib.ia_plugin_failure()).decode()
        budget = _installed.config.budget_mb
        raise torch.OutOfMemoryError(
            f"indexer-arena: cannot create the arenas of cuda:{device} (workspace budget {budget} "
            f"MiB): {why}. Lower budget_mb in {config_mod.ENV_VAR} or free device memory")


@contextlib.contextmanager
def workspace() -> Iterator[None]:
    """CUDA allocations of this thread inside the block come from the device's workspace arena.

    Without ``install()`` the scope changes nothing: tensors come from whatever allocator PyTorch
    has. Scopes nest.
    """
    lib.ia_workspace_enter()
    try:
        yield
    finally:
        lib.ia_workspace_exit()


def in_workspace() -> bool:
    return lib.ia_workspace_depth() > 0


def device_arena(device: int, pool: str) -> Arena | None:
    """A read-only view of one of the device's arenas (None before the device's first use)."""
    handle = lib.ia_plugin_arena(device, POOLS.index(pool))
    if handle == ffi.NULL:
        return None
    return Arena.view(handle, name=f"cuda:{device} {pool}", backend="cuda", device=device)


def _pool_stats(device: int) -> dict[str, dict]:
    out = {}
    for pool in POOLS:
        arena = device_arena(device, pool)
        out[pool] = arena.stats() if arena else stats_dict(ffi.new("ia_stats_t *"))
    return out


def memory_stats(device: int | None = None) -> dict:
    """PyTorch's ``memory_stats()`` keys wherever one applies, plus ``arena.<pool>.<stat>`` for
    every statistic of every arena (pools: workspace, small, large)."""
    device = _device_index(device)
    pools = _pool_stats(device)
    totals = lib.ia_plugin_device_totals(device)

    def total(key: str) -> int:
        return sum(p[key] for p in pools.values())

    out: dict[str, float] = {}
    for metric, names in (("all", POOLS), ("small_pool", ("small",)), ("large_pool", ("large",))):
        chosen = [pools[p] for p in names]

        def summed(key: str) -> int:
            return sum(p[key] for p in chosen)

        if metric == "all":  # device-wide peaks are kept exact in C, not summed per pool
            in_use, in_use_peak = totals.in_use, totals.in_use_peak
            capacity, capacity_peak = totals.capacity, totals.capacity_peak
        else:
            in_use, in_use_peak = summed("in_use"), summed("in_use_peak")
            capacity, capacity_peak = summed("capacity"), summed("capacity_peak")
        for name in ("allocated_bytes", "active_bytes"):
            out[f"{name}.{metric}.current"] = in_use
            out[f"{name}.{metric}.peak"] = in_use_peak
            out[f"{name}.{metric}.allocated"] = summed("allocated_total")
            out[f"{name}.{metric}.freed"] = summed("freed_total")
        out[f"reserved_bytes.{metric}.current"] = capacity
        out[f"reserved_bytes.{metric}.peak"] = capacity_peak
        out[f"requested_bytes.{metric}.current"] = summed("requested")
        for name in ("allocation", "active"):
            out[f"{name}.{metric}.current"] = summed("blocks_in_use")
            out[f"{name}.{metric}.allocated"] = summed("requests_served")
            out[f"{name}.{metric}.freed"] = summed("frees")
        out[f"segment.{metric}.current"] = summed("regions")
        out[f"segment.{metric}.allocated"] = summed("backend_reserves")
        out[f"segment.{metric}.freed"] = summed("backend_releases")
        out[f"inactive_split.{metric}.current"] = summed("free_blocks")
        out[f"inactive_split_bytes.{metric}.current"] = summed("free_bytes")
    out["num_alloc_retries"] = total("retries") + int(lib.ia_plugin_retries())
    out["num_ooms"] = int(lib.ia_plugin_ooms())
    out["num_device_alloc"] = total("backend_reserves")
    out["num_device_free"] = total("backend_releases")
    for pool, stats in pools.items():
        for key, value in stats.items():
            out[f"arena.{pool}.{key}"] = value
    return out


def reset_peak_memory_stats(device: int | None = None) -> None:
    lib.ia_plugin_reset_peaks(_device_index(device))


def memory_allocated(device: int | None = None) -> int:
    return int(lib.ia_plugin_device_totals(_device_index(device)).in_use)


def max_memory_allocated(device: int | None = None) -> int:
    return int(lib.ia_plugin_device_totals(_device_index(device)).in_use_peak)


def memory_reserved(device: int | None = None) -> int:
    return int(lib.ia_plugin_device_totals(_device_index(device)).capacity)


def max_memory_reserved(device: int | None = None) -> int:
    return int(lib.ia_plugin_device_totals(_device_index(device)).capacity_peak)


def device_is_unified(device: int | None = None) -> bool:
    """Whether the device's arenas guard against host memory (False before its first use)."""
    return bool(lib.ia_plugin_device_unified(_device_index(device)))


def _device_index(device) -> int:
    if device is None:
        import torch
        return torch.cuda.current_device()
    if hasattr(device, "index"):  # torch.device
        return device.index if device.index is not None else _device_index(None)
    return int(device)
