"""The two implementations of densematch.ops.Ops, torch's and C's, judged one way (the ``ops``
fixture runs each test once per implementation) against float64 references, and the one place
that chooses between them (densematch.kernels.ops_for)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch.kernels import native, ops_for
from densematch.kernels.c_ops import C_OPS
from densematch.ops import TORCH_OPS

from .._reference import assert_sums_close, minkowski_reference

INF = float("inf")


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 9),
    n=st.integers(1, 21),
    c=st.integers(1, 30),
    p=st.sampled_from([1.0, INF]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    given_out=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_minkowski_scores_are_minus_the_distances(ops, m, n, c, p, dtype, given_out, seed):
    g = torch.Generator().manual_seed(seed)
    q, r = torch.randn(m, c, generator=g, dtype=dtype), torch.randn(n, c, generator=g, dtype=dtype)
    out = torch.full((m, n), torch.nan, dtype=dtype) if given_out else None
    got = ops.minkowski_scores(q, r, out, p=p)
    assert got.shape == (m, n) and got.dtype == dtype and (out is None or got.data_ptr() == out.data_ptr())
    assert_sums_close(-got, minkowski_reference(q, r.T, p == INF), c, dtype)


@pytest.mark.parametrize("p", [1.0, INF])
@pytest.mark.parametrize("strided_out", [False, True])
def test_minkowski_bank_and_its_gradients(ops, p, strided_out):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 11, generator=g, dtype=torch.float64)
    xt = torch.randn(11, 40, generator=g, dtype=torch.float64)
    xt[:, 3] = rows[2]  # a zero distance: the subgradient 0, as torch.cdist's
    out = torch.empty(40, 7, dtype=torch.float64).T if strided_out else torch.empty(7, 40, dtype=torch.float64)
    if strided_out and not ops.writes_strided:
        out = out.contiguous()  # the caller's own tile where the operations need one
    ops.minkowski_bank(rows, xt, out, p=p)
    assert_sums_close(out, minkowski_reference(rows, xt, p == INF), 11, torch.float64)
    w = torch.randn(7, 40, generator=g, dtype=torch.float64)
    gx, gp = ops.minkowski_bank_grads(rows, xt, w, out, p=p)
    rr, xr = rows.clone().requires_grad_(), xt.clone().requires_grad_()
    want_p, want_x = torch.autograd.grad((torch.cdist(rr, xr.T, p=p) * w).sum(), (rr, xr))
    torch.testing.assert_close(gx, want_x)
    torch.testing.assert_close(gp, want_p)


@pytest.mark.parametrize("root", [True, False])
def test_l2_bank_and_its_weights(ops, root):
    g = torch.Generator().manual_seed(2)
    protos = torch.randn(13, 6, generator=g, dtype=torch.float64)
    centre = protos.mean(0)
    body = protos - centre
    xt = torch.randn(6, 30, generator=g, dtype=torch.float64)
    xt[:, 4] = protos[5]
    out = torch.empty(13, 30, dtype=torch.float64)
    xc, xx, smallest = ops.l2_bank(body, body.square().sum(1), centre, xt, out, root=root)
    want = torch.cdist(protos, xt.T)
    torch.testing.assert_close(out, want if root else want.square())
    torch.testing.assert_close(xc, xt - centre[:, None])
    torch.testing.assert_close(xx, xc.square().sum(0))
    assert (out >= 0).all() and abs(float(smallest[4])) < 1e-12
    gout = torch.randn(13, 30, generator=g, dtype=torch.float64)
    w, per_col, per_row = ops.l2_weights(gout, out, root=root)
    expect = torch.where(out == 0, 0.0, gout / out) if root else gout
    torch.testing.assert_close(w, expect)
    torch.testing.assert_close(per_col, expect.sum(0))
    torch.testing.assert_close(per_row, expect.sum(1))


@pytest.mark.parametrize("metric", ["cosine", "dot", "l2", "sqeuclidean", "l1", "linf"])
def test_the_metrics_values_and_direct_scores_through_either(ops, metric):
    m = densematch.metrics.get_metric(metric)
    g = torch.Generator().manual_seed(8)
    q, r = torch.randn(7, 50, generator=g), torch.randn(11, 50, generator=g)
    idx = torch.randint(0, 11, (7, 4), generator=g)
    terms = m.pair_terms(r, ops=ops)
    assert (terms is not None) == (ops.c and metric == "cosine")
    got = m.pair_values(q, r, idx, ops=ops, r_terms=terms)
    want = m.pair_value(q.double()[:, None, :], r.double()[idx])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    rows = torch.tensor([6, 0, 0, 3, 6, 1, 2])  # the query rows named: the scores that settle near-ties
    scores = m.direct_scores(q, r, idx, q_rows=rows, ops=ops)
    want = m.direct_score(q.double()[rows][:, None, :], r.double()[idx])
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-4)


def test_only_c_has_a_kernel_of_pairs(ops):
    q, r, idx = torch.randn(3, 5), torch.randn(4, 5), torch.tensor([[0, 3], [1, 1], [2, 0]])
    got = ops.pair_values(q, r, idx, "dot")
    if ops.c:
        torch.testing.assert_close(got, torch.einsum("mc,mkc->mk", q, r[idx]))
    else:
        assert got is None and ops.cosine_terms(r) is None


@pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
def test_c_hands_tensors_it_cannot_take_to_torch():
    # tensors without memory here (meta), or of a dtype no kernel has: torch's implementation
    q, r = torch.randn(5, 8, device="meta"), torch.randn(6, 8, device="meta")
    assert C_OPS.minkowski_scores(q, r, None, p=1.0).shape == (5, 6)
    assert C_OPS.pair_values(q, r, torch.zeros(5, 1, dtype=torch.int64), "dot") is None
    assert C_OPS.cosine_terms(torch.randn(4, 3).half()) is None
    g, d = torch.rand(3, 4).half(), torch.rand(3, 4).half()
    for got, want in zip(C_OPS.l2_weights(g, d, root=True), TORCH_OPS.l2_weights(g, d, root=True), strict=True):
        assert torch.equal(got, want)


def test_the_one_resolution():
    cpu = torch.device("cpu")
    c = C_OPS if native.library() is not None else TORCH_OPS
    assert ops_for(True, cpu, torch.float32) is c and ops_for(True, cpu, torch.float64) is c
    # the setting says no, or the tensors suit no kernel: torch's
    assert ops_for(False, cpu, torch.float32) is TORCH_OPS
    assert ops_for(True, cpu, torch.float16) is TORCH_OPS
    assert ops_for(True, torch.device("meta"), torch.float32) is TORCH_OPS
    # nor while a graph is traced (fake tensors have no memory to hand to C)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert ops_for(True, cpu, torch.float32) is TORCH_OPS
    assert repr(TORCH_OPS) == "<densematch ops: torch>" and not TORCH_OPS.c and C_OPS.c
