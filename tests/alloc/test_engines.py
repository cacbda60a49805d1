"""The engine plugins on the CPU: found through their entry points, the scope read from the
environment, and the indexer's logits functions routed into the workspace scope in modules loaded
before or after the plugin."""

import importlib.metadata
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

import alloc
from alloc import engines
from tests.support import run_python


def _installed_as_a_distribution() -> bool:
    try:
        importlib.metadata.distribution("indexer-arena")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_entry_points = pytest.mark.skipif(
    not _installed_as_a_distribution(),
    reason="indexer-arena is on the path but not installed, so no entry points are registered")


@needs_entry_points
@pytest.mark.parametrize("group, target", [("vllm.general_plugins", "alloc.engines:vllm_plugin"),
                                           ("sglang.srt.plugins", "alloc.engines:sglang_plugin")])
def test_entry_points_are_found_and_load_the_plugin(group, target):
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "indexer_arena"]
    assert [ep.value for ep in found] == [target]
    assert callable(found[0].load())


@needs_entry_points
def test_without_the_variable_the_plugin_does_nothing():
    # Each plugin as the engine calls it: loaded by name, called with no arguments.
    done = run_python("""
import importlib.metadata, sys
for group in ("vllm.general_plugins", "sglang.srt.plugins"):
    ep, = [e for e in importlib.metadata.entry_points(group=group) if e.name == "indexer_arena"]
    ep.load()()
import alloc
print(alloc.is_installed(), "torch" in sys.modules, len([f for f in sys.meta_path
      if type(f).__name__ == "_AfterImport"]))
""", env={engines.SCOPE_VAR: ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "0"]


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


def test_a_bad_configuration_is_refused_before_anything_is_installed():
    env = {engines.SCOPE_VAR: "workspace", alloc.ENV_VAR: "budget_mb:lots"}
    with pytest.raises(alloc.ConfigError, match="budget_mb"):
        engines.activate(engines.VLLM_ROUTES, env)
    assert not alloc.is_installed()


def test_the_chosen_scope_is_installed_for_real():
    # On a machine without CUDA the install itself is what refuses: the scope was chosen and
    # handed to alloc.install, whose refusal reaches the engine.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/alloc/plugin/test_scoped.py installs for real")
    done = run_python("""
import alloc
from alloc import engines
try:
    engines.vllm_plugin()
except alloc.InstallError as e:
    print("refused:", e)
""", env={engines.SCOPE_VAR: "workspace"})
    assert done.returncode == 0, done.stderr
    assert "refused: torch sees no CUDA device" in done.stdout


FAKE_INDEXER = '''
import alloc

def fp8_fp4_mqa_logits(q, kv):
    return ("logits", alloc.in_workspace())

def as_fp32_logits(logits, ends):
    return alloc.in_workspace()

class GPUModelRunner:
    def profile_run(self):
        return "profiled"
'''


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """A package standing in for an engine's indexer module, on sys.path but not imported."""
    pkg = tmp_path / "fake_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "indexer.py").write_text(textwrap.dedent(FAKE_INDEXER))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_engine.indexer"
    for name in ("fake_engine.indexer", "fake_engine"):
        sys.modules.pop(name, None)


def _routes(module):
    return (engines.Route(module, "fp8_fp4_mqa_logits", engines.allocating_in_workspace),
            engines.Route(module, "as_fp32_logits", engines.allocating_in_workspace),
            engines.Route(module, "no_such_function", engines.allocating_in_workspace),
            engines.Route(module, "GPUModelRunner.profile_run", engines.allocating_in_workspace))


@pytest.mark.parametrize("imported_first", [True, False])
def test_routes_reach_modules_loaded_before_and_after(fake_engine, imported_first):
    import importlib
    if imported_first:
        importlib.import_module(fake_engine)
    for route in _routes(fake_engine):
        engines._after_import.apply(route)
    module = importlib.import_module(fake_engine)
    assert module.fp8_fp4_mqa_logits(1, 2) == ("logits", True)
    assert module.as_fp32_logits(None, None) is True
    assert module.GPUModelRunner().profile_run() == "profiled"
    assert not alloc.in_workspace()  # the scope closes after each call
    assert not hasattr(module, "no_such_function")  # a name this version lacks is skipped
    for route in _routes(fake_engine):  # applying twice does not wrap twice
        engines._after_import.apply(route)
    inner = module.fp8_fp4_mqa_logits.__wrapped__
    assert not hasattr(inner, "__indexer_arena_route__")
