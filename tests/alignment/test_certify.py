"""densematch.certify_alignment: the branch and bound that certifies align's answer, and the
ranges its bound rests on."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch.alignment.certify import bilinear_range, pixel_range, sample_spans
from densematch.kernels import native


def textured(side: int, seed: int) -> torch.Tensor:
    """A smooth random texture (bicubic from a coarse grid of noise), values about 0..1."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 1, side // 2, side // 2, generator=g)
    return torch.nn.functional.interpolate(coarse, size=(side, side), mode="bicubic", align_corners=False)[0, 0]


def pair(side: int, size: int, warp_args: tuple[float, ...], seed: int = 0, channels: int = 0):
    img = textured(side, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tpl = densematch.warp(img, *warp_args, (size, size)) + 0.01 * torch.randn(size, size, generator=g)
    if channels:  # one pair of two channels (align's (1, C, h, w)): the second brightened and halved
        img, tpl = torch.stack((img, 0.5 * img + 0.2))[None], torch.stack((tpl, 0.5 * tpl + 0.2))[None]
    return tpl, img


@pytest.mark.parametrize(("objective", "channels"), [("l1", 0), ("l2", 0), ("l1", 2)])
def test_a_translation_is_certified_and_a_shifted_answer_is_not(objective, channels):
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6), channels=channels)
    fixed = {"scale_h": (1.0, 1.0), "scale_w": (1.0, 1.0)}
    a = densematch.align(tpl, img, objective=objective, **fixed)
    cert = densematch.certify_alignment(tpl, img, a, objective=objective, **fixed)
    assert cert.certified and cert.reason == "" and len(cert.cells_left) == 0
    assert cert.within == (0.015, 0.015, 1.5, 1.5)  # the default near
    assert cert.error == pytest.approx(a.error, rel=1e-5)
    # 4 px off: the truth's fits beat it; the first cell whose centre does ends the search
    wrong = dataclasses.replace(a, shift_x=a.shift_x - 4)
    cert = densematch.certify_alignment(tpl, img, wrong, objective=objective, **fixed)
    assert not cert.certified and cert.reason.startswith("a better fit lies at (")
    residual = densematch.warp(img, *cert.better_fit, tuple(tpl.shape[-2:])) - tpl
    better = residual.abs().mean() if objective == "l1" else residual.square().mean()
    assert float(better) < cert.error * (1 - 1e-9)  # better indeed, by the warp itself
    assert cert.better_fit[:2] == (1.0, 1.0) and all(0 <= v <= 44 - 32 for v in cert.better_fit[2:])  # a fit searched
    truth = torch.tensor([1.0, 1.0, 7.3, 4.6], dtype=torch.float64)
    half = torch.tensor([0.0, 0.0, *[cert.cell_size[1]] * 2], dtype=torch.float64)
    assert ((cert.cells_left - truth).abs() <= half + 1e-9).all(1).any()
    # what is shown all the same: better fits, the truth's among them, lie within reach
    offset = (truth - torch.tensor([wrong.scale_h, wrong.scale_w, wrong.shift_y, wrong.shift_x])).abs()
    assert (offset <= torch.tensor(cert.within, dtype=torch.float64)).all() and cert.within[3] >= 3.5


def test_a_stretch_is_certified():
    tpl, img = pair(34, 32, (1.01, 0.99, 1.3, 0.6), seed=3)
    ranges = {"scale_h": (0.98, 1.04), "scale_w": (0.96, 1.02)}
    a = densematch.align(tpl, img, **ranges)
    cert = densematch.certify_alignment(tpl, img, a, **ranges)
    assert cert.certified, cert.reason
    assert cert.cells_examined > 0 and cert.seconds > 0


