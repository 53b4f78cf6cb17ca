"""The search in the compute dtype (float32 or float64), with its near-ties settled.

An expansion rounds equal distances unequally, and exact ties must go to the lowest index: after
the scan, each row's candidates within the products' rounding bound of its k-th best are
re-scored by the metric's direct form (:meth:`PlainSearch.rank`).

That bound grows with the references' norms. Wide cosine features (:func:`tile_bounds_for`) take
one per reference tile: each tile's largest norm bounds its own pairs, its scores are lowered by
it, and the k-th best is then a lower bound. And as a pure product ranks a query's references the
same after one vector is taken from them all, the references are shifted by their mean where
that shrinks their tiles' norms: same-scene features share most of their length, so their bound
then scales with what they do not share (48x48x1536 same-scene cosine: no row over the cap, from
395 of 2304).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..metrics import Metric
from ..precision import Precision, shifted_slack
from .plan import Dims, TilePlan
from .pool import Pool
from .strategy import Inputs, Strategy, rescore_bytes, resolve_bytes, rows_of

__all__ = ["PlainSearch", "tile_bounds_for"]

# References shifted by their mean where that leaves their tiles' largest norms at most this share
# of what they were, on average
SHIFT_GAIN = 0.9
TILE_BOUNDS_FROM = 512  # channels


def tile_bounds_for(metric: Metric, c: int) -> bool:
    """Whether the plain search of ``c`` channels bounds each reference tile's pairs by its own
    norms, references shifted where that pays: cosine from C=512. Same-scene cosine features (an
    Intel Xeon with AVX-512) sent 10-17% of rows over the cap at C=768 and 1536, none with it, and
    the search took 0.79-0.94 of its time; at C=256 no row was over and the bounds' passes cost
    what the candidates saved (0.99-1.17); dot's rows, of uneven norms, left few near-ties to save
    and its searches took 1.03-1.15 (BENCHMARKS.md)."""
    return metric.shiftable and metric.unit and c >= TILE_BOUNDS_FROM


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

    # each prepared reference's norm, where tiles bound their own pairs (None: one bound for all);
    # the vector taken from every prepared reference (None: none), and their largest norm before
    row_norms: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    unshifted = 0.0

    def __init__(self, inputs: Inputs, plan: TilePlan) -> None:
        # set before the base prepares the references, which tiles' bounds want scaled precisely
        self.tiled = bool(inputs.cap) and tile_bounds_for(inputs.metric, inputs.b.shape[1])
        self.tile_norms: dict[int, list[float]] = {}  # per tile width: each tile's largest norm
        super().__init__(inputs, plan)
        if inputs.prepared is not None:
            state = inputs.prepared.state
            self.ref_norms = state.get("ref_norms", self.ref_norms)
            self.row_norms, self.shift = state.get("row_norms"), state.get("shift")
            self.unshifted = state.get("unshifted", 0.0)
        elif self.cap_rows:
            self.ref_norms = self._shift_refs() if self.tiled else self._largest_norms()

    def _state(self) -> dict[str, Any]:
        if not self.cap_rows:
            return {}
        keys = ("ref_norms", "row_norms", "shift", "unshifted")
        return {key: getattr(self, key) for key in keys}

    def _prepare_refs(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.whole is not None or not self.tiled:
            return super()._prepare_refs(start, stop, out)
        rows = self._scaled(rows_of(self.b, self.rows_b, start, stop))
        refs = self.metric.prepare(rows, "ref", self.dtype, out=out, precise=True)
        return refs if self.shift is None else refs.sub_(self.shift)

    def _shift_refs(self) -> tuple[float, float]:
        """Each reference's norm (:attr:`row_norms`), after their mean is taken from them all
        where that shrinks their tiles' largest norms (:attr:`shift`, :attr:`unshifted`); returns
        the largest, as :meth:`_largest_norms` does. Two passes over the prepared references, and
        a third to shift them where they are prepared once."""
        norms = torch.empty(self.nb, dtype=self.dtype, device=self.b.device)
        shifted = torch.empty_like(norms)
        sums: dict[int, torch.Tensor] = {}

        def first(start: int, stop: int) -> None:
            refs = self._prepare_refs(start, stop)
            sums[start] = refs.sum(0, dtype=torch.float64)
            torch.linalg.vector_norm(refs, dim=1, out=norms[start:stop])

        self._each_ref_tile(first)
        mean = self._mean_in_tile_order(sums, torch.float64).to(self.dtype)  # unused without references

        def second(start: int, stop: int) -> None:
            torch.linalg.vector_norm(self._prepare_refs(start, stop) - mean, dim=1, out=shifted[start:stop])

        self._each_ref_tile(second)
        if self.nb and _mean_of_tiles(shifted, self.tile_b) <= SHIFT_GAIN * _mean_of_tiles(norms, self.tile_b):
            self.shift, self.unshifted, norms = mean, float(norms.amax()), shifted
            if self.whole is not None:
                whole = self.whole
                self._each_ref_tile(lambda start, stop: whole[start:stop].sub_(mean))
        self.row_norms = norms
        return (float(norms.amax()) if self.nb else 0.0), 0.0

    def _tile_norm(self, start: int, n: int) -> float:
        """The largest norm of the references ``start:start + n``, read from the device once for
        all tiles of that width."""
        assert self.row_norms is not None
        if start % n:
            return float(self.row_norms[start : start + n].amax())
        tiles = self.tile_norms.get(n)
        if tiles is None:
            with self.lock:
                tiles = self.tile_norms.setdefault(n, _tile_maxima(self.row_norms, n).tolist())
        return tiles[start // n]

    def _tile_bounds(self, q: torch.Tensor) -> Callable[[int, int], tuple[torch.Tensor | None, torch.Tensor]]:
        """Each reference tile its own slack (its largest norm's, :func:`shifted_slack`): its
        scores lowered by it, a margin of twice it for the pair's own bound and the k-th best's."""
        if self.row_norms is None:
            return super()._tile_bounds(q)
        q_norms = torch.linalg.vector_norm(q, dim=1)

        def bounds(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            slack = shifted_slack(q_norms, q.shape[1], q.dtype, self._tile_norm(start, n), self.unshifted)
            return slack, 2 * slack

        return bounds

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        q = self._prepare_queries(start, best_v.shape[0])
        if not self.cap_rows:
            self._scan(q, best_v, best_i, buf)
            return
        rows, redo = self._rank_exact(q, None, best_v, best_i, start, buf, self.tile_b)
        self._record(best_v.shape[0], rows, redo)


def _tile_maxima(x: torch.Tensor, width: int) -> torch.Tensor:
    """The largest value of each run of ``width`` values of ``x`` (n,), the last run shorter."""
    whole = x.shape[0] // width * width
    parts = [x[:whole].view(-1, width).amax(1)] if whole else []
    if whole < x.shape[0]:
        parts.append(x[whole:].amax().view(1))
    return torch.cat(parts) if parts else x[:0]


def _mean_of_tiles(x: torch.Tensor, width: int) -> float:
    """The mean of :func:`_tile_maxima`."""
    return float(_tile_maxima(x, width).mean())
