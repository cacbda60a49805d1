"""Every integer field of every reader (CSV trace, snapshot pickle, JSON report), across the whole
integer line: a value its consumer can hold (64 bits for sizes, pointers, streams, threads and
times; 2**62 for a budget, which becomes an arena's capacity; 0 to 63 for a device) reads back as
written, any other is refused naming the field, the value and the bound; and the commands on such
a file end with exit status 0, 1 or 2 and, on 2, one line: never a traceback."""

import copy
import json
import os
import pickle

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from alloc.units import MAX_DEVICES, MAX_SIZE, U64_MAX
from arena_tools import replay, report
from arena_tools.export import TraceFormatError, check_snapshot, read_csv
from arena_tools.report import ReportError, check_report

HIGHEST_DEVICE = MAX_DEVICES - 1
WORDS = {U64_MAX: "2**64 - 1", U64_MAX - 1: "2**64 - 2", MAX_SIZE: "2**62", HIGHEST_DEVICE: str(HIGHEST_DEVICE)}
"""How a refusal names each bound."""

EDGES = sorted({0, 1, HIGHEST_DEVICE, MAX_DEVICES, MAX_SIZE, MAX_SIZE + 1, 2**63, U64_MAX - 1, U64_MAX, 2**64,
                2**72, 2**80, 10**20, 10**30, -1, -(2**64)})
VALUES = st.one_of(st.sampled_from(EDGES), st.integers(-(1 << 90), 1 << 90))
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def run(command, argv, capsys) -> tuple[int, str]:
    """The command's exit status and its last line of error output, the only one on status 2."""
    rc = command(argv)
    err = capsys.readouterr().err
    assert rc in (0, 1, 2)
    lines = err.strip().splitlines()
    if rc == 2:
        assert "Traceback" not in err and len(lines) == 1, err
    return rc, lines[-1] if lines else ""


# -- CSV traces -----------------------------------------------------------------------------------------
CSV_COLUMNS = {"Thread": U64_MAX, "Pointer": U64_MAX, "Size": U64_MAX, "Stream": U64_MAX - 1,
               "Device": HIGHEST_DEVICE}
HEADER = "Thread,Time,Action,Pointer,Size,Stream,Device,Pool\n"


def written(column: str, value: int) -> str:
    if column in ("Pointer", "Stream"):  # hexadecimal, as RMM writes them
        return f"-0x{-value:x}" if value < 0 else f"{value:#x}"
    return str(value)


def csv_text(column: str, value: int, pool: str = "large") -> str:
    row = {"Thread": "7", "Pointer": "0x10000", "Size": "4096", "Stream": "0x0", "Device": "0",
           column: written(column, value)}
    fields = lambda action: f"{row['Thread']},00:00:01.000001,{action},{row['Pointer']},{row['Size']}," \
                            f"{row['Stream']},{row['Device']},{pool}\n"
    return HEADER + fields("allocate") + fields("free")


@SETTINGS
@given(column=st.sampled_from(sorted(CSV_COLUMNS)), value=VALUES)
def test_every_integer_column_of_a_csv_trace(tmp_path, capsys, column, value):
    high = CSV_COLUMNS[column]
    text = csv_text(column, value)
    try:
        trace = read_csv("t.csv", text=text)
    except TraceFormatError as e:
        assert not 0 <= value <= high and f"line 2: bad {column} {written(column, value)!r}" in str(e)
        assert (WORDS[high] if value > high else "negative") in str(e), str(e)
    else:
        assert 0 <= value <= high
        e = trace.events[0]
        assert {"Thread": e.thread, "Pointer": e.address, "Size": e.size, "Stream": e.stream,
                "Device": e.device}[column] == value
    path = tmp_path / "t.csv"
    path.write_text(text)
    run(report.main, [str(path), "--text", str(tmp_path / "out.txt")], capsys)
    run(replay.main, [str(path), "--allocators", "host", "--no-progress", "--json", str(tmp_path / "r.json")], capsys)


