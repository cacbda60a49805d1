"""Memory reports: numbers agree with the arenas' own statistics; the CLI reads the out-of-memory
report, snapshots and CSV traces; text, JSON and PNG come out; the report example runs on the host."""

import importlib.util
import json

import pytest

from alloc import Arena, ArenaError
from arena_tools import arena_report, export, report
from alloc.arena import STAT_NAMES
from tests.support import ROOT
from tests.support.trace_workload import BUDGET, MiB, record

KiB = 1 << 10
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rec():
    r = record()
    yield r
    r.close()


def c_report_text(rep: dict) -> str:
    """The report as csrc/torch/plugin_oom.c's ia_plugin_write_report prints it (fprintf, "%.6f" doubles)."""
    def stats(s):
        return ", ".join(f'"{k}": {s[k]:.6f}' if isinstance(s[k], float) else f'"{k}": {s[k]}'
                         for k in STAT_NAMES)

    def blocks(bs):
        return ", ".join("[" + ", ".join(str(v) for v in b) + "]" for b in bs)

    devices = ", ".join(
        f'{{"device": {d["device"]}, "unified": {"true" if d["unified"] else "false"}, "pools": ['
        + ", ".join(f'{{"pool": "{p["pool"]}", "stats": {{{stats(p["stats"])}}}, "blocks": [{blocks(p["blocks"])}]}}'
                    for p in d["pools"]) + "]}" for d in rep["devices"])
    return f'{{"format": "indexer-arena-report-2", "budget": {rep["budget"]}, "devices": [{devices}]}}\n'


def test_summary_agrees_with_arena_stats(rec):
    summary = report.summarize(arena_report.collect(rec.arenas))
    assert [(s["device"], s["pool"]) for s in summary] == [(0, "workspace"), (0, "large")]
    for s in summary:
        stats = rec.arenas[(s["device"], s["pool"])].stats()
        for ours, theirs in (("capacity", "capacity"), ("regions", "regions"), ("in_use", "in_use"),
                             ("requested", "requested"), ("free", "free_bytes"),
                             ("largest_free", "largest_free"), ("blocks", "blocks"),
                             ("free_blocks", "free_blocks"), ("in_use_peak", "in_use_peak")):
            assert s[ours] == stats[theirs], ours
        assert s["fragmentation"] == pytest.approx(stats["fragmentation"], abs=1e-12)
        assert s["fragmentation"] > 0.1  # the workload does fragment them
        assert sum(h["count"] for h in s["free_histogram"]) == stats["free_blocks"]
        assert sum(h["bytes"] for h in s["free_histogram"]) == stats["free_bytes"]
        sizes = [h["size"] for h in s["top_holders"]]
        assert sizes == sorted(sizes, reverse=True) and len(sizes) == min(10, stats["blocks"])


def test_collect_has_the_c_reports_shape(rec):
    rep = arena_report.collect(rec.arenas)
    assert rep["format"] == "indexer-arena-report-2" and rep["budget"] == BUDGET
    assert [d["device"] for d in rep["devices"]] == [0] and rep["devices"][0]["unified"] is False
    for pool in rep["devices"][0]["pools"]:
        assert set(pool) == {"pool", "stats", "blocks"} and list(pool["stats"]) == list(STAT_NAMES)
        arena = rec.arenas[(0, pool["pool"])]
        assert pool["blocks"] == [[b.address - b.offset, b.offset, b.size, b.requested,
                                   int(b.state == "used"), b.stream] for b in arena.blocks()]
    assert json.loads(json.dumps(rep)) == rep
    # the same structure, keyed by pool alone, or from (device, pool, arena) triples
    ws = rec.arenas[(0, "workspace")]
    assert arena_report.collect({"workspace": ws})["devices"][0]["pools"][0]["blocks"] == \
        rep["devices"][0]["pools"][0]["blocks"]
    assert arena_report.collect([(2, "workspace", ws)], unified={2: True})["devices"][0] \
        | {"pools": None} == {"device": 2, "unified": True, "pools": None}


