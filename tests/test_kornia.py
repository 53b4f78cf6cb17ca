"""densematch.kornia side by side with kornia.feature's matchers: same conventions, same matches."""

import numpy as np
import pytest
import torch

kornia_feature = pytest.importorskip("kornia.feature")

from densematch import kornia as dk  # noqa: E402

from ._memory import peak_extra  # noqa: E402
from ._reference import assert_same_up_to_ties, tolerance  # noqa: E402

PLAIN = ["match_nn", "match_mnn", "match_snn", "match_smnn"]


def sift_like(n: int, seed: int) -> torch.Tensor:
    """Kornia's SIFT descriptor of n 32x32 patches cut from scikit-image photographs: real
    descriptors, non-negative and L2-normalised, with near-duplicates from overlapping patches."""
    from skimage import data

    g = np.random.default_rng(seed)
    images = [data.camera(), data.coins(), data.astronaut()[..., 1], data.moon()]
    patches = []
    for i in range(n):
        img = images[i % len(images)]
        y, x = g.integers(0, img.shape[0] - 32), g.integers(0, img.shape[1] - 32)
        patches.append(img[y : y + 32, x : x + 32])
    x = torch.from_numpy(np.stack(patches)).float()[:, None] / 255.0
    with torch.no_grad():
        return kornia_feature.SIFTDescriptor(32, rootsift=False)(x)


def same_matches(ours, theirs, desc1, desc2, *, ratio: bool, atol: float = 1e-5, tie: float | None = None) -> None:
    """Index pairs equal (or, where they differ, a near-tie of the distances, within ``tie``,
    default float32's); values close."""
    (d_o, i_o), (d_t, i_t) = ours, theirs
    assert i_o.dtype == torch.int64 and d_o.dtype == d_t.dtype
    assert i_o.shape[1] == i_t.shape[1] and d_o.shape[1] == 1
    if torch.equal(i_o, i_t):
        torch.testing.assert_close(d_o, d_t, atol=atol, rtol=1e-4)
        return
    # only near-ties may differ: every pair of one side whose row the other side matched
    # elsewhere must be as near as the other side's pick
    assert not ratio or abs(len(i_o) - len(i_t)) <= max(2, len(i_t) // 50)
    rows = sorted(set(i_o[:, 0].tolist()) & set(i_t[:, 0].tolist()))
    if not rows:
        return
    got = {int(a): int(b) for a, b in i_o.tolist()}
    want = {int(a): int(b) for a, b in i_t.tolist()}
    a = desc1[rows].double()
    pick_o = torch.tensor([got[r] for r in rows])
    pick_t = torch.tensor([want[r] for r in rows])
    assert_same_up_to_ties(a, desc2, pick_o, pick_t, "l2", tol=tolerance(desc1, desc2, "l2") if tie is None else tie)


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("sizes", [(300, 400), (400, 300), (1, 5), (5, 1), (2, 2)])
def test_random_descriptors_give_kornias_matches(name, sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    d1, d2 = torch.randn(sizes[0], 32, generator=g), torch.randn(sizes[1], 32, generator=g)
    same_matches(getattr(dk, name)(d1, d2), getattr(kornia_feature, name)(d1, d2), d1, d2, ratio="snn" in name)


@pytest.mark.parametrize("name", PLAIN)
def test_sift_descriptors_of_photographs(name):
    d1, d2 = sift_like(500, 1), sift_like(600, 2)
    ours, theirs = getattr(dk, name)(d1, d2), getattr(kornia_feature, name)(d1, d2)
    # Kornia's torch.cdist takes the matrix-product form: near 0 its distances carry the
    # expansion's cancellation, about sqrt(eps32 * |a|^2) = 5e-4 for unit descriptors (a patch
    # drawn twice is 0 here and up to 1.3e-3 there); densematch recomputes them directly
    same_matches(ours, theirs, d1, d2, ratio="snn" in name, atol=2e-3)
    if name == "match_nn":
        twins = (d1[:, None, :] == d2[None, :, :]).all(-1).any(1)
        assert twins.any() and (ours[0][twins] == 0).all()


def test_exact_duplicates_tie_to_the_lower_index_and_fail_the_ratio_test():
    g = torch.Generator().manual_seed(0)
    d2 = torch.randn(50, 16, generator=g)
    d2 = torch.cat([d2, d2[:10]])  # rows 50-59 repeat rows 0-9
    d1 = d2[:20] + 1e-3 * torch.randn(20, 16, generator=g)
    _, idx = dk.match_nn(d1, d2)
    assert torch.equal(idx[:, 1], torch.arange(20))  # the copy at 50+ never wins
    _, idx = dk.match_snn(d1, d2, 0.99)
    assert (idx[:, 0] >= 10).all()  # a second neighbour as near as the first: ratio 1 > 0.99
    _, k_idx = kornia_feature.match_snn(d1, d2, 0.99)
    assert torch.equal(idx, k_idx)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", PLAIN)
def test_dtypes(name, dtype):
    d1, d2 = sift_like(200, 3).to(dtype), sift_like(250, 4).to(dtype)
    ours, theirs = getattr(dk, name)(d1, d2), getattr(kornia_feature, name)(d1, d2)
    # Kornia rounds its distances to the input dtype before ranking them: its picks are the
    # nearest up to that rounding (distances of these unit descriptors are at most 2)
    tie = None if dtype == torch.float64 else 4 * torch.finfo(dtype).eps
    atol = 1e-10 if dtype == torch.float64 else 4 * torch.finfo(dtype).eps
    same_matches(ours, theirs, d1.double(), d2.double(), ratio="snn" in name, atol=atol, tie=tie)


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (0, 0), (1, 1)])
def test_empty_and_single_inputs_return_what_kornia_returns(name, sizes):
    d1, d2 = torch.randn(sizes[0], 8), torch.randn(sizes[1], 8)
    ours, theirs = getattr(dk, name)(d1, d2), getattr(kornia_feature, name)(d1, d2)
    for o, t in zip(ours, theirs, strict=True):
        assert o.shape == t.shape and o.dtype == t.dtype


