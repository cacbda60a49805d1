"""The plugin's CPU-checkable parts: the out-of-memory path through the C++ shim, configuration
order, the workspace scope and the statistics before any device exists."""

import importlib
import shutil
import subprocess
import threading

import pytest

import alloc
from tests.support import run_python

OOM_VIA_SHIM = """
from alloc._lib import ffi, lib
from alloc import shims
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified = 1 << 20, 256, 0
cudart = ffi.new("char[]", b"/nonexistent/libcudart.so")
c.cudart_path = cudart
{hook}
assert lib.ia_plugin_configure(c) == lib.IA_OK
lib.ia_torch_alloc(4096, 0, ffi.NULL, ffi.NULL)
print("returned")  # must never happen: a failed allocation never returns
"""


def test_out_of_memory_is_thrown_as_c10_out_of_memory_error():
    done = run_python(OOM_VIA_SHIM.format(
        hook='c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())'))
    assert "returned" not in done.stdout
    assert done.returncode != 0
    # Nothing on the CPU catches it, so the C++ runtime names the type and the message as it dies.
    assert "c10::OutOfMemoryError" in done.stderr, done.stderr
    # PyTorch's opening (no device figures: the CUDA runtime is missing), then the arena's account
    assert "CUDA out of memory. Tried to allocate 4.00 KiB. indexer-arena: device 0 cannot allocate 4.00 KiB" \
        in done.stderr
    assert "/nonexistent/libcudart.so" in done.stderr


def test_the_pool_entry_point_raises_too_and_returns_null_without_a_hook():
    # Workspace scope: PyTorch's caching layer calls ia_pool_alloc; a refusal throws through the
    # hook, and without one it returns NULL, which PyTorch turns into its own out-of-memory error.
    code = OOM_VIA_SHIM.replace("lib.ia_torch_alloc(4096, 0, ffi.NULL, ffi.NULL)",
                                "print(lib.ia_pool_alloc(4096, 0, ffi.NULL) == ffi.NULL)")
    code = code.replace("c.budget, c.alignment", "c.scope = lib.IA_SCOPE_WORKSPACE\nc.budget, c.alignment")
    done = run_python(code.format(
        hook='c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())'))
    assert done.returncode != 0 and "c10::OutOfMemoryError" in done.stderr, done.stderr
    assert "/nonexistent/libcudart.so" in done.stderr
    done = run_python(code.format(hook=""))
    assert done.returncode == 0 and done.stdout.split() == ["True", "returned"], done.stderr


def _defined_symbols(path: str, dynamic: bool) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on this machine")
    listed = subprocess.run([nm, *(["-D"] if dynamic else []), "--defined-only", path], capture_output=True,
                            text=True, check=True).stdout
    return {line.split()[-1] for line in listed.splitlines() if line.split()[1:2] in (["T"], ["t"])}


@pytest.mark.parametrize("module", ["alloc._core", "alloc._core_testing"])
def test_the_core_exports_only_what_pytorch_looks_up(module):
    path = importlib.import_module(module).__file__
    expected = {f"PyInit_{module.split('.')[-1]}", "ia_pool_alloc", "ia_pool_free"}
    assert _defined_symbols(path, dynamic=True) == expected


def test_the_production_core_carries_no_test_machinery():
    """csrc/testing/ is built into the test build alone (alloc/_build.py): the production
    extension neither declares nor contains its entry points."""
    import alloc._core as production
    import alloc._core_testing as testing
    for name in ("ia_host_capture_begin", "ia_host_capture_violations", "ia_graph_check", "ia_arena_backend"):
        assert not hasattr(production.lib, name) and hasattr(testing.lib, name), name
    assert "ia_host_capture_begin" not in _defined_symbols(production.__file__, dynamic=False)
    assert "ia_host_capture_begin" in _defined_symbols(testing.__file__, dynamic=False)
    assert getattr(production.lib, "ia_arena_check")  # the invariant walk is the library's (Arena.check)


def test_without_a_hook_it_aborts_with_the_message_instead_of_returning_null():
    done = run_python(OOM_VIA_SHIM.format(hook=""))
    assert "returned" not in done.stdout and done.returncode != 0
    assert "no out-of-memory hook is set" in done.stderr
    assert "CUDA out of memory. Tried to allocate 4.00 KiB." in done.stderr


def test_an_unconfigured_plugin_says_to_install():
    done = run_python("""
from alloc._lib import ffi, lib
lib.ia_torch_alloc(4096, 0, ffi.NULL, ffi.NULL)
""")
    assert done.returncode != 0 and "call alloc.install()" in done.stderr