@pytest.mark.parametrize("column, text, bound", [
    ("Size", str(2**64), "18446744073709551615 (2**64 - 1"), ("Size", str(10**30), "2**64 - 1"),
    ("Stream", f"{2**72:#x}", "2**64 - 2"), ("Pointer", f"{2**80:#x}", "2**64 - 1"),
    ("Stream", f"{U64_MAX:#x}", "2**64 - 1 is the core's no-stream value"),
    ("Device", str(10**20), "more than 63"), ("Size", "1_000", "digits 0-9"), ("Device", "+1", "digits 0-9"),
])
def test_the_numbers_of_the_issue_exit_2_naming_value_and_bound(tmp_path, capsys, column, text, bound):
    row = {"Pointer": "0x10000", "Size": "4096", "Stream": "0x0", "Device": "0", column: text}
    path = tmp_path / "t.csv"
    path.write_text(HEADER + f"1,00:00:01.000001,allocate,{row['Pointer']},{row['Size']},{row['Stream']},"
                    f"{row['Device']},large\n")
    for command, argv in ((report.main, []), (replay.main, ["--allocators", "host", "--no-progress"])):
        rc, line = run(command, [str(path), *argv], capsys)
        assert rc == 2 and f"line 2: bad {column} {text!r}" in line and bound in line, line


# -- snapshot pickles ---------------------------------------------------------------------------------
def snapshot() -> dict:
    entry = {"action": "alloc", "addr": 0x10000, "size": 4096, "stream": 0, "time_us": 1, "ia_seq": 0,
             "ia_thread": 7, "ia_pool": "workspace", "ia_time_ns": 1000, "ia_stream": 0}
    return {"segments": [{"device": 0, "address": 0x10000, "total_size": 1 << 20, "stream": 0,
                          "ia_pool": "workspace", "segment_type": "large",
                          "blocks": [{"size": 4096, "requested_size": 4096, "state": "active_allocated"},
                                     {"size": (1 << 20) - 4096, "requested_size": 0, "state": "inactive"}]}],
            "device_traces": [[entry]],
            "indexer_arena": {"budget": 1 << 20, "dropped": 0, "devices": [{"device": 0, "unified": False}],
                              "stats": [{"device": 0, "pool": "workspace", "stats": {}}]}}


TIME_US_MAX = (2**64 - 1) // 1000  # microseconds whose nanoseconds a 64-bit field holds
SNAPSHOT_FIELDS = {
    **{("segments", 0, k): U64_MAX for k in ("address", "total_size", "stream")},
    ("segments", 0, "device"): HIGHEST_DEVICE,
    **{("segments", 0, "blocks", 0, k): U64_MAX for k in ("size", "requested_size")},
    **{("device_traces", 0, 0, k): U64_MAX for k in ("addr", "size", "stream", "ia_seq", "ia_thread",
                                                      "ia_time_ns", "ia_stream")},
    ("device_traces", 0, 0, "time_us"): TIME_US_MAX,
    ("indexer_arena", "budget"): MAX_SIZE, ("indexer_arena", "dropped"): U64_MAX,
    ("indexer_arena", "devices", 0, "device"): HIGHEST_DEVICE,
    ("indexer_arena", "stats", 0, "device"): HIGHEST_DEVICE,
}


def put(doc, path, value):
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def where(path) -> str:
    out = str(path[0])
    for key in path[1:]:
        out += f"[{key}]" if isinstance(key, int) else f".{key}"
    return out


@SETTINGS
@given(field=st.sampled_from(sorted(SNAPSHOT_FIELDS, key=str)), value=VALUES)
def test_every_integer_field_of_a_snapshot(tmp_path, capsys, field, value):
    high = SNAPSHOT_FIELDS[field]
    doc = snapshot()
    put(doc, field, value)
    try:
        check_snapshot(doc, "s.pickle")
    except TraceFormatError as e:
        assert not 0 <= value <= high and where(field) in str(e), str(e)
        words = "64 bits" if field[-1] == "time_us" else WORDS[high]
        assert str(value) in str(e) and words in str(e), str(e)
    else:
        assert 0 <= value <= high
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(doc, protocol=4))
    run(report.main, [str(path), "--text", str(tmp_path / "out.txt")], capsys)
    run(replay.main, [str(path), "--allocators", "host", "--no-progress", "--json", str(tmp_path / "r.json")], capsys)


@pytest.mark.parametrize("key", ["ia_stream", "stream"])
def test_an_allocation_on_the_no_stream_value_in_a_snapshot_exits_2(tmp_path, capsys, key):
    """The core's no-stream value (2**64 - 1) marks a region's events; an allocation or a free
    recorded on it is refused in one line, before the replay hands it to an arena."""
    doc = snapshot()
    entry = doc["device_traces"][0][0]
    del entry["ia_stream"]
    entry[key] = U64_MAX
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(doc, protocol=4))
    for command, argv in ((report.main, []), (replay.main, ["--allocators", "host", "--no-progress"])):
        rc, line = run(command, [str(path), *argv], capsys)
        assert rc == 2 and "device_traces[0][0]: stream 18446744073709551615: more than" in line, line


