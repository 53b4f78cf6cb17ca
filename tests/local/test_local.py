"""local_match: windows against a float64 brute-force reference, the volume's layout and
gradients, flows, masks, and the memory it never takes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch import LocalCostVolume, LocalMatcher, local_cost_volume, local_match
from densematch.kernels import native
from densematch.kernels.c_ops import C_OPS
from densematch.metrics import get_metric

from .._memory import peak_extra
from .._reference import METRICS, assert_same_up_to_ties, patch_features, reference_scores, reported, tolerance


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def window_reference(a, b, radius, dilation=1, flow=None, sampling="nearest", metric="cosine", mask_b=None):
    """(O, H, W) float64 values of one (H, W, C) pair, NaN where a window has no candidate.

    Integer positions read the full float64 score matrix; bilinear positions interpolate b
    with torch's grid_sample (align_corners=True puts -1 and 1 on the first and last pixels)."""
    h, w, c = a.shape
    (ry, rx), (dy, dx) = _pair(radius), _pair(dilation)
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    fy, fx = (
        (torch.zeros_like(yy), torch.zeros_like(xx)) if flow is None else (flow[..., 0].double(), flow[..., 1].double())
    )
    if sampling == "nearest":
        fy, fx = (fy + 0.5).floor(), (fx + 0.5).floor()
    full = reported(reference_scores(a.reshape(-1, c), b.reshape(-1, c), metric), metric)
    allowed = torch.ones(h, w, dtype=torch.bool) if mask_b is None else mask_b
    out = []
    for i in range(-ry, ry + 1):
        for j in range(-rx, rx + 1):
            py, px = yy + fy + i * dy, xx + fx + j * dx
            inside = (py >= 0) & (py <= h - 1) & (px >= 0) & (px <= w - 1)
            vals = torch.full((h, w), math.nan, dtype=torch.float64)
            if sampling == "nearest":
                q = (py.clamp(0, h - 1) * w + px.clamp(0, w - 1)).long()
                ok = inside & allowed.reshape(-1)[q]
                vals[ok] = full[torch.arange(h * w).reshape(h, w)[ok], q[ok]]
            else:
                grid = torch.stack((2 * px / max(w - 1, 1) - 1, 2 * py / max(h - 1, 1) - 1), -1)[None]
                bi = F.grid_sample(b.double().permute(2, 0, 1)[None], grid, align_corners=True)[0].permute(1, 2, 0)
                vals[inside] = _direct(a.double()[inside], bi[inside], metric)
            out.append(vals)
    return torch.stack(out)


def _direct(x, y, metric):
    if metric == "cosine":
        return (F.normalize(x, dim=-1) * F.normalize(y, dim=-1)).sum(-1)
    if metric == "dot":
        return (x * y).sum(-1)
    d = x - y
    return {
        "l2": d.norm(dim=-1),
        "sqeuclidean": d.square().sum(-1),
        "l1": d.abs().sum(-1),
        "linf": d.abs().amax(-1),
    }[metric]


def ranked_reference(vol, metric, k):
    """(H*W, k) offsets best first from a reference volume, ties to the lower offset; -1 where
    a pixel has fewer than k candidates."""
    o = vol.shape[0]
    flat = vol.reshape(o, -1).T
    score = torch.where(flat.isnan(), -math.inf, flat if metric in ("cosine", "dot") else -flat)
    order = score.sort(dim=1, descending=True, stable=True).indices[:, :k]
    return torch.where(score.gather(1, order) > -math.inf, order, -1)


