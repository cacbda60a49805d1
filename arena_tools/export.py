"""Allocation traces in formats other tools read, and back.

Two formats:

- **CSV, RMM's logging_resource_adaptor format**: the header ``Thread,Time,Action,Pointer,Size,Stream``,
  then one line per event: the thread id (decimal), the local time of day ``HH:MM:SS.ffffff``,
  ``allocate`` / ``free`` / ``allocate failure``, the pointer in hex (``0x0`` for a failure), the
  size in bytes and the stream in hex. RMM's replay benchmark (benchmarks/replay) and its log parser
  read columns by name, so by default two more columns follow, ``Device,Pool``, which keep which
  device and which arena (workspace or general) served the event; ``extended=False`` writes RMM's
  six columns only. As in RMM's log, the size of a ``free`` is the size its ``allocate`` asked for
  (RMM's resources must be freed with the size they were allocated with). Region reservations are
  not in RMM's vocabulary and are left out of the CSV; the time keeps microseconds of the day.

- **A PyTorch memory snapshot**, the dict ``torch.cuda.memory._snapshot()`` returns, pickled
  (protocol 4, plain dicts, lists, ints and strings, as PyTorch's memory visualizer unpickles):
  each arena region is a segment whose blocks tile it, and the trace is ``device_traces``
  (``alloc``; ``free_requested`` + ``free_completed`` for a free; ``oom`` for a failure;
  ``segment_alloc`` / ``segment_free`` for a region reserved / given back). Every trace entry also
  carries ``ia_seq``, ``ia_thread``, ``ia_pool`` and ``ia_time_ns`` (and a region's ``ia_stream``),
  which the visualizer ignores and which make the round trip exact.

Both readers check what they read and raise TraceFormatError naming the file and the line (or the
trace entry): a bad header, an unknown action, a malformed field, a truncated line, a free of a
pointer no earlier allocation returned, an allocation at an address that is still live.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from alloc.errors import excerpt
from alloc.records import (CSV_ACTIONS, EXTRA_COLUMNS, MAX_STREAM, RMM_COLUMNS,  # noqa: F401 (the CSV writer's home)
                           STREAM_NONE, Event, csv_lines, format_time, write_csv)
from alloc.units import MAX_DEVICES, MAX_SIZE, U64_MAX, bound_name, bounded, is_count, is_int_in, whole_number

ACTION_OF_CSV = {v: k for k, v in CSV_ACTIONS.items()}
GENERAL = "general"
"""Pool of an event whose source does not say which arena served it (RMM logs, PyTorch snapshots)."""

SNAPSHOT_FORMAT = "indexer-arena-snapshot-1"
PICKLE_PROTOCOL = 4  # PyTorch's MemoryViz.js unpickles protocols 2 to 4 only
DAY_NS = 86_400 * 10**9


class TraceFormatError(ValueError):
    """A trace or snapshot file that cannot be read; the message names the file and the line."""

    def __init__(self, path: str, where: str | None, message: str):
        self.path, self.where = path, where
        super().__init__(f"{path}: {where}: {message}" if where else f"{path}: {message}")


@dataclass
class TraceFile:
    """Events read from a file, oldest first, with where each one came from."""
    events: list[Event]
    path: str
    kind: str                           # "csv" (with Device,Pool), "rmm-csv" or "snapshot"
    origins: list = field(default_factory=list)  # per event: line number, or (device, entry)
    dropped: int = 0                    # events the recording ring lost before the first one
    budget: int | None = None           # workspace budget in bytes, when the source says it
    snapshot: dict | None = None        # the snapshot itself, for kind "snapshot"

    def where(self, index: int) -> str:
        origin = self.origins[index] if index < len(self.origins) else None
        if isinstance(origin, tuple):
            return f"device_traces[{origin[0]}][{origin[1]}]"
        return f"line {origin}" if origin is not None else f"event {index}"


# -- CSV ----------------------------------------------------------------------------------------------
def time_of_day_ns(time_ns: int) -> int:
    """What a CSV keeps of a CLOCK_REALTIME time: nanoseconds since local midnight, to the µs."""
    t = time.localtime(time_ns // 10**9)
    return ((t.tm_hour * 60 + t.tm_min) * 60 + t.tm_sec) * 10**9 + time_ns // 1000 % 10**6 * 1000


def _count(text: str, base: int = 10, high: int = U64_MAX) -> int:
    """A field the C core holds in 64 bits (sizes, pointers, streams, threads) or as a device index."""
    return bounded(whole_number(text, base), 0, high)


def _parse_pointer(text: str) -> int:
    if text == "(nil)":  # glibc's %p of NULL, which RMM's parser also accepts
        return 0
    return _count(text, 16)


def _parse_stream(text: str) -> int:
    if text == "(nil)":
        return 0
    return _count(text, 16 if text.lstrip("-")[:2].lower() == "0x" else 10, MAX_STREAM)


def _parse_time(text: str) -> int:
    clock, _, fraction = text.partition(".")
    parts = clock.split(":")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts) \
            or (fraction and not (fraction.isascii() and fraction.isdigit())):
        raise ValueError("expected HH:MM:SS.ffffff")
    h, m, s = map(int, parts)
    if h > 23 or m > 59 or s > 60:
        raise ValueError("expected HH:MM:SS.ffffff")
    return ((h * 60 + m) * 60 + s) * 10**9 + int((fraction + "000000000")[:9])


CSV_FIELDS = {"Thread": _count, "Time": _parse_time, "Pointer": _parse_pointer, "Size": _count,
              "Stream": _parse_stream, "Device": lambda t: _count(t, high=MAX_DEVICES - 1)}
"""How each numeric column is read, bounded to what the C core holds."""


def read_csv(path: str | os.PathLike, *, text: str | None = None) -> TraceFile:
    """Reads a CSV trace: ours (with Device,Pool) or RMM's. Checks the syntax only; see check()."""
    path = os.fspath(path)
    if text is None:
        try:
            with open(path, newline="") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise TraceFormatError(path, None, "not a text file, so not a CSV trace") from None
    lines = text.splitlines(keepends=True)
    if not lines:
        raise TraceFormatError(path, "line 1", "empty file: expected the header "
                               + ",".join(RMM_COLUMNS))
    header = [c.strip() for c in lines[0].lstrip("\ufeff").rstrip("\r\n").split(",")]
    missing = [c for c in RMM_COLUMNS if c not in header]
    doubled = sorted({c for c in header if header.count(c) > 1})
    if missing or doubled:
        why = f"missing {', '.join(missing)}" if missing else f"{excerpt(', '.join(doubled))} appear twice"
        raise TraceFormatError(path, "line 1", f"bad header {excerpt(lines[0].rstrip())} ({why}): expected "
                               f"RMM's logging_resource_adaptor header {','.join(RMM_COLUMNS)}, "
                               f"optionally followed by {','.join(EXTRA_COLUMNS)}")
    col = {name: header.index(name) for name in (*RMM_COLUMNS, *EXTRA_COLUMNS) if name in header}
    extended = all(c in col for c in EXTRA_COLUMNS)
    events: list[Event] = []
    origins: list[int] = []
    day, last_tod = 0, None
    for lineno, raw in enumerate(lines[1:], start=2):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(header):
            cut = " (the last line, cut short: was the file truncated?)" if not raw.endswith("\n") else ""
            raise TraceFormatError(path, f"line {lineno}", f"expected {len(header)} fields "
                                   f"({excerpt(','.join(header))}), found {len(fields)}: {excerpt(line)}{cut}")
        action_text = fields[col["Action"]]
        action = ACTION_OF_CSV.get(action_text)
        if action is None:
            raise TraceFormatError(path, f"line {lineno}", f"unknown action {excerpt(action_text)}; "
                                   f"expected one of {', '.join(ACTION_OF_CSV)}")
        values = {}
        for name, parse in CSV_FIELDS.items():
            if name not in col:
                continue
            try:
                values[name] = parse(fields[col[name]])
            except ValueError as e:
                raise TraceFormatError(path, f"line {lineno}",
                                       f"bad {name} {excerpt(fields[col[name]])}: {e}") from None
        pool = fields[col["Pool"]] if "Pool" in col else GENERAL
        if not pool:
            raise TraceFormatError(path, f"line {lineno}", "empty Pool")
        tod = values["Time"]
        if last_tod is not None and tod < last_tod - DAY_NS // 2:
            day += 1  # the log ran past midnight
        last_tod = tod
        events.append(Event(time_ns=day * DAY_NS + tod, thread=values["Thread"], action=action,
                            address=0 if action == "fail" else values["Pointer"], size=values["Size"],
                            stream=values["Stream"], device=values.get("Device", 0), pool=pool))
        origins.append(lineno)
    return TraceFile(events, path, "csv" if extended else "rmm-csv", origins)


