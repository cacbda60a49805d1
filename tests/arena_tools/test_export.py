"""Trace exports: RMM's CSV and PyTorch's memory snapshot, written from a trace recorded on the host
backend, read back, and fed to PyTorch's memory visualizer."""

import base64
import json
import pickle
import pickletools
import re

import pytest

from arena_tools import export
from arena_tools.export import DAY_NS, TraceFormatError
from arena_tools.arena_report import collect
from alloc.trace import Trace
from tests.support.trace_workload import BUDGET, record


# The opcodes PyTorch's MemoryViz.js unpickler handles (torch/utils/viz/MemoryViz.js, unpickle()).
JS_OPCODES = {"PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
              "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
              "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT",
              "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
              "BINFLOAT"}


@pytest.fixture
def mv():
    """PyTorch's memory visualizer (torch/cuda/_memory_viz.py)."""
    return pytest.importorskip("torch.cuda._memory_viz")


@pytest.fixture(scope="module")
def rec():
    r = record()
    yield r
    r.close()


def identity(lines):
    return lines


# -- CSV ---------------------------------------------------------------------------------------------
def test_csv_is_rmms_format(rec, tmp_path):
    path = tmp_path / "rmm.csv"
    export.write_csv(rec.events, path, extended=False)
    lines = path.read_text().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream"
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == sum(e.action in ("alloc", "free", "fail") for e in rec.events)
    for thread, t, action, pointer, size, stream in rows:
        assert thread.isdigit() and size.isdigit()
        assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{6}", t)
        assert action in ("allocate", "free", "allocate failure")
        assert re.fullmatch(r"0x[0-9a-f]+", pointer) and re.fullmatch(r"0x[0-9a-f]+", stream)
        if action == "allocate failure":
            assert pointer == "0x0"
    # as in RMM's log, a free carries the size its allocation asked for
    sizes = {}
    for _t, _time, action, pointer, size, _s in rows:
        if action == "allocate":
            sizes[pointer] = size
        elif action == "free":
            assert sizes.pop(pointer) == size


def test_csv_round_trip(rec, tmp_path):
    path = tmp_path / "trace.csv"
    export.write_csv(rec.events, path)
    back = export.load_trace(path)
    assert back.kind == "csv"
    expected = [e for e in rec.events if e.action in ("alloc", "free", "fail")]
    assert len(back.events) == len(expected)
    asked = {}
    for orig, got in zip(expected, back.events):
        assert (got.action, got.thread, got.stream, got.device, got.pool) == \
               (orig.action, orig.thread, orig.stream, orig.device, orig.pool)
        assert got.address == (0 if orig.action == "fail" else orig.address)
        if orig.action == "alloc":
            asked[orig.address] = orig.size
        assert got.size == (asked.pop(orig.address) if orig.action == "free" else orig.size)
        assert got.time_ns % DAY_NS == export.time_of_day_ns(orig.time_ns)
    assert [e.time_ns for e in back.events] == sorted(e.time_ns for e in back.events)


def test_rmm_csv_reads_as_general_pool(rec, tmp_path):
    path = tmp_path / "rmm.csv"
    export.write_csv(rec.events, path, extended=False)
    back = export.load_trace(path)
    assert back.kind == "rmm-csv"
    assert {e.pool for e in back.events} == {"general"} and {e.device for e in back.events} == {0}


def test_csv_reader_takes_rmm_spellings(tmp_path):
    # columns in another order, CRLF, (nil) pointers, a decimal stream, a run past midnight
    path = tmp_path / "log.csv"
    path.write_bytes(b"Action,Thread,Time,Size,Pointer,Stream\r\n"
                     b"allocate,7,23:59:59.999999,256,0x7f0000001000,0x0\r\n"
                     b"allocate failure,7,00:00:00.000001,1024,(nil),5\r\n"
                     b"free,7,00:00:00.000002,256,0x7f0000001000,0\r\n")
    t = export.load_trace(path)
    assert [e.action for e in t.events] == ["alloc", "fail", "free"]
    assert t.events[1].stream == 5 and t.events[1].address == 0
    assert t.events[1].time_ns - t.events[0].time_ns == 2000  # 2 µs later, the next day