def offset_index(order, radius, dilation, h, w, flow=None):
    """Flat indices in b of the offsets ``order`` (H*W, k) of each pixel (nearest positions)."""
    (ry, rx), (dy, dx) = _pair(radius), _pair(dilation)
    side = 2 * rx + 1
    oy, ox = (order // side - ry) * dy, (order % side - rx) * dx
    y = torch.arange(h).repeat_interleave(w)[:, None]
    x = torch.arange(w).repeat(h)[:, None]
    if flow is not None:
        f = (flow.double() + 0.5).floor().long().reshape(-1, 2)
        y, x = y + f[:, :1], x + f[:, 1:]
    return torch.where(order >= 0, (y + oy) * w + x + ox, -1)


def same_picks(a, b, got, want, metric):
    """Window picks (flat indices in b, of shape (*batch, H, W[, k])) of two computations agree
    up to near-ties, batch item by batch item: float32 may break those either way."""
    c = a.shape[-1]
    a, b, got, want = (x[None] if a.dim() == 3 else x for x in (a, b, got, want))
    for i in range(a.shape[0]):
        assert_same_up_to_ties(a[i].reshape(-1, c), b[i].reshape(-1, c), got[i], want[i], metric)


def check_topk(a, b, radius, metric, k=1, dilation=1, flow=None, mask_b=None, device=None):
    """local_match of a and b (on ``device``, default theirs) against the windowed reference."""
    h, w, c = a.shape
    on = (lambda v: v) if device is None else (lambda v: None if v is None else v.to(device))
    got = local_match(on(a), on(b), radius, dilation=dilation, flow=on(flow), metric=metric, k=k, mask_b=on(mask_b))
    vol = window_reference(a, b, radius, dilation, flow, metric=metric, mask_b=mask_b)
    want = offset_index(ranked_reference(vol, metric, k), radius, dilation, h, w, flow)
    index = got.index.cpu().reshape(h * w, k)
    # a tie inside the window is a tie: judge with the same near-tie rule as the global search
    assert_same_up_to_ties(a.reshape(-1, c), b.reshape(-1, c), index, want, metric)
    chosen = reported(reference_scores(a.reshape(-1, c), b.reshape(-1, c), metric), metric)
    ok = index >= 0
    expect = chosen.gather(1, index.clamp_min(0))[ok]
    score = got.score.cpu().reshape(h * w, k)[ok].double()
    assert torch.allclose(score, expect, atol=tolerance(a, b, metric), rtol=1e-5)
    assert torch.equal(got.valid.cpu().reshape(h * w, k), ok)
    coords = got.coords.cpu().reshape(h * w, k, 2)
    assert torch.equal(coords[ok], torch.stack((index // w, index % w), -1)[ok])


# the C kernel values shifted windows by default; torch's elementwise passes are the other path
KERNELS = ("auto", "torch")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("metric", METRICS)
def test_topk_on_photo_features_matches_the_windowed_reference(camera_small, metric, kernel):
    img = camera_small[:20, :24]
    a = patch_features(img, 5)
    b = torch.roll(a, (2, -1), (0, 1)) + 0.01 * torch.randn(a.shape)
    with densematch.config_context(kernel=kernel):
        for radius, dilation, k in ((0, 1, 1), (3, 1, 2), ((2, 5), (2, 1), 3), (7, 1, 1)):
            check_topk(a, b, radius, metric, k=k, dilation=dilation)


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="no C kernels here")
@pytest.mark.parametrize("metric", METRICS)
def test_the_c_windows_value_each_pair_as_the_engine_does(metric):
    # one reduction order for a pair wherever it is valued: the window's value and the engine's
    # re-scoring of the same two features are equal to the last bit
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 9, 37, generator=g), torch.randn(7, 9, 37, generator=g)
    vol = local_cost_volume(a, b, (2, 3), metric=metric, fill=math.nan).reshape(-1, 63)
    # cosine windows are dot products of unit rows
    m = densematch.metrics.get_metric("dot" if metric == "cosine" else metric)
    ra, rb = (
        densematch.metrics.unit_rows(x.reshape(-1, 37)) if metric == "cosine" else x.reshape(-1, 37) for x in (a, b)
    )
    y, x = torch.arange(63) // 9, torch.arange(63) % 9
    for slot, (oy, ox) in enumerate((i, j) for i in range(-2, 3) for j in range(-3, 4)):
        inside = (y + oy >= 0) & (y + oy < 7) & (x + ox >= 0) & (x + ox < 9)
        idx = ((y + oy) * 9 + x + ox)[inside][:, None]
        engine = m.pair_values(ra, rb, idx, q_rows=torch.arange(63)[inside], ops=C_OPS)[:, 0]
        assert torch.equal(vol[slot][inside], engine), (metric, oy, ox)
        assert vol[slot][~inside].isnan().all()


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    c=st.integers(1, 5),
    radius=st.tuples(st.integers(0, 7), st.integers(0, 7)),
    dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    metric=st.sampled_from(METRICS),
    integer=st.booleans(),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(KERNELS),
    data=st.data(),
)
def test_property_volume_and_topk_equal_the_reference(h, w, c, radius, dilation, metric, integer, seed, kernel, data):
    with densematch.config_context(kernel=kernel):
        _volume_and_topk_equal_the_reference(h, w, c, radius, dilation, metric, integer, seed, data)


def _volume_and_topk_equal_the_reference(h, w, c, radius, dilation, metric, integer, seed, data):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
    if integer:  # small integers: exact ties everywhere, which must go to the lower offset
        a, b = a.round().clamp(-1, 1), b.round().clamp(-1, 1)
    count = (2 * radius[0] + 1) * (2 * radius[1] + 1)
    k = data.draw(st.integers(1, min(count, 4)))
    check_topk(a, b, radius, metric, k=k, dilation=dilation)
    vol = local_cost_volume(a, b, radius, dilation=dilation, metric=metric, fill=math.nan)
    ref = window_reference(a, b, radius, dilation, metric=metric)
    assert vol.shape == (2 * radius[0] + 1, 2 * radius[1] + 1, h, w)
    assert torch.equal(vol.isnan().reshape(count, h, w), ref.isnan())
    assert torch.allclose(
        vol.reshape(count, h, w).double(), ref, atol=tolerance(a, b, metric), rtol=1e-5, equal_nan=True
    )


@settings(max_examples=40, deadline=None)
@given(
    metric=st.sampled_from(METRICS),
    c=st.integers(1, 6),
    integer=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_pair_grads_equal_autograd(metric, c, integer, seed):
    # the backward operator's closed forms against autograd of the value itself, float64; small
    # integers give equal rows (l2 at 0), zero rows (cosine) and linf's tied largest differences
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(7, c, generator=g, dtype=torch.float64) for _ in range(2))
    if integer:
        a, b = a.round().clamp(-1, 1), b.round().clamp(-1, 1)
    up = torch.randn(7, generator=g, dtype=torch.float64)
    m = get_metric(metric)
    leaves = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.autograd.grad((m.pair_value(*leaves) * up).sum(), leaves)
    got = m.pair_grads(a, b, up)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_exact_ties_go_to_the_lowest_offset():
    a = torch.ones(6, 7, 3)
    b = torch.ones(6, 7, 3)
    m = local_match(a, b, 2, metric="l2", k=3)
    # every candidate is at distance 0: the first three inside b, row-major over the window
    assert m.coords[3, 3].tolist() == [[1, 1], [1, 2], [1, 3]]
    assert m.coords[0, 0].tolist() == [[0, 0], [0, 1], [0, 2]]
    assert m.coords[5, 6].tolist() == [[3, 4], [3, 5], [3, 6]]


def test_volume_has_spatial_correlation_samplers_layout_hand_computed():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])[None, None]  # (B, C, H, W)
    b = torch.tensor([[5.0, 6.0], [7.0, 8.0]])[None, None]
    vol = local_cost_volume(a, b, 1, metric="dot", layout="chw")
    assert vol.shape == (1, 3, 3, 2, 2)
    assert vol[0, 1, 1].tolist() == [[5, 12], [21, 32]]  # no displacement
    assert vol[0, 0, 0].tolist() == [[0, 0], [0, 20]]  # b one row up and one col left
    assert vol[0, 2, 2].tolist() == [[8, 0], [0, 0]]
    assert vol[0, 0, 1].tolist() == [[0, 0], [15, 24]]
    assert vol[0, 1, 2].tolist() == [[6, 0], [24, 0]]
    dil = local_cost_volume(a, b, 1, dilation=2, metric="dot", layout="chw")
    assert dil[0, 1, 1].tolist() == [[5, 12], [21, 32]] and dil[0, 0].abs().sum() == 0 and dil[0, 2].abs().sum() == 0


def test_volume_equals_the_samplers_formula_written_out():
    """out[n, i, j, y, x] = sum_c a[n, c, y, x] * b[n, c, y + (i - ry) dy, x + (j - rx) dx],
    0 outside b: spatial-correlation-sampler's definition (kernel_size=1, stride=1, padding=0)."""
    a, b = torch.randn(2, 3, 5, 6, dtype=torch.float64), torch.randn(2, 3, 5, 6, dtype=torch.float64)
    (ry, rx), (dy, dx) = (1, 2), (2, 1)
    want = torch.zeros(2, 3, 5, 5, 6, dtype=torch.float64)
    for n in range(2):
        for i in range(3):
            for j in range(5):
                for y in range(5):
                    for x in range(6):
                        yb, xb = y + (i - ry) * dy, x + (j - rx) * dx
                        if 0 <= yb < 5 and 0 <= xb < 6:
                            want[n, i, j, y, x] = (a[n, :, y, x] * b[n, :, yb, xb]).sum()
    got = LocalCostVolume((ry, rx), dilation=(dy, dx), metric="dot", layout="chw")(a, b)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("metric", ["cosine", "dot", "l2", "l1"])
def test_volume_gradcheck(metric):
    a = torch.randn(2, 5, 6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 5, 6, 3, dtype=torch.float64, requires_grad=True)

    def vol(a, b):
        return local_cost_volume(a, b, (1, 2), dilation=(1, 2), metric=metric, memory=6000, fill=0.0)

    assert torch.autograd.gradcheck(vol, (a, b), fast_mode=True)


@pytest.mark.parametrize("memory", [None, 40_000])  # one band, then bands of two rows
@pytest.mark.parametrize("metric", ["dot", "l2"])
def test_a_radius_past_the_map_fills_its_planes_in_place_and_differentiates(metric, memory):
    # offsets no pixel reaches are written into the output as the fill, the others in place
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)

    def vol(a, b, radius):
        return local_cost_volume(a, b, radius, metric=metric, memory=memory, fill=0.0)

    wide, reach = vol(a, b, (6, 7)), vol(a, b, (3, 4))  # +-3 rows, +-4 cols reach every pixel pair
    assert wide.shape == (2, 13, 15, 4, 5)
    assert torch.equal(wide[:, 3:10, 3:12], reach)
    outside = torch.ones(13, 15, dtype=torch.bool)
    outside[3:10, 3:12] = False
    assert (wide[:, outside] == 0).all()
    assert torch.autograd.gradcheck(lambda a, b: vol(a, b, (6, 7)), (a, b), fast_mode=True)


def test_volume_gradient_equals_the_unfold_recipe():
    a = torch.randn(1, 4, 9, 11, requires_grad=True)
    b = torch.randn(1, 4, 9, 11, requires_grad=True)
    g = torch.randn(1, 5, 5, 9, 11)
    (local_cost_volume(a, b, 2, metric="dot", layout="chw", memory="64KiB") * g).sum().backward()
    mine = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    patches = F.unfold(F.pad(b, (2, 2, 2, 2)), 5).view(1, 4, 5, 5, 9, 11)
    ((a[:, :, None, None] * patches).sum(1) * g).sum().backward()
    assert torch.allclose(mine[0], a.grad, atol=1e-5) and torch.allclose(mine[1], b.grad, atol=1e-5)


def test_nearest_flow_moves_the_window(camera_small):
    a = patch_features(camera_small[:24, :24], 5)
    flow = torch.zeros(24, 24, 2)
    flow[..., 0] = torch.linspace(-3.4, 3.6, 24)[:, None]
    flow[..., 1] = 2.5  # halves go up
    for metric in ("cosine", "l2"):
        b = a + 0.01 * torch.randn(a.shape)
        check_topk(a, b, 1, metric, k=2, flow=flow)
    m = local_match(a, a, 0, flow=flow)
    assert m.coords[10, 3].tolist() == [10 + round(float(flow[10, 3, 0]) + 1e-9), 6]


@pytest.mark.parametrize("metric", ["cosine", "dot", "l2", "l1"])
def test_bilinear_flow_reads_b_like_grid_sample(metric):
    a, b = torch.randn(7, 8, 4, dtype=torch.float64), torch.randn(7, 8, 4, dtype=torch.float64)
    flow = 3 * torch.rand(7, 8, 2, dtype=torch.float64) - 1.5
    flow[0, 0] = torch.tensor([0.0, 0.0])  # integer positions, and one exactly on the last row
    flow[6, 2] = torch.tensor([0.0, 0.25])
    vol = local_cost_volume(a, b, 1, dilation=2, flow=flow, sampling="bilinear", metric=metric, fill=math.nan)
    ref = window_reference(a, b, 1, 2, flow, "bilinear", metric)
    assert torch.allclose(vol.reshape(9, 7, 8), ref, atol=1e-10, equal_nan=True)
    m = local_match(a, b, 1, dilation=2, flow=flow, sampling="bilinear", metric=metric)
    best = ranked_reference(ref, metric, 1)[:, 0]
    ok = best >= 0
    side_y, side_x = best // 3 - 1, best % 3 - 1
    want = torch.stack((torch.arange(7).repeat_interleave(8) + 2 * side_y, torch.arange(8).repeat(7) + 2 * side_x), -1)
    want = want + flow.reshape(-1, 2)
    assert torch.allclose(m.coords.reshape(-1, 2)[ok], want[ok].to(m.coords.dtype))
    assert torch.equal(m.valid.reshape(-1), ok)


@pytest.mark.parametrize("sampling", ["nearest", "bilinear"])
@pytest.mark.parametrize("metric", METRICS)
def test_flow_windows_agree_on_both_kernels(metric, sampling):
    # the C kernel against torch's gathers: the same validity (corners outside b or masked out
    # count only where their weight is not 0), the same values up to rounding, the same picks
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(2, 9, 11, 6, generator=g), torch.randn(2, 9, 11, 6, generator=g)
    flow = 5 * torch.rand(2, 9, 11, 2, generator=g) - 2.5
    flow[:, ::3, ::2] = flow[:, ::3, ::2].round()  # whole positions: corners of weight 0 at the edges
    mask_a, mask_b = torch.rand(2, 9, 11, generator=g) > 0.2, torch.rand(2, 9, 11, generator=g) > 0.2
    kw = dict(flow=flow, sampling=sampling, metric=metric, mask_a=mask_a, mask_b=mask_b)
    with densematch.config_context(kernel="torch"):
        want, want_m = local_cost_volume(a, b, 2, fill=math.nan, **kw), local_match(a, b, 2, k=3, **kw)
    got, got_m = local_cost_volume(a, b, 2, fill=math.nan, **kw), local_match(a, b, 2, k=3, **kw)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(got_m.valid, want_m.valid)
    assert torch.allclose(got_m.score, want_m.score, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("sampling", [None, "nearest", "bilinear"])  # None: shifted windows, no flow
@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_window_gradients_agree_on_both_kernels(metric, sampling):
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(2, 8, 9, 5, generator=g), torch.randn(2, 8, 9, 5, generator=g)
    flow = 4 * torch.rand(2, 8, 9, 2, generator=g) - 2
    flow[:, ::2, ::3] = flow[:, ::2, ::3].round()  # whole positions: corners of weight 0 at the edges
    mask_a, mask_b = torch.rand(2, 8, 9, generator=g) > 0.2, torch.rand(2, 8, 9, generator=g) > 0.2
    w = torch.randn(2, 5, 5, 8, 9, generator=g)

    def grads():
        x, y, f = (t.clone().requires_grad_(t.is_floating_point()) for t in (a, b, flow))
        moved = dict(flow=f, sampling=sampling) if sampling else {}
        kw = dict(**moved, metric=metric, mask_a=mask_a, mask_b=mask_b, fill=0.0)
        (local_cost_volume(x, y, 2, **kw) * w).sum().backward()
        return x.grad, y.grad, f.grad

    with densematch.config_context(kernel="torch"):
        want = grads()
    for got, expect in zip(grads(), want, strict=True):
        if expect is None:  # a nearest flow has no gradient, nor an unused one
            assert got is None
            continue
        assert torch.allclose(got, expect, atol=1e-5, rtol=1e-5)


def test_bilinear_flow_gradcheck_of_the_dot_kernel():
    a = torch.randn(1, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    flow = (0.8 * torch.rand(1, 4, 5, 2, dtype=torch.float64) + 0.1).requires_grad_()  # away from integers

    def vol(a, b, flow):
        return local_cost_volume(a, b, 1, flow=flow, sampling="bilinear", metric="dot", fill=0.0)

    assert torch.autograd.gradcheck(vol, (a, b, flow), fast_mode=True)


def test_bilinear_flow_gradcheck():
    a = torch.randn(1, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    flow = (0.8 * torch.rand(1, 4, 5, 2, dtype=torch.float64) + 0.1).requires_grad_()  # away from integers

    def vol(a, b, flow):
        return local_cost_volume(a, b, 1, flow=flow, sampling="bilinear", metric="l2", fill=0.0)

    assert torch.autograd.gradcheck(vol, (a, b, flow), fast_mode=True)


def test_topk_score_carries_gradients():
    a = torch.randn(5, 6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: local_match(a, b, 1, metric="l2", k=2).score, (a, b))
    m = local_match(a.detach(), b.detach(), 1, metric="l2", k=2)
    assert not m.score.requires_grad


def test_masks_exclude_candidates_and_pixels():
    a, b = torch.randn(6, 7, 4), torch.randn(6, 7, 4)
    mask_b = torch.rand(6, 7) > 0.4
    b_nan = torch.where(mask_b[..., None], b, math.nan)  # masked-out pixels are never read
    check_topk(a, b, 2, "l2", k=2, mask_b=mask_b)
    got = local_match(a, b_nan, 2, metric="l2", k=2, mask_b=mask_b)
    same_picks(a, b, got.index, local_match(a, b, 2, metric="l2", k=2, mask_b=mask_b).index, "l2")
    mask_a = torch.zeros(6, 7, dtype=torch.bool)
    mask_a[2:4, 3:5] = True
    m = local_match(a, b, 2, mask_a=mask_a)
    assert (m.index[~mask_a] == -1).all() and m.valid[mask_a].all() and not m.valid[~mask_a].any()
    vol = local_cost_volume(a, b_nan, 1, metric="l2", mask_a=mask_a, mask_b=mask_b)
    assert torch.isinf(vol[:, :, ~mask_a]).all() and not vol.isnan().any()


def test_batches_and_layouts_agree():
    a, b = torch.randn(3, 8, 9, 5), torch.randn(3, 8, 9, 5)
    flow = torch.randn(3, 8, 9, 2) * 2
    whole = local_match(a, b, 2, k=2, flow=flow)
    for i in range(3):
        one = local_match(a[i], b[i], 2, k=2, flow=flow[i])
        same_picks(a[i], b[i], whole.index[i], one.index, "cosine")
        assert torch.allclose(whole.score[i], one.score, equal_nan=True)
    chw = local_match(a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2), 2, k=2, flow=flow, layout="chw")
    same_picks(a, b, chw.index, whole.index, "cosine")
    shared = local_match(a, b, 2, flow=flow[0])  # one (H, W, 2) flow for every item
    same_picks(a[1], b[1], shared.index[1], local_match(a[1], b[1], 2, flow=flow[0]).index, "cosine")


def test_small_budgets_give_the_same_answer():
    a, b = torch.randn(2, 12, 10, 6), torch.randn(2, 12, 10, 6)
    big = local_match(a, b, 3, metric="l1", k=3)
    small = local_match(a, b, 3, metric="l1", k=3, memory=40_000)
    same_picks(a, b, small.index, big.index, "l1")
    tol = tolerance(a, b, "l1")
    torch.testing.assert_close(small.score, big.score, rtol=0, atol=tol, equal_nan=True)
    vol = local_cost_volume(a, b, 3, metric="l1")
    assert torch.equal(vol, local_cost_volume(a, b, 3, metric="l1", memory=30_000))


@pytest.mark.parametrize("metric", METRICS)
def test_a_window_over_the_whole_map_is_the_global_match(metric):
    a, b = torch.randn(7, 6, 5), torch.randn(7, 6, 5)
    local = local_match(a, b, 6, metric=metric, k=3)
    whole = densematch.match(a, b, metric=metric, k=3)
    assert_same_up_to_ties(a.reshape(-1, 5), b.reshape(-1, 5), local.index, whole.index, metric)
    assert torch.allclose(local.score, whole.score, atol=tolerance(a, b, metric), rtol=1e-5)


def test_a_shifted_photo_is_found(camera_small):
    a = patch_features(camera_small, 7)
    b = torch.roll(a, (-3, 2), (0, 1))  # b[y, x] = a[y + 3, x - 2]
    m = local_match(a, b, 4)
    inner = m.coords[8:-8, 8:-8]
    grid = torch.stack(torch.meshgrid(torch.arange(8, 56), torch.arange(8, 56), indexing="ij"), -1)
    assert ((inner - grid) == torch.tensor([-3, 2])).all(-1).float().mean() > 0.99


def test_half_inputs_are_computed_in_float32():
    a, b = torch.randn(6, 7, 8), torch.randn(6, 7, 8)
    got = local_cost_volume(a.half(), b.half(), 1, metric="l2")
    assert got.dtype == torch.float32
    assert torch.allclose(got, local_cost_volume(a.half().float(), b.half().float(), 1, metric="l2"))


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"radius": -1}, ValueError, "radius must be"),
        ({"radius": (1, 2, 3)}, ValueError, "radius must be an int or a"),
        ({"radius": 1.5}, TypeError, "radius must be an int"),
        ({"dilation": 0}, ValueError, "dilation must be"),
        ({"k": 10}, ValueError, "k must be between 1 and 9"),
        ({"output": "volume"}, TypeError, "unexpected keyword argument 'output'"),  # local_cost_volume now
        ({"sampling": "cubic"}, ValueError, "sampling must be one of"),
        ({"metric": "hamming"}, ValueError, "metric must be one of"),
        ({"layout": "flat"}, ValueError, "layout must be 'hwc' or 'chw'"),
        ({"flow": torch.zeros(6, 7, 3)}, ValueError, "flow must have shape"),
        ({"flow": torch.full((6, 7, 2), math.nan)}, ValueError, "flow must hold only finite"),
        ({"flow": torch.zeros(6, 7, 2, dtype=torch.bool)}, TypeError, "flow must hold real numbers"),
        ({"mask_b": torch.ones(6, 7)}, TypeError, "mask_b must be a boolean mask"),
        ({"memory": 100}, ValueError, "cannot hold one row of windows"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, text):
    kwargs = {"radius": 1, **kwargs}
    with pytest.raises(error, match=text):
        local_match(torch.randn(6, 7, 4), torch.randn(6, 7, 4), **kwargs)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="share one grid"):
        local_match(torch.randn(6, 7, 4), torch.randn(6, 8, 4), 1)
    with pytest.raises(ValueError, match="channels"):
        local_match(torch.randn(6, 7, 4), torch.randn(6, 7, 3), 1)
    with pytest.raises(ValueError, match="finite"):
        local_match(torch.full((6, 7, 4), math.inf), torch.randn(6, 7, 4), 1)
    with pytest.raises(TypeError, match="floats"):
        local_match(torch.ones(6, 7, 4, dtype=torch.int64), torch.randn(6, 7, 4), 1)


def test_module_twin():
    m = LocalMatcher(2, metric="l2", k=2)
    assert repr(m) == "LocalMatcher(radius=(2, 2), metric='l2', k=2, layout='hwc')"
    assert (
        repr(LocalCostVolume(1, metric="dot", fill=0.0))
        == "LocalCostVolume(radius=(1, 1), metric='dot', fill=0.0, layout='hwc')"
    )
    a, b = torch.randn(5, 6, 3), torch.randn(5, 6, 3)
    same_picks(a, b, m(a, b).index, local_match(a, b, 2, metric="l2", k=2).index, "l2")
    with pytest.raises(ValueError, match="k must be between 1 and 25"):
        LocalMatcher(2, k=26)


LOCAL_TRAIN = """
g = torch.Generator().manual_seed(0)
a = torch.randn(1, 64, {n}, {n}, generator=g).requires_grad_()
b = torch.randn(1, 64, {n}, {n}, generator=g).requires_grad_()
def run(small):
    n = 16 if small else {n}
    x, y = a[..., :n, :n], b[..., :n, :n]
    vol = densematch.local_cost_volume(x, y, 7, metric="{metric}", layout="chw", memory="{mib}MiB")
    vol.sum().backward()
"""


@pytest.mark.parametrize("metric", ["l2"])
def test_volume_forward_backward_stays_under_its_budget(metric):
    # the unfold recipe would hold 1 x 64 x 225 x 96 x 96 floats: 506 MiB, twice over
    n, mib = 96, 32
    extra = peak_extra(LOCAL_TRAIN.format(n=n, metric=metric, mib=mib))
    volume = 225 * n * n * 4
    grads = 2 * 64 * n * n * 4
    assert extra <= mib * 2**20 + 3 * volume + grads + 16 * 2**20, f"peak {extra / 2**20:.1f} MiB"