# -- checking ------------------------------------------------------------------------------------------
def check(trace: TraceFile, *, allow_unknown_frees: bool = False) -> TraceFile:
    """Checks that the events make sense as a sequence: every free names a live allocation and no
    allocation returns an address that is still live. A free of an unknown pointer is an error
    unless the recording ring dropped events (the allocation may be among them) or
    ``allow_unknown_frees``; such frees are then left out. Returns the trace (possibly shortened)."""
    live: dict[tuple[int, int], int] = {}
    keep: list[int] = []
    lenient = allow_unknown_frees or trace.dropped > 0
    for i, e in enumerate(trace.events):
        key = (e.device, e.address)
        if e.action == "alloc":
            if e.size and e.address == 0:
                raise TraceFormatError(trace.path, trace.where(i), f"allocate of {e.size} bytes returned "
                                       "a null pointer (a failure is written 'allocate failure')")
            if key in live:
                raise TraceFormatError(trace.path, trace.where(i), f"allocate returned {e.address:#x} on "
                                       f"device {e.device}, which is still live (allocated at "
                                       f"{trace.where(live[key])} and not freed since)")
            if e.size:
                live[key] = i
        elif e.action == "free":
            if e.address == 0:
                continue  # free(NULL)
            if key not in live:
                if lenient:
                    continue
                raise TraceFormatError(
                    trace.path, trace.where(i),
                    f"free of {e.address:#x} on device {e.device}, which no earlier allocate in this "
                    "trace returned (if the trace starts mid-run, e.g. a wrapped ring, pass "
                    "--allow-unknown-frees to skip such frees)")
            del live[key]
        keep.append(i)
    if len(keep) != len(trace.events):
        trace.events = [trace.events[i] for i in keep]
        trace.origins = [trace.origins[i] for i in keep] if trace.origins else []
    return trace


