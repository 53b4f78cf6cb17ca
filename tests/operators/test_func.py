"""torch.func (issue 40, goal 5): vmap over the leading dimension of pairwise_distance and
soft_match, grad and jacrev through them and through local_cost_volume, each against torch's
own operators in float64 (dense references); second order raises one clear
NotImplementedError, as cdist's does."""

import pytest
import torch

import densematch


def _reference(x: torch.Tensor, p: torch.Tensor, metric: str) -> torch.Tensor:
    """(N, F, H, W) distances by plain broadcasting (float64 inputs)."""
    diff = x[:, None] - p[None, :, :, None, None]  # (N, F, D, H, W)
    if metric == "l2":
        return diff.square().sum(2).sqrt()
    if metric == "l1":
        return diff.abs().sum(2)
    dot = torch.einsum("ndhw,fd->nfhw", x, p)
    if metric == "dot":
        return dot
    return 1 - dot / (x.norm(dim=1)[:, None] * p.norm(dim=1)[None, :, None, None])  # cosine


@pytest.fixture
def maps() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 6, 4, 5, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)


@pytest.mark.parametrize("metric", ["l2", "cosine", "l1", "dot"])
def test_vmap_grad_and_jacrev_through_pairwise_distance(maps, metric):
    x, p = maps

    def mine(a, b):
        return densematch.pairwise_distance(a, b, metric=metric)

    def theirs(a, b):
        return _reference(a, b, metric)

    xs, ps = torch.stack([x, 2 * x, -x]), torch.stack([p, p + 1, 0.5 * p])
    for dims in ((0, None), (None, 0), (0, 0)):
        got = torch.func.vmap(mine, in_dims=dims)(xs if dims[0] == 0 else x, ps if dims[1] == 0 else p)
        want = torch.func.vmap(theirs, in_dims=dims)(xs if dims[0] == 0 else x, ps if dims[1] == 0 else p)
        torch.testing.assert_close(got, want)
    weights = torch.rand(2, 3, 4, 5, dtype=torch.float64)
    got = torch.func.grad(lambda a, b: (mine(a, b) * weights).sum(), argnums=(0, 1))(x, p)
    want = torch.func.grad(lambda a, b: (theirs(a, b) * weights).sum(), argnums=(0, 1))(x, p)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(torch.func.jacrev(lambda b: mine(x, b))(p), torch.func.jacrev(lambda b: theirs(x, b))(p))
    torch.testing.assert_close(torch.func.jacrev(lambda a: mine(a, p))(x), torch.func.jacrev(lambda a: theirs(a, p))(x))


def test_second_order_raises_one_clear_error(maps):
    x, p = maps
    with pytest.raises(NotImplementedError, match="differentiable once"):
        torch.func.grad(lambda a: torch.func.grad(lambda c: densematch.pairwise_distance(c, p).sum())(a).sum())(x)
    x = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(densematch.pairwise_distance(x, p, metric="cosine").sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="differentiable once"):
        gx.sum().backward()
    a = torch.randn(4, 5, 6, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="soft_match is differentiable once"):
        torch.func.grad(lambda y: torch.func.grad(lambda z: densematch.soft_match(z, a).spread.sum())(y).sum())(a)