def test_size_zero_and_null_free_need_nothing():
    from alloc._lib import ffi, lib
    assert lib.ia_torch_alloc(0, 0, ffi.NULL, ffi.NULL) == ffi.NULL
    lib.ia_torch_free(ffi.NULL)


def test_install_without_cuda_is_a_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(alloc.InstallError, match="no CUDA device"):
        alloc.install()
    assert not alloc.is_installed()
    with pytest.raises(alloc.InstallError, match="install"):
        alloc.reserve(0)


def test_workspace_scope_nests_and_is_per_thread():
    seen = []
    assert not alloc.in_workspace()
    with alloc.workspace():
        with alloc.workspace():
            assert alloc.in_workspace()
        assert alloc.in_workspace()
        t = threading.Thread(target=lambda: seen.append(alloc.in_workspace()))
        t.start()
        t.join()
    assert not alloc.in_workspace() and seen == [False]
    with pytest.raises(KeyError):
        with alloc.workspace():
            raise KeyError("the scope closes on errors too")
    assert not alloc.in_workspace()


def test_stats_of_a_device_without_arenas_are_zero():
    s = alloc.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 0 and s["reserved_bytes.all.peak"] == 0
    assert s["num_ooms"] == 0 and s["arena.workspace.capacity"] == 0 and s["arena.expandable"] == 0
    assert not alloc.device_is_expandable(0)
    assert alloc.device_arena(0, "workspace") is None and alloc.memory_reserved(0) == 0


def test_shim_builds_for_the_installed_torch(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from alloc import shims
    monkeypatch.setenv("INDEXER_ARENA_CACHE", str(tmp_path))
    path = shims.build()
    assert path.parent == tmp_path and path.exists()
    assert shims.build() == path  # cached
    monkeypatch.setenv("INDEXER_ARENA_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(alloc.InstallError, match="not an executable"):
        shims.build()
    monkeypatch.setenv("CXX", "c++ -fno-such-option")
    with pytest.raises(alloc.InstallError, match="building the out-of-memory shim failed"):
        shims.build()


def test_workers_building_the_shim_into_one_cache_at_once_each_get_a_whole_file(tmp_path):
    # An engine starts several workers together, each building into the same cache: each build
    # goes to a temporary name and is renamed into place, so every worker loads a whole file.
    pytest.importorskip("torch")
    code = ("import ctypes; from alloc import shims; p = shims.build(); "
            "ctypes.CDLL(str(p)).indexer_arena_raise_oom; print(p)")
    import os
    import sys
    env = {**os.environ, "INDEXER_ARENA_CACHE": str(tmp_path)}
    workers = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [w.communicate(timeout=600) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(outs[0][0].strip())]


def test_a_device_whose_driver_cannot_map_pages_says_why():
    """`python -m alloc devices` and expandable:on both report the driver's reason; without a CUDA
    driver on the machine, it is that the driver library cannot be loaded."""
    if shutil.which("nvidia-smi"):
        pytest.skip("a CUDA driver is here")
    from alloc.plugin import mapping_refusal
    why = mapping_refusal(0, cudart="")
    assert why and "libcuda" in why, why


SCOPE_DISPATCH = """
import json
import alloc
from alloc import plugin
from tests.support.host_plugin import install_on_host
out = {}
try:
    alloc.workspace_pool(0)
except alloc.InstallError as e:
    out["pool_before"] = str(e)
SCOPE = {scope!r}
install_on_host(alloc.Config(budget_mb=4), SCOPE)
out["scope"] = alloc.installed_scope()
asked = []
if SCOPE == "workspace":  # PyTorch's MemPool needs CUDA: record that reserve() asks for it
    plugin.workspace_pool = lambda device=None: asked.append(device)
else:
    try:
        alloc.workspace_pool(0)
    except alloc.InstallError as e:
        out["pool_after"] = str(e)
alloc.reserve(0)
out["asked"], out["reserved"] = asked, alloc.workspace_reserved(0)
if SCOPE == "process":
    with alloc.workspace():
        out["in_workspace"] = alloc.in_workspace()
    out["reserved_bytes"] = alloc.memory_reserved(0)
    out["stats_reserved"] = alloc.memory_stats(0)["reserved_bytes.all.current"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("scope", ["process", "workspace"])
def test_the_scope_chosen_at_install_decides_what_reserve_and_the_pool_do(scope):
    import json
    done = run_python(SCOPE_DISPATCH.replace("{scope!r}", repr(scope)))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["scope"] == scope
    assert out["pool_before"].endswith("the allocator is not installed")
    if scope == "workspace":
        # reserve() goes through the device's pool, which reserves the arena itself
        assert out["asked"] == [0] and out["reserved"] is False
        return
    assert out["pool_after"].endswith("the allocator is installed in process scope")
    assert out["asked"] == [] and out["reserved"] is True and out["in_workspace"] is True
    assert out["reserved_bytes"] == out["stats_reserved"] == 4 << 20  # the core's counts


WORKSPACE_OOM = """
from alloc._lib import ffi, lib
from alloc import shims
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory = 1 << 20, 256, 0, 1
c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())
assert lib.ia_plugin_configure(c) == lib.IA_OK
KiB = 1 << 10
def alloc(size):
    return lib.ia_torch_alloc(size, 0, ffi.cast("void *", 1), ffi.NULL)
lib.ia_workspace_enter()
blocks = [alloc(size) for size in (300 * KiB, 100 * KiB + 1, 200 * KiB, 100 * KiB, 324 * KiB - 256)]
lib.ia_torch_free(blocks[0])
lib.ia_torch_free(blocks[2])
alloc(400 * KiB + 1)   # 500 KiB free in two pieces, the larger 300 KiB: refused
print("returned")
"""


def test_the_workspace_out_of_memory_message_gives_the_arenas_figures():
    """The figures inside the message, each one: what was asked (in bytes too), the device, the
    budget, what the arena holds, what is in use (by block size: 524 KiB, of which 255 bytes were not
    asked for) and its largest free block (after fragmentation: 300 KiB of 500 KiB free)."""
    done = run_python(WORKSPACE_OOM)
    assert "returned" not in done.stdout and done.returncode != 0
    assert ("indexer-arena: workspace request of 400.00 KiB (409601 bytes) on device 0 does not fit the "
            "workspace arena (budget 1.00 MiB; it holds 1.00 MiB, 524.00 KiB in use, largest free block "
            "300.00 KiB)") in done.stderr, done.stderr


GENERAL_OOM = """
import json
from alloc._lib import ffi, lib
from alloc import shims
from alloc.arena import stats_dict
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory, c.expandable = 1 << 20, 256, 0, 1, 0
c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())
assert lib.ia_plugin_configure(c) == lib.IA_OK
def alloc(size):
    return lib.ia_torch_alloc(size, 0, ffi.cast("void *", 1), ffi.NULL)