# -- PyTorch memory snapshots --------------------------------------------------------------------------
def _segment(device: int, pool: str, base: int, blocks: list[dict]) -> dict:
    used = [b for b in blocks if b["state"] == "active_allocated"]
    return {
        "device": device, "address": base, "total_size": sum(b["size"] for b in blocks),
        "stream": 0, "segment_type": "small" if pool == "small" else "large",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
        "allocated_size": sum(b["size"] for b in used), "active_size": sum(b["size"] for b in used),
        "requested_size": sum(b["requested_size"] for b in used), "blocks": blocks, "ia_pool": pool,
    }


def _block(address: int, size: int, requested: int, used: bool) -> dict:
    # A free block keeps the requested bytes of the last allocation freed into it, as in PyTorch's
    # own snapshots (the segment's requested_size counts the live blocks' alone).
    return {"address": address, "size": size, "requested_size": requested,
            "state": "active_allocated" if used else "inactive", "frames": []}


def segments_from_report(report: dict) -> list[dict]:
    """One segment per arena region, from a report (arena_tools.arena_report.collect or the OOM report)."""
    out = []
    for dev in report.get("devices", []):
        for pool in dev.get("pools", []):
            regions: dict[int, list[dict]] = {}
            for base, offset, size, requested, used, _stream in pool.get("blocks", []):
                regions.setdefault(base, []).append(_block(base + offset, size, requested, bool(used)))
            for base, blocks in regions.items():
                blocks.sort(key=lambda b: b["address"])
                out.append(_segment(dev["device"], pool["pool"], base, blocks))
    return out


