"""The allocator inside serving engines: the entry points of the ``vllm.general_plugins`` and
``sglang.srt.plugins`` groups (``indexer_arena``), and what they wrap, read from the released code
of vLLM 0.13.0 and 0.33.0 and SGLang 0.5.23 (tests/engines checks every route against those
wheels; alloc/engine_plugin.py says how a plugin loads, where it acts and what it logs).

- The indexer's logits are taken inside ``alloc.workspace()`` at the DeepGEMM level: the
  ``deep_gemm`` module's functions (external, or vLLM 0.33's vendored copy), which vLLM's
  ``vllm.utils.deep_gemm`` wrappers resolve once at first use and SGLang looks up at every call,
  so every caller is reached, those that imported vLLM's wrappers by name included. vLLM 0.33's
  float32 copy of half-precision logits (``as_fp32_logits``) is routed too.
- A logits request the arena cannot hold is served outside it (by the allocator the engine has)
  with one warning and a count in ``alloc.memory_stats()`` (``arena.outside.*``), so that no
  request the engine alone would serve fails: the decode logits, ``[batch * next_n,
  max_model_len]`` float32, are not bounded by any budget in either engine. Only inside a CUDA
  graph capture is the arena's refusal raised (a capture cannot be retried).
- The workspace arena is reserved before the engine sizes its KV cache, so the cache is sized with
  the budget taken, counted once (see ``sizing_kv_cache``); vLLM's sleep gives it back and its
  wake takes it again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

from .engine_plugin import (SCOPE_VAR, Engine, Route, _after_import, active_settings,  # noqa: F401
                            carrying_settings, check_ranks, load, refuse, route_status,
                            scope_from_env, start_worker, starting_worker_first)

_warned = set()


def _current_device() -> int:
    import torch
    return torch.cuda.current_device()


def _capturing() -> bool:
    """Whether the current stream captures a CUDA graph (a module function, as _current_device, so
    that the CPU tests can stand in for a device)."""
    import torch
    return torch.cuda.is_current_stream_capturing()


def _arena_refusals(plugin, device: int) -> int:
    arena = plugin.device_arena(device, "workspace")
    return arena.stats()["requests_failed"] if arena is not None else 0


def _serve_outside(fn, args, kwargs, device: int, nbytes: int, why: str, logger: str):
    from . import plugin
    plugin.count_outside(device, nbytes)
    if why not in _warned:
        _warned.add(why)
        budget = plugin.installed_config().budget_mb
        need = f" ({-(-nbytes // (1 << 20))} MiB)" if nbytes else ""
        logging.getLogger(logger).warning(
            "indexer-arena: an indexer logits request%s %s (budget_mb %d), so it was served "
            "outside the arena by the engine's allocator, as it would be without the plugin "
            "(counted in alloc.memory_stats()['arena.outside.calls']); raise budget_mb above it "
            "to keep such requests inside. Warned once.", need, why, budget)
    return fn(*args, **kwargs)


def logits_in_workspace(estimate: Callable[[tuple, dict], int] | None = None, logger: str = __name__):
    """Wraps a function that returns indexer logits: its allocations come from the arena, or from
    outside it when ``estimate(args, kwargs)`` (bytes) is over the budget or the arena refuses."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            from . import plugin
            if not plugin.is_installed():  # a process that does not run the model
                return fn(*args, **kwargs)
            import torch
            device = _current_device()
            nbytes = estimate(args, kwargs) if estimate else 0
            if nbytes > plugin.installed_config().budget_bytes:
                return _serve_outside(fn, args, kwargs, device, nbytes, "is larger than the budget",
                                      logger)
            refused = _arena_refusals(plugin, device)
            try:
                with plugin.workspace():
                    return fn(*args, **kwargs)
            except torch.OutOfMemoryError:
                if _capturing() or _arena_refusals(plugin, device) == refused:
                    raise  # not the arena's refusal, or a capture, which cannot be retried
            return _serve_outside(fn, args, kwargs, device, nbytes,
                                  "did not fit in what the arena had free", logger)
        return call
    return wrap


