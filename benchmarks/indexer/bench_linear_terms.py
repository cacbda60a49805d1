#!/usr/bin/env python
"""The sm_90 logits kernel with and without the relus' linear half taken apart
(``HopperConfig.linear_terms``), side by side: speed and accuracy, fp8 and bf16, at 64, 32 and
16 heads.

    python benchmarks/indexer/bench_linear_terms.py [--rounds 3] [--json FILE]

Per (dtype, H): each config's TFLOP/s (median of ``--rounds`` ``do_bench`` rounds, full rows,
M = 4096, N = 65536, D = 128) beside the product ceiling measured in the same rounds, and its
logits' relative error and tie-aware top-2048 agreement (``reference.topk_agreement``) against
the float64 reference on the same (quantized) inputs over the first ``--rows`` rows. This is
the measurement behind the default config's choice of linear terms
(``indexer.logits.default_config``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.indexer.cases import FP8, D, M, N, logits_inputs, product_case  # noqa: E402
from indexer import HopperConfig, mqa_logits, row_stride_elems  # noqa: E402
from indexer import reference as ref  # noqa: E402
from indexer.logits_hopper import supports  # noqa: E402

K = 2048
CASES = [(FP8, 64, [(6, 3), (6, 3, 2), (6, 3, 3), (8, 3, 3)]),
         (FP8, 32, [(6, 3), (6, 3, 3)]),
         (FP8, 16, [(6, 3), (6, 3, 3)]),
         (torch.bfloat16, 64, [(3, 2), (3, 2, 2), (3, 2, 3)]),
         (torch.bfloat16, 32, [(3, 2), (3, 2, 3)])]


def main():
    p = harness.parser(__doc__, rounds=3, rounds_help="interleaved do_bench rounds")
    p.add_argument("--rows", type=int, default=64, help="rows checked against float64")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench_linear_terms needs an sm_90 GPU (the kernel it measures is sm_90's)")
    out = torch.empty((M, row_stride_elems(N)), device="cuda")[:, :N]
    table, results = [], []
    for seed, (dtype, h, shapes) in enumerate(CASES):
        q, kv, kv_scale, w, ks, ke = logits_inputs(dtype, h, seed)
        rows = slice(0, args.rows)
        want = ref.logits(q[rows], kv, kv_scale, w[rows], ks[rows], ke[rows])
        fns, acc = {}, {}
        for shape in shapes:
            cfg = HopperConfig(*shape)
            if not supports(dtype, h, D, cfg):
                continue
            fns[cfg] = lambda cfg=cfg: mqa_logits(q, kv, kv_scale, w, ks, ke, out, config=cfg)
            fns[cfg]()
            got = out[rows].double()
            agree = ref.topk_agreement(want, got.topk(K, dim=1).indices, ks[rows], ke[rows], K)
            acc[cfg] = (((got - want).norm() / want.norm()).item(), agree.mean().item())
        ceiling, ceiling_flops, name = product_case(dtype)
        times = {c: [] for c in [*fns, name]}
        for _ in range(args.rounds):       # interleaved, so drifts of the clock hit all alike
            for c, fn in [*fns.items(), (name, ceiling)]:
                times[c].append(triton.testing.do_bench(fn, warmup=25, rep=200,
                                                        return_mode="median"))
        ceiling_tf = ceiling_flops / statistics.median(times[name]) / 1e9
        table.append((str(dtype).replace("torch.", ""), str(h), name, f"{ceiling_tf:.1f}", "1.000",
                      "", ""))
        for cfg in fns:
            tf = 2 * M * N * h * D / statistics.median(times[cfg]) / 1e9
            err, agree = acc[cfg]
            table.append(("", "", repr(cfg), f"{tf:.1f}", f"{tf / ceiling_tf:.3f}", f"{err:.2e}",
                          f"{agree:.5f}"))
            results.append(dict(dtype=str(dtype), H=h, config=repr(cfg), tflops=tf,
                                of_ceiling=tf / ceiling_tf, ceiling=name, ceiling_tflops=ceiling_tf,
                                rel_err=err, topk_agreement=agree))
        del q, kv
    harness.table(f"linear terms ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
                  f"Triton {triton.__version__})",
                  ("dtype", "H", "config", "TFLOP/s", "of ceiling", "rel. err vs float64",
                   f"top-{K} agreement"), table, justify="left", width=140)
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