def _release(regions: dict, device: int, lo: int, hi: int) -> None:
    """Takes [lo, hi) out of the recorded regions: a whole region given back, or, in a mapped pool,
    the pages unmapped from a stretch (what is left of it on either side stays)."""
    for (d, base), (size, pool) in list(regions.items()):
        if d != device or base + size <= lo or base >= hi:
            continue
        del regions[(d, base)]
        if base < lo:
            regions[(d, base)] = (lo - base, pool)
        if hi < base + size:
            regions[(d, hi)] = (base + size - hi, pool)


def segments_from_events(events: Sequence[Event]) -> list[dict]:
    """The state at the end of a trace, for a snapshot made without the arenas at hand: regions from
    reserve/release events; live blocks at their addresses with their requested sizes (the trace
    does not record the rounding), and free blocks in the gaps. Allocations outside every recorded
    region (their region was reserved before the trace began) get one synthetic segment per device,
    spanning them all, so that every block of the trace lies in a segment."""
    regions: dict[tuple[int, int], tuple[int, str]] = {}
    ever: list[tuple[int, int, int]] = []  # every region ever seen: device, base, end
    live: dict[tuple[int, int], tuple[int, str]] = {}
    spans: list[tuple[int, str, int, int]] = []  # every block ever: device, pool, start, end
    for e in events:
        if e.action == "reserve":
            regions[(e.device, e.address)] = (e.size, e.pool)
            ever.append((e.device, e.address, e.address + e.size))
        elif e.action == "release":
            _release(regions, e.device, e.address, e.address + e.size)
        elif e.action == "alloc" and e.size:
            live[(e.device, e.address)] = (e.size, e.pool)
            spans.append((e.device, e.pool, e.address, e.address + e.size))
        elif e.action == "free":
            live.pop((e.device, e.address), None)
            spans.append((e.device, e.pool, e.address, e.address + e.size))
    by_device: dict[int, list[tuple[int, int]]] = {}
    for d, b, e in ever:
        by_device.setdefault(d, []).append((b, e))
    covered: dict[tuple[int, int], bool] = {}
    orphans: dict[int, list] = {}  # device -> [lo, hi, pools]
    for device, pool, start, end in spans:
        key = (device, start)
        if key not in covered:
            covered[key] = any(b <= start < e for b, e in by_device.get(device, ()))
        if not covered[key]:
            o = orphans.setdefault(device, [start, end, set()])
            o[0], o[1] = min(o[0], start), max(o[1], end)
            o[2].add(pool)
    extents = [(d, base, size, pool) for (d, base), (size, pool) in regions.items()]
    extents += [(d, lo, hi - lo, next(iter(pools)) if len(pools) == 1 else GENERAL)
                for d, (lo, hi, pools) in orphans.items()]
    out = []
    for device, base, size, pool in sorted(extents):
        inside = sorted((a, s) for (d, a), (s, _p) in live.items() if d == device and base <= a < base + size)
        blocks, cursor = [], base
        for address, length in inside:
            if address > cursor:
                blocks.append(_block(cursor, address - cursor, 0, False))
            length = min(length, base + size - address)
            blocks.append(_block(address, length, length, True))
            cursor = address + length
        if cursor < base + size:
            blocks.append(_block(cursor, base + size - cursor, 0, False))
        out.append(_segment(device, pool, base, blocks))
    return out


def trace_entries(events: Sequence[Event]) -> dict[int, list[dict]]:
    """device -> the events as PyTorch trace entries."""
    out: dict[int, list[dict]] = {}
    for seq, e in enumerate(events):
        stream = 0 if e.stream == STREAM_NONE else e.stream
        extra = {"frames": [], "time_us": e.time_ns // 1000, "ia_seq": seq, "ia_thread": e.thread,
                 "ia_pool": e.pool, "ia_time_ns": e.time_ns}
        if e.stream == STREAM_NONE:  # regions: no stream; the visualizer wants a small number
            extra["ia_stream"] = e.stream
        entries = out.setdefault(e.device, [])
        if e.action == "alloc":
            entries.append({"action": "alloc", "addr": e.address, "size": e.size, "stream": stream, **extra})
        elif e.action == "free":
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": e.address, "size": e.size, "stream": stream,
                                **extra})
        elif e.action == "fail":
            entries.append({"action": "oom", "size": e.size, "device_free": 0, "stream": stream, **extra})
        elif e.action in ("reserve", "release"):
            action = "segment_alloc" if e.action == "reserve" else "segment_free"
            entries.append({"action": action, "addr": e.address, "size": e.size, "stream": stream, **extra})
    return out


