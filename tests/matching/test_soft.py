"""soft_match: against a float64 dense reference, gradients, masks, batches, the memory cap."""

import itertools

import numpy as np
import pytest
import torch

from densematch import soft_match
from densematch.matching import soft as _soft

from .._memory import peak_extra
from .._reference import patch_features


def dense(a, b, temperature, mode, mask_b=None):
    """The float64 reference, through the full Na x Nb weights."""
    a, b = a.double(), b.double()
    q = torch.nn.functional.normalize(a.reshape(-1, a.shape[-1]), dim=1)
    k = torch.nn.functional.normalize(b.reshape(-1, b.shape[-1]), dim=1)
    s = q @ k.T / temperature
    if mask_b is not None:
        s[:, ~torch.as_tensor(mask_b).reshape(-1)] = -torch.inf
    # in the log domain: dual weights that underflow are still renormalised per row
    logp = s.log_softmax(1)
    if mode == "dual_softmax":
        logp = torch.nan_to_num(logp + s.log_softmax(0), nan=-torch.inf)  # masked-out columns
    p = logp.exp()
    hb, wb = b.shape[:2]
    pos = torch.stack(torch.meshgrid(torch.arange(hb), torch.arange(wb), indexing="ij"), -1).reshape(-1, 2).double()
    w = logp.softmax(1)
    mean = w @ pos
    var = w @ pos.square() - mean.square()
    grid = a.shape[:2]
    return mean.reshape(*grid, 2), var.sum(1).clamp_min(0).sqrt().reshape(grid), p.amax(1).reshape(grid)


@pytest.fixture(scope="module")
def photo(camera_small):
    f = patch_features(camera_small, 5)  # (64, 64, 25)
    return f[10:26, 12:30], f[8:28, 10:32]


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(_soft, "_TILE_B", 37)  # many column tiles, uneven
    return 37 * 8 * 6 * 12  # a budget of about a dozen rows per tile


# the plain softmax runs through torch's fused attention where it can, else tiles: both checked
PATHS = [("softmax", True), ("softmax", False), ("dual_softmax", False)]


@pytest.fixture(params=PATHS, ids=["softmax-fused", "softmax-tiled", "dual_softmax"])
def mode(request, monkeypatch):
    name, fused = request.param
    monkeypatch.setattr(_soft, "_SDPA", fused)
    return name


def rounding_bounds(dtype, a, b, temperature, want):
    """How far rounding in ``dtype`` may move soft_match's (coords, spread, max_weight) from the
    exact ``want``, per pixel, from a stated bound (first order in delta / T, which is ~1e-4
    here). Every cosine lies within delta = 4 (C + 2) u of the exact one (gamma_C of the
    product, twice for the rows' normalisation), so each weight w_j moves by w_j (e_j - sum_l
    w_l e_l) / T with |e| <= delta. Then, by Cauchy-Schwarz over the weights, the expected
    position moves by at most 2 delta / T x spread, the spread by delta / T x spread and the
    largest weight by 2 delta / T of itself; the sums over b's n pixels add (n + 2) u of their
    terms' size (the grid's extent x for positions), twice (the reference rounds too). The spread
    is the root of E|p|^2 - |mean|^2, whose rounding dv = 4 (n + 2) u x^2 moves it by at most
    min(sqrt(dv), dv / spread)."""
    u = float(torch.finfo(dtype).eps) / 2
    c, n, x = a.shape[-1], b.shape[0] * b.shape[1], max(b.shape[:2])
    rel = 2 * 4 * (c + 2) * u / temperature
    _, spread, top = want
    sums = 2 * (n + 2) * u * x
    dv = 4 * (n + 2) * u * x**2
    cancel = torch.minimum(torch.full_like(spread, dv**0.5), dv / spread)
    return (rel * spread[..., None] + sums, rel / 2 * spread + cancel, rel * top + 2 * (n + 2) * u)