def test_events_of_a_device_past_the_highest_are_refused():
    doc = snapshot()
    doc["device_traces"] = [[]] * MAX_DEVICES + doc["device_traces"]
    with pytest.raises(TraceFormatError, match=rf"device_traces\[64\]: events of device 64: more than 63"):
        check_snapshot(doc, "s.pickle")
    doc["device_traces"] = doc["device_traces"][:MAX_DEVICES] + [[]]  # empty lists past it are harmless
    check_snapshot(doc, "s.pickle")


@pytest.mark.parametrize("change, words", [
    ({("indexer_arena", "budget"): 2**63}, "indexer_arena.budget: expected a byte count from 0 to 2**62"),
    # no recorded budget: the workspace region's size stands for it, and it is more than an arena takes
    ({("indexer_arena", "budget"): None, ("segments", 0, "total_size"): 2**63},
     "the workspace budget it records, 9223372036854775808 bytes, is more than 4611686018427387904 (2**62"),
])
def test_a_recorded_budget_past_an_arena_exits_2(tmp_path, capsys, change, words):
    doc = snapshot()
    for field, value in change.items():
        put(doc, field, value)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(doc, protocol=4))
    rc, line = run(replay.main, [str(path), "--allocators", "host", "--no-progress"], capsys)
    assert rc == 2 and words in line, line
    # a budget given on the command line replaces the recorded one, unless it is the malformed field
    rc, _ = run(replay.main, [str(path), "--allocators", "host", "--no-progress", "--budget-mb", "1"], capsys)
    assert rc == (2 if "indexer_arena.budget" in words else 0)


@pytest.mark.parametrize("command", [report.main, replay.main])
@pytest.mark.parametrize("mib, words", [
    ("99999999999999", "--budget-mb 99999999999999: must be at most 4398046511104"),
    ("0", "--budget-mb 0: must be greater than zero"),
    (str(MAX_SIZE >> 20), "pass a smaller --budget-mb"),  # an arena's most, and more than this host has
])
def test_a_budget_on_the_command_line_is_bounded(tmp_path, capsys, command, mib, words):
    path = tmp_path / "t.csv"
    path.write_text(csv_text("Size", 4096, "workspace"))
    out = tmp_path / "out.json"
    rc, line = run(command, [str(path), "--budget-mb", mib, "--json", str(out)], capsys)
    assert rc == 2 and words in line and not out.exists(), line


# -- JSON reports ---------------------------------------------------------------------------------------
def json_report() -> dict:
    return {"format": "indexer-arena-report-2", "budget": 1 << 20, "devices": [
        {"device": 0, "unified": False, "pools": [
            {"pool": "workspace", "stats": {"capacity": 1 << 20, "in_use": 4096},
             "blocks": [[0x10000, 0, 4096, 4000, 1, 0], [0x10000, 4096, (1 << 20) - 4096, 0, 0, 0]]}]}]}


REPORT_FIELDS = {("budget",): MAX_SIZE, ("devices", 0, "device"): HIGHEST_DEVICE,
                 **{("devices", 0, "pools", 0, "blocks", 0, i): U64_MAX for i in range(6)},
                 **{("devices", 0, "pools", 0, "stats", k): U64_MAX for k in ("capacity", "in_use")}}


