"""The engine plugins on the CPU (alloc/engines.py, alloc/engine_plugin.py): found through their
entry points, the settings read from the environment and refused in one line, the routes applied to
modules loaded before or after the plugin (and reported), the worker's start as the one place that
installs, and what each route does, over the real C core serving device 0 from host memory
(tests/support/host_plugin.py). tests/engines runs the same plugin against the released engines."""

import importlib
import importlib.metadata
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

import alloc
from alloc import engines
from tests.support import fake_package, run_python


def _installed_as_a_distribution() -> bool:
    try:
        importlib.metadata.distribution("indexer-arena")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_entry_points = pytest.mark.skipif(
    not _installed_as_a_distribution(),
    reason="indexer-arena is on the path but not installed, so no entry points are registered")

CALL_ENTRY_POINT = """
import importlib.metadata
ep, = [e for e in importlib.metadata.entry_points(group={group!r}) if e.name == "indexer_arena"]
ep.load()()
"""


@needs_entry_points
@pytest.mark.parametrize("group, target", [("vllm.general_plugins", "alloc.engines:vllm_plugin"),
                                           ("sglang.srt.plugins", "alloc.engines:sglang_plugin")])
def test_entry_points_are_found_and_load_the_plugin(group, target):
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "indexer_arena"]
    assert [ep.value for ep in found] == [target]
    assert callable(found[0].load())


