import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch import match

from .._reference import (
    METRICS,
    assert_same_up_to_ties,
    assert_topk_exact,
    decided,
    patch_features,
    reference_scores,
    reported,
    tolerance,
)


def brute(a, b, metric):
    """Reference best index of each row of a in b, and of each row of b in a."""
    ref = reference_scores(a, b, metric)
    return ref.argmax(1), ref.argmax(0)


class TestShapesAndLayouts:
    def test_hwc_shapes_and_coords_use_b_width(self):
        a, b = torch.randn(7, 9, 5), torch.randn(6, 11, 5)
        r = match(a, b, metric="l2")
        assert r.index.shape == (7, 9) and r.coords.shape == (7, 9, 2)
        assert r.score.dtype == torch.float32 and r.valid.all()
        assert torch.equal(r.coords[..., 0] * 11 + r.coords[..., 1], r.index)
        assert (r.coords[..., 1] < 11).all() and (r.coords[..., 0] < 6).all()

    def test_layouts_agree(self):
        a, b = torch.randn(2, 7, 9, 5), torch.randn(2, 6, 11, 5)
        hwc = match(a, b, k=3)
        chw = match(a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2), k=3, layout="chw")
        flat = match(a.reshape(2, 63, 5), b.reshape(2, 66, 5), k=3, layout="flat")
        assert torch.equal(hwc.index, chw.index) and torch.equal(hwc.coords, chw.coords)
        assert torch.equal(hwc.index.reshape(2, 63, 3), flat.index) and getattr(flat, "coords", None) is None
        with pytest.raises(AttributeError, match="layout='flat'"):
            _ = flat.coords
        assert hwc.index.shape == (2, 7, 9, 3) and hwc.coords.shape == (2, 7, 9, 3, 2)

    def test_batch_items_are_independent(self):
        a, b = torch.randn(3, 5, 4, 6), torch.randn(3, 4, 7, 6)
        r = match(a, b, metric="l1", k=2)
        for i in range(3):
            assert torch.equal(r.index[i], match(a[i], b[i], metric="l1", k=2).index)

    def test_numpy_inputs_and_channels_last(self):
        a = np.random.default_rng(0).normal(size=(5, 6, 3)).astype(np.float32)
        r = match(a, a[::-1])  # negative strides
        assert isinstance(r.index, torch.Tensor)
        x = torch.randn(1, 4, 5, 6).contiguous(memory_format=torch.channels_last)
        assert match(x, x, layout="chw").valid.all()

    def test_numpy_result(self):
        out = match(torch.randn(4, 4, 3), torch.randn(4, 4, 3)).numpy()
        assert set(out) == {"index", "coords", "score", "valid"}
        assert out["coords"].dtype == np.int64 and out["score"].dtype == np.float32

    def test_module_twin(self):
        m = densematch.DenseMatcher(metric="l2", k=3, ratio=np.float32(0.9), memory="1MiB")
        shown = "metric='l2', k=3, ratio=0.8999999761581421, layout='hwc', memory='1MiB', precision='exact'"
        assert repr(m) == f"DenseMatcher({shown})"
        a, b = torch.randn(8, 8, 4), torch.randn(6, 9, 4)
        mask = torch.rand(6, 9) < 0.5
        got = m(a, b, mask_b=mask)
        want = match(a, b, metric="l2", k=3, ratio=0.8999999761581421, mask_b=mask)
        assert torch.equal(got.index, want.index) and torch.equal(got.valid, want.valid)

    def test_options_are_one_checked_frozen_object(self):
        options = densematch.MatchOptions(metric="l2", k=2, stride=[14], ratio=np.float32(0.5))
        assert options.stride == (14.0, 14.0) and type(options.ratio) is float
        assert (
            repr(options)
            == "MatchOptions(metric='l2', k=2, ratio=0.5, layout='hwc', precision='exact', stride=(14.0, 14.0))"
        )
        with pytest.raises(AttributeError):
            options.k = 3  # frozen: a matcher's settings cannot drift from what was checked
        m = densematch.DenseMatcher(options)
        assert m.options is options and m.k == 2 and m.stride == (14.0, 14.0)
        assert repr(m) == f"DenseMatcher({options.shown()})"
        a, b = torch.randn(6, 5, 4), torch.randn(7, 3, 4)
        got, want = m(a, b), match(a, b, **options.settings())
        assert torch.equal(got.index, want.index) and torch.equal(got.coords, want.coords)
        with pytest.raises(TypeError, match="not both"):
            densematch.DenseMatcher(options, k=3)

    @pytest.mark.parametrize(
        ("kwargs", "error", "pattern"),
        [
            (dict(metric="l3"), ValueError, "metric must be one of"),
            (dict(k=0), ValueError, "k must be >= 1"),
            (dict(k=1.5), TypeError, "k must be an int"),
            (dict(ratio=1.5), ValueError, "ratio must be in"),
            (dict(metric="dot", ratio=0.8), ValueError, "ratio is undefined"),
            (dict(layout="nhwc"), ValueError, "layout must be one of"),
            (dict(memory="lots"), ValueError, "memory must be a size"),
            (dict(precision="half"), ValueError, "precision must be one of"),
        ],
    )
    def test_module_twin_checks_its_settings_at_construction(self, kwargs, error, pattern):
        with pytest.raises(error, match=pattern):
            densematch.DenseMatcher(**kwargs)

    def test_a_setting_assigned_applies_and_is_checked(self):
        # m.k = 5 read back 5 while matching went on with k=2
        m = densematch.DenseMatcher(k=2, metric="l2")
        m.k = 5
        a, b = torch.randn(6, 5, 4), torch.randn(7, 3, 4)
        got = m(a, b)
        assert m.k == 5 and m.options.k == 5 and got.index.shape == (6, 5, 5)
        assert torch.equal(got.index, match(a, b, k=5, metric="l2").index)
        with pytest.raises(ValueError, match="k must be >= 1"):
            m.k = 0
        with pytest.raises(TypeError, match="mutual must be True or False"):
            m.mutual = "yes"
        assert m.k == 5 and m.mutual is False  # a refused setting changes nothing
        m.training = False  # nn.Module's own attributes are set as ever
        assert not m.training

    def test_a_dict_of_settings_is_refused_at_construction(self):
        with pytest.raises(TypeError, match=r"options must be a MatchOptions, got dict; give the settings as keywords"):
            densematch.DenseMatcher({"k": 3})


