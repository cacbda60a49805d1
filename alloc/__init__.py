"""indexer-arena: a budget arena allocator for PyTorch serving workers.

The C core (csrc/) owns the memory; this package is its Python face. Importing it needs neither
torch nor CUDA, nor the compiled core: the names that reach the core (the arena, the plugin) load
it at first use, so a reader of saved traces can import the plain records and the configuration
alone. ``install()`` needs torch and CUDA.
"""

import importlib

from .config import ENV_VAR, VLLM_BUDGET_VAR, Config, from_env
from .errors import (ArenaError, ArenaOutOfMemory, BackendError, ConfigError, DoubleFree,
                     ForeignPointer, InstallError, InvalidFree, InvariantError, WorkspaceBusy)
from .records import STREAM_NONE

_COMPILED = {  # name -> the module that defines it; each one imports the compiled core
    **dict.fromkeys(("Arena", "Block", "HostGuard", "Region", "workspace_arena"), "arena"),
    **dict.fromkeys((
        "SCOPES", "device_arena", "device_is_expandable", "device_is_unified", "graph_pool_blocks", "graph_pools",
        "in_workspace", "install", "installed_config", "installed_scope", "is_installed",
        "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
        "memory_stats", "pool_segment_bytes", "pool_snapshot", "release", "reserve",
        "reset_peak_memory_stats", "workspace", "workspace_pool", "workspace_reserved"), "plugin"),
}

__all__ = [
    "STREAM_NONE", "ENV_VAR", "VLLM_BUDGET_VAR", "Config", "from_env",
    "ArenaError", "ArenaOutOfMemory", "BackendError", "ConfigError", "DoubleFree",
    "ForeignPointer", "InstallError", "InvalidFree", "InvariantError", "WorkspaceBusy",
    *_COMPILED,
]


def __getattr__(name: str):
    module = _COMPILED.get(name)
    if module is None:
        raise AttributeError(f"module 'alloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_COMPILED))
