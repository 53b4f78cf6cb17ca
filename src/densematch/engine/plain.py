"""The search in the compute dtype (float32 or float64), with its near-ties settled.

An expansion rounds equal distances unequally, and exact ties must go to the lowest index: after
the scan, each row's candidates within the products' rounding bound of its k-th best are
re-scored by the metric's direct form (:meth:`PlainSearch.rank`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..metrics import Metric
from ..precision import Precision, product_slack
from .merge import best_of_candidates
from .plan import Dims, TilePlan
from .pool import Pool
from .strategy import Inputs, Strategy, rescore_bytes

__all__ = ["PlainSearch"]


class PlainSearch(Strategy):
    """Scores in the compute dtype; for matrix metrics with ``precision.certify``, near-ties
    settled by the direct form."""

    @classmethod
    def cap(cls, precision: Precision, metric: Metric, k: int) -> int:
        return precision.cap(k) if metric.matrix and precision.certify else 0

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        held = super().own_bytes(d, ta, tb, whole_b)
        if d.cap:
            # the near-tie pool, each tile's row maxima (`maxima`), the gathered query rows and
            # the pass mask of a recomputed block, and the re-scoring chunk
            tiles = -(-d.nb // max(tb, 1))
            held += (
                Pool.bytes(ta, d.cap)
                + ta * tiles * (d.item + 1)
                + ta * (d.cp * d.item + tb + 8)
                + ta * rescore_bytes(d.c)
            )
        return held

    def __init__(self, inputs: Inputs, plan: TilePlan) -> None:
        super().__init__(inputs, plan)
        self.ref_norms = (0.0, 0.0)
        if inputs.prepared is not None:
            self.ref_norms = inputs.prepared.state.get("ref_norms", self.ref_norms)
        elif self.cap_rows:
            # the largest prepared reference norms (of the feature columns, and of the l2
            # column): with a query's own, they bound how far the compute dtype's product can be
            # from the exact one for every pair of the row
            c = self.a.shape[1]
            for j in range(0, self.nb, self.tile_b):
                r = self._prepare_refs(j, j + self.tile_b)
                body = float(torch.linalg.vector_norm(r[:, :c], dim=1).amax())
                extra = float(torch.linalg.vector_norm(r[:, c:], dim=1).amax()) if r.shape[1] > c else 0.0
                self.ref_norms = (max(self.ref_norms[0], body), max(self.ref_norms[1], extra))

    def _state(self) -> dict[str, Any]:
        return {"ref_norms": self.ref_norms} if self.cap_rows else {}

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        q = self._prepare_queries(start, best_v.shape[0])
        if not self.cap_rows:
            self._scan(q, best_v, best_i, buf)
            return
        # each product is within `slack` of the exact one, so the exact top k all score at
        # least the k-th best minus twice that: the candidates. The scan keeps each tile's row
        # maxima; afterwards only the tiles whose maximum reaches a row's floor (for k=1 mostly
        # its best's own tile) are multiplied again for that row, to list its candidates. Rows
        # with more than k are settled by the direct form (more than the cap: kept as ranked).
        m, k = best_v.shape
        slack = product_slack(q, self.ref_norms, self.metric.extra_columns)
        maxima = torch.empty(m, -(-self.nb // self.tile_b), dtype=self.dtype, device=q.device)
        self._scan(q, best_v, best_i, buf, maxima=maxima)
        floor = best_v[:, -1] - 2 * slack
        near = maxima >= floor[:, None]
        pool = Pool(m, self.cap_rows, q.device, self.dtype, lazy=True)
        for t in (near.sum(0) > 0).nonzero().squeeze(1).tolist():
            j = t * self.tile_b
            n = min(self.tile_b, self.nb - j)
            rows = near[:, t].nonzero().squeeze(1)
            block = self.metric.score_tile(
                q.index_select(0, rows), self._prepare_refs(j, j + n), out=buf[: rows.numel() * n].view(-1, n)
            )
            pool.add(block, j, floor, rows)
        rows, cols = pool.finish(floor)
        crowded = torch.bincount(rows, minlength=m) > k
        keep = crowded[rows]
        if bool(keep.any()):
            rows, cols = rows[keep], cols[keep]
            score = self._direct_scores(start, rows, cols, buf)
            v, i = best_v[crowded], best_i[crowded]
            local = torch.cumsum(crowded, 0)[rows] - 1  # rows renumbered among the crowded
            best_of_candidates(local, cols, score, v.fill_(-math.inf), i.fill_(-1))
            best_v[crowded], best_i[crowded] = v, i
