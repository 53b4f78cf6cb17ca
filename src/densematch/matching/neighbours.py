"""Exact k nearest neighbours of flat rows in a memory bank: the flat form of nearest_prototype."""

from __future__ import annotations

from typing import Any

import torch

from .. import engine
from ..checks import as_tensor, check_bool, check_finite, options_by_keyword
from ..choices import MetricName, PrecisionName
from ..distances.prototypes import Nearest, NearestTask, nearest_search, nearest_task

__all__ = ["KNNIndex", "knn"]


def _rows(x: Any, name: str, *, empty: bool = False) -> torch.Tensor:
    """``x`` as (N, D) rows with D >= 1 and N >= 1 (N >= 0 where ``empty``)."""
    t = as_tensor(x, name)
    if t.ndim != 2 or t.shape[0] < (0 if empty else 1) or t.shape[1] == 0:
        least = "N >= 0, D >= 1" if empty else "N, D >= 1"
        raise ValueError(f"{name} must have shape (N, D) with {least}, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must hold real floats, got {t.dtype}; convert with .float() (of .real or .abs())")
    return t


def _task(
    queries: Any,
    bank: Any,
    metric: str,
    k: int,
    memory: int | str | None,
    finite: bool,
    precision: str,
    *,
    bank_checked: bool = False,
) -> NearestTask:
    """Validated queries (as one N x 1 map, a view), bank, metric, precision, k and budget
    (``bank_checked``: the bank's values were checked already, by the index)."""
    finite = check_bool(finite, "check_finite")
    q, b = _rows(queries, "queries", empty=True), _rows(bank, "bank")
    if q.shape[1] != b.shape[1]:
        raise ValueError(f"queries and bank must have one D, got {q.shape[1]} and {b.shape[1]}")
    if q.device != b.device:
        raise ValueError(f"queries and bank must be on one device, got {q.device} and {b.device}")
    if finite:
        check_finite(q.detach(), "queries")
        if not bank_checked:
            check_finite(b.detach(), "bank")
    # the queries as one map of N x 1 pixels: a view, no copy
    return nearest_task(q.T[None, :, :, None], b, metric, k, memory, False, precision)


@options_by_keyword(2)
def knn(
    queries: Any,
    bank: Any,
    *,
    k: int = 1,
    metric: MetricName = "l2",
    memory: int | str | None = None,
    precision: PrecisionName = "exact",
    check_finite: bool = True,
) -> Nearest:
    """The k nearest rows of ``bank`` of every row of ``queries``, exactly, without the N x M
    distance matrix.

    Which options fit which job, and what each costs: docs/choosing.md.

    Parameters
    ----------
    queries : Tensor or ndarray of shape (N, D)
    bank : Tensor or ndarray of shape (M, D)
    k : int, default=1
        1 <= k <= M.
    metric : {"l2", "sqeuclidean", "l1", "linf", "cosine", "dot"}, default="l2"
        As in :func:`densematch.nearest_prototype` (cosine: the distance 1 - cos; dot: larger
        is nearer).
    memory, precision, check_finite
        As in :func:`densematch.nearest_prototype`.

    Returns
    -------
    Nearest
        ``values``: Tensor of shape (N, k), recomputed directly from each pair, in float32
        (float64 for float64 inputs), differentiable with respect to queries and bank.
        ``indices``: int64, shape (N, k), rows of the bank, nearest first; ties to the lower
        index. A named tuple: ``d, i = knn(...)`` still unpacks it.

    Examples
    --------
    >>> bank = torch.randn(1000, 16)
    >>> d, i = knn(bank[:5] + 1e-3, bank, k=2)
    >>> i[:, 0].tolist()
    [0, 1, 2, 3, 4]
    """
    value, index = nearest_search(_task(queries, bank, metric, k, memory, check_finite, precision))
    return Nearest(value[0], index[0])


class KNNIndex:
    """A memory bank prepared once (normalised, centred, its norms kept, as the metric needs),
    then searched by :meth:`search` with query sets of any size: :func:`knn` without preparing
    the bank at every call.

    Parameters
    ----------
    bank : Tensor or ndarray of shape (M, D)
        A tensor is kept by reference (not copied), and followed: changed in place, it is
        prepared again at the next search, so indices and distances both come from the bank as
        it is then. A numpy array or an inference tensor, whose in-place changes torch cannot
        see, is copied once. The prepared rows, about the bank's size in float32, are held
        beside it: like the bank, outside ``memory``.
    metric, memory, precision, check_finite
        As in :func:`knn`.

    Examples
    --------
    >>> index = KNNIndex(torch.randn(5000, 32), metric="cosine")
    >>> d, i = index.search(torch.randn(10, 32), k=3)
    >>> d.shape, i.shape
    (torch.Size([10, 3]), torch.Size([10, 3]))
    """

    @options_by_keyword(2)
    def __init__(
        self,
        bank: Any,
        *,
        metric: MetricName = "l2",
        memory: int | str | None = None,
        precision: PrecisionName = "exact",
        check_finite: bool = True,
    ) -> None:
        b = _rows(bank, "bank")
        if not isinstance(bank, torch.Tensor) or b.is_inference():
            b = b.clone()
        self.memory, self.precision, self.check_finite = memory, precision, check_finite
        task = _task(b[:1], b, metric, 1, memory, check_finite, precision)
        self.bank, self.metric, self._precision = task.prototypes, task.metric, task.precision
        self._prepare()

    def _prepare(self) -> None:
        self.prepared = engine.prepare(self.bank.detach(), metric=self.metric, k=1, precision=self._precision)
        self._version = self.bank._version

    @options_by_keyword(2)
    def search(self, queries: Any, *, k: int = 1) -> Nearest:
        """The k nearest rows of the bank of every row of ``queries`` (N, D): distances and
        indices of shape (N, k), a :class:`densematch.Nearest` as :func:`knn` returns it."""
        if self.bank._version != self._version:  # changed in place since it was prepared
            if self.check_finite:
                check_finite(self.bank.detach(), "bank")
            self._prepare()
        settings = (self.metric.name, k, self.memory, self.check_finite, self.precision)
        task = _task(queries, self.bank, *settings, bank_checked=True)
        value, index = nearest_search(task, prepared=self.prepared)
        return Nearest(value[0], index[0])

    def __repr__(self) -> str:
        m, d = self.bank.shape
        return f"KNNIndex(bank of {m} x {d}, metric={self.metric.name!r}, precision={self.precision!r})"
