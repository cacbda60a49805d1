"""The indexer logits in Triton, dense and paged.

``logits[i, j] = kv_scale[j] * sum_h relu(q[i, h, :] . kv[j, :]) * w[i, h]`` for
``ks[i] <= j < ke[i]``, ``-inf`` elsewhere. q and kv are bf16, fp8 e4m3 (kv then carries its
per-row float32 scale in ``kv_scale``; q's scale is folded into ``w`` as vLLM does) or float32;
w and kv_scale are float32; the output is float32.

Two kernels: on sm_90, bf16, fp16 and fp8 calls go by default to the warp-specialized Gluon
kernel of ``logits_hopper`` (consumer warpgroups that ping-pong their products and relus, and
for fp8 the relus' linear half taken apart, see ``weighted_q``). The portable Triton kernel
below serves everything else (other GPUs, float32, inputs the Gluon kernel cannot take, the
CPU interpreter); it is slower, because its relus wait for each product. Their rates, and the
figures behind the defaults below: ``docs/indexer-kernels.md``.

Tiling of the portable kernel: one program owns a ``BLOCK_M x BLOCK_N`` output tile (queries x
kv entries). It loads its kv tile once into shared memory, then loops over the heads: per head one
``[BLOCK_N, D] x [D, BLOCK_M]`` tensor-core product (kv is the A operand, so it stays put in
shared memory; q tiles stream through a ``NUM_STAGES``-deep pipeline as the B operand), whose
relu is weighted by ``w[:, h]`` and accumulated in float32 registers. The relu sits between the
product and the head sum, so the heads cannot become the product's K dimension. The tile is
computed transposed and transposed back once at the store. Programs are ordered n-fastest, so
the programs running together share one q block in L2. Triton waits for each product before
the relu that follows it, so products and relus overlap only across co-resident programs:
the default tile (64 x 128, 4 warps) lets two run per SM.
A tile whose columns lie wholly outside every row's ``[ks, ke)`` skips the products (causal
rows cost about half of full rows) and, if ``clean``, writes ``-inf``.

The paged variant reads kv rows through a block table: column ``j`` of the output is position
``j - cu_kv[r]`` of request ``r`` (the request whose ``[cu_kv[r], cu_kv[r+1])`` holds j), found
by a binary search over ``cu_kv`` once per tile, then page ``block_table[r, pos // PAGE]``,
slot ``pos % PAGE``. Dense and paged share one kernel body; ``PAGED`` only changes where kv
rows are read from, so for the same kv the two produce bit-identical logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import logits_hopper as hopper
from ._device import FAMILIES, capability, family, family_of
from ._launch import LAUNCH_OPTIONS
from .logits_hopper import HopperConfig

__all__ = ["LogitsConfig", "HopperConfig", "mqa_logits", "paged_mqa_logits", "kv_offsets",
           "default_config", "candidate_configs", "set_config", "supported_dtypes",
           "row_stride_elems", "FAMILY_DEFAULTS", "FLOAT32_DEFAULTS", "SHARED_PER_BLOCK"]

INT32_MAX = tl.constexpr(2**31 - 1)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _request_of_column(p_cu_kv, o_n, num_reqs, n_steps):
    # Largest r with cu_kv[r] <= j: with empty requests (repeated starts) that is the one
    # request whose range holds j.
    b_lo = tl.zeros_like(o_n)
    b_hi = tl.zeros_like(o_n) + (num_reqs - 1)
    for _ in range(n_steps):
        b_mid = (b_lo + b_hi + 1) // 2
        b_start = tl.load(p_cu_kv + b_mid)
        b_go = b_start <= o_n
        b_lo = tl.where(b_go, b_mid, b_lo)
        b_hi = tl.where(b_go, b_hi, b_mid - 1)
    return b_lo


@triton.jit
def _kv_rows(p_kv, p_kv_scale, n_0, o_bn, m_n, p_block_table, p_cu_kv, num_reqs, n_steps,
             stride_kv_0, stride_kv_1, stride_sc_0, stride_sc_1, stride_bt,
             PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Pointers to the kv rows and scales of output columns n_0 + o_bn."""
    if PAGED:
        o_n = n_0 + o_bn
        b_req = _request_of_column(p_cu_kv, o_n, num_reqs, n_steps)
        b_pos = o_n - tl.load(p_cu_kv + b_req, mask=m_n, other=0)
        b_pos = tl.where(m_n, b_pos, 0)
        b_page = tl.load(p_block_table + b_req.to(tl.int64) * stride_bt + b_pos // PAGE,
                         mask=m_n, other=0).to(tl.int64)
        b_slot = (b_pos % PAGE).to(tl.int64)
        p_rows = p_kv + (b_page * stride_kv_0 + b_slot * stride_kv_1)
        p_scales = p_kv_scale + (b_page * stride_sc_0 + b_slot * stride_sc_1)
    else:
        # int64 tile base, int32 offsets within the tile: registers stay 32-bit per element.
        p_rows = p_kv + n_0.to(tl.int64) * stride_kv_0 + o_bn * stride_kv_0
        p_scales = p_kv_scale + n_0.to(tl.int64) * stride_sc_0 + o_bn * stride_sc_0
    return p_rows, p_scales


