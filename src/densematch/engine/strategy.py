"""What every search strategy shares: its inputs, the prepared rows, the scan of reference tiles,
re-scoring by the direct form, the final values, and the part of the memory model they hold.

A strategy is a class with a memory model (:meth:`Strategy.working_set`, the bytes it holds for
tiles of (ta, tb)) beside the allocations it counts, and two steps per query tile: ``rank`` (the
running top-k of the tile) and ``finalise`` (rows of b, values recomputed, order). The driver
(:mod:`densematch.engine.driver`) chooses one per call, plans with its memory model, and runs it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import native
from ..metrics import Metric
from ..ops import TORCH_OPS, Ops
from ..precision import Precision, product_slack
from ..threads import ITEMS_PER_WORKER, own_thread, share_out
from .merge import best_of_candidates, merge_best, merge_topk, order
from .plan import Dims, TilePlan, device_caps
from .pool import CandidateList, Pool

__all__ = ["CANDIDATE_BYTES", "Inputs", "Prepared", "Strategy", "rescore_bytes", "resolve_bytes", "rows_of"]

# Bytes per candidate while :meth:`Strategy._resolve` lists and scores them: its (row, column)
# from nonzero (16), the row and column gathered and offset (24), and its direct score.
CANDIDATE_BYTES = 48


def rows_of(x: torch.Tensor, rows: torch.Tensor | None, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``x``, or of ``x[rows]`` when a row list is given."""
    return x[start:stop] if rows is None else x.index_select(0, rows[start:stop])


def rescore_bytes(c: int) -> int:
    """Bytes to re-score one candidate by the direct form: its raw query and reference rows
    gathered, their copies in the compute dtype, and their difference or unit copies (8-byte
    items at most), and its indices and score."""
    return 6 * 8 * c + 64


def resolve_bytes(ta: int, tb: int, cap: int) -> int:
    """Bytes :meth:`Strategy._resolve` holds beyond its block of upper bounds: the candidates of
    one step (at most ``max(tb, ta * cap)``, see there; counted as their sum, which the planner
    needs linear in ``ta``), :data:`CANDIDATE_BYTES` each."""
    return (tb + ta * cap) * CANDIDATE_BYTES if cap else 0


@dataclass(frozen=True)
class Prepared:
    """References prepared once by a strategy (:meth:`Strategy.prepared`), for later searches
    of the same references with other queries (:class:`densematch.KNNIndex`).

    Attributes
    ----------
    strategy : type
        The strategy that prepared them; only it can use them.
    peak : float
        The largest magnitude of the references (for the common scale).
    scale : float
        The common scale they were prepared at.
    centre : Tensor of shape (C,), optional
        The references' mean, for centred metrics.
    whole : Tensor of shape (nb, C'), optional
        Every prepared reference row.
    state : dict
        What else the strategy derives from the references alone (norms, half copies).
    """

    strategy: type[Strategy]
    peak: float
    scale: float
    centre: torch.Tensor | None
    whole: torch.Tensor | None
    state: dict[str, Any]


@dataclass(frozen=True)
class Inputs:
    """One call's inputs, as the driver resolved them.

    Attributes
    ----------
    a, b : Tensor of shape (Na, C), (Nb, C)
        Query and reference rows (any float dtype, any strides).
    rows_a, rows_b : Tensor of int64, optional
        The query rows ranked, and the reference rows that may be chosen (increasing).
    metric : Metric
    precision : Precision
    k : int
    scale : float
        A power of two applied to every row before use (1: none); see ``driver.common_scale``.
    cap : int
        Candidates kept per row by the strategy (its :meth:`Strategy.cap`).
    stats : dict, optional
        Counts of the certified search, filled by the strategies that certify.
    prepared : Prepared, optional
        The references already prepared (by this strategy, at this scale).
    workers : int
        Threads the call's work is shared out over (:func:`densematch.threads.share_out`).
    ops : Ops
        The call's kernel operations (:func:`densematch.kernels.ops_for`): where they are C's,
        the strategies' own C steps run too (merges, candidate lists, the certified step).
    """

    a: torch.Tensor
    b: torch.Tensor
    rows_a: torch.Tensor | None
    rows_b: torch.Tensor | None
    metric: Metric
    precision: Precision
    k: int
    scale: float = 1.0
    cap: int = 0
    stats: dict[str, int] | None = None
    prepared: Prepared | None = None
    workers: int = 1
    ops: Ops = TORCH_OPS

    @property
    def nb(self) -> int:
        return self.b.shape[0] if self.rows_b is None else self.rows_b.numel()