def paged_logits_bytes(args: tuple, kwargs: dict) -> int:
    """DeepGEMM's paged logits, ``(q, kv_cache, weights, context_lens, block_tables, schedule,
    max_len, ...)``: ``[weights.shape[0], max_len]`` float32 (bf16 on SM100: half, counted as
    float32)."""
    weights = args[2] if len(args) > 2 else kwargs.get("weights")
    width = args[6] if len(args) > 6 else kwargs.get("max_model_len", kwargs.get("max_context_len"))
    if weights is None or not isinstance(width, int):
        return 0
    return int(weights.shape[0]) * width * 4


def _reserve(logger: str) -> None:
    from . import plugin
    if not plugin.is_installed():
        return
    import torch
    try:
        plugin.reserve(_current_device())
    except torch.OutOfMemoryError as e:
        refuse(logger, str(e))


def reserving_first(logger: str):
    """``fn`` after reserving the current device's workspace arena (``alloc.reserve``)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            _reserve(logger)
            return fn(*args, **kwargs)
        return call
    return wrap


def sizing_kv_cache(counts_torch_reserved: bool, logger: str):
    """vLLM's ``Worker.determine_available_memory`` (the KV cache's bytes), with the workspace
    arena reserved first, before the engine's own profiling resets its peaks, so that the workspace
    pool's priming allocation is no transient peak.

    vLLM 0.33 takes what profiling consumed from ``cudaMemGetInfo``, which sees the reservation: it
    is counted once as it is. vLLM 0.13 adds PyTorch's allocated peak to the memory outside
    PyTorch's reserved bytes, and both scopes put the reservation inside those bytes (the process
    scope's ``memory_reserved`` is the arena's; the workspace pool's segment is PyTorch's): it is
    not counted, so it is taken off here (``counts_torch_reserved=False``). A cache size the user
    gave (``kv_cache_memory_bytes``) is kept as given."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            from . import plugin
            _reserve(logger)
            available = fn(self, *args, **kwargs)
            given = getattr(getattr(self, "cache_config", None), "kv_cache_memory_bytes", None)
            if counts_torch_reserved or given or not plugin.is_installed():
                return available
            unseen = (plugin.pool_segment_bytes() if plugin.installed_scope() == "workspace"
                      else plugin.installed_config().budget_bytes)
            return available - unseen
        return call
    return wrap


def releasing_after(logger: str):
    """vLLM's ``Worker.sleep``: the workspace arena goes back with the weights and the cache."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            from . import plugin
            done = fn(*args, **kwargs)
            if plugin.is_installed() and plugin.workspace_reserved(_current_device()):
                try:
                    plugin.release(_current_device())
                except plugin.WorkspaceBusy as e:
                    logging.getLogger(logger).warning("indexer-arena: asleep with the workspace "
                                                      "arena kept: %s", e)
            return done
        return call
    return wrap


def keeping_the_pool_splittable(fn: Callable) -> Callable:
    """vLLM 0.33's ``Worker._scoped_allocator_max_split``, a context manager that sets PyTorch's
    ``max_split_size_mb`` around loading and profiling. Under it PyTorch never splits a segment
    that large, so the workspace pool's one segment would serve one workspace at a time: in the
    workspace scope the setting is left out. vLLM uses it only to keep freed multi-GiB blocks
    releasable while it measures, which at worst makes the KV cache smaller, never a failure."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        from . import plugin
        if plugin.installed_scope() == "workspace":
            return contextlib.nullcontext()
        return fn(*args, **kwargs)
    return call


def capped_to_budget(fn: Callable) -> Callable:
    """SGLang's logits budget (from free memory, up to several GiB): at most the workspace's, so
    that its prefill chunks fit the arena."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        from . import plugin
        budget = fn(*args, **kwargs)
        if not plugin.is_installed():
            return budget
        return min(budget, plugin.installed_config().budget_bytes)
    return call


_VLLM_LOG = "vllm.indexer_arena"
_SGLANG_LOG = "sglang.indexer_arena"
_V13, _V33 = ("0.13.0",), ("0.33.0",)
_VLLM_WORKER = "vllm.v1.worker.gpu_worker"
_prefill = logits_in_workspace(logger=_VLLM_LOG)
_decode = logits_in_workspace(paged_logits_bytes, _VLLM_LOG)


def _deep_gemm(module: str, names: tuple[str, str], versions, decode, prefill) -> tuple[Route, ...]:
    return (Route(module, names[0], prefill, versions, eager=False),
            Route(module, names[1], decode, versions, eager=False))


def _world_group(module: str) -> Callable[[], object]:
    """The engine's group of all its ranks on the CPU (gloo), where the settings are compared."""
    def group():
        import importlib
        return importlib.import_module(module).get_world_group().cpu_group
    return group


