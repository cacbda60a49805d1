#!/usr/bin/env python
"""Sustained throughput of the indexer logits against the matrix-product ceilings, with the SM
clock and board power sampled while each runs.

    python benchmarks/indexer/bench_clocks.py [--seconds 4] [--json FILE]
    python benchmarks/indexer/bench_clocks.py --launch fp8 --launches 3     # for a profiler (ncu)

``bench_indexer.py`` times short bursts (``do_bench``); a GPU held at its power limit lowers its
clock within a second or two, and by a different amount for each kernel. This program runs each
case back to back for ``--seconds`` while ``nvidia-smi`` samples the SM clock, the power draw and
the active clock-limit reasons every 100 ms, and prints per case: TFLOP/s, median clock and
power, and TFLOP/s per GHz (the work done per cycle, which the clock does not scale). Cases, at
the indexer benchmark's shape (M = 4096, N = 65536, H = 64, D = 128, full rows) and 8192^3 for the
products: fp8 ``torch._scaled_mm`` and the fp8 logits, bf16 ``torch.matmul`` and the bf16 logits,
each logits kernel in its default config.

``--launch DTYPE`` instead runs the logits kernel ``--launches`` times and exits, for a profiler:

    ncu --clock-control none --kernel-name regex:_logits_ws --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters python benchmarks/indexer/bench_clocks.py \\
        --launch fp8 --launches 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import indexer  # noqa: E402
from indexer import logits as logits_mod  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = {"fp8": FP8, "bf16": torch.bfloat16}
M, N, H, D, MM = 4096, 65536, 64, 128, 8192
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def logits_inputs(dtype, h: int = H, seed: int = 0):
    """(q, kv, kv_scale, w, ks, ke) at the benchmark shape with ``h`` heads, full rows, on fresh
    random data (kv rows scaled into e4m3's range for fp8, as a quantizer would)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q32 = torch.randn(M, h, D, generator=g, device="cuda")
    kv32 = torch.randn(N, D, generator=g, device="cuda")
    w = torch.randn(M, h, generator=g, device="cuda") / h ** 0.5
    scale = torch.rand(N, generator=g, device="cuda") + 0.5
    if dtype == FP8:
        row = kv32.abs().amax(1).clamp(min=1e-6) / 448.0
        q, kv, scale = q32.to(FP8), (kv32 / row[:, None]).to(FP8), scale * row
    else:
        q, kv = q32.to(dtype), kv32.to(dtype)
    ks = torch.zeros(M, dtype=torch.int32, device="cuda")
    ke = torch.full((M,), N, dtype=torch.int32, device="cuda")
    return q, kv, scale.float(), w, ks, ke


def logits_case(dtype):
    """The logits call at the benchmark shape in its default config."""
    args = logits_inputs(dtype)
    out = torch.empty((M, indexer.row_stride_elems(N)), device="cuda")[:, :N]
    cfg = logits_mod.default_config(dtype, H, D)
    return (lambda: indexer.mqa_logits(*args, out)), 2 * M * N * H * D, cfg


def product_case(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(MM, MM, generator=g, device="cuda")
    b = torch.randn(MM, MM, generator=g, device="cuda")
    if dtype == FP8:
        a8, b8 = a.to(FP8), b.to(FP8).t()            # _scaled_mm wants b column-major
        one = torch.ones((), device="cuda")
        fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,  # noqa: E731
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
        return fn, 2 * MM ** 3, "torch._scaled_mm"
    a16, b16 = a.bfloat16(), b.bfloat16()
    return (lambda: a16 @ b16), 2 * MM ** 3, "torch.matmul"


def sustained(fn, seconds: float) -> tuple[float, float, float]:
    """(seconds a call, start, end) over ``seconds`` of back-to-back calls after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        calls += 10
    t1 = time.time()
    return (t1 - t0) / calls, t0, t1


def read_samples(path: Path) -> list[tuple[float, float, float, int]]:
    """(unix time, SM MHz, W, clock-limit reasons bitmask) per nvidia-smi line."""
    out = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            out.append((ts, float(parts[1].split()[0]), float(parts[2].split()[0]),
                        int(parts[3], 16)))
        except (ValueError, IndexError):
            continue
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="run time of each case")
    p.add_argument("--json", help="write the results there as JSON")
    p.add_argument("--launch", choices=sorted(DTYPES), help="only launch this logits kernel")
    p.add_argument("--launches", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_clocks needs a CUDA GPU")
    if args.launch:
        fn, _, _ = logits_case(DTYPES[args.launch])
        for _ in range(args.launches):
            fn()
        torch.cuda.synchronize()
        return

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "smi.csv"
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader",
                                "-i", str(torch.cuda.current_device()), "-lms", "100"],
                               stdout=log.open("w"), stderr=subprocess.DEVNULL)
        rows = []
        try:
            for name, dtype in DTYPES.items():
                for kind in ("ceiling", "logits"):
                    if kind == "ceiling":
                        fn, flops, what = product_case(dtype)
                    else:
                        fn, flops, cfg = logits_case(dtype)
                        what = f"logits ({cfg!r})"
                    per_call, t0, t1 = sustained(fn, args.seconds)
                    rows.append(dict(dtype=name, case=what, tflops=flops / per_call / 1e12,
                                     ms=per_call * 1e3, start=t0, end=t1))
                    time.sleep(1.0)         # let the clock recover between cases
        finally:
            smi.terminate()
            smi.wait()
        samples = read_samples(log)
    for r in rows:
        # The last 60% of each run: the clock has settled at its power limit by then.
        lo = r["start"] + 0.4 * (r["end"] - r["start"])
        inside = [s for s in samples if lo <= s[0] <= r["end"]]
        r["sm_mhz"] = statistics.median(s[1] for s in inside) if inside else float("nan")
        r["watts"] = statistics.median(s[2] for s in inside) if inside else float("nan")
        r["power_capped"] = (sum(bool(s[3] & 0x4) for s in inside) / len(inside)
                             if inside else float("nan"))
        r["tflops_per_ghz"] = r["tflops"] / (r["sm_mhz"] / 1e3)
    table = Table(title=f"sustained, {args.seconds:g} s a case ({torch.cuda.get_device_name()}, "
                        f"torch {torch.__version__})")
    for col in ("dtype", "case", "TFLOP/s", "of ceiling", "SM MHz", "W", "power-capped",
                "TFLOP/s per GHz", "per cycle, of ceiling"):
        table.add_column(col, justify="left" if col in ("dtype", "case") else "right")
    ceiling = {}
    for r in rows:
        c = ceiling.setdefault(r["dtype"], r)
        r["of_ceiling"] = r["tflops"] / c["tflops"]
        r["per_cycle_of_ceiling"] = r["tflops_per_ghz"] / c["tflops_per_ghz"]
        table.add_row(r["dtype"], r["case"], f"{r['tflops']:.1f}", f"{r['of_ceiling']:.3f}",
                      f"{r['sm_mhz']:.0f}", f"{r['watts']:.0f}", f"{r['power_capped']:.0%}",
                      f"{r['tflops_per_ghz']:.1f}", f"{r['per_cycle_of_ceiling']:.3f}")
    Console(width=160).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