@pytest.mark.parametrize("name", PLAIN)
def test_a_given_distance_matrix_is_used_as_kornia_uses_it(name):
    g = torch.Generator().manual_seed(5)
    d1, d2 = torch.randn(30, 8, generator=g), torch.randn(40, 8, generator=g)
    dm = torch.rand(30, 40, generator=g)  # not the descriptors' distances: it must win
    ours, theirs = getattr(dk, name)(d1, d2, dm=dm), getattr(kornia_feature, name)(d1, d2, dm=dm)
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0])
    with pytest.raises(ValueError, match=r"dm must have shape \(B1, B2\) = \(30, 40\)"):
        getattr(dk, name)(d1, d2, dm=dm.T)


@pytest.mark.parametrize("name", PLAIN)
def test_distances_carry_gradients_to_the_descriptors(name):
    g = torch.Generator().manual_seed(6)
    d1 = torch.rand(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    d2 = torch.rand(7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    fn = getattr(dk, name)
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, **({"th": 0.99} if "snn" in name else {}))[0], (d1, d2))
    dists, _ = fn(d1, d2)
    kd, _ = getattr(kornia_feature, name)(d1, d2)
    (ga,) = torch.autograd.grad(dists.sum(), d1) if dists.numel() else (torch.zeros_like(d1),)
    (gk,) = torch.autograd.grad(kd.sum(), d1) if kd.numel() else (torch.zeros_like(d1),)
    torch.testing.assert_close(ga, gk)