@pytest.mark.parametrize("temperature", [0.05, 0.3])
def test_equals_the_dense_reference(photo, small_tiles, mode, temperature):
    a, b = photo
    want = dense(a, b, temperature, mode)
    # small tiles, and for the dual also one matrix product shared by its passes (it fits 64 MiB)
    budgets = (small_tiles, 2**26) if mode == "dual_softmax" else (small_tiles,)
    # inputs that want gradients take torch's fused attention (float32, "softmax-fused"), others the tiles
    for dtype, memory, grad in itertools.product((torch.float32, torch.float64), budgets, (False, True)):
        x, y = (v.detach().to(dtype).clone().requires_grad_(grad) for v in (a, b))
        got = soft_match(x, y, temperature=temperature, mode=mode, memory=memory)
        assert got.coords.dtype == dtype and got.coords.shape == (16, 18, 2)
        bounds = rounding_bounds(dtype, a, b, temperature, want)
        for have, ref, bound in zip((got.coords, got.spread, got.max_weight), want, bounds, strict=True):
            over = (have.double() - ref).abs() - bound
            assert (over <= 0).all(), f"{int((over > 0).sum())} values beyond the bound, worst by {float(over.max())}"


def test_the_largest_weight_costs_no_second_pass(photo, monkeypatch):
    # on a CPU the plain softmax's tiles find the largest weight on the way, with gradients (the
    # flash kernel's backward follows) or without: no pass of products of its own
    calls = []
    monkeypatch.setattr(_soft, "_row_max", lambda *args: calls.append(args))
    monkeypatch.setattr(_soft, "_row_stats", lambda *args: calls.append(args))
    a, b = photo
    for grad in (False, True):
        x, y = a.clone().requires_grad_(grad), b.clone().requires_grad_(grad)
        got = soft_match(x, y, temperature=0.1)
        assert calls == [] and bool((got.max_weight > 0).all() and (got.max_weight <= 1).all())


def test_the_gpus_fused_path_takes_the_kernels_log_sum_exp(photo, monkeypatch):
    # the fused attention path a GPU takes, run here through the CPU's flash kernel: its moments,
    # its largest weight (the kernel's log-sum-exp against one pass of maxima, no pass of
    # exponentials) and its log-sum-exp equal the tiles', and so do the tiles' gradients from them
    monkeypatch.setattr(_soft, "_row_stats", lambda *args: pytest.fail("a second pass of exponentials"))
    q, k = (torch.nn.functional.normalize(f.reshape(-1, f.shape[-1]), dim=1) for f in photo)
    v = torch.randn(k.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = _soft._fused(q, k, v, 10.0, 2**24)
    want = _soft._attention_forward(q, k, v, 10.0, False, 2**24)[:3]
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine.double(), theirs.double(), atol=2e-4 * float(theirs.abs().max()), rtol=0)
    assert bool((got[1] > 0).all() and (got[1] <= 1).all())
    grad = torch.randn(q.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = [_soft._attention_backward(grad, q, k, v, out, lse, None, 10.0, 2**24) for out, _, lse in (got, want)]
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=2e-4 * float(theirs.abs().max()), rtol=0)


def test_float32_gradients_through_the_flash_backward_equal_the_dense_recipes(photo):
    # the tiles' forward hands its log-sum-exp and moments to torch's flash backward (float32,
    # narrow features); float64 runs the tiles' own backward (test_gradients)
    x2, y2 = (t.detach().double().requires_grad_() for t in photo)
    coords, spread, _ = dense(x2, y2, 0.1, "softmax")
    (coords.sum() + spread.sum()).backward()
    x, y = (t.detach().clone().requires_grad_() for t in photo)
    got = soft_match(x, y, temperature=0.1)
    (got.coords.sum() + got.spread.sum()).backward()
    for mine, want in ((x.grad, x2.grad), (y.grad, y2.grad)):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine.double(), want, atol=2e-4 * float(want.abs().max()), rtol=0)


