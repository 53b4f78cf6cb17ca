"""torch.func (issue 40, goal 5): vmap over pairwise_distance's leading dimension, grad and
jacrev through it, grad through soft_match and local_cost_volume, each against torch's own
operators in float64; second order raises one clear NotImplementedError, as cdist's does."""

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
        return densematch.pairwise_distance(a, b, metric)

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
    (gx,) = torch.autograd.grad(densematch.pairwise_distance(x, p, "cosine").sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="differentiable once"):
        gx.sum().backward()


def test_grad_through_soft_match_equals_autograd():
    a, b = torch.randn(6, 7, 8, dtype=torch.float64), torch.randn(5, 6, 8, dtype=torch.float64)
    for mode in ("softmax", "dual_softmax"):

        def loss(x, y, mode=mode):
            s = densematch.soft_match(x, y, temperature=0.2, mode=mode)
            return s.coords.square().sum() + s.spread.sum()

        got = torch.func.grad(loss, argnums=(0, 1))(a, b)
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = torch.autograd.grad(loss(x, y), (x, y))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_grad_through_local_cost_volume_equals_autograd():
    a, b = torch.randn(1, 8, 6, 7, dtype=torch.float64), torch.randn(1, 8, 6, 7, dtype=torch.float64)
    for metric in ("dot",):  # cosine and l2 recompute with autograd inside their backward: not yet

        def loss(x, y, metric=metric):
            v = densematch.local_cost_volume(x, y, radius=1, metric=metric)
            return torch.nan_to_num(v, posinf=0.0).square().sum()

        got = torch.func.grad(loss, argnums=(0, 1))(a, b)
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = torch.autograd.grad(loss(x, y), (x, y))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
