"""indexer/_launch.py: every kernel launch of the package passes its options (FP fusion on),
whatever Triton's default; compiled with them, the logits' weighted relus are fused
multiply-adds even where the default turns fusion off (Triton 3.10's, TRITON_DEFAULT_FP_FUSION=0
on 3.9), and compiled without them they are not, so the check has teeth."""

import dataclasses
import importlib
import os
import pkgutil

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

import indexer
from indexer import logits_hopper as hopper
from indexer import mqa_logits, paged_mqa_logits, top_k_per_row
from indexer._launch import LAUNCH_OPTIONS
from indexer.topk import default_config
from indexer.weighted_q import split_weighted_q, w_tiles
from tests.support.aot import (LOGITS_POINTERS, compile_kernel, innermost_loops, logits_ints,
                               resources)
from tests.support.indexer_cpu import make_inputs, make_paged

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernels() -> set[str]:
    """Every kernel the package defines (a @triton.jit or @gluon.jit named *_kernel)."""
    found = set()
    for info in pkgutil.iter_modules(indexer.__path__):
        module = importlib.import_module(f"indexer.{info.name}")
        found |= {name for name, v in vars(module).items()
                  if isinstance(v, JITFunction) and name.endswith("_kernel")}
    return found


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_every_kernel_is_launched_with_the_options(monkeypatch):
    """Each launch path of the package on CPU tensors, the launches caught before they reach
    a GPU: every kernel the package defines is launched, each time with LAUNCH_OPTIONS."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self.__name__, kwargs))

    monkeypatch.setattr(JITFunction, "run", record)
    m, n = 37, 101
    q, kv, kv_scale, w, ks, ke = make_inputs(m, n, 8, 32, seed=3)
    context = torch.tensor([60, n - 60], dtype=torch.int32)
    cache, scale, table = make_paged(kv, kv_scale, context.tolist(), page=16, seed=4)
    mqa_logits(q, kv, kv_scale, w, ks, ke)
    paged_mqa_logits(q, cache, scale, w, ks, ke, table, context, n_cols=n)
    top_k_per_row(torch.randn(m, n), ks, ke, 8)
    top_k_per_row(torch.randn(m, n), ks, ke, 8,  # the streaming layout's two kernels
                  config=dataclasses.replace(default_config(8, "cpu"), stream=True))
    split_weighted_q(q, w, 2)
    w_tiles(w, 1.0, 64)
    if hopper.AVAILABLE:  # the sm_90 kernel's launch, as on an H200, of bf16 inputs
        monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
        q16, kv16, cache16 = q.bfloat16(), kv.bfloat16(), cache.bfloat16()
        out = torch.empty(m, 112)[:, :n]
        cu_kv = torch.tensor([0, 60, n], dtype=torch.int32)
        hopper.launch(q16, kv16, kv_scale, w, ks, ke, out, table, cu_kv, 1, 0, False, 1,
                      (kv16.stride(0), 0), (1, 0), 0, True, hopper.HopperConfig(3))
        hopper.launch(q16, cache16, scale, w, ks, ke, out, table, cu_kv, 2, 1, True, 16,
                      cache16.stride()[:2], scale.stride(), table.stride(0), True,
                      hopper.HopperConfig(6, 3, 3))
    launched = {name for name, _ in launches}
    expected = kernels() - (set() if hopper.AVAILABLE else {"_logits_ws_kernel"})
    assert launched == expected, f"not launched here: {expected - launched}"
    unpinned = [name for name, kwargs in launches
                if any(kwargs.get(k) != v for k, v in LAUNCH_OPTIONS.items())]
    assert not unpinned, f"launched without {LAUNCH_OPTIONS}: {unpinned}"


def weighted_relu_ops(fusion, monkeypatch) -> dict[str, int]:
    """The portable logits kernel's head loop on sm_90 (bf16, D = 128) compiled with Triton's
    default turned off: its FFMA, FMUL and FADD count."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    cfg = indexer.logits.FAMILY_DEFAULTS["sm_90"]
    kernel = compile_kernel(
        indexer.logits._logits_kernel, dict(LOGITS_POINTERS, p_q="bf16", p_kv="bf16"),
        logits_ints(64, 128, False),
        dict(H=64, D=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=False, PAGE=64, CLEAN=True, DOT_PRECISION="tf32"),
        cfg.num_warps, cfg.num_stages, **({} if fusion else {"enable_fp_fusion": False}))
    loops = [body for body in innermost_loops(kernel) if any("GMMA" in op for op in body)]
    assert loops, f"no product loop found ({resources(kernel)})"
    ops = " ".join(max(loops, key=len))
    return {op: ops.count(op + " ") + ops.count(op + ".") for op in ("FFMA", "FMUL", "FADD")}


@pytest.mark.compiled
def test_the_weighted_relus_stay_fused_when_tritons_default_is_off(monkeypatch):
    fused, unfused = weighted_relu_ops(True, monkeypatch), weighted_relu_ops(False, monkeypatch)
    print(f"Triton {triton.__version__}: head loop with the launch options {fused}, "
          f"with fusion off {unfused}")
    # 64 x 128 accumulator elements over 128 threads: 64 a thread and head
    assert fused["FFMA"] >= 64 and fused["FMUL"] < 64, fused
    assert unfused["FFMA"] < 64 <= unfused["FMUL"], unfused
