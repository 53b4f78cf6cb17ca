"""Metrics: the one model of each metric, for the search engine and for prototype distances.

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

The same classes give :func:`densematch.pairwise_distance` its distances from every pixel to a
bank of prototypes and their gradients (:meth:`Metric.bank`, :meth:`Metric.bank_distances`,
:meth:`Metric.bank_grads`), a tile of pixels at a time.

Adding a metric is one class here (and one entry of :data:`METRICS`); the engine, the CLI's
choices and the checks all read that dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import TORCH_OPS, Ops, l2_pair_weights

__all__ = ["METRICS", "Bank", "Metric", "get_metric", "row_norms", "unit_rows"]

# Zero rows pass gradients g / _EPS through their unit vector, as through x / max(||x||, eps).
_EPS = 1e-12
# The l2 expansion's error is about eps * (||x||^2 + ||p||^2); below this fraction of that scale a
# squared distance would keep too few correct digits, so it is recomputed from x - p directly.
_CLOSE = 1e-4


def _peaks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each line's largest magnitude along ``dim`` (kept as a size-1 axis), 1 for zero lines."""
    x = x.detach()
    # two reductions: on AVX-512 CPUs torch's aminmax along a dim takes about 5x their time;
    # out of place, so that exported graphs stay functional
    peak = torch.maximum(x.amax(dim, keepdim=True), -x.amin(dim, keepdim=True))
    return torch.where(peak > 0, peak, 1.0)


