"""One chunk of a tensor-parallel prefill around the sparse-attention indexer.

What a serving step does per prefill chunk, reduced to the parts that touch memory and
communication: the sharded MLP over the chunk's hidden states (column- then row-parallel, closed
by one all-reduce), the chunk's new indexer keys written into a kv cache that lives across
chunks, and the indexer prefill over everything seen so far. The indexer runs replicated, as vLLM
runs it under tensor parallelism: every rank scores every query with identical inputs and gets
identical indices, so no collective follows it. Its logits pieces come from ``alloc.workspace()``,
i.e. from the rank's own arena when the arena is installed.

Buffers that live across chunks (kv cache, its scales, the top-k output, sized for the longest
chunk) are made once, outside the workspace, as a serving engine makes them at start-up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from indexer.prefill import DenseKV, PrefillStats, prefill_topk

from .mlp import ShardedMLP

__all__ = ["ServingStep", "StepResult"]


@dataclass
class StepResult:
    """``hidden`` is the all-reduced MLP output ``[T, hidden]`` (the same on every rank);
    ``indices`` int32 ``[T, k]``, a view of the step's output buffer, valid until the next
    step. Times in seconds: device times on a GPU, host times on the CPU."""
    hidden: torch.Tensor
    indices: torch.Tensor
    mlp_s: float
    indexer_s: float
    prefill: PrefillStats


class ServingStep:
    """A prefill of one request, one chunk per call, on this rank."""

    def __init__(self, mlp: ShardedMLP, *, max_tokens: int, max_chunk_tokens: int, head_dim: int,
                 kv_dtype: torch.dtype, compress_ratio: int, topk: int, max_logits_bytes: int,
                 device: torch.device,
                 workspace: Callable[[], contextlib.AbstractContextManager] | None = None):
        if compress_ratio < 1:
            raise ValueError(f"compress_ratio must be >= 1, got {compress_ratio}")
        self.mlp = mlp
        self.compress_ratio = compress_ratio
        self.topk = topk
        self.max_logits_bytes = max_logits_bytes
        self.device = torch.device(device)
        self.workspace = workspace
        capacity = max_tokens // compress_ratio
        self.kv = torch.empty(capacity, head_dim, dtype=kv_dtype, device=self.device)
        self.kv_scale = torch.empty(capacity, dtype=torch.float32, device=self.device)
        self.out = torch.empty(max_chunk_tokens, topk, dtype=torch.int32, device=self.device)
        self.seen = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.kv_scale, self.out))

    def kv_entries(self, seen: int) -> int:
        return seen // self.compress_ratio

    def _clock(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def __call__(self, hidden: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                 new_kv: torch.Tensor, new_kv_scale: torch.Tensor) -> StepResult:
        """Shapes: hidden ``[T, hidden]``, q ``[T, H, D]``, w float32 ``[T, H]``; new_kv
        ``[E, D]`` and new_kv_scale float32 ``[E]`` with ``E`` the kv entries the chunk adds
        (``(seen + T) // ratio - seen // ratio``)."""
        tokens = hidden.shape[0]
        if q.shape[0] != tokens or w.shape[0] != tokens:
            raise ValueError(f"hidden, q and w must have the same tokens: {tokens}, "
                             f"{q.shape[0]}, {w.shape[0]}")
        if tokens > self.out.shape[0]:
            raise ValueError(f"a chunk of {tokens} tokens exceeds the {self.out.shape[0]} the "
                             "step was made for")
        seen = self.seen + tokens
        lo, hi = self.kv_entries(self.seen), self.kv_entries(seen)
        if hi > self.kv.shape[0]:
            raise ValueError(f"{seen} tokens exceed the kv cache made for "
                             f"{self.kv.shape[0] * self.compress_ratio}")
        if new_kv.shape[0] != hi - lo or new_kv_scale.shape != (hi - lo,):
            raise ValueError(f"the chunk adds {hi - lo} kv entries; got {new_kv.shape[0]} and "
                             f"{tuple(new_kv_scale.shape)} scales")
        self.kv[lo:hi] = new_kv
        self.kv_scale[lo:hi] = new_kv_scale
        t0 = self._clock()
        out = self.mlp(hidden)
        t1 = self._clock()
        stats = PrefillStats()
        indices = prefill_topk(q, w, [tokens], [seen], DenseKV(self.kv[:hi], self.kv_scale[:hi]),
                               k=self.topk, max_logits_bytes=self.max_logits_bytes,
                               compress_ratio=self.compress_ratio, out=self.out[:tokens],
                               workspace=self.workspace, stats=stats)
        t2 = self._clock()
        if self.device.type == "cuda":
            t2.synchronize()
        self.seen = seen
        return StepResult(out, indices, self._elapsed(t0, t1), self._elapsed(t1, t2), stats)
