"""A recorded trace as a list of operations, and the loop that replays them under any allocator
(the host-backed arenas of arena_tools.host_replay, or an allocator on the GPU in
arena_tools.gpu_replay); arena_tools.replay is the command that compares them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from alloc.errors import ConfigError
from alloc.plugin import POOLS, SMALL_REQUEST
from alloc.units import MAX_SIZE, MiB, bound_name, bounded

from .export import TraceFile, TraceFormatError

ALLOC, FREE, FAIL = 0, 1, 2
WORKSPACE, SMALL, LARGE = (POOLS.index(p) for p in ("workspace", "small", "large"))


# -- the trace as operations ---------------------------------------------------------------------------
@dataclass
class Plan:
    """The trace as a flat list of operations: (kind, slot, size, device, pool, stream). An
    allocation fills ``slot`` (a dense index), its free empties it."""
    ops: list[tuple[int, int, int, int, int, int]]
    slots: int
    devices: list[int]
    streams: list[int]
    trace_failures: int
    peak_live: int           # most bytes the trace's own live allocations asked for at once
    peak_op: int             # index of the op after which that peak holds
    workspace_ops: int
    events: int = 0
    pools: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        out = asdict(self)
        del out["ops"]
        out["ops"] = len(self.ops)
        out["allocations"] = sum(1 for op in self.ops if op[0] == ALLOC)
        out["frees"] = sum(1 for op in self.ops if op[0] == FREE)
        return out


def _pool_index(pool: str, size: int, workspace_all: bool) -> int:
    if workspace_all or pool == "workspace":
        return WORKSPACE
    if pool in ("small", "large"):
        return POOLS.index(pool)
    return SMALL if size <= SMALL_REQUEST else LARGE  # general / unknown: the plugin's routing


def compile_trace(trace: TraceFile, *, workspace_all: bool = False) -> Plan:
    """The operations to replay (reservations are the allocator's business, not replayed)."""
    ops, live, slot_pool = [], {}, []
    live_bytes = peak = peak_op = failures = 0
    devices, streams, pools = set(), {}, {}
    for e in trace.events:
        key = (e.device, e.address)
        if e.action == "alloc":
            if e.size == 0:
                continue
            pool = _pool_index(e.pool, e.size, workspace_all)
            slot = len(slot_pool)
            slot_pool.append((pool, e.size))
            live[key] = slot
            ops.append((ALLOC, slot, e.size, e.device, pool, e.stream))
            live_bytes += e.size
            if live_bytes > peak:
                peak, peak_op = live_bytes, len(ops) - 1
        elif e.action == "free":
            slot = live.pop(key, None)
            if slot is None:
                continue  # free(NULL), or an allocation the trace does not hold (check() decided)
            pool, size = slot_pool[slot]
            ops.append((FREE, slot, size, e.device, pool, e.stream))
            live_bytes -= size
        elif e.action == "fail":
            failures += 1
            ops.append((FAIL, -1, e.size, e.device, _pool_index(e.pool, e.size, workspace_all), e.stream))
        else:
            continue
        devices.add(e.device)
        streams.setdefault(e.stream, None)
        name = POOLS[ops[-1][4]]
        pools[name] = pools.get(name, 0) + 1
    return Plan(ops, len(slot_pool), sorted(devices), list(streams), failures, peak, peak_op,
                sum(1 for op in ops if op[4] == WORKSPACE and op[0] != FREE), len(trace.events), pools)


def workspace_budget(trace: TraceFile, budget: int | None = None) -> tuple[int, str]:
    """(bytes, where it came from): ``budget`` when given, else the trace's, else the
    configuration's."""
    if budget:
        why = "given"
    elif trace.budget:
        budget, why = trace.budget, "recorded in the trace"
    else:
        from alloc.config import ENV_VAR, from_env
        return from_env().budget_bytes, f"the configuration's: {ENV_VAR} or its default"
    try:  # a trace records its budget as a region's size, which may be any 64-bit count
        bounded(budget, 1, MAX_SIZE)
    except ValueError as e:
        if why == "given":
            raise ConfigError("budget", budget, f"1 to {bound_name(MAX_SIZE)} bytes", reason=str(e)) from None
        raise TraceFormatError(trace.path, None, f"the workspace budget it records, {budget} bytes, is "
                               f"{e}; pass --budget-mb") from None
    return budget, why


# -- the loop, shared by every allocator -------------------------------------------------------------------
@dataclass
class LoopResult:
    ops: int = 0
    seconds: float = 0.0
    failures: int = 0
    unexpected_successes: int = 0
    first_failure: str = ""


def run_ops(plan: Plan, allocate: Callable[[int, int, int, int], int], free: Callable[[int, int], None],
            *, set_pool: Callable[[int], None] | None = None, sample: Callable[[], None] | None = None,
            sample_every: int = 64, sample_bytes: int = 2 * MiB, progress: Callable[[int], None] | None = None,
            failure_types: tuple[type[BaseException], ...] = (MemoryError,)) -> LoopResult:
    """Replays ``plan``: ``allocate(size, device, pool, stream) -> handle`` raising one of
    ``failure_types`` when the allocator refuses, ``free(handle, stream)``. ``set_pool(pool)`` is
    called before an allocation whose pool differs from the previous one's. ``sample()`` (memory
    sampling) and ``progress(done)`` are timed apart from the replay."""
    handles: list = [None] * plan.slots
    res = LoopResult()
    current_pool = -1
    overhead = 0.0
    step = max(1, len(plan.ops) // 200)
    peak_op = plan.peak_op
    clock = time.perf_counter
    start = clock()
    for i, (kind, slot, size, device, pool, stream) in enumerate(plan.ops):
        if kind == FREE:
            handle = handles[slot]
            if handle is not None:
                free(handle, stream)
                handles[slot] = None
                res.ops += 1
        else:
            if set_pool is not None and pool != current_pool:
                set_pool(pool)
                current_pool = pool
            res.ops += 1
            try:
                handle = allocate(size, device, pool, stream)
            except failure_types as e:
                res.failures += 1
                if not res.first_failure:
                    res.first_failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                handle = None
            if kind == FAIL and handle is not None:
                res.unexpected_successes += 1
                free(handle, stream)
                res.ops += 1
            elif handle is not None:
                handles[slot] = handle
        if sample is not None and (i == peak_op or i % sample_every == 0
                                   or (kind != FREE and size >= sample_bytes)):
            t = clock()
            sample()
            overhead += clock() - t
        if progress is not None and i % step == 0:
            t = clock()
            progress(i)
            overhead += clock() - t
    if set_pool is not None and current_pool != -1:
        set_pool(-1)
    if sample is not None:
        t = clock()
        sample()
        overhead += clock() - t
    res.seconds = clock() - start - overhead
    if progress is not None:
        progress(len(plan.ops))
    return res


def result_row(name: str, loop: LoopResult, plan: Plan, **extra) -> dict:
    return {"allocator": name, "ops": loop.ops, "seconds": loop.seconds,
            "ops_per_s": loop.ops / loop.seconds if loop.seconds > 0 else None,
            "failures": loop.failures, "trace_failures": plan.trace_failures,
            "unexpected_successes": loop.unexpected_successes, "first_failure": loop.first_failure,
            **extra}