def test_gradients(photo, monkeypatch, mode):
    a, b = (x[:3, :4, :3].double().requires_grad_() for x in photo)
    monkeypatch.setattr(_soft, "_TILE_B", 5)  # 12 pixels of b in tiles of 5, 5 and 2

    def f(x, y):
        r = soft_match(x, y, temperature=0.2, mode=mode, memory=5 * 80 * 4)  # a in tiles of 4 rows
        return r.coords, r.spread

    assert torch.autograd.gradcheck(f, (a, b), eps=1e-6, atol=1e-5, rtol=1e-4)
    # and the same gradient as the dense reference's, on the photo's features, in tiles and
    # (dual) with the products shared where they fit
    x2, y2 = (t.detach().double().requires_grad_() for t in photo)
    coords, spread, _ = dense(x2, y2, 0.1, mode)
    (coords.sum() + spread.sum()).backward()
    for memory in (5 * 80 * 4, 2**26) if mode == "dual_softmax" else (5 * 80 * 4,):
        x, y = (t.detach().double().requires_grad_() for t in photo)
        got = soft_match(x, y, temperature=0.1, mode=mode, memory=memory)
        (got.coords.sum() + got.spread.sum()).backward()
        torch.testing.assert_close(x.grad, x2.grad, atol=1e-8, rtol=1e-6)
        torch.testing.assert_close(y.grad, y2.grad, atol=1e-8, rtol=1e-6)


def test_masks_and_batches(photo, small_tiles, mode):
    a, b = photo
    mask = torch.zeros(b.shape[:2], dtype=torch.bool)
    mask[5:15, 3:20] = True
    got = soft_match(a, b, temperature=0.1, mask_b=mask, memory=small_tiles, mode=mode)
    want = dense(a, b, 0.1, mode, mask)
    torch.testing.assert_close(got.coords.double(), want[0], atol=1e-4, rtol=0)
    inside = (got.coords[..., 0] >= 5 - 1e-4) & (got.coords[..., 0] <= 14 + 1e-4)
    assert inside.all(), "weight on a masked-out pixel of b"
    batch = soft_match(torch.stack([a, a.flip(0)]), torch.stack([b, b]), temperature=0.1, memory=small_tiles)
    torch.testing.assert_close(batch.coords[0], soft_match(a, b, temperature=0.1, memory=small_tiles).coords)
    torch.testing.assert_close(batch.coords[1], soft_match(a.flip(0), b, temperature=0.1, memory=small_tiles).coords)
    shared = soft_match(torch.stack([a, a]), torch.stack([b, b]), temperature=0.1, mask_b=mask, mode=mode)
    torch.testing.assert_close(shared.coords[1], got.coords, atol=1e-5, rtol=0)
    chw = soft_match(a.permute(2, 0, 1), b.permute(2, 0, 1), temperature=0.1, layout="chw", memory=small_tiles)
    torch.testing.assert_close(chw.coords, soft_match(a, b, temperature=0.1, memory=small_tiles).coords)


def test_sharp_weights_find_the_match(photo):
    a, b = photo  # a is b shifted by (2, 2)
    got = soft_match(a, b, temperature=0.005)
    rows, cols = np.meshgrid(np.arange(16) + 2, np.arange(18) + 2, indexing="ij")
    err = np.hypot(got.coords[..., 0].numpy() - rows, got.coords[..., 1].numpy() - cols)
    sharp = got.spread.numpy() < 0.5
    assert sharp.mean() > 0.5 and np.median(err[sharp]) < 0.05


