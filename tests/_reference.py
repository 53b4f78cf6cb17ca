"""Float64 brute-force references and the tolerances the tests judge by."""

from __future__ import annotations

import numpy as np
import torch

from densematch.metrics import METRICS as _ALL
from densematch.metrics import get_metric

# every metric the library has, and those scored by a matrix product (the half-precision and
# fused-kernel paths): the tests' one list, so a new metric is tested everywhere at once
METRICS = list(_ALL)
MATRIX = [m for m in METRICS if get_metric(m).matrix]

HIGHER = {"cosine": True, "dot": True}


def reference_scores(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """(Na, Nb) float64 scores, higher is better (distances negated), by brute force."""
    a, b = a.double(), b.double()
    if metric == "cosine":
        a = a / a.norm(dim=1, keepdim=True).clamp_min(1e-12)
        b = b / b.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return a @ b.T
    if metric == "dot":
        return a @ b.T
    if metric in ("l2", "sqeuclidean"):
        # the expansion in float64 is exact far below the float32 tolerances judged by, and
        # needs no (Na, Nb, C) broadcast
        sq = (a.square().sum(1)[:, None] + b.square().sum(1)[None, :] - 2 * a @ b.T).clamp_min(0)
        return -sq if metric == "sqeuclidean" else -sq.sqrt()
    # cdist, not the (Na, Nb, C) broadcast: 500 x 8192 x 128 float64 differences held 8 GB,
    # the test suite's whole peak
    return -torch.cdist(a, b, p=1.0 if metric == "l1" else float("inf"))


def reported(score: torch.Tensor, metric: str) -> torch.Tensor:
    """The value match() reports, from a reference score."""
    return score if HIGHER.get(metric, False) else -score


def tolerance(a: torch.Tensor, b: torch.Tensor, metric: str) -> float:
    """How far float32 accumulation may move a score: near-ties inside it count as ties."""
    c = a.shape[-1]
    if metric == "cosine":
        return 2e-6 * c + 1e-6
    na = a.double().norm(dim=-1).max().item()
    nb = b.double().norm(dim=-1).max().item()
    scale = {"dot": na * nb, "sqeuclidean": (na + nb) ** 2, "l2": (na + nb), "l1": (na + nb) * c**0.5, "linf": na + nb}[
        metric
    ]
    return 4e-6 * c**0.5 * scale + 1e-6


def assert_same_up_to_ties(
    a: torch.Tensor,
    b: torch.Tensor,
    got: torch.Tensor,
    want: torch.Tensor,
    metric: str,
    *,
    tol: float | None = None,
) -> None:
    """Indices ``got`` and ``want`` (rows of ``b`` for each row of ``a``) agree, except where
    their two picks score alike by the float64 reference, within ``tol`` (default
    :func:`tolerance`): float32 may break such near-ties either way, by the summation order of
    whatever kernel ran, and no test may demand one order. Empty slots (-1) must agree."""
    got, want = got.reshape(a.shape[0], -1), want.reshape(a.shape[0], -1)
    assert torch.equal(got < 0, want < 0), "empty slots differ"
    ref = reference_scores(a, b, metric)
    gap = (ref.gather(1, got.clamp_min(0)) - ref.gather(1, want.clamp_min(0))).abs()
    differ = got != want
    tol = tolerance(a, b, metric) if tol is None else tol
    assert (gap[differ] <= tol).all(), f"{int((gap[differ] > tol).sum())} picks differ beyond a near-tie"


def decided(scores: torch.Tensor, tol: float, dim: int = 1) -> torch.Tensor:
    """Along ``dim``, True where the best reference score beats the second by more than ``tol``:
    the lines whose argmax no float32 summation order can change."""
    top = scores.topk(min(2, scores.shape[dim]), dim=dim).values
    if top.shape[dim] < 2:
        return torch.ones(top.shape[1 - dim], dtype=torch.bool)
    first, second = top.unbind(dim)
    return (first - second) > tol


def assert_topk_exact(
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    metric: str,
    k: int,
    allowed_b: torch.Tensor | None = None,
) -> None:
    """Each chosen index must score (by the reference) like the true k-th best, within tolerance."""
    ref = reference_scores(a, b, metric)
    if allowed_b is not None:
        ref[:, ~allowed_b] = -np.inf
    want = ref.topk(k, dim=1).values
    got = ref.gather(1, index.reshape(-1, k).clamp_min(0))
    tol = tolerance(a, b, metric)
    assert (index >= 0).all()
    if allowed_b is not None:
        assert allowed_b[index].all(), "a masked-out pixel of b was chosen"
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # no pixel of b chosen twice for the same query
    if k > 1:
        s = index.reshape(-1, k).sort(dim=1).values
        assert (s[:, 1:] != s[:, :-1]).all()


def reference_scores_exact(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """float64 scores by the direct form (no expansion): exact for integer rows of l2,
    sqeuclidean, l1 and dot, where equal distances compare equal."""
    a, b = a.double(), b.double()
    if metric in ("l2", "sqeuclidean"):
        sq = torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").square()
        return -sq if metric == "sqeuclidean" else -sq.sqrt()
    if metric == "l1":
        return -torch.cdist(a, b, p=1)
    if metric == "linf":
        return -torch.cdist(a, b, p=float("inf"))
    dots = a @ b.T  # integer sums below 2^53: exact in any order
    if metric == "cosine":
        return dots / (a.norm(dim=1)[:, None] * b.norm(dim=1)[None, :]).clamp_min(1e-300)
    return dots


def lowest_index_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best columns of exact ``scores``, equal scores to the lower column."""
    return scores.sort(dim=1, descending=True, stable=True).indices[:, :k]


def assert_exact_ties_lowest(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, metric: str, k: int) -> None:
    """For rows whose exact scores (:func:`reference_scores_exact`) have no near-tie, only exact
    ties and clear gaps, ``index`` must be the lowest-index top k exactly; other rows are judged
    by :func:`assert_same_up_to_ties`. Meant for integer rows, which make most rows sure."""
    index = index.reshape(a.shape[0], k)
    ref = reference_scores_exact(a, b, metric)
    want = lowest_index_topk(ref, k)
    tol = tolerance(a, b, metric)
    kth = ref.gather(1, want[:, -1:])
    # a row is sure when no score lies within float32's tolerance of its k-th best without
    # equalling it (a tie float32 must keep exact) and the same holds for its better picks
    near = ((ref - kth).abs() <= tol) & (ref != kth)
    top = ref.gather(1, want)
    for j in range(k - 1):
        near |= ((ref - top[:, j : j + 1]).abs() <= tol) & (ref != top[:, j : j + 1])
    sure = ~near.any(1)
    bad = (index != want).any(1) & sure
    assert not bad.any(), f"{int(bad.sum())} of {int(sure.sum())} sure rows break the lowest-index rule"
    assert_same_up_to_ties(a, b, index, want, metric, tol=tol)


def patch_features(image: np.ndarray, size: int = 5) -> torch.Tensor:
    """(H, W, size*size) local patch features of a grey image, zero-mean per patch."""
    x = torch.as_tensor(image, dtype=torch.float32)[None, None] / 255.0
    p = torch.nn.functional.unfold(x, size, padding=size // 2)[0]
    p = p - p.mean(0, keepdim=True)
    return p.T.reshape(image.shape[0], image.shape[1], size * size)


def minkowski_reference(y: torch.Tensor, x: torch.Tensor, linf: bool) -> torch.Tensor:
    """(F, P) distances of the rows of y (F, D) to the columns of x (D, P), in float64."""
    diff = (y.double()[:, :, None] - x.double()[None]).abs()
    return diff.amax(1) if linf else diff.sum(1)


def assert_sums_close(got: torch.Tensor, want: torch.Tensor, terms: int, dtype: torch.dtype) -> None:
    """``got`` (computed in ``dtype``) equals the float64 ``want`` within the rounding of a sum of
    ``terms`` non-negative terms in ``dtype``, whatever their order."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=terms * eps, atol=terms * eps * want.abs().max().item())
