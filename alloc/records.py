"""Plain records of what the C core reports, importable without the compiled core: a reader of a
saved trace (arena_tools.export) needs them and nothing else of the runtime; and the writer of
RMM's CSV log, which the runtime uses for a trace written at exit (alloc.trace) and the tools for
their exports (arena_tools.export describes the format)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .units import U64_MAX

STREAM_NONE = U64_MAX
"""Stream value of memory no stream has touched yet (IA_STREAM_NONE in csrc/arena/internal.h)."""
MAX_STREAM = STREAM_NONE - 1
"""The highest stream an allocation or a free is made on: the core refuses its no-stream value."""


@dataclass(frozen=True)
class Event:
    """One allocation event, as the C core's trace ring records it (alloc.trace reads it out)."""
    time_ns: int
    thread: int
    action: str     # alloc, free, fail, reserve, release
    address: int
    size: int       # requested bytes (alloc, fail); block bytes (free); region bytes
    stream: int
    device: int
    pool: str       # workspace, small, large (plugin arenas) or the tag given to attach()


RMM_COLUMNS = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
EXTRA_COLUMNS = ("Device", "Pool")
CSV_ACTIONS = {"alloc": "allocate", "free": "free", "fail": "allocate failure"}


def format_time(time_ns: int) -> str:
    """RMM's time column: local time of day, ``HH:MM:SS.ffffff``."""
    return time.strftime("%H:%M:%S", time.localtime(time_ns // 10**9)) + f".{time_ns // 1000 % 10**6:06d}"


def csv_lines(events: Iterable[Event], *, extended: bool = True) -> Iterable[str]:
    """The CSV text, one line at a time (newline included)."""
    yield ",".join(RMM_COLUMNS + (EXTRA_COLUMNS if extended else ())) + "\n"
    live: dict[tuple[int, int], int] = {}
    for e in events:
        action = CSV_ACTIONS.get(e.action)
        if action is None:  # reserve / release: not in RMM's vocabulary
            continue
        size = e.size
        if e.action == "alloc":
            live[(e.device, e.address)] = e.size
        elif e.action == "free":
            size = live.pop((e.device, e.address), e.size)
        address = 0 if e.action == "fail" else e.address
        line = f"{e.thread},{format_time(e.time_ns)},{action},{address:#x},{size},{e.stream:#x}"
        if extended:
            line += f",{e.device},{e.pool}"
        yield line + "\n"


def write_csv(events: Iterable[Event], path: str | os.PathLike, *, extended: bool = True) -> None:
    with open(path, "w", newline="") as f:
        f.writelines(csv_lines(events, extended=extended))
