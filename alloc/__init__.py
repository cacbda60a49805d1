"""indexer-arena: a budget arena allocator for PyTorch serving workers.

The C core (csrc/) owns the memory; this package is its Python face. Importing it needs neither
torch nor CUDA; ``install()`` needs both.
"""

from .arena import STREAM_NONE, Arena, Block, HostGuard, Region, workspace_arena
from .config import ENV_VAR, VLLM_BUDGET_VAR, Config, from_env
from .errors import (ArenaError, ArenaOutOfMemory, BackendError, ConfigError, DoubleFree,
                     ForeignPointer, InstallError, InvalidFree, InvariantError)
from .plugin import (SCOPES, device_arena, device_is_expandable, device_is_unified, graph_pool_blocks, graph_pools, in_workspace, install, installed_config,
                     installed_scope, is_installed, max_memory_allocated, max_memory_reserved,
                     memory_allocated, memory_reserved, memory_stats, pool_segment_bytes, pool_snapshot, reserve,
                     reset_peak_memory_stats, workspace, workspace_pool)

__all__ = [
    "STREAM_NONE", "Arena", "Block", "HostGuard", "Region", "workspace_arena",
    "ENV_VAR", "VLLM_BUDGET_VAR", "Config", "from_env",
    "ArenaError", "ArenaOutOfMemory", "BackendError", "ConfigError", "DoubleFree",
    "ForeignPointer", "InstallError", "InvalidFree", "InvariantError",
    "SCOPES", "device_arena", "device_is_expandable", "device_is_unified", "graph_pool_blocks", "graph_pools", "in_workspace", "install", "installed_config",
    "installed_scope", "is_installed",
    "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
    "memory_stats", "pool_segment_bytes", "pool_snapshot", "reserve", "reset_peak_memory_stats", "workspace",
    "workspace_pool",
]
