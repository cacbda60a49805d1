"""Trace replay: the host-backed arena reproduces a recorded trace's peak and fragmentation; the loop
shared with the GPU workers replays what the trace says; the command line; the GPU side by side."""

import json

import pytest

from arena_tools import allocators, export, gpu_replay, host_replay, replay
from arena_tools.arena_report import collect
from arena_tools.export import TraceFile
from arena_tools.plan import ALLOC, FAIL, FREE, LARGE, SMALL, WORKSPACE, compile_trace, run_ops
from alloc.trace import Event
from tests.support.trace_workload import BUDGET, MiB, record


@pytest.fixture(scope="module")
def rec():
    r = record()
    yield r
    r.close()


@pytest.fixture(scope="module")
def files(rec, tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    csv, snap = d / "trace.csv", d / "snapshot.pickle"
    export.write_csv(rec.events, csv)
    export.write_snapshot(export.to_snapshot(collect(rec.arenas), rec.events), snap)
    return {"csv": csv, "snapshot": snap}


def _layout(report: dict) -> dict:
    """Per pool, the blocks relative to their regions, regions numbered oldest first as the arena
    lists them (addresses, and their order, differ from run to run)."""
    out = {}
    for dev in report["devices"]:
        for pool in dev["pools"]:
            bases = list(dict.fromkeys(b[0] for b in pool["blocks"]))
            out[pool["pool"]] = [(bases.index(b[0]), *b[1:5]) for b in pool["blocks"]]
    return out


@pytest.mark.parametrize("source", ["csv", "snapshot"])
def test_host_replay_reproduces_peak_and_fragmentation(rec, files, source):
    trace = export.load_trace(files[source])
    result = host_replay.replay_host(trace, budget=BUDGET, keep_report=True)
    ws, large = rec.arenas[(0, "workspace")].stats(), rec.arenas[(0, "large")].stats()
    assert result["budget"] == BUDGET
    assert result["failures"] == result["trace_failures"] == rec.failures > 0
    assert result["unexpected_successes"] == 0
    assert result["workspace_in_use_peak"] == ws["in_use_peak"]
    assert result["fragmentation"] == ws["fragmentation"] and result["largest_free"] == ws["largest_free"]
    replayed = result["arenas"]
    for key, stats in (("0/workspace", ws), ("0/large", large)):
        for name in ("in_use_peak", "capacity_peak", "capacity", "in_use", "free_blocks", "fragmentation",
                     "blocks_allocated", "requests_failed", "blocks_freed", "backend_reserves"):
            assert replayed[key][name] == stats[name], (key, name)
    assert result["peak_reserved_bytes"] == large["capacity_peak"] + BUDGET  # the sum over arenas
    assert _layout(result["report"]) == _layout(collect(rec.arenas))
    assert result["ops"] == sum(e.action in ("alloc", "free", "fail") for e in rec.events)
    assert result["ops_per_s"] > 0


def test_replay_on_a_smaller_budget_fails_more(rec, files):
    trace = export.load_trace(files["csv"])
    assert trace.budget is None  # a CSV does not say; the snapshot does
    assert export.load_trace(files["snapshot"]).budget == BUDGET
    result = host_replay.replay_host(trace, budget=BUDGET // 4)
    assert result["failures"] > rec.failures and result["budget"] == BUDGET // 4


def test_rmm_log_replays_on_the_general_pools(rec, tmp_path):
    path = tmp_path / "rmm.csv"
    export.write_csv(rec.events, path, extended=False)
    trace = export.load_trace(path)
    plan = compile_trace(trace)
    assert set(plan.pools) == {"small", "large"}
    for kind, _slot, size, _d, pool, _s in plan.ops:
        assert pool == (SMALL if size <= 1 << 20 else LARGE)
    result = host_replay.replay_host(trace, plan=plan)
    # without pools every request goes to the growable general arenas: the recorded failures (the
    # workspace's budget overflowing) now succeed, and are freed at once
    assert result["failures"] == 0 and result["unexpected_successes"] == plan.trace_failures
    workspace_all = compile_trace(trace, workspace_all=True)
    assert set(workspace_all.pools) == {"workspace"}


def _trace(*events) -> TraceFile:
    evs = [Event(time_ns=i, thread=1, action=a, address=addr, size=size, stream=stream, device=0, pool=pool)
           for i, (a, addr, size, stream, pool) in enumerate(events)]
    return TraceFile(evs, "<test>", "csv", list(range(2, len(evs) + 2)))


def test_compile_and_run_ops_with_a_fake_allocator():
    trace = _trace(("alloc", 0x100, 1000, 0, "workspace"),
                   ("alloc", 0x200, 3 << 20, 5, "general"),
                   ("alloc", 0x300, 64, 0, "general"),
                   ("free", 0x100, 1024, 0, "workspace"),
                   ("fail", 0, 50, 0, "workspace"),       # recorded failure; fits in the fake: freed at once
                   ("fail", 0, 10 << 20, 0, "workspace"),  # recorded failure; fails again
                   ("alloc", 0x100, 2000, 0, "workspace"),
                   ("free", 0x200, 3 << 20, 5, "general"),
                   ("reserve", 0x1000, 1 << 21, 0, "small"))
    plan = compile_trace(trace)
    assert [op[0] for op in plan.ops] == [ALLOC, ALLOC, ALLOC, FREE, FAIL, FAIL, ALLOC, FREE]
    assert [op[4] for op in plan.ops] == [WORKSPACE, LARGE, SMALL, WORKSPACE, WORKSPACE, WORKSPACE,
                                          WORKSPACE, LARGE]
    assert plan.peak_live == 2000 + (3 << 20) + 64 and plan.peak_op == 6
    assert plan.trace_failures == 2 and plan.slots == 4 and plan.streams == [0, 5]

    log, live = [], {}

    def allocate(size, device, pool, stream):
        if sum(live.values()) + size > 5 << 20:
            raise MemoryError("full")
        handle = len(log)
        live[handle] = size
        log.append(("alloc", size, pool, stream))
        return handle

    def free(handle, stream):
        log.append(("free", live.pop(handle), stream))

    pools, samples = [], []
    result = run_ops(plan, allocate, free, set_pool=pools.append,
                            sample=lambda: samples.append(sum(live.values())), sample_every=1000,
                            sample_bytes=1 << 30)
    assert log == [("alloc", 1000, WORKSPACE, 0), ("alloc", 3 << 20, LARGE, 5), ("alloc", 64, SMALL, 0),
                   ("free", 1000, 0), ("alloc", 50, WORKSPACE, 0), ("free", 50, 0),
                   ("alloc", 2000, WORKSPACE, 0), ("free", 3 << 20, 5)]
    assert pools == [WORKSPACE, LARGE, SMALL, WORKSPACE, -1]  # only on changes, and a final exit
    assert samples == [1000, plan.peak_live, 64 + 2000]  # op 0, the trace's peak, the end
    assert (result.ops, result.failures, result.unexpected_successes) == (9, 1, 1)  # 6 requests, 3 frees
    assert result.first_failure == "MemoryError: full"


def test_cli_host_replay_writes_the_table_and_json(files, tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert replay.main([str(files["snapshot"]), "--allocators", "host", "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "replay: peak memory, failures, speed" in printed and "host" in printed
    data = json.loads(out.read_text())
    assert data["trace"]["budget"] == BUDGET and data["trace"]["budget_source"] == "recorded in the trace"
    host, = data["results"]
    assert host["allocator"] == "host" and host["failures"] == host["trace_failures"]
    assert replay.main([str(files["csv"]), "--allocators", "host", "--json", "-", "--budget-mb", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["budget_source"] == "given"


def test_cli_errors(files, tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,grab,0x10,16,0x0\n")
    assert replay.main([str(bad), "--allocators", "host"]) == 2
    assert f"{bad}: line 2: unknown action 'grab'" in capsys.readouterr().err
    assert replay.main([str(files["csv"]), "--allocators", "host", "--sample-every", "0"]) == 2
    assert "--sample-every must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replay.main([str(files["csv"]), "--allocators", "host,tcmalloc"])
    assert "unknown allocator(s) tcmalloc" in capsys.readouterr().err


def test_gpu_allocators_need_cuda(files, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert replay.main([str(files["csv"]), "--allocators", "default,host"]) == 2
    assert "torch sees none here" in capsys.readouterr().err


@pytest.mark.parametrize("name, conf", [("default", ""), ("expandable", "expandable_segments:True"),
                                        ("cuda-async", "backend:cudaMallocAsync"), ("arena", None)])
def test_worker_command_chooses_the_allocator_before_torch_loads(name, conf, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.5")
    cmd, env = gpu_replay.worker_command(name, "/t.csv", "/r.json", device=1, budget_mb=512, sample_every=64,
                                     sample_bytes=1 << 21, allow_unknown_frees=True, workspace_all=False)
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == conf
    assert cmd[1:4] == ["-m", "arena_tools", "replay"] and cmd[4] == "/t.csv"
    assert cmd[cmd.index("--worker") + 1] == name and cmd[cmd.index("--device") + 1] == "1"
    assert cmd[cmd.index("--budget-mb") + 1] == "512" and "--allow-unknown-frees" in cmd
    with pytest.raises(ValueError, match="not a GPU allocator"):
        gpu_replay.worker_command("host", "/t.csv", "/r.json", device=0, budget_mb=512, sample_every=64,
                              sample_bytes=1, allow_unknown_frees=False, workspace_all=False)


@pytest.mark.gpu
def test_gpu_side_by_side(tmp_path):
    """Growing workspace pieces (the seed workload's shape, smaller): PyTorch's default allocator
    keeps the segments it can no longer reuse, so it holds several times the largest piece; the
    arena holds its budget; nothing fails anywhere."""
    sizes = [(i + 1) * 4 * MiB for i in range(12)]
    events, t = [], 0
    for i, size in enumerate(sizes):
        for action in ("alloc", "free"):
            events.append(Event(t, 1, action, 0x7F0000000000, size, 0, 0, "workspace"))
            t += 1000
    path = tmp_path / "growing.csv"
    export.write_csv(events, path)
    out = tmp_path / "replay.json"
    rc = replay.main([str(path), "--json", str(out), "--budget-mb", "64", "--no-progress", "--timeout", "300"])
    results = {r["allocator"]: r for r in json.loads(out.read_text())["results"]}
    assert rc == 0, results
    assert set(results) == {*gpu_replay.GPU_ALLOCATORS, "host"}
    for r in results.values():
        assert r["failures"] == 0 and r["ops"] == len(events)
    # How many segments PyTorch keeps depends on its splitting rules (a 4 MiB piece gets a 20 MiB
    # segment that also serves the next ones); that it keeps several does not.
    assert results["default"]["peak_reserved_bytes"] >= 3 * max(sizes)
    for arena in ("arena", "arena-regions"):  # budget + general pools
        assert results[arena]["peak_reserved_bytes"] < 64 * MiB + 64 * MiB
    assert results["default"]["peak_bytes"] > 2 * results["arena"]["peak_bytes"]


class _FakeTorch:
    """Just enough of torch for the GPU worker: a device of 1 GiB with raw allocations that record
    whether they ran inside alloc.workspace(); device memory grows by each request rounded to 2 MiB
    and never shrinks, as a caching allocator's would."""

    def __init__(self):
        import types

        from alloc import in_workspace
        self.__version__ = "fake"
        self.used, self.peak_reserved, self.calls, self.next = 0, 0, [], 1 << 32
        self.in_workspace = in_workspace
        fake = self

        class Stream:
            made = 0

            def __init__(self, device=None):
                Stream.made += 1
                self.cuda_stream = 1000 + Stream.made

        def raw_alloc(size, stream):
            if size > 256 << 20:
                raise RuntimeError("CUDA out of memory (fake)")
            fake.calls.append(("alloc", size, stream, fake.in_workspace()))
            fake.used += -(-size // (2 << 20)) * (2 << 20)
            fake.peak_reserved = fake.used
            fake.next += 1 << 24
            return fake.next

        def raw_delete(ptr):
            fake.calls.append(("free", ptr))

        self.cuda = types.SimpleNamespace(
            init=lambda: None, device_count=lambda: 1, set_device=lambda d: None, synchronize=lambda: None,
            cudart=lambda: types.SimpleNamespace(cudaMemGetInfo=lambda d: ((1 << 30) - fake.used, 1 << 30)),
            Stream=Stream, max_memory_reserved=lambda d: fake.peak_reserved,
            max_memory_allocated=lambda d: 0, get_device_name=lambda d: "fake device",
            current_device=lambda: 0)
        self._C = types.SimpleNamespace(_cuda_cudaCachingAllocator_raw_alloc=raw_alloc,
                                        _cuda_cudaCachingAllocator_raw_delete=raw_delete)


@pytest.mark.parametrize("name", ["default", "arena"])
def test_gpu_worker_against_a_fake_torch(name, tmp_path, monkeypatch):
    import sys

    import alloc
    events = [Event(1, 1, "alloc", 0x10000, 100 << 20, 0, 0, "workspace"),
              Event(2, 1, "alloc", 0x20000, 4096, 77, 0, "small"),
              Event(3, 1, "free", 0x10000, 100 << 20, 0, 0, "workspace"),
              Event(4, 1, "fail", 0, 300 << 20, 0, 0, "workspace"),
              Event(5, 1, "alloc", 0x10000, 50 << 20, 0, 0, "workspace"),
              Event(6, 1, "free", 0x20000, 4096, 77, 0, "small")]
    path = tmp_path / "t.csv"
    export.write_csv(events, path)
    fake = _FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    installed = []
    monkeypatch.setattr(alloc, "install", lambda config, scope: installed.append(config))
    monkeypatch.setattr(alloc, "max_memory_reserved", lambda d: 512 << 20)
    monkeypatch.setattr(alloc, "max_memory_allocated", lambda d: 150 << 20)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", allocators.ALLOCATORS[name].alloc_conf or "")
    result_path = tmp_path / "result.json"
    args = replay.build_parser().parse_args([str(path), "--worker", name, "--result", str(result_path),
                                             "--budget-mb", "512", "--sample-every", "1"])
    assert gpu_replay.gpu_worker(args) == 0
    r = json.loads(result_path.read_text())
    allocs = [c for c in fake.calls if c[0] == "alloc"]
    assert [(c[1], c[3] if name == "arena" else None) for c in allocs] == \
        [(100 << 20, True if name == "arena" else None), (4096, False if name == "arena" else None),
         (50 << 20, True if name == "arena" else None)]
    assert allocs[1][2] > 1000 and allocs[0][2] == 0  # stream 77 got a stream of its own, 0 stayed 0
    assert [c[0] for c in fake.calls].count("free") == 2
    assert (r["failures"], r["trace_failures"], r["ops"]) == (1, 1, 6)
    assert r["peak_device_bytes"] == (100 + 2 + 50) << 20
    if name == "arena":
        assert installed and installed[0].budget_mb == 512
        assert r["peak_reserved_bytes"] == 512 << 20 and r["budget"] == 512 << 20
    else:
        assert not installed and r["peak_reserved_bytes"] == (100 + 2 + 50) << 20
    assert r["peak_bytes"] == max(r["peak_device_bytes"], r["peak_reserved_bytes"])
    assert not alloc.in_workspace()


def test_worker_failures_become_error_rows(files):
    """The parent's side of a GPU worker: its failure (here: no CUDA), or its timeout, is a row
    naming the cause, not an exception."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the worker would succeed")
    args = replay.build_parser().parse_args([str(files["csv"])])
    row = gpu_replay.run_worker("default", str(files["csv"]), args, None, 512)
    assert row["allocator"] == "default" and row["error"].startswith("exit status 1")
    assert "CUDA" in row["error"]
    args = replay.build_parser().parse_args([str(files["csv"]), "--timeout", "0.05"])
    row = gpu_replay.run_worker("expandable", str(files["csv"]), args, None, 512)
    assert row["error"].startswith("timed out")


UNKNOWN_FREES = "Thread,Time,Action,Pointer,Size,Stream,Device,Pool\n" \
                "1,00:00:00.000001,allocate,0x10,16,0x0,0,large\n{free}\n"


@pytest.mark.parametrize("free, refused", [
    ("1,00:00:00.000002,free,0xdead,16,0x0,0,large", "free of 0xdead on device 0"),   # never allocated
    ("1,00:00:00.000002,free,0x10,16,0x0,1,large", "free of 0x10 on device 1"),       # another device's
    ("1,00:00:00.000002,free,0x0,0,0x0,0,large", None),                               # free(NULL)
    ("1,00:00:00.000002,free,0x10,16,0x0,0,large", None),                             # the allocation's
])
def test_replay_refuses_a_free_of_an_address_no_allocation_returned(tmp_path, capsys, free, refused):
    path = tmp_path / "t.csv"
    path.write_text(UNKNOWN_FREES.format(free=free))
    rc = replay.main([str(path), "--allocators", "host", "--no-progress"])
    err = capsys.readouterr().err
    if refused is None:
        assert rc == 0, err
        return
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{path}: line 3: {refused}, which no earlier allocate in this trace returned" in err
    assert "--allow-unknown-frees" in err
    assert replay.main([str(path), "--allocators", "host", "--no-progress", "--allow-unknown-frees"]) == 0
    # a snapshot whose ring dropped events may have lost the allocation: its unknown frees are skipped
    trace = export.read_csv(path)
    snap = export.to_snapshot(None, trace.events, dropped=0)
    export.write_snapshot(snap, tmp_path / "s.pickle")
    assert replay.main([str(tmp_path / "s.pickle"), "--allocators", "host", "--no-progress"]) == 2
    snap["indexer_arena"]["dropped"] = 1
    export.write_snapshot(snap, tmp_path / "s.pickle")
    assert replay.main([str(tmp_path / "s.pickle"), "--allocators", "host", "--no-progress"]) == 0


def test_the_plan_skips_frees_it_holds_no_allocation_for_and_marks_the_first_op_at_the_peak():
    """compile_trace on a trace check() has not shortened (e.g. built in code): a free of an address
    no allocation in it returned is left out; the peak's op is the first to reach the peak."""
    trace = _trace(("free", 0xdead, 16, 0, "general"),
                   ("alloc", 0x100, 1000, 0, "workspace"),
                   ("free", 0x100, 1000, 0, "workspace"),
                   ("alloc", 0x100, 1000, 0, "workspace"))  # the same peak again, later
    plan = compile_trace(trace)
    assert [op[0] for op in plan.ops] == [ALLOC, FREE, ALLOC]
    assert plan.peak_live == 1000 and plan.peak_op == 0
