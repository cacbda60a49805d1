"""Per-device facts the launchers need on every call, read once per device.

``torch.cuda.get_device_properties`` and ``get_device_capability`` resolve the device index in
Python on every call, and a prefill asks several times a piece.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "sm_count"]


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
