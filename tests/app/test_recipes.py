"""The plain recipes ``densematch bench`` times densematch against compute what densematch does:
a peer that answered something else would make the speed-ups meaningless."""

import pytest
import torch

from densematch import align, local_cost_volume, match, soft_match, warp
from densematch.app import recipes
from densematch.app.synthetic import alignment_cases

from .._reference import assert_same_up_to_ties


def test_blockwise_loop_picks_match_s_best():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 24, 16, generator=g), torch.randn(18, 22, 16, generator=g)
    got = recipes.blockwise_argmax(a, b, block=100)
    want = match(a.reshape(-1, 16), b.reshape(-1, 16), layout="flat").index.reshape(-1)
    assert_same_up_to_ties(a.reshape(-1, 16), b.reshape(-1, 16), got, want, "cosine")


def test_shifted_products_are_the_local_cost_volume():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 8, 12, 15, generator=g), torch.randn(1, 8, 12, 15, generator=g)
    got = recipes.shifted_volume(a, b, 2)
    want = local_cost_volume(a, b, 2, metric="dot", layout="chw")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_dual_softmax_gives_soft_match_s_positions():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(9, 11, 16, generator=g), torch.randn(10, 12, 16, generator=g)
    got = recipes.dense_dual_softmax(a, b, 0.1).reshape(9, 11, 2)
    want = soft_match(a, b, temperature=0.1, mode="dual_softmax").coords
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_coarse_to_fine_recipe_finds_a_warp_on_its_own_grid():
    # a warp its coarse grid holds exactly (5% scales, 10-pixel shifts): found exactly, as align
    # finds it; anything off its grids it finds only to 1% and one pixel, if at all
    c = next(alignment_cases(1, seed=3, kinds=("photo",), noise=(0.0,)))
    truth = (1.05, 0.95, 20.0, 10.0)
    tpl = warp(c.image, *truth, (100, 100))
    got = recipes.coarse_to_fine_align(tpl, c.image)
    assert got == pytest.approx(truth, abs=1e-5)
    a = align(tpl, c.image)
    assert (a.scale_h, a.scale_w, a.shift_y, a.shift_x) == pytest.approx(truth, abs=1e-3)
