"""The vLLM checks of a conformance run (conformance.py loads this file in the engine's
environment). Each step calls vLLM's own code; what is stubbed is what needs a GPU: the worker's
device set-up, the model's forward (a transient of ACTIVATIONS bytes on the fake device) and the
sleep-mode backend."""

from __future__ import annotations

import ast
import importlib.util
import math
import types

import torch

from conformance import ACTIVATIONS, BUDGET_MB, WEIGHTS, MiB  # noqa: E402 (the script's folder)


def _version() -> str:
    import vllm
    return vllm.__version__


def _attempt(fn, *args, **kwargs):
    """Calls a function of vLLM's whose body needs a GPU after the route's work: the route's part
    runs, the rest may raise."""
    try:
        fn(*args, **kwargs)
        return "returned"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}"


def _stub_runner(device):
    def profile_run(*args, **kwargs):
        device.allocate(ACTIVATIONS)
        device.free(ACTIVATIONS)

    return types.SimpleNamespace(model_memory_usage=WEIGHTS, profile_run=profile_run,
                                 profile_cudagraph_memory=lambda: 0)


def _worker(device, gpu_worker):
    """A vLLM Worker after init_device and load_model, as far as determine_available_memory, sleep
    and wake_up read it."""
    from vllm.config import CUDAGraphMode
    from vllm.utils import mem_utils
    w = gpu_worker.Worker.__new__(gpu_worker.Worker)
    snapshot = mem_utils.MemorySnapshot
    w.init_snapshot = (snapshot(device=torch.device("cuda:0"))
                       if "device" in snapshot.__dataclass_fields__ else snapshot())
    device.allocate(WEIGHTS)
    w.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9,
                                           cache_dtype="auto")
    w.requested_memory = math.ceil(w.init_snapshot.total_memory * 0.9)
    w.model_runner = _stub_runner(device)
    model_config = types.SimpleNamespace(multimodal_config=None, enforce_eager=True,
                                         enable_nccl_comm_suspend=False, enable_sleep_mode=True)
    w.model_config = model_config
    w.vllm_config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE,
                                                 cudagraph_mm_encoder=False),
        model_config=model_config,
        parallel_config=types.SimpleNamespace(_api_process_count=1, data_parallel_size=1))
    w.parallel_config = w.vllm_config.parallel_config
    w.use_v2_model_runner = True
    if not isinstance(getattr(type(w), "randomize_dummy_inputs", None), property):
        w.randomize_dummy_inputs = False  # 0.33 reads it from parallel_config
    backend = types.SimpleNamespace(suspend=lambda level: None, resume=lambda tags: None,
                                    discard=lambda tags: None)
    w._sleep_mode_backend = backend
    w._sleep_saved_buffers, w._sleep_saved_parameters, w._sleep_saved_draft_buffers = {}, {}, {}
    w.synchronize_device = lambda: None
    _sleep_backend_standin()
    return w


def _sleep_backend_standin() -> None:
    """vLLM 0.13's sleep backend, CuMemAllocator, is compiled against the driver: on this machine
    a stand-in that gives nothing back (the weights and cache are not the plugin's)."""
    import sys
    try:
        importlib.import_module("vllm.device_allocator.cumem")
    except ImportError:
        allocator = types.SimpleNamespace(sleep=lambda offload_tags=(): None,
                                          wake_up=lambda tags=None: None)
        module = types.ModuleType("vllm.device_allocator.cumem")
        module.CuMemAllocator = types.SimpleNamespace(get_instance=lambda: allocator)
        sys.modules[module.__name__] = module


def _kv_cache_bytes(w, gpu_worker) -> int:
    return int(gpu_worker.Worker.determine_available_memory(w))