@pytest.mark.parametrize("body, line, words", [
    ("Thread,Time,Action,Ptr,Size,Stream\n1,00:00:00.000001,allocate,0x10,16,0x0\n", 1,
     ["bad header", "missing Pointer"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,16,0x0\n"
     "1,00:00:00.000002,alloc,0x20,16,0x0\n", 3, ["unknown action 'alloc'"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,16,0x0\n"
     "1,00:00:00.000002,free,0xdead,16,0x0\n", 3, ["free of 0xdead", "--allow-unknown-frees"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,16,0x0\n"
     "1,00:00:00.000002,free,0x1", 3, ["expected 6 fields", "found 4", "truncated"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,lots,0x0\n", 2,
     ["bad Size 'lots'"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0xzz,16,0x0\n", 2,
     ["bad Pointer '0xzz'"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,noon,allocate,0x10,16,0x0\n", 2, ["bad Time 'noon'"]),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x10,16,0x0\n"
     "1,00:00:00.000002,allocate,0x10,32,0x0\n", 3, ["still live", "allocated at line 2"]),
    ("Thread,Time,Action,Pointer,Size,Stream,Device,Pool\n1,00:00:00.000001,allocate,0x10,16,0x0,x,large\n",
     2, ["bad Device 'x'"]),
    ("", 1, ["empty file"]),
])
def test_malformed_csv_names_file_and_line(tmp_path, body, line, words):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(TraceFormatError) as e:
        export.load_trace(path)
    assert str(e.value).startswith(f"{path}: line {line}: ")
    for w in words:
        assert w in str(e.value)


def test_unknown_frees_can_be_skipped(tmp_path):
    path = tmp_path / "mid.csv"
    path.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,free,0xdead,16,0x0\n"
                    "1,00:00:00.000002,allocate,0x10,16,0x0\n")
    t = export.load_trace(path, allow_unknown_frees=True)
    assert [e.action for e in t.events] == ["alloc"] and t.origins == [3]


# -- snapshots ---------------------------------------------------------------------------------------
def test_snapshot_round_trip_is_exact(rec, tmp_path):
    path = tmp_path / "snapshot.pickle"
    export.write_snapshot(export.to_snapshot(collect(rec.arenas), rec.events), path)
    back = export.load_trace(path)
    assert back.kind == "snapshot" and back.events == rec.events
    assert back.budget == BUDGET


def test_snapshot_segments_are_the_arenas(rec):
    snap = export.to_snapshot(collect(rec.arenas), rec.events)
    by_pool = {}
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        cursor = seg["address"]
        for b in seg["blocks"]:  # blocks tile the segment in address order
            assert b["address"] == cursor
            cursor += b["size"]
        by_pool.setdefault(seg["ia_pool"], []).append(seg)
    for (device, pool), arena in rec.arenas.items():
        segs = by_pool[pool]
        assert sorted(s["address"] for s in segs) == sorted(r.base for r in arena.regions())
        live = sorted((b["address"], b["size"], b["requested_size"]) for s in segs for b in s["blocks"]
                      if b["state"] == "active_allocated")
        assert live == sorted((b.address, b.size, b.requested) for b in arena.blocks() if b.state == "used")
        # free blocks too: each keeps the requested bytes of the last allocation freed into it
        free = sorted((b["address"], b["size"], b["requested_size"]) for s in segs for b in s["blocks"]
                      if b["state"] == "inactive")
        assert free == sorted((b.address, b.size, b.requested) for b in arena.blocks() if b.state != "used")
        assert any(r for _, _, r in free), "the recording frees nothing: the free blocks' check cannot fail"
        assert sum(s["requested_size"] for s in segs) == sum(r for _, _, r in live)
        assert sum(s["allocated_size"] for s in segs) == arena.stats()["in_use"]
    assert len(snap["device_traces"]) == 1
    assert len(snap["device_traces"][0]) == len(rec.events) + sum(e.action == "free" for e in rec.events)


def _js_opcodes(data: bytes) -> set[str]:
    return {op.name for op, _arg, _pos in pickletools.genops(data)}


def test_snapshot_passes_pytorch_memory_viz(rec, tmp_path, mv):
    report = collect(rec.arenas)
    snap = export.to_snapshot(report, rec.events)
    path = tmp_path / "snapshot.pickle"
    export.write_snapshot(snap, path)
    data = path.read_bytes()
    assert data[:2] == b"\x80\x04"  # protocol 4: MemoryViz.js reads 2 to 4
    assert _js_opcodes(data) <= JS_OPCODES
    assert pickle.loads(data) == snap

    # text views
    summary = mv.segsum(snap)  # asserts internally that blocks account for every segment byte
    capacity = sum(a.stats()["capacity"] for a in rec.arenas.values())
    assert f"segments: {len(snap['segments'])}" in summary
    assert f"total_reserved: {mv.Bytes(capacity)}" in summary
    assert f"total_allocated: {mv.Bytes(sum(a.stats()['requested'] for a in rec.arenas.values()))}" in summary
    text = mv.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in text
    assert text.count("cudaMalloc(") == sum(e.action == "reserve" for e in rec.events)
    assert text.count("raise OutOfMemoryError") == rec.failures
    flame = mv.memory(snap, format_flamegraph=identity)
    live = [b for a in rec.arenas.values() for b in a.blocks() if b.state == "used"]
    assert sum(int(line.rsplit(" ", 1)[1]) for line in flame.splitlines()
               if ";active_allocated;" in line) == sum(b.size for b in live)
    assert mv.segments(snap, format_flamegraph=identity).count(";seg_") >= len(live)
    mv.compare(snap["segments"], snap["segments"], format_flamegraph=identity)

    # HTML views: the snapshot travels base64-encoded, pickled by torch itself
    for html in (mv.segment_plot(snap), mv.trace_plot(snap), mv.trace_plot(snap, plot_segments=True)):
        blob = json.loads(html.split("const local_files = ", 1)[1].split("\n", 1)[0])[0]["base64"]
        inner = base64.b64decode(blob).rstrip(b"\x00")
        assert _js_opcodes(inner) <= JS_OPCODES
        assert pickle.loads(inner) == snap
    filtered = mv.filter_alloc_free_pairs(pickle.loads(data))
    assert len(filtered["device_traces"][0]) < len(snap["device_traces"][0])


def _js_segment_view_check(snap: dict, device: int = 0) -> int:
    """A port of MemoryViz.js's segment view (annotate_snapshot, simulate_memory, find_segment): walk
    the trace backwards from the snapshot's state; at every step each live block must lie in a
    segment, and every segment_alloc must undo a present segment. Returns the steps checked."""
    segments = [(s["address"], s["total_size"]) for s in snap["segments"] if s["device"] == device]
    blocks = {}
    for s in snap["segments"]:
        if s["device"] != device:
            continue
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                blocks[addr] = b["size"]
            addr += b["size"]
    events = []
    for t in snap["device_traces"][device]:  # annotate: free_requested + free_completed -> free
        if t["action"] == "free_completed" and events and events[-1]["action"] == "free_requested" \
                and events[-1]["addr"] == t["addr"]:
            events[-1] = {**events[-1], "action": "free"}
            continue
        events.append(t)

    def check():
        for addr, size in blocks.items():
            assert any(base <= addr and addr + size <= base + length for base, length in segments), \
                f"block {addr:#x}+{size} lies in no segment"

    check()
    for t in reversed(events):
        a = t["action"]
        if a in ("free", "free_completed"):
            blocks[t["addr"]] = t["size"]
        elif a == "alloc":
            blocks.pop(t["addr"], None)
        elif a == "segment_free":
            segments.append((t["addr"], t["size"]))
        elif a == "segment_alloc":
            match = [s for s in segments if s[0] == t["addr"]]
            assert match, f"segment_alloc of {t['addr']:#x}, which is not present"
            segments.remove(match[0])
        check()
    return len(events)


def test_snapshot_satisfies_the_visualizers_segment_view(rec):
    assert _js_segment_view_check(export.to_snapshot(collect(rec.arenas), rec.events)) > 100


def test_snapshot_from_events_alone(rec, mv):
    """Without the arenas: regions from the reserve events, a synthetic segment for the workspace
    arena (reserved before its trace was attached); the visualizer's checks still hold."""
    snap = export.to_snapshot(None, rec.events)
    mv.segsum(snap)
    _js_segment_view_check(snap)
    large = {s["address"] for s in snap["segments"] if s["ia_pool"] == "large"}
    assert large == {r.base for r in rec.arenas[(0, "large")].regions()}
    ws = [s for s in snap["segments"] if s["ia_pool"] == "workspace"]
    base = rec.arenas[(0, "workspace")].regions()[0].base
    assert len(ws) == 1 and base <= ws[0]["address"] and \
        ws[0]["address"] + ws[0]["total_size"] <= base + BUDGET


def test_wrapped_ring_reads_as_a_suffix(tmp_path):
    r = record(capacity=64, general=False)
    try:
        assert r.dropped > 0 and len(r.events) == 64
        path = tmp_path / "wrapped.pickle"
        export.write_snapshot(export.to_snapshot(collect(r.arenas), r.events, dropped=r.dropped), path)
        back = export.load_trace(path)  # frees of evicted allocations are skipped, not errors
        assert back.dropped == r.dropped
        assert all(e.action != "free" or any(a.action == "alloc" and a.address == e.address
                                             for a in back.events) for e in back.events)
        _js_segment_view_check(export.load_snapshot(path))
        csv = tmp_path / "wrapped.csv"
        export.write_csv(r.events, csv)
        with pytest.raises(TraceFormatError, match="--allow-unknown-frees"):
            export.load_trace(csv)
        export.load_trace(csv, allow_unknown_frees=True)
    finally:
        r.close()


def test_malformed_snapshots_name_the_entry(tmp_path):
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 16, "size": 8},
                                               {"action": "teleport", "addr": 16, "size": 8}]]}
    path = tmp_path / "bad.pickle"
    export.write_snapshot(snap, path)
    with pytest.raises(TraceFormatError, match=r"bad.pickle: device_traces\[0\]\[1\]: unknown action 'teleport'"):
        export.load_trace(path)
    snap["device_traces"][0][1] = {"action": "free_completed", "addr": 32, "size": 8}
    export.write_snapshot(snap, path)
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\]\[1\]: free of 0x20"):
        export.load_trace(path)
    snap["device_traces"][0][1] = {"action": "alloc", "size": 8}
    export.write_snapshot(snap, path)
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\]\[1\]: addr missing"):
        export.load_trace(path)
    path.write_bytes(pickle.dumps([1, 2, 3], protocol=4))
    with pytest.raises(TraceFormatError, match="not a PyTorch memory snapshot"):
        export.load_trace(path)


