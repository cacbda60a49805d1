"""The SGLang checks of a conformance run (conformance.py loads this file in the engine's
environment). SGLang's functions are called as they are; what is stubbed is the device
(conformance.FakeDevice) and SGLang's runtime context (``get_schedule()`` and its siblings, which a
launched server publishes from its arguments), with the values a one-GPU server has."""

from __future__ import annotations

import importlib
import types

import torch

from conformance import BUDGET_MB, TOTAL, WEIGHTS, MiB  # noqa: E402 (the script's folder)

NS = types.SimpleNamespace
MEM_FRACTION_STATIC = 0.85
CONTEXT = {
    "get_parallel": lambda: NS(launch_world_size=1, world_group=NS(cpu_group=None), attn_dcp_size=1),
    "get_schedule": lambda: NS(mem_fraction_static=MEM_FRACTION_STATIC, prefill_max_requests=None,
                               max_mamba_cache_size=None, page_size=1, max_total_tokens=None),
    "get_exec": lambda: NS(graph=NS(cuda_graph_config=NS(prefill=NS(backend=None,
                                                                    full_prefill_max_req=None)))),
    "get_disagg": lambda: NS(disaggregation_mode="null"),
    "get_mm": lambda: NS(mm_feature_transport=None),
}


def _publish_context(*modules) -> None:
    for module in modules:
        for name, fn in CONTEXT.items():
            if hasattr(module, name):
                setattr(module, name, fn)
        if hasattr(module, "get_device_module"):  # the platform check finds no CUDA here
            module.get_device_module = lambda: torch.cuda
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_properties = lambda *a, **k: NS(is_integrated=False, total_memory=TOTAL)


def _attempt(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
        return "returned"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__


def _kv_bytes(configurator_module) -> int:
    """The KV pool's bytes as SGLang profiles them after loading the model."""
    cls = configurator_module.KVCacheConfigurator
    kvc = cls.__new__(cls)
    kvc.device, kvc.gpu_id, kvc.mambaish_config, kvc.post_capture_kv_active = "cuda", 0, None, False
    kvc.model_config = NS(is_multimodal=False)
    before_load_gb = torch.cuda.mem_get_info()[0] / (1 << 30) + WEIGHTS / (1 << 30)
    return int(cls._profile_available_bytes(kvc, before_load_gb))


def _logits(scope: str) -> dict:
    from sglang.srt.layers.attention.dsa import utils as dsa_utils
    from sglang.srt.layers.attention import mqa_logits_utils
    prefill, paged = dsa_utils.resolve_fp8_mqa_logits_fn(), dsa_utils.resolve_fp8_paged_mqa_logits_fn()
    q, weights, lens = torch.zeros(4, 1, 2, 8), torch.zeros(4, 2), torch.ones(4, dtype=torch.int32)
    tables, ks = torch.zeros(4, 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    out = {"prefill": prefill(q, (torch.zeros(16, 8), torch.zeros(16)), weights, ks, ks),
           "decode": paged(q, torch.zeros(1), weights, lens, tables, torch.zeros(1), 1024, clean_logits=False),
           "decode_over_budget": paged(q, torch.zeros(1), torch.zeros(1024, 2), lens, tables, torch.zeros(1),
                                       163840, clean_logits=False),
           "logits_budget_mb": mqa_logits_utils.mqa_logits_static_budget_bytes(device_index=0) // MiB}
    if scope != "off":
        import alloc
        stats = alloc.memory_stats(0)
        out["outside"] = [stats["arena.outside.calls"], stats["arena.outside.bytes"] // MiB]
    return out


def run(device, scope: str) -> dict:
    import sglang
    from sglang.srt.plugins import load_plugins
    load_plugins()  # SGLang's own loader: every sglang.srt.plugins entry point
    import alloc
    from alloc import engines
    out = {"engine": "sglang", "version": sglang.__version__, "torch": torch.__version__,
           "scope": scope, "budget_mb": BUDGET_MB, "loaded": engines.active_settings() is not None}
    from sglang.srt.managers import scheduler
    out["scheduler_init"] = _attempt(scheduler.Scheduler.__init__,
                                     scheduler.Scheduler.__new__(scheduler.Scheduler))
    out["installed"] = alloc.is_installed()
    from sglang.srt.layers.attention import mqa_logits_utils
    from sglang.srt.mem_cache import kv_cache_configurator
    _publish_context(kv_cache_configurator, mqa_logits_utils)
    device.allocate(WEIGHTS)
    out["kv_cache_bytes"] = _kv_bytes(kv_cache_configurator)
    out["workspace_reserved_after_sizing"] = alloc.is_installed() and alloc.workspace_reserved(0)
    out["logits"] = _logits(scope)
    for module in {r.module for r, s in engines.route_status().items() if s == "pending"}:
        _attempt(importlib.import_module, module)
    out["routes"] = {str(r): s for r, s in engines.route_status().items()}
    out["always"] = [str(r) for r in engines.route_status() if r.always]
    return out