def _logits(device, scope) -> dict:
    """The indexer's logits functions as the model code holds them (imported by name from
    vllm.utils.deep_gemm, resolved there on first use), called with DeepGEMM's stand-in."""
    from vllm.utils import deep_gemm
    new = hasattr(deep_gemm, "fp8_fp4_mqa_logits")
    holder = None
    for name in (("vllm.model_executor.layers.sparse_attn_indexer",) if new else
                 ("vllm.model_executor.models.deepseek_v2",)):
        try:
            holder = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            holder = deep_gemm
    prefill = getattr(holder, "fp8_fp4_mqa_logits" if new else "fp8_mqa_logits")
    paged = getattr(holder, "fp8_fp4_paged_mqa_logits" if new else "fp8_paged_mqa_logits")
    q = (torch.zeros(4, 1, 2, 8), None) if new else torch.zeros(4, 1, 2, 8)
    weights, lens = torch.zeros(4, 2), torch.ones(4, dtype=torch.int32)
    tables = torch.zeros(4, 1, dtype=torch.int32)
    ks = ke = torch.zeros(4, dtype=torch.int32)
    kv = (torch.zeros(16, 8), torch.zeros(16))
    out = {"holder": holder.__name__}
    out["prefill"] = (prefill(q, kv, weights, ks, ke, 16) if new else prefill(q, kv, weights, ks, ke))
    out["decode"] = paged(q, torch.zeros(1), weights, lens, tables, torch.zeros(1), max_model_len=1024)
    wide = torch.zeros(1024, 2)  # 1,024 rows at a 163,840-token context: 640 MiB of float32
    out["decode_over_budget"] = paged(q, torch.zeros(1), wide, lens, tables, torch.zeros(1),
                                      max_model_len=163840)
    import alloc
    if scope != "off":
        stats = alloc.memory_stats(0)
        out["outside"] = [stats["arena.outside.calls"], stats["arena.outside.bytes"] // MiB]
    return out


def _source_has(module: str, names: list[str]) -> bool:
    """Whether ``module``'s source defines or imports every name (for a module that needs a GPU
    to import: vLLM's vendored DeepGEMM)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return False
    tree = ast.parse(open(spec.origin).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.Assign)):
            found.update([node.name] if isinstance(node, ast.FunctionDef) else
                         [t.id for t in node.targets if isinstance(t, ast.Name)])
    return set(names) <= found


def run(device, scope: str) -> dict:
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # vLLM's own loader: every vllm.general_plugins entry point
    import alloc
    from alloc import engines
    from vllm.v1.worker import gpu_worker
    out = {"engine": "vllm", "version": _version(), "torch": torch.__version__, "scope": scope,
           "budget_mb": BUDGET_MB, "loaded": engines.active_settings() is not None}
    bare = gpu_worker.Worker.__new__(gpu_worker.Worker)
    out["init_device"] = _attempt(gpu_worker.Worker.init_device, bare)  # the worker starts here
    out["installed"] = alloc.is_installed()
    runners = {"v1": "vllm.v1.worker.gpu_model_runner", "v2": "vllm.v1.worker.gpu.model_runner"}
    out["runners"] = {}
    for name, module in runners.items():
        try:
            cls = importlib.import_module(module).GPUModelRunner
        except ImportError:
            continue
        _attempt(cls.profile_run, cls.__new__(cls))
        out["runners"][name] = alloc.is_installed() and alloc.workspace_reserved(0)
        if alloc.is_installed():
            alloc.release(0)
    w = _worker(device, gpu_worker)
    out["kv_cache_bytes"] = _kv_cache_bytes(w, gpu_worker)
    out["workspace_reserved_after_sizing"] = alloc.is_installed() and alloc.workspace_reserved(0)
    free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731
    before = free()
    gpu_worker.Worker.sleep(w, level=1)
    asleep = free()
    gpu_worker.Worker.wake_up(w)
    out["sleep_freed_mb"], out["wake_took_mb"] = (asleep - before) / MiB, (asleep - free()) / MiB
    out["logits"] = _logits(device, scope)
    pending = [r for r, s in engines.route_status().items() if s == "pending"]
    out["pending_found_in_source"] = {str(r): _source_has(r.module, [r.attribute]) for r in pending}
    for module in {r.module for r in pending}:  # vLLM's vendored DeepGEMM, behind an external one
        _attempt(importlib.import_module, module)
    out["routes"] = {str(r): s for r, s in engines.route_status().items()}
    out["always"] = [str(r) for r in engines.route_status() if r.always]
    return out
