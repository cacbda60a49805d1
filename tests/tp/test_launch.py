"""Tensor parallelism on the CPU: the launcher (its own and torchrun's), the sharded MLP closed by
a gloo all-reduce, and the seed program end to end on two gloo ranks, all in real processes
(the sharding itself, in one process, is in test_mlp.py).

On the CPU no CUDA allocator exists to install, so every rank here runs with ``--allocator
none``; that asking for the arena (or PyTorch's CUDA allocator) without CUDA is refused, and not
skipped, is tested too. What needs GPUs (the arena under NCCL, device memory) is in
benchmarks/alloc/tp_seed.py, run on the device machine.
"""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import ROOT, SUPPORT
from tp import launch

PROBE = SUPPORT / "tp_probe.py"
CUDA = torch.cuda.is_available()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "NCCL_NVLS_ENABLE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _run(cmd, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# --- the launcher -----------------------------------------------------------------------------

def _launch_cmd(how: str, world: int, out: Path) -> list[str]:
    target = [str(PROBE), str(out), "--json", "not-for-the-launcher", "-m"]
    if how == "tp.launch":
        return [sys.executable, "-m", "tp.launch", "--nproc-per-node", str(world),
                "--allocator", "none", *target]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
            "--standalone", "-m", "tp.launch", "--allocator", "none", *target]


@pytest.mark.parametrize("how", ["tp.launch", "torchrun"])
def test_two_gloo_ranks_get_the_torchrun_environment_and_an_exact_sharded_mlp(how, tmp_path):
    world = 2
    done = _run(_launch_cmd(how, world, tmp_path), OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = _reports(tmp_path, world)
    ports = {r["env"]["MASTER_PORT"] for r in reports}
    assert len(ports) == 1 and None not in ports
    assert len({pid for r in reports for pid in r["pids"]}) == world  # distinct processes
    for rank, r in enumerate(reports):
        env = r["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
            (str(rank), "2", str(rank), "2")
        assert env["MASTER_ADDR"]
        assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
                env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
        assert r["argv"] == [str(tmp_path), "--json", "not-for-the-launcher", "-m"]
        assert r["backend"] == "gloo" and r["world_size"] == world and r["rank"] == rank
        assert r["sum_of_ranks_plus_one"] == 3.0
        ctx = r["context"]
        assert ctx["allocator"] == "none" and ctx["device"] == "cpu"
        assert [m["label"] for m in ctx["marks"]] == ["context", "before process group",
                                                     "process group", "first collective"]
        assert not r["cuda_initialized"]
        assert r["mlp"]["float64"]["rel_err"] < 1e-13
        assert r["mlp"]["float32"]["rel_err"] < 1e-6
        assert r["mlp"]["float64"]["partial_rel_err"] > 0.1
    # The reduced output is the same on both ranks, bit for bit.
    assert reports[0]["mlp"]["float32"]["digest"] == reports[1]["mlp"]["float32"]["digest"]


def test_a_failing_rank_stops_the_launch_with_its_status(tmp_path):
    script = tmp_path / "fail.py"
    # Rank 0 stands for a rank stuck in a collective its peer will never join: only the
    # launcher can end it.
    script.write_text("import sys, time, torch.distributed as d\n"
                      "if d.get_rank() == 1: sys.exit(7)\n"
                      "time.sleep(600)\n")
    t0 = time.monotonic()
    done = _run([sys.executable, "-m", "tp.launch", "--nproc-per-node", "2", "--allocator",
                 "none", str(script)], timeout=60)
    assert done.returncode == 7, done.stderr[-2000:]
    assert "rank 1 exited with status 7" in done.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("allocator", ["arena", "default"])
@pytest.mark.parametrize("as_rank", [False, True], ids=["launcher", "rank"])
def test_a_cuda_allocator_without_cuda_is_refused_not_skipped(allocator, as_rank, tmp_path):
    extra = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT="29999") if as_rank else {}
    done = _run([sys.executable, "-m", "tp.launch", "--allocator", allocator, str(PROBE),
                 str(tmp_path)], timeout=60, **extra)
    assert done.returncode == 2
    assert f"--allocator {allocator} needs CUDA" in done.stderr
    assert "--allocator none" in done.stderr
    assert not list(tmp_path.glob("rank*.json"))


def test_rank_environment_is_parsed_strictly():
    assert launch.RankEnv.from_environ({}) is None
    with pytest.raises(launch.LaunchError, match="MASTER_PORT"):
        launch.RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                     "MASTER_ADDR": "h"})
    with pytest.raises(launch.LaunchError, match="inconsistent"):
        launch.RankEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                     "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    env = launch.RankEnv(1, 2, 1, 2, "h", 5)
    child = launch.child_environ({"NCCL_NVLS_ENABLE": "1", "PYTHONPATH": "/x"}, env, "arena", 2)
    assert child["NCCL_NVLS_ENABLE"] == "0" and child[launch.REGISTER_HOOK_VAR] == "0"
    assert child["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/x"]
    assert launch.RankEnv.from_environ(child) == env