def to_snapshot(report: dict | None = None, events: Sequence[Event] = (), *, dropped: int = 0) -> dict:
    """A ``torch.cuda.memory._snapshot()``-shaped dict: the arenas of ``report`` as segments (or, with
    no report, the state the events leave), and the events as ``device_traces``."""
    segments = segments_from_report(report) if report is not None else segments_from_events(events)
    entries = trace_entries(events)
    devices = [s["device"] for s in segments] + list(entries) + [0]
    traces = [entries.get(d, []) for d in range(max(devices) + 1)]
    meta = {"format": SNAPSHOT_FORMAT, "dropped": dropped,
            "budget": report.get("budget") if report else None,
            "devices": [{"device": d["device"], "unified": d.get("unified", False)}
                        for d in (report or {}).get("devices", [])],
            "stats": [{"device": d["device"], "pool": p["pool"], "stats": p.get("stats", {})}
                      for d in (report or {}).get("devices", []) for p in d.get("pools", [])]}
    return {"segments": segments, "device_traces": traces, "allocator_settings": {},
            "indexer_arena": meta}


def write_snapshot(snapshot: dict, path: str | os.PathLike) -> None:
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold only dicts, lists, tuples, strings and numbers: no class may be loaded, so a
    hostile pickle cannot run code. (load_snapshot quotes the message cut to an excerpt.)"""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds "
                                     "plain data only")


def load_snapshot(path: str | os.PathLike, *, data: bytes | None = None) -> dict:
    path = os.fspath(path)
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    try:
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise TraceFormatError(path, None, f"not a readable memory snapshot pickle: {excerpt(str(e), 200)}") from None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list) \
            or not isinstance(snapshot.get("device_traces"), list):
        raise TraceFormatError(path, None, "not a PyTorch memory snapshot: expected a dict with "
                               "'segments' and 'device_traces' lists")
    check_snapshot(snapshot, path, len(data))
    return snapshot


def _fields(path: str, where: str, item, required: dict, optional: dict) -> None:
    """`item` must be a dict whose required keys (and optional ones, when present) pass their checks;
    a check is (test, what it expects)."""
    if not isinstance(item, dict):
        raise TraceFormatError(path, where, f"expected an object, found {excerpt(item)}")
    for key, (test, expected) in {**required, **optional}.items():
        if (key in required or key in item) and not test(item.get(key)):
            raise TraceFormatError(path, f"{where}.{key}", f"expected {expected}, found {excerpt(item.get(key))}")


COUNT = (is_count, f"an integer from 0 to {bound_name(U64_MAX)}")
DEVICE = (lambda v: is_int_in(v, 0, MAX_DEVICES - 1), f"a device index from 0 to {bound_name(MAX_DEVICES - 1)}")
BUDGET = (lambda v: v is None or is_int_in(v, 0, MAX_SIZE),  # None: to_snapshot had no report to say
          f"a byte count from 0 to {bound_name(MAX_SIZE)}, or none")
TEXT = (lambda v: isinstance(v, str), "a string")
MICROSECONDS = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 2**64 / 1000,
                "a non-negative number of microseconds whose nanoseconds fit in 64 bits")


ITEMS_PER_BYTE = 1
"""The limit on the work a snapshot pickle makes: it may name at most this many segments, blocks,
trace entries and statistics per byte of the file. Each takes a byte of the pickle at least (its
opcode; a name of an object met before, through the pickle's memo, two), so only a pickle that names
the same list over and over goes past it: one list of blocks shared by every segment, a 226 KB file
naming 2*10^8 blocks, which every reader would walk. Such a file is refused before anything walks it
(check_snapshot), and every tool's work on a snapshot is then proportional to the file's size."""


class _Walk:
    """Counts the items check_snapshot meets against the limit (ITEMS_PER_BYTE)."""

    def __init__(self, path: str, size: int | None):
        self.path, self.size, self.seen = path, size, 0

    def take(self, items, where: str) -> None:
        self.seen += len(items) if isinstance(items, (list, dict)) else 0
        if self.size is not None and self.seen > self.size * ITEMS_PER_BYTE:
            raise TraceFormatError(self.path, where, f"names more segments, blocks, trace entries and "
                                   f"statistics than the file's {self.size} bytes ({ITEMS_PER_BYTE} a byte "
                                   "at most): it names the same objects over and over through the "
                                   "pickle's memo, which no snapshot writer does; refused before walking them")


def check_snapshot(snapshot: dict, path: str = "<snapshot>", size: int | None = None) -> None:
    """Every field of a snapshot that the reports and the replay read, checked once; raises
    TraceFormatError naming the field. ``size``: the file's bytes, which bound the items it may
    name (ITEMS_PER_BYTE)."""
    walk = _Walk(path, size)
    walk.take(snapshot["segments"], "segments")
    for i, seg in enumerate(snapshot["segments"]):
        where = f"segments[{i}]"
        _fields(path, where, seg, {"address": COUNT},
                {"total_size": COUNT, "device": DEVICE, "stream": COUNT, "ia_pool": TEXT, "segment_type": TEXT,
                 "blocks": (lambda v: isinstance(v, list), "a list")})
        walk.take(seg.get("blocks"), f"{where}.blocks")
        for k, block in enumerate(seg.get("blocks", [])):
            _fields(path, f"{where}.blocks[{k}]", block, {"size": COUNT},
                    {"requested_size": COUNT, "state": TEXT})
    walk.take(snapshot["device_traces"], "device_traces")
    for d, entries in enumerate(snapshot["device_traces"]):
        if not isinstance(entries, list):
            raise TraceFormatError(path, f"device_traces[{d}]", "not a list of trace entries")
        walk.take(entries, f"device_traces[{d}]")
        try:
            if entries:
                bounded(d, 0, MAX_DEVICES - 1)
        except ValueError as e:
            raise TraceFormatError(path, f"device_traces[{d}]", f"events of device {d}: {e}") from None
        for k, t in enumerate(entries):
            _fields(path, f"device_traces[{d}][{k}]", t, {"action": TEXT},
                    {"addr": COUNT, "size": COUNT, "time_us": MICROSECONDS, "ia_time_ns": COUNT, "ia_seq": COUNT,
                     "ia_thread": COUNT, "ia_stream": COUNT, "stream": COUNT, "ia_pool": TEXT})
    meta = snapshot.get("indexer_arena")
    if meta is None:
        return
    _fields(path, "indexer_arena", meta, {}, {"budget": BUDGET, "dropped": COUNT,
            "devices": (lambda v: isinstance(v, list), "a list"), "stats": (lambda v: isinstance(v, list), "a list")})
    walk.take(meta.get("devices"), "indexer_arena.devices")
    for i, dev in enumerate(meta.get("devices", [])):
        _fields(path, f"indexer_arena.devices[{i}]", dev, {"device": DEVICE},
                {"unified": (lambda v: isinstance(v, bool), "true or false")})
    walk.take(meta.get("stats"), "indexer_arena.stats")
    for i, st in enumerate(meta.get("stats", [])):
        _fields(path, f"indexer_arena.stats[{i}]", st,
                {"device": DEVICE, "pool": TEXT, "stats": (lambda v: isinstance(v, dict), "an object")}, {})
        walk.take(st["stats"], f"indexer_arena.stats[{i}].stats")


_SNAPSHOT_ACTIONS = {"alloc": "alloc", "free_completed": "free", "free": "free", "oom": "fail",
                     "segment_alloc": "reserve", "segment_map": "reserve",
                     "segment_free": "release", "segment_unmap": "release"}
_SNAPSHOT_SKIPPED = {"free_requested", "snapshot"}


def trace_from_snapshot(snapshot: dict, path: str = "<snapshot>") -> TraceFile:
    """The events of a snapshot's ``device_traces`` (ours, or PyTorch's own), oldest first."""
    rows = []
    for device, entries in enumerate(snapshot["device_traces"]):
        if not isinstance(entries, list):
            raise TraceFormatError(path, f"device_traces[{device}]", "not a list of trace entries")
        for k, t in enumerate(entries):
            where = f"device_traces[{device}][{k}]"
            if not isinstance(t, dict) or not isinstance(t.get("action"), str):
                raise TraceFormatError(path, where, "not a trace entry (a dict with an 'action')")
            if t["action"] in _SNAPSHOT_SKIPPED:
                continue
            action = _SNAPSHOT_ACTIONS.get(t["action"])
            if action is None:
                raise TraceFormatError(path, where, f"unknown action {excerpt(t['action'])}; expected one of "
                                       f"{', '.join([*_SNAPSHOT_ACTIONS, *_SNAPSHOT_SKIPPED])}")
            needed = ("size",) if action == "fail" else ("addr", "size")
            for key in needed:
                if not isinstance(t.get(key), int) or t[key] < 0:
                    raise TraceFormatError(path, where, f"{key} missing or not a non-negative integer")
            time_ns = t.get("ia_time_ns", int(t.get("time_us", 0) * 1000))
            stream = t.get("ia_stream", t.get("stream", 0))
            if stream == STREAM_NONE and action != "reserve" and action != "release":
                raise TraceFormatError(path, where, f"stream {stream}: more than {bound_name(MAX_STREAM)}: an "
                                       f"allocation or a free is made on a stream")
            event = Event(time_ns=time_ns, thread=t.get("ia_thread", 0), action=action,
                          address=t.get("addr", 0) if action != "fail" else 0, size=t["size"],
                          stream=stream if isinstance(stream, int) and stream >= 0 else 0,
                          device=device, pool=t.get("ia_pool", GENERAL))
            order = (t["ia_seq"], 0) if "ia_seq" in t else (time_ns, len(rows))
            rows.append((order, event, (device, k)))
    rows.sort(key=lambda r: r[0])
    meta = snapshot.get("indexer_arena") or {}
    budget = meta.get("budget")
    if budget is None:
        ws = [s["total_size"] for s in snapshot["segments"] if s.get("ia_pool") == "workspace"]
        budget = ws[0] if ws else None
    return TraceFile([r[1] for r in rows], path, "snapshot", [r[2] for r in rows],
                     dropped=int(meta.get("dropped", 0) or 0), budget=budget, snapshot=snapshot)


# -- any trace file ------------------------------------------------------------------------------------
def sniff(path: str | os.PathLike) -> str:
    """'snapshot' (a pickle), 'report' (JSON) or 'csv', from the first bytes of the file."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:1] == b"\x80" or os.fspath(path).endswith((".pickle", ".pkl")):  # a pickle, if broken
        return "snapshot"
    if head.lstrip()[:1] == b"{":
        return "report"
    return "csv"


def load_trace(path: str | os.PathLike, *, allow_unknown_frees: bool = False) -> TraceFile:
    """Reads and checks a trace: a CSV (ours or RMM's) or a snapshot pickle."""
    path = os.fspath(path)
    try:
        kind = sniff(path)
    except OSError as e:
        raise TraceFormatError(path, None, f"cannot read it: {e.strerror or e}") from None
    if kind == "report":
        raise TraceFormatError(path, None, "this is a JSON memory report, which holds the arenas' "
                               "blocks but no events; replay needs a CSV trace or a snapshot pickle")
    trace = trace_from_snapshot(load_snapshot(path), path) if kind == "snapshot" else read_csv(path)
    trace = check(trace, allow_unknown_frees=allow_unknown_frees)
    if trace.budget is None:
        reserves = [e.size for e in trace.events if e.action == "reserve" and e.pool == "workspace"]
        trace.budget = reserves[0] if reserves else None
    return trace