@triton.jit
def _logits_kernel(p_q, p_kv, p_kv_scale, p_w, p_ks, p_ke, p_out, p_block_table, p_cu_kv,
                   M, N, num_reqs, n_steps,
                   stride_qm, stride_qh, stride_kv_0, stride_kv_1, stride_sc_0, stride_sc_1,
                   stride_wm, stride_wh, stride_om, stride_bt,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PAGED: tl.constexpr,
                   PAGE: tl.constexpr, CLEAN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Offsets: int64 to each tile's origin, int32 within a tile (the launcher checks that a
    # tile spans less than 2**31 elements of every tensor).
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    m_0 = pid_m * BLOCK_M
    n_0 = pid_n * BLOCK_N
    o_bm = tl.arange(0, BLOCK_M)
    o_bn = tl.arange(0, BLOCK_N)
    m_m = m_0 + o_bm < M
    m_n = n_0 + o_bn < N
    b_ks = tl.load(p_ks + m_0 + o_bm, mask=m_m, other=0)
    b_ke = tl.load(p_ke + m_0 + o_bm, mask=m_m, other=0)
    m_row = m_m & (b_ke > b_ks)
    n_lo = tl.min(tl.where(m_row, b_ks, INT32_MAX))
    n_hi = tl.max(tl.where(m_row, b_ke, 0))
    p_out_tile = p_out + m_0.to(tl.int64) * stride_om + n_0
    if (n_0 < n_hi) & (n_0 + BLOCK_N > n_lo):
        p_rows, p_scales = _kv_rows(p_kv, p_kv_scale, n_0, o_bn, m_n, p_block_table, p_cu_kv,
                                    num_reqs, n_steps, stride_kv_0, stride_kv_1, stride_sc_0,
                                    stride_sc_1, stride_bt, PAGED, PAGE)
        o_d = tl.arange(0, D)
        # kv is the product's A operand: loop-invariant, it goes to shared memory once. (As the
        # B operand, Triton re-stores it to shared memory every head and keeps it in registers.)
        b_kv = tl.load(p_rows[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_scale = tl.load(p_scales, mask=m_n, other=0.0)
        p_q_tile = p_q + m_0.to(tl.int64) * stride_qm + (o_bm[:, None] * stride_qm + o_d[None, :])
        p_w_tile = p_w + m_0.to(tl.int64) * stride_wm + o_bm * stride_wm
        # Transposed tile: rows are kv entries, columns are queries.
        b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for h in tl.range(0, H, num_stages=NUM_STAGES):
            b_q = tl.load(p_q_tile + h * stride_qh, mask=m_m[:, None], other=0.0)
            b_w = tl.load(p_w_tile + h * stride_wh, mask=m_m, other=0.0)
            b_s = tl.dot(b_kv, tl.trans(b_q), input_precision=DOT_PRECISION)
            b_acc += tl.maximum(b_s, 0.0) * b_w[None, :]
        b_acc = b_acc * b_scale[:, None]
        o_n = n_0 + o_bn
        m_in = (o_n[:, None] >= b_ks[None, :]) & (o_n[:, None] < b_ke[None, :])
        b_out = tl.trans(tl.where(m_in, b_acc, float("-inf")))
        tl.store(p_out_tile + (o_bm[:, None] * stride_om + o_bn[None, :]), b_out,
                 mask=m_m[:, None] & m_n[None, :])
    else:
        if CLEAN:
            b_inf = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
            tl.store(p_out_tile + (o_bm[:, None] * stride_om + o_bn[None, :]), b_inf,
                     mask=m_m[:, None] & m_n[None, :])


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogitsConfig:
    """Tile shape and pipeline depth of the logits kernel."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


_FP8 = getattr(torch, "float8_e4m3fn", None)
_INTERPRETER_CONFIG = LogitsConfig(16, 32, 4, 1)
# The portable kernel's tile for bf16, fp16 and fp8 by GPU family (indexer/_device.py), taken
# by the device's compute capability. Each must fit two programs an SM without spills, which is
# what overlaps one program's relus with the other's products; the compiled tests of
# tests/indexer/test_logits.py check that for every family's targets on Triton's ptxas.
#   sm_90:   64 x 128 on 4 warps (wider tiles, 128 x 128 on 8 warps, spill); the H200 figures.
#   sm_100:  64 x 128 spills there (255 registers and 136-280 bytes of stack on Triton 3.9,
#            640-800 on 3.6), and so do 64 x 64 and 64 x 128 on 8 warps on 3.6; 32 x 128 keeps
#            the product's 128 kv rows and fits (at most 255 registers, 56 KiB).
#   sm_120:  64 x 128 fits one program an SM (254 registers, 64.5 KiB of the SM's 100);
#            32 x 128 fits two (at most 168 registers, 48.2 KiB).
#   generic: the sm_120 tile, which fits the 99 KiB of Ampere and Ada too.
# Not timed on those GPUs (none was at hand): the benchmark's sweep
# (benchmarks/indexer/bench_indexer.py) times the candidates and set_config() can pin a winner.
FAMILY_DEFAULTS = {"sm_90": LogitsConfig(64, 128, 4, 3), "sm_100": LogitsConfig(32, 128, 4, 3),
                   "sm_120": LogitsConfig(32, 128, 4, 3), "generic": LogitsConfig(32, 128, 4, 3)}
# float32 (products on the FMA units at ieee precision): 32 x 64 takes 255 registers a thread
# and spills at D = 128 on every target (288-936 bytes of stack), and at D = 64 on Triton 3.6;
# 32 x 32 does not. sm_90 keeps 32 x 64, the tile its recorded behaviour was taken with.
FLOAT32_DEFAULTS = {"sm_90": LogitsConfig(32, 64, 4, 2), "sm_100": LogitsConfig(32, 32, 4, 2),
                    "sm_120": LogitsConfig(32, 32, 4, 2), "generic": LogitsConfig(32, 32, 4, 2)}
# Shared memory a program may take (bytes), by family; and what the sweep allows a candidate's
# estimate (every q stage counted in full): 200 KiB of sm_90's 227, as its recorded sweeps did.
SHARED_PER_BLOCK = {"sm_90": 227 << 10, "sm_100": 227 << 10, "sm_120": 99 << 10,
                    "generic": 99 << 10}
_SWEEP_SHARED = {"sm_90": 200 << 10, "sm_100": 200 << 10, "sm_120": 99 << 10,
                 "generic": 99 << 10}
assert set(FAMILY_DEFAULTS) == set(FLOAT32_DEFAULTS) == set(SHARED_PER_BLOCK) == set(FAMILIES)
_CANDIDATES = (LogitsConfig(64, 128, 4, 3), LogitsConfig(64, 128, 4, 4),
               LogitsConfig(64, 64, 4, 3), LogitsConfig(32, 128, 4, 3),
               LogitsConfig(32, 256, 4, 3), LogitsConfig(64, 256, 8, 3),
               LogitsConfig(128, 128, 8, 3))
_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + ((_FP8,) if _FP8 is not None else ())
_CHOSEN: dict[tuple, LogitsConfig] = {}


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return _DTYPES


def row_stride_elems(width: int) -> int:
    """The row stride (float32 elements) a logits buffer of ``width`` columns gets: a multiple
    of 16 elements (64 bytes). 16 bytes is what TMA needs and what ``out`` must have; 16
    elements also lets Triton's specialization mark the stride divisible by 16, which keeps
    the stores vectorized."""
    return max(16, -(-width // 16) * 16)


def _key(dtype: torch.dtype, h: int, d: int, paged: bool) -> tuple:
    return (dtype, h, d, paged)


def _family(device: str, cap: tuple[int, int] | None) -> str:
    if cap is not None:
        return family_of(cap)
    if device == "cuda" and torch.cuda.is_available():
        return family()
    return "generic"


def default_config(dtype: torch.dtype, h: int, d: int, paged: bool = False,
                   device: str = "cuda",
                   capability: tuple[int, int] | None = None) -> LogitsConfig | HopperConfig:
    """The config a call uses when none is given: one chosen by ``set_config`` (the benchmark's
    sweep can set it), else the warp-specialized kernel on sm_90 where it applies (it falls
    back to the portable kernel's default for inputs it cannot take), else the portable
    kernel's default for the device's family (``FAMILY_DEFAULTS``). ``capability`` (major,
    minor) answers for a device of that capability (default: the current CUDA device's;
    without one, the generic family's)."""
    if device == "cpu":
        return _INTERPRETER_CONFIG
    chosen = _CHOSEN.get(_key(dtype, h, d, paged))
    if chosen is not None:
        return chosen
    fam = _family(device, capability)
    if fam == "sm_90" and hopper.AVAILABLE:
        # bf16 is fastest with two consumer warpgroups and 3 q stages; fp8's products take
        # half as long, and a third consumer with a deeper q ring keeps the tensor cores fed
        # through the relus. From 32 heads up, fp8 is faster still with the linear half of
        # the relus as three more products a tile (one instruction a head and element less);
        # at 16 heads those products cost more than they save (docs/indexer-kernels.md).
        linear = 3 if dtype == _FP8 and h >= 32 else 0
        for cfg in ((HopperConfig(3),) if dtype != _FP8 else
                    (HopperConfig(6, 3, linear), HopperConfig(4, 2, linear))):
            if hopper.supports(dtype, h, d, cfg):
                return cfg
    return _portable_default(dtype, d, fam)


def _portable_default(dtype: torch.dtype, d: int, fam: str) -> LogitsConfig:
    if dtype == torch.float32:
        return FLOAT32_DEFAULTS[fam]
    tile = FAMILY_DEFAULTS[fam]
    if d <= 64 and fam == "sm_90":
        # Half-size q tiles: room for a deeper pipeline (measured on the H200 only).
        return LogitsConfig(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages + 1)
    return tile


def set_config(dtype: torch.dtype, h: int, d: int, paged: bool,
               config: LogitsConfig | HopperConfig | None) -> None:
    """Make ``config`` the default for this (dtype, H, D, paged); None restores the built-in."""
    if config is None:
        _CHOSEN.pop(_key(dtype, h, d, paged), None)
    else:
        _CHOSEN[_key(dtype, h, d, paged)] = config


def candidate_configs(dtype: torch.dtype, h: int, d: int,
                      capability: tuple[int, int] | None = None) -> list[LogitsConfig | HopperConfig]:
    """Configs worth timing at H heads of size D on the current GPU (or one of ``capability``):
    the warp-specialized kernel's q pipeline depths (on sm_90) and the portable kernel's tiles,
    those that fit the family's shared memory."""
    fam = _family("cuda", capability)
    elem = 1 if dtype == _FP8 else (4 if dtype == torch.float32 else 2)
    shapes = [(3, 2), (4, 2), (4, 3), (6, 3), (8, 3)]
    ws = ([c for c in [HopperConfig(*sc) for sc in shapes] +
           [HopperConfig(*sc, linear_terms=3) for sc in shapes[2:]]
           if hopper.supports(dtype, h, d, c)] if fam == "sm_90" and hopper.AVAILABLE else [])
    # Elsewhere than on sm_90 (whose list the recorded sweeps used) the family's default first.
    first = [] if fam == "sm_90" else [_portable_default(dtype, d, fam)]
    tiles = first + [c for c in _CANDIDATES if c not in first]
    return ws + [c for c in tiles
                 if (c.block_n * d + c.num_stages * c.block_m * d) * elem <= _SWEEP_SHARED[fam]]


def _check_out(out: torch.Tensor, m: int, n: int) -> None:
    if out.dtype != torch.float32 or out.dim() != 2 or tuple(out.shape) != (m, n):
        raise ValueError(f"out must be float32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    if n > 0 and m > 0 and out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    if m > 1 and (out.stride(0) * 4) % 16 != 0:
        raise ValueError(f"out's row stride ({out.stride(0)} floats) must be a multiple of 16 "
                         "bytes; take it from a buffer of row_stride_elems(width) columns")


def _check_inputs(q, kv_dtype, kv_d, kv_scale, w, ks, ke) -> tuple[int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [M, H, D], got {tuple(q.shape)}")
    m, h, d = q.shape
    if q.dtype != kv_dtype:
        raise ValueError(f"q and kv must share a dtype, got {q.dtype} and {kv_dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; supported: {supported_dtypes()}")
    if kv_d != d:
        raise ValueError(f"kv head size {kv_d} != q head size {d}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"D must be a power of two >= 16, got {d}")
    if q.stride(2) != 1:
        raise ValueError("q's last dimension must be contiguous")
    if w.shape != (m, h) or w.dtype != torch.float32:
        raise ValueError(f"w must be float32 [{m}, {h}], got {w.dtype} {tuple(w.shape)}")
    if kv_scale.dtype != torch.float32:
        raise ValueError(f"kv_scale must be float32, got {kv_scale.dtype}")
    for name, t in (("ks", ks), ("ke", ke)):
        if t.shape != (m,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [{m}], got {t.dtype} {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return m, h, d


def _launch(q, kv, kv_scale, w, ks, ke, out, block_table, cu_kv, num_reqs, paged, page,
            strides_kv, strides_sc, stride_bt, clean, config):
    m, h, d = q.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(q.dtype, h, d, paged, q.device.type,
                                   capability(q.device) if q.is_cuda else None)
    n_steps = max(0, math.ceil(math.log2(num_reqs))) if paged and num_reqs > 1 else 0
    if isinstance(cfg, HopperConfig):
        if hopper.usable(q, kv, strides_kv, out, cfg):
            return hopper.launch(q, kv, kv_scale, w, ks, ke, out, block_table, cu_kv, num_reqs,
                                 n_steps, paged, page, strides_kv, strides_sc, stride_bt, clean,
                                 cfg)
        if config is not None:
            raise ValueError(
                f"{cfg} needs an sm_90 GPU, bf16/fp16/fp8 inputs with D a power of two in "
                "32..128 (256 for fp8), q viewable as [M, H * D] (unit stride over H and D) "
                "and 16-byte aligned q rows, kv rows and out; use a LogitsConfig for these "
                "inputs")
        cfg = _portable_default(q.dtype, d, family(q.device) if q.is_cuda else "generic")
    spans = [cfg.block_m * max(q.stride(0), 1), cfg.block_m * max(w.stride(0), 1),
             cfg.block_m * max(out.stride(0), 1)]
    if not paged:
        spans.append(cfg.block_n * max(strides_kv[0], strides_sc[0], 1))
    if max(spans) >= 2**31:
        raise ValueError("a tile would span 2**31 elements or more; use smaller blocks")
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _logits_kernel[grid](
        q, kv, kv_scale, w, ks, ke, out, block_table, cu_kv,
        m, n, num_reqs, n_steps,
        q.stride(0), q.stride(1), strides_kv[0], strides_kv[1], strides_sc[0], strides_sc[1],
        w.stride(0), w.stride(1), out.stride(0), stride_bt,
        H=h, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        PAGED=paged, PAGE=page, CLEAN=clean,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **LAUNCH_OPTIONS,
    )
    return out


# --------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------

def mqa_logits(q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor, w: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, out: torch.Tensor | None = None, *,
               clean: bool = True, config: LogitsConfig | None = None) -> torch.Tensor:
    """Indexer logits over a dense kv.

    Shapes: q ``[M, H, D]`` and kv ``[N, D]`` in one of bf16, fp8 e4m3 or float32 (last dim
    contiguous, D a power of two >= 16); kv_scale ``[N]`` float32; w ``[M, H]`` float32; ks, ke
    ``[M]`` int32 with ``0 <= ks <= ke <= N``. ``out`` is float32 ``[M, N]`` with unit column
    stride and a row stride that is a multiple of 16 bytes (a view of an arena buffer of
    ``row_stride_elems(N)`` columns qualifies); without it one is allocated.

    Entries outside ``[ks[i], ke[i])`` are ``-inf`` when ``clean`` (the default); with
    ``clean=False`` tiles that lie wholly outside every row's range are not written at all,
    which is what a top-k that reads only ``[ks, ke)`` needs. Returns ``out``.
    """
    if kv.dim() != 2 or kv.stride(1) != 1:
        raise ValueError(f"kv must be [N, D] with contiguous rows, got {tuple(kv.shape)}")
    m, h, d = _check_inputs(q, kv.dtype, kv.shape[1], kv_scale, w, ks, ke)
    n = kv.shape[0]
    if kv_scale.shape != (n,):
        raise ValueError(f"kv_scale must be [{n}], got {tuple(kv_scale.shape)}")
    if out is None:
        out = torch.empty((m, row_stride_elems(n)), dtype=torch.float32, device=q.device)[:, :n]
    _check_out(out, m, n)
    return _launch(q, kv, kv_scale, w, ks, ke, out, ks, ks, 1, False, 1,
                   (kv.stride(0), 0), (kv_scale.stride(0), 0), 0, clean, config)


def kv_offsets(context_lens: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """int32 ``[R + 1]``: where each request's compressed kv starts among the output columns,
    ``cu[r + 1] - cu[r] = context_lens[r] // compress_ratio``."""
    lens = torch.div(context_lens.to(torch.int64), compress_ratio, rounding_mode="floor")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=context_lens.device)
    torch.cumsum(lens, 0, out=cu[1:])
    return cu.to(torch.int32)


def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor,
                     w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor | None = None, compress_ratio: int = 1,
                     out: torch.Tensor | None = None, *, n_cols: int | None = None,
                     cu_kv: torch.Tensor | None = None, clean: bool = True,
                     config: LogitsConfig | None = None) -> torch.Tensor:
    """Indexer logits reading kv from a paged cache.

    Shapes: kv_cache ``[num_blocks, PAGE, D]`` (rows contiguous; other strides free, so a view
    into a packed page works) and kv_scale_cache ``[num_blocks, PAGE]`` float32;
    block_table ``[R, max_blocks]`` int32; context_lens ``[R]`` int32, each request's
    uncompressed length, so request r holds ``context_lens[r] // compress_ratio`` kv entries.
    The output columns are those entries, requests concatenated in order, exactly as the dense
    ``mqa_logits`` sees a kv gathered from the cache: request r's entry p is column
    ``cu_kv[r] + p``, with ``cu_kv = kv_offsets(context_lens, compress_ratio)`` (pass
    ``cu_kv`` directly to skip that computation). q, w, ks, ke and ``out`` are as in ``mqa_logits``;
    ``n_cols`` (the total kv length) is needed only when ``out`` is not given.
    """
    if kv_cache.dim() != 3 or kv_cache.stride(2) != 1:
        raise ValueError(f"kv_cache must be [num_blocks, PAGE, D] with contiguous rows, "
                         f"got {tuple(kv_cache.shape)}")
    m, h, d = _check_inputs(q, kv_cache.dtype, kv_cache.shape[2], kv_scale_cache, w, ks, ke)
    page = kv_cache.shape[1]
    if kv_scale_cache.shape != kv_cache.shape[:2]:
        raise ValueError(f"kv_scale_cache must be {tuple(kv_cache.shape[:2])}, "
                         f"got {tuple(kv_scale_cache.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError("block_table must be int32 [R, max_blocks] with contiguous rows")
    if compress_ratio < 1:
        raise ValueError(f"compress_ratio must be >= 1, got {compress_ratio}")
    if cu_kv is None:
        if context_lens is None:
            raise ValueError("give context_lens (with compress_ratio) or cu_kv")
        cu_kv = kv_offsets(context_lens, compress_ratio)
    num_reqs = cu_kv.numel() - 1
    if num_reqs != block_table.shape[0] or cu_kv.dtype != torch.int32:
        raise ValueError(f"cu_kv must be int32 [{block_table.shape[0] + 1}], got "
                         f"{cu_kv.dtype} [{cu_kv.numel()}]")
    if out is None:
        if n_cols is None:
            raise ValueError("without out, give n_cols (the total kv length)")
        out = torch.empty((m, row_stride_elems(n_cols)), dtype=torch.float32,
                          device=q.device)[:, :n_cols]
    _check_out(out, m, out.shape[1])
    return _launch(q, kv_cache, kv_scale_cache, w, ks, ke, out, block_table, cu_kv, num_reqs,
                   True, page, (kv_cache.stride(0), kv_cache.stride(1)),
                   (kv_scale_cache.stride(0), kv_scale_cache.stride(1)), block_table.stride(0),
                   clean, config)