def test_histogram_and_holders_of_a_known_layout():
    with Arena(1 * MiB, 256) as a:
        ptrs = [a.allocate(s) for s in (4 * KiB, 3 * KiB, 1000, 256, 300 * KiB, 64)]
        a.free(ptrs[1])
        a.free(ptrs[3])  # free blocks: 3 KiB, 256 B and the tail
        rep = arena_report.collect({"workspace": a})
        s, = report.summarize(rep, top=2)
        tail = MiB - (4 * KiB + 3 * KiB + 1024 + 256 + 300 * KiB + 256)
        assert s["free_histogram"] == [
            {"min": 256, "max": 512, "count": 1, "bytes": 256},
            {"min": 2048, "max": 4096, "count": 1, "bytes": 3 * KiB},
            {"min": 512 * KiB, "max": 1024 * KiB, "count": 1, "bytes": tail}]
        assert [(h["size"], h["requested"], h["offset"]) for h in s["top_holders"]] == [
            (300 * KiB, 300 * KiB, 7 * KiB + 1024 + 256), (4 * KiB, 4 * KiB, 0)]
        assert s["top_holders"][0]["address"] == ptrs[4]


def test_report_reads_the_c_out_of_memory_report(rec, tmp_path, capsys):
    rep = arena_report.collect(rec.arenas)
    path = tmp_path / "oom.json"
    path.write_text(c_report_text(rep))
    out_json, png, txt = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.txt"
    assert report.main([str(path), "--json", str(out_json), "--png", str(png), "--text", str(txt)]) == 0
    assert capsys.readouterr().out.startswith("written: JSON ")  # --text took the tables
    back = json.loads(out_json.read_text())
    for got, sent in zip(back["devices"][0]["pools"], rep["devices"][0]["pools"]):
        assert got["blocks"] == sent["blocks"]
        assert got["stats"] == pytest.approx(sent["stats"], abs=1e-6)  # "%.6f" for the double
    expected = report.summarize(rep)
    assert [(s["pool"], s["free"], s["largest_free"], s["in_use"]) for s in back["summary"]] == \
        [(s["pool"], s["free"], s["largest_free"], s["in_use"]) for s in expected]
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = txt.read_text()
    for s in expected:
        assert f"{100 * s['fragmentation']:.1f}%" in text
    assert "free blocks by size" in text and "largest live blocks" in text
    # the JSON output is itself a report the command reads back
    assert report.main([str(out_json), "--json", "-"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["summary"] == back["summary"]


def test_report_of_a_snapshot_and_of_a_csv_trace(rec, tmp_path, capsys):
    expected = [(s["pool"], s["capacity"], s["in_use"], s["free"], s["largest_free"], s["free_blocks"])
                for s in report.summarize(arena_report.collect(rec.arenas))]
    snap, csv = tmp_path / "s.pickle", tmp_path / "t.csv"
    export.write_snapshot(export.to_snapshot(arena_report.collect(rec.arenas), rec.events), snap)
    export.write_csv(rec.events, csv)
    for source, extra in ((snap, []), (csv, ["--budget-mb", str(BUDGET >> 20)])):
        assert report.main([str(source), "--json", "-", *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        assert [(s["pool"], s["capacity"], s["in_use"], s["free"], s["largest_free"], s["free_blocks"])
                for s in got["summary"]] == expected, source
        assert [s["in_use_peak"] for s in got["summary"]] == \
            [rec.arenas[(0, p)].stats()["in_use_peak"] for p in ("workspace", "large")]
        assert got["timeline"]["in_use"] and max(got["timeline"]["in_use"]) > 0
    assert report.main([str(csv), "--budget-mb", "2"]) == 0
    assert "host-backed arena" in capsys.readouterr().out


def test_timeline_follows_the_events(rec):
    tl = report.timeline(rec.events, arena_report.collect(rec.arenas))
    live = {}
    for e in rec.events:
        if e.action == "alloc":
            live[e.address] = e.size
        elif e.action == "free":
            live.pop(e.address)
    assert tl["in_use"][-1] == sum(live.values())
    capacity = sum(a.stats()["capacity"] for a in rec.arenas.values())
    assert tl["reserved"][-1] == capacity and tl["reserved"][0] == BUDGET  # the workspace came first
    assert len(report.timeline(rec.events, max_points=50)["t"]) <= 50


@pytest.mark.parametrize("content, words", [
    (None, ["missing.json", "cannot read it"]),
    ('{"format": "something-else"}', ["bad.json", "not an indexer-arena memory report"]),
    ('{"format": "indexer-arena-report-2", "devices": [{"device": 0, "pools": '
     '[{"pool": "workspace", "blocks": [[1, 2, 3]]}]}]}', ["bad.json", "devices[0].pools[0].blocks[0]"]),
    ('{"format": "indexer-arena-report-2", "devices": [', ["bad.json", "not valid JSON"]),
])
def test_report_errors_name_the_file(tmp_path, capsys, content, words):
    path = tmp_path / ("missing.json" if content is None else "bad.json")
    if content is not None:
        path.write_text(content)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_live_report_needs_the_installed_allocator(tmp_path):
    with pytest.raises(ArenaError, match="alloc.install"):
        arena_report.live_report()
    with pytest.raises(ArenaError, match="alloc.install"):
        report.save_live(tmp_path)


def _load_example():
    spec = importlib.util.spec_from_file_location("report_example", ROOT / "examples" / "report_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_example_on_the_host(tmp_path, capsys):
    example = _load_example()
    out = tmp_path / "out"
    assert example.main([str(out), "--prompt-tokens", "32000", "--budget-mb", "64", "--cpu"]) == 0
    printed = capsys.readouterr().out
    assert "seed workload (host simulation)" in printed and "report.png" in printed
    pieces = list(example.pieces(32_000, 3_200, 4, 64 * MiB))
    assert len(pieces) > 10 and pieces[-1][2] == 8000  # the last chunks are cut in two
    rep = json.loads((out / "report.json").read_text())
    ws = rep["summary"][0]
    biggest = max(rows * width * 4 for _s, rows, width in pieces)
    assert ws["capacity"] == 64 * MiB and ws["in_use"] == 0
    assert biggest <= ws["in_use_peak"] < biggest + 256
    assert (out / "report.png").read_bytes()[:8] == PNG_MAGIC
    trace = export.load_trace(out / "trace.csv")
    sizes = [e.size for e in trace.events if e.action == "alloc"]
    assert sizes == [rows * width * 4 for _s, rows, width in pieces]
    snap = export.load_trace(out / "snapshot.pickle")
    assert snap.budget == 64 * MiB and len(snap.events) == 1 + 2 * len(pieces)  # the reservation too
    assert snap.events[0].action == "reserve" and snap.events[0].size == 64 * MiB


def test_a_format_1_report_reads_with_its_counters_under_today_s_names():
    old = {"format": "indexer-arena-report-1", "budget": 0, "devices": [{"device": 0, "pools": [
        {"pool": "large", "blocks": [], "stats": {"capacity": 4, "blocks_in_use": 2, "requests_served": 5,
                                                  "frees": 3, "allocated_total": 9, "freed_total": 7}}]}]}
    stats = report.check_report(old)["devices"][0]["pools"][0]["stats"]
    assert stats == {"capacity": 4, "blocks": 2, "blocks_allocated": 5, "blocks_freed": 3,
                     "in_use_allocated": 9, "in_use_freed": 7}
    with pytest.raises(report.ReportError, match="indexer-arena-report-2"):
        report.check_report({**old, "format": "indexer-arena-report-0"})
