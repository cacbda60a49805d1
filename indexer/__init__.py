"""The sparse-attention indexer's prefill path: logits kernels (dense and paged, bf16 / fp8 /
float32; a warp-specialized Gluon kernel on sm_90, portable Triton elsewhere), a Triton top-k,
the vLLM-compatible chunk planner and the prefill driver that takes every logits buffer from the
workspace arena. Torch references live in ``indexer.reference``.
"""

from .logits import (HopperConfig, LogitsConfig, kv_offsets, mqa_logits, paged_mqa_logits,
                     row_stride_elems, supported_dtypes)
from .planner import split_prefill_chunks, split_rows
from .prefill import DenseKV, PagedKV, PrefillPiece, PrefillStats, prefill_topk, token_ranges
from .topk import TopkConfig, top_k_per_row

__all__ = [
    "HopperConfig", "LogitsConfig", "kv_offsets", "mqa_logits", "paged_mqa_logits",
    "row_stride_elems", "supported_dtypes", "split_prefill_chunks", "split_rows", "DenseKV",
    "PagedKV", "PrefillPiece", "PrefillStats", "prefill_topk", "token_ranges", "TopkConfig",
    "top_k_per_row",
]