def row_norms(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Euclidean norms along ``dim`` (kept as a size-1 axis), whatever the magnitude: each line
    is divided by its largest magnitude first, so its squares can neither overflow nor
    underflow. Exact zero lines have norm 0."""
    peak = _peaks(x, dim)
    return torch.linalg.vector_norm(x / peak, dim=dim, keepdim=True) * peak


def unit_rows(x: torch.Tensor, dim: int = -1, *, inplace: bool = False, precise: bool = False) -> torch.Tensor:
    """``x`` scaled to unit length along ``dim``, divided by each line's largest magnitude first
    as in :func:`row_norms` (in place with ``inplace``, no temporary; differentiable
    otherwise). Only exact zero lines stay zero. ``precise``: norms summed in float64, so that
    each value of a line errs by at most about 3 roundings of its dtype, whatever its length."""
    peak = _peaks(x, dim)
    y = x.div_(peak) if inplace else x / peak
    if precise and y.dtype != torch.float64:
        norm = torch.linalg.vector_norm(y, dim=dim, keepdim=True, dtype=torch.float64).to(y.dtype)
    else:
        norm = torch.linalg.vector_norm(y, dim=dim, keepdim=True)
    norm = torch.where(norm > 0, norm, 1.0)
    return y.div_(norm) if inplace else y / norm


def _unit_grad(unit: torch.Tensor, norm: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """Gradient through the unit vector x / ||x|| given the gradient g there; exact zero vectors
    (unit 0) pass g / eps, as through x / max(||x||, eps)."""
    full = norm > 0
    proj = torch.where(full, (unit * g).sum(dim), 0.0)
    return (g - unit * proj.unsqueeze(dim)) / torch.where(full, norm, _EPS).unsqueeze(dim)


def unit_rows_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient at ``x`` (..., C) through :func:`unit_rows` given ``g`` at its output: the
    part of g across the unit row, over the norm. Exact zero rows (which unit_rows keeps) pass
    g as it is."""
    unit, norm = unit_rows(x), row_norms(x)
    full = norm > 0
    return torch.where(full, (g - unit * (unit * g).sum(-1, keepdim=True)) / torch.where(full, norm, 1.0), g)


@dataclass(frozen=True)
class Bank:
    """Prototypes prepared once per call of :func:`densematch.pairwise_distance`.

    Attributes
    ----------
    rows : Tensor of shape (F, D)
        The prototypes in the compute dtype, contiguous.
    body : Tensor of shape (F, D)
        What the metric multiplies: centred rows (l2, sqeuclidean), unit rows (cosine), or
        ``rows`` itself.
    norms : Tensor of shape (F,)
        Squared norms of the centred rows (l2, sqeuclidean), norms of the rows (cosine), or empty.
    centre : Tensor of shape (D,)
        The mean the rows were centred on (zeros where the metric does not centre).
    """

    rows: torch.Tensor
    body: torch.Tensor
    norms: torch.Tensor
    centre: torch.Tensor


class Metric:
    """How one metric prepares rows, scores a tile, reports a value and takes a gradient.

    Attributes
    ----------
    name : str
        The metric's public name.
    higher_is_better : bool
        True for similarities (cosine, dot), False for distances.
    p : float or None
        The Minkowski order for metrics scored by ``torch.cdist``; None for matrix metrics.
    extra_columns : int
        Columns that :meth:`prepare` adds to C (1 for the l2 expansion).
    centred : bool
        Whether rows are centred on the reference mean before scoring.
    degree : int
        Scaling both rows by s scales the value by s ** degree.
    unit : bool
        Whether prepared rows have unit length (so float16's range holds them).
    """

    name: str = ""
    higher_is_better = False
    p: float | None = None
    extra_columns = 0
    centred = False
    degree = 1
    unit = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def matrix(self) -> bool:
        """Whether a tile of scores is one matrix product of prepared rows."""
        return self.p is None

    @property
    def shiftable(self) -> bool:
        """Whether subtracting one vector from every prepared reference changes all scores of a
        query row by one amount (a plain product, no extra column): rankings stay, and half
        precision then resolves the references' differences rather than their common part."""
        return self.matrix and not self.extra_columns

    @property
    def has_ratio(self) -> bool:
        """Whether Lowe's ratio test has a distance to compare (:meth:`ratio_distance`)."""
        return True

    # -- the search engine's rows, scores and values ------------------------------------------

    def prepare(
        self,
        x: torch.Tensor,
        role: str,
        dtype: torch.dtype,
        centre: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        precise: bool = False,
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
        out : Tensor of shape (n, C + extra_columns), optional
            Written and returned (contiguous rows, of ``dtype``).
        precise : bool, default=False
            Rows scaled (cosine's unit rows) within about 3 roundings of each value: norms
            summed in float64.

        Returns
        -------
        Tensor of shape (n, C + extra_columns), contiguous, of ``dtype``.
        """
        if out is None:
            return x.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
        return out.copy_(x)

    def score_tile(
        self, q: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None = None, *, ops: Ops = TORCH_OPS
    ) -> torch.Tensor:
        """Scores of shape (len(q), len(r)), higher is better, of prepared rows (``ops``: the
        call's operations, :mod:`densematch.ops`)."""
        return q @ r.T if out is None else torch.mm(q, r.T, out=out)

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
        raise NotImplementedError

    def pair_grads(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients at ``a`` and ``b`` of :meth:`pair_value` given ``g`` at its value, in
        closed form (autograd's own subgradients: 0 for a distance at 0, ties of linf sharing
        evenly), so that a kernel computes them without autograd.

        Parameters
        ----------
        a, b : Tensor of shape (..., C)
            The rows :meth:`pair_value` took (same shape).
        g : Tensor of shape (...)
            The gradient at each pair's value.

        Returns
        -------
        (Tensor, Tensor) of shape (..., C)
        """
        raise NotImplementedError

    pair_kind: str | None = None  # the reduction of the kernel of pairs (Ops.pair_values)

    def pair_values(
        self,
        q: torch.Tensor,
        r: torch.Tensor,
        idx: torch.Tensor,
        *,
        q_rows: torch.Tensor | None = None,
        ops: Ops = TORCH_OPS,
        r_terms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`pair_value` of the pairs (q[q_rows[i]], r[idx[i, j]]), for the engine's last
        step (no gradient): through the C kernel where it runs, with no gathered copy and one
        pass per pair.

        Parameters
        ----------
        q : Tensor of shape (mq, C)
        r : Tensor of shape (n, C)
            Raw rows in the compute dtype, any strides.
        idx : Tensor of int64, shape (m, k)
            Rows of ``r``.
        q_rows : Tensor of int64, shape (m,), optional
            Rows of ``q`` (default: row i for row i of ``idx``).
        ops : Ops, default=TORCH_OPS
            The call's operations (:func:`densematch.kernels.ops_for`): C's kernel of pairs
            where they are C's.
        r_terms : Tensor, optional
            :meth:`pair_terms` of ``r``, for the kernel of pairs (the same values, faster).

        Returns
        -------
        Tensor of shape (m, k)
        """
        v = self._pair_kernel(q, r, idx, q_rows, ops, r_terms)
        return self.kernel_value(v) if v is not None else self.pair_value(*self._pairs(q, r, idx, q_rows))

    def direct_scores(
        self,
        q: torch.Tensor,
        r: torch.Tensor,
        idx: torch.Tensor,
        *,
        q_rows: torch.Tensor | None = None,
        ops: Ops = TORCH_OPS,
        r_terms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`direct_score` of the pairs (q[q_rows[i]], r[idx[i, j]]), arguments as in
        :meth:`pair_values`, through the C kernel where it runs."""
        v = self._pair_kernel(q, r, idx, q_rows, ops, r_terms)
        if v is not None:
            return v if self.higher_is_better else v.neg_()
        return self.direct_score(*self._pairs(q, r, idx, q_rows))

    @staticmethod
    def _pairs(
        q: torch.Tensor, r: torch.Tensor, idx: torch.Tensor, q_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' rows gathered, (m, 1, C) and (m, k, C), for torch's kernels."""
        m, k = idx.shape
        q = q if q_rows is None else q.index_select(0, q_rows)
        return q[:, None, :], r.index_select(0, idx.reshape(-1)).view(m, k, -1)

    def _pair_kernel(
        self,
        q: torch.Tensor,
        r: torch.Tensor,
        idx: torch.Tensor,
        q_rows: torch.Tensor | None,
        ops: Ops,
        r_terms: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The kernel of pairs' reduction of the pairs (:meth:`Ops.pair_values`), or None where
        the operations have none."""
        if self.pair_kind is None or r.dtype != q.dtype:
            return None
        return ops.pair_values(q, r, idx, self.pair_kind, q_rows=q_rows, r_terms=r_terms)

    def pair_terms(self, x: torch.Tensor, *, ops: Ops = TORCH_OPS) -> torch.Tensor | None:
        """What the kernel of pairs would compute for a reference row ``x`` (n, C) at each of its
        pairs (:meth:`Ops.cosine_terms`: cosine's scale and norm), computed once for
        :meth:`pair_values`' ``r_terms``; None where the kernel needs none or has none."""
        return ops.cosine_terms(x) if self.pair_kind == "cosine" else None

    def kernel_value(self, v: torch.Tensor) -> torch.Tensor:
        """The reported value from the C kernel's reduction of :attr:`pair_kind` (in place)."""
        return v

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Scores of row pairs (n, C) from raw rows in the compute dtype, higher is better,
        computed directly (no expansion, no centring): equal rows give equal scores, and for l2
        integer features give exact integers, so exact ties stay exact."""
        raise NotImplementedError

    def ratio_distance(self, value: torch.Tensor) -> torch.Tensor:
        """The distance Lowe's ratio test compares: chord distance for cosine, Euclidean for
        l2 and sqeuclidean, the metric's own distance for l1 and linf."""
        return value

    def distance(self, value: torch.Tensor) -> torch.Tensor:
        """The value as :func:`densematch.pairwise_distance` reports it: 1 - cos for cosine,
        the value itself otherwise (for dot, a similarity: larger is nearer)."""
        return value

    # -- prototype banks: distances from pixels (columns) to every prototype --------------------

    def bank(self, p: torch.Tensor, dtype: torch.dtype) -> Bank:
        """The prototypes (F, D) prepared once for :meth:`bank_distances` and :meth:`bank_grads`."""
        rows = p.detach().to(dtype).contiguous()
        return Bank(rows, rows, rows.new_empty(0), rows.new_zeros(rows.shape[1]))

    def bank_distances(self, bank: Bank, xt: torch.Tensor, out: torch.Tensor, *, ops: Ops = TORCH_OPS) -> None:
        """Distances (F, m) of the columns of ``xt`` (D, m) to the prototypes, into ``out``
        (contiguous, unless :meth:`bank_writes_strided`)."""
        raise NotImplementedError

    def bank_writes_strided(self, ops: Ops) -> bool:
        """Whether :meth:`bank_distances` with ``ops`` writes an ``out`` of any strides itself
        (:attr:`Ops.writes_strided`), so that the caller needs no contiguous tile of its own."""
        return False

    def bank_grads(
        self, bank: Bank, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients for the columns ``xt`` (D, m) and the bank (F, D), from the output's
        gradient ``g`` and the distances ``d``, both (F, m)."""
        raise NotImplementedError

    def bank_grad_finish(self, bank: Bank, gp: torch.Tensor) -> torch.Tensor:
        """The bank's gradient once every tile has added its part (a linear last step some
        metrics apply once rather than per tile)."""
        return gp


class Dot(Metric):
    """The dot product, a similarity."""

    name = "dot"
    higher_is_better = True
    degree = 2

    @property
    def has_ratio(self) -> bool:
        return False

    pair_kind = "dot"

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1)

    def pair_grads(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g[..., None] * b, g[..., None] * a

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vecdot(a, b)

    def bank_distances(self, bank: Bank, xt: torch.Tensor, out: torch.Tensor, *, ops: Ops = TORCH_OPS) -> None:
        torch.mm(bank.rows, xt, out=out)

    def bank_grads(
        self, bank: Bank, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return bank.rows.T @ g, g @ xt.T


class Cosine(Metric):
    """Cosine similarity; as a prototype distance, 1 - cos (zero vectors have cos 0)."""

    name = "cosine"
    higher_is_better = True
    degree = 0
    unit = True

    def prepare(
        self,
        x: torch.Tensor,
        role: str,
        dtype: torch.dtype,
        centre: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        precise: bool = False,
    ) -> torch.Tensor:
        return unit_rows(super().prepare(x, role, dtype, out=out), inplace=True, precise=precise)

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (unit_rows(a) * unit_rows(b)).sum(-1)

    def pair_grads(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = g[..., None]
        return unit_rows_grad(a, g * unit_rows(b)), unit_rows_grad(b, g * unit_rows(a))

    pair_kind = "cosine"

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vecdot(unit_rows(a), unit_rows(b))

    def ratio_distance(self, value: torch.Tensor) -> torch.Tensor:
        return (2.0 - 2.0 * value).clamp_min_(0.0).sqrt_()

    def distance(self, value: torch.Tensor) -> torch.Tensor:
        return 1.0 - value

    def bank(self, p: torch.Tensor, dtype: torch.dtype) -> Bank:
        rows = super().bank(p, dtype).rows
        return Bank(rows, unit_rows(rows, dim=1), row_norms(rows, dim=1)[:, 0], rows.new_zeros(rows.shape[1]))

    def bank_distances(self, bank: Bank, xt: torch.Tensor, out: torch.Tensor, *, ops: Ops = TORCH_OPS) -> None:
        torch.mm(bank.body, unit_rows(xt, dim=0), out=out).neg_().add_(1.0)

    def bank_grads(
        self, bank: Bank, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nx = row_norms(xt, dim=0)[0]
        xn = unit_rows(xt, dim=0)
        gx = _unit_grad(xn, nx, -(bank.body.T @ g), dim=0)
        # the bank's projection is linear: bank_grad_finish applies it once, after the last tile
        return gx, -(g @ xn.T)

    def bank_grad_finish(self, bank: Bank, gp: torch.Tensor) -> torch.Tensor:
        return _unit_grad(bank.body, bank.norms, gp, dim=1)


class Euclidean(Metric):
    """The Euclidean distance, ranked through the centred expansion of its square."""

    name = "l2"
    extra_columns = 1
    centred = True
    root = True  # the distance is the square root of the expansion

    def prepare(
        self,
        x: torch.Tensor,
        role: str,
        dtype: torch.dtype,
        centre: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        precise: bool = False,
    ) -> torch.Tensor:
        n, c = x.shape
        out = torch.empty(n, c + 1, dtype=dtype, device=x.device) if out is None else out
        body = out[:, :c]
        body.copy_(x)
        if centre is not None:
            body.sub_(centre)
        if role == "query":
            out[:, c] = 1.0
        else:
            torch.linalg.vecdot(body, body, out=out[:, c]).mul_(-0.5)
        return out

    def _finish(self, squared: torch.Tensor) -> torch.Tensor:
        """The distance from its square (in place where it can be)."""
        return squared.sqrt_()

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(a - b, dim=-1)

    def pair_grads(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = a - b
        ga = d * (2 * g[..., None] if not self.root else l2_pair_weights(g, row_norms(d)[..., 0], root=True)[..., None])
        return ga, -ga

    pair_kind = "sqdiff"

    def kernel_value(self, v: torch.Tensor) -> torch.Tensor:
        return self._finish(v)

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = a - b
        return torch.linalg.vecdot(d, d).neg()

    def bank(self, p: torch.Tensor, dtype: torch.dtype) -> Bank:
        # centring on the prototypes' mean leaves distances alone and shrinks the norms, and
        # with them the cancellation of ||x||^2 - 2 x.p + ||p||^2
        rows = super().bank(p, dtype).rows
        centre = rows.mean(0)
        body = rows - centre
        return Bank(rows, body, body.square().sum(1), centre)

    def bank_writes_strided(self, ops: Ops) -> bool:
        return ops.writes_strided

    def bank_distances(self, bank: Bank, xt: torch.Tensor, out: torch.Tensor, *, ops: Ops = TORCH_OPS) -> None:
        xc, xx, smallest = ops.l2_bank(bank.body, bank.norms, bank.centre, xt, out, root=self.root)
        # columns with a near prototype have lost digits: recompute them directly, in chunks
        # no larger than ``out``
        close = (smallest < _CLOSE * (xx + bank.norms.max())).nonzero().squeeze(1)
        step = max(1, out.numel() // max(1, xt.shape[0] * bank.rows.shape[0]))
        for start in range(0, close.numel(), step):
            cols = close[start : start + step]
            diff = bank.body[:, :, None] - xc[:, cols][None]
            out[:, cols] = self._finish(diff.square_().sum(1))

    def bank_grads(
        self, bank: Bank, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 if self.root else 2.0
        w, per_col, per_row = ops.l2_weights(g, d, root=self.root)
        gx = torch.addmm(xt * per_col, bank.rows.T, w, alpha=-1.0)
        gp = torch.addmm(bank.rows * per_row[:, None], w, xt.T, alpha=-1.0)
        return gx.mul_(scale), gp.mul_(scale)


class SquaredEuclidean(Euclidean):
    """The squared Euclidean distance."""

    name = "sqeuclidean"
    degree = 2
    root = False

    def _finish(self, squared: torch.Tensor) -> torch.Tensor:
        return squared

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).square().sum(-1)

    def ratio_distance(self, value: torch.Tensor) -> torch.Tensor:
        return value.clamp_min(0.0).sqrt()


class Minkowski(Metric):
    """l1 (p=1) and linf (p=inf): no matrix form. Tiles go through densematch's C kernels where
    they run (:mod:`densematch.kernels.native`), else through torch.cdist's."""

    def __init__(self, name: str, p: float) -> None:
        self.name, self.p = name, p

    @property
    def order(self) -> float:
        """The Minkowski order (``p``, never None here)."""
        assert self.p is not None
        return self.p

    @property
    def linf(self) -> bool:
        return self.order == float("inf")

    def score_tile(
        self, q: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None = None, *, ops: Ops = TORCH_OPS
    ) -> torch.Tensor:
        return ops.minkowski_scores(q, r, out, p=self.order)

    @property
    def pair_kind(self) -> str:  # type: ignore[override]
        return "maxabs" if self.linf else "absdiff"

    def pair_value(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(a - b, ord=self.order, dim=-1)

    def pair_grads(self, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = a - b
        ga = d.sign() * g[..., None]
        if self.linf:  # the largest magnitudes share the gradient evenly
            top = d.abs() == d.abs().amax(-1, keepdim=True)
            ga = ga * top / top.sum(-1, keepdim=True)
        return ga, -ga

    def direct_score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(a - b, self.order, dim=-1).neg()

    def reduce_abs(self, diff: torch.Tensor, dim: int) -> torch.Tensor:
        """The distance from absolute differences along ``dim``: their sum (l1) or maximum."""
        return diff.sum(dim) if self.order == 1.0 else diff.amax(dim)

    def bank_writes_strided(self, ops: Ops) -> bool:
        return ops.writes_strided

    def bank_distances(self, bank: Bank, xt: torch.Tensor, out: torch.Tensor, *, ops: Ops = TORCH_OPS) -> None:
        ops.minkowski_bank(bank.rows, xt, out, p=self.order)

    def bank_grads(
        self, bank: Bank, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.minkowski_bank_grads(bank.rows, xt, g, d, p=self.order)


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Cosine(),
        Dot(),
        Euclidean(),
        SquaredEuclidean(),
        Minkowski("l1", 1.0),
        Minkowski("linf", float("inf")),
    )
}


def get_metric(metric: str | Metric) -> Metric:
    """Look up a metric by name, raising a ValueError that lists the choices."""
    if isinstance(metric, Metric):
        return metric
    if not isinstance(metric, str) or metric not in METRICS:
        choices = ", ".join(repr(n) for n in METRICS)
        raise ValueError(f"metric must be one of {choices}, got {metric!r}")
    return METRICS[metric]