def test_out_of_time_is_not_certified():
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    a = densematch.align(tpl, img)
    cert = densematch.certify_alignment(tpl, img, a, time_limit=0.0)
    assert not cert.certified and cert.reason == "out of time after 0 s"
    assert len(cert.cells_left) > 0  # the cells not reached are left, not dropped


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"objective": "ncc"}, ValueError, "objective must be one of"),
        ({"scale_h": (1.2, 0.8)}, ValueError, "scale_h must be a pair"),
        ({"near": (0.01, -1.0)}, ValueError, "near must be a pair"),
        ({"template": torch.rand(1, 3, 32, 32)}, ValueError, r"image must have the template's layout \(4 dims"),
        # align's own checks: it refuses each of these, so certifying them certified nonsense
        ({"template": torch.full((32, 32), math.nan)}, ValueError, "template must hold only finite values"),
        ({"image": torch.full((44, 44), math.inf)}, ValueError, "image must hold only finite values"),
        ({"template": torch.rand(60, 60)}, ValueError, "does not fit in the image"),
        ({"time_limit": math.nan}, ValueError, r"time_limit must be in \[0, inf\], got nan"),
        ({"time_limit": -1}, ValueError, r"time_limit must be in \[0, inf\], got -1"),
        ({"time_limit": True}, TypeError, "time_limit must be a real number, got bool"),
        ({"alignment": {"scale_h": math.nan, "scale_w": 1, "shift_y": 0, "shift_x": 0}}, ValueError, "positive finite"),
        ({"template": torch.rand(2, 32, 32), "image": torch.rand(2, 44, 44)}, ValueError, "a batch of 2"),
        ({"alignment": "a"}, TypeError, r"the Alignment densematch.align returned \(or its as_dict\(\)\), got str"),
        ({"alignment": {"scale_h": 1.0}}, TypeError, "got dict"),
    ],
)
def test_bad_input_is_named(change, error, message):
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    a = densematch.align(tpl, img)
    args = {"template": tpl, "image": img, "alignment": a, **change}
    with pytest.raises(error, match=message):
        densematch.certify_alignment(args.pop("template"), args.pop("image"), args.pop("alignment"), **args)


@pytest.mark.parametrize("where", ["template", "image"])
def test_one_nan_is_refused_as_align_refuses_it(where):
    # it certified an answer 15 px off: NaN compares false with every bound, so no cell survived
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    a = densematch.align(tpl, img)
    wrong = {**a.as_dict(), "shift_y": a.shift_y + 15.0}
    inputs = {"template": tpl.clone(), "image": img.clone()}
    inputs[where][5, 7] = math.nan
    with pytest.raises(ValueError, match=f"{where} must hold only finite values"):
        densematch.align(inputs["template"], inputs["image"])
    with pytest.raises(ValueError, match=f"{where} must hold only finite values"):
        densematch.certify_alignment(inputs["template"], inputs["image"], wrong)