@settings(max_examples=40, deadline=None)
@given(
    ha=st.integers(1, 9),
    wa=st.integers(1, 9),
    hb=st.integers(1, 9),
    wb=st.integers(1, 9),
    c=st.integers(1, 20),
    k=st.integers(1, 4),
    metric=st.sampled_from(METRICS),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    budget=st.sampled_from([6_000, 30_000, None]),
    seed=st.integers(0, 2**31 - 1),
)
def test_match_equals_brute_force(ha, wa, hb, wb, c, k, metric, dtype, budget, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(ha, wa, c, generator=g).to(dtype)
    b = torch.randn(hb, wb, c, generator=g).to(dtype)
    k = min(k, hb * wb)
    try:
        r = match(a, b, metric=metric, k=k, memory=budget)
    except ValueError as err:  # a budget too small for one tile must say so
        assert "cannot hold one tile" in str(err)
        return
    fa, fb = a.reshape(-1, c), b.reshape(-1, c)
    assert_topk_exact(fa, fb, r.index.reshape(-1, k), metric, k)
    want = reported(reference_scores(fa, fb, metric), metric).gather(1, r.index.reshape(-1, k))
    torch.testing.assert_close(r.score.reshape(-1, k).double(), want, rtol=0, atol=tolerance(fa, fb, metric))


class TestFilters:
    @pytest.mark.parametrize("metric", METRICS)
    def test_mutual_equals_brute_force(self, metric):
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(9, 8, 6, generator=g), torch.randn(7, 10, 6, generator=g)
        r = match(a, b, metric=metric, mutual=True, memory="1MiB")
        fa, fb = a.reshape(-1, 6), b.reshape(-1, 6)
        fwd, back = brute(fa, fb, metric)
        want = back[fwd] == torch.arange(72)
        ref, tol = reference_scores(fa, fb, metric), tolerance(fa, fb, metric)
        sure = decided(ref, tol) & decided(ref, tol, dim=0)[fwd]  # no near-tie either way
        assert sure.float().mean() > 0.9
        assert torch.equal(r.valid.reshape(-1)[sure], want[sure])
        assert 0 < want.sum() < 72

    def test_mutual_with_k(self):
        g = torch.Generator().manual_seed(2)
        a, b = torch.randn(30, 5, generator=g), torch.randn(25, 5, generator=g)
        r = match(a, b, metric="l2", k=3, mutual=True, layout="flat")
        _, back = brute(a, b, "l2")
        sure = decided(reference_scores(a, b, "l2"), tolerance(a, b, "l2"), dim=0)[r.index]
        assert sure.float().mean() > 0.9
        assert torch.equal(r.valid[sure], (back[r.index] == torch.arange(30)[:, None])[sure])

    @pytest.mark.parametrize("metric", ["cosine", "l2", "sqeuclidean", "l1"])
    def test_ratio_equals_brute_force(self, metric):
        g = torch.Generator().manual_seed(3)
        a, b = torch.randn(120, 4, generator=g), torch.randn(90, 4, generator=g)
        r = match(a, b, metric=metric, ratio=0.8, layout="flat")
        ref = reference_scores(a, b, metric).topk(2, dim=1).values
        d = -ref if metric != "cosine" else (2 - 2 * ref).clamp_min(0).sqrt()
        if metric == "sqeuclidean":
            d = d.sqrt()
        want = d[:, 0] <= 0.8 * d[:, 1]
        sure = (d[:, 0] - 0.8 * d[:, 1]).abs() > tolerance(a, b, metric)  # not on the threshold
        assert sure.float().mean() > 0.9
        assert torch.equal(r.valid[sure], want[sure])
        assert 0 < want.sum() < 120

    def test_ratio_with_exact_duplicates_fails_and_single_candidate_passes(self):
        b = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
        a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        r = match(a, b, metric="l2", ratio=1.0, layout="flat")
        assert r.valid.tolist() == [False, True]
        r1 = match(a, b, metric="l2", ratio=0.5, layout="flat", mask_b=torch.tensor([True, False, False]))
        assert r1.valid.tolist() == [True, True]

    def test_masks(self):
        g = torch.Generator().manual_seed(4)
        a, b = torch.randn(6, 7, 5, generator=g), torch.randn(8, 5, 5, generator=g)
        ma = torch.rand(6, 7, generator=g) < 0.5
        mb = torch.rand(8, 5, generator=g) < 0.5
        r = match(a, b, metric="cosine", k=2, mask_a=ma, mask_b=mb)
        assert (r.index[~ma] == -1).all() and (~r.valid[~ma]).all() and r.score[~ma].isnan().all()
        assert (r.coords[~ma] == -1).all()
        assert r.valid[ma].all()
        assert_topk_exact(a[ma], b.reshape(-1, 5), r.index[ma], "cosine", 2, allowed_b=mb.reshape(-1))

    def test_batch_masks_broadcast_and_mutual_respects_masks(self):
        g = torch.Generator().manual_seed(5)
        a, b = torch.randn(2, 5, 5, 3, generator=g), torch.randn(2, 4, 6, 3, generator=g)
        mb = torch.rand(4, 6, generator=g) < 0.6
        ma = torch.rand(2, 5, 5, generator=g) < 0.6
        r = match(a, b, metric="l2", mask_a=ma, mask_b=mb, mutual=True)
        for i in range(2):
            fa, fb = a[i].reshape(-1, 3), b[i].reshape(-1, 3)
            ref = reference_scores(fa, fb, "l2")
            ref[~ma[i].reshape(-1)] = -np.inf
            ref[:, ~mb.reshape(-1)] = -np.inf
            fwd, back = ref.argmax(1), ref.argmax(0)
            want = (back[fwd] == torch.arange(25)) & ma[i].reshape(-1)
            tol = tolerance(fa, fb, "l2")
            sure = ~ma[i].reshape(-1) | (decided(ref, tol) & decided(ref, tol, dim=0)[fwd])
            assert torch.equal(r.valid[i].reshape(-1)[sure], want[sure])


class TestNumerics:
    def test_cosine_zero_vectors(self):
        a = torch.zeros(3, 3, 4)
        b = torch.randn(3, 3, 4)
        b[0, 0] = 0
        r = match(a, b, ratio=0.9)
        assert not r.score.isnan().any() and (r.score == 0).all()

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
    def test_low_precision_inputs_accumulate_in_float32(self, dtype):
        g = torch.Generator().manual_seed(6)
        a = torch.randn(40, 64, generator=g).to(dtype)
        b = torch.randn(50, 64, generator=g).to(dtype)
        r = match(a, b, metric="dot", layout="flat", k=2)
        assert r.score.dtype == torch.float32
        assert_topk_exact(a, b, r.index, "dot", 2)

    def test_float64_precision(self):
        a, b = torch.randn(30, 8, dtype=torch.float64), torch.randn(40, 8, dtype=torch.float64)
        r = match(a, b, metric="l2", layout="flat", precision="float64")
        ref = reference_scores(a, b, "l2")
        assert_same_up_to_ties(a, b, r.index, ref.argmax(1), "l2", tol=1e-12)
        torch.testing.assert_close(r.score.double(), -ref.amax(1), rtol=1e-6, atol=1e-6)

    def test_real_image_patch_features(self, camera_small):
        # features of a real photograph against a shifted crop of itself
        f = patch_features(camera_small)
        a, b = f[4:52, 6:58], f[0:60, 0:64]
        r = match(a, b, metric="cosine", k=2, memory="2MiB")
        assert_topk_exact(a.reshape(-1, 25), b.reshape(-1, 25), r.index.reshape(-1, 2), "cosine", 2)
        # textured pixels land where they came from
        texture = a.norm(dim=-1) > 0.3
        hit = (r.coords[..., 0, 0] == torch.arange(4, 52)[:, None]) & (r.coords[..., 0, 1] == torch.arange(6, 58))
        assert hit[texture].float().mean() > 0.8
        r2 = match(a, b, metric="l1", mutual=True, ratio=0.9)
        assert_topk_exact(a.reshape(-1, 25), b.reshape(-1, 25), r2.index.reshape(-1, 1), "l1", 1)
        assert r2.valid.float().mean() > 0.2

    def test_tiny_and_large_budgets_agree(self, camera_small):
        f = patch_features(camera_small)[:40, :40]
        big = match(f, f.flip(0), metric="l2", k=3, memory="1GiB")
        small = match(f, f.flip(0), metric="l2", k=3, memory="300KiB")
        # flat regions of the photo give exact ties, which tiling may round either way:
        # both must be exact by the reference, and report the same scores
        for r in (big, small):
            assert_topk_exact(f.reshape(-1, 25), f.flip(0).reshape(-1, 25), r.index.reshape(-1, 3), "l2", 3)
        torch.testing.assert_close(big.score, small.score, rtol=0, atol=1e-5)

    def test_progress_bar(self, capsys):
        match(torch.randn(20, 20, 3), torch.randn(20, 20, 3), progress=True, mutual=True)
        assert "800/800" in capsys.readouterr().err

    def test_config_context_sets_the_budget(self):
        a = torch.randn(50, 50, 8)
        with densematch.config_context(memory=1000), pytest.raises(ValueError, match="cannot hold one tile"):
            match(a, a)
        assert densematch.get_config()["memory"] is None


class TestBadInput:
    a = torch.randn(4, 5, 3)

    @pytest.mark.parametrize(
        ("kwargs", "error", "pattern"),
        [
            (dict(a=torch.randn(4, 5)), ValueError, r"a must have shape \(H, W, C\)"),
            (dict(a=torch.randn(3), b=torch.randn(4, 3), layout="flat"), ValueError, r"a must have shape \(N, C\)"),
            (dict(b=torch.randn(4, 5, 2)), ValueError, "same number of channels C, got 3 and 2"),
            (dict(a=torch.randn(2, 4, 5, 3)), ValueError, "same batch size"),
            (dict(a=torch.randn(2, 4, 5, 3), b=torch.randn(3, 4, 5, 3)), ValueError, "same batch size"),
            (dict(a=torch.randn(0, 5, 3)), ValueError, "a must not be empty"),
            (dict(b=torch.randn(4, 5, 0), a=torch.randn(4, 5, 0)), ValueError, "must not be empty"),
            (dict(a=torch.full((4, 5, 3), float("nan"))), ValueError, "a must hold only finite"),
            (dict(b=torch.full((4, 5, 3), float("inf"))), ValueError, "b must hold only finite"),
            (dict(a=torch.ones(4, 5, 3, dtype=torch.int32)), TypeError, "a must hold floats"),
            (dict(b=torch.ones(4, 5, 3, dtype=torch.bool)), TypeError, "b must hold floats"),
            (dict(a=[[1.0]]), TypeError, "a must be a torch.Tensor or numpy.ndarray"),
            (dict(metric="L3"), ValueError, "metric must be one of 'cosine', 'dot'"),
            (dict(layout="nhwc"), ValueError, "layout must be one of 'hwc', 'chw', 'flat'"),
            (dict(k=0), ValueError, "k must be >= 1, got 0"),
            (dict(k=21), ValueError, "k must be between 1 and 20, got 21"),
            (dict(k=2.0), TypeError, "k must be an int"),
            (dict(ratio=0.0), ValueError, r"ratio must be in \(0, 1\]"),
            (dict(ratio=1.5), ValueError, r"ratio must be in \(0, 1\]"),
            (dict(ratio=0.8, metric="dot"), ValueError, "ratio is undefined for metric='dot'"),
            (dict(mask_a=torch.ones(5, 4, dtype=torch.bool)), ValueError, r"mask_a must have shape \(4, 5\)"),
            (dict(mask_b=torch.ones(4, 5)), TypeError, "mask_b must be a boolean mask"),
            (dict(memory="lots"), ValueError, "memory must be a size"),
            (dict(memory=-5), ValueError, "memory must be a positive"),
            (dict(memory=64), ValueError, r"memory=64 bytes cannot hold one tile: at least \d+ bytes"),
            (dict(precision="half"), ValueError, "precision must be one of"),
            # bool("False") is True: these turned the filter (or the bar) on
            (dict(mutual="False"), TypeError, r"mutual must be True or False, got 'False' \(str\)"),
            (dict(mutual="no"), TypeError, "mutual must be True or False"),
            (dict(mutual=0), TypeError, r"mutual must be True or False, got 0 \(int\)"),
            (dict(progress="0"), TypeError, "progress must be True or False"),
        ],
    )
    def test_errors_name_the_argument(self, kwargs, error, pattern):
        args = dict(a=self.a, b=torch.randn(4, 5, 3))
        args.update(kwargs)
        a, b = args.pop("a"), args.pop("b")
        with pytest.raises(error, match=pattern):
            match(a, b, **args)


@pytest.mark.parametrize("mutual", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_the_progress_bar_counts_what_is_searched(monkeypatch, mutual, masked):
    # with mutual=True the bar's total was 2 x a's pixels, while the check searches b's
    import contextlib

    from densematch.matching import dense as _match

    seen = {}

    @contextlib.contextmanager
    def recorder(enabled, total, **_):
        class Bar:
            def update(self, n=1):
                seen["done"] = seen.get("done", 0) + n

        seen["total"] = total
        yield Bar()

    monkeypatch.setattr(_match, "progress_bar", recorder)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 30, 8, generator=g), torch.randn(25, 33, 8, generator=g)
    masks = dict(mask_a=torch.rand(20, 30, generator=g) < 0.5, mask_b=torch.rand(25, 33, generator=g) < 0.7)
    match(a, b, mutual=mutual, progress=True, **(masks if masked else {}))
    assert seen["done"] == seen["total"]