def _soft_reference(a: torch.Tensor, b: torch.Tensor, t: float, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """soft_match's (coords, spread) from the whole (Na, Nb) weights, for (H, W, C) maps."""
    (h, w, c), (hb, wb, _) = a.shape, b.shape
    s = (
        torch.nn.functional.normalize(a.reshape(-1, c), dim=1)
        @ torch.nn.functional.normalize(b.reshape(-1, c), dim=1).T
    )
    weights = torch.softmax(s / t, 1)
    if mode == "dual_softmax":
        weights = weights * torch.softmax(s / t, 0)
        weights = weights / weights.sum(1, keepdim=True)
    grid = torch.stack(torch.meshgrid(torch.arange(hb), torch.arange(wb), indexing="ij"), -1).reshape(-1, 2).to(a)
    coords = weights @ grid
    spread = ((weights @ grid.square().sum(1, keepdim=True)).squeeze(1) - coords.square().sum(1)).sqrt()
    return coords.reshape(h, w, 2), spread.reshape(h, w)


@pytest.mark.parametrize("mode", ["softmax", "dual_softmax"])
def test_vmap_grad_and_jacrev_through_soft_match(mode):
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(3, 5, 6, 8, dtype=torch.float64, generator=g),
        torch.randn(3, 4, 5, 8, dtype=torch.float64, generator=g),
    )

    def mine(x, y):
        s = densematch.soft_match(x, y, temperature=0.2, mode=mode)
        return s.coords, s.spread

    def theirs(x, y):
        return _soft_reference(x, y, 0.2, mode)

    for dims in ((0, 0), (0, None), (None, 0)):
        x, y = (a if dims[0] == 0 else a[0]), (b if dims[1] == 0 else b[1])
        got, want = torch.func.vmap(mine, in_dims=dims)(x, y), torch.func.vmap(theirs, in_dims=dims)(x, y)
        for have, ref in zip(got, want, strict=True):
            torch.testing.assert_close(have, ref)
    weights = torch.rand(5, 6, 2, dtype=torch.float64, generator=g)

    def loss(fn):
        return lambda x, y: (fn(x, y)[0] * weights).sum() + fn(x, y)[1].sum()

    got, want = (torch.func.grad(loss(fn), argnums=(0, 1))(a[0], b[0]) for fn in (mine, theirs))
    for have, ref in zip(got, want, strict=True):
        torch.testing.assert_close(have, ref)
    for argnum in (0, 1):
        got, want = (
            torch.func.jacrev(lambda x, y, fn=fn: fn(x, y)[0], argnums=argnum)(a[0], b[0]) for fn in (mine, theirs)
        )
        torch.testing.assert_close(got, want)


def _local_reference(a: torch.Tensor, b: torch.Tensor, radius: int, metric: str) -> torch.Tensor:
    """local_cost_volume for (H, W, C) maps by shifting b, 0 where a candidate is outside it."""
    h, w, _ = a.shape
    side = 2 * radius + 1
    padded = torch.nn.functional.pad(b, (0, 0, radius, radius, radius, radius))
    inside = torch.nn.functional.pad(torch.ones(h, w, dtype=torch.bool), (radius,) * 4)
    planes = []
    for i in range(side):
        for j in range(side):
            cand = padded[i : i + h, j : j + w]
            if metric == "dot":
                v = (a * cand).sum(-1)
            elif metric == "cosine":
                v = torch.nn.functional.cosine_similarity(a, cand, dim=-1, eps=1e-300)
            else:
                v = (a - cand).square().sum(-1).sqrt()
            planes.append(torch.where(inside[i : i + h, j : j + w], v, 0.0))
    return torch.stack(planes).reshape(side, side, h, w)


@pytest.mark.parametrize("metric", ["dot", "cosine", "l2"])
def test_grad_and_jacrev_through_local_cost_volume(metric):
    g = torch.Generator().manual_seed(1)
    a, b = (
        torch.randn(6, 7, 5, dtype=torch.float64, generator=g),
        torch.randn(6, 7, 5, dtype=torch.float64, generator=g),
    )

    def mine(x, y):
        return densematch.local_cost_volume(x, y, 1, metric=metric, fill=0.0)

    def theirs(x, y):
        return _local_reference(x, y, 1, metric)

    torch.testing.assert_close(mine(a, b), theirs(a, b))
    weights = torch.rand(3, 3, 6, 7, dtype=torch.float64, generator=g)
    got, want = (
        torch.func.grad(lambda x, y, fn=fn: (fn(x, y) * weights).sum(), argnums=(0, 1))(a, b) for fn in (mine, theirs)
    )
    for have, ref in zip(got, want, strict=True):
        torch.testing.assert_close(have, ref)
    for argnum in (0, 1):
        got, want = (torch.func.jacrev(fn, argnums=argnum)(a, b) for fn in (mine, theirs))
        torch.testing.assert_close(got, want)
