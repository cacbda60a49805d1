"""The allocator inside serving engines, turned on from their plugin hooks.

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts, before a worker
picks its device or loads the model (``vllm/plugins/__init__.py``, ``load_general_plugins``);
SGLang loads ``sglang.srt.plugins`` the same way in each scheduler process
(``sglang/srt/plugins/__init__.py``, ``load_plugins``). This package registers one entry point in
each group, named ``indexer_arena``. Both read:

    INDEXER_ARENA_SCOPE   process or workspace: install the allocator in that scope
                          (unset or empty: the plugin does nothing)
    INDEXER_ARENA_CONF, VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: the configuration, as everywhere

and then route the engine's indexer logits into ``alloc.workspace()`` by wrapping the functions
that return them where the indexer looks them up, now if their module is loaded and otherwise as
soon as it is. For vLLM the device's workspace is also reserved at the start of the memory
profile run, so that the KV cache is sized with the budget already taken.

The names routed were read from vLLM 0.13.0 and 0.33.0 and SGLang 0.5.23.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import config as config_mod
from . import plugin
from .errors import ConfigError

SCOPE_VAR = "INDEXER_ARENA_SCOPE"


@dataclass(frozen=True)
class Route:
    """``module.attribute`` (or ``module.Class.method``) is replaced by ``wrap`` of it."""
    module: str
    attribute: str
    wrap: Callable[[Callable], Callable]


def allocating_in_workspace(fn: Callable) -> Callable:
    """``fn`` with every allocation of its call made inside ``alloc.workspace()``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with plugin.workspace():
            return fn(*args, **kwargs)
    return call


def reserving_first(fn: Callable) -> Callable:
    """``fn`` after reserving the current device's workspace (``alloc.reserve``)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        import torch
        plugin.reserve(torch.cuda.current_device())
        return fn(*args, **kwargs)
    return call


_VLLM_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"  # vLLM 0.33
_VLLM_DEEPSEEK = "vllm.model_executor.models.deepseek_v2"  # vLLM 0.13

VLLM_ROUTES = (
    # The indexer's prefill and decode logits, and (0.33) the float32 copy of half-precision ones.
    Route(_VLLM_INDEXER, "fp8_fp4_mqa_logits", allocating_in_workspace),
    Route(_VLLM_INDEXER, "fp8_fp4_paged_mqa_logits", allocating_in_workspace),
    Route(_VLLM_INDEXER, "as_fp32_logits", allocating_in_workspace),
    Route(_VLLM_DEEPSEEK, "fp8_mqa_logits", allocating_in_workspace),
    Route(_VLLM_DEEPSEEK, "fp8_paged_mqa_logits", allocating_in_workspace),
    Route("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.profile_run", reserving_first),
)

SGLANG_ROUTES = (
    # SGLang resolves DeepGEMM's functions from the module at every call (layers/attention/dsa).
    Route("deep_gemm", "fp8_mqa_logits", allocating_in_workspace),
    Route("deep_gemm", "fp8_paged_mqa_logits", allocating_in_workspace),
)


def scope_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The scope INDEXER_ARENA_SCOPE names, or None when it is unset or empty."""
    environ = os.environ if environ is None else environ
    scope = environ.get(SCOPE_VAR, "").strip()
    if not scope:
        return None
    if scope not in plugin.SCOPES:
        raise ConfigError(SCOPE_VAR, scope, f"{' or '.join(plugin.SCOPES)} (unset: off)", "the environment",
                          "unknown scope")
    return scope


def activate(routes: tuple[Route, ...], environ: Mapping[str, str] | None = None) -> str | None:
    """Installs the allocator in the scope the environment names and routes ``routes``; returns
    the scope, or None (and changes nothing) when INDEXER_ARENA_SCOPE is unset."""
    environ = os.environ if environ is None else environ
    scope = scope_from_env(environ)
    if scope is None:
        return None
    plugin.install(config_mod.from_env(environ), scope=scope)
    for route in routes:
        _after_import.apply(route)
    return scope


def vllm_plugin() -> None:
    """The ``vllm.general_plugins`` entry point."""
    activate(VLLM_ROUTES)


def sglang_plugin() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    activate(SGLANG_ROUTES)


def _replace(module, route: Route) -> None:
    owner_path, _, name = route.attribute.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part, None)
    original = getattr(owner, name, None) if owner is not None else None
    if original is None or getattr(original, "__indexer_arena_route__", None) == route:
        return  # this engine version has no such attribute, or it is routed already
    wrapped = route.wrap(original)
    wrapped.__indexer_arena_route__ = route
    setattr(owner, name, wrapped)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies routes to modules loaded already, and to the others right after they load."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, list[Route]] = {}

    def apply(self, route: Route) -> None:
        with self._lock:
            module = sys.modules.get(route.module)
            if module is None:
                self._pending.setdefault(route.module, []).append(route)
                if self not in sys.meta_path:
                    sys.meta_path.insert(0, self)
                return
        _replace(module, route)

    def find_spec(self, name, path, target=None):
        with self._lock:
            routes = self._pending.pop(name, None)
        if routes is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_route(module):
            exec_module(module)
            for route in routes:
                _replace(module, route)

        spec.loader.exec_module = exec_then_route
        return spec


_after_import = _AfterImport()
