"""A recorded trace on host-backed arenas, shared by the export, report and replay tests.

The workspace arena is fixed; the general arena is the one the host replay builds for the "large"
pool (arena_tools.host_replay.host_arena), attached to the trace before its first region, so that a replay
must reproduce both exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from alloc import Arena, ArenaOutOfMemory
from arena_tools.host_replay import host_arena
from arena_tools.plan import LARGE
from alloc.trace import Event, Trace

KiB, MiB = 1 << 10, 1 << 20
BUDGET = 2 * MiB


@dataclass
class Recorded:
    trace: Trace
    arenas: dict          # (device, pool) -> Arena
    events: list[Event]
    dropped: int
    failures: int

    def close(self):
        for a in self.arenas.values():
            a.close()


def record(seed: int = 1, steps: int = 400, capacity: int = 1 << 14, general: bool = True) -> Recorded:
    rng = random.Random(seed)
    trace = Trace(capacity)
    ws = Arena(BUDGET, 256, "host", name="ws")
    trace.attach(ws, device=0, pool="workspace")
    arenas = {(0, "workspace"): ws}
    if general:
        g = host_arena(LARGE, BUDGET, 256, 0)
        trace.attach(g, device=0, pool="large")
        arenas[(0, "large")] = g
    live: list[tuple[Arena, int, int]] = []
    failures = 0
    for step in range(steps):
        if live and rng.random() < 0.45:
            arena, p, stream = live.pop(rng.randrange(len(live)))
            arena.free(p, stream)
            continue
        arena = ws if not general or rng.random() < 0.7 else arenas[(0, "large")]
        if arena is ws:
            size = rng.choice([1, 100, 256, 1000, 4 * KiB, 50 * KiB, 200 * KiB, 600 * KiB])
        else:
            size = rng.choice([3 * MiB, 12 * MiB, 700 * KiB, 30 * MiB])
        stream = rng.choice([0, 0, 0, 7])
        try:
            live.append((arena, arena.allocate(size, stream), stream))
        except ArenaOutOfMemory:
            failures += 1
        if step == steps // 2:
            try:
                ws.allocate(BUDGET + 1)
            except ArenaOutOfMemory:
                failures += 1
    events, dropped = trace.events()
    return Recorded(trace, arenas, events, dropped, failures)
