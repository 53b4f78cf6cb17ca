"""The search in the compute dtype (float32 or float64), with its near-ties settled.

An expansion rounds equal distances unequally, and exact ties must go to the lowest index: after
the scan, each row's candidates within the products' rounding bound of its k-th best are
re-scored by the metric's direct form (:meth:`PlainSearch.rank`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..metrics import Metric
from ..precision import Precision
from .plan import Dims, TilePlan
from .pool import Pool
from .strategy import Inputs, Strategy, rescore_bytes, resolve_bytes

__all__ = ["PlainSearch"]


class PlainSearch(Strategy):
    """Scores in the compute dtype; for matrix metrics with ``precision.certify``, near-ties
    settled by the direct form."""

    @classmethod
    def cap(cls, precision: Precision, metric: Metric, k: int, nb: int, c: int) -> int:
        return precision.cap(k, nb, c) if metric.matrix and precision.certify else 0

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        held = super().own_bytes(d, ta, tb, whole_b)
        if d.cap:
            # the near-tie pool; a block's hot rows gathered, with their pass mask (`rank`; then
            # `_resolve`'s block of scores and its mask); the gathered query rows of the rows
            # resolved, and their candidates (`_resolve`); the re-scoring chunk
            held += (
                Pool.bytes(ta, d.cap)
                + ta * tb * (d.item + 1)
                + ta * (d.cp * d.item + 8)
                + resolve_bytes(ta, tb, d.cap)
                + ta * rescore_bytes(d.c)
            )
        return held

    def __init__(self, inputs: Inputs, plan: TilePlan) -> None:
        super().__init__(inputs, plan)
        if inputs.prepared is not None:
            self.ref_norms = inputs.prepared.state.get("ref_norms", self.ref_norms)
        elif self.cap_rows:
            self.ref_norms = self._largest_norms()

    def _state(self) -> dict[str, Any]:
        return {"ref_norms": self.ref_norms} if self.cap_rows else {}

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        q = self._prepare_queries(start, best_v.shape[0])
        if not self.cap_rows:
            self._scan(q, best_v, best_i, buf)
            return
        rows, redo = self._rank_exact(q, None, best_v, best_i, start, buf, self.tile_b)
        self._record(best_v.shape[0], rows, redo)
