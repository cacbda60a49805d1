"""The C core's event ring read out, and written to a file at exit (the ``trace_file`` key).

Apart from alloc.trace (which switches recording on and wraps a ring) so that install, in
alloc.plugin, can start the file's recording without an import circle: this module needs the
compiled core, the records and the device's pools (alloc.devices), nothing of the plugin.
"""

from __future__ import annotations

import atexit
import os
import sys

from ._lib import ffi, lib
from .devices import POOLS
from .records import Event, write_csv

ACTIONS = {lib.IA_TRACE_ALLOC: "alloc", lib.IA_TRACE_FREE: "free", lib.IA_TRACE_FAIL: "fail",
           lib.IA_TRACE_RESERVE: "reserve", lib.IA_TRACE_RELEASE: "release"}


def read_events(handle) -> tuple[list[Event], int]:
    """The events a ring holds, oldest first, and how many older ones it dropped."""
    held = lib.ia_trace_read(handle, ffi.NULL, 0, ffi.NULL)
    buf = ffi.new("ia_trace_event_t[]", max(held, 1))
    dropped = ffi.new("uint64_t *")
    held = min(held, lib.ia_trace_read(handle, buf, held, dropped))
    events = [Event(int(e.time_ns), int(e.thread), ACTIONS[e.action], int(e.address), int(e.size),
                    int(e.stream), int(e.device),
                    POOLS[e.pool] if e.pool < len(POOLS) else str(e.pool)) for e in buf[0:held]]
    return events, int(dropped[0])


AT_EXIT_CAPACITY = 1 << 20
"""The ring of a trace written at exit when the ``trace`` key does not size it."""


def write_at_exit(path: str, capacity: int = 0) -> None:
    """Records the installed allocator's events from now on and writes them to ``path`` when the
    process exits, as RMM's logging adaptor leaves its log file (the ``trace_file`` key; install
    calls this). The events of the ring are written, oldest first; a full ring has dropped the
    oldest, and the line on standard error says how many."""
    if lib.ia_plugin_trace_start(capacity or AT_EXIT_CAPACITY) != lib.IA_OK:
        raise MemoryError(f"cannot allocate a trace ring of {capacity or AT_EXIT_CAPACITY} events")
    atexit.register(_write_trace, os.path.abspath(path))


def _write_trace(path: str) -> None:
    handle = lib.ia_plugin_trace()
    if handle == ffi.NULL:
        return
    events, dropped = read_events(handle)
    try:
        write_csv(events, path)
    except OSError as e:  # at exit nothing can be raised to: say it, once
        print(f"indexer-arena: could not write the trace to {path!r} (trace_file): {e.strerror or e}",
              file=sys.stderr)
        return
    if dropped:
        print(f"indexer-arena: trace written to {path}: the last {len(events)} events; the ring "
              f"dropped {dropped} older ones (raise the trace key)", file=sys.stderr)