def test_a_batch_of_one_is_one_pair_and_a_batch_of_two_is_refused():
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    fixed = {"scale_h": (1.0, 1.0), "scale_w": (1.0, 1.0)}
    one = densematch.align(tpl[None], img[None], **fixed)
    assert densematch.certify_alignment(tpl[None], img[None], one, **fixed).certified
    assert densematch.certify_alignment(tpl, img, one.as_dict(), **fixed).certified  # its lists of one
    two = densematch.align(torch.stack((tpl, tpl)), torch.stack((img, img)), **fixed)
    for answer in (two, two.as_dict()):
        with pytest.raises(TypeError, match="certify each pair of a batch on its own"):
            densematch.certify_alignment(tpl, img, answer, **fixed)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    scale=st.tuples(st.floats(0.8, 1.2), st.floats(0.8, 1.2)),
    ds=st.sampled_from([0.0, 1e-4, 0.003, 0.02]),
    dt=st.sampled_from([0.0, 0.01, 0.3, 2.0]),
)
def test_the_ranges_hold_every_warp_of_the_cell(seed, scale, ds, dt):
    # the bound's foundation: at any parameters inside a cell, every template pixel's sample lies
    # within the interpolant's exact range over its box, which lies within the whole pixels'
    # cells place the template's pixel `pivot` (anywhere: its middle in certify_alignment) at
    # centre (cy, cx): the fit (s, c) is the shift (c + 0.5) s - pivot - 0.5
    img = textured(30, seed).double()
    g = torch.Generator().manual_seed(seed)
    h = w = 16
    py, px = (float(v) for v in torch.rand(2, generator=g) * 15)
    sh, sw = (torch.tensor([s], dtype=torch.float64) for s in scale)
    cy, cx = (torch.rand(1, generator=g, dtype=torch.float64) * 20 + 5 for _ in range(2))
    ys = sample_spans(torch.arange(h), 30, sh, cy, ds, dt, pivot=py)
    xs = sample_spans(torch.arange(w), 30, sw, cx, ds, dt, pivot=px)
    lo, hi = bilinear_range(img, ys, xs)
    wide_lo, wide_hi = pixel_range(img, ys, xs)
    assert (wide_lo <= lo + 1e-12).all() and (hi <= wide_hi + 1e-12).all()

    def shift(s: torch.Tensor, c: torch.Tensor, p: float) -> float:
        return float((c + 0.5) * s - p - 0.5)

    for u in torch.rand(8, 4, generator=g, dtype=torch.float64) * 2 - 1:
        s_h, s_w = sh + ds * u[0], sw + ds * u[1]
        params = (float(s_h), float(s_w), shift(s_h, cy + dt * u[2], py), shift(s_w, cx + dt * u[3], px))
        v = densematch.warp(img, *params, (h, w))
        assert (lo[0] - 1e-12 <= v).all() and (v <= hi[0] + 1e-12).all()
    if ds == dt == 0:  # a cell of one point: the range is its warp
        v = densematch.warp(img, float(sh), float(sw), shift(sh, cy, py), shift(sw, cx, px), (h, w))
        torch.testing.assert_close(lo[0], v, rtol=0, atol=1e-12)
        torch.testing.assert_close(hi[0], v, rtol=0, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    half=st.sampled_from([(0.02, 0.02, 2.0, 2.0), (0.005, 0.0, 0.5, 0.3), (0.0003, 0.0003, 0.03, 0.03)]),
    exact=st.booleans(),
    squared=st.booleans(),
)
def test_the_c_bound_is_torchs_sum_and_stops_past_the_line(seed, half, exact, squared):
    # certify.c against the torch ranges it replaces, over two channels and cells anywhere
    # (clamped at the image's edges included); stopped, a sum is partial but past the line
    g = torch.Generator().manual_seed(seed)
    img = torch.stack((textured(40, seed), textured(40, seed + 1))).double()
    tpl = torch.rand(2, 24, 20, generator=g, dtype=torch.float64)
    m = 30
    cells = torch.cat([0.8 + 0.4 * torch.rand(m, 2, generator=g), 30 * torch.rand(m, 2, generator=g) - 5], 1)
    cells = cells.double()
    rows = torch.randperm(24, generator=g)
    pivot = (11.5, 3.0)
    ys = sample_spans(torch.arange(24), 40, cells[:, 0], cells[:, 2], half[0], half[2], pivot=pivot[0])
    xs = sample_spans(torch.arange(20), 40, cells[:, 1], cells[:, 3], half[1], half[3], pivot=pivot[1])
    want = torch.zeros(m, dtype=torch.float64)
    for ch in range(2):
        lo, hi = (bilinear_range if exact else pixel_range)(img[ch], ys, xs)
        gap = (lo - tpl[ch]).clamp_min(0) + (tpl[ch] - hi).clamp_min(0)
        want += (gap.square() if squared else gap).sum((1, 2))
    full = native.certify_bound(img, tpl, cells, half, rows, pivot=pivot, exact=exact, squared=squared, stop=math.inf)
    torch.testing.assert_close(full, want, rtol=1e-12, atol=1e-12)
    stop = float(want.median())
    part = native.certify_bound(img, tpl, cells, half, rows, pivot=pivot, exact=exact, squared=squared, stop=stop)
    past = full > stop
    assert (part[past] > stop).all() and (part[past] <= full[past] * (1 + 1e-12)).all()
    torch.testing.assert_close(part[~past], full[~past], rtol=0, atol=0)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    half=st.sampled_from([(0.02, 0.02, 2.0, 2.0), (0.005, 0.0, 0.5, 0.3), (0.0006, 0.0006, 0.06, 0.06)]),
    exact=st.sampled_from([(False, True), (True, True), (False, False)]),
    squared=st.booleans(),
)
def test_a_childs_rows_start_from_its_parents(seed, half, exact, squared):
    # a cell inside another samples each pixel from a box inside the other's: each of its rows'
    # sums is at least the parent's (whole pixels or exact, the child's range no wider), so the
    # parent's sums per row are floors: with them a sum stops past the line, or is the whole sum
    g = torch.Generator().manual_seed(seed)
    img = torch.stack((textured(40, seed), textured(40, seed + 1))).double()
    tpl = torch.rand(2, 24, 20, generator=g, dtype=torch.float64)
    parents = torch.cat([0.8 + 0.4 * torch.rand(8, 2, generator=g), 30 * torch.rand(8, 2, generator=g) - 5], 1)
    parents = parents.double()
    signs = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0], dtype=torch.float64)] * 4)
    small = tuple(v / 2 for v in half)
    cells = (parents[:, None] + signs * torch.tensor(small, dtype=torch.float64)).reshape(-1, 4)
    rows = torch.randperm(24, generator=g)
    kw = {"pivot": (11.5, 3.0), "squared": squared}
    floors = torch.empty(8, 24, dtype=torch.float64)
    native.certify_bound(img, tpl, parents, half, rows, exact=exact[0], stop=math.inf, row_sums=floors, **kw)
    floors = floors.repeat_interleave(16, 0)
    per_row = torch.empty(128, 24, dtype=torch.float64)
    full = native.certify_bound(img, tpl, cells, small, rows, exact=exact[1], stop=math.inf, row_sums=per_row, **kw)
    torch.testing.assert_close(per_row.sum(1), full, rtol=1e-12, atol=1e-12)
    assert (per_row >= floors * (1 - 1e-12) - 1e-12).all()
    stop = float(full.median())
    sums = torch.empty(128, 24, dtype=torch.float64)
    part = native.certify_bound(
        img, tpl, cells, small, rows, exact=exact[1], stop=stop, floors=floors, row_sums=sums, **kw
    )
    past = full > stop
    assert (part[past] > stop).all() and (part[past] <= full[past] * (1 + 1e-12)).all()
    torch.testing.assert_close(part[~past], full[~past], rtol=1e-12, atol=1e-12)
    # each row its own sum where reached, its floor where not
    reached = sums != floors
    assert torch.equal(sums[reached], per_row[reached]) and torch.equal(sums[~reached], floors[~reached])
    assert torch.equal(sums[~past], per_row[~past])  # a cell not stopped reaches every row


