"""Allocation traces (events: alloc.records.Event): the C core records events into a bounded ring with no Python on the hot path;
this module switches recording on and reads the ring out.

A full ring overwrites its oldest events; ``Trace.events()`` reports how many were dropped so a
consumer knows the trace is a suffix of what happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._lib import ffi, lib
from .errors import ArenaError
from .records import Event
from .ring import ACTIONS, POOLS, read_events, write_at_exit  # noqa: F401 (the trace's API)


class Trace:
    """A ring of ``capacity`` events, owned here (for arenas made in Python) or by the plugin."""

    def __init__(self, capacity: int = 1 << 20, *, _handle=None):
        if _handle is not None:
            self._handle, self._owned = _handle, False
            return
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"trace capacity must be a positive number of events, got {capacity!r}")
        out = ffi.new("ia_trace_t **")
        if lib.ia_trace_create(capacity, out) != lib.IA_OK:
            raise MemoryError(f"cannot allocate a trace ring of {capacity} events")
        self._handle, self._owned = out[0], True

    def __del__(self):
        if getattr(self, "_owned", False) and self._handle != ffi.NULL:
            lib.ia_trace_destroy(self._handle)
            self._handle = ffi.NULL

    @property
    def capacity(self) -> int:
        return int(lib.ia_trace_capacity(self._handle))

    def attach(self, arena, device: int = 0, pool: str | int = 0) -> None:
        """Records the events of a Python-made ``alloc.Arena`` into this trace."""
        tag = POOLS.index(pool) if isinstance(pool, str) else int(pool)
        arena._trace = self  # the ring must outlive the arena's use of it
        lib.ia_arena_set_trace(arena._handle(), self._handle, device, tag)

    def enable(self, on: bool = True) -> None:
        lib.ia_trace_set_enabled(self._handle, on)

    def clear(self) -> None:
        lib.ia_trace_clear(self._handle)

    def events(self) -> tuple[list[Event], int]:
        """The held events, oldest first, and how many older ones the ring dropped."""
        return read_events(self._handle)


def plugin_trace() -> Trace | None:
    """The installed allocator's trace, if tracing was ever started."""
    handle = lib.ia_plugin_trace()
    return None if handle == ffi.NULL else Trace(_handle=handle)


@contextlib.contextmanager
def tracing(capacity: int = 1 << 20) -> Iterator[Trace]:
    """Records every allocation event of the installed allocator inside the block.

    The ring is created on first use with ``capacity`` events (or by the ``trace`` key of
    INDEXER_ARENA_CONF at install) and is kept afterwards; events of earlier blocks are cleared.
    """
    from .plugin import is_installed
    if not is_installed():
        raise ArenaError("tracing() records the installed allocator: call alloc.install() first")
    if lib.ia_plugin_trace_start(capacity) != lib.IA_OK:
        raise MemoryError(f"cannot allocate a trace ring of {capacity} events")
    trace = plugin_trace()
    trace.clear()
    try:
        yield trace
    finally:
        trace.enable(False)