class Strategy:
    """One call's prepared references; ranks and finalises one query tile at a time, its score
    blocks in one reused buffer (:meth:`block`)."""

    # the reference tile may halve down to this many rows to make room for taller query tiles
    narrowest_b = 1
    # query tiles per worker thread at least (threads.share_size), so that a worker slowed down
    # by other processes leaves few behind
    items_per_worker = ITEMS_PER_WORKER
    # the largest prepared reference norms (:meth:`_largest_norms`), set by the strategies that
    # search in the compute dtype with near-ties settled (:meth:`_rank_exact`)
    ref_norms: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def cap(cls, precision: Precision, metric: Metric, k: int, nb: int, c: int) -> int:
        """Candidates kept per row of a search of ``nb`` references of ``c`` channels (0: the
        strategy keeps none)."""
        return 0

    @classmethod
    def tile_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int]:
        """The largest tiles worth having (query rows, reference rows)."""
        return device_caps(device)

    @classmethod
    def narrower_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int] | None:
        """Tile caps to plan at where :meth:`tile_caps` would leave the search the base cap of
        candidates, not its grown one (None: no others)."""
        return None

    @classmethod
    def working_set(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        """Bytes one call holds at once for tiles of (ta, tb): the terms every strategy shares,
        named below beside what allocates them, plus :meth:`own_bytes`."""
        row_prep = d.cp * (d.item + d.half_item) + d.c * d.in_item  # a gathered raw row, its prepared copies
        refs = d.ref_rows(tb, whole_b) * row_prep  # _prepare_refs: all references, or one tile
        queries = ta * row_prep  # _prepare_queries: one tile
        state = d.na * d.k * (d.item + 8)  # the driver's running top-k: value + int64 index
        merge = ta * 2 * d.k * (d.item + 8) * 3  # merge_topk's candidates and their sorts
        final = ta * d.k * d.c * (d.in_item + 4 * d.item)  # finalise: rows regathered, repeated, differenced
        return refs + queries + state + merge + final + cls.own_bytes(d, ta, tb, whole_b)

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        """The strategy's own temporaries: here the score block (:meth:`block`; cdist also
        makes its own) and the merge's reductions of it (row maxima, the rows that improve, the
        boundary-ties count of :func:`merge.topk_lowest_index`)."""
        block_item = d.half_item or d.item
        scores = ta * tb * block_item * (2 if d.cdist else 1)
        reduce = ta * tb * (block_item if d.k == 1 else 2 * block_item + 1)
        return scores + reduce

    def __init__(self, inputs: Inputs, plan: TilePlan) -> None:
        self.inputs = inputs
        self.a, self.b, self.rows_a, self.rows_b = inputs.a, inputs.b, inputs.rows_a, inputs.rows_b
        self.metric, self.dtype, self.scale = inputs.metric, inputs.precision.dtype, inputs.scale
        self.ops = inputs.ops
        self.tile_b, self.nb, self.cap_rows = plan.tile_b, inputs.nb, inputs.cap
        self.merge = merge_best if inputs.k == 1 else merge_topk
        self.lock = threading.Lock()  # for what query tiles on several threads update together
        self.whole: torch.Tensor | None = None
        # cosine's per-reference scale and norm for the C kernel of pairs, once rather than at
        # each pair; worth a pass over b only where at least as many pairs will be valued
        self.ref_terms: torch.Tensor | None = None
        na = self.a.shape[0] if self.rows_a is None else self.rows_a.numel()
        if self.scale == 1.0 and self.b.dtype == self.dtype and na * inputs.k >= self.b.shape[0]:
            self.ref_terms = self.metric.pair_terms(self.b, ops=self.ops)
        if inputs.prepared is not None:
            self.centre, self.whole = inputs.prepared.centre, inputs.prepared.whole
            return
        self.centre = self._reference_mean() if self.metric.centred else None
        # references prepared once when the plan allows, else tile by tile
        if plan.whole_b:
            cp = self.b.shape[1] + self.metric.extra_columns
            whole = torch.empty((self.nb, cp), dtype=self.dtype, device=self.b.device)
            self._each_ref_tile(lambda start, stop: self._prepare_refs(start, stop, out=whole[start:stop]))
            self.whole = whole

    def prepared(self, peak: float) -> Prepared:
        """The references as this search prepared them (``peak``: their largest magnitude)."""
        return Prepared(type(self), peak, self.scale, self.centre, self.whole, self._state())

    def _state(self) -> dict[str, Any]:
        """What a strategy derives from the references alone, besides the prepared rows."""
        return {}

    def block(self, ta: int) -> torch.Tensor:
        """The buffer every score block of query tiles of ``ta`` rows is written into."""
        dtype = self.inputs.precision.half or self.dtype
        return torch.empty(ta * self.tile_b, dtype=dtype, device=self.a.device)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Raw rows times the common scale (a power of two: exact), in their own dtype."""
        return x if self.scale == 1.0 else x * self.scale

    def _each_ref_tile(self, work: Callable[[int, int], object]) -> None:
        """``work(start, stop)`` for every reference tile, shared out over the call's workers (so
        no operator inside waits on an OpenMP barrier)."""

        def tile(j: int) -> None:
            work(j, min(j + self.tile_b, self.nb))

        share_out(range(0, self.nb, self.tile_b), tile, self.inputs.workers, name="densematch-refs")

    def _reference_mean(self) -> torch.Tensor:
        parts: dict[int, torch.Tensor] = {}

        def tile(start: int, stop: int) -> None:
            parts[start] = self._scaled(rows_of(self.b, self.rows_b, start, stop)).sum(0, dtype=self.dtype)

        self._each_ref_tile(tile)
        return self._mean_in_tile_order(parts, self.dtype)

    def _mean_in_tile_order(self, sums: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The mean over the references of their tiles' sums (``sums``, keyed by each tile's
        start), added in tile order whichever worker finished first: the same bits with any
        number of workers."""
        total = torch.zeros(self.b.shape[1], dtype=dtype, device=self.b.device)
        for start in sorted(sums):
            total += sums[start]
        return total / self.nb

    def _prepare_refs(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prepared reference rows ``start:stop`` (into ``out`` if given)."""
        if self.whole is not None:
            return self.whole[start:stop]
        rows = self._scaled(rows_of(self.b, self.rows_b, start, stop))
        return self.metric.prepare(rows, "ref", self.dtype, self.centre, out=out)

    def _prepare_queries(self, start: int, m: int) -> torch.Tensor:
        rows = self._scaled(rows_of(self.a, self.rows_a, start, start + m))
        return self.metric.prepare(rows, "query", self.dtype, self.centre)

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        """Merge every reference tile into the running top-k of the query tile at ``start``."""
        raise NotImplementedError

    def _scan(
        self,
        q: torch.Tensor,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        buf: torch.Tensor,
        refs: Callable[[int, int], torch.Tensor] | None = None,
    ) -> None:
        """The plain search of prepared query rows ``q`` over every reference tile that
        ``refs(start, stop)`` gives (default: the prepared references), scores in ``buf``."""
        refs = refs or self._prepare_refs
        m = q.shape[0]
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        merge = native.merge if self._native(best_v, best_i) else self.merge
        for j in range(0, self.nb, self.tile_b):
            n = min(self.tile_b, self.nb - j)
            s = self.metric.score_tile(q, refs(j, j + n), out=buf[: m * n].view(m, n), ops=self.ops)
            merge(s, j, best_v, best_i)

    def _native(self, best_v: torch.Tensor, best_i: torch.Tensor, tiles: torch.dtype | None = None) -> bool:
        """Whether score tiles (of dtype ``tiles``, by default the scan's) merge through the C
        kernel (:func:`densematch.kernels.native.merge`): float32, float64 or bfloat16 scores on a
        CPU, into a contiguous running top-k."""
        tiles = tiles or self.inputs.precision.half or self.dtype
        return tiles != torch.float16 and self.ops.c and best_v.is_contiguous() and best_i.is_contiguous()

    def _best_of(
        self, rows: torch.Tensor, cols: torch.Tensor, score: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor
    ) -> None:
        """Re-scored candidates (``rows`` of ``best_v``, columns, scores) into the emptied running
        top-k: by the C kernel where it runs (one insertion per pair), else by sorting."""
        if self.ops.c and best_v.is_contiguous() and best_i.is_contiguous():
            native.merge_pairs(rows, cols, score, best_v, best_i)
        else:
            best_of_candidates(rows, cols, score, best_v, best_i)

    def _largest_norms(self) -> tuple[float, float]:
        """The largest prepared reference norms, of the feature columns and of the l2 column:
        with a query's own, they bound how far the compute dtype's product can be from the exact
        one for every pair of the row (:func:`densematch.precision.product_slack`)."""
        c = self.a.shape[1]
        norms: list[tuple[float, float]] = [(0.0, 0.0)]

        def tile(start: int, stop: int) -> None:
            r = self._prepare_refs(start, stop)
            body = float(torch.linalg.vector_norm(r[:, :c], dim=1).amax()) if r.numel() else 0.0
            extra = float(torch.linalg.vector_norm(r[:, c:], dim=1).amax()) if r.shape[1] > c and r.numel() else 0.0
            with self.lock:
                norms.append((body, extra))

        if self.whole is not None:
            # every reference prepared: one pass on this thread alone (tiles this small cost more
            # to hand out, and OpenMP's threads, once woken, spin on the cores the search's
            # workers are about to take)
            with own_thread():
                tile(0, self.nb)
        else:
            self._each_ref_tile(tile)
        return max(n[0] for n in norms), max(n[1] for n in norms)

    def _rank_exact(
        self,
        q: torch.Tensor,
        tile_rows: torch.Tensor | None,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        start: int,
        buf: torch.Tensor,
        width: int,
        cap: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of prepared query rows ``q`` (rows ``tile_rows`` of the query tile at
        ``start``; None: the whole tile) from products in the compute dtype, near-ties settled by
        the direct form, references in blocks of ``width`` columns scored into ``buf``, at most
        ``cap`` candidates listed per row (default: the search's cap; ``nb`` lists every one).

        Each product is within a slack of the exact one (:meth:`_tile_bounds`: one for every tile,
        or each reference tile its own, its scores lowered by it to lower bounds), so the exact top
        k all reach the k-th best lower bound: a pair is a candidate if its score less its tile's
        margin (twice the slack, or once with the lowering) reaches it. They are listed during the
        scan, while the block is in cache, against each row's running k-th best (which only
        rises), with their score plus their margin, and pruned as it rises: no block is multiplied
        twice. Rows with more than k candidates are settled by the direct form; a row that lists
        more than the cap is resolved at the end against its final k-th best, without a cap
        (:meth:`_resolve`). Returns the tile rows of the listed candidates and the rows resolved,
        for :meth:`_record`."""
        m, k = best_v.shape
        rows_of_tile = (lambda r: r) if tile_rows is None else (lambda r: tile_rows[r])
        zero = (q == 0).all(1) if not self.metric.extra_columns else None
        if zero is not None and bool(zero.any()):
            # a zero query row of a pure product (dot, cosine: a black patch) ties every reference
            # at an exact 0, more ties than any cap: its top k are its first references with a 0
            # product (`_first_finite`), found without a product, and the scan goes on without it
            # (listed up to the cap, then resolved over every block: 96x96x64 same-scene cosine,
            # 78 such rows took 12 ms of a 206 ms search). Counted with the rows resolved.
            best_v[zero], best_i[zero] = self._first_finite(k, q.device)
            keep = (~zero).nonzero().squeeze(1)
            rows, redo = keep[:0], keep[:0]
            if keep.numel():
                v, i = best_v[keep], best_i[keep]
                rows, redo = self._rank_exact(q[keep], rows_of_tile(keep), v, i, start, buf, width, cap)
                best_v[keep], best_i[keep] = v, i
            return rows, torch.cat([redo, rows_of_tile(zero.nonzero().squeeze(1))])
        bounds = self._tile_bounds(q)
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        # on a CPU one C call per block merges and lists (native.merge); else the torch merge
        # finds the rows that reach their floor and the pool lists them
        listed: CandidateList
        cap = self.cap_rows if cap is None else cap
        if self._native(best_v, best_i, self.dtype):
            listed = native.Candidates(m, cap, self.dtype)
        else:
            listed = pool = Pool(m, cap, q.device, self.dtype, lazy=True)
        for j in range(0, self.nb, width):
            n = min(width, self.nb - j)
            s = self.metric.score_tile(q, self._prepare_refs(j, j + n), out=buf[: m * n].view(m, n), ops=self.ops)
            lowered, margin = bounds(j, n)
            if lowered is not None:
                s.sub_(lowered[:, None])
            if isinstance(listed, native.Candidates):
                native.merge(s, j, best_v, best_i, margin, listed)
                continue
            hot, sub = self.merge(s, j, best_v, best_i, margin)
            if hot.numel():
                pool.add(sub.add_(margin[hot, None]), j, best_v[:, -1], hot)  # the block is done with
        # every pair is listed with its score plus its tile's margin: those reaching the k-th best
        rows, cols = listed.reaching(best_v[:, -1])
        redo = listed.over.nonzero().squeeze(1)
        crowded = torch.bincount(rows, minlength=m) > k
        keep = crowded[rows]
        if bool(keep.any()):
            near, cols = rows[keep], cols[keep]
            score = self._direct_scores(start, rows_of_tile(near), cols, buf)
            v, i = best_v[crowded], best_i[crowded]
            local = torch.cumsum(crowded, 0)[near] - 1  # rows renumbered among the crowded
            self._best_of(local, cols, score, v.fill_(-math.inf), i.fill_(-1))
            best_v[crowded], best_i[crowded] = v, i
        if redo.numel():
            q_redo = q.index_select(0, redo)
            kth = best_v[redo, -1]
            best_v[redo], best_i[redo] = self._resolve(q_redo, rows_of_tile(redo), kth, start, k, buf)
        return rows_of_tile(rows), rows_of_tile(redo)

    def _tile_bounds(self, q: torch.Tensor) -> Callable[[int, int], tuple[torch.Tensor | None, torch.Tensor]]:
        """For prepared query rows ``q`` (m, C), a function of a reference tile (start, rows)
        giving what each row's scores of that tile are lowered by before they merge (None: they
        are not) and the margin (m,) by which a merged score may fall short of its row's k-th
        best and its pair still be a candidate. Here one slack for every tile (the largest
        references', ``self.ref_norms``): scores as they are, twice the slack."""
        twice = 2 * product_slack(q, self.ref_norms, self.metric.extra_columns)
        return lambda start, n: (None, twice)

    def _resolve_shape(self, m: int) -> tuple[int, int]:
        """(rows, columns) of the blocks of scores :meth:`_resolve` computes for a query tile of
        ``m`` rows: by default the scan's own block, whose temporaries are free by then."""
        return m, self.tile_b

    def _groups(self, m: int, r: int) -> tuple[int, int]:
        """(rows, columns) of each step over ``r`` rows of a query tile of ``m`` rows searched
        again or resolved: references in blocks of at most :meth:`_resolve_shape`'s columns, as
        many rows at once as its block holds."""
        block_rows, block_cols = self._resolve_shape(m)
        width = min(block_cols, self.nb)
        return max(1, min(r, block_rows * block_cols // width)), width

    def _resolve(
        self, q: torch.Tensor, rows: torch.Tensor, kth: torch.Tensor, start: int, k: int, buf: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact top ``k`` (values, tile positions) of the rows ``rows`` of the query tile at
        ``start`` (``q``: their prepared rows) whose near-ties outgrew the cap: every pair whose
        product in the compute dtype reaches its row's floor (``kth``, the scan's k-th best,
        less its tile's margin, plus what its scores were lowered by: :meth:`_tile_bounds`) is
        scored by the metric's direct form, however many there are, written
        over its product in the block (the others become -inf) and merged into the rows' top k
        like any score tile (equal scores to the lower column). Rows are taken in groups and
        references in blocks of :meth:`_resolve_shape`; the candidates listed at once are at most
        ``max(columns, tile rows x cap)`` (a row alone may bring a whole block's columns)."""
        r, device = rows.numel(), q.device
        v = torch.full((r, k), -math.inf, dtype=self.dtype, device=device)
        i = torch.full((r, k), -1, dtype=torch.int64, device=device)
        if r == 0:
            return v, i
        group, width = self._groups(q.shape[0], r)
        limit = max(width, q.shape[0] * self.cap_rows)
        merge = native.merge if self.ops.c else self.merge
        bounds = self._tile_bounds(q)
        for g in range(0, r, group):
            sel = rows[g : g + group]
            gv, gi = v[g : g + group], i[g : g + group]
            side = q[g : g + group]
            for j in range(0, self.nb, width):
                n = min(width, self.nb - j)
                block = self.metric.score_tile(side, self._prepare_refs(j, j + n), ops=self.ops)
                lowered, margin = bounds(j, n)
                floor = kth - margin if lowered is None else kth - margin + lowered
                reach = block >= floor[g : g + group, None]
                total = torch.cumsum(reach.sum(1), 0).tolist()
                block.fill_(-math.inf)
                first = 0
                while first < len(total):  # rows of the group in steps of at most `limit` candidates
                    base = total[first - 1] if first else 0
                    last = max(first + 1, bisect.bisect_right(total, base + limit))
                    if total[last - 1] > base:
                        lr, lc = reach[first:last].nonzero().unbind(1)
                        block[first + lr, lc] = self._direct_scores(start, sel[first + lr], lc + j, buf)
                    first = last
                merge(block, j, gv, gi)
        return v, i

    def _first_finite(self, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The top ``k`` (values (k,), positions (k,)) of a zero query row of a pure product: the
        first references whose prepared row is finite score an exact 0 (a sum of products of 0),
        the others NaN (0 times inf or NaN), which never ranks; -inf and -1 past the last."""
        v = torch.full((k,), -math.inf, dtype=self.dtype, device=device)
        i = torch.full((k,), -1, dtype=torch.int64, device=device)
        found = 0
        for j in range(0, self.nb, self.tile_b):
            refs = self._prepare_refs(j, min(j + self.tile_b, self.nb))
            at = torch.isfinite(refs).all(1).nonzero().squeeze(1)[: k - found] + j
            i[found : found + at.numel()] = at
            v[found : found + at.numel()] = 0.0
            found += at.numel()
            if found == k:
                break
        return v, i

    def _record(self, m: int, rows: torch.Tensor, resolved: torch.Tensor) -> None:
        """Add a query tile of ``m`` rows to the call's ``stats``: its listed candidates (their
        rows), the most for one row, and the rows resolved without a cap."""
        stats = self.inputs.stats
        if stats is None:
            return
        most = int(torch.bincount(rows, minlength=m).max()) if m else 0
        with self.lock:  # query tiles may run on several threads
            stats["candidates"] += int(rows.numel())
            stats["most"] = max(stats["most"], most)
            stats["fallback"] += int(resolved.numel())

    def _direct_scores(self, start: int, rows: torch.Tensor, cols: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """The metric's direct scores of candidates (rows of the query tile at ``start``,
        reference positions ``cols``) in the compute dtype, in chunks within the bytes of
        ``buf`` (:func:`rescore_bytes` per candidate)."""
        score = torch.empty(rows.numel(), dtype=self.dtype, device=rows.device)
        step = max(1, buf.numel() * buf.element_size() // rescore_bytes(self.a.shape[1]))
        if self._reads_in_place():  # no gathered rows: one call for them all
            step = max(step, rows.numel())
        queries = start + rows if self.rows_a is None else self.rows_a[start + rows]
        refs = cols if self.rows_b is None else self.rows_b[cols]
        for s in range(0, rows.numel(), step):
            q, q_rows = self._pair_rows(self.a, queries[s : s + step])
            r, idx, terms = self._ref_pair_rows(refs[s : s + step, None])
            score[s : s + step] = self.metric.direct_scores(q, r, idx, q_rows=q_rows, ops=self.ops, r_terms=terms)[:, 0]
        return score

    def _reads_in_place(self) -> bool:
        """Whether the C pair kernel values pairs straight from a and b (in the compute dtype,
        unscaled, unit-stride rows): then re-scoring gathers no rows, whatever the count."""
        return (
            self.metric.pair_kind is not None
            and self.scale == 1.0
            and all(x.dtype == self.dtype and (x.stride(1) == 1 or x.shape[1] <= 1) for x in (self.a, self.b))
            and self.ops.c
        )

    def _pair_rows(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw rows of ``x`` (a or b) in the compute dtype for the metric's pairs, and where
        ``rows`` (any shape) of x are in them: x itself when it is in the compute dtype and
        unscaled (the C kernel reads it in place), else those rows gathered, scaled and cast."""
        if self.scale == 1.0 and x.dtype == self.dtype:
            return x, rows
        g = self._scaled(x.index_select(0, rows.reshape(-1))).to(self.dtype)
        return g, torch.arange(g.shape[0], device=g.device).view(rows.shape)

    def _ref_pair_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_pair_rows` of b, with :attr:`ref_terms` where the kernel reads b in place."""
        r, idx = self._pair_rows(self.b, rows)
        return r, idx, self.ref_terms if r is self.b else None

    def finalise(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int) -> None:
        """Map tile positions to rows of b, recompute each chosen pair's value, and reorder."""
        found = best_i >= 0
        local = best_i.clamp_min(0)
        if self.rows_b is not None:
            best_i.copy_(torch.where(found, self.rows_b[local], best_i))
            local = best_i.clamp_min(0)
        queries = torch.arange(start, start + best_i.shape[0], device=best_i.device)
        if self.rows_a is not None:
            queries = self.rows_a[queries]
        q, q_rows = self._pair_rows(self.a, queries)
        r, idx, terms = self._ref_pair_rows(local)
        v = self.metric.pair_values(q, r, idx, q_rows=q_rows, ops=self.ops, r_terms=terms)
        missing = math.inf if self.metric.higher_is_better else -math.inf
        v, i = order(torch.where(found, v, -missing), best_i, descending=self.metric.higher_is_better)
        if self.scale != 1.0 and self.metric.degree:
            # ordered at the search's scale, then back to the caller's units: a value past the
            # dtype's range (only where the inputs had to be rescaled) becomes inf, never NaN
            v = v / self.scale**self.metric.degree
        best_v.copy_(torch.where(i >= 0, v, math.nan))
        best_i.copy_(i)