@pytest.mark.parametrize("objective", ["l1", "l2"])
def test_c_and_torch_reach_the_same_verdict_and_cells(objective):
    # the default path (C) and torch's (kernel="torch") rule out the same cells: same certificate
    tpl, img = pair(34, 24, (1.02, 0.97, 3.2, 5.7), seed=6)
    ranges = {"scale_h": (1.0, 1.04), "scale_w": (0.96, 1.0)}
    a = densematch.align(tpl, img, objective=objective, **ranges)
    wrong = dataclasses.replace(a, shift_y=a.shift_y + 3)
    for answer in (a, wrong):
        args = {"objective": objective, "finest": (0.004, 0.4), "near": (0.07, 1.5), **ranges}
        c_path = densematch.certify_alignment(tpl, img, answer, **args)
        with densematch.config_context(kernel="torch"):
            torch_path = densematch.certify_alignment(tpl, img, answer, **args)
        assert c_path.certified == torch_path.certified and c_path.cells_examined == torch_path.cells_examined
        assert torch.equal(c_path.cells_left, torch_path.cells_left) and c_path.within == torch_path.within
        assert (c_path.better_fit is None) == (torch_path.better_fit is None) == (answer is a)
        scales = c_path.cells_left[:, :2] - torch.tensor([1.02, 0.98], dtype=torch.float64)
        assert (scales.abs() <= 0.02 + c_path.cell_size[0] + 1e-9).all()  # none beyond the ranges
        assert c_path.certified == (answer is a), c_path.reason  # a 24-pixel template pins scales loosely


