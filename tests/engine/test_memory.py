"""The memory cap, measured: peak RSS of a fresh subprocess, above its RSS before the call."""

import pytest

from .._memory import peak_extra

MATCH = """
g = torch.Generator().manual_seed(0)
a = torch.randn({n}, {n}, 64, generator=g)
b = torch.randn({n}, {n}, 64, generator=g)
def run(small):
    x, y = (a[:20, :20], b[:20, :20]) if small else (a, b)
    with densematch.config_context(half="{half}"):
        densematch.match(x, y, metric="{metric}", memory="{mib}MiB", mutual={mutual})
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "mib", "metric", "mutual", "half"),
    [
        # the full matrix would be 1 GiB (160x160) and 324 MiB (96x96): far above each budget
        (160, 32, "cosine", False, "auto"),
        (160, 32, "l2", True, "auto"),
        (96, 16, "l1", False, "auto"),
        (96, 16, "l2", False, "bfloat16"),  # the certified half-precision search
    ],
)
def test_match_stays_under_its_budget(n, mib, metric, mutual, half):
    extra = peak_extra(MATCH.format(n=n, mib=mib, metric=metric, mutual=mutual, half=half))
    outputs = n * n * (8 + 16 + 4 + 1)
    assert extra <= mib * 2**20 + outputs, f"peak working memory {extra / 2**20:.1f} MiB"


WIDE = """
g = torch.Generator().manual_seed(0)
a = torch.randn(64, 64, 512, generator=g)
b = torch.randn(64, 64, 512, generator=g)
def run(small):
    x, y = (a[:20, :20], b[:20, :20]) if small else (a, b)
    with densematch.config_context(half="{half}"):
        densematch.match(x, y, metric="cosine", memory="{mib}MiB")
"""


@pytest.mark.slow
@pytest.mark.parametrize("half", ["bfloat16", "off"])
def test_two_workers_share_the_references_prepared_once_within_the_budget(half):
    # two workers, each with its own tiles, plan in the whole budget with the references
    # prepared once counted once (they took half the budget each before: at 96 MiB the
    # certified search then prepared them again for every query tile)
    import torch

    from densematch.engine import driver
    from densematch.engine.half import HalfSearch
    from densematch.engine.plain import PlainSearch
    from densematch.metrics import get_metric
    from densematch.precision import Precision

    mib = 96
    p = Precision(half=torch.bfloat16 if half == "bfloat16" else None)
    strategy = HalfSearch if p.half is not None else PlainSearch

    def plan(budget: int, workers: int) -> object:
        return driver._plan(
            strategy, 4096, 4096, 512, 1, budget, metric=get_metric("cosine"), device=torch.device("cpu"),
            precision=p, in_dtype=torch.float32, tiles=None, reserved=0, workers=workers,
        )[1]  # fmt: skip

    shared, alone = plan(mib * 2**20, 2), plan(mib * 2**20, 1)
    assert shared.whole_b and shared.bytes <= mib * 2**20
    assert shared.tile_a < alone.tile_a  # (two workers' tiles beside the references)
    if half == "bfloat16":
        assert not plan(mib * 2**19, 1).whole_b  # (each worker's half alone, as before)
    extra = peak_extra(WIDE.format(half=half, mib=mib))
    assert extra <= mib * 2**20 + 64 * 64 * (8 + 16 + 4 + 1), f"peak working memory {extra / 2**20:.1f} MiB"


TRAIN = """
g = torch.Generator().manual_seed(0)
x = torch.randn(4, {d}, 64, 64, generator=g, requires_grad=True)
p = torch.randn(256, {d}, generator=g, requires_grad=True)
def run(small):
    xs = x[:, :, :4, :4] if small else x
    d = densematch.pairwise_distance(xs, p, metric="{metric}", memory="{mib}MiB")
    d.backward(torch.ones_like(d))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("metric", "d", "mib"), [("l1", 128, 64), ("l2", 64, 16)])
def test_distances_forward_backward_keep_their_budget(metric, d, mib):
    # the broadcast would be 4*64*64*256*d floats (2 GiB for l1's d=128)
    extra = peak_extra(TRAIN.format(metric=metric, d=d, mib=mib))
    output = 4 * 256 * 64 * 64 * 4
    grads = 4 * d * 64 * 64 * 4 + 256 * d * 4
    # output + its gradient, x's gradient and its float copy, and the tiles
    assert extra <= 2 * output + 2 * grads + mib * 2**20, f"peak {extra / 2**20:.1f} MiB"


NEAREST = """
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 16, 128, 128, generator=g)
p = torch.randn(4096, 16, generator=g)
def run(small):
    with densematch.config_context(half="{half}"):
        densematch.nearest_prototype(x[:, :, :4, :4] if small else x, p, metric="{metric}", memory="{mib}MiB")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("metric", "half", "mib"),
    [("l2", "auto", 32), ("l2", "bfloat16", 16), ("cosine", "bfloat16", 16), ("sqeuclidean", "bfloat16", 16)],
)
def test_nearest_prototype_never_builds_the_full_tensor(metric, half, mib):
    # (N, F, H, W) would be 2*4096*128*128 floats = 512 MiB; memory= is a hard cap, and the
    # outputs (distance and index, and their reordered copies) come on top
    extra = peak_extra(NEAREST.format(metric=metric, half=half, mib=mib))
    assert extra <= mib * 2**20 + 2 * 128 * 128 * (8 + 4) * 2, f"peak {extra / 2**20:.1f} MiB"


LOCAL_HUGE_RADIUS = """
g = torch.Generator().manual_seed(0)
a, b = torch.randn(3, 3, 16, generator=g), torch.randn(3, 3, 16, generator=g)
def run(small):
    densematch.local_match(a, b, 1 if small else {radius}, k=2, memory="8MiB")
