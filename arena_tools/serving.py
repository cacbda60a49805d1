"""The memory a serving engine leaves the indexer's workspace, as vLLM works it out: a fraction of
the device's memory (--gpu-memory-utilization), less this GPU's share of the weights and of the KV
cache (--tensor-parallel-size, --kv-cache-memory), with the weights and KV cache per token read
from a model's config.json on disk when given. arena_tools.fit checks the workload against it.
"""

from __future__ import annotations

import argparse
import json

from alloc.errors import ConfigError
from alloc.units import fmt_mib_text as mib


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_int(name: str, value: object, minimum: int, accepted: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(name, value, accepted, reason="not an integer")
    if value < minimum:
        raise ConfigError(name, value, accepted, reason=f"below {minimum}")


def byte_count(text: str) -> int:
    """A byte count as vLLM's --kv-cache-memory takes it: digits, or with a k/m/g/t suffix
    (powers of 1000; Ki/Mi/Gi/Ti: of 1024)."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
    number = text.strip().lower().rstrip("b")
    digits = number.rstrip("kmgti")
    try:
        value = float(digits) * units[number[len(digits):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a byte count: {text[:40]!r} (e.g. 8589934592, 8G, 8Gi)") from None
    if not 0 <= value < 2.0**63:
        raise argparse.ArgumentTypeError(f"out of range: {text[:40]!r}")
    return int(value)


def _host_memory(why: str) -> tuple[int, str]:
    try:
        from alloc.hostmem import available_bytes
    except ImportError as e:
        raise RuntimeError("cannot read this machine's available memory (alloc.hostmem: "
                           f"{e}); pass --available-mb or --device-memory-mb") from None
    try:
        return int(available_bytes()), f"this machine's available host memory ({why})"
    except (OSError, RuntimeError) as e:  # BackendError is a RuntimeError
        raise RuntimeError(f"cannot read this machine's available memory: {e}; pass "
                           "--available-mb or --device-memory-mb") from None


def device_memory(device: int = 0) -> tuple[int, str]:
    """(bytes, where from) of the memory an engine on ``device`` can take: the GPU's total on a
    discrete GPU (what --gpu-memory-utilization is a fraction of), the host's available memory
    on unified memory (GB10: cudaMemGetInfo leaves out reclaimable page cache) and without a GPU
    (alloc.hostmem: MemAvailable bounded by the cgroup limit). torch is read only if installed."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return _host_memory("torch is not installed")
    import torch
    if not torch.cuda.is_available():
        return _host_memory("no CUDA device")
    from alloc.unified import device_attributes, is_unified
    if is_unified(device_attributes(device)):
        return _host_memory(f"GPU {device}, {torch.cuda.get_device_name(device)}, has unified memory")
    total = torch.cuda.mem_get_info(device)[1]
    return total, f"GPU {device}, {torch.cuda.get_device_name(device)}: total (cudaMemGetInfo)"


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1,
               "float8_e4m3fn": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 0}


def model_from_config(path: str) -> dict:
    """Weights (bytes) and KV cache bytes per token of a model directory on disk: config.json's
    layers and attention shape (MLA: kv_lora_rank + qk_rope_head_dim per layer; otherwise keys and
    values of each KV head; a DeepSeek-V3.2 indexer's fp8 keys and scale beside), the weights from
    the safetensors index's total_size, else the size of the weight files. An estimate: pass
    --weights-gib / --kv-bytes-per-token to override either."""
    import os
    config_path = path if path.endswith(".json") else os.path.join(path, "config.json")
    folder = os.path.dirname(config_path)
    try:
        with open(config_path) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        config = config.get("text_config", config)  # multimodal configs nest the language model's
        layers = int(config["num_hidden_layers"])
        dtype = DTYPE_BYTES.get(str(config.get("torch_dtype", config.get("dtype", "bfloat16"))), 2) or 2
        if "kv_lora_rank" in config:
            per_layer = (int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))) * dtype
        else:
            heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            per_layer = 2 * int(config.get("num_key_value_heads", heads)) * head_dim * dtype
        if "index_head_dim" in config:
            per_layer += int(config["index_head_dim"]) + 4
    except OSError as e:
        raise RuntimeError(f"cannot read the model's config {config_path!r}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{config_path!r} is not a model config this check reads ({str(e)[:80]}); "
                           "pass --weights-gib and --kv-bytes-per-token instead") from None
    return {"weights_bytes": _weights_on_disk(folder), "kv_bytes_per_token": layers * per_layer,
            "max_position_embeddings": config.get("max_position_embeddings"), "config": config_path}


def _weights_on_disk(folder: str) -> int | None:
    import glob
    import os
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        with open(index) as f:
            return int(json.load(f)["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    files = glob.glob(os.path.join(folder, "*.safetensors")) or glob.glob(os.path.join(folder, "*.bin"))
    return sum(os.path.getsize(f) for f in files) or None


def serving_available(device_bytes: int, utilization: float, tensor_parallel: int, *,
                      weights_bytes: int = 0, kv_cache_bytes: int | None = None,
                      kv_bytes_per_token: int = 0, max_model_len: int = 0,
                      profiled_bytes: int = 0) -> dict:
    """What vLLM leaves the indexer's workspace on each GPU: the device's memory less this GPU's
    share of the weights (split over --tensor-parallel-size) and its KV cache.

    The KV cache is --kv-cache-memory when given (per GPU, as vLLM takes it). Otherwise vLLM sizes
    it as ``utilization`` of the device (--gpu-memory-utilization) less the weights and the peak
    its profile run saw, whose indexer logits are one budget (``profiled_bytes``: vLLM 0.33 sets
    aside a dummy logits buffer of VLLM_SPARSE_INDEXER_MAX_LOGITS_MB): the workspace then has that
    budget plus the share the engine leaves the system, ``(1 - utilization)`` of the device. A KV
    cache that cannot hold one sequence of max_model_len tokens (``kv_bytes_per_token``) is one
    vLLM refuses to start with."""
    if not 0 < utilization <= 1:
        raise ConfigError("gpu_memory_utilization", utilization, "a fraction in (0, 1]")
    check_int("tensor_parallel_size", tensor_parallel, 1, "a positive number of GPUs")
    weights = cdiv(weights_bytes, tensor_parallel)
    share = int(device_bytes * utilization)
    kv = kv_cache_bytes if kv_cache_bytes is not None else share - weights - profiled_bytes
    least = cdiv(kv_bytes_per_token * max_model_len, tensor_parallel)
    if kv <= 0 or kv < least:
        raise RuntimeError(
            f"the KV cache gets {mib(max(kv, 0))} a GPU ({utilization:g} of {mib(device_bytes)} less "
            f"{mib(weights)} of weights and {mib(profiled_bytes)} of profiled logits), less than one "
            f"{max_model_len:,}-token sequence needs ({mib(least)}): vLLM would not start; raise "
            "--gpu-memory-utilization or --tensor-parallel-size, or lower --max-model-len")
    left = device_bytes - weights - kv
    if left <= 0:
        raise RuntimeError(f"the weights ({mib(weights)} a GPU) and KV cache ({mib(kv)}) take all of "
                           f"{mib(device_bytes)}: nothing is left for the indexer's workspace")
    return {"device_bytes": device_bytes, "gpu_memory_utilization": utilization,
            "tensor_parallel_size": tensor_parallel, "weights_bytes_per_gpu": weights,
            "kv_cache_bytes_per_gpu": kv, "kv_cache_sized_by": "given" if kv_cache_bytes is not None
            else "vLLM: the rest of the engine's share after the profile run", "available_bytes": left}
