"""The memory report of live arenas: the structure the C core writes on out-of-memory (see
arena_tools.report), built from ``alloc.Arena`` objects (host-backed ones, or the installed
allocator's views of its arenas)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from alloc.errors import ArenaError

if TYPE_CHECKING:
    from alloc.arena import Arena

REPORT_FORMAT = "indexer-arena-report-2"
# Format 1 wrote the counters of blocks and of bytes handed out under these names; format 2 writes
# every quantity as `name`, `name_peak`, `name_allocated`, `name_freed` (csrc/arena/arena.h).
FORMAT_1 = "indexer-arena-report-1"
FORMAT_1_NAMES = {"blocks_in_use": "blocks", "requests_served": "blocks_allocated", "frees": "blocks_freed",
                  "allocated_total": "in_use_allocated", "freed_total": "in_use_freed"}


def arena_blocks(arena: Arena) -> list[list[int]]:
    """The arena's blocks in the report's form: [region_base, offset, size, requested, used, stream]."""
    return [[b.address - b.offset, b.offset, b.size, b.requested, 1 if b.state == "used" else 0, b.stream]
            for b in arena.blocks()]


def pool_order(pool: str) -> tuple[int, str]:
    """Sort key of a pool name: the C core's pools in its order, any other name after them."""
    from alloc.plugin import POOLS
    return (POOLS.index(pool), "") if pool in POOLS else (len(POOLS), pool)


def collect(arenas: Mapping | Iterable, *, budget: int | None = None,
            unified: bool | Mapping[int, bool] = False) -> dict:
    """The report of some arenas. ``arenas`` maps ``(device, pool)`` or ``pool`` (device 0, or the
    arena's own device) to ``alloc.Arena`` objects, or is an iterable of (device, pool, arena).
    ``budget`` defaults to the capacity of the first workspace arena."""
    items = []
    pairs = arenas.items() if isinstance(arenas, Mapping) else ((k[:2], k[2]) for k in arenas)
    for key, arena in pairs:
        if arena is None:
            continue
        if isinstance(key, tuple):
            device, pool = key
        else:
            device, pool = (arena.device if arena.device is not None else 0), key
        items.append((int(device), str(pool), arena))
    devices: dict[int, list[dict]] = {}
    for device, pool, arena in sorted(items, key=lambda t: (t[0], pool_order(t[1]))):
        devices.setdefault(device, []).append(
            {"pool": pool, "stats": arena.stats(), "blocks": arena_blocks(arena)})
    if budget is None:
        budget = next((p["stats"]["capacity"] for pools in devices.values() for p in pools
                       if p["pool"] == "workspace"), 0)

    def is_unified(d: int) -> bool:
        return bool(unified.get(d, False)) if isinstance(unified, Mapping) else bool(unified)

    return {"format": REPORT_FORMAT, "budget": int(budget),
            "devices": [{"device": d, "unified": is_unified(d), "pools": pools}
                        for d, pools in sorted(devices.items())]}


def live_report() -> dict:
    """The report of the installed allocator, every device that has its arenas (the same structure
    as the out-of-memory report). Blocks and statistics are read arena by arena, each under its
    arena's lock, so allocations made meanwhile by other threads may make them differ slightly."""
    from alloc.plugin import MAX_DEVICES, POOLS, device_arena, device_is_unified, installed_config, is_installed
    if not is_installed():
        raise ArenaError("live_report() reads the installed allocator: call alloc.install() first, "
                         "or pass the arenas to arena_tools.arena_report.collect()")
    arenas, unified = {}, {}
    for device in range(MAX_DEVICES):
        if device_arena(device, "workspace") is None:
            continue
        for pool in POOLS:
            arenas[(device, pool)] = device_arena(device, pool)
        unified[device] = device_is_unified(device)
    return collect(arenas, budget=installed_config().budget_bytes, unified=unified)
