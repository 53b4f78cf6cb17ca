import math

import numpy as np
import pytest
import torch

from densematch import align, config_context, warp
from densematch import shift_landscape as densematch_shift_landscape
from densematch.alignment.refine import refine
from densematch.alignment.search import _best_shifts, candidate_rule, pick_candidates
from densematch.app.synthetic import PHOTOS, SIZES, alignment_cases, reference_warp
from densematch.kernels import native, ops_for

from .._threads import torch_threads

needs_c = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")


def _grid_operands(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple:
    """Random t (B, C, h, w) and x (B, C, H, W) of ``shape``, and a grid's Ry, Rx, Rx's taps and
    shifts over scales 0.8-1.2 and 0.7-1.3, for the grid kernels' tests."""
    from densematch.alignment.search import scale_grid
    from densematch.alignment.warp import bilinear_taps, sampling_matrix

    b, c, h, w, big_h, big_w = shape
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(b, c, h, w, generator=gen, dtype=dtype)
    x = torch.rand(b, c, big_h, big_w, generator=gen, dtype=dtype)
    gh, gw = scale_grid(0.8, 1.2, h, x.device, dtype), scale_grid(0.7, 1.3, w, x.device, dtype)
    rows, cols = int(big_h * gh.max()), int(big_w * gw.max())
    ry = sampling_matrix(rows, big_h, gh, torch.zeros_like(gh))
    rx = sampling_matrix(cols, big_w, gw, torch.zeros_like(gw))
    taps = bilinear_taps(cols, big_w, gw, torch.zeros_like(gw))
    return t, x, ry, rx, taps, (rows - h + 1, cols - w + 1)


def within(a, case, scale_tol=0.005, shift_tol=0.5) -> bool:
    return (
        abs(a.scale_h - case.scale_h) <= scale_tol
        and abs(a.scale_w - case.scale_w) <= scale_tol
        and abs(a.shift_y - case.shift_y) <= shift_tol
        and abs(a.shift_x - case.shift_x) <= shift_tol
    )


class TestWarp:
    def test_python_numbers_keep_a_float64_images_precision(self):
        # a Python float went through torch's default float32 on its way to the image's dtype
        img = torch.rand(30, 30, dtype=torch.float64)
        params = (1.0123456789012, 0.9876543210987, 2.123456789012, 3.987654321098)
        exact = warp(img, *(torch.tensor(p, dtype=torch.float64) for p in params), (20, 20))
        assert torch.equal(warp(img, *params, (20, 20)), exact)

    def test_integer_crop_equals_interpolate(self):
        img = torch.rand(37, 41)
        ref = torch.nn.functional.interpolate(img[None, None], scale_factor=(1.17, 0.86), mode="bilinear")
        torch.testing.assert_close(warp(img, 1.17, 0.86, 5, 3, (20, 25)), ref[0, 0, 5:25, 3:28])

    def test_fractional_shift_equals_grid_sample(self):
        img = torch.rand(30, 30)
        out = warp(img, 0.91, 1.13, 2.37, 4.81, (22, 24))
        torch.testing.assert_close(out, reference_warp(img, 0.91, 1.13, 2.37, 4.81, (22, 24)))


class TestAlign:
    def test_recovers_known_warps_of_photos_and_masks(self):
        # every size of the brief, photographs and ellipse masks, with and without noise
        cases = list(alignment_cases(24, seed=123))
        hits = [within(align(c.template, c.image), c) for c in cases]
        assert sum(hits) >= 23, hits

    def test_result_fields(self):
        c = next(alignment_cases(1, seed=4, kinds=("mask",)))
        a = align(c.template, c.image)
        assert isinstance(a.scale_h, float) and a.warped.shape == c.template.shape
        expected = (a.warped - c.template).abs().mean().item()
        assert a.error == pytest.approx(expected, abs=1e-6)
        again = warp(c.image, a.scale_h, a.scale_w, a.shift_y, a.shift_x, tuple(c.template.shape))
        torch.testing.assert_close(a.warped, again)
        assert a.landscape.shape == (1, a.scales_h.numel(), a.scales_w.numel())
        assert set(a.as_dict()) == {"scale_h", "scale_w", "shift_y", "shift_x", "error", "relative_error", "at_bound"}

    @pytest.mark.parametrize("objective", ["l2", "ncc"])
    def test_other_objectives(self, objective):
        c = next(alignment_cases(1, seed=8, kinds=("photo",)))
        tpl = c.template * 0.6 + 0.25 if objective == "ncc" else c.template  # brightness and contrast
        a = align(tpl, c.image, objective=objective)
        assert within(a, c) and 0.0 <= a.error < 0.05

    def test_mask_ignores_an_occluded_region(self):
        c = next(alignment_cases(1, seed=9, kinds=("photo",), sizes=(SIZES[0],), noise=(0.0,)))
        tpl = c.template.clone()
        tpl[20:70, 10:60] = 1.0  # an occluder
        mask = torch.ones_like(tpl)
        mask[20:70, 10:60] = 0
        assert within(align(tpl, c.image, template_mask=mask), c)

    @pytest.mark.parametrize("weight", [1e-16, 1e-30, 1e20])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("objective", ["l1", "l2", "ncc"])
    def test_uniform_weights_of_any_size_are_no_weights(self, weight, dtype, objective):
        # only the weights' ratios matter; weights of 1e-16 or less broke every objective
        c = next(alignment_cases(1, seed=9, kinds=("photo",), sizes=(SIZES[0],), noise=(0.0,)))
        tpl, img = c.template.to(dtype), c.image.to(dtype)
        free = align(tpl, img, objective=objective)
        weighted = align(
            tpl, img, objective=objective, template_mask=torch.full(tpl.shape, weight, dtype=torch.float64)
        )
        assert within(weighted, c)
        for field in ("scale_h", "scale_w", "shift_y", "shift_x"):
            assert getattr(weighted, field) == pytest.approx(getattr(free, field), abs=1e-3)

    def test_nan_and_inf_under_a_zero_weight_are_never_read(self):
        # docs/design.md: NaN or Inf are refused only where a mask lets the pixel be read
        c = next(alignment_cases(1, seed=9, kinds=("photo",), sizes=(SIZES[0],), noise=(0.0,)))
        tpl, mask = c.template.clone(), torch.ones_like(c.template)
        tpl[20:30, 10:20], mask[20:30, 10:20] = math.inf, 0.0
        tpl[0, 0], mask[0, 0] = math.nan, 0.0
        a = align(tpl, c.image, template_mask=mask)
        assert within(a, c) and math.isfinite(a.error)
        mask[0, 0] = 0.5  # read now
        with pytest.raises(ValueError, match="template must hold only finite values"):
            align(tpl, c.image, template_mask=mask)

    def test_a_wide_scale_range_keeps_to_memory_or_says_so(self):
        # the valid shifts of every scale pair were built whole: (0.8, 20) tried 52.6 GB and
        # failed with a RuntimeError; now the search's own matrices count against the budget
        c = next(alignment_cases(1, seed=9, kinds=("photo",), sizes=(SIZES[0],), noise=(0.0,)))
        with pytest.raises(
            ValueError,
            match=r"memory=67108864 bytes cannot hold the search of one scale pair .* "
            r"stretched up to \(20, 20\), beside its sampling matrices.*narrow the scale ranges",
        ):
            align(c.template, c.image, scale_h=(0.8, 20), scale_w=(0.8, 20), memory="64MiB")

    @pytest.mark.parametrize("level", [0.0, 500.0])
    def test_texture_on_a_large_level(self, level):
        # white noise on a level of 500 missed: the grid's expanded sums lost it to rounding
        g = torch.Generator().manual_seed(0)
        image = torch.rand(125, 125, generator=g) + level
        truth = (1.03, 0.98, 7.2, 5.6)
        a = align(warp(image, *truth, (100, 100)), image)
        assert (a.scale_h, a.scale_w, a.shift_y, a.shift_x) == pytest.approx(truth, abs=2e-3)

    @pytest.mark.parametrize(
        ("period", "truths"),
        [
            (5, ((1.05, 0.97, 6.3, 9.7), (0.93, 1.08, 3.1, 4.4))),
            (6, ((1.05, 0.97, 6.3, 9.7), (0.93, 1.08, 3.1, 4.4))),
            (7, ((1.05, 0.97, 6.3, 9.7), (0.93, 1.08, 3.1, 4.4))),
            # warped, these leave beats of lower frequency, enough for the factor 2's Nyquist
            # rule alone: the grid ran there, two samples a period, and missed (error 0.44-0.71)
            (3, ((0.859, 1.09, 5.177, 8.035),)),
            (4, ((1.099, 0.863, 2.197, 4.071), (1.147, 0.937, 9.0, 6.047))),
        ],
    )
    def test_a_periodic_texture_finer_than_the_coarse_level(self, period, truths):
        # a block mean of 4 keeps only aliases of these: the grid ran on them and missed
        # (error 0.2-0.9 where the truth gives 1e-6); the grid now runs where the level resolves
        # some content. Any whole period away is as good a fit, so the error is what is checked
        yy, xx = torch.meshgrid(torch.arange(125.0), torch.arange(135.0), indexing="ij")
        image = torch.sin(2 * math.pi * xx / period) + torch.sin(2 * math.pi * yy / period)
        for truth in truths:
            a = align(warp(image, *truth, (100, 100)), image)
            assert a.error < 1e-3, (truth, a.as_dict())

    @needs_c
    def test_the_level_rules_share_in_c_is_numpys(self):
        # the C search takes the level rule's sums in C: the same shares as numpy's (other sums'
        # orders), so the same levels, on photographs, masks, colour batches and a periodic texture
        from densematch.alignment.api import _levels, _low_band

        cases = list(alignment_cases(3, seed=21, sizes=(SIZES[0],)))
        t = torch.stack([c.template for c in cases])[:, None]
        yy, xx = torch.meshgrid(torch.arange(100.0), torch.arange(90.0), indexing="ij")
        g = torch.Generator().manual_seed(4)
        texture = (torch.sin(2 * math.pi * xx / 4) + torch.sin(2 * math.pi * yy / 3))[None, None]
        mask = (torch.rand(1, 1, 100, 100, generator=g) > 0.3).float()
        operands = [
            (t[:1], None),
            (t, None),
            (t.expand(3, 3, 100, 100) * torch.rand(1, 3, 1, 1, generator=g), mask.expand(3, 1, 100, 100)),
            (t, torch.rand(3, 1, 100, 100, generator=g)),
            (t.double(), None),
            (texture, None),
        ]
        for v, m in operands:
            by_numpy, by_c = _low_band(v, m), _low_band(v, m, True)
            for f in (8, 4, 2, 1):
                assert by_c(f) == pytest.approx(by_numpy(f), rel=1e-12)
            assert _levels(v, m, True) == _levels(v, m)
        assert _levels(texture, None, True) == [1]  # period 3 and 4: no coarse level keeps it

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    @pytest.mark.parametrize("objective", ["l1", "ncc"])
    @pytest.mark.parametrize("threads", [1, 2])
    def test_nan_or_inf_anywhere_is_refused_on_either_path(self, kernel, objective, threads):
        # C's search checks both images itself, first thing; torch's path before it starts; on
        # two threads the three pairs go out in shares, after what the batch computes for them
        g = torch.Generator().manual_seed(2)
        t, x = torch.rand(3, 2, 30, 30, generator=g), torch.rand(3, 2, 40, 40, generator=g)
        with config_context(kernel=kernel), torch_threads(threads):
            for name, v, at in (("template", t, (2, 1, 29, 29)), ("image", x, (1, 0, 17, 3))):
                for bad in (math.nan, math.inf, -math.inf):
                    spoiled = v.clone()
                    spoiled[at] = bad
                    pair = (spoiled, x) if name == "template" else (t, spoiled)
                    with pytest.raises(ValueError, match=f"{name} must hold only finite values"):
                        align(*pair, objective=objective)
                    if name == "image":  # a mask: the template's check is the mask's, the image's still C's
                        with pytest.raises(ValueError, match="image must hold only finite values"):
                            align(*pair, objective=objective, template_mask=torch.ones(30, 30))
            assert math.isfinite(float(align(t, x, objective=objective).error[0]))

    def test_batches_and_channels(self):
        cases = list(alignment_cases(3, seed=10, sizes=(SIZES[0],)))
        t = torch.stack([c.template for c in cases])
        x = torch.stack([c.image for c in cases])
        a = align(t, x, memory="8MiB")  # forces one pair per chunk of the search
        assert a.scale_h.shape == (3,) and a.warped.shape == t.shape
        for i, c in enumerate(cases):
            single = align(c.template, c.image)
            assert abs(single.scale_h - a.scale_h[i].item()) < 1e-4
            assert abs(single.shift_x - a.shift_x[i].item()) < 1e-2
        rgb = align(
            t[:, None].expand(3, 3, 100, 100), x[:, None].expand(3, 3, 125, 125), template_mask=torch.ones(3, 100, 100)
        )
        assert torch.allclose(rgb.scale_w, a.scale_w, atol=1e-4) and rgb.warped.shape == (3, 3, 100, 100)

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    def test_a_batch_shared_over_threads_is_searched_as_one_as_on_one_thread(self, kernel, monkeypatch):
        # a smooth photograph's template alone takes a coarser pyramid than a noise texture's;
        # shared out one pair a worker, each share once took its own, and their landscapes (9 x 9
        # and 15 x 15 scales) could not be joined. The noise pair, 8x brighter, also has its own
        # unit amplitude (torch's path searches a share at one unit: now the batch's)
        from skimage import data

        from densematch.alignment import api
        from densematch.alignment.api import _levels

        cam = torch.as_tensor(data.camera(), dtype=torch.float32)[None, None] / 255
        noise = 8 * torch.rand(1, 1, 160, 160, generator=torch.Generator().manual_seed(0))
        img = torch.cat([cam[:, :, 100:260, 100:260], noise])
        tpl = img[:, :, 30:130, 40:140].clone()
        assert _levels(tpl[:1], None) != _levels(tpl[1:], None)
        assert api._batch_unit(tpl, img) == api._centred(tpl, img)[3] != api._centred(tpl[:1], img[:1])[3]
        units = []
        centred = api._centred

        def spy(t4, x4, unit=None):
            out = centred(t4, x4, unit)
            units.append(out[3])
            return out

        monkeypatch.setattr(api, "_centred", spy)
        with config_context(kernel=kernel):
            with torch_threads(2):
                two = align(tpl, img)
            # one unit for every share where torch's steps search (C's own is each pair's, and
            # its shares centre nothing in torch where its grid has taps)
            assert len(set(units)) == 1 if kernel == "torch" else len(set(units)) <= 1, units
            with torch_threads(1):
                one = align(tpl, img)
        for field in ("scale_h", "scale_w", "shift_y", "shift_x", "error", "landscape", "warped"):
            assert torch.equal(getattr(two, field), getattr(one, field)), field

    def test_memory_bounds_the_search_in_chunks(self):
        from densematch.alignment.search import downsample, grid_search, scale_grid

        cases = list(alignment_cases(2, seed=13, sizes=(SIZES[0],)))
        t = torch.stack([c.template for c in cases])
        x = torch.stack([c.image for c in cases])
        free = align(t, x)
        tight = align(t, x, memory="1500KiB")  # the grid one pair at a time
        for field in ("scale_h", "scale_w", "shift_y", "shift_x"):
            torch.testing.assert_close(getattr(tight, field), getattr(free, field))
        torch.testing.assert_close(tight.landscape, free.landscape)
        # the grid alone (the coarse level's 25x25 in 31x31): a few scale rows at a time, then a
        # few scale pairs, with and without the C kernels, against one chunk (the budgets hold
        # the sampling matrices, about 80 KiB, beside the chunks)
        tc, xc = downsample(t[:, None], 4), downsample(x[:, None], 4)
        grid = scale_grid(0.8, 1.2, 25, x.device, x.dtype)
        for in_c in (False, ops_for(True, x.device, x.dtype).c):  # and C where it runs
            whole = grid_search(tc, xc, None, grid, grid, False, 2**30, in_c)
            for budget in (190 * 2**10, 110 * 2**10):
                torch.testing.assert_close(grid_search(tc, xc, None, grid, grid, False, budget, in_c), whole)
        with pytest.raises(ValueError, match=r"memory=1048576 bytes cannot hold the refinement of one candidate"):
            align(t, x, memory="1MiB")
        with pytest.raises(ValueError, match=r"memory=8192 bytes cannot hold the search of one scale pair"):
            align(t, x, memory="8KiB")

    def test_integer_and_numpy_images(self):
        c = next(alignment_cases(1, seed=11, kinds=("photo",), noise=(0.0,)))
        as_u8 = lambda v: (v.clamp(0, 1) * 255).round().to(torch.uint8).numpy()  # noqa: E731
        a = align(as_u8(c.template), as_u8(c.image))
        assert within(a, c, 0.005, 0.5)
        assert isinstance(as_u8(c.template), np.ndarray)

    def test_scale_ranges_are_respected(self):
        c = next(alignment_cases(1, seed=12, kinds=("photo",)))
        with pytest.warns(UserWarning, match=r"scale_w lies at an end of the range searched \(scale_w=\(0.9, 0.95\)\)"):
            a = align(c.template, c.image, scale_h=(c.scale_h, c.scale_h), scale_w=(0.9, 0.95))
        assert a.scale_h == pytest.approx(c.scale_h, abs=1e-6) and 0.9 - 1e-6 <= a.scale_w <= 0.95 + 1e-6
        # a range of one value is fixed, not a bound the truth may lie beyond
        assert a.at_bound == ("scale_w",)

    def test_at_bound_per_item_of_a_batch(self):
        img = torch.rand(2, 90, 90)
        t = torch.stack([warp(img[0], 1.0, 1.0, 3.0, 2.0, (64, 64)), warp(img[1], 1.25, 1.0, 3.0, 2.0, (64, 64))])
        with pytest.warns(UserWarning, match="widen scale_h="):
            a = align(t, img, scale_h=(0.9, 1.1), scale_w=(0.9, 1.1))
        assert a.at_bound == [(), ("scale_h",)]
        assert a.as_dict()["at_bound"] == [[], ["scale_h"]]
        assert a.scale_h[1] == pytest.approx(1.1, abs=1e-4)


class TestBadInput:
    t, x = torch.rand(20, 20), torch.rand(30, 30)

    @pytest.mark.parametrize(
        ("args", "kwargs", "error", "pattern"),
        [
            ((torch.rand(40, 40), torch.rand(30, 30)), {}, ValueError, "does not fit in the image"),
            ((t, x), {"scale_h": (0.0, 1.2)}, ValueError, "scale_h must be a pair"),
            ((t, x), {"scale_w": (1.2, 0.8)}, ValueError, "scale_w must be a pair"),
            ((t, x), {"scale_w": 1.0}, TypeError, "scale_w must be a pair"),
            ((torch.full((20, 20), float("nan")), x), {}, ValueError, "template must hold only finite"),
            ((t, torch.full((30, 30), float("inf"))), {}, ValueError, "image must hold only finite"),
            ((torch.rand(2, 20, 20), torch.rand(3, 30, 30)), {}, ValueError, "same batch and channels"),
            ((torch.rand(2, 3, 20, 20), torch.rand(2, 1, 30, 30)), {}, ValueError, "same batch and channels"),
            ((torch.rand(20, 20), torch.rand(2, 30, 30)), {}, ValueError, "image must have the template's layout"),
            ((torch.rand(0, 20), x), {}, ValueError, "must not be empty"),
            ((t, x), {"template_mask": torch.ones(10, 10)}, ValueError, "template_mask must have shape"),
            (
                (torch.rand(2, 3, 20, 20), torch.rand(2, 3, 30, 30)),
                {"template_mask": torch.ones(2, 3, 20, 20)},
                ValueError,
                r"template_mask must have shape \(20, 20\) or \(2, 20, 20\), one weight per pixel",
            ),
            ((t, x), {"template_mask": torch.zeros(20, 20)}, ValueError, "template_mask must keep some pixels"),
            ((t, x), {"objective": "l3"}, ValueError, "objective must be one of 'l1', 'l2', 'ncc'"),
            ((t, [1, 2]), {}, TypeError, "image must be a torch.Tensor"),
        ],
    )
    def test_errors(self, args, kwargs, error, pattern):
        with pytest.raises(error, match=pattern):
            align(*args, **kwargs)


def test_a_template_that_cannot_fit_gets_the_bound_that_works():
    # 160 x 0.6 = 96 < 100: the smallest scales must be raised to 100 / 160, not lowered
    with pytest.raises(ValueError, match=r"raise the smallest scales: scale_h from at least 0\.625 \(100 / 160\)"):
        align(torch.rand(100, 100), torch.rand(160, 160), scale_h=(0.6, 1.2), scale_w=(0.6, 1.2))
    r = align(torch.rand(100, 100), torch.rand(160, 160), scale_h=(0.625, 1.2), scale_w=(0.625, 1.2))
    assert r.scale_h >= 0.625
    # swapped: no scale of the range fits, and the message says so
    with pytest.raises(ValueError, match=r"even at the largest scales.*were template and image swapped"):
        align(torch.rand(160, 160), torch.rand(100, 100))


def test_colour_images_are_taken_as_colour_or_told_how():
    # issue 42: an RGB (H, W, 3) pair was read as a batch of H images 3 pixels wide, and refused
    # with "the same batch and channels, got (100,) and (125,)"
    from skimage import data

    img = torch.from_numpy(data.astronaut()[::4, ::4][:125, :125].astype(np.float32) / 255)
    tpl = warp(img.permute(2, 0, 1)[None], 1.05, 0.95, 4.0, 6.5, (100, 100))[0].permute(1, 2, 0)
    with pytest.raises(ValueError, match=r"colour images go as \(1, C, h, w\): pass x.permute\(2, 0, 1\)\[None\]"):
        align(tpl, img)
    r = align(tpl.permute(2, 0, 1)[None], img.permute(2, 0, 1)[None])  # as the message says
    assert abs(r.scale_h[0] - 1.05) < 0.005 and abs(r.shift_x[0] - 6.5) < 0.5


class TestSearch:
    """The pyramid: an exhaustive grid at the coarse level, refinement level by level, in C on a CPU."""

    @pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
    @pytest.mark.parametrize("photometric", [False, True])
    @pytest.mark.parametrize("width", [80, 77, 78])
    def test_the_c_refinement_is_the_torch_iteration(self, photometric, width):
        gen = torch.Generator().manual_seed(3)
        cases = list(alignment_cases(2, seed=21, kinds=("photo",), sizes=(SIZES[1],), noise=(0.02,)))
        # two channels (the second a brightness-shifted copy) and uneven pixel weights; templates
        # cut to widths that leave C's four-column blocks one or two columns over (the same truth)
        t = torch.stack([torch.stack((c.template, 0.5 * c.template + 0.2)) for c in cases])[..., :width]
        x = torch.stack([torch.stack((c.image, 0.5 * c.image + 0.2)) for c in cases])
        mask = torch.rand(2, 1, *t.shape[-2:], generator=gen) + 0.25
        truth = torch.tensor([[c.scale_h, c.scale_w, c.shift_y, c.shift_x] for c in cases])
        owner = torch.tensor([0, 1, 1])
        moved = torch.tensor([[0.01, -0.01, 1.2, -0.7], [-0.012, 0.0, -1.0, 1.0], [0.0, 0.015, 0.5, 0.5]])
        start = truth[owner] + moved
        box = ((0.8, 1.2), (0.8, 1.2))
        p_torch, sums_torch = refine(t, x, mask, owner, start, *box, photometric)
        p_c, sums_c = refine(t, x, mask, owner, start, *box, photometric, in_c=ops_for(True, x.device, x.dtype).c)
        torch.testing.assert_close(p_c, p_torch, atol=2e-3, rtol=0)
        torch.testing.assert_close(sums_c, sums_torch, atol=1e-4, rtol=1e-3)
        assert (p_c - truth[owner]).abs().max() < 0.05  # and both found the truth

    @needs_c
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("shape", [(2, 1, 25, 25, 31, 31), (2, 3, 20, 27, 33, 29), (1, 2, 7, 5, 40, 9)])
    def test_the_c_cross_term_is_the_products(self, dtype, shape):
        # Rx's two taps per output column in C against the dense products and a float64 sum over
        # each window of the stretched image; several lane blocks of row shifts (42 at 7 x 5),
        # channels, template widths that are no multiple of the register block
        from densematch.alignment.search import _cross_by_products

        _b, c, h, w, _, _ = shape
        t, x, ry, rx, taps, (n_y, n_x) = _grid_operands(shape, dtype, sum(shape))
        along_y = torch.einsum("hrH,bcHW->bchrW", ry, x)
        by_c = native.align_cross(along_y.contiguous(), t, taps, (n_y, n_x))
        stretched = torch.einsum("bchrW,wkW->bchwrk", along_y.double(), rx.double())
        windows = stretched.unfold(4, h, 1).unfold(5, w, 1)  # (B, C, nh, nw, n_y, n_x, h, w)
        reference = torch.einsum("bcnmyxrk,bcrk->bnmyx", windows, t.double())
        tol = 1e-4 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(by_c.double(), reference, atol=tol * h * w * c, rtol=0)
        torch.testing.assert_close(by_c, _cross_by_products(t, along_y, rx, (n_y, n_x)), atol=tol * h * w * c, rtol=0)

    @needs_c
    @pytest.mark.parametrize("ncc", [False, True])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("shape", [(2, 1, 25, 25, 31, 31), (2, 3, 20, 27, 33, 29), (1, 2, 7, 5, 40, 9)])
    def test_the_c_scores_are_the_torch_scores(self, shape, dtype, ncc):
        # the grid's scores of uniform weights in one pass of C against the torch path's products
        # and band sums, and the squared error against a float64 sum over each stretched window;
        # row shifts past one vector, channels, images whose last column is a clamped tap
        from densematch.alignment.search import _shift_scores

        b, _c, h, w, _, _ = shape
        t, x, ry, rx, taps, shifts = _grid_operands(shape, dtype, sum(shape) + ncc)
        ones = torch.ones(b, 1, h, w, dtype=dtype)
        args = (t, x, ones, ry, rx, (0, 0), shifts, ncc, True, True)
        by_c, by_torch = _shift_scores(*args, taps), _shift_scores(*args)
        tol = 2e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(by_c, by_torch, atol=tol, rtol=tol)
        if not ncc:
            stretched = torch.einsum("hrH,bcHW,wkW->bchwrk", ry.double(), x.double(), rx.double())
            windows = stretched.unfold(4, h, 1).unfold(5, w, 1)  # (B, C, nh, nw, n_y, n_x, h, w)
            reference = (windows - t.double()[:, :, None, None, None, None]).square().mean((1, 6, 7))
            torch.testing.assert_close(by_c.double(), reference, atol=tol, rtol=tol)

    def test_one_mask_for_a_batch_is_each_pairs_copy(self):
        # a (h, w) mask (or none) is broadcast over the batch, never copied per pair: the C
        # refinement then reads one weight array for every pair; the same answers to the bit
        cases = list(alignment_cases(3, seed=14, sizes=(SIZES[0],)))
        t = torch.stack([c.template for c in cases])
        x = torch.stack([c.image for c in cases])
        mask = torch.ones(100, 100)
        mask[30:60, 20:50] = 0.25
        for kernel in ("auto", "torch"):
            with config_context(kernel=kernel):
                shared = align(t, x, template_mask=mask)
                copied = align(t, x, template_mask=mask.expand(3, 100, 100).clone())
                plain = align(t, x)
                ones = align(t, x, template_mask=torch.ones(3, 100, 100))
            for field in ("scale_h", "scale_w", "shift_y", "shift_x", "error", "warped"):
                assert torch.equal(getattr(shared, field), getattr(copied, field)), (kernel, field)
                torch.testing.assert_close(getattr(plain, field), getattr(ones, field), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("objective", ["l1", "ncc"])
    def test_torch_and_c_give_the_same_alignments(self, objective):
        # the C search (grid, candidates, levels with gain and bias for NCC, warp) against torch's
        cases = list(alignment_cases(4, seed=5))
        for c in cases:
            default = align(c.template, c.image, objective=objective)
            with config_context(kernel="torch"):
                forced = align(c.template, c.image, objective=objective)
            assert within(default, c) and within(forced, c)
            assert abs(default.scale_w - forced.scale_w) < 1e-3 and abs(default.shift_x - forced.shift_x) < 0.02
            # the warp of the answer, C's against torch's products at the same parameters
            at = (default.scale_h, default.scale_w, default.shift_y, default.shift_x)
            torch.testing.assert_close(default.warped, warp(c.image, *at, c.template.shape), atol=1e-5, rtol=0)

    @needs_c
    @pytest.mark.parametrize("ncc", [False, True])
    def test_the_c_grid_is_the_chunked_grid(self, ncc):
        # native.align_grid (the whole grid in one call, nothing but the best shifts kept) against
        # the chunks of torch's products: two pairs, two channels, scale ranges whose largest
        # shifts differ per scale (inf past them). Photographs: the landscape; random values in
        # float64 (no near-tie for the two orders of summation to part): the shifts and candidates
        from densematch.alignment.search import downsample, grid_search, scale_grid

        cases = list(alignment_cases(2, seed=8, kinds=("photo",), sizes=(SIZES[0],)))
        t = downsample(torch.stack([c.template for c in cases]).double(), 4)
        x = downsample(torch.stack([c.image for c in cases]).double(), 4)
        t, x = torch.stack((t, t.flip(-1)), 1), torch.stack((x, x.flip(-1)), 1)
        gh = scale_grid(0.8, 1.2, t.shape[-2], x.device, x.dtype)
        gw = scale_grid(0.85, 1.15, t.shape[-1], x.device, x.dtype)
        _, c_land, _ = grid_search(t, x, None, gh, gw, ncc, 2**30, True)
        _, land, _ = grid_search(t, x, None, gh, gw, ncc, 2**30, False)
        torch.testing.assert_close(c_land, land, atol=1e-10, rtol=1e-10)
        gen = torch.Generator().manual_seed(int(ncc))
        t, x = (
            torch.rand(t.shape, generator=gen, dtype=torch.float64),
            torch.rand(x.shape, generator=gen, dtype=torch.float64),
        )
        by_c = grid_search(t, x, None, gh, gw, ncc, 2**30, True)
        by_torch = grid_search(t, x, None, gh, gw, ncc, 2**30, False)
        torch.testing.assert_close(by_c[1], by_torch[1], atol=1e-10, rtol=1e-10)
        assert torch.equal(by_c[2], by_torch[2]) and torch.equal(by_c[0], by_torch[0])

    @needs_c
    def test_the_c_kernels_refuse_operands_out_of_their_rules(self):
        # taps whose second index is not the first or the next, or outside the image; levels whose
        # candidates are not grouped by pair in ascending order: a ValueError naming the rule
        from densematch.alignment.warp import bilinear_taps

        a, t = torch.rand(1, 1, 2, 30, 17), torch.rand(1, 1, 11, 9)
        i0, i1, w0, w1 = bilinear_taps(20, 17, torch.tensor([0.9, 1.1]), torch.zeros(2))
        native.align_scores(a, t, (i0, i1, w0, w1), (20, 12), False)  # as made: accepted
        for bad in ((i0, i0 + 2, w0, w1), (i0 - 1, i1, w0, w1), (i0, i1.clamp(max=16) + 1, w0, w1)):
            with pytest.raises(ValueError, match="i1 = i0 or i0 \\+ 1"):
                native.align_scores(a, t, tuple(v.contiguous() for v in bad), (20, 12), False)
        # align_search: one of the grid's taps and given, weights of the template's size, a grid
        # made for the coarsest level
        t, x = torch.rand(2, 1, 8, 8), torch.rand(2, 1, 10, 10)
        scales = torch.linspace(0.9, 1.1, 3, dtype=torch.float64)
        grid = native.AlignGrid(scales, scales, (3, 3), (8, 8), (10, 10), torch.float32, kept=1)
        best, where = torch.rand(2, 3, 3, 1), torch.zeros(2, 3, 3, 1, dtype=torch.int64)
        rule = {
            "levels": 1, "pick": 9, "candidates": 8, "keep": (4, 2), "objective": 0, "iterations": 5,
            "ranges": (0.9, 1.1, 0.9, 1.1), "near": (0.1, 0.1, 2.0, 2.0), "same": (1e-3, 0.1),
            "tolerance": (0.05, 1e-3), "far": 1.0,
        }  # fmt: skip
        total = torch.full((2,), 64.0)
        answer, *_ = native.align_search(t, x, None, total, grid, given=(best, where), **rule)  # accepted
        assert answer.shape == (2, 4)
        for bad, message in (
            ({}, "one of the grid's taps and given"),
            ({"given": (best, where), "levels": 2}, "grid must be made for the coarsest level"),
            ({"given": (best[:1], where[:1])}, "best shifts \\(B, nh, nw, K\\)"),
        ):
            with pytest.raises(ValueError, match=message):
                native.align_search(t, x, None, total, grid, **{**rule, **bad})
        with pytest.raises(ValueError, match="weights \\(B or 1, h, w\\)"):
            native.align_search(t, x, torch.ones(2, 8, 9), total, grid, given=(best, where), **rule)
        # the grid's taps checked once, where it is made: Ry's outside the image refused
        r0, r1, v0, v1 = bilinear_taps(12, 10, scales.float(), torch.zeros(3))
        c0, c1, u0, u1 = bilinear_taps(10, 10, scales.float(), torch.zeros(3))
        limits = (torch.full((3,), 2), torch.full((3,), 2))
        native.AlignGrid(
            scales, scales, (3, 3), (8, 8), (10, 10), torch.float32, ((r0, r1, v0, v1), (c0, c1, u0, u1), *limits)
        )
        with pytest.raises(ValueError, match="Ry's taps \\(nh, rows\\) of the image's dtype inside its rows"):
            native.AlignGrid(
                scales,
                scales,
                (3, 3),
                (8, 8),
                (10, 10),
                torch.float32,
                ((r0, r1 + 1, v0, v1), (c0, c1, u0, u1), *limits),
            )

    @needs_c
    @pytest.mark.parametrize("objective", ["l1", "l2", "ncc"])
    def test_the_c_search_is_its_steps(self, objective):
        # native.align_search (each pair at unit amplitude, pyramid to warp, in one call) against
        # the same steps taken one call at a time at torch's unit amplitude (_centred, then
        # _search_steps with the C grid and refinement) and brought back to the pairs' units: a
        # batch of three photographs and masks, one whose full-resolution path is long (refined
        # again, blurred then sharp), colour, float64, a weighted template (the grid then torch's,
        # given to C), and images on a level of 100. The same answers, errors, warps, landscapes
        # and errors against the template's spread, up to the rounding of the two centrings
        from itertools import islice

        from densematch.alignment.api import _centred, _own_units, _search_c, _search_steps, _Settings, _spread

        far = next(islice(alignment_cases(231, seed=0), 230, None))  # 64x80 in its image
        photos = list(alignment_cases(3, seed=21, sizes=(SIZES[0],), kinds=("photo", "mask")))
        batch = (torch.stack([c.template for c in photos])[:, None], torch.stack([c.image for c in photos])[:, None])
        colour = (batch[0].reshape(1, 3, 100, 100), batch[1].reshape(1, 3, 125, 125))
        weights = torch.ones(1, 1, 100, 100)
        weights[..., 20:50, 30:90] = 0.25
        runs = [
            (far.template[None, None], far.image[None, None], None),
            (*batch, None),
            (*colour, None),
            (batch[0][:1].double(), batch[1][:1].double(), None),
            (batch[0][1:], batch[1][1:], weights.expand(2, -1, -1, -1)),
            (batch[0][:1] * 3 + 100, batch[1][:1] * 3 + 100, None),
        ]
        with torch.inference_mode():
            for t, x, mask in runs:
                uniform = mask is None
                mask = torch.ones(1, 1, *t.shape[-2:]).expand(t.shape[0], 1, -1, -1) if uniform else mask
                mask = mask.to(t.dtype)
                settings = _Settings((0.8, 1.2), (0.8, 1.2), objective, 2**30, uniform, True)
                fused = _search_c(t, x, mask, settings)
                tu, xu, level, unit = _centred(t, x)
                steps = _own_units(_search_steps(tu, xu, mask, settings), level, unit, objective)
                for key in ("grid_h", "grid_w"):
                    assert torch.equal(getattr(fused, key), getattr(steps, key)), key
                for key in ("scale_h", "scale_w"):
                    torch.testing.assert_close(getattr(fused, key), getattr(steps, key), atol=1e-5, rtol=0)
                for key in ("shift_y", "shift_x"):
                    torch.testing.assert_close(getattr(fused, key), getattr(steps, key), atol=1e-3, rtol=0)
                scale = float(x.abs().amax())  # the images' own amplitude
                torch.testing.assert_close(fused.landscape, steps.landscape, atol=1e-6 * scale**2, rtol=1e-4)
                # 1 - NCC: C sums in float64, torch in float32 (0 against 1.2e-7 at a perfect fit)
                atol = 1e-6 if objective == "ncc" else 1e-9 * scale**2
                torch.testing.assert_close(fused.error, steps.error, atol=atol, rtol=1e-4)
                relative = steps.error / _spread(t, mask, objective, uniform)
                torch.testing.assert_close(fused.relative, relative, atol=1e-6, rtol=1e-3)
                torch.testing.assert_close(
                    fused.warped, steps.warped, atol=1e-4 * scale, rtol=0
                )  # torch: float32 products

    @needs_c
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_the_c_warp_is_the_products(self, dtype):
        # bilinear samples in C against warp_batch's Ry X Rx^T: two channels, stretches both ways,
        # crops reaching the image's last row and column (the clamped tap)
        from densematch.alignment.warp import warp_batch

        gen = torch.Generator().manual_seed(7)
        x = torch.rand(3, 2, 23, 31, generator=gen, dtype=dtype)
        params = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.83, 1.17, 1.4, 6.25], [1.2, 0.8, 7.6, 0.0]], dtype=dtype)
        size = (18, 24)
        params[2, 3] = 31 * 0.8 - size[1]  # the last column
        by_c = native.align_warp(x, params, size)
        tol = 1e-5 if dtype == torch.float32 else 1e-13  # torch takes the taps in float32
        torch.testing.assert_close(by_c, warp_batch(x, *params.unbind(1), size), atol=tol, rtol=0)

    def test_every_photo_over_the_whole_default_range(self):
        # the cases: 2x2-pooled photographs, 100x100 from 125x125, scales anywhere in
        # (0.8, 1.2), noise 0.01; every one of the 12 photographs twice, the truth always found
        cases = list(
            alignment_cases(
                24,
                seed=30,
                kinds=("photo",),
                sizes=(SIZES[0],),
                noise=(0.01,),
                scale_range=(0.8, 1.2),
                pooled=2,
                cycle=True,
            )
        )
        assert {c.source for c in cases} == set(PHOTOS)
        found = [align(c.template, c.image) for c in cases]
        misses = [(c.source, a.as_dict()) for a, c in zip(found, cases, strict=True) if not within(a, c)]
        assert not misses, misses

    def test_a_long_full_resolution_path_is_refined_again(self):
        # bench_align's case 230: the coarse level's best was 0.04 off in scale_h, and the long
        # path full resolution took from it stopped in a small basin of the grass 0.35 px and
        # 0.008 in scale_w short of the truth (squared error 1.1e-5 against 0; strict missed)
        from itertools import islice

        c = next(islice(alignment_cases(231, seed=0), 230, None))
        assert (c.source, tuple(c.template.shape), c.noise) == ("camera", (64, 80), 0.0)
        a = align(c.template, c.image)
        assert within(a, c, 1e-4, 0.01) and a.error < 1e-6

    def test_candidates_are_distinct_and_keep_a_basin_outranked_by_its_neighbours(self):
        grid = torch.linspace(0.8, 1.2, 11)
        best = torch.full((1, 11, 11, 1), 5.0)
        where = torch.zeros(1, 11, 11, 1, dtype=torch.long)
        best[0, 3:6, 3:6, 0] = torch.arange(9.0).reshape(3, 3) / 10  # one wide basin: 9 cells below 1
        best[0, 9, 1, 0] = 1.5  # another, 10th in the plain ranking
        cand = pick_candidates(best, where, grid, grid, 13)[0]
        assert tuple(cand[0, :2].tolist()) == pytest.approx((0.92, 0.92))  # the lowest first
        assert any(torch.allclose(c[:2], torch.tensor([1.16, 0.84])) for c in cand)
        apart = (cand[:, None, :2] - cand[None, :, :2]).abs().amax(-1) > 0.06 + 1e-6
        assert apart[~torch.eye(len(cand), dtype=torch.bool)].all()

    @needs_c
    @pytest.mark.parametrize("seed", range(4))
    def test_the_c_candidates_are_torchs(self, seed):
        # distinct scores (no tie for topk to order its own way), a share of them inf (scale pairs
        # with fewer minima), three pairs, shifts clustered so that the greedy rule drops some
        gen = torch.Generator().manual_seed(seed)
        grid = torch.linspace(0.8, 1.2, 9, dtype=torch.float64)
        best = torch.rand(3, 9, 9, 3, generator=gen, dtype=torch.float64)
        best[torch.rand(best.shape, generator=gen) < 0.3] = math.inf
        where = torch.randint(0, 4 * 13, best.shape, generator=gen)
        n, m, near = candidate_rule(grid, grid, 3)
        by_c = native.align_pick(best, where, grid, grid, 13, near, n, m)
        torch.testing.assert_close(by_c, pick_candidates(best, where, grid, grid, 13), rtol=0, atol=0)

    def test_a_basin_reached_twice_is_refined_once(self):
        # candidates that converged onto one another (the usual case: 101 of 144 pairs handed two
        # identical ones to full resolution) are refined once; near ones that may still part
        # (0.002 in scale, 0.3 px: two starts pinned at a scale bound) are both kept
        from densematch.alignment.api import _best_per_pair

        cand = torch.tensor(
            [
                [1.0, 1.0, 5.0, 7.0],  # pair 0's best
                [1.0, 1.0, 5.0, 7.00001],  # the same basin again
                [0.8, 0.94, 4.3, 19.4],  # pair 1
                [0.8, 0.942, 4.35, 19.1],  # pair 1, near but not the same
                [1.1, 0.9, 2.0, 3.0],  # pair 0, elsewhere
                [1.2, 0.9, 2.0, 3.0],  # pair 0, third: past keep=2
            ]
        )
        owner = torch.tensor([0, 0, 1, 1, 0, 0])
        err = torch.tensor([0.1, 0.1, 0.3, 0.2, 0.5, 0.6])
        assert _best_per_pair(cand, owner, err, 2).tolist() == [0, 3, 2]  # the duplicate is not replaced
        assert _best_per_pair(cand, owner, err, 3).tolist() == [0, 4, 3, 2]
        assert _best_per_pair(cand, owner, err, 1).tolist() == [0, 3]

    @pytest.mark.parametrize("in_c", [False, pytest.param(True, marks=needs_c)])
    def test_several_shifts_of_one_scale_pair_are_kept(self, in_c):
        # a periodic texture has several good shifts at one scale: the best two local minima over
        # the shifts both stay candidates (a plain minimum per scale pair kept only one)
        score = torch.full((1, 1, 1, 9, 9), 3.0)
        score[0, 0, 0, 1, 1], score[0, 0, 0, 1, 2] = 0.5, 0.6  # one basin (two cells)
        score[0, 0, 0, 7, 6] = 0.7  # another
        best, where = _best_shifts(score, in_c)
        assert best[0, 0, 0, :2].tolist() == pytest.approx([0.5, 0.7])
        assert where[0, 0, 0, :2].tolist() == [1 * 9 + 1, 7 * 9 + 6]

    @pytest.mark.parametrize("ncc", [False, True])
    def test_the_grid_from_products_equals_the_grid_from_transforms(self, monkeypatch, ncc):
        # uniform weights take the matrix products (no stretched image built); forcing the FFT
        # path must give the same landscape and the same candidates, for two channels
        from densematch.alignment import search

        cases = list(alignment_cases(3, seed=1, kinds=("photo",), sizes=(SIZES[0],), pooled=2))
        t = torch.stack([torch.stack((c.template, 0.5 * c.template + 0.1)) for c in cases])
        x = torch.stack([torch.stack((c.image, 0.5 * c.image + 0.1)) for c in cases])
        tc, xc = search.downsample(t, 4), search.downsample(x, 4)
        grid_h, grid_w = (search.scale_grid(lo, 1.2, 25, x.device, x.dtype) for lo in (0.8, 0.85))
        products = search.grid_search(tc, xc, None, grid_h, grid_w, ncc, 2**30)
        monkeypatch.setattr(search, "_products_cheaper", lambda *args: False)
        transforms = search.grid_search(tc, xc, None, grid_h, grid_w, ncc, 2**30)
        torch.testing.assert_close(products[1], transforms[1], atol=1e-5, rtol=1e-5)
        assert torch.equal(products[0], transforms[0])

    @pytest.mark.parametrize(
        ("template", "image", "torch_products", "c_products"),
        [
            ((25, 25), (31, 31), True, True),  # a 100x100 photograph's coarse level: products either way
            ((32, 40), (40, 50), False, True),  # a 64x80 mask's: C's grid, where torch's transforms
            ((120, 120), (150, 150), False, True),  # a fine texture at full resolution: the same
            ((400, 400), (500, 500), False, False),  # and a large one: transforms either way
        ],
    )
    def test_the_grid_takes_products_or_transforms_by_the_rule(self, template, image, torch_products, c_products):
        # the rule per kernel: torch's products against the transforms at 4x their flops, C's
        # grid (taps, 3-4x faster than torch's transforms at 2-4x their counted flops) up to 8x
        from densematch.alignment.search import _fast_length, _products_cheaper, scale_grid

        (h, w), (big_h, big_w) = template, image
        nh, nw = (scale_grid(0.8, 1.2, n, "cpu", torch.float64).numel() for n in (h, w))
        shifts = (math.floor(big_h * 1.2 - h + 1e-6) + 1, math.floor(big_w * 1.2 - w + 1e-6) + 1)
        fft = (_fast_length(math.floor(big_h * 1.2)), _fast_length(math.floor(big_w * 1.2)))
        shape = torch.Size([1, 1, h, w])
        assert _products_cheaper(shape, big_w, nh, nw, shifts, fft) is torch_products
        assert _products_cheaper(shape, big_w, nh, nw, shifts, fft, True) is c_products

    @pytest.mark.parametrize("in_c", [False, pytest.param(True, marks=needs_c)])
    def test_the_grids_shifts_are_counted_in_its_dtype(self, in_c):
        # 60 x 0.9 is 54 in float32 (0.9 itself a little under): the last shift of a 40-wide
        # template is 14, as the float32 tensors hold it, not 13 as 0.9's exact value would give;
        # and the rows and columns cover every valid shift's window whichever way it rounds
        from densematch.alignment.search import _plan

        t, x = torch.zeros(1, 1, 48, 40), torch.zeros(1, 1, 60, 60)  # their shapes
        for dtype, last in ((torch.float32, 14), (torch.float64, 14)):
            grid = torch.tensor([0.9], dtype=dtype)
            plan = _plan(tuple(t.shape), tuple(x.shape), False, grid, grid, 2**30, in_c)
            assert plan.n_shift == (7, last + 1) and plan.max_x.tolist() == [last]
            assert plan.rx.shape[1] >= plan.n_shift[1] + 40 - 1 and plan.ry.shape[1] >= plan.n_shift[0] + 48 - 1

    @needs_c
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("shape", [(2, 3, 4, 13, 13), (1, 2, 2, 1, 7), (3, 1, 1, 5, 1), (1, 1, 1, 1, 1)])
    def test_the_c_best_shifts_are_torchs(self, dtype, shape):
        # ties (scores on a grid of eighths), invalid shifts (inf) and rows of one shift
        gen = torch.Generator().manual_seed(sum(shape))
        score = (torch.rand(*shape, generator=gen, dtype=dtype) * 8).round() / 8
        score = score.masked_fill(torch.rand(*shape, generator=gen) < 0.2, float("inf"))
        (best_t, _), (best_c, where_c) = _best_shifts(score), _best_shifts(score, True)
        assert torch.equal(best_c, best_t)
        # each scale pair's local minima (no higher than their 8 neighbours) by score, ties by index
        ny, nx = shape[-2:]
        padded = torch.nn.functional.pad(score, (1, 1, 1, 1), value=float("inf"))
        around = torch.stack([padded[..., dy : dy + ny, dx : dx + nx] for dy in range(3) for dx in range(3)])
        minima = (score <= around.amin(0)).reshape(-1, ny * nx)
        values, k = score.reshape(-1, ny * nx), best_c.shape[-1]
        found = zip(best_c.reshape(-1, k).tolist(), where_c.reshape(-1, k).tolist(), strict=True)
        for row, (v, at) in enumerate(found):
            low = [(float(x), i) for i, x in enumerate(values[row].tolist()) if minima[row, i] and x < float("inf")]
            assert [(a, i) for a, i in zip(v, at, strict=True) if a < float("inf")] == sorted(low)[:k]


