"""The weighted q in parts (indexer/weighted_q.py, the sm_90 kernel's linear half) and the
weights' tiles: the parts add up to sum_h w q_h under the interpreter, and round to nearest on a
GPU."""

import pytest
import torch

from indexer.weighted_q import FP8_MAX, split_weighted_q, w_tiles
from tests.support import indexer_gpu as gpu


# --- under the interpreter -------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,terms,bits", [(torch.float8_e4m3fn, 2, 3),
                                              (torch.float8_e4m3fn, 3, 3),
                                              (torch.bfloat16, 2, 7), (torch.bfloat16, 3, 7),
                                              (torch.float16, 2, 10)])
def test_weighted_q_parts_add_up_to_the_weighted_q(dtype, terms, bits):
    """row_scale * sum of the parts = sum_h w q_h, to what ``terms`` roundings to a
    ``bits``-bit mantissa leave, each within one unit in its last place (the interpreter's
    conversions round less carefully than the GPU's round-to-nearest, which halves each
    part's error; the GPU test holds the kernel to that)."""
    g = torch.Generator().manual_seed(terms)
    m, h, d = 37, 5, 32
    q = (torch.randn(m, h, d, generator=g) * 3).to(dtype)
    w = torch.randn(m, h, generator=g)
    w[3] = 0                                   # a row whose weighted q is zero
    parts, row_scale = split_weighted_q(q, w, terms)
    assert parts.dtype == dtype and parts.shape == (m, terms * d)
    want = (q.double() * w.double()[:, :, None]).sum(1)
    got = parts.double().view(m, terms, d).sum(1) * row_scale.double()[:, None]
    size = want.abs().amax(1)
    live = size > 0
    err = (got - want).abs().amax(1)[live] / size[live]
    assert err.max().item() <= 2.0 ** (-bits * terms) + 1e-6
    assert (parts[3].float() == 0).all() and row_scale[3].item() == 1.0
    if dtype == torch.float8_e4m3fn:
        # the scale puts each row's largest value at (or one step under) e4m3's maximum
        first = parts[:, :d].float().abs().amax(1)[live]
        assert ((first <= FP8_MAX) & (first >= 416)).all()
    elif dtype == torch.bfloat16:
        assert (row_scale == 1).all()


@pytest.mark.interpreter
def test_weighted_q_rejects_bad_inputs():
    q = torch.randn(4, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="w must be float32"):
        split_weighted_q(q, torch.ones(4, 3), 2)
    with pytest.raises(ValueError, match="w must be float32"):
        split_weighted_q(q, torch.ones(4, 2, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="terms"):
        split_weighted_q(q, torch.ones(4, 2), 0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        split_weighted_q(q.transpose(1, 2), torch.ones(4, 32), 2)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,scale", [(37, 0.5), (64, 1.0), (1, 0.5)])
def test_w_tiles_transpose_scale_pad_and_interleave_rows(m, scale):
    h = 6
    wide = torch.randn(m, h + 3, generator=torch.Generator().manual_seed(m))
    w = wide[:, 2:2 + h]                       # strided rows
    wt = w_tiles(w, scale, 64)
    assert wt.shape == (h, 64)
    # within each 16 rows: 0, 8, 1, 9, ..., 7, 15; rows past M are zero
    place = [i // 16 * 16 + i % 8 * 2 + i % 16 // 8 for i in range(64)]
    assert sorted(place) == list(range(64))
    want = torch.zeros(h, 64)
    want[:, place[:m]] = w.t() * scale
    assert torch.equal(wt, want)
    with pytest.raises(ValueError, match="w must be float32"):
        w_tiles(w.double(), scale, 64)
    with pytest.raises(ValueError, match="block_m"):
        w_tiles(w, scale, 48)


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,terms", [(gpu.FP8, 3), (gpu.FP8, 2), (torch.bfloat16, 2)])
def test_weighted_q_parts_round_to_nearest(dtype, terms):
    """On the GPU each part of the weighted q is its residual rounded to nearest, so the parts
    hold sum_h w q_h to 2^-(mantissa bits + 1) a part (fp8 e4m3: 2^-4, bf16: 2^-8) of each
    row's largest value."""
    from indexer.weighted_q import split_weighted_q
    g = gpu.gen(300 + terms)
    m, h, d = 1000, 64, 128
    q = gpu.quantize(torch.randn(m, h, d, generator=g, device="cuda"),
                     torch.randn(1, d, device="cuda"), dtype)[0]
    w = torch.randn(m, h, generator=g, device="cuda") / h ** 0.5
    parts, row_scale = split_weighted_q(q, w, terms)
    want = (q.double() * w.double()[:, :, None]).sum(1)
    got = parts.double().view(m, terms, d).sum(1) * row_scale.double()[:, None]
    err = ((got - want).abs().amax(1) / want.abs().amax(1)).max().item()
    bound = 2.0 ** (-(4 if dtype == gpu.FP8 else 8) * terms)
    gpu.report(test="weighted q parts", dtype=str(dtype), terms=terms, max_err=err, bound=bound)
    assert err <= bound + 5e-6          # plus the float32 sum over the heads
