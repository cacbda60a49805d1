"""Per-device facts the launchers need on every call, read once per device, and the GPU families
the kernels' configs are chosen by.

``torch.cuda.get_device_properties`` and ``get_device_capability`` resolve the device index in
Python on every call, and a prefill asks several times a piece.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "sm_count", "FAMILIES", "family", "family_of"]

# The families whose kernel configs differ (the logits kernel's tile, indexer/logits.py), by
# what their SMs offer:
#   sm_90:   Hopper (H100, H200): wgmma, 227 KiB of shared memory a block.
#   sm_100:  datacenter Blackwell, compute capability 10.x (B200, GB200 10.0; B300 10.3):
#            tcgen05 products into tensor memory, 227 KiB.
#   sm_120:  Blackwell with the consumer SM, 12.x (RTX 50 series, RTX PRO 6000 12.0; GB10 of
#            DGX Spark 12.1): mma.sync, 99 KiB a block and 100 KiB an SM.
#   generic: everything else (Ampere, Ada, Thor, what comes next): configs that fit 99 KiB.
FAMILIES = ("sm_90", "sm_100", "sm_120", "generic")


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, torch.device):
        device = device.index
    return torch.cuda.current_device() if device is None else device


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (default: the current one)."""
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device (default: the current one)."""
    p = _properties(_index(device))
    return p.major, p.minor


def family_of(cap: tuple[int, int]) -> str:
    """The family (one of ``FAMILIES``) of compute capability ``(major, minor)``."""
    if tuple(cap) == (9, 0):
        return "sm_90"
    return {10: "sm_100", 12: "sm_120"}.get(cap[0], "generic")


def family(device: torch.device | int | None = None) -> str:
    """The family of a CUDA device (default: the current one)."""
    return family_of(capability(device))