@SETTINGS
@given(field=st.sampled_from(sorted(REPORT_FIELDS, key=str)), value=VALUES)
def test_every_integer_field_of_a_json_report(tmp_path, capsys, field, value):
    high = REPORT_FIELDS[field]
    doc = json_report()
    put(doc, field, value)
    try:
        checked = check_report(copy.deepcopy(doc), "r.json")
    except ReportError as e:
        assert not 0 <= value <= high and str(value) in str(e) and WORDS[high] in str(e), str(e)
    else:
        assert 0 <= value <= high
        put(doc, field, value)
        assert checked["devices"][0]["device"] == doc["devices"][0]["device"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    run(report.main, [str(path), "--text", str(tmp_path / "out.txt")], capsys)


def test_the_readers_device_bound_is_the_cores():
    from alloc._lib import lib  # the readers themselves run without the compiled core
    assert MAX_DEVICES == lib.IA_MAX_DEVICES


# -- every refusal quotes a bounded excerpt -----------------------------------------------------------
# Whatever field is malformed and however long it is, the refusal is one line that quotes at most an
# excerpt of it (alloc.errors.excerpt): never a line as large as the file.
LINE_MOST = 600
"""Characters an error line may hold beside the file's path: its fixed words and a few excerpts."""
LENGTHS = st.one_of(st.integers(0, 200), st.sampled_from([81, 5000, 1 << 20, 8 << 20]))
PIECES = st.text(min_size=1, max_size=3).filter(lambda t: not set(t) & set(",\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"))
BOUND_SETTINGS = settings(SETTINGS, max_examples=int(os.environ.get("FUZZ_EXAMPLES", "30")))


def long_text(piece: str, length: int) -> str:
    """``length`` characters of ``piece`` repeated, and one that no numeric field takes."""
    return (piece * (length // len(piece) + 1))[:length] + "z"


def one_bounded_line(rc: int, line: str, path) -> None:
    assert rc == 2 and "\n" not in line and len(line) <= len(str(path)) + LINE_MOST, (rc, len(line), line[:300])


def csv_case(case: str, bad: str) -> str:
    if case == "header":
        return f"{bad},Time\n"
    if case == "doubled":
        return f"{HEADER.strip()},{bad},{bad}\n"
    if case == "fields":
        return HEADER + f"1,00:00:01.000001,allocate,0x10000,4096,0x0,0,large,{bad}\n"
    row = {"Thread": "7", "Time": "00:00:01.000001", "Action": "allocate", "Pointer": "0x10000",
           "Size": "4096", "Stream": "0x0", "Device": "0", "Pool": "large", case: bad}
    return HEADER + ",".join(row[c] for c in HEADER.strip().split(",")) + "\n"


@BOUND_SETTINGS
@given(case=st.sampled_from(["header", "doubled", "fields", "Thread", "Time", "Action", "Pointer", "Size",
                             "Stream", "Device"]), piece=PIECES, length=LENGTHS)
def test_a_malformed_csv_field_of_any_length_is_refused_in_one_bounded_line(tmp_path, capsys, case, piece,
                                                                             length):
    path = tmp_path / "t.csv"
    path.write_text(csv_case(case, long_text(piece, length)))
    for command, argv in ((report.main, []), (replay.main, ["--allocators", "host", "--no-progress"])):
        one_bounded_line(*run(command, [str(path), *argv], capsys), path)


HUGE_VALUES = st.one_of(st.builds(long_text, PIECES, LENGTHS),
                        st.builds(lambda n: 1 << n, st.sampled_from([64, 300, 20_000, 8 << 20])),
                        st.builds(lambda s, n: [s] * n, st.builds(long_text, PIECES, LENGTHS),
                                  st.sampled_from([2, 1000, 100_000])),
                        st.builds(lambda s: {s: s}, st.builds(long_text, PIECES, LENGTHS)))
"""A malformed value of any size: a long string, an integer of many digits, a long list, a dict."""
JSON_VALUES = st.one_of(st.builds(long_text, PIECES, LENGTHS), st.builds(lambda n: 1 << n, st.sampled_from([64, 300, 10_000])),
                        st.builds(lambda n: [0.5] * n, st.sampled_from([7, 1000, 100_000])),
                        st.builds(lambda s: {s: s}, st.builds(long_text, PIECES, LENGTHS)))
"""The same, as a JSON file holds them (its integers as Python reads back: up to 4,300 digits)."""


@BOUND_SETTINGS
@given(field=st.sampled_from(sorted(SNAPSHOT_FIELDS, key=str) + [("device_traces", 0, 0, "action"),
                                                                  ("segments", 0), ("segments", 0, "blocks", 0)]),
       value=HUGE_VALUES)
def test_a_malformed_snapshot_field_of_any_length_is_refused_in_one_bounded_line(tmp_path, capsys, field, value):
    doc = snapshot()
    put(doc, field, value)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(doc, protocol=4))
    for command, argv in ((report.main, []), (replay.main, ["--allocators", "host", "--no-progress"])):
        one_bounded_line(*run(command, [str(path), *argv], capsys), path)


@BOUND_SETTINGS
@given(name=st.builds(long_text, st.sampled_from(["os", "x.y", "é"]), LENGTHS))
def test_a_class_named_in_a_pickle_is_refused_in_one_bounded_line(tmp_path, capsys, name):
    path = tmp_path / "s.pickle"
    path.write_bytes(b"\x80\x04" + b"\x8c" + b"\x02os" + b"\x8d" + len(name.encode()).to_bytes(8, "little")
                     + name.encode() + b"\x93.")  # protocol 4: SHORT_BINUNICODE, BINUNICODE8, STACK_GLOBAL
    one_bounded_line(*run(report.main, [str(path)], capsys), path)


@BOUND_SETTINGS
@given(field=st.sampled_from(sorted(REPORT_FIELDS, key=str) + [("format",), ("devices", 0),
                                                                ("devices", 0, "pools", 0, "stats")]),
       value=JSON_VALUES)
def test_a_malformed_report_field_of_any_length_is_refused_in_one_bounded_line(tmp_path, capsys, field, value):
    doc = json_report()
    put(doc, field, value)
    path = tmp_path / "r.json"
    with open(path, "w") as f:
        json.dump(doc, f)
    one_bounded_line(*run(report.main, [str(path)], capsys), path)


@BOUND_SETTINGS
@given(name=st.builds(long_text, PIECES, LENGTHS),
       value=st.one_of(st.sampled_from([-1, 1 << 64, 1.5, None]), st.builds(long_text, PIECES, LENGTHS)))
def test_a_statistic_of_any_name_and_value_is_refused_in_one_bounded_line(tmp_path, capsys, name, value):
    doc = json_report()
    doc["devices"][0]["pools"][0]["stats"][name] = value
    path = tmp_path / "r.json"
    with open(path, "w") as f:
        json.dump(doc, f)
    one_bounded_line(*run(report.main, [str(path)], capsys), path)


@pytest.mark.parametrize("digits", [4301, 1 << 20])
def test_a_json_integer_of_more_digits_than_python_reads_is_refused_in_one_line(tmp_path, capsys, digits):
    path = tmp_path / "r.json"
    path.write_text('{"format": "indexer-arena-report-2", "budget": ' + "9" * digits + ', "devices": []}')
    rc, line = run(report.main, [str(path)], capsys)
    one_bounded_line(rc, line, path)
    assert "not valid JSON" in line and "4300" in line, line


# -- work bounded by the file -------------------------------------------------------------------------
def shared_snapshot(segments: int, blocks: int, entries: int = 1, traces: int = 1) -> bytes:
    """A snapshot pickle that names one segment ``segments`` times and, in it, one block ``blocks``
    times, through the pickle's memo: a few bytes per name, so the file is small and the blocks it
    names are segments * blocks."""
    doc = snapshot()
    block = {"size": 4096, "requested_size": 0, "state": "inactive"}
    segment = dict(doc["segments"][0], total_size=4096 * blocks, blocks=[block] * blocks)
    doc["segments"] = [segment] * segments
    doc["device_traces"] = [doc["device_traces"][0] * entries] * traces
    return pickle.dumps(doc, protocol=4)


@pytest.mark.parametrize("shape", [dict(segments=2000, blocks=2000), dict(segments=1, blocks=1, entries=2000,
                                                                           traces=2000)])
@pytest.mark.parametrize("command", [report.main, replay.main])
def test_a_small_snapshot_naming_millions_of_blocks_is_refused_at_once(tmp_path, capsys, command, shape):
    """Item 5 of issue 47: a 226 KB pickle named 2*10^8 blocks and the tools walked them; here 4*10^6
    blocks (or trace entries) from a file of about 20 KB."""
    import time
    path = tmp_path / "s.pickle"
    path.write_bytes(shared_snapshot(**shape))
    assert path.stat().st_size < 40_000
    start = time.perf_counter()
    rc, line = run(command, [str(path), "--allocators", "host", "--no-progress"] if command is replay.main
                   else [str(path)], capsys)
    assert time.perf_counter() - start < 0.5
    assert rc == 2 and "names more segments, blocks, trace entries and statistics than" in line, line


@SETTINGS
@given(segments=st.integers(1, 40), blocks=st.integers(1, 40), entries=st.integers(0, 40),
       traces=st.integers(1, 3))
def test_a_snapshot_is_read_when_its_names_are_within_its_bytes_and_refused_past_them(segments, blocks, entries,
                                                                                      traces):
    """The limit is the file's own size: a snapshot is read exactly when it names no more segments,
    blocks, trace entries and statistics than it has bytes (alloc.export.ITEMS_PER_BYTE each)."""
    from arena_tools.export import ITEMS_PER_BYTE, load_snapshot
    data = shared_snapshot(segments, blocks, entries, traces)
    doc = pickle.loads(data)
    named = (len(doc["segments"]) + sum(len(s["blocks"]) for s in doc["segments"]) + len(doc["device_traces"])
             + sum(map(len, doc["device_traces"])) + len(doc["indexer_arena"]["devices"])
             + sum(1 + len(s["stats"]) for s in doc["indexer_arena"]["stats"]))
    try:
        load_snapshot("s.pickle", data=data)
    except TraceFormatError as e:
        assert named > len(data) * ITEMS_PER_BYTE and "names more" in str(e), (named, len(data), str(e))
    else:
        assert named <= len(data) * ITEMS_PER_BYTE
