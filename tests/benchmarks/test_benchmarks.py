"""The GPU benchmarks' host-side parts, on the CPU: the shared harness (a fresh process per
allocator, rounds alternated, the parent's flags forwarded), the indexer benchmark end to end at
toy sizes (its --smoke mode, under the Triton interpreter), its config texts, and the
linear-terms benchmark's refusal to run without an sm_90 GPU. Their figures mean nothing here;
what is checked is that the programs run and report what RESULTS.md quotes from them."""

import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.alloc import bench_arena
from tests.support import ROOT


def test_bench_indexer_smoke_reports_every_section(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "indexer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "indexer" / "bench_indexer.py"),
                           "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"ceiling_tflops", "prefill", "table"} <= set(res)
    prefill = res["prefill"]
    assert prefill["pieces"] == 5 and prefill["host_per_call_s"] > 0
    assert prefill["max_piece_bytes"] <= prefill["budget_bytes"]
    cases = {(r["section"], r["case"]): r for r in res["table"]}
    identical = [r for (section, case), r in cases.items()
                 if section.startswith("topk") and case.endswith("identical sets / exact rows")]
    assert len(identical) == 2 and all(r["value"] == 1.0 for r in identical)
    assert ("prefill", "host time a call (median)") in cases


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "indexer" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HARNESS_PROGRAM = """
import os, sys
sys.path.insert(0, {root!r})
from benchmarks import harness
NAMES = ("default", "expandable")
p = harness.parser("A toy comparison.", workers=NAMES, rounds=2)
p.add_argument("--x")
args = p.parse_args()
if not harness.child(args, lambda a: {{"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                                     "pid": os.getpid(), "x": a.x, "argv": sys.argv[1:]}}):
    runs = harness.each_allocator(NAMES, __file__, harness.forwarded(), rounds=args.rounds)
    harness.write_json(args.json, runs)
    harness.goal("every run its own process", len({{r["pid"] for r in runs}}) == len(runs), "4 runs")
"""


def test_harness_runs_each_allocator_in_a_fresh_process_rounds_alternated(tmp_path):
    program = tmp_path / "toy.py"
    program.write_text(HARNESS_PROGRAM.format(root=str(ROOT)))
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, str(program), "--x", "7", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert [r["allocator"] for r in runs] == ["default", "expandable", "default", "expandable"]
    assert [r["conf"] for r in runs] == ["", "expandable_segments:True"] * 2
    assert len({r["pid"] for r in runs}) == 4
    assert all(r["x"] == "7" and "--json" not in r["argv"] for r in runs)  # flags forwarded, --json kept
    assert proc.stdout.strip().splitlines()[-1] == "goal: every run its own process: 4 runs: met"
    # each run is also summed up as it ends, so that a run stopped by a time limit leaves figures
    ended = [json.loads(line.split(" ", 3)[3]) for line in proc.stderr.splitlines() if line.startswith("run: round ")]
    assert [(r["allocator"], r["pid"]) for r in ended] == [(r["allocator"], r["pid"]) for r in runs]
    assert [line.split(" ")[2] for line in proc.stderr.splitlines() if line.startswith("run: round ")] == ["1", "1", "2", "2"]


def test_harness_refuses_an_unwritable_json_path_in_one_line(tmp_path):
    program = tmp_path / "toy.py"
    program.write_text(HARNESS_PROGRAM.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, str(program), "--json", str(tmp_path / "nowhere" / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("does not exist")


def test_bench_indexer_topk_config_text_round_trips():
    """The parent hands its top-k config to the arena run's process as text: every field,
    the boolean one included, must come back as it was."""
    pytest.importorskip("triton")
    cases = _bench_module("cases")
    from indexer import topk
    default = topk.default_config(2048)
    for cfg in (default, dataclasses.replace(default, sampled=False, z=2.5, stages=3),
                dataclasses.replace(default, stream=True, segment=16384)):
        assert cases.parse_topk_config(cases.topk_config_text(cfg), 2048) == cfg
    assert "stream seg 16384" in cases.topk_name(dataclasses.replace(default, stream=True,
                                                                     segment=16384))
    for bad in ("sampled=yes", "stages=three", "colour=4", "block="):
        with pytest.raises(SystemExit, match="--topk-config"):
            cases.parse_topk_config(bad, 2048)


def test_bench_indexer_logits_config_text_round_trips():
    """The arena run's process gets the parent's logits config as text: every field must come
    back (a dropped linear_terms once made that process run a slower kernel than the parent)."""
    pytest.importorskip("triton")
    cases = _bench_module("cases")
    from indexer import HopperConfig, LogitsConfig
    configs = [HopperConfig(stages, consumers, linear)
               for stages in (2, 4, 6) for consumers in (2, 3) for linear in range(5)]
    configs += [LogitsConfig(64, 128, 4, 3), LogitsConfig(32, 64, 8, 2)]
    for cfg in configs:
        back = cases.parse_logits_config(cases.logits_config_text(cfg))
        assert type(back) is type(cfg) and back == cfg and repr(back) == repr(cfg)


def test_bench_indexer_compares_prefills_only_when_both_ran_the_same_kernels():
    """The arena-vs-default goal: medians over the alternated rounds; refused (not met) when the
    two processes ran different kernels; skipped where only one side ran (the child's own run)."""
    pytest.importorskip("triton")
    import types
    bench = _bench_module("bench_indexer")

    def compare(results):
        rows = []
        fake = types.SimpleNamespace(results=results, row=lambda *a, **k: rows.append((a, k)))
        bench.Bench.compare_prefill(fake)
        return rows

    same = dict(logits_config="wgmma 64x384 s6 linear3", topk_config="t")
    assert compare({"prefill_arena": dict(same, round_walls_s=[1.0])}) == []
    rows = compare({"prefill": dict(same, round_walls_s=[1.0, 1.2, 1.1]),
                    "prefill_arena": dict(same, round_walls_s=[1.05, 1.3, 1.1])})
    (args, kwargs), = rows
    assert args[2] == pytest.approx(1.1 / 1.1) and args[-1] is True
    rows = compare({"prefill": dict(same, round_walls_s=[1.0]),
                    "prefill_arena": dict(same, logits_config="wgmma 64x384 s6", round_walls_s=[0.9])})
    (args, kwargs), = rows
    assert args[-1] is False and "logits_config" in args[1]


def test_bench_linear_terms_says_what_it_needs_without_an_sm90_gpu():
    """It measures the sm_90 kernel only: elsewhere it must stop with a clear message rather
    than time another kernel under the sm_90 kernel's name."""
    pytest.importorskip("rich")
    import torch
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is here: the benchmark would run")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "indexer" / "bench_linear_terms.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs an sm_90 GPU" in proc.stderr


def test_bench_topk_smoke_runs_every_config_and_finds_torchs_sets(tmp_path):
    """The program end to end on toy sizes in the interpreter: every layout, prefill and
    decode shapes, the same sets as torch.topk (it exits non-zero otherwise), the sampled
    default taking its one-read path on some rows and the streaming layout its own."""
    pytest.importorskip("rich")
    out = tmp_path / "topk.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "indexer" / "bench_topk.py"), "--smoke",
                           "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {r["shape"].split(" [")[0] for r in results} == {"prefill full", "prefill causal", "decode"}
    assert len({r["config"] for r in results}) == 4
    assert all(r["same_sets"] for r in results)
    assert any(r["config"] == "persistent (default)" and r["paths"]["sampled"] > 0 for r in results)
    assert all(r["paths"]["sampled"] == 0 for r in results if "two reads" in r["config"])
    assert all(r["paths"]["stream"] > 0 for r in results if r["config"].startswith("stream"))
    assert all(r["paths"]["stream"] == 0 for r in results if r["config"].startswith("persistent"))


def test_bench_arena_reports_the_core_beside_glibc_as_ratios_and_judges_its_goals(tmp_path):
    """The arena microbenchmark end to end at toy sizes: its C program builds from the tree, every
    allocator runs at one and four threads, ratios are taken within a repeat, and the goals are
    judged on the one-thread medians it reports."""
    out = tmp_path / "arena.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "alloc" / "bench_arena.py"),
                           "--pairs", "4000", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["threads"] for r in res["results"]] == [1, 4]
    for r in res["results"]:
        assert all(len(r["runs"][name]) == 2 and min(r["runs"][name]) > 0 for name in bench_arena.ALLOCATORS)
        for name in bench_arena.GOALS:
            assert r["ratios"][name] == [ns / glibc for ns, glibc in zip(r["runs"][name], r["runs"]["malloc"])]
            assert r["median_ratio"][name] == statistics.median(r["ratios"][name])
    one = res["results"][0]
    assert [g["met"] for g in res["goals"]] == [one["median_ratio"][name] <= bound
                                               for name, bound in bench_arena.GOALS.items()]
    assert "goal: 1 thread: an alloc+free pair in the arena costs at most 1.5x glibc's in the same run" in proc.stdout
    assert " ns" not in proc.stdout  # ratios only


@pytest.mark.parametrize("cpus, says", [("x", "'x' is not a CPU number or range"), ("3-1", "'3-1' runs backwards"),
                                        ("", "'' is not a CPU number or range"),
                                        ("100000", "CPU 100000 is not one this process may run on")])
def test_bench_torch_alloc_refuses_bad_cpus_in_one_line_before_any_run(cpus, says):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/alloc/bench_torch_alloc.py"), "--cpus", cpus],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "run: round" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1]


def test_bench_torch_alloc_reads_cpu_lists_as_the_kernel_writes_them():
    from benchmarks.alloc import bench_torch_alloc
    assert bench_torch_alloc.cpu_list("12-15") == {12, 13, 14, 15}
    assert bench_torch_alloc.cpu_list("3, 5,7-8") == {3, 5, 7, 8}


def test_bench_torch_alloc_pairs_each_round_with_the_same_rounds_baseline(monkeypatch, capsys):
    from benchmarks.alloc import bench_torch_alloc
    runs = [{"allocator": "default", "us": {"r": 1.0}}, {"allocator": "arena", "us": {"r": 1.2}},
            {"allocator": "default", "us": {"r": 10.0}}, {"allocator": "arena", "us": {"r": 5.0}},
            {"allocator": "default", "us": {"r": 2.0}}, {"allocator": "arena", "us": {"r": 3.0}}]
    ratio, ahead = bench_torch_alloc.paired(runs, "default", "arena")["r"]
    assert ratio == pytest.approx(1.2) and ahead == 1  # pairs 1.2, 0.5, 1.5; the medians' ratio is 1.5
    # the parent's report from those runs: the table's columns and the goal on the medians
    monkeypatch.setattr(bench_torch_alloc.harness, "each_allocator", lambda *a, **k: runs)
    monkeypatch.setattr(sys, "argv", ["bench_torch_alloc.py", "--rounds", "3", "--cpus", "none"])
    bench_torch_alloc.main()
    out = capsys.readouterr().out
    assert "1.50" in out and "1.20, 1 of 3" in out
    assert "p < 0.05 over the 1 rows together): no row" in out  # behind in 2 of 3: half of all ties are
    assert out.strip().splitlines()[-1] == ("goal: the process scope at or below PyTorch's allocator's time in every "
                                            "row: slower: r 1.50x: NOT met")


def test_bench_torch_alloc_names_a_row_behind_in_more_rounds_than_ties_allow(monkeypatch, capsys):
    # Two rows, six rounds: "slow" is behind in all six (1 in 64 for a tie, under 0.05 / 2), "even"
    # in three; the medians would call both slower.
    from benchmarks.alloc import bench_torch_alloc
    runs = []
    for i in range(6):
        runs += [{"allocator": "default", "us": {"slow": 1.0 + i, "even": 1.0}},
                 {"allocator": "arena", "us": {"slow": 1.1 + i, "even": (0.9, 1.3)[i % 2]}}]
    monkeypatch.setattr(bench_torch_alloc.harness, "each_allocator", lambda *a, **k: runs)
    monkeypatch.setattr(sys, "argv", ["bench_torch_alloc.py", "--rounds", "6", "--cpus", "none"])
    bench_torch_alloc.main()
    out = capsys.readouterr().out
    assert "p < 0.05 over the 2 rows together): slow (6 of 6)\n" in out
    assert out.strip().splitlines()[-1].endswith("slower: slow 1.03x; even 1.10x: NOT met")


@pytest.mark.parametrize("behind, rounds, chance", [(0, 12, 1.0), (12, 12, 1 / 4096), (10, 12, 79 / 4096),
                                                   (9, 12, 299 / 4096), (4, 8, 163 / 256)])
def test_bench_torch_alloc_sign_test_counts_every_way_a_tie_falls(behind, rounds, chance):
    from benchmarks.alloc import bench_torch_alloc
    assert bench_torch_alloc.behind_by_chance(behind, rounds) == pytest.approx(chance)


@given(st.data())
def test_bench_torch_alloc_sign_test_is_a_tie_seen_from_either_side(data):
    # A tie leaves the process scope behind in k or more rounds exactly as often as it leaves it
    # ahead in n - k + 1 or more, and the two cover every outcome once.
    from benchmarks.alloc import bench_torch_alloc
    rounds = data.draw(st.integers(1, 60))
    behind = data.draw(st.integers(1, rounds))
    assert (bench_torch_alloc.behind_by_chance(behind, rounds)
            + bench_torch_alloc.behind_by_chance(rounds - behind + 1, rounds)) == pytest.approx(1.0)


def test_the_results_table_names_machine_commit_and_command_on_every_claim():
    """benchmarks/RESULTS.md: a user reads it in minutes (at most 300 lines), and every row of a
    claims table has its figure, machine, commit and a command that reproduces it."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= 300
    rows, in_claims = [], False
    for line in text.splitlines():
        if line.startswith("| claim"):
            in_claims = True
            assert line.count("|") == 6, line
        elif not line.startswith("|"):
            in_claims = False
        elif in_claims and not line.startswith("|---"):
            rows.append(line)
    assert len(rows) > 40
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        claim, figure, machine, commit, command = cells[0], cells[1], cells[-3], cells[-2], cells[-1]
        assert claim and figure and machine, row
        assert any(c.isdigit() for c in commit), row
        assert command.count("`") >= 2, row
