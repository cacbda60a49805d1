"""indexer-arena: a budget arena allocator for PyTorch serving workers.

The C core (csrc/) owns the memory; this package is its Python face.
"""

from .arena import STREAM_NONE, Arena, Block, Region, workspace_arena
from .config import ENV_VAR, VLLM_BUDGET_VAR, Config, from_env
from .errors import (ArenaError, ArenaOutOfMemory, BackendError, ConfigError, DoubleFree,
                     ForeignPointer, InstallError, InvalidFree, InvariantError)

__all__ = [
    "STREAM_NONE", "Arena", "Block", "Region", "workspace_arena",
    "ENV_VAR", "VLLM_BUDGET_VAR", "Config", "from_env",
    "ArenaError", "ArenaOutOfMemory", "BackendError", "ConfigError", "DoubleFree",
    "ForeignPointer", "InstallError", "InvalidFree", "InvariantError",
]
