"""Metrics: how to prepare rows, score a tile, and report a value, for every metric.

Inside the engine every metric is a *score* where higher is better, so one top-k serves all.
Matrix metrics score a tile with one matrix product:

- cosine: rows are L2-normalised (only exact zero rows stay zero, and score 0; a row's own
  largest magnitude divides it first, so no row is too small or too large), score = a . b.
- dot: score = a . b.
- l2, sqeuclidean: both sides are centred on the reference mean (distances do not change, the
  norms shrink, and so does the cancellation of the expansion); the query gets a column of ones
  and the reference a column of -||b||^2 / 2, so that one product gives
  a . b - ||b||^2 / 2 = (||a||^2 - ||a - b||^2) / 2, which ranks like -||a - b||^2.

l1 and linf have no matrix form; a tile is ``-torch.cdist(a, b, p)``, which never builds the
(tile_a, tile_b, C) broadcast. Whatever the ranking used, the reported value of every chosen pair
is recomputed directly from the two rows (:meth:`Metric.pair_value`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["METRICS", "Metric", "get_metric"]


def _peaks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each line's largest magnitude along ``dim`` (kept as a size-1 axis), 1 for zero lines."""
    low, high = torch.aminmax(x.detach(), dim=dim, keepdim=True)
    peak = torch.maximum(high, low.neg_())
    return torch.where(peak > 0, peak, 1.0)


def row_norms(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Euclidean norms along ``dim`` (kept as a size-1 axis), whatever the magnitude: each line
    is divided by its largest magnitude first, so its squares can neither overflow nor
    underflow. Exact zero lines have norm 0."""
    peak = _peaks(x, dim)
    return torch.linalg.vector_norm(x / peak, dim=dim, keepdim=True) * peak


def unit_rows(x: torch.Tensor, dim: int = -1, *, inplace: bool = False) -> torch.Tensor:
    """``x`` scaled to unit length along ``dim``, divided by each line's largest magnitude first
    as in :func:`row_norms` (in place with ``inplace``, no temporary; differentiable
    otherwise). Only exact zero lines stay zero."""
    peak = _peaks(x, dim)
    y = x.div_(peak) if inplace else x / peak
    norm = torch.linalg.vector_norm(y, dim=dim, keepdim=True)
    norm = torch.where(norm > 0, norm, 1.0)
    return y.div_(norm) if inplace else y / norm


@dataclass(frozen=True)
class Metric:
    """How one metric scores, compares and reports.

    Attributes
    ----------
    name : str
        The metric's public name.
    higher_is_better : bool
        True for similarities (cosine, dot), False for distances.
    p : float or None
        The Minkowski order for metrics scored by ``torch.cdist``; None for matrix metrics.
    """

    name: str
    higher_is_better: bool
    p: float | None = None

    @property
    def extra_columns(self) -> int:
        """Columns that :meth:`prepare` adds to C (1 for the l2 expansion)."""
        return 1 if self.name in ("l2", "sqeuclidean") else 0

    @property
    def centred(self) -> bool:
        """Whether rows are centred on the reference mean before scoring."""
        return self.name in ("l2", "sqeuclidean")

    def prepare(
        self, x: torch.Tensor, role: str, dtype: torch.dtype, centre: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ready for :meth:`score_tile`.

        Parameters
        ----------
        x : Tensor of shape (n, C)
            Raw rows of any float dtype and any strides.
        role : {"query", "ref"}
            Queries and references are prepared differently for l2 and sqeuclidean.
        dtype : torch.dtype
            The compute dtype (float32 or float64).
        centre : Tensor of shape (C,), optional
            Subtracted from every row when the metric is centred.

        Returns
        -------
        Tensor of shape (n, C + extra_columns), contiguous, of ``dtype``.
        """
        n, c = x.shape
        if self.extra_columns:
            out = torch.empty(n, c + 1, dtype=dtype, device=x.device)
            body = out[:, :c]
            body.copy_(x)
            if centre is not None:
                body.sub_(centre)
            if role == "query":
                out[:, c] = 1.0
            else:
                torch.linalg.vecdot(body, body, out=out[:, c]).mul_(-0.5)
            return out
        out = x.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
        return unit_rows(out, inplace=True) if self.name == "cosine" else out

    def score_tile(self, q: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of shape (len(q), len(r)), higher is better, of prepared rows."""
        if self.p is None:
            if out is None:
                return q @ r.T
            return torch.mm(q, r.T, out=out)
        if out is None:
            return torch.cdist(q, r, p=self.p).neg_()
        # torch.cdist has no out=; its kernel does, and writing into the caller's reused buffer
        # keeps the allocator from churning one fresh block per tile
        return torch.ops.aten._cdist_forward.out(q, r, self.p, None, out=out).neg_()

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The reported value of each row pair, computed directly (differentiable; the gradient
        of a distance at 0 is 0).

        Parameters
        ----------
        a, b : Tensor of shape (..., C)
            Raw rows, already in the compute dtype (broadcastable).

        Returns
        -------
        Tensor of shape (...)
            Cosine similarity, dot product, or the distance for the other metrics.
        """
        if self.name == "cosine":
            return (unit_rows(a) * unit_rows(b)).sum(-1)
        if self.name == "dot":
            return (a * b).sum(-1)
        d = a - b
        if self.name == "sqeuclidean":
            return d.square().sum(-1)
        return torch.linalg.vector_norm(d, ord=2 if self.p is None else self.p, dim=-1)

    @property
    def degree(self) -> int:
        """How values scale with the rows: scaling both by s scales the value by s ** degree."""
        return {"cosine": 0, "dot": 2, "sqeuclidean": 2}.get(self.name, 1)

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Scores of row pairs (n, C) from raw rows in the compute dtype, higher is better,
        computed directly (no expansion, no centring): equal rows give equal scores, and for l2
        integer features give exact integers, so exact ties stay exact."""
        if self.name == "cosine":
            return torch.linalg.vecdot(unit_rows(a), unit_rows(b))
        if self.name == "dot":
            return torch.linalg.vecdot(a, b)
        d = a - b
        return torch.linalg.vecdot(d, d).neg_() if self.centred else torch.linalg.vector_norm(d, self.p, dim=-1).neg_()

    def ratio_distance(self, value: torch.Tensor) -> torch.Tensor:
        """The distance Lowe's ratio test compares: chord distance for cosine, Euclidean for
        l2 and sqeuclidean, the metric's own distance for l1 and linf."""
        if self.name == "cosine":
            return (2.0 - 2.0 * value).clamp_min_(0.0).sqrt_()
        if self.name == "sqeuclidean":
            return value.clamp_min(0.0).sqrt()
        if self.name == "dot":
            raise ValueError("ratio is undefined for metric='dot': dot products are not distances")
        return value


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("cosine", True),
        Metric("dot", True),
        Metric("l2", False),
        Metric("sqeuclidean", False),
        Metric("l1", False, p=1.0),
        Metric("linf", False, p=float("inf")),
    )
}


def get_metric(metric: str | Metric, allowed: tuple[str, ...] | None = None) -> Metric:
    """Look up a metric by name, raising a ValueError that lists the choices."""
    if isinstance(metric, Metric):
        return metric
    names = allowed or tuple(METRICS)
    if not isinstance(metric, str) or metric not in names:
        choices = ", ".join(repr(n) for n in names)
        raise ValueError(f"metric must be one of {choices}, got {metric!r}")
    return METRICS[metric]
