"""Plain records of what the C core reports, importable without the compiled core: a reader of a
saved trace (arena_tools.export) needs them and nothing else of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from .units import U64_MAX

STREAM_NONE = U64_MAX
"""Stream value of memory no stream has touched yet (IA_STREAM_NONE in csrc/arena.h)."""


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