def test_fginn_matches_kornia_one_and_two_way():
    from kornia.feature.laf import laf_from_center_scale_ori

    g = torch.Generator().manual_seed(7)
    d1, d2 = sift_like(300, 5), sift_like(320, 6)
    lafs1 = laf_from_center_scale_ori(torch.rand(1, 300, 2, generator=g) * 100)
    lafs2 = laf_from_center_scale_ori(torch.rand(1, 320, 2, generator=g) * 100)
    for mutual in (False, True):
        for spatial_th in (0.5, 10.0, 1000.0):
            args = (d1, d2, lafs1, lafs2, 0.9, spatial_th, mutual)
            same_matches(dk.match_fginn(*args), kornia_feature.match_fginn(*args), d1, d2, ratio=True)
    assert dk.match_fginn(d1, d2[:1], lafs1, lafs2[:, :1])[1].shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_smnn_batched_with_masks_matches_kornia(dtype):
    from kornia.feature.matching import match_smnn_batched

    g = torch.Generator().manual_seed(8)
    d1 = torch.randn(3, 60, 16, generator=g).to(dtype)
    d2 = torch.randn(3, 70, 16, generator=g).to(dtype)
    m1, m2 = torch.rand(3, 60, generator=g) < 0.8, torch.rand(3, 70, generator=g) < 0.7
    m2[2, 1:] = False  # one valid descriptor: that pair gives no match
    d1 = d1.masked_fill(~m1[..., None], float("nan"))  # padding is never read
    for masks in ((None, None), (m1, m2)):
        if masks[0] is None:
            a, b = d1.nan_to_num(0.0), d2
        else:
            a, b = d1, d2
        r_o, i_o = dk.match_smnn_batched(a, b, 0.9, None, *masks)
        r_t, i_t = match_smnn_batched(a, b, 0.9, None, *masks)
        assert i_o.shape[1] == 3 and r_o.dtype == dtype
        for item in range(3):  # each pair of sets as match_smnn's (rows, cols), near-ties aside
            mine, theirs = i_o[:, 0] == item, i_t[:, 0] == item
            rows = a[item].float().nan_to_num(0.0)  # padding is never a match, and never judged
            atol = 1e-2 if dtype == torch.float16 else 1e-5
            ours_item, theirs_item = (r_o[mine], i_o[mine, 1:]), (r_t[theirs], i_t[theirs, 1:])
            same_matches(ours_item, theirs_item, rows, b[item].float(), ratio=True, atol=atol)
    assert (i_o[:, 0] != 2).all()  # the masked run: pair 2 has one valid descriptor


def test_descriptor_matcher_module_scripts_and_checks_its_mode():
    g = torch.Generator().manual_seed(9)
    d1, d2 = torch.randn(40, 8, generator=g), torch.randn(50, 8, generator=g)
    for mode in ("nn", "MNN", "snn", "smnn"):
        ours = dk.DescriptorMatcher(mode, 0.9)
        scripted = torch.jit.script(dk.DescriptorMatcher(mode, 0.9))
        theirs = kornia_feature.DescriptorMatcher(mode, 0.9)(d1, d2)
        same_matches(ours(d1, d2), theirs, d1, d2, ratio=mode.lower() in ("snn", "smnn"))
        same_matches(scripted(d1, d2), ours(d1, d2), d1, d2, ratio=mode.lower() in ("snn", "smnn"))
    with pytest.raises(NotImplementedError, match="fginn is not supported"):
        dk.DescriptorMatcher("fginn")
    assert repr(dk.DescriptorMatcher("smnn", 0.9, memory="64MiB")) == (
        "DescriptorMatcher(match_mode='smnn', th=0.9, memory='64MiB')"
    )


def test_snn_never_builds_the_distance_matrix():
    # 6000 x 6000 float32 distances would take 137 MiB; Kornia's cdist holds about twice that
    extra = peak_extra(
        """
        from densematch.kornia import match_snn
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(6000, 128, generator=g), torch.randn(6000, 128, generator=g)
        def run(small):
            n = 100 if small else 6000
            match_snn(a[:n], b[:n], 0.8, memory="16MiB")
        """
    )
    assert extra < 24 * 2**20, f"{extra / 2**20:.1f} MiB above the inputs"