@pytest.mark.parametrize(
    ("mode", "mib"),
    # the dual at 96 MiB keeps its 64 MiB of products for both passes, its tiles in the rest
    [("softmax", 12), ("dual_softmax", 12), ("dual_softmax", 96)],
)
def test_memory_stays_under_the_budget(mode, mib):
    # 64 x 64 against 64 x 64, forward and backward: the float64 weights alone would be 128 MiB
    extra = peak_extra(
        f"""
        g = torch.Generator().manual_seed(0)
        a = torch.randn(64, 64, 16, generator=g, requires_grad=True)
        b = torch.randn(64, 64, 16, generator=g, requires_grad=True)
        def run(small):
            x, y = (a[:8, :8], b[:8, :8]) if small else (a, b)
            r = densematch.soft_match(x, y, temperature=0.1, memory="{mib}MiB", mode="{mode}")
            (r.coords.sum() + r.spread.sum()).backward()
        """
    )
    held = 2 * 64 * 64 * 16 * 4 * 4  # gradients, normalised copies, float64 gradient sums
    assert extra <= mib * 2**20 + held + 8 * 2**20, f"peak {extra / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"temperature": 0}, ValueError, r"temperature must be in \(0, inf\]"),
        ({"mode": "sinkhorn"}, ValueError, "mode must be one of"),
        ({"temperature": "hot"}, TypeError, "temperature must be a real number"),
        ({"layout": "flat"}, ValueError, "positions need a 2-D grid"),
        ({"mask_b": torch.zeros(5, 6, dtype=torch.bool)}, ValueError, "at least one pixel of b"),
    ],
)
def test_bad_input(kwargs, error, pattern):
    x = torch.randn(5, 6, 4)
    with pytest.raises(error, match=pattern):
        soft_match(x, x, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1e-3, 1e-4])
def test_dual_softmax_at_low_temperature_renormalises_in_the_log_domain(dtype, temperature):
    # every dual weight of some rows underflows here: they used to fall back to b's centre with a
    # spread of 1e-6 (reading as certain) and NaN gradients
    g = torch.Generator().manual_seed(0)
    a = torch.randn(9, 11, 16, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(10, 12, 16, generator=g, dtype=dtype).requires_grad_()
    got = soft_match(a, b, temperature=temperature, mode="dual_softmax")
    coords, _, top = dense(a.detach(), b.detach(), temperature, "dual_softmax")
    assert torch.isfinite(coords).all()
    # at these temperatures the weight of a row sits on its best column: coords are that column
    torch.testing.assert_close(got.coords.double(), coords, atol=1e-3, rtol=0)
    torch.testing.assert_close(got.max_weight.double(), top, atol=1e-6, rtol=1e-3)
    (got.coords.sum() + got.spread.sum()).backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


def test_the_default_temperature_finds_a_photos_shift():
    # temperature="auto" is scale-free: on the library's own patch features of a pure shift
    # (synthetic.match_pairs()'s first pair) it matches like the hard argmax, where the old
    # fixed default of 0.1 put every pixel tens of pixels off (PCK@1 0%)
    from densematch import match
    from densematch.app import synthetic
    from densematch.app.features import dense_features

    pair = synthetic.match_pairs()[0]
    fa, fb = dense_features(pair.a, "patch"), dense_features(pair.b, "patch")
    soft = synthetic.pck(soft_match(fa, fb).coords.detach().numpy(), pair.truth, pair.inside, (1,))[0]
    hard = synthetic.pck(match(fa, fb).coords.float().numpy(), pair.truth, pair.inside, (1,))[0]
    fixed = synthetic.pck(soft_match(fa, fb, temperature=0.1).coords.detach().numpy(), pair.truth, pair.inside, (1,))[0]
    assert soft >= 0.9 and soft >= hard - 0.02 and fixed < 0.1


@pytest.mark.parametrize("mode", ["softmax", "dual_softmax"])
def test_autocast_does_not_reach_the_weights(photo, mode):
    # under bfloat16 autocast the coordinates moved by up to 0.045 px: soft_match opts out
    a, b = (t.clone().requires_grad_() for t in photo)
    plain = soft_match(a, b, temperature=0.05, mode=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = soft_match(a, b, temperature=0.05, mode=mode)
    assert cast.coords.dtype == torch.float32
    assert torch.equal(cast.coords, plain.coords) and torch.equal(cast.spread, plain.spread)
    (ga,) = torch.autograd.grad(cast.coords.sum(), a)
    (want,) = torch.autograd.grad(plain.coords.sum(), a)
    assert torch.equal(ga, want)
