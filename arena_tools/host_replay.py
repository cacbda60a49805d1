"""Replaying a trace on the CPU, on host-backed ``alloc.Arena`` objects laid out as the C core
lays out a device (``alloc.plugin.pool_options``): see arena_tools.replay."""

from __future__ import annotations

from alloc.plugin import POOLS

from .export import TraceFile
from .plan import WORKSPACE, Plan, compile_trace, result_row, run_ops, workspace_budget


def host_arena(pool: int, budget: int, alignment: int, device: int):
    """The arena of pool index ``pool``: the workspace fixed at ``budget``; a general pool as the
    C core makes it."""
    from alloc.arena import Arena
    from alloc.plugin import pool_options
    name = f"host {device} {POOLS[pool]}"
    if pool == WORKSPACE:
        return Arena(budget, alignment, "host", growable=False, name=name)
    return Arena(backend="host", name=name, **pool_options(POOLS[pool]))


def replay_host(trace: TraceFile, *, budget: int | None = None, alignment: int = 256,
                workspace_all: bool = False, keep_report: bool = False, progress=None,
                sample_every: int = 64, plan: Plan | None = None) -> dict:
    """Replays the trace on host-backed arenas (see the module's docstring). ``progress`` is a
    callable(done, total), True for a progress bar, or False/None."""
    from alloc.errors import ArenaError, ArenaOutOfMemory
    plan = plan or compile_trace(trace, workspace_all=workspace_all)
    budget, why = workspace_budget(trace, budget)
    arenas: dict[tuple[int, int], object] = {}

    def arena(device: int, pool: int):
        a = arenas.get((device, pool))
        if a is None:
            try:
                a = arenas[(device, pool)] = host_arena(pool, budget, alignment, device)
            except ArenaOutOfMemory as e:  # the replay cannot run at all: not a failure it measures
                raise ArenaError(f"{e}; the host replay holds the workspace budget ({why}) in this "
                                 "machine's memory: pass a smaller --budget-mb") from None
        return a

    # The recorded streams by index: a host arena needs their identity only, and a recorded handle
    # may be any 64-bit value, the core's "no stream" (2**64 - 1) among them.
    ids = {s: i for i, s in enumerate(plan.streams)}

    def allocate(size, device, pool, stream):
        a = arena(device, pool)
        return a, a.allocate(size, ids[stream])

    def free(handle, stream):
        handle[0].free(handle[1], ids[stream])

    peak_sum = 0

    def sample():
        nonlocal peak_sum
        peak_sum = max(peak_sum, sum(a.stats()["capacity"] for a in arenas.values()))

    try:
        with _progress_bar(progress, len(plan.ops), "host") as tick:
            loop = run_ops(plan, allocate, free, sample=sample, sample_every=sample_every, progress=tick,
                           failure_types=(ArenaOutOfMemory,))
        stats = {(d, POOLS[p]): a.stats() for (d, p), a in arenas.items()}
        ws = [s for (d, p), s in stats.items() if p == "workspace"]
        result = result_row(
            "host", loop, plan, where="cpu", budget=budget, budget_source=why,
            peak_reserved_bytes=max([peak_sum, *(s["capacity_peak"] for s in stats.values())]),
            peak_in_use_bytes=sum(s["in_use_peak"] for s in stats.values()),
            peak_device_bytes=None,
            workspace_in_use_peak=ws[0]["in_use_peak"] if ws else None,
            fragmentation=ws[0]["fragmentation"] if ws else None,
            largest_free=ws[0]["largest_free"] if ws else None,
            arenas={f"{d}/{p}": s for (d, p), s in stats.items()})
        if keep_report:
            from .arena_report import collect
            result["report"] = collect({(d, POOLS[p]): a for (d, p), a in arenas.items()},
                                       budget=budget)
        return result
    finally:
        for a in arenas.values():
            a.close()


class _progress_bar:
    """A rich progress bar as a context manager yielding tick(done), or None when switched off."""

    def __init__(self, progress, total: int, label: str):
        self.progress, self.total, self.label, self.bar = progress, total, label, None

    def __enter__(self):
        if callable(self.progress):
            return lambda done: self.progress(done, self.total)
        if not self.progress:
            return None
        from .textout import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), transient=True)
        self.bar.start()
        task = self.bar.add_task(f"replaying on {self.label}", total=self.total)
        return lambda done: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