"""


@pytest.mark.slow
@pytest.mark.parametrize("radius", [1000, 3000, 10_000])
def test_a_radius_past_the_maps_costs_nothing(radius):
    # a 3x3 map: offsets past +-2 reach no pixel of b; they took 490 MiB (radius 1000), 4.6 GiB
    # (3000) and the OOM killer (10^4) as a list of offsets
    extra = peak_extra(LOCAL_HUGE_RADIUS.format(radius=radius))
    assert extra <= 8 * 2**20, f"peak {extra / 2**20:.1f} MiB"


LOCAL_VOLUME_HUGE_RADIUS = """
g = torch.Generator().manual_seed(0)
a, b = torch.randn(40, 40, 8, generator=g), torch.randn(40, 40, 8, generator=g)
def run(small):
    x, y = (a[:4, :4], b[:4, :4]) if small else (a, b)
    densematch.local_cost_volume(x, y, 1 if small else 60, memory="8MiB")
"""


@pytest.mark.slow
def test_a_cost_volume_past_the_maps_holds_one_output():
    # offsets past +-39 reach nothing: their planes were filled in a second output-sized tensor,
    # 137 MiB over an 8 MiB budget; the reachable ones are now written into the output in place
    extra = peak_extra(LOCAL_VOLUME_HUGE_RADIUS)
    output = 121 * 121 * 40 * 40 * 4
    assert extra <= output + 8 * 2**20, f"peak {(extra - output) / 2**20:.1f} MiB past the output"


ALIGN_WIDE_SCALES = """
g = torch.Generator().manual_seed(0)
image = torch.rand(60, 60, generator=g)
template = densematch.warp(image, 1.0, 1.0, 5.0, 5.0, (45, 45))
def run(small):
    top = 1.5 if small else 3.5
    densematch.align(template, image, scale_h=(0.8, top), scale_w=(0.8, top), memory="8MiB")
"""


@pytest.mark.slow
def test_align_keeps_its_budget_over_wide_scale_ranges():
    # the valid shifts of every scale pair were built whole: 55 x 55 scale pairs of up to 84 x 84
    # shifts at the coarse level here, 20 MiB under memory="8MiB" (1.1 GB for scales (0.8, 8))
    extra = peak_extra(ALIGN_WIDE_SCALES)
    assert extra <= 8 * 2**20 + 6 * 2**20, f"peak {extra / 2**20:.1f} MiB"


SOFT = """
g = torch.Generator().manual_seed(0)
a = torch.randn(56, 56, 64, generator=g, requires_grad=True)
b = torch.randn(56, 56, 64, generator=g, requires_grad=True)
def run(small):
    x, y = (a[:8, :8], b[:8, :8]) if small else (a, b)
    r = densematch.soft_match(x, y, temperature=0.1, mode="{mode}", memory="{mib}MiB")
    if {backward}:
        (r.coords.sum() + r.spread.sum()).backward()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "mib", "backward"),
    [("softmax", 4, True), ("softmax", 16, True), ("dual_softmax", 4, True), ("dual_softmax", 16, False)],
)
def test_soft_match_keeps_its_budget_beside_the_per_input_state(mode, mib, backward):
    # soft_match's docstring: outside memory= lie the unit copies of a and b, and in the backward
    # their gradients' accumulators and the normalisation's backward, each (Na + Nb) x C values
    extra = peak_extra(SOFT.format(mode=mode, mib=mib, backward=backward))
    # 3136 x 3136 pairs: 37.5 MiB of float32 weights, 9 times the smaller budget, 2.3 times the larger
    inputs = 2 * 56 * 56 * 64 * 4
    grads = inputs if backward else 0  # a.grad and b.grad: the call's outputs
    state = inputs * (3 if backward else 1)
    assert extra <= mib * 2**20 + grads + state + 2 * 2**20, f"peak {extra / 2**20:.1f} MiB"


LOCAL_VOLUME_BACKWARD = """
g = torch.Generator().manual_seed(0)
a = torch.randn(96, 128, 64, generator=g, requires_grad=True)
b = torch.randn(96, 128, 64, generator=g, requires_grad=True)
def run(small):
    x, y = (a[:8, :8], b[:8, :8]) if small else (a, b)
    densematch.local_cost_volume(x, y, 4, metric="dot", memory="4MiB").sum().backward()
"""


@pytest.mark.slow
def test_local_volume_backward_keeps_its_budget():
    extra = peak_extra(LOCAL_VOLUME_BACKWARD)
    outputs = 81 * 96 * 128 * 4 + 2 * 96 * 128 * 64 * 4  # the volume, and a's and b's gradients
    assert extra <= 4 * 2**20 + outputs, f"peak {extra / 2**20:.1f} MiB"
