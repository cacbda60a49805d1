"""The torch references against loop-by-loop definitions, and the top-k checks on hand-made
rows with ties."""

import pytest
import torch

from indexer import reference as ref


def naive_logits(q, kv, kv_scale, w, ks, ke):
    m, h, _ = q.shape
    n = kv.shape[0]
    out = torch.full((m, n), float("-inf"), dtype=torch.float64)
    for i in range(m):
        for j in range(int(ks[i]), int(ke[i])):
            total = 0.0
            for hh in range(h):
                total += max(float(q[i, hh].double() @ kv[j].double()), 0.0) * float(w[i, hh])
            out[i, j] = float(kv_scale[j]) * total
    return out


def random_case(m, n, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    kv_scale = torch.rand(n, generator=g) + 0.5
    w = torch.randn(m, h, generator=g)
    ks = torch.randint(0, n // 2 + 1, (m,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, n, (m,), generator=g, dtype=torch.int32),
                       torch.tensor(n, dtype=torch.int32))
    ke[0] = ks[0]  # one empty row
    return q, kv, kv_scale, w, ks, ke


@pytest.mark.parametrize("m,n,h,d", [(5, 9, 3, 4), (7, 13, 2, 8), (1, 1, 1, 1)])
def test_logits_matches_the_definition(m, n, h, d):
    args = random_case(m, n, h, d, seed=m * 100 + n)
    got = ref.logits(*args)
    want = naive_logits(*args)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float64


def test_logits_float32_close_to_float64_and_chunking_invariant():
    args = random_case(33, 70, 4, 16, seed=3)
    f64 = ref.logits(*args)
    f32 = ref.logits(*args, dtype=torch.float32)
    tiny = ref.logits(*args, max_temp_bytes=1)  # one row at a time
    finite = torch.isfinite(f64)
    assert torch.equal(finite, torch.isfinite(f32))
    err = (f32.double()[finite] - f64[finite]).norm() / f64[finite].norm()
    assert 0 < err < 1e-6
    assert torch.equal(tiny, f64)


def test_logits_upcasts_low_precision_inputs_exactly():
    q, kv, kv_scale, w, ks, ke = random_case(6, 11, 2, 8, seed=4)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    assert torch.equal(ref.logits(qb, kvb, kv_scale, w, ks, ke),
                       ref.logits(qb.float(), kvb.float(), kv_scale, w, ks, ke))


def test_logits_rejects_bad_shapes_and_dtypes():
    q, kv, kv_scale, w, ks, ke = random_case(4, 6, 2, 4, seed=5)
    with pytest.raises(ValueError):
        ref.logits(q, kv[:, :3], kv_scale, w, ks, ke)
    with pytest.raises(ValueError):
        ref.logits(q, kv, kv_scale, w, ks, ke, dtype=torch.bfloat16)


def naive_topk(x, ks, ke, k):
    out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
    for i in range(x.shape[0]):
        row = x[i, int(ks[i]):int(ke[i])]
        order = sorted(range(row.numel()), key=lambda j: -float(row[j]))[:k]
        out[i, :len(order)] = torch.tensor(order, dtype=torch.int32)
    return out


def test_topk_matches_sorting():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(20, 50, generator=g, dtype=torch.float64)
    ks = torch.randint(0, 25, (20,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, 30, (20,), generator=g, dtype=torch.int32),
                       torch.tensor(50, dtype=torch.int32))
    for k in (1, 7, 40):
        got = ref.topk(x, ks, ke, k)
        assert torch.equal(got, naive_topk(x, ks, ke, k))  # distinct values: one answer
        assert ref.topk_validity(x, got, ks, ke, k).all()


def test_topk_pads_short_rows_and_is_relative_to_ks():
    x = torch.tensor([[9.0, 1.0, 5.0, 3.0, 7.0]])
    got = ref.topk(x, torch.tensor([1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 5)
    assert got.tolist() == [[1, 2, 0, -1, -1]]


def test_agreement_with_ties():
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    ks, ke = torch.tensor([0], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)

    def agree(idx, k):
        return ref.topk_agreement(x, torch.tensor([idx], dtype=torch.int32), ks, ke, k).item()

    def valid(idx, k):
        return ref.topk_validity(x, torch.tensor([idx], dtype=torch.int32), ks, ke, k).item()

    for pick in ([0, 2], [2, 4], [4, 0]):
        assert agree(pick, 2) == 1.0 and valid(pick, 2)
    assert agree([0, 3], 2) == 0.5 and not valid([0, 3], 2)
    assert agree([0, 0], 2) == 0.5 and not valid([0, 0], 2)        # repeated index
    assert agree([0, 7], 2) == 0.5 and not valid([0, 7], 2)        # out of range
    assert agree([0, 2, 4, 3], 4) == 1.0 and valid([0, 2, 4, 3], 4)
    # a row shorter than k: all its entries then -1
    assert valid([0, 1, 2, 3, 4, -1, -1], 7)
    assert not valid([0, 1, 2, 3, -1, -1, -1], 7)


def test_agreement_on_empty_rows_is_one():
    x = torch.randn(2, 4)
    ks = torch.tensor([2, 0], dtype=torch.int32)
    ke = torch.tensor([2, 0], dtype=torch.int32)
    idx = torch.full((2, 3), -1, dtype=torch.int32)
    assert ref.topk_agreement(x, idx, ks, ke, 3).tolist() == [1.0, 1.0]
    assert ref.topk_validity(x, idx, ks, ke, 3).all()
    idx[0, 0] = 0
    assert not ref.topk_validity(x, idx, ks, ke, 3)[0]


def test_cpu_tensors_without_the_interpreter_say_what_to_set():
    from tests.support import run_python
    done = run_python("""
import torch, indexer
q, w, kv = torch.randn(4, 2, 64), torch.rand(4, 2), torch.randn(4, 64)
try:
    indexer.prefill_topk(q, w, [4], [4], indexer.DenseKV(kv, torch.ones(4)), k=2)
except ValueError as e:
    print(e)
""", env={"TRITON_INTERPRET": ""})
    assert done.returncode == 0 and "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr
