"""Beyond the argmax on match: sub-pixel and strided coordinates (refine, stride, offset) and the
ratio test's exclusion radius."""

import numpy as np
import pytest
import torch

from densematch import match
from densematch.app.features import dense_features

from .._reference import assert_same_up_to_ties

SHIFT = (0.3, -0.4)


@pytest.fixture(scope="module")
def shifted():
    """Patch features of a blurred photograph and of its copy shifted by SHIFT (cubic spline
    resampling, another library's), and where each pixel of the first lies in the second."""
    from scipy.ndimage import gaussian_filter
    from scipy.ndimage import shift as spline_shift
    from skimage import data

    img = gaussian_filter(data.camera().astype(np.float64) / 255, 1.5)[150:230, 150:230]
    moved = spline_shift(img, SHIFT, order=3, mode="reflect")  # moved[y] = img[y - SHIFT]
    rows, cols = np.meshgrid(np.arange(80), np.arange(80), indexing="ij")
    truth = np.stack([rows + SHIFT[0], cols + SHIFT[1]], -1)
    keep = np.zeros((80, 80), bool)
    keep[8:-8, 8:-8] = True
    fa = dense_features(img.astype(np.float32), "patch")
    fb = dense_features(moved.astype(np.float32), "patch")
    return fa, fb, truth, keep


def median_error(coords: torch.Tensor, truth: np.ndarray, keep: np.ndarray) -> float:
    return float(np.median(np.linalg.norm(coords.double().numpy() - truth, axis=-1)[keep]))


def test_feature_refinement_recovers_a_fractional_shift(shifted):
    fa, fb, truth, keep = shifted
    whole = match(fa, fb)
    errors = {None: median_error(whole.coords, truth, keep)}
    for mode in ("parabola", "soft", "features"):
        m = match(fa, fb, refine=mode)
        assert m.coords.dtype == torch.float32
        assert_same_up_to_ties(fa.reshape(-1, 49), fb.reshape(-1, 49), m.index, whole.index, "cosine")
        # never more than one pixel from the integer match
        assert (m.coords - whole.coords).abs().max() <= 1.0 + 1e-6
        errors[mode] = median_error(m.coords, truth, keep)
    assert errors[None] > 0.45  # the integer grid is half a pixel off at this shift
    assert errors["features"] <= 0.15, errors
    assert errors["parabola"] < errors[None] and errors["soft"] < errors[None], errors


def test_stride_and_offset_map_the_grid_to_pixels(shifted):
    fa, fb, *_ = shifted
    plain = match(fa[:20, :20], fb[:24, :24], k=2)
    vit = match(fa[:20, :20], fb[:24, :24], k=2, stride=14, offset=6.5)
    torch.testing.assert_close(vit.coords, plain.coords.float() * 14 + 6.5)
    per_axis = match(fa[:20, :20], fb[:24, :24], stride=(2, 4), offset=(0.5, -1))
    torch.testing.assert_close(
        per_axis.coords, plain.coords[..., 0, :].float() * torch.tensor([2.0, 4.0]) + torch.tensor([0.5, -1.0])
    )
    refined = match(fa[:20, :20], fb[:24, :24], refine="features", stride=14, offset=6.5)
    alone = match(fa[:20, :20], fb[:24, :24], refine="features")
    torch.testing.assert_close(refined.coords, alone.coords * 14 + 6.5)


def test_unmatched_pixels_are_nan_and_batches_and_float64_work(shifted):
    fa, fb, *_ = shifted
    mask = torch.ones(20, 20, dtype=torch.bool)
    mask[:3] = False
    a = torch.stack([fa[:20, :20], fa[5:25, 5:25]]).double()
    b = torch.stack([fb[:24, :24], fb[:24, :24]]).double()
    m = match(a, b, mask_a=mask, refine="soft", k=3)
    assert m.coords.shape == (2, 20, 20, 3, 2) and m.coords.dtype == torch.float64
    assert torch.isnan(m.coords[:, :3]).all() and not torch.isnan(m.coords[:, 3:]).any()
    plain = match(a, b, mask_a=mask, k=3)
    assert ((m.coords[:, 3:] - plain.coords[:, 3:]).abs() <= 1.0 + 1e-9).all()
    # each batch item refined against its own b
    one = match(a[1], b[1], mask_a=mask, refine="soft", k=3)
    torch.testing.assert_close(m.coords[1], one.coords, equal_nan=True)


def test_every_metric_refines_near_its_integer_match(shifted):
    fa, fb, *_ = shifted
    for metric in ("l2", "sqeuclidean", "l1", "linf", "dot", "cosine"):
        plain = match(fa[:16, :16], fb[:20, :20], metric=metric)
        for mode in ("parabola", "soft", "features"):
            got = match(fa[:16, :16], fb[:20, :20], metric=metric, refine=mode).coords
            assert torch.isfinite(got).all() and ((got - plain.coords).abs() <= 1.0 + 1e-6).all(), (metric, mode)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"refine": "cubic"}, ValueError, "refine must be one of"),
        ({"stride": 0}, ValueError, "stride must be positive"),
        ({"stride": (1, 2, 3)}, ValueError, r"stride must be a number or a \(row, col\) pair"),
        ({"offset": "1"}, TypeError, "offset must be a real number"),
        ({"refine": "soft", "layout": "flat"}, ValueError, "need 2-D grids"),
    ],
)
def test_bad_placing(kwargs, error, pattern):
    x = torch.randn(6, 7, 4)
    if kwargs.get("layout") == "flat":
        x = x.reshape(-1, 4)
    with pytest.raises(error, match=pattern):
        match(x, x, **kwargs)


def test_the_module_twin_carries_the_placing(shifted):
    from densematch import DenseMatcher

    fa, fb, *_ = shifted
    m = DenseMatcher(refine="features", stride=14, offset=6.5)
    assert "refine='features', stride=(14.0, 14.0), offset=(6.5, 6.5)" in repr(m)
    torch.testing.assert_close(
        m(fa[:12, :12], fb[:12, :12]).coords, match(fa[:12, :12], fb[:12, :12], refine="features").coords * 14 + 6.5
    )
    with pytest.raises(ValueError, match="refine must be one of"):
        DenseMatcher(refine="quadratic")
    with pytest.raises(ValueError, match="give ratio= as well"):
        DenseMatcher(exclude_radius=2)
    twin = DenseMatcher(ratio=0.8, exclude_radius=1.5)
    assert "exclude_radius=1.5" in repr(twin)
    got = twin(fa[:12, :12], fb[:12, :12])
    want = match(fa[:12, :12], fb[:12, :12], ratio=0.8, exclude_radius=1.5)
    a, b = fa[:12, :12].reshape(-1, 49), fb[:12, :12].reshape(-1, 49)
    assert_same_up_to_ties(a, b, got.index, want.index, "cosine")
    same = got.index == want.index  # where a near-tie picked another match, its ratio may differ
    assert same.float().mean() > 0.9 and torch.equal(got.valid[same], want.valid[same])


@pytest.mark.parametrize("radius", [0.0, 1.0, 1.5, 2.0])
@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_exclude_radius_takes_the_runner_up_beyond_it(radius, metric):
    from .._reference import decided, reference_scores, reported, tolerance

    g = torch.Generator().manual_seed(3)
    # a smooth field, and a half-pixel shift of it: the best and its neighbour score alike
    b = torch.nn.functional.avg_pool2d(torch.randn(1, 6, 14, 16, generator=g), 3, 1, 1)[0].permute(1, 2, 0)
    a = 0.5 * (b[2:11, 3:12] + b[2:11, 4:13]) + 0.02 * torch.randn(9, 9, 6, generator=g)
    m = match(a, b, metric=metric, ratio=0.8, exclude_radius=radius)
    ra, rb = a.reshape(-1, 6), b.reshape(-1, 6)
    ref = reference_scores(ra, rb, metric)
    best = ref.argmax(1)
    rows, cols = torch.arange(14).repeat_interleave(16), torch.arange(16).repeat(14)
    near = (rows[None] - rows[best][:, None]).square() + (cols[None] - cols[best][:, None]).square() <= radius**2
    second = ref.masked_fill(near, -torch.inf).amax(1)
    first = ref.gather(1, best[:, None])[:, 0]
    d1 = _ratio_distance(reported(first, metric), metric)
    d2 = _ratio_distance(reported(second, metric), metric)
    want = d1 <= 0.8 * d2
    tol = tolerance(ra, rb, metric)
    clear = decided(ref, tol) & ((d1 - 0.8 * d2).abs() > 10 * tol)
    assert clear.float().mean() > 0.8
    assert torch.equal(m.valid.reshape(-1)[clear], want[clear])
    if radius >= 1:  # the plain test, whose runner-up is a neighbour, rejects more on a smooth field
        plain = match(a, b, metric=metric, ratio=0.8)
        assert m.valid.sum() > 1.5 * plain.valid.sum()


def _ratio_distance(value: torch.Tensor, metric: str) -> torch.Tensor:
    return (2 - 2 * value).clamp_min(0).sqrt() if metric == "cosine" else value


def test_exclude_radius_needs_the_ratio_test_and_a_grid():
    x = torch.randn(6, 7, 4)
    with pytest.raises(ValueError, match="give ratio= as well"):
        match(x, x, exclude_radius=2)
    with pytest.raises(ValueError, match="needs 2-D grids"):
        match(x.reshape(-1, 4), x.reshape(-1, 4), layout="flat", ratio=0.8, exclude_radius=2)
    with pytest.raises(ValueError, match=r"exclude_radius must be in \[0, inf\]"):
        match(x, x, ratio=0.8, exclude_radius=-1)


# -- the contract at the edges (issue 28): finite, within a pixel, masked pixels never read ----

REFINE_MODES = ["parabola", "soft", "features"]


def assert_near_integer(r, index_grid_width):
    """Wherever index >= 0: finite coordinates within one pixel of the integer match."""
    found = r.index >= 0
    assert torch.isfinite(r.coords[found]).all(), "NaN or inf coordinates for a valid match"
    integer = torch.stack((r.index // index_grid_width, r.index % index_grid_width), -1).to(r.coords.dtype)
    assert ((r.coords - integer).abs()[found] <= 1 + 1e-6).all()


@pytest.mark.parametrize("mode", REFINE_MODES)
@pytest.mark.parametrize(("metric", "k"), [("l2", 1), ("cosine", 2), ("dot", 1), ("l1", 1)])
def test_corners_and_edges_of_b(mode, metric, k):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(12, 13, 6, generator=g), torch.randn(12, 13, 6, generator=g)
    a[0, 0], a[-1, -1], a[0, -1] = b[0, 0], b[-1, -1], b[0, -1]  # matches at b's far corners
    r = match(a, b, metric=metric, k=k, refine=mode)
    assert_near_integer(r, 13)


@pytest.mark.parametrize("mode", REFINE_MODES)
@pytest.mark.parametrize("shape", [(7, 9), (1, 1), (1, 9), (7, 1)], ids=str)
def test_constant_and_one_pixel_maps(mode, shape):
    # a constant map, and maps one pixel high, wide or both
    g = torch.Generator().manual_seed(sum(shape))
    b = torch.ones(*shape, 4) if shape == (7, 9) else torch.randn(*shape, 4, generator=g)
    a = torch.randn(5, 6, 4, generator=torch.Generator().manual_seed(0))
    r = match(a, b, metric="l2", refine=mode)
    assert_near_integer(r, b.shape[1])


@pytest.mark.parametrize("mode", REFINE_MODES)
@pytest.mark.parametrize("magnitude", [2.0**100, 2.0**-100])
def test_extreme_magnitudes_refine_as_unit_ones(shifted, mode, magnitude):
    # powers of two (1.3e30, 7.9e-31): exact, so the refinement must give the very same positions
    fa, fb, _, _ = shifted
    fa, fb = fa[20:40, 20:40], fb[18:42, 18:42]
    want = match(fa, fb, metric="l2", refine=mode)
    got = match(fa * magnitude, fb * magnitude, metric="l2", refine=mode)
    assert_near_integer(got, fb.shape[1])
    assert torch.equal(got.index, want.index) and torch.equal(got.coords, want.coords)


@pytest.mark.parametrize("mode", REFINE_MODES)
def test_masked_out_pixels_of_b_are_never_read(shifted, mode):
    fa, fb, _, _ = shifted
    fa, fb = fa[20:44, 20:44].clone(), fb[20:44, 20:44].clone()
    mask = torch.ones(fb.shape[:2], dtype=torch.bool)
    mask[10:14, 6:18] = False
    poisoned = fb.clone()
    poisoned[~mask] = float("nan")
    clean = match(fa, fb, metric="l2", refine=mode, mask_b=mask)
    got = match(fa, poisoned, metric="l2", refine=mode, mask_b=mask)
    assert_near_integer(got, fb.shape[1])
    # what lies under the mask cannot change a coordinate: the same with other values there
    other = fb.clone()
    other[~mask] = 100.0
    assert torch.equal(got.coords, clean.coords)
    assert torch.equal(match(fa, other, metric="l2", refine=mode, mask_b=mask).coords, clean.coords)
