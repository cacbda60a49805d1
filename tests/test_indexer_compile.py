"""The GPU kernels compiled ahead of time for Hopper (sm_90) on the CPU, with the ptxas that
ships in Triton's wheel: every dtype / head size / dense-paged variant the launchers can pick
by default must compile, use wgmma, and fit in registers without spilling (a spill is the
usual way a small kernel change quietly halves the speed). No GPU is needed; what this cannot
show is speed or numerical results (see test_indexer_gpu.py and the benchmark)."""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted in this process; nothing to compile",
                allow_module_level=True)

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - very old or very new Triton
    pytest.skip("this Triton has no ASTSource/GPUTarget compile API", allow_module_level=True)

from indexer import logits as logits_mod  # noqa: E402
from indexer import topk as topk_mod  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (BIN / "ptxas").exists():
    pytest.skip("Triton's NVIDIA backend (ptxas) is not installed", allow_module_level=True)

TARGET = GPUTarget("cuda", 90, 32)
TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}


def compile_kernel(fn, pointer_types, ints, constexprs, num_warps, num_stages=3, **options):
    """Compile like a launch would: ints equal to 1 become constants and ints divisible by 16
    carry that divisibility (Triton's default specialization), pointers are 16-byte aligned.
    ``options`` go to the compiler as a launch's would (e.g. maxnreg)."""
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = "*" + pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints[name] == 1:
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn, signature, consts, attrs)
    except TypeError as e:  # this Triton describes kernels differently; not a kernel bug
        pytest.skip(f"ASTSource API differs in Triton {triton.__version__}: {e}")
    return triton.compile(src, target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


LOGITS_POINTERS = dict(p_kv_scale="fp32", p_w="fp32", p_ks="i32", p_ke="i32", p_out="fp32",
                       p_block_table="i32", p_cu_kv="i32")


def logits_ints(h, d, paged, m=4096, n=65536, page=64):
    """Argument values of the benchmark's launch (dense) or of a paged one over a cache of
    ``page``-entry pages and three requests."""
    ints = dict(M=m, N=n, num_reqs=1, n_steps=0, stride_qm=h * d, stride_qh=d,
                stride_kv_0=d, stride_kv_1=0, stride_sc_0=1, stride_sc_1=0, stride_wm=h,
                stride_wh=1, stride_om=logits_mod.row_stride_elems(n), stride_bt=0)
    if paged:
        ints.update(num_reqs=3, n_steps=2, stride_kv_0=page * d, stride_kv_1=d,
                    stride_sc_0=page, stride_sc_1=1, stride_bt=1024)
    return ints


def _cuobjdump(kernel, flag: str) -> str:
    tool = BIN / "cuobjdump"
    if not tool.exists() or shutil.which(str(tool)) is None:
        pytest.skip("cuobjdump not shipped with this Triton")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def resources(kernel) -> dict:
    text = _cuobjdump(kernel, "--dump-resource-usage")
    return {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", text)}


def innermost_loops(kernel) -> list[list[str]]:
    """The SASS of each innermost loop (a backward branch whose body holds no other)."""
    ins = [(int(a, 16), op.strip()) for a, op in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(kernel, "-sass"))]
    at = {a: i for i, (a, _) in enumerate(ins)}
    backward = [(at[int(m.group(1), 16)], i) for i, (a, op) in enumerate(ins)
                for m in [re.search(r"BRA (?:!?U?P\d, )?0x([0-9a-f]+)", op)]
                if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at]
    return [[op for _, op in ins[lo:hi + 1]] for lo, hi in backward
            if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in backward)]


def product_loops(kernel) -> list[list[str]]:
    """The innermost loops that run a wgmma and the weighted relus after it."""
    return [body for body in innermost_loops(kernel)
            if any("GMMA" in op for op in body) and any("FFMA" in op for op in body)]


def spill_ops(body: list[str]) -> int:
    return sum(bool(re.search(r"\b(LDL|STL)\b", op)) for op in body)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_logits_kernel_compiles_for_sm90_without_spills(dtype, d, paged):
    cfg = logits_mod.default_config(dtype, 64, d, paged)
    t = TRITON_DTYPE[dtype]
    kernel = compile_kernel(
        logits_mod._logits_kernel, dict(LOGITS_POINTERS, p_q=t, p_kv=t),
        logits_ints(64, d, paged),
        dict(H=64, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=paged, PAGE=64, CLEAN=True, DOT_PRECISION="tf32"),
        cfg.num_warps, cfg.num_stages)
    assert "warp_group_dot" in kernel.asm["ttgir"], "expected Hopper wgmma"
    use = resources(kernel)
    assert use["STACK"] == 0, f"{cfg}: spills ({use})"