def test_snapshot_reader_loads_no_code(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("this must not run",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Boom()}, protocol=4))
    with pytest.raises(TraceFormatError, match="refusing to load builtins.print"):
        export.load_trace(path)


def test_report_json_is_not_a_trace(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"format": "indexer-arena-report-1", "devices": []}))
    with pytest.raises(TraceFormatError, match="no events"):
        export.load_trace(path)
    with pytest.raises(TraceFormatError, match="cannot read it"):
        export.load_trace(tmp_path / "missing.csv")


def test_pytorch_snapshot_without_our_keys(tmp_path):
    """A snapshot as PyTorch's own allocator writes it: pools by segment type, order by time."""
    snap = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 2},
        {"action": "free_requested", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 3},
        {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0, "time_us": 4},
        {"action": "snapshot", "size": 0, "time_us": 5}]]}
    t = export.trace_from_snapshot(snap, "torch.pickle")
    assert [(e.action, e.time_ns) for e in t.events] == [("reserve", 1000), ("alloc", 2000),
                                                        ("free", 3000), ("fail", 4000)]
    assert {e.pool for e in t.events} == {"general"}


def test_trace_ring_events_are_what_the_arena_did():
    """The recording itself (csrc/arena/trace.c): the regions held when the trace was attached, sizes as
    asked for, on free too (as PyTorch's trace), not the rounded block's."""
    from alloc import STREAM_NONE, Arena
    t = Trace(16)
    with Arena(1 << 20, 256) as a:
        a_base = a.regions()[0].base
        t.attach(a, device=3, pool="small")
        p = a.allocate(1000, stream=9)
        a.free(p, stream=9)
        events, dropped = t.events()
    assert dropped == 0
    assert [(e.action, e.size, e.stream, e.device, e.pool) for e in events] == [
        ("reserve", 1 << 20, STREAM_NONE, 3, "small"), ("alloc", 1000, 9, 3, "small"),
        ("free", 1000, 9, 3, "small")]
    assert events[0].address == a_base