@pytest.mark.parametrize("output", ["volume", "topk"])
def test_a_radius_past_the_maps_equals_the_largest_that_reaches(output):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)
    if output == "volume":
        huge = densematch.local_cost_volume(a, b, 500, metric="dot")
        whole = densematch.local_cost_volume(a, b, (2, 3), metric="dot")
        assert huge.shape == (1001, 1001, 3, 4)
        assert torch.equal(huge[498:503, 497:504], whole)
        huge[498:503, 497:504] = 0
        assert (huge == 0).all()  # dot's fill where no candidate exists
    else:
        huge = densematch.local_match(a, b, 500, k=40)
        whole = densematch.local_match(a, b, (2, 3), k=35)
        assert torch.equal(huge.index[..., :35], whole.index) and (huge.index[..., 35:] == -1).all()
        assert not huge.valid[..., 35:].any()


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="no C kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channels_first_maps_are_read_in_place_to_the_same_bits(dtype):
    # rows turned channels last into a ring, valued by the per-pixel kernels: every kind, with
    # and without a channel tail, any offsets (unsorted, with gaps, past the grid)
    g = torch.Generator().manual_seed(11)
    offsets = torch.tensor([(i, j) for i in range(-2, 3) for j in range(-3, 4)] + [(5, 1), (-7, 0), (3, -2)])
    offsets = offsets[torch.randperm(len(offsets), generator=g)]
    for c, h, w in ((3, 5, 7), (16, 9, 45), (37, 4, 70)):
        a, b = (torch.randn(c, h, w, generator=g, dtype=dtype).permute(1, 2, 0) for _ in range(2))
        assert native.planar(a) and not native.planar(a.contiguous())
        for kind in ("dot", "sqdiff", "absdiff", "maxabs"):
            flat = native.local_values(a, b, offsets, 1, h, kind)
            rows = native.local_values(a.contiguous(), b.contiguous(), offsets, 1, h, kind)
            assert torch.equal(flat.isnan(), rows.isnan()) and torch.equal(flat.nan_to_num(), rows.nan_to_num())
    with pytest.raises(ValueError, match="must be contiguous"):
        native.local_values(a, b.contiguous(), offsets, 0, h, "dot")


@pytest.mark.parametrize("metric", ["dot", "cosine", "l2", "l1", "linf"])
def test_chw_and_hwc_inputs_give_one_volume_and_one_gradient(metric):
    # (C, H, W) inputs are read in place by the C kernels, (H, W, C) rows per pixel: the same bits
    g = torch.Generator().manual_seed(12)
    a, b = (torch.randn(2, 37, 9, 41, generator=g) for _ in range(2))
    mask = torch.rand(2, 9, 41, generator=g) > 0.2
    got = {}
    for layout, (x, y) in (("chw", (a, b)), ("hwc", (a.permute(0, 2, 3, 1), b.permute(0, 2, 3, 1)))):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        vol = local_cost_volume(x, y, (2, 3), metric=metric, layout=layout, mask_b=mask, fill=0.0)
        vol.square().sum().backward()
        grads = [t.grad if layout == "chw" else t.grad.permute(0, 3, 1, 2) for t in (x, y)]
        best = local_match(x.detach(), y.detach(), 2, metric=metric, layout=layout, k=2)
        got[layout] = (vol.detach(), *grads, best.index)
    for u, v in zip(got["chw"], got["hwc"], strict=True):
        assert torch.equal(u, v), metric


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="no C kernels here")
def test_a_chw_volume_holds_its_output_and_one_band():
    # no channels-last copy of either map: those would add 2 x 64 x 96 x 96 floats (4.5 MiB)
    code = """
g = torch.Generator().manual_seed(0)
a, b = torch.randn(1, 64, 96, 96, generator=g), torch.randn(1, 64, 96, 96, generator=g)
def run(small):
    n = 16 if small else 96
    densematch.local_cost_volume(a[..., :n, :n], b[..., :n, :n], 4, metric="dot", layout="chw", memory="1MiB")
"""
    output = 81 * 96 * 96 * 4
    extra = peak_extra(code)
    assert extra <= output + 1.5 * 2**20, f"peak {extra / 2**20:.2f} MiB, output {output / 2**20:.2f} MiB"