def test_float32_logits_kernel_compiles():
    cfg = logits_mod.default_config(torch.float32, 8, 64)
    kernel = compile_kernel(
        logits_mod._logits_kernel, dict(LOGITS_POINTERS, p_q="fp32", p_kv="fp32"),
        logits_ints(8, 64, False, m=37, n=101),
        dict(H=8, D=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
             PAGED=False, PAGE=1, CLEAN=False, DOT_PRECISION="ieee"),
        cfg.num_warps, cfg.num_stages)
    assert resources(kernel)["STACK"] == 0


def test_hopper_weights_row_layout_reads_rows_where_w_tiles_put_them():
    """The consumers read a head's weights through ``w_layouts()[1]``: memory offset o holds
    the row that the layout's offset bases sum to, which must be the row ``w_tiles`` put at o
    (row i goes to i // 16 * 16 + i % 8 * 2 + i % 16 // 8)."""
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    bases = [b[0] for b in hopper.w_layouts()[1].offset_bases]
    assert 1 << len(bases) == hopper.BLOCK_M
    for i in range(hopper.BLOCK_M):
        o = i // 16 * 16 + i % 8 * 2 + i % 16 // 8
        row = 0
        for bit, base in enumerate(bases):
            if o >> bit & 1:
                row ^= base
        assert row == i, (i, o, row)