VLLM = Engine("vLLM", "vllm", ("0.13.0", "0.33.0"), (
    Route(_VLLM_WORKER, "Worker.init_device", starting_worker_first, always=True),
    # What the driver copies to its workers (alloc/engine_settings.py): each caller's own name
    # for the function (imported by name), so that a module imported before the plugin loaded
    # is covered too. The Ray executors: 0.13's copies the names listed, 0.33's RayExecutorV2
    # the driver's whole environment; the data-parallel engine-core actors: the names listed.
    Route("vllm.ray.ray_env", "get_env_vars_to_copy", carrying_settings, eager=False, always=True),
    Route("vllm.v1.engine.utils", "get_env_vars_to_copy", carrying_settings, eager=False,
          always=True),
    Route("vllm.v1.executor.ray_executor", "get_env_vars_to_copy", carrying_settings, _V13,
          eager=False, always=True),
    Route("vllm.v1.executor.ray_executor_v2", "get_driver_env_vars", carrying_settings, _V33,
          eager=False, always=True),
    Route(_VLLM_WORKER, "Worker.determine_available_memory", sizing_kv_cache(False, _VLLM_LOG), _V13),
    Route(_VLLM_WORKER, "Worker.determine_available_memory", sizing_kv_cache(True, _VLLM_LOG), _V33),
    Route(_VLLM_WORKER, "Worker.sleep", releasing_after(_VLLM_LOG)),
    Route(_VLLM_WORKER, "Worker.wake_up", reserving_first(_VLLM_LOG)),
    Route(_VLLM_WORKER, "Worker._scoped_allocator_max_split", keeping_the_pool_splittable, _V33),
    # Both model runners reserve at their profile run too, for a worker that sizes the cache
    # another way (a no-op once reserved); 0.33's default is Model Runner V2 (gpu/model_runner).
    Route("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.profile_run", reserving_first(_VLLM_LOG)),
    Route("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.profile_run", reserving_first(_VLLM_LOG),
          _V33),
    Route("vllm.model_executor.layers.sparse_attn_indexer", "as_fp32_logits", _prefill, _V33),
    *_deep_gemm("deep_gemm", ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"), _V33, _decode, _prefill),
    *_deep_gemm("vllm.third_party.deep_gemm", ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"), _V33,
                _decode, _prefill),
    *_deep_gemm("deep_gemm", ("fp8_mqa_logits", "fp8_paged_mqa_logits"), _V13, _decode, _prefill),
), _VLLM_LOG, _world_group("vllm.distributed.parallel_state"))

_sg_prefill = logits_in_workspace(logger=_SGLANG_LOG)
_sg_decode = logits_in_workspace(paged_logits_bytes, _SGLANG_LOG)
_SG_ATTENTION = "sglang.srt.layers.attention"

SGLANG = Engine("SGLang", "sglang", ("0.5.23",), (
    # The scheduler process runs the model; SGLang loads plugins in it before making the Scheduler.
    Route("sglang.srt.managers.scheduler", "Scheduler.__init__", starting_worker_first, always=True),
    Route("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator._profile_available_bytes",
          reserving_first(_SGLANG_LOG)),
    *_deep_gemm("deep_gemm", ("fp8_mqa_logits", "fp8_paged_mqa_logits"), (), _sg_decode, _sg_prefill),
    Route(f"{_SG_ATTENTION}.mqa_logits_utils", "mqa_logits_static_budget_bytes", capped_to_budget),
    Route(f"{_SG_ATTENTION}.dsa.dsa_indexer", "mqa_logits_static_budget_bytes", capped_to_budget),
    Route(f"{_SG_ATTENTION}.dsa.utils", "mqa_logits_static_budget_bytes", capped_to_budget),
), _SGLANG_LOG, _world_group("sglang.srt.distributed.parallel_state"))


def vllm_plugin() -> None:
    """The ``vllm.general_plugins`` entry point."""
    load(VLLM)


def sglang_plugin() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    load(SGLANG)
