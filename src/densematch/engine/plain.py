"""The search in the compute dtype (float32 or float64), with its near-ties settled.

An expansion rounds equal distances unequally, and exact ties must go to the lowest index: after
the scan, each row's candidates within the products' rounding bound of its k-th best are
re-scored by the metric's direct form (:meth:`PlainSearch.rank`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels import native
from ..metrics import Metric
from ..precision import Precision, product_slack
from .merge import best_of_candidates
from .plan import Dims, TilePlan
from .pool import CandidateList, Pool
from .strategy import Inputs, Strategy, rescore_bytes, resolve_bytes

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
        self.ref_norms = (0.0, 0.0)
        if inputs.prepared is not None:
            self.ref_norms = inputs.prepared.state.get("ref_norms", self.ref_norms)
        elif self.cap_rows:
            # the largest prepared reference norms (of the feature columns, and of the l2
            # column): with a query's own, they bound how far the compute dtype's product can be
            # from the exact one for every pair of the row
            c = self.a.shape[1]
            norms: list[tuple[float, float]] = [self.ref_norms]

            def tile(start: int, stop: int) -> None:
                r = self._prepare_refs(start, stop)
                body = float(torch.linalg.vector_norm(r[:, :c], dim=1).amax())
                extra = float(torch.linalg.vector_norm(r[:, c:], dim=1).amax()) if r.shape[1] > c else 0.0
                norms.append((body, extra))

            self._each_ref_tile(tile)
            self.ref_norms = (max(n[0] for n in norms), max(n[1] for n in norms))

    def _upper(self, side: Any, j: int, n: int) -> torch.Tensor:
        # the scores themselves: the floors already leave twice the products' slack
        return self.metric.score_tile(side, self._prepare_refs(j, j + n), use_c=self.use_c)

    def _state(self) -> dict[str, Any]:
        return {"ref_norms": self.ref_norms} if self.cap_rows else {}

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        q = self._prepare_queries(start, best_v.shape[0])
        if not self.cap_rows:
            self._scan(q, best_v, best_i, buf)
            return
        # each product is within `slack` of the exact one, so the exact top k all score at
        # least the k-th best minus twice that: the candidates. They are listed during the scan,
        # while the block is in cache, against each row's running floor (its running k-th best
        # minus twice the slack, which only rises), from the rows whose tile maximum reaches
        # their floor before the tile (after the first tiles, few; the merge finds them), and
        # pruned as the floors rise: no tile is multiplied twice. A row that lists more than the
        # cap is resolved at the end against its final floor, without a cap (`_resolve`). Rows
        # with more than k candidates are settled by the direct form.
        m, k = best_v.shape
        twice = 2 * product_slack(q, self.ref_norms, self.metric.extra_columns)
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        # on a CPU one C call per tile merges and lists (native.merge); else the torch merge
        # finds the rows that reach their floor and the pool lists them
        listed: CandidateList
        if self._native(best_v, best_i):
            listed = native.Candidates(m, self.cap_rows, self.dtype)
        else:
            listed = pool = Pool(m, self.cap_rows, q.device, self.dtype, lazy=True)
        for j in range(0, self.nb, self.tile_b):
            n = min(self.tile_b, self.nb - j)
            s = self.metric.score_tile(q, self._prepare_refs(j, j + n), out=buf[: m * n].view(m, n), use_c=self.use_c)
            if isinstance(listed, native.Candidates):
                native.merge(s, j, best_v, best_i, twice, listed)
                continue
            hot, sub = self.merge(s, j, best_v, best_i, twice)
            if hot.numel():
                pool.add(sub, j, best_v[:, -1] - twice, hot)
        floor = best_v[:, -1] - twice
        rows, cols = listed.reaching(floor)
        over = listed.over
        self._record(m, rows, over.nonzero().squeeze(1))
        crowded = torch.bincount(rows, minlength=m) > k
        keep = crowded[rows]
        if bool(keep.any()):
            rows, cols = rows[keep], cols[keep]
            score = self._direct_scores(start, rows, cols, buf)
            v, i = best_v[crowded], best_i[crowded]
            local = torch.cumsum(crowded, 0)[rows] - 1  # rows renumbered among the crowded
            best_of_candidates(local, cols, score, v.fill_(-math.inf), i.fill_(-1))
            best_v[crowded], best_i[crowded] = v, i
        redo = over.nonzero().squeeze(1)
        if redo.numel():
            best_v[redo], best_i[redo] = self._resolve(q, redo, floor[redo], start, k, buf)