def compile_hopper_kernel(dtype, d, h, paged, cfg):
    """The warp-specialized sm_90 logits kernel (Gluon) as its launcher would compile it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from indexer import logits_hopper as hopper
    q_smem, kv_smem, kv_load, chunk = hopper.layouts(dtype, d)
    t = TRITON_DTYPE[dtype]
    fn = hopper._logits_ws_kernel
    maxnreg, consumer_regs, producer_regs = cfg.registers()
    consts = dict(H=h, D=d, STAGES=cfg.stages, NC=cfg.consumers, PAGED=paged, PAGE=64,
                  CLEAN=True, KV_SMEM=kv_smem, KV_LOAD=kv_load, CHUNK=chunk,
                  CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                  TERMS=cfg.linear_terms, W_ROW=hopper.w_layouts()[1])
    pointers = dict(LOGITS_POINTERS, p_kv=t, p_row_scale="fp32")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("q_desc", "qw_desc") or (name == "kv_desc" and paged):
            signature[name] = f"tensordesc<{t}[{hopper.BLOCK_M}, {d}],{q_smem!r}>"
        elif name == "kv_desc":
            signature[name] = f"tensordesc<{t}[{hopper.PART_N}, {d}],{kv_smem!r}>"
        elif name == "w_desc":
            signature[name] = f"tensordesc<fp32[{h}, {hopper.BLOCK_M}],{hopper.w_layouts()[0]!r}>"
        elif name == "out_desc":
            signature[name] = (f"tensordesc<fp32[{hopper.FILL_ROWS}, {hopper.PART_N}],"
                               f"{hopper.w_layouts()[0]!r}>")
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    try:
        src = GluonASTSource(fn, signature, consts, attrs)
    except TypeError as e:  # this Triton describes kernels differently; not a kernel bug
        pytest.skip(f"GluonASTSource API differs in Triton {triton.__version__}: {e}")
    return triton.compile(src, target=TARGET, options=dict(num_warps=4, maxnreg=maxnreg))


# The configs the defaults and the sweep choose from: their product loops must hold no spill
# loads or stores (elsewhere a few do no harm), but for the one case below. With the linear
# half taken apart, a head costs one FFMA an element and no FMNMX.
@pytest.mark.parametrize("dtype,stages,consumers,linear", [
    (torch.bfloat16, 3, 2, 0), (torch.float8_e4m3fn, 4, 2, 0), (torch.float8_e4m3fn, 6, 3, 0),
    (torch.float8_e4m3fn, 6, 3, 3), (torch.float8_e4m3fn, 4, 2, 3)])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_hopper_logits_kernel_compiles_with_partitions_and_wgmma(dtype, stages, consumers, linear,
                                                                 d, paged):
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    cfg = hopper.HopperConfig(stages, consumers, linear)
    if not hopper.supports(dtype, 64, d, cfg):
        pytest.skip(f"{cfg} does not fit shared memory at {dtype}, D={d}, 64 heads")
    kernel = compile_hopper_kernel(dtype, d, 64, paged, cfg)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, "expected wgmma in partitions"
    assert kernel.metadata.shared <= 227 * 1024
    loops = product_loops(kernel)
    # One product loop per consumer (ptxas may keep a second copy of a loop).
    assert len(loops) >= consumers, f"found {len(loops)} product loops"
    spills = sorted(spill_ops(body) for body in loops)
    # No loop spills on Triton 3.6 (the version benchmarked). Triton 3.9's ptxas keeps one of
    # a thread's row offsets in local memory in the workers' loops of fp8 with a relu per
    # head at three consumers (a store and two loads a head of ~170 instructions).
    tight = dtype == torch.float8_e4m3fn and consumers == 3 and not linear
    newer = tuple(int(v) for v in triton.__version__.split(".")[:2]) > (3, 6)
    limit = 3 if tight and newer else 0
    assert spills[-1] <= limit, (
        f"spill loads/stores per product loop {spills} ({resources(kernel)})")
    for body in loops:
        ops = " ".join(body)
        # 64 x 128 accumulator elements over 128 threads: 64 a thread and head
        assert ops.count("FFMA") == 64
        assert ops.count("FMNMX") == (0 if linear else 64)


# The deepest q ring that ``supports`` allows, with paged kv (its rows' offsets take shared
# memory too): ``supports`` must count at least what the compiled kernel takes, or a launch
# would fail on the device.
@pytest.mark.parametrize("dtype,h,d,consumers", [
    (torch.float8_e4m3fn, 64, 128, 3), (torch.bfloat16, 16, 128, 2),
    (torch.float8_e4m3fn, 256, 64, 3)])
def test_hopper_supports_counts_the_kernels_shared_memory(dtype, h, d, consumers):
    from indexer import logits_hopper as hopper
    if not hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    stages = max(st for st in range(2, 32)
                 if hopper.supports(dtype, h, d, hopper.HopperConfig(st, consumers)))
    kernel = compile_hopper_kernel(dtype, d, h, True, hopper.HopperConfig(stages, consumers))
    assert kernel.metadata.shared <= 227 * 1024, f"{stages} stages"


def assert_row_passes_do_not_spill(kernel, cfg):
    """Pass 1's loops (bits or keys, and with ``sampled`` collecting or not: two or four) hold
    no spill loads or stores.
    Triton 3.6 keeps a value of pass 2's (which the sampled pass 1 leaves to ~0.1% of rows)
    in local memory, a store and a load a block, and a few more around the passes and in
    the selection, once a row or a chunk."""
    streaming = [body for body in innermost_loops(kernel) if any("LDGSTS" in op for op in body)]
    spills = sorted(spill_ops(body) for body in streaming)
    assert spills.count(0) >= (4 if cfg.sampled else 2) and spills[-1] <= 2, (
        f"{cfg}: spill loads/stores per row-pass loop {spills}")


def compile_topk(k, cfg):
    """The top-k kernel as top_k_per_row launches it over [4096, 65536] logits: its constexprs
    and the register cap that lets ``programs_per_sm`` programs share an SM."""
    fn = topk_mod._topk_kernel
    pointers = dict(p_x="fp32", p_ks="i32", p_ke="i32", p_out="i32", p_scratch="i64",
                    p_path="i8")
    constexprs = dict(topk_mod._launch_constants(cfg, k), WITH_PATH=False)
    options = {name: constexprs.pop(name) for name in ("num_warps", "maxnreg")}
    ints = dict(M=4096, N=65536, stride_xm=65536, stride_om=k)
    return compile_kernel(fn, pointers, ints, constexprs, **options)


@pytest.mark.parametrize("k", [2048, 512])
def test_topk_kernel_compiles_for_sm90_without_spills(k):
    cfg = topk_mod.default_config(k)
    kernel = compile_topk(k, cfg)
    use = resources(kernel)
    print(f"top-k k={k} Triton {triton.__version__}: {use['REG']} registers a thread "
          f"(cap {topk_mod.max_registers(cfg)}), {kernel.metadata.shared} B shared, {cfg}")
    assert_row_passes_do_not_spill(kernel, cfg)
    # every program of the persistent grid must be resident at once
    assert use["REG"] * 32 * cfg.num_warps * cfg.programs_per_sm <= 65536, use
    assert kernel.metadata.shared * cfg.programs_per_sm <= 228 * 1024
    assert "cp.async" in kernel.asm["ptx"], "expected the row passes' loads pipelined"


@pytest.mark.parametrize("index", range(len(topk_mod.sweep_configs(2048))))
def test_topk_sweep_candidates_compile_without_spills(index):
    cfg = topk_mod.sweep_configs(2048)[index]
    kernel = compile_topk(2048, cfg)
    use = resources(kernel)
    print(f"top-k sweep {index} Triton {triton.__version__}: {use['REG']} registers a thread "
          f"(cap {topk_mod.max_registers(cfg)}), {cfg}")
    assert_row_passes_do_not_spill(kernel, cfg)