def _wrong_first(monkeypatch, pairs_off: tuple[int, ...], by: float = 4.0) -> None:
    """align's search hands back the answers of ``pairs_off`` moved ``by`` px along x: a first
    answer in the wrong basin, as the coarse grid gave on the mask pair of issue 41."""
    from densematch.alignment import api

    real = api._search_pairs

    def search(*args, **kwargs):
        found = real(*args, **kwargs)
        for i in pairs_off:
            found.shift_x[i] -= by
        return found

    monkeypatch.setattr(api, "_search_pairs", search)


def test_certify_true_ends_certified_at_the_truth_from_a_wrong_first_answer(monkeypatch):
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    fixed = {"scale_h": (1.0, 1.0), "scale_w": (1.0, 1.0)}
    _wrong_first(monkeypatch, (0,))
    assert densematch.align(tpl, img, **fixed).shift_x == pytest.approx(0.6, abs=0.05)  # wrong, silently
    a = densematch.align(tpl, img, certify=True, **fixed)
    assert a.certificate.certified and a.certificate.reason == ""
    assert (a.shift_y, a.shift_x) == pytest.approx((7.3, 4.6), abs=0.05)
    assert a.error == pytest.approx(a.certificate.error, rel=1e-4)
    torch.testing.assert_close(a.warped, densematch.warp(img, 1.0, 1.0, a.shift_y, a.shift_x, (32, 32)))


def test_certify_true_out_of_time_says_so_with_within():
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    a = densematch.align(tpl, img, certify=True, time_limit=0.0)
    cert = a.certificate
    assert not cert.certified and cert.reason == "out of time after 0 s"
    assert len(cert.within) == 4 and all(w > 0 for w in cert.within)


def test_certify_true_gives_each_pair_of_a_batch_its_own_certificate(monkeypatch):
    (t0, x0), (t1, x1) = pair(44, 32, (1.0, 1.0, 7.3, 4.6)), pair(44, 32, (1.0, 1.0, 3.2, 8.9), seed=5)
    fixed = {"scale_h": (1.0, 1.0), "scale_w": (1.0, 1.0)}
    _wrong_first(monkeypatch, (1,))  # the hard pair: its first answer in the wrong basin
    a = densematch.align(torch.stack((t0, t1)), torch.stack((x0, x1)), certify=True, **fixed)
    assert [c.certified for c in a.certificate] == [True, True]
    assert a.shift_x.tolist() == pytest.approx([4.6, 8.9], abs=0.05)
    assert a.shift_y.tolist() == pytest.approx([7.3, 3.2], abs=0.05)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"objective": "ncc"}, ValueError, "certify=True needs objective 'l1' or 'l2'"),
        ({"template_mask": torch.ones(32, 32)}, ValueError, "certify=True does not take template_mask"),
        ({"time_limit": -1.0}, ValueError, r"time_limit must be in \[0, inf\]"),
    ],
)
def test_certify_true_refuses_what_it_cannot_certify(kwargs, error, pattern):
    tpl, img = pair(44, 32, (1.0, 1.0, 7.3, 4.6))
    with pytest.raises(error, match=pattern):
        densematch.align(tpl, img, certify=True, **kwargs)
    with pytest.raises(TypeError, match="certify must be True or False"):
        densematch.align(tpl, img, certify="yes")


@pytest.mark.parametrize("kind", ["mask", "photo"])
def test_the_search_is_global_by_the_certificates_word(kind):
    # issue 41's oracle: over the whole default scale range, no fit better than align's answer
    # lies outside its neighbourhood, on masks (where a coarse level once dropped the true basin)
    # and photographs; three template sizes, with and without noise
    from densematch.app.synthetic import alignment_cases

    photos = ("camera", "astronaut", "coins", "brick")
    cases = list(alignment_cases(6, seed=11, kinds=(kind,), noise=(0.0, 0.02), scale_range=(0.8, 1.2), photos=photos))
    for case in cases:
        a = densematch.align(case.template, case.image)
        cert = densematch.certify_alignment(case.template, case.image, a)
        assert cert.certified and cert.better_fit is None, (case.source, case.noise, cert.reason)
