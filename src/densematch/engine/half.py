"""The certified half-precision search: candidates from half-precision products, made exact by
the rounding certificate of :mod:`densematch.precision`.

For each reference tile, ``e`` (the per-pair bound, one small product) turns half scores ``h``
into lower bounds ``h - e``, whose running k-th best ``t`` the usual merge keeps; every pair with
``h + e >= t`` joins a pool of (row, column, h + e), pruned as ``t`` rises. A row whose pool
outgrows the cap stops collecting and is searched again at the end from float32 products
(:meth:`HalfSearch._search_again`); the others' candidates are re-scored in float32 by the
direct form. Without ``certify`` ("fast"), the half
scores rank alone.

Half rows are centred to shrink the bound: each query tile on its mean, and on a CPU with the C
step each group of native.GROUP references on theirs, the centres' products added back in
float32 (docs/precision.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..kernels import native
from ..metrics import Metric
from ..precision import (
    Precision,
    cross_terms,
    group_centres,
    group_norms,
    group_terms,
    query_terms,
    ref_terms,
    row_norms,
    unit_roundoff,
)
from ..threads import share_out, share_size
from .plan import Dims, TilePlan
from .pool import CandidateList, Pool
from .strategy import Inputs, Strategy, resolve_bytes

__all__ = ["HalfSearch"]

# the float32 roundings of adding the l2 bias to a half score, and of the bounds built on it
# (relative to the score and to the bias): four at most
_BIAS_ROUNDING = 4 * unit_roundoff(torch.float32)
# and of adding a reference group's product and bound (`group_terms`) to them: two more, of each part
_GROUP_ROUNDING = 2 * unit_roundoff(torch.float32)
# the largest share of their norm the references' lowest tenth keep, less their group's centre,
# for the groups to be worth their products (`HalfSearch._group_centres`)
_GROUPS_WORTH = 0.75
# rows over the cap searched again uncapped list at most this share of the tile's list's room
# (`_search_again`): a row of exact ties lists every reference, each then scored directly, so the
# share bounds that worst case (where the cap grew from nb / 32 to nb / 16, the room it had before;
# at the whole room, 96x96x64 cosine with a cap of 512 took 27 -> 90 ms a call:
# benchmarks/history/2026-12-07-issue-39-the-certificate-s-cap-on-an-avx2-cpu.md). Those rows were
# black patches, which `_rank_exact` now settles before its scan; the share stays for other ties.
_UNCAPPED_SHARE = 0.5
# a reference block's bound terms (n, 3) and the float32 bias of its half scores (n,), or None
_Side = tuple[torch.Tensor | None, torch.Tensor | None]
# and its half rows (n, C) before them
_Tile = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class _QueryHalf(NamedTuple):
    """A query tile as the half product reads it (:meth:`HalfSearch._half_query`)."""

    rows: torch.Tensor  # (m, C) half rows: the body columns, less their centre
    terms: torch.Tensor | None  # (m, 3) bound terms (precision.query_terms), None without a bound
    centre: torch.Tensor | None  # (C,) the rows' centre, None where not centred
    centred: torch.Tensor  # (m, C) the body columns less the centre, in float32 (the body itself without one)
    norms: torch.Tensor | None  # (m, 4) precision.row_norms of (centred, rows, body), None without a bound


class HalfSearch(Strategy):
    """Candidates from half-precision products, certified and re-scored (see the module).

    For l2 and sqeuclidean the prepared rows carry an extra column (1 for queries, -|r|^2 / 2
    for references). Rounded to half precision, that column alone would dominate the bound
    (at C=768, -|r|^2/2 near -384 has a bfloat16 spacing of 2, an error up to 1, far above any
    score gap): it is kept out of the half product and added in float32 as a per-reference bias
    instead."""

    # whether the l2 column is added as a float32 bias (the fused kernel handles it itself)
    split_bias = True
    # whether each query tile's half rows are centred on its mean (:meth:`_half_query`), the
    # difference added back as a float32 bias per reference (the fused kernel takes no bias)
    centre_queries = True
    # whether the certified search's C path centres the references' half rows per group of
    # native.GROUP (:meth:`_grouped`), each query's product with the centre added back
    centre_groups = True

    # Each query tile costs a fixed share besides its pairs (its centre's products with every
    # reference, its terms, the settling): fewer, taller shares per worker, and each Python step
    # between C calls and products over twice the columns (tile_caps). At two threads the GIL
    # passed between the workers at every step (about 550 waits a search at 96x96x64). With the
    # set-up's changes beside them, a quarter off the search less its products at two threads
    # (k=1, C = 64-1536), level at one (BENCHMARKS.md, issue 39).
    items_per_worker = 2

    @classmethod
    def tile_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int]:
        rows, cols = super().tile_caps(device, na, nb)
        return (rows, 2 * cols) if device.type == "cpu" else (rows, cols)

    @classmethod
    def narrower_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int] | None:
        # the device's own caps: a wider reference tile holds more per query row
        return super().tile_caps(device, na, nb) if device.type == "cpu" else None

    @classmethod
    def cap(cls, precision: Precision, metric: Metric, k: int, nb: int, c: int) -> int:
        return precision.cap(k, nb, c) if precision.certify else 0

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        held = super().own_bytes(d, ta, tb, whole_b)
        if d.cap:
            # per pair: the bound and lower-bound blocks (`bounds`), |h| and the hot rows' half
            # scores, and the pool's gathered upper bounds with their pass mask; per row: the
            # pool and the bound terms' float32 copies of the half rows (query tile and
            # references: ref_terms, query_terms). The re-scoring chunk reuses the score block;
            # `_resolve` reuses the per-pair blocks (freed by then) and adds its candidates and
            # its group's query rows with their half copies.
            held += (
                Pool.bytes(ta, d.cap)
                + resolve_bytes(ta, tb, d.cap)
                + ta * tb * (3 * d.item + 2 * (d.half_item or d.item) + 1)
                + d.ref_rows(tb, whole_b) * (3 * d.item + d.cp * d.item)
                + ta * d.cp * (2 * d.item + (d.half_item or d.item))
            )
            if cls.centre_groups:
                # the groups' centres and terms, the grouped copy of the references
                # (`_grouped`), the query rows' centred copy and terms, the two blocks of group
                # products kept (`_GroupProducts`) and a tile's copy of its part
                groups = d.nb // native.GROUP + 1
                held += groups * (d.c + 3) * d.item + d.ref_rows(tb, whole_b) * (d.cp + 2) * d.item
                held += ta * (d.c + 5 + 2 * min(groups, _GroupProducts.span(tb)) + tb // native.GROUP + 2) * d.item
        return held

    def __init__(self, inputs: Inputs, plan: TilePlan) -> None:
        self.shift: torch.Tensor | None = None  # set below, once the references' mean is known
        # the reference groups' centres (G, C) and their bound terms (G, 3: group_norms)
        self.centres: torch.Tensor | None = None
        self.group_norms: torch.Tensor | None = None
        self.body_norms: torch.Tensor | None = None  # with every reference prepared
        super().__init__(inputs, plan)
        self.half = inputs.precision.half or self.dtype
        # torch's half products round their float32 sums to half: |stored - sum| <= u |stored| / (1 - u)
        u = unit_roundoff(self.half)
        self.rounding = u / (1.0 - u) * (1.0 + 2.0**-12)
        self.split = self.split_bias and self.metric.extra_columns == 1
        self.centring = self.centre_queries and self.half != self.dtype
        if self.split or self.centring:  # the float32 additions of a bias to the block and bounds
            self.rounding += _BIAS_ROUNDING
        grouped = (
            self.centre_groups
            and self.cap_rows > 0
            and self.half == torch.bfloat16
            and self.dtype == torch.float32
            and self.ops.c
        )
        if inputs.prepared is not None:
            state = inputs.prepared.state
            self.shift, self.whole_h, self.whole_t = state["shift"], state["whole_h"], state["whole_t"]
            self.ref_norms, self.centres = state["ref_norms"], state["centres"]
            self.group_norms, self.body_norms = state["group_norms"], state["body_norms"]
            if self.centres is not None:
                self.rounding += _GROUP_ROUNDING
            return
        # cosine and dot: references shifted by their mean change every score of a query row by
        # the same amount, so no ranking; features that all look alike (raw patches: cosines
        # near 0.9999) keep only their differences, which half precision then resolves
        if self.metric.shiftable and self.half != self.dtype:
            if self.whole is not None:
                shift = self.whole.sum(0) / self.nb
                self.whole -= shift
            else:
                total = torch.zeros(self.b.shape[1], dtype=self.dtype, device=self.b.device)
                for j in range(0, self.nb, self.tile_b):
                    total += self._prepare_refs(j, j + self.tile_b).sum(0)
                shift = total / self.nb
            self.shift = shift
        self.whole_h = self.whole_t = None
        # with every reference prepared, the grouping's blocks leave their half rows and terms
        if grouped and self._group_centres(whole=self.whole is not None):
            self.rounding += _GROUP_ROUNDING
        elif self.whole is not None:
            self.whole_h = self.whole.to(self.half)
            if self.cap_rows:
                self.whole_t = self._terms(self.whole, self.whole_h)
        # for the rows over the cap, searched again in float32 (`_search_again`)
        self.ref_norms = self._largest_norms() if self.cap_rows else (0.0, 0.0)

    def _state(self) -> dict[str, Any]:
        return {
            "shift": self.shift,
            "whole_h": self.whole_h,
            "whole_t": self.whole_t,
            "ref_norms": self.ref_norms,
            "centres": self.centres,
            "group_norms": self.group_norms,
            "body_norms": self.body_norms,
        }

    def _body(self, rows: torch.Tensor) -> torch.Tensor:
        """The columns of prepared rows that the half product reads (the l2 column apart)."""
        return rows[:, : rows.shape[1] - 1] if self.split else rows

    def _group_centres(self, *, whole: bool = False) -> bool:
        """The centres of the groups of native.GROUP consecutive references (their prepared
        body rows' means), and each group's largest norms before and after its centring; kept
        (and True returned) where a tenth of the groups lose at least a quarter of their norm.
        With ``whole`` (every reference prepared), each block also leaves the references less
        their group's centre, as :meth:`_grouped` makes them, in the half type with their bound
        terms (``whole_h``, ``whole_t``: set where the groups are kept), while it is in cache
        and on the worker that made it.

        Two views of one scene have, in every smooth region, dozens of references within a
        half type's resolution of a query's best; neighbouring pixels (a group) look alike, so
        less their centre the half rows keep only what tells them apart, and every term of the
        bound, which scales with the norm of the rows multiplied, shrinks with it (issue 39)."""
        size = native.GROUP
        step = max(size, self.tile_b // size * size)
        halves = terms = None
        if whole:  # the rows are there already: one block per worker's share
            assert self.whole is not None
            step = -(-share_size(self.nb, self.inputs.workers) // size) * size
            halves = torch.empty((self.nb, self.whole.shape[1]), dtype=self.half, device=self.whole.device)
            terms = torch.empty((self.nb, 3), dtype=self.dtype, device=self.whole.device) if self.cap_rows else None
        parts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def block(j: int) -> None:  # references j:j + step, a whole number of groups from j
            refs = self._prepare_refs(j, min(j + step, self.nb))
            body = self._body(refs)
            if halves is not None:  # (grouping runs where the C kernels do)
                # one C pass leaves the centres, the half rows and every norm, where torch's
                # operators make seven passes over the block (issue 39: most of the set-up)
                h = halves[j : j + refs.shape[0]]
                made = native.group_rows(refs, body.shape[1], h)
                if made is not None:
                    t, norms = made  # |d|, |h|, |h - d|, |b|
                    both = norms.new_zeros(t.shape[0] * size, 2)
                    both[: body.shape[0]] = norms[:, [3, 0]]
                    parts[j] = t, both.view(t.shape[0], size, 2).amax(1), norms[:, 3]
                    if terms is not None:
                        terms[j : j + refs.shape[0]] = self._terms(refs, h, norms)
                    return
            t = group_centres(body, size)
            both = torch.zeros(t.shape[0] * size, 2, dtype=body.dtype, device=body.device)
            torch.linalg.vector_norm(body, dim=1, out=both[: body.shape[0], 0])
            # row j starts a group
            grouped = self._grouped(refs, 0, t)
            d = self._body(grouped)
            torch.linalg.vector_norm(d, dim=1, out=both[: body.shape[0], 1])
            # rows holding NaN or inf bound nothing (their own products do); a finite row's norm
            # that overflows stays inf
            doubt = (~torch.isfinite(both[: body.shape[0]]).all(1)).nonzero().squeeze(1)
            if doubt.numel():
                both[doubt[~torch.isfinite(body[doubt]).all(1)]] = 0.0
            parts[j] = t, both.view(t.shape[0], size, 2).amax(1), both[: body.shape[0], 0]
            if halves is not None:
                h = halves[j : j + refs.shape[0]]
                h.copy_(grouped)
                if terms is not None:
                    terms[j : j + refs.shape[0]] = self._terms(grouped, h)

        # each block on a worker: on the caller's threads, operators this small wait on OpenMP
        share_out(range(0, self.nb, step), block, self.inputs.workers, name="densematch-groups")
        centres, norms, body_norms = (list(p) for p in zip(*(parts[j] for j in sorted(parts)), strict=True))
        largest = torch.cat(norms)
        # features unlike their neighbours' (noise) keep their norm: the groups' products would
        # cost without shrinking a bound (the lowest tenth of the ratios: 0.96-1.01 on noise,
        # 0.14-0.66 on same-scene patches, C 64-1536)
        shrink = largest[:, 1] / largest[:, 0].clamp_min(torch.finfo(largest.dtype).tiny)
        if not shrink.numel() or not float(shrink.nan_to_num(nan=1.0).quantile(0.1)) < _GROUPS_WORTH:
            self.centres = None
            return False
        self.centres = torch.cat(centres)
        self.group_norms = group_norms(self.centres, largest)
        # the references' own norms, for the queries' centre products (`_centred`)
        self.body_norms = torch.cat(body_norms) if whole else None
        self.whole_h, self.whole_t = halves, terms
        return True

    def _grouped(self, refs: torch.Tensor, start: int, centres: torch.Tensor | None = None) -> torch.Tensor:
        """Prepared references ``refs`` (rows start onwards) as the half product reads them:
        their body less their group's centre where the search groups them (a copy), else
        themselves. ``centres``: the groups' from ``start``'s on (default: the search's)."""
        if centres is None:
            if self.centres is None:
                return refs
            centres, start = self.centres[start // native.GROUP :], start % native.GROUP
        out = refs.clone()
        body, size = self._body(out), native.GROUP
        # the rows of the group start lies in, the whole groups after them, and the last rows
        head = min(body.shape[0], -start % size)
        full = (body.shape[0] - head) // size
        first = int(head > 0)
        if head:
            body[:head] -= centres[0]
        if full:
            body[head : head + full * size].view(full, size, -1).sub_(centres[first : first + full, None])
        if head + full * size < body.shape[0]:
            body[head + full * size :] -= centres[first + full]
        return out

    def _prepare_refs(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        refs = super()._prepare_refs(start, stop, out)
        return refs if self.whole is not None or self.shift is None else refs.sub_(self.shift)

    def _half_refs(self, start: int, stop: int) -> torch.Tensor:
        if self.whole_h is not None:
            return self.whole_h[start:stop]
        return self._grouped(self._prepare_refs(start, stop), start).to(self.half)

    def _norms(self, x: torch.Tensor, h: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`densematch.precision.row_norms` of ``(x, h, u)``: in one C pass for bfloat16
        half rows on a CPU with the C kernels (at C=1536, 4-5 passes of torch's over the rows
        for each query tile's terms and the references')."""
        if self.ops.c and h.dtype == torch.bfloat16 and x.dtype == torch.float32:
            return native.row_norms(x, h, u)
        return row_norms(x, h, u)

    def _terms(self, refs: torch.Tensor, half_refs: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
        """The references' bound terms: of every column, or with the l2 bias apart, of the body
        columns plus the float32 rounding of adding the bias (in the per-reference term).
        ``norms``: the body columns' :meth:`_norms`, where made already."""
        if not self.split:
            return ref_terms(refs, half_refs, norms=self._norms(refs, half_refs) if norms is None else norms)
        c = refs.shape[1] - 1
        body, half_body = refs[:, :c], half_refs[:, :c]
        terms = ref_terms(body, half_body, norms=self._norms(body, half_body) if norms is None else norms)
        terms[:, 2] += _BIAS_ROUNDING * refs[:, c].abs()
        return terms

    def _half_query(self, q: torch.Tensor, *, bound: bool = True) -> _QueryHalf:
        """The query rows the half product reads (the body columns, less their centre), with
        their bound terms and norms (:func:`densematch.precision.row_norms`; both None without
        ``bound``), that centre (None where the rows are not centred) and the centred rows in
        float32.

        Centring: with ``v`` the mean of the tile's finite body rows, ``a.b = (a - v).b + v.b``,
        and ``v.b`` is a per-reference float32 bias (:meth:`_sides`). Features that look alike
        (same-scene patches) keep only what tells them apart, so every term of the bound, which
        scales with the norm of the rows multiplied, shrinks with it (issue 39: 5x at C=64)."""
        body = self._body(q)
        finite = self._finite_rows(body) if self.centring and body.shape[0] > 1 else None
        centre = None
        centred = body
        if finite is not None and bool(finite.any()):
            # (a boolean index would copy the whole tile where, as almost always, every row is finite)
            centre = body.mean(0) if bool(finite.all()) else body[finite].mean(0)
            centred = body - centre
        qh = centred.to(self.half)
        if not bound:
            return _QueryHalf(qh, None, centre, centred, None)
        norms = self._norms(centred, qh, body)
        terms = query_terms(centred, qh, None if centre is None else body, norms=norms)
        return _QueryHalf(qh, terms, centre, centred, norms)

    @staticmethod
    def _finite_rows(body: torch.Tensor) -> torch.Tensor:
        """Which rows hold only finite values: a finite row sum proves it (a NaN or inf makes
        the sum so), and only the rows whose sum is not finite (or overflowed) are read again,
        as a whole-tensor ``isfinite`` costs about 15x a row sum on CPUs."""
        finite = torch.isfinite(body.sum(1))
        if not bool(finite.all()):
            doubt = (~finite).nonzero().squeeze(1)
            finite[doubt] = torch.isfinite(body[doubt]).all(1)
        return finite

    def _sides(
        self, centre: torch.Tensor | None, *, bound: bool = True, planes: bool = False
    ) -> Callable[[int, int], _Tile]:
        """``side(start, stop)``: the half rows of references start:stop as the product reads
        them, their bound terms (None without ``bound``; rows (n, 3), or with ``planes`` three
        planes (3, n) with unit-stride rows, as the C step reads them) and the float32 bias added
        to their half scores (the l2 column kept out of the product, plus ``centre . b`` for
        centred queries; None without either), for a query tile centred on ``centre``. With every
        reference prepared, the terms and bias of all of them are made once here; else each tile
        is prepared once for its half rows, terms and bias."""
        if self.whole is not None and (self.whole_t is not None or not bound):
            terms, bias = self._centred(self.whole, self.whole_t if bound else None, centre)
            if planes and terms is not None:
                terms = terms.T.contiguous()
            return lambda start, stop: (
                self._half_refs(start, stop),
                None if terms is None else terms[:, start:stop] if planes else terms[start:stop],
                None if bias is None else bias[start:stop],
            )

        def side(start: int, stop: int) -> _Tile:
            refs = self._prepare_refs(start, stop)
            grouped = self._grouped(refs, start)
            rh = grouped.to(self.half)  # (never prepared whole here: no whole_h either)
            # the terms of the rows rh rounds (less their group's centre where grouped); the
            # centre's products of the rows themselves
            terms = self._terms(grouped, rh) if bound else None
            terms, bias = self._centred(refs, terms, centre)
            return rh, (terms.T.contiguous() if planes and terms is not None else terms), bias

        return side

    def _centred(self, refs: torch.Tensor, terms: torch.Tensor | None, centre: torch.Tensor | None) -> _Side:
        """The terms and bias of prepared references ``refs`` (their bound terms ``terms``, or
        None) for queries centred on ``centre``: the bias gains ``centre . b``, computed in
        float32 to within ``gamma |centre| |b|``, and the per-reference term that and its
        addition's roundings."""
        c = refs.shape[1] - 1 if self.split else refs.shape[1]
        bias = refs[:, c] if self.split else None
        if centre is None:
            if terms is not None and bias is not None and self.centres is not None:
                terms = terms.clone()
                terms[:, 2] += _GROUP_ROUNDING * bias.abs()
            return terms, bias
        cross = refs[:, :c] @ centre
        if terms is not None:
            terms = terms.clone()
            # grouped, the half rows are b less its centre: the cross product's own norm
            norms = None
            if self.centres is not None:
                whole = self.body_norms is not None and refs is self.whole
                norms = self.body_norms if whole else torch.linalg.vector_norm(refs[:, :c], dim=1)
            terms[:, 2] += cross_terms(terms, centre, cross, self.half, norms)
            both = cross.abs() if bias is None else bias.abs() + cross.abs()
            if bias is not None:
                terms[:, 2] += unit_roundoff(self.dtype) * both
            if self.centres is not None:
                terms[:, 2] += _GROUP_ROUNDING * both
        return terms, cross if bias is None else cross.add_(bias)

    def _block(
        self, qh: torch.Tensor, j: int, n: int, out: torch.Tensor | None = None, *, sides: Callable[[int, int], _Tile]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The half scores of references j:j+n (into ``out``), their bound terms, and the
        float32 bias to add (None without one), from ``sides`` (:meth:`_sides`)."""
        rh, terms, bias = sides(j, j + n)
        c = qh.shape[1]
        return torch.mm(qh, (rh if rh.shape[1] == c else rh[:, :c]).T, out=out), terms, bias

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        m = best_v.shape[0]
        q = self._prepare_queries(start, m)
        if not self.cap_rows:
            self._rank_fast(q, best_v, best_i, buf)
            return
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        half = self._half_query(q)
        qh, qt = half.rows, half.terms
        assert qt is not None
        # the C step: always with grouped half rows (only it adds the groups' bounds), else for
        # bfloat16 on a CPU with the C kernels
        c_step = self.centres is not None or self._native_certified(best_v, best_i)
        sides = self._sides(half.centre, planes=c_step)
        if c_step:
            v, i = best_v.contiguous(), best_i.contiguous()
            self._rank_native(q, half, sides, v, i, start, buf)
            if v is not best_v or i is not best_i:
                best_v.copy_(v)
                best_i.copy_(i)
            return
        rounding = self.rounding
        reach_rows = (qt[:, 0] + qt[:, 1]) * (1.0 + 2.0**-10) * rounding  # >= |a'| u/(1-u)
        pool = Pool(m, self.cap_rows, q.device, self.dtype)
        bounds = torch.empty(2, m * min(self.tile_b, self.nb), dtype=self.dtype, device=q.device)
        for j in self._tile_order(start, m):
            n = min(self.tile_b, self.nb - j)
            s, terms, bias = self._block(qh, j, n, out=buf[: m * n].view(m, n), sides=sides)
            assert terms is not None
            # only rows whose best score, raised by the largest bound it can have in this tile,
            # reaches the floor can gain a candidate or a better floor: after the first tiles,
            # few do, and the others cost one row maximum, as in the float32 search
            top = terms.amax(0)
            reach = s.amax(1).to(self.dtype) + qt @ top + reach_rows * top[1]
            if bias is not None:
                reach += bias.amax()
            # (NaN, from products past float16's range, reaches: such pairs prove nothing)
            hot = (~(reach < best_v[:, -1]) & ~pool.over).nonzero().squeeze(1)
            h = hot.numel()
            if h == 0:
                continue
            every = h == m
            sub = s if every else s.index_select(0, hot)
            e = torch.mm(qt if every else qt.index_select(0, hot), terms.T, out=bounds[0, : h * n].view(h, n))
            low = torch.sub(sub, e.add_(sub.abs(), alpha=rounding), out=bounds[1, : h * n].view(h, n))
            if bias is not None:
                low += bias
            low.nan_to_num_(nan=-math.inf)
            if every:
                self.merge(low, j, best_v, best_i)
            else:
                v, i = best_v[hot], best_i[hot]
                self.merge(low, j, v, i)
                best_v[hot], best_i[hot] = v, i
            upper = e.add_(sub) if bias is None else e.add_(sub).add_(bias)
            pool.add(upper.nan_to_num_(nan=math.inf), j, best_v[:, -1], hot)
        del bounds  # free before `_settle`, whose blocks take its place
        self._settle(q, start, pool, best_v[:, -1].clone(), best_v, best_i, buf)

    def _rank_fast(self, q: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor, buf: torch.Tensor) -> None:
        """ "fast": rank by the half scores of centred queries plus the float32 bias (the l2
        column and the centre's products, as the certified search forms them), with no bound:
        approximate, but as close to float32 as the half product can be made."""
        half = self._half_query(q, bound=False)
        qh = half.rows
        sides = self._sides(half.centre, bound=False)
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        c_merge = self._native(best_v, best_i)
        for j in range(0, self.nb, self.tile_b):
            n = min(self.tile_b, self.nb - j)
            s, _, bias = self._block(qh, j, n, out=buf[: qh.shape[0] * n].view(-1, n), sides=sides)
            if c_merge:
                native.merge(s, j, best_v, best_i, bias=bias)
            else:
                self.merge(s if bias is None else s.to(self.dtype).add_(bias), j, best_v, best_i)

    def _native_certified(self, best_v: torch.Tensor, best_i: torch.Tensor) -> bool:
        """Whether each tile's bounds, merge and listing run as one C call
        (:class:`densematch.kernels.native.CertifiedStep`): bfloat16 products on a CPU."""
        return self.half == torch.bfloat16 and self.ops.c and best_v.is_contiguous() and best_i.is_contiguous()

    def _rank_native(
        self,
        q: torch.Tensor,
        half: _QueryHalf,
        sides: Callable[[int, int], _Tile],
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        start: int,
        buf: torch.Tensor,
    ) -> None:
        """:meth:`rank` with one C call per tile for the bounds, the merge of the lower bounds
        and the listing of the candidates, after the tile's bfloat16 product (``half``: the
        query rows as :meth:`_half_query` made them). With grouped references, each tile's group
        bounds come from the query rows in float32 (:func:`densematch.precision.group_terms`).

        Rows over the cap are searched again in float32 (:meth:`_search_again`), so their
        products are wasted: once a quarter of the rows still listing have gone over, the
        others go on alone (their products, bounds, top-k and lists gathered; written back
        before the next gathering and at the end). Which rows go over depends on the data, never
        on time, and no answer depends on it."""
        m = best_v.shape[0]
        listed = native.Candidates(m, self.cap_rows, self.dtype)
        rows: torch.Tensor | None = None  # the rows still listing, where not all
        qh, qt, centred = half.rows, half.terms, half.centred
        assert qt is not None and half.norms is not None
        gq = None
        if self.centres is not None:  # and the rounding of adding a group's product to each bound
            qt = qt * (1.0 + 2 * _GROUP_ROUNDING)
            gq = group_terms(centred, self._body(q), norms=half.norms)
        step = native.CertifiedStep(best_v, best_i, qt, self.rounding, listed, gq)
        part = (qh, best_v, best_i, listed, centred, step)
        products = None if self.centres is None else _GroupProducts(self.centres, self.tile_b)

        def put_back() -> None:
            if rows is not None:
                best_v[rows], best_i[rows] = part[1], part[2]
                listed.put(rows, part[3])

        for j in self._tile_order(start, m):
            n = min(self.tile_b, self.nb - j)
            ph, _, _, pl, pc, step = part
            s, planes, bias = self._block(ph, j, n, out=buf[: ph.shape[0] * n].view(-1, n), sides=sides)
            assert planes is not None
            groups = None
            if products is not None and self.group_norms is not None:
                first, last = j // native.GROUP, (j + n - 1) // native.GROUP + 1
                groups = (products(pc, first, last), self.group_norms[first:last])
            gone = step(s, j, planes, bias, groups)
            if gone and 4 * gone >= ph.shape[0]:
                put_back()
                keep = (~pl.over).nonzero().squeeze(1)
                rows = keep if rows is None else rows[keep]
                pv, pi, pl = best_v[rows], best_i[rows], listed.take(rows)
                step = native.CertifiedStep(pv, pi, qt[rows], self.rounding, pl, None if gq is None else gq[rows])
                part = (qh[rows], pv, pi, pl, centred[rows], step)
                if products is not None:
                    products.take(keep)
        put_back()
        self._settle(q, start, listed, best_v[:, -1].clone(), best_v, best_i, buf)

    def _tile_order(self, start: int, m: int) -> list[int]:
        """The reference tiles for the query tile at ``start`` (``m`` rows), nearest first to
        where its rows sit in the query rows' order, scaled to the references'. Two views of one
        scene (stereo, flow, video, overlapping crops) have their matches there, so the floors
        rise from the first tile and fewer candidates are listed against low ones. Any order
        gives the same answer: the floors' values do not depend on it, and the candidates are
        re-scored whatever their order."""
        tiles = range(0, self.nb, self.tile_b)
        na = self.a.shape[0] if self.rows_a is None else self.rows_a.numel()
        centre = (start + m / 2) * self.nb / max(na, 1)
        return sorted(tiles, key=lambda j: abs(j + min(self.tile_b, self.nb - j) / 2 - centre))

    def _search_again(
        self, q: torch.Tensor, redo: torch.Tensor, start: int, best_v: torch.Tensor, best_i: torch.Tensor
    ) -> None:
        """The top k of the rows ``redo`` of the query tile at ``start`` (``q``: its prepared
        rows), whose candidates outgrew the cap, searched again from float32 products: in groups
        of :meth:`_resolve_shape`, each reference block one matrix product (a handful of rows: all
        of them against every reference at once, uncapped), near-ties settled by the direct form
        (:meth:`Strategy._rank_exact`). A row over the cap costs about one float32 product row,
        never a direct score per pair inside the half-precision bound."""
        k, r = best_v.shape[1], redo.numel()
        rows, cols = self._resolve_shape(q.shape[0])
        room = int(_UNCAPPED_SHARE * q.shape[0] * self.cap_rows)
        if r * self.nb <= min(rows * cols, room):
            # a few rows: every reference in one product, every candidate listed (no cap to
            # outgrow, so no second pass), within the bytes of the block and a share of the
            # tile's list
            group, width, cap = r, self.nb, self.nb
        else:
            # the same share of the list among the group's rows: rows that outgrew the half
            # bound's cap often outgrow float32's too (a smooth region's near-ties), and each
            # one resolved costs a second float32 pass over every reference
            group, width = self._groups(q.shape[0], r)
            cap = min(self.nb, max(self.cap_rows, room // group))
        block = torch.empty(group * width, dtype=self.dtype, device=q.device)
        for g in range(0, r, group):
            sel = redo[g : g + group]
            v = torch.empty((sel.numel(), k), dtype=self.dtype, device=q.device)
            i = torch.empty((sel.numel(), k), dtype=torch.int64, device=q.device)
            self._rank_exact(q.index_select(0, sel), sel, v, i, start, block, width, cap)
            best_v[sel], best_i[sel] = v, i

    def _settle(
        self,
        q: torch.Tensor,
        start: int,
        listed: CandidateList,
        floor: torch.Tensor,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        buf: torch.Tensor,
    ) -> None:
        """Re-score the candidates ``listed`` of the query tile at ``start`` that reach their
        row's ``floor`` by the metric's direct form in the compute dtype into the running top-k,
        and resolve the rows over the cap (prepared rows of ``q``) without one."""
        m = best_v.shape[0]
        rows, cols = listed.reaching(floor)
        over = listed.over
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        score = self._direct_scores(start, rows, cols, buf)
        self._best_of(rows, cols, score, best_v, best_i)
        redo = over.nonzero().squeeze(1)
        if redo.numel():
            self._search_again(q, redo, start, best_v, best_i)
        self._record(m, rows, redo)


class _GroupProducts:
    """Query rows' float32 products with the reference groups' centres, made a block of
    :meth:`span` groups at a time: one matrix product per block rather than one per tile, whose
    few columns (a tile's 16 groups) ran at about half the product's speed. Tiles are visited
    outward from the query tile's place on both sides (:meth:`HalfSearch._tile_order`), so with
    the two blocks last used kept, each block is made once."""

    def __init__(self, centres: torch.Tensor, tile_b: int) -> None:
        self.centres, self.size = centres, self.span(tile_b)
        self.kept: dict[int, torch.Tensor] = {}

    @staticmethod
    def span(tile_b: int) -> int:
        """Groups per block: a reference tile's columns' worth (32 tiles of groups)."""
        return max(1, tile_b)

    def __call__(self, rows: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """The products (m, last - first) of ``rows`` (m, C) with the centres of groups
        first:last, from a kept block where they lie in one."""
        block = first // self.size
        start = block * self.size
        if last > start + self.size:  # across two blocks: never a search's tile (32 to a block)
            return rows @ self.centres[first:last].T
        got = self.kept.pop(block, None)
        if got is None:
            got = rows @ self.centres[start : start + self.size].T
            if len(self.kept) == 2:
                self.kept.pop(next(iter(self.kept)))
        self.kept[block] = got  # the most recently used last
        # a tile's own copy: the C step reads it row after row, as it reads the tile's scores
        return got[:, first - start : last - start].contiguous()

    def take(self, keep: torch.Tensor) -> None:
        """Keep only the rows ``keep`` of every kept block (the rows still listing)."""
        self.kept = {block: got.index_select(0, keep) for block, got in self.kept.items()}