@needs_entry_points
def test_without_the_variable_the_plugin_installs_nothing_and_says_it_is_off():
    # Each plugin as the engine calls it: loaded by name, called with no arguments. Off, only the
    # routes marked always are registered (the settings' carriers and the worker's start).
    done = run_python("import logging; logging.basicConfig(level=logging.INFO)\n"
                      + CALL_ENTRY_POINT.format(group="vllm.general_plugins")
                      + CALL_ENTRY_POINT.format(group="sglang.srt.plugins") + """
import alloc, sys
from alloc import engines
loaded = "alloc.plugin" in sys.modules  # the compiled core stays unloaded
print(alloc.is_installed(), "torch" in sys.modules, loaded,
      len([r for r in engines.route_status() if not r.always]))
""", env={engines.SCOPE_VAR: ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False", "0"]
    off = [line for line in done.stderr.splitlines() if "indexer-arena" in line]
    assert len(off) == 2 and all(": off: INDEXER_ARENA_SCOPE unset on this node" in line
                                 for line in off), done.stderr  # one line per engine's loader


@pytest.mark.parametrize("value, scope", [("process", "process"), (" workspace ", "workspace"),
                                          ("", None)])
def test_the_scope_comes_from_the_variable(value, scope):
    assert engines.scope_from_env({engines.SCOPE_VAR: value}) == scope
    assert engines.scope_from_env({}) is None


@given(st.text(min_size=1).filter(lambda s: s.strip() and s.strip() not in alloc.SCOPES))
def test_any_other_value_is_refused_naming_the_variable(value):
    with pytest.raises(alloc.ConfigError) as e:
        engines.scope_from_env({engines.SCOPE_VAR: value})
    assert engines.SCOPE_VAR in str(e.value) and "process or workspace" in str(e.value)


def _one_line(stderr: str) -> str:
    """The process ended with one message, printed once (through the engine's logger), and
    nothing else (no traceback)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@needs_entry_points
@pytest.mark.parametrize("group", ["vllm.general_plugins", "sglang.srt.plugins"])
@pytest.mark.parametrize("env, says", [
    ({engines.SCOPE_VAR: "everywhere"}, "invalid value 'everywhere' for 'INDEXER_ARENA_SCOPE'"),
    ({engines.SCOPE_VAR: "workspace", alloc.ENV_VAR: "budget_mb:lots"}, "'budget_mb'"),
])
def test_a_bad_setting_ends_the_process_with_one_line(group, env, says):
    # vLLM calls the plugin without catching; SGLang catches Exception, which SystemExit is not.
    done = run_python(CALL_ENTRY_POINT.format(group=group) + "print('went on')", env=env)
    assert done.returncode == 1 and "went on" not in done.stdout
    line = _one_line(done.stderr)
    assert line.startswith("indexer-arena: ") and says in line, line


def test_a_refused_install_at_the_workers_start_is_one_line_too():
    # On this machine torch has no CUDA: the install the worker's start makes is what refuses.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/alloc/plugin/test_scoped.py installs for real")
    done = run_python("""
from alloc import engines
engines.load(engines.VLLM)
engines.start_worker()
print('went on')
""", env={engines.SCOPE_VAR: "workspace"})
    assert done.returncode == 1 and "went on" not in done.stdout
    line = _one_line(done.stderr)
    assert line.startswith("indexer-arena: the allocator was not installed: torch sees no CUDA device"), line


FAKE_ENGINE = '''
import alloc

def fp8_fp4_mqa_logits(q, kv):
    return ("logits", alloc.in_workspace())

class GPUModelRunner:
    def profile_run(self):
        return "profiled"

    @staticmethod
    def helper():
        return "static"
'''


@pytest.fixture
def fake_engine_path(tmp_path):
    """A folder holding a package that stands in for an engine's module."""
    return fake_package(tmp_path, {"model": FAKE_ENGINE})


@pytest.fixture
def fake_engine(fake_engine_path, monkeypatch):
    """The stand-in engine's module name, on sys.path but not imported."""
    monkeypatch.syspath_prepend(str(fake_engine_path))
    yield "fake_engine.model"
    for name in ("fake_engine.model", "fake_engine"):
        sys.modules.pop(name, None)


def _routes(module):
    def tagged(fn):
        def call(*args, **kwargs):
            return ("routed", fn(*args, **kwargs))
        return call
    return (engines.Route(module, "fp8_fp4_mqa_logits", tagged),
            engines.Route(module, "no_such_function", tagged),
            engines.Route(module, "GPUModelRunner.profile_run", tagged),
            engines.Route(module, "GPUModelRunner.helper", tagged))


@pytest.mark.parametrize("how", ["imported first", "imported after", "found, then imported"])
def test_routes_reach_modules_loaded_before_and_after(fake_engine, how):
    if how == "imported first":
        importlib.import_module(fake_engine)
    routes = _routes(fake_engine)
    for route in routes:
        engines._after_import.apply(route)
    if how == "found, then imported":  # vLLM's has_deep_gemm asks for the spec before importing
        assert importlib.util.find_spec(fake_engine) is not None
        assert engines.route_status()[routes[0]] == "pending"
    module = importlib.import_module(fake_engine)
    assert module.fp8_fp4_mqa_logits(1, 2) == ("routed", ("logits", False))
    assert module.GPUModelRunner().profile_run() == ("routed", "profiled")
    assert module.GPUModelRunner.helper() == ("routed", "static")
    status = engines.route_status()
    assert [status[r] for r in routes] == ["applied", "missing", "applied", "applied"]
    assert not hasattr(module, "no_such_function")
    for route in routes:  # applying twice does not wrap twice
        engines._after_import.apply(route)
    assert module.fp8_fp4_mqa_logits(1, 2) == ("routed", ("logits", False))


def test_routes_are_chosen_by_the_engines_version():
    from alloc.engines import VLLM
    old, new, unknown = (VLLM.routes_for(v) for v in ("0.13.0", "0.33.0", "0.99.0"))
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run" in map(str, new)
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_run" not in map(str, old)
    assert "deep_gemm.fp8_mqa_logits" in map(str, old) and "deep_gemm.fp8_fp4_mqa_logits" in map(str, new)
    assert unknown == new  # a version the routes were not read from gets the newest's
    for routes in (old, new):  # one wrapper per target in any version
        assert len({str(r) for r in routes}) == len(routes)


HOST = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
import alloc
from alloc import engines, plugin

from tests.support.host_plugin import install_on_host
engines._current_device = lambda: 0  # no CUDA here: device 0 is the host-backed one
"""


def _own_version() -> str:
    """The fake engine's version is this package's: its metadata's where it is installed (CI),
    "(version unknown)" where the tree runs uninstalled (benchmarks/gpu_suite.sh's machine)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("indexer-arena")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def test_only_the_workers_start_installs_and_it_logs_the_routes_once(fake_engine_path):
    done = run_python(HOST + f"sys.path.insert(0, {str(fake_engine_path)!r})" + """
plugin.install = lambda config, scope: install_on_host(config, scope)
fake = engines.Engine("Fake", "indexer-arena", ("0.1.0",), (
    engines.Route("fake_engine.model", "GPUModelRunner.__init__", engines.starting_worker_first),
    engines.Route("fake_engine.model", "fp8_fp4_mqa_logits", engines.logits_in_workspace()),
    engines.Route("fake_engine.model", "renamed_in_this_version", engines.capped_to_budget),
), "fake.indexer_arena")
engines.load(fake)
print("installed after load:", alloc.is_installed())
import fake_engine.model as m
m.GPUModelRunner(); m.GPUModelRunner()
print("installed at the start:", alloc.is_installed(), plugin.installed_scope())
print("logits:", m.fp8_fp4_mqa_logits(1, 2))
""", env={engines.SCOPE_VAR: "process", alloc.ENV_VAR: "budget_mb:64"})
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "installed after load: False" in out and "installed at the start: True process" in out
    assert "logits: ('logits', True)" in out
    info = [line for line in out if line.startswith("INFO fake.indexer_arena")]
    assert len(info) == 2, done.stdout  # the load's line, and the start's, once per process
    assert info[0].endswith(": process scope, budget 64 MiB (from this node's environment)")
    info = info[1:]
    assert f"Fake {_own_version()}, process scope, budget 64 MiB; routes applied: fake_engine.model." \
           "GPUModelRunner.__init__, fake_engine.model.fp8_fp4_mqa_logits" in info[0]
    warnings = [line for line in out if line.startswith("WARNING fake.indexer_arena")]
    assert any("lacks what these routes wrap" in w and "renamed_in_this_version" in w for w in warnings)


def _host(body: str, scope: str = "process", budget_mb: int = 64):
    done = run_python(HOST + f"install_on_host(alloc.Config(budget_mb={budget_mb}), {scope!r})\n"
                      + textwrap.dedent(body))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_logits_over_the_budget_are_served_outside_with_one_warning_and_a_count():
    out = _host("""
    def logits(q, kv, weights, lens, tables, schedule, width):
        return alloc.in_workspace()
    routed = engines.logits_in_workspace(engines.paged_logits_bytes, "engine.x")(logits)
    import torch
    rows = torch.zeros(8, 2)
    print("small:", routed(None, None, rows, None, None, None, 1024))
    wide = torch.zeros(1024, 2)  # 1,024 rows x 163,840 columns x 4 bytes: 640 MiB
    print("wide:", routed(None, None, wide, None, None, None, 163840), routed(None, None, wide, None, None, None, 163840))
    stats = alloc.memory_stats(0)
    print("outside:", stats["arena.outside.calls"], stats["arena.outside.bytes"] >> 20)
    """, budget_mb=512)
    assert "small: True" in out and "wide: False False" in out and "outside: 2 1280" in out
    warnings = [line for line in out if line.startswith("WARNING engine.x")]
    assert len(warnings) == 1 and "(640 MiB) is larger than the budget" in warnings[0]
    assert "raise budget_mb" in warnings[0]


def test_without_the_allocator_installed_the_routes_pass_calls_through():
    done = run_python(HOST + """
routed = engines.logits_in_workspace()(lambda: alloc.in_workspace())
print(routed(), engines.capped_to_budget(lambda: 1 << 40)())
""")
    assert done.returncode == 0 and done.stdout.split() == ["False", str(1 << 40)], done.stderr


@pytest.mark.parametrize("counts_torch_reserved, given, lost", [
    (True, None, 0),            # vLLM 0.33: cudaMemGetInfo saw the reservation
    (False, None, 64 << 20),    # vLLM 0.13: inside PyTorch's reserved bytes, so taken off here
    (False, 1 << 30, 0),        # the user gave the cache's size
])
def test_the_kv_cache_is_sized_with_the_budget_reserved_and_counted_once(counts_torch_reserved, given, lost):
    out = _host(f"""
    import types
    def determine_available_memory(self):
        print("reserved while sizing:", alloc.workspace_reserved(0))
        return 10 << 30
    worker = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_memory_bytes={given}))
    sized = engines.sizing_kv_cache({counts_torch_reserved}, "engine.x")(determine_available_memory)
    print("kv:", sized(worker))
    """)
    assert "reserved while sizing: True" in out and f"kv: {(10 << 30) - lost}" in out


def test_release_and_reserve_move_the_workspace_and_refuse_while_a_block_is_live():
    out = _host("""
    from alloc._lib import ffi, lib
    capacity = lambda: alloc.device_arena(0, "workspace").stats()["capacity"] if alloc.workspace_reserved(0) else 0
    alloc.reserve(0)
    print("reserved:", capacity() >> 20)
    lib.ia_workspace_enter()
    block = lib.ia_torch_alloc(1 << 20, 0, ffi.NULL, ffi.NULL)
    lib.ia_workspace_exit()
    try:
        alloc.release(0)
    except alloc.WorkspaceBusy as e:
        print("busy:", e)
    print("still:", capacity() >> 20)
    lib.ia_torch_free(block)
    alloc.release(0)
    print("released:", capacity(), alloc.memory_stats(0)["reserved_bytes.all.current"])
    alloc.reserve(0)
    print("again:", capacity() >> 20)
    """)
    assert out[0] == "reserved: 64" and out[2] == "still: 64" and out[-1] == "again: 64"
    assert out[1] == ("busy: cannot release the workspace of cuda:0: 1.00 MiB of its workspace arena are "
                      "live (1 blocks); free those tensors (or the CUDA graphs that hold them) first")
    assert out[3] == "released: 0 0"


def test_sleep_releases_the_workspace_and_wake_takes_it_again():
    out = _host("""
    sleep = engines.releasing_after("engine.x")(lambda: "slept")
    wake = engines.reserving_first("engine.x")(lambda: "woke")
    alloc.reserve(0)
    print(sleep(), alloc.workspace_reserved(0), wake(), alloc.workspace_reserved(0))
    from alloc._lib import ffi, lib
    lib.ia_workspace_enter()
    block = lib.ia_torch_alloc(1 << 20, 0, ffi.NULL, ffi.NULL)
    lib.ia_workspace_exit()
    print(sleep(), alloc.workspace_reserved(0))  # a live block: asleep with the arena kept
    """)
    assert out[0] == "slept False woke True" and out[-1] == "slept True"
    assert any(line.startswith("WARNING engine.x indexer-arena: asleep with the workspace arena kept: "
                               "cannot release") for line in out)


@pytest.mark.parametrize("scope, kept", [("process", True), ("workspace", False)])
def test_vllms_max_split_setting_is_left_out_in_the_workspace_scope(scope, kept):
    out = _host("""
    import contextlib
    @contextlib.contextmanager
    def scoped(self, max_split_size_mb):
        print("set", max_split_size_mb)
        yield
    with engines.keeping_the_pool_splittable(scoped)(None, max_split_size_mb=20):
        print("profiled")
    """, scope=scope)
    assert out == (["set 20", "profiled"] if kept else ["profiled"])


def test_sglangs_logits_budget_is_capped_at_the_workspaces():
    out = _host("""
    capped = engines.capped_to_budget(lambda device_index: {2: 3 << 30, 3: 1 << 20}[device_index])
    print(capped(device_index=2) >> 20, capped(device_index=3) >> 20)
    """)
    assert out == ["64 1"]


@pytest.mark.parametrize("capturing, arena_refuses, says", [
    (False, True, "served outside: outside"),        # the arena's refusal: served by the engine's allocator
    (True, True, "raised: OutOfMemoryError"),         # but not inside a capture, which cannot be retried
    (False, False, "raised: OutOfMemoryError"),       # nor a refusal that is not the arena's
])
def test_a_refused_logits_request_is_served_outside_except_in_a_capture_or_when_not_the_arenas(
        capturing, arena_refuses, says):
    out = _host(f"""
    import torch
    engines._capturing = lambda: {capturing}
    plugin.reserve(0)  # the workspace arena, which the engine's start reserves
    def logits():
        if not alloc.in_workspace():
            return "outside"
        if {arena_refuses}:
            try:
                plugin.device_arena(0, "workspace").allocate(2 << 20)  # over the 1 MiB budget
            except alloc.ArenaOutOfMemory as e:
                raise torch.OutOfMemoryError(str(e)) from None
        raise torch.OutOfMemoryError("the device itself")
    routed = engines.logits_in_workspace()(logits)
    try:
        print("served outside:", routed())
    except torch.OutOfMemoryError as e:
        print("raised:", type(e).__name__)
    print("outside calls:", alloc.memory_stats(0)["arena.outside.calls"])
    """, budget_mb=1)
    assert says in out, out
    assert f"outside calls: {1 if says.startswith('served') else 0}" in out, out


def test_a_logits_request_of_exactly_the_budget_is_taken_inside():
    out = _host("""
    import torch
    routed = engines.logits_in_workspace(engines.paged_logits_bytes, "engine.x")(
        lambda q, kv, weights, lens, tables, schedule, width: alloc.in_workspace())
    rows = torch.zeros(256, 2)  # 256 rows x 1,024 columns x 4 bytes: 1 MiB, the budget
    print("exact:", routed(None, None, rows, None, None, None, 1024), routed(None, None, rows, None, None, None, 1025))
    """, budget_mb=1)
    assert "exact: True False" in out, out
