"""Unified-memory detection: which devices take their memory from the host's RAM.

The decision is the C core's (``ia_memory_is_unified``), the same one the allocator applies when
it creates a device's arenas under ``unified:auto``; this module shows its inputs.
"""

from __future__ import annotations

from ._lib import ffi, lib
from .errors import BackendError

FIELDS = ("integrated", "pageable_memory_access", "concurrent_managed_access", "uses_host_page_tables")


def is_unified(attributes: dict[str, int]) -> bool:
    """The decision for a set of attribute values (keys: FIELDS)."""
    unknown = set(attributes) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown attributes {sorted(unknown)}; accepted: {', '.join(FIELDS)}")
    c = ffi.new("ia_memory_attributes_t *", {k: int(v) for k, v in attributes.items()})
    return bool(lib.ia_memory_is_unified(c))


def device_attributes(device: int) -> dict[str, int]:
    """Reads the attributes of a CUDA device through the CUDA runtime torch loaded."""
    import torch  # loads the CUDA runtime into the process

    from .plugin import loaded_cudart
    if not torch.cuda.is_available():
        raise BackendError("no CUDA device is visible")
    path = loaded_cudart()
    if lib.ia_cuda_load(path.encode() if path else ffi.NULL) != lib.IA_OK:
        raise BackendError(ffi.string(lib.ia_cuda_last_error()).decode())
    out = ffi.new("ia_memory_attributes_t *")
    if lib.ia_cuda_memory_attributes(device, out) != lib.IA_OK:
        raise BackendError(ffi.string(lib.ia_cuda_last_error()).decode())
    return {name: int(getattr(out, name)) for name in FIELDS}
