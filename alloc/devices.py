"""What the C core holds for each CUDA device, read without changing it: the device's pools and
their arenas, its CUDA graph pools and their blocks, whether its arenas guard host memory or map
pages, whether its workspace arena is reserved. Alike in either scope and before ``install()``
(a device the core has not served reads as empty); ``alloc.plugin`` installs, routes and counts,
and offers these under its own name too."""

from __future__ import annotations

from ._lib import ffi, lib
from .arena import Arena

POOLS = tuple(ffi.string(lib.ia_plugin_pool_name(p)).decode() for p in range(lib.IA_POOL_COUNT))
"""The pools of a device, in the C core's order: traces and reports name them so."""
MAX_DEVICES = lib.IA_MAX_DEVICES
SMALL_REQUEST = lib.IA_SMALL_REQUEST
"""General requests up to this many bytes go to the small pool, larger ones to the large pool."""


def pool_options(pool: str) -> dict:
    """How the C core makes a device's arena of ``pool``, as ``alloc.Arena`` keyword arguments
    (the workspace arena's ``capacity`` and ``alignment`` are the installed configuration's, 0
    before ``install()``)."""
    o = ffi.new("ia_arena_options_t *")
    if pool not in POOLS or lib.ia_plugin_pool_options(POOLS.index(pool), o) != lib.IA_OK:
        raise ValueError(f"unknown pool {pool!r}; accepted: {', '.join(POOLS)}")
    exact = int(o.region_exact_above)
    return {"capacity": int(o.capacity), "alignment": int(o.alignment), "growable": bool(o.growable),
            "region_min": int(o.region_min), "region_round": int(o.region_round),
            "region_exact_above": None if exact == int(ffi.cast("size_t", -1)) else exact}


def workspace_reserved(device: int) -> bool:
    """Whether the device's workspace arena is reserved now."""
    return bool(lib.ia_plugin_workspace_reserved(int(device)))


def in_workspace() -> bool:
    return lib.ia_workspace_depth() > 0


def device_arena(device: int, pool: str) -> Arena | None:
    """A read-only view of one of the device's arenas (None before the pool's first use). The view
    stays valid for the life of the process: a released workspace arena shows that it holds
    nothing until it is reserved again (Note [Device lifetime], csrc/torch/plugin.h)."""
    handle = lib.ia_plugin_arena(device, POOLS.index(pool))
    if handle == ffi.NULL:
        return None
    return Arena.view(handle, name=f"cuda:{device} {pool}", backend="cuda", device=device)


def graph_pools(device: int | None = None) -> list[dict]:
    """The device's CUDA graph pools (process scope): PyTorch's pool id, how many graphs or
    MemPools hold it, and the bytes it holds (``workspace``: of them, the bytes carved from the
    workspace arena, which eager workspaces cannot use while the pool lives)."""
    device = device_index(device)
    cap = 16
    while True:
        infos = ffi.new("ia_graph_pool_info_t[]", cap)
        n = lib.ia_graph_pools(device, infos, cap)
        if n <= cap:
            break
        cap = n + 16
    return [{"id": (int(i.first), int(i.second)), "use_count": int(i.use_count),
             "capturing": int(i.allocating) > 0, "streams": int(i.streams), "capacity": int(i.capacity),
             "in_use": int(i.in_use), "workspace": int(i.workspace)} for i in infos[0:n]]


def device_is_unified(device: int | None = None) -> bool:
    """Whether the device's arenas guard against host memory (False before its first use)."""
    return bool(lib.ia_plugin_device_unified(device_index(device)))


def device_is_expandable(device: int | None = None) -> bool:
    """Whether the device's general pools map pages of one address range each (``expandable``
    key), rather than reserving regions (False before its first use)."""
    return bool(lib.ia_plugin_device_expandable(device_index(device)))


def device_index(device) -> int:
    """The index of ``device``: an int, a ``torch.device``, or None for the current device."""
    if device is None:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("no device was named and torch sees no CUDA device to take as the current "
                             "one: pass the device index (the core's counters read 0 for a device it "
                             "has not served)")
        return torch.cuda.current_device()
    if hasattr(device, "index"):  # torch.device
        return device.index if device.index is not None else device_index(None)
    return int(device)


def graph_pool_blocks(pool_id: tuple[int, int], device: int | None = None) -> list[dict]:
    """Every block of one CUDA graph pool, live and free: address, size, free or not, stream."""
    device = device_index(device)
    pool = ffi.new("ia_pool_id_t *")
    pool.first, pool.second = pool_id
    while True:
        n = lib.ia_graph_blocks(device, pool[0], ffi.NULL, 0)
        blocks = ffi.new("ia_block_info_t[]", max(n, 1))
        if lib.ia_graph_blocks(device, pool[0], blocks, n) == n:
            break
    return [{"address": int(b.address), "size": int(b.size), "is_free": bool(b.is_free),
             "stream": int(b.stream)} for b in blocks[0:n]]