class TestLandscapes:
    """The error over the scales (Alignment.landscape, with each scale pair's best shift) and over
    the shifts (shift_landscape), against a float64 warp at every shift."""

    @staticmethod
    def brute(tpl, img, sh, sw, objective, weights=None):
        """(n_y, n_x) float64: squared error or 1 - NCC of ``tpl`` against ``img`` warped at each integer shift."""
        t, x = tpl.double(), img.double()
        h, w = t.shape
        ny, nx = math.floor(x.shape[0] * sh - h + 1e-6) + 1, math.floor(x.shape[1] * sw - w + 1e-6) + 1
        wt = torch.ones_like(t) if weights is None else weights.double()
        out = torch.empty(ny, nx, dtype=torch.float64)
        for y in range(ny):
            for xx in range(nx):
                s = warp(x, sh, sw, float(y), float(xx), (h, w))
                if objective == "ncc":
                    mt, ms = (wt * t).sum() / wt.sum(), (wt * s).sum() / wt.sum()
                    cov = (wt * (t - mt) * (s - ms)).sum()
                    out[y, xx] = 1 - cov / ((wt * (t - mt) ** 2).sum() * (wt * (s - ms) ** 2).sum()).sqrt()
                else:
                    out[y, xx] = (wt * (t - s) ** 2).sum() / wt.sum()
        return out

    @pytest.mark.parametrize("objective", ["l1", "ncc"])
    @pytest.mark.parametrize("weighted", [False, True])
    def test_shift_landscape_is_the_error_at_every_shift(self, camera_small, objective, weighted):
        img = torch.from_numpy(camera_small[:44, :50]).float() * 3 + 100  # a level the search takes off
        tpl = warp(img, 1.04, 0.95, 3.0, 2.0, (30, 34))
        weights = torch.rand(30, 34, generator=torch.Generator().manual_seed(1)) + 0.1 if weighted else None
        got = densematch_shift_landscape(tpl, img, 1.04, 0.95, objective=objective, template_mask=weights)
        ref = self.brute(tpl, img, 1.04, 0.95, objective, weights)
        assert got.shape == ref.shape
        scale = 1.0 if objective == "ncc" else float(ref.max())
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-4 * scale)
        assert divmod(int(got.argmin()), got.shape[1]) == (3, 2)

    def test_landscape_shifts_are_each_scale_pairs_best(self, camera_small):
        img = torch.from_numpy(camera_small[:40, :44]).float()
        tpl = warp(img, 1.05, 0.96, 2.6, 1.3, (30, 32))  # 30 rows: the search runs at full resolution
        a = align(tpl, img, scale_h=(0.95, 1.1), scale_w=(0.9, 1.05))
        assert a.landscape_shifts.shape == (1, a.scales_h.numel(), a.scales_w.numel(), 2)
        for r in range(0, a.scales_h.numel(), 3):
            for c in range(0, a.scales_w.numel(), 3):
                sh, sw = float(a.scales_h[r]), float(a.scales_w[c])
                errors = densematch_shift_landscape(tpl, img, sh, sw, objective="l2")
                y, x = (int(v) for v in a.landscape_shifts[0, r, c])
                # the best shift's error is the landscape's; a near-tie may pick another shift
                assert float(errors[y, x]) == pytest.approx(float(a.landscape[0, r, c]), rel=1e-4, abs=1e-7)
                assert float(errors[y, x]) <= float(errors.min()) * (1 + 1e-4) + 1e-7

    def test_landscape_shifts_are_in_the_images_pixels_on_a_coarse_level(self):
        from densematch.alignment.api import _levels

        case = next(alignment_cases(1, seed=5, kinds=("photo",), sizes=(SIZES[0],), noise=(0.0,)))
        factor = _levels(case.template[None, None], torch.ones(1, 1, *case.template.shape))[0]
        assert factor > 1  # 100 x 100: the grid runs on a coarser level
        a = align(case.template, case.image)
        shifts = a.landscape_shifts[0]
        finite = shifts[torch.isfinite(shifts)]
        assert finite.numel() > 0 and torch.equal(finite % factor, torch.zeros_like(finite))
        r = int((a.scales_h - a.scale_h).abs().argmin())
        c = int((a.scales_w - a.scale_w).abs().argmin())
        # the coarse level's best shift at the answer's scales, in the image's pixels
        y, x = shifts[r, c].tolist()
        assert abs(y - a.shift_y) <= 2 * factor and abs(x - a.shift_x) <= 2 * factor

    def test_shift_landscape_refuses_bad_input(self):
        img, tpl = torch.rand(40, 40), torch.rand(30, 30)
        with pytest.raises(ValueError, match="scale_h"):
            densematch_shift_landscape(tpl, img, 0.0, 1.0)
        with pytest.raises(TypeError, match="scale_w"):
            densematch_shift_landscape(tpl, img, 1.0, "1")
        with pytest.raises(ValueError, match="does not fit"):
            densematch_shift_landscape(tpl, img, 0.5, 1.0)
        with pytest.raises(ValueError, match="objective"):
            densematch_shift_landscape(tpl, img, 1.0, 1.0, objective="l3")
