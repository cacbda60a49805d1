"""One conformance run inside an engine's environment (tests/engines/suite.py starts it there):

    python tests/engines/conformance.py vllm|sglang off|process|workspace

prints one JSON object. The plugin is loaded through the engine's own loader, then the engine's own
functions are called on this CPU machine with the device faked where they read it
(``torch.cuda.mem_get_info``, ``torch.accelerator.get_memory_info``, ``memory_stats``,
``memory_reserved``; ``FakeDevice``). The allocator's side is the real C core serving device 0
from host memory; what PyTorch would count of it (the process scope's statistics are the arena's,
the workspace pool's segment is PyTorch's own) is what ``FakeDevice`` reports. DeepGEMM, a GPU
kernel library, is a stand-in package whose functions report whether they ran inside
``alloc.workspace()``; the code that resolves and calls it is the engine's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import textwrap
import types

MiB, GiB = 1 << 20, 1 << 30
BUDGET_MB = 512
TOTAL = 80 * GiB
CONTEXT = 600 * MiB      # the CUDA context and NCCL, before vLLM's baseline
WEIGHTS = 20 * GiB
ACTIVATIONS = 3 * GiB     # the profile run's transient peak

DEEP_GEMM = '''
import alloc
def _report(*args, **kwargs):
    return ("in workspace", alloc.in_workspace())
fp8_fp4_mqa_logits = fp8_fp4_paged_mqa_logits = fp8_mqa_logits = fp8_paged_mqa_logits = _report
def get_num_sms():
    return 132
'''


class FakeDevice:
    """Device 0's memory as the engine reads it: what the process's allocators hold (PyTorch's
    general tensors, simulated; the workspace arena, the real C core's) on top of a fixed context."""

    def __init__(self, scope: str | None):
        self.scope = scope
        self.allocated = self.peak = self.cached = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.cached = max(self.cached, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def transient(self, nbytes: int) -> None:
        """Allocated and freed at once from a pool that is not PyTorch's general cache."""
        self.peak = max(self.peak, self.allocated + nbytes)

    def workspace_bytes(self) -> tuple[int, int]:
        """(device bytes, of them what PyTorch's memory_reserved counts) of the workspace arena."""
        from alloc import plugin
        arena = plugin.device_arena(0, "workspace") if plugin.is_installed() else None
        held = arena.stats()["capacity"] if arena else 0
        if self.scope == "workspace":
            return held, plugin.pool_segment_bytes() if held else 0
        return held, held  # process scope: memory_reserved() is the arena's, workspace included

    def reserved(self) -> int:
        return self.cached + self.workspace_bytes()[1]

    def used(self) -> int:
        return CONTEXT + self.cached + self.workspace_bytes()[0]

    def stats(self) -> dict:
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.current": self.reserved()}

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self.cached = self.allocated

    def patch_torch(self) -> None:
        import torch
        fns = {"mem_get_info": lambda *a, **k: (TOTAL - self.used(), TOTAL),
               "get_memory_info": lambda *a, **k: (TOTAL - self.used(), TOTAL),
               "memory_stats": lambda *a, **k: self.stats(),
               "memory_reserved": lambda *a, **k: self.reserved(),
               "memory_allocated": lambda *a, **k: self.allocated,
               "max_memory_allocated": lambda *a, **k: self.peak,
               "reset_peak_memory_stats": lambda *a, **k: self.reset_peak(),
               "empty_cache": lambda *a, **k: self.empty_cache(),
               "synchronize": lambda *a, **k: None,
               "current_device": lambda: 0,
               "current_device_index": lambda: 0,
               "is_current_stream_capturing": lambda: False}
        for module in (torch.cuda, torch.accelerator):
            for name, fn in fns.items():
                if hasattr(module, name):
                    setattr(module, name, fn)
        @contextlib.contextmanager
        def use_mem_pool(*args, **kwargs):  # the pool is the fake device's; torch's dynamo
            yield                           # reads __wrapped__, which this keeps
        torch.cuda.use_mem_pool = use_mem_pool


def host_install(device: FakeDevice):
    """alloc.install as the engine plugin calls it, with the C core serving device 0 from host
    memory (tests/support/host_plugin.py); the workspace scope's pool is PyTorch's priming
    allocation on the fake device."""
    from alloc import plugin
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("host_plugin", f"{here}/../support/host_plugin.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)

    def install(config=None, *, devices=(), scope="process"):
        host.install_on_host(config, scope)
        return config

    def workspace_pool(index=None):
        pool = plugin._installed.scope.pools.get(0)
        if pool is None:
            plugin._reserve_arena(0)
            device.transient(plugin.pool_segment_bytes())  # the priming block, freed at once
            pool = plugin._installed.scope.pools[0] = object()
        return pool

    plugin.install = install
    plugin.workspace_pool = workspace_pool
    plugin.pool_snapshot = lambda device=None: []


def deep_gemm_standin() -> None:
    folder = tempfile.mkdtemp(prefix="deep_gemm-")
    os.makedirs(f"{folder}/deep_gemm")
    with open(f"{folder}/deep_gemm/__init__.py", "w") as f:
        f.write(textwrap.dedent(DEEP_GEMM))
    sys.path.insert(0, folder)


def plugin_routes() -> dict:
    from alloc import engines
    return {str(route): state for route, state in engines.route_status().items()}


class Collected(logging.Handler):
    """The plugin's records under the engine's logger (what the engine's handlers would print)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger(name)
        logger.addHandler(self)
        logger.setLevel(logging.INFO)  # SGLang sets its root to INFO when it configures logging

    def emit(self, record) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main() -> None:
    kind, scope = sys.argv[1], sys.argv[2]
    if scope == "bad":  # a bad setting through the engine's own loader: one line, exit status 1
        os.environ["INDEXER_ARENA_SCOPE"] = "everywhere"
        loader = {"vllm": ("vllm.plugins", "load_general_plugins"),
                  "sglang": ("sglang.srt.plugins", "load_plugins")}[kind]
        getattr(importlib.import_module(loader[0]), loader[1])()
        print("went on")
        return
    # vLLM configures its loggers when vllm.logger is imported, which resets its loggers' children
    importlib.import_module({"vllm": "vllm.logger", "sglang": "sglang"}[kind])
    log = Collected(f"{kind}.indexer_arena")
    os.environ.pop("INDEXER_ARENA_SCOPE", None)
    if scope != "off":
        os.environ["INDEXER_ARENA_SCOPE"] = scope
    os.environ["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = str(BUDGET_MB)
    device = FakeDevice(None if scope == "off" else scope)
    deep_gemm_standin()
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(f"conformance_{kind}", f"{here}/conformance_{kind}.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    device.patch_torch()
    host_install(device)
    result = checks.run(device, scope)
    result["log"] = log.lines
    print(json.dumps(result))


if __name__ == "__main__":
    main()