# --- the seed program, end to end -------------------------------------------------------------

def _load_tp_seed():
    spec = importlib.util.spec_from_file_location("tp_seed", ROOT / "benchmarks" / "alloc" / "tp_seed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_program_helpers():
    seed = _load_tp_seed()
    assert seed.chunks(10, 4) == [(4, 4), (4, 8), (2, 10)]
    assert sum(t for t, _ in seed.chunks(254_000, 3_200)) == 254_000
    assert len(seed.chunks(254_000, 3_200)) == 80
    assert seed._sample_rows(3200, 4) == [0, 1066, 2133, 3199]
    assert seed._sample_rows(1, 4) == [0]
    assert seed.plan_runs(["arena", "default"], 2, True) == [("arena", 1), ("arena", 2),
                                                             ("default", 2)]
    assert seed.plan_runs(["arena", "default"], 1, True) == [("arena", 1), ("default", 1)]


def test_seed_program_on_two_gloo_ranks_matches_one_rank_and_the_references(tmp_path):
    out = tmp_path / "tp.json"
    md = tmp_path / "tp.md"
    done = _run([sys.executable, "benchmarks/alloc/tp_seed.py", "--allocators", "none",
                 "--nproc-per-node", "2", "--prompt-tokens", "100", "--chunk-tokens", "50",
                 "--compress-ratio", "4", "--budget-bytes", "2048", "--topk", "8",
                 "--heads", "4", "--head-dim", "16", "--dtype", "fp32", "--hidden", "32",
                 "--intermediate", "64", "--mlp-dtype", "fp32", "--check-rows", "3",
                 "--json", str(out), "--markdown", str(md)], timeout=300, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"]
    runs = {(e["allocator"], e["world_size"]): e["run"] for e in result["runs"]}
    assert set(runs) == {("none", 2), ("none", 1)}
    two, one = runs[("none", 2)], runs[("none", 1)]
    assert two["indices_identical_across_ranks"] and two["hidden_identical_across_ranks"]
    assert two["run_indices_sha256"] == one["run_indices_sha256"]
    for run in (two, one):
        for r in run["ranks"]:
            assert len(r["chunks"]) == 2
            assert r["mlp_check"]["ok"] and r["mlp_check"]["rel_err"] < 1e-5
            assert r["index_check"]["ok"] and r["index_check"]["rows"] == 6
            assert r["index_check"]["exact_rows"] == 6  # float32 in the interpreter is exact here
            # More than one logits piece per chunk, each within the budget.
            assert all(c["pieces"] > 1 and c["max_piece_bytes"] <= 2048 for c in r["chunks"][1:])
            assert all(c["device_bytes"] is None for c in r["chunks"])  # no device to measure
    matches = result["comparison"]["matches"]["none x2"]
    assert [m["equal"] for m in matches] == [True, True]
    assert "| none | 2 | 1 |" in md.read_text()


@pytest.mark.skipif(shutil.which("torchrun") is None and importlib.util.find_spec(
    "torch.distributed.run") is None, reason="no torchrun")
def test_torchrun_alone_makes_the_seed_program_a_rank(tmp_path):
    """Plain torchrun on the script, without tp.launch: the script becomes the rank itself."""
    out = tmp_path / "r.json"
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                 "--standalone", "benchmarks/alloc/tp_seed.py", "--allocator", "none",
                 "--prompt-tokens", "40", "--chunk-tokens", "40", "--topk", "4", "--heads", "2",
                 "--head-dim", "16", "--dtype", "fp32", "--hidden", "8", "--intermediate", "8",
                 "--mlp-dtype", "fp32", "--check-rows", "2", "--json", str(out)],
                timeout=120, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["ok"] and run["world_size"] == 1 and run["backend"] == "gloo"
    assert math.isfinite(run["ranks"][0]["mlp_check"]["rel_err"])


def _gpu_like_run(seed, allocator: str, world: int, budget: int) -> dict:
    """A run record shaped as a GPU rank writes it (numbers made up), to put the reporting code
    that only GPU runs reach through its paces here."""
    ranks = []
    for rank in range(world):
        rows = []
        for i, (_, seen) in enumerate(seed.chunks(254_000, 3_200), 1):
            grow = 0 if allocator == "arena" else i * 10 * 2**20
            ws = None if allocator != "arena" else {
                "capacity": budget, "in_use_peak": budget // 2, "backend_reserves": 1,
                "blocks_allocated": i, "requests_failed": 0}
            rows.append({"chunk": i, "tokens": seen, "step_s": 0.02, "mlp_s": 0.01,
                         "indexer_s": 0.01, "device_bytes": 1500 * 2**20 + grow,
                         "allocator_reserved": 900 * 2**20 + grow, "workspace": ws,
                         "indices_sha256": f"i{i}", "hidden_sha256": f"h{i}"})
        ranks.append({
            "rank": rank, "device": f"cuda:{rank}", "device_name": "NVIDIA H200", "chunks": rows,
            "context": {"process_group_cost": {"device": 300 * 2**20, "allocator": 2 * 2**20,
                                               "outside": 298 * 2**20}},
            "full_allreduce_cost": {"device": 60 * 2**20, "allocator": 44 * 2**20,
                                    "outside": 16 * 2**20},
            "weights_bytes": 396 * 2**20, "loop_s": 9.0,
            "mlp_check": {"ok": True, "rel_err": 4e-3},
            "index_check": {"ok": True, "min_agreement": 0.9995},
            "workspace_check": seed._check_workspace(rows, budget) if allocator == "arena"
            else None})
    return {"allocator": allocator, "world_size": world, "backend": "nccl", "ok": True,
            "ranks": ranks}


def test_seed_program_reports_gpu_runs(capsys):
    seed = _load_tp_seed()
    budget = 512 * 2**20
    results = [{"allocator": a, "world_size": w, "exit_status": 0,
                "run": _gpu_like_run(seed, a, w, budget)}
               for a, w in (("arena", 1), ("arena", 2), ("default", 2))]
    results.append({"allocator": "default", "world_size": 1, "exit_status": 1})
    assert all(r["workspace_check"]["ok"] for r in results[0]["run"]["ranks"])
    cmp_ = seed.compare_runs(results)
    assert cmp_["reference"] == "arena x1" and not cmp_["ok"]
    assert cmp_["failed"] == ["default x1: exit 1"]
    assert all(p["equal"] for per in cmp_["matches"].values() for p in per)
    s = seed.rank_summary(results[1]["run"], results[1]["run"]["ranks"][1])
    assert s["loop_growth"] == 0 and s["workspace_device_calls"] == 1
    assert s["at_headline"] == 1500 * 2**20 and s["headline_tokens"] == 166_400
    cells = seed.summary_cells(s)
    assert cells[7] == "512" and cells[9] == "314" and cells[10] == "46"
    d = seed.rank_summary(results[2]["run"], results[2]["run"]["ranks"][0])
    assert d["loop_growth"] == 79 * 10 * 2**20 and d["workspace_min"] is None
    out = {"device": seed._device_line(results), "runs": results, "comparison": cmp_, "ok": False}
    assert out["device"].startswith("2 x NVIDIA H200,")  # two devices, the name once
    seed.print_comparison(out)
    printed = capsys.readouterr().out
    assert "exit 1" in printed and "some check failed" in printed
    md = seed.markdown(out, ["benchmarks/alloc/tp_seed.py"])
    assert md.count("| arena |") == 3 and md.count("| default |") == 2
    # A workspace that grew, or took a second reservation, fails the check.
    rows = results[1]["run"]["ranks"][0]["chunks"]
    rows[5]["workspace"] = dict(rows[5]["workspace"], capacity=budget * 2, backend_reserves=2)
    assert not seed._check_workspace(rows, budget)["ok"]
