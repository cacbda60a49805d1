"""Malformed files of every kind the readers take (JSON reports, snapshot pickles, CSV traces),
generated: `python -m arena_tools report FILE` either renders them or says in one line what is wrong,
with exit status 2. Nothing else may come out: no traceback, no RecursionError, no OverflowError.
FUZZ_EXAMPLES=N raises the number of files tried per kind (150 by default)."""

import json
import os
import pickle

from hypothesis import HealthCheck, given, settings, strategies as st

from arena_tools import report
from arena_tools.export import RMM_COLUMNS, EXTRA_COLUMNS

NUMBERS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from([0, 1, 2**63, 2**64, -1]),
                    st.floats(allow_nan=True, allow_infinity=True))
LEAVES = st.one_of(NUMBERS, st.text(max_size=6), st.none(), st.booleans())
KEYS = st.sampled_from(["action", "addr", "size", "stream", "time_us", "ia_seq", "ia_pool", "ia_stream",
                        "total_size", "blocks", "address", "state", "segment_type", "device", "pool",
                        "stats", "capacity", "in_use", "requested", "budget", "indexer_arena", "dropped",
                        "frames", "ia_time_ns", "ia_thread"])
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(KEYS, inner, max_size=5)), max_leaves=20)
ACTIONS = st.sampled_from(["alloc", "free_completed", "free", "oom", "segment_alloc", "segment_free",
                           "snapshot", "bogus"])


def entry():
    return st.dictionaries(KEYS, VALUES, max_size=6) | st.builds(
        lambda a, addr, size, rest: {"action": a, "addr": addr, "size": size, **rest},
        ACTIONS, NUMBERS, NUMBERS, st.dictionaries(KEYS, LEAVES, max_size=3))


def run_report(tmp_path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    try:
        rc = report.main([str(path), "--text", str(tmp_path / "out.txt"), "--json", str(tmp_path / "out.json")])
    except SystemExit as e:  # argparse only
        rc = e.code
    assert rc in (0, 2)


SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(devices=st.one_of(VALUES, st.lists(st.dictionaries(KEYS, VALUES, max_size=4) | st.builds(
    lambda d, pools: {"device": d, "pools": pools}, NUMBERS, st.lists(st.dictionaries(KEYS, VALUES, max_size=4)
                                                                     | st.builds(lambda n, b, s: {"pool": n, "blocks": b, "stats": s},
                                                                                 st.text(max_size=4), VALUES, VALUES), max_size=3)), max_size=3)),
       budget=VALUES)
def test_json_reports(tmp_path, devices, budget):
    doc = {"format": "indexer-arena-report-1", "budget": budget, "devices": devices}
    run_report(tmp_path, "r.json", json.dumps(doc, default=str).encode())


@SETTINGS
@given(segments=st.one_of(VALUES, st.lists(st.dictionaries(KEYS, VALUES, max_size=6), max_size=3)),
       traces=st.one_of(VALUES, st.lists(st.lists(entry(), max_size=5), max_size=2)),
       meta=st.one_of(st.none(), st.dictionaries(KEYS, VALUES, max_size=3)))
def test_snapshot_pickles(tmp_path, segments, traces, meta):
    doc = {"segments": segments, "device_traces": traces}
    if meta is not None:
        doc["indexer_arena"] = meta
    run_report(tmp_path, "s.pickle", pickle.dumps(doc, protocol=4))


FIELD = st.one_of(st.integers(-(1 << 70), 1 << 70).map(str), st.sampled_from(["allocate", "free", "allocate failure",
                  "0x10", "", "-1", "nan", str(2**64), "workspace", "general"]), st.text(max_size=4).filter(
                  lambda t: "," not in t and "\n" not in t and "\r" not in t))


@SETTINGS
@given(rows=st.lists(st.lists(FIELD, min_size=6, max_size=9), max_size=6), extra=st.booleans())
def test_csv_traces(tmp_path, rows, extra):
    header = ",".join(RMM_COLUMNS + (EXTRA_COLUMNS if extra else ()))
    text = header + "\n" + "".join(",".join(r) + "\n" for r in rows)
    run_report(tmp_path, "t.csv", text.encode())


def test_deep_nesting_is_a_malformed_file_not_a_recursion_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    run_report(tmp_path, "deep.json", ('{"format": "indexer-arena-report-1", "devices": ' + deep + "}").encode())
