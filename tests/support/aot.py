"""Compiling the GPU kernels ahead of time on the CPU for each target GPU (sm_90, sm_100, sm_120,
sm_121 and the generic family's sm_80 and sm_89), with the ptxas that ships in Triton's wheel,
and reading the result (registers, stack, shared memory, the SASS of the innermost loops). No GPU
is needed; what this cannot show is speed or numerical results. The tests that use it are marked
``compiled``; ``unavailable()`` says why they cannot run here, if they cannot.
"""

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton

from indexer import logits as logits_mod
from indexer._launch import LAUNCH_OPTIONS

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # pragma: no cover - a very old or very new Triton
    GPUTarget = ASTSource = None
    _IMPORT_ERROR = f"this Triton has no ASTSource/GPUTarget compile API ({e})"
else:
    _IMPORT_ERROR = ""

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
KiB = 1024


def unavailable() -> str:
    """Why the kernels cannot be compiled here; empty when they can."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if not (BIN / "ptxas").exists():
        return "Triton's NVIDIA backend (ptxas) is not installed"
    return ""


@dataclass(frozen=True)
class Gpu:
    """A compile target: its compute capability, what its SMs offer (shared memory a block may
    take and what all of an SM's blocks share, from the CUDA programming guide's table; each
    block also takes 1 KiB of the SM's for the system) and the MMA that Triton's TTGIR shows."""
    capability: tuple[int, int]
    shared_per_block: int
    shared_per_sm: int
    mma: str
    registers_per_sm: int = 65536

    @property
    def arch(self) -> int:
        return self.capability[0] * 10 + self.capability[1]

    def fits(self, shared: int, registers: int, threads: int, programs: int) -> bool:
        """Whether ``programs`` blocks of ``threads`` threads, each taking ``shared`` bytes and
        ``registers`` registers a thread (allocated 256 a warp at a time), are resident at once."""
        warp_registers = -(-registers * 32 // 256) * 256
        return (programs * (shared + KiB) <= self.shared_per_sm
                and programs * threads // 32 * warp_registers <= self.registers_per_sm)


MMA_V2 = "versionMajor = 2"  # mma.sync, Ampere's tensor-core instruction
GPUS = {
    "sm_90": Gpu((9, 0), 227 * KiB, 228 * KiB, "warp_group_dot"),
    "sm_100": Gpu((10, 0), 227 * KiB, 228 * KiB, "tc_gen5_mma"),
    "sm_120": Gpu((12, 0), 99 * KiB, 100 * KiB, MMA_V2),
    "sm_121": Gpu((12, 1), 99 * KiB, 100 * KiB, MMA_V2),  # GB10 (DGX Spark)
    # The generic family: Ampere's 163 KiB and Ada's 99; fp8 products need Ada (sm_89).
    "sm_80": Gpu((8, 0), 163 * KiB, 164 * KiB, MMA_V2),
    "sm_89": Gpu((8, 9), 99 * KiB, 100 * KiB, MMA_V2),
}
SM90 = GPUS["sm_90"]
TARGET = GPUTarget("cuda", 90, 32) if GPUTarget else None
TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}


def compile_kernel(fn, pointer_types, ints, constexprs, num_warps, num_stages=3, gpu=SM90,
                   **options):
    """Compile like a launch would: ints equal to 1 become constants and ints divisible by 16
    carry that divisibility (Triton's default specialization), pointers are 16-byte aligned,
    and the options every launch passes (indexer/_launch.py) go with ``options`` (e.g. maxnreg)."""
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
    differs = source_api_differs(ASTSource)
    if differs:  # this Triton describes kernels differently; not a kernel bug
        pytest.skip(f"ASTSource API differs in Triton {triton.__version__}: {differs}")
    src = ASTSource(fn, signature, consts, attrs)  # a TypeError from inside it is a failure
    return triton.compile(src, target=GPUTarget("cuda", gpu.arch, 32),
                          options=dict(LAUNCH_OPTIONS, num_warps=num_warps, num_stages=num_stages,
                                       **options))


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
        done = subprocess.run([str(tool), flag, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:  # Triton 3.6's cuobjdump (CUDA 12.8) cannot read sm_121's SASS
        pytest.skip(f"the cuobjdump of Triton {triton.__version__} cannot read this cubin "
                    f"({flag}): {done.stderr.strip()[-200:]}")
    return done.stdout


def triton_newer_than(major: int, minor: int) -> bool:
    return tuple(int(v) for v in triton.__version__.split(".")[:2]) > (major, minor)


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


SOURCE_PARAMETERS = ["fn", "signature", "constexprs", "attrs"]
"""How the Triton releases these tests know describe a kernel to triton.compile (ASTSource and
Gluon's GluonASTSource)."""


def source_api_differs(cls) -> str | None:
    """What differs when this Triton's ``cls`` does not take SOURCE_PARAMETERS, else None: the one
    reason to skip an ahead-of-time compile, checked before the call, so that a TypeError a
    compile raises for any other reason fails the test."""
    import inspect
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    if params[:len(SOURCE_PARAMETERS)] == SOURCE_PARAMETERS:
        return None
    return f"{cls.__name__} takes ({', '.join(params)}), not ({', '.join(SOURCE_PARAMETERS)})"