alloc(3 * (1 << 20) + 1)              # live: its block is rounded up, so in use > requested
lib.ia_torch_free(alloc(64 << 20))    # a region of its own, given back by empty_cache: peak > held
lib.ia_torch_empty_cache()
s = ffi.new("ia_stats_t *")
lib.ia_arena_stats(lib.ia_plugin_arena(0, lib.IA_POOL_LARGE), s)
print(json.dumps(stats_dict(s[0])), flush=True)
alloc(1 << 50)                        # more than the host can map: the backend refuses
print("returned")
"""


def test_a_general_pool_out_of_memory_message_gives_what_the_pool_holds_now():
    """The general pool's figures in its message are the current ones (held, in use by block size,
    largest free block), not the peaks or the requested bytes, which differ here."""
    import json

    from alloc.units import fmt_bytes
    done = run_python(GENERAL_OOM)
    assert "returned" not in done.stdout and done.returncode != 0
    s = json.loads(done.stdout.splitlines()[0])
    assert s["capacity_peak"] > s["capacity"] and s["in_use"] > s["requested"] and s["largest_free"]
    assert (f"request of 1024.00 TiB (1125899906842624 bytes) on device 0 for the general large pool (it holds "
            f"{fmt_bytes(s['capacity'])}, {fmt_bytes(s['in_use'])} in use, largest free block "
            f"{fmt_bytes(s['largest_free'])}; the workspace arena holds a further nothing") in done.stderr, done.stderr


@pytest.mark.parametrize("size, words", [(1024, "1024 bytes"), (1025, "1.00 KiB"), (1 << 20, "1024.00 KiB"),
                                         ((1 << 20) + 1, "1.00 MiB"), ((1 << 30) + 1, "1.00 GiB")])
def test_the_out_of_memory_opening_sizes_a_request_as_pytorch_does(size, words):
    """PyTorch's format_size: bytes up to 1024, then KiB up to 1 MiB, MiB up to 1 GiB, then GiB."""
    done = run_python(OOM_VIA_SHIM.replace("ia_torch_alloc(4096,", f"ia_torch_alloc({size},").format(
        hook='c.raise_oom = ffi.cast("void (*)(const char *)", shims.raise_oom_address())'))
    assert f"CUDA out of memory. Tried to allocate {words}. indexer-arena:" in done.stderr, done.stderr
