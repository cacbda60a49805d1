"""What every kernel launch of the package passes to Triton itself, whatever Triton's defaults.

``enable_fp_fusion=True``: the kernels' inner loops are written as multiplies and adds that must
become fused multiply-adds (the logits' weighted relus, ``acc += relu(s) * w``: one FFMA an
element; the weighted q's sums), and every figure in benchmarks/RESULTS.md and every tolerance
of the tests was taken with them fused. Triton 3.9 warns that its default turns fusion off in
3.10 (TRITON_DEFAULT_FP_FUSION); a kernel that passes the option keeps it, on every version.
"""

LAUNCH_OPTIONS = {"enable_fp_fusion": True}
